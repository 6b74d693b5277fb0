"""The twelve pitfalls of today's converters (PRECISION.md), one test each (pitfall 8, models over
2 GB, is in test_external_data.py; pitfall 11, intermediate overflow, in the --check tests)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from amp_rewrite.decisions import Precision
from util import BF16, FP16, FP32, full_check, make_model, nodes_by_type, rel_err, rewrite, run, value_types


def assert_emulated_close(model, low_model, feeds, output="y"):
    """The low model, run as a GPU computes it (every FP16 value rounded where it is made), is
    finite and within 1e-2 of the FP32 model."""
    from amp_rewrite.emulate import emulate_low

    emulated, _ = emulate_low(low_model, FP16)
    got = run(emulated, feeds)[output]
    assert np.isfinite(got).all() and rel_err(run(model, feeds)[output], got) < 1e-2


# 1. "Type parameter (T) bound to different types": a low MatMul and an FP32 reduction meet in one Add.
def test_mixed_inputs_of_one_op_get_one_type():
    m = make_model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[4,8] x) => (float[4,8] y) {
          a = MatMul(x, w)
          r = ReduceSum<keepdims=1>(x, axes)
          s = Add(a, r)
          y = MatMul(s, w2)
        }""", {"w": (8, 8), "w2": (8, 8), "axes": np.array([1], np.int64)})
    out = rewrite(m).model
    full_check(out)
    types = value_types(out)
    add = nodes_by_type(out, "Add")[0]
    assert len({types[i] for i in add.input}) == 1
    x = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
    assert rel_err(run(m, {"x": x})["y"], run(out, {"x": x})["y"]) < 1e-2


# 2. Existing Cast(to=FLOAT), ConstantOfShape without value, dtype attributes stay consistent.
def test_existing_cast_to_float_is_retargeted_not_chained():
    m = make_model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (int64[4,8] ids) => (float[4,8] y) {
          f = Cast<to=1>(ids)
          y = MatMul(f, w)
        }""", {"w": (8, 8)})
    out = rewrite(m).model
    full_check(out)
    casts = nodes_by_type(out, "Cast")
    retargeted = [c for c in casts if c.input[0] == "ids"]
    assert len(retargeted) == 1 and retargeted[0].attribute[0].i == FP16
    # no FP32 -> FP16 cast chained after it
    assert not any(c.input[0] == retargeted[0].output[0] and c.attribute[0].i == FP16 for c in casts)


@pytest.mark.parametrize(("source", "target"), [("int64", "fp16"), ("float16", "bf16")])
def test_an_existing_cast_writing_a_low_output_is_cast_once_for_every_low_reader(source, target):
    """v = Cast(ix, to=FLOAT) is a graph output (--no-keep-io-types: low) read by an FP32 ReduceSum
    and a low MatMul: the MatMul got a Cast of ix to the low type and the output a second Cast of v
    to it, the same value cast twice."""
    m = make_model(f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g ({source}[2,4] ix) => (float[2,4] v, float[1,1] s, float[2,4] y) {{
          v = Cast<to=1>(ix)
          s = ReduceSum<keepdims=1>(v)
          y = MatMul(v, w)
        }}""", {"w": np.eye(4, dtype=np.float32)})
    result = rewrite(m, keep_io_types=False, target=target)
    full_check(result.model)
    low = {"fp16": FP16, "bf16": onnx.TensorProto.BFLOAT16}[target]
    producers = {o: n for n in result.model.graph.node for o in n.output}

    def root(name):
        while name in producers and producers[name].op_type == "Cast":
            name = producers[name].input[0]
        return name

    to_low = [root(n.input[0]) for n in nodes_by_type(result.model, "Cast") if n.attribute[0].i == low]
    assert len(to_low) == len(set(to_low)), to_low
    assert not rewrite(result.model, keep_io_types=False, target=target).modified
    if target == "fp16":
        ix = np.arange(8, dtype=np.int64).reshape(2, 4)
        got, want = run(result.model, {"ix": ix}), run(m, {"ix": ix})
        assert all(rel_err(want[k], got[k].astype(np.float32)) < 1e-3 for k in want)


@pytest.mark.parametrize("placement", ["greedy", "optimal"])
def test_an_existing_cast_serves_the_readers_that_need_its_type(placement):
    # v = MatMul (low) is read by Exp (FP32) and by the model's own Cast(v, to=FLOAT): the rewrite
    # added a second Cast(v, to=FLOAT) for Exp beside it; likewise a Cast(u, to=FLOAT16) the model
    # has beside a MatMul that needs u in FP16. One Cast per value and type.
    m = make_model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[2,4] x) => (float[2,4] vl, float[2,4] e, float[2,4] uf, float[2,4] mm) {
          v = MatMul(x, w)
          vc = Cast<to=1>(v)
          e = Exp(v)
          vl = Log(vc)
          u = Exp(x)
          uh = Cast<to=10>(u)
          uf = Cast<to=1>(uh)
          mm = MatMul(u, w)
        }""", {"w": np.full((4, 4), 0.25, np.float32)})
    result = rewrite(m, placement=placement)
    full_check(result.model)
    casts = [(n.input[0], n.attribute[0].i) for n in nodes_by_type(result.model, "Cast")]
    assert len(casts) == len(set(casts)), casts
    x = np.random.default_rng(0).uniform(0.5, 1.0, (2, 4)).astype(np.float32)
    got, want = run(result.model, {"x": x}), run(m, {"x": x})
    for name in want:
        assert rel_err(want[name], got[name]) < 1e-2


def test_the_models_own_cast_of_a_graph_output_reads_the_outputs_cast():
    # y = MatMul (low) is a graph output and the model casts it to FLOAT for an Exp: the output's
    # Cast back to FP32 and the model's own Cast both cast y's low value to FLOAT.
    m = make_model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[2,4] x) => (float[2,4] y, float[2,4] z) {
          y = MatMul(x, w)
          yc = Cast<to=1>(y)
          z = Exp(yc)
        }""", {"w": np.full((4, 4), 0.25, np.float32)})
    result = rewrite(m)
    full_check(result.model)
    casts = [(n.input[0], n.attribute[0].i) for n in nodes_by_type(result.model, "Cast")]
    assert len(casts) == len(set(casts)) == 2, casts  # x in, y out
    x = np.random.default_rng(0).uniform(0.5, 1.0, (2, 4)).astype(np.float32)
    got, want = run(result.model, {"x": x}), run(m, {"x": x})
    assert rel_err(want["z"], got["z"]) < 1e-2


def test_constant_of_shape_without_value_follows_its_consumers():
    m = make_model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[4,8] x) => (float[4,8] y) {
          a = MatMul(x, w)
          z = ConstantOfShape(shape)
          s = Add(a, z)
          y = MatMul(s, w)
        }""", {"w": (8, 8), "shape": np.array([4, 8], np.int64)})
    out = rewrite(m).model
    full_check(out)
    cos = nodes_by_type(out, "ConstantOfShape")[0]
    types = value_types(out)
    assert types[cos.output[0]] == FP16
    assert types[nodes_by_type(out, "Add")[0].output[0]] == FP16
    x = np.ones((4, 8), np.float32)
    run(out, {"x": x})


def test_constant_of_shape_fill_past_the_range_is_clamped_and_counted():
    """A ConstantOfShape made FP16 whose fill is float32's lowest value (torch's finfo.min mask
    fill) is written as -65504, not -inf, and the weight statistics count it clamped and a
    sentinel."""
    m = make_model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[4,8] x) => (float[4,8] y) {
          a = MatMul(x, w)
          z = ConstantOfShape<value = float[1] {-3.4028235e38}>(shape)
          s = Add(a, z)
          y = MatMul(s, w)
        }""", {"w": (8, 8), "shape": np.array([4, 8], np.int64)})
    result = rewrite(m)
    full_check(result.model)
    [fill] = [a.t for n in nodes_by_type(result.model, "ConstantOfShape") for a in n.attribute if a.name == "value"]
    assert fill.data_type == FP16
    assert onnx.numpy_helper.to_array(fill).tolist() == [-65504.0]
    stats = result.log.weights
    assert stats.clamped == 1
    assert [s["count"] for s in stats.sentinels] == [1]


def test_readers_of_a_constant_of_shape_fill_past_the_range_keep_fp32():
    """A ConstantOfShape filling with 100000 keeps FP32, and so do the Add and Sub reading its
    output: in FP16 the fill is inf (or clamped to 65504, 34% off) and h + 1e5 - 1e5 is not h."""
    model = make_model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[4,8] x) => (float[4,8] y) {
          h = MatMul(x, w)
          z = ConstantOfShape<value = float[1] {100000.0}>(shape)
          a = Add(h, z)
          s = Sub(a, z)
          y = MatMul(s, w)
        }""", {"w": (8, 8), "shape": np.array([4, 8], np.int64)})
    result = rewrite(model)
    full_check(result.model)
    for node in ("ConstantOfShape:z", "Add:a", "Sub:s"):
        decision = result.log.decisions[node]
        assert decision.precision == Precision.FP32 and "holding 100000" in decision.reason, (node, decision.reason)
    assert result.log.decisions["MatMul:h"].precision == Precision.LOW
    feeds = {"x": np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)}
    assert_emulated_close(model, result.model, feeds)


def test_dequantize_linear_made_low_writes_its_output_dtype():
    """DequantizeLinear-23 with output_dtype=FLOAT, made FP16 (--fp16-ops), kept output_dtype=1
    while its output was declared FP16: onnxruntime refused the model ('Type (tensor(float16)) of
    output arg (w) ... does not match expected type (tensor(float))')."""
    rng = np.random.default_rng(0)
    m = make_model("""
        <ir_version: 11, opset_import: ["" : 23]>
        g (float[2,8] x) => (float[2,8] y) {
          w = DequantizeLinear<output_dtype = 1>(wq, ws)
          y = MatMul(x, w)
        }""", {"wq": rng.integers(-100, 100, (8, 8)).astype(np.int8), "ws": np.array(0.01, np.float32)})
    out = rewrite(m, fp16_ops=["DequantizeLinear"]).model
    full_check(out)
    dq = nodes_by_type(out, "DequantizeLinear")[0]
    assert value_types(out)[dq.output[0]] == FP16
    assert [(a.name, a.i) for a in dq.attribute] == [("output_dtype", FP16)]
    x = rng.standard_normal((2, 8)).astype(np.float32)
    weights = {t.name: onnx.numpy_helper.to_array(t) for t in m.graph.initializer}
    want = x @ (weights["wq"].astype(np.float32) * weights["ws"])
    from tools.ortrun import OPT_LEVEL_ENV

    with pytest.MonkeyPatch.context() as mp:  # (onnxruntime's DQ→MatMulNBits fusion reads the scale's type)
        mp.setenv(OPT_LEVEL_ENV, "disable")
        assert rel_err(want, run(out, {"x": x})["y"]) < 1e-2


# 3. An initializer shared by an FP32 consumer and an FP16 consumer.
def test_shared_initializer_never_mismatches():
    m = make_model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[8,8] x) => (float[8,8] y, float[1,8] t) {
          y = MatMul(x, w)
          t = ReduceSum<keepdims=1>(w, axes)
        }""", {"w": (8, 8), "axes": np.array([0], np.int64)})
    out = rewrite(m).model
    full_check(out)
    types = value_types(out)
    mm = nodes_by_type(out, "MatMul")[0]
    rs = nodes_by_type(out, "ReduceSum")[0]
    assert types[mm.input[1]] == FP16 and types[rs.input[0]] == FP32
    x = np.random.default_rng(1).standard_normal((8, 8)).astype(np.float32)
    ref, got = run(m, {"x": x}), run(out, {"x": x})
    np.testing.assert_allclose(ref["t"], got["t"], rtol=1e-6)  # the FP32 consumer saw exact weights


@pytest.mark.parametrize("scope", ["main", "branch", "main-ir3", "main-ir4"])
def test_shared_constant_node_is_copied_clamped_not_cast_at_run_time(scope):
    """A Constant node (not an initializer) read by an FP16 MatMul and an FP32 reduction got a
    run-time Cast for the MatMul: its 1e5 became inf there, and so did the outputs. Shared like an
    initializer, it now gives the FP16 reader a copy converted offline (clamped to 65504 and
    counted), in a branch too, and at IR 3 (where the copy is listed among the graph inputs; from IR 4
    it is not)."""
    w = ",".join(["100000.0"] + ["0.1"] * 63)
    body = f"""w = Constant<value = float[8,8] {{{w}}}>()
               h = MatMul(x, w)
               r = ReduceSum<keepdims=1, axes=[0]>(w)"""
    if scope == "branch":
        text = f"""<ir_version: 8, opset_import: ["" : 12]>
            g (float[4,8] x, bool c) => (float[4,8] y, float[1,8] t) {{
              y, t = If(c) <
                then_branch = a () => (float[4,8] h, float[1,8] r) {{ {body} }},
                else_branch = b () => (float[4,8] h2, float[1,8] r2) {{ h2 = Identity(x)
                                                                         r2 = ReduceSum<keepdims=1, axes=[0]>(x) }}
              >
            }}"""
    else:
        text = f"""<ir_version: 8, opset_import: ["" : 12]>
            g (float[4,8] x) => (float[4,8] y, float[1,8] t) {{
              {body}
              y = Identity(h)
              t = Identity(r)
            }}"""
    model = make_model(text, ir_version={"main-ir3": 3, "main-ir4": 4}.get(scope, 8))
    result = rewrite(model)
    out = result.model
    full_check(out)
    graphs = [out.graph] + [a.g for n in out.graph.node for a in n.attribute if a.type == onnx.AttributeProto.GRAPH]
    assert not any(n.op_type == "Cast" and n.input[0] == "w" for g in graphs for n in g.node)
    assert result.log.weights.clamped == 1
    listed = {t.name for t in out.graph.initializer} & {i.name for i in out.graph.input}
    assert bool(listed) == (scope == "main-ir3")
    feeds = {"x": np.random.default_rng(0).uniform(0, 0.5, (4, 8)).astype(np.float32)}
    if scope == "branch":
        feeds["c"] = np.array(True)
    ref, got = run(model, feeds), run(out, feeds)
    assert np.isfinite(got["y"]).all()  # (was inf: the run-time Cast of 1e5)
    np.testing.assert_array_equal(ref["t"], got["t"])  # the FP32 reader saw the exact constant
    assert not rewrite(out).modified


# 4. Resize roi/scales (float control inputs) stay FP32.
def test_resize_scales_stay_fp32():
    m = make_model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[1,2,4,4] x) => (float[1,2,8,8] y) {
          c = Conv<pads=[1,1,1,1]>(x, w)
          r = Resize<mode="nearest">(c, roi, scales)
          y = Conv<pads=[1,1,1,1]>(r, w)
        }""", {"w": (2, 2, 3, 3), "roi": np.zeros(0, np.float32), "scales": np.array([1, 1, 2, 2], np.float32)})
    out = rewrite(m).model
    full_check(out)
    types = value_types(out)
    resize = nodes_by_type(out, "Resize")[0]
    assert types[resize.input[0]] == FP16
    assert types[resize.input[2]] == FP32  # scales
    assert not any(c.input[0] in ("scales", "roi") for c in nodes_by_type(out, "Cast"))
    run(out, {"x": np.ones((1, 2, 4, 4), np.float32)})


# 5. No FP32 -> FP16 -> FP32 round trips, including when every node is blocked.
def test_all_blocked_model_is_left_unchanged():
    m = make_model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[4,8] x) => (float[4,1] y) {
          e = Exp(x)
          y = ReduceSum<keepdims=1>(e, axes)
        }""", {"axes": np.array([1], np.int64)})
    result = rewrite(m)
    assert not result.modified
    assert result.model.SerializeToString() == m.SerializeToString()


def test_large_values_between_fp32_ops_never_pass_through_fp16():
    # x (1e5, above FP16's 65504) goes through a Reshape to an FP32 ReduceSum and to a MatMul.
    # Painting the Reshape low would round-trip x through FP16 and turn the sum into inf.
    m = make_model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[4,8] x) => (float[4,8] y, float[4,1] s) {
          r = Reshape(x, shape)
          s = ReduceSum<keepdims=1>(r, axes)
          y = MatMul(r, w)
        }""", {"w": (8, 8), "shape": np.array([4, 8], np.int64), "axes": np.array([1], np.int64)})
    out = rewrite(m).model
    full_check(out)
    x = np.full((4, 8), 1e5, np.float32)
    got = run(out, {"x": x})
    assert np.isfinite(got["s"]).all()
    np.testing.assert_allclose(got["s"], run(m, {"x": x})["s"], rtol=1e-6)


@pytest.mark.parametrize("placement", ["greedy", "optimal"])
def test_a_round_trip_longer_than_one_node_is_kept_fp32(placement):
    # Identity reads x and feeds a MatMul (clear-spread paints it low) and a Pow (FP32): safety keeps
    # it FP32. Transpose → Reshape, painted low from it, then ran x through FP16 on a path of two
    # non-allow nodes between FP32 ops: each node checked alone read or fed a low one, and stayed low.
    m = make_model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[4,4] x) => (float[4,4] mm, float[4,4] p, float[4,4] e) {
          i = Identity(x)
          mm = MatMul(i, w)
          p = Pow(i, two)
          t = Transpose<perm=[1,0]>(i)
          r = Reshape(t, shape)
          s = Mul(r, k)
          e = Exp(s)
        }""", {"w": np.full((4, 4), 1e-6, np.float32), "two": np.array(2.0, np.float32),
               "k": np.array(1e-5, np.float32), "shape": np.array([4, 4], np.int64)})
    result = rewrite(m, placement=placement)
    full_check(result.model)
    precision = {d.node: d.precision.value for d in result.log.decisions.values()}
    assert precision["Transpose:t"] == precision["Reshape:r"] == "fp32"
    assert precision["MatMul:mm"] == "low"
    x = np.full((4, 4), 1e5, np.float32)
    np.testing.assert_allclose(run(result.model, {"x": x})["e"], run(m, {"x": x})["e"], rtol=1e-6)


@pytest.mark.parametrize("placement", ["greedy", "optimal"])
def test_a_round_trip_ending_in_an_existing_cast_to_float_is_kept_fp32(placement):
    # x → Split → {MatMul, Transpose → Cast(to=FLOAT) → Mul → Exp}. A Cast reads any type, so it
    # was no end of a round trip: Split and Transpose went low, and the model's own Cast took x
    # (1e5) from FP16 (inf) back to FP32. The readers behind the Cast decide.
    m = make_model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[2,4] x) => (float[2,2] e, float[2,2] mm) {
          a, b = Split<axis=1>(x, sp)
          mm = MatMul(b, w)
          t = Transpose<perm=[1,0]>(a)
          c = Cast<to=1>(t)
          s = Mul(c, k)
          e = Exp(s)
        }""", {"w": np.full((2, 2), 1e-6, np.float32), "sp": np.array([2, 2], np.int64),
               "k": np.array(1e-5, np.float32)})
    result = rewrite(m, placement=placement)
    full_check(result.model)
    precision = {d.node: d.precision.value for d in result.log.decisions.values()}
    assert precision["Split:a"] == precision["Transpose:t"] == "fp32" and precision["MatMul:mm"] == "low"
    x = np.array([[1e5, 2e5, 1e-3, 1e-3], [3e5, 1e5, 1e-3, 1e-3]], np.float32)
    np.testing.assert_allclose(run(result.model, {"x": x})["e"], run(m, {"x": x})["e"], rtol=1e-6)


@pytest.mark.parametrize("placement", ["greedy", "optimal"])
def test_a_no_op_cast_to_float_is_no_wall_between_low_ops(placement):
    """q = MatMul * table, then Cast(to=FLOAT) of that FP32 value before QK^T (GPT-J's
    ``query.to(float32)``): a no-op in the FP32 model. Painting saw no edge through it, so the
    Muls were "not between fp16 ops" and stayed FP32 with Casts around them (4 Casts, not 2);
    cast placement then dropped the Cast as a no-op anyway."""
    m = make_model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[4,8] x) => (float[4,4] y) {
          q = MatMul(x, wq)
          k = MatMul(x, wk)
          qr = Mul(q, table)
          kr = Mul(k, table)
          qf = Cast<to=1>(qr)
          kf = Cast<to=1>(kr)
          kt = Transpose<perm=[1,0]>(kf)
          y = MatMul(qf, kt)
        }""", {"wq": (8, 8), "wk": (8, 8), "table": (4, 8)})
    result = rewrite(m, placement=placement)
    out = result.model
    full_check(out)
    precision = {d.node: d.precision.value for d in result.log.decisions.values()}
    assert precision["Mul:qr"] == precision["Mul:kr"] == "low", precision
    assert len(nodes_by_type(out, "Cast")) == 2  # the graph input and output only
    x = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
    assert rel_err(run(m, {"x": x})["y"], run(out, {"x": x})["y"]) < 1e-2
    assert not rewrite(out, placement=placement).modified


@pytest.mark.parametrize("placement", ["greedy", "optimal"])
def test_an_existing_cast_read_by_another_cast_is_not_retargeted(placement):
    """c = Cast(to=FLOAT) of an FP32 Relu feeds a low MatMul and a second Cast(to=FLOAT) before a
    ReduceMax. A Cast reader needs no inserted Cast, so c looked read only in low precision and was
    retargeted: the ReduceMax then read the Relu through FP16 (1e5 came back as inf)."""
    m = make_model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[4,8] x) => (float[4,8] y, float[4] z) {
          rl = Relu(x)
          c = Cast<to=1>(rl)
          y = MatMul(c, w)
          z0 = Cast<to=1>(c)
          z = ReduceMax<axes=[-1], keepdims=0>(z0)
        }""", {"w": np.eye(8, dtype=np.float32) * 1e-3})
    out = rewrite(m, placement=placement).model
    full_check(out)
    assert value_types(out)[nodes_by_type(out, "MatMul")[0].output[0]] == FP16
    x = np.full((4, 8), 1e5, np.float32)
    ref, got = run(m, {"x": x}), run(out, {"x": x})
    np.testing.assert_array_equal(got["z"], ref["z"])
    assert rel_err(ref["y"], got["y"]) < 1e-2
    assert not rewrite(out, placement=placement).modified


# 6. Inserted casts: unique names even against colliding user names; topologically sorted.
def test_inserted_names_unique_and_sorted():
    m = make_model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[4,8] x) => (float[4,8] y) {
          a = MatMul(x, w)
          "x/amp_fp16" = Identity(a)
          y = MatMul("x/amp_fp16", w)
        }""", {"w": (8, 8)})
    out = rewrite(m).model
    full_check(out)  # the checker rejects duplicate value names and unsorted graphs
    names = [o for n in out.graph.node for o in n.output]
    assert len(names) == len(set(names))
    node_names = [n.name for n in out.graph.node if n.name]
    assert len(node_names) == len(set(node_names))
    run(out, {"x": np.ones((4, 8), np.float32)})


# 7. A blocked op inside an If body gets its cast inside the body, not in the outer graph.
def test_casts_live_in_the_subgraph_that_needs_them():
    m = make_model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[4,8] x, bool c) => (float[4,8] y) {
          h = MatMul(x, w)
          y = If(c) <
            then_branch = t () => (float[4,8] o) {
              p = MatMul(h, w)
              e = Exp(p)
              o = MatMul(e, w)
            },
            else_branch = f () => (float[4,8] o2) {
              o2 = Identity(h)
            }>
        }""", {"w": (8, 8)})
    out = rewrite(m).model
    full_check(out)
    then = next(a.g for a in nodes_by_type(out, "If")[0].attribute if a.name == "then_branch")
    body_casts = [n for n in then.node if n.op_type == "Cast"]
    assert body_casts, "the body's Exp needs FP32 and its MatMuls FP16: casts belong in the body"
    outer_exp_casts = [n for n in out.graph.node if n.op_type == "Cast" and "e" in n.input]
    assert not outer_exp_casts
    x = np.random.default_rng(2).standard_normal((4, 8)).astype(np.float32) * 0.1
    for c in (True, False):
        feeds = {"x": x, "c": np.array(c)}
        assert rel_err(run(m, feeds)["y"], run(out, feeds)["y"]) < 1e-2


# 9. Constants clamp at the true FP16 limit (65504), not at 1e4; the counts are reported.
def test_constants_clamp_at_true_fp16_limits():
    w = np.zeros((8, 8), np.float32)
    w[0, 0], w[1, 1], w[2, 2], w[3, 3] = 30000.0, 1e6, -1e6, 1e-9
    m = make_model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[4,8] x) => (float[4,8] y) { y = MatMul(x, w) }""", {"w": w})
    result = rewrite(m)
    out = result.model
    full_check(out)
    conv = onnx.numpy_helper.to_array(next(t for t in out.graph.initializer if t.name == "w"))
    assert conv.dtype == np.float16
    assert conv[0, 0] == 30000 and conv[1, 1] == 65504 and conv[2, 2] == -65504 and conv[3, 3] == 0
    stats = result.log.weights
    assert stats.clamped == 2 and stats.flushed_to_zero == 1
    assert result.report.summary()["weights"]["clamped"] == 2


# 10. Ops with no FP16 kernel on the provider stay FP32 even when a rule file says otherwise.
def test_op_without_fp16_kernel_stays_fp32(tmp_path):
    rules = tmp_path / "r.toml"
    rules.write_text('[allow]\nGridSample = "user wants it low"\n')
    m = make_model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[1,2,4,4] x, float[1,4,4,2] grid) => (float[1,2,4,4] y) {
          c = Conv<pads=[1,1,1,1]>(x, w)
          s = GridSample(c, grid)
          y = Conv<pads=[1,1,1,1]>(s, w)
        }""", {"w": (2, 2, 3, 3)})
    result = rewrite(m, rules=[str(rules)])
    out = result.model
    full_check(out)
    types = value_types(out)
    assert types[nodes_by_type(out, "GridSample")[0].output[0]] == FP32
    decision = next(d for d in result.log.decisions.values() if d.op == "GridSample")
    assert "no float16 kernel" in decision.reason


@pytest.mark.parametrize("force", ["fp16_ops", "fp16_nodes"])
def test_forcing_low_never_skips_the_kernel_table(force):
    # --fp16-nodes returned before the kernel table was read, and an op CUDA runs in no float type
    # at all (Det, Hardmax) counted as unknown to the table: both went low with no kernel.
    m = make_model("""
        <ir_version: 8, opset_import: ["" : 20]>
        g (float[1,2,4,4] x, float[1,4,4,2] grid, float[2,3,3] a) => (float[1,2,4,4] y, float[2] d) {
          c = Conv<pads=[1,1,1,1]>(x, w)
          s = GridSample(c, grid)
          y = Conv<pads=[1,1,1,1]>(s, w)
          d = Det(a)
        }""", {"w": (2, 2, 3, 3)})
    options = {"fp16_ops": ["GridSample", "Det"]} if force == "fp16_ops" else {"fp16_nodes": ["GridSample:s", "Det:d"]}
    result = rewrite(m, **options)
    full_check(result.model)
    for op, why in (("GridSample", "no float16 kernel for GridSample"), ("Det", "no kernel for Det at opset 20")):
        decision = next(d for d in result.log.decisions.values() if d.op == op)
        assert decision.precision == Precision.FP32 and why in decision.reason, decision


# 12. A decomposed LayerNorm (Pow/ReduceMean) overflows in FP16. Where no fused op can take it (here
# fuse=False; also below opset 17 without a residual Add, see test_fuse.py) it is one FP32 island;
# by default it becomes a fused op whose kernel keeps the statistics in FP32. Neither overflows.
LN13 = """
    <ir_version: 8, opset_import: ["" : 13]>
    g (float[2,4,8] x) => (float[2,4,8] y) {
      q = MatMul(x, wq)
      r = Add(q, x)
      m = ReduceMean<axes=[-1]>(r)
      d = Sub(r, m)
      p = Pow(d, two)
      v = ReduceMean<axes=[-1]>(p)
      ve = Add(v, eps)
      sd = Sqrt(ve)
      n = Div(d, sd)
      ng = Mul(n, g)
      ln = Add(ng, b)
      y = MatMul(ln, wo)
    }"""


def _ln_model():
    return make_model(LN13, {"wq": (8, 8), "wo": (8, 8), "g": np.ones(8, np.float32),
                             "b": np.zeros(8, np.float32), "two": np.array(2.0, np.float32),
                             "eps": np.array(1e-5, np.float32)})


@pytest.mark.parametrize("body, pattern", [
    ("e = Exp(h)\n      s = ReduceSum<keepdims = 1>(e, axes)\n      z = Div(e, s)", "softmax"),
    # a GELU's derivative (exp(-h²/2)) beside a bias gradient's sum: an Exp and a ReduceSum, no softmax
    ("sq = Mul(h, h)\n      ng = Mul(sq, half)\n      e = Exp(ng)\n      d = Mul(e, h)\n"
     "      s = ReduceSum<keepdims = 1>(h, axes)\n      z = Add(d, s)", "reduction"),
    # an Exp read by its sum and by an Add, with no division: a reduction, not a softmax
    ("e = Exp(h)\n      s = ReduceSum<keepdims = 1>(e, axes)\n      z = Add(e, s)", "reduction"),
    # a LogSoftmax alone (read by a MatMul, no loss after it) is a softmax, not a loss
    ("z = LogSoftmax(h)", "softmax")])
def test_an_island_is_named_a_softmax_only_when_it_divides_an_exp_by_its_sum(body, pattern):
    """The report named every FP32 island holding an Exp and a ReduceSum (or a Div) anywhere a
    softmax pattern: a training graph's GELU backward pass beside a bias gradient's sum was one."""
    m = make_model(f"""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[2,8] x) => (float[2,8] y) {{
      h = MatMul(x, w1)
      {body}
      y = MatMul(z, w2)
    }}""", {"w1": (8, 8), "w2": (8, 8), "axes": np.array([-1], np.int64), "half": np.array(-0.5, np.float32)})
    islands = rewrite(m).log.islands
    assert [i.pattern for i in islands] == [pattern]


def test_island_cast_counts_leave_out_the_models_own_retargeted_cast():
    """An island counts only the casts the rewrite inserted at its edges: the model's own
    ``Cast(to=FLOAT)`` after the Exp, retargeted to fp16, carries the island's output to the low
    MatMul but is not counted as a cast out."""
    from amp_rewrite.passes.islands import describe

    m = make_model("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[2,8] x) => (float[2,8] y) {
      h = MatMul(x, w1)
      z = Exp(h)
      zc = Cast<to=1>(z)
      y = MatMul(zc, w2)
    }""", {"w1": (8, 8), "w2": (8, 8)})
    result = rewrite(m)
    [own] = [c for c in result.log.casts if c.kind == "retargeted"]
    assert own.tensor == "z" and own.consumers == ["MatMul:y"]
    [island] = result.log.islands
    assert island.members == ["Exp:z"] and (island.casts_in, island.casts_out) == (1, 0)
    assert describe(island) == "exponential pattern, 1 node, 1 cast in, 0 out"


def test_decomposed_layernorm_is_one_fp32_island():
    result = rewrite(_ln_model(), fuse=False)
    out = result.model
    full_check(out)
    assert len(result.log.islands) == 1
    island = result.log.islands[0]
    assert island.pattern == "LayerNorm"
    assert {"ReduceMean:m", "Pow:p", "Sqrt:sd", "Div:n"} <= set(island.members)
    assert island.casts_in == 1 and island.casts_out == 1
    types = value_types(out)
    for name in ("m", "d", "p", "v", "sd", "n", "ln"):
        assert types[name] == FP32, name
    assert all(types[mm.output[0]] == FP16 or mm.output[0].endswith("amp_fp16")
               for mm in nodes_by_type(out, "MatMul"))


@pytest.mark.parametrize("fuse", [False, True], ids=["island", "fused"])
def test_decomposed_layernorm_does_not_overflow(fuse):
    m = _ln_model()
    result = rewrite(m, fuse=fuse)
    assert bool(result.log.fusions) == fuse
    out = result.model
    # deviations of ~300 square to ~90000: inf in FP16, fine in the FP32 island
    x = (np.random.default_rng(3).standard_normal((2, 4, 8)) * 300).astype(np.float32)
    ref, got = run(m, {"x": x})["y"], run(out, {"x": x})["y"]
    assert np.isfinite(got).all()
    assert rel_err(ref, got) < 1e-2


def test_bf16_target_uses_bf16_casts_only():
    out = rewrite(_ln_model(), target="bf16").model
    full_check(out)
    assert all(c.attribute[0].i in (FP32, BF16) for c in nodes_by_type(out, "Cast"))
    assert BF16 in value_types(out).values()


# -- weight conversion: the counts behind pitfall 9's report -----------------------------------------------
def _reference_conversion(data: np.ndarray, target):
    """Each element on its own: clamp finite values beyond the type's range, then count what
    rounded to zero from a nonzero, non-NaN value, and the sentinels (|x| ≥ 1e8, inf included)."""
    import ml_dtypes

    limit = float(ml_dtypes.finfo(target).max)
    over = np.isfinite(data) & (np.abs(data) > limit)
    converted = np.where(over, np.sign(data) * limit, data).astype(target)
    zero_now = (converted.view(np.uint16) & 0x7FFF) == 0
    flushed = int(np.count_nonzero(zero_now & (data != 0) & ~np.isnan(data)))
    hits = data[np.abs(data) >= 1e8]
    sentinel = {"count": int(hits.size), "min": float(hits.min()), "max": float(hits.max())} if hits.size else None
    return converted, int(np.count_nonzero(over)), flushed, sentinel


@pytest.mark.parametrize("target", ["fp16", "bf16"])
def test_weight_conversion_counts_match_an_element_by_element_reference(target):
    """``convert_array`` skips the clamp, sentinel and flush passes when a tensor's largest and
    smallest magnitudes show there is nothing to find: on tensors with and without each case
    (NaN, ±inf, exact zeros, subnormal and huge values, half the smallest subnormal, empty), it
    returns the reference's array bit for bit and its counts."""
    import ml_dtypes
    from amp_rewrite.emitters.onnx_emitter import convert_array

    dtype = np.float16 if target == "fp16" else ml_dtypes.bfloat16
    rng = np.random.default_rng(7)
    specials = np.array([0.0, -0.0, np.nan, np.inf, -np.inf, 1e8, -1e8, 1e9, -3.4e38, 7e4, -6.6e4, 65504.0, 65519.0, 65520.0,
                         1e-9, -2.9e-8, 3e-8, 6e-8, 1e-40, -1e-45, 1e-38], np.float32)
    half_tiniest = float(ml_dtypes.finfo(dtype).smallest_subnormal) / 2  # (rounds to zero: ties to even)
    cases = [np.zeros(0, np.float32), rng.standard_normal(1000).astype(np.float32),
             np.abs(rng.standard_normal(100)).astype(np.float32) + 1e-3,
             np.array([half_tiniest, -half_tiniest, 1.0], np.float32)]
    for k in range(60):
        base = rng.standard_normal(64).astype(np.float32) * np.float32(10.0 ** rng.integers(-8, 6))
        picks = rng.choice(specials, size=int(rng.integers(0, 4)))
        base[rng.choice(64, size=picks.size, replace=False)] = picks
        cases.append(base)
    for data in cases:
        got = convert_array(data, dtype)
        want = _reference_conversion(data, dtype)
        assert np.array_equal(got[0].view(np.uint16), want[0].view(np.uint16)), data
        assert got[1:] == want[1:], (data, got[1:], want[1:])


def _rotary(angle_from: str) -> onnx.ModelProto:
    """An in-graph rotary table as HF Llama exports it: inv_freq @ positions -> Transpose -> Concat
    -> Cos, multiplied into the activations. ``angle_from``: "positions" (an int64 input cast to
    float), "range" (a float Range from an offset of 4000 to a float limit given at run time) or
    "features" (a float graph input: Fourier features)."""
    source = {"positions": "int64[1,1,16] pid", "range": "float pid"}.get(angle_from, "float[1,1,16] pid")
    cast = {"positions": "pf = Cast<to=1>(pid)",
            "range": "r = Range(start, pid, one)\n      pf = Reshape(r, shape3)"}.get(angle_from, "pf = Identity(pid)")
    text = f"""
    <ir_version: 10, opset_import: ["" : 17]>
    g (float[1,16,8] x, {source}) => (float[1,16,8] y) {{
      {cast}
      fr = MatMul(invf, pf)
      frt = Transpose<perm=[0, 2, 1]>(fr)
      emb = Concat<axis=-1>(frt, frt)
      c = Cos(emb)
      h = MatMul(x, w)
      hc = Mul(h, c)
      y = MatMul(hc, w2)
    }}"""
    invf = (1.0 / (10000 ** (np.arange(0, 8, 2) / 8))).astype(np.float32).reshape(4, 1)
    extra = {"start": np.array(4000.0, np.float32), "one": np.array(1.0, np.float32),
             "shape3": np.array([1, 1, 16], np.int64)} if angle_from == "range" else {}
    return make_model(text, {"invf": invf, "w": (8, 8), "w2": (8, 8), **extra})


@pytest.mark.parametrize("angle_from", ["positions", "range"])
@pytest.mark.parametrize("placement", ["optimal", "greedy"])
@pytest.mark.parametrize("target", ["fp16", "bf16"])
def test_rotary_angles_from_positions_are_computed_in_fp32(placement, target, angle_from):
    """Cos is kept FP32 for its argument's precision, but the angle inv_freq @ positions was an
    allow MatMul made low (and the positions' Cast retargeted to it): the angle arrived rounded
    (positions 4000-4015: rel err 0.83 in FP16). The nodes computing a Sin/Cos argument from
    integers and constants only now keep FP32; the model's other MatMuls stay low. A float Range
    counts positions whatever its limit: one given at run time (a float input) made the search
    stop there, and the angles went low (0.43 off)."""
    from amp_rewrite.emulate import emulate_low

    model = _rotary(angle_from)
    result = rewrite(model, placement=placement, target=target)
    full_check(result.model)
    decisions = result.log.decisions
    for name in ("MatMul:fr", "Transpose:frt", "Concat:emb"):
        assert decisions[name].precision == Precision.FP32, name
        assert "from integers and constants only" in decisions[name].reason
    assert decisions["MatMul:h"].precision == decisions["MatMul:y"].precision == Precision.LOW
    assert value_types(result.model)["pf"] == FP32  # the positions' Cast is not retargeted
    pid = (np.arange(16) + 4000).reshape(1, 1, 16).astype(np.int64) if angle_from == "positions" \
        else np.array(4016.0, np.float32)
    feeds = {"x": np.random.default_rng(0).standard_normal((1, 16, 8)).astype(np.float32), "pid": pid}
    emulated, _ = emulate_low(result.model, FP16 if target == "fp16" else BF16)
    assert rel_err(run(model, feeds)["y"], run(emulated, feeds)["y"]) < (1e-2 if target == "fp16" else 5e-2)
    assert not rewrite(result.model, placement=placement, target=target).modified


def test_angles_from_a_float_input_are_left_to_painting():
    """Fourier features of a float input: nothing says the input is a position, so the rule does
    not apply and the MatMul follows its own (allow) rule."""
    result = rewrite(_rotary("features"))
    assert result.log.decisions["MatMul:fr"].precision == Precision.LOW


def alibi_attention(bias: str, inits: dict | None = None) -> onnx.ModelProto:
    """One decode step of an attention whose scaled scores ``s2`` become ``sb`` through ``bias``
    (ONNX text), beside a padding mask ``(1 - mask) * -10000``; ``inits``: its constants."""
    text = f"""
    <ir_version: 10, opset_import: ["" : 17]>
    g (float[1,1,8] x, int64[1,N] mask, float[1,N,8] k, float[1,N,8] v) => (float[1,1,8] y) {{
      q = MatMul(x, wq)
      kt = Transpose<perm=[0, 2, 1]>(k)
      s = MatMul(q, kt)
      s2 = Mul(s, scale)
      {bias}
      mf = Cast<to=1>(mask)
      inv = Sub(one_f, mf)
      mb = Mul(inv, neg)
      sm = Add(sb, mb)
      p = Softmax<axis=-1>(sm)
      a = MatMul(p, v)
      y = MatMul(a, wo)
    }}"""
    return make_model(text, {"wq": (8, 8), "wo": (8, 8), "scale": np.array(8 ** -0.5, np.float32),
                             "one_f": np.array(1.0, np.float32), "neg": np.array(-10000.0, np.float32),
                             **(inits or {})})


def _alibi_step(bias_from: str) -> onnx.ModelProto:
    """An attention step with an ALiBi bias, as BLOOM and Falcon build it: ``slope *
    (cumsum(mask) - 1)`` (``bias_from="cumsum"``) or ``slope * range(n)`` (``"range"``), or as an
    exporter folds MPT's (``"table"``); ``"mask"``: the padding mask only."""
    positions = {"cumsum": "cs = CumSum(mask, ax)\n      pos = Sub(cs, one_i)",
                 "range": "n = Shape<start=1, end=2>(mask)\n      ns = Squeeze(n)\n      pos = Range(zero_i, ns, one_i)"}
    bias = "sb = Identity(s2)" if bias_from == "mask" else f"""{positions.get(bias_from, "")}
      pf = Cast<to=1>(pos)
      bias = Mul(slope, pf)
      sb = Add(s2, bias)"""
    inits = {"ax": np.array(1, np.int64), "one_i": np.array(1, np.int64), "zero_i": np.array(0, np.int64),
             "slope": np.array(0.7071, np.float32)}
    if bias_from == "table":  # (MPT: the exporter folds slope * arange(max_seq_len) into a constant)
        bias = """n = Shape<start=1, end=2>(mask)
      bias = Slice(table, zero_1, n, ax_1)
      sb = Add(s2, bias)"""
        inits = {"table": (0.7071 * np.arange(4096, dtype=np.float32)).reshape(1, 4096),
                 "zero_1": np.array([0], np.int64), "ax_1": np.array([1], np.int64)}
    return alibi_attention(bias, inits)


@pytest.mark.parametrize("bias_from", ["cumsum", "range", "table"])
@pytest.mark.parametrize("placement", ["optimal", "greedy"])
@pytest.mark.parametrize("target", ["fp16", "bf16"])
def test_an_alibi_bias_from_positions_keeps_the_scores_fp32_up_to_the_softmax(placement, target, bias_from):
    """The bias was computed FP32 but cast to the low type before the score Add: at 3000 positions
    it is near 2100, where fp16's spacing is 2 and bf16's 16, so every logit was rounded (the
    output 0.54 off in fp16, 0.95 in bf16; 2e-4 / 2.5e-3 now). The Add, the mask Add after it and
    the Softmax keep FP32, as torch's type promotion does; the MatMuls stay low. ``table``: the
    exporter folded ``slope * arange(max_seq_len)`` into a constant (MPT), sliced to the sequence."""
    from amp_rewrite.emulate import emulate_low

    model = _alibi_step(bias_from)
    result = rewrite(model, placement=placement, target=target)
    full_check(result.model)
    decisions = result.log.decisions
    for name in ("Add:sb", "Add:sm", "Softmax:p"):
        assert decisions[name].precision == Precision.FP32, name
        assert "bias computed from positions" in decisions[name].reason, name
    for name in ("MatMul:s", "MatMul:a", "MatMul:y"):
        assert decisions[name].precision == Precision.LOW, name
    n = 3000
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((1, 1, 8)).astype(np.float32), "mask": np.ones((1, n), np.int64),
             "k": rng.standard_normal((1, n, 8)).astype(np.float32),
             "v": rng.standard_normal((1, n, 8)).astype(np.float32)}
    emulated, _ = emulate_low(result.model, FP16 if target == "fp16" else BF16)
    assert rel_err(run(model, feeds)["y"], run(emulated, feeds)["y"]) < (5e-3 if target == "fp16" else 2e-2)
    assert not rewrite(result.model, placement=placement, target=target).modified


def test_a_padding_mask_alone_is_no_position_bias():
    """``(1 - mask) * -10000`` converts the mask itself (no CumSum, no Range): the score Add and the
    Softmax stay low, as before."""
    result = rewrite(_alibi_step("mask"))
    for name in ("Add:sm", "Softmax:p"):
        assert result.log.decisions[name].precision == Precision.LOW, name


def _unrolled_ema(steps: int) -> onnx.ModelProto:
    """``h = a * h + (1 - a) * u[:, t]`` unrolled over ``steps`` as an exporter writes a Python loop,
    with ``a = exp(-exp(w))`` (0.9933-0.99966) and MatMuls before and after."""
    lines = ["u = MatMul(x, w1)", "e = Exp(w)", "ne = Neg(e)", "a = Exp(ne)", "oma = Sub(one, a)", "h0 = Mul(a, zeros)"]
    for t in range(steps):
        lines += [f"ut{t} = Gather<axis=1>(u, i{t})", f"m{t} = Mul(a, h{t})", f"n{t} = Mul(oma, ut{t})",
                  f"h{t + 1} = Add(m{t}, n{t})"]
    lines += [f"st = Concat<axis=0>({', '.join(f'h{t + 1}' for t in range(steps))})", "y = MatMul(st, w2)"]
    body = "\n      ".join(lines)
    text = f"""
    <ir_version: 10, opset_import: ["" : 17]>
    g (float[1,{steps},16] x) => (float[{steps},16] y) {{
      {body}
    }}"""
    rng = np.random.default_rng(0)
    inits = {"w1": (rng.standard_normal((16, 16)) * 0.3).astype(np.float32),
             "w2": (rng.standard_normal((16, 16)) * 0.3).astype(np.float32),
             "w": np.linspace(-8, -5, 16).astype(np.float32), "one": np.array(1.0, np.float32),
             "zeros": np.zeros((1, 16), np.float32), **{f"i{t}": np.array(t, np.int64) for t in range(steps)}}
    return make_model(text, inits)


@pytest.mark.parametrize("placement", ["optimal", "greedy"])
def test_a_recurrence_unrolled_in_the_graph_keeps_its_state_fp32(placement):
    """An exporter writes a Python loop's recurrence as a chain of steps; painted bf16 between two
    MatMuls, the state was rounded at every step and ``a`` (0.99966) held as 1.0: 0.15 off over 200
    steps (8.8e-3 now), where autocast keeps the state FP32. The steps keep FP32; the MatMuls stay
    low."""
    from amp_rewrite.emulate import emulate_low

    model = _unrolled_ema(200)
    result = rewrite(model, placement=placement, target="bf16")
    full_check(result.model)
    decisions = result.log.decisions
    assert decisions["Mul:m150"].precision == decisions["Add:h151"].precision == Precision.FP32
    assert "a step of a recurrence written as a loop" in decisions["Add:h151"].reason
    assert decisions["MatMul:u"].precision == decisions["MatMul:y"].precision == Precision.LOW
    feeds = {"x": (np.random.default_rng(1).standard_normal((1, 200, 16)) + 1.0).astype(np.float32)}
    got = run(emulate_low(result.model, BF16)[0], feeds)["y"]
    assert rel_err(run(model, feeds)["y"], got) < 1.5e-2
    assert not rewrite(result.model, placement=placement, target="bf16").modified


@pytest.mark.parametrize("placement", ["optimal", "greedy"])
def test_a_castlike_of_integers_read_in_fp32_is_no_round_trip(placement):
    """CastLike(ids, h) takes h's type: with h FP16 its output was FP16 and cast back to FP32 for
    the ReduceSum, an int -> FP16 -> FP32 trip (ids above 65504 became inf). A CastLike of a
    non-float input now counts as reading FP32 data, so the round-trip rule keeps it FP32."""
    model = make_model("""
    <ir_version: 10, opset_import: ["" : 17]>
    g (float[4,8] x, int64[4,8] ids) => (float y, float[4,8] z) {
      h = MatMul(x, w)
      c = CastLike(ids, h)
      y = ReduceSum<keepdims=0>(c)
      z = MatMul(h, w)
    }""", {"w": (8, 8)})
    result = rewrite(model, placement=placement)
    full_check(result.model)
    assert result.log.decisions["CastLike:c"].precision == Precision.FP32
    assert result.log.decisions["MatMul:h"].precision == Precision.LOW
    feeds = {"x": np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32),
             "ids": (np.arange(32).reshape(4, 8) * 10000).astype(np.int64)}
    ref, got = run(model, feeds)["y"], run(result.model, feeds)["y"]
    assert np.isfinite(got).all() and rel_err(ref, got) < 1e-6
    assert not rewrite(result.model, placement=placement).modified


@pytest.mark.parametrize("cast", ["Cast<to=1>(big)", "CastLike(big, h)"])
def test_an_integer_constant_beyond_fp16_read_through_a_cast_keeps_its_reader_fp32(cast):
    """An int64 100000 cast to float and added to an activation: as an FP32 initializer it kept the
    Add FP32, but through Cast it was folded offline and clamped to 65504, and through CastLike it
    became inf at run time (inf - inf: NaN downstream)."""
    model = make_model(f"""
    <ir_version: 10, opset_import: ["" : 18]>
    g (float[4,8] x) => (float[4,8] y) <int64 big = {{100000}}> {{
      h = MatMul(x, w)
      c = {cast}
      a = Add(h, c)
      s = Sub(a, c)
      y = MatMul(s, w)
    }}""", {"w": (8, 8)})
    result = rewrite(model)
    full_check(result.model)
    assert result.log.decisions["Add:a"].precision == Precision.FP32
    assert "holding 100000" in result.log.decisions["Add:a"].reason
    feeds = {"x": np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)}
    assert_emulated_close(model, result.model, feeds)


@pytest.mark.parametrize(("k", "low"), [(300.0, False), (200.0, True)])
def test_arithmetic_on_constants_only_that_leaves_fp16_keeps_fp32(k, low):
    """Mul(k, k) of a constant 300 computes 90000: each constant fits FP16, the product does not, so
    in FP16 it was inf and the Div reading it gave 0 (the literal-constant check saw 300 only). The
    node computing it and its reader keep FP32; at 200 (40000) both still go low."""
    from amp_rewrite.emulate import emulate_low

    model = make_model("""
    <ir_version: 10, opset_import: ["" : 18]>
    g (float[4,8] x) => (float[4,8] y) {
      a = MatMul(x, w)
      c = Mul(k, k)
      d = Div(a, c)
      y = MatMul(d, w2)
    }""", {"w": (8, 8), "w2": (8, 8), "k": np.array(k, np.float32)})
    result = rewrite(model)
    full_check(result.model)
    for node in ("Mul:c", "Div:d"):
        assert (result.log.decisions[node].precision == Precision.LOW) is low, result.log.decisions[node].reason
    if not low:
        assert "computes 'c' holding 90000" in result.log.decisions["Mul:c"].reason
    feeds = {"x": np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)}
    emulated, _ = emulate_low(result.model, FP16)
    assert rel_err(run(model, feeds)["y"], run(emulated, feeds)["y"]) < 1e-2


def _between_matmuls(body: str, inits: dict, *, inputs: str = "", last: str, opset: int = 17):
    """The rewrite (checked in full) of x -> MatMul(x, w) = h -> ``body`` -> MatMul(``last``, w) -> y,
    with ``inputs`` as more graph inputs and ``inits`` beside w (8 x 8)."""
    lines = "\n".join(f"      {line.strip()}" for line in body.strip().splitlines())
    model = make_model(f"""
    <ir_version: {10 if opset >= 18 else 8}, opset_import: ["" : {opset}]>
    g (float[4,8] x{inputs}) => (float[4,8] y) {{
      h = MatMul(x, w)
{lines}
      y = MatMul({last}, w)
    }}""", {"w": (8, 8), **inits})
    result = rewrite(model)
    full_check(result.model)
    return model, result


@pytest.mark.parametrize(("k", "low"), [(65504.0, True), (-65504.0, True), (65505.0, False), (-7e4, False)])
def test_a_constant_at_the_largest_fp16_value_goes_low_and_one_past_it_keeps_fp32(k, low):
    """±65504 is FP16's largest finite value: a Sub reading it holds it exactly in FP16 and goes low
    between two low MatMuls; a constant past it (65505, -70000) keeps the Sub FP32 with the value."""
    _, result = _between_matmuls("a = Sub(h, k)", {"k": np.array(k, np.float32)}, last="a", opset=18)
    decision = result.log.decisions["Sub:a"]
    assert (decision.precision == Precision.LOW) is low, decision.reason
    if not low:
        assert f"holding {k:g}, beyond fp16's finite range" in decision.reason


def test_readers_of_a_square_root_of_a_constant_past_the_range_keep_fp32():
    """Sqrt of a constant 1e10 (a sentinel-sized constant, left alone itself) computes 100000: the
    Add and Sub reading it keep FP32 with that value, where in FP16 the root of the clamped
    constant is 256."""
    model, result = _between_matmuls("""
        r = Sqrt(k)
        a = Add(h, r)
        s = Sub(a, r)""", {"k": np.array(1e10, np.float32)}, last="s", opset=18)
    for node in ("Add:a", "Sub:s"):
        decision = result.log.decisions[node]
        assert decision.precision == Precision.FP32 and "'r' holding 100000" in decision.reason, decision.reason
    feeds = {"x": np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)}
    assert_emulated_close(model, result.model, feeds)


@pytest.mark.parametrize(("count", "low"), [("Slice(sh, one, two)\n      n = ReduceProd<keepdims=0>(s2)", False),
                                            ("Gather<axis=0>(sh, zero)\n      n = Identity(s2)", True)])
def test_a_count_from_a_sliced_or_gathered_shape_is_read_exactly(count, low):
    """Shape -> Slice -> ReduceProd of [1, 80000] (80000) was missed (Slice was no shape op), and
    Shape -> Gather[0] (1) kept its reader FP32 (the walk went on past the exact fold to the shape)."""
    model = make_model(f"""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[2,8] x, float[1,80000] big) => (float[2,8] y) {{
      h = MatMul(x, w)
      sh = Shape(big)
      s2 = {count}
      c = Cast<to=1>(n)
      q = Mul(h, c)
      q2 = Mul(q, small)
      y = MatMul(q2, w)
    }}""", {"w": (8, 8), "small": np.array(1e-5, np.float32), "one": np.array([1], np.int64),
            "two": np.array([2], np.int64), "zero": np.array(0, np.int64)})
    result = rewrite(model)
    full_check(result.model)
    decision = result.log.decisions["Mul:q"]
    assert (decision.precision == Precision.LOW) is low, decision.reason
    feeds = {"x": np.random.default_rng(0).standard_normal((2, 8)).astype(np.float32),
             "big": np.zeros((1, 80000), np.float32)}
    assert_emulated_close(model, result.model, feeds)


@pytest.mark.parametrize(("width", "low"), [(40000, False), (100, True)])
def test_a_count_from_static_shapes_beyond_fp16_keeps_its_readers_fp32(width, low):
    """ReduceProd(Shape(x)) of an x of shape [2, 40000], cast to float, scaled activations between two
    MatMuls: the model's Cast was retargeted to FP16, 80000 became inf and h / inf * inf NaN. Every
    shape is static, so the count is known when the rewrite runs, as a constant's is."""
    model = make_model(f"""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[2,8] x, float[2,{width}] big) => (float[2,8] y) {{
      h = MatMul(x, w)
      sh = Shape(big)
      n = ReduceProd<keepdims=0>(sh)
      c = Cast<to=1>(n)
      d = Div(h, c)
      e = Mul(d, c)
      y = MatMul(e, w2)
    }}""", {"w": (8, 8), "w2": (8, 8)})
    result = rewrite(model)
    full_check(result.model)
    for node in ("Div:d", "Mul:e"):
        assert (result.log.decisions[node].precision == Precision.LOW) is low, result.log.decisions[node].reason
    if not low:
        assert "holding 80000" in result.log.decisions["Div:d"].reason
    feeds = {"x": np.random.default_rng(0).standard_normal((2, 8)).astype(np.float32),
             "big": np.zeros((2, width), np.float32)}
    assert_emulated_close(model, result.model, feeds)


@pytest.mark.parametrize("route", ["Identity(k)", "Cast<to=1>(k64)", "ConstantOfShape<value=float[1] {1e-6}>(dims)",
                                   "Sqrt(k12)", "Expand(k, dims)"])
def test_a_small_divisor_read_through_copies_or_sqrt_keeps_its_division_fp32(route):
    """The divisor's check read the initializer itself and arithmetic on constants: 1e-6 through an
    Identity, a Cast from double, a ConstantOfShape fill or an Expand, or Sqrt(1e-12), let the
    Div run low (inf), where Mul by 1e6 through the same ops kept FP32."""
    model = make_model(f"""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[4,8] x) => (float[4,8] y) {{
      a = MatMul(x, w)
      c = {route}
      d = Div(a, c)
      e = Mul(d, k)
      y = MatMul(e, w2)
    }}""", {"w": (8, 8), "w2": (8, 8), "k": np.array(1e-6, np.float32), "k64": np.array(1e-6, np.float64),
            "k12": np.array(1e-12, np.float32), "dims": np.array([1], np.int64)})
    result = rewrite(model)
    full_check(result.model)
    assert result.log.decisions["Div:d"].precision == Precision.FP32, result.log.decisions["Div:d"].reason
    feeds = {"x": np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)}
    assert_emulated_close(model, result.model, feeds)


def test_an_overridable_input_default_beyond_fp16_keeps_its_readers_fp32():
    """An initializer also listed as a graph input (IR >= 4: a default the caller may override, as
    torch.onnx.export(keep_initializers_as_inputs=True) writes) holding 1e5: as a plain initializer
    its Add kept FP32; listed, it was cast to FP16 at run time (inf) and the Add ran low."""
    model = make_model("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[4,8] x, float[8] big) => (float[4,8] y) {
      h = MatMul(x, w)
      a = Add(h, big)
      s = Sub(a, big)
      y = MatMul(s, w2)
    }""", {"w": (8, 8), "w2": (8, 8), "big": np.full(8, 1e5, np.float32)})
    result = rewrite(model)
    full_check(result.model)
    assert result.log.decisions["Add:a"].precision == Precision.FP32
    assert "holding 100000" in result.log.decisions["Add:a"].reason
    feeds = {"x": np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)}
    assert_emulated_close(model, result.model, feeds)


@pytest.mark.parametrize(("k", "low"), [(1e-6, False), (-1e-6, False), (1e-3, True)])
def test_a_division_by_a_constant_whose_reciprocal_leaves_fp16_keeps_fp32(k, low):
    """``h / 1e-6`` multiplies by 1e6: ``h * 1e6`` kept FP32 (its constant is past 65504), the division
    went low and overflowed to inf (each constant fits FP16; the divisor's reciprocal does not). By
    1e-3 it still goes low."""
    model = make_model("""
    <ir_version: 10, opset_import: ["" : 18]>
    g (float[4,8] x) => (float[4,8] y) {
      a = MatMul(x, w)
      d = Div(a, k)
      e = Mul(d, k)
      y = MatMul(e, w2)
    }""", {"w": (8, 8), "w2": (8, 8), "k": np.array(k, np.float32)})
    result = rewrite(model)
    full_check(result.model)
    decision = result.log.decisions["Div:d"]
    assert (decision.precision == Precision.LOW) is low, decision.reason
    if not low:
        assert f"divides by 'k' holding {k:g}, which multiplies by {1 / k:g}" in decision.reason
    feeds = {"x": np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)}
    assert_emulated_close(model, result.model, feeds)
    assert not rewrite(result.model).modified


@pytest.mark.parametrize(("k", "low"), [([0, 0, 1e-6, 2, 2, 2, 2, 2], False), ([0, 0, 2, 2, 2, 2, 2, 2], True)])
def test_zeros_in_a_constant_divisor_are_left_out_of_its_smallest_value(k, low):
    """A divisor holding zeros next to 1e-6 keeps its Div FP32 for the 1e-6 (its reciprocal is past
    FP16's range); one holding zeros and 2s only goes low (a zero divides to inf in either type)."""
    _, result = _between_matmuls("d = Div(h, k)", {"k": np.array(k, np.float32)}, last="d", opset=18)
    decision = result.log.decisions["Div:d"]
    assert (decision.precision == Precision.LOW) is low, decision.reason
    if not low:
        assert "divides by 'k' holding 1e-06, which multiplies by 1e+06" in decision.reason


@pytest.mark.parametrize(("alpha", "low"), [(100000.0, False), (0.01, True)])
def test_a_leaky_relu_slope_past_the_range_keeps_fp32(alpha, low):
    """LeakyRelu multiplies its negative inputs by alpha in the node's type: a slope of 100000 is inf
    in FP16, so the node keeps FP32 with the attribute named; a slope of 0.01 goes low."""
    _, result = _between_matmuls(f"r = LeakyRelu<alpha = {alpha}>(h)", {}, last="r", opset=18)
    decision = result.log.decisions["LeakyRelu:r"]
    assert (decision.precision == Precision.LOW) is low, decision.reason
    if not low:
        assert "its alpha attribute holding 100000" in decision.reason


@pytest.mark.parametrize(("mode", "low"), [("tf_crop_and_resize", False), ("half_pixel", True)])
def test_a_resize_fill_past_the_range_keeps_fp32_only_where_the_mode_writes_it(mode, low):
    """Resize writes its extrapolation_value only under tf_crop_and_resize: a fill of -70000 keeps
    that Resize FP32 with the attribute named; under half_pixel the fill is never written and the
    Resize goes low between low MatMuls."""
    model = make_model(f"""
    <ir_version: 8, opset_import: ["" : 13]>
    g (float[1,1,4,4] x) => (float[1,1,8,8] y) {{
      a = MatMul(x, w)
      r = Resize<mode = "linear", coordinate_transformation_mode = "{mode}", extrapolation_value = -70000.0>(a, roi, sc)
      y = MatMul(r, wn)
    }}""", {"w": np.eye(4, dtype=np.float32), "wn": (np.eye(8) * 0.01).astype(np.float32),
            "sc": np.array([1, 1, 2, 2], np.float32), "roi": np.array([0, 0, -.5, -.5, 1, 1, 1.5, 1.5], np.float32)})
    result = rewrite(model)
    full_check(result.model)
    decision = result.log.decisions["Resize:r"]
    assert (decision.precision == Precision.LOW) is low, decision.reason
    if not low:
        assert "its extrapolation_value attribute holding -70000" in decision.reason


def test_readers_of_an_if_whose_branch_returns_a_constant_past_the_range_keep_fp32():
    """An If whose then-branch returns a constant 100000: the Add and Sub reading its output keep
    FP32 with that value, as they would reading the constant itself."""
    _, result = _between_matmuls("""
        k = If(c) <then_branch = t () => (float[1] o) { o = Identity(big) },
                   else_branch = e () => (float[1] o2) { o2 = Identity(one) }>
        a = Add(h, k)
        s = Sub(a, k)""", {"big": np.array([1e5], np.float32), "one": np.array([1.0], np.float32)},
                                 inputs=", bool c", last="s")
    for node in ("Add:a", "Sub:s"):
        decision = result.log.decisions[node]
        assert decision.precision == Precision.FP32 and "'k' holding 100000" in decision.reason, decision.reason


def test_readers_of_a_one_hot_whose_values_leave_fp16_keep_fp32():
    """OneHot(i, 8, values=[0, 100000]) writes 100000 at each index: the OneHot keeps FP32, and so
    does the Mul reading its output (in FP16 it would read inf)."""
    _, result = _between_matmuls("""
        o = OneHot(i, depth, vals)
        a = Mul(h, o)""", {"depth": np.array(8, np.int64), "vals": np.array([0.0, 1e5], np.float32)},
                                 inputs=", int64[4] i", last="a")
    assert "'vals' holding 100000" in result.log.decisions["OneHot:o"].reason
    decision = result.log.decisions["Mul:a"]
    assert decision.precision == Precision.FP32 and "'o' holding 100000" in decision.reason, decision.reason


@pytest.mark.parametrize("where", ["Where(m, h, big)", "Where(m, big, h)"])
def test_readers_of_a_where_that_selects_a_constant_past_the_range_keep_fp32(where):
    """A Where choosing between an activation and a constant 100000 (in either slot) writes 100000
    where it picks the constant: the Add reading its output keeps FP32 with that value."""
    _, result = _between_matmuls(f"""
        f = {where}
        a = Add(h, f)""", {"big": np.array(1e5, np.float32)}, inputs=", bool[4,8] m", last="a")
    decision = result.log.decisions["Add:a"]
    assert decision.precision == Precision.FP32 and "'f' holding 100000" in decision.reason, decision.reason


_FILLS = {
    "Resize": ("float[1,1,8,8]", "r = Resize<mode = \"linear\", coordinate_transformation_mode = \"tf_crop_and_resize\", "
               "extrapolation_value = -70000.0>(a, roi, sc)", 8),
    "Pad": ("float[1,1,6,6]", "r = Pad<mode = \"constant\">(a, pads, cv)", 6),
    "Pad-2": ("float[1,1,6,6]", "r = Pad<mode = \"constant\", pads = [0, 0, 1, 1, 0, 0, 1, 1], value = -70000.0>(a)", 6)}


@pytest.mark.parametrize("op", list(_FILLS))
def test_a_fill_past_the_range_that_reaches_a_low_matmul_is_clamped_before_its_cast(op):
    """A Resize (tf_crop_and_resize) or Pad filling with -70000 keeps FP32 for that fill, but its
    output went to an FP16 MatMul through a plain Cast: -70000 became -inf, and -inf × 0 made
    every output NaN where FP32 is finite. The Cast now reads the value clamped to ±65504, as a
    constant converted offline is."""
    shape, line, n = _FILLS[op]
    opset = 10 if op == "Pad-2" else 13  # (Pad-2: pads and value are attributes)
    model = make_model(f"""
    <ir_version: 8, opset_import: ["" : {opset}]>
    g (float[1,1,4,4] x) => ({shape} y) {{
      a = MatMul(x, w)
      {line}
      y = MatMul(r, wn)
    }}""", {"w": np.eye(4, dtype=np.float32), "wn": (np.eye(n) * 0.01).astype(np.float32),
            "sc": np.array([1, 1, 2, 2], np.float32), "roi": np.array([0, 0, -.5, -.5, 1, 1, 1.5, 1.5], np.float32),
            "pads": np.array([0, 0, 1, 1, 0, 0, 1, 1], np.int64), "cv": np.array(-70000.0, np.float32)})
    result = rewrite(model)
    out = result.model
    full_check(out)
    from amp_rewrite.emulate import emulate_low

    if not any(c.dst == "fp16" and c.tensor == "r" for c in result.log.casts):
        pytest.skip(f"{op}: its output is not cast to fp16 at this opset")
    [clip] = [node for node in out.graph.node if node.op_type == "Clip"]
    record = next(c for c in result.log.casts if c.tensor == "r")
    assert "clamped to ±65504 first (Clip): it may hold -70000" in record.reason
    feeds = {"x": np.random.default_rng(0).standard_normal((1, 1, 4, 4)).astype(np.float32)}
    want, got = run(model, feeds)["y"], run(emulate_low(out, FP16)[0], feeds)["y"]
    assert np.isfinite(want).all() and np.isfinite(got).all()
    assert np.abs(got - want).max() <= 0.1 * np.abs(want).max()  # (-65504 for -70000: 6.4%, not NaN)
    assert not rewrite(out).modified


@pytest.mark.parametrize("placement", ["optimal", "greedy"])
def test_a_divisor_holding_a_tiny_constant_through_a_concat_keeps_the_division_fp32(placement):
    """A divisor that is partly a constant of 1e-6 (``Concat(h, tiny)``): not a constant, so the
    check of the divisor's reciprocal, which folded constants only, passed it; the optimal
    placement made the Div FP16 and 1000 / 1e-6 was inf (found by a fuzzer). The constant is now
    looked for through copies as an out-of-range constant is."""
    model = make_model("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[2,4] x) => (float[2,3] y) {
      h = MatMul(x, w)
      c = Concat<axis = 1>(h, tiny)
      d = Div(num, c)
      y = Slice(d, st, en, ax)
    }""", {"w": (4, 3), "tiny": np.full((2, 3), 1e-6, np.float32), "num": np.full(6, 1000.0, np.float32),
            "st": np.array([3], np.int64), "en": np.array([6], np.int64), "ax": np.array([1], np.int64)})
    result = rewrite(model, placement=placement)
    full_check(result.model)
    decision = result.log.decisions["Div:d"]
    assert decision.precision == Precision.FP32 and "which multiplies by 1e+06" in decision.reason
    feeds = {"x": np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32)}
    assert_emulated_close(model, result.model, feeds)


@pytest.mark.parametrize("placement", ["optimal", "greedy"])
def test_a_reciprocal_of_a_tiny_constant_through_a_copy_keeps_fp32_with_its_readers(placement):
    """``Reciprocal(Concat(h, 1e-8))`` then a Mul by zeros where the 1e-8s are: the reciprocal is
    1e8, inf in FP16, and 0 × inf NaN, where FP32 gives 0. A Reciprocal is checked as a Div's
    divisor is, and its readers keep FP32 with it (its output is the number past the range)."""
    model = make_model("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[2,2] x) => (float[2,4] y) {
      h = MatMul(x, w)
      n = Concat<axis = 1>(h, zeros)
      c = Concat<axis = 1>(h, tiny)
      r = Reciprocal(c)
      q = Mul(n, r)
      y = MatMul(q, w4)
    }""", {"w": np.eye(2, dtype=np.float32), "w4": np.eye(4, dtype=np.float32),
            "zeros": np.zeros((2, 2), np.float32), "tiny": np.full((2, 2), 1e-8, np.float32)})
    result = rewrite(model, placement=placement)
    full_check(result.model)
    assert result.log.decisions["Reciprocal:r"].precision == Precision.FP32
    assert result.log.decisions["Mul:q"].precision == Precision.FP32
    feeds = {"x": np.array([[1.0, -2.0], [0.5, 3.0]], np.float32)}
    assert_emulated_close(model, result.model, feeds)


_PER_CHANNEL = [1e-8] * 4 + [1e-3] * 4  # (one sign: its 1e-8 lanes give 0/0 as a scalar 1e-8 does)


@pytest.mark.parametrize(("eps", "low"), [(1e-8, False), (1e-12, False), (1e-3, True), (_PER_CHANNEL, False)])
def test_an_epsilon_the_low_type_flushes_to_zero_keeps_its_sum_and_division_fp32(eps, low):
    """``r / (r + 1e-8)`` after a Relu: FP16 holds nothing below 6e-8, so the converted epsilon was
    0, the sum was r and every zero of the Relu gave 0/0 = NaN, exit 0 (the summary counted "1
    flushed to zero"). The Add now seeds FP32 like a deny op, so the division by its sum follows
    it. An epsilon FP16 holds (1e-3) changes nothing. A per-channel epsilon loses its 1e-8 lanes
    alike (it went low while one lane kept a value FP16 holds)."""
    model = make_model("""
    <ir_version: 10, opset_import: ["" : 18]>
    g (float[4,8] x) => (float[4,8] y) {
      h = MatMul(x, w)
      r = Relu(h)
      a = Add(r, eps)
      q = Div(r, a)
      y = MatMul(q, w2)
    }""", {"w": (8, 8), "w2": (8, 8), "eps": np.array(eps, np.float32)})
    result = rewrite(model)
    full_check(result.model)
    add, div = result.log.decisions["Add:a"], result.log.decisions["Div:q"]
    assert (add.precision == Precision.LOW) is low and (div.precision == Precision.LOW) is low, div.reason
    if not low:
        assert f"adds 'eps' holding {1e-8 if eps is _PER_CHANNEL else eps:g}, below fp16's smallest value" in add.reason
    feeds = {"x": np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)}
    assert_emulated_close(model, result.model, feeds)
    assert not rewrite(result.model).modified
    bf16 = rewrite(model, target="bf16")  # (bf16 holds 1e-12)
    assert bf16.log.decisions["Div:q"].precision == Precision.LOW


@pytest.mark.parametrize(("op", "reduction", "low"), [
    ("ScatterElements", "add", False), ("ScatterElements", "mul", False), ("ScatterElements", "max", True),
    ("ScatterElements", "none", True), ("ScatterND", "add", False)])
def test_a_scatter_that_accumulates_keeps_fp32(op, reduction, low):
    """ScatterElements(reduction='add') was a clear op: 4096 ones landing on one index ran in FP16,
    where a GPU's half atomicAdd rounds every partial sum (stuck at 2048, half the true 4096); the
    emulation summed in FP32 and saw nothing. An accumulating reduction now keeps FP32."""
    n = 64
    if op == "ScatterElements":
        idx = np.zeros((n, 8), np.int64)
        body = f"s = ScatterElements<axis=0, reduction=\"{reduction}\">(base, idx, h)"
    else:
        idx = np.zeros((n, 1), np.int64)
        body = f"s = ScatterND<reduction=\"{reduction}\">(base, idx, h)"
    model = make_model(f"""
    <ir_version: 10, opset_import: ["" : 18]>
    g (float[{n},8] x) => (float[2,8] y) {{
      h = MatMul(x, w)
      {body}
      y = MatMul(s, w2)
    }}""", {"w": (8, 8), "w2": (8, 8), "base": np.zeros((2, 8), np.float32), "idx": idx})
    result = rewrite(model)
    full_check(result.model)
    decision = result.log.decisions[f"{op}:s"]
    assert (decision.precision == Precision.LOW) is low, decision.reason
    if not low:
        assert f"reduction={reduction!r} accumulates" in decision.reason
    assert not rewrite(result.model).modified


@pytest.mark.parametrize(("attrs", "low", "target"), [
    ("alpha=100000.0", False, "fp16"), ("beta=100000.0", False, "fp16"), ("alpha=1e-09", False, "fp16"),
    ("alpha=1e-07", False, "fp16"), ("alpha=60000.0, beta=0.5", True, "fp16"), ("alpha=0.0001", True, "fp16"),
    ("alpha=100000.0", True, "bf16")])
def test_a_gemm_scalar_the_low_type_cannot_hold_keeps_the_gemm_fp32(attrs, low, target):
    """onnxruntime's CUDA Gemm converts alpha and beta to the data type before calling cuBLAS: an
    alpha of 1e5 in FP16 is inf (every output inf), 1e-9 is 0, 1e-7 the subnormal 1.19e-7 (every
    output 19% off). The weights are clamped and counted, the scalars were neither: such a Gemm
    keeps FP32 with the reason (BF16 holds 1e5; 1e-4 is a normal FP16 number)."""
    model = make_model(f"""
    <ir_version: 10, opset_import: ["" : 18]>
    g (float[4,8] x) => (float[4,8] y) {{
      a = MatMul(x, w)
      y = Gemm<{attrs}>(a, w2, c)
    }}""", {"w": (8, 8), "w2": (8, 8), "c": (8,)})
    result = rewrite(model, target=target)
    full_check(result.model)
    decision = result.log.decisions["Gemm:y"]
    assert (decision.precision == Precision.LOW) is low, decision.reason
    if not low:
        assert "attribute" in decision.reason and "converts it to" in decision.reason
        assert result.log.decisions["MatMul:a"].precision == Precision.LOW
    again = rewrite(result.model, target=target)
    assert not again.modified


@pytest.mark.parametrize(("body", "k", "low"), [
    ("s = Mul(h, k)", 1e-7, False), ("s = Mul(k, h)", -2e-6, False), ("s = Div(k, h2)", 1e-7, False),
    ("r = Reciprocal(k)\ns = Mul(h, r)", 1e7, False), ("s = Mul(h, k)", 1e-4, True), ("s = Mul(h, k)", 1e-5, True),
    ("s = Mul(h, k)", [1.0, 0.5, 1e-7, 2.0, 0.0, 1.0, 1.0, 1.0], True)],
    ids=["mul", "mul-left", "div-numerator", "reciprocal", "normal", "subnormal-0.14%", "mixed"])
def test_a_factor_fp16_holds_only_as_a_coarse_subnormal_keeps_its_mul_fp32(body, k, low):
    """``h * 1e-7`` went FP16 with 1e-7 stored as the subnormal 1.19e-7: every output 19% off and
    nothing said (``h / 1e7`` kept FP32 for its divisor). A factor FP16 keeps to fewer than 7
    significant bits (-2e-6 is 1.3% off) keeps its Mul (or a Div's numerator) FP32; 1e-4 is a normal
    FP16 number, 1e-5 is 0.14% off, and a tensor with one tiny entry among larger ones rounds that
    entry's small product only."""
    inits = {"k": np.array(k, np.float32)}
    if "h2" in body:
        body = "h2 = Add(h, one)\n" + body
        inits["one"] = np.array(40.0, np.float32)
    model, result = _between_matmuls(body, inits, last="s", opset=18)
    node = next(name for name in result.log.decisions if name.endswith(":s"))
    decision = result.log.decisions[node]
    assert (decision.precision == Precision.LOW) is low, decision.reason
    if not low:
        assert "below fp16's smallest normal value" in decision.reason and "% off" in decision.reason
    if "h2" not in body:  # (a quotient 1e-7 / h is itself below FP16's range, where the MatMul reads it)
        feeds = {"x": (np.random.default_rng(0).standard_normal((4, 8)) * 1000).astype(np.float32)}
        assert_emulated_close(model, result.model, feeds)
    assert not rewrite(result.model).modified


def test_a_coarse_factor_goes_bf16():
    """BF16 has FP32's exponent range: 1e-7 is a normal BF16 number, and the Mul goes low."""
    model = make_model("""
    <ir_version: 10, opset_import: ["" : 18]>
    g (float[4,8] x) => (float[4,8] y) {
      h = MatMul(x, w)
      s = Mul(h, k)
      y = MatMul(s, w)
    }""", {"w": (8, 8), "k": np.array(1e-7, np.float32)})
    result = rewrite(model, target="bf16")
    assert result.log.decisions["Mul:s"].precision == Precision.LOW


@pytest.mark.parametrize(("op", "bias", "low", "target"), [
    ("Gemm", [1e5, -1e5, 1e-3, 3.0], False, "fp16"), ("Conv", [1e5, -1e5, 1e-3, 3.0], False, "fp16"),
    ("Gemm", [6e4, -1.0, 1e-3, 3.0], True, "fp16"), ("Gemm", [1e5, -1e5, 1e-3, 3.0], True, "bf16"),
    ("Gemm", [-1e9, 0.0, 0.0, 0.0], True, "fp16")])
def test_a_bias_the_low_type_cannot_hold_keeps_its_gemm_or_conv_fp32(op, bias, low, target):
    """A Gemm's C or a Conv's B of 1e5 was clamped to 65504 with the weights and the node ran FP16:
    the output was 35% off where the same sum as MatMul + Add kept its Add FP32 and was exact. The
    bias is added to the output as it is, so such a node keeps FP32 (BF16 holds 1e5; a mask
    sentinel saturates and still masks, as everywhere)."""
    from amp_rewrite.emulate import emulate_low

    conv = op == "Conv"
    model = make_model(f"""
    <ir_version: 10, opset_import: ["" : 18]>
    g (float{"[1,4,2,2]" if conv else "[2,4]"} x) => (float{"[1,4,2,2]" if conv else "[2,4]"} y) {{
      a = {op}(x, w, b)
      y = Relu(a)
    }}""", {"w": np.eye(4, dtype=np.float32).reshape((4, 4, 1, 1) if conv else (4, 4)),
            "b": np.array(bias, np.float32)})
    result = rewrite(model, target=target)
    full_check(result.model)
    decision = result.log.decisions[f"{op}:a"]
    assert (decision.precision == Precision.LOW) is low, decision.reason
    if not low:
        assert "its bias 'b' holds 100000" in decision.reason
        x = np.ones((1, 4, 2, 2) if conv else (2, 4), np.float32)
        ref = run(model, {"x": x})["y"]
        got = run(emulate_low(result.model, onnx.TensorProto.FLOAT16)[0], {"x": x})["y"]
        assert rel_err(ref, got) < 1e-3
    assert not rewrite(result.model, target=target).modified


@pytest.mark.parametrize("equation,shape,low", [("ij->", "", False), ("ij->i", "[4]", False), ("ii->", "", False),
                                                ("ij", "[4,8]", True), ("ij->ji", "[8,4]", True), ("ii->i", "[4]", True)])
def test_a_one_operand_einsum_that_sums_is_a_reduction_kept_fp32(equation, shape, low):
    """Einsum was allow ("contractions lowered to GEMMs") whatever its equation: 'ij->' summed a
    64x256 activation to 3.35e6 in FP16 (inf), where the same ReduceSum is deny and exact. An
    Einsum summing a label one operand alone holds is a reduction and keeps FP32; a transpose or
    a diagonal does not sum and still goes low."""
    square = equation.startswith("ii")
    model = make_model(f"""
    <ir_version: 10, opset_import: ["" : 18]>
    g (float[4,{4 if square else 8}] x) => (float{shape} y) {{
      a = MatMul(x, w)
      y = Einsum<equation="{equation}">(a)
    }}""", {"w": (4, 4) if square else (8, 8)})
    result = rewrite(model)
    full_check(result.model)
    decision = result.log.decisions["Einsum:y"]
    assert (decision.precision == Precision.LOW) is low, decision.reason
    if not low:
        assert f"Einsum {equation!r} sums over" in decision.reason


def test_a_two_operand_einsum_contraction_goes_low_and_an_extra_sum_keeps_it_fp32():
    model = make_model("""
    <ir_version: 10, opset_import: ["" : 18]>
    g (float[4,8] x) => (float[4,8] y, float[4] z) {
      a = MatMul(x, w)
      y = Einsum<equation="ij,jk->ik">(a, w)
      z = Einsum<equation="ij,jk->i">(a, w)
    }""", {"w": (8, 8)})
    decisions = rewrite(model).log.decisions
    assert decisions["Einsum:y"].precision == Precision.LOW
    assert decisions["Einsum:z"].precision == Precision.FP32 and "sums over k" in decisions["Einsum:z"].reason


def test_the_out_of_range_scan_reads_a_constant_in_chunks_and_finds_the_same_value(monkeypatch):
    """(the whole-tensor float64 copy of a 2 GB Constant took 12 GB of memory)"""
    from amp_rewrite.frontends import onnx_constants

    data = np.zeros(1000, np.float32)
    data[[10, 700, 701]] = [7e4, -9e4, 9e4]
    whole = onnx_constants._largest(data, 65504.0)
    monkeypatch.setattr(onnx_constants, "_CHUNK", 64)
    assert whole == onnx_constants._largest(data, 65504.0) == -9e4
    assert onnx_constants._largest(np.full(100, 1e9, np.float32), 65504.0) is None  # sentinels are not data
    assert onnx_constants._largest(np.arange(100, dtype=np.float16), 65504.0) is None


@pytest.mark.parametrize("double", [False, True])
def test_an_exponential_computed_in_fp64_is_an_fp32_island_like_one_in_fp32(double):
    """``Cast(to=DOUBLE) → Exp → Cast(to=FLOAT)``: painting saw no deny op (the Exp is not FP32),
    so the Add and Mul after it ran between the MatMuls in FP16 and exp(12) became inf, where the
    same graph with an FP32 Exp keeps them FP32. A deny op computed in double now seeds the spread
    as an FP32 one does; a float copied to double and back, or double arithmetic, does not."""
    exp = "md = Cast<to=11>(m)\n      e = Exp(md)\n      ef = Cast<to=1>(e)" if double else "ef = Exp(m)"
    model = make_model(f"""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[2,8] x) => (float[2,8] y) {{
      m = MatMul(x, w)
      {exp}
      a0 = Add(ef, m)
      a = Mul(a0, s)
      y = MatMul(a, w)
    }}""", {"w": np.eye(8, dtype=np.float32), "s": np.array(1e-3, np.float32)})
    result = rewrite(model)
    full_check(result.model)
    for label in ("Add:a0", "Mul:a"):
        assert result.log.decisions[label].precision == Precision.FP32, result.log.decisions[label].reason
    if double:
        assert "of Exp:e, computed in FP64" in result.log.decisions["Add:a0"].reason
    assert_emulated_close(model, result.model, {"x": np.full((2, 8), 12.0, np.float32)})
    assert not rewrite(result.model).modified


def test_an_island_seeded_only_by_deny_paint_is_reported():
    """The Add and Mul after an Exp computed in FP64 are FP32 by deny paint alone (no member is a
    deny op: the Exp is not an FP32 node): they are one FP32 island in the report, with no seed,
    one cast in and one out."""
    from amp_rewrite.passes.islands import describe

    model = make_model("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[2,8] x) => (float[2,8] y) {
      m = MatMul(x, w)
      md = Cast<to=11>(m)
      e = Exp(md)
      ef = Cast<to=1>(e)
      a0 = Add(ef, m)
      a = Mul(a0, s)
      y = MatMul(a, w)
    }""", {"w": np.eye(8, dtype=np.float32), "s": np.array(1e-3, np.float32)})
    result = rewrite(model)
    [island] = result.log.islands
    assert island.members == ["Add:a0", "Mul:a"] and island.seeds == []
    assert describe(island) == "FP32 region, 2 nodes, 1 cast in, 1 out"
    assert result.log.decisions["Add:a0"].island == island.id


def test_a_float_copied_to_double_and_back_stays_in_the_low_chain():
    """The FP64 rule reads only deny ops computed in double: ``Cast(DOUBLE) → Cast(FLOAT)`` of an
    FP32 value copies it (its range is the FP32 value's), and its readers paint as before."""
    model = make_model("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[2,8] x) => (float[2,8] y) {
      m = MatMul(x, w)
      md = Cast<to=11>(m)
      ef = Cast<to=1>(md)
      a = Add(ef, m)
      y = MatMul(a, w)
    }""", {"w": (8, 8)})
    result = rewrite(model)
    full_check(result.model)
    assert result.log.decisions["Add:a"].precision == Precision.LOW


def test_a_comparison_of_a_low_value_with_a_constant_compares_in_the_low_type():
    """--placement greedy left Equal(f, fill) FP32 with f cast up: the FP16-rounded fill (-0.09998)
    never equalled the exact -0.1, and the guard built on it missed (the optimal placement had it).
    (Equal has no bfloat16 CUDA kernel: bf16 keeps it FP32 by the kernel table.)"""
    model = make_model("""
    <ir_version: 10, opset_import: ["" : 18]>
    g (float[4,8] x, bool[4,8] m) => (float[4,8] y) {
      h = MatMul(x, w)
      f = Where(m, h, fill)
      e = Equal(f, fill)
      g2 = Where(e, zero, f)
      y = MatMul(g2, w2)
    }""", {"w": (8, 8), "w2": (8, 8), "fill": np.array(-0.1, np.float32), "zero": np.array(0.0, np.float32)})
    for placement in ("greedy", "optimal"):
        result = rewrite(model, placement=placement)
        full_check(result.model)
        decision = result.log.decisions["Equal:e"]
        assert decision.precision == Precision.LOW, (placement, decision.reason)
        assert not rewrite(result.model, placement=placement).modified


@pytest.mark.parametrize(("guard", "node", "said"), [
    ("a = Max(r, eps)", "Max:a", "bounds below by 'eps'"), ("a = Clip(r, eps)", "Clip:a", "bounds below by 'eps'"),
    # a variadic Sum; the guard Where(Less(r, eps), eps, r), whose comparison in FP16 tests r < 0
    # (never true of a zero, which was kept); an Add of Relu(eps)
    ("a = Sum(r, eps)", "Sum:a", "adds 'eps'"),
    ("lt = Less(r, eps)\n      a = Where(lt, eps, r)", "Less:lt", "compares with 'eps'"),
    ("e = Relu(eps)\n      a = Add(r, e)", "Add:a", "adds 'e'"),
    # beside an upper bound past FP16's range: the Clip was kept FP32 for that bound, and the
    # division after it went low (the lower bound's mark was never made)
    ("hi = Constant<value = float {1e6}>()\n      a = Clip(r, eps, hi)", "Clip:a", "bounds below by 'eps'")])
def test_a_lower_bound_the_low_type_flushes_to_zero_keeps_its_guard_and_division_fp32(guard, node, said):
    """x / clamp_min(r, 1e-8) (Clip's min, or Max): in FP16 the bound was 0, so a zero row divided
    0 by 0 (NaN, exit 0), as the Add form did before it was fixed; so did the guard written as a
    Sum, a Where with its comparison, or an Add of a Relu of the epsilon."""
    model = make_model(f"""
    <ir_version: 10, opset_import: ["" : 18]>
    g (float[4,8] x) => (float[4,8] y) {{
      h = MatMul(x, w)
      r = Relu(h)
      {guard}
      q = Div(r, a)
      y = MatMul(q, w2)
    }}""", {"w": (8, 8), "w2": (8, 8), "eps": np.array(1e-8, np.float32)})
    result = rewrite(model)
    full_check(result.model)
    assert result.log.decisions[node].precision == Precision.FP32
    assert result.log.decisions["Div:q"].precision == Precision.FP32
    assert f"{said} holding 1e-08" in result.log.decisions[node].reason
    feeds = {"x": np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)}
    assert_emulated_close(model, result.model, feeds)
    assert not rewrite(result.model).modified
    bf16 = rewrite(model, target="bf16").log.decisions.values()  # (bf16 holds 1e-8)
    assert not [d for d in bf16 if "smallest value" in d.reason]


@pytest.mark.parametrize("placement", ["greedy", "optimal"])
def test_a_value_multiplied_by_itself_is_a_square_held_fp32_like_pow(placement):
    """``torch.square(h)`` exports as ``Mul(h, h)``. It ran FP16 while ``Pow(h, 2)`` is denied
    (x^2 overflows fp16 for |x| > 256): a squared-ReLU MLP with activations near 1000 gave inf/NaN.
    A Mul of a value by itself now takes Pow's verdict; a Mul of two values stays low."""
    m = make_model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[4,8] x) => (float[4,8] y, float[4,8] z) {
          a = MatMul(x, w1)
          h = Relu(a)
          s = Mul(h, h)
          t = Mul(s, k)
          y = MatMul(t, w2)
          c = MatMul(x, w2)
          p = Mul(c, x2)
          z = MatMul(p, w2)
        }""", {"w1": np.full((8, 8), 150.0, np.float32), "w2": np.full((8, 8), 0.1, np.float32),
               "k": np.array(1e-4, np.float32), "x2": np.full((4, 8), 0.5, np.float32)})
    result = rewrite(m, placement=placement)
    full_check(result.model)
    decisions = {d.node: d for d in result.log.decisions.values()}
    assert decisions["Mul:s"].precision.value == "fp32"
    assert "square" in decisions["Mul:s"].reason and "256" in decisions["Mul:s"].reason
    assert decisions["Mul:p"].precision.value == "low" and decisions["MatMul:y"].precision.value == "low"
    x = np.abs(np.random.default_rng(0).normal(size=(4, 8))).astype(np.float32)  # h up to ~3000: h^2 ~1e7
    got, want = run(result.model, {"x": x}), run(m, {"x": x})
    assert np.isfinite(got["y"]).all()
    assert rel_err(want["y"], got["y"]) < 1e-2
    # BF16 has FP32's range: the rules make Pow infer there, and so the square
    bf16 = rewrite(m, placement=placement, target="bf16")
    assert {d.node: d for d in bf16.log.decisions.values()}["Mul:s"].precision.value == "low"


_SQUARE_SPELLINGS = {
    "Einsum bd,bd->bd": ("s = Einsum<equation = \"bd,bd->bd\">(h, h)", "Einsum:s"),
    "Einsum bd,bd->b": ("n = Einsum<equation = \"bd,bd->b\">(h, h)\n          u = Unsqueeze(n, ax)\n"
                        "          s = Expand(u, shape)", "Einsum:n"),
    "Mul(h, Identity(h))": ("i = Identity(h)\n          s = Mul(h, i)", "Mul:s"),
    "Mul(Cast(h), Cast(h))": ("c1 = Cast<to = 1>(h)\n          c2 = Cast<to = 1>(h)\n          s = Mul(c1, c2)", "Mul:s"),
    # the same pure op on both sides: two twin nodes compute the same values
    "Mul(Abs(h), Abs(h))": ("b1 = Abs(h)\n          b2 = Abs(h)\n          s = Mul(b1, b2)", "Mul:s"),
    "Mul(Unsqueeze(h), Unsqueeze(h))": ("u1 = Unsqueeze(h, ax)\n          u2 = Unsqueeze(h, ax)\n"
                                        "          q = Mul(u1, u2)\n          s = Reshape(q, shape)", "Mul:q"),
}


@pytest.mark.parametrize("spelling", sorted(_SQUARE_SPELLINGS))
def test_a_square_spelled_another_way_is_held_fp32_too(spelling):
    """An Einsum of a value with itself under one subscript (no contraction: squares; a summed
    label: a sum of squares) was an allow op, and a Mul of a value by a copy of itself (Identity, a
    Cast to its own type), or of two twin nodes of one pure op on it (Abs, Unsqueeze), no square:
    each overflowed FP16 for |h| > 256 (inf at the output)."""
    line, node = _SQUARE_SPELLINGS[spelling]
    m = make_model(f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[4,8] x) => (float[4,8] y) {{
          a = MatMul(x, w1)
          h = Relu(a)
          {line}
          t = Mul(s, k)
          y = MatMul(t, w2)
        }}""", {"w1": np.full((8, 8), 150.0, np.float32), "w2": np.full((8, 8), 0.1, np.float32),
                "k": np.array(1e-4, np.float32), "ax": np.array([1], np.int64), "shape": np.array([4, 8], np.int64)})
    x = np.abs(np.random.default_rng(0).normal(size=(4, 8))).astype(np.float32)
    for placement in ("greedy", "optimal"):
        result = rewrite(m, placement=placement)
        full_check(result.model)
        decision = {d.node: d for d in result.log.decisions.values()}[node]
        assert decision.precision.value == "fp32" and decision.reason.startswith("a square"), placement
        assert_emulated_close(m, result.model, {"x": x})
    # (BF16 holds FP32's range: the rules make Pow infer there, and no square is held for being one)
    assert not {d.node: d for d in rewrite(m, target="bf16").log.decisions.values()}[node].reason.startswith("a square")


_ROUND_TRIPS = {
    # an infer op painted low between two MatMuls that also reads an FP32 graph input and feeds an FP32 sum
    "an Add between allow ops, reading an FP32 input": ("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[4,4] x, float[4,4] z) => (float[4,4] y, float[4,1] s) {
          h = MatMul(z, w)
          a = Add(h, x)
          y = MatMul(a, w2)
          s = ReduceSum<keepdims=1>(a, axes)
        }""", "Add:a", {"x": np.full((4, 4), 1e5, np.float32), "z": np.ones((4, 4), np.float32)}),
    # an integer made float (Cast of int64) feeding an FP32 sum and a low MatMul through an Identity
    "a float cast of an integer": ("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (int64[4,4] p) => (float[4,4] y, float[4,1] s) {
          f = Cast<to=1>(p)
          r = Identity(f)
          s = ReduceSum<keepdims=1>(r, axes)
          y = MatMul(r, w2)
        }""", "Identity:r", {"p": np.full((4, 4), 100000, np.int64)}),
}


@pytest.mark.parametrize("placement", ["greedy", "optimal"])
@pytest.mark.parametrize("case", list(_ROUND_TRIPS))
def test_a_value_read_fp32_on_both_sides_of_a_node_keeps_that_node_fp32(case, placement):
    """Pitfall: an FP32 → FP16 → FP32 round trip. A node whose input is an FP32 tensor and whose
    output an FP32 op reads gains nothing low and overflows above 65504 (1e5 here: the FP32 sum
    read inf). Mutation testing found both cases untested: greedy's rule for a non-clear node on
    such a path (an Add between two MatMuls, its other operand an FP32 input), and the optimal
    placement taking a float Cast of an integer for an FP32 tensor."""
    from amp_rewrite.emulate import emulate_low

    text, node, feeds = _ROUND_TRIPS[case]
    model = make_model(text, {"w": np.full((4, 4), 1e-6, np.float32), "w2": np.full((4, 4), 0.1, np.float32),
                              "axes": np.array([1], np.int64)})
    result = rewrite(model, placement=placement)
    full_check(result.model)
    assert result.log.decisions[node].precision == Precision.FP32
    got = run(emulate_low(result.model, onnx.TensorProto.FLOAT16)[0], feeds)["s"]
    assert np.isfinite(got).all() and rel_err(run(model, feeds)["s"], got) < 1e-3


@pytest.mark.parametrize("placement", ["greedy", "optimal"])
def test_a_value_a_cast_hands_to_a_graph_output_makes_no_round_trip_through_fp16(placement):
    """A Transpose of an FP32 input feeds an fp16 MatMul and, through the model's own
    Cast(to=FLOAT), a graph output: painted fp16 it would take the input to fp16 and back to FP32
    for that output, 1e5 becoming inf. It stays FP32 and the output keeps its values."""
    model = make_model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[2,8] x) => (float[8,2] c, float[8,8] y) {
          r = Transpose<perm=[1,0]>(x)
          c = Cast<to=1>(r)
          y = MatMul(r, w)
        }""", {"w": (2, 8)})
    result = rewrite(model, placement=placement)
    full_check(result.model)
    assert result.log.decisions["Transpose:r"].precision == Precision.FP32
    assert result.log.decisions["MatMul:y"].precision == Precision.LOW
    assert_emulated_close(model, result.model, {"x": np.full((2, 8), 1e5, np.float32)}, output="c")


@pytest.mark.parametrize("placement", ["greedy", "optimal"])
def test_a_value_a_cast_to_fp16_hands_to_a_graph_output_goes_fp16(placement):
    """The model's own Cast(to=FLOAT16) of a Transpose feeding an fp16 MatMul hands the output the
    fp16 value it writes anyway: no round trip through fp16, so the Transpose follows the MatMul
    into fp16 (one Cast of the input, none after the Transpose)."""
    model = make_model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[2,8] x) => (float16[8,2] c, float[8,8] y) {
          r = Transpose<perm=[1,0]>(x)
          c = Cast<to=10>(r)
          y = MatMul(r, w)
        }""", {"w": (2, 8)})
    result = rewrite(model, placement=placement)
    full_check(result.model)
    assert result.log.decisions["Transpose:r"].precision == Precision.LOW
    assert sorted(c.tensor for c in result.log.casts if c.kind == "inserted") == ["x", "y/amp_fp16"]


@pytest.mark.parametrize("stored", [onnx.TensorProto.BFLOAT16, onnx.TensorProto.FLOAT, onnx.TensorProto.INT64])
def test_a_bf16_stored_mask_read_low_and_fp32_is_clamped_before_its_run_time_cast(stored):
    """A -1e9 mask stored as bfloat16, cast to FLOAT and read by a low attention-score Add and by an
    FP32 ReduceSum, is cast to fp16 at run time (it has an FP32 reader). Stored as FP32 or int64 it
    was clamped first; as bfloat16 it was not (numpy sees ml_dtypes' bfloat16 as kind 'V', which the
    range checks skipped, and a bfloat16 value was taken for a low one holding no sentinel): -inf in
    the fully masked row, NaN after the Softmax, on onnxruntime's CPU provider too."""
    from onnx import helper, parser

    mask = np.zeros((2, 16), np.float32)
    mask[0, 8:] = -1e9
    mask[1, :] = -1e9  # (a padding row: every score masked)
    cast = "mf = Identity(mc)" if stored == onnx.TensorProto.FLOAT else "mf = Cast<to=1>(mc)"
    model = parser.parse_model(f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[2,16] x) => (float[2,16] y, float[2,1] mn) {{
          {cast}
          sc = MatMul(x, w)
          z = Add(sc, mf)
          p = Softmax(z)
          y = MatMul(p, w)
          mn = ReduceSum(mf, ax)
        }}""")
    values = mask.astype(np.int64) if stored == onnx.TensorProto.INT64 else mask
    w = (np.random.default_rng(0).standard_normal((16, 16)) * 0.3).astype(np.float32)
    model.graph.initializer.extend([helper.make_tensor("mc", stored, (2, 16), values.reshape(-1).tolist()),
                                    onnx.numpy_helper.from_array(w, "w"),
                                    onnx.numpy_helper.from_array(np.array([1], np.int64), "ax")])
    out = rewrite(model).model
    full_check(out)
    assert nodes_by_type(out, "Clip")
    feeds = {"x": np.random.default_rng(1).standard_normal((2, 16)).astype(np.float32)}
    assert np.isfinite(run(out, feeds)["y"]).all()
    assert_emulated_close(model, out, feeds)
    assert not rewrite(out).modified
