"""ONNX training rewrite (amp_rewrite.training_onnx) and the forward+gradient graph helper
(tools/make_training_graph.py). Issue 5.

onnxruntime runs in child processes (FP16 graphs can crash the CPU provider): single runs through
tools/ortrun.py, the training loops in one child that runs the whole loop. onnxruntime's CPU
provider has no BF16 MatMul, so BF16 training graphs are checked for structure only.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import onnx
import pytest

from amp_rewrite.errors import UsageError
from amp_rewrite.training_onnx import (ALL_FINITE, GROWTH_TRACKER, LOSS_SCALE, NEXT_GROWTH_TRACKER, NEXT_LOSS_SCALE,
                                       SCALED_LOSS, rewrite_training_onnx, rewrite_training_onnx_model, training_info)
from amp_rewrite import rewrite as amp_rewrite_rewrite
from tools.ortrun import run_onnx

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

from tools.make_training_graph import make_training_graph, training_graph_info  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BATCH = 32
GRADS = "grad.*"


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = torch.nn.Linear(8, 16)
        self.l2 = torch.nn.Linear(16, 1)

    def forward(self, x):
        return self.l2(torch.tanh(self.l1(x)))


@pytest.fixture(scope="module")
def setup():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        model = MLP()
        x, y = torch.randn(BATCH, 8), torch.randn(BATCH, 1)
        proto = make_training_graph(model, (x,), (y,), loss_fn=F.mse_loss, exporter="torchscript")
    finally:
        torch.set_num_threads(threads)
    return model, proto


@pytest.fixture(scope="module")
def rewritten(setup):
    _, proto = setup
    return rewrite_training_onnx_model(proto, loss="loss", grads=GRADS, target="fp16")


def _params(model):
    return {n: p.detach().numpy().copy() for n, p in model.named_parameters()}


# -- the helper --------------------------------------------------------------------------------------------------
def test_training_graph_computes_loss_and_gradients(setup):
    model, proto = setup
    info = training_graph_info(proto)
    assert info["loss"] == "loss" and info["loss_grad"] == "loss_grad"
    assert [i.name for i in proto.graph.input] == ["l1.weight", "l1.bias", "l2.weight", "l2.bias", "input_0",
                                                   "target_0", "loss_grad"]
    assert [o.name for o in proto.graph.output] == ["loss"] + [f"grad.{n}" for n, _ in model.named_parameters()]
    assert proto.ir_version <= 10
    rng = np.random.default_rng(1)
    x = rng.standard_normal((BATCH, 8)).astype(np.float32)
    y = rng.standard_normal((BATCH, 1)).astype(np.float32)
    out = run_onnx(proto, {**_params(model), "input_0": x, "target_0": y, "loss_grad": np.array(2.0, np.float32)})
    ref = MLP()
    ref.load_state_dict(model.state_dict())
    loss = F.mse_loss(ref(torch.from_numpy(x)), torch.from_numpy(y))
    (2.0 * loss).backward()
    np.testing.assert_allclose(out["loss"], loss.item(), rtol=1e-5)
    for n, p in ref.named_parameters():  # gradients of loss_grad * loss
        np.testing.assert_allclose(out[f"grad.{n}"], p.grad.numpy(), rtol=1e-4, atol=1e-6)


# -- the rewrite -----------------------------------------------------------------------------------------------
def test_rewrite_adds_the_loss_scale_interface(setup, rewritten):
    _, proto = setup
    m = rewritten.model
    onnx.checker.check_model(m)
    assert m.ir_version <= 10
    inputs = {i.name: i.type.tensor_type.elem_type for i in m.graph.input}
    outputs = {o.name: o.type.tensor_type.elem_type for o in m.graph.output}
    F32, I64, BOOL = onnx.TensorProto.FLOAT, onnx.TensorProto.INT64, onnx.TensorProto.BOOL
    assert inputs == {**{i.name: F32 for i in proto.graph.input if i.name != "input_0"}, "input_0": F32,
                      LOSS_SCALE: F32, GROWTH_TRACKER: I64}
    grads = [o.name for o in proto.graph.output[1:]]
    assert outputs == {"loss": F32, **{g: F32 for g in grads}, SCALED_LOSS: F32, ALL_FINITE: BOOL,
                       NEXT_LOSS_SCALE: F32, NEXT_GROWTH_TRACKER: I64}
    for init in m.graph.initializer:  # master weights: nothing converted offline
        assert init.data_type != onnx.TensorProto.FLOAT16, init.name
    info = training_info(m)
    assert info["grads"] == grads and info["loss_grad"] == "loss_grad"
    assert info["config"]["growth_interval"] == 2000 and info["config"]["min_scale"] == 1.0
    # heavy math went FP16, the loss island stayed FP32
    tags = {n.name: {p.key: p.value for p in n.metadata_props} for n in m.graph.node}
    low = [n for n in m.graph.node if n.op_type in ("Gemm", "MatMul")
           and tags[n.name].get("amp_rewrite.precision") == "low"]
    assert len(low) >= 4
    loss_nodes = [n for n in m.graph.node if tags[n.name].get("amp_rewrite.source") == "training"]
    assert loss_nodes and all(tags[n.name]["amp_rewrite.precision"] == "fp32" for n in loss_nodes)
    assert {n.op_type for n in loss_nodes} >= {"Sub", "Pow", "ReduceMean"}
    assert any("loss scale dynamic" in note for note in rewritten.log.notes)


def _feeds(params, x, y, scale, tracker, seed=1.0):
    return {**params, "input_0": x, "target_0": y, "loss_grad": np.array(seed, np.float32),
            LOSS_SCALE: np.array(scale, np.float32), GROWTH_TRACKER: np.array(tracker, np.int64)}


def test_gradients_are_unscaled_and_match_fp32(setup, rewritten):
    model, proto = setup
    rng = np.random.default_rng(2)
    x = rng.standard_normal((BATCH, 8)).astype(np.float32)
    y = rng.standard_normal((BATCH, 1)).astype(np.float32)
    params = _params(model)
    ref = run_onnx(proto, {**params, "input_0": x, "target_0": y, "loss_grad": np.array(1.0, np.float32)})
    out = run_onnx(rewritten.model, _feeds(params, x, y, 1024.0, 5))
    np.testing.assert_allclose(out[SCALED_LOSS], 1024.0 * out["loss"], rtol=1e-6)
    np.testing.assert_allclose(out["loss"], ref["loss"], rtol=1e-2)
    for name in ref:
        if name.startswith("grad."):
            got, want = out[name].ravel(), ref[name].ravel()
            cos = float(got @ want / (np.linalg.norm(got) * np.linalg.norm(want)))
            assert cos > 0.999, (name, cos)
            np.testing.assert_allclose(got, want, rtol=0.05, atol=0.02 * np.abs(want).max())
    assert bool(out[ALL_FINITE]) is True
    assert float(out[NEXT_LOSS_SCALE]) == 1024.0 and int(out[NEXT_GROWTH_TRACKER]) == 6


# The in-graph update against LossScaler's rule, one child process for all cases.
_RUN_MANY = textwrap.dedent("""
    import json, sys
    import numpy as np, onnxruntime as ort
    model, cases, out = sys.argv[1:4]
    opts = ort.SessionOptions(); opts.log_severity_level = 3
    sess = ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"])
    data = np.load(cases)
    results = []
    for i in range(int(data["n"])):
        feeds = {k.split("/", 1)[1]: data[k] for k in data.files if k.startswith(f"{i}/")}
        r = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
        results.append({"all_finite": bool(r["all_finite"]), "next_loss_scale": float(r["next_loss_scale"]),
                        "next_growth_tracker": int(r["next_growth_tracker"])})
    json.dump(results, open(out, "w"))
""")


def _reference_update(scale, tracker, finite, *, growth=2.0, backoff=0.5, interval=2000, floor=1.0, ceiling=2.0 ** 24):
    if not finite:
        return max(scale * backoff, floor), 0
    tracker += 1
    if tracker >= interval:
        return min(scale * growth, ceiling), 0
    return scale, tracker


def test_in_graph_scale_update_has_loss_scaler_semantics(setup, tmp_path):
    model, proto = setup
    config = dict(growth_interval=3, min_scale=2.0, max_scale=2.0 ** 12)
    m = rewrite_training_onnx_model(proto, loss="loss", grads=GRADS, target="fp16", **config).model
    assert training_info(m)["config"]["max_scale"] == 2.0 ** 12
    rng = np.random.default_rng(3)
    x = (0.1 * rng.standard_normal((BATCH, 8))).astype(np.float32)
    y = (0.1 * rng.standard_normal((BATCH, 1))).astype(np.float32)
    params = _params(model)
    cases = [  # (scale, tracker, overflow)
        (64.0, 0, False), (64.0, 1, False), (64.0, 2, False),  # growth at the interval
        (2.0 ** 12, 2, False),  # the ceiling holds
        (2.0 ** 11, 2, False),  # growth up to the ceiling
        (64.0, 2, True), (2.0, 1, True), (3.0, 0, True),  # backoff, the floor holds
        (64.0, 7, False),  # a tracker past the interval (restored with another interval) grows at once
    ]
    arrays = {"n": np.array(len(cases))}
    for i, (scale, tracker, overflow) in enumerate(cases):
        seed = math.inf if overflow else 1.0  # an overflowing backward pass
        for k, v in _feeds(params, x, y, scale, tracker, seed).items():
            arrays[f"{i}/{k}"] = v
    np.savez(tmp_path / "cases.npz", **arrays)
    onnx.save(m, tmp_path / "m.onnx")
    (tmp_path / "run.py").write_text(_RUN_MANY)
    subprocess.run([sys.executable, str(tmp_path / "run.py"), str(tmp_path / "m.onnx"), str(tmp_path / "cases.npz"),
                    str(tmp_path / "out.json")], check=True, timeout=120)
    results = json.loads((tmp_path / "out.json").read_text())
    for (scale, tracker, overflow), r in zip(cases, results):
        assert r["all_finite"] is (not overflow)
        want = _reference_update(scale, tracker, not overflow, interval=3, floor=2.0, ceiling=2.0 ** 12)
        assert (r["next_loss_scale"], r["next_growth_tracker"]) == want, (scale, tracker, overflow)
    # and LossScaler computes the same rule
    from amp_rewrite.training import LossScaler, _OptState

    for (scale, tracker, overflow), r in zip(cases, results):
        s = LossScaler(init_scale=scale, growth_interval=3, min_scale=2.0, max_scale=2.0 ** 12)
        s._growth_tracker = tracker
        s._opt[0] = _OptState(stage="stepped", found_inf=torch.tensor(1.0 if overflow else 0.0))
        s.update()
        assert (s.get_scale(), s.growth_tracker) == (r["next_loss_scale"], r["next_growth_tracker"])


_SGD_LOOP = textwrap.dedent("""
    import json, sys
    import numpy as np, onnxruntime as ort
    fp32_path, amp_path, data_path, out_path = sys.argv[1:5]
    cfg = json.loads(sys.argv[5])
    opts = ort.SessionOptions(); opts.log_severity_level = 3
    fp32 = ort.InferenceSession(fp32_path, opts, providers=["CPUExecutionProvider"])
    amp = ort.InferenceSession(amp_path, opts, providers=["CPUExecutionProvider"])
    d = np.load(data_path)
    X, Y = d["X"], d["Y"]
    names = cfg["params"]
    init = {n: d["p/" + n] for n in names}
    B, lr, steps, inject = cfg["batch"], cfg["lr"], cfg["steps"], cfg["inject"]
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, len(X), B) for _ in range(steps)]
    one = np.array(1.0, np.float32)

    def run(sess, feeds):
        return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))

    def full_loss(p):  # FP32 evaluation over the whole set
        losses = [run(fp32, {**p, "input_0": X[i:i + B], "target_0": Y[i:i + B], "loss_grad": one})["loss"]
                  for i in range(0, len(X), B)]
        return float(np.mean(losses))

    result = {}
    for mode in ("fp32", "amp"):
        p = {n: v.copy() for n, v in init.items()}
        scale, tracker = np.array(cfg["init_scale"], np.float32), np.array(0, np.int64)
        log = {"loss": [], "all_finite": [], "scale": [], "changed": []}
        for step, idx in enumerate(batches):
            x, y = X[idx], Y[idx]
            if step == inject:
                if mode == "fp32":  # the reference skips that step too
                    log["changed"].append(False)
                    continue
                x = x.copy(); x[0, 0] = np.inf  # every gradient becomes inf/NaN
            if mode == "fp32":
                r = run(fp32, {**p, "input_0": x, "target_0": y, "loss_grad": one})
                finite = True
            else:
                r = run(amp, {**p, "input_0": x, "target_0": y, "loss_grad": one, "loss_scale": scale,
                              "growth_tracker": tracker})
                finite = bool(r["all_finite"])
                log["scale"].append(float(scale))
                scale, tracker = r["next_loss_scale"], r["next_growth_tracker"]
            log["all_finite"].append(finite)
            log["loss"].append(float(r["loss"]))
            if finite:
                for n in names:
                    p[n] = p[n] - lr * r["grad." + n]
            log["changed"].append(finite)
            if step == inject:
                log["inject_params_equal"] = all(np.array_equal(p[n], prev[n]) for n in names)
            prev = {n: v.copy() for n, v in p.items()}
        log["final_scale"] = float(scale)
        log["initial_full_loss"] = full_loss(init)
        log["final_full_loss"] = full_loss(p)
        result[mode] = log
    json.dump(result, open(out_path, "w"))
""")


def test_sgd_loop_in_onnxruntime_converges_like_fp32_and_skips_overflow(setup, tmp_path):
    """60 SGD steps of the FP16 training graph in onnxruntime, feeding back the in-graph next scale
    (growth every 10 finite steps up to a ceiling of 2**18), with an overflow injected at step 30.

    onnxruntime's CPU provider runs FP16 Gemm/MatMul in FP32 (it wraps them in casts and removes
    the cast pairs), so on CPU no overflow comes from FP16 itself: the injected one is an inf input."""
    model, proto = setup
    amp_model = rewrite_training_onnx_model(proto, loss="loss", grads=GRADS, target="fp16", growth_interval=10,
                                            max_scale=2.0 ** 18).model
    rng = np.random.default_rng(0)
    X = rng.standard_normal((256, 8)).astype(np.float32)
    w = rng.standard_normal((8, 1)).astype(np.float32)
    Y = (np.tanh(0.5 * X @ w) + 0.05 * rng.standard_normal((256, 1))).astype(np.float32)
    params = _params(model)
    np.savez(tmp_path / "data.npz", X=X, Y=Y, **{"p/" + n: v for n, v in params.items()})
    onnx.save(proto, tmp_path / "fp32.onnx")
    onnx.save(amp_model, tmp_path / "amp.onnx")
    (tmp_path / "loop.py").write_text(_SGD_LOOP)
    cfg = {"params": list(params), "batch": BATCH, "lr": 0.2, "steps": 60, "inject": 30, "init_scale": 2.0 ** 16}
    subprocess.run([sys.executable, str(tmp_path / "loop.py"), str(tmp_path / "fp32.onnx"), str(tmp_path / "amp.onnx"),
                    str(tmp_path / "data.npz"), str(tmp_path / "out.json"), json.dumps(cfg)], check=True, timeout=300)
    r = json.loads((tmp_path / "out.json").read_text())
    fp32, amp = r["fp32"], r["amp"]
    skipped = [i for i, f in enumerate(amp["all_finite"]) if not f]
    print(f"\nONNX SGD, 60 steps: full-set loss {fp32['initial_full_loss']:.4f} -> FP32 {fp32['final_full_loss']:.4f}, "
          f"FP16 {amp['final_full_loss']:.4f} ({(amp['final_full_loss'] / fp32['final_full_loss'] - 1):+.2%}); "
          f"skipped steps {skipped}; scale 2^16 -> {amp['final_scale']:g}")
    assert fp32["final_full_loss"] < 0.5 * fp32["initial_full_loss"]
    assert abs(amp["final_full_loss"] - fp32["final_full_loss"]) <= 0.05 * fp32["final_full_loss"]
    assert skipped == [30] and amp["inject_params_equal"]
    scale, tracker = 2.0 ** 16, 0
    for step, finite in enumerate(amp["all_finite"]):  # the fed-back trajectory follows LossScaler's rule
        assert amp["scale"][step] == scale, step
        scale, tracker = _reference_update(scale, tracker, finite, interval=10, ceiling=2.0 ** 18)
    assert amp["scale"][29] == 2.0 ** 18 and amp["scale"][31] == 2.0 ** 17  # ceiling, then backoff
    assert amp["final_scale"] == scale


# -- variants and errors -------------------------------------------------------------------------------------------
def test_forward_only_training_rewrite(setup):
    model, proto = setup
    # without --grads: only loss_scale and scaled_loss; the seed and the gradients are left alone,
    # and the summary says the gradients the graph computes are not scaled (it said nothing)
    result = rewrite_training_onnx_model(proto, loss="loss", target="fp16")
    m = result.model
    assert any("seed input 'loss_grad'" in n and "--grads names no gradient output" in n
               for n in result.report.summary_text().splitlines())
    assert not any("--grads names no" in n for n in rewrite_training_onnx_model(proto, loss="loss", grads=GRADS).log.notes)
    assert [i.name for i in m.graph.input][-1] == LOSS_SCALE
    assert [o.name for o in m.graph.output][-1] == SCALED_LOSS
    assert GROWTH_TRACKER not in {i.name for i in m.graph.input}
    rng = np.random.default_rng(4)
    feeds = {**_params(model), "input_0": rng.standard_normal((BATCH, 8)).astype(np.float32),
             "target_0": rng.standard_normal((BATCH, 1)).astype(np.float32), "loss_grad": np.array(1.0, np.float32),
             LOSS_SCALE: np.array(8.0, np.float32)}
    out = run_onnx(m, feeds)
    np.testing.assert_allclose(out[SCALED_LOSS], 8.0 * out["loss"], rtol=1e-6)


def test_bf16_training_rewrite_has_no_loss_scaling(setup):
    """Issue 6: BF16 needs no loss scaling. The bf16 training rewrite kept FP32 master weights and
    the FP32 loss island but added loss_scale/growth_tracker inputs and the scaled_loss/all_finite/
    next_* outputs as for fp16; now it adds none (its interface is the FP32 graph's), unless
    loss_scaling=True asks for them, and rewriting it again changes nothing."""
    _, proto = setup
    result = rewrite_training_onnx_model(proto, loss="loss", grads=GRADS, target="bf16")
    m = result.model
    onnx.checker.check_model(m, full_check=True)
    assert [(i.name, i.type.tensor_type.elem_type) for i in m.graph.input] == \
        [(i.name, i.type.tensor_type.elem_type) for i in proto.graph.input]  # FP32 weights fed, FP32 seed
    assert [(o.name, o.type.tensor_type.elem_type) for o in m.graph.output] == \
        [(o.name, o.type.tensor_type.elem_type) for o in proto.graph.output]  # FP32 loss and gradients
    assert any(n.op_type == "Cast" and n.attribute[0].i == onnx.TensorProto.BFLOAT16 for n in m.graph.node)
    assert not any(n.op_type in ("IsInf", "IsNaN", "Reciprocal") for n in m.graph.node)
    assert training_info(m) == {"loss": "loss", "loss_scaling": False, "grads": [o.name for o in proto.graph.output[1:]]}
    assert any("no loss scaling (bf16 keeps FP32's exponent range" in n for n in result.log.notes)
    again = rewrite_training_onnx_model(m, loss="loss", grads=GRADS, target="bf16")
    assert not again.modified and again.model.SerializeToString() == m.SerializeToString()
    scaled = rewrite_training_onnx_model(proto, loss="loss", grads=GRADS, target="bf16", loss_scaling=True).model
    onnx.checker.check_model(scaled)
    assert {o.name for o in scaled.graph.output} >= {SCALED_LOSS, ALL_FINITE, NEXT_LOSS_SCALE, NEXT_GROWTH_TRACKER}
    assert training_info(scaled)["loss_scale"] == LOSS_SCALE
    with pytest.raises(UsageError, match="rewritten for training with loss scaling already"):
        rewrite_training_onnx_model(scaled, loss="loss", grads=GRADS, target="bf16", loss_scaling=False)
    with pytest.raises(UsageError, match=r"loss_grad='loss_grad': .*scales nothing"):
        rewrite_training_onnx_model(proto, loss="loss", grads=GRADS, target="bf16", loss_grad="loss_grad")
    with pytest.raises(UsageError, match="loss_scaling applies to a training graph"):
        amp_rewrite_rewrite(proto, loss_scaling=False)


def test_a_users_pin_inside_the_loss_island_survives_rewriting_the_output_again(setup):
    """A --fp32-ops pin on an op of the loss island (the last Gemm, which then joins the island)
    was tagged as the training rewrite's own pin: rewriting the output again made that Gemm low."""
    _, proto = setup
    first = rewrite_training_onnx_model(proto, loss="loss", grads=GRADS, target="bf16", fp32_ops=["Gemm"])

    def gemms(model):
        tags = [{p.key: p.value for p in n.metadata_props} for n in model.graph.node if n.op_type == "Gemm"]
        return {(t.get("amp_rewrite.precision"), t.get("amp_rewrite.source")) for t in tags}

    assert gemms(first.model) == {("fp32", "--fp32-ops")}
    again = rewrite_training_onnx_model(first.model, loss="loss", grads=GRADS, target="bf16")
    assert not again.modified and again.model.SerializeToString() == first.model.SerializeToString()


def test_a_pin_naming_another_node_exactly_is_not_credited_to_a_loss_island_node(setup):
    """A --fp32-nodes pattern that is one node's exact name names that node only (rules/README.md),
    as classify matches it; the training relabelling read it as a glob and credited the pin for
    the loss-island node it also matched ('/S[u]b' for '/Sub'), in the report and the tags."""
    _, proto = setup
    plain = rewrite_training_onnx_model(proto, loss="loss", grads=GRADS, target="fp16")
    tags = {n.name: {p.key: p.value for p in n.metadata_props} for n in plain.model.graph.node}
    island = next(n.name for n in proto.graph.node
                  if tags.get(n.name, {}).get("amp_rewrite.source") == "training" and len(n.name) > 2)
    other = next(n for n in proto.graph.node
                 if n.name and tags.get(n.name, {}).get("amp_rewrite.source") != "training")
    glob = f"{island[:1]}[{island[1]}]{island[2:]}"  # names `island` as a glob, `other` exactly
    renamed = onnx.ModelProto()
    renamed.CopyFrom(proto)
    next(n for n in renamed.graph.node if n.name == other.name).name = glob
    result = rewrite_training_onnx_model(renamed, loss="loss", grads=GRADS, target="fp16", fp32_nodes=[glob])
    sources = {n.name: {p.key: p.value for p in n.metadata_props}.get("amp_rewrite.source")
               for n in result.model.graph.node}
    assert sources[island] == "training"
    assert sources[glob] == "--fp32-nodes"


def test_every_in_memory_entry_point_takes_the_training_options(setup):
    """api.rewrite_onnx_model (what --auto-fp32 and the checks call) took training=True, loss=...
    as an inference rewrite with FP32 weights and no loss scale, and refused grads=; it now does
    what rewrite() does."""
    from amp_rewrite.api import rewrite_onnx_model

    _, proto = setup
    direct = rewrite_onnx_model(proto, training=True, loss="loss", grads=GRADS).model
    via_rewrite = amp_rewrite_rewrite(proto, training=True, loss="loss", grads=GRADS)
    assert LOSS_SCALE in {i.name for i in direct.graph.input}
    assert direct.SerializeToString() == via_rewrite.SerializeToString()


def test_fp16_training_without_loss_scaling_runs_and_matches_fp32(setup):
    """loss_scaling=False takes the scale off fp16 (the user's choice; the note says what it risks):
    the FP32 interface, and gradients close to FP32's on onnxruntime."""
    model, proto = setup
    result = rewrite_training_onnx_model(proto, loss="loss", grads=GRADS, target="fp16", loss_scaling=False)
    m = result.model
    onnx.checker.check_model(m, full_check=True)
    assert [i.name for i in m.graph.input] == [i.name for i in proto.graph.input]
    assert any("no loss scaling (turned off: fp16 gradients below 6e-8 flush to zero)" in n for n in result.log.notes)
    rng = np.random.default_rng(3)
    feeds = {**_params(model), "input_0": rng.standard_normal((BATCH, 8)).astype(np.float32),
             "target_0": rng.standard_normal((BATCH, 1)).astype(np.float32), "loss_grad": np.array(1.0, np.float32)}
    ref, out = run_onnx(proto, feeds), run_onnx(m, feeds)
    assert set(out) == set(ref)
    for name, want in ref.items():
        np.testing.assert_allclose(out[name], want, rtol=0.05, atol=0.02 * np.abs(want).max())


def test_errors(setup):
    _, proto = setup
    with pytest.raises(UsageError, match="no graph output"):
        rewrite_training_onnx_model(proto, loss="nope")
    with pytest.raises(UsageError, match="matches no graph output"):
        rewrite_training_onnx_model(proto, loss="loss", grads="nothing*")
    with pytest.raises(UsageError, match="keeps graph inputs and outputs FP32"):
        rewrite_training_onnx_model(proto, loss="loss", keep_io_types=False)
    # a gradient graph whose backward seed was folded away cannot be loss-scaled
    seedless = onnx.ModelProto()
    seedless.CopyFrom(proto)
    del seedless.metadata_props[:]
    seed = next(i for i in seedless.graph.input if i.name == "loss_grad")
    seedless.graph.input.remove(seed)
    seedless.graph.initializer.append(onnx.numpy_helper.from_array(np.array(1.0, np.float32), "loss_grad"))
    with pytest.raises(UsageError, match="no input seeding the backward pass"):
        rewrite_training_onnx_model(seedless, loss="loss", grads=GRADS)
    # ... unless the seed input is named
    renamed = onnx.ModelProto()
    renamed.CopyFrom(proto)
    del renamed.metadata_props[:]
    assert training_info(rewrite_training_onnx_model(renamed, loss="loss", grads=GRADS,
                                                     loss_grad="loss_grad").model)["loss_grad"] == "loss_grad"
    twice = rewrite_training_onnx_model(proto, loss="loss", grads=GRADS).model
    with pytest.raises(UsageError, match="already"):
        rewrite_training_onnx_model(twice, loss="loss", grads=GRADS)


@pytest.mark.parametrize("first, then", [("bf16", "fp16"), ("fp16", "bf16")])
def test_a_training_graph_rewritten_to_the_other_low_type_is_refused(setup, first, then):
    """As an inference rewrite refuses it: a bf16 training graph given fp16 loss scaling kept its
    bf16 casts and said 'fp16' in its metadata."""
    _, proto = setup
    once = rewrite_training_onnx_model(proto, loss="loss", grads=GRADS, target=first, loss_scaling=False).model
    with pytest.raises(UsageError, match=f"rewritten to {first} already"):
        rewrite_training_onnx_model(once, loss="loss", grads=GRADS, target=then)


def test_training_options_are_checked(setup):
    """training="yes" with loss/grads, dynamic="no" (built the dynamic update), growth_interval=2.7
    (recorded 2.7, built 2), growth_factor="2" and grads=3 (raw TypeErrors), growth_interval=2**63
    (an OverflowError making the int64 counter's constant), and a loss_grad that
    is a data input (the forward pass ran on x × scale) are usage errors, as is growth_interval=0, and a
    growth or backoff factor that FP32 rounds to 1 is refused for that reason."""
    import amp_rewrite

    _, proto = setup
    for bad, match in (({"training": "yes"}, "training='yes': pass True or False"),
                       ({"dynamic": "no"}, "dynamic='no': pass True or False"),
                       ({"growth_interval": 2.7}, "growth_interval=2.7: pass a whole number"),
                       ({"growth_interval": 0}, "growth_interval=0: must be >= 1"),
                       ({"growth_interval": 2 ** 63}, r"growth_interval=9223372036854775808: must be at most 2\*\*63 - 1"),
                       ({"growth_factor": "2"}, "growth_factor='2': pass a number"),
                       ({"min_scale": 1e-46}, "min_scale=1e-46: the model holds it as an FP32 constant, where it is 0"),
                       ({"max_scale": 1e39}, "max_scale=1e.39: the model holds it as an FP32 constant, where it is inf"),
                       ({"growth_factor": 1.00000001}, r"growth_factor=1.00000001: must be > 1 as the model stores it.* rounds to 1;"),
                       ({"backoff_factor": 0.99999999}, r"backoff_factor=0.99999999: must be < 1 as the model stores it.* rounds to 1;"),
                       ({"grads": 3}, "grads=3: pass glob patterns"),
                       ({"loss_grad": "input_0"}, "loss_grad='input_0': the seed of the backward pass .* FP32 input of one element")):
        options = {"training": True, "loss": "loss", "grads": GRADS, **bad}
        with pytest.raises(UsageError, match=match):
            amp_rewrite.rewrite(proto, **options)
    assert training_info(amp_rewrite.rewrite(proto, training=True, loss="loss", grads=GRADS,
                                             growth_interval=np.int64(3)))["config"]["growth_interval"] == 3
    # grads or loss_grad without loss: they were 'unknown options', in a list that left them out
    for options in ({"training": True, "grads": GRADS}, {"grads": GRADS}, {"training": True, "loss_grad": "loss_grad"}):
        key = "grads" if "grads" in options else "loss_grad"
        with pytest.raises(UsageError, match=f"{key} applies to a training graph: pass training=True and loss="):
            amp_rewrite.rewrite(proto, **options)
    # loss_grad without grads: it was told to pass loss_scaling=True, which was on (and changed nothing)
    for scaling in ({}, {"loss_scaling": True}):
        with pytest.raises(UsageError, match="no gradient output is named to unscale: pass grads="):
            amp_rewrite.rewrite(proto, training=True, loss="loss", loss_grad="loss_grad", **scaling)


def test_a_failed_training_check_suggests_what_applies_and_its_report_names_no_removed_file(tmp_path):
    """The hint said "try --auto-fp32", which --training refuses; the report of the failed check
    named the output file it had just removed."""
    from onnx import helper as h

    from amp_rewrite.cli import main

    T = onnx.TensorProto
    rng = np.random.default_rng(0)
    w = onnx.numpy_helper.from_array((rng.standard_normal((8, 8)) * 0.1).astype(np.float32), "W")
    graph = h.make_graph([h.make_node("MatMul", ["x", "W"], ["y"], name="mm"),
                          h.make_node("ReduceMean", ["y"], ["loss"], keepdims=0),
                          h.make_node("Expand", ["loss_grad", "shp"], ["dy"]), h.make_node("Transpose", ["x"], ["xT"]),
                          h.make_node("MatMul", ["xT", "dy"], ["grad.W"], name="bmm")], "g",
                         [h.make_tensor_value_info("x", T.FLOAT, [4, 8]), h.make_tensor_value_info("loss_grad", T.FLOAT, [])],
                         [h.make_tensor_value_info("loss", T.FLOAT, []), h.make_tensor_value_info("grad.W", T.FLOAT, [8, 8])],
                         [w, onnx.numpy_helper.from_array(np.array([4, 8], np.int64), "shp")])
    onnx.save(h.make_model(graph, opset_imports=[h.make_opsetid("", 17)], ir_version=8), tmp_path / "m.onnx")
    np.savez(tmp_path / "in.npz", x=(rng.standard_normal((4, 8)) * 3e4).astype(np.float32),
             loss_grad=np.array(1, np.float32))
    out, report = tmp_path / "out.onnx", tmp_path / "r.json"
    rc = main([str(tmp_path / "m.onnx"), "--training", "--loss", "loss", "--grads", GRADS, "--check", "--inputs",
               str(tmp_path / "in.npz"), "-o", str(out), "--report", str(report), "-q"])
    assert rc == 8 and not out.exists()
    written = json.loads(report.read_text())
    assert written["output"] is None and written["check"]["passed"] is False


def test_the_check_runs_a_training_model_at_a_scale_a_division_error_shows_at():
    """--check fed loss_scale 1, where a gradient left scaled (or divided twice) is right: the
    in-graph clip bug passed it. It runs at 1024 now; where the gradients overflow there (a
    skipped step in training), at 1."""
    from amp_rewrite.check import check_models

    model = _hand_graph()
    good = rewrite_training_onnx_model(model, loss="loss", grads=GRADS).model
    assert check_models(model, good).passed
    broken = onnx.ModelProto()
    broken.CopyFrom(good)
    unscale = next(n for n in broken.graph.node if list(n.output) == ["grad.W"])
    unscale.op_type, unscale.input[:] = "Identity", unscale.input[:1]  # (the gradient leaves scaled)
    result = check_models(model, broken, localise=False)
    assert not result.passed and not next(o for o in result.outputs if o.name == "grad.W").passed
    huge = {"x": np.full((2, 4), 300.0, np.float32), "loss_grad": np.array(1.0, np.float32)}  # x 1024: inf
    assert check_models(model, good, inputs=huge).passed


def test_cli_training(setup, tmp_path):
    from amp_rewrite.cli import main

    _, proto = setup
    src = tmp_path / "train.onnx"
    onnx.save(proto, src)
    dst = tmp_path / "train.fp16.onnx"
    # --check runs both models (the rewritten one at loss_scale 1024) and compares loss and gradients
    rc = main([str(src), "-o", str(dst), "--training", "--loss", "loss", "--grads", GRADS, "--check", "-q"])
    assert rc == 0 and dst.exists()
    m = onnx.load(dst)
    assert training_info(m)["grads"] == [o.name for o in proto.graph.output[1:]]
    assert main([str(src), "-o", str(tmp_path / "x.onnx"), "--training", "-q"]) == 2  # --loss missing
    # the API writes the same thing
    result = rewrite_training_onnx(src, tmp_path / "api.onnx", loss="loss", grads=GRADS)
    assert result.outputs == [tmp_path / "api.onnx"]
    assert [o.name for o in onnx.load(tmp_path / "api.onnx").graph.output] == [o.name for o in m.graph.output]


# -- hand-built training graphs: what the rewrite refuses and what it passes through -------------------------
def _hand_graph(*, loss_shape=(), grad_type=onnx.TensorProto.FLOAT, seed_read=True, constant_grad=False):
    """loss = ReduceSum(x @ W) (shaped ``loss_shape``), grad.W = x^T @ broadcast(seed): a minimal
    forward+backward graph; ``constant_grad`` adds an unused parameter's zero gradient, folded into
    an initializer that is also a graph output (what the dynamo exporter writes)."""
    from onnx import helper as h

    T = onnx.TensorProto
    W = onnx.numpy_helper.from_array(np.ones((4, 4), np.float32), "W")
    nodes = [h.make_node("MatMul", ["x", "W"], ["y"]), h.make_node("ReduceSum", ["y"], ["total"], keepdims=0),
             h.make_node("Reshape", ["total", "loss_shape"], ["loss"]), h.make_node("Shape", ["y"], ["ys"])]
    if seed_read:
        nodes.append(h.make_node("Expand", ["loss_grad", "ys"], ["gy"]))
    else:
        nodes.append(h.make_node("ConstantOfShape", ["ys"], ["gy"],
                                 value=onnx.numpy_helper.from_array(np.array([1.0], np.float32))))
    nodes.append(h.make_node("Gemm", ["x", "gy"], ["gW"], transA=1))
    nodes.append(h.make_node("Cast", ["gW"], ["grad.W"], to=grad_type))
    inits = [W, onnx.numpy_helper.from_array(np.array(loss_shape, np.int64), "loss_shape")]
    outputs = [h.make_tensor_value_info("loss", T.FLOAT, list(loss_shape)),
               h.make_tensor_value_info("grad.W", grad_type, [4, 4])]
    if constant_grad:
        inits.append(onnx.numpy_helper.from_array(np.zeros((3,), np.float32), "grad.unused"))
        outputs.append(h.make_tensor_value_info("grad.unused", T.FLOAT, [3]))
    graph = h.make_graph(nodes, "g", [h.make_tensor_value_info("x", T.FLOAT, [2, 4]),
                                      h.make_tensor_value_info("loss_grad", T.FLOAT, [])], outputs, initializer=inits)
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)], ir_version=10)
    onnx.checker.check_model(model, full_check=True)
    return model


def _grad_w(path, scale=1024.0):
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    feeds = {"x": x, "loss_grad": np.array(1.0, np.float32), LOSS_SCALE: np.array(scale, np.float32),
             GROWTH_TRACKER: np.array(0, np.int64)}
    return run_onnx(path, feeds), x.T @ np.ones((2, 4), np.float32)


def test_a_cast_in_the_loss_tail_is_not_pinned_and_no_flag_is_said_to_be_without_effect():
    """The loss leaves through the model's own no-op ``Cast(to=FLOAT)``: the loss island pins the
    ReduceSum and the Reshape (two nodes), not the Cast (cast placement decides Casts), and no note
    says an --fp32-nodes the user never passed is without effect."""
    m = _hand_graph()
    for node in m.graph.node:
        if node.op_type == "Reshape":
            node.input[0] = "total32"
    m.graph.node.insert(2, onnx.helper.make_node("Cast", ["total"], ["total32"], to=onnx.TensorProto.FLOAT, name="lc"))
    result = rewrite_training_onnx_model(m, loss="loss", grads=GRADS, target="fp16")
    notes = result.log.notes
    assert not [n for n in notes if "without effect" in n], notes
    assert any("kept FP32 with 2 node(s) of its island pinned FP32" in n for n in notes), notes
    training = sorted(d.node for d in result.log.decisions.values() if d.source == "training")
    assert training == ["amp_loss/ReduceSum", "amp_loss/Reshape"]


def test_hand_built_graph_unscales_exactly(tmp_path):
    """The baseline the cases below vary: the seed is read, the gradient comes out exact."""
    out = rewrite_training_onnx_model(_hand_graph(), loss="loss", grads=GRADS, target="fp16").model
    onnx.checker.check_model(out, full_check=True)
    onnx.save(out, tmp_path / "t.onnx")
    got, want = _grad_w(tmp_path / "t.onnx")
    np.testing.assert_allclose(got["grad.W"], want, rtol=1e-2)
    assert bool(got[ALL_FINITE])


def _with_gradient_readers(model, *outputs):
    """The hand graph plus nodes reading grad.W inside the graph: an SGD step (affine in the
    gradient), its squared norm (quadratic) and, as given, more outputs."""
    from onnx import helper as h

    T = onnx.TensorProto
    g = model.graph
    g.initializer.append(onnx.numpy_helper.from_array(np.array(0.1, np.float32), "lr"))
    g.node.extend([h.make_node("Mul", ["grad.W", "lr"], ["step"]), h.make_node("Sub", ["W", "step"], ["new_W"]),
                   h.make_node("ReduceSumSquare", ["grad.W"], ["grad_norm_sq"], keepdims=0)])
    g.output.extend([h.make_tensor_value_info("new_W", T.FLOAT, [4, 4]),
                     h.make_tensor_value_info("grad_norm_sq", T.FLOAT, [])])
    for name in outputs:
        g.output.append(h.make_tensor_value_info(name, T.FLOAT, None))
    return model


def test_nodes_reading_a_gradient_in_the_graph_read_it_unscaled(tmp_path):
    """Only the gradient output was rewired to the unscaled value: an in-graph SGD step and a
    gradient norm read the scaled gradient (new_W off by 1024x lr, the norm by 1024²). The step
    itself, proportional to the gradient, is an output too: read scaled, it was refused as a
    backward-pass output --grads does not name (mutation testing found it unchecked). The summary
    names them, as it names nodes divided before a clip (it named only those)."""
    model = _with_gradient_readers(_hand_graph(), "step")
    result = rewrite_training_onnx_model(model, loss="loss", grads=GRADS, target="fp16")
    [note] = [n for n in result.log.notes if "divided by the loss scale" in n]
    assert note.endswith("2 node(s) read the gradients divided by the loss scale, so that what they compute does "
                         "not carry it (a norm, a clip, a sum with a weight, a value leaving the graph): 'Mul:step', "
                         "'ReduceSumSquare:grad_norm_sq'"), note
    out = result.model
    onnx.checker.check_model(out, full_check=True)
    onnx.save(out, tmp_path / "t.onnx")
    got, want = _grad_w(tmp_path / "t.onnx")
    np.testing.assert_allclose(got["grad.W"], want, rtol=1e-2)
    np.testing.assert_allclose(got["new_W"], 1.0 - 0.1 * want, rtol=1e-2)
    np.testing.assert_allclose(got["step"], 0.1 * want, rtol=1e-2)
    np.testing.assert_allclose(got["grad_norm_sq"], float((want ** 2).sum()), rtol=1e-2)


def _clipped(model, max_norm, squares="ReduceSumSquare"):
    """The hand graph with its gradient clipped in the graph to a global norm (what a training
    step exported with clip_grad_norm_ computes): grad.W = g * min(1, max_norm / ||g||), and the
    norm as an output too."""
    from onnx import helper as h

    T = onnx.TensorProto
    g = model.graph
    for node in g.node:
        node.output[:] = ["raw" if o == "grad.W" else o for o in node.output]
    g.initializer.extend([onnx.numpy_helper.from_array(np.array(max_norm, np.float32), "max_norm"),
                          onnx.numpy_helper.from_array(np.array(1.0, np.float32), "one")])
    if squares == "ReduceSumSquare":
        g.node.append(h.make_node("ReduceSumSquare", ["raw"], ["sq"], keepdims=0))
    else:  # (the dot product of the Gemm's own output with itself, low: it reads the gradient in FP16)
        g.initializer.append(onnx.numpy_helper.from_array(np.array([-1], np.int64), "flat"))
        g.node.extend([h.make_node("Reshape", ["gW", "flat"], ["gflat"]), h.make_node("MatMul", ["gflat", "gflat"], ["sq"])])
    g.node.extend([h.make_node("Sqrt", ["sq"], ["norm"]),
                   h.make_node("Div", ["max_norm", "norm"], ["ratio"]), h.make_node("Min", ["ratio", "one"], ["coef"]),
                   h.make_node("Mul", ["raw", "coef"], ["grad.W"])])
    g.output.append(h.make_tensor_value_info("norm", T.FLOAT, []))
    return model


@pytest.mark.parametrize("squares", ["ReduceSumSquare", "MatMul"])
def test_gradients_clipped_in_the_graph_are_divided_before_the_clip(tmp_path, squares):
    """The clip's norm was taken over the scaled gradients: its coefficient came out 1/scale of
    the truth, and the gradient, divided by the scale once more, 65536x too small, with
    all_finite true. The gradient is divided by the scale before the norm now (in FP32, where the
    square reads it in FP16)."""
    out = rewrite_training_onnx_model(_clipped(_hand_graph(), 5.0, squares), loss="loss", grads=GRADS, target="fp16")
    onnx.checker.check_model(out.model, full_check=True)
    assert any("divided by the loss scale" in note and squares in note for note in out.log.notes)
    divided = [n for n in out.model.graph.node if "not proportional" in
               dict((p.key, p.value) for p in n.metadata_props).get("amp_rewrite.reason", "")]
    # (the FP32 gradient the graph casts to already is the one divided; the low Reshape's output is
    # divided in FP32 between two Casts)
    assert [n.op_type for n in divided] == (["Mul"] if squares == "ReduceSumSquare" else ["Cast", "Mul", "Cast"])
    onnx.save(out.model, tmp_path / "t.onnx")
    for scale in (1.0, 1024.0):  # (x 4096 the gradient overflows FP16: a skipped step)
        got, raw = _grad_w(tmp_path / "t.onnx", scale)
        norm = float(np.sqrt((raw ** 2).sum()))
        np.testing.assert_allclose(got["grad.W"], raw * min(1.0, 5.0 / norm), rtol=1e-2)
        np.testing.assert_allclose(got["norm"], norm, rtol=1e-2)
        assert bool(got[ALL_FINITE])


def _post_processed(kind):
    """The hand graph's gradient ``raw`` post-processed in the graph into outputs: MaxPool's int64
    indices picking values again, a PRelu whose slope is the gradient, a clip by value."""
    from onnx import helper as h

    T = onnx.TensorProto
    model = _hand_graph()
    g = model.graph
    for node in g.node:
        node.output[:] = ["raw" if o == "grad.W" else o for o in node.output]
    const = lambda name, value, dtype=np.float32: g.initializer.append(  # noqa: E731
        onnx.numpy_helper.from_array(np.array(value, dtype), name))
    if kind == "maxpool indices":
        const("s4", [1, 1, 4, 4], np.int64)
        const("flat", [-1], np.int64)
        g.node.extend([h.make_node("Reshape", ["raw", "s4"], ["g4"]),
                       h.make_node("MaxPool", ["g4"], ["pooled", "idx"], kernel_shape=[2, 2], strides=[2, 2]),
                       h.make_node("Reshape", ["idx", "flat"], ["idxf"]), h.make_node("Reshape", ["raw", "flat"], ["gf"]),
                       h.make_node("Gather", ["gf", "idxf"], ["grad.picked"]), h.make_node("Identity", ["raw"], ["grad.W"])])
        g.output.append(h.make_tensor_value_info("grad.picked", T.FLOAT, [4]))
    elif kind == "prelu slope":
        const("xs", np.linspace(-1, 1, 16).reshape(4, 4))
        g.node.append(h.make_node("PRelu", ["xs", "raw"], ["grad.W"]))
    else:  # clip by value
        const("lo", -0.01)
        const("hi", 0.01)
        g.node.append(h.make_node("Clip", ["raw", "lo", "hi"], ["grad.W"]))
    onnx.checker.check_model(model, full_check=True)
    return model


@pytest.mark.parametrize("kind", ["maxpool indices", "prelu slope", "clip"])
def test_post_processed_gradients_come_out_as_in_fp32_at_any_scale(tmp_path, kind):
    """MaxPool's int64 indices were given the gradient's degree and 'divided' (Mul of int64 by a
    float: the checker and onnxruntime refused the model); PRelu counted as a product, though a
    gradient as its slope is not proportional (every output 1024x off at scale 1024)."""
    model = _post_processed(kind)
    out = rewrite_training_onnx_model(model, loss="loss", grads=GRADS).model
    onnx.checker.check_model(out, full_check=True)
    onnx.save(out, tmp_path / "t.onnx")
    x = np.arange(8, dtype=np.float32).reshape(2, 4) / 8
    want = run_onnx(model, {"x": x, "loss_grad": np.array(1.0, np.float32)})
    for scale in (1.0, 1024.0):
        got = run_onnx(tmp_path / "t.onnx", {"x": x, "loss_grad": np.array(1.0, np.float32),
                                             LOSS_SCALE: np.array(scale, np.float32), GROWTH_TRACKER: np.array(0, np.int64)})
        for name in want:
            if name.startswith("grad."):
                np.testing.assert_allclose(got[name], want[name], rtol=1e-2, atol=1e-3, err_msg=f"{name} x{scale}")
        assert bool(got[ALL_FINITE])


def _transformed(kind):
    """The hand graph's gradient ``raw`` transformed in the graph into grad.W, not in proportion to
    the loss scale: divided by its own largest magnitude (degree 0), its square root (degree 1/2),
    its square, a mask of the entries past a threshold, a truncation to integers and back, and a
    Gemm adding a constant bias to a product with it."""
    from onnx import helper as h

    T = onnx.TensorProto
    model = _hand_graph()
    g = model.graph
    for node in g.node:
        node.output[:] = ["raw" if o == "grad.W" else o for o in node.output]
    const = lambda name, value: g.initializer.append(  # noqa: E731
        onnx.numpy_helper.from_array(np.array(value, np.float32), name))
    if kind == "max-normalised":
        g.node.extend([h.make_node("Abs", ["raw"], ["mag"]), h.make_node("ReduceMax", ["mag"], ["top"]),
                       h.make_node("Div", ["raw", "top"], ["grad.W"])])
    elif kind == "square root":
        g.node.extend([h.make_node("Abs", ["raw"], ["mag"]), h.make_node("Sqrt", ["mag"], ["grad.W"])])
    elif kind == "square":
        const("two", 2.0)
        g.node.append(h.make_node("Pow", ["raw", "two"], ["grad.W"]))
    elif kind == "threshold":
        const("cut", 0.8)
        const("zero", 0.0)
        g.node.extend([h.make_node("Greater", ["raw", "cut"], ["big"]),
                       h.make_node("Where", ["big", "raw", "zero"], ["grad.W"])])
    elif kind == "integer part":
        g.node.extend([h.make_node("Cast", ["raw"], ["whole"], to=T.INT32),
                       h.make_node("Cast", ["whole"], ["grad.W"], to=T.FLOAT)])
    else:  # gemm bias
        const("xs", np.linspace(-1, 1, 16).reshape(4, 4))
        const("bias", np.ones((4, 4)))
        g.node.append(h.make_node("Gemm", ["xs", "raw", "bias"], ["grad.W"]))
    onnx.checker.check_model(model, full_check=True)
    return model


@pytest.mark.parametrize("kind", ["max-normalised", "square root", "square", "threshold", "integer part", "gemm bias"])
def test_a_gradient_transformed_out_of_proportion_to_the_scale_comes_out_as_in_fp32(tmp_path, kind):
    """A node whose output is not the scale times its value at scale 1 (a ratio of two scaled
    values, a root, a power, a comparison with a constant, a cast to an integer, a sum of a scaled
    product and a constant bias) reads the gradient divided by the scale, and what it computes
    comes out as the FP32 model computes it, at any scale."""
    model = _transformed(kind)
    out = rewrite_training_onnx_model(model, loss="loss", grads=GRADS).model
    onnx.checker.check_model(out, full_check=True)
    onnx.save(out, tmp_path / "t.onnx")
    x = np.arange(8, dtype=np.float32).reshape(2, 4) / 8
    want = run_onnx(model, {"x": x, "loss_grad": np.array(1.0, np.float32)})["grad.W"]
    for scale in (1.0, 1024.0):
        got = run_onnx(tmp_path / "t.onnx", {"x": x, "loss_grad": np.array(1.0, np.float32),
                                             LOSS_SCALE: np.array(scale, np.float32), GROWTH_TRACKER: np.array(0, np.int64)})
        np.testing.assert_allclose(got["grad.W"], want, rtol=1e-2, atol=1e-3, err_msg=f"x{scale}")
        assert bool(got[ALL_FINITE])


def test_a_power_whose_exponent_a_caller_may_feed_reads_the_gradient_divided_by_the_scale(tmp_path):
    """An exponent stored as an initializer that is also a graph input may be fed another value
    at run time: the power is not taken as proportional to the scale for its stored value, and
    with the exponent fed as 2 the output is the FP32 model's at any scale."""
    from onnx import helper as h

    model = _hand_graph()
    g = model.graph
    for node in g.node:
        node.output[:] = ["raw" if o == "grad.W" else o for o in node.output]
    g.initializer.append(onnx.numpy_helper.from_array(np.array(1.0, np.float32), "p"))
    g.input.append(h.make_tensor_value_info("p", onnx.TensorProto.FLOAT, []))
    g.node.append(h.make_node("Pow", ["raw", "p"], ["grad.W"]))
    onnx.checker.check_model(model, full_check=True)
    out = rewrite_training_onnx_model(model, loss="loss", grads=GRADS).model
    onnx.save(out, tmp_path / "t.onnx")
    x = np.arange(8, dtype=np.float32).reshape(2, 4) / 8
    feeds = {"x": x, "loss_grad": np.array(1.0, np.float32), "p": np.array(2.0, np.float32)}
    want = run_onnx(model, feeds)["grad.W"]
    for scale in (1.0, 1024.0):
        got = run_onnx(tmp_path / "t.onnx", {**feeds, LOSS_SCALE: np.array(scale, np.float32),
                                             GROWTH_TRACKER: np.array(0, np.int64)})
        np.testing.assert_allclose(got["grad.W"], want, rtol=1e-2, atol=1e-3, err_msg=f"x{scale}")


def test_a_clip_after_the_division_does_not_hide_an_overflow():
    """Clip(inf) is the bound: a backward pass that overflowed in FP16 came out clipped and
    finite, all_finite said True and the scale never backed off. The values divided before the
    clip are checked too."""
    out = rewrite_training_onnx_model(_post_processed("clip"), loss="loss", grads=GRADS).model
    x = np.full((2, 4), 7.0, np.float32)  # gradient 14: x 65536 is past FP16's 65504
    feeds = {"x": x, "loss_grad": np.array(1.0, np.float32), GROWTH_TRACKER: np.array(0, np.int64)}
    assert bool(run_onnx(out, {**feeds, LOSS_SCALE: np.array(1024.0, np.float32)})[ALL_FINITE])
    overflowed = run_onnx(out, {**feeds, LOSS_SCALE: np.array(65536.0, np.float32)})
    assert not bool(overflowed[ALL_FINITE]) and float(overflowed[NEXT_LOSS_SCALE]) == 32768.0


def test_the_report_of_gradients_divided_before_a_clip_tells_what_the_model_holds():
    """The summary said every gradient output was unscaled under its own name where none was;
    the Casts a division for a low reader adds were in no count; the model's own report lost the
    note on the division."""
    from amp_rewrite.report import Report

    clipped = rewrite_training_onnx_model(_post_processed("clip"), loss="loss", grads=GRADS)
    seed_note = next(n for n in clipped.log.notes if n.startswith("training: backward seed"))
    assert "0 gradient output(s) unscaled in FP32 under their own names, 1 computed from gradients divided before " \
           "(left as computed: 'grad.W')" in seed_note
    result = rewrite_training_onnx_model(_clipped(_hand_graph(), 5.0, "MatMul"), loss="loss", grads=GRADS)
    ours = [n.name for n in result.model.graph.node if n.op_type == "Cast"
            and dict((p.key, p.value) for p in n.metadata_props).get("amp_rewrite.inserted")]  # (not the model's own)
    assert sorted(c.name for c in result.log.casts if c.kind == "inserted") == sorted(ours)
    assert any("divided by the loss scale" in c.reason for c in result.log.casts)
    rebuilt = Report.from_model(result.model)
    assert rebuilt.log.notes == result.log.notes
    assert [c.name for c in rebuilt.log.casts if c.kind == "inserted"] == \
        [c.name for c in result.log.casts if c.kind == "inserted"]


def test_a_backward_pass_proportional_to_its_seed_is_divided_only_at_its_outputs():
    """Ops a backward pass is made of (a Where with a zero branch, comparisons, a Softmax-like
    Sub of a sum, reshapes) keep the gradient proportional: nothing is divided before the outputs."""
    import torch.nn as nn

    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 16), nn.ReLU(),
                           nn.Linear(16, 4), nn.LogSoftmax(-1))
    proto = make_training_graph(module, (torch.randn(6, 8),), (torch.randn(6, 4),), loss_fn=F.mse_loss)
    out = rewrite_training_onnx_model(proto, loss="loss", grads=GRADS)
    assert not any("divided by the loss scale" in note for note in out.log.notes)
    reasons = [dict((p.key, p.value) for p in n.metadata_props).get("amp_rewrite.reason", "") for n in out.model.graph.node]
    assert sum("gradient unscaled in FP32" in r for r in reasons) == len(proto.graph.output) - 1
    assert not any("before" in r and "not proportional" in r for r in reasons)


def test_scaled_outputs_grads_does_not_name_and_grads_the_pass_does_not_reach_are_refused():
    """An output the backward pass computes but --grads does not name would leave multiplied by the
    scale (here gy, the loss gradient broadcast); a --grads output the pass does not reach would
    be divided by it."""
    model = _with_gradient_readers(_hand_graph(), "gy")
    with pytest.raises(UsageError, match=r"'gy' are computed from the backward pass but --grads does not name"):
        rewrite_training_onnx_model(model, loss="loss", grads=GRADS, target="fp16")
    from onnx import helper as h

    model = _hand_graph()
    model.graph.node.append(h.make_node("Relu", ["y"], ["grad.act"]))
    model.graph.output.append(h.make_tensor_value_info("grad.act", onnx.TensorProto.FLOAT, None))
    with pytest.raises(UsageError, match=r"--grads names 'grad.act', which the backward pass .* does not reach"):
        rewrite_training_onnx_model(model, loss="loss", grads=GRADS, target="fp16")


def test_a_seed_no_node_reads_is_refused():
    """The seed found by name was not read (the exporter folded a constant 1): the gradients were
    computed unscaled, then divided by the scale, and came out 1/65536 of the truth."""
    with pytest.raises(UsageError, match="seed input 'loss_grad' is read by no node"):
        rewrite_training_onnx_model(_hand_graph(seed_read=False), loss="loss", grads=GRADS, target="fp16")


@pytest.mark.parametrize("dtype", [onnx.TensorProto.INT64, onnx.TensorProto.FLOAT16])
def test_a_gradient_output_that_is_not_fp32_is_refused(dtype):
    """An int64 or FP16 output matched by --grads got Mul(grad, 1/scale): an invalid model."""
    with pytest.raises(UsageError, match=r"--grads matches 'grad\.W', which is (INT64|FLOAT16)"):
        rewrite_training_onnx_model(_hand_graph(grad_type=dtype), loss="loss", grads=GRADS, target="fp16")


def test_the_loss_must_have_one_element(tmp_path):
    """A [2, 2] loss was accepted and scaled_loss declared [] (checker: rank mismatch); a
    one-element loss keeps its shape."""
    with pytest.raises(UsageError, match=r"the loss must be a scalar \(one element\), its shape is \[2, 2\]"):
        rewrite_training_onnx_model(_hand_graph(loss_shape=(2, 2)), loss="loss", grads=None, target="fp16")
    for grads in (None, GRADS):
        out = rewrite_training_onnx_model(_hand_graph(loss_shape=(1, 1)), loss="loss", grads=grads,
                                          target="fp16").model
        onnx.checker.check_model(out, full_check=True)
        scaled = next(o for o in out.graph.output if o.name == SCALED_LOSS)
        assert [d.dim_value for d in scaled.type.tensor_type.shape.dim] == [1, 1]


def test_a_constant_gradient_passes_through(tmp_path):
    """An unused parameter's zero gradient, an initializer wired to the output, made the rewrite
    refuse graphs tools/make_training_graph.py writes; it never went through the scaled backward
    pass, so it leaves unchanged while the computed gradient is unscaled."""
    out = rewrite_training_onnx_model(_hand_graph(constant_grad=True), loss="loss", grads=GRADS,
                                      target="fp16").model
    onnx.checker.check_model(out, full_check=True)
    info = training_info(out)
    assert info["grads"] == ["grad.W", "grad.unused"] and info["scaled_grads"] == ["grad.W/amp_scaled"]
    onnx.save(out, tmp_path / "t.onnx")
    got, want = _grad_w(tmp_path / "t.onnx")
    np.testing.assert_allclose(got["grad.W"], want, rtol=1e-2)
    np.testing.assert_array_equal(got["grad.unused"], np.zeros(3, np.float32))


def test_a_gradient_output_the_caller_may_feed_is_refused_naming_it():
    """The zero gradient as an initializer that is also a graph input (IR >= 4: a default the
    caller may feed) is no constant: the graph does not compute it, so there is nothing to unscale,
    and the rewrite refuses it, naming the output and telling the user to narrow --grads."""
    m = _hand_graph(constant_grad=True)
    m.graph.input.append(onnx.helper.make_tensor_value_info("grad.unused", onnx.TensorProto.FLOAT, [3]))
    with pytest.raises(UsageError) as caught:
        rewrite_training_onnx_model(m, loss="loss", grads=GRADS, target="fp16")
    message = str(caught.value)
    assert "'grad.unused' is a graph input" in message and "narrow --grads" in message
    # grads naming only the computed gradient is accepted
    out = rewrite_training_onnx_model(m, loss="loss", grads="grad.W", target="fp16").model
    assert training_info(out)["scaled_grads"] == ["grad.W/amp_scaled"]


def test_a_constant_gradient_made_by_a_constant_node_passes_through(tmp_path):
    """The same zero gradient written as a Constant node (not an initializer) was taken for a
    computed gradient, then refused as one the backward pass does not reach."""
    m = _hand_graph(constant_grad=True)
    zero = next(i for i in m.graph.initializer if i.name == "grad.unused")
    m.graph.initializer.remove(zero)
    m.graph.node.append(onnx.helper.make_node("Constant", [], ["grad.unused"], value=zero))
    out = rewrite_training_onnx_model(m, loss="loss", grads=GRADS, target="fp16").model
    onnx.checker.check_model(out, full_check=True)
    assert training_info(out)["scaled_grads"] == ["grad.W/amp_scaled"]
    onnx.save(out, tmp_path / "t.onnx")
    got, want = _grad_w(tmp_path / "t.onnx")
    np.testing.assert_allclose(got["grad.W"], want, rtol=1e-2)
    np.testing.assert_array_equal(got["grad.unused"], np.zeros(3, np.float32))


def test_a_gradient_computed_inside_an_if_body_from_another_is_unscaled_once(tmp_path):
    """grad.b = If(...) { ReduceSum(gW) }: the body reads the scaled gW from outside. The backward
    set ignored body reads, so the body was given gW unscaled and grad.b could not be traced back
    to the seed: refused as "not a gradient of the loss"."""
    from onnx import helper as h

    T = onnx.TensorProto
    m = _hand_graph()
    branches = [h.make_graph([h.make_node("ReduceSum", ["gW", "ax"], [f"{b}_sum"], keepdims=0)], b, [],
                             [h.make_tensor_value_info(f"{b}_sum", T.FLOAT, [4])]) for b in ("then", "else")]
    m.graph.initializer.extend([onnx.numpy_helper.from_array(np.array([0], np.int64), "ax"),
                                onnx.numpy_helper.from_array(np.array(True), "flag")])
    m.graph.node.append(h.make_node("If", ["flag"], ["grad.b"], then_branch=branches[0], else_branch=branches[1]))
    m.graph.output.append(h.make_tensor_value_info("grad.b", T.FLOAT, [4]))
    out = rewrite_training_onnx_model(m, loss="loss", grads=GRADS, target="fp16").model
    onnx.checker.check_model(out, full_check=True)
    onnx.save(out, tmp_path / "t.onnx")
    got, want = _grad_w(tmp_path / "t.onnx", scale=1024.0)
    np.testing.assert_allclose(got["grad.W"], want, rtol=1e-2)
    np.testing.assert_allclose(got["grad.b"], want.sum(0), rtol=1e-2)


def test_make_training_graph_never_returns_an_invalid_model():
    """A .sum() loss: the TorchScript exporter wrote ReduceSum with FLOAT axes, which only the full
    check (and onnxruntime) rejects; "auto" returned it. The full check now sends it to dynamo."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    proto = make_training_graph(model, (torch.randn(3, 4),), loss_fn=lambda out: out.sum())
    onnx.checker.check_model(proto, full_check=True)
    with pytest.raises(RuntimeError, match="the torchscript exporter wrote an invalid model"):
        make_training_graph(model, (torch.randn(3, 4),), loss_fn=lambda out: out.sum(), exporter="torchscript")


def test_make_training_graph_refuses_batchnorm_in_training_mode():
    """Tracing a train-mode BatchNorm updated the caller's running statistics, and the graph's loss
    and gradients matched neither mode."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    with pytest.raises(ValueError, match=r"1 would update running statistics .* call module\.eval\(\)"):
        make_training_graph(model, (x,), (y,), loss_fn=F.mse_loss, exporter="torchscript")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    model.eval()
    make_training_graph(model, (x,), (y,), loss_fn=F.mse_loss)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_grads_regex_is_checked_and_taken_whole(setup):
    """--grads 're:grad.(' was an internal error (exit 70; --fp32-nodes says it is not a regex), and a
    regex holding a comma was cut in two at it."""
    _, proto = setup
    with pytest.raises(UsageError, match=r"--grads: invalid regular expression 're:grad\.\('"):
        rewrite_training_onnx_model(proto, loss="loss", grads="re:grad.(")
    grads = [o.name for o in proto.graph.output[1:]]
    m = rewrite_training_onnx_model(proto, loss="loss", grads=r"re:grad\.l[0-9]{1,3}\..*", target="fp16").model
    assert training_info(m)["grads"] == grads


_SHARED_BIAS = '''<ir_version: 8, opset_import: ["" : 17]>
g (float[2,4] x, float loss_grad) => (float loss, float[2,4] grad_h, float[4] grad_b)
<float[4,4] W = {0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9,1.0,1.1,1.2,1.3,1.4,1.5,1.6},
 float[4,4] W2 = {1.0,0.0,0.5,0.2,0.1,1.0,0.3,0.4,0.2,0.1,1.0,0.1,0.3,0.2,0.1,1.0},
 float[4] b = {0.1, 0.2, 0.3, 0.4}, int64[1] ax = {0}>
{
  h0 = MatMul(x, W)
  h = Add(h0, b)
  y0 = MatMul(h, W2)
  y = Add(y0, b)
  loss = ReduceSum<keepdims=0>(y)
  ys = Shape(y)
  gy = Expand(loss_grad, ys)
  W2t = Transpose(W2)
  grad_h = MatMul(gy, W2t)
  gb1 = ReduceSum<keepdims=0>(grad_h, ax)
  gb2 = ReduceSum<keepdims=0>(gy, ax)
  grad_b = Add(gb1, gb2)
}'''


def _run_scaled(model, out, tmp_path, extra=None):
    onnx.save(model, tmp_path / "in.onnx")
    onnx.save(out, tmp_path / "out.onnx")
    feeds = {"x": np.arange(8, dtype=np.float32).reshape(2, 4) / 8, "loss_grad": np.array(1.0, np.float32),
             **(extra or {})}
    ref = run_onnx(tmp_path / "in.onnx", feeds)
    got = run_onnx(tmp_path / "out.onnx", dict(feeds, **{LOSS_SCALE: np.array(1024.0, np.float32),
                                                          GROWTH_TRACKER: np.array(0, np.int64)}))
    return ref, got


def test_a_gradient_the_backward_pass_reads_for_another_gradient_is_unscaled_once(tmp_path):
    """A bias shared by two layers: grad_b = rowsum(grad_h) + rowsum(gy). Every reader of grad_h was
    rewired to the unscaled value, including the backward pass's own ReduceSum, so grad_b's first
    term was divided by the scale twice: [2.0033 ...] for [5.4 ...], with all_finite True. (With
    MatMul pinned FP32, grad_W = x^T grad_h was refused as not reached.)"""
    model = onnx.parser.parse_model(_SHARED_BIAS)
    out = rewrite_training_onnx_model(model, loss="loss", grads="grad_*", target="fp16").model
    onnx.checker.check_model(out, full_check=True)
    ref, got = _run_scaled(model, out, tmp_path)
    for name in ("grad_h", "grad_b"):
        np.testing.assert_allclose(got[name], ref[name], rtol=1e-2)
    pinned = onnx.parser.parse_model(_SHARED_BIAS.replace("float[4] grad_b)", "float[4,4] grad_W)").replace(
        "gb1 = ReduceSum<keepdims=0>(grad_h, ax)\n  gb2 = ReduceSum<keepdims=0>(gy, ax)\n  grad_b = Add(gb1, gb2)",
        "xt = Transpose(x)\n  grad_W = MatMul(xt, grad_h)"))
    out = rewrite_training_onnx_model(pinned, loss="loss", grads="grad_*", target="fp16", fp32_ops=["MatMul"]).model
    ref, got = _run_scaled(pinned, out, tmp_path)
    np.testing.assert_allclose(got["grad_W"], ref["grad_W"], rtol=1e-2)


_THROUGH_IF = '''<ir_version: 8, opset_import: ["" : 17]>
g (float[2,4] x, float loss_grad, bool c) => (float loss, float[4,4] grad_W{extra_out})
<float[4,4] W = {{0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9,1.0,1.1,1.2,1.3,1.4,1.5,1.6}}, float two = {{2.0}}>
{{
  y = MatMul(x, W)
  loss = ReduceSum<keepdims=0>(y)
  ys = Shape(y)
  {body}
}}'''


def test_the_backward_pass_is_followed_through_an_if(tmp_path):
    """The walk from the seed never left a branch for the If that owns it: a gradient computed from
    an If's result was refused as not reached, and an output --grads does not name, computed
    through an If, left multiplied by the loss scale ([1023.9 ...] for [1. ...]) instead of being
    refused as it is without the If."""
    seeded_in_branch = onnx.parser.parse_model(_THROUGH_IF.format(extra_out="", body='''
  gy = If(c) <then_branch = t () => (float[2,4] a) { a = Expand(loss_grad, ys) },
              else_branch = e () => (float[2,4] b) { b0 = Expand(loss_grad, ys)
                                                      b = Mul(b0, two) }>
  xt = Transpose(x)
  grad_W = MatMul(xt, gy)'''))
    out = rewrite_training_onnx_model(seeded_in_branch, loss="loss", grads="grad_*", target="fp16").model
    onnx.checker.check_model(out, full_check=True)
    for c in (True, False):
        ref, got = _run_scaled(seeded_in_branch, out, tmp_path, {"c": np.array(c)})
        np.testing.assert_allclose(got["grad_W"], ref["grad_W"], rtol=1e-2)
    leftover = onnx.parser.parse_model(_THROUGH_IF.format(extra_out=", float[2,4] dx", body='''
  gy = Expand(loss_grad, ys)
  xt = Transpose(x)
  grad_W = MatMul(xt, gy)
  Wt = Transpose(W)
  dx = If(c) <then_branch = t () => (float[2,4] a) { a = MatMul(gy, Wt) },
              else_branch = e () => (float[2,4] b) { b = MatMul(gy, W) }>'''))
    with pytest.raises(UsageError, match=r"'dx' are computed from the backward pass but --grads does not name"):
        rewrite_training_onnx_model(leftover, loss="loss", grads="grad_*", target="fp16")


def test_explain_with_training_is_refused_not_answered_for_the_inference_rewrite(tmp_path, capsys):
    """``--training --loss loss --explain scale_loss`` printed 'computes in fp16' for a node the
    training rewrite keeps FP32 (the loss tail): --explain ran the inference pipeline. It is now a
    usage error that points to --report."""
    from amp_rewrite.cli import main

    src = tmp_path / "t.onnx"
    onnx.save(_hand_graph(), src)
    rc = main([str(src), "-o", str(tmp_path / "o.onnx"), "--training", "--loss", "loss", "--grads", GRADS,
               "--explain", "loss"])
    assert rc == 2 and "--report" in capsys.readouterr().err
    assert not (tmp_path / "o.onnx").exists()


def test_a_low_precision_reader_of_a_gradient_reads_it_unscaled(tmp_path):
    """``pg = MatMul(grad_W, P)`` (an in-graph preconditioner) runs FP16 and read the FP16 gradient
    before its Cast to the FP32 output, still scaled: the rewrite refused the graph, telling the
    user to compute pg from the named gradients, which it is. It now reads the unscaled gradient,
    cast to FP16."""
    model = onnx.parser.parse_model('''<ir_version: 8, opset_import: ["" : 17]>
        g (float[2,4] x, float loss_grad, float[4,4] W) => (float loss, float[4,4] grad_W, float[4,4] pg)
        <float[4,4] P = {1,0,0,0, 0,2,0,0, 0,0,3,0, 0,0,0,4}> {
          y = MatMul(x, W)
          loss = ReduceSum<keepdims=0>(y)
          ys = Shape(y)
          gy = Expand(loss_grad, ys)
          xt = Transpose(x)
          grad_W = MatMul(xt, gy)
          pg = MatMul(grad_W, P)
        }''')
    result = rewrite_training_onnx_model(model, loss="loss", grads="grad_*", target="fp16")
    out = result.model
    onnx.checker.check_model(out, full_check=True)
    assert result.log.decisions["MatMul:pg"].precision.value == "low"
    ref, got = _run_scaled(model, out, tmp_path, {"W": np.ones((4, 4), np.float32)})
    for name in ("grad_W", "pg"):
        np.testing.assert_allclose(got[name], ref[name], rtol=1e-2)


# -- the report of a training rewrite describes the model written, loss-scale nodes and all ---------------------
def _mlp_step_graph():
    """loss = mean((x @ W)²) and its gradient grad.W (the backward pass computed low), named nodes."""
    from onnx import helper as h

    T = onnx.TensorProto
    inputs = [h.make_tensor_value_info("W", T.FLOAT, [16, 16]), h.make_tensor_value_info("x", T.FLOAT, [8, 16]),
              h.make_tensor_value_info("loss_grad", T.FLOAT, [])]
    outputs = [h.make_tensor_value_info("loss", T.FLOAT, []), h.make_tensor_value_info("grad.W", T.FLOAT, [16, 16])]
    nodes = [h.make_node("MatMul", ["x", "W"], ["y"], name="fwd_mm"), h.make_node("Mul", ["y", "y"], ["sq"], name="sq"),
             h.make_node("ReduceMean", ["sq"], ["loss"], keepdims=0, name="mean"),
             h.make_node("Mul", ["y", "loss_grad"], ["dy"], name="dy"), h.make_node("Transpose", ["x"], ["xt"], name="xt"),
             h.make_node("MatMul", ["xt", "dy"], ["grad.W"], name="bwd_mm")]
    return h.make_model(h.make_graph(nodes, "g", inputs, outputs), opset_imports=[h.make_opsetid("", 17)], ir_version=10)


def _held_bytes(model):
    total = sum(onnx.numpy_helper.to_array(t).nbytes for t in model.graph.initializer)
    return total + sum(onnx.numpy_helper.to_array(a.t).nbytes for n in model.graph.node if n.op_type == "Constant"
                       for a in n.attribute if a.name == "value")


def test_training_report_weights_count_the_loss_scale_constants():
    """The loss-scale update brings its own initializers (growth factor, interval, min/max scale,
    ...): the report's weights said 0 B -> 0 B for a model written with 40 B of them."""
    from amp_rewrite.report import Report

    model = _mlp_step_graph()
    result = rewrite_training_onnx_model(model, loss="loss", grads=GRADS, target="fp16")
    weights = result.report.summary()["weights"]
    assert (weights["bytes_before"], weights["bytes_after"]) == (_held_bytes(model), _held_bytes(result.model))
    assert weights["bytes_after"] == 40  # 4 float32 and 3 int64 scalars
    assert Report.from_model(result.model).summary()["weights"] == weights


def test_training_report_cast_records_follow_the_loss_scale_nodes():
    """The Cast bringing the FP16 gradient to FP32 was recorded (before the loss-scale nodes went
    in) as writing the graph output, "graph outputs keep their type"; in the written model the
    unscale Mul reads it and writes the output. The seed's Cast read loss_grad x loss_scale, not
    loss_grad, though its record said it read the graph input."""
    from amp_rewrite.report import Report

    result = rewrite_training_onnx_model(_mlp_step_graph(), loss="loss", grads=GRADS, target="fp16")
    out = result.model
    nodes = {n.name: n for n in out.graph.node}
    producers = {o: n.name for n in out.graph.node for o in n.output}
    outputs = {o.name for o in out.graph.output}
    casts = [c for c in result.report.to_dict()["casts"] if c["kind"] == "inserted"]
    assert {c["name"] for c in casts} >= {"amp_cast/grad.W/to_fp32", "amp_cast/loss_grad/to_fp16"}
    for c in casts:
        cast = nodes[c["name"]]
        readers = {n.name for n in out.graph.node if cast.output[0] in n.input}
        assert set(c["consumers"]) == readers | ({"<graph output>"} if cast.output[0] in outputs else set()), c
        assert (c["tensor"], c["producer"]) == (cast.input[0], producers.get(cast.input[0])), c
    grad = next(c for c in casts if c["name"] == "amp_cast/grad.W/to_fp32")
    assert grad["consumers"] == ["amp_train/Mul_2"] and "keep_io_types" not in grad["reason"]
    assert "unscaled" in grad["reason"]
    assert Report.from_model(out).to_dict()["casts"] == result.report.to_dict()["casts"]


def test_make_training_graph_says_in_one_line_why_neither_exporter_could(capsys, tmp_path, monkeypatch):
    """A Conv's backward has no ONNX export in either exporter: the command line printed four
    chained tracebacks. It prints both exporters' reasons in one line and exits 1."""
    from tools import make_training_graph as tool

    module = tmp_path / "convnet.py"
    module.write_text("import torch\n\ndef make():\n    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), "
                      "torch.nn.Flatten(), torch.nn.Linear(36, 2))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    code = tool.main(["convnet:make", "--input-shape", "2,3,5,5", "--target-shape", "2,2", "--loss", "mse",
                      "-o", str(tmp_path / "t.onnx")])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 1 and err.startswith("make_training_graph: error: neither exporter can export")
    assert "torchscript: " in err and "dynamo: " in err and "convolution_backward" in err
    assert not (tmp_path / "t.onnx").exists()


@pytest.mark.parametrize("factory, said", [
    ("mlp:make", "wrote "),  # (the module beside the caller: run as a script, its directory was not on the path)
    ("nowhere:make", "cannot import 'nowhere'"),
    ("mlp:absent", "module 'mlp' has no 'absent'"),
    ("mlp", "write it as module:callable"),
])
def test_make_training_graph_finds_a_factory_in_the_current_directory_or_says_why_not(tmp_path, factory, said):
    """Run by path as its docstring shows, the tool did not find a module in the current directory,
    and a bad factory gave a traceback (ModuleNotFoundError, AttributeError). It imports from the
    current directory now, and a factory it cannot load is one line and exit 2."""
    (tmp_path / "mlp.py").write_text("import torch\n\ndef make():\n    return torch.nn.Linear(4, 2)\n")
    tool = Path(__file__).resolve().parent.parent / "tools" / "make_training_graph.py"
    run = subprocess.run([sys.executable, str(tool), factory, "--input-shape", "3,4", "--target-shape", "3,2",
                          "--loss", "mse", "-o", "t.onnx"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    if said == "wrote ":
        assert run.returncode == 0 and run.stdout.startswith(said), run.stderr
        assert (tmp_path / "t.onnx").exists()
    else:
        assert run.returncode == 2 and said in run.stderr and "Traceback" not in run.stderr, run.stderr
        assert not (tmp_path / "t.onnx").exists()


def _gradient_post_processed_by(op: str, domain: str = "") -> onnx.ModelProto:
    """loss = sum(x @ W) with its backward written out: grad.W = x^T @ (ones * loss_grad), and then
    ``op`` reading the gradient: a ScatterND multiplying rows of it by other rows of it, or an
    accumulator adding it to a running sum ``acc`` (a graph input, not scaled)."""
    from onnx import helper as h

    T = onnx.TensorProto
    nodes = [h.make_node("MatMul", ["x", "W"], ["y"]), h.make_node("ReduceSum", ["y"], ["loss"], keepdims=0),
             h.make_node("Constant", [], ["ones"], value=h.make_tensor("o", T.FLOAT, [4, 4], [1.0] * 16)),
             h.make_node("Mul", ["ones", "loss_grad"], ["dy"]), h.make_node("Transpose", ["x"], ["xt"], perm=[1, 0]),
             h.make_node("MatMul", ["xt", "dy"], ["grad.W"])]
    inputs = [h.make_tensor_value_info("x", T.FLOAT, [4, 8]), h.make_tensor_value_info("W", T.FLOAT, [8, 4]),
              h.make_tensor_value_info("loss_grad", T.FLOAT, [])]
    if op == "ScatterND":
        nodes += [h.make_node("Constant", [], ["rows"], value=h.make_tensor("r", T.INT64, [2], [0, 3])),
                  h.make_node("Gather", ["grad.W", "rows"], ["upd"], axis=0),
                  h.make_node("Constant", [], ["idx"], value=h.make_tensor("i", T.INT64, [2, 1], [1, 2])),
                  h.make_node("ScatterND", ["grad.W", "idx", "upd"], ["grad.out"], reduction="mul")]
    else:
        inputs.append(h.make_tensor_value_info("acc", T.FLOAT, [8, 4]))
        nodes.append(h.make_node(op, ["acc", "grad.W"], ["grad.out"], domain=domain))
    graph = h.make_graph(nodes, "g", inputs, [h.make_tensor_value_info("loss", T.FLOAT, []),
                                              h.make_tensor_value_info("grad.W", T.FLOAT, [8, 4]),
                                              h.make_tensor_value_info("grad.out", T.FLOAT, [8, 4])])
    opsets = [h.make_opsetid("", 18)] + ([h.make_opsetid(domain, 1)] if domain else [])
    return h.make_model(graph, opset_imports=opsets, ir_version=8)


@pytest.mark.parametrize("op", ["ScatterND", "GradientAccumulator"])
def test_a_gradient_post_processed_not_in_proportion_to_the_scale_is_divided_before(tmp_path, op):
    """ScatterND(reduction='mul') of gradient rows by gradient rows makes those rows S^2 x the truth,
    and com.microsoft GradientAccumulator(acc, g) adds an unscaled sum to a scaled gradient; both
    were taken as proportional to the scale (every com.microsoft op named *Grad* was), so only
    their output was divided: rows 1024x too large, an accumulator shrinking by 1/S each step,
    with all_finite true. The gradient is now divided before them."""
    domain = "com.microsoft" if op == "GradientAccumulator" else ""
    out = rewrite_training_onnx_model(_gradient_post_processed_by(op, domain), loss="loss", grads=GRADS)
    onnx.checker.check_model(out.model, full_check=True)
    model = out.model
    if domain:  # (onnxruntime's inference build has no GradientAccumulator: it computes acc + g)
        for node in model.graph.node:
            if node.op_type == op:
                node.op_type, node.domain = "Add", ""
    reference = _gradient_post_processed_by("ScatterND") if op == "ScatterND" else _gradient_post_processed_by("Add")
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((4, 8)).astype(np.float32), "W": rng.standard_normal((8, 4)).astype(np.float32),
             "loss_grad": np.array(1, np.float32)}
    if op != "ScatterND":
        feeds["acc"] = rng.standard_normal((8, 4)).astype(np.float32)
    want = run_onnx(reference, feeds)["grad.out"]
    for scale in (1.0, 1024.0):
        got = run_onnx(model, {**feeds, LOSS_SCALE: np.array(scale, np.float32), GROWTH_TRACKER: np.array(0, np.int64)})
        np.testing.assert_allclose(got["grad.out"], want, rtol=1e-2, atol=1e-2)
        assert bool(got[ALL_FINITE])


_ACCUMULATE = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[8,4] x, float[8,4] t, float loss_grad, float[4,4] acc_in) => (float loss, float[4,4] grad_acc)
<float[4,4] W, float two{inits}>
{{
  y = MatMul(x, W)
  d = Sub(y, t)
  d2 = Mul(d, d)
  loss = ReduceSum<keepdims=0>(d2)
  s = Mul(loss_grad, two)
  gy = Mul(d, s)
  gW = Gemm<transA=1>(x, gy)
  grad_acc = Add(acc_in, gW)
}}
"""


@pytest.mark.parametrize("default", [False, True])
def test_an_initializer_a_caller_may_feed_is_not_taken_for_a_constant_zero(default):
    """A gradient accumulator that is an initializer of zeros listed as a graph input (a default the
    caller feeds) was taken for a constant 0 by the loss-scale analysis: acc_in + S·g was divided
    by S as a whole on its way out, so the fed buffer came back divided by the scale."""
    from tests.util import make_model, rel_err

    extra = {"acc_in": np.zeros((4, 4), np.float32)} if default else {}
    model = make_model(_ACCUMULATE.format(inits=", float[4,4] acc_in" if default else ""),
                       {"W": (4, 4), "two": np.array(2, np.float32), **extra})
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((8, 4)).astype(np.float32), "t": rng.standard_normal((8, 4)).astype(np.float32),
             "loss_grad": np.array(1, np.float32), "acc_in": np.full((4, 4), 5.0, np.float32)}
    ref = run_onnx(model, feeds)["grad_acc"]
    out = rewrite_training_onnx_model(model, loss="loss", grads="grad_acc").model
    onnx.checker.check_model(out, full_check=True)
    for scale in (1.0, 1024.0):
        got = run_onnx(out, {**feeds, "loss_scale": np.array(scale, np.float32),
                             "growth_tracker": np.array(0, np.int64)})["grad_acc"]
        assert rel_err(ref, got) < 2e-3, scale


_BPTT = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[4,1,8] xs, float loss_grad) => (float loss, float[8,8] grad_W)
<float[8,8] W, float[8,8] WT, float[1,8] h0, float lam, int64[1] ax0, float[8,8] zeros>
{{
  hT, hs = Scan<num_scan_inputs=1, body = fwd (float[1,8] h_in, float[1,8] x_t) => (float[1,8] h_out, float[1,8] h_prev) {{
        hw = MatMul(h_in, W)
        h_out = Add(hw, x_t)
        h_prev = Identity(h_in)
     }}>(h0, xs)
  s = ReduceSum<keepdims=0>(hT)
  loss = Mul(s, lam)
  g0 = Mul(loss_grad, lam)
  sh = Shape(hT)
  dhT = Expand(g0, sh)
  {backward}
}}
"""
# the backward pass through time, a Scan over the saved states: dW summed outside, or carried
_SCAN_OUT = """dh0, dWs = Scan<num_scan_inputs=1, scan_input_directions=[1], scan_output_directions=[1], body = bwd (float[1,8] dh, float[1,8] hp) => (float[1,8] dh_prev, float[8,8] dW) {
        hpT = Transpose<perm=[1,0]>(hp)
        dW = MatMul(hpT, dh)
        dh_prev = MatMul(dh, WT)
     }>(dhT, hs)
  grad_W = ReduceSum<keepdims=0>(dWs, ax0)"""
_CARRIED = """dh0, grad_W = Scan<num_scan_inputs=1, scan_input_directions=[1], body = bwd (float[1,8] dh, float[8,8] acc, float[1,8] hp) => (float[1,8] dh_prev, float[8,8] acc_out) {
        hpT = Transpose<perm=[1,0]>(hp)
        dW = MatMul(hpT, dh)
        acc_out = Add(acc, dW)
        dh_prev = MatMul(dh, WT)
     }>(dhT, zeros, hs)"""
# a carried value that leaves each iteration at another degree than it came in with (dh²): the
# body cannot run on scaled values; it reads them divided by the scale, as before
_SQUARED = _SCAN_OUT.replace("dh_prev = MatMul(dh, WT)", "dt = MatMul(dh, WT)\n        dh_prev = Mul(dt, dh)")


@pytest.mark.parametrize("backward", [_SCAN_OUT, _CARRIED, _SQUARED], ids=["scan output", "carried from zero", "squared"])
def test_a_backward_pass_through_time_runs_on_the_scaled_gradient(backward):
    """A Scan or Loop computing the backward pass (BPTT) read the gradient divided by the loss
    scale: its FP16 body computed unscaled gradients of 6e-8, which flushed to zero at every scale
    (100% error, all_finite True). Linear in the gradient, it now runs on the scaled values."""
    from amp_rewrite.emulate import emulate_low
    from tests.util import make_model, rel_err

    rng = np.random.default_rng(0)
    W = (rng.standard_normal((8, 8)) * 0.3).astype(np.float32)
    model = make_model(_BPTT.format(backward=backward), {
        "W": W, "WT": W.T.copy(), "h0": np.zeros((1, 8), np.float32), "lam": np.array(1e-8, np.float32),
        "ax0": np.array([0], np.int64), "zeros": np.zeros((8, 8), np.float32)})
    feeds = {"xs": rng.standard_normal((4, 1, 8)).astype(np.float32), "loss_grad": np.array(1, np.float32)}
    ref = run_onnx(model, feeds)["grad_W"]
    result = rewrite_training_onnx_model(model, loss="loss", grads="grad_W")
    onnx.checker.check_model(result.model, full_check=True)
    divided = [n for n in result.log.notes if "divided by the loss scale" in n]
    emulated, _ = emulate_low(result.model)
    got = run_onnx(emulated, {**feeds, "loss_scale": np.array(32768.0, np.float32),
                              "growth_tracker": np.array(0, np.int64)})["grad_W"]
    if backward is _SQUARED:  # (dh² of 1e-8 is 0 in FP32 too: only where the scale goes is checked)
        assert divided and "'Scan:dh0'" in divided[0]
        return
    assert not divided and rel_err(ref, got) < 5e-3


def test_a_backward_pass_in_a_loop_runs_on_the_scaled_gradient():
    """The Loop form of the same: the carried gradient and the per-step dW (a scan output)."""
    from amp_rewrite.emulate import emulate_low
    from tests.util import make_model, rel_err

    text = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[1,8] x, float loss_grad) => (float loss, float[8,8] grad_W)
<float[8,8] W, float[8,8] WT, float lam, int64 K, bool tr, int64[1] ax0, int64[1] one>
{
  h1 = MatMul(x, W)
  h2 = MatMul(h1, W)
  h3 = MatMul(h2, W)
  s = ReduceSum<keepdims=0>(h3)
  loss = Mul(s, lam)
  g0 = Mul(loss_grad, lam)
  sh = Shape(h3)
  dh3 = Expand(g0, sh)
  hs = Concat<axis=0>(h2, h1, x)
  dh_last, dWs = Loop(K, tr, dh3) <body = b (int64 i, bool c, float[1,8] dh) => (bool co, float[1,8] dhp, float[8,8] dW) {
      co = Identity(c)
      i1 = Unsqueeze(i, ax0)
      i2 = Add(i1, one)
      hp = Slice(hs, i1, i2, ax0)
      hpT = Transpose<perm=[1,0]>(hp)
      dW = MatMul(hpT, dh)
      dhp = MatMul(dh, WT)
  }>
  grad_W = ReduceSum<keepdims=0>(dWs, ax0)
}
"""
    rng = np.random.default_rng(0)
    W = (rng.standard_normal((8, 8)) * 0.3).astype(np.float32)
    model = make_model(text, {"W": W, "WT": W.T.copy(), "lam": np.array(1e-8, np.float32),
                              "K": np.array(3, np.int64), "tr": np.array(True), "ax0": np.array([0], np.int64),
                              "one": np.array([1], np.int64)})
    feeds = {"x": rng.standard_normal((1, 8)).astype(np.float32), "loss_grad": np.array(1, np.float32)}
    ref = run_onnx(model, feeds)["grad_W"]
    result = rewrite_training_onnx_model(model, loss="loss", grads="grad_W")
    onnx.checker.check_model(result.model, full_check=True)
    assert not [n for n in result.log.notes if "divided by the loss scale" in n]
    emulated, _ = emulate_low(result.model)
    got = run_onnx(emulated, {**feeds, "loss_scale": np.array(32768.0, np.float32),
                              "growth_tracker": np.array(0, np.int64)})["grad_W"]
    assert rel_err(ref, got) < 5e-3


def test_a_loop_body_reading_the_gradient_from_the_outer_scope_computes_a_scaled_gradient():
    """A Loop whose inputs do not come from the seed, but whose body reads the seed's gradient from
    the outer scope: its body output (after the condition) is the Loop's scan output, so the
    gradient it makes is reached from the seed, unscaled on its way out and accepted."""
    from amp_rewrite.emulate import emulate_low
    from tests.util import make_model, rel_err

    text = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[1,8] x, float loss_grad) => (float loss, float[8,8] grad_W)
<float[8,8] W, float lam, int64 K, bool tr, int64[1] ax0, int64[1] one>
{
  h1 = MatMul(x, W)
  h2 = MatMul(h1, W)
  s = ReduceSum<keepdims=0>(h2)
  loss = Mul(s, lam)
  g0 = Mul(loss_grad, lam)
  sh = Shape(h2)
  dh = Expand(g0, sh)
  hs = Concat<axis=0>(h1, x)
  dWs = Loop(K, tr) <body = b (int64 i, bool c) => (bool co, float[8,8] dW) {
      co = Identity(c)
      i1 = Unsqueeze(i, ax0)
      i2 = Add(i1, one)
      hp = Slice(hs, i1, i2, ax0)
      hpT = Transpose<perm=[1,0]>(hp)
      dW = MatMul(hpT, dh)
  }>
  grad_W = ReduceSum<keepdims=0>(dWs, ax0)
}
"""
    rng = np.random.default_rng(0)
    W = (rng.standard_normal((8, 8)) * 0.3).astype(np.float32)
    model = make_model(text, {"W": W, "lam": np.array(1e-8, np.float32), "K": np.array(2, np.int64),
                              "tr": np.array(True), "ax0": np.array([0], np.int64), "one": np.array([1], np.int64)})
    feeds = {"x": rng.standard_normal((1, 8)).astype(np.float32), "loss_grad": np.array(1, np.float32)}
    ref = run_onnx(model, feeds)["grad_W"]
    result = rewrite_training_onnx_model(model, loss="loss", grads="grad_W")
    onnx.checker.check_model(result.model, full_check=True)
    assert training_info(result.model)["scaled_grads"] == ["grad_W/amp_scaled"]
    emulated, _ = emulate_low(result.model)
    got = run_onnx(emulated, {**feeds, "loss_scale": np.array(32768.0, np.float32),
                              "growth_tracker": np.array(0, np.int64)})["grad_W"]
    assert rel_err(ref, got) < 5e-3


def test_a_gradient_listed_twice_among_the_outputs_comes_out_unscaled_in_both_slots(tmp_path):
    """The output list named grad.W twice: the rewrite renamed the value and moved only one slot to
    the unscaled gradient, then refused the model naming its own 'grad.W/amp_scaled'."""
    model = _hand_graph()
    model.graph.output.append(onnx.helper.make_tensor_value_info("grad.W", onnx.TensorProto.FLOAT, [4, 4]))
    out = rewrite_training_onnx_model(model, loss="loss", grads=GRADS, target="fp16").model
    onnx.checker.check_model(out, full_check=True)
    assert [o.name for o in out.graph.output].count("grad.W") == 2
    onnx.save(out, tmp_path / "t.onnx")
    got, want = _grad_w(tmp_path / "t.onnx")
    np.testing.assert_allclose(got["grad.W"], want, rtol=1e-2)
    assert bool(got[ALL_FINITE])


def test_a_seed_input_with_a_symbolic_dim_is_found_and_a_wrong_one_is_told_what_is_wrong(tmp_path):
    """A dynamic-axes export declares the seed float[N]: it was skipped, and the user told the
    graph had no seed and to name it 'loss_grad', the name it had."""
    model = _hand_graph()
    seed = next(i for i in model.graph.input if i.name == "loss_grad")
    seed.type.tensor_type.shape.dim.add().dim_param = "N"
    out = rewrite_training_onnx_model(model, loss="loss", grads=GRADS, target="fp16").model
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    got = run_onnx(out, {"x": x, "loss_grad": np.ones((1,), np.float32), LOSS_SCALE: np.array(1024.0, np.float32),
                         GROWTH_TRACKER: np.array(0, np.int64)})
    np.testing.assert_allclose(got["grad.W"], x.T @ np.ones((2, 4), np.float32), rtol=1e-2)
    seed.type.tensor_type.shape.dim[0].dim_value = 3  # three elements: not a loss's gradient
    with pytest.raises(UsageError, match=r"'loss_grad' is FLOAT \[3\]"):
        rewrite_training_onnx_model(model, loss="loss", grads=GRADS, target="fp16")


def test_a_misspelt_loss_grads_or_seed_names_the_closest_and_not_every_output():
    model = _hand_graph()
    for i in range(40):
        model.graph.node.append(onnx.helper.make_node("Identity", ["grad.W"], [f"grad.layer{i}.weight"]))
        model.graph.output.append(onnx.helper.make_tensor_value_info(f"grad.layer{i}.weight",
                                                                     onnx.TensorProto.FLOAT, [4, 4]))
    with pytest.raises(UsageError, match=r"did you mean 'loss'\?") as info:
        rewrite_training_onnx_model(model, loss="Loss", grads=GRADS)
    assert "34 more" in str(info.value) and "grad.layer39.weight" not in str(info.value)
    with pytest.raises(UsageError, match=r"did you mean 'grad\.W'\?"):
        rewrite_training_onnx_model(model, loss="loss", grads="grad.w")
    with pytest.raises(UsageError, match=r"did you mean 'loss_grad'\?"):
        rewrite_training_onnx_model(model, loss="loss", grads=GRADS, loss_grad="loss_gradient")


def test_a_users_low_pin_on_a_loss_island_node_is_honoured():
    """--fp16-nodes on a node between the last allow op and the loss lost to the loss island's own
    FP32 pin, silently (FP32 pins win over low ones): the user's explicit pin now ends the island."""
    model = _hand_graph()
    plain = rewrite_training_onnx_model(model, loss="loss", grads=GRADS, target="bf16").model
    pinned = rewrite_training_onnx_model(model, loss="loss", grads=GRADS, target="bf16",
                                         fp16_nodes=["ReduceSum:total"]).model
    onnx.checker.check_model(pinned, full_check=True)

    def reduce_sum(m):
        node = next(n for n in m.graph.node if n.op_type == "ReduceSum" and "total" in n.output)
        return {p.key: p.value for p in node.metadata_props}

    assert reduce_sum(plain)["amp_rewrite.precision"] == "fp32"
    assert (reduce_sum(pinned)["amp_rewrite.precision"], reduce_sum(pinned)["amp_rewrite.source"]) == \
        ("low", "--fp16-nodes")


def test_static_loss_scaling_passes_the_scale_and_tracker_through():
    """dynamic=False keeps the loss scale fixed: the next scale and growth tracker are the ones fed,
    at the step where a dynamic scale would grow and after an overflow, with no update built."""
    out = rewrite_training_onnx_model(_hand_graph(), loss="loss", grads=GRADS, target="fp16", dynamic=False).model
    onnx.checker.check_model(out, full_check=True)
    assert not [n for n in out.graph.node if n.op_type == "Where"]
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    for seed, finite in ((1.0, True), (np.inf, False)):
        got = run_onnx(out, {"x": x, "loss_grad": np.array(seed, np.float32),
                             LOSS_SCALE: np.array(1024.0, np.float32), GROWTH_TRACKER: np.array(1999, np.int64)})
        assert bool(got[ALL_FINITE]) is finite
        assert float(got[NEXT_LOSS_SCALE]) == 1024.0 and int(got[NEXT_GROWTH_TRACKER]) == 1999


def test_a_low_reader_inside_the_backward_pass_reads_the_scaled_gradient():
    """grad.B = gW @ ones reads the FP16 gW that grad.W is cast from: it is part of the backward
    pass, so it reads the scaled value, and loss scaling protects it. Emulated in FP16 at scale
    65536 with gradients near 1e-7, grad.B comes out as in FP32."""
    from onnx import helper as h

    from amp_rewrite.emulate import emulate_low
    from tests.util import rel_err

    model = _hand_graph()
    model.graph.node.append(h.make_node("MatMul", ["gW", "ones"], ["grad.B"], name="gb"))
    model.graph.initializer.append(onnx.numpy_helper.from_array(np.ones((4, 1), np.float32), "ones"))
    model.graph.output.append(h.make_tensor_value_info("grad.B", onnx.TensorProto.FLOAT, [4, 1]))
    onnx.checker.check_model(model, full_check=True)
    out = rewrite_training_onnx_model(model, loss="loss", grads=GRADS, target="fp16").model
    onnx.checker.check_model(out, full_check=True)
    x = (np.arange(8, dtype=np.float32).reshape(2, 4) + 1) * 1e-4
    seed = np.float32(1e-4)
    want_w = x.T @ np.full((2, 4), seed, np.float32)
    got = run_onnx(emulate_low(out)[0], {"x": x, "loss_grad": np.array(seed, np.float32),
                                         LOSS_SCALE: np.array(65536.0, np.float32),
                                         GROWTH_TRACKER: np.array(0, np.int64)})
    assert rel_err(want_w, got["grad.W"]) < 1e-2
    assert rel_err(want_w @ np.ones((4, 1), np.float32), got["grad.B"]) < 1e-2


def test_the_seed_named_by_the_training_graph_metadata_is_used():
    """The seed input is called 'gseed', and the model's amp_rewrite.training_graph metadata names it
    as the loss gradient: the rewrite takes it as the seed of the backward pass."""
    model = _hand_graph()
    for node in model.graph.node:
        node.input[:] = ["gseed" if i == "loss_grad" else i for i in node.input]
    next(i for i in model.graph.input if i.name == "loss_grad").name = "gseed"
    model.metadata_props.add(key="amp_rewrite.training_graph", value=json.dumps({"loss_grad": "gseed"}))
    out = rewrite_training_onnx_model(model, loss="loss", grads=GRADS, target="fp16").model
    onnx.checker.check_model(out, full_check=True)
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    got = run_onnx(out, {"x": x, "gseed": np.array(1.0, np.float32), LOSS_SCALE: np.array(1024.0, np.float32),
                         GROWTH_TRACKER: np.array(0, np.int64)})
    np.testing.assert_allclose(got["grad.W"], x.T @ np.ones((2, 4), np.float32), rtol=1e-2)


def test_a_grads_pattern_matching_every_output_leaves_out_the_loss():
    """grads='*' matches the loss too: the loss is not a gradient, so it is left out of the
    gradients unscaled, and grad.W alone is."""
    result = rewrite_training_onnx_model(_hand_graph(), loss="loss", grads="*", target="fp16")
    out = result.model
    onnx.checker.check_model(out, full_check=True)
    grads = training_info(out)["grads"]
    assert "loss" not in grads and "grad.W" in grads
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    got = run_onnx(out, {"x": x, "loss_grad": np.array(1.0, np.float32), LOSS_SCALE: np.array(1024.0, np.float32),
                         GROWTH_TRACKER: np.array(0, np.int64)})
    np.testing.assert_allclose(got["grad.W"], x.T @ np.ones((2, 4), np.float32), rtol=1e-2)
    np.testing.assert_allclose(got["loss"], float((x @ np.ones((4, 4), np.float32)).sum()), rtol=1e-2)


def test_only_what_follows_the_last_allow_op_joins_the_loss_island():
    """The loss island is what feeds the loss with no allow op between: a node two steps before a
    MatMul that feeds the loss (Add, then Relu, then the MatMul) is not in it, and computes in
    FP16 between the two MatMuls."""
    from tests.util import make_model

    model = make_model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[4,8] x) => (float loss) {
          h0 = MatMul(x, w0)
          a = Add(h0, b)
          r = Relu(a)
          h = MatMul(r, w)
          loss = ReduceSum<keepdims=0>(h)
        }""", {"w0": (8, 8), "w": (8, 8), "b": (8,)})
    for node in model.graph.node:
        node.name = node.output[0] + "_node"
    log = rewrite_training_onnx_model(model, loss="loss", target="fp16").log
    assert log.decisions["loss_node"].source == "training"
    for name in ("a_node", "r_node"):
        assert log.decisions[name].precision.value == "low" and log.decisions[name].source != "training", name


def test_a_training_rewrite_solves_no_if_with_the_scope_around_it():
    """In training mode the placement does not solve an If together with its branches: the If and
    its branch nodes keep the precision painting gives them (FP32 here), where the inference
    rewrite of the same model runs them in fp16."""
    from tests.util import make_model, rewrite

    model = make_model("""
        <ir_version: 9, opset_import: ["" : 17]>
        g (float[4,8] x, bool c) => (float loss) {
          h = MatMul(x, w)
          y = If(c) <then_branch = t () => (float[4,8] a) { a = Relu(h) },
                     else_branch = e () => (float[4,8] b) { b = Sigmoid(h) }>
          z = MatMul(y, w)
          loss = ReduceSum<keepdims=0>(z)
        }""", {"w": (8, 8)}, ir_version=9)
    assert rewrite(model).log.decisions["If:y"].precision.value == "low"
    log = rewrite_training_onnx_model(model, loss="loss", target="fp16").log
    assert {name: log.decisions[name].precision.value for name in ("If:y", "Relu:a", "Sigmoid:b")} == {
        "If:y": "fp32", "Relu:a": "fp32", "Sigmoid:b": "fp32"}


def test_the_unscaled_readers_note_names_output_readers_first_then_the_clip():
    """The readers of the gradient outputs come first, then the nodes divided before a clip."""
    model = _with_gradient_readers(_clipped(_hand_graph(), 5.0, "ReduceSumSquare"), "step")
    result = rewrite_training_onnx_model(model, loss="loss", grads=GRADS, target="fp16")
    [note] = [n for n in result.log.notes if "divided by the loss scale" in n]
    assert note.endswith(": 'Mul:step', 'ReduceSumSquare:grad_norm_sq', 'ReduceSumSquare:sq'"), note
