"""What the CLI does with its arguments: calls the API and prints. Kept apart from cli.py so the
argument parser stays declarative."""

from __future__ import annotations

import contextlib
import math
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from .errors import OutputError, UsageError


@dataclass
class CliArgs:
    model: Path
    output: Optional[Path] = None
    target: str = "fp16"
    rules: list[Path] = field(default_factory=list)
    keep_io_types: bool = True
    fp32_nodes: list[str] = field(default_factory=list)
    fp16_nodes: list[str] = field(default_factory=list)
    fp32_ops: list[str] = field(default_factory=list)
    fp16_ops: list[str] = field(default_factory=list)
    placement: str = "optimal"
    fuse: bool = True
    inline_functions: bool = True
    overwrite: bool = False
    report: list[Path] = field(default_factory=list)  # one file per format asked for (repeatable)
    explain: Optional[str] = None
    check: bool = False
    tolerance: Optional[float] = None  # None: the target's default (check.DEFAULT_TOLERANCE)
    inputs: Optional[Path] = None
    auto_fp32: bool = False
    training: bool = False
    loss: Optional[str] = None
    grads: Optional[str] = None
    loss_scaling: Optional[bool] = None
    quiet: bool = False
    debug: bool = False

    def options(self) -> dict:
        return dict(target=self.target, rules=[str(r) for r in self.rules], keep_io_types=self.keep_io_types,
                    fp32_nodes=self.fp32_nodes, fp16_nodes=self.fp16_nodes, fp32_ops=_split(self.fp32_ops, "--fp32-ops"),
                    fp16_ops=_split(self.fp16_ops, "--fp16-ops"), placement=self.placement, verify_each=self.debug,
                    fuse=self.fuse, inline_functions=self.inline_functions)

    def output_path(self) -> Path:
        """Where the model goes: -o, else the default the API picks next to the input."""
        from .api import default_output

        return self.output if self.output is not None else default_output(
            self.model, self.target, ".train" if self.training else "")


def _split(ops: list[str], flag: str) -> list[str]:
    """``--fp32-ops A,B`` as well as ``--fp32-ops A --fp32-ops B`` (op names hold no commas). An
    empty name (``--fp32-ops ''``, ``A,,B``) is a mistake, not nothing: it is refused, as an empty
    node pattern is."""
    from .errors import UsageError

    names = []
    for item in ops:
        parts = [op.strip() for op in item.split(",")]
        if not all(parts):
            raise UsageError(f"{flag}: empty op name in {item!r}")
        names += parts
    return names


# the files this process's command wrote and kept: an interrupt after that point (while the summary
# is printed) said "no output was written" with the output complete on disk
COMMITTED: list[Path] = []


def say(args: CliArgs, text: str) -> None:
    if not args.quiet:
        print(text)


def run(args: CliArgs) -> None:
    _validate(args)
    if args.quiet:
        from . import progress

        progress.disable()
    if args.explain is not None:
        from .explain import explain_node

        print(explain_node(args.model, args.explain, **args.options()))  # (asked for: printed under -q too)
        return
    from .files import previous_outputs_kept

    with previous_outputs_kept() as written, _staged(args) as stage:
        if args.training:
            from .training_onnx import rewrite_training_cli

            result = rewrite_training_cli(args)
        elif args.auto_fp32:
            from .check import auto_fp32_cli

            result = auto_fp32_cli(args)
        else:
            from .api import rewrite_onnx

            if stage is None:
                result = rewrite_onnx(args.model, args.output, overwrite=args.overwrite, **args.options())
            else:  # (--check: written and checked in the stage, then moved into place)
                result = rewrite_onnx(args.model, stage / args.output_path().name, overwrite=True, **args.options())
        if stage is None:
            written.extend(result.outputs)
        report = result.report
        if not result.modified:
            report.log.notes.append("nothing to rewrite: no FP32 op that the rules and safety checks let run in low "
                                    "precision; the output is a copy of the input")
        if args.check and not args.auto_fp32:
            from .check import check_cli

            check_cli(args, result, report)
        if stage is not None:
            result.outputs = publish_stage(args, result.outputs)
            written.extend(result.outputs)
            report.output = str(result.outputs[-1])
        if args.report:
            from .report import write_report

            # one set with the model: a report that fails takes the ones written before it with it
            # and puts back the files they replaced
            with previous_outputs_kept() as reports:
                for path in args.report:
                    write_report(report, path)
                    reports.append(path)
    COMMITTED.extend(written)  # (kept from here on: an interrupt now must not say nothing was written)
    say(args, report.summary_text())
    if not result.modified:
        say(args, "nothing to rewrite: the model has no FP32 op that the rules and safety checks let run in low "
                  "precision")
    if args.report:
        say(args, f"report: {', '.join(map(str, args.report))}")


def _validate(args: CliArgs) -> None:
    if args.target not in ("fp16", "bf16"):
        raise UsageError(f"--target {args.target!r}: choose fp16 or bf16")
    if args.placement not in ("greedy", "optimal"):
        raise UsageError(f"--placement {args.placement!r}: choose greedy or optimal")
    from .api import check_input_path
    from .report_render import RENDERED_SUFFIXES

    check_input_path(args.model)  # (a missing model first: before anything about the outputs)
    for report in args.report:
        if report.suffix.lower() not in (".json", *RENDERED_SUFFIXES):
            raise UsageError(f"--report {report}: the format comes from the extension: .json, .html (.htm) or "
                             f".md (.markdown)")
    for path, error, option in (*((r, OutputError, "--report") for r in args.report),
                                (args.inputs, UsageError, "--inputs")):
        try:
            if path is not None:
                path.stat()
        except FileNotFoundError:
            pass
        except OSError as exc:  # (a name too long, a loop of links: exists() raises those on Python 3.11)
            raise error(f"{option} {path}: cannot be opened ({exc.strerror or exc})") from None
    seen: dict[Path, Path] = {}
    for report in args.report:
        if not report.parent.is_dir():
            # checked before any work: failing after the model is written would leave a stray output
            raise OutputError(f"--report {report}: folder {report.parent} does not exist")
        if not os.access(report.parent, os.W_OK):
            raise OutputError(f"--report {report}: folder {report.parent} is not writable")
        first = seen.setdefault(report.resolve(), report)
        if first is not report:
            raise UsageError(f"--report {report}: given twice (as {first} too); give each file once")
    if (args.loss or args.grads or args.loss_scaling is not None) and not args.training:
        raise UsageError("--loss, --grads and --loss-scaling/--no-loss-scaling need --training")
    if args.training and not args.loss:
        raise UsageError("--training needs --loss NAME (the graph output holding the loss)")
    if (args.inputs is not None or args.tolerance is not None) and not (args.check or args.auto_fp32):
        raise UsageError("--inputs and --tolerance apply to --check and --auto-fp32; add --check")
    if args.auto_fp32 and args.training:
        raise UsageError("--auto-fp32 does not apply to --training graphs; run --check on the training rewrite instead")
    if args.explain is not None and args.report:
        raise UsageError("--explain prints one node's reasons and writes nothing; drop --report (or --explain)")
    if args.explain is not None and args.training:
        # (it would explain the inference rewrite: the training plan pins the loss tail FP32)
        raise UsageError("--explain explains the inference rewrite, not the training one; drop --explain and "
                         "add --report FILE: the report gives every node's decision and reason")
    if args.explain is not None and (args.check or args.auto_fp32):
        raise UsageError("--explain prints one node's reasons and runs nothing; drop --check/--auto-fp32 "
                         "(or --explain)")
    if args.inputs is not None and not args.inputs.exists():
        raise UsageError(f"--inputs {args.inputs}: no such file")
    if args.inputs is not None and not args.inputs.is_file():  # (a FIFO blocked the read; <(cat f) is read twice)
        raise UsageError(f"--inputs {args.inputs}: is not a regular file (a pipe, a device or a folder); save the "
                         f"arrays to an .npz file")
    _refuse_writing_what_is_read(args)
    if args.tolerance is not None and (not math.isfinite(args.tolerance) or args.tolerance <= 0):
        raise UsageError(f"--tolerance {args.tolerance}: must be a positive number")
    if args.tolerance is None and (args.check or args.auto_fp32):
        from .check import default_tolerance

        args.tolerance = default_tolerance(args.target)
    for given in args.report if args.explain is None else ():
        from .frontends.onnx_loader import external_data_files

        report, model, output = given.resolve(), args.model.resolve(), args.output_path().resolve()
        if report in (model, output):
            which = "the input model" if report == model else "the output model"
            raise OutputError(f"--report {given}: is {which}; choose another report path")
        if given.is_dir():
            raise OutputError(f"--report {given}: is a directory")
        if given.exists() and not given.is_file():  # (--overwrite would put a file in place of a device)
            raise OutputError(f"--report {given}: is not a regular file (a device or a pipe); give a file path")
        # (external data is read next to the path given: a symlinked model reads it beside the link)
        folders = {model.parent, args.model.absolute().parent.resolve()}
        if given.exists() and folders & set(report.parents) and report in external_data_files(args.model):
            raise OutputError(f"--report {given}: is a file the input model reads its external data from; "
                              f"choose another report path")
        if given.exists() and not args.overwrite:
            raise OutputError(f"--report {given}: already exists; pass --overwrite to replace it")


def _refuse_writing_what_is_read(args) -> None:
    """-o or --report naming a file the command reads besides the model (a rule file, the --inputs
    arrays): with --overwrite the rule file was replaced by the model, and the arrays by the
    output before --check read them."""
    read = [(r, "--rules") for r in args.rules] + ([(args.inputs, "--inputs")] if args.inputs is not None else [])
    written = [(args.output_path(), "-o")] + ([] if args.explain is not None else [(r, "--report") for r in args.report])
    for out, flag in written:
        for given, option in read:
            try:
                same = given.exists() and out.exists() and out.resolve() == given.resolve()
            except OSError:  # (a name too long, a loop of links: the file's own check says so)
                same = False
            if same:
                raise OutputError(f"{flag} {out}: is the {option} file this command reads; choose another path")


@contextlib.contextmanager
def _staged(args: CliArgs):
    """The stage a --check rewrite is written to and checked in before it takes its place (None
    without --check, or for --training and --auto-fp32, which place their own); removed after."""
    if not args.check or args.training or args.auto_fp32:
        yield None
        return
    with _staged_check(args) as stage:
        yield stage


@contextlib.contextmanager
def _staged_check(args: CliArgs):
    from .api import _check_output, default_output
    from .files import stage_beside

    dst = args.output_path()
    _check_output(args.model, dst, args.overwrite, default_output(args.model, args.target).name)
    stage = stage_beside(dst)
    try:
        yield stage
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def publish_stage(args, staged: list[Path]) -> list[Path]:
    """Move a checked rewrite from its stage to the output's folder (see :func:`files.stage_beside`)."""
    from .files import publish
    from .frontends.onnx_loader import external_data_files

    return publish(staged, args.output_path().parent, overwrite=args.overwrite,
                   reserved=external_data_files(args.model))
