"""Malformed and edge inputs through the real CLI (``python -m amp_rewrite`` in a subprocess).

Every case checks the whole user-visible contract (docs/exit-codes.md):

- the documented exit code;
- stderr is empty on success, else exactly ONE line starting ``amp-rewrite: error:`` that names
  the problem (never an internal error, never a traceback);
- the input files are byte-identical afterwards (hashed before and after);
- no stray files: a failure leaves the folder exactly as it was, a success adds exactly the
  output (plus its ``.data`` file when the output uses external data);
- a success's output passes ``onnx.checker`` and loads in onnxruntime (in a child process).
"""

from __future__ import annotations

import hashlib
import os
import re
import resource
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

from ortrun import load_ok, run_onnx  # noqa: E402
from util import run_cli  # noqa: E402

OPSET = 17
IR_VERSION = 8
NOTHING_TO_DO = "nothing to rewrite"


# -- builders ---------------------------------------------------------------------------------------
def vi(name: str, dtype: int = TensorProto.FLOAT, shape=(2, 4)):
    return helper.make_tensor_value_info(name, dtype, list(shape) if shape is not None else None)


def model(nodes, inputs, outputs, inits=(), *, opset: int = OPSET, ir_version: int = IR_VERSION,
          extra_opsets=(), functions=(), sparse=(), value_info=()) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", list(inputs), list(outputs), list(inits), sparse_initializer=list(sparse),
                              value_info=list(value_info))
    opsets = [helper.make_opsetid("", opset), *[helper.make_opsetid(d, v) for d, v in extra_opsets]]
    return helper.make_model(graph, opset_imports=opsets, ir_version=ir_version, functions=list(functions))


def weight(name: str, shape=(4, 4), seed: int = 0):
    return numpy_helper.from_array(np.random.default_rng(seed).standard_normal(shape).astype(np.float32), name)


def mlp(**kw) -> onnx.ModelProto:
    """x → MatMul(w1) → Relu → MatMul(w2) → y: the smallest model with something to rewrite."""
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"),
             helper.make_node("Relu", ["h"], ["r"], name="relu"),
             helper.make_node("MatMul", ["r", "w2"], ["y"], name="mm2")]
    return model(nodes, [vi("x")], [vi("y")], [weight("w1"), weight("w2", seed=1)], **kw)


def save(proto: onnx.ModelProto, path: Path) -> Path:
    path.write_bytes(proto.SerializeToString())
    return path


def save_external(proto: onnx.ModelProto, path: Path, location: str = "weights.bin") -> Path:
    onnx.save_model(proto, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=location, size_threshold=0, convert_attribute=False)
    return path


# -- the harness ------------------------------------------------------------------------------------
@dataclass
class Case:
    argv: list[str]  # arguments after ``python -m amp_rewrite``; paths relative to the case folder
    code: int  # expected exit code
    message: str | None = None  # regex the stderr line (or, for success, stdout) must match
    outputs: list[str] = field(default_factory=list)  # files a success adds (relative names)
    inputs: list[str] = field(default_factory=list)  # files that must stay byte-identical
    feeds: dict[str, np.ndarray] | None = None  # run the output in onnxruntime with these inputs
    preexec: Callable[[], None] | None = None
    runtime: bool = True  # False: onnxruntime's CPU provider cannot load it (custom ops, bf16 MatMul)


def snapshot(folder: Path) -> dict[str, str]:
    out = {}
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            out[str(path.relative_to(folder))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def check_case(case: Case, folder: Path) -> subprocess.CompletedProcess:
    before = snapshot(folder)
    for name in case.inputs:
        assert name in before, f"test bug: input {name} was not created"
    proc = run_cli(case.argv, folder, preexec=case.preexec)
    after = snapshot(folder)
    detail = f"\n--- rc={proc.returncode}\n--- stdout:\n{proc.stdout}\n--- stderr:\n{proc.stderr}"
    assert "Traceback" not in proc.stderr + proc.stdout, detail
    assert "internal error" not in proc.stderr, detail
    assert proc.returncode == case.code, detail
    for name in case.inputs:
        assert after.get(name) == before[name], f"input {name} changed or vanished" + detail
    if case.code != 0:
        lines = proc.stderr.splitlines()
        assert len(lines) == 1, "stderr must be exactly one line" + detail
        assert lines[0].startswith("amp-rewrite: error: "), detail
        if case.message:
            assert re.search(case.message, lines[0], re.I), f"message does not match {case.message!r}" + detail
        assert after == before, f"stray files: {sorted(set(after) - set(before))}" + detail
        return proc
    assert proc.stderr == "", "a success prints nothing on stderr" + detail
    if case.message:
        assert re.search(case.message, proc.stdout, re.I), f"stdout does not match {case.message!r}" + detail
    added = sorted(set(after) - set(before))
    assert added == sorted(case.outputs), f"expected to add {case.outputs}, added {added}" + detail
    changed = [k for k in before if after.get(k) != before[k]]
    assert not changed, f"files changed: {changed}" + detail
    out = folder / case.outputs[0]
    onnx.checker.check_model(str(out), full_check=False)
    if not case.runtime:
        return proc
    if case.feeds is not None:
        run_onnx(out, case.feeds)  # loads and runs; raises OrtRunError on failure or crash
    else:
        ok, why = load_ok(out)
        assert ok, why
    return proc


def feed(shape=(2, 4), dtype=np.float32, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


# -- malformed files -----------------------------------------------------------------------------------
def case_empty_file(d: Path) -> Case:
    (d / "m.onnx").write_bytes(b"")
    return Case(["m.onnx"], 3, r"m\.onnx: the file is empty", inputs=["m.onnx"])


def case_random_bytes(d: Path) -> Case:
    (d / "m.onnx").write_bytes(np.random.default_rng(7).bytes(4096))
    return Case(["m.onnx"], 3, r"not a valid ONNX model", inputs=["m.onnx"])


def case_text_file(d: Path) -> Case:
    (d / "m.onnx").write_text("this is not a model\n" * 10)
    return Case(["m.onnx"], 3, r"not a valid ONNX model", inputs=["m.onnx"])


def case_truncated_protobuf(d: Path) -> Case:
    data = mlp().SerializeToString()
    (d / "m.onnx").write_bytes(data[: len(data) * 2 // 3])
    return Case(["m.onnx"], 3, r"not a valid ONNX model", inputs=["m.onnx"])


def case_truncated_tiny(d: Path) -> Case:
    data = mlp().SerializeToString()
    (d / "m.onnx").write_bytes(data[:7])
    return Case(["m.onnx"], 3, r"not a valid ONNX model", inputs=["m.onnx"])


def case_missing_input(d: Path) -> Case:
    return Case(["nope.onnx"], 3, r"nope\.onnx: no such file")


def case_missing_input_with_an_existing_output(d: Path) -> Case:
    """The output's complaint came first: "out.onnx: already exists" (exit 6) for a model that
    is not there; the missing model is the error to fix."""
    (d / "out.onnx").write_bytes(b"kept")
    return Case(["nope.onnx", "-o", "out.onnx"], 3, r"nope\.onnx: no such file", inputs=["out.onnx"])


def case_missing_input_with_a_missing_output_folder(d: Path) -> Case:
    return Case(["nope.onnx", "-o", "no/dir/out.onnx"], 3, r"nope\.onnx: no such file")


def case_missing_input_with_an_existing_report(d: Path) -> Case:
    (d / "r.json").write_bytes(b"{}")
    return Case(["nope.onnx", "--report", "r.json"], 3, r"nope\.onnx: no such file", inputs=["r.json"])


def case_input_is_directory(d: Path) -> Case:
    (d / "dir.onnx").mkdir()
    return Case(["dir.onnx"], 3, r"is a directory")


def case_missing_external_data(d: Path) -> Case:
    save_external(mlp(), d / "m.onnx")
    (d / "weights.bin").unlink()
    return Case(["m.onnx"], 3, r"external data file 'weights\.bin'.*missing", inputs=["m.onnx"])


def case_short_external_data(d: Path) -> Case:
    save_external(mlp(), d / "m.onnx")
    data = (d / "weights.bin").read_bytes()
    (d / "weights.bin").write_bytes(data[:40])
    return Case(["m.onnx"], 3, r"external data file 'weights\.bin' is too short", inputs=["m.onnx", "weights.bin"])


def case_short_external_data_in_a_later_tensor(d: Path) -> Case:
    """Cut inside the second tensor (the first whole): the length check counts the tensor's
    offset; left out, the check passes and the read fails later, an internal error (exit 70)."""
    save_external(mlp(), d / "m.onnx")
    data = (d / "weights.bin").read_bytes()
    (d / "weights.bin").write_bytes(data[:-10])
    return Case(["m.onnx"], 3, r"external data file 'weights\.bin' is too short for tensor 'w2'",
                inputs=["m.onnx", "weights.bin"])


def case_external_data_escapes(d: Path) -> Case:
    (d / "sub").mkdir()
    save_external(mlp(), d / "sub" / "m.onnx", location="weights.bin")
    (d / "sub" / "weights.bin").rename(d / "weights.bin")
    proto = onnx.load(str(d / "sub" / "m.onnx"), load_external_data=False)
    for tensor in proto.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = "../weights.bin"
    save(proto, d / "sub" / "m.onnx")
    return Case(["sub/m.onnx"], 3, r"escapes the model folder", inputs=["sub/m.onnx", "weights.bin"])


def _set_external(path: Path, key: str, value: str) -> None:
    proto = onnx.load(str(path), load_external_data=False)
    for tensor in proto.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == key:
                entry.value = value
    save(proto, path)


def case_external_data_absolute_location(d: Path) -> Case:
    """An absolute location inside the model's folder was said to escape it."""
    save_external(mlp(), d / "m.onnx")
    _set_external(d / "m.onnx", "location", str(d / "weights.bin"))
    return Case(["m.onnx"], 3, r"is an absolute path; ONNX locations are relative", inputs=["m.onnx", "weights.bin"])


def case_external_data_offset_not_a_number(d: Path) -> Case:
    """onnx-ir's 'invalid literal for int()' named neither the tensor nor the key."""
    save_external(mlp(), d / "m.onnx")
    _set_external(d / "m.onnx", "offset", "abc")
    return Case(["m.onnx"], 3, r"tensor 'w1': its external data offset is 'abc', not a whole number",
                inputs=["m.onnx", "weights.bin"])


def case_external_data_unknown_key(d: Path) -> Case:
    """onnx-ir printed a UserWarning with its source line per tensor; every reader ignores the key."""
    save_external(mlp(), d / "m.onnx")
    proto = onnx.load(str(d / "m.onnx"), load_external_data=False)
    for tensor in proto.graph.initializer:
        entry = tensor.external_data.add()
        entry.key, entry.value = "foo", "bar"
    save(proto, d / "m.onnx")
    return Case(["m.onnx", "-o", "out.onnx"], 0, outputs=["out.onnx"], inputs=["m.onnx", "weights.bin"],
                feeds={"x": feed()})


def case_external_data_hard_link(d: Path) -> Case:
    save_external(mlp(), d / "m.onnx")
    os.link(d / "weights.bin", d / "weights-link.bin")
    return Case(["m.onnx"], 3, r"'weights\.bin' has 2 hard links.*copy", inputs=["m.onnx", "weights.bin"])


def case_external_data_symlink_out_of_folder(d: Path) -> Case:
    (d / "sub").mkdir()
    save_external(mlp(), d / "sub" / "m.onnx")
    (d / "sub" / "weights.bin").rename(d / "real.bin")
    (d / "sub" / "weights.bin").symlink_to(d / "real.bin")
    return Case(["sub/m.onnx"], 3, r"'weights\.bin' is a link to .*outside the model folder", inputs=["sub/m.onnx"])


def case_external_data_symlink_in_folder(d: Path) -> Case:
    """A symlink that stays inside the model folder is fine."""
    save_external(mlp(), d / "m.onnx")
    (d / "weights.bin").rename(d / "real.bin")
    (d / "weights.bin").symlink_to("real.bin")
    return Case(["m.onnx", "-o", "out.onnx"], 0, outputs=["out.onnx"], inputs=["m.onnx", "real.bin"],
                feeds={"x": feed()})


# -- versions ------------------------------------------------------------------------------------------
def case_ir_version_too_new(d: Path) -> Case:
    save(mlp(ir_version=99), d / "m.onnx")
    return Case(["m.onnx"], 5, r"IR version 99", inputs=["m.onnx"])


def case_ir_version_too_old(d: Path) -> Case:
    save(mlp(ir_version=2), d / "m.onnx")
    return Case(["m.onnx"], 5, r"IR version 2", inputs=["m.onnx"])


def case_opset_too_new(d: Path) -> Case:
    save(mlp(opset=99), d / "m.onnx")
    return Case(["m.onnx"], 5, r"opset 99 is outside the supported range", inputs=["m.onnx"])


def case_opset_too_old(d: Path) -> Case:
    save(mlp(opset=5, ir_version=3), d / "m.onnx")
    return Case(["m.onnx"], 5, r"opset 5 is outside the supported range", inputs=["m.onnx"])


def case_no_opset_import(d: Path) -> Case:
    proto = mlp()
    del proto.opset_import[:]
    save(proto, d / "m.onnx")
    return Case(["m.onnx"], 5, r"imports no ai\.onnx opset", inputs=["m.onnx"])


def case_custom_domain_without_opset_import(d: Path) -> Case:
    """(exit 0 before, and the output failed the checker like the input: 'No opset import for domain')"""
    proto = mlp()
    proto.graph.node.append(helper.make_node("Twice", ["y"], ["z"], name="twice", domain="com.example"))
    proto.graph.output[0].name = "z"
    save(proto, d / "m.onnx")
    return Case(["m.onnx"], 5, r"ops of domain 'com\.example' but imports no opset for it", inputs=["m.onnx"])


# -- graph structure -----------------------------------------------------------------------------------
def case_duplicate_node_names(d: Path) -> Case:
    proto = mlp()
    for node in proto.graph.node:
        node.name = "same"
    save(proto, d / "m.onnx")
    return Case(["m.onnx"], 3, r"two nodes are named 'same'.*rename", inputs=["m.onnx"])


def case_unnamed_nodes(d: Path) -> Case:
    proto = mlp()
    for node in proto.graph.node:
        node.name = ""
    save(proto, d / "m.onnx")
    return Case(["m.onnx", "-o", "out.onnx"], 0, outputs=["out.onnx"], inputs=["m.onnx"], feeds={"x": feed()})


def case_duplicate_value_names(d: Path) -> Case:
    """Two nodes write the same tensor name: invalid SSA, an error naming the tensor."""
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="a"),
             helper.make_node("Relu", ["x"], ["h"], name="b"),
             helper.make_node("MatMul", ["h", "w2"], ["y"], name="c")]
    save(model(nodes, [vi("x")], [vi("y")], [weight("w1"), weight("w2")]), d / "m.onnx")
    return Case(["m.onnx"], 3, r"'h'", inputs=["m.onnx"])


def case_duplicate_graph_input(d: Path) -> Case:
    """An input listed twice (onnx-ir reads it): exit 7, 'a bug in amp-rewrite', before."""
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["y"], name="mm")]
    save(model(nodes, [vi("x"), vi("x")], [vi("y")], [weight("w1")]), d / "m.onnx")
    return Case(["m.onnx"], 3, r"input 'x' is listed twice", inputs=["m.onnx"])


def case_duplicate_loop_body_input(d: Path) -> Case:
    """The same in a Loop body: exit 0 before, with an output as invalid as the input."""
    body = helper.make_graph([helper.make_node("MatMul", ["v", "w1"], ["v2"], name="body_mm"),
                              helper.make_node("Identity", ["cond"], ["cond_out"], name="body_cond")], "body",
                             [vi("i", TensorProto.INT64, []), vi("cond", TensorProto.BOOL, []), vi("v"), vi("v")],
                             [vi("cond_out", TensorProto.BOOL, []), vi("v2")])
    nodes = [helper.make_node("Loop", ["n", "", "x"], ["y"], name="loop", body=body)]
    trips = numpy_helper.from_array(np.array(3, np.int64), "n")
    save(model(nodes, [vi("x")], [vi("y")], [weight("w1"), trips]), d / "m.onnx")
    return Case(["m.onnx"], 3, r"graph 'body': input 'v' is listed twice", inputs=["m.onnx"])


def case_dangling_input(d: Path) -> Case:
    nodes = [helper.make_node("MatMul", ["x", "w_missing"], ["y"], name="mm")]
    save(model(nodes, [vi("x")], [vi("y")]), d / "m.onnx")
    return Case(["m.onnx"], 3, r"'w_missing'.*dangling", inputs=["m.onnx"])


def case_dangling_output(d: Path) -> Case:
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm")]
    save(model(nodes, [vi("x")], [vi("y")], [weight("w1")]), d / "m.onnx")
    return Case(["m.onnx"], 3, r"output 'y' is not produced", inputs=["m.onnx"])


def case_cycle(d: Path) -> Case:
    nodes = [helper.make_node("Add", ["x", "b"], ["a"], name="add"),
             helper.make_node("MatMul", ["a", "w1"], ["b"], name="mm"),
             helper.make_node("Relu", ["b"], ["y"], name="relu")]
    save(model(nodes, [vi("x")], [vi("y")], [weight("w1")]), d / "m.onnx")
    return Case(["m.onnx"], 3, r"has a cycle \((add -> mm -> add|mm -> add -> mm)\)", inputs=["m.onnx"])


def case_self_loop(d: Path) -> Case:
    nodes = [helper.make_node("Add", ["x", "a"], ["a"], name="add"),
             helper.make_node("MatMul", ["a", "w1"], ["y"], name="mm")]
    save(model(nodes, [vi("x")], [vi("y")], [weight("w1")]), d / "m.onnx")
    return Case(["m.onnx"], 3, r"has a cycle \(add -> add\)", inputs=["m.onnx"])


def case_loop_without_body(d: Path) -> Case:
    """A Loop without its required body was accepted: what follows it could not be typed, and the
    rewrite wrote a copy saying there was nothing to rewrite (exit 0)."""
    nodes = [helper.make_node("Loop", ["n", "", "x"], ["h"], name="loop"),
             helper.make_node("MatMul", ["h", "w1"], ["y"], name="mm")]
    trips = numpy_helper.from_array(np.array(3, np.int64), "n")
    save(model(nodes, [vi("x")], [vi("y")], [weight("w1"), trips]), d / "m.onnx")
    return Case(["m.onnx"], 3, r"node 'loop' \(Loop\) lacks its required attribute 'body': the model is not valid ONNX",
                inputs=["m.onnx"])


def case_unsorted_acyclic(d: Path) -> Case:
    """Nodes out of order but no cycle: onnxruntime accepts it, so do we (the output is sorted)."""
    proto = mlp()
    nodes = list(proto.graph.node)
    del proto.graph.node[:]
    proto.graph.node.extend(reversed(nodes))
    save(proto, d / "m.onnx")
    return Case(["m.onnx", "-o", "out.onnx"], 0, outputs=["out.onnx"], inputs=["m.onnx"], feeds={"x": feed()})


def case_unsorted_body_reads_a_later_value(d: Path) -> Case:
    """An If listed before the node making the value its branches read: the loader sorts the graph
    (the body's read counts as the If's) and the output is sorted and runs."""
    branch = {name: helper.make_graph([helper.make_node(op, ["h", "h"], [f"{name}_out"], name=f"{name}_op")],
                                      name, [], [vi(f"{name}_out", shape=None)])
              for name, op in (("then", "Add"), ("else", "Sub"))}
    nodes = [helper.make_node("If", ["c"], ["z"], name="if", then_branch=branch["then"], else_branch=branch["else"]),
             helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"),
             helper.make_node("MatMul", ["z", "w2"], ["y"], name="mm2")]
    save(model(nodes, [vi("x"), vi("c", TensorProto.BOOL, ())], [vi("y")], [weight("w1"), weight("w2", seed=1)]),
         d / "m.onnx")
    return Case(["m.onnx", "-o", "out.onnx"], 0, outputs=["out.onnx"], inputs=["m.onnx"],
                feeds={"x": feed(), "c": np.array(True)})


def case_passthrough_graph(d: Path) -> Case:
    """No nodes, the output is the input: nothing to rewrite."""
    save(model([], [vi("x")], [vi("x")]), d / "m.onnx")
    return Case(["m.onnx", "-o", "out.onnx"], 0, NOTHING_TO_DO, outputs=["out.onnx"], inputs=["m.onnx"],
                feeds={"x": feed()})


def case_empty_graph(d: Path) -> Case:
    save(model([], [vi("x")], []), d / "m.onnx")
    return Case(["m.onnx"], 3, r"no graph|no nodes|nothing", inputs=["m.onnx"])


# -- content edge cases (success) -------------------------------------------------------------------
def case_no_float_tensors(d: Path) -> Case:
    nodes = [helper.make_node("Add", ["i", "j"], ["s"], name="add"),
             helper.make_node("Mul", ["s", "j"], ["o"], name="mul")]
    save(model(nodes, [vi("i", TensorProto.INT64), vi("j", TensorProto.INT64)], [vi("o", TensorProto.INT64)]),
         d / "m.onnx")
    return Case(["m.onnx", "-o", "out.onnx"], 0, NOTHING_TO_DO, outputs=["out.onnx"], inputs=["m.onnx"],
                feeds={"i": np.arange(8).reshape(2, 4), "j": np.ones((2, 4), np.int64)})


def case_already_fp16(d: Path) -> Case:
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"),
             helper.make_node("Relu", ["h"], ["y"], name="relu")]
    w = numpy_helper.from_array(np.ones((4, 4), np.float16), "w1")
    save(model(nodes, [vi("x", TensorProto.FLOAT16)], [vi("y", TensorProto.FLOAT16)], [w]), d / "m.onnx")
    return Case(["m.onnx", "-o", "out.onnx"], 0, NOTHING_TO_DO, outputs=["out.onnx"], inputs=["m.onnx"],
                feeds={"x": feed(dtype=np.float16)})


def case_mixed_fp16_fp32(d: Path) -> Case:
    """An FP16 half (left alone) cast into an FP32 half (rewritten)."""
    nodes = [helper.make_node("MatMul", ["x16", "w16"], ["h16"], name="mm16"),
             helper.make_node("Cast", ["h16"], ["h32"], name="up", to=TensorProto.FLOAT),
             helper.make_node("MatMul", ["h32", "w1"], ["m"], name="mm32"),
             helper.make_node("Add", ["m", "x32"], ["a"], name="add"),
             helper.make_node("MatMul", ["a", "w2"], ["y"], name="mm_out")]
    inits = [numpy_helper.from_array(np.eye(4, dtype=np.float16), "w16"), weight("w1"), weight("w2", seed=1)]
    save(model(nodes, [vi("x16", TensorProto.FLOAT16), vi("x32")], [vi("y")], inits), d / "m.onnx")
    return Case(["m.onnx", "-o", "out.onnx"], 0, outputs=["out.onnx"], inputs=["m.onnx"],
                feeds={"x16": feed(dtype=np.float16), "x32": feed(seed=1)})


def case_custom_domain_op(d: Path) -> Case:
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"),
             helper.make_node("MyOp", ["h"], ["c"], name="custom", domain="com.example"),
             helper.make_node("MatMul", ["c", "w2"], ["y"], name="mm2")]
    proto = model(nodes, [vi("x")], [vi("y")], [weight("w1"), weight("w2")], extra_opsets=[("com.example", 1)],
                  value_info=[vi("c")])
    save(proto, d / "m.onnx")
    # onnxruntime cannot run MyOp, so only the checker and the rewrite itself are exercised.
    return Case(["m.onnx", "-o", "out.onnx"], 0, outputs=["out.onnx"], inputs=["m.onnx"], runtime=False)


def case_unknown_op_in_the_default_domain(d: Path) -> Case:
    """An ai.onnx node with no such operator: the input fails the checker ("No Op registered for
    FooBarOp"), and so did the output the rewrite used to write with exit 0."""
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"),
             helper.make_node("FooBarOp", ["h"], ["y"], name="foo")]
    save(model(nodes, [vi("x")], [vi("y")], [weight("w1")]), d / "m.onnx")
    return Case(["m.onnx", "-o", "out.onnx"], 3, r"'foo' \(FooBarOp\): ai\.onnx has no operator 'FooBarOp'.*own domain",
                inputs=["m.onnx"])


def case_op_newer_than_the_opset(d: Path) -> Case:
    """Gelu is an ai.onnx operator only from opset 20: at opset 13 it is not one (nor one
    onnxruntime registers in the default domain, as it does LayerNormalization below 17)."""
    nodes = [helper.make_node("Gelu", ["x"], ["y"], name="gelu")]
    save(model(nodes, [vi("x")], [vi("y")], [], opset=13), d / "m.onnx")
    return Case(["m.onnx", "-o", "out.onnx"], 3, r"'gelu' \(Gelu\).*only from opset 20.*opset 13",
                inputs=["m.onnx"])


def case_op_newer_than_the_opset_names_its_first_opset(d: Path) -> Case:
    """GroupNormalization exists from opset 18 (and again from 21): the message named the newest
    version, 21, and an unnamed node read "a Attention node"."""
    nodes = [helper.make_node("GroupNormalization", ["x", "g", "g"], ["y"], num_groups=2)]
    save(model(nodes, [vi("x")], [vi("y")], [numpy_helper.from_array(np.ones(2, np.float32), "g")], opset=17),
         d / "m.onnx")
    return Case(["m.onnx", "-o", "out.onnx"], 3, r"a GroupNormalization node: .*only from opset 18, .*opset 17",
                inputs=["m.onnx"])


def case_duplicate_initializer_names(d: Path) -> Case:
    """Two initializers named W (onnxruntime reads the first): the rewrite kept the last, so the
    output computed with other weights than the input, silently."""
    proto = mlp()
    extra = onnx.TensorProto()
    extra.CopyFrom(proto.graph.initializer[0])
    proto.graph.initializer.append(extra)
    save(proto, d / "m.onnx")
    return Case(["m.onnx", "-o", "out.onnx"], 3, rf"two initializers are named '{extra.name}'.*rename",
                inputs=["m.onnx"])


def case_stale_value_info_type(d: Path) -> Case:
    """A value_info entry typing an FP32 intermediate as FP16 (peer converters leave such entries):
    bad input, not "IR verification failed ... (a bug: please report)" with exit 7."""
    proto = mlp()
    proto.graph.value_info.append(helper.make_tensor_value_info("h", TensorProto.FLOAT16, [2, 4]))
    save(proto, d / "m.onnx")
    return Case(["m.onnx", "-o", "out.onnx"], 3, r"node 'mm1' \(MatMul\) reads or writes 'x' as fp32 and 'h' as fp16",
                inputs=["m.onnx"])


def case_custom_domain_unknown_type(d: Path) -> Case:
    """No schema and no value_info: the custom op's output dtype is unknown; its consumers keep FP32."""
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"),
             helper.make_node("MyOp", ["h"], ["c"], name="custom", domain="com.example"),
             helper.make_node("MatMul", ["c", "w2"], ["y"], name="mm2")]
    save(model(nodes, [vi("x")], [vi("y")], [weight("w1"), weight("w2")], extra_opsets=[("com.example", 1)]),
         d / "m.onnx")
    return Case(["m.onnx", "-o", "out.onnx"], 0, outputs=["out.onnx"], inputs=["m.onnx"], runtime=False)


def _gelu_function() -> onnx.FunctionProto:
    body = [helper.make_node("Constant", [], ["half"], value=numpy_helper.from_array(np.array(0.5, np.float32))),
            helper.make_node("Mul", ["X", "half"], ["Y"])]
    return helper.make_function("local", "HalfIt", ["X"], ["Y"], body, [helper.make_opsetid("", OPSET)])


def case_model_local_function(d: Path) -> Case:
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"),
             helper.make_node("HalfIt", ["h"], ["f"], name="fn", domain="local"),
             helper.make_node("MatMul", ["f", "w2"], ["y"], name="mm2")]
    proto = model(nodes, [vi("x")], [vi("y")], [weight("w1"), weight("w2")], extra_opsets=[("local", 1)],
                  functions=[_gelu_function()])
    save(proto, d / "m.onnx")
    return Case(["m.onnx", "-o", "out.onnx"], 0, outputs=["out.onnx"], inputs=["m.onnx"], feeds={"x": feed()})


@pytest.mark.parametrize("pin", [["--fp16-nodes", "fn"], ["--fp16-ops", "local:HalfIt"]])
def test_a_low_pin_on_a_local_function_call_keeps_it_fp32(tmp_path: Path, pin: list[str]) -> None:
    """--fp16-nodes fn on a call of a model-local function whose body holds an FP32 Constant: the
    call read FP16 while its body stayed FP32, and the model written with exit 0 failed the checker
    and onnxruntime ('B has inconsistent type'). The call keeps FP32 and the report says why."""
    case_model_local_function(tmp_path)
    proc = run_cli(["m.onnx", "-o", "out.onnx", "--report", "r.json", "--no-inline-functions", *pin], tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = onnx.load(tmp_path / "out.onnx")
    onnx.checker.check_model(out, full_check=True)
    import json

    nodes = {n["node"]: n for n in json.loads((tmp_path / "r.json").read_text())["nodes"]}
    assert nodes["fn"]["precision"] == "fp32" and "model-local function local:HalfIt" in nodes["fn"]["reason"]
    assert nodes["mm1"]["precision"] == "fp16" and nodes["mm2"]["precision"] == "fp16"
    x = feed()
    got = run_onnx(tmp_path / "out.onnx", {"x": x})
    want = run_onnx(tmp_path / "m.onnx", {"x": x})
    np.testing.assert_allclose(got["y"], want["y"], rtol=1e-2, atol=1e-2)


def case_sparse_initializer(d: Path) -> Case:
    dense = np.zeros((4, 4), np.float32)
    dense[1, 2], dense[3, 0] = 2.0, -1.5
    values = numpy_helper.from_array(np.array([2.0, -1.5], np.float32), "w1")
    indices = numpy_helper.from_array(np.array([6, 12], np.int64), "w1_idx")
    sparse = helper.make_sparse_tensor(values, indices, [4, 4])
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"),
             helper.make_node("MatMul", ["h", "w2"], ["y"], name="mm2")]
    save(model(nodes, [vi("x")], [vi("y")], [weight("w2")], sparse=[sparse]), d / "m.onnx")
    return Case(["m.onnx", "-o", "out.onnx"], 0, outputs=["out.onnx"], inputs=["m.onnx"], feeds={"x": feed()})


def case_sparse_constant(d: Path) -> Case:
    """A Constant's sparse_value (valid: the checker and onnxruntime take it), in the graph and in a
    branch, was exit 3 "Error calling _deserialize_graph"; it is densified like an initializer."""
    def sparse(name):
        values = numpy_helper.from_array(np.array([2.0, -1.5], np.float32), name)
        return helper.make_sparse_tensor(values, numpy_helper.from_array(np.array([1, 3], np.int64)), [4])
    branch = lambda name, out: helper.make_graph(  # noqa: E731
        [helper.make_node("Constant", [], [f"{name}_c"], name=f"{name}_const", sparse_value=sparse(f"{name}_v")),
         helper.make_node("Add", ["h", f"{name}_c"], [out], name=f"{name}_add")], name, [], [vi(out)])
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"),
             helper.make_node("Constant", [], ["c"], name="const", sparse_value=sparse("c_v")),
             helper.make_node("Add", ["h", "c"], ["a"], name="add"),
             helper.make_node("ReduceSum", ["x"], ["s"], name="sum", keepdims=0),
             helper.make_node("Greater", ["s", "zero"], ["cond"], name="gt"),
             helper.make_node("If", ["cond"], ["b"], name="if", then_branch=branch("then", "t"),
                              else_branch=branch("else", "e")),
             helper.make_node("Add", ["a", "b"], ["ab"], name="add2"),
             helper.make_node("MatMul", ["ab", "w2"], ["y"], name="mm2")]
    zero = numpy_helper.from_array(np.array(0.0, np.float32), "zero")
    save(model(nodes, [vi("x")], [vi("y")], [weight("w1"), weight("w2"), zero]), d / "m.onnx")
    return Case(["m.onnx", "-o", "out.onnx"], 0, outputs=["out.onnx"], inputs=["m.onnx"], feeds={"x": feed()})


def case_string_tensors(d: Path) -> Case:
    labels = helper.make_tensor("labels", TensorProto.STRING, [2], [b"cat", b"dog"])
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["y"], name="mm"),
             helper.make_node("Identity", ["labels"], ["names"], name="id"),
             helper.make_node("Identity", ["s"], ["s_out"], name="id_in")]
    proto = model(nodes, [vi("x"), vi("s", TensorProto.STRING, [3])],
                  [vi("y"), vi("names", TensorProto.STRING, [2]), vi("s_out", TensorProto.STRING, [3])],
                  [weight("w1"), labels])
    save(proto, d / "m.onnx")
    # string feeds cannot cross ortrun's npz transport (no pickles): load only.
    return Case(["m.onnx", "-o", "out.onnx"], 0, outputs=["out.onnx"], inputs=["m.onnx"])


def case_zero_size_tensors(d: Path) -> Case:
    nodes = [helper.make_node("MatMul", ["x", "w0"], ["h"], name="mm0"),
             helper.make_node("Relu", ["h"], ["r"], name="relu"),
             helper.make_node("MatMul", ["r", "w1"], ["y"], name="mm1")]
    inits = [numpy_helper.from_array(np.zeros((4, 0), np.float32), "w0"),
             numpy_helper.from_array(np.zeros((0, 3), np.float32), "w1")]
    save(model(nodes, [vi("x")], [vi("y", shape=(2, 3))], inits), d / "m.onnx")
    return Case(["m.onnx", "-o", "out.onnx"], 0, outputs=["out.onnx"], inputs=["m.onnx"], feeds={"x": feed()})


def case_zero_size_input(d: Path) -> Case:
    proto = mlp()
    proto.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "batch"
    proto.graph.output[0].type.tensor_type.shape.dim[0].dim_param = "batch"
    save(proto, d / "m.onnx")
    return Case(["m.onnx", "-o", "out.onnx"], 0, outputs=["out.onnx"], inputs=["m.onnx"],
                feeds={"x": np.zeros((0, 4), np.float32)})


def case_symbolic_shapes(d: Path) -> Case:
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"),
             helper.make_node("Softmax", ["h"], ["s"], name="sm", axis=-1),
             helper.make_node("MatMul", ["s", "w2"], ["y"], name="mm2")]
    proto = model(nodes, [vi("x", shape=("batch", "seq", 4))], [vi("y", shape=("batch", "seq", 4))],
                  [weight("w1"), weight("w2")])
    save(proto, d / "m.onnx")
    return Case(["m.onnx", "-o", "out.onnx"], 0, outputs=["out.onnx"], inputs=["m.onnx"],
                feeds={"x": feed((3, 5, 4))})


def case_no_shapes(d: Path) -> Case:
    proto = mlp()
    for v in list(proto.graph.input) + list(proto.graph.output):
        for dim in v.type.tensor_type.shape.dim:
            dim.Clear()  # rank known, every dimension unknown
    save(proto, d / "m.onnx")
    return Case(["m.onnx", "-o", "out.onnx"], 0, outputs=["out.onnx"], inputs=["m.onnx"], feeds={"x": feed()})


def case_initializers_as_inputs(d: Path) -> Case:
    proto = mlp(ir_version=3, opset=9)
    proto.graph.input.extend([vi("w1", shape=(4, 4)), vi("w2", shape=(4, 4))])
    save(proto, d / "m.onnx")
    return Case(["m.onnx", "-o", "out.onnx"], 0, outputs=["out.onnx"], inputs=["m.onnx"], feeds={"x": feed()})


def overridable_initializer(d: Path) -> Case:
    """IR >= 4: an initializer also listed as a graph input is a default the caller may override."""
    proto = mlp()
    proto.graph.input.extend([vi("w1", shape=(4, 4))])
    save(proto, d / "m.onnx")
    return Case(["m.onnx", "-o", "out.onnx"], 0, outputs=["out.onnx"], inputs=["m.onnx"],
                feeds={"x": feed(), "w1": feed((4, 4), seed=3)})


def case_external_data_input(d: Path) -> Case:
    save_external(mlp(), d / "m.onnx")
    # (its weights are tiny: each output tensor stays inline, and no empty out.onnx.data is written)
    return Case(["m.onnx", "-o", "out.onnx"], 0, outputs=["out.onnx"],
                inputs=["m.onnx", "weights.bin"], feeds={"x": feed()})


def case_default_output_name(d: Path) -> Case:
    save(mlp(), d / "m.onnx")
    return Case(["m.onnx"], 0, outputs=["m.fp16.onnx"], inputs=["m.onnx"], feeds={"x": feed()})


def case_bf16_target(d: Path) -> Case:
    save(mlp(), d / "m.onnx")
    return Case(["m.onnx", "--target", "bf16"], 0, outputs=["m.bf16.onnx"], inputs=["m.onnx"], runtime=False)


# -- rule files ----------------------------------------------------------------------------------------
def case_rules_misspelt_op(d: Path) -> Case:
    save(mlp(), d / "m.onnx")
    (d / "r.toml").write_text('[deny]\nReluu = "typo"\n')
    return Case(["m.onnx", "--rules", "r.toml"], 4, r"r\.toml.*Reluu.*did you mean 'Relu'",
                inputs=["m.onnx", "r.toml"])


def case_rules_misspelt_table(d: Path) -> Case:
    save(mlp(), d / "m.onnx")
    (d / "r.toml").write_text('[deyn]\nRelu = "typo"\n')
    return Case(["m.onnx", "--rules", "r.toml"], 4, r"r\.toml.*deyn.*did you mean 'deny'", inputs=["m.onnx", "r.toml"])


def case_rules_conflicting(d: Path) -> Case:
    save(mlp(), d / "m.onnx")
    (d / "r.toml").write_text('[deny]\nRelu = "fp32 please"\n[allow]\nRelu = "fp16 please"\n')
    return Case(["m.onnx", "--rules", "r.toml"], 4, r"r\.toml.*Relu", inputs=["m.onnx", "r.toml"])


def case_rules_bad_toml(d: Path) -> Case:
    save(mlp(), d / "m.onnx")
    (d / "r.toml").write_text('[deny\nRelu = \n')
    return Case(["m.onnx", "--rules", "r.toml"], 4, r"r\.toml.*TOML", inputs=["m.onnx", "r.toml"])


def case_rules_missing_reason(d: Path) -> Case:
    save(mlp(), d / "m.onnx")
    (d / "r.toml").write_text('[deny]\nRelu = { since = 7 }\n')
    return Case(["m.onnx", "--rules", "r.toml"], 4, r"r\.toml.*reason", inputs=["m.onnx", "r.toml"])


def case_rules_file_missing(d: Path) -> Case:
    save(mlp(), d / "m.onnx")
    return Case(["m.onnx", "--rules", "nope.toml"], 4, r"nope\.toml", inputs=["m.onnx"])


def case_misspelt_fp32_op_flag(d: Path) -> Case:
    save(mlp(), d / "m.onnx")
    return Case(["m.onnx", "--fp32-ops", "Softmx"], 2, r"Softmx.*did you mean 'Softmax'", inputs=["m.onnx"])


# -- usage ---------------------------------------------------------------------------------------------
def case_bad_target(d: Path) -> Case:
    save(mlp(), d / "m.onnx")
    return Case(["m.onnx", "--target", "fp8"], 2, r"--target 'fp8'", inputs=["m.onnx"])


def case_unknown_option(d: Path) -> Case:
    save(mlp(), d / "m.onnx")
    return Case(["m.onnx", "--frobnicate"], 2, r"No such option: --frobnicate", inputs=["m.onnx"])


def case_missing_argument(d: Path) -> Case:
    return Case([], 2, r"Missing argument")


def case_bad_option_value(d: Path) -> Case:
    save(mlp(), d / "m.onnx")
    return Case(["m.onnx", "--tolerance", "abc"], 2, r"--tolerance", inputs=["m.onnx"])


# -- output --------------------------------------------------------------------------------------------
def case_output_is_input(d: Path) -> Case:
    save(mlp(), d / "m.onnx")
    return Case(["m.onnx", "-o", "m.onnx"], 6, r"would replace the input", inputs=["m.onnx"])


def case_output_is_input_overwrite(d: Path) -> Case:
    save(mlp(), d / "m.onnx")
    return Case(["m.onnx", "-o", "./m.onnx", "--overwrite"], 6, r"would replace the input", inputs=["m.onnx"])


def case_output_is_input_via_symlink(d: Path) -> Case:
    save(mlp(), d / "m.onnx")
    (d / "link.onnx").symlink_to("m.onnx")
    return Case(["m.onnx", "-o", "link.onnx", "--overwrite"], 6, r"would replace the input", inputs=["m.onnx"])


def case_output_is_input_no_op(d: Path) -> Case:
    nodes = [helper.make_node("Add", ["i", "i"], ["o"], name="add")]
    save(model(nodes, [vi("i", TensorProto.INT64)], [vi("o", TensorProto.INT64)]), d / "m.onnx")
    return Case(["m.onnx", "-o", "m.onnx", "--overwrite"], 6, r"would replace the input", inputs=["m.onnx"])


def case_output_overwrites_external_data(d: Path) -> Case:
    save_external(mlp(), d / "m.onnx", location="out.onnx.data")
    return Case(["m.onnx", "-o", "out.onnx"], 6, r"input's external data", inputs=["m.onnx", "out.onnx.data"])


def case_output_is_the_input_external_data(d: Path) -> Case:
    """-o naming the input's own data file, with --overwrite: it used to be replaced by the output
    (exit 0, the input's weights gone)."""
    save_external(mlp(), d / "m.onnx", location="weights.bin")
    return Case(["m.onnx", "-o", "weights.bin", "--overwrite"], 6, r"reads its external data from",
                inputs=["m.onnx", "weights.bin"])


def case_report_is_the_input(d: Path) -> Case:
    """--report naming the input model: the report replaced it (exit 0)."""
    save(mlp(), d / "m.md")
    return Case(["m.md", "-o", "out.onnx", "--report", "m.md"], 6, r"is the input model", inputs=["m.md"])


def case_report_is_the_output(d: Path) -> Case:
    """--report naming the -o path: the report replaced the model just written (exit 0)."""
    save(mlp(), d / "m.onnx")
    return Case(["m.onnx", "-o", "r.json", "--report", "r.json"], 6, r"is the output model", inputs=["m.onnx"])


def case_report_exists(d: Path) -> Case:
    save(mlp(), d / "m.onnx")
    (d / "r.json").write_text("keep me")
    return Case(["m.onnx", "-o", "out.onnx", "--report", "r.json"], 6, r"r\.json: already exists; pass --overwrite",
                inputs=["m.onnx", "r.json"])


def case_report_is_a_directory(d: Path) -> Case:
    """Found before any work; it used to fail after writing the model, leaving it and a temp file."""
    save(mlp(), d / "m.onnx")
    (d / "r.json").mkdir()
    return Case(["m.onnx", "-o", "out.onnx", "--report", "r.json"], 6, r"r\.json: is a directory", inputs=["m.onnx"])


_TOO_LONG = "q" * 300  # (a file name no file system here takes: Path.exists() raised on it)


def case_report_name_too_long(d: Path) -> Case:
    """An internal error (exit 70, 'OSError: [Errno 36] File name too long') for --report, --inputs
    and --rules alike; -o and the model path said it already."""
    save(mlp(), d / "m.onnx")
    return Case(["m.onnx", "-o", "o.onnx", "--report", _TOO_LONG + ".json"], 6, r"--report q+\.json: cannot be opened",
                inputs=["m.onnx"])


def case_inputs_name_too_long(d: Path) -> Case:
    save(mlp(), d / "m.onnx")
    return Case(["m.onnx", "-o", "o.onnx", "--check", "--inputs", _TOO_LONG + ".npz"], 2,
                r"--inputs q+\.npz: cannot be opened", inputs=["m.onnx"])


def case_rules_name_too_long(d: Path) -> Case:
    save(mlp(), d / "m.onnx")
    return Case(["m.onnx", "-o", "o.onnx", "--rules", _TOO_LONG + ".toml"], 4, r"q+\.toml.*cannot be opened",
                inputs=["m.onnx"])


def case_failed_check_keeps_the_previous_output(d: Path) -> Case:
    """--overwrite, then --check fails: the rewritten model goes and the file it replaced comes back
    (it used to be lost: the command left nothing at all)."""
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"),
             helper.make_node("Softmax", ["h"], ["s"], name="softmax"),
             helper.make_node("MatMul", ["s", "w2"], ["y"], name="mm2")]
    save(model(nodes, [vi("x")], [vi("y")], [weight("w1"), weight("w2", seed=1)]), d / "m.onnx")  # (FP16 error > 0)
    (d / "out.onnx").write_bytes(b"the previous output")
    return Case(["m.onnx", "-o", "out.onnx", "--overwrite", "--check", "--tolerance", "1e-12"], 8,
                r"check failed.*not kept", inputs=["m.onnx", "out.onnx"])


def case_bad_inputs_keep_the_previous_output(d: Path) -> Case:
    save(mlp(), d / "m.onnx")
    (d / "out.onnx").write_bytes(b"the previous output")
    np.savez(d / "bad.npz", z=feed())
    return Case(["m.onnx", "-o", "out.onnx", "--overwrite", "--check", "--inputs", "bad.npz"], 2,
                r"'z' is not an input of the model", inputs=["m.onnx", "out.onnx", "bad.npz"])


def case_inputs_is_an_npy_file(d: Path) -> Case:
    """np.load gives an .npy file as one array, not a context manager: it was an internal error."""
    save(mlp(), d / "m.onnx")
    np.save(d / "x.npy", feed())
    return Case(["m.onnx", "-o", "out.onnx", "--check", "--inputs", "x.npy"], 2, r"\.npy file holds one unnamed array",
                inputs=["m.onnx", "x.npy"])


def case_inputs_is_not_an_archive(d: Path) -> Case:
    """A text file given as .npz got numpy's advice to load it with allow_pickle."""
    save(mlp(), d / "m.onnx")
    (d / "i.npz").write_text("x = 1, 2, 3\n")
    return Case(["m.onnx", "-o", "out.onnx", "--check", "--inputs", "i.npz"], 2,
                r"not an \.npz file \(an \.npz is a zip archive", inputs=["m.onnx", "i.npz"])


def case_input_is_the_current_directory(d: Path) -> Case:
    """'.' has no name to make the default output's from: it was an internal error."""
    save(mlp(), d / "m.onnx")
    return Case(["."], 3, r"\.: is a directory", inputs=["m.onnx"])


def case_empty_model_path(d: Path) -> Case:
    """pathlib reads '' as '.', so an empty path (an unset shell variable) was reported as the
    current folder: ".: is a directory"."""
    save(mlp(), d / "m.onnx")
    return Case([""], 2, r"Invalid value for 'model': the path is empty", inputs=["m.onnx"])


def case_empty_rules_path(d: Path) -> Case:
    save(mlp(), d / "m.onnx")
    return Case(["m.onnx", "-o", "out.onnx", "--rules", ""], 2, r"'--rules': the path is empty", inputs=["m.onnx"])


def case_empty_output_path(d: Path) -> Case:
    save(mlp(), d / "m.onnx")
    return Case(["m.onnx", "-o", ""], 2, r"'--output': the path is empty", inputs=["m.onnx"])


def case_empty_inputs_path(d: Path) -> Case:
    save(mlp(), d / "m.onnx")
    return Case(["m.onnx", "-o", "out.onnx", "--check", "--inputs", ""], 2, r"'--inputs': the path is empty",
                inputs=["m.onnx"])


def case_tolerance_nan(d: Path) -> Case:
    save(mlp(), d / "m.onnx")
    return Case(["m.onnx", "-o", "out.onnx", "--check", "--tolerance", "nan"], 2, r"--tolerance nan: must be a positive",
                inputs=["m.onnx"])


def case_tolerance_zero(d: Path) -> Case:
    save(mlp(), d / "m.onnx")
    return Case(["m.onnx", "-o", "out.onnx", "--check", "--tolerance", "0"], 2, r"--tolerance 0.0: must be a positive",
                inputs=["m.onnx"])


def case_tolerance_without_check(d: Path) -> Case:
    """--inputs / --tolerance without --check or --auto-fp32 did nothing, silently."""
    save(mlp(), d / "m.onnx")
    return Case(["m.onnx", "-o", "out.onnx", "--tolerance", "0.1"], 2, r"apply to --check and --auto-fp32",
                inputs=["m.onnx"])


def case_explain_with_report(d: Path) -> Case:
    save(mlp(), d / "m.onnx")
    return Case(["m.onnx", "--explain", "mm1", "--report", "r.json"], 2, r"--explain .* writes nothing; drop --report",
                inputs=["m.onnx"])


def case_auto_fp32_with_training(d: Path) -> Case:
    save(mlp(), d / "m.onnx")
    return Case(["m.onnx", "-o", "out.onnx", "--training", "--loss", "y", "--auto-fp32"], 2,
                r"--auto-fp32 does not apply to --training", inputs=["m.onnx"])


def case_output_exists(d: Path) -> Case:
    save(mlp(), d / "m.onnx")
    (d / "out.onnx").write_bytes(b"keep me")
    return Case(["m.onnx", "-o", "out.onnx"], 6, r"already exists; pass --overwrite", inputs=["m.onnx", "out.onnx"])


def case_output_overwrite(d: Path) -> Case:
    save(mlp(), d / "m.onnx")
    (d / "out.onnx").write_bytes(b"old")
    case = Case(["m.onnx", "-o", "out.onnx", "--overwrite"], 0, inputs=["m.onnx"], feeds={"x": feed()})
    case.outputs = []  # replaces an existing file: checked below
    return case


def case_output_is_a_fifo(d: Path) -> Case:
    """With --overwrite a FIFO (or a device: as root, -o /dev/null) was replaced by a regular file
    holding the model."""
    save(mlp(), d / "m.onnx")
    os.mkfifo(d / "out.onnx")
    return Case(["m.onnx", "-o", "out.onnx", "--overwrite"], 6, r"out\.onnx: is not a regular file", inputs=["m.onnx"])


def case_report_is_a_fifo(d: Path) -> Case:
    save(mlp(), d / "m.onnx")
    os.mkfifo(d / "r.json")
    return Case(["m.onnx", "-o", "out.onnx", "--report", "r.json", "--overwrite"], 6,
                r"--report r\.json: is not a regular file", inputs=["m.onnx"])


def case_output_is_a_dangling_link(d: Path) -> Case:
    """A symlink to nothing does not 'exist': it was replaced without --overwrite."""
    save(mlp(), d / "m.onnx")
    os.symlink(d / "gone.onnx", d / "out.onnx")
    return Case(["m.onnx", "-o", "out.onnx"], 6, r"already exists; pass --overwrite", inputs=["m.onnx"])


def case_output_folder_missing(d: Path) -> Case:
    save(mlp(), d / "m.onnx")
    return Case(["m.onnx", "-o", "no/such/dir/out.onnx"], 6, r"output folder does not exist", inputs=["m.onnx"])


def case_output_with_a_trailing_slash(d: Path) -> Case:
    """(pathlib dropped the slash: a file named 'outdir' was written, exit 0)"""
    save(mlp(), d / "m.onnx")
    return Case(["m.onnx", "-o", "outdir/"], 2, r"'outdir/' ends with a slash, so it names a folder", inputs=["m.onnx"])


def case_report_with_a_trailing_slash(d: Path) -> Case:
    save(mlp(), d / "m.onnx")
    return Case(["m.onnx", "--report", "r.json/"], 2, r"'r\.json/' ends with a slash", inputs=["m.onnx"])


def case_output_is_directory(d: Path) -> Case:
    save(mlp(), d / "m.onnx")
    (d / "out.onnx").mkdir()
    return Case(["m.onnx", "-o", "out.onnx", "--overwrite"], 6, r"is a directory", inputs=["m.onnx"])


def case_output_is_directory_without_overwrite(d: Path) -> Case:
    """It said "already exists; pass --overwrite", which then failed with "is a directory"."""
    save(mlp(), d / "m.onnx")
    (d / "out").mkdir()
    return Case(["m.onnx", "-o", "out"], 6, r"out: is a directory; -o takes the output file's path", inputs=["m.onnx"])


def case_output_is_directory_names_the_targets_file(d: Path) -> Case:
    """The suggested file name was <stem>.fp16.onnx for --target bf16 too."""
    save(mlp(), d / "m.onnx")
    (d / "out").mkdir()
    return Case(["m.onnx", "-o", "out", "--target", "bf16"], 6, r"is a directory; .*\(e\.g\. out/m\.bf16\.onnx\)",
                inputs=["m.onnx"])


def case_input_is_a_fifo(d: Path) -> Case:
    """A pipe reports size 0: it was "the file is empty"."""
    os.mkfifo(d / "m.onnx")
    return Case(["m.onnx"], 3, r"m\.onnx: is not a regular file")


def case_rules_with_a_byte_order_mark(d: Path) -> Case:
    """A UTF-8 byte-order mark (some editors write one) was "line 1: TOML syntax error"."""
    save(mlp(), d / "m.onnx")
    (d / "r.toml").write_bytes('\ufeff[deny]\nRelu = "kept FP32 here"\n'.encode("utf-8"))
    return Case(["m.onnx", "--rules", "r.toml", "-o", "out.onnx"], 0, outputs=["out.onnx"], inputs=["m.onnx", "r.toml"],
                feeds={"x": feed()})


def case_output_parent_is_file(d: Path) -> Case:
    save(mlp(), d / "m.onnx")
    (d / "afile").write_bytes(b"x")
    return Case(["m.onnx", "-o", "afile/out.onnx"], 6, r"afile", inputs=["m.onnx", "afile"])


def case_report_folder_missing(d: Path) -> Case:
    """Checked before any work, so no model is written either."""
    save(mlp(), d / "m.onnx")
    return Case(["m.onnx", "-o", "out.onnx", "--report", "nodir/r.json"], 6, r"--report .*folder nodir does not exist",
                inputs=["m.onnx"])


def _read_only_dir() -> Path | None:
    """A folder this process cannot write to, even as root (a read-only mount)."""
    for candidate in ("/proc/self", "/sys/kernel"):
        path = Path(candidate)
        try:
            fd = os.open(path / ".amp-probe", os.O_CREAT | os.O_WRONLY, 0o600)
        except OSError:
            return path
        os.close(fd)
        os.unlink(path / ".amp-probe")
    return None


def case_unwritable_output_dir(d: Path) -> Case:
    save(mlp(), d / "m.onnx")
    if os.geteuid() != 0:
        locked = d / "locked"
        locked.mkdir()
        locked.chmod(0o500)
        return Case(["m.onnx", "-o", "locked/out.onnx"], 6, r"locked.*(not writable|cannot write)", inputs=["m.onnx"])
    target = _read_only_dir()
    if target is None:
        pytest.skip("no read-only folder available to a root process")
    return Case(["m.onnx", "-o", str(target / "out.onnx")], 6, r"(not writable|cannot write)", inputs=["m.onnx"])


def case_unwritable_report_dir(d: Path) -> Case:
    """Found only when the report was written, after the model: checked before any work now."""
    save(mlp(), d / "m.onnx")
    target = _read_only_dir()
    if os.geteuid() != 0:
        target = d / "locked"
        target.mkdir()
        target.chmod(0o500)
    if target is None:
        pytest.skip("no read-only folder available to a root process")
    return Case(["m.onnx", "-o", "out.onnx", "--report", str(target / "r.json")], 6,
                r"--report .*r\.json: folder .* is not writable", inputs=["m.onnx"])


def _limit_file_size(limit: int) -> Callable[[], None]:
    """Writes past ``limit`` bytes fail with EFBIG (Python ignores SIGXFSZ): a disk filling up midway."""
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


def case_write_fails_midway(d: Path) -> Case:
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"),
             helper.make_node("MatMul", ["h", "w2"], ["y"], name="mm2")]
    save(model(nodes, [vi("x", shape=(2, 256))], [vi("y", shape=(2, 256))],
               [weight("w1", (256, 256)), weight("w2", (256, 256), 1)]), d / "m.onnx")
    size = (d / "m.onnx").stat().st_size
    return Case(["m.onnx", "-o", "out.onnx"], 6, r"out\.onnx: writing failed", inputs=["m.onnx"],
                preexec=_limit_file_size(size // 4))


def case_write_fails_midway_external(d: Path) -> Case:
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"),
             helper.make_node("MatMul", ["h", "w2"], ["y"], name="mm2")]
    save_external(model(nodes, [vi("x", shape=(2, 256))], [vi("y", shape=(2, 256))],
                        [weight("w1", (256, 256)), weight("w2", (256, 256), 1)]), d / "m.onnx")
    size = (d / "weights.bin").stat().st_size
    return Case(["m.onnx", "-o", "out.onnx"], 6, r"out\.onnx: writing failed", inputs=["m.onnx", "weights.bin"],
                preexec=_limit_file_size(size // 8))


def case_write_fails_midway_no_op(d: Path) -> Case:
    """Nothing to rewrite, so the input is copied: the copy fails midway."""
    nodes = [helper.make_node("Add", ["i", "c"], ["o"], name="add")]
    c = numpy_helper.from_array(np.arange(50_000, dtype=np.int64), "c")
    save(model(nodes, [vi("i", TensorProto.INT64, [50_000])], [vi("o", TensorProto.INT64, [50_000])], [c]),
         d / "m.onnx")
    size = (d / "m.onnx").stat().st_size
    return Case(["m.onnx", "-o", "out.onnx"], 6, r"out\.onnx: writing failed", inputs=["m.onnx"],
                preexec=_limit_file_size(size // 3))


CASES = {name[len("case_"):]: fn for name, fn in sorted(globals().items()) if name.startswith("case_")}


def test_overridable_initializer_keeps_its_fp32_input_type(tmp_path: Path) -> None:
    check_case(overridable_initializer(tmp_path), tmp_path)


@pytest.mark.parametrize("name", sorted(CASES))
def test_battery(name: str, tmp_path: Path) -> None:
    case = CASES[name](tmp_path)
    if name == "output_overwrite":
        before = snapshot(tmp_path)
        proc = run_cli(case.argv, tmp_path)
        assert proc.returncode == 0 and proc.stderr == "", proc.stderr
        after = snapshot(tmp_path)
        assert set(after) == set(before) and after["m.onnx"] == before["m.onnx"]
        assert after["out.onnx"] != before["out.onnx"]
        assert load_ok(tmp_path / "out.onnx")[0]
        return
    check_case(case, tmp_path)


def test_rewrite_onnx_names_a_missing_input_before_the_output(tmp_path: Path) -> None:
    """rewrite_onnx() raised OutputError "already exists" for a source that is not there."""
    import amp_rewrite
    from amp_rewrite.errors import ModelLoadError

    (tmp_path / "out.onnx").write_bytes(b"kept")
    for dst in ("out.onnx", "no/dir/out.onnx"):
        with pytest.raises(ModelLoadError, match=r"nope\.onnx: no such file"):
            amp_rewrite.rewrite_onnx(tmp_path / "nope.onnx", tmp_path / dst)
    assert (tmp_path / "out.onnx").read_bytes() == b"kept"


def test_a_report_that_fails_takes_the_earlier_reports_with_it(tmp_path: Path) -> None:
    """--report a.json --report b.html where b.html's write fails midway (the file-size limit
    between the two sizes): a.json was left holding a report of an output that had been removed,
    and the a.json it replaced was lost."""
    probe = tmp_path / "probe"
    probe.mkdir()
    save(mlp(), probe / "m.onnx")
    proc = run_cli(["m.onnx", "-o", "out.onnx", "--report", "a.json", "--report", "b.html"], probe)
    assert proc.returncode == 0, proc.stderr
    sizes = {name: (probe / name).stat().st_size for name in ("out.onnx", "a.json", "b.html")}
    limit = max(sizes["out.onnx"], sizes["a.json"]) + 1
    assert limit < sizes["b.html"], f"test bug: the html report is not the largest file: {sizes}"
    save(mlp(), tmp_path / "m.onnx")
    for name in ("out.onnx", "a.json"):
        (tmp_path / name).write_bytes(b"the previous " + name.encode())
    check_case(Case(["m.onnx", "-o", "out.onnx", "--overwrite", "--report", "a.json", "--report", "b.html"], 6,
                    r"b\.html: cannot write the report", inputs=["m.onnx", "out.onnx", "a.json"],
                    preexec=_limit_file_size(limit)), tmp_path)


def test_overwrite_replaces_an_output_whose_name_is_near_the_limit(tmp_path: Path) -> None:
    """The replaced file was set aside under '.<name>.amp-rewrite-previous-...', 45 bytes longer:
    a 240-byte name, written once, could not be replaced ('File name too long', exit 6)."""
    save(mlp(), tmp_path / "m.onnx")
    name = "y" * 235 + ".onnx"
    (tmp_path / name).write_bytes(b"the previous output")
    proc = run_cli(["m.onnx", "-o", name, "--overwrite", "-q"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["m.onnx", name])
    assert load_ok(tmp_path / name)[0]


def test_debug_shows_traceback(tmp_path: Path) -> None:
    """--debug trades the one-line message for the full traceback (same failure)."""
    (tmp_path / "m.onnx").write_bytes(b"")
    proc = run_cli(["m.onnx", "--debug"], tmp_path)
    assert proc.returncode != 0
    assert "Traceback" in proc.stderr and "ModelLoadError" in proc.stderr


def test_exit_codes_documented() -> None:
    """docs/exit-codes.md lists every error class with its code."""
    from amp_rewrite import errors

    text = (ROOT / "docs" / "exit-codes.md").read_text()
    classes = [c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, errors.AmpRewriteError)]
    for cls in classes:
        assert re.search(rf"\|\s*{cls.exit_code}\s*\|\s*`{cls.__name__}`", text), cls.__name__
    for code in (0, 70, 130):
        assert re.search(rf"\|\s*{code}\s*\|", text), code


# -- the CLI and API surface beyond exit codes -------------------------------------------------------------
def test_debug_keeps_the_documented_exit_code(tmp_path: Path) -> None:
    """--debug prints the traceback instead of the line; the exit code used to become 1 (Python's
    for an uncaught exception) for every failure."""
    (tmp_path / "m.onnx").write_bytes(b"")
    assert run_cli(["m.onnx"], tmp_path).returncode == 3
    proc = run_cli(["m.onnx", "--debug"], tmp_path)
    assert proc.returncode == 3 and "Traceback" in proc.stderr
    save(mlp(), tmp_path / "n.onnx")
    assert run_cli(["n.onnx", "--target", "fp8", "--debug"], tmp_path).returncode == 2


def test_quiet_prints_nothing_on_a_success(tmp_path: Path) -> None:
    """-q printed a note about bf16 training on stderr."""
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"),
             helper.make_node("ReduceSum", ["h"], ["loss"], name="sum", keepdims=0)]
    save(model(nodes, [vi("x")], [vi("loss", shape=())], [weight("w1")]), tmp_path / "t.onnx")
    proc = run_cli(["t.onnx", "-o", "o.onnx", "--training", "--loss", "loss", "--target", "bf16", "-q"], tmp_path)
    assert proc.returncode == 0 and proc.stdout == "" and proc.stderr == "", proc.stderr
    loud = run_cli(["t.onnx", "-o", "o2.onnx", "--training", "--loss", "loss", "--target", "bf16"], tmp_path)
    assert loud.returncode == 0 and loud.stderr == "" and "no loss scaling (bf16" in loud.stdout


def test_loss_scaling_flags_choose_the_training_interface(tmp_path: Path) -> None:
    """Issue 6: bf16 training adds no loss scaling (it did, with a note that said so); fp16 does.
    --loss-scaling / --no-loss-scaling override either default, and need --training."""
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"),
             helper.make_node("ReduceSum", ["h"], ["loss"], name="sum", keepdims=0)]
    save(model(nodes, [vi("x")], [vi("loss", shape=())], [weight("w1")]), tmp_path / "t.onnx")
    cases = {("fp16",): True, ("bf16",): False, ("fp16", "--no-loss-scaling"): False,
             ("bf16", "--loss-scaling"): True}
    for i, ((target, *flags), scaled) in enumerate(cases.items()):
        proc = run_cli(["t.onnx", "-o", f"o{i}.onnx", "--training", "--loss", "loss", "--target", target, *flags],
                       tmp_path)
        assert proc.returncode == 0, proc.stderr
        out = onnx.load(str(tmp_path / f"o{i}.onnx"))
        onnx.checker.check_model(out, full_check=True)
        assert ("loss_scale" in {i.name for i in out.graph.input}) is scaled, (target, flags)
        assert ("scaled_loss" in {o.name for o in out.graph.output}) is scaled, (target, flags)
        assert ("no loss scaling" in proc.stdout) is not scaled, proc.stdout
    proc = run_cli(["t.onnx", "-o", "x.onnx", "--no-loss-scaling"], tmp_path)
    assert proc.returncode == 2 and "need --training" in proc.stderr and not (tmp_path / "x.onnx").exists()


def test_fp32_ops_takes_a_comma_list(tmp_path: Path) -> None:
    """rules/README.md documents --fp32-ops A,B; it was read as one op named 'Relu,MatMul'."""
    save(mlp(), tmp_path / "m.onnx")
    proc = run_cli(["m.onnx", "-o", "out.onnx", "--fp32-ops", "Relu,MatMul"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = onnx.load(str(tmp_path / "out.onnx"))
    assert not any(n.op_type == "Cast" for n in out.graph.node)  # nothing left to run low
    assert "as pinned: the rewrite moves nothing to fp16" in proc.stdout


def test_an_unchanged_copy_has_ordinary_permissions(tmp_path: Path) -> None:
    """The nothing-to-rewrite copy kept mkstemp's 0600, unlike every other output."""
    nodes = [helper.make_node("Add", ["a", "b"], ["c"], name="add")]
    ints = [helper.make_tensor_value_info(n, onnx.TensorProto.INT64, [2]) for n in ("a", "b", "c")]
    save(model(nodes, ints[:2], ints[2:]), tmp_path / "i.onnx")
    save(mlp(), tmp_path / "m.onnx")
    old = os.umask(0o022)
    try:
        assert run_cli(["i.onnx", "-o", "copied.onnx"], tmp_path).returncode == 0
        assert run_cli(["m.onnx", "-o", "rewritten.onnx"], tmp_path).returncode == 0
    finally:
        os.umask(old)
    modes = {name: (tmp_path / name).stat().st_mode & 0o777 for name in ("copied.onnx", "rewritten.onnx")}
    assert modes == {"copied.onnx": 0o644, "rewritten.onnx": 0o644}


def test_explain_a_node_that_was_fused(tmp_path: Path) -> None:
    """The decomposed LayerNorm's ReduceMean is fused away: --explain said there was no such node."""
    import shutil

    shutil.copy(ROOT / "models" / "transformer_block_op13.onnx", tmp_path / "t.onnx")
    proc = run_cli(["t.onnx", "--explain", "ln1_mean"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("ln1_mean: fused, with the rest of its LayerNorm pattern, into ")
    assert "computes in" in proc.stdout  # and the fused node's own explanation follows
    typo = run_cli(["t.onnx", "--explain", "ln1_maen"], tmp_path)
    assert typo.returncode == 2 and "ln1_mean" in typo.stderr  # a fused member is among the suggestions


def test_a_misspelt_fp32_input_name_is_a_rule_file_error(tmp_path: Path) -> None:
    """fp32_inputs = ["rio"] pinned nothing, silently. The error names the file as given (it gave
    only its base name, unlike every other rule-file error)."""
    save(mlp(), tmp_path / "m.onnx")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "r.toml").write_text('[clear.Resize]\nreason = "coordinates"\nfp32_inputs = ["rio", "scales"]\n')
    proc = run_cli(["m.onnx", "-o", "out.onnx", "--rules", "sub/r.toml"], tmp_path)
    assert proc.returncode == 4
    assert re.search(r"^amp-rewrite: error: sub/r\.toml: clear\.Resize\.fp32_inputs: 'rio' is not an input of Resize .*did you mean 'roi'",
                     proc.stderr, re.M), proc.stderr
    (tmp_path / "sub" / "r.toml").write_text('[clear.Resize]\nreason = "coordinates"\nfp32_inputs = ["roi", 2]\n')
    assert run_cli(["m.onnx", "-o", "out.onnx", "--rules", "sub/r.toml"], tmp_path).returncode == 0


def test_a_misspelt_fp32_input_name_of_a_contrib_op_is_a_rule_file_error(tmp_path: Path) -> None:
    """onnx has no schema for com.microsoft ops, so their fp32_inputs names went unchecked; they are
    checked against onnxruntime's own schemas."""
    save(mlp(), tmp_path / "m.onnx")
    rule = '[infer."com.microsoft:SkipLayerNormalization"]\nreason = "fused"\nfp32_inputs = [%s]\n'
    (tmp_path / "r.toml").write_text(rule % '"gama"')
    proc = run_cli(["m.onnx", "-o", "out.onnx", "--rules", "r.toml"], tmp_path)
    assert proc.returncode == 4, proc.stderr
    assert re.search(r"'gama' is not an input of SkipLayerNormalization .*did you mean 'gamma'", proc.stderr), \
        proc.stderr
    (tmp_path / "r.toml").write_text(rule % '"gamma", "beta"')
    assert run_cli(["m.onnx", "-o", "out.onnx", "--rules", "r.toml"], tmp_path).returncode == 0


def test_an_fp32_input_index_past_the_ops_inputs_is_a_rule_file_error(tmp_path: Path) -> None:
    """fp32_inputs = [5] on MatMul (inputs 0..1) pinned nothing, silently, while a misspelt name was
    an error. Variadic ops (Concat) take any index."""
    save(mlp(), tmp_path / "m.onnx")
    (tmp_path / "r.toml").write_text('[allow.MatMul]\nreason = "gemm"\nfp32_inputs = [1, 5]\n')
    proc = run_cli(["m.onnx", "-o", "out.onnx", "--rules", "r.toml"], tmp_path)
    assert proc.returncode == 4, proc.stderr
    assert re.search(r"r\.toml: allow\.MatMul\.fp32_inputs: input index 5 is out of range: MatMul takes at most 2 "
                     r"inputs \(indices 0\.\.1\)", proc.stderr), proc.stderr
    (tmp_path / "r.toml").write_text('[clear.Concat]\nreason = "joins"\nfp32_inputs = [7]\n')
    assert run_cli(["m.onnx", "-o", "out.onnx", "--rules", "r.toml"], tmp_path).returncode == 0


@pytest.mark.parametrize("typed, meant", [("relu", "Relu"), ("tanh", "Tanh"), ("gelu", "Gelu")])
def test_an_op_in_the_wrong_case_is_suggested_in_the_right_one(tmp_path: Path, typed: str, meant: str) -> None:
    """'relu' got "did you mean 'Selu'?": the fuzzy match ran before the case-insensitive one."""
    save(mlp(), tmp_path / "m.onnx")
    proc = run_cli(["m.onnx", "-o", "out.onnx", "--fp32-ops", typed], tmp_path)
    assert proc.returncode == 2 and f"did you mean {meant!r}?" in proc.stderr, proc.stderr


@pytest.mark.parametrize("given", ["", "Relu,,MatMul", "Relu,"])
def test_an_empty_op_name_is_refused(tmp_path: Path, given: str) -> None:
    """--fp32-ops '' (an unset shell variable) or 'A,,B' dropped the empty name and pinned what was
    left without a word; an empty --fp32-nodes pattern was already refused."""
    save(mlp(), tmp_path / "m.onnx")
    proc = run_cli(["m.onnx", "-o", "out.onnx", "--fp32-ops", given], tmp_path)
    assert proc.returncode == 2 and f"--fp32-ops: empty op name in {given!r}" in proc.stderr, proc.stderr
    assert not (tmp_path / "out.onnx").exists()


def test_api_options_of_the_wrong_shape(tmp_path: Path) -> None:
    """A string where a list is expected was read letter by letter (fp32_ops="Softmax": "unknown
    op 'S'"; fp32_nodes="/mm1": silently nothing; rules="r.toml": "/ is a directory"), and a
    non-bool flag was taken as true. One name is now that one item; a non-bool flag is refused."""
    from amp_rewrite import rewrite
    from amp_rewrite.errors import UsageError

    m = mlp()
    one = rewrite(m, fp32_nodes="mm1", report=True)[1].log.decisions["mm1"]
    assert one.precision.value == "fp32"
    assert rewrite(m, fp32_ops="MatMul", report=True)[1].log.decisions["mm2"].precision.value == "fp32"
    (tmp_path / "r.toml").write_text('[deny]\nMatMul = "test"\n')
    assert rewrite(m, rules=str(tmp_path / "r.toml"), report=True)[1].log.decisions["mm1"].precision.value == "fp32"
    with pytest.raises(UsageError, match="keep_io_types='no': pass True or False"):
        rewrite(m, keep_io_types="no")
    with pytest.raises(UsageError, match="fp32_ops: 3 is not a name"):
        rewrite(m, fp32_ops=[3])


def test_rewrite_onnx_of_a_training_graph_adds_the_loss_scale(tmp_path: Path) -> None:
    """rewrite_onnx(..., training=True, loss=...) ignored the loss: no loss-scale nodes, unlike
    rewrite() on the same ModelProto and the CLI."""
    from amp_rewrite import rewrite_onnx

    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"),
             helper.make_node("ReduceSum", ["h"], ["loss"], name="sum", keepdims=0)]
    save(model(nodes, [vi("x")], [vi("loss", shape=())], [weight("w1")]), tmp_path / "t.onnx")
    result = rewrite_onnx(tmp_path / "t.onnx", tmp_path / "o.onnx", training=True, loss="loss")
    out = onnx.load(str(tmp_path / "o.onnx"))
    assert any("scale" in o.name for o in out.graph.output), [o.name for o in out.graph.output]
    assert result.modified


_INTERRUPTED_IMPORT = """
import os, signal, sys, time, tomllib
TRIGGER, SIGNAL, SWALLOWED = sys.argv[2], getattr(signal, sys.argv[3]), sys.argv[4] == "swallowed"
# a Ctrl-C from a terminal: a suite started in the background by a non-interactive shell ignores
# SIGINT, and its children inherit that (the signal then did nothing and the run ended with 0)
signal.signal(signal.SIGINT, signal.default_int_handler)
class Interrupt:  # the signal lands while TRIGGER imports
    def find_spec(self, name, path, target=None):
        if name == TRIGGER and not SWALLOWED:  # (numpy's extension swallows it itself)
            os.kill(os.getpid(), SIGNAL)
        elif name == TRIGGER:  # (onnxruntime's C initialisation turns it into an ImportError)
            try:
                os.kill(os.getpid(), SIGNAL)
                time.sleep(0.2)
            except KeyboardInterrupt:
                raise ImportError("import numpy failed")
        return None
sys.meta_path.insert(0, Interrupt())
module, _, func = tomllib.load(open(sys.argv[1], "rb"))["project"]["scripts"]["amp-rewrite"].partition(":")
sys.argv = ["amp-rewrite", "m.onnx", "-o", "o.onnx"]
entry = getattr(__import__(module, fromlist=[func]), func)
sys.exit(entry())
"""


def _interrupted_import(folder: Path, trigger: str, sig: str, how: str) -> subprocess.CompletedProcess:
    save(mlp(), folder / "m.onnx")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return subprocess.run([sys.executable, "-c", _INTERRUPTED_IMPORT, str(ROOT / "pyproject.toml"), trigger, sig, how],
                          cwd=folder, env=env, capture_output=True, text=True, timeout=300)


def test_ctrl_c_while_the_cli_starts_is_an_interruption(tmp_path: Path) -> None:
    """A Ctrl-C in the first ~0.5 s (while the package imported numpy, networkx and onnx, before the
    CLI's handler was in place) printed a traceback (exit -2), or, inside numpy's extension, which
    turns it into an ImportError, 'internal error: ImportError ... please report it' (exit 70). The
    console script's entry point now holds a Ctrl-C through those imports: exit 130, one line."""
    proc = _interrupted_import(tmp_path, "numpy._core._add_newdocs", "SIGINT", "raised")
    assert (proc.returncode, proc.stderr) == (130, "amp-rewrite: interrupted; no output was written\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]


@pytest.mark.parametrize("sig, code", [("SIGINT", 130), ("SIGTERM", 143)])
def test_ctrl_c_while_onnxruntime_loads_is_an_interruption(tmp_path: Path, sig: str, code: int) -> None:
    """A Ctrl-C (or SIGTERM) inside onnxruntime's extension initialisation became its ImportError
    ('import numpy failed'); the run went on without onnxruntime's schemas and stopped at a false
    rule-file error ('deny.com.microsoft:QLinearReduceMean: unknown com.microsoft op', exit 4)."""
    proc = _interrupted_import(tmp_path, "onnxruntime.capi.onnxruntime_pybind11_state", sig, "swallowed")
    assert proc.returncode == code, proc.stderr
    assert "unknown com.microsoft op" not in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]


@pytest.mark.parametrize("extra", [[], ["--check"], ["--explain", "mm1"]], ids=["summary", "check", "explain"])
def test_a_reader_that_stops_reading_stdout_ends_the_printing_not_the_command(tmp_path: Path, extra) -> None:
    """``amp-rewrite m.onnx | head -1``: the reader closes the pipe before the summary (or the
    --check table, or --explain) is printed. The command still does its work and exits 0, with
    nothing on stderr."""
    save(mlp(), tmp_path / "m.onnx")
    env = dict(os.environ, AMP_REWRITE_NO_PROGRESS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    argv = ["m.onnx", *extra] if extra[:1] == ["--explain"] else ["m.onnx", "-o", "o.onnx", *extra]
    proc = subprocess.Popen([sys.executable, "-m", "amp_rewrite", *argv], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # (the reader is gone before the first line)
    err = proc.stderr.read().decode()
    assert (proc.wait(timeout=300), err) == (0, "")
    if extra[:1] != ["--explain"]:
        onnx.checker.check_model(str(tmp_path / "o.onnx"), full_check=True)


_INTERRUPTED_EXIT = """
import os, signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)  # (as from a terminal: see _INTERRUPTED_IMPORT)
import amp_rewrite.cli as cli
real = cli.main
def main():  # the Ctrl-C lands after the run, while its frames return (freeing a large model takes a while)
    code = real()
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.5)
    return code
cli.main = main
sys.argv = ["amp-rewrite", "m.onnx", "-o", "o.onnx"]
from amp_rewrite._console import main as entry
code = entry()
os.kill(os.getpid(), signal.SIGINT)  # (and another on the way out)
time.sleep(0.2)
sys.exit(code)
"""


def test_ctrl_c_after_the_output_is_written_says_so(tmp_path: Path) -> None:
    """A Ctrl-C after the run, as its frames freed the model, ended the process by SIGINT with
    nothing said, though the output was written and kept (the shell's 130 reads 'no output')."""
    save(mlp(), tmp_path / "m.onnx")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    proc = subprocess.run([sys.executable, "-c", _INTERRUPTED_EXIT], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert (proc.returncode, proc.stderr) == (130, "amp-rewrite: interrupted after writing o.onnx\n"), proc.stderr
    onnx.checker.check_model(str(tmp_path / "o.onnx"), full_check=True)


def test_version_flag(tmp_path: Path) -> None:
    from amp_rewrite import __version__

    proc = run_cli(["--version"], tmp_path)
    assert proc.returncode == 0 and proc.stdout.strip() == f"amp-rewrite {__version__}" and proc.stderr == ""


# -- found by a bug hunt on unusual ONNX constants -------------------------------------------------------------
def _graph_model(nodes, inputs, outputs, inits=(), opset=17) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)
    onnx.checker.check_model(model, full_check=True)
    return model


@pytest.mark.parametrize("attr", [{"value_float": 0.5}, {"value_floats": [0.5, 1.0, 2.0, 3.0]}])
def test_a_constant_written_with_value_float_is_converted(tmp_path: Path, attr: dict) -> None:
    """Constant(value_float=...) between two MatMuls was an internal error (KeyError: 'value')."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((4, 4)).astype(np.float32), "W")
    model = _graph_model([helper.make_node("MatMul", ["x", "W"], ["h"]), helper.make_node("Constant", [], ["c"], **attr),
                          helper.make_node("Add", ["h", "c"], ["a"]), helper.make_node("MatMul", ["a", "W"], ["y"])],
                         [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                         [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])], [w])
    save(model, tmp_path / "m.onnx")
    proc = run_cli(["m.onnx", "-o", "out.onnx"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = onnx.load(str(tmp_path / "out.onnx"))
    onnx.checker.check_model(out, full_check=True)
    const = next(n for n in out.graph.node if n.op_type == "Constant")
    assert [a.name for a in const.attribute] == ["value"] and const.attribute[0].t.data_type == TensorProto.FLOAT16
    x = rng.standard_normal((2, 4)).astype(np.float32)
    want = run_onnx(model, {"x": x})["y"]
    got = run_onnx(out, {"x": x})["y"]
    assert np.abs(got - want).max() <= 1e-2 * np.abs(want).max()


def test_constant_of_shape_value_is_clamped_like_any_constant(tmp_path: Path) -> None:
    """ConstantOfShape(value=finfo(float32).min), what torch exports for masks, became -inf."""
    fill = numpy_helper.from_array(np.array([np.finfo(np.float32).min], np.float32), "value")
    w = numpy_helper.from_array(np.eye(4, dtype=np.float32), "W")
    model = _graph_model([helper.make_node("Shape", ["x"], ["s"]),
                          helper.make_node("ConstantOfShape", ["s"], ["m"], value=fill),
                          helper.make_node("Where", ["keep", "x", "m"], ["masked"]),
                          helper.make_node("MatMul", ["masked", "W"], ["h"]),
                          helper.make_node("Softmax", ["h"], ["y"], axis=-1)],
                         [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4]),
                          helper.make_tensor_value_info("keep", TensorProto.BOOL, [2, 4])],
                         [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])], [w])
    out, report = __import__("amp_rewrite").rewrite(model, report=True, fp16_ops=["Where", "ConstantOfShape"])
    onnx.checker.check_model(out, full_check=True)
    cos = next(n for n in out.graph.node if n.op_type == "ConstantOfShape")
    value = numpy_helper.to_array(cos.attribute[0].t)
    assert value.dtype == np.float16 and value.tolist() == [-65504.0]
    assert report.log.weights.clamped >= 1
    x = np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32)
    keep = np.array([[True, False, True, False], [False, False, False, True]])
    got = run_onnx(out, {"x": x, "keep": keep})["y"]
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, run_onnx(model, {"x": x, "keep": keep})["y"], atol=1e-2)


def test_a_tensor_shorter_than_its_dims_is_a_load_error(tmp_path: Path) -> None:
    """raw_data shorter than its dims (a corrupt model) was an internal error, exit 70."""
    model = mlp()
    weight = next(t for t in model.graph.initializer if len(t.dims) == 2)
    weight.raw_data = weight.raw_data[:8]
    save(model, tmp_path / "m.onnx")
    proc = run_cli(["m.onnx", "-o", "out.onnx"], tmp_path)
    assert proc.returncode == 3, proc.stderr
    assert f"tensor {weight.name!r}" in proc.stderr and "corrupt" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "out.onnx").exists()


def test_ir3_lists_a_shared_weights_low_copy_among_the_graph_inputs(tmp_path: Path) -> None:
    """IR 3 lists every initializer as a graph input: the FP16 copy of a weight read by an FP16 and
    an FP32 op was not listed, and the checker rejected the output."""
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((4, 4)).astype(np.float32), "W")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["h"]),
                               helper.make_node("ReduceSum", ["W"], ["s"], axes=[0], keepdims=1),
                               helper.make_node("Add", ["h", "s"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4]),
                               helper.make_tensor_value_info("W", TensorProto.FLOAT, [4, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 8)], ir_version=3)
    onnx.checker.check_model(model, full_check=True)
    for placement in ("optimal", "greedy"):
        out = __import__("amp_rewrite").rewrite(model, placement=placement)
        copies = [t.name for t in out.graph.initializer if t.data_type == TensorProto.FLOAT16]
        assert copies and all(name in [i.name for i in out.graph.input] for name in copies)
        onnx.checker.check_model(out, full_check=True)
        assert load_ok(out)


def test_dropped_training_info_is_said(tmp_path: Path) -> None:
    """ModelProto.training_info (onnx-ir does not carry it) vanished from the output without a word."""
    model = mlp()
    info = model.training_info.add()
    weight = next(t for t in model.graph.initializer if len(t.dims) == 2)
    info.algorithm.CopyFrom(helper.make_graph(
        [helper.make_node("Mul", [weight.name, "lr"], ["updated"])], "sgd", [],
        [helper.make_tensor_value_info("updated", TensorProto.FLOAT, list(weight.dims))],
        [numpy_helper.from_array(np.array(0.9, np.float32), "lr")]))
    binding = info.update_binding.add()
    binding.key, binding.value = weight.name, "updated"
    onnx.checker.check_model(model, full_check=True)
    save(model, tmp_path / "m.onnx")
    proc = run_cli(["m.onnx", "-o", "out.onnx"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "dropped: the model's training_info (1 TrainingInfoProto)" in proc.stdout
    assert len(onnx.load(str(tmp_path / "out.onnx")).training_info) == 0


def test_a_converted_weight_keeps_its_doc_string_and_metadata(tmp_path: Path) -> None:
    model = mlp()
    weight = next(t for t in model.graph.initializer if len(t.dims) == 2)
    weight.doc_string = "projection weight"
    entry = weight.metadata_props.add()
    entry.key, entry.value = "source", "layer0"
    out = __import__("amp_rewrite").rewrite(model)
    converted = next(t for t in out.graph.initializer if t.name == weight.name)
    assert converted.data_type == TensorProto.FLOAT16
    assert converted.doc_string == "projection weight"
    assert [(p.key, p.value) for p in converted.metadata_props] == [("source", "layer0")]


def test_ctrl_c_is_exit_130_and_leaves_the_previous_output(tmp_path: Path, monkeypatch, capsys) -> None:
    """typer turns a KeyboardInterrupt into Exit(130), which click (not standalone) returns: main()
    ignored it and a Ctrl-C exited 0, silently. Interrupted after the model is written (here in
    --check), the output is removed and the file --overwrite was replacing comes back."""
    from amp_rewrite import check
    from amp_rewrite.cli import main

    save(mlp(), tmp_path / "m.onnx")
    (tmp_path / "out.onnx").write_bytes(b"previous")

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(check, "check_cli", interrupted)
    code = main([str(tmp_path / "m.onnx"), "-o", str(tmp_path / "out.onnx"), "--overwrite", "--check"])
    assert code == 130
    assert capsys.readouterr().err.strip() == "amp-rewrite: interrupted; no output was written"
    assert (tmp_path / "out.onnx").read_bytes() == b"previous"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx", "out.onnx"]


def test_ctrl_c_after_the_output_is_kept_says_it_was_written(tmp_path: Path, monkeypatch, capsys) -> None:
    """A Ctrl-C landing while the summary is printed, after the output was renamed into place and
    kept, said 'no output was written' (exit 130) with the complete output on disk."""
    from amp_rewrite.cli import main
    from amp_rewrite.report import Report

    save(mlp(), tmp_path / "m.onnx")

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(Report, "summary_text", interrupted)
    code = main([str(tmp_path / "m.onnx"), "-o", str(tmp_path / "out.onnx")])
    assert code == 130
    assert capsys.readouterr().err.strip() == f"amp-rewrite: interrupted after writing {tmp_path / 'out.onnx'}"
    onnx.checker.check_model(onnx.load(str(tmp_path / "out.onnx")), full_check=True)
    monkeypatch.undo()
    assert main([str(tmp_path / "m.onnx"), "-o", str(tmp_path / "out.onnx")]) == 6  # (exists: nothing written)
    assert "interrupted" not in capsys.readouterr().err


def test_sigterm_cleans_up_like_ctrl_c_and_exits_143(tmp_path: Path, monkeypatch, capsys) -> None:
    """SIGTERM (kill, timeout, a job scheduler) had no handler: the process died where it stood,
    leaving its temporary folder (a partial data file) and the files --overwrite had set aside.
    Now it unwinds like Ctrl-C; the previous handler is back afterwards."""
    import signal

    from amp_rewrite import check
    from amp_rewrite.cli import main

    save(mlp(), tmp_path / "m.onnx")
    (tmp_path / "out.onnx").write_bytes(b"previous")

    def terminated(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        raise AssertionError("SIGTERM did not stop the command")

    monkeypatch.setattr(check, "check_cli", terminated)
    before = signal.getsignal(signal.SIGTERM)
    code = main([str(tmp_path / "m.onnx"), "-o", str(tmp_path / "out.onnx"), "--overwrite", "--check"])
    assert code == 143
    assert "no output was written" in capsys.readouterr().err
    assert (tmp_path / "out.onnx").read_bytes() == b"previous"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx", "out.onnx"]
    assert signal.getsignal(signal.SIGTERM) == before


def test_a_name_too_long_for_the_file_system_is_a_clear_error(tmp_path: Path) -> None:
    """A 260-character file name (over NAME_MAX) raised OSError from Path.exists(): exit 70."""
    save(mlp(), tmp_path / "m.onnx")
    long = "a" * 260 + ".onnx"
    out = run_cli(["m.onnx", "-o", long], tmp_path)
    assert out.returncode == 6 and "cannot be written (File name too long)" in out.stderr, out.stderr
    for argv in ([long], [long, "-o", "x.onnx"]):
        proc = run_cli(argv, tmp_path)
        assert proc.returncode == 3 and "cannot be opened (File name too long)" in proc.stderr, proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_an_unreadable_model_is_a_load_error(tmp_path: Path) -> None:
    """click's readable check answered first: exit 2 ("Invalid value for 'model'"), where the
    docs give 3 for an input that cannot be read."""
    save(mlp(), tmp_path / "m.onnx")
    (tmp_path / "m.onnx").chmod(0)
    proc = run_cli(["m.onnx", "-o", "out.onnx"], tmp_path)
    assert proc.returncode == 3, proc.stderr


@pytest.mark.parametrize("where", ["copy of an unchanged model", "report"])
def test_an_interrupted_write_leaves_no_temporary_file(tmp_path: Path, monkeypatch, capsys, where) -> None:
    """The unchanged-model copy and the report writer removed their temporary file on OSError only:
    a Ctrl-C while they wrote left .amp-rewrite-* / .amp-report-* in the output folder."""
    import shutil

    from amp_rewrite import files
    from amp_rewrite.cli import main

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    if where == "report":
        save(mlp(), tmp_path / "m.onnx")
        monkeypatch.setattr(files, "ordinary_mode", interrupted)  # (called on the temp file before the rename)
        argv = [str(tmp_path / "m.onnx"), "-o", str(tmp_path / "out.onnx"), "--report", str(tmp_path / "r.json")]
    else:
        nodes = [helper.make_node("Add", ["a", "b"], ["c"], name="add")]
        save(model(nodes, [vi("a", TensorProto.INT64), vi("b", TensorProto.INT64)], [vi("c", TensorProto.INT64)]),
             tmp_path / "m.onnx")
        real = shutil.copyfile
        monkeypatch.setattr(shutil, "copyfile", lambda src, dst, **kw: (real(src, dst, **kw), interrupted()))
        argv = [str(tmp_path / "m.onnx"), "-o", str(tmp_path / "out.onnx")]
    assert main([*argv, "-q"]) == 130
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]


@pytest.mark.parametrize("kind", ["rewritten", "nothing to rewrite"])
def test_a_constant_stored_in_external_data_is_read_from_the_model_folder(tmp_path: Path, kind) -> None:
    """A Constant's value in external data (onnx's convert_attribute=True) was read relative to the
    working directory: exit 70 from elsewhere, or an unrelated w.bin there silently used as the
    weight; and an output written to another folder pointed at the input's data file."""
    from onnx.external_data_helper import convert_model_to_external_data

    rng = np.random.default_rng(0)
    if kind == "rewritten":
        w = numpy_helper.from_array((rng.standard_normal((4, 4)) / 2).astype(np.float32), "wc")
        c = numpy_helper.from_array(rng.standard_normal(4).astype(np.float32), "cc")
        nodes = [helper.make_node("Constant", [], ["w"], name="const_w", value=w),
                 helper.make_node("Constant", [], ["c"], name="const_c", value=c),
                 helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
                 helper.make_node("Exp", ["h"], ["e"], name="exp"),
                 helper.make_node("Add", ["e", "c"], ["y"], name="add")]  # (c stays FP32, outside)
        proto, feeds = model(nodes, [vi("x")], [vi("y")]), {"x": feed()}
    else:
        c = numpy_helper.from_array(np.arange(4, dtype=np.int64), "cc")
        nodes = [helper.make_node("Constant", [], ["c"], name="const_c", value=c),
                 helper.make_node("Add", ["x", "c"], ["y"], name="add")]
        proto = model(nodes, [vi("x", TensorProto.INT64, [4])], [vi("y", TensorProto.INT64, [4])])
        feeds = {"x": np.arange(4, dtype=np.int64)}
    convert_model_to_external_data(proto, location="w.bin", size_threshold=0, convert_attribute=True)
    (tmp_path / "sub").mkdir()
    (tmp_path / "out").mkdir()
    onnx.save(proto, str(tmp_path / "sub" / "m.onnx"))
    np.full(64, 100.0, np.float32).tofile(tmp_path / "w.bin")  # an unrelated file of that name where it runs
    proc = run_cli(["sub/m.onnx", "-o", "out/o.onnx", "-q"], tmp_path)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    onnx.checker.check_model(str(tmp_path / "out" / "o.onnx"), full_check=True)
    ref = run_onnx(tmp_path / "sub" / "m.onnx", feeds)["y"]
    got = run_onnx(tmp_path / "out" / "o.onnx", feeds)["y"]
    assert np.abs(got.astype(np.float64) - ref).max() <= 1e-2 * np.abs(ref).max()


@pytest.mark.parametrize("via_symlink", [False, True])
def test_report_may_not_overwrite_the_inputs_external_data(tmp_path: Path, via_symlink: bool) -> None:
    """--report weights.md --overwrite, with the input's tensors stored in weights.md, replaced the
    data file with the report: exit 0, and the input no longer loaded. Given through a symlink in
    another folder (whose data onnx reads beside the link), the check looked in the folder the link
    points to and let the report replace the data."""
    save_external(mlp(), tmp_path / "m.onnx", location="weights.md")
    if via_symlink:
        (tmp_path / "real").mkdir()
        (tmp_path / "m.onnx").rename(tmp_path / "real" / "m.onnx")
        (tmp_path / "m.onnx").symlink_to(Path("real") / "m.onnx")
    before = snapshot(tmp_path)
    proc = run_cli(["m.onnx", "-o", "out.onnx", "--report", "weights.md", "--overwrite"], tmp_path)
    assert proc.returncode == 6 and "external data" in proc.stderr, proc.stderr
    assert snapshot(tmp_path) == before


def test_rewrite_onnx_refuses_a_destination_ending_in_a_slash(tmp_path):
    from amp_rewrite.api import rewrite_onnx
    from amp_rewrite.errors import OutputError

    src = save(mlp(), tmp_path / "m.onnx")
    with pytest.raises(OutputError, match="ends with a slash, so it names a folder"):
        rewrite_onnx(src, str(tmp_path / "outdir") + "/")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]


def test_an_unlisted_local_function_call_advises_inlining_not_a_rule_file(tmp_path: Path) -> None:
    """The summary listed a model-local function call among the unlisted ops, to classify in a rule
    file; a rule file doing so was then 'without effect' (a call's body is not rewritten). The
    summary and the node's reason now say to inline it."""
    case_model_local_function(tmp_path)
    proc = run_cli(["m.onnx", "-o", "out.onnx", "--report", "r.json", "--no-inline-functions"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "unlisted ops" not in proc.stdout
    assert "model-local function calls kept FP32: local::HalfIt ×1" in proc.stdout
    assert "rewrite without --no-inline-functions" in proc.stdout
    import json

    nodes = {n["node"]: n for n in json.loads((tmp_path / "r.json").read_text())["nodes"]}
    assert nodes["fn"]["precision"] == "fp32" and "inlined, what it computes is rewritten" in nodes["fn"]["reason"]


def test_a_model_holding_maps_is_refused_as_unsupported_with_what_to_do(tmp_path: Path) -> None:
    """skl2onnx's default classifier ends in ai.onnx.ml's ZipMap, a sequence of maps: a valid model
    (onnxruntime runs it) that onnx-ir cannot hold. It was exit 3, 'could not be read', with
    onnx-ir's request for a pull request; it is exit 5, naming the value and the way out."""
    from onnx import TensorProto as T

    nodes = [helper.make_node("MatMul", ["x", "W"], ["lg"]), helper.make_node("Softmax", ["lg"], ["pr"], axis=1),
             helper.make_node("ZipMap", ["pr"], ["zm"], domain="ai.onnx.ml", classlabels_int64s=[0, 1, 2])]
    zm = helper.make_value_info("zm", helper.make_sequence_type_proto(
        helper.make_map_type_proto(T.INT64, helper.make_tensor_type_proto(T.FLOAT, []))))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", T.FLOAT, [3, 4])], [zm],
                              [numpy_helper.from_array(np.ones((4, 3), np.float32), "W")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13), helper.make_opsetid("ai.onnx.ml", 3)],
                              ir_version=8)
    onnx.checker.check_model(model, full_check=True)
    save(model, tmp_path / "clf.onnx")
    before = snapshot(tmp_path)
    proc = run_cli(["clf.onnx", "-o", "out.onnx"], tmp_path)
    assert proc.returncode == 5, proc.stderr
    assert "'zm' holds maps (sequence(map(int64, float32)), made by ai.onnx.ml:ZipMap)" in proc.stderr
    assert "zipmap" in proc.stderr and "Traceback" not in proc.stderr and "PR" not in proc.stderr
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("option", ["--rules", "--inputs", "--report"])
def test_an_output_naming_a_file_the_command_reads_is_refused(tmp_path: Path, option: str) -> None:
    """-o my_rules.toml --rules my_rules.toml --overwrite replaced the user's rule file by the model
    (exit 0); -o in.npz with --inputs in.npz replaced the arrays before --check read them."""
    save(mlp(), tmp_path / "m.onnx")
    for name in ("my.toml", "my.json"):
        (tmp_path / name).write_text("[deny]\nRelu = \"mine\"\n")
    np.savez(tmp_path / "in.npz", x=np.ones((2, 4), np.float32))
    read = {"--rules": "my.toml", "--inputs": "in.npz", "--report": "my.json"}[option]
    extra = ["--check"] if option == "--inputs" else []
    written = ["--report", read, "--rules", read] if option == "--report" else ["-o", read, option, read]
    before = snapshot(tmp_path)
    proc = run_cli(["m.onnx", *written, *extra, "--overwrite"], tmp_path)
    assert proc.returncode == 6, proc.stderr
    flag, source = ("--report" if option == "--report" else "-o"), ("--inputs" if option == "--inputs" else "--rules")
    assert f"{flag} {read}: is the {source} file this command reads" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert snapshot(tmp_path) == before
