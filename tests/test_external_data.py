"""External data and the streaming path, exercised on small models by lowering the thresholds.

The real thing (a generated >2 GB model, peak RSS) is ``tools/huge_model.py``; these tests force the
same code paths with tiny thresholds: lazy conversion at save time (``LAZY_BYTES``), chunked conversion
(``CHUNK_ELEMENTS``), external data chosen by input size (``EXTERNAL_DATA_ABOVE``), and reading external
tensors through the file instead of a memory map.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import re
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


# -- defects found by a file-handling hunt -----------------------------------------------------------------------
def test_an_existing_data_file_is_not_replaced_without_overwrite(tmp_path):
    """Another model kept its weights in out.onnx.data; `-o out.onnx` (no --overwrite, out.onnx
    itself absent) replaced that file and broke the other model, exit 0."""
    from amp_rewrite.errors import OutputError

    model = mlp()
    src = tmp_path / "m.onnx"
    save_external(model, src)
    other = tmp_path / "out.onnx.data"
    other.write_bytes(b"another model's weights")
    with pytest.raises(OutputError, match=r"out\.onnx\.data: already exists .*--overwrite"):
        api.rewrite_onnx(src, tmp_path / "out.onnx")
    assert other.read_bytes() == b"another model's weights"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx", "m.onnx.weights", "out.onnx.data"]
    api.rewrite_onnx(src, tmp_path / "out.onnx", overwrite=True)  # asked for: replaced
    check_runs_like(model, tmp_path / "out.onnx")


@pytest.mark.parametrize("fault", [OSError(21, "Is a directory"), KeyboardInterrupt()])
def test_a_failure_between_the_two_renames_leaves_the_earlier_output_whole(tmp_path, monkeypatch, fault):
    """The new <out>.data was renamed into place before <out>: a failure or Ctrl-C between the two
    left the earlier out.onnx reading the new data file (another model's bytes), while the error
    said nothing was left behind. The pair is now undone together."""
    from amp_rewrite import files
    from amp_rewrite.errors import OutputError

    src, out = tmp_path / "m.onnx", tmp_path / "out.onnx"
    save_external(mlp(), src)
    earlier = mlp({f"w{i}": np.full((H, H), 7.0, np.float32) for i in range(3)})
    onnx.save_model(earlier, str(out), save_as_external_data=True, location="out.onnx.data", size_threshold=0)
    earlier = onnx.load(str(out))  # an earlier output, whole, whose data file the new one replaces
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    def fail_on_the_model(tmp, dst):
        if dst == out:
            raise fault
        files.replace_into(tmp, dst)

    monkeypatch.setattr(onnx_emitter, "replace_into", fail_on_the_model)
    with pytest.raises(OutputError if isinstance(fault, OSError) else KeyboardInterrupt):
        api.rewrite_onnx(src, out, overwrite=True)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # no stray file, nothing replaced
    check_runs_like(earlier, out)


@pytest.mark.parametrize("external", [False, True])
def test_an_overwritten_output_is_a_whole_file_at_every_moment(tmp_path, monkeypatch, external):
    """--overwrite renamed the earlier output aside and then the new one into place: between the two
    renames no file had the output's name, and a kill -9 there (or a reader) found none, the
    earlier output only under a hidden name. The earlier file is now kept by a second name, and
    the new one replaces it in one rename."""
    from amp_rewrite import files

    src, out = tmp_path / "m.onnx", tmp_path / "out.onnx"
    (save_external if external else lambda m, p: onnx.save(m, str(p)))(mlp(), src)
    api.rewrite_onnx(src, out)
    names = [out, *([tmp_path / "out.onnx.data"] if external else [])]
    earlier = {path: path.read_bytes() for path in names}
    seen = []
    real_replace = os.replace

    def watching(a, b):
        if Path(b) in earlier:  # the rename that puts the new file in place: the earlier one is still there
            seen.append((Path(b), Path(b).is_file() and Path(b).read_bytes() == earlier[Path(b)]))
        real_replace(a, b)

    monkeypatch.setattr(files.os, "replace", watching)
    api.rewrite_onnx(src, out, overwrite=True, placement="greedy")
    assert sorted(seen) == sorted((path, True) for path in names)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["m.onnx", *(["m.onnx.weights"] if external else []),
                                                                  *(p.name for p in names)])
    check_runs_like(mlp(), out)


@pytest.mark.parametrize("held_by", ["initializers", "Constant nodes"])
def test_an_output_over_the_limit_from_an_inline_input_gets_external_data(tmp_path, monkeypatch, held_by):
    """The choice went by the input's size: an inline input whose weights are each read by both
    types (an FP32 original and a low copy) grew past protobuf's 2 GB limit in the output, and the
    write died in serialisation (exit 70). Threshold lowered to 60 KiB: 48 KiB of weights in, 48 KiB
    of FP32 originals plus 24 KiB of low copies out. Weights held by Constant nodes were not counted
    (one of 1.4 GB, read by both types, so 2.2 GB out): written inline, the write failed, blaming 'a
    Constant inside an If/Loop body or a function'."""
    monkeypatch.setattr(api, "EXTERNAL_DATA_ABOVE", 60 * 1024)
    model = mlp()
    if held_by == "Constant nodes":
        for i, tensor in enumerate(list(model.graph.initializer)):
            model.graph.node.insert(i, helper.make_node("Constant", [], [tensor.name], value=tensor, name=f"c{i}"))
        del model.graph.initializer[:]
    sums = [helper.make_node("ReduceSum", [w], [f"s{w}"], keepdims=0, name=f"sum_{w}") for w in ("w0", "w1", "w2")]
    model.graph.node.extend(sums)
    model.graph.output.extend(helper.make_tensor_value_info(f"s{w}", TensorProto.FLOAT, []) for w in ("w0", "w1", "w2"))
    src = tmp_path / "m.onnx"
    onnx.save(model, str(src))
    assert src.stat().st_size < 60 * 1024
    result = api.rewrite_onnx(src, tmp_path / "out.onnx")
    assert sorted(p.name for p in result.outputs) == ["out.onnx", "out.onnx.data"]
    check_runs_like(model, tmp_path / "out.onnx")


@pytest.mark.parametrize("modified", [True, False])
def test_without_external_data_the_inputs_file_weights_are_read_in(tmp_path, modified):
    """rewrite_onnx(..., external_data=False) on an external-data input left the tensors it did
    not convert pointing at the input's file, by a path relative to the output's folder: the
    output did not load elsewhere (and silently depended on the input's file beside it)."""
    model = mlp()
    src = tmp_path / "m.onnx"
    save_external(model, src)
    (tmp_path / "out").mkdir()
    if not modified:  # an output pinned all FP32, rewritten again: the nothing-to-rewrite copy
        api.rewrite_onnx(src, tmp_path / "pinned.onnx", fp32_ops=["MatMul"], external_data=True)
        src = tmp_path / "pinned.onnx"
        assert external_names(src)
    result = api.rewrite_onnx(src, tmp_path / "out" / "o.onnx", external_data=False)
    assert result.modified is modified
    assert [p.name for p in result.outputs] == ["o.onnx"]
    assert external_names(tmp_path / "out" / "o.onnx") == {}
    onnx.checker.check_model(str(tmp_path / "out" / "o.onnx"), full_check=True)
    check_runs_like(model, tmp_path / "out" / "o.onnx")


def test_no_empty_data_file_is_written(tmp_path):
    """An external-data input whose output tensors all stay inline (each under the 1 KiB threshold)
    left an empty, unreferenced out.onnx.data."""
    rng = np.random.default_rng(0)
    weights = {f"w{i}": rng.standard_normal((8, 8)).astype(np.float32) for i in range(3)}
    model = mlp(weights)
    for inp in [*model.graph.input, *model.graph.output]:
        inp.type.tensor_type.shape.dim[1].dim_value = 8
    src = tmp_path / "m.onnx"
    save_external(model, src)
    result = api.rewrite_onnx(src, tmp_path / "out.onnx")
    assert [p.name for p in result.outputs] == ["out.onnx"]
    assert not (tmp_path / "out.onnx.data").exists()
    assert external_names(tmp_path / "out.onnx") == {}


def test_a_function_constant_kept_outside_is_read_into_the_output(tmp_path):
    """A model-local function's Constant with its tensor in a file: the loader and the emitter
    walked the graphs only, so the output pointed at the input's file from another folder (exit 0,
    the checker and onnxruntime refused it)."""
    w = (np.random.default_rng(0).standard_normal((H, H)) / 8).astype(np.float32)
    const = helper.make_node("Constant", [], ["w"], value=numpy_helper.from_array(w, "fw"))
    fn = helper.make_function("local", "Proj", ["a"], ["b"], [const, helper.make_node("MatMul", ["a", "w"], ["b"])],
                              [helper.make_opsetid("", 17)])
    nodes = [helper.make_node("Proj", ["x"], ["p"], domain="local", name="proj"),
             helper.make_node("MatMul", ["p", "v"], ["y"], name="mm")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, H])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, H])],
                              [numpy_helper.from_array(w, "v")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("local", 1)],
                              ir_version=8, functions=[fn])
    src = tmp_path / "m.onnx"
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    onnx.save_model(copy, str(src), save_as_external_data=True, all_tensors_to_one_file=True, location="fw.bin",
                    size_threshold=0, convert_attribute=True)
    assert any(a.t.data_location == TensorProto.EXTERNAL for a in onnx.load(str(src), load_external_data=False)
               .functions[0].node[0].attribute)
    (tmp_path / "out").mkdir()
    api.rewrite_onnx(src, tmp_path / "out" / "o.onnx")
    onnx.checker.check_model(str(tmp_path / "out" / "o.onnx"), full_check=True)
    check_runs_like(model, tmp_path / "out" / "o.onnx")


def _external_constant_model(tmp_path: Path) -> tuple[onnx.ModelProto, Path]:
    """A main-graph Constant read by a ReduceSum (FP32), its tensor in external data."""
    c = np.full(50_000, 0.001, np.float32)
    nodes = [helper.make_node("Constant", [], ["c"], name="cst", value=numpy_helper.from_array(c, "c")),
             helper.make_node("ReduceSum", ["c"], ["s"], name="rsum", keepdims=0),
             helper.make_node("MatMul", ["x", "v"], ["y"], name="mm")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, H])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, H]),
                               helper.make_tensor_value_info("s", TensorProto.FLOAT, [])],
                              [numpy_helper.from_array(np.eye(H, dtype=np.float32), "v")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    src = tmp_path / "m.onnx"
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    onnx.save_model(copy, str(src), save_as_external_data=True, all_tensors_to_one_file=True, location="m.bin",
                    size_threshold=0, convert_attribute=True)
    return model, src


def test_a_main_graph_constant_kept_outside_stays_in_the_outputs_data_file(tmp_path):
    """It was read into the output .onnx: the layout changed silently, and a 2 GB one broke
    protobuf's limit (internal error, exit 70, 12 GB of memory)."""
    model, src = _external_constant_model(tmp_path)
    out = tmp_path / "o.onnx"
    api.rewrite_onnx(src, out)
    onnx.checker.check_model(str(out), full_check=True)
    written = onnx.load(str(out), load_external_data=False)
    [c] = [t for t in written.graph.initializer if t.name == "c"]
    assert c.data_location == TensorProto.EXTERNAL and out.stat().st_size < 50_000
    assert not any(n.op_type == "Constant" for n in written.graph.node)
    x = np.random.default_rng(1).standard_normal((2, H)).astype(np.float32)
    ref, got = run_onnx(model, {"x": x}), run_onnx(out, {"x": x})
    assert np.isclose(got["s"], ref["s"]) and np.abs(got["y"] - ref["y"]).max() < 1e-2
    again = tmp_path / "again.onnx"
    assert not api.rewrite_onnx(out, again).modified


def test_a_constant_kept_outside_and_converted_stays_in_the_outputs_data_file(tmp_path):
    """Only a Constant left FP32 went to the data file: one converted to FP16 (a MatMul's weight
    as a Constant) was read into the output .onnx, where a 4 GB one would pass protobuf's limit."""
    w = (np.random.default_rng(0).standard_normal((H, H)) / 8).astype(np.float32)
    nodes = [helper.make_node("Constant", [], ["w"], name="cw", value=numpy_helper.from_array(w, "w")),
             helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, H])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, H])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    onnx.save_model(copy, str(tmp_path / "m.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="m.bin", size_threshold=1024, convert_attribute=True)
    out = tmp_path / "o.onnx"
    api.rewrite_onnx(tmp_path / "m.onnx", out)
    onnx.checker.check_model(str(out), full_check=True)
    written = onnx.load(str(out), load_external_data=False)
    [t] = [t for t in written.graph.initializer if t.name == "w"]
    assert t.data_location == TensorProto.EXTERNAL and t.data_type == TensorProto.FLOAT16
    assert out.stat().st_size < w.nbytes // 4
    x = np.random.default_rng(1).standard_normal((2, H)).astype(np.float32)
    assert np.abs(run_onnx(out, {"x": x})["y"] - run_onnx(model, {"x": x})["y"]).max() < 1e-2
    assert not api.rewrite_onnx(out, tmp_path / "again.onnx").modified


def test_a_proto_over_the_limit_is_an_output_error_not_an_internal_error(tmp_path, monkeypatch):
    import google.protobuf.message

    from amp_rewrite.errors import OutputError

    def too_big(*args, **kwargs):
        raise google.protobuf.message.EncodeError("Failed to serialize proto")

    model, src = _external_constant_model(tmp_path)
    monkeypatch.setattr(onnx_emitter.ir, "save", too_big)
    with pytest.raises(OutputError, match="does not fit in one protobuf"):
        api.rewrite_onnx(src, tmp_path / "o.onnx")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.bin", "m.onnx"]


def test_sparse_external_data_is_read_beside_the_model_not_in_the_working_directory(tmp_path, monkeypatch):
    """A sparse initializer's values kept in a file were read relative to the working directory:
    from elsewhere the model failed to load, and an unrelated file of that name there was read as
    its weights (exit 0)."""
    rng = np.random.default_rng(0)
    dense = (rng.standard_normal((H, H)) / 8).astype(np.float32)
    dense[dense < 0] = 0
    idx = np.flatnonzero(dense).astype(np.int64)
    values = numpy_helper.from_array(dense.reshape(-1)[idx], "w0")
    indices = numpy_helper.from_array(idx, "w0_idx")
    model = mlp()
    model.graph.initializer.remove(next(t for t in model.graph.initializer if t.name == "w0"))
    src = tmp_path / "model" / "m.onnx"
    src.parent.mkdir()
    (src.parent / "w.bin").write_bytes(values.raw_data + indices.raw_data)
    offset = 0
    for tensor in (values, indices):  # (onnx.save keeps sparse tensors inline: moved out by hand)
        size = len(tensor.raw_data)
        tensor.ClearField("raw_data")
        tensor.data_location = TensorProto.EXTERNAL
        for key, value in (("location", "w.bin"), ("offset", str(offset)), ("length", str(size))):
            entry = tensor.external_data.add()
            entry.key, entry.value = key, value
        offset += size
    model.graph.sparse_initializer.append(helper.make_sparse_tensor(values, indices, [H, H]))
    onnx.save(model, str(src))
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    (elsewhere / "w.bin").write_bytes(np.full(1 << 16, 7, np.float32).tobytes())  # an unrelated file
    monkeypatch.chdir(elsewhere)
    api.rewrite_onnx(src, tmp_path / "o.onnx")
    out = weights_of(tmp_path / "o.onnx")["w0"]
    np.testing.assert_allclose(out.astype(np.float32), dense, atol=1e-3)


def test_a_model_in_memory_with_unloaded_external_data_is_refused():
    """rewrite(ModelProto) whose tensors still name their files (onnx.load(...,
    load_external_data=False)): a raw FileNotFoundError, or, with a file of that name in the
    working directory, that file's bytes as weights."""
    import tempfile

    import amp_rewrite
    from amp_rewrite.errors import ModelLoadError

    with tempfile.TemporaryDirectory() as tmp:
        save_external(mlp(), Path(tmp) / "m.onnx")
        proto = onnx.load(str(Path(tmp) / "m.onnx"), load_external_data=False)
    with pytest.raises(ModelLoadError, match=r"keeps its data in the file 'm\.onnx\.weights'.*onnx\.load\(path\)"):
        amp_rewrite.rewrite(proto)


def test_a_model_in_memory_whose_sparse_initializer_keeps_its_values_in_a_file_is_refused(tmp_path, monkeypatch):
    """The same for a sparse initializer's values (a walk of the dense tensors leaves them out): a
    file of that name in the working directory, another model's, must not be read as its weights."""
    import amp_rewrite
    from amp_rewrite.errors import ModelLoadError

    monkeypatch.chdir(tmp_path)
    np.full(64, 7.0, np.float32).tofile(tmp_path / "weights.bin")  # another model's data
    values = helper.make_tensor("W", TensorProto.FLOAT, [4], np.zeros(4, np.float32))
    values.ClearField("float_data")
    values.data_location = TensorProto.EXTERNAL
    for key, value in (("location", "weights.bin"), ("offset", "0"), ("length", "16")):
        entry = values.external_data.add()
        entry.key, entry.value = key, value
    m = onnx.parser.parse_model("""<ir_version: 8, opset_import: ["" : 17]>
    g (float[2, 4] x) => (float[2, 4] y) { y = MatMul(x, W) }""")
    m.graph.sparse_initializer.append(helper.make_sparse_tensor(
        values, numpy_helper.from_array(np.array([0, 5, 10, 15], np.int64), "W_idx"), [4, 4]))
    with pytest.raises(ModelLoadError, match=r"tensor 'W' keeps its data in the file 'weights\.bin'.*onnx\.load\(path\)"):
        amp_rewrite.rewrite(m)


@pytest.mark.parametrize("defect, message", [
    ("short length", r"declares 100 bytes, but a tensor of its type and shape takes 16384"),
    ("directory", r"external data location 'd' of tensor 'w0' is not a file"),
    ("empty location", r"names no file"),
    ("negative offset", r"offset must be non-negative, got -16 for tensor 'w0'"),
])
def test_inconsistent_external_data_is_a_load_error(tmp_path, defect, message):
    """A declared length shorter than the tensor was read past (onnxruntime refuses the model); a
    directory as the location said 'has 2 hard links'; an empty location said the file was a link
    outside the model folder; a negative offset said only 'Error calling _deserialize_graph with: g'
    (onnx-ir's wrapper around the real error)."""
    from amp_rewrite.errors import ModelLoadError

    src = tmp_path / "m.onnx"
    save_external(mlp(), src)
    proto = onnx.load(str(src), load_external_data=False)
    w0 = next(t for t in proto.graph.initializer if t.name == "w0")
    entries = {e.key: e for e in w0.external_data}
    if defect == "short length":
        entries["length"].value = "100"
    elif defect == "directory":
        (tmp_path / "d").mkdir()
        entries["location"].value = "d"
    elif defect == "negative offset":
        if "offset" not in entries:
            entries["offset"] = w0.external_data.add(key="offset")
        entries["offset"].value = "-16"
    else:
        entries["location"].value = ""
    onnx.save(proto, str(src))
    with pytest.raises(ModelLoadError, match=message):
        api.rewrite_onnx(src, tmp_path / "out.onnx")
    assert not (tmp_path / "out.onnx").exists()


def test_small_tensors_in_external_data_give_the_shapes_the_same_model_inline_gives(tmp_path):
    """Saved with size_threshold=0, a Reshape's shape tensor is external: shape inference could not
    read it, the shapes after it were unknown and the skip-LayerNorm fusion was skipped; the
    output holds such small tensors inline, so a second rewrite fused what the first had not."""
    model = onnx.load(str(ROOT / "models" / "transformer_block_op13.onnx"))
    onnx.save_model(model, str(tmp_path / "inline.onnx"))
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    onnx.save_model(copy, str(tmp_path / "ext.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="ext.bin", size_threshold=0)
    ops = {}
    for stem in ("inline", "ext"):
        api.rewrite_onnx(tmp_path / f"{stem}.onnx", tmp_path / f"{stem}.1.onnx")
        ops[stem] = sorted(n.op_type for n in onnx.load(str(tmp_path / f"{stem}.1.onnx")).graph.node)
        again = api.rewrite_onnx(tmp_path / f"{stem}.1.onnx", tmp_path / f"{stem}.2.onnx")
        assert not again.modified, f"{stem}: a rewrite of the output changed it"
    assert ops["ext"] == ops["inline"]
    assert ops["ext"].count("SkipLayerNormalization") >= 1


def test_a_dangling_link_at_the_outputs_data_file_is_not_replaced_without_overwrite(tmp_path):
    """A dangling symlink does not 'exist': the output's .data went over it without --overwrite,
    where a dangling link at the output itself is refused (docs/exit-codes.md)."""
    from amp_rewrite.errors import OutputError

    save_external(mlp(), tmp_path / "m.onnx")
    link = tmp_path / "out.onnx.data"
    link.symlink_to(tmp_path / "gone.bin")
    with pytest.raises(OutputError, match=r"out\.onnx\.data: already exists"):
        api.rewrite_onnx(tmp_path / "m.onnx", tmp_path / "out.onnx")
    assert link.is_symlink() and not (tmp_path / "out.onnx").exists()
    api.rewrite_onnx(tmp_path / "m.onnx", tmp_path / "out.onnx", overwrite=True)
    assert not link.is_symlink() and link.stat().st_size > 0


def test_an_output_past_the_limit_without_external_data_is_told_to_use_it(tmp_path, monkeypatch):
    """external_data=False on an output past protobuf's 2 GB: the error said it did not fit 'even
    with its initializers in out.onnx.data', a file it had not been asked to write."""
    import google.protobuf.message

    from amp_rewrite.errors import OutputError

    def too_big(*args, **kwargs):
        raise google.protobuf.message.EncodeError("Failed to serialize proto")

    src = tmp_path / "m.onnx"
    onnx.save(mlp(), str(src))
    monkeypatch.setattr(onnx_emitter.ir, "save", too_big)
    with pytest.raises(OutputError) as caught:
        api.rewrite_onnx(src, tmp_path / "out.onnx", external_data=False)
    assert "without external data; write it with external data" in str(caught.value)
    assert ".data" not in str(caught.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]


@pytest.mark.skipif(sys.platform != "linux", reason="file names of arbitrary bytes")
def test_a_non_utf8_output_name_is_refused_for_external_data_and_shown_escaped_in_reports(tmp_path):
    """-o out<0xfe>.onnx with external data was exit 70 (a SerdeError: the model names its data file
    in UTF-8), and an .html/.md report of such a path a UnicodeEncodeError."""
    import os as _os

    from amp_rewrite.errors import OutputError
    from amp_rewrite.report import write_report

    src = tmp_path / "m.onnx"
    save_external(mlp(), src)
    bad = Path(_os.fsdecode(_os.fsencode(str(tmp_path)) + b"/out\xfe.onnx"))
    with pytest.raises(OutputError, match="not valid UTF-8"):
        api.rewrite_onnx(src, bad)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx", "m.onnx.weights"]
    result = api.rewrite_onnx(src, tmp_path / "out.onnx")
    report = result.report
    report.output = str(bad)
    for suffix in (".html", ".md"):
        write_report(report, tmp_path / f"r{suffix}")
        assert "out\\udcfe.onnx" in (tmp_path / f"r{suffix}").read_text()


@pytest.mark.parametrize("location, needle", [("missing.bin", "external data file 'missing.bin' is missing"),
                                              ("../outside.bin", "external data location '../outside.bin' is not a file name relative")])
def test_a_sparse_initializers_bad_external_data_is_a_read_error(tmp_path, location, needle):
    """A sparse initializer whose values name a missing file or one outside the folder was exit 5,
    'cannot be densified; store it as a dense tensor'; the same fault in a dense tensor is exit 3
    (docs/exit-codes.md), naming the file."""
    from onnx.external_data_helper import set_external_data

    from amp_rewrite.errors import ModelLoadError

    (tmp_path / "d").mkdir()
    np.arange(8, dtype=np.float32).tofile(tmp_path / "outside.bin")
    m = onnx.parser.parse_model("""<ir_version: 8, opset_import: ["" : 17]>
    g (float[2, 8] x) => (float[2, 8] y) { h = MatMul(x, W)  y = Add(h, S) }""")
    m.graph.initializer.append(numpy_helper.from_array(np.ones((8, 8), np.float32), "W"))
    values = helper.make_tensor("S", TensorProto.FLOAT, [8], np.zeros(8, np.float32))
    values.ClearField("float_data")
    values.raw_data = b"\0" * 32
    set_external_data(values, location, offset=0, length=32)
    values.data_location = TensorProto.EXTERNAL
    values.ClearField("raw_data")
    m.graph.sparse_initializer.append(helper.make_sparse_tensor(
        values, helper.make_tensor("i", TensorProto.INT64, [8], list(range(8))), [8]))
    onnx.save(m, str(tmp_path / "d" / "m.onnx"))
    with pytest.raises(ModelLoadError, match=f"sparse initializer 'S': {re.escape(needle)}"):
        api.rewrite_onnx(tmp_path / "d" / "m.onnx", tmp_path / "d" / "o.onnx")
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["m.onnx"]


def _custom_attribute_model(folder: Path) -> tuple[onnx.ModelProto, np.ndarray, Path]:
    """MatMul → custom:Foo(t=<16x16 tensor>), saved with the attribute's tensor in ``weights.bin``
    (``convert_attribute=True``). Returns the model, t's values and the saved path."""
    t = np.arange(256, dtype=np.float32).reshape(16, 16)
    w = (np.random.default_rng(0).standard_normal((16, 16)) / 4).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"], name="mm"),
             helper.make_node("Foo", ["h"], ["y"], name="foo", domain="custom", t=numpy_helper.from_array(t, "t"))]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 16])],
                              [numpy_helper.from_array(w, "W")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("custom", 1)],
                              ir_version=8)
    folder.mkdir()
    src = folder / "m.onnx"
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    onnx.save_model(copy, str(src), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="weights.bin", size_threshold=0, convert_attribute=True)
    [attr] = next(n for n in onnx.load(str(src), load_external_data=False).graph.node if n.op_type == "Foo").attribute
    assert attr.t.data_location == TensorProto.EXTERNAL
    return model, t, src


def test_a_custom_ops_tensor_attribute_kept_outside_is_read_beside_the_model(tmp_path, monkeypatch):
    """A custom op's tensor attribute stored outside is bound to the model's folder, as Constant's
    and ConstantOfShape's are: left relative to the working directory, the output written from
    another one (exit 0) would name a file that is not there, and onnx.load would refuse it."""
    model, t, src = _custom_attribute_model(tmp_path / "m")
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    out = tmp_path / "out.onnx"
    api.rewrite_onnx(src, out)
    written = onnx.load(str(out))  # loads with its data
    [attr] = next(n for n in written.graph.node if n.op_type == "Foo").attribute
    assert attr.name == "t"
    np.testing.assert_array_equal(numpy_helper.to_array(attr.t), t)


def test_a_custom_ops_tensor_attribute_with_a_missing_file_is_a_load_error(tmp_path, monkeypatch):
    """The same model with the attribute's file gone is refused on load, naming the file and the
    attribute (a ModelLoadError: exit 3 from the CLI), and no output is written."""
    from amp_rewrite.errors import ModelLoadError

    _, _, src = _custom_attribute_model(tmp_path / "m")
    proto = onnx.load(str(src), load_external_data=False)
    [attr] = next(n for n in proto.graph.node if n.op_type == "Foo").attribute
    next(e for e in attr.t.external_data if e.key == "location").value = "gone.bin"  # W stays in weights.bin
    onnx.save(proto, str(src))
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    with pytest.raises(ModelLoadError, match=r"external data file 'gone\.bin' for tensor 'foo\.t' is missing"):
        api.rewrite_onnx(src, tmp_path / "out.onnx")
    assert not (tmp_path / "out.onnx").exists()


def test_an_external_data_file_one_byte_short_is_a_load_error(tmp_path):
    """An external data file one byte shorter than its last tensor needs is truncated: refused on
    load, naming the file and the tensor, and no output is written."""
    from amp_rewrite.errors import ModelLoadError

    src = tmp_path / "m.onnx"
    save_external(mlp(), src)
    data = tmp_path / "m.onnx.weights"
    data.write_bytes(data.read_bytes()[:-1])
    with pytest.raises(ModelLoadError, match=r"external data file 'm\.onnx\.weights' is too short for tensor 'w2'"):
        api.rewrite_onnx(src, tmp_path / "out.onnx")
    assert not (tmp_path / "out.onnx").exists()


def test_a_constant_of_shape_value_kept_outside_is_read_beside_the_model(tmp_path, monkeypatch):
    """ConstantOfShape's ``value`` stored outside (``convert_attribute=True``) is bound to the model's
    folder: the rewrite, run from another working directory, reads it and writes it out."""
    graph = helper.make_graph(
        [helper.make_node("ConstantOfShape", ["shape"], ["c"], name="fill",
                          value=numpy_helper.from_array(np.array([0.5], np.float32))),
         helper.make_node("Add", ["x", "c"], ["y"], name="add")], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, H])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, H])],
        [numpy_helper.from_array(np.array([2, H], np.int64), "shape")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    (tmp_path / "m").mkdir()
    src = tmp_path / "m" / "m.onnx"
    onnx.save_model(model, str(src), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="weights.bin", size_threshold=0, convert_attribute=True)
    [attr] = next(n for n in onnx.load(str(src), load_external_data=False).graph.node
                  if n.op_type == "ConstantOfShape").attribute
    assert attr.t.data_location == TensorProto.EXTERNAL
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    out = tmp_path / "out.onnx"
    api.rewrite_onnx(src, out)
    [attr] = next(n for n in onnx.load(str(out)).graph.node if n.op_type == "ConstantOfShape").attribute
    np.testing.assert_array_equal(numpy_helper.to_array(attr.t), np.array([0.5], np.float32))

