"""Inline an ONNX model's model-local functions before it is rewritten.

Why: a function's body is one definition shared by every call, typed by its callers (its inputs
carry no types), so it cannot be painted per call: a call node left alone keeps everything it
computes FP32. TorchScript's ``export_modules_as_functions`` and onnxscript write whole transformer
blocks as functions, and the rewrite then made only the layers outside them low. onnxruntime inlines
every model-local function when it loads a model anyway, so inlining here costs nothing at run time
and lets every op of every call be decided like any other.

onnx's inliner does the work (:func:`onnx.inliner.inline_local_functions`). Around it:

- each call gets its own copy of the function whose node names start with the call's name
  (``/b1/Block/MatMul_2``), so a node keeps a name that says where it came from and that
  ``--fp32-nodes '/b1/*'`` matches (the inliner alone names it ``MatMul_2__1``);
- a call that leaves an attribute its function gives a default (``attribute_proto``) unset is given
  that default: the inliner leaves it unset, and the inlined op took its schema's default instead;
- the main graph's initializers are set aside while the inliner runs (it serialises the model, and
  a model past 2 GB does not serialise) and put back after; the inliner keeps the main graph's names.

A model whose functions import another version of an op set than the model (the inliner would need
to convert them) is not inlined: :func:`inline_functions` says why, and its calls stay FP32.
"""

from __future__ import annotations

import re
from collections import Counter

import onnx

_SUFFIX = re.compile(r"__\d+$")  # what the inliner appends to the names it copies


def called_functions(proto: onnx.ModelProto) -> Counter:
    """Calls of model-local functions, by ``domain::name``, in every graph and function body."""
    local = {(f.domain, f.name) for f in proto.functions}
    calls: Counter = Counter()
    if not local:
        return calls
    for nodes in _node_lists(proto):
        for node in nodes:
            if (node.domain, node.op_type) in local:
                calls[f"{node.domain}::{node.op_type}"] += 1
    return calls


def inline_functions(proto: onnx.ModelProto) -> tuple[onnx.ModelProto | None, Counter, str | None]:
    """(the model with its model-local functions inlined, the calls inlined, None), or (None, the
    calls, why not) where they cannot be, or (None, empty, None) where the model calls none.
    ``proto`` is not modified."""
    calls = called_functions(proto)
    if not calls:
        return None, calls, None
    model_sets = {o.domain or "ai.onnx": o.version for o in proto.opset_import}
    for function in proto.functions:
        for o in function.opset_import:
            have = model_sets.get(o.domain or "ai.onnx")
            if have is not None and have != o.version:
                return None, calls, (f"function {function.domain}::{function.name} imports {o.domain or 'ai.onnx'} "
                                     f"opset {o.version}, the model {have}")
    from .onnx_loader import _copy_fields

    work = onnx.ModelProto()  # (everything but the main graph's initializers, copied)
    _copy_fields(work, proto, skip="graph")
    _copy_fields(work.graph, proto.graph, skip="initializer")
    _one_function_per_call(work)
    from onnx import inliner

    try:
        inlined = inliner.inline_local_functions(work)
    except Exception as exc:  # noqa: BLE001 - onnx's C++ inliner raises several kinds
        from ..errors import first_line

        return None, calls, f"onnx's inliner failed: {first_line(exc)}"
    inlined.graph.initializer.extend(proto.graph.initializer)
    _drop_inliner_suffixes(inlined)
    return inlined, calls, None


def with_default_attributes(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` whose function calls set every attribute their function gives a default
    (``FunctionProto.attribute_proto``): onnx's inliner leaves an unset one unset, so the inlined
    op took its schema's default instead (LeakyRelu's 0.01 for a function's 0.2). ``model`` itself
    where no function has a default."""
    defaults = _defaults(model)
    if not defaults:
        return model
    copied = onnx.ModelProto()
    copied.CopyFrom(model)
    _fill_defaults(copied, defaults)
    return copied


def _defaults(model: onnx.ModelProto) -> dict:
    return {(f.domain, f.name, getattr(f, "overload", "")): list(f.attribute_proto)
            for f in model.functions if len(f.attribute_proto)}


def _fill_defaults(model: onnx.ModelProto, defaults: dict) -> None:
    for nodes in _node_lists(model):
        for node in nodes:
            given = defaults.get((node.domain, node.op_type, getattr(node, "overload", "")))
            if given:
                have = {a.name for a in node.attribute}
                node.attribute.extend(a for a in given if a.name not in have)


def _node_lists(model: onnx.ModelProto) -> list:
    """The node lists of every graph (bodies included) and every function body of ``model``."""
    from .onnx_loader import _graph_protos  # (it reads ``.node`` alone: a FunctionProto walks alike)

    return [g.node for body in (model.graph, *model.functions) for g in _graph_protos(body)]


def _one_function_per_call(model: onnx.ModelProto) -> None:
    """Give each call (in the main graph and its bodies, then in the copies made, for nested calls)
    its own copy of its function, whose node names start with the call's name; fill the calls'
    default attributes. Edits ``model`` (the inliner's working copy)."""
    _fill_defaults(model, _defaults(model))
    functions = {(f.domain, f.name): f for f in model.functions}
    copies: list[onnx.FunctionProto] = []
    taken = {f.name for f in model.functions}
    count = Counter()

    def visit(nodes, prefix: str) -> None:
        pending = []
        for index, node in enumerate(nodes):
            if prefix:
                node.name = f"{prefix}/{node.name or f'{node.op_type}_{index}'}"
            for attr in node.attribute:  # (a body inside a function's body: named under the call too)
                if attr.type == onnx.AttributeProto.GRAPH:
                    visit(attr.g.node, prefix)
                elif attr.type == onnx.AttributeProto.GRAPHS:
                    for g in attr.graphs:
                        visit(g.node, prefix)
            original = functions.get((node.domain, node.op_type))
            if original is None:
                continue
            count[node.op_type] += 1
            name = f"{original.name}__amp{count[node.op_type]}"
            while name in taken:
                name += "_"
            taken.add(name)
            copy = onnx.FunctionProto()
            copy.CopyFrom(original)
            copy.name = name
            node.op_type = name
            copies.append(copy)
            pending.append((copy, node.name or f"{original.name}_{index}"))
        for copy, call_name in pending:  # (nested calls: inside the copy, named under this call)
            visit(copy.node, call_name)

    visit(model.graph.node, "")
    del model.functions[:]
    model.functions.extend(copies)


def _drop_inliner_suffixes(model: onnx.ModelProto) -> None:
    """The inliner appends ``__<n>`` to every node name it copies; the per-call prefix already makes
    them distinct, so the suffix goes wherever the name left is still unique in the model."""
    lists = _node_lists(model)
    names = Counter(node.name for nodes in lists for node in nodes if node.name)
    for nodes in lists:
        for node in nodes:
            plain = _SUFFIX.sub("", node.name)
            if plain != node.name and names[plain] == 0:
                names[plain] += 1
                node.name = plain
