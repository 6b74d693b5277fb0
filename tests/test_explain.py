"""--explain NODE: why a node has its precision, back to the rule entries; writes no model."""

from __future__ import annotations

import subprocess
import sys

import onnx
import pytest

from report_models import LAYERNORM_NODES, block_model, branches_sharing_a_node_name
from util import ROOT, make_model

from amp_rewrite.cli import main
from amp_rewrite.errors import UsageError
from amp_rewrite.explain import explain_node


@pytest.fixture()
def block(tmp_path):
    path = tmp_path / "block.onnx"
    onnx.save(block_model(), path)
    return path


def _lines(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip()]


def test_node_inside_decomposed_layernorm_leads_to_the_deny_rule(block):
    text = explain_node(block, "ln_div", fuse=False)
    lines = _lines(text)
    assert lines[0] == "ln_div (Div) computes in fp32"
    chain = [line for line in lines if line.startswith(("ln_div (Div) fp32 [", "← "))]
    assert [c.split(" (")[0].lstrip("← ") for c in chain] == ["ln_div", "ln_sub", "ln_mean"]
    assert "[deny-spread" in chain[0] and "[classify" in chain[-1]
    assert any(line.startswith("rule entry: onnx-cuda-fp16.toml: deny.ReduceMean") for line in lines)
    assert "FP32 island 0 (main): LayerNorm pattern, 10 nodes, 1 cast in, 1 out" in text
    assert "ln_pow (Pow): deny rule onnx-cuda-fp16.toml: deny.Pow" in text


@pytest.mark.parametrize("name", LAYERNORM_NODES)
def test_every_layernorm_node_explains_back_to_a_deny_rule(block, name):
    text = explain_node(block, name, fuse=False)
    assert "computes in fp32" in text.splitlines()[0]
    assert "deny.ReduceMean" in text or "deny.Pow" in text
    assert "LayerNorm pattern" in text


def test_low_node_chain_ends_at_allow_rule(block):
    lines = _lines(explain_node(block, "k_t", fuse=False))
    assert lines[0] == "k_t (Transpose) computes in fp16"
    assert any(line.startswith("← scores (MatMul) fp16 [allow") for line in lines)
    assert any(line.startswith("rule entry: onnx-cuda-fp16.toml: allow.MatMul") for line in lines)


def test_casts_on_the_node_edges(block):
    text = explain_node(block, "ffn_up", fuse=False)
    assert "casts on its edges:" in text and "amp_cast/ln/to_fp16: ln fp32→fp16 into ffn_up, 2048 elements" in text


def test_explain_a_cast_and_an_output_name(block):
    text = explain_node(block, "amp_cast/ln/to_fp16", fuse=False)
    assert text.startswith("amp_cast/ln/to_fp16: Cast inserted on ln (fp32→fp16)")
    assert "edge: ln_add → ffn_up" in text and "12288 bytes moved per run" in text
    assert explain_node(block, "n", fuse=False).startswith("ln_div (Div)")  # the output tensor of ln_div


def test_undecided_node(tmp_path):
    model = make_model("""
        <ir_version: 9, opset_import: ["" : 17]>
        g (float[4,8] x) => (float[4,8] y, int64[2] s) { a = MatMul(x, w)
                                                         s = Shape(a)
                                                         y = Relu(a) }""", {"w": (8, 8)}, ir_version=9)
    model.graph.node[1].name = "shape_of_a"
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    assert "shape_of_a (Shape): unchanged" in explain_node(path, "shape_of_a")


def test_unknown_name_suggests_close_names(block):
    with pytest.raises(UsageError) as err:
        explain_node(block, "ln_dvi", fuse=False)
    assert "no node of that name" in err.value.message and "ln_div" in err.value.message


def test_options_change_the_answer(block):
    text = explain_node(block, "ln_div", fp16_nodes=["ln_div"], fuse=False)
    assert "ln_div (Div) computes in fp16" in text
    assert "node rule 'ln_div'" in text


def test_cli_explain_prints_and_writes_nothing(block, capsys):
    before = sorted(p.name for p in block.parent.iterdir())
    assert main([str(block), "--no-fuse", "--explain", "ln_div"]) == 0
    out = capsys.readouterr().out
    assert "deny.ReduceMean" in out and "ln_sub" in out
    assert sorted(p.name for p in block.parent.iterdir()) == before
    # -q (print only errors) printed nothing at all: the explanation is what was asked for
    assert main([str(block), "--no-fuse", "--explain", "ln_div", "-q"]) == 0
    assert capsys.readouterr().out == out


def test_cli_explain_unknown_node_exits_2(block, capsys):
    assert main([str(block), "--no-fuse", "--explain", "nope_14"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("amp-rewrite: error: --explain 'nope_14'")


def test_cli_explain_subprocess(block):
    proc = subprocess.run([sys.executable, "-m", "amp_rewrite", str(block), "--no-fuse", "--explain", "ln_mul"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "← ln_div" in proc.stdout and "← ln_sub" in proc.stdout and "← ln_mean" in proc.stdout
    assert proc.stderr == ""  # no progress bar when stderr is not a terminal
    assert not (block.parent / "block.fp16.onnx").exists()


def test_explain_names_the_optimal_step():
    """Nodes the min-cut placement decided printed '[optimal: optimal]': the step had no gloss."""
    from amp_rewrite.explain import _STEPS

    import amp_rewrite
    import onnx

    _, report = amp_rewrite.rewrite(onnx.load(str(ROOT / "models" / "tiny_bert.onnx")), report=True)
    steps = {d.step for d in report.log.decisions.values()}
    assert "optimal" in steps and steps <= set(_STEPS)


def test_explain_finds_a_node_by_its_output_name_as_the_model_has_it(tmp_path):
    """The rewrite renames a graph output's producer's output (y → y/amp_fp16) and fusion removes
    producers: --explain y, and --explain of a fused node's output, said there was no such node."""
    import onnx

    from amp_rewrite.explain import explain_node

    m = make_model("""
        <ir_version: 9, opset_import: ["" : 17]>
        g (float[4,8] x) => (float[4,8] y) {
          b = Relu(x)
          y = MatMul(b, w)
        }""", {"w": (8, 8)})
    for node in m.graph.node:
        node.name = {"Relu": "relu", "MatMul": "mm2"}[node.op_type]
    onnx.save(m, tmp_path / "m.onnx")
    assert explain_node(tmp_path / "m.onnx", "y").startswith("mm2 (MatMul) computes in fp16")
    assert explain_node(tmp_path / "m.onnx", "b").startswith("relu (Relu)")
    text = explain_node(ROOT / "models" / "transformer_block_op13.onnx", "ln1_var")  # made by an unnamed ReduceMean
    assert ": fused, with the rest of its LayerNorm pattern" in text


def test_a_name_two_scopes_share_asks_for_one_of_their_labels(tmp_path):
    """Both If branches hold a node 'mm'; the report labels each with its scope. --explain mm said
    "no node of that name" while listing both labels as the closest."""
    m = branches_sharing_a_node_name()
    onnx.save(m, tmp_path / "m.onnx")
    with pytest.raises(UsageError, match=r"2 nodes of .* have that name.*label: If:y\.then_branch/mm, If:y\.else_branch/mm$"):
        explain_node(tmp_path / "m.onnx", "mm")
    assert explain_node(tmp_path / "m.onnx", "If:y.then_branch/mm").startswith("If:y.then_branch/mm (MatMul) computes in fp16")


def test_a_main_graph_node_sharing_its_name_with_a_body_node_says_so(tmp_path):
    """--explain mm explained the main graph's mm without a word of the If branch's own mm
    (labelled If:y.then_branch/mm): the user could not tell which one they got."""
    m = make_model("""
        <ir_version: 9, opset_import: ["" : 17]>
        g (bool cond, float[4,8] x) => (float[4,8] y) {
          h = MatMul(x, w)
          y = If(cond) <
            then_branch = t () => (float[4,8] r) { r = MatMul(h, w) },
            else_branch = e () => (float[4,8] r2) { r2 = Exp(h) }
          >
        }""", {"w": (8, 8)})
    m.graph.node[0].name = "mm"
    next(a.g for a in m.graph.node[1].attribute if a.name == "then_branch").node[0].name = "mm"
    onnx.save(m, tmp_path / "m.onnx")
    text = explain_node(tmp_path / "m.onnx", "mm")
    assert text.startswith("mm (MatMul) computes in fp16")
    assert text.splitlines()[-1] == "(1 other node(s) named 'mm', in If/Loop/Scan bodies: ask for If:y.then_branch/mm)"
    assert explain_node(tmp_path / "m.onnx", "If:y.then_branch/mm").startswith("If:y.then_branch/mm (MatMul)")


def test_an_empty_name_is_refused():
    """--explain '' matched every unnamed node ("3 nodes have that name, in different scopes", all in
    the main graph), or silently explained the only one."""
    with pytest.raises(UsageError, match="--explain needs a node name"):
        explain_node(ROOT / "models" / "transformer_block_op13.onnx", "")


def test_an_op_whose_rule_covers_other_opsets_says_so(tmp_path):
    """A rule file's Softmax entry ending at opset 10 (it replaces every built-in Softmax entry) left
    an opset-17 Softmax 'no rule names Softmax', and --explain said 'decided by its rule entry'."""
    model = make_model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[2,8] x) => (float[2,8] y) {
          a = MatMul(x, w)
          p = Softmax(a)
          y = MatMul(p, w)
        }""", {"w": (8, 8)})
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    rules = tmp_path / "old_softmax.toml"
    rules.write_text('[clear.Softmax]\nreason = "old opsets only"\nuntil = 10\n')
    text = explain_node(path, "Softmax:p", rules=[rules])
    assert "no rule covers Softmax at opset 17 (old_softmax.toml: clear.Softmax covers opsets 1 to 10)" in text
    assert "decided by its rule entry" not in text and "no rule entry names it at its opset" in text


def test_explain_answers_for_the_clip_that_saturates_a_mask_before_its_cast(tmp_path):
    """The Clip (and its bound Constants) inserted before the Cast of a value that may hold a mask
    sentinel were in no section of the report, and --explain said there was no such node. They
    now explain as part of their Cast."""
    import numpy as np

    model = make_model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[4,8] x, float[4,8] keep) => (float[4,8] y) {
          q = MatMul(x, w1)
          inv = Sub(one, keep)
          neg = Mul(inv, big)
          s = Add(q, neg)
          sm = Softmax<axis = 1>(s)
          y = MatMul(sm, w2)
        }""", {"w1": (8, 8), "w2": (8, 8), "one": np.float32(1.0), "big": np.float32(-1e9)})
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    text = explain_node(path, "amp_saturate/neg")
    assert text.startswith("amp_saturate/neg: inserted with amp_cast/neg/to_fp16, to clamp 'neg'")
    assert "amp_cast/neg/to_fp16: Cast inserted on neg (fp32→fp16)" in text and "clamped to ±65504" in text
    bound = next(n for n in rewrite_names(model) if n.startswith("amp_saturate/neg/min"))
    assert explain_node(path, bound).startswith(f"{bound}: inserted with amp_cast/neg/to_fp16")


def rewrite_names(model: onnx.ModelProto) -> list[str]:
    from util import rewrite

    return [n.name for n in rewrite(model).model.graph.node]


def test_explain_answers_for_the_clamp_after_an_fp16_sum_with_a_mask(tmp_path):
    """The Clip that clamps an FP16 Add of scores and a saturated mask explains as part of the Add."""
    import numpy as np

    model = make_model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[4,8] x) => (float[4,8] y) {
          q = MatMul(x, w1)
          s = Add(q, causal)
          sm = Softmax<axis = 1>(s)
          y = MatMul(sm, w2)
        }""", {"w1": (8, 8), "w2": (8, 8), "causal": np.triu(np.full((4, 8), -1e9, np.float32), 1)})
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    text = explain_node(path, "amp_saturate/s")
    assert text.startswith("amp_saturate/s: inserted after Add:s, to clamp its fp16 sum to ±65504")
    assert "Add:s (Add) computes in fp16" in text


def test_an_allow_entry_holding_its_node_fp32_is_not_called_a_deny_rule(tmp_path):
    """An allow entry whose fp32_inputs pin an input sharing the op's type keeps the node FP32
    (deny): --explain printed 'rule entry: pin.toml: allow.Mul (deny Mul)' and 'deny rule
    pin.toml: allow.Mul', the user's allow entry called a deny rule."""
    import numpy as np

    model = make_model("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[4,16] x) => (float[4,16] y) {
      h = MatMul(x, w)
      m = Mul(h, s)
      e = Exp(m)
      y = MatMul(e, w2)
    }""", {"w": (16, 16), "w2": (16, 16), "s": np.full((16,), 0.5, np.float32)})
    path, rules = tmp_path / "m.onnx", tmp_path / "pin.toml"
    onnx.save(model, path)
    rules.write_text('[allow.Mul]\nreason = "always low, but keep the scale FP32"\nfp32_inputs = ["B"]\n')
    lines = _lines(explain_node(path, "Mul:m", rules=[rules]))
    assert lines[0] == "Mul:m (Mul) computes in fp32"
    [entry] = [line for line in lines if line.startswith("rule entry:")]
    assert entry.startswith("rule entry: pin.toml: allow.Mul (allow Mul; this node is deny: input 'B' is pinned FP32")
    [seed] = [line for line in lines if line.startswith("Mul:m (Mul): deny")]
    assert seed.startswith("Mul:m (Mul): deny: pin.toml: allow.Mul lists it allow, but input 'B'")
    assert not [line for line in lines if "deny rule" in line and "allow.Mul" in line]


def test_explain_node_takes_rewrite_onnx_s_options_and_names_a_misspelt_one(block):
    """Documented as taking rewrite_onnx's options: a misspelt one was Python's TypeError, and
    overwrite (which rewrite_onnx takes) was one too."""
    assert "ln_div" in explain_node(block, "ln_div", fuse=False, overwrite=True, external_data=None)
    with pytest.raises(UsageError, match=r"explain_node\(\) got an unknown option 'targt' \(did you mean 'target'\?\)"):
        explain_node(block, "ln_div", targt="bf16")


def _named_chain(tmp_path, middle="b = Relu(a)\n      c = Tanh(b)", names=None, opsets='"" : 17', value_info=()):
    """mm1 = MatMul(x, w), then ``middle``, then mm2 = MatMul(c, w) writing y; nodes named by op."""
    model = make_model(f"""
        <ir_version: 9, opset_import: [{opsets}]>
        g (float[4,8] x) => (float[4,8] y) {{
          a = MatMul(x, w)
          {middle}
          y = MatMul(c, w)
        }}""", {"w": (8, 8)})
    names = names or {"Relu": "relu", "Tanh": "tanh", "Cast": "own_cast"}
    for node in model.graph.node:
        node.name = ("mm1" if node.output[0] == "a" else "mm2") if node.op_type == "MatMul" else names[node.op_type]
    model.graph.value_info.extend(onnx.helper.make_tensor_value_info(v, onnx.TensorProto.FLOAT, [4, 8])
                                  for v in value_info)
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    return path


def test_a_command_line_pin_is_the_rule_entry_its_chain_ends_at(tmp_path):
    """--fp32-nodes and --fp32-ops are rule entries: the chain says the node was decided by its
    rule entry, names the flag as that entry with the op's list, and the island's seed line calls
    it a deny rule."""
    path = _named_chain(tmp_path)
    lines = _lines(explain_node(path, "relu", fp32_nodes=["relu"]))
    assert "relu (Relu) fp32 [classify: decided by its rule entry]" in lines
    assert "rule entry: --fp32-nodes (deny Relu)" in lines
    assert "relu (Relu): deny rule --fp32-nodes — node rule 'relu' keeps it FP32" in lines
    lines = _lines(explain_node(path, "tanh", fp32_ops=["Tanh"]))
    assert "tanh (Tanh) fp32 [classify: decided by its rule entry]" in lines
    assert "rule entry: --fp32-ops (deny Tanh)" in lines
    assert not any(line.startswith("decided by:") for line in lines)


def test_a_node_painted_from_an_island_seed_is_not_called_a_neighbour_that_joined_it(tmp_path):
    """A node whose chain leads to the island's seed (FP32 paint spread from it) is explained by
    that chain; the line for a node that joined the island as an FP32 neighbour is left out."""
    text = explain_node(_named_chain(tmp_path), "tanh", fp32_nodes=["relu"])
    assert "← relu (Relu) fp32 [classify: decided by its rule entry]" in text
    assert "FP32 island 0 (main)" in text
    assert "joined it as an FP32 neighbour" not in text


def test_an_unlisted_op_s_chain_ends_at_the_unlisted_verdict(tmp_path):
    """A typed op that no rule names is kept FP32 by the unlisted verdict, which explain names as
    the entry the chain ends at."""
    path = _named_chain(tmp_path, "c = custom.Foo(a)", names={"Foo": "foo"}, opsets='"" : 17, "custom" : 1',
                        value_info=["c"])
    lines = _lines(explain_node(path, "foo"))
    assert "rule entry: unlisted (unlisted custom::Foo)" in lines
    assert not any(line.startswith("decided by:") for line in lines)


def test_the_renamed_name_of_an_output_tensor_finds_its_producer(tmp_path):
    """The rewritten model calls the low value that its output's Cast reads ``y/amp_fp16``:
    --explain of that name explains the node writing it."""
    assert explain_node(_named_chain(tmp_path), "y/amp_fp16").startswith("mm2 (MatMul) computes in fp16")


def test_a_removed_cast_is_not_listed_on_its_neighbours_edges_nor_a_main_graph_cast_as_in_a_loop(tmp_path):
    """The model's own Cast(to=FLOAT) between two fp16 MatMuls does nothing after painting and is
    removed: mm1's explanation lists only the casts the written model has. A cast of the main
    graph runs once per run and says nothing of loops."""
    path = _named_chain(tmp_path, "c = Cast<to=1>(a)")
    edges = explain_node(path, "mm1").split("casts on its edges:")[1]
    assert "amp_cast/x/to_fp16" in edges and "own_cast" not in edges
    text = explain_node(path, "amp_cast/x/to_fp16")
    assert "bytes moved per run" in text and "loop body" not in text


def test_a_cast_into_an_island_names_the_island_in_its_reason(tmp_path):
    """The Cast into an FP32 island gives its reader's island with the reader's reason."""
    text = explain_node(_named_chain(tmp_path), "amp_cast/a/to_fp32", fp32_nodes=["relu"])
    assert "  why: relu (FP32 island 0) computes in FP32: node rule 'relu' keeps it FP32" in text.splitlines()
