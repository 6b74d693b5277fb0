"""ONNX → neutral IR, with onnx-ir underneath.

onnx-ir is lenient by design (it memory-maps external data and loads what it can), so this module
adds the guard rails: a clear error for files that are missing, not ONNX, truncated, or whose
external data is missing or short; IR versions and opsets outside what we support; dangling
input names. Every IR object keeps a handle (``origin``) to its onnx-ir object so the emitter can
patch the model instead of rebuilding it.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import onnx
import onnx_ir as ir
from google.protobuf.message import DecodeError

from ..errors import ModelLoadError, UnsupportedModelError, first_line
from ..ir import DType, Graph, Model, Node, Value
from ..ir.verifier import group_conflict

# onnx (and onnx-ir through it) warns, with its source line, at every read of an external tensor
# with a key it does not know; every reader ignores such a key, and so does the output
warnings.filterwarnings("ignore", message="Ignoring unknown external data key", category=UserWarning)

MIN_OPSET = 7
MIN_IR_VERSION = 3  # the first with opset imports
CONTROL_FLOW_OPS = {"If", "Loop", "Scan", "SequenceMap"}
# Ops whose float input may be any type and never needs a cast (they read metadata only).
_TYPE_AGNOSTIC_INPUTS = {"Shape", "Size"}
# Type groups the schema keeps apart but the model must keep equal, painted as one group:
# - RMSNormalization-23 types X as T and scale and Y as V, yet onnx's type inference gives Y the
#   type of X (a low Y read from an FP32 X fails onnx.checker);
# - Attention-23 types Q/K (and Y) as T1 and V as T2, yet its kernels take one type for all three
#   (onnxruntime refuses an FP32 V next to FP16 Q/K).
_MERGED_GROUPS = {("", "RMSNormalization"): {"V": "T"}, ("", "Attention"): {"T2": "T1"}}
# Groups of onnx's own schemas that a node paints with its main group where the model types both
# alike (see ``_join_groups``): Attention-23's mask U may be bool or any type, but onnxruntime's
# kernels (CPU and CUDA) take a float mask only in Q's type, so an FP32 mask beside FP16 Q/K/V has
# no kernel (the CPU provider ran the function body instead). A bool mask keeps its type.
# DequantizeLinear-23 types its output T3 apart from its scale T2, yet with no output_dtype the
# output takes the scale's type: an FP16 output beside an FP32 scale was a model the checker and
# onnxruntime refuse, so where the model types both alike the scale is painted (converted) with it.
# BatchNormalization-14 types mean/var (U) and -15 scale/bias (T1) and mean/var (T2) apart from X
# (T), but onnxruntime's CUDA kernels are registered with U = T and T1 = T2 = T only: an FP16 X
# beside FP32 statistics found no CUDA kernel and ran on the CPU, copies to and from the host
# around it (seen on an H100); the statistics are painted with X, as BatchNormalization 9-13 (one
# group) always had them.
_JOINED_GROUPS = {("", "Attention"): (("U", "T1"),), ("", "DequantizeLinear"): (("T2", "T3"),),
                  ("", "BatchNormalization"): (("U", "T"), ("T1", "T"), ("T2", "T")),
                  # (only without a past_state: onnx's inference then types present_state as the query)
                  ("", "LinearAttention"): (("S", "T"),)}


@dataclass
class OnnxSource:
    """What the emitter needs to write the model back: the onnx-ir model and where it came from."""

    model: ir.Model
    path: Path | None
    data_files: frozenset[Path] = frozenset()  # the external-data files it reads (resolved)
    # The proto it was deserialised from, as read (before any pass): its structure serves
    # onnxruntime's symbolic shape inference without serialising the model again. (onnx-ir's
    # tensors wrap this proto's TensorProtos, so while they are unconverted, holding it holds
    # nothing more; run_pipeline lets it go after the passes, before weights are converted.)
    proto: onnx.ModelProto | None = None


def load_onnx(source: str | os.PathLike | onnx.ModelProto, *, infer_shapes: bool = True,
              inline_functions: bool = False) -> Model:
    """Load a path or ModelProto into the neutral IR (never modifies the input).
    ``inline_functions``: inline the model-local functions it calls first (onnx_functions.py);
    ``meta["onnx.inlined"]`` then counts the calls inlined, ``meta["onnx.not_inlined"]`` says why
    they could not be."""
    inlining: dict[str, Any] = {} if inline_functions else None
    if isinstance(source, onnx.ModelProto):
        path = None
        _refuse_unloaded_external_data(source)
        ir_model, inferred, nested, proto = _read_proto(source, None, source.ByteSize(), owned=False,
                                                        infer_shapes=infer_shapes, inlining=inlining)
    else:
        path = Path(source)
        ir_model, inferred, nested, proto = _read_path(path, infer_shapes=infer_shapes, inlining=inlining)
    # (the bodies are found by a walk over every node: only done when the proto has some)
    graphs = ir_graphs(ir_model) if nested else [ir_model.graph]
    if inferred is not None and len(inferred) != len(graphs):
        inferred = None  # (not expected: one table per graph)
    # (a model-local function's Constant may keep its tensor outside too)
    bodies = graphs + [function.graph for function in ir_model.functions.values()]
    data_files = _bind_external_data(bodies, path) if path is not None else frozenset()
    _check_supported(ir_model, graphs, path)
    retyped = _trust_actual_types(graphs, _opsets(ir_model), ir_model.ir_version)
    if retyped:
        inferred = None  # (inferred from the stale declarations: typed again from the corrected ones)
    unsorted = False
    if inferred is None:  # (types come from onnx-ir's pass, which wants the graph sorted first)
        unsorted = not all(_is_sorted(g) for g in graphs)
        _sort_and_type(ir_model, path, infer_shapes, sort=unsorted)
    model = Model(graph=Graph(), frontend="onnx", opsets=_opsets(ir_model),
                  origin=OnnxSource(ir_model, path, data_files, proto))

    functions = {(f.domain, f.name) for f in ir_model.functions.values()}

    def build(types):
        return _Builder(model.opsets, ir_model.ir_version, types, functions=functions,
                        retyped=retyped).build_graph(ir_model.graph, outer={})

    try:
        # The builder finds an unsorted graph itself (a node reading a value produced later), so
        # the usual, sorted model is walked once. The early types then do not hold (inference
        # reads the nodes in order): the graph is sorted and typed by onnx-ir's pass instead.
        model.graph = build(inferred)
    except _Unsorted:
        unsorted = True
        _sort_and_type(ir_model, path, infer_shapes)
        try:
            model.graph = build(None)
        except _Unsorted as exc:
            raise ModelLoadError(str(exc)) from None
    # (even with nothing to rewrite, the output is then the sorted or retyped model, not a copy of
    # the input: a copy of a peer's model whose initializer is declared another type loads nowhere)
    model.meta["onnx.changed_on_load"] = unsorted or bool(retyped)
    if retyped:
        model.meta["onnx.retyped"] = retyped
    if nested:
        _unique_value_names(model.graph)
    _unique_labels(model.graph)
    _type_custom_outputs(model)
    model.meta["ir_version"] = ir_model.ir_version
    if proto is not None and len(proto.training_info):
        model.meta["onnx.training_info"] = list(proto.training_info)  # (onnx-ir does not carry it)
    model.meta["functions"] = functions
    # (the ops the bodies of model-local functions hold: an op flag naming one of them alone, under
    # --no-inline-functions, names something the model has, kept as written)
    model.meta["onnx.function_ops"] = {(node.domain if node.domain != "ai.onnx" else "", node.op_type)
                                       for function in ir_model.functions.values() for node in function.all_nodes()}
    if inlining:
        model.meta.update({f"onnx.{k}": v for k, v in inlining.items()})
    return model


def _type_custom_outputs(model: Model) -> None:
    """Types for what onnx's shape inference leaves untyped behind a contrib op: it has no schema
    for com.microsoft's Attention, SkipLayerNormalization, FastGelu... (the ops onnxruntime's
    transformer optimizer writes), nor for those onnxruntime registers in the default domain
    (LayerNormalization below opset 17, SimplifiedLayerNormalization), so their outputs and
    everything downstream had no dtype and kept FP32. onnxruntime's symbolic shape inference knows
    most of those ops; it runs on the model's structure (weights as inputs of their shape), only
    when such an output is read. What it leaves untyped (it has no FusedMatMul handler) is typed
    from onnxruntime's schemas, in graph order: an output of a type group an input shares takes
    that input's type, one whose group allows a single type takes that type."""
    main = model.graph
    if not any(v.dtype is None and v.uses() and (node.domain not in ("", "ai.onnx")
                                                 or has_ort_schema_only(node.op_type, "", node.opset))
               for node in main.nodes for v in node.outputs):
        return
    _type_by_symbolic_inference(model)
    for node in main.nodes:  # (in order: an output typed here types its readers' outputs)
        if any(v.dtype is None for v in node.outputs) and node.output_groups:
            _type_from_schema(node)


def _type_by_symbolic_inference(model: Model) -> None:
    main = model.graph
    source = model.origin
    proto = structure_proto(source) if isinstance(source, OnnxSource) else None
    if proto is None:
        return
    try:
        from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference
    except ImportError:
        return
    import logging

    from .onnx_fuse import _symbolic_inference

    logging.getLogger("onnxruntime.tools.symbolic_shape_infer").setLevel(logging.CRITICAL)
    inferred, _, _ = _symbolic_inference(SymbolicShapeInference, proto, auto_merge=True)  # (partial is sound)
    if inferred is None:
        return
    types = {info.name: info.type.tensor_type.elem_type for info in [*inferred.value_info, *inferred.output]
             if info.type.HasField("tensor_type") and info.type.tensor_type.elem_type}
    known = {int(d) for d in DType}
    for node in main.nodes:
        for value in node.outputs:
            if value.dtype is None and types.get(value.name) in known:
                value.dtype = DType(types[value.name])


def _type_from_schema(node: Node, containers: "dict[int, str] | None" = None) -> None:
    """Type the node's untyped outputs from its schema: an output of a type group that a typed
    input shares takes that input's type; an output of a contrib op whose schema allows one type
    (SkipLayerNormalization's mean, U: float only) takes that type. (A sequence or optional keeps
    what it has. ``containers``: the builder's ids of those; else the values' own marks.)"""
    def plain(v: Value) -> bool:
        return id(v) not in containers if containers is not None else "onnx.container" not in v.meta

    typed = {g: v.dtype for v, g in zip(node.inputs, node.input_groups)
             if v is not None and g not in (None, "?") and v.dtype is not None and plain(v)}
    fixed = node.meta.get("onnx.output_types", ())
    if node.op_type == "Cast" and node.domain in ("", "ai.onnx") and node.outputs and plain(node.outputs[0]):
        to = node.attrs.get("to") if node.attrs else None  # (its 'to' says its output type: a body
        if node.outputs[0].dtype is None and isinstance(to, int):  # Cast shadowing an outer name)
            try:
                node.outputs[0].dtype = DType(to)
            except ValueError:
                pass
    for k, (v, g) in enumerate(zip(node.outputs, node.output_groups)):
        if v.dtype is None and plain(v):
            v.dtype = typed.get(g) or (fixed[k] if k < len(fixed) else None)


def _unique_labels(main: Graph) -> None:
    """The report, the tags and --explain key nodes by label, so every node needs one of its own.
    Node names are unique per graph, not per model: both If branches may name a node ``mm``, so a
    body node whose name another scope uses too is labelled with its scope
    (``If:y.then_branch/mm``); its name in the model stays."""
    from collections import Counter

    from ..passes.base import node_label, scope_label

    scopes = list(main.scopes())
    if len(scopes) == 1 and all((":" not in n.name) if n.name else (n.outputs and n.outputs[0].name)
                                for n in main.nodes):
        return  # names are unique in a graph, and none can be an Op:output label (100k nodes: 0.3 s)
    seen = Counter(node.name for graph in scopes for node in graph.nodes if node.name)
    for graph in scopes[1:]:  # (the main graph comes first; its names stay its labels)
        for node in graph.nodes:
            if node.name and seen[node.name] > 1:
                node.meta["amp.label"] = f"{scope_label(graph)}/{node.name}"
    # A label made up for an unnamed node (``Relu:c``) may be another node's real name, and two
    # odd names may still meet: every node gets a label of its own, named nodes first, so a
    # node with a name keeps it and the later one takes ``#2``.
    nodes = [node for graph in scopes for node in graph.nodes]
    used: set[str] = set()
    for node in sorted(nodes, key=lambda n: not n.name):  # (stable: named first, each in scope order)
        label = node_label(node)
        if label in used:
            k = 2
            while f"{label}#{k}" in used or seen[f"{label}#{k}"]:
                k += 1
            label = node.meta["amp.label"] = f"{label}#{k}"
        used.add(label)


def _unique_value_names(main: Graph) -> None:
    """ONNX lets bodies that cannot see each other reuse a name (both If branches yield ``t``, two
    Loop bodies name their counter ``i``) and checkers accept a body initializer shadowing an outer
    one; the IR names each value once per model, as its verifier checks and the passes' names for
    new values assume. A body value whose name an earlier scope took gets a fresh one in the IR
    (``t__1``, never one the model uses); the main graph's names never change. Values are linked by
    object, so nothing else moves: the output names it by the fresh name where it retypes it."""
    scopes = list(main.scopes())

    def values(g: Graph) -> list[Value]:  # (IR < 4 lists an initializer as an input too: once)
        return list({id(v): v for v in [*g.inputs, *g.initializers.values(),
                                        *(o for n in g.nodes for o in n.outputs)]}.values())

    every = {v.name for g in scopes for v in values(g)}
    taken: set[str] = set()
    for graph in scopes:
        renamed = False
        for v in values(graph):
            if v.name and v.name in taken:
                k = 1
                while f"{v.name}__{k}" in every:
                    k += 1
                v.meta["onnx.original_name"] = v.name  # (a body's outputs are written back by it)
                v.name = f"{v.name}__{k}"
                v.meta["onnx.unique_name"] = v.name
                every.add(v.name)
                renamed = True
            taken.add(v.name)
        if renamed:  # (initializers are keyed by name)
            graph.initializers = {v.name: v for v in graph.initializers.values()}


# -- reading ------------------------------------------------------------------------------------------
def _read_proto(proto: onnx.ModelProto, path: Path | None, size: int, *, owned: bool, infer_shapes: bool,
                inlining: dict[str, Any] | None = None
                ) -> tuple[ir.Model, "list[dict[str, onnx.ValueInfoProto]] | None", bool, onnx.ModelProto]:
    """The onnx-ir model, the types inferred for its values (one table per graph, in
    ``_graph_protos`` order) or None where they were not inferred here, whether any node holds a
    graph (an If/Loop/Scan body, a custom op's graph attribute), and the proto deserialised
    (``proto`` itself, or the copy made to edit it; never edited after). ``size``: the proto's
    serialised size. ``owned``: the proto is ours to edit (read from a file), else it is copied
    before any edit. ``inlining``: a dict to fill when the model-local functions are to be
    inlined first (``inlined``: the calls inlined, or ``not_inlined``: why they were not)."""
    where = f"{path}: " if path else ""
    if inlining is not None and len(proto.functions):
        from .onnx_functions import inline_functions

        inlined, calls, why_not = inline_functions(proto)
        if inlined is not None:
            proto, owned = inlined, True  # (``size`` stays the input's: it only gates inference)
            inlining["inlined"] = dict(calls)
        elif why_not:
            inlining["not_inlined"] = why_not
    graphs = _graph_protos(proto.graph)
    for graph in graphs:
        _check_initializer_names(graph, where)
    if len(graphs) > 1:
        _check_shadowing_initializers(proto.graph, frozenset(), where)
    sparse = any(_has_sparse(graph) for graph in graphs)
    # (sparse initializers are made dense below; the onnx-ir pass infers the types then)
    early = _inferred_proto(proto, graphs, size, owned=owned, base=path.parent if path is not None else None) \
        if infer_shapes and not sparse else None
    types = None
    if early is not None:
        (proto, types), owned = early, True
    if sparse:
        proto = proto if owned else _copy(proto)
        _densify_sparse_initializers(proto.graph, where, str(path.parent) if path is not None else "")
    try:
        with _quiet_onnx_ir():
            return ir.serde.deserialize_model(proto), types, len(graphs) > 1, proto
    except Exception as exc:  # onnx-ir raises many kinds on malformed protos
        for graph in graphs:  # a tensor written twice, which onnx-ir refuses without naming it
            _check_names(graph, where)
            _check_map_types(graph, where)
        _check_external_numbers(proto, where)
        raise ModelLoadError(f"{where}the model could not be read: {first_line(_root_cause(exc))}") from exc


def _trust_actual_types(graphs, opsets: dict[str, int], ir_version: int) -> list[str]:
    """An initializer's element type is its data's, as onnxruntime takes it, whatever a stale
    value_info entry declares: onnxruntime's float16 converter with MatMul/Gemm blocked writes an
    FP32 weight declared float16 (GPT-2). onnx-ir typed the value from the declaration; the rewrite
    took the weight for FP16, converted nothing, removed its Cast as a widening, and wrote a model
    the checker and onnxruntime refuse ('bound to different types'). An IR 3 model listing an FP16
    initializer as an FP32 graph input (onnxconverter-common's output of a model zoo CNN) is
    retyped alike. A Cast's output is typed by its ``to`` likewise, whatever a value_info entry
    declares (onnxconverter-common declares a rotary position Cast(to=FLOAT)'s output float16).
    So is a float output whose type an attribute sets rather than an input (EyeLike's and the
    random ops' ``dtype``, LayerNormalization's statistics by ``stash_type``, a Constant's tensor),
    and a SplitToSequence's sequence (its input's type): onnxconverter-common declares
    EyeLike(dtype=FLOAT)'s output float16 and such a sequence float, and both peers declare
    LayerNormalization's Mean float16; onnxruntime refuses each declaration. Where the corrected
    type then meets a reader of the other type, the builder refuses the model naming both.
    Returns what was retyped, a line each ("'mu' declared fp16, made fp32 by LayerNormalization")."""
    retyped: list[str] = []

    def retype(value: ir.Value, wanted: ir.DataType, by: str) -> None:
        was = _short_type(value.dtype)
        value.dtype = wanted
        retyped.append(f"{value.name!r} declared {was}, {by} {_short_type(wanted)}")

    for graph in graphs:
        for value in graph.initializers.values():
            data = value.const_value
            if data is not None and value.dtype is not None and data.dtype != value.dtype:
                retype(value, data.dtype, "its data is")
        for node in graph:
            if node.domain not in ("", "ai.onnx"):
                continue
            if node.op_type == "Cast":
                to, out = node.attributes.get("to"), node.outputs[0] if node.outputs else None
                if to is None or out is None or out.dtype is None:
                    continue
                try:
                    wanted = ir.DataType(to.value)
                except (ValueError, TypeError):
                    continue
                if out.dtype != wanted:
                    retype(out, wanted, "a Cast makes it")
            elif node.op_type in _ATTRIBUTE_TYPED:
                for out, wanted in _attribute_types(node, opsets, ir_version):
                    retype(out, wanted, f"{node.op_type} makes it")
            elif node.op_type == "SplitToSequence" and node.outputs and node.inputs and node.inputs[0] is not None:
                out, made = node.outputs[0], node.inputs[0].dtype
                elem = out.type.elem_type if isinstance(out.type, ir.SequenceType) else None
                if made in _FLOATS and isinstance(elem, ir.TensorType) and elem.dtype in _FLOATS and elem.dtype != made:
                    out.type = ir.SequenceType(ir.TensorType(made))
                    retyped.append(f"{out.name!r} declared a sequence of {_short_type(elem.dtype)}, SplitToSequence "
                                   f"makes one of {_short_type(made)}")
    return retyped


def retyped_summary(retyped: list[str]) -> str:
    """The first corrections ``_trust_actual_types`` made, and how many more: for a message or note."""
    return "; ".join(retyped[:3]) + (f"; … ({len(retyped) - 3} more)" if len(retyped) > 3 else "")


def _short_type(dtype: ir.DataType | None) -> str:
    known = _DTYPES.get(int(dtype)) if dtype is not None else None
    return known.short if known is not None else str(dtype)


# ai.onnx ops with a float output whose type variable no input carries: an attribute sets it
_ATTRIBUTE_TYPED = frozenset({"Constant", "ConstantOfShape", "EyeLike", "Bernoulli", "RandomNormal", "RandomUniform",
                              "RandomNormalLike", "RandomUniformLike", "LayerNormalization", "DequantizeLinear",
                              "BlackmanWindow", "HammingWindow", "HannWindow", "MelWeightMatrix"})
_FLOATS = frozenset({ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.DOUBLE})


def _attribute_types(node: ir.Node, opsets: dict[str, int], ir_version: int) -> list[tuple[ir.Value, ir.DataType]]:
    """(output, the float type the node makes it) for each float-declared output whose type its
    attributes set otherwise, as onnx's own inference types it; [] where they agree or it cannot
    tell (an input of unknown type, an inference error)."""
    declared = [out for out in node.outputs if out is not None and out.name and out.dtype in _FLOATS]
    if not declared:
        return []
    if node.op_type == "Constant":
        attr = node.attributes.get("value")
        tensor = attr.value if attr is not None and attr.type == ir.AttributeType.TENSOR else None
        made = tensor.dtype if tensor is not None else None
        return [(out, made) for out in declared if made in _FLOATS and out.dtype != made]
    schema = _schema(node.op_type, "", opsets.get("", None))
    if schema is None or isinstance(schema, _OrtSchema):
        return []
    try:
        types = {}
        for v in node.inputs:
            if v is not None and v.name:
                if v.type is None:
                    return []
                types[v.name] = ir.serde.serialize_type(v.type)
        proto = ir.serde.serialize_node(node)
        inferred = onnx.shape_inference.infer_node_outputs(
            schema, proto, types, opset_imports=[onnx.helper.make_opsetid(d, v) for d, v in opsets.items()],
            ir_version=ir_version)
    except Exception:  # noqa: BLE001 - inference stumbled on the node: nothing to correct by it
        return []
    found = []
    for out in declared:
        kind = inferred.get(out.name)
        elem = kind.tensor_type.elem_type if kind is not None and kind.HasField("tensor_type") else 0
        made = _DATA_TYPES.get(elem)
        if made in _FLOATS and made != out.dtype:
            found.append((out, made))
    return found


_DATA_TYPES = {int(d): d for d in ir.DataType}


def _check_map_types(graph: onnx.GraphProto, where: str) -> None:
    """A valid model with a map-typed value (ai.onnx.ml's ZipMap, which skl2onnx writes after a
    classifier by default) is one onnx-ir cannot represent: say so and what to do (exit 5), not
    'could not be read' with onnx-ir's request for a pull request."""
    def has_map(t: onnx.TypeProto) -> bool:
        kind = t.WhichOneof("value")
        if kind in ("sequence_type", "optional_type"):
            return has_map(getattr(t, kind).elem_type)
        return kind == "map_type"

    def text(t: onnx.TypeProto) -> str:
        kind = t.WhichOneof("value")
        if kind == "map_type":
            key = onnx.helper.tensor_dtype_to_np_dtype(t.map_type.key_type).name
            return f"map({key}, {text(t.map_type.value_type)})"
        if kind in ("sequence_type", "optional_type"):
            return f"{kind[:-5]}({text(getattr(t, kind).elem_type)})"
        if kind == "tensor_type":
            return onnx.helper.tensor_dtype_to_np_dtype(t.tensor_type.elem_type).name
        return kind or "?"

    for info in [*graph.input, *graph.output, *graph.value_info]:
        if has_map(info.type):
            maker = next((n for n in graph.node if info.name in n.output), None)
            made = f", made by {maker.domain or 'ai.onnx'}:{maker.op_type}" if maker is not None else ""
            raise UnsupportedModelError(
                f"{where}{info.name!r} holds maps ({text(info.type)}{made}), a type the ONNX "
                f"reader this tool uses (onnx-ir) cannot hold; rewrite the model without it (skl2onnx: "
                f"options={{'zipmap': False}}, which writes the probabilities as a tensor) and map the labels after")


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


def _check_external_numbers(proto: onnx.ModelProto, where: str) -> None:
    """An external tensor's offset or length that is not a number, named (onnx-ir's error is
    ``invalid literal for int()``, naming neither the tensor nor the key; a negative one it names)."""
    from onnx.external_data_helper import _get_all_tensors, uses_external_data

    for tensor in _get_all_tensors(proto):
        if not uses_external_data(tensor):
            continue
        for entry in tensor.external_data:
            if entry.key in ("offset", "length") and not entry.value.strip().lstrip("+-").isdigit():
                raise ModelLoadError(f"{where}tensor {tensor.name!r}: its external data {entry.key} is {entry.value!r}, "
                                     f"not a whole number of bytes")


def _subgraphs(graph: onnx.GraphProto):
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield attr.g
            elif attr.type == onnx.AttributeProto.GRAPHS:
                yield from attr.graphs


def _graph_protos(graph: onnx.GraphProto) -> list[onnx.GraphProto]:
    """The graph and every nested body, parents before children."""
    graphs = [graph]
    for sub in _subgraphs(graph):
        graphs.extend(_graph_protos(sub))
    return graphs


def _check_shadowing_initializers(graph: onnx.GraphProto, outer: frozenset[str], where: str) -> None:
    """A body initializer named like a value of an enclosing graph: onnx's checker accepts it, but
    the runtimes disagree on which tensor its readers get (onnxruntime reads the outer one where it
    is an initializer, the inner one where it is an input or a node output; onnx.reference always
    the outer one). The rewrite read the inner one, and computed with the other tensor than
    onnxruntime did: refused, naming it."""
    inner = [t.name for t in graph.initializer] + [t.values.name for t in graph.sparse_initializer]
    for name in inner if outer else ():
        if name in outer:
            raise UnsupportedModelError(
                f"{where}graph {graph.name!r} (an If/Loop/Scan body) has an initializer {name!r} that shadows a "
                f"value of an enclosing graph: runtimes disagree on which one its readers get (onnxruntime and "
                f"onnx.reference differ); rename one of them")
    visible = outer | {v.name for v in graph.input} | set(inner) | {o for n in graph.node for o in n.output}
    for sub in _subgraphs(graph):
        _check_shadowing_initializers(sub, visible, where)


def _check_initializer_names(graph: onnx.GraphProto, where: str) -> None:
    """Two initializers of one name: onnx-ir keeps the last one silently, onnxruntime reads the
    first. (The few initializers are checked up front; the many node and tensor names are not:
    see ``_check_names``.)"""
    weights = [t.name for t in graph.initializer] + [t.values.name for t in graph.sparse_initializer]
    if len(set(weights)) != len(weights):
        seen: set[str] = set()
        twice = next(name for name in weights if name in seen or seen.add(name))
        raise ModelLoadError(f"{where}graph {graph.name!r}: two initializers are named {twice!r}; initializer names "
                             f"must be unique (onnx.checker rejects the model): remove or rename one")


def _check_names(graph: onnx.GraphProto, where: str) -> None:
    """Duplicate tensor names (not SSA) and duplicate node names (onnxruntime rejects both) are
    reported here by name. Called when onnx-ir fails to read a model (a tensor written twice is
    what it refuses, with an unhelpful message): reading every name of a 100k-node proto up front
    cost a tenth of a second of every load. Node names onnx-ir accepts twice; the IR builder
    checks those (``_Builder._build_graph``). (One scope: nested bodies are checked on their own.)"""
    nodes = graph.node
    names = [node.name for node in nodes if node.name]
    written = [out for node in nodes for out in node.output if out] + [v.name for v in graph.input]
    if len(set(names)) == len(names) and len(set(written)) == len(written):
        return  # the usual case, in bulk; otherwise find the first clash to name it
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


def _has_sparse(graph: onnx.GraphProto) -> bool:
    return bool(graph.sparse_initializer) or any(
        node.op_type == "Constant" and node.domain in ("", "ai.onnx") and
        any(a.name == "sparse_value" for a in node.attribute) for node in graph.node)


def _densify_sparse_initializers(graph: onnx.GraphProto, where: str, base_dir: str) -> None:
    """onnx-ir drops sparse initializers and cannot read a Constant's ``sparse_value``: they become
    dense initializers and ``value`` attributes (the output stores them dense). ``base_dir``: the
    model's folder, where their external data lies (not the working directory)."""
    for sparse in graph.sparse_initializer:
        graph.initializer.append(_dense(sparse, where, f"sparse initializer {sparse.values.name!r}", base_dir))
    del graph.sparse_initializer[:]
    for node in graph.node:
        if node.op_type != "Constant" or node.domain not in ("", "ai.onnx"):
            continue
        for i, attr in enumerate(node.attribute):
            if attr.name == "sparse_value":
                what = f"Constant {node.name or node.output[0]!r}: sparse_value"
                dense = _dense(attr.sparse_tensor, where, what, base_dir)
                dense.name = ""
                node.attribute[i].CopyFrom(onnx.helper.make_attribute("value", dense))
    for sub in _subgraphs(graph):
        _densify_sparse_initializers(sub, where, base_dir)


def _dense(sparse: onnx.SparseTensorProto, where: str, what: str, base_dir: str) -> onnx.TensorProto:
    from onnx import numpy_helper

    for part in (sparse.values, sparse.indices):  # (a bad reference is a read error, as for a dense tensor)
        if part.data_location != onnx.TensorProto.EXTERNAL:
            continue
        location = next((e.value for e in part.external_data if e.key == "location"), "")
        if not location or Path(location).is_absolute() or ".." in Path(location).parts:
            raise ModelLoadError(f"{where}{what}: external data location {location!r} is not a file name relative "
                                 f"to the model's folder")
        if not (Path(base_dir) / location).is_file():
            raise ModelLoadError(f"{where}{what}: external data file {location!r} is missing (expected next to the "
                                 f"model in {base_dir or '.'})")
    try:
        values = numpy_helper.to_array(sparse.values, base_dir=base_dir)
        indices = numpy_helper.to_array(sparse.indices, base_dir=base_dir).astype(np.int64)
        dims = [int(d) for d in sparse.dims]
        dense = np.zeros(int(np.prod(dims, dtype=np.int64)), dtype=values.dtype)
        flat = indices if indices.ndim == 1 else np.ravel_multi_index(tuple(indices.T), dims)
        dense[flat] = values
    except Exception as exc:
        raise UnsupportedModelError(f"{where}{what} cannot be densified ({first_line(exc)}); "
                                    f"store it as a dense tensor") from exc
    return numpy_helper.from_array(dense.reshape(dims), sparse.values.name)


def _read_path(path: Path, *, infer_shapes: bool = False, inlining: dict[str, Any] | None = None
               ) -> tuple[ir.Model, "list[dict[str, onnx.ValueInfoProto]] | None", bool, onnx.ModelProto]:
    """What ``_read_proto`` returns, for a file."""
    if not path.exists():
        raise ModelLoadError(f"{path}: no such file")
    if path.is_dir():
        raise ModelLoadError(f"{path}: is a directory, expected an .onnx file")
    if not os.access(path, os.R_OK):
        raise ModelLoadError(f"{path}: not readable (check permissions)")
    if not path.is_file():  # a pipe (<(...)), a FIFO, a device: its size says nothing
        raise ModelLoadError(f"{path}: is not a regular file (a pipe or device); save the model to a file first")
    if path.stat().st_size == 0:
        raise ModelLoadError(f"{path}: the file is empty")
    try:
        # load_external_data=False: external tensors are referenced, never read into memory here.
        proto = onnx.load(str(path), load_external_data=False)
    except (DecodeError, RuntimeError, ValueError, OSError) as exc:
        raise ModelLoadError(f"{path}: not a valid ONNX model (truncated or not ONNX): {first_line(exc)}") from exc
    if not proto.HasField("graph") or (not proto.graph.node and not proto.graph.output):
        raise ModelLoadError(f"{path}: not a valid ONNX model (no graph); is this an ONNX file?")
    return _read_proto(proto, path, path.stat().st_size, owned=True, infer_shapes=infer_shapes, inlining=inlining)


def _root_cause(exc: BaseException) -> BaseException:
    """The exception at the bottom of ``exc``'s chain: onnx-ir wraps what went wrong (``External
    data offset must be non-negative, got -16 for tensor 'w'``) in ``Error calling
    _deserialize_graph with: g``, which names no tensor and no fix."""
    seen = {id(exc)}
    while True:
        inner = exc.__cause__ or exc.__context__
        if inner is None or id(inner) in seen:
            return exc
        seen.add(id(inner))
        exc = inner


def external_data_files(model: Path) -> set[Path]:
    """The files an ONNX model's external tensors are stored in (resolved), read from the proto
    alone; empty if it cannot be read (loading it says why)."""
    from onnx.external_data_helper import ExternalDataInfo, _get_all_tensors, uses_external_data

    try:
        proto = onnx.load(str(model), load_external_data=False)
    except Exception:  # noqa: BLE001 - not this check's error to report
        return set()
    return {(Path(model).parent / ExternalDataInfo(t).location).resolve()
            for t in _get_all_tensors(proto) if uses_external_data(t)}


def _refuse_unloaded_external_data(proto: onnx.ModelProto) -> None:
    """A ModelProto in memory has no folder: a tensor whose data it left in a file (``onnx.load``
    with ``load_external_data=False``, or a proto built by hand) would be read relative to the
    working directory, another model's file of that name included. Say what to do instead."""
    from onnx.external_data_helper import ExternalDataInfo, _get_all_tensors, uses_external_data

    sparse = (s.values for graph in _graph_protos(proto.graph)  # (onnx's walk leaves sparse tensors out)
              for s in [*graph.sparse_initializer,
                        *(a.sparse_tensor for n in graph.node for a in n.attribute if a.HasField("sparse_tensor"))])
    for tensor in itertools.chain(_get_all_tensors(proto), sparse):
        if uses_external_data(tensor):
            raise ModelLoadError(f"tensor {tensor.name!r} keeps its data in the file {ExternalDataInfo(tensor).location!r}, "
                                 f"which a model in memory cannot locate: load it with onnx.load(path) (which reads "
                                 f"external data), or rewrite the file with rewrite_onnx(path, ...)")


def _bind_external_data(graphs: list[ir.Graph], path: Path) -> frozenset[Path]:
    """Resolve external data next to the model file and fail early, naming the file, when it is
    missing or shorter than declared: initializers' and node attributes' (a Constant's ``value``
    stored outside, onnx's ``convert_attribute=True``). Returns the data files (resolved)."""
    base_dir = str(path.parent)
    sizes: dict[str, int] = {}
    files: set[Path] = set()

    def bind(tensor, name: str) -> None:
        if not isinstance(tensor, ir.ExternalTensor):
            return
        tensor.base_dir = base_dir
        location = Path(tensor.base_dir) / tensor.location
        if Path(tensor.location) == Path("."):  # (also the empty location)
            raise ModelLoadError(f"{path}: tensor {name!r} is stored as external data but names no file "
                                 f"(its 'location' is empty)")
        if Path(tensor.location).is_absolute():
            raise ModelLoadError(f"{path}: external data location {tensor.location!r} is an absolute path; ONNX "
                                 f"locations are relative to the model's folder: save the model with a relative one")
        if ".." in Path(tensor.location).parts:
            raise ModelLoadError(f"{path}: external data location {tensor.location!r} escapes the model folder")
        if (tensor.offset or 0) < 0 or (tensor.length is not None and tensor.length < 0):
            raise ModelLoadError(f"{path}: external data of tensor {name!r} has a negative offset or length")
        if tensor.length is not None and tensor.length < tensor.nbytes:
            raise ModelLoadError(
                f"{path}: external data of tensor {name!r} declares {tensor.length} bytes, but a tensor of its "
                f"type and shape takes {tensor.nbytes}; the model is inconsistent (onnxruntime refuses it too)")
        key = str(location)
        if key not in sizes:
            if not location.exists():
                raise ModelLoadError(
                    f"{path}: external data file {tensor.location!r} for tensor {name!r} is missing "
                    f"(expected next to the model in {location.parent})")
            if not location.is_file():
                raise ModelLoadError(f"{path}: external data location {tensor.location!r} of tensor {name!r} is not "
                                     f"a file")
            if not os.access(location, os.R_OK):
                raise ModelLoadError(f"{path}: external data file {tensor.location!r} cannot be read (permission "
                                     f"denied)")
            _check_not_linked_out(location, Path(tensor.base_dir), tensor.location, path)
            sizes[key] = location.stat().st_size
            files.add(location.resolve())
        need = (tensor.offset or 0) + (tensor.length if tensor.length is not None else tensor.nbytes)
        if need > sizes[key]:
            raise ModelLoadError(
                f"{path}: external data file {tensor.location!r} is too short for tensor {name!r} "
                f"(needs {need} bytes, has {sizes[key]}); the file is truncated")

    for graph in graphs:
        for value in graph.initializers.values():
            bind(value.const_value, value.name)
        for node in graph:
            if not _may_hold_tensors(node):
                continue
            for attr in node.attributes.values():
                if attr.type == ir.AttributeType.TENSOR:
                    bind(attr.value, f"{node.name or node.op_type}.{attr.name}")
                elif attr.type == ir.AttributeType.TENSORS:
                    for tensor in attr.value:
                        bind(tensor, f"{node.name or node.op_type}.{attr.name}")
    return frozenset(files)


def _may_hold_tensors(node: ir.Node) -> bool:
    """Whether a node's attributes may hold a tensor: in the default domain only Constant's and
    ConstantOfShape's do (checked by op type: walking every attribute of a 100k-node graph costs)."""
    return node.op_type in ("Constant", "ConstantOfShape") or node.domain not in ("", "ai.onnx")


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


def ir_graphs(model: ir.Model) -> list[ir.Graph]:
    """The model's graph and every graph a node holds (If/Loop/Scan bodies, nested), parents
    before children: what ``ir.Model.graphs()`` yields, without its per-node generator chain
    (0.1 s on a 100k-node graph, and the loader, checks and emitter each asked for it)."""
    found = [model.graph]
    for graph in found:  # (grows as bodies are found)
        for node in graph:
            if node.attributes:
                for attr in node.attributes.values():
                    if attr.type == ir.AttributeType.GRAPH:
                        found.append(attr.value)
                    elif attr.type == ir.AttributeType.GRAPHS:
                        found.extend(attr.value)
    return found


def _check_supported(model: ir.Model, graphs: list[ir.Graph], path: Path | None) -> None:
    """``graphs``: the model's graph and bodies (``ir_graphs``)."""
    where = f"{path}: " if path else ""
    if model.ir_version is not None and model.ir_version < MIN_IR_VERSION:
        raise UnsupportedModelError(
            f"{where}IR version {model.ir_version} is older than the oldest supported ({MIN_IR_VERSION}, which "
            f"introduced opset imports); re-export the model with a newer exporter")
    if model.ir_version is not None and model.ir_version > onnx.IR_VERSION:
        raise UnsupportedModelError(
            f"{where}IR version {model.ir_version} is newer than this onnx ({onnx.__version__}) supports "
            f"(max {onnx.IR_VERSION}); upgrade onnx")
    functions = {(f.domain, f.name) for f in model.functions.values()}
    ops = {(n.domain, n.op_type) for graph in graphs for n in graph}
    missing = sorted({domain for domain, op in ops if domain not in ("", "ai.onnx")
                      and domain not in model.opset_imports and (domain, op) not in functions})
    if missing:  # (onnx.checker and onnxruntime refuse such a model: 'No opset import for domain')
        raise UnsupportedModelError(f"{where}the model uses ops of domain {missing[0]!r} but imports no opset for it; "
                                    f"add one (onnx.helper.make_opsetid({missing[0]!r}, 1))")
    opset = model.opset_imports.get("", model.opset_imports.get("ai.onnx"))
    if opset is None:
        if any(domain in ("", "ai.onnx") for domain, _ in ops):
            raise UnsupportedModelError(f"{where}the model uses ai.onnx ops but imports no ai.onnx opset")
        return
    newest = onnx.defs.onnx_opset_version()
    if opset < MIN_OPSET or opset > newest:
        raise UnsupportedModelError(
            f"{where}ai.onnx opset {opset} is outside the supported range {MIN_OPSET}..{newest}; "
            f"convert it first (onnx.version_converter.convert_version)")
    _check_required_attributes(graphs, opset, where)


def _check_required_attributes(graphs: list[ir.Graph], opset: int, where: str) -> None:
    """A node without an attribute its schema requires (a Loop without its body, a Cast without
    ``to``) is not valid ONNX: onnx.checker and onnxruntime refuse it. Unchecked, the rewrite
    could not type what follows it and wrote a copy saying there was nothing to rewrite."""
    required: dict[str, tuple[str, ...]] = {}  # by op type, at the model's opset
    for node in (n for graph in graphs for n in graph):
        if node.domain not in ("", "ai.onnx"):
            continue
        names = required.get(node.op_type)
        if names is None:
            try:
                schema = onnx.defs.get_schema(node.op_type, opset)
            except onnx.defs.SchemaError:
                names = ()  # (an op onnx does not know: said elsewhere, when it matters)
            else:
                names = tuple(name for name, attr in schema.attributes.items() if attr.required)
            required[node.op_type] = names
        missing = [name for name in names if name not in node.attributes]
        if missing:
            label = node.name or (node.outputs[0].name if node.outputs else node.op_type)
            raise ModelLoadError(
                f"{where}node {label!r} ({node.op_type}) lacks its required attribute {missing[0]!r}: the model is "
                f"not valid ONNX (onnx.checker.check_model refuses it too); fix the exporter or the graph")


def _sort(model: ir.Model, path: Path | None) -> None:
    """ONNX requires topological order; onnxruntime accepts any acyclic order, so sort what is
    merely unsorted (our copy, never the input file) and report a cycle by its nodes."""
    try:
        model.graph.sort()
    except ValueError:
        where = f"{path}: " if path else ""
        raise ModelLoadError(f"{where}the graph has a cycle ({_describe_cycle(model)}); an ONNX graph must be "
                             f"acyclic (use Loop for recurrence)") from None


def _sort_and_type(model: ir.Model, path: Path | None, infer_shapes: bool, *, sort: bool = True) -> None:
    if sort:
        _sort(model, path)
    if infer_shapes:
        with _quiet_onnx_ir():
            _infer_types(model)


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

    for graph in ir_graphs(model):
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


# A model this large (serialised) has its types inferred after loading, by onnx-ir's pass, which
# also leaves the weights out of what it serialises. (The pass checks types, so it types a few
# more optional outputs, such as Dropout-7 masks; these models have always taken that path.)
_INFER_PROTO_BELOW = 256 << 20
# Initializers with more elements than this are weights, not shape data (Reshape targets, axes,
# pads): shape inference reads them as graph inputs of the same type and shape, never their data.
_INFER_WITHOUT_DATA_ABOVE = 1024


def _keep_denotations(declared: onnx.TypeProto, inferred: onnx.TypeProto) -> None:
    """Put back the denotations shape inference drops where it refines a declared output type
    (a dim it computes afresh comes back without the ``DATA_BATCH`` the model gave it)."""
    if declared.denotation and not inferred.denotation:
        inferred.denotation = declared.denotation
    kind = declared.WhichOneof("value")
    if kind is None or kind != inferred.WhichOneof("value"):
        return
    if kind in ("sequence_type", "optional_type"):
        _keep_denotations(getattr(declared, kind).elem_type, getattr(inferred, kind).elem_type)
        return
    if kind == "map_type":
        _keep_denotations(declared.map_type.value_type, inferred.map_type.value_type)
        return
    was, now = getattr(declared, kind), getattr(inferred, kind)
    if not was.HasField("shape") or not now.HasField("shape") or len(was.shape.dim) != len(now.shape.dim):
        return
    for old, new in zip(was.shape.dim, now.shape.dim):
        if old.denotation and not new.denotation:
            new.denotation = old.denotation


def _inferred_proto(proto: onnx.ModelProto, graphs: list[onnx.GraphProto], size: int, *, owned: bool,
                    base: Path | None = None) -> tuple[onnx.ModelProto, list[dict[str, onnx.ValueInfoProto]]] | None:
    """Shape inference on the proto already in hand (``graphs``: its graph and nested bodies,
    ``size``: its serialised size): the proto with its graph outputs' types refined, and the
    types and shapes found for the other values, one table per graph (``_graph_protos`` order).
    ``owned``: the proto may be edited in place; otherwise the argument is left untouched. None:
    not inferred here (the onnx-ir pass runs after loading).

    The tables go to the IR builder, not into the proto's value_info: onnx-ir would deserialise
    every entry into its own type and shape objects (and the emitter write them all back out),
    about a second on a 100k-node graph, and the output would carry value_info the input never
    had.

    Cheaper than onnx-ir's pass, which serialises the deserialised model and merges the result
    back: on a 100k-node graph that round trip was the largest fixed cost. Inference serialises
    the proto it is given and parses its answer back, so a model with weights is inferred without
    them (as onnx-ir's pass does) and only the types found are copied into it."""
    if size > _INFER_PROTO_BELOW:
        return None
    options = {"check_type": False, "strict_mode": False, "data_prop": False}
    try:
        weighty = any(_is_weight(t) or t.data_location == onnx.TensorProto.EXTERNAL for t in proto.graph.initializer)
        inferred = onnx.shape_inference.infer_shapes(_without_weights(proto, base=base) if weighty else proto,
                                                     **options)
    except Exception:  # inference is best effort
        return None
    nested = len(graphs) > 1  # (else the bodies' walk over every node is skipped)
    if not owned:
        proto = _copy(proto)
        graphs = _graph_protos(proto.graph) if nested else [proto.graph]
    tables = []
    for graph, inferred_graph in zip(graphs, _graph_protos(inferred.graph) if nested else [inferred.graph],
                                     strict=True):
        declared = list(graph.output)
        del graph.output[:]  # refined output types (a graph output's type is part of the model)
        graph.output.extend(inferred_graph.output)
        for before, after in zip(declared, graph.output, strict=True):
            _keep_denotations(before.type, after.type)
        tables.append({info.name: info for info in inferred_graph.value_info})
    for index, body in _foreign_bodies(proto.graph) if nested else ():
        for offset, table in enumerate(_inferred_body(body, proto, options)):
            tables[index + offset] = {**table, **tables[index + offset]}
    return proto, tables


# Domains whose ops onnx's shape inference knows (it types what their bodies compute, if any)
_INFERRED_DOMAINS = frozenset({"", "ai.onnx", "ai.onnx.ml", "ai.onnx.preview.training"})


def _foreign_bodies(graph: onnx.GraphProto) -> list[tuple[int, onnx.GraphProto]]:
    """(position in ``_graph_protos(graph)``, body) of each graph attribute of a node in a domain
    onnx's shape inference does not know (com.microsoft's BeamSearch, GreedySearch...): it does
    not enter them, so nothing they compute was typed. The outermost such bodies only."""
    found: list[tuple[int, onnx.GraphProto]] = []
    position = 0

    def walk(g: onnx.GraphProto, inside: bool) -> None:
        nonlocal position
        position += 1  # (g's own place)
        for node in g.node:
            foreign = node.domain not in _INFERRED_DOMAINS
            for attr in node.attribute:
                subs = [attr.g] if attr.type == onnx.AttributeProto.GRAPH else \
                    list(attr.graphs) if attr.type == onnx.AttributeProto.GRAPHS else []
                for sub in subs:
                    if foreign and not inside:
                        found.append((position, sub))
                    walk(sub, inside or foreign)

    walk(graph, False)
    return found


def _inferred_body(body: onnx.GraphProto, proto: onnx.ModelProto, options: dict[str, Any]
                   ) -> list[dict[str, onnx.ValueInfoProto]]:
    """Shape inference on a foreign op's body as a model of its own (its weights as typed inputs;
    a value it reads from the enclosing graph stays untyped): one table per graph, the body and
    its nested bodies in ``_graph_protos`` order; [] where inference fails."""
    alone = onnx.ModelProto()
    _copy_fields(alone, proto, skip="graph")  # (opsets, and the functions a body may call)
    _copy_fields(alone.graph, body, skip="initializer")
    inputs = {v.name for v in body.input}
    for tensor in body.initializer:
        if _is_weight(tensor) or tensor.data_location == onnx.TensorProto.EXTERNAL:
            if tensor.name not in inputs:
                alone.graph.input.append(onnx.helper.make_tensor_value_info(tensor.name, tensor.data_type,
                                                                            list(tensor.dims)))
        else:
            alone.graph.initializer.append(tensor)
    try:
        inferred = onnx.shape_inference.infer_shapes(alone, **options)
    except Exception:  # noqa: BLE001 - inference is best effort
        return []
    return [{info.name: info for info in g.value_info} for g in _graph_protos(inferred.graph)]


def _is_weight(tensor: onnx.TensorProto) -> bool:
    """Stored in the proto and larger than shape data. (Counted from the dims: ``ByteSize`` would
    encode the whole tensor to measure it.)"""
    if tensor.data_location == onnx.TensorProto.EXTERNAL:
        return False
    return _numel(tensor) > _INFER_WITHOUT_DATA_ABOVE


def _numel(tensor: onnx.TensorProto) -> int:
    count = 1
    for d in tensor.dims:
        count *= d
    return count


def attr_tensor(attr: ir.Attr):
    """A TENSOR attribute's tensor (``Attr.as_tensor`` without its check against a runtime
    Protocol, which costs ~70 µs a call on Python 3.11: thousands of Constant nodes add up)."""
    if attr.type != ir.AttributeType.TENSOR:
        raise TypeError(f"attribute {attr.name!r} is not a tensor but {attr.type.name}")
    return attr.value


def constant_node_tensor(n: ir.Node):
    """A float Constant node's value as a tensor, whichever attribute holds it (``value``, or the
    ``value_float``/``value_floats`` shorthands); None for another kind. The node is not changed."""
    attrs = n.attributes
    if "value" in attrs:
        return attr_tensor(attrs["value"])
    if "value_float" in attrs:
        return ir.tensor(np.array(attrs["value_float"].as_float(), np.float32))
    if "value_floats" in attrs:
        return ir.tensor(np.array(list(attrs["value_floats"].as_floats()), np.float32))
    return None


def constant_array(value) -> np.ndarray | None:
    """The data of a constant IR value (an initializer, or a Constant node's in any of its float
    spellings) as an array; None where there is none or it cannot be read (unreadable data is the
    loader's concern, not its readers')."""
    if value.is_initializer:
        tensor = value.origin.const_value if value.origin is not None else None
    else:
        origin = value.producer.origin if value.producer is not None else None
        tensor = constant_node_tensor(origin) if origin is not None else None
    try:
        return tensor.numpy() if tensor is not None else None
    except Exception:  # noqa: BLE001
        return None


def structure_proto(source: OnnxSource) -> onnx.ModelProto | None:
    """The model as read, with its large initializers (in the file or external) turned into graph
    inputs of the same type and shape: a shape-inference tool's input, a fraction of the model's
    size whatever its weights. None where the source proto was not kept."""
    if source.proto is None:
        return None
    return _without_weights(source.proto, external_too=True,
                            base=source.path.parent if source.path is not None else None)


def _without_weights(proto: onnx.ModelProto, *, external_too: bool = False, base: Path | None = None
                     ) -> onnx.ModelProto:
    """A copy of ``proto`` whose large main-graph initializers are graph inputs of the same type
    and shape: what shape inference reads from them, without their data. ``external_too``: also
    those stored in external data (for a reader that would try to load them). A small tensor in
    external data (a Reshape's shape, saved with ``size_threshold=0``) is read in from ``base``,
    the model's folder: inference cannot follow the reference, and without its values the shapes
    after it were unknown where the same model stored inline had them (a fusion skipped on the
    first rewrite was made on the second)."""
    stripped = onnx.ModelProto()
    _copy_fields(stripped, proto, skip="graph")
    _copy_fields(stripped.graph, proto.graph, skip="initializer")
    inputs = {v.name for v in proto.graph.input}
    for tensor in proto.graph.initializer:
        external = tensor.data_location == onnx.TensorProto.EXTERNAL
        if external and _numel(tensor) <= _INFER_WITHOUT_DATA_ABOVE:
            stripped.graph.initializer.append(_read_in(tensor, base))
        elif (external and not external_too) or _numel(tensor) <= _INFER_WITHOUT_DATA_ABOVE:
            stripped.graph.initializer.append(tensor)
        elif tensor.name not in inputs:  # (IR < 4 lists initializers as inputs already)
            stripped.graph.input.append(onnx.helper.make_tensor_value_info(tensor.name, tensor.data_type,
                                                                           list(tensor.dims)))
    return stripped


def _read_in(tensor: onnx.TensorProto, base: Path | None) -> onnx.TensorProto:
    """A copy of a small external tensor with its data read in from ``base``; the tensor itself
    where that cannot be done safely (no folder, a location outside it, a short file): the
    loader reports a bad reference on its own."""
    from onnx.external_data_helper import ExternalDataInfo, load_external_data_for_tensor

    if base is None:
        return tensor
    try:
        folder = base.resolve()
        file = (folder / ExternalDataInfo(tensor).location).resolve()
        if folder not in file.parents or not file.is_file():
            return tensor
        copy = onnx.TensorProto()
        copy.CopyFrom(tensor)
        load_external_data_for_tensor(copy, str(folder))  # (offset and length: onnx's reader)
        del copy.external_data[:]
        copy.data_location = onnx.TensorProto.DEFAULT
        onnx.numpy_helper.to_array(copy)  # (a short read fails here: keep the reference)
        return copy
    except Exception:  # noqa: BLE001 - best effort, for shape inference only
        return tensor


def _copy_fields(dst, src, *, skip: str) -> None:
    """Copy every field that is set in protobuf message ``src`` into ``dst``, except ``skip``."""
    for field, value in src.ListFields():
        if field.name == skip:
            continue
        if field.is_repeated:
            getattr(dst, field.name).extend(value)
        elif field.type == field.TYPE_MESSAGE:
            getattr(dst, field.name).CopyFrom(value)
        else:
            setattr(dst, field.name, value)


def _copy(proto: onnx.ModelProto) -> onnx.ModelProto:
    copy = onnx.ModelProto()
    copy.CopyFrom(proto)
    return copy


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
_DTYPES = {int(d): d for d in DType}


class Slots(NamedTuple):
    """What an op's schema says about its slots at the model's opset, for one input and output
    count: computed once and shared (read-only) by every node of that op and arity."""

    inputs: tuple[str | None, ...]  # per input: its type-constraint group, or None for a fixed type
    outputs: tuple[str | None, ...]
    input_names: tuple[str, ...]  # the schema's formal input names
    group_types: dict[str, frozenset[str]]  # per group, the element types the schema allows ("float16", ...)
    # (onnxruntime's schemas) per (group, main group): a float group the node paints with its main
    # group where the model types both alike, as the kernels take them (see ``_joinable``)
    joins: tuple[tuple[str, str], ...] = ()
    # (onnxruntime's schemas) per output: the one element type its schema allows, else None
    output_types: tuple[DType | None, ...] = ()

    def apply(self, node: Node) -> None:
        ins, outs, group_types = self.inputs, self.outputs, self.group_types
        if self.joins:
            ins, outs, group_types = _join_groups(node, self)
        node.input_groups, node.output_groups = list(ins), list(outs)
        node.meta["input_names"] = self.input_names
        node.meta["group_types"] = group_types
        if self.output_types:
            node.meta["onnx.output_types"] = self.output_types


def _join_groups(node: Node, slots: Slots) -> tuple[tuple, tuple, dict[str, frozenset[str]]]:
    """The node's groups once each joinable group whose values the model types alike with its
    main group's (one float type between them, or none known) is painted as the main group: a
    GroupQueryAttention's FP32 KV cache goes low with its query (the CUDA kernel takes one type for
    both), an int8 cache keeps its own group."""
    ins, outs, group_types = slots.inputs, slots.outputs, slots.group_types
    if node.op_type == "LinearAttention" and node.domain in ("", "ai.onnx") and len(node.inputs) > 3 \
            and node.inputs[3] is not None:
        return ins, outs, group_types  # (a state carried in keeps its own type: FP32, as a running sum)
    for group, main in slots.joins:
        dtypes = {v.dtype for groups, values in ((ins, node.inputs), (outs, node.outputs))
                  for g, v in zip(groups, values) if g in (group, main) and v is not None and v.dtype is not None}
        if len(dtypes) > 1 or any(not d.is_float for d in dtypes):
            continue
        ins = tuple(main if g == group else g for g in ins)
        outs = tuple(main if g == group else g for g in outs)
        group_types = {**group_types, main: group_types[main] & group_types[group]}
        del group_types[group]
    return ins, outs, group_types


_LOW_TYPES = frozenset({"float16", "bfloat16"})


# Groups a contrib schema lets be low whose CUDA kernel takes in float only: GroupNorm's gamma and
# beta ("GroupNorm only supports gamma and beta in float type", NOT_IMPLEMENTED at run time; what
# onnxruntime's own float16 converter keeps FP32 as ALWAYS_FLOAT_INPUTS). Not joined: they keep FP32.
_KERNEL_FLOAT_GROUPS = {("com.microsoft", "GroupNorm"): frozenset({"M"}),
                        ("com.microsoft", "SkipGroupNorm"): frozenset({"M"})}


def _joinable(group_types: dict[str, frozenset[str]], ins: tuple, outs: tuple) -> tuple[tuple[str, str], ...]:
    """onnxruntime's contrib schemas list apart float groups that their kernels take in one type
    (GroupQueryAttention's KV cache T_CACHE and its query T, MatMulNBits' float zero points,
    SimplifiedLayerNormalization's X and scale): before these ops had groups, all their slots were
    painted together. They still are, except for groups whose schema pins them to types without a
    low one (LayerNorm statistics U: float only; k_scale; Attention's int32 mask_index): those keep
    their types. Returns (group, main group) pairs; the main group is that of the first output
    that may be a float, else of the first input."""
    floats = {"float", *_LOW_TYPES}
    slots = [g for g in (*outs, *ins) if g is not None]
    main = next((g for g in slots if group_types.get(g, frozenset()) & floats), None)
    if main is None:
        return ()
    joins = []
    for group in dict.fromkeys(slots):
        allowed = group_types.get(group, frozenset())
        if group != main and "float" in allowed and allowed & _LOW_TYPES and group_types[main] & allowed:
            joins.append((group, main))
    return tuple(joins)


@functools.lru_cache(maxsize=None)
def schema_slots(op: str, domain: str, opset: int | None, n_in: int, n_out: int) -> Slots:
    """Per slot: the type-constraint name (a group painted together) or None (a fixed type). An op
    with no schema, onnx's or onnxruntime's (a custom domain, a model-local function), is one
    group, "?". Cached: every node of an op and arity shares one (read-only) answer."""
    schema = _schema(op, domain or "", opset)
    if schema is None:
        return Slots(("?",) * n_in, ("?",) * n_out, (), {})
    type_vars = {tc.type_param_str for tc in schema.type_constraints}
    group_types = {tc.type_param_str: frozenset(t[len("tensor("):-1] for t in tc.allowed_type_strs
                                                if t.startswith("tensor("))
                   for tc in schema.type_constraints}
    ins = (None,) * n_in if op in _TYPE_AGNOSTIC_INPUTS else tuple(_expand(schema.inputs, n_in, type_vars, "in"))
    outs = tuple(_expand(schema.outputs, n_out, type_vars))
    for group in (*ins, *outs):  # a heterogeneous variadic slot is a group of its own, "V#0", typed as "V"
        if group is not None and "#" in group:
            group_types.setdefault(group, group_types.get(group.split("#", 1)[0], frozenset()))
    merged = _MERGED_GROUPS.get((domain or "", op))
    if merged:
        ins = tuple(merged.get(g, g) for g in ins)
        outs = tuple(merged.get(g, g) for g in outs)
        for old, into in merged.items():
            if old in group_types and into in group_types:  # (a later opset may name them otherwise)
                group_types[into] = group_types[into] & group_types.pop(old)
    # the output types a schema fixes (a single-type constraint, a concrete type): what types the
    # outputs of the ops shape inference has no type function for, onnxruntime's contrib ops and
    # onnx's own ai.onnx.ml ops (Scaler, Normalizer: tensor(float) whatever they read); onnx's
    # default-domain ops are typed by its inference
    output_types: tuple = ()
    if isinstance(schema, _OrtSchema) or (domain or "") not in ("", "ai.onnx"):
        single = {tc.type_param_str: _dtype_of(tc.allowed_type_strs[0]) for tc in schema.type_constraints
                  if len(tc.allowed_type_strs) == 1}
        fixed = tuple(single.get(g) if g is not None else _dtype_of(f.type_str) if f is not None else None
                      for g, f in zip(outs, _formals(schema.outputs, n_out)))
        output_types = fixed if any(fixed) else ()
    if not isinstance(schema, _OrtSchema):
        joins = tuple((g, main) for g, main in _JOINED_GROUPS.get((domain or "", op), ())
                      if g in group_types and main in group_types)  # (a later opset may name them otherwise)
        return Slots(ins, outs, tuple(f.name for f in schema.inputs), group_types, joins, output_types)
    joins = tuple(join for join in _joinable(group_types, ins, outs)
                  if join[0] not in _KERNEL_FLOAT_GROUPS.get((domain or "", op), ()))
    return Slots(ins, outs, tuple(f.name for f in schema.inputs), group_types, joins, output_types)


def _formals(formals, count: int) -> list:
    """The formal parameter of each of ``count`` slots (a variadic last one repeats), or None."""
    out = []
    for i in range(count):
        if not formals or (i >= len(formals)
                           and formals[-1].option != onnx.defs.OpSchema.FormalParameterOption.Variadic):
            out.append(None)
        else:
            out.append(formals[min(i, len(formals) - 1)])
    return out


def _dtype_of(type_str: str) -> DType | None:
    """``tensor(float)`` -> DType.FLOAT; None for anything else (a sequence, a type variable)."""
    if not (type_str.startswith("tensor(") and type_str.endswith(")")):
        return None
    return DType.__members__.get(type_str[len("tensor("):-1].upper())


@functools.lru_cache(maxsize=None)
def _schema(op: str, domain: str, opset: int | None):
    """The op's schema at ``opset``: onnx's, else onnxruntime's (its contrib ops: com.microsoft's,
    and those it registers in the default domain, such as LayerNormalization below opset 17 and
    SimplifiedLayerNormalization, which its optimizers write and it loads); None where neither
    has one."""
    if opset is None:
        return None
    try:
        return onnx.defs.get_schema(op, opset, domain)
    except onnx.defs.SchemaError:
        pass
    versions = [s for s in _ort_schemas().get(("" if domain == "ai.onnx" else domain, op), ())
                if s.since_version <= opset]
    return _OrtSchema.of(versions[-1]) if versions else None


def has_ort_schema_only(op: str, domain: str, opset: int | None) -> bool:
    """Whether only onnxruntime knows the op at this opset (a contrib op, in any domain)."""
    return isinstance(_schema(op, domain or "", opset), _OrtSchema)


@functools.lru_cache(maxsize=1)
def _ort_schemas() -> dict[tuple[str, str], tuple]:
    """onnxruntime's registered schemas per (domain, op), oldest first; {} without onnxruntime."""
    from .._console import interrupts_held

    try:
        with interrupts_held():
            from onnxruntime.capi import _pybind_state

            schemas = _pybind_state.get_all_operator_schema()
    except (ImportError, AttributeError, RuntimeError):
        return {}
    index: dict[tuple[str, str], list] = {}
    for s in schemas:
        index.setdefault((s.domain, s.name), []).append(s)
    return {key: tuple(sorted(found, key=lambda s: s.since_version)) for key, found in index.items()}


class _Formal(NamedTuple):
    """An onnxruntime formal parameter, spelt as onnx's (``type_str``, ``option``, ``is_homogeneous``)."""

    name: str
    type_str: str
    option: Any
    is_homogeneous: bool


class _OrtSchema(NamedTuple):
    """An onnxruntime schema with onnx's attribute names, as the slot code reads them."""

    name: str
    domain: str
    since_version: int
    inputs: tuple[_Formal, ...]
    outputs: tuple[_Formal, ...]
    type_constraints: tuple
    max_input: int

    @staticmethod
    def of(schema) -> "_OrtSchema":
        option = onnx.defs.OpSchema.FormalParameterOption

        def formals(params):
            return tuple(_Formal(f.name, f.typeStr, option(int(f.option)), f.isHomogeneous) for f in params)

        return _OrtSchema(schema.name, schema.domain, schema.since_version, formals(schema.inputs),
                          formals(schema.outputs), tuple(schema.type_constraints), schema.max_input)


class _Unsorted(Exception):
    """A node reads a value that a node the builder has not reached yet produces."""


class _Builder:
    def __init__(self, opsets: dict[str, int], ir_version: int | None = None,
                 inferred: list[dict[str, onnx.ValueInfoProto]] | None = None, *,
                 functions: set[tuple[str, str]] = frozenset(), retyped: list[str] = ()) -> None:
        self.opsets = opsets
        # (_trust_actual_types: declarations read as the model makes the values; a type conflict names them)
        self.retyped = retyped
        self.ir_version = ir_version
        self.functions = functions  # (domain, name) of the model-local functions
        # shape inference's answer, one table per graph in the order build_graph meets them
        # (the graph, then each node's bodies in node and attribute order, depth first)
        self._tables = iter(inferred) if inferred is not None else None
        self._types: dict[str, onnx.ValueInfoProto] = {}
        self._parsed: dict[bytes, tuple[DType | None, tuple | None, str | None]] = {}
        # the values that are a sequence or an optional (by id): their element type is fixed from
        # producer to every reader, so a node reading or making one keeps its types
        self._containers: dict[int, str] = {}

    def build_graph(self, g: ir.Graph, outer: dict[int, Value], parent: Node | None = None) -> Graph:
        enclosing = self._types
        self._types = next(self._tables, {}) if self._tables is not None else {}
        try:
            return self._build_graph(g, outer, parent)
        finally:
            self._types = enclosing

    def _build_graph(self, g: ir.Graph, outer: dict[int, Value], parent: Node | None) -> Graph:
        graph = Graph(g.name or "", origin=g)
        graph.parent = parent
        graph.opsets = self.opsets
        scope: dict[int, Value] = dict(outer)
        listed: set[str] = set()
        for v in g.inputs:
            # (onnx-ir reads an input listed twice; the checker and onnxruntime refuse the model)
            if v.name in listed:
                raise ModelLoadError(f"graph {g.name!r}: input {v.name!r} is listed twice; every graph input needs "
                                     f"a name of its own (onnxruntime rejects the model too): remove or rename one")
            listed.add(v.name)
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
        names: set[str] = set()
        for n in g:
            node = self._node(n, scope)
            if node.name:  # (onnx-ir reads a node name given twice; onnxruntime rejects the model)
                if node.name in names:
                    raise ModelLoadError(f"graph {g.name!r}: two nodes are named {node.name!r}; node names must be "
                                         f"unique (onnxruntime rejects the model too): rename one")
                names.add(node.name)
            graph.append(node)
        for v in g.outputs:
            if id(v) not in scope:
                raise ModelLoadError(f"graph {g.name!r}: output {v.name!r} is not produced by any node or input")
            graph.outputs.append(scope[id(v)])
        return graph

    def _value(self, v: ir.Value) -> Value:
        dtype = v.dtype
        if dtype is None:
            info = self._types.get(v.name)
            if info is not None:
                return self._inferred_value(v, info)
        shape = v.shape
        if shape is not None:
            # (an unknown dim is a SymbolicDim whose value is None, which str() spells "None": written back
            # so, onnxruntime took every such dim for one symbol and re-used too small a buffer)
            # (a negative dim_value, as paddle2onnx writes a dynamic dim, is unknown too: onnxruntime
            # reads it so, and a size of -1 made cast bytes negative)
            shape = tuple((d if d >= 0 else None) if isinstance(d, int) else (getattr(d, "value", None) or None)
                          for d in shape.dims)
        value = Value(v.name or "", _DTYPES.get(int(dtype)) if dtype is not None else None, shape, origin=v)
        kind = "sequence" if isinstance(v.type, ir.SequenceType) else \
            "optional" if isinstance(v.type, ir.OptionalType) else None
        if kind:
            self._containers[id(value)] = kind
            value.meta["onnx.container"] = kind
        return value

    def _inferred_value(self, v: ir.Value, info: onnx.ValueInfoProto) -> Value:
        """A value typed from shape inference's answer (the onnx-ir value has no type)."""
        # Most values share a few types (a 100k-node graph has a handful): each distinct one is
        # read once, keyed by its encoding (a C call, cheaper than walking the dims in Python).
        key = info.type.SerializeToString()
        parsed = self._parsed.get(key)
        if parsed is None:
            parsed = self._parsed[key] = _parse_type(info.type)
        value = Value(v.name, parsed[0], parsed[1], origin=v)
        if parsed[2]:
            self._containers[id(value)] = parsed[2]
            value.meta["onnx.container"] = parsed[2]
        return value

    def _node(self, n: ir.Node, scope: dict[int, Value]) -> Node:
        op_type, domain, ir_inputs, ir_outputs = n.op_type, n.domain, n.inputs, n.outputs
        try:
            inputs = [scope[id(v)] if v is not None else None for v in ir_inputs]
        except KeyError:
            self._unreachable_input(n, scope)
            raise
        outputs = [self._value(v) for v in ir_outputs]
        node = Node(op_type, inputs, name=n.name or "", domain=domain, outputs=outputs, origin=n)
        node.opset = self.opsets.get(node.domain)
        props = n.metadata_props
        if props and props.get("amp_rewrite.category") == "deny" and props.get("amp_rewrite.precision") == "fp32":
            node.meta["amp.kept_fp32_by"] = props.get("amp_rewrite.source", "")  # (an earlier rewrite's tags)
        if props and props.get("amp_rewrite.unfused"):
            node.meta["onnx.unfused"] = True  # an earlier rewrite left its pattern unfused for a user's pin
        if props and props.get("amp_rewrite.inserted") == "saturate":
            node.meta["onnx.given_saturate"] = True  # (an earlier rewrite's clamp: not one of the model's nodes)
        attributes = n.attributes
        if attributes or op_type == "ConstantOfShape":  # (most nodes have no attributes)
            node.attrs = _interesting_attrs(n)
        for v, out in zip(ir_outputs, outputs):
            scope[id(v)] = out
        if op_type == "Constant" and node.domain == "":
            for out in outputs:
                _fill_const_from_attr(out, n)
        if attributes:
            for attr_name, attr in attributes.items():
                if attr.type == ir.AttributeType.GRAPH:
                    node.subgraphs[attr_name] = [self.build_graph(attr.as_graph(), scope, node)]
                elif attr.type == ir.AttributeType.GRAPHS:
                    node.subgraphs[attr_name] = [self.build_graph(sg, scope, node) for sg in attr.as_graphs()]
        opset = self.opsets.get("" if domain == "ai.onnx" else domain or "")
        if domain in ("", "ai.onnx") and _schema(op_type, "", opset) is None \
                and (domain, op_type) not in self.functions:
            raise ModelLoadError(_unknown_op(n, opset))
        schema_slots(op_type, domain, opset, len(inputs), len(outputs)).apply(node)
        # amp.refuses_low: why the node keeps FP32 whatever the rules say (classify reads it)
        if (domain, op_type) in self.functions:
            # its body is not rewritten, and a Constant or Cast in it fixes its own type: a call given
            # low inputs made a model the checker and onnxruntime refuse ('B has inconsistent type')
            node.meta["amp.function_call"] = True
            node.meta["amp.refuses_low"] = (
                f"calls the model-local function {domain}:{op_type}, whose body is not rewritten (its constants "
                f"and casts keep their types); inlined, what it computes is rewritten (the default: the "
                f"summary's note says why it was not)")
        elif op_type == "Einsum" and domain in ("", "ai.onnx"):
            summed = _einsum_reduction(n)
            if summed:
                node.meta["amp.refuses_low"] = (
                    f"Einsum {summed[0]!r} sums over {', '.join(summed[1])}, which only one operand holds: a reduction, "
                    f"not a GEMM contraction, whose sum can pass the low type's range as ReduceSum's does")
            elif len(inputs) >= 3:
                node.meta["amp.refuses_low"] = (
                    f"Einsum of {len(inputs)} operands: onnxruntime's CUDA kernel computes it as pairwise products "
                    f"and keeps each in the low type, so an intermediate past its range is inf (NaN after) where "
                    f"the result fits")
            elif len(inputs) == 2 and inputs[0] is not None and inputs[0] is inputs[1]:
                equation = _einsum_equation(n)
                if equation and one_subscript_twice(equation):
                    node.meta["amp.einsum_square"] = equation  # (classify: squares, as Pow(x, 2) makes)
        elif op_type == "BatchNormalization" and domain in ("", "ai.onnx") and _trains(n, opset):
            node.meta["amp.refuses_low"] = (
                f"{'training_mode=1' if (opset or 15) >= 14 else 'the training form (its statistics outputs)'}: it "
                "computes the batch's mean and variance (a reduction over every element of a "
                "channel) and the running statistics; and onnxruntime's Conv+BatchNormalization fusion ignores "
                "training_mode, which the Cast on a low node's statistics outputs lets fire (0.9 relative error at "
                "the default optimisation level)")
            for stat in node.outputs[1:3]:  # (and a Cast on them as graph outputs, --no-keep-io-types, too)
                if stat is not None:
                    stat.meta["amp.keeps_io_type"] = True
        elif op_type == "TreeEnsemble" and domain == "ai.onnx.ml":
            node.meta["amp.refuses_low"] = (
                "TreeEnsemble keeps its split thresholds and leaf weights in tensor attributes of its input's "
                "type, and onnxruntime has no float16 kernel for it (CPU: float and double; CUDA: none): low, "
                "the model would load nowhere, and rounded thresholds would send samples down other branches")
        elif op_type in ("ScatterElements", "ScatterND") and domain in ("", "ai.onnx"):
            reduction = n.attributes.get("reduction")
            reduction = reduction.as_string() if reduction is not None else "none"
            if reduction in ("add", "mul"):
                # (torch.autocast runs scatter_add in the widest input type: FP32 for an FP32 base)
                node.meta["amp.refuses_low"] = (
                    f"{op_type} with reduction={reduction!r} accumulates every update that lands on one index: "
                    f"in the low type each partial result is rounded (a sum of ones stops at 2048 in FP16), so "
                    f"it computes in FP32 as a reduction does")
        if (domain, op_type) not in _MERGED_GROUPS:  # (Attention-23 may type V apart from Q and K)
            conflict = group_conflict(node)
            if conflict:
                corrected = f" (read as the model makes them, not as declared: {retyped_summary(self.retyped)})" \
                    if self.retyped else ""
                raise ModelLoadError(_declared_type_conflict(node, *conflict) + corrected)
            if domain in ("", "ai.onnx", "ai.onnx.ml"):
                refused = _type_not_allowed(node)
                if refused:
                    raise ModelLoadError(refused)
            if any(v.dtype is None for v in outputs):
                self._type_from_group(node)
        if self._containers:
            kind = next((self._containers[id(v)] for v in (*inputs, *outputs)
                         if v is not None and id(v) in self._containers), None)
            if kind:  # (painting either end would leave the other reading the wrong type, whatever the rules say)
                node.meta["amp.keeps_types"] = (f"it reads or makes a {kind}, whose element type no Cast can "
                                                f"change: it keeps the types it was written with")
        return node

    def _type_from_group(self, node: Node) -> None:
        """Type an output shape inference left untyped from an input of its schema's type group (the
        schema says they are one type). onnx's inference skips a body value that shadows an outer
        name, as onnxruntime allows: untyped, the body's MatMul kept FP32 and a second rewrite,
        which reads it renamed, painted it low."""
        _type_from_schema(node, self._containers)

    @staticmethod
    def _unreachable_input(n: ir.Node, scope: dict[int, Value]) -> None:
        """Raise the reason a node's input is not in scope: produced later (unsorted) or by nothing."""
        for i, v in enumerate(n.inputs):
            if v is None or id(v) in scope:
                continue
            if v.producer() is not None:
                raise _Unsorted(
                    f"node {n.name or n.op_type!r} ({n.op_type}) reads {v.name!r} (input {i}) from outside the "
                    f"scope that produces it (a value made in an If/Loop/Scan body is visible only there)")
            raise ModelLoadError(
                f"node {n.name or n.op_type!r} ({n.op_type}) reads {v.name!r} (input {i}), which nothing "
                f"produces (a dangling input: no node, graph input or initializer has that name)")


def check_rule_input_names(book) -> None:
    """A rule's ``fp32_inputs`` names must be inputs of its op (at some opset): a misspelt name
    would pin nothing, silently. (The rule book itself imports no onnx; the ONNX edge checks.)"""
    import difflib

    from ..errors import RuleFileError

    for entry in book.entries():
        if not entry.fp32_inputs:
            continue  # (most entries: nothing to check, and no file and key to look up)
        names = [item for item in entry.fp32_inputs if isinstance(item, str)]
        known = _schema_input_names(entry.op, entry.domain) if names else ()
        shown, key = book.file_and_key(entry)
        for name in names:
            if known and name not in known:
                close = difflib.get_close_matches(name, known, n=1, cutoff=0.5)
                raise RuleFileError(shown, f"{key}.fp32_inputs", f"{name!r} is not an input of {entry.op} (its "
                                    f"inputs: {', '.join(known)})", close[0] if close else None)
        indices = [item for item in entry.fp32_inputs if isinstance(item, int)]
        most = _schema_max_inputs(entry.op, entry.domain) if indices else None
        for index in indices:
            if most is not None and index >= most:
                raise RuleFileError(shown, f"{key}.fp32_inputs", f"input index {index} is out of range: {entry.op} "
                                    f"takes at most {most} input{'s' if most != 1 else ''} (indices 0..{most - 1})")


@functools.lru_cache(maxsize=None)
def _schema_max_inputs(op: str, domain: str) -> int | None:
    """The most inputs any schema of the op has had; None where no schema knows the op or one
    takes any number (a variadic last input)."""
    most = max((s.max_input for s in _all_schemas(op, domain)), default=None)
    return None if most is None or most >= 2**31 - 1 else most


@functools.lru_cache(maxsize=None)
def _schema_input_names(op: str, domain: str) -> tuple[str, ...]:
    """Every input name the op's schemas have had, oldest first; () where no schema knows the op."""
    names: list[str] = []
    for schema in _all_schemas(op, domain):
        names += [f.name for f in schema.inputs if f.name not in names]
    return tuple(names)


@functools.lru_cache(maxsize=None)
def _all_schemas(op: str, domain: str) -> tuple:
    """Every schema the op has had, oldest first: onnx's, or for an op onnx has no schema for
    (onnxruntime's contrib ops, com.microsoft and others) onnxruntime's own; () where neither knows it."""
    try:
        newest = onnx.defs.get_schema(op, domain).since_version
    except onnx.defs.SchemaError:
        return _ort_schemas().get((domain, op), ())
    found = []
    for version in range(1, newest + 1):
        try:
            schema = onnx.defs.get_schema(op, version, domain)
        except onnx.defs.SchemaError:
            continue
        if not found or found[-1].since_version != schema.since_version:
            found.append(schema)
    return tuple(found)


def _declared_type_conflict(node: Node, group: str, first: Value, other: Value) -> str:
    """A model that declares a value's type wrongly (a stale value_info entry) is bad input, not an
    internal failure: what the verifier would find after the passes, said of the input."""
    label = node.name or f"{node.op_type}:{node.outputs[0].name if node.outputs else ''}"
    return (f"node {label!r} ({node.qualified_op}) reads or writes {first.name!r} as {first.dtype.short} and "
            f"{other.name!r} as {other.dtype.short}, which its schema types alike (type {group.split('#')[0]}); a "
            f"value_info entry (or a graph input or output) that declares the wrong type? "
            f"onnx.checker.check_model(full_check=True) rejects the model too")


def _type_not_allowed(node: Node) -> str | None:
    """Why the node's schema refuses the type a value is declared (a float type its type variable
    does not list at the model's opset: QuantizeLinear-13 reading float16, which both peers write
    for a QDQ model); None where every declared float type is one it takes. onnxruntime refuses
    such a model on load; the rewrite would copy the declaration into its output."""
    group_types = node.meta.get("group_types")
    if not group_types or has_ort_schema_only(node.op_type, node.domain, node.opset):
        return None
    slots = [("input", i, g, v) for i, (g, v) in enumerate(zip(node.input_groups, node.inputs))]
    slots += [("output", i, g, v) for i, (g, v) in enumerate(zip(node.output_groups, node.outputs))]
    for side, index, group, value in slots:
        allowed = group_types.get(group) if group is not None else None
        if not allowed or value is None or value.dtype is None or not value.dtype.is_float:
            continue
        name = value.dtype.name.lower()  # (onnx's type strings: "float16", "bfloat16", "float", "double")
        if name in allowed:
            continue
        label = node.name or f"{node.op_type}:{node.outputs[0].name if node.outputs else ''}"
        floats = ", ".join(sorted(t for t in allowed if t.startswith(("float", "bfloat", "double")))) or "none"
        verb = "reads" if side == "input" else "writes"
        since = _first_opset_allowing(node.op_type, node.domain, group.split("#")[0], name, node.opset)
        fix = (f"{node.op_type} takes {name} there from opset {since}: convert the model "
               f"(onnx.version_converter.convert_version) or " if since else "")
        return (f"node {label!r} ({node.qualified_op}, opset {node.opset}) {verb} {value.name!r} as "
                f"{value.dtype.short}, a type its schema does not take there (its {side} {index}, type "
                f"{group.split('#')[0]}, takes {floats}); onnxruntime refuses the model too. Was it converted "
                f"to FP16 by another tool? {fix}rewrite the FP32 original instead")
    return None


def _first_opset_allowing(op: str, domain: str, group: str, type_name: str, opset: int | None) -> int | None:
    """The first opset after ``opset`` whose schema of the op lets ``group`` be ``type_name``."""
    for schema in _all_schemas(op, "" if domain == "ai.onnx" else domain):
        if opset is not None and schema.since_version <= opset:
            continue
        for tc in schema.type_constraints:
            if tc.type_param_str == group and f"tensor({type_name})" in tc.allowed_type_strs:
                return schema.since_version
    return None


def _unknown_op(n: ir.Node, opset: int | None) -> str:
    """Why an ai.onnx node has no operator: not one at the model's opset, or not one at all."""
    article = "an" if n.op_type[:1].lower() in "aeiou" else "a"
    label = f"node {n.name!r} ({n.op_type})" if n.name else f"{article} {n.op_type} node"
    # the first opset that has the op (get_schema at the newest opset gives its newest version)
    since = min((s.since_version for s in onnx.defs.get_all_schemas_with_history()
                 if s.name == n.op_type and s.domain == ""), default=None)
    if since is not None:
        return (f"{label}: {n.op_type} is an ai.onnx operator only from opset {since}, and the model imports "
                f"opset {opset}; convert the model (onnx.version_converter.convert_version) or fix the op")
    return (f"{label}: ai.onnx has no operator {n.op_type!r} (onnx {onnx.__version__}); a custom op needs its "
            f"own domain (e.g. domain=\"com.example\") with an opset import for it")


_CONTAINERS = {"sequence_type": "sequence", "optional_type": "optional"}


def _parse_type(type_proto: onnx.TypeProto) -> tuple[DType | None, tuple | None, str | None]:
    """A TypeProto's tensor dtype and shape (None where not a tensor, or not known), and
    "sequence" or "optional" where it is one of those."""
    if not type_proto.HasField("tensor_type"):
        return None, None, _CONTAINERS.get(type_proto.WhichOneof("value"))
    tensor = type_proto.tensor_type
    shape = None
    if tensor.HasField("shape"):
        shape = tuple((d.dim_value if d.dim_value >= 0 else None) if d.HasField("dim_value") else (d.dim_param or None)
                      for d in tensor.shape.dim)
    return (_DTYPES.get(tensor.elem_type) if tensor.elem_type else None), shape, None


def _expand(formals, count: int, type_vars: set[str], side: str = "") -> list[str | None]:
    """Per slot of ``count``: its type-constraint name, or None (a fixed type). A heterogeneous
    variadic slot (If/Loop/Scan) is a group of its own, and an input's is never an output's: Loop's
    carried values start at input 2 and output 0, and Scan's scan inputs and outputs share no type
    (an int64 counter beside an FP32 cache was taken for a type clash)."""
    out: list[str | None] = []
    for i in range(count):
        if not formals:
            out.append(None)
            continue
        formal = formals[min(i, len(formals) - 1)]
        if i >= len(formals) and formal.option != onnx.defs.OpSchema.FormalParameterOption.Variadic:
            out.append(None)
            continue
        if formal.type_str not in type_vars:
            out.append(None)
        elif formal.option == onnx.defs.OpSchema.FormalParameterOption.Variadic and not formal.is_homogeneous:
            out.append(f"{formal.type_str}#{side}{i}")  # If/Loop/Scan: each slot has a type of its own
        else:
            out.append(formal.type_str)
    return out


def one_subscript_twice(equation: str) -> bool:
    """Whether an Einsum equation takes two operands under one subscript (``bd,bd->b``): of one
    value twice, it squares it (and may sum the squares)."""
    operands = equation.replace(" ", "").partition("->")[0].split(",")
    return len(operands) == 2 and operands[0] == operands[1]


def _trains(node: ir.Node, opset: int | None) -> bool:
    """Whether a BatchNormalization computes batch statistics: ``training_mode=1`` from opset 14;
    before it, the training form is the one with its statistics outputs (running mean and variance,
    saved mean and variance; opset 6 and earlier also say ``is_test=0``)."""
    attribute = node.attributes.get("training_mode")
    if opset is None or opset >= 14:
        return attribute is not None and attribute.as_int() == 1
    test = node.attributes.get("is_test")
    if opset <= 6 and test is not None and test.as_int() == 1:
        return False
    return any(v is not None and v.name for v in list(node.outputs)[1:])


def _einsum_equation(n: ir.Node) -> str | None:
    attr = n.attributes.get("equation") if n.attributes else None
    try:
        return attr.as_string() if attr is not None else None
    except Exception:  # noqa: BLE001 - an unreadable attribute: the checker's concern
        return None


def _einsum_reduction(n: ir.Node) -> tuple[str, list[str]] | None:
    """(equation, the summed labels) where an Einsum sums a label that only one operand holds
    (``ij->``, ``ii->``, ``ij,jk->i``: a reduction, as ReduceSum is); None for pure contractions,
    transposes and diagonals (``ij,jk->ik``, ``ij->ji``, ``ii->i``) or an equation it cannot read."""
    equation = _einsum_equation(n)
    if not equation:
        return None
    text = equation.replace(" ", "").replace("...", "")
    lhs, arrow, rhs = text.partition("->")
    operands = lhs.split(",")
    if not arrow:  # implicit output: the labels that occur once, in alphabetical order
        counts = {c: lhs.count(c) for c in set(lhs) if c.isalpha()}
        rhs = "".join(sorted(c for c, k in counts.items() if k == 1))
    summed = sorted({c for c in lhs if c.isalpha() and c not in rhs
                     and sum(c in operand for operand in operands) == 1})
    return (equation, summed) if summed else None


def _interesting_attrs(n: ir.Node) -> dict[str, Any]:
    """Only the attributes the passes read: float-type-carrying ones."""
    attrs: dict[str, Any] = {}
    if n.attributes:  # (most nodes have none)
        for key in ("to", "dtype"):
            a = n.attributes.get(key)
            if a is not None and a.type == ir.AttributeType.INT:
                attrs[key] = a.as_int()
    if n.op_type == "ConstantOfShape":
        a = n.attributes.get("value")
        attrs["value_dtype"] = int(_tensor(a).dtype) if a is not None else int(ir.DataType.FLOAT)
    return attrs


def _tensor(attr: ir.Attr):
    """A TENSOR attribute's tensor. (``Attr.as_tensor`` checks it against a runtime Protocol, which
    costs more than the rest of loading a node.)"""
    if attr.type != ir.AttributeType.TENSOR:
        raise TypeError(f"attribute {attr.name!r} is not a tensor")
    return attr.value


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
    if attr is not None and attr.type == ir.AttributeType.TENSOR:
        tensor = _tensor(attr)
    elif "value_float" in n.attributes or "value_floats" in n.attributes:
        tensor = constant_node_tensor(n)  # (the shorthands: converted like the value form)
    else:
        return
    size = 1
    for d in tensor.shape.dims:
        size *= int(d)
    out.const_numel = size
    if out.dtype is None:
        out.dtype = DType(int(tensor.dtype))


def input_files(model: Model, src: Path) -> set[Path]:
    """Every file the loaded model reads: the .onnx and its external-data files (never overwritten)."""
    return {Path(src).resolve(), *model.origin.data_files}
