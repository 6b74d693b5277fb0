"""Progress bars for long work (loading and saving large models, running checks).

Bars go to stderr and only when stderr is a terminal: piped or captured output (CI logs, tests,
``2> file``) stays clean. They also stay hidden for work that finishes quickly (``delay``), and
``-q``/``disable()`` or ``AMP_REWRITE_NO_PROGRESS=1`` turns them off altogether.

    with progress.stages(["load", "rewrite", "save"], desc=path.name) as stage:
        stage("load"); ...
        stage("rewrite"); ...

    for name in progress.bar(outputs, desc="comparing outputs"):
        ...
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import time
from typing import Any, Callable, Iterable, Iterator, Sequence, TextIO, TypeVar

T = TypeVar("T")
DELAY_S = 0.5  # work shorter than this never shows a bar
ENV_OFF = "AMP_REWRITE_NO_PROGRESS"

_disabled = False


def disable(flag: bool = True) -> None:
    """Turn bars off for the rest of the process (the CLI calls this for ``--quiet``)."""
    global _disabled
    _disabled = flag


def enabled(stream: TextIO | None = None) -> bool:
    """Whether a bar would be shown on ``stream`` (stderr by default)."""
    stream = stream if stream is not None else sys.stderr
    if _disabled or os.environ.get(ENV_OFF, "") not in ("", "0"):
        return False
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except (ValueError, OSError):  # closed or detached stream
        return False


def _width(stream: TextIO | None) -> dict[str, Any]:
    """Follow the terminal's size; one that reports 0×0 (a fresh pty: tqdm would print nothing
    there) gets 80×24."""
    try:
        size = os.get_terminal_size((stream or sys.stderr).fileno())
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
        size = os.terminal_size((0, 0))
    if size.columns > 0 and size.lines > 0:
        return {"dynamic_ncols": True}
    return {"ncols": size.columns or 80, "nrows": size.lines or 24}


def bar(iterable: Iterable[T], *, desc: str = "", total: int | None = None, unit: str = "it",
        stream: TextIO | None = None, **kwargs: Any) -> Iterable[T]:
    """``iterable`` wrapped in a tqdm bar when a terminal shows it, else returned unchanged."""
    if not enabled(stream):
        return iterable
    from tqdm.auto import tqdm

    return tqdm(iterable, desc=desc, total=total, unit=unit, file=stream or sys.stderr, delay=DELAY_S,
                leave=False, **_width(stream), **kwargs)


@contextlib.contextmanager
def stages(names: Sequence[str], *, desc: str = "", stream: TextIO | None = None) -> Iterator[Callable[[str], None]]:
    """A bar over named stages; call the yielded function with each stage's name as it starts."""
    if not enabled(stream):
        yield lambda name: None
        return
    from tqdm.auto import tqdm

    t = tqdm(total=len(names), desc=desc, unit="step", file=stream or sys.stderr, delay=DELAY_S, leave=False,
             bar_format="{desc}: {n_fmt}/{total_fmt} {postfix} [{elapsed}]", **_width(stream))
    started: list[str] = []

    def stage(name: str) -> None:
        if started:
            t.update(1)
        started.append(name)
        t.set_postfix_str(name, refresh=False)
        # Shown at once only past the delay, as tqdm's update shows it: a forced refresh drew quick
        # work's bar, which close() then left on the terminal (it clears only what it counts as shown).
        now = time.time()
        if now - t.start_t >= DELAY_S:
            t.refresh()
            t.last_print_t = now

    try:
        yield stage
        if started:
            t.update(1)
    finally:
        t.close()


@contextlib.contextmanager
def bytes_bar(total: int, *, desc: str = "", stream: TextIO | None = None) -> Iterator[Callable[[int], None]]:
    """A byte-counting bar (reading or writing large files); yields ``advance(nbytes)``."""
    if not enabled(stream) or total <= 0:
        yield lambda n: None
        return
    from tqdm.auto import tqdm

    t = tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, file=stream or sys.stderr,
             delay=DELAY_S, leave=False, **_width(stream))
    try:
        yield t.update
    finally:
        t.close()
