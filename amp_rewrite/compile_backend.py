"""A torch.compile backend: rewrite the captured graph with amp-rewrite, then hand it on.

    import amp_rewrite.compile_backend            # registers "amp_rewrite" (or let the entry point do it)
    compiled = torch.compile(model, backend="amp_rewrite")
    compiled = torch.compile(model, backend="amp_rewrite",
                             options={"target": "bf16", "backend": "aot_eager", "rules": ["my.toml"]})
    compiled = torch.compile(model, backend=amp_rewrite.compile_backend.make_backend(target="bf16"))

How the name gets registered: importing this module registers it with
``torch._dynamo.register_backend``. The package also declares the entry point
``[project.entry-points.torch_dynamo_backends] amp_rewrite = "amp_rewrite.compile_backend:amp_rewrite_backend"``,
which torch's backend registry reads the first time an unknown backend name is looked up, so once
the package is installed, ``backend="amp_rewrite"`` works without any import. Importing
``amp_rewrite`` itself never imports torch.

Options (``options=`` of torch.compile, or keyword arguments of :func:`make_backend`): ``target``
("fp16" | "bf16", default "fp16"), ``backend`` (the compiler that gets the rewritten graph:
"inductor" by default, any registered dynamo backend name, or a callable), ``rules``,
and the other options of :func:`amp_rewrite.rewrite` (not ``keep_io_types=False``: the graph's
inputs include the FP32 parameters), plus ``inner_options`` passed to the inner backend (e.g.
inductor's options). ``torch.compile(..., mode="max-autotune")`` (torch takes ``mode`` or
``options``, not both) applies that mode's inductor settings, as inductor itself would.

Dynamo hands the backend a torch-level graph whose parameters are graph inputs (dynamo lifts them),
so weights are cast at use (as torch.autocast does); the inner compiler (inductor) fuses those
casts into their consumers. The graph is rewritten for inference or training alike: gradients flow
through the casts into the FP32 parameters. With ``training=True`` no loss-scale node goes into the
graph (a graph break or a recompile gives several graphs, none of which need end at the loss):
scale the loss with ``LossScaler().backward(loss)``, as with torch.amp.GradScaler. The last rewrite's report is kept in
:data:`last_reports` (one per compiled graph, most recent last).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

BACKEND_NAME = "amp_rewrite"
last_reports: list[Any] = []
_MAX_REPORTS = 32


def make_backend(*, target: str = "fp16", backend: str | Callable = "inductor", inner_options: dict | None = None,
                 **rewrite_options: Any) -> Callable:
    """A backend callable with fixed options (for ``torch.compile(model, backend=make_backend(...))``)."""
    _refuse_low_io(rewrite_options)

    def compile_fn(gm: torch.fx.GraphModule, example_inputs: list, **kwargs: Any) -> Callable:
        options = dict(kwargs.pop("options", None) or {})
        merged = {"target": target, "backend": backend, "inner_options": inner_options, **rewrite_options, **options}
        return _compile(gm, example_inputs, merged, mode=kwargs.get("mode"))

    return compile_fn


def amp_rewrite_backend(gm: torch.fx.GraphModule, example_inputs: list, **kwargs: Any) -> Callable:
    """The registered backend: ``torch.compile(model, backend="amp_rewrite", options={...})``, or
    with ``mode=`` (torch.compile takes one of the two): the FP16 rewrite, then inductor in that mode."""
    return _compile(gm, example_inputs, dict(kwargs.get("options") or {}), mode=kwargs.get("mode"))


def _compile(gm: torch.fx.GraphModule, example_inputs: list, options: dict, mode: str | None = None) -> Callable:
    from .errors import InPlaceMutationError, UsageError
    from .fx_api import allow_pickling, rewrite_torch

    from .fx_api import ambient_autocast

    autocast = ambient_autocast()
    if autocast:
        raise UsageError(f"the amp_rewrite backend was called inside torch.autocast ({', '.join(autocast)}): "
                         f"amp_rewrite replaces autocast, and the graph dynamo hands over holds autocast's types; "
                         f"call the compiled module outside the torch.autocast context")
    supplied = sorted(set(options) & {"example_inputs", "example_kwargs", "capture", "decompose", "dynamic_shapes"})
    if supplied:
        raise UsageError(f"option(s) {', '.join(supplied)} do not apply under torch.compile: dynamo captures the graph "
                         f"and supplies its inputs")
    inner = options.pop("backend", "inductor") or "inductor"
    if not (isinstance(inner, str) or callable(inner)):
        raise UsageError(f"options['backend'] must be a backend name or a callable, got {type(inner).__name__}")
    if inner == BACKEND_NAME:
        raise UsageError("options['backend']: the amp_rewrite backend cannot hand the graph to itself; name the "
                         "backend that compiles the rewritten graph (inductor, aot_eager, ...)")
    inner_options = options.pop("inner_options", None)
    options.setdefault("target", "fp16")
    _refuse_low_io(options)
    if options.get("training"):
        _refuse_in_graph_scaling(options)
        options["loss_scaling"] = False
        options["_in_compile"] = True
    if mode is not None:
        if inner != "inductor":
            raise UsageError(f"mode={mode!r} configures inductor; the inner backend here is {inner!r}: drop mode, "
                             f"or pass that backend's own settings in inner_options")
        from torch._inductor import list_mode_options

        inner_options = {**list_mode_options(mode), **(inner_options or {})}
    try:
        result = rewrite_torch(gm, example_inputs=tuple(example_inputs), **options)
    except InPlaceMutationError as exc:  # (its advice, decompose=True, is for rewrite() on an nn.Module)
        raise InPlaceMutationError(
            exc.finding, "Under torch.compile the amp_rewrite backend gets dynamo's graph, which keeps in-place "
            "ops: make the operation out of place (x = x + 1 for x.add_(1)), or rewrite the module first with "
            "amp_rewrite.rewrite(model, example_inputs=..., decompose=True) and compile that with another "
            "backend") from exc
    last_reports.append(result.report)
    del last_reports[:-_MAX_REPORTS]
    rewritten = result.model
    allow_pickling(rewritten)  # (no user holds it; the inner compilers pickle it for their cache keys)
    compiler = _inner_compiler(inner)
    if inner_options:
        return compiler(rewritten, list(example_inputs), options=inner_options)
    return compiler(rewritten, list(example_inputs))


def _refuse_low_io(options: dict) -> None:
    """Dynamo lifts the parameters into graph inputs: low graph inputs would declare the FP32
    weights low, and the graph would run in FP32 while its report said otherwise."""
    from .errors import UsageError

    if options.get("keep_io_types") is False:
        raise UsageError("keep_io_types=False does not apply under torch.compile: dynamo passes the parameters in "
                         "as graph inputs, which must stay FP32; cast your inputs yourself, or use "
                         "amp_rewrite.rewrite(model, keep_io_types=False) for low-precision inputs and outputs")


def _refuse_in_graph_scaling(options: dict) -> None:
    """Dynamo hands over one graph per compiled region: a graph break makes an intermediate scalar an
    output (taken for the loss and scaled), a recompile makes a second graph whose scale buffer the
    scaler never saw (its updates 65536 times too small). Under torch.compile the loss is scaled
    outside the graph, as torch.amp.GradScaler does it."""
    from .errors import UsageError

    for name, given in (("loss_scaling", options.get("loss_scaling") is True),
                        ("loss_output", options.get("loss_output") is not None)):
        if given:
            raise UsageError(f"{name}= does not apply under torch.compile: the loss is scaled outside the graph; "
                             f"call LossScaler().backward(loss) (or scaler.scale(loss).backward()) on the compiled "
                             f"module's loss")


def _inner_compiler(inner: str | Callable) -> Callable:
    if callable(inner):
        return inner
    if inner == "inductor":
        from torch._inductor.compile_fx import compile_fx

        def inductor(gm: torch.fx.GraphModule, example_inputs: list, options: dict | None = None) -> Callable:
            return compile_fx(gm, example_inputs, config_patches=options) if options else compile_fx(gm, example_inputs)

        return inductor
    if inner == BACKEND_NAME:
        raise ValueError("the amp_rewrite backend cannot hand the graph to itself")
    from torch._dynamo.backends.registry import lookup_backend

    return lookup_backend(inner)


def register() -> None:
    """Register the backend name with dynamo (idempotent). When dynamo is itself loading this
    module through the ``torch_dynamo_backends`` entry point it registers the function right
    after the import, so registering here too would be a duplicate."""
    from importlib.metadata import EntryPoint

    from torch._dynamo.backends.registry import _BACKENDS, _COMPILER_FNS, register_backend

    if BACKEND_NAME in _COMPILER_FNS or isinstance(_BACKENDS.get(BACKEND_NAME), EntryPoint):
        return
    register_backend(compiler_fn=amp_rewrite_backend, name=BACKEND_NAME)


register()
