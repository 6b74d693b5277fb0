"""The cast placement report: built from the decision log, rendered as a terminal summary or JSON.

Every number in it is derived from ``DecisionLog`` records, so the same report can be rebuilt
from the ``amp_rewrite.*`` tags the emitter leaves in the output model.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from .decisions import Category, DecisionLog, Precision
from .passes.islands import describe

SCHEMA_VERSION = "1.0"
HEAVY_OPS = {"MatMul", "Gemm", "Conv", "ConvTranspose", "Einsum", "com.microsoft::Attention",
             "com.microsoft::MultiHeadAttention", "Attention", "linear", "matmul", "mm", "bmm", "addmm", "conv1d",
             "conv2d", "conv3d", "baddbmm", "scaled_dot_product_attention"}


@dataclass
class Report:
    log: DecisionLog
    source: str | None = None
    output: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_log(cls, log: DecisionLog, *, source: str | None = None, output: str | None = None) -> "Report":
        return cls(log=log, source=source, output=output)

    # -- numbers --------------------------------------------------------------------------------------
    @property
    def precision_counts(self) -> dict[str, int]:
        counts = Counter()
        for d in self.log.decisions.values():
            counts[_precision_name(d.precision, self.log.target)] += 1
        return dict(sorted(counts.items()))

    @property
    def casts_inserted(self) -> int:
        return sum(1 for c in self.log.casts if c.kind == "inserted")

    @property
    def heavy_ops(self) -> dict[str, Any]:
        """MatMul/Gemm/Conv/attention: how many run low, and why the others do not."""
        heavy = [d for d in self.log.decisions.values() if d.op in HEAVY_OPS]
        low = [d for d in heavy if d.precision == Precision.LOW]
        kept = [{"node": d.node, "op": d.op, "reason": d.reason} for d in heavy if d.precision != Precision.LOW]
        return {"total": len(heavy), "low": len(low), "kept_fp32": kept}

    def summary(self) -> dict[str, Any]:
        w = self.log.weights
        return {
            "target": self.log.target,
            "nodes": self.precision_counts,
            "casts_inserted": self.casts_inserted,
            "casts_retargeted": sum(1 for c in self.log.casts if c.kind == "retargeted"),
            "casts_removed": sum(1 for c in self.log.casts if c.kind == "removed"),
            "cast_bytes_per_run": sum(c.bytes_per_run or 0 for c in self.log.casts if c.kind == "inserted"),
            "islands": len(self.log.islands),
            "heavy_ops": self.heavy_ops,
            "weights": {"bytes_before": w.bytes_before, "bytes_after": w.bytes_after, "converted": w.converted,
                        "clamped": w.clamped, "flushed_to_zero": w.flushed_to_zero, "duplicated": w.duplicated,
                        "sentinels": w.sentinels},
            "unlisted_ops": dict(sorted(self.log.unlisted_ops.items())),
        }

    # -- renderers --------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "source": self.source,
            "output": self.output,
            "summary": self.summary(),
            "nodes": [_decision_dict(d) for d in self.log.decisions.values()],
            "casts": [{**asdict(c), "shape": list(c.shape) if c.shape is not None else None,
                       "bytes_per_run": c.bytes_per_run} for c in self.log.casts],
            "islands": [{**asdict(i), "description": describe(i)} for i in self.log.islands],
            "notes": list(self.log.notes),
            **self.extra,
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, default=str)

    def summary_text(self) -> str:
        s = self.summary()
        low = self.log.target
        lines = []
        nodes = ", ".join(f"{n} {k}" for k, n in s["nodes"].items())
        lines.append(f"nodes: {nodes or 'none'}")
        heavy = s["heavy_ops"]
        if heavy["total"]:
            lines.append(f"MatMul/Gemm/Conv/attention in {low}: {heavy['low']} of {heavy['total']}")
            for k in heavy["kept_fp32"][:10]:
                lines.append(f"  kept FP32: {k['node']} ({k['op']}): {k['reason']}")
        lines.append(f"casts inserted: {s['casts_inserted']} ({_bytes(s['cast_bytes_per_run'])} per run where shapes are known)"
                     + (f", retargeted: {s['casts_retargeted']}" if s["casts_retargeted"] else "")
                     + (f", removed: {s['casts_removed']}" if s["casts_removed"] else ""))
        lines.append(f"FP32 islands: {s['islands']}")
        for island in self.log.islands[:8]:
            lines.append(f"  island {island.id}: {describe(island)} (seeded by {', '.join(island.seeds[:3]) or '-'})")
        if len(self.log.islands) > 8:
            lines.append(f"  ... {len(self.log.islands) - 8} more (see --report)")
        w = s["weights"]
        lines.append(f"weights: {_bytes(w['bytes_before'])} → {_bytes(w['bytes_after'])} "
                     f"({w['converted']} converted, {w['clamped']} values clamped at ±65504, "
                     f"{w['flushed_to_zero']} flushed to zero)" if low == "fp16" else
                     f"weights: {_bytes(w['bytes_before'])} → {_bytes(w['bytes_after'])} ({w['converted']} converted)")
        for sentinel in w["sentinels"][:5]:
            lines.append(f"  sentinel constants in {sentinel['tensor']}: {sentinel['count']} values in "
                         f"[{sentinel['min']:.3g}, {sentinel['max']:.3g}] (masks?)")
        if s["unlisted_ops"]:
            ops = ", ".join(f"{op} ×{n}" for op, n in s["unlisted_ops"].items())
            lines.append(f"unlisted ops kept FP32: {ops} — classify them in a rule file (--rules, see rules/README.md)")
        if self.output:
            lines.append(f"output: {self.output}")
        return "\n".join(lines)


def _precision_name(p: Precision, target: str) -> str:
    return {Precision.LOW: target, Precision.FP32: "fp32", Precision.NONE: "unchanged"}[p]


def _decision_dict(d) -> dict[str, Any]:
    return {"node": d.node, "op": d.op, "category": d.category.value if isinstance(d.category, Category) else d.category,
            "precision": d.precision.value, "reason": d.reason, "source": d.source, "step": d.step, "via": d.via,
            "island": d.island}


def _bytes(n: int | None) -> str:
    if not n:
        return "0 B"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def write_report(report: Report, path) -> None:
    """Write ``report`` in the format its extension names, atomically."""
    import os
    import tempfile
    from pathlib import Path

    from .errors import OutputError, UsageError

    path = Path(path)
    suffix = path.suffix.lower()
    if suffix == ".json":
        text = report.to_json()
    else:
        from . import report_render

        text = report_render.render(report, suffix)
        if text is None:
            raise UsageError(f"--report {path}: unknown format {suffix!r}; use .json, .html or .md")
    try:
        fd, tmp = tempfile.mkstemp(prefix=".amp-report-", dir=path.parent or ".")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError as exc:
        raise OutputError(f"{path}: cannot write the report ({exc.strerror or exc})") from exc
