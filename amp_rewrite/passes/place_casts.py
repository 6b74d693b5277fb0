"""Place casts: turn node precisions into value dtypes and the fewest Cast nodes.

Cases handled:
- outputs of low nodes (their painted group) take the low type;
- every use needing another type than its value has gets one Cast per (value, type, scope),
  shared by all such consumers, placed right after the producer (or at the top of the scope that
  needs it, for graph inputs, initializers and outer-scope values: casts live in the scope that
  needs them);
- graph outputs keep their FP32 type and name (keep_io_types): the low value is renamed and the
  Cast takes the original name; with keep_io_types off, float graph inputs and outputs go low;
- initializers and Constant outputs whose consumers all need the low type are converted offline
  (the emitter clamps at the type's true limits); shared by both precisions: the FP32 original
  stays and the low consumers get a converted copy (inference) or a Cast at use (training, so
  master weights stay FP32);
- existing casts: a use reading ``Cast(u, to=FLOAT)`` that needs the low type reads ``u`` (or a
  Cast of ``u``) instead of chaining two casts; a ``Cast(to=FLOAT)`` whose consumers are all low
  is retargeted; a Cast whose input already has its target type is removed.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..decisions import CastRecord, Precision
from ..ir import DType, Graph, Model, Node, Value
from .base import (LOW_LIMITS, Context, PassResult, accepts_any_float, group_inputs, group_outputs, is_noop_cast,
                   node_label, participates, precision, retypable_io, scope_label, string_attribute)


# from -> the types that represent each of its values exactly (a cast there and back is the identity)
_EXACT_WIDENING: dict[DType, frozenset[int]] = {
    DType.FLOAT16: frozenset({int(DType.FLOAT), int(DType.DOUBLE)}),
    DType.BFLOAT16: frozenset({int(DType.FLOAT), int(DType.DOUBLE)}),
    DType.FLOAT: frozenset({int(DType.DOUBLE)}),
    DType.BOOL: frozenset(int(t) for t in (DType.INT8, DType.INT16, DType.INT32, DType.INT64, DType.UINT8,
                                           DType.FLOAT16, DType.BFLOAT16, DType.FLOAT, DType.DOUBLE)),
    DType.INT8: frozenset({int(DType.INT16), int(DType.INT32), int(DType.INT64)}),
    DType.INT16: frozenset({int(DType.INT32), int(DType.INT64)}),
    DType.INT32: frozenset({int(DType.INT64)}),
    DType.UINT8: frozenset({int(DType.INT16), int(DType.INT32), int(DType.INT64), int(DType.UINT16)}),
}


class Namer:
    """Unique, deterministic names: the base name, then base_1, base_2, ..."""

    def __init__(self, taken: set[str]) -> None:
        self.taken = taken
        # per base, the suffix of the last name handed out: the names before it were all taken
        # then, and a name is never given back, so the next search for that base starts there
        # (a pass naming thousands of nodes after one base stays linear)
        self._last: dict[str, int] = {}

    @classmethod
    def for_model(cls, model: Model) -> "Namer":
        taken: set[str] = set()
        for scope in model.graph.scopes():
            for v in list(scope.inputs) + list(scope.initializers.values()):
                taken.add(v.name)
            for n in scope.nodes:
                taken.add(n.name)
                taken.update(o.name for o in n.outputs)
        return cls(taken)

    def __call__(self, base: str) -> str:
        i = self._last.get(base, 0)
        name = f"{base}_{i}" if i else base
        while name in self.taken:
            i += 1
            name = f"{base}_{i}"
        self._last[base] = i
        self.taken.add(name)
        return name


_SENTINEL_SCAN = 1 << 24  # elements: a mask constant is a scalar or a mask, not a weight
# ops whose output may still hold a sentinel an input holds (copies, selections, elementwise
# arithmetic that keeps the magnitude); not bounded ones (Softmax, Sigmoid, Tanh, normalisations)
# nor those that compute anew: a probability is never clamped for a mask it was made from
_CARRY_SENTINELS = frozenset({
    "Cast", "CastLike", "Identity", "Mul", "Add", "Sub", "Div", "Neg", "Abs", "Sum", "Min", "Max", "Clip", "Where",
    "Expand", "Reshape", "Unsqueeze", "Squeeze", "Flatten", "Transpose", "Concat", "Slice", "Split", "Gather",
    "GatherElements", "GatherND", "Tile", "Pad", "Trilu", "ScatterND", "ScatterElements", "ReduceMin",
    "ReduceMax", "DepthToSpace", "SpaceToDepth", "Resize"})
# the inputs a sentinel passes through, where not all of them: the others are indices, shapes, axes
# or a condition (a Slice's int64 ``ends`` of INT64_MAX means "to the end", not a mask)
_SENTINEL_SLOTS = {op: (0,) for op in ("CastLike", "Expand", "Reshape", "Unsqueeze", "Squeeze", "Slice", "Split",
                                       "Gather", "GatherElements", "GatherND", "Tile", "Trilu", "ReduceMin",
                                       "ReduceMax", "Resize")}
_SENTINEL_SLOTS.update({"Pad": (0, 2), "ScatterND": (0, 2), "ScatterElements": (0, 2), "Where": (1, 2)})


_BOUND_COPIES = frozenset({"Cast", "Identity", "Reshape", "Squeeze", "Unsqueeze", "Transpose", "Flatten", "Expand",
                           "Neg", "Abs"})


def _constant_bound(value: Value | None, depth: int = 0) -> float | None:
    """An upper bound on the magnitudes of an FP32 ``value`` computed from constants alone through
    copies, products and sums (``Cast(int8 weight) * scale``), or None where it reads anything else."""
    import numpy as np

    from ..frontends.onnx_constants import numeric
    from ..frontends.onnx_loader import constant_array

    if value is None or depth > 8:
        return None
    if value.data_known:
        if (value.numel or 0) > _SENTINEL_SCAN:
            return None
        data = numeric(constant_array(value))
        if data is None:
            return None
        return float(np.max(np.abs(data.astype(np.float64)))) if data.size else 0.0
    node = value.producer
    if node is None or node.domain != "" or precision(node) == Precision.LOW or len(node.outputs) != 1:
        return None
    if node.op_type in _BOUND_COPIES:
        return _constant_bound(node.inputs[0] if node.inputs else None, depth + 1)
    if node.op_type in ("Mul", "Add", "Sub") and len(node.inputs) == 2:
        a, b = (_constant_bound(v, depth + 1) for v in node.inputs)
        if a is None or b is None:
            return None
        return a * b if node.op_type == "Mul" else a + b
    return None


@dataclass
class _Use:
    node: Node | None  # None: the graph output slot
    index: int
    need: DType


def place_casts(model: Model, ctx: Context) -> PassResult:
    placer = _Placer(model, ctx)
    placer.run()
    return PassResult("place_casts", modified=placer.modified)


def _outermost_among(scope: Graph, home: Graph, chosen: set[int]) -> Graph:
    """The outermost scope enclosing ``scope`` (up to ``home``) whose id is in ``chosen``, else
    ``scope`` itself."""
    best, current = scope, scope
    while current is not None and current is not home:
        owner = current.parent
        if owner is None:
            break
        current = owner.graph
        if current is not None and id(current) in chosen:
            best = current
    return best


def _in_loop_body(scope: Graph, home: Graph) -> bool:
    """Whether ``scope`` lies inside a Loop or Scan body below ``home``."""
    while scope is not None and scope is not home:
        owner = scope.parent
        if owner is None:
            return False
        if owner.op_type in ("Loop", "Scan"):
            return True
        scope = owner.graph
    return False


def _runs(scope: Graph) -> int | None:
    """How many times a node of ``scope`` runs per model run: the product of the trip counts of the
    Loops and the lengths of the Scans around it (an If branch counts once), None where one is not
    known statically."""
    runs = 1
    while scope is not None and scope.parent is not None:
        owner = scope.parent
        if owner.op_type in ("Loop", "Scan") and owner.domain in ("", "ai.onnx"):
            trips = _loop_trips(owner) if owner.op_type == "Loop" else _scan_length(owner)
            if trips is None:
                return None
            runs *= trips
        scope = owner.graph
    return runs


def _loop_trips(loop: Node) -> int | None:
    """A Loop's constant trip count where it has no condition input (a for loop: the body's
    condition output is ignored); None for a computed count or a condition, which may end it early."""
    from ..frontends.onnx_loader import constant_array

    ins = loop.inputs
    count = ins[0] if ins else None
    if count is None or not count.is_constant or (len(ins) > 1 and ins[1] is not None):
        return None
    value = constant_array(count)
    return max(int(value.reshape(-1)[0]), 0) if value is not None and value.size == 1 else None


def _scan_length(scan: Node) -> int | None:
    """A Scan's (opset 9+) sequence length: its first scan input's static size along its axis."""
    attrs = getattr(scan.origin, "attributes", None) or {}  # (the loader keeps none of these in ``attrs``)
    n = attrs["num_scan_inputs"].as_int() if "num_scan_inputs" in attrs else 0
    if not n or (scan.opset or 0) < 9 or len(scan.inputs) < n:
        return None
    value = scan.inputs[len(scan.inputs) - n]
    axes = list(attrs["scan_input_axes"].as_ints()) if "scan_input_axes" in attrs else []
    axis = axes[0] if axes else 0
    shape = value.shape if value is not None else None
    if shape is None or not -len(shape) <= axis < len(shape):
        return None
    length = shape[axis]
    return length if isinstance(length, int) else None


class _Placer:
    def __init__(self, model: Model, ctx: Context) -> None:
        self.model = model
        self.ctx = ctx
        self.low = ctx.low
        self.name = Namer.for_model(model)
        self.modified = False
        # id(node) -> its painted group's input slots: asked for every use, and fixed during the
        # pass (rewiring a use to a cast keeps its slot)
        self._group_inputs: dict[int, list[int]] = {}
        self._sentinels: dict[int, tuple[str, float] | None] = {}  # id(value) -> a mask sentinel it may hold

    # -- driver ----------------------------------------------------------------------------------
    def run(self) -> None:
        scopes = list(self.model.graph.scopes())
        if not any(precision(n) == Precision.LOW for s in scopes for n in s.nodes):
            self._weight_bytes(scopes)  # (what there is, unchanged)
            return  # nothing painted low anywhere: the model is left exactly as it is
        outputs_before = [(v.name, v.dtype) for v in self.model.graph.outputs]
        self._retype_low_outputs(scopes)
        self._retype_io()
        for scope in scopes:
            for value in self._float_values(scope):
                self._settle(value)
        for (name, before), value in zip(outputs_before, self.model.graph.outputs):
            if before == DType.FLOAT and value.dtype == self.low and name not in self.ctx.log.io_changed:
                self.ctx.log.io_changed.append(name)  # (--no-keep-io-types: a caller now reads it low)
        self._remove_identity_casts(scopes)
        self._saturate_low_sums(scopes)
        for scope in scopes:
            scope.sort()
        self._settle_tied_weights()
        self._weight_bytes(scopes)

    def _retype_low_outputs(self, scopes: list[Graph]) -> None:
        for scope in scopes:
            for node in scope.nodes:
                if node.meta.get("amp.branch_outputs"):  # an If the optimal placement made low
                    slots = node.meta["amp.branch_outputs"]
                elif not participates(node) or precision(node) != Precision.LOW:
                    continue
                else:
                    slots = group_outputs(node)
                for k in slots:
                    out = node.outputs[k]
                    if out.dtype == DType.FLOAT:
                        out.meta["amp.was"] = DType.FLOAT
                        out.dtype = self.low
                        self.modified = True

    def _retype_io(self) -> None:
        if self.ctx.options.keep_io_types:
            return
        for value in self.model.graph.inputs:
            if value.dtype == DType.FLOAT and not value.is_initializer and retypable_io(value):
                value.meta["amp.was"] = DType.FLOAT
                value.dtype = self.low
                self.ctx.log.io_changed.append(value.name)
                self.modified = True

    def _float_values(self, scope: Graph) -> list[Value]:
        values = list(scope.inputs) + [v for v in scope.initializers.values() if not v.is_graph_input]
        # (initializers listed as inputs are already in scope.inputs)
        values += [o for n in scope.nodes for o in n.outputs]
        return [v for v in values if v.meta.get("amp.was", v.dtype) == DType.FLOAT]

    # -- what each use needs -----------------------------------------------------------------------
    def _need(self, consumer: Node, index: int, value: Value) -> DType | None:
        if accepts_any_float(consumer, index):
            return None
        if participates(consumer) and index in self._painted_inputs(consumer):
            return self.low if precision(consumer) == Precision.LOW else DType.FLOAT
        return value.meta.get("amp.was", value.dtype)

    def _painted_inputs(self, node: Node) -> list[int]:
        slots = self._group_inputs.get(id(node))
        if slots is None:
            slots = self._group_inputs[id(node)] = group_inputs(node)
        return slots

    def _uses(self, value: Value) -> list[_Use]:
        uses = []
        for consumer, k in value.uses():
            need = self._need(consumer, k, value)
            if need is not None:
                uses.append(_Use(consumer, k, need))
        if value.is_graph_output:
            main = value.graph is self.model.graph
            need = self.low if (main and not self.ctx.options.keep_io_types and retypable_io(value)) else DType.FLOAT
            if main and value.is_graph_input:
                need = value.dtype  # (an input passed straight out: one name, so the input's type, as retyped or kept)
            if not main and self._branch_output_low(value):
                need = self.low
            uses.append(_Use(None, -1, need))
        return uses

    def _branch_output_low(self, value: Value) -> bool:
        """``value`` is an output of an If branch whose If output took the low type."""
        node = value.graph.parent
        slots = node.meta.get("amp.branch_outputs") if node is not None else None
        if not slots:
            return False
        outputs = value.graph.outputs
        return any(outputs[k] is value for k in slots if k < len(outputs))

    # -- one value -----------------------------------------------------------------------------------
    def _settle(self, value: Value) -> None:
        uses = self._uses(value)
        if not uses:
            return
        if value.is_constant:
            self._settle_constant(value, uses)
            return
        if self._try_fold_existing_cast(value, uses):
            return
        self._insert_casts(value, uses)

    def _settle_constant(self, value: Value, uses: list[_Use]) -> None:
        needs = {u.need for u in uses}
        if needs == {DType.FLOAT}:
            return
        if self._read_exactly(value):
            # a Cast (to an integer type, to double, to FLOAT) reads its values as they are: converted
            # in place for the low readers, 0.99987 became 1.0 and truncated to 1, 1e5 became 65504.
            # The original stays for it, and the low readers get a converted copy (or a Cast at use)
            needs = needs | {DType.FLOAT}
        # A training parameter stays FP32 (its gradient lands there), and a buffer the model updates
        # as it runs (``amp.mutable``: a running sum its forward adds to in place) has no fixed value
        # to convert offline: a low copy made now would go stale. Their low readers cast at each use.
        at_use = (self.ctx.options.training or value.meta.get("amp.mutable", False)) and value.is_initializer
        # A main-graph output keeps its type (the model's signature). A branch output needs the low
        # type only where its If took it: then the constant is converted, not cast in the branch.
        # (Unless the output itself takes the low type: --no-keep-io-types.)
        output_low = any(u.node is None and u.need == self.low for u in uses)
        fixed_output = value.is_graph_output and value.graph is self.model.graph and not output_low
        if needs == {self.low} and not at_use and not fixed_output:
            value.meta["amp.was"] = DType.FLOAT
            value.meta["amp.convert"] = True
            value.dtype = self.low
            self.modified = True
            if value.is_graph_input and value.graph is self.model.graph and value.name not in self.ctx.log.io_changed:
                # below IR 4 every initializer is a graph input too (is_constant lets only those
                # through): converted offline, not cast at run time, the input is declared low now
                # whatever keep_io_types says, and a caller feeding it must feed the low type
                self.ctx.log.io_changed.append(value.name)
            literal = value.producer
            if literal is not None and literal.meta.get("amp.category") is not None:  # a Constant node
                literal.meta["amp.precision"] = Precision.LOW
                literal.meta["amp.reason"] = (f"a literal, converted offline to {self.low.short}: every reader "
                                              f"computes in {self.low.short}")
            return
        low_uses = [u for u in uses if u.need == self.low]
        # A constant shared with FP32 readers: the low readers get a copy converted offline (clamped
        # to the low type's range and counted, as every converted weight is), never a run-time Cast,
        # which turns a value past the range into inf. (A Constant node's copy is an initializer;
        # below IR 4 every initializer is also a graph input, which a subgraph's signature cannot
        # take, so there a subgraph's literal keeps the Cast.)
        literal = (not value.is_initializer and self.model.frontend == "onnx"
                   and ((self.model.meta.get("ir_version") or 4) >= 4 or value.graph is self.model.graph))
        if (value.is_initializer and not at_use) or literal:
            copy = self._low_copy(value)
            for use in low_uses:
                if use.node is not None:  # (a graph output that is this initializer keeps it)
                    use.node.set_input(use.index, copy)
            self.ctx.log.weights.duplicated += 1
            self.modified = True
            return
        self._insert_casts(value, uses)

    def _read_exactly(self, value: Value) -> bool:
        """Whether a Cast or CastLike (which read any float type, so need no cast of their own)
        reads ``value``'s data into a type other than the low one."""
        for reader, k in value.uses():
            if reader.domain != "" or k != 0 or reader.op_type not in ("Cast", "CastLike"):
                continue
            if reader.op_type == "Cast":
                to = reader.attrs.get("to")
            else:
                like = reader.inputs[1] if len(reader.inputs) > 1 else None
                to = int(like.dtype) if like is not None and like.dtype is not None else None
            if to != int(self.low):
                return True
        return False

    def _retarget(self, cast: Node, value: Value, uses: list[_Use], reason: str) -> None:
        cast.attrs["to"] = int(self.low)
        value.meta["amp.was"] = DType.FLOAT
        value.dtype = self.low
        cast.meta["amp.retargeted"] = True
        cast.meta["amp.precision"] = Precision.LOW  # (it writes the low type now: the report says so)
        read = cast.inputs[0] if cast.inputs else None
        # (the tensor cast is what the Cast reads: its producer, or none for a graph input)
        self._record(cast.name or value.name, read if read is not None else value,
                     read.dtype if read is not None and read.dtype is not None else DType.FLOAT, self.low, uses,
                     value.graph, reason, "retargeted")
        self.modified = True

    def _convertible_constant(self, value: Value) -> bool:
        """A stored initializer of numbers the offline conversion can read: not one a caller may
        override (listed as a graph input) nor a training parameter."""
        origin = value.origin
        return (self.model.frontend == "onnx" and value.is_initializer and not value.is_graph_input
                and not self.ctx.options.training and value.dtype is not None and value.dtype != DType.BOOL
                and getattr(origin, "const_value", None) is not None)

    def _low_copy(self, value: Value) -> Value:
        scope = value.graph
        copy = Value(self.name(f"{value.name}/amp_{self.low.short}"), self.low, value.shape)
        copy.const_numel = value.const_numel
        copy.meta.update({"amp.was": DType.FLOAT, "amp.convert": True, "amp.copy_of": value})
        scope.add_initializer(copy)
        return copy

    def _try_fold_existing_cast(self, value: Value, uses: list[_Use]) -> bool:
        """``value = Cast(u, to=FLOAT)`` and someone needs the low type: don't chain a second cast."""
        cast = value.producer
        if cast is None or cast.op_type != "Cast" or cast.domain != "" or not cast.inputs or cast.inputs[0] is None:
            return False
        if value.meta.get("amp.mutable"):
            return False  # (retargeted, it would copy a tensor written in place through another name)
        if any(u.need == self.low for u in uses) and self._sentinel(value) is not None:
            # retargeted (or cast from its double or int64 source), it would make a mask sentinel -inf:
            # the low readers get a clamped Cast of the FP32 value instead (_insert_one)
            return False
        source = cast.inputs[0]
        # (a graph output that takes the low type counts: --no-keep-io-types, or an If's branch
        # output where the If runs low; retargeted, the Cast serves it as well as the nodes)
        all_low = [u for u in uses if u.need == self.low]
        low_uses = [u for u in all_low if u.node is not None]
        # A Cast reading ``value`` (to FLOAT again, to an integer) needs no inserted Cast, so it is
        # not among ``uses``; but a retargeted Cast would hand it ``value`` through the low type,
        # and a value past 65504 would reach it as inf (an FP32 -> low -> FP32 round trip). Then
        # the Cast is not retargeted: the low readers get a Cast of the source of their own.
        passes_on = any(reader.op_type == "Cast" and reader.domain == "" and reader.attrs.get("to") != int(self.low)
                        for reader, _ in value.uses())
        if len(all_low) == len(uses) and len(low_uses) < len(all_low) and not passes_on:
            self._retarget(cast, value, all_low, "existing Cast(to=FLOAT) writes an output that takes the low "
                           "type, and feeds only low-precision readers: retargeted")
            return True
        if not low_uses:
            return False
        convertible = self._convertible_constant(source)
        if len(low_uses) == len(uses) and source.dtype != self.low and (convertible or not passes_on):
            if not convertible:
                self._retarget(cast, value, low_uses, "existing Cast(to=FLOAT) feeds only low-precision consumers: "
                               "retargeted")
                return True
            # Cast(c, to=FLOAT) of a stored constant: retargeted, it would cast at run time, where a
            # value past the low type's range becomes inf (an int64 -100000 mask fill: a NaN row
            # after Softmax). Converted offline instead, it is clamped like an FP32 constant.
            copy = self._low_copy(source)
            for use in low_uses:
                use.node.set_input(use.index, copy)
            if not value.uses() and not value.is_graph_output:
                self._drop_cast(cast, value, source, "existing Cast(to=FLOAT) of a stored constant read only in "
                                "low precision: the constant is converted offline (clamped to the low type's "
                                "range, as an FP32 one is) and the Cast removed")
            self.modified = True
            return True
        rest = [u for u in uses if u.need != self.low or u.node is None]
        if source.dtype == self.low:
            for use in low_uses:
                use.node.set_input(use.index, source)
            self.modified = True
            if not rest and not value.uses() and not value.is_graph_output:
                self._drop_cast(cast, value, source, "existing Cast(to=FLOAT) of a low value read only in low "
                                "precision: its readers read the value itself; removed")
                return True
        elif any(u.need == self.low for u in rest):
            # a graph output that takes the low type gets a Cast of ``value`` anyway: the low readers
            # share it (a Cast of the source for them beside it cast the same value twice)
            rest = rest + low_uses
        else:
            self._insert_casts(source, [_Use(u.node, u.index, self.low) for u in low_uses], replaces=value)
        self._insert_casts(value, rest)
        return True

    # -- inserting -------------------------------------------------------------------------------------
    def _insert_casts(self, value: Value, uses: list[_Use], *, replaces: Value | None = None) -> None:
        produced = value.dtype
        groups: dict[tuple[DType, int], list[_Use]] = {}
        scopes: dict[int, Graph] = {}
        home = value.graph
        placed: list[tuple[_Use, Graph]] = []
        for use in uses:
            if use.need == produced:
                continue
            scope = use.node.graph if use.node is not None else value.graph
            if home is not None and scope is not home and _in_loop_body(scope, home):
                scope = home  # (in a Loop/Scan body the Cast of an outer value would run on every iteration)
            placed.append((use, scope))
        # An outer value a body reads in FP32 takes the Cast a scope around it makes anyway (its own
        # scope, or a branch it is nested in: a second Cast would cast the value again); the
        # outermost such scope serves every FP32 reader below it. An If branch's reader alone
        # keeps its Cast in the branch, which runs only when taken.
        fp32_scopes = {id(scope) for use, scope in placed if use.need == DType.FLOAT}
        for k, (use, scope) in enumerate(placed):
            if use.need == DType.FLOAT and home is not None:
                outer = _outermost_among(scope, home, fp32_scopes)
                if outer is not scope:
                    placed[k] = (use, outer)
        # A tensor written in place as the graph runs (``amp.mutable``, torch) is cast at each use:
        # one Cast shared by a reader before a write and one after it would hand the later one
        # the value from before.
        apart = value.meta.get("amp.mutable", False) and self.model.frontend == "torch"
        for k, (use, scope) in enumerate(placed):
            scopes[id(scope)] = scope
            groups.setdefault((use.need, id(scope), k if apart else -1), []).append(use)
        # by type, then in the order the uses came (stable): never by id(scope), a memory address that
        # would make the Cast names (and so the written model) differ from run to run
        for (need, scope_id, _), members in sorted(groups.items(), key=lambda kv: int(kv[0][0])):
            self._insert_one(value, need, scopes[scope_id], members, replaces)

    def _insert_one(self, value: Value, need: DType, scope: Graph, uses: list[_Use], replaces: Value | None) -> None:
        to_output = any(u.node is None for u in uses)
        # (not for a tensor written in place as the graph runs: the model's own cast of it may read
        # it before a write this reader comes after)
        existing = None if to_output or value.meta.get("amp.mutable") else self._existing_cast(value, need, scope)
        if existing is not None:  # the model's own Cast of this value to this type: one per value and type
            for use in uses:
                use.node.set_input(use.index, existing.outputs[0])
            self.modified = True
            return
        tensor = (replaces or value).name
        if to_output:
            out_name = value.name
            value.name = self.name(f"{value.name}/amp_{value.dtype.short}")
        else:
            out_name = self.name(f"{tensor}/amp_{need.short}")
        out = Value(out_name, need, value.shape)
        if to_output:
            out.meta["amp.takes_output_of"] = value  # (the emitter moves the output's doc and metadata)
        anchor = value.producer if value.producer is not None and value.producer.graph is scope else None
        source, saturated = value, None
        sentinel = self._sentinel(value) if need == self.low and value.dtype == DType.FLOAT else None
        if sentinel is not None and self.model.frontend == "onnx":
            source, made = self._saturation(value, tensor, scope)
            for node in made:
                scope.insert_after(anchor, node)
            saturated = sentinel
        elif sentinel is not None:
            saturated = sentinel  # (the fx emitter clamps before the cast it writes)
        cast = Node("Cast", [source], name=self.name(f"amp_cast/{tensor}/to_{need.short}"), attrs={"to": int(need)},
                    outputs=[out])
        cast.input_groups, cast.output_groups = ["T1"], ["T2"]
        cast.opset = scope.opsets.get("")
        cast.meta.update({"amp.inserted": True, "amp.precision": Precision.NONE, "amp.participates": False,
                          "input_names": ["input"]})
        if saturated is not None and self.model.frontend != "onnx":
            cast.meta["amp.saturate"] = LOW_LIMITS[self.low]
        if saturated is not None:
            out.meta["amp.saturated"] = saturated[1]  # (its low readers: _saturate_low_sums)
        scope.insert_after(anchor, cast)
        for use in uses:
            if use.node is None:
                scope.outputs.replace(value, out)
            else:
                use.node.set_input(use.index, out)
        if to_output:
            # the model's own Cast of this value to the same type reads the output's Cast instead
            # (a Cast to the type it already has, removed below): not a second Cast beside ours
            while (own := self._existing_cast(value, need, scope)) is not None:
                own.set_input(0, out)
        reason = self._cast_reason(value, need, uses, scope)
        if saturated is not None:
            from ..frontends.onnx_constants import SENTINEL

            where, number = saturated
            limit = LOW_LIMITS[self.low]
            reason += (f"; clamped to ±{limit:g} first (Clip): it may hold the mask sentinel {number:g} "
                       f"({where}), which a Cast makes ±inf (a fully masked softmax row NaN), where a constant "
                       f"converted offline saturates" if abs(number) >= SENTINEL else
                       f"; clamped to ±{limit:g} first (Clip): it may hold {number:g} ({where}), past "
                       f"{self.low.short}'s range, which a Cast makes ±inf (and inf × 0 NaN in the op reading it); "
                       f"clamped, as a constant converted offline is")
        self._record(cast.name, replaces or value, value.dtype, need, uses, scope, reason, "inserted")
        cast.meta["amp.reason"] = reason
        self.modified = True

    # -- mask sentinels -----------------------------------------------------------------------------------
    def _saturate_low_sums(self, scopes: list[Graph]) -> None:
        """An FP16 Add/Sub (Sum) reading a value that may hold a number FP16 saturates (a mask
        sentinel of -1e9 converted offline, or clamped before its run-time Cast, to -65504) is
        followed by a clamp of its sum to ±65504, in FP16 (``Clip``; ``Max`` and ``Min`` before
        opset 12, where onnxruntime has no FP16 Clip). Its sum with a score of -16 or less was
        -inf, where FP32 (-1e9 + score) is finite: a row every entry of which is masked (a
        left-padded sequence under a causal mask) was -inf throughout, its softmax NaN, and the
        next layer spread the NaN to every row. Clamped, such a row is -65504 throughout and its
        softmax finite, as HF's models clamp attention scores to finfo.min. Both sides: the sign
        a mask takes at run time is not the constant's (``(m - 1) * 1e9``). (ONNX, FP16, opset 8
        and later: Max-6 does not broadcast. BF16 holds -1e9, and 2 * finfo(float32).min
        overflows in FP32 too.)"""
        if self.model.frontend != "onnx" or self.low != DType.FLOAT16 or not self._any_saturated(scopes):
            return
        memo: dict[int, float | None] = {}
        made = 0
        first = None
        for scope in scopes:
            if (scope.opsets.get("") or 0) < 8:
                continue
            for node in list(scope.nodes):
                if node.domain != "" or node.op_type not in ("Add", "Sub", "Sum") or not node.outputs:
                    continue
                out = node.outputs[0]
                if out is None or out.dtype != DType.FLOAT16 or out.is_graph_output or not out.has_uses():
                    continue
                if not any(self._saturated_in(v, memo) is not None for v in node.inputs):
                    continue
                self._clamp_sum(node, out, scope)
                made += 1
                first = first or node_label(node)
        if made:
            self.ctx.log.notes.append(
                f"clamped sums: {made} fp16 Add/Sub reading a mask sentinel saturated to ±65504 (e.g. {first!r}) "
                f"clamp their sum to ±65504 (tagged inserted: saturate): the fp16 sum of -65504 and a score of "
                f"-16 or less is -inf, and a fully masked row's softmax NaN, where FP32 is finite")
            self.modified = True

    def _any_saturated(self, scopes: list[Graph]) -> bool:
        """Whether anything in the model holds a number FP16 saturates (a clamped Cast's output, a
        converted constant past the range that a sum or a copy reads, a ConstantOfShape's fill):
        most models hold none, and :meth:`_saturate_low_sums` then walks nothing (0.2 s of a
        100k-node graph)."""
        readers = _CARRY_SENTINELS | {"Add", "Sub", "Sum"}
        for scope in scopes:
            values = [*scope.initializers.values(), *(o for n in scope.nodes for o in n.outputs if o is not None)]
            for value in values:
                if "amp.saturated" in value.meta:
                    return True
                if (value.data_known or (value.producer is not None and value.producer.op_type == "ConstantOfShape")) \
                        and any(r.op_type in readers for r, _ in value.uses()) \
                        and self._saturated_source(value) is not None:
                    return True
        return False

    def _saturated_source(self, value: Value) -> float | None:
        """The number past FP16's range that the FP16 ``value`` holds saturated as a constant
        converted offline or a ConstantOfShape's fill, or None."""
        from ..frontends.onnx_constants import _attribute, _largest
        from ..frontends.onnx_loader import constant_array

        limit = LOW_LIMITS[self.low]
        if value.dtype != DType.FLOAT16:
            return None
        if value.data_known:
            source = value.meta.get("amp.copy_of", value)
            if value.meta.get("amp.was") != DType.FLOAT or (source.numel or 0) > _SENTINEL_SCAN:
                return None
            return _largest(constant_array(source), limit, float("inf"))
        node = value.producer
        if node is not None and node.domain == "" and node.op_type == "ConstantOfShape":
            return _largest(_attribute(node, "value"), limit, float("inf"))
        return None

    def _saturated_in(self, value: Value | None, memo: dict[int, float | None], depth: int = 0) -> float | None:
        """A number past FP16's range that the FP16 ``value`` may hold saturated (as -65504): a
        constant converted offline, a value clamped before its run-time Cast, or what copies or
        adds them (:data:`_CARRY_SENTINELS`); None where there is none."""
        if value is None or value.dtype != DType.FLOAT16 or depth > 16:
            return None
        if id(value) in memo:
            return memo[id(value)]
        memo[id(value)] = None  # (a cycle through a body reads as none)
        found = value.meta.get("amp.saturated")
        if found is None:
            found = self._saturated_source(value)
        if found is None and (node := value.producer) is not None and node.domain == "":
            if node.op_type in _CARRY_SENTINELS or node.meta.get("amp.inserted_kind") == "saturate":
                slots = _SENTINEL_SLOTS.get(node.op_type, range(len(node.inputs)))
                for slot in slots:
                    found = self._saturated_in(node.inputs[slot], memo, depth + 1) if slot < len(node.inputs) else None
                    if found is not None:
                        break
        memo[id(value)] = found
        return found

    def _clamp_sum(self, node: Node, out: Value, scope: Graph) -> None:
        """``Clip(out, -65504, 65504)`` in FP16 after ``node`` (``Min(Max(out, -65504), 65504)``
        before opset 12); its readers read the clamp."""
        opset = scope.opsets.get("") or 0
        readers = list(out.uses())
        limit = LOW_LIMITS[self.low]
        name = self.name(f"amp_saturate/{out.name}")
        low, high = self._bound(f"{name}/min", -limit, DType.FLOAT16), self._bound(f"{name}/max", limit, DType.FLOAT16)
        made: list[Node] = [low, high]
        clamped = Value(self.name(f"{out.name}/amp_saturated"), DType.FLOAT16, out.shape)
        if opset >= 12:
            made.append(Node("Clip", [out, low.outputs[0], high.outputs[0]], name=name, outputs=[clamped]))
        else:
            floor = Value(self.name(f"{out.name}/amp_floor"), DType.FLOAT16, out.shape)
            made.append(Node("Max", [out, low.outputs[0]], name=name, outputs=[floor]))
            made.append(Node("Min", [floor, high.outputs[0]], name=self.name(f"{name}/max"), outputs=[clamped]))
        self._saturating(made, opset, f"clamps the fp16 sum of {node_label(node)} to ±{limit:g}: it may add a mask "
                                      f"sentinel saturated to ±{limit:g}, and the sum overflow to ±inf")
        anchor = node
        for each in made:
            scope.insert_after(anchor, each)
            anchor = each
        clamped.meta["amp.saturated"] = -limit
        for reader, index in readers:
            reader.set_input(index, clamped)

    def _sentinel(self, value: Value, depth: int = 0) -> tuple[str, float] | None:
        """(where, the number) of a mask sentinel the FP32 ``value`` may hold: a constant of
        magnitude 1e8 or more that the low type cannot hold (-1e9, finfo(float32).min), read
        through the FP32 elementwise and copying ops that made ``value`` (``(1 - mask) * fmin``).
        A constant like it that a low node reads is converted offline, which saturates it; cast at
        run time it became -inf, and a fully masked row of the softmax after it NaN (a padded
        sequence, a left-padded decoder row), where FP32 gives a finite row. In a torch graph the
        frontend marks such values (``amp.sentinel``: a ``mul`` by finfo.min, a ``masked_fill`` of
        -1e9, and what copies them); it keeps their infer and clear readers FP32, and an allow op
        reading one (``baddbmm``, an attention's weights path) gets a clamped cast. Any other number
        past the low type's range counts the same way (a Pad's or Resize's fill of -70000 kept the
        Pad FP32, and the Cast of its output to a MatMul made it -inf, and NaN after the MatMul):
        the Cast reads it clamped to the type's largest value."""
        if self.model.frontend == "torch" and value is not None:
            return value.meta.get("amp.sentinel")  # (marked by the torch frontend: a mask fill and its copies)
        if self.model.frontend != "onnx" or value is None or depth > 16:
            return None
        key = id(value)
        if key in self._sentinels:
            return self._sentinels[key]
        self._sentinels[key] = None  # (a cycle through a body reads as none)
        found = self._find_sentinel(value, depth)
        self._sentinels[key] = found
        return found

    def _find_sentinel(self, value: Value, depth: int) -> tuple[str, float] | None:
        from ..frontends.onnx_constants import _attribute, _largest
        from ..frontends.onnx_loader import constant_array

        dtype = value.dtype  # (as painted: a low node's output is low already, its constants converted)
        if dtype is None or dtype == DType.BOOL or dtype in (self.low, DType.FLOAT16):
            # (a low value holds no sentinel: a constant converted offline is clamped; FP16 holds
            # nothing past either low type's range. A BF16 one, for an FP16 rewrite, may: a -1e9 mask)
            return None
        threshold = LOW_LIMITS[self.low]  # (past it: a sentinel of 1e8 and more, or any other number)
        if value.data_known:  # (an overridable input's default mask too)
            if (value.numel or 0) > _SENTINEL_SCAN:
                return None
            big = _largest(constant_array(value), threshold, float("inf"))  # (an int64 -1e9 too)
            return (repr(value.name), big) if big is not None else None
        node = value.producer
        if node is None or node.domain != "" or precision(node) == Precision.LOW:
            return None
        if node.op_type == "ConstantOfShape":
            big = _largest(_attribute(node, "value"), threshold, float("inf"))
            return (f"the fill of {node_label(node)}", big) if big is not None else None
        if node.op_type in ("Pad", "Resize"):  # a fill attribute (Pad before opset 11; Resize's crop)
            name = "value" if node.op_type == "Pad" else "extrapolation_value"
            big = _largest(_attribute(node, name), threshold, float("inf"))
            if big is not None and (node.op_type == "Pad" or string_attribute(
                    node, "coordinate_transformation_mode") == "tf_crop_and_resize"):
                return (f"the {name} of {node_label(node)}", big)
        if node.op_type == "DequantizeLinear":  # a quantized weight whose values pass the range (int8 × 800)
            from ..frontends.onnx_constants import dequantized_past

            bound = dequantized_past(node, threshold)
            return (f"what {node_label(node)} dequantizes", bound) if bound is not None else None
        if node.op_type in ("If", "Loop", "Scan"):  # what the bodies return in this slot, or the loop starts from
            return self._sentinel_of_control(node, value, depth)
        if node.op_type in ("Mul", "Add", "Sub"):  # a weight dequantized by hand: Cast(int8) × 800 is 101600
            bound = _constant_bound(value)
            if bound is not None and bound > threshold:
                return (f"what {node_label(node)} computes from constants", bound)
        if node.op_type not in _CARRY_SENTINELS:
            return None  # (a bounded op: Softmax, Sigmoid, a normalisation; or one that computes anew)
        slots = _SENTINEL_SLOTS.get(node.op_type, range(len(node.inputs)))
        for slot in slots:
            found = self._sentinel(node.inputs[slot], depth + 1) if slot < len(node.inputs) else None
            if found is not None:
                return found
        return None

    def _sentinel_of_control(self, node: Node, value: Value, depth: int) -> tuple[str, float] | None:
        k = next((i for i, out in enumerate(node.outputs) if out is value), None)
        if k is None:
            return None
        candidates: list[Value | None] = []
        for body in node.all_subgraphs():
            # If: its branch's output k; Loop: body output k + 1 (after the condition); Scan: body output k
            at = k + 1 if node.op_type == "Loop" else k
            candidates.append(body.outputs[at] if at < len(body.outputs) else None)
        if node.op_type == "Loop" and k + 2 < len(node.inputs):
            candidates.append(node.inputs[k + 2])  # (a loop-carried value: its initial one)
        elif node.op_type == "Scan" and k < len(node.inputs):
            candidates.append(node.inputs[k])
        for candidate in candidates:
            found = self._sentinel(candidate, depth + 1)
            if found is not None:
                return found
        return None

    def _saturation(self, value: Value, tensor: str, scope: Graph) -> tuple[Value, list[Node]]:
        """``Clip(value, -max, max)`` in FP32, for the Cast to the low type to read: the nodes, in order."""
        opset = scope.opsets.get("") or 0
        limit = LOW_LIMITS[self.low]
        name = self.name(f"amp_saturate/{tensor}")
        out = Value(self.name(f"{tensor}/amp_saturated"), DType.FLOAT, value.shape)
        if opset >= 11:  # min and max are inputs
            bounds = [self._bound(f"{name}/min", -limit, DType.FLOAT), self._bound(f"{name}/max", limit, DType.FLOAT)]
            made = [*bounds, Node("Clip", [value, *(b.outputs[0] for b in bounds)], name=name, outputs=[out])]
        else:  # Clip-6: attributes
            made = [Node("Clip", [value], name=name, attrs={"min": -limit, "max": limit}, outputs=[out])]
        self._saturating(made, opset)
        return out, made

    def _bound(self, name: str, number: float, dtype: DType) -> Node:
        """A scalar Constant of ``number`` in ``dtype`` (FLOAT or FLOAT16): a clamp's bound."""
        import numpy as np

        bound = Value(self.name(name), dtype, ())
        bound.const_numel = 1
        bound.meta["amp.made_by_fusion"] = True  # (not in the input: weight counts leave it out)
        return Node("Constant", [], name=bound.name,
                    attrs={"value": np.asarray(number, np.float16 if dtype == DType.FLOAT16 else np.float32)},
                    outputs=[bound])

    @staticmethod
    def _saturating(nodes: list[Node], opset: int, reason: str | None = None) -> None:
        """Give the nodes of an inserted clamp their opset, schema slots and tags."""
        from ..frontends.onnx_loader import schema_slots

        for node in nodes:
            node.opset = opset
            schema_slots(node.op_type, "", opset, len(node.inputs), 1).apply(node)
            node.meta.update({"amp.inserted": True, "amp.inserted_kind": "saturate", "amp.precision": Precision.NONE,
                              "amp.participates": False})
            if reason is not None:
                node.meta["amp.reason"] = reason

    @staticmethod
    def _existing_cast(value: Value, need: DType, scope: Graph) -> Node | None:
        """A Cast the model already has in ``scope`` that turns ``value`` into ``need``."""
        for node, index in value.uses():
            if index == 0 and node.graph is scope and node.op_type == "Cast" and node.domain == "" \
                    and not node.meta.get("amp.inserted") and node.attrs.get("to") == int(need) \
                    and node.outputs and node.outputs[0].dtype == need:
                return node
        return None

    def _cast_reason(self, value: Value, need: DType, uses: list[_Use], scope: Graph) -> str:
        if any(u.node is None for u in uses):
            if scope.parent is not None:  # an If branch's or a Loop/Scan body's output
                return f"a body output takes the {need.short} type of the control-flow op's output it becomes"
            return "graph outputs keep their type (keep_io_types)" if need == DType.FLOAT else \
                "--no-keep-io-types: graph outputs take the low type"
        first = uses[0].node
        label = node_label(first)
        if need == DType.FLOAT:
            island = first.meta.get("amp.island")
            where = f" (FP32 island {island})" if island is not None else ""
            return f"{label}{where} computes in FP32: {first.meta.get('amp.reason', '')}"
        return f"{label} computes in {need.short}: {first.meta.get('amp.reason', '')}"

    def _record(self, name: str, value: Value, src: DType, dst: DType, uses: list[_Use], scope: Graph,
                reason: str, kind: str) -> None:
        output = "<graph output>" if scope.parent is None else "<body output>"
        consumers = sorted({node_label(u.node) if u.node is not None else output for u in uses})
        producer = value.producer
        self.ctx.log.casts.append(CastRecord(
            name=name, tensor=value.name, src=src.short, dst=dst.short,
            producer=node_label(producer) if producer is not None else None, consumers=consumers,
            shape=value.shape, numel=value.numel, scope=scope_label(scope), reason=reason, kind=kind,
            runs=_runs(scope)))

    # -- cleanup --------------------------------------------------------------------------------------
    def _remove_identity_casts(self, scopes: list[Graph]) -> None:
        """A Cast whose input already has its target type does nothing: its readers read the input.

        Two kinds: a float Cast whose producer went low with it (painting made it a no-op), and a
        no-op the model already had (TorchScript exports write Cast(int64 -> int64) after every
        Shape/Gather and Cast(bool -> bool) in masks). Both are removed after painting, so a Cast the
        user wrote as a precision hint has already done its work; a Cast that writes a graph output
        keeps the output's name and stays.
        """
        # A torch graph that mutates tensors in place keeps the casts it wrote: ``_to_copy`` copies,
        # and reading the source instead would let a later in-place op change it.
        mutates = self.model.frontend == "torch" and any(n.meta.get("fx.inplace") for s in scopes for n in s.nodes)
        for scope in scopes:
            casts = [node for node in scope.nodes if node.op_type == "Cast" and node.domain == ""]
            for node in casts:
                if node.meta.get("amp.inserted"):
                    continue
                src, out = node.inputs[0], node.outputs[0]
                if not is_noop_cast(node) or out.is_graph_output:
                    continue
                if mutates and src.meta.get("amp.was") is None:
                    continue
                reason = ("existing Cast became a no-op after painting: removed" if src.meta.get("amp.was") is not None
                          else f"existing Cast of a {src.dtype.short} value to {src.dtype.short} does nothing: removed")
                out.replace_all_uses_with(src, include_outputs=False)
                self._drop_cast(node, out, src, reason)
            if not mutates:
                for node in casts:
                    self._fold_round_trip(node)

    def _fold_round_trip(self, node: Node) -> None:
        """``Cast(Cast(x, to=W), to=type(x))`` where W holds every value of x's type exactly (an fp16
        softmax the model upcasts and whose upcast a low MatMul reads): the pair is ``x`` itself.
        ``node`` is a standard-domain Cast (already removed if it did nothing)."""
        if node.graph is None:
            return
        mid, out = node.inputs[0], node.outputs[0]
        # (through Identity nodes: one between the two Casts moves nothing, and it stopped the
        # fold, 2 Casts per attention layer instead of none)
        passes = []
        while mid is not None and _is_standard(mid.producer, "Identity") and mid.producer.inputs \
                and mid.producer.inputs[0] is not None:
            passes.append(mid.producer)
            mid = mid.producer.inputs[0]
        first = mid.producer if mid is not None else None
        if first is None or first.op_type not in ("Cast", "CastLike") or first.domain != "" or out.is_graph_output:
            return
        src = first.inputs[0]
        if src is None or src.dtype is None or int(src.dtype) != node.attrs.get("to"):
            return
        # (CastLike(x, like): the type it writes is like's, its output's)
        widened = first.attrs.get("to") if first.op_type == "Cast" else \
            int(mid.dtype) if mid.dtype is not None else None
        if widened not in _EXACT_WIDENING.get(src.dtype, ()):
            return
        out.replace_all_uses_with(src, include_outputs=False)
        wide = DType(widened).name.lower()
        self._drop_cast(node, out, src, f"casts a {src.dtype.short} value to {wide} and back, which returns it "
                        "exactly: its readers read the value itself; removed")
        for identity in passes:  # (nearest first: one another node reads stays, and those before it)
            if identity.outputs[0].uses() or identity.outputs[0].is_graph_output:
                break
            identity.graph.remove(identity)
            identity.meta["amp.removed"] = True
            identity.meta["amp.read_instead"] = src
            self.model.meta.setdefault("amp.removed_nodes", []).append(identity)
        if not mid.uses() and not mid.is_graph_output:
            self._drop_cast(first, mid, src, f"its only reader was the cast back to {src.dtype.short}, "
                            "folded away: removed")

    def _drop_cast(self, node: Node, out: Value, src: Value, reason: str) -> None:
        """Remove an existing Cast nobody needs any more (its readers read ``src``). A record of the
        same Cast (retargeted before a fold removed it) is replaced: the report gives each Cast its
        outcome."""
        name = node.name or out.name
        if node.meta.get("amp.retargeted"):
            self.ctx.log.casts[:] = [c for c in self.ctx.log.casts if c.name != name or c.kind != "retargeted"]
        source = node.inputs[0] if node.inputs else None
        read = source.dtype if source is not None else None
        wrote = DType(node.attrs["to"]) if isinstance(node.attrs.get("to"), int) else out.dtype  # (CastLike)
        self._record(name, source if source is not None else out, read or src.dtype, wrote or src.dtype, [],
                     node.graph, reason, "removed")
        node.graph.remove(node)
        # An initializer only this Cast read (an int64 constant now converted offline to a low copy)
        # goes with it: the emitter drops such an initializer (onnx_emitter._remove), so the weight
        # counts leave it out after, as they do a fused pattern's eps.
        if (source is not None and source.is_initializer and not source.has_uses() and not source.is_graph_input
                and not source.is_graph_output and self.model.frontend == "onnx"):
            source.meta["amp.dropped_unread"] = True
        node.meta["amp.removed"] = True
        node.meta["amp.read_instead"] = src  # (for a torch reader the IR has no edge for: fx_emitter)
        self.model.meta.setdefault("amp.removed_nodes", []).append(node)
        self.modified = True

    def _settle_tied_weights(self) -> None:
        """A tied weight (torch: one tensor the module holds by several names) converted in place
        under one name is converted under the names no node reads too: the emitter gives them the
        one converted tensor (a torch.export graph reads a tied embedding by one name only). Where
        an FP32 node reads it by another name, its low readers read a converted copy instead."""
        if self.model.frontend != "torch":
            return
        groups: dict[str, list[Value]] = {}
        for value in self.model.graph.initializers.values():
            groups.setdefault(value.meta.get("amp.alias_of", value.name), []).append(value)
        for members in groups.values():
            converted = [v for v in members if v.meta.get("amp.convert")]
            if not converted or len(members) == 1:
                continue
            if any(not v.meta.get("amp.convert") and v.has_uses() for v in members):
                # an FP32 node reads the weight by another name (an FP32 embedding tied to a low
                # head): converted in place under one name, the tie broke (an FP16 head.weight
                # beside the FP32 emb.weight). The low readers get a converted copy instead.
                for v in converted:
                    v.dtype = v.meta.pop("amp.was", DType.FLOAT)
                    v.meta.pop("amp.convert", None)
                    copy = self._low_copy(v)
                    for reader, index in list(v.uses()):
                        reader.set_input(index, copy)
                    self.ctx.log.weights.duplicated += 1
                continue
            for v in members:  # (the others are read by no node)
                if not v.meta.get("amp.convert") and v.dtype == DType.FLOAT:
                    v.meta.update({"amp.was": DType.FLOAT, "amp.convert": True})
                    v.dtype = converted[0].dtype

    def _weight_bytes(self, scopes: list[Graph]) -> None:
        """Bytes of the initializers and Constant tensors before and after, and how many were
        converted (those a fused pattern alone read count before only: they leave with it, in the
        emitter)."""
        w = self.ctx.log.weights
        before: set[str] = set()  # the tensors counted, by their first name (a tied weight is one)
        after: set[tuple[str, DType]] = set()
        for scope in scopes:
            constants = [n.outputs[0] for n in scope.nodes
                         if n.op_type == "Constant" and n.domain in ("", "ai.onnx") and n.outputs]
            for value in [*scope.initializers.values(), *constants]:
                if value.const_numel is None or value.dtype is None:
                    continue
                tensor = value.meta.get("amp.alias_of", value.name)
                if "amp.copy_of" not in value.meta and not value.meta.get("amp.made_by_fusion") \
                        and tensor not in before:
                    before.add(tensor)
                    w.bytes_before += int(value.const_numel * value.meta.get("amp.was", value.dtype).itemsize)
                if value.meta.get("amp.dropped_unread") or (tensor, value.dtype) in after:
                    continue  # (in the input, not in the output; a tied weight's other name)
                after.add((tensor, value.dtype))
                w.bytes_after += int(value.const_numel * value.dtype.itemsize)
                if value.meta.get("amp.convert"):  # (a tied weight once: its names are one tensor)
                    w.converted += 1
                    w.converted_elements += value.const_numel


def _is_standard(node: Node | None, op: str) -> bool:
    return node is not None and node.op_type == op and node.domain in ("", "ai.onnx")
