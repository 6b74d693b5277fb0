"""Classify: give every node a rule category and decide whether painting may touch it.

Cases handled:
- node rules (name, glob, regex; --fp32-nodes / --fp16-nodes) win over op rules;
- op rules by (domain, op, opset); no rule → UNLISTED, treated as deny and reported;
- an op the provider has no low-precision kernel for at this opset leaves the low set, whatever
  the rule file says (a safety net under the rule-file test);
- likewise an op whose own schema at this opset does not allow the low type for the painted group
  (ConstantOfShape has no bfloat16 output below opset 20): the frontend records each group's types;
- an input pinned FP32 that shares the painted type group keeps the node FP32;
- control flow (If/Loop/Scan), Cast, Constant and nodes whose group has an unknown dtype (an
  input, or an output something reads: a custom op shape inference has no schema for) do not
  take part in painting: their types stay as they are;
- nor does a node the frontend marks ``amp.keeps_types``: a torch op that mixes float types (torch's
  type promotion decides its result), an ONNX node that reads or makes a sequence or optional (no
  Cast changes their element type); it keeps the types it was written with.
"""

from __future__ import annotations

import difflib

from ..decisions import Category, Precision
from ..ir import DType, Model, Node, Value
from ..rulebook import RuleEntry
from .base import (LOW_LIMITS, Context, PassResult, accepts_any_float, earlier_pin, given_low_type, is_float32,
                   is_node_source, is_user_source, node_label, node_names, node_rule_of, painted_group,
                   int_attribute, string_attribute)

_CONTROL = "control flow: its boundary types are kept and each body is rewritten as a scope of its own"
_SOURCES = {"Cast", "Constant"}  # handled by cast folding and weight conversion, not painting

# (category, reason, source, the rule entry if one decided)
_Verdict = tuple[Category, str, str, RuleEntry | None]


def classify(model: Model, ctx: Context) -> PassResult:
    verdicts: dict[tuple, _Verdict] = {}  # per (op, domain, opset): the same for every such node
    names = node_names(model) if ctx.rules.node_rules() else frozenset()
    if names and model.meta.get("amp.fused_member_names"):  # (a pin naming a member of a fused node names it)
        names |= model.meta["amp.fused_member_names"]
    angles = []  # deny ops whose argument must be precise (Sin, Cos)
    dequantized = []  # DequantizeLinear nodes of constant (weight) data
    to_integer = []  # Casts of a float to an integer or bool type
    given_low: dict[str, list[tuple[str, str]]] = {}  # a user's FP32 pin → the nodes it names that are low as given
    fixed: dict[str, list[str]] = {}  # a user's low pin → the nodes it names whose float types the schema fixes
    overridden: dict[str, list[tuple[str, str]]] = {}  # a user's low pin → (node, why it stays FP32)
    calls: dict[str, int] = {}  # model-local functions called, by name: their bodies are not rewritten
    untyped: dict[str, list[str]] = {}  # ops reading or writing values no schema types, by op: their nodes
    sums = []  # Add/Sub nodes: an ALiBi bias's Add among them
    for node in model.graph.walk():
        _classify_node(node, ctx, verdicts, names)
        if node.op_type in ("Add", "Sub") and node.domain in ("", "ai.onnx") and len(node.inputs) == 2:
            sums.append(node)
        if model.frontend == "torch":
            _keep_fp32_from_non_floats(node)
        _pin_overridden(node, ctx, names, overridden)
        if "amp.untyped" in node.meta:
            untyped.setdefault(node.qualified_op, []).append(node_label(node))
        if node.meta.get("amp.function_call"):
            calls[node.qualified_op] = calls.get(node.qualified_op, 0) + 1
        if node.meta.get("amp.fp32_argument"):
            angles.append(node)
        if node.op_type == _QDQ[1] and node.domain in ("", "ai.onnx") and node.meta["amp.participates"]:
            dequantized.append(node)
        if node.op_type == "Cast" and node.domain in ("", "ai.onnx") and _float_to_integer(node):
            to_integer.append(node)
        if node.meta["amp.group"] is None:
            _pin_on_given_low(node, ctx, verdicts, names, given_low)
            _pin_on_fixed_fp32(node, ctx, names, fixed)
    _keep_position_arguments_fp32(angles, ctx)
    _keep_integer_arithmetic_fp32(to_integer, ctx)
    _keep_position_biases_fp32(sums, ctx)
    _keep_unrolled_scans_fp32(model, ctx)
    _dequantize_weights_low(dequantized, ctx, names)
    if calls:
        listed = ", ".join(f"{name} ×{n}" for name, n in sorted(calls.items()))
        why_not = model.meta.get("onnx.not_inlined")
        advice = (f"they could not be inlined ({why_not})" if why_not else
                  "rewrite without --no-inline-functions (inline_functions=False) to inline them, and what they "
                  "compute is rewritten too")
        ctx.log.notes.append(f"model-local function calls kept FP32: {listed} — their bodies are not rewritten; "
                             f"{advice}")
    if untyped:
        listed = ", ".join(f"{op} ×{len(nodes)}" for op, nodes in sorted(untyped.items()))
        first = next(iter(untyped.values()))[0]
        ctx.log.notes.append(
            f"untyped values kept FP32: {listed} (e.g. {first!r}) — no schema or value_info gives their float "
            f"outputs (or inputs) a type, so no rule or pin can make them low (their readers could not be given a "
            f"Cast); give those values a type in the model's value_info (onnx.helper.make_tensor_value_info), then "
            f"classify the ops in a rule file")
    _note_unmatched_node_rules(ctx, names)
    _note_unmatched_op_flags(model, ctx)
    for pin, labels in given_low.items():
        types = " or ".join(sorted({t for _, t in labels}))
        ctx.log.notes.append(
            f"without effect: {pin} names {len(labels)} node(s) that compute in {types} as given (e.g. "
            f"{labels[0][0]!r}): a rewrite keeps the types a model already has, so the pin changes nothing here; "
            f"apply it when rewriting the FP32 original")
    for pin, found in overridden.items():
        control = [label for label, why in found if why == _CONTROL]
        kept = [(label, why) for label, why in found if why != _CONTROL]
        if kept:
            label, why = kept[0]
            ctx.log.notes.append(
                f"without effect: {pin} names {len(kept)} node(s) that stay FP32 whatever a pin says (e.g. {label!r}: "
                f"{why})")
        if control:  # (their outputs take what their bodies compute: FP32, or low where every branch is)
            ctx.log.notes.append(
                f"without effect: {pin} names {len(control)} control-flow node(s) (e.g. {control[0]!r}), whose "
                f"outputs take the type their bodies compute whatever a pin says; pin the nodes inside the bodies")
    for pin, labels in fixed.items():
        ctx.log.notes.append(
            f"without effect: {pin} names {len(labels)} node(s) whose op schema types their float tensors "
            f"tensor(float) outright (e.g. {labels[0]!r}), so they stay FP32 and low neighbours meet them through "
            f"a Cast")
    return PassResult("classify", modified=False)


def _keep_fp32_from_non_floats(node: Node) -> None:
    """A torch op reading tensors but no float one, with no ``dtype`` argument, computes FP32
    whatever the rewrite says (``where(mask, 1.0, 0.0)`` of Python scalars, ``(ids > 3) * 1.0``,
    ``abs`` of a complex spectrum): made low (the optimal placement, to which it cost nothing,
    did), its low readers met an FP32 tensor and the module failed at its first call on a dtype
    mismatch. It keeps FP32, and its low readers read it through a Cast. (A factory, reading no
    tensor, and an op given a ``dtype`` take the low type through that argument.)"""
    category = node.meta.get("amp.category")
    if not node.meta.get("amp.participates") or category not in (Category.ALLOW, Category.INFER, Category.CLEAR) \
            or node.op_type == "Cast":  # (a conversion's target type is cast placement's to set)
        return
    origin = node.origin
    tensors = [v for v in node.inputs if v is not None]
    if not tensors or any(v.dtype is None or v.dtype.is_float for v in tensors):
        return
    if origin is not None and "dtype" in getattr(origin, "kwargs", {}):
        return
    _fix_fp32(node, category, "reads no float tensor and takes no dtype argument, so torch computes it in FP32 "
                              "whatever its readers' type (Python scalars, a complex input): kept FP32, its low "
                              "readers read it through a Cast", "classify")


def _fixed_fp32(node: Node) -> bool:
    """Whether ``node`` reads or writes an FP32 tensor in a slot its schema types outright (no type
    parameter: DequantizeLinear-13's output, QuantizeLinear-13's scale), so no rule can make it low."""
    return any(group is None and value is not None and value.dtype == DType.FLOAT
               for slots in (zip(node.output_groups, node.outputs),
                             () if accepts_any_float(node) else zip(node.input_groups, node.inputs))
               for group, value in slots)  # (Shape, Size, Cast read any type: their input slot is no fixed FP32)


def _pin_on_fixed_fp32(node: Node, ctx: Context, names: frozenset[str], found: dict[str, list[str]]) -> None:
    """A user's low pin (``--fp16-nodes``, ``--fp16-ops``, a rule file's allow) naming a node whose
    FP32 tensors the op schema fixes: the node stays FP32 whatever the pin says; collected for a
    note rather than dropped in silence."""
    if not _fixed_fp32(node) or (node.domain == "" and node.op_type in _SOURCES):
        return
    rule = node_rule_of(ctx.rules, node, names)
    if rule is not None:
        if rule.precision != Precision.FP32 and is_user_source(rule.source):
            found.setdefault(f"{rule.source} {rule.pattern!r}", []).append(node_label(node))
        return
    entry = ctx.rules.lookup(node.op_type, node.domain, node.opset)  # (what the rule says, before the kernel table)
    if entry is not None and entry.category == Category.ALLOW and is_user_source(entry.source):
        pin = f"{entry.source} {node.qualified_op!r}" if entry.source.startswith("--") else entry.source
        found.setdefault(pin, []).append(node_label(node))


def _pin_overridden(node: Node, ctx: Context, names: frozenset[str], found: dict[str, list[tuple[str, str]]]) -> None:
    """A user's low pin (``--fp16-nodes``, ``--fp16-ops``, a rule file's allow/infer/clear) naming a
    node the kernel table, the op's schema or control flow keeps FP32 (Det, which CUDA runs on the
    CPU provider; CumSum at opset 13; a Loop, whose boundary types are kept): only ``--explain``
    said the pin had been overridden; collected for a note."""
    meta = node.meta
    if meta.get("amp.group") is None or (node.domain == "" and node.op_type in _SOURCES):
        return
    control = bool(node.all_subgraphs())
    if not control and meta.get("amp.source") not in ("kernel table", "op schema"):
        return
    rule = node_rule_of(ctx.rules, node, names)
    if rule is not None:
        if rule.precision != Precision.FP32 and is_user_source(rule.source):
            pin = f"{rule.source} {rule.pattern!r}"
        else:
            return
    else:
        entry = ctx.rules.lookup(node.op_type, node.domain, node.opset)
        if entry is None or entry.category == Category.DENY or not is_user_source(entry.source):
            return
        pin = f"{entry.source} {node.qualified_op!r}" if entry.source.startswith("--") else entry.source
    why = _CONTROL if control else str(meta.get("amp.reason", "")).split(", so node rule")[0]
    found.setdefault(pin, []).append((node_label(node), why))


def _pin_on_given_low(node: Node, ctx: Context, verdicts: dict[tuple, _Verdict], names: frozenset[str],
                      found: dict[str, list[tuple[str, str]]]) -> None:
    """A user's FP32 pin (``--fp32-nodes``, ``--fp32-ops``, a rule file's deny) that names a node the
    input already computes in a low type (an output rewritten again): the rewrite leaves that node
    as it is, so the pin does nothing; collected for a note rather than passed over in silence."""
    low = given_low_type(node)
    if low is None or (node.domain == "" and node.op_type in _SOURCES):
        return
    rule = node_rule_of(ctx.rules, node, names)
    if rule is not None and rule.precision == Precision.FP32 and is_user_source(rule.source):
        found.setdefault(f"{rule.source} {rule.pattern!r}", []).append((node_label(node), low.short))
    category, _, source, _ = _cached_verdict(node, ctx, verdicts)  # (the op's rule, which a node rule overrides)
    if category == Category.DENY and is_user_source(source):
        pin = f"{source} {node.qualified_op!r}" if source.startswith("--") else source  # (a file's names the op)
        found.setdefault(pin, []).append((node_label(node), low.short))


def _note_unmatched_node_rules(ctx: Context, names: frozenset[str]) -> None:
    """A node pattern that names no node (a typo, another model's names) pins nothing: say so.
    ``names``: every node's name and label (:func:`node_names`)."""
    for rule in ctx.rules.node_rules():
        if not any(rule.matches(name, names) for name in names):
            close = difflib.get_close_matches(rule.pattern, sorted(names), n=3, cutoff=0.6)
            hint = f" (closest: {', '.join(close)})" if close else ""
            ctx.log.notes.append(f"unmatched: {rule.source} {rule.pattern!r} names no node of this model, so it "
                                 f"pins nothing{hint}")


def _note_unmatched_op_flags(model: Model, ctx: Context) -> None:
    """--fp32-ops / --fp16-ops naming an op the model does not have (a typo of a real op, another
    model's op) changes nothing: say so, as for a node pattern naming no node."""
    flagged = [e for e in ctx.rules.entries() if e.reason.startswith("command line: --")]
    if not flagged:
        return
    present = {(n.domain if n.domain != "ai.onnx" else "", n.op_type) for n in model.graph.walk()}
    present |= model.meta.get("amp.fused_member_ops", set())  # (a flag on a member kept its fused op FP32)
    declined = model.meta.get("amp.fusion_declined_ops", set())  # (onnx_fuse: the flag kept patterns unfused)
    in_bodies = model.meta.get("onnx.function_ops", set())  # (kept model-local functions: not inlined)
    for entry in flagged:
        key = (entry.domain, entry.op)
        if key in present:
            continue
        flag, op = entry.source, f"{entry.domain}:{entry.op}" if entry.domain else entry.op
        if key in declined:
            note = f"{flag} {op!r}: the decomposed patterns that would be fused into it stay unfused, FP32 islands " \
                   f"with their Casts"
        elif key in in_bodies:
            note = f"unmatched: {flag} {op!r} names an op only the bodies of model-local functions hold, which stay " \
                   f"as written (not inlined: FP32), so it changes nothing"
        else:
            note = f"unmatched: {flag} {op!r} names an op this model does not have, so it changes nothing"
        ctx.log.notes.append(note)


def _classify_node(node: Node, ctx: Context, verdicts: dict[tuple, _Verdict], names: frozenset[str]) -> None:
    meta = node.meta
    meta["amp.label"] = node_label(node)
    group = painted_group(node)
    meta["amp.group"] = group
    meta["amp.participates"] = False
    meta["amp.precision"] = Precision.NONE
    if group is None:
        at = f" at opset {node.opset}" if node.opset is not None else ""
        reason = (f"the {node.qualified_op} schema{at} types its float tensors tensor(float), with no type "
                  f"parameter: it cannot compute in a low type, and low neighbours meet it through a Cast"
                  if _fixed_fp32(node) else "no FP32 float tensor to paint")
        meta["amp.category"], meta["amp.reason"], meta["amp.source"] = None, reason, "classify"
        unknown = [v.name for v in (*node.inputs, *node.outputs) if v is not None and v.dtype is None]
        if unknown:  # (an op reading another's untyped output: a rule classifying it could not make it low)
            meta["amp.untyped"] = unknown[0]
        return
    category, reason, source, entry = _lookup(node, ctx, verdicts, names)
    refused = _schema_refuses_low(node, group, ctx) or _cast_refuses_low(node, ctx) \
        or node.meta.get("amp.refuses_low")  # (a frontend's: a model-local function call, a summing Einsum)
    if refused and category in (Category.ALLOW, Category.INFER, Category.CLEAR):
        category, reason, source = Category.DENY, refused, "op schema"
    elif refused and category == Category.UNLISTED and node.meta.get("amp.function_call"):
        # (no rule file can classify a call of a model-local function: the summary's advice to
        # write one was a dead end; the way out is inlining)
        category, reason, source = Category.DENY, refused, "classify"
    elif node.meta.get("amp.lost_epsilon") and category in (Category.INFER, Category.CLEAR) \
            and node_rule_of(ctx.rules, node, names) is None:
        # (onnx_constants: it adds an epsilon the low type flushes to 0. Deny, not just FP32: its
        # sum is near 0 where the epsilon matters, so the readers dividing by it follow it FP32)
        category, reason, source = Category.DENY, node.meta["amp.lost_epsilon"], "classify"
    elif category in (Category.ALLOW, Category.INFER, Category.CLEAR) and not is_user_source(source) \
            and node_rule_of(ctx.rules, node, names) is None:  # (a user's rule making it low is their choice)
        square = _square_verdict(node, ctx, verdicts)
        if square is not None:
            category, reason, source = square
    meta["amp.category"], meta["amp.reason"], meta["amp.source"] = category, reason, source
    meta["amp.pinned"] = _pinned_inputs(node, entry)
    meta["amp.bounded_output"] = category == Category.DENY and entry is not None and entry.bounded_output
    meta["amp.fp32_argument"] = category == Category.DENY and entry is not None and entry.fp32_argument
    if node.all_subgraphs():
        # what the rules (node rules, the kernel table, the schema) say of the op itself: the
        # optimal placement may give an If's outputs the low type only where they allow it
        meta["amp.control_category"] = category
        _fix_fp32(node, Category.DENY, _CONTROL, "classify")
        return
    if node.domain == "" and node.op_type in _SOURCES:
        if "fx.torch_name" not in meta and category != Category.CLEAR and source not in ("op schema", "kernel table"):
            _own_source(node, category, source, ctx)
        meta["amp.precision"] = Precision.FP32
        return
    if "amp.exact_constant" in meta and category in (Category.INFER, Category.CLEAR):
        # a frontend found it reads a constant the low type cannot hold (onnx_constants)
        _fix_fp32(node, category, meta["amp.exact_constant"], "classify")
        return
    if "amp.keeps_types" in meta:  # a frontend's verdict (mixed float types, a sequence or optional)
        _fix_fp32(node, category, meta["amp.keeps_types"], "frontend")
        return
    unknown = [v.name for i, v in enumerate(node.inputs) if v is not None and i < len(node.input_groups)
               and node.input_groups[i] == group and v.dtype is None]
    if unknown:  # (not counted unlisted: a rule classifying it, or a pin, could not make it low either)
        _fix_fp32(node, category, f"dtype of {unknown[0]!r} is unknown, so the node keeps its types", "classify")
        meta["amp.untyped"] = unknown[0]
        return
    # An output of unknown type (a custom-domain op that shape inference has no schema for): were
    # the node painted low, its readers could not tell they read the low type, and get no Cast.
    unknown = [v.name for v, g in zip(node.outputs, node.output_groups) if g == group and v.dtype is None and v.uses()]
    if unknown:
        # (not counted unlisted: a rule classifying it, or a pin, could not make it low either)
        _fix_fp32(node, category, f"dtype of its output {unknown[0]!r} is unknown (no schema infers it), so its "
                                  f"readers could not be given a Cast: the node keeps its types", "classify")
        meta["amp.untyped"] = unknown[0]
        return
    if category in (Category.ALLOW, Category.INFER, Category.CLEAR) and _in_quantized_unit(node, group) \
            and node_rule_of(ctx.rules, node, names) is None:  # (a node rule making it low is the user's choice)
        _count_unlisted(node, category, ctx)
        _fix_fp32(node, category, _QDQ_UNIT, "classify")
        return
    gap = _runtime_gap(node, ctx) if category in (Category.ALLOW, Category.INFER, Category.CLEAR) else None
    if gap is None and category == Category.ALLOW:  # (onnx_constants.KERNEL_SCALAR: a Gemm's alpha past the range)
        gap = meta.get("amp.kernel_scalar")
    if gap and node_rule_of(ctx.rules, node, names) is None:  # (a node rule making it low is the user's choice)
        _fix_fp32(node, category, gap, "classify")
        return
    shared = [i for i in meta["amp.pinned"] if i < len(node.input_groups) and node.input_groups[i] == group
              and group != "?" and is_float32(node.inputs[i])]
    if shared and category in (Category.ALLOW, Category.INFER, Category.CLEAR):
        name = _input_name(node, shared[0])
        meta["amp.category"] = Category.DENY
        meta["amp.reason"] = f"input {name} is pinned FP32 by the rules and shares type {group} with the rest"
    _count_unlisted(node, category, ctx)
    meta["amp.participates"] = True


_ATTENTION_CACHE = ("Attention with a KV cache (past_key/past_value) whose V head size differs from Q/K's: onnxruntime "
                    "1.31's CUDA kernel computes Y and present_value wrong in FP16 there (seen on an H100: relative "
                    "error 0.98, with NaN/Inf; FP32 is right): kept FP32")


_BF16_SCATTER_REDUCTION = ("ScatterND with reduction={}: onnxruntime 1.31's CUDA kernel has no bfloat16 reduction (the run "
                           "fails with 'element_type 16 not implemented', seen on an H100): kept FP32")
_BF16_DROPOUT_MASK = ("Dropout whose mask output is read: onnxruntime 1.31's CUDA provider fails to initialise a bfloat16 one "
                      "(seen on an H100; without the mask it runs): kept FP32")


_ODD_TANH_GELU = ("{op} on a tensor whose element count is not known to be even: onnxruntime 1.31's CUDA kernel "
                  "computes FP16 in pairs (half2) and leaves the last element of an odd count unwritten (seen on an "
                  "H100: relative error 0.19 on 3 elements; FP32 and BF16 are right): kept FP32")


def tanh_gelu_gap(op: str, x: Value | None, target: str) -> str | None:
    """Why an FP16 tanh-GELU on ``x`` (Gelu with approximate="tanh", or com.microsoft FastGelu
    without a bias) must stay FP32: onnxruntime's CUDA launcher takes its half2 path whenever there is
    no bias and computes ``count // 2`` pairs, so an odd element count leaves the last element
    unwritten (``_count_known_even`` says when it cannot be odd)."""
    if target != "fp16" or _count_known_even(x):
        return None
    return _ODD_TANH_GELU.format(op=op)


# ops whose first output holds exactly as many elements as their first input
_SAME_COUNT = frozenset({"Reshape", "Flatten", "Transpose", "Squeeze", "Unsqueeze", "Identity", "Cast", "CastLike",
                         "Dropout"})


def _count_known_even(value: Value | None, depth: int = 8) -> bool:
    """Whether ``value``'s element count is known even: a dimension of its shape is a known even
    number, or it is a reshape, transpose, cast... of a value whose count is (GPT-2's TorchScript
    export reshapes its MLP's Gemm output to dims onnx's inference leaves unnamed), or a matrix
    product whose weight gives it an even last dimension (onnx's inference has no shape behind
    com.microsoft's FusedMatMul, which onnxruntime's optimizer writes before a FastGelu)."""
    while value is not None and depth > 0:
        if value.shape is not None and any(isinstance(d, int) and d % 2 == 0 for d in value.shape):
            return True
        if _product_columns(value) % 2 == 0:
            return True
        node = value.producer
        if node is None or node.domain not in ("", "ai.onnx") or node.op_type not in _SAME_COUNT \
                or not node.outputs or node.outputs[0] is not value or not node.inputs:
            return False
        value, depth = node.inputs[0], depth - 1
    return False


def _product_columns(value: Value) -> int:
    """The last dimension of a MatMul, Gemm or FusedMatMul output, read off its second operand's
    static shape (1 where it is not known): the product has as many columns as B, or as B has rows
    under transB. FusedMatMul's transBatchB moves B's batch dims, so it is not read."""
    node = value.producer
    if node is None or len(node.inputs) < 2 or node.inputs[1] is None or not node.outputs \
            or node.outputs[0] is not value:
        return 1
    kind = (node.domain if node.domain != "ai.onnx" else "", node.op_type)
    if kind not in (("", "MatMul"), ("", "Gemm"), ("com.microsoft", "FusedMatMul")):
        return 1
    shape = node.inputs[1].shape
    if shape is None or len(shape) < 2 or (kind[1] == "FusedMatMul" and int_attribute(node, "transBatchB", 0)):
        return 1
    column = shape[-2] if kind[1] != "MatMul" and int_attribute(node, "transB", 0) else shape[-1]
    return column if isinstance(column, int) and column > 0 else 1


def _runtime_gap(node: Node, ctx: Context) -> str | None:
    """Why an ONNX node the rules make low must stay FP32 after all: onnxruntime's CUDA kernel
    exists for the low type (so the kernel table lets it through) but computes it wrong or fails
    on this node's attributes or uses, as running the rewrites on a GPU showed (tools/gpu_sweep.py,
    onnx's operator tests on an H100)."""
    if node.domain == "com.microsoft" and node.op_type == "FastGelu" and \
            (len(node.inputs) < 2 or node.inputs[1] is None):
        return tanh_gelu_gap("FastGelu without a bias", node.inputs[0] if node.inputs else None, ctx.options.target)
    if node.domain not in ("", "ai.onnx"):
        return None
    if node.op_type == "Gelu" and string_attribute(node, "approximate") == "tanh":
        return tanh_gelu_gap('Gelu(approximate="tanh")', node.inputs[0] if node.inputs else None, ctx.options.target)
    if _cache_with_unequal_head_sizes(node):
        return _ATTENTION_CACHE
    if ctx.options.target != "bf16":
        return None
    if node.op_type == "ScatterND":
        reduction = string_attribute(node, "reduction") or "none"
        if reduction != "none":
            return _BF16_SCATTER_REDUCTION.format(reduction)
    mask = node.outputs[1] if node.op_type == "Dropout" and len(node.outputs) > 1 else None
    if mask is not None and (mask.uses() or mask.is_graph_output):
        return _BF16_DROPOUT_MASK
    return None


def _cache_with_unequal_head_sizes(node: Node) -> bool:
    """An ONNX Attention (opset 23+) given past_key and past_value whose last dimensions (the head
    sizes: past tensors are always 4-D) are known and differ; with unknown sizes, 3-D or 4-D K and V
    (whose last dimensions are kv_num_heads × the head size, or the head size) are compared."""
    if node.op_type != "Attention" or len(node.inputs) < 6:  # (the caller checks the domain)
        return False
    key, value = node.inputs[4], node.inputs[5]
    if key is None or value is None:
        return False
    for a, b in ((key, value), (node.inputs[1], node.inputs[2])):
        da = a.shape[-1] if a is not None and a.shape else None
        db = b.shape[-1] if b is not None and b.shape else None
        if isinstance(da, int) and isinstance(db, int):
            return da != db
    return False


_QDQ = ("QuantizeLinear", "DequantizeLinear")
_QDQ_DOMAINS = ("", "ai.onnx", "com.microsoft")
_QDQ_UNIT = ("QDQ node unit: its float inputs come from DequantizeLinear (or are constants) and every reader is a "
             "QuantizeLinear, so runtimes run it as one quantized op (onnxruntime's CPU provider fuses DQ → Conv → Q "
             "into QLinearConv, TensorRT builds an int8 kernel); a low type inside the unit would break that fusion "
             "and round the result before it is quantized again: kept FP32")


def _in_quantized_unit(node: Node, group: str) -> bool:
    """Whether ``node`` sits inside a QDQ node unit (the format onnxruntime's quantize_static writes):
    its float inputs of the painted group are DequantizeLinear outputs or constants (a layer whose
    weight was left float: onnxruntime's WeightBiasQuantization quantizes it and fuses the unit all
    the same), at least one dequantized, and each of its outputs of that group is read by
    QuantizeLinear nodes only. A weight-only quantized GEMM (a float activation times a dequantized
    weight) or a DQ → op read by float ops is no such unit and is painted as usual."""
    inputs = [v for g, v in zip(node.input_groups, node.inputs) if g == group and v is not None]
    outputs = [v for g, v in zip(node.output_groups, node.outputs) if g == group and v is not None]
    if not inputs or not outputs:
        return False
    dequantized = False
    for value in inputs:
        producer = value.producer
        if producer is not None and producer.op_type == _QDQ[1] and producer.domain in _QDQ_DOMAINS:
            dequantized = True
        elif not value.is_constant:  # (a float weight or bias: onnxruntime quantizes it for the unit)
            return False
    if not dequantized:
        return False
    for value in outputs:
        uses = value.uses()
        if not uses or value.is_graph_output:
            return False
        if any(reader.op_type != _QDQ[0] or reader.domain not in _QDQ_DOMAINS for reader, _ in uses):
            return False
    return True


def _dequantize_weights_low(candidates: list[Node], ctx: Context, names: frozenset[str]) -> None:
    """A DequantizeLinear of a constant quantized weight (weight-only quantization: int4 blocks for
    an LLM's MatMuls, int8 channels) whose every reader is a low-precision GEMM reading it in its
    painted group computes in the low type, its scale converted offline like any weight. Kept FP32
    by its deny rule, it left a Cast between it and the GEMM: one more kernel and FP32 copy of the
    weight per run, and onnxruntime (CUDA, CPU, DML) no longer fused the DequantizeLinear → MatMul of
    an int4 block-quantized weight (1.31 also an int8 per-channel one) into MatMulNBits, its
    weight-only kernel (its selector takes an FP16 scale). The deny rule stands where the DQ
    dequantizes an activation (a QDQ unit's input) or a user pins it FP32."""
    from ..frontends.onnx_constants import dequantized_past

    low = ctx.low.short if ctx.low is not None else "the low type"
    for node in candidates:
        meta = node.meta
        if meta["amp.category"] != Category.DENY or is_user_source(meta["amp.source"]) \
                or meta["amp.source"] in ("kernel table", "op schema") or node_rule_of(ctx.rules, node, names):
            continue
        if not all(v is None or v.is_constant for v in node.inputs) or len(node.outputs) != 1:
            continue
        out = node.outputs[0]
        uses = out.uses()
        if not uses or out.is_graph_output or not all(
                reader.meta.get("amp.participates") and reader.meta.get("amp.category") == Category.ALLOW
                and k < len(reader.input_groups) and reader.input_groups[k] == reader.meta.get("amp.group")
                for reader, k in uses):
            continue
        group = meta["amp.group"]
        if missing_low_kernel(ctx, node.op_type, node.domain, node.opset) or _schema_refuses_low(node, group, ctx):
            continue
        subnormal = _subnormal_scale(node, ctx)
        beyond = dequantized_past(node, LOW_LIMITS[ctx.low]) if ctx.low in LOW_LIMITS else None
        why = (f"its scale holds {subnormal:.3g}, below {low}'s smallest normal number, where {low} keeps too few "
               f"bits for it (every weight of that channel or block would move with it)" if subnormal is not None else
               f"its weights dequantize to up to {beyond:.6g}, beyond {low}'s finite range, where they would be ±inf "
               f"(computed at run time, nothing clamps them)" if beyond is not None else None)
        if why is not None:
            meta["amp.reason"] = f"{meta['amp.reason']}; kept FP32 though only {low} GEMMs read it: {why}"
            continue
        readers = sorted({reader.op_type for reader, _ in uses})
        meta["amp.category"], meta["amp.source"] = Category.ALLOW, "classify"
        meta["amp.reason"] = (
            f"dequantizes a constant weight that only {low} {'/'.join(readers)} read: computed in {low}, its scale "
            f"converted offline, so no Cast sits between it and its reader (onnxruntime fuses a quantized "
            f"weight's DequantizeLinear → MatMul into MatMulNBits, which a Cast prevents)")


def _subnormal_scale(node: Node, ctx: Context) -> float | None:
    """The smallest nonzero scale of a DequantizeLinear that the low type holds only as a subnormal
    (below 6.1e-5 in FP16: 1.4e-7 is a multiple of 6e-8 there, up to 18% off), or None."""
    import numpy as np

    from ..frontends.onnx_loader import constant_array

    scale = node.inputs[1] if len(node.inputs) > 1 else None
    data = constant_array(scale) if scale is not None else None
    if data is None or ctx.low is None:
        return None
    tiny = float(np.finfo(np.float16).tiny) if ctx.low == DType.FLOAT16 else 1.1754944e-38
    magnitudes = np.abs(np.asarray(data, np.float64))
    small = magnitudes[(magnitudes > 0) & (magnitudes < tiny)]
    return float(small.min()) if small.size else None


_CONE_LIMIT = 64  # nodes: an argument computed by more than this is no position encoding


def _keep_position_arguments_fp32(angles: list[Node], ctx: Context) -> None:
    """A deny op whose rule marks its argument precise (``fp32_argument``: Sin, Cos) keeps FP32 the
    nodes computing that argument where they compute it from integers and constants only: the
    angles of rotary and sinusoidal position encodings (``inv_freq @ position_ids``). An allow
    MatMul there would otherwise round the angle to the low type before the FP32 Sin/Cos reads it
    (fp16: positions 4000-4015 gave rel err 0.83; 0-511 gave 0.014); HF computes these with
    autocast disabled for the same reason. An argument that depends on a float activation or graph
    input (Fourier features, a SIREN layer) is left to painting."""
    low = ctx.low.short if ctx.low is not None else "the low type"
    spacing = 8.0 if ctx.low == DType.BFLOAT16 else 1.0  # 2**(10 - mantissa bits): 7 in bf16, 10 in fp16
    for node in angles:
        _keep_cone_fp32(node, (
            f"computes the argument of {node_label(node)} from integers and constants only (positions): "
            f"kept FP32, as {low} would round the angle before the FP32 {node.op_type} reads it ({low} "
            f"spacing is {spacing:g} at 1024; HF computes rotary angles with autocast disabled)"))


def _keep_cone_fp32(node: Node, reason: str) -> None:
    """Fix FP32 the nodes of ``node``'s :func:`_position_cone` that painting could make low."""
    _hold_fp32(_position_cone(node), reason)


def _hold_fp32(nodes, reason: str) -> None:
    """Fix FP32, for ``reason``, those of ``nodes`` that painting could make low."""
    for member in nodes:
        category = member.meta.get("amp.category")
        if member.meta.get("amp.participates") and category in (Category.ALLOW, Category.INFER, Category.CLEAR):
            _fix_fp32(member, category, reason, "classify")


def _float_to_integer(cast: Node) -> bool:
    source, target = cast.inputs[0] if cast.inputs else None, cast.outputs[0] if cast.outputs else None
    return (source is not None and source.dtype is not None and source.dtype.is_float and target is not None
            and target.dtype is not None and not target.dtype.is_float)


def _keep_integer_arithmetic_fp32(casts: list[Node], ctx: Context) -> None:
    """A float computed from integers and constants only and then cast to an integer type is shape
    or index arithmetic (``math.ceil(h / patch) * patch`` of a TorchScript export, T5's position
    buckets): the nodes computing it keep FP32. Low precision gains nothing there (no activation
    flows through) and rounds the integers it carries: fp16 holds integers exactly only up to 2048
    (4099 became 4100, and a Reshape failed), bf16 up to 256. The optimal placement, to which the
    constant inputs cost nothing, painted such a chain fp16."""
    if ctx.low is None:
        return
    exact = 256 if ctx.low == DType.BFLOAT16 else 2048  # 2**(mantissa bits + 1)
    for cast in casts:
        _keep_cone_fp32(cast, (
            f"computes from integers and constants only a value {node_label(cast)} casts to "
            f"{cast.outputs[0].dtype.short} (shape or index arithmetic): kept FP32, as {ctx.low.short} holds "
            f"integers exactly only up to {exact}"))


# ops that apply a layer's weights: a convolution, or a product with (a lookup in) a weight matrix
_CONVOLUTIONS = frozenset({"Conv", "ConvTranspose", "conv1d", "conv2d", "conv3d", "convolution", "_convolution",
                           "conv_transpose1d", "conv_transpose2d", "conv_transpose3d"})
_WEIGHT_PRODUCTS = frozenset({"MatMul", "Gemm", "Gather", "Einsum", "linear", "matmul", "mm", "bmm", "addmm",
                              "embedding", "einsum"})


def _learned_layer(node: Node) -> bool:
    """Whether ``node`` applies a learned layer: a convolution, or a product with (a lookup in) a
    constant with two dimensions larger than 1 (a weight matrix, an embedding table). Integer data
    fed through one is an activation (a uint8 image, an int16 waveform, token ids), not positions:
    an image-in, image-out super-resolution net kept all its Convs FP32 as "shape arithmetic". A
    rotary angle's ``inv_freq`` is a vector ([d/2, 1] or [1, d/2, 1]): no such matrix."""
    if node.op_type in _CONVOLUTIONS:
        return True
    if node.op_type not in _WEIGHT_PRODUCTS:
        return False
    for value in node.inputs:
        if value is None or not (value.is_constant or "fx.lifted_tensor" in value.meta) or value.dtype is None \
                or not value.dtype.is_float:
            continue
        dims = [d for d in (value.shape or ()) if not (isinstance(d, int) and d <= 1)]
        if len(dims) >= 2:
            return True
    return False


# ops through which a float computed from positions keeps a position's magnitude (affine arithmetic
# and data movement): ALiBi's slope * position, or -|i - j| * slope
_POSITION_KEEPING = frozenset({"Cast", "Mul", "Add", "Sub", "Div", "Neg", "Abs", "Unsqueeze", "Squeeze", "Reshape",
                               "Expand", "Transpose", "Slice", "Concat", "Tile", "Identity", "Flatten", "Gather",
                               "Range", "CumSum"})
# ops that carry a biased score on to the softmax reading it (a mask added or applied, a scale)
_SCORE_CARRYING = frozenset({"Add", "Sub", "Mul", "Div", "Where", "Max", "Min", "Clip", "Reshape", "Transpose",
                             "Unsqueeze", "Squeeze", "Expand", "Slice", "Identity"})
_SCORE_READERS = frozenset({"Softmax", "LogSoftmax"})


def _keep_position_biases_fp32(sums: list[Node], ctx: Context) -> None:
    """A float computed from positions (a CumSum or Range of integers, converted to float) and
    added to an activation is an ALiBi bias (BLOOM and Falcon: ``slope * (cumsum(mask) - 1)``):
    it grows with the sequence (0.707 × 4000 ≈ 2800, where fp16's spacing is 2 and bf16's 16),
    so the Add and what carries its sum on to the Softmax reading it keep FP32, as torch's type
    promotion keeps ``fp16 scores + fp32 bias``. Cast low before the Add, the bias rounded every
    logit by up to 1 (fp16) / 8 (bf16): a 1-layer decoder's logits were 4.7e-2 off at 4000
    positions (fp16) and 0.14 (bf16), 4e-4 and 3e-3 with the hold. A bias looked up by position
    (T5's relative buckets, a position-embedding row) is a weight and bounded: not held."""
    if ctx.low is None:
        return
    low = ctx.low.short
    for node in sums:
        if not node.meta.get("amp.participates") \
                or node.meta.get("amp.category") not in (Category.ALLOW, Category.INFER, Category.CLEAR):
            continue
        kinds = [_position_kind(v, node) for v in node.inputs]
        if "positions" not in kinds or "activation" not in kinds:
            continue
        reason = (f"adds to an activation a bias computed from positions (ALiBi: a CumSum or Range of integers, "
                  f"scaled): kept FP32 up to the softmax reading it, as the bias grows with the sequence and "
                  f"{low} rounds it ({low} spacing is {2.0 if ctx.low == DType.FLOAT16 else 16.0:g} at 2048; "
                  f"torch's type promotion keeps fp16 scores + an FP32 bias FP32)")
        _hold_fp32(_score_chain(node), reason)


# the arithmetic of a recurrence step (h = a * h + b * u[t]), and the data moves that take a step's
# operand out of a whole sequence (u[:, t]) or pass a value on unchanged
_STEP_ARITHMETIC = frozenset({"Add", "Sub", "Mul", "add", "sub", "mul", "rsub"})
_STEP_MOVES = frozenset({"Slice", "Gather", "Squeeze", "Unsqueeze", "Reshape", "Identity", "Transpose", "Expand",
                         "Split", "Flatten", "select", "slice", "index", "view", "reshape", "_unsafe_view", "unsqueeze",
                         "squeeze", "expand", "permute", "transpose", "unbind", "split", "chunk", "clone",
                         "contiguous", "alias", "narrow"})
_SCAN_STEPS = 8  # chained steps reading one source: an unrolled scan, not a residual stream
_STEP_REACH = 4  # arithmetic nodes between two steps of one scan (a * h, b * u[t], their sum)


def _keep_unrolled_scans_fp32(model: Model, ctx: Context) -> None:
    """A recurrence written as a Python loop (``h = a * h + b * u[:, t]``; a running sum ``h = h +
    kv[:, t]``) unrolls into a chain of elementwise steps, each reading the one before and one
    source every step shares (the decay ``a``, slices of ``kv``): a sum over the sequence, which
    the CumSum spelling keeps FP32. Painted low between two allow ops, the state was rounded at
    every step: bf16 0.044 off over 300 steps (autocast 0.007), fp16 inf at 2000 (a running mean
    reaching 8e4), and a decay of 0.99966 held as 1.0 in bf16, so the state never forgot (0.27 off;
    autocast 0.005). torch.autocast keeps such a state FP32 by promotion from its FP32 zeros.
    A residual stream is no such chain: each of its Adds reads another layer's output."""
    if ctx.low is None:
        return
    for scope in model.graph.scopes():
        steps = [n for n in scope.nodes if n.op_type in _STEP_ARITHMETIC
                 and (n.domain in ("", "ai.onnx") or model.frontend == "torch")
                 and n.meta.get("amp.participates")
                 and n.meta.get("amp.category") in (Category.ALLOW, Category.INFER, Category.CLEAR)]
        if len(steps) < _SCAN_STEPS:
            continue
        order = {id(n): i for i, n in enumerate(scope.nodes)}
        by_source: dict[int, tuple[Node | Value, list[Node]]] = {}  # id(source) -> (it, the steps reading it)
        for node in steps:
            if not any(v is not None and v.producer is not None and v.producer.op_type in _STEP_ARITHMETIC
                       for v in node.inputs):
                continue  # (a step carries a state another step computed: 1 - a is no step)
            for source in {id(s): s for s in (_step_source(v) for v in node.inputs) if s is not None}.values():
                by_source.setdefault(id(source), (source, []))[1].append(node)
        held: list[Node] = []
        for source, readers in by_source.values():
            if len(readers) < _SCAN_STEPS:
                continue
            chain = _scan_chain(sorted(readers, key=lambda n: order[id(n)]), scope)
            held += chain
            if chain and isinstance(source, Node) and source.meta.get("amp.category") in (Category.INFER,
                                                                                          Category.CLEAR):
                held.append(source)  # (the decay a step multiplies by: exp(-exp(w)) is 1.0 computed in bf16)
        if not held:
            continue
        reason = (f"a step of a recurrence written as a loop ({_SCAN_STEPS} or more chained steps reading one "
                  f"source: h = a * h + b * u[t]): kept FP32 as CumSum is, since {ctx.low.short} rounds the state "
                  f"at every step (and a decay near 1 to 1: 0.99966 is 1.0 in bf16), as torch.autocast keeps it "
                  f"FP32 by promotion")
        _hold_fp32(held, reason)


def _step_source(value: Value | None):
    """What a step's operand is taken from: through the data moves that slice a sequence, the node
    computing it, or the constant itself; None for a Python number or an untyped value."""
    seen = 0
    while value is not None and seen < 8:
        producer = value.producer
        if producer is None or producer.op_type not in _STEP_MOVES or not producer.inputs:
            return producer if producer is not None else value
        value = producer.inputs[0]
        seen += 1
    return None


def _scan_chain(readers: list[Node], scope) -> list[Node]:
    """The steps of ``readers`` (in graph order) that follow one another through at most
    :data:`_STEP_REACH` arithmetic nodes, in runs of :data:`_SCAN_STEPS` or more, with the
    arithmetic nodes linking them."""
    members = {id(n) for n in readers}
    held: list[Node] = []
    run: list[Node] = [readers[0]]
    for before, after in zip(readers, readers[1:]):
        path = _arithmetic_path(before, after, scope)
        if path is not None:
            run += [*path, after]
            continue
        if sum(id(n) in members for n in run) >= _SCAN_STEPS:
            held += run
        run = [after]
    if sum(id(n) in members for n in run) >= _SCAN_STEPS:
        held += run
    return held


def _arithmetic_path(start: Node, goal: Node, scope) -> list[Node] | None:
    """The arithmetic nodes between ``start`` and ``goal`` on a path of at most
    :data:`_STEP_REACH` of them (empty where ``goal`` reads ``start``), or None."""
    frontier: list[tuple[Node, list[Node]]] = [(start, [])]
    for _ in range(_STEP_REACH + 1):
        following = []
        for node, path in frontier:
            for out in node.outputs:
                for reader in out.consumers():
                    if reader is goal:
                        return path
                    if reader.graph is scope and reader.op_type in _STEP_ARITHMETIC and len(path) < _STEP_REACH:
                        following.append((reader, [*path, reader]))
        frontier = following
    return None


def _position_kind(value: Value | None, node: Node) -> str:
    """``positions`` where ``value`` is a float computed only from constants and integers, through
    :data:`_POSITION_KEEPING` ops, with a CumSum or Range among them (not a mask: ``1 - mask``
    converts the mask itself); ``constant`` where it is computed from constants and integers
    otherwise; ``activation`` else."""
    if value is None or value.dtype is None or not value.dtype.is_float:
        return "constant"
    if value.is_constant or "fx.lifted_tensor" in value.meta:
        return "positions" if _progression_table(value) else "constant"
    cone = _cone_of([value], node.graph)
    if cone is None:
        return "activation"
    if any(member.op_type not in _POSITION_KEEPING or member.domain not in ("", "ai.onnx") for member in cone):
        return "constant"
    if any(member.op_type in ("Range", "CumSum") for member in cone):
        return "positions"
    if any(v is not None and v.is_constant and _progression_table(v) for member in cone for v in member.inputs):
        return "positions"  # (an exporter folded slope * arange(max_len) into a table: MPT's ALiBi)
    casts = [m for m in cone if m.op_type == "Cast" and m.inputs and m.inputs[0] is not None]
    return "positions" if any(_counts_positions(c.inputs[0]) for c in casts) else "constant"


_TABLE_LIMIT = 1 << 22  # (elements: a position table is rows of max_len, not a weight matrix)


def _progression_table(value: Value) -> bool:
    """Whether the float constant ``value`` holds rows of 16 or more positions' values: along its
    last axis, each row steps by one constant, not 0 in every row (``slopes * arange(max_len)``,
    the ALiBi table an exporter folds from ``config.max_seq_len``)."""
    if value.dtype is None or not value.dtype.is_float or not value.shape or (value.numel or 0) > _TABLE_LIMIT:
        return False
    import numpy as np

    from ..frontends.onnx_loader import constant_array

    data = constant_array(value)
    if data is None or data.ndim == 0 or data.shape[-1] < 16 or not np.isfinite(data).all():
        return False
    rows = data.reshape(-1, data.shape[-1]).astype(np.float64)
    steps = np.diff(rows, axis=-1)
    if not np.any(steps[:, 0]):
        return False
    return bool(np.allclose(steps, steps[:, :1], rtol=1e-4, atol=1e-6 * float(np.abs(rows).max())))


def _counts_positions(value: Value) -> bool:
    """Whether an integer ``value`` is computed by a CumSum or Range through integer arithmetic
    (a bool, a comparison's result, is a mask: not walked)."""
    stack, seen = [value], set()
    while stack and len(seen) <= _CONE_LIMIT:
        value = stack.pop()
        if value is None or id(value) in seen or value.dtype is None or value.dtype.is_float \
                or value.dtype == DType.BOOL:
            continue
        seen.add(id(value))
        producer = value.producer
        if producer is None or producer.domain not in ("", "ai.onnx"):
            continue
        if producer.op_type in ("Range", "CumSum"):
            return True
        if producer.op_type in _POSITION_KEEPING:
            stack.extend(producer.inputs[:1] if producer.op_type == "Gather" else producer.inputs)
    return False


def _score_chain(node: Node) -> list[Node]:
    """``node`` and the nodes carrying its output on to a Softmax or LogSoftmax (included), through
    :data:`_SCORE_CARRYING` ops of its scope."""
    chain, stack, seen = [], [node], set()
    while stack and len(chain) <= _CONE_LIMIT:
        member = stack.pop()
        if id(member) in seen:
            continue
        seen.add(id(member))
        chain.append(member)
        if member.op_type in _SCORE_READERS:
            continue
        for out in member.outputs:
            stack.extend(reader for reader in out.consumers() if reader.graph is node.graph
                         and reader.domain in ("", "ai.onnx")
                         and (reader.op_type in _SCORE_CARRYING or reader.op_type in _SCORE_READERS))
    return chain


def _position_cone(node: Node) -> list[Node]:
    """The nodes computing ``node``'s float inputs, if every source they reach is an integer tensor
    (through its conversion to float), a constant or a factory; else (a float graph input, an
    outer-scope value, a control-flow node, more than :data:`_CONE_LIMIT` nodes) none."""
    return _cone_of([v for v in node.inputs if v is not None], node.graph) or []


def _cone_of(values: list[Value], graph) -> list[Node] | None:
    """The nodes of ``graph`` computing ``values`` from integer tensors, constants and factories,
    or None where they read a float graph input, an outer-scope value or a control-flow node (or
    take more than :data:`_CONE_LIMIT` nodes)."""
    cone: list[Node] = []
    seen: set[int] = set()
    stack = list(values)
    while stack:
        value = stack.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        if value.dtype is None:
            return None
        if not value.dtype.is_float:
            continue  # integer data: positions, shapes, indices
        if value.is_constant or "fx.lifted_tensor" in value.meta:  # (a buffer torch.compile passes in)
            continue
        producer = value.producer
        if producer is None or producer.graph is not graph or producer.all_subgraphs():
            return None  # a float graph input or outer-scope value: an activation, not positions
        if id(producer) not in seen:
            seen.add(id(producer))
            if _learned_layer(producer):
                return None  # an image, a waveform or token ids through a layer: an activation
            cone.append(producer)
            if len(cone) > _CONE_LIMIT:
                return None
            inputs = producer.inputs
            if producer.op_type == "Range" and producer.domain in ("", "com.microsoft") and len(inputs) == 3:
                # start + i * delta: positions however far the limit goes (a float graph input or a
                # length computed at run time only sets how many)
                inputs = [inputs[0], inputs[2]]
            stack.extend(v for v in inputs if v is not None)
    return cone


# what a Cast or Constant is, whatever the rules say: cast placement and weight conversion decide them
_SOURCE_REASONS = {
    "Cast": "type conversion: cast placement owns it (folded where it undoes another cast, retargeted where every "
            "reader is low precision), whatever the rule files say",
    "Constant": "a literal: converted offline where every reader is low precision, like an initializer, whatever "
                "the rule files say",
}


# ops that square where two of their inputs are one value: the power op whose rule decides them,
# those two input slots, and how the reason says it. ONNX's Mul and torch's mul; torch's
# addcmul(acc, g, g) (Adam's second moment) and dot products of a vector with itself (sums of squares)
_SQUARES = {"Mul": ("Pow", (0, 1), "by"), "mul": ("pow", (0, 1), "by"),
            **{op: ("pow", slots, "with") for op, slots in (("addcmul", (1, 2)), ("linalg_vecdot", (0, 1)),
                                                           ("vdot", (0, 1)), ("dot", (0, 1)), ("inner", (0, 1)))}}
_TORCH_ONLY_SQUARES = frozenset(_SQUARES) - {"Mul", "mul"}
# torch ops that hand on their input's values in the same order (a view of the same shape, a copy)
_TORCH_COPIES = {"detach", "contiguous", "clone", "alias", "lift_fresh_copy", "view", "reshape", "_unsafe_view",
                 "view_as", "reshape_as", "expand", "expand_as", "broadcast_to"}
# ops whose output is a function of their inputs and arguments alone: the same op applied to the same
# values twice computes the same values (abs(h) * abs(h) squares abs(h), reshape(h) * reshape(h) too)
_PURE = frozenset({"Abs", "Relu", "Neg", "Reshape", "Unsqueeze", "Squeeze", "Flatten", "Transpose", "Expand",
                   "abs", "relu", "neg", "gelu", "silu", "sigmoid", "tanh", "view", "reshape", "_unsafe_view",
                   "unsqueeze", "squeeze", "flatten", "unflatten", "permute", "transpose", "t", "expand",
                   "expand_as", "contiguous", "clone", "slice", "select", "narrow", "view_as", "reshape_as"})


def _square_verdict(node: Node, ctx: Context, verdicts: dict[tuple, _Verdict]) -> tuple[Category, str, str] | None:
    """A value multiplied by itself is a square, as ``Pow(x, 2)`` is: the rules' word on the
    power op decides it (FP16: x^2 overflows for |x| > 256, deny; BF16: infer). Without this,
    ``torch.square(h)`` exported as ``Mul(h, h)`` ran FP16 where ``h.pow(2)`` stayed FP32: a
    squared-ReLU MLP gave NaN. The same holds for ``Mul(x, Identity(x))`` and for an Einsum of a
    value with itself under one subscript (``bd,bd->bd`` squares, ``bd,bd->b`` sums them)."""
    if node.domain != "" or len(node.inputs) < 2:
        return None
    equation = _einsum_square(node)
    torch_op = "fx.torch_name" in node.meta
    if equation is not None:
        power = "pow" if torch_op else "Pow"
        what = f"{node.op_type} {equation!r} of a value with itself"
    else:
        if node.op_type not in _SQUARES or (node.op_type in _TORCH_ONLY_SQUARES and not torch_op):
            return None
        power, slots, word = _SQUARES[node.op_type]
        a, b = (node.inputs[k] if k < len(node.inputs) else None for k in slots)
        base = _same_values(a, b)
        if base is None or (_constant_only(base) and not torch_op):
            # (a square of ONNX constants is known: onnx_constants folds it and holds it if it must;
            # a torch parameter is not folded, and in training it is no constant)
            return None
        what = f"{node.op_type} of a value {word} itself"
    probe = Node(power, [], domain=node.domain)
    probe.opset = node.opset
    category, reason, source, _ = _cached_verdict(probe, ctx, verdicts)
    if category != Category.DENY:
        return None
    return Category.DENY, f"a square ({what}), which the rules treat as {power}: {reason}", source


def _einsum_square(node: Node) -> str | None:
    """The equation of an Einsum of one value with itself under one subscript (squares, or sums of
    them); None for any other node. (ONNX: the loader's note; torch: the call's arguments.)"""
    if node.op_type == "Einsum":
        return node.meta.get("amp.einsum_square")
    origin = node.origin
    if node.op_type != "einsum" or "fx.torch_name" not in node.meta or not getattr(origin, "args", None):
        return None
    equation, *operands = origin.args
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = list(operands[0])
    if not isinstance(equation, str) or len(operands) != 2 or operands[0] is not operands[1]:
        return None
    from ..frontends.onnx_loader import one_subscript_twice

    return equation if one_subscript_twice(equation) else None


def _constant_only(value: Value, depth: int = 0) -> bool:
    """Whether ``value`` is computed from constants alone (no graph input, no run-time shape)."""
    if value.data_known:
        return True
    node = value.producer
    if node is None or depth > 8 or not node.inputs or node.all_subgraphs() or node.op_type in ("Shape", "Size"):
        return False  # (a graph input, a random draw, a run-time shape: not known)
    return all(v is None or _constant_only(v, depth + 1) for v in node.inputs)


def _torch_identity(node: Node) -> bool:
    """A torch op that hands its input on as it is: a permute to the same order, a product with 1
    (decompositions write both: addcmul(z, h, h) becomes mul(mul(h, 1), h))."""
    args = getattr(node.origin, "args", None)
    if not args or len(node.inputs) != 1:
        return False
    if node.op_type == "permute" and len(args) > 1 and isinstance(args[1], (list, tuple)):
        return list(args[1]) == list(range(len(args[1])))
    if node.op_type in ("mul", "div", "true_divide") and len(args) == 2:
        return any(type(a) in (int, float) and a == 1 for a in args)
    return False


def _same_values(a: Value | None, b: Value | None, depth: int = 0) -> Value | None:
    """The value behind both ``a`` and ``b`` where they hold the same values: one value (through
    copies), or the same pure op with the same arguments applied to values that are (``abs(h)``
    twice, ``h.unsqueeze(-1)`` twice: export and the ONNX exporters keep such twins apart); None
    where that is not shown."""
    a, b = _copied_from(a), _copied_from(b)
    if a is None or b is None:
        return None
    if a is b:
        return a
    first, second = a.producer, b.producer
    if depth >= 4 or first is None or second is None or first.op_type not in _PURE \
            or (first.op_type, first.domain) != (second.op_type, second.domain) or len(first.outputs) != 1 \
            or len(second.outputs) != 1 or len(first.inputs) != len(second.inputs) or not first.inputs \
            or _arguments(first) != _arguments(second):
        return None
    base = None
    for x, y in zip(first.inputs, second.inputs):
        if x is None or y is None:
            if x is not y:
                return None
            continue
        same = x if x is y else _same_values(x, y, depth + 1)
        if same is None:
            return None
        base = base if base is not None else same
    return base


def _arguments(node: Node):
    """What besides its tensor inputs decides a node's output: its attributes (ONNX), or the
    call's arguments with each tensor replaced by a marker (torch)."""
    origin = node.origin
    if "fx.torch_name" not in node.meta or not hasattr(origin, "args"):
        return sorted((k, repr(v)) for k, v in node.attrs.items())

    def marked(x):  # (an fx node is told by its fields: the passes import no framework)
        if isinstance(x, (tuple, list)):
            return type(x)(marked(item) for item in x)
        if isinstance(x, dict):
            return {k: marked(v) for k, v in x.items()}
        return "<tensor>" if hasattr(x, "op") and hasattr(x, "target") and hasattr(x, "graph") else x

    return repr((marked(origin.args), marked(origin.kwargs)))


def _copied_from(value: Value | None) -> Value | None:
    """The value ``value`` copies unchanged: through Identity and Casts to the type it already has
    (ONNX), and torch's copies and same-shape views."""
    for _ in range(8):
        node = value.producer if value is not None else None
        if node is None or node.domain != "" or not node.inputs or node.inputs[0] is None:
            break
        if node.op_type == "Identity" or (node.op_type == "Cast" and node.inputs[0].dtype is not None
                                          and node.inputs[0].dtype == value.dtype):
            value = node.inputs[0]
        elif "fx.torch_name" in node.meta and node.inputs[0].shape == value.shape and value.shape is not None \
                and (node.op_type in _TORCH_COPIES or _torch_identity(node)):
            value = node.inputs[0]  # (h.detach(), h.contiguous(), h.view(h.shape): h's values in h's order)
        else:
            break
    return value


def _own_source(node: Node, category: Category, source: str, ctx: Context) -> None:
    """A Cast or Constant that a rule (or its absence) puts in a list other than clear: painting
    never reads that category (cast placement folds or retargets a Cast, weight conversion converts
    a literal), so the node entry says what the rewrite does with it instead, and a user's rule
    naming it another way gets a note: it pins nothing (an unlisted Cast was counted "kept FP32"
    while it was folded away, a deny Constant was converted all the same)."""
    if category != Category.UNLISTED and is_user_source(source):
        note = (f"without effect: {source} makes {node.op_type} {category.value}, but cast placement and weight "
                f"conversion decide Cast and Constant nodes whatever the rules say; to keep a value FP32, pin the "
                f"nodes that read it (--fp32-nodes)")
        if note not in ctx.log.notes:
            ctx.log.notes.append(note)
    node.meta["amp.category"], node.meta["amp.reason"], node.meta["amp.source"] = \
        Category.CLEAR, _SOURCE_REASONS[node.op_type], "classify"


def _count_unlisted(node: Node, category: Category, ctx: Context) -> None:
    # (a torch conversion is the IR's Cast, which torch rule files cannot name: fx_api's
    # _explain_conversions classifies it by the name the model called, clear where none names it)
    if category == Category.UNLISTED and not (node.op_type == "Cast" and "fx.torch_name" in node.meta):
        ctx.log.unlisted_ops[node.qualified_op] = ctx.log.unlisted_ops.get(node.qualified_op, 0) + 1


def _fix_fp32(node: Node, category: Category, reason: str, source: str) -> None:
    node.meta.update({"amp.category": category, "amp.reason": reason, "amp.source": source,
                      "amp.precision": Precision.FP32, "amp.participates": False})


def _lookup(node: Node, ctx: Context, verdicts: dict[tuple, _Verdict], names: frozenset[str]) -> _Verdict:
    kept = node.meta.get("amp.fused_fp32")  # (onnx_fuse: a LayerNorm fused to stay FP32, and why)
    if kept is not None:
        return Category.DENY, f"a decomposed LayerNorm fused to stay FP32: {kept[0]}", kept[1], None
    node_rule = node_rule_of(ctx.rules, node, names)
    if node_rule is not None:
        if node_rule.precision == Precision.FP32:
            return Category.DENY, f"node rule {node_rule.pattern!r} keeps it FP32", node_rule.source, None
        missing = missing_low_kernel(ctx, node.op_type, node.domain, node.opset)
        if missing:  # (the kernel table is a safety net under node rules too)
            return Category.DENY, f"{missing}, so node rule {node_rule.pattern!r} cannot make it low", \
                "kernel table", None
        return Category.ALLOW, f"node rule {node_rule.pattern!r} makes it low precision", node_rule.source, None
    verdict = _cached_verdict(node, ctx, verdicts)
    earlier = earlier_pin(node)
    # (this run's --fp16-ops or rule file wins over an earlier op pin, not over an earlier node pin:
    # a node rule beat the op flags in that run too, and its pattern may name a member of what was
    # fused since, which it matches no more)
    if earlier and (not is_user_source(verdict[2]) or is_node_source(earlier)):
        return (Category.DENY, f"kept FP32: an earlier rewrite of this model pinned it ({earlier}), as its tags say",
                earlier, None)
    return verdict


def _cached_verdict(node: Node, ctx: Context, verdicts: dict[tuple, _Verdict]) -> _Verdict:
    """:func:`_op_verdict`, once per (op, domain, opset)."""
    key = (node.op_type, node.domain, node.opset)
    if key not in verdicts:
        verdicts[key] = _op_verdict(node, ctx)
    return verdicts[key]


def _op_verdict(node: Node, ctx: Context) -> _Verdict:
    """What the op rules and the kernel table say of the node's op at its opset."""
    entry = ctx.rules.lookup(node.op_type, node.domain, node.opset)
    if entry is None:
        others = ctx.rules.lookup(node.op_type, node.domain)  # (an entry for other opsets: a file's range)
        if others is not None and node.opset is not None:
            covered = f"{others.since or 1} to {others.until}" if others.until else f"{others.since} on"
            return (Category.UNLISTED, f"no rule covers {node.qualified_op} at opset {node.opset} ({others.source} "
                                       f"covers opsets {covered}): kept FP32; extend its range or add an entry "
                                       f"for this opset", "unlisted", None)
        return (Category.UNLISTED, f"no rule names {node.qualified_op}: kept FP32; classify it in a rule file",
                "unlisted", None)
    category, reason, source = entry.category, entry.reason, entry.source
    if category != Category.DENY:
        missing = missing_low_kernel(ctx, node.op_type, node.domain, node.opset)
        if missing:
            return Category.DENY, missing, "kernel table", entry
    return category, reason, source, entry


def missing_low_kernel(ctx: Context, op: str, domain: str, opset: int | None) -> str | None:
    """Why the provider cannot run ``op`` in the target type at ``opset`` (None if it can, or if
    the bundled kernel table does not know the provider or the op: then the rules decide)."""
    provider = ctx.options.provider or ctx.rules.provider
    if ctx.rules.frontend != "onnx" or not provider or opset is None:
        return None
    from .. import kernels

    if not kernels.knows_provider(provider):
        return None  # a provider outside the bundled table (e.g. TensorRT): the rules decide
    low = "bfloat16" if ctx.low == DType.BFLOAT16 else "float16"
    if kernels.has_kernel(provider, op, opset, low, domain):
        return None
    qualified = f"{domain}::{op}" if domain else op
    if not kernels.has_kernel(provider, op, opset, "float", domain):
        if domain or op not in kernels.known_ops(""):
            return None  # unknown to the provider's table (custom op, function): the rules decide
        # a standard op the provider runs in no float type (Det, Hardmax on CUDA): onnxruntime
        # places it on the CPU provider, whose low kernels the table does not promise either
        return f"{provider} has no kernel for {qualified} at opset {opset} (it runs on the CPU provider)"
    return f"{provider} has no {low} kernel for {qualified} at opset {opset}"


def _schema_refuses_low(node: Node, group: str, ctx: Context) -> str | None:
    """The op's own schema at this opset does not allow the low type for the painted group
    (ConstantOfShape below opset 20 has no bfloat16 output, for example): whatever the rules say."""
    allowed = node.meta.get("group_types", {}).get(group)
    low = "bfloat16" if ctx.low == DType.BFLOAT16 else "float16"
    if not allowed or low in allowed:
        return None
    return f"the {node.qualified_op} schema at opset {node.opset} does not allow {low} for {group}"


_BF16_CAST_OPSET = 13  # Cast-6 and Cast-9 have no tensor(bfloat16); Cast-13 added it


def _cast_refuses_low(node: Node, ctx: Context) -> str | None:
    """Below ai.onnx opset 13 no Cast can make or read bfloat16: a com.microsoft op with a BF16
    kernel (FusedMatMul, Attention) painted BF16 there gave Casts the checker and onnxruntime
    refuse (the ai.onnx ops' own schemas have no bfloat16 there either)."""
    opset = node.graph.opsets.get("") if ctx.low == DType.BFLOAT16 and node.graph is not None else None
    if opset is None or opset >= _BF16_CAST_OPSET:
        return None
    return (f"Cast at ai.onnx opset {opset} has no bfloat16 (from opset {_BF16_CAST_OPSET} on), so no value can "
            f"be cast to it; convert the model to opset {_BF16_CAST_OPSET} or later for bf16")


def _pinned_inputs(node: Node, entry) -> tuple[int, ...]:
    if entry is None or not entry.fp32_inputs:
        return ()
    names = node.meta.get("input_names", [])
    out = []
    for item in entry.fp32_inputs:
        if isinstance(item, int):
            out.append(item)
        elif item in names:
            out.append(names.index(item))
    return tuple(i for i in out if i < len(node.inputs))


def _input_name(node: Node, index: int) -> str:
    names = node.meta.get("input_names", [])
    return repr(names[index]) if index < len(names) else f"#{index}"
