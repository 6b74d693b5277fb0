"""ONNX → neutral IR, with onnx-ir underneath.

onnx-ir is lenient by design (it memory-maps external data and loads what it can), so this module
adds the guard rails: a clear error for files that are missing, not ONNX, truncated, or whose
external data is missing or short; IR versions and opsets outside what we support; dangling
input names. Every IR object keeps a handle (``origin``) to its onnx-ir object so the emitter can
patch the model instead of rebuilding it.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
from google.protobuf.message import DecodeError

from ..errors import ModelLoadError, UnsupportedModelError
from ..ir import DType, Graph, Model, Node, Value

MIN_OPSET = 7
MIN_IR_VERSION = 3  # the first with opset imports
CONTROL_FLOW_OPS = {"If", "Loop", "Scan", "SequenceMap"}
# Ops whose float input may be any type and never needs a cast (they read metadata only).
_TYPE_AGNOSTIC_INPUTS = {"Shape", "Size"}


@dataclass
class OnnxSource:
    """What the emitter needs to write the model back: the onnx-ir model and where it came from."""

    model: ir.Model
    path: Path | None


def load_onnx(source: str | os.PathLike | onnx.ModelProto, *, infer_shapes: bool = True) -> Model:
    """Load a path or ModelProto into the neutral IR (never modifies the input)."""
    inferred = False
    if isinstance(source, onnx.ModelProto):
        early = _inferred_proto(source) if infer_shapes else None
        ir_model = _from_proto(early, owned=True) if early is not None else _from_proto(source)
        inferred = early is not None
        path = None
    else:
        path = Path(source)
        ir_model, inferred = _read_path(path, infer_shapes=infer_shapes)
    _check_supported(ir_model, path)
    sorted_already = all(_is_sorted(g) for g in ir_model.graphs())
    _ensure_sorted(ir_model, path)
    if infer_shapes and not (inferred and sorted_already):
        with _quiet_onnx_ir():
            _infer_types(ir_model)
    model = Model(graph=Graph(), frontend="onnx", opsets=_opsets(ir_model), origin=OnnxSource(ir_model, path))
    model.graph = _Builder(model.opsets, ir_model.ir_version).build_graph(ir_model.graph, outer={})
    model.meta["ir_version"] = ir_model.ir_version
    model.meta["functions"] = {(f.domain, f.name) for f in ir_model.functions.values()}
    return model


# -- reading ------------------------------------------------------------------------------------------
def _from_proto(proto: onnx.ModelProto, path: Path | None = None, *, owned: bool = False) -> ir.Model:
    """``owned``: the proto is ours to edit (read from a file), else it is copied before any edit."""
    where = f"{path}: " if path else ""
    _check_names(proto.graph, where)
    if _has_sparse_initializers(proto.graph):
        if not owned:
            copy = onnx.ModelProto()
            copy.CopyFrom(proto)
            proto = copy
        _densify_sparse_initializers(proto.graph, where)
    try:
        with _quiet_onnx_ir():
            return ir.serde.deserialize_model(proto)
    except Exception as exc:  # onnx-ir raises many kinds on malformed protos
        raise ModelLoadError(f"{where}the model could not be read: {_first_line(exc)}") from exc


@contextlib.contextmanager
def _quiet_onnx_ir():
    """onnx-ir logs warnings for the defects the loader reports itself as one clear error."""
    logger = logging.getLogger("onnx_ir.serde")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _subgraphs(graph: onnx.GraphProto):
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield attr.g
            elif attr.type == onnx.AttributeProto.GRAPHS:
                yield from attr.graphs


def _check_names(graph: onnx.GraphProto, where: str) -> None:
    """Duplicate tensor names (not SSA) and duplicate node names (onnxruntime rejects both) are
    reported here by name; onnx-ir would fail on the first with an unhelpful message."""
    produced: dict[str, str] = {v.name: "a graph input" for v in graph.input}
    node_names: set[str] = set()
    for node in graph.node:
        label = f"node {node.name!r}" if node.name else f"a {node.op_type} node"
        if node.name:
            if node.name in node_names:
                raise ModelLoadError(f"{where}graph {graph.name!r}: two nodes are named {node.name!r}; node names "
                                     f"must be unique (onnxruntime rejects the model too): rename one")
            node_names.add(node.name)
        for out in node.output:
            if not out:
                continue
            if out in produced:
                raise ModelLoadError(f"{where}graph {graph.name!r}: tensor {out!r} is written by {label} and by "
                                     f"{produced[out]}; every tensor needs exactly one producer")
            produced[out] = label
    for sub in _subgraphs(graph):
        _check_names(sub, where)


def _has_sparse_initializers(graph: onnx.GraphProto) -> bool:
    return bool(graph.sparse_initializer) or any(_has_sparse_initializers(g) for g in _subgraphs(graph))


def _densify_sparse_initializers(graph: onnx.GraphProto, where: str) -> None:
    """onnx-ir drops sparse initializers; they become dense ones (the output stores them dense)."""
    from onnx import numpy_helper

    for sparse in graph.sparse_initializer:
        name = sparse.values.name
        try:
            values = numpy_helper.to_array(sparse.values)
            indices = numpy_helper.to_array(sparse.indices).astype(np.int64)
            dims = [int(d) for d in sparse.dims]
            dense = np.zeros(int(np.prod(dims, dtype=np.int64)), dtype=values.dtype)
            flat = indices if indices.ndim == 1 else np.ravel_multi_index(tuple(indices.T), dims)
            dense[flat] = values
        except Exception as exc:
            raise UnsupportedModelError(f"{where}sparse initializer {name!r} cannot be densified "
                                        f"({_first_line(exc)}); store it as a dense initializer") from exc
        graph.initializer.append(numpy_helper.from_array(dense.reshape(dims), name))
    del graph.sparse_initializer[:]
    for sub in _subgraphs(graph):
        _densify_sparse_initializers(sub, where)


def _read_path(path: Path, *, infer_shapes: bool = False) -> tuple[ir.Model, bool]:
    """The onnx-ir model, and whether its types were already inferred."""
    if not path.exists():
        raise ModelLoadError(f"{path}: no such file")
    if path.is_dir():
        raise ModelLoadError(f"{path}: is a directory, expected an .onnx file")
    if not os.access(path, os.R_OK):
        raise ModelLoadError(f"{path}: not readable (check permissions)")
    if path.stat().st_size == 0:
        raise ModelLoadError(f"{path}: the file is empty")
    try:
        # load_external_data=False: external tensors are referenced, never read into memory here.
        proto = onnx.load(str(path), load_external_data=False)
    except (DecodeError, RuntimeError, ValueError, OSError) as exc:
        raise ModelLoadError(f"{path}: not a valid ONNX model (truncated or not ONNX): {_first_line(exc)}") from exc
    if not proto.HasField("graph") or (not proto.graph.node and not proto.graph.output):
        raise ModelLoadError(f"{path}: not a valid ONNX model (no graph); is this an ONNX file?")
    early = _inferred_proto(proto) if infer_shapes else None
    inferred = early is not None
    model = _from_proto(early if inferred else proto, path, owned=True)
    _attach_base_dir(model, path.parent)
    _check_external_data(model, path)
    return model, inferred


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _attach_base_dir(model: ir.Model, base_dir: Path) -> None:
    for graph in model.graphs():
        for value in graph.initializers.values():
            tensor = value.const_value
            if isinstance(tensor, ir.ExternalTensor):
                tensor.base_dir = str(base_dir)


def _check_external_data(model: ir.Model, path: Path) -> None:
    """Fail early, naming the file, when external data is missing or shorter than declared."""
    sizes: dict[str, int] = {}
    for graph in model.graphs():
        for value in graph.initializers.values():
            tensor = value.const_value
            if not isinstance(tensor, ir.ExternalTensor):
                continue
            location = Path(tensor.base_dir) / tensor.location
            if tensor.location.startswith("/") or ".." in Path(tensor.location).parts:
                raise ModelLoadError(f"{path}: external data location {tensor.location!r} escapes the model folder")
            key = str(location)
            if key not in sizes:
                if not location.exists():
                    raise ModelLoadError(
                        f"{path}: external data file {tensor.location!r} for tensor {value.name!r} is missing "
                        f"(expected next to the model in {location.parent})")
                _check_not_linked_out(location, Path(tensor.base_dir), tensor.location, path)
                sizes[key] = location.stat().st_size
            need = (tensor.offset or 0) + (tensor.length if tensor.length is not None else tensor.nbytes)
            if need > sizes[key]:
                raise ModelLoadError(
                    f"{path}: external data file {tensor.location!r} is too short for tensor {value.name!r} "
                    f"(needs {need} bytes, has {sizes[key]}); the file is truncated")


def _check_not_linked_out(location: Path, folder: Path, written: str, path: Path) -> None:
    """onnx-ir refuses (at read time, as a ValueError) external data that a symlink resolves outside
    the model folder, or that has several hard links: say so up front, with what to do."""
    real = location.resolve()
    if folder.resolve() not in real.parents:
        raise ModelLoadError(f"{path}: external data file {written!r} is a link to {real}, outside the model "
                             f"folder, which onnx-ir refuses to read (a safety rule); copy the file next to the model")
    links = real.stat().st_nlink
    if links > 1:
        raise ModelLoadError(f"{path}: external data file {written!r} has {links} hard links, which onnx-ir refuses "
                             f"to read (a safety rule); replace the link by a copy (cp, not ln)")


def _check_supported(model: ir.Model, path: Path | None) -> None:
    where = f"{path}: " if path else ""
    if model.ir_version is not None and model.ir_version < MIN_IR_VERSION:
        raise UnsupportedModelError(
            f"{where}IR version {model.ir_version} is older than the oldest supported ({MIN_IR_VERSION}, which "
            f"introduced opset imports); re-export the model with a newer exporter")
    if model.ir_version is not None and model.ir_version > onnx.IR_VERSION:
        raise UnsupportedModelError(
            f"{where}IR version {model.ir_version} is newer than this onnx ({onnx.__version__}) supports "
            f"(max {onnx.IR_VERSION}); upgrade onnx")
    opset = model.opset_imports.get("", model.opset_imports.get("ai.onnx"))
    if opset is None:
        if any(n.domain in ("", "ai.onnx") for n in model.graph.all_nodes()):
            raise UnsupportedModelError(f"{where}the model uses ai.onnx ops but imports no ai.onnx opset")
        return
    newest = onnx.defs.onnx_opset_version()
    if opset < MIN_OPSET or opset > newest:
        raise UnsupportedModelError(
            f"{where}ai.onnx opset {opset} is outside the supported range {MIN_OPSET}..{newest}; "
            f"convert it first (onnx.version_converter.convert_version)")


def _ensure_sorted(model: ir.Model, path: Path | None) -> None:
    """ONNX requires topological order; onnxruntime accepts any acyclic order, so sort what is
    merely unsorted (our copy, never the input file) and report a cycle by its nodes."""
    if all(_is_sorted(g) for g in model.graphs()):
        return
    try:
        model.graph.sort()
    except ValueError:
        where = f"{path}: " if path else ""
        raise ModelLoadError(f"{where}the graph has a cycle ({_describe_cycle(model)}); an ONNX graph must be "
                             f"acyclic (use Loop for recurrence)") from None


def _is_sorted(graph: ir.Graph) -> bool:
    seen: set[int] = set()
    for node in graph:
        for v in node.inputs:
            producer = v.producer() if v is not None else None
            if producer is not None and producer.graph is graph and id(producer) not in seen:
                return False
        seen.add(id(node))
    return True


def _describe_cycle(model: ir.Model) -> str:
    import networkx as nx

    for graph in model.graphs():
        dg = nx.DiGraph()
        for node in graph:
            for v in node.inputs:
                producer = v.producer() if v is not None else None
                if producer is not None and producer.graph is graph:
                    dg.add_edge(producer, node)
        try:
            edges = nx.find_cycle(dg)
        except nx.NetworkXNoCycle:
            continue
        names = [u.name or f"{u.op_type} node" for u, _ in edges]
        return " -> ".join(names + names[:1])
    return "through a subgraph"


# Above this the proto is not inferred directly: inference serialises it, which would double a
# large model with inline weights in memory (the onnx-ir pass strips the weights first).
_INFER_PROTO_BELOW = 256 << 20


def _inferred_proto(proto: onnx.ModelProto) -> onnx.ModelProto | None:
    """Shape inference on the proto already in hand (a new proto; the argument is untouched).

    Cheaper than onnx-ir's pass, which serialises the deserialised model and merges the result
    back: on a 100k-node graph that round trip was the largest fixed cost. None: use the pass."""
    if proto.ByteSize() > _INFER_PROTO_BELOW or _has_sparse_initializers(proto.graph):
        return None  # (sparse initializers are made dense later; the pass sees them then)
    try:
        return onnx.shape_inference.infer_shapes(proto, check_type=False, strict_mode=False, data_prop=False)
    except Exception:  # inference is best effort; the onnx-ir pass gets its own chance
        return None


def _infer_types(model: ir.Model) -> None:
    """Fill dtypes of intermediate values. Failure is not fatal: unknown dtypes are left alone."""
    from onnx_ir.passes.common import ShapeInferencePass

    import logging

    logging.getLogger("onnx_ir.passes.common.shape_inference").setLevel(logging.ERROR)
    ShapeInferencePass(strict_mode=False, data_prop=False)(model)


def _opsets(model: ir.Model) -> dict[str, int]:
    out: dict[str, int] = {}
    for domain, version in model.opset_imports.items():
        out["" if domain == "ai.onnx" else domain] = version
    return out


# -- building the neutral IR ---------------------------------------------------------------------------
class _Builder:
    def __init__(self, opsets: dict[str, int], ir_version: int | None = None) -> None:
        self.opsets = opsets
        self.ir_version = ir_version
        self._schema_cache: dict[tuple[str, str, int], Any] = {}

    def build_graph(self, g: ir.Graph, outer: dict[int, Value], parent: Node | None = None) -> Graph:
        graph = Graph(g.name or "", origin=g)
        graph.parent = parent
        graph.opsets = self.opsets
        scope: dict[int, Value] = dict(outer)
        for v in g.inputs:
            scope[id(v)] = graph.add_input(self._value(v))
        for name, v in g.initializers.items():
            if id(v) in scope:  # an initializer listed as a graph input
                scope[id(v)].is_initializer = True
                # IR < 4 lists every initializer as an input: they are weights. From IR 4 on, listing
                # one is deliberate: a default the caller may override, so its FP32 type is kept.
                scope[id(v)].meta["amp.overridable"] = (self.ir_version or 0) >= 4
                graph.initializers[name] = scope[id(v)]
                _fill_const(scope[id(v)], v)
                continue
            val = graph.add_initializer(self._value(v))
            _fill_const(val, v)
            scope[id(v)] = val
        for n in g:
            graph.append(self._node(n, scope))
        for v in g.outputs:
            if id(v) not in scope:
                raise ModelLoadError(f"graph {g.name!r}: output {v.name!r} is not produced by any node or input")
            graph.outputs.append(scope[id(v)])
        return graph

    def _value(self, v: ir.Value) -> Value:
        shape = None
        if v.shape is not None:
            shape = tuple(d if isinstance(d, int) else (str(d) if d is not None and str(d) else None) for d in v.shape.dims)
        dtype = DType(int(v.dtype)) if v.dtype is not None and int(v.dtype) in DType._value2member_map_ else None
        return Value(v.name or "", dtype, shape, origin=v)

    def _node(self, n: ir.Node, scope: dict[int, Value]) -> Node:
        inputs: list[Value | None] = []
        for i, v in enumerate(n.inputs):
            if v is None:
                inputs.append(None)
                continue
            if id(v) not in scope:
                raise ModelLoadError(
                    f"node {n.name or n.op_type!r} ({n.op_type}) reads {v.name!r} (input {i}), which nothing "
                    f"produces (a dangling input: no node, graph input or initializer has that name)")
            inputs.append(scope[id(v)])
        outputs = [self._value(v) for v in n.outputs]
        node = Node(n.op_type, inputs, name=n.name or "", domain=n.domain, outputs=outputs, origin=n)
        node.opset = self.opsets.get(node.domain)
        node.attrs = _interesting_attrs(n)
        for v, out in zip(n.outputs, outputs):
            scope[id(v)] = out
            if n.op_type == "Constant" and node.domain == "":
                _fill_const_from_attr(out, n)
        for attr_name, attr in n.attributes.items():
            if attr.type == ir.AttributeType.GRAPH:
                node.subgraphs[attr_name] = [self.build_graph(attr.as_graph(), scope, node)]
            elif attr.type == ir.AttributeType.GRAPHS:
                node.subgraphs[attr_name] = [self.build_graph(sg, scope, node) for sg in attr.as_graphs()]
        node.input_groups, node.output_groups = self._groups(n, len(inputs), len(outputs))
        node.meta["input_names"] = self._last_input_names
        node.meta["group_types"] = self._last_group_types
        return node

    def _groups(self, n: ir.Node, n_in: int, n_out: int) -> tuple[list[str | None], list[str | None]]:
        """Per slot: the type-constraint name (a group painted together) or None (a fixed type)."""
        schema = self._schema(n.op_type, n.domain or "", self.opsets.get("" if n.domain == "ai.onnx" else n.domain or ""))
        if schema is None:
            # No schema (custom domain, model-local function): one group; such ops are unlisted → FP32.
            self._last_input_names = []
            self._last_group_types = {}
            return ["?"] * n_in, ["?"] * n_out
        type_vars = {tc.type_param_str for tc in schema.type_constraints}
        self._last_input_names = [f.name for f in schema.inputs]
        # per type-constraint group, the element types its schema allows at this opset ("float16", ...)
        self._last_group_types = {tc.type_param_str: {t[len("tensor("):-1] for t in tc.allowed_type_strs
                                                      if t.startswith("tensor(")}
                                  for tc in schema.type_constraints}
        ins = _expand(schema.inputs, n_in, type_vars)
        outs = _expand(schema.outputs, n_out, type_vars)
        if n.op_type in _TYPE_AGNOSTIC_INPUTS:
            ins = [None] * n_in
        return ins, outs

    def _schema(self, op: str, domain: str, opset: int | None):
        if opset is None:
            return None
        key = (op, domain, opset)
        if key not in self._schema_cache:
            try:
                self._schema_cache[key] = onnx.defs.get_schema(op, opset, domain)
            except onnx.defs.SchemaError:
                self._schema_cache[key] = None
        return self._schema_cache[key]


def _expand(formals, count: int, type_vars: set[str]) -> list[str | None]:
    out: list[str | None] = []
    for i in range(count):
        if not formals:
            out.append(None)
            continue
        formal = formals[min(i, len(formals) - 1)]
        if i >= len(formals) and formal.option != onnx.defs.OpSchema.FormalParameterOption.Variadic:
            out.append(None)
            continue
        out.append(formal.type_str if formal.type_str in type_vars else None)
    return out


def _interesting_attrs(n: ir.Node) -> dict[str, Any]:
    """Only the attributes the passes read: float-type-carrying ones."""
    attrs: dict[str, Any] = {}
    for key in ("to", "dtype"):
        a = n.attributes.get(key)
        if a is not None and a.type == ir.AttributeType.INT:
            attrs[key] = a.as_int()
    if n.op_type == "ConstantOfShape":
        a = n.attributes.get("value")
        attrs["value_dtype"] = int(a.as_tensor().dtype) if a is not None else int(ir.DataType.FLOAT)
    return attrs


def _fill_const(val: Value, v: ir.Value) -> None:
    tensor = v.const_value
    if tensor is None:
        return
    size = 1
    for d in tensor.shape.dims:
        size *= int(d) if isinstance(d, int) else 1
    val.const_numel = size


def _fill_const_from_attr(out: Value, n: ir.Node) -> None:
    attr = n.attributes.get("value")
    if attr is None or attr.type != ir.AttributeType.TENSOR:
        return
    tensor = attr.as_tensor()
    size = 1
    for d in tensor.shape.dims:
        size *= int(d)
    out.const_numel = size
    if out.dtype is None:
        out.dtype = DType(int(tensor.dtype))


def input_files(model: Model, src: Path) -> set[Path]:
    """Every file the loaded model reads: the .onnx and its external-data files (never overwritten)."""
    files = {Path(src).resolve()}
    for graph in model.origin.model.graphs():
        for value in graph.initializers.values():
            if isinstance(value.const_value, ir.ExternalTensor):
                files.add((Path(value.const_value.base_dir) / value.const_value.location).resolve())
    return files
