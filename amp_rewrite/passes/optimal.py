"""Optimal placement: choose the precision of the undecided infer/clear nodes by an s–t minimum cut.

Safety decides first (classify + paint): allow ops are low precision, deny / unlisted ops and the
nodes deny paint pulled into an FP32 island are FP32. What is left — infer and clear nodes that no
deny paint reached — may take either type within the safety rules below; the rest is cost. With
two labels (source side = low precision, sink side = FP32) the cost below is a sum of terms a graph
cut represents exactly, so max-flow (networkx, Boykov–Kolmogorov) gives the optimum, not a
heuristic. Fixed nodes are terminals, so the free nodes fall into independent components (linked
by a value one produces and another reads): each is cut, checked and repaired on its own.

Cost model (bytes moved per run; one model run at the default shapes below):

- **a cast**: ``numel × (4 + 2)`` bytes (it reads one type and writes the other), paid once per
  value and target type: a value read by several consumers that need the other type is cast once
  (``place_casts`` shares one Cast per (value, type, scope)). Modelled with one auxiliary node per
  value and direction, so k consumers across the cut cost one cast, not k.
- **a free node left FP32**: ``2 × numel`` extra bytes for each float input and output of its
  painted group (the 2 bytes per element FP32 moves over FP16/BF16), weights included; none for
  an ONNX ``Identity``, which onnxruntime removes before it runs (left FP32 it still decides which
  side of it the Cast goes). (Fixed nodes cost the same whatever the cut does, so the reported
  FP32 traffic is the free nodes'.)
- **terminals**: graph inputs and outputs are FP32 (``keep_io_types``; low without it); values
  produced or read by non-participating nodes (control flow, existing casts, custom ops, Loop and
  Scan bodies) need FP32; initializers and Constant outputs are free (converted offline, or duplicated
  when both types read them) except training-mode initializers (master weights: a cast at use);
  an existing ``Cast(to=FLOAT)`` of a non-FP32 value is free too (``place_casts`` retargets or
  bypasses it), and so is one of an FP32 value that only moves weights (Gather, Reshape, Concat…
  of initializers: GPT-2's position row), which is no FP32 activation read either.
- **shapes**: a known dimension counts as is; a symbolic dimension whose name mentions "batch"
  counts :data:`BATCH_DIM` (1), and so does the leading dimension of a tensor of rank 2 or more
  where onnx could not name it (unknown, or named afresh: ``unk__7``), which in an activation is
  its batch (a TorchScript export's attention scores are four such dims: counted 128^4 elements,
  their cast cost the tiny-BERT model 1.5 GiB per run where the batch-1 figure is 12 MiB); any
  other symbolic or unknown dimension counts :data:`SYMBOLIC_DIM` (128, a typical sequence length
  / feature-map side). Where the fuse pass ran
  a shape inference for a skip proof (onnxruntime's symbolic one where it ran, else onnx's with
  data propagation: ``onnx_fuse.SymbolicShapes``), its shapes count too, the smaller estimate
  winning: it carries ``batch`` and ``sequence`` where the loader's inference names a fresh dim. Where the producer's
  op ties the count to its inputs, the smaller estimate wins: a reshape, transpose, unary
  elementwise op or normalisation keeps its data input's count, a broadcasting elementwise op has
  at least its largest input's (so an attention Reshape to four unknown dims is not counted 128^4
  elements when its input counts 1 × 128 × 64). A value of unknown rank takes that relation's
  estimate, else the largest among its producer's float inputs, else :data:`SYMBOLIC_DIM`.
- **ties** go, in order, to fewer cast bytes, then to greedy's answer (so optimal only departs
  from greedy where that strictly saves bytes).
- **never more cast bytes than greedy**: where the plain sum's optimum trades an extra cast for
  more FP32 traffic saved (a low-precision embedding block cast once into an FP32 LayerNorm), cast
  bytes are weighted ×2, ×4, ×16 and finally lexicographically (any cast byte outweighs all FP32
  traffic) until the component casts no more than greedy; each answer is the exact optimum of its
  weighted sum (a Lagrangian step on the budget "cast bytes ≤ greedy's"), and the report says
  which weight was used.

Safety, never less than greedy's:

- nodes fixed by a deny reason (deny / unlisted category, deny-painted island members, pinned or
  kernel-less ops) are terminals on the FP32 side: the cut cannot move them;
- downstream only: a free node greedy kept FP32 may turn low only where every value it reads comes
  from a node that ends low (or is a weight): an implication edge per input, exact in the cut. A
  cast never moves *upstream* across a value-changing op (``x → Div(1000) → MatMul`` keeps casting
  the normalised value, not raw ``x``), and a node reading an FP32 tensor nobody can change stays
  FP32, as does what follows it;
- nor *downstream* across an op whose result the low type may not hold although its inputs fit,
  where an FP32 reader reads that result, directly or through copying ops (a reader fixed FP32, or
  held FP32 by these rules in turn: KL's ``Div(p, q)`` is held before its Log, and its softmaxes for
  it; a small-value reader greedy computes in FP32 counts wherever the cut leaves it): a product, quotient or
  sum of two activations or a reciprocal (:data:`_OVERFLOWING`) read by any FP32 op or output
  (``(a * b).sum()`` keeps its Mul: 300 × 300 passes 65504 before the FP32 sum), a softmax or
  sigmoid (:data:`_UNDERFLOWING`) read by a Log, a division or a power (``log(softmax(z))`` keeps
  its Softmax: FP16 probabilities below 6e-8 are 0, and the Log -inf), as greedy keeps them;
  and, for either low type, a sum a log reads (:data:`_ABSORBING`: ``log(1 + exp(-z))`` keeps its
  Add, as bf16's 8 significant bits round 1 + 0.002 to 1, and what greedy kept FP32 before such a
  sum or a log1p: ``log(1 - sigmoid(z))`` keeps its sigmoid, which is 1 in bf16 from z = 5.5, and
  ``log(1 - tanh(u)**2)`` its tanh, 1 in fp16 from u = 4.2), and a sum with a constant addend
  (:data:`_ABSORBING` too: an ONNX constant, a torch Python number) with the nodes moving weights
  into it (a schedule table's Gather): the constant sets the sum's scale, so the low type rounds
  the sum to its spacing there and the constant offline (anchor centres at 2000 px: 2 px in FP16;
  ``1 - alphas_cumprod[t]``: 15% off in FP16, 0 in BF16);
- round trips: no low-precision path of non-allow nodes may run from a node that reads an FP32
  tensor to a node that feeds an FP32 consumer (an FP32 → low → FP32 trip overflows above 65504).
  This is greedy's per-node rule extended to paths. A cut that breaks it is repaired — the nodes
  on offending paths that greedy kept FP32 are fixed FP32, with the rest of a path that those
  alone leave in place (or, where greedy had none there, all of them) — and the component cut
  again, until none remain; a heavier cast weight (below) starts from the lighter weights' repair;
- a component whose repaired answer casts more than greedy's keeps greedy's answer (as safe as
  greedy, and never dearer).

- **If nodes** whose branches produce the If's FP32 outputs with nodes of their own are solved
  with their branches (one problem for the scope and all such branch bodies, recursively): each
  FP32 output of the If is a free variable that reads the branches' outputs at its position and
  produces the If's (no FP32 traffic of its own), so it takes the low type where both branches
  end low, or stays FP32 as greedy has it (the downstream-only rule above: only if every branch
  output there comes from a node that ends low); outer values read inside those branches are
  ordinary terms. Casts in a branch are counted as if
  both branches ran (an upper bound). Not in training mode.

Cases handled: every scope (subgraph bodies too), keep_io_types on/off, training initializers,
values read across scopes, shared initializers, Shape/Size/Cast consumers (they need no cast).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from typing import Mapping

import networkx as nx

from ..decisions import Category, Precision
from ..ir import DType, Graph, Model, Node, Value
from .base import LOW_LIMITS, Context, PassResult, accepts_any_float, adds_a_constant, category, converts_non_float, \
    group_inputs, group_outputs, node_label, participates, read_through_casts, retypable_io, round_trip_harm

BATCH_DIM = 1
SYMBOLIC_DIM = 128
CAST_BYTES_PER_ELEMENT = 6  # read 4 + write 2 (or read 2 + write 4)
FP32_EXTRA_BYTES_PER_ELEMENT = 2  # what an FP32 node moves over a low-precision one, per element

# Integer capacities, exact in max-flow: one byte is worth _BYTE units; cast elements carry a
# tie-break of _CAST_TIE units each (fewer cast bytes wins a tie); departing from greedy costs
# _GREEDY_TIE per node (greedy's answer wins a remaining tie). The scales never overlap: a model
# would need 2^20 nodes to outweigh one cast element, and 2^20 cast elements to outweigh a byte.
_BYTE = 1 << 40
_CAST_TIE = 1 << 20
_GREEDY_TIE = 1

_S, _T = "S", "T"  # source = low precision, sink = FP32
# A component of the flow network with at most this many nodes (variables and auxiliary nodes) is
# cut by trying all 2^n sides: a networkx max-flow costs about a millisecond however small the network.
_ENUMERATE_CUTS_UP_TO = 4
_FIXED_FP32 = (Category.DENY, Category.UNLISTED)
# ops whose (first) output has as many elements as their first input, and broadcasting ones
_SAME_NUMEL = {"Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Identity", "Cast", "CastLike", "Dropout",
               "Relu", "LeakyRelu", "Gelu", "Tanh", "Sigmoid", "HardSigmoid", "Erf", "Neg", "Abs", "Sqrt",
               "Reciprocal", "Exp", "Log", "Sin", "Cos", "Softmax", "LogSoftmax", "LayerNormalization",
               "BatchNormalization", "InstanceNormalization", "Not", "IsNaN", "IsInf", "Clip"}
# ops whose output the low type may not hold although their (low) inputs fit it: a product or
# quotient of two activations overflows (300 x 300 > 65504), a reciprocal of a small one too;
# computed low and cast up for an FP32 reader, they hand it inf where greedy kept them FP32
_OVERFLOWING = {"Mul", "Div", "Reciprocal", "Add", "Sub", "Sum", "mul", "div", "true_divide", "reciprocal", "add",
                "sub"}
# (overflowing only between two activations: a residual sum, 36000 + 30000, passes 65504 too)
_OF_TWO = {"Mul", "Div", "Add", "Sub", "Sum", "mul", "div", "true_divide", "add", "sub"}
# ... and probabilities, which underflow (a softmax or sigmoid below 6e-8 is 0 in FP16): harmless
# to a sum or a GEMM, fatal to an FP32 op that takes their log or divides by them (-inf, inf)
_UNDERFLOWING = {"Softmax", "Sigmoid", "softmax", "_softmax", "sigmoid"}
_SMALL_VALUE_READERS = {"Log", "Reciprocal", "Div", "Pow", "log", "log2", "log10", "reciprocal", "rsqrt", "div",
                        "true_divide", "pow", "xlogy", "special_xlog1py"}
_WIDENING = _OVERFLOWING | _UNDERFLOWING
# sums whose small addend the low type's few significant bits drop, fatal before a log; and sums
# whose constant addend sets their scale: precision lost to the low type's spacing there
_ABSORBING = {"Add", "Sub", "Sum", "add", "sub", "rsub"}
_LOGS = {"Log", "log", "log2", "log10", "log1p"}
# softmax weights, the FP32 sums that pool with them, and what carries the weights there
_WEIGHTINGS = {"Softmax", "softmax", "_softmax"}
_FP32_SUMS = {"ReduceSum", "ReduceMean", "sum", "mean"}
_WEIGHT_CARRIERS = {"Mul", "Transpose", "Reshape", "Unsqueeze", "Squeeze", "Expand", "Identity", "Flatten", "mul",
                    "view", "reshape", "transpose", "permute", "unsqueeze", "squeeze", "expand", "clone"}
# logs with a sum of their own: log1p(-y) is log(1 - y), as absorbing as the spelled-out sum
_SUMMING_LOGS = {"log1p", "special_xlog1py"}
# ops that keep a value near 1 near 1 (a square, a sign, an absolute value): held FP32 by a rule, they
# do not end the walk back from such a sum (1 - tanh(u)**2: fp16's square is a deny pow)
_NEAR_ONE_KEEPING = {"Mul", "Pow", "Neg", "Abs", "mul", "pow", "neg", "abs", "square"}
_BROADCAST = {"Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Where", "Equal", "Less", "Greater",
              "LessOrEqual", "GreaterOrEqual", "And", "Or", "Xor", "Mod", "PRelu"}
_BATCH = re.compile("batch", re.IGNORECASE)


def _removed_at_load(node: Node) -> bool:
    """An ONNX Identity: onnxruntime's basic graph optimisations remove it, so it moves no data.
    (Costed as a copy, an FP32 Identity after an FP32 op moved the Cast before the 4x larger input
    of the MaxPool it fed.)"""
    return node.op_type == "Identity" and node.domain in ("", "ai.onnx")


def optimise_placement(model: Model, ctx: Context) -> PassResult:
    """Re-decide the free infer/clear nodes of every scope by min-cut, then renumber the islands."""
    changed = False
    joined: set[int] = set()  # If branch bodies solved with the scope holding their If
    for scope in list(model.graph.scopes()):
        if id(scope) in joined:
            continue
        problem = Problem.from_scope(scope, ctx, model.meta.get("amp.symbolic_shapes"))
        if problem is None:
            continue
        joined.update(id(b) for b in problem.bodies)
        labels, outcome = problem.solve()
        changed |= problem.apply(labels, outcome, ctx)
    if changed:
        _refresh_islands(model, ctx)
    return PassResult("optimal", modified=False)  # precisions only: place_casts makes the edits


# -- the problem ---------------------------------------------------------------------------------------
@dataclass
class _ValueTerm:
    """One value's cast term: a cast is paid when its producer's type differs from a consumer's."""

    value: Value
    producer: int | str  # node index, or _S / _T for a fixed source
    consumers: list[int]  # node indices (free or fixed) reading it in their painted group
    fixed_needs: set[str]  # _S / _T: fixed consumers (graph outputs, non-participating nodes, ...)
    numel: int

    @property
    def cast_bytes(self) -> int:
        return self.numel * CAST_BYTES_PER_ELEMENT


@dataclass
class Outcome:
    """How the scope was decided, for the report."""

    scope: Graph
    cost: "Cost"
    greedy_cost: "Cost"
    rounds: int = 1
    repaired: list[int] = field(default_factory=list)  # nodes fixed FP32 by the round-trip repair
    kept_greedy: int = 0  # components where greedy's answer was kept (the repaired cut cast more)
    kept_nodes: set[int] = field(default_factory=set)  # their nodes
    components: int = 0
    weight: int = 1  # the cast-byte weight of the accepted cut (1: the plain sum)


@dataclass
class _Component:
    variables: list[int] = field(default_factory=list)
    terms: list[_ValueTerm] = field(default_factory=list)
    requires: list[tuple[int, int]] = field(default_factory=list)


@dataclass(frozen=True)
class Cost:
    cast_bytes: int
    fp32_bytes: int
    casts: int

    @property
    def total(self) -> int:
        return self.cast_bytes + self.fp32_bytes

    def __add__(self, other: "Cost") -> "Cost":
        return Cost(self.cast_bytes + other.cast_bytes, self.fp32_bytes + other.fp32_bytes, self.casts + other.casts)


class Problem:
    """The two-label problem of one scope."""

    def __init__(self, scope: Graph, ctx: Context, nodes: list[Node], bodies: list[Graph] = (),
                 branches: list[Node] = (), symbolic: Mapping[str, tuple] | None = None) -> None:
        self.scope = scope
        self.symbolic = symbolic or {}  # main-graph shapes with consistent symbols (onnx_fuse.SymbolicShapes)
        self.ctx = ctx
        self.bodies = list(bodies)  # If branch bodies solved with this scope (see _joined_ifs)
        self.scope_ids = {id(scope)} | {id(b) for b in self.bodies}
        nodes = list(nodes)
        self.index = {id(n): i for i, n in enumerate(nodes)}
        # an If joined with its branches is one free variable per FP32 output: the type that output
        # and the branches' outputs at its position then take (it reads them, as a node reads its
        # inputs). The If node stands in the node list once per such output.
        self.output_var: dict[tuple[int, int], int] = {}  # (id(If), output index) -> variable
        self.branch_of: dict[int, int] = {}  # id(branch output value) -> the variable reading it
        for n in branches:
            for k in _fp32_outputs(n):
                self.output_var[(id(n), k)] = len(nodes)
                for body in n.all_subgraphs():
                    self.branch_of[id(body.outputs[k])] = len(nodes)
                nodes.append(n)
        self.nodes = nodes
        self.branch_nodes = set(self.output_var.values())
        self.group_in = [frozenset(group_inputs(n)) for n in nodes]
        self.group_out = [group_outputs(n) for n in nodes]
        self.cat = [category(n) for n in nodes]
        self.greedy = [n.meta.get("amp.precision") == Precision.LOW for n in nodes]
        for (_, k), i in self.output_var.items():
            self.cat[i] = Category.CLEAR
            self.group_in[i] = frozenset()
            self.group_out[i] = [k]
            self.greedy[i] = False
        self.fixed: dict[int, bool] = {}  # index -> is_low
        for i, n in enumerate(nodes):
            if self.cat[i] == Category.ALLOW:
                self.fixed[i] = True
            elif self.cat[i] in _FIXED_FP32 or n.meta.get("amp.deny_painted") or self.cat[i] not in (
                    Category.INFER, Category.CLEAR):
                self.fixed[i] = False
        self.free = [i for i in range(len(nodes)) if i not in self.fixed]
        # The graph view greedy's safety rule reads (paint._ScopePainter._wire), built from the same
        # uses as the cost terms: group edges, FP32 sources read, FP32 consumers fed.
        self.preds: list[set[int]] = [set() for _ in nodes]
        self.succs: list[set[int]] = [set() for _ in nodes]
        self.trip_succs: list[set[int]] = [set() for _ in nodes]  # readers behind a Cast out of the low type
        self.fp32_source = [False] * len(nodes)
        self.fp32_sink = [False] * len(nodes)
        self._numel: dict[int, int] = {}
        self._inner: dict[int, int] = {}  # estimates made on the way to another value's (see _cached_estimate)
        self.terms = self._value_terms()
        for i, node in enumerate(nodes):
            if converts_non_float(node):
                self.fp32_source[i] = True
        self.requires = self._only_downstream()
        self.free = [i for i in range(len(nodes)) if i not in self.fixed]
        self.node_bytes = [0] * len(nodes)
        for i in self.free:
            if i in self.branch_nodes or _removed_at_load(nodes[i]):
                continue  # an If moves no data of its own, nor does an Identity onnxruntime removes
            ins, outs = nodes[i].inputs, nodes[i].outputs
            floats = [ins[k] for k in self.group_in[i]] + [outs[k] for k in self.group_out[i]]
            self.node_bytes[i] = FP32_EXTRA_BYTES_PER_ELEMENT * sum(self.numel(v) for v in floats)
        self.components = self._components()

    @classmethod
    def from_scope(cls, scope: Graph, ctx: Context, symbolic: Mapping[str, tuple] | None = None) -> "Problem | None":
        branches, bodies = _joined_ifs(scope, ctx)
        nodes = [n for g in [scope, *bodies] for n in g.nodes if participates(n)]
        if not any(n.meta.get("amp.precision") == Precision.LOW for n in nodes):
            return None  # no low node: greedy changes nothing here, neither do we
        problem = cls(scope, ctx, nodes, bodies, branches, symbolic)
        return problem if problem.free else None

    # -- building ----------------------------------------------------------------------------------
    def _value_terms(self) -> list[_ValueTerm]:
        seen: dict[int, Value] = {}
        for i, node in enumerate(self.nodes):
            ins, outs = node.inputs, node.outputs
            for k in self.group_in[i]:
                seen.setdefault(id(ins[k]), ins[k])
            for k in self.group_out[i]:
                seen.setdefault(id(outs[k]), outs[k])
        terms = []
        index, scope_ids, branch_of = self.index, self.scope_ids, self.branch_of
        for value in seen.values():
            graph = value.graph
            is_main = graph is None or graph.parent is None
            keep_io = self.ctx.options.keep_io_types or not is_main
            producer, fp32_read = self._producer(value, keep_io, is_main)
            if producer is None and not fp32_read:
                continue  # a free source (weights, constants): no cast term, no safety mark
            consumers: dict[int, None] = {}  # an ordered set
            needs: set[str] = set()
            for consumer, k in value.uses():
                j = index.get(id(consumer))
                if id(consumer.graph) not in scope_ids:
                    needs.add(_T)  # read inside a nested body not solved here: its boundary stays FP32
                elif j is not None and k in self.group_in[j]:
                    consumers[j] = None
                elif accepts_any_float(consumer, k):
                    continue
                else:
                    needs.add(_T)
            if value.is_graph_output:
                if id(value) in branch_of:
                    consumers[branch_of[id(value)]] = None  # a branch output: its If reads it
                else:
                    needs.add(_T if keep_io or not retypable_io(value) else _S)
            if isinstance(producer, int):
                if _T in needs:
                    self.fp32_sink[producer] = True
                behind, fixed = read_through_casts(value, self.ctx.low, self._painted_reader)
                self.trip_succs[producer] |= behind
                self.fp32_sink[producer] = self.fp32_sink[producer] or fixed
                for c in consumers:
                    self.succs[producer].add(c)
                    self.preds[c].add(producer)
            elif fp32_read:
                for c in consumers:
                    self.fp32_source[c] = True
            if producer is None:
                continue
            if consumers or (isinstance(producer, int) and needs):
                terms.append(_ValueTerm(value, producer, list(consumers), needs, self.numel(value)))
        return terms

    def _painted_reader(self, reader: Node, slot: int) -> int | None:
        j = self.index.get(id(reader)) if id(reader.graph) in self.scope_ids else None
        return j if j is not None and slot in self.group_in[j] else None

    def _producer(self, value: Value, keep_io: bool, is_main: bool) -> tuple[int | str | None, bool]:
        """The producer's label for the cost — a node index, a fixed terminal, or None for a free
        source — and whether greedy's safety rule counts the value as an FP32 tensor read."""
        node = value.producer
        j = self.index.get(id(node)) if node is not None else None
        if j is None and node is not None and self.output_var:
            j = self.output_var.get((id(node), value.producer_index))  # an output of a joined If
        if j is not None and value.producer_index in self.group_out[j]:
            return j, False
        if value.is_constant:
            return (_T if (self.ctx.options.training and value.is_initializer) else None), False
        if value.is_graph_input and is_main and not keep_io and retypable_io(value):
            return _S, False
        if value.dtype != DType.FLOAT:
            return None, False
        if _is_float_cast_of_non_fp32(node):
            return None, True  # free to retarget for the cost, but an FP32 tensor all the same
        if _is_cast_of_weights(node):
            return None, False  # weights moved and cast: retargeted for low readers, like a weight
        return _T, True

    def _only_downstream(self) -> list[tuple[int, int]]:
        """Greedy kept these free nodes FP32; they may turn low only *downstream* of low
        precision: every value they read in their group must come from a node that ends low (or
        be a weight/constant). Returns those (node, producer) implications for the cut; a node
        reading an FP32 tensor nobody can change (a graph input, a Cast(to=FLOAT), an FP32 node
        output) is fixed FP32, and so, transitively, is what reads it.

        So a cast never moves *upstream* across a value-changing op greedy kept FP32: ``x → Sub →
        Div → Conv`` keeps its cast right before the Conv (raw ``x`` may exceed 65504 where the
        normalised value does not), and an LSTM reading a graph input stays as greedy left it."""
        follow = [i for i in self.free if not self.greedy[i]]
        absorbing = self._absorbing_before_a_log()
        held = {**self._constant_offsets(), **self._before_an_absorbing_sum(), **absorbing,
                **self._weights_of_an_fp32_sum()}
        # (FP16 only: BF16 has FP32's exponent range, so its products, sums and probabilities
        # overflow or underflow where FP32's would; but a sum read by a log loses its small
        # addend in either: precision, not range)
        if self.ctx.low == DType.FLOAT16:
            held = {**held, **self._widening_for_fp32_readers({i for i in held if not self.greedy[i]})}
        held = {i: why for i, why in held.items() if not self.greedy[i]}  # (greedy's low nodes stay free)
        for i in held:
            node = self.nodes[i]
            if not node.meta.get("amp.widening_hold"):  # (said once: a Problem may be built again)
                node.meta["amp.widening_hold"] = True
                node.meta["amp.reason"] = (f"{node.meta.get('amp.reason', '')}; the optimal placement keeps it FP32 "
                                           f"too: {held[i]}")
        pending = [i for i in follow if self.fp32_source[i] or any(self.fixed.get(p) is False for p in self.preds[i])
                   or i in held]
        for i in pending:
            self.fixed[i] = False
        while pending:  # a node that must stay FP32 pins the followers reading it
            i = pending.pop()
            for j in self.succs[i]:
                if j not in self.fixed and not self.greedy[j]:
                    self.fixed[j] = False
                    pending.append(j)
        return [(i, p) for i in follow if i not in self.fixed for p in sorted(self.preds[i]) if p not in self.fixed]

    def _free_upstream(self, starts: list[int], stop: set[int] = frozenset()) -> set[int]:
        """``starts`` and the free nodes they read from, transitively, not walking into ``stop``."""
        seen = set(starts)
        stack = list(starts)
        while stack:
            for p in self.preds[stack.pop()]:
                if p not in seen and p not in self.fixed and p not in stop:
                    seen.add(p)
                    stack.append(p)
        return seen

    def _constant_offsets(self) -> dict[int, str]:
        """The free sums greedy kept FP32 that add a float constant (an anchor grid, the 1 of
        ``1 - alphas_cumprod[t]``, a bias before an output), and the free nodes that only move
        weights into such a sum (the schedule table's Gather). A constant addend fixes the sum's
        scale: computed low, the result is rounded to the low type's spacing at the constant's
        magnitude (box centres at 2000 px: 2 px in FP16, 16 in BF16) and the weights moved into it
        are rounded offline before it (0.99915 is 0.99902 in FP16 and 1 in BF16, so ``1 - a`` is
        15% off or 0, and ``x / sqrt(1 - a)`` inf). Greedy computes such a sum in FP32 from its
        exact constant; the optimal placement keeps it so, whatever the target: precision, not range."""
        low = self.ctx.low.short
        held: set[int] = set()
        stack: list[Value] = []
        for i in self.free:
            node = self.nodes[i]
            if self.greedy[i] or i in self.branch_nodes or node.op_type not in _ABSORBING:
                continue
            if adds_a_constant(node, self.group_in[i]):  # (torch: 1 - a, a literal)
                held.add(i)
                stack.extend(node.inputs[k] for k in self.group_in[i] if node.inputs[k] is not None)
        while stack:  # (walked back through the free nodes that only move weights into a held sum)
            value = stack.pop()
            j = self.index.get(id(value.producer)) if value.producer is not None else None
            if (j is None or j in held or j in self.fixed or self.greedy[j] or j in self.branch_nodes
                    or value.producer_index not in self.group_out[j] or not _moves_weights(value, 0)):
                continue
            held.add(j)
            stack.extend(v for k in self.group_in[j] if (v := self.nodes[j].inputs[k]) is not None)
        why = (f"it adds a constant, or moves weights into such a sum: in {low} the sum is rounded to {low}'s "
               f"spacing at the constant's magnitude (2 px at 2048 in fp16, 16 in bf16) and the weights rounded "
               f"before it (1 - 0.99915 is 15% off in fp16, 0 in bf16), where greedy computes it from the exact "
               f"constant")
        return {i: why for i in held}

    def _absorbing_before_a_log(self) -> dict[int, str]:
        """The free sums (:data:`_ABSORBING`) a log reads, directly or through free nodes: computed
        low and cast up, ``log(1 + exp(-z))`` rounds ``1 + 0.002`` to 1 (bf16 keeps 8 bits, FP16
        11), and the log of what is left is 0, a 100% error where greedy kept the sum FP32."""
        free = [i for i in range(len(self.nodes)) if i not in self.fixed]
        sums = {i for i in free if i not in self.branch_nodes and self.nodes[i].op_type in _ABSORBING}
        if not sums:
            return {}

        def feeds_log(i: int) -> bool:  # (an FP32 log, or one the rules leave free: greedy's FP32 too)
            return any(self.nodes[k].op_type in _LOGS for k in (*self.succs[i], *self.trip_succs[i]))

        # (through free nodes: a Max or a Mul between the sum and the log rounds no less)
        seen = self._free_upstream([i for i in free if feeds_log(i)])
        why = (f"a sum read by a log: {self.ctx.low.short} rounds 1 + 0.002 to 1 ({self.ctx.low.short} keeps "
               f"{8 if self.ctx.low == DType.BFLOAT16 else 11} significant bits), whose log is then 0")
        return {i: why for i in sums & seen}

    def _before_an_absorbing_sum(self) -> dict[int, str]:
        """The free nodes greedy kept FP32 that a sum before a log (an FP32 one, or one held FP32
        by :meth:`_absorbing_before_a_log`) or a log1p reads, transitively: holding the sum FP32
        does not help where its addend was rounded before it. A sigmoid, tanh or exp near 1 is 1 in
        the low type (bf16: sigmoid(5.5); fp16: tanh(4.2)), so ``log(1 - sigmoid(z))`` and
        ``log(1 - tanh(u)**2)`` are log(0) = -inf where greedy, computing them FP32, is finite."""
        def fp32(i: int) -> bool:  # (in greedy's answer)
            return not self.greedy[i] and i not in self.branch_nodes

        before_log: set[int] = set()  # FP32 nodes a log reads through FP32 nodes
        stack = [i for i, n in enumerate(self.nodes) if n.op_type in _LOGS and fp32(i)]
        while stack:
            i = stack.pop()
            if i not in before_log:
                before_log.add(i)
                stack.extend(p for p in self.preds[i] if fp32(p))
        starts = [i for i in before_log if self.nodes[i].op_type in _ABSORBING | _SUMMING_LOGS]
        seen: set[int] = set()
        passed: set[int] = set()
        stack = [p for i in starts for p in self.preds[i]]
        while stack:
            p = stack.pop()
            if p in passed or p in seen or not fp32(p):
                continue
            if p in self.fixed:  # (through an FP32 square or sign: fp16's tanh² is a deny pow)
                if self.nodes[p].op_type in _NEAR_ONE_KEEPING:
                    passed.add(p)
                    stack.extend(self.preds[p])
                continue
            seen.add(p)
            stack.extend(self.preds[p])
        low = self.ctx.low.short
        why = (f"a sum a log reads adds its result: a value near the sum's other addend (a sigmoid, tanh or exp "
               f"near 1 before 1 - y) is that addend in {low}, and the log of their difference -inf, where greedy "
               f"computes it FP32")
        return {i: why for i in seen}

    def _weights_of_an_fp32_sum(self) -> dict[int, str]:
        """The free softmaxes greedy kept FP32 whose probabilities an FP32 sum reduces, directly or
        through products and data moves that do not end low: attentive statistics pooling
        (``mu = sum(w * h)``, ``var = sum(w * h * h) - mu ** 2`` over 3000 frames). Rounded to the
        low type, the weights no longer sum to 1, and the variance's cancellation multiplies that
        by mu²: the pooled std was 70 times further from FP32 (1.4e-2) than greedy's FP32 softmax
        gives. Precision, not range: both targets."""
        low = self.ctx.low.short
        why = (f"an FP32 sum reduces its probabilities (a weighted mean or variance): rounded to {low} they no "
               f"longer sum to 1, which a variance's cancellation multiplies, where greedy computes them FP32")
        held: dict[int, str] = {}
        for i in self.free:
            if self.greedy[i] or i in self.branch_nodes or self.nodes[i].op_type not in _WEIGHTINGS:
                continue
            stack, seen = [*self.succs[i], *self.trip_succs[i]], set()
            while stack:
                k = stack.pop()
                if k in seen or self.fixed.get(k) is True:
                    continue
                seen.add(k)
                op = self.nodes[k].op_type
                if op in _FP32_SUMS and self.fixed.get(k) is False:
                    held[i] = why
                    break
                if op in _WEIGHT_CARRIERS:
                    stack.extend([*self.succs[k], *self.trip_succs[k]])
        return held

    def _widening_for_fp32_readers(self, held_before: set[int]) -> dict[int, str]:
        """The free nodes that make a value the low type may not hold (:data:`_WIDENING`) that an
        FP32 reader reads, directly or through free nodes that only move, select or add values: a
        cast moved downstream across one would hand that reader inf (``(a * b).sum()``'s products)
        or 0 (``log(softmax(z))``'s probabilities: a reader of :data:`_SMALL_VALUE_READERS`, or
        one adding an epsilon the low type flushes) where FP32 is finite."""
        limit = LOW_LIMITS.get(self.ctx.low, 65504.0)
        bounds: dict[int, float | None] = {}

        def widening(i: int) -> bool:
            node = self.nodes[i]
            if i in self.branch_nodes or node.op_type not in _WIDENING:
                return False
            # (scaled or shifted by at most 1, or by constants and weights a Gather/Slice moves whose
            # result is proven to fit: one rounding; a constant past the range is kept apart)
            return node.op_type not in _OF_TWO or _may_grow_past(node, self.group_in[i], limit, bounds)

        # An FP32 reader: fixed FP32, or held FP32 by the placement's own holds (``held`` grows to
        # a fixed point: KL's ``Div(softmax p, softmax q)`` is held before its Log, and then its
        # softmaxes are held for it; counting fixed readers only, both went low and KL was NaN).
        # A small-value reader greedy computes in FP32 counts too, wherever the cut would leave
        # it: it read exact probabilities, and a low softmax hands it 0 in either type. Readers
        # behind the model's own Cast out of the low type, ``(a * b).float().sum()``, read the
        # result in FP32 too: trip_succs.
        held: dict[int, str] = {}

        def fp32_reader(k: int) -> bool:
            return self.fixed.get(k) is False or k in held or k in held_before

        def feeds_fp32(i: int) -> bool:
            return self.fp32_sink[i] or bool(self.trip_succs[i]) or any(fp32_reader(k) for k in self.succs[i])

        def feeds_small_value_reader(i: int) -> bool:
            # (an epsilon the low type flushes, added or clamped to: ``log(p + 1e-10)`` is there
            # for exactly the values that underflow)
            return any((fp32_reader(k) or k in self.trip_succs[i] or not (self.greedy[k] or k in self.branch_nodes))
                       and (self.nodes[k].op_type in _SMALL_VALUE_READERS or "amp.lost_epsilon" in self.nodes[k].meta)
                       for k in (*self.succs[i], *self.trip_succs[i]))

        free = [i for i in range(len(self.nodes)) if i not in self.fixed]
        widen = {i for i in free if widening(i)}
        if not widen:
            return {}

        def reaching(feeds, stop: set[int]) -> set[int]:
            # free nodes through which a value reaches such a reader: walked back from those that
            # feed one, once for all widening nodes of a kind, not through ``stop``
            return self._free_upstream([i for i in free if i not in stop and feeds(i)], stop)

        low = self.ctx.low.short
        kinds = ((_OVERFLOWING, feeds_fp32, f"its result may pass {low}'s range (a product, quotient or sum of two "
                                            f"activations, a reciprocal) before an FP32 reader, which a Cast after it "
                                            f"would hand inf"),
                 (_UNDERFLOWING, feeds_small_value_reader, f"its probabilities below 6e-8 are 0 in {low}, and an FP32 "
                                                           f"reader takes their log, divides by them or adds an epsilon "
                                                           f"to them"))
        while True:
            found: dict[int, str] = {}
            for kind, feeds, why in kinds:
                nodes = {i for i in widen if self.nodes[i].op_type in kind and i not in held}
                if nodes:
                    # (a probability scaled by a product that may grow is still 0 before the Log;
                    # a sum past the range is not carried through a softmax, which reads it)
                    seen = reaching(feeds, nodes if kind is _UNDERFLOWING else widen)
                    found.update({i: why for i in nodes if feeds(i) or any(k in seen for k in self.succs[i])})
            if not found:
                return held
            held.update(found)

    def feasible(self, labels: list[bool]) -> bool:
        """The downstream-only rule holds (and fixed nodes have their labels)."""
        return all(labels[i] == low for i, low in self.fixed.items()) and all(
            labels[p] or not labels[i] for i, p in self.requires)

    def _components(self) -> list["_Component"]:
        """Free nodes linked by a cost term, with their terms: independent sub-problems (fixed
        nodes are terminals), and a low path of free nodes never leaves one."""
        parent = {i: i for i in self.free}

        def find(x: int) -> int:
            while parent[x] != x:
                parent[x] = parent[parent[x]]
                x = parent[x]
            return x

        term_root: list[int | None] = []
        for term in self.terms:
            refs = [r for r in [term.producer, *term.consumers] if isinstance(r, int) and r in parent]
            for r in refs[1:]:
                a, b = find(refs[0]), find(r)
                if a != b:
                    parent[a] = b
            term_root.append(refs[0] if refs else None)
        groups: dict[int, _Component] = {}
        for i in self.free:
            groups.setdefault(find(i), _Component()).variables.append(i)
        for term, r in zip(self.terms, term_root):
            if r is not None:
                groups[find(r)].terms.append(term)
        for i, p in self.requires:  # i and p share the term of p's output: one component
            groups[find(i)].requires.append((i, p))
        return list(groups.values())

    # -- sizes ---------------------------------------------------------------------------------------
    def numel(self, value: Value | None) -> int:
        if value is None:
            return 0
        key = id(value)
        if key not in self._numel:
            self._numel[key] = self._estimate(value, depth=0)
        return self._numel[key]

    def _estimate(self, value: Value, depth: int) -> int:
        if value.numel is not None:
            return value.numel
        shapes = [value.shape] if value.shape is not None else []
        sym = self.symbolic.get(value.name) if value.graph is not None and value.graph.parent is None else None
        if sym is not None and all(d not in (None, "", 0) for d in sym):
            shapes.append(sym)  # the fuse pass's inference may follow a shape the loader's lost
        own = shape = None
        if len(shapes) == 1:
            own, shape = _shape_numel(shapes[0]), shapes[0]
        elif shapes:
            own, shape = min(((_shape_numel(s), s) for s in shapes), key=lambda pair: pair[0])
        if depth >= 32:
            return own if own is not None else SYMBOLIC_DIM
        # Each unknown dim counts SYMBOLIC_DIM: a Reshape to (batch, seq, heads, head_dim) that
        # inference could not follow would count 128^4 elements, 2^15 times its input's
        # (batch, seq, 64); what it was made from bounds it better. A dim onnx named afresh
        # (``unk__7``) says nothing but that it exists (a 5-D attention Expand would count 128^5):
        # with no relation for the op, the producer's largest float input bounds it (an estimate:
        # an Expand or a MatMul can exceed its inputs), as it does a value of unknown shape.
        related = self._related_numel(value, depth)
        if related is None and (own is None or _fresh_dims(shape)):
            related = self._inputs_numel(value, depth)
        if own is None:
            return related if related is not None else SYMBOLIC_DIM
        return own if related is None else min(own, related)

    def _inputs_numel(self, value: Value, depth: int) -> int | None:
        """The largest float input of the value's producer, or None."""
        producer = value.producer
        if producer is None:
            return None
        sizes = [self._cached_estimate(v, depth + 1) for v in producer.inputs
                 if v is not None and v.dtype is not None and v.dtype.is_float]
        return max(sizes) if sizes else None

    def _cached_estimate(self, value: Value, depth: int) -> int:
        """An input's estimate, made once: each value's estimate reads its producer's inputs', so
        unstored they were made again for every path to them (a chain of 50 custom ops of unknown
        shape, each read twice, took 11 million estimates and 6 s)."""
        key = id(value)
        known = self._numel.get(key)
        if known is None:
            known = self._inner.get(key)
        if known is None:
            known = self._inner[key] = self._estimate(value, depth)
        return known

    def _related_numel(self, value: Value, depth: int) -> int | None:
        """The element count the producer's op implies from its inputs: the same as its data input
        (reshapes, transposes, unary elementwise ops, normalisations) or, for a broadcasting
        elementwise op, the largest input's (a lower bound). None where the op says nothing."""
        node = value.producer
        if node is None or node.domain != "" or value.producer_index != 0 or not node.inputs:
            return None
        if node.op_type in _SAME_NUMEL and node.inputs[0] is not None:
            return self._cached_estimate(node.inputs[0], depth + 1)
        if node.op_type in _BROADCAST:
            sizes = [self._cached_estimate(v, depth + 1) for v in node.inputs if v is not None]
            return max(sizes) if sizes else None
        return None

    # -- cost ----------------------------------------------------------------------------------------
    def label(self, ref: int | str, labels: list[bool]) -> bool:
        return ref == _S if isinstance(ref, str) else labels[ref]

    def cost(self, labels: list[bool], *, terms: list[_ValueTerm] | None = None,
             variables: list[int] | None = None) -> Cost:
        """Bytes per run of a labelling (True = low): of the whole scope, or of one component."""
        cast_bytes = casts = 0
        for term in self.terms if terms is None else terms:
            if self._cut_between(term, labels):
                cast_bytes += term.cast_bytes
                casts += 1
        fp32 = sum(self.node_bytes[i] for i in (self.free if variables is None else variables) if not labels[i])
        return Cost(cast_bytes, fp32, casts)

    def _cut_between(self, term: _ValueTerm, labels: list[bool]) -> bool:
        produced = self.label(term.producer, labels)
        return any(labels[c] != produced for c in term.consumers) or any(
            (n == _S) != produced for n in term.fixed_needs)

    def local_costs(self, i: int, labels: list[bool]) -> tuple[int, int]:
        """Bytes of the terms touching node ``i`` with it low, then FP32 (the rest as labelled)."""
        out = []
        was = labels[i]
        try:
            for low in (True, False):
                labels[i] = low
                total = 0 if low else self.node_bytes[i]
                total += sum(t.cast_bytes for t in self._terms_of(i) if self._cut_between(t, labels))
                out.append(total)
        finally:
            labels[i] = was
        return out[0], out[1]

    def _terms_of(self, i: int) -> list[_ValueTerm]:
        if not hasattr(self, "_by_node"):
            self._by_node: dict[int, list[_ValueTerm]] = {}
            for term in self.terms:
                refs = set(term.consumers)
                if not isinstance(term.producer, str):
                    refs.add(term.producer)
                for r in refs:
                    self._by_node.setdefault(r, []).append(term)
        return self._by_node.get(i, [])

    # -- the cut -------------------------------------------------------------------------------------
    def min_cut(self, fixed: dict[int, bool], weight: int = 1) -> list[bool]:
        """Labels (True = low) minimising ``weight × cast bytes + FP32 bytes`` with ``fixed`` nodes
        pinned, by max-flow."""
        labels = list(self.greedy)
        for i, low in fixed.items():
            labels[i] = low
        variables = [i for i in range(len(self.nodes)) if i not in fixed]
        for i in variables:
            labels[i] = False
        for v in self._cut(self.terms, variables, fixed, weight, self.requires):
            labels[v] = True
        return labels

    def _cut(self, terms: list[_ValueTerm], variables: list[int], fixed: Mapping[int, bool], weight: int,
             requires: list[tuple[int, int]] = ()) -> list[int]:
        """The variables that go low in the minimum cut of the network these terms build."""
        def ref(i: int | str) -> int | str:
            if isinstance(i, str):
                return i
            if i in fixed:
                return _S if fixed[i] else _T
            return i

        edges: dict[tuple, int | None] = {}  # (u, v) -> capacity; None is infinite

        def add(u, v, cap: int | None = None) -> None:
            if u == v or u == _T or v == _S:
                return  # never cut (one side, or from the sink side to the source side)
            if cap is not None and cap <= 0:
                return
            if (u, v) in edges:
                old = edges[(u, v)]
                edges[(u, v)] = None if old is None or cap is None else old + cap
            else:
                edges[(u, v)] = cap

        for i in variables:
            add(_S, i, self.node_bytes[i] * _BYTE)  # cut when i stays FP32
            if self.greedy[i]:
                add(_S, i, _GREEDY_TIE)  # cut when i goes FP32
            else:
                add(i, _T, _GREEDY_TIE)  # cut when i goes low
        for term in terms:
            w = term.numel * (CAST_BYTES_PER_ELEMENT * weight * _BYTE + _CAST_TIE)
            p = ref(term.producer)
            cons = {ref(c) for c in term.consumers} | set(term.fixed_needs)
            cons.discard(p)
            if not cons or w <= 0:
                continue
            # producer low, some consumer FP32: one cast, shared through an auxiliary node
            fp32_side = [c for c in cons if c != _S]
            if p != _T and fp32_side:
                if _T in fp32_side or len(fp32_side) == 1:
                    add(p, _T if _T in fp32_side else fp32_side[0], w)
                else:
                    a = ("a", id(term))
                    add(p, a, w)
                    for c in fp32_side:
                        add(a, c)
            # producer FP32, some consumer low: one cast, shared through another auxiliary node
            low_side = [c for c in cons if c != _T]
            if p != _S and low_side:
                if _S in low_side or len(low_side) == 1:
                    add(_S if _S in low_side else low_side[0], p, w)
                else:
                    b = ("b", id(term))
                    add(b, p, w)
                    for c in low_side:
                        add(c, b)
        for i, p in requires:  # i low only if p low: an infinite edge i → p (uncut only if not i∈S, p∈T)
            add(ref(i), ref(p))
        low: list[int] = []
        for component, comp_edges in _components(edges):
            low.extend(_cut_component(component, comp_edges, self.greedy))
        return low

    # -- safety --------------------------------------------------------------------------------------
    def round_trip_nodes(self, labels: list[bool], within: list[int] | None = None) -> set[int]:
        """Low non-allow nodes on a low path from an FP32 reader to an FP32 feeder."""
        candidates = range(len(labels)) if within is None else within
        low = {i for i in candidates if labels[i] and self.cat[i] != Category.ALLOW}
        readers = [i for i in low if self.fp32_source[i] or any(not labels[p] for p in self.preds[i])]
        feeders = [i for i in low if self.fp32_sink[i]
                   or any(not labels[s] for s in (*self.succs[i], *self.trip_succs[i]))]
        if not readers or not feeders:
            return set()
        forward = _reach(readers, self.succs, low)
        backward = _reach(feeders, self.preds, low)
        return forward & backward

    def _forced_cast_bytes(self, terms: list[_ValueTerm], fixed: Mapping[int, bool]) -> int:
        """Cast bytes every labelling with ``fixed`` pays: terms whose producer and some reader (or
        fixed need) are both fixed, to different types."""
        total = 0
        for term in terms:
            p = term.producer
            if isinstance(p, str):
                low = p == _S
            elif p in fixed:
                low = fixed[p]
            else:
                continue
            if any((n == _S) != low for n in term.fixed_needs) or any(
                    c in fixed and fixed[c] != low for c in term.consumers):
                total += term.cast_bytes
        return total

    # -- solving -------------------------------------------------------------------------------------
    def solve(self) -> tuple[list[bool], Outcome]:
        """The cheapest round-trip-safe labelling that casts no more bytes than greedy's, solved
        component by component (the cost is a sum over them, and so are both constraints).

        First the exact optimum of the plain sum (casts + FP32 traffic). Where that casts more
        bytes than greedy (it traded a cast for more FP32 traffic saved), cast bytes are weighted
        up — ×2, ×4, ×16, then lexicographically (any cast byte outweighs all FP32 traffic) — and
        the cut solved again: each answer is the exact optimum of its weighted sum, and the last
        one can never cast more than greedy, whose answer is a feasible labelling. Where a weight's
        first cut already casts within greedy's bytes and only the round-trip repair pushed it over,
        the weight is not what fails: the intermediate weights are skipped and only the
        lexicographic cut is tried before greedy's answer is kept (on a 100k-node chain whose
        residual stream greedy itself runs low, that was 15 max-flows of a 25k-node network for
        greedy's answer; the 40 corpus models place exactly the same casts either way). A heavier
        weight starts from the lighter weights' repair, and a repair that fixes greedy's FP32 nodes
        on an offending path fixes the rest of the path in the same step when those alone leave
        it in place (both cut that chain's component from six max-flows to three, and again
        change no cast on the corpus)."""
        labels = list(self.greedy)
        for i, low in self.fixed.items():
            labels[i] = low
        # the scope's cost is the components' plus that of the terms no free node touches (the same
        # in every labelling): summed, not recounted over the whole scope twice
        in_components = {id(t) for component in self.components for t in component.terms}
        fixed_cost = self.cost(self.greedy, terms=[t for t in self.terms if id(t) not in in_components], variables=[])
        outcome = Outcome(self.scope, fixed_cost, fixed_cost, rounds=0, components=len(self.components))
        for component in self.components:
            greedy, final = self._solve_component(component, labels, outcome)
            outcome.greedy_cost += greedy
            outcome.cost += final
        return labels, outcome

    def _solve_component(self, component: "_Component", labels: list[bool], outcome: Outcome) -> tuple[Cost, Cost]:
        """Label the component's variables; returns its cost under greedy's labels and under ours."""
        variables, terms = component.variables, component.terms
        greedy_cost = self.cost(self.greedy, terms=terms, variables=variables)
        greedy_cast = greedy_cost.cast_bytes
        if greedy_cost.total == 0:
            # greedy's answer costs nothing here (no cast, no FP32 traffic: a bias Add and a Relu
            # between two MatMuls), and departing from it costs its tie-breaks: it is the cut's
            # answer (a greedy-low node reaching the sink would cross a positive edge), so the
            # max-flow is skipped; the round-trip check still applies
            for i in variables:
                labels[i] = self.greedy[i]
            if not self.round_trip_nodes(labels, variables):
                outcome.rounds = max(outcome.rounds, 1)
                return greedy_cost, greedy_cost
        lexicographic = sum(self.node_bytes[i] for i in variables) + 1
        # the fixed labels the component's cut reads (not a copy of the scope-wide dict per component)
        known = {i: self.fixed[i] for i in _references(component) if i in self.fixed}
        weights = [1, 2, 4, 16, lexicographic]
        carried: list[int] = []  # the round-trip repair of the weights tried so far
        while weights:
            weight = weights.pop(0)
            # plus the nodes the round-trip repair fixes FP32; a heavier weight starts from the
            # lighter weights' repair (those nodes lie on round-trip paths whatever casts cost)
            fixed = dict(known)
            for i in carried:
                fixed[i] = False
            repaired: list[int] = list(carried)
            rounds = 0
            within_budget = hopeless = False
            while True:  # cut, then repair round trips (fix offending nodes FP32) until none remain
                rounds += 1
                free = [i for i in variables if i not in fixed]
                for i in free:
                    labels[i] = False
                for i in repaired:
                    labels[i] = False
                for i in self._cut(terms, free, fixed, weight, component.requires):
                    labels[i] = True
                bad = self.round_trip_nodes(labels, variables)
                if not bad:
                    break
                if rounds == 1:  # (only a repaired cut needs its first cut's bytes)
                    within_budget = self.cost(labels, terms=terms, variables=variables).cast_bytes <= greedy_cast
                # prefer the nodes greedy kept FP32 (as safe as greedy); else all of them. Where
                # this labelling with greedy's ones set FP32 still has a round trip, its offending
                # nodes are fixed too, with no cut in between (on a 25k-node residual chain that
                # cut only found the same path again, and it was the dearest of the cuts)
                pick = {i for i in bad if not self.greedy[i]}
                if pick:
                    for i in pick:
                        labels[i] = False
                    pick |= self.round_trip_nodes(labels, variables)
                pick = pick or bad
                for i in sorted(pick):
                    fixed[i] = False
                    repaired.append(i)
                if self._forced_cast_bytes(terms, fixed) > greedy_cast:
                    # the nodes now fixed already force more cast bytes than greedy's answer casts,
                    # in every labelling: this weight's next cut and every later weight's (each
                    # starts from this repair and only fixes more) would be rejected, so greedy's
                    # answer stands without them (on the 100k-node chain: two 25k-node cuts saved)
                    hopeless = True
                    break
            outcome.rounds = max(outcome.rounds, rounds)
            if hopeless:
                break
            cost = self.cost(labels, terms=terms, variables=variables)
            if cost.cast_bytes <= greedy_cast:
                outcome.repaired.extend(repaired)
                outcome.weight = max(outcome.weight, weight)
                return greedy_cost, cost
            if within_budget:
                weights = weights[-1:]
            carried = repaired
        # only the round-trip repair can get here: greedy's answer is as safe and casts less
        for i in variables:
            labels[i] = self.greedy[i]
        outcome.kept_greedy += 1
        outcome.kept_nodes.update(variables)
        return greedy_cost, greedy_cost

    # -- recording -----------------------------------------------------------------------------------
    def apply(self, labels: list[bool], outcome: Outcome, ctx: Context) -> bool:
        low_name = ctx.low.short
        changed = False
        repaired = set(outcome.repaired)
        intact = self._greedy_chains_intact(labels, repaired)
        outputs: dict[int, tuple[Node, list[tuple[int, int, int]]]] = {}  # joined If -> its low outputs
        for i in self.free:
            if i in outcome.kept_nodes:
                continue  # greedy's answer and reason stand
            node = self.nodes[i]
            meta = node.meta
            was = self.greedy[i]
            low_here, fp32_here = self.local_costs(i, labels)
            mine, other = (low_here, fp32_here) if labels[i] else (fp32_here, low_here)
            name, other_name = (low_name, "FP32") if labels[i] else ("FP32", low_name)
            if i in self.branch_nodes:
                if labels[i]:
                    outputs.setdefault(id(node), (node, []))[1].append((self.group_out[i][0], mine, other))
                changed |= labels[i] != was
                continue
            if i in repaired:
                meta["amp.step"] = "safety"
                meta["amp.reason"] = (f"kept FP32: in {low_name} it would lie on a path from an FP32 producer to an "
                                      f"FP32 consumer (an FP32→{low_name}→FP32 round trip {round_trip_harm(ctx.low)})")
            elif i in intact:
                # the cut agrees with the painter here and on the chain the painter's reason cites
                # (``explain`` follows ``via`` back to the rule that decided): that reason stands,
                # with the cut's figures added
                meta["amp.reason"] = (f"{meta.get('amp.reason', '')}; the min-cut placement agrees: {name} moves "
                                      f"{_fmt(mine)} per run here against {_fmt(other)} in {other_name}")
                continue
            else:
                meta["amp.step"] = "optimal"
                meta["amp.reason"] = (f"min-cut placement: {name} moves {_fmt(mine)} per run here against "
                                      f"{_fmt(other)} in {other_name} (casts on edges whose ends differ + extra "
                                      f"FP32 traffic; {'as greedy chose' if labels[i] == was else f'greedy chose {other_name}'})")
            meta["amp.via"] = None
            meta["amp.precision"] = Precision.LOW if labels[i] else Precision.FP32
            changed |= labels[i] != was
        for node, low in outputs.values():
            self._apply_branch(node, low, low_name)
        ctx.log.notes.append(self._note(outcome))
        placement = getattr(ctx.log, "placement", None)
        if placement is None:
            placement = {"mode": "optimal", "scopes": []}
            ctx.log.placement = placement  # type: ignore[attr-defined]
        placement["scopes"].append(self._summary(outcome))
        return changed

    def _apply_branch(self, node: Node, low: list[tuple[int, int, int]], low_name: str) -> None:
        """Record the cut's answer for a joined If with some outputs low: those outputs (and its
        branches' outputs at their positions) take the low type. (An If whose outputs all stay
        FP32 keeps what classify said of it.)"""
        meta = node.meta
        meta["amp.precision"] = Precision.LOW
        meta["amp.branch_outputs"] = sorted(k for k, _, _ in low)
        meta.update({"amp.category": Category.CLEAR, "amp.step": "optimal", "amp.via": None,
                     "amp.source": "optimal placement"})
        names = ", ".join(node.outputs[k].name for k, _, _ in sorted(low))
        mine, other = sum(m for _, m, _ in low), sum(o for _, _, o in low)
        meta["amp.reason"] = (f"control flow: output(s) {names} take {low_name} in both branches (min-cut "
                              f"placement: {_fmt(mine)} per run here against {_fmt(other)} in FP32; one Cast "
                              f"after the If instead of one per branch)")

    def _greedy_chains_intact(self, labels: list[bool], repaired: set[int]) -> set[int]:
        """The nodes whose painter reason still holds: the cut left them, and every node their
        ``via`` chain cites, with greedy's label (and no round-trip repair touched them)."""
        by_label = {node_label(n): i for i, n in enumerate(self.nodes)}
        memo: dict[int, bool] = {}
        for start in self.free:
            path: list[int] = []
            on_path: set[int] = set()
            i: int | None = start
            verdict = True
            while i is not None and i not in memo:  # walk the chain (iteratively: it can be long)
                if i in on_path or labels[i] != self.greedy[i] or i in repaired:
                    verdict = False
                    break
                path.append(i)
                on_path.add(i)
                via = self.nodes[i].meta.get("amp.via")
                if via is None:
                    break
                i = by_label.get(via)
                if i is None:
                    verdict = False
                    break
            else:
                if i is not None:
                    verdict = memo[i]
            for k in path:
                memo[k] = verdict
        return {i for i in self.free if memo.get(i)}

    def _note(self, outcome: Outcome) -> str:
        from .base import scope_label

        c, g = outcome.cost, outcome.greedy_cost
        head = f"optimal placement ({scope_label(self.scope)}): "
        extra = []
        if outcome.weight != 1:
            extra.append(f"cast bytes weighted up to ×{outcome.weight} to cast no more than greedy")
        if outcome.repaired:
            extra.append(f"{len(outcome.repaired)} node(s) fixed FP32 against round trips")
        if outcome.kept_greedy:
            extra.append(f"greedy's answer kept in {outcome.kept_greedy} component(s) where the round-trip-safe cut "
                         f"cast more")
        # (the cut's own figures: cast placement then folds and retargets the model's own casts, so
        # the casts it inserts, and their bytes, are what the summary's "casts inserted" line says)
        holder = self.scope.parent
        # (the summary's cast bytes count a body's casts times its trip count where it is known)
        unit = "per run" if holder is None else "per iteration" if holder.op_type in ("Loop", "Scan") else \
            "per run of the branch"
        return (head + f"cost model: {_fmt(c.cast_bytes)} cast + {_fmt(c.fp32_bytes)} FP32 traffic {unit} against "
                f"greedy's {_fmt(g.cast_bytes)} + {_fmt(g.fp32_bytes)} ({c.casts} crossings against {g.casts}, before "
                f"the model's own casts are folded; symbolic dims "
                f"counted as {SYMBOLIC_DIM}, batch (named, or an unnamed leading dim) as {BATCH_DIM}; {len(self.free)} free nodes in "
                f"{outcome.components} independent cut(s)" + "".join(f"; {e}" for e in extra) + ")")

    def _summary(self, outcome: Outcome) -> dict:
        from .base import scope_label

        return {"scope": scope_label(self.scope), "free_nodes": len(self.free), "rounds": outcome.rounds,
                "components": outcome.components, "kept_greedy": outcome.kept_greedy, "repaired": [node_label(self.nodes[i]) for i in outcome.repaired],
                "cast_bytes": outcome.cost.cast_bytes, "fp32_bytes": outcome.cost.fp32_bytes,
                "casts": outcome.cost.casts, "cast_weight": outcome.weight, "greedy_cast_bytes": outcome.greedy_cost.cast_bytes,
                "greedy_fp32_bytes": outcome.greedy_cost.fp32_bytes, "greedy_casts": outcome.greedy_cost.casts}


# -- helpers -------------------------------------------------------------------------------------------------
def _fresh_dims(shape: tuple) -> int:
    """How many dims onnx's shape inference named afresh because it could not compute them
    (``unk__7``)."""
    return sum(1 for d in shape if isinstance(d, str) and d.startswith("unk__"))


@functools.lru_cache(maxsize=4096)
def _cached_numel(shape: tuple) -> int:
    return estimate_numel(shape)


def _shape_numel(shape) -> int:
    """:func:`estimate_numel`, read once per distinct shape (a 100k-node graph has a handful)."""
    try:
        return _cached_numel(shape)
    except TypeError:  # (an unhashable shape: a list)
        return estimate_numel(shape)


def estimate_numel(shape: tuple) -> int:
    """Elements of a tensor of ``shape`` at the default sizes for symbolic dimensions."""
    n = 1
    for k, d in enumerate(shape):
        if isinstance(d, int):
            n *= max(d, 0)
        elif isinstance(d, str) and _BATCH.search(d):
            n *= BATCH_DIM
        elif k == 0 and len(shape) >= 2 and (d is None or d.startswith("unk__")):
            n *= BATCH_DIM  # an unnamed leading dim of an activation: its batch
        else:
            n *= SYMBOLIC_DIM
    return n


def _is_float_cast_of_non_fp32(node: Node | None) -> bool:
    if node is None or node.op_type != "Cast" or node.domain != "" or not node.inputs:
        return False
    source = node.inputs[0]
    return node.attrs.get("to") == int(DType.FLOAT) and source is not None and source.dtype is not None \
        and source.dtype != DType.FLOAT


_WEIGHT_MOVERS = {"Gather", "GatherElements", "GatherND", "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Slice",
                  "Split", "Identity", "Flatten", "Expand", "Tile", "Concat", "Cast"}


def _is_cast_of_weights(node: Node | None) -> bool:
    """``Cast(to=FLOAT)`` of an FP32 value that only moves weights (a position-embedding row
    gathered from its table): its elements are weights, whose range the offline conversion checks,
    so retargeting the Cast to the low type exposes no activation to the low type's range."""
    if node is None or node.op_type != "Cast" or node.domain != "" or node.attrs.get("to") != int(DType.FLOAT):
        return False
    return _only_weights(node.inputs[0], depth=0) if node.inputs else False


_MULTIPLYING = {"Mul", "mul"}
_DIVIDING = {"Div", "div", "true_divide"}
_ACTIVATION = object()  # (an operand of unknown magnitude, one that fits the low type)
_FP32_RANGE = 3.0e38


def _may_grow_past(node: Node, slots: frozenset, limit: float, bounds: dict[int, float | None]) -> bool:
    """Whether an elementwise Mul/Div/Add/Sub/Sum may make a value past the low type's range
    (``limit``) from inputs that fit it. Two activations may (a residual sum, 36000 + 30000). One
    activation scaled or shifted by constants may where they can grow it: a factor or addend above
    1 in magnitude, a divisor below 1 (Gemma's embedding times sqrt(hidden) made 15000 into 84853);
    constants and weights a Gather/Slice moves alone may where their proven bound passes the range
    (an embedding plus a position table). A constant of unknown magnitude counts as one that may."""
    # per operand: (position: input index or fx slot, largest magnitude or _ACTIVATION, smallest or None)
    operands: list[tuple[object, object, float | None]] = []
    slot_of = node.meta.get("fx.slots")
    for k in sorted(slots):
        value = node.inputs[k]
        if value is None:
            continue
        position = slot_of[k].where if slot_of is not None and k < len(slot_of) else k
        if not (value.data_known or _only_weights(value, 0)):
            operands.append((position, _ACTIVATION, None))
            continue
        # (a smallest is known for a constant's own data; weights a Gather moves have a largest only)
        stats = _stats(value) if value.data_known else None
        operands.append((position, _bound(value, bounds, 0), stats.get("min_abs") if stats else None))
    operands += [(position, abs(number), abs(number)) for position, number in node.meta.get("amp.scalars", ())]
    activations = sum(1 for _, b, _ in operands if b is _ACTIVATION)
    if limit >= _FP32_RANGE:  # (BF16 holds what FP32 does: a constant that grows it past overflows FP32 alike)
        return activations >= 2
    if activations >= 2 or any(b is None for _, b, _ in operands):
        return True
    known = [b for _, b, _ in operands if b is not _ACTIVATION]
    op = node.op_type
    if op in _MULTIPLYING:
        product = 1.0
        for b in known:
            product *= b
        return product > 1 if activations else product > limit
    if op in _DIVIDING:
        divisor = next(((b, least) for p, b, least in operands if p in _DIVISOR_SLOTS), None)
        dividend = next((b for p, b, _ in operands if p in (0, ("args", 0), ("kwargs", "input"))), None)
        if divisor is None or divisor[0] is _ACTIVATION or dividend is None or not divisor[1]:
            return True  # (a reciprocal of an activation, a divisor that may be near 0, or a form not recognised)
        return 1 / divisor[1] > 1 if dividend is _ACTIVATION else dividend / divisor[1] > limit
    total = sum(known)
    return total > 1 if activations else total > limit


_DIVISOR_SLOTS = (1, ("args", 1), ("kwargs", "other"))


def _stats(value: Value) -> dict | None:
    """max_abs (and, for a small tensor, min_abs) of a constant's data; the torch frontend fills
    them as it reads each tensor, the ONNX one here on first ask. None where unknown (no data, or
    an ONNX tensor over 2**27 elements, not scanned)."""
    if value.const_stats is not None:
        return value.const_stats
    try:
        from ..frontends.onnx_loader import constant_array

        if (value.numel or 0) > 1 << 27:
            return None
        data = constant_array(value)
    except Exception:  # noqa: BLE001 - not an ONNX constant, or unreadable: unknown
        return None
    if data is None or data.dtype.kind != "f" or data.size == 0:
        return None
    import numpy as np

    finite = data if bool(np.isfinite(data).all()) else data[np.isfinite(data)]
    if finite.size == 0:
        return None
    stats = {"max_abs": float(max(abs(float(finite.max())), abs(float(finite.min()))))}
    if finite.size <= 1 << 16:
        stats["min_abs"] = float(np.abs(finite).min())
    value.const_stats = stats
    return stats


def _bound(value: Value, bounds: dict[int, float | None], depth: int) -> float | None:
    """The largest magnitude a constant, or weights moved by Gather/Slice/Reshape/Concat..., can
    hold; None where unknown."""
    key = id(value)
    if key in bounds:
        return bounds[key]
    found: float | None = None
    if value.data_known:
        stats = _stats(value)
        found = stats.get("max_abs") if stats else None
    elif value.producer is not None and depth <= 8 and value.producer.op_type in _WEIGHT_MOVERS:
        floats = [v for v in value.producer.inputs if v is not None and v.dtype is not None and v.dtype.is_float]
        parts = [_bound(v, bounds, depth + 1) for v in floats]
        found = max(parts) if parts and all(p is not None for p in parts) else None
    bounds[key] = found
    return found


def _only_weights(value: Value | None, depth: int) -> bool:
    if value is None or value.dtype is None or not value.dtype.is_float:
        return True  # indices, shapes: not float data
    if value.is_constant:
        return True
    node = value.producer
    if node is None or depth > 8 or node.domain != "" or node.op_type not in _WEIGHT_MOVERS:
        return False
    if node.op_type == "Cast" and node.attrs.get("to") != int(DType.FLOAT):
        return False
    return all(_only_weights(v, depth + 1) for v in node.inputs)


def _moves_weights(value: Value | None, depth: int) -> bool:
    """``value`` holds weights or constants only, moved or combined by ops that read nothing else: an
    ONNX Gather of a table, a torch ``index``/``view`` of a buffer, the ratio ``a_t / a_prev`` of two
    schedule entries (:func:`_only_weights` for either frontend)."""
    if value is None or value.dtype is None or not value.dtype.is_float or value.is_constant \
            or "fx.lifted_tensor" in value.meta:
        return True
    node = value.producer
    if node is None or depth > 8 or not node.inputs or node.all_subgraphs() \
            or node.meta.get("amp.category") not in (Category.CLEAR, Category.INFER):
        return False
    return all(_moves_weights(v, depth + 1) for v in node.inputs)


def _fp32_outputs(node: Node) -> list[int]:
    return [k for k, v in enumerate(node.outputs) if v.dtype == DType.FLOAT]


def _joined_ifs(scope: Graph, ctx: Context) -> tuple[list[Node], list[Graph]]:
    """The If nodes of ``scope`` (and, recursively, of their branches) solved together with it,
    and their branch bodies. An If whose FP32 outputs every branch produces with a node of its
    own (not a graph input, an outer value or a constant, which it cannot retype) joins: its
    outputs may then take the low type, one Cast after the If instead of one per branch, and the
    outer values its branches read are read in whatever type the cut gives them. An If a rule
    keeps FP32 (a deny entry, ``--fp32-nodes``) does not join. Loop and Scan bodies, whose
    carried values tie iterations together, stay scopes of their own (FP32 boundary), as does
    everything in training mode."""
    if ctx.options.training:
        return [], []
    branches: list[Node] = []
    bodies: list[Graph] = []
    pending = [scope]
    while pending:
        graph = pending.pop()
        for node in graph.nodes:
            if _joins(node):
                subs = node.all_subgraphs()
                branches.append(node)
                bodies.extend(subs)
                pending.extend(subs)
    return branches, bodies


def _joins(node: Node) -> bool:
    """Whether an If joins the problem of its scope (see :func:`_joined_ifs`)."""
    if node.op_type != "If" or node.domain != "" or node.meta.get("amp.control_category") not in (
            Category.ALLOW, Category.INFER, Category.CLEAR):
        return False  # (a rule file or --fp32-nodes keeps it FP32)
    outputs = _fp32_outputs(node)
    subs = node.all_subgraphs()
    if not outputs or len(subs) != 2 or any(len(g.outputs) != len(node.outputs) for g in subs):
        return False
    return all(g.outputs[k].dtype == DType.FLOAT and g.outputs[k].producer is not None
               and g.outputs[k].producer.graph is g and g.outputs.count(g.outputs[k]) == 1
               and _painted_output(g.outputs[k]) for g in subs for k in outputs)


def _painted_output(value: Value) -> bool:
    """Whether a branch output comes from a node the cut sees it leave (a painted node's group
    output). One that does not (a node classify fixed FP32 for reading a constant past the low
    range, one that keeps its types) would make no term, and the If's output, free of it, could
    take the low type and cast that branch's FP32 result down (inf)."""
    producer = value.producer  # (not None: _joins checked)
    if not producer.domain and producer.op_type in ("Constant", "Cast"):
        return True  # (a constant is converted, a Cast retargeted: either writes the If's type)
    if not producer.domain and producer.op_type == "If":
        return _joins(producer) and value.producer_index in _fp32_outputs(producer)  # (a nested If, joined too)
    return participates(producer) and value.producer_index in group_outputs(producer)


def _references(component: _Component) -> set[int]:
    """The node indices a component's cut refers to: its variables and the ends of its terms."""
    refs = set(component.variables)
    for term in component.terms:
        if isinstance(term.producer, int):
            refs.add(term.producer)
        refs.update(term.consumers)
    for pair in component.requires:
        refs.update(pair)
    return refs


def _components(edges: dict[tuple, int | None]) -> list[tuple[set, list]]:
    """Split the flow network at its terminals: each weakly connected group of variables (and
    auxiliary nodes) is an independent cut. Returns (variables and aux nodes, edges) per group."""
    parent: dict = {}

    def find(x):
        parent.setdefault(x, x)
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for (u, v) in edges:
        for x in (u, v):
            if x not in (_S, _T):
                find(x)
        if u not in (_S, _T) and v not in (_S, _T):
            ru, rv = find(u), find(v)
            if ru != rv:
                parent[ru] = rv
    groups: dict = {}
    for x in parent:
        groups.setdefault(find(x), (set(), []))[0].add(x)
    for (u, v), cap in edges.items():
        inner = u if u not in (_S, _T) else v
        if inner in (_S, _T):
            continue  # S→T: a constant, in every cut
        groups[find(inner)][1].append((u, v, cap))
    return list(groups.values())


def _cut_component(nodes: set, edges: list, greedy: list[bool]) -> list[int]:
    """The variables of one component that go low (the source side of its minimum cut)."""
    variables = [v for v in nodes if isinstance(v, int)]
    if len(nodes) == 1 and len(variables) == 1:
        # one variable: compare the two ways of cutting it directly
        i = variables[0]
        if any(c is None and v == _T for u, v, c in edges):
            return []  # must stay FP32
        if any(c is None and u == _S for u, v, c in edges):
            return [i]  # must go low
        to_fp32 = sum(c for u, v, c in edges if u == _S)  # paid when it stays FP32
        to_low = sum(c for u, v, c in edges if v == _T)  # paid when it goes low
        low = to_fp32 > to_low or (to_fp32 == to_low and greedy[i])
        return [i] if low else []
    if len(nodes) <= _ENUMERATE_CUTS_UP_TO:
        source_side = _largest_minimum_cut(nodes, edges)
        if source_side is not None:
            return [v for v in source_side if isinstance(v, int)]
    return [v for v in _max_flow_source_side(nodes, edges) if isinstance(v, int)]


def _max_flow_source_side(nodes: set, edges: list) -> set:
    """The source side of the minimum cut networkx's ``minimum_cut`` returns (the nodes that
    cannot reach the sink in the residual network after a maximum flow, by Boykov–Kolmogorov),
    computed on a residual network built here in one pass: ``minimum_cut`` would build the
    capacity graph, copy it into the residual network, then remove and re-add the saturated edges
    — three quarters of the time on a 25k-node cut. (Infinite capacities become three times the
    sum of the finite ones, as in ``build_residual_network``.)"""
    inf = 3 * sum(cap for _, _, cap in edges if cap is not None) or 1
    caps: dict[tuple, int] = {}
    for u, v, cap in edges:
        caps[(u, v)] = inf if cap is None else min(cap, inf)
    # A node joined to both terminals (its FP32 traffic from the source, a tie-break to the sink)
    # sends min(a, b) straight through: that flow is in every maximum flow, so it is pushed here
    # and only the rest left to Boykov-Kolmogorov, which otherwise found those paths one by one,
    # each time walking a terminal's whole adjacency from the start again (a chain of 4000 Ifs:
    # a 12k-node cut, 7 s, quadratic). Their reverse residual edges (into the source, out of the
    # sink) cannot change which nodes reach the sink at a maximum flow, and are left out.
    for n in nodes:
        a, b = caps.get((_S, n)), caps.get((n, _T))
        if a is not None and b is not None and a < inf and b < inf:
            through = min(a, b)
            for key, left in (((_S, n), a - through), ((n, _T), b - through)):
                if left:
                    caps[key] = left
                else:
                    del caps[key]
    for u, v in list(caps):
        caps.setdefault((v, u), 0)  # every residual edge has its reverse
    residual = nx.DiGraph()
    residual.__networkx_cache__ = None  # (as build_residual_network: no caching)
    residual.add_nodes_from(nodes)
    residual.add_nodes_from((_S, _T))
    residual.add_edges_from((u, v, {"capacity": cap}) for (u, v), cap in caps.items())
    residual.graph["inf"] = inf
    terminals = nx.DiGraph()
    terminals.add_nodes_from((_S, _T))
    nx.algorithms.flow.boykov_kolmogorov(terminals, _S, _T, residual=residual, value_only=True)
    # the sink side: what reaches the sink through unsaturated residual edges
    pred = residual.pred
    sink_side = {_T}
    stack = [_T]
    while stack:
        v = stack.pop()
        for u, d in pred[v].items():
            if u not in sink_side and d["flow"] < d["capacity"]:
                sink_side.add(u)
                stack.append(u)
    return {n for n in residual if n not in sink_side}


def _largest_minimum_cut(nodes: set, edges: list) -> set | None:
    """The source side of a minimum cut, by trying every side for each of the few ``nodes``: of the
    minimum cuts, the one with the largest source side (the union of theirs, a minimum cut too).
    That is the side ``nx.minimum_cut`` returns, whatever the flow algorithm: the nodes that cannot
    reach the sink in the residual network. None when every cut is infinite (networkx raises)."""
    order = list(nodes)
    best: int | None = None
    largest: set = set()
    for mask in range(1 << len(order)):
        side = {node for k, node in enumerate(order) if mask >> k & 1}
        value: int | None = 0
        for u, v, cap in edges:
            if (u == _S or u in side) and v != _S and v not in side:  # from the source side to the sink side
                if cap is None:
                    value = None
                    break
                value += cap
        if value is None:
            continue
        if best is None or value < best:
            best, largest = value, side
        elif value == best:
            largest |= side
    return largest if best is not None else None


def _reach(roots: list[int], neighbours: list[set[int]], within: set[int]) -> set[int]:
    seen = set(roots)
    stack = list(roots)
    while stack:
        current = stack.pop()
        for nxt in neighbours[current]:
            if nxt in within and nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return seen


def _refresh_islands(model: Model, ctx: Context) -> None:
    """Islands were found on greedy's paint; recompute them on the new precisions."""
    from .islands import find_islands

    for node in model.graph.walk():
        node.meta.pop("amp.island", None)
    ctx.log.islands.clear()
    find_islands(model, ctx)


def _fmt(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)
