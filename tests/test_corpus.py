"""Tests of the FP32 model corpus (tools/corpus.py) and the isolated runner (tools/ortrun.py).

The corpus is the ground truth the rewriter is judged against, so it must itself be sound: every
model builds, passes the full checker, loads in onnxruntime (IR <= 10), runs on its own feeds, and
produces finite, non-constant outputs.  The fast tier runs by default; the rest is marked slow.
The runner must turn crashes, hangs and invalid models into OrtRunError instead of killing pytest.
"""

from __future__ import annotations

import os
import time

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from tools import corpus
from tools.ortrun import FAULT_ENV, OrtRunError, _load_arrays, _save_arrays, load_ok, run_onnx

FAST = corpus.list_models("fast")
FULL = corpus.list_models("full")
FAMILIES = {"zoo", "hf", "torchnn", "control", "synthetic"}


def _tiered(names: list[str]) -> list:
    return [n if n in FAST else pytest.param(n, marks=pytest.mark.slow) for n in names]


# -- registry ---------------------------------------------------------------------------------------------
def test_tiers_are_consistent():
    assert FAST and set(FAST) < set(FULL)
    assert len(FULL) == len(set(FULL))
    with pytest.raises(ValueError):
        corpus.list_models("everything")
    with pytest.raises(KeyError):
        corpus.build("zoo/no-such-model")


def test_every_required_architecture_is_registered():
    required = ["control/if", "control/loop", "synthetic/transformer-block-op13",
                "synthetic/transformer-block-op17", "torchnn/lstm-op13", "torchnn/unet-groupnorm-op17",
                "torchnn/resnet-bn-op13", "torchnn/resnet-bn-op17"]
    required += [f"zoo/{z}" for z in ("bvlc_alexnet", "densenet121", "inception_v1", "inception_v2",
                                      "resnet50", "shufflenet", "squeezenet", "vgg19", "zfnet512")]
    for arch in ("bert", "gpt2", "vit", "t5", "llama", "whisper-encoder", "clip"):
        required += [f"hf/{arch}-torchscript-op13", f"hf/{arch}-torchscript-op17", f"hf/{arch}-dynamo-op18"]
    missing = sorted(set(required) - set(FULL))
    assert not missing, missing


# -- every model -----------------------------------------------------------------------------------------
def _assert_sound(cm: corpus.CorpusModel) -> None:
    """The static invariants: checker, IR/opset bookkeeping, feeds matching the inputs, SSA names."""
    m = cm.model
    onnx.checker.check_model(m, full_check=True)
    assert m.ir_version <= corpus.MAX_IR_VERSION
    assert cm.family in FAMILIES and cm.name.startswith(cm.family + "/")
    assert cm.opset == next(o.version for o in m.opset_import if o.domain in ("", "ai.onnx"))
    inits = {t.name for t in m.graph.initializer}
    data_inputs = [i.name for i in m.graph.input if i.name not in inits]
    assert sorted(cm.feeds) == sorted(data_inputs)
    assert set(cm.logits) <= {o.name for o in m.graph.output}
    produced = [o for n in m.graph.node for o in n.output if o] + [t.name for t in m.graph.initializer]
    assert len(produced) == len(set(produced)), "a value is defined twice"
    for name, value in cm.feeds.items():
        if value.dtype == np.int64 and "mask" in name:
            assert set(np.unique(value)) <= {0, 1}


def _assert_runs(cm: corpus.CorpusModel) -> None:
    """Run in the isolated runner: finite outputs, and the compared outputs are not constant."""
    outputs = run_onnx(cm.path or cm.model, cm.feeds, timeout=300)
    assert list(outputs) == [o.name for o in cm.model.graph.output]
    for name, value in outputs.items():
        if np.issubdtype(value.dtype, np.floating):
            assert np.isfinite(value).all(), f"{cm.name}: non-finite values in {name}"
    for name in cm.logits:
        assert float(np.std(outputs[name])) > 0, f"{cm.name}: {name} is constant"


@pytest.mark.parametrize("name", _tiered(FULL))
def test_model_builds_checks_and_runs(name):
    cm = corpus.build(name)
    assert cm.name == name
    _assert_sound(cm)
    _assert_runs(cm)


# -- determinism and cache -------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["control/loop", "synthetic/transformer-block-op13", "torchnn/lstm-op13"])
def test_builds_are_deterministic(name):
    a, b = corpus.build_uncached(name), corpus.build_uncached(name)
    assert a.model.SerializeToString() == b.model.SerializeToString()
    assert a.feeds.keys() == b.feeds.keys()
    for key in a.feeds:
        np.testing.assert_array_equal(a.feeds[key], b.feeds[key])


def test_cache_round_trip(tmp_path, monkeypatch):
    monkeypatch.setenv("AMP_REWRITE_CORPUS_CACHE", str(tmp_path))
    first = corpus.build("control/if")
    assert first.path and os.path.exists(first.path)
    second = corpus.build("control/if")  # now from disk
    assert second.path == first.path
    assert second.model.SerializeToString() == first.model.SerializeToString()
    assert (second.family, second.logits, second.exporter, second.opset) == \
        (first.family, first.logits, first.exporter, first.opset)
    for key in first.feeds:
        assert second.feeds[key].dtype == first.feeds[key].dtype
        np.testing.assert_array_equal(second.feeds[key], first.feeds[key])
    leftovers = [p for p in corpus.cache_dir().iterdir() if p.name.startswith(".tmp")]
    assert not leftovers


def test_zoo_weights_are_random_and_calibrated():
    """The light zoo models ship constant placeholder weights; ours are random and
    the calibration keeps the logits in a sane range (not a saturated softmax)."""
    cm = corpus.build("zoo/squeezenet")
    assert not any(n.op_type == "ConstantOfShape" for n in cm.model.graph.node)
    weights = [onnx.numpy_helper.to_array(t) for t in cm.model.graph.initializer
               if t.data_type == TensorProto.FLOAT and t.dims and np.prod(t.dims) > 1000]
    assert weights and all(np.std(w) > 0 for w in weights)
    probs = run_onnx(cm.path or cm.model, cm.feeds)[cm.logits[0]]
    assert 0 < probs.max() < 0.5


# -- the runner -----------------------------------------------------------------------------------------
def _tiny_model() -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("out/y:0", TensorProto.FLOAT, [2, 3])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["out/y:0"])], "tiny", [x], [y])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_run_onnx_returns_named_outputs(tmp_path):
    x = np.array([[-1, 2, -3], [4, -5, 6]], np.float32)
    out = run_onnx(_tiny_model(), {"x": x})
    np.testing.assert_array_equal(out["out/y:0"], np.maximum(x, 0))
    path = tmp_path / "tiny.onnx"
    onnx.save(_tiny_model(), path)
    np.testing.assert_array_equal(run_onnx(str(path), {"x": x})["out/y:0"], np.maximum(x, 0))
    assert load_ok(path) == (True, "")


def test_transport_keeps_dtypes(tmp_path):
    import ml_dtypes

    arrays = {"f16": np.arange(4, dtype=np.float16), "bf16": np.ones(3, ml_dtypes.bfloat16),
              "flag": np.array(True), "ids": np.arange(6, dtype=np.int64).reshape(2, 3),
              "text": np.array(["a", "bc"], dtype=object)}
    path = str(tmp_path / "a.npz")
    _save_arrays(path, arrays)
    back = _load_arrays(path)
    assert list(back) == list(arrays)
    for key in ("f16", "bf16", "flag", "ids"):
        assert back[key].dtype == arrays[key].dtype and back[key].shape == arrays[key].shape
        np.testing.assert_array_equal(back[key].astype(np.float64), arrays[key].astype(np.float64))
    assert back["text"].tolist() == ["a", "bc"]


@pytest.mark.parametrize("fault, signal_name", [("segv", "SIGSEGV"), ("abort", "SIGABRT")])
def test_crash_is_an_error_not_a_dead_pytest(monkeypatch, fault, signal_name):
    monkeypatch.setenv(FAULT_ENV, fault)
    with pytest.raises(OrtRunError) as info:
        run_onnx(_tiny_model(), {"x": np.zeros((2, 3), np.float32)})
    assert info.value.signal_name == signal_name
    assert signal_name in str(info.value)
    ok, reason = load_ok(_tiny_model())
    assert not ok and signal_name in reason


def test_hang_times_out(monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "hang")
    start = time.monotonic()
    with pytest.raises(OrtRunError, match="timed out"):
        run_onnx(_tiny_model(), {"x": np.zeros((2, 3), np.float32)}, timeout=5)
    assert time.monotonic() - start < 30


def test_invalid_model_is_an_error_with_the_reason():
    bad = _tiny_model()
    bad.graph.node[0].op_type = "NoSuchOp"
    with pytest.raises(OrtRunError) as info:
        run_onnx(bad, {"x": np.zeros((2, 3), np.float32)}, timeout=60)
    assert info.value.returncode and info.value.returncode > 0
    assert "NoSuchOp" in str(info.value)
    ok, reason = load_ok(bad)
    assert not ok and "NoSuchOp" in reason


def test_wrong_feed_is_an_error():
    with pytest.raises(OrtRunError, match="x"):
        run_onnx(_tiny_model(), {"x": np.zeros((5, 5), np.float32)}, timeout=60)
