"""torch.fx frontend and emitter: amp_rewrite.rewrite() on torch modules and GraphModules.

Tolerances (stated once, used everywhere): the rewritten module's output may differ from the FP32
module's by at most ``TOL[target]`` relative to the largest FP32 output magnitude,
max|y_amp - y_fp32| / max|y_fp32|: 3e-2 in BF16 (8 significand bits), 5e-3 in FP16 (11 bits), on
tiny shapes (hidden <= 64, seq <= 8, batch <= 2) so FP16 on CPU stays fast.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import operator
import re
import warnings

import pytest

torch = pytest.importorskip("torch")
import torch.fx as fx  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import amp_rewrite  # noqa: E402
from amp_rewrite.api import _dispatch  # noqa: E402
from amp_rewrite.decisions import Precision  # noqa: E402
from amp_rewrite.errors import RuleFileError, UnsupportedModelError, UsageError  # noqa: E402
from amp_rewrite.frontends.fx_loader import leaf_metas, load_fx  # noqa: E402
from amp_rewrite.fx_api import report_of  # noqa: E402

TOL = {"bf16": 3e-2, "fp16": 5e-3}
LOW = {"bf16": torch.bfloat16, "fp16": torch.float16}


# -- models (tiny) -----------------------------------------------------------------------------------------------
class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 8)

    def forward(self, x):
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


class Block(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.c2, self.b2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        y = self.relu(self.b1(self.c1(x)))
        y = self.b2(self.c2(y))
        return self.relu(y + x)


class CNN(nn.Module):
    """ResNet-style: stem, one residual block with BatchNorm, pooling, classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.bn = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.block = Block(8)
        self.pool, self.fc = nn.AdaptiveAvgPool2d(1), nn.Linear(8, 10)

    def forward(self, x):
        x = F.relu(self.bn(self.stem(x)))
        x = self.block(x)
        return self.fc(self.pool(x).flatten(1))


class Encoder(nn.Module):
    """One transformer encoder layer around nn.MultiheadAttention, with a LM head."""

    def __init__(self, d: int = 32, heads: int = 2, vocab: int = 50) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.ff1, self.ff2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids):
        x = self.emb(ids)
        a, _ = self.attn(x, x, x, need_weights=False)
        x = self.ln1(x + a)
        x = self.ln2(x + self.ff2(F.gelu(self.ff1(x))))
        return self.head(x)


class LSTMLM(nn.Module):
    def __init__(self, vocab: int = 50) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, 16)
        self.lstm = nn.LSTM(16, 32, num_layers=2, batch_first=True)
        self.head = nn.Linear(32, vocab)

    def forward(self, ids):
        y, _ = self.lstm(self.emb(ids))
        return self.head(y)


def make(name: str):
    torch.manual_seed(0)
    if name == "mlp":
        return MLP().eval(), (torch.randn(2, 16),)
    if name == "cnn":
        model = CNN().eval()
        with torch.no_grad():  # non-trivial running statistics
            for m in model.modules():
                if isinstance(m, nn.BatchNorm2d):
                    m.running_mean.uniform_(-0.5, 0.5)
                    m.running_var.uniform_(0.5, 2.0)
        return model, (torch.randn(2, 3, 8, 8),)
    if name == "encoder":
        return Encoder().eval(), (torch.randint(0, 50, (2, 8)),)
    if name == "lstm":
        return LSTMLM().eval(), (torch.randint(0, 50, (2, 8)),)
    raise KeyError(name)


# -- helpers -------------------------------------------------------------------------------------------------------
def rel_err(out, ref) -> float:
    return float((out.float() - ref.float()).abs().max() / ref.float().abs().max())


class _DtypeCheck(fx.Interpreter):
    """Runs the module node by node and compares every tensor's real dtype with node.meta: the
    emitter's promise that each op computes exactly in the type the IR gave it (no silent promotion)."""

    def __init__(self, gm):
        super().__init__(gm)
        self.mismatches: list[str] = []

    def run_node(self, n):
        out = super().run_node(n)
        if n.op in ("call_function", "call_method", "call_module"):
            for path, meta in leaf_metas(n):
                actual = out
                for p in path:
                    actual = actual[p]
                if isinstance(actual, torch.Tensor) and actual.dtype != meta.dtype:
                    self.mismatches.append(f"{n.name}{path}: meta {meta.dtype}, actual {actual.dtype}")
        return out


def assert_dtypes_consistent(gm, inputs) -> None:
    check = _DtypeCheck(gm)
    with torch.no_grad():
        check.run(*inputs)
    assert not check.mismatches, check.mismatches


def low_node_count(result) -> int:
    return sum(1 for d in result.log.decisions.values() if d.precision == Precision.LOW)


# -- end to end: numerics, lint, dtypes, idempotence, the caller's module untouched ---------------------------------------
CASES = [(m, c, t) for m in ("mlp", "cnn", "encoder", "lstm") for c in ("export", "symbolic_trace") for t in ("bf16", "fp16")]


@pytest.mark.parametrize("name,capture,target", CASES, ids=[f"{m}-{c}-{t}" for m, c, t in CASES])
def test_rewrite_matches_fp32(name, capture, target):
    model, inputs = make(name)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = _dispatch(model, example_inputs=inputs, target=target, capture=capture)
    gm = result.model
    assert isinstance(gm, fx.GraphModule)
    assert result.modified and low_node_count(result) > 0
    gm.graph.lint()
    with torch.no_grad():
        ref, out = model(*inputs), gm(*inputs)
    assert out.dtype == torch.float32  # keep_io_types
    assert rel_err(out, ref) < TOL[target], f"{name} {capture} {target}: {rel_err(out, ref):.2e}"
    assert_dtypes_consistent(gm, inputs)
    # the caller's module is untouched
    for k, v in model.state_dict().items():
        assert v.dtype == before[k].dtype and torch.equal(v, before[k]), k
    # rewriting the output again changes nothing
    code = gm.code
    again = _dispatch(gm, example_inputs=inputs, target=target)
    assert not again.modified
    assert again.model.code == code


class _IntArgument(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(16, 16)

    def forward(self, x, n: int = 3):
        return self.l(x) * n


def test_rewriting_an_output_with_a_number_argument_again_needs_no_example_inputs():
    """A symbolic_trace rewrite of ``forward(self, x, n: int = 3)`` carries its metadata, but the
    int placeholder has no tensor's (ShapeProp records its type only): rewriting the output again
    asked for example inputs ('carries no dtype metadata'). It changes nothing now, as for any output."""
    x = torch.randn(2, 8, 16)
    gm = amp_rewrite.rewrite(_IntArgument().eval(), example_inputs=(x,), capture="symbolic_trace")
    again = _dispatch(gm)
    assert not again.modified and again.model.code == gm.code
    with torch.no_grad():
        assert torch.equal(again.model(x, 2), gm(x, 2))


@pytest.mark.parametrize("target", ["bf16", "fp16"])
def test_optimal_placement_keeps_nested_tuple_metadata_true(target):
    """The min-cut runs the LSTM (an infer op) low between the embedding and the head, so its
    (h, c) tuple is low too: the getitem that selects that tuple must say so in its metadata,
    not only the getitems of its leaves (the torch default, greedy, keeps the LSTM FP32)."""
    model, inputs = make("lstm")
    result = _dispatch(model, example_inputs=inputs, target=target, capture="symbolic_trace", placement="optimal")
    gm = result.model
    lstm = next(n for n in gm.graph.nodes if n.op == "call_module" and n.target == "lstm")
    assert result.log.decisions["lstm/lstm"].precision == Precision.LOW
    assert any(n.op == "call_function" and n.target is operator.getitem and n.args == (lstm, 1) for n in gm.graph.nodes)
    gm.graph.lint()
    with torch.no_grad():
        ref, out = model(*inputs), gm(*inputs)
    assert rel_err(out, ref) < TOL[target]
    assert_dtypes_consistent(gm, inputs)


def test_heavy_ops_low_and_params_stored_low():
    model, inputs = make("cnn")
    result = _dispatch(model, example_inputs=inputs, target="bf16")
    heavy = result.report.heavy_ops
    assert heavy["total"] == 4 and heavy["low"] == 4, heavy  # 3 convolutions and the classifier
    gm = result.model
    params = dict(gm.named_parameters())
    assert params["stem.weight"].dtype == torch.bfloat16  # inference: stored low, memory halved
    assert params["bn.weight"].dtype == torch.float32  # BatchNorm keeps FP32 parameters beside bf16 input
    assert dict(gm.named_buffers())["bn.running_var"].dtype == torch.float32
    w = result.log.weights
    assert w.converted > 0 and w.bytes_after < w.bytes_before


@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_decomposed_export_graphs(name):
    """torch.export after run_decompositions(): aten.addmm/permute, _native_batch_norm_legit_no_training
    with getitem outputs, _softmax ... — as a GraphModule and as an ExportedProgram."""
    model, inputs = make(name)
    ep = torch.export.export(model, inputs).run_decompositions()
    for obj in (ep.module(), ep):
        result = _dispatch(obj, target="bf16")
        gm = result.model
        gm.graph.lint()
        with torch.no_grad():
            assert rel_err(gm(*inputs), model(*inputs)) < TOL["bf16"]
        assert_dtypes_consistent(gm, inputs)
        ops = {d.op for d in result.log.decisions.values()}
        assert "addmm" in ops
        assert not result.log.unlisted_ops, result.log.unlisted_ops
        assert not _dispatch(gm, target="bf16").modified


def test_public_rewrite_and_report():
    model, inputs = make("mlp")
    gm, report = amp_rewrite.rewrite(model, example_inputs=inputs, target="bf16", report=True)
    assert report.summary()["heavy_ops"]["low"] == 3
    assert report_of(gm).summary() == report.summary()
    tags = {n.name: n.meta.get("amp_rewrite") for n in gm.graph.nodes}
    assert tags["linear"]["precision"] == "low" and tags["linear"]["category"] == "allow"
    assert "torch.autocast" in tags["linear"]["reason"]
    inserted = [t for t in tags.values() if t and t.get("inserted") == "cast"]
    assert inserted and all(t["reason"] for t in inserted)


def test_node_meta_and_stack_traces_kept():
    model, inputs = make("encoder")
    ep = torch.export.export(model, inputs)
    original = {n.name: n.meta.get("stack_trace") for n in ep.module().graph.nodes}
    gm = amp_rewrite.rewrite(ep, target="bf16")
    for n in gm.graph.nodes:
        if n.name in original and original[n.name]:
            assert n.meta.get("stack_trace") == original[n.name], n.name
    casts = [n for n in gm.graph.nodes if (n.meta.get("amp_rewrite") or {}).get("inserted") == "cast"]
    assert casts and all(n.meta.get("stack_trace") for n in casts)  # a cast points at the code that needs it


# -- op spellings ---------------------------------------------------------------------------------------------------
class Spellings(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.w = nn.Parameter(torch.randn(8, 8) * 0.1)
        self.sm = nn.Softmax(-1)

    def forward(self, x):
        a = self.fc(x)  # call_module nn.Linear
        b = F.linear(x, self.w)  # call_function F.linear on a get_attr weight
        c = x @ self.w  # operator.matmul
        d = torch.matmul(x, self.w)  # torch.matmul
        e = a.softmax(-1) + torch.softmax(b, -1) + F.softmax(c, dim=-1) + self.sm(d)  # four softmax spellings
        f = e.float().to(torch.float32)  # conversions
        return torch.relu(f) + x.relu()


class _ScalarArithmetic(nn.Module):
    def forward(self, x):
        return torch.add(x * 5.5, x, alpha=300.0) - torch.sub(x, x, alpha=1)


def test_the_numbers_arithmetic_combines_with_its_tensors_are_recorded_alpha_included():
    """The numbers a mul/div/add/sub combines with its tensors are recorded where they sit (the
    optimal placement bounds growth by them); add/sub's ``alpha`` scales an operand and counts as
    one more, unless it is 1."""
    x = torch.randn(2, 4)
    ir = load_fx(fx.symbolic_trace(_ScalarArithmetic()), example_inputs=(x,))
    scalars = {n.op_type: n.meta.get("amp.scalars") for n in ir.graph.nodes}
    assert scalars["mul"] == ((("args", 1), 5.5),)
    assert scalars["add"] == ((("kwargs", "alpha"), 300.0),)
    assert scalars["sub"] is None


def test_every_spelling_maps_to_the_rule_name():
    model = Spellings().eval()
    x = torch.randn(2, 8)
    gm = fx.symbolic_trace(model)
    ir = load_fx(copy.deepcopy(gm), example_inputs=(x,))
    ops = sorted(n.op_type for n in ir.graph.nodes)
    assert ops.count("linear") == 2 and ops.count("matmul") == 2 and ops.count("softmax") == 4
    assert ops.count("relu") == 2 and ops.count("Cast") == 2 and ops.count("add") == 4
    # ATen level: the same model through torch.export, before and after decomposition
    ep = torch.export.export(model, (x,))
    aten_ops = {n.op_type for n in load_fx(ep.module()).graph.nodes}
    assert {"linear", "matmul", "softmax", "relu", "add"} <= aten_ops
    decomposed = {n.op_type for n in load_fx(ep.run_decompositions().module()).graph.nodes}
    assert {"addmm", "_softmax", "relu", "add"} <= decomposed
    result = _dispatch(model, example_inputs=(x,), target="bf16", capture="symbolic_trace")
    assert not result.log.unlisted_ops
    with torch.no_grad():
        assert rel_err(result.model(x), model(x)) < TOL["bf16"]


# -- leaf modules handled whole ----------------------------------------------------------------------------------------
def test_leaf_modules_handled_whole_with_casts_around():
    """symbolic_trace keeps BatchNorm, LSTM and MultiheadAttention as call_module leaves: each is one
    IR node whose parameters are its inputs, painted and cast around as a whole."""
    model, inputs = make("encoder")
    result = _dispatch(model, example_inputs=inputs, target="bf16", capture="symbolic_trace")
    gm = result.model
    attn = next(n for n in gm.graph.nodes if n.op == "call_module" and n.target == "attn")
    assert all(a.meta["tensor_meta"].dtype == torch.bfloat16 for a in attn.args[:3])  # allow: inputs cast low
    assert gm.attn.in_proj_weight.dtype == torch.bfloat16  # and its own parameters converted with it
    decision = result.log.decisions["attn/attn"]
    assert decision.op == "multi_head_attention" and decision.precision == Precision.LOW

    model, inputs = make("cnn")
    gm = _dispatch(model, example_inputs=inputs, target="fp16", capture="symbolic_trace").model
    bn = next(n for n in gm.graph.nodes if n.op == "call_module" and n.target == "block.b1")
    assert bn.args[0].meta["tensor_meta"].dtype == torch.float16  # between two convolutions: joins them
    assert gm.block.b1.running_mean.dtype == torch.float32 and gm.block.b1.weight.dtype == torch.float32

    model, inputs = make("lstm")
    result = _dispatch(model, example_inputs=inputs, target="bf16", capture="symbolic_trace")
    lstm = next(n for n in result.model.graph.nodes if n.op == "call_module" and n.target == "lstm")
    assert lstm.args[0].meta["tensor_meta"].dtype == torch.float32  # infer, not between allow ops
    assert "lstm/lstm" in result.log.decisions and result.log.decisions["lstm/lstm"].op == "lstm"


# -- weights -----------------------------------------------------------------------------------------------------------
class SharedWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8) * 0.3)

    def forward(self, x):
        return F.linear(x, self.w) + self.w.exp().sum()  # one low use (linear), one FP32 use (exp, deny)


def test_weight_shared_by_fp32_and_low_uses_gets_a_low_copy():
    model, x = SharedWeight().eval(), torch.randn(2, 8)
    result = _dispatch(model, example_inputs=(x,), target="fp16")
    gm = result.model
    assert gm.w.dtype == torch.float32
    copies = [(n, b) for n, b in gm.named_buffers() if "amp_fp16" in n]
    assert len(copies) == 1 and copies[0][1].dtype == torch.float16
    assert set(gm.state_dict()) == set(model.state_dict())  # the copy is not persistent
    assert result.log.weights.duplicated == 1
    with torch.no_grad():
        assert rel_err(gm(x), model(x)) < TOL["fp16"]


@pytest.mark.parametrize("capture", ["export", "symbolic_trace"])
def test_loading_a_state_dict_makes_the_low_copy_again(capture):
    """The low copy of a weight read both low and FP32 is a buffer outside the state dict: after
    gm.load_state_dict(new) the linear went on computing with the old weights (error 1.5)."""
    torch.manual_seed(0)
    model, x = SharedWeight().eval(), torch.randn(2, 8)
    gm = amp_rewrite.rewrite(model, example_inputs=(x,), target="bf16", capture=capture)
    other = SharedWeight().eval()
    gm.load_state_dict(other.state_dict())
    with torch.no_grad():
        assert rel_err(gm(x), other(x)) < TOL["bf16"]
    copied = copy.deepcopy(gm)
    copied.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert rel_err(copied(x), model(x)) < TOL["bf16"] and rel_err(gm(x), other(x)) < TOL["bf16"]


@pytest.mark.parametrize("capture", ["export", "symbolic_trace"])
def test_a_weight_written_in_place_makes_its_low_copy_again(capture):
    """Only load_state_dict made the low copy again: after ``gm.w.copy_(w)`` (or nn.init, an EMA,
    an optimizer step) the linear computed with the old weight while exp().sum() read the new one
    (error 1.5). The copy is made again at the next call after its original changes, and only then."""
    torch.manual_seed(0)
    model, x = SharedWeight().eval(), torch.randn(2, 8)
    gm = amp_rewrite.rewrite(model, example_inputs=(x,), target="bf16", capture=capture)
    low = next(b for n, b in gm.named_buffers() if "_amp_" in n)
    with torch.no_grad():
        gm(x)
        made = low._version
        gm(x)
        assert low._version == made  # (nothing changed: not made again)
        w = torch.randn(8, 8) * 0.3
        model.w.copy_(w)
        gm.w.copy_(w)
        assert rel_err(gm(x), model(x)) < TOL["bf16"]
        gm.w.mul_(0.5)
        model.w.mul_(0.5)
        assert rel_err(gm(x), model(x)) < TOL["bf16"]
    gm.w = nn.Parameter(torch.randn(8, 8) * 0.3)  # (replaced, not written)
    with torch.no_grad():
        model.w.copy_(gm.w)
        assert rel_err(gm(x), model(x)) < TOL["bf16"]


class _SharedBySoftmax(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4) * 0.3)

    def forward(self, x):
        return F.linear(x, self.w) + torch.softmax(self.w, -1).sum()  # one low use, one FP32 use


def test_a_weight_grown_past_fp16_is_clamped_in_the_cast_its_low_readers_take_under_grad():
    """With autograd recording, the low readers of a weight read both low and FP32 take a cast of it
    made for that forward, clamped at FP16's limit as the copy is: a weight grown past 65504 in
    training reads as 65504 there, not inf."""
    torch.manual_seed(0)
    model, x = _SharedBySoftmax().train(), torch.full((1, 4), 1e-3)
    gm = amp_rewrite.rewrite(model, example_inputs=(x,), target="fp16", capture="symbolic_trace")
    assert [n for n, _ in gm.named_buffers() if "_amp_" in n]
    with torch.no_grad():
        gm.w[0, 0] = 1e5
    out = gm(x)
    assert torch.isfinite(out).all() and float(out[0, 0].detach()) == pytest.approx(65.504 + 4.0, rel=1e-2)


class _SharedWeightWithATakenName(SharedWeight):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("w_amp_bf16", torch.zeros(()))  # (the name a low copy of w would take)

    def forward(self, x):
        return super().forward(x) + self.w_amp_bf16


def test_a_low_copy_takes_a_free_name_where_its_own_is_taken():
    """A low copy is named ``<weight>_amp_<type>``, or with a number where the module has an
    attribute of that name already, which stays as it was."""
    torch.manual_seed(0)
    model, x = _SharedWeightWithATakenName().eval(), torch.randn(2, 8)
    gm = amp_rewrite.rewrite(model, example_inputs=(x,), target="bf16", capture="symbolic_trace")
    assert [n for n, _ in gm.named_buffers() if "_amp_" in n] == ["w_amp_bf16", "w_amp_bf16_1"]
    assert float(gm.w_amp_bf16) == 0.0 and gm.w_amp_bf16_1.dtype == torch.bfloat16
    with torch.no_grad():
        assert rel_err(gm(x), model(x)) < TOL["bf16"]


def test_a_weight_replaced_by_one_of_another_shape_makes_its_low_copy_anew():
    """A weight read low and FP32 replaced by a tensor of another shape (a resized head): its low
    copy cannot take the new values in place, and is made anew at the next call."""
    torch.manual_seed(0)
    x = torch.randn(2, 8)
    gm = amp_rewrite.rewrite(SharedWeight().eval(), example_inputs=(x,), target="bf16", capture="symbolic_trace")
    gm.w = nn.Parameter(torch.randn(4, 8) * 0.3)
    with torch.no_grad():
        got = gm(x)
        want = F.linear(x, gm.w) + gm.w.exp().sum()
    assert got.shape == (2, 4) and rel_err(got, want) < TOL["bf16"]
    assert next(b for n, b in gm.named_buffers() if "_amp_" in n).shape == (4, 8)



class _ConvertedAndCopied(nn.Module):
    """l.weight is read low (linear) and FP32 (sum): a low copy; l2's weight only low: converted."""

    def __init__(self) -> None:
        super().__init__()
        self.l, self.l2 = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.l2(torch.relu(self.l(x))) + self.l.weight.sum()


@pytest.mark.parametrize("capture", ["export", "symbolic_trace"])
def test_load_state_dict_with_assign_keeps_the_weights_converted(capture):
    """gm.load_state_dict(ckpt, assign=True) put the checkpoint's FP32 tensors in place of the
    weights the rewrite converted: every call then raised 'mat1 and mat2 must have the same dtype'."""
    torch.manual_seed(0)
    model, trained, x = _ConvertedAndCopied().eval(), _ConvertedAndCopied().eval(), torch.randn(3, 8)
    gm = amp_rewrite.rewrite(model, example_inputs=(x,), target="bf16", capture=capture)
    dtypes = {name: t.dtype for name, t in gm.state_dict().items()}
    assert torch.bfloat16 in dtypes.values()  # (something was converted in place)
    gm.load_state_dict(trained.state_dict(), assign=True)
    assert {name: t.dtype for name, t in gm.state_dict().items()} == dtypes
    assert all(isinstance(p, nn.Parameter) for p in gm.parameters())
    with torch.no_grad():
        assert rel_err(gm(x), trained(x)) < TOL["bf16"]
    copied = copy.deepcopy(gm)  # (the hook goes with a copy)
    copied.load_state_dict(model.state_dict(), assign=True)
    with torch.no_grad():
        assert rel_err(copied(x), model(x)) < TOL["bf16"] and rel_err(gm(x), trained(x)) < TOL["bf16"]


def test_a_rewrite_on_the_meta_device_takes_its_weights_with_assign():
    """A model built on the meta device, rewritten, then given its weights by
    load_state_dict(assign=True): the low copy of a weight read both low and FP32 is no state dict
    key, so it stayed on meta, and the module returned garbage (errors 0.8 to 1e20) without a word."""
    torch.manual_seed(0)
    trained, x = _ConvertedAndCopied().eval(), torch.randn(3, 8)
    with torch.device("meta"):
        skeleton = _ConvertedAndCopied().eval()
    gm = amp_rewrite.rewrite(skeleton, example_inputs=(x.to("meta"),), target="bf16", capture="symbolic_trace")
    gm.load_state_dict(trained.state_dict(), assign=True)
    assert not any(t.is_meta for t in [*gm.parameters(), *gm.buffers()])
    with torch.no_grad():
        assert rel_err(gm(x), trained(x)) < TOL["bf16"]


def test_loading_a_checkpoint_clamps_a_converted_weight_as_the_rewrite_does():
    """A weight converted in place took a checkpoint's values by load_state_dict's copy_, which
    makes FP32 values past 65504 inf in FP16; the rewrite itself clamps them to 65504."""
    model, x = _ConvertedAndCopied().eval(), torch.randn(3, 8)
    gm = amp_rewrite.rewrite(model, example_inputs=(x,), target="fp16", capture="symbolic_trace")
    assert gm.l2.weight.dtype == torch.float16
    state = model.state_dict()
    state["l2.weight"] = state["l2.weight"].clone()
    state["l2.weight"][0, 0] = 1e5
    # the rewrite chose its readers' precision from the values it saw: the clamp is said (a learned
    # scale of 1e5 read by an infer op, kept FP32 by a rewrite of the trained module, gave NaN)
    with pytest.warns(RuntimeWarning, match=r"'l2.weight' holds 1 value\(s\) beyond float16's range"):
        gm.load_state_dict(state)
    assert gm.l2.weight[0, 0].item() == 65504.0 and state["l2.weight"][0, 0].item() == 1e5
    state["l2.weight"][0, 0] = -1e9  # a mask sentinel saturates and still masks: nothing to say
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gm.load_state_dict(state)
    assert gm.l2.weight[0, 0].item() == -65504.0


class _Rope(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(8, 8)
        self.register_buffer("inv_freq", 1.0 / (100 ** (torch.arange(0, 8, 2).float() / 8)), persistent=False)
        self.rot = nn.Module()  # (one in a submodule too)
        self.rot.register_buffer("pos", torch.arange(4, dtype=torch.float32), persistent=False)

    def forward(self, x):
        ang = torch.outer(self.rot.pos, self.inv_freq).repeat(1, 2)  # (x: 4 positions)
        return self.l(x) * ang.cos() + x * ang.sin()


@pytest.mark.parametrize("capture", ["export", "symbolic_trace"])
def test_non_persistent_buffers_stay_out_of_the_state_dict(capture):
    """A non-persistent buffer (a RoPE inv_freq) became persistent in the rewritten module:
    GraphModule's deepcopy (export) and symbolic_trace register every buffer as persistent, so
    gm.load_state_dict(model.state_dict()) missed the key and the model refused gm's checkpoint.
    (symbolic_trace's _tensor_constant0, the cos table computed from buffers alone, too.)"""
    torch.manual_seed(0)
    model, x = _Rope().eval(), torch.randn(2, 4, 8)
    gm = amp_rewrite.rewrite(model, example_inputs=(x,), target="bf16", capture=capture)
    assert set(gm.state_dict()) == set(model.state_dict())
    gm.load_state_dict(_Rope().state_dict())
    _Rope().load_state_dict(gm.state_dict())
    assert set(copy.deepcopy(gm).state_dict()) == set(model.state_dict())
    with torch.no_grad():
        gm.load_state_dict(model.state_dict())
        assert rel_err(gm(x), model(x)) < TOL["bf16"]


def test_fp32_nodes_given_as_one_string_is_one_pattern():
    """fp32_nodes="fc1/*" was split into its letters, and the '*' among them pinned every node."""
    model, x = MLP().eval(), torch.randn(2, 16)
    as_str = amp_rewrite.rewrite(model, example_inputs=(x,), target="bf16", fp32_nodes="fc1/*", report=True)[1]
    as_list = amp_rewrite.rewrite(model, example_inputs=(x,), target="bf16", fp32_nodes=["fc1/*"], report=True)[1]
    assert as_str.heavy_ops == as_list.heavy_ops and as_str.heavy_ops["low"] == 2


@dataclasses.dataclass
class _Logits:
    logits: torch.Tensor
    norm: float


class _ReturnsADataclass(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        y = self.fc(x)
        return _Logits(logits=y, norm=y.abs().max().item())


def test_a_dataclass_the_module_returns_gets_fp32_tensors():
    """torch.export refuses a dataclass output, so rewrite() traces symbolically; the node building
    the dataclass makes no tensor and was skipped, so the low linear output went into it (and out
    of the module) in BF16 despite keep_io_types, and .item() read the rounded value."""
    torch.manual_seed(0)
    model, x = _ReturnsADataclass().eval(), torch.randn(2, 8)
    result = _dispatch(model, example_inputs=(x,), target="bf16")
    gm = result.model
    gm.graph.lint()
    out, ref = gm(x), model(x)
    assert out.logits.dtype == torch.float32 and rel_err(out.logits, ref.logits) < TOL["bf16"]
    assert out.norm == out.logits.abs().max().item()  # read from the FP32 value
    assert [d.precision for d in result.log.decisions.values() if d.op == "linear"] == [Precision.LOW]
    assert not _dispatch(gm, example_inputs=(x,), target="bf16").modified


class _CountsCalls(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.register_buffer("calls", torch.zeros(()))
        self.register_buffer("ema", torch.ones(8))

    def forward(self, x):
        self.calls += 1
        self.ema.mul_(0.5)
        return self.fc(x)


def test_symbolic_tracing_leaves_the_callers_module_as_it_was():
    """symbolic_trace ran on the caller's module (the private copy was made after): its buffer
    updates in forward were applied to the caller's buffers, or replaced them. (Such updates, which
    read no traced value, are not recorded by tracing: the rewrite refuses them, after tracing.)"""
    model = _CountsCalls().eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(UnsupportedModelError, match="'calls', 'ema' in a way torch.fx.symbolic_trace does not record"):
        amp_rewrite.rewrite(model, example_inputs=(torch.randn(2, 8),), target="bf16", capture="symbolic_trace")
    assert set(model._buffers) == {"calls", "ema"}
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())


def test_weights_clamped_at_true_fp16_limits():
    model = nn.Sequential(nn.Linear(4, 4)).eval()
    with torch.no_grad():
        model[0].weight[0, 0] = 1e6
        model[0].weight[0, 1] = 70000.0
        model[0].weight[0, 2] = 60000.0  # representable: untouched
    result = _dispatch(model, example_inputs=(torch.randn(1, 4),), target="fp16")
    w = result.model.get_parameter("0.weight")
    assert w.dtype == torch.float16
    assert float(w[0, 0]) == 65504.0 and float(w[0, 1]) == 65504.0 and float(w[0, 2]) == 60000.0
    assert result.log.weights.clamped == 2
    assert not result.log.weights.sentinels  # sentinels start at 1e8 (masks), 1e6 is just large


def test_weight_conversion_counts_infinities_and_mask_sizes_as_sentinels_not_nan():
    """Converting a weight, ±inf and magnitudes of 1e8 and more count as sentinels (with their
    range); a NaN is none: a NaN weight is not reported as a mask."""
    from amp_rewrite.emitters.fx_emitter import convert_tensor

    converted, clamped, flushed, sentinel = convert_tensor(torch.tensor([1.0, float("nan"), -math.inf, -1e9]),
                                                           torch.float16)
    assert sentinel == {"count": 2, "min": -math.inf, "max": -1e9} and clamped == 1  # (-1e9, to -65504)
    assert converted.dtype == torch.float16 and bool(converted[1].isnan())
    assert convert_tensor(torch.tensor([1.0, float("nan")]), torch.float16)[3] is None


# -- training -------------------------------------------------------------------------------------------------------
class WithLoss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = MLP()

    def forward(self, x, y):
        logits = self.net(x)
        return logits, F.cross_entropy(logits, y)


@pytest.mark.parametrize("capture", ["export", "symbolic_trace"])
def test_training_master_weights_loss_fp32_and_loss_scale(capture):
    torch.manual_seed(0)
    model = WithLoss().train()
    x, y = torch.randn(4, 16), torch.randint(0, 8, (4,))
    result = _dispatch(model, example_inputs=(x, y), target="fp16", training=True, capture=capture)
    gm = result.model
    assert gm.amp_training is True
    scale = gm.get_buffer("amp_loss_scale")
    assert scale.dtype == torch.float32 and scale.shape == () and float(scale) == 1.0
    assert all(p.dtype == torch.float32 for p in gm.parameters())  # master weights stay FP32
    logits, loss = gm(x, y)
    ref_logits, ref_loss = model(x, y)
    assert loss.dtype == torch.float32 and abs(float(loss) - float(ref_loss)) < 5e-3 * abs(float(ref_loss))
    loss.backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in gm.parameters())
    # the loss is multiplied by the buffer
    with torch.no_grad():
        gm.amp_loss_scale.fill_(8.0)
        assert abs(float(gm(x, y)[1]) - 8.0 * float(loss)) < 1e-4 * 8.0 * abs(float(loss))
    again = _dispatch(gm, example_inputs=(x, y), target="fp16", training=True)
    assert not again.modified and again.model.code == gm.code  # no second cast, no second loss scale
    loss_decisions = [d for d in result.log.decisions.values() if d.op in ("cross_entropy", "cross_entropy_loss")]
    assert loss_decisions and all(d.precision == Precision.FP32 for d in loss_decisions)
    assert low_node_count(result) >= 3  # the three linears


class BNNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.bn = nn.Linear(8, 8), nn.BatchNorm1d(8)

    def forward(self, x, y):
        logits = self.bn(self.fc(x))
        return logits, F.cross_entropy(logits, y)


@pytest.mark.parametrize("source", ["module", "exported_program", "decompose"])
def test_the_callers_state_is_never_shared(source):
    """torch.export's ``ep.module()`` shares its tensors with the program, and an exported module's
    program shares them with the module: the rewritten module used to hold the caller's own
    parameters and buffers, so a training step on it moved the caller's weights and a train-mode
    call moved the caller's BatchNorm statistics (symbolic_trace and GraphModules were copied)."""
    torch.manual_seed(0)
    model = BNNet().train()
    x, y = torch.randn(4, 8), torch.randint(0, 8, (4,))
    program = torch.export.export(model, (x, y)) if source == "exported_program" else None
    obj = program if program is not None else model
    options = {} if program is not None else {"example_inputs": (x, y), "decompose": source == "decompose"}
    before = {k: v.clone() for k, v in model.state_dict().items()}
    held = {k: v.clone() for k, v in program.state_dict.items()} if program is not None else {}
    gm = _dispatch(obj, target="bf16", training=True, **options).model
    theirs = {t.data_ptr() for t in [*model.parameters(), *model.buffers()]}
    if program is not None:
        theirs |= {t.data_ptr() for t in program.state_dict.values()}
    assert not theirs & {t.data_ptr() for t in [*gm.parameters(), *gm.buffers()]}
    _, loss = gm(x, y)  # train mode: BatchNorm updates its running statistics
    assert not torch.equal(gm.get_buffer("bn.running_mean"), before["bn.running_mean"])
    if source != "decompose":  # (torch's own decomposed train-mode BatchNorm graph cannot backprop:
        optimiser = torch.optim.SGD(gm.parameters(), lr=0.5)  # its copy_ to running stats bumps a saved tensor)
        loss.backward()
        optimiser.step()
        assert not torch.equal(gm.get_parameter("fc.weight"), before["fc.weight"])
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), f"the caller's {k} changed"
    for k, v in held.items():
        assert torch.equal(program.state_dict[k], v), f"the program's {k} changed"


@pytest.mark.parametrize("capture", ["export", "symbolic_trace"])
def test_training_batchnorm_statistics(capture):
    """Rewriting runs nothing that touches the running statistics (symbolic_trace's dtype run restores
    them); a training step then updates them in FP32, close to what the FP32 model computes."""
    model, inputs = make("cnn")
    model.train()
    result = _dispatch(model, example_inputs=inputs, target="bf16", training=True, capture=capture)
    gm = result.model
    for name, buffer in model.named_buffers():
        assert torch.equal(gm.get_buffer(name), buffer), name
    gm(*inputs)
    model(*inputs)
    for name, buffer in model.named_buffers():
        ours = gm.get_buffer(name)
        assert ours.dtype == buffer.dtype
        if buffer.is_floating_point():
            assert float((ours - buffer).abs().max()) < 3e-2 * max(float(buffer.abs().max()), 1.0), name


def test_training_loss_tail_after_last_allow_op_stays_fp32():
    class Manual(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x, t):
            d = self.fc(x) - t
            return (d * d).mean()  # sub, mul, mean: infer/deny ops after the last allow op

    model, x, t = Manual().train(), torch.randn(4, 8), torch.randn(4, 8)
    result = _dispatch(model, example_inputs=(x, t), target="bf16", training=True)
    tail = {d.op: d for d in result.log.decisions.values() if d.op in ("sub", "mul", "mean")}
    assert set(tail) == {"sub", "mul", "mean"}
    assert all(d.precision == Precision.FP32 for d in tail.values()), tail
    assert "training" in tail["mul"].reason
    loss = result.model(x, t)
    loss.backward()
    assert result.model.get_parameter("fc.weight").grad.dtype == torch.float32


def test_training_casts_weights_read_mid_graph():
    """symbolic_trace puts a get_attr where the weight is first read, after other nodes: its cast
    must follow it."""
    model, x = Spellings().train(), torch.randn(2, 8)
    result = _dispatch(model, example_inputs=(x,), target="bf16", training=True, capture="symbolic_trace")
    result.model.graph.lint()
    assert result.model.w.dtype == torch.float32
    out = result.model(x)
    out.sum().backward()
    assert result.model.w.grad.dtype == torch.float32
    assert rel_err(out, model(x)) < TOL["bf16"]


def test_training_loss_output_named():
    model = WithLoss().train()
    x, y = torch.randn(4, 16), torch.randint(0, 8, (4,))
    with pytest.raises(UsageError):
        _dispatch(model, example_inputs=(x, y), training=True, loss_output="nope")
    gm = _dispatch(model, example_inputs=(x, y), training=True, loss_output=1).model
    assert any(n.op == "get_attr" and n.target == "amp_loss_scale" for n in gm.graph.nodes)


# -- conversions, in-place ops, custom ops, options ------------------------------------------------------------------------
class Conversions(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc1(x).float()  # an FP32 conversion that only feeds a low op
        h = self.fc2(h.to(torch.float32))
        return h.type_as(x) + torch.zeros(2, 8)  # a factory with the default dtype


@pytest.mark.parametrize("capture", ["export", "symbolic_trace"])
def test_existing_conversions_and_factories(capture):
    model, x = Conversions().eval(), torch.randn(2, 8)
    result = _dispatch(model, example_inputs=(x,), target="bf16", capture=capture)
    gm = result.model
    gm.graph.lint()
    with torch.no_grad():
        assert rel_err(gm(x), model(x)) < TOL["bf16"]
    assert_dtypes_consistent(gm, (x,))
    assert not result.log.unlisted_ops
    assert not _dispatch(gm, example_inputs=(x,), target="bf16").modified


@pytest.mark.parametrize("target", ["bf16", "fp16"])
def test_existing_conversions_after_decompositions(target):
    """run_decompositions() keeps ``x.float()`` as ``_assert_tensor_metadata(x, None, None,
    torch.float32)``, the dtype passed by position. The check must follow the type the rewrite gives
    x; it only followed a keyword dtype, so the module failed at run time with "Tensor dtype
    mismatch! Expected: Float, Got: c10::Half"."""
    model, x = Conversions().eval(), torch.randn(2, 8)
    ep = torch.export.export(model, (x,)).run_decompositions()
    asserts = [n for n in ep.graph_module.graph.nodes if "assert_tensor_metadata" in str(n.target)]
    assert any(len(n.args) > 3 and n.args[3] == torch.float32 for n in asserts)  # the positional form
    for obj, options in ((ep, {}), (model, {"example_inputs": (x,), "decompose": True})):
        result = _dispatch(obj, target=target, **options)
        gm = result.model
        gm.graph.lint()
        with torch.no_grad():
            out = gm(x)
        assert out.dtype == torch.float32 and rel_err(out, model(x)) < TOL[target]
        assert_dtypes_consistent(gm, (x,))
        assert sum(d.precision == Precision.LOW for d in result.log.decisions.values()) >= 2


class Promotes(nn.Module):
    """Ops whose float inputs and outputs differ in type: torch's type promotion decides each one's
    result (and an autocast region's output is BF16 whatever goes in)."""

    def __init__(self, region: bool = True) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 8)
        self.register_buffer("scale64", torch.linspace(0.5, 1.5, 8, dtype=torch.float64))
        self.region = region

    def forward(self, x, half):
        h = self.fc1(x)
        a = (h * self.scale64).float()  # fp32 * fp64 -> fp64
        b = h + half  # fp32 + fp16 -> fp32
        c = h.softmax(-1, dtype=torch.float64).float()  # fp32 in, fp64 out
        if not self.region:
            return a + b + c + self.fc2(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            d = self.fc2(x)  # export: one higher-order op, fp32 in, bf16 out
        return a + b + c + d.float()


@pytest.mark.parametrize("capture", ["export", "symbolic_trace"])
@pytest.mark.parametrize("target", ["bf16", "fp16"])
def test_ops_that_mix_float_types_keep_them(capture, target):
    """Such an op has no one type variable, so the rewrite used to fail its own IR verification
    ("type group T of mul is bound to different types (fp32, fp64)"). It now keeps the types it was
    written with (lowering its FP32 tensors could change what the promotion gives: FP16 with BF16
    promotes to FP32), says why, and the heavy op before it still runs low."""
    torch.manual_seed(0)
    inputs = (torch.randn(2, 8), torch.randn(8).half())
    if capture == "symbolic_trace":  # (it drops an autocast region: refused, test_symbolic_trace_refuses_...)
        with pytest.raises(UnsupportedModelError, match="has a torch.autocast region"):
            _dispatch(Promotes().eval(), example_inputs=inputs, target=target, capture=capture)
    model = Promotes(region=capture == "export").eval()
    result = _dispatch(model, example_inputs=inputs, target=target, capture=capture)
    gm = result.model
    gm.graph.lint()
    with torch.no_grad():
        ref, out = model(*inputs), gm(*inputs)
    assert out.dtype == ref.dtype == torch.float32
    assert rel_err(out, ref) < TOL[target]
    assert_dtypes_consistent(gm, inputs)
    kept = {k: d for k, d in result.log.decisions.items() if "type promotion" in d.reason}
    assert len(kept) >= 3 and all(d.precision == Precision.FP32 for d in kept.values()), kept
    fc1 = [d for k, d in result.log.decisions.items() if k.startswith("fc1/")]
    assert len(fc1) == 1 and fc1[0].precision == Precision.LOW
    again = _dispatch(gm, example_inputs=inputs, target=target)
    assert not again.modified and again.model.code == gm.code


def test_inplace_ops_read_later_are_rewired_or_kept_whole():
    """``r = h.relu_(); ... h ...``: later readers of h read r (the same tensor), so a cast can feed
    relu and it becomes out of place. With a view of h alive, that is unsound: an export capture
    falls back to its functionalized graph; symbolic_trace, which has none, keeps h, its view and
    relu_ in their types (it refused before), so the view sees the write."""

    class ReadAfterMutation(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            h = self.fc(x)
            r = h.relu_()
            return r + h.exp()  # reads h after relu_ mutated it

    class ViewAlive(ReadAfterMutation):
        def forward(self, x):
            h = self.fc(x)
            v = h.view(-1)
            h.relu_()
            return v.exp().sum() + h  # v sees the mutation

    x = torch.randn(2, 4)
    for capture in ("symbolic_trace", "export"):
        model = ReadAfterMutation().eval()
        gm = _dispatch(model, example_inputs=(x,), target="bf16", capture=capture).model
        with torch.no_grad():
            assert rel_err(gm(x), model(x)) < TOL["bf16"]
    model = ViewAlive().eval()
    result = _dispatch(model, example_inputs=(x,), target="bf16", capture="symbolic_trace")
    with torch.no_grad():
        assert rel_err(result.model(x), model(x)) < TOL["bf16"]
    assert "shares storage with 'fc'" in result.log.decisions["fc/fc"].reason
    gm = _dispatch(model, example_inputs=(x,), target="bf16", capture="export").model  # functionalized: fine
    with torch.no_grad():
        assert rel_err(gm(x), model(x)) < TOL["bf16"]


class _Parametrized(nn.Module):
    def __init__(self):
        super().__init__()
        from torch.nn.utils import parametrizations

        self.a = parametrizations.weight_norm(nn.Linear(8, 8))
        self.c = parametrizations.weight_norm(nn.Conv1d(8, 8, 3, padding=1))
        self.o = parametrizations.orthogonal(nn.Linear(8, 8))
        self.s = parametrizations.spectral_norm(nn.Linear(8, 8))
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        h = self.c(self.a(x).transpose(1, 2)).transpose(1, 2)
        return self.b(self.s(self.o(torch.relu(h))))


@pytest.mark.parametrize("target", ["bf16", "fp16"])
def test_symbolic_trace_runs_the_gemm_of_a_parametrized_layer_low(target):
    """weight_norm / spectral_norm / orthogonal make a class at run time (ParametrizedLinear), a
    torch.nn module that symbolic_trace kept whole: the rewrite called it an unlisted op, kept the
    layer's GEMM FP32 and told the user to classify it in a rule file, which refused the name as an
    unknown torch op. symbolic_trace now traces into such a module: its linear/conv runs low, the
    weight its parametrization computes from the FP32 originals stays FP32 (a norm over the weight),
    and training gradients reach the originals."""
    torch.manual_seed(0)
    model, x = _Parametrized().eval(), torch.randn(2, 5, 8)
    result = _dispatch(copy.deepcopy(model), example_inputs=(x,), target=target, capture="symbolic_trace")
    result.model.graph.lint()
    with torch.no_grad():
        assert rel_err(result.model(x), model(x)) < TOL[target]
    assert result.report.heavy_ops["total"] == result.report.heavy_ops["low"] == 5
    assert not result.log.unlisted_ops
    weights = [d for d in result.log.decisions.values() if d.op == "parametrization"]
    assert len(weights) == 4 and all(d.precision == Precision.FP32 for d in weights)

    class Loss(nn.Module):
        def __init__(self, net):
            super().__init__()
            self.net = net

        def forward(self, x, y):
            return F.mse_loss(self.net(x), y)

    torch.manual_seed(1)
    trained, reference = Loss(_Parametrized().train()), Loss(_Parametrized().train())
    reference.load_state_dict(trained.state_dict())
    y = torch.randn(2, 5, 8)
    gm = amp_rewrite.rewrite(trained, example_inputs=(x, y), target="bf16", capture="symbolic_trace", training=True)
    gm(x, y).backward()
    reference(x, y).backward()
    got = dict(gm.named_parameters())
    for name, p in reference.named_parameters():
        assert got[name].dtype == torch.float32 and rel_err(got[name].grad, p.grad) < 5e-2, name


def test_a_buffer_written_by_setitem_under_symbolic_trace_keeps_its_type_and_values():
    """symbolic_trace writes ``self.cache[1:3] = x`` as a ``__setitem__`` method call, which the
    loader took for a node that reads values and writes nothing: the buffer was not known to
    change, so it was converted offline like a weight. The cache then held FP16 roundings of what
    was written (1.0001 became 1.0; past 65504, inf), and the module's state_dict an FP16 buffer.
    A setitem is an in-place write now: the buffer stays FP32 and exact, its low reader casts it
    at the read, after the write."""

    class Cache(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)
            self.register_buffer("cache", torch.zeros(4, 8))

        def forward(self, x):
            self.cache[1:3] = x[1:3]
            return self.fc(self.cache) + self.fc(x)

    torch.manual_seed(0)
    model, reference = Cache().eval(), Cache().eval()
    reference.load_state_dict(model.state_dict())
    x = torch.randn(4, 8)
    gm = _dispatch(model, example_inputs=(x,), target="fp16", capture="symbolic_trace").model
    gm.graph.lint()
    assert gm.cache.dtype == torch.float32
    for _ in range(2):
        x = torch.randn(4, 8)
        with torch.no_grad():
            assert rel_err(gm(x.clone()), reference(x.clone())) < TOL["fp16"]
        assert torch.equal(gm.cache, reference.cache)


def test_a_tensor_written_through_a_view_and_returned_low_is_cast_after_the_write():
    """keep_io_types=False: a graph output written through a view (``h.view(-1).mul_(2)``) is cast
    to the low type for the caller. That Cast went right after h was made, before the write, so
    the caller got h without it (error ~0.5 of max |h|); it goes at the output now."""

    class Returned(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            h = x.exp()
            h.view(-1).mul_(2.0)
            return self.fc(x), h

    torch.manual_seed(0)
    model, x = Returned().eval(), torch.randn(4, 8)
    gm = _dispatch(model, example_inputs=(x,), target="bf16", capture="symbolic_trace", keep_io_types=False).model
    gm.graph.lint()
    with torch.no_grad():
        out, h = gm(x.to(torch.bfloat16))
        _, want = model(x.to(torch.bfloat16).float())
    assert h.dtype == torch.bfloat16 and rel_err(h, want) < TOL["bf16"]


@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
def test_an_in_place_write_through_a_view_of_a_view_is_kept(training):
    """``out[0, 0].copy_(src)`` is a copy into select(select(out)). The aliasing check looked one
    view level up only, so out's later reader went unseen: the copy was emitted out of place into
    a cast copy, and the write never reached ``out`` (error ~1)."""

    class NestedViewWrite(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.o = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x, src):
            out = self.q(x).clone()
            out[0, 0].copy_(src)
            return self.o(out)

    torch.manual_seed(0)
    model, x, src = NestedViewWrite(), torch.randn(2, 4, 8), torch.randn(8) * 10
    gm = amp_rewrite.rewrite(model, example_inputs=(x, src), target="bf16", training=training)
    with torch.no_grad():
        assert rel_err(gm(x, src), model(x, src)) < TOL["bf16"]


def test_a_mutation_seen_through_a_sibling_or_nested_view_is_kept():
    """The aliasing check counted later readers of the target, of its direct views and of the
    tensors above it, not of a sibling view of the same base (a = h.view(12); b = h.view(3, 4);
    a.sin_(): b sees it) nor of a view of a view (v = h.unsqueeze(0).squeeze(0); h.cumsum_(0)).
    The deny op, fed a cast of the bf16 linear output, went out of place, and b and v read the
    old values (error 0.3-1.2). Export captures now fall back to the functionalized graph;
    symbolic_trace keeps h, its views and the write in their types."""

    class ViewOfView(nn.Module):
        def __init__(self):
            super().__init__()
            self.l, self.l2 = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            h = self.l(x)
            v = h.unsqueeze(0).squeeze(0)
            h.cumsum_(0)
            return self.l2(v)

    class SiblingViews(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(4, 4)

        def forward(self, x):
            h = self.l(x)
            a, b = h.view(12), h.view(3, 4)
            a.sin_()
            return b * 2

    torch.manual_seed(0)
    x = torch.randn(3, 4)
    for cls in (ViewOfView, SiblingViews):
        model = cls()
        gm = amp_rewrite.rewrite(copy.deepcopy(model), example_inputs=(x,), target="bf16", capture="export")
        with torch.no_grad():
            assert rel_err(gm(x), model(x)) < TOL["bf16"], cls.__name__
        traced = _dispatch(copy.deepcopy(model), example_inputs=(x,), target="bf16", capture="symbolic_trace").model
        with torch.no_grad():
            assert rel_err(traced(x), model(x)) < TOL["bf16"], cls.__name__


def test_an_in_place_buffer_update_under_no_grad_is_rewritten():
    """An EMA updated in place inside ``torch.no_grad()``: export writes the block as a
    higher-order op whose body is rewritten on its own, its placeholders the enclosing graph's
    values. The check that a model input's mutation reaches the caller took the buffer passed
    in for one, and raised InPlaceMutationError there, where no functionalized fallback exists."""

    class EMA(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(4, 4)
            self.register_buffer("ema", torch.zeros(4))

        def forward(self, x):
            h = self.l(x)
            with torch.no_grad():
                self.ema.mul_(0.5).add_(h.mean(0), alpha=0.5)
            return self.l(h) + self.ema

    torch.manual_seed(0)
    model, x = EMA(), torch.randn(3, 4)
    reference = copy.deepcopy(model)
    gm = amp_rewrite.rewrite(model, example_inputs=(x,), target="bf16")
    with torch.no_grad():
        for _ in range(2):  # (the second call reads the first's update)
            assert rel_err(gm(x), reference(x)) < TOL["bf16"]
    assert rel_err(dict(gm.named_buffers())["ema"], reference.ema) < TOL["bf16"]


def test_the_functionalized_copy_follows_its_neighbours():
    """``out[..., :8].copy_(src)`` falls back to the functionalized graph, where the write is
    aten.copy (src converted into a tensor of the slice's shape). No torch rule named copy: it was
    "unlisted, kept FP32", an FP32 island between two bf16 ops with its own pair of casts, and the
    summary asked the user to classify it."""

    class SliceWrite(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.o = nn.Linear(16, 16), nn.Linear(16, 16)

        def forward(self, x, src):
            out = self.q(x).clone()
            out[..., :8].copy_(src)
            return self.o(out)

    torch.manual_seed(0)
    model, x, src = SliceWrite(), torch.randn(2, 4, 16), torch.randn(8)
    gm, report = amp_rewrite.rewrite(model, example_inputs=(x, src), target="bf16", report=True)
    copies = [n for n in report.to_dict()["nodes"] if n["op"] == "copy"]
    assert copies and all((n["precision"], n["category"]) == ("bf16", "clear") for n in copies)
    assert "copy" not in report.summary()["unlisted_ops"]
    assert report.summary()["islands"] == 0
    with torch.no_grad():
        assert rel_err(gm(x, src), model(x, src)) < TOL["bf16"]


@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
def test_an_in_place_write_to_a_model_input_reaches_the_caller(training):
    """``x.add_(y)`` on an argument: the caller's tensor must change. The aliasing check looked for
    later readers inside the graph only; painted low, add_ was emitted out of place into a cast
    copy, so the caller's ``x`` kept its old values and the next call read them (error ~0.4).
    Export captures now fall back to the functionalized graph, which writes the input back;
    symbolic_trace, which has none, refuses with advice, also where nothing in the graph reads
    the input again."""

    class MutatesItsInput(nn.Module):
        def __init__(self):
            super().__init__()
            self.q = nn.Linear(8, 8)

        def forward(self, x, y):
            x.add_(self.q(y))
            return self.q(x)

    torch.manual_seed(0)
    model = MutatesItsInput()
    x, y = torch.randn(2, 8), torch.randn(2, 8)
    gm = amp_rewrite.rewrite(model, example_inputs=(x.clone(), y), target="bf16", training=training)
    ours, theirs = x.clone(), x.clone()
    with torch.no_grad():
        for _ in range(2):  # (the second call reads what the first wrote)
            assert rel_err(gm(ours, y), model(theirs, y)) < TOL["bf16"]
    assert rel_err(ours, theirs) < TOL["bf16"]
    if not training:

        class OnlyTheCallerSees(MutatesItsInput):
            def forward(self, x, y):
                x.add_(self.q(y))
                return self.q(y)

        with pytest.raises(UnsupportedModelError, match="'x' is an input of the model, whose caller sees"):
            _dispatch(OnlyTheCallerSees(), example_inputs=(x.clone(), y), target="bf16", capture="symbolic_trace")


class _AliasedBuffers(nn.Module):
    """A buffer registered as a view of another (a cache handing out per-layer slices): the forward
    writes through one name and reads through the other."""

    def __init__(self, write_view: bool):
        super().__init__()
        self.l = nn.Linear(4, 4)
        kv = torch.zeros(2, 3, 4)
        self.register_buffer("kv", kv)
        self.register_buffer("k", kv[0])  # shares kv's storage
        self.write_view = write_view

    def forward(self, x):
        if self.write_view:
            self.k.copy_(self.l(x))
            return self.l(self.kv[0])
        self.kv[0].copy_(self.l(x))
        return self.l(self.k)


@pytest.mark.parametrize("capture", ["export", "symbolic_trace"])
@pytest.mark.parametrize("write_view", [False, True], ids=["write-base-read-view", "write-view-read-base"])
def test_a_write_through_one_buffer_is_read_through_its_alias(capture, write_view):
    """Only the written attribute was taken for mutable: its alias, read by a low linear, was
    converted once at rewrite time (no longer a view), so the read was stale on every call (error
    ~0.9); made mutable, its cast still sat at the top of the graph, before the write. Both names
    stay FP32 views of one storage now, and the cast sits at the use."""
    torch.manual_seed(0)
    model = _AliasedBuffers(write_view)
    ref = copy.deepcopy(model)
    gm = amp_rewrite.rewrite(model, example_inputs=(torch.randn(3, 4),), target="bf16", capture=capture)
    with torch.no_grad():
        for _ in range(2):
            x = torch.randn(3, 4)
            assert rel_err(gm(x), ref(x)) < TOL["bf16"]
    # (symbolic_trace holds kv[0] as a tensor constant: a view all the same; the name its graph does
    # not read stays registered, so the original's checkpoint loads)
    buffers = [b for _, b in gm.named_buffers(remove_duplicate=False)]
    assert len(buffers) == (2 if capture == "export" else 3) and {b.dtype for b in buffers} == {torch.float32}
    assert list(gm.state_dict()) == list(model.state_dict())
    assert len({b.untyped_storage().data_ptr() for b in buffers}) == 1


class _Counts(nn.Module):
    """A step counter and a decay that read no input, beside an update that does."""

    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 4)
        self.register_buffer("ema", torch.ones(4))
        self.register_buffer("step", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        h = self.l(x)
        self.step.add_(1)
        self.ema.mul_(0.5)
        self.ema.add_(h.mean(0))
        return self.l(h) + self.ema


def test_updates_symbolic_trace_cannot_record_are_refused_and_export_records_them():
    """symbolic_trace ran ``self.step.add_(1)`` and ``self.ema.mul_(0.5)`` (no traced value in them)
    once while tracing and left them out of the graph: the rewrite started one step ahead and never
    made them again (error 0.2-0.6 from the second call on). symbolic_trace now says so; export
    records them and the rewrite follows the FP32 module call after call."""
    x = torch.randn(3, 4)
    model = _Counts()
    with pytest.raises(UnsupportedModelError, match=r"_Counts.forward changes 'ema', 'step' in a way "
                                                    r"torch.fx.symbolic_trace does not record"):
        _dispatch(copy.deepcopy(model), example_inputs=(x,), target="bf16", capture="symbolic_trace")
    assert model.step.item() == 0 and torch.equal(model.ema, torch.ones(4))  # (the caller's module untouched)
    ref = copy.deepcopy(model)
    gm = amp_rewrite.rewrite(model, example_inputs=(x,), target="bf16")
    with torch.no_grad():
        for _ in range(3):
            assert rel_err(gm(x), ref(x)) < TOL["bf16"]
    assert rel_err(gm.ema, ref.ema) < TOL["bf16"] and gm.step.item() == ref.step.item() == 3


@torch.library.custom_op("amp_rewrite_test::twice", mutates_args=())
def _twice(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@_twice.register_fake
def _(x):
    return torch.empty_like(x)


def test_unlisted_op_stays_fp32_and_is_reported():
    class Custom(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            return self.fc2(torch.ops.amp_rewrite_test.twice(self.fc1(x)))

    model, x = Custom().eval(), torch.randn(2, 4)
    result = _dispatch(model, example_inputs=(x,), target="bf16")
    assert result.log.unlisted_ops == {"amp_rewrite_test::twice": 1}
    twice = next(n for n in result.model.graph.nodes if "twice" in str(n.target))
    assert twice.args[0].meta["val"].dtype == torch.float32
    with torch.no_grad():
        assert rel_err(result.model(x), model(x)) < TOL["bf16"]


def test_graph_module_without_metadata_needs_example_inputs():
    gm = fx.symbolic_trace(MLP())
    with pytest.raises(UsageError, match="example_inputs"):
        _dispatch(gm, target="bf16")
    assert _dispatch(gm, example_inputs=(torch.randn(2, 16),), target="bf16").modified


def test_example_inputs_of_the_wrong_dtype_are_refused_not_captured():
    """torch.export's fake tensors accept a float32 Linear on int64 / float64 / float16 examples: the
    graph input kept the example's type, no cast went in front of the now-FP16 weights, and the
    rewritten module failed on real inputs ('mat1 and mat2 must have the same dtype')."""
    x = torch.randn(2, 16)
    for example in (torch.randint(0, 3, (2, 16)), x.double(), x.half()):
        with pytest.raises(UsageError, match=r"reads tensors of different types .*example inputs of the wrong dtype"):
            _dispatch(MLP(), example_inputs=(example,), target="bf16")
    assert _dispatch(MLP(), example_inputs=(x,), target="bf16").modified


def test_capture_options_on_an_already_captured_graph_are_refused():
    """capture=/decompose= say how to capture an nn.Module: given a GraphModule, capture='export'
    and decompose=True (and symbolic_trace for an ExportedProgram) would be ignored silently, so
    they are usage errors (capture='symbolic_trace' describes a GraphModule as it is)."""
    x = torch.randn(2, 16)
    gm = fx.symbolic_trace(MLP())
    for options, named in (({"capture": "export"}, "capture='export'"), ({"decompose": True}, "decompose=True")):
        with pytest.raises(UsageError, match=f"{re.escape(named)} applies to capturing an nn.Module"):
            _dispatch(gm, example_inputs=(x,), target="bf16", **options)
    ep = torch.export.export(MLP(), (x,))
    with pytest.raises(UsageError, match="ExportedProgram is already captured"):
        _dispatch(ep, capture="symbolic_trace", target="bf16")
    assert _dispatch(ep, capture="export", decompose=True, target="bf16").modified



def test_keep_io_types_off_takes_and_returns_low():
    model, inputs = make("mlp")
    gm = _dispatch(model, example_inputs=inputs, target="bf16", keep_io_types=False).model
    out = gm(inputs[0].bfloat16())
    assert out.dtype == torch.bfloat16
    assert rel_err(out, model(*inputs)) < TOL["bf16"]


def test_node_rules_match_module_paths():
    model, inputs = make("mlp")
    result = _dispatch(model, example_inputs=inputs, target="bf16", fp32_nodes=["fc2/*"])
    by_op = {label: d for label, d in result.log.decisions.items() if d.op == "linear"}
    assert by_op["fc2/linear_1"].precision == Precision.FP32
    assert by_op["fc1/linear"].precision == Precision.LOW


def test_unknown_option_and_bad_input():
    with pytest.raises(UsageError):
        _dispatch(MLP(), example_inputs=(torch.randn(1, 16),), colour="red")
    with pytest.raises(UsageError):
        _dispatch(MLP(), example_inputs=(torch.randn(1, 16),), capture="jit")


def test_tuple_getitem_is_not_an_op():
    gm = fx.symbolic_trace(LSTMLM())
    ir = load_fx(gm, example_inputs=(torch.randint(0, 50, (2, 8)),))
    assert "getitem" not in {n.op_type for n in ir.graph.nodes}
    lstm = next(n for n in ir.graph.nodes if n.op_type == "lstm")
    assert len(lstm.outputs) == 3  # output, (h, c) flattened
    assert any(n.target is operator.getitem for n in gm.graph.nodes)


class TupleOut(nn.Module):
    """Tuple-valued nodes used whole: returned as they are (nn.MultiheadAttention's (out, weights),
    a split) and passed whole to torch.cat."""

    def __init__(self) -> None:
        super().__init__()
        self.mha, self.fc = nn.MultiheadAttention(16, 2, batch_first=True), nn.Linear(16, 16)

    def forward(self, x):
        parts = self.fc(x).split(8, -1)
        return self.mha(x, x, x), parts, torch.cat(parts, -1).softmax(-1)


def test_tuple_valued_nodes_used_whole_after_symbolic_trace():
    """The elements get casts back to FP32, so the tuple is rebuilt from its elements. Under
    symbolic_trace each element's metadata is a TensorMetadata NamedTuple, which the rebuild used
    to walk into as if it were a tuple too: the output indexed the element's 7 fields
    (``getitem_1[6]``) and failed at run time with "index 6 is out of bounds"."""
    torch.manual_seed(0)
    model, x = TupleOut().eval(), torch.randn(2, 4, 16)
    for source in (model, fx.symbolic_trace(model)):
        result = _dispatch(source, example_inputs=(x,), target="bf16", capture="symbolic_trace")
        gm = result.model
        gm.graph.lint()
        with torch.no_grad():
            out, ref = gm(x), model(x)
        flat_out, flat_ref = torch.utils._pytree.tree_leaves(out), torch.utils._pytree.tree_leaves(ref)
        assert len(flat_out) == len(flat_ref) == 5
        for a, b in zip(flat_out, flat_ref):
            assert a.dtype == b.dtype == torch.float32 and a.shape == b.shape
            assert rel_err(a, b) < TOL["bf16"]
        assert_dtypes_consistent(gm, (x,))


class Optional(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x, bias=0.0, scale=1.0):
        return self.fc2(self.fc1(x) + bias) * scale


@pytest.mark.parametrize("traced", [False, True])
def test_example_kwargs_bind_by_name_past_a_skipped_default(traced):
    """``example_kwargs={"scale": s}`` skips ``bias``. The metadata run (ShapeProp, positional
    only) used to get s in bias's place: the rewrite cast bias as an FP32 tensor, and the module,
    called as gm(x, scale=s) with bias at its default 0.0, failed ('float' object has no attribute
    'to'). A keyword naming no parameter, or one that leaves a parameter without a default
    unfilled, is a clear UsageError."""
    torch.manual_seed(0)
    model, x, s = Optional().eval(), torch.randn(2, 8), torch.linspace(1, 2, 8)
    source = fx.symbolic_trace(model) if traced else model
    gm = _dispatch(source, example_inputs=(x,), example_kwargs={"scale": s}, target="bf16",
                   capture="symbolic_trace").model
    gm.graph.lint()
    with torch.no_grad():
        assert rel_err(gm(x, scale=s), model(x, scale=s)) < TOL["bf16"]
        assert rel_err(gm(x, 0.5, s), model(x, 0.5, s)) < TOL["bf16"]
    assert "bias.to(" not in gm.code
    with pytest.raises(UsageError, match="'shift'.*parameters: x, bias, scale"):
        _dispatch(source, example_inputs=(x,), example_kwargs={"shift": s}, capture="symbolic_trace")


def test_example_kwargs_cannot_skip_a_parameter_without_default():
    class Two(nn.Module):
        def forward(self, x, y, z=None):
            return x + y

    x = torch.randn(2)
    with pytest.raises(UsageError, match="but not 'y'"):
        _dispatch(fx.symbolic_trace(Two()), example_inputs=(), example_kwargs={"x": x, "z": x})


@pytest.mark.parametrize("case", ["kwargs as a list", "no inputs", "one input too many"])
def test_example_inputs_that_do_not_fit_the_module_are_said_before_capturing(case):
    """A list for example_kwargs failed with "'list' object has no attribute 'items'"; an nn.Module
    given no inputs was told "this GraphModule carries no dtype metadata"; an extra positional input,
    which torch.export refused, was dropped by the symbolic_trace fallback with a note only (eager
    raises TypeError)."""
    model, x = Optional().eval(), torch.randn(2, 8)
    arguments, expected = {
        "kwargs as a list": ({"example_inputs": (x,), "example_kwargs": [x]}, r"example_kwargs is a list: pass a dict"),
        "no inputs": ({}, r"the nn.Module Optional needs example inputs: pass example_inputs="),
        "one input too many": ({"example_inputs": (x, x, x, x)},
                               r"example_inputs holds 4 inputs, which do not fit Optional.forward\(x, bias=0.0, "
                               r"scale=1.0\): too many positional arguments"),
    }[case]
    with pytest.raises(UsageError, match=expected):
        amp_rewrite.rewrite(model, **arguments)
    assert amp_rewrite.rewrite(model, example_inputs=(x, x, x)) is not None  # (three fit)


class VarKw(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, shift=0.0, **kw):
        return (self.fc(x) + shift) * kw["scale"] + kw["bias"]


def test_example_kwargs_fill_a_var_keyword_parameter():
    """``forward(self, x, **kw)`` under symbolic_trace (placeholder '**kw'): example_kwargs were
    matched by parameter name only and refused ("names 'bias', 'scale', which is not a parameter")
    although the module takes them through **kw; they are its dict in the metadata run now."""
    torch.manual_seed(0)
    model, x, b, s = VarKw().eval(), torch.randn(3, 8), torch.randn(3, 8), torch.tensor(2.0)
    gm = amp_rewrite.rewrite(model, example_inputs=(x,), example_kwargs={"scale": s, "bias": b}, target="bf16",
                             capture="symbolic_trace")
    with torch.no_grad():
        assert rel_err(gm(x, scale=s, bias=b), model(x, scale=s, bias=b)) < TOL["bf16"]
    with pytest.raises(UsageError, match=r"names 'x', which is not a parameter after the 1 example_inputs "
                                         r"\(parameters: x, shift, \*\*kw\)"):
        amp_rewrite.rewrite(model, example_inputs=(x,), example_kwargs={"x": x, "scale": s, "bias": b},
                            capture="symbolic_trace")
    with pytest.raises(UsageError, match=r"names 'bias', 'scale', which are not parameters after"):
        amp_rewrite.rewrite(Optional().eval(), example_inputs=(x, 0.0, 1.0), example_kwargs={"scale": s, "bias": b},
                            capture="symbolic_trace")


class Expanded(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.register_buffer("shift", torch.ones(1).expand(8))  # stride 0: no element can be written

    def forward(self, x):
        return self.fc(x) + self.shift + torch.tensor([3.0]).expand(8)


def test_an_expanded_buffer_survives_the_metadata_run():
    """The metadata run restores every buffer afterwards (a train-mode BatchNorm would move its
    statistics); writing an expanded buffer back raised torch's "more than one element of the
    written-to tensor refers to a single memory location". Only what the run changed is restored."""
    model, x = Expanded().eval(), torch.randn(2, 8)
    gm = _dispatch(model, example_inputs=(x,), target="bf16", capture="symbolic_trace").model
    gm.graph.lint()
    with torch.no_grad():
        assert rel_err(gm(x), model(x)) < TOL["bf16"]


@pytest.mark.parametrize("target", ["bf16", "fp16"])
def test_a_module_on_the_meta_device(target):
    """A model's skeleton on the meta device (no data) is rewritten as its real twin is: same
    graph, weights converted in type only (there is nothing to clamp or count); the conversion
    used to read the weights' values and fail ("Tensor.item() cannot be called on meta tensors")."""
    torch.manual_seed(0)
    real, x = MLP().eval(), torch.randn(2, 16)
    meta = copy.deepcopy(real).to("meta")
    on_meta = _dispatch(meta, example_inputs=(x.to("meta"),), target=target)
    on_cpu = _dispatch(real, example_inputs=(x,), target=target)
    on_meta.model.graph.lint()
    assert on_meta.model.code == on_cpu.model.code
    assert {k: (p.dtype, p.device.type) for k, p in on_meta.model.named_parameters()} == \
        {k: (p.dtype, "meta") for k, p in on_cpu.model.named_parameters()}
    out = on_meta.model(x.to("meta"))
    assert out.device.type == "meta" and out.dtype == torch.float32 and out.shape == (2, 8)


def test_a_no_op_upcast_is_no_wall_between_low_ops():
    """GPT-J/CodeGen upcast the rotated query and key with ``.to(torch.float32)`` before QK^T, a
    no-op in the FP32 model. Painting took the Cast for a wall: the rotary Muls stayed FP32 "not
    between fp16 ops" with Casts around them (4 Casts where the same model without the upcast has
    2), and the Cast was then removed as a no-op anyway."""

    class Rotary(nn.Module):
        def __init__(self, upcast: bool):
            super().__init__()
            self.q, self.k = nn.Linear(8, 8), nn.Linear(8, 8)
            self.register_buffer("table", torch.randn(4, 8))
            self.upcast = upcast

        def forward(self, x):
            q, k = self.q(x) * self.table, self.k(x) * self.table
            if self.upcast:
                q, k = q.to(torch.float32), k.to(torch.float32)
            return q @ k.transpose(-1, -2)

    x = torch.randn(2, 4, 8)
    counts = {}
    for upcast in (False, True):
        model = Rotary(upcast).eval()
        low, report = amp_rewrite.rewrite(model, example_inputs=(x,), target="bf16", report=True)
        muls = [n["precision"] for n in report.to_dict()["nodes"] if n["op"] == "mul"]
        assert muls == ["bf16", "bf16"], (upcast, muls)
        counts[upcast] = report.casts_inserted
        with torch.no_grad():
            assert rel_err(low(x), model(x)) < TOL["bf16"]
    assert counts[True] == counts[False]


def test_torch_conversions_are_classified_by_the_name_the_model_called():
    """A torch conversion is the IR's Cast, but the torch rule files name what the model called
    (``to``, ``float``, ``type_as``). Looked up as "Cast", each one's entry said "no rule names Cast:
    kept FP32; classify it in a rule file", which no torch rule file could do, and the summary
    listed it among the unlisted ops."""

    class Converts(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            h = self.fc(x).to(torch.float32) * 2.0
            return h.float().softmax(-1).type_as(x)

    class ConvertsByType(nn.Module):  # (.type(dtype), which no rule file names: clear all the same)
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            h = self.fc(x)
            return self.fc(h.type(torch.float32) * 2.0 + h.type(torch.float64).sum(-1, keepdim=True).type(torch.float32))

    for module, capture in ((Converts(), "auto"), (ConvertsByType(), "symbolic_trace")):
        _, report = amp_rewrite.rewrite(module.eval(), example_inputs=(torch.randn(2, 8),), target="bf16",
                                        report=True, capture=capture)
        d = report.to_dict()
        casts = [n for n in d["nodes"] if n["op"] in ("to", "float", "type_as", "type")]
        assert casts and all(n["category"] == "clear" and "no rule names" not in n["reason"] for n in casts), casts
        assert d["summary"]["unlisted_ops"] == {}


def test_a_copying_no_op_cast_stays_where_the_copy_is_mutated():
    """``_to_copy`` to the dtype a tensor already has copies it. The rewrite removes no-op casts,
    but not in a graph that mutates tensors in place: reading the source instead of the copy would
    let ``add_`` change the source too."""

    class CopyThenMutate(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            c = torch.relu(x)
            d = torch.ops.aten._to_copy(c, dtype=torch.float32)
            d.add_(1.0)
            return self.fc2(self.fc1(c)) + d

    model, x = CopyThenMutate().eval(), torch.randn(2, 4)
    result = _dispatch(model, example_inputs=(x,), target="bf16", capture="symbolic_trace")
    assert [c.kind for c in result.log.casts if c.kind == "removed"] == []
    with torch.no_grad():
        assert rel_err(result.model(x), model(x)) < TOL["bf16"]


# -- higher-order ops: torch.no_grad() blocks, torch.cond, while_loop, autocast regions -------------------------
class NoGradEncoder(nn.Module):
    """A frozen encoder run under torch.no_grad(): torch.export keeps the block as a
    wrap_with_set_grad_enabled op whose body is a GraphModule of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.enc, self.head = nn.Linear(16, 32), nn.Linear(32, 8)

    def forward(self, x):
        with torch.no_grad():
            h = torch.relu(self.enc(x))
        return self.head(h)


class Branches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        return torch.cond(x.sum() > 0, lambda x: self.a(x).softmax(-1), lambda x: self.b(x), (x,))


class FrozenRegion(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 8)

    def forward(self, x):
        with torch.autocast("cpu", enabled=False):
            h = self.a(x)
        return self.b(h)


def _attr(gm: nn.Module, target: str):
    for atom in target.split("."):
        gm = getattr(gm, atom)
    return gm


def _body_dtypes(gm: fx.GraphModule, body: str, op) -> list:
    """The dtypes the body's ``op`` nodes compute in, from a run of the body's recorded metadata."""
    return [n.meta["val"].dtype for n in getattr(gm, body).graph.nodes if n.op == "call_function" and n.target == op]


def test_a_no_grad_block_is_rewritten_as_a_scope_of_its_own() -> None:
    """The body of a torch.no_grad() block was left FP32 (its op listed as unlisted), so a frozen
    encoder's matmuls never ran low, and the summary counted only the head's."""
    torch.manual_seed(0)
    model, x = NoGradEncoder(), torch.randn(2, 16)
    gm, report = amp_rewrite.rewrite(model, example_inputs=(x,), target="bf16", report=True)
    gm.graph.lint()
    bodies = [n.target for n in gm.graph.nodes if n.op == "get_attr" and isinstance(_attr(gm, n.target), fx.GraphModule)]
    assert len(bodies) == 1
    body = getattr(gm, bodies[0])
    body.graph.lint()
    assert _body_dtypes(gm, bodies[0], torch.ops.aten.linear.default) == [torch.bfloat16]
    assert report.heavy_ops["low"] == report.heavy_ops["total"] == 2
    assert report.log.unlisted_ops == {}
    scoped = [c for c in report.log.casts if c.scope == bodies[0]]
    assert scoped and all(c.name.startswith(f"{bodies[0]}/") for c in scoped)
    wrap = [d for d in report.log.decisions.values() if d.op.endswith("wrap_with_set_grad_enabled")]
    assert len(wrap) == 1 and "rewritten as scopes of their own" in wrap[0].reason
    y, ref = gm(x), model(x)
    assert y.dtype == torch.float32 and y.requires_grad  # the head still trains; the block does not
    assert ((y - ref).abs().max() / ref.abs().max()).item() <= TOL["bf16"]
    again = amp_rewrite.rewrite(gm, example_inputs=(x,), target="bf16")
    assert again.code == gm.code and getattr(again, bodies[0]).code == body.code


def test_both_branches_of_torch_cond_are_rewritten() -> None:
    torch.manual_seed(0)
    model, x = Branches(), torch.randn(2, 16)
    gm, report = amp_rewrite.rewrite(model, example_inputs=(x,), target="bf16", report=True)
    for branch in ("true_graph_0", "false_graph_0"):
        getattr(gm, branch).graph.lint()
        assert _body_dtypes(gm, branch, torch.ops.aten.linear.default) == [torch.bfloat16]
    # the softmax stays FP32 in its branch, and the branch still returns the cond's FP32 type
    softmax = report.log.decisions["true_graph_0/softmax"]
    assert softmax.precision == Precision.FP32
    assert report.heavy_ops["low"] == report.heavy_ops["total"] == 2
    for sign in (1.0, -1.0):  # each branch taken once
        xs = sign * x.abs()
        y, ref = gm(xs), model(xs)
        assert y.dtype == torch.float32
        assert ((y - ref).abs().max() / ref.abs().max()).item() <= TOL["bf16"]


def test_a_node_pattern_naming_only_a_branch_node_is_not_called_unmatched() -> None:
    """Node patterns also apply inside the bodies; one that named only a branch's node pinned it
    but was reported as naming no node, since the main graph's check had not seen the bodies."""
    model, x = Branches(), torch.randn(2, 16)
    _, report = amp_rewrite.rewrite(model, example_inputs=(x,), target="bf16", report=True,
                                    fp32_nodes=["linear", "no_such_node"])
    assert report.log.decisions["true_graph_0/linear"].precision == Precision.FP32
    unmatched = [n for n in report.log.notes if n.startswith("unmatched:")]
    assert len(unmatched) == 1 and "'no_such_node'" in unmatched[0]


@pytest.mark.parametrize("pattern", ["true_graph_0/linear", "true_graph_0/*", "re:true_graph_0/lin.*"])
def test_a_node_pattern_may_name_a_branch_node_by_its_reported_name(pattern) -> None:
    """The report lists a body's nodes under the body's path (true_graph_0/linear), but patterns
    were matched against the body's local names only: the reported name pinned nothing and was
    said to name no node, and the local name 'linear' pinned the node in both branches."""
    torch.manual_seed(0)
    model, x = Branches(), torch.randn(2, 16)
    gm, report = amp_rewrite.rewrite(model, example_inputs=(x,), target="bf16", report=True, fp32_nodes=[pattern])
    assert report.log.decisions["true_graph_0/linear"].precision == Precision.FP32
    assert report.log.decisions["false_graph_0/linear"].precision == Precision.LOW
    assert _body_dtypes(gm, "true_graph_0", torch.ops.aten.linear.default) == [torch.float32]
    assert _body_dtypes(gm, "false_graph_0", torch.ops.aten.linear.default) == [torch.bfloat16]
    assert not [n for n in report.log.notes if n.startswith("unmatched:")]


def test_an_autocast_region_is_left_as_written() -> None:
    """torch decides the precision inside an autocast region at run time; enabled=False keeps it
    FP32 on purpose, so its body is not rewritten (the code outside it is)."""
    torch.manual_seed(0)
    model, x = FrozenRegion(), torch.randn(2, 16)
    program = torch.export.export(model, (x,), strict=False).module()
    body = next(n.target for n in program.graph.nodes if n.op == "get_attr"
                and isinstance(_attr(program, n.target), fx.GraphModule))
    gm, report = amp_rewrite.rewrite(model, example_inputs=(x,), target="bf16", report=True)
    assert getattr(gm, body).code == getattr(program, body).code
    assert _body_dtypes(gm, body, torch.ops.aten.linear.default) == [torch.float32]
    region = [d for d in report.log.decisions.values() if d.op.endswith("wrap_with_autocast")]
    assert len(region) == 1 and "left as written" in region[0].reason
    assert "enabled=False" in region[0].reason and "bfloat16" not in region[0].reason
    assert report.heavy_ops == {"total": 1, "low": 1, "kept_fp32": []}
    y, ref = gm(x), model(x)
    assert ((y - ref).abs().max() / ref.abs().max()).item() <= TOL["bf16"]


class _Bf16Region(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 8)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = self.a(x)
        return self.b(h.float())


def test_an_enabled_autocast_region_is_said_to_run_in_its_type() -> None:
    """The reason for an enabled region said 'enabled=False keeps it FP32 on purpose' beside the
    listed precision fp32, though its linear gives bfloat16: it now names the region's type."""
    torch.manual_seed(0)
    model, x = _Bf16Region().eval(), torch.randn(2, 16)
    gm, report = amp_rewrite.rewrite(model, example_inputs=(x,), target="fp16", report=True)
    region = [d for d in report.log.decisions.values() if d.op.endswith("wrap_with_autocast")]
    assert len(region) == 1 and "left as written" in region[0].reason
    assert "bfloat16" in region[0].reason and "enabled=False" not in region[0].reason


@pytest.mark.parametrize("bad", [(torch.randn(3, 5),), (3,)], ids=["wrong-width", "not-a-tensor"])
def test_example_inputs_the_module_cannot_take_are_a_usage_error(bad, capfd):
    """export fails on them and the fallback's ShapeProp raised its own RuntimeError, a dump of
    fx node internals, after printing the traced code to stderr."""
    model = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4)).eval()
    with pytest.warns(UserWarning, match="fell back|falling back"):
        with pytest.raises(UsageError, match=r"the example inputs do not run through the module \((RuntimeError|TypeError)"):
            amp_rewrite.rewrite(model, example_inputs=bad, target="bf16")
    assert "Traceback" not in capfd.readouterr().err


class _EnergyGrad(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l, self.bn = nn.Linear(8, 8), nn.BatchNorm1d(8)

    def forward(self, x):
        with torch.enable_grad():
            x = x.detach().requires_grad_(True)
            energy = self.bn(self.l(x)).tanh().pow(2).sum()
            (g,) = torch.autograd.grad(energy, x, create_graph=True)
        return g


def test_a_forward_that_differentiates_its_input_is_rewritten():
    """torch.autograd.grad inside forward (gradient penalty, score matching): export cannot
    capture it, symbolic_trace can, but the metadata run (ShapeProp) ran under no_grad, where
    symbolic_trace's graph (no enable_grad block) builds no graph: "element 0 of tensors does not
    require grad", reported as bad example inputs. Then x.detach().requires_grad_(True) was taken
    for an in-place write into the model's input (InPlaceMutationError). The run leaves no trace."""
    torch.manual_seed(0)
    model, x = _EnergyGrad().train(), torch.randn(3, 8)
    stats = model.bn.running_mean.clone()
    with pytest.warns(UserWarning, match="falling back"):
        gm = amp_rewrite.rewrite(model, example_inputs=(x,), target="bf16")
    assert "bfloat16" in gm.code
    assert all(p.grad is None for p in gm.parameters()) and torch.equal(gm.bn.running_mean, stats)
    y, ref = gm(x), model(x)
    assert rel_err(y, ref) < TOL["bf16"]


def test_torch_api_refuses_a_retarget_and_wrong_argument_types():
    """A BF16-rewritten GraphModule rewritten with target='fp16' kept its BF16 weights silently;
    example_inputs=3 and Report.from_model(None) were Python TypeErrors from deep inside."""
    from amp_rewrite.report import Report

    m = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    x = torch.randn(2, 8)
    gm = amp_rewrite.rewrite(m, example_inputs=(x,), target="bf16")
    with pytest.raises(UsageError, match="rewritten to bf16 already"):
        amp_rewrite.rewrite(gm, example_inputs=(x,), target="fp16")
    again = amp_rewrite.rewrite(gm, example_inputs=(x,), target="bf16")
    torch.testing.assert_close(again(x), gm(x))
    with pytest.raises(UsageError, match="example_inputs=3: pass a tuple"):
        amp_rewrite.rewrite(m, example_inputs=3, target="bf16")
    with pytest.raises(UsageError, match="Report.from_model takes a path"):
        Report.from_model(None)


class _ReadBeforeOwnCast(nn.Module):
    """log_softmax reads h (FP32) before the model's own h.float(): cast placement hands it that
    conversion, which the fx graph computes later."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        h = self.lin(x)
        return torch.log_softmax(h, -1) + h.float()


class _LossThenLogits(nn.Module):
    """A common training head: the loss first, then ``logits.float()`` for the caller."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(16, 10)

    def forward(self, h, y):
        logits = self.head(h)
        return F.cross_entropy(logits, y), logits.float()


@pytest.mark.parametrize("capture", ["export", "symbolic_trace"])
def test_a_reader_handed_the_models_own_later_cast_runs(capture):
    """The reader was rewired to the model's own conversion, computed after it in the fx graph:
    rewrite() died in graph.lint() ("used before it has been defined")."""
    torch.manual_seed(0)
    model, x = _ReadBeforeOwnCast().eval(), torch.randn(2, 16)
    gm = amp_rewrite.rewrite(model, example_inputs=(x,), target="bf16", capture=capture)
    gm.graph.lint()
    assert rel_err(gm(x), model(x)) < TOL["bf16"]
    head, y = _LossThenLogits(), torch.tensor([1, 2])
    trained = amp_rewrite.rewrite(head, example_inputs=(x, y), training=True, target="bf16", capture=capture)
    trained.graph.lint()
    loss, logits = trained(x, y)
    ref_loss, ref_logits = head(x, y)
    assert logits.dtype == torch.float32
    assert abs(loss.item() - ref_loss.item()) < 3e-2 * abs(ref_loss.item())
    assert rel_err(logits, ref_logits) < TOL["bf16"]


class _RunningBias(nn.Module):
    """A buffer the forward updates in place (a running sum), read by low-precision ops before and
    after the update."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 4)
        self.register_buffer("acc", torch.linspace(-1.0, 1.0, 16))

    def forward(self, x):
        h = self.a(x)
        before = self.b(h * self.acc)
        self.acc.add_(h.mean(0))
        return before + self.b(h + self.acc)


@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("capture", ["export", "symbolic_trace"])
def test_a_buffer_the_forward_updates_is_read_as_it_is_now(capture, training):
    """The low readers read a low copy of the buffer made once at rewrite time (inference), or a
    cast placed at the top of the graph, before the update (training; symbolic_trace reads
    ``self.acc`` through a get_attr node per access, so the read after the update looked like the
    one before): outputs silently drifted further from the FP32 module's with every call. Now the
    buffer is cast at each low use, a read after the update casts the updated tensor, and the
    update itself stays in place in FP32."""
    torch.manual_seed(0)
    model, x = _RunningBias(), torch.randn(4, 16)
    reference = copy.deepcopy(model)
    result = _dispatch(copy.deepcopy(model), example_inputs=(x,), target="bf16", capture=capture,
                       training=training)
    gm = result.model
    gm.graph.lint()
    assert not [name for name, _ in gm.named_buffers() if "_amp_" in name]  # no frozen low copy
    for _ in range(3):
        with torch.no_grad():
            assert rel_err(gm(x), reference(x)) < TOL["bf16"]
        torch.testing.assert_close(gm.acc, reference.acc, atol=1e-2, rtol=1e-2)
    assert gm.acc.dtype == torch.float32
    update = result.log.decisions["add_"]
    assert update.precision == Precision.FP32 and "writes the module's 'acc' in place" in update.reason


class _Picks(nn.Module):
    def __init__(self, op: str) -> None:
        super().__init__()
        self.a, self.b, self.op = nn.Linear(16, 16), nn.Linear(4, 4), op

    def forward(self, x):
        y = self.a(x)
        if self.op == "topk":
            v = torch.topk(y, 4, dim=-1).values
        elif self.op == "sort":
            v = torch.sort(y, dim=-1).values[..., :4]
        else:
            v = y.view(2, 4, 4).max(dim=-1).values
        return self.b(v)


@pytest.mark.parametrize("op", ["topk", "sort", "max"])
@pytest.mark.parametrize("capture", ["export", "symbolic_trace"])
def test_a_named_tuple_field_selects_an_output(capture, op):
    """symbolic_trace keeps ``torch.topk(y, k).values`` as ``getattr(topk, "values")``: it was taken
    for an unlisted op reading the whole tuple, which the emitter rebuilt as a plain tuple
    ('tuple' object has no attribute 'values' on every call). A field of a named tuple now selects
    that output, as getitem does (export spells it so)."""
    torch.manual_seed(0)
    model, x = _Picks(op).eval(), torch.randn(2, 16)
    result = _dispatch(model, example_inputs=(x,), target="bf16", capture=capture)
    gm = result.model
    gm.graph.lint()
    with torch.no_grad():
        assert rel_err(gm(x), model(x)) < TOL["bf16"]
    assert not [op for op in result.log.unlisted_ops if "getattr" in op]
    assert not [k for k in result.log.decisions if "getattr" in k]


class _MaskFill(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.l, self.l2, self.how = nn.Linear(16, 16), nn.Linear(16, 16), how

    def forward(self, x, mask):
        h = self.l(x)
        fill = h.new_full(h.shape, -1e9) if self.how == "new_full" else torch.full_like(h, -1e9)
        return self.l2(torch.softmax(torch.where(mask, fill, h), -1))


@pytest.mark.parametrize("how", ["new_full", "full_like"])
@pytest.mark.parametrize("capture", ["export", "symbolic_trace"])
def test_a_fill_the_low_type_cannot_hold_keeps_fp32(capture, how):
    """A mask fill of -1e9 made from a low tensor (``h.new_full(s, -1e9)``, ``full_like(h, -1e9)``)
    took the low type: in FP16 torch raised 'value cannot be converted to type c10::Half without
    overflow' on every call. A node with a number argument the target type cannot hold now keeps
    FP32 and says why; in BF16, which holds -1e9, the rule does not apply."""
    torch.manual_seed(0)
    model, x = _MaskFill(how).eval(), torch.randn(2, 16)
    mask = torch.zeros(2, 16, dtype=torch.bool)
    mask[:, 8:] = True
    result = _dispatch(model, example_inputs=(x, mask), target="fp16", capture=capture)
    result.model.graph.lint()
    with torch.no_grad():
        assert rel_err(result.model(x, mask), model(x, mask)) < TOL["fp16"]
    (fill,) = [d for k, d in result.log.decisions.items() if how in k]
    assert fill.precision == Precision.FP32 and "outside fp16's finite range" in fill.reason
    bf16 = _dispatch(model, example_inputs=(x, mask), target="bf16", capture=capture)
    assert not [d for d in bf16.log.decisions.values() if "finite range" in d.reason]


class _DividesBySmall(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.a, self.b, self.how = nn.Linear(4, 4), nn.Linear(4, 4), how
        self.register_buffer("small", torch.tensor(1e-6))

    def forward(self, x):
        h = self.a(x)
        if self.how == "buffer":  # (a module tensor holding the divisor)
            return self.b(h / self.small * 1e-6)
        if self.how == "buffer_keyword":  # (passed as ``other=``)
            return self.b(torch.div(h, other=self.small) * 1e-6)
        if self.how == "negative":  # (its magnitude is what leaves FP16)
            return self.b(h / -1e-6 * -1e-6)
        h = h / 1e-6 if self.how == "operator" else torch.div(h, 1e-6) if self.how == "torch" else h.div(1e-6)
        return self.b(h * 1e-6)


@pytest.mark.parametrize("how", ["operator", "torch", "method", "buffer", "buffer_keyword", "negative"])
@pytest.mark.parametrize("capture", ["export", "symbolic_trace"])
def test_a_division_by_a_number_whose_reciprocal_leaves_fp16_keeps_fp32(capture, how):
    """``h / 1e-6`` multiplies by 1e6: ``h * 1e6`` kept FP32 (its number is past 65504), the division
    ran in FP16 and its output was inf."""
    torch.manual_seed(0)
    model, x = _DividesBySmall(how).eval(), torch.randn(3, 4)
    result = _dispatch(model, example_inputs=(x,), target="fp16", capture=capture)
    result.model.graph.lint()
    with torch.no_grad():
        got = result.model(x)
        assert torch.isfinite(got).all() and rel_err(got, model(x)) < TOL["fp16"]
    (div,) = [d for d in result.log.decisions.values() if "divides by" in d.reason]
    sign = "-" if how == "negative" else ""
    assert div.precision == Precision.FP32 and f"divides by {sign}1e-06, which multiplies by {sign}1e+06" in div.reason


class _LayerScale(nn.Module):
    """ConvNeXt's and CaiT's layer scale: a learned per-channel factor, initialised to 1e-6."""

    def __init__(self, init: float, how: str) -> None:
        super().__init__()
        self.a, self.b, self.how = nn.Linear(16, 16), nn.Linear(16, 16), how
        self.gamma = nn.Parameter(torch.full((16,), init))

    def forward(self, x):
        h = self.a(x)
        h = h * self.gamma if self.how == "mul" else self.gamma.mul(h) if self.how == "method" else self.gamma / h
        return self.b(h * 1e4 if self.how != "div" else h * 1e-4)


@pytest.mark.parametrize(("init", "how", "low"), [(1e-6, "mul", False), (1e-7, "method", False),
                                                  (1e-6, "div", False), (1e-5, "mul", True), (1e-3, "mul", True)])
@pytest.mark.parametrize("capture", ["export", "symbolic_trace"])
def test_a_factor_fp16_holds_only_as_a_coarse_subnormal_keeps_its_mul_fp32(capture, init, how, low):
    """A layer scale of 1e-6 went FP16 as the subnormal 1.01e-6 (1.3% off, 1e-7: 19%): every product
    that far off, where torch.autocast's type promotion keeps ``half * float`` FP32 (the ONNX
    frontend's limit: 7 significant bits; 1e-5, 0.14% off, goes low)."""
    torch.manual_seed(0)
    model, x = _LayerScale(init, how).eval(), torch.randn(4, 16) * (1 if how == "div" else 100)
    result = _dispatch(model, example_inputs=(x,), target="fp16", capture=capture)
    result.model.graph.lint()
    scale = next(d for k, d in result.log.decisions.items() if k.endswith("div" if how == "div" else "mul"))
    assert (scale.precision == Precision.LOW) is low, scale.reason
    if not low:
        assert "below fp16's smallest normal value" in scale.reason and "% off" in scale.reason
    with torch.no_grad():
        got = result.model(x)
        assert torch.isfinite(got).all() and rel_err(got, model(x)) < TOL["fp16"]
    bf16 = _dispatch(model, example_inputs=(x,), target="bf16", capture=capture)
    assert not [d for d in bf16.log.decisions.values() if "smallest normal" in d.reason]


class _ReadsAFill(nn.Module):
    """Ops that read what an out-of-range number made: an additive padding mask (``where(m, 0.0,
    -1e5)``, read through a view by ``h + bias``) and a lerp towards ``full_like(h, 1e5)``."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.proj, self.out, self.how = nn.Linear(8, 8), nn.Linear(8, 4), how

    def forward(self, x, mask):
        h = self.proj(x)
        if self.how == "mask":
            h = h + torch.where(mask, 0.0, -1e5)[..., None]
            pooled = h.max(dim=1).values * mask.any(1, keepdim=True)  # (an all-padding row: 0)
        else:
            pooled = torch.lerp(h, torch.full_like(h, 1e5), 0.5).mean(1) * 1e-4
        return self.out(pooled)


@pytest.mark.parametrize("how", ["mask", "lerp"])
@pytest.mark.parametrize("capture", ["export", "symbolic_trace"])
def test_readers_of_an_out_of_range_fill_keep_fp32(capture, how):
    """The node with the number kept FP32, but its readers were free to go low: ``h + bias`` went
    FP16, so its FP32 mask was cast at run time and -1e5 became -inf (an all-padding row then gave
    -inf * 0 = NaN); the lerp read 1e5 as inf. Its readers keep FP32 now and say why, as the ONNX
    side keeps readers of an out-of-range constant."""
    torch.manual_seed(0)
    model = _ReadsAFill(how).eval()
    x = torch.randn(3, 4, 8)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]], dtype=torch.bool)
    result = _dispatch(model, example_inputs=(x, mask), target="fp16", capture=capture)
    result.model.graph.lint()
    with torch.no_grad():
        out = result.model(x, mask)
        assert torch.isfinite(out).all() and rel_err(out, model(x, mask)) < TOL["fp16"]
    readers = [d for d in result.log.decisions.values() if "beyond fp16's finite range" in d.reason]
    assert readers and all(d.precision == Precision.FP32 for d in readers)
    assert {d.op for d in readers} >= ({"add"} if how == "mask" else {"lerp"})


class _HoldsABigTensor(nn.Module):
    """Module tensors holding values past FP16's range, read by infer and clear ops between two
    Linears: a learned scale of 1e5 (``mul``), a buffer of 70000 concatenated to an activation, a
    constant tensor symbolic_trace makes of ``torch.full`` (``masked_scatter``); and a causal-mask
    buffer of -1e9 (a sentinel: saturated it still masks, so its reader may go low)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.a, self.b, self.how = nn.Linear(16, 16), nn.Linear(16, 16), how
        self.scale = nn.Parameter(torch.full((16,), 1e5))
        self.register_buffer("big", torch.full((2, 1, 16), 70000.0))
        self.register_buffer("mask", torch.triu(torch.full((8, 16), -1e9), 1))

    def forward(self, x):
        h = self.a(x)
        if self.how == "mul":
            h = h * self.scale * 1e-5
        elif self.how == "cat":
            h = torch.cat([h, self.big], 1) / 70000.0
        elif self.how == "masked_scatter":
            h = h.masked_scatter(h > 0, torch.full((2 * 8 * 16,), 70000.0)) / 70000.0
        else:
            h = torch.softmax(h + self.mask, -1)
        return self.b(h)


@pytest.mark.parametrize("how", ["mul", "cat", "masked_scatter"])
@pytest.mark.parametrize("capture", ["export", "symbolic_trace"])
@pytest.mark.parametrize("training", [False, True])
def test_readers_of_a_module_tensor_past_the_range_keep_fp32(capture, how, training):
    """Only number arguments were checked: a parameter, buffer or traced constant holding 1e5 or
    70000 was converted to FP16 with clamping for its mul/cat/masked_scatter reader, which then
    overflowed (inf/NaN outputs, a NaN training loss) or came out 5-7% off. Its readers keep FP32
    now and say why, as readers of such an initializer do on the ONNX side."""
    torch.manual_seed(0)
    model = _HoldsABigTensor(how)
    model.train(training)
    x = torch.randn(2, 8, 16)
    result = _dispatch(model, example_inputs=(x,), target="fp16", capture=capture, training=training)
    result.model.graph.lint()
    with torch.no_grad():
        out, ref = result.model(x), model(x)
    assert torch.isfinite(out).all() and rel_err(out, ref) < TOL["fp16"]
    readers = [d for d in result.log.decisions.values() if "beyond fp16's finite range" in d.reason]
    assert readers and all(d.precision == Precision.FP32 for d in readers)
    assert result.log.weights.clamped == 0


class _BigBias(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.how = how
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)
        self.conv = nn.Conv1d(16, 16, 1)
        if how == "linear":
            with torch.no_grad():
                self.a.bias[:2] = torch.tensor([1e5, -1e5])
        self.const = torch.full((16,), 1e5)

    def forward(self, x):
        h = self.a(x)
        if self.how == "linear":
            h = h - self.a.bias
        elif self.how == "addmm":
            h = torch.addmm(torch.full((16,), 1e5), h, torch.eye(16)) - 1e5
        elif self.how == "attr":
            h = torch.addmm(self.const, h, torch.eye(16)) - 1e5
        elif self.how == "conv":
            h = F.conv1d(h.unsqueeze(-1), self.conv.weight, self.const).squeeze(-1) - 1e5
        elif self.how == "attr to":  # (F.linear(x, w.to(x.dtype), b.to(x.dtype)): a wrapper's idiom)
            h = torch.addmm(self.const.to(h.dtype), h, torch.eye(16)) - 1e5
        elif self.how == "attr times one":
            h = torch.addmm(self.const * 1.0, h, torch.eye(16)) - 1e5
        return self.b(h)


@pytest.mark.parametrize("how", ["addmm", "attr", "conv", "linear", "attr to", "attr times one"])
@pytest.mark.parametrize("capture", ["export", "symbolic_trace"])
def test_a_gemm_or_conv_adding_a_bias_past_the_range_keeps_fp32(capture, how):
    """torch.addmm(full(1e5), h, w) was cast to fp16 (the bias clamped to 65504 at run time) and
    came out 4.5e4 times off, with no clamp counted; an nn.Linear's bias of 1e5 was clamped offline.
    The bias is added to the output as it is: the node keeps FP32, as the ONNX Gemm does. So it is
    read through ``.to(h.dtype)`` or ``* 1.0`` (each was FP16, every output row inf)."""
    model = _BigBias(how).eval()
    x = torch.randn(16, 16)
    result = _dispatch(model, example_inputs=(x,), target="fp16", capture=capture)
    result.model.graph.lint()
    with torch.no_grad():
        out, ref = result.model(x), model(x)
    # (h + 1e5 - 1e5 keeps FP32's 0.008 spacing at 1e5 around values of 0.3: 1-2%; it was 4.5e4 times off)
    assert rel_err(out, ref) < 0.03
    kept = [d for d in result.log.decisions.values() if "its bias" in d.reason]
    assert len(kept) == 1 and kept[0].precision == Precision.FP32, [d.reason for d in result.log.decisions.values()]
    low = [d for d in result.log.decisions.values() if d.op == "linear" and d.precision == Precision.LOW]
    assert len(low) == (1 if how == "linear" else 2)  # (the other GEMMs still run low)


def test_a_mask_sentinel_in_a_buffer_does_not_keep_its_reader_fp32():
    """-1e9 in a mask buffer is a sentinel (saturated to -65504 it still masks): its ``add`` may
    go low with the softmax input around it, as on the ONNX side."""
    torch.manual_seed(0)
    model = _HoldsABigTensor("mask").eval()
    x = torch.randn(2, 8, 16)
    result = _dispatch(model, example_inputs=(x,), target="fp16", capture="symbolic_trace")
    assert not [d for d in result.log.decisions.values() if "beyond fp16's finite range" in d.reason]
    with torch.no_grad():
        assert rel_err(result.model(x), model(x)) < TOL["fp16"]


class _IntScalars(nn.Module):
    """Out-of-range scalars the check missed: an int literal (``clamp(min=-100000)``,
    ``h * 100000 / 100000``) and a leaf module's attribute (``nn.ConstantPad1d(..., -1e9)``, kept
    as a call_module by symbolic_trace), next to an int that is a size (``view(-1, 70000 // 1000)``
    must not count)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.l, self.l2, self.how = nn.Linear(16, 16), nn.Linear(16, 16), how
        self.pad = nn.ConstantPad1d((0, 2), -1e9)

    def forward(self, x):
        h = self.l(x)
        if self.how == "clamp":
            h = torch.clamp(h, min=-100000)
        elif self.how == "scale":
            h = h * 100000 / 100000
        else:  # "pad": TF-style SAME pooling pads with a huge negative
            h = torch.nn.functional.max_pool1d(self.pad(h), 3, 1)
        return self.l2(h)


@pytest.mark.parametrize("how", ["clamp", "scale", "pad"])
@pytest.mark.parametrize("capture", ["export", "symbolic_trace"])
def test_int_and_module_scalars_the_low_type_cannot_hold_keep_fp32(capture, how):
    """``clamp(h, min=-100000)`` crashed in FP16 ('cannot be converted to type c10::Half without
    overflow') where ``min=-1e5`` was kept FP32; ``h * 100000`` overflowed to inf; symbolic_trace's
    ``nn.ConstantPad1d(value=-1e9)`` crashed. Int scalars of value ops, and a leaf module's scalar
    attributes, now count as the float ones do."""
    torch.manual_seed(0)
    model, x = _IntScalars(how).eval(), torch.randn(2, 4, 16)
    result = _dispatch(model, example_inputs=(x,), target="fp16", capture=capture)
    result.model.graph.lint()
    with torch.no_grad():
        out = result.model(x)
        assert torch.isfinite(out).all() and rel_err(out, model(x)) < TOL["fp16"]
    assert [d for d in result.log.decisions.values() if "outside fp16's finite range" in d.reason]


def test_an_int_size_argument_is_not_a_value():
    """``view(-1, 70000)`` names a size: it stays free to run low (no 'finite range' reason)."""

    class Vocab(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l = nn.Linear(8, 70000)

        def forward(self, x):
            return self.l(x).view(-1, 70000)

    x = torch.randn(1, 2, 8)
    result = _dispatch(Vocab().eval(), example_inputs=(x,), target="fp16", capture="symbolic_trace")
    assert not [d for d in result.log.decisions.values() if "finite range" in d.reason]


class _SinusoidalPositions(nn.Module):
    """Sinusoidal positions made in the hidden state's type: ``arange(..., dtype=h.dtype)``."""

    def __init__(self) -> None:
        super().__init__()
        self.l, self.l2 = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        h = self.l(x)
        pos = torch.arange(h.shape[1], dtype=h.dtype, device=h.device)
        inv = torch.exp(torch.arange(0, 16, 2, dtype=h.dtype) * (-9.21 / 16))
        ang = pos[:, None] * inv[None, :]
        return self.l2(h + torch.cat([ang.sin(), ang.cos()], -1))


class _RuntimeTypes(fx.Interpreter):
    """Runs a GraphModule and lists the nodes whose tensor is not of the type its meta says."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.wrong: list[str] = []

    def run_node(self, n):
        out = super().run_node(n)
        metas = leaf_metas(n)
        if isinstance(out, torch.Tensor) and len(metas) == 1 and metas[0][0] == ():
            meta = metas[0][1]
            if getattr(meta, "dtype", out.dtype) != out.dtype:
                self.wrong.append(f"{n.name}: meta {meta.dtype}, runs {out.dtype}")
        return out


@pytest.mark.parametrize("capture", ["export", "symbolic_trace"])
def test_a_dtype_read_at_run_time_answers_the_source_models_type(capture):
    """symbolic_trace keeps ``h.dtype`` as a node read at run time: with ``h`` made low, the
    positions' arange followed it into FP16 while the IR and the report said FP32, so the deny
    ops on them (exp, sin, cos) silently ran in FP16 (positions up to 1500: rel err 3e-2 instead
    of 4e-4). The read now answers FP32, as in the source model, and every node runs in the type
    its metadata (and the report) gives it."""
    torch.manual_seed(0)
    model, x = _SinusoidalPositions().eval(), torch.randn(1, 12, 16)
    result = _dispatch(model, example_inputs=(x,), target="fp16", capture=capture)
    gm = result.model
    gm.graph.lint()
    assert not [n for n in gm.graph.nodes if n.target is getattr and n.args[1:] == ("dtype",)]
    spy = _RuntimeTypes(gm)
    with torch.no_grad():
        y = spy.run(x)
        assert rel_err(y, model(x)) < TOL["fp16"]
    assert spy.wrong == []
    sin = [d for k, d in result.log.decisions.items() if k.endswith("sin")]
    assert [d.precision for d in sin] == [Precision.FP32]
    heavy = [d for d in result.log.decisions.values() if d.op == "linear"]
    assert heavy and all(d.precision == Precision.LOW for d in heavy)
    assert not _dispatch(gm, example_inputs=(x,), target="fp16").modified


class _ConvertsToItsType(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l, self.l2 = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        h = self.l(x)
        p = torch.softmax(h.float(), -1).to(h.dtype)  # back to the hidden state's type
        z = torch.ones(3, 16, dtype=self.l.weight.dtype)  # made in the weights' type
        return self.l2(p) + z.sum()


@pytest.mark.parametrize("capture", ["export", "symbolic_trace"])
def test_a_conversion_to_a_tensors_dtype_is_a_cast_to_the_source_models_type(capture):
    """``y.to(h.dtype)`` under symbolic_trace is a conversion to FP32 (h's type in the source
    model), which cast placement folds with the cast it needs there: one conversion, to FP16,
    where the module ran two; a factory given a converted weight's dtype is made as the IR
    says (FP32 here, where it used to follow the weight into FP16 against its metadata)."""
    torch.manual_seed(0)
    model, x = _ConvertsToItsType().eval(), torch.randn(3, 16)
    result = _dispatch(model, example_inputs=(x,), target="fp16", capture=capture)
    gm = result.model
    gm.graph.lint()
    spy = _RuntimeTypes(gm)
    with torch.no_grad():
        assert rel_err(spy.run(x), model(x)) < TOL["fp16"]
    assert spy.wrong == []
    to_fp16 = [n for n in gm.graph.nodes if n.op.startswith("call") and "assert" not in str(n.target)
               and torch.float16 in (*n.args, *n.kwargs.values())]
    # x into the first linear, softmax's output into the second: no second conversion after it
    assert len(to_fp16) == 2, gm.code
    assert not _dispatch(gm, example_inputs=(x,), target="fp16").modified


class _Rotary(nn.Module):
    """HF Llama's rotary table: inv_freq[:, None] @ position_ids[None, :].float(), then cos."""

    def __init__(self) -> None:
        super().__init__()
        self.l, self.l2 = nn.Linear(8, 8), nn.Linear(8, 8)
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8)))

    def forward(self, x, position_ids):
        freqs = (self.inv_freq[:, None] @ position_ids[None, :].float()).t()
        cos = torch.cat([freqs, freqs], -1).cos()
        return self.l2(self.l(x) * cos)


@pytest.mark.parametrize("capture", ["export", "symbolic_trace"])
def test_rotary_angles_from_positions_stay_fp32_in_torch(capture):
    """The angle matmul of a rotary table reads positions and a constant buffer only: it keeps
    FP32 so cos gets a precise argument (positions 4000+); the linears stay low."""
    torch.manual_seed(0)
    model = _Rotary().eval()
    x, pos = torch.randn(16, 8), torch.arange(4000, 4016)
    result = _dispatch(model, example_inputs=(x, pos), target="fp16", capture=capture)
    matmul = [d for d in result.log.decisions.values() if d.op == "matmul"]
    assert matmul and all(d.precision == Precision.FP32 and "integers and constants" in d.reason for d in matmul)
    linears = [d for d in result.log.decisions.values() if d.op == "linear"]
    assert linears and all(d.precision == Precision.LOW for d in linears)
    with torch.no_grad():
        assert rel_err(result.model(x, pos), model(x, pos)) < TOL["fp16"]


class _BigLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.big = nn.Linear(8, 8), nn.Linear(8, 8)
        with torch.no_grad():
            self.big.weight.fill_(30000.0)  # outputs past FP16's 65504

    def forward(self, x):
        return self.big(torch.relu(self.a(x))) * 1e-3


@pytest.mark.parametrize("capture", ["export", "symbolic_trace"])
def test_a_pin_that_leaves_nothing_low_survives_rewriting_the_output_again(capture):
    """With every Linear pinned FP32 nothing changed, and the module came back without tags: the
    second rewrite made the pinned Linears FP16 (the big one's outputs inf)."""
    torch.manual_seed(0)
    model, x = _BigLinear().eval(), torch.rand(2, 8) + 1
    first = _dispatch(model, example_inputs=(x,), target="fp16", capture=capture, fp32_nodes=["a*", "big*"])
    assert first.modified and any(n.startswith("as pinned: the rewrite moves nothing to fp16") for n in first.log.notes)
    first.model.graph.lint()
    again = _dispatch(first.model, example_inputs=(x,), target="fp16")
    again.model.graph.lint()
    with torch.no_grad():
        assert torch.isfinite(again.model(x)).all()
    assert {d.precision for d in again.log.decisions.values() if d.op == "linear"} == {Precision.FP32}
    assert not again.modified and again.model.code == first.model.code


@pytest.mark.parametrize("capture", ["export", "symbolic_trace"])
def test_a_users_fp32_pin_survives_rewriting_the_output_again(capture):
    """README: pinned nodes stay FP32 when the output is rewritten again without the flags. The
    torch loader never read the earlier rewrite's tags: the second rewrite made the pinned Linear
    FP16 and its ~1e5 outputs inf."""
    torch.manual_seed(0)
    model, x = _BigLinear().eval(), torch.rand(2, 8) + 1
    first = _dispatch(model, example_inputs=(x,), target="fp16", capture=capture, fp32_nodes=["big/*"]).model
    again = _dispatch(first, example_inputs=(x,), target="fp16")
    again.model.graph.lint()
    with torch.no_grad():
        assert torch.isfinite(again.model(x)).all()
    pinned = [d for d in again.log.decisions.values() if d.op == "linear" and d.precision == Precision.FP32]
    assert len(pinned) == 1 and pinned[0].source == "--fp32-nodes"
    assert again.model.code == first.code


class _LinearThenNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x):
        return self.norm(self.fc(x))


@pytest.mark.parametrize("capture", ["export", "symbolic_trace"])
def test_torch_rule_fp32_inputs_names_schema_arguments(tmp_path, capture):
    """A torch rule's ``fp32_inputs = ["bias"]`` named an input the way torch's schemas do, but the
    loader labelled a call's arguments by position ("2"), so the name pinned nothing, silently, and
    linear ran in fp16. It now pins the bias (which shares linear's type, so linear keeps FP32)."""
    rules = tmp_path / "r.toml"
    rules.write_text('[ruleset]\nname = "r"\nfrontend = "torch"\n'
                     '[allow.linear]\nreason = "gemm"\nfp32_inputs = ["bias"]\n')
    x = torch.randn(2, 8)
    gm, report = amp_rewrite.rewrite(_LinearThenNorm(), example_inputs=(x,), rules=[rules], capture=capture,
                                     report=True)
    assert gm.fc.weight.dtype == torch.float32 and gm(x).dtype == torch.float32
    assert "input 'bias' is pinned FP32 by the rules" in report.summary_text()


def test_torch_rule_fp32_inputs_misspelt_is_refused(tmp_path):
    """A misspelt name pinned nothing, silently (the ONNX edge checks names against op schemas; torch
    had no check): it is a rule file error naming the file, the key and the closest input."""
    rules = tmp_path / "r.toml"
    rules.write_text('[ruleset]\nname = "r"\nfrontend = "torch"\n'
                     '[infer.layer_norm]\nreason = "stats"\nfp32_inputs = ["wieght"]\n')
    with pytest.raises(RuleFileError) as info:
        amp_rewrite.rewrite(_LinearThenNorm(), example_inputs=(torch.randn(2, 8),), rules=[rules])
    message = str(info.value)
    assert "r.toml: infer.layer_norm.fp32_inputs: 'wieght' is not an input of any layer_norm call" in message
    assert "did you mean 'weight'" in message


class _ShiftRight(nn.Module):
    """T5's / BART's shift_tokens_right: in-place writes into an int64 tensor, then an embedding."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.fc = nn.Linear(8, 8)

    def forward(self, labels):
        shifted = labels.new_zeros(labels.shape)
        shifted[..., 1:] = labels[..., :-1].clone()
        shifted.masked_fill_(shifted == -100, 0)
        return self.fc(self.emb(shifted))


def test_in_place_writes_to_an_integer_tensor_are_not_refused():
    """Such writes in dynamo's graph were refused ('casts would break that aliasing') although an
    integer tensor is never cast: torch.compile of T5 and BART (training too) stopped there."""
    import amp_rewrite.compile_backend  # noqa: F401  (registers the backend)

    torch._dynamo.reset()
    labels = torch.tensor([[1, 2, -100, 4], [3, -100, 5, 6]])
    module = _ShiftRight().eval()
    compiled = torch.compile(module, backend="amp_rewrite", options={"target": "bf16", "backend": "eager"})
    got = compiled(labels)
    ref = module(labels)
    assert got.dtype == torch.float32 and torch.allclose(got, ref, rtol=5e-2, atol=5e-2)
    assert not torch.equal(got, ref)  # (the bf16 linear ran: the graph was rewritten, not passed over)


class _TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16)) for _ in range(2)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.parametrize("capture", ["export", "symbolic_trace"])
def test_a_module_path_pins_what_runs_in_that_module(capture):
    """rules/README promised that torch node patterns match module paths, but a node answered only
    to '<module path>/<fx name>': fp32_nodes=['layers.1'] named no node ("pins nothing") and the
    layer ran low. A module's path (or an ancestor's) now pins every node in it."""
    x = torch.randn(4, 16)
    gm, report = amp_rewrite.rewrite(_TwoLayers().eval(), example_inputs=(x,), capture=capture,
                                     fp32_nodes=["layers.1"], report=True)
    nodes = {n["node"]: n["precision"] for n in report.to_dict()["nodes"] if n["op"] == "linear"}
    assert {name for name, p in nodes.items() if p == "fp32"} == {n for n in nodes if n.startswith("layers.1.")}
    assert any(n.startswith("layers.0.") and p == "fp16" for n, p in nodes.items())
    assert not [n for n in report.to_dict()["notes"] if not n.startswith("captured with torch.export for")]
    whole, report = amp_rewrite.rewrite(_TwoLayers().eval(), example_inputs=(x,), capture=capture,
                                        fp32_nodes=["layers"], report=True)
    assert all(n["precision"] == "fp32" for n in report.to_dict()["nodes"] if n["op"] == "linear")


class _SoftmaxInFp32(nn.Module):
    """HF eager attention: softmax(..., dtype=float32).to(q.dtype)."""

    def __init__(self):
        super().__init__()
        self.q, self.v = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        q, v = self.q(x), self.v(x)
        return torch.softmax(q @ q.transpose(-1, -2), dim=-1, dtype=torch.float32).to(q.dtype) @ v


def test_a_retargeted_conversion_is_reported_in_the_type_it_writes():
    """The model's own .to(q.dtype) after an FP32 softmax is retargeted to fp16 (only fp16 matmuls
    read it); the report listed it as computing in fp32 while it wrote fp16 at run time."""
    x = torch.randn(2, 4, 16)
    gm, report = amp_rewrite.rewrite(_SoftmaxInFp32().eval(), example_inputs=(x,), report=True)
    written = {}

    class Recorder(fx.Interpreter):
        def run_node(self, n):
            result = super().run_node(n)
            if isinstance(result, torch.Tensor):
                written[n.name] = result.dtype
            return result

    with torch.no_grad():
        Recorder(gm).run(x)
    retargeted = [c["name"] for c in report.to_dict()["casts"] if c["kind"] == "retargeted"]
    assert retargeted
    nodes = {n["node"]: n for n in report.to_dict()["nodes"]}
    for name in retargeted:
        assert nodes[name]["precision"] == "fp16" and "retargeted to fp16" in nodes[name]["reason"]
        assert written[name.rsplit("/", 1)[-1]] == torch.float16


def test_example_inputs_given_as_a_dict_are_refused_with_the_keyword_to_use():
    """A dict (an HF tokenizer's output) was turned into the tuple of its keys, and the error spoke
    of a str where a tensor was expected."""
    with pytest.raises(UsageError, match=r"example_inputs is a dict \(keys 'x'\): pass keyword inputs as example_kwargs"):
        amp_rewrite.rewrite(MLP(), example_inputs={"x": torch.randn(2, 16)})


@torch.fx.wrap
def _clip_if_big(x):
    if x.abs().max() > 100:  # (data-dependent: torch.export fails, symbolic_trace keeps the call whole)
        return x.clamp(-100, 100)
    return x


class _DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(_clip_if_big(x))


def test_example_kwargs_alone_serve_the_symbolic_trace_fallback():
    """With export failing, a caller who gave the inputs as example_kwargs (the usual way for an HF
    model) was told to 'pass example_inputs'; the same tensor given positionally worked."""
    x = torch.randn(2, 8)
    with pytest.warns(UserWarning, match="falling back to torch.fx.symbolic_trace"):
        gm = amp_rewrite.rewrite(_DataDependent().eval(), target="bf16", example_kwargs={"x": x})
    gm.graph.lint()
    assert gm.fc.weight.dtype == torch.bfloat16 and gm(x).dtype == torch.float32


class _NormsSoftmaxLoss(nn.Module):
    """An RMSNorm and a LayerNorm written out, a softmax, an nn.LayerNorm and a cross entropy, each
    between linears: five FP32 islands."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c, self.d, self.e = (nn.Linear(8, 8) for _ in range(5))
        self.ln = nn.LayerNorm(8)

    def forward(self, x, labels):
        h = self.a(x)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        h = self.ln(self.c(torch.softmax(self.b(h), -1)))
        h = self.d(h)
        u = h.mean(-1, keepdim=True)
        h = (h - u) / torch.sqrt((h - u).pow(2).mean(-1, keepdim=True) + 1e-5)
        return F.cross_entropy(self.e(h), labels)


@pytest.mark.parametrize("capture, decompose", [("export", False), ("export", True), ("symbolic_trace", False)],
                         ids=["export", "decomposed", "symbolic_trace"])
def test_torch_islands_are_named_by_their_pattern(capture, decompose):
    """Island patterns were recognised by ONNX op names only: every torch island was an anonymous
    'FP32 region'. The aten (fused and decomposed) and torch-level spellings name them too."""
    x, labels = torch.randn(4, 8), torch.tensor([1, 2, 3, 0])
    _, report = amp_rewrite.rewrite(_NormsSoftmaxLoss().eval(), example_inputs=(x, labels), target="bf16",
                                    capture=capture, decompose=decompose, report=True)
    assert [i.pattern for i in report.log.islands] == ["RMSNorm", "softmax", "normalisation", "LayerNorm", "loss"]
    assert report.to_dict()["islands"][0]["description"].startswith("RMSNorm pattern, 5 nodes")


class _LogSoftmaxBetweenLinears(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.b(torch.log_softmax(self.a(x), -1))


class _LogSoftmaxNllLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x, labels):
        return F.nll_loss(torch.log_softmax(self.a(x), -1), labels)


@pytest.mark.parametrize("capture", ["export", "symbolic_trace"])
def test_a_lone_log_softmax_island_is_a_softmax_and_with_its_nll_loss_a_loss(capture):
    """A log_softmax alone (read by a Linear) is a softmax, not a loss: only with the loss that reads
    it (more than the one node) is the island a loss."""
    x, labels = torch.randn(3, 4), torch.tensor([0, 2, 1])
    _, lone = amp_rewrite.rewrite(_LogSoftmaxBetweenLinears().eval(), example_inputs=(x,), target="bf16",
                                  capture=capture, report=True)
    assert [(i.pattern, len(i.members)) for i in lone.log.islands] == [("softmax", 1)]
    _, loss = amp_rewrite.rewrite(_LogSoftmaxNllLoss().eval(), example_inputs=(x, labels), target="bf16",
                                  capture=capture, report=True)
    assert [(i.pattern, len(i.members)) for i in loss.log.islands] == [("loss", 2)]


class _LogSumExp(nn.Module):
    """log(sum(exp(h))) written out: an exp read by a sum, with no division."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(1, 4)

    def forward(self, x):
        return self.b(torch.log(torch.exp(self.a(x)).sum(-1, keepdim=True)))


class _SoftmaxWrittenOut(nn.Module):
    """exp(h) / sum(exp(h)): the exp is read by a sum and a division."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        e = torch.exp(self.a(x))
        return self.b(e / e.sum(-1, keepdim=True))


@pytest.mark.parametrize("model, pattern", [(_LogSumExp, "reduction"), (_SoftmaxWrittenOut, "softmax")],
                         ids=["logsumexp", "softmax"])
def test_an_exp_read_by_a_sum_is_a_softmax_only_with_a_division(model, pattern):
    """An exp and a sum of it are a softmax only when a division reads the exp too: a log-sum-exp
    (and a GELU backward beside a bias-gradient sum) is none."""
    x = torch.randn(3, 4)
    _, report = amp_rewrite.rewrite(model().eval(), example_inputs=(x,), target="bf16", report=True)
    assert [i.pattern for i in report.log.islands] == [pattern]


class _OwnConversionAroundSoftmax(nn.Module):
    """The model's own .float() before a softmax and .to(h.dtype) after it: the rewrite retargets the
    second to the low type and inserts one cast of its own."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        h = self.a(x)
        return self.b(torch.softmax(h.float(), -1).to(h.dtype))


def test_island_cast_counts_leave_out_the_models_own_retargeted_casts():
    """An island counts the casts the rewrite inserted at its edges. The model's own .to() after the
    softmax, retargeted to fp16, is not a cast out of the island."""
    x = torch.randn(3, 4)
    _, report = amp_rewrite.rewrite(_OwnConversionAroundSoftmax().eval(), example_inputs=(x,), target="fp16",
                                    report=True)
    assert sorted({c.kind for c in report.log.casts}) == ["inserted", "retargeted"]
    [island] = report.log.islands
    assert (island.pattern, island.casts_in, island.casts_out) == ("softmax", 0, 0)
    members = set(island.members)
    inserted = [c for c in report.log.casts if c.kind == "inserted"]
    assert island.casts_out == sum(c.producer in members for c in inserted)
    assert island.casts_in == sum(bool(members & set(c.consumers)) for c in inserted)


class _GemmsAndConv(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(12, 16)  # K = 12: not a multiple of 8
        self.conv = nn.Conv2d(3, 16, 3)  # C_in = 3
        self.w = nn.Parameter(torch.randn(16, 24))

    def forward(self, x, img):
        h = self.fc(x)
        return torch.bmm(h, h.transpose(1, 2)), h @ self.w, self.conv(img)


@pytest.mark.parametrize("capture, decompose", [("export", False), ("export", True), ("symbolic_trace", False)],
                         ids=["export", "decomposed", "symbolic_trace"])
def test_torch_gemms_and_convolutions_get_the_alignment_check(capture, decompose):
    """The report's tensor-core alignment section was always empty on torch: operand shapes were
    recorded for ONNX op names only. linear's M is its input's leading dims flattened (2 * 4);
    addmm's operands are the two after the bias."""
    from amp_rewrite.report import validate

    x, img = torch.randn(2, 4, 12), torch.randn(1, 3, 8, 8)
    _, report = amp_rewrite.rewrite(_GemmsAndConv().eval(), example_inputs=(x, img), target="fp16",
                                    capture=capture, decompose=decompose, report=True)
    d = report.to_dict()
    validate(d)
    got = {a["op"]: (a["dims"], a["misaligned"]) for a in d["alignment"]}
    linear = "addmm" if decompose else "linear"
    conv, channels = ("convolution", ("W[0]", "W[1]")) if decompose else ("conv2d", ("C_out", "C_in/group"))
    assert got[linear] == ({"M": 8, "K": 12, "N": 16}, ["K"])
    assert got["bmm"] == ({"M": 4, "K": 16, "N": 4}, ["M", "N"])
    assert got["mm" if decompose else "matmul"][0]["N"] == 24
    assert got[conv] == (dict(zip(channels, (16, 3))), [channels[1]])
    assert d["summary"]["alignment"]["checked"] == 4 and d["summary"]["alignment"]["unknown"] == 0


class _MatmulBatchedA(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(16, 16))

    def forward(self, x, y):
        return x @ self.w, x @ y  # a 2-D B, then both operands batched (bmm-like)


@pytest.mark.parametrize("decompose", [False, True], ids=["export", "decomposed"])
def test_matmul_with_a_2d_b_folds_the_batch_into_m(decompose):
    """x [2, 4, 16] @ W [16, 16] is one GEMM with M = 2 * 4, as linear is, but the report gave
    matmul M = x[-2] = 4, 'misaligned', where the decomposed capture (view + mm) said M=8,
    aligned. Both operands batched stays one GEMM per batch: M = 4."""
    x, y = torch.randn(2, 4, 16), torch.randn(2, 16, 8)
    _, report = amp_rewrite.rewrite(_MatmulBatchedA().eval(), example_inputs=(x, y), target="bf16",
                                    decompose=decompose, report=True)
    got = {a["dims"]["N"]: (a["op"], a["dims"], a["status"]) for a in report.alignment()}
    gemm, batched = ("mm", "bmm") if decompose else ("matmul", "matmul")
    assert got == {16: (gemm, {"M": 8, "K": 16, "N": 16}, "aligned"),
                   8: (batched, {"M": 4, "K": 16, "N": 8}, "misaligned")}


class _ColourMatrix(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("yuv", torch.randn(3, 3))
        self.fc = nn.Linear(3, 5)

    def forward(self, x):  # x: [B, H, W, 3]
        return self.fc(torch.einsum("ij,bhwj->bhwi", self.yuv, x))


@pytest.mark.parametrize("capture", ["export", "symbolic_trace"])
def test_a_low_einsum_gets_the_alignment_check(capture):
    """A low einsum of two operands is a GEMM, but the tensor-core line counted 1 of the 2 low
    GEMMs (the linear): einsum's dims come from its equation."""
    from amp_rewrite.report import validate

    _, report = amp_rewrite.rewrite(_ColourMatrix().eval(), example_inputs=(torch.randn(1, 4, 4, 3),),
                                    target="bf16", capture=capture, report=True)
    validate(report.to_dict())
    (einsum,) = [a for a in report.alignment() if a["op"] == "einsum"]
    assert einsum["equation"] == "ij,bhwj->bhwi"
    assert einsum["dims"] == {"M": 3, "N": 16, "K": 3} and einsum["misaligned"] == ["M", "K"]
    assert "tensor cores: 2 of 2 bf16" in report.summary_text()


class _HfStyleDataDependent(nn.Module):
    """An HF-style forward: optional inputs checked against each other (symbolic_trace feeds a
    Proxy to each, so the check raises) and a data-dependent branch torch.export cannot capture."""

    def __init__(self):
        super().__init__()
        self.emb, self.fc = nn.Embedding(10, 8), nn.Linear(8, 8)

    def forward(self, input_ids=None, inputs_embeds=None):
        if input_ids is not None and inputs_embeds is not None:
            raise ValueError("You cannot specify both input_ids and inputs_embeds at the same time")
        h = self.emb(input_ids) if inputs_embeds is None else inputs_embeds
        if (input_ids > 5).any().item():
            h = h * 2
        return self.fc(h)


@pytest.mark.filterwarnings("ignore:amp_rewrite. torch.export failed")
@pytest.mark.parametrize("capture", ["auto", "export"])
def test_an_export_failure_leads_the_error_and_says_what_to_do(capture):
    """With the symbolic_trace fallback failing too, the error led with the fallback's failure (the
    module's own argument check, beside the point) and gave export's cause only at its end."""
    ids = torch.tensor([[1, 7, 3]])
    with pytest.raises(UnsupportedModelError) as caught:
        amp_rewrite.rewrite(_HfStyleDataDependent().eval(), example_kwargs={"input_ids": ids}, target="bf16",
                            capture=capture)
    message = caught.value.message
    assert message.startswith("torch.export could not capture _HfStyleDataDependent: Could not guard on data-dependent")
    assert 'torch.compile(model, backend="amp_rewrite")' in message
    # (the fallback traces inputs_embeds as the None the examples leave it, so it fails on the
    # data-dependent branch too, not on the module's own check of its optional arguments)
    assert "cannot specify both" not in message
    fallback = message.find("symbolic_trace fallback failed too: symbolically traced variables cannot be used")
    assert fallback > message.find("torch.compile") if capture == "auto" else fallback == -1


class _DataDependentBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        if x.sum() > 0:
            return self.fc(x)
        return self.fc(-x)


@pytest.mark.parametrize("module, kwargs, code", [
    (_DataDependentBranch, {"x": torch.randn(2, 8)}, "if x.sum() > 0:"),
    (_HfStyleDataDependent, {"input_ids": torch.tensor([[1, 7, 3]])}, "if (input_ids > 5).any().item():")],
    ids=["branch", "item"])
def test_an_export_failure_names_the_line_of_forward(module, kwargs, code):
    """The cause came from export's first 'Caused by:' line: for a tensor's truth value that is the
    first frame outside torch's tracing files, a torch file ('_export/non_strict_utils.py:1205 in
    __torch_function__'), where the forward's line is in the error's traceback section; for .item()
    it is the forward's line, its path cut by torch ('mp/wt_torch/tests/...' for /tmp/wt_torch/...)."""
    with pytest.raises(UnsupportedModelError) as caught:
        amp_rewrite.rewrite(module().eval(), example_kwargs=kwargs, target="bf16", capture="export")
    head = caught.value.message.split("; torch.compile")[0]
    line = next(i for i, text in enumerate(open(__file__).read().splitlines(), 1) if text.strip() == code)
    assert head.endswith(f" (caused by {__file__}:{line} in forward: {code})")


def test_the_export_cause_is_the_innermost_frame_outside_torch():
    """Strict export (dynamo) lists its own frame before the module's under 'from user code:'; a
    message with no traceback keeps its 'Caused by:' line."""
    from amp_rewrite.fx_api import _export_cause

    torch_file = torch.__file__.replace("__init__.py", "_dynamo/functional_export.py")
    text = ("Data-dependent branching\n\nfrom user code:\n"
            f'   File "{torch_file}", line 232, in forward\n    res = self._export_root(*args, **kwargs)\n'
            '  File "/src/model.py", line 8, in forward\n    if x.sum() > 0:\n       ^^^^^^^^^^^^\n'
            '  File "/src/block.py", line 3, in inner\n    return y.item()\n')
    assert _export_cause(RuntimeError(text)) == \
        "Data-dependent branching (caused by /src/block.py:3 in inner: return y.item())"
    plain = "Could not guard\nCaused by: (model.py:19 in forward)\nFor more information"
    assert _export_cause(RuntimeError(plain)) == "Could not guard (caused by model.py:19 in forward)"


class _GemmaRMSNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        f = x.float()  # (x is FP32 already: a no-op the rewrite removes)
        out = f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + 1e-6)
        return (out * (1.0 + self.weight.float())).type_as(x)


class _GemmaNormBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.norm = nn.Linear(8, 8), _GemmaRMSNorm(8)

    def forward(self, x):
        return self.norm(x + self.l1(x))


def test_a_dtype_reader_of_a_removed_conversion_keeps_the_type_it_made():
    """g = h.float() is removed because its IR reader (a Linear) runs low, but type_as(ones, g) reads
    g for its dtype: rewired to the bf16 h, it made a bf16 graph output of an FP32 one."""

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            g = self.a(x).float()
            return self.b(g), torch.ones(2, 8).type_as(g)

    x = torch.randn(2, 8)
    low = amp_rewrite.rewrite(M().eval(), example_inputs=(x,), target="bf16")
    low.graph.lint()
    with torch.no_grad():
        y, z = low(x)
    assert y.dtype == z.dtype == torch.float32


@pytest.mark.parametrize("capture", ["export", "symbolic_trace"])
def test_a_conversion_reported_removed_is_gone_from_the_graph(capture):
    """torch.export traces ``x.float()`` of an FP32 x as an alias of x, so ``type_as(x)`` read the
    conversion for its dtype: the report said 'removed' while the node stayed in the graph."""
    x = torch.randn(2, 8)
    model = _GemmaNormBlock().eval()
    gm, report = amp_rewrite.rewrite(model, example_inputs=(x,), target="fp16", capture=capture, report=True)
    removed = [c["name"].rsplit("/", 1)[-1] for c in report.to_dict()["casts"] if c["kind"] == "removed"]
    assert removed
    left = {n.name: [u.name for u in n.users] for n in gm.graph.nodes if n.name in removed}
    assert not left, f"reported removed, still in the graph (read by): {left}"
    gm.graph.lint()
    assert_dtypes_consistent(gm, (x,))
    with torch.no_grad():
        assert rel_err(gm(x), model(x)) <= TOL["fp16"]


class _BaddbmmMaskedDecoder(nn.Module):
    """Two attention layers adding an HF-style mask ((1 - allowed) * finfo(float32).min) with
    baddbmm: the mask is the bias input of an allow op, cast to the low type at run time."""

    def __init__(self, d: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.d, self.h = d, heads
        self.qkv = nn.ModuleList([nn.Linear(d, 3 * d) for _ in range(2)])
        self.o = nn.ModuleList([nn.Linear(d, d) for _ in range(2)])

    def forward(self, x, mask):
        b, t, d, h = 2, 5, self.d, self.h  # (sizes fixed: symbolic_trace cannot make torch.ones of a shape)
        allowed = torch.ones(t, t, dtype=torch.bool).tril()[None] & mask[:, None, :].bool()
        ext = ((1.0 - allowed.float()) * torch.finfo(torch.float32).min).repeat_interleave(h, 0)
        for qkv, o in zip(self.qkv, self.o):
            q, k, v = qkv(x).view(b, t, 3, h, d // h).permute(2, 0, 3, 1, 4).reshape(3, b * h, t, d // h)
            scores = torch.baddbmm(ext, q * (d // h) ** -0.5, k.transpose(1, 2))
            y = torch.bmm(scores.softmax(-1), v).view(b, h, t, d // h).transpose(1, 2).reshape(b, t, d)
            x = x + o(y)
        return x


@pytest.mark.parametrize("capture", ["export", "symbolic_trace"])
def test_a_mask_fill_an_allow_op_reads_is_clamped_before_its_cast(capture):
    """The mask (1 - allowed) * finfo.min fed baddbmm, an allow op, so it was cast to BF16 at run
    time: -inf, a left-padded row's pad queries gave NaN after the softmax, and the second layer
    spread it to every real token of that row (FP32 is finite). It is clamped first now, as the ONNX
    side clamps such a value and as a constant converted offline saturates; rewriting again changes
    nothing."""
    torch.manual_seed(0)
    model = _BaddbmmMaskedDecoder().eval()
    x = torch.randn(2, 5, 16)
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])  # row 1 left-padded
    gm = amp_rewrite.rewrite(model, example_inputs=(x, mask), target="bf16", capture=capture)
    with torch.no_grad():
        out, ref = gm(x, mask), model(x, mask)
    assert torch.isfinite(ref).all() and torch.isfinite(out).all()
    assert rel_err(out[0], ref[0]) < TOL["bf16"] and rel_err(out[1, 2:], ref[1, 2:]) < TOL["bf16"]
    assert any(n.meta.get("amp_rewrite", {}).get("inserted") == "saturate" for n in gm.graph.nodes)
    assert amp_rewrite.rewrite(gm, example_inputs=(x, mask), target="bf16").code == gm.code


_MIN = torch.finfo(torch.float32).min
_COMBINED_MASKS = {
    "causal + padding": lambda pad, causal: pad + causal,
    "padding + 0.0": lambda pad, causal: pad.expand(-1, 5, -1) + 0.0,
    "padding - 0 * causal": lambda pad, causal: pad - 0 * causal,
    "maximum(padding, finfo.min)": lambda pad, causal: torch.maximum(pad.expand(-1, 5, -1), torch.tensor(_MIN)),
    "minimum(padding, causal)": lambda pad, causal: torch.minimum(pad, causal),
}


class _CombinedMaskAttention(nn.Module):
    def __init__(self, combine) -> None:
        super().__init__()
        self.qkv, self.o, self.combine = nn.Linear(8, 24), nn.Linear(8, 8), combine
        self.register_buffer("causal", torch.triu(torch.full((5, 5), _MIN), 1))

    def forward(self, x, allowed):
        mask = self.combine((1.0 - allowed[:, None, :].float()) * _MIN, self.causal)
        for _ in range(2):  # (a second layer spreads a padded row's NaN to every token through P @ V)
            q, k, v = self.qkv(x).chunk(3, -1)
            x = x + self.o(torch.baddbmm(mask, q, k.transpose(1, 2), alpha=0.3).softmax(-1) @ v)
        return x


@pytest.mark.parametrize("combine", list(_COMBINED_MASKS))
def test_a_mask_sentinel_summed_or_compared_keeps_its_clamp_before_an_allow_op(combine):
    """A causal mask plus a padding mask (older HF decoders), ``p + 0.0``, OPT's ``torch.max(w,
    tensor(finfo.min))``: the sum kept FP32 but was no longer known to hold a sentinel, so its cast
    to baddbmm was bare, -inf, and a fully padded row NaN in every token after the second layer."""
    torch.manual_seed(0)
    model = _CombinedMaskAttention(_COMBINED_MASKS[combine]).eval()
    x, allowed = torch.randn(2, 5, 8), torch.tensor([[1, 1, 1, 1, 1], [0, 0, 0, 0, 0]])
    gm = amp_rewrite.rewrite(model, example_inputs=(x, allowed), target="fp16")
    with torch.no_grad():
        out, ref = gm(x, allowed), model(x, allowed)
    assert torch.isfinite(ref).all() and torch.isfinite(out).all()
    assert rel_err(out[0], ref[0]) < TOL["fp16"]
    assert any(n.meta.get("amp_rewrite", {}).get("inserted") == "saturate" for n in gm.graph.nodes)


_MORE_COMBINED_MASKS = {  # (found by mutation testing)
    "rsub(-padding, 0)": lambda pad, causal: torch.rsub(-pad, 0.0),
    "fmin(padding, causal)": lambda pad, causal: torch.fmin(pad, causal),
    "fmax(padding, finfo.min)": lambda pad, causal: torch.fmax(pad.expand(-1, 5, -1), torch.tensor(_MIN)),
    "max(padding, causal)": lambda pad, causal: torch.max(pad.expand(-1, 5, -1), causal),
}



@pytest.mark.parametrize("combine", list(_MORE_COMBINED_MASKS))
def test_more_mask_combinations_keep_their_clamp(combine):
    """(kills F9: rsub, F11: fmin/fmax, F13: two-tensor max) every op of _MAGNITUDE_KEEPING passes
    the sentinel on: the combined mask is clamped before baddbmm, not -inf (NaN in a padded row)."""
    torch.manual_seed(0)
    model = _CombinedMaskAttention(_MORE_COMBINED_MASKS[combine]).eval()
    x, allowed = torch.randn(2, 5, 8), torch.tensor([[1, 1, 1, 1, 1], [0, 0, 0, 0, 0]])
    gm = amp_rewrite.rewrite(model, example_inputs=(x, allowed), target="fp16")
    with torch.no_grad():
        out, ref = gm(x, allowed), model(x, allowed)
    assert torch.isfinite(ref).all() and torch.isfinite(out).all()
    assert (out[0] - ref[0]).abs().max() <= 5e-3 * ref[0].abs().max()
    assert any(n.meta.get("amp_rewrite", {}).get("inserted") == "saturate" for n in gm.graph.nodes)


class _MaskBufferAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)
        mask = torch.triu(torch.full((5, 5), _MIN), 1)
        mask[0] = _MIN  # (a padded query: a fully masked row)
        self.register_buffer("mask", mask.expand(2, 5, 5).contiguous())
        self.big = nn.Linear(8, 2)
        with torch.no_grad():
            self.big.weight[0, 0] = 1e5  # (past fp16's range: clamped to 65504, as the offline conversion does)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        h = torch.baddbmm(self.mask, q, k.transpose(1, 2), alpha=0.3).softmax(-1) @ v
        return self.big(h * 1e-3)


@pytest.mark.parametrize("training", [False, True])
def test_module_tensors_past_the_range_cast_at_use_are_clamped_as_converted_ones(training):
    """A mask buffer of finfo.min read by baddbmm, a Linear weight of 1e5: converted offline they
    saturate, but the training rewrite (FP32 master copies) and torch.compile cast them at use,
    where they became -inf (NaN in the masked row) and inf. The cast clamps them now; the answer
    is the inference rewrite's."""
    torch.manual_seed(0)
    model, x = _MaskBufferAttention().eval(), torch.randn(2, 5, 8)
    gm = amp_rewrite.rewrite(model, example_inputs=(x,), target="fp16", training=training)
    with torch.no_grad():
        out, ref = gm(x), model(x)
        inference = amp_rewrite.rewrite(model, example_inputs=(x,), target="fp16")(x)
    assert torch.isfinite(ref).all() and torch.isfinite(out).all()
    assert (out - inference).abs().max() <= 1e-2 * inference.abs().max()
    if training:
        saturated = [n.args[0].name for n in gm.graph.nodes if n.meta.get("amp_rewrite", {}).get("inserted") == "saturate"]
        assert {"mask", "big_weight"} <= set(saturated)


class _UnreadTensors(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1, self.aux_head = nn.Linear(16, 16), nn.Linear(16, 3)  # (the head unused at inference)
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16)))
        self.register_buffer("scale", torch.tensor(1.0))
        self.register_buffer("cache", torch.zeros(2), persistent=False)

    def forward(self, x):
        return self.l1(x + (self.inv_freq * self.scale).repeat(2))  # (from buffers alone: computed while tracing)


@pytest.mark.parametrize("training", [False, True])
def test_symbolic_trace_keeps_the_tensors_its_graph_does_not_read(training):
    """symbolic_trace copies only the tensors its graph reads: an unused head and the buffers a
    table computed while tracing came from were gone, so the original's checkpoint failed a strict
    load (unexpected keys). They stay registered, with their persistence and order, and the
    report says the folded table does not follow them."""
    torch.manual_seed(0)
    model, x = _UnreadTensors().eval(), torch.randn(2, 16)
    gm, report = amp_rewrite.rewrite(model, example_inputs=(x,), target="bf16", training=training,
                                     capture="symbolic_trace", report=True)
    assert list(gm.state_dict()) == list(model.state_dict())
    gm.load_state_dict(model.state_dict())  # (strict)
    assert "cache" in dict(gm.named_buffers()) and "cache" not in gm.state_dict()
    assert any("'inv_freq', 'scale'" in n and "are not read by the traced graph" in n and "capture='export'" in n
               for n in report.log.notes)
    with torch.no_grad():
        assert rel_err(gm(x), model(x)) < TOL["bf16"]


def test_a_module_torch_cannot_deep_copy_is_refused_with_the_way_out():
    """The hook-based weight_norm keeps a computed (non-leaf) weight on the module after a forward;
    the symbolic_trace capture's private copy raised torch's own RuntimeError."""
    from torch.nn.utils import weight_norm

    from amp_rewrite.errors import UnsupportedModelError

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # (torch deprecates the hook-based form)
        model = nn.Sequential(weight_norm(nn.Linear(4, 4)), nn.Tanh(), nn.Linear(4, 2))
    x = torch.randn(3, 4)
    model(x)
    with pytest.raises(UnsupportedModelError, match=r"cannot be copied .*parametrizations\.weight_norm"):
        amp_rewrite.rewrite(model, example_inputs=(x,), capture="symbolic_trace")
    gm = amp_rewrite.rewrite(model, example_inputs=(x,), capture="export", target="bf16")
    with torch.no_grad():
        assert rel_err(gm(x), model(x)) < TOL["bf16"]


@pytest.mark.parametrize("training", [False, True])
def test_dynamic_shapes_keep_an_exported_batch_dynamic(training):
    """torch.export holds the example inputs' sizes: a rewrite with batch 8 failed torch's guard on a
    last batch of 3, and rewrite() refused dynamic_shapes as an unknown option."""
    from torch.export import Dim

    from amp_rewrite.errors import UsageError

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).train(training)
    x = torch.randn(8, 4)
    gm, result = amp_rewrite.rewrite(model, example_inputs=(x,), target="bf16", report=True,
                                     training=training, dynamic_shapes={"input": {0: Dim.AUTO}})
    small = torch.randn(3, 4)
    assert rel_err(gm(small), model(small)) < TOL["bf16"]
    assert not [n for n in result.log.notes if "dynamic_shapes=" in n]
    _, static = amp_rewrite.rewrite(model, example_inputs=(x,), target="bf16", report=True, training=training)
    assert [n for n in static.log.notes if "a call with another batch size fails" in n]
    with pytest.raises(UsageError, match="dynamic_shapes is torch.export's"):
        amp_rewrite.rewrite(model, example_inputs=(x,), capture="symbolic_trace", dynamic_shapes={"input": {0: Dim.AUTO}})
    # a spec export refuses is the caller's mistake: no silent fallback to symbolic_trace
    with pytest.raises(UsageError, match="could not capture Sequential with the dynamic_shapes given"):
        amp_rewrite.rewrite(model, example_inputs=(x,), dynamic_shapes={"wrong_name": {0: Dim.AUTO}})


def test_an_export_of_a_one_dimensional_input_notes_its_fixed_size():
    """An export capture without dynamic_shapes holds every sized input's size, a 1-D one's too:
    the report's notes say a call with another size fails torch's guard."""
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    _, result = amp_rewrite.rewrite(model, example_inputs=(torch.randn(4),), target="bf16", report=True)
    assert [n for n in result.log.notes if "a call with another batch size fails" in n]


@pytest.mark.parametrize("training", [False, True])
def test_a_qat_leaf_module_is_not_taken_for_its_nn_namesake(training):
    """torch.ao.nn.qat.Linear/Conv2d stay single module calls under symbolic_trace and were given
    nn.Linear's and nn.Conv2d's rules by class name: their weights went low, and their fake-quant
    observer (FP32 only) refused them on the first call ("expected scalar type Float but found
    Half"), while the summary said the GEMMs ran in fp16."""
    import torch.ao.nn.qat as nnqat
    import torch.ao.quantization as tq

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            qconfig = tq.get_default_qat_qconfig("fbgemm")
            self.conv = nnqat.Conv2d(3, 8, 3, padding=1, qconfig=qconfig)
            self.fc = nnqat.Linear(8, 4, qconfig=qconfig)
            self.head = nn.Linear(4, 4)

        def forward(self, x):
            return self.head(self.fc(self.conv(x).mean((2, 3))))

    torch.manual_seed(0)
    model, x = Net().train(training), torch.randn(2, 3, 8, 8)
    model(x)  # (the observers take their shapes from a first call)
    gm, report = amp_rewrite.rewrite(copy.deepcopy(model), example_inputs=(x,), capture="symbolic_trace",
                                     target="bf16", training=training, report=True)
    gm.graph.lint()
    assert gm.conv.weight.dtype == gm.fc.weight.dtype == torch.float32
    assert rel_err(gm(x), copy.deepcopy(model)(x)) < TOL["bf16"]
    assert any("qat" in op for op in report.log.unlisted_ops)


def test_loading_a_checkpoint_warns_when_a_low_copy_is_clamped():
    """A weight read by a low op and an FP32 one keeps its FP32 original and a low copy: loading a
    checkpoint refreshed the copy clamped at 65504, without the warning a converted weight gives."""
    class Both(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l = nn.Linear(8, 8)

        def forward(self, x):
            return self.l(x) + self.l.weight.pow(2).sum() * 0

    torch.manual_seed(0)
    model, x = Both().eval(), torch.randn(2, 8)
    gm = amp_rewrite.rewrite(model, example_inputs=(x,), target="fp16", capture="symbolic_trace")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["l.weight"][0, 0] = 1e5
    with pytest.warns(RuntimeWarning, match=r"'l.weight' holds 1 value\(s\) beyond float16's range"):
        gm.load_state_dict(state)
    assert gm.l.weight.dtype == torch.float32 and gm.l.weight[0, 0].item() == 1e5


class _Hooked(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x)


def test_hooks_on_the_module_itself_are_not_dropped_silently():
    """symbolic_trace traces forward without the module's own hooks (its submodules' run inside and
    are traced): the rewritten module ran without them, 10 off, silently (also after the auto
    fallback). Refused, naming what keeps them; export keeps them."""
    torch.manual_seed(0)
    x = torch.randn(2, 8)
    model = _Hooked()
    model.register_forward_hook(lambda m, args, out: out + 10.0)
    with pytest.raises(UnsupportedModelError, match=r"forward hooks registered on itself.*capture='export'"):
        amp_rewrite.rewrite(model, example_inputs=(x,), target="bf16", capture="symbolic_trace")
    gm = amp_rewrite.rewrite(copy.deepcopy(model), example_inputs=(x,), target="bf16", capture="export")
    torch.testing.assert_close(gm(x), model(x), rtol=5e-2, atol=5e-2)


def test_a_pre_hook_on_the_module_itself_is_not_dropped_silently():
    """A forward pre-hook on the module itself runs before its forward, which symbolic_trace
    traces without it: that capture is refused, naming the pre-hook; export keeps it."""
    torch.manual_seed(0)
    x = torch.randn(2, 8)
    model = _Hooked()
    model.register_forward_pre_hook(lambda m, args: (args[0] * 2.0,))
    with pytest.raises(UnsupportedModelError, match=r"forward pre-hooks registered on itself.*capture='export'"):
        amp_rewrite.rewrite(model, example_inputs=(x,), target="bf16", capture="symbolic_trace")
    gm = amp_rewrite.rewrite(copy.deepcopy(model), example_inputs=(x,), target="bf16", capture="export")
    torch.testing.assert_close(gm(x), model(x), rtol=5e-2, atol=5e-2)


class _MaskedMaxPool(nn.Module):
    def __init__(self, fill: float) -> None:
        super().__init__()
        self.fc, self.fc2, self.fill = nn.Linear(8, 8), nn.Linear(8, 4), fill

    def forward(self, x, m):
        mx = self.fc(x).masked_fill(~m[..., None], self.fill).amax(1)  # masked max over time
        mx = mx.masked_fill(mx == self.fill, 0.0)  # a fully masked row -> 0
        return self.fc2(mx)


@pytest.mark.parametrize(("target", "fill"), [("bf16", -1e4), ("bf16", -1e9), ("fp16", -0.1)])
def test_a_comparison_of_low_values_with_a_constant_compares_in_the_low_type(target, fill):
    """Greedy (the torch default) left `mx == fill` FP32 and cast mx up: the bf16-rounded fill
    (-9984) never equalled -1e4, the guard for fully masked rows missed and the fill went into the
    next Linear (error 3600; 1.7e9 for -1e9). torch.autocast compares in the operand's type."""
    torch.manual_seed(0)
    module = _MaskedMaxPool(fill).eval()
    x, m = torch.randn(3, 5, 8), torch.ones(3, 5, dtype=torch.bool)
    m[2] = False
    with torch.no_grad():
        ref = module(x, m)
    for placement in ("greedy", "optimal"):
        gm = amp_rewrite.rewrite(module, example_inputs=(x, m), target=target, placement=placement)
        gm.graph.lint()
        with torch.no_grad():
            out = gm(x, m)
        assert (out - ref).abs().max().item() < 1e-2, placement


class _EpsilonGuard(nn.Module):
    """``r / (r + eps)`` or ``r / clamp_min(r, eps)`` after a relu, as a number or a buffer."""

    def __init__(self, how: str, eps: float) -> None:
        super().__init__()
        self.l1, self.l2, self.how = nn.Linear(8, 8), nn.Linear(8, 8), how
        self.register_buffer("eps", torch.tensor(eps))
        self.number = eps

    def forward(self, x):
        r = torch.relu(self.l1(x))
        guarded = {"add": lambda: r + self.number, "add buffer": lambda: r + self.eps,
                   "clamp": lambda: torch.clamp(r, min=self.number), "clamp_min": lambda: r.clamp_min(self.number),
                   "maximum buffer": lambda: torch.maximum(r, self.eps),
                   "where": lambda: torch.where(r > 0, r, self.number),
                   # the guard's own test against the epsilon: in FP16 ``r < 0``, never true of a zero
                   "where below": lambda: torch.where(r < self.number, torch.full_like(r, self.number), r),
                   "where below buffer": lambda: torch.where(r < self.eps, self.eps, r),
                   "masked_fill": lambda: r.masked_fill(r == 0, self.number),
                   "rsub": lambda: -torch.rsub(r, -self.number), "full_like": lambda: r + torch.full_like(r, self.number),
                   "add alpha": lambda: torch.add(r, self.number * 1e4, alpha=1e-4),
                   # the epsilon in a tensor: scaled by alpha/value, made in forward, read through a copy
                   "alpha tensor": lambda: torch.add(r, torch.ones_like(r), alpha=self.number),
                   "addcmul": lambda: torch.addcmul(r, torch.ones_like(r), torch.ones_like(r), value=self.number),
                   "addcdiv": lambda: torch.addcdiv(r, torch.ones_like(r), torch.ones_like(r), value=self.number),
                   "ones times": lambda: r + torch.ones(8) * self.number,
                   "scalar_tensor": lambda: r + torch.scalar_tensor(self.number),
                   "fill_": lambda: r + torch.zeros_like(r).fill_(self.number),
                   "buffer to": lambda: r + self.eps.to(r.dtype),
                   "buffer detach": lambda: r + self.eps.detach()}[self.how]()
        return self.l2(r / guarded)


@pytest.mark.parametrize("capture", ["symbolic_trace", "export"])
@pytest.mark.parametrize("placement", ["optimal", "greedy"])
@pytest.mark.parametrize("how", ["add", "add buffer", "clamp", "clamp_min", "maximum buffer", "where", "where below",
                                 "where below buffer", "masked_fill",
                                 "rsub", "full_like", "add alpha", "alpha tensor", "addcmul", "addcdiv", "ones times",
                                 "scalar_tensor", "fill_", "buffer to", "buffer detach"])
def test_an_epsilon_the_low_type_flushes_to_zero_keeps_its_guard_fp32_in_torch(how, placement, capture):
    """The torch side of the ONNX frontend's epsilon test: 1e-8 is 0 in FP16 (its smallest value is
    6e-8), so ``r + 1e-8`` or ``clamp_min(r, 1e-8)`` in FP16 was 0 wherever the relu was, and the
    division 0/0 = NaN, where FP32 is finite. The guard now keeps FP32 (a deny seed that the
    division follows), and the reason says why; 1e-3 (which FP16 holds) and BF16 go low."""
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    model = _EpsilonGuard(how, 1e-8).eval()
    result = _dispatch(model, example_inputs=(x,), target="fp16", capture=capture, placement=placement)
    with torch.no_grad():
        want, got = model(x), result.model(x)
    assert (want == 0).any() or (torch.relu(model.l1(x)) == 0).any()  # (a zero the epsilon guards)
    assert torch.isfinite(got).all() and rel_err(got, want) < TOL["fp16"]
    kept = [d for d in result.log.decisions.values() if "epsilon is lost" in d.reason]
    assert kept and all(d.precision == Precision.FP32 for d in kept)
    for eps, target in ((1e-3, "fp16"), (1e-8, "bf16")):
        other = _dispatch(_EpsilonGuard(how, eps).eval(), example_inputs=(x,), target=target, capture=capture,
                          placement=placement)
        assert not [d for d in other.log.decisions.values() if "epsilon is lost" in d.reason]


class _TiedHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.l = nn.Linear(8, 8)
        self.out = nn.Linear(8, 10, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, t):
        return self.out(torch.tanh(self.l(self.emb(t))))


def _held_bytes(module: nn.Module) -> int:
    seen, total = set(), 0
    for t in [*module.parameters(), *module.buffers()]:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


@pytest.mark.parametrize("capture", ["export", "symbolic_trace"])
def test_a_tied_weight_counts_once_in_the_weight_bytes(capture):
    """An embedding tied to the output projection is one tensor under two names: the report
    counted it twice before (928 B for a module holding 608 B), and showed a saving where the
    weights grew. Bytes before and after are what the modules hold."""
    torch.manual_seed(0)
    model = _TiedHead().eval()
    gm, report = amp_rewrite.rewrite(model, example_inputs=(torch.tensor([[1, 2, 3]]),), target="fp16",
                                     capture=capture, report=True)
    weights = report.summary()["weights"]
    assert (weights["bytes_before"], weights["bytes_after"]) == (_held_bytes(model), _held_bytes(gm))
    assert gm.get_parameter("emb.weight") is gm.get_parameter("out.weight")  # (converted once, still tied)


class _FillPastTheRange(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        with torch.no_grad():
            self.b.weight.copy_(torch.eye(8) * 0.01)
            self.b.bias.zero_()

    def forward(self, x, keep):
        return self.b(self.a(x).masked_fill(~keep, -70000.0))


@pytest.mark.parametrize("capture", ["export", "symbolic_trace"])
def test_a_fill_past_the_range_that_reaches_a_low_linear_is_clamped_before_its_cast(capture):
    """``masked_fill(-70000)`` keeps FP32 (FP16 cannot hold its number), and its output went to an
    FP16 linear through a plain ``.to()``: -inf, and -inf × 0 NaN in every row with a fill. The
    cast now reads it clamped to ±65504, as a constant converted offline is."""
    torch.manual_seed(0)
    model = _FillPastTheRange().eval()
    x, keep = torch.randn(2, 8), torch.rand(2, 8) > 0.5
    result = _dispatch(model, example_inputs=(x, keep), target="fp16", capture=capture)
    with torch.no_grad():
        want, got = model(x, keep), result.model(x, keep)
    assert torch.isfinite(got).all()
    assert (got - want).abs().max() <= 0.1 * want.abs().max()  # (-65504 for -70000: 6.4%, not NaN)
    assert any("clamped to ±65504 first" in c.reason for c in result.log.casts)


class _SquaredReLU(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.fc, self.pr, self.how = nn.Linear(8, 16), nn.Linear(16, 8), how

    def forward(self, x):
        h = torch.relu(self.fc(x) * 300)  # up to ~1000: fine in FP16
        if self.how == "einsum":  # (an Einsum of a value with itself under one subscript: squares)
            h = torch.einsum("bd,bd->bd", h, h)
        else:  # up to ~1e6: past FP16's 65504
            h = torch.square(h) if self.how == "square" else h * h
        return self.pr(h * 1e-4)


@pytest.mark.parametrize("capture", ["symbolic_trace", "export"])
@pytest.mark.parametrize("how", ["square", "mul", "einsum"])
def test_a_square_written_as_square_or_a_product_is_held_fp32_like_pow(how, capture):
    """``torch.square(h)`` and ``h * h`` ran FP16 (both were infer) while ``h.pow(2)`` is held FP32:
    a squared-ReLU MLP overflowed to inf. Both now take pow's verdict."""
    torch.manual_seed(0)
    x = torch.randn(2, 8)
    model = _SquaredReLU(how).eval()
    gm, report = amp_rewrite.rewrite(model, example_inputs=(x,), target="fp16", capture=capture, report=True)
    squares = [d for d in report.log.decisions.values()
               if d.op == "square" or (d.op in ("mul", "einsum") and d.reason.startswith("a square"))]
    assert len(squares) == 1 and squares[0].precision == Precision.FP32 and "256" in squares[0].reason
    got, want = gm(x).float(), model(x)
    assert torch.isfinite(got).all()
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-2


class _InPlacePow(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        y = self.l1(x).clone()
        y.pow_(2)  # (a hand-written variance or squared ReLU, in place)
        return self.l2(y)


@pytest.mark.parametrize("placement", ["greedy", "optimal"])
def test_an_in_place_op_made_out_of_place_takes_the_overload_with_its_arguments(placement):
    """aten.pow_.Scalar(Tensor self, Scalar exponent) was made out of place as aten.pow.Scalar, which
    is (Scalar self, Tensor exponent): the exported rewrite failed on every call. Its twin is the
    overload taking the same arguments, pow.Tensor_Scalar."""
    torch.manual_seed(0)
    x, model = torch.randn(2, 4), _InPlacePow().eval()
    gm = amp_rewrite.rewrite(model, example_inputs=(x,), target="fp16", capture="export", placement=placement)
    assert torch.allclose(gm(x).float(), model(x), atol=1e-2, rtol=1e-2)
    gm.graph.lint()


_TORCH_SQUARES = {
    "addcmul": lambda h: torch.addcmul(torch.zeros_like(h), h, h),  # (Adam's second moment)
    "detach": lambda h: h * h.detach(),
    "view": lambda h: h * h.view(h.shape),
    "vecdot": lambda h: torch.linalg.vecdot(h, h).unsqueeze(-1).expand_as(h),
    "einsum": lambda h: torch.einsum("bd,bd->bd", h, h),
    # the same view or pure op on both sides, and an expand to the same shape: each was FP16 and inf
    "expand_as": lambda h: h * h.expand_as(h),
    "reshape twice": lambda h: (h.reshape(4, 8) * h.reshape(4, 8)).reshape(2, 16),
    "unsqueeze twice": lambda h: (h.unsqueeze(-1) * h.unsqueeze(-1)).squeeze(-1),
    "abs twice": lambda h: h.abs() * h.abs(),
    "relu twice": lambda h: torch.relu(h) * torch.relu(h),
}


class _Squares(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.fc, self.pr, self.how = nn.Linear(8, 16), nn.Linear(16, 8), how

    def forward(self, x):
        h = self.fc(x) * 600  # |h| up to ~1000: its square passes FP16's 65504
        return self.pr(_TORCH_SQUARES[self.how](h) * 1e-6)


@pytest.mark.parametrize("capture, decompose", [("symbolic_trace", False), ("export", False), ("export", True)])
@pytest.mark.parametrize("how", sorted(_TORCH_SQUARES))
def test_a_torch_square_through_a_copy_or_a_fused_op_is_held_fp32(how, capture, decompose):
    """Squares that were no square to the rewrite ran FP16 and overflowed: addcmul(z, h, h), h times
    a copy or same-shape view of itself, vecdot(h, h), and what decompositions write for them
    (mul(mul(h, 1), h); two identical permutes of h multiplied); h times its expand_as(h), and the
    same view or pure op applied to h on both sides (abs(h) * abs(h))."""
    torch.manual_seed(0)
    x, model = torch.randn(2, 8), _Squares(how).eval()
    want = model(x)
    gm = amp_rewrite.rewrite(model, example_inputs=(x,), target="fp16", capture=capture, decompose=decompose)
    got = gm(x).float()
    assert torch.isfinite(got).all()
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-2


class _WeightPenalty(nn.Module):
    """A loss with an L2 penalty on a weight, as vecdot(p, p): the square of a parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.p = nn.Parameter(torch.full((64,), 300.0))

    def forward(self, x, y):
        return F.mse_loss(self.fc(x), y) + 1e-9 * torch.linalg.vecdot(self.p, self.p)


@pytest.mark.parametrize("training", [False, True])
def test_a_square_of_a_parameter_is_held_fp32_as_an_activations_is(training):
    """vecdot(p, p) of a parameter ran FP16: a square of constants is the ONNX constant folder's
    business, and a parameter counted as one, but nothing folds it in torch (and in training it is
    no constant): 300^2 summed 64 times was inf, the loss inf where FP32 gives 5.8."""
    torch.manual_seed(0)
    model, x, y = _WeightPenalty(), torch.randn(2, 8), torch.randn(2, 8)
    want = model(x, y)
    gm, report = amp_rewrite.rewrite(model, example_inputs=(x, y), target="fp16", training=training, report=True)
    got = gm(x, y).float() / float(getattr(gm, "amp_loss_scale", 1.0))
    assert torch.isfinite(got).all() and abs(got.item() - want.item()) <= 1e-2 * abs(want.item())
    [vecdot] = [d for d in report.log.decisions.values() if d.op == "linalg_vecdot"]
    assert vecdot.precision == Precision.FP32 and "a square" in vecdot.reason


class _Fenced(nn.Module):
    """A Gram matrix fenced off FP32 with autocast(enabled=False), or a frozen teacher under
    no_grad; ``fallback``: a data-dependent helper makes torch.export fail (capture='auto' then
    falls back to symbolic_trace)."""

    def __init__(self, block: str):
        super().__init__()
        self.fc, self.teacher, self.block = nn.Linear(8, 8), nn.Linear(8, 8), block

    def forward(self, x):
        h = self.fc(x)
        if self.block == "autocast":
            with torch.autocast("cpu", enabled=False):
                g = h.float().T @ h.float()
            return g.sum()
        with torch.no_grad():
            t = self.teacher(x)
        return ((h - t) ** 2).mean()


@pytest.mark.parametrize("block, training", [("autocast", False), ("no_grad", True)])
def test_symbolic_trace_refuses_a_block_it_would_drop(block, training):
    """symbolic_trace runs a torch.autocast region and a torch.no_grad() block while tracing and
    records neither: the fenced Gram matrix ran FP16 (inf), and in training the frozen teacher
    got gradients that the optimizer applied. Refused, pointing at torch.export; export keeps them.
    (An inference rewrite loses nothing with a no_grad block: not refused.)"""
    x = torch.randn(4, 8)
    with pytest.raises(UnsupportedModelError, match=r"_Fenced\.forward has a torch\.(autocast region|no_grad).*capture='export'"):
        _dispatch(_Fenced(block), example_inputs=(x,), capture="symbolic_trace", training=training, target="bf16")
    if block == "no_grad":
        _dispatch(_Fenced(block).eval(), example_inputs=(x,), capture="symbolic_trace", target="bf16")
    result = _dispatch(_Fenced(block), example_inputs=(x,), capture="export", training=training, target="bf16")
    result.model.graph.lint()


def test_torch_rewrites_in_several_threads_give_the_sequential_results():
    """torch.export and fx.symbolic_trace change process-wide state: four threads rewriting at once
    failed ('_EXPORT_MODULE_HIERARCHY must not be None', 'module is not installed as a
    submodule'), blaming the model or its inputs, or fell back to symbolic_trace silently. Torch
    rewrites now run one at a time; a thread's own no_grad does not count as the traced model's."""
    import threading

    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Softmax(-1)).eval()

    x = torch.randn(2, 8)
    want = {capture: _dispatch(model(), example_inputs=(x,), capture=capture, target="bf16", training=False)
            for capture in ("export", "symbolic_trace")}
    got, errors, stop = [], [], threading.Event()

    def work(capture):
        try:
            got.append((capture, _dispatch(model(), example_inputs=(x,), capture=capture, target="bf16")))
        except Exception as exc:  # noqa: BLE001 - collected for the assertion
            errors.append(exc)

    def inference():
        layer = nn.Linear(8, 8)
        while not stop.is_set():
            with torch.no_grad():
                layer(x)

    side = threading.Thread(target=inference)
    side.start()
    threads = [threading.Thread(target=work, args=(c,)) for c in ("export", "symbolic_trace") * 3]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    side.join()
    assert not errors, errors
    for capture, result in got:
        assert result.model.code == want[capture].model.code
        assert result.report.to_dict()["nodes"] == want[capture].report.to_dict()["nodes"]


@pytest.mark.parametrize("capture", ["export", "symbolic_trace"])
def test_a_sparse_buffer_is_read_by_its_stored_values(capture):
    """A GCN's sparse adjacency buffer: the range check ran aminmax on it (no sparse kernel: a raw
    NotImplementedError), and symbolic_trace's buffer restore torch.equal (called a problem with
    the example inputs)."""

    class GCN(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)
            self.register_buffer("adj", torch.eye(6).to_sparse())

        def forward(self, x):
            return torch.sparse.mm(self.adj, self.fc(x)).relu()

    torch.manual_seed(0)
    model, x = GCN().eval(), torch.randn(6, 8)
    gm = _dispatch(model, example_inputs=(x,), capture=capture, target="bf16").model
    gm.graph.lint()
    assert rel_err(gm(x), model(x)) < TOL["bf16"]


def test_a_rewrite_inside_inference_mode_works_under_symbolic_trace():
    """The private copy made under torch.inference_mode holds inference tensors, which have no
    version counter: reading it was a raw RuntimeError ('Inference tensors do not track version
    counter')."""
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)).eval(), torch.randn(2, 8)
    with torch.inference_mode():
        gm = _dispatch(model, example_inputs=(x,), capture="symbolic_trace", target="bf16").model
        out = gm(x)
    assert rel_err(out, model(x)) < TOL["bf16"]


class _CatScale(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        return torch.cat([h, h * x], dim=-1)


@pytest.mark.parametrize("capture", ["export", "symbolic_trace"])
@pytest.mark.parametrize("op, name", [("cat", "tensors.1"), ("mul", "other")])
def test_one_torch_rule_file_names_arguments_alike_under_either_capture(tmp_path, capture, op, name):
    """Under symbolic_trace the arguments of torch.cat were named by position ('0.1' for the
    README's 'tensors.1') and operator.mul's by Python's spelling ('a', 'b' for 'self', 'other'):
    a rule file written for one capture was refused under the other. Both now take the aten op's
    schema names."""
    rules = tmp_path / "r.toml"
    rules.write_text(f'[ruleset]\nname = "r"\nfrontend = "torch"\nextends = "torch-bf16"\n'
                     f'[infer.{op}]\nreason = "mine"\nfp32_inputs = ["{name}"]\n')
    x = torch.randn(2, 8)
    gm, report = amp_rewrite.rewrite(_CatScale().eval(), example_inputs=(x,), rules=[rules], capture=capture,
                                     target="bf16", report=True)
    gm.graph.lint()
    assert f"input '{name}' is pinned FP32 by the rules" in json.dumps(report.to_dict())


def test_an_op_flag_naming_an_op_the_torch_model_lacks_is_said():
    """fp16_ops=["softmax"] on a module without one changed nothing, silently, where the ONNX path
    says so: the note was ONNX-only."""
    model, x = nn.Sequential(nn.Linear(8, 8), nn.ReLU()).eval(), torch.randn(2, 8)
    _, report = amp_rewrite.rewrite(model, example_inputs=(x,), target="bf16", fp16_ops=["softmax"], report=True)
    assert [n for n in report.log.notes if n.startswith("unmatched:")] == [
        "unmatched: --fp16-ops 'softmax' names an op this model does not have, so it changes nothing"]
    _, report = amp_rewrite.rewrite(model, example_inputs=(x,), target="bf16", fp32_ops=["relu"], report=True)
    assert not [n for n in report.log.notes if n.startswith("unmatched:")]


@pytest.mark.parametrize("capture", ["export", "symbolic_trace"])
def test_a_deep_copy_keeps_its_low_copies_in_step_with_its_weights(capture):
    """copy.deepcopy (an EMA or teacher model) lost the forward hook that makes a low copy again
    after an in-place write: the copy's low readers went on with the weights it was made with."""
    torch.manual_seed(0)
    model, x = _ConvertedAndCopied().eval(), torch.randn(4, 8)
    twin = copy.deepcopy(amp_rewrite.rewrite(model, example_inputs=(x,), target="bf16", capture=capture))
    with torch.no_grad():
        w = torch.randn(8, 8) * 0.3
        twin.l.weight.copy_(w)
        model.l.weight.copy_(w)
        assert rel_err(twin(x), model(x)) < TOL["bf16"]


@pytest.mark.parametrize("capture", ["export", "symbolic_trace"])
def test_a_weight_read_low_and_fp32_gets_its_whole_gradient(capture):
    """The low copy is made without grad: backward through an inference rewrite gave l.weight only
    the share of its FP32 reader (the sum), silently; the low reader now reads a cast made in the
    forward while autograd records, and the cached copy is back in place after it."""
    torch.manual_seed(0)
    model, x = _ConvertedAndCopied().eval(), torch.randn(4, 8)
    gm = amp_rewrite.rewrite(copy.deepcopy(model), example_inputs=(x,), target="bf16", capture=capture)
    cached = {name: b for name, b in gm.named_buffers() if "_amp_" in name}
    assert cached
    gm(x).square().sum().backward()
    model(x).square().sum().backward()
    got, want = gm.get_parameter("l.weight").grad, model.l.weight.grad
    assert float((got - want).abs().max()) <= 3e-2 * float(want.abs().max())
    assert {name: b for name, b in gm.named_buffers() if "_amp_" in name} == cached  # (the same tensors)
    assert all(b.grad_fn is None for b in cached.values())


def test_torch_func_transforms_run_over_a_weight_read_low_and_fp32():
    """torch.func.grad / vmap over functional_call crashed inside the refresh hook (an in-place
    copy and a data-dependent check inside the transform)."""
    torch.manual_seed(0)
    model, x = _ConvertedAndCopied().eval(), torch.randn(4, 8)
    gm = amp_rewrite.rewrite(copy.deepcopy(model), example_inputs=(x,), target="bf16")
    w = torch.randn(8, 8) * 0.3
    got = torch.func.grad(lambda w: torch.func.functional_call(gm, {"l.weight": w}, (x,)).sum())(w)
    want = torch.func.grad(lambda w: torch.func.functional_call(model, {"l.weight": w}, (x,)).sum())(w)
    assert float((got - want).abs().max()) <= 3e-2 * float(want.abs().max())
    stacked = torch.randn(3, 8, 8) * 0.3
    got = torch.func.vmap(lambda w: torch.func.functional_call(gm, {"l.weight": w}, (x,)))(stacked)
    want = torch.func.vmap(lambda w: torch.func.functional_call(model, {"l.weight": w}, (x,)))(stacked)
    assert rel_err(got, want) < TOL["bf16"]


class _SharedWeightNet(nn.Module):
    """a.weight is read by its Linear (low) and by a norm (FP32): the rewrite keeps a low copy and
    calls the Linear through functional_call."""

    def __init__(self):
        super().__init__()
        self.a, self.ln, self.b = nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 8)

    def forward(self, x):
        return self.b(self.ln(F.gelu(self.a(x)))) + self.a.weight.norm()


@pytest.mark.parametrize("training", [False, True])
def test_a_symbolic_trace_rewrite_with_cast_parameters_can_be_jit_traced_and_legacy_exported(training):
    """torch.jit.trace and torch.onnx.export(dynamo=False) crashed with torch's 'The stateless API
    can't be used with Jitted modules' from inside amp-rewrite on a submodule called with cast
    parameters; under tracing the common leaves now run their functional form, and the traced
    graph casts the weight itself (it keeps no hook to refresh a copy), so it follows the weight."""
    import io

    torch.manual_seed(0)
    x = torch.randn(4, 16)
    model = _SharedWeightNet().train(training)
    options = {"training": True, "loss_scaling": False} if training else {}
    gm = amp_rewrite.rewrite(model, example_inputs=(x,), target="fp16", capture="symbolic_trace", **options)
    assert any(getattr(n.target, "__name__", "") == "functional_call" for n in gm.graph.nodes)
    traced = torch.jit.trace(gm, (x,))
    torch.testing.assert_close(traced(x), gm(x))
    with torch.no_grad():
        gm.a.weight.mul_(2.0)  # (the traced module shares the parameters)
    torch.testing.assert_close(traced(x), gm(x))
    buffer = io.BytesIO()
    torch.onnx.export(gm, (x,), buffer, dynamo=False)
    assert len(buffer.getvalue()) > 0


def test_tracing_a_submodule_call_with_no_functional_form_is_refused_clearly():
    """A leaf amp-rewrite has no functional form for (here a ConvTranspose1d in a training rewrite)
    cannot be traced through functional_call: one clear error, not torch's stateless-API one."""
    net = nn.Sequential(nn.Conv1d(2, 4, 3), nn.ConvTranspose1d(4, 2, 3)).train()
    x = torch.randn(2, 2, 8)
    gm = amp_rewrite.rewrite(net, example_inputs=(x,), target="fp16", capture="symbolic_trace", training=True,
                             loss_scaling=False)
    with pytest.raises(UnsupportedModelError, match="no functional form of ConvTranspose1d.*dynamo=True"):
        torch.jit.trace(gm, (x,))


class _OptionalMask(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 4)

    def forward(self, x, mask=None):
        h = self.a(x)
        if mask is not None:
            h = h + mask
        return h


@pytest.mark.parametrize("kwargs", [{}, {"example_kwargs": {"mask": None}}])
def test_symbolic_trace_takes_an_optional_argument_the_examples_leave_none_as_none(kwargs):
    """forward(x, mask=None) with ``if mask is not None``: symbolic_trace fed mask a Proxy, traced
    the branch the examples do not take, and the rewrite blamed the example inputs ('do not run
    through the module'), which run fine. mask is now traced as None, said in a note; the rewrite
    takes mask=None by keyword and refuses a mask, as torch.fx's check does."""
    torch.manual_seed(0)
    x = torch.randn(4, 16)
    model = _OptionalMask().eval()
    gm, report = amp_rewrite.rewrite(model, example_inputs=(x,), capture="symbolic_trace", target="bf16",
                                     report=True, **kwargs)
    gm.graph.lint()
    torch.testing.assert_close(gm(x), model(x), atol=5e-2, rtol=5e-2)
    torch.testing.assert_close(gm(x, mask=None), gm(x))
    with pytest.raises(AssertionError, match="mask has been specialized to have value None"):
        gm(x, mask=torch.ones(4))
    assert any(n.startswith("symbolic_trace: traced with mask=None") for n in report.log.notes), report.log.notes


def test_a_hook_on_an_export_captures_submodule_is_refused_not_silently_ignored():
    """The default (torch.export) capture's submodules only hold parameters: a forward hook or
    pre-hook registered on one after the rewrite was accepted and never ran (feature extraction
    got nothing, an output edit did nothing). It is refused, saying what runs hooks; the rewrite
    still runs, deep-copies and loads its state dict."""
    torch.manual_seed(0)
    x = torch.randn(4, 16)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8)).eval()
    gm = amp_rewrite.rewrite(model, example_inputs=(x,), target="bf16")
    expected = gm(x)
    for module in (gm, copy.deepcopy(gm)):
        with pytest.raises(NotImplementedError, match="forward hook registered on it would never run.*symbolic_trace"):
            module.get_submodule("0").register_forward_hook(lambda m, i, o: o * 0)
        with pytest.raises(NotImplementedError, match="forward pre-hook"):
            module.get_submodule("2").register_forward_pre_hook(lambda m, i: None)
        torch.testing.assert_close(module(x), expected)
    assert set(gm.state_dict()) == set(model.state_dict())
    gm.load_state_dict(model.state_dict())
    torch.testing.assert_close(gm(x), expected)
    seen = []
    gm.register_forward_hook(lambda m, i, o: seen.append(o.shape))  # (the root's hooks run)
    gm(x)
    assert seen == [expected.shape]


class _ScaledBeforeFloat(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(32, 32), nn.Linear(32, 32)
        with torch.no_grad():
            self.a.weight[0] = 700.0  # (a(x)[..., 0] is ~11000: fits FP16; times 6 it does not)

    def forward(self, x):
        h = (self.a(x) * 6.0).float()
        n = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return h + self.b(n)


def test_optimal_keeps_a_python_scale_above_one_fp32_before_an_fp32_reader():
    """``linear(x) * 6.0`` read by an FP32 norm: the min-cut (placement="optimal") made the mul low (a Python scalar was no
    operand it weighed), so 11000 * 6 was inf in FP16 and the output NaN, where greedy is exact."""
    torch.manual_seed(0)
    model, x = _ScaledBeforeFloat().eval(), torch.rand(2, 32)
    reference = model(x)
    assert reference.abs().max() > 65504
    gm, report = amp_rewrite.rewrite(model, example_inputs=(x,), target="fp16", placement="optimal", report=True)
    got = gm(x)
    assert torch.isfinite(got).all() and (got - reference).abs().max() <= 1e-2 * reference.abs().max()
    assert report.log.decisions["mul"].precision == Precision.FP32


class _DiffusionStep(nn.Module):
    """eps from an x0 prediction: (x - sqrt(a) * x0) / sqrt(1 - a), a = alphas_cumprod[t] (a buffer)."""

    def __init__(self) -> None:
        super().__init__()
        betas = torch.linspace(0.00085 ** 0.5, 0.012 ** 0.5, 1000, dtype=torch.float64) ** 2
        self.register_buffer("alphas_cumprod", torch.cumprod(1 - betas, 0).float())
        self.net, self.nxt = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x, t):
        a = self.alphas_cumprod[t].view(-1, 1)
        return self.nxt((x - a.sqrt() * self.net(x)) / (1 - a).sqrt())


@pytest.mark.parametrize("target", ["bf16", "fp16"])
def test_optimal_keeps_one_minus_a_schedule_entry_fp32_with_its_exact_table(target):
    """``1 - alphas_cumprod[t]`` (``rsub`` of a Python 1): the min-cut (placement="optimal") made the
    index, view and rsub low, the buffer's 0.99915 was 1.0 in BF16 (0.99902 in FP16), and the output
    NaN (7% off in FP16), where greedy and torch.autocast are within 5e-3."""
    torch.manual_seed(0)
    model, x, t = _DiffusionStep().eval(), torch.randn(2, 8), torch.tensor([0, 1])
    with torch.no_grad():
        reference = model(x, t)
        gm, report = amp_rewrite.rewrite(model, example_inputs=(x, t), target=target, placement="optimal", report=True)
        got = gm(x, t)
    assert torch.isfinite(got).all() and (got - reference).abs().max() <= TOL[target] / 3 * reference.abs().max()
    assert report.log.decisions["rsub"].precision == Precision.FP32
    assert "it adds a constant" in report.log.decisions["rsub"].reason


class _ScaledByTheSchedule(_DiffusionStep):
    """``a * h`` and ``1 - a`` of one schedule entry a = alphas_cumprod[t]."""

    def forward(self, x, t):
        a = self.alphas_cumprod[t].view(-1, 1)
        return 1 - a, self.nxt(a * self.net(x))


@pytest.mark.parametrize("placement", ["greedy", "optimal"])
@pytest.mark.parametrize("target", ["bf16", "fp16"])
def test_a_schedule_entry_a_low_product_also_reads_keeps_one_minus_it_exact(target, placement):
    """The index and view of the schedule followed the low ``a * h`` (clear ops spread low), the
    buffer was converted offline, and ``1 - a`` read 0.99902 for 0.99915 (FP16: 15% off) or 1.0
    (BF16: 0). A data move only feeding weights into a sum with a constant addend stays FP32; the
    product reads it through a Cast."""
    torch.manual_seed(0)
    model, x, t = _ScaledByTheSchedule().eval(), torch.randn(2, 8), torch.tensor([0, 1])
    with torch.no_grad():
        reference = model(x, t)
        gm = amp_rewrite.rewrite(model, example_inputs=(x, t), target=target, placement=placement)
        got = gm(x, t)
    assert torch.equal(got[0].float(), reference[0])
    assert (got[1] - reference[1]).abs().max() <= TOL[target] * reference[1].abs().max()
    assert gm.alphas_cumprod.dtype == torch.float32


class _Uint8SuperResolution(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 3, 3, padding=1)

    def forward(self, img):
        y = self.c2(torch.relu(self.c1(img.float() / 255)))
        return (y * 255).clamp(0, 255).round().to(torch.uint8)


def test_a_uint8_image_through_convolutions_is_no_shape_arithmetic_in_torch():
    """uint8 in, uint8 out: every conv was kept FP32 as "shape or index arithmetic" (0 of 2 low)."""
    torch.manual_seed(0)
    model, img = _Uint8SuperResolution().eval(), torch.randint(0, 256, (1, 3, 8, 8), dtype=torch.uint8)
    gm, report = amp_rewrite.rewrite(model, example_inputs=(img,), target="bf16", report=True)
    gm.graph.lint()
    assert report.heavy_ops["low"] == report.heavy_ops["total"] == 2
    with torch.no_grad():
        assert (gm(img).int() - model(img).int()).abs().max() <= 2


class _FromNonFloats(nn.Module):
    """A float feature computed from integers, bools or a complex tensor alone, read by a Linear."""

    def __init__(self, spelling: str) -> None:
        super().__init__()
        self.spelling, self.l0, self.l1 = spelling, nn.Linear(16, 16), nn.Linear(16, 8)

    def forward(self, x, ids):
        if self.spelling == "where of scalars":
            feature = torch.where(ids > 3, 1.0, 0.0)
        elif self.spelling == "bool times a scalar":
            feature = (ids > 3) * 1.0
        elif self.spelling == "int over a scalar":
            feature = ids / 7.0
        else:  # "abs of a complex tensor"
            feature = torch.complex(x, x.flip(-1)).detach().abs()  # (complex from a float: no float read after)
        return self.l1(self.l0(x) * feature)


@pytest.mark.parametrize("placement", ["greedy", "optimal"])
@pytest.mark.parametrize("spelling", ["where of scalars", "bool times a scalar", "int over a scalar",
                                      "abs of a complex tensor"])
def test_an_op_reading_no_float_tensor_keeps_fp32_and_its_readers_get_a_cast(spelling, placement):
    """``where(ids > 3, 1.0, 0.0)`` read by a low product: torch computes it FP32 whatever the
    rewrite says (scalars, no dtype argument), the optimal placement made it low at no cost, no
    Cast was written, and the module failed at its first call (mat1 and mat2 must have the same
    dtype). It keeps FP32 now and the product reads it through a Cast."""
    torch.manual_seed(0)
    model, x, ids = _FromNonFloats(spelling).eval(), torch.randn(2, 16), torch.randint(0, 8, (2, 16))
    gm = amp_rewrite.rewrite(model, example_inputs=(x, ids), target="bf16", placement=placement)
    gm.graph.lint()
    with torch.no_grad():
        got, reference = gm(x, ids), model(x, ids)
    assert (got.float() - reference).abs().max() <= TOL["bf16"] * reference.abs().max()


class _BufferNamedLikeAnOp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mean", torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1))
        self.linear = nn.Parameter(torch.randn(4, 8) * 0.3)
        self.conv = nn.Conv2d(3, 8, 3, padding=1)

    def forward(self, x):
        return F.linear(torch.relu(self.conv(x - self.mean)).mean((2, 3)), self.linear)


@pytest.mark.parametrize("capture", ["export", "symbolic_trace"])
def test_a_module_tensor_named_like_an_op_the_model_calls_is_rewritten(capture):
    """A buffer ``mean`` beside ``x.mean()`` (ImageNet normalisation and global average pooling),
    a parameter ``linear`` beside ``F.linear``: the export capture names the op's node like the
    tensor, the IR held two values of that name, and the rewrite failed its own verification (exit
    7, "a bug")."""
    torch.manual_seed(0)
    model, x = _BufferNamedLikeAnOp().eval(), torch.rand(1, 3, 8, 8)
    gm, report = amp_rewrite.rewrite(model, example_inputs=(x,), target="bf16", capture=capture, report=True)
    gm.graph.lint()
    assert report.heavy_ops["low"] == report.heavy_ops["total"] == 2
    with torch.no_grad():
        got, reference = gm(x), model(x)
    assert (got.float() - reference).abs().max() <= TOL["bf16"] * reference.abs().max()


class _UnrolledScan(nn.Module):
    """A recurrence written as a Python loop over 200 steps: an EMA ``h = a * h + (1 - a) * u[t]``
    with ``a = exp(-exp(w))`` (0.9933-0.99966, RWKV's decay), a decay held as a parameter, or a
    running sum ``h = h + (k * v)[t]``."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind, self.u, self.o = kind, nn.Linear(16, 16), nn.Linear(16, 16)
        self.w = nn.Parameter(torch.linspace(-8, -5, 16))
        self.decay = nn.Parameter(torch.linspace(0.9990, 0.9997, 16))

    def forward(self, x):
        u = self.u(x)
        a = torch.exp(-torch.exp(self.w)) if self.kind == "ema" else self.decay
        kv, h, ys = u * x, torch.zeros(x.shape[0], x.shape[2]), []
        for t in range(x.shape[1]):
            if self.kind == "running sum":
                h = h + kv[:, t]
            else:
                h = a * h + (1 - a) * u[:, t] if self.kind == "ema" else a * h + u[:, t]
            ys.append(h)
        return self.o(torch.stack(ys, 1))


@pytest.mark.parametrize("kind", ["ema", "decay parameter", "running sum"])
def test_a_recurrence_written_as_a_loop_keeps_its_state_fp32(kind):
    """The steps of an unrolled scan were painted bf16 between the two Linears: the state was
    rounded at every step and a decay of 0.99966 held as 1.0, so the state never forgot (EMA 0.27
    off over 300 steps, a decay parameter 0.10, a running sum 0.044; torch.autocast 0.005, keeping
    the state FP32 by promotion from its FP32 zeros). The steps keep FP32, as CumSum does, and the
    Linears stay low."""
    torch.manual_seed(0)
    model, x = _UnrolledScan(kind).eval(), torch.randn(1, 200, 16) + 1.0
    gm, report = amp_rewrite.rewrite(model, example_inputs=(x,), target="bf16", report=True)
    assert report.heavy_ops["low"] == report.heavy_ops["total"] == 2
    steps = [d for d in report.log.decisions.values() if "a step of a recurrence written as a loop" in d.reason]
    assert len(steps) >= 200
    with torch.no_grad():
        got, reference = gm(x), model(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            autocast = model(x).float()
    error = ((got.float() - reference).abs().max() / reference.abs().max()).item()
    assert error <= 2 * ((autocast - reference).abs().max() / reference.abs().max()).item() + 1e-3


class _SquashedLogProb(nn.Module):
    """SAC's tanh-squashed Gaussian log-probability term: log(1 - tanh(u)^2 + 1e-6) summed."""

    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(8, 8)

    def forward(self, x):
        u = self.l(x)
        return torch.log(1 - torch.tanh(u).pow(2) + 1e-6).sum(-1)


def test_optimal_keeps_a_tanh_before_one_minus_its_square_fp32_as_greedy_does():
    """``log(1 - tanh(u)**2 + 1e-6)``: the sums before the log were held FP32, but the min-cut made
    the tanh and its square bf16, where tanh(u) for u > 3 is 1: the log-probability was 37% off
    (-inf without the 1e-6), where greedy was within 4e-4."""
    torch.manual_seed(0)
    model, x = _SquashedLogProb().eval(), torch.randn(2, 8)
    with torch.no_grad():
        model.l.weight.mul_(4.0)
        reference = model(x)
        results = {placement: amp_rewrite.rewrite(model, example_inputs=(x,), target="bf16", placement=placement,
                                                  report=True) for placement in ("greedy", "optimal")}
        for placement, (gm, report) in results.items():
            got = gm(x)
            assert torch.isfinite(got).all() and (got - reference).abs().max() <= 5e-3 * reference.abs().max(), \
                placement
            assert report.log.decisions["tanh"].precision == Precision.FP32, placement


class _PerChannelEpsilon(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.register_buffer("eps", torch.tensor([1e-8, 1e-8, 1e-3, 1e-3]))

    def forward(self, x):
        r = torch.relu(self.a(x))
        return self.b(r / (r + self.eps))


@pytest.mark.parametrize("capture", ["symbolic_trace", "export"])
def test_a_per_channel_epsilon_fp16_loses_in_some_lanes_keeps_its_guard_fp32(capture):
    """An epsilon buffer [1e-8, 1e-8, 1e-3, 1e-3]: the guard went low because one of its values
    survives in FP16, and the lanes whose 1e-8 did not gave 0/0 = NaN."""
    torch.manual_seed(0)
    model, x = _PerChannelEpsilon().eval(), torch.randn(8, 4)
    result = _dispatch(model, example_inputs=(x,), target="fp16", capture=capture)
    with torch.no_grad():
        want, got = model(x), result.model(x)
    assert (torch.relu(model.a(x))[:, :2] == 0).any()  # (a zero the 1e-8 lanes guard)
    assert torch.isfinite(got).all() and rel_err(got, want) < TOL["fp16"]
    assert [d.precision for d in result.log.decisions.values() if "epsilon is lost" in d.reason] == [Precision.FP32]


class _InfPadding(nn.Module):
    """A padding bias holding -inf, read only by ops that run low."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.register_buffer("pad", torch.tensor([0.0, 0.0, 0.0, float("-inf")]))

    def forward(self, x):
        h = self.a(x) + self.pad
        return self.b(h).amax(-1), torch.isinf(h).sum()


def test_an_infinite_buffer_entry_is_kept_not_clamped_when_converted():
    """±inf is no value past 65504 to clamp: the padded feature stays -inf, and the report counts
    no clamped value."""
    torch.manual_seed(0)
    model, x = _InfPadding().eval(), torch.randn(3, 4)
    result = _dispatch(model, example_inputs=(x,), target="fp16")
    assert result.log.weights.clamped == 0
    with torch.no_grad():
        got, want = result.model(x), model(x)
    assert int(got[1]) == int(want[1]) == 3


class _FactoryWithoutDtype(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.b(self.a(x) * torch.full((4,), 0.5))


@pytest.mark.parametrize("capture", ["symbolic_trace", "export"])
def test_a_factory_called_without_a_dtype_makes_the_type_its_readers_need(capture):
    """``torch.full((4,), 0.5)`` has no ``dtype=``: made low, it must be given one (else it is
    FP32, and the low Linear after the Mul met Float and Half)."""
    torch.manual_seed(0)
    model, x = _FactoryWithoutDtype().eval(), torch.randn(3, 4)
    result = _dispatch(model, example_inputs=(x,), target="fp16", capture=capture)
    with torch.no_grad():
        assert rel_err(result.model(x), model(x)) < TOL["fp16"]


class _PrunedWithTinyWeight(nn.Module):
    """A pruned Linear (a column of exact zeros) whose weight also holds 1e-8, below fp16's
    smallest subnormal."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        with torch.no_grad():
            self.a.weight[:, 0] = 0.0
            self.a.weight[1, 1] = 1e-8

    def forward(self, x):
        return self.b(F.relu(self.a(x)))


def test_flushed_to_zero_counts_only_weights_that_lost_a_nonzero_value():
    """A weight that was already 0 loses nothing in fp16: only the 1e-8 is flushed to zero (counting
    every zero of the converted weight would count the pruned column's four too)."""
    torch.manual_seed(0)
    model, x = _PrunedWithTinyWeight().eval(), torch.randn(3, 4)
    result = _dispatch(model, example_inputs=(x,), target="fp16")
    assert result.model.a.weight.dtype == torch.float16 and int((result.model.a.weight == 0).sum()) == 5
    assert result.log.weights.flushed_to_zero == 1 and result.log.weights.clamped == 0
    assert re.search(r"0 values clamped at ±65504, 1 flushed to zero", result.report.summary_text())


class _TransposedViews(nn.Module):
    """``x.T`` / ``x.mT`` (Falcon's attention), a ``torch.tensor`` constant made in forward
    (DeBERTa-v2's scale) and a weight-normed projection (Wav2Vec2's positional conv)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.utils.parametrizations.weight_norm(nn.Linear(8, 8))

    def forward(self, x):
        h = self.a(x)
        s = (h.mT @ h.T.T) * torch.tensor(0.125)
        return self.b(s.mT)


@pytest.mark.parametrize("target", ["fp16", "bf16"])
def test_transposed_views_lifted_constants_and_weight_norm_are_classified(target):
    """``numpy_T``, ``mT`` and ``lift_fresh_copy`` were unlisted ops (treated as deny: a transpose
    kept FP32 between two low matmuls, with its Casts), and ``_weight_norm`` was unlisted too: it
    stays FP32 now for its reason, a norm over the weight, and the views follow their neighbours."""
    torch.manual_seed(0)
    model = _TransposedViews().eval()
    x = torch.randn(8, 8)
    result = _dispatch(model, example_inputs=(x,), target=target)
    assert not result.log.unlisted_ops, result.log.unlisted_ops
    decisions = list(result.log.decisions.values())
    views = [d for d in decisions if d.op in ("numpy_T", "mT")]
    assert views and all(d.precision == Precision.LOW for d in views), [(d.op, d.precision) for d in views]
    [norm] = [d for d in decisions if d.op == "_weight_norm"]
    assert norm.precision == Precision.FP32 and "weight's norm is a long sum of squares" in norm.reason
    result.model.graph.lint()
    with torch.no_grad():
        assert rel_err(result.model(x), model(x)) < TOL[target]
