"""tools/gpu_sweep without a GPU: the CPU provider stands in for CUDA, so preparing onnx's operator
test cases, running them in a child process and sorting the findings run on any machine. The
findings themselves come from a GPU (the closing notes and BENCHMARKS.md say which)."""

from __future__ import annotations

import lzma
import pickle

import pytest

pytest.importorskip("onnx.backend.test.case.node")

from tools import gpu_sweep  # noqa: E402


def test_prepare_wraps_each_case_in_matmuls_and_rewrites_it(tmp_path):
    import onnx

    path = gpu_sweep.prepare(tmp_path, "fp16", ["ScatterND"], lambda _m: None)
    cases = pickle.loads(lzma.decompress(path.read_bytes()))["cases"]
    assert cases and all("ScatterND" in c["ops"] for c in cases)
    for case in cases:
        fp32, low = onnx.load_from_string(case["fp32"]), onnx.load_from_string(case["low"])
        assert [n.op_type for n in fp32.graph.node].count("MatMul") >= 2  # the identity MatMuls around the op
        scatter = next(n for n in low.graph.node if n.op_type == "ScatterND")
        tags = {m.key: m.value for m in scatter.metadata_props}
        reduction = next((a.s.decode() for a in scatter.attribute if a.name == "reduction"), "none")
        # painted low between the MatMuls; an accumulating one (add, mul) keeps FP32 as a reduction
        assert tags["amp_rewrite.precision"] == ("fp32" if reduction in ("add", "mul") else "low"), tags


def test_run_records_placement_and_errors(tmp_path, monkeypatch):
    path = gpu_sweep.prepare(tmp_path, "fp16", ["ScatterND"], lambda _m: None)
    monkeypatch.setattr(gpu_sweep, "PROVIDER", "CPUExecutionProvider")
    out = tmp_path / "r.jsonl"
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(gpu_sweep.tempfile, "tempdir", str(scratch))
    gpu_sweep.run_chunk(path, 0, 2, out)
    assert not list(scratch.iterdir())  # onnxruntime's profile files are gone with the chunk
    records = [r for r in map(__import__("json").loads, out.read_text().splitlines()) if "i" in r]
    assert [r["i"] for r in records] == [0, 1]
    for r in records:
        assert "MatMul" in r["fp32"]["cpu"]  # every node ran on the stand-in provider
        assert 0 <= r["low"]["rel_err"] < 1e-2 and r["low"]["new_nonfinite"] is False


def test_findings_sort_what_a_gpu_run_reports():
    base = {"cpu": {"Shape": 1}}
    records = [
        {"i": 0, "name": "ok", "fp32": base, "low": {"cpu": {"Shape": 1, "Cast": 2}, "rel_err": 1e-3}},
        {"i": 1, "name": "moved", "fp32": base, "low": {"cpu": {"Shape": 1, "BatchNormalization": 1}, "rel_err": 0}},
        {"i": 2, "name": "fails", "fp32": base, "low": {"error": "Fail: element_type 16 not implemented"}},
        {"i": 3, "name": "nan", "fp32": base, "low": {"cpu": {}, "rel_err": 0.9, "new_nonfinite": True}},
        {"i": 4, "crash": -11},
        {"i": 5, "name": "fp32 fails too", "fp32": {"error": "x"}, "low": {"error": "x"}},
    ]
    found = gpu_sweep.findings(records)
    assert found["moved to CPU"] == [("moved", {"BatchNormalization": 1})]  # (onnxruntime's Casts are not findings)
    assert [n for n, _ in found["fails where FP32 runs"]] == ["fails"]
    assert found["new NaN/Inf"] == [("nan", 0.9)]
    assert found["crashed"] == [("case 4", -11)]
    assert found["largest errors"][0] == (0.9, "nan")
    assert "moved to CPU: 1" in gpu_sweep.render(found, len(records), "fp16")
