"""The one place that knows the pipeline order:
load → fuse (ONNX) → classify → paint → islands → place casts (folding existing casts) → verify → emit → report.
"""

from __future__ import annotations

import functools
import gc
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, ParamSpec, Sequence, TypeVar

from .decisions import ALIGNMENT_OPS, HEAVY_OPS, Category, Decision, DecisionLog, Precision
from .errors import ModelLoadError, OutputError, UsageError
from .ir import DType, Model, Node, verify
from .passes.base import Context, Options, given_low_type, is_user_source, node_label, run_passes
from .passes.classify import classify
from .passes.islands import attach_cast_counts, find_islands
from .passes.paint import paint
from .passes.place_casts import place_casts

if TYPE_CHECKING:
    from .report import Report
    from .rulebook import RuleBook

TARGETS = ("fp16", "bf16")
# An input file above this is written with external data: its output could pass protobuf's 2 GB limit.
EXTERNAL_DATA_ABOVE = (1 << 31) - (64 << 20)


@dataclass
class RewriteResult:
    """What a rewrite produced: the model (ONNX ModelProto, onnx-ir Model or GraphModule), the
    decision log, whether anything changed, and the files written."""

    model: Any
    log: DecisionLog
    modified: bool
    outputs: list[Path] = field(default_factory=list)
    source: str | None = None

    @property
    def report(self) -> "Report":
        from .report import Report

        return Report.from_log(self.log, source=self.source, output=str(self.outputs[-1]) if self.outputs else None)


def rule_book(rules: Any, *, frontend: str, target: str, fp32_ops: Any = (), fp16_ops: Any = (),
              fp32_nodes: Any = (), fp16_nodes: Any = ()) -> "RuleBook":
    """The rules a rewrite uses: ``rules`` (rule files, or a RuleBook that must fit the rewrite)
    with the user's op flags and node pins on top, as load_rules puts them over its files."""
    from .rulebook import RuleBook, load_rules

    pins = dict(fp32_ops=_as_list("fp32_ops", fp32_ops), low_ops=_as_list("fp16_ops", fp16_ops),
                fp32_nodes=_as_list("fp32_nodes", fp32_nodes), low_nodes=_as_list("fp16_nodes", fp16_nodes))
    if isinstance(rules, RuleBook):
        for what, wanted, have in (("frontend", frontend, rules.frontend), ("target", target, rules.target)):
            if have != wanted:
                raise UsageError(f"rules: the RuleBook given was composed for {what} {have!r}, this rewrite's is "
                                 f"{wanted!r}; build it with load_rules(..., {what}={wanted!r})")
        return rules.with_overrides(**pins)
    return load_rules([os.fspath(r) for r in _as_list("rules", rules)], frontend=frontend, target=target, **pins)


def make_context(*, frontend: str, target: str = "fp16", rules: Iterable[str | os.PathLike] | "RuleBook" = (),
                 keep_io_types: bool = True, training: bool = False, fp32_nodes: Sequence[str] = (),
                 fp16_nodes: Sequence[str] = (), fp32_ops: Sequence[str] = (), fp16_ops: Sequence[str] = (),
                 placement: str | None = None, loss: str | None = None, verify_each: bool = False,
                 fuse: bool = True, inline_functions: bool = True) -> Context:
    """``placement`` defaults to ``optimal`` (the exact min-cut) for ONNX and to ``greedy`` for
    torch, whose painter mirrors CUDA autocast node by node (``tests/test_fx_autocast.py``)."""
    if placement is None:
        placement = "optimal" if frontend == "onnx" else "greedy"
    flags = dict(keep_io_types=keep_io_types, training=training, verify_each=verify_each, fuse=fuse,
                 inline_functions=inline_functions)
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise UsageError(f"{name}={value!r}: pass True or False")
    # one name or path where a list is expected is that one item (a str is iterable letter by letter)
    fp32_nodes, fp16_nodes, fp32_ops, fp16_ops = (_as_list(name, v) for name, v in (
        ("fp32_nodes", fp32_nodes), ("fp16_nodes", fp16_nodes), ("fp32_ops", fp32_ops), ("fp16_ops", fp16_ops)))
    if target not in TARGETS:
        raise UsageError(f"unknown target {target!r}: choose one of {', '.join(TARGETS)}")
    if placement not in ("greedy", "optimal"):
        raise UsageError(f"unknown placement {placement!r}: choose greedy or optimal")
    book = rule_book(rules, frontend=frontend, target=target, fp32_ops=fp32_ops, fp16_ops=fp16_ops,
                     fp32_nodes=fp32_nodes, fp16_nodes=fp16_nodes)
    if frontend == "onnx":
        from .frontends.onnx_loader import check_rule_input_names

        check_rule_input_names(book)
    options = Options(target=target, keep_io_types=keep_io_types, training=training, placement=placement,
                      loss=loss, verify_each=verify_each, fuse=fuse, inline_functions=inline_functions)
    return Context(rules=book, options=options, log=DecisionLog(target=target))


# what rewrite(training=True, loss=...) takes beyond make_context's options (training_onnx): the
# loss scale's settings (training_onnx.ScaleConfig) and the gradients' names
SCALE_OPTIONS = ("growth_factor", "backoff_factor", "growth_interval", "min_scale", "max_scale", "dynamic")
_ONNX_TRAINING_OPTIONS = ("grads", "loss_grad", "loss_scaling", *SCALE_OPTIONS)


def context_for(frontend: str, options: dict[str, Any], where: str) -> Context:
    """``make_context`` with the caller's keyword options, where a name it does not take is a
    UsageError naming the closest one (not Python's TypeError from deep inside)."""
    import difflib
    import inspect

    known = [p for p in inspect.signature(make_context).parameters if p != "frontend"]
    unknown = [k for k in options if k not in known]
    if unknown:
        # (an ONNX rewrite with training=True and loss= takes the training graph's options too)
        offered = known + (list(_ONNX_TRAINING_OPTIONS) if frontend == "onnx" else [])
        close = difflib.get_close_matches(unknown[0], offered, n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]!r}?)" if close else f"; it takes: {', '.join(offered)}"
        raise UsageError(f"{where} got an unknown option {unknown[0]!r}{hint}")
    return make_context(frontend=frontend, **options)


def flag(name: str, value: Any, *, none: bool = False) -> Any:
    """A True/False option (None too where ``none``); anything else is a UsageError ("no" is truthy)."""
    if isinstance(value, bool) or (none and value is None):
        return value
    raise UsageError(f"{name}={value!r}: pass True or False" + (" (or None)" if none else ""))


def _as_list(name: str, value: Any) -> list:
    if isinstance(value, str) or (name == "rules" and isinstance(value, os.PathLike)):
        return [value]
    if value is None:
        return []
    if isinstance(value, dict):  # (its keys would be taken for the names: rules={"deny": ...} read files 'deny'...)
        raise UsageError(f"{name}: a dict is not a list of names or paths; write rules in a rule file and pass its "
                         f"path" if name == "rules" else f"{name}: pass a list of names (or one name), not a dict")
    try:
        items = list(value)
    except TypeError:
        raise UsageError(f"{name}={value!r}: pass a list (or one name)") from None
    paths = name == "rules"
    bad = [item for item in items if not isinstance(item, (str, os.PathLike) if paths else str)]
    if bad:
        raise UsageError(f"{name}: {bad[0]!r} is not a {'name or path' if paths else 'name (a str)'}")
    return items


def run_pipeline(model: Model, ctx: Context) -> bool:
    """Run the passes on the IR; returns whether anything changed. Verifies the IR at the end."""
    passes = [classify, paint, find_islands]
    if model.frontend == "onnx":
        from .frontends.onnx_constants import mark_out_of_range_constants
        from .frontends.onnx_fuse import fuse

        passes[:0] = [fuse, mark_out_of_range_constants]
    if ctx.options.placement == "optimal":
        from .passes.optimal import optimise_placement

        passes.append(optimise_placement)
    passes.append(place_casts)
    results = run_passes(model, ctx, passes)
    if model.frontend == "onnx":
        # The proto the model was read from served the passes' shape proofs. Let it go: where
        # every weight is converted, it is the last holder of the FP32 originals (densenet121's
        # 32 MB stayed resident through the save while it was kept).
        model.origin.proto = None
    attach_cast_counts(ctx.log)
    _record_decisions(model, ctx)
    verify(model.graph)
    modified = any(r.modified for r in results)
    if modified and model.frontend == "onnx" and model.graph.opsets.get("", 0) >= 17:
        entered = [i for i in ctx.log.islands if i.pattern == "LayerNorm" and i.casts_in and _ort_can_fuse(model, i)
                   and _cast_is_x(model, i) and _whole_layernorm(model, i) and _means_end_at_the_last_axis(model, i)]
        if entered:  # (frontends/onnx_fuse.py: what fusing it would have avoided)
            why, fix = ("--no-fuse", "rewrite without --no-fuse to avoid it") if not ctx.options.fuse else (
                "a form the fuse pass does not take, such as an epsilon outside (0, 1) or not a scalar",
                "--fp32-nodes on the node feeding the island keeps the Cast out")
            ctx.log.notes.append(
                f"onnxruntime: {len(entered)} decomposed LayerNorm island(s) entered through a Cast ({why}): "
                f"onnxruntime's own LayerNormFusion folds that Cast into a LayerNormalization of low-precision X "
                f"and FP32 scale and then refuses the model at its default optimisation levels (it loads with "
                f"graph optimisations off); {fix}")
    if modified and model.frontend == "onnx" and ctx.low == DType.FLOAT16:
        pairs = _batch_transpose_matmuls(model)
        if pairs:
            label, perm = pairs[0]
            # (at ORT_ENABLE_EXTENDED onnxruntime 1.31's CPU provider computes zeros for an FP16
            # DequantizeLinear → MatMul; with graph optimisations off both run correctly)
            dequantized = any(n.op_type == "DequantizeLinear" and n.domain == "" and n.outputs
                              and n.outputs[0].dtype == DType.FLOAT16 for n in model.graph.walk())
            level = ("ORT_DISABLE_ALL (not ORT_ENABLE_EXTENDED: there it computes zeros for the model's FP16 "
                     "DequantizeLinear → MatMul)") if dequantized else "ORT_ENABLE_EXTENDED"
            ctx.log.notes.append(
                f"onnxruntime: {len(pairs)} FP16 Transpose → MatMul pair(s) moving the first axis back (e.g. "
                f"{label!r}, perm={perm}; as around an LSTM): onnxruntime 1.31's CPU provider crashes (SIGSEGV) on "
                f"them at its default optimisation level, ORT_ENABLE_ALL; on the CPU, load the output with {level}")
    retyped = model.meta.get("onnx.retyped")
    if retyped:
        from .frontends.onnx_loader import retyped_summary

        ctx.log.notes.append(f"corrected on load: {len(retyped)} declared type(s) the model's own data or ops "
                             f"contradict, which onnxruntime refuses, written as made: {retyped_summary(retyped)}")
    if modified and model.meta.get("onnx.training_info"):
        ctx.log.notes.append(f"dropped: the model's training_info ({len(model.meta['onnx.training_info'])} "
                             f"TrainingInfoProto) is not in the output: its algorithm binds the FP32 initializers "
                             f"the rewrite converts; build it again for the rewritten model")
    inlined = model.meta.get("onnx.inlined")
    if modified and inlined:  # (unmodified, the output is the input, functions and all)
        listed = ", ".join(f"{name} ×{n}" for name, n in sorted(inlined.items()))
        ctx.log.notes.append(f"model-local functions inlined: {listed} — what each call computes is rewritten, its "
                             f"nodes named under the call's name; --no-inline-functions (inline_functions=False) "
                             f"keeps the calls, and their bodies FP32")
    return modified


def _unchanged_proto(model: Model) -> Any:
    """The proto of a model with nothing rewritten, written through onnx-ir (sorted, retyped or
    read from a path), with its training_info put back: onnx-ir does not carry it, and nothing
    its bindings name changed."""
    from .emitters.onnx_emitter import to_proto

    out = to_proto(model.origin.model)
    out.training_info.extend(model.meta.get("onnx.training_info") or ())
    return out


_LN_STATISTICS = {"ReduceMean": 2, "Sub": 3, "Pow": 1, "Sqrt": 1}  # op -> most reads onnxruntime's pattern makes


def _ort_can_fuse(model: Model, island) -> bool:
    """Whether onnxruntime's LayerNormFusion can take the island's LayerNorm: it fuses only where
    the pattern's statistics (the means, ``x - mean``, its square, the deviation) are read by the
    pattern alone: no more reads than it makes, none a graph output. A training graph's backward
    pass reads them too (a Reciprocal of the deviation): no fusion there, and the model loads."""
    members = set(island.members)
    scope = next((g for g in model.graph.scopes() if any(node_label(n) in members for n in g.nodes)), None)
    if scope is None:
        return True
    for node in scope.nodes:
        most = _LN_STATISTICS.get(node.op_type)
        if most is None or node_label(node) not in members:
            continue
        reads = [reader for out in node.outputs for reader, _ in out.uses()]
        if node.op_type == "Sub" and any(reader.op_type == "Pow" for reader in reads):
            most = 2  # (x - mean read by its Pow and the Div; squared by a Mul, it is read twice there)
        if len(reads) > most or any(out.is_graph_output for out in node.outputs):
            return False
    return True


def _whole_layernorm(model: Model, island) -> bool:
    """Whether the island holds the tail of a decomposed LayerNorm whole: its division, the scale
    Mul reading it and the bias Add reading that. onnxruntime's LayerNormFusion takes only that
    form; without the bias Add, or with a member a pin made low (a Cast inside the pattern), it
    fuses nothing, the model loads, and the warning was false."""
    members = set(island.members)

    def only_reader(node: Node, op: str) -> Node | None:
        readers = [reader for out in node.outputs for reader, _ in out.uses()]
        found = readers[0] if len(readers) == 1 else None
        return found if found is not None and found.op_type == op and node_label(found) in members else None

    for node in model.graph.walk():
        if node.op_type == "Div" and node_label(node) in members:
            scale = only_reader(node, "Mul")
            if scale is not None and only_reader(scale, "Add") is not None:
                return True
    return False


def _means_end_at_the_last_axis(model: Model, island) -> bool:
    """Whether the island's ReduceMeans may be what onnxruntime's LayerNormFusion takes: consecutive
    axes ending at the last one (a positive axis needs a known rank). A channels-first LayerNorm
    (ConvNeXt's, mean over axis 1) is not fused: the model loads, and the warning was false. True
    where the axes cannot be read (the warning errs on the side of saying)."""
    from .frontends.onnx_loader import constant_array

    members = set(island.members)
    for node in model.graph.walk():
        if node.op_type != "ReduceMean" or node.domain != "" or node_label(node) not in members or not node.inputs:
            continue
        attr = node.origin.attributes.get("axes") if getattr(node.origin, "attributes", None) is not None else None
        if attr is not None:
            axes = list(attr.as_ints())
        elif len(node.inputs) > 1 and node.inputs[1] is not None:
            data = constant_array(node.inputs[1])
            if data is None:
                return True
            axes = [int(a) for a in data.reshape(-1)]
        else:
            return True  # (every axis: the last included)
        x = node.inputs[0]
        rank = len(x.shape) if x is not None and x.shape is not None else None
        if any(a >= 0 for a in axes) and rank is None:
            return False
        axes = sorted(a - rank if a >= 0 else a for a in axes)
        if not axes or axes[-1] != -1 or any(b != a + 1 for a, b in zip(axes, axes[1:])):
            return False
    return True


def _cast_is_x(model: Model, island) -> bool:
    """Whether the Cast into a LayerNorm island makes the normalised input X itself (what its mean and
    ``x - mean`` read): only that Cast does onnxruntime's LayerNormFusion fold into a node of mixed
    types. One into a member before X (the residual Add of a pre-LN block, x + Cast(o)) leaves X
    FP32: the model loads, and the warning was false."""
    members = set(island.members)
    for node in model.graph.walk():
        if node.op_type != "ReduceMean" or node_label(node) not in members or not node.inputs:
            continue
        x = node.inputs[0]
        if x is not None and any(r.op_type == "Sub" and node_label(r) in members for r, _ in x.uses()):
            return x.producer is not None and x.producer.op_type == "Cast"
    return False  # (no mean of X in the island: a pin made it low, a Cast sits inside; nothing to fold)


def _batch_transpose_matmuls(model: Model) -> list[tuple[str, list[int]]]:
    """(label, perm) of the FP16 Transposes a MatMul reads whose perm moves the first axis behind
    the batch axes, alone or with the last two swapped (``[1, 0, 2]``, ``[1, 2, 0]``; in 4-D
    ``[1, 2, 0, 3]``, ``[1, 2, 3, 0]``: what onnxruntime's MatMulTransposeFusion folds into a
    FusedMatMul's transBatch): onnxruntime 1.31's CPU provider dies on such a pair at
    ORT_ENABLE_ALL (found by the fuzzer; the corpus's LSTM models have it;
    ``test_known_ort_fp16_transpose_matmul_crash`` says when onnxruntime fixes it)."""
    found = []
    for node in model.graph.walk():
        if node.op_type != "Transpose" or node.domain != "" or not node.outputs:
            continue
        out = node.outputs[0]
        if out.dtype != DType.FLOAT16 or not any(c.op_type == "MatMul" and c.domain == "" for c, _ in out.uses()):
            continue
        perm = node.origin.attributes.get("perm") if getattr(node.origin, "attributes", None) is not None else None
        order = list(perm.as_ints()) if perm is not None else []
        rank = len(order)
        if rank >= 3 and order in ([*range(1, rank - 1), 0, rank - 1], [*range(1, rank - 1), rank - 1, 0]):
            found.append((node_label(node), order))
    return found


def _record_pins(model: Model, ctx: Context, internal: Iterable[str] = ()) -> bool:
    """Whether the output must be written although nothing runs low: this run's pins (--fp32-nodes,
    --fp32-ops, --auto-fp32's, a user rule file's) kept nodes FP32 and the model's tags do not say
    so yet. A copy of the input would drop them, and rewriting that copy again would make the
    pinned nodes low; the written output carries them in its tags. ``internal``: labels of nodes
    the caller pinned itself (a training rewrite's loss island), decided afresh each time."""
    internal = set(internal)

    def untagged_pin(node) -> bool:
        meta = node.meta
        source = meta.get("amp.source") or ""
        return (meta.get("amp.precision") == Precision.FP32 and meta.get("amp.category") == Category.DENY
                and node_label(node) not in internal and is_user_source(source)
                and meta.get("amp.kept_fp32_by") != source)

    pinned = [n for n in model.graph.walk() if untagged_pin(n)]
    if pinned:
        # ("the rewrite moves nothing": nodes the model computes in a low type itself run in it as given)
        ctx.log.notes.append(f"as pinned: the rewrite moves nothing to {ctx.options.target}; the output is the input "
                             f"with tags that keep the {len(pinned)} pinned node(s) FP32 when it is rewritten again")
    return bool(pinned)


def _record_decisions(model: Model, ctx: Context) -> None:
    from collections import Counter

    given: Counter = Counter()  # nodes that compute in a low type already: (type, heavy) → count
    for node in model.graph.walk():
        meta = node.meta
        if meta.get("amp.inserted"):
            continue
        if meta.get("amp.category") is None:
            low = given_low_type(node)
            if low is not None and not (node.domain == "" and node.op_type in ("Cast", "Constant")) \
                    and not meta.get("onnx.given_saturate"):  # (an earlier rewrite's clamp of a masked sum)
                given[low.short, node.qualified_op in HEAVY_OPS] += 1
            continue
        precision = meta.get("amp.precision", Precision.NONE)
        ctx.log.decide(Decision(
            node=node_label(node), op=node.qualified_op, category=meta["amp.category"], precision=precision,
            reason=meta.get("amp.reason", ""), source=meta.get("amp.source", ""), step=meta.get("amp.step", "classify"),
            via=meta.get("amp.via"), island=meta.get("amp.island")))
        if node.domain == "" and node.op_type in ALIGNMENT_OPS:
            operands = [node.inputs[i] for i in ALIGNMENT_OPS[node.op_type] if i < len(node.inputs)]
            ctx.log.operand_shapes[node_label(node)] = [
                list(v.shape) if v is not None and v.shape is not None else None for v in operands]
        elif (equation := _einsum_gemm(node)) is not None:  # (its equation third: its dims depend on it)
            ctx.log.operand_shapes[node_label(node)] = [
                list(v.shape) if v is not None and v.shape is not None else None for v in node.inputs] + [equation]
    # A model that is partly (or wholly: an output rewritten again) low precision already: those
    # nodes take no decision, so the summary's counts would leave them out without a word.
    for low in sorted({t for t, _ in given}):
        total, heavy = given[low, False] + given[low, True], given[low, True]
        ctx.log.notes.append(f"as given: {total} nodes already compute in {low}"
                             + (f" ({heavy} of them MatMul/Gemm/Conv/attention)" if heavy else "")
                             + "; they keep their types")


def _einsum_gemm(node: Node) -> str | None:
    """The equation of an Einsum (ONNX) or einsum (torch) of two operands that contracts a label
    both hold (a GEMM, tensor cores tile it as MatMul's); None for any other node."""
    if node.domain != "" or node.op_type not in ("Einsum", "einsum") or len(node.inputs) != 2:
        return None
    if node.op_type == "Einsum":
        from .frontends.onnx_loader import _einsum_equation

        equation = _einsum_equation(node.origin) if node.origin is not None else None
    else:
        args = getattr(node.origin, "args", None)
        equation = args[0] if args and "fx.torch_name" in node.meta else None
    if not isinstance(equation, str):
        return None
    from .report import einsum_gemm_labels

    labels = einsum_gemm_labels(equation)
    return equation if labels is not None and labels[2] else None


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _gc_paused(func: Callable[_P, _R]) -> Callable[_P, _R]:
    """Run without the cyclic garbage collector. A rewrite allocates millions of small objects
    (nodes and values point at each other) that stay alive until it returns, so every collection
    scans them all for nothing: about 45% of the time on a 100k-node graph."""

    @functools.wraps(func)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            return func(*args, **kwargs)
        finally:
            if was_enabled:
                gc.enable()

    return wrapper


# -- ONNX ------------------------------------------------------------------------------------------------
@_gc_paused
def rewrite_onnx(src: str | os.PathLike, dst: str | os.PathLike | None = None, *, overwrite: bool = False,
                 external_data: bool | None = None, **options: Any) -> RewriteResult:
    """Rewrite an ONNX file. ``dst`` defaults to ``<stem>.fp16.onnx`` (or ``.bf16``) next to ``src``.

    The input is never modified; the output is written atomically (external data, if any, to a
    fresh ``<dst>.data``). Options are those of :func:`make_context` but ``frontend`` (``onnx``
    here); with ``training=True`` and ``loss``, also those of
    :func:`amp_rewrite.training_onnx.rewrite_training_onnx` (``grads``, ``loss_grad``,
    ``loss_scaling`` and the loss scale's settings)."""
    from .emitters.onnx_emitter import save_onnx
    from .frontends.onnx_loader import load_onnx

    flag("overwrite", overwrite)
    flag("external_data", external_data, none=True)
    if isinstance(dst, str) and dst.endswith(("/", os.sep)):  # (Path() would drop the slash: a file 'outdir')
        raise OutputError(f"{dst}: ends with a slash, so it names a folder; pass the output file's path")
    for name, value in (("src", src), ("dst", dst)):
        if not isinstance(value, (str, os.PathLike)) and not (name == "dst" and value is None):
            raise UsageError(f"rewrite_onnx: {name} must be a path, got {type(value).__name__}"
                             + (" (for a ModelProto use rewrite())" if name == "src" else ""))
    if _training_graph(options):
        # an ONNX training graph: the loss-scale (and unscale/all_finite) nodes go in too, as
        # rewrite() does for a ModelProto
        from .training_onnx import rewrite_training_onnx

        options = {k: v for k, v in options.items() if k != "training"}
        return rewrite_training_onnx(src, dst, overwrite=overwrite, external_data=external_data, **options)
    src_path = Path(src)
    default = default_output(src_path, options.get("target", "fp16"))
    dst_path = Path(dst) if dst is not None else default
    _check_output(src_path, dst_path, overwrite, default.name)
    ctx = context_for("onnx", options, "rewrite_onnx()")
    from . import progress

    with progress.stages(["load", "rewrite", "write"], desc=src_path.name) as stage:
        stage("load")
        model = load_onnx(src_path, inline_functions=ctx.options.inline_functions)
        _refuse_retarget(model, ctx.options.target)
        source_files = _input_files(model, src_path)
        if dst_path.resolve() in source_files:
            raise OutputError(f"{dst_path}: is a file the input reads its external data from; choose another -o "
                              f"(the input is never modified)")
        stage("rewrite")
        modified = run_pipeline(model, ctx) or _record_pins(model, ctx)
        stage("write")
        if not modified:
            if model.meta.get("onnx.inlined"):  # (the output is then the input, functions and all)
                model = load_onnx(src_path)
            use_external = external_data if external_data is not None else _needs_external(model, src_path)
            written = _copy_unchanged(src_path, dst_path, model, use_external, source_files, overwrite)
            return RewriteResult(model.origin.model, ctx.log, False, written, source=str(src_path))
        from .emitters.onnx_emitter import emit_onnx

        ir_model = emit_onnx(model, ctx.log)
        use_external = external_data if external_data is not None else _needs_external(model, src_path, ir_model)
        written = save_onnx(ir_model, dst_path, external=use_external, source_files=source_files, overwrite=overwrite)
    return RewriteResult(ir_model, ctx.log, True, written, source=str(src_path))


@_gc_paused
def rewrite_onnx_model(proto: Any, **options: Any) -> RewriteResult:
    """Rewrite an in-memory ModelProto; the argument is not modified."""
    from .emitters.onnx_emitter import emit_onnx, to_proto
    from .frontends.onnx_loader import load_onnx

    if not isinstance(proto, (str, os.PathLike)) and type(proto).__name__ != "ModelProto":  # (api.py imports no onnx)
        raise UsageError(f"rewrite_onnx_model takes an onnx.ModelProto (or a path), got {type(proto).__name__}"
                         + (": for a torch module use amp_rewrite.rewrite()" if _is_torch_module(proto) else ""))
    if _training_graph(options):  # (as rewrite() and rewrite_onnx() do: the loss-scale nodes go in too)
        from .training_onnx import rewrite_training_onnx_model

        return rewrite_training_onnx_model(proto, **{k: v for k, v in options.items() if k != "training"})
    ctx = context_for("onnx", options, "rewrite()")
    model = load_onnx(proto, inline_functions=ctx.options.inline_functions)
    _refuse_retarget(model, ctx.options.target)
    source = os.fspath(proto) if isinstance(proto, (str, os.PathLike)) else None
    modified = run_pipeline(model, ctx) or _record_pins(model, ctx)
    if not modified:
        if model.meta.get("onnx.inlined"):  # (the output is then the input, functions and all)
            model = load_onnx(proto)
        # ONNX requires topological order: the sorted copy (or retyped: onnx_loader._trust_actual_types);
        # a path's model: the one read
        if model.meta.get("onnx.changed_on_load") or source is not None:
            return RewriteResult(_unchanged_proto(model), ctx.log, False, source=source)
        out = type(proto)()
        out.CopyFrom(proto)
        return RewriteResult(out, ctx.log, False)
    return RewriteResult(to_proto(emit_onnx(model, ctx.log)), ctx.log, True, source=source)


def rewrite(obj: Any, *, report: bool = False, **options: Any) -> Any:
    """Rewrite an ``onnx.ModelProto`` (returns a ModelProto) or a torch ``nn.Module`` /
    ``fx.GraphModule`` (returns a GraphModule). ``report=True`` returns ``(model, Report)``."""
    flag("report", report)
    result = _dispatch(obj, **options)
    return (result.model, result.report) if report else result.model


def _training_graph(options: dict[str, Any]) -> bool:
    """Whether ONNX options ask for a training graph (the loss-scale nodes go in): ``training``
    with ``loss``. ``loss`` alone, or not a name, is a UsageError; ``training`` alone keeps the
    weights FP32 (cast at use) and adds no loss scaling."""
    if "training" in options:
        flag("training", options["training"])
    loss = options.get("loss")
    if loss is not None and not isinstance(loss, str):
        raise UsageError(f"loss={loss!r}: pass the name of the loss output")
    if loss is not None and not options.get("training"):
        raise UsageError("loss names the output to scale for training: pass training=True with it (or drop it)")
    if "loss_scaling" in options and not (options.get("training") and loss):
        raise UsageError("loss_scaling applies to a training graph: pass training=True and loss='<loss output>' "
                         "with it (or drop it)")
    for key in ("grads", "loss_grad"):  # (they were called unknown options, though the README lists them)
        if options.get(key) is not None and not (options.get("training") and loss):
            raise UsageError(f"{key} applies to a training graph: pass training=True and loss='<loss output>' "
                             f"with it (or drop it)")
    return bool(options.get("training") and loss)


def _refuse_retarget(model: Any, target: str) -> None:
    """A model amp-rewrite already rewrote to one low type, asked for the other: its low nodes
    would stay as they are, and a .bf16 file would hold FP16. Say so instead."""
    import json

    origin = getattr(model, "origin", None)
    props = getattr(getattr(origin, "model", None), "metadata_props", None) or {}
    try:
        before = json.loads(props.get("amp_rewrite.report", "{}")).get("target")
    except (ValueError, AttributeError):
        return
    if before and before != target:
        raise UsageError(f"this model was rewritten to {before} already (its amp_rewrite metadata says so); "
                         f"rewrite the FP32 original for {target}")


def _dispatch(obj: Any, **options: Any) -> RewriteResult:
    kind = type(obj).__module__
    if kind.startswith("onnx") and type(obj).__name__ == "ModelProto":
        return rewrite_onnx_model(obj, **options)  # (a training graph included)
    if isinstance(obj, (str, os.PathLike)):
        raise UsageError("rewrite() takes a model object; for files use rewrite_onnx(src, dst)")
    if _is_torch_module(obj):
        from .fx_api import rewrite_torch

        return rewrite_torch(obj, **options)
    raise UsageError(f"rewrite() does not know how to rewrite a {type(obj).__name__}: pass an onnx.ModelProto, "
                     f"a torch.nn.Module or a torch.fx.GraphModule")


def _is_torch_module(obj: Any) -> bool:
    import sys

    torch = sys.modules.get("torch")
    exported = getattr(getattr(torch, "export", None), "ExportedProgram", None) if torch is not None else None
    return torch is not None and (isinstance(obj, torch.nn.Module) or (exported is not None and isinstance(obj, exported)))


# -- file handling -------------------------------------------------------------------------------------
def default_output(src: Path, target: str, kind: str = "") -> Path:
    """``<stem>.<target><kind>.onnx`` next to ``src`` (``kind``: ".train" for training rewrites).
    A directory names no model (and "." has no name to make one from)."""
    check_input_path(src)
    if src.is_dir():
        raise ModelLoadError(f"{src}: is a directory, expected an .onnx file")
    return src.with_name(f"{src.stem}.{target}{kind}.onnx")



def check_input_path(src: Path) -> None:
    """A missing input, or a path the file system refuses to look up at all (a name too long, a
    loop of links), is a bad input, said as such before anything about the output: with both
    wrong, the missing model is the error to fix first (exit 3, not the output's exit 6)."""
    try:
        src.stat()
    except FileNotFoundError:
        raise ModelLoadError(f"{src}: no such file") from None
    except OSError as exc:
        raise ModelLoadError(f"{src}: cannot be opened ({exc.strerror or exc})") from None


def _check_output(src: Path, dst: Path, overwrite: bool, name: str) -> None:
    """``name``: the default output's file name, suggested when ``dst`` is a folder."""
    check_input_path(src)
    try:
        _check_output_path(src, dst, overwrite, name)
    except OSError as exc:  # a name too long for the file system, a loop of links...
        raise OutputError(f"{dst}: cannot be written ({exc.strerror or exc})") from None


def _check_output_path(src: Path, dst: Path, overwrite: bool, name: str) -> None:
    if not dst.parent.exists():
        raise OutputError(f"{dst.parent}: output folder does not exist")
    if src.exists() and dst.exists() and dst.resolve() == src.resolve():
        raise OutputError(f"{dst}: the output would replace the input; choose another -o (the input is never modified)")
    if dst.is_dir():  # (before "exists": --overwrite would not help)
        raise OutputError(f"{dst}: is a directory; -o takes the output file's path (e.g. {dst / name})")
    if dst.exists() and not dst.is_file():  # (a device, a FIFO: --overwrite would put a file in its place)
        raise OutputError(f"{dst}: is not a regular file (a device or a pipe); -o takes a file path")
    if (dst.exists() or dst.is_symlink()) and not overwrite:  # (a dangling link would be replaced too)
        raise OutputError(f"{dst}: already exists; pass --overwrite to replace it")
    if not os.access(dst.parent, os.W_OK):
        raise OutputError(f"{dst.parent}: not writable")


def _input_files(model: Model, src: Path) -> set[Path]:
    from .frontends.onnx_loader import input_files

    return input_files(model, src)


def _needs_external(model: Model, src: Path, output: Any = None) -> bool:
    """External data when the input used it, or when the output could pass protobuf's 2 GB limit:
    the input's size, or the written weights' (``output``, the emitted model: a weight both types
    read is stored twice, so a 1.5 GB input can make a 2.2 GB output)."""
    if len(_input_files(model, src)) > 1 or src.stat().st_size > EXTERNAL_DATA_ABOVE:
        return True
    from .emitters.onnx_emitter import tensor_bytes

    return output is not None and tensor_bytes(output) > EXTERNAL_DATA_ABOVE


def _copy_unchanged(src: Path, dst: Path, model: Model, external: bool, source_files: set[Path],
                    overwrite: bool) -> list[Path]:
    """Nothing to change: write the model as it is (byte-identical when it has no external data
    and was in topological order, which ONNX requires: an unsorted input is written sorted; one with
    external data written without is written with its weights read in)."""
    import shutil
    import tempfile

    from .files import ordinary_mode, replace_into

    if not external and not model.meta.get("onnx.changed_on_load") and len(source_files) == 1:
        fd, tmp = tempfile.mkstemp(prefix=".amp-rewrite-", dir=dst.parent)
        os.close(fd)
        try:
            shutil.copyfile(src, tmp)
            ordinary_mode(tmp)
            replace_into(Path(tmp), dst)
        except BaseException as exc:  # (a Ctrl-C too: nothing is left behind)
            Path(tmp).unlink(missing_ok=True)
            if isinstance(exc, OSError):
                raise OutputError(f"{dst}: writing failed ({exc.strerror or exc})") from exc
            raise
        return [dst]
    from .emitters.onnx_emitter import save_onnx

    # (onnx-ir does not carry training_info: nothing its bindings name changed, so it is put back)
    return save_onnx(model.origin.model, dst, external=external, source_files=source_files, overwrite=overwrite,
                     training_info=model.meta.get("onnx.training_info") or ())
