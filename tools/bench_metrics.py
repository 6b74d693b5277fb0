"""What the benchmark measures on a converted model, the same way for every converter.

Static (from the file, external data never loaded): the full checker, Cast nodes (every scope),
share of float weights stored in 16 bits.

At run time (onnxruntime CPU in a child process, ``tools/ortrun.py``), on a copy of the model whose
outputs also expose the inputs of every main-graph Cast and MatMul/Gemm/Conv/ConvTranspose and
the outputs of the heavy ops (so their shapes and types are the real ones at these feeds, not
guesses):

- loads / runs, max relative error of the logits against FP32 (max |a-b| / max |a|), new NaN/Inf;
- cast bytes per run: Σ over main-graph Casts, and the Casts of the branch of each main-graph If
  that ran, of elements × (bytes read + bytes written); Casts inside Loop/Scan bodies are counted
  but their bytes are not (their trip count is unknown);
- the FP16 share of MatMul/Gemm/Conv FLOPs: 2·M·K·N per (batched) GEMM, 2·|Y|·(C/g)·∏k per
  convolution, weighted by whether the op's first input is 16-bit at run time.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto

HEAVY = ("MatMul", "Gemm", "Conv", "ConvTranspose")
LOW_TYPES = {TensorProto.FLOAT16, TensorProto.BFLOAT16}
FLOAT_TYPES = {TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.DOUBLE}
_ITEMSIZE = {TensorProto.FLOAT: 4, TensorProto.FLOAT16: 2, TensorProto.BFLOAT16: 2, TensorProto.DOUBLE: 8,
             TensorProto.INT64: 8, TensorProto.INT32: 4, TensorProto.INT8: 1, TensorProto.UINT8: 1,
             TensorProto.BOOL: 1, TensorProto.INT16: 2, TensorProto.UINT16: 2}


def _graphs(graph: onnx.GraphProto):
    yield graph
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from _graphs(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for g in attr.graphs:
                    yield from _graphs(g)


def static_metrics(path: str | os.PathLike) -> dict:
    """Checker, Cast count and 16-bit weight share, reading the file without its external data."""
    path = str(path)
    out: dict = {}
    try:
        onnx.checker.check_model(path, full_check=True)
        out["checker"] = True
        out["checker_error"] = None
    except Exception as exc:  # noqa: BLE001 - a checker failure is a measurement
        out["checker"] = False
        out["checker_error"] = _first_line(exc)
    model = onnx.load(path, load_external_data=False)
    casts = sub_casts = 0
    low = total = 0
    for i, g in enumerate(_graphs(model.graph)):
        n = sum(1 for node in g.node if node.op_type == "Cast" and node.domain in ("", "ai.onnx"))
        casts += n
        if i:
            sub_casts += n
        for t in g.initializer:
            if t.data_type in FLOAT_TYPES:
                numel = int(np.prod(t.dims)) if len(t.dims) else 1
                total += numel
                low += numel if t.data_type in LOW_TYPES else 0
        for node in g.node:
            if node.op_type == "Constant":
                for attr in node.attribute:
                    if attr.name == "value" and attr.t.data_type in FLOAT_TYPES:
                        numel = int(np.prod(attr.t.dims)) if len(attr.t.dims) else 1
                        total += numel
                        low += numel if attr.t.data_type in LOW_TYPES else 0
    out.update({"casts": casts, "casts_in_subgraphs": sub_casts,
                "weights_low_share": (low / total) if total else None, "float_weights": total})
    return out


def logits_of(model: onnx.ModelProto, names: list[str]) -> list[str]:
    """What the comparison reads, as tests/test_e2e_corpus.py does: for an output made by a
    Softmax/LogSoftmax, its input (the logits), else the output itself."""
    producers = {o: n for n in model.graph.node for o in n.output}
    return [producers[n].input[0] if n in producers and producers[n].op_type in ("Softmax", "LogSoftmax") else n
            for n in names]


def with_outputs(model: onnx.ModelProto, names: list[str]) -> onnx.ModelProto:
    """A copy that also outputs ``names`` (untyped: onnxruntime takes the inferred type)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    present = {o.name for o in out.graph.output} | {i.name for i in out.graph.input}
    for name in names:
        if name not in present:
            vi = onnx.ValueInfoProto()
            vi.name = name
            out.graph.output.append(vi)
            present.add(name)
    return out


def instrumented_copy(path: str | os.PathLike, dst: str | os.PathLike,
                      also: list[str] = ()) -> tuple[list[str], dict]:
    """Write ``dst`` (next to ``path``, so external data still resolves): the model with extra
    outputs for the values the run-time metrics need (and ``also``). Returns (extra names, plan)."""
    model = onnx.load(str(path), load_external_data=False)
    g = model.graph
    existing = {o.name for o in g.output} | {i.name for i in g.input} | {t.name for t in g.initializer}
    wanted: list[str] = list(also)
    casts, heavy = [], []
    for node in g.node:
        if node.domain not in ("", "ai.onnx"):
            continue
        if node.op_type == "Cast" and node.input and node.input[0]:
            to = next((a.i for a in node.attribute if a.name == "to"), None)
            casts.append((node.input[0], to))
            wanted.append(node.input[0])
        elif node.op_type in HEAVY and len(node.input) >= 2:
            heavy.append((node.op_type, list(node.input[:2]), node.output[0], _attrs(node)))
            wanted.extend([node.input[0], node.input[1], node.output[0]])
    branch_casts = _expose_branch_casts(model)
    casts.extend(branch_casts)
    wanted.extend(name for name, _ in branch_casts)
    extra = []
    seen = set(existing)
    for name in wanted:
        if name and name not in seen:
            seen.add(name)
            extra.append(name)
            vi = onnx.ValueInfoProto()
            vi.name = name  # untyped: onnxruntime takes the inferred type
            g.output.append(vi)
    with open(dst, "wb") as f:
        f.write(model.SerializeToString())
    inits = {t.name: (list(t.dims), t.data_type) for t in g.initializer}
    consts = {}
    for node in g.node:
        if node.op_type == "Constant":
            for attr in node.attribute:
                if attr.name == "value":
                    consts[node.output[0]] = (list(attr.t.dims), attr.t.data_type)
    return extra, {"casts": casts, "heavy": heavy, "inits": inits, "consts": consts, "branch_casts": len(branch_casts)}


def _expose_branch_casts(model: onnx.ModelProto) -> list[tuple[str, int | None]]:
    """Make the input of every Cast in a main-graph If's branches visible at run time: the branch
    outputs it through an Identity, the other branch an empty tensor of its type, and the If an
    extra output. Its run-time shape is the Cast's input in the branch that ran and (0,) in the
    other, so each run counts the casts it executed. Returns (If output name, to) per Cast whose
    input type shape inference knows; Loop and Scan bodies stay uncounted (see the docstring)."""
    from onnx import helper

    g = model.graph
    ifs = [n for n in g.node if n.op_type == "If" and n.domain in ("", "ai.onnx")]
    if not ifs:
        return []
    types: dict[str, int] = {}
    for sub in _graphs(onnx.shape_inference.infer_shapes(model).graph):
        for v in list(sub.input) + list(sub.output) + list(sub.value_info):
            if v.type.HasField("tensor_type") and v.type.tensor_type.elem_type:
                types[v.name] = v.type.tensor_type.elem_type
        for t in sub.initializer:
            types[t.name] = t.data_type
    exposed: list[tuple[str, int | None]] = []
    for node in ifs:
        branches = {a.name: a.g for a in node.attribute if a.type == onnx.AttributeProto.GRAPH}
        if set(branches) != {"then_branch", "else_branch"}:
            continue
        for key, branch in list(branches.items()):
            other = branches["else_branch" if key == "then_branch" else "then_branch"]
            for cast in [n for n in branch.node if n.op_type == "Cast" and n.input and n.input[0]]:
                elem = types.get(cast.input[0])
                if not elem:
                    continue
                name = f"amp_bench/branch_cast_{len(exposed)}"
                branch.node.append(helper.make_node("Identity", [cast.input[0]], [f"{name}/in"]))
                branch.output.append(helper.make_tensor_value_info(f"{name}/in", elem, None))
                empty = helper.make_tensor(f"{name}/none", elem, [0], [])
                other.node.append(helper.make_node("Constant", [], [f"{name}/none"], value=empty))
                other.output.append(helper.make_tensor_value_info(f"{name}/none", elem, None))
                node.output.append(name)
                exposed.append((name, next((a.i for a in cast.attribute if a.name == "to"), None)))
    return exposed


def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute if a.name in ("group", "transA", "transB")}


def runtime_metrics(path: str | os.PathLike, feeds: dict, ref: dict, logits: list[str], *, timeout: float = 600) -> dict:
    """Run the converted model (instrumented) and measure it against the FP32 reference outputs
    (``ref`` holds the reference's outputs and the ``logits`` values, see :func:`logits_of`)."""
    from tools.ortrun import OrtRunError, load_ok, run_onnx

    path = Path(path)
    inst = path.with_name(path.stem + ".instrumented.onnx")
    out: dict = {"loads": False, "runs": False, "error": None}
    try:
        extra, plan = instrumented_copy(path, inst, also=list(logits))
        try:
            got = run_onnx(inst, feeds, timeout=timeout)
        except OrtRunError as exc:
            ok, reason = load_ok(path, timeout=timeout)
            out["loads"] = ok
            out["error"] = _first_line(reason if not ok else exc)
            return out
    finally:
        inst.unlink(missing_ok=True)
    out["loads"] = out["runs"] = True
    out.update(_errors(ref, got, logits))
    out["max_rel_err_cpu"], out["new_nonfinite_cpu"] = out["max_rel_err"], out["new_nonfinite"]
    out.update(_emulated_errors(path, feeds, ref, logits, timeout))
    shapes = {k: (list(v.shape), v.dtype) for k, v in got.items()}
    shapes.update({k: (list(np.asarray(v).shape), np.asarray(v).dtype) for k, v in feeds.items()})
    out.update(_cast_bytes(plan, shapes))
    out["casts_in_branches_measured"] = plan["branch_casts"]
    out.update(_flop_share(plan, shapes))
    return out


def _emulated_errors(path: Path, feeds: dict, ref: dict, logits: list[str], timeout: float) -> dict:
    """The errors of the model's GPU numerics: onnxruntime's CPU provider runs FP16 nodes that lack
    FP16 kernels in FP32 and drops the casts between them, so the plain run above rounds little.
    The model runs again as ``amp_rewrite.emulate.emulate_low`` makes it (every FP16 value rounded
    where it is made, FP32 in between, as GPU kernels compute); its errors replace the plain run's,
    which stay as ``*_cpu``. Where the emulation cannot run, the plain figures stand and
    ``emulated`` is False."""
    from amp_rewrite.emulate import emulate_low
    from tools.ortrun import run_onnx

    try:
        model = onnx.load(str(path))
        emulated, rounded = emulate_low(with_outputs(model, logits), onnx.TensorProto.FLOAT16)
        if not rounded:
            return {"emulated": False, "emulation_error": "no FP16 value"}
        got = run_onnx(emulated, feeds, timeout=timeout)
    except Exception as exc:  # noqa: BLE001 - a measurement: the plain run's figures stand
        return {"emulated": False, "emulation_error": _first_line(exc)}
    errors = _errors(ref, got, logits)
    return {"emulated": True, "max_rel_err": errors["max_rel_err"], "new_nonfinite": errors["new_nonfinite"]}


def _errors(ref: dict, got: dict, logits: list[str]) -> dict:
    errs = []
    new_nonfinite = []
    ref_nonfinite = []
    for key, value in ref.items():
        value = np.asarray(value)
        if key not in got:
            continue
        g = np.asarray(got[key])
        if np.issubdtype(value.dtype, np.floating):
            bad_ref = ~np.isfinite(value)
            if bad_ref.any():
                ref_nonfinite.append(key)
            if np.issubdtype(g.dtype, np.floating) and (~np.isfinite(g) & ~bad_ref).any():
                new_nonfinite.append(key)
    for key in logits:
        if key in got and key in ref:
            errs.append(rel_err(ref[key], got[key]))
    return {"max_rel_err": max(errs) if errs else None, "new_nonfinite": new_nonfinite,
            "ref_nonfinite": ref_nonfinite}


def rel_err(ref, got) -> float:
    ref = np.asarray(ref, np.float64)
    got = np.asarray(got, np.float64)
    if ref.size == 0:
        return 0.0
    scale = max(float(np.abs(ref).max()), 1e-6)
    return float(np.abs(ref - got).max() / scale)


def _np_itemsize(dtype) -> int:
    return int(np.dtype(dtype).itemsize) if dtype is not None else 4


def _shape_dtype(name: str, plan: dict, shapes: dict):
    """(shape, itemsize, is_low) of a value at run time, from the run, the feeds or the initializers."""
    if name in shapes:
        shape, dtype = shapes[name]
        low = str(dtype) in ("float16", "bfloat16")
        return shape, _np_itemsize(dtype), low
    for table in (plan["inits"], plan["consts"]):
        if name in table:
            dims, dt = table[name]
            return dims, _ITEMSIZE.get(dt, 4), dt in LOW_TYPES
    return None, None, None


def _cast_bytes(plan: dict, shapes: dict) -> dict:
    total = 0
    unknown = 0
    for name, to in plan["casts"]:
        shape, src_size, _ = _shape_dtype(name, plan, shapes)
        if shape is None:
            unknown += 1
            continue
        numel = int(np.prod(shape)) if shape else 1
        total += numel * (src_size + _ITEMSIZE.get(to, 4))
    return {"cast_bytes": total, "casts_unmeasured": unknown}


def _flop_share(plan: dict, shapes: dict) -> dict:
    low = total = 0.0
    heavy_low = heavy_n = 0
    for op, (a, b), y, attrs in plan["heavy"]:
        a_shape, _, a_low = _shape_dtype(a, plan, shapes)
        b_shape, _, _ = _shape_dtype(b, plan, shapes)
        y_shape, _, _ = _shape_dtype(y, plan, shapes)
        if a_shape is None or b_shape is None or y_shape is None:
            continue
        flops = _flops(op, a_shape, b_shape, y_shape, attrs)
        total += flops
        heavy_n += 1
        if a_low:
            low += flops
            heavy_low += 1
    return {"flops": total, "flops_low_share": (low / total) if total else None,
            "heavy_ops": heavy_n, "heavy_ops_low": heavy_low}


def _flops(op: str, a: list, b: list, y: list, attrs: dict) -> float:
    ny = float(np.prod(y)) if y else 1.0
    if op == "MatMul":
        k = a[-1] if a else 1
        return 2.0 * ny * k
    if op == "Gemm":
        k = a[0] if attrs.get("transA") else a[-1]
        return 2.0 * ny * k
    if op == "Conv":
        return 2.0 * ny * float(np.prod(b[1:]))  # W: [C_out, C_in/g, k...]
    if op == "ConvTranspose":
        na = float(np.prod(a)) if a else 1.0
        return 2.0 * na * float(np.prod(b[1:]))  # W: [C_in, C_out/g, k...]
    return 0.0


def _first_line(exc) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__
