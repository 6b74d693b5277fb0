"""Quantized (QDQ) models: what the rewrite does around QuantizeLinear / DequantizeLinear.

A QDQ node unit (DequantizeLinear → Conv/MatMul → QuantizeLinear, the format onnxruntime's
quantize_static writes) is an int8 op in disguise: runtimes fuse it into QLinearConv or an int8
kernel. Its op stays FP32, with no Cast inside the unit. A GEMM that only reads a dequantized
weight (weight-only quantization) or whose result goes on as a float is painted as usual. A
DequantizeLinear whose schema fixes its output to tensor(float) says so when asked, and a user's
low pin naming it gets a note instead of silence."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP
from onnx import helper as oh
from onnx import numpy_helper as nh

from amp_rewrite.decisions import Precision
from amp_rewrite.explain import explain_node
from tests.util import full_check, rel_err, rewrite, run

C = 8


def _qdq_conv(opset: int, *, tail: str = "q", name_conv: str = "conv") -> onnx.ModelProto:
    """x → Q → DQ → Conv(DQ(int8 weight), DQ(int32 bias)) → ``tail``: "q" (Q → DQ, a full unit),
    "float" (the Conv's output is the graph output) or "relu" (a float Relu reads it)."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((C, C, 3, 3)).astype(np.float32)
    ws = (np.abs(w).reshape(C, -1).max(1) / 127).astype(np.float32)
    s0 = np.float32(0.03)
    inits = [nh.from_array(np.round(w / ws[:, None, None, None]).astype(np.int8), "wq"), nh.from_array(ws, "ws"),
             nh.from_array(np.zeros(C, np.int8), "wz"), nh.from_array(np.array(s0), "s0"),
             nh.from_array(np.array(128, np.uint8), "z0"), nh.from_array(np.array(0.1, np.float32), "s1"),
             nh.from_array(np.array(128, np.uint8), "z1"),
             nh.from_array(rng.integers(-200, 200, C).astype(np.int32), "bq"), nh.from_array(ws * s0, "bs")]
    nodes = [oh.make_node("QuantizeLinear", ["x", "s0", "z0"], ["q0"], name="q0"),
             oh.make_node("DequantizeLinear", ["q0", "s0", "z0"], ["d0"], name="dq0"),
             oh.make_node("DequantizeLinear", ["wq", "ws", "wz"], ["w"], axis=0, name="dqw"),
             oh.make_node("DequantizeLinear", ["bq", "bs"], ["b"], axis=0, name="dqb"),
             oh.make_node("Conv", ["d0", "w", "b"], ["c"], pads=[1, 1, 1, 1], name=name_conv)]
    if tail == "q":
        nodes += [oh.make_node("QuantizeLinear", ["c", "s1", "z1"], ["q1"], name="q1"),
                  oh.make_node("DequantizeLinear", ["q1", "s1", "z1"], ["y"], name="dq1")]
    elif tail == "relu":
        nodes.append(oh.make_node("Relu", ["c"], ["y"], name="relu"))
    else:
        nodes.append(oh.make_node("Identity", ["c"], ["y"], name="out"))
    graph = oh.make_graph(nodes, "qdq", [oh.make_tensor_value_info("x", TP.FLOAT, [1, C, 6, 6])],
                          [oh.make_tensor_value_info("y", TP.FLOAT, [1, C, 6, 6])], inits)
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", opset)], ir_version=8)
    onnx.checker.check_model(model, full_check=True)
    return model


def _feeds() -> dict:
    return {"x": np.random.default_rng(1).uniform(-3, 3, (1, C, 6, 6)).astype(np.float32)}


def _optimized_ops(model: onnx.ModelProto, tmp_path) -> list[str]:
    """The op types onnxruntime (CPU, level EXTENDED: its QDQ fusions) turns ``model`` into; in a
    child process, so that a crash fails this test only."""
    src, dst = tmp_path / "m.onnx", tmp_path / "m.opt.onnx"
    onnx.save(model, src)
    script = textwrap.dedent("""
        import sys, onnxruntime as ort
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
        so.optimized_model_filepath = sys.argv[2]
        ort.InferenceSession(sys.argv[1], so, providers=["CPUExecutionProvider"])
    """)
    subprocess.run([sys.executable, "-c", script, str(src), str(dst)], check=True, timeout=120)
    return [n.op_type for n in onnx.load(str(dst)).graph.node]


@pytest.mark.parametrize("opset", [13, 19, 21])
def test_qdq_unit_keeps_its_op_fp32_and_fusable(opset, tmp_path):
    """Before, the Conv of DQ → Conv → Q was painted FP16 with Casts inside the unit: onnxruntime
    could no longer fuse it into QLinearConv, and the FP16 result was re-quantized into other bins."""
    model = _qdq_conv(opset)
    result = rewrite(model)
    decision = result.log.decisions["conv"]
    assert decision.precision == Precision.FP32
    assert decision.reason.startswith("QDQ node unit")
    out = result.model
    assert not [n for n in out.graph.node if n.op_type == "Cast"]
    full_check(out)
    assert "QLinearConv" in _optimized_ops(out, tmp_path)
    assert "Conv" not in _optimized_ops(out, tmp_path)
    ref, got = run(model, _feeds()), run(out, _feeds())
    np.testing.assert_array_equal(ref["y"], got["y"])  # the unit computes as it did: same bins
    assert rewrite(out).model.SerializeToString() == out.SerializeToString()  # again: nothing changes


def test_qdq_unit_with_a_float_weight_stays_fp32(tmp_path):
    """A layer whose weight and bias quantize_static left float (nodes_to_exclude, or weights not
    quantized) between a DequantizeLinear and a QuantizeLinear: onnxruntime quantizes the weight
    and fuses the unit into QGemm all the same. Before, the Gemm was painted FP16 with a Cast on
    each side, which broke that fusion."""
    rng = np.random.default_rng(0)
    inits = [nh.from_array(np.float32(0.02), "xs"), nh.from_array(np.uint8(128), "xz"),
             nh.from_array(np.float32(0.05), "ys"), nh.from_array(np.uint8(128), "yz"),
             nh.from_array(rng.standard_normal((16, 16)).astype(np.float32) * 0.1, "W"),
             nh.from_array(rng.standard_normal(16).astype(np.float32) * 0.1, "B")]
    nodes = [oh.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"], name="q_in"),
             oh.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xd"], name="dq_in"),
             oh.make_node("Gemm", ["xd", "W", "B"], ["g"], name="gemm", transB=1),
             oh.make_node("QuantizeLinear", ["g", "ys", "yz"], ["gq"], name="q_out"),
             oh.make_node("DequantizeLinear", ["gq", "ys", "yz"], ["y"], name="dq_out")]
    graph = oh.make_graph(nodes, "g", [oh.make_tensor_value_info("x", TP.FLOAT, [4, 16])],
                          [oh.make_tensor_value_info("y", TP.FLOAT, [4, 16])], inits)
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 19)], ir_version=9)
    result = rewrite(model)
    assert result.log.decisions["gemm"].reason.startswith("QDQ node unit")
    assert not [n for n in result.model.graph.node if n.op_type == "Cast"]
    assert "QGemm" in _optimized_ops(result.model, tmp_path)


def test_a_constant_only_op_before_a_quantize_is_no_unit():
    """No input dequantized (a float weight transformed, then quantized): painted as usual."""
    graph = oh.make_graph([oh.make_node("Relu", ["w"], ["r"], name="relu"),
                           oh.make_node("QuantizeLinear", ["r", "s"], ["q"], name="q"),
                           oh.make_node("DequantizeLinear", ["q", "s"], ["d"], name="dq"),
                           oh.make_node("MatMul", ["x", "d"], ["y"], name="mm")], "c",
                          [oh.make_tensor_value_info("x", TP.FLOAT, [4, 8])],
                          [oh.make_tensor_value_info("y", TP.FLOAT, [4, 8])],
                          [nh.from_array(np.eye(8, dtype=np.float32), "w"), nh.from_array(np.float32(0.1), "s")])
    result = rewrite(oh.make_model(graph, opset_imports=[oh.make_opsetid("", 19)], ir_version=9))
    assert not result.log.decisions["relu"].reason.startswith("QDQ node unit")
    assert result.log.decisions["mm"].precision == Precision.LOW


def test_qdq_unit_is_listed_as_kept_fp32_in_the_summary():
    report_text = _summary(_qdq_conv(19))
    assert "MatMul/Gemm/Conv/attention in fp16: 0 of 1" in report_text
    assert "kept FP32: conv (Conv): QDQ node unit" in report_text


def _summary(model) -> str:
    from amp_rewrite.report import Report

    return Report.from_log(rewrite(model).log).summary_text()


@pytest.mark.parametrize("tail", ["float", "relu"])
def test_dequantized_inputs_read_by_float_ops_are_painted(tail):
    """No QuantizeLinear reads the Conv: no unit to keep, so the Conv runs low like any other."""
    model = _qdq_conv(19, tail=tail)
    result = rewrite(model)
    assert result.log.decisions["conv"].precision == Precision.LOW
    full_check(result.model)
    assert rel_err(run(model, _feeds())["y"], run(result.model, _feeds())["y"]) < 1e-2


def test_a_quantized_conv_whose_output_is_also_a_graph_output_is_no_unit():
    """DQ → Conv → Q with the Conv's float output also a graph output: onnxruntime cannot fuse
    a unit whose output leaves the graph, so it is no QDQ unit and the Conv runs low like any
    other, its graph output kept FP32."""
    model = _qdq_conv(19, tail="q")
    model.graph.output.append(oh.make_tensor_value_info("c", TP.FLOAT, [1, C, 6, 6]))
    result = rewrite(model)
    decision = result.log.decisions["conv"]
    assert decision.precision == Precision.LOW and not decision.reason.startswith("QDQ node unit")
    out = result.model
    full_check(out)
    assert [o.type.tensor_type.elem_type for o in out.graph.output] == [TP.FLOAT, TP.FLOAT]
    assert rel_err(run(model, _feeds())["c"], run(out, _feeds())["c"]) < 1e-2


def test_weight_only_quantized_matmul_is_painted():
    """A float activation times a dequantized int8 weight (weight-only quantization): not a unit."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((16, 16)).astype(np.float32)
    scale = (np.abs(w).max(0) / 127).astype(np.float32)
    inits = [nh.from_array(np.round(w / scale).astype(np.int8), "wq"), nh.from_array(scale, "ws")]
    nodes = [oh.make_node("DequantizeLinear", ["wq", "ws"], ["w"], axis=1, name="dqw"),
             oh.make_node("MatMul", ["x", "w"], ["m"], name="mm"),
             oh.make_node("QuantizeLinear", ["m", "s"], ["q"], name="q"),
             oh.make_node("DequantizeLinear", ["q", "s"], ["y"], name="dq")]
    inits.append(nh.from_array(np.array(0.05, np.float32), "s"))
    graph = oh.make_graph(nodes, "wo", [oh.make_tensor_value_info("x", TP.FLOAT, [4, 16])],
                          [oh.make_tensor_value_info("y", TP.FLOAT, [4, 16])], inits)
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 19)], ir_version=9)
    result = rewrite(model)
    assert result.log.decisions["mm"].precision == Precision.LOW
    full_check(result.model)


def test_node_rule_can_still_make_a_unit_low():
    """A --fp16-nodes pin naming the op is the user's explicit choice: it wins over the unit."""
    result = rewrite(_qdq_conv(19), fp16_nodes=["conv"])
    assert result.log.decisions["conv"].precision == Precision.LOW
    full_check(result.model)


def test_fixed_type_dequantize_explains_why_it_stays_fp32(tmp_path):
    """DequantizeLinear-13's output is tensor(float) by its schema: --explain said "no FP32 float
    tensor to paint" (it writes one), and a --fp16-nodes pin naming it was dropped in silence."""
    path = tmp_path / "q13.onnx"
    onnx.save(_qdq_conv(13, tail="float"), path)
    text = explain_node(path, "dq0", fp16_nodes=["dq0"])
    assert "no FP32 float tensor" not in text
    assert "DequantizeLinear schema at opset 13 types its float tensors tensor(float)" in text
    for options, pin in (({"fp16_nodes": ["dq0"]}, "--fp16-nodes 'dq0'"),
                         ({"fp16_ops": ["DequantizeLinear"]}, "--fp16-ops 'DequantizeLinear'")):
        notes = [n for n in rewrite(_qdq_conv(13, tail="float"), **options).log.notes if n.startswith("without effect")]
        assert len(notes) == 1 and notes[0].startswith(f"without effect: {pin} names ")
        assert "'dq0'" in notes[0]


def test_no_note_without_a_pin():
    assert not [n for n in rewrite(_qdq_conv(13, tail="float")).log.notes if n.startswith("without effect")]


# -- weight-only quantization: a DequantizeLinear of a constant weight ------------------------------
K, N, BLOCK = 64, 32, 32


def _int4_matmul(*, relu: bool = False, extra_reader: bool = False, opset: int = 21,
                 weight_scale: float = 1.0) -> onnx.ModelProto:
    """x @ DQ(int4 weight, block-quantized along axis 0, block 32): what onnxruntime's
    matmul_nbits_quantizer writes in QDQ format, and what it fuses into MatMulNBits."""
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((K, N)) * weight_scale).astype(np.float32)
    scale = (np.abs(w).reshape(K // BLOCK, BLOCK, N).max(1) / 7).astype(np.float32)
    q = np.clip(np.round(w / np.repeat(scale, BLOCK, 0)), -8, 7).astype(np.int8)
    inits = [oh.make_tensor("wq", TP.INT4, [K, N], q.flatten().tolist()), nh.from_array(scale, "ws")]
    nodes = [oh.make_node("DequantizeLinear", ["wq", "ws"], ["w"], axis=0, block_size=BLOCK, name="dqw"),
             oh.make_node("MatMul", ["x", "w"], ["m"], name="mm")]
    outputs = [oh.make_tensor_value_info("y", TP.FLOAT, [4, N])]
    nodes.append(oh.make_node("Relu" if relu else "Identity", ["m"], ["y"], name="tail"))
    if extra_reader:  # the dequantized weight is also an operand of float arithmetic
        nodes.append(oh.make_node("ReduceSum", ["w"], ["wsum"], keepdims=0, name="wsum"))
        outputs.append(oh.make_tensor_value_info("wsum", TP.FLOAT, []))
    graph = oh.make_graph(nodes, "int4", [oh.make_tensor_value_info("x", TP.FLOAT, [4, K])], outputs, inits)
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", opset)], ir_version=10)
    onnx.checker.check_model(model, full_check=True)
    return model


def _x() -> dict:
    return {"x": np.random.default_rng(2).standard_normal((4, K)).astype(np.float32)}


@pytest.mark.parametrize("placement", ["greedy", "optimal"])
def test_weight_dequantize_runs_low_with_its_matmul(placement, tmp_path, monkeypatch):
    """Before, the DequantizeLinear kept FP32 by its deny rule and a Cast sat between it and the
    FP16 MatMul: a dequantize and a cast of the whole weight every run, and onnxruntime's
    DequantizeLinear → MatMul fusion into MatMulNBits (int4 kernel) no longer matched.

    Numerics run at onnxruntime's default level (ALL): at level EXTENDED, onnxruntime 1.31.1's CPU
    provider computes zeros for the FP16 MatMulNBits it fuses (accuracy level 4), for a model
    written in FP16 from the start too (no rewrite involved); ALL, or accuracy level 0, is right."""
    from tools.ortrun import OPT_LEVEL_ENV

    monkeypatch.setenv(OPT_LEVEL_ENV, "all")
    model = _int4_matmul()
    result = rewrite(model, placement=placement)
    decision = result.log.decisions["dqw"]
    assert decision.precision == Precision.LOW and decision.reason.startswith("dequantizes a constant weight")
    out = result.model
    full_check(out)
    mm = next(n for n in out.graph.node if n.op_type == "MatMul")
    dq = next(n for n in out.graph.node if n.op_type == "DequantizeLinear")
    assert mm.input[1] == dq.output[0]  # no Cast between them: what the MatMulNBits selector needs
    scale = next(t for t in out.graph.initializer if t.name == dq.input[1])
    assert scale.data_type == TP.FLOAT16  # converted offline, as a weight
    assert "MatMulNBits" in _optimized_ops(out, tmp_path)
    assert rel_err(run(model, _x())["y"], run(out, _x())["y"]) < 1e-2
    assert rewrite(out, placement=placement).model.SerializeToString() == out.SerializeToString()


def test_weight_dequantize_with_a_subnormal_scale_stays_fp32():
    """Weights of magnitude ~1e-6 give scales ~1.5e-7, below FP16's smallest normal (6.1e-5):
    converted offline they became multiples of 6e-8, each block's weights off by up to 18%, and
    the output by 15%; the plain FP32 weight of the same layer converts within 1e-2. The scale
    now keeps the DequantizeLinear FP32 (bf16 reaches 1.2e-38: no such loss there)."""
    model = _int4_matmul(weight_scale=1e-6)
    result = rewrite(model)
    decision = result.log.decisions["dqw"]
    assert decision.precision == Precision.FP32
    assert "below fp16's smallest normal number" in decision.reason
    out = result.model
    full_check(out)
    assert result.log.decisions["mm"].precision == Precision.LOW
    assert rel_err(run(model, _x())["y"], run(out, _x())["y"]) < 1e-2
    assert not rewrite(out).modified


def test_weight_dequantize_stays_fp32_where_its_reader_does():
    """Its MatMul pinned FP32, or a float op also reading the weight: the deny rule stands."""
    for model, options in ((_int4_matmul(), {"fp32_nodes": ["mm"]}), (_int4_matmul(extra_reader=True), {})):
        result = rewrite(model, **options)
        assert result.log.decisions["dqw"].precision == Precision.FP32
        full_check(result.model)


def test_weight_dequantize_respects_a_users_fp32_pin():
    for options in ({"fp32_ops": ["DequantizeLinear"]}, {"fp32_nodes": ["dqw"]}):
        result = rewrite(_int4_matmul(), **options)
        assert result.log.decisions["dqw"].precision == Precision.FP32
        assert result.log.decisions["mm"].precision == Precision.LOW


def test_activation_dequantize_stays_fp32():
    """A DequantizeLinear of an activation (a QDQ unit's input, read by a low Conv outside a unit)
    keeps its deny rule: its data is not a constant weight."""
    result = rewrite(_qdq_conv(19, tail="float"))
    assert result.log.decisions["dq0"].precision == Precision.FP32
    assert result.log.decisions["dqw"].precision == Precision.LOW  # (the Conv's weight)


def test_weight_dequantize_without_a_bf16_kernel_stays_fp32():
    result = rewrite(_int4_matmul(), target="bf16")
    decision = result.log.decisions["dqw"]
    assert decision.precision == Precision.FP32
    assert "no bf16 kernel" in decision.reason


@pytest.mark.parametrize("output_dtype", [None, TP.FLOAT])
@pytest.mark.parametrize("opset", [21, 23])
def test_weight_dequantize_at_opset_23_converts_its_scale(opset, output_dtype, monkeypatch):
    """DequantizeLinear-23 types its output apart from its scale (T3, T2), but with no output_dtype
    the output takes the scale's type. Before, the output was declared FP16 beside an FP32 scale:
    the checker and onnxruntime refused the model ("does not match expected type").

    (Level ALL: onnxruntime 1.31.1 fuses an int8 per-channel DQ → MatMul into an 8-bit MatMulNBits
    too, and computes zeros for it in FP16 at level EXTENDED on the CPU provider, as for int4.)"""
    from tools.ortrun import OPT_LEVEL_ENV

    monkeypatch.setenv(OPT_LEVEL_ENV, "all")
    if opset < 23 and output_dtype is not None:
        pytest.skip("output_dtype exists from opset 23")
    rng = np.random.default_rng(0)
    attrs = {"axis": 1} if output_dtype is None else {"axis": 1, "output_dtype": output_dtype}
    inits = [nh.from_array(rng.integers(-8, 8, (16, 16)).astype(np.int8), "wq"),
             nh.from_array((rng.random(16) * 0.01 + 0.001).astype(np.float32), "ws")]
    nodes = [oh.make_node("DequantizeLinear", ["wq", "ws"], ["w"], name="dq", **attrs),
             oh.make_node("MatMul", ["x", "w"], ["y"], name="mm")]
    graph = oh.make_graph(nodes, "g", [oh.make_tensor_value_info("x", TP.FLOAT, [4, 16])],
                          [oh.make_tensor_value_info("y", TP.FLOAT, [4, 16])], inits)
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", opset)], ir_version=10)
    onnx.checker.check_model(model, full_check=True)
    result = rewrite(model)
    assert result.log.decisions["dq"].precision == Precision.LOW
    out = result.model
    full_check(out)
    assert next(t for t in out.graph.initializer if t.name == "ws").data_type == TP.FLOAT16
    feeds = {"x": rng.standard_normal((4, 16)).astype(np.float32)}
    assert rel_err(run(model, feeds)["y"], run(out, feeds)["y"]) < 1e-2
    assert rewrite(out).model.SerializeToString() == out.SerializeToString()


def test_quantize_nodes_between_fp32_units_are_no_islands():
    """A QDQ model with one float layer: every QuantizeLinear between FP32 units was reported as an
    "FP32 region, 1 node, 0 casts in, 0 out" island (64 of them on a small transformer). An island
    is an FP32 region a low value enters or leaves; these are FP32 amid FP32."""
    rng = np.random.default_rng(0)
    s = nh.from_array(np.float32(0.05), "s")
    z = nh.from_array(np.uint8(128), "z")
    inits = [s, z, nh.from_array(rng.standard_normal((8, 8)).astype(np.float32), "wf")]
    nodes, h = [], "x"
    for i in range(3):  # three QDQ units of Relu
        nodes += [oh.make_node("QuantizeLinear", [h, "s", "z"], [f"q{i}"], name=f"q{i}"),
                  oh.make_node("DequantizeLinear", [f"q{i}", "s", "z"], [f"d{i}"], name=f"dq{i}"),
                  oh.make_node("Relu", [f"d{i}"], [f"r{i}"], name=f"relu{i}")]
        h = f"r{i}"
    nodes += [oh.make_node("QuantizeLinear", [h, "s", "z"], ["qe"], name="qe"),
              oh.make_node("DequantizeLinear", ["qe", "s", "z"], ["de"], name="dqe"),
              oh.make_node("MatMul", ["de", "wf"], ["m"], name="mm"),  # the float layer
              oh.make_node("Relu", ["m"], ["y"], name="out")]
    graph = oh.make_graph(nodes, "g", [oh.make_tensor_value_info("x", TP.FLOAT, [4, 8])],
                          [oh.make_tensor_value_info("y", TP.FLOAT, [4, 8])], inits)
    result = rewrite(oh.make_model(graph, opset_imports=[oh.make_opsetid("", 19)], ir_version=9))
    assert result.log.decisions["mm"].precision == Precision.LOW
    seeds = {seed for island in result.log.islands for seed in island.seeds}
    assert seeds == {"dqe"}  # the DequantizeLinear the low MatMul reads: one cast out


def test_an_fp32_region_entering_low_through_the_models_own_cast_is_an_island():
    """Llama's rotary cos: Cos (deny) → the model's Cast(to=FLOAT) → the FP16 attention's Mul. The
    retargeted Cast carries it into low precision: still an island, though no Cast was inserted."""
    rng = np.random.default_rng(0)
    nodes = [oh.make_node("Cos", ["pos"], ["c"], name="cos"),
             oh.make_node("Cast", ["c"], ["cf"], to=TP.FLOAT, name="cast"),
             oh.make_node("MatMul", ["x", "w"], ["m"], name="mm"),
             oh.make_node("Mul", ["m", "cf"], ["y"], name="mul"),
             oh.make_node("MatMul", ["y", "w"], ["out"], name="mm2")]
    graph = oh.make_graph(nodes, "g", [oh.make_tensor_value_info("x", TP.FLOAT, [4, 8]),
                                        oh.make_tensor_value_info("pos", TP.FLOAT, [4, 8])],
                          [oh.make_tensor_value_info("out", TP.FLOAT, [4, 8])],
                          [nh.from_array(rng.standard_normal((8, 8)).astype(np.float32), "w")])
    result = rewrite(oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)], ir_version=8))
    assert result.log.decisions["mul"].precision == Precision.LOW
    assert [island.seeds for island in result.log.islands] == [["cos"]]


@pytest.mark.parametrize("target", ["fp16", "bf16"])
def test_onnxruntime_quantized_contrib_ops_have_rules(target):
    """The QOperator format (QLinearConv, QGemm, QLinearConcat ...) and the other quantized contrib
    ops were unlisted: the summary asked the user to classify integer ops that can never go low."""
    from amp_rewrite.frontends.onnx_loader import _ort_schemas
    from amp_rewrite.rulebook import load_rules

    rules = load_rules(frontend="onnx", target=target)
    quantized = sorted(op for domain, op in _ort_schemas() if domain == "com.microsoft"
                       and (op.startswith(("QLinear", "QOrdered", "QGemm", "QAttention", "QEmbed", "QMoE"))
                            or "Quantize" in op or "Integer" in op or "BlockQuantized" in op))
    assert len(quantized) > 20
    # (left out: integer-only ops, with no float tensor for a rule to decide)
    integer_only = ["MatMulInteger16", "MulInteger", "ReduceSumInteger"]
    assert [op for op in quantized if rules.lookup(op, "com.microsoft", 21) is None] == integer_only


def test_qoperator_model_lists_no_unlisted_op():
    rng = np.random.default_rng(0)
    inits = [nh.from_array(np.float32(0.05), "s"), nh.from_array(np.uint8(128), "z"),
             nh.from_array(rng.standard_normal((8, 8)).astype(np.float32), "w")]
    nodes = [oh.make_node("QuantizeLinear", ["x", "s", "z"], ["q"], name="q"),
             oh.make_node("QLinearSigmoid", ["q", "s", "z", "s", "z"], ["qs"], domain="com.microsoft", name="qsig"),
             oh.make_node("DequantizeLinear", ["qs", "s", "z"], ["d"], name="dq"),
             oh.make_node("MatMul", ["d", "w"], ["y"], name="mm")]
    graph = oh.make_graph(nodes, "g", [oh.make_tensor_value_info("x", TP.FLOAT, [4, 8])],
                          [oh.make_tensor_value_info("y", TP.FLOAT, [4, 8])], inits)
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17), oh.make_opsetid("com.microsoft", 1)],
                          ir_version=8)
    result = rewrite(model)
    assert result.log.unlisted_ops == {}
    assert result.log.decisions["mm"].precision == Precision.LOW
    feeds = {"x": rng.standard_normal((4, 8)).astype(np.float32)}
    assert rel_err(run(model, feeds)["y"], run(result.model, feeds)["y"]) < 1e-2


def test_explain_names_a_classify_check_not_a_rule_entry(tmp_path):
    """--explain said a QDQ unit's Conv was "decided by its rule entry" and showed "rule entry:
    classify (allow Conv)": no rule entry decided it; a check at classification overrode one."""
    path = tmp_path / "q.onnx"
    onnx.save(_qdq_conv(19), path)
    text = explain_node(path, "conv")
    assert "[classify: a check at classification, over its rule entry]" in text
    assert "  decided by: a check at classification, not a rule entry (the op's category: allow)" in text
    assert "rule entry: classify" not in text
    rule = explain_node(path, "q1")  # a deny rule entry decided this one
    assert "[classify: decided by its rule entry]" in rule and "rule entry: onnx-cuda-fp16.toml: deny." in rule


@pytest.mark.parametrize("placement", ["optimal", "greedy"])
def test_a_quantized_weight_dequantizing_past_the_range_keeps_fp32_and_is_clamped_before_its_cast(placement):
    """int8 weights with a scale of 800 dequantize to up to 101600: the DequantizeLinear was made
    FP16 with its scale (800 fits), computed inf at run time, and the MatMul gave NaN, with 0 values
    counted clamped. It keeps FP32, and its output is clamped to ±65504 before the Cast to the
    MatMul, as the same weights stored as a plain initializer are clamped offline."""
    from amp_rewrite.emulate import emulate_low

    rng = np.random.default_rng(0)
    wq = rng.integers(-127, 128, (64, 32)).astype(np.int8)
    nodes = [oh.make_node("DequantizeLinear", ["wq", "s", "z"], ["w"], axis=1, name="dq"),
             oh.make_node("MatMul", ["x", "w"], ["y"], name="mm")]
    inits = [nh.from_array(wq, "wq"), nh.from_array(np.full(32, 800.0, np.float32), "s"),
             nh.from_array(np.zeros(32, np.int8), "z")]
    graph = oh.make_graph(nodes, "g", [oh.make_tensor_value_info("x", TP.FLOAT, [4, 64])],
                          [oh.make_tensor_value_info("y", TP.FLOAT, [4, 32])], inits)
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 19)], ir_version=9)
    result = rewrite(model, placement=placement)
    full_check(result.model)
    decision = result.log.decisions["dq"]
    assert decision.precision == Precision.FP32 and "101600" in decision.reason
    assert any("clamped to" in c.reason for c in result.log.casts)
    feeds = {"x": (rng.standard_normal((4, 64)) * 1e-3).astype(np.float32)}
    got = run(emulate_low(result.model, TP.FLOAT16)[0], feeds)["y"]
    assert np.isfinite(got).all()
    # (the clamped weights, as a plain initializer's: 65504 where the model holds up to 101600)
    clamped = np.clip(wq.astype(np.float32) * 800.0, -65504, 65504)
    assert rel_err(feeds["x"] @ clamped, got) < 1e-2
    # BF16 holds 101600: nothing is held for the range there
    assert "101600" not in rewrite(model, placement=placement, target="bf16").log.decisions["dq"].reason


def test_a_zero_point_that_carries_dequantized_weights_past_the_range_keeps_fp32():
    """(x - zero_point) * scale: int8 weights up to 100 with a zero point of -100 and a scale of 400
    dequantize to up to 80000 (each alone times the scale stays under 65504): the DequantizeLinear
    keeps FP32 with that bound."""
    wq = np.tile(np.arange(-100, 100, 25, dtype=np.int8), (8, 1))
    wq[0, 0] = 100
    nodes = [oh.make_node("DequantizeLinear", ["wq", "s", "z"], ["w"], axis=1, name="dq"),
             oh.make_node("MatMul", ["x", "w"], ["y"], name="mm")]
    inits = [nh.from_array(wq, "wq"), nh.from_array(np.full(8, 400.0, np.float32), "s"),
             nh.from_array(np.full(8, -100, np.int8), "z")]
    graph = oh.make_graph(nodes, "g", [oh.make_tensor_value_info("x", TP.FLOAT, [4, 8])],
                          [oh.make_tensor_value_info("y", TP.FLOAT, [4, 8])], inits)
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 19)], ir_version=9)
    result = rewrite(model)
    full_check(result.model)
    decision = result.log.decisions["dq"]
    assert decision.precision == Precision.FP32 and "dequantize to up to 80000" in decision.reason, decision.reason


@pytest.mark.parametrize("form", ["Cast * scale", "DequantizeLinear"])
def test_a_weight_dequantized_by_hand_past_fp16_s_range_is_clamped_like_a_dequantize_linear(form):
    """Cast(int8 weight) × 800 (the pre-DequantizeLinear form) reaches 101600: cast to FP16 at run
    time for the FP16 MatMul it became inf and the output NaN, where the same weight written as a
    DequantizeLinear gets its saturating Clip."""
    from amp_rewrite.emulate import emulate_low

    rng = np.random.default_rng(0)
    wq = rng.integers(-127, 128, (8, 6)).astype(np.int8)
    body = "w = DequantizeLinear(wq, sc)" if form == "DequantizeLinear" else "wf = Cast<to=1>(wq)\n  w = Mul(wf, sc)"
    model = onnx.parser.parse_model(f"""<ir_version: 8, opset_import: ["" : 17]> g (float[4,8] x) => (float[4,6] y) {{
  {body}
  y = MatMul(x, w)
}}""")
    model.graph.initializer.extend([nh.from_array(wq, "wq"), nh.from_array(np.array(800.0, np.float32), "sc")])
    x = (rng.standard_normal((4, 8)) * 1e-3).astype(np.float32)
    ref = run(model, {"x": x})["y"]
    result = rewrite(model)
    full_check(result.model)
    got = run(emulate_low(result.model)[0], {"x": x})["y"]
    assert np.isfinite(got).all() and np.abs(got).max() > 0.5 * np.abs(ref).max()
    assert [n.op_type for n in result.model.graph.node].count("Clip") == 1
