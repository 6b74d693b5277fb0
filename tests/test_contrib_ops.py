"""onnxruntime's contrib ops (com.microsoft's, and those onnxruntime registers in the default
domain): their type-constraint groups, their output types, and the default-domain ones onnx has
no schema for at the model's opset.

Each case: the output loads and runs in onnxruntime (CPU), within 1e-2 of the FP32 model, passes
onnx.checker as far as the input does, the GEMMs run low, and a second rewrite changes nothing."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper as oh
from onnx import numpy_helper

from amp_rewrite.decisions import Precision
from amp_rewrite.frontends.onnx_loader import load_onnx
from amp_rewrite.ir import DType
from tests.util import FP32, full_check, rel_err, rewrite, run

MS = "com.microsoft"
H = 8


def _weights(*specs: tuple) -> list[onnx.TensorProto]:
    rng = np.random.default_rng(0)
    out = []
    for name, *shape in specs:
        scale = 1.0 if name.startswith("g") else 1 / np.sqrt(shape[0])
        out.append(numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name))
    return out


def _model(nodes, opset: int, inits, *, outputs=("out",), value_info=(), ms: bool = True) -> onnx.ModelProto:
    graph = oh.make_graph(nodes, "g", [oh.make_tensor_value_info("x", FP32, [2, 4, H])],
                          [oh.make_tensor_value_info(name, FP32, [2, 4, H]) for name in outputs], inits,
                          value_info=[oh.make_tensor_value_info(n, FP32, s) for n, s in value_info])
    opsets = [oh.make_opsetid("", opset)] + ([oh.make_opsetid(MS, 1)] if ms else [])
    return oh.make_model(graph, opset_imports=opsets, ir_version=10)


def _feeds() -> dict:
    return {"x": np.random.default_rng(1).standard_normal((2, 4, H)).astype(np.float32)}


def _types(model: onnx.ModelProto) -> dict[str, DType | None]:
    """Every node output's element type as amp-rewrite reads the model (onnx's inference, then
    onnxruntime's symbolic inference and schemas for what onnx cannot type)."""
    return {v.name: v.dtype for node in load_onnx(model).graph.nodes for v in node.outputs}


def _checker_verdict(model: onnx.ModelProto) -> str:
    try:
        full_check(model)
    except onnx.checker.ValidationError as exc:
        return str(exc).splitlines()[0]
    return "ok"


def _assert_sound(model: onnx.ModelProto, result, output: str = "out") -> None:
    out = result.model
    assert _checker_verdict(out) == _checker_verdict(model)
    x = _feeds()
    assert rel_err(run(model, x)[output], run(out, x)[output]) < 1e-2
    assert result.report.heavy_ops["low"] == result.report.heavy_ops["total"] > 0
    assert rewrite(out).modified is False


# -- 1. statistics outputs of the Skip* norms: their own group (U: float only) -----------------------
@pytest.mark.parametrize("declared", [True, False], ids=["value_info", "inferred"])
@pytest.mark.parametrize("op", ["SkipLayerNormalization", "SkipSimplifiedLayerNormalization"])
def test_skip_norm_statistics_outputs_stay_fp32(op, declared):
    """The mean / inv_std_var outputs (type U: float only) were in the node's one group "?" and
    declared FLOAT16 with it: onnxruntime refused the output ("Type (tensor(float16)) of output
    arg (mean) ... does not match expected type (tensor(float))")."""
    norm_inputs = ["a", "x1", "g"] + (["b"] if op == "SkipLayerNormalization" else [])
    nodes = [oh.make_node("MatMul", ["x", "w0"], ["x1"], name="mm0"),
             oh.make_node("MatMul", ["x1", "w1"], ["a"], name="mm1"),
             oh.make_node(op, norm_inputs, ["y", "mean", "isv", "sum"], name="norm", domain=MS, epsilon=1e-5),
             oh.make_node("MatMul", ["y", "w2"], ["o1"], name="mm2"),
             oh.make_node("MatMul", ["sum", "w2"], ["o2"], name="mm3"),
             oh.make_node("Add", ["o1", "o2"], ["o3"]),
             oh.make_node("Mul", ["mean", "isv"], ["ms"]),
             oh.make_node("Add", ["o3", "ms"], ["out"])]
    infos = [("mean", [2, 4, 1]), ("isv", [2, 4, 1]), ("y", [2, 4, H]), ("sum", [2, 4, H])] if declared else []
    model = _model(nodes, 17, _weights(("w0", H, H), ("w1", H, H), ("w2", H, H), ("g", H), ("b", H)),
                   value_info=infos)
    result = rewrite(model)
    types = _types(result.model)
    assert types["y"] == types["sum"] == DType.FLOAT16
    assert types["mean"] == types["isv"] == DType.FLOAT
    assert result.log.decisions["norm"].precision == Precision.LOW
    _assert_sound(model, result)


def test_contrib_groups_come_from_onnxruntimes_schemas():
    """Attention's int32 mask_index (M), GroupQueryAttention's k_scale/v_scale (float only) are
    groups of their own; its FP32 KV cache is painted with the query (its CUDA kernel takes one type
    for both), an int8 cache is not; GemmaRotaryEmbedding's emb (U: float) is apart from q/k."""
    def node(op, inputs, outputs, types, out_type=FP32):
        graph = oh.make_graph([oh.make_node(op, inputs, outputs, domain=MS, num_heads=2, kv_num_heads=2)], "g",
                              [oh.make_tensor_value_info(n, t, None) for n, t in zip(inputs, types) if n],
                              [oh.make_tensor_value_info(outputs[0], out_type, None)])
        model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17), oh.make_opsetid(MS, 1)], ir_version=10)
        return load_onnx(model).graph.nodes[0]

    i32, i8 = onnx.TensorProto.INT32, onnx.TensorProto.INT8
    attention = node("Attention", ["x", "w", "b", "mask"], ["y"], [FP32, FP32, FP32, i32])
    assert attention.input_groups == ["T", "T", "T", "M"]
    gqa_inputs = ["q", "k", "v", "pk", "pv", "seqlens", "total", "", "", "", "", "", "ks", "vs"]
    gqa = node("GroupQueryAttention", gqa_inputs, ["y", "ck", "cv"],
               [FP32] * 5 + [i32, i32] + [0] * 5 + [FP32, FP32])
    assert gqa.input_groups[3:5] == ["T", "T"] and gqa.output_groups == ["T", "T", "T"]
    assert gqa.input_groups[12:14] == ["T_KV_SCALE", "T_KV_SCALE"] and gqa.input_groups[5] == "M"
    quantized = node("GroupQueryAttention", gqa_inputs, ["y", "ck", "cv"],
                     [FP32, FP32, FP32, i8, i8, i32, i32] + [0] * 5 + [FP32, FP32])
    assert quantized.input_groups[3:5] == ["T_CACHE", "T_CACHE"] and quantized.output_groups[1:] == ["T_CACHE"] * 2
    gemma = node("GemmaRotaryEmbedding", ["emb", "q", "qr", "k", "kr"], ["o1", "o2"],
                 [FP32] + [onnx.TensorProto.FLOAT16] * 4, onnx.TensorProto.FLOAT16)
    assert gemma.input_groups == ["U", "T", "T", "T", "T"] and gemma.meta["group_types"]["U"] == {"float"}


def test_an_int8_kv_cache_keeps_its_group_when_the_query_type_is_unknown():
    """An int8 KV cache is not painted with the query even where nothing types the query (no
    value_info): only float values join their main group."""
    names = ["q", "k", "v", "pk", "pv", "seqlens", "total"]
    types = [None, None, None, onnx.TensorProto.INT8, onnx.TensorProto.INT8, onnx.TensorProto.INT32,
             onnx.TensorProto.INT32]
    graph = oh.make_graph([oh.make_node("GroupQueryAttention", names, ["y", "ck", "cv"], domain=MS, num_heads=2,
                                        kv_num_heads=2)], "g",
                          [oh.make_tensor_value_info(n, t, None) if t else oh.make_value_info(n, onnx.TypeProto())
                           for n, t in zip(names, types)],
                          [oh.make_value_info("y", onnx.TypeProto())])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17), oh.make_opsetid(MS, 1)], ir_version=10)
    gqa = load_onnx(model).graph.nodes[0]
    assert gqa.input_groups[:5] == ["T", "T", "T", "T_CACHE", "T_CACHE"]
    assert gqa.output_groups == ["T", "T_CACHE", "T_CACHE"]


@pytest.mark.parametrize("target", ["fp16", "bf16"])
def test_group_norm_gamma_and_beta_stay_fp32(target):
    """GroupNorm's gamma and beta (group M: float16 or float by its schema) were painted with X and
    converted to FP16: onnxruntime's CUDA kernel refuses them at run time ("GroupNorm only supports
    gamma and beta in float type"); its own converter keeps them FP32 (ALWAYS_FLOAT_INPUTS)."""
    c = 8
    nodes = [oh.make_node("MatMul", ["x", "w1"], ["a"], name="mm1"),
             oh.make_node("GroupNorm", ["a", "gamma", "beta"], ["gn"], domain=MS, groups=2, activation=1,
                          epsilon=1e-5, channels_last=1, name="gnorm"),
             oh.make_node("SkipGroupNorm", ["gn", "gamma", "beta", "a"], ["sg", "s"], domain=MS, groups=2,
                          activation=0, epsilon=1e-5, channels_last=1, name="sgnorm"),
             oh.make_node("MatMul", ["sg", "w2"], ["y"], name="mm2")]
    graph = oh.make_graph(nodes, "g", [oh.make_tensor_value_info("x", FP32, [1, 4, 4, c])],
                          [oh.make_tensor_value_info("y", FP32, [1, 4, 4, c])],
                          _weights(("w1", c, c), ("w2", c, c), ("gamma", c), ("beta", c)))
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17), oh.make_opsetid(MS, 1)], ir_version=9)
    result = rewrite(model, target=target)
    out = result.model
    full_check(out)
    inits = {t.name: t.data_type for t in out.graph.initializer}
    for node in out.graph.node:
        if node.op_type in ("GroupNorm", "SkipGroupNorm"):
            assert [inits.get(v) for v in node.input[1:3]] == [FP32, FP32], node.op_type
    # (bf16: no bfloat16 CUDA kernel, FP32 throughout)
    want = Precision.LOW if target == "fp16" else Precision.FP32
    assert result.log.decisions["gnorm"].precision == result.log.decisions["sgnorm"].precision == want
    assert rewrite(out, target=target).modified is False


# -- 2. contrib ops onnxruntime registers in the default domain ---------------------------------------
def test_default_domain_layernorm_below_opset_17_is_onnxruntimes():
    """onnxruntime's optimizers write LayerNormalization at opset 13 (its own contrib op, in the
    default domain: X T, Scale/B/Y V, Mean/InvStdDev U); onnxruntime loads it. amp-rewrite exited 3
    ("LayerNormalization is an ai.onnx operator only from opset 17"). The CUDA provider has FP16
    kernels for it (opsets 1-16): it runs low, its statistics stay FP32."""
    nodes = [oh.make_node("MatMul", ["x", "w1"], ["a"], name="mm1"),
             oh.make_node("LayerNormalization", ["a", "g", "b"], ["y", "mean", "isd"], name="ln", axis=-1,
                          epsilon=1e-5),
             oh.make_node("MatMul", ["y", "w2"], ["o1"], name="mm2"),
             oh.make_node("Mul", ["mean", "isd"], ["ms"]),
             oh.make_node("Add", ["o1", "ms"], ["out"])]
    model = _model(nodes, 13, _weights(("w1", H, H), ("w2", H, H), ("g", H), ("b", H)), ms=False)
    assert "No Op registered for LayerNormalization" in _checker_verdict(model)  # (onnx: none at opset 13)
    result = rewrite(model)
    types = _types(result.model)
    assert types["y"] == DType.FLOAT16 and types["mean"] == types["isd"] == DType.FLOAT
    assert result.log.decisions["ln"].precision == Precision.LOW
    _assert_sound(model, result)


def test_default_domain_simplified_layernorm():
    """SimplifiedLayerNormalization (onnxruntime's RMSNorm, default domain, at any opset), as its
    session-level optimizer writes it: ai.onnx has no such op, and amp-rewrite exited 3."""
    nodes = [oh.make_node("MatMul", ["x", "w1"], ["a"], name="mm1"),
             oh.make_node("SimplifiedLayerNormalization", ["a", "g"], ["y"], name="rms", axis=-1, epsilon=1e-6),
             oh.make_node("MatMul", ["y", "w2"], ["out"], name="mm2")]
    model = _model(nodes, 17, _weights(("w1", H, H), ("w2", H, H), ("g", H)), ms=False)
    result = rewrite(model)
    assert result.log.decisions["rms"].precision == Precision.LOW
    assert _types(result.model)["y"] == DType.FLOAT16
    _assert_sound(model, result)


# -- 3. outputs no inference types: from the schema's type constraints ---------------------------------
def test_fused_matmul_output_is_typed_from_its_schema():
    """onnxruntime's symbolic shape inference has no FusedMatMul handler: its output stayed
    untyped, so FusedMatMul (an allow op) and everything after it kept FP32. Its schema says
    output T = input T."""
    nodes = [oh.make_node("MatMul", ["x", "w1"], ["a"], name="mm1"),
             oh.make_node("FusedMatMul", ["a", "w2"], ["b"], name="fmm1", domain=MS, alpha=0.5, transB=1),
             oh.make_node("FusedMatMul", ["b", "w3"], ["c"], name="fmm2", domain=MS, alpha=2.0),
             oh.make_node("Relu", ["c"], ["d"], name="relu"),
             oh.make_node("MatMul", ["d", "w4"], ["out"], name="mm2")]
    model = _model(nodes, 17, _weights(("w1", H, H), ("w2", H, H), ("w3", H, H), ("w4", H, H)))
    result = rewrite(model)
    decisions = result.log.decisions
    assert all(decisions[n].precision == Precision.LOW for n in ("fmm1", "fmm2", "relu", "mm2"))
    types = _types(result.model)
    assert types["b"] == types["c"] == types["d"] == DType.FLOAT16
    _assert_sound(model, result)


def test_an_op_no_schema_knows_keeps_fp32_when_its_output_is_untyped():
    """What neither onnx nor onnxruntime has a schema for (a com.example op) is still one group "?"
    with untyped outputs: pinned low by a node rule, it keeps FP32 and says why, and so do its
    readers (painted low, its readers would get no Cast)."""
    text = """
        <ir_version: 8, opset_import: ["" : 17, "com.example" : 1]>
        g (float[2,4] x) => (float[2,4] z) {
          a = MatMul(x, w)
          y = com.example.Foo(a)
          z = MatMul(y, w)
        }"""
    model = onnx.parser.parse_model(text)
    model.graph.initializer.append(numpy_helper.from_array(np.eye(4, dtype=np.float32), "w"))
    full_check(model)
    result = rewrite(model, fp16_nodes=["Foo:y"])
    foo = result.log.decisions["Foo:y"]
    assert foo.precision == Precision.FP32 and "'y' is unknown" in foo.reason
    assert result.log.decisions["MatMul:z"].precision == Precision.FP32
    full_check(result.model)
    assert rewrite(result.model, fp16_nodes=["Foo:y"]).modified is False


# -- 4. --check loads the rewritten model itself, not only its FP32 emulation ---------------------------
def _skip_norm_with_mean(mean_type: int) -> onnx.ModelProto:
    """FP16 SkipLayerNormalization whose mean output is declared ``mean_type`` (FLOAT16 is what the
    rewrite used to write; onnxruntime refuses to load it)."""
    f16 = onnx.TensorProto.FLOAT16
    nodes = [oh.make_node("Cast", ["x"], ["xl"], to=f16),
             oh.make_node("SkipLayerNormalization", ["xl", "xl", "g", "b"], ["y", "mean"], domain=MS, epsilon=1e-5),
             oh.make_node("Cast", ["y"], ["out"], to=FP32),
             oh.make_node("Cast", ["mean"], ["m"], to=FP32)]
    inits = [numpy_helper.from_array(np.linspace(0.5, 1.5, H).astype(np.float16), "g"),
             numpy_helper.from_array(np.zeros(H, np.float16), "b")]
    graph = oh.make_graph(nodes, "g", [oh.make_tensor_value_info("x", FP32, [2, 4, H])],
                          [oh.make_tensor_value_info("out", FP32, [2, 4, H]), oh.make_tensor_value_info("m", FP32, [2, 4, 1])],
                          inits, value_info=[oh.make_tensor_value_info("mean", mean_type, [2, 4, 1])])
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17), oh.make_opsetid(MS, 1)], ir_version=10)


def test_check_fails_when_onnxruntime_cannot_load_the_rewritten_model():
    """On the CPU provider --check ran only the FP32 emulation of the rewritten model, which loads
    whatever the model declares: it said "check passed" for an output onnxruntime refuses."""
    from amp_rewrite import check as ck

    reference = _model([oh.make_node("SkipLayerNormalization", ["x", "x", "g", "b"], ["out", "m"], domain=MS,
                                     epsilon=1e-5)],
                       17, [numpy_helper.from_array(np.linspace(0.5, 1.5, H).astype(np.float32), "g"),
                            numpy_helper.from_array(np.zeros(H, np.float32), "b")], outputs=())
    del reference.graph.output[:]
    reference.graph.output.extend([oh.make_tensor_value_info("out", FP32, [2, 4, H]),
                                   oh.make_tensor_value_info("m", FP32, [2, 4, 1])])
    runner = ck.Runner(["CPUExecutionProvider"])
    assert ck.check_models(reference, _skip_norm_with_mean(FP32), runner=runner).passed
    with pytest.raises(ck.CheckRunError, match="cannot load the rewritten model.*mean"):
        ck.check_models(reference, _skip_norm_with_mean(onnx.TensorProto.FLOAT16), runner=runner)
    assert ck.CheckRunError("").exit_code == 8


def test_an_ai_onnx_ml_output_is_typed_from_its_schema():
    """onnx's shape inference has no type function for most ai.onnx.ml ops, and the schema's fixed
    output types were read for onnxruntime's schemas only: Scaler's output (tensor(float) whatever
    it reads) stayed untyped, so the MatMul reading it kept FP32, "dtype of 'n' is unknown"."""
    nodes = [oh.make_node("MatMul", ["x", "w1"], ["a"]),
             oh.make_node("Scaler", ["a"], ["n"], domain="ai.onnx.ml", offset=[0.5], scale=[2.0]),
             oh.make_node("MatMul", ["n", "w2"], ["out"])]
    model = _model(nodes, 17, _weights(("w1", H, H), ("w2", H, H)), ms=False)
    model.opset_import.append(oh.make_opsetid("ai.onnx.ml", 3))
    result = rewrite(model)
    full_check(result.model)
    summary = result.report.summary()
    assert (summary["heavy_ops"]["low"], summary["heavy_ops"]["total"]) == (2, 2)
    x = np.random.default_rng(1).standard_normal((2, 4, H)).astype(np.float32)
    assert rel_err(run(model, {"x": x})["out"], run(result.model, {"x": x})["out"]) < 1e-2
    assert not rewrite(result.model).modified


def test_the_emulation_of_a_gqa_prompt_step_reading_a_past_cache_runs():
    """emulate_low (what --check runs on a CPU) renamed each low output without its declared shape:
    onnxruntime's GroupQueryAttention inference takes present for past's shape (a shared buffer),
    and its planner reused past's (1,1,3,16) buffer for the (1,1,7,16) present, so the emulation
    failed to run and --check left the FP16 rounding of every such model unchecked."""
    from amp_rewrite.emulate import emulate_low

    b, s, h, heads, kv_heads, past = 1, 4, 32, 2, 1, 3
    d = h // heads
    rng = np.random.default_rng(0)

    def w(name, *shape):
        return numpy_helper.from_array((rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32), name)

    nodes = [oh.make_node("MatMul", ["x", "wq"], ["q"]), oh.make_node("MatMul", ["x", "wk"], ["k"]),
             oh.make_node("MatMul", ["x", "wv"], ["v"]),
             oh.make_node("GroupQueryAttention", ["q", "k", "v", "pk", "pv", "seqlens", "total"], ["att", "prk", "prv"],
                          domain=MS, num_heads=heads, kv_num_heads=kv_heads, name="gqa"),
             oh.make_node("MatMul", ["att", "wo"], ["out"])]
    vi = oh.make_tensor_value_info
    graph = oh.make_graph(
        nodes, "g",
        [vi("x", onnx.TensorProto.FLOAT, [b, s, h]), vi("pk", onnx.TensorProto.FLOAT, [b, kv_heads, past, d]),
         vi("pv", onnx.TensorProto.FLOAT, [b, kv_heads, past, d]), vi("seqlens", onnx.TensorProto.INT32, [b]),
         vi("total", onnx.TensorProto.INT32, [])],
        [vi("out", onnx.TensorProto.FLOAT, [b, s, h]), vi("prk", onnx.TensorProto.FLOAT, [b, kv_heads, s + past, d]),
         vi("prv", onnx.TensorProto.FLOAT, [b, kv_heads, s + past, d])],
        [w("wq", h, h), w("wk", h, kv_heads * d), w("wv", h, kv_heads * d), w("wo", h, h)])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17), oh.make_opsetid(MS, 1)], ir_version=9)
    feeds = {"x": rng.standard_normal((b, s, h)).astype(np.float32),
             "pk": rng.standard_normal((b, kv_heads, past, d)).astype(np.float32),
             "pv": rng.standard_normal((b, kv_heads, past, d)).astype(np.float32),
             "seqlens": np.array([s + past - 1], np.int32), "total": np.array(s + past, np.int32)}
    result = rewrite(model)
    full_check(result.model)
    emulated, rounded = emulate_low(result.model)
    assert "att" in rounded
    ref, got = run(model, feeds), run(emulated, feeds)
    for name in ("out", "prk", "prv"):
        assert got[name].shape == ref[name].shape and rel_err(ref[name], got[name]) < 1e-2, name


def test_a_model_of_custom_domain_ops_only_gets_an_ai_onnx_import_with_its_casts():
    """A com.microsoft FusedMatMul alone (no ai.onnx import) got ai.onnx Casts and no import for
    them: the output failed the checker, and rewriting it again refused it."""
    T = onnx.TensorProto
    g = oh.make_graph([oh.make_node("FusedMatMul", ["A", "B"], ["Y"], domain="com.microsoft", alpha=1.0)], "g",
                      [oh.make_tensor_value_info("A", T.FLOAT, [2, 4])], [oh.make_tensor_value_info("Y", T.FLOAT, [2, 3])],
                      [numpy_helper.from_array(np.full((4, 3), 0.5, np.float32), "B")])
    m = oh.make_model(g, opset_imports=[oh.make_opsetid("com.microsoft", 1)], ir_version=8)
    out = rewrite(m).model
    assert {o.domain: o.version for o in out.opset_import} == {"com.microsoft": 1, "": 13}
    assert any(n.op_type == "Cast" for n in out.graph.node)
    full_check(out)
    a = np.arange(8, dtype=np.float32).reshape(2, 4)
    assert rel_err(run(out, {"A": a})["Y"], a @ np.full((4, 3), 0.5, np.float32)) < 1e-2
    again = rewrite(out)
    assert not again.modified


def test_onnxruntimes_cpu_only_conv_counts_among_the_heavy_ops_kept_fp32():
    """onnxruntime's ENABLE_ALL optimisation (optimize_model(opt_level=99)) saves Convs as
    com.microsoft.nchwc::Conv, which has no low kernel and stays FP32 as an unlisted op. The summary
    counted only the MatMul ('1 of 1' heavy ops low) and listed no heavy op kept FP32."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal((8, 8, 1, 1)) * 0.3).astype(np.float32), "w"),
             numpy_helper.from_array((rng.standard_normal((8, 8)) * 0.3).astype(np.float32), "m")]
    graph = oh.make_graph([oh.make_node("Conv", ["x", "w"], ["c"], domain="com.microsoft.nchwc", name="conv"),
                           oh.make_node("Relu", ["c"], ["r"], name="relu"),
                           oh.make_node("MatMul", ["r", "m"], ["y"], name="fc")], "g",
                          [oh.make_tensor_value_info("x", FP32, [1, 8, 2, 8])],
                          [oh.make_tensor_value_info("y", FP32, [1, 8, 2, 8])], inits,
                          value_info=[oh.make_tensor_value_info(n, FP32, [1, 8, 2, 8]) for n in ("c", "r")])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17), oh.make_opsetid("com.microsoft.nchwc", 1)],
                          ir_version=10)
    result = rewrite(model)
    heavy = result.report.heavy_ops
    assert (heavy["total"], heavy["low"]) == (2, 1)
    assert [(k["node"], k["op"]) for k in heavy["kept_fp32"]] == [("conv", "com.microsoft.nchwc::Conv")]
    assert "1 of 2" in result.report.summary_text()
