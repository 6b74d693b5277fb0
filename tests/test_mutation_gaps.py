"""Gaps mutation testing found in the stop-53 changes (optimal constant-sum holds, torch sentinel
marks, --check's not-emulated notes, training-form BatchNormalization, unread tensors kept by
symbolic_trace) and in the stop-54 changes (holds before a sum a log reads, epsilon guards as
comparisons and Where, torch comparisons, BatchNormalization's training form by opset): each test
here failed on a mutant of that code the rest of the suite let through, and passes on the code as
written."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper as nh
from torch import nn

from util import make_model, rewrite, run

import amp_rewrite
from amp_rewrite.api import rewrite_onnx_model
from amp_rewrite.decisions import Precision

HELD = "the optimal placement keeps it FP32 too"


def test_optimal_says_it_keeps_fp32_only_what_greedy_kept_fp32():
    """(kills O3) A bias Add between two MatMuls adds a constant, but greedy runs it low: the
    optimal placement leaves it low and must not append 'keeps it FP32 too' to its reason."""
    rng = np.random.default_rng(0)
    m = make_model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[2,16] x) => (float[2,16] y) {
          m = MatMul(x, W1)
          a = Add(m, b)
          r = Relu(a)
          y = MatMul(r, W2)
        }""", {"W1": (rng.standard_normal((16, 16)) * .3).astype(np.float32),
               "W2": (rng.standard_normal((16, 16)) * .3).astype(np.float32),
               "b": rng.standard_normal(16).astype(np.float32)})
    result = rewrite(m)
    bias = result.log.decisions["Add:a"]
    assert bias.precision == Precision.LOW
    assert HELD not in (bias.reason or "")


_SCHEDULE = np.cumprod(1 - np.linspace(0.00085 ** 0.5, 0.012 ** 0.5, 1000) ** 2).astype(np.float32)


@pytest.mark.parametrize("target", ["fp16", "bf16"])
def test_optimal_holds_every_weight_move_into_a_constant_sum(target):
    """(kills O14) 1 - Unsqueeze(Gather(schedule, t)), with the Gather also read by a low-side Sqrt:
    the walk back from the held Sub must reach the Gather through the Unsqueeze, or the Gather goes
    low, the schedule is rounded offline (0.99915 -> 0.99902 / 1.0) and the result is 7% off / NaN."""
    from amp_rewrite.emulate import emulate_low
    rng = np.random.default_rng(0)
    W = (rng.standard_normal((6, 6)) * 0.3).astype(np.float32)
    m = make_model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[1,4,6,6] x, int64[1] t) => (float[1,4,6,6] y) {
          h = MatMul(x, W)
          a0 = Gather(schedule, t)
          a = Unsqueeze(a0, ax)
          oma = Sub(one, a)
          c = Sqrt(oma)
          sa = Sqrt(a0)
          sx = Mul(sa, h)
          num = Sub(x, sx)
          e = Div(num, c)
          y = MatMul(e, W)
        }""", {"W": W, "schedule": _SCHEDULE, "one": np.array(1.0, np.float32), "ax": np.array([0], np.int64)})
    result = rewrite(m, target=target)
    for name in ("Gather:a0", "Unsqueeze:a", "Sub:oma"):
        assert result.log.decisions[name].precision == Precision.FP32, name
    feeds = {"x": rng.standard_normal((1, 4, 6, 6)).astype(np.float32), "t": np.array([0], np.int64)}
    want, got = run(m, feeds)["y"], run(emulate_low(result.model)[0], feeds)["y"]
    assert np.isfinite(got).all() and np.abs(got - want).max() / np.abs(want).max() < 1e-2


class _Fill1e9MaskAttention(nn.Module):
    def __init__(self, fill: float) -> None:
        super().__init__()
        self.qkv, self.o = nn.Linear(8, 24), nn.Linear(8, 8)
        mask = torch.triu(torch.full((5, 5), fill), 1)
        mask[0] = fill  # (a fully masked row)
        self.register_buffer("mask", mask.expand(2, 5, 5).contiguous())

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        return self.o(torch.baddbmm(self.mask, q, k.transpose(1, 2), alpha=0.3).softmax(-1) @ v)


@pytest.mark.parametrize("fill", [-1e9, -1e10])
def test_a_mask_buffer_of_minus_1e9_cast_at_use_is_clamped(fill):
    """(kills F1) -1e9 is past fp16's range but far below finfo.min: the training rewrite casts the
    FP32 buffer at use, which must clamp it (a saturate cast), not make it -inf (NaN in the row)."""
    import amp_rewrite
    torch.manual_seed(0)
    model, x = _Fill1e9MaskAttention(fill).eval(), torch.randn(2, 5, 8)
    gm = amp_rewrite.rewrite(model, example_inputs=(x,), target="fp16", training=True)
    with torch.no_grad():
        out, ref = gm(x), model(x)
    assert torch.isfinite(out).all()
    assert (out - ref).abs().max() <= 1e-2 * ref.abs().max()


_RECURRENT = {
    "GRU": ("""<ir_version: 8, opset_import: ["" : 17]>
        g (float[4,1,8] x) => (float[4,1,8] y) {
          h = MatMul(x, W)  o, hn = GRU<hidden_size=8>(h, Wi, R)  s = Squeeze(o, one)  y = MatMul(s, W)
        }""", {"W": (8, 8), "Wi": (1, 24, 8), "R": (1, 24, 8), "one": np.array([1], np.int64)}),
    "RNN": ("""<ir_version: 8, opset_import: ["" : 17]>
        g (float[4,1,8] x) => (float[4,1,8] y) {
          h = MatMul(x, W)  o, hn = RNN<hidden_size=8>(h, Wi, R)  s = Squeeze(o, one)  y = MatMul(s, W)
        }""", {"W": (8, 8), "Wi": (1, 8, 8), "R": (1, 8, 8), "one": np.array([1], np.int64)}),
}


@pytest.mark.parametrize("op", list(_RECURRENT))
def test_check_says_a_low_gru_or_rnn_keeps_its_state_low(op, target="fp16"):
    """(kills E3/E4: GRU/RNN dropped from _LOW_INTERNALS) tests/test_check.py parametrizes CumSum,
    LSTM and Attention only. (No bf16 case: GRU/RNN/LSTM have no bf16 CUDA kernel and stay FP32.)"""
    from amp_rewrite import check as ck
    text, inits = _RECURRENT[op]
    m = make_model(text, inits)
    low = rewrite(m, fp16_ops=[op], target=target)
    says = f"keeps the hidden state in {target} between time steps"
    notes = [n for n in ck.check_models(m, low.model, target=target).notes if says in n]
    assert len(notes) == 1 and f"low-precision {op} node(s)" in notes[0]


def test_check_names_bf16_in_a_bf16_rewrites_internals_note():
    """(kills E11) the note names the low type of the node's inputs: a bf16 com.microsoft:Attention
    writes its QKV projection to a buffer of bf16, not fp16."""
    from amp_rewrite import check as ck
    m = make_model("""<ir_version: 8, opset_import: ["" : 17, "com.microsoft" : 1]>
        g (float[1,4,8] x) => (float[1,4,8] y) {
          a = com.microsoft.Attention<num_heads=2>(x, Wqkv, bqkv)  y = MatMul(a, W)
        }""", {"W": (8, 8), "Wqkv": (8, 24), "bqkv": (24,)})
    low = rewrite(m, target="bf16")
    notes = [n for n in ck.check_models(m, low.model, target="bf16").notes if "CUDA kernel" in n]
    assert len(notes) == 1 and "a buffer of bf16" in notes[0] and "fp16" not in notes[0]


def _lstm_model():
    return make_model("""<ir_version: 8, opset_import: ["" : 17]>
        g (float[4,1,8] x) => (float[4,1,8] y) {
          h = MatMul(x, W)  o, hn, cn = LSTM<hidden_size=8>(h, Wi, R)  s = Squeeze(o, one)  y = MatMul(s, W)
        }""", {"W": (8, 8), "Wi": (1, 32, 8), "R": (1, 32, 8), "one": np.array([1], np.int64)})


def test_not_emulated_reads_an_explicit_ai_onnx_domain():
    """(kills E8) a node whose domain is spelled "ai.onnx" is the default-domain LSTM."""
    from amp_rewrite.emulate import not_emulated
    low = rewrite(_lstm_model(), fp16_ops=["LSTM"]).model
    before = not_emulated(low)
    for n in low.graph.node:
        if n.op_type == "LSTM":
            n.domain = "ai.onnx"
    low.opset_import.append(onnx.helper.make_opsetid("ai.onnx", 17))
    assert before and not_emulated(low) == before


def test_not_emulated_looks_inside_subgraphs():
    """(kills E12) a low LSTM inside an If branch is noted as one at the top level is."""
    from amp_rewrite.emulate import not_emulated
    low = rewrite(_lstm_model(), fp16_ops=["LSTM"]).model
    from onnx import helper
    body = helper.make_graph(list(low.graph.node), "then", [], list(low.graph.output))
    other = helper.make_graph([helper.make_node("Identity", [low.graph.input[0].name], [low.graph.output[0].name + "_e"])],
                              "else", [], [helper.make_tensor_value_info(low.graph.output[0].name + "_e", low.graph.output[0].type.tensor_type.elem_type, None)])
    wrapped = helper.make_graph([helper.make_node("If", ["c"], ["out"], then_branch=body, else_branch=other)], "g",
                                [*low.graph.input, helper.make_tensor_value_info("c", onnx.TensorProto.BOOL, [])],
                                [helper.make_tensor_value_info("out", low.graph.output[0].type.tensor_type.elem_type, None)],
                                list(low.graph.initializer), value_info=list(low.graph.value_info))
    m = helper.make_model(wrapped, opset_imports=list(low.opset_import))
    m.ir_version = 8
    notes = not_emulated(m)
    assert len(notes) == 1 and "low-precision LSTM node(s)" in notes[0]


def test_not_emulated_sees_a_low_input_that_is_not_the_first():
    """(kills E7) a custom-domain node whose first input is an int64 index and second an fp16 table:
    its untyped output is unrounded, and said so."""
    from amp_rewrite.emulate import not_emulated
    from onnx import TensorProto as T, helper
    g = helper.make_graph([helper.make_node("Lookup", ["idx", "table"], ["v"], domain="mylib"),
                           helper.make_node("Cast", ["v"], ["y"], to=T.FLOAT)], "g",
                          [helper.make_tensor_value_info("idx", T.INT64, [3]),
                           helper.make_tensor_value_info("table", T.FLOAT16, [10, 4])],
                          [helper.make_tensor_value_info("y", T.FLOAT, None)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("mylib", 1)])
    m.ir_version = 8
    notes = not_emulated(m)
    assert len(notes) == 1 and "'v' of mylib:Lookup" in notes[0]


def _conv_bn_conv(attrs: str = "", domain: str = ""):
    rng = np.random.default_rng(0)
    op = f"{domain}.BatchNormalization" if domain else "BatchNormalization"
    imports = f', "{domain}" : 15' if domain else ""
    return make_model(f"""
        <ir_version: 8, opset_import: ["" : 15{imports}]>
        g (float[2,4,3,3] x) => (float[2,4,3,3] z) {{
          c = Conv<pads=[1,1,1,1]>(x, W)
          bn = {op}{attrs}(c, scale, bias, mean, var)
          z = Conv<pads=[1,1,1,1]>(bn, W)
        }}""", {"W": (rng.standard_normal((4, 4, 3, 3)) * 0.3).astype(np.float32),
                "scale": np.ones(4, np.float32), "bias": np.zeros(4, np.float32),
                "mean": np.zeros(4, np.float32), "var": np.ones(4, np.float32)})


def test_an_inference_batchnorm_with_an_explicit_training_mode_0_runs_low():
    """(kills L1) training_mode=0 is the inference form: it follows its low neighbours as the rule says."""
    for attrs in ("", "<training_mode=0>"):
        result = rewrite(_conv_bn_conv(attrs))
        bn = next(d for d in result.log.decisions.values() if d.op == "BatchNormalization")
        assert bn.precision == Precision.LOW, attrs



class _ClashingUnread(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.l1 = nn.Linear(8, 8)
        if kind == "submodule":
            self.code = nn.Linear(8, 3)  # (unused; GraphModule has a 'code' property)
        else:
            self.register_buffer("meta", torch.zeros(3))  # (unused; GraphModule has a 'meta' dict)

    def forward(self, x):
        return self.l1(x)


@pytest.mark.parametrize("kind", ["submodule", "buffer"])
def test_unread_tensors_named_as_graphmodule_attributes_do_not_crash(kind):
    """(kills A3: a path part taken by an attribute; A4: a leaf taken by one) _keep_unread_tensors
    leaves such a name out instead of raising KeyError from add_module/register_buffer."""
    import amp_rewrite
    model, x = _ClashingUnread(kind).eval(), torch.randn(2, 8)
    gm = amp_rewrite.rewrite(model, example_inputs=(x,), target="bf16", capture="symbolic_trace")
    with torch.no_grad():
        assert (gm(x) - model(x)).abs().max() <= 3e-2 * model(x).abs().max()


class _OneUnreadBuffer(nn.Module):
    def __init__(self, fold: bool) -> None:
        super().__init__()
        self.l1, self.fold = nn.Linear(16, 16), fold
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16)))

    def forward(self, x):
        if self.fold:
            return self.l1(x + (self.inv_freq * self.inv_freq).repeat(2))  # (computed while tracing)
        return self.l1(x)


@pytest.mark.parametrize("fold", [True, False])
def test_the_unread_buffer_note_needs_a_folded_tensor_and_counts_one(fold):
    """(kills A6: the note without a folded tensor; A8: 'are' for one buffer)"""
    import amp_rewrite
    model, x = _OneUnreadBuffer(fold).eval(), torch.randn(2, 16)
    gm, report = amp_rewrite.rewrite(model, example_inputs=(x,), target="bf16", capture="symbolic_trace", report=True)
    assert list(gm.state_dict()) == list(model.state_dict())
    notes = [n for n in report.log.notes if "not read by the traced graph" in n]
    if fold:
        assert len(notes) == 1 and "'inv_freq' is not read by the traced graph" in notes[0]
    else:
        assert not notes


class _AlphaSum(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        return torch.add(self.a(x) * 64, self.b(x).relu(), alpha=2.0)


def test_an_alpha_is_no_constant_addend_for_the_optimal_placement():
    """(kills O5) add's alpha scales the other operand; it adds no constant, so the min-cut may still
    run the sum low (it does here, where greedy keeps it FP32 before the output)."""
    import amp_rewrite
    x = torch.randn(2, 16)
    _, report = amp_rewrite.rewrite(_AlphaSum().eval(), example_inputs=(x,), target="bf16", placement="optimal", report=True)
    add = report.log.decisions["add"]
    assert add.precision == Precision.LOW and HELD not in (add.reason or "")


class _OneTensorTwoNames(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(4, 4)
        t = torch.ones(4)
        self.register_buffer("a", t)
        self.register_buffer("b", t)  # (the same tensor object: named_buffers() lists it once)

    def forward(self, x):
        return self.l1(x) + self.a


def test_an_unread_second_name_of_a_read_buffer_stays_registered():
    """(kills A10) named_buffers() de-duplicates by object: 'b' (the tensor 'a' is) was left out
    and the original's checkpoint failed a strict load (missing 'b')."""
    import amp_rewrite
    model, x = _OneTensorTwoNames().eval(), torch.randn(3, 4)
    gm = amp_rewrite.rewrite(model, example_inputs=(x,), target="bf16", capture="symbolic_trace")
    assert list(gm.state_dict()) == list(model.state_dict())
    gm.load_state_dict(model.state_dict())


def test_optimal_says_nothing_of_fp32_on_greedys_low_weight_movers():
    """(kills O11) the walk back from a held constant sum stops at nodes greedy ran low: the Gather
    and Unsqueeze a low Mul also reads stay low, and their reasons must not claim FP32."""
    m = make_model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[1,4] x, int64[1] t) => (float[1,1] y, float[1,4] z) {
          h = MatMul(x, W)
          a = Gather(schedule, t)
          a2 = Unsqueeze(a, ax)
          y = Sub(one, a2)
          m = Mul(a2, h)
          z = MatMul(m, W)
        }""", {"W": (4, 4), "schedule": _SCHEDULE, "one": np.array(1.0, np.float32), "ax": np.array([0], np.int64)})
    result = rewrite(m)
    assert HELD in result.log.decisions["Sub:y"].reason
    for name in ("Gather:a", "Unsqueeze:a2"):
        d = result.log.decisions[name]
        # (LOW here rounds the schedule: finding 3 of REPORT.md; whatever the fix, a LOW node's
        # reason must not say the optimal placement keeps it FP32)
        assert d.precision == Precision.FP32 or HELD not in (d.reason or ""), name


# -- stop 54's changes ------------------------------------------------------------------------------
def _onnx(nodes, inits, inputs=(("x", T.FLOAT, [2, 16]),), outputs=("y",), opset=17):
    g = h.make_graph([h.make_node(op, ins, [out], name=out, **attrs) for op, ins, out, attrs in nodes], "g",
                     [h.make_tensor_value_info(*i) for i in inputs],
                     [h.make_tensor_value_info(o, T.FLOAT, None) for o in outputs], inits)
    m = h.make_model(g, opset_imports=[h.make_opsetid("", opset)])
    m.ir_version = 8
    return m


def test_optimal_claims_no_fp32_hold_on_a_low_sum_a_log_reads():
    """(kills O3) MatMul -> Add(bias) read by a Log and by a MatMul: greedy runs the Add low, so the
    optimal placement leaves it free; _absorbing_before_a_log still names it, and only the filter on
    greedy's low nodes keeps 'keeps it FP32 too' out of a LOW node's reason."""
    rng = np.random.default_rng(0)
    W = [nh.from_array((rng.standard_normal((16, 16)) * .3).astype(np.float32), n) for n in ("W1", "W2")]
    b = nh.from_array(np.full(16, 50.0, np.float32), "b")
    m = _onnx([("MatMul", ["x", "W1"], "m", {}), ("Add", ["m", "b"], "a", {}), ("Log", ["a"], "y", {}),
               ("MatMul", ["a", "W2"], "z", {})], [*W, b], outputs=("y", "z"))
    for target in ("fp16", "bf16"):
        d = rewrite_onnx_model(m, target=target).log.decisions["a"]
        assert d.precision == Precision.FP32 or HELD not in (d.reason or ""), target


class _Log1pOfOneMinus(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(8, 8)

    def forward(self, x):
        return torch.log1p(-torch.sigmoid(self.l(x))).sum(-1)


@pytest.mark.parametrize("target", ["bf16", "fp16"])
def test_optimal_keeps_a_sigmoid_before_log1p_of_its_negation_fp32(target):
    """(kills B1, B2) log1p(-sigmoid(u)) is log(1 - sigmoid(u)): a summing log (_SUMMING_LOGS) whose
    walk back must start at the log1p itself. Without it the min-cut ran the sigmoid low: 1 in bf16
    from u = 5.5, log1p(-1) = -inf (fp16: 3% off), where greedy is within 2e-3."""
    torch.manual_seed(0)
    model, x = _Log1pOfOneMinus().eval(), torch.randn(2, 8)
    with torch.no_grad():
        model.l.weight.mul_(4.0)
        model.l.bias.fill_(6.0)
        reference = model(x)
        gm, report = amp_rewrite.rewrite(model, example_inputs=(x,), target=target, placement="optimal", report=True)
        got = gm(x)
    assert torch.isfinite(got).all() and (got - reference).abs().max() <= 5e-3 * reference.abs().max()
    assert report.log.decisions["sigmoid"].precision == Precision.FP32


def _emulated_rel_err(model, rewritten, feeds):
    """FP32 ``model`` vs ``rewritten`` run through emulate_low, in onnxruntime (subprocess-free here:
    the graphs hold no FP16 kernels once emulated)."""
    import onnxruntime as ort

    from amp_rewrite.emulate import emulate_low

    emulated, _ = emulate_low(rewritten)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    got = ort.InferenceSession(emulated.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    return float(np.abs(want - got).max() / np.abs(want).max())


def test_optimal_keeps_a_tanh_before_one_minus_its_pow_square_fp32_in_fp16():
    """(kills B8) log(1 - Pow(tanh(u), 2) + 1e-6): in fp16 the Pow is a deny op (fixed FP32), and the
    walk back from the sum must pass it (_NEAR_ONE_KEEPING) to hold the tanh, 1 in fp16 from u = 4.2.
    The Mul(t, t) spelling is tested; without Pow in the set the tanh went low: 19% off, greedy 0.1%."""
    rng = np.random.default_rng(0)
    inits = [nh.from_array((rng.standard_normal((16, 16)) * 2).astype(np.float32), "W"),
             nh.from_array(np.array(1.0, np.float32), "one"), nh.from_array(np.array(2.0, np.float32), "two"),
             nh.from_array(np.array(1e-6, np.float32), "eps"), nh.from_array(np.array([-1], np.int64), "ax")]
    m = _onnx([("MatMul", ["x", "W"], "u", {}), ("Tanh", ["u"], "t", {}), ("Pow", ["t", "two"], "t2", {}),
               ("Sub", ["one", "t2"], "s", {}), ("Add", ["s", "eps"], "a", {}), ("Log", ["a"], "l", {}),
               ("ReduceSum", ["l", "ax"], "y", {"keepdims": 0})], inits, inputs=(("x", T.FLOAT, [4, 16]),))
    result = rewrite_onnx_model(m, target="fp16", placement="optimal")
    assert result.log.decisions["t"].precision == Precision.FP32
    feeds = {"x": rng.standard_normal((4, 16)).astype(np.float32)}
    assert _emulated_rel_err(m, result.model, feeds) < 1e-2


def test_optimal_holds_a_softmax_scaled_by_a_growing_product_before_a_log():
    """(kills W5) log(softmax(m) * sigmoid(n)): the Mul is itself a widening node (a product of two
    activations); the walk back from the Log must pass it for the underflowing kind, or the Softmax
    (and the sigmoid) go fp16: probabilities below 6e-8 are 0 and the Log -inf, where greedy is 4e-4."""
    rng = np.random.default_rng(0)
    inits = [nh.from_array((rng.standard_normal((16, 16)) * 4).astype(np.float32), "W1"),
             nh.from_array((rng.standard_normal((16, 16)) * 0.1).astype(np.float32), "W2"),
             nh.from_array(np.array([-1], np.int64), "ax")]
    m = _onnx([("MatMul", ["x", "W1"], "m", {}), ("MatMul", ["x", "W2"], "n", {}), ("Sigmoid", ["n"], "g", {}),
               ("Softmax", ["m"], "s", {}), ("Mul", ["s", "g"], "p", {}), ("Log", ["p"], "l", {}),
               ("ReduceSum", ["l", "ax"], "y", {"keepdims": 0})], inits, inputs=(("x", T.FLOAT, [4, 16]),))
    result = rewrite_onnx_model(m, target="fp16", placement="optimal")
    assert result.log.decisions["s"].precision == Precision.FP32
    feeds = {"x": rng.standard_normal((4, 16)).astype(np.float32)}
    assert _emulated_rel_err(m, result.model, feeds) < 1e-2


def test_a_where_selecting_a_flushed_epsilon_in_its_else_slot_keeps_fp32():
    """(kills K2) Where(Greater(r, 0), r, 1e-8): the comparison with 0 is exact; the epsilon sits in
    Where's third input (slice(1, 3)), and the Where and the Div after it keep FP32."""
    rng = np.random.default_rng(0)
    inits = [nh.from_array(rng.standard_normal((8, 8)).astype(np.float32), "w"),
             nh.from_array(rng.standard_normal((8, 8)).astype(np.float32), "w2"),
             nh.from_array(np.array(1e-8, np.float32), "eps"), nh.from_array(np.array(0.0, np.float32), "zero")]
    m = _onnx([("MatMul", ["x", "w"], "h", {}), ("Relu", ["h"], "r", {}), ("Greater", ["r", "zero"], "c", {}),
               ("Where", ["c", "r", "eps"], "a", {}), ("Div", ["r", "a"], "q", {}), ("MatMul", ["q", "w2"], "y", {})],
              inits, inputs=(("x", T.FLOAT, [4, 8]),), opset=18)
    result = rewrite_onnx_model(m, target="fp16")
    assert result.log.decisions["a"].precision == result.log.decisions["q"].precision == Precision.FP32
    assert "selects 'eps' holding 1e-08" in result.log.decisions["a"].reason
    feeds = {"x": rng.standard_normal((4, 8)).astype(np.float32)}
    assert _emulated_rel_err(m, result.model, feeds) < 1e-2


@pytest.mark.parametrize(("compare", "then", "otherwise"), [("GreaterOrEqual", "r", "eps"), ("Greater", "r", "eps"),
                                                            ("LessOrEqual", "eps", "r"), ("Less", "eps", "r")])
def test_every_comparison_with_a_flushed_epsilon_keeps_fp32(compare, then, otherwise):
    """(kills K5, K10) Where(GreaterOrEqual(r, 1e-8), r, 1e-8): compared in fp16, 1e-8 is 0 and r >= 0
    is true of a zero r, so the zero is selected and r / guard is 0/0 = NaN, although the Where itself
    keeps FP32 ('selects'). Only Less is in the existing test; each comparison must be in _GUARDS."""
    rng = np.random.default_rng(0)
    inits = [nh.from_array(rng.standard_normal((8, 8)).astype(np.float32), "w"),
             nh.from_array(rng.standard_normal((8, 8)).astype(np.float32), "w2"),
             nh.from_array(np.array(1e-8, np.float32), "eps")]
    m = _onnx([("MatMul", ["x", "w"], "h", {}), ("Relu", ["h"], "r", {}), (compare, ["r", "eps"], "c", {}),
               ("Where", ["c", then, otherwise], "a", {}), ("Div", ["r", "a"], "q", {}), ("MatMul", ["q", "w2"], "y", {})],
              inits, inputs=(("x", T.FLOAT, [4, 8]),), opset=18)
    result = rewrite_onnx_model(m, target="fp16")
    assert result.log.decisions["c"].precision == Precision.FP32
    assert "compares with 'eps' holding 1e-08" in result.log.decisions["c"].reason
    feeds = {"x": rng.standard_normal((4, 8)).astype(np.float32)}
    assert _emulated_rel_err(m, result.model, feeds) < 1e-2


def test_optimal_keeps_a_variadic_sum_before_a_log_fp32_in_bf16():
    """(kills C6) softplus spelled Log(Sum(1, Exp(-|z|))): Sum is in _ABSORBING, so the optimal placement
    keeps it FP32 before its Log as greedy does (bf16 rounds 1 + 0.002 to 1), and the Exp for it."""
    rng = np.random.default_rng(0)
    inits = [nh.from_array((rng.standard_normal((16, 16)) * 3).astype(np.float32), "W"),
             nh.from_array(np.array(1.0, np.float32), "one"), nh.from_array(np.array([-1], np.int64), "ax")]
    m = _onnx([("MatMul", ["x", "W"], "z", {}), ("Abs", ["z"], "az", {}), ("Neg", ["az"], "n", {}), ("Exp", ["n"], "e", {}),
               ("Sum", ["one", "e"], "s", {}), ("Log", ["s"], "l", {}), ("ReduceSum", ["l", "ax"], "y", {})],
              inits, inputs=(("x", T.FLOAT, [4, 16]),))
    for placement in ("greedy", "optimal"):
        decisions = rewrite_onnx_model(m, target="bf16", placement=placement).log.decisions
        assert decisions["s"].precision == decisions["e"].precision == Precision.FP32, placement


class _ComparedGuard(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.l1, self.l2, self.how = nn.Linear(8, 8), nn.Linear(8, 8), how

    def forward(self, x):
        r = torch.relu(self.l1(x))
        guarded = {"lt": lambda: torch.where(r < 1e-8, 1e-8, r), "le": lambda: torch.where(r <= 1e-8, 1e-8, r),
                   "gt": lambda: torch.where(r > 1e-8, r, 1e-8), "ge": lambda: torch.where(r >= 1e-8, r, 1e-8),
                   "less": lambda: torch.where(torch.less(r, 1e-8), 1e-8, r),
                   "greater_equal": lambda: torch.where(torch.greater_equal(r, 1e-8), r, 1e-8)}[self.how]()
        return self.l2(r / guarded)


@pytest.mark.parametrize("how", ["lt", "le", "gt", "ge", "less", "greater_equal"])
def test_a_torch_comparison_with_a_flushed_epsilon_keeps_fp32(how):
    """(kills X2, X5) torch.where(r >= 1e-8, r, 1e-8): in fp16 r >= 0 holds for a zero r, the zero is
    selected and r / guard is NaN. Only '<' is in the existing test; every comparison of
    _EPSILON_ARGUMENTS must mark 'compares with'."""
    torch.manual_seed(0)
    model, x = _ComparedGuard(how).eval(), torch.randn(4, 8)
    with torch.no_grad():
        result = amp_rewrite.rewrite(model, example_inputs=(x,), target="fp16", capture="symbolic_trace", report=True)
    gm, report = result
    said = [d for d in report.log.decisions.values() if "compares with" in (d.reason or "")]
    assert said and all(d.precision == Precision.FP32 for d in said)


@pytest.mark.parametrize(("opset", "outputs", "attrs"), [(14, ["y"], {"training_mode": 1}),
                                                         (13, ["y", "rm"], {}), (13, ["y", "", "", "sm"], {})])
def test_a_training_batchnorm_keeps_fp32_whatever_statistics_outputs_it_names(opset, outputs, attrs):
    """(kills L1, L3) _trains: from opset 14 (not 15) training_mode=1 decides, even with Y alone; below
    it any one named statistics output (the running mean alone, or only a saved variance) makes the
    training form."""
    rng = np.random.default_rng(0)
    inits = [nh.from_array(rng.standard_normal((4, 4, 3, 3)).astype(np.float32), "w")] + \
            [nh.from_array(np.ones(4, np.float32) * v, n) for v, n in ((1, "s"), (0, "b"), (0, "mu"), (1, "var"))]
    g = h.make_graph([h.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
                      h.make_node("BatchNormalization", ["c", "s", "b", "mu", "var"], outputs, name="bn", **attrs)],
                     "g", [h.make_tensor_value_info("x", T.FLOAT, [2, 4, 5, 5])],
                     [h.make_tensor_value_info("y", T.FLOAT, None)], inits)
    m = h.make_model(g, opset_imports=[h.make_opsetid("", opset)])
    m.ir_version = 8
    decisions = rewrite_onnx_model(m, target="fp16").log.decisions
    bn = next(d for name, d in decisions.items() if "bn" in name or "BatchNormalization" in name)
    assert bn.precision == Precision.FP32
    assert "batch's mean and variance" in bn.reason


def test_an_inference_batchnorm_whose_absent_statistics_outputs_are_written_as_empty_names_runs_low():
    """(kills L4) BatchNormalization(opset 13) with outputs ["y", ""]: an empty name is an absent
    optional output, not the training form; the node runs low like the one-output form."""
    rng = np.random.default_rng(0)
    inits = [nh.from_array(rng.standard_normal((4, 4, 3, 3)).astype(np.float32), "w")] + \
            [nh.from_array(np.ones(4, np.float32) * v, n) for v, n in ((1, "s"), (0, "b"), (0, "mu"), (1, "var"))]
    g = h.make_graph([h.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
                      h.make_node("BatchNormalization", ["c", "s", "b", "mu", "var"], ["y", ""], name="bn")],
                     "g", [h.make_tensor_value_info("x", T.FLOAT, [2, 4, 5, 5])],
                     [h.make_tensor_value_info("y", T.FLOAT, None)], inits)
    m = h.make_model(g, opset_imports=[h.make_opsetid("", 13)])
    m.ir_version = 8
    decisions = rewrite_onnx_model(m, target="fp16").log.decisions
    bn = next(d for name, d in decisions.items() if "bn" in name or "BatchNormalization" in name)
    assert "batch's mean and variance" not in bn.reason
