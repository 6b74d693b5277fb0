"""External data and the streaming path, exercised on small models by lowering the thresholds.

The real thing (a generated >2 GB model, peak RSS) is ``tools/huge_model.py``; these tests force the
same code paths with tiny thresholds: lazy conversion at save time (``LAZY_BYTES``), chunked conversion
(``CHUNK_ELEMENTS``), external data chosen by input size (``EXTERNAL_DATA_ABOVE``), and reading external
tensors through the file instead of a memory map.
"""

from __future__ import annotations

import hashlib
import mmap
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tools")]

from amp_rewrite import api  # noqa: E402
from amp_rewrite.emitters import onnx_emitter  # noqa: E402
from ortrun import run_onnx  # noqa: E402

H = 64  # weights are H x H floats (16 KiB)


def mlp(weights: dict[str, np.ndarray] | None = None) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    weights = weights or {f"w{i}": (rng.standard_normal((H, H)) / 8).astype(np.float32) for i in range(3)}
    names = list(weights)
    nodes, src = [], "x"
    for i, w in enumerate(names):
        nodes.append(helper.make_node("MatMul", [src, w], [f"m{i}"], name=f"mm{i}"))
        nodes.append(helper.make_node("Relu", [f"m{i}"], [f"r{i}"], name=f"relu{i}"))
        src = f"r{i}"
    nodes.append(helper.make_node("Identity", [src], ["y"], name="out"))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, H])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, H])],
                              [numpy_helper.from_array(v, k) for k, v in weights.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def save_external(model: onnx.ModelProto, path: Path, *, one_file: bool = True) -> None:
    copy = onnx.ModelProto()
    copy.CopyFrom(model)  # onnx.save_model moves the data of the proto it saves out to the files
    onnx.save_model(copy, str(path), save_as_external_data=True, all_tensors_to_one_file=one_file,
                    location=path.name + ".weights" if one_file else None, size_threshold=0)


def digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def external_names(model_path: Path) -> dict[str, str]:
    """initializer name → external data location (only the external ones)."""
    proto = onnx.load(str(model_path), load_external_data=False)
    out = {}
    for t in proto.graph.initializer:
        if t.data_location == TensorProto.EXTERNAL:
            out[t.name] = next(e.value for e in t.external_data if e.key == "location")
    return out


def weights_of(model_path: Path) -> dict[str, np.ndarray]:
    proto = onnx.load(str(model_path))
    return {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}


@pytest.fixture
def streaming(monkeypatch):
    """Every float weight takes the lazy path, converted in chunks of 1000 elements (not a divisor of
    the 4096-element weights, so chunk boundaries fall mid-row)."""
    monkeypatch.setattr(onnx_emitter, "LAZY_BYTES", 64)
    monkeypatch.setattr(onnx_emitter, "CHUNK_ELEMENTS", 1000)


@pytest.fixture
def no_mmap(monkeypatch):
    """Fail if anything memory-maps a file: a mapped external tensor stays resident in RSS."""
    real = mmap.mmap

    def refuse(fileno, length, *args, **kwargs):
        if length == 0:  # onnx-ir maps whole external-data files with length 0
            raise AssertionError("an external-data file was memory-mapped")
        return real(fileno, length, *args, **kwargs)

    monkeypatch.setattr(mmap, "mmap", refuse)


def check_runs_like(original: onnx.ModelProto, out_path: Path) -> None:
    x = np.random.default_rng(1).standard_normal((2, H)).astype(np.float32)
    ref = run_onnx(original, {"x": x})["y"]
    got = run_onnx(out_path, {"x": x})["y"]
    assert np.abs(ref - got).max() <= 2e-2 * (1 + np.abs(ref).max())


def test_forced_external_output_from_an_inline_input(tmp_path, streaming, monkeypatch):
    """A small inline model is written with external data once it is 'too big' (threshold lowered)."""
    monkeypatch.setattr(api, "EXTERNAL_DATA_ABOVE", 1000)
    model = mlp()
    src = tmp_path / "m.onnx"
    onnx.save(model, str(src))
    before = digest(tmp_path)
    result = api.rewrite_onnx(src, tmp_path / "out.onnx")
    assert digest(tmp_path)["m.onnx"] == before["m.onnx"]
    assert sorted(p.name for p in result.outputs) == ["out.onnx", "out.onnx.data"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx", "out.onnx", "out.onnx.data"]
    assert set(external_names(tmp_path / "out.onnx").values()) == {"out.onnx.data"}
    converted = weights_of(tmp_path / "out.onnx")
    for name, w in {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}.items():
        assert converted[name].dtype == np.float16
        np.testing.assert_array_equal(converted[name], w.astype(np.float16))  # chunking is exact
    check_runs_like(model, tmp_path / "out.onnx")


def test_external_input_is_streamed_not_mapped(tmp_path, streaming, no_mmap):
    model = mlp()
    src = tmp_path / "m.onnx"
    save_external(model, src)
    before = digest(tmp_path)
    api.rewrite_onnx(src, tmp_path / "out.onnx")
    after = digest(tmp_path)
    assert {k: after[k] for k in before} == before, "the input or its external data changed"
    assert set(after) - set(before) == {"out.onnx", "out.onnx.data"}
    assert set(external_names(tmp_path / "out.onnx").values()) == {"out.onnx.data"}
    check_runs_like(model, tmp_path / "out.onnx")


def test_clamping_and_sentinels_counted_across_chunks(tmp_path, streaming):
    rng = np.random.default_rng(2)
    w = (rng.standard_normal((H, H)) / 8).astype(np.float32)
    w.flat[10] = 1e5  # clamped to 65504 (chunk 0)
    w.flat[2500] = -7e4  # clamped (chunk 2)
    w.flat[3999] = -1e9  # a sentinel, also clamped (chunk 3)
    w.flat[4000] = np.inf  # a sentinel, not clamped (inf stays inf) (chunk 4)
    model = mlp({"w0": w})
    src = tmp_path / "m.onnx"
    save_external(model, src)
    result = api.rewrite_onnx(src, tmp_path / "out.onnx")
    out = weights_of(tmp_path / "out.onnx")["w0"]
    assert out.flat[10] == 65504 and out.flat[2500] == -65504 and out.flat[3999] == -65504
    assert np.isposinf(out.flat[4000])
    weights = result.log.weights
    assert weights.clamped == 3
    assert weights.sentinels == [{"tensor": "w0", "count": 2, "min": -1e9, "max": float("inf")}]


def test_one_file_per_tensor_input(tmp_path, streaming):
    model = mlp()
    src = tmp_path / "m.onnx"
    save_external(model, src, one_file=False)
    before = digest(tmp_path)
    assert len(before) == 4  # the model and one file per weight
    api.rewrite_onnx(src, tmp_path / "out.onnx")
    after = digest(tmp_path)
    assert {k: after[k] for k in before} == before
    assert set(external_names(tmp_path / "out.onnx").values()) == {"out.onnx.data"}
    check_runs_like(model, tmp_path / "out.onnx")


def test_shared_weight_keeps_fp32_original_and_gets_a_low_copy(tmp_path, streaming):
    """w feeds a MatMul (low) and a ReduceSum (FP32): both forms end up in the new data file."""
    rng = np.random.default_rng(3)
    w = (rng.standard_normal((H, H)) / 8).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"], name="mm"),
             helper.make_node("ReduceSum", ["w"], ["s"], name="sum", keepdims=1),
             helper.make_node("Add", ["m", "s"], ["y"], name="add")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, H])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, H])],
                              [numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    src = tmp_path / "m.onnx"
    save_external(model, src)
    api.rewrite_onnx(src, tmp_path / "out.onnx")
    out = weights_of(tmp_path / "out.onnx")
    np.testing.assert_array_equal(out["w"], w)
    low = [v for k, v in out.items() if k != "w"]
    assert len(low) == 1 and low[0].dtype == np.float16
    np.testing.assert_array_equal(low[0], w.astype(np.float16))
    check_runs_like(model, tmp_path / "out.onnx")


def test_nothing_to_rewrite_with_external_data(tmp_path, streaming):
    """No allow op: the output is the input re-saved, with its own fresh external data file."""
    w = np.arange(H * H, dtype=np.float32).reshape(H, H) / 100
    nodes = [helper.make_node("Add", ["x", "w"], ["y"], name="add")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [H, H])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [H, H])],
                              [numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    src = tmp_path / "m.onnx"
    save_external(model, src)
    before = digest(tmp_path)
    result = api.rewrite_onnx(src, tmp_path / "out.onnx")
    assert not result.modified
    after = digest(tmp_path)
    assert {k: after[k] for k in before} == before
    assert set(external_names(tmp_path / "out.onnx").values()) == {"out.onnx.data"}
    np.testing.assert_array_equal(weights_of(tmp_path / "out.onnx")["w"], w)
    x = np.ones((H, H), np.float32)
    np.testing.assert_array_equal(run_onnx(tmp_path / "out.onnx", {"x": x})["y"], x + w)


def test_output_next_to_input_never_reuses_its_data_file(tmp_path, streaming):
    """-o in the input's own folder twice in a row (--overwrite): each save writes a fresh data file
    atomically and leaves no temporary folders behind."""
    model = mlp()
    src = tmp_path / "m.onnx"
    save_external(model, src)
    api.rewrite_onnx(src, tmp_path / "out.onnx")
    first = digest(tmp_path)
    api.rewrite_onnx(src, tmp_path / "out.onnx", overwrite=True)
    assert digest(tmp_path) == first  # deterministic, and nothing extra
    assert not list(tmp_path.glob(".amp-rewrite-*"))


def test_converted_weights_stream_into_the_file_never_whole(tmp_path, streaming, monkeypatch):
    """With external data, each converted weight goes chunk by chunk into the new data file: neither
    precision of a big tensor is ever held whole (tools/huge_model.py measures the RSS this buys)."""
    def refuse(self):
        raise AssertionError(f"converted weight {self.name!r} was materialised whole")

    monkeypatch.setattr(onnx_emitter._ConvertingTensor, "_evaluate", refuse)
    model = mlp()
    src = tmp_path / "m.onnx"
    save_external(model, src)
    result = api.rewrite_onnx(src, tmp_path / "out.onnx")
    assert result.log.weights.converted == 3
    converted = weights_of(tmp_path / "out.onnx")
    for t in model.graph.initializer:
        np.testing.assert_array_equal(converted[t.name], numpy_helper.to_array(t).astype(np.float16))


def test_a_streamed_weight_keeps_its_doc_string_and_metadata(tmp_path, streaming):
    """A weight converted while it is written (over LAZY_BYTES, external) lost its doc string and
    metadata; a weight converted in memory kept them."""
    model = mlp()
    weight = model.graph.initializer[0]
    weight.doc_string = "projection weight"
    entry = weight.metadata_props.add()
    entry.key, entry.value = "source", "layer0"
    save_external(model, tmp_path / "m.onnx")
    api.rewrite_onnx(tmp_path / "m.onnx", tmp_path / "out.onnx")
    assert weight.name in external_names(tmp_path / "out.onnx")  # (it took the streaming path)
    out = onnx.load(str(tmp_path / "out.onnx"), load_external_data=False)
    converted = next(t for t in out.graph.initializer if t.name == weight.name)
    assert converted.data_type == TensorProto.FLOAT16
    assert converted.doc_string == "projection weight"
    assert [(p.key, p.value) for p in converted.metadata_props] == [("source", "layer0")]
