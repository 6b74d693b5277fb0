"""``--check`` and ``--auto-fp32``: run the FP32 and the rewritten model on the same inputs, compare
their outputs, find intermediate low-precision values that overflowed, and pin a short run of nodes
FP32 until it passes.

An edge module: it imports onnxruntime, numpy and onnx (tests/test_core.py lists it).

Inputs
    From ``--inputs file.npz`` (keys = graph input names of the FP32 model), else generated from
    the FP32 model's declared inputs, seeded (``seed=0``):

    - float inputs: N(0, 1) (images, features); a float input named like ``*mask*``: 0/1;
    - integer inputs named like ``*mask*``: 1 everywhere but the last position of the last axis
      (one padded token) when that axis is longer than 2; bool masks the same with True/False;
    - ``*token_type*`` / ``*segment*``: zeros; ``*position*``: 0, 1, 2, ... along the last axis;
    - other integer inputs (``input_ids``, ``tokens``, ...): uniform in ``[0, vocab)``, ``vocab``
      being the first axis of the embedding table a Gather reads with them (looking through
      Cast/Reshape/Unsqueeze/...), else ``[0, 100)``;
    - symbolic or unknown dims: 1 for batch-like names (``batch*``, ``N``, ``B``; also any unnamed
      first axis), 8 for sequence-like names (``*seq*``, ``*len*``, ``*token*``, ``*time*``,
      ``*past*``), 64 for ``height``/``width``/``H``/``W``, else 1 on the first axis and 8
      elsewhere. A dim name gets the same value in every input.
    - a sequence input (``seq(tensor)``): a list of 2 tensors of its element type and shape, made
      by the rules above; an optional one (``optional(tensor)``, ``optional(seq(tensor))``): its
      value, present. A map, a sparse tensor or a sequence of sequences cannot be fed: a UsageError.

    In the ``.npz``, a sequence input's tensors are keyed ``<name>/0``, ``<name>/1``, ... (their
    shapes may differ), or given as one array under ``<name>`` that stacks them on axis 0; an
    optional input with no array is fed empty.

Running
    onnxruntime in one child process per check (:mod:`amp_rewrite.ort_worker`; in-process where
    pipes cannot be passed, off POSIX), so that onnxruntime aborting or segfaulting is an error
    naming the signal, not the end of amp-rewrite; on ``CUDAExecutionProvider`` when onnxruntime
    has it, else on the CPU provider at graph optimisation level EXTENDED (the CPU-only level-ALL
    layout optimisers can crash on valid FP16 graphs). Every ``InferenceSession.run`` is one
    *evaluation*.

    The CPU provider runs FP16 nodes it has no kernel for with FP32 kernels and drops the casts
    between them, so the values in between are never rounded (nor overflow), and it has no BF16
    arithmetic kernels at all. There the rewritten model runs as its emulation
    (:mod:`amp_rewrite.emulate`): every FP16/BF16 value rounded where it is made and carried as
    FP32, as a GPU's kernels compute. Where the emulation cannot be built or run, the model runs as
    it is, with a note.

Comparison (per graph output)
    max abs error and max relative error ``max|a-b| / max|a|`` over the elements finite in both,
    cosine similarity (none where the rewritten model has a NaN/Inf the FP32 one does not), and
    NaN/Inf counts in each model. An output fails when its relative error
    exceeds ``tolerance`` or the rewritten model has a NaN/Inf where the FP32 one is finite.
    Integer and bool outputs are compared by the fraction of differing elements.

Overflow localisation (PRECISION.md pitfall 11)
    Every FP16/BF16 value of the rewritten model's *main graph* (If/Loop/Scan bodies are not
    looked into; what overflows in them shows in the outputs) is exposed as an extra output of a
    copy of the model (of its emulation on the CPU provider), and compared with the FP32 model's value of the same name (the rewrite keeps names; its
    low-precision copies are named ``<name>/amp_fp16``). Nodes whose low-precision output has
    NaN/Inf where the FP32 value is finite are *overflowing*; the first of them in topological
    order whose inputs did not already overflow are the *roots*. An overflow fails the check
    even when the outputs look fine (a softmax turns -inf logits into plausible zeros; other
    inputs make them +inf and NaN). Values above half the type's limit (|x| > 32752 in FP16)
    are listed as warnings.

Auto FP32
    Rewrite, check (with localisation), and while it fails: pin the root overflowing nodes FP32
    (for an overflowing Cast, its low-precision consumers) and rewrite again; when no overflow
    explains the failure, bisect over the low-precision nodes in topological order, a body's nodes
    where their If/Loop/Scan runs (the shortest prefix that passes, then the shortest suffix of that
    prefix). At most ``2*ceil(log2(N+1))+5``
    candidate runs for N low-precision nodes, plus one FP32 reference run and one run of the
    final written model.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Mapping, Sequence

import numpy as np
import onnx

from .api import RewriteResult
from .decisions import HEAVY_OPS
from .errors import AmpRewriteError, CheckFailedError, UsageError

if TYPE_CHECKING:
    from .commands import CliArgs
    from .report import Report

SEED = 0
BATCH_DIM = 1
SEQUENCE_DIM = 8
SPATIAL_DIM = 64
DEFAULT_VOCAB = 100
SEQUENCE_ITEMS = 2  # tensors in a generated sequence input
NEAR_LIMIT = 0.5  # warn when |x| > NEAR_LIMIT * the type's largest finite value
LIMITS = {"fp16": 65504.0, "bf16": 3.3895313892515355e38}
# where rounding to nearest overflows: the largest value plus half its ulp (fp16: 65504 + 16)
_OVERFLOW_AT = {"fp16": 65520.0, "bf16": 3.3895313892515355e38 + 2.0 ** 119}
_LOW_TYPES = {onnx.TensorProto.FLOAT16: "fp16", onnx.TensorProto.BFLOAT16: "bf16"}
_RENAMED = re.compile(r"/amp_(?:fp16|bf16)(?:_\d+)?$")  # the rewrite's low-precision copies
_PASS_THROUGH = {"Cast", "Reshape", "Unsqueeze", "Squeeze", "Flatten", "Identity", "Expand", "Transpose"}
_MAX_LISTED = 10  # overflowing / near-limit values kept in the result
SENTINEL = 1e8  # |x| at or above this in FP32 is a mask sentinel (-1e9, finfo.min): its ±inf is expected


class CheckRunError(CheckFailedError):
    """onnxruntime could not load or run the rewritten model (the FP32 one ran)."""


# ===================================================================================================
# models and inputs
# ===================================================================================================
def _as_proto(model: Any, *, load_data: bool = True) -> onnx.ModelProto:
    if isinstance(model, onnx.ModelProto):
        return model
    if isinstance(model, (str, Path)):
        try:
            return onnx.load(str(model), load_external_data=load_data)
        except Exception as exc:  # noqa: BLE001 (protobuf raises many kinds)
            from .errors import ModelLoadError

            raise ModelLoadError(f"{model}: cannot read the model to check it: {exc}") from exc
    if type(model).__module__.startswith("onnx_ir"):
        import onnx_ir as ir

        return ir.serde.serialize_model(model)
    raise TypeError(f"expected a path, an onnx.ModelProto or an onnx_ir.Model, got {type(model).__name__}")


def graph_inputs(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    """The inputs a caller feeds: graph inputs that are not initializers (IR < 4 lists both)."""
    inits = {t.name for t in model.graph.initializer}
    return [v for v in model.graph.input if v.name not in inits]


def _np_dtype(elem_type: int) -> np.dtype:
    if elem_type == onnx.TensorProto.BFLOAT16:
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem_type))


def _dim_value(name: str | None, axis: int) -> int:
    low = (name or "").lower()
    if not low:
        return BATCH_DIM if axis == 0 else SEQUENCE_DIM
    if "batch" in low or low in ("n", "b", "bs", "batch_size"):
        return BATCH_DIM
    if any(k in low for k in ("seq", "len", "token", "time", "past", "step", "total")):
        return SEQUENCE_DIM
    if low in ("height", "width", "h", "w", "img_h", "img_w"):
        return SPATIAL_DIM
    return BATCH_DIM if axis == 0 else SEQUENCE_DIM


def _shape_of(tt: onnx.TypeProto.Tensor, named: dict[str, int]) -> tuple[int, ...]:
    if not tt.HasField("shape"):
        return (BATCH_DIM, SEQUENCE_DIM)  # rank unknown: a guess, stated in the inputs description
    shape = []
    for axis, d in enumerate(tt.shape.dim):
        if d.HasField("dim_value") and d.dim_value >= 0:  # (0 included: an empty KV cache is [1, 0, 8]; -1: unknown)
            shape.append(d.dim_value)
        elif d.HasField("dim_param") and d.dim_param:
            shape.append(named.setdefault(d.dim_param, _dim_value(d.dim_param, axis)))
        else:
            shape.append(_dim_value(None, axis))
    return tuple(shape)


def _through_pass_through(name: str, producers: dict[str, onnx.NodeProto]) -> str:
    """The value behind ``name`` through Identity and Cast (a tied weight's Identity, an FP16 table's
    Cast): the embedding table a Gather reads."""
    seen: set[str] = set()
    while name in producers and name not in seen and producers[name].op_type in ("Identity", "Cast") \
            and producers[name].input:
        seen.add(name)
        name = producers[name].input[0]
    return name


def _vocab_for(model: onnx.ModelProto, name: str) -> int | None:
    """The number of rows of the embedding table a Gather reads with ``name`` as indices."""
    g = model.graph
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for n in g.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    producers = {o: n for n in g.node for o in n.output}
    tables = {t.name: list(t.dims) for t in g.initializer}
    for n in g.node:
        if n.op_type == "Constant" and n.output:
            for a in n.attribute:
                if a.name == "value" and a.HasField("t"):
                    tables[n.output[0]] = list(a.t.dims)
    seen, todo = set(), [name]
    while todo:
        v = todo.pop()
        if v in seen:
            continue
        seen.add(v)
        for n in consumers.get(v, []):
            if n.op_type == "Gather" and len(n.input) > 1 and n.input[1] == v:
                dims = tables.get(_through_pass_through(n.input[0], producers))
                axis = next((a.i for a in n.attribute if a.name == "axis"), 0)
                if dims and -len(dims) <= axis < len(dims):
                    return int(dims[axis])
            elif n.op_type in _PASS_THROUGH and n.input and n.input[0] == v:
                todo.extend(n.output)
    return None


def _feed_type(tp: onnx.TypeProto) -> tuple[str, onnx.TypeProto.Tensor] | None:
    """What --check can feed an input of type ``tp``: ("tensor" or "sequence", the tensor type of the
    value or of its elements), an optional input's as its element's; None for anything else (a map,
    a sparse tensor, a sequence of sequences, no type)."""
    if tp.WhichOneof("value") == "optional_type":
        tp = tp.optional_type.elem_type
    which = tp.WhichOneof("value")
    if which == "tensor_type":
        return "tensor", tp.tensor_type
    if which == "sequence_type" and tp.sequence_type.elem_type.WhichOneof("value") == "tensor_type":
        return "sequence", tp.sequence_type.elem_type.tensor_type
    return None


def _type_text(tp: onnx.TypeProto) -> str:
    """``tp`` as onnxruntime writes types: tensor(float), seq(tensor(float)), map(int64,tensor(float))."""
    def elem(e: int) -> str:
        return onnx.TensorProto.DataType.Name(e).lower() if e in onnx.TensorProto.DataType.values() else str(e)

    which = tp.WhichOneof("value")
    if which == "tensor_type":
        return f"tensor({elem(tp.tensor_type.elem_type)})"
    if which == "sparse_tensor_type":
        return f"sparse_tensor({elem(tp.sparse_tensor_type.elem_type)})"
    if which == "sequence_type":
        return f"seq({_type_text(tp.sequence_type.elem_type)})"
    if which == "optional_type":
        return f"optional({_type_text(tp.optional_type.elem_type)})"
    if which == "map_type":
        return f"map({elem(tp.map_type.key_type)},{_type_text(tp.map_type.value_type)})"
    return "of no declared type"


def _unfeedable(vi: onnx.ValueInfoProto) -> str:
    return (f"input {vi.name!r} is {_type_text(vi.type)}: --check feeds tensors, sequences of tensors and optionals "
            f"of either (generated, or from --inputs), not this type")


def make_inputs(model: Any, *, seed: int = SEED) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Generated inputs for ``model`` (see the module docstring for the rules) and, per input, a
    description of how it was made. A sequence input's value is a list of arrays."""
    proto = _as_proto(model, load_data=False)
    rng = np.random.default_rng(seed)
    named: dict[str, int] = {}
    feeds: dict[str, Any] = {}
    described = []
    for vi in graph_inputs(proto):
        fed = _feed_type(vi.type)
        if fed is None:
            raise UsageError(_unfeedable(vi))
        kind, tt = fed
        if kind == "tensor":
            arr, how = _make_array(proto, vi.name, tt, rng, named)
            feeds[vi.name] = arr
            described.append({"name": vi.name, "dtype": str(arr.dtype), "shape": list(arr.shape), "values": how})
            continue
        items = [_make_array(proto, vi.name, tt, rng, named) for _ in range(SEQUENCE_ITEMS)]
        feeds[vi.name] = [arr for arr, _ in items]
        first, how = items[0]
        described.append({"name": vi.name, "dtype": str(first.dtype), "shape": list(first.shape),
                          "values": f"a sequence of {len(items)} tensors, each {how}"})
    return feeds, described


def _make_array(proto: onnx.ModelProto, name: str, tt: onnx.TypeProto.Tensor, rng: np.random.Generator,
                named: dict[str, int]) -> tuple[np.ndarray, str]:
    """A generated value of tensor type ``tt`` for input ``name`` and how it was made."""
    elem = tt.elem_type
    if elem == onnx.TensorProto.STRING:
        raise UsageError(f"input {name!r} is a string tensor: --check cannot make a value for it; "
                         f"pass --inputs file.npz")
    if elem == onnx.TensorProto.UNDEFINED:
        raise UsageError(f"input {name!r} declares no element type: --check cannot make a value for it; "
                         f"pass --inputs file.npz")
    dtype = _np_dtype(elem)
    shape = _shape_of(tt, named)
    low = name.lower()
    if "mask" in low:
        arr = np.ones(shape, np.int64)
        if shape and shape[-1] > 2:
            arr[..., -1] = 0
        how = "mask: ones, last position 0" if shape and shape[-1] > 2 else "mask: ones"
        arr = arr.astype(dtype) if dtype != np.bool_ else arr.astype(bool)
    elif _kind(dtype) == "float":
        arr = rng.standard_normal(shape).astype(np.float32).astype(dtype)
        how = "N(0, 1)"
    elif dtype == np.bool_:
        arr = np.ones(shape, bool)
        how = "True"
    elif "token_type" in low or "segment" in low:
        arr = np.zeros(shape, dtype)
        how = "zeros"
    elif "position" in low and shape:
        arr = np.broadcast_to(np.arange(shape[-1] if shape else 1), shape).astype(dtype).copy()
        how = "0, 1, 2, ... along the last axis"
    elif dtype.kind in "iu":
        vocab = _vocab_for(proto, name)
        high = min(vocab or DEFAULT_VOCAB, int(np.iinfo(dtype).max) + 1)
        arr = rng.integers(0, high, size=shape).astype(dtype)
        how = f"ids in [0, {high})" + ("" if vocab else " (no embedding table found: default)")
    else:
        raise UsageError(f"input {name!r} has type {dtype}: --check cannot make a value for it; pass --inputs")
    return arr, how


def load_inputs(path: str | Path, model: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Inputs from an ``.npz`` file whose keys are the model's input names; checked against the
    declared inputs (names, element kind, fixed dims) so mistakes are a clear UsageError. A
    sequence input's tensors are keyed ``<name>/0``, ``<name>/1``, ... or stacked on axis 0 in one
    array under ``<name>``; its value is a list of arrays. An optional input without an array is
    left out (fed empty)."""
    import difflib
    import zipfile

    proto = _as_proto(model, load_data=False)
    declared = {vi.name: vi for vi in graph_inputs(proto)}
    optional = {t.name for t in proto.graph.initializer} & {v.name for v in proto.graph.input}
    where = f"--inputs {path}"
    try:
        with open(path, "rb") as f:
            magic = f.read(6)
        if magic[:2] != b"PK" and magic != b"\x93NUMPY":  # (numpy takes anything else for a pickle)
            raise UsageError(f"{where}: not an .npz file (an .npz is a zip archive of arrays): save the inputs by "
                             f"name with np.savez(path, <input name>=array, ...)")
        data = np.load(str(path), allow_pickle=False)
        if not hasattr(data, "files"):  # an .npy file: one unnamed array
            raise UsageError(f"{where}: an .npy file holds one unnamed array; save the inputs by name in an .npz "
                             f"(np.savez(path, <input name>=array, ...))")
        with data:
            arrays = {k: np.asarray(data[k]) for k in data.files}
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
        raise UsageError(f"{where}: not a readable .npz file ({exc})") from exc
    fed = {name: _feed_type(vi.type) for name, vi in declared.items()}
    sequences = {name for name, f in fed.items() if f is not None and f[0] == "sequence"}
    items: dict[str, dict[int, np.ndarray]] = {}  # a sequence input's tensors by index, from "<name>/<index>"
    for key in list(arrays):
        base, _, index = key.rpartition("/")
        if key not in declared and key not in optional and base in declared and index.isdigit():
            if base not in sequences:
                raise UsageError(f"{where}: {key!r}: keys '<name>/0', '<name>/1', ... are for sequence inputs, and "
                                 f"{base!r} is {_type_text(declared[base].type)}")
            if str(int(index)) != index:
                raise UsageError(f"{where}: {key!r}: a sequence input's tensors are keyed {base + '/0'!r}, "
                                 f"{base + '/1'!r}, ... (no leading zeros)")
            items.setdefault(base, {})[int(index)] = arrays.pop(key)
    unknown = [k for k in arrays if k not in declared and k not in optional]
    if unknown:
        close = difflib.get_close_matches(unknown[0], list(declared), n=1, cutoff=0.5)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise UsageError(f"{where}: {unknown[0]!r} is not an input of the model{hint}; its inputs: "
                         f"{', '.join(declared) or 'none'}")
    both = [name for name in items if name in arrays]
    if both:
        raise UsageError(f"{where}: sequence input {both[0]!r} is given both as one array and as {both[0] + '/0'!r}, "
                         f"...: give one array stacking its tensors on axis 0, or one array per tensor, not both")
    for name, found in items.items():
        gap = next(i for i in range(len(found) + 1) if i not in found)
        if gap < len(found):
            raise UsageError(f"{where}: sequence input {name!r} has {name + '/' + str(max(found))!r} but no "
                             f"{name + '/' + str(gap)!r}: its tensors are keyed {name + '/0'!r}, {name + '/1'!r}, "
                             f"... without gaps")
    empty = [k for k in declared if k not in arrays and k not in items and declared[k].type.HasField("optional_type")]
    missing = [k for k in declared if k not in arrays and k not in items and k not in empty]
    if missing:
        keys = [*arrays, *(f"{name}/{i}" for name, found in items.items() for i in sorted(found))]
        hint = (f" (a sequence input takes {missing[0] + '/0'!r}, {missing[0] + '/1'!r}, ... or one array stacking "
                f"its tensors on axis 0)" if missing[0] in sequences else "")
        raise UsageError(f"{where}: no array for input {missing[0]!r}" + (f" (and {len(missing) - 1} more)" if
                         len(missing) > 1 else "") + f"{hint}; the file has: {', '.join(keys) or 'nothing'}")
    feeds: dict[str, Any] = {}
    described = []
    for name in [k for k in declared if k in arrays or k in items] + [k for k in arrays if k not in declared]:
        vi = declared.get(name)
        kind, tt = (fed.get(name) or (None, None)) if vi is not None else ("tensor", None)
        if vi is not None and kind is None:
            raise UsageError(f"{where}: {_unfeedable(vi)}")
        if kind == "tensor":
            arr = _checked_array(where, repr(name), arrays[name], tt)
            feeds[name] = arr
            described.append({"name": name, "dtype": str(arr.dtype), "shape": list(arr.shape),
                              "values": f"from {path}"})
            continue
        if name in items:
            tensors = [_checked_array(where, repr(f"{name}/{i}"), items[name][i], tt) for i in range(len(items[name]))]
        else:
            stacked = arrays[name]
            if stacked.ndim == 0:
                raise UsageError(f"{where}: {name!r} is a sequence input and the file has a scalar for it: give its "
                                 f"tensors stacked on axis 0, or as {name + '/0'!r}, {name + '/1'!r}, ...")
            tensors = [_checked_array(where, f"{name!r} (tensor {i} of the sequence stacked on axis 0)", t, tt)
                       for i, t in enumerate(stacked)]
        feeds[name] = tensors
        shapes = {t.shape for t in tensors}
        dtype = str(tensors[0].dtype) if tensors else str(_np_dtype(tt.elem_type)) if tt.elem_type else "?"
        described.append({"name": name, "dtype": dtype, "shape": list(tensors[0].shape) if len(shapes) == 1 else [],
                          "values": f"a sequence of {len(tensors)} tensors" + (" of differing shapes" if len(shapes) > 1
                                                                               else "") + f" from {path}"})
    for name in empty:
        described.append({"name": name, "dtype": None, "shape": [], "values": f"empty (optional, no array in {path})"})
    return feeds, described


def _checked_array(where: str, label: str, arr: np.ndarray, tt: onnx.TypeProto.Tensor | None) -> np.ndarray:
    """``arr`` checked against the tensor type ``tt`` (element kind, range, fixed dims; none where
    ``tt`` is None: an initializer's input) and cast to its element type."""
    if tt is None or tt.elem_type == onnx.TensorProto.UNDEFINED:
        return arr
    want = _np_dtype(tt.elem_type)
    if _kind(arr.dtype) != _kind(want):
        wants = "strings" if _kind(want) == "string" else want
        raise UsageError(f"{where}: {label} is {arr.dtype}, the model wants {wants}")
    if arr.dtype != want:
        with np.errstate(over="ignore", invalid="ignore"):
            cast = arr.astype(want)
        if _kind(want) == "float" and np.count_nonzero(np.isfinite(arr)) != np.count_nonzero(np.isfinite(cast)):
            raise UsageError(f"{where}: {label} holds values beyond {want}'s range (max |x| "
                             f"{float(np.nanmax(np.abs(arr[np.isfinite(arr)]))):.4g}), the model's input type")
        if _kind(want) == "int" and arr.size and not np.array_equal(cast.astype(arr.dtype), arr):
            info = np.iinfo(want)  # (int64 ids of 2**32 + 1 wrapped to 1 in an int32 input, silently)
            wrong = arr[cast.astype(arr.dtype) != arr].reshape(-1)[0]
            raise UsageError(f"{where}: {label} holds {wrong}, beyond {want}'s range ({info.min}..{info.max}), "
                             f"the model's input type")
        arr = cast
    if tt.HasField("shape"):
        dims = list(tt.shape.dim)
        bad = len(dims) != arr.ndim or any(d.HasField("dim_value") and d.dim_value >= 0 and d.dim_value != s
                                           for d, s in zip(dims, arr.shape))  # (-1: a dynamic dim, paddle2onnx)
        if bad:
            want_shape = [d.dim_value if d.HasField("dim_value") and d.dim_value >= 0 else (d.dim_param or "?")
                          for d in dims]
            raise UsageError(f"{where}: {label} has shape {list(arr.shape)}, the model wants {want_shape}")
    return arr


def _kind(dtype: np.dtype) -> str:
    if dtype.kind == "f" or dtype.name == "bfloat16":
        return "float"
    if dtype.kind in "iu":
        return "int"
    if dtype.kind in "USO":  # (a STRING input is an object array; an .npz holds str or bytes arrays)
        return "string"
    return dtype.kind


# ===================================================================================================
# running
# ===================================================================================================
class Runner:
    """Creates onnxruntime sessions and counts evaluations (``InferenceSession.run`` calls)."""

    def __init__(self, providers: Sequence[str] | None = None, *, isolated: bool = True) -> None:
        """``isolated``: onnxruntime runs in a child process (:mod:`amp_rewrite.ort_worker`), so
        that a crash in it is an error, not the end of this process (POSIX only)."""
        import onnxruntime as ort

        from . import ort_worker

        self.ort = ort
        if providers is None:
            providers = (["CUDAExecutionProvider", "CPUExecutionProvider"] if cuda_usable()
                         else ["CPUExecutionProvider"])
        self.providers = list(providers)
        self.provider = self.providers[0]  # the one sessions really got (set by run)
        self.evaluations = 0
        self._worker = ort_worker.Worker(self.providers) if isolated and ort_worker.available() else None

    def close(self) -> None:
        """End the child process, if any (also done when the Runner is collected)."""
        if getattr(self, "_worker", None) is not None:  # (None, or never set: __init__ failed)
            self._worker.close()

    __del__ = close

    def _in_child(self, method: str, model: Any, *args: Any, what: str, **kwargs: Any) -> Any:
        """``self._<method>_here(...)`` in the worker: the model crosses as a path or its bytes
        (one past 2 GB written with external data to a folder that lasts for the call)."""
        with _session_source(model) as source:
            result, self.provider = self._worker.call(method, source, *args, what=what, **kwargs)
        return result

    def run(self, model: Any, feeds: Mapping[str, Any], *, what: str, fp32: bool = False,
            emulated: bool = False) -> dict[str, Any]:
        """Run ``model`` (path or ModelProto) once; all outputs by name. Raises RuntimeError with
        onnxruntime's message on failure (callers turn it into the right AmpRewriteError).
        ``fp32``: the FP32 reference; on CUDA its GEMMs are kept off TF32 (``use_tf32=0``).
        ``emulated``: ``model`` is an emulation (amp_rewrite.emulate), which no user runs: where
        onnxruntime's graph optimisers refuse it (DivMulFusion meets the Identity an emulation
        writes for a removed Cast), it runs unoptimised, which computes the same values."""
        if self._worker is None:
            return self._run_here(model, feeds, what=what, fp32=fp32, emulated=emulated)
        self.evaluations += 1
        return self._in_child("run", model, dict(feeds), what=what, fp32=fp32, emulated=emulated)

    def _run_here(self, model: Any, feeds: Mapping[str, np.ndarray], *, what: str, fp32: bool = False,
                  emulated: bool = False) -> dict[str, Any]:
        ort = self.ort
        opts = ort.SessionOptions()
        opts.log_severity_level = 4  # its errors reach the user as one line of ours, not as its log
        if "CUDAExecutionProvider" not in self.providers:
            opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
        from .ort_worker import SessionError

        try:
            with _session_source(model) as source:
                try:
                    sess = self._session(source, opts, fp32)
                except Exception as exc:  # noqa: BLE001 (onnxruntime raises its own pybind types)
                    if not emulated or opts.graph_optimization_level == ort.GraphOptimizationLevel.ORT_DISABLE_ALL:
                        raise SessionError(f"{what}: {_one_line(str(exc), limit=1000)}") from exc
                    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
                    try:
                        sess = self._session(source, opts, fp32)
                    except Exception:  # noqa: BLE001 (the optimised refusal says more)
                        raise SessionError(f"{what}: {_one_line(str(exc), limit=1000)}") from exc
                self.provider = sess.get_providers()[0]
                names = [o.name for o in sess.get_outputs()]
                feed = _adapt_feeds(sess, feeds)
                self.evaluations += 1

                def run_once(feed: dict[str, Any]) -> list[Any]:
                    if any(o.type == "tensor(bfloat16)" for o in sess.get_outputs()):
                        if any(isinstance(v, list) for v in feed.values()):
                            raise RuntimeError("onnxruntime's Python API reads bfloat16 outputs only with OrtValue "
                                               "inputs, which cannot hold a sequence: a model with both cannot be run")
                        ort_feed = {k: v if isinstance(v, ort.OrtValue) else ort.OrtValue.ortvalue_from_numpy(v)
                                    for k, v in feed.items()}
                        return [_numpy_of(v) for v in sess.run_with_ort_values(names, ort_feed)]
                    return sess.run(names, feed)

                values = run_once(feed)
                finite = _training_finite_output(sess)
                if finite in names and "loss_scale" not in feeds and "loss_scale" in feed \
                        and not bool(np.asarray(values[names.index(finite)]).all()):
                    # the gradients overflowed at the check's scale: a skipped step in training; the
                    # check compares them at scale 1 instead
                    self.evaluations += 1
                    values = run_once({**feed, "loss_scale": np.array(1.0, np.float32)})
        except SessionError:
            raise
        except Exception as exc:  # noqa: BLE001 (onnxruntime raises its own pybind types)
            raise RuntimeError(f"{what}: {_one_line(str(exc))}") from exc
        return dict(zip(names, values))

    def load(self, model: Any, *, what: str) -> None:
        """Create (and drop) a CPU-provider session for ``model``: onnxruntime checks every node's
        declared types against its schema when it loads a model, which an emulation of the model
        (FP32 throughout) does not show. RuntimeError with onnxruntime's message where it refuses
        the model; a node the CPU provider merely has no kernel for (every BF16 GEMM) is not a
        failure: the GPU providers have those kernels."""
        if self._worker is None:
            self._load_here(model, what=what)
        else:
            self._in_child("load", model, what=what)

    def _load_here(self, model: Any, *, what: str) -> None:
        ort = self.ort
        opts = ort.SessionOptions()
        opts.log_severity_level = 4
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        try:
            from onnxruntime.capi.onnxruntime_pybind11_state import NotImplemented as not_implemented
        except ImportError:  # (an onnxruntime that names it otherwise: every refusal counts)
            not_implemented = ()
        try:
            with _session_source(model) as source:
                ort.InferenceSession(source, opts, providers=["CPUExecutionProvider"])
        except not_implemented:
            return
        except Exception as exc:  # noqa: BLE001 (onnxruntime raises its own pybind types)
            raise RuntimeError(f"{what}: {_one_line(str(exc))}") from exc

    def _session(self, source: Any, opts: Any, fp32: bool) -> Any:
        ort = self.ort
        if fp32 and self.providers[0] == "CUDAExecutionProvider":
            try:
                return ort.InferenceSession(source, opts, providers=[("CUDAExecutionProvider", {"use_tf32": "0"}),
                                                                     *self.providers[1:]])
            except Exception:  # noqa: BLE001 (an onnxruntime without the option: run as is)
                pass
        return ort.InferenceSession(source, opts, providers=self.providers)


def cuda_usable() -> bool:
    """Whether onnxruntime lists the CUDA provider *and* its library loads (onnxruntime-gpu lists
    it even where CUDA/cuDNN are missing, then logs errors and falls back to the CPU)."""
    import ctypes
    import os

    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return False
    lib = Path(ort.__file__).parent / "capi" / ("onnxruntime_providers_cuda.dll" if os.name == "nt"
                                                else "libonnxruntime_providers_cuda.so")
    try:
        ctypes.CDLL(str(lib))
    except OSError:
        return False
    return True


@contextlib.contextmanager
def _session_source(model: Any) -> Iterator[Any]:
    """What an InferenceSession reads ``model`` from: its path, or its bytes; a folder of its own
    (removed after) only for a proto past 2 GB, written with external data. Made for every call,
    the folder was left behind in /tmp whenever onnxruntime aborted the worker process running it."""
    if isinstance(model, (str, Path)):
        yield str(model)
        return
    if isinstance(model, bytes):
        yield model
        return
    proto = _as_proto(model)
    try:
        small = proto.ByteSize() < (1 << 31) - (1 << 24)
    except Exception:  # noqa: BLE001 (ByteSize itself can fail on huge protos)
        small = False
    if small:
        yield proto.SerializeToString()
        return
    import tempfile

    with tempfile.TemporaryDirectory(prefix="amp-check-") as tmp:
        path = str(Path(tmp) / "model.onnx")
        onnx.save_model(proto, path, save_as_external_data=True, all_tensors_to_one_file=True,
                        location="model.onnx.data")
        yield path


CHECK_LOSS_SCALE = 1024.0


def _training_finite_output(sess: Any) -> str | None:
    """The name of a training rewrite's ``all_finite`` output, if the model has one."""
    raw = sess.get_modelmeta().custom_metadata_map.get("amp_rewrite.training")
    if not raw:
        return None
    try:
        return json.loads(raw).get("all_finite")
    except ValueError:
        return None


def _adapt_feeds(sess: Any, feeds: Mapping[str, Any]) -> dict[str, Any]:
    """Only the inputs the session declares, float ones cast to its declared type (a rewrite
    with ``keep_io_types=False`` takes FP16 inputs); a sequence input's list of arrays each cast
    to its element type."""
    types = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64}
    out = {}
    # A training rewrite (amp_rewrite.training_onnx) adds loss_scale/growth_tracker: checked at a scale
    # of 1024, where the gradients are computed scaled and unscaled (a value not divided back, or
    # divided twice, is 1024x off); where they overflow there, at scale 1 (Runner._run_here).
    training = "amp_rewrite.training" in sess.get_modelmeta().custom_metadata_map
    defaults = {"loss_scale": np.array(CHECK_LOSS_SCALE, np.float32),
                "growth_tracker": np.array(0, np.int64)} if training else {}
    for i in sess.get_inputs():
        if i.name not in feeds:
            if i.name in defaults:
                out[i.name] = defaults[i.name]
            continue
        if isinstance(feeds[i.name], (list, tuple)):
            want = types.get(_innermost_tensor(i.type))
            with np.errstate(over="ignore"):
                out[i.name] = [a.astype(want) if want is not None and a.dtype != want and _kind(a.dtype) == "float"
                               else a for a in map(np.asarray, feeds[i.name])]
            continue
        arr = np.asarray(feeds[i.name])
        if i.type == "tensor(bfloat16)" and _kind(arr.dtype) == "float":
            out[i.name] = _bf16_value(arr)  # numpy has no bfloat16: onnxruntime takes its bits
            continue
        want = types.get(_innermost_tensor(i.type))  # (an optional tensor's too)
        if want is not None and arr.dtype != want and _kind(arr.dtype) == "float":
            with np.errstate(over="ignore"):  # (beyond FP16's range: check_models notes it)
                arr = arr.astype(want)
        elif i.type == "tensor(string)" and arr.dtype != object:
            arr = arr.astype(str).astype(object)
        out[i.name] = arr
    return out


def _innermost_tensor(ort_type: str) -> str:
    """The tensor type inside onnxruntime's type text: tensor(float) in optional(seq(tensor(float)))."""
    found = re.search(r"tensor\([a-z0-9]+\)", ort_type)
    return found.group(0) if found else ort_type


def _numpy_of(value: Any) -> Any:
    """An output OrtValue as numpy; bfloat16 (which numpy lacks) widened to float32 exactly."""
    if not value.is_tensor() or value.data_type() != "tensor(bfloat16)":
        return value.numpy()
    if value.device_name().lower() != "cpu":
        raise RuntimeError(f"a bfloat16 output on {value.device_name()} cannot be read back")
    import ctypes

    shape = tuple(value.shape())
    count = int(np.prod(shape, dtype=np.int64))
    bits = np.ctypeslib.as_array((ctypes.c_uint16 * count).from_address(value.data_ptr())) if count else \
        np.zeros(0, np.uint16)
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32).reshape(shape)


def _bf16_value(arr: np.ndarray) -> Any:
    """An onnxruntime OrtValue of type bfloat16 holding ``arr`` rounded to nearest even (a rewrite
    with ``--target bf16 --no-keep-io-types`` takes BF16 inputs)."""
    from onnxruntime import OrtValue

    return OrtValue.ortvalue_from_numpy_with_onnx_type(_bf16_bits(arr), 16)  # onnx.TensorProto.BFLOAT16


def _bf16_bits(arr: np.ndarray) -> np.ndarray:
    """The bfloat16 bit patterns of ``arr`` rounded to nearest even (NaN stays NaN)."""
    bits = np.ascontiguousarray(arr, dtype=np.float32).view(np.uint32)
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
    return np.where(np.isnan(arr), np.uint32(0x7FC0), rounded).astype(np.uint16)


def _one_line(text: str, limit: int = 400) -> str:
    """onnxruntime's message on one line: its lines joined (the first alone dropped the detail, such
    as which index of which input was wrong), cut at ``limit`` characters."""
    joined = " ".join(ln.strip() for ln in text.strip().splitlines() if ln.strip()) or text
    # (less onnxruntime's source location and C++ signature, which say nothing to the user)
    joined = re.sub(r"\S*onnxruntime/\S+\.(?:h|cc|cpp):\d+ [^()]*\([^()]*\) ", "", joined)
    return joined if len(joined) <= limit else joined[:limit - 1] + "…"


# ===================================================================================================
# exposing intermediates
# ===================================================================================================
def _tags(node: onnx.NodeProto) -> dict[str, str]:
    return {p.key[len("amp_rewrite."):]: p.value for p in node.metadata_props if p.key.startswith("amp_rewrite.")}


def node_label(node: onnx.NodeProto) -> str:
    """The node's label as the rewrite's decision log and ``fp32_nodes`` know it."""
    return _tags(node).get("label") or node.name or f"{node.op_type}:{node.output[0] if node.output else ''}"


def _value_types(graph: onnx.GraphProto) -> dict[str, int]:
    types = {v.name: v.type.tensor_type.elem_type for v in list(graph.input) + list(graph.output) + list(graph.value_info)
             if v.type.HasField("tensor_type")}
    types.update({t.name: t.data_type for t in graph.initializer})
    for n in graph.node:
        if n.op_type == "Cast" and n.domain in ("", "ai.onnx") and n.output:
            to = next((a.i for a in n.attribute if a.name == "to"), None)
            if to is not None:
                types[n.output[0]] = to
    return types


def _reference_copy(proto: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of the FP32 model with every main-graph node output also a graph output."""
    model = onnx.ModelProto()
    model.CopyFrom(proto)
    g = model.graph
    have = {o.name for o in g.output}
    for n in g.node:
        for out in n.output:
            if out and out not in have:
                have.add(out)
                g.output.add().name = out  # no type: onnxruntime infers it
    return model


def _exposed_copy(proto: onnx.ModelProto) -> tuple[onnx.ModelProto, dict[str, str]]:
    """A copy of the rewritten model with every main-graph FP16/BF16 node output also a graph
    output. Returns the copy and extra output → value name.

    FP16 values are exposed as they are: on the CPU provider onnxruntime computes FP16 ops in FP32
    between inserted casts and drops FP16 → FP32 round trips, so a Cast to FP32 here would read the
    unrounded FP32 value and hide the overflow; a graph output of type FP16 is rounded (and
    overflows) as on a GPU. BF16 values go through a Cast to FP32 (numpy has no bfloat16)."""
    model = onnx.ModelProto()
    model.CopyFrom(proto)
    g = model.graph
    types = _value_types(g)
    exposed: dict[str, str] = {}
    have = {o.name for o in g.output}
    taken = {o for n in g.node for o in n.output} | {v.name for v in g.input} | {t.name for t in g.initializer}
    casts = []
    for i, n in enumerate(list(g.node)):
        for out in n.output:
            elem = types.get(out)
            if not out or elem not in _LOW_TYPES:
                continue
            if elem == onnx.TensorProto.FLOAT16:
                if out not in have:
                    g.output.append(onnx.helper.make_tensor_value_info(out, elem, None))
                    have.add(out)
                exposed[out] = out
                continue
            name = f"amp_check/{i}/{out}"
            while name in taken:
                name += "_"
            taken.add(name)
            casts.append(onnx.helper.make_node("Cast", [out], [name], name=name, to=onnx.TensorProto.FLOAT))
            g.output.append(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))
            exposed[name] = out
    g.node.extend(casts)
    _expose_holders(g, have, exposed)
    return model, exposed


def _fp32_name(low_name: str) -> str:
    return _RENAMED.sub("", low_name)


# ===================================================================================================
# comparison
# ===================================================================================================
@dataclass
class OutputStats:
    name: str
    max_abs: float
    max_rel: float
    cosine: float | None
    nan_fp32: int
    inf_fp32: int
    nan_low: int
    inf_low: int
    new_nonfinite: int  # NaN/Inf in the rewritten model where the FP32 one is finite
    passed: bool
    compared: str = "values"  # "values" or "mismatch fraction" (integer / bool outputs)

    def to_dict(self) -> dict[str, Any]:
        return {"output": self.name, "max_abs": _jnum(self.max_abs), "max_rel": _jnum(self.max_rel),
                "cosine": _jnum(self.cosine), "nan_fp32": self.nan_fp32, "inf_fp32": self.inf_fp32,
                "nan_low": self.nan_low, "inf_low": self.inf_low, "new_nonfinite": self.new_nonfinite,
                "compared": self.compared, "passed": self.passed}


@dataclass
class Overflow:
    node: str  # label (the name fp32_nodes matches), or the inserted Cast's name
    op: str
    value: str  # the low-precision value
    fp32_value: str
    nan: int
    pos_inf: int
    neg_inf: int
    fp32_max_abs: float
    root: bool  # none of its inputs had overflowed already
    inserted: bool = False  # an inserted Cast (FP32 -> low): the value was too large for the type
    own_cast: bool = False  # (of those) a Cast the model had, retargeted to the low type or written so
    consumers: list[tuple[str, str]] = field(default_factory=list)  # Casts: (label, op) of low nodes reading it
    # an If/Loop/Scan root: its inputs (outer values its bodies read too) were fine, so the value
    # overflowed inside a body, whose values are not exposed; pinning the node itself changes nothing
    in_body: bool = False

    def describe(self, low: str) -> str:
        parts = []
        if self.pos_inf:
            parts.append(f"{self.pos_inf} values +inf")
        if self.neg_inf:
            parts.append(f"{self.neg_inf} values -inf")
        if self.nan:
            parts.append(f"{self.nan} values NaN")
        what = ", ".join(parts)
        feeding = f" feeding {', '.join(c for c, _ in self.consumers[:3])}" if self.consumers else ""
        what_cast = "the model's own Cast, to " if self.own_cast else "inserted Cast to "
        cast = f" ({what_cast}{low}{feeding})" if self.inserted else ""
        body = f" (made inside its body: --fp32-nodes '{self.node}.*' pins the body's nodes)" if self.in_body else ""
        return f"{self.node} ({self.op}){cast} — {what} in {low}; FP32 max |x| {self.fp32_max_abs:.3g}{body}"

    def to_dict(self) -> dict[str, Any]:
        return {"node": self.node, "op": self.op, "value": self.value, "nan": self.nan, "pos_inf": self.pos_inf,
                "neg_inf": self.neg_inf, "fp32_max_abs": _jnum(self.fp32_max_abs), "root": self.root,
                "inserted_cast": self.inserted, "in_body": self.in_body}


@dataclass
class CheckResult:
    passed: bool
    tolerance: float
    target: str
    provider: str
    outputs: list[OutputStats]
    overflow: list[Overflow] = field(default_factory=list)  # in topological order; roots flagged
    overflow_total: int = 0
    near_limit: list[dict[str, Any]] = field(default_factory=list)
    inputs: list[dict[str, Any]] = field(default_factory=list)
    evaluations: int = 0
    localised: bool = True
    notes: list[str] = field(default_factory=list)
    # inputs taken in the low type whose values it cannot hold (--no-keep-io-types): no pin helps
    beyond_inputs: list[str] = field(default_factory=list)

    @property
    def roots(self) -> list[Overflow]:
        return [o for o in self.overflow if o.root]

    @property
    def worst(self) -> OutputStats | None:
        failing = [o for o in self.outputs if not o.passed] or self.outputs
        return max(failing, key=lambda o: (o.new_nonfinite > 0, _sortable(o.max_rel)), default=None)

    @property
    def reshaped(self) -> list["OutputStats"]:
        """Outputs whose shape differs from the FP32 model's: no precision choice explains that."""
        return [o for o in self.outputs if o.compared.startswith("shape ")]

    def failure_message(self) -> str:
        parts = []
        bad = [o for o in self.outputs if not o.passed]
        reshaped = self.reshaped
        if reshaped:
            w = reshaped[0]
            parts.append(f"output {w.name!r}: {w.compared} (FP32 vs {self.target}): the "
                         f"rewrite changed an output's shape, a bug in amp-rewrite; please report it with the model"
                         + (f" ({len(bad) - 1} more outputs fail)" if len(bad) > 1 else ""))
        elif bad:
            w = self.worst
            why = (f"{w.new_nonfinite} NaN/Inf values the FP32 model does not have" if w.new_nonfinite else
                   f"max relative error {_fmt(w.max_rel)} > tolerance {self.tolerance:g}")
            parts.append(f"output {w.name!r}: {why}" + (f" ({len(bad) - 1} more outputs fail)" if len(bad) > 1 else ""))
        else:
            parts.append("the outputs are within tolerance but intermediate values overflowed")
        if self.beyond_inputs:
            parts.append(self.beyond_inputs[0])
        if self.roots:
            parts.append(f"first overflowing node: {self.roots[0].describe(self.target)}")
        return "check failed: " + "; ".join(parts)

    def table(self) -> str:
        lines = [f"check: {self.provider}, tolerance {self.tolerance:g} (max |a-b| / max |a|), {self.evaluations} "
                 f"model evaluations"]
        for d in self.inputs:  # (an optional input fed empty has no dtype)
            typed = f"{d['dtype']}{d['shape']} " if d.get("dtype") else ""
            lines.append(f"  input {d['name']}: {typed}{d['values']}")
        low = self.target
        head = ["output", "max abs err", "max rel err", "cosine", "NaN/Inf fp32", f"NaN/Inf {low}", "ok"]
        rows = [[o.name, _fmt(o.max_abs), _fmt(o.max_rel) + ("*" if o.compared != "values" else ""),
                 "-" if o.cosine is None else f"{o.cosine:.6f}", f"{o.nan_fp32}/{o.inf_fp32}",
                 f"{o.nan_low}/{o.inf_low}", "yes" if o.passed else "NO"] for o in self.outputs]
        widths = [max(len(str(r[i])) for r in [head] + rows) for i in range(len(head))]
        for r in [head] + rows:
            lines.append("  " + "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip())
        if any(o.compared == "mismatch fraction" for o in self.outputs):
            lines.append("  * integer/bool output: fraction of elements that differ")
        for o in self.reshaped:
            lines.append(f"  * {o.name}: {o.compared} (FP32 vs {low}): the shapes differ")
        if self.overflow:
            roots = self.roots
            lines.append(f"first overflowing node: {roots[0].describe(low)}" if roots else
                         f"overflowing node: {self.overflow[0].describe(low)}")
            for o in roots[1:5]:
                lines.append(f"  also: {o.describe(low)}")
            more_roots = len(roots[5:])
            downstream = self.overflow_total - len(roots[:5]) - more_roots
            said = ([f"{more_roots} more overflowing node{'s' if more_roots > 1 else ''}"] if more_roots else []) \
                + ([f"{downstream} more {low} value{'s' if downstream > 1 else ''} downstream"] if downstream > 0 else [])
            if said:
                lines.append(f"  ({' and '.join(said)} carry NaN/Inf)")
        elif self.localised:
            lines.append(f"no {low} intermediate value overflowed (main graph)")
        for w in self.near_limit[:5]:
            lines.append(f"warning: {w['node']} ({w['op']}): max |x| {w['max_abs']:.4g} is within 2x of the {low} "
                         f"limit")
        for note in self.notes:
            lines.append(f"note: {note}")
        lines.append("check " + ("passed" if self.passed else "FAILED"))
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {"passed": self.passed, "tolerance": self.tolerance, "target": self.target, "provider": self.provider,
                "evaluations": self.evaluations, "inputs": [dict(d, shape=str(d["shape"])) for d in self.inputs],
                "outputs": [o.to_dict() for o in self.outputs],
                "first_overflow": self.roots[0].node if self.roots else None,
                "overflow": [o.to_dict() for o in self.overflow],
                "overflow_total": self.overflow_total,
                "near_limit": [{k: _jnum(v) if isinstance(v, float) else v for k, v in w.items()}
                               for w in self.near_limit],
                "scope": "main graph (If/Loop/Scan bodies are not looked into)",
                "notes": list(self.notes)}


def _jnum(x: float | None) -> Any:
    """JSON has no inf/NaN: such numbers become strings."""
    if x is None:
        return None
    x = float(x)
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return x


def _fmt(x: float | None) -> str:
    if x is None:
        return "-"
    if math.isnan(x) or math.isinf(x):
        return str(x)
    return f"{x:.3g}"


def _sortable(x: float) -> float:
    return float("inf") if math.isnan(x) else x


def compare_output(name: str, ref: Any, got: Any, tolerance: float) -> OutputStats:
    a = np.asarray(ref)
    b = np.asarray(got)
    if a.dtype.kind not in "fc" and a.dtype.name != "bfloat16":
        same_shape = a.shape == b.shape
        frac = float(np.mean(a != b)) if same_shape and a.size else (0.0 if same_shape else 1.0)
        numeric = a.dtype.kind in "iub" and b.dtype.kind in "iub"
        diff = float(np.abs(a.astype(np.float64) - b.astype(np.float64)).max()) if numeric and same_shape and a.size \
            else float(frac > 0)  # (strings: no distance, only equal or not)
        return OutputStats(name, diff, frac, None, 0, 0, 0, 0, 0, frac <= tolerance, "mismatch fraction")
    a = a.astype(np.float64)
    b = b.astype(np.float64)
    stats = dict(nan_fp32=int(np.isnan(a).sum()), inf_fp32=int(np.isinf(a).sum()),
                 nan_low=int(np.isnan(b).sum()), inf_low=int(np.isinf(b).sum()))
    if a.shape != b.shape:
        return OutputStats(name, float("inf"), float("inf"), None, **stats, new_nonfinite=0, passed=False,
                           compared=f"shape {list(a.shape)} vs {list(b.shape)}")
    fa, fb = np.isfinite(a), np.isfinite(b)
    new = int((fa & ~fb).sum())
    both = fa & fb
    if both.any():
        diff = np.abs(a[both] - b[both])
        max_abs = float(diff.max())
        scale = float(np.abs(a[both]).max())
        max_rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else float("inf"))
        na, nb = float(np.linalg.norm(a[both])), float(np.linalg.norm(b[both]))
        cosine = float(np.dot(a[both], b[both]) / (na * nb)) if na > 0 and nb > 0 else (1.0 if na == nb else 0.0)
    else:
        max_abs, max_rel, cosine = 0.0, 0.0, None
    # the same non-finite pattern is not an error (an FP32 -inf stays -inf)
    mismatched = int((~fa & ~fb & ~((a == b) | (np.isnan(a) & np.isnan(b)))).sum())
    if new or mismatched:  # (a finite value against NaN/inf, or two different ones: infinitely far apart)
        max_abs, max_rel = float("inf"), float("inf")
        cosine = None  # (over the finite elements alone it said 1.000000 beside 112 NaN)
    passed = new == 0 and mismatched == 0 and max_rel <= tolerance
    return OutputStats(name, max_abs, max_rel, cosine, **stats, new_nonfinite=new, passed=passed)


def _localise(low_proto: onnx.ModelProto, low_values: Mapping[str, np.ndarray], exposed: Mapping[str, str],
              ref: Mapping[str, np.ndarray], target: str, bad_inputs: Sequence[str] = (),
              feeds: Mapping[str, Any] | None = None
              ) -> tuple[list[Overflow], int, list[dict[str, Any]], list[dict[str, Any]]]:
    """Overflowing low-precision values in topological order, values near the limit, and values
    where mask sentinels saturated to ±inf (not counted as overflow). ``bad_inputs``: graph inputs
    fed values beyond the low type's range (their readers are not where it started).

    A value of |x| >= SENTINEL in FP32 is a mask sentinel only where it carries one: made by a
    Constant/ConstantOfShape, or computed from a constant, graph input or value that holds one
    (a constant the rewrite saturated holds ±limit). A MatMul whose output reaches 1.6e8 from
    inputs of 1e4 overflowed: it was taken for a mask, and the check said nothing overflowed."""
    limit = LIMITS[target]
    carrying = _sentinel_sources(low_proto, limit, feeds or {}) | set(bad_inputs)
    by_value = {v: k for k, v in exposed.items()}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for n in low_proto.graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    bad_values: set[str] = set(bad_inputs)
    found: list[Overflow] = []
    total = 0
    near: list[dict[str, Any]] = []
    sentinels: list[dict[str, Any]] = []
    for n in low_proto.graph.node:
        for out in n.output:
            key = by_value.get(out)
            if key is None or key not in low_values or not isinstance(low_values[key], np.ndarray):
                continue  # (an If's or Loop's sequence output, whose tensors may differ in shape: not a tensor)
            got = np.asarray(low_values[key], np.float64)
            ref_name = _fp32_name(out)
            want = ref.get(ref_name)
            if want is None or not isinstance(want, np.ndarray) or want.shape != got.shape or want.dtype.kind != "f":
                continue
            want = np.asarray(want, np.float64)
            new = np.isfinite(want) & ~np.isfinite(got)
            read = [*n.input, *_outer_reads(n)]  # (an If/Loop/Scan reads outer values in its bodies too)
            sentinel = np.abs(want) >= SENTINEL
            if sentinel.any() and (n.op_type in ("Constant", "ConstantOfShape") or any(i in carrying for i in read)
                                   or _body_holds_sentinel(n, carrying)):
                carrying.add(out)
            elif out not in carrying:
                sentinel = np.zeros_like(sentinel)  # (a computed magnitude, not a mask's)
            # mask sentinels (-1e9, finfo(float32).min) saturating to -inf of the same sign: expected
            with np.errstate(invalid="ignore"):
                saturated = new & np.isinf(got) & sentinel & (np.sign(got) == np.sign(want))
            if saturated.any():
                sentinels.append({"node": n.name if _tags(n).get("inserted") else node_label(n), "op": n.op_type,
                                  "value": out, "count": int(saturated.sum())})
                new = new & ~saturated
            finite_ref = want[np.isfinite(want) & ~sentinel]
            ref_max = float(np.abs(finite_ref).max()) if finite_ref.size else 0.0
            if new.any():
                total += 1
                bad_values.add(out)
                tags = _tags(n)
                inserted = tags.get("inserted") == "cast" or n.op_type == "Cast"
                # A Cast of values that stay within the low type's range in FP32 cannot overflow
                # itself: its input was bad already (an FP32 value behind an If/Loop or the model's
                # own Cast carries an earlier overflow, and such values are not exposed)
                root = not any(i in bad_values for i in read) and not (n.op_type == "Cast" and ref_max < limit)
                users = [(node_label(c), c.op_type) for c in consumers.get(out, []) if _tags(c).get("precision") == "low"]
                if len(found) < _MAX_LISTED or root:
                    found.append(Overflow(
                        node=n.name if tags.get("inserted") else node_label(n), op=n.op_type, value=out,
                        fp32_value=ref_name, nan=int((new & np.isnan(got)).sum()),
                        pos_inf=int((new & np.isposinf(got)).sum()), neg_inf=int((new & np.isneginf(got)).sum()),
                        fp32_max_abs=ref_max, root=root, inserted=inserted, consumers=users,
                        own_cast=inserted and tags.get("inserted") != "cast",
                        in_body=root and bool(_bodies(n))))
                continue
            finite = got[np.isfinite(got) & np.isfinite(want) & ~sentinel]
            peak = float(np.abs(finite).max()) if finite.size else 0.0
            if peak > NEAR_LIMIT * limit and len(near) < _MAX_LISTED:
                near.append({"node": node_label(n), "op": n.op_type, "value": out, "max_abs": peak})
    return found, total, near, sentinels


def _sentinel_sources(proto: onnx.ModelProto, limit: float, feeds: Mapping[str, Any]) -> set[str]:
    """Graph inputs fed a value of |x| >= SENTINEL, and constants holding one at the low type's
    limit or beyond (a mask sentinel, saturated or kept FP32): initializers of any graph, and the
    Constant nodes of If/Loop/Scan bodies (the main graph's are exposed and judged by their values)."""
    found = {name for name, value in feeds.items() if isinstance(value, np.ndarray) and value.dtype.kind == "f"
             and value.size and np.nanmax(np.abs(value)) >= SENTINEL}
    for graph in _graphs_in(proto.graph):
        constants = [(t.name, t) for t in graph.initializer if t.data_location != onnx.TensorProto.EXTERNAL]
        if graph is not proto.graph:
            constants += [(n.output[0], a.t if a.name == "value" else a.f) for n in graph.node
                          if n.op_type == "Constant" and n.output for a in n.attribute
                          if a.name in ("value", "value_float")]
        found.update(name for name, held in constants if _reaches(held, limit))
    return found


def _reaches(held: onnx.TensorProto | float, limit: float) -> bool:
    """Whether a float constant (a tensor or a number) holds a value of |x| >= ``limit``."""
    if isinstance(held, float):
        return abs(held) >= limit
    if held.data_type not in _FLOAT_TYPES:
        return False
    from onnx import numpy_helper

    try:
        data = numpy_helper.to_array(held)
    except Exception:  # noqa: BLE001 - an unreadable tensor holds no sentinel we can see
        return False
    return bool(data.size) and float(np.nanmax(np.abs(data.astype(np.float32)))) >= limit


def _body_holds_sentinel(node: onnx.NodeProto, carrying: set[str]) -> bool:
    """Whether an If/Loop/Scan's bodies hold a mask sentinel of their own (``_sentinel_sources``
    found it): the bodies' values are not exposed, so the node's outputs stand for them."""
    return any(name in carrying for body in _bodies(node) for g in _graphs_in(body)
               for name in [*(t.name for t in g.initializer), *(o for n in g.node for o in n.output)])


def _graphs_in(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    """``graph`` and every graph nested in it."""
    yield graph
    for n in graph.node:
        for body in _bodies(n):
            yield from _graphs_in(body)


_FLOAT_TYPES = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE)


def _bodies(node: onnx.NodeProto) -> list[onnx.GraphProto]:
    """The graphs ``node`` holds (an If's branches, a Loop's or Scan's body)."""
    return [g for a in node.attribute for g in ([a.g] if a.type == onnx.AttributeProto.GRAPH else
                                                 a.graphs if a.type == onnx.AttributeProto.GRAPHS else [])]


def _nested_nodes(node: onnx.NodeProto) -> Iterator[onnx.NodeProto]:
    """The nodes of ``node``'s bodies, nested bodies included."""
    for body in _bodies(node):
        for n in body.node:
            yield n
            yield from _nested_nodes(n)


def _outer_reads(node: onnx.NodeProto) -> list[str]:
    """The outer-scope values ``node``'s bodies (nested ones included) read: inputs of the node as
    much as its listed ones, though no edge of the outer graph says so."""
    reads: list[str] = []

    def walk(graph: onnx.GraphProto, defined: set[str]) -> None:
        defined = defined | {v.name for v in graph.input} | {t.name for t in graph.initializer} | \
            {o for n in graph.node for o in n.output}
        for n in graph.node:
            reads.extend(i for i in n.input if i and i not in defined)
            for body in _bodies(n):
                walk(body, defined)

    for body in _bodies(node):
        walk(body, set())
    return reads


# ===================================================================================================
# the check
# ===================================================================================================
@dataclass
class Reference:
    """The FP32 model's outputs and main-graph intermediate values on ``feeds`` (one evaluation)."""

    outputs: list[str]
    values: dict[str, np.ndarray]
    feeds: dict[str, Any]  # a sequence input's value: a list of arrays
    inputs: list[dict[str, Any]]
    notes: list[str] = field(default_factory=list)
    input_types: dict[str, int] = field(default_factory=dict)  # element type by graph input name
    others: dict[str, Any] = field(default_factory=dict)  # sequence (a list) and optional outputs, by name



def _reference_for(fp32, inputs, runner):
    """The FP32 run on generated inputs, an .npz file's, or a dict's."""
    if inputs is None:
        feeds, described = make_inputs(fp32)
    elif isinstance(inputs, (str, Path)):
        feeds, described = load_inputs(inputs, fp32)
    else:  # (a sequence input's value: a list of arrays)
        feeds = {k: [np.asarray(a) for a in v] if isinstance(v, (list, tuple)) else np.asarray(v)
                 for k, v in inputs.items()}
        described = [{"name": k, "dtype": str(v.dtype), "shape": list(v.shape), "values": "given"}
                     if isinstance(v, np.ndarray) else
                     {"name": k, "dtype": str(v[0].dtype) if v else "?", "shape": list(v[0].shape) if v else [],
                      "values": f"a sequence of {len(v)} tensors, given"} for k, v in feeds.items()]
    return reference(fp32, feeds, runner, described, user_inputs=inputs is not None)


def _cannot_load(exc: RuntimeError, runner: Runner) -> str:
    """Why onnxruntime cannot run the FP32 model whatever the inputs (it refused to create the
    session), and what to do: the inputs are not to blame."""
    text, version = str(exc), runner.ort.__version__
    if ir := re.search(r"Unsupported model IR version: (\d+), max supported IR version: (\d+)", text):
        return (f"onnxruntime {version} reads ONNX IR version {ir[2]} at most and the model is IR version {ir[1]}, "
                f"so --check cannot run it on this machine: save the model with ir_version {ir[2]} or lower "
                f"(onnx.helper.make_model writes the newest by default; the rewrite keeps the model's), or leave out "
                f"--check")
    if opset := re.search(r"Opset (\d+) is under development.*support for domain (\S+) is till opset (\d+)", text):
        return (f"onnxruntime {version} reads {opset[2]} opsets up to {opset[3]} and the model imports opset "
                f"{opset[1]}, so --check cannot run it on this machine: export the model at opset {opset[3]} or "
                f"lower, or leave out --check")
    if "NOT_IMPLEMENTED" in text:  # (an op with no kernel on this provider)
        return (f"onnxruntime's {runner.providers[0]} has no kernel for an op of the FP32 model ({exc}), so --check "
                f"cannot run it on this machine: check where onnxruntime has one (onnxruntime-gpu's "
                f"CUDAExecutionProvider for com.microsoft ops), or leave out --check")
    return (f"onnxruntime {version} cannot load the FP32 model ({exc}), so --check cannot run it on this machine: "
            f"leave out --check")


def reference(fp32: Any, feeds: Mapping[str, Any], runner: Runner,
              inputs: list[dict[str, Any]] | None = None, *, user_inputs: bool = False) -> Reference:
    proto = original = _as_proto(fp32)
    notes = []
    if runner.providers[0] != "CUDAExecutionProvider" and _holds_low_values(proto):
        # the input model computes in FP16/BF16 somewhere itself: its GPU numerics, as the rewrite's
        from .emulate import emulate_all

        try:
            proto = emulate_all(proto)[0]
            feeds = _rounded_feeds(original, feeds)
            notes.append("the input model holds FP16/BF16 values itself: it is checked as a GPU computes them too "
                         "(rounded where they are made)")
        except Exception as exc:  # noqa: BLE001 - it runs as it is, with a note
            notes.append(f"the input model's own FP16/BF16 values could not be emulated ({_one_line(str(exc))})")
    try:
        values = runner.run(_reference_copy(proto), feeds, what="running the FP32 model", fp32=True)
    except RuntimeError:
        try:  # exposing the intermediates was the problem? then compare the outputs only
            values = runner.run(proto, feeds, what="running the FP32 model", fp32=True)
        except RuntimeError as exc:
            from .ort_worker import OrtCrash, SessionError

            if isinstance(exc, SessionError) or "NOT_IMPLEMENTED" in str(exc):
                raise UsageError(_cannot_load(exc, runner)) from exc  # (whatever the inputs)
            hint = "check the arrays in --inputs" if user_inputs else "pass real inputs with --inputs file.npz"
            if isinstance(exc, OrtCrash):  # (no input makes an assertion in a kernel hold)
                hint = "onnxruntime cannot run it, so the check cannot compare with it"
            raise UsageError(f"onnxruntime cannot run the FP32 model on the {'given' if user_inputs else 'generated'} "
                             f"inputs ({exc}); {hint}") from exc
        notes.append("onnxruntime could not run the FP32 model with its intermediate values exposed: "
                     "overflow is not localised")
    outputs = [o.name for o in proto.graph.output]
    # a sequence output comes back as a list of arrays, an empty optional as None
    others = {k: values[k] for k in outputs if k in values and not isinstance(values[k], np.ndarray)}
    values = {k: np.asarray(v) for k, v in values.items() if isinstance(v, np.ndarray)}
    values.update({k: v for k, v in feeds.items() if isinstance(v, np.ndarray)})  # (not a sequence's list)
    return Reference(outputs, values, dict(feeds), inputs or [], notes,
                     {vi.name: vi.type.tensor_type.elem_type for vi in original.graph.input}, others)


def _holds_low_values(proto: onnx.ModelProto) -> bool:
    """Whether a model declares or casts to FP16/BF16 anywhere (a quick look: types, initializers,
    Cast targets)."""
    from .frontends.onnx_loader import _graph_protos

    for g in _graph_protos(proto.graph):
        if any(t.data_type in _LOW_TYPES for t in g.initializer):
            return True
        if any(v.type.tensor_type.elem_type in _LOW_TYPES for v in [*g.input, *g.output, *g.value_info]):
            return True
        if any(n.op_type == "Cast" and any(a.name == "to" and a.i in _LOW_TYPES for a in n.attribute) for n in g.node):
            return True
    return False


# The relative error --check allows by default: 1e-2 for fp16 (issue 2's bound on logits); bf16
# keeps 8 significant bits to fp16's 11 (unit roundoff 2**-9 against 2**-12, 8x coarser), so the
# same model lands several times further from FP32 (tiny_bert logits: 0.0128 in bf16, 0.0006 in fp16).
DEFAULT_TOLERANCE = {"fp16": 1e-2, "bf16": 5e-2}


def default_tolerance(target: str | None) -> float:
    return DEFAULT_TOLERANCE.get(target or "fp16", DEFAULT_TOLERANCE["fp16"])


def check_models(fp32: Any, low: Any, *, inputs: Mapping[str, Any] | str | Path | None = None,
                 tolerance: float | None = None, target: str | None = None, localise: bool = True,
                 plain_run: bool = True, runner: Runner | None = None, ref: Reference | None = None) -> CheckResult:
    """Run the FP32 model and the rewritten one on the same inputs and compare them.

    ``fp32``/``low``: paths, ModelProtos or onnx-ir Models. ``inputs``: arrays by name, an .npz
    path, or None to generate them. ``localise``: also run a copy of the rewritten model with its
    low-precision intermediates exposed and report overflows (one more evaluation).
    ``plain_run=False`` takes the outputs from that copy instead of running the model as it is.
    ``tolerance``: None takes the target's (:data:`DEFAULT_TOLERANCE`).
    """
    runner = runner or Runner()
    if ref is None:
        ref = _reference_for(fp32, inputs, runner)
    low_proto = _as_proto(low)
    target = target or _target_of(low_proto)
    tolerance = default_tolerance(target) if tolerance is None else tolerance
    beyond = _inputs_beyond_range(ref.input_types, low_proto, ref.feeds)
    notes = list(ref.notes) + [note for _, note in beyond]
    run_model: Any = low if isinstance(low, (str, Path)) else low_proto
    feeds = ref.feeds
    emulation: _Emulation | None = None
    if runner.providers[0] != "CUDAExecutionProvider":
        feeds = _rounded_feeds(low_proto, ref.feeds)
        emulation = _Emulation.build(low_proto, target, notes)
        if emulation is not None:
            # (what runs is the emulation, FP32 throughout: the model itself must still load)
            try:
                runner.load(run_model, what="loading the rewritten model")
            except RuntimeError as exc:
                raise CheckRunError(f"check failed: onnxruntime cannot load the rewritten model ({exc})") from exc
            run_model = emulation.model
    outputs: dict[str, Any] = {}

    def plain() -> dict[str, Any]:
        nonlocal run_model, emulation
        if emulation is not None:
            try:
                return runner.run(run_model, feeds, what="running the emulated rewritten model", emulated=True)
            except RuntimeError as exc:
                emulation.failed(exc, notes)
                emulation, run_model = None, low_proto
        return _run_low(runner, run_model, feeds)

    if plain_run or not localise:
        outputs = plain()
    overflow, total, near, sentinels = [], 0, [], []
    if localise:
        copy, exposed = _exposed_copy(low_proto) if emulation is None else _exposed_names(run_model, emulation.rounded)
        try:
            values = runner.run(copy, feeds, what="running the rewritten model with its intermediates exposed",
                                emulated=emulation is not None)
        except RuntimeError:
            values = None
            localise = False
            notes.append("onnxruntime could not run the rewritten model with its intermediate values exposed: "
                         "overflow is not localised")
            if not outputs:
                outputs = plain()
        if values is not None:
            if not outputs:
                outputs = {k: v for k, v in values.items() if k in set(ref.outputs)}
            overflow, total, near, sentinels = _localise(low_proto, values, exposed, ref.values, target,
                                                         [name for name, _ in beyond], feeds)
    if emulation is not None:
        notes.append(f"CPU provider: every {target} value is rounded to {target} where it is made and carried as "
                     f"FP32 between nodes, as a GPU computes (onnxruntime's CPU kernels alone skip those roundings)")
    stats = []
    if sentinels:
        first = sentinels[0]
        notes.append(f"{sum(s['count'] for s in sentinels)} mask-like sentinel values (|x| >= {SENTINEL:.0e} in FP32, "
                     f"e.g. finfo(float32).min) became ±inf in {target} at {len(sentinels)} value(s), first at "
                     f"{first['node']} ({first['op']}): expected for masks added before a softmax (a fully masked "
                     f"row would give NaN), not counted as overflow")
    for name in ref.outputs:
        if name not in outputs:
            notes.append(f"output {name!r} is missing from the rewritten model")
            stats.append(OutputStats(name, float("inf"), float("inf"), None, 0, 0, 0, 0, 0, False, "missing"))
            continue
        if name not in ref.values:
            stats += _compare_other(name, ref.others.get(name), outputs[name], tolerance, notes)
            continue
        stats.append(compare_output(name, ref.values[name], outputs[name], tolerance))
    passed = all(o.passed for o in stats) and total == 0
    notes += _selection_notes(low_proto, [o.name for o in stats if not o.passed and o.compared != "missing"], target)
    return CheckResult(passed=passed, tolerance=tolerance, target=target, provider=runner.provider, outputs=stats,
                       overflow=overflow, overflow_total=total, near_limit=near, inputs=ref.inputs,
                       evaluations=runner.evaluations, localised=localise, notes=notes,
                       beyond_inputs=[note for _, note in beyond])


# ops that choose elements by comparing values: near ties may choose or order others in a low type
_SELECTING = frozenset({"TopK", "NonMaxSuppression", "ArgMax", "ArgMin", "Unique"})


def _selection_notes(proto: onnx.ModelProto, failing: list[str], target: str) -> list[str]:
    """A note per failing output computed after an op that selects elements by comparing values
    (NonMaxSuppression, TopK, ArgMax...): near-tied scores may pick or order other elements in the
    low type, which an element-wise comparison counts as error though each element is as accurate
    (detection outputs on random images fail so, and --auto-fp32 then pins most of the model)."""
    if not failing:
        return []
    graph = proto.graph
    producers = {out: node for node in graph.node for out in node.output if out}
    notes = []
    for name in failing:
        seen: set[str] = set()
        stack, found = [name], None
        while stack and found is None:
            value = stack.pop()
            node = producers.get(value)
            if node is None or value in seen:
                continue
            seen.add(value)
            chosen = node if node.op_type in _SELECTING else next(
                (n for n in _nested_nodes(node) if n.op_type in _SELECTING), None)
            if chosen is not None:
                found = (chosen.op_type, node_label(node) if chosen is node else f"inside {node_label(node)}")
            stack.extend(i for i in [*node.input, *_outer_reads(node)] if i)
        if found is not None:
            op, where = found
            notes.append(f"output {name!r} is computed after {op} ({where}), which selects elements by comparing "
                         f"values: near-tied scores may select or order other elements in {target}, and an "
                         f"element-wise comparison counts that as error; compare matched elements (detections by "
                         f"box) before pinning nodes FP32 (--auto-fp32 would pin most of such a model)")
    return notes


def _compare_other(name: str, want: Any, got: Any, tolerance: float, notes: list[str]) -> list[OutputStats]:
    """A sequence output compared element by element (``name[i]``), an optional one as its tensor
    or as empty on both sides. A difference in length or presence fails the check."""
    def failed(compared: str) -> OutputStats:
        return OutputStats(name, float("inf"), float("inf"), None, 0, 0, 0, 0, 0, False, compared)

    if isinstance(want, list) or isinstance(got, list):
        if not (isinstance(want, list) and isinstance(got, list)):
            return [failed("a sequence on one side only")]
        if len(want) != len(got):
            return [failed(f"sequence of {len(want)} vs {len(got)} tensors")]
        return [compare_output(f"{name}[{i}]", a, b, tolerance) for i, (a, b) in enumerate(zip(want, got))]
    if want is None and got is None:
        return []  # (an empty optional on both sides)
    if want is None or got is None:
        return [failed("an optional empty on one side only")]
    notes.append(f"output {name!r} is neither a tensor nor a sequence of tensors: not compared")
    return []


def _inputs_beyond_range(before: Mapping[str, int], low_proto: onnx.ModelProto,
                         feeds: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(name, note) of the inputs the rewritten model takes in FP16/BF16 whose values that type
    cannot hold: they enter as ±inf, whatever the rewrite did. The rewrite's doing
    (--no-keep-io-types) where the FP32 model took them (``before``: its input types) in another type."""
    notes = []
    for vi in low_proto.graph.input:
        elem = vi.type.tensor_type.elem_type
        if elem not in _LOW_TYPES or vi.name not in feeds:
            continue
        arr = np.asarray(feeds[vi.name])
        if _kind(arr.dtype) != "float" or not arr.size:
            continue
        kind = _LOW_TYPES[elem]
        finite = arr[np.isfinite(arr)]
        peak = float(np.abs(finite).max()) if finite.size else 0.0
        if peak >= _OVERFLOW_AT[kind]:  # (65504 < |x| < 65520 rounds to 65504, finite)
            why = " (--no-keep-io-types)" if before.get(vi.name) != elem else ""
            notes.append((vi.name, f"input {vi.name!r} holds values beyond {kind}'s range (max |x| {peak:.4g}); the "
                                   f"rewritten model takes it in {kind}{why}, so they enter as ±inf"))
    return notes


@dataclass
class _Emulation:
    """The FP32 emulation of a rewritten model for the CPU provider (amp_rewrite.emulate) and the
    names of the values it rounds to the low type."""

    model: onnx.ModelProto
    rounded: set[str]
    target: str

    @classmethod
    def build(cls, low_proto: onnx.ModelProto, target: str, notes: list[str]) -> "_Emulation | None":
        from .emulate import emulate_all

        try:
            model, rounded = emulate_all(low_proto, notes)
        except Exception as exc:  # noqa: BLE001 - the model itself is run instead, and the note says so
            cls.note_failure(target, exc, notes)
            return None
        return cls(model, rounded, target)

    def failed(self, exc: BaseException, notes: list[str]) -> None:
        self.note_failure(self.target, exc, notes)

    @staticmethod
    def note_failure(target: str, exc: BaseException, notes: list[str]) -> None:
        notes.append(f"the {target} rounding could not be emulated on the CPU provider ({_one_line(str(exc))}): "
                     f"onnxruntime computes its FP32-kernel nodes unrounded, so precision loss and overflow "
                     f"between them go unseen")


def _rounded_feeds(proto: onnx.ModelProto, feeds: Mapping[str, Any]) -> dict[str, Any]:
    """The feeds, those of inputs the model declares FP16/BF16 rounded to that type and widened back:
    what the model receives, also where it passes an input straight to an output."""
    low = {vi.name: vi.type.tensor_type.elem_type for vi in proto.graph.input
           if vi.type.tensor_type.elem_type in _LOW_TYPES}
    out = dict(feeds)
    for name, elem in low.items():
        if name not in feeds:
            continue
        arr = np.asarray(feeds[name])
        if _kind(arr.dtype) != "float":
            continue
        with np.errstate(over="ignore"):
            out[name] = (arr.astype(np.float16) if elem == onnx.TensorProto.FLOAT16 else _bf16_round(arr)
                         ).astype(np.float32)
    return out


def _bf16_round(arr: np.ndarray) -> np.ndarray:
    """``arr`` rounded to bfloat16, as float32."""
    return (_bf16_bits(arr).astype(np.uint32) << np.uint32(16)).view(np.float32)


def _exposed_names(model: onnx.ModelProto, names: set[str]) -> tuple[onnx.ModelProto, dict[str, str]]:
    """A copy of the emulated model with each of its main-graph rounded values (FP32 now) also a
    graph output. Returns the copy and extra output → value name."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    g = copy.graph
    have = {o.name for o in g.output}
    exposed = {}
    for n in g.node:
        for out in n.output:
            if out in names:
                if out not in have:
                    g.output.append(onnx.helper.make_tensor_value_info(out, onnx.TensorProto.FLOAT, None))
                    have.add(out)
                exposed[out] = out
    _expose_holders(g, have, exposed)
    return copy, exposed


def _expose_holders(g: onnx.GraphProto, have: set[str], exposed: dict[str, str]) -> None:
    """Also expose the outputs of the If/Loop/Scan nodes whose bodies run low-precision nodes.
    Their bodies' values are not exposed, and such a node's outputs are FP32 where its body
    casts back: an overflow made inside (a body MatMul) surfaced first at a Cast further on,
    which was blamed (``amp_cast/s/to_fp16``, of a value 0.16 in FP32) with no root found. The
    outputs go untyped (onnxruntime infers them); a non-float one is skipped when compared."""
    for n in g.node:
        if not _holds_low(n):
            continue
        for out in n.output:
            if out and out not in exposed:
                if out not in have:
                    g.output.add().name = out
                    have.add(out)
                exposed[out] = out


def _holds_low(node: onnx.NodeProto) -> bool:
    """Whether a body ``node`` holds (nested ones included) has a low-precision node."""
    return any(_tags(n).get("precision") == "low" or _holds_low(n) for body in _bodies(node) for n in body.node)


def _run_low(runner: Runner, model: Any, feeds: Mapping[str, Any]) -> dict[str, Any]:
    try:
        return runner.run(model, feeds, what="running the rewritten model")
    except RuntimeError as exc:
        raise CheckRunError(f"check failed: onnxruntime cannot run the rewritten model ({exc})") from exc


def _target_of(proto: onnx.ModelProto) -> str:
    import json

    meta = {p.key: p.value for p in proto.metadata_props}
    try:
        return json.loads(meta.get("amp_rewrite.report", "{}")).get("target", "fp16")
    except ValueError:
        return "fp16"


# ===================================================================================================
# auto fp32
# ===================================================================================================
def _exact(label: str) -> str:
    """An fp32_nodes pattern matching exactly ``label`` (labels may hold glob characters), whose
    decision names ``--auto-fp32`` as its source."""
    from .rulebook import PinnedBy

    if label.startswith("re:") or set("*?[").intersection(label):
        return PinnedBy("re:" + re.escape(label), "--auto-fp32")
    return PinnedBy(label, "--auto-fp32")


def _low_nodes(proto: onnx.ModelProto) -> list[tuple[str, str]]:
    """(label, op) of the low-precision nodes in graph order, those of an If/Loop/Scan body where
    their holder runs (an accuracy loss inside a branch is bisected for like any other)."""
    out: list[tuple[str, str]] = []

    def walk(graph: onnx.GraphProto) -> None:
        for n in graph.node:
            for body in _bodies(n):
                walk(body)
            # (a Constant or Cast is no computation to pin: weight conversion and cast placement decide
            # them whatever a pin says, and the summary then called those pins without effect)
            if _tags(n).get("precision") == "low" and not (n.op_type in ("Constant", "Cast")
                                                            and n.domain in ("", "ai.onnx")):
                out.append((node_label(n), n.op_type if n.domain in ("", "ai.onnx") else f"{n.domain}::{n.op_type}"))

    walk(proto.graph)
    return out


@dataclass
class AutoResult:
    result: RewriteResult  # the final rewrite (in memory)
    check: CheckResult  # its check
    pinned: list[dict[str, Any]]
    evaluations: int
    candidates: int
    budget: int
    history: list[dict[str, Any]]
    ref: Reference = field(repr=False, default=None)  # type: ignore[assignment]

    def to_dict(self) -> dict[str, Any]:
        return {"passed": self.check.passed, "pinned": self.pinned, "evaluations": self.evaluations,
                "candidates": self.candidates, "budget": self.budget, "history": self.history}


def auto_fp32(model: Any, *, inputs: Mapping[str, Any] | str | Path | None = None,
              tolerance: float | None = None,
              runner: Runner | None = None, max_candidates: int | None = None, **options: Any) -> AutoResult:
    """Rewrite ``model`` (path or ModelProto) and pin nodes FP32 until it passes the check: the
    shortest run of nodes in graph order (bisected: a prefix, then a suffix of it), not a minimum set.

    Returns the final in-memory rewrite with its check (outputs taken from the exposed copy: one
    evaluation per candidate) and what was pinned and why."""
    from . import progress
    from .api import rewrite_onnx_model

    runner = runner or Runner()
    fp32 = _as_proto(model)
    ref = _reference_for(fp32, inputs, runner)
    base = list(options.pop("fp32_nodes", ()) or ())
    pinned: list[dict[str, Any]] = []
    history: list[dict[str, Any]] = []
    cache: dict[tuple[str, ...], tuple[RewriteResult, CheckResult]] = {}
    state = {"candidates": 0}

    def attempt(labels: Sequence[str], why: str) -> tuple[RewriteResult, CheckResult]:
        key = tuple(sorted(set(labels)))
        if key in cache:
            return cache[key]
        res = rewrite_onnx_model(fp32, fp32_nodes=base + [_exact(lb) for lb in key], **options)
        state["candidates"] += 1
        cr = check_models(fp32, res.model, tolerance=tolerance, plain_run=False, runner=runner, ref=ref,
                          target=options.get("target"))
        history.append({"candidate": state["candidates"], "pinned": len(key), "why": why, "passed": cr.passed,
                        "overflowing_values": cr.overflow_total,
                        "worst_rel_err": _jnum(cr.worst.max_rel) if cr.worst else None})
        cache[key] = (res, cr)
        return res, cr

    labels: list[str] = []
    res, cr = attempt(labels, "initial rewrite")
    n_low = len(_low_nodes(res.model))
    budget = max_candidates if max_candidates is not None else 2 * math.ceil(math.log2(n_low + 1)) + 5
    with progress.stages([f"candidate {i + 2}" for i in range(budget)], desc="auto-fp32") as stage:
        while not cr.passed and state["candidates"] < budget:
            if cr.beyond_inputs and not _pin_targets(cr, labels):
                # an input taken in the low type cannot hold its values (--no-keep-io-types): pinning
                # nodes FP32 would only end where nothing is low and the rewrite keeps the FP32 model
                state["stopped"] = (f"{cr.beyond_inputs[0]}; no pin helps: keep the inputs FP32 "
                                    f"(--keep-io-types)")
                break
            stage(f"candidate {state['candidates'] + 1}")
            new = _pin_targets(cr, labels)
            if new:
                for label, op, reason in new:
                    labels.append(label)
                    pinned.append({"node": label, "op": op, "reason": reason, "candidate": state["candidates"] + 1})
                res, cr = attempt(labels, f"pin overflowing {', '.join(lb for lb, _, _ in new[:3])}")
                continue
            res, cr = _bisect(res, cr, labels, pinned, attempt, budget, state)
            break
    result = AutoResult(res, cr, pinned, runner.evaluations, state["candidates"], budget, history, ref)
    if not cr.passed:
        why = state.get("stopped") or f"its budget of {budget} candidates ran out"
        cr.notes.append(f"--auto-fp32 stopped after {state['candidates']} candidates without passing: {why}")
    return result


def _pin_targets(cr: CheckResult, labels: Sequence[str]) -> list[tuple[str, str, str]]:
    """(label, op, reason) of the nodes to pin for the root overflows not already pinned."""
    out: list[tuple[str, str, str]] = []
    seen = set(labels)
    for o in cr.roots:
        why = f"overflow: {o.describe(cr.target)}"
        if o.in_body:
            continue  # (pinning an If/Loop/Scan changes nothing: the bisection finds the node in its body)
        if o.inserted or o.op == "Cast":
            targets = list(o.consumers)
        else:
            targets = [(o.node, o.op)]
        for label, op in targets:
            if label not in seen:
                seen.add(label)
                out.append((label, op, why))
    return out


def _bisect(res: RewriteResult, cr: CheckResult, labels: list[str], pinned: list[dict[str, Any]], attempt: Any,
            budget: int, state: dict[str, int]) -> tuple[RewriteResult, CheckResult]:
    """No overflow explains the failure: find a short run of low-precision nodes (in topological
    order) whose pinning passes: the shortest passing prefix, then the shortest suffix of it.
    Among the nodes other than MatMul/Gemm/Conv/attention first, where pinning all of those
    passes: an accuracy loss usually comes from what reads a GEMM (a sigmoid or exp near 1, a
    state carried low), and pinning the GEMM, first in graph order, gave up its speed for it."""
    nodes = [(lb, op) for lb, op in _low_nodes(res.model) if lb not in labels]
    if not nodes:
        state["stopped"] = "no low-precision node is left to pin"
        return res, cr
    w = cr.worst
    why = (f"accuracy: output {w.name!r} " + (f"relative error {_fmt(w.max_rel)} > {cr.tolerance:g}"
                                               if not w.new_nonfinite else "has NaN/Inf") if w else "accuracy")
    best: tuple[int, int] | None = None
    results: dict[tuple[int, int], tuple[RewriteResult, CheckResult]] = {}
    light = [(lb, op) for lb, op in nodes if op not in HEAVY_OPS]
    among = ""
    if light and len(light) < len(nodes) and state["candidates"] < budget:
        r = attempt(labels + [lb for lb, _ in light], "bisect: pin the low-precision nodes other than "
                                                      "MatMul/Gemm/Conv/attention")
        if r[1].passed:
            nodes, among = light, " other than MatMul/Gemm/Conv/attention"
            best = (0, len(nodes))
            results[best] = r

    def ok(lo: int, hi: int) -> bool:
        if state["candidates"] >= budget:
            raise _OutOfBudget
        r = attempt(labels + [lb for lb, _ in nodes[lo:hi]], f"bisect: pin low-precision nodes {lo}..{hi - 1}")
        results[(lo, hi)] = r
        return r[1].passed

    try:
        lo, hi = 0, len(nodes)  # prefix length: lo fails, hi assumed to pass (everything pinned)
        if not ok(0, hi):  # even pinning every one of them fails: keep the pins so far, report failure
            state["stopped"] = (f"even with all {len(nodes)} low-precision nodes pinned FP32 the check fails (the "
                                f"rest is FP32 already: the difference lies elsewhere, e.g. the casts at the inputs)")
            return res, cr
        best = (0, hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if ok(0, mid):
                hi = mid
                best = (0, hi)
            else:
                lo = mid
        start_ok, start_bad = 0, hi  # window start: 0 passes, hi (empty window) fails
        while start_bad - start_ok > 1:
            mid = (start_ok + start_bad) // 2
            if ok(mid, hi):
                start_ok = mid
                best = (mid, hi)
            else:
                start_bad = mid
    except _OutOfBudget:
        pass
    if best is None:
        return res, cr
    lo, hi = best
    chosen = nodes[lo:hi]
    for label, op in chosen:
        labels.append(label)
        pinned.append({"node": label, "op": op, "reason": f"{why}; bisection over {len(nodes)} low-precision nodes"
                       f"{among} chose {len(chosen)} (topological positions {lo}..{hi - 1})",
                       "candidate": state["candidates"]})
    return results[best]


class _OutOfBudget(Exception):
    pass


# ===================================================================================================
# CLI
# ===================================================================================================
def _cli_inputs(args: "CliArgs") -> tuple[dict[str, Any], list[dict[str, Any]]]:
    if args.inputs is not None:
        return load_inputs(args.inputs, args.model)
    return make_inputs(args.model)


def _say(args: "CliArgs", text: str) -> None:
    if not args.quiet:
        print(text)


def _fail(args: "CliArgs", report: "Report", outputs: Iterable[Path], message: str,
          exc_type: type[AmpRewriteError] = CheckFailedError) -> None:
    """Write the report (it records the failure), remove the rewritten model (a failed command
    leaves nothing in the output folder: docs/exit-codes.md) and raise."""
    outputs = list(outputs)
    if args.report:
        from .report import write_report

        if report.output is not None and any(str(p) == str(report.output) for p in outputs):
            report.output = None  # (removed below: the report names no file that is not there)
        for path in args.report:
            write_report(report, path, kept=False)  # (it records the failure: it stays)
    removed = _remove(outputs)
    raise exc_type(message + ("; the rewritten model was not kept" if removed else ""))


def _remove(paths: Iterable[Path]) -> bool:
    removed = False
    for path in paths:
        try:
            Path(path).unlink()
            removed = True
        except OSError:
            pass
    return removed


def check_cli(args: "CliArgs", result: RewriteResult, report: "Report") -> CheckResult:
    """``--check``: compare the written model with the input, print the table, store the result in
    ``report.extra["check"]``; CheckFailedError when it fails."""
    runner = Runner()
    outputs = [p for p in result.outputs if p.exists()]
    try:
        feeds, described = _cli_inputs(args)
        ref = reference(args.model, feeds, runner, described, user_inputs=args.inputs is not None)
    except AmpRewriteError:
        _remove(outputs)  # the command failed: leave nothing in the output folder
        raise
    low = result.outputs[-1] if result.outputs else result.model
    options = args.options()
    try:
        cr = check_models(args.model, low, tolerance=args.tolerance, runner=runner, ref=ref,
                          target=options.get("target"))
    except CheckRunError as exc:
        report.extra["check"] = {"passed": False, "tolerance": args.tolerance, "provider": runner.provider,
                                 "evaluations": runner.evaluations, "notes": [exc.message]}
        _fail(args, report, outputs, exc.message)
    report.extra["check"] = cr.to_dict()
    _say(args, cr.table())
    if not cr.passed:
        # (quoted for a shell: repr doubled a regex's backslashes, and left $ and ' to the shell)
        pin = (f"--fp32-nodes {shlex.quote(str(_exact(cr.roots[0].node)))}" if cr.roots and not cr.roots[0].inserted
               and not cr.roots[0].in_body else "")
        # (--auto-fp32 does not take --training graphs: only the pin applies there)
        suggestions = [s for s in ("--auto-fp32" if not args.training else "", pin) if s]
        if cr.beyond_inputs and not cr.roots:  # (no pin makes an input's ±inf finite)
            suggestions = ["--keep-io-types, so the inputs stay FP32"]
        hint = f"; try {' or '.join(suggestions)}" if suggestions and not args.auto_fp32 and not cr.reshaped else ""
        _fail(args, report, outputs, cr.failure_message() + hint)
    return cr


@dataclass
class CheckedRewriteResult(RewriteResult):
    """A RewriteResult whose report carries ``extra`` (the check and auto-fp32 sections)."""

    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def report(self) -> "Report":
        report = RewriteResult.report.fget(self)  # type: ignore[attr-defined]
        report.extra.update(self.extra)
        return report


def auto_fp32_cli(args: "CliArgs") -> RewriteResult:
    """``--auto-fp32``: find the pins, write the final rewrite, check the written model (printed
    and stored in the report with the pins)."""
    from .api import _check_output, default_output, rewrite_onnx

    options = args.options()
    target = options.get("target", "fp16")
    default = default_output(args.model, target)
    dst = args.output if args.output is not None else default
    _check_output(args.model, dst, args.overwrite, default.name)  # fail before running anything
    runner = Runner()
    _, described = _cli_inputs(args)  # (checked and described here; auto_fp32 reads the file itself)
    try:
        # (the file, or None: generated inputs are not "given", and a failure must not blame --inputs)
        auto = auto_fp32(args.model, inputs=args.inputs, tolerance=args.tolerance, runner=runner, **options)
    except CheckRunError as exc:  # a candidate onnxruntime cannot run: the report still records it
        if not args.report:
            raise
        from .api import rewrite_onnx_model

        report = rewrite_onnx_model(str(args.model), **options).report
        report.extra["check"] = {"passed": False, "tolerance": args.tolerance, "provider": runner.provider,
                                 "evaluations": runner.evaluations, "notes": [exc.message]}
        _fail(args, report, [], exc.message, type(exc))
    labels = [p["node"] for p in auto.pinned]
    final_options = dict(options, fp32_nodes=list(options.get("fp32_nodes", [])) + [_exact(lb) for lb in labels])
    from .commands import _staged_check, publish_stage

    with _staged_check(args) as stage:  # (written and checked beside dst, then moved into place)
        result = rewrite_onnx(args.model, stage / dst.name, overwrite=True, **final_options)
        try:
            cr = check_models(args.model, result.outputs[-1] if result.outputs else result.model,
                              tolerance=args.tolerance, runner=runner, ref=auto.ref, localise=False, target=target)
        except CheckRunError as exc:
            report = result.report
            report.extra["check"] = {"passed": False, "tolerance": args.tolerance, "provider": runner.provider,
                                     "evaluations": runner.evaluations, "notes": [exc.message]}
            _fail(args, report, [p for p in result.outputs if p.exists()], exc.message)
        cr.overflow, cr.overflow_total, cr.near_limit = auto.check.overflow, auto.check.overflow_total, auto.check.near_limit
        cr.passed = cr.passed and auto.check.passed
        cr.inputs = described
        cr.notes = auto.check.notes + ["overflow localisation: from the last candidate's run with its intermediates "
                                       "exposed (the same rewrite as the written model)"]
        info = auto.to_dict()
        info["evaluations"] = runner.evaluations
        info["passed"] = cr.passed
        checked = CheckedRewriteResult(result.model, result.log, result.modified, result.outputs, result.source,
                                       extra={"check": cr.to_dict(), "auto_fp32": info})
        _say(args, _auto_text(auto, info))
        _say(args, cr.table())
        if not cr.passed:
            _fail(args, checked.report, [p for p in result.outputs if p.exists()],
                  f"--auto-fp32 did not pass the check after {info['candidates']} candidates "
                  f"({info['evaluations']} model evaluations): " + cr.failure_message().removeprefix("check failed: "))
        result.outputs = checked.outputs = publish_stage(args, result.outputs)
    return checked


def _auto_text(auto: AutoResult, info: dict[str, Any]) -> str:
    lines = [f"auto-fp32: {len(auto.pinned)} node(s) pinned FP32 after {info['candidates']} candidate rewrites, "
             f"{info['evaluations']} model evaluations (budget {auto.budget} candidates)"]
    for p in auto.pinned[:20]:
        lines.append(f"  pinned {p['node']} ({p['op']}): {p['reason']}")
    if len(auto.pinned) > 20:
        lines.append(f"  ... {len(auto.pinned) - 20} more (see --report)")
    return "\n".join(lines)
