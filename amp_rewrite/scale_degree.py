"""How each value of an ONNX training graph depends on the loss scale (``training_onnx``).

Loss scaling multiplies the backward seed by ``S`` and divides each gradient by ``S`` on the way
out. That is only right where the gradient is *proportional* to ``S``: a backward pass is linear
in its seed, but what a graph computes from the gradients afterwards need not be. In-graph
global-norm clipping, ``g * min(1, max_norm / ||g||)``, gives ``S * g * min(1, max_norm / (S *
||g||))``: divided by ``S`` that is ``1/S`` of the clipped gradient, silently.

A value's *degree* is ``d`` when ``value(S) = S**d * value(1)`` for every ``S > 0``: the seed
scaled is degree 1, a forward value 0, a MatMul of a gradient with a weight 1, ``g * g`` 2, a
comparison of two degree-1 values 0 (a positive factor keeps the order), ``min(1, c / ||g||)``
none at all. The walk below follows the graph in order and, at a node whose output would not be
degree 0 or 1 (or mixes degrees, as ``Add(g, weight)`` does), first divides the node's degree-1
inputs by ``S`` (``unscale``): the node then computes with the true gradients, and everything it
feeds is degree 0. What is degree 1 at a gradient output is divided there, as before.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any, Callable, Collection

import numpy as np

# A constant zero (a gradient of zeros, Where's 0 branch): any degree, so it mixes with all.
ZERO = "zero"
# The inputs that carry the data an op computes with (the others are shapes, indices, axes: degree 0).
_SAME_ALL = frozenset({"Add", "Sub", "Sum", "Mean", "Max", "Min", "Concat", "Neg", "Abs", "Relu", "Identity",
                       "Transpose", "Flatten"})
_SAME_FIRST = frozenset({"Reshape", "Squeeze", "Unsqueeze", "Expand", "Slice", "Gather", "GatherElements", "GatherND",
                         "Split", "Tile", "ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceL1", "ReduceL2",
                         "MaxPool", "AveragePool", "GlobalAveragePool", "GlobalMaxPool", "LeakyRelu", "Dropout",
                         "DepthToSpace", "SpaceToDepth", "Resize", "Upsample", "CumSum", "Trilu", "Compress",
                         "ReverseSequence", "TopK", "Cast", "CastLike"})
_SAME_SLOTS = {"Pad": (0, 2), "ScatterND": (0, 2), "ScatterElements": (0, 2), "Scatter": (0, 2), "Where": (1, 2)}
# multilinear: the degrees add up (Conv's and Gemm's bias must have the result's degree)
_PRODUCT = frozenset({"Mul", "MatMul", "Einsum", "FusedMatMul"})
_BIASED = {"Gemm": 2, "Conv": 2, "ConvTranspose": 2}
# onnxruntime-training's backward ops (ReluGrad, SoftmaxGrad_13, BiasGeluGrad_dX...): linear in the
# incoming gradient; not GradientAccumulator (an Add) or ClipGradNorm, which only name gradients
_GRADIENT_OP = re.compile(r"Grad(_\w+)?$")
# degree 0 whatever the (consistent) degree of what they read: order, sign and shape survive S > 0
_INDEX_OF = frozenset({"Greater", "Less", "Equal", "GreaterOrEqual", "LessOrEqual"})
_ANY_TO_ZERO = frozenset({"ArgMax", "ArgMin", "Sign", "IsInf", "IsNaN", "Shape", "Size", "NonZero"})
_FLOATS = frozenset({1, 10, 11, 16})  # FLOAT, FLOAT16, DOUBLE, BFLOAT16 (Cast's ``to``)


class Degrees:
    """Degrees of the values of ``graph`` in the loss scale, whose input is ``scale``.

    ``unscale(node, slot)`` is called for each degree-1 input of a node that breaks proportionality
    (``ours``: the ids of the nodes the loss-scale builder added, never broken); it must rewire that
    input to the value divided by the scale. ``broken`` lists the nodes it was called for.
    ``on_watched(value)`` is called when a value of ``watched`` (ids) is found degree 1, before
    any node after it in the graph is walked."""

    def __init__(self, graph: Any, scale: Any, ours: set[int],
                 unscale: Callable[[Any, int], None] | None = None, *, watched: Any = (),
                 on_watched: Callable[[Any], None] | None = None, fed: Collection[int] = frozenset()) -> None:
        self.graph = graph
        # ids of initializers also listed as graph inputs (IR >= 4): defaults a caller may feed, so
        # their zeros are not known zeros (an accumulator fed 5.0 came out divided by the scale)
        self.fed = fed
        self.watched = watched  # ids of values handed to on_watched once found degree 1
        self.on_watched = on_watched
        self.ours = ours
        self.unscale = unscale
        self.degree: dict[int, Any] = {id(scale): Fraction(1)} if scale is not None else {}
        self.broken: list[Any] = []
        self.refused: list[tuple[Any, str]] = []  # (node, why) where no unscale can help

    def of(self, value: Any) -> Any:
        if value is None:
            return ZERO
        known = self.degree.get(id(value))
        if known is not None:
            return known
        return ZERO if _is_zero(value, self.fed) else Fraction(0)

    def run(self) -> "Degrees":
        self._walk(self.graph)
        return self

    def _reaches(self, value: Any) -> bool:
        return value is not None and self.degree.get(id(value), 0) not in (ZERO, 0)

    def _walk(self, graph: Any) -> None:
        for node in list(graph):
            held = list(bodies(node))
            if self._loop_at_its_degrees(node, held):
                continue
            for body in held:
                self._walk(body)
            if not any(map(self._reaches, node.inputs)) and not any(
                    self._reaches(out) for body in held for out in body.outputs):
                continue  # reads nothing the scale reaches: degree 0
            if held:
                self._control_flow(node, held)
                continue
            result = _rule(node, [self.of(v) for v in node.inputs])
            if node.op_type == "Pow" and len(node.inputs) > 1 and id(node.inputs[1]) in self.fed:
                result = None  # (an exponent a caller may feed: its value is not known)
            if id(node) in self.ours:
                result = result if result is not None else [Fraction(0)] * len(node.outputs)
            elif result is None or any(d not in (ZERO, 0, 1) for d in result):
                self._break(node)
                result = [Fraction(0)] * len(node.outputs)
            self._set(node, result)

    def _set(self, node: Any, degrees: list[Any]) -> None:
        for out, d in zip(node.outputs, degrees):
            self.degree[id(out)] = d
            if d == 1 and id(out) in self.watched and self.on_watched is not None:
                self.on_watched(out)

    def _break(self, node: Any) -> None:
        if self.unscale is None:
            self.broken.append(node)
            return
        for slot, v in enumerate(node.inputs):
            d = self.of(v)
            if d not in (ZERO, 0):
                if d != 1:  # (not expected: every value the walk leaves is degree 0 or 1)
                    self.refused.append((node, f"reads {v.name!r}, which the loss scale reaches as S^{d}"))
                    continue
                self.unscale(node, slot)
        self.broken.append(node)

    def _loop_at_its_degrees(self, node: Any, held: list[Any]) -> bool:
        """A Loop or Scan given scaled values (a backward pass through time) runs its body on them as
        they are, where every carried value leaves an iteration at the degree it entered with (a
        linear recurrence: ``dh_prev = dh @ Wᵀ``): the body's inputs take the degrees of what the
        node reads, its outputs those of the body's. Anything else (a carried value whose degree
        changes, a body node that cannot be unscaled) leaves it to :meth:`_control_flow`, which
        reads the scaled values divided by the scale. True when it walked the body."""
        if node.op_type not in ("Loop", "Scan") or node.domain not in ("", "ai.onnx") or len(held) != 1:
            return False
        body = held[0]
        if not any(map(self._reaches, node.inputs)):
            return False
        first = 2 if node.op_type == "Loop" else 0  # (a Loop's trip count and condition; a Scan-8's lengths)
        outer = list(node.inputs)[len(node.inputs) - len(body.inputs):] if node.op_type == "Scan" else list(node.inputs)
        pairs = list(zip(outer[first:], list(body.inputs)[first:]))
        shift = 1 if node.op_type == "Loop" else 0  # (a Loop body's first output is its condition)
        n_carried = len(pairs) - ((_attr_int(node, "num_scan_inputs") or 0) if node.op_type == "Scan" else 0)
        carried = [(b, body.outputs[shift + j]) for j, (_, b) in enumerate(pairs[:n_carried])
                   if shift + j < len(body.outputs)]
        seeds = {id(b): d for v, b in pairs if (d := self.of(v)) != 0}
        for _ in range(4):  # (a carried zero takes the degree its iteration gives it: at most once each)
            probe = Degrees(body, None, self.ours, fed=self.fed)
            probe.degree = {**self.degree, **seeds}
            probe._walk(body)
            if probe.refused:
                return False
            settled = True
            for b_in, b_out in carried:
                d_in, d_out = seeds.get(id(b_in), Fraction(0)), probe.of(b_out)
                if d_out == d_in or d_out is ZERO:
                    continue
                if d_in is not ZERO or d_out not in (0, 1):
                    return False  # (an unscaled start mixed with scaled steps, or the reverse)
                if d_out == 0:
                    seeds.pop(id(b_in))
                else:
                    seeds[id(b_in)] = d_out
                settled = False
            if settled:
                break
        else:
            return False
        self.degree.update(seeds)
        self._walk(body)
        outs = [self.of(body.outputs[k + shift]) if k + shift < len(body.outputs) else Fraction(0)
                for k in range(len(node.outputs))]
        self._set(node, outs)
        return True

    def _control_flow(self, node: Any, bodies: list[Any]) -> None:
        """An If's outputs have its branches' degree; a Loop or Scan given a scaled value as a
        carried or scanned input reads it unscaled (its body's own inputs are not followed)."""
        if node.op_type == "If":
            outs = []
            for k in range(len(node.outputs)):
                found = {self.of(b.outputs[k]) for b in bodies if k < len(b.outputs)} - {ZERO}
                if len(found) > 1:
                    self.refused.append((node, "its branches return the gradient at different loss-scale degrees"))
                outs.append(found.pop() if len(found) == 1 else ZERO)
        else:
            if any(self.of(v) not in (ZERO, 0) for v in node.inputs):
                self._break(node)
            shift = 1 if node.op_type == "Loop" else 0
            outs = []
            for k in range(len(node.outputs)):
                found = {self.of(b.outputs[k + shift]) for b in bodies if k + shift < len(b.outputs)} - {ZERO}
                outs.append(found.pop() if len(found) == 1 else Fraction(0))
            carried = len(node.inputs) - 2 if node.op_type == "Loop" else 0
            if any(d not in (ZERO, 0) for d in outs[:max(carried, 0)]):
                self.refused.append((node, "a loop-carried value depends on the loss scale"))
        self._set(node, outs)


def _rule(node: Any, ins: list[Any]) -> list[Any] | None:
    """The outputs' degrees, or None where the node is not proportional to the scale."""
    op, n_out = node.op_type, len(node.outputs)
    if node.domain not in ("", "ai.onnx"):
        if node.domain == "com.microsoft" and (_GRADIENT_OP.search(op) or op in _PRODUCT):
            return [_product(ins)] * n_out  # a gradient op: linear in the incoming gradient
        return None  # (GradientAccumulator, ClipGradNorm... and every op not known: unscaled before)
    if op in ("ScatterND", "ScatterElements") and _attr_str(node, "reduction") == "mul" \
            and ins[2] not in (ZERO, 0):
        return None  # (the updated entries are data x updates: degrees add there, not elsewhere)
    if op in _SAME_ALL or op in _SAME_FIRST or op in _SAME_SLOTS:
        slots = range(len(ins)) if op in _SAME_ALL else (0,) if op in _SAME_FIRST else _SAME_SLOTS[op]
        if op == "Cast" and _attr_int(node, "to") not in _FLOATS:
            return None
        others = [d for k, d in enumerate(ins) if k not in slots]
        if any(d not in (ZERO, 0) for d in others) and op != "CastLike":
            return None
        d = _same([ins[k] for k in slots if k < len(ins)])
        if d is None:
            return None
        index_out = {"TopK": 1, "Dropout": 1, "MaxPool": 1}.get(op)  # (indices, a mask: degree 0)
        return [Fraction(0) if k == index_out or not _float(out) else d for k, out in enumerate(node.outputs)]
    if op in _PRODUCT:
        return [_product(ins)] * n_out
    if op == "PRelu":  # x where x >= 0, x * slope elsewhere: proportional in x for a slope of degree 0
        return [ins[0]] if len(ins) > 1 and ins[1] in (ZERO, 0) else None
    if op in _BIASED:
        d = _product(ins[:2])
        if len(ins) > 2 and _same([d, ins[2]]) is None:
            return None
        return [d] * n_out
    if op == "Div":
        a, b = ins[0], ins[1]
        return [ZERO if a is ZERO else a - (0 if b is ZERO else b)]
    if op == "Reciprocal":
        return [ZERO if ins[0] is ZERO else -ins[0]]
    if op == "Sqrt":
        return [ZERO if ins[0] is ZERO else ins[0] / 2]
    if op == "ReduceSumSquare":
        return [ZERO if ins[0] is ZERO else ins[0] * 2]
    if op == "Pow":
        if ins[1] not in (ZERO, 0):
            return None
        p = _scalar(node.inputs[1])
        if ins[0] is ZERO or p is None:
            return [ZERO] if ins[0] is ZERO else None
        return [ins[0] * Fraction(p).limit_denominator(1000)] if p == p and abs(p) < 1e6 else None
    if op in _INDEX_OF:
        return None if _same(ins) is None else [Fraction(0)] * n_out
    if op in _ANY_TO_ZERO:
        return [Fraction(0)] * n_out
    return None


def _float(value: Any) -> bool:
    """Whether ``value`` may be a float tensor (an untyped one may)."""
    dtype = value.dtype if value is not None else None
    return dtype is None or int(dtype) in _FLOATS


def _same(degrees: list[Any]) -> Any:
    found = {d for d in degrees} - {ZERO}
    if len(found) > 1:
        return None
    return found.pop() if found else ZERO


def _product(degrees: list[Any]) -> Any:
    if any(d is ZERO for d in degrees):
        return ZERO
    return sum(degrees, Fraction(0))


_COPIES = frozenset({"Expand", "Reshape", "Cast", "CastLike", "Squeeze", "Unsqueeze", "Identity", "Tile", "Transpose"})


def _is_zero(value: Any, fed: Collection[int] = frozenset(), depth: int = 0) -> bool:
    """A constant whose every element is 0 (an initializer, a Constant node, a ConstantOfShape),
    or a copy of one (Expand, Reshape, Cast...); not an initializer a caller may feed (``fed``)."""
    if id(value) in fed:
        return False
    tensor = value.const_value
    producer = value.producer()
    if tensor is None and producer is not None and producer.domain in ("", "ai.onnx"):
        if producer.op_type in _COPIES and producer.inputs and producer.inputs[0] is not None and depth < 8:
            return _is_zero(producer.inputs[0], fed, depth + 1)
        if producer.op_type == "ConstantOfShape":
            attr = producer.attributes.get("value")
            if attr is None:
                return True
            tensor = attr.value
        elif producer.op_type == "Constant":
            attr = producer.attributes.get("value")
            tensor = attr.value if attr is not None else None
            if tensor is None:
                for key in ("value_float", "value_floats", "value_int", "value_ints"):
                    if key in producer.attributes:
                        return not np.any(np.asarray(producer.attributes[key].value))
    if tensor is None:
        return False
    try:
        if getattr(tensor, "size", 0) > 1 << 20:
            return False
        return not np.any(tensor.numpy())
    except Exception:  # noqa: BLE001 - an unreadable tensor is simply not known to be zero
        return False


def _scalar(value: Any) -> float | None:
    tensor = value.const_value if value is not None else None
    if tensor is None and value is not None and value.producer() is not None \
            and value.producer().op_type == "Constant":
        attr = value.producer().attributes.get("value") or value.producer().attributes.get("value_float")
        if attr is not None:
            tensor = attr.value
    try:
        array = np.asarray(tensor.numpy() if hasattr(tensor, "numpy") else tensor, dtype=np.float64)
    except Exception:  # noqa: BLE001
        return None
    return float(array.reshape(-1)[0]) if array.size == 1 else None


def _attr_int(node: Any, key: str) -> int | None:
    attr = node.attributes.get(key)
    return int(attr.value) if attr is not None else None


def _attr_str(node: Any, key: str) -> str | None:
    attr = node.attributes.get(key)
    value = attr.value if attr is not None else None
    return value.decode() if isinstance(value, bytes) else value


def bodies(node: Any):
    """The graphs an onnx-ir node holds (an If's branches, a Loop's or Scan's body)."""
    from onnx_ir import AttributeType

    for attr in node.attributes.values():
        if attr.type == AttributeType.GRAPH:
            yield attr.value
        elif attr.type == AttributeType.GRAPHS:
            yield from attr.value
