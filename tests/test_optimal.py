"""Optimal cast placement (s–t minimum cut, amp_rewrite/passes/optimal.py).

- hand-built graphs whose optimum is known by hand: the cut finds it;
- a value read by several consumers across the cut costs one cast, not one per consumer;
- seeded random DAGs: the cut's cost equals a brute-force minimum over every labelling, deny and
  deny-painted nodes are never low, no FP32 → low → FP32 path appears, cast bytes never exceed
  greedy's;
- end to end: checker, onnxruntime, tolerance, a fixed point, and the report carries the bytes.
"""

from __future__ import annotations

import itertools
import random

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from util import full_check, make_model, nodes_by_type, rel_err, rewrite, run

from amp_rewrite.api import make_context
from amp_rewrite.decisions import Category, Precision
from amp_rewrite.frontends.onnx_loader import load_onnx
from amp_rewrite.passes import optimal
from amp_rewrite.passes.classify import classify
from amp_rewrite.passes.islands import find_islands
from amp_rewrite.passes.paint import paint


def _problem(model: onnx.ModelProto, *, allow_none: bool = False, **options) -> optimal.Problem | None:
    ctx = make_context(frontend="onnx", placement="optimal", **options)
    ir_model = load_onnx(model)
    for p in (classify, paint, find_islands):
        p(ir_model, ctx)
    problem = optimal.Problem.from_scope(ir_model.graph, ctx)
    assert allow_none or problem is not None
    return problem


def _precisions(result) -> dict[str, str]:
    return {d.node: d.precision.value for d in result.log.decisions.values()}


def _inserted(result) -> list:
    return [c for c in result.log.casts if c.kind == "inserted"]


def _cast_bytes(result) -> int:
    return sum(c.bytes_per_run for c in _inserted(result))


# -- hand-built graphs with a known optimum ------------------------------------------------------------
def test_free_nodes_downstream_of_low_ops_go_low_and_upstream_ones_keep_greedys_answer():
    # greedy: Relu (before the first allow op) and Sigmoid (after the last) stay FP32, casts on both
    # sides of the MatMul. Sigmoid reads the MatMul's fp16 output: low costs the same cast (moved
    # before the ReduceMean) and saves its FP32 traffic (2×16×16×2 B). Relu reads the FP32 input:
    # turning it low would move the cast upstream across a value-changing op, which the
    # downstream-only rule forbids, so it stays FP32 as greedy had it.
    m = make_model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[16,16] x) => (float[16,1] y) {
          r = Relu(x)
          a = MatMul(r, w)
          s = Sigmoid(a)
          y = ReduceMean<axes=[1]>(s)
        }""", {"w": (16, 16)})
    greedy, best = rewrite(m, placement="greedy"), rewrite(m, placement="optimal")
    assert _precisions(greedy)["Relu:r"] == "fp32" and _precisions(greedy)["Sigmoid:s"] == "fp32"
    p = _precisions(best)
    assert p == {"Relu:r": "fp32", "MatMul:a": "low", "Sigmoid:s": "low", "ReduceMean:y": "fp32"}
    assert _cast_bytes(best) == _cast_bytes(greedy) == 2 * 16 * 16 * 6
    assert best.log.decisions["Sigmoid:s"].step == "optimal"
    assert "min-cut" in best.log.decisions["Sigmoid:s"].reason
    scope = best.log.placement["scopes"][0]
    # the cost covers the free nodes only (Relu is pinned FP32): Sigmoid's FP32 traffic is saved
    assert (scope["cast_bytes"], scope["fp32_bytes"]) == (2 * 16 * 16 * 6, 0)
    assert scope["greedy_fp32_bytes"] == 2 * 16 * 16 * 2


def test_casts_never_move_upstream_across_a_value_changing_op():
    # x / 1000 → MatMul: greedy casts the normalised value. Casting raw x instead would be cheaper
    # by nothing and overflow above 65504; it must not happen.
    m = make_model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[4,8] x) => (float[4,8] y) {
          k = Constant<value=float {1000.0}>()
          d = Div(x, k)
          t = Transpose<perm=[0,1]>(d)
          y = MatMul(t, w)
        }""", {"w": (8, 8)})
    best = rewrite(m, placement="optimal")
    assert _precisions(best)["Div:d"] == "fp32"
    got = run(best.model, {"x": np.full((4, 8), 1e6, np.float32)})
    assert np.isfinite(got["y"]).all()


def test_a_value_cast_once_costs_once_whatever_its_consumer_count():
    # Relu feeds three FP32 Exps. Low Relu: ONE shared cast after it (6N). FP32 Relu: a cast of the
    # MatMul output (6N) plus FP32 traffic (4N). Counting a cast per consumer (18N) would wrongly
    # keep Relu FP32.
    m = make_model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[8,32] x) => (float[8,32] e1, float[8,32] e2, float[8,32] e3) {
          a = MatMul(x, w)
          r = Relu(a)
          e1 = Exp(r)
          e2 = Exp(r)
          e3 = Exp(r)
        }""", {"w": (32, 32)})
    best = rewrite(m, placement="optimal")
    assert _precisions(best)["Relu:r"] == "low"
    after_relu = [c for c in _inserted(best) if c.tensor == "r"]
    assert len(after_relu) == 1 and sorted(after_relu[0].consumers) == ["Exp:e1", "Exp:e2", "Exp:e3"]
    assert len(_inserted(best)) == 2  # x in, r out


def test_clear_op_that_grows_its_tensor_runs_fp32_so_the_small_tensor_is_cast():
    # MatMul → [1,64] → Expand → [64,64] → Exp (deny). Greedy spreads low through the clear Expand
    # and casts the big tensor (64×64×6 = 24576 B). Optimum: Expand FP32, cast the small one
    # (64×6 = 384 B) plus FP32 traffic 2×(64 + 4096) = 8320 B: 8704 < 24576.
    m = make_model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[1,64] x) => (float[64,64] y) {
          a = MatMul(x, w)
          e = Expand(a, shape)
          y = Exp(e)
        }""", {"w": (64, 64), "shape": np.array([64, 64], np.int64)})
    greedy, best = rewrite(m, placement="greedy"), rewrite(m, placement="optimal")
    assert _precisions(greedy)["Expand:e"] == "low"
    assert _precisions(best)["Expand:e"] == "fp32"
    out_casts = {c.tensor: c.bytes_per_run for c in _inserted(best)}
    assert out_casts == {"x": 64 * 6, "a": 64 * 6}
    assert _cast_bytes(best) < _cast_bytes(greedy)
    scope = best.log.placement["scopes"][0]
    assert scope["cast_bytes"] + scope["fp32_bytes"] == 384 + 384 + 8320


@pytest.mark.parametrize("identity", [False, True])
def test_an_identity_moves_no_data_in_the_cost_model(identity):
    """LRN (FP32) → [Identity] → MaxPool (halves each side) → Conv. The optimum keeps the pool FP32
    and casts its 4x smaller output. Costed as a copy (2 × 2 × 64·64·16 B of FP32 traffic), an FP32
    Identity made the low pool cheaper, and the Cast went before it, on the larger tensor; but
    onnxruntime removes an Identity before it runs."""
    mid = "l = LRN<size=5>(r)\n          li = Identity(l)" if identity else "li = LRN<size=5>(r)"
    m = make_model(f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[1,16,64,64] x) => (float[1,16,32,32] y) {{
          c = Conv<pads=[1,1,1,1]>(x, w1)
          r = Relu(c)
          {mid}
          p = MaxPool<kernel_shape=[2,2], strides=[2,2]>(li)
          y = Conv<pads=[1,1,1,1]>(p, w2)
        }}""", {"w1": (16, 16, 3, 3), "w2": (16, 16, 3, 3)})
    best = rewrite(m, placement="optimal")
    assert _precisions(best)["MaxPool:p"] == "fp32"
    casts = {c.tensor: c.bytes_per_run for c in _inserted(best)}
    assert casts == {"x": 16 * 64 * 64 * 6, "r": 16 * 64 * 64 * 6, "p": 16 * 32 * 32 * 6, "y/amp_fp16": 16 * 32 * 32 * 6}
    if identity:
        assert _precisions(best)["Identity:li"] == "fp32"
        assert "FP32 moves 0 B per run here" in best.log.decisions["Identity:li"].reason


def test_a_value_returned_through_two_identities_is_cast_once():
    """Each Identity followed its low producer and cast its own graph output: two Casts of one
    tensor where one before both Identities does (they move nothing)."""
    m = make_model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[8,32] x) => (float[8,64] y, float[8,64] y2) {
          h = MatMul(x, w)
          y = Identity(h)
          y2 = Identity(h)
        }""", {"w": (32, 64)})
    best = rewrite(m, placement="optimal")
    assert [c.tensor for c in _inserted(best)] == ["x", "h"]
    full_check(best.model)
    feeds = {"x": np.random.default_rng(0).standard_normal((8, 32)).astype(np.float32)}
    want, got = run(m, feeds), run(best.model, feeds)
    assert rel_err(want["y"], got["y"]) < 1e-2 and np.array_equal(got["y"], got["y2"])


def test_plain_optimum_that_casts_more_than_greedy_is_reweighted():
    # Embedding-like block: Gathers (clear) + Add (infer) before an FP32 reduction island. The plain
    # sum prefers them low (one cast into the island, no FP32 traffic) although greedy casts
    # nothing there; cast bytes get weighted until the answer casts no more than greedy.
    m = make_model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (int64[64] ids, int64[64] pids, float[64,16] h) => (float[1,16] s, float[64,16] y) {
          e = Gather(table, ids)
          q = Gather(pos, pids)
          p = Add(e, q)
          s = ReduceSum<keepdims=1>(p, axes)
          y = MatMul(h, w)
        }""", {"table": (100, 16), "pos": (64, 16), "w": (16, 16), "axes": np.array([0], np.int64)})
    problem = _problem(m)
    greedy_cost = problem.cost(problem.greedy)
    plain = problem.cost(problem.min_cut(problem.fixed, 1))
    assert plain.cast_bytes > greedy_cost.cast_bytes and plain.total < greedy_cost.total
    labels, outcome = problem.solve()
    assert outcome.weight > 1 and outcome.cost.cast_bytes <= greedy_cost.cast_bytes


_EMBEDDING = """
    <ir_version: 8, opset_import: ["" : 17]>
    g (int64[64] ids, int64[64] pos_ids, float[64,16] act) => (float[64,16] y) {
      tok = Gather(table, ids)
      pos = Gather(pos_table, pos_ids)
      pos_f = Cast<to=1>(SOURCE)
      e = Add(tok, pos_f)
      y = MatMul(e, w)
    }"""


def _embedding(source: str) -> onnx.ModelProto:
    return make_model(_EMBEDDING.replace("SOURCE", source),
                      {"table": (100, 16), "pos_table": (64, 16), "w": (16, 16)})


def test_cast_of_gathered_weights_lets_the_embedding_sum_run_low():
    """GPT-2's position row: Gather(wpe) then an FP32 → FLOAT Cast. Its elements are weights, so
    the Cast's output counts as a weight (retargeted or bypassed for low readers), not an FP32
    activation, and the embedding Add runs low: no inserted Cast before the MatMul."""
    model = _embedding("pos")
    greedy, best = rewrite(model, placement="greedy"), rewrite(model, placement="optimal")
    assert _precisions(greedy)["Add:e"] == "fp32" and _inserted(greedy)  # greedy casts the sum
    assert _precisions(best)["Add:e"] == "low"
    assert [c.consumers for c in _inserted(best)] == [["<graph output>"]]  # only the output's
    # the position Gather runs low too, so the model's own Cast has nothing left to do: removed,
    # not left dangling
    assert [c.kind for c in best.log.casts if c.name == "pos_f"] == ["removed"]  # (the unnamed Cast writing pos_f)
    assert [n.input[0] for n in nodes_by_type(best.model, "Cast")] == ["y/amp_fp16"]
    full_check(best.model)
    rng = np.random.default_rng(0)
    feeds = {"ids": rng.integers(0, 100, 64), "pos_ids": np.arange(64), "act": rng.standard_normal((64, 16)).astype(np.float32)}
    ref, got = run(model, feeds), run(best.model, feeds)
    assert rel_err(ref["y"], got["y"]) < 1e-2


@pytest.mark.parametrize("mover", ["GatherElements<axis=0>(tiled, pos_idx)", "GatherND(tiled, nd_idx)"])
def test_weights_moved_by_tile_and_gather_elements_count_as_weights(mover):
    """GPT-J's TorchScript export reads its sin/cos rows as Cast(GatherElements(Tile(Expand(table)))):
    Tile, GatherElements, GatherND and Split were not known to only move weights, so the Cast's
    output was an FP32 activation and the rotary Mul/Add stayed FP32 between FP16 ops (15 Casts
    against the dynamo export's 2)."""
    model = make_model(f"""
    <ir_version: 8, opset_import: ["" : 17]>
    g (int64[64] ids, int64[64,16] pos_idx, int64[64,1] nd_idx) => (float[64,16] y) {{
      tok = Gather(table, ids)
      tiled = Tile(pos_table, reps)
      pos = {mover}
      pos_f = Cast<to=1>(pos)
      e = Add(tok, pos_f)
      y = MatMul(e, w)
    }}""", {"table": (100, 16), "pos_table": (64, 16), "w": (16, 16), "reps": np.array([2, 1], np.int64)})
    best = rewrite(model, placement="optimal")
    assert _precisions(best)["Add:e"] == "low"
    assert [c.consumers for c in _inserted(best)] == [["<graph output>"]]
    full_check(best.model)
    rng = np.random.default_rng(0)
    feeds = {"ids": rng.integers(0, 100, 64), "pos_idx": rng.integers(0, 128, (64, 16)),
             "nd_idx": rng.integers(0, 128, (64, 1))}
    assert rel_err(run(model, feeds)["y"], run(best.model, feeds)["y"]) < 1e-2


def test_cast_of_an_activation_stays_an_fp32_read():
    """The same Cast of an activation (a graph input) is not weights: the Add keeps reading FP32."""
    best = rewrite(_embedding("act"), placement="optimal")
    assert _precisions(best)["Add:e"] == "fp32"
    assert not any(c.kind == "retargeted" for c in best.log.casts)
    # the model's Cast(fp32 -> FLOAT) of the activation does nothing, and goes as such (not as a
    # cast a low reader made redundant): the Add reads the graph input itself
    assert [(c.name, c.tensor, c.reason) for c in best.log.casts if c.kind == "removed"] == [
        ("pos_f", "act", "existing Cast of a fp32 value to fp32 does nothing: removed")]
    add = next(n for n in best.model.graph.node if n.op_type == "Add")
    assert "act" in add.input


def test_deny_and_island_nodes_stay_fp32_even_when_low_would_save_bytes():
    # A decomposed LayerNorm between two MatMuls: every island member would be cheaper low, but
    # deny paint fixed them FP32; only the infer/clear nodes outside the island are free.
    m = make_model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[8,16] x) => (float[8,16] y) {
          a = MatMul(x, w1)
          mu = ReduceMean<axes=[1]>(a)
          d = Sub(a, mu)
          two = Constant<value=float {2.0}>()
          sq = Pow(d, two)
          var = ReduceMean<axes=[1]>(sq)
          eps = Constant<value=float {1e-5}>()
          ve = Add(var, eps)
          sd = Sqrt(ve)
          n = Div(d, sd)
          y = MatMul(n, w2)
        }""", {"w1": (16, 16), "w2": (16, 16)})
    best = rewrite(m, placement="optimal")
    for d in best.log.decisions.values():
        if d.category in (Category.DENY, Category.UNLISTED) or d.step == "deny-spread":
            assert d.precision == Precision.FP32, d
    greedy = rewrite(m, placement="greedy")
    for name, prec in _precisions(greedy).items():
        if greedy.log.decisions[name].step == "deny-spread":
            assert _precisions(best)[name] == "fp32"


def _single_node_round_trips(self, allow):
    """Greedy's safety as it was (each node alone): a path of two clear ops between FP32 ops stayed
    low. The optimum must repair such a trip whatever greedy hands it."""
    changed = True
    while changed:
        changed = False
        for i in sorted(allow):
            if self.cat[i] != Category.ALLOW \
                    and (self.fp32_source[i] or any(p not in allow for p in self.preds[i])) \
                    and (self.fp32_sink[i] or any(s not in allow for s in self.succs[i])):
                allow.discard(i)
                self.step[i] = "safety"
                changed = True


def test_round_trip_through_free_nodes_is_refused(monkeypatch):
    # x → Concat(x, C) → MatMul, and Concat → Tile (8× bigger) → Exp. Greedy spread low through
    # both clear ops when it checked each node alone: casts x in and the big Tile output back out.
    # The plain cut keeps the Concat low (casting small x beats moving the weight-laden Concat in
    # FP32) but runs the Tile FP32 (cast its 8× smaller input): then the low Concat sits between
    # the FP32 input and the FP32 Tile, an FP32 → fp16 → FP32 trip for x. Safety pins the Concat
    # FP32 and cuts again. (Greedy now keeps that clear path FP32 itself: the placement is the same.)
    from amp_rewrite.passes import paint as paint_module

    m = make_model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[1,64] x) => (float[8,64] y, float[64,64] z) {
          r = Concat<axis=0>(x, c)
          y = MatMul(r, w)
          t = Tile(r, reps)
          z = Exp(t)
        }""", {"w": (64, 64), "c": (7, 64), "reps": np.array([8, 1], np.int64)})
    with monkeypatch.context() as patched:
        patched.setattr(paint_module._ScopePainter, "_remove_round_trips", _single_node_round_trips)
        problem = _problem(m)
    concat = next(i for i, n in enumerate(problem.nodes) if n.op_type == "Concat")
    assert problem.greedy[concat]
    unconstrained = problem.min_cut(problem.fixed)
    assert problem.round_trip_nodes(unconstrained) == {concat}  # the plain optimum would round-trip
    labels, outcome = problem.solve()
    assert not problem.round_trip_nodes(labels) and outcome.repaired == [concat]
    assert not labels[concat] and not labels[next(i for i, n in enumerate(problem.nodes) if n.op_type == "Tile")]
    for placement in ("optimal", "greedy"):
        result = rewrite(m, placement=placement)
        p = _precisions(result)
        assert p["Concat:r"] == "fp32" and p["Tile:t"] == "fp32"
        assert result.log.decisions["Concat:r"].step == "safety"
        got = run(result.model, {"x": np.full((1, 64), 0.3, np.float32)})
        assert np.array_equal(got["z"][0], np.exp(np.full(64, 0.3, np.float32)))  # x's path never saw fp16


# -- seeded random DAGs -----------------------------------------------------------------------------------
_UNARY = {"Relu": "infer", "Sigmoid": "infer", "Tanh": "infer", "Identity": "clear", "Exp": "deny", "Neg": "infer"}


def _random_model(seed: int, n_ops: int = 12) -> onnx.ModelProto:
    rng = random.Random(seed)
    nodes, inits, outputs = [], [], []
    values: list[tuple[str, int]] = [("x", 4), ("z", 4)]  # (name, rows); every tensor is [rows, 8]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8]),
              helper.make_tensor_value_info("z", TensorProto.FLOAT, [4, 8])]
    nrng = np.random.default_rng(seed)
    has_allow = False
    for i in range(n_ops):
        name = f"v{i}"
        kind = rng.random()
        # mostly read computed values (the graph inputs are FP32 sources, which pin their readers)
        src, rows = rng.choice(values[2:]) if len(values) > 2 and rng.random() < 0.85 else rng.choice(values)
        if kind < 0.3 or i == 0 or (i == n_ops - 1 and not has_allow):
            w = f"w{i}"
            inits.append(numpy_helper.from_array((nrng.standard_normal((8, 8)) / 3).astype(np.float32), w))
            nodes.append(helper.make_node("MatMul", [src, w], [name], name=f"n{i}"))
            has_allow = True
        elif kind < 0.55:
            same = [v for v in values if v[1] == rows]
            other = rng.choice(same)[0] if rng.random() < 0.7 else None
            if other is None:
                other = f"c{i}"
                inits.append(numpy_helper.from_array(nrng.standard_normal((1, 8)).astype(np.float32), other))
            nodes.append(helper.make_node(rng.choice(["Add", "Mul"]), [src, other], [name], name=f"n{i}"))
        elif kind < 0.7:
            src2, rows2 = rng.choice(values)
            nodes.append(helper.make_node("Concat", [src, src2], [name], axis=0, name=f"n{i}"))
            rows = rows + rows2
        elif kind < 0.8:
            axes = f"ax{i}"
            inits.append(numpy_helper.from_array(np.array([0], np.int64), axes))
            nodes.append(helper.make_node("ReduceSum", [src, axes], [name], keepdims=1, name=f"n{i}"))
            rows = 1
        else:
            op = rng.choice(sorted(_UNARY))
            nodes.append(helper.make_node(op, [src], [name], name=f"n{i}"))
        values.append((name, rows))
    used = {i for n in nodes for i in n.input}
    rows_of = dict(values)
    for name, _ in values[2:]:
        if name not in used or rng.random() < 0.15:
            outputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, [rows_of[name], 8]))
    graph = helper.make_graph(nodes, "random", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model, full_check=True)
    return model


def _brute_force(problem: optimal.Problem, fixed: dict[int, bool]) -> tuple[int, int]:
    free = [i for i in range(len(problem.nodes)) if i not in fixed]
    best = None
    for bits in itertools.product((False, True), repeat=len(free)):
        labels = [False] * len(problem.nodes)
        for i, low in fixed.items():
            labels[i] = low
        for i, low in zip(free, bits):
            labels[i] = low
        if not problem.feasible(labels):
            continue
        c = problem.cost(labels)
        key = (c.total, c.cast_bytes)
        best = key if best is None or key < best else best
    return best


@pytest.mark.parametrize("seed", range(80))
def test_cut_equals_brute_force_minimum_on_random_graphs(seed):
    model = _random_model(seed)
    problem = _problem(model, allow_none=True)
    if problem is None:
        pytest.skip("no free node in this draw")
    assert len(problem.free) <= 14
    labels = problem.min_cut(problem.fixed)
    assert problem.feasible(labels)
    cut = problem.cost(labels)
    assert (cut.total, cut.cast_bytes) == _brute_force(problem, problem.fixed)
    # with cast bytes weighted lexicographically, the cut minimises cast bytes first
    lex = sum(problem.node_bytes) + 1
    lex_cut = problem.cost(problem.min_cut(problem.fixed, lex))
    brute_lex = min(
        (problem.cost(ls).cast_bytes for ls in _all_labellings(problem) if problem.feasible(ls)), default=None)
    assert lex_cut.cast_bytes == brute_lex


def _all_labellings(problem: optimal.Problem):
    free = [i for i in range(len(problem.nodes)) if i not in problem.fixed]
    for bits in itertools.product((False, True), repeat=len(free)):
        labels = [False] * len(problem.nodes)
        for i, low in problem.fixed.items():
            labels[i] = low
        for i, low in zip(free, bits):
            labels[i] = low
        yield labels


@pytest.mark.parametrize("seed", range(0, 80, 4))
def test_safety_view_matches_greedy_painters(seed):
    # the round-trip rule must read the graph exactly as paint.py's does (one safety definition)
    from amp_rewrite.passes.paint import _ScopePainter

    problem = _problem(_random_model(seed), allow_none=True)
    if problem is None:
        pytest.skip("no free node in this draw")
    view = _ScopePainter(problem.scope, problem.ctx)
    assert [id(n) for n in view.nodes] == [id(n) for n in problem.nodes]
    assert problem.preds == view.preds and problem.succs == view.succs
    assert problem.fp32_sink == view.fp32_sink
    assert problem.fp32_source == view.fp32_source


@pytest.mark.parametrize("seed", range(40))
def test_random_graphs_keep_safety_and_never_cast_more_than_greedy(seed):
    model = _random_model(seed)
    greedy = rewrite(model, placement="greedy")
    best = rewrite(model, placement="optimal")
    full_check(best.model)
    for d in best.log.decisions.values():
        if d.category in (Category.DENY, Category.UNLISTED):
            assert d.precision == Precision.FP32
        if greedy.log.decisions[d.node].step == "deny-spread":
            assert d.precision == Precision.FP32
    for scope in getattr(best.log, "placement", {"scopes": []})["scopes"]:
        assert scope["cast_bytes"] <= scope["greedy_cast_bytes"]
    assert _cast_bytes(best) <= _cast_bytes(greedy)
    problem = _problem(model, allow_none=True)
    if problem is not None:
        labels, _ = problem.solve()
        assert not problem.round_trip_nodes(labels) or labels == problem.greedy
        assert problem.feasible(labels)
    feeds = {"x": np.random.default_rng(seed).standard_normal((4, 8)).astype(np.float32),
             "z": np.random.default_rng(seed + 1).standard_normal((4, 8)).astype(np.float32)}
    ref, got = run(model, feeds), run(best.model, feeds)
    for k in ref:
        assert rel_err(ref[k], got[k]) < 5e-2, k
    assert not rewrite(best.model, placement="optimal").modified


def test_keep_io_types_off_makes_io_low_terminals():
    m = make_model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[16,16] x) => (float[16,16] y) {
          r = Relu(x)
          a = MatMul(r, w)
          y = Sigmoid(a)
        }""", {"w": (16, 16)})
    best = rewrite(m, placement="optimal", keep_io_types=False)
    assert not nodes_by_type(best.model, "Cast")
    assert set(_precisions(best).values()) == {"low"}


def test_report_carries_cast_bytes_and_placement():
    m = make_model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[16,16] x) => (float[16,16] y) {
          a = MatMul(x, w)
          y = Sigmoid(a)
        }""", {"w": (16, 16)})
    best = rewrite(m, placement="optimal")
    summary = best.report.summary()
    assert summary["cast_bytes_per_run"] == 2 * 16 * 16 * 6
    assert any(note.startswith("optimal placement") for note in best.log.notes)
    assert best.log.placement["mode"] == "optimal"


def test_symbolic_dims_take_the_documented_defaults():
    assert optimal.estimate_numel(("batch_size", 16, "seq")) == optimal.BATCH_DIM * 16 * optimal.SYMBOLIC_DIM
    # an unnamed leading dim of rank >= 2 is the batch; unnamed dims elsewhere count SYMBOLIC_DIM
    assert optimal.estimate_numel((None, 4)) == optimal.BATCH_DIM * 4
    assert optimal.estimate_numel(("unk__3", "unk__4", "unk__5", "unk__6")) == (
        optimal.BATCH_DIM * optimal.SYMBOLIC_DIM ** 3)
    assert optimal.estimate_numel((4, None)) == 4 * optimal.SYMBOLIC_DIM
    assert optimal.estimate_numel((None,)) == optimal.SYMBOLIC_DIM  # rank 1: a length, not a batch
    assert optimal.estimate_numel(("seq", 4)) == optimal.SYMBOLIC_DIM * 4  # a named dim keeps its name's size
    assert optimal.estimate_numel(()) == 1


def _attention_reshape():
    """x (batch, seq, 64) → MatMul → Reshape to a shape computed at run time (onnx names four fresh
    dims) → Transpose → Relu → MatMul; the Relu's output is what the estimate is asked about."""
    return make_model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[batch, seq, 64] x, int64[4] heads) => (float[batch, seq, 64] y) {
          q = MatMul(x, w)
          r = Reshape(q, heads)
          t = Transpose<perm=[0, 2, 1, 3]>(r)
          a = Relu(t)
          b = Transpose<perm=[0, 2, 1, 3]>(a)
          back = Shape(x)
          c = Reshape(b, back)
          y = MatMul(c, w)
        }""", {"w": (64, 64)})


def test_size_estimates_follow_what_a_value_is_made_from():
    problem = _problem(_attention_reshape())
    values = {o.name: o for n in problem.nodes for o in n.outputs}
    assert len(values["r"].shape) == 4 and not any(isinstance(d, int) for d in values["r"].shape)
    counted = optimal.BATCH_DIM * optimal.SYMBOLIC_DIM * 64  # x's (batch, seq, 64)
    # the reshape keeps its input's count (not BATCH_DIM × SYMBOLIC_DIM ** 3, what its own four
    # fresh dims say), and so do the transpose and relu
    assert problem.numel(values["r"]) == problem.numel(values["t"]) == problem.numel(values["a"]) == counted
    assert optimal.estimate_numel(values["r"].shape) == optimal.BATCH_DIM * optimal.SYMBOLIC_DIM ** 3 > counted


def test_symbolic_shape_table_refines_the_estimates():
    model = _attention_reshape()
    ctx = make_context(frontend="onnx", placement="optimal")
    ir_model = load_onnx(model)
    for p in (classify, paint, find_islands):
        p(ir_model, ctx)
    table = {"q": ("batch", "seq", 64), "r": ("batch", "seq", 2, 8)}  # as onnx_fuse.SymbolicShapes gives them
    problem = optimal.Problem.from_scope(ir_model.graph, ctx, table)
    values = {o.name: o for n in problem.nodes for o in n.outputs}
    assert problem.numel(values["r"]) == optimal.BATCH_DIM * optimal.SYMBOLIC_DIM * 16  # the table's, smaller


def test_fresh_dims_are_bounded_by_what_the_producer_reads():
    """An Expand to a shape computed at run time: onnx knows the rank (5) and the broadcast
    trailing dims, but names the two leading dims afresh (``unk__``), which its own shape would
    count SYMBOLIC_DIM times the input (the first taken for a batch). The estimate takes the Expand's input instead (an Expand
    says nothing else), and the Relu after it follows."""
    problem = _problem(make_model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[2, 8, 64] x, int64[5] dims) => (float[2, 8, 64] y) {
          q = MatMul(x, w)
          e = Expand(q, dims)
          a = Relu(e)
          s = ReduceSum<keepdims=0>(a, axes)
          y = MatMul(s, w)
        }""", {"w": (64, 64), "axes": np.array([0, 1], np.int64)}))
    values = {o.name: o for n in problem.nodes for o in n.outputs}
    assert values["e"].shape[2:] == (2, 8, 64) and all(str(d).startswith("unk__") for d in values["e"].shape[:2])
    assert problem.numel(values["e"]) == problem.numel(values["a"]) == 2 * 8 * 64
    # (its own shape would say: the leading fresh dim as a batch, the next as SYMBOLIC_DIM)
    assert optimal.estimate_numel(values["e"].shape) == optimal.BATCH_DIM * optimal.SYMBOLIC_DIM * 2 * 8 * 64


@pytest.mark.parametrize("seed", range(12))
def test_residual_network_cut_matches_networkx_minimum_cut(seed):
    """The one-pass residual network gives the same source side as ``nx.minimum_cut`` (the
    largest minimum cut's), with finite and infinite capacities and edges both ways."""
    import networkx as nx

    rng = random.Random(seed)
    variables = list(range(rng.randint(5, 30)))
    edges = {}
    for _ in range(len(variables) * 3):
        u = rng.choice(variables + [optimal._S])
        v = rng.choice(variables + [optimal._T])
        if u != v:
            edges[(u, v)] = None if rng.random() < 0.1 else rng.randint(1, 1 << 44)
    g = nx.DiGraph()
    g.add_nodes_from((optimal._S, optimal._T))
    g.add_edges_from((u, v) if c is None else (u, v, {"capacity": c}) for (u, v), c in edges.items())
    try:
        _, (expected, _) = nx.minimum_cut(g, optimal._S, optimal._T, flow_func=nx.algorithms.flow.boykov_kolmogorov)
    except nx.NetworkXUnbounded:
        pytest.skip("an infinite path from source to sink: no finite cut to compare")
    nodes = {x for e in edges for x in e} - {optimal._S, optimal._T}
    got = optimal._max_flow_source_side(nodes, [(u, v, c) for (u, v), c in edges.items()])
    assert {n for n in got if isinstance(n, int)} == {n for n in expected if isinstance(n, int)}


def _chain_problem(n: int = 160):
    from tools.bench_synth import synthetic_chain  # (conftest puts the repository root on sys.path)
    from amp_rewrite.frontends.onnx_fuse import fuse

    model, _ = synthetic_chain(n)
    ir_model = load_onnx(model)
    ctx = make_context(frontend="onnx", placement="optimal")
    for step in (fuse, classify, paint, find_islands):
        step(ir_model, ctx)
    problem = optimal.Problem.from_scope(ir_model.graph, ctx)
    chain = set(max(problem.components, key=lambda c: len(c.variables)).variables)  # the residual stream
    assert len(chain) > 20
    return problem, chain


def _solve_counting_cuts(monkeypatch, problem, chain, *, forced_bound: bool):
    weights: list[int] = []
    real_cut = optimal.Problem._cut

    def counting_cut(self, terms, variables, fixed, weight, requires=()):
        if chain.intersection(variables):
            weights.append(weight)
        return real_cut(self, terms, variables, fixed, weight, requires)

    monkeypatch.setattr(optimal.Problem, "_cut", counting_cut)
    if not forced_bound:
        monkeypatch.setattr(optimal.Problem, "_forced_cast_bytes", lambda self, terms, fixed: 0)
    labels, outcome = problem.solve()
    monkeypatch.undo()
    return labels, outcome, weights


def test_repair_failure_skips_the_intermediate_cast_weights(monkeypatch):
    """A residual chain that greedy runs low from an FP32 graph input to near the FP32 output: the
    round-trip repair (not the cast weight) makes every cut cast more than greedy, so after the
    plain cut only the lexicographic one is tried, then greedy's answer is kept. The repair fixes
    the whole offending path after one cut (greedy's FP32 nodes alone leave the path in place),
    and the lexicographic weight starts from that repair: one cut, not the plain weight's rounds
    again. (With the forced-cast bound off: with it, see the next test.)"""
    problem, chain = _chain_problem()
    labels, outcome, weights = _solve_counting_cuts(monkeypatch, problem, chain, forced_bound=False)
    assert outcome.kept_greedy >= 1
    # (the residual stream keeps greedy's answer; other components are cut on their own)
    assert [labels[i] for i in sorted(chain)] == [problem.fixed.get(i, problem.greedy[i]) for i in sorted(chain)]
    assert set(weights) == {1, max(weights)} and max(weights) > 16  # plain, then lexicographic only
    assert weights.count(1) == 2  # the first cut, then the cut after one repair of the whole path
    assert weights.count(max(weights)) == 1  # the repair carried over: no round trip left to repair


def test_a_repair_that_forces_more_cast_bytes_than_greedy_ends_the_search(monkeypatch):
    """Same chain: the repair fixes the residual stream FP32 between MatMuls fixed low, which
    forces casts on edges whose ends are both fixed, more bytes than greedy's whole answer casts.
    No later cut can cast less, so the solver keeps greedy's answer after the first cut, and that
    answer is exactly the one the full search reaches."""
    problem, chain = _chain_problem()
    full_labels, full_outcome, full_weights = _solve_counting_cuts(monkeypatch, problem, chain, forced_bound=False)
    labels, outcome, weights = _solve_counting_cuts(monkeypatch, problem, chain, forced_bound=True)
    assert weights == [1] and len(full_weights) == 3
    assert labels == full_labels
    assert (outcome.kept_greedy, outcome.kept_nodes, outcome.repaired, outcome.weight, outcome.cost) == (
        full_outcome.kept_greedy, full_outcome.kept_nodes, full_outcome.repaired, full_outcome.weight,
        full_outcome.cost)
    # the bound itself: the residual stream fixed FP32 between low MatMuls forces casts
    fixed = dict(problem.fixed)
    fixed.update({i: False for i in chain})
    big = max(problem.components, key=lambda c: len(c.variables))
    greedy_cast = problem.cost(problem.greedy, terms=big.terms, variables=big.variables).cast_bytes
    assert problem._forced_cast_bytes(big.terms, fixed) > greedy_cast
    # before the repair the fixed nodes force only the graph input's cast: the search goes on
    assert 0 < problem._forced_cast_bytes(big.terms, problem.fixed) <= greedy_cast


def test_components_where_greedy_costs_nothing_skip_the_cut_and_match_it(monkeypatch):
    """A bias Add and a Relu between two MatMuls: greedy runs them low at no cost, which is the
    cut's own answer. solve() skips the max-flow there; the skipped cuts agree with greedy."""
    from tools.bench_synth import synthetic_chain

    model, _ = synthetic_chain(160)
    ir_model = load_onnx(model)
    ctx = make_context(frontend="onnx", placement="optimal")
    from amp_rewrite.frontends.onnx_fuse import fuse

    for step in (fuse, classify, paint, find_islands):
        step(ir_model, ctx)
    problem = optimal.Problem.from_scope(ir_model.graph, ctx)
    free_of_cost = [c for c in problem.components
                    if problem.cost(problem.greedy, terms=c.terms, variables=c.variables).total == 0]
    assert len(free_of_cost) >= 5
    for c in free_of_cost:  # what the cut says for each, at every weight the solver tries
        known = {i: problem.fixed[i] for i in optimal._references(c) if i in problem.fixed}
        for weight in (1, 2, 16):
            low = set(problem._cut(c.terms, c.variables, known, weight, c.requires))
            assert low == {i for i in c.variables if problem.greedy[i]}
    cut_variables: list[set[int]] = []
    real_cut = optimal.Problem._cut

    def recording_cut(self, terms, variables, fixed, weight, requires=()):
        cut_variables.append(set(variables))
        return real_cut(self, terms, variables, fixed, weight, requires)

    monkeypatch.setattr(optimal.Problem, "_cut", recording_cut)
    labels, _ = problem.solve()
    skipped = {i for c in free_of_cost for i in c.variables}
    assert not any(v & skipped for v in cut_variables)
    assert all(labels[i] == problem.greedy[i] for i in skipped)


def test_painter_reason_kept_only_where_its_whole_via_chain_kept_its_label():
    """``_greedy_chains_intact``: a node keeps the painter's reason only if the cut left it and every
    node its ``via`` chain cites with greedy's label, and no round-trip repair touched them. Chain
    a -> b -> c (a's reason cites b, b's cites c), and h cites a, walked after a (from the memo); d
    cites a node outside the scope; e and f cite each other."""
    from types import SimpleNamespace

    from amp_rewrite.ir import Node

    via = {"a": "b", "b": "c", "c": None, "d": "elsewhere", "e": "f", "f": "e", "g": None, "h": "a"}
    nodes = []
    for name, cites in via.items():
        node = Node("Relu", [], name=name)
        node.meta["amp.via"] = cites
        nodes.append(node)
    index = {name: i for i, name in enumerate(via)}
    greedy = [True] * len(nodes)
    problem = SimpleNamespace(nodes=nodes, free=list(range(len(nodes))), greedy=greedy)

    def intact(moved=(), repaired=()):
        labels = [name not in moved for name in via]
        found = optimal.Problem._greedy_chains_intact(problem, labels, {index[n] for n in repaired})
        return {nodes[i].name for i in found}

    assert intact() == {"a", "b", "c", "g", "h"}  # d's chain leaves the scope, e/f cite each other
    assert intact(moved=["c"]) == {"g"}  # c moved: b, a and h cite it
    assert intact(moved=["b"]) == {"c", "g"}  # a's chain, and so h's, passes through b
    assert intact(moved=["a"]) == {"b", "c", "g"}  # h cites a
    assert intact(repaired=["c"]) == {"g"}  # a repair counts as a move


def _reads_a_big_constant(kind: str, big: float) -> onnx.ModelProto:
    """h = MatMul(x, w); z = h (+|*) a constant holding ``big``; y = ReduceSum(z): the elementwise
    op is free to go either way, and the optimal placement's cost model finds low cheaper."""
    w = numpy_helper.from_array((np.random.default_rng(0).standard_normal((8, 8)) * 0.5).astype(np.float32), "w")
    inits, nodes = [w], [helper.make_node("MatMul", ["x", "w"], ["h"])]
    if kind == "ConstantOfShape":
        nodes += [helper.make_node("Shape", ["h"], ["sh"]),
                  helper.make_node("ConstantOfShape", ["sh"], ["c"],
                                   value=numpy_helper.from_array(np.array([big], np.float32))),
                  helper.make_node("Add", ["h", "c"], ["z"])]
    elif kind == "OneHot":
        inits += [numpy_helper.from_array(np.array([[0, 1, 2, 3]], np.int64), "ix"),
                  numpy_helper.from_array(np.array(8, np.int64), "depth"),
                  numpy_helper.from_array(np.array([0.0, big], np.float32), "vals")]
        nodes += [helper.make_node("OneHot", ["ix", "depth", "vals"], ["c"]), helper.make_node("Mul", ["h", "c"], ["z"])]
    else:  # a Constant node's value_float
        nodes += [helper.make_node("Constant", [], ["c"], value_float=big), helper.make_node("Add", ["h", "c"], ["z"])]
    nodes.append(helper.make_node("ReduceSum", ["z"], ["y"], keepdims=0))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


@pytest.mark.parametrize("placement", ["optimal", "greedy"])
@pytest.mark.parametrize("kind", ["ConstantOfShape", "OneHot", "Constant"])
def test_an_op_reading_a_constant_fp16_cannot_hold_keeps_fp32(kind, placement):
    """The optimal placement made ``h + ConstantOfShape(1e5)`` FP16 (cheaper by its cost model),
    which clamped the constant to 65504: 34% error; with ``OneHot(values=[0, 1e5])`` the output was
    inf. Greedy kept them FP32 only because they were not between FP16 ops. An infer or clear op
    reading a constant beyond FP16's range now keeps FP32 under both placements, with the reason."""
    model = _reads_a_big_constant(kind, 1e5)
    result = rewrite(model, placement=placement)
    full_check(result.model)
    reader = {"ConstantOfShape": "Add:z", "OneHot": "Mul:z", "Constant": "Add:z"}[kind]
    decision = result.log.decisions[reader]
    assert decision.precision == Precision.FP32 and "100000" in decision.reason and "fp16" in decision.reason
    assert result.log.weights.clamped == 0
    feeds = {"x": np.random.default_rng(1).standard_normal((1, 4, 8)).astype(np.float32)}
    ref, got = run(model, feeds)["y"], run(result.model, feeds)["y"]
    assert np.isfinite(got).all() and rel_err(ref, got) < 1e-2
    assert not rewrite(result.model, placement=placement).modified
    # in BF16, which holds 1e5, nothing is kept FP32 for it
    bf16 = rewrite(model, placement=placement, target="bf16")
    assert "100000" not in bf16.log.decisions[reader].reason


@pytest.mark.parametrize("placement", ["optimal", "greedy"])
def test_a_constant_an_if_branch_returns_counts_as_read(placement):
    """``s = If(c)`` returning a Constant 1e5 from one branch, then ``z = h / s`` between FP16
    MatMuls: the Div went FP16 (the check looked at the Div's inputs, not through the If), clamping
    s to 65504: 53% error. The value an If returns is now looked up in its branches."""
    w = ",".join(["100.0"] * 64)
    model = make_model(f"""<ir_version: 8, opset_import: ["" : 17]>
        g (float[4,8] x, bool c) => (float[4,8] y) {{
          w = Constant<value = float[8,8] {{{w}}}>()
          h = MatMul(x, w)
          s = If(c) <
            then_branch = t () => (float[1] a) {{ a = Constant<value = float[1] {{100000.0}}>() }},
            else_branch = e () => (float[1] b) {{ b = Constant<value = float[1] {{2.0}}>() }}
          >
          z = Div(h, s)
          y = MatMul(z, w)
        }}""")
    result = rewrite(model, placement=placement)
    full_check(result.model)
    decision = result.log.decisions["Div:z"]
    assert decision.precision == Precision.FP32 and "100000" in decision.reason
    feeds = {"x": np.random.default_rng(1).uniform(0, 1, (4, 8)).astype(np.float32), "c": np.array(True)}
    ref, got = run(model, feeds)["y"], run(result.model, feeds)["y"]
    assert rel_err(ref, got) < 1e-2


_COPY_READS = {
    "Slice": ("bb = Slice(C2, s0, s1)", ""),
    "Gather": ("bb = Gather<axis=0>(C, idx)", ""),
    "Concat": ("bb = Concat<axis=0>(C1, C1)", ""),
    "Split": ("bb, bb2 = Split<axis=1>(C2, sp)", ""),
    "Neg": ("bb = Neg(C)", ""),
    "Cast from double": ("bb = Cast<to=1>(D)", ""),
}


@pytest.mark.parametrize("placement", ["optimal", "greedy"])
@pytest.mark.parametrize("how", sorted(_COPY_READS))
def test_a_constant_read_through_a_copy_op_counts_as_read(how, placement):
    """``b = a + bb; c = b - bb`` between FP16 MatMuls, with bb a 1e5 constant read through Slice,
    Gather, Concat or Split: the check looked through Reshape-like ops only, so Add and Sub went
    FP16 and bb was cast to inf at run time; every output was NaN."""
    big = ",".join(["100000"] * 16)
    model = make_model(f"""<ir_version: 8, opset_import: ["" : 17]>
        g (float[2,4] x) => (float[2,4] y)
          <float[2,4] C = {{{big[:55]}}}, float[2,8] C2 = {{{big}}}, float[1,4] C1 = {{{big[:27]}}},
           double[2,4] D = {{{big[:55]}}}, int64[2] s0 = {{0,0}}, int64[2] s1 = {{2,4}}, int64[2] idx = {{0,1}},
           int64[2] sp = {{4,4}}> {{
          {_COPY_READS[how][0]}
          a = MatMul(x, W)
          b = Add(a, bb)
          c = Sub(b, bb)
          y = MatMul(c, W)
        }}""", {"W": (4, 4)})
    result = rewrite(model, placement=placement)
    full_check(result.model)
    for reader in ("Add:b", "Sub:c"):
        decision = result.log.decisions[reader]
        assert decision.precision == Precision.FP32 and "100000" in decision.reason
    feeds = {"x": np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32)}
    ref, got = run(model, feeds)["y"], run(result.model, feeds)["y"]
    assert np.isfinite(got).all() and rel_err(ref, got) < 1e-2


def test_pad2_fill_attribute_past_the_range_keeps_the_pad_and_its_reader_fp32():
    """Pad-2 (opsets 2 to 10) holds its fill as a float attribute: ``Pad<value=70000>`` went FP16
    (inf on a GPU) where opset 11's constant input was caught. Its reader keeps FP32 too."""
    model = make_model("""<ir_version: 4, opset_import: ["" : 9]>
        g (float[1,1,4,4] x) => (float[1,1,6,6] y) {
          a = MatMul(x, W)
          s = Pad<pads=[0,0,1,1,0,0,1,1], value=70000.0>(a)
          y = Relu(s)
        }""", {"W": (4, 4)})
    result = rewrite(model)
    full_check(result.model)
    for node in ("Pad:s", "Relu:y"):
        decision = result.log.decisions[node]
        assert decision.precision == Precision.FP32 and "70000" in decision.reason


_ATTRIBUTE_OPS = {  # op text (attribute {v}), opset, whether a value past FP16's range matters
    "LeakyRelu alpha": ("LeakyRelu<alpha={v}>(h)", 17, True),
    "Elu alpha": ("Elu<alpha={v}>(h)", 17, True),
    "Selu gamma": ("Selu<gamma={v}>(h)", 17, True),
    "HardSigmoid alpha": ("HardSigmoid<alpha={v}>(h)", 17, True),
    "Shrink bias": ("Shrink<bias={v}>(h)", 17, True),
    "Swish alpha": ("Swish<alpha={v}>(h)", 24, True),
    # compared with the data only: no FP16 value lies beyond such a bound, whichever side
    "ThresholdedRelu alpha": ("ThresholdedRelu<alpha={v}>(h)", 17, False),
    "Shrink lambd": ("Shrink<lambd={v}>(h)", 17, False),
}


@pytest.mark.parametrize("placement", ["optimal", "greedy"])
@pytest.mark.parametrize("case", sorted(_ATTRIBUTE_OPS))
def test_an_op_computing_with_a_float_attribute_fp16_cannot_hold_keeps_fp32(case, placement):
    """``LeakyRelu<alpha=1e5>`` (or an Elu/Selu/HardSigmoid/Shrink/Swish scale or offset past
    65504) between FP16 MatMuls went FP16: the kernel combines the attribute with the data in the
    node's type, where it is clamped or inf (and inf * 0 is NaN). The out-of-range scan read the
    constants a node reads and ConstantOfShape/Pad fills only; such a node now keeps FP32, its
    reason naming the attribute. A threshold the data is only compared with (ThresholdedRelu's
    alpha, Shrink's lambd) selects the same FP16 values at any size, and leaves the node free."""
    text, opset, matters = _ATTRIBUTE_OPS[case]
    attribute = case.split()[1]

    def model(value: str) -> onnx.ModelProto:
        return make_model(f"""<ir_version: 10, opset_import: ["" : {opset}]>
            g (float[2,4] x) => (float[2,4] y) {{
              h = MatMul(x, W)
              s = {text.format(v=value)}
              y = MatMul(s, W)
            }}""", {"W": (4, 4)}, ir_version=10)

    op = text.split("<")[0]
    for value, big in (("100000.0", 1e5), ("-1000000000.0", -1e9)):  # (no mask sentinel: any size counts)
        result = rewrite(model(value), placement=placement)
        full_check(result.model)
        decision = result.log.decisions[f"{op}:s"]
        if matters:
            assert decision.precision == Precision.FP32, decision.reason
            assert f"its {attribute} attribute holding {big:g}, beyond fp16's finite range" in decision.reason
        else:
            assert decision.precision == Precision.LOW and "finite range" not in decision.reason
        assert result.log.decisions["MatMul:y"].precision == Precision.LOW
    assert rewrite(model("0.5"), placement=placement).log.decisions[f"{op}:s"].precision == Precision.LOW
    # BF16 holds 1e5 (its range is FP32's): no attribute keeps the node FP32 there
    assert "finite range" not in rewrite(model("100000.0"), placement=placement, target="bf16") \
        .log.decisions[f"{op}:s"].reason


def _image_scaler(bias: list[float], then_sub: bool) -> onnx.ModelProto:
    """Conv -> ImageScaler(scale=0.5, bias) -> [Sub(s, bias as a constant) ->] Conv, opset 9 (ImageScaler
    has no onnx schema since opset 10, so no onnx.parser text)."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"]),
             helper.make_node("ImageScaler", ["c"], ["s"], scale=0.5, bias=bias)]
    inits = [numpy_helper.from_array((rng.standard_normal((2, 2, 3, 3)) * 0.3).astype(np.float32), "w"),
             numpy_helper.from_array((rng.standard_normal((2, 2, 2, 2)) * 0.3).astype(np.float32), "w2")]
    if then_sub:
        nodes.append(helper.make_node("Sub", ["s", "k"], ["d"]))
        inits.append(numpy_helper.from_array(np.array(bias, np.float32).reshape(2, 1, 1), "k"))
    nodes.append(helper.make_node("Conv", ["d" if then_sub else "s", "w2"], ["y"]))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 6, 6])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 3, 3])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 9)], ir_version=4)


@pytest.mark.parametrize("placement", ["optimal", "greedy"])
def test_an_image_scaler_whose_bias_fp16_cannot_hold_keeps_fp32(placement):
    """ImageScaler (y = scale * x + bias[c]) with bias=[1e5, 2] between two Convs was painted FP16:
    on a GPU channel 0 became +inf. It now keeps FP32 and says which attribute; the model's own
    Sub of the same bias brings the values back into FP16's range, so the last Conv runs FP16 and
    the result matches FP32 (as a GPU computes it: every FP16 value rounded where it is made)."""
    from amp_rewrite.emulate import emulate_low

    plain = rewrite(_image_scaler([1e5, 2.0], then_sub=False), placement=placement)
    decision = plain.log.decisions["ImageScaler:s"]
    assert decision.precision == Precision.FP32
    assert "its bias attribute holding 100000, beyond fp16's finite range" in decision.reason
    assert plain.log.decisions["Conv:c"].precision == Precision.LOW  # (the Convs stay allow ops)
    assert rewrite(_image_scaler([1e3, 2.0], then_sub=False), placement=placement) \
        .log.decisions["ImageScaler:s"].precision == Precision.LOW  # a bias FP16 holds leaves it free

    model = _image_scaler([1e5, 2.0], then_sub=True)
    result = rewrite(model, placement=placement)
    assert result.log.decisions["ImageScaler:s"].precision == Precision.FP32
    assert result.log.decisions["Conv:y"].precision == Precision.LOW
    feeds = {"x": np.random.default_rng(1).standard_normal((1, 2, 6, 6)).astype(np.float32)}
    got = run(emulate_low(result.model, TensorProto.FLOAT16)[0], feeds)["y"]
    assert np.isfinite(got).all() and rel_err(run(model, feeds)["y"], got) < 1e-2
    assert not rewrite(result.model, placement=placement).modified


@pytest.mark.parametrize("mode", ["tf_crop_and_resize", "half_pixel"])
def test_a_resize_fill_past_the_range_keeps_the_resize_and_its_reader_fp32(mode):
    """Resize's extrapolation_value is written where tf_crop_and_resize samples outside the input
    (as Pad-2's fill is): 7e4 went FP16 (inf on a GPU). The Resize and its reader keep FP32 in that
    mode; in another the attribute is not used, and nothing is kept FP32 for it."""
    model = make_model(f"""<ir_version: 8, opset_import: ["" : 13]>
        g (float[1,1,4,4] x) => (float[1,1,4,4] y) <float[8] roi = {{0,0,-0.5,-0.5,1,1,1.5,1.5}},
                                                  float[4] sc = {{1,1,1,1}}> {{
          a = MatMul(x, W)
          r = Resize<mode="linear", coordinate_transformation_mode="{mode}", extrapolation_value=70000.0>(a, roi, sc)
          t = Relu(r)
          y = MatMul(t, W)
        }}""", {"W": (4, 4)})
    result = rewrite(model)
    full_check(result.model)
    for node in ("Resize:r", "Relu:t"):
        decision = result.log.decisions[node]
        if mode == "tf_crop_and_resize":
            assert decision.precision == Precision.FP32 and "70000" in decision.reason, node
        else:
            assert "finite range" not in decision.reason


def test_an_fp16_constant_of_shape_fill_raises_no_overflow_warning():
    """An FP16 ConstantOfShape fill (a mixed model; amp-rewrite's own fused zero skip, rewritten
    again) printed numpy's 'overflow encountered in cast' on stderr: the check compared the FP16
    datum with the 1e8 sentinel bound in FP16."""
    import warnings

    model = make_model("""<ir_version: 8, opset_import: ["" : 17]>
        g (float[2,4] x) => (float[2,4] y) {
          a = MatMul(x, W)
          sh = Shape(a)
          z = ConstantOfShape<value = float16[1] {15872}>(sh)
          zf = Cast<to=1>(z)
          y = Add(a, zf)
        }""", {"W": (4, 4)})
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        result = rewrite(model)
    full_check(result.model)


def test_a_mask_sentinel_constant_does_not_keep_its_reader_fp32():
    """-1e9 (and finfo(float32).min) mask sentinels saturate and still mask; keeping every mask op
    FP32 for them would cast around every attention block. The optimal placement still chooses."""
    result = rewrite(_reads_a_big_constant("Constant", -1e9), placement="optimal")
    assert "beyond fp16" not in result.log.decisions["Add:z"].reason


@pytest.mark.parametrize("placement", ["greedy", "optimal"])
def test_an_if_branch_ending_in_a_node_fixed_fp32_keeps_the_if_output_fp32(placement):
    """Optimal joined an If with its branches though the else branch ended in a Mul classify had
    fixed FP32 (it reads 1e5, past FP16's range) and so made no cost term: the If's output went
    low, that branch's FP32 result was cast to FP16 at the boundary, and y was inf where greedy
    was right. Such an If no longer joins (its output stays FP32 as greedy has it)."""
    from amp_rewrite.emulate import emulate_low

    rng = np.random.default_rng(7)
    vi = helper.make_tensor_value_info
    w = lambda n: numpy_helper.from_array((rng.standard_normal((16, 16)) * 0.3).astype(np.float32), n)  # noqa: E731
    then_g = helper.make_graph([helper.make_node("MatMul", ["h", "W2"], ["t1"], name="tmm")], "t", [],
                               [vi("t1", TensorProto.FLOAT, ["B", 16])])
    else_g = helper.make_graph([helper.make_node("Mul", ["h", "k"], ["e1"], name="emul")], "e", [],
                               [vi("e1", TensorProto.FLOAT, ["B", 16])])
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W1"], ["h"], name="mm1"),
         helper.make_node("If", ["c"], ["y0"], name="iff", then_branch=then_g, else_branch=else_g),
         helper.make_node("Mul", ["y0", "ik"], ["y1"], name="unscale"),
         helper.make_node("MatMul", ["y1", "W2"], ["y"], name="mmo")], "g",
        [vi("x", TensorProto.FLOAT, ["B", 16]), vi("c", TensorProto.BOOL, [])], [vi("y", TensorProto.FLOAT, ["B", 16])],
        [w("W1"), w("W2"), numpy_helper.from_array(np.array(1e5, np.float32), "k"),
         numpy_helper.from_array(np.array(1e-5, np.float32), "ik")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    out = rewrite(m, placement=placement).model
    full_check(out)
    x = np.random.default_rng(0).standard_normal((4, 16)).astype(np.float32)
    for branch in (False, True):
        feeds = {"x": x, "c": np.array(branch)}
        got = run(emulate_low(out)[0], feeds)["y"]  # (as a GPU computes FP16)
        assert np.isfinite(got).all() and rel_err(run(m, feeds)["y"], got) < 1e-2, branch


@pytest.mark.parametrize("target", ["fp16", "bf16"])
@pytest.mark.parametrize("placement", ["optimal", "greedy"])
def test_shape_arithmetic_cast_to_integer_keeps_fp32(placement, target):
    """``math.ceil(h / patch) * patch`` as a TorchScript export writes it: Constant → Ceil → Mul →
    Cast(to=INT64) → a Reshape's shape. The optimal placement (constants cost it nothing) painted
    Ceil and Mul fp16, so the constant 4099 was stored as 4100 and onnxruntime's Reshape failed."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"], name="mm"),
             helper.make_node("Constant", [], ["c"], name="c",
                              value=numpy_helper.from_array(np.array([4099.0], np.float32))),
             helper.make_node("Ceil", ["c"], ["ce"], name="ceil"),
             helper.make_node("Mul", ["ce", "one"], ["mu"], name="mul"),
             helper.make_node("Cast", ["mu"], ["ci"], name="to_int", to=TensorProto.INT64),
             helper.make_node("Concat", ["ci", "eight"], ["shape"], name="cat", axis=0),
             helper.make_node("Reshape", ["m", "shape"], ["r"], name="reshape"),
             helper.make_node("MatMul", ["r", "w"], ["y"], name="mm2")]
    inits = [numpy_helper.from_array((rng.standard_normal((8, 8)) * 0.3).astype(np.float32), "w"),
             numpy_helper.from_array(np.array([1.0], np.float32), "one"),
             numpy_helper.from_array(np.array([8], np.int64), "eight")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4099, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4099, 8])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    result = rewrite(model, placement=placement, target=target)
    for name in ("ceil", "mul"):
        decision = result.log.decisions[name]
        assert decision.precision == Precision.FP32, (name, decision.reason)
    assert "shape or index arithmetic" in result.log.decisions["mul"].reason
    assert result.log.decisions["mm"].precision == Precision.LOW
    full_check(result.model)
    const = next(n for n in result.model.graph.node if n.op_type == "Constant")
    assert numpy_helper.to_array(const.attribute[0].t).tolist() == [4099.0]
    if target == "fp16":  # (onnxruntime's CPU provider has no bf16 MatMul)
        x = rng.standard_normal((4099, 8)).astype(np.float32)
        assert run(result.model, {"x": x})["y"].shape == (4099, 8)


_INTEGER_DATA = {
    # a super-resolution net as deployed: a uint8 image in, Round(Clip(y * 255)) cast to uint8 out
    "uint8 image in and out": ("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (uint8[1,3,8,8] img) => (uint8[1,3,8,8] out) {
          f = Cast<to=1>(img)
          x = Div(f, k255)
          c1 = Conv<pads=[1,1,1,1]>(x, W1)
          r1 = Relu(c1)
          c2 = Conv<pads=[1,1,1,1]>(r1, W2)
          y = Mul(c2, k255)
          cl = Clip(y, zero, k255)
          ro = Round(cl)
          out = Cast<to=2>(ro)
        }""", ["Conv:c1", "Conv:c2"]),
    # a duration predictor: token ids -> an embedding -> MatMuls -> Exp -> Round -> int64 frames
    "token ids in, frame counts out": ("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (int64[1,6] ids) => (int64[1,6,1] frames) {
          e = Gather(emb, ids)
          h1 = MatMul(e, W3)
          r1 = Relu(h1)
          logd = MatMul(r1, W4)
          d = Exp(logd)
          ro = Round(d)
          frames = Cast<to=7>(ro)
        }""", ["MatMul:h1", "MatMul:logd"]),
}


@pytest.mark.parametrize("placement", ["optimal", "greedy"])
@pytest.mark.parametrize("case", list(_INTEGER_DATA))
def test_integer_data_through_a_layer_is_an_activation_not_shape_arithmetic(case, placement):
    """A uint8 image or token ids cast to float, through Convs or an embedding and MatMuls, then
    rounded and cast to an integer: the rule for shape and index arithmetic ("computed from
    integers and constants only") took the whole net for it, and kept every Conv and MatMul FP32
    (0 of 3 low). A convolution or a product with a weight matrix (or an embedding lookup) makes
    the value an activation: the heavy ops go low, as with a float input."""
    text, heavy = _INTEGER_DATA[case]
    rng = np.random.default_rng(0)
    model = make_model(text, {"W1": (rng.standard_normal((4, 3, 3, 3)) * 0.2).astype(np.float32),
                              "W2": (rng.standard_normal((3, 4, 3, 3)) * 0.2).astype(np.float32),
                              "k255": np.array(255.0, np.float32), "zero": np.array(0.0, np.float32),
                              "emb": (rng.standard_normal((20, 8)) * 0.5).astype(np.float32),
                              "W3": (rng.standard_normal((8, 8)) * 0.3).astype(np.float32),
                              "W4": (rng.standard_normal((8, 1)) * 0.3).astype(np.float32)})
    result = rewrite(model, placement=placement)
    full_check(result.model)
    for name in heavy:
        decision = result.log.decisions[name]
        assert decision.precision == Precision.LOW, (name, decision.reason)
    assert not any("shape or index arithmetic" in d.reason for d in result.log.decisions.values())
    feeds = {"img": rng.integers(0, 256, (1, 3, 8, 8)).astype(np.uint8)} if "img" in text \
        else {"ids": rng.integers(0, 20, (1, 6)).astype(np.int64)}
    want, got = run(model, feeds), run(result.model, feeds)
    name = next(iter(want))
    assert np.abs(want[name].astype(np.int64) - got[name].astype(np.int64)).max() <= 1


def test_a_loop_bodys_cost_line_says_per_iteration():
    """A Loop body's cost line said "per run" for one iteration, beside a summary whose cast bytes per
    run count the trip count's five iterations."""
    model = make_model("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[4,16] x) => (float[4,16] y, float[5,4,16] all) {
      trip = Constant<value = int64 {5}>()
      y, all = Loop(trip, , x) <body = body(int64 i, bool c, float[4,16] s) => (bool c2, float[4,16] s2, float[4,16] so) {
          c2 = Identity(c)
          m = MatMul(s, W)
          e = Exp(m)
          r = ReduceSum<keepdims=1>(e)
          s2 = Div(e, r)
          so = Identity(m)
      }>
    }""", {"W": (16, 16)})
    result = rewrite(model)
    [line] = [n for n in result.log.notes if n.startswith("optimal placement (Loop")]
    assert "FP32 traffic per iteration against greedy's" in line
    report = result.report.to_dict()
    assert [c["runs"] for c in report["casts"]] == [5] * len(report["casts"])


_WIDENING_CASES = {
    # torch.log(torch.softmax(z, -1)): probabilities below 6e-8 are 0 in FP16, and the Log -inf
    "log of softmax": ("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[4,32] x) => (float[4,32] y) {
          h = MatMul(x, w)
          p = Softmax<axis=-1>(h)
          y = Log(p)
        }""", {"w": (np.random.default_rng(3).standard_normal((32, 32)) * 1.5).astype(np.float32)},
        "Softmax:p", 1.5),
    # a residual sum of two activations that each fit FP16 (near 30000) read by an FP32 reduction
    "residual sum": ("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[4,16] x) => (float[4] y) {
          a = MatMul(x, w)
          b = MatMul(x, w)
          r = Add(a, b)
          y = ReduceMean<keepdims=0, axes=[-1]>(r)
        }""", {"w": np.full((16, 16), 2000.0, np.float32)}, "Add:r", 1.0),
    # (a * b).float().sum(-1): the model's own upcast before the FP32 reader
    "products cast up, then summed": ("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[4,16] x) => (float[4] y) {
          a = MatMul(x, w)
          b = MatMul(x, w2)
          p = Mul(a, b)
          c = Cast<to = 1>(p)
          y = ReduceSum<keepdims=0>(c, axes)
        }""", {"w": np.full((16, 16), 20.0, np.float32), "w2": np.full((16, 16), -20.0, np.float32),
               "axes": np.array([-1], np.int64)}, "Mul:p", 1.0),
    # torch.log(p + 1e-10): the FP32 Add keeps the epsilon FP16 flushes, for the values that underflow
    "log of softmax plus epsilon": ("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[4,32] x) => (float[4,32] y) {
          h = MatMul(x, w)
          p = Softmax<axis=-1>(h)
          q = Add(p, eps)
          y = Log(q)
        }""", {"w": (np.random.default_rng(3).standard_normal((32, 32)) * 1.5).astype(np.float32),
               "eps": np.array(1e-10, np.float32)}, "Softmax:p", 1.5),
    # KL(p || q) = sum p * log(p / q): the Div reading both softmaxes is free, and held FP32 before
    # its Log; the softmaxes it divides by are held for it (q's 1e-11 was 0 in FP16: KL NaN)
    "KL divergence of two softmaxes": ("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[4,32] x) => (float[4] y) {
          h = MatMul(x, w)
          h2 = MatMul(x, w2)
          p = Softmax<axis=-1>(h)
          q = Softmax<axis=-1>(h2)
          r = Div(p, q)
          l = Log(r)
          m = Mul(p, l)
          y = ReduceSum<keepdims=0>(m, axes)
        }""", {"w": np.random.default_rng(4).standard_normal((32, 32)).astype(np.float32),
               "w2": np.random.default_rng(5).standard_normal((32, 32)).astype(np.float32),
               "axes": np.array([-1], np.int64)}, "Softmax:q", 1.0),
    # 1 / softmax through a Transpose: the Div is held FP32 (a quotient that may grow), and the
    # softmax before it for it
    "reciprocal of a transposed softmax": ("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[4,32] x) => (float[32,4] y) {
          h = MatMul(x, w)
          p = Softmax<axis=-1>(h)
          t = Transpose<perm=[1,0]>(p)
          y = Div(one, t)
        }""", {"w": np.random.default_rng(4).standard_normal((32, 32)).astype(np.float32),
               "one": np.array(1.0, np.float32)}, "Softmax:p", 1.0),
    # (a * b) * 8 before an FP32 sum: the scaled product is held, and the product it scales for it
    "products scaled, then summed": ("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[4,16] x) => (float[4] y) {
          a = MatMul(x, w)
          b = MatMul(x, w2)
          p = Mul(a, b)
          s = Mul(p, eight)
          y = ReduceSum<keepdims=0>(s, axes)
        }""", {"w": np.full((16, 16), 20.0, np.float32), "w2": np.full((16, 16), -20.0, np.float32),
               "eight": np.array(8.0, np.float32), "axes": np.array([-1], np.int64)}, "Mul:p", 1.0),
    # (a * b).sum(-1) of two activations near 750: the products pass 65504 before the FP32 sum
    "products summed": ("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[4,16] x) => (float[4] y) {
          a = MatMul(x, w)
          b = MatMul(x, w2)
          p = Mul(a, b)
          y = ReduceSum<keepdims=0>(p, axes)
        }""", {"w": np.full((16, 16), 20.0, np.float32), "w2": np.full((16, 16), -20.0, np.float32),
               "axes": np.array([-1], np.int64)}, "Mul:p", 1.0),
}


@pytest.mark.parametrize("case", sorted(_WIDENING_CASES))
def test_a_cast_never_moves_downstream_across_an_op_whose_result_fp16_cannot_hold(case):
    """The optimal placement computed a Softmax (or a product of two activations) in FP16 and cast
    its result up for the FP32 op reading it, where greedy kept it FP32 and cast its inputs: the
    probabilities underflowed to 0 (Log: -inf at 74 of 128 outputs), the products overflowed to inf.
    Such an op keeps FP32 where an FP32 reader reads it; a copying op may still move."""
    from amp_rewrite.emulate import emulate_low

    text, inits, node, scale = _WIDENING_CASES[case]
    model = make_model(text, inits)
    feeds = {"x": (np.abs(np.random.default_rng(0).standard_normal((4, model.graph.input[0].type.tensor_type
                                                                      .shape.dim[1].dim_value))) * scale)
             .astype(np.float32)}
    want = run(model, feeds)["y"]
    assert np.isfinite(want).all()
    for placement in ("optimal", "greedy"):
        result = rewrite(model, placement=placement)
        full_check(result.model)
        assert result.log.decisions[node].precision == Precision.FP32, placement
        got = run(emulate_low(result.model, TensorProto.FLOAT16)[0], feeds)["y"]
        assert np.isfinite(got).all() and rel_err(want, got) < 1e-2, placement
    assert "the optimal placement keeps it FP32 too" in rewrite(model).log.decisions[node].reason
    # BF16 holds FP32's exponent range: nothing is held for range there (the cut decides; a sum
    # before a log is held for its precision, and what it reads with it)
    bf16 = rewrite(model, target="bf16").log.decisions[node].reason
    assert "range" not in bf16.partition("keeps it FP32 too")[2] and "below 6e-8" not in bf16


_SATURATING = {
    # log(1 - sigmoid(z)): sigmoid(5.5) is 1 in bf16
    "log of 1 - sigmoid": ("""s = Sigmoid(h)
          d = Sub(one, s)
          y = Log(d)""", "Sigmoid:s"),
    # log(1 - tanh(z)^2): tanh(4.2) is 1 in fp16 (and the square is a deny pow there, passed through)
    "log of 1 - tanh squared": ("""t = Tanh(h)
          q = Mul(t, t)
          d = Sub(one, q)
          y = Log(d)""", "Tanh:t"),
}


@pytest.mark.parametrize("target", ["fp16", "bf16"])
@pytest.mark.parametrize("case", sorted(_SATURATING))
def test_a_value_near_one_before_a_difference_a_log_reads_keeps_greedys_fp32(case, target):
    """``log(1 - f(z))``: the Sub is held FP32 before its Log, but the optimal placement moved the
    sigmoid or tanh it reads to the low type, where a value near 1 is 1 (bf16: sigmoid(5.5); fp16:
    tanh(4.2)): 1 - 1 = 0 and the Log -inf where greedy, computing f in FP32, is finite. What greedy
    kept FP32 before a sum a log reads stays FP32."""
    from amp_rewrite.emulate import emulate_low

    body, node = _SATURATING[case]
    model = make_model(f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[4,8] x) => (float[4,8] y) {{
          h = MatMul(x, w)
          {body}
        }}""", {"w": np.eye(8, dtype=np.float32), "one": np.array(1.0, np.float32)})
    feeds = {"x": np.linspace(-7.0, 7.0, 32, dtype=np.float32).reshape(4, 8)}
    want = run(model, feeds)["y"]
    assert np.isfinite(want).all()
    low = TensorProto.FLOAT16 if target == "fp16" else TensorProto.BFLOAT16
    greedy, best = rewrite(model, placement="greedy", target=target), rewrite(model, target=target)
    full_check(best.model)
    assert _precisions(greedy)[node] == _precisions(best)[node] == "fp32", best.log.decisions[node].reason
    got = run(emulate_low(best.model, low)[0], feeds)["y"]
    assert np.isfinite(got).all() and rel_err(want, got) < 2e-2
    assert not rewrite(best.model, target=target).modified


def test_a_copying_op_before_an_fp32_reader_may_still_take_the_low_type():
    """Only ops that make new values are held: a Transpose between a low GEMM and an FP32 Log moves
    nothing FP16 cannot hold, and the optimal cut still casts after it when that is cheaper."""
    model = make_model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[4,32] x) => (float[32,4] y) {
          h = MatMul(x, w)
          r = Relu(h)
          t = Transpose<perm=[1,0]>(r)
          y = Log(t)
        }""", {"w": (32, 32)})
    decisions = rewrite(model, placement="optimal").log.decisions
    assert decisions["Relu:r"].precision == decisions["Transpose:t"].precision == Precision.LOW


@pytest.mark.parametrize("placement", ["optimal", "greedy"])
@pytest.mark.parametrize("where", ["main graph", "if branch"])
def test_an_identity_of_a_constant_fp16_cannot_hold_keeps_fp32(where, placement):
    """An Identity was no reader in the constant check (Reshape, Neg... were): ``b = Identity(B)`` of
    a 1e5 went FP16 and B was converted offline, clamped to 65504, in a graph output (34% off) or
    in the value an If's branch returns (the optimal placement made the If's output FP16)."""
    big = ",".join(["100000.0"] * 64)
    if where == "main graph":
        text = f"""<ir_version: 8, opset_import: ["" : 17]>
            g (float[4,8] x) => (float[8,8] y, float[4,8] z) {{
              B = Constant<value = float[8,8] {{{big}}}>()
              y = Identity(B)
              a = MatMul(x, W)
              z = MatMul(a, y)
            }}"""
    else:
        text = f"""<ir_version: 8, opset_import: ["" : 17]>
            g (float[4,8] x, bool c) => (float[4,8] y) {{
              y = If(c) <
                then_branch = t () => (float[4,8] a) {{
                  B = Constant<value = float[4,8] {{{big[:len(big) // 2]}}}>()
                  a = Identity(B)
                }},
                else_branch = e () => (float[4,8] b) {{ m = MatMul(x, W)  b = Relu(m) }}
              >
            }}"""
    model = make_model(text, {"W": (8, 8)})
    result = rewrite(model, placement=placement)
    full_check(result.model)
    identity = next(d for d in result.log.decisions.values() if d.op == "Identity")
    assert identity.precision == Precision.FP32 and "100000" in identity.reason
    feeds = {"x": np.random.default_rng(1).standard_normal((4, 8)).astype(np.float32), "c": np.array(True)}
    feeds = {k: v for k, v in feeds.items() if k in {i.name for i in model.graph.input}}
    assert run(result.model, feeds)["y"].max() == 1e5
    assert not rewrite(result.model, placement=placement).modified


def test_bf16_holds_no_product_or_softmax_for_the_range_fp16_lacks():
    """The FP16 holds (a product of two activations before an FP32 sum, a Softmax before a Log) held
    BF16 nodes FP32 too, one Cast and FP32 traffic more than before: BF16 has FP32's exponent
    range, so the min-cut decides them there."""
    model = make_model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[4,64] x, float[4,64] y) => (float[4] z, float[4,64] l) {
          a = MatMul(x, W1)
          b = MatMul(y, W2)
          p = Mul(a, b)
          z = ReduceSum<keepdims=0>(p, ax)
          s = Softmax(a)
          l = Log(s)
        }""", {"W1": (64, 64), "W2": (64, 64), "ax": np.array([1], np.int64)})
    fp16, bf16 = (_precisions(rewrite(model, target=t)) for t in ("fp16", "bf16"))
    assert fp16["Mul:p"] == fp16["Softmax:s"] == "fp32"
    assert bf16["Mul:p"] == bf16["Softmax:s"] == "low"


@pytest.mark.parametrize("seed", range(12))
def test_the_flow_pushed_straight_through_terminal_pairs_keeps_networkx_s_cut(seed):
    """Nodes joined to both terminals send min(a, b) straight through before Boykov-Kolmogorov runs
    (it found those paths one at a time, quadratic on a 12k-node cut). The source side must stay
    the one networkx's minimum_cut gives on the same network."""
    import networkx as nx

    from amp_rewrite.passes.optimal import _S, _T, _max_flow_source_side

    rng = random.Random(seed)
    nodes = set(range(30))
    edges = []
    for n in nodes:
        if rng.random() < 0.8:
            edges.append((_S, n, rng.choice([1, 2, 5, 8])))
        if rng.random() < 0.8:
            edges.append((n, _T, rng.choice([1, 3, 5, 8, None])))
    for _ in range(60):
        u, v = rng.sample(sorted(nodes), 2)
        edges.append((u, v, rng.choice([1, 2, 4, None])))
    graph = nx.DiGraph()
    graph.add_nodes_from([*nodes, _S, _T])
    for u, v, cap in edges:
        graph.add_edge(u, v, **({} if cap is None else {"capacity": cap}))
    _, (source_side, _) = nx.minimum_cut(graph, _S, _T)
    assert _max_flow_source_side(nodes, edges) == source_side


_GROWING_HEADS = {
    "embedding times sqrt(hidden), then the model's own Cast": "x = Gather(E, ids)\n h = Mul(x, s32)\n hc = Cast<to=1>(h)",
    "embedding plus a position table": "x = Gather(E, ids)\n h = Add(x, pos)\n hc = Cast<to=1>(h)",
    "a MatMul's output times 6": "a = MatMul(xin, W0)\n hc = Mul(a, six)",
    "a MatMul's output plus 50000": "a = MatMul(xin, W0)\n hc = Add(a, k50000)",
    "a MatMul's output over 0.25": "a = MatMul(xin, W0)\n hc = Div(a, quarter)",
}


@pytest.mark.parametrize("head", list(_GROWING_HEADS))
def test_optimal_keeps_a_scaling_that_may_pass_the_range_fp32_before_an_fp32_reader(head):
    """The min-cut took a value scaled or shifted by a constant or a gathered weight for 'one
    rounding' and moved the Cast past it: a value that fits FP16 times a constant above 1 (Gemma's
    sqrt(hidden), Granite's embedding_multiplier) or an embedding plus a position table passed
    65504, and the FP32 RMSNorm island read inf, where greedy (and FP32) are exact. A factor,
    addend or divisor that can grow the value keeps the node FP32 before an FP32 reader, as greedy
    does; a scale of at most 1 still goes low."""
    from amp_rewrite.emulate import emulate_low

    rng = np.random.default_rng(0)
    E = (rng.standard_normal((100, 32)) * 0.02).astype(np.float32)
    E[:, 0] = 15000.0  # (fits FP16; times 5.66 it does not)
    W0 = (rng.standard_normal((32, 32)) * 0.1).astype(np.float32)
    W0[:, 0] = 2000.0  # (the MatMul's output, ~3e4, fits FP16)
    pos = np.zeros((2, 8, 32), np.float32)
    pos[..., 0] = 60000.0
    feeds = {"ids": rng.integers(0, 100, (2, 8)).astype(np.int64),
             "xin": np.abs(rng.standard_normal((2, 8, 32))).astype(np.float32) * 0.5}
    text = f"""
    <ir_version: 8, opset_import: ["" : 17]>
    g (int64[2, 8] ids, float[2, 8, 32] xin) => (float[2, 8, 32] y) {{
        {_GROWING_HEADS[head]}
        sq = Pow(hc, two)
        ms = ReduceMean<axes=[-1]>(sq)
        sd = Sqrt(ms)
        nrm = Div(hc, sd)
        a2 = MatMul(nrm, W1)
        y = Add(hc, a2)
    }}"""
    weights = {"E": E, "pos": pos, "W0": W0, "s32": np.array(np.sqrt(32.0), np.float32),
               "six": np.array(6.0, np.float32), "two": np.array(2.0, np.float32), "W1": (32, 32),
               "k50000": np.array(50000.0, np.float32), "quarter": np.array(0.25, np.float32)}
    model = make_model(text, weights)
    reference = run(model, feeds)["y"]
    result = rewrite(model, placement="optimal", fuse=False)
    full_check(result.model)
    got = run(emulate_low(result.model, TensorProto.FLOAT16)[0], feeds)["y"]
    assert np.isfinite(got).all() and rel_err(reference, got) < 1e-2
    scaling = next(n for n in result.model.graph.node
                   if n.op_type in ("Mul", "Add", "Div") and n.output[0] in ("h", "hc"))
    assert {p.key: p.value for p in scaling.metadata_props}["amp_rewrite.precision"] == "fp32"
    # (a scale of at most 1, a divisor of at least 1: one rounding, and the min-cut still moves the
    # Cast past it; a constant addend of any size keeps its sum FP32: precision, tested below)
    shrinking = make_model(text.replace("Mul(a, six)", "Mul(a, half)").replace("Mul(x, s32)", "Mul(x, half)")
                           .replace("Add(a, k50000)", "Add(a, half)").replace("Div(a, quarter)", "Div(a, two)"),
                           {**weights, "half": np.array(0.5, np.float32)})
    if "position" not in head:
        again = rewrite(shrinking, placement="optimal", fuse=False).model
        scaled = next(n for n in again.graph.node
                      if n.op_type in ("Mul", "Add", "Div") and n.output[0].split("/")[0] in ("h", "hc"))
        want = "fp32" if "plus" in head else "low"
        assert {p.key: p.value for p in scaled.metadata_props}["amp_rewrite.precision"] == want


def test_size_estimates_through_ops_of_unknown_shape_are_made_once_per_value(monkeypatch):
    """A value of unknown shape is sized from its producer's inputs, recursively. Only the value
    asked for kept its estimate, so every path to an input estimated it again: through a chain of
    custom ops each read by the op and by the next Add, the count doubled per layer (50 nodes: 11.6
    million estimates, 6 s against greedy's 0.01 s). Each value is estimated once now."""
    calls = [0]
    estimate = optimal.Problem._estimate

    def counting(self, value, depth):
        calls[0] += 1
        return estimate(self, value, depth)

    monkeypatch.setattr(optimal.Problem, "_estimate", counting)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["v0"])]
    layers = 24
    for i in range(layers):  # a_i = my.Foo(v_i); v_{i+1} = a_i + v_i
        nodes += [helper.make_node("Foo", [f"v{i}"], [f"a{i}"], domain="my"),
                  helper.make_node("Add", [f"a{i}", f"v{i}"], [f"v{i + 1}"])]
    nodes.append(helper.make_node("MatMul", [f"v{layers}", "w"], ["y"]))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "S", 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", "S", 16])],
                              [numpy_helper.from_array(np.eye(16, dtype=np.float32), "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("my", 1)])
    model.ir_version = 8
    result = rewrite(model, placement="optimal")
    full_check(result.model)
    assert 0 < calls[0] <= 4 * len(nodes), calls[0]


def test_a_scope_with_no_free_node_gets_no_placement_note():
    """A lone MatMul (an allow op, fixed low) leaves the cut nothing to decide: the rewrite adds no
    'optimal placement' note and records no placement."""
    m = make_model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[4,8] x) => (float[4,8] y) { y = MatMul(x, w) }""", {"w": (8, 8)})
    log = rewrite(m, placement="optimal").log
    assert log.decisions["MatMul:y"].precision == Precision.LOW
    assert not [n for n in log.notes if n.startswith("optimal placement")]
    assert getattr(log, "placement", None) is None


def test_the_placement_note_of_a_scan_body_counts_bytes_per_iteration():
    """A Scan body's cost runs once per element of the sequence: its placement note gives the
    bytes per iteration, as a Loop body's does, not per run of a branch."""
    m = make_model("""
        <ir_version: 9, opset_import: ["" : 17]>
        g (float[8] h0, float[5,1,8] xs) => (float[8] h, float[5,1,8] ys) {
          h, ys = Scan <num_scan_inputs = 1, body = b (float[8] hp, float[1,8] xt) => (float[8] hn, float[1,8] yt) {
            t = Transpose<perm=[1,0]>(xt)
            u = Transpose<perm=[1,0]>(t)
            m = MatMul(u, w)
            r = ReduceSum<keepdims=0>(m)
            hn = Sub(hp, r)
            yt = Identity(m) }> (h0, xs)
        }""", {"w": (8, 8)}, ir_version=9)
    [note] = [n for n in rewrite(m, placement="optimal").log.notes if n.startswith("optimal placement (Scan:h.body)")]
    assert "FP32 traffic per iteration against greedy's" in note


_SCHEDULE = np.cumprod(1 - np.linspace(0.00085 ** 0.5, 0.012 ** 0.5, 1000) ** 2).astype(np.float32)  # Stable Diffusion's


_CONSTANT_ADDENDS = {
    # eps from an x0 prediction: (x - sqrt(a) * x0) / sqrt(1 - a), a = alphas_cumprod[t]
    "a diffusion schedule subtracted from 1": ("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[1,4,6,6] x, int64[1] t) => (float[1,4,6,6] y) {
          x0 = MatMul(x, W)
          a = Gather(schedule, t)
          sa = Sqrt(a)
          sx0 = Mul(sa, x0)
          num = Sub(x, sx0)
          oma = Sub(one, a)
          coef = Sqrt(oma)
          eps = Div(num, coef)
          y = MatMul(eps, W)
        }""", ["Gather:a", "Sub:oma"], "schedule"),
    # DDPM's beta_t = 1 - a_next / a_t: the ratio of two schedule entries is computed from weights
    # alone (an infer Div, not a data move); it went low with its Gathers (FP16 32% off, BF16 NaN)
    "a ratio of schedule entries subtracted from 1": ("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[1,4,6,6] x, int64[1] t) => (float[1,4,6,6] y) {
          h = MatMul(x, W)
          tn = Add(t, one_i)
          a = Gather(schedule, t)
          an = Gather(schedule, tn)
          r = Div(an, a)
          omr = Sub(one, r)
          c = Sqrt(omr)
          sr = Sqrt(r)
          sx = Mul(sr, h)
          num = Sub(x, sx)
          e = Div(num, c)
          y = MatMul(e, W)
        }""", ["Gather:a", "Gather:an", "Div:r", "Sub:omr"], "schedule"),
    # the schedule entry also scales an activation (a low product): the Gather went low with the
    # product, in greedy too, and the table was rounded offline before the FP32 1 - a
    "a schedule entry a low product also reads": ("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[1,4,6,6] x, int64[1] t) => (float[1,4,6,6] y) {
          h = MatMul(x, W)
          a = Gather(schedule, t)
          m = Mul(a, h)
          oma = Sub(one, a)
          c = Sqrt(oma)
          e = Div(m, c)
          y = MatMul(e, W)
        }""", ["Gather:a", "Sub:oma"], "schedule"),
    # box centres: a predicted offset plus anchor centres at image coordinates
    "anchor centres plus a predicted offset": ("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[1,4,6,6] x, int64[1] t) => (float[1,4,6,6] y) {
          d = MatMul(x, W)
          s = Mul(d, scale)
          y = Add(s, anchors)
        }""", ["Add:y"], "anchors"),
}


@pytest.mark.parametrize("target", ["fp16", "bf16"])
@pytest.mark.parametrize("case", list(_CONSTANT_ADDENDS))
def test_a_sum_with_a_constant_addend_greedy_keeps_fp32_keeps_its_exact_constant(case, target):
    """The min-cut took a constant for a free source and moved the Cast past a sum greedy kept FP32:
    the Gather of a diffusion schedule and ``1 - a`` went low, 0.99915 was rounded offline to
    0.99902 (FP16; 1.0 in BF16), and ``x / sqrt(1 - a)`` was 7% off (BF16: inf, then NaN); box
    centres at 1500-3500 px were rounded to FP16's 2 px spacing (BF16's 16). Such a sum, and the
    nodes moving weights into it, keep greedy's FP32 and the constant stays exact."""
    from amp_rewrite.emulate import emulate_low

    text, held, constant = _CONSTANT_ADDENDS[case]
    rng = np.random.default_rng(0)
    model = make_model(text, {"W": (rng.standard_normal((6, 6)) * 0.3).astype(np.float32),
                              "schedule": _SCHEDULE, "one": np.array(1.0, np.float32),
                              "scale": np.array(64.0, np.float32),
                              "anchors": (1500 + 2000 * rng.random((1, 4, 6, 6))).astype(np.float32),
                              "one_i": np.array([1], np.int64)})
    low = TensorProto.FLOAT16 if target == "fp16" else TensorProto.BFLOAT16
    feeds = {"x": rng.standard_normal((1, 4, 6, 6)).astype(np.float32), "t": np.array([0], np.int64)}
    want = run(model, feeds)["y"]
    greedy, best = rewrite(model, placement="greedy", target=target), rewrite(model, target=target)
    full_check(best.model)
    for name in held:
        assert _precisions(greedy)[name] == _precisions(best)[name] == "fp32", name
    assert "the optimal placement keeps it FP32 too" in best.log.decisions[held[-1]].reason
    assert {i.name: i.data_type for i in best.model.graph.initializer}[constant] == TensorProto.FLOAT
    got = run(emulate_low(best.model, low)[0], feeds)["y"]
    assert np.isfinite(got).all()
    if constant == "schedule":
        assert rel_err(want, got) < (2e-3 if target == "fp16" else 1e-2)
    else:  # (pixels: the offset's own rounding, not the anchor's spacing of 1-2 px in FP16, 8-16 in BF16)
        assert np.abs(want - got).max() < (0.25 if target == "fp16" else 2.0)
    assert not rewrite(best.model, target=target).modified


def test_a_constant_scale_may_still_take_the_low_type_before_an_fp32_reader():
    """Only sums are held: a product with a constant is one relative rounding wherever the Cast
    goes, and the min-cut still moves the Cast past it."""
    model = make_model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[1,4,6,6] x) => (float[1,4,6,6] y) {
          d = Conv<pads=[1,1,1,1]>(x, W)
          y = Mul(d, scale)
        }""", {"W": (4, 4, 3, 3), "scale": np.array(0.5, np.float32)})
    assert _precisions(rewrite(model, placement="greedy"))["Mul:y"] == "fp32"
    assert _precisions(rewrite(model))["Mul:y"] == "low"


@pytest.mark.parametrize("square", ["Pow", "Mul"])
def test_softmax_weights_an_fp32_sum_pools_keep_the_softmax_fp32(square):
    """Attentive statistics pooling (ECAPA): w = softmax over 3000 frames, mu = sum(w * h),
    var = sum(w * h * h) - mu^2. Optimal placement moved the softmax low (fewer bytes); its FP16
    weights do not sum to 1, and the variance's cancellation multiplies that by mu^2: the pooled std
    was 1.4e-2 from FP32 where greedy's FP32 softmax gives 2e-4."""
    from amp_rewrite.emulate import emulate_low

    rng = np.random.default_rng(1)
    c, t = 16, 3000
    sq = "hh = Pow(h, two)" if square == "Pow" else "hh = Mul(h, h)"
    m = make_model(f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[1,{c},{t}] x) => (float[1,{c}] std) {{
          h = Conv(x, wl, bl)
          th = Tanh(h)
          a = Conv(th, wa, ba)
          w = Softmax<axis = 2>(a)
          hw = Mul(h, w)
          mu = ReduceSum<keepdims = 0>(hw, axes)
          {sq}
          hhw = Mul(hh, w)
          m2 = ReduceSum<keepdims = 0>(hhw, axes)
          mu2 = Mul(mu, mu)
          var = Sub(m2, mu2)
          vc = Clip(var, eps)
          std = Sqrt(vc)
        }}""", {"wl": np.eye(c, dtype=np.float32)[:, :, None], "bl": np.zeros(c, np.float32),
                "wa": (rng.standard_normal((c, c, 1)) * 0.3).astype(np.float32), "ba": np.zeros(c, np.float32),
                "axes": np.array([2], np.int64), "two": np.array(2.0, np.float32), "eps": np.array(1e-4, np.float32)})
    x = (rng.standard_normal((1, c, t)) * 0.5 + 10).astype(np.float32)
    want = run(m, {"x": x})["std"]
    result = rewrite(m, placement="optimal")
    full_check(result.model)
    (softmax,) = [d for d in result.report.to_dict()["nodes"] if d["op"] == "Softmax"]
    assert softmax["precision"] == "fp32" and "an FP32 sum reduces its probabilities" in softmax["reason"]
    emulated, _ = emulate_low(result.model)
    assert rel_err(want, run(emulated, {"x": x})["std"]) < 2e-3
    assert not rewrite(result.model, placement="optimal").modified
