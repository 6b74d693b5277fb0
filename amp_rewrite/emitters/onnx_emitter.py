"""Neutral IR → ONNX, by patching the onnx-ir model the loader read.

Only what changed is touched: value dtypes and names, converted initializers and Constant
tensors, retargeted Cast attributes, rewired inputs, the new Cast nodes, removed no-op casts and
graph outputs. Everything else (names, metadata, doc strings, functions, external-data layout) is
left as the loader found it. Inserted and painted nodes get ``amp_rewrite.*`` metadata_props so
the report can be rebuilt from the output model alone.

Weights are converted with clamping at the target type's true limits (±65504 for FP16); large
external-data tensors are converted lazily at save time, one at a time, so a model is never fully
materialised.
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
from dataclasses import asdict, fields
from pathlib import Path
from typing import NamedTuple, Sequence

import google.protobuf.message
import ml_dtypes
import numpy as np
import onnx
import onnx_ir as ir

from ..decisions import CastRecord, DecisionLog, Precision
from ..errors import OutputError
from ..files import previous_outputs_kept, remove_stale_stages, replace_into, stage_prefix
from ..ir import DType, Graph, Model, Node, Value
from ..frontends.onnx_loader import OnnxSource, attr_tensor, constant_node_tensor, ir_graphs
from ..passes.base import node_label

# External tensors above this are converted while saving, not in memory up front. (A tensor held in
# the proto is converted right away: the model is in memory already, and it is converted once.)
LAZY_BYTES = 16 << 20
SENTINEL = 1e8  # |x| at or above this (or inf) is a sentinel (masks), reported
TAG = "amp_rewrite."
# the keys of a decided node's tags, in the order they are written
TAG_PRECISION = TAG + "precision"
TAG_CATEGORY = TAG + "category"
TAG_REASON = TAG + "reason"
TAG_SOURCE = TAG + "source"
TAG_STEP = TAG + "step"
TAG_VIA = TAG + "via"
TAG_ISLAND = TAG + "island"
TAG_LABEL = TAG + "label"
TAG_INDEX = TAG + "index"
TAG_SHAPES = TAG + "shapes"
TAG_UNFUSED = TAG + "unfused"  # a pattern member a pin or --no-fuse kept unfused: a rewrite of the output keeps it so


def emit_onnx(model: Model, log: DecisionLog) -> ir.Model:
    """Apply the IR's changes to the onnx-ir model and return it."""
    source: OnnxSource = model.origin
    patcher = _Patcher(log, source.model.ir_version)
    patcher.patch(model.graph)
    _remove(model.meta.get("amp.removed_nodes", []))
    for domain, version in model.opsets.items():
        if domain and domain not in source.model.opset_imports:  # a fused com.microsoft op brought it in
            source.model.opset_imports[domain] = version
    if "" not in source.model.opset_imports and any(
            n.domain in ("", "ai.onnx") for graph in ir_graphs(source.model) for n in graph):
        # a model of custom-domain ops only (an ai.onnx.ml pipeline, com.microsoft ops) given Casts:
        # they need an ai.onnx import, or the output fails the checker and a rewrite of it refuses it
        source.model.opset_imports[""] = default_opset_for(source.model.ir_version)
    _sort(model, source.model)
    source.model.metadata_props[TAG + "log"] = "v1"
    source.model.metadata_props[TAG + "report"] = _model_tags(log, patcher.deferred)
    return source.model


def default_opset_for(ir_version: int | None) -> int:
    """The ai.onnx opset a model given its first ai.onnx nodes imports: 13 (Cast to and from
    bfloat16), or the newest its IR version allows when that is older."""
    allowed = [opset for _, ir_v, opset, *_ in onnx.helper.VERSION_TABLE
               if ir_version is None or ir_v <= ir_version]
    return min(13, max(allowed, default=13))


def _remove(nodes: list[Node]) -> None:
    """Drop removed nodes from their onnx-ir graphs, one call per graph: a fused pattern's members
    read each other, so they can only go together."""
    by_graph: dict[int, tuple[ir.Graph, list[ir.Node]]] = {}
    read: dict[int, ir.Value] = {}  # the values the removed nodes read
    for node in nodes:
        origin = node.origin
        if origin is not None and origin.graph is not None:
            by_graph.setdefault(id(origin.graph), (origin.graph, []))[1].append(origin)
            read.update((id(v), v) for v in origin.inputs if v is not None)
    # A graph's removal checks that nothing left reads what it removes, and a removed body node may
    # read a removed outer node's output (a fused pattern in a branch reading a fused pattern's
    # result outside): a graph whose removal is refused waits until the others are done.
    pending = list(by_graph.values())
    while pending:
        refused = []
        for graph, origins in pending:
            try:
                graph.remove(origins, safe=True)
            except ValueError:
                refused.append((graph, origins))
        if len(refused) == len(pending):
            graph, origins = refused[0]
            graph.remove(origins, safe=True)  # no progress: let its error through
        pending = refused
    # A constant only the removed nodes read (a fused pattern's eps, its exponent 2) goes with them.
    # An initializer the input model already left unread is kept: it is not ours to drop.
    for value in read.values():
        graph = value.graph
        if (graph is not None and value.is_initializer() and not value.uses() and not value.is_graph_input()
                and not value.is_graph_output() and graph.initializers.get(value.name) is value):
            graph.initializers.pop(value.name)


def _sort(model: Model, ir_model: ir.Model) -> None:
    """Topological order, as ONNX requires (what onnx-ir's TopologicalSortPass does).

    The passes keep the neutral IR sorted (it is verified before it is emitted) and the patcher
    lays new nodes out in its order, so an onnx-ir graph holding its scope's nodes in that order
    is sorted already: onnx-ir's stable sort would leave it as it is, at the cost of a heap
    operation per node. Only a scope a pass reordered needs it."""
    if not all(_in_neutral_order(scope) for scope in model.graph.scopes()):
        ir_model.graph.sort()
    for function in ir_model.functions.values():
        function.sort()


def _in_neutral_order(scope: Graph) -> bool:
    ir_nodes = list(scope.origin)
    return len(ir_nodes) == len(scope.nodes) and all(a is n.origin for a, n in zip(ir_nodes, scope.nodes))


def _move_output_info(old: ir.Value, new: ir.Value) -> None:
    """A Cast now writes the graph output ``old`` wrote: the output's doc string, metadata and type
    and dim denotations go with its name to ``new`` (the inner value keeps none of them)."""
    new.doc_string, old.doc_string = old.doc_string, None
    new.metadata_props.update(old.metadata_props)
    old.metadata_props.clear()
    if old.type is not None and new.type is not None and getattr(old.type, "denotation", None):
        new.type = ir.TensorType(new.type.dtype, denotation=old.type.denotation)
    if old.shape is not None and new.shape is not None and len(old.shape) == len(new.shape):
        denotations = [old.shape.get_denotation(i) for i in range(len(old.shape))]
        if any(denotations):
            new.shape = ir.Shape(list(new.shape.dims), denotations=denotations)


def to_proto(model: ir.Model) -> onnx.ModelProto:
    _once_tensor_metadata(model)
    return ir.serde.serialize_model(model)


def _once_tensor_metadata(model: ir.Model) -> None:
    """onnx-ir (1.1) writes a tensor read from a proto as that proto, metadata_props included, and
    then appends the tensor's metadata_props again: every pass through it doubled a tensor's
    metadata, so rewriting an output again changed it. The proto's copy is the one written."""
    def once(tensor: object) -> None:
        if isinstance(tensor, ir.TensorProtoTensor) and len(tensor.raw.metadata_props) and tensor.metadata_props:
            tensor.metadata_props.clear()

    graphs = [model.graph, *(function.graph for function in model.functions.values())]
    for graph in graphs:  # (grows as bodies are found, functions' own included)
        for value in graph.initializers.values():
            if value.const_value is not None:
                once(value.const_value)
        for node in graph:
            for attr in node.attributes.values():
                if attr.type == ir.AttributeType.TENSOR:
                    once(attr.value)
                elif attr.type == ir.AttributeType.TENSORS:
                    for tensor in attr.value:
                        once(tensor)
                elif attr.type == ir.AttributeType.GRAPH:
                    graphs.append(attr.value)
                elif attr.type == ir.AttributeType.GRAPHS:
                    graphs.extend(attr.value)


class _Patcher:
    def __init__(self, log: DecisionLog, ir_version: int | None = None) -> None:
        self.log = log
        self.ir_version = ir_version
        self.values: dict[int, ir.Value] = {}
        self.deferred: list[tuple] = []  # (tensor, target, name) converted at save time
        self.order = {name: i for i, name in enumerate(log.decisions)}
        self.casts = {c.name: (i, c) for i, c in enumerate(log.casts)}

    def ir_value(self, value: Value) -> ir.Value:
        if value.origin is not None:
            return value.origin
        if id(value) not in self.values:
            shape = ir.Shape(list(value.shape)) if value.shape is not None else None
            dtype = ir.TensorType(ir.DataType(int(value.dtype))) if value.dtype is not None else None
            new = ir.Value(name=value.name, type=dtype, shape=shape)
            replaced = value.meta.get("amp.takes_output_of")
            if replaced is not None and replaced.origin is not None:
                _move_output_info(replaced.origin, new)
            self.values[id(value)] = new
        return self.values[id(value)]

    def patch(self, graph: Graph, body: bool = False) -> None:
        origin: ir.Graph = graph.origin
        for value in graph.inputs:  # (a body's formal inputs keep their names: see _retype)
            self._retype(value, rename=not body)
        for value in graph.initializers.values():
            self._retype(value)
        for value in graph.initializers.values():
            if value.origin is None and "amp.copy_of" in value.meta:
                self._add_copy(origin, value)
            elif value.meta.get("amp.convert") and value.origin is not None:
                value.origin.const_value = self._convert(value.origin.const_value, value.name, value.dtype)
        previous: ir.Node | None = None
        for node in graph.nodes:
            if node.origin is None:
                new = self._new_node(node)
                if previous is None:
                    if len(origin) == 0:
                        origin.append(new)
                    else:
                        origin.insert_before(origin.node(0), new)
                else:
                    origin.insert_after(previous, new)
                previous = new
                continue
            self._patch_node(node)
            previous = node.origin
            for sub in node.all_subgraphs():
                self.patch(sub, body=True)
        for i, value in enumerate(graph.outputs):
            target = self.ir_value(value)
            if origin.outputs[i] is not target:
                origin.outputs[i] = target
            if body:  # (a body's outputs keep the names the model gave them: see _body_output_name)
                target.name = _body_output_name(value, target.name)

    def _retype(self, value: Value, rename: bool = True) -> None:
        """``value``'s type, and the name the IR gave it (:func:`~amp_rewrite.frontends.onnx_loader._unique_value_names`),
        on its ONNX value. A body's formal inputs keep theirs (``rename=False``): a name may shadow
        an outer one there, and some ops find a body's inputs by name (onnxruntime's GreedySearch
        refused a decoder whose ``input_ids`` had become ``input_ids__1``)."""
        o = value.origin
        if o is None:
            return
        if rename and o.name != value.name:
            o.name = value.name
        if value.dtype is not None and (o.dtype is None or int(o.dtype) != int(value.dtype)) and "amp.was" in value.meta:
            o.dtype = ir.DataType(int(value.dtype))

    def _patch_node(self, node: Node) -> None:
        n: ir.Node = node.origin
        for out in node.outputs:
            self._retype(out)
        old = n.inputs
        changes = [(i, target) for i, value in enumerate(node.inputs)
                   if old[i] is not (target := self.ir_value(value) if value is not None else None)]
        _replace_inputs(n, changes)
        if node.meta.get("amp.retargeted"):
            _set_attr(n, ir.AttrInt64("to", int(node.attrs["to"])))
        self._convert_literal(n, node)
        if node.op_type == "ConstantOfShape" and node.outputs[0].meta.get("amp.was") is not None:
            self._retype_constant_of_shape(n, node.outputs[0].dtype)
        type_attr = _OUTPUT_TYPE_ATTRS.get(node.op_type) if node.domain == "" else None
        if type_attr and node.outputs[0].meta.get("amp.was") is not None and node.outputs[0].dtype is not None:
            # the attribute, not the input, says the output type. A *Like op without it takes its
            # input's type, but that input is another type group (only its shape is read), which
            # painting leaves FP32: the attribute is written there too. Where it only counts when
            # set (DequantizeLinear's output_dtype), an unset one stays unset.
            attr = n.attributes.get(type_attr)
            if node.op_type not in _TYPE_ATTR_ONLY_WHEN_SET or (
                    attr is not None and attr.type == ir.AttributeType.INT and attr.value != 0):
                _set_attr(n, ir.AttrInt64(type_attr, int(node.outputs[0].dtype)))
        if node.meta.get("amp.category") is not None:
            self._tag(n, node)
        if node.meta.get("amp.retargeted"):
            self._tag_cast(n, node.name or node.outputs[0].name)

    def _convert_literal(self, n: ir.Node, node: Node) -> None:
        """A Constant node painting converts: its tensor is written in the low type."""
        if node.op_type == "Constant" and node.domain == "" and node.outputs[0].meta.get("amp.convert"):
            tensor = constant_node_tensor(n)
            if isinstance(tensor, ir.ExternalTensor):
                n.meta[_EXTERNAL_CONSTANT] = True  # (converted, it still goes to the data file)
            doc = None
            for shorthand in ("value_float", "value_floats"):  # (the converted tensor replaces them)
                old = n.attributes.pop(shorthand, None)
                doc = doc or (old.doc_string if old is not None else None)
            _set_attr(n, ir.AttrTensor("value", self._convert(tensor, node.outputs[0].name, node.outputs[0].dtype),
                                       doc_string=doc))

    def _retype_constant_of_shape(self, n: ir.Node, dtype: DType) -> None:
        """Its output type comes from the ``value`` attribute (default: float32 zero)."""
        attr = n.attributes.get("value")
        if attr is None and dtype == DType.FLOAT:
            return  # (the default is the type: converting it counted a float32 zero as a value flushed to zero)
        data = attr_tensor(attr).numpy() if attr is not None else np.zeros((1,), np.float32)
        # clamped at the type's limits like any constant: torch exports fill masks with finfo.min,
        # which a plain astype would turn into -inf (and the softmax after it into NaN)
        name = n.outputs[0].name or "ConstantOfShape.value"
        converted = self._convert(ir.tensor(np.asarray(data, np.float32)), name, dtype)
        _set_attr(n, ir.AttrTensor("value", converted))

    def _tag(self, n: ir.Node, node: Node) -> None:
        meta = node.meta
        precision = meta.get("amp.precision")
        tags = n.metadata_props
        tags[TAG_PRECISION] = precision.value if isinstance(precision, Precision) else ""
        tags[TAG_CATEGORY] = getattr(meta.get("amp.category"), "value", "") or ""
        tags[TAG_REASON] = str(meta.get("amp.reason", ""))
        tags[TAG_SOURCE] = str(meta.get("amp.source", ""))
        tags[TAG_STEP] = str(meta.get("amp.step", ""))
        tags[TAG_VIA] = str(meta.get("amp.via") or "")
        if meta.get("amp.island") is not None:
            tags[TAG_ISLAND] = str(meta["amp.island"])
        if meta.get("amp.unfused_by_pin"):
            unfused = meta["amp.unfused_by_pin"]
            tags[TAG_UNFUSED] = unfused if isinstance(unfused, str) else "pinned"
        label = node_label(node)
        if label != n.name:
            tags[TAG_LABEL] = label  # unnamed node: its label names the output as it was before renaming
        if label in self.order:
            tags[TAG_INDEX] = str(self.order[label])
        if label in self.log.operand_shapes:
            tags[TAG_SHAPES] = json.dumps(self.log.operand_shapes[label])

    def _new_node(self, node: Node) -> ir.Node:
        """An inserted Cast, or a fused op (frontends/onnx_fuse.py), which is tagged like any decided node."""
        inputs = [self.ir_value(v) if v is not None else None for v in node.inputs]
        outputs = [self.ir_value(v) for v in node.outputs]
        attrs = [_attribute(key, value) for key, value in node.attrs.items()]
        new = ir.Node(node.domain, node.op_type, inputs, attrs, outputs=outputs, name=node.name)
        node.origin = new
        if node.op_type == "ConstantOfShape" and not node.domain:  # the fuse pass's zero skip
            self._retype_constant_of_shape(new, node.outputs[0].dtype)
        self._convert_literal(new, node)  # (the zero skip's literal, where it is Expanded)
        if node.meta.get("amp.inserted") or (node.op_type == "Cast" and not node.domain):
            new.metadata_props[TAG + "inserted"] = node.meta.get("amp.inserted_kind", "cast")
            new.metadata_props[TAG + "reason"] = node.meta.get("amp.reason", "")
            self._tag_cast(new, node.name)
        elif node.meta.get("amp.category") is not None:
            self._tag(new, node)
        return new

    def _tag_cast(self, n: ir.Node, name: str) -> None:
        """The cast's record (edge, shape, bytes), so the report can be rebuilt from the model."""
        if name in self.casts:
            index, record = self.casts[name]
            n.metadata_props[TAG + "cast"] = json.dumps({**cast_record_dict(record), "index": index})

    def _add_copy(self, origin: ir.Graph, value: Value) -> None:
        source: Value = value.meta["amp.copy_of"]
        if source.is_initializer:
            tensor = source.origin.const_value
        else:  # a Constant node's value, shared with FP32 readers (its node keeps it as it is)
            tensor = constant_node_tensor(source.origin.producer())
        tensor = self._convert(tensor, value.name, value.dtype)
        new = ir.Value(name=value.name, type=ir.TensorType(ir.DataType(int(value.dtype))),
                       shape=ir.Shape(list(tensor.shape.dims)), const_value=tensor)
        origin.register_initializer(new)
        if any(v is source.origin for v in origin.inputs) or _initializers_are_inputs(self.ir_version):
            origin.inputs.append(new)
        value.origin = new

    # -- weights -----------------------------------------------------------------------------------
    def _convert(self, tensor, name: str, dtype: DType):
        nbytes = int(np.prod(tensor.shape.numpy(), dtype=np.int64)) * 4 if tensor.shape is not None else 0
        target = _np_dtype(dtype)
        stats = self.log.weights

        counted: list[bool] = []  # statistics are taken once, by the first complete conversion

        def parts():
            # chunk by chunk: temporaries stay small whatever the tensor's size
            found: dict | None = None
            clamped_sum = flushed_sum = 0
            for _, chunk in _float32_chunks(tensor):
                part, clamped, flushed, sentinel = convert_array(chunk, target)
                clamped_sum += clamped
                flushed_sum += flushed
                found = _merge_sentinels(found, sentinel)
                yield part
            if not counted:
                counted.append(True)
                stats.clamped += clamped_sum
                stats.flushed_to_zero += flushed_sum
                if found:
                    stats.sentinels.append({"tensor": name, **found})

        # the converted weight keeps what the model said of it (doc string, metadata)
        said = {"name": tensor.name, "doc_string": getattr(tensor, "doc_string", None),
                "metadata_props": dict(getattr(tensor, "metadata_props", None) or {}) or None}

        def convert() -> ir.Tensor:
            shape = tuple(int(d) for d in tensor.shape.numpy())
            converted = None
            start = 0
            for part in parts():
                if converted is None and part.size == nbytes // 4:  # one chunk: it is the array (no copy)
                    converted = flat = part
                elif converted is None:
                    converted = np.empty(shape, dtype=target)
                    flat = converted.reshape(-1)
                if flat is not part:
                    flat[start:start + part.size] = part
                start += part.size
            if converted is None:  # (no values: a dim of 0)
                converted = np.empty(shape, dtype=target)
            return ir.Tensor(converted.reshape(shape), **said)

        if nbytes > LAZY_BYTES and isinstance(tensor, ir.ExternalTensor):
            self.deferred.append((tensor, target, name))
            return _ConvertingTensor(convert, parts, dtype=ir.DataType(int(dtype)), shape=tensor.shape, **said)
        return convert()


def _attribute(key: str, value) -> ir.Attr:
    if isinstance(value, int):  # bool included
        return ir.AttrInt64(key, int(value))
    if isinstance(value, float):
        return ir.AttrFloat32(key, value)
    if isinstance(value, str):
        return ir.AttrString(key, value)
    if isinstance(value, np.ndarray):  # (a Constant's value: the saturation bounds of place_casts)
        return ir.AttrTensor(key, ir.tensor(value))
    raise TypeError(f"attribute {key!r}: cannot emit a {type(value).__name__}")


class _ConvertingTensor(ir.LazyTensor):
    """A weight converted while it is written: ``tofile`` (what onnx-ir's external-data writer
    calls) streams the converted chunks straight into the file, so not even the low-precision copy
    of a multi-GB tensor is held in memory. Whoever asks for the whole array (``numpy()``,
    ``tobytes()``) still gets it, through the LazyTensor function."""

    __slots__ = ("_parts",)

    def __init__(self, func, parts, **kwargs) -> None:
        super().__init__(func, **kwargs)
        self._parts = parts

    def tofile(self, file) -> None:
        for part in self._parts():
            file.write(part.tobytes())


def _shallow(record) -> dict:
    """A dataclass record's fields, shallow (``asdict`` would deep-copy every list only to serialise it)."""
    return {f.name: getattr(record, f.name) for f in fields(record)}


def cast_record_dict(record: CastRecord) -> dict:
    d = _shallow(record)
    d["shape"] = list(record.shape) if record.shape is not None else None
    return d


def _model_tags(log: DecisionLog, deferred: list[tuple]) -> str:
    """What no single node carries: islands, weight statistics, unlisted ops, removed casts.

    Tensors converted at save time have not been counted yet: their clamped/flushed/sentinel
    counts are taken here in a read-only pass (chunked, nothing kept), so the tags hold the totals
    the log will hold once the model is saved."""
    weights = asdict(log.weights)
    for tensor, target, name in deferred:
        found = None
        for _, chunk in _float32_chunks(tensor):
            _, clamped, flushed, sentinel = convert_array(chunk, target)
            weights["clamped"] += clamped
            weights["flushed_to_zero"] += flushed
            found = _merge_sentinels(found, sentinel)
        if found:
            weights["sentinels"].append({"tensor": name, **found})
    removed = [{**cast_record_dict(c), "index": i} for i, c in enumerate(log.casts) if c.kind == "removed"]
    return json.dumps({"version": 1, "target": log.target, "islands": [_shallow(i) for i in log.islands],
                       "weights": weights, "unlisted_ops": log.unlisted_ops, "notes": log.notes,
                       "io_changed": log.io_changed, "removed_casts": removed,
                       "fusions": [_shallow(f) for f in log.fusions]})


CHUNK_ELEMENTS = 4 << 20  # 16 MB of FP32 converted per step


def _float32_chunks(tensor):
    """``(start, flat FP32 chunk)`` pairs. External data is read through the file, not a memory map:
    mapped pages stay resident (and count in RSS) until the map is closed, so a >2 GB model would
    otherwise peak at its full size."""
    n = int(np.prod(tensor.shape.numpy(), dtype=np.int64))
    if isinstance(tensor, ir.ExternalTensor) and tensor.dtype == ir.DataType.FLOAT:
        with open(tensor.path, "rb") as f:
            for start in range(0, n, CHUNK_ELEMENTS):
                count = min(CHUNK_ELEMENTS, n - start)
                f.seek((tensor.offset or 0) + 4 * start)
                chunk = np.fromfile(f, dtype="<f4", count=count)
                if chunk.size != count:
                    raise OSError(f"external data file {tensor.path!r} is shorter than tensor {tensor.name!r}")
                yield start, chunk
        return
    try:  # raw_data shorter or longer than its dims say: a corrupt model
        data = np.asarray(tensor.numpy(), dtype=np.float32).reshape(-1)
        if data.size != n:
            raise ValueError(f"it holds {data.size} values")
    except ValueError as exc:
        from ..errors import ModelLoadError

        raise ModelLoadError(f"tensor {tensor.name!r}: its data does not hold the {n} values its dims "
                             f"{tuple(int(d) for d in tensor.shape.numpy())} need ({exc}); the model is corrupt "
                             f"(onnx.checker.check_model rejects it too)") from None
    for start in range(0, n, CHUNK_ELEMENTS):
        yield start, data[start:start + CHUNK_ELEMENTS]


def _merge_sentinels(a: dict | None, b: dict | None) -> dict | None:
    if not a or not b:
        return a or b
    return {"count": a["count"] + b["count"], "min": min(a["min"], b["min"]), "max": max(a["max"], b["max"])}


def convert_array(data: np.ndarray, target) -> tuple[np.ndarray, int, int, dict | None]:
    """FP32 → target (a 16-bit float type: FP16 or BF16) with clamping at the true limits.
    Returns (array, clamped, flushed, sentinel).

    One pass per question over the data, and none where the answer is visibly no."""
    data = np.asarray(data, dtype=np.float32)
    info = _limits(target)
    magnitude = np.abs(data)
    # the largest and smallest magnitude, NaN ignored (fmax/fmin skip it): most tensors have no
    # sentinel, nothing to clamp and nothing to flush, and two passes say so
    top = float(np.fmax.reduce(magnitude)) if magnitude.size else 0.0
    bottom = float(np.fmin.reduce(magnitude)) if magnitude.size else np.inf
    sentinel = None
    if top >= SENTINEL:
        hits = magnitude >= SENTINEL  # infinities included; NaN compares false
        found = data[hits]
        sentinel = {"count": int(found.size), "min": float(found.min()), "max": float(found.max())}
    clamped = 0
    if top > info.max:
        over = (magnitude > info.max) & np.isfinite(data)
        clamped = int(np.count_nonzero(over))
        if clamped:
            data = np.where(over, np.sign(data) * info.max, data)
    converted = data.astype(target)
    flushed = 0
    if bottom < info.smallest_subnormal:  # (below it, a value may round to zero)
        # a zero stays zero and NaN stays NaN: the zeros gained are the values flushed
        flushed = _zeros(converted) - int(np.count_nonzero(data == 0))
    return converted, clamped, flushed, sentinel


@functools.lru_cache(maxsize=None)
def _limits(target):
    """The 16-bit type's largest finite value and smallest subnormal, as Python floats."""
    finfo = ml_dtypes.finfo(target)
    return _Limits(float(finfo.max), float(finfo.smallest_subnormal))


class _Limits(NamedTuple):
    max: float
    smallest_subnormal: float


def _zeros(values: np.ndarray) -> int:
    """How many elements of a 16-bit float array (FP16, BF16) are ±0: all bits but the sign clear.
    (Read as integers: comparing FP16 values converts every element.)"""
    return int(np.count_nonzero((values.view(np.uint16) & 0x7FFF) == 0))


# ops whose output type an attribute gives (default FLOAT, or the input's type for a *Like op)
_OUTPUT_TYPE_ATTRS = {"RandomNormal": "dtype", "RandomUniform": "dtype", "RandomNormalLike": "dtype",
                      "RandomUniformLike": "dtype", "EyeLike": "dtype", "Bernoulli": "dtype",
                      "HannWindow": "output_datatype", "HammingWindow": "output_datatype",
                      "BlackmanWindow": "output_datatype", "MelWeightMatrix": "output_datatype",
                      "DequantizeLinear": "output_dtype"}
# of those, the ones whose attribute gives the type only when set (0 or absent: another input's type,
# which painting retypes with the output): DequantizeLinear-23's output_dtype (else the scale's)
_TYPE_ATTR_ONLY_WHEN_SET = {"DequantizeLinear"}


def _np_dtype(dtype: DType):
    return {DType.FLOAT16: np.float16, DType.BFLOAT16: ml_dtypes.bfloat16, DType.FLOAT: np.float32}[dtype]


# -- saving ----------------------------------------------------------------------------------------------
def _replace_inputs(node: ir.Node, changes: list[tuple[int, ir.Value | None]]) -> None:
    """``node.replace_input_with`` for each (index, value), in one pass where there are many:
    onnx-ir rebuilds the whole input tuple per call, so a Concat of 32k inputs half of which read a
    Cast took 30 s (quadratic). The batch keeps the use lists as that method does."""
    if len(changes) < 16 or not _BATCHED_INPUTS:
        for index, value in changes:  # (few, or an onnx-ir whose internals differ: the public method)
            node.replace_input_with(index, value)
        return
    old = node.inputs
    new = list(old)
    for index, value in changes:
        new[index] = value
        if old[index] is not None:
            old[index]._remove_usage(node, index)  # noqa: SLF001 - what replace_input_with does
    node._inputs = tuple(new)  # noqa: SLF001
    for index, value in changes:
        if value is not None:
            value._add_usage(node, index)  # noqa: SLF001
        if old[index] is not None and old[index] is not value and hasattr(node, "_drop_sharding_for_value"):
            node._drop_sharding_for_value(old[index])  # noqa: SLF001


# (the onnx-ir internals replace_input_with uses; another onnx-ir version takes the public method)
_BATCHED_INPUTS = all(hasattr(ir.Value, a) for a in ("_remove_usage", "_add_usage")) and "_inputs" in getattr(
    ir.Node, "__slots__", ("_inputs",))


def _utf8(name: str) -> bool:
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:  # (a byte of a non-UTF-8 file name, kept as a surrogate)
        return False
    return True


def tensor_bytes(model: ir.Model) -> int:
    """Bytes of the initializers and Constant nodes' tensors of every graph of ``model``: what its
    weights take in a file. (A 1.4 GB weight held by a Constant node was left out: the output was
    written without external data and failed past protobuf's limit.)"""
    total = 0
    for graph in ir_graphs(model):
        total += sum(value.const_value.nbytes for value in graph.initializers.values() if value.const_value is not None)
        for node in graph:
            if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
                tensor = constant_node_tensor(node)
                total += tensor.nbytes if tensor is not None else 0
    return total


def _inline_external_initializers(model: ir.Model, dst: Path) -> None:
    """An output written without external data holds every weight itself: one the input kept in a
    file would otherwise name that file, relative to a folder the output may not be in."""
    from ..api import EXTERNAL_DATA_ABOVE

    external = [value for graph in ir_graphs(model) for value in graph.initializers.values()
                if isinstance(value.const_value, ir.ExternalTensor)]
    if not external:
        return
    size = tensor_bytes(model)
    if size > EXTERNAL_DATA_ABOVE:
        raise OutputError(f"{dst}: its weights take {size / (1 << 30):.2f} GiB, over protobuf's 2 GB "
                          f"limit for a file without external data; write it with external data")
    for value in external:
        value.const_value = _in_memory(value.const_value)


def _initializers_are_inputs(ir_version: int | None) -> bool:
    """IR versions before 4 list every initializer among the graph inputs (an unknown one: not)."""
    return ir_version is not None and ir_version < 4


_EXTERNAL_CONSTANT = "amp.external_constant"  # (an onnx-ir node's meta: its tensor was external, then converted)


def _external_constants_to_initializers(model: ir.Model) -> None:
    """A main-graph Constant whose tensor the input kept in external data (onnx's
    ``convert_attribute=True``), converted to the low type or not, becomes an initializer of the
    same name, so it stays in the output's data file: read into the node, a 2 GB one broke protobuf's limit ('Failed to serialize
    proto', and 12 GB of memory). IR 3 lists every initializer as a graph input: there it stays a
    Constant, read into the node."""
    if _initializers_are_inputs(model.ir_version):
        return
    graph = model.graph
    for node in list(graph):
        attr = node.attributes.get("value")
        if node.op_type != "Constant" or node.domain not in ("", "ai.onnx") or attr is None \
                or attr.type != ir.AttributeType.TENSOR \
                or not (isinstance(attr.value, ir.ExternalTensor) or node.meta.get(_EXTERNAL_CONSTANT)):
            continue
        old = node.outputs[0]
        new = ir.Value(name=old.name, type=old.type, shape=old.shape, const_value=attr.value)
        new.metadata_props.update(old.metadata_props)
        old.replace_all_uses_with(new, replace_graph_outputs=True)
        graph.remove(node, safe=True)
        graph.register_initializer(new)


def _inline_external_attributes(model: ir.Model) -> None:
    """A node attribute's tensor stored outside (a Constant's ``value``, onnx's
    ``convert_attribute=True``) is read into the node: onnx-ir writes only initializers to the
    output's data file, and the output would point at the input's file by a path relative to a
    folder it is not in."""
    from ..frontends.onnx_loader import _may_hold_tensors

    for graph in [*ir_graphs(model), *(function.graph for function in model.functions.values())]:
        for node in graph:
            if not _may_hold_tensors(node):
                continue
            for key, attr in list(node.attributes.items()):
                if attr.type == ir.AttributeType.TENSOR and isinstance(attr.value, ir.ExternalTensor):
                    _set_attr(node, ir.AttrTensor(key, _in_memory(attr.value)))
                elif attr.type == ir.AttributeType.TENSORS and any(isinstance(t, ir.ExternalTensor)
                                                                 for t in attr.value):
                    _set_attr(node, ir.AttrTensors(key, [_in_memory(t) if isinstance(t, ir.ExternalTensor)
                                                         else t for t in attr.value]))


def _set_attr(node: ir.Node, attr: ir.Attr) -> None:
    """Put ``attr`` on the node in place of its namesake, keeping that one's doc_string (an
    identity of the model's text the rewrite does not own)."""
    old = node.attributes.get(attr.name)
    if old is not None and old.doc_string and not attr.doc_string:
        attr.doc_string = old.doc_string
    node.attributes[attr.name] = attr


def _in_memory(tensor: ir.ExternalTensor) -> ir.Tensor:
    return ir.Tensor(tensor.numpy(), dtype=tensor.dtype, name=tensor.name, doc_string=tensor.doc_string,
                     metadata_props=dict(tensor.metadata_props) or None)


def _restore_tensor_docs(model: ir.Model, path: Path) -> None:
    """onnx-ir's external-data writer drops a tensor's doc string and metadata; put them back in
    the written proto (only read and written again when some weight has them)."""
    said = {}
    for graph in ir_graphs(model):
        for name, value in graph.initializers.items():
            tensor = value.const_value
            doc, meta = getattr(tensor, "doc_string", None), getattr(tensor, "metadata_props", None)
            if doc or meta:
                said[name] = (doc, dict(meta or {}))
    if not said:
        return
    proto = onnx.load(str(path), load_external_data=False)
    graphs = [proto.graph]
    while graphs:
        graph = graphs.pop()
        for tensor in graph.initializer:
            if tensor.name in said and not tensor.doc_string and not len(tensor.metadata_props):
                doc, meta = said[tensor.name]
                tensor.doc_string = doc or ""
                for key, value in meta.items():
                    tensor.metadata_props.add(key=key, value=value)
        graphs.extend(a.g for n in graph.node for a in n.attribute if a.type == onnx.AttributeProto.GRAPH)
        graphs.extend(g for n in graph.node for a in n.attribute if a.type == onnx.AttributeProto.GRAPHS
                      for g in a.graphs)
    onnx.save_model(proto, str(path))


def save_onnx(model: ir.Model, dst: Path, *, external: bool, source_files: set[Path], overwrite: bool,
              training_info: Sequence[onnx.TrainingInfoProto] = ()) -> list[Path]:
    """Write atomically: into a temp folder beside ``dst``, then rename into place.

    External data, when used, goes to a fresh ``<dst name>.data`` next to the output; it must not
    be a file the input reads from, nor (without ``overwrite``) any file already there: another
    model's weights may live in it. Without external data, tensors the input kept in files are
    read into the output (which names no file then)."""
    dst = Path(dst)
    data_name = dst.name + ".data"
    if external and not _utf8(data_name):
        raise OutputError(f"{dst}: its name is not valid UTF-8, and an ONNX model names its external data file in "
                          f"UTF-8; choose an output name that is")
    if dst.resolve() in source_files:
        raise OutputError(f"{dst}: is a file the input reads its external data from; choose another -o")
    if external and (dst.parent / data_name).resolve() in source_files:
        raise OutputError(f"{dst.parent / data_name}: would overwrite the input's external data; choose another -o")
    if not external:
        _inline_external_initializers(model, dst)
    try:
        remove_stale_stages(dst.parent)  # (what a killed write left: up to a model's size)
        tmpdir = tempfile.mkdtemp(prefix=stage_prefix(), dir=dst.parent)
    except OSError as exc:
        raise OutputError(f"{dst.parent}: cannot write here ({exc.strerror or exc})") from exc
    tmp = Path(tmpdir)
    written = []
    if external:
        _external_constants_to_initializers(model)
    _inline_external_attributes(model)
    _once_tensor_metadata(model)
    try:
        if external:
            ir.save(model, tmp / dst.name, external_data=data_name, size_threshold_bytes=1024)
            _restore_tensor_docs(model, tmp / dst.name)
        else:
            ir.save(model, tmp / dst.name)
        if training_info:  # (a model written unchanged keeps what onnx-ir cannot hold)
            written_proto = onnx.load(str(tmp / dst.name), load_external_data=False)
            written_proto.training_info.extend(training_info)
            onnx.save(written_proto, str(tmp / dst.name))
        # (onnx-ir makes the data file even when every tensor stayed inline: an empty file is no output)
        pair = external and (tmp / data_name).exists() and (tmp / data_name).stat().st_size > 0
        existing = dst.parent / data_name
        if pair and (existing.exists() or existing.is_symlink()) and not overwrite:  # (a dangling link too)
            raise OutputError(f"{existing}: already exists (the output's external data goes "
                              f"there); pass --overwrite to replace it, or choose another -o")
        # Two renames: a failure (or Ctrl-C) after the first puts the previous data file back, so
        # an earlier output is never left reading the new model's bytes.
        with previous_outputs_kept() as renamed:
            if pair:
                replace_into(tmp / data_name, dst.parent / data_name)
                renamed.append(dst.parent / data_name)
            replace_into(tmp / dst.name, dst)
            renamed.append(dst)
        written.extend(renamed)
    except OSError as exc:
        raise OutputError(f"{dst}: writing failed ({exc.strerror or exc}); nothing was left behind") from exc
    except google.protobuf.message.EncodeError as exc:  # (a proto past 2 GB)
        if not external:
            raise OutputError(f"{dst}: the model does not fit in one protobuf (2 GB) without external data; write "
                              f"it with external data; nothing was left behind") from exc
        raise OutputError(f"{dst}: the model does not fit in one protobuf (2 GB) even with its initializers in "
                          f"{data_name}: a tensor held inline (a Constant inside an If/Loop body or a "
                          f"function) is too large; nothing was left behind") from exc
    finally:
        for leftover in tmp.iterdir():
            leftover.unlink()
        tmp.rmdir()
    return written


def _body_output_name(value: Value, current: str) -> str:
    """The name a body output is written with: the model's own where only the IR's unique naming
    changed it (:func:`~amp_rewrite.frontends.onnx_loader._unique_value_names`), also where a Cast
    now writes the output in its place. Some ops find a body's outputs by name: onnxruntime's
    BeamSearch refused an encoder body whose ``logits`` had become ``logits__1`` (the decoder body
    names its output ``logits`` too)."""
    source = value.meta.get("amp.takes_output_of", value)
    original = source.meta.get("onnx.original_name")
    return original if original is not None and value.name == source.meta.get("onnx.unique_name") else current
