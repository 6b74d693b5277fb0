"""An FP32 model that computes what a mixed FP16/BF16 model computes on a GPU, for checks on a CPU.

onnxruntime's CPU provider has few FP16 kernels and no BF16 arithmetic ones. It runs an FP16 model
by giving the nodes it lacks kernels for FP32 ones and, where the casts it inserts around them
meet (FP32 → FP16 → FP32), removing both: the values between such nodes are never rounded to FP16
and never overflow. A check run there passes models that lose precision or overflow on a GPU. A BF16
model does not load at all (no BF16 MatMul).

:func:`emulate_low` rewrites the model so the CPU provider computes the GPU's numerics, the way
GPU kernels read and write 16-bit tensors and compute in FP32 inside (cuBLAS GEMMs with FP32
accumulation, elementwise kernels that convert on load and store):

- low-precision initializers and Constant / ConstantOfShape tensors become their exact FP32 values,
  every low type declared (graph inputs and outputs, value_info, sequence and optional element
  types, in every body) becomes FP32, and so does a ``dtype`` attribute naming it (EyeLike,
  RandomNormal, SequenceEmpty...);
- every value the model holds in the low type is rounded to it where it is made — a
  ``Cast(to=low)`` then ``Cast(to=FLOAT)`` written in the model, which the CPU provider runs as
  written — and carried as FP32: every rounding (and overflow to ±inf) the model does happens, and
  no other; a low graph input is rounded where it enters;
- a ``Cast(to=low)`` keeps its rounding and gains the ``Cast(to=FLOAT)`` after it; a
  ``Cast(to=FLOAT)`` of a former low value becomes an Identity.

Value names do not change (a value's rounded copy carries its name), so the FP32 model's values
and the emulated ones compare by name. An edge module: it imports onnx and numpy.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import AttributeProto, TensorProto, helper, numpy_helper

from .frontends.onnx_loader import _graph_protos

FLOAT = TensorProto.FLOAT
LOW_TYPES = (TensorProto.FLOAT16, TensorProto.BFLOAT16)


def emulate_low(model: onnx.ModelProto, low: int | None = None) -> tuple[onnx.ModelProto, set[str]]:
    """(the FP32 emulation of ``model``, the names of the values it holds in the low type).

    ``low``: TensorProto.FLOAT16 or BFLOAT16; by default whichever the model uses (FP16 if both)."""
    model = _inlined(model)
    types, shapes = _value_types(model)
    if low is None:
        used = set(types.values())
        low = next((t for t in LOW_TYPES if t in used), TensorProto.FLOAT16)
    return _emulate(model, types, {low}, shapes)


def emulate_all(model: onnx.ModelProto, notes: list[str] | None = None) -> tuple[onnx.ModelProto, set[str]]:
    """:func:`emulate_low` for every low type the model holds at once (a BF16 rewrite of a model
    with FP16 parts of its own holds both); the names rounded to either. ``notes``: where given,
    :func:`not_emulated`'s notes are appended to it (from the same type inference)."""
    model = _inlined(model)
    types, shapes = _value_types(model)
    emulated = _emulate(model, types, set(LOW_TYPES), shapes)
    if notes is not None:
        notes += _not_emulated(model, types)
    return emulated


# ops whose GPU kernels keep an intermediate in the low type, which the emulation (one rounding per
# output) computes in FP32: (domain, op) → what is not emulated
_LOW_INTERNALS = {
    ("", "LSTM"): "keeps the hidden and cell state in {low} between time steps (rounding compounds with "
                  "sequence length)",
    ("", "GRU"): "keeps the hidden state in {low} between time steps (rounding compounds with sequence length)",
    ("", "RNN"): "keeps the hidden state in {low} between time steps (rounding compounds with sequence length)",
    ("", "CumSum"): "keeps its running sum in {low} (a sum of 4096 ones stops at 2048 in fp16)",
    ("com.microsoft", "Attention"): "writes the QKV projection to a buffer of {low} (a projection past the "
                                    "range is inf there)",
}


def not_emulated(model: onnx.ModelProto) -> list[str]:
    """What :func:`emulate_low` computes more exactly than a GPU would, as notes: low-precision nodes
    whose CUDA kernels keep an intermediate in the low type (:data:`_LOW_INTERNALS`), which the
    emulation computes in FP32 and rounds at the outputs only; and values of custom-domain nodes
    reading a low value whose type onnx's inference does not know (no value_info), which it cannot
    round. Empty for a rewrite of amp-rewrite's own with no such node."""
    model = _inlined(model)
    return _not_emulated(model, _value_types(model)[0])


def _not_emulated(model: onnx.ModelProto, types: dict[str, int]) -> list[str]:
    names = {TensorProto.FLOAT16: "fp16", TensorProto.BFLOAT16: "bf16"}
    found: dict[tuple[str, str], list[str]] = {}  # (op, what its kernel keeps low) → node labels
    untyped: list[tuple[str, str]] = []
    for g in _graph_protos(model.graph):
        for n in g.node:
            reads = [types.get(i) for i in n.input if i]
            low = next((t for t in reads if t in LOW_TYPES), None)
            if low is None:
                continue
            key = (n.domain if n.domain not in ("ai.onnx",) else "", n.op_type)
            if key in _LOW_INTERNALS:
                label = f"{n.op_type}:{n.name or n.output[0]}"
                found.setdefault((n.op_type, _LOW_INTERNALS[key].format(low=names[low])), []).append(label)
            elif n.domain not in ("", "ai.onnx"):
                untyped += [(o, f"{n.domain}:{n.op_type}") for o in n.output if o and o not in types]
    notes = []
    for (op, text), labels in found.items():
        notes.append(f"{len(labels)} low-precision {op} node(s) (e.g. {labels[0]}): the CUDA kernel {text}; the "
                     f"emulation computes that in FP32 and rounds only the outputs, so this check does not see it "
                     f"(keep the node FP32 with --fp32-nodes, or check on a GPU)")
    if untyped:
        name, op = untyped[0]
        notes.append(f"{len(untyped)} value(s) of custom-domain nodes reading low-precision inputs have no known "
                     f"element type (e.g. {name!r} of {op}; the model has no value_info for them): the emulation "
                     f"does not round them")
    return notes


def _inlined(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with its model-local functions inlined: a body holds its own low values and Casts,
    which are then typed and rounded like any other (left in the function, a body widened at its
    call met its own FP16 Cast, and onnxruntime refused the emulation). Main-graph names stay."""
    if not len(model.functions):
        return model
    from onnx import inliner

    from .frontends.onnx_functions import with_default_attributes

    return inliner.inline_local_functions(with_default_attributes(model))


def _value_types(model: onnx.ModelProto) -> tuple[dict[str, int], dict[str, onnx.TensorShapeProto]]:
    """Element type by value name, model-wide (names are unique in a rewritten model), and the
    shapes inference knows."""
    from .frontends.onnx_loader import _without_weights

    # (on the structure: inference serialises its input, and a model past 2 GB does not serialise)
    inferred = onnx.shape_inference.infer_shapes(_without_weights(model), strict_mode=False)
    types: dict[str, int] = {}
    shapes: dict[str, onnx.TensorShapeProto] = {}
    for g in _graph_protos(inferred.graph):
        for vi in [*g.input, *g.output, *g.value_info]:
            if vi.type.HasField("tensor_type"):
                types[vi.name] = vi.type.tensor_type.elem_type
                if vi.type.tensor_type.HasField("shape"):
                    shapes[vi.name] = vi.type.tensor_type.shape
        for t in g.initializer:
            types[t.name] = t.data_type
        for n in g.node:
            if n.op_type == "Cast" and n.domain in ("", "ai.onnx") and n.output:
                types[n.output[0]] = _attr(n, "to")
    return types, shapes


def _emulate(model: onnx.ModelProto, types: dict[str, int], lows: set[int],
             shapes: dict[str, onnx.TensorShapeProto]) -> tuple[onnx.ModelProto, set[str]]:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    rounded: set[str] = set()
    taken = {name for g in _graph_protos(out.graph) for name in _names(g)}
    _Rewriter(types, lows, rounded, taken, shapes).graph(out.graph)
    return out, rounded


class _Rewriter:
    def __init__(self, types: dict[str, int], lows: set[int], rounded: set[str], taken: set[str],
                 shapes: dict[str, onnx.TensorShapeProto]) -> None:
        self.types, self.lows, self.rounded, self.taken = types, lows, rounded, taken
        self.shapes = shapes
        self.counter = 0
        # value_info for the names a scope's rounding makes, with the shape of the value they stand
        # for: onnxruntime's planner otherwise trusts its own inference for them, which for
        # GroupQueryAttention's present (past's shape, as if sharing its buffer) was too small
        self.declared: list[onnx.ValueInfoProto] = []

    def _declare(self, name: str, like: str, elem_type: int) -> None:
        shape = self.shapes.get(like)
        if shape is not None:
            info = onnx.ValueInfoProto(name=name)
            info.type.tensor_type.elem_type = elem_type
            info.type.tensor_type.shape.CopyFrom(shape)
            self.declared.append(info)

    def fresh(self, base: str) -> str:
        while True:
            self.counter += 1
            name = f"{base}/amp_emu{self.counter}"
            if name not in self.taken:
                self.taken.add(name)
                return name

    def graph(self, graph: onnx.GraphProto) -> None:
        for t in graph.initializer:
            if t.data_type in self.lows:
                t.CopyFrom(_widened(t))
        for vi in [*graph.output, *graph.value_info]:
            _widen_type(vi.type, self.lows)
        nodes: list[onnx.NodeProto] = []
        for vi in graph.input:  # a low input is rounded where it enters, then carried as FP32
            low = _widen_type(vi.type, self.lows)
            if low is not None and vi.type.HasField("tensor_type"):
                nodes.extend(self._round_in_place(vi.name, low, graph))
        outer, self.declared = self.declared, []
        for node in graph.node:
            nodes.extend(self.node(node))
        del graph.node[:]
        graph.node.extend(nodes)
        graph.value_info.extend(self.declared)
        self.declared = outer

    def _round_in_place(self, name: str, low: int, graph: onnx.GraphProto) -> list[onnx.NodeProto]:
        """Round graph input ``name``: its readers read a rounded copy under a fresh name. (An input
        that is also a graph output passes through as fed: the check feeds it rounded.)"""
        fresh = self.fresh(name)
        for g in _graph_protos(graph):  # (bodies read it too, as an outer-scope value)
            for node in g.node:
                for i, x in enumerate(node.input):
                    if x == name:
                        node.input[i] = fresh
        self.rounded.add(name)
        mid = self.fresh(name)
        return [helper.make_node("Cast", [name], [mid], to=low, name=self.fresh("amp_emu_round")),
                helper.make_node("Cast", [mid], [fresh], to=FLOAT, name=self.fresh("amp_emu_back"))]

    def node(self, node: onnx.NodeProto) -> list[onnx.NodeProto]:
        for attr in node.attribute:
            if attr.type == AttributeProto.GRAPH:
                self.graph(attr.g)
            elif attr.type == AttributeProto.GRAPHS:
                for g in attr.graphs:
                    self.graph(g)
            elif attr.type == AttributeProto.TENSOR and attr.t.data_type in self.lows:
                attr.t.CopyFrom(_widened(attr.t))
            elif attr.type == AttributeProto.SPARSE_TENSOR and attr.sparse_tensor.values.data_type in self.lows:
                attr.sparse_tensor.values.CopyFrom(_widened(attr.sparse_tensor.values))
            elif attr.type == AttributeProto.INT and attr.name == "dtype" and attr.i in self.lows:
                attr.i = FLOAT  # EyeLike, RandomNormal, SequenceEmpty...: made FP32, rounded after
            elif attr.type == AttributeProto.TYPE_PROTO:
                _widen_type(attr.tp, self.lows)  # Optional(type=...)
        is_cast = node.op_type == "Cast" and node.domain in ("", "ai.onnx")
        if is_cast and _attr(node, "to") == FLOAT and self.types.get(node.input[0]) in self.lows:
            return [helper.make_node("Identity", [node.input[0]], list(node.output), name=node.name)]
        low_outputs = [o for o in node.output if o and self.types.get(o) in self.lows]
        if not low_outputs:
            return [node]
        if node.op_type == "Sum" and node.domain in ("", "ai.onnx") and len(node.input) > 2:
            return self._sum_pairwise(node, self.types[node.output[0]])
        renamed = {o: self.fresh(o) for o in low_outputs}
        made = onnx.NodeProto()
        made.CopyFrom(node)
        del made.output[:]
        made.output.extend(renamed.get(o, o) for o in node.output)
        nodes = [made]
        for o in low_outputs:
            self.rounded.add(o)
            if is_cast:  # Cast(to=low) rounds already: back to FLOAT
                nodes.append(helper.make_node("Cast", [renamed[o]], [o], to=FLOAT, name=self.fresh("amp_emu_back")))
                continue
            nodes.extend(self._rounding(renamed[o], o, self.types[o], like=o))
        return nodes

    def _rounding(self, raw: str, out: str, low: int, like: str | None) -> list[onnx.NodeProto]:
        """``out`` = ``raw`` rounded to ``low`` and carried as FP32 (Cast there and back); the names
        made are declared with the shape of value ``like`` where given."""
        mid = self.fresh(out)
        if like is not None:
            self._declare(raw, like, FLOAT)
            self._declare(mid, like, low)
        return [helper.make_node("Cast", [raw], [mid], to=low, name=self.fresh("amp_emu_round")),
                helper.make_node("Cast", [mid], [out], to=FLOAT, name=self.fresh("amp_emu_back"))]

    def _sum_pairwise(self, node: onnx.NodeProto, low: int) -> list[onnx.NodeProto]:
        """A low Sum of k > 2 inputs as onnxruntime's CUDA kernel computes it: each partial sum is
        held in the low type (``output = in0 + in1; output = output + in_k``), so 40000 + 40000 -
        40000 is inf in FP16, where one rounding of the FP32 sum gave 40000."""
        nodes: list[onnx.NodeProto] = []
        acc = node.input[0]
        for k, x in enumerate(node.input[1:], start=1):
            last = k == len(node.input) - 1
            out = node.output[0] if last else self.fresh(node.output[0])
            raw = self.fresh(out)
            nodes.append(helper.make_node("Sum", [acc, x], [raw], name=node.name if last else self.fresh(node.name)))
            # (a partial sum of broadcast inputs may have another shape: only the last is declared)
            nodes.extend(self._rounding(raw, out, low, like=node.output[0] if last else None))
            acc = out
        self.rounded.add(node.output[0])
        return nodes


def _widened(t: TensorProto) -> TensorProto:
    return numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float32), t.name)


def _widen_type(tp: onnx.TypeProto, lows: set[int]) -> int | None:
    """Make the low element type of ``tp`` (a tensor, or inside a sequence/optional/map) FLOAT;
    the low type it had, or None."""
    which = tp.WhichOneof("value")
    if which == "tensor_type" and tp.tensor_type.elem_type in lows:
        low = tp.tensor_type.elem_type
        tp.tensor_type.elem_type = FLOAT
        return low
    if which == "sequence_type":
        return _widen_type(tp.sequence_type.elem_type, lows)
    if which == "optional_type":
        return _widen_type(tp.optional_type.elem_type, lows)
    if which == "map_type":
        return _widen_type(tp.map_type.value_type, lows)
    return None


def _attr(node: onnx.NodeProto, name: str) -> int | None:
    return next((a.i for a in node.attribute if a.name == name), None)


def _names(graph: onnx.GraphProto) -> set[str]:
    return ({n.name for n in graph.node} | {o for n in graph.node for o in n.output}
            | {v.name for v in graph.input} | {t.name for t in graph.initializer})
