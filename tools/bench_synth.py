"""Generated models for the benchmark's scaling rows: a transformer-like chain of any node count,
and a model over 2 GB stored as external data (written tensor by tensor, never held in memory).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

HIDDEN = 16
# One block, 16 nodes: two GEMMs with bias and ReLU, a residual Add, and a decomposed LayerNorm
# (ReduceMean, Sub, Mul, ReduceMean, Add, Sqrt, Div, Mul, Add): allow, infer, clear and deny ops,
# one FP32 island per block, like a pre-fusion transformer export.
BLOCK_NODES = 16


def synthetic_chain(num_nodes: int, *, seed: int = 0, opset: int = 17) -> tuple[onnx.ModelProto, dict]:
    """A model of about ``num_nodes`` nodes (a multiple of 16) and its feeds."""
    rng = np.random.default_rng(seed)
    blocks = max(1, num_nodes // BLOCK_NODES)
    inits = [
        numpy_helper.from_array((rng.standard_normal((HIDDEN, HIDDEN)) / np.sqrt(HIDDEN)).astype(np.float32), "w1"),
        numpy_helper.from_array((rng.standard_normal((HIDDEN, HIDDEN)) / np.sqrt(HIDDEN)).astype(np.float32), "w2"),
        numpy_helper.from_array(rng.standard_normal(HIDDEN).astype(np.float32) * 0.1, "b1"),
        numpy_helper.from_array(rng.standard_normal(HIDDEN).astype(np.float32) * 0.1, "b2"),
        numpy_helper.from_array(np.ones(HIDDEN, np.float32), "gamma"),
        numpy_helper.from_array(np.zeros(HIDDEN, np.float32), "beta"),
        numpy_helper.from_array(np.array(1e-5, np.float32), "eps"),
    ]
    nodes = []
    h = "x"
    for i in range(blocks):
        p = f"b{i}_"

        def node(op, ins, **attrs):
            out = p + op.lower() + str(len(nodes))
            nodes.append(helper.make_node(op, ins, [out], name=out, **attrs))
            return out

        a = node("MatMul", [h, "w1"])
        a = node("Add", [a, "b1"])
        a = node("Relu", [a])
        a = node("MatMul", [a, "w2"])
        a = node("Add", [a, "b2"])
        r = node("Add", [a, h])
        mu = node("ReduceMean", [r], axes=[-1])
        d = node("Sub", [r, mu])
        sq = node("Mul", [d, d])
        var = node("ReduceMean", [sq], axes=[-1])
        ve = node("Add", [var, "eps"])
        sd = node("Sqrt", [ve])
        n = node("Div", [d, sd])
        n = node("Mul", [n, "gamma"])
        h = node("Add", [n, "beta"])
        node("Identity", [h])  # a clear op, as exporters leave them
    nodes[-1].output[0] = "y"
    graph = helper.make_graph(nodes, f"chain{num_nodes}",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", HIDDEN])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", HIDDEN])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)
    onnx.checker.check_model(model)
    feeds = {"x": rng.standard_normal((2, HIDDEN)).astype(np.float32)}
    return model, feeds


def write_large_model(folder: str | os.PathLike, *, total_bytes: int = (2 << 30) + (256 << 20),
                      dim: int = 8192, seed: int = 0) -> Path:
    """Write a model over 2 GB (default 2.25 GiB of FP32 weights) as ``folder/large.onnx`` plus
    ``large.onnx.data``: a chain of MatMul(dim×dim) → Add → Relu blocks with a LayerNorm-style
    reduction at the end. Weights are streamed to the data file one tensor at a time (pseudo-random
    values drawn in chunks), so writing it needs about one tensor's worth of memory."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "large.onnx"
    data_name = "large.onnx.data"
    per_weight = dim * dim * 4
    count = max(1, -(-total_bytes // per_weight))
    rng = np.random.default_rng(seed)
    inits, nodes = [], []
    offset = 0
    h = "x"
    with open(folder / data_name, "wb") as data:
        for i in range(count):
            name = f"w{i}"
            rows_per_chunk = 512
            for start in range(0, dim, rows_per_chunk):
                chunk = (rng.standard_normal((min(rows_per_chunk, dim - start), dim), dtype=np.float32)
                         / np.float32(np.sqrt(dim)))
                data.write(chunk.tobytes())
            tensor = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=[dim, dim])
            tensor.data_location = TensorProto.EXTERNAL
            for key, value in (("location", data_name), ("offset", str(offset)), ("length", str(per_weight))):
                entry = tensor.external_data.add()
                entry.key, entry.value = key, value
            offset += per_weight
            inits.append(tensor)
            nodes.append(helper.make_node("MatMul", [h, name], [f"m{i}"], name=f"MatMul_{i}"))
            nodes.append(helper.make_node("Relu", [f"m{i}"], [f"r{i}"], name=f"Relu_{i}"))
            h = f"r{i}"
    nodes.append(helper.make_node("ReduceMean", [h], ["mu"], name="ReduceMean", axes=[-1]))
    nodes.append(helper.make_node("Sub", [h, "mu"], ["y"], name="Sub"))
    graph = helper.make_graph(nodes, "large",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", dim])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", dim])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    with open(path, "wb") as f:
        f.write(model.SerializeToString())
    return path


def large_feeds(dim: int = 8192, seed: int = 0) -> dict:
    return {"x": np.random.default_rng(seed).standard_normal((1, dim)).astype(np.float32)}
