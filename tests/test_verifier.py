"""The IR verifier (amp_rewrite.ir.verify), run after every pass with --debug / verify_each and once
before emit, on small hand-built graphs with one broken invariant each."""

from __future__ import annotations

import pytest

from amp_rewrite.errors import VerificationError
from amp_rewrite.ir import DType, Graph, Node, Value, verify


def _node(op_type: str, inputs: list[Value], output: str, name: str) -> Node:
    """A node whose inputs and output all share the type group T (as MatMul's and Add's do)."""
    node = Node(op_type, inputs, name=name, outputs=[Value(output, DType.FLOAT, (2, 8))])
    node.input_groups = ["T"] * len(inputs)
    node.output_groups = ["T"]
    return node


def _graph() -> Graph:
    """h = MatMul(x, w1); a = Add(h, x); y = MatMul(a, w2), all FP32."""
    graph = Graph("g")
    x = graph.add_input(Value("x", DType.FLOAT, (2, 8)))
    w1 = graph.add_initializer(Value("w1", DType.FLOAT, (8, 8)))
    w2 = graph.add_initializer(Value("w2", DType.FLOAT, (8, 8)))
    h = graph.append(_node("MatMul", [x, w1], "h", "mm1")).outputs[0]
    a = graph.append(_node("Add", [h, x], "a", "add")).outputs[0]
    y = graph.append(_node("MatMul", [a, w2], "y", "mm2")).outputs[0]
    graph.outputs = [y]
    return graph


def _refused(graph: Graph) -> str:
    with pytest.raises(VerificationError) as caught:
        verify(graph)
    return str(caught.value)


def test_a_well_formed_graph_verifies():
    verify(_graph())


def test_two_nodes_with_one_name_are_refused():
    graph = _graph()
    graph.nodes[1].name = "mm1"
    assert "duplicate node name 'mm1'" in _refused(graph)


def test_a_node_placed_before_the_producer_of_its_input_is_refused():
    graph = _graph()
    graph.nodes = [graph.nodes[1], graph.nodes[0], graph.nodes[2]]
    assert "input 0 ('h') is used before it is defined" in _refused(graph)


def test_a_type_group_bound_to_two_dtypes_is_refused():
    """Add's output typed FP16 while its inputs (the same group T) are FP32."""
    graph = _graph()
    graph.nodes[1].outputs[0].dtype = DType.FLOAT16
    message = _refused(graph)
    assert "type group T of Add is bound to different types" in message
    assert "fp16" in message and "fp32" in message


def test_a_graph_output_whose_producer_is_not_in_the_graph_is_refused():
    graph = _graph()
    graph.remove(graph.nodes[2])
    assert "graph output 'y' is not defined in this scope" in _refused(graph)


def test_two_values_with_one_name_are_refused():
    graph = _graph()
    graph.nodes[1].outputs[0].name = "h"
    assert "two values are named 'h'" in _refused(graph)


def test_a_node_name_is_unique_per_graph_so_a_branch_may_reuse_an_outer_one():
    """Node names are checked per graph (as onnxruntime does), value names across the model: a
    branch node named like an outer node verifies, a branch value named like an outer one does not."""
    graph = _graph()
    cond = graph.add_input(Value("cond", DType.BOOL, ()))
    a = graph.nodes[1].outputs[0]
    branches = []
    for out_name in ("t", "e"):
        branch = Graph(out_name)
        branch.append(_node("Relu", [a], out_name, "mm1"))
        branch.outputs = [branch.nodes[0].outputs[0]]
        branches.append(branch)
    node = Node("If", [cond], name="if", outputs=[Value("r", DType.FLOAT, (2, 8))])
    node.subgraphs = {"then_branch": [branches[0]], "else_branch": [branches[1]]}
    graph.append(node)
    graph.outputs = list(graph.outputs) + [node.outputs[0]]
    verify(graph)
    branches[1].nodes[0].outputs[0].name = "h"
    assert "two values are named 'h'" in _refused(graph)
