"""Fusion of decomposed LayerNorm / RMSNorm / tanh-GELU into fused ops (amp_rewrite/passes/fuse.py).

Each fused form is checked for: the op it becomes, no FP32 island and no Cast left for it, the
checker, a fixed point, and numerics against the FP32 model in onnxruntime (large activations
included: the fused kernels keep their statistics in FP32). The cases where fusion must not
happen keep the FP32 island."""

from __future__ import annotations

import re

import numpy as np
import onnx
from onnx import TensorProto, helper
import pytest

from amp_rewrite.decisions import Precision
from amp_rewrite.report import Report, validate
from tests.util import FP16, FP32, full_check, make_model, nodes_by_type, rel_err, rewrite, run, value_types

W = {"wq": (8, 8), "wo": (8, 8), "g": np.linspace(0.5, 1.5, 8, dtype=np.float32),
     "b": np.linspace(-0.1, 0.1, 8, dtype=np.float32), "two": np.array(2.0, np.float32),
     "eps": np.array(1e-5, np.float32), "one": np.array(1.0, np.float32)}

LAYERNORM = """
      m = ReduceMean<axes=[-1]>(r)
      d = Sub(r, m)
      p = Pow(d, two)
      v = ReduceMean<axes=[-1]>(p)
      ve = Add(v, eps)
      sd = Sqrt(ve)
      n = Div(d, sd)
      ng = Mul(n, g)
      ln = Add(ng, b)"""

RMSNORM = """
      rc = Cast<to=1>(r)
      p = Pow(rc, two)
      v = ReduceMean<axes=[-1]>(p)
      ve = Add(v, eps)
      sd = Sqrt(ve)
      inv = Reciprocal(sd)
      n = Mul(rc, inv)
      ln = Mul(g, n)"""


def residual_block(norm: str, opset: int, *, outputs: str = "float[2,4,8] y",
                   inits: dict | None = None) -> onnx.ModelProto:
    """x -> MatMul -> residual Add (q + x1) -> norm -> MatMul; the residual sum r also feeds the
    next residual Add, as in a pre-LN transformer."""
    text = f"""
    <ir_version: 8, opset_import: ["" : {opset}]>
    g (float[2,4,8] x) => ({outputs}) {{
      x1 = MatMul(x, wi)
      q = MatMul(x1, wq)
      r = Add(q, x1){norm}
      h = MatMul(ln, wo)
      s = Add(h, r)
      y = MatMul(s, wy)
    }}"""
    return make_model(text, {**W, "wi": (8, 8), "wy": (8, 8), **(inits or {})})


def feeds(scale: float = 1.0) -> dict:
    return {"x": (np.random.default_rng(0).standard_normal((2, 4, 8)) * scale).astype(np.float32)}


def names(values) -> list[str]:
    """Value names without the suffix a retyped value gets ("r/amp_fp16" -> "r")."""
    return [v.split("/amp_")[0] for v in values]


def only(model: onnx.ModelProto, op: str, domain: str = "") -> onnx.NodeProto:
    found = [n for n in model.graph.node if n.op_type == op and n.domain == domain]
    assert len(found) == 1, [(n.op_type, n.domain) for n in model.graph.node]
    return found[0]


def unread(model: onnx.ModelProto) -> set[str]:
    """Initializers and nodes whose values nothing reads."""
    read = {i for n in model.graph.node for i in n.input} | {o.name for o in model.graph.output}
    return {t.name for t in model.graph.initializer if t.name not in read} | \
        {n.name or n.output[0] for n in model.graph.node if not any(o in read for o in n.output)}


def check_fused(model: onnx.ModelProto, result, *, scale: float = 1.0, tolerance: float = 1e-2) -> None:
    out = result.model
    full_check(out)
    assert out.ir_version == model.ir_version
    assert not result.log.islands
    assert not nodes_by_type(out, "ReduceMean") and not nodes_by_type(out, "Pow")
    # only the graph input and output cross precisions
    assert len(nodes_by_type(out, "Cast")) == 2
    # the pattern's constants (eps, the exponent) and Constant nodes went with it
    assert unread(out) == unread(model)
    ref, got = run(model, feeds(scale))["y"], run(out, feeds(scale))["y"]
    assert np.isfinite(got).all()
    assert rel_err(ref, got) < tolerance
    again = rewrite(out)
    assert not again.modified


@pytest.mark.parametrize("scale", [1.0, 300.0])
def test_layernorm_opset17_becomes_layernormalization(scale):
    model = residual_block(LAYERNORM, 17)
    result = rewrite(model)
    node = only(result.model, "LayerNormalization")
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    assert attrs["axis"] == -1 and attrs["epsilon"] == pytest.approx(1e-5)
    assert names(node.input) == ["r", "g", "b"]
    assert value_types(result.model)["ln"] == FP16
    # deviations of ~300 square to ~90000 (inf in FP16): the fused kernel's statistics are FP32
    check_fused(model, result, scale=scale)
    [fusion] = result.log.fusions
    assert fusion.pattern == "LayerNorm" and fusion.op == "LayerNormalization"
    assert {"ReduceMean:m", "Pow:p", "Sqrt:sd", "Div:n", "Add:ln"} <= set(fusion.members)


# older torch exports: ``x - mean`` twice, one Sub for the Pow and one for the Div (or the Mul of the
# reciprocal)
LAYERNORM_TWIN_SUB = LAYERNORM.replace("n = Div(d, sd)", "d2 = Sub(r, m)\n      n = Div(d2, sd)")
LAYERNORM_TWIN_SUB_RECIPROCAL = LAYERNORM.replace(
    "n = Div(d, sd)", "d2 = Sub(r, m)\n      inv = Reciprocal(sd)\n      n = Mul(d2, inv)")


@pytest.mark.parametrize("norm", [LAYERNORM_TWIN_SUB, LAYERNORM_TWIN_SUB_RECIPROCAL], ids=["div", "reciprocal"])
@pytest.mark.parametrize("scale", [1.0, 300.0])
def test_layernorm_with_a_twin_sub_is_fused_too(norm, scale):
    """Left unfused, its FP32 island (Cast, then the decomposition) met onnxruntime's own
    LayerNormFusion, which takes that form too, folds the leading Cast into a LayerNormalization
    of FP16 X and FP32 scale and then refuses to load it ('bound to different types')."""
    model = residual_block(norm, 17)
    result = rewrite(model)
    node = only(result.model, "LayerNormalization")
    assert names(node.input) == ["r", "g", "b"]
    check_fused(model, result, scale=scale)
    [fusion] = result.log.fusions
    assert {"Sub:d", "Sub:d2"} <= set(fusion.members)


def _layernorm_with_affine(source: str, opset: int) -> tuple[onnx.ModelProto, dict]:
    """x -> MatMul -> decomposed LayerNorm -> MatMul, gamma and beta from ``source``: graph inputs,
    or a Squeeze of [1, 8] initializers."""
    g = np.linspace(0.5, 1.5, 8).astype(np.float32)
    b = np.linspace(-0.5, 0.5, 8).astype(np.float32)
    inputs = {"x": feeds()["x"]}
    if source == "input":
        head, inits, pre = "float[2,4,8] x, float[8] g, float[8] b", {}, ""
        inputs = {**inputs, "g": g, "b": b}
    else:
        head, inits = "float[2,4,8] x", {"g0": g[None], "b0": b[None], "ax": np.array([0], np.int64)}
        pre = "g = Squeeze(g0, ax)\n      b = Squeeze(b0, ax)"
    text = f"""
    <ir_version: 8, opset_import: ["" : {opset}]>
    gr ({head}) => (float[2,4,8] y) {{
      {pre}
      r = MatMul(x, wq){LAYERNORM}
      y = MatMul(ln, wo)
    }}"""
    weights = {k: v for k, v in W.items() if k not in ("g", "b")}
    return make_model(text, {**weights, **inits}), inputs


@pytest.mark.parametrize("source", ["input", "squeeze"])
def test_a_layernorm_whose_scale_is_no_constant_is_fused_at_opset_17(source):
    """gamma and beta as graph inputs, or computed (Squeeze of an initializer): the matcher wanted
    constants and left the FP32 island, which onnxruntime's LayerNormFusion took anyway (it folds
    the Squeeze, or takes an input) into a LayerNormalization of FP16 X and FP32 scale that it
    then refused to load. LayerNormalization takes any scale and bias: the pattern is fused."""
    model, inputs = _layernorm_with_affine(source, 17)
    result = rewrite(model)
    full_check(result.model)
    node = only(result.model, "LayerNormalization")
    assert value_types(result.model)[node.output[0]] == FP16
    ref, got = run(model, inputs)["y"], run(result.model, inputs)["y"]  # (default optimisations)
    assert rel_err(ref, got) < 1e-2
    assert not rewrite(result.model).modified


def test_below_opset_17_a_scale_that_is_no_constant_keeps_the_island():
    """The skip ops are chosen for constants only: below opset 17 such a LayerNorm stays an FP32
    island (onnxruntime fuses it into its own LayerNormalization, which takes mixed types)."""
    model, inputs = _layernorm_with_affine("input", 13)
    result = rewrite(model)
    assert not result.log.fusions and [i.pattern for i in result.log.islands] == ["LayerNorm"]
    assert rel_err(run(model, inputs)["y"], run(result.model, inputs)["y"]) < 1e-2


def test_a_second_sub_of_other_operands_is_no_twin():
    """``r - m`` squared but ``x1 - m`` divided: not a LayerNorm, left as it is."""
    norm = LAYERNORM.replace("n = Div(d, sd)", "d2 = Sub(x1, m)\n      n = Div(d2, sd)")
    result = rewrite(residual_block(norm, 17))
    assert not result.log.fusions and nodes_by_type(result.model, "ReduceMean")
    full_check(result.model)


@pytest.mark.parametrize("scale", [1.0, 300.0])
def test_layernorm_opset13_after_residual_becomes_skiplayernormalization(scale):
    model = residual_block(LAYERNORM, 13)
    result = rewrite(model)
    node = only(result.model, "SkipLayerNormalization", "com.microsoft")
    assert names(node.input) == ["q", "x1", "g", "b"]
    # the residual sum keeps its name and its other reader, through the fourth output
    assert names(node.output)[1:] == ["", "", "r"]
    [residual] = nodes_by_type(result.model, "Add")
    assert residual.input[1] == node.output[3] and value_types(result.model)[node.output[3]] == FP16
    assert any(op.domain == "com.microsoft" for op in result.model.opset_import)
    check_fused(model, result, scale=scale)


def test_rmsnorm_opset13_after_residual_becomes_skipsimplifiedlayernormalization():
    model = residual_block(RMSNORM, 13)
    result = rewrite(model)
    node = only(result.model, "SkipSimplifiedLayerNormalization", "com.microsoft")
    assert names(node.input) == ["q", "x1", "g"]
    assert not nodes_by_type(result.model, "Reciprocal")
    check_fused(model, result, scale=300.0)
    assert result.log.fusions[0].pattern == "RMSNorm"


@pytest.mark.parametrize("opset", [22, 23])
def test_rmsnorm_after_residual_takes_the_skip_op_below_opset_23_and_rmsnormalization_from_it(opset):
    """RMSNormalization is new in opset 23: at opset 22 the residual RMSNorm becomes the skip op, as
    at 13 (taking 22 for its first opset would leave it an unfused FP32 island); at 23 the standard op
    takes the norm and the residual Add stays."""
    model = residual_block(RMSNORM_AXES_INPUT, opset, inits={"last": np.array([-1], np.int64)})
    result = rewrite(model)
    if opset == 22:
        node = only(result.model, "SkipSimplifiedLayerNormalization", "com.microsoft")
        assert names(node.input) == ["q", "x1", "g"]
        assert not any(n.op_type == "RMSNormalization" for n in result.model.graph.node)
    else:
        node = only(result.model, "RMSNormalization")
        assert names(node.input) == ["r", "g"]
        assert not any(n.domain == "com.microsoft" for n in result.model.graph.node)
    assert [f.pattern for f in result.log.fusions] == ["RMSNorm"]
    assert not nodes_by_type(result.model, "Reciprocal")
    check_fused(model, result, scale=300.0)


def test_broadcast_skip_goes_second():
    """A position-embedding-like operand (1, 4, 8) is the skip, the full activation the input."""
    text = """
    <ir_version: 8, opset_import: ["" : 13]>
    g (float[2,4,8] x) => (float[2,4,8] y) {
      q = MatMul(x, wq)
      r = Add(pos, q)""" + LAYERNORM + """
      y = MatMul(ln, wo)
    }"""
    model = make_model(text, {**W, "pos": (1, 4, 8)})
    result = rewrite(model)
    node = only(result.model, "SkipLayerNormalization", "com.microsoft")
    assert names(node.input)[:2] == ["q", "pos"]
    check_fused(model, result)


@pytest.mark.parametrize("bias", [(1, 8), (8,)], ids=["1x8", "8"])
def test_a_broadcast_operand_of_a_rank_2_sum_is_no_skip(bias):
    """For a (tokens, hidden) input the skip ops take a skip of the same shape only (onnxruntime
    refuses a (1, hidden) or (hidden,) one at run time): the norm reads the sum with a zero skip."""
    model = make_model("""
    <ir_version: 8, opset_import: ["" : 13]>
    g (float[4,8] x) => (float[4,8] y) {
      q = MatMul(x, wq)
      r = Add(q, pos)""" + LAYERNORM + """
      y = MatMul(ln, wo)
    }""", {**W, "pos": bias})
    result = rewrite(model)
    full_check(result.model)
    node = only(result.model, "SkipLayerNormalization", "com.microsoft")
    assert names(node.input)[0] == "r" and "zero tensor" in result.log.fusions[0].reason
    x = {"x": np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)}
    assert rel_err(run(model, x)["y"], run(result.model, x)["y"]) < 1e-2


def _two_input_dims_residual(norm: str) -> str:
    """A residual sum of (B, S, 8) and (B, T, 8), two graph-input dims broadcast together, then the norm."""
    return """
    <ir_version: 8, opset_import: ["" : 13]>
    g (float[B,S,8] x, float[B,T,8] c) => (float[B,U,8] y) {
      q = MatMul(x, wq)
      r = Add(q, c)""" + norm + """
      y = MatMul(ln, wo)
    }"""


@pytest.mark.parametrize("norm, op", [(LAYERNORM, "SkipLayerNormalization"),
                                      (RMSNORM, "SkipSimplifiedLayerNormalization")], ids=["layernorm", "rmsnorm"])
def test_a_residual_sum_of_two_input_dims_is_no_proof_of_equal_shapes(norm, op):
    """``(B, S, 8) + (B, T, 8)`` is valid ONNX where T (or S) is 1 at run time. onnxruntime's
    symbolic inference, run again with auto_merge where the strict run stops at that broadcast,
    took T for S, and the sum was fused into a skip op, which wants the skip's shape to be the
    input's: the output failed at run time ('last two dimensions of skip needs to be same as
    input') wherever the FP32 model broadcast. A merge that equates two of the graph's input dims
    proves nothing now; BERT's Min(64, sequence) against sequence (one input dim) still does."""
    model = make_model(_two_input_dims_residual(norm), W)
    result = rewrite(model)
    full_check(result.model)
    assert not any(n.op_type == op and n.input[1] in ("c", "c/amp_fp16") for n in result.model.graph.node)
    rng = np.random.default_rng(0)
    for s, t in [(4, 4), (4, 1), (1, 4)]:
        feeds = {"x": rng.standard_normal((2, s, 8)).astype(np.float32),
                 "c": rng.standard_normal((2, t, 8)).astype(np.float32)}
        want, got = run(model, feeds)["y"], run(result.model, feeds)["y"]
        assert rel_err(got, want) < 1e-2, (s, t)


def _shifted_residual(norm: str) -> str:
    """A residual sum of x[:, 1:] (B, S - 1, 8) and (B, S, 8), one input dim broadcast against an
    expression of itself, then the norm."""
    return """
    <ir_version: 8, opset_import: ["" : 13]>
    g (float[B,S,8] x) => (float[B,U,8] y) {
      q = MatMul(x, wq)
      c = Slice(x, st, en, ax)
      r = Add(q, c)""" + norm + """
      y = MatMul(ln, wo)
    }"""


@pytest.mark.parametrize("norm, op", [(LAYERNORM, "SkipLayerNormalization"),
                                      (RMSNORM, "SkipSimplifiedLayerNormalization")], ids=["layernorm", "rmsnorm"])
def test_a_residual_sum_of_a_dim_and_a_shift_of_it_is_no_proof_of_equal_shapes(norm, op):
    """``(B, S, 8) + (B, S - 1, 8)`` runs where S - 1 is 1 (S = 2, the FP32 model broadcasts) or
    S is 1 (S - 1 = 0). onnxruntime's symbolic inference merges S - 1 into S; a merge of two
    expressions of one input dim proves equal shapes only where they are equal wherever the
    broadcast runs (Min(64, S) against S is), so the sum is not fused into a skip op, which wants
    the skip's shape to be the input's."""
    model = make_model(_shifted_residual(norm), {**W, "st": np.array([1], np.int64),
                                                  "en": np.array([2**62], np.int64), "ax": np.array([1], np.int64)})
    result = rewrite(model)
    full_check(result.model)
    assert not any(n.op_type == op and "c" in (n.input[0], n.input[1]) for n in result.model.graph.node)
    rng = np.random.default_rng(0)
    for s, rows in ((2, 2), (1, 0)):  # (S = 1: the sum broadcasts 0 against 1, an empty output)
        feeds = {"x": rng.standard_normal((2, s, 8)).astype(np.float32)}
        want, got = run(model, feeds)["y"], run(result.model, feeds)["y"]
        assert got.shape == want.shape == (2, rows, 8)
        if rows:
            assert rel_err(got, want) < 1e-2


def _reshaped_residual(shape_of: str) -> onnx.ModelProto:
    """(B, S, 8) + the same rows through a Reshape whose shape is computed from x1's own Shape,
    read through ``shape_of`` ("Identity" or nothing): the sum is proven to be of equal shapes only
    by carrying the Shape's values through to the Reshape (onnxruntime's symbolic inference)."""
    read = f"si = {shape_of}(s)" if shape_of else "si = Identity(s)"
    text = f"""
    <ir_version: 8, opset_import: ["" : 13]>
    g (float[B,S,8] x) => (float[B,S,8] y) {{
      x1 = MatMul(x, wi)
      s = Shape(x1)
      {read if shape_of else ""}
      b0 = Gather<axis=0>({"si" if shape_of else "s"}, i0)
      s0 = Gather<axis=0>({"si" if shape_of else "s"}, i1)
      b1 = Unsqueeze(b0, ax0)
      s1 = Unsqueeze(s0, ax0)
      shape = Concat<axis=0>(b1, s1, c8)
      flat = Reshape(x1, rows)
      qf = MatMul(flat, wq)
      q = Reshape(qf, shape)
      r = Add(q, x1){LAYERNORM}
      h = MatMul(ln, wo)
      s2 = Add(h, r)
      y = MatMul(s2, wy)
    }}"""
    return make_model(text, {**W, "wi": (8, 8), "wy": (8, 8), "i0": np.array(0, np.int64),
                             "i1": np.array(1, np.int64), "ax0": np.array([0], np.int64),
                             "c8": np.array([8], np.int64), "rows": np.array([-1, 8], np.int64)})


@pytest.mark.parametrize("shape_of", ["", "Identity"])
def test_a_residual_proof_reads_shape_arithmetic_through_identity(shape_of):
    """onnxruntime's symbolic inference passes only shape and type through an Identity, so the
    Shape's values stopped there: the opset-13 LayerNorm was never fused into the skip op and stayed
    an FP32 island with 2 more Casts (ViT's TorchScript export with Identity nodes: 14 Casts, not 2).
    The proof now carries the values through, as without the Identity."""
    model = _reshaped_residual(shape_of)
    result = rewrite(model)
    out = result.model
    full_check(out)
    skip = only(out, "SkipLayerNormalization", "com.microsoft")
    assert names(skip.input[:2]) in (["q", "x1"], ["x1", "q"])
    assert len(nodes_by_type(out, "Cast")) == 2 and not nodes_by_type(out, "ReduceMean")
    x = np.random.default_rng(0).standard_normal((2, 4, 8)).astype(np.float32)
    assert rel_err(run(model, {"x": x})["y"], run(out, {"x": x})["y"]) < 1e-2
    assert not rewrite(out).modified


@pytest.mark.parametrize("a, b, sound", [("Min(64, S)", "S", True), ("Max(1, S)", "S", True), ("S", "S", True),
                                         ("S - 1", "S", False), ("S - 100", "S", False), ("2*S", "S", False),
                                         ("floor(S/2)", "S", False), ("S*T", "S*T", True), ("Min(S, T)", "S", False)])
def test_a_merge_is_sound_where_both_dims_are_equal_wherever_the_broadcast_runs(a, b, sound):
    """Equal, or one of them 1 (a broadcast the FP32 model runs too), at every input-dim value tried,
    including those where a polynomial side is 1 (S - 100 at S = 101)."""
    import sympy

    from amp_rewrite.frontends.onnx_fuse import _equal_where_broadcast

    symbols = {name: sympy.Symbol(name, integer=True, nonnegative=True) for name in ("S", "T")}
    assert _equal_where_broadcast(sympy.sympify(a, locals=symbols), sympy.sympify(b, locals=symbols)) is sound


GELU = """
    <ir_version: 8, opset_import: ["" : {opset}]>
    g (float[2,4,8] x) => (float[2,4,8] y) {{
      h = MatMul(x, wq)
      half = Mul(h, c_half)
      cube = Pow(h, c_three)
      cubic = Mul(cube, c_cubic)
      inner = Add(h, cubic)
      scaled = Mul(inner, c_scale)
      t = Tanh(scaled)
      t1 = Add(t, c_one)
      act = Mul(half, t1)
      y = MatMul(act, wo)
    }}"""

GELU_CONSTS = {"c_half": np.array(0.5, np.float32), "c_three": np.array(3.0, np.float32),
               "c_cubic": np.array(0.044715, np.float32), "c_scale": np.array(np.sqrt(2 / np.pi), np.float32),
               "c_one": np.array(1.0, np.float32)}


# torch's F.gelu(approximate="tanh") as the dynamo exporter writes it below opset 20: the half
# multiplies (1 + tanh) first and x last (Gemma); only GPT-2's order was recognised, so every MLP
# kept x**3 in a 9-node FP32 island with its Casts
GELU_TORCHLIB = GELU.replace("      half = Mul(h, c_half)\n", "").replace(
    "act = Mul(half, t1)", "half = Mul(c_half, t1)\n      act = Mul(h, half)")


# torch's own tanh-GELU symbolic, as the TorchScript exporter writes it below opset 20 (SigLIP,
# any nn.GELU(approximate="tanh")): the cube as h * (h * h), and the half applied last; it stayed a
# 9-node FP32 island with two Casts per MLP, and no note said why
GELU_TORCHSCRIPT = GELU.replace("      half = Mul(h, c_half)\n", "").replace(
    "cube = Pow(h, c_three)", "square = Mul(h, h)\n      cube = Mul(h, square)").replace(
    "act = Mul(half, t1)", "xt = Mul(h, t1)\n      act = Mul(c_half, xt)")


# BLOOM's bloom_gelu_forward: the cube factored, x * c * (1 + 0.044715 * x * x), as both exporters
# write it; its x * x ran past FP16's range (x > 256) where the fused kernel is exact, and --check
# failed a model whose outputs were right
GELU_BLOOM = """
    <ir_version: 8, opset_import: ["" : {opset}]>
    g (float[2,4,8] x) => (float[2,4,8] y) {{
      h = MatMul(x, wq)
      half = Mul(h, c_half)
      scaled = Mul(h, c_scale)
      k = Mul(h, c_cubic)
      quad = Mul(k, h)
      poly = Add(quad, c_one)
      arg = Mul(scaled, poly)
      t = Tanh(arg)
      t1 = Add(t, c_one)
      act = Mul(half, t1)
      y = MatMul(act, wo)
    }}"""
GELU_BLOOM_SQUARED = GELU_BLOOM.replace("k = Mul(h, c_cubic)\n      quad = Mul(k, h)",
                                        "k = Mul(h, h)\n      quad = Mul(c_cubic, k)")


@pytest.mark.parametrize("form", ["gpt2", "torchlib", "torchscript", "bloom", "bloom-squared"])
@pytest.mark.parametrize("opset,op,domain", [(13, "FastGelu", "com.microsoft"), (20, "Gelu", "")])
def test_tanh_gelu_is_fused(opset, op, domain, form):
    text = {"gpt2": GELU, "torchlib": GELU_TORCHLIB, "torchscript": GELU_TORCHSCRIPT, "bloom": GELU_BLOOM,
            "bloom-squared": GELU_BLOOM_SQUARED}[form]
    assert form == "gpt2" or ("act = Mul(h, half)" in text and "Mul(h, c_half)" not in text) or (
        "cube = Mul(h, square)" in text and "Pow" not in text) or ("poly = Add(quad, c_one)" in text)
    model = make_model(text.format(opset=opset), {"wq": (8, 8), "wo": (8, 8), **GELU_CONSTS})
    result = rewrite(model)
    node = only(result.model, op, domain)
    if op == "Gelu":
        assert onnx.helper.get_attribute_value(node.attribute[0]) == b"tanh"
    assert not nodes_by_type(result.model, "Tanh")
    # x**3 of activations ~60 overflows FP16: it only saturates the tanh
    check_fused(model, result, scale=60.0)
    assert result.log.fusions[0].pattern == "tanh-GELU"


def _odd_gelu(opset: int, shape: str, width: int) -> onnx.ModelProto:
    """GELU's model with x of ``shape`` and square weights of ``width``."""
    text = GELU.replace("float[2,4,8] x", f"float[{shape}] x").replace("float[2,4,8] y", f"float[{shape}] y")
    return make_model(text.format(opset=opset), {"wq": (width, width), "wo": (width, width), **GELU_CONSTS})


@pytest.mark.parametrize("opset", [13, 20])
@pytest.mark.parametrize("shape,width,target,fused", [
    ("3,5", 5, "fp16", False),      # 15 elements: the FP16 kernel leaves the 15th unwritten
    ("N,3", 3, "fp16", False),      # N unknown: the count may be odd
    ("N,6", 6, "fp16", True),       # a known even dimension: the count is even
    ("3,5", 5, "bf16", True),       # onnxruntime's BF16 kernel computes one element at a time
])
def test_a_tanh_gelu_of_an_odd_or_unknown_count_is_not_fused_for_fp16(opset, shape, width, target, fused):
    """onnxruntime's CUDA launcher for Gelu(approximate="tanh") and FastGelu (no bias) runs FP16 in
    half2 pairs over count // 2 of them: an odd count's last element is never written (an H100 gave
    relative error 0.19 on onnx's 3-element test case). FP16 fuses only a count known to be even."""
    result = rewrite(_odd_gelu(opset, shape, width), target=target)
    op, domain = ("Gelu", "") if opset >= 20 else ("FastGelu", "com.microsoft")
    found = [n for n in result.model.graph.node if n.op_type == op and n.domain == domain]
    assert bool(found) is fused
    assert bool(result.log.fusions) is fused
    if not fused:  # the decomposition stays an FP32 island, as an unfused pattern does
        assert nodes_by_type(result.model, "Pow") and len(result.log.islands) == 1
        assert not [n for n in result.model.graph.node if n.op_type in ("Gelu", "FastGelu")]
    else:
        assert value_types(result.model)[found[0].output[0]] == (FP16 if target == "fp16" else onnx.TensorProto.BFLOAT16)


@pytest.mark.parametrize("coeff", ["c_scale", "c_cubic", "c_one"])
def test_a_factored_gelu_with_a_wrong_coefficient_is_not_fused(coeff):
    """BLOOM's spelling is fused only with GELU's own coefficients: another changes the function."""
    model = make_model(GELU_BLOOM.format(opset=13), {"wq": (8, 8), "wo": (8, 8), **GELU_CONSTS,
                                                     coeff: np.array(0.3, np.float32)})
    result = rewrite(model)
    full_check(result.model)
    assert not result.log.fusions and nodes_by_type(result.model, "Tanh")


def test_wrong_gelu_coefficient_is_not_fused():
    consts = {**GELU_CONSTS, "c_cubic": np.array(0.05, np.float32)}
    result = rewrite(make_model(GELU.format(opset=13), {"wq": (8, 8), "wo": (8, 8), **consts}))
    assert not result.log.fusions
    assert nodes_by_type(result.model, "Pow") and len(result.log.islands) == 1


@pytest.mark.parametrize("eps", [0.0, 1.0, -1e-5])
def test_an_eps_outside_zero_to_one_is_not_fused(eps):
    """A LayerNorm's eps is a small positive constant below 1: a pattern that adds 0, 1 or a
    negative number to the variance is left as written (an FP32 island)."""
    model = residual_block(LAYERNORM, 17, inits={"eps": np.array(eps, np.float32)})
    result = rewrite(model)
    full_check(result.model)
    assert not result.log.fusions
    assert not nodes_by_type(result.model, "LayerNormalization") and nodes_by_type(result.model, "ReduceMean")
    assert len(result.log.islands) == 1


def standalone_norm(norm: str, opset: int, extra: dict | None = None) -> onnx.ModelProto:
    """x -> MatMul -> norm -> MatMul: the norm reads no residual sum (T5's and Llama's first
    RMSNorm reads the embedding Gather the same way)."""
    text = f"""
    <ir_version: 8, opset_import: ["" : {opset}]>
    g (float[2,4,8] x) => (float[2,4,8] y) {{
      r = MatMul(x, wq){norm}
      y = MatMul(ln, wo)
    }}"""
    return make_model(text, {**W, **(extra or {})})


@pytest.mark.parametrize("scale", [1.0, 300.0])
@pytest.mark.parametrize("norm, opset, op", [(LAYERNORM, 13, "SkipLayerNormalization"),
                                             (RMSNORM, 17, "SkipSimplifiedLayerNormalization")],
                         ids=["layernorm-op13", "rmsnorm-op17"])
def test_standalone_norm_below_the_standard_op_takes_a_zero_skip(norm, opset, op, scale):
    """No residual Add to take over and no standard fused op at this opset (LayerNormalization
    17, RMSNormalization 23): the skip op reads ConstantOfShape(Shape(r)), exact zeros in the low
    type, so the norm runs in one kernel with FP32 statistics instead of an FP32 island."""
    model = standalone_norm(norm, opset)
    result = rewrite(model)
    node = only(result.model, op, "com.microsoft")
    assert names(node.input)[0] == "r" and len(node.output) == 1
    producers = {o: n for n in result.model.graph.node for o in n.output}
    fill = producers[node.input[1]]
    assert fill.op_type == "ConstantOfShape"
    assert producers[fill.input[0]].op_type == "Shape" and names(producers[fill.input[0]].input) == ["r"]
    [value] = [a.t for a in fill.attribute if a.name == "value"]
    assert value.data_type == onnx.TensorProto.FLOAT16 and not onnx.numpy_helper.to_array(value).any()
    [fusion] = result.log.fusions
    assert "zero tensor" in fusion.reason
    check_fused(model, result, scale=scale)


RMSNORM_AXES_INPUT = RMSNORM.replace("ReduceMean<axes=[-1]>(p)", "ReduceMean(p, last)")


@pytest.mark.parametrize("norm, opset, op, fill_op", [
    (LAYERNORM, 13, "SkipLayerNormalization", "Expand"), (RMSNORM, 17, "SkipSimplifiedLayerNormalization", "Expand"),
    (RMSNORM_AXES_INPUT, 20, "SkipSimplifiedLayerNormalization", "ConstantOfShape")],
    ids=["layernorm-op13", "rmsnorm-op17", "rmsnorm-op20"])
def test_bf16_zero_skip_is_made_in_bf16(norm, opset, op, fill_op):
    """ConstantOfShape has no bfloat16 output below opset 20: the zero skip made with it stayed
    FP32 and took the fused norm with it (an FP32 island with its Casts, the fusion's point lost).
    There the zeros are Expand(Constant(0), Shape(r)), both bfloat16 from opset 13, and the norm
    runs bf16 with only the graph input and output cast."""
    from tools.bench_bf16 import emulate_bf16

    model = standalone_norm(norm, opset, {"last": np.array([-1], np.int64)} if opset >= 18 else None)
    result = rewrite(model, target="bf16")
    out = result.model
    full_check(out)
    node = only(out, op, "com.microsoft")
    types = value_types(out)
    assert types[node.output[0]] == types[node.input[0]] == types[node.input[1]] == onnx.TensorProto.BFLOAT16
    producers = {o: n for n in out.graph.node for o in n.output}
    fill = producers[node.input[1]]
    assert fill.op_type == fill_op
    if fill_op == "Expand":
        literal = producers[fill.input[0]]
        assert literal.op_type == "Constant" and producers[fill.input[1]].op_type == "Shape"
        [value] = [a.t for a in literal.attribute if a.name == "value"]
        assert value.data_type == onnx.TensorProto.BFLOAT16 and not onnx.numpy_helper.to_array(value).any()
    assert len(nodes_by_type(out, "Cast")) == 2 and not result.log.islands
    # the literal the rewrite made is no weight of the input
    weights = [onnx.numpy_helper.to_array(t) for t in model.graph.initializer]
    weights += [onnx.numpy_helper.to_array(a.t) for n in model.graph.node for a in n.attribute if a.name == "value"]
    assert result.report.summary()["weights"]["bytes_before"] == sum(w.nbytes for w in weights)
    ref, got = run(model, feeds())["y"], run(emulate_bf16(out), feeds())["y"]
    assert rel_err(ref, got) < 5e-2
    assert not rewrite(out, target="bf16").modified


@pytest.mark.parametrize("scale", [1.0, 300.0])
def test_rmsnorm_opset23_becomes_rmsnormalization(scale):
    """From opset 23 the standard RMSNormalization takes the norm, residual or not: no skip op,
    no zero fill."""
    text = """
    <ir_version: 11, opset_import: ["" : 23]>
    g (float[2,4,8] x) => (float[2,4,8] y) {
      r = MatMul(x, wq)""" + RMSNORM_AXES_INPUT + """
      y = MatMul(ln, wo)
    }"""
    model = make_model(text, {**W, "last": np.array([-1], np.int64)})
    result = rewrite(model)
    node = only(result.model, "RMSNormalization")
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    assert attrs["axis"] == -1 and attrs["epsilon"] == pytest.approx(1e-5)
    assert names(node.input) == ["r", "g"]
    assert not nodes_by_type(result.model, "ConstantOfShape")
    check_fused(model, result, scale=scale)


def test_a_models_own_rmsnormalization_keeps_x_scale_and_y_one_type():
    """RMSNormalization-23 types X as T and scale and Y as V, but onnx's inference gives Y the type
    of X: painting them as one group keeps the model valid, with no Cast around the norm."""
    text = """
    <ir_version: 11, opset_import: ["" : 23]>
    g (float[2,4,8] x) => (float[2,4,8] y) {
      r = MatMul(x, wq)
      ln = RMSNormalization<axis=-1, epsilon=0.00001>(r, g)
      y = MatMul(ln, wo)
    }"""
    model = make_model(text, W)
    out = rewrite(model).model
    full_check(out)
    types = value_types(out)
    assert types["r"] == types["ln"] == FP16
    assert [t.data_type for t in out.graph.initializer if t.name == "g"] == [FP16]
    assert len(nodes_by_type(out, "Cast")) == 2  # the graph input and output only
    assert rel_err(run(model, feeds())["y"], run(out, feeds())["y"]) < 1e-2


def test_no_zero_skip_below_opset_9():
    """ConstantOfShape, which makes the zero skip, is an opset 9 op: below it the norm keeps its
    FP32 island (the fuser wrote a ConstantOfShape the opset does not have)."""
    model = standalone_norm(LAYERNORM, 8)
    result = rewrite(model)
    full_check(result.model)
    assert not result.log.fusions and not nodes_by_type(result.model, "ConstantOfShape")
    [island] = result.log.islands
    assert island.pattern == "LayerNorm"
    assert "and a zero skip needs ConstantOfShape (opset 9)" in _not_fused(result)


@pytest.mark.parametrize("opset", [9, 11])
def test_zero_skip_from_opset_9(opset):
    """From opset 9, where ConstantOfShape exists, a norm with no residual sum below opset 17
    takes the skip op on a zero tensor."""
    model = standalone_norm(LAYERNORM, opset)
    result = rewrite(model)
    full_check(result.model)
    node = only(result.model, "SkipLayerNormalization", "com.microsoft")
    producers = {o: n for n in result.model.graph.node for o in n.output}
    assert producers[node.input[1]].op_type == "ConstantOfShape"
    assert not result.log.islands


def test_zero_skip_needs_rank_2_or_3():
    """The skip ops take (batch, sequence, hidden) or (tokens, hidden): a rank-4 norm keeps its island."""
    model = make_model("""
    <ir_version: 8, opset_import: ["" : 13]>
    g (float[1,2,4,8] x) => (float[1,2,4,8] y) {
      r = MatMul(x, wq)""" + LAYERNORM + """
      y = MatMul(ln, wo)
    }""", W)
    result = rewrite(model)
    full_check(result.model)
    assert not result.log.fusions
    [island] = result.log.islands
    assert island.pattern == "LayerNorm"
    assert "and its input has rank 4" in _not_fused(result)
    x = {"x": np.random.default_rng(0).standard_normal((1, 2, 4, 8)).astype(np.float32)}
    assert rel_err(run(model, x)["y"], run(result.model, x)["y"]) < 1e-2


def test_zero_skip_needs_a_known_rank():
    """The skip ops take rank 2 or 3; a norm over an input of unknown rank keeps its island."""
    text = """
    <ir_version: 8, opset_import: ["" : 13]>
    g (float[2,4,8] x, int64[n] dims) => (float y) {
      q = MatMul(x, wq)
      r = Reshape(q, dims)""" + LAYERNORM + """
      y = MatMul(ln, wo)
    }"""
    model = make_model(text, W)  # r: a reshape to as many dims as the input says
    result = rewrite(model)
    assert not result.log.fusions
    [island] = result.log.islands
    assert island.pattern == "LayerNorm" and island.casts_in == 1 and island.casts_out == 1
    full_check(result.model)
    assert _not_fused(result) == (
        "not fused: 1 pattern(s) left as written: ReduceMean:m and 8 more nodes (LayerNorm: LayerNormalization needs opset 17 (this graph "
        "has 13); onnxruntime's skip ops need a residual sum or an input of rank 2 or 3: it does not follow a "
        "residual sum whose operand shapes are proven, and its input's rank is not known)")
    assert _not_fused(result) in result.report.summary_text().splitlines()


def test_zero_skip_takes_a_rank_only_the_data_propagating_inference_knows():
    """An opset-13 export reshapes to a shape computed from Shape arithmetic (CLIP's first
    layer_norm1 and post_layernorm, a Conv's output flattened): the loader's inference gives the
    norm's input no shape, so the zero skip declined and the norm stayed an FP32 island. onnx's
    inference with data propagation, which the skip proofs run anyway, knows its rank: 3."""
    model = make_model("""
    <ir_version: 8, opset_import: ["" : 13]>
    g (float[2,4,8] x) => (float[2,4,8] y) {
      q = MatMul(x, wq)
      s = Shape(q)
      k = Shape(s)
      e = Sub(k, one)
      h = Slice(s, zero, e)
      t = Concat<axis=0>(h, minus)
      r = Reshape(q, t)""" + LAYERNORM + """
      y = MatMul(ln, wo)
    }""", {**W, "one": np.array([1], np.int64), "zero": np.array([0], np.int64), "minus": np.array([-1], np.int64)})
    result = rewrite(model)
    full_check(result.model)
    assert [f.op for f in result.log.fusions] == ["com.microsoft::SkipLayerNormalization"]
    assert not result.log.islands and not [n for n in result.log.notes if n.startswith("not fused:")]
    x = {"x": np.random.default_rng(0).standard_normal((2, 4, 8)).astype(np.float32)}
    assert rel_err(run(model, x)["y"], run(result.model, x)["y"]) < 1e-2


def _not_fused(result) -> str:
    """The note on patterns recognised but left unfused (the report said nothing of them: the same
    export fused at opset 14 and not at 13 with no word why)."""
    [note] = [n for n in result.log.notes if n.startswith("not fused:")]
    return note


def test_a_norm_in_a_control_flow_body_left_unfused_is_said_why():
    """Inside an If branch no residual sum is proven (the shape proofs are the main graph's), so
    below opset 17 a norm of unknown rank stays decomposed; the note says where and why."""
    model = make_model("""
    <ir_version: 8, opset_import: ["" : 13]>
    g (float[2,4,8] x, int64[n] dims, bool c) => (float y) {
      q = MatMul(x, wq)
      r = Reshape(q, dims)
      y = If(c) <then_branch = t () => (float a) {""" + LAYERNORM + """
        a = MatMul(ln, wo)
      }, else_branch = e () => (float z) {
        z = Identity(r)
      }>
    }""", W)
    result = rewrite(model)
    full_check(result.model)
    assert not result.log.fusions
    assert "inside a control-flow body, where no residual sum is proven" in _not_fused(result)


def test_unread_initializer_of_the_input_is_kept():
    """Fusion drops the constants only its pattern read (eps, the exponent); one the input model
    already left unread is not the rewrite's to drop."""
    model = residual_block(LAYERNORM, 17)
    model.graph.initializer.append(onnx.numpy_helper.from_array(np.ones(3, np.float32), "spare"))
    out = rewrite(model).model
    assert {t.name for t in out.graph.initializer} >= {"spare"}
    assert not {"eps", "two"} & {t.name for t in out.graph.initializer}


@pytest.mark.parametrize("escaping", ["float[2,4,1] v", "float[2,4,8] p"], ids=["variance", "square"])
def test_escaping_intermediate_blocks_fusion(escaping):
    """The variance (or the squared deviations) is also a graph output: fusing would lose it, so
    the pattern stays."""
    model = residual_block(LAYERNORM, 17, outputs=f"float[2,4,8] y, {escaping}")
    result = rewrite(model)
    assert not result.log.fusions
    assert nodes_by_type(result.model, "ReduceMean") and len(result.log.islands) == 1
    full_check(result.model)


@pytest.mark.parametrize("opset", [13, 17])
def test_fuse_false_keeps_the_island(opset):
    """At opset 17+ onnxruntime's LayerNormFusion refuses that island (test_properties'
    test_known_ort_layernorm_fusion_issue): the summary says so, with the way out."""
    result = rewrite(residual_block(LAYERNORM, opset), fuse=False)
    assert not result.log.fusions
    assert [i.pattern for i in result.log.islands] == ["LayerNorm"]
    warned = [n for n in result.log.notes if n.startswith("onnxruntime:")]
    assert bool(warned) is (opset >= 17) and (not warned or "without --no-fuse" in warned[0])
    assert bool(warned) is ("onnxruntime:" in result.report.summary_text())


def test_node_rule_on_a_member_blocks_fusion():
    """Below opset 17 (no standard LayerNormalization; onnxruntime fuses into its own, which takes
    mixed types) a pin on a member keeps the decomposition, FP32."""
    result = rewrite(residual_block(LAYERNORM, 13), fp32_nodes=["Sqrt:sd"])
    assert not result.log.fusions
    assert value_types(result.model)["sd"] == FP32


@pytest.mark.parametrize("pin", [{"fp32_nodes": ["Sqrt:sd"]}, {"fp32_ops": ["LayerNormalization"]},
                                 {"fp32_ops": ["Pow"]}],
                         ids=["member pin", "op rule", "member op flag"])
def test_a_layernorm_kept_fp32_at_opset_17_is_fused_fp32_and_loads(pin):
    """Left decomposed, the FP32 island (Cast, ReduceMean, Sub, ...) met onnxruntime's own
    LayerNormFusion, which folded the Cast into a LayerNormalization of FP16 X and FP32 scale and
    then refused the model ('bound to different types'). It is fused into an FP32
    LayerNormalization instead, which says why, and a pin naming a member still names it."""
    model = residual_block(LAYERNORM, 17)
    result = rewrite(model, **pin)
    out = result.model
    full_check(out)
    node = only(out, "LayerNormalization")
    [fusion] = result.log.fusions
    decision = result.log.decisions[fusion.node]
    assert decision.precision == Precision.FP32 and "fused to stay FP32" in decision.reason
    assert value_types(out)[node.output[0]] == FP32 and names(node.input) == ["r", "g", "b"]
    assert not [n for n in result.log.notes if n.startswith("unmatched")]
    ref, got = run(model, feeds())["y"], run(out, feeds())["y"]  # (onnxruntime, default optimisations)
    assert rel_err(ref, got) < 1e-2
    again = rewrite(out)
    assert not again.modified


@pytest.mark.parametrize("pin, opset, kept", [({"fp32_ops": ["Pow"]}, 13, FP32), ({"fp16_ops": ["ReduceMean"]}, 17, FP16),
                                              ({"fp16_ops": ["ReduceMean"]}, 13, FP16)])
def test_an_op_flag_naming_a_member_pins_the_pattern_as_a_node_pin_does(pin, opset, kept):
    """--fp32-ops Pow / --fp16-ops ReduceMean named ops the fusion then removed: the pin was
    dropped and the summary said the model had no such op. A flag on a member now keeps the
    pattern as written (or, FP32 at opset 17+, fused FP32: the test above), as a node pin does."""
    result = rewrite(residual_block(LAYERNORM, opset), **pin)
    assert not result.log.fusions
    [op] = [*pin.values()][0]
    assert {value_types(result.model)[n.output[0]] for n in nodes_by_type(result.model, op)} == {kept}
    assert not [n for n in result.log.notes if n.startswith("unmatched")]
    full_check(result.model)


@pytest.mark.parametrize("pin, opset", [({"fp32_nodes": ["Sqrt:sd"]}, 13), ({"fp16_nodes": ["Add:ln"]}, 17)])
def test_a_pattern_a_pin_kept_unfused_stays_so_in_a_rewrite_of_the_output(pin, opset):
    """--fp16-nodes on the LayerNorm's last Add kept the pattern unfused, with a Cast before that
    Add; rewriting the output without the flag found a smaller LayerNorm (up to the Cast) and
    fused it. The members are tagged, and a rewrite of the output keeps them as they are."""
    first = rewrite(residual_block(LAYERNORM, opset), **pin)
    assert not first.log.fusions
    again = rewrite(first.model)
    assert not again.log.fusions and not again.modified
    assert again.model.SerializeToString() == first.model.SerializeToString()


@pytest.mark.parametrize("opset", [13, 17])
def test_a_no_fuse_output_rewritten_again_stays_unfused(opset):
    """A --no-fuse output rewritten with the default options fused its LayerNorm islands then (FP32
    SkipLayerNormalization at opset 13, its casts kept): the output changed. --no-fuse is remembered
    as a pin is."""
    first = rewrite(residual_block(LAYERNORM, opset), fuse=False)
    assert not first.log.fusions and first.log.islands
    tags = [{p.key: p.value for p in n.metadata_props} for n in first.model.graph.node if n.op_type == "ReduceMean"]
    assert tags and all(t.get("amp_rewrite.unfused") == "--no-fuse" for t in tags)
    again = rewrite(first.model)
    assert not again.log.fusions and not again.modified
    assert again.model.SerializeToString() == first.model.SerializeToString()
    assert rewrite(residual_block(LAYERNORM, opset)).log.fusions  # (the input itself still fuses)


@pytest.mark.parametrize("opset", [13, 17])
def test_weight_bytes_before_count_the_constants_a_fusion_removes(opset):
    """The report's weights.bytes_before left out a fused pattern's Constant nodes (the epsilon and
    the exponent a TorchScript export writes as Constant nodes): they were gone when it counted."""
    from onnx import numpy_helper

    norm = ("\n      two_c = Constant<value = float {2.0}>()\n      eps_c = Constant<value = float {1e-5}>()"
            + LAYERNORM.replace("Pow(d, two)", "Pow(d, two_c)").replace("Add(v, eps)", "Add(v, eps_c)"))
    model = residual_block(norm, opset)
    result = rewrite(model)
    assert result.log.fusions and not nodes_by_type(result.model, "Constant")
    before = sum(numpy_helper.to_array(t).nbytes for t in model.graph.initializer) + sum(
        numpy_helper.to_array(a.t).nbytes for n in model.graph.node if n.op_type == "Constant" for a in n.attribute)
    assert result.log.weights.bytes_before == before


@pytest.mark.parametrize("opset", [13, 17])
def test_weight_bytes_after_leave_out_the_initializers_a_fusion_removes(opset):
    """A fused pattern's epsilon and exponent initializers leave the model with it: the report's
    weights.bytes_after is what the output holds."""
    from onnx import numpy_helper

    model = residual_block(LAYERNORM, opset)
    result = rewrite(model)
    out = result.model
    assert result.log.fusions and not {"eps", "two"} & {t.name for t in out.graph.initializer}
    after = sum(numpy_helper.to_array(t).nbytes for t in out.graph.initializer) + sum(
        numpy_helper.to_array(a.t).nbytes for n in out.graph.node if n.op_type == "Constant" for a in n.attribute)
    assert result.log.weights.bytes_after == after


@pytest.mark.parametrize("keep_io_types", [True, False])
def test_a_user_allow_rule_for_layernormalization_applies_to_the_fused_op(tmp_path, keep_io_types):
    """A rule file's [allow] LayerNormalization (no accumulates_fp32 flag): the fused op was kept FP32
    for want of the flag, and a rewrite of the output, where it is a LayerNormalization like any
    other, made it low: not a no-op. The user's allow makes the fused op low the first time."""
    rules = tmp_path / "r.toml"
    rules.write_text('[allow]\nLayerNormalization = "we want it low"\n')
    model = make_model("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[2,4,8] x) => (float[2,4,8] ln, float[2,4,8] z) {
      r = Exp(x)""" + LAYERNORM + """
      z = MatMul(x, wo)
    }""", W)
    first = rewrite(model, rules=[str(rules)], keep_io_types=keep_io_types)
    [fused] = nodes_by_type(first.model, "LayerNormalization")
    assert first.log.decisions[fused.name].precision == Precision.LOW
    assert "allow.LayerNormalization" in first.log.decisions[fused.name].source
    full_check(first.model)
    again = rewrite(first.model, rules=[str(rules)], keep_io_types=keep_io_types)
    assert not again.modified


def test_a_user_infer_rule_without_accumulates_fp32_keeps_the_fused_layernorm_fp32(tmp_path):
    """A rule file's [infer] LayerNormalization without accumulates_fp32 promises no FP32 statistics:
    the fused LayerNormalization stays FP32, an island (unguarded, the fuse would make it low, its
    statistics in FP16)."""
    rules = tmp_path / "r.toml"
    rules.write_text('[infer]\nLayerNormalization = { reason = "my kernel, statistics in the input type" }\n')
    model = make_model("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[2,4,8] x) => (float[2,4,8] y) {
      r = MatMul(x, wq)""" + LAYERNORM + """
      y = MatMul(ln, wo)
    }""", W)
    result = rewrite(model, rules=[str(rules)])
    full_check(result.model)
    [fused] = nodes_by_type(result.model, "LayerNormalization")
    assert result.log.decisions[fused.name].precision == Precision.FP32
    assert value_types(result.model)[fused.input[0]] == value_types(result.model)[fused.output[0]] == FP32
    assert len(result.log.islands) == 1
    ref, got = run(model, feeds(300.0))["y"], run(result.model, feeds(300.0))["y"]
    assert rel_err(ref, got) < 1e-2


@pytest.mark.parametrize("pin", [{}, {"fp16_ops": ["Sub"]}, {"fp16_nodes": ["Sub:d"]}])
def test_a_layernorm_whose_centred_value_is_read_outside_fuses_its_rmsnorm_tail(pin):
    """d = x - mean also read outside the pattern: the LayerNorm cannot be fused, and its tail (an
    RMSNorm of d) was left an FP32 island; with d made low by a pin, a rewrite of the output found
    that RMSNorm behind the new Cast and fused it: not a no-op. The tail is fused the first time."""
    model = make_model("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[2,4,8] x) => (float[2,4,8] y, float[2,4,8] other) {
      a = MatMul(x, wi)
      m = ReduceMean<axes=[-1]>(a)
      d = Sub(a, m)
      other = Relu(d)
      p = Pow(d, two)
      v = ReduceMean<axes=[-1]>(p)
      ve = Add(v, eps)
      sd = Sqrt(ve)
      n = Div(d, sd)
      ng = Mul(n, g)
      y = MatMul(ng, wo)
    }""", {**W, "wi": (8, 8)})
    first = rewrite(model, **pin)
    assert [f.pattern for f in first.log.fusions] == ["RMSNorm"]
    assert not nodes_by_type(first.model, "Pow")
    full_check(first.model)
    again = rewrite(first.model, **pin)
    assert not again.modified and not again.log.fusions
    ref, got = run(model, feeds()), run(first.model, feeds())
    assert all(rel_err(ref[k], got[k]) < 1e-2 for k in ("y", "other"))


def test_an_unfusable_layernorm_island_entered_through_a_cast_is_warned_of():
    """An epsilon of 1e5 (the fuse pass takes 0 < eps < 1): the island stays, entered through a Cast,
    and onnxruntime's own LayerNormFusion folds that Cast and refuses the model; only --no-fuse had
    the "onnxruntime:" line."""
    model = residual_block(LAYERNORM, 17)
    for init in model.graph.initializer:
        if init.name == "eps":
            init.CopyFrom(onnx.numpy_helper.from_array(np.array(1e5, np.float32), "eps"))
    result = rewrite(model)
    assert not result.log.fusions and result.log.islands
    [note] = [n for n in result.log.notes if n.startswith("onnxruntime:")]
    assert "LayerNorm island(s) entered through a Cast (a form the fuse pass does not take" in note


def test_no_onnxruntime_warning_for_a_channels_first_layernorm():
    """ConvNeXt's LayerNorm over the channel axis (means over axis 1 of [N, C, H, W]): the fuse
    pass does not take it, and the summary said onnxruntime's LayerNormFusion would fold the Cast
    into it and refuse the model. onnxruntime fuses means ending at the last axis only: it loads."""
    rng = np.random.default_rng(0)
    model = make_model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[1,8,4,4] x) => (float[1,8,4,4] y) {
          a = Conv(x, w1)
          m = ReduceMean<axes=[1]>(a)
          d = Sub(a, m)
          p = Pow(d, two)
          v = ReduceMean<axes=[1]>(p)
          ve = Add(v, eps)
          sd = Sqrt(ve)
          n = Div(d, sd)
          ng = Mul(n, g)
          nb = Add(ng, b)
          y = Conv(nb, w2)
        }""", {"w1": (rng.standard_normal((8, 8, 1, 1)) * 0.3).astype(np.float32),
               "w2": (rng.standard_normal((8, 8, 1, 1)) * 0.3).astype(np.float32),
               "two": np.array(2.0, np.float32), "eps": np.array(1e-6, np.float32),
               "g": np.ones((8, 1, 1), np.float32), "b": np.zeros((8, 1, 1), np.float32)})
    result = rewrite(model)
    assert result.log.islands and any(i.casts_in for i in result.log.islands)
    assert not [n for n in result.log.notes if n.startswith("onnxruntime:")]
    full_check(result.model)
    x = rng.standard_normal((1, 8, 4, 4)).astype(np.float32)
    assert rel_err(run(model, {"x": x})["y"], run(result.model, {"x": x})["y"]) < 1e-2


@pytest.mark.parametrize("read_outside", ["Reciprocal", "graph output"])
def test_no_onnxruntime_warning_where_its_fusion_cannot_take_the_island(read_outside):
    """onnxruntime's LayerNormFusion fuses only where the statistics are read by the pattern
    alone; a training graph's backward pass reads the deviation too (a Reciprocal of it). The
    warning said the model would be refused, but it loads and runs at every level."""
    if read_outside == "Reciprocal":
        model = residual_block(LAYERNORM + "\n      out = Reciprocal(sd)", 17,
                               outputs="float[2,4,8] y, float[2,4,1] out")
    else:
        model = residual_block(LAYERNORM, 17, outputs="float[2,4,8] y, float[2,4,1] sd")
    for init in model.graph.initializer:
        if init.name == "eps":
            init.CopyFrom(onnx.numpy_helper.from_array(np.array(1e5, np.float32), "eps"))
    result = rewrite(model)
    assert result.log.islands and any(i.casts_in for i in result.log.islands)
    assert not [n for n in result.log.notes if n.startswith("onnxruntime:")]
    full_check(result.model)
    import onnxruntime as ort

    ort.InferenceSession(result.model.SerializeToString(), providers=["CPUExecutionProvider"])  # (loads)


def test_no_allow_op_means_no_fusion():
    text = """
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[2,4,8] r) => (float[2,4,8] ln) {""" + LAYERNORM + """
    }"""
    model = make_model(text, W)
    result = rewrite(model)
    assert not result.modified and not result.log.fusions
    assert result.model == model


def test_bf16_target_fuses_too():
    result = rewrite(residual_block(LAYERNORM, 17), target="bf16")
    only(result.model, "LayerNormalization")
    full_check(result.model)
    assert not result.log.islands


def test_fusions_are_in_the_report_and_rebuilt_from_the_model():
    result = rewrite(residual_block(LAYERNORM, 13))
    report = Report.from_log(result.log)
    assert report.summary()["fusions"] == 1
    assert "fused: 1 LayerNorm → SkipLayerNormalization" in report.summary_text()
    [fusion] = report.to_dict()["fusions"]
    assert fusion["op"] == "com.microsoft::SkipLayerNormalization"
    rebuilt = Report.from_model(result.model)
    assert rebuilt.to_dict()["fusions"] == report.to_dict()["fusions"]
    node = rebuilt.log.decisions[fusion["node"]]
    assert node.precision.value == "low" and node.source.endswith("infer.com.microsoft:SkipLayerNormalization")


def test_shape_proof_hands_its_shapes_to_the_size_estimates():
    """The symbolic shapes computed for a skip proof stay on the model for the optimal placement."""
    from amp_rewrite.api import make_context
    from amp_rewrite.frontends.onnx_fuse import fuse
    from amp_rewrite.frontends.onnx_loader import load_onnx

    model = load_onnx(residual_block(LAYERNORM, 13))
    fuse(model, make_context(frontend="onnx"))
    table = model.meta.get("amp.symbolic_shapes")
    assert table and all(isinstance(shape, tuple) for shape in table.values())
    late = load_onnx(residual_block(LAYERNORM, 17))  # LayerNormalization exists: no proof, no table
    fuse(late, make_context(frontend="onnx"))
    assert "amp.symbolic_shapes" not in late.meta


def test_shape_proof_writes_nothing_to_the_working_directory(tmp_path, monkeypatch):
    """onnxruntime's symbolic shape inference saves sym_shape_infer_temp.onnx (and data files) to
    the working directory when it cannot finish, as it cannot here (two unrelated symbols are
    broadcast); a rewrite writes nothing but its output."""
    model = make_model(_two_input_dims_residual(LAYERNORM), W)
    monkeypatch.chdir(tmp_path)
    result = rewrite(model)
    assert list(tmp_path.iterdir()) == []
    full_check(result.model)


def test_shape_proof_reads_the_structure_not_the_weights(monkeypatch):
    """The skip proof hands shape inference the model as read with its weights as
    graph inputs of their type and shape (the tool copies its input whole): the model is not
    serialised again, no weight data reaches the tool, and the proof holds whatever the weights
    weigh (before, the model was serialised for it, and one over 256 MB of weights never fused)."""
    import onnx_ir

    from amp_rewrite.frontends import onnx_fuse

    text = """
    <ir_version: 8, opset_import: ["" : 13]>
    g (float[batch,seq,64] x) => (float[batch,seq,64] y) {
      q = MatMul(x, wq)
      r = Add(q, x)""" + LAYERNORM + """
      y = MatMul(ln, wo)
    }"""
    weights = {"wq": (64, 64), "wo": (64, 64), "g": np.linspace(0.5, 1.5, 64, dtype=np.float32),
               "b": np.linspace(-0.1, 0.1, 64, dtype=np.float32), "two": np.array(2.0, np.float32),
               "eps": np.array(1e-5, np.float32)}
    model = make_model(text, weights)
    seen: list[onnx.ModelProto] = []
    real = onnx_fuse.SymbolicShapes._structure

    def recording(self):
        seen.append(real(self))
        return seen[-1]

    def no_serialise(*args, **kwargs):
        raise AssertionError("the model was serialised for the shape proof")

    monkeypatch.setattr(onnx_fuse.SymbolicShapes, "_structure", recording)
    from amp_rewrite.api import make_context
    from amp_rewrite.frontends.onnx_loader import load_onnx

    ir_model = load_onnx(model)
    monkeypatch.setattr(onnx_ir.serde, "serialize_model", no_serialise)
    onnx_fuse.fuse(ir_model, make_context(frontend="onnx"))
    monkeypatch.undo()
    assert seen, "no shape proof ran"
    proof = seen[0]
    assert {t.name for t in proof.graph.initializer} == {"g", "b", "two", "eps"}  # 64 elements or fewer
    inputs = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim] for v in proof.graph.input}
    assert inputs["wq"] == inputs["wo"] == [64, 64]
    assert [n.op_type for n in ir_model.graph.nodes].count("SkipLayerNormalization") == 1
    result = rewrite(model)  # and end to end: fused, checked, close to FP32
    only(result.model, "SkipLayerNormalization", "com.microsoft")
    full_check(result.model)
    x = {"x": np.random.default_rng(0).standard_normal((2, 4, 64)).astype(np.float32)}
    assert rel_err(run(result.model, x)["y"], run(model, x)["y"]) < 1e-2


# input_ids -> Reshape(ids, [-1, seq]) -> embedding Gather, as GPT-2's TorchScript export does: onnx
# cannot say what the -1 is (a fresh symbol), onnxruntime's symbolic inference works out "batch"
RESHAPED_EMBEDDING = """
    <ir_version: 8, opset_import: ["" : 13]>
    g (int64[batch,seq] ids, float[batch,seq,8] h) => (float[batch,seq,8] y) {
      shape = Shape(ids)
      second = Constant<value = int64 {1}>()
      s = Gather<axis=0>(shape, second)
      zero = Constant<value = int64[1] {0}>()
      s1 = Unsqueeze(s, zero)
      minus = Constant<value = int64[1] {-1}>()
      target = Concat<axis=0>(minus, s1)
      flat = Reshape(ids, target)
      e = Gather<axis=0>(emb, flat)
      q = MatMul(e, wq)
      r = Add(q, h)""" + LAYERNORM + """
      y = MatMul(ln, wo)
    }"""


def _proof_engines(monkeypatch, *, onnxruntime: bool = True) -> list[str]:
    """Record which shape inferences the skip proof ran; ``onnxruntime=False``: its finds nothing."""
    from amp_rewrite.frontends import onnx_fuse

    ran: list[str] = []
    first, second = onnx_fuse.SymbolicShapes._onnx_inference, onnx_fuse.SymbolicShapes._onnxruntime_inference

    def by_onnx(self):
        ran.append("onnx")
        return first(self)

    def by_onnxruntime(self):
        ran.append("onnxruntime")
        return second(self) if onnxruntime else {}

    monkeypatch.setattr(onnx_fuse.SymbolicShapes, "_onnx_inference", by_onnx)
    monkeypatch.setattr(onnx_fuse.SymbolicShapes, "_onnxruntime_inference", by_onnxruntime)
    return ran


def test_shape_proof_by_onnx_inference_needs_no_onnxruntime_run(monkeypatch):
    """Where onnx's inference (with data propagation, in C++) proves the residual operands equal,
    onnxruntime's symbolic inference (tens of milliseconds of sympy even on a small model) is not
    run: the dynamo exporter's graphs and the opset-17 RMSNorm models are proven this way."""
    model = residual_block(LAYERNORM, 13, outputs="float[batch,seq,8] y")
    for dim, name in zip(model.graph.input[0].type.tensor_type.shape.dim, ("batch", "seq")):
        dim.dim_param = name  # symbolic batch and sequence, as exporters write them
    ran = _proof_engines(monkeypatch)
    result = rewrite(model)
    only(result.model, "SkipLayerNormalization", "com.microsoft")
    assert ran == ["onnx"]
    check_fused(model, result)


def test_shape_proof_falls_back_to_onnxruntime_inference(monkeypatch):
    """onnx cannot name the embedding's batch dim (a Reshape to -1), so the residual operands
    (?, seq, 8) and (batch, seq, 8) are not proven equal by it; onnxruntime's symbolic inference
    works the -1 out as batch and the skip op is made. Without that second inference nothing is
    proven and the normalisation stays an FP32 island."""
    model = make_model(RESHAPED_EMBEDDING, {**W, "emb": (16, 8)})
    ran = _proof_engines(monkeypatch)
    result = rewrite(model)
    assert ran == ["onnx", "onnxruntime"]
    only(result.model, "SkipLayerNormalization", "com.microsoft")
    full_check(result.model)
    rng = np.random.default_rng(0)
    feeds = {"ids": rng.integers(0, 16, (2, 4)).astype(np.int64),
             "h": rng.standard_normal((2, 4, 8)).astype(np.float32)}
    assert rel_err(run(model, feeds)["y"], run(result.model, feeds)["y"]) < 1e-2
    assert not rewrite(result.model).modified
    monkeypatch.undo()
    ran = _proof_engines(monkeypatch, onnxruntime=False)
    unproven = rewrite(model)
    assert ran == ["onnx", "onnxruntime"]
    assert not nodes_by_type(unproven.model, "SkipLayerNormalization") and unproven.log.islands


def test_the_source_proto_is_let_go_after_the_passes():
    """The proto kept for the shape proof would otherwise hold every FP32 weight through the save
    once the converted copies replace them (a model whose weights are all converted: densenet121
    peaked 32 MB higher, its weights' size, while it was kept)."""
    from amp_rewrite.api import make_context, run_pipeline
    from amp_rewrite.frontends.onnx_loader import load_onnx

    model = load_onnx(residual_block(LAYERNORM, 13))
    assert model.origin.proto is not None
    run_pipeline(model, make_context(frontend="onnx"))
    assert model.origin.proto is None
    assert any(n.op_type == "SkipLayerNormalization" for n in model.graph.nodes)  # (the proof had it)


def _branch_model(opset: int, *, split: bool) -> onnx.ModelProto:
    """A LayerNorm inside an If branch: ``split`` puts its mean and Sub in the main graph (the
    branch reads d from outside); else the whole norm is in the branch, over a residual sum made in
    the main graph."""
    lines = [line.strip() for line in LAYERNORM.strip().splitlines()]
    outer, inner = (lines[:2], lines[2:]) if split else ([], lines)
    body = "\n".join(inner)
    return make_model(f"""
    <ir_version: 8, opset_import: ["" : {opset}]>
    g (float[2,4,8] x, bool c) => (float[2,4,8] y) {{
      q = MatMul(x, wq)
      r = Add(q, x)
      {" ".join(outer)}
      y = If(c) <then_branch = t () => (float[2,4,8] t_out) {{
          {body}
          t_out = MatMul(ln, wo)
        }}, else_branch = e () => (float[2,4,8] e_out) {{
          e_out = Identity(r)
        }}>
    }}""", W)


@pytest.mark.parametrize("opset, split", [(17, True), (13, False)], ids=["pattern-across-if", "outer-residual-sum"])
def test_a_pattern_never_spans_an_if_boundary(opset, split):
    """A LayerNorm split across an If branch's boundary, or one inside a branch over a residual sum
    made outside it: the fuse pass took members (or the sum) from two scopes and crashed with
    KeyError (exit 70)."""
    model = _branch_model(opset, split=split)
    result = rewrite(model)
    full_check(result.model)
    assert [n.op_type for n in result.model.graph.node if n.op_type == "Add"] == ["Add"]  # the outer sum stays
    assert all("Add:r" not in f.members for f in result.log.fusions)
    for c in (True, False):
        inputs = {**feeds(), "c": np.array(c)}
        assert rel_err(run(model, inputs)["y"], run(result.model, inputs)["y"]) < 1e-2


def test_a_higher_rank_eps_or_coefficient_is_not_fused(monkeypatch):
    """An eps of shape (1, 1, 1, 1) on a rank-3 input makes the pattern's output rank 4; the fused
    op's output was rank 3 (the declared output stayed [1, 2, 4, 8]). (Run without onnxruntime's
    graph optimisations: its own LayerNormFusion drops the rank the same way on the FP16 model.)"""
    from tools.ortrun import OPT_LEVEL_ENV

    monkeypatch.setenv(OPT_LEVEL_ENV, "disable")
    model = standalone_norm(LAYERNORM, 13)
    model.graph.initializer.remove(next(t for t in model.graph.initializer if t.name == "eps"))
    model.graph.initializer.append(onnx.numpy_helper.from_array(np.full((1, 1, 1, 1), 1e-5, np.float32), "eps"))
    model.graph.ClearField("output")
    model.graph.output.append(onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 2, 4, 8]))
    result = rewrite(model)
    full_check(result.model)
    assert not result.log.fusions
    assert run(result.model, feeds())["y"].shape == run(model, feeds())["y"].shape == (1, 2, 4, 8)


@pytest.mark.parametrize("norm, opset", [(LAYERNORM, 13), (RMSNORM, 17)], ids=["layernorm-op13", "rmsnorm-op17"])
def test_a_broadcast_scale_with_a_symbolic_hidden_dim_is_not_fused_into_a_skip_op(norm, opset):
    """gamma of shape [1] against x of shape (2, 4, H): the skip ops refuse it at run time ('Last
    dimension of gamma and input does not match'); with a static H it was left unfused already."""
    model = make_model(f"""
    <ir_version: 8, opset_import: ["" : {opset}]>
    g (float[2,4,H] x) => (float[2,4,8] y) {{
      r = Relu(x){norm}
      y = MatMul(ln, wo)
    }}""", {**W, "g": np.array([1.5], np.float32)})
    result = rewrite(model)
    full_check(result.model)
    assert not result.log.fusions
    assert rel_err(run(model, feeds())["y"], run(result.model, feeds())["y"]) < 1e-2


def test_constants_in_value_float_shorthand_are_read():
    """A Constant node may hold its scalar as ``value_float`` (onnxscript and hand-written graphs
    write eps and the exponent so); the fuser read only ``value`` and left the LayerNorm an FP32
    island with Casts around it."""
    norm = LAYERNORM.replace("p = Pow(d, two)", "two_c = Constant<value_float=2.0>()\n      p = Pow(d, two_c)") \
        .replace("ve = Add(v, eps)", "eps_c = Constant<value_float=1e-5>()\n      ve = Add(v, eps_c)")
    model = residual_block(norm, 17)
    result = rewrite(model)
    node = only(result.model, "LayerNormalization")
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    assert attrs["epsilon"] == pytest.approx(1e-5)
    check_fused(model, result)


def test_an_fp32_zero_skip_counts_no_value_flushed_to_zero():
    """An RMSNorm of a graph input (greedy: it stays FP32) is fused with a zero skip,
    ConstantOfShape(Shape(x)) with no value. The emitter converted its default float32 zero as if to
    a 16-bit type, and the summary said 1 value was flushed to zero where no weight lost a value."""
    model = make_model(f"""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[2,4,8] r) => (float[2,4,8] y) {{{RMSNORM}
      y = MatMul(ln, wo)
    }}""", W)
    result = rewrite(model, placement="greedy")
    assert result.log.fusions
    fills = nodes_by_type(result.model, "ConstantOfShape")
    assert fills and all(not n.attribute for n in fills)  # (the default float32 zero, as the fuser made it)
    assert result.log.weights.flushed_to_zero == 0


@pytest.mark.parametrize("opset", [13, 17])
def test_an_output_whose_gemms_a_user_pinned_is_not_fused_when_rewritten_again(opset):
    """--fp32-ops MatMul left no GEMM low, so nothing was fused and the output was the input with
    tags. Rewritten again without the flag, the MatMuls stayed FP32 (their tags keep the pin), but
    the fuse pass, which looked at the op rules alone, fused the LayerNorm (FP32 SkipLayerNormalization
    below opset 17): the graph changed, and a contrib op appeared in an all-FP32 model."""
    pinned = rewrite(residual_block(LAYERNORM, opset), fp32_ops=["MatMul"]).model
    again = rewrite(pinned)
    assert not again.modified
    assert again.model.graph == pinned.graph
    assert rewrite(pinned, fp16_ops=["MatMul"]).log.fusions  # (a pin of this run still decides)


@pytest.mark.parametrize("src, warned", [("h", True), ("r", False)])
def test_the_layernorm_fusion_warning_is_given_where_the_cast_makes_x(src, warned):
    """--no-fuse at opset 17: the warning that onnxruntime's LayerNormFusion refuses the output was
    given for any LayerNorm island entered through a Cast, also one into the residual Add before the
    LayerNorm (x + Cast(h): the second LayerNorm of a pre-LN block), whose output loads and runs.
    onnxruntime folds only a Cast that makes the normalised input itself."""
    text = f"""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[2,16] x) => (float[2,16] y) {{
      h = MatMul(x, W0)
      r = Add(x, h)
      mean = ReduceMean<axes=[-1]>({src})
      d = Sub({src}, mean)
      sq = Pow(d, two)
      var = ReduceMean<axes=[-1]>(sq)
      ve = Add(var, eps)
      sd = Sqrt(ve)
      n = Div(d, sd)
      g = Mul(n, gamma)
      ln = Add(g, beta)
      y = MatMul(ln, W1)
    }}"""
    model = make_model(text, {"W0": (16, 16), "W1": (16, 16), "two": np.array(2.0, np.float32),
                              "eps": np.array(1e-5, np.float32), "gamma": np.ones(16, np.float32),
                              "beta": np.zeros(16, np.float32)})
    if src == "h":
        model.graph.node.remove(next(n for n in model.graph.node if n.output[0] == "r"))
    result = rewrite(model, fuse=False)
    assert bool([n for n in result.log.notes if n.startswith("onnxruntime:")]) is warned
    x = {"x": np.random.default_rng(0).standard_normal((2, 16)).astype(np.float32)}
    if not warned:  # (onnxruntime at its extended level, where LayerNormFusion runs: it loads and runs)
        assert rel_err(run(model, x)["y"], run(result.model, x)["y"]) < 1e-2


@pytest.mark.parametrize("opset", [13, 17])
def test_a_dead_noop_cast_of_a_patterns_value_neither_blocks_fusion_nor_breaks_idempotence(opset):
    """A Cast of a LayerNorm's internal value to the type it has, read by nothing, counted as a
    reader outside the pattern: the first rewrite left the pattern unfused and removed the Cast
    (cast placement drops no-op Casts), and the rewrite of its output fused it."""
    model = residual_block(LAYERNORM, opset)
    model.graph.node.append(helper.make_node("Cast", ["n"], ["dead"], to=TensorProto.FLOAT))
    first = rewrite(model)
    assert [f.pattern for f in first.log.fusions] == [f.pattern for f in rewrite(residual_block(LAYERNORM, opset)).log.fusions]
    assert first.log.fusions and not any(o == "dead" for n in first.model.graph.node for o in n.output)
    full_check(first.model)
    again = rewrite(first.model)
    assert not again.modified and again.model.SerializeToString() == first.model.SerializeToString()


@pytest.mark.parametrize("norm, dead_cast", [(RMSNORM, False), (LAYERNORM, True), (RMSNORM, True)])
def test_the_summary_accounts_for_every_cast_the_fusion_took(norm, dead_cast):
    """The summary's Cast counts add up to the output's: an RMSNorm's own Cast went with the fused
    pattern, and a dead no-op Cast the fuse pass dropped, but neither was counted (a T5 export's
    summary said 31 + 1 − 23 where the output had 7)."""
    model = residual_block(norm, 17)
    if dead_cast:
        model.graph.node.append(helper.make_node("Cast", ["n"], ["dead"], to=TensorProto.FLOAT))
    result = rewrite(model)
    report = Report.from_log(result.log)
    s = report.summary()
    before, after = len(nodes_by_type(model, "Cast")), len(nodes_by_type(result.model, "Cast"))
    assert result.log.fusions
    assert after == before + s["casts_inserted"] - s["casts_removed"] - s["casts_fused"]
    assert s["casts_fused"] == (1 if norm is RMSNORM else 0)
    assert s["casts_removed"] == (1 if dead_cast else 0)
    assert ("fused away: 1" in report.summary_text()) == (norm is RMSNORM)
    validate(report.to_dict())


def _norm_look_alike(case: str) -> tuple[onnx.ModelProto, dict]:
    """A decomposed-norm shape that is not a LayerNorm: one guard of the matcher tells it apart."""
    kd = 0 if case == "keepdims" else 1
    axes, n_axes = ("{-1, -2}", 2) if case == "two_axes" else ("{-1}", 1)
    square = {"mul_not_square": "sq = Mul(d, t)",
              "pow_three": "three = Constant <value = float {3.0}> ()\n      sq = Pow(d, three)"}.get(case, "sq = Mul(d, d)")
    scale = ("two = Constant <value = float {2.0}> ()\n  r = Div(two, s)\n  n = Mul(d, r)" if case == "div_by_two"
             else "n = Div(d, s)")
    shape = "[4, 4]" if case == "keepdims" else "[2, 4, 4]"  # (keepdims=0: the statistics broadcast on the last axis)
    text = f"""<ir_version: 8, opset_import: ["" : 18]>
    g (float{shape} x, float{shape} z) => (float{shape} y) {{
      axes = Constant <value = int64[{n_axes}] {axes}> ()
      h = MatMul(z, W)
      xs = Add(x, h)
      t = Relu(z)
      mean = ReduceMean <keepdims = {kd}> ({"t" if case == "other_mean" else "xs"}, axes)
      d = Sub(xs, mean)
      {square}
      var = ReduceMean <keepdims = {kd}> (sq, axes)
      e = Constant <value = float {{1e-5}}> ()
      ve = Add(var, e)
      s = Sqrt(ve)
      {scale}
      sc = Mul(n, G)
      y = MatMul(sc, W2)
    }}"""
    dims = (4, 4) if case == "keepdims" else (2, 4, 4)
    rng = np.random.default_rng(1)
    feeds = {"x": (rng.standard_normal(dims) * 3 + np.arange(4)).astype(np.float32),
             "z": (rng.standard_normal(dims) + 1).astype(np.float32)}
    return make_model(text, {"W": (4, 4), "G": np.ones(4, np.float32), "W2": (4, 4)}), feeds


def _gelu_look_alike(case: str) -> tuple[onnx.ModelProto, dict]:
    text = f"""<ir_version: 8, opset_import: ["" : 17]>
    g (float[2, 8] a, float[2, 8] b) => (float[2, 8] y) {{
      x = MatMul(a, W)
      z = MatMul(b, W)
      three = Constant <value = float {{3.0}}> ()
      cube = Pow(x, three)
      c1 = Constant <value = float {{0.044715}}> ()
      m1 = Mul(cube, c1)
      s1 = Add(m1, {"z" if case == "other_addend" else "x"})
      c2 = Constant <value = float {{0.7978845608}}> ()
      m2 = Mul(s1, c2)
      th = Tanh(m2)
      one = Constant <value = float {{1.0}}> ()
      o = Add(th, one)
      half = Constant <value = float {{{"0.46" if case == "coefficient" else "0.5"}}}> ()
      hx = Mul(x, half)
      g1 = Mul(hx, o)
      y = MatMul(g1, W2)
    }}"""
    rng = np.random.default_rng(1)
    feeds = {k: (rng.standard_normal((2, 8)) * 2).astype(np.float32) for k in ("a", "b")}
    return make_model(text, {"W": (8, 8), "W2": (8, 8)}), feeds


LOOK_ALIKES = [("norm", "keepdims"), ("norm", "two_axes"), ("norm", "mul_not_square"), ("norm", "pow_three"),
               ("norm", "div_by_two"),
               ("norm", "other_mean"), ("gelu", "other_addend"), ("gelu", "coefficient")]


@pytest.mark.parametrize("kind,case", LOOK_ALIKES, ids=[c for _, c in LOOK_ALIKES])
def test_a_look_alike_of_a_norm_or_gelu_is_not_fused(kind, case):
    """Statistics kept per row (keepdims=0 on a square input), a norm over two axes, a 'variance'
    of d·t, d·(2/σ), the mean of another tensor subtracted, a GELU adding another tensor inside
    its tanh or halving by 0.46: each is one guard of the matcher, and a fused op in its place
    computes other numbers (relative errors of 0.09 to 1.07) in a model that passes the checker.
    (With another tensor's mean subtracted, what follows is an RMSNorm of the difference, and that
    is fused: a LayerNorm is not.) A 'variance' of Pow(d, 3) is no square either."""
    model, feeds = (_norm_look_alike if kind == "norm" else _gelu_look_alike)(case)
    result = rewrite(model)
    full_check(result.model)
    assert [f.pattern for f in result.log.fusions] == (["RMSNorm"] if case == "other_mean" else [])
    ops = {n.op_type for n in result.model.graph.node}
    assert not ops & {"LayerNormalization", "SkipLayerNormalization", "Gelu", "FastGelu"}
    want, got = run(model, feeds)["y"], run(result.model, feeds)["y"]
    finite = np.isfinite(want)  # (a 'variance' of d·t may be negative: its root is NaN in FP32 too)
    np.testing.assert_array_equal(finite, np.isfinite(got))
    assert finite.any() and rel_err(want[finite], got[finite]) < 1e-2


def _through_identity(snippet: str, value: str) -> str:
    """``snippet`` with ``value`` read through a new ``Identity`` by the lines after the one that
    makes it (every line, where ``value`` is made before the snippet)."""
    import re

    lines = snippet.split("\n")  # (a norm snippet starts with a newline: lines[0] is empty)
    made = next((i for i, line in enumerate(lines) if line.strip().startswith(f"{value} = ")), 0)
    pattern = re.compile(rf"(?<![\w/]){re.escape(value)}(?![\w/])")
    for i in range(made + 1, len(lines)):
        target, eq, expr = lines[i].partition(" = ")
        if eq:
            lines[i] = target + eq + pattern.sub(f"{value}_i", expr)
    lines.insert(made + 1, f"      {value}_i = Identity({value})")
    return "\n".join(lines)


NORM_EDGES = [(norm, opset, value) for norm, values in ((LAYERNORM, ("r", "m", "d", "p", "v", "ve", "sd", "n", "ng")),
                                                        (RMSNORM, ("rc", "p", "v", "sd", "inv", "n")))
              for opset in (13, 17) for value in values]


@pytest.mark.parametrize("norm,opset,value", NORM_EDGES,
                         ids=[f"{'layernorm' if n is LAYERNORM else 'rmsnorm'}-op{o}-{v}" for n, o, v in NORM_EDGES])
def test_a_norm_is_fused_through_an_identity_on_any_of_its_edges(norm, opset, value):
    """An Identity (the TorchScript exporter writes them; onnxruntime removes them) on an edge of
    a decomposed norm stopped the fusion: the norm stayed an FP32 island with two more Casts, and
    at opset 17, with the Identity after the division, onnxruntime's own LayerNormFusion took the
    island with its entry Cast and refused to load the model ('bound to different types'). The
    Identity now goes with the pattern, and the model is as fused as without it."""
    snippet = _through_identity(norm, value)
    assert f"{value}_i = Identity({value})" in snippet
    model = residual_block(snippet, opset)
    result = rewrite(model)
    [fusion] = result.log.fusions
    assert fusion.pattern == ("LayerNorm" if norm is LAYERNORM else "RMSNorm")
    assert f"Identity:{value}_i" in fusion.members
    assert not nodes_by_type(result.model, "Identity")
    check_fused(model, result, scale=300.0)  # (loads and runs in onnxruntime at its default level)


GELU_EDGES = ["h", "half", "cube", "cubic", "inner", "scaled", "t", "t1"]


@pytest.mark.parametrize("value", GELU_EDGES)
def test_a_tanh_gelu_is_fused_through_an_identity_on_any_of_its_edges(value):
    snippet = _through_identity(GELU.format(opset=13), value)
    model = make_model(snippet, {"wq": (8, 8), "wo": (8, 8), **GELU_CONSTS})
    result = rewrite(model)
    [fusion] = result.log.fusions
    assert fusion.pattern == "tanh-GELU" and f"Identity:{value}_i" in fusion.members
    node = only(result.model, "FastGelu", "com.microsoft")
    assert names(node.input) == ["h"]
    check_fused(model, result, scale=60.0)


def test_an_identity_read_by_the_pattern_and_by_others_stays_and_the_fused_op_reads_its_source():
    """``r_i = Identity(r)`` read by the norm and by the next residual Add: the Identity stays for
    that reader, and the fused op reads ``r`` itself (the same values)."""
    snippet = _through_identity(LAYERNORM, "r")
    model = residual_block(snippet, 17)
    for node in model.graph.node:  # the next residual Add reads r through the Identity too
        if node.op_type == "Add" and list(node.input) == ["h", "r"]:
            node.input[1] = "r_i"
    result = rewrite(model)
    [fusion] = result.log.fusions
    assert "Identity:r_i" not in fusion.members
    assert names(only(result.model, "LayerNormalization").input) == ["r", "g", "b"]
    [identity] = nodes_by_type(result.model, "Identity")
    assert names(identity.input) == ["r"]
    full_check(result.model)
    assert rel_err(run(model, feeds())["y"], run(result.model, feeds())["y"]) < 1e-2
    assert not rewrite(result.model).modified


@pytest.mark.parametrize("opset", [13, 17])
def test_a_constant_read_through_identities_goes_with_the_fusion(opset):
    """eps and the exponent read through Identity nodes (a TorchScript export shares a constant
    that way): the fusion took the pattern but left ``Constant → Identity`` behind, dead, and the
    initializer read only through an Identity was kept (converted to FP16) for it."""
    norm = LAYERNORM.replace("ve = Add(v, eps)", "e0 = Constant<value=float {1e-5}>()\n      e1 = Identity(e0)\n"
                                                 "      e2 = Identity(e1)\n      ve = Add(v, e2)")
    norm = norm.replace("p = Pow(d, two)", "two_i = Identity(two)\n      p = Pow(d, two_i)")
    model = residual_block(norm, opset)
    result = rewrite(model)
    [fusion] = result.log.fusions
    assert {"Constant:e0", "Identity:e1", "Identity:e2", "Identity:two_i"} <= set(fusion.members)
    assert not nodes_by_type(result.model, "Identity") and not nodes_by_type(result.model, "Constant")
    assert "two" not in {t.name for t in result.model.graph.initializer}
    check_fused(model, result)


def test_an_op_flag_naming_the_fused_op_is_said_to_keep_the_patterns_unfused_not_to_match_nothing():
    """--fp32-ops com.microsoft:SkipLayerNormalization declines every skip fusion (BERT: 73 nodes
    more FP32), and the summary said the flag 'names an op this model does not have, so it changes
    nothing': the op is not in the output because the flag kept it out."""
    model = residual_block(LAYERNORM, 13)
    result = rewrite(model, fp32_ops=["com.microsoft:SkipLayerNormalization"])
    assert not result.log.fusions and result.log.islands
    assert not [n for n in result.log.notes if n.startswith("unmatched")]
    assert any(n.startswith("--fp32-ops 'com.microsoft:SkipLayerNormalization': the decomposed patterns")
               for n in result.log.notes)
    elsewhere = rewrite(residual_block(LAYERNORM, 17), fp32_ops=["com.microsoft:SkipLayerNormalization"])
    assert elsewhere.log.fusions  # (opset 17: LayerNormalization, and the flag names an op it never needed)
    assert any(n.startswith("unmatched: --fp32-ops 'com.microsoft:SkipLayerNormalization'") for n in elsewhere.log.notes)


LAYERNORM_NO_BIAS = LAYERNORM.replace("ng = Mul(n, g)\n      ln = Add(ng, b)", "ln = Mul(n, g)")


@pytest.mark.parametrize("case,options,warned", [
    ("whole", {"fuse": False}, True), ("no bias", {"fuse": False}, False),
    ("bias add low", {"fp16_nodes": ["Add:ln"]}, False), ("scale mul low", {"fp16_nodes": ["Mul:ng"]}, False),
    ("mean low", {"fp16_nodes": ["ReduceMean:m"]}, False)])
def test_the_layernorm_fusion_warning_needs_the_whole_pattern_in_the_island(case, options, warned):
    """onnxruntime's LayerNormFusion takes a decomposed LayerNorm with its scale Mul and its bias
    Add only: without the bias, or with a member a --fp16-nodes pin made low (a Cast inside the
    pattern), it fuses nothing and the output loads, and the warning that it refuses the model was
    false (with a cause about epsilons that the model did not have)."""
    model = residual_block(LAYERNORM_NO_BIAS if case == "no bias" else LAYERNORM, 17)
    result = rewrite(model, **options)
    full_check(result.model)
    assert result.log.islands and not result.log.fusions
    notes = [n for n in result.log.notes if n.startswith("onnxruntime:")]
    assert bool(notes) is warned, notes
    if not warned:  # (at onnxruntime's extended level, where LayerNormFusion runs, it loads and runs)
        assert rel_err(run(model, feeds())["y"], run(result.model, feeds())["y"]) < 1e-2
    else:
        with pytest.raises(Exception, match="bound to different types"):
            run(result.model, feeds())


def _stacked_norms(count: int, opset: int = 8) -> onnx.ModelProto:
    chunks, prev = [], "r0"
    for i in range(count):
        text = LAYERNORM
        for v in ["ln", "ng", "n", "sd", "ve", "v", "p", "d", "m"]:
            text = re.sub(rf"\b{v}\b", f"{v}{i}", text)
        chunks.append(re.sub(r"\br\b", prev, text))
        prev = f"ln{i}"
    return make_model(f"""
    <ir_version: 8, opset_import: ["" : {opset}]>
    g (float[2,4,8] x) => (float[2,4,8] y) {{
      r0 = MatMul(x, wq){''.join(chunks)}
      y = MatMul({prev}, wo)
    }}""", W)


@pytest.mark.parametrize("count, more", [(3, ""), (4, "; and 1 more"), (5, "; and 2 more")])
def test_the_not_fused_note_lists_three_patterns_and_counts_the_rest(count, more):
    """Three patterns are shown, the rest counted."""
    note = _not_fused(rewrite(_stacked_norms(count)))
    assert note.startswith(f"not fused: {count} pattern(s) left as written: ")
    assert note.count("(LayerNorm: ") == 3
    assert note.endswith("(opset 9))" + more), note[-60:]


def test_a_tanh_gelu_of_odd_count_left_unfused_is_said_why():
    """The reason names the odd element count, not a missing op."""
    odd = GELU.replace("float[2,4,8] x", "float[3,5,7] x").replace("float[2,4,8] y", "float[3,5,7] y")
    result = rewrite(make_model(odd.format(opset=13), {"wq": (7, 7), "wo": (7, 7), **GELU_CONSTS}))
    assert _not_fused(result).endswith("(tanh-GELU: its element count is not known to be even, and the FP16 GELU "
                                       "kernels skip the last of an odd count)")


def test_a_norm_with_a_computed_scale_left_unfused_is_said_why():
    """Below opset 17 the skip ops take a constant scale and bias only."""
    model = make_model("""
    <ir_version: 8, opset_import: ["" : 13]>
    g (float[2,4,8] x, float[8] g) => (float[2,4,8] y) {
      r = MatMul(x, wq)""" + LAYERNORM + """
      y = MatMul(ln, wo)
    }""", {k: v for k, v in W.items() if k != "g"})
    assert _not_fused(rewrite(model)).endswith(
        "onnxruntime's skip ops take a constant scale and bias only, and this one's are computed)")


def test_a_rank_4_norm_at_opset_9_is_said_to_have_rank_4():
    """At opset 9 the zero skip exists (ConstantOfShape is an opset-9 op): the rank is why."""
    model = make_model("""
    <ir_version: 8, opset_import: ["" : 9]>
    g (float[1,2,4,8] x) => (float[1,2,4,8] y) {
      r = MatMul(x, wq)""" + LAYERNORM + """
      y = MatMul(ln, wo)
    }""", W)
    assert _not_fused(rewrite(model)).endswith("and its input has rank 4)")


# --- onnx_fuse.py: the TorchScript tanh-GELU ---------------------------------------------------------
_GW = {"wq": (8, 8), "wo": (8, 8), **GELU_CONSTS}
_X = {"x": np.random.default_rng(0).standard_normal((2, 4, 8)).astype(np.float32)}


def test_the_torchscript_cube_is_fused_in_either_order():
    """(x * x) * x is the cube as much as x * (x * x)."""
    text = GELU_TORCHSCRIPT.replace("cube = Mul(h, square)", "cube = Mul(square, h)")
    assert [f.op for f in rewrite(make_model(text.format(opset=13), _GW)).log.fusions] == ["com.microsoft::FastGelu"]


@pytest.mark.parametrize("edit", [("square = Mul(h, h)", "square = Mul(h, c_one)"),  # x * (x * 1): no cube
                                  ("act = Mul(c_half, xt)", "act = Mul(c_one, xt)")])  # times 1, not 0.5
def test_a_torchscript_gelu_look_alike_is_not_fused(edit):
    """Look-alikes of the TorchScript spelling are not fused (mutation round: matched, the output was
    4% / 50% off)."""
    model = make_model(GELU_TORCHSCRIPT.replace(*edit).format(opset=13), _GW)
    result = rewrite(model)
    assert not result.log.fusions
    assert rel_err(run(model, _X)["y"], run(result.model, _X)["y"]) < 1e-2


# --- onnx_fuse.py: the zero skip's rank -----------------------------------------------------------
def test_a_rank_4_input_only_the_data_propagating_inference_knows_takes_no_zero_skip():
    """The rank the data-propagating inference finds is taken as found: rank 4 keeps its island."""
    model = make_model("""
    <ir_version: 8, opset_import: ["" : 13]>
    g (float[1,2,4,8] x) => (float[1,2,4,8] y) {
      q = MatMul(x, wq)
      s = Shape(q)
      k = Shape(s)
      e = Sub(k, one)
      h = Slice(s, zero, e)
      t = Concat<axis=0>(h, minus)
      r = Reshape(q, t)""" + LAYERNORM + """
      y = MatMul(ln, wo)
    }""", {**W, "one": np.array([1], np.int64), "zero": np.array([0], np.int64), "minus": np.array([-1], np.int64)})
    result = rewrite(model)
    assert not result.log.fusions
    assert _not_fused(result).endswith("and its input has rank 4)")
