"""LossScaler (amp_rewrite.training) and mixed-precision training through amp_rewrite.rewrite(training=True).

Issue 5. Shapes are tiny (FP16 matmul on CPU is slow) and torch runs on one thread (the CI box
has two busy cores; more threads only oversubscribe them).
"""

from __future__ import annotations

import copy
import json
import math
import os
import socket
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

import amp_rewrite  # noqa: E402
from amp_rewrite.errors import UsageError
from amp_rewrite.training import LossScaler, register_training_module  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class ScaledLinear(torch.nn.Module):
    """What rewrite(training=True) produces, by hand: the loss times its own amp_loss_scale buffer,
    registered as rewrite() registers its modules."""

    def __init__(self, n_in: int = 4) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(n_in, 1)
        self.register_buffer("amp_loss_scale", torch.ones(()))
        self.amp_training = True
        register_training_module(self)

    def forward(self, x, y):
        return F.mse_loss(self.lin(x), y) * self.amp_loss_scale


class Plain(torch.nn.Module):
    def __init__(self, n_in: int = 4) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(n_in, 1)

    def forward(self, x, y):
        return F.mse_loss(self.lin(x), y)


def _data(n=16, n_in=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, n_in, generator=g), torch.randn(n, 1, generator=g)


def _grads(module):
    return [p.grad.clone() for p in module.parameters()]


def _params(module):
    return [p.detach().clone() for p in module.parameters()]


def _inject_inf(module):
    next(module.parameters()).grad.view(-1)[0] = math.inf


# -- the scaler on its own ---------------------------------------------------------------------------------
def test_defaults_agree_with_the_onnx_side():
    from amp_rewrite import training, training_onnx

    for key in ("INIT_SCALE", "GROWTH_FACTOR", "BACKOFF_FACTOR", "GROWTH_INTERVAL", "MIN_SCALE", "MAX_SCALE"):
        assert getattr(training, key) == getattr(training_onnx, key), key
    s = LossScaler()
    assert (s.get_scale(), s.growth_factor, s.backoff_factor, s.growth_interval) == (2.0 ** 16, 2.0, 0.5, 2000)
    assert amp_rewrite.LossScaler is LossScaler


def test_package_import_stays_torch_free():
    code = ("import sys, amp_rewrite, amp_rewrite.training_onnx; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_backward_finds_the_module_and_grads_are_the_fp32_grads():
    x, y = _data()
    model = ScaledLinear()
    ref = copy.deepcopy(model)
    ref(x, y).backward()
    scaler = LossScaler()  # not attached: backward finds the module from the loss's autograd graph
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    loss = model(x, y)  # buffer still 1.0 on this first step
    scaler.backward(loss)
    for g in _grads(model):
        assert g.abs().max() > 100  # they carry 2**16
    scaler.unscale_(opt)
    for got, want in zip(_grads(model), _grads(ref)):
        torch.testing.assert_close(got, want)
    scaler.step(opt)
    assert float(model.amp_loss_scale) == 2.0 ** 16  # synced for the next forward
    opt.zero_grad()
    scaler.backward(model(x, y))  # now the graph applies the scale itself
    scaler.unscale_(opt)
    for got, want in zip(_grads(model), _grads(ref)):
        torch.testing.assert_close(got, want)


def test_a_scale_buffer_placed_where_another_scalar_was_is_still_found():
    """The scaler remembered the address of each saved scalar it found to be no module's scale (a
    per-step loss weight), and never looked at that address again. A rewritten module created later
    (a deep copy) whose scale buffer the allocator put there went unnoticed: the scaler scaled its
    loss again, unscaled once, and the optimizer got gradients 65536 times too large. Here the
    second module's buffer is given the weight's very storage, as the allocator would."""
    x, y = _data()
    first = ScaledLinear()
    scaler = LossScaler()
    opt = torch.optim.SGD(first.parameters(), lr=0.0)
    weight = torch.tensor(0.5)
    scaler.backward(first(x, y) * weight)  # the weight: a saved FP32 scalar, found to be no scale
    scaler.step(opt)
    opt.zero_grad()
    second = ScaledLinear()
    second.load_state_dict(first.state_dict())
    ref = copy.deepcopy(second)
    ref.amp_loss_scale.fill_(1.0)
    ref(x, y).backward()
    second._buffers["amp_loss_scale"] = weight.fill_(scaler.get_scale())  # (the address the weight had)
    opt2 = torch.optim.SGD(second.parameters(), lr=0.0)
    scaler.backward(second(x, y))
    scaler.unscale_(opt2)
    for got, want in zip(_grads(second), _grads(ref)):
        torch.testing.assert_close(got, want)


def test_plain_loss_backward_with_an_attached_module():
    x, y = _data()
    model = ScaledLinear()
    ref = copy.deepcopy(model)
    ref(x, y).backward()
    scaler = LossScaler(model, init_scale=1024.0)
    assert float(model.amp_loss_scale) == 1024.0
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    model(x, y).backward()  # scaled inside the graph
    scaler.unscale_(opt)
    for got, want in zip(_grads(model), _grads(ref)):
        torch.testing.assert_close(got, want)
    scaler.step(opt)
    assert scaler.history[-1]["skipped"] is False


def test_plain_module_is_scaled_by_the_scaler():
    x, y = _data()
    model = Plain()
    ref = copy.deepcopy(model)
    ref(x, y).backward()
    scaler = LossScaler(init_scale=256.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler.scale(model(x, y)).backward()
    assert torch.allclose(_grads(model)[0], 256.0 * _grads(ref)[0])
    scaler.step(opt)
    for got, want in zip(_grads(model), _grads(ref)):
        torch.testing.assert_close(got, want)
    with pytest.raises(ValueError, match="amp_loss_scale"):
        LossScaler(model)


def test_injected_overflow_skips_the_step_and_backs_off():
    x, y = _data()
    model = ScaledLinear()
    scaler = LossScaler(model, init_scale=1024.0, growth_interval=100)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.backward(model(x, y))
    scaler.step(opt)
    opt.zero_grad()
    assert scaler.growth_tracker == 1
    before = _params(model)
    scaler.backward(model(x, y))
    _inject_inf(model)
    assert scaler.step(opt) is None
    for p, q in zip(_params(model), before):
        assert torch.equal(p, q)  # the step was skipped
    assert scaler.get_scale() == 512.0 and scaler.growth_tracker == 0
    assert float(model.amp_loss_scale) == 512.0
    assert scaler.skipped_steps == [1]
    opt.zero_grad()
    nan_step_before = _params(model)
    scaler.backward(model(x, y))
    next(model.parameters()).grad.view(-1)[1] = math.nan
    scaler.step(opt)
    assert all(torch.equal(p, q) for p, q in zip(_params(model), nan_step_before))
    assert scaler.get_scale() == 256.0


def _drive(scaler, flags, *, module=None):
    """One step per flag (True: overflow); returns the scale after each update."""
    x, y = _data()
    model = module or ScaledLinear()
    scaler.attach(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scales = []
    for overflow in flags:
        opt.zero_grad()
        scaler.backward(model(x, y))
        if overflow:
            _inject_inf(model)
        scaler.step(opt)
        scales.append(scaler.get_scale())
    return scales


def test_growth_after_interval_floor_and_ceiling():
    scaler = LossScaler(init_scale=4.0, growth_interval=3, min_scale=1.0, max_scale=16.0)
    scales = _drive(scaler, [False] * 3 + [False] * 3 + [False] * 3 + [True] * 6 + [False] * 3)
    #              3 finite: x2     x2 (16)      ceiling holds   halvings to the floor   growth again
    assert scales == [4, 4, 8, 8, 8, 16, 16, 16, 16, 8, 4, 2, 1, 1, 1, 1, 1, 2]
    assert scaler.summary()["floor_hits"] == 2
    assert scaler.summary()["skipped"] == 6


def test_equal_floor_and_ceiling_hold_a_dynamic_scale_where_it_is():
    scaler = LossScaler(init_scale=8.0, min_scale=8.0, max_scale=8.0, growth_interval=1)
    assert _drive(scaler, [False, True, False]) == [8.0, 8.0, 8.0]
    assert scaler.skipped_steps == [1]


def test_static_and_disabled():
    static = LossScaler(init_scale=128.0, dynamic=False)
    assert _drive(static, [False, True, False, False]) == [128.0] * 4
    assert static.skipped_steps == [1]  # static scaling still skips overflowing steps
    x, y = _data()
    model = ScaledLinear()
    off = LossScaler(model, enabled=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = _params(model)
    off.backward(model(x, y))
    off.step(opt)
    assert off.get_scale() == 1.0 and float(model.amp_loss_scale) == 1.0
    assert not torch.equal(_params(model)[0], before[0])


def test_unscale_before_clipping():
    x, y = _data()
    model = ScaledLinear()
    ref = copy.deepcopy(model)
    ref(x, y).backward()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    ref_opt.step()
    scaler = LossScaler(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    scaler.backward(model(x, y))
    scaler.unscale_(opt)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    assert 0.1 < float(norm) < 100  # the true norm, not the scaled one
    with pytest.raises(RuntimeError, match="already"):
        scaler.unscale_(opt)
    scaler.step(opt)  # does not unscale a second time
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q)


def test_gradient_accumulation():
    x, y = _data(n=32)
    model = ScaledLinear()
    ref = copy.deepcopy(model)
    for half in (slice(0, 16), slice(16, 32)):
        (ref(x[half], y[half]) / 2).backward()
    scaler = LossScaler(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    for half in (slice(0, 16), slice(16, 32)):
        scaler.backward(model(x[half], y[half]) / 2)
    scaler.unscale_(opt)
    for got, want in zip(_grads(model), _grads(ref)):
        torch.testing.assert_close(got, want)
    scaler.step(opt)
    assert scaler.steps == 1


def test_several_optimizers():
    x, y = _data()
    model = ScaledLinear()
    scaler = LossScaler(model, init_scale=64.0, growth_interval=1, auto_update=False)
    opt_w = torch.optim.SGD([model.lin.weight], lr=0.1)
    opt_b = torch.optim.Adam([model.lin.bias], lr=0.1)
    before = _params(model)
    scaler.backward(model(x, y))
    model.lin.bias.grad.fill_(math.inf)  # only the second optimizer's gradients overflow
    scaler.step(opt_w)
    scaler.step(opt_b)
    scaler.update()
    assert not torch.equal(model.lin.weight, before[0])  # as GradScaler: each optimizer decides its own step
    assert torch.equal(model.lin.bias, before[1])
    assert scaler.get_scale() == 32.0  # any overflow backs off
    scaler.update()  # nothing pending: a no-op
    assert scaler.get_scale() == 32.0 and scaler.steps == 1


@pytest.mark.parametrize("module", [ScaledLinear, Plain])
def test_several_optimizers_with_auto_update_are_refused_not_unscaled_wrong(module):
    """GradScaler's loop, step(a); step(b); update(), with auto_update on: step(a) updated the scale
    (here it grows every step), and b's gradients, made before, were unscaled by the new one
    (half size, silently). It is an error naming auto_update=False."""
    x, y = _data()
    model = module()
    scaler = LossScaler(init_scale=64.0, growth_interval=1)
    opt_w = torch.optim.SGD([model.lin.weight], lr=0.1)
    opt_b = torch.optim.SGD([model.lin.bias], lr=0.1)
    scaler.backward(model(x, y))
    scaler.step(opt_w)
    assert scaler.get_scale() == 128.0
    with pytest.raises(RuntimeError, match="second optimizer.*auto_update=False"):
        scaler.step(opt_b)


@pytest.mark.parametrize("scale_input", [1.0, 0.01], ids=["backoff", "growth"])
def test_a_second_optimizer_of_another_module_after_an_auto_update_is_refused(scale_input):
    """The same loop where the second optimizer holds another module's parameters (a head whose
    term the loss adds): nobody recorded its gradients, so they passed for new ones, and it stepped
    them unscaled by the updated scale (2x after a backoff, 0.5x after a growth), updating the
    scale twice. Only a backward pass since (which writes the first module's gradients) makes
    them new."""
    torch.manual_seed(0)
    x, y, z = torch.randn(4, 8) * scale_input, torch.randn(4, 4) * scale_input, torch.randn(4, 8)
    model = _MseModule()
    gm = amp_rewrite.rewrite(model, example_inputs=(x, y), training=True)
    head = torch.nn.Linear(8, 1)
    scaler = LossScaler(gm, growth_interval=1)
    opt_a, opt_b = torch.optim.SGD(gm.parameters(), lr=0.1), torch.optim.SGD(head.parameters(), lr=0.1)
    scaler.backward(gm(x, y) + head(z).pow(2).mean())
    before = scaler.get_scale()
    scaler.step(opt_a)
    assert scaler.get_scale() != before
    with pytest.raises(RuntimeError, match="second optimizer.*auto_update=False"):
        scaler.step(opt_b)
    # a new backward pass makes both sets of gradients afresh: each optimizer steps after its own
    opt_a.zero_grad()
    opt_b.zero_grad()
    gm(x, y).backward()
    scaler.step(opt_a)
    scaler.backward(head(z).pow(2).mean())
    scaler.step(opt_b)


def test_a_plain_backward_over_an_unattached_training_rewrite_is_refused():
    """Two training rewrites, one attached, and a plain (g1 + g2).backward(): g2's gradients carry
    its own buffer's scale (1, never updated) and step() divided them by g1's 65536 at every step:
    g2 never trained, silently. Attached too, both train."""
    torch.manual_seed(0)
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    g1 = amp_rewrite.rewrite(_MseModule(), example_inputs=(x, y), training=True)
    g2 = amp_rewrite.rewrite(_MseModule(), example_inputs=(x, y), training=True)
    scaler = LossScaler(g1)
    opt = torch.optim.SGD([*g1.parameters(), *g2.parameters()], lr=0.1)
    (g1(x, y) + g2(x, y)).backward()
    with pytest.raises(RuntimeError, match="not attached to.*scaler.attach"):
        scaler.step(opt)
    opt.zero_grad()
    scaler.attach(g2)
    reference = copy.deepcopy(g2)
    (g1(x, y) + g2(x, y)).backward()
    scaler.unscale_(opt)
    scale = float(reference.amp_loss_scale)
    reference(x, y).backward()
    for p, q in zip(g2.parameters(), reference.parameters()):
        assert torch.allclose(p.grad, q.grad / scale, rtol=1e-3, atol=1e-7)


class _MseModule(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 4)

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.lin(x), y)


def test_alternating_optimizers_each_after_its_own_backward_need_no_flag():
    """A GAN-like loop steps a different optimizer after each backward: with auto_update on that
    is one step per update, whether the backward went through the scaler or the in-graph scale."""
    x, y = _data()
    model = ScaledLinear()
    ref = copy.deepcopy(model)
    scaler = LossScaler(model, init_scale=64.0, growth_interval=1)
    opt_w = torch.optim.SGD([model.lin.weight], lr=0.0)
    opt_b = torch.optim.SGD([model.lin.bias], lr=0.0)
    ref(x, y).backward()
    for opt in (opt_w, opt_b, opt_w, opt_b):
        model.zero_grad()
        model(x, y).backward()  # the graph's own scale, no scaler call
        scaler.unscale_(opt)
        torch.testing.assert_close(_grads(model)[0 if opt is opt_w else 1], _grads(ref)[0 if opt is opt_w else 1])
        scaler.step(opt)
    assert scaler.get_scale() == 64.0 * 2 ** 4


def test_a_retained_graph_backward_twice_divides_the_in_graph_scale_once_per_pass():
    """scaler.backward(loss, retain_graph=True) twice: each pass's gradients carry the scale once
    (the dividing pre-hook went on the scale node once per call: the second pass was divided twice)."""
    x, y = _data()
    model = ScaledLinear()
    ref = copy.deepcopy(model)
    ref(x, y).backward()
    scaler = LossScaler(model, init_scale=1024.0)
    loss = model(x, y) + 0.0 * model.lin.weight.sum()  # a term outside the graph: the scaler scales the sum
    scaler.backward(loss, retain_graph=True)
    first = _grads(model)
    scaler.backward(loss)
    second = [g - f for g, f in zip(_grads(model), first)]
    for got, want in zip(second, first):
        torch.testing.assert_close(got, want)
    for got, want in zip(first, _grads(ref)):
        torch.testing.assert_close(got / 1024.0, want)


def test_checkpoint_restore_resumes_the_same_scale(tmp_path):
    flags = [False, False, True, False, False, False, True, False]
    a = LossScaler(init_scale=2.0 ** 10, growth_interval=2)
    _drive(a, flags[:5])
    path = tmp_path / "scaler.pt"
    torch.save(a.state_dict(), path)
    rest_a = _drive(a, flags[5:])
    b = LossScaler()
    model = ScaledLinear()
    b.attach(model)
    b.load_state_dict(torch.load(path))
    assert b.get_scale() == _reference(flags[:5], 2.0 ** 10, 2)[-1] == 2048.0
    assert b.growth_tracker == a.history[4]["growth_tracker"]
    assert float(model.amp_loss_scale) == b.get_scale()  # the buffer follows the restored scale
    assert b.steps == 5 and b.skipped_steps == [2]
    assert _drive(b, flags[5:], module=model) == rest_a


def test_a_restored_scaler_summarises_the_run_from_its_first_scale():
    """The summary after a checkpoint restore starts from the scale the run began with."""
    a = LossScaler(init_scale=2.0 ** 10, growth_interval=1)
    _drive(a, [False, False])
    b = LossScaler()
    b.load_state_dict(a.state_dict())
    assert b.summary()["init_scale"] == 2.0 ** 10
    assert b.summary_text() == a.summary_text()
    assert "scale 1024 -> 4096" in b.summary_text()


def test_loads_a_gradscaler_state_dict():
    gs = torch.amp.GradScaler("cpu", init_scale=512.0, growth_interval=7)
    gs._lazy_init_scale_growth_tracker(torch.device("cpu"))
    s = LossScaler()
    s.load_state_dict(gs.state_dict())
    assert s.get_scale() == 512.0 and s.growth_interval == 7 and s.growth_tracker == 0


def test_the_summary_after_a_gradscaler_state_counts_from_the_loaded_scale():
    """A GradScaler state has no history: the summary starts at its scale, not at this scaler's
    own initial one (it said "scale 65536 -> 512 (range 512..512, 0 backoffs)"), and drops what the
    scaler did before the load."""
    s = LossScaler(growth_interval=1)
    _drive(s, [False, True])
    s.load_state_dict({"scale": 512.0, "_growth_tracker": 0, "growth_factor": 2.0, "backoff_factor": 0.5,
                       "growth_interval": 2})
    assert s.summary_text() == ("loss scaling (dynamic): 0 steps, 0 skipped; scale 512 -> 512 (range 512..512, "
                                "0 growths, 0 backoffs)")
    fresh = LossScaler(init_scale=512.0, growth_interval=2)
    for scaler in (s, fresh):
        _drive(scaler, [False, False, True])
    assert s.summary_text() == fresh.summary_text()
    assert "3 steps, 1 skipped (steps 2); scale 512 -> 512 (range 512..1024, 1 growths, 1 backoffs)" in s.summary_text()


def test_a_gradscaler_state_dict_carries_its_growth_tracker():
    """A GradScaler checkpoint taken part-way through a growth interval resumes there: its
    ``_growth_tracker`` becomes the scaler's tracker, so the next growth comes as GradScaler's would."""
    gs = torch.amp.GradScaler("cpu", init_scale=512.0, growth_interval=3)
    gs._lazy_init_scale_growth_tracker(torch.device("cpu"))
    gs._growth_tracker.fill_(2)
    s = LossScaler()
    s.load_state_dict(gs.state_dict())
    assert s.growth_tracker == 2
    assert _drive(s, [False, False]) == [1024.0, 1024.0]  # one finite step completes the interval


# -- against torch.amp.GradScaler -----------------------------------------------------------------------------
def _reference(flags, init, interval, growth=2.0, backoff=0.5, floor=0.0, ceiling=math.inf):
    """The documented update rule, in plain Python."""
    scale, tracker, out = init, 0, []
    for overflow in flags:
        if overflow:
            scale, tracker = max(scale * backoff, floor), 0
        else:
            tracker += 1
            if tracker == interval:
                scale, tracker = min(scale * growth, ceiling), 0
        out.append(scale)
    return out


def _gradscaler_trajectory(flags, init, interval):
    x, y = _data()
    model = Plain()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    gs = torch.amp.GradScaler("cpu", init_scale=init, growth_interval=interval)
    out = []
    for overflow in flags:
        opt.zero_grad()
        gs.scale(model(x, y)).backward()
        if overflow:
            _inject_inf(model)
        gs.step(opt)
        gs.update()
        out.append(gs.get_scale())
    return out


FLAGS = [False] * 4 + [True] + [False] * 7 + [True, True] + [False] * 9 + [True] + [False] * 3


def test_scale_trajectory_matches_gradscaler():
    torch_scales = _gradscaler_trajectory(FLAGS, 2.0 ** 12, 3)
    ours = _drive(LossScaler(init_scale=2.0 ** 12, growth_interval=3), FLAGS)
    assert ours == torch_scales
    assert ours == _reference(FLAGS, 2.0 ** 12, 3)


def test_scale_trajectory_differs_from_gradscaler_only_at_the_floor():
    flags = [True] * 6 + [False] * 4 + [True] + [False] * 2
    torch_scales = _gradscaler_trajectory(flags, 4.0, 2)
    ours = _drive(LossScaler(init_scale=4.0, growth_interval=2, min_scale=1.0), flags)
    # GradScaler: 2, 1, 0.5, 0.25, ... ; ours stops at the floor 1.0 and grows from there.
    assert torch_scales[:2] == ours[:2] == [2.0, 1.0]
    assert torch_scales[2:6] == [0.5, 0.25, 0.125, 0.0625]
    assert ours == _reference(flags, 4.0, 2, floor=1.0) == [2, 1, 1, 1, 1, 1, 1, 2, 2, 4, 2, 2, 4]
    # with the floor out of the way the two agree step for step
    assert _drive(LossScaler(init_scale=4.0, growth_interval=2, min_scale=2.0 ** -20), flags) == torch_scales


# -- DDP --------------------------------------------------------------------------------------------------------
_DDP_WORKER = textwrap.dedent("""
    import json, math, os, sys
    import torch, torch.distributed as dist
    import torch.nn.functional as F
    sys.path.insert(0, {root!r})
    from amp_rewrite.training import LossScaler

    class ScaledLinear(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 1)
            self.register_buffer("amp_loss_scale", torch.ones(()))
            self.amp_training = True
        def forward(self, x, y):
            return F.mse_loss(self.lin(x), y) * self.amp_loss_scale

    def main(rank, port, out):
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{{port}}", rank=rank, world_size=2)
        torch.manual_seed(0)
        model = torch.nn.parallel.DistributedDataParallel(ScaledLinear())
        scaler = LossScaler(model, init_scale=1024.0, growth_interval=100)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(rank)  # different data on each rank
        params = []
        for step in range(4):
            opt.zero_grad()
            x, y = torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)
            scaler.backward(model(x, y))
            if step == 2 and rank == 1:  # after DDP's all-reduce: only rank 1 sees it
                model.module.lin.weight.grad[0, 0] = math.inf
            scaler.step(opt)
            params.append([p.detach().flatten().tolist() for p in model.parameters()])
        with open(os.path.join(out, f"rank{{rank}}.json"), "w") as f:
            json.dump({{"history": scaler.history, "params": params}}, f)
        # Both ranks finish their collectives before either leaves. Then no teardown: gloo's
        # destructors at exit still aborted a rank now and then under load ("terminate called
        # without an active exception", exit -6) after all the work was done and written.
        dist.barrier()
        sys.stderr.flush()
        os._exit(0)

    if __name__ == "__main__":
        main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ddp_one_rank_overflows_both_skip(tmp_path):
    """Two gloo ranks on localhost (two processes started here: cheaper than mp.spawn's three)."""
    script = tmp_path / "ddp_worker.py"
    script.write_text(_DDP_WORKER.format(root=str(ROOT)))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    port = str(_free_port())
    procs = [subprocess.Popen([sys.executable, str(script), str(rank), port, str(tmp_path)], env=env,
                              stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    try:
        errors = [p.communicate(timeout=120)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(e[-3000:] for e in errors)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for r in ranks:
        assert [e["skipped"] for e in r["history"]] == [False, False, True, False]
        assert [e["next_scale"] for e in r["history"]] == [1024.0, 1024.0, 512.0, 512.0]
        assert r["params"][2] == r["params"][1]  # the skipped step left the parameters alone
        assert r["params"][3] != r["params"][2]
    assert ranks[0]["params"] == ranks[1]["params"]  # identical on both ranks, every step


# -- history -----------------------------------------------------------------------------------------------------
def test_history_summary_and_report():
    scaler = LossScaler(init_scale=8.0, growth_interval=2)
    _drive(scaler, [False, False, True, False])
    h = scaler.history
    assert [e["scale"] for e in h] == [8.0, 8.0, 16.0, 8.0]
    assert [e["skipped"] for e in h] == [False, False, True, False]
    s = scaler.summary()
    assert (s["steps"], s["skipped"], s["skipped_steps"], s["growths"], s["backoffs"]) == (4, 1, [2], 1, 1)
    text = scaler.summary_text()
    assert "1 skipped" in text and "steps 2" in text
    from amp_rewrite.decisions import DecisionLog
    from amp_rewrite.report import Report

    report = scaler.add_to_report(Report.from_log(DecisionLog()))
    assert text in report.log.notes
    scaler.add_to_report(report)
    assert report.log.notes.count(text) == 1


def test_history_limit_bounds_the_history_and_the_skipped_steps():
    """``history_limit`` keeps the last entries of the history and of the skipped steps alike (a
    long run that overflows often holds no unbounded list); the counts stay whole."""
    scaler = LossScaler(init_scale=2.0 ** 10, growth_interval=100, history_limit=2)
    _drive(scaler, [True, False, True, True])
    assert [e["step"] for e in scaler.history] == [2, 3]
    assert scaler.skipped_steps == [2, 3]
    assert scaler.steps == 4 and scaler.summary()["skipped"] == 3


def test_step_without_gradients_is_not_an_error():
    model = Plain()
    scaler = LossScaler()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.step(opt)  # nothing to unscale: the optimizer steps (a no-op) and the scale counts a finite step
    assert scaler.history[-1]["skipped"] is False


def test_overflows_at_the_floor_warn_after_ten_in_a_row_only():
    """Ten steps in a row that overflow at the floor scale warn (the gradients are non-finite
    before any scaling); overflows split by a finite step are not in a row and do not."""
    floor = LossScaler(init_scale=1.0, min_scale=1.0, growth_interval=100)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _drive(floor, [True] * 9)
        assert not [w for w in caught if "in a row" in str(w.message)]
        _drive(floor, [True])
    assert [str(w.message) for w in caught if "in a row" in str(w.message)] == [
        "LossScaler: 10 steps in a row overflowed at the floor scale 1: the gradients are non-finite before "
        "scaling (NaN in the data or a diverged model?)"]
    split = LossScaler(init_scale=1.0, min_scale=1.0, growth_interval=100)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _drive(split, [True] * 5 + [False] + [True] * 5)
    assert not [w for w in caught if "in a row" in str(w.message)]


# -- through amp_rewrite.rewrite(training=True) -------------------------------------------------------------------
class MLPLoss(torch.nn.Module):
    def __init__(self, n_in=8, hidden=16, loss_factor=1.0):
        super().__init__()
        self.l1 = torch.nn.Linear(n_in, hidden)
        self.l2 = torch.nn.Linear(hidden, 1)
        self.loss_factor = loss_factor

    def forward(self, x, y):
        return F.mse_loss(self.l2(torch.tanh(self.l1(x))), y) * self.loss_factor


def _rewrite_for_training(model, example, target):
    """A training rewrite with the in-graph loss scale (bf16 adds none by default: the scaler's
    mechanics are tested on bf16 with loss_scaling=True, because FP16 math on CPU is slow)."""
    gm = amp_rewrite.rewrite(model, example_inputs=example, training=True, target=target, loss_scaling=True)
    assert hasattr(gm, "amp_loss_scale") and gm.amp_training is True and gm.amp_loss_scaling is True
    return gm


def test_rewritten_module_keeps_fp32_parameters_and_loss():
    torch.manual_seed(0)
    x, y = torch.randn(8, 8), torch.randn(8, 1)
    gm = _rewrite_for_training(MLPLoss(), (x, y), "fp16")
    assert all(p.dtype == torch.float32 for p in gm.parameters())
    loss = gm(x, y)
    assert loss.dtype == torch.float32 and loss.dim() == 0
    loss.backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in gm.parameters())


def test_the_readmes_recipe_logs_the_true_loss_from_the_first_step():
    """The README built LossScaler() without the module and logged loss.item() / get_scale(): the
    scaler learns the module at its first backward, so the first forward ran at scale 1 and the
    logged loss was 65536 times too small (every HF and vision model logged 0.0000 first). The
    README now gives the scaler the module and divides by the scale the forward applied."""
    torch.manual_seed(0)
    model = MLPLoss()
    x, y = torch.randn(8, 8), torch.randn(8, 1)
    data = [(x, y), (x * 0.5, y)]
    ref, gm = copy.deepcopy(model), _rewrite_for_training(model, (x, y), "bf16")
    scaler = LossScaler(gm)
    optimizer, ref_optimizer = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (gm, ref))
    for step, (xb, yb) in enumerate(data):
        loss = gm(xb, yb)
        logged = loss.item() / float(gm.amp_loss_scale)
        scaler.backward(loss)
        scaler.step(optimizer)
        optimizer.zero_grad()
        want = ref(xb, yb)
        want.backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
        assert float(gm.amp_loss_scale) == 2.0 ** 16 and math.isclose(logged, want.item(), rel_tol=2e-2), step
    unattached, fresh = LossScaler(), _rewrite_for_training(MLPLoss(), (x, y), "bf16")
    assert unattached.get_scale() == 2.0 ** 16 and float(fresh.amp_loss_scale) == 1.0  # (why the README attaches it)


def test_fp16_gradients_underflow_without_scaling():
    torch.manual_seed(0)
    model = MLPLoss(loss_factor=1e-6)  # tiny loss: dL/dout ~ 3e-8, below FP16's smallest subnormal
    x, y = torch.randn(64, 8), torch.randn(64, 1)
    ref = copy.deepcopy(model)
    ref(x, y).backward()
    want = torch.cat([p.grad.flatten() for p in ref.parameters()])
    gm = _rewrite_for_training(copy.deepcopy(model), (x, y), "fp16")
    results = {}
    for name, enabled in (("unscaled", False), ("scaled", True)):
        scaler = LossScaler(gm, enabled=enabled)
        gm.zero_grad()
        opt = torch.optim.SGD(gm.parameters(), lr=0.0)
        scaler.backward(gm(x, y))
        scaler.unscale_(opt)
        got = torch.cat([p.grad.flatten() for p in gm.parameters()])
        results[name] = (float((got[want != 0] == 0).float().mean()), float(F.cosine_similarity(got, want, dim=0)))
    zero_unscaled, cos_unscaled = results["unscaled"]
    zero_scaled, cos_scaled = results["scaled"]
    print(f"\nunderflow: without scaling {zero_unscaled:.0%} of gradients are 0 (cosine {cos_unscaled:.3f}); "
          f"with the scaler {zero_scaled:.0%} (cosine {cos_scaled:.6f})")
    assert zero_unscaled > 0.5 and cos_unscaled < 0.95
    assert zero_scaled == 0.0 and cos_scaled > 0.999


def _train(model, X, Y, steps, scaler=None, seed=1):
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        idx = torch.randint(0, X.shape[0], (32,), generator=g)
        loss = model(X[idx], Y[idx])
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.backward(loss)
            scaler.step(opt)
        opt.zero_grad()
    return model


def _fp32_loss(reference, trained, X, Y):
    """Loss of the trained parameters, evaluated in FP32 on the whole set."""
    model = copy.deepcopy(reference)
    state = {k: v for k, v in trained.state_dict().items() if k in model.state_dict()}
    model.load_state_dict(state)
    with torch.no_grad():
        return float(model(X, Y))


@pytest.fixture(scope="module")
def regression():
    torch.manual_seed(0)
    X = torch.randn(256, 8)
    Y = torch.tanh(X @ torch.randn(8, 1) * 0.5) + 0.05 * torch.randn(256, 1)
    base = MLPLoss()
    with torch.no_grad():
        initial = float(base(X, Y))
    fp32 = _fp32_loss(base, _train(copy.deepcopy(base), X, Y, 200), X, Y)
    return X, Y, base, initial, fp32


@pytest.mark.parametrize("target", ["bf16", "fp16"])
def test_training_200_steps_ends_near_fp32(regression, target):
    """fp16 trains with the in-graph loss scale and a LossScaler; bf16, which keeps FP32's exponent
    range, with none: a plain loss.backward() / optimizer.step() loop (issue 6: "no loss scaling")."""
    X, Y, base, initial, fp32 = regression
    gm = amp_rewrite.rewrite(copy.deepcopy(base), example_inputs=(X[:32], Y[:32]), training=True, target=target)
    assert gm.amp_loss_scaling is (target == "fp16") and hasattr(gm, "amp_loss_scale") is (target == "fp16")
    scaler = LossScaler(gm) if target == "fp16" else None
    final = _fp32_loss(base, _train(gm, X, Y, 200, scaler), X, Y)
    print(f"\n{target}: initial loss {initial:.5f}, final FP32 {fp32:.5f}, final {target} {final:.5f} "
          f"({(final - fp32) / fp32:+.2%}); {scaler.summary_text() if scaler else 'no loss scaling'}")
    assert fp32 < 0.1 * initial  # it learned something
    assert abs(final - fp32) <= 0.05 * fp32
    assert all(p.dtype == torch.float32 for p in gm.parameters())
    from amp_rewrite.fx_api import report_of

    if scaler is None:
        assert any(n.startswith("training: no loss scaling (bf16") for n in report_of(gm).log.notes)
        return
    assert float(gm.amp_loss_scale) == scaler.get_scale()
    scaler.add_to_report(gm)  # the module's own report now carries the scaling history
    assert scaler.summary_text() in report_of(gm).log.notes


def test_bf16_training_adds_no_loss_scale_unless_asked():
    """Issue 6: BF16 needs no loss scaling. The bf16 rewrite adds no amp_loss_scale buffer and
    returns the loss as computed, with FP32 master weights and FP32 gradients; a LossScaler refuses
    to attach to it, saying how to train it (or pass-through with enabled=False);
    loss_scaling=True adds the scale back, loss_scaling=False takes it off fp16."""
    torch.manual_seed(0)
    x, y = torch.randn(8, 8), torch.randn(8, 1)
    model = MLPLoss()
    gm = amp_rewrite.rewrite(copy.deepcopy(model), example_inputs=(x, y), training=True, target="bf16")
    assert not hasattr(gm, "amp_loss_scale") and gm.amp_training is True and gm.amp_loss_scaling is False
    assert not any(n.op == "get_attr" and n.target == "amp_loss_scale" for n in gm.graph.nodes)
    from amp_rewrite.fx_api import report_of

    heavy = report_of(gm).summary()["heavy_ops"]
    assert heavy["low"] == heavy["total"] == 2  # (both Linears did go bf16)
    loss = gm(x, y)
    assert loss.dtype == torch.float32 and loss.item() == pytest.approx(model(x, y).item(), rel=2e-2)
    loss.backward()
    model(x, y).backward()
    for got, want in zip(gm.parameters(), model.parameters()):
        assert got.dtype == torch.float32 and got.grad.dtype == torch.float32
        torch.testing.assert_close(got.grad, want.grad, rtol=5e-2, atol=2e-2 * want.grad.abs().max().item())
    with pytest.raises(ValueError, match=r"without loss scaling .*loss.backward\(\) and optimizer.step\(\).*"
                                         r"LossScaler\(enabled=False\)"):
        LossScaler(gm)
    passthrough = LossScaler(gm, enabled=False)
    gm.zero_grad()
    passthrough.backward(gm(x, y))
    passthrough.step(torch.optim.SGD(gm.parameters(), lr=0.0))
    assert passthrough.get_scale() == 1.0 and all(torch.isfinite(p.grad).all() for p in gm.parameters())
    assert copy.deepcopy(gm).amp_loss_scaling is False  # (kept by a deep copy, like amp_training)
    scaled = amp_rewrite.rewrite(copy.deepcopy(model), example_inputs=(x, y), training=True, target="bf16",
                                 loss_scaling=True)
    assert hasattr(scaled, "amp_loss_scale") and scaled.amp_loss_scaling is True
    unscaled = amp_rewrite.rewrite(copy.deepcopy(model), example_inputs=(x, y), training=True, loss_scaling=False)
    assert not hasattr(unscaled, "amp_loss_scale") and unscaled.amp_loss_scaling is False
    with pytest.raises(UsageError, match="loss_scaling applies to training"):
        amp_rewrite.rewrite(copy.deepcopy(model), example_inputs=(x, y), loss_scaling=False)
    with pytest.raises(UsageError, match=r"loss_scaling='no': pass True, False or None"):
        amp_rewrite.rewrite(copy.deepcopy(model), example_inputs=(x, y), training=True, loss_scaling="no")


# -- found by a bug hunt: terms outside the graph, hidden scale nodes, modes, checkpoints ----------------------
def _grads_by_name(module):
    return {n: p.grad.clone() for n, p in module.named_parameters()}


def test_terms_added_outside_the_graph_get_the_same_scale():
    """loss = gm(x, y) + reg: the scaler multiplied the whole loss by want/graph = 1, so the regulariser's
    gradient came out unscaled and was then divided by the scale (1/65536 of the truth)."""
    torch.manual_seed(0)
    x, y = torch.randn(8, 8), torch.randn(8, 1)
    model = MLPLoss()
    gm = _rewrite_for_training(copy.deepcopy(model), (x, y), "bf16")
    reg = lambda m: 10 * sum((p ** 2).sum() for p in m.parameters())  # noqa: E731
    (model(x, y) + reg(model)).backward()
    want = _grads_by_name(model)
    scaler = LossScaler(gm)
    opt = torch.optim.SGD(gm.parameters(), lr=0.0)
    gm.zero_grad()
    scaler.backward(gm(x, y) + reg(gm))
    scaler.unscale_(opt)
    for name, grad in _grads_by_name(gm).items():
        torch.testing.assert_close(grad, want[name], rtol=3e-2, atol=1e-3 * want[name].abs().max().item())


def test_a_hidden_scale_node_is_refused_not_scaled_twice():
    """A reentrant checkpoint hides the in-graph Mul from autograd: the scaler took the graph scale
    as 1 and multiplied again, so the gradients were scale x too large, and finite."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    x, y = torch.randn(8, 8), torch.randn(8, 1)
    gm = _rewrite_for_training(MLPLoss(), (x, y), "bf16")
    scaler = LossScaler(gm, init_scale=1024.0)
    x.requires_grad_(True)
    loss = checkpoint(gm, x, y, use_reentrant=True)
    with pytest.raises(RuntimeError, match="in-graph loss scale is hidden from autograd"):
        scaler.backward(loss)
    loss.backward()  # the documented way: the graph scaled it, the attached scaler unscales by its buffer
    opt = torch.optim.SGD(gm.parameters(), lr=0.0)
    scaler.unscale_(opt)
    plain = MLPLoss()
    plain.load_state_dict(gm.state_dict())
    plain(x.detach(), y).backward()
    for (name, grad), ref in zip(_grads_by_name(gm).items(), plain.parameters()):
        torch.testing.assert_close(grad, ref.grad, rtol=3e-2, atol=1e-3 * ref.grad.abs().max().item())


class LogitsAndLoss(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = torch.nn.Linear(8, 16)
        self.l2 = torch.nn.Linear(16, 4)

    def forward(self, x, y):
        logits = self.l2(torch.tanh(self.l1(x)))
        return logits, F.mse_loss(logits, y)


@pytest.mark.parametrize("attached", [True, False])
def test_a_loss_of_the_users_own_from_the_logits_is_scaled_not_refused(attached):
    """The module returns (logits, loss); the user trains on a loss of their own from the logits
    (and a regulariser in its own backward). No scale node lies on that path, as none should: the
    scaler took that for torch.compile hiding one and refused, naming compile or a checkpoint."""
    torch.manual_seed(0)
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    model = LogitsAndLoss()
    gm = amp_rewrite.rewrite(copy.deepcopy(model), example_inputs=(x, y), training=True, target="bf16",
                             loss_scaling=True)
    scaler = LossScaler(gm, init_scale=1024.0) if attached else LossScaler(init_scale=1024.0)
    opt = torch.optim.SGD(gm.parameters(), lr=0.0)
    for _ in range(2):  # (refused from the first step attached, from the second discovered)
        gm.zero_grad()
        logits, _ = gm(x, y)
        scaler.backward(logits.pow(2).mean())
        scaler.backward(1e-3 * sum(p.pow(2).sum() for p in gm.parameters()))
        scaler.unscale_(opt)
        model.zero_grad()
        (model(x, y)[0].pow(2).mean() + 1e-3 * sum(p.pow(2).sum() for p in model.parameters())).backward()
        want = _grads_by_name(model)
        for name, grad in _grads_by_name(gm).items():
            torch.testing.assert_close(grad, want[name], rtol=3e-2, atol=1e-2 * want[name].abs().max().item())
        scaler.step(opt)


def test_a_scale_node_compiled_away_is_still_refused():
    """The refusal now needs a backward that hides what ran on the way to the parameters: one
    torch.compile wrote (its CompiledFunctionBackward holds the in-graph Mul) is one."""
    torch.manual_seed(0)
    x, y = torch.randn(8, 8), torch.randn(8, 1)
    gm = _rewrite_for_training(MLPLoss(), (x, y), "bf16")
    scaler = LossScaler(gm, init_scale=1024.0)
    compiled = torch.compile(gm, backend="aot_eager")
    with pytest.raises(RuntimeError, match="in-graph loss scale is hidden from autograd"):
        scaler.backward(compiled(x, y))


def test_attaching_a_scaler_between_forward_and_backward():
    """The scaler wrote its buffer in place; a forward pass whose backward was pending failed with
    "modified by an inplace operation"."""
    torch.manual_seed(0)
    x, y = torch.randn(8, 8), torch.randn(8, 1)
    gm = _rewrite_for_training(MLPLoss(), (x, y), "bf16")
    loss = gm(x, y)  # the buffer still holds 1.0
    scaler = LossScaler(gm)  # writes 65536 into it
    scaler.backward(loss)
    opt = torch.optim.SGD(gm.parameters(), lr=0.0)
    scaler.step(opt)
    assert scaler.history[-1]["skipped"] is False
    assert all(torch.isfinite(p.grad).all() for p in gm.parameters())


def test_eval_on_an_exported_rewrite_says_the_mode_is_in_the_graph():
    """gm.eval() on a rewrite captured by torch.export did nothing: dropout stayed on and BatchNorm
    kept updating its statistics."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Dropout(0.5))
    x = torch.randn(8, 4)
    gm = amp_rewrite.rewrite(model, example_inputs=(x,), target="bf16")
    assert gm.train() is gm  # the mode it was captured in: fine
    with pytest.raises(NotImplementedError, match=r"captured by torch.export in training mode.*model\.eval\(\)"):
        gm.eval()
    model.eval()
    frozen = amp_rewrite.rewrite(model, example_inputs=(x,), target="bf16")
    assert frozen.eval() is frozen
    with torch.no_grad():
        assert torch.equal(frozen(x), frozen(x))  # no dropout, running statistics


def test_the_mode_guard_reads_an_exported_program_sets_training_and_survives_a_deep_copy():
    """An ExportedProgram's module() says training=True whatever it was captured in: a rewrite of an
    eval-mode export refused gm.eval() (asking to re-export in eval) and accepted gm.train(). The
    allowed call never set gm.training, and a deep copy lost the guard (dropout stayed on after
    copy.deepcopy(gm).eval())."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Dropout(0.5))
    x = torch.randn(8, 4)
    frozen = amp_rewrite.rewrite(torch.export.export(copy.deepcopy(model).eval(), (x,)), target="bf16")
    assert frozen.training is False and frozen.eval() is frozen
    with pytest.raises(NotImplementedError, match=r"captured by torch.export in eval mode"):
        frozen.train()
    live = amp_rewrite.rewrite(torch.export.export(copy.deepcopy(model).train(), (x,)), target="bf16")
    assert live.training is True
    with pytest.raises(NotImplementedError, match=r"in training mode"):
        live.eval()
    plain = amp_rewrite.rewrite(torch.export.export(torch.nn.Linear(4, 4), (x,)), target="bf16")
    assert plain.eval() is plain and plain.training is False  # nothing in it depends on the mode
    assert plain.train().training is True
    from_module = amp_rewrite.rewrite(copy.deepcopy(model).eval(), example_inputs=(x,), target="bf16")
    assert from_module.training is False
    copied = copy.deepcopy(amp_rewrite.rewrite(copy.deepcopy(model).train(), example_inputs=(x,), target="bf16"))
    with pytest.raises(NotImplementedError, match=r"in training mode"):
        copied.eval()
    trained = copy.deepcopy(_rewrite_for_training(MLPLoss(), (torch.randn(8, 8), torch.randn(8, 1)), "bf16"))
    assert trained.amp_training is True  # (what LossScaler looks for)


def test_an_export_captured_in_both_modes_refuses_either_mode():
    """An ExportedProgram whose BatchNorm was captured in eval mode and its dropout in training mode
    holds both modes in its graph: the rewrite refuses gm.eval() and gm.train() alike, saying so."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Dropout(0.5)).train()
    model[1].eval()
    gm = amp_rewrite.rewrite(torch.export.export(model, (torch.randn(8, 4),)), target="bf16")
    for call in (gm.eval, gm.train):
        with pytest.raises(NotImplementedError, match="captured by torch.export in a mix of training and eval mode"):
            call()


def test_a_decomposed_eval_export_is_read_as_eval_mode():
    """run_decompositions() writes an eval-mode BatchNorm as _native_batch_norm_legit_no_training:
    the rewrite of that program is in eval mode, accepts gm.eval() and refuses gm.train()."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)).eval()
    program = torch.export.export(model, (torch.randn(8, 4),)).run_decompositions()
    gm = amp_rewrite.rewrite(program, target="bf16")
    assert gm.training is False and gm.eval() is gm
    with pytest.raises(NotImplementedError, match=r"captured by torch.export in eval mode"):
        gm.train()


def test_rewritten_checkpoints_load_into_the_original_and_back():
    """The amp_loss_scale buffer was persistent: state_dicts did not move between the two."""
    torch.manual_seed(0)
    x, y = torch.randn(8, 8), torch.randn(8, 1)
    model = MLPLoss()
    gm = _rewrite_for_training(copy.deepcopy(model), (x, y), "bf16")
    assert set(gm.state_dict()) == set(model.state_dict())
    assert set(copy.deepcopy(gm).state_dict()) == set(model.state_dict())  # (a deep copy made it persistent)
    MLPLoss().load_state_dict(gm.state_dict())
    gm.load_state_dict(model.state_dict())


class _LossOutputAndIndices(torch.nn.Module):
    """A loss, the FP32 output it is computed from and that output's argmax: three outputs."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 4)

    def forward(self, x, y):
        out = self.lin(x)
        return F.mse_loss(out, y), out, out.argmax(-1)


def test_training_options_that_would_scale_the_wrong_thing_are_refused():
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    with pytest.raises(UsageError, match=r"loss_output=2 names .*INT64.*must be a scalar FP32 output"):
        amp_rewrite.rewrite(_LossOutputAndIndices(), example_inputs=(x, y), training=True, loss_output=2, target="bf16")
    with pytest.raises(UsageError, match=r"loss_output=1 names .*FLOAT \[8, 4\]"):
        amp_rewrite.rewrite(_LossOutputAndIndices(), example_inputs=(x, y), training=True, loss_output=1, target="bf16")
    with pytest.raises(UsageError, match="drop keep_io_types=False"):
        amp_rewrite.rewrite(_LossOutputAndIndices(), example_inputs=(x, y), training=True, keep_io_types=False,
                            target="bf16")
    # (accepted silently before: no loss was scaled, and no decomposition happened)
    with pytest.raises(UsageError, match=r"loss_output names the loss to scale for training: pass training=True"):
        amp_rewrite.rewrite(_LossOutputAndIndices(), example_inputs=(x, y), loss_output=0, target="bf16")
    with pytest.raises(UsageError, match=r"decompose=True decomposes a torch.export capture"):
        amp_rewrite.rewrite(_LossOutputAndIndices(), example_inputs=(x, y), capture="symbolic_trace", decompose=True)


def test_a_loss_output_index_past_the_outputs_says_how_many_there_are():
    """loss_output= as an index counts the flattened outputs: one past the last is refused, saying
    how many outputs the module returns."""
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    for index in (3, -1):
        with pytest.raises(UsageError, match=rf"loss_output={index}: the module returns 3 output\(s\) \(flattened\)"):
            amp_rewrite.rewrite(_LossOutputAndIndices(), example_inputs=(x, y), training=True, loss_output=index,
                                target="bf16")


def test_load_state_dict_clamps_and_explains():
    scaler = LossScaler()
    with pytest.warns(RuntimeWarning, match="clamped"):
        scaler.load_state_dict({"scale": 0.25, "_growth_tracker": 0, "growth_factor": 2.0, "backoff_factor": 0.5,
                                "growth_interval": 2000})
    assert scaler.get_scale() == 1.0
    with pytest.raises(ValueError, match="empty state dict"):
        scaler.load_state_dict({})


def test_load_state_dict_clamps_a_scale_above_the_ceiling():
    """A GradScaler has no ceiling: a restored scale above ``max_scale`` is clamped down to it, with
    a warning."""
    scaler = LossScaler(max_scale=2.0 ** 16)
    with pytest.warns(RuntimeWarning, match="outside"):
        scaler.load_state_dict({"scale": 2.0 ** 20, "_growth_tracker": 0, "growth_factor": 2.0,
                                "backoff_factor": 0.5, "growth_interval": 2000})
    assert scaler.get_scale() == 2.0 ** 16


def test_an_optimizer_on_the_original_parameters_is_an_error():
    """rewrite() returns a copy: an optimizer built on the original module saw no gradients, and
    every step counted as finite while nothing trained."""
    torch.manual_seed(0)
    x, y = torch.randn(8, 8), torch.randn(8, 1)
    model = MLPLoss()
    gm = _rewrite_for_training(model, (x, y), "bf16")
    scaler = LossScaler(gm)
    scaler.backward(gm(x, y))
    with pytest.raises(RuntimeError, match=r"build the optimizer on the rewritten module's parameters"):
        scaler.step(torch.optim.SGD(model.parameters(), lr=0.1))


def test_an_optimizer_whose_parameters_got_no_gradient_this_step_is_told_so():
    """The second optimizer holds the rewritten module's own head, unused by this step's loss:
    refused (as torch.amp.GradScaler does), but the message asked whether it was built on the
    original module's parameters, which it was not."""
    torch.manual_seed(0)
    x, y = torch.randn(8, 8), torch.randn(8, 4)

    class WithAux(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = torch.nn.Linear(8, 4)
            self.aux = torch.nn.Linear(4, 4)

        def forward(self, x, y):
            return F.mse_loss(self.body(x), y)

    gm = _rewrite_for_training(WithAux(), (x, y), "bf16")
    main = [p for n, p in gm.named_parameters() if not n.startswith("aux")]
    aux = [p for n, p in gm.named_parameters() if n.startswith("aux")]
    scaler = LossScaler(gm, auto_update=False)
    scaler.backward(gm(x, y))
    scaler.step(torch.optim.SGD(main, lr=0.1))
    with pytest.raises(RuntimeError, match=r"they are the rewritten module's, and this step's loss did not reach them"):
        scaler.step(torch.optim.SGD(aux, lr=0.1))


class _LossAfterAnInt(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 1)

    def forward(self, x, y):
        return x.shape[0], F.mse_loss(self.fc(x).squeeze(-1), y)


class _LossAfterATuple(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = torch.nn.LSTM(8, 8, batch_first=True)
        self.fc = torch.nn.Linear(8, 1)

    def forward(self, x, y):
        out, hc = self.lstm(x)
        return hc, F.mse_loss(self.fc(out[:, -1]).squeeze(-1), y)


@pytest.mark.parametrize("cls,shape", [(_LossAfterAnInt, (4, 8)), (_LossAfterATuple, (4, 3, 8))])
def test_the_scale_goes_on_the_loss_whatever_precedes_it_in_the_output(cls, shape):
    """The loss's place was counted among tensor outputs, the scale put on the output node's args
    by that count: an int batch size before the loss got the scale (4 became 262144.) and the loss
    none, so every gradient came out 1/65536 too small; an (h, c) tuple before it was an IndexError."""
    torch.manual_seed(0)
    model = cls()
    ref = copy.deepcopy(model)
    x, y = torch.randn(*shape), torch.randn(4)
    gm = amp_rewrite.rewrite(model, example_inputs=(x, y), training=True, target="bf16", loss_scaling=True, capture="symbolic_trace")
    scaler = LossScaler(gm)
    first, loss = gm(x, y)
    ref_first, ref_loss = ref(x, y)
    if cls is _LossAfterAnInt:
        assert first == 4 and isinstance(first, int)
    else:
        assert all(a.dtype == torch.float32 and a.shape == b.shape for a, b in zip(first, ref_first))
    assert loss.item() == pytest.approx(ref_loss.item() * scaler.get_scale(), rel=2e-2)
    opt, ref_opt = torch.optim.SGD(gm.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    loss.backward()
    scaler.step(opt)
    ref_loss.backward()
    ref_opt.step()
    moved = (ref.fc.weight - model.fc.weight).abs().max().item()
    assert moved > 1e-2  # (the step is large enough to tell a 1/65536 update apart)
    assert (gm.fc.weight.detach() - ref.fc.weight.detach()).abs().max().item() < 0.1 * moved


class _DictWithCount(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = torch.nn.Linear(8, 3)

    def forward(self, x, y):
        logits = self.l(x)
        return {"n": x.shape[0], "loss": F.cross_entropy(logits, y), "aux": logits.pow(2).mean()}


@pytest.mark.parametrize("capture", ["export", "symbolic_trace"])
@pytest.mark.parametrize("loss_output", [1, "loss"])
def test_loss_output_counts_every_flattened_output(capture, loss_output):
    """loss_output=1 on {"n": int, "loss": ..., "aux": ...} counted tensor outputs only and put the
    scale on "aux", silently (the loss's gradients 1/scale of the truth); the dict key was refused."""
    torch.manual_seed(0)
    model = _DictWithCount()
    x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))
    gm = amp_rewrite.rewrite(copy.deepcopy(model), example_inputs=(x, y), training=True, target="bf16",
                             loss_scaling=True, loss_output=loss_output, capture=capture)
    gm.amp_loss_scale.fill_(100.0)
    out, ref = gm(x, y), model(x, y)
    assert out["n"] == 4
    assert out["loss"].item() == pytest.approx(100 * ref["loss"].item(), rel=2e-2)
    assert out["aux"].item() == pytest.approx(ref["aux"].item(), rel=2e-2)
    with pytest.raises(UsageError, match=r"loss_output=0 names an output that is no tensor"):
        amp_rewrite.rewrite(copy.deepcopy(model), example_inputs=(x, y), training=True, loss_output=0,
                            capture=capture)


class _DictWithNone(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = torch.nn.Linear(8, 3)

    def forward(self, x, y):
        logits = self.l(x)
        return {"logits": logits, "hidden": None, "loss": F.cross_entropy(logits, y), "aux": logits.pow(2).mean()}


@pytest.mark.parametrize("capture", ["export", "symbolic_trace"])
@pytest.mark.parametrize("loss_output", ["by index", "loss"])
def test_loss_output_counts_a_none_output_as_pytree_does(capture, loss_output):
    """An HF-style output dict holding a None: loss_output=2 (the loss's index in tree_flatten, which
    keeps None as a leaf) scaled "aux" instead, silently; under export the key "loss" was refused."""
    from torch.utils._pytree import tree_flatten

    torch.manual_seed(0)
    model = _DictWithNone()
    x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))
    leaves = tree_flatten(model(x, y))[0]
    index = next(i for i, leaf in enumerate(leaves) if leaf is model(x, y)["loss"] or (
        isinstance(leaf, torch.Tensor) and leaf.ndim == 0 and torch.equal(leaf, model(x, y)["loss"])))
    gm = amp_rewrite.rewrite(copy.deepcopy(model), example_inputs=(x, y), training=True, target="bf16",
                             loss_scaling=True, loss_output=index if loss_output == "by index" else loss_output,
                             capture=capture)
    gm.amp_loss_scale.fill_(100.0)
    out, ref = gm(x, y), model(x, y)
    assert out["hidden"] is None
    assert out["loss"].item() == pytest.approx(100 * ref["loss"].item(), rel=2e-2)
    assert out["aux"].item() == pytest.approx(ref["aux"].item(), rel=2e-2)


def test_a_weight_read_after_its_module_call_keeps_the_graph_valid():
    """symbolic_trace puts `self.l.weight` where forward first reads it directly, after the call of
    self.l; the call, now a functional call reading the FP32 master weight through a cast, read
    that cast before it was defined: lint failed ("used before it has been defined")."""
    class WeightNorm(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l = torch.nn.Linear(8, 8)

        def forward(self, x):
            return self.l(x).pow(2).mean() + 0.1 * self.l.weight.norm()

    torch.manual_seed(0)
    model, x = WeightNorm(), torch.randn(4, 8)
    gm = amp_rewrite.rewrite(copy.deepcopy(model), example_inputs=(x,), training=True, target="bf16",
                             capture="symbolic_trace")
    gm.graph.lint()
    loss = gm(x)
    assert loss.item() == pytest.approx(model(x).item(), rel=2e-2)
    loss.backward()
    model(x).backward()
    torch.testing.assert_close(gm.l.weight.grad, model.l.weight.grad, rtol=5e-2,
                               atol=2e-2 * model.l.weight.grad.abs().max().item())


def test_a_loss_the_capture_cannot_see_is_said_not_scaled_silently():
    """A dataclass output torch cannot flatten hides its loss: the fp16 training rewrite added no
    loss scale with no word, and LossScaler(gm) then blamed bf16's default."""
    import dataclasses

    @dataclasses.dataclass
    class Out:
        loss: torch.Tensor

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l = torch.nn.Linear(8, 1)

        def forward(self, x, y):
            return Out(F.mse_loss(self.l(x), y))

    x, y = torch.randn(4, 8), torch.randn(4, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gm, report = amp_rewrite.rewrite(Net(), example_inputs=(x, y), training=True, report=True)
    assert not hasattr(gm, "amp_loss_scale") and gm.amp_loss_scaling is False
    assert "training: no loss output found" in report.summary_text()
    with pytest.raises(ValueError, match=r"no in-graph loss scale .*use scaler.backward\(loss\) without attaching"):
        LossScaler(gm)


def test_a_module_rewritten_after_the_scalers_first_backward_is_found():
    """The scaler looked for rewritten modules once: a second one (a deep copy, a new rewrite) met
    later kept its in-graph scale, the scaler multiplied again, and its gradients came out scale x
    too large after unscale_, silently."""
    torch.manual_seed(0)
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    gm = _rewrite_for_training(MLPLoss(), (x, y), "bf16")
    scaler = LossScaler(gm, init_scale=256.0)
    scaler.backward(gm(x, y))
    scaler.step(torch.optim.SGD(gm.parameters(), lr=0.1))
    later = copy.deepcopy(gm)
    ref = MLPLoss()
    ref.load_state_dict(later.state_dict())
    ref(x, y).backward()
    later.zero_grad()
    scaler.backward(later(x, y))
    scaler.unscale_(torch.optim.SGD(later.parameters(), lr=0.1))
    for got, want in zip(later.parameters(), ref.parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=5e-2, atol=2e-2 * want.grad.abs().max().item())


def test_training_on_an_inference_rewrite_is_refused():
    """rewrite(training=True) of a module already rewritten for inference trained its FP16 weights
    (no FP32 master weights: small updates rounded away), silently."""
    torch.manual_seed(0)
    x, y = torch.randn(8, 8), torch.randn(8, 1)
    inference = amp_rewrite.rewrite(MLPLoss().eval(), example_inputs=(x, y), target="bf16")
    assert any(p.dtype == torch.bfloat16 for p in inference.parameters())
    with pytest.raises(UsageError, match=r"rewritten for inference already, with weights converted to bf16 .*"
                                         r"rewrite the FP32 original with training=True"):
        amp_rewrite.rewrite(inference, example_inputs=(x, y), target="bf16", training=True)


def test_a_loss_summed_with_many_terms_still_finds_the_modules_scale():
    """The scale node was looked for among the first 256 autograd nodes from the loss: with the
    module's output first in a sum of ~60 regulariser terms it lay deeper, and a correct loss was
    refused as if torch.compile had hidden the scale."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(8, 8) for _ in range(30)]
    model = torch.nn.Sequential(*layers)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = model

        def forward(self, x, y):
            return F.mse_loss(self.body(x), y)

    x, y = torch.randn(4, 8), torch.randn(4, 8)
    net = Net()
    ref = copy.deepcopy(net)
    gm = _rewrite_for_training(net, (x, y), "bf16")
    scaler = LossScaler(gm)

    def with_terms(m, loss):
        for p in m.parameters():
            loss = loss + 1e-4 * p.pow(2).sum()
        return loss

    gm.zero_grad()
    scaler.backward(with_terms(gm, gm(x, y)))
    scaler.unscale_(torch.optim.SGD(gm.parameters(), lr=0.0))
    with_terms(ref, ref(x, y)).backward()
    want = _grads_by_name(ref)
    for name, grad in _grads_by_name(gm).items():
        torch.testing.assert_close(grad, want[name], rtol=5e-2, atol=2e-2 * want[name].abs().max().item())


def test_several_scalar_outputs_need_loss_output():
    """With an auxiliary scalar (a mean) returned before the loss, the first scalar was scaled as
    the loss, noted only in the report: the loss's gradients came out 1/scale of the truth."""
    class AuxFirst(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 4)

        def forward(self, x, y):
            h = self.lin(x)
            return h.mean(), F.mse_loss(h, y)

    torch.manual_seed(0)
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    with pytest.raises(UsageError, match=r"2 scalar float outputs \(0: .*, 1: .*\); say which is the loss with "
                                         r"loss_output="):
        amp_rewrite.rewrite(AuxFirst(), example_inputs=(x, y), training=True, target="bf16")
    model = AuxFirst()
    ref = copy.deepcopy(model)
    gm = amp_rewrite.rewrite(model, example_inputs=(x, y), training=True, target="bf16", loss_scaling=True, loss_output=1)
    scaler = LossScaler(gm)
    aux, loss = gm(x, y)
    assert aux.item() == pytest.approx(ref(x, y)[0].item(), rel=2e-2)  # not scaled
    scaler.backward(loss)
    scaler.unscale_(torch.optim.SGD(gm.parameters(), lr=0.0))
    ref(x, y)[1].backward()
    torch.testing.assert_close(gm.lin.weight.grad, ref.lin.weight.grad, rtol=3e-2,
                               atol=2e-2 * ref.lin.weight.grad.abs().max().item())


def test_a_dropped_rewrite_not_yet_collected_is_no_second_candidate():
    """A scaler with no module finds the rewritten ones among live objects; a rewrite dropped a
    moment ago (GraphModules hold reference cycles, so only the collector frees them) counted as a
    second one: "2 modules rewritten for training exist and none is attached"."""
    import gc

    torch.manual_seed(0)
    x, y = torch.randn(8, 8), torch.randn(8, 1)

    def throwaway():
        return float(amp_rewrite.rewrite(MLPLoss(), example_inputs=(x, y), training=True)(x, y))

    gc.collect()
    gc.disable()
    try:
        gm = _rewrite_for_training(MLPLoss(), (x, y), "bf16")
        throwaway()
        scaler = LossScaler()
        opt = torch.optim.SGD(gm.parameters(), lr=0.1)
        gm(x, y).backward()  # (the scaler meets the module first at step)
        scaler.step(opt)
    finally:
        gc.enable()
    assert scaler.history[-1]["skipped"] is False
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in gm.parameters())


@pytest.mark.parametrize("target", ["fp16", "bf16"])
def test_a_sparse_embedding_trains_and_its_table_is_never_cast(target):
    """Training casts weights at use on every step. An embedding followed its low Linear, so the
    whole table went through a cast each forward, and nn.Embedding(sparse=True) failed in backward
    ("to(options) doesn't support converting to a different layout"). As under autocast, the
    gather now reads the FP32 table and its rows are cast."""
    class Emb(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.e = torch.nn.Embedding(20, 8, sparse=True)
            self.l = torch.nn.Linear(8, 4)

        def forward(self, t, y):
            return F.cross_entropy(self.l(self.e(t)), y)

    torch.manual_seed(0)
    model = Emb()
    ref = copy.deepcopy(model)
    t, y = torch.randint(0, 20, (6,)), torch.randint(0, 4, (6,))
    gm = amp_rewrite.rewrite(model, example_inputs=(t, y), training=True, target=target)
    embedding = next(n for n in gm.graph.nodes if "embedding" in str(n.target))
    assert embedding.args[0].op in ("placeholder", "get_attr"), embedding.format_node()
    scaler = LossScaler(gm, enabled=target == "fp16")  # (bf16 has no in-graph scale: a pass-through)
    scaler.backward(gm(t, y))
    scaler.unscale_(torch.optim.SGD(gm.parameters(), lr=0.0))
    ref(t, y).backward()
    assert gm.e.weight.grad.layout == torch.sparse_coo
    torch.testing.assert_close(gm.e.weight.grad.to_dense(), ref.e.weight.grad.to_dense(), rtol=5e-2,
                               atol=2e-2 * ref.e.weight.grad.to_dense().abs().max().item())


class _ClipLike(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.img, self.txt = torch.nn.Linear(8, 4), torch.nn.Linear(6, 4)
        self.logit_scale = torch.nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    def forward(self, image, text):
        return self.img(image), self.txt(text), self.logit_scale.exp()


def test_a_scalar_computed_from_parameters_alone_is_no_loss():
    """CLIP returns logit_scale.exp() beside its embeddings: the one scalar output was taken for the
    loss and, once a LossScaler attached, came out 65536 times too large (and so did the
    contrastive loss the caller computed from it). It reads no input: no loss."""
    torch.manual_seed(0)
    image, text = torch.randn(4, 8), torch.randn(4, 6)
    model = _ClipLike()
    gm, report = amp_rewrite.rewrite(copy.deepcopy(model), example_inputs=(image, text), training=True,
                                     target="fp16", report=True)
    assert not hasattr(gm, "amp_loss_scale")
    notes = report.to_dict()["notes"]
    assert any("computed from parameters alone" in n for n in notes), notes
    assert not any("no loss output found" in n for n in notes)
    scaler = LossScaler()
    img, txt, scale = gm(image, text)
    assert abs(float(scale) - 1 / 0.07) < 1e-3
    logits = scale * torch.nn.functional.normalize(img.float(), dim=-1) @ torch.nn.functional.normalize(
        txt.float(), dim=-1).T
    scaler.backward(torch.nn.functional.cross_entropy(logits, torch.arange(4)))
    assert scaler.get_scale() > 1 and gm.logit_scale.grad is not None
    # named, it is the loss as before
    named = amp_rewrite.rewrite(copy.deepcopy(model), example_inputs=(image, text), training=True, target="fp16",
                                loss_output=2)
    assert hasattr(named, "amp_loss_scale")


def test_a_metric_beside_the_loss_is_not_taken_for_it():
    """(loss, accuracy, loss.detach()): three scalar float outputs, of which only the loss carries a
    gradient; it is taken as the loss (the accuracy and the detached copy stay unscaled)."""
    class WithMetrics(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 4)

        def forward(self, x, y):
            out = self.lin(x)
            loss = F.cross_entropy(out, y)
            return loss, (out.argmax(-1) == y).float().mean(), loss.detach()

    torch.manual_seed(0)
    x, y = torch.randn(8, 8), torch.randint(0, 4, (8,))
    for capture in ("export", "symbolic_trace"):
        model = WithMetrics()
        ref = copy.deepcopy(model)
        gm = amp_rewrite.rewrite(model, example_inputs=(x, y), training=True, target="bf16", loss_scaling=True, capture=capture)
        scaler = LossScaler(gm)
        loss, acc, plain = gm(x, y)
        ref_loss, _, _ = ref(x, y)
        assert loss.item() == pytest.approx(ref_loss.item() * scaler.get_scale(), rel=2e-2), capture
        assert 0.0 <= acc.item() <= 1.0  # (bf16 logits may flip an argmax, but a scaled accuracy is 65536x)
        assert plain.item() == pytest.approx(ref_loss.item(), rel=2e-2)


def test_an_integer_scalar_beside_the_loss_is_no_second_loss_candidate():
    """(loss, count of positive logits): the count is an INT64 scalar, no float one. It is no loss
    candidate: counted among them, the report would say "of the 2 scalar float outputs only it
    carries a gradient" where the module returns one."""
    class WithCount(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x, y):
            out = self.lin(x)
            return F.mse_loss(out, y), (out > 0).sum()

    from amp_rewrite.fx_api import report_of

    torch.manual_seed(0)
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    model = WithCount()
    ref = copy.deepcopy(model)
    gm = amp_rewrite.rewrite(model, example_inputs=(x, y), training=True, target="fp16")
    notes = report_of(gm).log.notes
    assert not [n for n in notes if "scalar float outputs" in n], notes
    assert any(n.startswith("training: loss 'mse_loss' scaled in the graph") for n in notes), notes
    scaler = LossScaler(gm)
    loss, count = gm(x, y)
    ref_loss, ref_count = ref(x, y)
    assert loss.item() == pytest.approx(ref_loss.item() * scaler.get_scale(), rel=1e-2)
    assert count.dtype == torch.int64 and abs(int(count) - int(ref_count)) <= 1  # (not scaled)


def test_a_per_sample_loss_vector_named_by_loss_output_is_refused():
    """loss_output=0 naming an mse_loss(reduction="none").mean(-1), a loss per sample ([3]), is refused,
    not scaled as the loss: a 1-D output as well as a 2-D one (only a scalar is a loss)."""
    class PerSample(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x, y):
            return F.mse_loss(self.lin(x), y, reduction="none").mean(-1)

    x, y = torch.randn(3, 4), torch.randn(3, 4)
    with pytest.raises(UsageError, match=r"loss_output=0 names .*FLOAT \[3\]: the loss must be a scalar FP32 output"):
        amp_rewrite.rewrite(PerSample(), example_inputs=(x, y), training=True, loss_output=0, target="fp16")


def test_a_symbolic_trace_training_module_runs_under_fx_interpreter():
    """Module calls that read their parameters through casts are emitted as functional calls; the
    parameter dict was a literal fx argument, which fx.Interpreter (ShapeProp, most FX passes)
    hands over as an immutable_dict that functional_call mutates: TypeError. Direct calls worked."""
    import torch.fx as fx
    from torch.fx.passes.shape_prop import ShapeProp

    torch.manual_seed(0)

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l, self.o = torch.nn.Linear(8, 8), torch.nn.Linear(8, 3)

        def forward(self, x, y):
            return F.cross_entropy(self.o(torch.relu(self.l(x))), y)

    x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))
    gm = amp_rewrite.rewrite(Net(), example_inputs=(x, y), target="bf16", training=True, capture="symbolic_trace")
    direct = gm(x, y)
    assert torch.equal(fx.Interpreter(gm).run(x, y), direct)
    assert torch.equal(ShapeProp(gm).propagate(x, y), direct)
    assert torch.equal(copy.deepcopy(gm)(x, y), direct)


@pytest.mark.parametrize("training", [True, False])
def test_pickling_a_rewritten_module_is_refused_and_its_state_dict_resumes_it(tmp_path, training):
    """torch.save(gm) pickled a module torch rebuilds from its code on load: its state dict gained
    keys no checkpoint has, a buffer read at a cast became a constant, and a weight's cached low copy
    went stale after load_state_dict (outputs [5.5, 5.3, ...] where FP32 gave [7.7, 7.3, ...]). It is
    refused, saying what to do; the state dict, which has the model's keys, resumes a new rewrite."""
    import pickle

    torch.manual_seed(0)
    x, y = torch.randn(8, 8), torch.randn(8, 1)
    model = MLPLoss()
    gm = amp_rewrite.rewrite(copy.deepcopy(model), example_inputs=(x, y), training=training, target="bf16",
                             capture="symbolic_trace")
    for module in (gm, copy.deepcopy(gm)):
        with pytest.raises(pickle.PicklingError, match=r"Save gm.state_dict\(\) instead"):
            torch.save(module, tmp_path / "gm.pt")
    assert sorted(gm.state_dict()) == sorted(model.state_dict())
    torch.save(gm.state_dict(), tmp_path / "sd.pt")
    again = amp_rewrite.rewrite(copy.deepcopy(model), example_inputs=(x, y), training=training, target="bf16",
                                capture="symbolic_trace")
    again.load_state_dict(torch.load(tmp_path / "sd.pt"))
    torch.testing.assert_close(again(x, y), gm(x, y))


class _ScaledByAConstant(torch.nn.Module):
    """A tensor made in forward (T5's, BART's and Whisper's torch.tensor(...) scalings)."""

    def __init__(self):
        super().__init__()
        self.l = torch.nn.Linear(8, 8)

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.l(x) * torch.tensor(2.0), y)


@pytest.mark.parametrize("training", [False, True])
def test_checkpoints_of_the_original_and_the_rewrite_load_into_each_other(training):
    """torch.export lifts that tensor into a constant; the rewrite's deep copy registered it as a
    buffer, so the rewritten module's state_dict had a key 'lifted_tensor_0' the original has not
    and strict loading failed both ways."""
    module = _ScaledByAConstant()
    x, y = torch.randn(2, 8), torch.randn(2, 8)
    gm = amp_rewrite.rewrite(module, example_inputs=(x, y), target="bf16", training=training)
    assert set(gm.state_dict()) == set(module.state_dict())
    gm.load_state_dict(module.state_dict())
    _ScaledByAConstant().load_state_dict(gm.state_dict())
    assert torch.isfinite(gm(x, y)).all()


class _SliceCopies(torch.nn.Module):
    """Writes into slices of a fresh tensor in place (HF DeepSeek-V2's rotary, q_pe.copy_(...)),
    one of them a detached (stop-gradient) copy where ``detach``."""

    def __init__(self, detach: bool = False):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
        self.detach = detach

    def forward(self, x, y):
        h = self.a(x)
        out = h.new_zeros(h.shape)
        out[..., :4].copy_(h[..., 4:].detach() if self.detach else h[..., 4:])
        out[..., 4:] = h[..., :4]
        return F.mse_loss(self.b(out), y)


@pytest.mark.parametrize("target", ["fp16", "bf16"])
@pytest.mark.parametrize("decompose", [False, True], ids=["functionalized-fallback", "decompose"])
@pytest.mark.parametrize("detach", [False, True], ids=["plain", "detached"])
def test_in_place_slice_copies_train(target, decompose, detach):
    """The in-place writes make the rewrite take the functionalized graph of run_decompositions(),
    which writes each slice copy as aten.copy: autograd has no derivative for it, and backward
    raised 'derivative for aten::copy is not implemented'. Its default table also wrote detach as
    alias, which let the gradient through a stop-gradient (twice the FP32 grads of ``a``). The
    grads are the FP32 module's."""
    torch.manual_seed(0)
    model = _SliceCopies(detach)
    ref = copy.deepcopy(model)
    x, y = torch.randn(2, 8), torch.randn(2, 8)
    gm = amp_rewrite.rewrite(model, example_inputs=(x, y), training=True, target=target, decompose=decompose)
    scaler = LossScaler(gm, enabled=target == "fp16")
    scaler.backward(gm(x, y))
    scaler.unscale_(torch.optim.SGD(gm.parameters(), lr=0.0))
    ref(x, y).backward()
    for got, want in zip(_grads(gm), _grads(ref)):
        torch.testing.assert_close(got, want, rtol=5e-2, atol=2e-2 * want.abs().max().item())


class _NormedWithSliceWrite(torch.nn.Module):
    """BatchNorm in train mode; with ``slice_write`` an in-place write into a view, which makes an
    export capture fall back to the functionalized graph."""

    def __init__(self, slice_write: bool):
        super().__init__()
        self.a, self.bn, self.b = torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 4)
        self.slice_write = slice_write

    def forward(self, x):
        h = self.bn(self.a(x))
        if self.slice_write:
            h[:, :2].mul_(3)
        return self.b(h).pow(2).mean()


@pytest.mark.parametrize("slice_write, decompose", [(True, False), (False, True)],
                         ids=["functionalized-fallback", "decompose"])
def test_batchnorm_trains_on_the_functionalized_graph(slice_write, decompose):
    """The functionalized graph runs BatchNorm as _native_batch_norm_legit_functional, whose autograd
    node saves the running statistics, then copy_()s the new ones into those buffers: backward raised
    'modified by an inplace operation'. It trains now: the grads and the updated running statistics
    are the FP32 module's."""
    torch.manual_seed(0)
    model = _NormedWithSliceWrite(slice_write).train()
    ref = copy.deepcopy(model)
    x = torch.randn(5, 4)
    gm = amp_rewrite.rewrite(model, example_inputs=(x,), training=True, target="bf16", decompose=decompose)
    gm(x).backward()
    ref(x).backward()
    scale = max(g.abs().max().item() for g in _grads(ref))  # (a's bias grad is zero up to rounding)
    for got, want in zip(_grads(gm), _grads(ref)):
        torch.testing.assert_close(got, want, rtol=5e-2, atol=3e-2 * scale)
    buffers = dict(gm.named_buffers())
    for name, want in ref.named_buffers():
        got = buffers[name]
        assert got.dtype == want.dtype, name
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


class _MaxNormEmbedding(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(16, 8, max_norm=1.0)
        self.out = torch.nn.Linear(8, 8)
        with torch.no_grad():
            self.emb.weight.mul_(3)  # (rows past the max norm: each lookup renormalises them)

    def forward(self, ids):
        return self.out(self.emb(ids)).pow(2).mean()


@pytest.mark.parametrize("capture", ["export", "symbolic_trace"])
@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
def test_an_embedding_with_max_norm_renormalises_its_weight_and_trains(training, capture):
    """F.embedding(max_norm=...) renormalises the looked-up rows of the weight in place, through a
    detached view of it. That was refused as an in-place write others observe, and the automatic
    fallback (the functionalized graph) wrote the rows back by copy_ into the parameter outside
    no_grad: every call with autograd on raised 'a leaf Variable that requires grad is being used
    in an in-place operation' (and its embedding read a detached renorm: no gradient reached the
    weight). The write into the module's weight is kept as written now: the weight is renormalised
    as the FP32 module's is, and the grads are the FP32 module's. (symbolic_trace: the metadata
    run renormalised the example's rows of the rewrite's weight ahead of time; it puts them back.)"""
    torch.manual_seed(0)
    model = _MaxNormEmbedding()
    ref = copy.deepcopy(model)
    calls = [torch.tensor([[1, 3, 5, 3, 9, 2]]), torch.tensor([[4, 3, 7, 7, 0, 1]])]
    example = torch.tensor([[1, 2, 6, 8, 10, 12]])  # (rows the calls do not all read)
    gm = amp_rewrite.rewrite(model, example_inputs=(example if capture == "symbolic_trace" else calls[0],),
                             target="bf16", training=training, capture=capture)
    for ids in calls:
        got, want = gm(ids), ref(ids)
        assert abs(got.item() - want.item()) < 2e-2 * abs(want.item())
        torch.testing.assert_close(gm.emb.weight.float(), ref.emb.weight, rtol=1e-2, atol=1e-2)
        if training:
            gm.zero_grad()
            ref.zero_grad()
            got.backward()
            want.backward()
            for mine, theirs in zip(_grads(gm), _grads(ref)):
                torch.testing.assert_close(mine, theirs, rtol=5e-2, atol=3e-2 * theirs.abs().max().item())


def test_rewriting_a_training_output_again_reports_no_pins_of_its_own():
    """The loss tail (what feeds the loss after the last allow op) is pinned FP32 internally. Rewriting
    a symbolic_trace training output again found its Linears (functional calls computing in FP16 as
    given) in that tail, and the summary said '--fp32-nodes 'a/a_2' ... without effect' for pins the
    user never gave. Nothing is pinned on nodes already low: the second rewrite changes nothing and
    says nothing of pins."""
    from amp_rewrite.api import _dispatch

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(16, 32), torch.nn.Linear(32, 4)

        def forward(self, x, y):
            return F.cross_entropy(self.b(F.relu(self.a(x))), y)

    torch.manual_seed(0)
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    gm = amp_rewrite.rewrite(Net(), example_inputs=(x, y), training=True, capture="symbolic_trace")
    again = _dispatch(gm, training=True)
    assert not again.modified and again.model.code == gm.code
    assert not [n for n in again.log.notes if "without effect" in n], again.log.notes
    assert any(n.startswith("as given: 3 nodes") for n in again.log.notes)


class _CalledOutOfOrder(torch.nn.Module):
    """Declares ``a`` (with a submodule holding a bare parameter) before ``b`` and uses ``b`` first."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.inner = torch.nn.Module()
        self.inner.first = torch.nn.Parameter(torch.randn(8))
        self.inner.second = torch.nn.Parameter(torch.randn(8))
        self.register_buffer("offset", torch.zeros(8))
        self.b = torch.nn.Linear(8, 8)

    def forward(self, x, y):
        h = torch.tanh(self.b(x)) * self.inner.second + self.inner.first + self.offset
        return F.mse_loss(self.a(h), y)


@pytest.mark.parametrize("capture", ["symbolic_trace", "export"])
def test_the_rewrite_keeps_the_declared_parameter_order_an_optimizer_checkpoint_relies_on(capture):
    """symbolic_trace gave the rewrite's parameters the order the graph uses them in (b before a):
    an Adam state_dict saved on the original loaded into an optimizer on the rewrite without an
    error, by position, and each parameter resumed with another's moments. The rewrite now keeps
    the declared order: the same parameter names, buffers and state_dict keys in the same order,
    and the resumed moments are the parameters' own."""
    torch.manual_seed(0)
    model, x, y = _CalledOutOfOrder(), torch.randn(4, 8), torch.randn(4, 8)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(2):
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
    gm = amp_rewrite.rewrite(copy.deepcopy(model), example_inputs=(x, y), training=True, target="bf16",
                             capture=capture)
    assert [n for n, _ in gm.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert [k for k in gm.state_dict() if k in model.state_dict()] == list(model.state_dict())
    resumed = torch.optim.Adam(gm.parameters(), lr=1e-2)
    resumed.load_state_dict(copy.deepcopy(opt.state_dict()))
    for name, p in gm.named_parameters():
        want = opt.state[model.get_parameter(name)]["exp_avg"]
        assert torch.equal(resumed.state[p]["exp_avg"], want), name


class _TiedEmbedding(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(20, 16)
        self.proj = torch.nn.Linear(16, 16)
        self.out = torch.nn.Linear(16, 20, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, t, y):
        return F.cross_entropy(self.out(torch.tanh(self.proj(self.emb(t)))).reshape(-1, 20), y.reshape(-1))


@pytest.mark.parametrize("capture", ["export", "symbolic_trace"])
def test_loading_with_assign_keeps_tied_weights_tied(capture):
    """``load_state_dict(sd, assign=True)`` (how a model made on the meta device gets its weights)
    gave each name of a tied weight its own Parameter. The torch.export graph reads it as
    ``out.weight`` only: ``emb.weight`` got no gradient and stayed behind. The rewrite ties them
    again after the load: one Parameter, which every step updates."""
    torch.manual_seed(0)
    base = _TiedEmbedding()
    t, y = torch.randint(0, 20, (2, 5)), torch.randint(0, 20, (2, 5))
    state = copy.deepcopy(base.state_dict())
    gm = amp_rewrite.rewrite(copy.deepcopy(base), example_inputs=(t, y), training=True, capture=capture)
    gm.load_state_dict(state, assign=True)
    assert gm.get_parameter("emb.weight") is gm.get_parameter("out.weight")
    assert len(list(gm.parameters())) == len(list(base.parameters()))
    amp_rewrite.LossScaler(gm).backward(gm(t, y))
    assert all(p.grad is not None for p in gm.parameters())


class _TiedLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(10, 8)
        self.head = torch.nn.Linear(8, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(torch.relu(self.emb(ids)))


def test_a_tied_weight_read_fp32_by_one_name_keeps_the_tie_and_loads_a_deduplicated_checkpoint():
    """symbolic_trace: the embedding reads the tied weight in FP32 and the head in FP16; the head's
    name was converted in place, an FP16 head.weight beside the FP32 emb.weight, tie gone. The
    head now reads a converted copy and both names keep the one FP32 Parameter; a checkpoint
    holding the tensor under one name (safetensors de-duplicates ties) loads into both."""
    torch.manual_seed(0)
    model, ids = _TiedLM().eval(), torch.tensor([[1, 2, 3], [4, 5, 9]])
    gm = amp_rewrite.rewrite(model, example_inputs=(ids,), capture="symbolic_trace")
    assert gm.get_parameter("emb.weight") is gm.get_parameter("head.weight")
    assert {k: v.dtype for k, v in gm.state_dict().items()} == {k: v.dtype for k, v in model.state_dict().items()}
    _load_one_name_of_the_tie(gm, ids, "head.weight")


def _load_one_name_of_the_tie(gm, ids, name: str) -> None:
    """Load another model's tied weight under ``name`` alone (assign=True): both names hold it and
    the rewrite computes what that model does."""
    torch.manual_seed(1)
    trained = _TiedLM().eval()
    gm.load_state_dict({name: trained.get_parameter(name).detach().clone()}, strict=False, assign=True)
    assert gm.get_parameter("emb.weight") is gm.get_parameter("head.weight")
    with torch.no_grad():
        want, got = trained(ids), gm(ids).float()
    assert (got - want).abs().max() <= 1e-2 * want.abs().max()


def test_a_reloaded_tie_remakes_the_low_copy_from_the_loaded_tensor():
    """An FP32 embedding tied to an FP16 head (which reads a converted copy): a checkpoint holding
    the tensor as emb.weight only, loaded with assign=True, re-tied head.weight to it after the
    copy had been made again from head.weight's old tensor: the head computed with the old
    weights. The copy is made again after the re-tie."""
    torch.manual_seed(0)
    model, ids = _TiedLM().eval(), torch.tensor([[1, 2, 3], [4, 5, 9]])
    gm = amp_rewrite.rewrite(model, example_inputs=(ids,), capture="symbolic_trace")
    _load_one_name_of_the_tie(gm, ids, "emb.weight")


def test_a_loss_weight_made_afresh_each_step_does_not_walk_the_heap(monkeypatch):
    """A loss times a new 0-dim tensor each step (a scheduled loss weight) is a saved scalar no
    module's scale is: the scaler collected garbage and walked the whole heap for rewritten modules
    at every such step (0.4 s a step on a 500k-object heap). One walk, when the scaler first looks."""
    import gc

    torch.manual_seed(0)
    x, y = torch.randn(8, 8), torch.randn(8, 1)
    gm = _rewrite_for_training(MLPLoss(), (x, y), "bf16")
    walks = []
    real = gc.get_objects
    monkeypatch.setattr(gc, "get_objects", lambda *a, **k: walks.append(1) or real(*a, **k))
    scaler = LossScaler()
    opt = torch.optim.SGD(gm.parameters(), lr=0.0)
    for step in range(6):
        weight = torch.tensor(1.0 + step / 10)
        scaler.backward(gm(x, y) * weight)
        scaler.step(opt)
        opt.zero_grad()
    assert len(walks) <= 1


def test_a_deep_copy_made_after_the_scaler_looked_is_found_without_a_walk():
    """The registry that replaced the per-step walk must know a deep copy of a rewritten module
    made later: otherwise its loss is scaled twice (the in-graph buffer and the scaler) and the
    optimizer gets gradients 65536 times too large."""
    torch.manual_seed(0)
    x, y = torch.randn(8, 8), torch.randn(8, 1)
    model = MLPLoss()
    ref = copy.deepcopy(model)
    gm = _rewrite_for_training(model, (x, y), "bf16")
    scaler = LossScaler()
    opt = torch.optim.SGD(gm.parameters(), lr=0.0)
    scaler.backward(gm(x, y) * torch.tensor(0.5))  # the scaler looks (once) and learns gm
    scaler.step(opt)
    twin = copy.deepcopy(gm)
    opt2 = torch.optim.SGD(twin.parameters(), lr=0.0)
    scaler.backward(twin(x, y) * torch.tensor(0.5))
    scaler.unscale_(opt2)
    (ref(x, y) * 0.5).backward()
    for got, want in zip(_grads(twin), _grads(ref)):  # (bf16: within 2% of the largest)
        assert float((got - want).abs().max()) <= 2e-2 * float(want.abs().max())


def test_a_users_low_pin_between_the_last_linear_and_the_loss_is_honoured():
    """fp16_nodes=['tanh'] on tanh(linear(x)) -> mse_loss lost to the training rewrite's FP32 pin on
    the loss tail, with no word: the tanh read FP32."""
    class TanhMLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.l1 = torch.nn.Linear(8, 4)

        def forward(self, x, y):
            return F.mse_loss(torch.tanh(self.l1(x)), y)

    x, y = torch.randn(4, 8), torch.randn(4, 4)
    dtypes = {}
    for pins in ((), ("tanh",)):
        gm = amp_rewrite.rewrite(TanhMLP(), example_inputs=(x, y), training=True, target="bf16", fp16_nodes=list(pins))
        gm.graph.lint()
        tanh = next(n for n in gm.graph.nodes if "tanh" in str(n.target))
        dtypes[pins] = tanh.args[0].meta["val"].dtype
        assert torch.isfinite(gm(x, y))
    assert dtypes == {(): torch.float32, ("tanh",): torch.bfloat16}


class _PaddedAttentionWithSliceWrites(torch.nn.Module):
    """SDPA under a causal + padding mask whose left-padded rows see no key, beside in-place slice
    writes (as DeepSeek-V3's expand_kv), which make the training capture decompose the graph."""

    def __init__(self, d=16, h=2):
        super().__init__()
        self.h, self.qkv, self.o = h, torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)

    def forward(self, x, mask, y):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.h, d // self.h).permute(2, 0, 3, 1, 4)
        kk = k.new_empty(k.shape)
        kk[..., :4] = k[..., :4]
        kk[..., 4:] = k[..., 4:]
        am = mask[:, None, None, :].bool() & torch.ones(s, s, dtype=torch.bool).tril()
        a = torch.nn.functional.scaled_dot_product_attention(q, kk, v, attn_mask=am)
        return torch.nn.functional.mse_loss(self.o(a.transpose(1, 2).reshape(b, s, d)), y)


@pytest.mark.parametrize("target", ["bf16", "fp16"])
def test_attention_over_a_row_that_sees_no_key_keeps_finite_gradients_when_the_capture_decomposes(target):
    """An in-place op makes the training capture fall back to run_decompositions, whose default
    table turned SDPA into its math form: the softmax backward of a fully masked row is NaN, so
    every gradient upstream was NaN (bf16: NaN weights after one step; fp16: every step skipped),
    where FP32 and autocast train fine (DeepSeek-V3, RecurrentGemma with left padding)."""
    torch.manual_seed(0)
    model = _PaddedAttentionWithSliceWrites().train()
    x, y = torch.randn(2, 5, 16), torch.randn(2, 5, 16)
    mask = torch.ones(2, 5, dtype=torch.long)
    mask[1, :2] = 0
    model(x, mask, y).backward()
    reference = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    gm = amp_rewrite.rewrite(model, example_inputs=(x, mask, y), target=target, training=True, loss_scaling=False)
    gm(x, mask, y).backward()
    for name, p in gm.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert (p.grad - reference[name]).norm() <= 0.05 * reference[name].norm(), name


class _BigMasterWeight(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 2)

    def forward(self, x, y):
        return F.mse_loss(self.fc(x), y)


def _big_master(value: float) -> _BigMasterWeight:
    torch.manual_seed(0)
    model = _BigMasterWeight()
    with torch.no_grad():
        model.fc.weight[0, 0] = value
        model.fc.weight[1, 3] = 1e-9  # (below fp16's smallest subnormal: flushed by the cast)
    return model


@pytest.mark.parametrize("capture", ["export", "symbolic_trace"])
def test_a_master_weight_past_the_range_keeps_its_gradient_through_the_clamp_and_is_counted(capture):
    """The cast at use of a master weight holding 1e5 clamps it at 65504; a plain clamp's backward
    zeroed that element's gradient at every step, so the weight could never move back into range,
    and the summary said 0 values clamped. The clamp passes its gradient straight through (that of
    the weight at 65504), and the values the cast clamps or flushes are counted."""
    x, y = torch.full((4, 8), 1e-3), torch.zeros(4, 2)
    model = _big_master(1e5)
    gm, report = amp_rewrite.rewrite(copy.deepcopy(model), example_inputs=(x, y), training=True, target="fp16",
                                     capture=capture, report=True)
    gm.graph.lint()
    weights = report.summary()["weights"]
    assert (weights["clamped"], weights["flushed_to_zero"]) == (1, 1)
    assert any("1 values clamped at ±65504, 1 flushed to zero" in line for line in report.summary_text().splitlines())
    loss = gm(x, y)
    loss.backward()
    scale = float(gm.amp_loss_scale)
    # the reference: the same step with the weight clamped in FP32 first (its gradient that of 65504)
    clamped = copy.deepcopy(model)
    with torch.no_grad():
        clamped.fc.weight.clamp_(-65504, 65504)
    clamped(x, y).backward()
    want, got = clamped.fc.weight.grad, gm.fc.weight.grad / scale
    assert float(want[0, 0]) != 0.0
    assert torch.allclose(got, want, rtol=1e-2, atol=1e-6)
    reference = float(clamped(x, y).detach())
    assert abs(float(loss.detach()) / scale - reference) <= 1e-2 * reference
    with torch.no_grad():
        gm.fc.weight -= gm.fc.weight.grad  # (the master weight moves)
    assert float(gm.fc.weight.detach()[0, 0]) < 1e5


class _CausalPlusPadding(torch.nn.Module):
    """A causal mask buffer of finfo.min plus an HF padding mask of it: -inf in FP32 where both
    mask (their sum overflows), and the baddbmm's mask input clamped before its cast."""

    def __init__(self):
        super().__init__()
        low = torch.finfo(torch.float32).min
        self.qkv, self.head = torch.nn.Linear(16, 48), torch.nn.Linear(16, 5)
        self.register_buffer("causal", torch.triu(torch.full((6, 6), low), 1))

    def forward(self, x, am, t):
        q, k, v = self.qkv(x).chunk(3, -1)
        mask = self.causal + (1.0 - am[:, None, :].float()) * torch.finfo(torch.float32).min
        a = torch.baddbmm(mask, q, k.transpose(-1, -2), alpha=0.25).softmax(-1)
        logits = self.head(x + a @ v)
        return torch.nn.functional.cross_entropy(logits[am.bool()], t[am.bool()])


@pytest.mark.parametrize("capture", ["export", "symbolic_trace"])
def test_a_clamp_of_an_infinite_mask_passes_a_finite_value_in_training(capture):
    """The straight-through clamp ``clamp(w).detach() + (w - w.detach())`` is NaN where w is ±inf
    (inf - inf): a causal plus padding mask, -inf in FP32 where both mask, made every training
    loss NaN and every step skipped, where FP32 and the inference rewrite are finite."""
    torch.manual_seed(0)
    x, am, t = torch.randn(2, 6, 16), torch.ones(2, 6, dtype=torch.long), torch.randint(0, 5, (2, 6))
    am[1, :2] = 0
    model = _CausalPlusPadding()
    want = float(model(x, am, t))
    gm = amp_rewrite.rewrite(copy.deepcopy(model), example_inputs=(x, am, t), training=True, target="fp16",
                             capture=capture, loss_scaling=False)
    gm.graph.lint()
    loss = gm(x, am, t)
    assert math.isfinite(float(loss)) and abs(float(loss) - want) <= 1e-2 * want
    loss.backward()
    model(x, am, t).backward()
    for name, p in gm.named_parameters():
        reference = dict(model.named_parameters())[name].grad
        assert torch.isfinite(p.grad).all(), name
        assert (p.grad - reference).abs().max() <= 2e-2 * reference.abs().max() + 1e-6, name


def test_loading_a_master_weight_past_the_range_into_a_training_rewrite_is_said():
    """The README's resume recipe (rewrite, then load the checkpoint) with a weight of 1e5: the
    inference rewrite warned and clamped, the training rewrite said nothing and its cast made inf
    (loss inf at every step). Now it warns, saying the cast does not clamp and what to do; a
    weight the rewrite saw past the range is clamped at use, and the warning says that."""
    x, y = torch.full((4, 8), 1e-3), torch.zeros(4, 2)
    checkpoint = _big_master(1e5).state_dict()
    gm = amp_rewrite.rewrite(_big_master(1.0), example_inputs=(x, y), training=True, target="fp16")
    with pytest.warns(RuntimeWarning, match=r"'fc.weight' holds 1 value\(s\) beyond float16's range.*without a clamp"):
        gm.load_state_dict(checkpoint)
    clamping = amp_rewrite.rewrite(_big_master(2e5), example_inputs=(x, y), training=True, target="fp16")
    with pytest.warns(RuntimeWarning, match=r"'fc.weight' holds 1 value\(s\).*clamped at ±65504"):
        clamping.load_state_dict(checkpoint)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gm.load_state_dict(_big_master(1.0).state_dict())  # (in range: nothing to say)
    assert torch.isfinite(clamping(x, y))
