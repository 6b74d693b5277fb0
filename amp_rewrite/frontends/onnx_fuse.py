"""Fuse decomposed normalisations and the tanh-approximated GELU into single ONNX ops.

Why: a LayerNorm or RMSNorm written as separate ops (ReduceMean, Sub, Pow, ReduceMean, Add, Sqrt,
Div, Mul, Add) squares and sums activations, which overflows FP16 and loses bits in BF16, so
painting must keep it an FP32 **island**: two Casts and an FP32 round of memory traffic per
normalisation, on every layer of a transformer. The fused kernels (LayerNormalization,
RMSNormalization, and onnxruntime's SkipLayerNormalization / SkipSimplifiedLayerNormalization)
read and write the low-precision type but keep the mean and variance in FP32 internally (the rule
files mark them ``accumulates_fp32``), so once fused the normalisation runs low precision safely
and its island, with its Casts, disappears. GPT-2's tanh-GELU holds ``x**3``, a deny op (Pow);
fused into Gelu(approximate="tanh") or FastGelu it is elementwise and bounded by its input: an
``x**3`` that overflows only saturates the tanh, whose result is then exact.

Patterns (the forms torch.onnx.export writes; ``Identity`` nodes and no-op ``Cast(to=FLOAT)`` of FP32
values are looked through, and those inside a pattern go with it)::

    LayerNorm   m = ReduceMean(x); d = x - m; v = ReduceMean(d^2)            (d^2: Pow(d, 2) or d*d)
                n = d / Sqrt(v + eps)   or   d * Reciprocal(Sqrt(v + eps))   or   d * (1 / Sqrt(v + eps))
                y = n * gamma [+ beta]
    RMSNorm     v = ReduceMean(x^2); n = x / Sqrt(v + eps) (or the same variants); y = n * gamma
    tanh-GELU   y = (x * 0.5) * (1 + Tanh((x + Pow(x, 3) * 0.044715) * sqrt(2/pi)))
                or x * (0.5 * (1 + Tanh(...)))   (torch's F.gelu(approximate="tanh") as the dynamo exporter writes it)
                or (x * (1 + Tanh(...))) * 0.5 with x * (x * x) for the cube (the TorchScript exporter's)
                or (x * 0.5) * (1 + Tanh((x * sqrt(2/pi)) * (1 + 0.044715 * x * x)))   (BLOOM's)

Fused op, the first one the model's opset has: LayerNormalization (opset 17+) or RMSNormalization
(23+) on x; else, when x is a residual sum ``Add(a, b)`` of two activations of one static shape,
com.microsoft SkipLayerNormalization / SkipSimplifiedLayerNormalization on (a, b), whose fourth
output is the sum for its other readers; else (no residual sum: T5's and Llama's first RMSNorm
reads the embedding Gather) the same skip op on (x, ConstantOfShape(Shape(x))), an exact zero
tensor, for an x of rank 2 or 3 (what the skip ops take): one fused kernel with FP32 statistics
and a zero fill instead of an FP32 island, its two Casts and seven FP32 kernels. For the GELU,
Gelu(approximate="tanh") (opset 20+), else com.microsoft FastGelu.

A pattern is left as it is (painting then makes it an FP32 island, as before) unless:
- every intermediate value is read only inside the pattern and is not a graph output;
- the reductions are over the last axis with keepdims; eps, the exponents and the GELU
  coefficients are constants of the expected values; gamma and beta are 1-D FP32 tensors
  (constants for the skip ops; LayerNormalization takes an input or a computed one too);
- the fused op has a low-precision kernel for the target at that opset (the bundled kernel table)
  and the rule set puts it in a low-capable list (normalisations: marked ``accumulates_fp32``);
- no member is named by a node rule: a user's ``--fp32-nodes`` / ``--fp16-nodes`` keeps its meaning;
- for the GELU under FP16, x's element count is known even (a dimension of x, or of the value x
  reshapes, is a known even number): onnxruntime's FP16 kernel of both fused forms leaves the last
  element of an odd count unwritten;
- the rewrite has something to do: at least one allow op (no allow op → nothing changes).

Except: a LayerNorm at opset 17 or later that one of those keeps from running low (an FP32 node
rule naming a member, the rules or the kernel table giving LayerNormalization no low form) is
fused into an FP32 LayerNormalization, Casts around it (``_kept_fp32``). Left decomposed, the
island's entry Cast is folded by onnxruntime's own LayerNormFusion into a LayerNormalization of
low-precision X and FP32 scale, and onnxruntime refuses to load the model. ``fuse=False`` still
keeps the decomposition (and meets that; tests/test_properties.py records it).

The pass lives at the ONNX edge (it reads onnx-ir attributes and constants, makes ONNX and
onnxruntime ops) and runs for the ONNX frontend before classify, is skipped for training graphs (their
backward ops read the decomposition's intermediates) and with ``fuse=False``. Every fusion is
recorded in the log (``DecisionLog.fusions``) and the fused node is named after its members'
common name prefix (``/layer.0/LayerNorm/LayerNormalization``), so name patterns still match.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Callable

import onnx

from ..decisions import CastRecord, Category, FusionRecord, Precision
from ..ir import DType, Graph, Model, Node, Value
from ..passes.base import (Context, PassResult, aliases, earlier_pin, is_noop_cast, is_user_source, node_label,
                           node_names, node_rule_of, scope_label)
from ..passes.classify import missing_low_kernel, tanh_gelu_gap
from ..passes.place_casts import Namer
from .onnx_loader import constant_array, schema_slots

MS = "com.microsoft"
_GELU_COEFFS = {"half": 0.5, "cubic": 0.044715, "scale": math.sqrt(2.0 / math.pi), "one": 1.0}
_LOW_CAPABLE = (Category.ALLOW, Category.INFER, Category.CLEAR)


@dataclass
class _Match:
    """One recognised pattern: what it reads, what it makes, and the nodes it replaces."""

    kind: str  # LayerNorm | RMSNorm | tanh-GELU
    x: Value
    out: Value
    members: list[Node]
    eps: float | None = None
    gamma: Value | None = None
    beta: Value | None = None


def fuse(model: Model, ctx: Context) -> PassResult:
    if model.frontend != "onnx" or ctx.options.training or not _has_allow_op(model, ctx):
        return PassResult("fuse", modified=False)
    if not ctx.options.fuse:
        _tag_unfused(model)
        return PassResult("fuse", modified=False)
    namer: Namer | None = None  # built at the first fusion: most models have nothing to fuse
    names: frozenset[str] | None = None
    shapes = SymbolicShapes(model)
    unfused: list[tuple[_Match, Graph]] = []
    changed = _drop_dead_noop_casts(model, ctx)
    for scope in list(model.graph.scopes()):
        nodes = list(scope.nodes)
        position = {id(n): i for i, n in enumerate(nodes)}
        gone: set[int] = set()
        for node in nodes:
            if id(node) in gone:
                continue
            match = _closed_match_at(node)
            if match is None or match.x.dtype != DType.FLOAT:
                continue  # only FP32 patterns: an FP16 one is the user's own, and typed to match
            if any(member.graph is not scope for member in match.members):
                continue  # a pattern across an If/Loop body's boundary: the fused op has one place
            if names is None:  # (node patterns match against every name of the input model)
                names = node_names(model) if ctx.rules.node_rules() else frozenset()
            # the fused form, asked once and only when needed (a skip op's shape proof is not cheap)
            choose = functools.cache(lambda: _choose(match, scope, ctx, shapes))  # noqa: B023 (used in this iteration)
            fp32 = _kept_fp32(match, scope, ctx, names, choose)
            if fp32 is None and _pinned(match, ctx, names):
                for member in match.members:  # (tagged: rewriting the output keeps the pattern unfused)
                    member.meta["amp.unfused_by_pin"] = True
                continue
            namer = namer or Namer.for_model(model)
            removed = _replace(model, scope, match, ctx, namer, position, choose(), fp32=fp32)
            if not removed:
                unfused.append((match, scope))
            if fp32 is not None and removed:  # (a pin naming a member still names something: the fused node)
                model.meta.setdefault("amp.fused_member_names", set()).update(
                    alias for member in removed for alias in aliases(member))
                model.meta.setdefault("amp.fused_member_ops", set()).update(  # (so an op flag names them)
                    (member.domain if member.domain != "ai.onnx" else "", member.op_type) for member in removed)
            gone.update(id(n) for n in removed)
            ctx.log.weights.bytes_before += _constant_bytes(removed)  # (they are gone when weights are counted)
        if gone:
            # one pass over the list, not a list.remove per node: graphs can have 100k nodes
            scope.nodes = [n for n in scope.nodes if id(n) not in gone]
            scope.sort()  # a reader of a residual sum may sit between the sum and the fused op
            changed = True
    if shapes.computed:  # for a skip proof: the optimal placement's size estimates read it too
        model.meta["amp.symbolic_shapes"] = shapes.computed
    if unfused:
        shown = "; ".join(f"{_pattern_label(match, scope)} ({match.kind}: {_why_unfused(match, scope, ctx)})"
                          for match, scope in unfused[:3])
        more = f"; and {len(unfused) - 3} more" if len(unfused) > 3 else ""
        ctx.log.notes.append(f"not fused: {len(unfused)} pattern(s) left as written: {shown}{more}")
    return PassResult("fuse", modified=changed)


def _pattern_label(match: _Match, scope: Graph) -> str:
    """The members' shared path (``/ln/``), else the first member's label in graph order and how
    many more there are."""
    prefix = _common_prefix([node_label(n) for n in match.members])
    if prefix != "amp_fused/":
        return prefix
    members = {id(n) for n in match.members}
    first = next(n for n in scope.nodes if id(n) in members)
    return f"{node_label(first)} and {len(match.members) - 1} more nodes"


def _why_unfused(match: _Match, scope: Graph, ctx: Context) -> str:
    """Why ``_choose`` found no fused form for a pattern, for the note that lists it."""
    opset = scope.opsets.get("", 0)
    if match.kind == "tanh-GELU":
        if tanh_gelu_gap("tanh-GELU", match.x, ctx.options.target):
            return "its element count is not known to be even, and the FP16 GELU kernels skip the last of an odd count"
        return f"neither Gelu (opset 20+) nor com.microsoft FastGelu has a low-precision form at opset {opset}"
    standard, since = {"LayerNorm": ("LayerNormalization", 17), "RMSNorm": ("RMSNormalization", 23)}[match.kind]
    if opset >= since:
        return f"{standard} has no low-precision form here (rules or kernel table)"
    head = f"{standard} needs opset {since} (this graph has {opset}); onnxruntime's skip ops"
    if not all(v is None or _constant(v) is not None for v in (match.gamma, match.beta)):
        return f"{head} take a constant scale and bias only, and this one's are computed"
    where = ("inside a control-flow body, where no residual sum is proven (the shape proofs are the main graph's)"
             if scope.parent is not None else "it does not follow a residual sum whose operand shapes are proven")
    rank = ("a zero skip needs ConstantOfShape (opset 9)" if opset < _ZEROS_SINCE else
            "its input's rank is not known" if match.x.shape is None else f"its input has rank {len(match.x.shape)}")
    return f"{head} need a residual sum or an input of rank 2 or 3: {where}, and {rank}"


def _constant_bytes(nodes: list[Node]) -> int:
    """Bytes of the Constant nodes' tensors among ``nodes`` (a pattern's epsilon and exponent)."""
    total = 0
    for node in nodes:
        value = node.outputs[0] if node.op_type == "Constant" and node.domain in ("", "ai.onnx") and node.outputs \
            else None
        if value is not None and value.const_numel is not None and value.dtype is not None:
            total += int(value.const_numel * value.dtype.itemsize)
    return total


def _tag_unfused(model: Model) -> None:
    """--no-fuse: the patterns stay FP32 islands, and their members are tagged so, as a pin's are
    (untagged, a rewrite of the output with the default options fused them into FP32
    SkipLayerNormalizations and kept the casts around them)."""
    for scope in model.graph.scopes():
        for node in scope.nodes:
            match = _closed_match_at(node)
            if match is not None and match.x.dtype == DType.FLOAT:
                for member in match.members:
                    member.meta.setdefault("amp.unfused_by_pin", "--no-fuse")


def _has_allow_op(model: Model, ctx: Context) -> bool:
    """Whether some node's op is an allow op that may run low: not one an earlier rewrite pinned FP32
    (its tags say so, and classify keeps the pin), unless this run's own rules name the op. Every
    MatMul pinned by --fp32-ops, the output was the input with tags; rewritten again without the flag,
    its LayerNorms were fused, FP32, and the graph changed."""
    for node in model.graph.walk():
        entry = ctx.rules.lookup(node.op_type, node.domain, node.opset)
        if entry is not None and entry.category == Category.ALLOW and (
                not earlier_pin(node) or is_user_source(entry.source)):
            return True
    return False


# -- matching --------------------------------------------------------------------------------------
def _closed_match_at(node: Node) -> _Match | None:
    """The pattern anchored at ``node`` whose intermediates nothing else reads. A LayerNorm whose
    centred ``d = x - mean`` (or mean) is read outside it falls back to the RMSNorm of ``d`` its tail
    computes: unfused, its tail was an FP32 island, and a rewrite of the output (with ``d`` made low
    by a pin, a Cast now between the Sub and the tail) fused that RMSNorm then."""
    match = _match_at(node)
    if match is not None and not _closed(match):
        match = _match_norm(node, centred=False) if match.kind == "LayerNorm" else None
        match = match if match is not None and _closed(match) else None
    return match


def _match_at(node: Node) -> _Match | None:
    if node.domain != "":
        return None
    if node.op_type == "ReduceMean":
        return _match_norm(node)
    if node.op_type in ("Pow", "Mul"):  # (a Mul anchors only as x * (x * x))
        return _match_gelu(node)
    if node.op_type == "Tanh":
        return _match_gelu_product(node)
    return None


def _cube_base(mul: Node) -> tuple[Value, Node] | None:
    """(x, the square) where ``mul`` is ``x * (x * x)`` in either order: the cube as torch's own
    tanh-GELU symbolic writes it below opset 20."""
    if len(mul.inputs) != 2:
        return None
    for a, b in (mul.inputs, mul.inputs[::-1]):
        square = _source(b).producer if b is not None else None
        x = _source(a) if a is not None else None
        if x is not None and _is(square, "Mul") and _square_base(square) is x:
            return x, square
    return None


def _match_norm(var_mean: Node, *, centred: bool = True) -> _Match | None:
    """Anchored at the variance's ReduceMean: ``ReduceMean(d^2)``. ``centred``: a ``d`` made by
    ``Sub(x, ReduceMean(x))`` makes it a LayerNorm of ``x`` (else the RMSNorm of ``d``)."""
    if not _mean_over_last_axis(var_mean):
        return None
    square = _source(var_mean.inputs[0]).producer
    d = _square_base(square)
    if d is None:
        return None
    members = [square, var_mean]
    kind, x = "RMSNorm", _source(d)
    sub = x.producer
    if centred and _is(sub, "Sub"):
        mean = _source(sub.inputs[1]).producer
        if _is(mean, "ReduceMean") and _mean_over_last_axis(mean) and \
                _source(mean.inputs[0]) is _source(sub.inputs[0]):
            kind, x = "LayerNorm", _source(sub.inputs[0])
            members += [sub, mean]
    add_eps = _only_consumer(var_mean.outputs[0], "Add")
    eps = _scalar(_other_input(add_eps, var_mean.outputs[0]), x) if add_eps else None
    sqrt = _only_consumer(add_eps.outputs[0], "Sqrt") if add_eps else None
    if eps is None or not 0 < eps < 1 or sqrt is None:
        return None
    members += [add_eps, sqrt]
    normed = _divide_by(sqrt.outputs[0], d, members)
    if normed is None:
        return None
    normed = _through_casts(normed, members)
    scaled = _only_consumer(normed, "Mul")
    gamma = _other_input(scaled, normed) if scaled else None
    if gamma is None or not _is_vector(gamma, x):
        return None
    members.append(scaled)
    out, beta = scaled.outputs[0], None
    if kind == "LayerNorm":
        shift = _only_consumer(out, "Add")
        candidate = _other_input(shift, out) if shift else None
        if candidate is not None and _is_vector(candidate, x):
            members.append(shift)
            out, beta = shift.outputs[0], candidate
    _absorb_passthroughs(x, members)
    return _Match(kind, x, out, members, eps=eps, gamma=gamma, beta=beta)


def _divide_by(root: Value, d: Value, members: list[Node]) -> Value | None:
    """``d / root``, ``d * Reciprocal(root)`` or ``d * (1 / root)``: returns the quotient. The
    ``d`` divided may be a twin of the one squared: older torch exports compute ``x - mean`` twice
    (one Sub for the Pow, one for the Div), and that island, left unfused, met onnxruntime's own
    LayerNormFusion, which folded the island's leading Cast into a LayerNormalization of FP16 X and
    FP32 scale that its type check then refused ('bound to different types')."""
    div = _only_consumer(root, "Div")
    if div is not None and _source(div.inputs[1]) is root and _same_difference(div.inputs[0], d, members):
        members.append(div)
        return div.outputs[0]
    inverse = _only_consumer(root, "Reciprocal")
    if inverse is None and div is not None and _source(div.inputs[1]) is root and _scalar(div.inputs[0], d) == 1.0:
        inverse = div
    if inverse is None:
        return None
    mul = _only_consumer(inverse.outputs[0], "Mul")
    if mul is None or not _same_difference(_other_input(mul, inverse.outputs[0]), d, members):
        return None
    members += [inverse, mul]
    return mul.outputs[0]


def _same_difference(value: Value | None, d: Value, members: list[Node]) -> bool:
    """``value`` is ``d`` (looked through no-op casts), or a second ``Sub`` of the same two
    operands as ``d``'s Sub, which then joins ``members``."""
    if value is None:
        return False
    if _source(value) is _source(d):
        return True
    twin, sub = _source(value).producer, _source(d).producer
    if not (_is(twin, "Sub") and _is(sub, "Sub") and sub in members) or twin in members:
        return False
    if len(twin.inputs) != 2 or any(_source(a) is not _source(b) for a, b in zip(twin.inputs, sub.inputs)):
        return False
    members.append(twin)
    return True


def _match_gelu(cube: Node) -> _Match | None:
    """Anchored at ``Pow(x, 3)`` or ``x * (x * x)``; the coefficients must be GPT-2's (``gelu_new``)."""
    if cube.op_type == "Mul":
        base = _cube_base(cube)
        if base is None:
            return None
        x, square = base
        members = [square, cube]
    else:
        x = _source(cube.inputs[0])
        if x is None or _scalar(cube.inputs[1], x) != 3.0:
            return None
        members = [cube]
    steps = [("Mul", "cubic"), ("Add", None), ("Mul", "scale"), ("Tanh", None), ("Add", "one")]
    value = cube.outputs[0]
    for op, coeff in steps:
        node = _only_consumer(value, op)
        if node is None:
            return None
        if coeff is not None and not _close(_scalar(_other_input(node, value), x), _GELU_COEFFS[coeff]):
            return None
        if op == "Add" and coeff is None and _source(_other_input(node, value)) is not x:
            return None
        members.append(node)
        value = node.outputs[0]
    return _gelu_tail(x, value, members)


def _match_gelu_product(tanh: Node) -> _Match | None:
    """Anchored at the Tanh of ``Tanh((x * c) * (1 + 0.044715 * x * x))``, the same function as
    GPT-2's with the cube factored (BLOOM's ``bloom_gelu_forward``): its ``x * x`` products run
    past FP16's range where the fused kernel's result is exact."""
    prod = _source(tanh.inputs[0]).producer if tanh.inputs and tanh.inputs[0] is not None else None
    if not _is(prod, "Mul") or len(prod.inputs) != 2 or any(v is None for v in prod.inputs):
        return None
    for left, right in (prod.inputs, prod.inputs[::-1]):
        scale, poly = _source(left).producer, _source(right).producer
        x = _scaled(scale, "scale")
        if x is None or not _is(poly, "Add") or len(poly.inputs) != 2 or any(v is None for v in poly.inputs):
            continue
        for quad, one in (poly.inputs, poly.inputs[::-1]):
            if not _close(_scalar(one, x), _GELU_COEFFS["one"]):
                continue
            quadratic = _quadratic(_source(quad).producer, x)
            if quadratic is None:
                continue
            members = [scale, *quadratic, poly, prod, tanh]
            add = _only_consumer(tanh.outputs[0], "Add")
            if add is None or not _close(_scalar(_other_input(add, tanh.outputs[0]), x), _GELU_COEFFS["one"]):
                return None
            members.append(add)
            return _gelu_tail(x, add.outputs[0], members)
    return None


def _scaled(node: Node | None, coeff: str) -> Value | None:
    """x where ``node`` is ``x * k`` (either order) with k the GELU coefficient ``coeff``."""
    if not _is(node, "Mul") or len(node.inputs) != 2 or any(v is None for v in node.inputs):
        return None
    for a, b in (node.inputs, node.inputs[::-1]):
        if _constant(a) is None and _close(_scalar(b, a), _GELU_COEFFS[coeff]):
            return _source(a)
    return None


def _quadratic(node: Node | None, x: Value) -> list[Node] | None:
    """The nodes of ``0.044715 * x * x`` at ``node``: ``(x * k) * x`` in any order, or ``(x * x) * k``."""
    if not _is(node, "Mul") or len(node.inputs) != 2 or any(v is None for v in node.inputs):
        return None
    for a, b in (node.inputs, node.inputs[::-1]):
        inner = _source(b).producer
        if _source(a) is x and _scaled(inner, "cubic") is x:
            return [inner, node]
        if _close(_scalar(a, x), _GELU_COEFFS["cubic"]) and _is(inner, "Mul") and _square_base(inner) is x:
            return [inner, node]
    return None


def _gelu_tail(x: Value, value: Value, members: list[Node]) -> _Match | None:
    """The end of a tanh-GELU from ``value = 1 + tanh(...)``: times x and 0.5 in one of the orders
    the exporters write."""
    final = _only_consumer(value, "Mul")
    other = _other_input(final, value) if final else None
    if other is None:
        return None
    half_node = _source(other).producer
    if _is(half_node, "Mul") and any(_source(v) is x for v in half_node.inputs) and \
            _close(_scalar(_other_input(half_node, x), x), _GELU_COEFFS["half"]):
        members += [half_node, final]  # (x * 0.5) * (1 + tanh(...)): GPT-2's gelu_new
        _absorb_passthroughs(x, members)
        return _Match("tanh-GELU", x, final.outputs[0], members)
    outer = _only_consumer(final.outputs[0], "Mul")
    if _close(_scalar(other, x), _GELU_COEFFS["half"]) and outer is not None \
            and _source(_other_input(outer, final.outputs[0])) is x:
        members += [final, outer]  # x * (0.5 * (1 + tanh(...))): torch's F.gelu(approximate="tanh")
        _absorb_passthroughs(x, members)
        return _Match("tanh-GELU", x, outer.outputs[0], members)
    if _source(other) is x and outer is not None \
            and _close(_scalar(_other_input(outer, final.outputs[0]), x), _GELU_COEFFS["half"]):
        members += [final, outer]  # (x * (1 + tanh(...))) * 0.5: the TorchScript exporter's, below opset 20
        _absorb_passthroughs(x, members)
        return _Match("tanh-GELU", x, outer.outputs[0], members)
    return None


# -- the fused op ------------------------------------------------------------------------------------
def _choose(match: _Match, scope: Graph, ctx: Context,
            shapes: SymbolicShapes) -> tuple[str, str, list[Value | None], dict] | None:
    """(domain, op, inputs, attrs) of the first fused form the model's opsets and the target allow."""
    opset = scope.opsets.get("", 0)
    standard_since = {"LayerNorm": 17, "RMSNorm": 23}.get(match.kind)
    if standard_since and opset < standard_since and not all(
            v is None or _constant(v) is not None for v in (match.gamma, match.beta)):
        return None  # (the skip ops are chosen for a constant scale and bias only)
    skip = _residual_operands(match.x, scope, shapes) if standard_since and opset < standard_since else None
    if standard_since and opset < standard_since and skip is None and _zero_skip_rank(match.x, scope, shapes) \
            and opset >= _ZEROS_SINCE:
        skip = [match.x, _ZERO_SKIP]  # no residual sum to take over: the skip op adds zeros
    if match.kind == "tanh-GELU":
        if tanh_gelu_gap("tanh-GELU", match.x, ctx.options.target):
            return None  # (its FP16 kernel skips the last element of an odd count: classify's tanh_gelu_gap)
        forms = [("", "Gelu", 20, [match.x], {"approximate": "tanh"}), (MS, "FastGelu", 1, [match.x], {})]
    elif match.kind == "LayerNorm":
        forms = [("", "LayerNormalization", 17, [match.x, match.gamma, match.beta],
                  {"axis": -1, "epsilon": match.eps})]
        if skip:
            forms.append((MS, "SkipLayerNormalization", 1, [*skip, match.gamma, match.beta], {"epsilon": match.eps}))
    else:
        forms = [("", "RMSNormalization", 23, [match.x, match.gamma], {"axis": -1, "epsilon": match.eps})]
        if skip:
            forms.append((MS, "SkipSimplifiedLayerNormalization", 1, [*skip, match.gamma], {"epsilon": match.eps}))
    for domain, op, since, inputs, attrs in forms:
        version = opset if domain == "" else scope.opsets.get(domain, 1)
        if version >= since and _low_capable(ctx, op, domain, version, norm=match.kind != "tanh-GELU"):
            while inputs and inputs[-1] is None:
                inputs.pop()
            return domain, op, inputs, attrs
        if version >= since and _op_flag_entry(ctx, op, domain, version) is not None:
            # (an --fp32-ops naming the fused op declined it: the flag changed the model, though the
            # op it names is not in the output; classify's unmatched-flag note asks)
            shapes.model.meta.setdefault("amp.fusion_declined_ops", set()).add((domain, op))
    return None


def _op_flag_entry(ctx: Context, op: str, domain: str, opset: int | None):
    """The ``--fp32-ops`` / ``--fp16-ops`` entry naming ``op``, or None."""
    entry = ctx.rules.lookup(op, domain, opset)
    return entry if entry is not None and entry.reason.startswith("command line: --") else None


def _low_capable(ctx: Context, op: str, domain: str, opset: int, *, norm: bool) -> bool:
    entry = ctx.rules.lookup(op, domain, opset)
    # (an allow entry, a user's "always low", needs no accumulates_fp32 flag: classify makes the op low
    # either way, and a fused LayerNorm kept FP32 for the missing flag went low in a rewrite of the output)
    if entry is None or entry.category not in _LOW_CAPABLE or (
            norm and entry.category != Category.ALLOW and not entry.accumulates_fp32):
        return False
    return missing_low_kernel(ctx, op, domain, opset) is None


def _replace(model: Model, scope: Graph, match: _Match, ctx: Context, namer: Namer,
             position: dict[int, int], chosen: tuple | None, *, fp32: tuple[str, str] | None = None) -> list[Node]:
    """Put the fused op in place of the pattern; returns the nodes it replaces (none if no fused
    form is available). ``chosen``: ``_choose``'s form. ``fp32``: (reason, source) of a LayerNorm
    fused to stay FP32 (``_kept_fp32``), which takes the standard LayerNormalization whatever was chosen."""
    if fp32 is not None:
        chosen = ("", "LayerNormalization", [v for v in (match.x, match.gamma, match.beta) if v is not None],
                  {"axis": -1, "epsilon": match.eps})
    if chosen is None:
        return []
    domain, op, inputs, attrs = chosen
    zero_skip = any(v is _ZERO_SKIP for v in inputs)
    # the residual Add taken over
    total = match.x.producer if domain == MS and op.startswith("Skip") and not zero_skip else None
    removed = list(match.members) + ([total] if total is not None else [])
    # The outputs take over the names of the values they replace: a graph output keeps its name.
    outputs = [Value(match.out.name, match.out.dtype, match.out.shape)]
    readers = [(n, i) for n, i in total.outputs[0].uses() if n not in removed] if total is not None else []
    if readers:  # others read the residual sum: the skip op's 4th output (mean, inv_std_var unused)
        total_out = total.outputs[0]
        outputs += [Value(""), Value(""), Value(total_out.name, total_out.dtype, total_out.shape)]
    label = _common_prefix([node_label(n) for n in removed])
    anchor = max(removed, key=lambda n: position[id(n)])
    if zero_skip:
        inputs = list(inputs)
        inputs[1], made = _zeros_like(match.x, scope, label, namer, ctx.low)
        for extra in made:
            scope.insert_after(anchor, extra)
            anchor = extra
    node = Node(op, inputs, domain=domain, name=namer(label + op), attrs=attrs, outputs=outputs)
    node.opset = scope.opsets.get(domain, 1)
    # com.microsoft ops have no onnx schema: all their slots are one group ("?"), which is right for
    # these (every data input and every output used shares type T)
    schema_slots(op, domain, node.opset, len(inputs), len(outputs)).apply(node)
    scope.insert_after(anchor, node)
    match.out.replace_all_uses_with(outputs[0])
    for reader, index in readers:
        reader.set_input(index, outputs[3])
    read = [v for member in removed for v in member.inputs if v is not None]
    for member in removed:
        member.detach()
        member.graph = None
    # a Constant node only the pattern read (its eps, its exponent 2) goes with it, and so do the
    # Identity nodes it was read through; so does such an initializer, in the emitter (marked here,
    # so the weight counts leave it out)
    while read:
        value = read.pop()
        if value.has_uses() or value.is_graph_output:
            continue
        if value.is_initializer and not value.is_graph_input:
            value.meta["amp.dropped_unread"] = True
        producer = value.producer
        if (_is(producer, "Constant") or _is(producer, "Identity")) and producer.graph is scope:
            read += [v for v in producer.inputs if v is not None]
            producer.detach()
            producer.graph = None
            removed.append(producer)
    model.meta.setdefault("amp.removed_nodes", []).extend(removed)
    if domain and domain not in model.opsets:
        model.opsets[domain] = 1
        for graph in model.graph.scopes():
            graph.opsets.setdefault(domain, 1)
    reason = _REASONS[match.kind] + (_ZERO_SKIP_REASON if zero_skip else "")
    if fp32 is not None:
        node.meta["amp.fused_fp32"] = fp32
        reason = f"decomposed LayerNorm fused to stay FP32 ({fp32[0]}): {_FP32_FUSION}"
    ctx.log.fusions.append(FusionRecord(node=node.name, op=node.qualified_op, pattern=match.kind,
                                        members=[node_label(n) for n in removed], reason=reason,
                                        casts=sum(1 for n in removed if n.op_type == "Cast" and n.domain in ("", "ai.onnx"))))
    return removed


# Stands for the zero skip input in a chosen form until ``_replace`` makes it.
_ZERO_SKIP = Value("<zeros like the input>")


_ZEROS_SINCE = 9  # ConstantOfShape, which makes the zero skip, is an opset 9 op


def _zero_skip_rank(x: Value, scope: Graph, shapes: SymbolicShapes) -> bool:
    """The skip ops take a (batch, sequence, hidden) or (tokens, hidden) input. Where onnx's
    inference as the loader ran it gave x no shape (an opset-13 Reshape to a computed shape), the
    main graph's shape tables may know its rank (onnx's with data propagation, then onnxruntime's):
    x is given that many unknown dims, a fact whichever table gave it (merged symbols change
    dims, not ranks)."""
    if x.shape is None and scope.parent is None:
        for table in shapes.tables():
            found = table.shapes.get(x.name)
            if found is not None:
                x.shape = (None,) * len(found)
                break
    return x.shape is not None and len(x.shape) in (2, 3)


def _zeros_like(x: Value, scope: Graph, label: str, namer: Namer, low: DType) -> tuple[Value, list[Node]]:
    """``ConstantOfShape(Shape(x))``: an FP32 zero tensor of x's shape (its ``value`` attribute is
    written in whatever type painting gives it). Adding exact zeros changes nothing, so the skip op
    computes the normalisation of x alone. Where ConstantOfShape's schema has no ``low`` output
    (bfloat16 below opset 20) it would stay FP32 and take the skip op with it, so the zeros are
    ``Expand(Constant(0.0), Shape(x))`` instead (both take bfloat16 from opset 13)."""
    opset = scope.opsets.get("", 0)
    dims = Value(namer(label + "zero_skip_shape"), DType.INT64, (len(x.shape),))
    zeros = Value(namer(label + "zero_skip"), DType.FLOAT, x.shape)
    made = [Node("Shape", [x], name=namer(label + "zero_skip/Shape"), outputs=[dims])]
    if _constant_of_shape_takes(low, opset) or opset < 13:  # (below 13 nothing is bfloat16: no Cast makes it)
        made.append(Node("ConstantOfShape", [dims], name=namer(label + "zero_skip/ConstantOfShape"), outputs=[zeros]))
    else:
        zero = Value(namer(label + "zero_skip_value"), DType.FLOAT, ())
        zero.const_numel = 1
        zero.meta["amp.made_by_fusion"] = True  # (not in the input: the weight counts leave it out before)
        made += [Node("Constant", [], name=namer(label + "zero_skip/Constant"), attrs={"value_float": 0.0},
                      outputs=[zero]),
                 Node("Expand", [zero, dims], name=namer(label + "zero_skip/Expand"), outputs=[zeros])]
    for node in made:
        node.opset = opset
        schema_slots(node.op_type, "", node.opset, len(node.inputs), 1).apply(node)
    return zeros, made


def _constant_of_shape_takes(low: DType, opset: int) -> bool:
    return ("bfloat16" if low == DType.BFLOAT16 else "float16") in \
        schema_slots("ConstantOfShape", "", opset, 1, 1).group_types.get("T2", ())


_REASONS = {
    "LayerNorm": "decomposed LayerNorm fused: the fused kernel keeps mean and variance in FP32, so it can run low "
                 "precision without the FP32 island the separate ops need",
    "RMSNorm": "decomposed RMSNorm fused: the fused kernel keeps the mean of squares in FP32, so it can run low "
               "precision without the FP32 island the separate ops need",
    "tanh-GELU": "tanh-approximated GELU fused: elementwise and bounded by its input (an x^3 that overflows "
                 "only saturates the tanh), so the Pow no longer forces an FP32 island",
}
_ZERO_SKIP_REASON = ("; with no residual sum to take over and no standard fused op at this opset, the skip "
                     "op adds a zero tensor (ConstantOfShape(Shape(x))), which changes no value")


# -- conditions ----------------------------------------------------------------------------------------
def _closed(match: _Match) -> bool:
    """Every value made inside the pattern is read only inside it (and is no graph output)."""
    inside = {id(n) for n in match.members}
    for member in match.members:
        for value in member.outputs:
            if value is match.out:
                continue
            if value.is_graph_output or any(id(n) not in inside for n in value.consumers()):
                return False
    return True


_FP32_FUSION = ("left decomposed, its island is entered through a Cast that onnxruntime's own LayerNormFusion "
                "folds into a LayerNormalization of low-precision X and FP32 scale, which onnxruntime then refuses "
                "to load ('bound to different types'); fused here, it computes the same in FP32")


def _kept_fp32(match: _Match, scope: Graph, ctx: Context, names: frozenset[str],
               choose: Callable[[], tuple | None]) -> tuple[str, str] | None:
    """(reason, source) where a LayerNorm that will not run low is to be fused anyway, into an FP32
    LayerNormalization: at opset 17 and later, where onnxruntime fuses the decomposition itself
    (folding the Cast into the island into a node it then refuses), when a user's FP32 node pin
    names a member, or the rules or kernel table give the fused op no low form (``--fp32-ops
    LayerNormalization``). A low pin on a member, or a pattern an earlier rewrite left unfused,
    keeps it as it is."""
    if match.kind != "LayerNorm" or scope.opsets.get("", 0) < 17 or any(
            n.meta.get("onnx.unfused") for n in match.members):
        return None
    rules = [rule for rule in (node_rule_of(ctx.rules, n, names) for n in match.members) if rule is not None]
    if any(rule.precision != Precision.FP32 for rule in rules):
        return None
    if rules:
        return f"node rule {rules[0].pattern!r} names its member, keeping it FP32", rules[0].source
    flagged = [(n, e) for n in match.members if (e := _op_flag(n, ctx)) is not None]
    if any(e.category in _LOW_CAPABLE for _, e in flagged):
        return None
    if flagged:
        member, entry = flagged[0]
        return f"{entry.source} {member.op_type!r} names its member {node_label(member)}, keeping it FP32", entry.source
    pins = [earlier_pin(n) for n in match.members if earlier_pin(n)]
    if pins:
        return f"an earlier rewrite pinned a member FP32 ({pins[0]})", pins[0]
    if choose() is None:  # (``_choose``'s form for it: none low)
        entry = ctx.rules.lookup("LayerNormalization", "", scope.opsets.get("", 0))
        if entry is not None and entry.category not in _LOW_CAPABLE:
            return f"the rules keep LayerNormalization FP32: {entry.reason}", entry.source
        missing = missing_low_kernel(ctx, "LayerNormalization", "", scope.opsets.get("", 0))
        return (missing or "LayerNormalization has no low-precision form here"), "kernel table"
    return None


def _drop_dead_noop_casts(model: Model, ctx: Context) -> bool:
    """Remove Casts to the type their input has whose output nothing reads: cast placement removes
    them anyway, after this pass. Left here, such a Cast of a pattern's value counted as a reader
    outside the pattern and kept it unfused, and the rewrite of the output (the Cast gone) fused
    it: rewriting the output again changed it. Each is recorded as removed, as cast placement
    records those it removes."""
    dropped = False
    for scope in model.graph.scopes():
        dead = [n for n in scope.nodes
                if is_noop_cast(n) and not any(o.has_uses() or o.is_graph_output for o in n.outputs)]
        for node in dead:
            src, out = node.inputs[0], node.outputs[0]
            ctx.log.casts.append(CastRecord(
                name=node.name or out.name, tensor=src.name, src=src.dtype.short, dst=src.dtype.short,
                producer=node_label(src.producer) if src.producer is not None else None, consumers=[],
                shape=src.shape, numel=src.numel, scope=scope_label(scope),
                reason=f"casts a {src.dtype.short} value to {src.dtype.short} and nothing reads it: removed",
                kind="removed"))
            scope.remove(node)
            model.meta.setdefault("amp.removed_nodes", []).append(node)  # (the emitter drops its origin)
            dropped = True
    return dropped


def _pinned(match: _Match, ctx: Context, names: frozenset[str]) -> bool:
    """A node rule or an op flag names a member, an earlier rewrite pinned one FP32, or an earlier
    rewrite left the pattern (or a larger one around it) unfused for such a pin: it stays unfused."""
    return any(node_rule_of(ctx.rules, n, names) is not None or _op_flag(n, ctx) is not None or earlier_pin(n)
               or n.meta.get("onnx.unfused") for n in match.members)


def _op_flag(node: Node, ctx: Context):
    """The ``--fp32-ops`` / ``--fp16-ops`` entry naming ``node``'s op, or None. It pins the pattern
    as a node rule on that member does: fused, the member was gone, the flag silently pinned
    nothing, and the summary called its op one the model does not have. (A rule file's entries
    are not pins: they classify ops, and the fused op has its own.)"""
    return _op_flag_entry(ctx, node.op_type, node.domain, node.opset)


def _residual_operands(x: Value, scope: Graph, shapes: "SymbolicShapes") -> list[Value] | None:
    """[input, skip] when x = Add(a, b) sums FP32 tensors whose shapes are proven to be what the
    skip ops take: ``input`` of rank 3 (batch, sequence, hidden) or 2 (tokens, hidden), and
    ``skip`` of the same shape or, for a rank-3 input, broadcast as (1, sequence, hidden) or
    (sequence, hidden), like a position embedding. None otherwise. Only in the main graph (the
    shape tables are its), and only a sum in the pattern's own scope: not an outer sum that a
    pattern inside an If branch reads."""
    add = x.producer
    if not _is(add, "Add") or x.is_graph_output or len(add.inputs) != 2 or add.graph is not scope \
            or scope.parent is not None:
        return None
    a, b = add.inputs
    if a is None or b is None or (a.is_constant and b.is_constant) \
            or a.dtype != DType.FLOAT or b.dtype != DType.FLOAT:
        return None
    for table in shapes.tables():  # (symbols mean the same only within one table)
        for big, small in ((a, b), (b, a)):
            shape, other = table.of(big), table.of(small)
            if shape is None or other is None or big.is_constant or len(shape) not in (2, 3):
                continue
            if other == shape or (len(shape) == 3 and other in ((1, *shape[1:]), shape[1:])):
                return [big, small]
    return None


class SymbolicShapes:
    """Shapes of the main graph's values with symbolic dims that mean the same thing across the
    graph, for the skip proofs: tables from two inferences, tried in turn (computed only when a
    proof asks, the second only when the first proves nothing for it).

    onnx's own inference as the loader runs it names every dim it cannot compute afresh
    (``unk__7``), so two residual operands of shape (batch, sequence, H) look unrelated.

    1. onnx's inference with data propagation (``data_prop=True``): it carries the values of
       Shape/Gather/Concat through to Reshape, so ``batch`` and ``sequence`` survive where the
       dynamo exporter and opset-17 exports reshape. A few milliseconds, in C++. A symbol it
       shares between two values was carried, never assumed: a broadcast of two different symbols
       gets a fresh one.
    2. onnxruntime's symbolic shape inference, which reasons about more ops (the TorchScript
       exporter's opset-13 graphs, where step 1 proves nothing). With ``auto_merge=False`` it
       never assumes two symbols equal, so equal shapes are a proof; it stops at two symbols an op
       broadcasts together (BERT's ``Min(64, sequence)`` position slice against ``sequence``).
       With ``auto_merge=True`` it takes them as equal: a broadcast between them is only valid if
       they are, or if one is 1 at run time, and onnxruntime's skip kernels check the shapes and
       fail loudly rather than compute wrong values in that case (onnxruntime's own transformer
       optimizer fuses on the same assumption). The merged run goes first: where it finishes with
       no merge, or only sound ones (see ``_symbolic_inference``), its table is the answer.
       Otherwise the strict run's table is, filled in by the merged run's where its merges were
       sound. Tens of milliseconds a run even on a small model (Python and sympy).

    Where neither finishes (or onnxruntime is not installed), nothing is proven and no skip op is
    made. Both read the model's structure only: the proto as read, its large initializers turned
    into graph inputs of their type and shape (the tool copies its input whole, so a 440 MB
    BERT-base would otherwise be serialised and copied for a proof about shapes)."""

    def __init__(self, model: Model) -> None:
        self.model = model
        self._tables: list[ShapeTable] = []
        self._pending = [self._onnx_inference, self._onnxruntime_inference]
        self._proto: onnx.ModelProto | None = ...  # (the structure proto, made once: ... until then)

    def tables(self):
        """The tables in order, each inferred at the first ask for it."""
        i = 0
        while i < len(self._tables) or self._pending:
            if i == len(self._tables):
                self._tables.append(ShapeTable(self._pending.pop(0)()))
            yield self._tables[i]
            i += 1

    @property
    def computed(self) -> dict[str, tuple]:
        """For the optimal placement's size estimates: onnxruntime's table where it ran (the most
        ops reasoned about), else onnx's, else empty (no proof asked for one)."""
        return self._tables[-1].shapes if self._tables else {}  # (onnxruntime's is the second)

    def _structure(self):
        """The model's structure proto, made once for both inferences (neither edits it)."""
        if self._proto is ...:
            from .onnx_loader import OnnxSource, structure_proto

            source = self.model.origin
            self._proto = structure_proto(source) if isinstance(source, OnnxSource) else None
        return self._proto

    def _onnx_inference(self) -> dict[str, tuple]:
        proto = self._structure()
        if proto is None:
            return {}
        try:
            inferred = onnx.shape_inference.infer_shapes(proto, check_type=False, strict_mode=False, data_prop=True)
        except Exception:  # noqa: BLE001 - inference is best effort: nothing proven by it
            return {}
        return _shape_table(inferred.graph)

    def _onnxruntime_inference(self) -> dict[str, tuple]:
        import logging

        proto = self._structure()
        if proto is None:
            return {}
        try:
            from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference
        except ImportError:
            return {}
        logging.getLogger("onnxruntime.tools.symbolic_shape_infer").setLevel(logging.CRITICAL)
        # The merged run first: where it finishes and every merge it made is sound (none, on most
        # models: it is then the strict run), its table is the answer, and one run of tens of
        # milliseconds is saved.
        merged, merged_complete, sound = _symbolic_inference(SymbolicShapeInference, proto, auto_merge=True)
        if merged is not None and merged_complete and sound:
            return _shape_table(merged)
        strict, complete, _ = _symbolic_inference(SymbolicShapeInference, proto, auto_merge=False)
        if complete or not sound:  # (unsound: its equal shapes are an assumption the inputs need not meet)
            return _shape_table(strict)
        # the merged run's symbols are consistent with each other; the strict run's partial result
        # only fills in what the merged run did not reach
        return {**_shape_table(strict), **_shape_table(merged)}


class ShapeTable:
    """One inference's shapes: symbols are consistent within it, not across tables."""

    def __init__(self, shapes: dict[str, tuple]) -> None:
        self.shapes = shapes

    def of(self, value: Value) -> tuple | None:
        shape = self.shapes.get(value.name)
        if shape is None and value.is_constant and value.shape is not None:
            shape = value.shape  # a constant's shape is static
        return shape if shape is not None and all(d not in (None, "", 0) for d in shape) else None


def _shape_table(graph) -> dict[str, tuple]:
    if graph is None:
        return {}
    return {info.name: tuple(d.dim_param or (d.dim_value if d.HasField("dim_value") else None)
                             for d in info.type.tensor_type.shape.dim)
            for info in [*graph.input, *graph.value_info, *graph.output] if info.type.tensor_type.HasField("shape")}


def _symbolic_inference(engine, proto, auto_merge: bool):
    """(graph with inferred value_info or None, whether every shape was inferred, whether every
    merge it made is sound).

    The steps of ``SymbolicShapeInference.infer_shapes``, run here because that function saves the
    model to ``sym_shape_infer_temp.onnx`` in the working directory when it cannot finish: a
    rewrite must write nothing but its output. A partial result is still sound for the values it
    did infer.

    With ``auto_merge`` the inference takes two dims an op broadcasts together for equal. That is
    sound where both are made from the same graph-input dims (BERT's ``Min(64, sequence)``
    position slice against ``sequence``: equal wherever the model runs). It is not where it equates
    two of the graph's input dims (``(B, S, H) + (B, T, H)``, valid ONNX with T = 1), an input dim
    with a number, or dims from different inputs: a skip op fused on it fails at run time where
    the model broadcasts. After such a merge its table proves nothing."""
    try:
        inference = engine(2**31 - 1, auto_merge, False, 0)
        _carry_values_through_identity(inference)
        inference._preprocess(proto)
        complete = False
        while inference.run_:
            complete = inference._infer_impl()
        inference._update_output_from_vi()
        return inference.out_mp_.graph, bool(complete), _merges_sound(inference)
    except Exception:  # noqa: BLE001 - whatever the helper stumbles on, nothing is proven by it
        return None, False, False


def _carry_values_through_identity(inference) -> None:
    """Make the engine's Identity pass on the values it knows, as well as shape and type.
    onnxruntime's symbolic inference passes only shape and type through an Identity, so shape
    arithmetic with one in it (``Shape -> Identity -> Concat -> Expand``) lost its values and the
    inference stopped at the reader, proving no residual sum: an opset-13 export with Identity
    nodes then kept each LayerNorm an FP32 island (ViT: 14 Casts instead of 2)."""
    dispatch = getattr(inference, "dispatcher_", None)
    if not isinstance(dispatch, dict) or "Identity" not in dispatch:
        return  # (another onnxruntime's engine: left as it is)
    shape_and_type = dispatch["Identity"]

    def identity(node) -> None:
        shape_and_type(node)
        known = inference.sympy_data_
        if node.input and node.input[0] in known:
            known[node.output[0]] = known[node.input[0]]

    dispatch["Identity"] = identity


def _merges_sound(inference) -> bool:
    """Whether every merge the inference made equates dims made from the same graph-input dims
    and equal wherever the model can run (see ``_symbolic_inference``); True where it made none."""
    inputs = set(inference.input_symbols_)
    dims = inference.symbolic_dims_

    def symbols(name) -> set[str] | None:
        expr = dims.get(name) if isinstance(name, str) else None
        free = getattr(expr, "free_symbols", None)
        return None if free is None else {str(sym) for sym in free}

    return all(key not in inputs and (mine := symbols(key)) and mine == symbols(to) and mine <= inputs
               and _equal_where_broadcast(dims[key], dims[to])
               for key, to in inference.suggested_merge_.items())


# input-dim values tried for a counterexample to a merge: small ones, and both sides of the powers
# of two (and of 64, the position-slice bound exporters write as Min(64, S))
_DIM_SAMPLES = (1, 2, 3, 4, 5, 6, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 255, 256, 257,
                511, 512, 513, 1023, 1024, 1025, 2048, 4096, 65536)
_DIM_SAMPLES_2D = (1, 2, 3, 7, 8, 64, 65, 128, 513, 4096)


def _equal_where_broadcast(a, b) -> bool:
    """Whether two dim expressions of the same input dims are equal wherever the model can run.

    An op that broadcasts them together runs where they are equal or one of them is 1 (a longer
    one against a shorter one, neither 1, fails in the FP32 model too). So ``Min(64, S)`` against
    ``S`` is equal wherever BERT's position slice runs, but ``S - 1`` (a Slice from 1) against
    ``S`` is not: at S = 2 the FP32 model broadcasts 1 against 2, where a skip op fused on their
    equality fails. The input dims are tried at sample values, plus every positive whole value at
    which a polynomial side is 1; an expression with more than two input dims, or one that does
    not evaluate to a whole number, is taken for unsound."""
    import itertools

    import sympy

    free = sorted(a.free_symbols | b.free_symbols, key=str)
    if not free or len(free) > 2:
        return False
    samples = [set(_DIM_SAMPLES if len(free) == 1 else _DIM_SAMPLES_2D) for _ in free]
    if len(free) == 1:
        for side in (a, b):
            if side.is_polynomial(free[0]):
                try:
                    roots = sympy.solve(sympy.Eq(side, 1), free[0])
                except Exception:  # noqa: BLE001 - no closed form: the samples decide
                    roots = []
                for root in roots:
                    if root.is_integer and root.is_positive:
                        samples[0].update((int(root) - 1, int(root), int(root) + 1))
    for point in itertools.product(*(sorted(v for v in values if v >= 1) for values in samples)):
        at = {symbol: sympy.Integer(v) for symbol, v in zip(free, point)}
        x, y = a.xreplace(at), b.xreplace(at)
        if not (getattr(x, "is_Integer", False) and getattr(y, "is_Integer", False)):
            return False
        x, y = int(x), int(y)
        if x >= 0 and y >= 0 and x != y and 1 in (x, y):
            return False
    return True


def _mean_over_last_axis(node: Node) -> bool:
    x = node.inputs[0]
    rank = len(x.shape) if x is not None and x.shape is not None else None
    if _attr(node, "keepdims", 1) != 1:
        return False
    axes = _attr(node, "axes", None)
    if axes is None and len(node.inputs) > 1 and node.inputs[1] is not None:
        axes = _array(node.inputs[1])
        axes = None if axes is None else [int(a) for a in axes.reshape(-1)]
    if axes is None or len(axes) != 1:
        return False
    return axes[0] == -1 or (rank is not None and axes[0] == rank - 1)


def _square_base(node: Node | None) -> Value | None:
    """The value ``node`` squares (looked through pass-throughs), or None."""
    if _is(node, "Pow") and _scalar(node.inputs[1], node.inputs[0]) == 2.0:
        return _source(node.inputs[0])
    if _is(node, "Mul") and len(node.inputs) == 2 and node.inputs[0] is not None \
            and _source(node.inputs[0]) is _source(node.inputs[1]):
        return _source(node.inputs[0])
    return None


def _constant(value: Value | None) -> Value | None:
    """The constant behind ``value``, through Identity nodes (the TorchScript exporter shares a
    weight between layers by Identity); None if it is not one."""
    while value is not None and not value.is_constant and _is(value.producer, "Identity"):
        value = value.producer.inputs[0]
    return value if value is not None and value.is_constant else None


def _is_vector_const(value: Value, x: Value) -> bool:
    """A 1-D FP32 constant as long as x's last dim: when that dim is symbolic, of any length but 1
    (a broadcast [1] scale, which the skip ops refuse at run time: 'Last dimension of gamma and
    input does not match'; a longer one must equal the dim for the model to run at all)."""
    value = _constant(value)
    return value is not None and _is_vector(value, x)


def _is_vector(value: Value, x: Value) -> bool:
    """``_is_vector_const`` but for any 1-D FP32 value: a graph input, an initializer a caller may
    override, or one computed from constants (``Squeeze``, a ``Cast`` from double). The standard
    LayerNormalization/RMSNormalization take such a scale and bias; the skip ops are only chosen
    for constants (``_choose``). Left unfused, onnxruntime's LayerNormFusion took such a LayerNorm
    anyway and made a node of FP16 X and FP32 scale it then refused to load."""
    if value.dtype != DType.FLOAT or value.shape is None or len(value.shape) != 1:
        return False
    last = x.shape[-1] if x.shape else None
    return value.shape[0] == last if isinstance(last, int) else value.shape[0] != 1


# -- small helpers ---------------------------------------------------------------------------------------
def _is(node: Node | None, op: str) -> bool:
    return node is not None and node.domain == "" and node.op_type == op


def _is_noop_cast(node: Node | None) -> bool:
    return _is(node, "Cast") and node.attrs.get("to") == DType.FLOAT and node.inputs[0] is not None \
        and node.inputs[0].dtype == DType.FLOAT


def _is_passthrough(node: Node | None) -> bool:
    """A node that hands its FP32 input on unchanged: a no-op ``Cast(to=FLOAT)`` or an
    ``Identity``. A pattern is matched through them (the TorchScript exporter writes Identity
    nodes, users insert them); onnxruntime removes them, and left inside an unfused pattern at
    opset 17+, its own LayerNormFusion took the island with its entry Cast and refused the model."""
    if _is_noop_cast(node):
        return True
    return _is(node, "Identity") and len(node.inputs) == 1 and node.inputs[0] is not None \
        and node.inputs[0].dtype == DType.FLOAT


def _source(value: Value | None) -> Value | None:
    """The value behind any pass-throughs (``_is_passthrough``)."""
    while value is not None and _is_passthrough(value.producer):
        value = value.producer.inputs[0]
    return value


def _through_casts(value: Value, members: list[Node]) -> Value:
    """Follow single-reader pass-throughs forward (adding them to ``members``)."""
    while True:
        readers = value.consumers()
        if len(readers) != 1 or not _is_passthrough(readers[0]) or value.is_graph_output:
            return value
        members.append(readers[0])
        value = readers[0].outputs[0]


def _absorb_passthroughs(x: Value, members: list[Node]) -> None:
    """Add to ``members`` the pass-throughs on the pattern's own data path: those between two
    members, or between ``x`` and a member, whose result only members read. They go with the
    pattern (the fused op reads ``x`` itself). Pass-throughs of a scale, bias or constant stay:
    the fused op reads what they make."""
    inside = {id(n) for n in members}
    made = {id(v) for n in members for v in n.outputs}
    grown = True
    while grown:
        grown = False
        for member in list(members):
            for value in member.inputs:
                node = value.producer if value is not None else None
                if node is None or id(node) in inside or not _is_passthrough(node) or value.is_graph_output \
                        or any(id(reader) not in inside for reader in value.consumers()):
                    continue
                origin = _source(node.inputs[0])
                if origin is not x and id(origin) not in made:
                    continue
                members.append(node)
                inside.add(id(node))
                made.update(id(v) for v in node.outputs)
                grown = True


def _only_consumer(value: Value, op: str) -> Node | None:
    """The one reader of ``value`` (after single-reader pass-throughs), if it is an ``op``."""
    while True:
        readers = value.consumers()
        if len(readers) != 1 or value.is_graph_output:
            return None
        if not _is_passthrough(readers[0]):
            return readers[0] if _is(readers[0], op) else None
        value = readers[0].outputs[0]


def _other_input(node: Node | None, value: Value) -> Value | None:
    """The input of a two-input ``node`` that is not ``value`` (compared through pass-throughs)."""
    if node is None or len(node.inputs) != 2:
        return None
    a, b = node.inputs
    if a is value or b is value:
        return b if a is value else a
    source = _source(value)
    return b if _source(a) is source else a if _source(b) is source else None


def _attr(node: Node, name: str, default: Any) -> Any:
    origin = node.origin
    attr = origin.attributes.get(name) if origin is not None else None
    return attr.value if attr is not None else default


def _array(value: Value | None):
    """The constant's data (initializer or Constant node, through Identity), or None."""
    value = _constant(value)
    return constant_array(value) if value is not None else None


def _scalar(value: Value | None, like: Value | None) -> float | None:
    """A one-element constant's value, if it broadcasts against ``like`` (the tensor the pattern
    combines it with) without adding dims: an eps of shape (1, 1, 1, 1) on a rank-3 input makes
    the pattern's result rank 4, which the fused op would not."""
    value = _constant(value)
    if value is None or value.numel not in (None, 1):
        return None
    rank = len(value.shape) if value.shape is not None else None
    if rank is None or (rank > 1 and (like is None or like.shape is None or rank > len(like.shape))):
        return None
    data = _array(value)
    return float(data.reshape(-1)[0]) if data is not None and data.size == 1 else None


def _close(a: float | None, b: float) -> bool:
    return a is not None and math.isclose(a, b, rel_tol=1e-4)


def _common_prefix(labels: list[str]) -> str:
    """The shared path of the members' names (``/layer.0/LayerNorm/``), or ``amp_fused/``."""
    parts = [label.split("/")[:-1] for label in labels]
    common: list[str] = []
    for segment in zip(*parts):
        if len(set(segment)) != 1:
            break
        common.append(segment[0])
    prefix = "/".join(common)
    return prefix + "/" if prefix else "amp_fused/"


