"""The kernel table query module, and the built-in ONNX rule sets checked against it.

The hard requirement: a built-in ONNX rule set never puts an op in low precision at an opset where
onnxruntime's CUDA provider has a float kernel for it but no kernel in the target type. Otherwise
the rewritten model fails to load, or the node silently falls back to another provider.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from amp_rewrite import kernels
from amp_rewrite.decisions import Category
from amp_rewrite.rulebook import RuleEntry, load_rules

CUDA = "CUDAExecutionProvider"
CPU = "CPUExecutionProvider"
OPSETS = range(7, 27)
CUSTOM_DOMAIN_OPSETS = (1,)  # com.microsoft has a single opset version
LOW = (Category.ALLOW, Category.INFER, Category.CLEAR)
TARGET_DTYPE = {"fp16": "float16", "bf16": "bfloat16"}
SHARED_QUERY = Path("/work/shared/data/ort_kernels_query.py")


# --------------------------------------------------------------------------------------------
# kernels.py
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "op,opset,dtype,expected",
    [
        ("Softmax", 13, "bfloat16", True),
        ("Softmax", 12, "bfloat16", False),
        ("CumSum", 13, "float16", False),
        ("CumSum", 14, "float16", True),
        ("CumSum", 14, "bfloat16", False),
        ("GridSample", 20, "float", True),
        ("GridSample", 20, "float16", False),
        ("Range", 21, "float16", False),
        ("EyeLike", 17, "float16", False),
        ("TopK", 23, "bfloat16", False),
        ("TopK", 24, "bfloat16", True),
        ("RoiAlign", 15, "float16", False),
        ("RoiAlign", 16, "float16", True),
        ("Resize", 19, "float16", True),
        ("Resize", 19, "bfloat16", False),
        ("NonMaxSuppression", 11, "float", True),  # untyped kernel: types come from the schema
        ("Celu", 17, "float", False),  # CPU-only op
    ],
)
def test_has_kernel_cuda(op, opset, dtype, expected):
    assert kernels.has_kernel(CUDA, op, opset, dtype) is expected


def test_domain_and_provider_spellings():
    assert kernels.has_kernel("cuda", "Softmax", 13, "float16")
    assert kernels.has_kernel(CUDA, "Softmax", 13, "float16", domain="ai.onnx")
    assert kernels.has_kernel(CUDA, "Attention", 1, "float16", domain="com.microsoft")
    assert not kernels.has_kernel(CUDA, "Attention", 1, "float16", domain="")  # ai.onnx Attention is 23+
    assert not kernels.has_kernel(CUDA, "NoSuchOp", 13, "float")
    with pytest.raises(KeyError, match="unknown execution provider"):
        kernels.has_kernel("TPUExecutionProvider", "Softmax", 13, "float")
    assert kernels.knows_provider("cuda") and kernels.knows_provider(CPU)
    assert not kernels.knows_provider("TPUExecutionProvider")


def test_overlapping_rows_are_unioned():
    """CUDA ThresholdedRelu has two rows (1+ and 10+) covering opset 10: both count."""
    rows = kernels.kernel_rows(CUDA, "ThresholdedRelu", 10)
    assert len(rows) >= 2
    union = {t for row in rows for types in row["type_constraints"].values() for t in types}
    assert kernels.kernel_types(CUDA, "ThresholdedRelu", 10) == frozenset(union)


def test_op_has_float_kernel_and_gap():
    assert kernels.op_has_float_kernel(CUDA, "GridSample", 20)
    assert kernels.low_precision_gap(CUDA, "GridSample", 20, "float16")
    assert not kernels.low_precision_gap(CUDA, "MatMul", 17, "float16")
    assert not kernels.op_has_float_kernel(CUDA, "Celu", 17)  # no CUDA kernel at all
    assert kernels.op_has_float_kernel(CPU, "Celu", 17)


def test_known_ops():
    onnx_ops = kernels.known_ops()
    assert {"MatMul", "Softmax", "ReduceMean", "Celu", "LayerNormalization"} <= onnx_ops
    assert "MatMull" not in onnx_ops
    assert kernels.known_ops("ai.onnx") == onnx_ops
    assert {"Attention", "SkipLayerNormalization"} <= kernels.known_ops("com.microsoft")
    onnx_ops.add("Mutated")  # callers get a copy
    assert "Mutated" not in kernels.known_ops()


def test_schema_allows_tells_spec_limits_from_gaps():
    assert kernels.schema_allows("CumSum", 13, "float16") is False  # spec limit
    assert kernels.schema_allows("CumSum", 14, "float16") is True
    assert kernels.schema_allows("EyeLike", 17, "float16") is True  # an EP gap
    assert kernels.schema_allows("NoSuchOp", 17, "float16") is None


@pytest.mark.skipif(not SHARED_QUERY.is_file(), reason="shared query script not available")
def test_agrees_with_the_shared_query_script():
    spec = importlib.util.spec_from_file_location("ort_kernels_query", SHARED_QUERY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for provider in (CUDA, CPU):
        for op in sorted(kernels.known_ops()):
            for opset in (7, 11, 13, 17, 18, 21, 24):
                for dtype in ("float", "float16", "bfloat16"):
                    ours = kernels.has_kernel(provider, op, opset, dtype)
                    theirs = module.has_kernel(provider, op, opset, dtype, "ai.onnx")
                    assert ours == theirs, (provider, op, opset, dtype)


# --------------------------------------------------------------------------------------------
# The ONNX rule sets against the CUDA kernel table
# --------------------------------------------------------------------------------------------


def _opsets(entry: RuleEntry) -> list[int]:
    candidates = CUSTOM_DOMAIN_OPSETS if entry.domain else OPSETS
    return [opset for opset in candidates if entry.covers(opset)]


def _low_entries(target: str) -> list[RuleEntry]:
    return [entry for entry in load_rules(target=target).entries() if entry.category in LOW]


@pytest.mark.parametrize("target", ["fp16", "bf16"])
def test_low_entries_have_cuda_kernels_in_the_target_type(target):
    dtype = TARGET_DTYPE[target]
    violations = [
        f"{entry.source} at opset {opset}"
        for entry in _low_entries(target)
        for opset in _opsets(entry)
        if kernels.low_precision_gap(CUDA, entry.op, opset, dtype, entry.domain)
    ]
    assert not violations, f"low precision without a CUDA {dtype} kernel: {violations}"


@pytest.mark.parametrize("target", ["fp16", "bf16"])
def test_low_entries_survive_the_cpu_fallback(target):
    """Where CUDA has no kernel at all, onnxruntime places the node on CPU: that kernel must take
    the target type too (CPU Resize, OneHot before 11, ... are float-only)."""
    dtype = TARGET_DTYPE[target]
    violations = [
        f"{entry.source} at opset {opset}"
        for entry in _low_entries(target)
        for opset in _opsets(entry)
        if not kernels.kernel_rows(CUDA, entry.op, opset, entry.domain)
        and kernels.low_precision_gap(CPU, entry.op, opset, dtype, entry.domain)
    ]
    assert not violations, f"low precision on a float-only CPU fallback: {violations}"


@pytest.mark.parametrize("target", ["fp16", "bf16"])
def test_kernel_check_can_fail(target):
    """The check above is not vacuous: the gaps it guards against exist in the table."""
    dtype = TARGET_DTYPE[target]
    assert kernels.low_precision_gap(CUDA, "GridSample", 20, dtype)
    fake = RuleEntry("GridSample", "", Category.INFER, "test", "test")
    assert any(kernels.low_precision_gap(CUDA, fake.op, o, dtype) for o in _opsets(fake))


@pytest.mark.parametrize("target", ["fp16", "bf16"])
def test_ranges_are_split_where_the_table_requires(target):
    book = load_rules(target=target)
    if target == "fp16":
        assert book.category_of("CumSum", opset=13) is Category.DENY
        assert book.category_of("Clip", opset=11) is Category.DENY
        assert book.category_of("Clip", opset=12) is Category.INFER
        assert book.category_of("RoiAlign", opset=16) is Category.DENY  # coordinates, kernel or not
    else:
        assert book.category_of("MatMul", opset=12) is Category.DENY
        assert book.category_of("MatMul", opset=13) is Category.ALLOW
        assert book.category_of("Conv", opset=21) is Category.DENY
        assert book.category_of("Conv", opset=22) is Category.ALLOW
        assert book.category_of("TopK", opset=23) is Category.DENY
        assert book.category_of("TopK", opset=24) is Category.CLEAR
        assert book.category_of("Resize", opset=19) is Category.DENY
        assert "no bfloat16" in book.lookup("Resize", opset=19).reason


def test_bf16_denies_an_op_fp16_runs_low_only_for_a_missing_kernel():
    """bf16 has FP32's range: an op the fp16 set runs low is denied in bf16 only where the CUDA
    provider has no bfloat16 kernel for it, or for a reason bf16's 8-bit mantissa gives (listed
    here). GatherBlockQuantized was filed under [deny] with its infer reason, and its kernel takes
    bfloat16: FP32 for nothing, and --explain said it was low where its readers are."""
    precision_only = set()  # (none yet: add an op here with the reason its entry gives)
    fp16, bf16 = load_rules(target="fp16"), load_rules(target="bf16")
    wrong = []
    for entry in bf16.entries():
        if entry.category is not Category.DENY:
            continue
        for opset in _opsets(entry):
            low16 = fp16.category_of(entry.op, entry.domain, opset=opset) in LOW
            if low16 and kernels.has_kernel(CUDA, entry.op, opset, "bfloat16", entry.domain) \
                    and entry.op not in precision_only:
                wrong.append(f"{entry.source} at opset {opset}")
    assert not wrong, f"denied in bf16 though fp16 runs it low and a bfloat16 kernel exists: {wrong}"


@pytest.mark.parametrize("op", ["GridSample", "EyeLike", "Range"])
@pytest.mark.parametrize("target", ["fp16", "bf16"])
def test_float_only_ops_are_never_low(op, target):
    book = load_rules(target=target)
    for opset in OPSETS:
        assert book.category_of(op, opset=opset) is Category.DENY, (op, opset)
    # and no other spelling of them is low in any built-in set
    for frontend in ("onnx", "torch"):
        for entry in load_rules(frontend=frontend, target=target).entries():
            if entry.op.lower() in {"gridsample", "grid_sampler", "eyelike", "range", "arange"}:
                assert entry.category is Category.DENY, entry


def test_ops_float_only_at_every_opset_are_deny():
    """Any ai.onnx op whose CUDA kernels never take fp16 is deny wherever the fp16 set names it."""
    book = load_rules()
    for entry in book.entries():
        if entry.domain or entry.category not in LOW:
            continue
        opsets = [o for o in _opsets(entry) if kernels.op_has_float_kernel(CUDA, entry.op, o)]
        assert not opsets or any(kernels.has_kernel(CUDA, entry.op, o, "float16") for o in opsets), entry


def test_fp32_ops_on_the_command_line_make_matmul_deny():
    book = load_rules(fp32_ops=["MatMul"])
    for opset in (7, 13, 17, 21):
        entry = book.lookup("MatMul", opset=opset)
        assert entry.category is Category.DENY
        assert entry.reason == "command line: --fp32-ops"
    assert load_rules().category_of("MatMul", opset=17) is Category.ALLOW  # the default is untouched


def test_low_ops_on_the_command_line_make_an_op_allow():
    book = load_rules(low_ops=["ReduceMean"])
    assert book.category_of("ReduceMean", opset=18) is Category.ALLOW
    assert book.lookup("ReduceMean").source == "--fp16-ops"


@pytest.mark.parametrize("opset", [14, 15, 17])
def test_batchnorm_statistics_take_the_type_of_x(opset):
    """onnxruntime's CUDA BatchNormalization kernels are registered with U = T (opset 14) and
    T1 = T2 = T (15+) only, which the kernel table (one type list per constraint) cannot show: a BN
    with FP16 X beside FP32 scale and statistics ran on the CPU with copies around it (seen on an
    H100 at opset 17: tools/gpu_check.py). Its five inputs and its output share one type at every opset."""
    import numpy as np

    from util import FP16, full_check, make_model, nodes_by_type, rewrite, value_types

    c = 4
    m = make_model(f"""
        <ir_version: 8, opset_import: ["" : {opset}]>
        g (float[1,{c},6,6] x) => (float[1,{c},6,6] y) {{
          a = Conv<pads=[1,1,1,1]>(x, w)
          b = BatchNormalization(a, scale, bias, mean, var)
          r = Relu(b)
          y = Conv<pads=[1,1,1,1]>(r, w2)
        }}""", {"w": (c, c, 3, 3), "w2": (c, c, 3, 3), "scale": (c,), "bias": (c,),
                "mean": (c,), "var": np.full((c,), 0.5, np.float32)})
    out = rewrite(m).model
    full_check(out)
    types = value_types(out)
    bn = nodes_by_type(out, "BatchNormalization")[0]
    assert {types[v] for v in (*bn.input, *bn.output)} == {FP16}


def _attention_with_cache(v_head: int, *, three_d: bool = False, node_pin: bool = False):
    """ONNX Attention-23 reading a KV cache; Q/K head size 8, V head size ``v_head``."""
    import onnx
    from onnx import TensorProto, helper

    b, heads, q_len, kv_len, past, qk = 2, 3, 4, 6, 12, 8
    if three_d:
        shapes = {"Q": [b, q_len, heads * qk], "K": [b, kv_len, heads * qk], "V": [b, kv_len, heads * v_head]}
        attrs = {"q_num_heads": heads, "kv_num_heads": heads}
        y = [b, q_len, heads * v_head]
    else:
        shapes = {"Q": [b, heads, q_len, qk], "K": [b, heads, kv_len, qk], "V": [b, heads, kv_len, v_head]}
        attrs, y = {}, [b, heads, q_len, v_head]
    shapes.update(past_key=[b, heads, past, qk], past_value=[b, heads, past, v_head])
    node = helper.make_node("Attention", ["Q", "K", "V", "", "past_key", "past_value"],
                            ["Y", "present_key", "present_value"], name="attn", **attrs)
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in shapes.items()],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, y),
         helper.make_tensor_value_info("present_key", TensorProto.FLOAT, [b, heads, past + kv_len, qk]),
         helper.make_tensor_value_info("present_value", TensorProto.FLOAT, [b, heads, past + kv_len, v_head])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)], ir_version=11)


@pytest.mark.parametrize("three_d", [False, True])
@pytest.mark.parametrize(("v_head", "low"), [(8, True), (10, False)])
def test_attention_with_a_cache_and_unequal_head_sizes_stays_fp32(v_head, low, three_d):
    """onnxruntime 1.31's CUDA Attention computes Y and present_value wrong in FP16 (relative error
    0.98, NaN/Inf; FP32 right) when it reads past_key/past_value and V's head size differs from
    Q/K's: seen on an H100 by the GPU sweep of onnx's operator tests. Such a node keeps FP32 with
    the reason; equal head sizes (the common case) still compute low."""
    from util import full_check, rewrite

    from amp_rewrite.decisions import Precision

    result = rewrite(_attention_with_cache(v_head, three_d=three_d))
    full_check(result.model)
    decision = next(d for d in result.report.log.decisions.values() if d.op == "Attention")
    assert (decision.precision == Precision.LOW) is low, decision
    if not low:
        assert "KV cache" in decision.reason and "head size" in decision.reason


def test_a_node_pin_still_makes_such_an_attention_low():
    from util import rewrite

    from amp_rewrite.decisions import Precision

    result = rewrite(_attention_with_cache(10), fp16_nodes=["attn"])
    decision = next(d for d in result.report.log.decisions.values() if d.op == "Attention")
    assert decision.precision == Precision.LOW


def _between_matmuls(body: str, opset: int, inits: dict, outputs: str = "float[4,8] y"):
    import numpy as np  # noqa: F401

    from util import make_model

    return make_model(f"""
        <ir_version: 8, opset_import: ["" : {opset}]>
        g (float[4,8] x) => ({outputs}) {{
          a = MatMul(x, w)
          {body}
          y = MatMul(b, w2)
        }}""", {"w": (8, 8), "w2": (8, 8), **inits})


def _decision(result, op):
    return next(d for d in result.report.log.decisions.values() if d.op == op)


@pytest.mark.parametrize(("reduction", "low"), [("none", True), ("add", False), ("mul", False), ("max", False)])
def test_bf16_scatternd_with_a_reduction_stays_fp32(reduction, low):
    """onnxruntime 1.31's CUDA ScatterND has no bfloat16 reduction ('element_type 16 not implemented'
    at run time, seen on an H100); plain ScatterND runs in bfloat16. FP16 has every form, and runs
    the non-accumulating ones low (add and mul accumulate: FP32, test_pitfalls)."""
    import numpy as np
    from util import rewrite

    from amp_rewrite.decisions import Precision

    m = _between_matmuls(f'b = ScatterND<reduction="{reduction}">(a, idx, upd)', 18,
                         {"idx": np.array([[1], [3]], np.int64), "upd": (2, 8)})
    assert (_decision(rewrite(m, target="bf16"), "ScatterND").precision == Precision.LOW) is low
    assert (_decision(rewrite(m), "ScatterND").precision == Precision.LOW) is (reduction not in ("add", "mul"))


@pytest.mark.parametrize("mask_read", [False, True])
def test_bf16_dropout_whose_mask_is_read_stays_fp32(mask_read):
    """onnxruntime 1.31's CUDA provider failed to initialise a bfloat16 Dropout whose mask output is
    read (seen on an H100); without the mask it runs."""
    from util import rewrite

    from amp_rewrite.decisions import Precision

    body, outputs = ("b, m = Dropout(a)", "float[4,8] y, bool[4,8] m") if mask_read else ("b = Dropout(a)", "float[4,8] y")
    m = _between_matmuls(body, 22, {}, outputs)
    decision = _decision(rewrite(m, target="bf16"), "Dropout")
    assert (decision.precision == Precision.LOW) is not mask_read
    if mask_read:
        assert "mask" in decision.reason


def test_bf16_centercroppad_stays_fp32():
    """A function op onnxruntime expands into Slice and Pad, and Pad has no bfloat16 CUDA kernel: a
    bfloat16 CenterCropPad made the session fail to initialise (seen on an H100)."""
    import numpy as np
    from util import rewrite

    from amp_rewrite.decisions import Precision

    m = _between_matmuls("b = CenterCropPad(a, shape)", 18, {"shape": np.array([4, 8], np.int64)})
    assert _decision(rewrite(m, target="bf16"), "CenterCropPad").precision == Precision.FP32
    assert _decision(rewrite(m), "CenterCropPad").precision == Precision.LOW
