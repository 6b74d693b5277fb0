"""onnx's own operator test cases, rewritten and run on onnxruntime's CUDA provider: which op does a
rewrite push off the GPU, make fail there, or compute wrong there?

    python -m tools.gpu_sweep prepare DIR [--target fp16|bf16] [--ops Op ...]   # any machine
    python -m tools.gpu_sweep run DIR [--json PATH]                             # needs a GPU

``prepare`` takes every node test case of ``onnx.backend.test.case.node`` (the op's model and its first
data set), keeps those whose expected outputs onnxruntime's CPU provider reproduces, wraps each float
input and output in a MatMul by the identity (so the rules paint the op low, as inside a network),
and rewrites that with amp-rewrite's default options for the target. Cases over 300 kB are left out.
It writes ``DIR/cases-<target>.pkl.xz``. ``run`` creates a CUDA session (CPU as fallback) for each case's
FP32 and rewritten model, in child processes of 100 cases (a crash is recorded and the next child
starts after the case), with onnxruntime's profiler on to say which provider ran each node.

Printed: the cases whose rewrite runs an op on the CPU that the FP32 model runs on the GPU, fails
where the FP32 model runs, or adds NaN/Inf; and the largest errors against FP32 on the same GPU
(inputs like [10000, 10001] lose their difference in a low type: read them before blaming a rule).
This sweep found the checks of ``amp_rewrite/passes/classify.py``'s ``_runtime_gap`` and the
BatchNormalization groups in ``amp_rewrite/frontends/onnx_loader.py``.
"""

from __future__ import annotations

import argparse
import json
import lzma
import os
import pickle
import subprocess
import sys
import tempfile
import time
import warnings
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

PROVIDER = "CUDAExecutionProvider"
MAX_OPSET = 26  # the newest default-domain opset onnxruntime 1.31 loads; onnx's own tests are written at onnx's newest
MAX_BYTES = 300_000
CHUNK = 100


# -- prepare ---------------------------------------------------------------------------------------------
def _sandwich(model, inputs: list, outputs: list):
    """``model`` with each finite float input and output of rank >= 1 passed through MatMul(., I)."""
    import numpy as np
    import onnx
    from onnx import helper, numpy_helper

    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    inits = {i.name for i in graph.initializer}
    real = [i for i in graph.input if i.name not in inits]
    pre, post, renamed = [], [], {}

    def wrappable(x) -> bool:
        return isinstance(x, np.ndarray) and x.dtype == np.float32 and x.ndim and x.shape[-1] \
            and bool(np.isfinite(x).all())

    for vi, x in zip(real, inputs):
        if wrappable(x):
            graph.initializer.append(numpy_helper.from_array(np.eye(x.shape[-1], dtype=np.float32), vi.name + "__I"))
            pre.append(helper.make_node("MatMul", [vi.name, vi.name + "__I"], [vi.name + "__sw"]))
            renamed[vi.name] = vi.name + "__sw"
    if not renamed or any(o.name in renamed for o in graph.output):
        return None

    def rename(g) -> None:
        for node in g.node:
            node.input[:] = [renamed.get(v, v) for v in node.input]
            for a in node.attribute:
                for sub in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
                    rename(sub)
    rename(graph)
    for vo, y in zip(list(graph.output), outputs):
        if not wrappable(y):
            continue
        inner = vo.name + "__inner"
        for node in graph.node:
            node.output[:] = [inner if v == vo.name else v for v in node.output]
            node.input[:] = [inner if v == vo.name else v for v in node.input]
        graph.initializer.append(numpy_helper.from_array(np.eye(y.shape[-1], dtype=np.float32), vo.name + "__O"))
        post.append(helper.make_node("MatMul", [inner, vo.name + "__O"], [vo.name]))
    nodes = pre + list(graph.node) + post
    del graph.node[:]
    graph.node.extend(nodes)
    del graph.value_info[:]
    if not any(o.domain in ("", "ai.onnx") for o in out.opset_import):  # (an ai.onnx.ml-only test model)
        out.opset_import.append(helper.make_opsetid("", MAX_OPSET))
    return out


def _lower_opset(model) -> bool:
    """Lower a test model's default-domain opset to ``MAX_OPSET`` where every node's schema is the
    same at both (the usual case: a new opset changes a few ops); False where one is not."""
    from onnx import defs

    for opset in model.opset_import:
        if opset.domain in ("", "ai.onnx") and opset.version > MAX_OPSET:
            for node in model.graph.node:
                if node.domain in ("", "ai.onnx"):
                    try:
                        same = (defs.get_schema(node.op_type, opset.version).since_version
                                == defs.get_schema(node.op_type, MAX_OPSET).since_version)
                    except defs.SchemaError:
                        return False
                    if not same:
                        return False
            opset.version = MAX_OPSET
    return True


def _matches(got: list, expected: list) -> bool:
    import numpy as np

    if len(got) < len(expected):
        return False
    for g, e in zip(got, expected):
        g, e = np.asarray(g), np.asarray(e)
        if g.shape != e.shape:
            return False
        if e.dtype.kind == "f":
            if not np.allclose(g.astype(np.float64), e.astype(np.float64), rtol=1e-3, atol=1e-5, equal_nan=True):
                return False
        elif e.dtype.kind in "biu" and not np.array_equal(g, e):
            return False
    return True


def _cpu_run(model_bytes: bytes, inputs: list) -> list:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 4
    sess = ort.InferenceSession(model_bytes, opts, providers=["CPUExecutionProvider"])
    return sess.run(None, {i.name: x for i, x in zip(sess.get_inputs(), inputs) if x is not None})


def prepare(folder: Path, target: str, ops: list[str] | None, log) -> Path:
    import numpy as np
    import onnx
    from onnx.backend.test.case.node import collect_testcases

    import amp_rewrite

    warnings.filterwarnings("ignore")
    cases, skipped = [], Counter()
    for tc in collect_testcases(None):
        if tc.model is None or not tc.data_sets:
            continue
        model = tc.model
        op_types = sorted({n.op_type for n in model.graph.node if n.domain in ("", "ai.onnx")})
        if ops and not set(ops) & set(op_types):
            continue
        if model.ir_version > 10:  # (the tests' models say the newest IR; onnxruntime 1.31 reads 10)
            model.ir_version = 10
        if not _lower_opset(model):
            skipped[f"an op changed after opset {MAX_OPSET}"] += 1
            continue
        inputs, expected = tc.data_sets[0]
        inputs = [np.asarray(x) if not isinstance(x, list) and x is not None else x for x in inputs]
        try:
            fp32 = model.SerializeToString()
            if not _matches(_cpu_run(fp32, inputs), list(expected)):
                skipped["onnxruntime's CPU provider does not reproduce the expected outputs"] += 1
                continue
            wrapped = _sandwich(model, inputs, list(expected))
            if wrapped is None:
                skipped["no float input or output to wrap"] += 1
                continue
            blob = wrapped.SerializeToString()
            if len(blob) + sum(getattr(x, "nbytes", 0) for x in inputs) > MAX_BYTES:
                skipped["over 300 kB"] += 1
                continue
            _cpu_run(blob, inputs)
        except Exception as exc:  # noqa: BLE001 - a case the runtime cannot take is not ours to judge
            skipped[f"onnxruntime: {type(exc).__name__}"] += 1
            continue
        case = {"name": tc.name, "ops": op_types, "fp32": blob, "inputs": inputs}
        try:
            case["low"] = amp_rewrite.rewrite(onnx.load_from_string(blob), target=target).SerializeToString()
        except Exception as exc:  # noqa: BLE001 - reported by run
            case["rewrite_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        cases.append(case)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"cases-{target}.pkl.xz"
    with lzma.open(path, "wb") as f:
        pickle.dump({"target": target, "cases": cases}, f)
    log(f"[prepare] {len(cases)} cases for {target} in {path}; left out: {dict(skipped)}")
    return path


# -- run ---------------------------------------------------------------------------------------------------
def _session_record(model_bytes: bytes, inputs: list, workdir: str, tag: str) -> tuple[dict, list | None]:
    from tools.gpu_check import _placement, profiled_session

    rec: dict = {}
    try:
        sess = profiled_session(model_bytes, os.path.join(workdir, tag), PROVIDER)
        outs = sess.run(None, {i.name: x for i, x in zip(sess.get_inputs(), inputs) if x is not None})
        rec["cpu"] = dict(_placement(sess.end_profiling()).get("CPUExecutionProvider", {}))
        return rec, outs
    except Exception as exc:  # noqa: BLE001 - the result
        rec["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
        return rec, None


def _compare(ref: list, got: list) -> tuple[float, bool]:
    import numpy as np

    worst, new_nonfinite = 0.0, False
    for a, b in zip(ref, got):
        a, b = np.asarray(a), np.asarray(b)
        if a.dtype.kind != "f" or b.dtype.kind != "f" or a.shape != b.shape or not a.size:
            continue
        a, b = a.astype(np.float64), b.astype(np.float64)
        fa, fb = np.isfinite(a), np.isfinite(b)
        new_nonfinite |= bool((fa & ~fb).any())
        both = fa & fb
        if both.any():
            worst = max(worst, float(np.abs(a[both] - b[both]).max() / max(float(np.abs(a[both]).max()), 1e-6)))
    return worst, new_nonfinite


def run_chunk(path: Path, lo: int, hi: int, out: Path) -> None:
    """Cases ``lo``..``hi`` of ``path``, one JSON line each (a {"start": i} line first, so a crash
    names its case)."""
    with lzma.open(path, "rb") as f:
        cases = pickle.load(f)["cases"]
    # onnxruntime's profile files: read back per case and not needed after the chunk
    with tempfile.TemporaryDirectory(prefix="amp-gpu-sweep-") as workdir, open(out, "a") as f:
        for i in range(lo, min(hi, len(cases))):
            case = cases[i]
            f.write(json.dumps({"start": i}) + "\n")
            f.flush()
            rec: dict = {"i": i, "name": case["name"], "ops": case["ops"]}
            rec["fp32"], ref = _session_record(case["fp32"], case["inputs"], workdir, f"{i}_fp32")
            if "low" not in case:
                rec["low"] = {"error": "rewrite failed: " + case.get("rewrite_error", "?")}
            else:
                rec["low"], got = _session_record(case["low"], case["inputs"], workdir, f"{i}_low")
                if ref is not None and got is not None:
                    rec["low"]["rel_err"], rec["low"]["new_nonfinite"] = _compare(ref, got)
            f.write(json.dumps(rec) + "\n")
            f.flush()


def run(path: Path, out: Path, budget_s: float, log) -> list[dict]:
    with lzma.open(path, "rb") as f:
        n = len(pickle.load(f)["cases"])
    out.unlink(missing_ok=True)
    t0, i = time.perf_counter(), 0
    while i < n and time.perf_counter() - t0 < budget_s:
        hi = min(i + CHUNK, n)
        proc = subprocess.run([sys.executable, "-m", "tools.gpu_sweep", "chunk", str(path), str(i), str(hi), str(out)],
                              cwd=ROOT, capture_output=True, text=True)
        lines = [json.loads(ln) for ln in out.read_text().splitlines()] if out.exists() else []
        started = max((ln["start"] for ln in lines if "start" in ln), default=-1)
        finished = {ln["i"] for ln in lines if "i" in ln}
        if proc.returncode != 0 and started >= i and started not in finished:
            with open(out, "a") as f:
                f.write(json.dumps({"i": started, "crash": proc.returncode,
                                    "tail": (proc.stderr.strip().splitlines() or [""])[-1][:300]}) + "\n")
            i = started + 1
        else:
            i = hi
        log(f"[run] {i} of {n} cases")
    return [ln for ln in (json.loads(x) for x in out.read_text().splitlines()) if "i" in ln]


def findings(records: list[dict]) -> dict[str, list]:
    """The records worth reading: ops moved to the CPU, failures where FP32 runs, new NaN/Inf, crashes."""
    found: dict[str, list] = {"moved to CPU": [], "fails where FP32 runs": [], "new NaN/Inf": [], "crashed": [],
                              "largest errors": []}
    for r in records:
        if "crash" in r:
            found["crashed"].append((r.get("name", f"case {r['i']}"), r["crash"]))
            continue
        base, low = r["fp32"], r["low"]
        if "error" in base:
            continue
        if "error" in low:
            found["fails where FP32 runs"].append((r["name"], low["error"]))
            continue
        moved = Counter(low.get("cpu", {})) - Counter(base.get("cpu", {}))
        moved.pop("Cast", None)  # (onnxruntime's own casts around a CPU fallback: the op beside them says which)
        if moved:
            found["moved to CPU"].append((r["name"], dict(moved)))
        if low.get("new_nonfinite"):
            found["new NaN/Inf"].append((r["name"], low.get("rel_err")))
        found["largest errors"].append((low.get("rel_err") or 0.0, r["name"]))
    found["largest errors"] = sorted(found["largest errors"], reverse=True)[:10]
    return found


def render(found: dict[str, list], n: int, target: str) -> str:
    lines = [f"{n} cases, target {target}, on {PROVIDER}."]
    for key, items in found.items():
        lines.append(f"{key}: {len(items) if key != 'largest errors' else ''}".rstrip())
        lines += [f"  {item}" for item in items]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["chunk"]:
        run_chunk(Path(argv[1]), int(argv[2]), int(argv[3]), Path(argv[4]))
        return 0
    ap = argparse.ArgumentParser(prog="python -m tools.gpu_sweep", description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=("prepare", "run"))
    ap.add_argument("folder", type=Path)
    ap.add_argument("--target", default="fp16", choices=("fp16", "bf16"))
    ap.add_argument("--ops", nargs="*", help="prepare: only the cases of these ops")
    ap.add_argument("--budget", type=float, default=480, help="run: stop starting children after this many seconds")
    ap.add_argument("--json", metavar="PATH", help="run: also write the findings as JSON")
    ap.add_argument("-q", "--quiet", action="store_true")
    args = ap.parse_args(argv)

    def log(msg: str) -> None:
        if not args.quiet:
            print(msg, file=sys.stderr, flush=True)

    path = args.folder / f"cases-{args.target}.pkl.xz"
    if args.mode == "prepare":
        prepare(args.folder, args.target, args.ops, log)
        return 0
    if not path.exists():
        print(f"error: {path} does not exist: run `python -m tools.gpu_sweep prepare {args.folder} "
              f"--target {args.target}` first", file=sys.stderr)
        return 2
    records = run(path, args.folder / f"results-{args.target}.jsonl", args.budget, log)
    found = findings(records)
    if args.json:
        Path(args.json).write_text(json.dumps(found, indent=1, default=str))
    print(render(found, len(records), args.target), end="")
    return 1 if any(found[k] for k in ("moved to CPU", "fails where FP32 runs", "new NaN/Inf", "crashed")) else 0


if __name__ == "__main__":
    sys.exit(main())
