"""Deterministic text form of the IR, for golden tests and --debug output."""

from __future__ import annotations

from .core import Graph, Node, Value


def _v(value: Value | None) -> str:
    if value is None:
        return "_"
    return f"%{value.name}"


def _type(value: Value) -> str:
    dt = value.dtype.short if value.dtype is not None else "?"
    if value.shape is None:
        return dt
    return f"{dt}[{','.join('?' if d is None else str(d) for d in value.shape)}]"


def format_node(node: Node) -> str:
    outs = ", ".join(f"{_v(o)}: {_type(o)}" for o in node.outputs)
    ins = ", ".join(_v(i) for i in node.inputs)
    attrs = "".join(f" {k}={v}" for k, v in sorted(node.attrs.items()))
    prec = node.meta.get("amp.precision")
    tag = f"  # {prec}" if prec else ""
    return f"{outs} = {node.qualified_op}({ins}){attrs}{tag}"


def format_graph(graph: Graph, indent: int = 0) -> str:
    pad = "  " * indent
    lines = [f"{pad}graph {graph.name or '<main>'} ("]
    lines += [f"{pad}  in {_v(v)}: {_type(v)}" for v in graph.inputs]
    lines += [f"{pad}  init {_v(v)}: {_type(v)}" for v in graph.initializers.values() if not v.is_graph_input]
    lines.append(f"{pad}) {{")
    for node in graph.nodes:
        lines.append(f"{pad}  {format_node(node)}")
        for key, subs in node.subgraphs.items():
            for sub in subs:
                lines.append(f"{pad}    {key}:")
                lines.append(format_graph(sub, indent + 3))
    lines.append(f"{pad}  return {', '.join(_v(v) for v in graph.outputs)}")
    lines.append(f"{pad}}}")
    return "\n".join(lines)
