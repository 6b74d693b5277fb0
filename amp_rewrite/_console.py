"""The ``amp-rewrite`` console script's entry point. Ctrl-C is handled from the first line of ours
that runs: the CLI and, through it, numpy, networkx and onnx take a few hundred milliseconds to
import, and an interrupt then must still end as ``interrupted`` (exit 130), not as a traceback.
numpy's extension catches a KeyboardInterrupt raised inside its import, prints it and raises an
ImportError instead, so a Ctrl-C is held back while those imports run and acted on after them.
Only the standard library is imported here, and the package's ``__init__`` imports nothing heavy."""

from __future__ import annotations

import contextlib
import signal
import sys
import threading

INTERRUPTED = 130


def interrupted_import(exc: BaseException | None) -> bool:
    """Whether an exception is a Ctrl-C in disguise: an ImportError whose cause or context is the
    KeyboardInterrupt (an import interrupted after the CLI's own imports, onnxruntime's for --check)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, KeyboardInterrupt):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


@contextlib.contextmanager
def interrupts_held():
    """Hold Ctrl-C and SIGTERM back while an extension module imports, and deliver them after it:
    onnxruntime's, interrupted inside the numpy import it makes, failed with "import numpy failed",
    and the run went on without onnxruntime's schemas to a false rule-file error (exit 4)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: held.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if held:
        signal.raise_signal(held[0])  # (to the handler it was meant for: KeyboardInterrupt, the CLI's SIGTERM)


def main() -> int:
    try:
        with interrupts_held():
            # the extension modules every run loads (a Ctrl-C inside a pure-Python import is a plain
            # KeyboardInterrupt, which the CLI handles)
            import ml_dtypes  # noqa: F401
            import numpy  # noqa: F401
            import onnx  # noqa: F401

            from .cli import main as cli_main
    except KeyboardInterrupt:  # (one held through the imports, delivered after them)
        print("amp-rewrite: interrupted; no output was written", file=sys.stderr)
        return INTERRUPTED
    try:
        code = cli_main()
    except KeyboardInterrupt:
        # (after the run: the model's memory is freed as its frames return, which takes a while for
        # large weights; a Ctrl-C there ended the process by SIGINT, saying nothing of what was written)
        from .cli import _interrupted

        print(_interrupted(), file=sys.stderr)
        code = INTERRUPTED
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):  # the outcome is decided: the exit is not interrupted
            signal.signal(sig, signal.SIG_IGN)
    return code
