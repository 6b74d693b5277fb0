"""The benchmark's child process: one conversion (or one latency measurement) per process, so its
time and peak RSS are its own and a converter that crashes or hangs costs one row, not the run.

    python tools/bench_worker.py convert CONVERTER SRC DST [--target fp16|bf16]
    python tools/bench_worker.py latency MODEL FEEDS.npz PROVIDER[:OPTION=VALUE,...] WARMUP RUNS [OUTPUTS.npz]
    python tools/bench_worker.py load MODEL
    python tools/bench_worker.py gpu-probe

Each prints one JSON line on stdout. A conversion is timed file to file (load, convert, save), the
way a user runs it; imports (and onnx's one-time schema registry) happen before the clock starts,
for every converter alike.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

CONVERTERS = ("amp-rewrite-greedy", "amp-rewrite-optimal", "onnxconverter-common", "ort-transformers")
TWO_GB = (2 << 30) - (64 << 20)


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / (1 << 20)


def _peak_rss_mib() -> float:
    """This process's peak RSS. VmHWM, not ru_maxrss: Linux carries ru_maxrss across fork+exec, so a
    child of a big parent would report the parent's size."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _prepare(converter: str):
    """Import what the converter needs (outside the timed span) and return convert(src, dst, target).

    onnx builds its operator schema registry once per process, at the first schema lookup or shape
    inference (about 9 ms here). Every converter needs it; it is library initialisation, like an
    import, so it is built here for all of them alike. (amp-rewrite's rule check looks up schemas
    while its rules load, before the clock, while the peers met it inside their first
    infer_shapes: without this, 9 ms of their time would be a cost amp-rewrite had moved out.)"""
    import onnx

    onnx.defs.get_schema("Add", onnx.defs.onnx_opset_version())
    if converter.startswith("amp-rewrite"):
        import amp_rewrite.emitters.onnx_emitter  # noqa: F401  (onnx_ir and friends)
        import amp_rewrite.frontends.onnx_fuse  # noqa: F401
        import amp_rewrite.frontends.onnx_constants  # noqa: F401  (imported by the ONNX pipeline's first run)
        import amp_rewrite.frontends.onnx_loader  # noqa: F401
        import onnxruntime.tools.symbolic_shape_infer  # noqa: F401  (sympy: the fuse pass's shape proofs)
        import sympy.tensor.tensor  # noqa: F401  (sympy's Add imports it at its first call)
        import sympy.assumptions.wrapper  # noqa: F401  (and this one at its first assumption query)
        import amp_rewrite.progress  # noqa: F401
        import amp_rewrite.passes.optimal  # noqa: F401
        from amp_rewrite.api import rewrite_onnx

        from amp_rewrite.api import make_context

        placement = converter.rsplit("-", 1)[1]
        # Parsing the built-in rule files is configuration loading, like the peers' import of their
        # op lists: done (and cached) before the clock starts.
        make_context(frontend="onnx", target=os.environ.get("AMP_BENCH_TARGET", "fp16"), placement=placement)

        def convert(src: str, dst: str, target: str) -> None:
            rewrite_onnx(src, dst, overwrite=True, placement=placement, target=target)

        return convert
    import onnx

    # "<peer>+no-shape-infer": the same call with disable_shape_infer=True, the peers' own escape
    # hatch for models over 2 GB (their shape inference serialises the whole model)
    peer, _, variant = converter.partition("+")
    if peer == "onnxconverter-common":
        from onnxconverter_common.float16 import convert_float_to_float16
    elif peer == "ort-transformers":
        from onnxruntime.transformers.float16 import convert_float_to_float16
    else:
        raise SystemExit(f"unknown converter {converter!r}; choose from {', '.join(CONVERTERS)}")
    extra = {"disable_shape_infer": True} if variant == "no-shape-infer" else {}

    def convert(src: str, dst: str, target: str) -> None:
        if target != "fp16":
            raise RuntimeError(f"{converter} converts to fp16 only")
        model = onnx.load(src)  # loads external data too: these converters work on an in-memory proto
        out = convert_float_to_float16(model, keep_io_types=True, **extra)
        _save(out, dst)

    return convert


def _save(model, dst: str) -> None:
    import onnx

    weight_bytes = sum(len(t.raw_data) for t in model.graph.initializer)
    if weight_bytes > TWO_GB:
        onnx.save_model(model, dst, save_as_external_data=True, all_tensors_to_one_file=True,
                        location=Path(dst).name + ".data", size_threshold=1024)
    else:
        onnx.save_model(model, dst)


def convert_main(converter: str, src: str, dst: str, target: str) -> dict:
    os.environ["AMP_BENCH_TARGET"] = target
    convert = _prepare(converter)
    rss_before = _rss_mib()
    cpu0, t0 = _cpu(), time.perf_counter()
    try:
        convert(src, dst, target)
        error = None
    except BaseException as exc:  # noqa: BLE001 - a converter failure is a result, not a crash
        error = f"{type(exc).__name__}: {exc}"
        sys.stderr.write(traceback.format_exc())
    seconds, cpu = time.perf_counter() - t0, _cpu() - cpu0
    return {"ok": error is None, "seconds": seconds, "cpu_seconds": cpu, "peak_rss_mib": _peak_rss_mib(),
            "rss_before_mib": rss_before, "error": error}


def latency_main(model: str, feeds_path: str, provider: str, warmup: int, runs: int,
                 out_path: str | None = None) -> dict:
    """Median latency of one model. On a GPU provider the inputs and outputs are bound on the device
    (I/O binding), so what is timed is the model, not host copies; ``out_path`` gets the outputs
    of the first run (an .npz) for the caller's error check."""
    import numpy as np
    import onnxruntime as ort

    feeds = dict(np.load(feeds_path))
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    provider, _, spec = provider.partition(":")  # "CUDAExecutionProvider:prefer_nhwc=1,..." sets options
    options = dict(kv.split("=", 1) for kv in spec.split(",") if kv)
    sess = ort.InferenceSession(model, opts, providers=[(provider, options), "CPUExecutionProvider"])
    if sess.get_providers()[0] != provider:
        return {"ok": False, "error": f"{provider} not used (got {sess.get_providers()})"}
    names = [o.name for o in sess.get_outputs()]
    if provider == "CUDAExecutionProvider":
        binding = sess.io_binding()
        for name, value in feeds.items():
            binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(value, "cuda", 0))
        for name in names:
            binding.bind_output(name, "cuda")

        def once() -> None:
            sess.run_with_iobinding(binding)
            binding.synchronize_outputs()

        def outputs() -> list:
            return binding.copy_outputs_to_cpu()
    else:
        last: list = []

        def once() -> None:
            last[:] = sess.run(None, feeds)

        def outputs() -> list:
            return last
    once()
    if out_path:
        np.savez(out_path, **dict(zip(names, outputs())))
    for _ in range(max(warmup - 1, 0)):
        once()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        once()
        times.append(time.perf_counter() - t0)
    times.sort()
    return {"ok": True, "median_ms": 1000 * times[len(times) // 2], "runs": runs, "warmup": warmup}


def load_main(model: str) -> dict:
    """Does onnxruntime create a session for ``model`` (on the CUDA provider where this build has one)?"""
    import onnxruntime as ort

    providers = [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in ort.get_available_providers()]
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    try:
        ort.InferenceSession(model, opts, providers=providers)
    except Exception as exc:  # noqa: BLE001 - a model that does not load is the answer
        return {"ok": False, "error": str(exc).splitlines()[0][:300]}
    return {"ok": True}


def gpu_probe_main() -> dict:
    """Is there a usable CUDA provider? Creating a session is the only honest test:
    onnxruntime-gpu lists CUDAExecutionProvider even on a machine without a GPU."""
    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return {"available": False, "reason": "this onnxruntime build has no CUDAExecutionProvider"}
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "probe",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    opts = ort.SessionOptions()
    opts.log_severity_level = 4
    try:
        sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CUDAExecutionProvider"])
        used = sess.get_providers()
    except Exception as exc:  # noqa: BLE001
        return {"available": False, "reason": f"CUDAExecutionProvider failed to start: {str(exc).splitlines()[0]}"}
    if "CUDAExecutionProvider" not in used:
        return {"available": False,
                "reason": f"onnxruntime lists CUDAExecutionProvider but fell back to {used[0]} (no usable GPU / CUDA)"}
    name = _gpu_name()
    return {"available": True, "gpu": name, "onnx": onnx.__version__, "onnxruntime": ort.__version__}


def _gpu_name() -> str:
    import subprocess

    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown NVIDIA GPU"


def main(argv: list[str]) -> int:
    mode = argv[0] if argv else ""
    if mode == "convert":
        target = argv[argv.index("--target") + 1] if "--target" in argv else "fp16"
        result = convert_main(argv[1], argv[2], argv[3], target)
    elif mode == "latency":
        result = latency_main(argv[1], argv[2], argv[3], int(argv[4]), int(argv[5]), argv[6] if len(argv) > 6 else None)
    elif mode == "gpu-probe":
        result = gpu_probe_main()
    elif mode == "load":
        result = load_main(argv[1])
    else:
        sys.stderr.write(__doc__)
        return 2
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
