"""torch.compile(model, backend="amp_rewrite"): the graph dynamo captures is rewritten, then compiled
by the inner backend (inductor by default; aot_eager here where speed matters). Outputs must match
eager FP32 within the tolerances of test_fx_rewrite (3e-2 BF16, 5e-3 FP16, relative to max |y|)."""

from __future__ import annotations

import copy
import re
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
import amp_rewrite  # noqa: E402
import amp_rewrite.compile_backend as backend  # noqa: E402  (registers "amp_rewrite")
from amp_rewrite.decisions import Precision  # noqa: E402
from amp_rewrite.errors import UnsupportedModelError  # noqa: E402

from test_fx_rewrite import TOL, WithLoss, make, rel_err  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_backend_is_registered_by_name():
    from torch._dynamo.backends.registry import lookup_backend

    assert "amp_rewrite" in torch._dynamo.list_backends()
    assert lookup_backend("amp_rewrite") is backend.amp_rewrite_backend
    backend.register()  # idempotent


def test_importing_the_package_does_not_import_torch():
    code = "import sys, amp_rewrite; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("name,target", [("mlp", "bf16"), ("encoder", "bf16"), ("cnn", "fp16")])
def test_compile_aot_eager_matches_eager(name, target):
    model, inputs = make(name)
    compiled = torch.compile(model, backend="amp_rewrite", options={"target": target, "backend": "aot_eager"})
    with torch.no_grad():
        out, ref = compiled(*inputs), model(*inputs)
    assert out.dtype == torch.float32
    assert rel_err(out, ref) < TOL[target]
    report = backend.last_reports[-1]
    assert report.heavy_ops["low"] == report.heavy_ops["total"] > 0
    assert not report.summary()["unlisted_ops"]


def test_make_backend_with_fixed_options():
    model, inputs = make("mlp")
    compiled = torch.compile(model, backend=backend.make_backend(target="bf16", backend="aot_eager"))
    with torch.no_grad():
        assert rel_err(compiled(*inputs), model(*inputs)) < TOL["bf16"]
    assert backend.last_reports[-1].log.target == "bf16"


def test_compile_training_gradients_reach_fp32_parameters():
    torch.manual_seed(0)
    model = WithLoss().train()
    x, y = torch.randn(4, 16), torch.randint(0, 8, (4,))
    compiled = torch.compile(model, backend="amp_rewrite", options={"target": "bf16", "backend": "aot_eager"})
    _, loss = compiled(x, y)
    _, ref = model(x, y)
    assert abs(float(loss) - float(ref)) < TOL["bf16"] * abs(float(ref))
    loss.backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())


def test_compile_dynamic_shapes_and_inplace_ops():
    model, inputs = make("encoder")
    compiled = torch.compile(model, backend="amp_rewrite", options={"target": "bf16", "backend": "aot_eager"},
                             dynamic=True)
    with torch.no_grad():
        for seq in (8, 5):
            ids = inputs[0][:, :seq]
            assert rel_err(compiled(ids), model(ids)) < TOL["bf16"]

    class InPlace(torch.nn.Module):  # dynamo keeps in-place ops; h is read after relu_ mutated it
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

        def forward(self, x):
            h = self.fc(x)
            r = h.relu_()
            return r + h.exp()

    model, x = InPlace().eval(), torch.randn(2, 4)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="amp_rewrite", options={"target": "bf16", "backend": "aot_eager"})
    with torch.no_grad():
        assert rel_err(compiled(x), model(x)) < TOL["bf16"]


def test_compile_dynamic_shapes_rewrite_once_for_every_size():
    """A symbolic dim stays symbolic: reading it with int() guards on its value, so every new
    batch size recompiled, and after dynamo's recompile limit the model ran plain FP32."""
    model, inputs = make("encoder")
    compiled = torch.compile(model, backend="amp_rewrite", options={"target": "bf16", "backend": "aot_eager"},
                             dynamic=True)
    backend.last_reports.clear()  # (it keeps the last 32: counts must start from none)
    compiles = []
    with torch.no_grad():
        for batch in range(2, 12):  # (a size of 1 is specialised by dynamo itself)
            ids = inputs[0][:1].repeat(batch, 1)[:, : 4 + batch % 4]
            out, ref = compiled(ids), model(ids)
            compiles.append(len(backend.last_reports))
            assert rel_err(out, ref) < TOL["bf16"]
            assert not torch.equal(out, ref)  # (the bf16 graph ran, not a fallback to FP32)
    assert compiles == compiles[:1] * len(compiles), compiles  # all compiled at the first call
    assert any(r.heavy_ops["low"] > 0 for r in backend.last_reports)


@pytest.fixture
def inductor_settings(monkeypatch):
    """The config_patches each inductor compile is given, in order (inductor's compile_fx replaced
    by a spy: no C++ compile, the settings are what is checked)."""
    import torch._inductor.compile_fx as compile_fx_module

    seen = []

    def spy(gm, example_inputs, config_patches=None, **kwargs):
        seen.append(config_patches)
        return gm.forward

    monkeypatch.setattr(compile_fx_module, "compile_fx", spy)
    return seen


def test_compile_mode_reaches_inductor(inductor_settings):
    """torch.compile(mode=...) hands the backend the mode (not options): inductor gets that mode's
    settings, as it would compiling alone; a mode for another inner backend is refused."""
    from torch._inductor import list_mode_options

    seen = inductor_settings
    model, inputs = make("mlp")
    mode = "max-autotune-no-cudagraphs"
    with torch.no_grad():
        torch.compile(model, backend="amp_rewrite", mode=mode)(*inputs)
    assert seen == [list_mode_options(mode)] and seen[0]
    torch._dynamo.reset()
    with pytest.raises(Exception, match="mode='max-autotune-no-cudagraphs' configures inductor"):
        torch.compile(model, backend=backend.make_backend(target="bf16", backend="aot_eager"), mode=mode)(*inputs)


def test_compile_mode_leaves_the_users_inner_options_in_force(inductor_settings):
    """inner_options are the user's settings for the inner backend: with mode= too, the mode's
    settings fill in around them, not over them (max-autotune must not set max_autotune=True over
    the user's False)."""
    from torch._inductor import list_mode_options

    seen = inductor_settings
    model, inputs = make("mlp")
    mode = "max-autotune-no-cudagraphs"
    assert list_mode_options(mode)["max_autotune"] is True
    with torch.no_grad():
        torch.compile(model, backend=backend.make_backend(inner_options={"max_autotune": False}), mode=mode)(*inputs)
    assert seen == [{**list_mode_options(mode), "max_autotune": False}]


def test_last_reports_keeps_only_the_most_recent_reports():
    """last_reports holds the last _MAX_REPORTS reports, most recent last: a process that keeps
    recompiling must not keep every report (each holds a whole decision log)."""
    model, x = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4)), torch.randn(2, 4)
    backend.last_reports.clear()
    made = []
    with torch.no_grad():
        for _ in range(backend._MAX_REPORTS + 3):
            torch._dynamo.reset()
            torch.compile(model, backend="amp_rewrite", options={"target": "bf16", "backend": "eager"})(x)
            made.append(backend.last_reports[-1])
    assert len({id(r) for r in made}) == len(made)  # (one new report per compile)
    assert len(backend.last_reports) == backend._MAX_REPORTS
    assert [id(r) for r in backend.last_reports] == [id(r) for r in made[-backend._MAX_REPORTS:]]


def test_compile_refuses_low_graph_inputs():
    """Dynamo's graph inputs include the FP32 parameters: keep_io_types=False would declare them
    low and leave the whole graph FP32 under a report saying bf16."""
    from amp_rewrite.errors import UsageError

    with pytest.raises(UsageError, match="keep_io_types=False does not apply under torch.compile"):
        backend.make_backend(target="bf16", keep_io_types=False)
    model, inputs = make("mlp")
    compiled = torch.compile(model, backend="amp_rewrite",
                             options={"target": "bf16", "backend": "aot_eager", "keep_io_types": False})
    with pytest.raises(Exception, match="keep_io_types=False does not apply under torch.compile"):
        compiled(*inputs)


@pytest.mark.parametrize("kind", ["sequential", "renamed_self"])
def test_compile_node_rules_match_module_paths(kind):
    """Dynamo roots module paths at the compiled frame's local (L['fn'] for an nn.Sequential,
    L['s'] for a forward(s, x)): --fp32-nodes patterns name paths below the compiled module."""
    if kind == "sequential":
        model, pattern = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8)), "0/*"
    else:
        class Net(torch.nn.Module):
            def __init__(s):
                super().__init__()
                s.enc, s.dec = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

            def forward(s, x):
                return s.dec(torch.relu(s.enc(x)))

        model, pattern = Net(), "enc/*"
    backend.last_reports.clear()
    compiled = torch.compile(model, backend="amp_rewrite",
                             options={"target": "bf16", "backend": "aot_eager", "fp32_nodes": [pattern]})
    with torch.no_grad():
        compiled(torch.randn(2, 8))
    report = backend.last_reports[-1]
    assert report.heavy_ops["total"] == 2 and report.heavy_ops["low"] == 1
    assert not any(n.startswith("unmatched:") for n in report.log.notes)


def test_compile_an_input_mutated_in_place_says_what_works_under_compile():
    """Dynamo keeps x.add_(1) on an input; the loader's advice (decompose=True) was for rewrite() on
    an nn.Module, which torch.compile does not call. The message says what to do under compile,
    and the decompose route it names does work."""
    class Mutates(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(16, 8)

        def forward(self, x):
            x.add_(1.0)
            return self.fc(x)

    model, x = Mutates(), torch.randn(4, 16)
    compiled = torch.compile(model, backend="amp_rewrite", options={"target": "bf16", "backend": "aot_eager"})
    with pytest.raises(Exception, match=r"Under torch\.compile .*make the operation out of place"):
        compiled(x.clone())
    import amp_rewrite

    gm = amp_rewrite.rewrite(model, example_inputs=(x.clone(),), target="bf16", decompose=True)
    a, b = x.clone(), x.clone()
    with torch.no_grad():
        assert rel_err(gm(a), model(b)) < TOL["bf16"]
    assert torch.equal(a, b)  # the input was mutated alike


class _WithLinear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)


class _SetitemMask(_WithLinear):
    """Longformer's ``extended_attention_mask[attention_mask == 2] = ...``: a mask written in
    place, seen afterwards only through its own name."""

    def forward(self, x):
        m = torch.zeros_like(x)
        m[:, :2] = 1.0
        return self.fc(x * m)


class _ReadBeforeAndAfter(_WithLinear):
    """Low readers of one tensor before and after a write into it (the first must not see it)."""

    def forward(self, x):
        m = x.exp()
        a = self.fc(m)
        m[0] = 5.0
        v = m.view(-1)
        v[3] = -2.0
        return a, self.fc(m)


class _MaskedScores(torch.nn.Module):
    """Scores made by a matmul, masked in place, then a softmax."""

    def __init__(self):
        super().__init__()
        self.q, self.k = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x):
        scores = self.q(x) @ self.k(x).transpose(-1, -2)
        scores[:, 0] = float("-inf")
        return torch.softmax(scores, -1) @ x


class _LowValueWritten(_WithLinear):
    """A low-precision result written into a slice of an FP32 tensor."""

    def forward(self, x):
        m = torch.ones_like(x)
        m[:, :2] = self.fc(x)[:, :2]
        return self.fc(m)


class _ViewWritten(_WithLinear):
    """A view written in place, its base read afterwards."""

    def forward(self, x):
        h = x.exp()
        h.view(-1).mul_(2.0)
        return self.fc(h)


class _CacheBuffer(torch.nn.Module):
    """A buffer written by setitem on every call and read by a low-precision op (dynamo passes
    the buffer in as a graph input)."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
        self.register_buffer("cache", torch.zeros(4, 8))

    def forward(self, x):
        self.cache[1:3] = x[1:3] * 1000.0
        return self.fc(self.cache / 1000.0) + self.fc(x)


_WRITES_SEEN_THROUGH_ANOTHER_NAME = [_SetitemMask, _ReadBeforeAndAfter, _MaskedScores, _LowValueWritten, _ViewWritten,
                                     _CacheBuffer]


@pytest.mark.parametrize("target", ["bf16", "fp16"])
@pytest.mark.parametrize("cls", _WRITES_SEEN_THROUGH_ANOTHER_NAME, ids=lambda c: c.__name__.strip("_"))
def test_compile_rewrites_an_in_place_write_seen_through_another_name(cls, target):
    """Dynamo keeps ``m[i] = v`` (operator.setitem) and in-place writes into views; the loader
    refused each one the tensor is read through afterwards (InPlaceMutationError: Longformer could
    not be compiled with the backend at all, nor captured by rewrite()). The tensor, its views and
    the write now keep their types and each low reader casts the tensor at its own use: outputs
    match eager on every call, a reader before the write does not see it, a buffer so written
    stays FP32 and holds exactly what was written, and the ops that read no shared tensor (the
    Linear) still run low."""
    torch.manual_seed(0)
    model, reference = cls().eval(), cls().eval()
    reference.load_state_dict(model.state_dict())
    compiled = torch.compile(model, backend="amp_rewrite", options={"target": target, "backend": "aot_eager"})
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(4, 8)
            got, want = compiled(x.clone()), reference(x.clone())
            for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
                assert rel_err(g, w) < TOL[target]
            if cls is _CacheBuffer:
                assert model.cache.dtype == torch.float32 and torch.equal(model.cache, reference.cache)
    decisions = backend.last_reports[-1].log.decisions.values()
    linears = [d for d in decisions if d.op == "linear"]
    assert linears and all(d.precision == Precision.LOW for d in linears), [(d.node, d.precision) for d in linears]
    kept = [d for d in decisions if "writes in place" in d.reason and "shares storage" in d.reason]
    assert kept and all(d.precision == Precision.FP32 for d in kept)


@pytest.mark.slow
def test_compile_inductor_matches_eager():
    """Inductor on CPU needs a C++ compiler (g++ is here); the first compile takes tens of seconds."""
    model, inputs = make("mlp")
    compiled = torch.compile(model, backend="amp_rewrite", options={"target": "bf16"})
    with torch.no_grad():
        out, ref = compiled(*inputs), model(*inputs)
    assert rel_err(out, ref) < TOL["bf16"]
    assert backend.last_reports[-1].heavy_ops["low"] == 3


def test_an_autocast_region_in_a_dynamo_graph_is_left_as_written():
    """rewrite() leaves a torch.autocast region as written (torch.export wraps it in
    wrap_with_autocast); dynamo inlines it between _enter_autocast and _exit_autocast, and the
    compile backend painted the `autocast(enabled=False)` block low: its outputs past 65504 came
    out inf."""
    class Pinned(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.l, self.l2 = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
            with torch.no_grad():
                self.l2.weight.mul_(5000.0)

        def forward(self, x):
            h = self.l(x)
            with torch.autocast("cpu", enabled=False):  # the usual way to keep a block FP32
                return self.l2(h.float())

    torch.manual_seed(0)
    model, x = Pinned().eval(), torch.randn(4, 8) * 50
    ref = model(x)
    assert ref.abs().max() > 65504
    compiled = torch.compile(model, backend="amp_rewrite", options={"target": "fp16", "backend": "aot_eager"})
    out = compiled(x)
    assert torch.isfinite(out).all() and rel_err(out, ref) < TOL["fp16"]
    decisions = backend.last_reports[-1].log.decisions
    assert {d.precision.value for d in decisions.values() if d.op == "linear"} == {"low", "fp32"}
    inside = [d for d in decisions.values() if "torch.autocast region" in d.reason]
    assert inside and all(d.precision.value == "fp32" for d in inside)


class _OutWrites(torch.nn.Module):
    """Results written by out=: into a buffer, into an intermediate, into a pair of intermediates
    (torch.max's values and indices), and a float result into an integer tensor's float twin."""

    def __init__(self):
        super().__init__()
        self.l = torch.nn.Linear(4, 4)
        self.register_buffer("buf", torch.zeros(3, 4))

    def forward(self, x):
        h = self.l(x).detach()
        torch.mul(h, 2, out=self.buf)
        o = torch.zeros_like(h)
        torch.cumsum(h, 0, out=o)
        v, i = torch.zeros_like(h[:, 0]), torch.zeros_like(h[:, 0], dtype=torch.long)
        torch.max(h, 1, out=(v, i))
        return self.l(self.buf) + self.l(o) + self.l(h * v.sum()) + i.sum()


class _OutWritesNoBuffer(_OutWrites):
    def forward(self, x):
        h = self.l(x).detach()
        o = torch.zeros_like(h)
        torch.cumsum(h, 0, out=o)
        v, i = torch.zeros_like(h[:, 0]), torch.zeros_like(h[:, 0], dtype=torch.long)
        torch.max(h, 1, out=(v, i))
        return self.l(o) + self.l(h * v.sum()) + i.sum()


@pytest.mark.parametrize("capture", ["symbolic_trace", "compile"])
def test_out_writes_are_seen_by_later_readers(capture):
    """``torch.mul(h, 2, out=self.buf)`` was not taken for a write: a later low reader of the
    buffer got a copy converted once at rewrite time (stale: error ~1 on every call), and an
    intermediate painted low handed ``torch.cumsum(h, 0, out=o)`` a cast copy, so the sum landed in
    the copy and ``self.l(o)`` read zeros. It is now the in-place write it is, seen by every later
    reader. Under compile dynamo lifts the buffer into a graph input, whose write the module must
    see: that was refused, as an explicit ``copy_`` was; the buffer and the write keep their types
    now, and the buffer holds what eager writes into it (to bf16's rounding of ``self.l(x)``)."""
    torch.manual_seed(0)
    model = _OutWrites() if capture == "symbolic_trace" else _OutWritesNoBuffer()
    ref = copy.deepcopy(model)
    xs = [torch.randn(3, 4) for _ in range(3)]
    if capture == "compile":
        low = torch.compile(model, backend="amp_rewrite", options={"target": "bf16", "backend": "eager"})
    else:
        low = amp_rewrite.rewrite(model, example_inputs=(xs[0],), target="bf16", capture="symbolic_trace")
    with torch.no_grad():
        for x in xs:  # (each call reads what it wrote, not what the rewrite saw)
            assert rel_err(low(x), ref(x)) < TOL["bf16"]
    if capture == "compile":
        torch._dynamo.reset()
        model = _OutWrites()
        ref = copy.deepcopy(model)
        compiled = torch.compile(model, backend="amp_rewrite", options={"target": "bf16", "backend": "eager"})
        with torch.no_grad():
            for x in xs:
                assert rel_err(compiled(x), ref(x)) < TOL["bf16"]
                assert model.buf.dtype == torch.float32 and rel_err(model.buf, ref.buf) < TOL["bf16"]


@pytest.mark.filterwarnings("ignore:An output with one or more elements was resized")  # (the example run's)
def test_an_out_write_that_resizes_is_refused():
    class Resizes(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.l = torch.nn.Linear(4, 4)

        def forward(self, x):
            h = self.l(x).detach()
            o = torch.zeros_like(h[0])
            torch.mul(h, 2, out=o)  # (3, 4) into (4,): out= resizes o
            return self.l(o)

    with pytest.raises(UnsupportedModelError, match=r"shape \(3, 4\) into 'zeros_like' of shape \(4,\) by out=, which resizes"):
        amp_rewrite.rewrite(Resizes(), example_inputs=(torch.randn(3, 4),), target="bf16", capture="symbolic_trace")


class _Gated(torch.nn.Module):
    """A graph break with a scalar crossing it: dynamo's first graph outputs ``gate``."""

    def __init__(self) -> None:
        super().__init__()
        self.l, self.o = torch.nn.Linear(4, 8), torch.nn.Linear(8, 3)

    def forward(self, x):
        h = torch.relu(self.l(x))
        gate = h.mean()
        if float(gate) > 100:
            h = h / gate
        return self.o(h) * gate


def test_compile_training_scales_the_loss_outside_every_graph():
    """With training=True each graph dynamo made got an in-graph scale: after a recompile (a smaller
    last batch) the scaler kept unscaling by the first graph's 65536 and every update was 65536
    times too small; a scalar crossing a graph break was taken for the loss and scaled, the forward
    output with it. Now no graph holds a scale: the scaler scales the loss, once."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend="amp_rewrite", options={"training": True, "backend": "aot_eager"})
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    scaler = amp_rewrite.LossScaler()
    for n in (6, 5):  # batch 5: dynamo compiles a second graph
        x, y = torch.randn(n, 4), torch.randint(0, 3, (n,))
        before, ref_before = model[0].weight.detach().clone(), ref[0].weight.detach().clone()
        scaler.backward(torch.nn.functional.cross_entropy(compiled(x), y))
        scaler.step(opt)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ratio = ((model[0].weight - before).norm() / (ref[0].weight - ref_before).norm()).item()
        assert ratio == pytest.approx(1.0, rel=2e-2)
    assert not any(hasattr(m, "amp_loss_scale") for m in model.modules())
    # a plain backward leaves the gradients unscaled, and the scaler says it cannot know their scale
    torch.nn.functional.cross_entropy(compiled(x), y).backward()
    with pytest.raises(RuntimeError, match="does not know the scale of these gradients"):
        amp_rewrite.LossScaler().step(opt)

    torch._dynamo.reset()
    gated = _Gated()
    backend.last_reports.clear()
    compiled = torch.compile(gated, backend="amp_rewrite", options={"training": True, "backend": "aot_eager"})
    x = torch.randn(6, 4)
    assert rel_err(compiled(x), gated(x)) < TOL["fp16"]
    notes = [n for r in backend.last_reports for n in r.log.notes]
    assert not [n for n in notes if "scaled in the graph" in n]
    assert [n for n in notes if n.startswith("training under torch.compile: the loss is scaled outside")]


@pytest.mark.parametrize("option", [{"loss_scaling": True}, {"loss_output": 0}])
def test_compile_training_refuses_in_graph_scaling(option):
    from amp_rewrite.errors import UsageError

    compiled = torch.compile(torch.nn.Linear(4, 4), backend="amp_rewrite",
                             options={"training": True, "backend": "aot_eager", **option})
    with pytest.raises(Exception) as caught:
        compiled(torch.randn(2, 4)).sum()
    error = caught.value
    error = getattr(error, "inner_exception", error)  # (dynamo wraps a backend's error)
    assert isinstance(error, UsageError) and "does not apply under torch.compile" in str(error)


class _Rotary(torch.nn.Module):
    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim)), persistent=False)
        self.l = torch.nn.Linear(dim, dim)

    def forward(self, x, pos):
        f = (self.inv_freq[None, :, None].expand(pos.shape[0], -1, 1) @ pos[:, None, :].float()).transpose(1, 2)
        emb = torch.cat((f, f), -1)
        return self.l(x) * emb.cos() + x * emb.sin()


class _LearnedScale(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l, self.l2 = torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)
        self.scale = torch.nn.Parameter(torch.full((8,), 1e5))

    def forward(self, x):
        return self.l2(self.l(x) * self.scale) * 1e-5


@pytest.mark.parametrize("case", ["rotary fp16", "rotary bf16", "learned scale"])
def test_a_parameter_or_buffer_dynamo_passes_in_is_checked_as_the_module_holds_it(case):
    """torch.compile lifts parameters and buffers to graph inputs: the checks on module tensors'
    values never ran. A rotary inv_freq buffer was an activation to the position check (angles
    in fp16 at position 3000: 92% off; bf16 at 300: 62%), and a learned scale of 1e5 was cast to
    fp16 at run time (inf, NaN outputs). They are read as the module's tensors now."""
    torch.manual_seed(0)
    target = "bf16" if case == "rotary bf16" else "fp16"
    if case.startswith("rotary"):
        model, x = _Rotary(), torch.randn(2, 6, 8)
        args = (x, torch.arange(6).expand(2, 6) + (3000 if target == "fp16" else 300))
    else:
        model, args = _LearnedScale(), (torch.randn(4, 8) * 0.01,)
    compiled = torch.compile(model, backend="amp_rewrite", options={"target": target, "backend": "aot_eager"})
    with torch.no_grad():
        want, got = model(*args), compiled(*args)
    assert torch.isfinite(got).all() and rel_err(got, want) < TOL[target]


def test_the_backend_under_an_ambient_autocast_and_misused_options_say_what_to_do():
    """Called inside torch.autocast, the backend blamed 'example inputs of the wrong dtype' (the
    graph dynamo hands over holds autocast's types); backend=3, example_inputs= and the backend
    naming itself were raw TypeErrors/ValueErrors."""
    import amp_rewrite
    from amp_rewrite.compile_backend import _compile
    from amp_rewrite.errors import UsageError

    model, x = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval(), torch.randn(2, 8)
    gm = torch.fx.symbolic_trace(model)
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(UsageError, match=r"inside torch\.autocast \(cpu\)"):
        _compile(gm, [x], {"target": "bf16"})
    for options, needle in (({"backend": 3}, "must be a backend name or a callable"),
                            ({"example_inputs": (x,)}, "example_inputs do not apply under torch.compile"),
                            ({"backend": "amp_rewrite"}, "cannot hand the graph to itself")):
        with pytest.raises(UsageError, match=re.escape(needle)):
            _compile(gm, [x], {"target": "bf16", **options})
    with torch.autocast("cpu", dtype=torch.bfloat16):  # (rewrite() captures the module's own types)
        out = amp_rewrite.rewrite(model, example_inputs=(x,), target="bf16")(x)
    assert out.dtype == torch.float32
    with pytest.raises(UsageError, match="takes an onnx.ModelProto .*use amp_rewrite.rewrite"):
        amp_rewrite.api.rewrite_onnx_model(model)
    with pytest.raises(TypeError, match="is not a torch module"):
        amp_rewrite.LossScaler("gm")


def test_the_graph_handed_to_the_inner_compiler_pickles_for_its_cache_key():
    """inductor and AOTAutograd pickle the graph they are given for their cache keys. The refusal a
    rewritten module carries (torch.save(gm) would come back wrong) does not apply to that graph, which
    no user holds: under torch 2.11 inductor logged the refusal's traceback twice per compile and
    compiled without its cache. A deep copy of it pickles too; a rewrite() result still refuses."""
    import pickle

    seen = {}

    def inner(gm, example_inputs):
        seen["bytes"] = len(pickle.dumps(gm))
        seen["copy"] = len(pickle.dumps(copy.deepcopy(gm)))
        return gm.forward

    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    x = torch.randn(4, 16)
    compiled = torch.compile(model, backend="amp_rewrite", options={"target": "bf16", "backend": inner})
    with torch.no_grad():
        assert rel_err(compiled(x), model(x)) < TOL["bf16"]
    assert seen["bytes"] > 0 and seen["copy"] > 0
    gm = amp_rewrite.rewrite(model, example_inputs=(x,), target="bf16")
    with pytest.raises(pickle.PicklingError, match=r"Save gm.state_dict\(\) instead"):
        pickle.dumps(gm)


@pytest.mark.parametrize("option", [{"example_kwargs": {}}, {"capture": "export"}, {"decompose": True},
                                    {"dynamic_shapes": {"x": {0: None}}}])
def test_each_capture_option_is_refused_under_compile_as_dynamos_to_decide(option):
    """Dynamo captures the graph and supplies its inputs: an option about capturing (example
    inputs, capture, decompose, dynamic_shapes) is refused by name, saying it does not apply under
    torch.compile."""
    from amp_rewrite.compile_backend import _compile
    from amp_rewrite.errors import UsageError

    gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(4, 4)).eval())
    name = next(iter(option))
    with pytest.raises(UsageError, match=f"option\\(s\\) {name} do not apply under torch.compile"):
        _compile(gm, [torch.randn(2, 4)], {"target": "bf16", **option})


def test_the_backend_without_options_rewrites_for_fp16_and_hands_the_graph_to_inductor(inductor_settings):
    """backend="amp_rewrite" with no options: the rewrite targets fp16 and inductor compiles the
    rewritten graph with its own default settings."""
    model, x = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4)), torch.randn(2, 4)
    with torch.no_grad():
        torch.compile(model, backend="amp_rewrite")(x)
    assert inductor_settings == [None]
    assert backend.last_reports[-1].log.target == "fp16"


class _TwoGraphs(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x):
        h = self.a(x)
        torch._dynamo.graph_break()
        return self.b(h)


def test_a_graph_break_keeps_one_report_per_compiled_graph():
    """A graph break gives dynamo two graphs: each one's rewrite report is kept in last_reports,
    in the order they were compiled."""
    backend.last_reports.clear()
    model, x = _TwoGraphs(), torch.randn(2, 4)
    with torch.no_grad():
        torch.compile(model, backend="amp_rewrite", options={"target": "bf16", "backend": "eager"})(x)
    assert len(backend.last_reports) == 2
    assert all(r.log.target == "bf16" and r.heavy_ops["low"] == r.heavy_ops["total"] == 1
               for r in backend.last_reports)


def test_options_given_to_torch_compile_override_make_backends_fixed_ones():
    """torch.compile(..., options=) reaches a make_backend callable too: an option given there
    takes the place of the same option fixed in make_backend (a rewrite option as much as target)."""
    model, x = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4)), torch.randn(2, 4)
    fixed = backend.make_backend(target="fp16", backend="eager", fp32_ops=["linear"])
    with torch.no_grad():
        torch.compile(model, backend=fixed, options={"target": "bf16", "fp32_ops": []})(x)
    report = backend.last_reports[-1]
    assert report.log.target == "bf16"
    assert report.heavy_ops["low"] == report.heavy_ops["total"] == 2


def test_compile_clamps_lifted_module_tensors_past_the_range_where_it_casts_them():
    """dynamo lifts parameters and buffers to graph inputs, cast at use: a mask buffer of finfo.min
    read by baddbmm was -inf (a fully masked row NaN) and a weight of 1e5 inf, where the inference
    rewrite, converting them offline, saturates both. The casts clamp them now."""
    from test_fx_rewrite import _MaskBufferAttention

    torch.manual_seed(0)
    model, x = _MaskBufferAttention().eval(), torch.randn(2, 5, 8)
    compiled = torch.compile(model, backend="amp_rewrite", options={"target": "fp16", "backend": "aot_eager"})
    with torch.no_grad():
        out = compiled(x)
        inference = amp_rewrite.rewrite(model, example_inputs=(x,), target="fp16")(x)
    assert torch.isfinite(out).all()
    assert (out - inference).abs().max() <= 1e-2 * inference.abs().max()


class _MaskBeforeABreak(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(16, 48)

    def forward(self, x, am):
        pad = ((1.0 - am[:, None, :].float()) * torch.finfo(torch.float32).min).expand(-1, x.shape[1], -1)
        torch._dynamo.graph_break()  # (logging, a .item(): dynamo hands pad to the next graph as an input)
        q, k, v = self.qkv(x).chunk(3, -1)
        return torch.baddbmm(pad, q, k.transpose(-1, -2), alpha=0.25).softmax(-1) @ v


def test_compile_clamps_a_mask_a_graph_break_hands_over():
    """A padding mask of finfo.min built before a graph break reaches the next graph as its input,
    which was cast as it was: -inf, and the fully padded row NaN, where one graph clamps it. An
    activation input of a dynamo graph is clamped before its cast."""
    torch.manual_seed(0)
    model, x = _MaskBeforeABreak().eval(), torch.randn(2, 6, 16)
    am = torch.ones(2, 6, dtype=torch.long)
    am[1, :] = 0  # (the second sequence fully padded)
    backend.last_reports.clear()
    compiled = torch.compile(model, backend="amp_rewrite", options={"target": "fp16", "backend": "aot_eager"})
    with torch.no_grad():
        out, want = compiled(x, am), model(x, am)
    assert len(backend.last_reports) == 2
    assert torch.isfinite(want).all() and torch.isfinite(out).all()
    assert (out - want).abs().max() <= 1e-2 * want.abs().max()
    casts = [c for r in backend.last_reports for c in r.to_dict()["casts"] if "torch.compile hands values over" in c["reason"]]
    assert casts, "the clamped cast of the handed-over mask"


def test_compile_passes_the_gradient_of_a_clamped_lifted_parameter_straight_through():
    """Under torch.compile the parameters are graph inputs cast at use; one of 1e5 is clamped at
    65504, and the clamp's backward zeroed its gradient (the weight stuck out of range for good).
    The clamp of a value that requires a gradient passes it straight through."""
    from test_training import _big_master

    x, y = torch.full((4, 8), 1e-3), torch.zeros(4, 2)
    model, reference = _big_master(1e5), _big_master(65504.0)
    compiled = torch.compile(model, backend="amp_rewrite", options={"target": "fp16", "backend": "aot_eager"})
    compiled(x, y).backward()
    reference(x, y).backward()
    assert float(reference.fc.weight.grad[0, 0]) != 0.0
    assert torch.allclose(model.fc.weight.grad, reference.fc.weight.grad, rtol=1e-2, atol=1e-6)
