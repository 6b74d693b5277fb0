"""HF BERT and GPT-2, built from tiny configs (hidden 32, 2 layers, 2 heads, seq 8, batch 2),
captured with torch.export and rewritten. Tolerances as in test_fx_rewrite: 3e-2 BF16, 5e-3 FP16,
relative to the largest FP32 output magnitude. Per-node precision is checked against CUDA autocast
with the oracle of test_fx_autocast."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from amp_rewrite.api import _dispatch  # noqa: E402
from amp_rewrite.decisions import Precision  # noqa: E402

from test_fx_autocast import EXPECTED_DISAGREEMENTS, LOW, _Recorder, autocast_lists, autocast_node_dtypes  # noqa: E402
from test_fx_rewrite import TOL, assert_dtypes_consistent, rel_err  # noqa: E402

pytestmark = pytest.mark.slow


def _bert():
    config = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=16)
    return transformers.BertModel(config).eval()


def _gpt2():
    config = transformers.GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=2, n_positions=16,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config).eval()


def _inputs(name):
    torch.manual_seed(0)
    ids = torch.randint(0, 100, (2, 8))
    if name == "bert":
        return {"input_ids": ids, "attention_mask": torch.ones(2, 8, dtype=torch.long)}
    return {"input_ids": ids, "use_cache": False}  # a DynamicCache output would not export


@pytest.fixture(scope="module")
def exported():
    torch.manual_seed(0)
    out = {}
    for name, build in (("bert", _bert), ("gpt2", _gpt2)):
        model = build()
        kwargs = _inputs(name)
        tensors = {k: v for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
        static = {k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor)}

        class Wrapped(torch.nn.Module):  # tensors in, first output out: one graph input per tensor
            def __init__(self, inner):
                super().__init__()
                self.inner = inner

            def forward(self, *args):
                return self.inner(**dict(zip(tensors, args)), **static)[0]

        wrapped = Wrapped(model).eval()
        args = tuple(tensors.values())
        out[name] = (model, kwargs, wrapped, args, torch.export.export(wrapped, args))
    return out


@pytest.mark.parametrize("target", ["bf16", "fp16"])
@pytest.mark.parametrize("name", ["bert", "gpt2"])
def test_hf_model_rewrite(exported, name, target):
    model, kwargs, _, _, _ = exported[name]
    result = _dispatch(model, example_inputs=(), example_kwargs=kwargs, target=target)
    gm = result.model
    gm.graph.lint()
    assert not result.log.unlisted_ops, result.log.unlisted_ops
    heavy = result.report.heavy_ops
    assert heavy["total"] > 0 and heavy["low"] == heavy["total"], heavy
    with torch.no_grad():
        ref, out = model(**kwargs)[0], gm(**kwargs)[0]
    assert out.dtype == torch.float32
    assert rel_err(out, ref) < TOL[target]
    assert not _dispatch(gm, target=target).modified


@pytest.mark.parametrize("target", ["bf16", "fp16"])
@pytest.mark.parametrize("name", ["bert", "gpt2"])
def test_hf_model_per_node_matches_autocast(exported, name, target):
    _, _, wrapped, args, ep = exported[name]
    oracle = autocast_node_dtypes(ep.module(), args, LOW[target])
    result = _dispatch(ep, target=target)
    recorder = _Recorder(result.model)
    with torch.no_grad():
        recorder.run(*args)
        assert rel_err(result.model(*args), wrapped(*args)) < TOL[target]
    assert_dtypes_consistent(result.model, args)
    lists = autocast_lists(target)
    compared, unexpected = 0, {}
    for node, (op, dtype) in oracle.items():
        if op not in lists:
            continue
        compared += 1
        ours = recorder.seen[node][1]
        if ours != dtype and op not in EXPECTED_DISAGREEMENTS[target]:
            unexpected[node] = (op, dtype, ours)
    assert compared >= 8 and not unexpected, unexpected
    assert sum(d.precision == Precision.LOW for d in result.log.decisions.values()) > 0
