"""tools/snapshot records what every rewrite decided and reports what a change moved."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from util import ROOT

pytest.importorskip("tools.corpus")

from tools import snapshot  # noqa: E402

MODEL = "synthetic/transformer-block-op17"


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    out = tmp_path_factory.mktemp("snap") / "a.json"
    proc = subprocess.run([sys.executable, "-m", "tools.snapshot", "record", str(out), "--models", MODEL],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def test_a_snapshot_records_each_placement_with_its_casts_and_decisions(recorded):
    snap = json.loads(recorded.read_text())
    assert snap["target"] == "fp16"
    assert set(snap["models"]) == {f"{MODEL} greedy", f"{MODEL} optimal"}
    entry = snap["models"][f"{MODEL} optimal"]
    assert entry["casts"] > 0 and entry["nodes"] > entry["casts"]
    precisions = {p for p, _ in entry["decisions"].values()}
    assert {"fp16", "fp32"} <= precisions  # (a transformer block keeps its softmax island FP32)


def test_compare_is_quiet_on_equal_snapshots_and_names_a_moved_node(recorded, tmp_path, capsys):
    assert snapshot.compare(recorded, recorded) == 0
    assert "2 unchanged, 0 changed" in capsys.readouterr().out
    snap = json.loads(recorded.read_text())
    entry = snap["models"][f"{MODEL} greedy"]
    node = next(n for n, (p, _) in entry["decisions"].items() if p == "fp16")
    entry["decisions"][node][0] = "fp32"
    entry["casts"] += 2
    moved = tmp_path / "b.json"
    moved.write_text(json.dumps(snap))
    assert snapshot.compare(recorded, moved) == 1
    out = capsys.readouterr().out
    assert f"{MODEL} greedy: casts {entry['casts'] - 2}->{entry['casts']}" in out
    assert f"{node} fp16->fp32" in out and "1 unchanged, 1 changed" in out
