"""Paint: decide each participating node's precision, scope by scope.

Order (PRECISION.md, after TensorFlow's grappler auto_mixed_precision):
1. allow ops are low precision; a scope with no allow op is left as it is;
2. deny spreads forward through clear and infer ops along paths that end at a deny or infer op
   (``deny → (clear|infer)* → (deny|infer)``): a decomposed LayerNorm becomes one FP32 island;
   a deny op whose rule marks its output bounded (Sin, Cos) computes in FP32 but does not spread;
3. infer and clear ops sandwiched between allow ops (downstream of one, upstream of another)
   join the low region;
4. allow spreads through clear ops, both directions;
5. (classify already removed ops with no low kernel at their opset);
6. safety: a non-allow node painted low that both reads an FP32 tensor and feeds an FP32
   consumer would make an FP32→low→FP32 round trip (values > 65504 become inf in FP16), so it
   goes back to FP32, repeated to a fixed point.

Painting is per type-constraint group (``base.group_inputs/outputs``); a subgraph is a scope of
its own whose boundary (inputs, outputs, outer-scope values) keeps FP32.
"""

from __future__ import annotations

from ..decisions import Category, Precision
from ..ir import DType, Graph, Model, Node, Value
from .base import Context, PassResult, accepts_any_float, adds_a_constant, category, converts_non_float, \
    group_inputs, group_outputs, node_label, participates, read_through_casts, retypable_io, round_trip_harm

_LOW_OK = (Category.CLEAR, Category.INFER)


def paint(model: Model, ctx: Context) -> PassResult:
    for scope in model.graph.scopes():
        _ScopePainter(scope, ctx).run()
    return PassResult("paint", modified=False)


class _ScopePainter:
    def __init__(self, scope: Graph, ctx: Context) -> None:
        self.scope = scope
        self.ctx = ctx
        self.nodes = [n for n in scope.nodes if participates(n)]
        self.index = {id(n): i for i, n in enumerate(self.nodes)}
        self.cat = [category(n) for n in self.nodes]
        # per node, its painted group's input and output slots (read for every edge: computed once)
        self.group_ins = [group_inputs(n) for n in self.nodes]
        self.group_outs = [group_outputs(n) for n in self.nodes]
        self.preds: list[set[int]] = [set() for _ in self.nodes]
        self.succs: list[set[int]] = [set() for _ in self.nodes]
        self.fp32_source = [False] * len(self.nodes)  # reads an FP32 tensor painting cannot change
        self.fp32_sink = [False] * len(self.nodes)  # feeds a consumer that needs FP32
        # readers behind a Cast out of the low type (Cast(to=FLOAT) → Mul): no paint edge, but a
        # round trip through the low type ends there if they are FP32
        self.trip_succs: list[set[int]] = [set() for _ in self.nodes]
        self.step: dict[int, str] = {}
        self.via: dict[int, int] = {}
        self.left: dict[int, int] = {}  # painted through this neighbour, which the round-trip check kept FP32
        # nodes reading what a deny op computed in FP64, cast to FP32 (index -> what they read): an
        # Exp in double is still an Exp
        self.fp64_read: dict[int, str] = {}
        self._wire()

    # -- graph view --------------------------------------------------------------------------------
    def _wire(self) -> None:
        is_main = self.scope.parent is None
        keep_io = self.ctx.options.keep_io_types or not is_main
        for i, node in enumerate(self.nodes):
            for k in self.group_ins[i]:
                value = node.inputs[k]
                j = self._group_producer(value)
                if j is not None:
                    self.preds[i].add(j)
                    self.succs[j].add(i)
                elif not self._flexible_source(value, keep_io):
                    self.fp32_source[i] = True
                    source = _fp64_deny_source(value, self.ctx)
                    if source is not None:
                        self.fp64_read[i] = f"{node_label(value.producer)} (of {source}, computed in FP64)"
            if converts_non_float(node):
                self.fp32_source[i] = True
            for k in self.group_outs[i]:
                if self._has_fixed_use(node.outputs[k], keep_io):
                    self.fp32_sink[i] = True
                behind, fixed = read_through_casts(node.outputs[k], self.ctx.low, self._painted_reader)
                self.trip_succs[i] |= behind
                self.fp32_sink[i] = self.fp32_sink[i] or fixed

    def _painted_reader(self, reader: Node, slot: int) -> int | None:
        j = self.index.get(id(reader)) if reader.graph is self.scope else None
        return j if j is not None and slot in self.group_ins[j] else None

    def _group_producer(self, value: Value) -> int | None:
        value = through_no_op_casts(value)
        j = self.index.get(id(value.producer)) if value.producer is not None else None
        return j if j is not None and value.producer_index in self.group_outs[j] else None

    def _flexible_source(self, value: Value, keep_io: bool) -> bool:
        if value.is_constant:
            return True  # converted offline to whatever its consumers need
        if value.is_graph_input and value.graph is self.scope and not keep_io and retypable_io(value):
            return True
        return value.dtype != DType.FLOAT

    def _has_fixed_use(self, value: Value, keep_io: bool) -> bool:
        if value.is_graph_output and (keep_io or not retypable_io(value)):
            return True
        for consumer, k in value.uses():
            if consumer.graph is not self.scope:
                return True  # read inside a nested body, whose boundary is FP32
            if accepts_any_float(consumer, k):
                continue
            j = self.index.get(id(consumer))
            if j is None or k not in self.group_ins[j]:
                return True
        return False

    # -- the steps ---------------------------------------------------------------------------------
    def run(self) -> None:
        allow = {i for i, c in enumerate(self.cat) if c == Category.ALLOW}
        if not allow:
            self._finish(set(), set(), none_allowed=True)
            return
        for i in allow:
            self.step[i] = "allow"
        deny = {i for i, c in enumerate(self.cat) if c in (Category.DENY, Category.UNLISTED)}
        self._spread_deny(deny, allow)
        self._add_between_allow(allow, deny)
        self._spread_allow_through_clear(allow, deny)
        self._compare_in_operand_type(allow, deny)
        self._remove_round_trips(allow)
        self._finish(allow, deny, none_allowed=False)

    def _dfs(self, roots, neighbours, enter, visit) -> None:
        for root in roots:
            stack = [root]
            while stack:
                current = stack.pop()
                for nxt in sorted(neighbours(current)):
                    if enter(nxt):
                        visit(nxt, current)
                        stack.append(nxt)

    def _spread_deny(self, deny: set[int], allow: set[int]) -> None:
        upstream: set[int] = set()
        roots = [i for i, c in enumerate(self.cat) if c in (Category.DENY, Category.UNLISTED, Category.INFER)]
        upstream.update(roots)
        self._dfs(roots, lambda i: self.preds[i],
                  lambda j: j not in upstream and self.cat[j] == Category.CLEAR,
                  lambda j, _: upstream.add(j))

        def visit(j: int, came_from: int) -> None:
            deny.add(j)
            self.step[j] = "deny-spread"
            self.via[j] = came_from

        # A deny op with a bounded output (Sin, Cos) computes in FP32 but seeds no spread: its
        # output in [-1, 1] is as safe in low precision as any other input.
        seeds = sorted(i for i in deny if not self.nodes[i].meta.get("amp.bounded_output"))
        # A deny op the model computes in FP64 (an Exp in double, cast back to FLOAT) has no more a
        # range than an FP32 one: its readers are painted as that output's would be.
        for i in sorted(self.fp64_read):
            if i not in deny and i not in allow and i in upstream:
                deny.add(i)
                self.step[i] = "deny-spread"
                seeds.append(i)
        self._dfs(seeds, lambda i: self.succs[i],
                  lambda j: j not in deny and j not in allow and j in upstream, visit)

    def _add_between_allow(self, allow: set[int], deny: set[int]) -> None:
        downstream: set[int] = set()
        self._dfs(sorted(allow), lambda i: self.succs[i],
                  lambda j: j not in downstream and j not in allow and j not in deny and self.cat[j] in _LOW_OK,
                  lambda j, _: downstream.add(j))

        def visit(j: int, came_from: int) -> None:
            allow.add(j)
            self.step[j] = "between-allow"
            self.via[j] = came_from

        self._dfs(sorted(allow), lambda i: self.preds[i], lambda j: j not in allow and j in downstream, visit)

    def _spread_allow_through_clear(self, allow: set[int], deny: set[int]) -> None:
        def visit(j: int, came_from: int) -> None:
            allow.add(j)
            self.step[j] = "clear-spread"
            self.via[j] = came_from

        self._dfs(sorted(allow), lambda i: self.preds[i] | self.succs[i],
                  lambda j: j not in allow and j not in deny and self.cat[j] == Category.CLEAR
                  and not self._reads_master_weight(j) and not self._moves_into_a_constant_sum(j, allow), visit)

    def _moves_into_a_constant_sum(self, i: int, allow: set[int]) -> bool:
        """Whether clear node ``i`` only moves weights (a schedule table's Gather, its Unsqueeze)
        into a sum with a constant addend that is not low (``1 - alphas_cumprod[t]``), directly or
        through other such clear nodes. Made low for another reader (a low ``a * h``), the table
        was rounded offline before the FP32 sum (0.99915 is 0.99902 in fp16, 1 in bf16: ``1 - a``
        15% off, or 0); FP32, the low reader gets a Cast of the few values moved."""
        from .optimal import _ABSORBING, _moves_weights

        node = self.nodes[i]
        if not all(_moves_weights(node.outputs[k], 0) for k in self.group_outs[i]):
            return False
        stack, seen = [i], {i}
        while stack:
            for j in self.succs[stack.pop()]:
                if j in seen or j in allow:
                    continue
                seen.add(j)
                reader = self.nodes[j]
                if reader.op_type in _ABSORBING and adds_a_constant(reader, self.group_ins[j]):
                    return True
                if self.cat[j] == Category.CLEAR:
                    stack.append(j)
        return False

    def _reads_master_weight(self, i: int) -> bool:
        """Training keeps the weights FP32 (master weights, cast at use on every step). A clear op
        reading one (an embedding's gather, a weight's transpose) then stays FP32 instead of
        following a low neighbour, as under torch.autocast: a cast after it moves no more bytes (after
        a gather, the rows read, not the whole table), and the weight's gradient flows through the
        op's own backward (a sparse embedding gradient cannot pass a cast)."""
        if not self.ctx.options.training:
            return False
        node = self.nodes[i]
        return any(node.inputs[k] is not None and node.inputs[k].is_initializer for k in self.group_ins[i])

    def _compare_in_operand_type(self, allow: set[int], deny: set[int]) -> None:
        """A comparison (an infer or clear op whose painted outputs are all bool: Equal, Less,
        IsInf) whose float operands are all made low, the rest constants, compares in the low type.
        Left FP32, it compared the rounded value with the exact constant: a masked max filled with
        -1e4 (-9984 in bfloat16) never equalled -1e4, and the guard for fully masked rows let the
        fill through. torch.autocast compares in the operand's type, as this does."""
        for i, node in enumerate(self.nodes):
            if i in allow or i in deny or self.cat[i] not in _LOW_OK or not self.group_ins[i] \
                    or any(v is not None and v.dtype != DType.BOOL for v in node.outputs):
                continue
            producers = [self._group_producer(node.inputs[k]) for k in self.group_ins[i]
                         if node.inputs[k] is not None and not node.inputs[k].is_constant]
            if producers and all(j is not None and j in allow for j in producers):
                allow.add(i)
                self.step[i] = "compare-low"
                self.via[i] = producers[0]

    def _remove_round_trips(self, allow: set[int]) -> None:
        """Keep FP32 every non-allow node that reads an FP32 tensor and feeds an FP32 consumer, and
        every clear op (data movement: Transpose, Reshape, Identity...) on a low path of clear ops
        from one that reads FP32 to one that feeds FP32 (Transpose → Reshape between two FP32
        ops): either would carry an FP32 value through the low type and back unchanged (an
        overflow above 65504) with no low compute to gain. (A longer path through an infer op
        painted between allow ops is not such a trip: that op mixes in an allow op's low result.)
        A node kept FP32 makes its low neighbours read or feed FP32 in turn: this runs to a fixed
        point."""
        while True:
            between = {i for i in allow if self.cat[i] != Category.ALLOW}
            reads = {i for i in between if self.fp32_source[i] or any(p not in allow for p in self.preds[i])}
            feeds = {i for i in between if self.fp32_sink[i]
                     or any(s not in allow for s in (*self.succs[i], *self.trip_succs[i]))}
            trips = reads & feeds
            clear = {i for i in between if self.cat[i] == Category.CLEAR}
            from_fp32, to_fp32 = reads & clear, feeds & clear
            self._dfs(sorted(from_fp32), lambda i: self.succs[i], lambda j: j in clear and j not in from_fp32,
                      lambda j, _: from_fp32.add(j))
            self._dfs(sorted(to_fp32), lambda i: self.preds[i], lambda j: j in clear and j not in to_fp32,
                      lambda j, _: to_fp32.add(j))
            trips |= from_fp32 & to_fp32
            if not trips:
                self._retrace(allow)
                return
            for i in trips:
                allow.discard(i)
                self.step[i] = "safety"
                self.via.pop(i, None)

    def _retrace(self, allow: set[int]) -> None:
        """A node painted low through a neighbour the round-trip check then kept FP32 keeps its
        precision, but its reason must not cite that neighbour as low: it names another low
        neighbour it still joins, else the low producer it reads, and the neighbour that left."""
        for i in sorted(allow):
            via = self.via.get(i)
            if via is None or via in allow:
                continue
            near = self.succs[i] if self.step[i] == "between-allow" else self.preds[i] | self.succs[i]
            joined = sorted(j for j in near if j in allow)
            if joined:
                self.via[i] = joined[0]
                continue
            if self.step[i] != "between-allow":  # (a clear op with no low neighbour is a round trip)
                continue
            producers = sorted(j for j in self.preds[i] if j in allow)
            self.left[i] = via
            if producers:
                self.via[i] = producers[0]
            else:
                self.via.pop(i)

    # -- recording ---------------------------------------------------------------------------------
    def _finish(self, allow: set[int], deny: set[int], *, none_allowed: bool) -> None:
        low_name = self.ctx.low.short
        for i, node in enumerate(self.nodes):
            meta = node.meta
            low = i in allow
            meta["amp.precision"] = Precision.LOW if low else Precision.FP32
            step = self.step.get(i, "classify")
            meta["amp.step"] = step
            via = self.via.get(i)
            meta["amp.via"] = node_label(self.nodes[via]) if via is not None else self.fp64_read.get(i) \
                if step == "deny-spread" else None
            meta["amp.deny_painted"] = i in deny
            if none_allowed and self.cat[i] in _LOW_OK:
                # what it says where the scope changes after all (restate_changed: a low value read
                # from around it, an If the optimal placement made low): as in a painted scope.
                # (A deny op, a pin, keeps FP32 for its own reason, whatever the scope holds.)
                restated = f"{self.cat[i].value} op not between {low_name} ops: stays FP32 ({meta['amp.reason']})"
                meta["amp.reason"] = f"no allow op in this scope, so nothing changes ({meta['amp.reason']})"
                meta["amp.restated"] = (meta["amp.reason"], restated)
            elif step == "deny-spread" and via is None:
                meta["amp.reason"] = (f"reads {meta['amp.via']}: a deny op's output, though computed in FP64, so "
                                      f"painted FP32 as it lies on a path from it to a deny or infer op")
            elif step == "deny-spread":
                meta["amp.reason"] = (f"FP32 paint from {meta['amp.via']}: it lies on a path from a deny op to a "
                                      f"deny or infer op")
            elif step == "between-allow" and i in self.left:
                after = f" after {meta['amp.via']}" if meta["amp.via"] else ""
                meta["amp.reason"] = (f"between {low_name} ops when painted; {node_label(self.nodes[self.left[i]])} on "
                                      f"its way to them was then kept FP32 (round-trip check), so it stays "
                                      f"{low_name}{after} and the Cast to FP32 follows it")
            elif step == "between-allow":
                meta["amp.reason"] = f"between {low_name} ops (upstream of {meta['amp.via']}), so it joins them"
            elif step == "compare-low":
                meta["amp.reason"] = (f"compares {low_name} values ({meta['amp.via']}) with constants: in "
                                      f"{low_name}, as those values were made, so a fill value it tests for "
                                      f"matches (torch.autocast compares in the operand's type)")
            elif step == "clear-spread":
                meta["amp.reason"] = f"moves data next to {low_name} op {meta['amp.via']}, so it follows it"
            elif step == "safety":
                meta["amp.reason"] = (f"kept FP32: in {low_name} it would lie on a path from an FP32 producer to an "
                                      f"FP32 consumer with no {low_name} compute on it (an FP32→{low_name}→FP32 "
                                      f"round trip {round_trip_harm(self.ctx.low)})")
            elif not low and self.cat[i] in _LOW_OK:
                meta["amp.reason"] = (f"{self.cat[i].value} op not between {low_name} ops: stays FP32 "
                                      f"({meta['amp.reason']})")


def _fp64_deny_source(value: Value, ctx: Context) -> str | None:
    """The label of a deny op (an Exp, a reduction, an op no rule names) that computed ``value``
    in double, ``value`` being a ``Cast(to=FLOAT)`` of that double: found walking up the double
    values it is made from (through copies and the ops the rules would let run low). None for a
    double graph input or constant, a float copied to double and back, double arithmetic of those."""
    cast = value.producer
    if cast is None or cast.op_type != "Cast" or cast.domain not in ("", "ai.onnx") or not cast.inputs:
        return None
    stack, seen = [cast.inputs[0]], set()
    while stack and len(seen) < 64:
        source = stack.pop()
        if source is None or id(source) in seen or source.dtype != DType.DOUBLE or source.producer is None:
            continue
        seen.add(id(source))
        node = source.producer
        if node.op_type not in ("Cast", "Identity", "Constant") or node.domain not in ("", "ai.onnx"):
            entry = ctx.rules.lookup(node.op_type, node.domain, node.opset)
            if entry is None or (entry.category == Category.DENY and not entry.bounded_output):
                return node_label(node)
        stack.extend(node.inputs)
    return None


def restate_changed(scope: Graph) -> None:
    """A scope painted with no allow op said of each node "nothing changes"; where the rewrite
    changes it after all (``islands.changed_scopes``: a Cast enters it), each node says instead why
    it stays FP32, as in a painted scope (the cut's figures, appended since, stay)."""
    for node in scope.nodes:
        stale, restated = node.meta.pop("amp.restated", (None, None))
        if stale is not None:
            node.meta["amp.reason"] = node.meta.get("amp.reason", "").replace(stale, restated, 1)


def through_no_op_casts(value: Value) -> Value:
    """The value a chain of no-op ``Cast(to=FLOAT)`` of an FP32 value passes on (``value`` if it is
    no such Cast's output). Such a Cast changes nothing in the FP32 model (HF's GPT-J upcasts its
    query ``q.to(float32)`` before QK^T): painting looks through it, as cast placement does, where it
    is retargeted or removed. Seen as a wall, it kept the ops before it FP32 with Casts around
    them, "not between fp16 ops" though they were."""
    cast = value.producer
    while (cast is not None and cast.op_type == "Cast" and cast.domain == "" and cast.inputs
           and cast.inputs[0] is not None and cast.inputs[0].dtype == DType.FLOAT
           and cast.attrs.get("to") == int(DType.FLOAT) and cast.graph is value.graph):
        value = cast.inputs[0]
        cast = value.producer
    return value
