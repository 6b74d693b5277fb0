"""Decision snapshot of the corpus: what every rewrite decided, to diff before and after a change.

A change to the rules or the passes should move only the decisions it means to move. This records,
for every corpus model (``tools.corpus``) and placement, each node's precision and reason step, the
Casts in the written model (main graph and subgraphs) and the clamp nodes added, and compares two
snapshots model by model::

    python -m tools.snapshot record before.json            # all 40 models x greedy/optimal, ~3 min
    python -m tools.snapshot record after.json --models 'hf/*' --target bf16
    python -m tools.snapshot compare before.json after.json

``compare`` prints one line per (model, placement) whose Cast count or decisions changed, with the
nodes whose precision moved, then a count of those unchanged. It exits 1 when anything changed, so a
refactoring can be checked with ``compare && echo unchanged``.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import sys
from collections import Counter
from pathlib import Path

PLACEMENTS = ("greedy", "optimal")


def _casts(graph) -> int:
    count = 0
    for node in graph.node:
        count += node.op_type == "Cast" and node.domain in ("", "ai.onnx")
        for attr in node.attribute:
            for sub in [attr.g] if attr.HasField("g") else list(attr.graphs):
                count += _casts(sub)
    return count


def _ops(graph, counter: Counter) -> Counter:
    for node in graph.node:
        counter[node.op_type] += 1
        for attr in node.attribute:
            for sub in [attr.g] if attr.HasField("g") else list(attr.graphs):
                _ops(sub, counter)
    return counter


def record_one(model, target: str, placement: str) -> dict:
    from amp_rewrite.api import rewrite_onnx_model

    result = rewrite_onnx_model(model, target=target, placement=placement)
    report = result.report
    decisions = {d.node: [report.precision_of(d), d.step] for d in result.log.decisions.values()}
    ops = _ops(result.model.graph, Counter())
    return {"casts": _casts(result.model.graph), "clips": ops.get("Clip", 0), "nodes": sum(ops.values()),
            "decisions": decisions}


def record(out: Path, patterns: list[str], target: str) -> None:
    from tools.corpus import build, list_models

    names = [n for n in list_models("full") if not patterns or any(fnmatch.fnmatch(n, p) for p in patterns)]
    snap: dict[str, dict] = {}
    for name in names:
        model = build(name).model
        for placement in PLACEMENTS:
            key = f"{name} {placement}"
            try:
                snap[key] = record_one(model, target, placement)
            except Exception as exc:  # noqa: BLE001 - a failing rewrite is a snapshot entry too
                snap[key] = {"error": f"{type(exc).__name__}: {exc}"}
            entry = snap[key]
            print(f"{key}: {entry.get('error') or str(entry['casts']) + ' casts'}", file=sys.stderr)
    out.write_text(json.dumps({"target": target, "models": snap}, indent=1, sort_keys=True))


def compare(a_path: Path, b_path: Path, limit: int = 8) -> int:
    a, b = (json.loads(Path(p).read_text())["models"] for p in (a_path, b_path))
    same = changed = 0
    for key in sorted(set(a) | set(b)):
        x, y = a.get(key), b.get(key)
        if x == y:
            same += 1
            continue
        changed += 1
        if x is None or y is None:
            print(f"{key}: only in {'the second' if x is None else 'the first'} snapshot")
            continue
        if "error" in x or "error" in y:
            print(f"{key}: {x.get('error', 'ok')} -> {y.get('error', 'ok')}")
            continue
        dx, dy = x["decisions"], y["decisions"]
        moved = [f"{n} {dx[n][0]}->{dy[n][0]}" for n in sorted(set(dx) & set(dy)) if dx[n][0] != dy[n][0]]
        steps = sum(1 for n in set(dx) & set(dy) if dx[n][0] == dy[n][0] and dx[n][1] != dy[n][1])
        nodes = len(set(dy) - set(dx)) - len(set(dx) - set(dy))
        print(f"{key}: casts {x['casts']}->{y['casts']}, clips {x['clips']}->{y['clips']}, "
              f"{len(moved)} moved, {steps} re-reasoned, {nodes:+d} decided nodes")
        for line in moved[:limit]:
            print(f"    {line}")
        if len(moved) > limit:
            print(f"    ... {len(moved) - limit} more")
    print(f"{same} unchanged, {changed} changed")
    return 1 if changed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.snapshot", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="rewrite the corpus and write the snapshot")
    rec.add_argument("out", type=Path)
    rec.add_argument("--models", action="append", default=[], help="glob of corpus names (repeatable)")
    rec.add_argument("--target", default="fp16", choices=("fp16", "bf16"))
    cmp = sub.add_parser("compare", help="print what changed between two snapshots")
    cmp.add_argument("a", type=Path)
    cmp.add_argument("b", type=Path)
    args = parser.parse_args(argv)
    if args.command == "record":
        record(args.out, args.models, args.target)
        return 0
    return compare(args.a, args.b)


if __name__ == "__main__":
    sys.exit(main())
