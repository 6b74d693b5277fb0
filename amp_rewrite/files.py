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


def stage_beside(dst: Path) -> Path:
    """A fresh hidden folder beside ``dst`` for a command that checks its output before keeping it
    (``--check``, ``--auto-fp32``): the output is written there, checked there, and only then
    moved to ``dst`` (:func:`publish`), so ``dst`` never names an unchecked model, even when the
    process is killed during the check (an OOM kill while onnxruntime runs a large model left the
    failing model at ``dst`` and the earlier output under a hidden name). Its name carries the
    process id, so a later command can tell a leftover of a killed one (:func:`remove_stale_stages`)."""
    import tempfile

    remove_stale_stages(dst.parent)
    return Path(tempfile.mkdtemp(prefix=stage_prefix(), dir=dst.parent))


STAGE_PREFIX = ".amp-rewrite-"


def stage_prefix() -> str:
    """``.amp-rewrite-<pid>-<host>-``: a temporary folder's name says which process on which
    machine made it (a folder shared between machines holds others' live ones)."""
    import socket
    import zlib

    return f"{STAGE_PREFIX}{os.getpid()}-{zlib.crc32(socket.gethostname().encode()):08x}-"


def publish(staged: list[Path], folder: Path, *, overwrite: bool, reserved: set[Path] = frozenset()) -> list[Path]:
    """Move the files of a stage into ``folder`` under their names, the model (the last) after its
    data file, each in one rename; inside :func:`previous_outputs_kept` the files they replace are
    kept until the command succeeds. ``reserved``: files that must not be replaced (the input's
    external data). Returns the paths written."""
    from .errors import OutputError

    finals = [folder / path.name for path in staged]
    for path, final in zip(staged, finals):
        if final.resolve() in reserved:
            raise OutputError(f"{final}: would overwrite the input's external data; choose another -o")
        if path is not staged[-1] and (final.exists() or final.is_symlink()) and not overwrite:
            raise OutputError(f"{final}: already exists (the output's external data goes there); pass "
                              f"--overwrite to replace it, or choose another -o")
    try:
        for path, final in zip(staged, finals):
            replace_into(path, final)
    except OSError as exc:
        raise OutputError(f"{finals[-1]}: writing failed ({exc.strerror or exc}); nothing was left behind") from exc
    return finals


def remove_stale_stages(folder: Path) -> None:
    """Remove the stages (and the emitter's temporary folders) of commands killed in ``folder``:
    hidden ``.amp-rewrite-<pid>-*`` folders whose process is gone. They hold partial or unchecked
    outputs only (never a previous output: that is kept by a hard link beside it), up to a model's
    size each."""
    try:
        entries = list(folder.iterdir())
    except OSError:
        return
    host = stage_prefix().split("-")[-2]
    for entry in entries:
        pid, _, rest = entry.name[len(STAGE_PREFIX):].partition("-")
        if not entry.name.startswith(STAGE_PREFIX) or not pid.isdigit() or not rest.startswith(host + "-") \
                or not entry.is_dir() or entry.is_symlink() or _alive(int(pid)):
            continue
        shutil.rmtree(entry, ignore_errors=True)


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # (another user's process: alive)
        return True
    return True
