"""amp-rewrite: automatic mixed precision as a compiler pass.

Public API (everything else is private and may change):

- :func:`rewrite` — an ``onnx.ModelProto`` or a torch ``nn.Module``/``GraphModule`` → rewritten model
- :func:`rewrite_onnx` — ONNX file → ONNX file (external data, atomic writes)
- :func:`load_rules` — build a :class:`RuleBook` from the built-in and user rule files
- :class:`Report` — the cast placement report (text / JSON / HTML / Markdown)
- :class:`LossScaler` — dynamic loss scaling for training (torch)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .errors import AmpRewriteError

if TYPE_CHECKING:  # (loaded lazily at run time, below; type checkers and IDEs see the real names)
    from .api import RewriteResult, rewrite, rewrite_onnx
    from .report import Report
    from .rulebook import RuleBook
    from .training import LossScaler

__version__ = "0.1.0"

__all__ = ["rewrite", "rewrite_onnx", "load_rules", "Report", "LossScaler", "RewriteResult", "AmpRewriteError",
           "__version__"]


def load_rules(*args: Any, **kwargs: Any) -> "RuleBook":
    """See :func:`amp_rewrite.rulebook.load_rules`."""
    from .rulebook import load_rules as _load_rules

    return _load_rules(*args, **kwargs)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


def __getattr__(name: str) -> Any:
    # Lazy too: the api pulls in numpy, networkx and onnx-ir (~0.2 s), which the console script
    # imports only once its Ctrl-C handling is in place (amp_rewrite._console).
    if name in ("rewrite", "rewrite_onnx", "RewriteResult"):
        from . import api

        return getattr(api, name)
    # Lazy: Report pulls in renderers, LossScaler pulls in torch; `amp-rewrite model.onnx` needs neither.
    if name == "Report":
        from .report import Report

        return Report
    if name == "LossScaler":
        from .training import LossScaler

        return LossScaler
    raise AttributeError(f"module 'amp_rewrite' has no attribute {name!r}")
