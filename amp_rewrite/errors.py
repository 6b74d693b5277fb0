"""Error taxonomy. Every error a user can cause is an AmpRewriteError with an exit code and a
one-line message that says what to do; the CLI prints ``message`` and exits with ``exit_code``."""

from __future__ import annotations


class AmpRewriteError(Exception):
    """Base class. ``exit_code`` is what the CLI returns (see README, "Exit codes")."""

    exit_code = 1

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class UsageError(AmpRewriteError):
    """Bad command-line arguments or option values."""

    exit_code = 2


class ModelLoadError(AmpRewriteError):
    """The input is not a readable ONNX model (missing, not ONNX, truncated, missing external data)."""

    exit_code = 3


class RuleFileError(AmpRewriteError):
    """A rule file is invalid; the message names the file, the key and the closest valid value."""

    exit_code = 4

    def __init__(self, path: str, key: str, problem: str, suggestion: str | None = None) -> None:
        hint = f" (did you mean {suggestion!r}?)" if suggestion else ""
        super().__init__(f"{path}: {key}: {problem}{hint}")
        self.path = path
        self.key = key
        self.problem = problem
        self.suggestion = suggestion

    def __reduce__(self):  # (pickled from a worker process: rebuilt from its arguments, not the message)
        return type(self), (self.path, self.key, self.problem, self.suggestion)


class UnsupportedModelError(AmpRewriteError):
    """A valid model this tool cannot rewrite (IR version or opset out of range, ...)."""

    exit_code = 5


class InPlaceMutationError(UnsupportedModelError):
    """A torch graph mutates a tensor in place where casts would break the aliasing. ``finding``
    says what mutates what; the message adds the way out, which depends on how the graph came."""

    def __init__(self, finding: str, advice: str) -> None:
        super().__init__(f"{finding}. {advice}")
        self.finding = finding
        self.advice = advice

    def __reduce__(self):
        return type(self), (self.finding, self.advice)


class OutputError(AmpRewriteError):
    """The output cannot be written (exists without --overwrite, equals the input, unwritable)."""

    exit_code = 6


class VerificationError(AmpRewriteError):
    """An internal invariant failed after a pass: a bug in amp-rewrite, never the user's fault."""

    exit_code = 7


class CheckFailedError(AmpRewriteError):
    """--check found the rewritten model outside tolerance."""

    exit_code = 8


def first_line(exc: BaseException, limit: int | None = None) -> str:
    """The first line of an exception's message (its type's name when it has none), for one-line
    errors and notes that quote a library's failure; cut at ``limit`` characters if given."""
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:limit]
