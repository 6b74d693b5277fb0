"""Run ONNX models with onnxruntime in a child process.

Why a subprocess: onnxruntime's CPU provider can die with SIGSEGV/SIGABRT on
some (FP16, hand-rewritten) graphs instead of raising a Python exception.  In
the parent process such a crash would take the whole pytest session down; in
a child it becomes an ordinary :class:`OrtRunError` that fails one test.

Data crosses the process boundary through temporary ``.npz`` files (arrays are
stored under positional keys, names travel in a JSON side entry, so output
names containing ``/`` or ``:`` are safe).  The child is this very file run as
a script (``python tools/ortrun.py run ...``); it imports only numpy and
onnxruntime, so it starts quickly and does not depend on ``sys.path``.

Fault injection for tests: if ``AMP_REWRITE_ORTRUN_FAULT`` is set in the
environment the child misbehaves on purpose (``segv``: kills itself with
SIGSEGV, ``abort``: SIGABRT, ``hang``: sleeps forever, ``exit``: exits 3)
before touching the model.  This lets the crash-handling path be tested
without relying on a real onnxruntime bug.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Union

import numpy as np

__all__ = ["OrtRunError", "run_onnx", "load_ok", "FAULT_ENV"]

FAULT_ENV = "AMP_REWRITE_ORTRUN_FAULT"
OPT_LEVEL_ENV = "AMP_REWRITE_ORT_OPT_LEVEL"
_NAMES_KEY = "__names__"
_DTYPES_KEY = "__dtypes__"
_STDERR_TAIL = 8000

ModelLike = Union["onnx.ModelProto", str, os.PathLike]  # noqa: F821 (onnx imported lazily)


class OrtRunError(RuntimeError):
    """onnxruntime failed in the child: load error, run error, crash or timeout.

    Attributes:
        returncode: the child's exit status (negative: killed by that signal),
            ``None`` on timeout.
        signal_name: e.g. ``"SIGSEGV"`` when the child died from a signal.
        stderr: the tail of the child's stderr (the Python traceback or the
            native crash message).
    """

    def __init__(self, message: str, *, returncode: int | None = None,
                 signal_name: str | None = None, stderr: str = "") -> None:
        super().__init__(message)
        self.returncode = returncode
        self.signal_name = signal_name
        self.stderr = stderr


# --------------------------------------------------------------------------- #
# npz transport (shared by parent and child)
# --------------------------------------------------------------------------- #
def _save_arrays(path: str, arrays: Mapping[str, np.ndarray]) -> None:
    """Save named arrays without pickles.

    ml_dtypes types (bfloat16, float8 ...) travel as their bit pattern and are
    re-viewed on load; object arrays (onnxruntime's string tensors) travel as
    fixed-width unicode, which onnxruntime accepts as string input too.
    """
    names = list(arrays)
    payload: dict[str, np.ndarray] = {}
    dtypes = []
    for i, name in enumerate(names):
        arr = np.asarray(arrays[name])
        if arr.dtype == object:
            arr = arr.astype(np.str_)
        dtypes.append(arr.dtype.name)
        if arr.dtype.isbuiltin == 2:  # user-defined (ml_dtypes): ship the bit pattern
            arr = arr.view(f"u{arr.dtype.itemsize}")
        payload[f"a{i}"] = arr
    payload[_NAMES_KEY] = np.array(json.dumps(names))
    payload[_DTYPES_KEY] = np.array(json.dumps(dtypes))
    np.savez(path, **payload)


def _load_arrays(path: str) -> dict[str, np.ndarray]:
    """Inverse of :func:`_save_arrays`."""
    with np.load(path, allow_pickle=False) as data:
        names = json.loads(str(data[_NAMES_KEY]))
        dtypes = json.loads(str(data[_DTYPES_KEY]))
        out = {}
        for i, (name, dtype) in enumerate(zip(names, dtypes)):
            arr = data[f"a{i}"]
            if arr.dtype.name != dtype:
                import ml_dtypes  # only needed for exotic dtypes

                arr = arr.view(getattr(ml_dtypes, dtype))
            out[name] = arr
        return out


# --------------------------------------------------------------------------- #
# child side
# --------------------------------------------------------------------------- #
def _inject_fault() -> None:
    """Misbehave on request (see module docstring); a no-op normally."""
    fault = os.environ.get(FAULT_ENV, "")
    if fault == "segv":
        os.kill(os.getpid(), signal.SIGSEGV)
    elif fault == "abort":
        os.kill(os.getpid(), signal.SIGABRT)
    elif fault == "hang":
        import time

        while True:
            time.sleep(60)
    elif fault == "exit":
        sys.stderr.write("injected failure\n")
        sys.exit(3)


def _child_session(model_path: str, providers: Sequence[str]):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3  # errors only: keep stderr for real problems
    # onnxruntime's CPU-only level-ALL optimizers (layout transforms) can SIGSEGV on valid FP16
    # graphs (seen on an FP16 LSTM language model); tests of numerics may ask for "extended".
    level = os.environ.get(OPT_LEVEL_ENV, "all").lower()
    levels = {"disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
              "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
              "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
              "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL}
    opts.graph_optimization_level = levels.get(level, levels["all"])
    return ort.InferenceSession(model_path, opts, providers=list(providers))


def _child_main(argv: Sequence[str]) -> int:
    """Entry point of the child: ``run MODEL FEEDS OUT PROVIDERS`` or ``load MODEL PROVIDERS``."""
    import faulthandler

    faulthandler.enable()  # a native crash prints a Python stack to stderr
    _inject_fault()
    mode = argv[0]
    if mode == "load":
        _child_session(argv[1], argv[2].split(","))
        return 0
    if mode == "run":
        model_path, feeds_path, out_path, providers = argv[1:5]
        sess = _child_session(model_path, providers.split(","))
        feeds = _load_arrays(feeds_path)
        names = [o.name for o in sess.get_outputs()]
        values = sess.run(names, feeds)
        _save_arrays(out_path, dict(zip(names, values)))
        return 0
    sys.stderr.write(f"ortrun: unknown mode {mode!r}\n")
    return 2


# --------------------------------------------------------------------------- #
# parent side
# --------------------------------------------------------------------------- #
def _materialize(model: ModelLike, tmpdir: str) -> str:
    """Return a path onnxruntime can load; protos are written into ``tmpdir``.

    A path is used as-is so that models with external data keep resolving
    their tensors relative to their own directory.  Protos too large for a
    single protobuf (2 GiB) are saved with external data.
    """
    if isinstance(model, (str, os.PathLike)):
        return os.fspath(model)
    import onnx

    path = os.path.join(tmpdir, "model.onnx")
    try:
        too_big = model.ByteSize() >= 2**31 - 2**20
    except Exception:  # ByteSize itself can overflow on huge protos
        too_big = True
    if too_big:
        onnx.save_model(model, path, save_as_external_data=True,
                        all_tensors_to_one_file=True, location="model.onnx.data")
    else:
        with open(path, "wb") as f:
            f.write(model.SerializeToString())
    return path


def _describe_failure(rc: int, stderr: str, what: str) -> OrtRunError:
    tail = stderr[-_STDERR_TAIL:]
    if rc < 0:
        try:
            sig = signal.Signals(-rc).name
        except ValueError:
            sig = f"signal {-rc}"
        return OrtRunError(f"onnxruntime child crashed with {sig} while {what}\n{tail}",
                           returncode=rc, signal_name=sig, stderr=tail)
    last = next((ln for ln in reversed(tail.strip().splitlines()) if ln.strip()), "")
    return OrtRunError(f"onnxruntime failed (exit {rc}) while {what}: {last}\n{tail}",
                       returncode=rc, stderr=tail)


def _run_child(args: Sequence[str], timeout: float, what: str) -> None:
    """Run this file as a child with ``args``; raise OrtRunError unless it exits 0."""
    cmd = [sys.executable, os.path.abspath(__file__), *args]
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              timeout=timeout, text=True, errors="replace")
    except subprocess.TimeoutExpired as exc:
        err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        raise OrtRunError(f"onnxruntime child timed out after {timeout}s while {what}\n{err[-_STDERR_TAIL:]}",
                          returncode=None, stderr=err[-_STDERR_TAIL:]) from None
    if proc.returncode != 0:
        raise _describe_failure(proc.returncode, proc.stderr, what)


def run_onnx(model_or_path: ModelLike, feeds: Mapping[str, np.ndarray], *,
             providers: Sequence[str] = ("CPUExecutionProvider",),
             timeout: float = 120) -> dict[str, np.ndarray]:
    """Run a model in a fresh onnxruntime child process and return all outputs.

    Args:
        model_or_path: an ``onnx.ModelProto`` (written to a temp file) or a
            path to an ``.onnx`` file (used directly, external data included).
        feeds: input name -> array.
        providers: onnxruntime execution providers, in priority order.
        timeout: seconds before the child is killed (a hang is a failure too).

    Returns:
        output name -> array, in the model's output order.

    Raises:
        OrtRunError: the child failed to load or run the model, crashed with
            a signal, or timed out; the message carries the child's stderr.
    """
    with tempfile.TemporaryDirectory(prefix="ortrun-") as tmp:
        model_path = _materialize(model_or_path, tmp)
        feeds_path = os.path.join(tmp, "feeds.npz")
        out_path = os.path.join(tmp, "out.npz")
        _save_arrays(feeds_path, {k: np.asarray(v) for k, v in feeds.items()})
        _run_child(["run", model_path, feeds_path, out_path, ",".join(providers)],
                   timeout, f"running {Path(model_path).name}")
        return _load_arrays(out_path)


def load_ok(model_or_path: ModelLike, *,
            providers: Sequence[str] = ("CPUExecutionProvider",),
            timeout: float = 120) -> tuple[bool, str]:
    """Whether onnxruntime can create a session for the model (in a child).

    Returns ``(True, "")`` or ``(False, reason)``; never raises for model
    problems, so it suits "does the rewritten model still load" checks.
    """
    with tempfile.TemporaryDirectory(prefix="ortrun-") as tmp:
        model_path = _materialize(model_or_path, tmp)
        try:
            _run_child(["load", model_path, ",".join(providers)], timeout,
                       f"loading {Path(model_path).name}")
        except OrtRunError as exc:
            return False, str(exc)
        return True, ""


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1:]))
