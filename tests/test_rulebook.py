"""Rule files: built-in sets, layering, node patterns, and validation errors that name file, key
and the closest valid spelling."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest
from util import make_model

from amp_rewrite.decisions import Category, Precision
from amp_rewrite.errors import RuleFileError, UsageError
from amp_rewrite.rulebook import (
    NodeRule,
    RuleBook,
    RuleEntry,
    builtin_names,
    default_ruleset,
    load_rules,
)

RULES_DIR = Path(__file__).resolve().parent.parent / "rules"
PAIRS = [("onnx", "fp16"), ("onnx", "bf16"), ("torch", "fp16"), ("torch", "bf16")]


def write(tmp_path: Path, text: str, name: str = "my_rules.toml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


# --------------------------------------------------------------------------------------------
# Built-in sets
# --------------------------------------------------------------------------------------------


def test_builtin_names_and_defaults():
    assert builtin_names() == ["onnx-cuda-bf16", "onnx-cuda-fp16", "torch-bf16", "torch-fp16"]
    assert default_ruleset("onnx", "fp16") == "onnx-cuda-fp16"
    assert default_ruleset("onnx", "bf16") == "onnx-cuda-bf16"
    assert default_ruleset("torch", "fp16") == "torch-fp16"
    assert default_ruleset("torch", "bf16") == "torch-bf16"


@pytest.mark.parametrize("frontend,target", [("onx", "fp16"), ("onnx", "fp8")])
def test_default_ruleset_rejects_unknown_choices(frontend, target):
    with pytest.raises(UsageError):
        default_ruleset(frontend, target)


def test_a_choice_in_the_wrong_case_is_told_its_spelling():
    with pytest.raises(UsageError, match=r"unknown target 'FP16'.*\(did you mean 'fp16'\?\)"):
        load_rules(target="FP16")


@pytest.mark.parametrize("frontend,target", PAIRS)
def test_builtin_sets_load(frontend, target):
    book = load_rules(frontend=frontend, target=target)
    assert isinstance(book, RuleBook)
    assert book.name == default_ruleset(frontend, target)
    assert (book.frontend, book.target) == (frontend, target)
    assert book.files == (str(RULES_DIR / f"{book.name}.toml"),)
    assert book.provider == ("CUDAExecutionProvider" if frontend == "onnx" else None)
    categories = {entry.category for entry in book.entries()}
    assert categories == {Category.ALLOW, Category.INFER, Category.CLEAR, Category.DENY}


@pytest.mark.parametrize("frontend,target", PAIRS)
def test_every_builtin_entry_has_a_specific_reason(frontend, target):
    book = load_rules(frontend=frontend, target=target)
    for entry in book.entries():
        assert entry.reason.strip(), entry
        assert len(entry.reason) >= 15, f"reason too vague: {entry}"
        assert entry.source.startswith(f"{book.name}.toml: {entry.category.value}."), entry.source


def test_onnx_sets_name_the_same_ops():
    """bf16 may split an op into more opset ranges, but never forgets an op the fp16 set has."""
    ops = {t: {(e.domain, e.op) for e in load_rules(target=t).entries()} for t in ("fp16", "bf16")}
    assert ops["fp16"] == ops["bf16"]


def test_torch_sets_name_the_same_ops():
    ops = {t: {e.op for e in load_rules(frontend="torch", target=t).entries()} for t in ("fp16", "bf16")}
    assert ops["fp16"] == ops["bf16"]


def test_cumsum_depends_on_opset():
    book = load_rules()
    at13, at14 = book.lookup("CumSum", opset=13), book.lookup("CumSum", opset=14)
    assert at13.category is Category.DENY and at13.until == 13
    assert "kernel" in at13.reason
    assert at14.category is Category.DENY and at14.since == 14
    assert "running sum" in at14.reason
    assert book.lookup("CumSum") == at14  # no opset: the open-ended, newest entry


def test_clip_is_denied_only_where_cuda_lacks_fp16():
    book = load_rules()
    assert book.category_of("Clip", opset=11) is Category.DENY
    assert book.category_of("Clip", opset=12) is Category.INFER
    assert book.category_of("Clip", opset=21) is Category.INFER


def test_resize_pins_roi_and_scales():
    entry = load_rules().lookup("Resize", opset=19)
    assert entry.category is Category.CLEAR
    assert entry.fp32_inputs == ("roi", "scales")


def test_contentious_fp16_categories():
    book = load_rules()
    assert book.category_of("MatMul", opset=17) is Category.ALLOW
    assert book.lookup("Softmax", opset=17).accumulates_fp32
    assert book.category_of("Softmax", opset=17) is Category.INFER
    assert book.category_of("LogSoftmax", opset=17) is Category.DENY
    assert book.lookup("LayerNormalization", opset=17).accumulates_fp32
    assert book.category_of("ReduceMean", opset=17) is Category.DENY
    assert book.category_of("GroupNormalization", opset=21) is Category.DENY
    assert book.category_of("LSTM", opset=17) is Category.INFER
    assert book.category_of("TopK", opset=17) is Category.CLEAR


def test_domains():
    book = load_rules()
    assert book.category_of("Attention", "com.microsoft") is Category.ALLOW
    assert book.lookup("SkipLayerNormalization", "com.microsoft").accumulates_fp32
    assert book.lookup("MatMul", "ai.onnx") == book.lookup("MatMul", "")
    assert book.category_of("MatMul", "com.example") is Category.UNLISTED
    assert book.category_of("NoSuchOp") is Category.UNLISTED


def test_bf16_moves_range_only_denials_to_infer():
    fp16, bf16 = load_rules(target="fp16"), load_rules(target="bf16")
    assert fp16.category_of("Exp", opset=17) is Category.DENY
    assert bf16.category_of("Exp", opset=17) is Category.INFER
    assert bf16.category_of("Exp", opset=12) is Category.DENY  # no bf16 kernel before 13
    assert bf16.category_of("ReduceSum", opset=17) is Category.DENY
    torch16, torch_bf = load_rules(frontend="torch"), load_rules(frontend="torch", target="bf16")
    assert torch16.category_of("exp") is Category.DENY
    assert torch_bf.category_of("exp") is Category.INFER
    for op in ("sum", "mean", "softmax", "cumsum", "layer_norm", "cross_entropy"):
        assert torch_bf.category_of(op) is Category.DENY, op


def test_torch_follows_autocast_lists():
    book = load_rules(frontend="torch")
    for op in ("linear", "matmul", "conv2d", "baddbmm", "scaled_dot_product_attention", "lstm_cell"):
        assert book.category_of(op) is Category.ALLOW, op
    for op in ("exp", "log", "pow", "softmax", "log_softmax", "layer_norm", "cumsum", "sum", "mse_loss"):
        assert book.category_of(op) is Category.DENY, op
    for op in ("add", "mul", "relu", "gelu", "where", "batch_norm"):
        assert book.category_of(op) is Category.INFER, op
    for op in ("view", "reshape", "permute", "cat", "getitem", "max_pool2d"):
        assert book.category_of(op) is Category.CLEAR, op


def test_rulebook_is_frozen():
    book = load_rules()
    with pytest.raises(dataclasses.FrozenInstanceError):
        book.name = "other"  # type: ignore[misc]
    with pytest.raises(TypeError):
        book._table["MatMul"] = ()  # type: ignore[index]


# --------------------------------------------------------------------------------------------
# Layering
# --------------------------------------------------------------------------------------------


def test_user_file_moves_softmax_from_infer_to_deny(tmp_path):
    path = write(tmp_path, '[deny]\nSoftmax = "our logits reach 1e5"\n')
    book = load_rules([path])
    entry = book.lookup("Softmax", opset=17)
    assert entry.category is Category.DENY
    assert entry.reason == "our logits reach 1e5"
    assert entry.source == "my_rules.toml: deny.Softmax"
    # the user entry replaced every built-in range of Softmax, not only the newest one
    assert book.category_of("Softmax", opset=11) is Category.DENY
    assert book.name == "onnx-cuda-fp16+my_rules"
    assert book.files == (str(RULES_DIR / "onnx-cuda-fp16.toml"), str(path))
    # everything else still comes from the built-in default
    assert book.category_of("MatMul", opset=17) is Category.ALLOW


def test_user_ranges_replace_builtin_ranges(tmp_path):
    path = write(tmp_path, '[clear.CumSum]\nreason = "we trust it"\nsince = 14\n')
    book = load_rules([path])
    assert book.category_of("CumSum", opset=14) is Category.CLEAR
    assert book.lookup("CumSum", opset=13) is None  # the built-in range below 14 is gone too
    assert book.category_of("CumSum", opset=13) is Category.UNLISTED


def test_later_files_win(tmp_path):
    first = write(tmp_path, '[deny]\nGelu = "first"\n', "first.toml")
    second = write(tmp_path, '[allow]\nGelu = "second"\n', "second.toml")
    book = load_rules([first, second])
    assert book.lookup("Gelu", opset=20).reason == "second"
    assert book.name == "onnx-cuda-fp16+first+second"


def test_replace_gives_a_standalone_set(tmp_path):
    path = write(
        tmp_path,
        '[ruleset]\nname = "tiny"\nreplace = true\n[allow]\nMatMul = "only this"\n'
        '[nodes]\nfp32 = ["head"]\n',
    )
    book = load_rules([path])
    assert book.name == "tiny"
    assert book.files == (str(path),)
    assert [e.op for e in book.entries()] == ["MatMul"]
    assert book.category_of("Add", opset=17) is Category.UNLISTED
    assert book.provider is None


def test_extends_chain_of_files(tmp_path):
    write(tmp_path, '[ruleset]\nreplace = true\n[deny]\nAdd = "base says deny"\n', "base.toml")
    middle = tmp_path / "sub"
    middle.mkdir()
    write(middle, '[ruleset]\nextends = "../base.toml"\n[infer]\nMul = "middle"\n', "middle.toml")
    top = write(tmp_path, '[ruleset]\nextends = "sub/middle.toml"\n[allow]\nMatMul = "top"\n', "top.toml")
    book = load_rules([top])
    assert book.name == "base+middle+top"
    assert book.category_of("Add") is Category.DENY
    assert book.category_of("Mul") is Category.INFER
    assert book.category_of("MatMul") is Category.ALLOW
    assert book.category_of("Sub") is Category.UNLISTED  # base replaced the built-in default


def test_extends_a_builtin_is_not_layered_twice(tmp_path):
    path = write(tmp_path, '[ruleset]\nextends = "onnx-cuda-fp16"\n[deny]\nGelu = "mine"\n')
    book = load_rules([path])
    assert book.name == "onnx-cuda-fp16+my_rules"
    assert book.category_of("Gelu", opset=20) is Category.DENY


def test_a_listed_file_applies_in_order_though_an_earlier_chain_brought_it(tmp_path):
    """``--rules a.toml --rules b.toml`` with a extending b: b was skipped as already in the stack,
    under a, so a's entry won although the files apply in order. The file a user lists applies at
    its place; a second file extending the same base still keeps the first file's entries."""
    base = write(tmp_path, '[deny]\nGelu = "base: deny"\n', "b.toml")
    a = write(tmp_path, '[ruleset]\nextends = "b.toml"\n[allow]\nGelu = "a: allow"\n', "a.toml")
    book = load_rules([a, base])
    assert book.name == "onnx-cuda-fp16+a+b"
    assert book.category_of("Gelu", opset=20) is Category.DENY
    assert load_rules([base, a]).category_of("Gelu", opset=20) is Category.ALLOW
    c = write(tmp_path, '[ruleset]\nextends = "b.toml"\n[infer]\nErf = "c"\n', "c.toml")
    both = load_rules([a, c])
    assert both.name == "onnx-cuda-fp16+b+a+c"
    assert both.category_of("Gelu", opset=20) is Category.ALLOW


def test_files_of_one_base_name_are_told_apart_by_path(tmp_path):
    """``--rules a/r.toml --rules b/r.toml``: every entry of both said it came from "r.toml", so a
    decision's reason could not say which file decided it. Such files are named by their paths."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = write(tmp_path / "a", '[deny]\nGelu = "a says"\n[nodes]\nfp32 = ["head"]\n', "r.toml")
    second = write(tmp_path / "b", '[deny]\nErf = "b says"\n', "r.toml")
    book = load_rules([first, second])
    assert book.lookup("Gelu", opset=20).source == f"{first}: deny.Gelu"
    assert book.lookup("Erf", opset=20).source == f"{second}: deny.Erf"
    assert [rule.source for rule in book.node_rules()] == [f"{first}: nodes.fp32"]
    assert book.file_and_key(book.lookup("Erf", opset=20)) == (str(second), "deny.Erf")
    one = load_rules([first])
    assert one.lookup("Gelu", opset=20).source == "r.toml: deny.Gelu"  # (a base name alone where it is unique)


def test_provider_comes_from_the_top_layer_that_sets_it(tmp_path):
    path = write(tmp_path, '[ruleset]\nprovider = "CPUExecutionProvider"\n')
    assert load_rules([path]).provider == "CPUExecutionProvider"


def test_provider_without_a_kernel_table_is_refused(tmp_path):
    path = write(tmp_path, '[ruleset]\nprovider = "CUDAExecutionProvidr"\n')
    with pytest.raises(RuleFileError) as caught:
        load_rules([path])
    assert caught.value.suggestion == "CUDAExecutionProvider"
    assert "ruleset.provider" in str(caught.value)


def test_a_provider_in_a_file_used_for_a_torch_rewrite_is_refused_without_a_frontend_key(tmp_path):
    """provider is ONNX only: a file saying frontend = "torch" was refused, but one that names no
    frontend was accepted for a torch rewrite and its provider dropped without a word."""
    path = write(tmp_path, '[ruleset]\nprovider = "CUDAExecutionProvider"\n[deny]\nsoftmax = "mine"\n')
    with pytest.raises(RuleFileError, match=r"ruleset\.provider: only ONNX rule sets name an execution provider"):
        load_rules([path], frontend="torch", target="fp16")
    onnx_file = write(tmp_path, '[ruleset]\nprovider = "CUDAExecutionProvider"\n', "onnx.toml")
    assert load_rules([onnx_file], frontend="onnx").provider == "CUDAExecutionProvider"


@pytest.mark.parametrize("frontend,custom,typo,right", [("onnx", "my.dom:Softmx", "Softmx", "Softmax"),
                                                        ("torch", "mylib:sofmax", "sofmax", "softmax")])
def test_a_custom_domain_op_below_does_not_make_its_bare_spelling_valid(tmp_path, frontend, custom, typo, right):
    """The extends chain's op names joined the default-domain vocabulary with their domain dropped:
    a typo spelt like a custom op below it was accepted and pinned nothing."""
    write(tmp_path, f'[deny]\n"{custom}" = "a custom op"\n', "base.toml")
    top = write(tmp_path, f'[ruleset]\nextends = "base.toml"\n[deny]\n{typo} = "typo"\n', "top.toml")
    with pytest.raises(RuleFileError) as caught:
        load_rules([top], frontend=frontend)
    assert caught.value.suggestion == right and f"deny.{typo}" in str(caught.value)


def test_a_single_path_is_accepted(tmp_path):
    path = write(tmp_path, '[deny]\nGelu = "one file, not a list"\n')
    assert load_rules(str(path)).category_of("Gelu", opset=20) is Category.DENY


def test_torch_user_file_and_custom_domain(tmp_path):
    path = write(
        tmp_path,
        '[ruleset]\nfrontend = "torch"\n[deny]\nlinear = "keep the head exact"\n'
        '[allow]\n"mylib:fused_rope" = "our own fused kernel"\n',
    )
    book = load_rules([path], frontend="torch")
    assert book.category_of("linear") is Category.DENY
    assert book.category_of("fused_rope", "mylib") is Category.ALLOW


# --------------------------------------------------------------------------------------------
# Node patterns
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "pattern,name,expected",
    [
        ("exact_node", "exact_node", True),
        ("exact_node", "exact_node_2", False),
        ("/decoder/*", "/decoder/layer.0/MatMul", True),
        ("/decoder/*", "/encoder/layer.0/MatMul", False),
        ("layer.?/add", "layer.3/add", True),
        ("Layer*", "layer1", False),  # globs are case-sensitive
        ("re:.*lm_head.*", "model/lm_head/MatMul", True),
        ("re:lm_head", "model/lm_head", False),  # fullmatch, not search
        ("re:layer\\.[0-3]\\..*", "layer.2.mlp", True),
        ("re:layer\\.[0-3]\\..*", "layer.4.mlp", False),
        # a torch node: <dotted module path>/<fx name>; a slash glob of the path names its submodules' nodes
        ("b1/*", "b1.fc/linear", True),
        ("b1/fc/*", "b1.fc/linear", True),
        ("b1/*", "b10.fc/linear", False),
        ("b1/*", "b2.fc/linear", False),
        ("b1.fc/*", "b1.fc/linear", True),
        # an ONNX name has slashes in its path: its dots stay dots ('layer/0' is not 'layer.0')
        ("/enc/layer/0/*", "/enc/layer.0/fc/MatMul", False),
        ("/enc/layer/*", "/enc/layer.1/fc/MatMul", False),
        ("/enc/layer.0/*", "/enc/layer.0/fc/MatMul", True),
    ],
)
def test_node_rule_matching(pattern, name, expected):
    assert NodeRule(pattern, Precision.FP32, "test").matches(name) is expected


def test_a_pattern_that_is_a_node_name_names_that_node_only():
    """README: node patterns are "exact first, then glob". 'layer[0]/mm' is the name of a node, so
    it pins that node; read also as a glob it pinned ``layer0/mm`` too."""
    import amp_rewrite

    m = make_model("""
        <ir_version: 9, opset_import: ["" : 17]>
        g (float[2,8] x) => (float[2,8] y) {
          a = MatMul(x, w)
          b = MatMul(a, w)
          y = MatMul(b, w)
        }""", {"w": (8, 8)})
    for node, name in zip(m.graph.node, ["layer[0]/mm", "layer0/mm", "last"]):
        node.name = name
    _, report = amp_rewrite.rewrite(m, report=True, fp32_nodes=["layer[0]/mm"])
    precision = {n["node"]: n["precision"] for n in report.to_dict()["nodes"]}
    assert precision == {"layer[0]/mm": "fp32", "layer0/mm": "fp16", "last": "fp16"}
    # a glob that is no node's name still globs
    _, report = amp_rewrite.rewrite(m, report=True, fp32_nodes=["layer?/mm"])
    assert {n["node"]: n["precision"] for n in report.to_dict()["nodes"]}["layer0/mm"] == "fp32"


def test_a_node_pinned_by_two_files_cites_the_later_one(tmp_path):
    """The later file is the upper layer: its rule is the one a decision quotes."""
    first = write(tmp_path, '[nodes]\nlow = ["n*"]\n', "first.toml")
    second = write(tmp_path, '[nodes]\nlow = ["n1"]\n', "second.toml")
    assert load_rules([first, second]).node_rule("n1").source == "second.toml: nodes.low"
    assert load_rules([second, first]).node_rule("n1").source == "first.toml: nodes.low"


def test_a_node_the_command_line_pins_as_a_file_does_cites_the_command_line(tmp_path):
    """Command-line node rules sit above every file's: a node pinned both by a file and by
    --fp16-nodes (or --fp32-nodes) quotes the flag."""
    path = write(tmp_path, '[nodes]\nlow = ["n1"]\nfp32 = ["n2"]\n', "pins.toml")
    book = load_rules([path], low_nodes=["n1"], fp32_nodes=["n2"])
    assert (book.node_rule("n1").precision, book.node_rule("n1").source) == (Precision.LOW, "--fp16-nodes")
    assert (book.node_rule("n2").precision, book.node_rule("n2").source) == (Precision.FP32, "--fp32-nodes")
    assert load_rules([path]).node_rule("n1").source == "pins.toml: nodes.low"


def test_fp32_node_rules_win_over_low(tmp_path):
    path = write(tmp_path, '[nodes]\nlow = ["/decoder/*"]\nfp32 = ["re:.*/softmax.*"]\n')
    book = load_rules([path])
    assert book.node_rule("/decoder/attn/softmax_1").precision is Precision.FP32
    assert book.node_rule("/decoder/attn/matmul").precision is Precision.LOW
    assert book.node_rule("/encoder/attn/matmul") is None
    assert book.node_rule("/decoder/attn/matmul").source == "my_rules.toml: nodes.low"


def test_node_rules_accumulate_across_layers_and_cli(tmp_path):
    first = write(tmp_path, '[nodes]\nfp32 = ["a"]\n', "first.toml")
    second = write(tmp_path, '[nodes]\nlow = ["b"]\n', "second.toml")
    book = load_rules([first, second], fp32_nodes=["c*"], low_nodes=["a"])
    assert book.node_rule("a").precision is Precision.FP32  # fp32 wins over the CLI's low
    assert book.node_rule("b").precision is Precision.LOW
    rule = book.node_rule("c1")
    assert (rule.precision, rule.source) == (Precision.FP32, "--fp32-nodes")


# --------------------------------------------------------------------------------------------
# Command-line overrides
# --------------------------------------------------------------------------------------------


def test_cli_ops_override_every_file(tmp_path):
    path = write(tmp_path, '[allow]\nGelu = "file"\n')
    book = load_rules([path], fp32_ops=["Gelu", "com.microsoft:FastGelu"], low_ops=["Softmax"])
    gelu = book.lookup("Gelu", opset=20)
    assert gelu.category is Category.DENY
    assert (gelu.reason, gelu.source) == ("command line: --fp32-ops", "--fp32-ops")
    assert book.category_of("FastGelu", "com.microsoft") is Category.DENY
    assert book.category_of("Softmax", opset=13) is Category.ALLOW
    assert book.lookup("Softmax").reason == "command line: --fp16-ops"


def test_cli_unknown_op_suggests_the_closest():
    with pytest.raises(UsageError, match="ReduceMean"):
        load_rules(fp32_ops=["ReduceMaen"])


def test_cli_op_in_both_lists_is_an_error():
    with pytest.raises(UsageError, match="Softmax"):
        load_rules(fp32_ops=["Softmax"], low_ops=["Softmax"])


@pytest.mark.parametrize("fp32, low", [("Softmax", "ai.onnx:Softmax"), (":Softmax", "Softmax")])
def test_cli_op_in_both_lists_under_two_spellings_is_an_error(fp32, low):
    """The check compared the raw strings: --fp32-ops Softmax --fp16-ops ai.onnx:Softmax passed and
    the low entry won, silently."""
    with pytest.raises(UsageError, match=r"name the same op in both --fp32-ops and --fp16-ops"):
        load_rules(fp32_ops=[fp32], low_ops=[low])


def test_cli_op_with_two_domain_separators_is_an_error():
    with pytest.raises(UsageError, match=r"'a:b:Softmax' is not an op: write OP or DOMAIN:OP"):
        load_rules(fp32_ops=["a:b:Softmax"])


def test_cli_misspelt_op_of_a_known_domain_is_an_error_and_a_users_own_domain_is_not():
    with pytest.raises(UsageError, match=r"unknown onnx op 'com.microsoft:FastGeluu' \(did you mean "
                                         r"'com.microsoft:FastGelu'\?\)"):
        load_rules(fp32_ops=["com.microsoft:FastGeluu"])
    load_rules(fp32_ops=["com.microsoft:FastGelu", "my.domain:Anything"])


@pytest.mark.parametrize("op, meant", [("FusedMatMul", "com.microsoft:FusedMatMul"),
                                        ("skiplayernormalization", "com.microsoft:SkipLayerNormalization"),
                                        ("MultiHeadAttention", "com.microsoft:MultiHeadAttention"),
                                        ("LabelEncoder", "ai.onnx.ml:LabelEncoder"),
                                        ("com.microsoft:Relu", "Relu")])
def test_an_op_named_without_its_domain_is_told_the_domain_not_a_lookalike(tmp_path, op, meant):
    """onnxruntime's optimizer output names com.microsoft ops in op_type alone: 'FusedMatMul' got
    "did you mean 'MatMul'?" (following it pinned every MatMul), 'MultiHeadAttention'
    'LinearAttention', and ai.onnx.ml's 'LabelEncoder' no hint at all."""
    with pytest.raises(UsageError, match=rf"\(did you mean '{re.escape(meant)}'\?\)"):
        load_rules(fp32_ops=[op])
    table, _, key = op.rpartition(":")
    entry = f'"{op}"' if table else op
    with pytest.raises(RuleFileError, match=rf"deny\.{re.escape(op)}: .*\(did you mean '{re.escape(meant)}'\?\)"):
        load_rules([write(tmp_path, f'[deny]\n{entry} = "keep it FP32"\n')])


def test_cli_bad_regex_is_an_error():
    with pytest.raises(UsageError, match="--fp32-nodes"):
        load_rules(fp32_nodes=["re:(unclosed"])


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------

BAD_FILES = [
    ("unknown table", '[alow]\nMatMul = "x"\n', "alow", "allow"),
    ("unknown ONNX op", '[deny]\nReduceMaen = "x"\n', "deny.ReduceMaen", "ReduceMean"),
    # (com.microsoft's ops are known too: a misspelt one pinned nothing, silently)
    ("unknown com.microsoft op", '[deny]\n"com.microsoft:FastGeluu" = "x"\n', "deny.com.microsoft:FastGeluu",
     "com.microsoft:FastGelu"),  # (as the key is written: a bare FastGelu is another, unknown op)
    ("unknown entry key", '[deny.CumSum]\nreson = "x"\n', "deny.CumSum.reson", "reason"),
    ("unknown ruleset key", '[ruleset]\nextnds = "onnx-cuda-fp16"\n', "ruleset.extnds", "extends"),
    ("unknown nodes key", '[nodes]\nfp23 = ["a"]\n', "nodes.fp23", "fp32"),
    ("unknown frontend", '[ruleset]\nfrontend = "onxx"\n', "ruleset.frontend", "onnx"),
    ("unknown target", '[ruleset]\ntarget = "fp61"\n', "ruleset.target", "fp16"),
    ("missing builtin", '[ruleset]\nextends = "onnx-cuda-fp61"\n', "ruleset.extends", "onnx-cuda-fp16"),
    # a value or key in the wrong case is told its spelling (difflib alone scores 'FP16' against 'fp16' too low)
    ("key in capitals", '[ruleset]\nEXTENDS = "onnx-cuda-fp16"\n', "ruleset.EXTENDS", "extends"),
    ("target in capitals", '[ruleset]\ntarget = "FP16"\n', "ruleset.target", "fp16"),
    (
        "array entry key",
        '[[deny.Range]]\nreason = "a"\nuntil = 3\n[[deny.Range]]\nreasn = "b"\n',
        "deny.Range[1].reasn",
        "reason",
    ),
]


@pytest.mark.parametrize("what,text,key,suggestion", BAD_FILES, ids=[b[0] for b in BAD_FILES])
def test_errors_name_file_key_and_suggestion(tmp_path, what, text, key, suggestion):
    path = write(tmp_path, text)
    with pytest.raises(RuleFileError) as caught:
        load_rules([path])
    message = str(caught.value)
    assert str(path) in message
    assert key in message
    assert caught.value.suggestion == suggestion
    assert repr(suggestion) in message
    assert caught.value.exit_code == 4


BAD_VALUES = [
    ("missing reason", "[deny.Exp]\nsince = 3\n", "deny.Exp.reason", "missing"),
    ("empty reason", '[deny]\nExp = "   "\n', "deny.Exp.reason", "empty"),
    ("since after until", '[deny.Exp]\nreason = "x"\nsince = 14\nuntil = 13\n', "deny.Exp", "greater than"),
    ("string opset", '[deny.Exp]\nreason = "x"\nsince = "13"\n', "deny.Exp.since", "integer"),
    ("bool opset", '[deny.Exp]\nreason = "x"\nuntil = true\n', "deny.Exp.until", "integer"),
    ("zero opset", '[deny.Exp]\nreason = "x"\nsince = 0\n', "deny.Exp.since", ">= 1"),
    ("fp32_inputs not a list", '[clear.Resize]\nreason = "x"\nfp32_inputs = "roi"\n', "clear.Resize.fp32_inputs", "list"),
    ("negative input index", '[clear.Resize]\nreason = "x"\nfp32_inputs = [-1]\n', "clear.Resize.fp32_inputs", "-1"),
    (
        "accumulates not bool",
        '[infer.Softmax]\nreason = "x"\naccumulates_fp32 = "yes"\n',
        "infer.Softmax.accumulates_fp32",
        "true or false",
    ),
    ("entry not a string", "[deny]\nExp = 3\n", "deny.Exp", "reason string or a table"),
    ("list not a table", 'deny = "Exp"\n', "deny", "table"),
    ("replace not bool", "[ruleset]\nreplace = 1\n", "ruleset.replace", "true or false"),
    ("nodes not a list", '[nodes]\nfp32 = "a"\n', "nodes.fp32", "list"),
    ("bad regex", '[nodes]\nfp32 = ["re:(unclosed"]\n', "nodes.fp32", "regular expression"),
    ("malformed op key", '[deny]\n"a:b:c" = "x"\n', "deny.a:b:c", "malformed"),
    ("target mismatch", '[ruleset]\ntarget = "bf16"\n', "ruleset.target", "asks for 'fp16'"),
    ("torch provider", '[ruleset]\nfrontend = "torch"\nprovider = "CUDA"\n', "ruleset.provider", "ONNX"),
    # an unquoted domain op: TOML made tables of its dots, and the error said only "unknown key"
    # a [ruleset] key written above every header is a top-level key: say where it belongs
    ("ruleset key above its header", 'extends = "onnx-cuda-fp16"\n', "extends", "under a [ruleset] header"),
    ("dotted domain op", '[deny]\ncom.microsoft.Attention = "x"\n', "deny.com.microsoft", '"com.microsoft:Attention"'),
    ("dotted domain table", '[deny.com.microsoft.Attention]\nreason = "x"\n', "deny.com.microsoft",
     '"com.microsoft:Attention"'),
]


@pytest.mark.parametrize("what,text,key,problem", BAD_VALUES, ids=[b[0] for b in BAD_VALUES])
def test_bad_values(tmp_path, what, text, key, problem):
    path = write(tmp_path, text)
    frontend = "torch" if "torch" in what else "onnx"
    with pytest.raises(RuleFileError) as caught:
        load_rules([path], frontend=frontend)
    message = str(caught.value)
    assert str(path) in message
    assert f": {key}: " in message
    assert problem in message


def test_overlapping_ranges_in_one_file(tmp_path):
    path = write(tmp_path, '[infer]\nSoftmax = "a"\n[deny.Softmax]\nreason = "b"\nsince = 13\n')
    with pytest.raises(RuleFileError) as caught:
        load_rules([path])
    message = str(caught.value)
    assert str(path) in message and "Softmax" in message and "overlapping" in message
    assert "[infer]" in message


def test_same_op_twice_via_domain_alias(tmp_path):
    path = write(tmp_path, '[deny]\nExp = "a"\n"ai.onnx:Exp" = "b"\n')
    with pytest.raises(RuleFileError, match="overlapping"):
        load_rules([path])


def test_ranges_sharing_one_opset_overlap(tmp_path):
    """``until = 13`` and ``since = 13`` both cover opset 13 (the bounds are inclusive): the two
    entries overlap there and the file is refused, rather than the first entry winning at 13."""
    path = write(tmp_path, '[[deny.Softmax]]\nreason = "old"\nuntil = 13\n[[allow.Softmax]]\nreason = "new"\nsince = 13\n')
    with pytest.raises(RuleFileError) as caught:
        load_rules([path])
    message = str(caught.value)
    assert "Softmax" in message and "overlapping" in message


def test_a_range_of_one_opset_is_accepted(tmp_path):
    """``since = until`` names one opset (the bounds are inclusive): the entry loads and applies at
    that opset only."""
    path = write(tmp_path, '[[deny.Softmax]]\nreason = "only at 13"\nsince = 13\nuntil = 13\n')
    book = load_rules([path])
    entry = book.lookup("Softmax", "", 13)
    assert (entry.category, entry.since, entry.until) == (Category.DENY, 13, 13)
    assert book.lookup("Softmax", "", 12) is None and book.lookup("Softmax", "", 14) is None


def test_disjoint_ranges_in_two_lists_are_fine(tmp_path):
    path = write(
        tmp_path,
        '[deny.CumSum]\nreason = "no kernel"\nuntil = 13\n[clear.CumSum]\nreason = "fine"\nsince = 14\n',
    )
    book = load_rules([path])
    assert book.category_of("CumSum", opset=13) is Category.DENY
    assert book.category_of("CumSum", opset=14) is Category.CLEAR


def test_toml_syntax_error_names_the_line(tmp_path):
    path = write(tmp_path, '[deny]\nExp = "ok"\nLog = \n')
    with pytest.raises(RuleFileError) as caught:
        load_rules([path])
    message = str(caught.value)
    assert str(path) in message
    assert "line 3" in message and "syntax" in message


def test_values_nested_too_deeply_are_a_rule_file_error(tmp_path):
    """tomllib parses nested arrays recursively: 3000 levels raised RecursionError, which the CLI
    reported as an internal error (exit 70) instead of a bad rule file (exit 4)."""
    path = write(tmp_path, "[deny]\nExp = " + "[" * 3000 + "]" * 3000 + "\n")
    with pytest.raises(RuleFileError, match="nested too deeply") as caught:
        load_rules([path])
    assert str(path) in str(caught.value)


def test_missing_file(tmp_path):
    path = tmp_path / "nope.toml"
    with pytest.raises(RuleFileError) as caught:
        load_rules([path])
    assert str(path) in str(caught.value) and "not found" in str(caught.value)


def test_directory_instead_of_file(tmp_path):
    with pytest.raises(RuleFileError, match="directory"):
        load_rules([tmp_path])


def test_extends_missing_file(tmp_path):
    path = write(tmp_path, '[ruleset]\nextends = "missing.toml"\n')
    with pytest.raises(RuleFileError) as caught:
        load_rules([path])
    assert "ruleset.extends" in str(caught.value) and "missing.toml" in str(caught.value)


def test_extends_cycle(tmp_path):
    write(tmp_path, '[ruleset]\nextends = "b.toml"\n', "a.toml")
    write(tmp_path, '[ruleset]\nextends = "a.toml"\n', "b.toml")
    with pytest.raises(RuleFileError, match=r"cycle: .*own extends chain \(a\.toml -> b\.toml -> a\.toml\)"):
        load_rules([tmp_path / "a.toml"])  # (it said "this file extends itself": neither does)
    write(tmp_path, '[ruleset]\nextends = "c.toml"\n', "c.toml")
    with pytest.raises(RuleFileError, match="this file extends itself"):
        load_rules([tmp_path / "c.toml"])


def test_an_error_in_an_extended_file_says_how_it_was_reached(tmp_path):
    top = write(tmp_path, '[ruleset]\nextends = "mid.toml"\n', "top.toml")
    write(tmp_path, '[ruleset]\nextends = "base.toml"\n', "mid.toml")
    write(tmp_path, '[ruleset]\ntarget = "bf16"\n[allow]\nMatMul = "x"\n', "base.toml")
    with pytest.raises(RuleFileError) as caught:
        load_rules([top], target="fp16")
    # the user named top.toml: the message names the failing file and the chain that reached it
    assert str(caught.value).startswith(str(tmp_path / "base.toml") + ": ruleset.target:")
    assert f"(reached through {tmp_path / 'mid.toml'}: ruleset.extends)" in str(caught.value)
    write(tmp_path, '[ruleset]\n[allow]\nMatMull = "x"\n', "base.toml")
    with pytest.raises(RuleFileError, match=r"allow\.MatMull: .*\(did you mean 'MatMul'\?\) \(reached through "):
        load_rules([top])


def test_a_file_that_is_not_a_regular_file_is_not_called_missing():
    with pytest.raises(RuleFileError, match="/dev/null: .*is not a regular file"):
        load_rules(["/dev/null"])


def test_extending_a_builtin_for_another_target(tmp_path):
    path = write(tmp_path, '[ruleset]\nextends = "onnx-cuda-bf16"\n')
    with pytest.raises(RuleFileError, match="bf16"):
        load_rules([path], target="fp16")


def test_unknown_torch_op_suggests_the_closest(tmp_path):
    path = write(tmp_path, '[ruleset]\nfrontend = "torch"\n[deny]\nlienar = "x"\n')
    with pytest.raises(RuleFileError) as caught:
        load_rules([path], frontend="torch")
    assert caught.value.suggestion == "linear"
    assert "deny.lienar" in str(caught.value)


def test_custom_domains_are_not_validated(tmp_path):
    path = write(tmp_path, '[allow]\n"com.example:MyGemm" = "our own GEMM kernel"\n')
    assert load_rules([path]).category_of("MyGemm", "com.example") is Category.ALLOW


def test_an_op_spelt_as_the_summary_spells_it_is_read(tmp_path):
    """The summary lists an unlisted custom op as 'mydom::Foo' and says to classify it in a rule
    file; pasted there, it was a 'malformed op name'."""
    path = write(tmp_path, '[infer]\n"com.example::MyOp" = "as the summary spells it"\n')
    assert load_rules([path]).category_of("MyOp", "com.example") is Category.INFER
    with pytest.raises(RuleFileError, match="malformed op name"):
        load_rules([write(tmp_path, '[infer]\n"a::b::MyOp" = "two separators"\n', "bad.toml")])


def test_an_op_flag_spelt_as_the_summary_spells_it_is_read():
    """``--fp32-ops com.microsoft::FusedMatMul`` (the summary's spelling) names the op in that domain,
    as ``com.microsoft:FusedMatMul`` does."""
    for name in ("com.microsoft::FusedMatMul", "com.microsoft:FusedMatMul"):
        assert load_rules(fp32_ops=[name]).category_of("FusedMatMul", "com.microsoft") is Category.DENY


def test_onnx_function_ops_without_kernels_are_known(tmp_path):
    path = write(tmp_path, '[infer]\nSoftmaxCrossEntropyLoss = "testing"\n')
    assert load_rules([path]).category_of("SoftmaxCrossEntropyLoss") is Category.INFER


# --------------------------------------------------------------------------------------------
# Documentation and dependencies
# --------------------------------------------------------------------------------------------


def _readme_toml_blocks() -> list[str]:
    text = (RULES_DIR / "README.md").read_text(encoding="utf-8")
    return re.findall(r"```toml\n(.*?)```", text, flags=re.S)


def test_readme_examples_are_valid_rule_files(tmp_path):
    blocks = _readme_toml_blocks()
    assert len(blocks) >= 3
    for index, block in enumerate(blocks):
        path = write(tmp_path, block, f"example{index}.toml")
        assert load_rules([path]).entries(), f"README example {index} did not load"


@pytest.mark.parametrize("module", ["rulebook.py", "kernels.py"])
def test_no_heavy_imports(module):
    """Rules are configuration: reading them must not need onnx, onnxruntime or torch."""
    source = (Path(__file__).resolve().parent.parent / "amp_rewrite" / module).read_text(encoding="utf-8")
    imported: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            imported.add(node.module.split(".")[0])
    assert not imported & {"onnx", "onnxruntime", "onnx_ir", "torch", "numpy"}, imported


def test_rule_entry_covers():
    entry = RuleEntry("CumSum", "", Category.DENY, "r", "s", since=11, until=13)
    assert [entry.covers(o) for o in (10, 11, 13, 14)] == [False, True, True, False]
    assert RuleEntry("X", "", Category.DENY, "r", "s").covers(1)


def test_bounded_output_only_on_deny_entries(tmp_path):
    f = tmp_path / "r.toml"
    f.write_text('[infer]\nAdd = { reason = "x", bounded_output = true }\n')
    with pytest.raises(RuleFileError) as err:
        load_rules([str(f)], frontend="onnx", target="fp16")
    assert "infer.Add.bounded_output" in str(err.value) and str(f) in str(err.value)


def test_fp32_argument_only_on_deny_entries_and_set_on_the_trig_ops(tmp_path):
    f = tmp_path / "r.toml"
    f.write_text('[clear]\nTranspose = { reason = "x", fp32_argument = true }\n')
    with pytest.raises(RuleFileError) as err:
        load_rules([str(f)], frontend="onnx", target="fp16")
    assert "clear.Transpose.fp32_argument" in str(err.value) and "deny" in str(err.value)
    for frontend, target, ops in (("onnx", "fp16", ("Sin", "Cos")), ("onnx", "bf16", ("Sin", "Cos")),
                                  ("torch", "fp16", ("sin", "cos")), ("torch", "bf16", ("sin", "cos"))):
        book = load_rules([], frontend=frontend, target=target)
        assert all(book.lookup(op, "", 17).fp32_argument for op in ops), (frontend, target)


@pytest.mark.parametrize("key", [":Softmax", "ai.onnx:Softmax", "Softmax"])
def test_rule_files_read_op_names_as_the_command_line_does(tmp_path, key):
    """``--fp32-ops :Softmax`` (an empty domain: the default one) was accepted while the same key
    in a rule file was refused as malformed; every spelling the command line takes now loads."""
    path = write(tmp_path, f'[deny]\n"{key}" = "kept FP32 here"\n')
    from_file = load_rules([path], frontend="onnx")
    from_cli = load_rules(fp32_ops=[key])
    for book in (from_file, from_cli):
        assert book.category_of("Softmax", "", 17) == Category.DENY


@pytest.mark.parametrize("provider,clip", [("", "bf16"), ('provider = "CUDAExecutionProvider"\n', "fp32")])
def test_a_stand_alone_set_checks_kernels_only_against_a_provider_it_names(tmp_path, provider, clip):
    """rules/README.md (replace): a stand-alone set drops the default's provider; CUDA has no bf16
    Clip at opset 17, which only a set naming the provider keeps FP32."""
    import numpy as np
    import onnx
    from onnx import TensorProto as T
    from onnx import helper as h

    from amp_rewrite import rewrite

    rules = write(tmp_path, f'[ruleset]\nreplace = true\n{provider}[allow]\nMatMul = "x"\nClip = "y"\n')
    graph = h.make_graph([h.make_node("MatMul", ["x", "w"], ["a"]), h.make_node("Clip", ["a"], ["b"]),
                          h.make_node("MatMul", ["b", "w"], ["y"])], "g",
                         [h.make_tensor_value_info("x", T.FLOAT, [2, 8])], [h.make_tensor_value_info("y", T.FLOAT, [2, 8])],
                         initializer=[onnx.numpy_helper.from_array(np.ones((8, 8), np.float32), "w")])
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)], ir_version=8)
    _, report = rewrite(model, target="bf16", rules=[rules], report=True)
    assert {n["node"]: n["precision"] for n in report.to_dict()["nodes"]} == {"MatMul:a": "bf16", "Clip:b": clip,
                                                                              "MatMul:y": "bf16"}


@pytest.mark.parametrize("name", ["plain.toml", "my: rules.toml"])
def test_a_rule_files_pin_survives_a_rewrite_of_the_output_whatever_its_file_name(tmp_path, name):
    """A decision's source is "<file>: <list>.<op>": split at the first ": ", a file named
    'my: rules.toml' left the key 'rules.toml: deny.Relu', which named no list, so its pin read as a
    built-in rule's and a rewrite of the output without the file made the Relu low."""
    from util import rewrite

    model = make_model("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[2,8] x) => (float[2,8] y) {
      a = MatMul(x, w0)
      b = Relu(a)
      y = MatMul(b, w1)
    }""", {"w0": (8, 8), "w1": (8, 8)})
    rules = tmp_path / name
    rules.write_text('[deny]\nRelu = "keep it FP32"\n')
    first = rewrite(model, rules=[rules], fp32_nodes=["MatMul:a", "MatMul:y"])
    assert first.log.decisions["Relu:b"].precision == Precision.FP32
    again = rewrite(first.model, fp16_nodes=["MatMul:a", "MatMul:y"])
    assert again.log.decisions["Relu:b"].precision == Precision.FP32, again.log.decisions["Relu:b"].reason
