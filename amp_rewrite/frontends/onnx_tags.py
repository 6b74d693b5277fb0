"""Read back the ``amp_rewrite.*`` tags a rewrite leaves in an ONNX model, as a DecisionLog.

The emitter tags every decided node (precision, category, reason, rule entry, step, the node the
paint came from, its island, its position in the log, operand shapes of MatMul/Gemm/Conv), every
inserted or retargeted Cast (its record as JSON) and the model (islands, weight statistics,
unlisted ops and removed casts as JSON). From these alone the report of the rewrite is rebuilt.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator

import onnx

from ..decisions import CastRecord, Category, Decision, DecisionLog, FusionRecord, Island, Precision, WeightStats
from ..errors import ModelLoadError, UsageError

TAG = "amp_rewrite."


def read_log(model: Any) -> tuple[DecisionLog, str | None]:
    """``model``: a path, an ``onnx.ModelProto`` or an onnx-ir ``Model``. Returns the log and the
    model's path (None for in-memory models)."""
    path = None
    if isinstance(model, (str, os.PathLike)):
        path = str(model)
        if not Path(path).is_file():
            raise ModelLoadError(f"{path}: no such file")
        try:
            proto = onnx.load(path, load_external_data=False)
        except Exception as exc:  # protobuf raises several kinds on non-ONNX bytes
            raise ModelLoadError(f"{path}: not a valid ONNX model: {exc}") from exc
    elif isinstance(model, onnx.ModelProto):
        proto = model
    elif type(model).__module__.startswith("onnx_ir"):
        import onnx_ir as ir

        proto = ir.serde.serialize_model(model)
    else:
        raise UsageError(f"Report.from_model takes a path, an onnx.ModelProto or an onnx_ir.Model written by "
                         f"amp-rewrite, not a {type(model).__name__} (a rewritten torch module carries its report in "
                         f"gm.meta['amp_rewrite.log']: Report.from_log(...))")
    meta = {p.key: p.value for p in proto.metadata_props}
    if TAG + "report" not in meta:
        where = f"{path}: " if path else ""
        raise ModelLoadError(f"{where}the model carries no amp_rewrite tags: it was not written by amp-rewrite, or "
                             f"the rewrite changed nothing (the output was then a plain copy of the input)")
    return _log_from(proto, json.loads(meta[TAG + "report"])), path


def _log_from(proto: onnx.ModelProto, model_tags: dict) -> DecisionLog:
    log = DecisionLog(target=model_tags.get("target", "fp16"))
    decisions: list[tuple[float, Decision]] = []
    shapes: dict[str, list] = {}
    casts: list[tuple[float, CastRecord]] = []
    for position, node in enumerate(_walk(proto.graph)):
        tags = {p.key[len(TAG):]: p.value for p in node.metadata_props if p.key.startswith(TAG)}
        if "cast" in tags:
            record = json.loads(tags["cast"])
            casts.append((record.pop("index", position), _cast(record)))
        if "category" not in tags or "precision" not in tags:
            continue
        label = tags.get("label") or node.name or f"{node.op_type}:{node.output[0] if node.output else ''}"
        index = float(tags["index"]) if "index" in tags else 1e12 + position
        decisions.append((index, Decision(
            node=label, op=_qualified(node), category=Category(tags["category"]),
            precision=Precision(tags["precision"] or "none"), reason=tags.get("reason", ""),
            source=tags.get("source", ""), step=tags.get("step") or "classify", via=tags.get("via") or None,
            island=int(tags["island"]) if tags.get("island") else None)))
        if "shapes" in tags:
            shapes[label] = json.loads(tags["shapes"])
    for record in model_tags.get("removed_casts", []):
        casts.append((record.pop("index"), _cast(record)))
    for _, d in sorted(decisions, key=lambda t: t[0]):
        log.decide(d)
    log.operand_shapes = {d.node: shapes[d.node] for d in log.decisions.values() if d.node in shapes}
    log.casts = [c for _, c in sorted(casts, key=lambda t: t[0])]
    log.islands = [Island(**i) for i in model_tags.get("islands", [])]
    log.fusions = [FusionRecord(**f) for f in model_tags.get("fusions", [])]
    log.weights = WeightStats(**model_tags.get("weights", {}))
    log.unlisted_ops = dict(model_tags.get("unlisted_ops", {}))
    log.notes = list(model_tags.get("notes", []))
    log.io_changed = list(model_tags.get("io_changed", []))
    return log


def _cast(record: dict) -> CastRecord:
    if record.get("shape") is not None:
        record["shape"] = tuple(record["shape"])
    return CastRecord(**record)


def _qualified(node: onnx.NodeProto) -> str:
    return f"{node.domain}::{node.op_type}" if node.domain not in ("", "ai.onnx") else node.op_type


def _walk(graph: onnx.GraphProto) -> Iterator[onnx.NodeProto]:
    """Nodes of the graph and of nested subgraphs, parents before children (the log's order)."""
    for node in graph.node:
        yield node
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from _walk(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for g in attr.graphs:
                    yield from _walk(g)
