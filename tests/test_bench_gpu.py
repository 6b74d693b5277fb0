"""tools/bench's GPU rows and tools/gpu_check without a GPU: the CUDA provider is swapped for the CPU
one, so the plumbing (conversions, latency with outputs, errors against FP32, the verdicts) runs on
any machine. The figures themselves come from a GPU (BENCHMARKS.md says which)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("tools.corpus")

from tools import bench, gpu_check  # noqa: E402

MODEL = "synthetic/cnn-bn-op17"


def _cpu_worker(args, timeout):
    if args[0] == "gpu-probe":
        return {"available": True, "gpu": "CPU stand-in", "onnxruntime": "x"}
    # (the CPU provider takes no CUDA options such as prefer_nhwc: they are dropped)
    args = ["CPUExecutionProvider" if a.startswith("CUDAExecutionProvider") else a for a in args]
    return _REAL(args, timeout)


_REAL = bench.run_worker


def test_gpu_rows_time_every_variant_and_measure_errors(monkeypatch, tmp_path):
    monkeypatch.setattr(bench, "run_worker", _cpu_worker)
    res = bench.bench_gpu([MODEL], tmp_path, 600, lambda _m: None)
    assert res["available"] and res["gpu"] == "CPU stand-in"
    # a convolutional model is also timed with the CUDA provider's prefer_nhwc layout
    assert [(r["batch"], r["options"]) for r in res["rows"]] == [(1, ""), (1, "prefer_nhwc"), (32, ""),
                                                                  (32, "prefer_nhwc")]
    for row in res["rows"]:
        for label in ("fp32", "amp-rewrite", "all-fp16"):
            assert row[label] is not None and row[label] > 0, row
        # both rewrites compute FP16 (emulated by the CPU provider's casts): close to FP32, not equal
        for label in ("amp-rewrite_rel_err", "all-fp16_rel_err"):
            assert 0 < row[label] < 5e-2, row
    meta = {"command": "python -m tools.bench", "date": "today", "machine": "here", "versions": {}}
    md = bench.render_markdown({"meta": meta, "models": [], "gpu": res, "conditions": []})
    assert "| " + MODEL + " | 32 |" in md and f"| {MODEL} (prefer_nhwc) | 32 |" in md and "speed-up over FP32" in md


@pytest.mark.parametrize(("fp32", "amp", "bound", "holds"), [
    (10.0, 5.0, 4.8, True),     # 2x over FP32, within 10% of the bound
    (10.0, 5.6, 5.0, False),    # 12% over the bound
    (10.0, 7.0, 6.9, False),    # only 1.43x over FP32
])
def test_gpu_condition_follows_the_figures(fp32, amp, bound, holds):
    rows = [{"model": m, "batch": b, "fp32": fp32, "amp-rewrite": amp, "all-fp16": bound}
            for m in bench.GPU_JUDGED for b in (1, 32)]
    cond = bench._gpu_condition({"available": True, "gpu": "g", "rows": rows})
    assert cond["holds"] is holds
    assert len(cond["failing"]) == (0 if holds else len(bench.GPU_JUDGED))


def test_gpu_condition_holds_under_one_set_of_session_options():
    rows = [{"model": m, "batch": 32, "options": o, "fp32": 10.0, "amp-rewrite": a, "all-fp16": 5.0}
            for m in bench.GPU_JUDGED for o, a in (("", 7.5), ("prefer_nhwc", 5.2))]
    cond = bench._gpu_condition({"available": True, "gpu": "g", "rows": rows})
    assert cond["holds"] is True and "prefer_nhwc" in cond["detail"]
    for r in rows:
        r["fp32"] = 7.0  # now under 1.5x with either options
    cond = bench._gpu_condition({"available": True, "gpu": "g", "rows": rows})
    assert cond["holds"] is False and len(cond["failing"]) == 2 * len(bench.GPU_JUDGED)


def test_gpu_condition_unjudged_without_gpu_and_failing_when_a_model_is_missing():
    assert bench._gpu_condition({"available": False, "reason": "no GPU"})["holds"] is None
    rows = [{"model": bench.GPU_JUDGED[0], "batch": 32, "fp32": 10.0, "amp-rewrite": 5.0, "all-fp16": 5.0}]
    cond = bench._gpu_condition({"available": True, "gpu": "g", "rows": rows})
    assert cond["holds"] is False and cond["failing"] == [f"{bench.GPU_JUDGED[1]} (not measured)"]


def test_gpu_check_prepares_runs_and_flags_ops_moved_to_the_cpu(tmp_path, monkeypatch):
    gpu_check.prepare(tmp_path, [MODEL], None, lambda _m: None)
    entry = tmp_path / MODEL.replace("/", "__")
    assert {p.name for p in entry.iterdir()} >= {"fp32.onnx", "fp16.onnx", "bf16.onnx", "feeds.npz", "meta.json"}
    monkeypatch.setattr(gpu_check, "PROVIDER", "CPUExecutionProvider")
    row = gpu_check.run_one(entry)
    fp16 = row["variants"]["fp16"]
    assert 0 < fp16["max_rel_err"] < 1e-2 and fp16["new_nonfinite"] == []
    # On the CPU provider every node runs there; onnxruntime adds Casts around FP16 ops that lack CPU
    # kernels, so the FP16 rewrite shows ops "moved to CPU" that the FP32 model does not run there.
    ok, why = gpu_check.verdict(row, "fp16")
    assert not ok and "moved to CPU" in why
    table = gpu_check.render({"gpu": "g", "onnxruntime": "x", "rows": [row]})
    assert MODEL in table and "FAIL: " in table
    json.dumps(row)  # what the child process prints


def test_gpu_check_verdict_accepts_a_clean_gpu_row():
    row = {"name": "m", "variants": {
        "fp32": {"placement": {"CUDAExecutionProvider": {"MatMul": 2}, "CPUExecutionProvider": {"Shape": 1}}},
        "fp16": {"placement": {"CUDAExecutionProvider": {"MatMul": 2, "Cast": 2},
                               "CPUExecutionProvider": {"Shape": 1}}, "max_rel_err": 1e-3, "new_nonfinite": []},
        "bf16": {"placement": {"CUDAExecutionProvider": {"MatMul": 2}, "CPUExecutionProvider": {"Shape": 1}},
                 "max_rel_err": 2e-2, "new_nonfinite": ["y"]}}}
    assert gpu_check.verdict(row, "fp16") == (True, "")
    ok, why = gpu_check.verdict(row, "bf16")
    assert not ok and "NaN/Inf in y" in why


def test_render_joins_a_gpu_machines_results(tmp_path, capsys):
    meta = {"command": "python -m tools.bench", "date": "today", "machine": "here", "versions": {}}
    cpu = tmp_path / "cpu.json"
    cpu.write_text(json.dumps({"meta": meta, "models": []}))
    rows = [{"model": m, "batch": 32, "options": "", "fp32": 10.0, "amp-rewrite": 5.0, "all-fp16": 4.9}
            for m in bench.GPU_JUDGED]
    gpu = tmp_path / "gpu.json"
    gpu.write_text(json.dumps({"meta": {**meta, "machine": "a GPU box"},
                               "gpu": {"available": True, "gpu": "Some GPU", "rows": rows}}))
    assert bench.main(["--render", str(cpu), "--gpu-from", str(gpu)]) == 0
    md = capsys.readouterr().out
    assert "GPU: Some GPU" in md and "a GPU box" in md and f"| {bench.GPU_JUDGED[0]} | 32 | 10.00 | 5.00 |" in md
    # a file with no GPU section gives a note, not a traceback
    gpu.write_text(json.dumps({"meta": meta}))
    assert bench.main(["--render", str(cpu), "--gpu-from", str(gpu)]) == 0
    assert "holds no GPU results" in capsys.readouterr().out
