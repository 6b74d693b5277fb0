"""tools/bench_train trains the same model from the same weights three ways (FP32, autocast with
GradScaler, amp-rewrite's training rewrite with LossScaler) and prints how each went."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from util import ROOT

pytest.importorskip("torch")


@pytest.mark.parametrize("target", ["fp16", "bf16"])
def test_every_variant_learns_and_the_low_ones_follow_fp32(tmp_path, target):
    out = tmp_path / "train.json"
    proc = subprocess.run([sys.executable, "-m", "tools.bench_train", "--device", "cpu", "--target", target,
                           "--size", "tiny", "--steps", "30", "--lr", "1e-2", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "No GPU was available" in proc.stdout
    result = json.loads(out.read_text())
    rows = {r["variant"]: r for r in result["rows"]}
    assert list(rows) == ["fp32", "autocast+GradScaler", "rewrite+LossScaler"]
    for name, row in rows.items():
        assert row["finite"] and row["skipped"] == 0, (name, row)
        assert row["last_loss"] < row["first_loss"] - 0.1, (name, row)  # it learns the repeated pattern
        assert name in proc.stdout
    # The low-precision runs track FP32; the rewrite tracks autocast, whose precisions it matches.
    low = rows["rewrite+LossScaler"]
    assert low["last_loss_rel_diff"] < (1e-2 if target == "fp16" else 5e-2), low
    curve, ref = result["losses"]["rewrite+LossScaler"], result["losses"]["autocast+GradScaler"]
    assert max(abs(a - b) for a, b in zip(curve, ref)) < 2e-2
    # FP16 trains under a loss scale; BF16 has none.
    assert (low["final_scale"] == 65536.0) if target == "fp16" else (low["final_scale"] == 1.0), low


def test_a_step_count_too_short_to_compare_is_refused():
    proc = subprocess.run([sys.executable, "-m", "tools.bench_train", "--device", "cpu", "--steps", "5"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "at least 10" in proc.stderr and "Traceback" not in proc.stderr
