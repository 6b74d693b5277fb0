"""Models for the report, explain and HTML tests: a transformer block with a decomposed LayerNorm,
and a synthetic graph of any size (10,000 nodes for the HTML page)."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from util import make_model  # noqa: F401  (also puts the repository root on sys.path)

IR_VERSION = 9  # onnxruntime 1.31 refuses IR > 10

BLOCK = """
<ir_version: 9, opset_import: ["" : 17]>
block (float[2,16,64] x, float[2,16,16] mask) => (float[2,16,64] y) {
  q = MatMul(x, Wq)
  k = MatMul(x, Wk)
  kt = Transpose<perm=[0,2,1]>(k)
  s = MatMul(q, kt)
  s2 = Mul(s, scale)
  s3 = Add(s2, mask)
  sm = Softmax<axis=-1>(s3)
  a = MatMul(sm, x)
  h = Add(a, x)
  mu = ReduceMean<axes=[-1]>(h)
  d = Sub(h, mu)
  p = Pow(d, two)
  var = ReduceMean<axes=[-1]>(p)
  ve = Add(var, eps)
  sd = Sqrt(ve)
  n = Div(d, sd)
  g = Mul(n, gamma)
  ln = Add(g, beta)
  f1 = MatMul(ln, W1)
  r = Relu(f1)
  y = MatMul(r, W2)
}
"""
LAYERNORM_NODES = ["ln_mean", "ln_sub", "ln_pow", "ln_var", "ln_add_eps", "ln_sqrt", "ln_div", "ln_mul", "ln_add"]
_NAMES = ["q_proj", "k_proj", "k_t", "scores", "scale_mul", "mask_add", "softmax", "attn_v", "residual",
          *LAYERNORM_NODES, "ffn_up", "ffn_relu", "ffn_down"]


def block_model(*, big_weight: bool = False) -> onnx.ModelProto:
    """A transformer block: attention (with a -1e9 additive mask constant), residual, a decomposed
    LayerNorm and an FFN whose hidden size (100) is not a multiple of 8. The report tests rewrite
    it with ``fuse=False`` (``--no-fuse``): its LayerNorm is their FP32-island example, which by
    default would become one LayerNormalization (tests/test_fuse.py covers that)."""
    rng = np.random.default_rng(0)
    w1 = rng.normal(size=(64, 100)) * 0.1
    if big_weight:
        w1[0, :3] = [1e5, -7e4, 1e-9]  # two clamped at ±65504, one flushed to zero
    inits = {"Wq": rng.normal(size=(64, 64)) * 0.1, "Wk": rng.normal(size=(64, 64)) * 0.1,
             "scale": np.float32(0.125), "two": np.float32(2.0), "eps": np.float32(1e-5),
             "gamma": np.ones(64), "beta": np.zeros(64), "W1": w1, "W2": rng.normal(size=(100, 64)) * 0.1}
    model = make_model(BLOCK, {k: np.asarray(v, np.float32) for k, v in inits.items()}, ir_version=IR_VERSION)
    for node, name in zip(model.graph.node, _NAMES):
        node.name = name
    return model


def block_with_mask_constant() -> onnx.ModelProto:
    """The block with its mask baked in as a -1e9 constant (a sentinel the report must list)."""
    model = block_model()
    mask = np.zeros((2, 16, 16), np.float32)
    mask[:, :, 8:] = -1e9
    graph = model.graph
    keep = [i for i in graph.input if i.name != "mask"]
    del graph.input[:]
    graph.input.extend(keep)
    graph.initializer.append(numpy_helper.from_array(mask, "mask"))
    return model


def chain_model(n_nodes: int = 10_000, *, hidden: int = 12) -> onnx.ModelProto:
    """A synthetic DAG of about ``n_nodes`` nodes: repeated units of MatMul → Add → Relu, a
    decomposed LayerNorm every few units (an FP32 island each), a softmax, and residual edges."""
    rng = np.random.default_rng(1)
    nodes: list[onnx.NodeProto] = []
    inits: list[onnx.TensorProto] = []

    def init(name: str, arr) -> str:
        inits.append(numpy_helper.from_array(np.asarray(arr, np.float32), name))
        return name

    w = init("w", rng.normal(size=(hidden, hidden)) / np.sqrt(hidden))
    b = init("b", rng.normal(size=(hidden,)) * 0.1)
    w_odd = init("w_odd", rng.normal(size=(hidden, hidden)) / np.sqrt(hidden))
    two, eps = init("two", 2.0), init("eps", 1e-5)
    x = "x"
    unit = 0

    def add(op: str, inputs: list[str], **attrs) -> str:
        out = f"t{len(nodes)}"
        nodes.append(helper.make_node(op, inputs, [out], name=f"{op.lower()}_{len(nodes)}", **attrs))
        return out

    while len(nodes) < n_nodes - 12:
        residual = x
        x = add("MatMul", [x, w if unit % 5 else w_odd])
        x = add("Add", [x, b])
        x = add("Relu", [x])
        if unit % 4 == 3:
            h = add("Add", [x, residual])
            mu = add("ReduceMean", [h], axes=[-1])
            d = add("Sub", [h, mu])
            p = add("Pow", [d, two])
            var = add("ReduceMean", [p], axes=[-1])
            sd = add("Sqrt", [add("Add", [var, eps])])
            x = add("Div", [d, sd])
        elif unit % 7 == 5:
            x = add("Softmax", [x], axis=-1)
        elif unit % 3 == 1:
            x = add("Transpose", [x], perm=[0, 1])
        unit += 1
    add("MatMul", [x, w])
    nodes[-1].output[0] = "y"
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, hidden])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, hidden])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=IR_VERSION)


def overflow_model() -> onnx.ModelProto:
    """MatMul outputs near ±1.7e5: fine in FP32, inf in fp16 (what --check localises)."""
    return make_model("""
        <ir_version: 9, opset_import: ["" : 17]>
        g (float[4,64] x) => (float[4,1] y) {
          a = MatMul(x, w)
          b = Relu(a)
          c = MatMul(b, w2)
          y = ReduceMean<axes=[-1], keepdims=1>(c)
        }""", {"w": np.full((64, 64), 30000.0, np.float32), "w2": np.eye(64, dtype=np.float32)},
        ir_version=IR_VERSION)


def branches_sharing_a_node_name() -> onnx.ModelProto:
    """An If whose branches both hold a node named 'mm' (a MatMul, an Exp): valid ONNX, names are
    unique per graph."""
    m = make_model("""
        <ir_version: 9, opset_import: ["" : 17]>
        g (bool cond, float[4,8] x) => (float[4,8] y) {
          y = If(cond) <
            then_branch = t () => (float[4,8] r) { r = MatMul(x, w) },
            else_branch = e () => (float[4,8] r2) { r2 = Exp(x) }
          >
        }""", {"w": (8, 8)})
    branches = {a.name: a.g for a in m.graph.node[0].attribute}
    branches["then_branch"].node[0].name = branches["else_branch"].node[0].name = "mm"
    return m
