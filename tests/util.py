"""Test helpers: build ONNX models from text, rewrite them, inspect and run the result."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from amp_rewrite.api import rewrite_onnx_model  # noqa: E402


def make_model(text: str, inits: dict | None = None, *, seed: int = 0, ir_version: int = 8) -> onnx.ModelProto:
    """ONNX text plus initializers: a shape tuple gets seeded N(0, 1/fan_in) values, an array is used as is."""
    model = onnx.parser.parse_model(text)
    model.ir_version = ir_version
    rng = np.random.default_rng(seed)
    for name, spec in (inits or {}).items():
        if isinstance(spec, tuple):
            fan_in = spec[0] if spec else 1
            arr = rng.standard_normal(spec) / np.sqrt(max(fan_in, 1))
        else:
            arr = np.asarray(spec)
        if arr.dtype == np.float64:
            arr = arr.astype(np.float32)
        model.graph.initializer.append(numpy_helper.from_array(arr, name))
    onnx.checker.check_model(model, full_check=True)
    return model


def rewrite(model: onnx.ModelProto, **options):
    return rewrite_onnx_model(model, **options)


def nodes_by_type(model: onnx.ModelProto, op_type: str) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.op_type == op_type]


def value_types(model: onnx.ModelProto) -> dict[str, int]:
    """Element type of every named value (after shape inference), initializers included."""
    inferred = onnx.shape_inference.infer_shapes(model)
    g = inferred.graph
    types = {v.name: v.type.tensor_type.elem_type for v in list(g.input) + list(g.output) + list(g.value_info)}
    types.update({t.name: t.data_type for t in g.initializer})
    return types


def node_output_type(model: onnx.ModelProto, node_name_or_output: str) -> int:
    types = value_types(model)
    for n in model.graph.node:
        if n.name == node_name_or_output or node_name_or_output in n.output:
            return types[n.output[0]]
    raise KeyError(node_name_or_output)


def full_check(model: onnx.ModelProto) -> None:
    onnx.checker.check_model(model, full_check=True)


def run(model: onnx.ModelProto, feeds: dict) -> dict:
    """Run in onnxruntime (CPU) in a subprocess: a crash fails one test, not the run."""
    from tools.ortrun import OPT_LEVEL_ENV, run_onnx

    # The target is the CUDA provider; on CPU we check loading and numerics. onnxruntime's
    # CPU-only layout optimizers (level ALL) crash on some valid FP16 graphs (an FP16 LSTM LM
    # did), so numerics run at level EXTENDED; test_e2e_corpus records which models need it.
    os.environ.setdefault(OPT_LEVEL_ENV, "extended")
    return run_onnx(model, feeds)


def rel_err(ref: np.ndarray, got: np.ndarray) -> float:
    ref = np.asarray(ref, np.float64)
    got = np.asarray(got, np.float64)
    scale = max(float(np.abs(ref).max()), 1e-6)
    return float(np.abs(ref - got).max() / scale)


FP32, FP16, BF16 = onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16


def run_cli(argv: list[str], cwd: Path, env: dict | None = None, preexec=None):
    """``python -m amp_rewrite *argv`` in ``cwd`` (this checkout's package; no progress bars)."""
    import subprocess

    env = {**os.environ, **(env or {})}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["AMP_REWRITE_NO_PROGRESS"] = "1"
    return subprocess.run([sys.executable, "-m", "amp_rewrite", *argv], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300, preexec_fn=preexec)
