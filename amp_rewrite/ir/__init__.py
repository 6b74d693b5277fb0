"""Framework-neutral IR (stdlib + networkx only)."""

from .core import DType, Graph, Model, Node, Value
from .printer import format_graph
from .verifier import verify

__all__ = ["DType", "Graph", "Model", "Node", "Value", "format_graph", "verify", "to_networkx"]


def to_networkx(graph: Graph, *, recursive: bool = False):
    """A networkx view (DiGraph over nodes, edges labelled with the value): for algorithms, not edits."""
    import networkx as nx

    dg = nx.MultiDiGraph()
    nodes = list(graph.walk()) if recursive else list(graph.nodes)
    for node in nodes:
        dg.add_node(node)
    for node in nodes:
        for out in node.outputs:
            for consumer, index in out.uses():
                if consumer in dg:
                    dg.add_edge(node, consumer, value=out, index=index)
    return dg
