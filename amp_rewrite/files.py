"""Writing outputs: a file is replaced in one rename, and, inside a command that may still fail
after writing, the file it replaced is kept until the command has succeeded. (No framework
imports: the CLI and the report writer use it too.)"""

from __future__ import annotations

import contextlib
import contextvars
import os
import shutil
from pathlib import Path


def ordinary_mode(path: str | os.PathLike) -> None:
    """Give a file made by ``tempfile.mkstemp`` (mode 0600) the mode any new file gets under the umask."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


_KEPT: contextvars.ContextVar[list | None] = contextvars.ContextVar("amp_rewrite_kept", default=None)


@contextlib.contextmanager
def previous_outputs_kept():
    """For a command that may still fail after writing its model (a failed ``--check``, bad
    ``--inputs``, an unwritable report): every file a write inside replaces is set aside (renamed in
    its folder) at the moment it is replaced, not before, so the input is read as it is. On failure
    the command's own outputs go and the previous files come back; on success they are dropped, or,
    nested in another such block (a model and its data file written as a pair inside a command),
    handed to the outer one. Yields the list the command adds its written paths to."""
    outer = _KEPT.get()
    kept: list[tuple[Path, Path]] = []
    written: list[Path] = []
    token = _KEPT.set(kept)
    try:
        yield written
    except BaseException:
        for path in written:
            Path(path).unlink(missing_ok=True)
        for dst, aside in reversed(kept):
            os.replace(aside, dst)
        raise
    else:
        if outer is not None:
            outer.extend(kept)
        else:
            for _, aside in kept:
                aside.unlink(missing_ok=True)
    finally:
        _KEPT.reset(token)


def replace_into(tmp: Path, dst: Path) -> None:
    """``os.replace(tmp, dst)``; inside :func:`previous_outputs_kept`, the file at ``dst`` is kept
    aside as well: a second name for it (a hard link, a copy where the file system has none), made
    before the replacing rename, so ``dst`` names a whole file at every moment. (Renaming it aside
    first left a window with no file at ``dst``: a reader, or a kill -9, met none there.)"""
    kept = _KEPT.get()
    if kept is not None and dst.is_file():
        # (the name's first 64 bytes: a name near the file system's limit has no room for the suffix)
        head = dst.name.encode()[:64].decode(errors="ignore")
        aside = dst.with_name(f".{head}.amp-rewrite-previous-{os.getpid()}-{id(kept):x}-{len(kept)}")
        try:
            os.link(dst, aside)
        except OSError:  # (no hard links here: FAT, some network mounts)
            shutil.copy2(dst, aside)
        kept.append((dst, aside))
    os.replace(tmp, dst)
