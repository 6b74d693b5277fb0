"""End to end on real architectures nobody here wrote (tools/corpus.py builds them at test time):
the onnx package's model-zoo networks with random weights, HF transformers exports (TorchScript
exporter at opsets 13 and 17, and the dynamo exporter), torch.nn LSTM/UNet/ResNet, If/Loop models.

For each: the rewritten model passes the full checker, loads and runs in onnxruntime (CPU, in a
subprocess), produces no NaN/Inf the FP32 model does not, matches FP32 logits within a relative
error of 1e-2 (max |a-b| / max |a|), keeps every MatMul/Gemm/Conv low unless a stated reason keeps
it FP32, and is a fixed point of the rewrite.
"""

from __future__ import annotations

import numpy as np
import pytest

from util import full_check, rel_err, rewrite, run

corpus = pytest.importorskip("tools.corpus")

TOLERANCE = 1e-2
NAMES = corpus.list_models("full")


@pytest.fixture(scope="module")
def built():
    cache: dict[str, object] = {}

    def get(name):
        if name not in cache:
            cache.clear()  # zoo models are large: keep one at a time
            cache[name] = corpus.build(name)
        return cache[name]

    return get


@pytest.mark.parametrize("name", NAMES)
def test_rewrite_real_architecture(name, built):
    cm = built(name)
    result = rewrite(cm.model)
    assert result.modified, f"{name}: nothing was rewritten"
    out = result.model
    full_check(out)
    assert out.ir_version == cm.model.ir_version  # never raised

    ref = run(cm.path or cm.model, cm.feeds)  # the cached file: no re-serialising of large zoo models
    got = run(out, cm.feeds)
    for key, value in ref.items():
        bad_ref = ~np.isfinite(value) if np.issubdtype(value.dtype, np.floating) else np.zeros(value.shape, bool)
        if np.issubdtype(got[key].dtype, np.floating):
            assert not (~np.isfinite(got[key]) & ~bad_ref).any(), f"{name}: new NaN/Inf in {key}"
    for key in cm.logits:
        err = rel_err(ref[key], got[key])
        assert err <= TOLERANCE, f"{name}: {key} relative error {err:.2e} > {TOLERANCE}"

    heavy = result.report.heavy_ops
    assert heavy["total"] > 0
    for kept in heavy["kept_fp32"]:
        assert kept["reason"], f"{name}: {kept['node']} kept FP32 without a reason"
    assert heavy["low"] >= 1

    again = rewrite(out)
    assert not again.modified, f"{name}: rewriting the output changed it again"
