"""Training rewrite for ONNX: ``amp-rewrite --training --loss NAME [--grads PATTERN] model.onnx``.

What it does (PRECISION.md, "Training"):

1. the normal pipeline with ``training=True``: initializers stay FP32 and are cast at use (master
   weights; float graph inputs, e.g. parameters fed as inputs, stay FP32 too, keep_io_types is
   forced on), and the loss island is pinned FP32: every node feeding the loss with no allow op
   between it and the loss (the same rule the torch side applies);
2. loss scaling (fp16; bf16 keeps FP32's exponent range and gets none unless ``loss_scaling=True``
   / ``--loss-scaling`` asks for it, nor does fp16 with ``loss_scaling=False``), with standard ONNX
   ops, on the emitted model:

   - input ``loss_scale`` (FP32 scalar), output ``scaled_loss = loss * loss_scale`` (FP32);
   - with ``grads`` (gradient outputs, e.g. a forward+gradient graph from
     ``tools/make_training_graph.py``): the backward pass is seeded with ``loss_grad * loss_scale``
     (the graph must have a seed input: ``loss_grad=`` names it, else the model's
     ``amp_rewrite.training_graph`` metadata, else an FP32 scalar input called ``<loss>_grad``,
     ``<loss>.grad``, ``grad_<loss>`` or ``loss_grad``), so every gradient is computed scaled;
     each gradient output keeps its name and now carries the **unscaled** FP32 gradient
     (``scaled × (1/loss_scale)``); the scaled one is renamed ``<name>/amp_scaled``;
   - input ``growth_tracker`` (int64 scalar), outputs ``all_finite`` (bool scalar: every unscaled
     gradient is free of inf/NaN), ``next_loss_scale`` (FP32 scalar) and ``next_growth_tracker``
     (int64 scalar), the dynamic loss-scale update of :class:`amp_rewrite.LossScaler` /
     ``torch.amp.GradScaler``:

       finite:   tracker + 1 == growth_interval ? (min(scale * growth_factor, max_scale), 0)
                                                : (scale, tracker + 1)
       overflow: (max(scale * backoff_factor, min_scale), 0)   -- and the caller skips the step

     ``dynamic=False`` (static scaling) passes scale and tracker through unchanged.

The training loop feeds ``loss_scale``/``growth_tracker`` (start: 2**16 and 0), applies the
gradient outputs only when ``all_finite`` is true, and feeds ``next_loss_scale``/
``next_growth_tracker`` back in. The finiteness check sums each unscaled gradient (one reduction
per gradient) and tests the total for inf/NaN: a finite gradient whose sum exceeds FP32's range
(|sum| > 3.4e38) also counts as an overflow.
"""

from __future__ import annotations

import fnmatch
import json
import numbers
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Collection, Sequence

from .api import SCALE_OPTIONS, RewriteResult, _as_list, _record_pins, context_for, flag, rule_book, run_pipeline
from .errors import UsageError
from .loss_scale import BACKOFF_FACTOR, GROWTH_FACTOR, GROWTH_INTERVAL, MAX_SCALE, MIN_SCALE, loss_scaling_for
from .loss_scale import no_scaling_reason
from .loss_scale import INIT_SCALE  # noqa: F401  (the value a caller feeds as the first loss_scale)
from .passes.place_casts import Namer


LOSS_SCALE = "loss_scale"
GROWTH_TRACKER = "growth_tracker"
SCALED_LOSS = "scaled_loss"
ALL_FINITE = "all_finite"
NEXT_LOSS_SCALE = "next_loss_scale"
NEXT_GROWTH_TRACKER = "next_growth_tracker"
SCALED_SUFFIX = "/amp_scaled"
GRAPH_INFO_KEY = "amp_rewrite.training_graph"  # written by tools/make_training_graph.py
TRAINING_KEY = "amp_rewrite.training"  # what this rewrite added, as JSON
TAG = "amp_rewrite."
_TAIL_REASON = "training: feeds the loss with no allow op in between (loss island stays FP32)"


@dataclass(frozen=True)
class ScaleConfig:
    """The dynamic loss-scale update computed in the graph (same meaning as LossScaler's)."""

    growth_factor: float = GROWTH_FACTOR
    backoff_factor: float = BACKOFF_FACTOR
    growth_interval: int = GROWTH_INTERVAL
    min_scale: float = MIN_SCALE
    max_scale: float = MAX_SCALE
    dynamic: bool = True

    def __post_init__(self) -> None:
        for key in ("growth_factor", "backoff_factor", "min_scale", "max_scale"):
            number = getattr(self, key)
            if isinstance(number, bool) or not isinstance(number, numbers.Real):
                raise UsageError(f"{key}={number!r}: pass a number")
        if isinstance(self.growth_interval, bool) or not isinstance(self.growth_interval, numbers.Integral):
            raise UsageError(f"growth_interval={self.growth_interval!r}: pass a whole number of steps")
        if not isinstance(self.dynamic, bool):
            raise UsageError(f"dynamic={self.dynamic!r}: pass True or False")
        # plain Python numbers (a numpy int64 would not go into the model's JSON metadata)
        for key in ("growth_factor", "backoff_factor", "min_scale", "max_scale"):
            object.__setattr__(self, key, float(getattr(self, key)))
        object.__setattr__(self, "growth_interval", int(self.growth_interval))
        if not self.growth_factor > 1.0:
            raise UsageError(f"growth_factor={self.growth_factor}: must be > 1")
        if not 0.0 < self.backoff_factor < 1.0:
            raise UsageError(f"backoff_factor={self.backoff_factor}: must be in (0, 1)")
        if int(self.growth_interval) < 1:
            raise UsageError(f"growth_interval={self.growth_interval}: must be >= 1")
        if int(self.growth_interval) > _INT64_MAX:  # (the graph counts finite steps in an int64)
            raise UsageError(f"growth_interval={self.growth_interval}: must be at most 2**63 - 1 "
                             f"({_INT64_MAX}), the largest step count the model's int64 counter holds")
        if not 0.0 < self.min_scale <= self.max_scale < float("inf"):
            raise UsageError(f"min_scale={self.min_scale}, max_scale={self.max_scale}: need 0 < min <= max < inf")
        # the graph holds them as FP32 constants: each must be one (1e-46 was 0 there, 1e39 inf)
        import numpy as np

        for key in ("growth_factor", "backoff_factor", "min_scale", "max_scale"):
            number = getattr(self, key)
            with np.errstate(over="ignore", under="ignore"):
                stored = float(np.float32(number))
            if stored == 0.0 or stored == float("inf"):
                raise UsageError(f"{key}={number!r}: the model holds it as an FP32 constant, where it is "
                                 f"{stored:g}; pass one FP32 holds (nonzero, at most 3.4e38)")
            if (key == "backoff_factor" and stored >= 1.0) or (key == "growth_factor" and stored <= 1.0):
                bound, side = ("< 1", "below") if key == "backoff_factor" else ("> 1", "above")
                raise UsageError(f"{key}={number!r}: must be {bound} as the model stores it, an FP32 constant, "
                                 f"where it rounds to {stored:.9g}; pass one further {side} 1 (FP32 tells apart "
                                 f"numbers near 1 only some 1e-7 apart)")


_INT64_MAX = 2 ** 63 - 1


# -- entry points ------------------------------------------------------------------------------------------
def rewrite_training_onnx(src: str | os.PathLike, dst: str | os.PathLike | None = None, *, loss: str,
                          grads: str | Sequence[str] | None = None, loss_grad: str | None = None,
                          overwrite: bool = False, external_data: bool | None = None,
                          **options: Any) -> RewriteResult:
    """Training rewrite of an ONNX file (see the module docstring). ``dst`` defaults to
    ``<stem>.<target>.train.onnx``. ``grads``: glob pattern(s) over graph output names (comma-
    separated, or a list; ``re:`` for a regex). Scale options: growth_factor, backoff_factor,
    growth_interval, min_scale, max_scale, dynamic; other options are those of make_context."""
    from .api import _check_output, _input_files, _needs_external, default_output
    from .emitters.onnx_emitter import save_onnx
    from .frontends.onnx_loader import load_onnx

    src_path = Path(src)
    default = default_output(src_path, options.get("target", "fp16"), ".train")
    dst_path = Path(dst) if dst is not None else default
    _check_output(src_path, dst_path, overwrite, default.name)
    model = load_onnx(src_path, inline_functions=options.get("inline_functions", True) is True)
    ir_model, log, plan = _rewrite(model, loss=loss, grads=grads, loss_grad=loss_grad, options=options)
    source_files = _input_files(model, src_path)
    use_external = external_data if external_data is not None else _needs_external(model, src_path, ir_model)
    written = save_onnx(ir_model, dst_path, external=use_external, source_files=source_files, overwrite=overwrite)
    return RewriteResult(ir_model, log, plan.modified, written, source=str(src_path))


def rewrite_training_onnx_model(proto: Any, *, loss: str, grads: str | Sequence[str] | None = None,
                                loss_grad: str | None = None, **options: Any) -> RewriteResult:
    """In-memory variant: an ``onnx.ModelProto`` in, a new ``onnx.ModelProto`` out (``.model``)."""
    from .emitters.onnx_emitter import to_proto
    from .frontends.onnx_loader import load_onnx

    model = load_onnx(proto, inline_functions=options.get("inline_functions", True) is True)
    ir_model, log, plan = _rewrite(model, loss=loss, grads=grads, loss_grad=loss_grad, options=options)
    return RewriteResult(to_proto(ir_model), log, plan.modified)


def rewrite_training_cli(args: Any) -> RewriteResult:
    """What ``amp-rewrite --training`` runs (commands.run)."""
    return rewrite_training_onnx(args.model, args.output, overwrite=args.overwrite, loss=args.loss,
                                 grads=args.grads, loss_scaling=args.loss_scaling, **args.options())


# -- the rewrite -----------------------------------------------------------------------------------------------
@dataclass
class _Plan:
    loss: str
    grads: list[str]
    seed: str | None
    tail: list[str]
    config: ScaleConfig
    scaling: bool = True
    unnamed_seed: str | None = None  # the graph's backward seed, when no --grads names its gradients
    modified: bool = True  # False: no loss scaling and the pipeline changed nothing (the input as it was)


def _rewrite(model: Any, *, loss: str, grads: Any, loss_grad: str | None, options: dict) -> tuple[Any, Any, _Plan]:
    from .emitters.onnx_emitter import emit_onnx

    options = dict(options)
    options.pop("training", None)
    options.pop("loss", None)
    config = ScaleConfig(**{k: options.pop(k) for k in SCALE_OPTIONS if k in options})
    scaling = loss_scaling_for(options.get("target", "fp16"), options.pop("loss_scaling", None))
    if "keep_io_types" in options:
        flag("keep_io_types", options["keep_io_types"])
    if options.get("keep_io_types") is False:
        raise UsageError("--training keeps graph inputs and outputs FP32 (parameters fed as inputs are the FP32 "
                         "master weights; the loss and gradients must come out FP32): drop --no-keep-io-types")
    options["keep_io_types"] = True
    from .api import _refuse_retarget

    _refuse_retarget(model, options.get("target", "fp16"))  # (a bf16 training graph given fp16 scaling kept its bf16)
    ir_model = model.origin.model
    plan = _make_plan(model, ir_model, loss, grads, loss_grad, config, _rule_book(options), scaling)
    pins = ["re:" + re.escape(name) for name in plan.tail]
    options["fp32_nodes"] = _as_list("fp32_nodes", options.get("fp32_nodes")) + pins
    ctx = context_for("onnx", {**options, "training": True, "loss": loss}, "rewrite(training=True)")
    ctx.log.notes.extend(_notes(plan, options.get("target", "fp16")))
    modified = run_pipeline(model, ctx)
    # The loss island's pins are this rewrite's own, unless the user pinned the node too (an
    # --fp32-ops op, a node pattern, a rule file of theirs, an earlier rewrite's tag): that pin is
    # what its tags must say, so that rewriting the output again keeps it.
    from .passes.base import node_names

    relabel: dict[str, tuple[str, str]] = {}
    names = node_names(model) if ctx.rules.node_rules() else frozenset()  # (no patterns: no aliases to build)
    for node in model.graph.nodes:
        if node.name in plan.tail and node.meta.get("amp.category") is not None:
            relabel[node.name] = _user_pin(node, ctx, set(pins), names) or (_TAIL_REASON, "training")
            node.meta["amp.reason"], node.meta["amp.source"] = relabel[node.name]
    for label, decision in list(ctx.log.decisions.items()):
        if label in relabel:
            from dataclasses import replace

            reason, source = relabel[label]
            ctx.log.decisions[label] = replace(decision, reason=reason, source=source)
    ours = [name for name, (_, source) in relabel.items() if source == "training"]
    modified = modified or _record_pins(model, ctx, internal=ours)
    # (unscaled and nothing to change: a training output rewritten again stays as it is)
    plan.modified = modified or plan.scaling
    ir_model = emit_onnx(model, ctx.log) if plan.modified else model.origin.model
    if plan.scaling:
        builder = _LossScaleBuilder(ir_model, plan)
        builder.build()
        builder.report_to(ctx.log)
    else:
        ir_model.metadata_props[TRAINING_KEY] = json.dumps({"loss": plan.loss, "loss_scaling": False,
                                                            "grads": plan.grads})
    return ir_model, ctx.log, plan


def _user_pin(node: Any, ctx: Any, ours: set[str], names: frozenset[str]) -> tuple[str, str] | None:
    """(reason, source) of a user's FP32 pin on ``node`` besides the loss island's own, if any: a
    pattern matched as classify matches it (any of the node's aliases; a pattern that is some
    node's exact name names that node only, not a glob)."""
    from .decisions import Category, Precision
    from .passes.base import aliases, earlier_pin, is_user_source

    for rule in ctx.rules.node_rules():
        if rule.pattern not in ours and rule.precision == Precision.FP32 \
                and any(rule.matches(alias, names) for alias in aliases(node) if alias):
            return f"node rule {rule.pattern!r} keeps it FP32", rule.source
    entry = ctx.rules.lookup(node.op_type, node.domain, node.opset)
    if entry is not None and entry.category == Category.DENY and is_user_source(entry.source):
        return entry.reason, entry.source
    earlier = earlier_pin(node)
    if earlier:
        return f"kept FP32: an earlier rewrite of this model pinned it ({earlier}), as its tags say", earlier
    return None


def _make_plan(model: Any, ir_model: Any, loss: str, grads: Any, loss_grad: str | None,
               config: ScaleConfig, rules: Any, scaling: bool) -> _Plan:
    graph = model.graph
    outputs = {v.name: v for v in graph.outputs}
    if loss not in outputs:
        raise UsageError(f"--loss {loss!r}: no graph output has that name{_names_hint(loss, outputs, 'outputs')}")
    loss_value = outputs[loss]
    if loss_value.dtype is not None and int(loss_value.dtype) != 1:
        raise UsageError(f"--loss {loss!r}: the loss must be FP32, it is {loss_value.dtype.name}")
    if loss_value.shape is not None and not all(d == 1 for d in loss_value.shape):
        raise UsageError(f"--loss {loss!r}: the loss must be a scalar (one element), its shape is "
                         f"[{', '.join(str(d) for d in loss_value.shape)}]; reduce it (mean or sum) inside the graph")
    grad_names = _match_grads(grads, [v.name for v in graph.outputs], loss)
    for name in grad_names:
        dtype = outputs[name].dtype
        if dtype is None or int(dtype) != 1:
            kind = dtype.name if dtype is not None else "of unknown type"
            raise UsageError(f"--grads matches {name!r}, which is {kind}: gradients are unscaled in FP32 and must "
                             f"come out FP32 (FP32 master weights); narrow --grads to the FP32 gradient outputs")
    seed = None
    unnamed_seed = None  # a backward seed the graph has, with no --grads naming the gradients it makes
    if grad_names and scaling:
        seed = _find_seed(graph, ir_model, loss, loss_grad)
    elif scaling and loss_grad is None:
        try:
            unnamed_seed = _find_seed(graph, ir_model, loss, None)
        except UsageError:
            pass
    elif loss_grad is not None and scaling:
        raise UsageError(f"loss_grad={loss_grad!r}: names the backward seed to multiply by the loss scale, but no "
                         f"gradient output is named to unscale: pass grads= (glob patterns over the gradient outputs) "
                         f"with it")
    elif loss_grad is not None:
        raise UsageError(f"loss_grad={loss_grad!r}: names the backward seed to multiply by the loss scale, and this "
                         f"rewrite scales nothing (no loss scaling); drop it, or pass loss_scaling=True")
    if _scaled_already(ir_model):
        raise UsageError("the model was rewritten for training with loss scaling already (its amp_rewrite.training "
                         "metadata says so): rewrite the FP32 model instead")
    added = (LOSS_SCALE, SCALED_LOSS) + ((GROWTH_TRACKER, ALL_FINITE, NEXT_LOSS_SCALE, NEXT_GROWTH_TRACKER)
                                         if grad_names else ())
    for name in added if scaling else ():
        if _name_taken(ir_model.graph, name):
            raise UsageError(f"the model already has a value named {name!r}: it looks rewritten for training already")
    tail = _loss_tail(loss_value, graph, rules)
    return _Plan(loss=loss, grads=grad_names, seed=seed, tail=tail, config=config, scaling=scaling,
                 unnamed_seed=unnamed_seed)


def _scaled_already(ir_model: Any) -> bool:
    info = ir_model.metadata_props.get(TRAINING_KEY)
    try:
        return bool(info) and json.loads(info).get("loss_scale") is not None
    except (ValueError, AttributeError):
        return False


def _match_grads(grads: Any, outputs: list[str], loss: str) -> list[str]:
    if not grads:
        return []
    if not isinstance(grads, str) and not (isinstance(grads, (list, tuple)) and all(isinstance(g, str) for g in grads)):
        raise UsageError(f"grads={grads!r}: pass glob patterns over output names (a string, comma-separated, or a "
                         f"list of strings)")
    if isinstance(grads, str):
        # comma-separated globs; a re: pattern is taken whole (a regex may hold commas: x{1,2})
        grads = [grads] if grads.strip().startswith("re:") else grads.split(",")
    patterns = [p.strip() for p in grads if p.strip()]
    from .rulebook import _pattern_problem

    for p in patterns:
        problem = _pattern_problem(p)
        if problem:
            raise UsageError(f"--grads: {problem}")
    matched: list[str] = []
    for name in outputs:
        if name == loss:
            continue
        for p in patterns:
            hit = re.fullmatch(p[3:], name) if p.startswith("re:") else fnmatch.fnmatchcase(name, p)
            if hit:
                matched.append(name)
                break
    if not matched:
        others = [name for name in outputs if name != loss]
        raise UsageError(f"--grads {','.join(patterns)!r} matches no graph output other than the loss"
                         f"{_names_hint(patterns[0] if len(patterns) == 1 else '', others, 'outputs')}")
    return matched


def _names_hint(name: str, names: Collection[str], what: str, shown: int = 8) -> str:
    """'; did you mean X? (N outputs: a, b, ...)': the closest spelling, and the first few names
    (a training graph has an output per parameter: listing hundreds buries the answer)."""
    from .rulebook import _closest

    names = list(names)
    close = _closest(name, names) if name else None
    listing = ", ".join(names[:shown]) + (f", ... ({len(names) - shown} more)" if len(names) > shown else "")
    hint = f"; did you mean {close!r}?" if close else ""
    return f"{hint} ({what}: {listing or 'none'})"


def _find_seed(graph: Any, ir_model: Any, loss: str, explicit: str | None) -> str:
    inputs = {v.name: v for v in graph.inputs}
    if explicit is not None:
        if explicit not in inputs:
            raise UsageError(f"loss_grad={explicit!r}: no graph input has that name{_names_hint(explicit, inputs, 'inputs')}")
        return _read_seed(inputs[explicit])
    info = ir_model.metadata_props.get(GRAPH_INFO_KEY)
    if info:
        name = json.loads(info).get("loss_grad")
        if name in inputs:
            return _read_seed(inputs[name])
    for name in (f"{loss}_grad", f"{loss}.grad", f"grad_{loss}", "loss_grad"):
        value = inputs.get(name)
        if value is not None:
            return _read_seed(value)  # (named as a seed: one of the wrong type or shape is told so)
    raise UsageError(
        "--grads: the graph has no input seeding the backward pass (the gradient of the loss, usually a "
        f"constant 1 folded into the graph), so its gradients cannot be loss-scaled; export it with "
        f"tools/make_training_graph.py, or give the seed input a name like '{loss}_grad'")


def _read_seed(value: Any) -> str:
    """The seed's name, if the backward pass starts from it: scaling a seed no node reads would scale
    nothing, and the unscaled gradients would come out divided by the loss scale. It is the
    gradient of a scalar loss: an FP32 input of one element (scaling a data input would scale the
    forward pass)."""
    # a symbolic dim (float[N], as a dynamic-axes export writes it) may be 1 at run time
    one_element = value.shape is None or all(d == 1 or not isinstance(d, int) for d in value.shape)
    if value.dtype is None or int(value.dtype) != 1 or not one_element:
        raise UsageError(f"loss_grad={value.name!r}: the seed of the backward pass is the loss's gradient, an FP32 "
                         f"input of one element; {value.name!r} is {getattr(value.dtype, 'name', value.dtype)} "
                         f"{list(value.shape or [])}")
    if not value.consumers():
        raise UsageError(f"--grads: the seed input {value.name!r} is read by no node, so the backward pass does not "
                         f"start from it (a constant 1 folded into the graph?) and its gradients cannot be "
                         f"loss-scaled; export the graph with tools/make_training_graph.py")
    return value.name


def _name_taken(graph: Any, name: str) -> bool:
    if any(v.name == name for v in graph.inputs) or any(v.name == name for v in graph.outputs):
        return True
    if name in graph.initializers:
        return True
    return any(o.name == name for n in graph for o in n.outputs)


def _rule_book(options: dict) -> Any:
    """The rules the pipeline will use (op overrides and the user's node pins included), to find
    the allow ops and the nodes pinned low."""
    return rule_book(options.get("rules", ()), frontend="onnx", target=options.get("target", "fp16"),
                     **{k: options.get(k) or () for k in ("fp32_ops", "fp16_ops", "fp32_nodes", "fp16_nodes")})


def _loss_tail(loss: Any, graph: Any, book: Any) -> list[str]:
    """Names of the nodes feeding the loss with no allow op between them and the loss; unnamed
    ones get a name (amp_loss/<op>), so that node rules can pin them."""
    from .passes.base import loss_tail

    name = Namer({n.name for n in graph.nodes})
    tail = []
    for node in loss_tail(graph, loss, book):
        if node.op_type in ("Cast", "Constant"):
            continue
        if not node.name:
            node.name = name(f"amp_loss/{node.op_type}")
            if node.origin is not None:
                node.origin.name = node.name
        tail.append(node.name)
    return tail


def _notes(plan: _Plan, target: str) -> list[str]:
    if not plan.scaling:
        grads = (f"; {len(plan.grads)} gradient output(s) come out FP32 as computed" if plan.grads else "")
        return [f"training: loss {plan.loss!r} kept FP32 with {len(plan.tail)} node(s) of its island pinned FP32; "
                f"no loss scaling ({no_scaling_reason(target, 'loss_scaling=True / --loss-scaling')}){grads}"]
    notes = [f"training: loss {plan.loss!r} kept FP32 with {len(plan.tail)} node(s) of its island pinned FP32; "
             f"input {LOSS_SCALE!r} and output {SCALED_LOSS!r} added"]
    if plan.unnamed_seed is not None:
        notes.append(f"training: the graph has a backward pass (seed input {plan.unnamed_seed!r}) but --grads names no "
                     f"gradient output: its gradients are computed without loss scaling (small ones flush to zero "
                     f"in {target}); name them with --grads to scale and unscale them")
    if plan.grads:
        c = plan.config
        mode = (f"dynamic (x{c.growth_factor} after {c.growth_interval} finite steps, x{c.backoff_factor} on "
                f"overflow, within [{c.min_scale:g}, {c.max_scale:g}])" if c.dynamic else "static")
        notes.append(f"training: backward seed {plan.seed!r} multiplied by {LOSS_SCALE!r}; {len(plan.grads)} "
                     f"gradient output(s) unscaled in FP32 under their own names; outputs {ALL_FINITE!r}, "
                     f"{NEXT_LOSS_SCALE!r}, {NEXT_GROWTH_TRACKER!r} added; loss scale {mode}")
    return notes


class _LossScaleBuilder:
    """Adds the loss-scale, unscale, finiteness and next-scale nodes to the emitted onnx-ir model."""

    def __init__(self, model: Any, plan: _Plan) -> None:
        import onnx_ir as ir

        self.ir = ir
        self.model = model
        self.graph = model.graph
        self.plan = plan
        taken = {v.name for v in self.graph.inputs} | set(self.graph.initializers)
        taken |= {n.name for n in self.graph} | {o.name for n in self.graph for o in n.outputs}
        self.taken = taken
        self.name = Namer(taken)  # shares ``taken``: names added by hand are avoided too
        self.opset = model.opset_imports.get("", 0)
        # initializers also listed as graph inputs: from IR 4 on, defaults a caller may feed (below
        # it, the weights every initializer had to be listed as)
        self.fed = frozenset(id(v) for v in self.graph.inputs
                             if v.const_value is not None and (model.ir_version or 0) >= 4)
        self.new_nodes: list[Any] = []
        self.constants: list[Any] = []  # the initializers the update adds (the report's weights count them)
        self.unscaled_before: list[str] = []  # nodes that read gradients divided by the scale first
        self.divided: list[Any] = []  # the FP32 values those read (the finiteness check reads them too)
        self.left_as_computed: list[str] = []  # gradient outputs computed from divided values
        self.scaled_count: int | None = None  # gradient outputs unscaled on their way out
        self.rewired: dict[int, tuple[Any, str | None]] = {}  # our Casts whose edges changed, and a new reason

    def node(self, op: str, inputs: list, reason: str, *, out: str | None = None, graph: Any = None,
             **attrs: Any) -> Any:
        ir = self.ir
        out_name = out if out is not None else self.name(f"amp_train/{op.lower()}")
        if out is not None:
            self.taken.add(out)
        value = ir.Value(name=out_name)
        node = ir.Node("", op, inputs, attributes=[_attr(ir, k, v) for k, v in attrs.items()], outputs=[value],
                       name=self.name(f"amp_train/{op}"))
        node.metadata_props[TAG + "inserted"] = "training"
        node.metadata_props[TAG + "reason"] = reason
        (graph if graph is not None else self.graph).append(node)
        self.new_nodes.append(node)
        return value

    def const(self, value: Any, dtype: str, base: str) -> Any:
        import numpy as np

        ir = self.ir
        tensor = ir.tensor(np.array(value, dtype=dtype), name=self.name(f"amp_train/{base}"))
        v = ir.Value(name=tensor.name, type=ir.TensorType(tensor.dtype), shape=ir.Shape([]), const_value=tensor)
        self.graph.register_initializer(v)
        self.constants.append(v)
        return v

    def scalar_input(self, name: str, dtype: Any) -> Any:
        ir = self.ir
        v = ir.Value(name=name, type=ir.TensorType(dtype), shape=ir.Shape([]))
        self.graph.inputs.append(v)
        self.taken.add(name)
        return v

    def typed(self, value: Any, dtype: Any, shape: Any = None) -> Any:
        value.type = self.ir.TensorType(dtype)
        value.shape = shape if shape is not None else self.ir.Shape([])
        return value

    def build(self) -> None:
        ir = self.ir
        if self.opset < 10:
            raise UsageError(f"--training needs opset >= 10 (IsInf); the model imports opset {self.opset}")
        FLOAT, INT64, BOOL = ir.DataType.FLOAT, ir.DataType.INT64, ir.DataType.BOOL
        plan, graph = self.plan, self.graph
        outputs = {v.name: (i, v) for i, v in enumerate(graph.outputs)}
        scale = self.scalar_input(LOSS_SCALE, FLOAT)
        loss_value = outputs[plan.loss][1]
        scaled = self.node("Mul", [loss_value, scale], "training: scaled_loss = loss (FP32) x loss_scale",
                           out=SCALED_LOSS)
        if _our_cast(loss_value.producer()):  # (a loss computed low leaves through our Cast: it feeds this Mul too)
            self.rewired.setdefault(id(loss_value.producer()), (loss_value.producer(), None))
        self.typed(scaled, FLOAT, loss_value.shape)  # a scalar, or the loss's one-element shape
        graph.outputs.append(scaled)
        added = {"loss": plan.loss, "loss_scale": LOSS_SCALE, "scaled_loss": SCALED_LOSS}
        if plan.grads:
            tracker = self.scalar_input(GROWTH_TRACKER, INT64)
            seed = self._scale_seed(scale)
            inv = self.node("Reciprocal", [scale], "training: 1 / loss_scale, to unscale the gradients in FP32")
            reached = _reached_from(seed, self.graph)
            sums, scaled_grads = [], []
            scaled_of: dict[str, Any] = {}  # gradient output name -> its scaled value
            backward = _feeding([outputs[name][1] for name in plan.grads])
            watched: dict[int, str] = {}  # id(gradient output value) -> its name
            for name in plan.grads:
                index, value = outputs[name]
                if _from_constants(value, self.fed):
                    # a constant gradient (an unused parameter's zero, folded by the exporter into an
                    # initializer or a Constant node) never went through the scaled backward pass: it
                    # leaves as it is
                    continue
                if value.producer() is None:
                    raise UsageError(f"gradient output {name!r} is a graph input, not computed by the graph: "
                                     f"nothing to unscale; narrow --grads")
                if id(value) not in reached:
                    scaled_of[name] = value  # (refused below, with the others)
                    continue
                watched[id(value)] = name

            def unscale_output(value: Any) -> None:
                """A gradient output, proportional to the scale: divided on its way out (the walk calls
                this as soon as it has the gradient, so its readers after it read the division)."""
                name = watched.pop(id(value))
                value.name = self.name(name + SCALED_SUFFIX)
                scaled_grads.append(value.name)
                scaled_of[name] = value
                readers = list(value.uses())
                unscaled = self.node("Mul", [value, inv], "training: gradient unscaled in FP32 (x 1/loss_scale)",
                                     out=name)
                cast = value.producer()
                if _our_cast(cast):  # (it wrote the gradient output; the unscale reads it now)
                    self.rewired[id(cast)] = (cast, f"training: the gradient computed low is unscaled in FP32 by "
                                                    f"{unscaled.producer().name} before it leaves as output {name!r}")
                unscaled.type, unscaled.shape = ir.TensorType(FLOAT), value.shape
                for index, output in enumerate(graph.outputs):
                    if output is value:  # (every slot: a gradient may be listed twice among the outputs)
                        graph.outputs[index] = unscaled
                # what the graph computes from the gradient (an in-graph SGD step, a gradient norm)
                # reads it unscaled too: loss scaling must change no value but the backward pass's own.
                # A reader that computes another gradient (a shared bias's sum) is the backward pass:
                # it keeps the scaled value, which that gradient's own unscale divides once.
                for user, slot in readers:
                    if id(user) not in backward:
                        user.replace_input_with(slot, unscaled)
                        self.unscaled_before.append(_label(user))
                self._unscale_low_readers(value, unscaled, backward)
                sums.append(self.node("ReduceSum", [unscaled], "training: inf/NaN check (sum of the gradient)",
                                      keepdims=0))

            self._unscale_where_not_proportional(scale, inv, watched, unscale_output)
            for value_id, name in watched.items():
                # not proportional to the scale where it leaves: computed from gradients the walk
                # divided already (clipped in the graph); it leaves as it is, and the finiteness
                # check reads it
                self.left_as_computed.append(name)
                sums.append(self.node("ReduceSum", [outputs[name][1]], "training: inf/NaN check (sum of the "
                                      "gradient)", keepdims=0))
            for value in self.divided:
                # a clip or a threshold after the division turns an overflowed gradient into a finite
                # value (Clip(inf) is the bound, inf > t a mask of ones): the divided values are checked
                sums.append(self.node("ReduceSum", [value], "training: inf/NaN check (sum of a gradient divided "
                                      "by the loss scale before a clip, a norm or a threshold)", keepdims=0))
            if not sums:
                raise UsageError(f"--grads matches only constant outputs ({', '.join(plan.grads)}): no gradient "
                                 f"is computed by the graph, so there is nothing to loss-scale")
            self._refuse_scaled_leftovers(scale, scaled_of, reached)
            total = sums[0] if len(sums) == 1 else self.node("Sum", sums, "training: inf/NaN check (all gradients)")
            bad = self.node("Or", [self.node("IsInf", [total], "training: inf/NaN check"),
                                   self.node("IsNaN", [total], "training: inf/NaN check")], "training: inf/NaN check")
            finite = self.typed(self.node("Not", [bad], "training: every unscaled gradient is finite",
                                          out=ALL_FINITE), BOOL)
            next_scale, next_tracker = self._update(scale, tracker, finite)
            for v in (finite, next_scale, next_tracker):
                graph.outputs.append(v)
            from onnx_ir.passes.common import TopologicalSortPass

            TopologicalSortPass()(self.model)  # (an unscale Mul, appended last, may feed nodes before it)
            self.scaled_count = len(scaled_grads)
            added.update({"growth_tracker": GROWTH_TRACKER, "loss_grad": plan.seed, "grads": plan.grads,
                          "scaled_grads": scaled_grads, "all_finite": ALL_FINITE,
                          "next_loss_scale": NEXT_LOSS_SCALE, "next_growth_tracker": NEXT_GROWTH_TRACKER,
                          "config": asdict(plan.config)})
        self.model.metadata_props[TRAINING_KEY] = json.dumps(added)

    def report_to(self, log: Any) -> None:
        """The emitter wrote the log's records and the model's tags before these nodes went in: the
        weights now hold the update's constants too, and a Cast the rewrite placed on the seed or a
        gradient reads or feeds other nodes. Log and tags say so, so that both reports (the one
        returned, the one rebuilt from the model) describe the model written."""
        from .emitters.onnx_emitter import cast_record_dict

        added = sum(v.const_value.nbytes for v in self.constants)
        log.weights.bytes_after += added
        if self.unscaled_before:
            shown = ", ".join(repr(name) for name in self.unscaled_before[:3])
            more = f" and {len(self.unscaled_before) - 3} more" if len(self.unscaled_before) > 3 else ""
            log.notes.append(f"training: {len(self.unscaled_before)} node(s) read the gradients divided by the loss "
                             f"scale, so that what they compute does not carry it (a norm, a clip, a sum with a "
                             f"weight, a value leaving the graph): {shown}{more}")
        if self.scaled_count is not None and len(self.plan.grads) != self.scaled_count:
            said = f"{len(self.plan.grads)} gradient output(s) unscaled in FP32 under their own names"
            kept = ", ".join(repr(n) for n in self.left_as_computed[:3]) + (" ..." if len(self.left_as_computed) > 3
                                                                              else "")
            now = (f"{self.scaled_count} gradient output(s) unscaled in FP32 under their own names"
                   + (f", {len(self.left_as_computed)} computed from gradients divided before (left as computed: "
                      f"{kept})" if self.left_as_computed else ""))
            log.notes[:] = [note.replace(said, now, 1) if note.startswith("training: backward seed") else note
                            for note in log.notes]
        self._record_casts(log)
        tags = json.loads(self.model.metadata_props[TAG + "report"])
        tags["weights"]["bytes_after"] += added
        tags["notes"] = list(log.notes)
        self.model.metadata_props[TAG + "report"] = json.dumps(tags)
        records = {c.name: c for c in log.casts if c.kind == "inserted"}
        for cast, reason in self.rewired.values():
            record = records.get(cast.name)
            if record is None:
                continue
            source, out = cast.inputs[0], cast.outputs[0]
            record.tensor = source.name
            record.producer = _label(source.producer()) if source.producer() is not None else None
            record.consumers = sorted({_label(user) for user, _ in out.uses()}
                                      | ({"<graph output>"} if out.is_graph_output() else set()))
            if reason is not None:
                record.reason = reason
                cast.metadata_props[TAG + "reason"] = reason
            index = json.loads(cast.metadata_props[TAG + "cast"])["index"]
            cast.metadata_props[TAG + "cast"] = json.dumps({**cast_record_dict(record), "index": index})

    def _record_casts(self, log: Any) -> None:
        """The Casts these nodes include (a gradient divided in FP32 for a low reader, and cast back)
        are casts of the model like the pipeline's: in the log and tagged, so both reports count them."""
        import numpy as np

        from .decisions import CastRecord
        from .emitters.onnx_emitter import cast_record_dict
        from .ir import DType

        for node in self.new_nodes:
            if node.op_type != "Cast" or not node.inputs or node.inputs[0] is None:
                continue
            source, out = node.inputs[0], node.outputs[0]
            dims = list(out.shape.dims) if out.shape is not None else None
            shape = tuple(d if isinstance(d, int) else None for d in dims) if dims is not None else None
            numel = int(np.prod(shape)) if shape is not None and all(d is not None for d in shape) else None
            record = CastRecord(
                name=node.name, tensor=source.name,
                src=DType(int(source.dtype)).short if source.dtype is not None else "?",
                dst=DType(int(node.attributes["to"].value)).short,
                producer=_label(source.producer()) if source.producer() is not None else None,
                consumers=sorted({_label(user) for user, _ in out.uses()}), shape=shape, numel=numel,
                scope="main" if node.graph is self.graph else (node.graph.name or "body"),
                reason=node.metadata_props.get(TAG + "reason", "training"))
            node.metadata_props[TAG + "cast"] = json.dumps({**cast_record_dict(record), "index": len(log.casts)})
            log.casts.append(record)

    def _unscale_low_readers(self, value: Any, unscaled: Any, backward: set[int]) -> None:
        """A gradient computed low leaves through a Cast to FP32; a low-precision reader outside the
        backward pass (an in-graph preconditioner's MatMul) reads the low value before that Cast,
        still scaled. It reads the unscaled gradient cast to its type instead."""
        cast = value.producer()
        if cast is None or cast.op_type != "Cast" or cast.domain or not cast.inputs or cast.inputs[0] is None:
            return
        low = cast.inputs[0]
        readers = [(user, slot) for user, slot in low.uses() if user is not cast and id(user) not in backward]
        if not readers or low.type is None or low.dtype not in (self.ir.DataType.FLOAT16, self.ir.DataType.BFLOAT16):
            return
        recast = self.node("Cast", [unscaled], "training: the unscaled gradient, for the low-precision nodes "
                           "that read it", to=int(low.dtype))
        recast.type, recast.shape = low.type, low.shape
        for user, slot in readers:
            user.replace_input_with(slot, recast)

    def _refuse_scaled_leftovers(self, scale: Any, scaled_of: dict[str, Any], reached: set[int]) -> None:
        """Graph outputs still proportional to the loss scale (a gradient --grads does not name)
        would leave scaled; a --grads output the backward pass does not reach is no gradient of the
        loss, and dividing it by the scale would be wrong. Both are usage errors, named."""
        from .scale_degree import ZERO, Degrees

        degrees = Degrees(self.graph, scale, {id(n) for n in self.new_nodes}, fed=self.fed).run()
        outputs = [v for v in self.graph.outputs if v.name not in (SCALED_LOSS,)]
        leftover = [v.name for v in outputs if degrees.of(v) not in (ZERO, 0)]
        if leftover:
            raise UsageError(f"output(s) {', '.join(map(repr, leftover))} are computed from the backward pass but --grads "
                             f"does not name them: they would come out multiplied by the loss scale; add them to "
                             f"--grads (they are gradients) or compute them from the named gradients")
        unreached = [name for name, v in scaled_of.items() if id(v) not in reached]
        if unreached:
            raise UsageError(f"--grads names {', '.join(map(repr, unreached))}, which the backward pass from the loss "
                             f"gradient seed does not reach: not a gradient of the loss, so it is not loss-scaled; "
                             f"narrow --grads")

    def _unscale_where_not_proportional(self, scale: Any, inv: Any, watched: dict[int, str],
                                        on_gradient: Any) -> None:
        """Gradients are divided by the scale before a node whose result is not proportional to
        it (scale_degree): a gradient norm, an in-graph clip, an update adding to the weights."""
        from .scale_degree import Degrees

        unscaled: dict[int, Any] = {}

        def unscale(node: Any, slot: int) -> None:
            value = node.inputs[slot]
            if id(value) not in unscaled:
                unscaled[id(value)] = self._divided(value, inv, node)
            node.replace_input_with(slot, unscaled[id(value)])

        degrees = Degrees(self.graph, scale, {id(n) for n in self.new_nodes}, unscale,
                          watched=watched, on_watched=on_gradient, fed=self.fed).run()
        if degrees.refused:
            node, why = degrees.refused[0]
            raise UsageError(f"node {_label(node)!r} ({node.op_type}) {why}: loss scaling cannot be undone there; "
                             f"compute it from the gradient outputs outside the graph, or rewrite with "
                             f"--no-loss-scaling")
        # (after the readers of the gradient outputs, which the walk rewires as it meets them)
        self.unscaled_before = list(dict.fromkeys([*self.unscaled_before, *(_label(n) for n in degrees.broken)]))

    def _divided(self, value: Any, inv: Any, reader: Any) -> Any:
        """``value / loss_scale`` in FP32, cast back to ``value``'s type where that is low; placed in
        the graph that holds ``value`` (an If branch's own value stays in the branch)."""
        ir = self.ir
        producer = value.producer()
        graph = producer.graph if producer is not None else value.graph
        graph = graph if graph is not None else self.graph
        why = (f"training: the gradient divided by the loss scale before {_label(reader)} ({reader.op_type}), "
               f"whose result is not proportional to it")
        low = value.dtype in (ir.DataType.FLOAT16, ir.DataType.BFLOAT16)

        def typed(v: Any, dtype: Any) -> Any:
            v.type, v.shape = ir.TensorType(dtype), value.shape  # (the shape as known, or none)
            return v

        source = value
        if low:  # (a Cast of it to FP32 already there serves: one cast per value and type)
            source = next((user.outputs[0] for user, _ in value.uses() if user.op_type == "Cast" and not user.domain
                           and user.attributes.get("to") is not None and user.attributes["to"].value == 1
                           and (user.graph is graph or user.graph is None)), None) or typed(
                self.node("Cast", [value], why, to=int(ir.DataType.FLOAT), graph=graph), ir.DataType.FLOAT)
        out = typed(self.node("Mul", [source, inv], why, graph=graph), ir.DataType.FLOAT)
        if graph is self.graph:
            self.divided.append(out)
        if low:
            out = typed(self.node("Cast", [out], why, to=int(value.dtype), graph=graph), value.dtype)
        return out

    def _scale_seed(self, scale: Any) -> None:
        seed = next(v for v in self.graph.inputs if v.name == self.plan.seed)
        uses = list(seed.uses())
        scaled = self.node("Mul", [seed, scale], "training: the backward pass starts from loss_grad x loss_scale, "
                                                 "so every gradient is computed scaled")
        scaled.type, scaled.shape = seed.type, seed.shape
        for user, index in uses:
            user.replace_input_with(index, scaled)
            if _our_cast(user):  # (it reads the scaled seed now)
                self.rewired.setdefault(id(user), (user, None))
        # The new Mul was appended last; it must run before the seed's consumers.
        from onnx_ir.passes.common import TopologicalSortPass

        TopologicalSortPass()(self.model)
        return scaled

    def _update(self, scale: Any, tracker: Any, finite: Any) -> tuple[Any, Any]:
        ir = self.ir
        FLOAT, INT64 = ir.DataType.FLOAT, ir.DataType.INT64
        c = self.plan.config
        why = "training: dynamic loss scale update (LossScaler / torch.amp.GradScaler semantics)"
        if not c.dynamic:
            s = self.node("Identity", [scale], "training: static loss scale", out=NEXT_LOSS_SCALE)
            t = self.node("Identity", [tracker], "training: static loss scale", out=NEXT_GROWTH_TRACKER)
            return self.typed(s, FLOAT), self.typed(t, INT64)
        one = self.const(1, "int64", "one")
        zero = self.const(0, "int64", "zero")
        t1 = self.node("Add", [tracker, one], why)
        grow = self.node("Not", [self.node("Less", [t1, self.const(int(c.growth_interval), "int64", "growth_interval")],
                                           why)], why)
        grown = self.node("Min", [self.node("Mul", [scale, self.const(c.growth_factor, "float32", "growth_factor")],
                                            why), self.const(c.max_scale, "float32", "max_scale")], why)
        scale_ok = self.node("Where", [grow, grown, scale], why)
        tracker_ok = self.node("Where", [grow, zero, t1], why)
        backed = self.node("Max", [self.node("Mul", [scale, self.const(c.backoff_factor, "float32", "backoff_factor")],
                                             why), self.const(c.min_scale, "float32", "min_scale")], why)
        s = self.node("Where", [finite, scale_ok, backed], why, out=NEXT_LOSS_SCALE)
        t = self.node("Where", [finite, tracker_ok, zero], why, out=NEXT_GROWTH_TRACKER)
        return self.typed(s, FLOAT), self.typed(t, INT64)


def _our_cast(node: Any) -> bool:
    """A Cast the rewrite placed (its record is in the log and in the node's tags)."""
    return node is not None and node.op_type == "Cast" and TAG + "cast" in node.metadata_props \
        and node.metadata_props.get(TAG + "inserted") == "cast"


def _label(node: Any) -> str:
    """A node's name in the report (passes.base.node_label: the tagged label of an unnamed node)."""
    return node.metadata_props.get(TAG + "label") or node.name or \
        f"{node.op_type}:{node.outputs[0].name if node.outputs else ''}"


def _subgraph_outputs(graph: Any) -> dict[int, list[Any]]:
    """id of a body's output value -> the outputs of the If/Loop/Scan that it leaves as: an If's
    branch output i is the If's output i; a Loop body's output j (after its condition) is the
    Loop's output j - 1; a Scan body's output j is the Scan's output j."""
    from onnx_ir.traversal import RecursiveGraphIterator

    leaves: dict[int, list[Any]] = {}
    for node in RecursiveGraphIterator(graph):
        shift = 1 if node.op_type == "Loop" and not node.domain else 0
        for body in _bodies(node):
            for j, out in enumerate(body.outputs):
                if 0 <= j - shift < len(node.outputs):
                    leaves.setdefault(id(out), []).append(node.outputs[j - shift])
    return leaves


def _reached_from(value: Any, graph: Any) -> set[int]:
    """ids of the values computed from ``value``: through every reader, and from a body's output
    to its If/Loop/Scan's."""
    leaves = _subgraph_outputs(graph)
    reached: set[int] = set()
    stack = [value]
    while stack:
        v = stack.pop()
        if id(v) in reached:
            continue
        reached.add(id(v))
        stack.extend(leaves.get(id(v), ()))
        for user, _ in v.uses():
            stack.extend(user.outputs)
    return reached


def _feeding(values: list[Any]) -> set[int]:
    """ids of the nodes that ``values`` are computed from: their producers and everything upstream,
    with the nodes of any If/Loop/Scan body among them and what those bodies read from outside."""
    seen: set[int] = set()
    stack = [v.producer() for v in values if v.producer() is not None]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        stack.extend(v.producer() for v in node.inputs if v is not None and v.producer() is not None)
        for body in _bodies(node):
            stack.extend(body)  # (a body's nodes; each pushes the producers of what it reads)
    return seen


def _from_constants(value: Any, fed: Collection[int]) -> bool:
    """Whether ``value`` is computed from constants alone: initializers and Constant nodes, through
    nodes without bodies (no graph input, no outer value read by a body, no initializer a caller
    may feed: ``fed``)."""
    seen: set[int] = set()
    stack = [value]
    while stack:
        v = stack.pop()
        if id(v) in seen:
            continue
        seen.add(id(v))
        producer = v.producer()
        if producer is None:
            if v.const_value is None or id(v) in fed:  # (a graph input, or a default one may feed)
                return False
            continue
        if next(_bodies(producer), None) is not None:
            return False
        stack.extend(i for i in producer.inputs if i is not None)
    return True


def _bodies(node: Any):
    from .scale_degree import bodies

    return bodies(node)


def _attr(ir: Any, key: str, value: Any) -> Any:
    if isinstance(value, bool) or isinstance(value, int):
        return ir.AttrInt64(key, int(value))
    if isinstance(value, float):
        return ir.AttrFloat32(key, value)
    raise TypeError(f"attribute {key}: {type(value).__name__}")


def training_info(model: Any) -> dict | None:
    """What a training rewrite added (names of the new inputs/outputs, the scale config), read from
    an ``onnx.ModelProto`` or an onnx-ir model; None when the model was not rewritten for training."""
    props = model.metadata_props
    if isinstance(props, dict) or hasattr(props, "get"):
        raw = props.get(TRAINING_KEY)
    else:
        raw = next((p.value for p in props if p.key == TRAINING_KEY), None)
    return json.loads(raw) if raw else None
