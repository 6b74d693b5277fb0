"""Pass contract and what every pass shares: options, the decision log, and slot helpers.

A pass is ``call(model, ctx) -> PassResult``; ``modified`` is honest, so a second run of the
whole pipeline on its own output can be checked to report ``modified=False``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Collection, Iterable

from ..decisions import Category, DecisionLog, Precision
from ..ir import DType, Graph, Model, Node, Value, verify

if TYPE_CHECKING:
    from ..rulebook import RuleBook


@dataclass
class Options:
    target: str = "fp16"  # fp16 | bf16
    keep_io_types: bool = True
    training: bool = False
    placement: str = "optimal"  # optimal | greedy
    provider: str | None = None  # kernel table to check against (defaults to the rule set's)
    loss: str | None = None  # training: name of the loss value
    verify_each: bool = False
    fuse: bool = True  # fuse decomposed LayerNorm/RMSNorm/tanh-GELU into fused ops (ONNX; frontends/onnx_fuse.py)
    inline_functions: bool = True  # inline model-local functions before rewriting (ONNX; frontends/onnx_functions.py)


# the low types' largest finite values: constants past them keep their readers FP32
# (onnx_constants), and a value that may hold one cast at run time is clamped to them first
# (place_casts)
LOW_LIMITS = {DType.FLOAT16: 65504.0, DType.BFLOAT16: 3.3895313892515355e38}


def lost_epsilon(values, rounded) -> float | None:
    """Of a constant that keeps a sum or a bound away from zero (an epsilon, a clamp's lower bound),
    given as a numpy array and as the low type rounds it: the largest magnitude the low type
    flushes to 0 where that loses the guard, else None. Lost: every nonzero value, or some of a
    one-signed constant (a per-channel epsilon [1e-8, 1e-3]: its 1e-8 lanes give 0/0 all the
    same); a constant of both signs with a tiny entry (a bias, a position table) is data. Both
    frontends ask (onnx_constants._vanishes, fx_loader._lost_epsilon)."""
    import numpy as np

    nonzero = values != 0
    kept = values[nonzero]
    if kept.size == 0 or not np.isfinite(kept).all():
        return None
    lost = kept[rounded[nonzero] == 0]
    if lost.size and (lost.size == kept.size or (kept > 0).all() or (kept < 0).all()):
        return float(np.abs(lost).max())
    return None


# the largest rounding error, relative to the value, of a number kept to 7 significant bits (bf16's
# precision): a normal number of either low type rounds better (2^-11 for FP16, 2^-8 for BF16), a
# subnormal worse the smaller it is (FP16: 1e-5 is 0.14% off, 1e-6 1.3%, 1e-7 19%)
COARSE_LIMIT = 2.0 ** -7


def coarse_rounding(values, rounded) -> tuple[float, float] | None:
    """Of a constant factor, given as a numpy array and as the low type rounds it: (its value of
    largest magnitude, the error) where its largest rounding error, relative to its largest
    magnitude, is over :data:`COARSE_LIMIT` (a scale of 1e-7 held as an FP16 subnormal, 1.19e-7),
    else None. A tensor of larger values with a few tiny entries is not (their products are as
    small as their errors). Both frontends ask (onnx_constants._coarse_factor, fx_loader)."""
    import numpy as np

    values = np.asarray(values, np.float64).reshape(-1)
    finite = np.isfinite(values)
    values, rounded = values[finite], np.asarray(rounded, np.float64).reshape(-1)[finite]
    if not values.size:
        return None
    index = int(np.argmax(np.abs(values)))
    largest = float(abs(values[index]))
    if largest == 0.0 or largest >= 1e8:  # (a mask sentinel: saturated, it still masks)
        return None
    error = float(np.abs(rounded - values).max()) / largest
    return (float(values[index]), error) if error > COARSE_LIMIT else None


@dataclass
class Context:
    rules: "RuleBook"
    options: Options
    log: DecisionLog = field(default_factory=DecisionLog)

    @property
    def low(self) -> DType:
        return DType.BFLOAT16 if self.options.target == "bf16" else DType.FLOAT16


@dataclass
class PassResult:
    name: str
    modified: bool


Pass = Callable[[Model, Context], PassResult]


def run_passes(model: Model, ctx: Context, passes: Iterable[Pass]) -> list[PassResult]:
    results = []
    for p in passes:
        results.append(p(model, ctx))
        if ctx.options.verify_each:
            verify(model.graph)
    return results


def loss_tail(graph: Graph, loss: Value, rules: "RuleBook") -> list[Node]:
    """The nodes of ``graph`` that feed ``loss`` with no allow op between them and it, in graph
    order: the loss's FP32 island in a training graph (what a loss needs is computed in FP32).
    A node a user's node pattern in ``rules`` pins low (``--fp16-nodes``) counts as an allow op:
    the user asked for it low, and the island's own FP32 pin would silently beat theirs."""
    if loss.producer is None:
        return []
    ancestors: dict[int, Node] = {}
    stack = [loss.producer]
    while stack:
        node = stack.pop()
        if id(node) in ancestors or node.graph is not graph:
            continue
        ancestors[id(node)] = node
        stack.extend(v.producer for v in node.inputs if v is not None and v.producer is not None)
    low_rules = any(rule.precision is Precision.LOW for rule in rules.node_rules())
    names = graph_node_names(graph) if low_rules else frozenset()

    def pinned_low(node: Node) -> bool:
        rule = node_rule_of(rules, node, names) if low_rules else None
        return rule is not None and rule.precision is Precision.LOW

    allow = {i for i, n in ancestors.items()
             if rules.category_of(n.op_type, n.domain) == Category.ALLOW or pinned_low(n)}
    feeds_allow: set[int] = set()
    for node in reversed(graph.nodes):
        if id(node) not in ancestors:
            continue
        for out in node.outputs:
            if any(id(c) in ancestors and (id(c) in allow or id(c) in feeds_allow) for c in out.consumers()):
                feeds_allow.add(id(node))
    return [n for n in graph.nodes if id(n) in ancestors and id(n) not in allow and id(n) not in feeds_allow]


# -- slots: which inputs/outputs of a node are painted together ------------------------------------
def round_trip_harm(low: DType) -> str:
    """What an FP32→low→FP32 round trip with no low compute on it costs, as reasons say it."""
    if low == DType.BFLOAT16:
        return "rounds to bf16's 8 significant bits and gains nothing"
    return "overflows above 65504"


def painted_group(node: Node) -> str | None:
    """The type-constraint group painting decides for this node: the node's main group (that of
    its first float output, else of its first float input) when that group is FP32, else none.
    Other float groups (LayerNorm's U, BatchNorm-15's statistics, Resize's roi/scales,
    Attention's additive mask) keep their types: once the main group is low (a model rewritten
    before, or partly FP16 already), its FP32 mask is not the next group to paint.

    A node that keeps the types it was written with (``amp.keeps_types``: a torch op mixing float
    types, an ONNX sequence op) may have no FP32 main group; its first FP32 group is returned, so
    that its FP32 inputs stay FP32."""
    keeps = "amp.keeps_types" in node.meta
    for slots in (zip(node.output_groups, node.outputs), zip(node.input_groups, node.inputs)):
        for group, value in slots:
            if group is not None and value is not None and value.dtype is not None and value.dtype.is_float:
                if value.dtype == DType.FLOAT:
                    return group
                if not keeps:
                    return None
    return None


def given_low_type(node: Node) -> DType | None:
    """The low float type (FP16/BF16) of the node's main group when the input model already
    computes it in that type (the group painting leaves alone), else None."""
    for slots in (zip(node.output_groups, node.outputs), zip(node.input_groups, node.inputs)):
        for group, value in slots:
            if group is not None and value is not None and value.dtype is not None and value.dtype.is_float:
                return value.dtype if value.dtype in (DType.FLOAT16, DType.BFLOAT16) else None
    return None


class Slots(list):
    """Slot indices in order, with a membership test in O(1): a Concat of 32k inputs tested each of
    its slots against the list (quadratic: 16k inputs, 2 s in painting and cast placement)."""

    def __init__(self, items: Iterable[int] = ()) -> None:
        super().__init__(items)
        self._set = frozenset(self)

    def __contains__(self, slot: object) -> bool:
        return slot in self._set


def group_inputs(node: Node) -> Slots:
    group = node.meta.get("amp.group")
    if group is None:
        return Slots()
    pinned = node.meta.get("amp.pinned", ())
    return Slots(i for i, (g, v) in enumerate(zip(node.input_groups, node.inputs))
                 if g == group and v is not None and i not in pinned)


def group_outputs(node: Node) -> list[int]:
    group = node.meta.get("amp.group")
    if group is None:
        return []
    return [i for i, g in enumerate(node.output_groups) if g == group]


def precision(node: Node) -> Precision:
    return node.meta.get("amp.precision", Precision.NONE)


def category(node: Node) -> Category | None:
    return node.meta.get("amp.category")


def participates(node: Node) -> bool:
    return bool(node.meta.get("amp.participates"))


def node_rule_of(rules, node: Node, names: Collection[str] = ()):
    """The node rule forcing ``node``: by its name (an unnamed node by its label "Op:output"), its
    label, or for a body node its scope path (``If:y.then_branch/mm``); an FP32 rule matching any
    wins over a low one matching another. ``names``: :func:`node_names`."""
    if not rules.node_rules():
        return None  # (the usual case: no aliases to build)
    return rules.node_rule(aliases(node), names)


def aliases(node: Node) -> tuple[str, ...]:
    """The names a node pattern may give ``node``: its name, its label, a body node's scope path,
    and a torch node's module path and each module above it (``encoder.layer.0`` pins what runs
    in that module, ``encoder`` all of the encoder)."""
    label = node_label(node)
    path = node.meta.get("fx.module_path") or ""
    parts = path.split(".") if path else []
    modules = tuple(".".join(parts[:k]) for k in range(1, len(parts) + 1))
    return (node.name or label, label, *_scope_path(node), *modules)


BODY_SCOPE = "fx.body_scope"  # graph.meta of a torch body rewritten on its own: its path in the report


def _scope_path(node: Node) -> tuple[str, ...]:
    """A body node's name under its scope (``If:y.then_branch/mm``): a pattern may name it so
    whether or not another body uses the name (``If:y.then_branch/*`` pins one branch)."""
    if node.graph is None:
        return ()
    if node.graph.parent is None:
        # a torch higher-order op's body, rewritten on its own: its decisions join the report under
        # the body's path (true_graph_0/linear_1), which pins that branch's node alone
        scope = node.graph.meta.get(BODY_SCOPE)
        return tuple(dict.fromkeys(f"{scope}/{n}" for n in (node.name or _made_up_label(node), node_label(node)))) \
            if scope else ()
    return (f"{scope_label(node.graph)}/{node.name or _made_up_label(node)}",)


def node_names(model: Model) -> frozenset[str]:
    """Every name a node pattern may give a node of ``model`` (:func:`aliases`): a pattern equal to
    one of them names that node, not a glob (``RuleBook.node_rule``)."""
    return graph_node_names(model.graph)


def graph_node_names(graph: Graph) -> frozenset[str]:
    """:func:`node_names` of one graph and the bodies it holds."""
    return frozenset(n for node in graph.walk() for n in aliases(node) if n)


def earlier_pin(node: Node) -> str | None:
    """The source of the FP32 pin an earlier rewrite of this model gave the node (read from its
    tags: ``--fp32-nodes``, ``--fp32-ops``, ``--auto-fp32``'s pins, a rule file of the user's), which
    rewriting the output again keeps; None for none, or for a built-in rule's deny (decided afresh)."""
    source = node.meta.get("amp.kept_fp32_by")
    return source if source and is_user_source(source) else None


def is_node_source(source: str) -> bool:
    """Whether a pin's source names nodes (``--fp32-nodes``, ``--auto-fp32``'s pins, a rule file's
    ``[nodes]``), not ops (``--fp32-ops``, a rule file's op lists)."""
    if source.startswith("--"):
        return source.split()[0] not in ("--fp32-ops", "--fp16-ops")
    return source.rpartition(": ")[2].startswith("nodes")


@functools.lru_cache(maxsize=256)
def is_user_source(source: str) -> bool:
    """Whether a decision's source is the user's: a command-line flag or a rule file that is not a
    built-in set."""
    from ..rulebook import LISTS, builtin_names

    first, _, key = source.rpartition(": ")  # (the last ": ": a file's name may hold one, a key not)
    from_file = key.split(".", 1)[0].split("[", 1)[0] in (*LISTS, "nodes")
    # (a rule file's decision names "<file>: <list>.<op>"; a built-in set is "<name>.toml" exactly,
    # a user's file any other name, with or without the .toml suffix)
    return source.startswith("--") or (from_file and first.strip() not in {f"{b}.toml" for b in builtin_names()})


def node_label(node: Node) -> str:
    """A stable identifier for reports: the node name, else op and first output name (as it was
    before the rewrite renamed anything: classify fixes it in ``amp.label``)."""
    if "amp.label" in node.meta:
        return node.meta["amp.label"]
    return node.name or _made_up_label(node)


def _made_up_label(node: Node) -> str:
    """An unnamed node's label: op and first output name (``Relu:c``)."""
    return f"{node.op_type}:{node.outputs[0].name if node.outputs else ''}"


def scope_label(graph: Graph) -> str:
    """``main``, or the path of holder nodes and attribute names down to a body
    (``loop.body/If:y.then_branch``). The attribute, not the body graph's own name: both branches of
    an If may carry the same graph name."""
    parts = []
    g: Graph | None = graph
    while g is not None and g.parent is not None:
        parts.append(f"{node_label(g.parent)}.{_attribute_of(g)}")
        g = g.parent.graph
    return "/".join(reversed(parts)) or "main"


def _attribute_of(graph: Graph) -> str:
    for name, graphs in graph.parent.subgraphs.items():
        for i, sub in enumerate(graphs):
            if sub is graph:
                return name if len(graphs) == 1 else f"{name}[{i}]"
    return graph.name or "body"


def retypable_io(value: Value) -> bool:
    """Whether --no-keep-io-types may give this graph input or output the low type: a tensor. A
    sequence or optional keeps its element type (no Cast converts one), and so do a training-mode
    BatchNormalization's running statistics (``amp.keeps_io_type``: a Cast on them lets
    onnxruntime's Conv+BatchNormalization fusion, which ignores training_mode, fire)."""
    return "onnx.container" not in value.meta and "amp.keeps_io_type" not in value.meta


def string_attribute(node: Node, name: str) -> str | None:
    """An ONNX node's string attribute (the loader keeps attributes on ``node.origin``, the onnx-ir
    node), or None where it has none or it is unreadable."""
    attrs = getattr(node.origin, "attributes", None) or {}
    attr = attrs.get(name)
    try:
        return attr.as_string() if attr is not None else None
    except Exception:  # noqa: BLE001 - a malformed attribute is the loader's concern
        return None


def int_attribute(node: Node, name: str, default: int) -> int:
    """An ONNX node's int attribute (read from ``node.origin`` like ``string_attribute``), or
    ``default`` where it has none or it is unreadable."""
    attr = (getattr(node.origin, "attributes", None) or {}).get(name)
    try:
        return int(attr.as_int()) if attr is not None else default
    except Exception:  # noqa: BLE001 - an unreadable attribute: the default
        return default


def is_float32(value: Value | None) -> bool:
    return value is not None and value.dtype == DType.FLOAT


def is_noop_cast(node: Node) -> bool:
    """A standard-domain Cast to the type its input already has: it does nothing."""
    src = node.inputs[0] if node.op_type == "Cast" and node.domain in ("", "ai.onnx") and node.inputs else None
    return src is not None and src.dtype is not None and int(src.dtype) == node.attrs.get("to")


ANY_FLOAT_CONSUMERS = {"Cast", "Shape", "Size"}


def read_through_casts(value: Value, low: DType, painted: Callable[[Node, int], int | None]
                       ) -> tuple[set[int], bool]:
    """Who reads ``value`` behind a Cast out of the low type (``Cast(to=FLOAT)``, a cast to an
    integer): (the painted nodes among them, by ``painted(node, slot)``'s index; whether any other
    reader, or a graph output, takes the Cast's result as it is). A Cast reads any type and needs no
    inserted Cast, but a value painted low on its way to one of these readers passes through the
    low type and out again: round-trip checks look through the Cast to them."""
    nodes: set[int] = set()
    fixed = False
    for cast, _ in value.uses():
        if cast.domain != "" or cast.op_type != "Cast" or cast.attrs.get("to") == int(low) or not cast.outputs:
            continue
        out = cast.outputs[0]
        fixed = fixed or out.is_graph_output
        for reader, slot in out.uses():
            j = painted(reader, slot)
            if j is not None:
                nodes.add(j)
            elif not accepts_any_float(reader, slot):
                fixed = True
    return nodes, fixed


def converts_non_float(node: Node) -> bool:
    """A CastLike of a non-float tensor (ids, counts) to its float input's type: its output holds
    values FP32 has exactly and the low type may not (FP16 overflows above 65504), like an FP32
    tensor read, so the round-trip rule counts it as reading one."""
    data = node.inputs[0] if node.domain == "" and node.op_type == "CastLike" and node.inputs else None
    return data is not None and data.dtype is not None and not data.dtype.is_float


def accepts_any_float(node: Node, index: int | None = None) -> bool:
    """Cast reads any type, Shape and Size read only metadata: none of them ever needs a cast.
    Neither does CastLike's input 0 (``index``), which it casts to the type of input 1."""
    if node.domain != "":
        return False
    return node.op_type in ANY_FLOAT_CONSUMERS or (node.op_type == "CastLike" and index == 0)


def adds_a_constant(node: Node, slots: list[int]) -> bool:
    """Whether the sum ``node`` has a constant addend (an initializer or Constant; for torch, a
    literal other than ``alpha``)."""
    if any(slot != ("kwargs", "alpha") for slot, _ in node.meta.get("amp.scalars", ())):
        return True
    return any(node.inputs[k] is not None and node.inputs[k].is_constant for k in slots)
