"""Make a forward+gradient ONNX graph from a torch module and a loss.

    proto = make_training_graph(model, inputs=(x,), targets=(y,), loss_fn=torch.nn.functional.mse_loss)
    amp-rewrite --training --loss loss --grads 'grad.*' train.onnx -o train.fp16.onnx

The graph computes one training step's numbers, not the update:

- inputs: every trainable parameter under its own name (``l1.weight``, ...), the data inputs
  (``input_0``, ... or ``input_names``), the targets (``target_0``, ... or ``target_names``), and
  ``loss_grad``, an FP32 scalar: the gradient that seeds the backward pass (feed 1.0 for plain
  gradients). Parameters are graph *inputs* so a training loop can feed updated weights back in;
- outputs: ``loss`` (FP32 scalar) and ``grad.<parameter name>`` for each parameter, the gradients
  of ``loss_grad * loss``.

The seed input is what makes loss scaling possible in the exported graph: the backward pass must
start from the loss scale, not from a constant 1 that the exporter folds into the graph.
``amp_rewrite.training_onnx`` finds it through the model's ``amp_rewrite.training_graph`` metadata
(written here) or by its name, and multiplies it by ``loss_scale``.

How: ``make_fx`` traces a function that calls the module functionally and returns the loss and
``torch.autograd.grad(loss, params, grad_outputs=loss_grad)``, with the core ATen decompositions
(so backward ops become plain ATen ops); the resulting GraphModule is exported with
``torch.onnx.export``: ``exporter="torchscript"`` (fast), ``"dynamo"`` (needs onnxscript), or
``"auto"`` (the default: TorchScript, falling back to dynamo where it fails or is gone).

Limits: buffers (BatchNorm running statistics) are constants of the graph and are not updated:
a module whose normalisation layers are in training mode is refused (call ``.eval()`` on them); the
caller's module and buffers are never changed. The module's output (or ``loss_fn``'s) must be a scalar.
A convolution's backward (``aten.convolution_backward``) has no ONNX export in torch 2.13's exporters
(TorchScript: "unsupported argument type in the JIT tracer"; dynamo: "No ONNX function found"): a
module with Conv layers is refused with both exporters' errors in one line.

Command line (for a module importable as ``pkg.mod:factory``)::

    python tools/make_training_graph.py pkg.mod:factory --input-shape 8,4 --target-shape 8,1 -o train.onnx
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from typing import Any, Callable, Sequence

METADATA_KEY = "amp_rewrite.training_graph"
LOSS = "loss"
LOSS_GRAD = "loss_grad"
GRAD_PREFIX = "grad."
MAX_IR_VERSION = 10  # onnxruntime 1.31 refuses newer


def make_training_graph(module: Any, inputs: Sequence[Any], targets: Sequence[Any] = (), *,
                        loss_fn: Callable[..., Any] | None = None, input_names: Sequence[str] | None = None,
                        target_names: Sequence[str] | None = None, opset: int = 18, exporter: str = "auto",
                        path: str | os.PathLike | None = None):
    """The forward+gradient ONNX graph (``onnx.ModelProto``) of ``loss_fn(module(*inputs), *targets)``
    (or ``module(*inputs, *targets)`` when ``loss_fn`` is None), see the module docstring. Written to
    ``path`` when given."""
    import onnx
    import torch
    from torch.func import functional_call
    from torch.fx.experimental.proxy_tensor import make_fx

    inputs, targets = tuple(inputs), tuple(targets)
    params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    if not params:
        raise ValueError("the module has no trainable parameters")
    names = [n for n, _ in params]
    updating = [name or type(m).__name__ for name, m in module.named_modules()
                if m.training and getattr(m, "track_running_stats", False) and getattr(m, "running_mean", None) is not None]
    if updating:
        raise ValueError(f"{', '.join(updating[:3])}{' ...' if len(updating) > 3 else ''} would update running "
                         f"statistics (training mode), which the graph cannot do: its loss and gradients would match "
                         f"neither mode; call module.eval() on the normalisation layers (or the module) first")
    # copies: tracing runs the module, and nothing it does may reach the caller's buffers
    buffers = {n: b.clone() for n, b in module.named_buffers()}
    n_params, n_inputs = len(params), len(inputs)
    in_names = list(input_names or [f"input_{i}" for i in range(n_inputs)])
    tg_names = list(target_names or [f"target_{i}" for i in range(len(targets))])
    if len(in_names) != n_inputs or len(tg_names) != len(targets):
        raise ValueError("input_names/target_names must name every input/target")

    def step(*args: Any):
        ps = args[:n_params]
        xs = args[n_params:n_params + n_inputs]
        ts = args[n_params + n_inputs:-1]
        seed = args[-1]
        state = {**buffers, **dict(zip(names, ps))}
        if loss_fn is None:
            loss = functional_call(module, state, (*xs, *ts))
        else:
            loss = loss_fn(functional_call(module, state, xs), *ts)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError("the loss must be a scalar tensor")
        loss = loss.reshape(())
        grads = torch.autograd.grad(loss, ps, grad_outputs=seed, allow_unused=True)
        grads = tuple(torch.zeros_like(p) if g is None else g for p, g in zip(ps, grads))
        return (loss, *grads)

    leaves = [p.detach().clone().requires_grad_(True) for _, p in params]
    seed = torch.ones((), dtype=torch.float32)
    was_training = module.training
    try:
        gm = make_fx(step, decomposition_table=torch._decomp.core_aten_decompositions())(*leaves, *inputs, *targets,
                                                                                           seed)
    finally:
        module.train(was_training)
    example = (*[p.detach() for _, p in params], *inputs, *targets, seed)
    graph_inputs = [*names, *in_names, *tg_names, LOSS_GRAD]
    graph_outputs = [LOSS, *[GRAD_PREFIX + n for n in names]]
    proto = _export(gm, example, graph_inputs, graph_outputs, opset, exporter)
    proto.ir_version = min(proto.ir_version, MAX_IR_VERSION)
    info = {"loss": LOSS, "loss_grad": LOSS_GRAD, "params": names, "grads": graph_outputs[1:],
            "inputs": in_names, "targets": tg_names}
    entry = proto.metadata_props.add()
    entry.key, entry.value = METADATA_KEY, json.dumps(info)
    onnx.checker.check_model(proto)
    if path is not None:
        onnx.save(proto, os.fspath(path))
    return proto


def _first_line(exc: BaseException) -> str:
    """The first line of what went wrong, from the bottom of the chain (the dynamo exporter wraps
    'No ONNX function found for aten.convolution_backward' in 'Failed to convert ... step 3/3')."""
    import re

    seen = {id(exc)}
    while exc.__cause__ is not None and id(exc.__cause__) not in seen:
        exc = exc.__cause__
        seen.add(id(exc))
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc))
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:300]


def _export(gm: Any, example: tuple, input_names: list[str], output_names: list[str], opset: int, exporter: str):
    import io
    import warnings

    import onnx
    import torch

    if exporter == "auto":
        try:
            return _export(gm, example, input_names, output_names, opset, "torchscript")
        except Exception as first:  # noqa: BLE001 - the TorchScript exporter is deprecated: fall back
            try:
                return _export(gm, example, input_names, output_names, opset, "dynamo")
            except Exception as second:  # noqa: BLE001 - both failed: say both, in a line each
                raise RuntimeError(f"neither exporter can export this forward+gradient graph (torchscript: "
                                   f"{_first_line(first)}; dynamo: {_first_line(second)})") from second
    if exporter == "dynamo":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            program = torch.onnx.export(gm, example, dynamo=True, input_names=input_names,
                                        output_names=output_names, opset_version=opset, verbose=False)
        proto = program.model_proto
    elif exporter == "torchscript":
        buf = io.BytesIO()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(gm, example, buf, dynamo=False, input_names=input_names, output_names=output_names,
                              opset_version=opset)
        proto = onnx.load_from_string(buf.getvalue())
    else:
        raise ValueError(f"exporter {exporter!r}: choose auto, dynamo or torchscript")
    try:
        onnx.checker.check_model(proto, full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as exc:  # under "auto", the dynamo exporter is tried next
        raise RuntimeError(f"the {exporter} exporter wrote an invalid model: {str(exc).splitlines()[0]}") from exc
    got_in = [i.name for i in proto.graph.input]
    got_out = [o.name for o in proto.graph.output]
    missing = [n for n in input_names if n not in got_in]
    # An exporter may drop an input nothing reads (a parameter without gradient path): tolerated;
    # outputs must all be there, in order.
    if got_out != output_names:
        raise RuntimeError(f"the exporter named the outputs {got_out}, expected {output_names}")
    if LOSS_GRAD in missing:
        raise RuntimeError("the exporter dropped the loss_grad seed input: the backward pass does not read it")
    return proto


def training_graph_info(proto: Any) -> dict | None:
    """The metadata :func:`make_training_graph` wrote (loss, loss_grad, params, grads), or None."""
    for entry in proto.metadata_props:
        if entry.key == METADATA_KEY:
            return json.loads(entry.value)
    return None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="torch module + loss -> forward+gradient ONNX graph")
    parser.add_argument("factory", help="pkg.module:callable returning the nn.Module (its output is the loss "
                                        "unless --loss mse|cross_entropy|l1)")
    parser.add_argument("--input-shape", action="append", required=True, help="comma-separated, one per input")
    parser.add_argument("--target-shape", action="append", default=[], help="comma-separated, one per target")
    parser.add_argument("--loss", choices=("module", "mse", "cross_entropy", "l1"), default="module")
    parser.add_argument("--opset", type=int, default=18)
    parser.add_argument("--exporter", choices=("auto", "dynamo", "torchscript"), default="auto")
    parser.add_argument("-o", "--output", required=True)
    args = parser.parse_args(argv)
    import torch
    import torch.nn.functional as F

    mod_name, _, attr = args.factory.partition(":")
    if not mod_name or not attr:
        parser.error(f"factory {args.factory!r}: write it as module:callable (e.g. mymodel:make)")
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # (run as a script, the current directory is not on the path; -m puts it)
    try:
        factory = getattr(importlib.import_module(mod_name), attr)
    except ImportError as exc:
        parser.error(f"factory {args.factory!r}: cannot import {mod_name!r} ({exc}); run from the directory that "
                     f"holds it or put it on PYTHONPATH")
    except AttributeError:
        parser.error(f"factory {args.factory!r}: module {mod_name!r} has no {attr!r}")
    module = factory()
    shape = lambda s: tuple(int(d) for d in s.split(","))  # noqa: E731
    inputs = [torch.randn(shape(s)) for s in args.input_shape]
    loss_fn = {"module": None, "mse": F.mse_loss, "l1": F.l1_loss, "cross_entropy": F.cross_entropy}[args.loss]
    if args.loss == "cross_entropy":
        targets = [torch.zeros(shape(s), dtype=torch.long) for s in args.target_shape]
    else:
        targets = [torch.randn(shape(s)) for s in args.target_shape]
    try:
        make_training_graph(module, inputs, targets, loss_fn=loss_fn, opset=args.opset, exporter=args.exporter,
                            path=args.output)
    except (ValueError, RuntimeError) as exc:  # (the module or the exporters: one line, not four tracebacks)
        print(f"make_training_graph: error: {_first_line(exc) if not isinstance(exc, RuntimeError) else exc}",
              file=sys.stderr)
        return 1
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
