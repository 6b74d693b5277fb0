"""The torch side of :func:`amp_rewrite.rewrite`: capture → load → passes → emit.

``rewrite(model, example_inputs=(x,), target="fp16")`` accepts

- an ``nn.Module``, with ``example_inputs`` (and/or ``example_kwargs``), which it needs to learn
  every tensor's dtype: captured with ``torch.export.export`` (non-strict), which gives an
  ATen-level graph with every module traced through; if export fails (data-dependent control flow,
  unsupported Python), it falls back to ``torch.fx.symbolic_trace`` and says so in the report's
  notes. ``capture="export"`` or ``capture="symbolic_trace"`` forces one;
- a ``torch.fx.GraphModule`` from ``symbolic_trace`` (torch level, with call_module leaves such as
  BatchNorm, LSTM and MultiheadAttention) or from ``torch.export`` (``ep.module()``, before or after
  ``run_decompositions()``);
- a ``torch.export.ExportedProgram`` (its ``.module()`` is rewritten).

The bodies of higher-order ops (torch.cond's branches, while_loop's, a ``torch.no_grad()``
block's) are GraphModules of their own: each is rewritten as a scope whose inputs and outputs keep
their types, and its decisions join the report under the body's attribute path
(``true_graph_0/linear``), a name ``fp32_nodes`` takes too (``true_graph_0/*`` pins one branch; a
body-local name, ``linear``, every body's node of that name). A ``torch.autocast`` region is left
as written.

It returns a GraphModule (``RewriteResult.model``); the caller's module is never modified. The
report is available as for ONNX (``rewrite(..., report=True)`` or ``RewriteResult.report``), and the
decision log travels with the module in ``gm.meta["amp_rewrite.log"]``.

Training (``training=True``): parameters stay FP32 and are cast at use (gradients land in FP32);
the loss and whatever feeds it after the last allow op stay FP32; when the module returns a loss (a
scalar float output, or the output ``loss_output`` names: its index among the flattened outputs or
its fx node name; of several scalar float outputs, the one a gradient reaches, else it must be
named) the output becomes
``loss * self.amp_loss_scale``, an FP32 scalar buffer starting at 1.0 that
:class:`amp_rewrite.LossScaler` updates, and ``gm.amp_training`` is True. That loss scaling is for
fp16 (``loss_scaling=None``, the default: on for fp16, off for bf16, whose exponent range is
FP32's); a bf16 rewrite adds no buffer, ``gm.amp_loss_scaling`` is False, and it trains with
``loss.backward()`` and ``optimizer.step()``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import inspect
import os
import re
import threading
import warnings
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.fx as fx

from .api import RewriteResult, _as_list, _record_pins, flag, make_context, rule_book, run_pipeline
from .decisions import Category
from .errors import UnsupportedModelError, UsageError, first_line
from .ir import DType, Model, Value
from .loss_scale import loss_scaling_for, no_scaling_reason

CAPTURES = ("auto", "export", "symbolic_trace")
_CONTEXT_OPTIONS = ("fp32_nodes", "fp16_nodes", "fp32_ops", "fp16_ops", "placement", "verify_each")
_TRAINING_LOSS_REASON = ("training: the loss and what feeds it after the last allow op stay FP32 "
                         "(precision contract, 'Loss in FP32')")


# torch's captures are not thread-safe: torch.export keeps a process-wide dispatch-mode stack and
# fx.symbolic_trace patches nn.Module.__call__ for the whole process. Rewrites in several threads
# failed with errors blaming the model or the example inputs, or fell back to symbolic_trace with a
# different graph; one torch rewrite at a time (the ONNX path needs no lock).
_TORCH_REWRITE = threading.RLock()


def rewrite_torch(obj: Any, **kwargs: Any) -> RewriteResult:
    """Rewrite a torch module or graph; see the module docstring and :func:`_rewrite_torch`. Calls
    from several threads run one at a time."""
    with _TORCH_REWRITE, contextlib.ExitStack() as stack:
        for device in ambient_autocast():  # (the capture's types are the module's, not autocast's)
            stack.enter_context(torch.autocast(device, enabled=False))
        return _rewrite_torch(obj, **kwargs)


def ambient_autocast() -> list[str]:
    """The device types whose torch.autocast is on where this is called."""
    on = []
    for device in ("cpu", "cuda", "xpu", "mps"):
        try:
            if torch.is_autocast_enabled(device):
                on.append(device)
        except (RuntimeError, TypeError, ValueError):  # (a device type this torch does not know)
            pass
    return on


def _rewrite_torch(obj: Any, *, example_inputs: Sequence[Any] | None = None, target: str = "fp16",
                   rules: Any = (), keep_io_types: bool = True, training: bool = False,
                   loss_output: int | str | None = None, capture: str = "auto",
                   example_kwargs: dict[str, Any] | None = None, decompose: bool = False,
                   loss_scaling: bool | None = None, dynamic_shapes: Any = None, _in_compile: bool = False,
                   **options: Any) -> RewriteResult:
    """Extra options are those of :func:`amp_rewrite.api.make_context` (fp32_nodes, fp16_ops,
    placement, ...). ``_in_compile``: the graph is one dynamo captured (compile_backend), whose
    outputs need not hold the loss."""
    unknown = sorted(set(options) - set(_CONTEXT_OPTIONS))
    if unknown:
        raise UsageError(f"rewrite() got unknown option(s) {', '.join(unknown)} for a torch model")
    if capture not in CAPTURES:
        raise UsageError(f"unknown capture {capture!r}: choose one of {', '.join(CAPTURES)}")
    if loss_output is not None and not training:
        raise UsageError("loss_output names the loss to scale for training: pass training=True with it (or drop it)")
    if loss_scaling is not None and not training:
        raise UsageError("loss_scaling applies to training: pass training=True with it (or drop it)")
    scaling = loss_scaling_for(target, loss_scaling) if training else False
    flag("decompose", decompose)
    if decompose and capture == "symbolic_trace":
        raise UsageError("decompose=True decomposes a torch.export capture into aten ops; symbolic_trace makes "
                         "no such graph: use capture='export' (or 'auto'), or drop decompose")
    example_inputs = _as_tuple(example_inputs)
    _check_example_inputs(obj, example_inputs, example_kwargs)
    notes: list[str] = []
    before = getattr(getattr(obj, "meta", None), "get", lambda _k: None)("amp_rewrite.log")
    if before is not None and getattr(before, "target", target) != target:
        raise UsageError(f"this module was rewritten to {before.target} already (its amp_rewrite log says so); "
                         f"rewrite the FP32 original for {target}")
    if training and before is not None and not getattr(obj, "amp_training", False) and isinstance(obj, torch.nn.Module):
        low = [n for n, p in obj.named_parameters() if p.dtype in (torch.float16, torch.bfloat16)]
        if low:
            raise UsageError(f"this module was rewritten for inference already, with weights converted to "
                             f"{before.target} ({low[0]}{' and more' if len(low) > 1 else ''}): training needs "
                             f"them FP32 (master weights); rewrite the FP32 original with training=True")
    gm, how = capture_graph(obj, example_inputs, example_kwargs, capture=capture, decompose=decompose, notes=notes,
                            training=training, dynamic_shapes=dynamic_shapes)
    from .frontends.fx_loader import load_fx

    program = getattr(gm, "_amp_exported_program", None)
    try:
        # (an export capture refuses a write seen through another name: its functionalized graph,
        # below, lets the written tensor's producer go low, where keeping the storage whole would not)
        model = load_fx(gm, example_inputs=example_inputs, capture=how, example_kwargs=example_kwargs, target=target,
                        shared_storage=program is None)
    except UnsupportedModelError as exc:
        if program is None or "in place" not in exc.message:
            raise
        # torch.export's default IR keeps in-place ops; its decomposed IR is functional
        notes.append(f"{exc.message.split(';')[0]}: rewrote the functionalized graph of "
                     f"ExportedProgram.run_decompositions() instead")
        gm = _decomposed(program, training)
        model = load_fx(gm, example_inputs=example_inputs, capture=how, example_kwargs=example_kwargs, target=target)
    if hasattr(gm, "_amp_exported_program"):
        del gm._amp_exported_program
    if training and not keep_io_types:
        raise UsageError("training=True keeps graph inputs and outputs FP32 (the loss is scaled and its gradient "
                         "enters the graph in FP32): drop keep_io_types=False")
    loss_value = _loss_value(model, loss_output, notes) if training and not _in_compile else None
    if training and _in_compile:
        # a graph break makes an intermediate scalar a graph output, and a recompile a second graph with
        # a buffer of its own: an in-graph scale found the wrong "loss" or went unnoticed by the scaler
        notes.append("training under torch.compile: the loss is scaled outside the graph (LossScaler().backward(loss) "
                     "or scaler.scale(loss).backward()); a graph dynamo captures need not end at the loss")
    fp32_nodes = _as_list("fp32_nodes", options.pop("fp32_nodes", None))  # (one pattern, not its letters)
    user_fp32_nodes = list(fp32_nodes)
    tail: list[str] = []
    if loss_value is not None:
        tail = _loss_tail(model, target, rules, loss_value, options, fp32_nodes)
        fp32_nodes += tail
    ctx = make_context(frontend="torch", target=target, rules=rules, keep_io_types=keep_io_types,
                       training=training, loss=loss_value.name if loss_value is not None else None,
                       fp32_nodes=fp32_nodes, **options)
    if training and loss_value is None and scaling and not model.graph.meta.get("fx.no_loss"):
        notes.append("training: no loss output found (no scalar float tensor among the outputs the capture sees; "
                     "a dataclass output torch cannot flatten hides its tensors), so nothing is scaled in the graph: "
                     "scale the loss with LossScaler().backward(loss), or name it with loss_output=")
    if training and loss_value is not None:
        notes.append(f"training: loss {loss_value.name!r} scaled in the graph by the buffer amp_loss_scale "
                     f"(LossScaler updates it)" if scaling else
                     f"training: no loss scaling ({no_scaling_reason(target, 'loss_scaling=True')})")
    _check_rule_input_names(model, ctx.rules)
    ctx.log.notes.extend(notes)
    modified = run_pipeline(model, ctx) or _record_pins(model, ctx, internal=tail)
    _explain_conversions(model, ctx)
    _explain_tail(ctx, set(tail))
    if modified:
        from .emitters.fx_emitter import emit_fx

        gm = emit_fx(model, ctx.log, training=training)
    if scaling and loss_value is not None and not hasattr(gm, "amp_loss_scale"):  # once: rewriting again adds none
        from .emitters.fx_emitter import insert_loss_scale

        # (the output slot _loss_value chose: one tensor returned twice has two)
        insert_loss_scale(gm, model.graph.meta["fx.loss_slot"], model.meta.get("fx.level", "torch"))
        modified = True
    if _rewrite_bodies(gm, ctx.log, target=target, rules=rules, fp32_nodes=user_fp32_nodes, options=options):
        modified = True
    if how == "export":
        _keep_captured_mode(gm, obj.training if isinstance(obj, torch.nn.Module) else _graph_mode(gm))
        _refuse_container_hooks(gm)
    if training:
        from .training import register_training_module

        _preserve(gm, "amp_training", True)
        _preserve(gm, "amp_loss_scaling", hasattr(gm, "amp_loss_scale"))
        register_training_module(gm)
    gm.meta["amp_rewrite.log"] = ctx.log
    gm.meta["amp_rewrite.target"] = target
    _refuse_pickling(gm)
    source = f"torch:{type(obj).__name__} (captured with {how})"
    return RewriteResult(gm, ctx.log, modified, source=source)


_PICKLE_REFUSED = (
    "a module rewritten by amp-rewrite cannot be pickled whole (torch.save(gm)): torch rebuilds a GraphModule "
    "from its code on load, which drops the rewrite's state-dict hooks, turns buffers read at a cast into "
    "constants and keeps stale low-precision copies of weights (wrong numbers after load_state_dict). Save "
    "gm.state_dict() instead (its keys are the original model's); to resume, rewrite the model again and "
    "load that state dict into the new module")


def _refuse_pickling(gm: fx.GraphModule) -> None:
    """``torch.save(gm)`` would pickle a module that comes back wrong: refuse it, saying what to do.
    (A GraphModule's class is its own, made for the instance, so this touches no other module; a
    deep copy, which GraphModule makes by rebuilding the instance, gets the refusal again.)"""
    import pickle

    def __reduce__(self: Any) -> Any:  # noqa: N807 - the pickle protocol's name
        raise pickle.PicklingError(_PICKLE_REFUSED)

    type(gm).__reduce__ = __reduce__
    if _refuse_pickling not in getattr(gm, "_deepcopy_hooks", ()):
        gm._register_deepcopy_hook(_refuse_pickling)


def allow_pickling(gm: fx.GraphModule) -> None:
    """Undo ``_refuse_pickling`` for a graph no user holds: the one the torch.compile backend hands
    its inner compiler, which inductor and AOTAutograd pickle for their cache keys (torch 2.11 logged
    the refusal's traceback and compiled without its cache)."""
    if "__reduce__" in vars(type(gm)):
        del type(gm).__reduce__
    hooks = getattr(gm, "_deepcopy_hooks", None)
    if hooks and _refuse_pickling in hooks:
        hooks.remove(_refuse_pickling)


MIXED = "mixed"  # an ExportedProgram's ops captured in both modes (a submodule switched apart)


class ExportedSubmodule(torch.nn.Module):
    """A submodule of a torch.export capture: a holder of its parameters and buffers, which the
    graph reads by path; the graph never calls it. A forward hook or pre-hook registered on it
    would never run: refused, saying what runs them."""

    def _refuse(self, kind: str) -> None:
        raise NotImplementedError(
            f"this submodule of a torch.export capture only holds parameters (the rewritten graph is one "
            f"flat graph that never calls it), so a forward {kind} registered on it would never run: register "
            f"it on the original module before rewriting (it is traced into the graph), on the rewritten "
            f"module itself, or rewrite with capture='symbolic_trace', which keeps submodule calls")

    def register_forward_hook(self, *args: Any, **kwargs: Any) -> Any:
        self._refuse("hook")

    def register_forward_pre_hook(self, *args: Any, **kwargs: Any) -> Any:
        self._refuse("pre-hook")


def _refuse_container_hooks(gm: fx.GraphModule) -> None:
    """The export capture's submodules are plain holders (``nn.Module`` itself): give them the
    class that refuses hooks (a class, not instance attributes, so pickling and deep copies keep it)."""
    for _, sub in gm.named_modules():
        if type(sub) is torch.nn.Module:
            sub.__class__ = ExportedSubmodule


def _keep_captured_mode(gm: fx.GraphModule, training: bool | str | None) -> None:
    """torch.export bakes train/eval behaviour (dropout, BatchNorm statistics) into the graph:
    ``gm.eval()`` on the rewritten module would change nothing, silently. Asking for the mode it was
    captured in is fine (and sets ``gm.training``); asking for the other one is an error that says
    what to do. torch's own ``ExportedProgram.module()`` refuses both. ``training`` None: the graph
    does nothing mode-dependent, so either mode is fine; MIXED: neither is. A deep copy keeps the
    guard."""
    gm.meta["amp_rewrite.captured_mode"] = training
    _install_mode_guard(gm)
    gm._register_deepcopy_hook(_install_mode_guard)


def _install_mode_guard(gm: fx.GraphModule) -> None:
    import types

    training = gm.meta.get("amp_rewrite.captured_mode")

    def mode(self: torch.nn.Module, wanted: bool = True) -> torch.nn.Module:
        if training is not None and bool(wanted) is not training:
            captured = "training" if training is True else "eval" if training is False else \
                "a mix of training and eval"
            raise NotImplementedError(
                f"this module was captured by torch.export in {captured} mode, which is part of its graph "
                f"(dropout, BatchNorm statistics): call model.{'eval' if wanted is False else 'train'}() on the "
                f"original module and rewrite it again")
        return torch.nn.Module.train(self, bool(wanted))

    gm.train = types.MethodType(mode, gm)  # type: ignore[method-assign]
    gm.eval = types.MethodType(lambda self: mode(self, False), gm)  # type: ignore[method-assign]
    if isinstance(training, bool):
        torch.nn.Module.train(gm, training)


# aten ops whose behaviour depends on the mode, and the argument that says which it was captured in
_MODE_ARGS = {"dropout": (2, "train"), "feature_dropout": (2, "train"), "alpha_dropout": (2, "train"),
              "feature_alpha_dropout": (2, "train"), "native_dropout": (2, "train"),
              "batch_norm": (5, "training"), "native_batch_norm": (5, "training"),
              "_native_batch_norm_legit": (5, "training"), "_native_batch_norm_legit_functional": (5, "training"),
              "instance_norm": (5, "use_input_stats")}


def _graph_mode(gm: fx.GraphModule) -> bool | str | None:
    """The mode an ExportedProgram was captured in, read from its mode-dependent ops (its
    ``module()`` says ``training=True`` whatever it was): True/False, None where it does nothing
    mode-dependent, MIXED where its ops were captured in both."""
    modes = set()
    for module in gm.modules():
        if not isinstance(module, fx.GraphModule):
            continue
        for node in module.graph.nodes:
            name = getattr(getattr(node.target, "_overloadpacket", None), "__name__", None)
            if node.op != "call_function" or name is None:
                continue
            if name == "_native_batch_norm_legit_no_training":
                modes.add(False)
            elif name in _MODE_ARGS:
                index, key = _MODE_ARGS[name]
                flag = node.args[index] if len(node.args) > index else node.kwargs.get(key)
                if isinstance(flag, bool):
                    modes.add(flag)
    if len(modes) == 2:
        return MIXED
    return modes.pop() if modes else None


def _preserve(gm: fx.GraphModule, name: str, value: Any) -> None:
    """An attribute a deep copy of the module keeps (GraphModule's copy rebuilds the instance)."""
    from torch.fx.graph_module import _USER_PRESERVED_ATTRIBUTES_KEY

    setattr(gm, name, value)
    gm.meta.setdefault(_USER_PRESERVED_ATTRIBUTES_KEY, {})[name] = value


def report_of(gm: fx.GraphModule):
    """The report of a module :func:`rewrite_torch` returned."""
    from .report import Report

    log = getattr(gm, "meta", {}).get("amp_rewrite.log")
    if log is None:
        raise UsageError("this module was not produced by amp_rewrite.rewrite()")
    return Report.from_log(log, source=type(gm).__name__)


# -- bodies of higher-order ops ------------------------------------------------------------------------------
def _rewrite_bodies(gm: fx.GraphModule, log: Any, *, target: str, rules: Any, fp32_nodes: list[str],
                    options: dict[str, Any]) -> bool:
    """Rewrite the body graphs of gm's higher-order ops (torch.cond branches, while_loop bodies, a
    ``torch.no_grad()`` block) as scopes of their own, their inputs and outputs keeping their
    types (the op itself keeps its types in gm), and merge their decisions into ``log`` under the
    body's attribute path. A ``torch.autocast`` region is left as written: torch decides the
    precision inside it. Nested bodies are rewritten by the recursive call."""
    from .frontends.fx_loader import AUTOCAST_REGION, BODY_MARK, body_modules, hop_name

    outer = gm.meta.get(BODY_MARK)  # (a body's own scope, for the bodies nested in it)
    done: set[str] = set()
    modified = False
    for node in list(gm.graph.nodes):
        bodies = body_modules(node, gm)
        if not bodies or hop_name(node) == AUTOCAST_REGION:
            continue
        for path in bodies:
            if path in done:
                continue
            done.add(path)
            prefix, _, attr = path.rpartition(".")
            owner = gm.get_submodule(prefix) if prefix else gm
            # (its inputs are the enclosing graph's values; its nodes' names in the report are scoped
            # by its path, true_graph_0/linear_1, and a node pattern may name them so)
            getattr(owner, attr).meta[BODY_MARK] = f"{outer}/{path}" if isinstance(outer, str) else path
            result = rewrite_torch(getattr(owner, attr), target=target, rules=rules, keep_io_types=True,
                                   fp32_nodes=fp32_nodes, **options)
            body = result.model
            body.meta.pop(BODY_MARK, None)
            body.meta.pop("amp_rewrite.log", None)
            body.meta.pop("amp_rewrite.target", None)
            setattr(owner, attr, body)
            _merge_body_log(log, result.log, path)
            modified = modified or result.modified
    return modified


def _merge_body_log(log: Any, body: Any, scope: str) -> None:
    """Add a body's decisions to the enclosing graph's log, its names prefixed by the body's path."""
    def name(label: str | None) -> str | None:
        return label if label is None or label.startswith("<") else f"{scope}/{label}"

    def scoped(inner: str) -> str:
        return scope if inner == "main" else f"{scope}/{inner}"

    offset = len(log.islands)
    for island in body.islands:
        log.islands.append(dataclasses.replace(island, id=island.id + offset, scope=scoped(island.scope),
                                               members=[name(m) for m in island.members],
                                               seeds=[name(m) for m in island.seeds]))
    for label, decision in body.decisions.items():
        log.decisions[name(label)] = dataclasses.replace(
            decision, node=name(decision.node), via=name(decision.via),
            island=None if decision.island is None else decision.island + offset)
    for cast in body.casts:
        log.casts.append(dataclasses.replace(cast, name=name(cast.name), tensor=name(cast.tensor),
                                             producer=name(cast.producer),
                                             consumers=[name(c) for c in cast.consumers], scope=scoped(cast.scope)))
    for fusion in body.fusions:
        log.fusions.append(dataclasses.replace(fusion, node=name(fusion.node),
                                               members=[name(m) for m in fusion.members]))
    for op, count in body.unlisted_ops.items():
        log.unlisted_ops[op] = log.unlisted_ops.get(op, 0) + count
    for field in dataclasses.fields(log.weights):
        mine, theirs = getattr(log.weights, field.name), getattr(body.weights, field.name)
        setattr(log.weights, field.name, mine + theirs)
    # a node pattern is unmatched only if it names no node in the graph nor in any body (the
    # enclosing graph's note says so once; the body's own is not repeated)
    still = {_unmatched_rule(n) for n in body.notes if n.startswith("unmatched:")}
    log.notes[:] = [n for n in log.notes if not n.startswith("unmatched:") or _unmatched_rule(n) in still]
    log.notes.extend(f"{scope}: {note}" for note in body.notes if not note.startswith("unmatched:"))
    log.operand_shapes.update({name(k): v for k, v in body.operand_shapes.items()})


def _unmatched_rule(note: str) -> str:
    return note.split(" names no node", 1)[0]  # ("unmatched: <source> '<pattern>'")


# -- capture --------------------------------------------------------------------------------------------------
def _refuse_root_hooks(obj: torch.nn.Module, export_error: BaseException | None) -> None:
    """Hooks on the module itself run around its forward, which symbolic_trace traces without them
    (a submodule's hooks run inside, and are traced): the rewritten module would silently compute
    without them. Refused, with the captures that keep them."""
    kinds = [kind for kind, table in (("forward", obj._forward_hooks), ("forward pre-", obj._forward_pre_hooks))
             if table]
    if not kinds:
        return
    hooks = " and ".join(kinds) + "hooks" if len(kinds) > 1 else f"{kinds[0].rstrip()}{'' if '-' in kinds[0] else ' '}hooks"
    way = (f"torch.export, which keeps them, could not capture it ({_export_cause(export_error)})"
           if export_error is not None else "capture it with torch.export (capture='export', with example_inputs), "
           "which keeps them")
    what = "a symbolic_trace capture"
    raise UnsupportedModelError(
        f"{type(obj).__name__} has {hooks} registered on itself, which {what} does not keep "
        f"(the rewritten module would run without them): {way}, or register them on the rewritten module")


def capture_graph(obj: Any, example_inputs: tuple | None, example_kwargs: dict | None, *, capture: str = "auto",
                  decompose: bool = False, notes: list[str] | None = None,
                  training: bool = False, dynamic_shapes: Any = None) -> tuple[fx.GraphModule, str]:
    """A private GraphModule to patch, and how it was obtained. ``dynamic_shapes``: torch.export's
    (without it the capture holds the example inputs' sizes, batch included)."""
    notes = notes if notes is not None else []
    if dynamic_shapes is not None and (capture == "symbolic_trace" or not isinstance(obj, torch.nn.Module)
                                       or isinstance(obj, fx.GraphModule)):
        raise UsageError("dynamic_shapes is torch.export's, for capturing an nn.Module with capture='auto' or "
                         "'export'; a symbolic_trace capture, a GraphModule and an ExportedProgram keep the shapes "
                         "they have: drop dynamic_shapes")
    exported = getattr(torch.export, "ExportedProgram", None)
    if exported is not None and isinstance(obj, exported):
        if capture == "symbolic_trace":
            raise UsageError("capture='symbolic_trace' asks to trace an nn.Module; an ExportedProgram is already "
                             "captured by torch.export: drop capture (or pass the nn.Module itself)")
        return _module_of(obj, decompose, training), "export"
    if isinstance(obj, fx.GraphModule):
        if capture == "export" or decompose:  # (symbolic_trace: a GraphModule is such a graph already)
            given = f"capture={capture!r}" if capture == "export" else "decompose=True"
            raise UsageError(f"{given} applies to capturing an nn.Module; a GraphModule is already a graph and is "
                             f"rewritten as it is: drop {given.split('=')[0]} (or pass the nn.Module itself)")
        return _private_copy(obj), "graph_module"
    if not isinstance(obj, torch.nn.Module):
        raise UsageError(f"rewrite_torch takes an nn.Module, a GraphModule or an ExportedProgram, "
                         f"not {type(obj).__name__}")
    export_error: BaseException | None = None
    if capture in ("auto", "export"):  # (example inputs were checked: rewrite_torch asks for them)
        try:
            ep = torch.export.export(obj, tuple(example_inputs or ()), dict(example_kwargs or {}), strict=False,
                                     dynamic_shapes=dynamic_shapes)
            if dynamic_shapes is None and _has_sized_input(example_inputs, example_kwargs):
                notes.append("captured with torch.export for the example inputs' sizes: a call with another "
                             "batch size fails torch's guard; pass dynamic_shapes= (torch.export's, e.g. "
                             "{'x': {0: torch.export.Dim.AUTO}}) to keep it dynamic")
            return _module_of(ep, decompose, training), "export"
        except Exception as exc:  # noqa: BLE001 - export fails in many ways; fall back, say why
            if dynamic_shapes is not None:  # (the caller asked export for them: no silent fallback)
                raise UsageError(f"torch.export could not capture {type(obj).__name__} with the dynamic_shapes "
                                 f"given: {_export_cause(exc)}") from exc
            if capture == "export":
                raise UnsupportedModelError(f"torch.export could not capture {type(obj).__name__}: "
                                            f"{_export_cause(exc)}; {_EXPORT_ADVICE}") from exc
            export_error = exc
            notes.append(f"torch.export failed ({first_line(exc, 300)}); fell back to torch.fx.symbolic_trace")
            warnings.warn(f"amp_rewrite: torch.export failed for {type(obj).__name__} ({first_line(exc, 300)}); "
                          f"falling back to torch.fx.symbolic_trace", stacklevel=3)
    _refuse_root_hooks(obj, export_error)
    # Tracing runs forward on the module it is given: an attribute forward assigns (self.calls += 1)
    # is set to a Proxy there, and the traced graph shares its submodules. It traces a private copy.
    private = _private_copy(obj)
    before = _tensor_versions(private)
    fixed = _none_arguments(obj, example_inputs, example_kwargs)
    try:
        with _mode_switches() as switched:
            traced = _symbolic_trace(private, fixed or None)
    except Exception as exc:  # noqa: BLE001
        if export_error is not None:
            # export's failure is the one to fix: symbolic_trace cannot run most modules export
            # cannot (it feeds Proxies to every argument, an optional one left None included, so an
            # HF model's own argument checks raise), and its error hid export's cause
            raise UnsupportedModelError(
                f"torch.export could not capture {type(obj).__name__}: {_export_cause(export_error)}; "
                f"{_EXPORT_ADVICE} (the torch.fx.symbolic_trace fallback failed too: {first_line(exc, 300)})") from exc
        raise UnsupportedModelError(
            f"torch.fx.symbolic_trace could not trace {type(obj).__name__}: {first_line(exc, 300)}") from exc
    from .emitters.fx_emitter import keep_non_persistent, non_persistent_buffers

    if fixed:  # (fx names such a parameter "mask_1": a call passing mask=None by keyword was refused)
        for node in traced.graph.nodes:
            if node.op == "placeholder" and isinstance(node.target, str) and node.target.endswith("_1") \
                    and node.target[:-2] in fixed:
                node.target = node.target[:-2]
        traced.recompile()
    unread = _keep_unread_tensors(traced, private)
    _restore_declaration_order(traced, private)
    folded = [name for name, _ in traced.named_buffers() if name.split(".")[-1].startswith("_tensor_constant")]
    if unread["buffer"] and folded:
        notes.append(f"symbolic_trace: {_listed(unread['buffer'])} {'is' if len(unread['buffer']) == 1 else 'are'} "
                     f"not read by the traced graph, which holds tensors computed while tracing "
                     f"({_listed(folded)}): if those were computed from {'it' if len(unread['buffer']) == 1 else 'them'}, "
                     f"loading new values changes nothing; capture='export' records the computation")
    # symbolic_trace registers every buffer the graph reads as persistent: a RoPE inv_freq too, and
    # each tensor it computed while tracing (_tensor_constant0: a cos table from buffers alone)
    own = {name for name, _ in private.named_buffers(remove_duplicate=False)}
    keep_non_persistent(traced, non_persistent_buffers(private)
                        + [name for name, _ in traced.named_buffers(remove_duplicate=False) if name not in own])
    after = _tensor_versions(private)
    changed = [name for name, seen in before.items() if after.get(name) != seen]
    if changed:
        # An update that reads no traced value (self.step.add_(1), self.ema.mul_(0.9)) runs on the
        # real tensor while tracing and is not recorded: the rewrite would start one step ahead
        # and never make the update again.
        way = (f"torch.export could not capture it either ({_export_cause(export_error)})" if export_error is not None
               else "capture it with torch.export (pass example_inputs; capture='export'), which records the update")
        raise UnsupportedModelError(
            f"{type(obj).__name__}.forward changes {_listed(changed)} in a way torch.fx.symbolic_trace does not record (an "
            f"in-place update that reads no input, such as self.step.add_(1)): it ran once while tracing, and the "
            f"rewritten module would never run it; {way}")
    _refuse_unrecorded_modes(obj, switched, training, export_error)
    if fixed:
        notes.append(f"symbolic_trace: traced with {', '.join(f'{name}=None' for name in fixed)} as the example "
                     f"inputs leave {'them' if len(fixed) > 1 else 'it'} (symbolic_trace would otherwise trace "
                     f"{'them' if len(fixed) > 1 else 'it'} as a tensor, and the branch the examples do not take): "
                     f"a call passing a value there fails torch.fx's is-None check; rewrite with example inputs "
                     f"that pass it to keep it")
    return traced, "symbolic_trace"


def _none_arguments(obj: torch.nn.Module, example_inputs: tuple | None, example_kwargs: dict | None) -> dict:
    """The forward's parameters that default to None and that the example inputs leave None
    (not passed, or passed as None): symbolic_trace feeds every parameter a Proxy, so ``if mask is
    not None`` traced the branch the examples do not take, and running them then failed (HF's
    ``attention_mask=None``, ``labels=None``). They are traced as the constant None instead."""
    import inspect

    try:
        parameters = list(inspect.signature(obj.forward).parameters.values())
    except (TypeError, ValueError):
        return {}
    given = len(example_inputs or ())
    kwargs = dict(example_kwargs or {})
    fixed = {}
    for index, parameter in enumerate(parameters):
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            break  # (symbolic_trace takes concrete args by name: stop at *args / **kwargs)
        passed = example_inputs[index] if index < given else kwargs.get(parameter.name)
        if parameter.default is None and passed is None:
            fixed[parameter.name] = None
    return fixed


@contextlib.contextmanager
def _mode_switches():
    """Records the autocast and grad-mode switches a forward makes while symbolic_trace runs it:
    ``torch.autocast(...)`` and ``torch.no_grad()`` blocks run at trace time and leave nothing in
    the graph. Yields the list of ("autocast" | "grad", value) switches."""
    switched: list[tuple[str, Any]] = []
    set_autocast, set_grad = torch.set_autocast_enabled, torch._C._set_grad_enabled
    tracer = threading.get_ident()  # (another thread's no_grad is not this forward's; rewrites hold a lock)

    def autocast(*args):
        if threading.get_ident() == tracer:
            switched.append(("autocast", args[-1] if args else None))
        return set_autocast(*args)

    def grad(mode):
        if threading.get_ident() == tracer:
            switched.append(("grad", bool(mode)))
        return set_grad(mode)

    torch.set_autocast_enabled, torch._C._set_grad_enabled = autocast, grad
    try:
        yield switched
    finally:
        torch.set_autocast_enabled, torch._C._set_grad_enabled = set_autocast, set_grad


def _refuse_unrecorded_modes(obj: Any, switched: list, training: bool, export_error: Exception | None) -> None:
    """A ``torch.autocast`` region (``enabled=False`` around a Gram matrix, say) or, in training, a
    ``torch.no_grad()`` block (a frozen teacher, an EMA target) that symbolic_trace dropped: the
    README promises the region is left as written and the block stays gradient-free, and the
    capture silently made the fenced matmul FP16 (inf) and gave the frozen weights gradients,
    which the optimizer then updated. (An inference rewrite loses nothing with a no_grad block.)"""
    kinds = {kind for kind, _ in switched if kind == "autocast" or training}
    if not kinds:
        return
    what = " and ".join(sorted({"autocast": "a torch.autocast region", "grad": "a torch.no_grad()/enable_grad() block"}[k]
                               for k in kinds))
    way = (f"torch.export, which records them, could not capture it ({_export_cause(export_error)})"
           if export_error is not None else "capture it with torch.export (capture='export'), which records them")
    raise UnsupportedModelError(
        f"{type(obj).__name__}.forward has {what}, which torch.fx.symbolic_trace runs while tracing and does not "
        f"record: the rewrite would drop it (a region kept FP32 would run low, frozen weights would get gradients); "
        f"{way}")


def _keep_unread_tensors(traced: fx.GraphModule, original: torch.nn.Module) -> dict[str, list[str]]:
    """Register on ``traced`` the parameters and buffers of ``original`` its graph does not read (an
    unused head, buffers a table computed while tracing was made from), with their persistence:
    symbolic_trace copies only what the graph reads, so the original's checkpoint failed a strict
    load (unexpected keys) and ``state_dict()`` lost keys. Returns their names by kind."""
    have = {n for n, _ in traced.named_parameters(remove_duplicate=False)} \
        | {n for n, _ in traced.named_buffers(remove_duplicate=False)}
    added: dict[str, list[str]] = {"parameter": [], "buffer": []}
    kinds = [("parameter", original.named_parameters(remove_duplicate=False)),
             ("buffer", original.named_buffers(remove_duplicate=False))]
    for kind, items in kinds:
        for name, tensor in items:
            if name in have:
                continue
            path, _, leaf = name.rpartition(".")
            owner = original.get_submodule(path) if path else original
            holder = traced
            for part in path.split(".") if path else ():
                if part not in holder._modules and not hasattr(holder, part):
                    holder.add_module(part, torch.nn.Module())  # (an empty container: no forward is called)
                holder = holder._modules.get(part)
                if holder is None:
                    break  # (the name is taken by something else there: left out)
            if not isinstance(holder, torch.nn.Module) or hasattr(holder, leaf):
                continue
            if kind == "parameter":
                holder.register_parameter(leaf, tensor)
            else:
                holder.register_buffer(leaf, tensor, persistent=leaf not in owner._non_persistent_buffers_set)
            added[kind].append(name)
    return added


def _listed(names: list[str], most: int = 4) -> str:
    return ", ".join(repr(n) for n in names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def _restore_declaration_order(traced: fx.GraphModule, original: torch.nn.Module) -> None:
    """Give ``traced``'s submodules, parameters and buffers the order ``original`` declares them in.
    symbolic_trace copies them in the order the graph first uses them: a module that calls ``b``
    before ``a`` came back with ``parameters()`` in the order b, a, and an optimizer's state_dict
    saved on the original (matched by position) loaded without an error into one built on the
    rewrite, each parameter getting another's moments; ``state_dict()``'s keys came back
    reordered too. (torch.export keeps the declared order.)"""
    for path, module in list(traced.named_modules(remove_duplicate=False)):
        try:
            source = original.get_submodule(path) if path else original
        except AttributeError:
            continue
        if module is source:  # (a leaf module the graph calls: shared, its order is the original's)
            continue
        for slot in ("_modules", "_parameters", "_buffers"):
            held, declared = getattr(module, slot), getattr(source, slot)
            if list(held) == [key for key in declared if key in held]:
                continue  # (already in order, with nothing added between)
            rank = {key: i for i, key in enumerate(declared)}
            ordered = sorted(held, key=lambda key: rank.get(key, len(rank)))
            items = [(key, held[key]) for key in ordered]
            held.clear()
            held.update(items)


def _tensor_versions(module: torch.nn.Module) -> dict[str, tuple[int, int]]:
    """Each parameter's and buffer's identity and version counter (bumped by every in-place write):
    a cheap way to see that running forward changed one, without a copy of the weights."""
    from .frontends.fx_loader import module_tensors

    # (an inference tensor, made by a copy under torch.inference_mode, has no version counter and
    # cannot be written in place outside it)
    return {name: (id(t), t._version) for name, t in module_tensors(module).items() if not t.is_inference()}


_EXPORT_ADVICE = ("torch.compile(model, backend=\"amp_rewrite\") rewrites such a module graph by graph, around "
                  "the graph breaks torch.export cannot take (data-dependent control flow, .item(), unsupported "
                  "Python); or make the forward exportable (torch.cond for a data-dependent branch) and rewrite again")


def _export_cause(exc: BaseException) -> str:
    """torch.export's error, first line, with the line of the module's code that caused it: the
    innermost frame outside torch (and this package) of the traceback torch writes into its error
    ('The following call raised this error:', dynamo's 'from user code:'), else of the traceback
    the error came through (non-strict export runs forward), else the frame its 'Caused by:' line
    names. That last is the first frame outside torch's tracing files, often another torch file
    ('_export/non_strict_utils.py:1205 in __torch_function__'), its path shortened by torch."""
    text = str(exc)
    cause = first_line(exc, 300)
    where = _user_frame(text) or _raising_user_frame(exc)
    if where is None:
        where = next((line.strip()[len("Caused by:"):].strip().strip("()") for line in text.splitlines()
                      if line.strip().startswith("Caused by:")), "")
    return f"{cause} (caused by {where[:200]})" if where else cause


_TRACEBACK_FRAME = re.compile(r'File "([^"]+)", line (\d+), in ([^\s,]+)(?:, code: (.*))?')


def _not_user_code() -> tuple[str, ...]:
    return tuple(os.path.dirname(os.path.realpath(f)) + os.sep for f in (torch.__file__, __file__))


def _is_user_file(path: str, skip: tuple[str, ...]) -> bool:
    return path.startswith("<") or not os.path.realpath(path).startswith(skip)


def _frame_text(path: str, lineno: Any, func: str, code: str | None) -> str:
    code = (code or "").strip()
    return f"{path}:{lineno} in {func}" + (f": {code[:100]}" if code else "")


def _user_frame(text: str) -> str | None:
    """The innermost user-code frame of the traceback lines in torch's error text ('File "m.py",
    line 8, in forward' and the source line under it), as 'm.py:8 in forward: <source>'."""
    skip = _not_user_code()
    lines = text.splitlines()
    found = None
    for i, line in enumerate(lines):
        m = _TRACEBACK_FRAME.search(line)
        if m is None or not _is_user_file(m.group(1), skip):
            continue
        path, lineno, func, code = m.groups()
        if code is None and i + 1 < len(lines) and lines[i + 1].startswith("    ") \
                and not _TRACEBACK_FRAME.search(lines[i + 1]):
            code = lines[i + 1]
        found = _frame_text(path, lineno, func, code)
    return found


def _raising_user_frame(exc: BaseException) -> str | None:
    """The innermost user-code frame the error was raised through (or its cause's)."""
    import traceback

    skip = _not_user_code()
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if _is_user_file(f.filename, skip)]
        if frames:
            f = frames[-1]
            return _frame_text(f.filename, f.lineno, f.name, f.line)
        exc = exc.__cause__ or exc.__context__
    return None


def _symbolic_trace(module: Any, concrete_args: dict | None) -> fx.GraphModule:
    """``fx.symbolic_trace``, tracing into a module with parametrized tensors (weight_norm,
    spectral_norm, orthogonal: ``ParametrizedLinear``, a class torch makes at run time). fx keeps
    every ``torch.nn`` module whole, and those are too: the rule files could not name the made-up
    class, so the layer's GEMM stayed FP32 as an unlisted op. Traced into, it is the layer's own
    op (``linear``, ``conv2d``) reading the weight its parametrization computes, which stays a leaf
    module (``_WeightNorm``: FP32, unlisted)."""
    from torch.nn.utils import parametrize

    class Tracer(fx.Tracer):
        def is_leaf_module(self, m: Any, qualname: str) -> bool:
            return not parametrize.is_parametrized(m) and super().is_leaf_module(m, qualname)

    tracer = Tracer()
    graph = tracer.trace(module, concrete_args=concrete_args)
    return fx.GraphModule(tracer.root, graph, type(module).__name__)


def _module_of(program: Any, decompose: bool, training: bool = False) -> fx.GraphModule:
    """A private copy of ``program.module()``, remembering the program in case its graph needs
    functionalizing. (``module()`` shares its parameters and buffers with the program, and an
    exported nn.Module's program shares them with the module: a training step or a BatchNorm
    update on the rewritten module would change the caller's.)"""
    if decompose:
        return _decomposed(program, training)
    gm = _private_copy(program.module())
    gm._amp_exported_program = program  # dropped below, once loaded
    return gm


def _decomposed(program: Any, training: bool) -> fx.GraphModule:
    """A private copy of ``program.run_decompositions().module()``. Functionalization writes an
    in-place slice copy (``out[..., :4].copy_(h)``) as ``aten.copy``, which autograd has no
    derivative for: for training, copy is decomposed into what it computes (src converted to
    self's dtype, broadcast to self's shape), whose ops have one, or backward would fail."""
    if not training:
        return _private_copy(program.run_decompositions().module())
    table = torch.export.default_decompositions()
    table[torch.ops.aten.copy.default] = _copy_for_autograd
    # (attention stays one op: its math decomposition's softmax backward is NaN on a row that sees
    # no key, a left-padded query, and the where() around it does not remove a NaN gradient)
    table.pop(torch.ops.aten.scaled_dot_product_attention.default, None)
    # (the default table writes detach as alias, which passes gradients: a stop-gradient would be lost)
    table.pop(torch.ops.aten.detach.default, None)
    gm = _private_copy(program.run_decompositions(table).module())
    _unshare_written_back_inputs(gm)
    return gm


def _unshare_written_back_inputs(gm: fx.GraphModule) -> None:
    """Give a functional op a clone of each buffer its result is copied back into.

    Functionalization writes an op that mutates its inputs inside its kernel (BatchNorm's running
    mean and variance) as the op's ``*_functional`` form plus a ``copy_`` of the new value into the
    buffer at the end of the graph. The functional op's autograd node saves the buffer it read, and
    that later ``copy_`` bumps the buffer's version, so backward raised "modified by an inplace
    operation" (eager BatchNorm writes inside the op, after autograd saved it; torch's own
    ``run_decompositions().module()`` fails the same way). A clone of the buffer (the running
    statistics: one value per channel) is what the op reads now; the write-back is unchanged."""
    graph = gm.graph
    copy_ = torch.ops.aten.copy_.default
    written = {n.args[0] for n in graph.nodes
               if n.op == "call_function" and n.target is copy_ and isinstance(n.args[0], fx.Node)}
    changed = False
    for node in list(graph.nodes):
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload) \
                or not target._schema.name.endswith("_functional"):
            continue
        for arg in dict.fromkeys(a for a in node.args if isinstance(a, fx.Node) and a in written):
            with graph.inserting_before(node):
                clone = graph.call_function(torch.ops.aten.clone.default, (arg,))
            if "val" in arg.meta:
                clone.meta["val"] = arg.meta["val"]
            node.replace_input_with(arg, clone)
            changed = True
    if changed:
        graph.lint()
        gm.recompile()


def _copy_for_autograd(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    aten = torch.ops.aten
    device = {} if src.device == self.device else {"device": self.device}
    out = aten._to_copy.default(src, dtype=self.dtype, **device)
    return out if out.shape == self.shape else aten.expand.default(out, list(self.shape))


def _has_sized_input(example_inputs: tuple | None, example_kwargs: dict | None) -> bool:
    tensors = [t for t in (*(example_inputs or ()), *(example_kwargs or {}).values()) if isinstance(t, torch.Tensor)]
    return any(t.ndim > 0 for t in tensors)


def _private_copy(gm: torch.nn.Module) -> Any:
    """A deep copy: the emitter replaces parameters and edits nodes, the caller's module stays as is."""
    from .emitters.fx_emitter import keep_non_persistent, non_persistent_buffers

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch's own pytree specs deprecations
        try:
            clone = copy.deepcopy(gm)
        except RuntimeError as exc:  # a computed tensor held as an attribute: torch's deepcopy refuses it
            hint = ("the hook-based torch.nn.utils.weight_norm/spectral_norm keep such a tensor after a "
                    "forward: use torch.nn.utils.parametrizations.weight_norm/spectral_norm, or "
                    "capture='export'" if "graph leaves" in str(exc) else "capture='export' may copy it")
            raise UnsupportedModelError(f"{type(gm).__name__} cannot be copied for the rewrite (the input "
                                        f"module is never edited): {first_line(exc, 200)}; {hint}") from None
    if isinstance(clone, fx.GraphModule):
        # GraphModule's deepcopy registers every buffer again as persistent (ep.module() keeps a
        # RoPE inv_freq non-persistent, the copy did not): strict checkpoint loads failed both ways
        keep_non_persistent(clone, non_persistent_buffers(gm))
    # GraphModule's deepcopy registers the tensor constants the graph reads (torch.export's
    # lifted_tensor_0 for a torch.tensor(2.0) in forward: T5, BART, Whisper) as buffers, which put a
    # key in the state_dict that the original has not, so checkpoints no longer loaded either way
    buffers = {name for name, _ in gm.named_buffers()}
    for name, tensor in list(clone.named_buffers()):
        if name not in buffers:
            path, _, attr = name.rpartition(".")
            owner = clone.get_submodule(path) if path else clone
            del owner._buffers[attr]
            setattr(owner, attr, tensor)
    return clone


def _check_example_inputs(obj: Any, example_inputs: tuple | None, example_kwargs: Any) -> None:
    """Example inputs a module's forward can take, said before capturing: a list for example_kwargs
    failed with "'list' object has no attribute 'items'", a module without any with "this
    GraphModule carries no dtype metadata", and an extra positional input, which torch.export
    refuses, was dropped by the symbolic_trace fallback without a word."""
    if example_kwargs is not None and not isinstance(example_kwargs, Mapping):
        raise UsageError(f"example_kwargs is a {type(example_kwargs).__name__}: pass a dict of keyword inputs "
                         f"(parameter name -> value); positional inputs go in example_inputs")
    if not isinstance(obj, torch.nn.Module) or isinstance(obj, fx.GraphModule):
        return  # (a GraphModule carries its metadata, or is given inputs to learn it; an ExportedProgram has it)
    name = type(obj).__name__
    if example_inputs is None and not example_kwargs:
        raise UsageError(f"rewriting the nn.Module {name} needs example inputs: pass example_inputs=(x, ...) (its "
                         f"forward's positional inputs, or one tensor) and/or example_kwargs={{...}}; amp-rewrite "
                         f"captures the module with them and runs it once to learn every tensor's dtype")
    try:
        signature = inspect.signature(obj.forward)
    except (TypeError, ValueError):
        return  # (a forward inspect cannot read: torch.export says what does not fit)
    try:  # (keywords are checked against the graph's placeholders: fx_loader._positional)
        signature.bind_partial(*(example_inputs or ()))
    except TypeError as exc:
        raise UsageError(f"example_inputs holds {len(example_inputs or ())} inputs, which do not fit "
                         f"{name}.forward{signature}: {exc}") from None


def _as_tuple(example_inputs: Any) -> tuple | None:
    if example_inputs is None:
        return None
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,)
    if isinstance(example_inputs, dict):  # (a tuple of it would be its keys: a str where a tensor goes)
        raise UsageError(f"example_inputs is a dict (keys {', '.join(map(repr, list(example_inputs)[:4]))}): pass "
                         f"keyword inputs as example_kwargs=..., positional ones as a tuple in example_inputs")
    if isinstance(example_inputs, (str, bytes)) or not hasattr(example_inputs, "__iter__"):
        raise UsageError(f"example_inputs={example_inputs!r}: pass a tuple of the module's inputs (or one tensor)")
    return tuple(example_inputs)


# -- training -------------------------------------------------------------------------------------------------
def _flat_outputs(model: Model) -> tuple[list[tuple[int, Value, Any, str | None]], int]:
    """The module's tensor outputs as the caller sees them flattened (torch.utils._pytree's order:
    tuples, lists and dicts opened in order, None as pytree has it, anything else one leaf, an int batch size
    included): (flat index, value, the loader's slot, the dict key it sits under) for each, and the
    number of leaves. One tensor returned twice is two entries."""
    node = model.graph.meta.get("fx.output_node")
    by_where: dict[tuple, list] = {}
    for slot, v in zip(model.graph.meta.get("fx.output_slots", []), model.graph.meta.get("fx.loaded_outputs", [])):
        by_where.setdefault(slot.where, []).append((slot, v))
    found: list[tuple[int, Value, Any, str | None]] = []
    count = 0
    for path, key, leaf in _leaves(node.args[0], ("args", 0)) if node is not None and node.args else ():
        tensors = by_where.get(path, []) if isinstance(leaf, fx.Node) else []
        for slot, value in tensors:
            found.append((count, value, slot, key))
            count += 1
        if not tensors:
            count += 1
    keys = _spec_keys(node, count)
    if keys:  # a torch.export capture returns its outputs flat: the dict keys are in its out spec
        found = [(i, v, slot, keys.get(i, key)) for i, v, slot, key in found]
    return found, count


def _spec_keys(node: Any, count: int) -> dict[int, str]:
    """Flat output index -> the dict key it sits under, from the module's pytree out spec (the
    calling convention torch.export's GraphModules keep); empty without one."""
    spec = getattr(getattr(getattr(node, "graph", None), "owning_module", None), "_out_spec", None)
    if spec is None or getattr(spec, "num_leaves", None) != count:
        return {}
    from torch.utils import _pytree as pytree

    return {leaf: key for _, key, leaf in _leaves(pytree.tree_unflatten(list(range(count)), spec), ())
            if key is not None}


def _leaves(obj: Any, path: tuple, key: str | None = None):
    """(path, the dict key it sits under, leaf) for each leaf of a nested output, in pytree's
    order: tuples, lists and dicts opened in order, None a leaf where this torch's pytree makes it
    one (torch 2.13 does: a ``loss_output`` index counted without it named the output after the loss)."""
    if isinstance(obj, (tuple, list)):
        for i, item in enumerate(obj):
            yield from _leaves(item, path + (i,), key)
    elif isinstance(obj, dict):
        for k, item in obj.items():
            yield from _leaves(item, path + (k,), k if isinstance(k, str) else key)
    elif obj is not None or _none_is_leaf():
        yield path, key, obj


@functools.cache
def _none_is_leaf() -> bool:
    from torch.utils import _pytree as pytree

    return len(pytree.tree_flatten(None)[0]) == 1


def _loss_value(model: Model, loss_output: int | str | None, notes: list[str]) -> Value | None:
    """The loss output (its slot goes to ``fx.loss_slot``, where the scale is put)."""
    outputs, leaves = _flat_outputs(model)

    def chosen(entry: tuple) -> Value:
        model.graph.meta["fx.loss_slot"] = entry[2]
        return entry[1]

    if loss_output is not None:
        if isinstance(loss_output, int):
            hit = [e for e in outputs if e[0] == loss_output]
            if not 0 <= loss_output < leaves:
                raise UsageError(f"loss_output={loss_output}: the module returns {leaves} output(s) (flattened)")
            if not hit:
                raise UsageError(f"loss_output={loss_output} names an output that is no tensor (the flattened "
                                 f"outputs' tensors are at {', '.join(str(e[0]) for e in outputs) or 'none'})")
            _checked_loss(hit[0][1], loss_output)
            return chosen(hit[0])
        for entry in outputs:
            _, value, _, key = entry
            origin = value.origin
            names = {value.name, key}
            if isinstance(origin, tuple) and isinstance(origin[0], fx.Node):
                names.add(origin[0].name)
            if loss_output in names:
                _checked_loss(value, loss_output)
                return chosen(entry)
        raise UsageError(f"loss_output={loss_output!r} names no output (have: "
                         f"{', '.join(e[3] or e[1].name for e in outputs)})")
    scalars = [e for e in outputs if e[1].shape == () and e[1].dtype == DType.FLOAT]
    if not scalars:
        return None
    if len(scalars) > 1:  # (one tensor returned twice too: which of the two gets the scale?)
        # A metric returned beside the loss (an accuracy, a detached copy) carries no gradient:
        # with one scalar that does, it is the loss.
        graded = [e for e in scalars if _requires_grad(e[1])]
        if len(graded) == 1:
            notes.append(f"the loss is {graded[0][1].name!r}: of the {len(scalars)} scalar float outputs only it "
                         f"carries a gradient (pass loss_output= to choose another)")
            return chosen(graded[0])
        # Taking the first would scale another output (an auxiliary mean) and leave the loss's
        # gradients 1/scale of the truth: the caller has to say.
        named = ", ".join(f"{e[0]}: {e[3] or e[1].name!r}" for e in scalars)
        raise UsageError(f"training=True: the module returns {len(scalars)} scalar float outputs ({named}); "
                         f"say which is the loss with loss_output= (its flattened index, dict key or name)")
    if not _reads_an_input(scalars[0][1]):
        # a temperature returned beside embeddings (CLIP's logit_scale.exp()): scaled as "the loss",
        # it came out 65536 times too large once a LossScaler attached, and so did the loss the
        # caller computed from it
        notes.append(f"training: the scalar output {scalars[0][3] or scalars[0][1].name!r} is computed from "
                     f"parameters alone, no input, so it is taken for no loss and nothing is scaled in the graph "
                     f"(pass loss_output= if it is the loss; else scale the loss you compute with "
                     f"LossScaler.backward(loss))")
        model.graph.meta["fx.no_loss"] = True
        return None
    return chosen(scalars[0])


def _reads_an_input(value: Value) -> bool:
    """Whether ``value`` is computed from a graph input (the data), not from parameters alone."""
    return _reaches(value, lambda v: v.producer is None and v.is_graph_input, lambda v: True)


_NO_GRADIENT_OPS = {"detach", "detach_", "stop_gradient"}


def _requires_grad(value: Value) -> bool:
    """Whether a gradient can reach a parameter from this output: a path back to a weight through
    float values only, not through ``detach`` (an accuracy's argmax and comparison make integers and
    booleans, which carry none)."""
    return _reaches(value, lambda v: v.is_initializer,
                    lambda v: v.dtype is not None and v.dtype.is_float, stop_ops=_NO_GRADIENT_OPS)


def _reaches(value: Value, found: Callable[[Value], bool], follow: Callable[[Value], bool],
             stop_ops: frozenset[str] | set[str] = frozenset()) -> bool:
    """Whether a value ``found`` accepts computes ``value``, walking back through the inputs
    ``follow`` accepts, not through the ops in ``stop_ops``."""
    stack, seen = [value], set()
    while stack:
        v = stack.pop()
        if id(v) in seen:
            continue
        seen.add(id(v))
        if found(v):
            return True
        node = v.producer
        if node is None or node.op_type in stop_ops:
            continue
        stack.extend(x for x in node.inputs if x is not None and follow(x))
    return False


def _checked_loss(value: Value, loss_output: int | str) -> Value:
    """The output loss_output names, if it is a loss: a scalar FP32 value (an int output times the
    scale, or a per-element tensor, would be silently scaled)."""
    if value.dtype != DType.FLOAT or (value.shape is not None and any(d != 1 for d in value.shape)):
        kind = value.dtype.name if value.dtype is not None else "of unknown type"
        shape = "[" + ", ".join(map(str, value.shape)) + "]" if value.shape is not None else "of unknown shape"
        raise UsageError(f"loss_output={loss_output!r} names {value.name!r}, {kind} {shape}: the loss must be a "
                         f"scalar FP32 output (reduce it with mean or sum inside the module)")
    return value


def _loss_tail(model: Model, target: str, rules: Any, loss: Value, options: dict, fp32_nodes: list[str]) -> list[str]:
    """Names of the nodes feeding the loss with no allow op between them and the loss (the user's
    op flags and node pins on top of the rules: a node pinned low ends the tail). A node that
    computes in a low type as given (a rewrite's output rewritten again, whose Linears run through
    a functional_call the rules do not list) is left out: pinning it changes nothing, and the pin
    was reported as a user's ``--fp32-nodes`` without effect."""
    from .passes.base import given_low_type, loss_tail

    book = rule_book(rules, frontend="torch", target=target, fp32_nodes=fp32_nodes,
                     **{k: options.get(k) or () for k in ("fp32_ops", "fp16_ops", "fp16_nodes")})
    return [n.name for n in loss_tail(model.graph, loss, book)
            if n.op_type != "Cast" and n.name and given_low_type(n) is None]


def _explain_tail(ctx: Any, tail: set[str]) -> None:
    for label, decision in list(ctx.log.decisions.items()):
        if label in tail:
            ctx.log.decisions[label] = dataclasses.replace(decision, reason=_TRAINING_LOSS_REASON, source="training")


def _explain_conversions(model: Model, ctx: Any) -> None:
    """IR Casts stand for torch's own conversions (x.float(), x.to(dtype), aten._to_copy): report
    them under their torch name and rule, not as an unlisted ONNX Cast."""
    from .passes.base import node_label

    for node in model.graph.nodes:
        if node.op_type != "Cast" or node.meta.get("amp.inserted"):
            continue
        label = node_label(node)
        decision = ctx.log.decisions.get(label)
        name = node.meta.get("fx.torch_name", "to")
        entry = ctx.rules.lookup(name, node.domain)
        category = entry.category if entry is not None else Category.CLEAR
        reason = entry.reason if entry is not None else "type conversion: cast placement owns it"
        if node.meta.get("amp.retargeted"):
            reason = f"{reason}; retargeted to {DType(node.attrs['to']).short} because only low-precision ops read it"
        if decision is not None:
            ctx.log.decisions[label] = dataclasses.replace(decision, op=name, category=category, reason=reason,
                                                           source=entry.source if entry is not None else "fx_loader")
        node.meta["amp.category"] = category
        node.meta["amp.reason"] = reason


def _check_rule_input_names(model: Model, book) -> None:
    """A rule's ``fp32_inputs`` names must name inputs of its op: a misspelt one pinned nothing,
    silently. The loader names a call's inputs by its op's schema or its function's signature, but
    torch has no registry of every op's names to check a rule file against, so they are checked
    against the inputs of the op's calls in this model; an op the model does not call is not checked."""
    import difflib

    from .errors import RuleFileError

    called: dict[tuple[str, str], set[str]] = {}
    for scope in model.graph.scopes():
        for node in scope.nodes:
            called.setdefault((node.domain or "", node.op_type), set()).update(node.meta.get("input_names", ()))
    for entry in book.entries():
        known = called.get((entry.domain or "", entry.op))
        if known is None:
            continue
        for name in (item for item in entry.fp32_inputs if isinstance(item, str)):
            if name not in known:
                shown, key = book.file_and_key(entry)
                close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.5)
                raise RuleFileError(shown, f"{key}.fp32_inputs",
                                    f"{name!r} is not an input of any {entry.op} call in this model (their inputs: "
                                    f"{', '.join(sorted(known)) or 'none'}; a module call's own tensors go by their "
                                    f"names (a Linear's 'weight'), a function's arguments by the names of the aten op's "
                                    f"schema, whatever tensor they hold: 'other' for self.scale in x * self.scale)", close[0] if close else None)
