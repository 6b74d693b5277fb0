"""Run a BF16 model's numerics on onnxruntime's CPU provider, which has Cast kernels for bfloat16
but no bfloat16 MatMul/Gemm/Add/... kernels (session creation fails with NOT_IMPLEMENTED).

``emulate_bf16(model)`` returns an FP32 model that computes what the BF16 model computes on a GPU
whose kernels read and write bfloat16 and compute in FP32 internally (cuBLAS GEMMs with FP32
accumulation, elementwise kernels that convert on load and store):

- bfloat16 initializers and Constant tensors become their exact FP32 values;
- every tensor the BF16 model holds in bfloat16 is rounded to bfloat16 where it is produced
  (``Cast(to=BFLOAT16)`` then ``Cast(to=FLOAT)``, both of which the CPU provider runs), then carried
  as FP32: so every rounding the BF16 model does happens, and no other;
- ``Cast(to=BFLOAT16)`` keeps its rounding and gains the ``Cast(to=FLOAT)`` after it; a
  ``Cast(to=FLOAT)`` of a former bfloat16 tensor becomes an Identity; ConstantOfShape values follow.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from tools.bench_metrics import _graphs

BF16 = TensorProto.BFLOAT16
FLOAT = TensorProto.FLOAT


def emulate_bf16(model: onnx.ModelProto) -> onnx.ModelProto:
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    types: dict[str, int] = {}
    for g in _graphs(inferred.graph):  # subgraph bodies too (names are unique model-wide)
        for vi in list(g.input) + list(g.output) + list(g.value_info):
            if vi.type.HasField("tensor_type"):
                types[vi.name] = vi.type.tensor_type.elem_type
        for t in g.initializer:
            types[t.name] = t.data_type
    out = onnx.ModelProto()
    out.CopyFrom(model)
    _rewrite_graph(out.graph, types)
    return out



def _to_float_tensor(t: TensorProto) -> TensorProto:
    if t.data_type != BF16:
        return t
    return numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float32), t.name)


def _rewrite_graph(graph: onnx.GraphProto, types: dict[str, int]) -> None:
    for i, t in enumerate(graph.initializer):
        if t.data_type == BF16:
            graph.initializer[i].CopyFrom(_to_float_tensor(t))
    for vi in list(graph.input) + list(graph.output) + list(graph.value_info):
        if vi.type.tensor_type.elem_type == BF16:
            vi.type.tensor_type.elem_type = FLOAT
    new_nodes = []
    taken = {n.name for n in graph.node} | {o for n in graph.node for o in n.output}
    counter = [0]

    def fresh(base: str) -> str:
        while True:
            counter[0] += 1
            name = f"{base}/bf16emu{counter[0]}"
            if name not in taken:
                taken.add(name)
                return name

    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                _rewrite_graph(attr.g, types)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for sub in attr.graphs:
                    _rewrite_graph(sub, types)
            elif attr.type == onnx.AttributeProto.TENSOR and attr.t.data_type == BF16:
                attr.t.CopyFrom(_to_float_tensor(attr.t))
        if node.op_type == "Cast" and node.domain in ("", "ai.onnx"):
            to = next(a for a in node.attribute if a.name == "to")
            if to.i == FLOAT and types.get(node.input[0]) == BF16:
                new_nodes.append(helper.make_node("Identity", [node.input[0]], list(node.output), name=node.name))
                continue
        bf16_outputs = [o for o in node.output if o and types.get(o) == BF16]
        if not bf16_outputs:
            new_nodes.append(node)
            continue
        renamed = {}
        for o in bf16_outputs:
            renamed[o] = fresh(o)
        copy = onnx.NodeProto()
        copy.CopyFrom(node)
        del copy.output[:]
        copy.output.extend(renamed.get(o, o) for o in node.output)
        if copy.op_type == "Cast" and copy.domain in ("", "ai.onnx"):
            new_nodes.append(copy)  # Cast(to=BFLOAT16): keeps its rounding, then back to FLOAT
            for o in bf16_outputs:
                new_nodes.append(helper.make_node("Cast", [renamed[o]], [o], to=FLOAT, name=fresh("emu_cast")))
            continue
        new_nodes.append(copy)
        for o in bf16_outputs:
            rounded = fresh(o)
            new_nodes.append(helper.make_node("Cast", [renamed[o]], [rounded], to=BF16, name=fresh("emu_round")))
            new_nodes.append(helper.make_node("Cast", [rounded], [o], to=FLOAT, name=fresh("emu_back")))
    del graph.node[:]
    graph.node.extend(new_nodes)
