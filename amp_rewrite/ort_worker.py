"""onnxruntime in a child process, for ``--check`` and ``--auto-fp32``.

onnxruntime can end the process instead of raising: an assertion in a kernel aborts (RandomNormal
with ``scale=0`` does, in the FP32 model itself), and its CPU provider has died with SIGSEGV on
valid FP16 graphs. In-process, that killed amp-rewrite with "Aborted" and no word of which model
or why; here it is a RuntimeError like any other onnxruntime failure, which the check turns into
its usual one-line error (and ``--auto-fp32`` into a failed candidate).

One child serves every run of a :class:`~amp_rewrite.check.Runner` (a fresh one after a crash).
It is ``python -c`` importing this package, not a multiprocessing child: the spawn start method
would import the caller's main script again, running a script without an ``if __name__ ==
"__main__"`` guard twice. Requests and answers travel pickled over two pipes of their own (the
child's stdout is onnxruntime's, and may carry its prints); its stderr goes to a file whose last
lines describe a crash.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Sequence

FAULT_ENV = "AMP_REWRITE_ORT_WORKER_FAULT"  # tests: "segv" or "abort" kills the child at its next request
_STDERR_LINES = 3


class OrtCrash(RuntimeError):
    """The child died running onnxruntime (a signal, or an exit), rather than raising."""


class SessionError(RuntimeError):
    """onnxruntime refused to create a session for the model (an IR version or opset it does not
    read, an op it has no kernel for): whatever the inputs, it cannot run it."""


def available() -> bool:
    """Whether runs can go to a child (pipes passed by descriptor: POSIX)."""
    return os.name == "posix"


class Worker:
    """A child process that runs ``Runner._run_here`` / ``Runner._load_here`` for a parent Runner."""

    def __init__(self, providers: Sequence[str]) -> None:
        self.providers = list(providers)  # the child's Runner's
        self._proc: subprocess.Popen | None = None
        self._inbox: Connection | None = None  # answers from the child
        self._outbox: Connection | None = None  # requests to it
        self._stderr: Any = None

    def call(self, method: str, model: Any, *args: Any, what: str, **kwargs: Any) -> tuple[Any, str]:
        """``Runner.<method>_here(model, *args, what=what, **kwargs)`` in the child: its result and
        the provider its session got. RuntimeError where onnxruntime failed, OrtCrash where the
        child died."""
        if self._proc is None:
            self._start()
        try:
            self._outbox.send((method, model, args, dict(kwargs, what=what)))
            ok, payload, provider = self._inbox.recv()
        except (EOFError, OSError):  # (BrokenPipeError and ConnectionResetError are OSErrors)
            raise OrtCrash(f"{what}: {self._crash()}") from None
        if not ok:
            kind, message = payload
            raise (SessionError if kind == "session" else RuntimeError)(message)
        return payload, provider

    def _start(self) -> None:
        from_child, child_out = os.pipe()
        child_in, to_child = os.pipe()
        root = str(Path(__file__).resolve().parent.parent)
        code = (f"import sys; sys.path.insert(0, {root!r}); from amp_rewrite.ort_worker import serve; "
                f"serve({child_in}, {child_out}, {self.providers!r})")
        self._stderr = tempfile.TemporaryFile()
        try:
            self._proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=(child_in, child_out),
                                          stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self._stderr)
        except BaseException:
            for fd in (from_child, child_out, child_in, to_child):
                os.close(fd)
            raise
        finally:
            if self._proc is not None:
                os.close(child_in)
                os.close(child_out)
        self._inbox = Connection(from_child, writable=False)
        self._outbox = Connection(to_child, readable=False)

    def _crash(self) -> str:
        """Why the child went away (it is reaped, and the next call starts another)."""
        proc = self._proc
        try:
            code = proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        tail = ""
        if self._stderr is not None:
            self._stderr.seek(0)
            lines = [ln.strip() for ln in self._stderr.read().decode(errors="replace").splitlines() if ln.strip()]
            tail = " ".join(lines[-_STDERR_LINES:])
        self.close()
        if code < 0:
            try:
                how = f"killed by {signal.Signals(-code).name}"
            except ValueError:
                how = f"killed by signal {-code}"
        else:
            how = f"exit status {code}"
        return f"onnxruntime crashed the process running it ({how})" + (f": {tail}" if tail else "")

    def close(self) -> None:
        for conn in (self._outbox, self._inbox):
            if conn is not None:
                conn.close()
        self._outbox = self._inbox = None
        if self._proc is not None:
            try:
                self._proc.wait(timeout=10)  # (its inbox closed: it returns)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None
        if self._stderr is not None:
            self._stderr.close()
            self._stderr = None


def serve(rfd: int, wfd: int, providers: list[str]) -> None:
    """The child's loop: one answer per request until the parent closes the pipe."""
    from .check import Runner

    inbox, outbox = Connection(rfd, writable=False), Connection(wfd, readable=False)
    runner = Runner(providers, isolated=False)
    while True:
        try:
            method, model, args, kwargs = inbox.recv()
        except EOFError:
            return
        fault = os.environ.get(FAULT_ENV)
        if fault in ("segv", "abort"):
            sys.stderr.write(f"{FAULT_ENV}={fault}: crashing on purpose\n")
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGSEGV if fault == "segv" else signal.SIGABRT)
        try:
            result = getattr(runner, f"_{method}_here")(model, *args, **kwargs)
            answer = (True, result, runner.provider)
        except RuntimeError as exc:
            answer = (False, ("session" if isinstance(exc, SessionError) else "run", str(exc)), runner.provider)
        except Exception as exc:  # noqa: BLE001 (anything else is a failed run too, said in one line)
            answer = (False, ("run", f"{kwargs.get('what', 'onnxruntime')}: {type(exc).__name__}: {exc}"),
                      runner.provider)
        outbox.send(answer)
