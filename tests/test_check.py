"""--check and --auto-fp32 (issue 3, parts 5 and 6), and PRECISION.md pitfall 11: an intermediate
FP16 overflow that the outputs do not show.

The CLI tests run ``python -m amp_rewrite`` in a subprocess; the API tests call amp_rewrite.check
in-process (onnxruntime in the runner's child process, CPU provider here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from util import ROOT, full_check, make_model, rel_err, rewrite, run, run_cli, value_types

from amp_rewrite import check as ck
from amp_rewrite.decisions import Precision
from amp_rewrite.emulate import emulate_all, emulate_low

# -- models ---------------------------------------------------------------------------------------------
def overflow_model(sign: float = -1.0, *, named: bool = True) -> onnx.ModelProto:
    """logits = (x*x) @ w, y = softmax(logits). Three columns of w are sign*1e4, so with N(0, 1)
    inputs those logits are sign*~1.6e5: finite in FP32, ±inf in FP16. With sign=-1 the softmax
    output is the same either way (exp(-inf) = exp(-1.6e5) = 0): the overflow is invisible at the
    output (pitfall 11); with sign=+1 a GPU gives NaN."""
    w = np.random.default_rng(1).standard_normal((16, 8)).astype(np.float32) * 0.1
    w[:, :3] = sign * 1e4
    m = make_model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N,16] x) => (float[N,8] y) {
          sq = Mul(x, x)
          logits = MatMul(sq, w)
          y = Softmax(logits)
        }""", {"w": w})
    if named:
        for n in m.graph.node:
            n.name = f"/lm_head/{n.op_type}"
    return m


def benign_model() -> onnx.ModelProto:
    m = make_model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N,16] x) => (float[N,8] y) {
          h = MatMul(x, w1)
          r = Relu(h)
          y = MatMul(r, w2)
        }""", {"w1": (16, 16), "w2": (16, 8)})
    for n in m.graph.node:
        n.name = f"/mlp/{n.output[0]}"
    return m


def cancel_model() -> onnx.ModelProto:
    """y = h@w1 - h@w2 with w1 ≈ w2 ≈ 60: each product is ~1000 (FP16 spacing 0.5), their
    difference ~1: an accuracy failure without any overflow, found only by bisection."""
    rng = np.random.default_rng(2)
    inits, body, prev = {}, [], "x"
    for i in range(3):
        inits[f"a{i}"] = (rng.standard_normal((16, 16)) / 4).astype(np.float32)
        body += [f"m{i} = MatMul({prev}, a{i})", f"r{i} = Relu(m{i})"]
        prev = f"r{i}"
    w1 = (rng.standard_normal((16, 8)) * 0.1 + 60).astype(np.float32)
    inits["w1"] = w1
    inits["w2"] = (w1 + rng.standard_normal((16, 8)).astype(np.float32) * 0.02).astype(np.float32)
    body += [f"p = MatMul({prev}, w1)", f"q = MatMul({prev}, w2)", "y = Sub(p, q)"]
    m = make_model('<ir_version: 8, opset_import: ["" : 17]>\ng (float[N,16] x) => (float[N,8] y) {\n'
                   + "\n".join(body) + "\n}", inits)
    for n in m.graph.node:
        n.name = f"/net/{n.output[0]}"
    return m


_MASKS = {  # ways to compute the additive mask ``bias`` from ``mask``
    "float": "inv = Sub(one, mask)  bias = Mul(inv, big)",
    # (HF's (causal + padding).clamp(min=finfo.min): the Clip's min is the sentinel too)
    "clip": "inv = Sub(one, mask)  am = Mul(inv, big)  bias = Clip(am, big)",
    "int64 constant": "inv = Sub(one, mask)  bigf = Cast<to = 1>(big64)  bias = Mul(inv, bigf)",
    "double": """md = Cast<to = 11>(mask)  one64 = Cast<to = 11>(one)  big64d = Cast<to = 11>(big)
                 inv = Sub(one64, md)  bd = Mul(inv, big64d)  bias = Cast<to = 1>(bd)""",
    "if": """bias = If(always) <
               then_branch = t () => (float[N,8] tb) { inv = Sub(one, mask)  tb = Mul(inv, big) },
               else_branch = e () => (float[N,8] eb) { eb = Identity(mask) } >""",
}


def masked_attention_model(opset: int = 17, bias_input: bool = False, how: str = "float") -> onnx.ModelProto:
    """scores + (1 - mask) * finfo(float32).min between two MatMuls: the additive mask is an FP32
    runtime value cast to the low type. ``bias_input``: the caller feeds the additive mask itself;
    ``how``: how the mask is computed (:data:`_MASKS`)."""
    bias = "" if bias_input else _MASKS[how]
    unsqueeze = "Unsqueeze<axes = [1]>(bias)" if opset < 13 else "Unsqueeze(bias, one_axis)"
    m = make_model(f"""
        <ir_version: 8, opset_import: ["" : {opset}]>
        g (float[N,8,16] x, float[N,8] {"bias" if bias_input else "mask"}) => (float[N,8,16] y) {{
          q = MatMul(x, wq)
          k = MatMul(x, wk)
          kt = Transpose<perm = [0, 2, 1]>(k)
          s = MatMul(q, kt)
          {bias}
          b3 = {unsqueeze}
          sb = Add(s, b3)
          p = Softmax<axis = -1>(sb)
          y = MatMul(p, x)
        }}""", {"wq": (16, 16), "wk": (16, 16), "one": np.array(1.0, np.float32),
                "big": np.array(np.finfo(np.float32).min, np.float32), "one_axis": np.array([1], np.int64),
                "big64": np.array(-10 ** 9, np.int64), "always": np.array(True)})
    return m


def save(model: onnx.ModelProto, path: Path) -> Path:
    onnx.save(model, str(path))
    return path


# -- CLI ------------------------------------------------------------------------------------------------
def test_check_names_the_overflowing_matmul_and_exits_8(tmp_path):
    save(overflow_model(), tmp_path / "m.onnx")
    proc = run_cli(["m.onnx", "--check", "--report", "r.json"], tmp_path)
    assert proc.returncode == 8, proc.stderr
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("amp-rewrite: error: check failed")
    assert "/lm_head/MatMul (MatMul)" in err[0] and "-inf in fp16" in err[0]
    assert "first overflowing node: /lm_head/MatMul (MatMul)" in proc.stdout
    assert "max rel err" in proc.stdout and "check FAILED" in proc.stdout
    assert not (tmp_path / "m.fp16.onnx").exists()  # a failed command leaves no model behind
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["check"]["passed"] is False
    assert report["check"]["first_overflow"] == "/lm_head/MatMul"
    assert report["check"]["outputs"][0]["passed"] is True  # the output looked fine: pitfall 11
    from amp_rewrite.report import validate

    validate(report)


def test_auto_fp32_pins_the_matmul_and_the_written_model_passes(tmp_path):
    src = save(overflow_model(), tmp_path / "m.onnx")
    proc = run_cli(["m.onnx", "--auto-fp32", "-o", "out.onnx", "--report", "r.json"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "pinned /lm_head/MatMul (MatMul): overflow" in proc.stdout
    assert "check passed" in proc.stdout
    report = json.loads((tmp_path / "r.json").read_text())
    auto = report["auto_fp32"]
    assert [p["node"] for p in auto["pinned"]] == ["/lm_head/MatMul"]
    assert "overflow" in auto["pinned"][0]["reason"]
    assert auto["passed"] is True and auto["evaluations"] <= 5  # FP32 + 2 candidates + the written model
    assert report["check"]["passed"] is True
    from amp_rewrite.report import validate

    validate(report)
    out = tmp_path / "out.onnx"
    assert out.exists()
    again = ck.check_models(src, out)
    assert again.passed and not again.overflow


def test_auto_fp32_does_not_blame_a_cast_for_an_overflow_carried_through_fp32(tmp_path):
    """mm_big overflows; the model's own Cast(to=FLOAT) and an FP32 Mul carry its inf (not exposed:
    they are FP32) to the Cast into mm2, which was taken for a second root: mm2 was pinned too and
    nothing stayed FP16. A Cast of values within FP16's range cannot overflow itself."""
    m = make_model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[4,8] x) => (float[4,8] out) {
          y = MatMul(x, wbig)
          yc = Cast<to=1>(y)
          ys = Mul(yc, tiny)
          out = MatMul(ys, w)
        }""", {"wbig": np.full((8, 8), 1e5, np.float32), "tiny": np.array(1e-6, np.float32),
               "w": (np.random.default_rng(0).standard_normal((8, 8)) * 0.3).astype(np.float32)})
    save(m, tmp_path / "m.onnx")
    proc = run_cli(["m.onnx", "--auto-fp32", "-o", "out.onnx", "--report", "r.json"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    pinned = [p["node"] for p in json.loads((tmp_path / "r.json").read_text())["auto_fp32"]["pinned"]]
    assert pinned == ["MatMul:y"], pinned
    assert "MatMul/Gemm/Conv/attention in fp16: 1 of 2" in proc.stdout


def test_check_on_a_benign_model_passes_and_prints_the_table(tmp_path):
    save(benign_model(), tmp_path / "m.onnx")
    proc = run_cli(["m.onnx", "--check", "--report", "r.md"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    header = next(ln for ln in lines if "max abs err" in ln)
    for col in ("output", "max rel err", "cosine", "NaN/Inf fp32", "NaN/Inf fp16"):
        assert col in header
    row = next(ln for ln in lines if ln.split() and ln.split()[0] == "y")
    assert row.split()[-1] == "yes"
    assert "input x: float32[1, 16] N(0, 1)" in proc.stdout  # symbolic batch N -> 1
    assert "check passed" in proc.stdout
    assert (tmp_path / "m.fp16.onnx").exists()
    assert "## Accuracy check" in (tmp_path / "r.md").read_text()


def test_the_default_tolerance_follows_the_target(tmp_path):
    """--check allowed 1e-2 for bf16 too, so the bundled model failed `--target bf16 --check`
    (logits 0.0128: bf16 keeps 8 significant bits to fp16's 11). The default is now 5e-2 for bf16,
    1e-2 for fp16; --tolerance still overrides either."""
    bert = str(ROOT / "models" / "tiny_bert.onnx")
    proc = run_cli([bert, "--target", "bf16", "--check", "-o", "b.onnx", "--report", "r.json"], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "tolerance 0.05" in proc.stdout
    check = json.loads((tmp_path / "r.json").read_text())["check"]
    assert check["tolerance"] == 0.05 and check["passed"] is True
    worst = max(o["max_rel"] for o in check["outputs"])
    assert 1e-2 < worst <= 5e-2  # (what failed under the fp16 default)
    proc = run_cli([bert, "--target", "bf16", "--check", "-o", "c.onnx", "--tolerance", "1e-2"], tmp_path)
    assert proc.returncode == 8 and "tolerance 0.01" in proc.stdout
    proc = run_cli([bert, "--check", "-o", "f.onnx"], tmp_path)
    assert proc.returncode == 0 and "tolerance 0.01" in proc.stdout
    assert ck.default_tolerance("bf16") == 0.05 and ck.default_tolerance("fp16") == ck.default_tolerance(None) == 0.01


def test_check_uses_the_inputs_file(tmp_path):
    save(overflow_model(), tmp_path / "m.onnx")
    np.savez(tmp_path / "small.npz", x=np.full((3, 16), 0.01, np.float32))  # logits ~ -16: no overflow
    proc = run_cli(["m.onnx", "--check", "--inputs", "small.npz"], tmp_path)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert "input x: float32[3, 16] from small.npz" in proc.stdout


@pytest.mark.parametrize("arrays, needle", [
    ({"xx": np.zeros((1, 16), np.float32)}, "'xx' is not an input of the model (did you mean 'x'?)"),
    ({}, "no array for input 'x'"),
    ({"x": np.zeros((1, 15), np.float32)}, "'x' has shape [1, 15], the model wants ['N', 16]"),
    ({"x": np.zeros((1, 16), np.int64)}, "'x' is int64, the model wants float32"),
])
def test_bad_inputs_file_is_a_usage_error(tmp_path, arrays, needle):
    save(overflow_model(), tmp_path / "m.onnx")
    np.savez(tmp_path / "in.npz", **arrays)
    proc = run_cli(["m.onnx", "--check", "--inputs", "in.npz"], tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert needle in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "m.fp16.onnx").exists()


def test_check_fails_on_accuracy_without_overflow(tmp_path):
    """No overflow anywhere, the output is simply outside the tolerance: exit 8 naming the output."""
    save(cancel_model(), tmp_path / "m.onnx")
    proc = run_cli(["m.onnx", "--check"], tmp_path)
    assert proc.returncode == 8
    assert "output 'y': max relative error" in proc.stderr and "overflowing node" not in proc.stderr


# -- API: pitfall 11 and the search ---------------------------------------------------------------------
def test_pitfall_11_intermediate_overflow_invisible_at_the_outputs():
    m = overflow_model(-1.0)
    low = rewrite(m).model
    result = ck.check_models(m, low)
    (y,) = result.outputs
    assert y.passed and y.max_rel < 1e-3 and y.new_nonfinite == 0  # the output looks fine ...
    assert not result.passed  # ... but the check fails:
    root = result.roots[0]
    assert (root.node, root.op, root.value) == ("/lm_head/MatMul", "MatMul", "logits")
    assert root.neg_inf == 3 and root.fp32_max_abs > 65504
    assert "first overflowing node: /lm_head/MatMul (MatMul) — 3 values -inf in fp16" in result.table()
    assert result.evaluations == 3  # FP32 (with intermediates), rewritten, rewritten with intermediates


def test_auto_fp32_pins_unnamed_nodes_by_label():
    m = overflow_model(+1.0, named=False)
    auto = ck.auto_fp32(m)
    assert auto.check.passed
    assert [p["node"] for p in auto.pinned] == ["MatMul:logits"]
    assert auto.result.log.decisions["MatMul:logits"].precision.value == "fp32"


def test_auto_fp32_bisects_an_accuracy_failure_within_budget():
    m = cancel_model()
    first = ck.check_models(m, rewrite(m).model)
    assert not first.passed and not first.overflow
    auto = ck.auto_fp32(m)
    assert auto.check.passed
    assert sorted(p["node"] for p in auto.pinned) == ["/net/p", "/net/q"]
    assert all("bisection" in p["reason"] for p in auto.pinned)
    # (the decisions named --fp32-nodes, which the user never passed, as the pins' source)
    assert {auto.result.log.decisions[p["node"]].source for p in auto.pinned} == {"--auto-fp32"}
    n_low = len(ck._low_nodes(rewrite(m).model))
    assert auto.candidates <= auto.budget == 2 * int(np.ceil(np.log2(n_low + 1))) + 5
    assert auto.evaluations == auto.candidates + 1  # + the FP32 reference run


def test_auto_fp32_bisects_among_the_non_gemm_nodes_first():
    """d = h - 0.999 * h cancels: FP16 rounding of the product costs half of d. Pinning the GEMM
    making h passes too (what reads it follows it FP32), and as it comes first in graph order the
    bisection chose it, giving up the GEMM's speed where pinning the Mul suffices."""
    rng = np.random.default_rng(3)
    m = make_model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N,16] x) => (float[N,8] y) {
          h = MatMul(x, w)
          a = Mul(h, c)
          d = Sub(h, a)
          y = MatMul(d, w2)
        }""", {"w": (rng.standard_normal((16, 16)) * 0.5).astype(np.float32), "c": np.array(0.999, np.float32),
               "w2": (rng.standard_normal((16, 8)) * 0.5).astype(np.float32)})
    for n in m.graph.node:
        n.name = f"/net/{n.output[0]}"
    assert not ck.check_models(m, rewrite(m).model).passed
    auto = ck.auto_fp32(m)
    assert auto.check.passed
    pinned = [p["node"] for p in auto.pinned]
    assert pinned and not {"/net/h", "/net/y"} & set(pinned), pinned
    assert all("other than MatMul/Gemm/Conv/attention" in p["reason"] for p in auto.pinned)
    assert "MatMul/Gemm/Conv/attention in fp16: 2 of 2" in auto.result.report.summary_text()


def test_mask_sentinels_saturating_to_inf_are_not_overflow():
    """An additive mask the caller feeds (FP32 graph input, cast to FP16 at run time): its
    finfo(float32).min becomes -inf. Expected, not an overflow."""
    m = masked_attention_model(bias_input=True)
    low = rewrite(m).model
    feeds = {"x": np.random.default_rng(0).standard_normal((1, 8, 16)).astype(np.float32),
             "bias": np.array([[0, 0, 0, 0, 0, 0, 1, 1]], np.float32) * np.finfo(np.float32).min}
    result = ck.check_models(m, low, inputs=feeds)
    assert result.passed, result.table()
    assert not result.overflow
    assert any("sentinel" in n for n in result.notes)


_SATURATED = [(target, opset, "float") for target in ("fp16", "bf16") for opset in (10, 11, 13, 17)] + [
    ("fp16", 17, how) for how in ("int64 constant", "double", "if", "clip")]


@pytest.mark.parametrize("target, opset, how", _SATURATED)
def test_a_mask_sentinel_computed_at_run_time_saturates_before_its_cast(target, opset, how):
    """(1 - mask) * finfo(float32).min computed in FP32 and cast to the low type at run time: the
    Cast made it -inf, and a fully masked row (a padded sequence, a left-padded decoder row) NaN
    after the softmax, where FP32 gives a finite row. A constant the low type reads is converted
    offline, which saturates; the run-time value is now clamped before its Cast (Clip, FP32), and
    the reason says so."""
    m = masked_attention_model(opset, how=how)
    result = rewrite(m, target=target)
    low = result.model
    full_check(low)
    if target == "bf16" and opset < 13:  # (no bfloat16 kernels before opset 13: nothing goes low)
        assert not [n for n in low.graph.node if n.op_type == "Clip"]
        return
    clips = [n for n in low.graph.node if n.op_type == "Clip"]  # (how="clip": the model's own first)
    assert {p.key: p.value for p in clips[-1].metadata_props}["amp_rewrite.inserted"] == "saturate"
    record = next(c for c in result.log.casts if "mask sentinel" in c.reason)
    assert record.tensor in ("bias", "b3")
    assert "mask sentinel" in record.reason and "clamped to" in record.reason
    assert rewrite(low, target=target).model.graph == low.graph  # (rewriting it again changes nothing)
    feeds = {"x": np.random.default_rng(0).standard_normal((2, 8, 16)).astype(np.float32),
             "mask": np.array([[1, 1, 1, 1, 1, 1, 0, 0], [0] * 8], np.float32)}  # row 2: fully masked
    emulated, _ = emulate_low(low)  # (every low value rounded where it is made, as a GPU computes)
    want, got = run(m, feeds)["y"], run(emulated, feeds)["y"]
    assert np.isfinite(got).all()
    # the fully masked row attends to padding only: FP32 averages it (every score is finfo.min
    # alone), the low type nearly picks one (-65504 + score keeps part of the score); both are
    # finite, neither is meaningful. The other row is compared.
    assert rel_err(want[0], got[0]) < ck.default_tolerance(target)


def _two_causal_attention_layers(order: str) -> onnx.ModelProto:
    """Two causal attention layers sharing ``causal (-1e9 above the diagonal) + (1 - mask) * -1e9``,
    scaled by a negative number so every score is below -16. ``order``: "summed" (the two masks
    added into one, in FP32, then to the scores) or "chained" (the scores plus the causal constant,
    converted offline, plus the padding mask)."""
    masks = {"summed": "m = Add(causal, pad3)\n  a1 = Add(sc1, m)\n  a2 = Add(sc2, m)",
             "chained": "c1 = Add(sc1, causal)\n  a1 = Add(c1, pad3)\n  c2 = Add(sc2, causal)\n  a2 = Add(c2, pad3)"}
    lines = masks[order].split("\n  ")
    text = f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[1,6,8] x, float[1,6] mask) => (float[1,6,8] y) {{
          inv = Sub(one, mask)
          pad = Mul(inv, big)
          pad3 = Unsqueeze(pad, one_axis)
          {lines[0] if order == "summed" else ""}
          q1 = MatMul(x, wq1)
          kt1 = Transpose<perm = [0, 2, 1]>(x)
          s1 = MatMul(q1, kt1)
          sc1 = Mul(s1, scale)
          {"; ".join(line for line in lines if "1 = " in line or line.startswith("a1"))}
          p1 = Softmax<axis = -1>(a1)
          h1 = MatMul(p1, x)
          q2 = MatMul(h1, wq2)
          kt2 = Transpose<perm = [0, 2, 1]>(h1)
          s2 = MatMul(q2, kt2)
          sc2 = Mul(s2, scale)
          {"; ".join(line for line in lines if "2 = " in line or line.startswith("a2"))}
          p2 = Softmax<axis = -1>(a2)
          y = MatMul(p2, h1)
        }}"""
    text = text.replace("; ", "\n          ")
    rng = np.random.default_rng(0)
    return make_model(text, {"wq1": rng.uniform(0.1, 0.5, (8, 8)).astype(np.float32),
                             "wq2": rng.uniform(0.1, 0.5, (8, 8)).astype(np.float32),
                             "causal": np.triu(np.full((6, 6), -1e9, np.float32), 1),
                             "one": np.array(1.0, np.float32), "big": np.array(-1e9, np.float32),
                             "one_axis": np.array([1], np.int64), "scale": np.array(-0.5, np.float32)})


@pytest.mark.parametrize("placement", ["optimal", "greedy"])
@pytest.mark.parametrize("order", ["summed", "chained"])
def test_a_fully_masked_row_stays_finite_when_the_saturated_sentinel_meets_a_low_score(order, placement):
    """A left-padded sequence under a causal mask: its first rows mask every key. The sentinel
    saturated to -65504 (its Clip before the run-time Cast, or the causal constant converted
    offline), and the FP16 sum with a score of -16 or less was -inf: such a row was -inf
    throughout, NaN after its softmax, and the NaN reached every row through the second layer's
    keys, where FP32 gives finite rows. Such an FP16 sum is now clamped to ±65504 (Max), as HF
    clamps attention scores to finfo.min: the row is finite."""
    m = _two_causal_attention_layers(order)
    result = rewrite(m, placement=placement)
    low = result.model
    full_check(low)
    x = np.random.default_rng(1).standard_normal((1, 6, 8)).astype(np.float32) ** 2 + 1  # (scores < -16)
    feeds = {"x": x, "mask": np.array([[0, 0, 1, 1, 1, 1]], np.float32)}  # (left padding: rows 0, 1 mask all)
    emulated, _ = emulate_low(low)
    want, got = run(m, feeds)["y"], run(emulated, feeds)["y"]
    assert np.isfinite(want).all() and np.isfinite(got).all()
    # (the fully masked rows attend to padding only, finite but meaningless in both: the rest compare)
    assert rel_err(want[:, 2:], got[:, 2:]) < ck.default_tolerance("fp16")
    clamps = [n for n in low.graph.node if n.op_type == "Clip" and n.input[0] in ("a1", "a2", "c1", "c2")]
    assert len(clamps) == (2 if order == "summed" else 4)  # (one per sum with a mask, per layer)
    assert all(n.name.startswith("amp_saturate/") for n in clamps)
    assert f"clamped sums: {len(clamps)} fp16 Add/Sub reading a mask sentinel" in result.report.summary_text()
    assert not rewrite(low, placement=placement).modified


@pytest.mark.parametrize("mask, opset", [("(1 - m) * -1e9", 17), ("(m - 1) * 1e9", 17), ("-((1 - m) * 1e9)", 17),
                                         ("(1 - m) * -1e9", 10), ("(1 - m) * -1e9", 7)])
def test_a_padding_mask_added_to_fp16_scores_is_clamped_whatever_its_sign_and_opset(mask, opset):
    """A fully padded sequence with scores near -20 (an ALiBi-like bias): each masked score is
    -65504 - 20 in FP16, -inf, and the softmax row NaN. The sum is clamped on both sides: the
    clamp chosen by the constant's sign (+1e9 in ``(m - 1) * 1e9``) was a Min, and the row NaN;
    before opset 12 (no FP16 Clip) a Max and a Min; before opset 8 (Max does not broadcast) none,
    and the model still runs (the inserted Max failed in onnxruntime there)."""
    spelled = {"(1 - m) * -1e9": "inv = Sub(one, m)\n          pm = Mul(inv, neg)",
               "(m - 1) * 1e9": "inv = Sub(m, one)\n          pm = Mul(inv, pos)",
               "-((1 - m) * 1e9)": "inv = Sub(one, m)\n          pp = Mul(inv, pos)\n          pm = Neg(pp)"}[mask]
    model = make_model(f"""
        <ir_version: 7, opset_import: ["" : {opset}]>
        g (float[2,6,8] x, float[2,1,6] m) => (float[2,6,8] y) {{
          q = MatMul(x, wq)
          kt = Transpose<perm = [0, 2, 1]>(x)
          s = MatMul(q, kt)
          s2 = Add(s, bias)
          {spelled}
          s3 = Add(s2, pm)
          p = Softmax<axis = 2>(s3)
          y = MatMul(p, x)
        }}""", {"wq": (np.random.default_rng(0).standard_normal((8, 8)) / 3).astype(np.float32),
                "bias": np.array(-20.0, np.float32), "one": np.array(1.0, np.float32),
                "neg": np.array(-1e9, np.float32), "pos": np.array(1e9, np.float32)}, ir_version=7)
    low = rewrite(model).model
    full_check(low)
    clamps = {n.op_type for n in low.graph.node if n.name.startswith("amp_saturate/") and n.op_type != "Constant"
              and n.input[0] != "pm"}
    assert clamps == ({"Clip"} if opset >= 12 else {"Max", "Min"} if opset >= 8 else set())
    m = np.ones((2, 1, 6), np.float32)
    m[0] = 0  # (sequence 0: all padding)
    feeds = {"x": np.random.default_rng(1).standard_normal((2, 6, 8)).astype(np.float32), "m": m}
    want, got = run(model, feeds)["y"], run(emulate_low(low)[0], feeds)["y"]
    assert np.isfinite(want).all()
    if opset >= 8:
        assert np.isfinite(got).all() and rel_err(want[1], got[1]) < ck.default_tolerance("fp16")


_NOT_MASKS = {
    # T5's clamp(h, -finfo.max, finfo.max): a bound, not a mask; FP16 data up to 65504 passes it
    "clip bound": ("""h = MatMul(x, w)
          c = Clip(h, lo, hi)
          y = MatMul(c, w)""", {"x": [[30000, 20000, 100, 1], [-30000, 5, 6, 7]]}),
    # a masked max: what is not masked keeps its value, 30000 included
    "masked max": ("""h = MatMul(x, w)
          mh = Where(keep, h, neg)
          p = ReduceMax<axes = [0], keepdims = 1>(mh)
          y = MatMul(p, w)""", {"x": [[20000, 1, 2, 3], [4, 30000, 6, 7]], "keep": [[True] * 4, [True, True, False, True]]}),
    # the masked entries found by a threshold between -65504 and the sentinel
    "threshold": ("""h = MatMul(x, w)
          ms = Where(keep, h, neg)
          t = Less(ms, thr)
          z = Where(t, zero, ms)
          y = MatMul(z, w)""", {"x": [[0, 1, 2, 3], [4, 5, 6, 7]], "keep": [[True, True, False, False], [True, False, True, False]]}),
}


@pytest.mark.parametrize("case", list(_NOT_MASKS))
def test_sentinel_sized_constants_that_are_no_additive_mask_keep_fp16_data_exact(case):
    """A fix that saturated mask sentinels to ±16384 instead of ±65504 (for the sum with a score)
    clipped FP16 data that FP32 keeps: a Clip bound of finfo.max became 16384 (T5's clamp: 45%
    off), a Where/ReduceMax masked max clipped its 30000s, and Less(ms, -30000) stopped finding
    the masked entries. Sentinels saturate at ±65504; the sum with a score is clamped after it."""
    body, feeds = _NOT_MASKS[case]
    big = np.float32(np.finfo(np.float32).max)
    model = make_model(f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[2,4] x, bool[2,4] keep) => (float[{1 if case == "masked max" else 2},4] y) {{
          {body}
        }}""", {"w": np.eye(4, dtype=np.float32), "lo": np.array(-big), "hi": np.array(big),
                "neg": np.array(-1e9, np.float32), "thr": np.array(-3e4, np.float32), "zero": np.array(0, np.float32)})
    low = rewrite(model).model
    full_check(low)
    feeds = {"x": np.asarray(feeds["x"], np.float32), "keep": np.asarray(feeds.get("keep", [[True] * 4] * 2))}
    want, got = run(model, feeds)["y"], run(emulate_low(low)[0], feeds)["y"]
    assert np.isfinite(got).all() and rel_err(want, got) < 1e-3


def test_a_mask_sentinel_an_overridable_input_holds_saturates_before_its_cast():
    """finfo(float32).min in an initializer also listed as a graph input (IR >= 4: an overridable
    default, as keep_initializers_as_inputs exports write): not a constant, so no Clip, and -inf."""
    m = masked_attention_model(17)
    m.graph.input.append(onnx.helper.make_tensor_value_info("big", onnx.TensorProto.FLOAT, []))
    result = rewrite(m)
    full_check(result.model)
    assert [n for n in result.model.graph.node if n.op_type == "Clip"]
    feeds = {"x": np.random.default_rng(0).standard_normal((2, 8, 16)).astype(np.float32),
             "mask": np.array([[1, 1, 1, 1, 1, 1, 0, 0], [0] * 8], np.float32)}
    emulated, _ = emulate_low(result.model)
    assert np.isfinite(run(emulated, feeds)["y"]).all()


def test_no_clip_where_the_mask_stays_fp32():
    """Scores scaled by a Pow (deny: FP32) keep the mask Add and the Softmax FP32: no run-time cast
    of the mask, and the Softmax's output, cast for the MatMul after it, holds probabilities. The
    walk upstream went through the Softmax (an infer op) and clamped its output 'for the mask'."""
    m = make_model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N,8,16] x, float[N,8] mask) => (float[N,8,16] y) {
          s = MatMul(x, w)
          sc = Pow(s, two)
          inv = Sub(one, mask)
          bias = Mul(inv, big)
          b3 = Unsqueeze(bias, one_axis)
          sb = Add(sc, b3)
          p = Softmax<axis = -1>(sb)
          y = MatMul(p, x)
        }""", {"w": (16, 8), "two": np.array(2.0, np.float32), "one": np.array(1.0, np.float32),
               "big": np.array(np.finfo(np.float32).min, np.float32), "one_axis": np.array([1], np.int64)})
    result = rewrite(m)
    assert not [n for n in result.model.graph.node if n.op_type == "Clip"]
    assert not [c for c in result.log.casts if "mask sentinel" in c.reason]


def test_the_sentinel_walk_stops_at_a_low_node_whose_sentinel_was_converted():
    """A Where selecting finfo.min runs low (its constant converted offline, clamped); an FP32 Mul
    reading it (by 1e5, past FP16's range) has its output cast for the next MatMul: the walk went
    through the low Where to the constant's FP32 data and clamped a value that holds no sentinel.
    (The Mul's 1e5 is a number past the range the cast may hold: clamped at ±65504 for it, and
    the reason names it, not the sentinel.)"""
    m = make_model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[2,8] x, bool[2,8] keep) => (float[2,8] y) {
          h = MatMul(x, w)
          a = Where(keep, h, big)
          c = Mul(a, k)
          y = MatMul(c, w)
        }""", {"w": (8, 8), "big": np.array(np.finfo(np.float32).min, np.float32), "k": np.array(1e5, np.float32)})
    result = rewrite(m)
    assert {d.node: d.precision.value for d in result.log.decisions.values()}["Where:a"] == "low"
    record = next(c for c in result.log.casts if c.tensor == "c")
    assert "clamped to ±65504 first (Clip): it may hold 100000 ('k')" in record.reason
    assert "sentinel" not in record.reason


@pytest.mark.parametrize("index_input", ["Slice ends", "reversed Slice", "Gather indices"])
def test_an_index_input_is_no_mask_sentinel(index_input):
    """``x[..., 4:]`` exports its ``ends`` as INT64_MAX ("to the end"): the walk for a mask sentinel
    followed every input of a Slice, took 9.2e18 for a mask, put a Clip before the Cast of each
    layer's KV-cache key and said so in the report. Only the inputs that carry data are followed."""
    op = {"Slice ends": "s = Slice(x, starts, ends, axes)",
          "reversed Slice": "s = Slice(x, minus_one, int64_min, axes, minus_one)",  # (x.flip(1)[:, :4])
          "Gather indices": "s = Gather<axis=1>(x, far)"}[index_input]
    m = make_model(f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[2,8] x, float[2,4] past) => (float[2,8] y, float[2,8] present) {{
          {op}
          s4 = Slice(s, zero, four, axes)
          present = Concat<axis=1>(past, s4)
          y = MatMul(present, w)
        }}""", {"w": (8, 8), "starts": np.array([4], np.int64), "ends": np.array([np.iinfo(np.int64).max], np.int64),
                "axes": np.array([1], np.int64), "minus_one": np.array([-1], np.int64),
                "int64_min": np.array([np.iinfo(np.int64).min], np.int64),
                "far": np.full(8, 2**40, np.int64), "zero": np.array([0], np.int64), "four": np.array([4], np.int64)})
    result = rewrite(m)
    full_check(result.model)
    assert not [n for n in result.model.graph.node if n.op_type == "Clip"]
    assert not [c for c in result.log.casts if "mask sentinel" in c.reason]


def test_generated_inputs_follow_names_and_embedding_tables():
    m = make_model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (int64[batch, sequence] input_ids, int64[batch, sequence] attention_mask,
           int64[batch, sequence] token_type_ids, float[batch, 3, height, width] pixels) => (float[batch, sequence, 4] y) {
          e = Gather(emb, input_ids)
          t = Gather(tt, token_type_ids)
          y = Add(e, t)
        }""", {"emb": (50, 4), "tt": (2, 4)})
    feeds, described = ck.make_inputs(m)
    ids, mask, tt, px = feeds["input_ids"], feeds["attention_mask"], feeds["token_type_ids"], feeds["pixels"]
    assert ids.shape == mask.shape == tt.shape == (1, 8) and ids.dtype == np.int64
    assert ids.min() >= 0 and ids.max() < 50
    assert mask.tolist() == [[1, 1, 1, 1, 1, 1, 1, 0]] and not tt.any()
    assert px.shape == (1, 3, 64, 64) and px.dtype == np.float32
    assert described[0]["values"] == "ids in [0, 50)"


def test_generated_masks_pad_the_last_position_only_past_two_and_short_batch_names_are_one():
    """A mask of more than two positions has its last one 0 (padding is exercised); one of two
    positions or fewer is all ones. A dim named n, b or bs is a batch of 1 wherever it stands (a
    time-major [time, b, 5] input is [8, 1, 5])."""
    m = make_model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (int64[bs, 2] attention_mask, int64[n, 3] pad_mask, float[time, b, 5] x) => (float[bs, 2] y) {
          y = Cast<to=1>(attention_mask)
        }""")
    feeds, described = ck.make_inputs(m)
    assert feeds["attention_mask"].tolist() == [[1, 1]] and described[0]["values"] == "mask: ones"
    assert feeds["pad_mask"].tolist() == [[1, 1, 0]] and described[1]["values"] == "mask: ones, last position 0"
    assert feeds["x"].shape == (8, 1, 5)


def test_generated_ids_fit_a_narrow_type_and_follow_a_negative_gather_axis():
    """Ids of a type narrower than the vocabulary stay within the type (uint8: [0, 256) for 300
    rows, not wrapped); a Gather on axis -2 of a [300, 4] table takes its 300 rows."""
    m = make_model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (uint8[batch, 4] input_ids, int64[batch, 4] word_ids) => (float[batch, 4, 4] e, float[batch, 4, 4] f) {
          i = Cast<to=7>(input_ids)
          e = Gather<axis=-2>(emb, i)
          f = Gather<axis=-2>(emb, word_ids)
        }""", {"emb": (300, 4)})
    feeds, described = ck.make_inputs(m)
    assert described[0]["values"] == "ids in [0, 256)" and feeds["input_ids"].dtype == np.uint8
    assert described[1]["values"] == "ids in [0, 300)"


def test_integer_outputs_compare_by_mismatch_fraction():
    s = ck.compare_output("argmax", np.array([1, 2, 3, 4]), np.array([1, 2, 3, 5]), 0.3)
    assert s.passed and s.max_rel == 0.25 and s.compared == "mismatch fraction"
    f = ck.compare_output("y", np.array([1.0, 2.0], np.float32), np.array([1.0, np.nan], np.float16), 0.1)
    assert not f.passed and f.new_nonfinite == 1 and f.nan_low == 1
    assert f.max_abs == f.max_rel == np.inf  # (max_abs said 0 beside max_rel inf: over the finite pairs only)
    swapped = ck.compare_output("y", np.array([np.inf, 2.0], np.float32), np.array([-np.inf, 2.0], np.float16), 0.1)
    assert not swapped.passed and swapped.max_abs == swapped.max_rel == np.inf  # (both said 0)
    same = ck.compare_output("y", np.array([-np.inf, 1.0], np.float32), np.array([-np.inf, 1.0], np.float16), 0.1)
    assert same.passed  # the same non-finite value in both is not an error


def test_an_error_equal_to_the_tolerance_passes():
    """An output fails when its relative error exceeds the tolerance, not when it reaches it (an
    integer output: its mismatch fraction)."""
    ref = np.array([4.0, 1.0], np.float32)
    at = ck.compare_output("y", ref, np.array([4.5, 1.0], np.float16), 0.125)
    assert at.max_rel == 0.125 and at.passed
    assert not ck.compare_output("y", ref, np.array([4.5, 1.0], np.float16), 0.12).passed
    ids = ck.compare_output("ids", np.array([1, 2, 3, 4]), np.array([1, 2, 3, 5]), 0.25)
    assert ids.max_rel == 0.25 and ids.passed


def test_an_output_of_zeros_in_fp32_fails_when_the_rewrite_makes_it_nonzero():
    """Relative to an FP32 output that is all zeros, any nonzero difference is infinitely large."""
    s = ck.compare_output("y", np.zeros(3, np.float32), np.array([0.0, 1e-3, 0.0], np.float16), 1e-2)
    assert not s.passed and s.max_rel == np.inf and s.max_abs > 0
    assert ck.compare_output("y", np.zeros(3, np.float32), np.zeros(3, np.float16), 1e-2).passed


def test_cosine_of_an_output_the_rewrite_zeroes_is_zero():
    """The cosine similarity against an all-zero output is 0 (1 only when both are all zeros)."""
    ref = np.array([1.0, 2.0], np.float32)
    assert ck.compare_output("y", ref, np.zeros(2, np.float16), 1e-2).cosine == 0.0
    assert ck.compare_output("y", np.zeros(2, np.float32), np.zeros(2, np.float16), 1e-2).cosine == 1.0


def test_a_changed_output_shape_is_named_not_called_an_integer_mismatch():
    """A shape change showed as 'inf*' with the footnote for integer outputs, and the failure said
    'max relative error inf; try --auto-fp32', which cannot fix it."""
    s = ck.compare_output("y", np.ones((1, 2, 4), np.float32), np.ones((2, 4), np.float16), 0.01)
    assert not s.passed
    result = ck.CheckResult(passed=False, tolerance=0.01, target="fp16", provider="CPUExecutionProvider", outputs=[s])
    assert result.reshaped == [s]
    assert "* y: shape [1, 2, 4] vs [2, 4] (FP32 vs fp16): the shapes differ" in result.table()
    assert "integer/bool" not in result.table()
    message = result.failure_message()
    assert "shape [1, 2, 4] vs [2, 4]" in message and "a bug in amp-rewrite" in message and "relative" not in message


def test_runner_falls_back_to_cpu_when_cuda_cannot_load():
    runner = ck.Runner()
    m = benign_model()
    runner.run(m, {"x": np.zeros((1, 16), np.float32)}, what="test")
    assert runner.provider in ("CPUExecutionProvider", "CUDAExecutionProvider")
    assert runner.evaluations == 1
    if not ck.cuda_usable():
        assert runner.provider == "CPUExecutionProvider"


@pytest.mark.skipif(os.name != "posix", reason="onnxruntime runs in a child process on POSIX only")
def test_a_crash_in_onnxruntime_is_an_error_and_the_next_run_starts_afresh(monkeypatch):
    """onnxruntime can abort or segfault instead of raising; run in-process, that ended the whole
    check (and amp-rewrite) with 'Aborted'. The runner's child dies instead: a RuntimeError naming
    the signal, and the next run gets a fresh child."""
    from amp_rewrite.ort_worker import FAULT_ENV, OrtCrash

    feeds = {"x": np.zeros((1, 16), np.float32)}
    monkeypatch.setenv(FAULT_ENV, "segv")
    runner = ck.Runner(["CPUExecutionProvider"])
    with pytest.raises(OrtCrash, match=r"^first: onnxruntime crashed the process running it \(killed by SIGSEGV\)"):
        runner.run(benign_model(), feeds, what="first")
    monkeypatch.delenv(FAULT_ENV)
    out = runner.run(benign_model(), feeds, what="second")
    assert out["y"].shape == (1, 8) and runner.evaluations == 2
    runner.close()


def test_cli_check_of_a_model_that_aborts_onnxruntime_exits_with_one_line(tmp_path):
    """RandomNormal(scale=0) trips an assertion inside onnxruntime's kernel (SIGABRT): --check
    died with exit 134 and a C++ assertion text. (Should onnxruntime come to accept it, the check
    just runs.)"""
    m = onnx.helper.make_model(onnx.helper.make_graph(
        [onnx.helper.make_node("RandomNormal", [], ["r"], shape=[4, 4], scale=0.0),
         onnx.helper.make_node("Add", ["x", "r"], ["a"]), onnx.helper.make_node("MatMul", ["a", "w"], ["y"])], "g",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [4, 4])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [4, 4])],
        [onnx.numpy_helper.from_array(np.eye(4, dtype=np.float32), "w")]),
        opset_imports=[onnx.helper.make_opsetid("", 17)], ir_version=8)
    save(m, tmp_path / "m.onnx")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    r = run_cli(["m.onnx", "--check"], tmp_path, env={"TMPDIR": str(tmp)})
    assert r.returncode in (0, 2), r.stderr
    if r.returncode == 2:
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and "onnxruntime crashed the process running it" in lines[0], r.stderr
        assert "Traceback" not in r.stderr
    # (the worker onnxruntime aborted left its temporary folder, one per crash, in /tmp)
    assert not [p.name for p in tmp.iterdir() if p.name.startswith("amp-check-")]


def test_fp32_model_failing_on_generated_inputs_asks_for_inputs(tmp_path):
    """Generated inputs are a guess (M -> 8 here); when the model rejects them, say so: exit 2."""
    m = make_model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N,M] x) => (float[4,4] y) {
          r = Reshape(x, shape)
          y = MatMul(r, w)
        }""", {"shape": np.array([4, 4], np.int64), "w": (4, 4)})
    save(m, tmp_path / "m.onnx")
    proc = run_cli(["m.onnx", "--check"], tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "cannot run the FP32 model on the generated inputs" in proc.stderr
    assert "--inputs file.npz" in proc.stderr
    assert not (tmp_path / "m.fp16.onnx").exists()
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr  # onnxruntime's own log stays out of it
    np.savez(tmp_path / "in.npz", x=np.ones((2, 8), np.float32))
    assert run_cli(["m.onnx", "--check", "--inputs", "in.npz"], tmp_path).returncode == 0


@pytest.mark.parametrize("via", ["Identity", "Cast"])
def test_generated_ids_find_a_table_behind_identity_or_cast(via):
    """A tied weight reaches its Gather through Identity, an FP16-stored table through Cast: the
    table was not found and ids were drawn from [0, 100), out of range of a 50-row vocabulary."""
    m = make_model(f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g (int64[batch, sequence] input_ids) => (float[batch, sequence, 4] e) {{
          tied = {via}{"<to=1>" if via == "Cast" else ""}(emb)
          e = Gather(tied, input_ids)
        }}""", {"emb": (50, 4)})
    feeds, described = ck.make_inputs(m)
    assert described[0]["values"] == "ids in [0, 50)" and feeds["input_ids"].max() < 50


def test_check_feeds_and_reads_bf16_inputs_and_outputs(tmp_path):
    """--target bf16 --no-keep-io-types: the rewritten model takes and gives bfloat16, which numpy
    lacks; --check fed it float32 ("expected: (tensor(bfloat16))"), deleted the model and exited 8."""
    from amp_rewrite.check import _bf16_value, _numpy_of

    x = np.array([1.0, -2.5, 3.14159, 65504.0, 1e-3, np.inf], np.float32)
    back = _numpy_of(_bf16_value(x))
    assert back.dtype == np.float32 and back.shape == x.shape
    torch = pytest.importorskip("torch")  # an independent rounding to bfloat16
    np.testing.assert_array_equal(back, torch.from_numpy(x).to(torch.bfloat16).float().numpy())
    # onnxruntime's CPU provider has no bfloat16 MatMul; its Transpose takes any type
    save(make_model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[4,16] x) => (float[16,4] y) {
          y = Transpose<perm=[1,0]>(x)
        }"""), tmp_path / "m.onnx")
    proc = run_cli(["m.onnx", "-o", "o.onnx", "--target", "bf16", "--no-keep-io-types", "--fp16-ops", "Transpose",
                    "--check"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = onnx.load(str(tmp_path / "o.onnx"))
    assert out.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.BFLOAT16
    assert "PASSED" in proc.stdout or "passed" in proc.stdout


def test_auto_fp32_writes_the_report_when_a_candidate_cannot_run(tmp_path, monkeypatch, capsys):
    """--check wrote the report recording onnxruntime's failure; --auto-fp32 exited 8 without one.
    (Every run of a rewritten candidate fails here; the FP32 reference runs.)"""
    from amp_rewrite.cli import main

    real = ck.Runner.run

    def refuse_rewritten(self, model, feeds, *, what, **kwargs):
        if "rewritten" in what:
            raise RuntimeError(f"{what}: NOT_IMPLEMENTED : could not find an implementation for MatMul(13)")
        return real(self, model, feeds, what=what, **kwargs)

    monkeypatch.setattr(ck.Runner, "run", refuse_rewritten)
    save(benign_model(), tmp_path / "m.onnx")
    monkeypatch.chdir(tmp_path)
    assert main(["m.onnx", "-o", "o.onnx", "--target", "bf16", "--auto-fp32", "--report", "r.json"]) == 8
    assert "onnxruntime cannot run the rewritten model" in capsys.readouterr().err
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["check"]["passed"] is False and "cannot run" in report["check"]["notes"][0]
    assert not (tmp_path / "o.onnx").exists()


# -- FP16/BF16 numerics on the CPU provider ------------------------------------------------------------
def _add_sub_model() -> onnx.ModelProto:
    """d = (x@w + 3000) - 3000, then d@w: in FP16 the sum is rounded to a spacing of 2, so d keeps
    little of x@w (relative error ~0.4 at the output). Add and Sub have no FP16 CPU kernels."""
    rng = np.random.default_rng(0)
    m = make_model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[2,8] x) => (float[2,8] y) {
          h = MatMul(x, w)
          z = Add(h, c)
          d = Sub(z, c)
          y = MatMul(d, w)
        }""", {"w": rng.standard_normal((8, 8)).astype(np.float32), "c": np.array(3000.0, np.float32)})
    return m


def test_check_on_the_cpu_provider_sees_fp16_rounding_between_fp32_kernel_nodes():
    """onnxruntime's CPU provider runs FP16 Add/Sub with FP32 kernels and drops the casts between
    them, so nothing in between was rounded: --check passed at 4e-4 a model whose real FP16 error
    is 0.37. The check now runs an emulation that rounds every FP16 value where it is made."""
    m = _add_sub_model()
    out = rewrite(m).model
    assert all(n.op_type != "Cast" or n.input[0] in ("x", "y/amp_fp16") for n in out.graph.node)  # all FP16
    result = ck.check_models(m, out, runner=ck.Runner(["CPUExecutionProvider"]))
    assert not result.passed
    assert result.outputs[0].max_rel > 0.1
    assert any("rounded to fp16 where it is made" in n for n in result.notes)


def test_check_on_the_cpu_provider_sees_an_overflow_inside_an_if_branch():
    """An If branch multiplying by 3e4 in FP16 overflows on a GPU; the CPU provider computed it in
    FP32 and the check passed."""
    m = make_model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[2,8] x, bool c) => (float[2,8] y) {
          a = MatMul(x, w)
          r = If(c) <
            then_branch = t () => (float[2,8] tb) { big = Mul(a, k)  tm = MatMul(big, w)  tb = Mul(tm, s) },
            else_branch = e () => (float[2,8] eb) { eb = Identity(a) }
          >
          y = MatMul(r, w)
        }""", {"w": (np.random.default_rng(0).standard_normal((8, 8))).astype(np.float32),
               "k": np.array(3e4, np.float32), "s": np.array(1e-4, np.float32)})
    out = rewrite(m).model
    x = np.random.default_rng(1).standard_normal((2, 8)).astype(np.float32) * 2
    result = ck.check_models(m, out, inputs={"x": x, "c": np.array(True)}, runner=ck.Runner(["CPUExecutionProvider"]))
    assert not result.passed
    assert result.outputs[0].new_nonfinite > 0


def test_a_bf16_check_runs_on_the_cpu_provider(tmp_path):
    """onnxruntime's CPU provider has no bfloat16 MatMul: --target bf16 --check always ended in exit
    8 "cannot run". The emulation runs it, with bf16's rounding."""
    save(benign_model(), tmp_path / "m.onnx")
    proc = run_cli(["m.onnx", "-o", "o.onnx", "--target", "bf16", "--check"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "rounded to bf16 where it is made" in proc.stdout and "check passed" in proc.stdout
    assert onnx.load(str(tmp_path / "o.onnx")).graph.initializer[0].data_type == onnx.TensorProto.BFLOAT16


def test_emulate_low_rounds_like_numpy_float16_and_keeps_names():
    """Every FP16 value is rounded where it is made (a low graph input where it enters), FP16
    constants become their exact FP32 values, Cast(to=FLOAT) of a low value is an Identity; names
    stay, and the emulation is a valid FP32 model."""
    from onnx import TensorProto, helper, numpy_helper

    from amp_rewrite.emulate import emulate_low

    c = numpy_helper.from_array(np.array([3000.0, 0.1], np.float16), "c")
    nodes = [helper.make_node("Constant", [], ["k"], value=numpy_helper.from_array(np.array(1.5, np.float16))),
             helper.make_node("Add", ["x", "c"], ["z"]),
             helper.make_node("Mul", ["z", "k"], ["m"]),
             helper.make_node("Sub", ["m", "c"], ["d"]),
             helper.make_node("Cast", ["d"], ["y"], to=TensorProto.FLOAT)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2]),
                               helper.make_tensor_value_info("m", TensorProto.FLOAT16, [2])], [c])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    emulated, rounded = emulate_low(model)
    onnx.checker.check_model(emulated, full_check=True)
    assert rounded == {"x", "k", "z", "m", "d"}
    assert {v.name: v.type.tensor_type.elem_type for v in emulated.graph.output} == {"y": 1, "m": 1}
    x = np.array([1.3, 50000.0], np.float32)
    got = ck.Runner(["CPUExecutionProvider"]).run(emulated, {"x": x}, what="emulation")
    low_c = numpy_helper.to_array(c)
    with np.errstate(over="ignore"):  # numpy rounds each float16 operation's result to float16
        want_m = (x.astype(np.float16) + low_c) * np.float16(1.5)
        want_d = want_m - low_c
    np.testing.assert_array_equal(got["m"], want_m.astype(np.float32))
    np.testing.assert_array_equal(got["y"], want_d.astype(np.float32))
    assert np.isinf(got["m"][1])  # 50000 * 1.5 overflows FP16


# -- inputs ----------------------------------------------------------------------------------------------
def test_string_inputs_can_be_given_in_an_npz(tmp_path):
    """A STRING input asked for --inputs, but a str or bytes array was "<U1, the model wants object"
    (and an object array cannot be loaded without pickle): no string model could be checked."""
    m = make_model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[2,8] x, string[2] s) => (float[2,8] y, string[2] t) {
          y = MatMul(x, w)
          t = Identity(s)
        }""", {"w": (8, 8)})
    x = np.random.default_rng(0).standard_normal((2, 8)).astype(np.float32)
    for strings in (np.array(["a", "bc"]), np.array([b"a", b"bc"])):
        np.savez(tmp_path / "in.npz", x=x, s=strings)
        feeds, _ = ck.load_inputs(tmp_path / "in.npz", m)
        result = ck.check_models(m, rewrite(m).model, inputs=feeds, runner=ck.Runner(["CPUExecutionProvider"]))
        assert result.passed, result.table()
    np.savez(tmp_path / "in.npz", x=x, s=np.array([1, 2]))
    with pytest.raises(ck.UsageError, match="'s' is int64, the model wants strings"):
        ck.load_inputs(tmp_path / "in.npz", m)


def test_a_zero_dim_is_kept_and_values_beyond_the_input_type_are_refused(tmp_path):
    """A declared dim of 0 (an empty KV cache) was generated as 8, so the FP32 model refused the
    inputs; a float64 array beyond float32's range silently became inf (with numpy's warning on
    stderr)."""
    m = make_model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[1,0,8] past, float[1,4,8] x) => (float[1,4,8] y) {
          c = Concat<axis=1>(past, x)
          y = MatMul(c, w)
        }""", {"w": (8, 8)})
    feeds, _ = ck.make_inputs(m)
    assert feeds["past"].shape == (1, 0, 8)
    assert ck.check_models(m, rewrite(m).model, inputs=feeds, runner=ck.Runner(["CPUExecutionProvider"])).passed
    np.savez(tmp_path / "in.npz", past=np.zeros((1, 0, 8)), x=np.full((1, 4, 8), 1e39))
    with pytest.raises(ck.UsageError, match=r"'x' holds values beyond float32's range \(max \|x\| 1e\+39\)"):
        ck.load_inputs(tmp_path / "in.npz", m)


def _input_of_1e5() -> np.ndarray:
    x = np.random.default_rng(0).standard_normal((2, 16)).astype(np.float32)
    x[0, 0] = 1e5
    return x


def test_an_input_beyond_fp16_range_is_named_and_stderr_is_one_line(tmp_path):
    """--no-keep-io-types with an input value of 1e5: numpy's overflow warning reached stderr next to
    the error line, and the failure blamed the MatMul, not the input FP16 cannot hold (the error
    line named the MatMul as the first overflowing node and suggested --fp32-nodes on it, which
    cannot help). The input is named in the error line, and keeping the inputs FP32 is the hint."""
    save(benign_model(), tmp_path / "m.onnx")
    np.savez(tmp_path / "in.npz", x=_input_of_1e5())
    proc = run_cli(["m.onnx", "-o", "o.onnx", "--check", "--no-keep-io-types", "--inputs", "in.npz"], tmp_path)
    assert proc.returncode == 8
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "input 'x' holds values beyond fp16's range (max |x| 1e+05)" in proc.stdout
    assert "input 'x' holds values beyond fp16's range" in proc.stderr and "--keep-io-types" in proc.stderr
    assert "first overflowing node" not in proc.stderr and "--fp32-nodes" not in proc.stderr


def test_auto_fp32_stops_at_an_input_beyond_range():
    """It pinned node after node until nothing was low (and the rewrite kept the FP32 model): no
    pin makes an input's ±inf finite, so it stops at once and says why."""
    auto = ck.auto_fp32(benign_model(), inputs={"x": _input_of_1e5()}, keep_io_types=False,
                        runner=ck.Runner(["CPUExecutionProvider"]))
    assert not auto.check.passed and not auto.pinned and auto.candidates == 1
    assert any("no pin helps" in n for n in auto.check.notes)


def test_onnxruntime_messages_keep_their_detail_on_one_line():
    text = "[ONNXRuntimeError] : 2 : INVALID_ARGUMENT : Got invalid dimensions for input: past\n index: 1 Got: 8 Expected: 0\n"
    line = ck._one_line(text)
    assert "\n" not in line and "index: 1 Got: 8 Expected: 0" in line


def test_auto_fp32_bisects_into_if_branches():
    """The bisection looked only at main-graph nodes: an accuracy loss in an If branch (a MatMul
    by a table of ~1000s after a centring one) pinned nothing and said the "budget" ran out, though
    --fp32-nodes on the branch's MatMul passes."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w = numpy_helper.from_array((rng.standard_normal((8, 8)) / np.sqrt(8)).astype(np.float32), "W")
    p = numpy_helper.from_array((np.eye(8) - np.ones((8, 8)) / 8).astype(np.float32), "P")
    b = numpy_helper.from_array((1000 * np.ones((8, 8)) + rng.standard_normal((8, 8))).astype(np.float32), "B")
    then = helper.make_graph([helper.make_node("MatMul", ["a", "P"], ["p"], name="t_mmP"),
                              helper.make_node("MatMul", ["p", "B"], ["t_out"], name="t_mmB")], "then", [],
                             [helper.make_tensor_value_info("t_out", TensorProto.FLOAT, [2, 8])])
    other = helper.make_graph([helper.make_node("Identity", ["a"], ["e_out"], name="e_id")], "else", [],
                              [helper.make_tensor_value_info("e_out", TensorProto.FLOAT, [2, 8])])
    nodes = [helper.make_node("MatMul", ["x", "W"], ["a"], name="mm1"),
             helper.make_node("If", ["cond"], ["r"], name="if", then_branch=then, else_branch=other),
             helper.make_node("MatMul", ["r", "W"], ["y"], name="mm3")]
    graph = helper.make_graph(nodes, "ifacc", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8]),
                                               helper.make_tensor_value_info("cond", TensorProto.BOOL, [])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])], [w, p, b])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    feeds = {"x": rng.standard_normal((2, 8)).astype(np.float32), "cond": np.array(True)}
    runner = ck.Runner(["CPUExecutionProvider"])
    auto = ck.auto_fp32(m, inputs=feeds, runner=runner)
    assert auto.check.passed, auto.check.table()
    assert {"t_mmP", "t_mmB"} & {p["node"] for p in auto.pinned}



def test_emulation_widens_dtype_attributes_and_rounds_a_passed_through_input():
    """EyeLike(dtype=FLOAT16) kept its FP16 output in the FP32 emulation (NOT_IMPLEMENTED on the CPU:
    the check fell back to the unrounded model); an FP16 input also returned as an output was not
    rounded for its readers (70000 * 0.5 came out 35000, FP16 gives inf)."""
    from onnx import TensorProto, helper, numpy_helper

    from amp_rewrite.emulate import emulate_low

    nodes = [helper.make_node("EyeLike", ["xh"], ["e"], dtype=TensorProto.FLOAT16),
             helper.make_node("Mul", ["xh", "half"], ["m"]), helper.make_node("Add", ["m", "e"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("xh", TensorProto.FLOAT16, [2, 2])],
                              [helper.make_tensor_value_info("xh", TensorProto.FLOAT16, [2, 2]),
                               helper.make_tensor_value_info("y", TensorProto.FLOAT16, [2, 2])],
                              [numpy_helper.from_array(np.array(0.5, np.float16), "half")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    emulated, _ = emulate_low(model)
    onnx.checker.check_model(emulated, full_check=True)
    x = np.array([[1.0, 70000.0], [3.0, 4.0]], np.float32)
    got = ck.Runner(["CPUExecutionProvider"]).run(emulated, {"xh": x}, what="emulation")
    with np.errstate(over="ignore"):
        want = x.astype(np.float16) * np.float16(0.5) + np.eye(2, dtype=np.float16)
    np.testing.assert_array_equal(got["y"], want.astype(np.float32))


def test_emulation_rounds_a_low_input_that_a_branch_reads_from_the_outer_scope():
    """An FP16 graph input read inside an If branch (an outer-scope value) is read rounded there too:
    70000 * 0.5 is inf in FP16, as a GPU computes it, not 35000."""
    from onnx import TensorProto, helper, numpy_helper

    from amp_rewrite.emulate import emulate_low

    vi = helper.make_tensor_value_info
    then_g = helper.make_graph([helper.make_node("Mul", ["xh", "half"], ["tb"])], "then", [],
                               [vi("tb", TensorProto.FLOAT16, [2])])
    else_g = helper.make_graph([helper.make_node("Identity", ["xh"], ["eb"])], "else", [],
                               [vi("eb", TensorProto.FLOAT16, [2])])
    graph = helper.make_graph([helper.make_node("If", ["c"], ["y"], then_branch=then_g, else_branch=else_g)], "g",
                              [vi("xh", TensorProto.FLOAT16, [2]), vi("c", TensorProto.BOOL, [])],
                              [vi("y", TensorProto.FLOAT16, [2])],
                              [numpy_helper.from_array(np.array(0.5, np.float16), "half")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    emulated, _ = emulate_low(model)
    onnx.checker.check_model(emulated, full_check=True)
    x = np.array([1.0, 70000.0], np.float32)
    got = ck.Runner(["CPUExecutionProvider"]).run(emulated, {"xh": x, "c": np.array(True)}, what="emulation")
    np.testing.assert_array_equal(got["y"], [0.5, np.inf])


def test_emulation_rounds_every_low_output_of_a_multi_output_node():
    """An FP16 LSTM's last hidden state Y_h is rounded where it is made, as its sequence output Y is:
    it equals Y's last step exactly and is in the names returned as held low."""
    from onnx import TensorProto, helper, numpy_helper

    from amp_rewrite.emulate import emulate_low

    vi = helper.make_tensor_value_info
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((1, 8, 3)).astype(np.float16), "W"),
             numpy_helper.from_array(rng.standard_normal((1, 8, 2)).astype(np.float16), "R")]
    graph = helper.make_graph([helper.make_node("LSTM", ["x", "W", "R"], ["y", "yh"], hidden_size=2)], "g",
                              [vi("x", TensorProto.FLOAT16, [3, 1, 3])],
                              [vi("y", TensorProto.FLOAT16, [3, 1, 1, 2]), vi("yh", TensorProto.FLOAT16, [1, 1, 2])],
                              inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    emulated, rounded = emulate_low(model)
    onnx.checker.check_model(emulated, full_check=True)
    assert rounded == {"x", "y", "yh"}
    got = ck.Runner(["CPUExecutionProvider"]).run(emulated, {"x": rng.standard_normal((3, 1, 3)).astype(np.float32)},
                                                  what="emulation")
    np.testing.assert_array_equal(got["yh"], got["y"][-1])
    np.testing.assert_array_equal(got["yh"], got["yh"].astype(np.float16).astype(np.float32))


def test_emulation_widens_a_declared_sequence_of_low_tensors():
    """A value_info declaring a sequence of FP16 tensors becomes a sequence of FP32 ones, as its
    elements are: the emulation stays a valid model and keeps the elements' FP16 rounding."""
    from onnx import TensorProto, helper, numpy_helper

    from amp_rewrite.emulate import emulate_low

    vi = helper.make_tensor_value_info
    nodes = [helper.make_node("Mul", ["x", "two"], ["m"]), helper.make_node("SequenceConstruct", ["m", "x"], ["sq"]),
             helper.make_node("ConcatFromSequence", ["sq"], ["y"], axis=0)]
    graph = helper.make_graph(nodes, "g", [vi("x", TensorProto.FLOAT16, [2])], [vi("y", TensorProto.FLOAT16, [4])],
                              [numpy_helper.from_array(np.array(2, np.float16), "two")],
                              value_info=[helper.make_tensor_sequence_value_info("sq", TensorProto.FLOAT16, [2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    emulated, _ = emulate_low(model)
    onnx.checker.check_model(emulated, full_check=True)
    assert emulated.graph.value_info[0].type.sequence_type.elem_type.tensor_type.elem_type == TensorProto.FLOAT
    got = ck.Runner(["CPUExecutionProvider"]).run(emulated, {"x": np.array([1.0, 40000.0], np.float32)},
                                                  what="emulation")
    np.testing.assert_array_equal(got["y"], [2.0, np.inf, 1.0, 40000.0])


def test_an_input_model_with_fp16_or_bf16_of_its_own_is_checked_as_a_gpu_runs_it():
    """The reference ran raw on the CPU provider, which skips FP16 rounding: a model with nothing
    to rewrite whose own FP16 chain overflows "failed" against itself and blamed the wrong node.
    A BF16 input was rounded to FP16 (the target) and a BF16 output crashed the run
    ("'numpy.ndarray' object has no attribute '_get_c_value'")."""
    from onnx import TensorProto, helper, numpy_helper

    def model(nodes, inputs, outputs, inits):
        g = helper.make_graph(nodes, "g", inputs, outputs, inits)
        return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)

    vi = helper.make_tensor_value_info
    runner = ck.Runner(["CPUExecutionProvider"])
    own_fp16 = model([helper.make_node("Cast", ["x"], ["h"], to=TensorProto.FLOAT16),
                      helper.make_node("Mul", ["h", "big"], ["m"]), helper.make_node("Mul", ["m", "small"], ["n"]),
                      helper.make_node("Cast", ["n"], ["o"], to=TensorProto.FLOAT)],
                     [vi("x", TensorProto.FLOAT, [2, 8])], [vi("o", TensorProto.FLOAT, [2, 8])],
                     [numpy_helper.from_array(np.array(60000, np.float16), "big"),
                      numpy_helper.from_array(np.array(1 / 60000, np.float16), "small")])
    result = ck.check_models(own_fp16, rewrite(own_fp16).model, runner=runner)
    assert result.passed and result.outputs[0].max_rel == 0, result.table()

    bf16_in = model([helper.make_node("Cast", ["x"], ["f"], to=TensorProto.FLOAT), helper.make_node("Relu", ["f"], ["o"])],
                    [vi("x", TensorProto.BFLOAT16, [2, 8])], [vi("o", TensorProto.FLOAT, [2, 8])], [])
    feeds = {"x": np.full((2, 8), 1e5, np.float32)}
    result = ck.check_models(bf16_in, rewrite(bf16_in).model, inputs=feeds, runner=runner)
    assert result.passed and not [n for n in result.notes if "beyond" in n], result.table()

    bf16_out = model([helper.make_node("MatMul", ["x", "w"], ["y"]),
                      helper.make_node("Cast", ["y"], ["o"], to=TensorProto.BFLOAT16)],
                     [vi("x", TensorProto.FLOAT, [2, 8])], [vi("o", TensorProto.BFLOAT16, [2, 8])],
                     [numpy_helper.from_array(np.eye(8, dtype=np.float32), "w")])
    assert ck.check_models(bf16_out, rewrite(bf16_out).model, runner=runner).passed


def _sequence_output_model() -> onnx.ModelProto:
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["a"]), helper.make_node("SplitToSequence", ["a"], ["y"], axis=0)],
        "seq_out", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 2])],
        [helper.make_tensor_sequence_value_info("y", TensorProto.FLOAT, None)],
        [onnx.numpy_helper.from_array(np.array([[1.0], [-1.0]], np.float32), "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.mark.parametrize("cancels", [True, False], ids=["far-off", "close"])
def test_check_compares_a_sequence_output_element_by_element(tmp_path, cancels):
    """A sequence output was skipped without a word: x @ w with x = [1000.3, 1000.0], w = [1, -1]
    is 0.3 in FP32 and 0.5 in FP16 (67% off), and --check printed an empty table and 'check
    passed'. Each element is compared now (y[0], y[1]) and the far-off one fails the check."""
    save(_sequence_output_model(), tmp_path / "m.onnx")
    x = np.array([[1000.3, 1000.0], [0.5, 0.25]] if cancels else [[0.5, 0.25], [1.5, -0.75]], np.float32)
    np.savez(tmp_path / "in.npz", x=x)
    proc = run_cli(["m.onnx", "--check", "--inputs", "in.npz", "--report", "r.json"], tmp_path)
    report = json.loads((tmp_path / "r.json").read_text())
    assert [o["output"] for o in report["check"]["outputs"]] == ["y[0]", "y[1]"]
    if cancels:
        assert proc.returncode == 8, proc.stderr
        assert "output 'y[0]'" in proc.stderr and report["check"]["passed"] is False
    else:
        assert proc.returncode == 0, proc.stderr
        assert report["check"]["passed"] is True


# -- sequence and optional inputs ------------------------------------------------------------------------
def _sequence_input_model(**info) -> onnx.ModelProto:
    """y = s[1] @ eye(4), s a seq(tensor(float)) graph input (``info``: its element type's shape)."""
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("SequenceAt", ["s", "i"], ["e"]), helper.make_node("MatMul", ["e", "w"], ["y"])], "seq_in",
        [helper.make_tensor_sequence_value_info("s", TensorProto.FLOAT, info.get("shape", [3, 4]))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 4])],
        [onnx.numpy_helper.from_array(np.eye(4, dtype=np.float32), "w"),
         onnx.numpy_helper.from_array(np.array(1, np.int64), "i")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_check_generates_a_sequence_input(tmp_path):
    """--check on a model with a seq(tensor) input said "input 's' is not a tensor: --check cannot
    make a value for it; pass --inputs", and no .npz could hold a sequence. It now generates one:
    two tensors of the element type and shape, by the rules for tensors."""
    feeds, described = ck.make_inputs(_sequence_input_model())
    assert isinstance(feeds["s"], list) and [a.shape for a in feeds["s"]] == [(3, 4), (3, 4)]
    assert all(a.dtype == np.float32 for a in feeds["s"]) and not np.array_equal(*feeds["s"])
    assert described == [{"name": "s", "dtype": "float32", "shape": [3, 4],
                          "values": "a sequence of 2 tensors, each N(0, 1)"}]
    save(_sequence_input_model(), tmp_path / "m.onnx")
    proc = run_cli(["m.onnx", "-o", "o.onnx", "--check"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "input s: float32[3, 4] a sequence of 2 tensors, each N(0, 1)" in proc.stdout
    assert "check passed" in proc.stdout


@pytest.mark.parametrize("layout", ["keyed", "stacked"])
def test_an_npz_gives_a_sequence_input_by_index_or_stacked(tmp_path, layout):
    """The model reads s[1]: 7e4 there overflows FP16 at the MatMul's cast (exit 8, named), 7e4 in
    s[0] does not; so the file's tensors reach the model, in the order of their keys."""
    save(_sequence_input_model(), tmp_path / "m.onnx")
    ones, big = np.ones((3, 4), np.float32), np.full((3, 4), 7e4, np.float32)
    for first, second, code in ((big, ones, 0), (ones, big, 8)):
        arrays = {"s/1": second, "s/0": first} if layout == "keyed" else {"s": np.stack([first, second])}
        np.savez(tmp_path / "in.npz", **arrays)
        proc = run_cli(["m.onnx", "-o", "o.onnx", "--overwrite", "--check", "--inputs", "in.npz"], tmp_path)
        assert proc.returncode == code, proc.stderr
        assert "input s: float32[3, 4] a sequence of 2 tensors from in.npz" in proc.stdout
        if code:
            assert "(inserted Cast to fp16 feeding MatMul:y)" in proc.stderr
    feeds, _ = ck.load_inputs(tmp_path / "in.npz", _sequence_input_model())
    assert [float(a[0, 0]) for a in feeds["s"]] == [1.0, 7e4]


def test_a_check_the_cpu_provider_has_no_kernel_for_says_so(tmp_path):
    """GroupNorm (com.microsoft) has no CPU kernel: the check said "pass real inputs with --inputs"
    (and with them "check the arrays in --inputs"), which no input can fix."""
    from onnx import helper as oh

    c = 8
    nodes = [oh.make_node("MatMul", ["x", "w"], ["a"], name="mm"),
             oh.make_node("GroupNorm", ["a", "gamma", "beta"], ["y"], domain="com.microsoft", groups=2,
                          activation=0, epsilon=1e-5, channels_last=1, name="gnorm")]
    rng = np.random.default_rng(0)
    graph = oh.make_graph(nodes, "g", [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 4, 4, c])],
                          [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 4, 4, c])],
                          [onnx.numpy_helper.from_array(rng.standard_normal((c, c)).astype(np.float32), "w"),
                           onnx.numpy_helper.from_array(np.ones(c, np.float32), "gamma"),
                           onnx.numpy_helper.from_array(np.zeros(c, np.float32), "beta")])
    save(onnx.helper.make_model(graph, opset_imports=[oh.make_opsetid("", 17), oh.make_opsetid("com.microsoft", 1)],
                                ir_version=9), tmp_path / "m.onnx")
    proc = run_cli(["m.onnx", "-o", "o.onnx", "--check"], tmp_path)
    assert proc.returncode == 2
    err = proc.stderr.strip()
    assert "has no kernel for an op of the FP32 model" in err and "GroupNorm" in err and "--inputs" not in err
    assert not (tmp_path / "o.onnx").exists()


def test_a_check_of_a_model_onnxruntime_cannot_load_does_not_blame_the_inputs(tmp_path):
    """A model of an IR version newer than onnxruntime reads (onnx.helper.make_model's default)
    rewrites, keeping its IR version; --check says onnxruntime cannot load it and how to save it,
    with or without --inputs, and writes nothing."""
    import onnxruntime as ort
    from onnx import helper as oh

    graph = oh.make_graph([oh.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "g",
                          [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 8])],
                          [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 8])],
                          [onnx.numpy_helper.from_array(np.full((8, 8), 0.1, np.float32), "w")])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)], ir_version=onnx.IR_VERSION)
    try:
        ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        pytest.skip(f"this onnxruntime reads IR version {onnx.IR_VERSION}")
    except Exception as exc:  # noqa: BLE001
        assert "IR version" in str(exc)
    save(model, tmp_path / "m.onnx")
    np.savez(tmp_path / "in.npz", x=np.ones((2, 8), np.float32))
    for extra in ([], ["--inputs", "in.npz"]):
        proc = run_cli(["m.onnx", "-o", "o.onnx", "--check", *extra], tmp_path)
        err = proc.stderr.strip()
        assert proc.returncode == 2 and "\n" not in err, err
        assert f"model is IR version {onnx.IR_VERSION}, so --check cannot run it" in err
        assert "--inputs" not in err and "ir_version" in err
        assert not (tmp_path / "o.onnx").exists()
    assert run_cli(["m.onnx", "-o", "o.onnx"], tmp_path).returncode == 0
    assert onnx.load(tmp_path / "o.onnx").ir_version == onnx.IR_VERSION


def test_a_check_of_an_opset_onnxruntime_does_not_read_says_it_cannot_load_the_model(tmp_path):
    """A model stamped with onnx's newest opset, which this onnxruntime does not read yet: --check
    says onnxruntime cannot load it (its reason, without its C++ source location), not that the
    inputs are wrong."""
    import onnxruntime as ort
    from onnx import helper as oh

    graph = oh.make_graph([oh.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "g",
                          [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 8])],
                          [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 8])],
                          [onnx.numpy_helper.from_array(np.full((8, 8), 0.1, np.float32), "w")])
    newest = onnx.defs.onnx_opset_version()
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", newest)], ir_version=10)
    try:
        ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        pytest.skip(f"this onnxruntime reads opset {newest}")
    except Exception as exc:  # noqa: BLE001
        assert f"Opset {newest}" in str(exc)
    save(model, tmp_path / "m.onnx")
    proc = run_cli(["m.onnx", "-o", "o.onnx", "--check"], tmp_path)
    err = proc.stderr.strip()
    assert proc.returncode == 2 and "\n" not in err, err
    assert f"onnxruntime {ort.__version__} reads ai.onnx opsets up to " in err
    assert f"the model imports opset {newest}, so --check cannot run it" in err
    assert "--inputs" not in err and "leave out --check" in err
    assert not (tmp_path / "o.onnx").exists()


def test_a_check_of_a_model_with_an_op_onnxruntime_does_not_know_says_it_cannot_load_it(tmp_path):
    """An op onnxruntime has no schema for in a domain it knows: --check gives its reason for
    refusing the model, without its C++ source location, and does not blame the inputs."""
    import onnxruntime as ort
    from onnx import helper as oh

    graph = oh.make_graph([oh.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
                           oh.make_node("NoSuchOp", ["h"], ["y"], name="nso", domain="com.microsoft")], "g",
                          [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 8])],
                          [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 8])],
                          [onnx.numpy_helper.from_array(np.full((8, 8), 0.1, np.float32), "w")])
    save(oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17), oh.make_opsetid("com.microsoft", 1)],
                       ir_version=9), tmp_path / "m.onnx")
    proc = run_cli(["m.onnx", "-o", "o.onnx", "--check"], tmp_path)
    err = proc.stderr.strip()
    assert proc.returncode == 2 and "\n" not in err, err
    assert f"onnxruntime {ort.__version__} cannot load the FP32 model" in err and "NoSuchOp" in err
    assert "--inputs" not in err and "onnxruntime_src" not in err and "leave out --check" in err
    assert not (tmp_path / "o.onnx").exists()


def test_an_overflow_at_the_models_own_cast_does_not_call_it_inserted(tmp_path):
    """An int64 input cast to FLOAT for a MatMul: the model's Cast is retargeted to FP16, and 1e5
    becomes inf there. The check called it an "inserted Cast", which the report lists none of."""
    model = make_model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (int64[2,8] ids) => (float[2,8] y) {
          f = Cast<to=1>(ids)
          y = MatMul(f, w)
        }""", {"w": (8, 8)})
    save(model, tmp_path / "m.onnx")
    np.savez(tmp_path / "in.npz", ids=np.full((2, 8), 100000, np.int64))
    proc = run_cli(["m.onnx", "-o", "o.onnx", "--check", "--inputs", "in.npz"], tmp_path)
    assert proc.returncode == 8, proc.stderr
    assert "Cast:f (Cast) (the model's own Cast, to fp16 feeding MatMul:y)" in proc.stdout
    assert "inserted Cast" not in proc.stdout + proc.stderr


@pytest.mark.parametrize("arrays, needle", [
    ({"s/0": np.ones((3, 4)), "s/2": np.ones((3, 4))}, "sequence input 's' has 's/2' but no 's/1'"),
    ({"s": np.ones((2, 3, 4)), "s/0": np.ones((3, 4))}, "sequence input 's' is given both as one array and as 's/0'"),
    ({"s/0": np.ones((3, 5))}, "'s/0' has shape [3, 5], the model wants [3, 4]"),
    ({"s": np.ones((3, 4))}, "'s' (tensor 0 of the sequence stacked on axis 0) has shape [4], the model wants [3, 4]"),
    ({"s/0": np.ones((3, 4), np.int64)}, "'s/0' is int64, the model wants float32"),
    ({"s/01": np.ones((3, 4))}, "'s/01': a sequence input's tensors are keyed 's/0', 's/1', ... (no leading zeros)"),
    ({}, "no array for input 's' (a sequence input takes 's/0', 's/1', ... or one array stacking its tensors"),
])
def test_a_bad_sequence_in_an_npz_is_one_usage_error_line(tmp_path, arrays, needle):
    save(_sequence_input_model(), tmp_path / "m.onnx")
    np.savez(tmp_path / "in.npz", **arrays)
    proc = run_cli(["m.onnx", "-o", "o.onnx", "--check", "--inputs", "in.npz"], tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert needle in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / "o.onnx").exists()


def test_an_optional_input_is_generated_given_or_left_empty(tmp_path):
    """optional(tensor) was "not a tensor" to --check too. It is generated present; in an .npz its
    array is the value, and no array feeds it empty (the model's else branch: zeros)."""
    from onnx import TensorProto, helper

    vi = helper.make_value_info("o", helper.make_optional_type_proto(helper.make_tensor_type_proto(TensorProto.FLOAT,
                                                                                                   [2, 4])))
    got = helper.make_graph([helper.make_node("OptionalGetElement", ["o"], ["t"])], "got", [],
                            [helper.make_tensor_value_info("t", TensorProto.FLOAT, [2, 4])])
    zeros = helper.make_graph([helper.make_node("Constant", [], ["z"], value=onnx.numpy_helper.from_array(
        np.zeros((2, 4), np.float32)))], "zeros", [], [helper.make_tensor_value_info("z", TensorProto.FLOAT, [2, 4])])
    graph = helper.make_graph(
        [helper.make_node("OptionalHasElement", ["o"], ["h"]),
         helper.make_node("If", ["h"], ["e"], then_branch=got, else_branch=zeros),
         helper.make_node("MatMul", ["e", "w"], ["y"])], "opt_in", [vi],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
        [onnx.numpy_helper.from_array(np.eye(4, dtype=np.float32), "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)
    save(model, tmp_path / "m.onnx")
    feeds, _ = ck.make_inputs(model)
    assert feeds["o"].shape == (2, 4)
    proc = run_cli(["m.onnx", "-o", "o.onnx", "--check"], tmp_path)
    assert proc.returncode == 0 and "input o: float32[2, 4] N(0, 1)" in proc.stdout, proc.stderr
    np.savez(tmp_path / "none.npz")
    proc = run_cli(["m.onnx", "-o", "o.onnx", "--overwrite", "--check", "--inputs", "none.npz", "--report", "r.json"],
                   tmp_path)
    assert proc.returncode == 0 and "input o: empty (optional, no array in none.npz)" in proc.stdout, proc.stderr
    assert "o" not in ck.load_inputs(tmp_path / "none.npz", model)[0]
    assert json.loads((tmp_path / "r.json").read_text())["check"]["outputs"][0]["max_abs"] == 0  # (zeros: else)
    np.savez(tmp_path / "given.npz", o=np.full((2, 4), 7e4, np.float32))  # (present: FP16's range shows)
    proc = run_cli(["m.onnx", "-o", "o.onnx", "--overwrite", "--check", "--inputs", "given.npz"], tmp_path)
    assert proc.returncode == 8 and "input o: float32[2, 4] from given.npz" in proc.stdout, proc.stderr


def test_an_input_check_cannot_feed_is_named_with_its_type(tmp_path):
    """A sequence of sequences (or a map) cannot come from an .npz nor be generated: one line that
    says which types --check feeds, not advice to pass --inputs."""
    from onnx import TensorProto, helper

    nested = helper.make_value_info("ss", helper.make_sequence_type_proto(helper.make_sequence_type_proto(
        helper.make_tensor_type_proto(TensorProto.FLOAT, [2, 4]))))
    graph = helper.make_graph(
        [helper.make_node("SequenceAt", ["ss", "i"], ["s"]), helper.make_node("SequenceAt", ["s", "i"], ["e"]),
         helper.make_node("MatMul", ["e", "w"], ["y"])], "nested", [nested],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
        [onnx.numpy_helper.from_array(np.eye(4, dtype=np.float32), "w"),
         onnx.numpy_helper.from_array(np.array(0, np.int64), "i")])
    save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), tmp_path / "m.onnx")
    proc = run_cli(["m.onnx", "-o", "o.onnx", "--check"], tmp_path)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert ("input 'ss' is seq(seq(tensor(float))): --check feeds tensors, sequences of tensors and optionals of "
            "either (generated, or from --inputs), not this type") in proc.stderr
    assert "pass --inputs" not in proc.stderr and not (tmp_path / "o.onnx").exists()
    mapped = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "map", [
        helper.make_value_info("m", helper.make_map_type_proto(TensorProto.INT64, helper.make_tensor_type_proto(
            TensorProto.FLOAT, []))), helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    with pytest.raises(ck.UsageError, match=r"input 'm' is map\(int64,tensor\(float\)\): --check feeds"):
        ck.make_inputs(helper.make_model(mapped, opset_imports=[helper.make_opsetid("", 17)], ir_version=8))


def test_check_models_takes_a_sequence_input_as_a_list():
    """The Python API's ``inputs``: a sequence input's value is a list of arrays."""
    model = _sequence_input_model()
    runner = ck.Runner(["CPUExecutionProvider"])
    tensors = [np.ones((3, 4), np.float32), np.full((3, 4), 7e4, np.float32)]
    result = ck.check_models(model, rewrite(model).model, inputs={"s": tensors}, runner=runner)
    assert not result.passed and result.inputs[0]["values"] == "a sequence of 2 tensors, given"
    assert ck.check_models(model, rewrite(model).model, inputs={"s": tensors[::-1]}, runner=runner).passed


def test_a_sequence_input_beside_a_bf16_output_is_refused_in_words():
    """onnxruntime's Python API reads a bfloat16 output only through OrtValue inputs, and no
    OrtValue holds a sequence: the run says so instead of failing inside onnxruntime's binding."""
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("SequenceAt", ["s", "i"], ["e"]),
         helper.make_node("Cast", ["e"], ["y"], to=TensorProto.BFLOAT16)],
        "seq_bf16", [helper.make_tensor_sequence_value_info("s", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.BFLOAT16, [2])],
        [onnx.numpy_helper.from_array(np.array(0, np.int64), "i")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    with pytest.raises(RuntimeError, match="OrtValue inputs, which cannot hold a sequence"):
        ck.Runner(["CPUExecutionProvider"]).run(model, {"s": [np.ones(2, np.float32)]}, what="running it")


def _if_reading_an_overflow(inside: bool) -> onnx.ModelProto:
    """``inside``: the then-branch overflows itself (a Mul by 3e4 feeding a MatMul); otherwise the
    main graph's MatMul by 3e4 overflows and the branch reads its (scaled) result from outside."""
    branch = "big = Mul(a, k)  tm = MatMul(big, w)  tb = Mul(tm, s)" if inside else "tb = MatMul(a, w)"
    main = "a = MatMul(x, w)" if inside else "m = MatMul(x, wk)  a = Mul(m, s)"
    rng = np.random.default_rng(0)
    w = rng.standard_normal((8, 8)).astype(np.float32)
    return make_model(f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[2,8] x, bool c) => (float[2,8] y) {{
          {main}
          r = If(c) <
            then_branch = t () => (float[2,8] tb) {{ {branch} }},
            else_branch = e () => (float[2,8] eb) {{ eb = Identity(a) }}
          >
          y = MatMul(r, w)
        }}""", {"w": w, "wk": w * 3e4, "k": np.array(3e4, np.float32), "s": np.array(1e-4, np.float32)})


def _if_feeds() -> dict:
    return {"x": np.random.default_rng(1).standard_normal((2, 8)).astype(np.float32) * 2, "c": np.array(True)}


def test_an_if_reading_an_overflowed_outer_value_is_no_second_root():
    """The If reads the main graph's overflowed value inside its branch, which no edge of the main
    graph shows: it was called a second root ('also: if (If)'), and --auto-fp32 pinned it for nothing."""
    m = _if_reading_an_overflow(inside=False)
    runner = ck.Runner(["CPUExecutionProvider"])
    result = ck.check_models(m, rewrite(m).model, inputs=_if_feeds(), runner=runner)
    assert not result.passed
    assert [o.node for o in result.roots] == ["MatMul:m"]
    auto = ck.auto_fp32(m, inputs=_if_feeds(), runner=runner)
    assert auto.check.passed and [p["node"] for p in auto.pinned] == ["MatMul:m"]


def test_an_overflow_inside_an_if_branch_says_so_and_suggests_no_useless_pin(tmp_path):
    """The If was named with --fp32-nodes 'if' as the fix, which changes nothing (the overflow is in
    its branch); --auto-fp32 pinned it first. The root now says the value was made inside its body,
    the hint pins the body's nodes, and --auto-fp32 goes straight to the body."""
    m = _if_reading_an_overflow(inside=True)
    save(m, tmp_path / "m.onnx")
    np.savez(tmp_path / "in.npz", **_if_feeds())
    proc = run_cli(["m.onnx", "-o", "o.onnx", "--check", "--inputs", "in.npz"], tmp_path)
    assert proc.returncode == 8
    root = "If:r"
    assert f"first overflowing node: {root} (If)" in proc.stderr and "made inside its body" in proc.stderr
    assert f"--fp32-nodes '{root}'" not in proc.stderr
    fixed = run_cli(["m.onnx", "-o", "o.onnx", "--overwrite", "--check", "--inputs", "in.npz",
                     "--fp32-nodes", f"{root}.*"], tmp_path)
    assert fixed.returncode == 0, fixed.stderr
    auto = ck.auto_fp32(m, inputs=_if_feeds(), runner=ck.Runner(["CPUExecutionProvider"]))
    assert auto.check.passed and root not in {p["node"] for p in auto.pinned}


def _loop_overflowing_inside(op: str) -> onnx.ModelProto:
    """A Loop or Scan whose body overflows (a Mul by 3e4 feeding a MatMul) and scales back down:
    the holder's output is FP32 (its body casts back), and so is the Mul after it."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((8, 8)).astype(np.float32)
    inner = "big = Mul(c, k)  tm = MatMul(big, w)  cn = Mul(tm, s)"
    holder = (f"""r = Loop(n, , a) < body = b (int64 i, bool ci, float[2,8] c) => (bool co, float[2,8] cn) {{
                   {inner}  co = Identity(ci) }} >""" if op == "Loop" else
              f"""r, ys = Scan(a, xs) < num_scan_inputs = 1,
                   body = b (float[2,8] c, float[8] xi) => (float[2,8] cn, float[8] yo) {{
                   {inner}  yo = Identity(xi) }} >""")
    return make_model(f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[2,8] x) => (float[2,8] y) {{
          a = MatMul(x, w)
          {holder}
          u = Mul(r, s)
          y = MatMul(u, w)
        }}""", {"w": w, "n": np.array(1, np.int64), "xs": np.ones((1, 8), np.float32),
                "k": np.array(3e4, np.float32), "s": np.array(1e-4, np.float32)})


@pytest.mark.parametrize("op", ["Loop", "Scan"])
def test_an_overflow_inside_a_loop_body_is_blamed_on_the_loop(op, tmp_path):
    """A Loop's or Scan's outputs are FP32 where its body casts back, and body values are not
    exposed: the overflow first showed at the inserted Cast after the scaling Mul (0.16 in FP32),
    which was named as the overflowing node, and no root was found. The holder is the root now,
    made inside its body, and the hint that pins the body's nodes makes the check pass."""
    m = _loop_overflowing_inside(op)
    runner = ck.Runner(["CPUExecutionProvider"])
    result = ck.check_models(m, rewrite(m).model, inputs={"x": _if_feeds()["x"]}, runner=runner)
    assert not result.passed
    root = f"{op}:r"
    assert [(o.node, o.in_body) for o in result.roots] == [(root, True)]
    save(m, tmp_path / "m.onnx")
    np.savez(tmp_path / "in.npz", x=_if_feeds()["x"])
    fixed = run_cli(["m.onnx", "-o", "o.onnx", "--check", "--inputs", "in.npz", "--fp32-nodes", f"{root}.*"],
                    tmp_path)
    assert fixed.returncode == 0, fixed.stderr
    auto = ck.auto_fp32(m, inputs={"x": _if_feeds()["x"]}, runner=runner)
    assert auto.check.passed and root not in {p["node"] for p in auto.pinned}


# -- the output is checked before it takes its place -------------------------------------------------------------
@pytest.mark.parametrize("flag", ["--check", "--auto-fp32"])
def test_the_model_is_checked_before_it_replaces_the_previous_output(tmp_path, monkeypatch, flag):
    """--check --overwrite put the new model at -o and then ran the check: a kill -9 during the
    check (an OOM kill while onnxruntime runs a large model) left the unchecked model there and the
    previous output under a hidden name. The model is now written and checked beside -o, and
    moved into place once it passed."""
    from amp_rewrite.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("AMP_REWRITE_NO_PROGRESS", "1")
    save(benign_model(), tmp_path / "m.onnx")
    (tmp_path / "o.onnx").write_bytes(b"the previous output")
    seen = []
    real = ck.check_models

    def watching(src, low, **kwargs):
        if isinstance(low, (str, os.PathLike)):  # (--auto-fp32 checks its candidates in memory first)
            seen.append((Path(low).resolve() != (tmp_path / "o.onnx").resolve(), (tmp_path / "o.onnx").read_bytes()))
        return real(src, low, **kwargs)

    monkeypatch.setattr(ck, "check_models", watching)
    assert main(["m.onnx", "-o", "o.onnx", flag, "--overwrite", "-q"]) == 0
    assert seen and all(elsewhere and held == b"the previous output" for elsewhere, held in seen)
    full_check(onnx.load(str(tmp_path / "o.onnx")))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx", "o.onnx"]  # (no stage left)


def test_a_failed_check_leaves_the_previous_output_and_no_stage(tmp_path):
    save(overflow_model(), tmp_path / "m.onnx")
    (tmp_path / "o.onnx").write_bytes(b"the previous output")
    proc = run_cli(["m.onnx", "-o", "o.onnx", "--check", "--overwrite"], tmp_path)
    assert proc.returncode == 8, proc.stderr
    assert (tmp_path / "o.onnx").read_bytes() == b"the previous output"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx", "o.onnx"]


def test_a_killed_commands_temporary_folders_are_removed_by_the_next_write_there(tmp_path):
    """Each kill -9 left a hidden .amp-rewrite-* folder of up to a model's size that no later run
    removed (two of 579 MB and 639 MB in one folder). A folder's name now says which process on
    which machine made it; a write removes those of this machine's processes that are gone."""
    from amp_rewrite.files import stage_prefix

    save(benign_model(), tmp_path / "m.onnx")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    ours, other_host = stage_prefix().split("-")[-2], "0badc0de"
    folders = {"dead": f".amp-rewrite-{dead.stdout.strip()}-{ours}-abc", "alive": f".amp-rewrite-{os.getpid()}-{ours}-abc",
               "elsewhere": f".amp-rewrite-{dead.stdout.strip()}-{other_host}-abc"}
    for name in folders.values():
        (tmp_path / name).mkdir()
        (tmp_path / name / "o.onnx").write_bytes(b"partial")
    proc = run_cli(["m.onnx", "-o", "o.onnx", "-q"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    left = {p.name for p in tmp_path.iterdir()}
    assert folders["dead"] not in left and {folders["alive"], folders["elsewhere"]} <= left


def test_check_runs_on_an_if_that_returns_a_sequence_of_tensors_of_different_shapes(tmp_path):
    """The overflow localisation turned every exposed If output into one float array: an If whose
    branches split a low MatMul's output into a sequence of [2,4] and [2,12] crashed --check
    (exit 70, 'inhomogeneous shape'). A sequence is not a tensor to localise in."""
    m = make_model("""<ir_version: 8, opset_import: ["" : 17]>
    g (float[2,16] x, bool c) => (float[2,16] y, seq(float[2,?]) s) {
      h = MatMul(x, W)
      s = If(c) <
        then_branch = t () => (seq(float[2,?]) st) {
          m1 = MatMul(h, W2)
          sp = Constant<value = int64[2] {4, 12}>()
          st = SplitToSequence<axis=1>(m1, sp)
        },
        else_branch = e () => (seq(float[2,?]) se) {
          m2 = MatMul(h, W3)
          sp2 = Constant<value = int64[2] {8, 8}>()
          se = SplitToSequence<axis=1>(m2, sp2)
        }>
      y = MatMul(h, W4)
    }""", {"W": (16, 16), "W2": (16, 16), "W3": (16, 16), "W4": (16, 16)})
    save(m, tmp_path / "m.onnx")
    proc = run_cli(["m.onnx", "-o", "o.onnx", "--check"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "check passed" in proc.stdout


def test_the_pin_the_check_suggests_works_pasted_into_a_shell(tmp_path):
    """The hint printed the pattern with Python's repr: for a node named 'layers[0]/ReduceSum' the
    escaped regex's backslashes came out doubled, and the pasted pin named no node (exit 8 again)."""
    import re
    import shlex

    m = make_model("""<ir_version: 8, opset_import: ["" : 17]>
    g (float[1,64] x) => (float[1,1] y) {
      h = MatMul(x, W)
      s = ReduceSum<keepdims=1>(h, axes)
      y = Mul(s, k)
    }""", {"W": np.full((64, 4096), 1.0, np.float32), "axes": np.array([1], np.int64),
           "k": np.array([1e-3], np.float32)})
    next(n for n in m.graph.node if n.op_type == "ReduceSum").name = "layers[0]/ReduceSum"
    save(m, tmp_path / "m.onnx")
    np.savez(tmp_path / "in.npz", x=np.ones((1, 64), np.float32))
    argv = ["m.onnx", "-o", "o.onnx", "--check", "--inputs", "in.npz", "--fp16-ops", "ReduceSum"]
    proc = run_cli(argv, tmp_path)
    assert proc.returncode == 8, proc.stderr
    hint = re.search(r"try --auto-fp32 or (--fp32-nodes (?:'[^']*'|[^\s;]+))", proc.stderr).group(1)
    pasted = run_cli(argv + shlex.split(hint), tmp_path)
    assert pasted.returncode == 0, pasted.stderr


def test_integer_inputs_past_the_models_input_type_are_refused_not_wrapped(tmp_path):
    """int64 ids of 2**32 + 1 for an int32 input wrapped to 1: the check ran on other inputs than
    the file's, and the table said they came from it. Float inputs past the range were refused
    already; integers are too, naming the value."""
    m = make_model("""<ir_version: 8, opset_import: ["" : 17]>
    g (int32[1,4] ids) => (float[1,4,8] y) {
      e = Gather(E, ids)
      y = MatMul(e, W)
    }""", {"E": (8, 8), "W": (8, 8)})
    save(m, tmp_path / "m.onnx")
    np.savez(tmp_path / "in.npz", ids=np.array([[2**32 + 1, 2**32 + 2, 3, 4]], np.int64))
    proc = run_cli(["m.onnx", "--check", "--inputs", "in.npz"], tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "'ids' holds 4294967297, beyond int32's range" in proc.stderr
    np.savez(tmp_path / "in.npz", ids=np.array([[1, 2, 3, 4]], np.int64))  # (in range: taken as int32)
    assert run_cli(["m.onnx", "--check", "--inputs", "in.npz", "-o", "o.onnx"], tmp_path).returncode == 0


@pytest.mark.parametrize("flag", ["--check", "--auto-fp32"])
def test_a_model_the_generated_inputs_cannot_run_is_told_to_pass_inputs(tmp_path, flag):
    """--auto-fp32 handed its generated inputs on as if the user had given them: the error said
    'on the given inputs ... check the arrays in --inputs' with no --inputs passed."""
    m = make_model("""<ir_version: 8, opset_import: ["" : 17]>
    g (float[N,M] x) => (float[4,4] y) {
      r = Reshape(x, shape)
      y = MatMul(r, w)
    }""", {"shape": np.array([4, 4], np.int64), "w": (4, 4)})
    save(m, tmp_path / "m.onnx")
    proc = run_cli(["m.onnx", flag], tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "on the generated inputs" in proc.stderr and "pass real inputs with --inputs file.npz" in proc.stderr
    assert "given inputs" not in proc.stderr


def test_inputs_naming_a_pipe_is_refused_up_front(tmp_path):
    """--inputs naming a FIFO blocked reading it (the .npz is opened twice), and <(cat in.npz) was
    called 'not a readable .npz file'. Refused before anything runs, as a pipe for the model is."""
    save(benign_model(), tmp_path / "m.onnx")
    os.mkfifo(tmp_path / "in.npz")
    proc = run_cli(["m.onnx", "--check", "--inputs", "in.npz"], tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "--inputs in.npz: is not a regular file" in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.npz", "m.onnx"]


def test_auto_fp32_bisects_over_computations_not_constants_or_casts():
    """The bisection pinned every low node of its window, Constants too: a pinned Constant changes
    nothing (weight conversion decides it), the pin count overstated what was kept FP32, and the
    summary called the tool's own pins without effect."""
    m = make_model("""<ir_version: 8, opset_import: ["" : 17]>
    g (float[2,8] x) => (float[2,8] y) {
      k = Constant<value = float[8] {1,2,3,4,5,6,7,8}>()
      h = MatMul(x, W)
      a = Add(h, k)
      y = MatMul(a, W)
    }""", {"W": (8, 8)})
    low = rewrite(m).model
    assert any(n.op_type == "Constant" for n in low.graph.node) and any(n.op_type == "Cast" for n in low.graph.node)
    ops = [op for _, op in ck._low_nodes(low)]
    assert ops == ["MatMul", "Add", "MatMul"]


# -- the emulation stands in for the GPU ---------------------------------------------------------------------
def test_a_low_sum_of_three_inputs_is_emulated_with_its_partial_sums_rounded(tmp_path):
    """onnxruntime's CUDA Sum keeps each partial sum in the low type (out = in0 + in1; out = out + in2):
    40000 + 40000 - 40000 is inf in FP16. The emulation rounded only the node's output (40000), and
    --check passed a model that gives inf on the GPU."""
    m = make_model("""<ir_version: 8, opset_import: ["" : 17]>
    g (float[1,4] x) => (float[1,4] y) {
      a = MatMul(x, W)
      b = MatMul(x, W)
      c = MatMul(x, V)
      s = Sum(a, b, c)
      y = MatMul(s, I)
    }""", {"W": np.full((4, 4), 10000.0, np.float32), "V": np.full((4, 4), -10000.0, np.float32),
           "I": np.eye(4, dtype=np.float32) * 0.5})
    low = rewrite(m).model
    assert value_types(low)[next(n for n in low.graph.node if n.op_type == "Sum").output[0]] == onnx.TensorProto.FLOAT16
    emulated, _ = emulate_low(low)
    assert not np.isfinite(run(emulated, {"x": np.ones((1, 4), np.float32)})["y"]).any()  # (inf, NaN after the MatMul)
    save(m, tmp_path / "m.onnx")
    np.savez(tmp_path / "in.npz", x=np.ones((1, 4), np.float32))
    proc = run_cli(["m.onnx", "--check", "--inputs", "in.npz"], tmp_path)
    assert proc.returncode == 8, proc.stdout + proc.stderr


def test_a_low_sum_of_broadcast_inputs_is_emulated_with_each_partial_sum_its_own_shape():
    """The partial sums of Sum(a[4], b[4], c[2,4]) have shape [4] and the sum [2,4]: the emulation
    declares only the last one's shape, so it stays a valid model, and rounds each partial sum
    (40000 + 40000 overflows FP16 before -40000 is added)."""
    from onnx import TensorProto, helper

    vi = helper.make_tensor_value_info
    graph = helper.make_graph([helper.make_node("Sum", ["a", "b", "c"], ["s"])], "g",
                              [vi("a", TensorProto.FLOAT16, [4]), vi("b", TensorProto.FLOAT16, [4]),
                               vi("c", TensorProto.FLOAT16, [2, 4])], [vi("s", TensorProto.FLOAT16, [2, 4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    emulated, rounded = emulate_low(model)
    onnx.checker.check_model(emulated, full_check=True)
    assert rounded == {"a", "b", "c", "s"}
    feeds = {"a": np.full(4, 40000, np.float32), "b": np.full(4, 40000, np.float32),
             "c": np.full((2, 4), -40000, np.float32)}
    assert np.isposinf(run(emulated, feeds)["s"]).all()


def test_an_einsum_of_three_operands_stays_fp32():
    """onnxruntime's CUDA Einsum computes pairwise products and keeps each in the low type: an
    intermediate of 360000 was inf (NaN after) where the result, 3600, fits."""
    m = make_model("""<ir_version: 8, opset_import: ["" : 17]>
    g (float[4,4] x) => (float[4,4] y) {
      h = MatMul(x, A)
      y = Einsum<equation = "ij,jk,kl->il">(h, B, C)
    }""", {"A": np.eye(4, dtype=np.float32), "B": np.full((4, 4), 300.0, np.float32),
           "C": (np.eye(4) * 0.01).astype(np.float32)})
    result = rewrite(m)
    decision = next(d for d in result.log.decisions.values() if d.op == "Einsum")
    assert decision.precision == Precision.FP32 and "pairwise products" in decision.reason


def test_a_model_local_functions_low_body_is_emulated():
    """The emulation widened a low value at a function call but never visited the body, whose own
    Cast to FP16 then met it in a Mul: onnxruntime refused the emulated model and --check blamed
    the user's inputs. Function bodies are inlined first."""
    from onnx import helper

    body = [helper.make_node("Constant", [], ["two"], value=helper.make_tensor("t", onnx.TensorProto.FLOAT, [], [2.0])),
            helper.make_node("Cast", ["two"], ["two16"], to=onnx.TensorProto.FLOAT16),
            helper.make_node("Mul", ["a", "two16"], ["b"])]
    fn = helper.make_function("local", "scale", ["a"], ["b"], body, [helper.make_opsetid("", 17)])
    graph = helper.make_graph(
        [helper.make_node("Cast", ["x"], ["x16"], to=onnx.TensorProto.FLOAT16),
         helper.make_node("scale", ["x16"], ["y16"], domain="local"),
         helper.make_node("Cast", ["y16"], ["y"], to=onnx.TensorProto.FLOAT)], "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("local", 1)],
                              functions=[fn], ir_version=8)
    onnx.checker.check_model(model, full_check=True)
    emulated, _ = emulate_all(model)
    x = np.full((1, 4), 40000.0, np.float32)
    assert np.isinf(run(emulated, {"x": x})["y"]).all()  # (40000 * 2 in FP16, as the GPU computes it)


def test_the_emulation_infers_types_on_the_structure_not_the_weights(monkeypatch):
    """Shape inference serialises its input: on a model past 2 GB the emulation failed and --check
    fell back to an unrounded CPU run with a note. It now infers on the weights' types and shapes."""
    import amp_rewrite.emulate as em

    m = make_model("""<ir_version: 8, opset_import: ["" : 17]>
    g (float[1,256] x) => (float[1,256] y) { y = MatMul(x, W) }""", {"W": (256, 256)})
    low = rewrite(m).model
    seen = []
    real = onnx.shape_inference.infer_shapes
    monkeypatch.setattr(em.onnx.shape_inference, "infer_shapes", lambda p, **k: seen.append(p.ByteSize()) or real(p, **k))
    emulate_low(low)
    assert seen and max(seen) < 256 * 256 * 2 // 4  # (the FP16 weight, 128 KiB, is not in it)


def test_an_input_that_rounds_to_the_largest_fp16_is_not_said_to_enter_as_inf():
    notes = ck._inputs_beyond_range({}, _low_input_model(), {"x": np.array([[65510.0, 1.0]], np.float32)})
    assert notes == []
    notes = ck._inputs_beyond_range({}, _low_input_model(), {"x": np.array([[65520.0, 1.0]], np.float32)})
    assert len(notes) == 1 and "enter as ±inf" in notes[0][1]


def _low_input_model() -> onnx.ModelProto:
    return make_model("""<ir_version: 8, opset_import: ["" : 17]>
    g (float16[1,2] x) => (float16[1,2] y) { y = Relu(x) }""", {})


def test_a_failing_output_computed_after_a_selection_gets_a_note_about_near_ties():
    """Detection models compared element by element fail on near-tied scores that FP16 orders
    otherwise (a reorder, not an accuracy loss), and --auto-fp32 then pinned most of the model:
    the check now says that the failing output comes after an op that selects by comparing."""
    m = make_model("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[1,2] x) => (float[1] picked, float[1,2] scores)
    <float[2,2] W, int64[1] k, float[2,1] table>
    {
      scores = MatMul(x, W)
      top, idx = TopK<axis=-1>(scores, k)
      flat = Squeeze(idx)
      picked = Gather(table, flat)
    }""", {"W": np.array([[0.5, 0.50005], [0.5, 0.50005]], np.float32), "k": np.array([1], np.int64),
           "table": np.array([[10.0], [-10.0]], np.float32)})
    result = ck.check_models(m, rewrite(m).model, inputs={"x": np.ones((1, 2), np.float32)})
    assert not result.passed
    by_name = {o.name: o for o in result.outputs}
    assert by_name["scores"].passed and not by_name["picked"].passed
    notes = [n for n in result.notes if "selects elements by comparing values" in n]
    assert len(notes) == 1 and "output 'picked' is computed after TopK" in notes[0], result.table()


def test_a_function_s_default_attribute_is_kept_by_the_emulation():
    """onnx's inliner drops a function's default attributes (attribute_proto): the emulated model
    ran LeakyRelu with its schema's 0.01 where the function says 0.2, and --check failed (and
    deleted) a correct rewrite."""
    from onnx import helper as oh

    act = oh.make_node("LeakyRelu", ["a"], ["f"])
    act.attribute.append(onnx.AttributeProto(name="alpha", ref_attr_name="alpha", type=onnx.AttributeProto.FLOAT))
    fn = oh.make_function("local", "Act", ["a"], ["f"], [act], [oh.make_opsetid("", 18)])
    fn.attribute_proto.append(oh.make_attribute("alpha", 0.2))
    W = onnx.numpy_helper.from_array((np.random.default_rng(0).standard_normal((8, 8)) / 3).astype(np.float32), "W")
    T = onnx.TensorProto
    # (a second call sets alpha itself: its own 0.5 holds, not the function's default)
    g = oh.make_graph([oh.make_node("MatMul", ["x", "W"], ["h"], name="mm"),
                       oh.make_node("Act", ["h"], ["y0"], domain="local", name="act"),
                       oh.make_node("Act", ["y0"], ["y"], domain="local", name="act2", alpha=0.5)],
                      "g", [oh.make_tensor_value_info("x", T.FLOAT, [4, 8])],
                      [oh.make_tensor_value_info("y", T.FLOAT, [4, 8])], [W])
    m = oh.make_model(g, opset_imports=[oh.make_opsetid("", 18), oh.make_opsetid("local", 1)], functions=[fn],
                      ir_version=10)
    x = np.random.default_rng(1).standard_normal((4, 8)).astype(np.float32)
    assert rel_err(run(emulate_low(m)[0], {"x": x})["y"], run(m, {"x": x})["y"]) == 0
    assert not any(a.name == "alpha" for a in m.graph.node[1].attribute)  # (the input is left as it was)
    result = ck.check_models(m, rewrite(m).model, inputs={"x": x})
    assert result.passed, result.table()


def test_a_dim_value_of_minus_one_is_an_unknown_dim(tmp_path):
    """paddle2onnx (and some older converters) write a dynamic dim as ``dim_value: -1``; the checker
    accepts it and onnxruntime runs the model at any size there. It was taken for a size: cast bytes
    came out negative ('casts inserted: 4 (-384 B per run)', the cost model's figures too, so the
    optimal placement cut on negative capacities), --check crashed ('negative dimensions are not
    allowed', exit 70) and refused a (3, 16) array for a [-1, 16] input. It reads as a symbolic
    dim now: the same decisions, summary and check as the model with a named batch."""
    text = """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N,16] x) => (float[N,16] y) {
          a = MatMul(x, w1)
          b = Relu(a)
          c = Softmax<axis=-1>(b)
          d = MatMul(c, w2)
          e = Exp(d)
          y = MatMul(e, w3)
        }"""
    named = make_model(text, {"w1": (16, 16), "w2": (16, 16), "w3": (16, 16)})
    model = onnx.ModelProto()
    model.CopyFrom(named)
    for info in (model.graph.input[0], model.graph.output[0]):
        info.type.tensor_type.shape.dim[0].dim_value = -1  # (replaces the dim_param: one of the two)
    onnx.checker.check_model(model, full_check=True)
    got, want = rewrite(model), rewrite(named)
    assert got.report.summary()["cast_bytes_per_run"] == want.report.summary()["cast_bytes_per_run"] == 0
    assert got.report.summary()["casts_unknown_size"] == want.report.summary()["casts_unknown_size"] == 4
    assert {k: d.precision for k, d in got.log.decisions.items()} == \
        {k: d.precision for k, d in want.log.decisions.items()}
    save(model, tmp_path / "m.onnx")
    np.savez(tmp_path / "in.npz", x=np.random.default_rng(0).standard_normal((3, 16)).astype(np.float32))
    for extra in ([], ["--inputs", "in.npz"]):
        proc = run_cli(["m.onnx", "--check", "--overwrite", *extra], tmp_path)
        assert proc.returncode == 0, proc.stderr
        assert "check passed" in proc.stdout and "casts inserted: 4 (sizes unknown)" in proc.stdout


def test_a_nan_the_fp32_model_makes_at_the_same_place_is_no_mismatch():
    """The FP32 model's own NaN (a Sqrt of a negative sum), where the rewrite has it too, is no
    error of the rewrite: --check passes and keeps the output."""
    stats = ck.compare_output("y", np.array([np.nan, 1.0], np.float32), np.array([np.nan, 1.0], np.float32), 1e-2)
    assert stats.passed and stats.max_rel == 0
    assert not ck.compare_output("y", np.array([np.nan, 1.0], np.float32), np.array([np.inf, 1.0], np.float32),
                                 1e-2).passed


def test_emulate_low_takes_fp16_where_a_model_holds_both_low_types():
    """As its docstring says: FP16 if both."""
    from onnx import TensorProto as T
    from onnx import helper as oh

    g = oh.make_graph([oh.make_node("Cast", ["x"], ["h"], to=T.FLOAT16), oh.make_node("Cast", ["x"], ["b"], to=T.BFLOAT16),
                       oh.make_node("Cast", ["h"], ["y"], to=T.FLOAT), oh.make_node("Cast", ["b"], ["z"], to=T.FLOAT)],
                      "g", [oh.make_tensor_value_info("x", T.FLOAT, [2])],
                      [oh.make_tensor_value_info("y", T.FLOAT, [2]), oh.make_tensor_value_info("z", T.FLOAT, [2])])
    m = oh.make_model(g, opset_imports=[oh.make_opsetid("", 17)], ir_version=8)
    assert emulate_low(m)[1] == {"h"}


def _one_node_localised(want: list[float], got: list[float], mask: bool = True):
    """check._localise on a one-node graph ``y = Mul(a, b)`` (named "mul"), the FP32 run giving
    ``want`` and the low run ``got`` for y; ``mask``: input a is fed ``want`` (a mask holding its
    sentinels), else a and b are fed values a computation reaches ``want`` from."""
    m = make_model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[3] a, float[3] b) => (float[3] y) { y = Mul(a, b) }""")
    m.graph.node[0].name = "mul"
    feeds = {"a": np.array(want, np.float32) if mask else np.sqrt(np.abs(np.array(want, np.float32))),
             "b": np.ones(3, np.float32) if mask else np.sign(want) * np.sqrt(np.abs(np.array(want, np.float32)))}
    return ck._localise(m, {"y": np.array(got, np.float32)}, {"y": "y"}, {"y": np.array(want, np.float32)}, "fp16",
                        feeds=feeds)


def test_a_computed_value_past_the_sentinel_size_is_an_overflow_not_a_mask():
    """|x| >= 1e8 in FP32 was taken for a mask sentinel whatever made it: a MatMul reaching 1.6e8
    from inputs of 1e4 became inf, and the check said no fp16 value overflowed (or named the node
    after it, whose FP32 max was 1.2e3). Only a value computed from a sentinel (a constant, a
    graph input or a value holding one) is a mask's now."""
    found, total, _, sentinels = _one_node_localised([-1.6e8, 1.0, 2.0], [-np.inf, 1.0, 2.0], mask=False)
    assert total == 1 and not sentinels
    [overflow] = found
    assert (overflow.node, overflow.neg_inf, overflow.fp32_max_abs, overflow.root) == ("mul", 1, 1.6e8, True)


@pytest.mark.parametrize("scale", [1e-8, 1e-5])
def test_a_matmul_overflowing_past_the_sentinel_size_is_named(scale):
    """End to end: x of 1e4 times W of 2000 gives 1.6e8, inf in fp16, then scaled down. The check
    said 'no fp16 intermediate value overflowed' (1e-8: the output 20% off) or named the Mul after
    it (1e-5, FP32 max 1.2e3), whose --fp32-nodes hint then passed a model still writing inf."""
    rng = np.random.default_rng(0)
    m = make_model(f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[2,8] x) => (float[2,8] y) {{
          big = MatMul(x, w)
          small = Mul(big, k)
          t = Tanh(small)
          y = MatMul(t, w2)
        }}""", {"w": np.full((8, 8), 2000.0, np.float32), "k": np.array(scale, np.float32),
                "w2": rng.standard_normal((8, 8)).astype(np.float32)})
    feeds = {"x": (1e4 * (1 + rng.random((2, 8)))).astype(np.float32)}
    result = ck.check_models(m, rewrite(m).model, inputs=feeds)
    assert not result.passed
    assert [(o.node, o.op, o.root) for o in result.overflow if o.root] == [("MatMul:big", "MatMul", True)]
    assert not any("sentinel" in n for n in result.notes)


def test_a_sentinel_whose_sign_flips_to_inf_is_an_overflow_not_a_saturated_mask():
    """-1e9 in FP32 that the rewrite makes +inf is no mask sentinel saturating (that keeps its sign,
    -1e9 -> -inf): it is an overflow, counted and named."""
    found, total, _, sentinels = _one_node_localised([-1e9, 1.0, 2.0], [np.inf, 1.0, 2.0])
    assert total == 1 and not sentinels
    [overflow] = found
    assert (overflow.node, overflow.value, overflow.pos_inf, overflow.neg_inf, overflow.root) == ("mul", "y", 1, 0, True)
    # the same sentinel keeping its sign saturates: no overflow
    found, total, _, sentinels = _one_node_localised([-1e9, 1.0, 2.0], [-np.inf, 1.0, 2.0])
    assert (found, total) == ([], 0)
    assert [(s["node"], s["value"], s["count"]) for s in sentinels] == [("mul", "y", 1)]


def test_every_overflow_root_is_listed_past_the_first_ten():
    """Overflows are listed up to ten, but a root (none of its inputs overflowed) always is: twelve
    independent overflowing nodes give twelve roots."""
    from onnx import TensorProto as T
    from onnx import helper as oh

    n = 12
    g = oh.make_graph([oh.make_node("Mul", ["a", "a"], [f"y{i}"], name=f"mul{i}") for i in range(n)], "g",
                      [oh.make_tensor_value_info("a", T.FLOAT, [1])],
                      [oh.make_tensor_value_info(f"y{i}", T.FLOAT, [1]) for i in range(n)])
    m = oh.make_model(g, opset_imports=[oh.make_opsetid("", 17)], ir_version=8)
    names = {f"y{i}": f"y{i}" for i in range(n)}
    found, total, _, _ = ck._localise(m, {k: np.array([np.inf], np.float32) for k in names}, names,
                                      {k: np.array([1e5], np.float32) for k in names}, "fp16")
    assert total == n and [o.node for o in found if o.root] == [f"mul{i}" for i in range(n)]


def _overflow(node: str, root: bool = True) -> "ck.Overflow":
    return ck.Overflow(node=node, op="Mul", value=node, fp32_value=node, nan=0, pos_inf=1, neg_inf=0,
                       fp32_max_abs=1e5, root=root)


def test_the_table_counts_the_values_downstream_beyond_the_five_roots_it_names():
    """The table names the first root and four more; the roots past the fifth and the values
    downstream are counted on one line, each as what it is."""
    ok = ck.compare_output("y", np.ones(2, np.float32), np.ones(2, np.float16), 0.01)
    roots = [_overflow(f"mul{i}") for i in range(7)]
    result = ck.CheckResult(passed=False, tolerance=0.01, target="fp16", provider="CPUExecutionProvider",
                            outputs=[ok], overflow=roots + [_overflow("add", root=False)], overflow_total=8)
    table = result.table()
    assert table.count("  also: ") == 4 and "mul5" not in table
    assert "  (2 more overflowing nodes and 1 more fp16 value downstream carry NaN/Inf)" in table
    only_downstream = ck.CheckResult(passed=False, tolerance=0.01, target="fp16", provider="CPUExecutionProvider",
                                     outputs=[ok], overflow=roots[:2] + [_overflow("add", root=False)],
                                     overflow_total=5).table()
    assert "  (3 more fp16 values downstream carry NaN/Inf)" in only_downstream


def test_the_failure_names_an_output_with_new_nan_or_inf_before_one_only_far_off():
    """Of two failing outputs both infinitely far off, the one with NaN/Inf the FP32 model does not
    have is named (a flipped -inf is far off too, but the FP32 model has an inf there)."""
    flipped = ck.compare_output("a", np.array([np.inf, 1.0], np.float32), np.array([-np.inf, 1.0], np.float16), 0.01)
    new = ck.compare_output("b", np.array([2.0, 1.0], np.float32), np.array([np.nan, 1.0], np.float16), 0.01)
    assert flipped.max_rel == new.max_rel == np.inf and not flipped.passed and not new.passed
    result = ck.CheckResult(passed=False, tolerance=0.01, target="fp16", provider="CPUExecutionProvider",
                            outputs=[flipped, new])
    assert result.worst is new
    assert result.failure_message().startswith(
        "check failed: output 'b': 1 NaN/Inf values the FP32 model does not have (1 more outputs fail)")


def test_the_check_feeds_an_fp16_input_fp16_rounded_values_and_a_bf16_input_bf16_rounded_ones():
    """What a model declaring an FP16 (BF16) input receives is the feed rounded to FP16 (BF16):
    rounded to BF16, an FP16 input's feed would make --check of a --no-keep-io-types rewrite see 8
    bits of mantissa where there are 11, and fail a good rewrite."""
    import ml_dtypes

    m = make_model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float16[2, 8] h, bfloat16[2, 8] b, float[2, 8] f) => (float16[2, 8] y, bfloat16[2, 8] z, float[2, 8] w) {
          y = Identity(h)
          z = Identity(b)
          w = Identity(f)
        }""")
    x = (np.random.default_rng(3).standard_normal((2, 8)) * 3).astype(np.float32)
    fed = ck._rounded_feeds(m, {"h": x, "b": x, "f": x})
    as_fp16 = x.astype(np.float16).astype(np.float32)
    as_bf16 = x.astype(ml_dtypes.bfloat16).astype(np.float32)
    assert not np.array_equal(as_fp16, as_bf16)
    np.testing.assert_array_equal(fed["h"], as_fp16)
    np.testing.assert_array_equal(fed["b"], as_bf16)
    np.testing.assert_array_equal(fed["f"], x)
    # through check_models: y = Identity(x) of a --no-keep-io-types rewrite differs by FP16 rounding only
    m = make_model("""<ir_version: 8, opset_import: ["" : 17]>
        g (float[2, 8] x) => (float[2, 8] y, float[2, 8] h) { y = Identity(x)  h = MatMul(x, W) }""", {"W": (8, 8)})
    low = rewrite(m, keep_io_types=False).model
    assert low.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT16
    result = ck.check_models(m, low, inputs={"x": x}, tolerance=2e-3)
    [y] = [o for o in result.outputs if o.name == "y"]
    assert y.max_rel == pytest.approx(rel_err(x, as_fp16), rel=1e-3)
    assert result.passed, result.table()


def test_the_emulation_widens_an_optional_fp16_declaration():
    """An optional(tensor(float16)) value_info becomes FP32 in the emulation, as the value it
    declares does: left FP16, onnxruntime would refuse the emulated model (a type mismatch on 'o')."""
    from onnx import TensorProto as T
    from onnx import helper as oh

    g = oh.make_graph([oh.make_node("Cast", ["x"], ["h"], to=T.FLOAT16), oh.make_node("Optional", ["h"], ["o"]),
                       oh.make_node("OptionalGetElement", ["o"], ["e"]), oh.make_node("Cast", ["e"], ["y"], to=T.FLOAT)],
                      "g", [oh.make_tensor_value_info("x", T.FLOAT, [4])], [oh.make_tensor_value_info("y", T.FLOAT, [4])],
                      value_info=[oh.make_value_info("o", oh.make_optional_type_proto(
                          oh.make_tensor_type_proto(T.FLOAT16, [4])))])
    m = oh.make_model(g, opset_imports=[oh.make_opsetid("", 18)], ir_version=8)
    full_check(m)
    emulated, rounded = emulate_all(m)
    [o] = [v for v in emulated.graph.value_info if v.name == "o"]
    assert o.type.optional_type.elem_type.tensor_type.elem_type == T.FLOAT
    assert "h" in rounded
    x = np.array([1.0001, 7e4, -3.14159, 0.1], np.float32)
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(run(emulated, {"x": x})["y"], x.astype(np.float16).astype(np.float32))


def test_a_value_past_half_the_fp16_limit_is_reported_near_it():
    """A low-precision value that stays finite but exceeds half the FP16 limit is a near-limit
    warning, not an overflow."""
    found, total, near, _ = _one_node_localised([40000.0, 1.0, 2.0], [40000.0, 1.0, 2.0])
    assert (found, total) == ([], 0)
    assert [(w["node"], w["value"], w["max_abs"]) for w in near] == [("mul", "y", 40000.0)]
    assert _one_node_localised([30000.0, 1.0, 2.0], [30000.0, 1.0, 2.0])[2] == []


def test_an_overflow_beside_a_saturated_sentinel_reports_the_fp32_peak_without_the_sentinel():
    """The FP32 max |x| of an overflowing value leaves out the mask sentinels it also holds."""
    found, total, _, sentinels = _one_node_localised([-1e9, 7e4, 2.0], [-np.inf, np.inf, 2.0])
    assert total == 1 and [s["count"] for s in sentinels] == [1]
    [overflow] = found
    assert overflow.pos_inf == 1 and overflow.fp32_max_abs == 7e4
    assert "FP32 max |x| 7e+04" in overflow.describe("fp16")


def test_a_second_root_after_many_overflowing_values_downstream_of_the_first_is_still_listed():
    """Only the first few overflowing values are kept, but every root is: an independent overflow
    after a long chain carrying the first one's inf is named too."""
    chain = "\n".join(f"y{i} = Neg(y{i - 1})" for i in range(1, 12))
    m = make_model(f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[3] a, float[3] b) => (float[3] y11, float[3] z) {{
          y0 = Mul(a, b)
          {chain}
          z = Mul(b, b)
        }}""")
    for n in m.graph.node:
        n.name = n.output[0]
    want = {f"y{i}": np.array([(-1) ** i * 1e5, 1.0, 2.0], np.float32) for i in range(12)}
    want["z"] = np.array([1e6, 1.0, 2.0], np.float32)
    got = {k: np.where(np.abs(v) > 65504, np.sign(v) * np.inf, v).astype(np.float32) for k, v in want.items()}
    found, total, _, _ = ck._localise(m, got, {k: k for k in want}, want, "fp16")
    assert total == 13
    assert [o.value for o in found if o.root] == ["y0", "z"]
    assert len(found) == 11  # the first ten, then the second root


def _masked_by_initializer(w_scale: float) -> onnx.ModelProto:
    """scores = x @ w, plus an additive mask of -1e9 held in an initializer, then Softmax."""
    from onnx import helper as oh
    from onnx import numpy_helper as nh

    mask = np.zeros((1, 8), np.float32)
    mask[0, 6:] = -1e9
    g = oh.make_graph([oh.make_node("MatMul", ["x", "w"], ["s"], name="mm"),
                       oh.make_node("Add", ["s", "mask"], ["m"], name="add"),
                       oh.make_node("Softmax", ["m"], ["y"], axis=-1, name="sm")], "g",
                      [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [4, 8])],
                      [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [4, 8])],
                      [nh.from_array(np.random.default_rng(0).standard_normal((8, 8)).astype(np.float32) * w_scale, "w"),
                       nh.from_array(mask, "mask")])
    return oh.make_model(g, opset_imports=[oh.make_opsetid("", 17)], ir_version=8)


def test_a_mask_initializer_the_rewrite_saturated_still_carries_its_sentinel():
    """The fp16 rewrite stores the -1e9 mask as -65504; scores - 65504 is -inf in fp16, a mask
    saturating, not an overflow."""
    m = _masked_by_initializer(30.0)
    low = rewrite(m, fp16_nodes=["add"]).model  # (else the sum of scores and a constant keeps FP32, as greedy has it)
    assert [t.data_type for t in low.graph.initializer if t.name == "mask"] == [onnx.TensorProto.FLOAT16]
    x = np.random.default_rng(1).standard_normal((4, 8)).astype(np.float32)
    result = ck.check_models(m, low, inputs={"x": x})
    assert result.passed and not result.overflow
    assert any("sentinel" in n for n in result.notes)


def test_a_saturated_mask_is_not_near_the_limit():
    """The mask saturated to a finite -65504
    (small scores) is a mask's value, not a computation near fp16's limit."""
    m = _masked_by_initializer(0.5)
    x = np.random.default_rng(1).standard_normal((4, 8)).astype(np.float32)
    result = ck.check_models(m, rewrite(m, fp16_nodes=["add"]).model, inputs={"x": x})
    assert result.passed and not result.near_limit, result.near_limit


def test_a_reader_of_an_input_beyond_the_range_is_no_second_overflow():
    """Feeds not rounded (the CUDA provider's path), an
    input of 2e5 (listed beyond fp16's range) times 1e3 is 2e8 in FP32; the input's note says where
    it started, and its reader is not counted again."""
    m = make_model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[3] a, float[3] b) => (float[3] y) { y = Mul(a, b) }""")
    m.graph.node[0].name = "mul"
    feeds = {"a": np.array([2e5, 1, 1], np.float32), "b": np.array([1e3, 1, 2], np.float32)}
    found, total, _, sentinels = ck._localise(m, {"y": np.array([np.inf, 1, 2], np.float32)}, {"y": "y"},
                                              {"y": np.array([2e8, 1, 2], np.float32)}, "fp16", ["a"], feeds=feeds)
    assert (found, total, [s["count"] for s in sentinels]) == ([], 0, [1])




def test_a_mask_an_if_branch_holds_is_a_sentinel_not_an_overflow():
    """Each If branch adds its own -1e9 mask initializer: the If's output saturating to -inf is a
    mask's (the branches' values are not exposed, so the If stands for them). The first version of
    the sentinel-source check saw no source there and called it an overflow (mutation round)."""
    from onnx import helper as oh
    from onnx import numpy_helper as nh

    mask = np.zeros((1, 8), np.float32)
    mask[0, 6:] = -1e9

    def branch(name):
        return oh.make_graph([oh.make_node("Add", ["s", name], [name + "_o"], name=name + "_add")], name, [],
                             [oh.make_tensor_value_info(name + "_o", onnx.TensorProto.FLOAT, [4, 8])],
                             [nh.from_array(mask, name)])

    g = oh.make_graph([oh.make_node("MatMul", ["x", "w"], ["s"], name="mm"),
                       oh.make_node("If", ["c"], ["m"], name="if", then_branch=branch("mt"), else_branch=branch("me")),
                       oh.make_node("Softmax", ["m"], ["y"], axis=-1, name="sm")], "g",
                      [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [4, 8]),
                       oh.make_tensor_value_info("c", onnx.TensorProto.BOOL, [])],
                      [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [4, 8])],
                      [nh.from_array(np.random.default_rng(0).standard_normal((8, 8)).astype(np.float32) * 30, "w")])
    m = oh.make_model(g, opset_imports=[oh.make_opsetid("", 17)], ir_version=8)
    x = np.random.default_rng(1).standard_normal((4, 8)).astype(np.float32)
    low = rewrite(m, fp16_nodes=["mt_add", "me_add"]).model  # (else the masks' sums keep FP32, as greedy has them)
    result = ck.check_models(m, low, inputs={"x": x, "c": np.array(True)})
    assert result.passed and not result.overflow, result.table()
    assert any("sentinel" in n for n in result.notes)


_INTERNALS = {
    "CumSum": ("""<ir_version: 8, opset_import: ["" : 17]>
        g (float[1,64] x) => (float[1,64] y) { h = MatMul(x, W)  c = CumSum(h, ax)  y = MatMul(c, W) }""",
               {"W": (64, 64), "ax": np.array(1, np.int64)}, {"fp16_ops": ["CumSum"]}, "keeps its running sum in fp16"),
    "LSTM": ("""<ir_version: 8, opset_import: ["" : 17]>
        g (float[4,1,8] x) => (float[4,1,8] y) {
          h = MatMul(x, W)  o, hn, cn = LSTM<hidden_size=8>(h, Wi, R)  s = Squeeze(o, one)  y = MatMul(s, W)
        }""", {"W": (8, 8), "Wi": (1, 32, 8), "R": (1, 32, 8), "one": np.array([1], np.int64)},
             {"fp16_ops": ["LSTM"]}, "keeps the hidden and cell state in fp16"),
    "com.microsoft:Attention": ("""<ir_version: 8, opset_import: ["" : 17, "com.microsoft" : 1]>
        g (float[1,4,8] x) => (float[1,4,8] y) {
          a = com.microsoft.Attention<num_heads=2>(x, Wqkv, bqkv)  y = MatMul(a, W)
        }""", {"W": (8, 8), "Wqkv": (8, 24), "bqkv": (24,)}, {}, "writes the QKV projection to a buffer of fp16"),
}


@pytest.mark.parametrize("op", list(_INTERNALS))
def test_check_says_which_low_kernel_internals_it_does_not_emulate(op):
    """The emulation rounds each node's outputs; CUDA's CumSum keeps its running sum in FP16 (4096
    ones summed to 2048: 50% off where the check said 2.4e-4 and passed), LSTM its state between
    steps, com.microsoft:Attention its QKV projection (past 65504: inf on a GPU). The check says it
    does not see those, naming the node; an FP32 node of the same op gets no note."""
    text, inits, options, says = _INTERNALS[op]
    m = make_model(text, inits)
    low = rewrite(m, **options)
    assert any(n.op_type == op.split(":")[-1] and value_types(low.model).get(n.input[0]) == onnx.TensorProto.FLOAT16
               for n in low.model.graph.node)
    notes = [n for n in ck.check_models(m, low.model).notes if says in n]
    assert len(notes) == 1 and "the emulation computes that in FP32 and rounds only the outputs" in notes[0]
    kept = rewrite(m, fp32_ops=[op])
    assert not [n for n in ck.check_models(m, kept.model).notes if says in n]


def test_check_says_which_custom_domain_values_it_cannot_type_and_round():
    """Without value_info, onnx's inference knows no com.microsoft schema: a FastGelu's output and
    what follows were left unrounded, silently."""
    m = make_model("""<ir_version: 8, opset_import: ["" : 17, "com.microsoft" : 1]>
        g (float[2,16] x) => (float[2,16] y) { h = MatMul(x, W)  g = com.microsoft.FastGelu(h)  y = MatMul(g, W) }""",
                   {"W": (16, 16)})
    low = rewrite(m).model
    from amp_rewrite.emulate import not_emulated
    assert not not_emulated(low)  # (a rewrite of ours types every value)
    del low.graph.value_info[:]
    notes = not_emulated(low)
    assert len(notes) == 1 and "'g' of com.microsoft:FastGelu" in notes[0] and "does not round them" in notes[0]


def test_an_output_with_new_nan_has_no_cosine():
    """The cosine over the elements finite in both said 1.000000 beside 112 NaN."""
    a = np.arange(1, 9, dtype=np.float32)
    b = a.copy()
    b[3] = np.nan
    stats = ck.compare_output("y", a, b, 1e-2)
    assert not stats.passed and stats.cosine is None
    assert ck.compare_output("y", a, a * (1 + 1e-4), 1e-2).cosine == pytest.approx(1.0)


def test_a_reciprocal_multiplied_in_keeps_the_check_emulated():
    """``logits * (1 / t)``: onnxruntime's DivMulFusion refused the emulated model (the Identity the
    emulation writes for a removed Cast sits in its pattern), and the check fell back to the CPU
    provider's unrounded numerics with a note. The emulation runs unoptimised instead."""
    w = np.random.default_rng(1).standard_normal((16, 8)).astype(np.float32) * 0.1
    w[:, :3] = -1e4
    m = make_model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N,16] x, float t) => (float[N,8] y) {
          sq = Mul(x, x)
          logits = MatMul(sq, w)
          it = Div(one, t)
          scaled = Mul(logits, it)
          y = Softmax(scaled)
        }""", {"w": w, "one": np.array(1.0, np.float32)})
    result = ck.check_models(m, rewrite(m).model)
    assert not any("could not be emulated" in note for note in result.notes), result.notes
    assert any("every fp16 value is rounded to fp16" in note for note in result.notes), result.notes
    assert not result.passed and result.overflow[0].node == "MatMul:logits"
