"""Model-local functions are inlined before the rewrite (frontends/onnx_functions.py), so what a
call computes is decided like any other op; ``inline_functions=False`` keeps the calls, FP32."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from util import full_check, rel_err, rewrite, run, run_cli, value_types

from amp_rewrite.emulate import emulate_low

OPSET = 17
H = 8
RNG = np.random.default_rng(0)


def _weight(name: str, shape=(H, H)) -> onnx.TensorProto:
    return numpy_helper.from_array((RNG.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32), name)


def _block(name: str = "Block", *, opset: int = OPSET) -> onnx.FunctionProto:
    """x → LeakyRelu(x @ w1, alpha) @ w2 + x, alpha an attribute whose default is the function's."""
    body = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"),
            helper.make_node("LeakyRelu", ["h"], ["a"], name="act"),
            helper.make_node("MatMul", ["a", "w2"], ["p"], name="mm2"),
            helper.make_node("Add", ["p", "x"], ["y"], name="res")]
    body[1].attribute.append(helper.make_attribute_ref("alpha", onnx.AttributeProto.FLOAT))
    function = helper.make_function("local", name, ["x", "w1", "w2"], ["y"], body,
                                    [helper.make_opsetid("", opset)])
    function.attribute_proto.append(helper.make_attribute("alpha", 0.2))  # (not LeakyRelu's own 0.01)
    return function


def _model(nodes, functions, inits, *, opset: int = OPSET) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, H])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, H])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid("local", 1)],
                             functions=functions, ir_version=8)


def _two_blocks() -> onnx.ModelProto:
    nodes = [helper.make_node("Block", ["x", "a1", "a2"], ["b"], domain="local", name="/b1"),
             helper.make_node("Block", ["b", "c1", "c2"], ["z"], domain="local", name="/b2"),
             helper.make_node("MatMul", ["z", "head"], ["y"], name="head")]
    return _model(nodes, [_block()], [_weight(n) for n in ("a1", "a2", "c1", "c2", "head")])


def _feeds() -> dict:
    return {"x": np.random.default_rng(1).standard_normal((4, H)).astype(np.float32)}


def _precisions(result) -> dict[str, str]:
    return {f"{d.op}:{d.node}": d.precision.value for d in result.log.decisions.values()}


def _calling_in_a_branch(op: str, functions, first: onnx.NodeProto) -> onnx.ModelProto:
    """``first`` (making ``o``) → ReduceMean → Greater → If, whose then branch (the one that runs)
    calls ``op`` as '/then'; the else branch is a MatMul."""
    then = helper.make_graph([helper.make_node(op, ["x", "a1", "a2"], ["yt"], domain="local", name="/then")],
                             "then", [], [helper.make_tensor_value_info("yt", TensorProto.FLOAT, [4, H])])
    other = helper.make_graph([helper.make_node("MatMul", ["x", "a1"], ["ye"], name="/else/mm")],
                              "else", [], [helper.make_tensor_value_info("ye", TensorProto.FLOAT, [4, H])])
    nodes = [first,
             helper.make_node("ReduceMean", ["o"], ["m"], name="mean", keepdims=0),
             helper.make_node("Greater", ["m", "zero"], ["c"], name="cmp"),
             helper.make_node("If", ["c"], ["y"], name="branch", then_branch=then, else_branch=other)]
    zero = numpy_helper.from_array(np.array(-1e9, np.float32), "zero")  # (the then branch runs)
    return _model(nodes, functions, [_weight("a1"), _weight("a2"), zero])


def test_each_call_is_inlined_named_under_it_and_its_gemms_run_low():
    m = _two_blocks()
    given = m.SerializeToString()
    result = rewrite(m)
    assert m.SerializeToString() == given  # (the argument is not modified)
    out = result.model
    full_check(out)
    assert not len(out.functions)
    names = [n.name for n in out.graph.node if n.op_type != "Cast"]
    assert names == ["/b1/mm1", "/b1/act", "/b1/mm2", "/b1/res", "/b2/mm1", "/b2/act", "/b2/mm2", "/b2/res", "head"]
    low = {name for name, p in _precisions(result).items() if p == "low"}
    assert {"MatMul:/b1/mm1", "MatMul:/b1/mm2", "MatMul:/b2/mm1", "MatMul:/b2/mm2", "MatMul:head"} <= low
    assert any("model-local functions inlined: local::Block ×2" in n for n in result.log.notes)
    # the function's default alpha (0.2) holds in the inlined LeakyRelu, in onnxruntime and emulated
    ref = run(m, _feeds())["y"]
    assert rel_err(ref, run(out, _feeds())["y"]) < 1e-2
    assert rel_err(ref, run(emulate_low(out)[0], _feeds())["y"]) < 1e-2
    # and rewriting the output again changes nothing
    assert not rewrite(out).modified


def test_a_pin_by_the_calls_name_reaches_what_it_computes():
    result = rewrite(_two_blocks(), fp32_nodes=["/b1/*"])
    precision = _precisions(result)
    assert precision["MatMul:/b1/mm1"] == "fp32" and precision["MatMul:/b1/mm2"] == "fp32"
    assert precision["MatMul:/b2/mm1"] == "low"


def test_unnamed_calls_name_their_nodes_under_the_function_and_call_index():
    """A call with no name names what it inlines ``<Function>_<index>/<node>``: two unnamed
    Block calls give ``Block_0/...`` and ``Block_1/...``, and a pin by that prefix reaches one call."""
    nodes = [helper.make_node("Block", ["x", "a1", "a2"], ["b"], domain="local"),
             helper.make_node("Block", ["b", "c1", "c2"], ["z"], domain="local"),
             helper.make_node("MatMul", ["z", "head"], ["y"], name="head")]
    m = _model(nodes, [_block()], [_weight(n) for n in ("a1", "a2", "c1", "c2", "head")])
    result = rewrite(m)
    full_check(result.model)
    names = [n.name for n in result.model.graph.node if n.op_type != "Cast"]
    assert names == ["Block_0/mm1", "Block_0/act", "Block_0/mm2", "Block_0/res",
                     "Block_1/mm1", "Block_1/act", "Block_1/mm2", "Block_1/res", "head"]
    precision = _precisions(rewrite(m, fp32_nodes=["Block_1/*"]))
    assert precision["MatMul:Block_1/mm1"] == "fp32" and precision["MatMul:Block_1/mm2"] == "fp32"
    assert precision["MatMul:Block_0/mm1"] == "low" and precision["MatMul:head"] == "low"


def test_keeping_the_functions_keeps_the_calls_fp32_and_says_how_to_inline():
    m = _two_blocks()
    result = rewrite(m, inline_functions=False)
    out = result.model
    full_check(out)
    assert [f.name for f in out.functions] == ["Block"]
    assert [n.name for n in out.graph.node if n.op_type == "Block"] == ["/b1", "/b2"]
    assert _precisions(result)["MatMul:head"] == "low"
    assert any("kept FP32: local::Block ×2" in n and "without --no-inline-functions" in n for n in result.log.notes)
    assert rel_err(run(m, _feeds())["y"], run(out, _feeds())["y"]) < 1e-2


@pytest.mark.parametrize("flag", ["fp32_ops", "fp16_ops"])
def test_an_op_flag_naming_an_op_of_a_kept_function_body_says_so(flag):
    """With the functions kept (inline_functions=False), --fp32-ops/--fp16-ops LeakyRelu (an op
    only the Block's body holds) was said to name 'an op this model does not have'. Inlined, the
    flag names a node of the graph and there is no such note."""
    kept = rewrite(_two_blocks(), inline_functions=False, **{flag: ["LeakyRelu"]})
    [note] = [n for n in kept.log.notes if n.startswith("unmatched:")]
    assert "names an op only the bodies of model-local functions hold" in note
    inlined = rewrite(_two_blocks(), **{flag: ["LeakyRelu"]})
    assert not [n for n in inlined.log.notes if n.startswith("unmatched:")]


def test_nested_calls_and_calls_inside_a_branch_are_inlined():
    """A function calling another, and a call in an If branch: every body ends up rewritten."""
    inner = _block("Inner")
    outer = helper.make_function(
        "local", "Outer", ["x", "w1", "w2"], ["y"],
        [helper.make_node("Inner", ["x", "w1", "w2"], ["t"], domain="local", name="first"),
         helper.make_node("Inner", ["t", "w1", "w2"], ["y"], domain="local", name="second")],
        [helper.make_opsetid("", OPSET), helper.make_opsetid("local", 1)])
    m = _calling_in_a_branch("Outer", [inner, outer],
                             helper.make_node("Outer", ["x", "a1", "a2"], ["o"], domain="local", name="/main"))
    result = rewrite(m)
    out = result.model
    full_check(out)
    assert not len(out.functions)
    branch = next(n for n in out.graph.node if n.op_type == "If")
    then_names = {n.name for a in branch.attribute if a.name == "then_branch" for n in a.g.node}
    assert "/then/first/mm1" in then_names and "/then/second/mm2" in then_names
    precision = _precisions(result)
    for call in ("/main/first", "/main/second", "/then/first", "/then/second"):
        assert precision[f"MatMul:{call}/mm1"] == "low", call
    ref = run(m, _feeds())["y"]
    assert rel_err(ref, run(emulate_low(out)[0], _feeds())["y"]) < 1e-2
    assert not rewrite(out).modified


def test_a_function_of_another_opset_is_kept_and_the_note_says_why():
    m = _model([helper.make_node("Block", ["x", "a1", "a2"], ["y"], domain="local", name="/b1")],
               [_block(opset=18)], [_weight("a1"), _weight("a2")])
    result = rewrite(m)
    assert [f.name for f in result.model.functions] == ["Block"]
    note = next(n for n in result.log.notes if "kept FP32: local::Block ×1" in n)
    assert "could not be inlined (function local::Block imports ai.onnx opset 18, the model 17)" in note


def test_with_nothing_to_rewrite_the_output_is_the_input_functions_and_all(tmp_path: Path):
    """Inlined, a body of FP32-only ops changes nothing: the input is written as it is."""
    body = [helper.make_node("Exp", ["x"], ["y"], name="exp")]
    function = helper.make_function("local", "E", ["x"], ["y"], body, [helper.make_opsetid("", OPSET)])
    m = _model([helper.make_node("E", ["x"], ["y"], domain="local", name="/e")], [function], [])
    result = rewrite(m)
    assert not result.modified
    assert result.model.SerializeToString() == m.SerializeToString()
    src = tmp_path / "m.onnx"
    onnx.save(m, src)
    proc = run_cli([str(src), "-o", str(tmp_path / "out.onnx")], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "out.onnx").read_bytes() == src.read_bytes()
    assert "inlined" not in proc.stdout


def test_inlining_a_model_with_external_data_keeps_its_weights_outside(tmp_path: Path):
    m = _two_blocks()
    src = tmp_path / "m.onnx"
    onnx.save_model(m, str(src), save_as_external_data=True, all_tensors_to_one_file=True, location="m.data",
                    size_threshold=0)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    proc = run_cli([str(src), "-o", str(tmp_path / "out.onnx"), "--check"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "model-local functions inlined: local::Block ×2" in proc.stdout
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.name in before} == before
    out = onnx.load(str(tmp_path / "out.onnx"))
    onnx.checker.check_model(str(tmp_path / "out.onnx"), full_check=True)
    assert not len(out.functions)
    assert value_types(out)["a1"] == TensorProto.FLOAT16


@pytest.mark.parametrize("inline", [True, False])
def test_a_torchscript_export_with_modules_as_functions(tmp_path: Path, inline: bool):
    """What TorchScript's export_modules_as_functions writes: every GEMM of the blocks in
    functions. Inlined, all of them run low; kept, only the head."""
    torch = pytest.importorskip("torch")

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l1, self.l2, self.ln = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16), torch.nn.LayerNorm(16)

        def forward(self, x):
            return self.ln(x + self.l2(torch.relu(self.l1(x))))

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.b1, self.b2, self.head = Block(), Block(), torch.nn.Linear(16, 4)

        def forward(self, x):
            return self.head(self.b2(self.b1(x)))

    torch.manual_seed(0)
    path = tmp_path / "fn.onnx"
    x = torch.randn(2, 8, 16)
    torch.onnx.export(Net().eval(), (x,), str(path), dynamo=False, opset_version=OPSET,
                      export_modules_as_functions={Block}, input_names=["x"], output_names=["y"])
    m = onnx.load(str(path))
    assert len(m.functions) == 1
    result = rewrite(m, inline_functions=inline)
    out = result.model
    full_check(out)
    gemms = [d for d in result.log.decisions.values() if d.op in ("MatMul", "Gemm")]
    low = [d for d in gemms if d.precision.value == "low"]
    assert (len(low), len(gemms)) == ((5, 5) if inline else (1, 1))
    feeds = {"x": x.numpy()}
    assert rel_err(run(m, feeds)["y"], run(emulate_low(out)[0], feeds)["y"]) < 1e-2


def test_the_inliner_is_given_the_structure_not_the_weights(monkeypatch):
    """onnx's inliner serialises the model it is given: with the weights, a model past 2 GB could not
    be inlined. The main graph's initializers are set aside and put back after."""
    from onnx import inliner

    seen = []
    real = inliner.inline_local_functions

    def spy(model, *args, **kwargs):
        seen.append(len(model.graph.initializer))
        return real(model, *args, **kwargs)

    monkeypatch.setattr(inliner, "inline_local_functions", spy)
    m = _two_blocks()
    out = rewrite(m).model
    assert seen == [0]
    assert sorted(t.name for t in out.graph.initializer) == sorted(t.name for t in m.graph.initializer)


def test_a_branch_inside_a_function_is_named_under_the_call():
    then = helper.make_graph([helper.make_node("MatMul", ["x", "w1"], ["t"], name="mm_then")], "then", [],
                             [helper.make_tensor_value_info("t", TensorProto.FLOAT, [4, H])])
    other = helper.make_graph([helper.make_node("MatMul", ["x", "w2"], ["e"], name="mm_else")], "else", [],
                              [helper.make_tensor_value_info("e", TensorProto.FLOAT, [4, H])])
    body = [helper.make_node("ReduceMean", ["x"], ["m"], name="mean", keepdims=0),
            helper.make_node("Greater", ["m", "m"], ["c"], name="cmp"),
            helper.make_node("If", ["c"], ["y"], name="branch", then_branch=then, else_branch=other)]
    function = helper.make_function("local", "Pick", ["x", "w1", "w2"], ["y"], body, [helper.make_opsetid("", OPSET)])
    m = _model([helper.make_node("Pick", ["x", "a1", "a2"], ["y"], domain="local", name="/pick")], [function],
               [_weight("a1"), _weight("a2")])
    result = rewrite(m)
    full_check(result.model)
    branch = next(n for n in result.model.graph.node if n.op_type == "If")
    assert branch.name == "/pick/branch"
    assert {n.name for a in branch.attribute for n in a.g.node if n.op_type == "MatMul"} == {"/pick/mm_then",
                                                                                           "/pick/mm_else"}
    assert _precisions(result)["MatMul:/pick/mm_else"] == "low"
    assert rel_err(run(m, _feeds())["y"], run(result.model, _feeds())["y"]) < 1e-2


def test_a_function_called_only_inside_a_branch_is_inlined():
    """The only call of Block is in an If's then branch: the main graph calls no function, and the
    call is still inlined, its GEMMs low."""
    m = _calling_in_a_branch("Block", [_block()], helper.make_node("MatMul", ["x", "a1"], ["o"], name="pre"))
    result = rewrite(m)
    out = result.model
    full_check(out)
    assert not len(out.functions)
    precision = _precisions(result)
    assert precision["MatMul:/then/mm1"] == "low" and precision["MatMul:/then/mm2"] == "low"
    assert rel_err(run(m, _feeds())["y"], run(emulate_low(out)[0], _feeds())["y"]) < 1e-2


def test_a_function_importing_a_domain_the_model_does_not_import_is_inlined():
    """Block also imports com.microsoft, which the model does not: no opset disagrees, so the call
    is inlined and its GEMMs run low."""
    function = _block()
    function.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    m = _model([helper.make_node("Block", ["x", "a1", "a2"], ["y"], domain="local", name="/b1")],
               [function], [_weight("a1"), _weight("a2")])
    result = rewrite(m)
    out = result.model
    full_check(out)
    assert not len(out.functions)
    precision = _precisions(result)
    assert precision["MatMul:/b1/mm1"] == "low" and precision["MatMul:/b1/mm2"] == "low"
    assert rel_err(run(m, _feeds())["y"], run(out, _feeds())["y"]) < 1e-2


def test_an_inlined_node_keeps_its_suffix_when_the_plain_name_is_taken():
    """A main-graph MatMul is already named '/b1/mm1', beside a call '/b1' of Block: the inlined
    copy keeps a suffixed name, so node names stay unique and the model loads."""
    nodes = [helper.make_node("MatMul", ["x", "a0"], ["x0"], name="/b1/mm1"),
             helper.make_node("Block", ["x0", "a1", "a2"], ["b"], domain="local", name="/b1"),
             helper.make_node("MatMul", ["b", "head"], ["y"], name="head")]
    m = _model(nodes, [_block()], [_weight(n) for n in ("a0", "a1", "a2", "head")])
    out = rewrite(m).model
    full_check(out)
    assert not len(out.functions)
    names = [n.name for n in out.graph.node if n.name]
    assert len(names) == len(set(names))
    assert "/b1/mm1" in names and "/b1/mm1__1" in names and "/b1/act" in names
    assert rel_err(run(m, _feeds())["y"], run(out, _feeds())["y"]) < 1e-2
