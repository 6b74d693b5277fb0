"""Command line: argument parsing, messages and exit codes. No graph logic lives here.

Every failure is one line on stderr (``amp-rewrite: error: ...``) and a documented exit code;
``--debug`` shows the traceback instead of the line, with the same exit code.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import traceback
from pathlib import Path
from typing import List, Optional

import typer

from .errors import AmpRewriteError

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, no_args_is_help=True,
                  context_settings={"help_option_names": ["-h", "--help"]})

INTERNAL_ERROR = 70
INTERRUPTED = 130
TERMINATED = 143  # 128 + SIGTERM, as a shell reports a process SIGTERM ended


def _print_version(value: bool) -> None:
    if value:
        from . import __version__

        print(f"amp-rewrite {__version__}")
        raise typer.Exit()


def _path(value: str) -> Path:
    """A file to read: an empty one is refused here, as pathlib reads '' as '.', the current folder
    (which the messages further on would then name)."""
    if not value:
        raise typer.BadParameter("the path is empty; give a file's path")
    return Path(value)


def _file_path(value: str) -> Path:
    """A file to write: a trailing slash names a folder, which pathlib drops ('outdir/' became a
    file named outdir)."""
    _path(value)
    if value.endswith(("/", os.sep)):
        raise typer.BadParameter(f"{value!r} ends with a slash, so it names a folder; give the file's path "
                                 f"(e.g. {value}<file>)")
    return Path(value)


@app.command()
def _command(
    # (readable=False: the loader says why a file cannot be read, with exit 3, as for every bad input)
    model: Path = typer.Argument(..., help="FP32 ONNX model to rewrite (never modified).", readable=False,
                                 parser=_path),
    output: Optional[Path] = typer.Option(None, "-o", "--output", parser=_file_path, metavar="<path>",
                                          help="Output path (default: <model>.fp16.onnx, or <model>.bf16.onnx with --target bf16, next to the input)."),
    target: str = typer.Option("fp16", "--target", help="Low-precision type: fp16 or bf16."),
    rules: List[Path] = typer.Option([], "--rules", parser=_path, metavar="<path>", help="Rule file layered on the built-in set (repeatable)."),
    keep_io_types: bool = typer.Option(True, "--keep-io-types/--no-keep-io-types",
                                       help="Keep float graph inputs/outputs FP32 (default) or make them low precision."),
    fp32_nodes: List[str] = typer.Option([], "--fp32-nodes", help="Node name, glob or re:regex kept FP32 (repeatable)."),
    fp16_nodes: List[str] = typer.Option([], "--fp16-nodes", help="Node name, glob or re:regex made low precision (repeatable)."),
    fp32_ops: List[str] = typer.Option([], "--fp32-ops", help="Op type kept FP32 (repeatable)."),
    fp16_ops: List[str] = typer.Option([], "--fp16-ops", help="Op type made low precision (repeatable)."),
    placement: str = typer.Option("optimal", "--placement", help="Cast placement: optimal (exact min-cut, the default) or greedy (the painter alone)."),
    fuse: bool = typer.Option(True, "--fuse/--no-fuse",
                              help="Fuse decomposed LayerNorm/RMSNorm/tanh-GELU into fused ops that run low "
                                   "precision safely (default), or keep them as FP32 islands."),
    inline_functions: bool = typer.Option(True, "--inline-functions/--no-inline-functions",
                                          help="Inline model-local functions so what they compute is rewritten "
                                               "too (default), or keep their calls, and their bodies, FP32."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing output file."),
    report: List[Path] = typer.Option([], "--report", parser=_file_path, metavar="<path>",
                                      help="Write the report (.json, .html or .md; repeatable)."),
    explain: Optional[str] = typer.Option(None, "--explain", help="Explain one node's precision; writes no model."),
    check: bool = typer.Option(False, "--check", help="Run FP32 and rewritten models and compare outputs."),
    tolerance: Optional[float] = typer.Option(None, "--tolerance",
                                              help="Relative error allowed by --check (default: 1e-2 for fp16, "
                                                   "5e-2 for bf16)."),
    inputs: Optional[Path] = typer.Option(None, "--inputs", parser=_path, metavar="<path>", help="Inputs for --check (.npz)."),
    auto_fp32: bool = typer.Option(False, "--auto-fp32", help="Pin nodes FP32 (a bisected run in graph order) until --check passes."),
    training: bool = typer.Option(False, "--training", help="Training graph: FP32 master weights, loss scaling."),
    loss_scaling: Optional[bool] = typer.Option(None, "--loss-scaling/--no-loss-scaling",
                                                help="Training: add loss-scale nodes (default: on for fp16, off "
                                                     "for bf16)."),
    loss: Optional[str] = typer.Option(None, "--loss", help="Training: name of the loss output."),
    grads: Optional[str] = typer.Option(None, "--grads", help="Training: gradient outputs to unscale: globs, comma-separated, or one re:regex."),
    quiet: bool = typer.Option(False, "-q", "--quiet", help="Print nothing but errors."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks and verify the IR after every pass."),
    version: bool = typer.Option(False, "--version", is_eager=True, callback=_print_version,
                                 help="Print the version and exit."),
) -> None:
    """Rewrite an FP32 ONNX model to mixed precision: heavy math in FP16/BF16, fragile parts in FP32."""
    from . import commands

    commands.run(commands.CliArgs(**{k: v for k, v in locals().items() if k not in ("commands", "version")}))



def main(argv: list[str] | None = None) -> int:
    """Run the command, with a SIGTERM (a job scheduler's, ``timeout``'s, ``kill``'s) handled like
    Ctrl-C: temporary files and the files ``--overwrite`` set aside are cleaned up, not left."""
    terminated: list[int] = []

    def on_sigterm(signum, frame) -> None:
        terminated.append(signum)
        raise KeyboardInterrupt

    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, on_sigterm)
    stdout = sys.stdout
    sys.stdout = _ReaderMayLeave(stdout)
    try:
        code = _main(argv)
    finally:
        sys.stdout.flush()  # (through the wrapper: a reader gone since the last line is no error either)
        sys.stdout = stdout
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return TERMINATED if terminated and code == INTERRUPTED else code


class _ReaderMayLeave:
    """stdout whose reader may stop reading (``amp-rewrite m.onnx | head -3``): the summary, the
    ``--check`` table and ``--explain`` are for reading, so a closed pipe ends the printing, not the
    command. The rest goes to the null device; the model is written and the exit code is the
    work's, as if every line had been read. (Without this, click ended the run with exit 1 and no
    message at the first line that met the closed pipe: before the output was written, or after.)"""

    def __init__(self, stream) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._to_null()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._to_null()

    def _to_null(self) -> None:
        null = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(null, self._stream.fileno())
        finally:
            os.close(null)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def _interrupted() -> str:
    from .commands import COMMITTED

    if COMMITTED:  # (the interrupt came after the output was written and kept)
        return f"amp-rewrite: interrupted after writing {', '.join(str(p) for p in COMMITTED)}"
    return "amp-rewrite: interrupted; no output was written"


def _main(argv: list[str] | None) -> int:
    from .commands import COMMITTED

    COMMITTED.clear()  # (main() may run more than once in a process)
    debug = "--debug" in (argv if argv is not None else sys.argv[1:])
    try:
        code = app(args=argv, prog_name="amp-rewrite", standalone_mode=False)
        # typer turns a KeyboardInterrupt into Exit(130), which click, not standalone, returns
        if code == INTERRUPTED:
            raise KeyboardInterrupt
    except AmpRewriteError as exc:
        if debug:  # the traceback instead of the line; the exit code stays the documented one
            traceback.print_exc()
        else:
            print(f"amp-rewrite: error: {_one_line(exc.message)}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(_interrupted(), file=sys.stderr)
        return INTERRUPTED
    except SystemExit as exc:
        return int(exc.code or 0) if not isinstance(exc.code, str) else 1
    except Exception as exc:  # click's usage errors and anything unforeseen
        from ._console import interrupted_import

        if interrupted_import(exc):  # (an import the Ctrl-C landed in: numpy's wraps it in ImportError)
            print(_interrupted(), file=sys.stderr)
            return INTERRUPTED
        click_errors, click_aborts = _click_exception_types()
        if isinstance(exc, click_errors):
            # one line, like every other failure (click's own show() prints usage over 3 lines)
            hint = "; see amp-rewrite --help" if exc.exit_code == 2 else ""
            message = " ".join(exc.format_message().split()).rstrip(".")
            print(f"amp-rewrite: error: {message}{hint}", file=sys.stderr)
            return exc.exit_code
        if isinstance(exc, click_aborts):
            if isinstance(exc.__cause__, KeyboardInterrupt):  # (click's own spelling of Ctrl-C)
                print(_interrupted(), file=sys.stderr)
                return INTERRUPTED
            return 1
        if debug:
            traceback.print_exc()
        else:
            print(f"amp-rewrite: internal error: {type(exc).__name__}: {_one_line(str(exc))} (rerun with --debug "
                  f"for the traceback and please report it)", file=sys.stderr)
        return INTERNAL_ERROR
    return 0


def _one_line(message: str) -> str:
    """Failures are one line on stderr; extra lines (e.g. the verifier's node context) need --debug."""
    lines = [line for line in message.strip().splitlines() if line.strip()]
    if len(lines) <= 1:
        return lines[0] if lines else message
    return f"{lines[0]} (rerun with --debug for details)"


def _click_exception_types() -> tuple[tuple[type, ...], tuple[type, ...]]:
    """Typer >= 0.20 raises its vendored click's exceptions (typer._click), older ones click's."""
    errors: list[type] = []
    aborts: list[type] = []
    for module in ("click.exceptions", "typer._click.exceptions", "typer.exceptions"):
        try:
            mod = __import__(module, fromlist=["ClickException"])
        except ImportError:
            continue
        errors.extend([mod.ClickException] if hasattr(mod, "ClickException") else [])
        aborts.extend([mod.Abort] if hasattr(mod, "Abort") else [])
    return tuple(errors), tuple(aborts)
