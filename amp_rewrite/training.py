"""Dynamic loss scaling for mixed-precision training in torch: :class:`LossScaler`.

    gm = amp_rewrite.rewrite(model_with_loss, example_inputs=(x, y), training=True)
    scaler = amp_rewrite.LossScaler(gm)          # or LossScaler(): the module is found at backward
    for x, y in data:
        loss = gm(x, y)                          # loss * gm.amp_loss_scale, computed in FP32
        scaler.backward(loss)                    # or loss.backward(): the graph already scaled it
        scaler.unscale_(optimizer)               # optional: before clipping
        torch.nn.utils.clip_grad_norm_(gm.parameters(), 1.0)
        scaler.step(optimizer)                   # unscale, check, skip on inf/NaN, update the scale
        optimizer.zero_grad()

**Semantics** (those of ``torch.amp.GradScaler``, plus a floor, a ceiling and a static mode):

- the scale starts at ``init_scale`` (2**16); each step whose gradients are all finite adds one to
  the growth tracker, and when it reaches ``growth_interval`` (2000) the scale is multiplied by
  ``growth_factor`` (2.0) and the tracker resets;
- a step with any inf/NaN gradient is skipped (``optimizer.step()`` is not called, parameters do
  not change), the scale is multiplied by ``backoff_factor`` (0.5) and the tracker resets;
- **floor** ``min_scale`` (default 1.0; GradScaler has none): backoff never goes below it. Below 1
  scaling no longer protects small gradients, it only shrinks them, and an overflow at scale 1
  means the unscaled gradients themselves overflow; without a floor a persistent NaN (bad data)
  drives the scale to 0 in ~150 steps and training can never recover. Set ``min_scale`` lower
  for losses that are legitimately huge;
- **ceiling** ``max_scale`` (default 2**24; GradScaler has none, it only refuses a non-finite
  scale): growth never goes above it;
- ``dynamic=False``: static scaling, the scale never changes (overflow steps are still skipped);
  ``enabled=False``: a pass-through (scale 1, no checks), e.g. for BF16, which needs no scaling.

Because of the floor and the ceiling the scale trajectory differs from GradScaler's only where
GradScaler's would go below ``min_scale`` or above ``max_scale``.

**The in-graph scale.** A module rewritten with ``training=True`` multiplies its loss by its FP32
buffer ``amp_loss_scale``. The scaler keeps every attached module's buffer equal to its scale
(``LossScaler(module)``, :meth:`attach`; ``scaler.backward(loss)`` also finds the module by itself
from the loss's autograd graph). :meth:`backward` makes sure every gradient carries exactly the
current scale, whatever the buffer held at forward time (the first step, before the scaler knew
the module, ran with 1.0), and whatever the loss adds outside the module (a regulariser, a second
loss): it scales the whole loss and divides the gradient reaching each in-graph scale node by the
scale that node applied. A plain ``loss.backward()`` is fine once the module is attached, when the
loss is the module's output: the scaler then unscales by the buffer's value. Where the scale node
is hidden from autograd (the module ran inside ``torch.compile`` or a reentrant checkpoint),
:meth:`backward` refuses rather than scale twice. The optimizer must hold the rewritten module's
parameters (``rewrite`` returns a copy): a step after :meth:`backward` that finds no gradient is
an error. For a module without in-graph scale,
:meth:`backward` / :meth:`scale` multiply the loss themselves, like GradScaler.

**Gradient accumulation**: call :meth:`backward` on each micro-batch, then :meth:`step` once.
**Several optimizers**: ``LossScaler(auto_update=False)``, ``step()`` each, then :meth:`update`
once (with ``auto_update`` on, ``step()`` updates the scale itself, so a second optimizer's
``step()`` on the same gradients is an error; alternating optimizers, each after its own backward
pass, need no flag). **Distributed**: when
``torch.distributed`` is initialised with more than one rank, the overflow flag is all-reduced
(MAX) so that every rank skips the same steps and keeps the same scale. **Checkpoints**:
:meth:`state_dict` / :meth:`load_state_dict` (which also reads a GradScaler state dict).
**History**: :attr:`history` (one entry per update: step, scale, skipped, next scale),
:attr:`skipped_steps`, :meth:`summary`, :meth:`add_to_report`.
"""

from __future__ import annotations

import gc
import math
import warnings
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any, Iterable

import torch

from .loss_scale import BACKOFF_FACTOR, GROWTH_FACTOR, GROWTH_INTERVAL, INIT_SCALE, MAX_SCALE, MIN_SCALE

BUFFER = "amp_loss_scale"

_READY, _UNSCALED, _STEPPED = "ready", "unscaled", "stepped"

# The modules amp_rewrite.rewrite(..., training=True) made in this process, and their deep copies:
# where a scaler looks for a module it was not given. (It scanned the whole heap for them, which a
# loss multiplied by a new 0-dim tensor each step made a fraction of a second per step.)
_TRAINING_MODULES: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()


def register_training_module(gm: torch.nn.Module) -> None:
    """Make ``gm`` (a module rewritten for training) and every deep copy of it findable by a
    scaler it was not attached to."""
    _TRAINING_MODULES.add(gm)
    hooks = getattr(gm, "_deepcopy_hooks", None)
    if hooks is not None and register_training_module not in hooks:
        gm._register_deepcopy_hook(register_training_module)


@dataclass
class _OptState:
    stage: str = _READY
    found_inf: torch.Tensor | None = None


class LossScaler:
    """Dynamic (or static) loss scaling; see the module docstring."""

    def __init__(self, module: torch.nn.Module | Iterable[torch.nn.Module] | None = None, *,
                 init_scale: float = INIT_SCALE, growth_factor: float = GROWTH_FACTOR,
                 backoff_factor: float = BACKOFF_FACTOR, growth_interval: int = GROWTH_INTERVAL,
                 min_scale: float = MIN_SCALE, max_scale: float = MAX_SCALE, dynamic: bool = True,
                 enabled: bool = True, auto_update: bool = True, distributed: bool | None = None,
                 process_group: Any = None, history_limit: int | None = 100_000) -> None:
        if not growth_factor > 1.0:
            raise ValueError(f"growth_factor={growth_factor}: must be > 1")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"backoff_factor={backoff_factor}: must be in (0, 1)")
        if int(growth_interval) < 1:
            raise ValueError(f"growth_interval={growth_interval}: must be >= 1")
        if not 0.0 < min_scale <= max_scale < math.inf:
            raise ValueError(f"min_scale={min_scale}, max_scale={max_scale}: need 0 < min_scale <= max_scale < inf")
        if not min_scale <= init_scale <= max_scale:
            raise ValueError(f"init_scale={init_scale} is outside [min_scale, max_scale] = [{min_scale}, {max_scale}]")
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.min_scale = float(min_scale)
        self.max_scale = float(max_scale)
        self.dynamic = bool(dynamic)
        self.enabled = bool(enabled)
        self.auto_update = bool(auto_update)
        self.distributed = distributed
        self.process_group = process_group
        self.history_limit = history_limit
        self._init_scale = float(init_scale)
        self._scale = float(init_scale) if enabled else 1.0
        self._growth_tracker = 0
        self._steps = 0
        self._skipped = 0
        self._history: list[dict[str, Any]] = []
        self._skipped_steps: list[int] = []
        self._modules: list[weakref.ref] = []
        self._opt: dict[int, _OptState] = {}
        self._applied: float | None = None  # the scale the current gradients carry, when known
        # in-graph scale nodes given their dividing pre-hook this step (held, so that an id is not
        # reused by another node while the step lasts): one hook per node, however many backward
        # passes run through it (retain_graph)
        self._hooked: dict[int, Any] = {}
        # the gradients as step() left them when it updated the scale itself (auto_update), or None:
        # a second optimizer stepped on those same gradients would unscale them by the new scale
        self._auto_updated: dict[int, tuple[Any, int]] | None = None
        self._discovered = False
        if module is not None:  # (a str or a tensor is iterable, but attach says what it is not)
            self.attach(*(module if not isinstance(module, (torch.nn.Module, str, bytes, torch.Tensor)) else [module]))

    # -- the in-graph scale -------------------------------------------------------------------------------
    def attach(self, *modules: torch.nn.Module) -> "LossScaler":
        """Keep the ``amp_loss_scale`` buffer of these modules (or of their submodules, e.g. inside
        DDP) equal to the scaler's scale. Returns self."""
        for module in modules:
            if not isinstance(module, torch.nn.Module):
                raise TypeError(f"LossScaler: {module!r} is not a torch module; pass the module "
                                f"amp_rewrite.rewrite(..., training=True) returned")
            found = [m for m in module.modules() if isinstance(m._buffers.get(BUFFER), torch.Tensor)]
            if not found:
                if not self.enabled:
                    continue  # a pass-through has no scale to keep in step
                raise ValueError(_no_buffer_message(module))
            for m in found:
                if not any(ref() is m for ref in self._modules):
                    self._modules.append(weakref.ref(m))
                    self._sync(m)
        return self

    def _live_modules(self) -> list[torch.nn.Module]:
        live = [ref() for ref in self._modules]
        self._modules = [ref for ref, m in zip(self._modules, live) if m is not None]
        return [m for m in live if m is not None]

    def _sync(self, module: torch.nn.Module) -> None:
        buf = module._buffers.get(BUFFER)
        if buf is not None and float(buf) != self._scale:
            # through .data: a forward pass whose backward is still pending saved this buffer, and
            # an in-place write autograd sees would make that backward fail; the pending pass then
            # carries the new scale, which is the one _scale_nodes reads from the saved tensor
            buf.data.fill_(self._scale)

    def _sync_all(self) -> None:
        for m in self._live_modules():
            self._sync(m)

    @staticmethod
    def _candidates(scan: bool = True) -> list[torch.nn.Module]:
        """Modules in this process rewritten for training (``amp_training`` and the buffer). With
        ``scan`` (once per scaler), the whole heap after a collection: a module dropped but not yet
        collected (GraphModules hold reference cycles) would count as a second candidate, and a
        module made some other way than by rewrite() is found too (and registered). Without it,
        the registry only: the per-step look-up of a scalar that is no known module's scale (a loss
        weight made afresh each step) must not walk the heap each step."""
        def rewritten_for_training(obj: Any) -> bool:
            return isinstance(obj, torch.nn.Module) and getattr(obj, "amp_training", False) \
                and isinstance(obj._buffers.get(BUFFER), torch.Tensor)

        if not scan:
            return [m for m in list(_TRAINING_MODULES) if rewritten_for_training(m)]
        gc.collect()
        found = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # isinstance() on deprecated module-level objects warns
            for obj in gc.get_objects():
                try:
                    if rewritten_for_training(obj):
                        found.append(obj)
                except ReferenceError:  # a dead weakproxy
                    continue
        for module in found:
            register_training_module(module)
        return found

    def _known_modules(self) -> list[torch.nn.Module]:
        modules = self._live_modules()
        if not self._discovered:
            self._discovered = True
            known = {id(m) for m in modules}
            modules = modules + [m for m in self._candidates() if id(m) not in known]
        return modules

    def _scale_nodes(self, loss: torch.Tensor) -> list[tuple[Any, float]]:
        """The in-graph loss-scale nodes of ``loss``'s autograd graph, with the scale each applied:
        the Mul nodes that saved the buffer of an attached (or, once, discovered) module."""
        if loss.grad_fn is None:
            return []
        modules = self._known_modules()
        by_ptr = {m._buffers[BUFFER].data_ptr(): m for m in modules if m._buffers.get(BUFFER) is not None}
        unknown: set[tuple[int, float]] = set()
        muls = _scale_muls(loss.grad_fn, by_ptr, unknown)
        # (a scalar of 1.0 scales nothing: whichever module it belongs to, its gradients are right)
        unknown = {(ptr, value) for ptr, value in unknown if value != 1.0}
        if unknown:
            # a scalar saved by a Mul that is no known module's scale: a module rewritten since the
            # scaler last looked (a deep copy, a new rewrite) would go unscaled-out, its gradients
            # carrying the scale twice; look again (in the registry of such modules, not the heap: a
            # per-step loss weight is looked up at every step)
            pointers = {ptr for ptr, _ in unknown}
            fresh = {m._buffers[BUFFER].data_ptr(): m for m in self._candidates(scan=False)
                     if m._buffers[BUFFER].data_ptr() in pointers}
            if fresh:
                by_ptr.update(fresh)
                modules = modules + list(fresh.values())
                muls = _scale_muls(loss.grad_fn, by_ptr, set())
        found = []
        for fn, saved in muls:
            module = by_ptr[saved.data_ptr()]
            if not any(ref() is module for ref in self._modules):
                self._modules.append(weakref.ref(module))
            found.append((fn, float(saved)))
        if not found and modules:
            self._refuse_hidden_scale(loss, modules)
        return found

    @staticmethod
    def _refuse_hidden_scale(loss: torch.Tensor, modules: list[torch.nn.Module]) -> None:
        """The loss reaches a rewritten module's parameters through a backward that hides what
        ran (a reentrant checkpoint, a torch.compile'd function) and no loss-scale node is visible:
        the hidden part may hold the in-graph Mul. Scaling again would scale its gradients twice;
        not scaling would miss other terms. A loss that reaches them through the module's other
        outputs (its logits), with every autograd node in sight, passes no scale node and is
        scaled here like any loss."""
        params = {id(p): m for m in modules if float(m._buffers[BUFFER]) != 1.0 for p in m.parameters()}
        if not params:
            return
        seen: set[tuple[int, bool]] = set()
        stack: list[tuple[Any, bool]] = [(loss.grad_fn, False)]
        while stack and len(seen) < 200_000:
            fn, hidden = stack.pop()
            if fn is None or (id(fn), hidden) in seen:
                continue
            seen.add((id(fn), hidden))
            name = type(fn).__name__
            # (a reentrant checkpoint's backward reaches the parameters only by running the module again)
            variable = getattr(fn, "variable", None)
            if name == "CheckpointFunctionBackward" or (hidden and id(variable) in params):
                module = params.get(id(variable), next(iter(params.values())))
                raise RuntimeError(
                    f"this loss reaches the parameters of {type(module).__name__} (rewritten with "
                    f"training=True) but its in-graph loss scale is hidden from autograd (the module ran inside "
                    f"torch.compile or a reentrant checkpoint), so the scaler cannot tell how its gradients are "
                    f"scaled: call loss.backward() on the module's own output (the graph scaled it already, and "
                    f"the attached scaler unscales by its buffer), or compile with backend='amp_rewrite' instead")
            hides = hidden or name == "CompiledFunctionBackward"
            stack.extend((nxt, hides) for nxt, _ in getattr(fn, "next_functions", ()))

    # -- scaling ----------------------------------------------------------------------------------------------
    def get_scale(self) -> float:
        """The current scale (1.0 when disabled)."""
        return self._scale if self.enabled else 1.0

    @property
    def loss_scale(self) -> float:
        return self.get_scale()

    @property
    def growth_tracker(self) -> int:
        return self._growth_tracker

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` multiplied so that every gradient carries the current scale exactly once.
        ``scaler.scale(loss).backward()`` == ``scaler.backward(loss)``.

        A rewritten module's output is already scaled in the graph, but the loss may add terms of its
        own (a regulariser, a second loss): the whole loss is multiplied by the scale, and each in-graph
        loss-scale node divides the gradient reaching it by the scale it applied (a pre-hook on that
        autograd node), so that gradients through the module and through the other terms carry the
        scale alike."""
        nodes = self._scale_nodes(loss)
        want = self.get_scale()
        if self.enabled:
            self._note_scaled()
        for fn, applied in nodes:
            if applied != 1.0 and self._hooked.get(id(fn)) is not fn:
                fn.register_prehook(_divided_by(applied))
                self._hooked[id(fn)] = fn
        return loss * want if want != 1.0 else loss

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Backward pass with the gradients scaled by the current scale (accumulates, like
        ``loss.backward()``; call once per micro-batch for gradient accumulation)."""
        self.scale(loss).backward(**kwargs)

    def _note_scaled(self) -> None:
        self._auto_updated = None
        if self._applied is not None and self._applied != self._scale:
            raise RuntimeError("the scale changed between two backward passes of one step")
        self._applied = self._scale

    def _applied_scale(self) -> float:
        """The scale the gradients carry: the scaler's when they came through backward()/scale(),
        else the in-graph buffer of the attached (or the one discoverable) module."""
        if self._applied is not None:
            return self._applied
        modules = self._live_modules()
        if not modules and not self._discovered:
            self._discovered = True
            candidates = self._candidates()
            if len(candidates) > 1:
                raise RuntimeError(f"{len(candidates)} modules rewritten for training exist and none is attached: "
                                   f"use LossScaler(module) or scaler.attach(module), or scaler.backward(loss)")
            if candidates:
                modules = candidates
                self._modules.append(weakref.ref(candidates[0]))
        values = {float(m._buffers[BUFFER]) for m in modules}
        if not values:
            raise RuntimeError("the scaler does not know the scale of these gradients: call scaler.backward(loss) "
                               "(or scaler.scale(loss).backward()), or attach the rewritten module "
                               "(LossScaler(module)) before its forward pass")
        if len(values) > 1:
            raise RuntimeError(f"the attached modules hold different loss scales {sorted(values)}")
        return values.pop()

    # -- unscale / step / update -----------------------------------------------------------------------------
    def _state(self, optimizer: torch.optim.Optimizer) -> _OptState:
        return self._opt.setdefault(id(optimizer), _OptState())

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the optimizer's gradients by the scale (in place, in their own dtype: FP32 for
        rewritten modules) and record whether any is inf/NaN. Call before clipping; at most once
        per optimizer per step (``step`` calls it when you did not)."""
        if not self.enabled:
            return
        state = self._state(optimizer)
        if state.stage == _UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update()")
        if state.stage == _STEPPED:
            raise RuntimeError("unscale_() is being called after step(); call update() first (auto_update=False)")
        has_grads = any(p.grad is not None for group in optimizer.param_groups for p in group["params"])
        if has_grads:
            self._refuse_stale_gradients(optimizer)
        if not has_grads and self._applied is not None:
            own = {id(p) for m in self._live_modules() for p in m.parameters()}
            if own and all(id(p) in own for group in optimizer.param_groups for p in group["params"]):
                raise RuntimeError("scaler.backward() ran in this step, but no parameter of this optimizer has a "
                                   "gradient: they are the rewritten module's, and this step's loss did not reach "
                                   "them (an unused head?); skip step() for this optimizer in such a step, as with "
                                   "torch.amp.GradScaler")
            raise RuntimeError("scaler.backward() ran in this step, but no parameter of this optimizer has a gradient: "
                               "was the optimizer built on the original module's parameters? amp_rewrite.rewrite() "
                               "returns a copy; build the optimizer on the rewritten module's parameters "
                               "(gm.parameters())")
        applied = self._applied_scale() if has_grads else 1.0
        if has_grads and self._applied is None:
            self._refuse_unattached(optimizer, applied)
        found = _unscale_grads(optimizer, 1.0 / applied)
        if self._is_distributed():
            import torch.distributed as dist

            dist.all_reduce(found, op=dist.ReduceOp.MAX, group=self.process_group)
        state.found_inf = found
        state.stage = _UNSCALED

    def _refuse_unattached(self, optimizer: torch.optim.Optimizer, applied: float) -> None:
        """A plain ``loss.backward()`` over two training rewrites with one attached: the other's
        gradients carry its own in-graph scale (its buffer, never updated), and dividing them by
        the attached one's left them 1/65536 of the truth at every step, silently. Say so."""
        attached = {id(m) for m in self._live_modules()}
        held = {id(p) for group in optimizer.param_groups for p in group["params"] if p.grad is not None}
        for module in self._candidates(scan=False):
            if id(module) in attached or float(module._buffers[BUFFER]) == applied:
                continue
            if any(id(p) in held for p in module.parameters()):
                raise RuntimeError(
                    f"this optimizer holds parameters of a {type(module).__name__} rewritten for training that the "
                    f"scaler is not attached to: its gradients carry its own loss scale "
                    f"({float(module._buffers[BUFFER]):g}), not the scaler's ({applied:g}); attach it too "
                    f"(scaler.attach(module)) or call scaler.backward(loss)")

    def _refuse_stale_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """A GradScaler-style ``step(opt_a); step(opt_b); update()`` with ``auto_update`` on:
        ``step(opt_a)`` updated the scale already, and opt_b's gradients, made before that, would be
        unscaled by the new scale (and the scale would grow once per optimizer). Say so."""
        before = self._auto_updated
        if before is None:
            return
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        # a backward pass since (the in-graph scale, no scale() call) made this optimizer's gradients
        # and wrote the ones recorded; a second optimizer holding another module's parameters (a head
        # whose term the loss adds) has gradients nobody recorded, made by the same backward pass as
        # the first's: unscaled by the new scale, they were 2x or 0.5x the truth, without a word
        moved = any(ref() is None or ref()._version != version for ref, version in before.values())
        if self._live_modules() and moved and any(not _unchanged(g, before) for g in grads):
            self._auto_updated = None
            return
        raise RuntimeError("step() on a second optimizer after step() updated the scale (auto_update=True): its "
                           "gradients were made at the old scale. With several optimizers stepped on one backward "
                           "pass, use LossScaler(..., auto_update=False), step() each, then update() once (as "
                           "with torch.amp.GradScaler)")

    def _is_distributed(self) -> bool:
        if self.distributed is False:
            return False
        import torch.distributed as dist

        active = dist.is_available() and dist.is_initialized() and dist.get_world_size(self.process_group) > 1
        if self.distributed and not active:
            raise RuntimeError("distributed=True but torch.distributed is not initialised with more than one rank")
        return active

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale (unless :meth:`unscale_` did), then ``optimizer.step(*args, **kwargs)`` if every
        gradient is finite, else skip it. Updates the scale when ``auto_update`` is on. Returns
        what ``optimizer.step`` returned, or None for a skipped step."""
        if "closure" in kwargs:
            raise NotImplementedError("closures (LBFGS) are not supported: their gradients would be scaled")
        if not self.enabled:
            return optimizer.step(*args, **kwargs)
        state = self._state(optimizer)
        if state.stage == _STEPPED:
            raise RuntimeError("step() has already been called on this optimizer since the last update()")
        if state.stage == _READY:
            self.unscale_(optimizer)
        assert state.found_inf is not None
        skipped = bool(state.found_inf.item())
        result = None if skipped else optimizer.step(*args, **kwargs)
        state.stage = _STEPPED
        if self.auto_update:
            params = [p for s in (self._live_modules(), [optimizer]) for p in _parameters_of(s)]
            self.update()
            self._auto_updated = {id(p.grad): (weakref.ref(p.grad), p.grad._version)
                                  for p in params if p.grad is not None}
        return result

    def update(self, new_scale: float | None = None) -> None:
        """End the step: back off (overflow) or grow the scale, reset the per-step state, and write
        the new scale into the attached modules' buffers. A no-op when no step is pending (so a
        GradScaler-style ``update()`` after an auto-updating ``step()`` is harmless);
        ``new_scale`` sets the scale outright."""
        if not self.enabled:
            self._opt.clear()
            self._applied = None
            return
        if new_scale is not None:
            if not new_scale > 0 or not math.isfinite(new_scale):
                raise ValueError(f"new_scale={new_scale}: must be positive and finite")
            self._scale = float(new_scale)
            self._finish_step()
            return
        states = [s for s in self._opt.values() if s.found_inf is not None]
        if not states:
            return
        skipped = any(bool(s.found_inf.item()) for s in states)
        before = self._scale
        if self.dynamic:
            if skipped:
                self._scale = max(self._scale * self.backoff_factor, self.min_scale)
                self._growth_tracker = 0
            else:
                self._growth_tracker += 1
                if self._growth_tracker >= self.growth_interval:
                    self._scale = min(self._scale * self.growth_factor, self.max_scale)
                    self._growth_tracker = 0
        self._record(before, skipped)
        self._finish_step()

    def _finish_step(self) -> None:
        self._opt.clear()
        self._applied = None
        self._hooked.clear()
        self._sync_all()

    def _record(self, before: float, skipped: bool) -> None:
        entry = {"step": self._steps, "scale": before, "skipped": skipped, "next_scale": self._scale,
                 "growth_tracker": self._growth_tracker}
        self._steps += 1
        if skipped:
            self._skipped += 1
            self._skipped_steps.append(entry["step"])
        self._history.append(entry)
        if self.history_limit is not None and len(self._history) > self.history_limit:
            del self._history[: len(self._history) - self.history_limit]
            del self._skipped_steps[: max(0, len(self._skipped_steps) - self.history_limit)]
        if skipped and self.dynamic and before <= self.min_scale and self._consecutive_skips() in (10, 100, 1000):
            warnings.warn(f"LossScaler: {self._consecutive_skips()} steps in a row overflowed at the floor scale "
                          f"{self.min_scale:g}: the gradients are non-finite before scaling (NaN in the data or a "
                          f"diverged model?)", RuntimeWarning, stacklevel=3)

    def _consecutive_skips(self) -> int:
        n = 0
        for entry in reversed(self._history):
            if not entry["skipped"]:
                break
            n += 1
        return n

    # -- history ------------------------------------------------------------------------------------------------
    @property
    def history(self) -> list[dict[str, Any]]:
        """One entry per update: ``step``, ``scale`` (used for that step), ``skipped``,
        ``next_scale``, ``growth_tracker`` (the last ``history_limit`` entries)."""
        return list(self._history)

    @property
    def skipped_steps(self) -> list[int]:
        return list(self._skipped_steps)

    @property
    def steps(self) -> int:
        return self._steps

    def summary(self) -> dict[str, Any]:
        scales = [e["scale"] for e in self._history] + [self._scale]
        return {
            "mode": "disabled" if not self.enabled else ("dynamic" if self.dynamic else "static"),
            "steps": self._steps, "skipped": self._skipped, "skipped_steps": self.skipped_steps[:100],
            "scale": self.get_scale(), "init_scale": self._init_scale, "min_scale_seen": min(scales),
            "max_scale_seen": max(scales), "growth_tracker": self._growth_tracker,
            "growths": sum(1 for e in self._history if e["next_scale"] > e["scale"]),
            "backoffs": sum(1 for e in self._history if e["next_scale"] < e["scale"]),
            "floor_hits": sum(1 for e in self._history if e["skipped"] and e["next_scale"] == self.min_scale
                              and e["scale"] * self.backoff_factor < self.min_scale),
            "config": {"growth_factor": self.growth_factor, "backoff_factor": self.backoff_factor,
                       "growth_interval": self.growth_interval, "min_scale": self.min_scale,
                       "max_scale": self.max_scale},
        }

    def summary_text(self) -> str:
        s = self.summary()
        if s["mode"] == "disabled":
            return "loss scaling: disabled"
        where = f" (steps {', '.join(map(str, s['skipped_steps'][:10]))}{', ...' if s['skipped'] > 10 else ''})" \
            if s["skipped"] else ""
        return (f"loss scaling ({s['mode']}): {s['steps']} steps, {s['skipped']} skipped{where}; scale "
                f"{s['init_scale']:g} -> {s['scale']:g} (range {s['min_scale_seen']:g}..{s['max_scale_seen']:g}, "
                f"{s['growths']} growths, {s['backoffs']} backoffs)")

    def add_to_report(self, report: Any) -> Any:
        """Add the scaling history (:meth:`summary_text`) as a note to a :class:`amp_rewrite.Report`,
        or to the decision log a rewritten GraphModule carries (``gm.meta["amp_rewrite.log"]``, so
        every later report of it shows it); replaces an earlier note of this kind. Returns its argument."""
        log = getattr(report, "log", None)
        if log is None:
            log = getattr(report, "meta", {}).get("amp_rewrite.log")
        if log is None:
            raise TypeError("add_to_report takes an amp_rewrite Report or a module rewritten by amp_rewrite.rewrite()")
        log.notes[:] = [n for n in log.notes if not n.startswith("loss scaling")]
        log.notes.append(self.summary_text())
        return report

    # -- checkpoints -------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"scale": self._scale, "growth_tracker": self._growth_tracker, "init_scale": self._init_scale,
                "growth_factor": self.growth_factor, "backoff_factor": self.backoff_factor,
                "growth_interval": self.growth_interval, "min_scale": self.min_scale, "max_scale": self.max_scale,
                "dynamic": self.dynamic, "enabled": self.enabled, "steps": self._steps, "skipped": self._skipped,
                "skipped_steps": list(self._skipped_steps), "history": [dict(e) for e in self._history]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` (or a ``torch.amp.GradScaler`` one) and write the scale into
        the attached modules' buffers."""
        if not state:
            raise ValueError("load_state_dict got an empty state dict (a disabled GradScaler saves {}): nothing "
                             "to restore")
        if "_growth_tracker" in state:  # GradScaler
            # (no history in it: the summary counts from the load, starting at the loaded scale)
            state = {"scale": state["scale"], "growth_tracker": state["_growth_tracker"],
                     "growth_factor": state["growth_factor"], "backoff_factor": state["backoff_factor"],
                     "growth_interval": state["growth_interval"], "init_scale": state["scale"],
                     "steps": 0, "skipped": 0, "skipped_steps": [], "history": []}
        if "scale" not in state:
            raise ValueError(f"load_state_dict: no 'scale' in the state dict (keys: {', '.join(map(str, state))}); "
                             f"pass a LossScaler or torch.amp.GradScaler state_dict()")
        low, high = float(state.get("min_scale", self.min_scale)), float(state.get("max_scale", self.max_scale))
        scale = float(state["scale"])
        if not low <= scale <= high:
            # a GradScaler has no floor or ceiling: its scale may lie outside this scaler's range
            warnings.warn(f"LossScaler.load_state_dict: scale {scale:g} is outside [min_scale, max_scale] = "
                          f"[{low:g}, {high:g}]; clamped", RuntimeWarning, stacklevel=2)
            scale = min(max(scale, low), high)
        self._scale = scale
        self._growth_tracker = int(state.get("growth_tracker", 0))
        for key in ("growth_factor", "backoff_factor", "min_scale", "max_scale", "init_scale"):
            if key in state:
                setattr(self, key if key != "init_scale" else "_init_scale", float(state[key]))
        for key, cast in (("growth_interval", int), ("dynamic", bool), ("enabled", bool)):
            if key in state:
                setattr(self, key, cast(state[key]))
        self._steps = int(state.get("steps", self._steps))
        self._skipped = int(state.get("skipped", self._skipped))
        self._skipped_steps = list(state.get("skipped_steps", self._skipped_steps))
        self._history = [dict(e) for e in state.get("history", self._history)]
        self._opt.clear()
        self._applied = None
        self._sync_all()

    def __repr__(self) -> str:
        return (f"LossScaler(scale={self.get_scale():g}, tracker={self._growth_tracker}, dynamic={self.dynamic}, "
                f"enabled={self.enabled}, steps={self._steps}, skipped={self._skipped})")


# -- helpers ----------------------------------------------------------------------------------------------------
def _parameters_of(holders: list) -> Iterable[torch.nn.Parameter]:
    """The parameters of modules, or of optimizers' parameter groups."""
    for holder in holders:
        if isinstance(holder, torch.nn.Module):
            yield from holder.parameters()
        else:
            for group in holder.param_groups:
                yield from group["params"]


def _unchanged(grad: torch.Tensor, before: dict[int, tuple[Any, int]]) -> bool:
    """The gradient tensor is the one recorded, not written to since."""
    ref, version = before.get(id(grad), (None, None))
    return ref is not None and ref() is grad and grad._version == version


def _divided_by(applied: float):
    def hook(grad_outputs: tuple) -> tuple:
        return tuple(None if g is None else g / applied for g in grad_outputs)
    return hook


def _no_buffer_message(module: torch.nn.Module) -> str:
    """Why ``module`` has no in-graph loss scale to attach to, and what to do instead."""
    name = type(module).__name__
    unscaled = [m for m in module.modules() if getattr(m, "amp_training", False)
                and getattr(m, "amp_loss_scaling", True) is False]
    if any(getattr(m, "meta", {}).get("amp_rewrite.target") == "bf16" for m in unscaled):
        return (f"{name} was rewritten for training without loss scaling (the bf16 default: bf16 has FP32's "
                f"exponent range), so there is no scale to keep: train it with loss.backward() and "
                f"optimizer.step(), or keep this loop with LossScaler(enabled=False); rewrite(..., "
                f"loss_scaling=True) adds the in-graph scale")
    if unscaled:
        return (f"{name} was rewritten for training with no in-graph loss scale (loss_scaling=False, or no loss "
                f"output was found: its report's notes say which): use scaler.backward(loss) without attaching "
                f"it, which scales the loss itself")
    return (f"{name} has no {BUFFER!r} buffer: it was not rewritten with amp_rewrite.rewrite(..., training=True) "
            f"(or returns no loss); use scaler.backward(loss) or scaler.scale(loss) without attaching it")


def _scale_muls(root: Any, by_ptr: dict[int, Any], unknown: set[tuple[int, float]]) -> list[tuple[Any, torch.Tensor]]:
    """(Mul node, the loss-scale buffer it saved) for each in-graph loss-scale node of an autograd
    graph, breadth first from its root. The whole graph outside the scaled modules is searched (a
    loss summed with many terms puts the module's scale node deep: a search cut at a fixed count
    missed it); below a scale node lies its module's own graph, which is not. ``unknown`` collects
    the data pointers and values of FP32 scalars other Mul nodes saved (candidates for modules not
    in ``by_ptr``)."""
    seen: set[int] = set()
    queue = deque([root])
    found = []
    while queue:
        fn = queue.popleft()
        if fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        saved = _saved_buffer(fn, by_ptr, unknown)
        if saved is not None:
            found.append((fn, saved))
            continue
        queue.extend(nxt for nxt, _ in getattr(fn, "next_functions", ()))
    return found


def _saved_buffer(fn: Any, by_ptr: dict[int, Any], unknown: set[tuple[int, float]]) -> torch.Tensor | None:
    if not type(fn).__name__.startswith("MulBackward"):
        return None
    for attr in ("_saved_other", "_saved_self"):
        try:
            saved = getattr(fn, attr)
        except (AttributeError, RuntimeError):
            continue
        if isinstance(saved, torch.Tensor) and saved.dim() == 0 and saved.data_ptr() in by_ptr:
            return saved
        if isinstance(saved, torch.Tensor) and saved.dim() == 0 and saved.dtype == torch.float32 \
                and not saved.requires_grad:
            unknown.add((saved.data_ptr(), float(saved)))
    return None


def _unscale_grads(optimizer: torch.optim.Optimizer, inv_scale: float) -> torch.Tensor:
    """Multiply every gradient by ``inv_scale`` in place; a float tensor, 1.0 if any was inf/NaN."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is None:
                continue
            g = p.grad
            if g.is_sparse:
                if g.dtype == torch.float16:
                    g = g.coalesce()  # duplicates could overflow when summed
                    p.grad = g
                g = g._values()
            groups.setdefault((g.device, g.dtype), []).append(g)
    device = next(iter(groups))[0] if groups else torch.device("cpu")
    found = torch.zeros((), dtype=torch.float32, device=device)
    for (dev, _), grads in groups.items():
        found_dev = torch.zeros((), dtype=torch.float32, device=dev)
        inv = torch.full((), inv_scale, dtype=torch.float32, device=dev)
        try:
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found_dev, inv)
        except (RuntimeError, NotImplementedError, AttributeError):
            for g in grads:
                found_dev = torch.maximum(found_dev, (~torch.isfinite(g)).any().to(torch.float32))
                g.mul_(inv.to(g.dtype))
        found = torch.maximum(found, found_dev.to(device))
    return found
