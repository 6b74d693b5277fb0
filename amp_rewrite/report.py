"""The cast placement report: built from the decision log, rendered as a terminal summary, JSON,
HTML or Markdown (``report_render``).

Every number in it is derived from ``DecisionLog`` records, so the same report is rebuilt from
the ``amp_rewrite.*`` tags the emitter leaves in the output model (:meth:`Report.from_model`).
The JSON form follows ``amp_rewrite/data/report.schema.json`` (``schema_version`` below; see
docs/report.md).
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from .decisions import HEAVY_OPS, Category, Decision, DecisionLog, Precision  # noqa: F401 (HEAVY_OPS: re-exported)
from .passes.islands import describe

SCHEMA_VERSION = "1.4"
TENSOR_CORE_MULTIPLE = 8  # fp16/bf16 tensor cores want GEMM dims (M, N, K) and channels in multiples of 8
_PRECISIONS = ("fp16", "bf16", "fp32", "unchanged")


@dataclass
class Report:
    log: DecisionLog
    source: str | None = None
    output: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # "check": --check results (amp_rewrite.check)

    @classmethod
    def from_log(cls, log: DecisionLog, *, source: str | None = None, output: str | None = None) -> "Report":
        return cls(log=log, source=source, output=output)

    @classmethod
    def from_model(cls, model: Any) -> "Report":
        """Rebuild the report of a rewrite from its output model alone: a path, an
        ``onnx.ModelProto`` or an onnx-ir ``Model`` written by amp-rewrite."""
        from .frontends.onnx_tags import read_log

        log, path = read_log(model)
        return cls(log=log, output=path)

    # -- numbers --------------------------------------------------------------------------------------
    def precision_of(self, d: Decision) -> str:
        return _precision_name(d.precision, self.log.target)

    @property
    def precision_counts(self) -> dict[str, int]:
        counts = Counter(self.precision_of(d) for d in self.log.decisions.values())
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

    @property
    def sentinels(self) -> list[dict[str, Any]]:
        """Sentinel findings by tensor name (tensors converted at save time report in save order)."""
        return sorted(self.log.weights.sentinels, key=lambda s: s["tensor"])

    def alignment(self) -> list[dict[str, Any]]:
        """Tensor-core alignment of every low-precision MatMul/Gemm/Conv whose operand shapes were
        recorded: the GEMM/channel dims and which of them are not multiples of 8."""
        out = []
        for name, shapes in self.log.operand_shapes.items():
            d = self.log.decisions.get(name)
            if d is None or d.precision != Precision.LOW:
                continue
            dims = _tensor_core_dims(d.op, shapes)
            misaligned = [k for k, v in dims.items() if isinstance(v, int) and v % TENSOR_CORE_MULTIPLE]
            unknown = [k for k, v in dims.items() if not isinstance(v, int) and not _known_multiple(v)]
            status = "misaligned" if misaligned else "unknown" if unknown or not dims else "aligned"
            entry = {"node": name, "op": d.op, "shapes": shapes, "dims": dims, "misaligned": misaligned,
                     "status": status}
            if shapes and isinstance(shapes[-1], str):  # (an einsum's equation)
                entry["shapes"], entry["equation"] = shapes[:-1], shapes[-1]
            out.append(entry)
        return out

    def alignment_summary(self) -> dict[str, int]:
        counts = Counter(a["status"] for a in self.alignment())
        return {"checked": sum(counts.values()), "aligned": counts["aligned"], "misaligned": counts["misaligned"],
                "unknown": counts["unknown"]}

    def chain(self, node: str) -> list[Decision]:
        """The reason chain of ``node``: the node, the node its paint came from, and so on back to
        a node whose precision comes from a rule entry (the last element)."""
        out: list[Decision] = []
        seen: set[str] = set()
        current = self.log.decisions.get(node)
        while current is not None and current.node not in seen:
            out.append(current)
            seen.add(current.node)
            current = self.log.decisions.get(current.via) if current.via else None
        return out

    def _roots(self) -> dict[str, str]:
        """Each node's chain end (memoised: chains share tails, so this stays linear)."""
        roots: dict[str, str] = {}
        decisions = self.log.decisions
        for name in decisions:
            path = []
            current = name
            while current not in roots:
                d = decisions.get(current)
                if d is None or not d.via or d.via not in decisions or d.via in path or d.via == current:
                    roots[current] = current
                    break
                path.append(current)
                current = d.via
            for p in path:
                roots[p] = roots[current]
        return roots

    def summary(self) -> dict[str, Any]:
        w = self.log.weights
        return {
            "target": self.log.target,
            "nodes": self.precision_counts,
            "nodes_total": len(self.log.decisions),
            "casts_inserted": self.casts_inserted,
            "casts_retargeted": sum(1 for c in self.log.casts if c.kind == "retargeted"),
            "casts_removed": sum(1 for c in self.log.casts if c.kind == "removed"),
            "casts_fused": sum(f.casts for f in self.log.fusions),
            "cast_bytes_per_run": sum(c.bytes_per_run or 0 for c in self.log.casts if c.kind == "inserted"),
            "casts_unknown_size": sum(1 for c in self.log.casts if c.kind == "inserted" and c.bytes_per_run is None),
            "islands": len(self.log.islands),
            "fusions": len(self.log.fusions),
            "heavy_ops": self.heavy_ops,
            "alignment": self.alignment_summary(),
            "weights": {"bytes_before": w.bytes_before, "bytes_after": w.bytes_after, "converted": w.converted,
                        "converted_elements": w.converted_elements, "clamped": w.clamped,
                        "flushed_to_zero": w.flushed_to_zero, "duplicated": w.duplicated,
                        "sentinels": [_finite(s) for s in self.sentinels]},
            "unlisted_ops": dict(sorted(self.log.unlisted_ops.items())),
        }

    # -- renderers --------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        roots = self._roots()
        decisions = self.log.decisions
        return {
            "schema_version": SCHEMA_VERSION,
            "source": self.source,
            "output": self.output,
            "summary": self.summary(),
            "nodes": [_decision_dict(d, self.precision_of(d), roots.get(d.node, d.node), decisions)
                      for d in decisions.values()],
            "casts": [{**asdict(c), "shape": list(c.shape) if c.shape is not None else None,
                       "direction": f"{c.src}->{c.dst}", "bytes_per_run": c.bytes_per_run} for c in self.log.casts],
            "islands": [{**asdict(i), "description": describe(i),
                         "seed_rules": [{"node": s, "op": decisions[s].op if s in decisions else None,
                                         "source": decisions[s].source if s in decisions else None}
                                        for s in i.seeds]} for i in self.log.islands],
            "fusions": [asdict(f) for f in self.log.fusions],
            "alignment": self.alignment(),
            "io_changed": list(self.log.io_changed),
            "check": self.extra.get("check"),
            "notes": list(self.log.notes),
            **{k: v for k, v in self.extra.items() if k != "check"},
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, default=str, allow_nan=False)

    def summary_text(self) -> str:
        s = self.summary()
        low = self.log.target
        lines = []
        nodes = ", ".join(f"{n} {k}" for k, n in s["nodes"].items())
        lines.append(f"nodes: {nodes or 'none'}")
        heavy = s["heavy_ops"]
        if heavy["total"]:
            lines.append(f"MatMul/Gemm/Conv/attention in {low}: {heavy['low']} of {heavy['total']}")
            kept = heavy["kept_fp32"]
            for k in kept[:10]:
                lines.append(f"  kept FP32: {k['node']} ({k['op']}): {k['reason']}")
            if len(kept) > 10:
                lines.append(f"  kept FP32: {len(kept) - 10} more (--report FILE lists every node and its reason)")
        unknown = s.get("casts_unknown_size", 0)
        moved = (f"{_bytes(s['cast_bytes_per_run'])} per run" if not unknown else
                 "sizes unknown" if unknown == s["casts_inserted"] else
                 f"{_bytes(s['cast_bytes_per_run'])} per run, {unknown} of unknown size left out")
        lines.append(f"casts inserted: {s['casts_inserted']}" + (f" ({moved})" if s["casts_inserted"] else "")
                     + (f", retargeted: {s['casts_retargeted']}" if s["casts_retargeted"] else "")
                     + (f", removed: {s['casts_removed']}" if s["casts_removed"] else "")
                     + (f", fused away: {s['casts_fused']}" if s["casts_fused"] else ""))
        # --placement optimal: cast bytes and FP32 traffic per run at the default shapes, vs greedy's
        lines += [n for n in self.log.notes if n.startswith(("optimal placement", "dropped:", "unmatched:", "without effect:",
                                                                   "as given:", "as pinned:", "training:",
                                                                   "clamped sums:", "onnxruntime:",
                                                                   "model-local function", "untyped values",
                                                                   "corrected on load:"))]
        if self.log.fusions:
            fp32 = [f.node for f in self.log.fusions
                    if f.node in self.log.decisions and self.precision_of(self.log.decisions[f.node]) == "fp32"]
            lines.append(f"fused: {_fusion_counts(self.log.fusions)} ("
                         + (f"no FP32 island; now {low})" if not fp32 else
                            f"{len(self.log.fusions) - len(fp32)} now {low}, {len(fp32)} kept FP32: "
                            f"{', '.join(fp32[:3])}{' ...' if len(fp32) > 3 else ''})"))
        lines += [n for n in self.log.notes if n.startswith("not fused:")]
        lines.append(f"FP32 islands: {s['islands']}")
        for island in self.log.islands[:8]:
            lines.append(f"  island {island.id}: {describe(island)} (seeded by {', '.join(island.seeds[:3]) or '-'})")
        if len(self.log.islands) > 8:
            lines.append(f"  ... {len(self.log.islands) - 8} more (see --report)")
        w = s["weights"]
        limit = "65504" if low == "fp16" else "3.39e38"  # the low type's largest finite value
        lines.append(f"weights: {_bytes(w['bytes_before'])} → {_bytes(w['bytes_after'])} "
                     f"({w['converted']} converted, {w['clamped']} values clamped at ±{limit}, "
                     f"{w['flushed_to_zero']} flushed to zero)")
        for sentinel in self.sentinels[:5]:
            lines.append(f"  sentinel constants in {sentinel['tensor']}: {sentinel['count']} values in "
                         f"[{sentinel['min']:.3g}, {sentinel['max']:.3g}] (masks?)")
        al = s["alignment"]
        if al["misaligned"]:
            first = next(a for a in self.alignment() if a["status"] == "misaligned")
            dims = ", ".join(f"{k}={first['dims'][k]}" for k in first["misaligned"])
            lines.append(f"tensor cores: {al['misaligned']} of {al['checked']} {low} MatMul/Gemm/Conv have dims that "
                         f"are not multiples of {TENSOR_CORE_MULTIPLE} (e.g. {first['node']}: {dims})")
        if s["unlisted_ops"]:
            ops = ", ".join(f"{op} ×{n}" for op, n in s["unlisted_ops"].items())
            lines.append(f"unlisted ops kept FP32: {ops} — classify them in a rule file (--rules, see rules/README.md)")
        if self.log.io_changed:  # (the model's signature changed: its caller must follow)
            names = self.log.io_changed
            lines.append(f"graph inputs/outputs now {low}: {', '.join(names[:5])}{' ...' if len(names) > 5 else ''} "
                         f"(a caller feeds or reads them in {low})")
        if self.output:
            lines.append(f"output: {self.output}")
        # one line per item: a node named with a newline must not break the summary's lines
        return "\n".join(_CONTROL_CHARS.sub(lambda m: repr(m.group())[1:-1], line) for line in lines)


_CONTROL_CHARS = re.compile(r"[\x00-\x1f\x7f]")


def _fusion_counts(fusions) -> str:
    """'2 LayerNorm → SkipLayerNormalization, 1 tanh-GELU → FastGelu' (ops without their domain)."""
    counts: dict[tuple[str, str], int] = {}
    for f in fusions:
        key = (f.pattern, f.op.rsplit("::", 1)[-1])
        counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{n} {pattern} → {op}" for (pattern, op), n in counts.items())


def _precision_name(p: Precision | str, target: str) -> str:
    p = Precision(p)
    return {Precision.LOW: target, Precision.FP32: "fp32", Precision.NONE: "unchanged"}[p]


def _decision_dict(d: Decision, precision: str, root: str, decisions: dict[str, Decision]) -> dict[str, Any]:
    rule = decisions[root].source if root in decisions else d.source
    return {"node": d.node, "op": d.op, "category": d.category.value if isinstance(d.category, Category) else d.category,
            "precision": precision, "reason": d.reason, "source": d.source, "step": d.step, "via": d.via,
            "root": root, "rule": rule, "island": d.island}


# torch's GEMMs and convolutions, by the ONNX op whose dims they tile alike (the A and B operands
# recorded: addmm's mat1/mat2, baddbmm's batch1/batch2)
_TORCH_ALIGNMENT = {"matmul": "MatMul", "mm": "MatMul", "bmm": "MatMul", "addmm": "MatMul", "baddbmm": "MatMul",
                    "conv1d": "Conv", "conv2d": "Conv", "conv3d": "Conv", "conv_transpose1d": "ConvTranspose",
                    "conv_transpose2d": "ConvTranspose", "conv_transpose3d": "ConvTranspose"}


def _tensor_core_dims(op: str, shapes: list) -> dict[str, Any]:
    """The dims tensor cores tile, by name. Gemm's transA/transB are not recorded, so its dims are
    named by operand axis; every one of them is M, N or K either way. So are aten.convolution's
    weight axes (C_out and C_in/group, or the other way round when it is transposed)."""
    if op in ("Einsum", "einsum"):  # (its record carries the equation third)
        return _einsum_dims(shapes[2], shapes[:2]) if len(shapes) == 3 and isinstance(shapes[2], str) else {}
    a = shapes[0] if len(shapes) > 0 else None
    b = shapes[1] if len(shapes) > 1 else None
    name, op = op, _TORCH_ALIGNMENT.get(op, op)
    dims: dict[str, Any] = {}
    # (an operand of unknown shape leaves its dims unknown, not absent: absent, a MatMul reading a
    # Loop's output counted as aligned on its one known dim)
    if op == "MatMul":
        if a:
            if len(a) >= 2:
                dims["M"] = _product(a[:-1]) if _folds_batch(name, a, b) else a[-2]
            dims["K"] = a[-1]
        else:
            dims["M"] = dims["K"] = None
        if b and len(b) >= 2:
            dims["N"] = b[-1]
        elif not b:
            dims["N"] = None
    elif op == "linear":  # x [..., K] times weight [N, K]: one GEMM whose M is x's leading dims flattened
        if a:
            if len(a) >= 2:
                dims["M"] = _product(a[:-1])
            dims["K"] = a[-1]
        else:
            dims["M"] = dims["K"] = None
        dims["N"] = b[0] if b else None
    elif op == "Gemm":
        for label, shape in (("A", a), ("B", b)):
            for axis, size in enumerate(shape if shape else [None, None]):
                dims[f"{label}[{axis}]"] = size
    elif op == "Conv" and b and len(b) >= 2:
        dims["C_out"], dims["C_in/group"] = b[0], b[1]
    elif op == "ConvTranspose" and b and len(b) >= 2:
        dims["C_in"], dims["C_out/group"] = b[0], b[1]
    elif op in ("convolution", "_convolution") and b and len(b) >= 2:
        dims["W[0]"], dims["W[1]"] = b[0], b[1]
    return dims


def einsum_gemm_labels(equation: str) -> tuple[list[str], list[str], list[str]] | None:
    """(M labels, N labels, K labels) of a two-operand einsum: the labels only the first operand
    and the output hold, those only the second and the output hold, and those both operands hold
    that the output sums (labels all three hold are the batch). None for an equation that is not
    one of two operands or that sums a label only one operand holds (a reduction, no GEMM)."""
    text = equation.replace(" ", "")
    lhs, arrow, rhs = text.partition("->")
    operands = [o.replace("...", "") for o in lhs.split(",")]
    if len(operands) != 2 or not all(c.isalpha() for o in operands for c in o):
        return None
    a, b = operands
    if not arrow:  # implicit output: the labels that occur once, in alphabetical order
        rhs = "".join(sorted(c for c in set(a + b) if (a + b).count(c) == 1))
    rhs = rhs.replace("...", "")
    if any(c not in rhs and (c in a) != (c in b) for c in a + b):
        return None
    m = [c for c in a if c in rhs and c not in b]
    n = [c for c in b if c in rhs and c not in a]
    k = [c for c in a if c in b and c not in rhs]
    return m, n, k


def _einsum_dims(equation: str, shapes: list) -> dict[str, Any]:
    """M, N and K of a two-operand einsum (each the product of its labels' sizes), from its
    operands' shapes; an ellipsis stands for leading batch dims."""
    labels = einsum_gemm_labels(equation)
    if labels is None:
        return {}
    sizes: dict[str, Any] = {}
    lhs = equation.replace(" ", "").partition("->")[0].split(",")
    for subscript, shape in zip(lhs, shapes):
        head, _, tail = subscript.partition("...")
        if shape is None or len(shape) < len(head) + len(tail):
            continue
        for label, size in zip(head + tail, list(shape[:len(head)]) + list(shape[len(shape) - len(tail):])):
            if sizes.get(label) is None:
                sizes[label] = size
    return {axis: _product([sizes.get(c) for c in group]) for axis, group in zip("MNK", labels) if group}


def _folds_batch(op: str, a: list, b: list | None) -> bool:
    """Whether a batched A (``[..., M, K]``) times B runs as one GEMM with A's leading dims folded
    into M, as linear does, rather than one GEMM per batch. torch's matmul folds when B is a
    matrix or a vector (aten's should_fold; a non-contiguous A would go per batch instead, which
    the shapes cannot tell). onnxruntime's MatMul folds when B's leading dims are all 1 (a 2-D B
    included). bmm and baddbmm (both operands batched) never fold; mm and addmm have no batch."""
    if b is None or len(a) < 3:
        return False
    if op == "matmul":
        return len(b) <= 2
    if op == "MatMul":
        return 2 <= len(b) <= len(a) and all(d == 1 for d in b[:-2])
    return False


def _product(dims: list) -> Any:
    """The size of dims flattened into one: an int, a symbolic product ("s0*8"), or None where a
    dim is not known."""
    if all(isinstance(d, int) for d in dims):
        return math.prod(dims)
    if any(d is None for d in dims):
        return None
    return dims[0] if len(dims) == 1 else "*".join(str(d) for d in dims)


_SYMBOLIC_PRODUCT = re.compile(r"\w+(\*\w+)+")


def _known_multiple(dim: Any) -> bool:
    """Whether a symbolic product of dims (``_product``'s "B*128") is a multiple of 8 whatever its
    symbols are: its integer factors are. A folded M with a dynamic batch stays aligned when the
    rest of it is (without this it read "unknown" where the per-batch M had read aligned)."""
    if not isinstance(dim, str) or not _SYMBOLIC_PRODUCT.fullmatch(dim):
        return False
    return math.prod(int(f) for f in dim.split("*") if f.isdigit()) % TENSOR_CORE_MULTIPLE == 0


def _finite(d: dict[str, Any]) -> dict[str, Any]:
    """JSON has no inf/nan: such values (sentinel ranges) are written as strings."""
    return {k: (("inf" if v > 0 else "-inf") if isinstance(v, float) and math.isinf(v) else
                "nan" if isinstance(v, float) and math.isnan(v) else v) for k, v in d.items()}


def _bytes(n: int | float | None) -> str:
    if not n:
        return "0 B"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def load_schema() -> dict[str, Any]:
    """The JSON Schema reports follow (draft 2020-12)."""
    from importlib import resources

    return json.loads(resources.files("amp_rewrite.data").joinpath("report.schema.json").read_text("utf-8"))


def validate(report_dict: dict[str, Any]) -> None:
    """Raise ``jsonschema.ValidationError`` if ``report_dict`` does not follow the schema."""
    import jsonschema

    jsonschema.Draft202012Validator(load_schema(), format_checker=jsonschema.FormatChecker()).validate(report_dict)


def write_report(report: Report, path, *, kept: bool = True) -> None:
    """Write ``report`` in the format its extension names, atomically. Inside
    :func:`~amp_rewrite.files.previous_outputs_kept` the file it replaces is set aside until the
    command succeeds, unless ``kept`` is False: a report that must stay although the command fails
    (the one a failed ``--check`` writes)."""
    import os
    import tempfile
    from pathlib import Path

    from .errors import OutputError, UsageError
    from .files import ordinary_mode, replace_into

    path = Path(path)
    suffix = path.suffix.lower()
    if suffix == ".json":
        text = report.to_json()
    else:
        from . import report_render

        text = report_render.render(report, suffix)
        if text is None:
            raise UsageError(f"--report {path}: unknown format {suffix!r}; use .json, .html or .md")
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=".amp-report-", dir=path.parent or ".")
        # (a path whose name is not UTF-8 holds surrogates: shown escaped, not an internal error)
        with os.fdopen(fd, "w", encoding="utf-8", errors="backslashreplace") as f:
            f.write(text)
        ordinary_mode(tmp)
        (replace_into if kept else os.replace)(Path(tmp), path)
    except BaseException as exc:  # (a failed or interrupted write leaves nothing behind)
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise OutputError(f"{path}: cannot write the report ({exc.strerror or exc})") from exc
        raise
