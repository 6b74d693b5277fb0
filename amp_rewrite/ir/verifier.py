"""IR invariants, checked after every pass in tests and with --debug.

use-def symmetry, topological order (outer scopes visible), unique node names per graph and value names per model,
and dtype agreement inside every type-constraint group. A failure prints the nodes around it.
"""

from __future__ import annotations

from ..errors import VerificationError
from .core import Graph, Node, Value
from .printer import format_node


def verify(graph: Graph) -> None:
    """Raise VerificationError with context on the first broken invariant."""
    names: dict[str, object] = {}
    _verify_scope(graph, visible=set(), value_names=names, node_names=set())


def _fail(graph: Graph, node: Node | None, problem: str) -> None:
    context = ""
    if node is not None and node in graph.nodes:
        i = graph.nodes.index(node)
        lo, hi = max(0, i - 5), min(len(graph.nodes), i + 6)
        marks = [("> " if j == i else "  ") + format_node(graph.nodes[j]) for j in range(lo, hi)]
        context = "\n" + "\n".join(marks)
    raise VerificationError(f"IR verification failed in graph {graph.name or '<main>'!r}: {problem}{context}")


def _verify_scope(graph: Graph, visible: set[int], value_names: dict, node_names: set[str]) -> None:
    defined = set(visible)
    for v in list(graph.inputs) + list(graph.initializers.values()):
        defined.add(id(v))
        _unique_value(graph, None, v, value_names)
    for node in graph.nodes:
        if node.graph is not graph:
            _fail(graph, node, f"{node!r} does not point back to its graph")
        if node.name:
            if node.name in node_names:
                _fail(graph, node, f"duplicate node name {node.name!r}")
            node_names.add(node.name)
        for index, value in enumerate(node.inputs):
            if value is None:
                continue
            if value._uses.get((id(node), index), (None,))[0] is not node:
                _fail(graph, node, f"input {index} ({value.name!r}) does not list this use")
            if id(value) not in defined:
                _fail(graph, node, f"input {index} ({value.name!r}) is used before it is defined")
        for index, out in enumerate(node.outputs):
            if out.producer is not node or out.producer_index != index:
                _fail(graph, node, f"output {index} ({out.name!r}) does not point back to its producer")
            for user, k in out._uses.values():
                if user.inputs[k] is not out:
                    _fail(graph, node, f"output {out.name!r} lists a stale use by {user!r}")
            _unique_value(graph, node, out, value_names)
        _check_groups(graph, node)
        for sub in node.all_subgraphs():
            # node names are unique per graph (what onnxruntime checks); value names across the model
            _verify_scope(sub, defined, value_names, set())
        defined.update(id(o) for o in node.outputs)
    for out in graph.outputs:
        if id(out) not in defined:
            _fail(graph, None, f"graph output {out.name!r} is not defined in this scope")


def _unique_value(graph: Graph, node: Node | None, value: Value, names: dict) -> None:
    if not value.name:
        return
    other = names.get(value.name)
    if other is not None and other is not value:
        _fail(graph, node, f"two values are named {value.name!r}")
    names[value.name] = value


def _check_groups(graph: Graph, node: Node) -> None:
    if group_conflict(node) is not None:
        _fail_mixed_group(graph, node)


def group_conflict(node: Node) -> tuple[str, Value, Value] | None:
    """The first type-constraint group of ``node`` bound to two dtypes: (group, its first typed
    value, a value of another type); None if every group has one type."""
    bound: dict[str, Value] = {}  # group -> its first typed value
    for groups, values in ((node.input_groups, node.inputs), (node.output_groups, node.outputs)):
        for group, value in zip(groups, values):
            if group is None or group == "?" or value is None or value.dtype is None:
                continue
            first = bound.setdefault(group, value)
            if first.dtype != value.dtype:
                return group, first, value
    return None


def _fail_mixed_group(graph: Graph, node: Node) -> None:
    """Name the first type group bound to several dtypes, with all of them."""
    groups: dict[str, set] = {}
    slots = list(zip(node.input_groups, node.inputs)) + list(zip(node.output_groups, node.outputs))
    for group, value in slots:
        if group is None or group == "?" or value is None or value.dtype is None:
            continue
        groups.setdefault(group, set()).add(value.dtype)
    for group, dtypes in groups.items():
        if len(dtypes) > 1:
            kinds = ", ".join(sorted(d.short for d in dtypes))
            _fail(graph, node, f"type group {group} of {node.qualified_op} is bound to different types ({kinds})")
