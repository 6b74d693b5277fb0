"""Run the property-based tests of tests/test_properties.py on many more random models.

    python tools/fuzz.py --examples 2000            # fresh randomness, stops after --max-failures
    python tools/fuzz.py --examples 500 --seed 7    # reproducible
    python tools/fuzz.py --examples 300 --max-ops 20 --save failures/

The test suite runs a small derandomized sample in CI; this runs as many examples as you ask for, in
batches with different seeds so that one failure (shrunk by hypothesis, printed with its
``@reproduce_failure`` blob and, with --save, written as ``failure-N.onnx`` + ``.npz`` feeds) does
not end the run. Prints how many examples ran, how many were rewritten, run in onnxruntime and
compared numerically, and every distinct failure.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=2000, help="examples to run in total")
    parser.add_argument("--batch", type=int, default=250, help="examples per hypothesis run (one seed each)")
    parser.add_argument("--seed", type=int, default=None, help="base seed (default: random)")
    parser.add_argument("--max-ops", type=int, default=12, help="op families drawn per graph scope")
    parser.add_argument("--max-failures", type=int, default=5, help="stop after this many distinct failures")
    parser.add_argument("--save", type=Path, default=None, help="folder for failing models and feeds")
    args = parser.parse_args(argv)

    import numpy as np
    import onnx
    from hypothesis import HealthCheck, Phase, given, seed, settings

    import test_properties as tp

    base_seed = args.seed if args.seed is not None else int(time.time())
    worker = tp.OrtWorker()
    stats: Counter = Counter()
    issues: Counter = Counter()
    failures: dict[str, str] = {}
    started = time.time()
    batch_no = 0
    try:
        while stats["examples"] < args.examples and len(failures) < args.max_failures:
            n = min(args.batch, args.examples - stats["examples"])
            last: dict = {}

            def one(ex) -> None:
                if last.get("failed"):  # hypothesis is shrinking a failure: not a fresh example
                    stats["shrink calls"] += 1
                    last["ex"] = ex
                    tp.check_example(ex, worker)
                    return
                last["ex"] = ex
                stats["examples"] += 1
                try:
                    facts = tp.check_example(ex, worker)
                except BaseException:
                    last["failed"] = True
                    raise
                stats["passed"] += 1
                stats["rewritten"] += bool(facts.get("modified"))
                stats["ran in onnxruntime"] += bool(facts.get("ran"))
                stats["compared numerically"] += bool(facts.get("compared"))
                if facts.get("ort_optimizer_issue"):
                    stats["onnxruntime optimiser failed, ran correctly without (not ours)"] += 1
                    issues[facts["ort_optimizer_issue"]] += 1
                stats[f"target={ex.options['target']}"] += 1
                stats["main-graph nodes"] += len(ex.model.graph.node)
                stats["control-flow nodes"] += _count_control_flow(ex.model.graph)

            test = settings(max_examples=n, deadline=None, database=None, derandomize=False, print_blob=True,
                            phases=[Phase.generate, Phase.shrink],
                            suppress_health_check=list(HealthCheck))(given(ex=tp.models(max_ops=args.max_ops))(one))
            test = seed(base_seed + batch_no)(test)
            try:
                test()
            except Exception as exc:  # a property failed: hypothesis has shrunk it already
                key = _failure_key(exc)
                text = "".join(traceback.format_exception(exc))[-6000:]
                if key not in failures:
                    failures[key] = text
                    print(f"\n=== failure {len(failures)} (seed {base_seed + batch_no}) ===\n{text}", flush=True)
                    if args.save is not None and "ex" in last:
                        args.save.mkdir(parents=True, exist_ok=True)
                        stem = args.save / f"failure-{len(failures)}"
                        onnx.save(last["ex"].model, str(stem.with_suffix(".onnx")))
                        np.savez(stem.with_suffix(".npz"), **last["ex"].feeds)
                        stem.with_suffix(".txt").write_text(f"options: {last['ex'].options}\n\n{text}")
            batch_no += 1
            rate = stats["examples"] / (time.time() - started)
            print(f"[{time.time() - started:6.0f}s] {stats['examples']} examples, {len(failures)} failures "
                  f"({rate:.1f}/s)", flush=True)
    finally:
        worker.close()

    elapsed = time.time() - started
    print(f"\nexamples run: {stats['examples']} in {elapsed:.0f}s (seed {base_seed}, max-ops {args.max_ops}; "
          f"plus {stats['shrink calls']} shrinking calls)")
    for key in ("passed", "rewritten", "ran in onnxruntime", "compared numerically",
                "onnxruntime optimiser failed, ran correctly without (not ours)", "target=fp16", "target=bf16", "main-graph nodes",
                "control-flow nodes"):
        print(f"  {key}: {stats[key]}")
    for kind, count in issues.most_common():
        print(f"    {count} x {kind}")
    print(f"distinct failures: {len(failures)}")
    for i, key in enumerate(failures, 1):
        print(f"  {i}. {key}")
    return 1 if failures else 0


def _count_control_flow(graph) -> int:
    import onnx

    count = 0
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                count += 1 + _count_control_flow(attr.g)
    return count


def _failure_key(exc: BaseException) -> str:
    """First line of the innermost message, digits blurred, so repeats of one bug count once."""
    import re

    inner = exc
    while isinstance(inner, BaseExceptionGroup) and inner.exceptions:
        inner = inner.exceptions[0]
    first = (str(inner).strip().splitlines() or [type(inner).__name__])[0]
    return f"{type(inner).__name__}: " + re.sub(r"\d+(\.\d+)?", "N", first)[:160]


if __name__ == "__main__":
    sys.exit(main())
