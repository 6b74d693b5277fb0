"""Benchmark: rewrite a generated >2 GB external-data model without materialising it.

    python tools/huge_model.py --dir /tmp/huge                 # ~2.2 GB FP32 model, then deleted
    python tools/huge_model.py --dir /tmp/huge --size-gb 3 --compare --keep

1. Generates an MLP (MatMul + bias + Relu layers, a decomposed normalisation every 4th layer, so the
   output has FP32 islands too) whose weights are streamed straight into one external-data file: the
   generator never holds more than one weight row block in memory.
2. Rewrites it with ``python -m amp_rewrite`` in a child process, sampling its RSS (anonymous and
   file-backed) from /proc every 20 ms and reading the kernel's peak (``ru_maxrss``) when it exits.
3. Loads and runs the output in onnxruntime (in a child, tools/ortrun.py); ``--compare`` also runs the
   FP32 input and reports the difference.
4. Prints a table and deletes the files (unless ``--keep``).

Needs about 1.6 × the model size free on disk (input + FP16 output). Exit status 1 when the peak RSS
is over --rss-limit-mb (default 1024) or onnxruntime cannot run the output.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))


def generate(folder: Path, size_gb: float, hidden: int, seed: int = 0) -> tuple[Path, int]:
    """Write ``huge.onnx`` + ``huge.onnx.data``; returns the model path and the number of layers."""
    import onnx
    from onnx import TensorProto, helper

    layer_bytes = hidden * hidden * 4 + hidden * 4
    layers = max(1, int(np.ceil(size_gb * (1 << 30) / layer_bytes)))
    model_path = folder / "huge.onnx"
    data_name = "huge.onnx.data"
    rng = np.random.default_rng(seed)
    scale = np.float32(1.0 / np.sqrt(hidden))
    inits, nodes = [], []
    offset = 0

    def external(name: str, dims: list[int], nbytes: int) -> onnx.TensorProto:
        t = TensorProto(name=name, dims=dims, data_type=TensorProto.FLOAT, data_location=TensorProto.EXTERNAL)
        for key, value in (("location", data_name), ("offset", str(offset)), ("length", str(nbytes))):
            entry = t.external_data.add()
            entry.key, entry.value = key, value
        return t

    with open(folder / data_name, "wb") as data:
        rows = max(1, (16 << 20) // (hidden * 4))  # 16 MB at a time
        for i in range(layers):
            w, b = f"layer{i}.weight", f"layer{i}.bias"
            for start in range(0, hidden, rows):
                n = min(rows, hidden - start)
                data.write((rng.standard_normal((n, hidden), dtype=np.float32) * scale).tobytes())
            inits.append(external(w, [hidden, hidden], hidden * hidden * 4))
            offset += hidden * hidden * 4
            data.write((rng.standard_normal(hidden, dtype=np.float32) * np.float32(0.1)).tobytes())
            inits.append(external(b, [hidden], hidden * 4))
            offset += hidden * 4
            src = "x" if i == 0 else f"h{i - 1}"
            nodes += [helper.make_node("MatMul", [src, w], [f"mm{i}"], name=f"layer{i}.matmul"),
                      helper.make_node("Add", [f"mm{i}", b], [f"add{i}"], name=f"layer{i}.bias_add")]
            if i % 4 == 3:  # x / sqrt(mean(x^2) + eps): a deny island (RMSNorm pattern)
                nodes += [helper.make_node("Mul", [f"add{i}", f"add{i}"], [f"sq{i}"], name=f"layer{i}.square"),
                          helper.make_node("ReduceMean", [f"sq{i}"], [f"ms{i}"], name=f"layer{i}.mean", axes=[-1]),
                          helper.make_node("Add", [f"ms{i}", "eps"], [f"mse{i}"], name=f"layer{i}.eps"),
                          helper.make_node("Sqrt", [f"mse{i}"], [f"rms{i}"], name=f"layer{i}.sqrt"),
                          helper.make_node("Div", [f"add{i}", f"rms{i}"], [f"h{i}"], name=f"layer{i}.norm")]
            else:
                nodes.append(helper.make_node("Relu", [f"add{i}"], [f"h{i}"], name=f"layer{i}.relu"))
    inits.append(onnx.numpy_helper.from_array(np.array(1e-6, np.float32), "eps"))
    nodes.append(helper.make_node("Identity", [f"h{layers - 1}"], ["y"], name="output"))
    graph = helper.make_graph(nodes, "huge_mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, hidden])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, hidden])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    model_path.write_bytes(model.SerializeToString())
    return model_path, layers


class RssSampler(threading.Thread):
    """Peak RSS of a running process, split into anonymous (heap) and file-backed (mmap) pages."""

    def __init__(self, pid: int, period: float = 0.02) -> None:
        super().__init__(daemon=True)
        self.pid, self.period = pid, period
        self.peak = {"VmRSS": 0, "RssAnon": 0, "RssFile": 0}
        self.done = threading.Event()

    def run(self) -> None:
        path = f"/proc/{self.pid}/status"
        while not self.done.is_set():
            try:
                with open(path) as f:
                    for line in f:
                        key = line.split(":", 1)[0]
                        if key in self.peak:
                            self.peak[key] = max(self.peak[key], int(line.split()[1]))  # kB
            except (FileNotFoundError, ProcessLookupError, ValueError):
                return
            time.sleep(self.period)


def rewrite(src: Path, dst: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    started = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "amp_rewrite", str(src), "-o", str(dst), "--overwrite"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    sampler = RssSampler(proc.pid)
    sampler.start()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.time() - started
    sampler.done.set()
    sampler.join()
    proc.returncode = os.waitstatus_to_exitcode(status)
    stdout, stderr = proc.stdout.read().decode(), proc.stderr.read().decode()
    return {"rc": proc.returncode, "wall_s": wall, "maxrss_mb": usage.ru_maxrss / 1024,
            "anon_mb": sampler.peak["RssAnon"] / 1024, "file_mb": sampler.peak["RssFile"] / 1024,
            "stdout": stdout, "stderr": stderr}


def folder_size(paths: list[Path]) -> int:
    return sum(p.stat().st_size for p in paths if p.exists())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, required=True, help="scratch folder (created; files deleted after)")
    parser.add_argument("--size-gb", type=float, default=2.2, help="FP32 weight bytes to generate (GiB)")
    parser.add_argument("--hidden", type=int, default=4096, help="layer width (a weight is hidden² floats)")
    parser.add_argument("--rss-limit-mb", type=float, default=1024)
    parser.add_argument("--compare", action="store_true", help="also run the FP32 input and compare outputs")
    parser.add_argument("--keep", action="store_true", help="keep the generated files")
    args = parser.parse_args(argv)

    args.dir.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(args.dir).free / (1 << 30)
    if free < args.size_gb * 1.7:
        print(f"huge_model: only {free:.1f} GiB free in {args.dir}; need ~{args.size_gb * 1.7:.1f}", file=sys.stderr)
        return 2
    rows: list[tuple[str, str]] = []
    ok = True
    try:
        t0 = time.time()
        src, layers = generate(args.dir, args.size_gb, args.hidden)
        gen_s = time.time() - t0
        inputs = [src, args.dir / "huge.onnx.data"]
        rows += [("layers × hidden", f"{layers} × {args.hidden}"),
                 ("input size (onnx + data)", f"{folder_size(inputs) / (1 << 30):.2f} GiB"),
                 ("generate time", f"{gen_s:.1f} s")]
        dst = args.dir / "huge.fp16.onnx"
        r = rewrite(src, dst)
        if r["rc"] != 0:
            print(r["stdout"], r["stderr"], file=sys.stderr)
            rows.append(("rewrite", f"FAILED (exit {r['rc']}): {r['stderr'].strip()[:200]}"))
            ok = False
            return 1
        outputs = [dst, args.dir / "huge.fp16.onnx.data"]
        rows += [("rewrite wall time", f"{r['wall_s']:.1f} s"),
                 ("rewrite peak RSS (ru_maxrss)", f"{r['maxrss_mb']:.0f} MiB"),
                 ("  of which anonymous (heap, sampled)", f"{r['anon_mb']:.0f} MiB"),
                 ("  of which file-backed (mmap, sampled)", f"{r['file_mb']:.0f} MiB"),
                 ("output size (onnx + data)", f"{folder_size(outputs) / (1 << 30):.2f} GiB"),
                 ("output .onnx (protobuf) size", f"{dst.stat().st_size / 1024:.0f} KiB")]
        ok = r["maxrss_mb"] <= args.rss_limit_mb

        from ortrun import OrtRunError, run_onnx

        x = np.random.default_rng(1).standard_normal((1, args.hidden)).astype(np.float32)
        t0 = time.time()
        try:
            got = run_onnx(dst, {"x": x}, timeout=600)["y"].astype(np.float32)
            rows.append(("onnxruntime load + run (output)", f"ok, {time.time() - t0:.1f} s, finite: "
                                                            f"{bool(np.isfinite(got).all())}"))
            ok = ok and bool(np.isfinite(got).all())
        except OrtRunError as exc:
            rows.append(("onnxruntime load + run (output)", f"FAILED: {str(exc).splitlines()[0][:200]}"))
            ok = False
            got = None
        if args.compare and got is not None:
            ref = run_onnx(src, {"x": x}, timeout=600)["y"]
            err = float(np.abs(ref - got).max())
            rows.append(("max |fp32 - fp16| (output)", f"{err:.3g} (output max {float(np.abs(ref).max()):.3g})"))
        summary = next((line for line in r["stdout"].splitlines() if line.startswith("casts")), "")
        if summary:
            rows.append(("report", summary))
    finally:
        width = max((len(k) for k, _ in rows), default=10)
        print()
        print(f"| {'measure'.ljust(width)} | value |")
        print(f"|{'-' * (width + 2)}|-------|")
        for key, value in rows:
            print(f"| {key.ljust(width)} | {value} |")
        print(f"\nresult: {'PASS' if ok else 'FAIL'} (peak RSS limit {args.rss_limit_mb:.0f} MiB)")
        if not args.keep:
            for name in ("huge.onnx", "huge.onnx.data", "huge.fp16.onnx", "huge.fp16.onnx.data"):
                (args.dir / name).unlink(missing_ok=True)
            for leftover in args.dir.glob(".amp-rewrite-*"):
                shutil.rmtree(leftover, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
