"""The framework-neutral IR: Graph, Node, Value, DType.

Stdlib only. Frontends build it (keeping a handle to each origin object), passes read and edit
it, emitters patch the origin model from it.

Invariants (checked by ``verifier.verify``):
- a Value knows its producer and the ordered list of ``(node, input_index)`` uses;
- node inputs change only through ``Node.set_input`` (both sides stay in sync);
- each Graph is one scope; a subgraph's nodes may read values of enclosing scopes.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator


class DType(enum.IntEnum):
    """Tensor element types, numbered as ONNX numbers them (a widely shared convention)."""

    UNDEFINED = 0
    FLOAT = 1
    UINT8 = 2
    INT8 = 3
    UINT16 = 4
    INT16 = 5
    INT32 = 6
    INT64 = 7
    STRING = 8
    BOOL = 9
    FLOAT16 = 10
    DOUBLE = 11
    UINT32 = 12
    UINT64 = 13
    COMPLEX64 = 14
    COMPLEX128 = 15
    BFLOAT16 = 16
    FLOAT8E4M3FN = 17
    FLOAT8E4M3FNUZ = 18
    FLOAT8E5M2 = 19
    FLOAT8E5M2FNUZ = 20
    UINT4 = 21
    INT4 = 22
    FLOAT4E2M1 = 23

    @property
    def is_float(self) -> bool:
        return self in _FLOATS

    @property
    def itemsize(self) -> float:
        return _ITEMSIZE.get(self, 4)

    @property
    def short(self) -> str:
        return _SHORT.get(self, self.name.lower())

    @classmethod
    def from_short(cls, text: str) -> "DType":
        for k, v in _SHORT.items():
            if v == text:
                return k
        return cls[text.upper()]


_FLOATS = {DType.FLOAT, DType.FLOAT16, DType.BFLOAT16, DType.DOUBLE}
_ITEMSIZE = {
    DType.FLOAT: 4, DType.FLOAT16: 2, DType.BFLOAT16: 2, DType.DOUBLE: 8, DType.UINT8: 1,
    DType.INT8: 1, DType.UINT16: 2, DType.INT16: 2, DType.INT32: 4, DType.INT64: 8, DType.BOOL: 1,
    DType.UINT32: 4, DType.UINT64: 8, DType.COMPLEX64: 8, DType.COMPLEX128: 16,
    DType.FLOAT8E4M3FN: 1, DType.FLOAT8E4M3FNUZ: 1, DType.FLOAT8E5M2: 1, DType.FLOAT8E5M2FNUZ: 1,
    DType.UINT4: 0.5, DType.INT4: 0.5, DType.FLOAT4E2M1: 0.5,
}
_SHORT = {DType.FLOAT: "fp32", DType.FLOAT16: "fp16", DType.BFLOAT16: "bf16", DType.DOUBLE: "fp64"}

Dim = int | str | None


class Value:
    """A tensor edge: one producer (a node output, a graph input or a constant), many uses."""

    def __init__(
        self,
        name: str,
        dtype: DType | None = None,
        shape: tuple[Dim, ...] | None = None,
        *,
        origin: Any = None,
    ) -> None:
        self.name = name
        self.dtype = dtype
        self.shape = shape
        self.origin = origin
        self.producer: Node | None = None
        self.producer_index: int | None = None
        self.graph: Graph | None = None  # owning scope (set for inputs/initializers/node outputs)
        self.is_graph_input = False
        self.is_initializer = False
        # For initializers and Constant outputs: element count and a min/max summary (filled by the loader).
        self.const_numel: int | None = None
        self.const_stats: dict[str, Any] | None = None
        self.meta: dict[str, Any] = {}
        # (id(node), input index) -> (node, input index): ordered like a list, O(1) add and remove,
        # so values read by thousands of nodes (shared weights, eps constants) stay cheap to edit.
        self._uses: dict[tuple[int, int], tuple[Node, int]] = {}

    # -- uses -----------------------------------------------------------------------------------
    def uses(self) -> list[tuple["Node", int]]:
        """A snapshot: safe to iterate while editing."""
        return list(self._uses.values())

    def has_uses(self) -> bool:
        """Whether any node reads it (without the snapshot ``uses`` copies: a shared weight has
        thousands)."""
        return bool(self._uses)

    def consumers(self) -> list["Node"]:
        seen: dict[int, Node] = {}
        for node, _ in self._uses.values():
            seen.setdefault(id(node), node)
        return list(seen.values())

    @property
    def is_graph_output(self) -> bool:
        return self.graph is not None and self in self.graph.outputs  # (by identity, O(1): OutputList)

    @property
    def data_known(self) -> bool:
        """Its data is in the model: a constant, or an overridable input's initializer (the value it
        holds unless the caller feeds another; ``keep_initializers_as_inputs`` exports write them)."""
        return self.is_constant or (self.is_initializer and bool(self.meta.get("amp.overridable")))

    @property
    def is_constant(self) -> bool:
        """An initializer or the output of a Constant node: convertible offline."""
        # An initializer listed as a graph input counts as a weight when the IR version (< 4) lists
        # them all: converted offline, its declared input type follows (a runtime Cast of every
        # weight would cost more than it saves). From IR 4 on, listing one makes it an overridable
        # input ("amp.overridable"), which keeps its FP32 type like any graph input.
        if self.is_graph_input and self.meta.get("amp.overridable"):
            return False
        return self.is_initializer or (self.producer is not None and self.producer.op_type == "Constant"
                                       and self.producer.domain in ("", "ai.onnx"))

    @property
    def numel(self) -> int | None:
        if self.const_numel is not None:
            return self.const_numel
        if self.shape is None or any(not isinstance(d, int) for d in self.shape):
            return None
        n = 1
        for d in self.shape:
            n *= d
        return n

    def replace_all_uses_with(self, other: "Value", *, include_outputs: bool = True) -> None:
        for node, index in self.uses():
            node.set_input(index, other)
        if include_outputs and self.graph is not None:
            self.graph.outputs.replace(self, other)

    def __repr__(self) -> str:
        dt = self.dtype.short if self.dtype is not None else "?"
        return f"Value({self.name!r}, {dt})"


class Node:
    """One operation. ``slot_groups`` holds, per input and per output, the type-constraint group
    ("T", "T1", ...) or None where the slot has a fixed type; painting works per group."""

    def __init__(
        self,
        op_type: str,
        inputs: Iterable[Value | None] = (),
        num_outputs: int = 1,
        *,
        name: str = "",
        domain: str = "",
        attrs: dict[str, Any] | None = None,
        outputs: Iterable[Value] | None = None,
        origin: Any = None,
    ) -> None:
        self.op_type = op_type
        self.domain = "" if domain == "ai.onnx" else domain
        self.name = name
        self.attrs: dict[str, Any] = dict(attrs or {})
        self.origin = origin
        self.graph: Graph | None = None
        self.opset: int | None = None
        self.subgraphs: dict[str, list[Graph]] = {}
        self.input_groups: list[str | None] = []
        self.output_groups: list[str | None] = []
        self.meta: dict[str, Any] = {}
        # Tuples, so that reading them (the passes' most frequent operation) hands them out as they are.
        self._inputs: tuple[Value | None, ...] = tuple(inputs)
        for index, value in enumerate(self._inputs):
            if value is not None:
                value._uses[(id(self), index)] = (self, index)
        self._outputs: tuple[Value, ...] = (tuple(outputs) if outputs is not None
                                            else tuple(Value("") for _ in range(num_outputs)))
        for index, value in enumerate(self._outputs):
            value.producer = self
            value.producer_index = index

    @property
    def inputs(self) -> tuple[Value | None, ...]:
        return self._inputs

    @property
    def outputs(self) -> tuple[Value, ...]:
        return self._outputs

    @property
    def qualified_op(self) -> str:
        return f"{self.domain}::{self.op_type}" if self.domain else self.op_type

    def set_input(self, index: int, value: Value | None) -> None:
        """The one way to change an input: keeps the old and new value's use lists in sync."""
        old = self._inputs[index]
        if old is value:
            return
        if old is not None:
            del old._uses[(id(self), index)]
        self._inputs = self._inputs[:index] + (value,) + self._inputs[index + 1:]
        if value is not None:
            value._uses[(id(self), index)] = (self, index)

    def detach(self) -> None:
        for index in range(len(self._inputs)):
            self.set_input(index, None)

    def all_subgraphs(self) -> list["Graph"]:
        if not self.subgraphs:
            return []  # the common case, on every walk and sort: skip building the comprehension
        return [g for graphs in self.subgraphs.values() for g in graphs]

    def __repr__(self) -> str:
        return f"Node({self.qualified_op}, {self.name!r})"


class OutputList(list):
    """A graph's outputs: a list whose membership test (by identity) and :meth:`replace` take O(1),
    from a count and the positions of each value. Each was a scan of the list: 16k graph outputs,
    each given a Cast, took 30 s (quadratic)."""

    def __init__(self, items: Iterable["Value"] = ()) -> None:
        super().__init__(items)
        self._recount()

    def _recount(self) -> None:
        self._where: dict[int, list[int]] = {}
        for k, v in enumerate(self):
            self._where.setdefault(id(v), []).append(k)

    def __contains__(self, value: object) -> bool:
        return id(value) in self._where

    def replace(self, value: "Value", by: "Value") -> None:
        """Every position of ``value`` now holds ``by``."""
        for k in self._where.pop(id(value), []):
            list.__setitem__(self, k, by)
            self._where.setdefault(id(by), []).append(k)

    def append(self, value: "Value") -> None:
        super().append(value)
        self._where.setdefault(id(value), []).append(len(self) - 1)

    def extend(self, values: Iterable["Value"]) -> None:
        for value in values:
            self.append(value)

    def __setitem__(self, index, value) -> None:
        super().__setitem__(index, value)
        self._recount()

    def __delitem__(self, index) -> None:
        super().__delitem__(index)
        self._recount()

    def __iadd__(self, values):
        self.extend(values)
        return self

    def _changed(name: str):  # (the other in-place list methods: recount after them)
        def method(self, *args, **kwargs):
            result = getattr(list, name)(self, *args, **kwargs)
            self._recount()
            return result

        return method

    insert, remove, pop = _changed("insert"), _changed("remove"), _changed("pop")
    clear, sort, reverse = _changed("clear"), _changed("sort"), _changed("reverse")
    del _changed


class Graph:
    """One scope. ``nodes`` is kept in topological order by the passes (``sort`` restores it)."""

    @property
    def outputs(self) -> OutputList:
        return self._outputs

    @outputs.setter
    def outputs(self, values: Iterable["Value"]) -> None:
        self._outputs = OutputList(values)

    def __init__(self, name: str = "", *, origin: Any = None) -> None:
        self.name = name
        self.origin = origin
        self._nodes: list[Node] = []
        # insert_after() records here (anchor id, or None for the top → nodes, oldest first) and
        # ``nodes`` places them on its next read: one O(n) pass instead of an O(n) list.index per insert.
        self._pending: dict[int | None, list[Node]] = {}
        self.inputs: list[Value] = []
        self._outputs = OutputList()
        self.initializers: dict[str, Value] = {}
        self.parent: Node | None = None  # the node whose attribute holds this subgraph
        self.opsets: dict[str, int] = {}
        self.meta: dict[str, Any] = {}

    @property
    def nodes(self) -> list[Node]:
        if self._pending:
            self._place_pending()
        return self._nodes

    @nodes.setter
    def nodes(self, nodes: list[Node]) -> None:
        self._place_pending()
        self._nodes = nodes

    def _place_pending(self) -> None:
        """Put the nodes insert_after() recorded where list.insert would have put them: right after
        their anchor, the latest insert first."""
        pending, self._pending = self._pending, {}
        if not pending:
            return
        placed: list[Node] = []

        def emit(node: Node) -> None:
            stack = [node]
            while stack:
                current = stack.pop()
                placed.append(current)
                stack.extend(pending.pop(id(current), ()))  # oldest pushed first, so latest comes out first

        for node in reversed(pending.pop(None, ())):
            emit(node)
        for node in self._nodes:
            emit(node)
        self._nodes = placed

    # -- construction -----------------------------------------------------------------------------
    def add_input(self, value: Value) -> Value:
        value.graph = self
        value.is_graph_input = True
        self.inputs.append(value)
        return value

    def add_initializer(self, value: Value) -> Value:
        value.graph = self
        value.is_initializer = True
        self.initializers[value.name] = value
        return value

    def _adopt(self, node: Node) -> None:
        node.graph = self
        for out in node.outputs:
            out.graph = self
        for sub in node.all_subgraphs():
            sub.parent = node

    def append(self, node: Node) -> Node:
        self._adopt(node)
        self.nodes.append(node)
        return node

    def insert_after(self, anchor: Node | None, node: Node) -> Node:
        """Insert after ``anchor``; ``None`` means at the start of the scope."""
        if anchor is not None and anchor.graph is not self:
            raise ValueError(f"cannot insert after {anchor!r}: it is not a node of this graph")
        self._adopt(node)
        self._pending.setdefault(None if anchor is None else id(anchor), []).append(node)
        return node

    def remove(self, node: Node) -> None:
        for out in node.outputs:
            if out._uses:
                raise ValueError(f"cannot remove {node!r}: output {out.name!r} still has uses")
        node.detach()
        self.nodes.remove(node)
        node.graph = None

    # -- traversal --------------------------------------------------------------------------------
    def walk(self) -> Iterator[Node]:
        """Every node of this scope and of nested subgraphs, parents before children."""
        for node in list(self.nodes):
            yield node
            if node.subgraphs:  # (rare: checked before the call, on graphs of 100k nodes)
                for sub in node.all_subgraphs():
                    yield from sub.walk()

    def scopes(self) -> Iterator["Graph"]:
        yield self
        for node in self.nodes:
            if node.subgraphs:
                for sub in node.all_subgraphs():
                    yield from sub.scopes()

    def root(self) -> "Graph":
        g = self
        while g.parent is not None and g.parent.graph is not None:
            g = g.parent.graph
        return g

    def is_within(self, other: "Graph") -> bool:
        """True if this scope is ``other`` or nested inside it."""
        g: Graph | None = self
        while g is not None:
            if g is other:
                return True
            g = g.parent.graph if g.parent is not None else None
        return False

    def sort(self) -> None:
        """Stable topological sort of this scope (original order breaks ties)."""
        members = {id(n) for n in self.nodes}
        # Already in topological order (the usual case: casts go right after their producer)? Then
        # the lexicographic sort by position would return this very order: skip building it.
        if not self._in_order(members):
            import networkx as nx

            order = {id(n): i for i, n in enumerate(self.nodes)}
            by_id = {id(n): n for n in self.nodes}
            dg = nx.DiGraph()
            dg.add_nodes_from(order)
            dg.add_edges_from((id(dep), id(node)) for node in self.nodes for dep in self._dependencies(node, members))
            self.nodes = [by_id[i] for i in nx.lexicographical_topological_sort(dg, key=order.get)]
        for node in self.nodes:
            if node.subgraphs:
                for sub in node.all_subgraphs():
                    sub.sort()

    def _in_order(self, members: set[int]) -> bool:
        placed: set[int] = set()
        for node in self.nodes:
            for dep in self._dependencies(node, members):
                if id(dep) not in placed:
                    return False
            placed.add(id(node))
        return True

    def _dependencies(self, node: Node, members: set[int]) -> Iterator[Node]:
        """The nodes of this scope (``members``: their ids) that ``node`` must follow: the producers
        of what it reads, and the nodes whose nested scopes produce what it reads."""
        for value in _reads(node):
            p = value.producer
            if p is None or p is node:
                continue
            if id(p) in members:
                yield p
            elif p.graph is not self:
                # produced in an enclosing scope or by a node inside a nested scope of ours
                anc = _ancestor_in(p, self)
                if anc is not None and anc is not node:
                    yield anc


def _reads(node: Node) -> list[Value]:
    """Values a node reads: its inputs plus outer-scope values read inside its subgraphs."""
    vals = [v for v in node.inputs if v is not None]
    for sub in node.all_subgraphs():
        for inner in sub.walk():
            for v in inner.inputs:
                if v is not None and v.graph is not None and not v.graph.is_within(sub):
                    vals.append(v)
    return vals


def _ancestor_in(node: Node, scope: Graph) -> Node | None:
    """The node of ``scope`` that (transitively) contains ``node``, if any."""
    n: Node | None = node
    while n is not None and n.graph is not None and n.graph is not scope:
        n = n.graph.parent
    return n if n is not None and n.graph is scope else None


@dataclass
class Model:
    """A whole model: the main graph plus what the frontend needs to round-trip it."""

    graph: Graph
    frontend: str  # "onnx" | "torch"
    opsets: dict[str, int] = field(default_factory=dict)
    origin: Any = None
    meta: dict[str, Any] = field(default_factory=dict)
