"""amp-rewrite's output on onnxruntime's CUDA provider: does every rewritten corpus model load and run
there, stay on the GPU, and match the FP32 model computed on the same GPU?

    python -m tools.gpu_check prepare DIR [--tier full] [--models ...] [--max-mib N]   # any machine
    python -m tools.gpu_check run DIR [--json PATH]                                   # needs a GPU
    python -m tools.gpu_check --tier fast                                             # both, temp dir

``prepare`` builds each corpus model (``tools/corpus.py``) and writes ``DIR/<model>/`` with the FP32
model, amp-rewrite's default FP16 rewrite and its ``--target bf16`` rewrite, the feeds and the logits'
names; it needs no GPU, so the folder can be built on one machine and run on another. ``run`` takes
each model in a child process (a crash fails one model, not the run) and, for each variant, creates a
CUDAExecutionProvider session (CPU provider as fallback, as a user's session would have), runs the
feeds once with onnxruntime's profiler on and reads from the profile which provider ran each node.

Printed per model: the nodes the CPU provider ran (FP32 model, then each rewrite: onnxruntime keeps
some shape arithmetic on the CPU by design, so the figure that matters is what a rewrite adds), the op
types the rewrite moved to the CPU, the largest relative error of the logits against the FP32 model
on the GPU (TF32 off, so the reference is true FP32), and NaN/Inf the FP32 model does not produce;
for context, the error of onnxruntime's all-FP16 converter (``keep_io_types=True``) on the same GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

VARIANTS = {"fp16": {}, "bf16": {"target": "bf16"}}
TOLERANCE = {"fp16": 1e-2, "bf16": 5e-2}
# tests/test_e2e_corpus.py's stated tolerances for two deep random-weight CNNs (FP16 activation rounding
# over 50+ layers; every FP16 converter lands near 4e-2 on them).
STATED = {"zoo/resnet50": 5e-2, "zoo/inception_v2": 5e-2}
PROVIDER = "CUDAExecutionProvider"


# -- prepare ---------------------------------------------------------------------------------------------
def prepare(folder: Path, names: list[str], max_mib: float | None, log) -> list[str]:
    """Build, save and rewrite ``names`` under ``folder``; return the names written."""
    import numpy as np
    import onnx

    import amp_rewrite
    from tools import corpus

    done = []
    for name in names:
        cm = corpus.build(name)
        size = cm.model.ByteSize() / (1 << 20)
        if max_mib is not None and size > max_mib:
            log(f"[prepare] {name}: {size:.0f} MiB, over --max-mib {max_mib:g}: skipped")
            continue
        entry = folder / name.replace("/", "__")
        entry.mkdir(parents=True, exist_ok=True)
        src = entry / "fp32.onnx"
        onnx.save_model(cm.model, str(src))
        np.savez(entry / "feeds.npz", **cm.feeds)
        meta = {"name": name, "logits": list(cm.logits), "rewrite_errors": {}}
        for variant, options in VARIANTS.items():
            try:
                amp_rewrite.rewrite_onnx(src, entry / f"{variant}.onnx", overwrite=True, **options)
            except Exception as exc:  # noqa: BLE001 - a failed rewrite is a result
                meta["rewrite_errors"][variant] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
        try:  # the all-FP16 peer, for context: what FP16 alone costs in error on this GPU
            from onnxruntime.transformers.float16 import convert_float_to_float16

            onnx.save_model(convert_float_to_float16(onnx.load_model(str(src)), keep_io_types=True),
                            str(entry / "peer.onnx"))
        except Exception as exc:  # noqa: BLE001
            meta["rewrite_errors"]["peer"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        (entry / "meta.json").write_text(json.dumps(meta, indent=1))
        log(f"[prepare] {name}: {size:.1f} MiB")
        done.append(name)
    return done


# -- one model, in a child process -------------------------------------------------------------------------
def profiled_session(model: str | bytes, prefix: str, provider: str | None = None):
    """A session on ``provider`` (default :data:`PROVIDER`; the CPU one as fallback, as a user's
    session would have), TF32 off so that FP32 is true FP32, with onnxruntime's profiler writing
    under ``prefix``."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    opts.enable_profiling = True
    opts.profile_file_prefix = prefix
    providers = [(provider or PROVIDER, {"use_tf32": "0"}), "CPUExecutionProvider"]
    return ort.InferenceSession(model, opts, providers=providers)


def _placement(profile: str) -> dict[str, Counter]:
    """provider -> Counter of op types, from an onnxruntime profile (one entry per node)."""
    seen: dict[str, tuple[str, str]] = {}
    for event in json.loads(Path(profile).read_text()):
        args = event.get("args") or {}
        if event.get("cat") == "Node" and "provider" in args and "op_name" in args:
            node = event["name"].rsplit("_kernel_time", 1)[0]
            seen[node] = (args["provider"], args["op_name"])
    out: dict[str, Counter] = {}
    for provider, op in seen.values():
        out.setdefault(provider, Counter())[op] += 1
    return out


def run_one(entry: Path) -> dict:
    import numpy as np

    from tools.bench_metrics import _errors

    meta = json.loads((entry / "meta.json").read_text())
    feeds = dict(np.load(entry / "feeds.npz"))
    result: dict = {"name": meta["name"], "variants": {}}
    ref = None
    for variant in ("fp32", *VARIANTS, "peer"):
        path = entry / f"{variant}.onnx"
        if variant == "peer" and not path.exists() and variant not in meta["rewrite_errors"]:
            continue
        rec: dict = {}
        result["variants"][variant] = rec
        if variant in meta["rewrite_errors"]:
            rec["error"] = "rewrite failed: " + meta["rewrite_errors"][variant]
            continue
        try:
            sess = profiled_session(str(path), str(entry / f"profile_{path.stem}"))
            names = [o.name for o in sess.get_outputs()]
            outs = dict(zip(names, sess.run(None, feeds)))
            placement = _placement(sess.end_profiling())
        except Exception as exc:  # noqa: BLE001 - a load or run failure is the result
            rec["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
            continue
        rec["providers"] = sess.get_providers()[:1]
        rec["placement"] = {p: dict(c) for p, c in placement.items()}
        if variant == "fp32":
            ref = outs
        elif ref is not None:
            rec.update(_errors(ref, outs, meta["logits"]))
    return result


# -- run ---------------------------------------------------------------------------------------------------
def run(folder: Path, timeout: float, log) -> dict:
    from tools.bench_worker import _gpu_name

    rows = []
    for entry in sorted(p for p in folder.iterdir() if (p / "meta.json").exists()):
        name = json.loads((entry / "meta.json").read_text())["name"]
        log(f"[run] {name}")
        try:
            proc = subprocess.run([sys.executable, "-m", "tools.gpu_check", "one", str(entry)], cwd=ROOT,
                                  capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            rows.append({"name": name, "error": f"timed out after {timeout:.0f} s"})
            continue
        lines = proc.stdout.strip().splitlines()
        if proc.returncode != 0 or not lines:
            tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            rows.append({"name": name, "error": f"child exited {proc.returncode}: {tail[:300]}"})
            continue
        rows.append(json.loads(lines[-1]))
    return {"gpu": _gpu_name(), "onnxruntime": _ort_version(), "rows": rows}


def _ort_version() -> str:
    import onnxruntime as ort

    return ort.__version__


def _cpu_nodes(rec: dict) -> Counter:
    return Counter((rec.get("placement") or {}).get("CPUExecutionProvider", {}))


def verdict(row: dict, variant: str) -> tuple[bool, str]:
    """(ok, why) for one rewrite of one model."""
    rec = row.get("variants", {}).get(variant, {})
    if "error" in row or "error" in rec:
        return False, row.get("error") or rec["error"]
    base = row["variants"].get("fp32", {})
    if "error" in base:
        return True, "FP32 model does not run here: nothing to compare"
    moved = _cpu_nodes(rec) - _cpu_nodes(base)
    tol = STATED.get(row["name"], TOLERANCE[variant]) if variant == "fp16" else TOLERANCE[variant]
    problems = []
    if rec.get("max_rel_err") is not None and rec["max_rel_err"] > tol:
        problems.append(f"error {rec['max_rel_err']:.2e} > {tol:g}")
    if rec.get("new_nonfinite"):
        problems.append("new NaN/Inf in " + ", ".join(rec["new_nonfinite"]))
    if moved:
        problems.append("moved to CPU: " + ", ".join(f"{op}×{n}" for op, n in sorted(moved.items())))
    return not problems, "; ".join(problems)


def render(results: dict) -> str:
    lines = [f"GPU: {results['gpu']}; onnxruntime {results['onnxruntime']}, CUDA provider. Error: largest "
             f"|y - y_fp32| / max|y_fp32| over the logits, FP32 reference on the same GPU with TF32 off.", ""]
    head = ["model", "FP32 nodes on CPU"]
    for v in VARIANTS:
        head += [f"{v} nodes on CPU", f"{v} max rel err", f"{v} verdict"]
    head += ["all-FP16 peer max rel err"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in results["rows"]:
        cells = [row["name"]]
        base = row.get("variants", {}).get("fp32", {})
        cells.append(str(sum(_cpu_nodes(base).values())) if "placement" in base else "–")
        peer = row.get("variants", {}).get("peer", {})
        for v in VARIANTS:
            rec = row.get("variants", {}).get(v, {})
            ok, why = verdict(row, v)
            cells.append(str(sum(_cpu_nodes(rec).values())) if "placement" in rec else "–")
            err = rec.get("max_rel_err")
            cells.append(f"{err:.1e}" if err is not None else "–")
            cells.append("ok" if ok and not why else ("ok: " + why if ok else "FAIL: " + why))
        cells.append(f"{peer['max_rel_err']:.1e}" if peer.get("max_rel_err") is not None
                     else ("does not run" if "error" in peer else "–"))
        lines.append("| " + " | ".join(cells) + " |")
    bad = sum(not verdict(r, v)[0] for r in results["rows"] for v in VARIANTS)
    lines += ["", f"{len(results['rows'])} models, {bad} failing (model, target) pairs."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["one"]:
        print(json.dumps(run_one(Path(argv[1]))))
        return 0
    ap = argparse.ArgumentParser(prog="python -m tools.gpu_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", nargs="?", choices=("prepare", "run", "all"), default="all")
    ap.add_argument("folder", nargs="?", type=Path)
    ap.add_argument("--tier", default="fast", choices=("fast", "full"))
    ap.add_argument("--models", nargs="*")
    ap.add_argument("--max-mib", type=float, help="prepare: skip models larger than this")
    ap.add_argument("--timeout", type=float, default=600, help="run: seconds per model")
    ap.add_argument("--json", metavar="PATH", help="run: also write the results as JSON")
    ap.add_argument("-q", "--quiet", action="store_true")
    args = ap.parse_args(argv)

    def log(msg: str) -> None:
        if not args.quiet:
            print(msg, file=sys.stderr, flush=True)

    from tools import corpus

    if args.mode != "all" and args.folder is None:
        ap.error(f"{args.mode} needs a FOLDER")
    folder = args.folder or Path(tempfile.mkdtemp(prefix="amp-gpu-check-"))
    try:
        if args.mode in ("prepare", "all"):
            folder.mkdir(parents=True, exist_ok=True)
            prepare(folder, args.models or corpus.list_models(args.tier), args.max_mib, log)
        if args.mode in ("run", "all"):
            from tools.bench_worker import gpu_probe_main

            probe = gpu_probe_main()
            if not probe.get("available"):
                print(f"error: no usable CUDA provider: {probe.get('reason')}", file=sys.stderr)
                return 2
            results = run(folder, args.timeout, log)
            if args.json:
                Path(args.json).write_text(json.dumps(results, indent=1))
            print(render(results), end="")
            return 1 if any(not verdict(r, v)[0] for r in results["rows"] for v in VARIANTS) else 0
    finally:
        if args.folder is None:
            shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
