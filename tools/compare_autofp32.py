"""Compare ``amp-rewrite --auto-fp32`` with onnxconverter-common's ``auto_convert_mixed_precision``
on the same models and inputs: how many model evaluations each needs, how many nodes each keeps
FP32, and whether the result passes amp-rewrite's full check (outputs *and* intermediate
overflow).

An evaluation is one ``onnxruntime.InferenceSession.run`` call: both tools run onnxruntime
in-process, so the method is wrapped with a counter around each tool's call.

Both tools get the same inputs (``amp_rewrite.check.make_inputs``, or the corpus model's feeds)
and the same acceptance test on the outputs: every output within ``--tolerance`` (max |a-b| /
max |a|) with no new NaN/Inf (onnxconverter-common's ``validate_fn``). onnxconverter-common cannot
see intermediate values, so only amp-rewrite also fails candidates for hidden overflow.

    python tools/compare_autofp32.py                      # the built-in models
    python tools/compare_autofp32.py --corpus synthetic/transformer-block-op17 hf/llama-torchscript-op17
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import onnx

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from amp_rewrite import check as ck  # noqa: E402


# -- models -----------------------------------------------------------------------------------------------
def _parse(text: str, inits: dict[str, np.ndarray]) -> onnx.ModelProto:
    model = onnx.parser.parse_model(text)
    model.ir_version = 8
    for name, arr in inits.items():
        model.graph.initializer.append(onnx.numpy_helper.from_array(arr.astype(np.float32), name))
    onnx.checker.check_model(model, full_check=True)
    return model


def overflow_model() -> onnx.ModelProto:
    """FP16 logits overflow to -inf behind a softmax; the output looks fine (pitfall 11)."""
    w = np.random.default_rng(1).standard_normal((16, 8)) * 0.1
    w[:, :3] = -1e4
    return _parse("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N,16] x) => (float[N,8] y) {
          sq = Mul(x, x)
          logits = MatMul(sq, w)
          y = Softmax(logits)
        }""", {"w": w})


def cancel_model(depth: int) -> onnx.ModelProto:
    """``depth`` benign MatMul+Relu layers, then y = h@w1 - h@w2 with w1 ≈ w2 (catastrophic
    cancellation): an accuracy failure with no overflow, fixed by keeping the last two MatMuls FP32."""
    rng = np.random.default_rng(2)
    inits: dict[str, np.ndarray] = {}
    body, prev = [], "x"
    for i in range(depth):
        inits[f"a{i}"] = rng.standard_normal((16, 16)) / 4
        body += [f"m{i} = MatMul({prev}, a{i})", f"r{i} = Relu(m{i})"]
        prev = f"r{i}"
    w1 = rng.standard_normal((16, 8)) * 0.1 + 60
    inits["w1"], inits["w2"] = w1, w1 + rng.standard_normal((16, 8)) * 0.02
    body += [f"p = MatMul({prev}, w1)", f"q = MatMul({prev}, w2)", "y = Sub(p, q)"]
    return _parse('<ir_version: 8, opset_import: ["" : 17]>\ng (float[N,16] x) => (float[N,8] y) {\n'
                  + "\n".join(body) + "\n}", inits)


BUILTIN: dict[str, Callable[[], onnx.ModelProto]] = {
    "overflow-behind-softmax": overflow_model,
    "cancellation-depth3": lambda: cancel_model(3),
    "cancellation-depth30": lambda: cancel_model(30),
}


def _name_nodes(model: onnx.ModelProto) -> onnx.ModelProto:
    """onnxconverter-common blocks nodes by name: give unnamed nodes one (both tools get this copy)."""
    seen: set[str] = set()
    for i, n in enumerate(model.graph.node):
        if not n.name or n.name in seen:
            n.name = f"{n.op_type}_{i}"
        seen.add(n.name)
    return model


# -- counting ---------------------------------------------------------------------------------------------
@contextlib.contextmanager
def counting() -> Any:
    import onnxruntime as ort

    counter = {"runs": 0}
    original = ort.InferenceSession.run

    def run(self, *args, **kwargs):
        counter["runs"] += 1
        return original(self, *args, **kwargs)

    ort.InferenceSession.run = run
    try:
        yield counter
    finally:
        ort.InferenceSession.run = original


# -- the two tools ----------------------------------------------------------------------------------------
def run_ours(model: onnx.ModelProto, feeds: dict[str, np.ndarray], tolerance: float) -> dict[str, Any]:
    t = time.perf_counter()
    with counting() as counter:
        auto = ck.auto_fp32(model, inputs=feeds, tolerance=tolerance)
    return {"tool": "amp-rewrite --auto-fp32", "evaluations": counter["runs"], "candidates": auto.candidates,
            "fp32_nodes": len(auto.pinned), "pinned": [p["node"] for p in auto.pinned], "model": auto.result.model,
            "seconds": time.perf_counter() - t, "error": None if auto.check.passed else "did not pass"}


def run_theirs(model: onnx.ModelProto, feeds: dict[str, np.ndarray], tolerance: float) -> dict[str, Any]:
    from onnxconverter_common import auto_mixed_precision as amp

    def validate(ref: list, got: list) -> bool:
        return all(ck.compare_output(str(i), a, b, tolerance).passed for i, (a, b) in enumerate(zip(ref, got)))

    blocked: list[list[str]] = []
    convert = amp.float16.convert_float_to_float16

    def recording_convert(*args, **kwargs):
        blocked.append(list(kwargs.get("node_block_list") or []))
        return convert(*args, **kwargs)

    t = time.perf_counter()
    out: Any = None
    error = None
    amp.float16.convert_float_to_float16 = recording_convert
    try:
        with counting() as counter, contextlib.redirect_stdout(io.StringIO()), _quiet_warnings():
            try:
                out = amp.auto_convert_mixed_precision(model, feeds, validate_fn=validate, keep_io_types=True)
            except Exception as exc:  # noqa: BLE001 (report whatever the other tool raised)
                error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:70]
    finally:
        amp.float16.convert_float_to_float16 = convert
    attempts = max(len(blocked) - 1, 0)  # the last call rebuilds the final model
    final = blocked[-1] if blocked else []
    return {"tool": "onnxconverter-common auto_convert_mixed_precision", "evaluations": counter["runs"],
            "candidates": attempts, "fp32_nodes": len(final), "pinned": final, "model": out,
            "seconds": time.perf_counter() - t, "error": error}


@contextlib.contextmanager
def _quiet_warnings() -> Any:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def full_check(fp32: onnx.ModelProto, low: Any, feeds: dict[str, np.ndarray], tolerance: float) -> str:
    """amp-rewrite's check (outputs + intermediate overflow) of a tool's final model."""
    if low is None:
        return "-"
    try:
        result = ck.check_models(fp32, low, inputs=feeds, tolerance=tolerance)
    except Exception as exc:  # noqa: BLE001
        return f"error ({type(exc).__name__})"
    if result.passed:
        return "pass"
    if result.roots and all(o.passed for o in result.outputs):
        return f"FAIL: hidden overflow at {result.roots[0].node}"
    return "FAIL: " + result.failure_message().removeprefix("check failed: ")[:60]


# -- main -------------------------------------------------------------------------------------------------
def compare(name: str, model: onnx.ModelProto, feeds: dict[str, np.ndarray] | None, tolerance: float) -> list[dict]:
    model = _name_nodes(model)
    if feeds is None:
        feeds, _ = ck.make_inputs(model)
    rows = []
    for runner in (run_ours, run_theirs):
        r = runner(model, feeds, tolerance)
        r["check"] = full_check(model, r.pop("model"), feeds, tolerance)
        rows.append({"model": name, "nodes": len(model.graph.node), **r})
    return rows


def table(rows: list[dict]) -> str:
    head = ["model", "nodes", "tool", "evaluations", "candidates", "FP32 nodes", "amp-rewrite check", "seconds"]
    body = [[r["model"], r["nodes"], "amp-rewrite" if r["tool"].startswith("amp") else "onnxconverter-common",
             r["evaluations"], r["candidates"], r["fp32_nodes"],
             r["check"] if not r["error"] else f"{r['check']} ({r['error']})", f"{r['seconds']:.1f}"] for r in rows]
    widths = [max(len(str(x[i])) for x in [head] + body) for i in range(len(head))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(head, widths)).rstrip(),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(x, widths)).rstrip() for x in body]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", nargs="*", default=[], help="tools/corpus.py model names to add")
    parser.add_argument("--only-corpus", action="store_true", help="skip the built-in models")
    parser.add_argument("--tolerance", type=float, default=1e-2)
    parser.add_argument("--json", type=Path, help="also write the rows as JSON")
    args = parser.parse_args(argv)
    rows: list[dict] = []
    if not args.only_corpus:
        for name, build in BUILTIN.items():
            rows += compare(name, build(), None, args.tolerance)
    for name in args.corpus:
        from tools.corpus import build as build_corpus

        cm = build_corpus(name)
        rows += compare(name, cm.model, cm.feeds, args.tolerance)
    print(table(rows))
    print("\nevaluations: onnxruntime InferenceSession.run calls (FP32 reference runs included); candidates: "
          "mixed-precision models tried; amp-rewrite check: outputs and intermediate FP16 overflow")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
