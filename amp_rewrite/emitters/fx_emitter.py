"""Neutral IR → torch.fx, by patching the (private copy of the) GraphModule the loader read.

Only what changed is touched, so node names, ``node.meta`` (stack traces, nn_module_stack) and the
module's code generator (torch.export's pytree in/out specs) survive:

- each inserted IR Cast becomes one fx node, ``x.to(dtype)`` at torch level or
  ``aten._to_copy(x, dtype=...)`` in ATen graphs, right after its producer (weights and inputs:
  before the first computing node) and shared by every consumer the IR gives it;
- consumers are rewired argument by argument, exactly as the IR's edges say, so a low-precision
  node reads only low-precision tensors and an FP32 node only FP32 ones (torch would otherwise
  promote mixed inputs silently);
- existing conversions the IR retargeted or removed are edited or erased; ``x.type_as(y)`` whose
  ``y`` changed type is spelled out as ``x.to(dtype)``;
- factories painted low (``torch.zeros``, ``aten.full(..., dtype=float32)``) get the low dtype;
- weights: converted in place when every use is low (inference), else a low copy is registered as
  a non-persistent buffer (inference) or a cast is made at each use (training: parameters stay FP32
  so gradients land in FP32). A ``call_module`` whose own parameters need a cast is called through
  ``torch.func.functional_call`` with the cast tensors;
- in-place ops whose written tensor comes through a cast become out of place (the loader refused
  those whose input is read again, where that would change results);
- ``node.meta`` dtypes (``val`` / ``example_value`` / ``tensor_meta``) are updated to the new
  types so the output can be rewritten again (and must then change nothing); decisions are tagged
  in ``node.meta["amp_rewrite"]`` so the report can be rebuilt from the module alone.

Weights are clamped at the target type's true limits (±65504 for FP16, never a smaller bound);
clamped and flushed-to-zero counts and huge sentinels go in the report.
"""

from __future__ import annotations

import functools
import itertools
import operator
import warnings
from typing import Any

import torch
import torch.fx as fx

from ..decisions import DecisionLog
from ..errors import UnsupportedModelError
from ..frontends.fx_loader import CAST_OP, DTYPE_TO_TORCH, FxSource, Slot, is_tensor_meta, leaf_metas
from ..ir import DType, Model, Node, Value

SENTINEL = 1e8  # |x| at or above this (or inf) is a sentinel (masks), reported
TAG = "amp_rewrite"
LOSS_SCALE_BUFFER = "amp_loss_scale"


def emit_fx(model: Model, log: DecisionLog, *, training: bool = False) -> fx.GraphModule:
    """Apply the IR's changes to the loader's GraphModule, lint it and recompile it."""
    emitter = _Emitter(model, log, training)
    emitter.run()
    return emitter.gm


def insert_loss_scale(gm: fx.GraphModule, slot: Slot, level: str) -> fx.Node:
    """``scaled = loss_fp32 * self.amp_loss_scale`` on the output at ``slot`` (where the loader
    found the loss among the output node's arguments); the scale is a registered FP32 scalar
    buffer (initial value 1.0) that a LossScaler updates."""
    graph = gm.graph
    out_node = graph.output_node()
    loss = _get_at(out_node, slot.where)
    if slot.leaf or not isinstance(loss, fx.Node):
        raise UnsupportedModelError(
            "training: the loss is an element of a tuple another node returns, so no scale node can be put "
            "on it alone; return the loss as an output of its own")
    if not hasattr(gm, LOSS_SCALE_BUFFER):
        # not persistent: the scale is the LossScaler's state (its own state_dict), and a checkpoint
        # of the rewritten module must load into the original and back
        gm.register_buffer(LOSS_SCALE_BUFFER, torch.ones((), dtype=torch.float32), persistent=False)
        _keep_derived_buffers_out_of_copies(gm)
    with graph.inserting_before(out_node):
        scale = graph.get_attr(LOSS_SCALE_BUFFER)
        if level == "aten":
            scaled = graph.call_function(torch.ops.aten.mul.Tensor, (loss, scale))
        else:
            scaled = graph.call_function(torch.mul, (loss, scale))
    scale.meta["tensor_meta"] = None
    for key in ("val", "example_value", "tensor_meta"):
        if key in loss.meta:
            scaled.meta[key] = loss.meta[key]
    scaled.meta[TAG] = {"inserted": "loss_scale", "reason": "training: the FP32 loss is multiplied by the loss "
                                                               "scale (buffer amp_loss_scale) before backward"}
    for key in ("stack_trace", "nn_module_stack"):
        if key in loss.meta:
            scaled.meta[key] = loss.meta[key]
    _replace_arg(out_node, slot.where, scaled)
    graph.lint()
    gm.recompile()
    return scaled


class _Emitter:
    def __init__(self, model: Model, log: DecisionLog, training: bool) -> None:
        self.model = model
        self.ir = model.graph
        self.source: FxSource = model.origin
        self.gm = self.source.gm
        self.graph = self.gm.graph
        self.log = log
        self.training = training
        self.aten = self.source.level == "aten"
        self.fx_of: dict[int, fx.Node] = {}
        self.overrides: dict[fx.Node, dict[str, fx.Node]] = {}
        self.first_compute = next((n for n in self.graph.nodes if n.op not in ("placeholder", "get_attr")), None)
        self.position = {n: i for i, n in enumerate(self.graph.nodes)}
        self.first_index = self.position.get(self.first_compute, len(self.position))
        self.unread_attrs: list[fx.Node] = []
        self.converted: set[int] = set()  # id() of the converted tensors (held by the module)
        self.counted: set[int] = set()  # id() of the master weights cast at use whose values were counted
        # id(module tensor) -> (it, every path the module holds it by): a tied weight has several
        self.tensor_paths: dict[int, tuple[torch.Tensor, list[str]]] = {}

    def run(self) -> None:
        self._pin_dtype_reads()
        self._weights()
        for node in self.ir.nodes:
            if node.meta.get("amp.inserted"):
                self._insert_cast(node)
        for node in self.ir.nodes:
            if node.origin is None or node.meta.get("amp.inserted"):
                continue
            self._sync_inputs(node)
            if node.op_type == CAST_OP:
                self._fix_conversion(node)
            else:
                self._fix_dtype_kwarg(node)
        self._sync_outputs()
        self._drop_removed_casts()
        self._update_meta()
        self._fix_asserts()
        self._tag()
        self._functional_calls()
        for attr_node in self.unread_attrs:
            if not attr_node.users and attr_node.graph is self.graph:
                self.graph.erase_node(attr_node)
        self.graph.lint()
        self.gm.recompile()
        _keep_ties(self.gm)

    def _pin_dtype_reads(self) -> None:
        """``h.dtype`` read at run time (symbolic_trace keeps ``getattr(h, "dtype")`` as a node, as
        in ``torch.arange(n, dtype=h.dtype)``) answers with the type the source model gave ``h``
        wherever the rewrite changed that type: the IR, built from the source model's types, has
        the factory (or conversion) reading it make that type, and painting decided from there.
        Left to run, it would follow ``h`` into low precision, so ops the report shows FP32 (the
        sin/cos/exp of sinusoidal positions) would silently run low. torch.export resolves such
        reads while tracing, so only symbolic_trace graphs have them."""
        was: dict[fx.Node, torch.dtype] = {}
        for value in self._all_values():
            if "amp.was" not in value.meta:
                continue
            dtype = DTYPE_TO_TORCH.get(value.meta["amp.was"])
            origin = value.origin
            if isinstance(origin, tuple) and len(origin) == 2 and isinstance(origin[0], fx.Node):
                node = origin[0] if not origin[1] else self.source.leaf_nodes.get(origin)
                if node is not None:  # (a tuple output's leaf: the getitem that selects it)
                    was[node] = dtype
            elif value.meta.get("fx.attr"):
                for attr_node in self.source.attr_nodes.get(value.meta["fx.attr"], []):
                    was[attr_node] = dtype
        for node in list(self.graph.nodes):
            if node.op != "call_function" or node.target is not getattr or len(node.args) != 2 \
                    or node.args[1] != "dtype" or was.get(node.args[0]) is None:
                continue
            dtype, tensor = was[node.args[0]], node.args[0]
            for user in list(node.users):
                user.args = fx.node.map_arg(user.args, lambda a, n=node: dtype if a is n else a)
                user.kwargs = fx.node.map_arg(user.kwargs, lambda a, n=node: dtype if a is n else a)
            self.graph.erase_node(node)
            if tensor.op == "get_attr" and not tensor.users:
                self.unread_attrs.append(tensor)  # (a weight read for its dtype only: erased at the end)

    # -- where each IR value lives in the fx graph ---------------------------------------------------------
    def node_for(self, value: Value) -> fx.Node:
        cached = self.fx_of.get(id(value))
        if cached is not None:
            return cached
        origin = value.origin
        if isinstance(origin, tuple) and len(origin) == 2 and isinstance(origin[0], fx.Node):
            node, path = origin
            found = node if not path else self._leaf_node(node, path)
        elif value.meta.get("fx.attr") is not None:
            found = self._attr_node(value.meta["fx.attr"])
        else:
            raise AssertionError(f"no fx node yields {value!r}")
        self.fx_of[id(value)] = found
        return found

    def _leaf_node(self, node: fx.Node, path: tuple) -> fx.Node:
        existing = self.source.leaf_nodes.get((node, path))
        if existing is not None:
            return existing
        parent = node if len(path) == 1 else self._leaf_node(node, path[:-1])
        with self.graph.inserting_after(parent):
            item = self.graph.call_function(operator.getitem, (parent, path[-1]))
        meta = _meta_obj(node)
        if meta is not None:
            sub = meta
            for p in path:
                sub = sub[p]
            item.meta[_meta_key(node)] = sub
        _copy_debug_meta(node, item)
        self.source.leaf_nodes[(node, path)] = item
        return item

    def _attr_node(self, target: str) -> fx.Node:
        nodes = self.source.attr_nodes.get(target)
        if nodes:
            return nodes[0]
        anchor = self.first_compute
        ctx = self.graph.inserting_before(anchor) if anchor is not None else self.graph.inserting_after(None)
        with ctx:
            node = self.graph.get_attr(target)
        tensor = _fetch(self.gm, target)
        if isinstance(tensor, torch.Tensor):
            node.meta["tensor_meta"] = _tensor_metadata(tensor)
        self.source.attr_nodes[target] = [node]
        return node

    # -- weights -------------------------------------------------------------------------------------------
    def _weights(self) -> None:
        for path, tensor in itertools.chain(self.gm.named_parameters(remove_duplicate=False),
                                            self.gm.named_buffers(remove_duplicate=False)):
            self.tensor_paths.setdefault(id(tensor), (tensor, []))[1].append(path)
        for value in list(self.ir.initializers.values()):
            if "amp.copy_of" in value.meta:
                self._low_copy(value)
            elif value.meta.get("amp.convert") and value.meta.get("fx.attr"):
                self._convert_in_place(value)

    def _convert_in_place(self, value: Value) -> None:
        target = value.meta["fx.attr"]
        owner, attr = _owner(self.gm, target)
        old = getattr(owner, attr)
        converted = self.gm.meta.setdefault(CONVERTED, [])
        if not converted:
            self.gm.register_load_state_dict_pre_hook(_convert_loaded_weights)
        converted.append(target)
        if id(old) in self.converted:
            return  # a tied weight, converted under another of its names (below)
        new = self._convert(old, target, value.dtype)
        if isinstance(old, torch.nn.Parameter):
            new = torch.nn.Parameter(new, requires_grad=old.requires_grad)
        self.converted.add(id(new))
        # every name the module holds the weight by (tied weights: an embedding and the output
        # projection; a torch.export graph reads one of them) gets the one converted tensor: the
        # names a node reads are all converted (place_casts gives an FP32 reader's tie a low copy
        # instead), and a name no node reads has no IR value. Converted by name, the tie broke,
        # and the module held two tensors or an FP32 one no node read.
        entry = self.tensor_paths.get(id(old))
        paths = entry[1] if entry is not None and entry[0] is old else [target]
        for path in paths:
            owner, attr = _owner(self.gm, path)
            if isinstance(old, torch.nn.Parameter):
                setattr(owner, attr, new)
            elif attr in getattr(owner, "_buffers", {}):
                owner._buffers[attr] = new
            else:
                setattr(owner, attr, new)

    def _low_copy(self, value: Value) -> None:
        original: Value = value.meta["amp.copy_of"]
        target = original.meta["fx.attr"]
        owner, attr = _owner(self.gm, target)
        new = self._convert(getattr(owner, attr), target, value.dtype)
        name = f"{attr}_amp_{value.dtype.short}"
        i = 0
        while hasattr(owner, name):
            i += 1
            name = f"{attr}_amp_{value.dtype.short}_{i}"
        # non-persistent: the state_dict keeps the model's own keys; the copy is derived data, made
        # again from its original whenever a state dict is loaded
        owner.register_buffer(name, new, persistent=False)
        prefix = target.rsplit(".", 1)[0] + "." if "." in target else ""
        value.meta["fx.attr"] = prefix + name
        copies = self.gm.meta.setdefault(LOW_COPIES, [])
        if not copies:
            _register_after_load(self.gm)
            _keep_derived_buffers_out_of_copies(self.gm)
            _hook_copies(self.gm)
        copies.append((prefix + name, target))
        _note_source(self.gm, prefix + name, getattr(owner, attr))

    def _convert(self, tensor: torch.Tensor, name: str, dtype: DType) -> torch.Tensor:
        converted, clamped, flushed, sentinel = convert_tensor(tensor, DTYPE_TO_TORCH[dtype])
        stats = self.log.weights
        stats.clamped += clamped
        stats.flushed_to_zero += flushed
        if sentinel:
            stats.sentinels.append({"tensor": name, **sentinel})
        return converted

    # -- casts ---------------------------------------------------------------------------------------------
    def _insert_cast(self, node: Node) -> None:
        value = node.inputs[0]
        src = self.node_for(value)
        dtype = DTYPE_TO_TORCH[DType(node.attrs["to"])]
        leading = src.op == "placeholder" or (src.op == "get_attr" and self.position.get(src, -1) < self.first_index)
        consumer = next((c.origin for c, _ in node.outputs[0].uses() if isinstance(c.origin, fx.Node)), None)
        before = consumer
        if before is None and value.meta.get("amp.mutable") and node.outputs[0].is_graph_output:
            before = next(n for n in reversed(self.graph.nodes) if n.op == "output")  # (after every write)
        if value.meta.get("amp.mutable") and before is not None:
            # a tensor the forward writes reads its value at the use: a write through another name
            # (a buffer that is a view of the written one) may come between its node and the use
            def where():
                return self.graph.inserting_before(before)
        elif leading and self.first_compute is not None:
            def where():  # with the weights and inputs, at the top
                return self.graph.inserting_before(self.first_compute)
        else:
            def where():
                return self.graph.inserting_after(src)
        name = _identifier(node.name)
        limit = node.meta.get("amp.saturate")
        if self.training and src.op == "get_attr" and dtype in (torch.float16, torch.bfloat16):
            self._count_cast_at_use(src, dtype, saturates=limit is not None)
        if limit is not None:  # (a mask fill: clamped first, as a constant converted offline is)
            saturation = self._saturate(src, limit, node.name, where)
            clamped = saturation[-1]
            for made in saturation:
                _set_meta_dtype(made, (), DTYPE_TO_TORCH[value.dtype], template=src, template_path=())
                _copy_debug_meta(consumer if consumer is not None else src, made)
                made.meta[TAG] = {"inserted": "saturate", "name": node.name, "reason": node.meta.get("amp.reason", "")}
            src = clamped

            def where():  # (the cast reads the clamp: right after it)
                return self.graph.inserting_after(clamped)
        with where():
            if self.aten:
                new = self.graph.create_node("call_function", torch.ops.aten._to_copy.default, (src,),
                                             {"dtype": dtype}, name=name)
            else:
                new = self.graph.create_node("call_method", "to", (src,), {"dtype": dtype}, name=name)
        _set_meta_dtype(new, (), dtype, template=src, template_path=())
        _copy_debug_meta(consumer if consumer is not None else src, new)  # graph outputs: the producer's
        new.meta[TAG] = {"inserted": "cast", "name": node.name, "reason": node.meta.get("amp.reason", "")}
        self.fx_of[id(node.outputs[0])] = new

    def _saturate(self, src: fx.Node, limit: float, name: str, where) -> list[fx.Node]:
        """The nodes clamping ``src`` at ``limit``, in order (the last one's output is the clamped
        value). A training rewrite's clamp passes its gradient straight through (``clamp(w).detach()
        + nan_to_num(w - w.detach(), 0, 0, 0)``: the clamped value, exactly, also where ``w`` is ±inf,
        and a gradient of 1 where it is finite): a master weight past ±65504 read through a plain
        clamp got a zero gradient at every step, so it could never move back into range (F1 of the
        trainparams hunt: still 1e5 after three SGD steps, where FP32 moved it)."""
        made: list[fx.Node] = []

        def call(op, aten_op, *args, suffix=""):  # (each after the one before: a chain in order)
            with where() if not made else self.graph.inserting_after(made[-1]):
                made.append(self.graph.create_node("call_function", aten_op if self.aten else op, args,
                                                   name=_identifier(f"{name}_saturate{suffix}")))
            return made[-1]
        clamped = call(torch.clamp, torch.ops.aten.clamp.default, src, -limit, limit)
        if self.training or _requires_grad(src):  # (torch.compile: a lifted parameter)
            held = call(torch.detach, torch.ops.aten.detach.default, clamped, suffix="_value")
            still = call(torch.detach, torch.ops.aten.detach.default, src, suffix="_source")
            diff = call(operator.sub, torch.ops.aten.sub.Tensor, src, still, suffix="_difference")
            # (inf - inf is NaN: a causal plus a padding mask of finfo.min is -inf in FP32 too)
            zero = call(torch.nan_to_num, torch.ops.aten.nan_to_num.default, diff, 0.0, 0.0, 0.0, suffix="_zero")
            call(operator.add, torch.ops.aten.add.Tensor, held, zero, suffix="_straight_through")
        return made

    def _count_cast_at_use(self, src: fx.Node, dtype: torch.dtype, saturates: bool) -> None:
        """A training rewrite casts its FP32 master weights at each use: the values of one the
        cast clamps or flushes to zero are counted, once per tensor, as a conversion's are (the
        summary said 0 clamped where the first step clamped one). The weight is listed for
        :func:`_warn_on_loaded_masters`."""
        tensor = _fetch(self.gm, src.target)
        if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
            return
        listed = self.gm.meta.setdefault(CAST_AT_USE, {})
        if not listed:
            self.gm.register_load_state_dict_pre_hook(_warn_on_loaded_masters)
        saturated = listed.get(src.target, (dtype, False))[1]
        listed[src.target] = (dtype, saturated or saturates)
        if id(tensor) in self.counted:
            return
        self.counted.add(id(tensor))
        _, clamped, flushed, _ = convert_tensor(tensor, dtype)
        self.log.weights.clamped += clamped
        self.log.weights.flushed_to_zero += flushed

    def _sync_inputs(self, node: Node) -> None:
        fx_node: fx.Node = node.origin
        loaded: list[Value] = node.meta.get("fx.loaded", [])
        slots: list[Slot] = node.meta.get("fx.slots", [])
        tuple_edits: dict[tuple, dict[tuple, fx.Node]] = {}
        recast_target = False
        for i, (slot, value) in enumerate(zip(slots, node.inputs)):
            if value is None or (i < len(loaded) and loaded[i] is value):
                continue
            recast_target = recast_target or slot.where == ("args", 0)
            desired = self.node_for(value)
            self._move_before(desired, fx_node)
            if slot.where[0] == "param":
                self.overrides.setdefault(fx_node, {})[slot.where[1]] = desired
            elif slot.leaf:
                tuple_edits.setdefault(slot.where, {})[slot.leaf] = desired
            else:
                _replace_arg(fx_node, slot.where, desired)
        for where, leaves in tuple_edits.items():
            _replace_arg(fx_node, where, self._rebuilt_tuple(_get_at(fx_node, where), leaves))
        if recast_target and node.meta.get("fx.inplace"):
            # (only the tensor it writes matters: ``acc.add_(m.float())`` still updates acc)
            _make_out_of_place(fx_node, self.gm)

    def _move_before(self, node: fx.Node, reader: fx.Node) -> None:
        """Cast placement may hand a reader the model's own conversion of a value (``h.float()``)
        that the graph computes after that reader (``log_softmax(h) + h.float()``): the IR is
        ordered by data flow, the fx graph by the program. Such a conversion moves up to just
        before the reader; what it reads is computed before the reader anyway."""
        at, here = self.position.get(node), self.position.get(reader)
        src = node.args[0] if at is None and node.args else None
        if isinstance(src, fx.Node) and src.op == "get_attr" and here is not None and \
                self.position.get(src, -1) > here and node.meta.get(TAG, {}).get("inserted") == "cast":
            # our cast of a weight that the program reads first after this reader (symbolic_trace
            # puts `self.l.weight` where forward reads it, after the call of self.l): the attribute
            # read reads no value, so it and its cast move up to just before the reader
            reader.prepend(src)
            reader.prepend(node)
            self.position[src] = here - 0.5
            return
        if at is None or here is None or at < here:
            return
        if any(self.position.get(arg, here) >= here for arg in node.all_input_nodes):
            return  # (not a plain conversion of an earlier value: left for lint to name)
        reader.prepend(node)
        self.position[node] = here - 0.5

    def _rebuilt_tuple(self, tuple_node: fx.Node, leaves: dict[tuple, fx.Node]) -> Any:
        meta = _meta_obj(tuple_node)

        def build(sub: Any, path: tuple) -> Any:
            # (symbolic_trace's TensorMetadata is a NamedTuple too: a leaf, not a tuple to walk into)
            if isinstance(sub, (tuple, list)) and not is_tensor_meta(sub):
                items = [build(x, path + (i,)) for i, x in enumerate(sub)]
                return type(sub)(items) if isinstance(sub, list) else tuple(items)
            return leaves.get(path) or self._leaf_node(tuple_node, path)

        return build(meta, ())

    def _sync_outputs(self) -> None:
        out_node: fx.Node = self.ir.meta.get("fx.output_node")
        if out_node is None:
            return
        loaded = self.ir.meta.get("fx.loaded_outputs", [])
        slots: list[Slot] = self.ir.meta.get("fx.output_slots", [])
        tuple_edits: dict[tuple, dict[tuple, fx.Node]] = {}
        for slot, old, new in zip(slots, loaded, self.ir.outputs):
            if old is new:
                continue
            desired = self.node_for(new)
            if slot.leaf:
                tuple_edits.setdefault(slot.where, {})[slot.leaf] = desired
            else:
                _replace_arg(out_node, slot.where, desired)
        for where, leaves in tuple_edits.items():
            _replace_arg(out_node, where, self._rebuilt_tuple(_get_at(out_node, where), leaves))

    # -- conversions and dtype-carrying arguments ---------------------------------------------------------------
    def _fix_conversion(self, node: Node) -> None:
        """Make the fx conversion produce the IR's type (retargeted casts, type_as whose other
        tensor changed type)."""
        fx_node: fx.Node = node.origin
        want = DTYPE_TO_TORCH.get(DType(node.attrs["to"]))
        if want is None:
            return
        others = node.meta.get("fx.cast_other") or []
        other_changed = any("amp.was" in v.meta for v in others)
        if not node.meta.get("amp.retargeted") and not other_changed:
            return
        _set_conversion_dtype(fx_node, want, self.aten)

    def _fix_dtype_kwarg(self, node: Node) -> None:
        """Factories and ops with a ``dtype`` argument: the output type is the argument's."""
        changed = [o for o in node.outputs if "amp.was" in o.meta and o.dtype is not None]
        if not changed:
            return
        fx_node: fx.Node = node.origin
        want = DTYPE_TO_TORCH[changed[0].dtype]
        has_tensor_input = any(v is not None for v in node.inputs)
        current = fx_node.kwargs.get("dtype")
        if isinstance(current, torch.dtype) or (current is None and not has_tensor_input):
            fx_node.kwargs = {**fx_node.kwargs, "dtype": want}

    def _drop_removed_casts(self) -> None:
        """Erase the conversions the IR removed. A reader the IR has no edge for may still read one
        for its metadata (``type_as(y, x.float())`` its dtype, ``x.float().size(0)`` its shape):
        it reads the value the IR's readers read instead, which has the same dtype and shape, so
        the report's 'removed' holds in the graph too."""
        for node in self.model.meta.get("amp.removed_nodes", []):
            fx_node = node.origin
            if not isinstance(fx_node, fx.Node) or fx_node.graph is not self.graph:
                continue
            instead = node.meta.get("amp.read_instead")
            # (only where it has the type the conversion made: a conversion removed because its
            # IR readers run low still makes FP32 for a dtype reader, type_as(ones, h.float()))
            if fx_node.users and instead is not None and instead.dtype == node.outputs[0].dtype:
                fx_node.replace_all_uses_with(self.node_for(instead))
            if not fx_node.users:
                self.graph.erase_node(fx_node)

    # -- metadata ------------------------------------------------------------------------------------------------
    def _update_meta(self) -> None:
        for value in self._all_values():
            if "amp.was" not in value.meta or value.dtype is None:
                continue
            dtype = DTYPE_TO_TORCH[value.dtype]
            origin = value.origin
            if isinstance(origin, tuple) and len(origin) == 2 and isinstance(origin[0], fx.Node):
                node, path = origin
                _set_meta_dtype(node, path, dtype)
                leaf = self.source.leaf_nodes.get((node, path)) if path else None
                if leaf is not None:
                    _set_meta_dtype(leaf, (), dtype)
                for k in range(1, len(path)):  # getitems of the nested tuples on the way to the leaf
                    for inner in self.source.tuple_nodes.get((node, path[:k]), ()):
                        _set_meta_dtype(inner, path[k:], dtype)
            elif value.meta.get("fx.attr") and value.meta.get("amp.convert"):
                for attr_node in self.source.attr_nodes.get(value.meta["fx.attr"], []):
                    _set_meta_dtype(attr_node, (), dtype)

    def _all_values(self) -> list[Value]:
        values = list(self.ir.inputs) + list(self.ir.initializers.values())
        for node in self.ir.nodes:
            values += node.outputs
        return values

    def _fix_asserts(self) -> None:
        """torch.export's ``_assert_tensor_metadata(x, dtype=...)`` checks the type a value had."""
        target = getattr(torch.ops.aten, "_assert_tensor_metadata", None)
        if target is None:
            return
        dtype_at = 3  # (a, size, stride, dtype, *, device, layout): decompositions pass it by position
        for node in self.graph.nodes:
            if node.op != "call_function" or node.target is not target.default or not node.args:
                continue
            arg = node.args[0]
            metas = leaf_metas(arg) if isinstance(arg, fx.Node) else []
            actual = getattr(metas[0][1], "dtype", None) if len(metas) == 1 else None
            if actual is None:
                continue
            if isinstance(node.kwargs.get("dtype"), torch.dtype) and actual != node.kwargs["dtype"]:
                node.kwargs = {**node.kwargs, "dtype": actual}
            elif len(node.args) > dtype_at and isinstance(node.args[dtype_at], torch.dtype) \
                    and actual != node.args[dtype_at]:
                node.args = (*node.args[:dtype_at], actual, *node.args[dtype_at + 1:])

    def _tag(self) -> None:
        for node in self.ir.nodes:
            fx_node = node.origin
            if not isinstance(fx_node, fx.Node) or node.meta.get("amp.inserted"):
                continue
            meta = node.meta
            if meta.get("amp.category") is None:
                continue
            tag = {
                "precision": getattr(meta.get("amp.precision"), "value", str(meta.get("amp.precision", ""))),
                "category": getattr(meta.get("amp.category"), "value", ""),
                "reason": meta.get("amp.reason", ""),
                "source": meta.get("amp.source", ""),
                "step": meta.get("amp.step", ""),
                "via": meta.get("amp.via") or "",
                "op": meta.get("fx.torch_name", node.op_type),
            }
            if meta.get("amp.island") is not None:
                tag["island"] = meta["amp.island"]
            fx_node.meta[TAG] = tag

    # -- call_module with cast parameters ---------------------------------------------------------------------
    def _functional_calls(self) -> None:
        """A module whose own parameters must be read through a cast (training keeps FP32 master
        weights; a parameter shared by FP32 and low uses) is called functionally."""
        for fx_node, overrides in self.overrides.items():
            with self.graph.inserting_before(fx_node):
                module = self.graph.get_attr(str(fx_node.target))
                call = self.graph.call_function(
                    functional_call, (module, dict(overrides), tuple(fx_node.args), dict(fx_node.kwargs)))
            call.meta = dict(fx_node.meta)
            # a leaf under tracing: pickling re-traces the generated code (torch.save of the module),
            # which would otherwise trace into functional_call with Proxies for tensors
            call.meta["is_wrapped"] = True
            fx_node.replace_all_uses_with(call)
            name = fx_node.name
            self.graph.erase_node(fx_node)
            call.name = self.graph._graph_namespace.create_name(name, None)


def functional_call(module: torch.nn.Module, parameters: dict, args: tuple, kwargs: dict) -> Any:
    """``torch.func.functional_call`` on fresh containers: fx hands a node's dict arguments over as
    its ``immutable_dict``, which functional_call updates on the way out, so under
    ``fx.Interpreter`` (ShapeProp, most FX passes) the call raised 'immutable_dict' object does not
    support mutation. (Called directly, the generated code passed plain dicts.)

    Under ``torch.jit.trace`` (and so the TorchScript ONNX exporter), which torch's stateless API
    refuses, the common leaves are computed by their functional form with the same tensors."""
    if torch.jit.is_tracing():
        return _traced_call(module, parameters, tuple(args), dict(kwargs))
    return torch.func.functional_call(module, dict(parameters), tuple(args), dict(kwargs))


def _conv_form(conv):
    def form(m, p, x):
        if m.padding_mode != "zeros":
            return None
        return conv(x, p["weight"], p.get("bias"), m.stride, m.padding, m.dilation, m.groups)
    return form


@functools.lru_cache(maxsize=1)
def _functional_forms() -> dict[type, Any]:
    """The forward of each common leaf module as a function of (module, its tensors, input): what
    its ``forward`` computes, or None where a setting takes it elsewhere."""
    import torch.nn.functional as F

    nn = torch.nn
    return {
        nn.Linear: lambda m, p, x: F.linear(x, p["weight"], p.get("bias")),
        nn.Conv1d: _conv_form(F.conv1d), nn.Conv2d: _conv_form(F.conv2d), nn.Conv3d: _conv_form(F.conv3d),
        nn.LayerNorm: lambda m, p, x: F.layer_norm(x, m.normalized_shape, p.get("weight"), p.get("bias"), m.eps),
        nn.GroupNorm: lambda m, p, x: F.group_norm(x, m.num_groups, p.get("weight"), p.get("bias"), m.eps),
        nn.Embedding: lambda m, p, x: None if m.max_norm is not None else F.embedding(
            x, p["weight"], m.padding_idx, None, m.norm_type, m.scale_grad_by_freq, m.sparse),
    }


def _traced_call(module: torch.nn.Module, parameters: dict, args: tuple, kwargs: dict) -> Any:
    form = _functional_forms().get(type(module))
    hooked = module._forward_hooks or module._forward_pre_hooks
    if form is not None and len(args) == 1 and not kwargs and not hooked:
        tensors = {name: tensor for name, tensor in module.named_parameters(recurse=False)}
        tensors.update(parameters)
        out = form(module, tensors, args[0])
        if out is not None:
            return out
    why = ("it has forward hooks, which its functional form would skip" if hooked and form is not None else
           f"amp-rewrite has no functional form of {type(module).__name__} for tracing")
    raise UnsupportedModelError(
        f"torch.jit.trace (and torch.onnx.export with dynamo=False) cannot trace submodule {type(module).__name__} "
        f"of this rewrite: it reads its parameters through a cast by torch.func.functional_call, which tracing "
        f"refuses, and {why}; export with torch.onnx.export(..., dynamo=True), or rewrite with the default "
        f"capture (torch.export), whose graph holds no submodule calls")


# -- weights ------------------------------------------------------------------------------------------------
def convert_tensor(tensor: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, int, int, dict | None]:
    """FP32 → low with clamping at the true limits. Returns (tensor, clamped, flushed, sentinel).
    A tensor without data (the meta device) converts its type only: there is nothing to count."""
    if tensor.is_meta:
        return tensor.detach().to(dtype), 0, 0, None
    with torch.no_grad():
        data = tensor.detach().to(torch.float32)
        limit = torch.finfo(dtype).max
        finite = torch.isfinite(data)
        nonfinite = ~finite & ~torch.isnan(data)
        big = finite & (data.abs() >= SENTINEL)
        sentinel = None
        if bool(big.any()) or bool(nonfinite.any()):
            hits = data[big | nonfinite]
            sentinel = {"count": int(hits.numel()), "min": float(hits.min()), "max": float(hits.max())}
        over = finite & (data.abs() > limit)
        clamped = int(over.sum())
        if clamped:
            data = torch.where(over, torch.sign(data) * limit, data)
        converted = data.to(dtype)
        flushed = int(((data != 0) & (converted == 0)).sum())
    return converted.contiguous(), clamped, flushed, sentinel


# -- fx helpers -------------------------------------------------------------------------------------------------
def _get_at(node: fx.Node, where: tuple) -> Any:
    obj: Any = node.args if where[0] == "args" else node.kwargs
    for p in where[1:]:
        obj = obj[p]
    return obj


def _set_at(obj: Any, path: tuple, new: Any) -> Any:
    if not path:
        return new
    head, rest = path[0], path[1:]
    if isinstance(obj, dict):
        out = dict(obj)
        out[head] = _set_at(obj[head], rest, new)
        return out
    items = list(obj)
    items[head] = _set_at(items[head], rest, new)
    return type(obj)(items) if isinstance(obj, list) else tuple(items)


def _replace_arg(node: fx.Node, where: tuple, new: Any) -> None:
    if where[0] == "args":
        node.args = _set_at(node.args, where[1:], new)
    else:
        node.kwargs = _set_at(node.kwargs, where[1:], new)


def _set_conversion_dtype(node: fx.Node, dtype: torch.dtype, aten: bool) -> None:
    src = node.args[0]
    if node.op == "call_method":
        if node.target == "to" and not any(isinstance(a, fx.Node) for a in node.args[1:]):
            args = tuple(dtype if isinstance(a, torch.dtype) else a for a in node.args)
            kwargs = {k: (dtype if isinstance(v, torch.dtype) else v) for k, v in node.kwargs.items()}
            if not any(isinstance(a, torch.dtype) for a in node.args) and "dtype" not in kwargs:
                kwargs["dtype"] = dtype
            node.args, node.kwargs = args, kwargs
        else:
            node.target = "to"
            node.args, node.kwargs = (src,), {"dtype": dtype}
        return
    target = node.target
    if isinstance(target, torch._ops.OpOverload) and "dtype" in node.kwargs:
        node.kwargs = {**node.kwargs, "dtype": dtype}
        return
    if isinstance(target, torch._ops.OpOverload) and any(isinstance(a, torch.dtype) for a in node.args):
        node.args = tuple(dtype if isinstance(a, torch.dtype) else a for a in node.args)
        return
    node.target = torch.ops.aten._to_copy.default if aten else node.target
    if aten:
        node.args, node.kwargs = (src,), {"dtype": dtype}
    else:
        node.op, node.target, node.args, node.kwargs = "call_method", "to", (src,), {"dtype": dtype}


def _make_out_of_place(node: fx.Node, gm: fx.GraphModule) -> None:
    """The input now reaches the op through a cast, a fresh tensor: mutate nothing."""
    inplace_ops = {operator.iadd: operator.add, operator.isub: operator.sub, operator.imul: operator.mul,
                   operator.itruediv: operator.truediv, operator.ifloordiv: operator.floordiv,
                   operator.ipow: operator.pow, operator.imatmul: operator.matmul}
    if node.op == "call_function" and node.target in inplace_ops:
        node.target = inplace_ops[node.target]
    elif node.kwargs.get("inplace") is True:
        node.kwargs = {**node.kwargs, "inplace": False}
    elif node.op == "call_module":
        sub = gm.get_submodule(str(node.target))
        if getattr(sub, "inplace", False):
            sub.inplace = False
    elif node.op == "call_method" and str(node.target).endswith("_"):
        node.target = str(node.target)[:-1]
    elif isinstance(node.target, torch._ops.OpOverload):
        overload = _out_of_place_twin(node.target)
        if overload is not None:
            node.target = overload


def _out_of_place_twin(op: torch._ops.OpOverload) -> torch._ops.OpOverload | None:
    """The out-of-place overload taking the arguments ``op`` (in place) takes. Not always the one of
    the same name: ``pow_.Scalar(Tensor self, Scalar exponent)``'s twin is ``pow.Tensor_Scalar``;
    ``pow.Scalar`` is ``(Scalar self, Tensor exponent)``, and the module failed on every call."""
    packet = getattr(torch.ops.aten, op.overloadpacket.__name__.rstrip("_"), None)
    if packet is None:
        return None
    want = [str(a.type) for a in op._schema.arguments]
    same = getattr(packet, op._overloadname, None)
    others = [getattr(packet, name) for name in packet.overloads() if name != op._overloadname]
    for candidate in ([same] if same is not None else []) + others:
        if [str(a.type) for a in candidate._schema.arguments] == want:
            return candidate
    return None


def _meta_key(node: fx.Node) -> str:
    for key in ("val", "example_value", "tensor_meta"):
        if node.meta.get(key) is not None:
            return key
    return "tensor_meta"


def _meta_obj(node: fx.Node) -> Any:
    for key in ("val", "example_value", "tensor_meta"):
        if node.meta.get(key) is not None:
            return node.meta[key]
    return None


def _retyped(meta: Any, dtype: torch.dtype) -> Any:
    if meta is None:
        return None
    if type(meta).__name__ == "TensorMetadata":
        return meta._replace(dtype=dtype)
    if isinstance(meta, torch.Tensor):
        if meta.dtype == dtype:
            return meta
        fake_mode = getattr(meta, "fake_mode", None)
        if fake_mode is not None:
            with fake_mode:
                return torch.empty_strided(meta.shape, meta.stride(), dtype=dtype, device=meta.device)
        return torch.empty_strided(meta.shape, meta.stride(), dtype=dtype, device="meta")
    return meta


def _set_meta_dtype(node: fx.Node, path: tuple, dtype: torch.dtype, *, template: fx.Node | None = None,
                    template_path: tuple = ()) -> None:
    """Update every dtype record of ``node`` (or, with a template, copy the template's retyped)."""
    holder = template if template is not None else node
    for key in ("val", "example_value", "tensor_meta"):
        meta = holder.meta.get(key)
        if meta is None:
            continue
        node.meta[key] = _set_path(meta, template_path if template is not None else path, dtype,
                                   only_leaf=template is not None)


def _set_path(meta: Any, path: tuple, dtype: torch.dtype, *, only_leaf: bool = False) -> Any:
    """``meta`` with its leaf at ``path`` retyped (``only_leaf``: just that retyped leaf)."""
    leaf = meta
    for key in path:
        leaf = leaf[key]
    retyped = _retyped(leaf, dtype)
    return retyped if only_leaf else _set_at(meta, path, retyped)


def _copy_debug_meta(src: fx.Node, dst: fx.Node) -> None:
    for key in ("stack_trace", "nn_module_stack", "source_fn_stack"):
        if key in src.meta and key not in dst.meta:
            dst.meta[key] = src.meta[key]


def _tensor_metadata(tensor: torch.Tensor) -> Any:
    from torch.fx.passes.shape_prop import _extract_tensor_metadata

    return _extract_tensor_metadata(tensor)


def _identifier(name: str) -> str:
    import re

    text = re.sub(r"[^0-9a-zA-Z_]+", "_", name).strip("_") or "amp_cast"
    return text if not text[0].isdigit() else f"_{text}"


LOW_COPIES = "amp_rewrite.low_copies"  # gm.meta: (copy, original) attribute paths
CONVERTED = "amp_rewrite.converted"  # gm.meta: attribute paths of the weights converted in place


def _requires_grad(node: fx.Node) -> bool:
    """Whether the example value traced for ``node`` requires a gradient (dynamo marks the
    parameters it lifts to graph inputs so)."""
    example = node.meta.get("example_value", node.meta.get("val"))
    return isinstance(example, torch.Tensor) and bool(example.requires_grad)


def _convert_loaded_weights(module: torch.nn.Module, state_dict: dict, prefix: str, *_: Any) -> None:
    """load_state_dict pre-hook: a weight the rewrite converted in place (one only low ops read)
    takes a checkpoint's FP32 values converted as the rewrite converts them, clamped at the low
    type's limits. ``load_state_dict(..., assign=True)`` (how a model built on the meta device is
    given its weights) put the FP32 tensor in place of the low one, and every call then failed
    on a dtype mismatch; a plain load's copy_ made values past 65504 inf. Every name the weight
    goes by (tied weights) is converted: ``state_dict`` is load_state_dict's own copy."""
    converted = {id(t) for t in (_fetch(module, path) for path in module.meta.get(CONVERTED, ()))
                 if isinstance(t, torch.Tensor)}
    if not converted:
        return
    named = itertools.chain(module.named_parameters(remove_duplicate=False),
                            module.named_buffers(remove_duplicate=False))
    for name, current in named:
        incoming = state_dict.get(prefix + name)
        if (id(current) in converted and isinstance(incoming, torch.Tensor) and incoming.is_floating_point()
                and incoming.dtype != current.dtype):
            state_dict[prefix + name] = convert_tensor(incoming, current.dtype)[0]
            _warn_if_clamped(prefix + name, incoming, current.dtype)


CAST_AT_USE = "amp_rewrite.cast_at_use"  # gm.meta: master weight path -> (low dtype, whether its cast clamps)


def _warn_on_loaded_masters(module: torch.nn.Module, state_dict: dict, prefix: str, *_: Any) -> None:
    """load_state_dict pre-hook of a training rewrite: a master weight cast to the low type at
    each use, loaded with values past that type's range, is said. Where the rewrite saw such
    values its cast clamps them; where it did not, the cast makes them ±inf, and every step
    overflows (the loss scaler skips them all) with nothing said (trainparams hunt F2)."""
    for path, (dtype, saturates) in module.meta.get(CAST_AT_USE, {}).items():
        incoming = state_dict.get(prefix + path)
        if not isinstance(incoming, torch.Tensor) or not incoming.is_floating_point() or incoming.is_meta:
            continue
        limit = torch.finfo(dtype).max
        over = int((incoming.detach().abs() > limit).sum())
        if not over:
            continue
        low = str(dtype).removeprefix("torch.")
        what = (f"clamped at ±{limit:g} as it is cast to {low} at each use (its gradient passes the clamp)"
                if saturates else
                f"cast to {low} at each use without a clamp (its values were in range when the module was "
                f"rewritten), so the low-precision ops read ±inf and every step overflows")
        warnings.warn(
            f"amp_rewrite: load_state_dict: {prefix + path!r} holds {over} value(s) beyond {low}'s range "
            f"(±{limit:g}): {what}. Load the checkpoint into the FP32 module and rewrite that, so the rewrite "
            f"sees these values", RuntimeWarning, stacklevel=3)


def _warn_if_clamped(name: str, incoming: torch.Tensor, dtype: torch.dtype) -> None:
    """A loaded value past the low type's range is clamped as it is converted: the rewrite chose its
    readers' precision from the values it saw (a learned scale of 1e5, which a rewrite of the trained
    module keeps FP32 with its reader, clamped to 65504 gave NaN), so it is said."""
    limit = torch.finfo(dtype).max
    magnitude = incoming.detach().abs()
    # (mask sentinels, 1e8 and more, saturate and still mask: not counted)
    clamped = 0 if incoming.is_meta else int(((magnitude > limit) & (magnitude < SENTINEL)).sum())
    if clamped > 0:
        warnings.warn(
            f"amp_rewrite: load_state_dict: {name!r} holds {clamped} value(s) beyond "
            f"{str(dtype).removeprefix('torch.')}'s range (±{limit:g}), clamped as it is converted for the "
            f"low-precision ops that read it; the rewrite chose their precision from the values it saw. Load the "
            f"checkpoint into the FP32 module and rewrite that to keep such readers FP32", RuntimeWarning, stacklevel=3)


AFTER_LOAD = "amp_rewrite.after_load"  # gm.meta: _after_load is registered


def _register_after_load(gm: fx.GraphModule) -> None:
    if not gm.meta.get(AFTER_LOAD):
        gm.register_load_state_dict_post_hook(_after_load)
        gm.meta[AFTER_LOAD] = True


def _after_load(module: torch.nn.Module, incompatible_keys: Any) -> None:
    """load_state_dict post-hook: tie the tied weights again, then make the low copies again
    (from the tensors their names hold once tied)."""
    _retie(module, incompatible_keys)
    _refresh_low_copies(module, incompatible_keys)


def _refresh_low_copies(module: torch.nn.Module, incompatible_keys: Any) -> None:
    """A weight read both low and FP32 keeps its FP32 original (in the state dict) and a low copy
    (a buffer, not in it); loading new weights makes the copy again, or the low readers would go
    on computing with the old ones. A copy that cannot take the original's values in place (still
    on the meta device after ``assign=True`` gave the original its data, or on another device) is
    made anew."""
    for copy_path, original in getattr(module, "meta", {}).get(LOW_COPIES, ()):
        _refresh_copy(module, copy_path, original, warn=True)


def _refresh_copy(module: torch.nn.Module, copy_path: str, original: str, warn: bool) -> None:
    low = _fetch(module, copy_path)
    source = _fetch(module, original)
    if low is None or source is None or source.is_meta:
        return
    fresh = convert_tensor(source.detach(), low.dtype)[0]
    if warn:
        _warn_if_clamped(original, source, low.dtype)
    if low.is_meta or low.device != fresh.device or low.shape != fresh.shape:
        owner, attr = _owner(module, copy_path)
        owner._buffers[attr] = fresh
    else:
        with torch.no_grad():
            low.copy_(fresh)
    _note_source(module, copy_path, source)


COPY_SOURCES = "amp_rewrite.copy_sources"  # gm.meta: copy path -> (id, version) of the tensor it was made from


def _note_source(module: torch.nn.Module, copy_path: str, source: torch.Tensor) -> None:
    module.meta.setdefault(COPY_SOURCES, {})[copy_path] = _stamp(source)


def _stamp(tensor: Any) -> tuple[int, int | None]:
    try:
        return id(tensor), tensor._version
    except (AttributeError, RuntimeError):  # (an inference-mode tensor has no version counter)
        return id(tensor), None


def _refresh_changed_copies(module: torch.nn.Module, args: Any) -> None:
    """Forward pre-hook: a low copy whose FP32 original was written in place since the copy was
    made (``weight.copy_(w)``, ``nn.init``, an EMA, an optimizer step) or replaced is made again,
    or the low readers would compute with the old weight while the FP32 readers see the new one.
    (Not inside torch.compile's trace: there the copies are as last refreshed.)

    With autograd recording and an original that requires grad, or under a torch.func transform,
    the low readers read a cast of the original made for this forward instead (the cached copy is
    put back after it): the copy is made without grad, and backward gave the weight only its FP32
    readers' share; a transform refuses the in-place refresh. Under ``torch.jit.trace`` too, so
    the traced graph reads the weight itself (it keeps no hooks to refresh a copy)."""
    if torch.compiler.is_compiling():
        return
    stamps = module.meta.get(COPY_SOURCES, {})
    # under torch.func (grad, vmap, functional_call's weights inside them) nothing may be written in
    # place and no value inspected: every copy is a cast for this forward
    transformed = torch._C._are_functorch_transforms_active()
    # under torch.jit.trace the graph records a cast of the weight: the traced module runs no hooks
    # and would read the copy as it was at trace time, whatever the weight became after
    tracing = torch.jit.is_tracing()
    cast_here = []
    for copy_path, original in module.meta.get(LOW_COPIES, ()):
        source = _fetch(module, original)
        if source is None or source.is_meta:
            continue
        if transformed or tracing or (torch.is_grad_enabled() and source.requires_grad):
            cast_here.append((copy_path, source))  # (the cached copy is refreshed at a later forward)
            continue
        stamp = _stamp(source)
        if stamp[1] is None or stamps.get(copy_path) != stamp:
            _refresh_copy(module, copy_path, original, warn=stamp[1] is not None)
    for copy_path, source in cast_here:
        owner, attr = _owner(module, copy_path)
        cached = owner._buffers[attr]
        bound = torch.finfo(cached.dtype).max
        owner._buffers[attr] = source.clamp(-bound, bound).to(cached.dtype)
        module.meta.setdefault(_CACHED_COPIES, []).append((owner, attr, cached))


_CACHED_COPIES = "amp_rewrite.cached_copies"  # gm.meta, during a forward: the copies a cast stands in for


def _restore_cached_copies(module: torch.nn.Module, args: Any, output: Any) -> None:
    """Forward hook (run even when the forward raises): the cached low copies go back in place of
    the casts made for that forward, which its backward holds on to."""
    for owner, attr, cached in reversed(module.meta.pop(_CACHED_COPIES, [])):
        owner._buffers[attr] = cached


def _hook_copies(gm: fx.GraphModule) -> None:
    """The hooks that keep the low copies right. A deep copy (an EMA or teacher model) gets them
    again: GraphModule's copy keeps state-dict hooks, not forward hooks, and the copy's low readers
    went on reading the weights it was made with."""
    gm.register_forward_pre_hook(_refresh_changed_copies)
    gm.register_forward_hook(_restore_cached_copies, always_call=True)
    if _hook_copies not in getattr(gm, "_deepcopy_hooks", ()):
        gm._register_deepcopy_hook(_hook_copies)


TIED = "amp_rewrite.tied"  # gm.meta: the names of each parameter the module holds under several


def _keep_ties(gm: fx.GraphModule) -> None:
    """Record tied parameters (an embedding and an output projection holding one Parameter) for
    :func:`_retie`."""
    groups: dict[int, list[str]] = {}
    for name, parameter in gm.named_parameters(remove_duplicate=False):
        groups.setdefault(id(parameter), []).append(name)
    tied = [names for names in groups.values() if len(names) > 1]
    if tied:
        gm.meta[TIED] = tied
        _register_after_load(gm)


def _retie(module: torch.nn.Module, incompatible_keys: Any) -> None:
    """``load_state_dict(..., assign=True)`` (how a model built on the meta device is given its
    weights) gives each name of a tied parameter a Parameter of its own. A graph captured by
    torch.export reads the tied weight by one name only: the other became a parameter nothing
    read, with no gradient, left behind by the optimizer. Every name is given one Parameter again,
    as the module held it: the one loaded (the first name the checkpoint holds)."""
    missing = set(getattr(incompatible_keys, "missing_keys", ()) or ())
    for names in getattr(module, "meta", {}).get(TIED, ()):
        # (the name the checkpoint gave a tensor: a de-duplicated one holds the tied weight once)
        loaded = next((name for name in names if name not in missing), names[0])
        first = _fetch(module, loaded)
        if not isinstance(first, torch.nn.Parameter):
            continue
        for name in names:
            if _fetch(module, name) is not first:
                owner, attr = _owner(module, name)
                owner._parameters[attr] = first


def _keep_derived_buffers_out_of_copies(gm: fx.GraphModule) -> None:
    """A deep copy of a GraphModule registers every buffer again as persistent: the copy's state
    dict would then ask for the low copies and the loss scale, which no checkpoint of the model has."""
    if _restore_non_persistent not in getattr(gm, "_deepcopy_hooks", ()):
        gm._register_deepcopy_hook(_restore_non_persistent)


NON_PERSISTENT = "amp_rewrite.non_persistent"  # gm.meta: the model's own non-persistent buffer paths


def non_persistent_buffers(module: torch.nn.Module) -> list[str]:
    """The paths of ``module``'s non-persistent buffers (``register_buffer(..., persistent=False)``:
    a RoPE ``inv_freq``, a cos/sin cache, ``position_ids``)."""
    return [f"{prefix}.{attr}" if prefix else attr
            for prefix, sub in module.named_modules(remove_duplicate=False)
            for attr in sorted(getattr(sub, "_non_persistent_buffers_set", ())) if attr in sub._buffers]


def keep_non_persistent(gm: fx.GraphModule, paths: list[str]) -> None:
    """Mark the model's own non-persistent buffers so in ``gm``, now and in every deep copy of it.
    A GraphModule registers each buffer it copies from its root as persistent (symbolic_trace, and
    deepcopy of one), so its state dict asked for keys no checkpoint of the model has, and a
    checkpoint of it had keys the model refused: strict loads failed both ways."""
    if not paths:
        return
    gm.meta[NON_PERSISTENT] = sorted(set(gm.meta.get(NON_PERSISTENT, ())) | set(paths))
    _restore_non_persistent(gm)
    _keep_derived_buffers_out_of_copies(gm)


def _restore_non_persistent(gm: fx.GraphModule) -> None:
    paths = [path for path, _ in gm.meta.get(LOW_COPIES, ())]
    paths += gm.meta.get(NON_PERSISTENT, ())
    if hasattr(gm, LOSS_SCALE_BUFFER):
        paths.append(LOSS_SCALE_BUFFER)
    for path in paths:
        try:
            owner, attr = _owner(gm, path)
        except AttributeError:  # (a buffer the graph does not read: symbolic_trace copies no owner for it)
            continue
        if attr in owner._buffers:
            owner._non_persistent_buffers_set.add(attr)


def _owner(gm: torch.nn.Module, target: str) -> tuple[torch.nn.Module, str]:
    prefix, _, attr = target.rpartition(".")
    return (gm.get_submodule(prefix) if prefix else gm), attr


def _fetch(gm: torch.nn.Module, target: str) -> Any:
    owner, attr = _owner(gm, target)
    return getattr(owner, attr, None)


__all__ = ["emit_fx", "insert_loss_scale", "convert_tensor"]
