"""Constants the low type cannot hold, read by ops that would otherwise be free to go low.

A weight of a MatMul/Gemm/Conv (an allow op) is converted offline with clamping at the type's true
limit (±65504 for FP16), and the report counts every clamped value: that is the contract for
weights. A bias is not such a weight (a Gemm's C, a Conv's B): it is added to the output as it is,
so one past the range keeps its node FP32, as the Add of MatMul + Add would be. An infer or clear
op is different: it goes low only where painting (or the optimal placement's cost model) finds it
cheaper, and nothing in that choice looks at the constant it reads. ``Add(h, ConstantOfShape(value=1e5))`` or ``Mul(h, OneHot(values=[0, 1e5]))`` made FP16
clamp the constant to 65504 (34% error) or overflow to inf, where leaving the op FP32 is exact.

So before classify, every non-allow node of the ONNX graph that reads, in a float slot, a constant
(an initializer or Constant node, a ConstantOfShape's or Pad's fill, a OneHot's values; as read,
or through ops that copy it: reshapes, slices, gathers, concatenations, splits, negation, a cast
from double or from an integer type, an If branch that returns it) with a finite value beyond the
target's finite range is marked; classify keeps such an infer or clear op FP32, saying which constant and value.
Small constants combined by elementwise arithmetic alone (``Mul(k, k)`` of a 300 is 90000) are
folded: the node computing a value past the range and its readers keep FP32 the same way.
Infinities are left alone (the low types hold them), and so are mask sentinels of magnitude 1e8
and more (-1e9, finfo(float32).min): saturated, they still mask, which the report counts and
``--check`` expects; keeping every mask op FP32 for them would add casts to every attention block
for nothing.

A Mul by a constant factor the low type keeps to fewer than 7 significant bits (``h * 1e-7``: an
FP16 subnormal, 1.19e-7, every product 19% off; ``h / 1e7`` keeps FP32 for its divisor) keeps FP32
too (:func:`_coarse_factor`), as does a Gemm whose alpha or beta becomes one.

A float attribute the kernel combines with the data in the node's type counts the same way
(:data:`_ATTRIBUTES`): ImageScaler's ``bias`` of 1e5 made channel 0 +inf in FP16. Attributes that
are only compared with the data (ThresholdedRelu's ``alpha``, Shrink's ``lambd``, an RNN's
``clip``: no low value lies beyond a bound past the range, whichever side), epsilons that fused
kernels add to FP32 statistics, ratios, seeds and sizes do not.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx_ir as ir

from ..decisions import Category
from ..ir import DType, Model, Node, Value
from ..passes.base import (COARSE_LIMIT, LOW_LIMITS, Context, PassResult, coarse_rounding, lost_epsilon,
                           int_attribute, string_attribute)
from .onnx_loader import attr_tensor, constant_array

# |x| at or above this is a mask sentinel (-1e9, finfo(float32).min): it saturates to the low
# type's limit or infinity and still masks (exp of it is 0), as the report and --check expect
SENTINEL = 1e8
META = "amp.exact_constant"
LOST_EPSILON = "amp.lost_epsilon"  # (classify: a deny seed, see _vanishes)


def mark_out_of_range_constants(model: Model, ctx: Context) -> PassResult:
    limit = LOW_LIMITS.get(ctx.low)
    if limit is None:
        return PassResult("out-of-range constants", modified=False)
    seen: dict[int, float | None] = {}  # a constant's verdict, by id: a bias or eps read by every layer is read once
    folds: dict[int, object] = {}  # a value's folded data (or None), by id: a chain is walked once
    for node in model.graph.walk():
        if node.domain == "" and node.op_type in ("Cast", "Constant"):
            continue
        if ctx.rules.category_of(node.op_type, node.domain, node.opset) == Category.ALLOW:
            # weights of heavy ops: converted with clamping, counted in the report; but a scalar
            # the kernel converts to the low type itself is neither clamped nor counted
            scalar = _kernel_scalar_lost(node, ctx.low)
            if scalar is not None:
                name, value, became = scalar
                node.meta[KERNEL_SCALAR] = (
                    f"its {name} attribute {value:g} becomes {became} in {ctx.low.short}, which onnxruntime's CUDA "
                    f"kernel converts it to before it computes (cuBLAS takes alpha and beta in the data type): "
                    f"it keeps FP32")
                continue
            slot = _BIAS_SLOTS.get((node.domain, node.op_type))
            bias = node.inputs[slot] if slot is not None and len(node.inputs) > slot else None
            big = _held(bias, limit, seen=seen, folds=folds) if bias is not None else None
            if big is not None:
                short = ctx.low.short
                node.meta[KERNEL_SCALAR] = (
                    f"its bias {bias.name!r} holds {big:g}, beyond {short}'s finite range (±{limit:g}): clamped, it "
                    f"would be added to every output as is (as MatMul + Add, the Add keeps FP32), so the node "
                    f"keeps FP32")
            continue
        found = _beyond(node, limit, seen, folds)
        if found is None and node.domain == "" and node.op_type in _ARITHMETIC and node.outputs:
            big = _largest(_folded(node.outputs[0], folds), limit)  # (computes it from constants: 300 * 300)
            found = (f"constants only and computes {node.outputs[0].name!r}", big) if big is not None else None
        short = ctx.low.short
        if found is not None:
            where, value = found
            node.meta[META] = (f"reads {where} holding {value:g}, beyond {short}'s finite range (±{limit:g}): in "
                               f"{short} it would be clamped or overflow, so the node keeps FP32")
        lost = _vanishes(node, ctx.low, folds)  # (also beside a bound past the range: Clip(r, 1e-8, 1e6))
        if found is not None and lost is None:
            continue
        if lost is not None:
            name, value = lost
            verb = _GUARDS[node.op_type][1]
            node.meta[LOST_EPSILON] = (f"{verb} {name!r} holding {value:g}, below {short}'s smallest value (it "
                                       f"becomes 0 there: the epsilon is lost, and x / (x + eps) is 0/0): it "
                                       f"keeps FP32, and so do the nodes after it up to a low-precision op")
            continue
        divisor = _small_divisor(node, limit, folds)
        if divisor is not None:
            slot = _DIVISOR_SLOTS[node.op_type]
            verb = "divides by" if node.op_type == "Div" else "takes the reciprocal of"
            node.meta[META] = (f"{verb} {node.inputs[slot].name!r} holding {divisor:g}, which multiplies by "
                               f"{1 / divisor:g}, more than {short}'s largest value ({limit:g}): in {short} its "
                               f"result overflows, so the node keeps FP32")
            if node.op_type == "Reciprocal":  # (its output is the number past the range: its readers too)
                for reader, _ in node.outputs[0].uses():
                    reader.meta.setdefault(META, (
                        f"reads {node.outputs[0].name!r}, the reciprocal of {divisor:g} ({1 / divisor:g}), beyond "
                        f"{short}'s finite range (±{limit:g}): in {short} it would overflow, so the node keeps FP32"))
            for copy in _divisor_copies(node, limit, folds):
                copy.meta.setdefault(META, (
                    f"carries {divisor:g} into the divisor of {node.name or node.op_type!r}: in {short} it is a "
                    f"subnormal, rounded to a few bits (or 0), and the quotient with it, so the node keeps FP32"))
            continue
        coarse = _coarse_factor(node, ctx.low, folds)
        if coarse is not None:
            name, value, error = coarse
            node.meta[META] = (f"multiplies by {name!r} holding {value:g}, below {short}'s smallest normal value: "
                               f"{short} holds it as a subnormal, {error:.1%} off, and every product would be as "
                               f"far off, so the node keeps FP32")
    return PassResult("out-of-range constants", modified=False)


KERNEL_SCALAR = "amp.kernel_scalar"
# the input an allow op adds to its result as it is: a value past the range there is an error of
# its full size in the output, not the clamp of one weight among the many a dot product sums
_BIAS_SLOTS: dict[tuple[str, str], int] = {("", "Gemm"): 2, ("", "Conv"): 2, ("", "ConvTranspose"): 2}
# float attributes an allow op's CUDA kernel converts to the data type before it runs (onnxruntime's
# Gemm and com.microsoft's FusedMatMul/TransposeMatMul: ToCudaType<T>::FromFloat(alpha_))
_KERNEL_SCALARS: dict[tuple[str, str], tuple[str, ...]] = {
    ("", "Gemm"): ("alpha", "beta"), ("com.microsoft", "FusedMatMul"): ("alpha",),
    ("com.microsoft", "TransposeMatMul"): ("alpha",)}


def _kernel_scalar_lost(node: Node, low: DType) -> tuple[str, float, str] | None:
    """(attribute, value, what it becomes) for a scalar of :data:`_KERNEL_SCALARS` that the low type
    turns into ±inf or 0 (a Gemm's alpha of 1e5 in FP16: every output inf), or None."""
    for name in _KERNEL_SCALARS.get((node.domain, node.op_type), ()):
        data = _attribute(node, name)
        if data is None or data.size != 1 or not np.isfinite(data).all():
            continue
        value = float(data.reshape(-1)[0])
        with np.errstate(over="ignore"):
            became = float(np.asarray(value, np.float32).astype(_numpy_type(low)).astype(np.float32))
        if not np.isfinite(became):
            return name, value, f"{became:+g}"
        if became == 0.0 and value != 0.0:
            return name, value, "0"
        if value != 0.0 and abs(became - value) > COARSE_LIMIT * abs(value):
            return name, value, f"{became:g} (a subnormal, {abs(became - value) / abs(value):.1%} off)"
    return None


# ops that keep a value away from zero with a constant: the inputs where that constant sits, and
# what the op does with it (the reason's verb)
_GUARDS = {"Add": (slice(None), "adds"), "Sub": (slice(None), "adds"), "Sum": (slice(None), "adds"),
           "Max": (slice(None), "bounds below by"), "Clip": (slice(1, 2), "bounds below by"),
           "Where": (slice(1, 3), "selects"), "Less": (slice(None), "compares with"),
           "LessOrEqual": (slice(None), "compares with"), "Greater": (slice(None), "compares with"),
           "GreaterOrEqual": (slice(None), "compares with")}


def _vanishes(node: Node, low: DType, folds: dict[int, object]) -> tuple[str, float] | None:
    """(name, largest magnitude) of a constant an Add, Sub, Sum or Max reads, a Clip as its min (the
    guard of x / clamp_min(m, 1e-8)), a Where selects or a comparison compares with (the guard
    ``Where(Less(m, 1e-8), 1e-8, m)``: in the low type ``m < 0`` is never true of a zero m, and the
    zero is kept), whose nonzero values all become 0 in the low type (an
    epsilon of 1e-8 in FP16, whose smallest value is 6e-8), or some of them where all have one
    sign (a per-channel epsilon), or None. Such a constant exists to keep
    a sum or a bound away from zero: in the low type it is gone, and the division after it is 0/0.
    (A Mul by it is the value range's business, like a weight's flushed entries: counted in the
    report.)"""
    if node.domain != "" or node.op_type not in _GUARDS:
        return None
    for value in node.inputs[_GUARDS[node.op_type][0]]:
        data = _folded(value, folds)
        if data is None or data.size == 0:
            continue
        with np.errstate(all="ignore"):
            found = lost_epsilon(data, data.astype(np.float32).astype(_numpy_type(low)))
        if found is not None:
            return value.name, found
    return None


def _coarse_factor(node: Node, low: DType, folds: dict[int, object]) -> tuple[str, float, float] | None:
    """(name, value, error) of a constant factor a Mul multiplies by (or a Div's numerator) that
    the low type rounds to fewer than 7 significant bits (:func:`~amp_rewrite.passes.base.coarse_rounding`):
    ``h * 1e-7`` is 1.19e-7 in FP16, every product 19% off, where ``h / 1e7`` keeps FP32 for its
    divisor; None."""
    slots = {"Mul": (0, 1), "Div": (0,)}.get(node.op_type) if node.domain == "" else None
    for slot in slots or ():
        value = node.inputs[slot] if slot < len(node.inputs) else None
        data = _folded(value, folds)
        if data is None or data.size == 0 or data.dtype.kind != "f":
            continue
        with np.errstate(all="ignore"):
            found = coarse_rounding(data, data.astype(np.float32).astype(_numpy_type(low)))
        if found is not None:
            return (value.name, *found)
    return None


def _numpy_type(low: DType) -> np.dtype:
    if low == DType.BFLOAT16:
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(np.float16)


def _beyond(node: Node, limit: float, seen: dict[int, float | None],
            folds: dict[int, object] | None = None) -> tuple[str, float] | None:
    """(what, value) of the first float constant the node reads with a value the low type cannot
    hold (and no mask sentinel), or None: a float attribute it computes with, or an input."""
    for name in _ATTRIBUTES.get((node.domain, node.op_type), ()):
        big = _attribute_beyond(node, name, limit)
        if big is not None:
            return f"its {name} attribute", big
    for value in node.inputs:
        big = _held(value, limit, seen=seen, folds=folds)
        if big is not None:
            return f"{value.name!r}", big
    return None


# float attributes whose value the kernel combines with the data in the node's type (adds, multiplies,
# or writes to the output), by (domain, op): in FP16 a value past 65504 is clamped or becomes inf
# there (and inf * 0 is NaN) as a constant input's would. Left out: attributes only compared with
# the data (ThresholdedRelu alpha, Shrink lambd, RNN clip: a bound past the range selects the same
# low values either way), normalisation epsilons (the fused kernels add them to FP32 statistics),
# Dropout's ratio, Upsample's scales and RotaryEmbedding's scale (sizes and positions, not data),
# the allow ops' (Gemm alpha/beta, attention scale: weights of heavy ops are the clamping
# contract's), and Clip's min/max (attributes before opset 11, where onnxruntime has no float16
# kernel for Clip: it never goes low). Resize's fill and cubic coefficient matter in one mode each
# (_attribute_beyond).
_RNN = ("activation_alpha", "activation_beta")  # LeakyRelu/Affine/ScaledTanh/HardSigmoid/Elu params
_ATTRIBUTES: dict[tuple[str, str], tuple[str, ...]] = {
    ("", "ConstantOfShape"): ("value",), ("", "Pad"): ("value",),  # their fill (Pad before opset 11)
    ("", "ImageScaler"): ("scale", "bias"), ("", "Affine"): ("alpha", "beta"), ("", "Scale"): ("scale",),
    ("", "ScaledTanh"): ("alpha", "beta"), ("", "ParametricSoftplus"): ("alpha", "beta"),
    ("", "LeakyRelu"): ("alpha",), ("", "Elu"): ("alpha",), ("", "Celu"): ("alpha",),
    ("", "Selu"): ("alpha", "gamma"), ("", "HardSigmoid"): ("alpha", "beta"), ("", "Shrink"): ("bias",),
    ("", "Swish"): ("alpha",), ("com.microsoft", "QuickGelu"): ("alpha",),
    ("", "Resize"): ("extrapolation_value", "cubic_coeff_a"),
    ("", "RNN"): _RNN, ("", "GRU"): _RNN, ("", "LSTM"): _RNN,
}


def _small_divisor(node: Node, limit: float, folds: dict[int, object]) -> float | None:
    """The divisor of a Div whose constant divisor (or one computed from constants) holds a value
    whose reciprocal is past the limit: ``h / 1e-6`` multiplies by 1e6, which overflowed in FP16
    where ``h * 1e6`` kept FP32. The value of smallest magnitude (zeros left out), or None."""
    slot = _DIVISOR_SLOTS.get(node.op_type) if node.domain == "" else None
    if slot is None or len(node.inputs) <= slot:
        return None
    return _small_divisor_held(node.inputs[slot], limit, folds)


_DIVISOR_SLOTS = {"Div": 1, "Reciprocal": 0}  # the input a node divides by


def _small_divisor_held(value: Value | None, limit: float, folds: dict[int, object]) -> float | None:
    """The value of smallest magnitude (zeros left out) whose reciprocal is past the limit that
    ``value`` holds: folded (a constant, or computed from constants), else through a copy (in
    ``Concat(h, tiny)`` the divisor is not a constant, part of it is); or None."""
    def tiny(data: np.ndarray | None) -> float | None:
        data = numeric(data)
        if data is None or data.size == 0:
            return None
        with np.errstate(all="ignore"):
            magnitude = np.abs(data.reshape(-1).astype(np.float64))
            nonzero = np.flatnonzero((magnitude > 0) & np.isfinite(magnitude))
        if not nonzero.size:
            return None
        smallest = float(data.reshape(-1)[nonzero[int(np.argmin(magnitude[nonzero]))]])
        return smallest if 1 / abs(smallest) > limit else None

    found = tiny(_folded(value, folds))
    return found if found is not None else _held(value, limit, folds=folds, judge=tiny)


def _divisor_copies(node: Node, limit: float, folds: dict[int, object]) -> list[Node]:
    """The ops copying a tiny constant into a Div's divisor (``Concat(h, 1e-6)``), divisor first,
    that :func:`_small_divisor` looked through: a copy in the low type holds 1e-6 as an FP16
    subnormal (6% off), and the FP32 division by it is as far off."""
    found: list[Node] = []
    value = node.inputs[_DIVISOR_SLOTS[node.op_type]]
    while value is not None and not value.data_known and len(found) < 8:
        producer = value.producer
        if producer is None or producer.domain != "" or producer.op_type not in _COPIES:
            break
        slots = _COPIES[producer.op_type]
        onward = next((producer.inputs[i] for i in (range(len(producer.inputs)) if slots is None else slots)
                       if i < len(producer.inputs) and _small_divisor_held(producer.inputs[i], limit, folds)), None)
        if onward is None:
            break
        found.append(producer)
        value = onward
    return found


def _attribute_beyond(node: Node, name: str, limit: float) -> float | None:
    """A value of ``node``'s float attribute ``name`` beyond the limit that matters to its result, or None.
    A fill (ConstantOfShape's, Pad's, Resize's) of 1e8 or more is a mask sentinel, as a constant's is; a
    scale, slope or offset of any finite size past the limit is not."""
    fill = name in ("value", "extrapolation_value")
    big = _largest(_attribute(node, name), limit, SENTINEL if fill else np.inf)
    if big is None or node.domain != "":
        return big
    if node.op_type == "Resize":  # the fill of tf_crop_and_resize, the coefficient of cubic
        mode = string_attribute(node, "coordinate_transformation_mode") if name == "extrapolation_value" else \
            string_attribute(node, "mode")
        return big if mode == ("tf_crop_and_resize" if name == "extrapolation_value" else "cubic") else None
    return big


# ops whose output holds some of their inputs' values unchanged (or negated), by the input slots
# that hold them: None for every input
_COPIES: dict[str, tuple[int, ...] | None] = {
    **dict.fromkeys(("Identity", "Reshape", "Expand", "Tile", "Squeeze", "Unsqueeze", "Flatten", "Transpose",
                     "Slice", "Gather", "GatherElements", "GatherND", "Split", "DepthToSpace", "SpaceToDepth",
                     "Neg", "Abs", "Cast", "CastLike"), (0,)),
    "Pad": (0, 2), "Where": (1, 2), "Concat": None,
}
_FLOATS = (DType.FLOAT, DType.DOUBLE)
# what a Cast/CastLike to float may read: an integer constant (an int64 100000 bias or fill) lands
# beyond the low type's range as surely as a float one
_CASTABLE = (*_FLOATS, DType.INT8, DType.INT16, DType.INT32, DType.INT64, DType.UINT8, DType.UINT16, DType.UINT32,
             DType.UINT64)
_CASTS = ("Cast", "CastLike")


def _held(value: Value | None, limit: float, depth: int = 0, cast: bool = False,
          seen: dict[int, float | None] | None = None, folds: dict[int, object] | None = None,
          judge: Callable[[np.ndarray | None], float | None] | None = None) -> float | None:
    """A value beyond the limit that ``value`` holds as a constant: its own data, a ConstantOfShape's
    fill, a OneHot's on/off values, a Pad's fill, or those of a constant copied, sliced, gathered,
    concatenated, split, negated or cast (a double or an integer one too), or returned by a branch of
    an If. ``cast``: ``value`` is read through a Cast/CastLike, so an integer one counts. ``judge``:
    what to look for in each constant instead (the value it returns, or None); ``seen`` is then
    not used."""
    if value is None or value.dtype not in (_CASTABLE if cast else _FLOATS) or depth > 8:
        return None
    find = judge if judge is not None else (lambda data: _largest(data, limit))
    if value.data_known:  # (an overridable input's default too: what it holds unless fed another)
        if seen is None or judge is not None:
            return find(constant_array(value))
        if id(value) not in seen:
            seen[id(value)] = find(constant_array(value))
        return seen[id(value)]
    producer = value.producer
    if producer is None or producer.domain != "":
        return None
    if producer.op_type == "ConstantOfShape":
        return find(_attribute(producer, "value"))
    if producer.op_type == "OneHot" and len(producer.inputs) > 2:
        return _held(producer.inputs[2], limit, depth + 1, cast, seen, folds, judge)
    if producer.op_type == "Pad" and judge is not None:
        found = find(_attribute(producer, "value"))
        if found is not None:
            return found
    elif producer.op_type in ("Pad", "Resize"):  # a fill its output holds (Pad before opset 11)
        big = _attribute_beyond(producer, "value" if producer.op_type == "Pad" else "extrapolation_value", limit)
        if big is not None:
            return big
    if cast and value.dtype in _INTEGERS and producer.op_type in _SHAPE_OPS:
        counts = _shape_folded(value)  # (a count from static shapes: 2 * 40000 elements)
        if counts is not None:  # (exact: Gather(Shape, 0) of [1, 80000] holds 1, whatever the shape holds)
            return find(counts)
    if producer.op_type in _COPIES:
        slots = _COPIES[producer.op_type]
        for index in range(len(producer.inputs)) if slots is None else slots:
            big = _held(producer.inputs[index], limit, depth + 1, cast or producer.op_type in _CASTS, seen, folds,
                        judge) if index < len(producer.inputs) else None
            if big is not None:
                return big
    if producer.op_type in _ARITHMETIC or producer.op_type in _FOLD_UNARY:  # on constants only, folded (300 * 300)
        big = find(_folded(value, folds))
        if big is not None:
            return big
    if producer.op_type == "If":  # what either branch returns in this slot
        index = producer.outputs.index(value)
        for branch in producer.all_subgraphs():
            big = _held(branch.outputs[index], limit, depth + 1, cast, seen, folds, judge) \
                if index < len(branch.outputs) else None
            if big is not None:
                return big
    return None


_INTEGERS = (DType.INT32, DType.INT64)
# integer ops a count or size read from static shapes goes through (Shape -> ReduceProd -> Cast)
_SHAPE_OPS = {"Shape", "Size", "ReduceProd", "ReduceSum", "ReduceMax", "Gather", "Mul", "Add", "Concat",
              "Squeeze", "Unsqueeze", "Reshape", "Identity", "Slice"}


def _shape_folded(value: Value | None, depth: int = 0) -> np.ndarray | None:
    """An integer ``value`` computed from static shapes and integer constants by :data:`_SHAPE_OPS`
    (the element count ``ReduceProd(Shape(x))`` of an x of shape [2, 40000] is 80000), or None.
    A float made from it by a Cast is known when the rewrite runs, as a constant's is."""
    if value is None or value.dtype not in _INTEGERS or depth > 8:
        return None
    if value.is_constant:
        data = constant_array(value)
        return data.astype(np.int64) if data is not None and data.size <= _FOLD_ELEMENTS else None
    node = value.producer
    if node is None or node.domain != "" or node.op_type not in _SHAPE_OPS or not node.inputs:
        return None
    op = node.op_type
    if op in ("Shape", "Size"):
        shape = node.inputs[0].shape if node.inputs[0] is not None else None
        if shape is None or not all(isinstance(d, int) and d >= 0 for d in shape):
            return None
        if op == "Size":
            return np.asarray(int(np.prod(shape, dtype=np.int64)), np.int64)
        start, end = int_attribute(node, "start", 0), int_attribute(node, "end", len(shape))
        return np.asarray(shape[start:end], np.int64)
    args = [_shape_folded(v, depth + 1) if v is not None else None for v in node.inputs]
    data = args[0]
    if data is None:
        return None
    try:
        if op in ("ReduceProd", "ReduceSum", "ReduceMax") and len(node.inputs) == 1 and data.ndim <= 1:
            reduce = {"ReduceProd": np.prod, "ReduceSum": np.sum, "ReduceMax": np.max}[op]
            out = np.asarray(reduce(data), np.int64)
            return out.reshape([1] * data.ndim) if int_attribute(node, "keepdims", 1) else out
        if op == "Gather" and len(args) == 2 and args[1] is not None and int_attribute(node, "axis", 0) == 0:
            return np.take(data, args[1], axis=0)
        if op in ("Mul", "Add") and len(args) == 2 and args[1] is not None:
            return data * args[1] if op == "Mul" else data + args[1]
        if op == "Slice" and data.ndim == 1 and len(args) >= 3 and all(a is not None for a in args[1:]):
            starts, ends = args[1].reshape(-1), args[2].reshape(-1)
            axes = args[3].reshape(-1) if len(args) > 3 else np.zeros(1, np.int64)
            steps = args[4].reshape(-1) if len(args) > 4 else np.ones(1, np.int64)
            if starts.size == ends.size == axes.size == steps.size == 1 and int(axes[0]) in (0, -1):
                return data[slice(int(starts[0]), int(ends[0]), int(steps[0]))]
            return None
        if op == "Concat" and all(a is not None for a in args):
            return np.concatenate([np.atleast_1d(a) for a in args])
        if op in ("Squeeze", "Unsqueeze", "Reshape", "Identity") and data.size == 1:
            return data.reshape(-1)  # (a single count: its shape matters not to its magnitude)
    except (ValueError, IndexError, OverflowError):
        return None
    return None


# elementwise arithmetic that a chain of constants can overflow through (FP16: 300 * 300 is inf)
_ARITHMETIC = {"Add": np.add, "Sub": np.subtract, "Mul": np.multiply, "Div": np.divide, "Pow": np.power}
_FOLD_ELEMENTS = 1 << 16  # fold small constants only: a weight-sized product is a weight's business


# ops whose output holds their first input's values (reshaped, repeated or cast), and unary ops
# folded with them: a divisor or factor read through them is known too (Div by Sqrt(1e-12))
_FOLD_COPIES = {"Identity", "Cast", "CastLike", "Reshape", "Squeeze", "Unsqueeze", "Flatten", "Expand"}
_FOLD_UNARY = {"Sqrt": np.sqrt, "Neg": np.negative, "Abs": np.abs, "Reciprocal": np.reciprocal,
               "Relu": lambda x: np.maximum(x, 0)}


def _folded(value: Value | None, memo: dict[int, object] | None = None, depth: int = 0, cast: bool = False):
    """``value``'s data where it is a constant or elementwise arithmetic (:data:`_ARITHMETIC`) on
    constants only, up to a few levels and :data:`_FOLD_ELEMENTS` elements, in float64; else None.
    ``memo`` keeps each value's answer, so a long chain of activations is walked once."""
    if value is None or value.dtype not in (_CASTABLE if cast else _FLOATS) or depth > 4:
        return None
    if memo is not None and id(value) in memo and not cast:
        return memo[id(value)]
    out = None
    if value.data_known:
        data = constant_array(value)
        out = data.astype(np.float64) if data is not None and data.size <= _FOLD_ELEMENTS else None
    else:
        producer = value.producer
        op = producer.op_type if producer is not None and producer.domain == "" else None
        if op == "ConstantOfShape":  # (its fill: the magnitude is what matters)
            fill = _attribute(producer, "value")
            out = fill.astype(np.float64).reshape(-1)[:1] if fill is not None and fill.size else np.zeros(1)
        elif op in _FOLD_COPIES and producer.inputs and producer.inputs[0] is not None:
            out = _folded(producer.inputs[0], memo, depth + 1, cast=op in _CASTS)
        elif op in _FOLD_UNARY and producer.inputs:
            inner = _folded(producer.inputs[0], memo, depth + 1)
            if inner is not None:
                with np.errstate(all="ignore"):
                    out = _FOLD_UNARY[op](inner)
        elif producer is not None and producer.domain == "" and producer.op_type in _ARITHMETIC \
                and len(producer.inputs) == 2:
            a = _folded(producer.inputs[0], memo, depth + 1)
            b = _folded(producer.inputs[1], memo, depth + 1) if a is not None else None
            if b is not None:
                try:
                    with np.errstate(all="ignore"):
                        out = _ARITHMETIC[producer.op_type](a, b)
                except ValueError:  # (shapes that do not broadcast: the model's error, not this check's)
                    out = None
                out = out if out is not None and out.size <= _FOLD_ELEMENTS else None
    if memo is not None and not cast:
        memo[id(value)] = out
    return out


def _attribute(node: Node, name: str):
    """A tensor, float or floats attribute's data (ConstantOfShape's ``value``, Pad-2's ``value``,
    ImageScaler's ``bias``), or None."""
    attr = node.origin.attributes.get(name) if node.origin is not None else None
    try:
        if attr is not None and attr.type == ir.AttributeType.FLOAT:
            return np.asarray([attr.as_float()], np.float32)
        if attr is not None and attr.type == ir.AttributeType.FLOATS:
            return np.asarray(attr.as_floats(), np.float32)
        if attr is not None and attr.type != ir.AttributeType.TENSOR:
            return None
        return attr_tensor(attr).numpy() if attr is not None else None
    except Exception:  # noqa: BLE001 - unreadable data is the loader's concern, not this check's
        return None


def numeric(data: np.ndarray | None) -> np.ndarray | None:
    """``data`` as numbers numpy compares: as it is for float and integer arrays, widened to float32
    for ml_dtypes' (bfloat16, the float8 and float4 types: numpy kind 'V', which the range checks
    skipped, so a bfloat16 -1e9 mask reached an fp16 Cast unclamped); None for anything else."""
    if data is None:
        return None
    if data.dtype.kind in "fiu":
        return data
    if data.dtype.name.startswith(("bfloat16", "float8", "float4", "float6")):
        return data.astype(np.float32)
    return None


def _largest(data, limit: float, ceiling: float = SENTINEL) -> float | None:
    """The largest |value| between ``limit`` and ``ceiling`` (:data:`SENTINEL`; infinity for finite
    values of any size), signed, or None."""
    data = numeric(data)
    if data is None or data.size == 0:
        return None
    flat = data.reshape(-1)
    best: float | None = None
    # in chunks: the float64 copy of a 2 GB constant was 4.5 GB, and its magnitudes as much again
    for start in range(0, flat.size, _CHUNK):
        chunk = flat[start:start + _CHUNK].astype(np.float64)  # (FP16 compared with 1e8 warns of overflow)
        magnitude = np.abs(chunk)
        between = np.flatnonzero((magnitude > limit) & (magnitude < ceiling))
        if between.size:
            found = float(chunk[between[int(np.argmax(magnitude[between]))]])
            if best is None or abs(found) > abs(best):
                best = found
    return best


_CHUNK = 1 << 22  # elements


def dequantized_past(node: Node, limit: float) -> float | None:
    """An upper bound on what a DequantizeLinear of constants computes, max|x| + max|zero_point|
    times max|scale| (per channel or block, the largest of each), where it passes ``limit`` (int8 ×
    a scale of 800 is 101600: inf in FP16); None where it does not, where an input is not a
    constant or its type does not widen to float."""
    arrays = [constant_array(v) if v is not None else None for v in node.inputs[:3]]
    if node.op_type != "DequantizeLinear" or len(arrays) < 2 or arrays[0] is None or arrays[1] is None:
        return None
    try:
        span = float(np.max(np.abs(np.asarray(arrays[0]).astype(np.float64))))
        if len(arrays) > 2 and arrays[2] is not None:
            span += float(np.max(np.abs(np.asarray(arrays[2]).astype(np.float64))))  # (|x - zp| ≤ |x| + |zp|)
        bound = span * float(np.max(np.abs(np.asarray(arrays[1]).astype(np.float64))))
    except (TypeError, ValueError):  # (a packed type numpy cannot widen: nothing proven)
        return None
    return bound if bound > limit else None
