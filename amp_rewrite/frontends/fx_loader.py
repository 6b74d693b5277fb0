"""torch.fx GraphModule → neutral IR.

Three kinds of graph come in, and every spelling of an op is mapped onto one rule name (the aten
base name torch.autocast's lists use: ``linear``, ``softmax``, ``conv2d`` ...):

- torch level, from ``torch.fx.symbolic_trace`` or a torch.compile (dynamo) capture: ``call_module``
  (an ``nn.Linear`` is "linear", an ``nn.LSTM`` is "lstm"), ``call_function`` (``F.linear``,
  ``torch.softmax``, ``operator.add``) and ``call_method`` (``x.softmax(-1)``, ``x.float()``);
- ATen level, from ``torch.export`` before and after ``run_decompositions()`` (``aten.linear``,
  ``aten.addmm``, ``aten._softmax`` ...): the name is the schema's base name, overload dropped;
- dtype conversions in any spelling (``x.to(torch.float16)``, ``x.float()``, ``x.type_as(y)``,
  ``aten._to_copy(x, dtype=...)``) become IR ``Cast`` nodes, so cast placement can fold, retarget
  or drop them as it does for ONNX.

Each fx node becomes one IR node whose ``origin`` is the fx node; its IR inputs are its tensor
arguments (flattened from lists and kwargs; ``meta["fx.slots"]`` says where each sits) and, for a
``call_module`` node, the module's own parameters and buffers (so cast placement decides their type
as it does for initializers). Type groups: one group "T" over the floating tensors, ``None`` for
integer and bool tensors; normalisation parameters and running statistics are group "U" (torch's
kernels accept FP32 parameters with low-precision input, as cuDNN does) and their statistics
outputs are fixed FP32. Parameters, buffers and tensor constants become initializer Values.

Dtypes and shapes come from ``node.meta["val"]`` (torch.export FakeTensors),
``node.meta["example_value"]`` (dynamo) or ``node.meta["tensor_meta"]`` (ShapeProp, run here with
``example_inputs`` when the graph carries no metadata).

Not modelled, on purpose: nodes that produce no tensor (``x.size()``, ``_assert_tensor_metadata``,
export's ``_guards_fn``) read metadata only; ``operator.getitem`` on a tuple result, or a named
tuple's field (``torch.topk(x, k).values``), only selects which output a consumer reads.

In-place ops are modelled as their out-of-place op, and the emitter makes them out of place where
a cast feeds the tensor they write. First, readers of a tensor after an in-place op on it are
rewired to read the op's result (the same tensor), so the data flow shows the mutation. A module
attribute the forward writes in place (a running sum, a cache) is rewired the same way through
every get_attr node of it; the op keeps its types, so the write reaches the module's tensor, and
that tensor is marked ``amp.mutable``: cast placement casts it at each low use rather than making
a low copy once, which would go stale. A write seen through another name of the tensor (``m[i] =
v``, whose result is only visible through ``m``; a view written, its base read afterwards) keeps
the tensor's producer, its views and the write in their types, each marked ``amp.mutable``
(``_Builder._keep_shared_storage``). What neither can fix (a tensor the caller passed in, written
with views alive or read afterwards) is refused with an explanation; so is every write seen
through another name in an export capture, where ``rewrite()`` then falls back to torch.export's
functional (decomposed) graph, in which the tensor's producer may still go low.
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import inspect
import itertools
import io
import math
import operator
import re
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
import torch.fx as fx

from ..errors import InPlaceMutationError, UsageError
from ..ir import DType, Graph, Model, Node, Value
from ..passes.base import BODY_SCOPE, coarse_rounding, lost_epsilon

# -- dtypes -----------------------------------------------------------------------------------------------
TORCH_TO_DTYPE: dict[torch.dtype, DType] = {
    torch.float32: DType.FLOAT, torch.float16: DType.FLOAT16, torch.bfloat16: DType.BFLOAT16,
    torch.float64: DType.DOUBLE, torch.int64: DType.INT64, torch.int32: DType.INT32, torch.int16: DType.INT16,
    torch.int8: DType.INT8, torch.uint8: DType.UINT8, torch.bool: DType.BOOL, torch.complex64: DType.COMPLEX64,
    torch.complex128: DType.COMPLEX128,
}
DTYPE_TO_TORCH: dict[DType, torch.dtype] = {v: k for k, v in TORCH_TO_DTYPE.items()}

CAST_OP = "Cast"  # the IR op cast placement folds, retargets and removes


# -- op names ---------------------------------------------------------------------------------------------
# operator.* functions (symbolic_trace and dynamo spell Python operators this way)
_OPERATORS: dict[Any, str] = {
    operator.add: "add", operator.iadd: "add", operator.sub: "sub", operator.isub: "sub",
    operator.mul: "mul", operator.imul: "mul", operator.truediv: "div", operator.itruediv: "div",
    operator.floordiv: "floor_divide", operator.ifloordiv: "floor_divide", operator.mod: "remainder",
    operator.pow: "pow", operator.ipow: "pow", operator.neg: "neg", operator.abs: "abs",
    operator.matmul: "matmul", operator.imatmul: "matmul", operator.getitem: "getitem",
    operator.setitem: "setitem", operator.eq: "eq", operator.ne: "ne", operator.lt: "lt", operator.le: "le",
    operator.gt: "gt", operator.ge: "ge", operator.pos: "positive", operator.and_: "bitwise_and",
    operator.or_: "bitwise_or", operator.xor: "bitwise_xor", operator.invert: "bitwise_not",
}
_INPLACE_OPERATORS = {operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
                      operator.ipow, operator.imatmul}  # (and setitem: _is_setitem)

# Spellings whose Python name differs from the rule name.
_ALIASES: dict[str, str] = {
    "true_divide": "div", "divide": "div", "multiply": "mul", "subtract": "sub", "absolute": "abs",
    "negative": "neg", "concat": "cat", "concatenate": "cat", "clip": "clamp", "arccos": "acos",
    "arcsin": "asin", "arctan": "atan", "arctan2": "atan2", "greater": "gt", "greater_equal": "ge", "less": "lt",
    "less_equal": "le", "not_equal": "ne", "upsample": "interpolate", "upsample_nearest": "interpolate", "upsample_bilinear": "interpolate",
    "softmax_": "softmax", "__setitem__": "setitem",
}

# Module classes (call_module) → rule names. Leaf modules symbolic_trace does not trace into.
_MODULES: dict[str, str] = {
    "Linear": "linear", "LazyLinear": "linear", "NonDynamicallyQuantizableLinear": "linear", "Bilinear": "bilinear",
    "Identity": "alias", "Conv1d": "conv1d", "Conv2d": "conv2d", "Conv3d": "conv3d",
    "LazyConv1d": "conv1d", "LazyConv2d": "conv2d", "LazyConv3d": "conv3d",
    "ConvTranspose1d": "conv_transpose1d", "ConvTranspose2d": "conv_transpose2d", "ConvTranspose3d": "conv_transpose3d",
    "BatchNorm1d": "batch_norm", "BatchNorm2d": "batch_norm", "BatchNorm3d": "batch_norm", "SyncBatchNorm": "batch_norm",
    "LazyBatchNorm1d": "batch_norm", "LazyBatchNorm2d": "batch_norm", "LazyBatchNorm3d": "batch_norm",
    "InstanceNorm1d": "instance_norm", "InstanceNorm2d": "instance_norm", "InstanceNorm3d": "instance_norm",
    "ParametrizationList": "parametrization",  # (a parametrized module's weight: fx_api traces into the module)
    "LayerNorm": "layer_norm", "GroupNorm": "group_norm", "RMSNorm": "rms_norm", "LocalResponseNorm": "local_response_norm",
    "Embedding": "embedding", "EmbeddingBag": "embedding_bag",
    "LSTM": "lstm", "GRU": "gru", "LSTMCell": "lstm_cell", "GRUCell": "gru_cell",
    "MultiheadAttention": "multi_head_attention",
    "ReLU": "relu", "ReLU6": "relu6", "LeakyReLU": "leaky_relu", "ELU": "elu", "SELU": "selu", "CELU": "celu",
    "GELU": "gelu", "SiLU": "silu", "Mish": "mish", "Hardswish": "hardswish", "Hardsigmoid": "hardsigmoid",
    "Hardtanh": "hardtanh", "Hardshrink": "hardshrink", "Softshrink": "softshrink", "Tanhshrink": "tanhshrink",
    "Threshold": "threshold", "GLU": "glu", "LogSigmoid": "logsigmoid", "Sigmoid": "sigmoid", "Tanh": "tanh",
    "Softsign": "softsign", "Softplus": "softplus", "PReLU": "prelu", "RReLU": "rrelu",
    "Softmax": "softmax", "LogSoftmax": "log_softmax", "Softmin": "softmin", "Softmax2d": "softmax",
    "Dropout": "dropout", "Dropout1d": "dropout", "Dropout2d": "dropout", "Dropout3d": "dropout",
    "AlphaDropout": "alpha_dropout", "FeatureAlphaDropout": "feature_alpha_dropout",
    "Flatten": "flatten", "Unflatten": "unflatten",
    "MaxPool1d": "max_pool1d", "MaxPool2d": "max_pool2d", "MaxPool3d": "max_pool3d",
    "AvgPool1d": "avg_pool1d", "AvgPool2d": "avg_pool2d", "AvgPool3d": "avg_pool3d",
    "AdaptiveAvgPool1d": "adaptive_avg_pool1d", "AdaptiveAvgPool2d": "adaptive_avg_pool2d",
    "AdaptiveAvgPool3d": "adaptive_avg_pool3d", "AdaptiveMaxPool1d": "adaptive_max_pool1d",
    "AdaptiveMaxPool2d": "adaptive_max_pool2d", "AdaptiveMaxPool3d": "adaptive_max_pool3d",
    "Upsample": "interpolate", "UpsamplingNearest2d": "interpolate", "UpsamplingBilinear2d": "interpolate",
    "PixelShuffle": "pixel_shuffle", "PixelUnshuffle": "pixel_unshuffle", "ChannelShuffle": "channel_shuffle",
    "ZeroPad1d": "pad", "ZeroPad2d": "pad", "ZeroPad3d": "pad", "ConstantPad1d": "pad", "ConstantPad2d": "pad",
    "ConstantPad3d": "pad", "ReflectionPad1d": "pad", "ReflectionPad2d": "pad", "ReflectionPad3d": "pad",
    "ReplicationPad1d": "pad", "ReplicationPad2d": "pad", "ReplicationPad3d": "pad", "CircularPad2d": "pad",
    "CosineSimilarity": "cosine_similarity", "PairwiseDistance": "pairwise_distance",
    "CrossEntropyLoss": "cross_entropy", "NLLLoss": "nll_loss", "MSELoss": "mse_loss", "L1Loss": "l1_loss",
    "SmoothL1Loss": "smooth_l1_loss", "HuberLoss": "huber_loss", "KLDivLoss": "kl_div", "BCELoss": "binary_cross_entropy",
    "BCEWithLogitsLoss": "binary_cross_entropy_with_logits", "PoissonNLLLoss": "poisson_nll_loss",
    "GaussianNLLLoss": "gaussian_nll_loss", "CTCLoss": "ctc_loss", "MarginRankingLoss": "margin_ranking_loss",
    "HingeEmbeddingLoss": "hinge_embedding_loss", "CosineEmbeddingLoss": "cosine_embedding_loss",
    "SoftMarginLoss": "soft_margin_loss", "MultiLabelMarginLoss": "multilabel_margin_loss",
    "MultiLabelSoftMarginLoss": "multilabel_soft_margin_loss", "MultiMarginLoss": "multi_margin_loss",
    "TripletMarginLoss": "triplet_margin_loss",
}
# Normalisations: parameters and running statistics keep FP32 beside a low-precision input
# (torch's CPU and CUDA kernels take mixed types, as cuDNN does); statistics outputs are FP32.
NORM_OPS = frozenset({"batch_norm", "native_batch_norm", "_native_batch_norm_legit",
                      "_native_batch_norm_legit_no_training", "_native_batch_norm_legit_functional",
                      "cudnn_batch_norm", "instance_norm", "layer_norm", "native_layer_norm", "group_norm",
                      "native_group_norm"})
# dtype conversions: call_method spellings → target dtype (None: taken from the arguments)
_CAST_METHODS: dict[str, torch.dtype | None] = {
    "float": torch.float32, "half": torch.float16, "bfloat16": torch.bfloat16, "double": torch.float64,
    "long": torch.int64, "int": torch.int32, "short": torch.int16, "char": torch.int8, "byte": torch.uint8,
    "bool": torch.bool, "to": None, "type": None, "type_as": None,
}
_CAST_ATEN = {"_to_copy", "to", "type_as", "_to_dtype"}


@dataclass
class FxSource:
    """What the emitter needs: the GraphModule being patched (a private copy) and how to find the
    fx node that yields each IR value."""

    gm: fx.GraphModule
    level: str  # "torch" (symbolic_trace / dynamo) or "aten" (torch.export)
    capture: str  # how the graph was obtained: "export", "symbolic_trace", "graph_module", "dynamo"
    leaf_nodes: dict[tuple[fx.Node, tuple], fx.Node] = field(default_factory=dict)
    # getitem nodes that select a nested tuple ((h, c) of an LSTM): their metadata holds leaves too
    tuple_nodes: dict[tuple[fx.Node, tuple], list[fx.Node]] = field(default_factory=dict)
    attr_nodes: dict[str, list[fx.Node]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Slot:
    """Where an IR input sits in its fx node: ``where`` is ("args", i, ...) / ("kwargs", k, ...)
    into the (possibly nested) arguments, or ("param", name) for a call_module's own tensor;
    ``leaf`` indexes into a tuple-valued argument node."""

    where: tuple
    leaf: tuple = ()


# -- public ---------------------------------------------------------------------------------------------
def load_fx(gm: fx.GraphModule, *, example_inputs: tuple | None = None, capture: str = "graph_module",
            example_kwargs: dict | None = None, target: str | None = None, shared_storage: bool = True) -> Model:
    """Build the IR from ``gm`` (which the caller owns and the emitter will patch). ``target``
    ("fp16" / "bf16"), the type the rewrite lowers to, keeps FP32 any node with a number argument
    that type cannot hold (see ``_scalar_out_of_range``).

    ``shared_storage``: an in-place write seen through another name of the tensor (``m[i] = v``, a
    view written) keeps the tensor, its views and the write in their types (``_keep_shared_storage``);
    False refuses it instead (InPlaceMutationError), for a caller with a functional graph to fall
    back to, where the tensor's producer may still go low."""
    if not isinstance(gm, fx.GraphModule):
        raise UsageError(f"load_fx takes a torch.fx.GraphModule, got {type(gm).__name__}")
    _ensure_metadata(gm, example_inputs, example_kwargs)
    _out_writes_as_copies(gm)
    _read_mutated_values_through_the_mutation(gm)
    level = "aten" if any(isinstance(n.target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket))
                          for n in gm.graph.nodes if n.op == "call_function") else "torch"
    source = FxSource(gm=gm, level=level, capture=capture)
    graph = _Builder(gm, source, _LOW_TYPES.get(target), shared_storage).build()
    model = Model(graph=graph, frontend="torch", origin=source)
    model.meta["fx.level"] = level
    if isinstance(gm.meta.get(BODY_MARK), str):
        graph.meta[BODY_SCOPE] = gm.meta[BODY_MARK]
    return model


def leaf_metas(node: fx.Node) -> list[tuple[tuple, Any]]:
    """``(leaf path, tensor-like meta)`` for every tensor the node yields, in pytree order."""
    meta = _node_meta(node)
    if meta is None:
        return []
    return list(_leaves(meta, ()))


def torch_dtype_of(meta: Any) -> torch.dtype | None:
    return getattr(meta, "dtype", None)


def module_path(node: fx.Node) -> str:
    """The module a node belongs to: its call_module target, else the innermost nn_module_stack entry."""
    if node.op == "call_module":
        return str(node.target)
    stack = node.meta.get("nn_module_stack")
    if stack:
        path = list(stack.values())[-1][0]
        path = str(path)
        # dynamo spells paths from the compiled frame's local that holds the module: L['self'].layers[0].fc,
        # L['fn'].0 (an nn.Sequential, whose forward torch.compile calls through a wrapper), L['s'].fc
        # (a forward whose first parameter is not named self); the path starts below that module
        path = re.sub(r"^L\['[^']+'\]\.?", "", path)
        path = re.sub(r"\[(\d+)\]", r".\1", path)
        path = re.sub(r"\[['\"]([^'\"]+)['\"]\]", r".\1", path)
        return path.strip(".")
    return ""


def ir_node_name(node: fx.Node) -> str:
    """Unique and readable: ``<module path>/<fx node name>`` (node rules can match module paths)."""
    path = module_path(node)
    return f"{path}/{node.name}" if path else node.name


def canonical_name(node: fx.Node, gm: fx.GraphModule) -> tuple[str, str]:
    """(domain, rule name) for a call_* node. Domain is "" for aten and torch ops."""
    if node.op == "call_module":
        sub = gm.get_submodule(str(node.target))
        cls = type(sub).__name__
        where = type(sub).__module__ or ""
        if where.startswith("torch.") and not where.startswith("torch.nn."):
            # a leaf of torch.ao.nn (QAT, dynamically quantized Linear/Conv2d) named like nn's: its
            # fake-quant observers refuse a low weight and input, so it is no nn.Linear to the rules
            return "", f"{where}.{cls}"
        if cls == "RNN":
            return "", "rnn_relu" if getattr(sub, "nonlinearity", "tanh") == "relu" else "rnn_tanh"
        if cls == "RNNCell":
            return "", "rnn_relu_cell" if getattr(sub, "nonlinearity", "tanh") == "relu" else "rnn_tanh_cell"
        return "", _MODULES.get(cls, cls)
    if node.op == "call_method":
        return "", _strip_inplace(_ALIASES.get(str(node.target), str(node.target)))
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        target = target.overloadpacket
    if isinstance(target, torch._ops.OpOverloadPacket):
        namespace = getattr(target, "_qualified_op_name", "aten::x").split("::")[0]
        base = target.__name__.split(".")[0]
        name = _ALIASES.get(base, base)
        if namespace != "aten":
            return namespace, name
        return "", _strip_inplace(name)
    if target in _OPERATORS:
        return "", _OPERATORS[target]
    if target is builtins.getattr:
        attr = node.args[1] if len(node.args) > 1 else ""
        return "", {"T": "t", "mT": "transpose", "H": "t", "mH": "transpose", "data": "detach"}.get(attr, f"getattr_{attr}")
    name = getattr(target, "__name__", None) or str(target)
    name = _ALIASES.get(name, name)
    if name == "multi_head_attention_forward":
        return "", "multi_head_attention"
    return "", _strip_inplace(name)


# Methods named like in-place ops that change a flag of the tensor, not its values
# (x.detach().requires_grad_(True): an input differentiated inside forward): the same tensor back.
_FLAG_SETTERS = frozenset({"requires_grad_", "share_memory_"})


def is_inplace(node: fx.Node) -> bool:
    if (node.op == "call_function" and node.target in _INPLACE_OPERATORS) or _is_setitem(node):
        return True
    if node.kwargs.get("inplace") is True:
        return True
    if node.op == "call_module":
        return getattr(node.graph.owning_module.get_submodule(str(node.target)), "inplace", False) is True
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        arguments = target._schema.arguments
        info = arguments[0].alias_info if arguments else None
        return info is not None and info.is_write and not target._schema.overload_name.startswith("out")
    if node.op == "call_method":
        name = str(node.target)
        return name.endswith("_") and not name.endswith("__") and not name.startswith("_") \
            and name not in _FLAG_SETTERS
    name = getattr(target, "__name__", "")
    return bool(name) and name.endswith("_") and not name.endswith("__") and not name.startswith("_")


def cast_target(node: fx.Node) -> torch.dtype | None:
    """The dtype a conversion node converts to, or None when the node is not a dtype conversion
    (``x.to("cpu")`` moves data and keeps its type)."""
    if node.op == "call_method" and node.target in _CAST_METHODS:
        fixed = _CAST_METHODS[str(node.target)]
        if fixed is not None:
            return fixed
        return _dtype_in_args(node)
    if node.op == "call_function" and isinstance(node.target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        packet = node.target.overloadpacket if isinstance(node.target, torch._ops.OpOverload) else node.target
        if packet.__name__.split(".")[0] in _CAST_ATEN:
            return _dtype_in_args(node)
    return None


# -- in-place ops --------------------------------------------------------------------------------------------
# Ops whose result may share storage with their first argument (torch level and ATen level names).
_VIEW_OPS = frozenset({"view", "view_as", "reshape", "reshape_as", "_unsafe_view", "_reshape_alias", "flatten",
                       "unflatten", "squeeze", "unsqueeze", "permute", "transpose", "t", "swapaxes", "swapdims",
                       "movedim", "moveaxis", "expand", "expand_as", "broadcast_to", "unfold", "diagonal", "detach",
                       "alias", "as_strided", "narrow", "slice", "select", "getitem", "split", "split_with_sizes",
                       "chunk", "tensor_split", "unbind", "contiguous", "to", "type_as", "float", "half",
                       "bfloat16", "real", "imag", "view_as_real", "view_as_complex", "T", "mT", "H", "mH",
                       "requires_grad", "share_memory"})


def _read_mutated_values_through_the_mutation(gm: fx.GraphModule) -> None:
    """``r = h.relu_(); y = h + 1`` reads ``h`` after it was mutated: make later readers read ``r``
    (the same tensor), so the graph's data flow shows the mutation and the in-place op can be made
    out of place where a cast must feed it. A module attribute (``self.acc.add_(m); ... self.acc``)
    is read through every get_attr node of it (symbolic_trace makes one per access): each read after
    the mutation reads its result too, so a cast for a low reader comes after the update, not
    before it (the op itself keeps its types and stays in place: the module's tensor must change).
    Graph inputs (mutations visible outside) and tensors with views (which would observe the
    mutation) are left alone; the loader refuses those if they need it."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    attributes = _attribute_nodes(gm)
    for node in list(gm.graph.nodes):
        if node.op not in ("call_function", "call_method", "call_module") or not is_inplace(node):
            continue
        if _is_setitem(node):
            continue
        target = node.args[0] if node.args else None
        if not isinstance(target, fx.Node) or target.op == "placeholder":
            continue
        names = attributes[str(target.target)] if target.op == "get_attr" else [target]
        if any(_has_aliases(name, node, gm, order) for name in names):
            continue
        for name in names:
            for user in list(name.users):
                if user is not node and order.get(user, -1) > order[node]:
                    user.replace_input_with(name, node)


def _out_writes_as_copies(gm: fx.GraphModule) -> None:
    """``torch.mul(h, 2, out=self.buf)`` becomes ``self.buf.copy_(torch.mul(h, 2))``, which the
    in-place handling understands: readers of the buffer after the write read the copy's result, a
    module attribute so written is marked mutable (cast at each low use, not converted once), and a
    write that casts would hide is refused. Left as it was, the write was invisible: a later low
    reader of the buffer got a copy converted once at rewrite time (stale on every call), and an
    intermediate painted low handed the out= op a cast copy, so the result landed in the copy.

    symbolic_trace and dynamo graphs keep ``out=`` as a keyword of the torch function (torch.export
    writes an ``.out`` overload and rewires the readers itself; its graphs are left alone). The
    copy's source is the call without ``out=``: its type is worked out from the metadata (out=
    converts the result into the out tensor's type, as copy_ does). A write into a tensor of
    another shape (out= resizes it, copy_ would broadcast) is refused."""
    graph = gm.graph
    changed = False
    for node in list(graph.nodes):
        if node.op != "call_function" or isinstance(node.target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
            continue
        out = node.kwargs.get("out")
        outs = [out] if isinstance(out, fx.Node) else list(out) if isinstance(out, (tuple, list)) else []
        if not outs or not all(isinstance(o, fx.Node) for o in outs):
            continue
        kwargs = {k: v for k, v in node.kwargs.items() if k != "out"}
        result = _natural_result(node, kwargs)
        tuple_out = not isinstance(out, fx.Node)
        results = list(result) if tuple_out and isinstance(result, (tuple, list)) else [result]
        if tuple_out and any(u.target is not operator.getitem for u in node.users):
            raise InPlaceMutationError(
                f"node {node.name!r} ({node.format_node()}) writes its results into out= tensors and its tuple is "
                f"read as a whole", "Make the operation out of place (v, i = torch.max(x, 1) for "
                "torch.max(x, 1, out=(v, i)))")
        for target, got in zip(outs, results):
            shape = getattr(got, "shape", None)
            before = getattr(_node_meta(target), "shape", None)
            if shape is not None and before is not None and tuple(shape) != tuple(before):
                raise InPlaceMutationError(
                    f"node {node.name!r} ({node.format_node()}) writes a result of shape {tuple(shape)} into "
                    f"{target.name!r} of shape {tuple(before)} by out=, which resizes it",
                    "Make the operation out of place (y = torch.mul(h, 2) for torch.mul(h, 2, out=y))")
        with graph.inserting_before(node):
            call = graph.call_function(node.target, node.args, kwargs)
            call.meta = {**node.meta}
            copies = []
            for k, (target, got) in enumerate(zip(outs, results)):
                source = call
                if tuple_out:
                    source = graph.call_function(operator.getitem, (call, k))
                    source.meta = {**node.meta}
                    _set_meta(source, got if got is not None else _leaf(node, k))
                elif got is not None:
                    _set_meta(source, got)
                # (named after the call, so an error about the write names the user's op)
                copy_ = graph.create_node("call_method", "copy_", (target, source), name=f"{node.name}_out")
                copy_.meta = {**node.meta}
                _set_meta(copy_, _node_meta(target))
                copies.append(copy_)
            if tuple_out:
                _set_meta(call, tuple(_node_meta(c) for c in copies) if result is None else result)
        if tuple_out:
            for user in list(node.users):
                user.replace_all_uses_with(copies[user.args[1]])
                graph.erase_node(user)
        else:
            node.replace_all_uses_with(copies[0])
        graph.erase_node(node)
        changed = True
    if changed:
        graph.lint()
        gm.recompile()


def _natural_result(node: fx.Node, kwargs: dict) -> Any:
    """The metadata of ``node``'s call without out= (its own result type, which out= converts from),
    worked out on the metadata's fake or meta tensors; None where that cannot be done (the caller
    then takes the out tensor's type, which it is unless out= converted)."""
    metas = [_node_meta(n) for n in node.all_input_nodes]
    fake = next((m for m in metas if isinstance(m, torch.Tensor) and hasattr(m, "fake_mode")), None)

    def stand_in(arg: Any) -> Any:
        if not isinstance(arg, fx.Node):
            return arg
        meta = _node_meta(arg)
        if isinstance(meta, torch.Tensor):  # (a fake tensor: export's val, dynamo's example_value)
            return meta
        if type(meta).__name__ == "TensorMetadata":
            return torch.empty_strided(meta.shape, meta.stride, dtype=meta.dtype, device="meta")
        raise ValueError("no tensor metadata")

    try:
        args, kw = fx.node.map_aggregate((node.args, kwargs), stand_in)
        with fake.fake_mode if fake is not None else contextlib.nullcontext(), torch.no_grad():
            result = node.target(*args, **kw)
    except Exception:  # noqa: BLE001 - best effort: the out tensor's type stands in
        return None
    if _meta_key(node) == "tensor_meta":  # (ShapeProp's metadata: described, not a tensor)
        from torch.fx.passes.shape_prop import _extract_tensor_metadata

        result = fx.node.map_aggregate(result, lambda t: _extract_tensor_metadata(t) if isinstance(t, torch.Tensor)
                                       else t)
    return result


def _set_meta(node: fx.Node, meta: Any) -> None:
    node.meta[_meta_key(node)] = meta


def _leaf(node: fx.Node, k: int) -> Any:
    meta = _node_meta(node)
    return meta[k] if isinstance(meta, (tuple, list)) else None


def _attribute_nodes(gm: fx.GraphModule) -> dict[str, list[fx.Node]]:
    """The get_attr nodes of each module attribute: all of them read the same tensor."""
    found: dict[str, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            found.setdefault(str(node.target), []).append(node)
    return found


def _mutated_attribute(node: fx.Node, gm: fx.GraphModule) -> str | None:
    """The module attribute (a buffer, a parameter) an in-place op writes, directly, through a
    view of it or through an earlier in-place op's result (the same tensor); None for any other."""
    if not is_inplace(node) or not node.args or not isinstance(node.args[0], fx.Node):
        return None
    tensor = node.args[0]
    while tensor.op != "get_attr":
        if not (_is_view(tensor, gm) or is_inplace(tensor)) or not tensor.args \
                or not isinstance(tensor.args[0], fx.Node):
            return None
        tensor = tensor.args[0]
    return str(tensor.target)


def _has_aliases(value: fx.Node, mutation: fx.Node, gm: fx.GraphModule, order: dict) -> bool:
    """Whether a view shares ``value``'s storage (a view taken of it, or ``value`` itself a view)."""
    return _is_view(value, gm) or any(u is not mutation and _is_view(u, gm) for u in value.users)


def _is_view(node: fx.Node, gm: fx.GraphModule) -> bool:
    if node.op not in ("call_function", "call_method", "call_module"):
        return False
    if isinstance(node.target, torch._ops.OpOverload):
        arguments = node.target._schema.arguments
        returns = node.target._schema.returns
        return bool(arguments and returns and arguments[0].alias_info is not None
                    and returns[0].alias_info is not None and not arguments[0].alias_info.is_write)
    return canonical_name(node, gm)[1] in _VIEW_OPS


# -- metadata ----------------------------------------------------------------------------------------------
_META_KEYS = ("val", "example_value", "tensor_meta")


def _meta_key(node: fx.Node) -> str:
    """Where ``node`` keeps its tensor metadata: torch.export's ``val``, dynamo's ``example_value`` or
    ShapeProp's ``tensor_meta`` (``val`` where it has none yet)."""
    for key in _META_KEYS:
        if node.meta.get(key) is not None:
            return key
    return "val"


def _node_meta(node: fx.Node) -> Any:
    return node.meta.get(_meta_key(node))


def is_tensor_meta(m: Any) -> bool:
    return isinstance(m, torch.Tensor) or type(m).__name__ == "TensorMetadata"


def _leaves(meta: Any, path: tuple) -> Iterator[tuple[tuple, Any]]:
    if is_tensor_meta(meta):
        yield path, meta
    elif isinstance(meta, (tuple, list)):
        for i, item in enumerate(meta):
            yield from _leaves(item, path + (i,))
    elif isinstance(meta, dict):
        for k, item in meta.items():
            yield from _leaves(item, path + (k,))


def _described(placeholder: fx.Node) -> bool:
    """The placeholder has its metadata: a tensor's (or a structure's), or the type ShapeProp
    recorded for a value that is no tensor (``forward(self, x, n: int = 3)``'s ``n``, which gets
    no tensor metadata: a rewrite of a rewrite's output, which carries it, asked for example inputs)."""
    if _node_meta(placeholder) is not None:
        return True
    kind = placeholder.meta.get("type")
    return isinstance(kind, type) and not issubclass(kind, torch.Tensor)


def _ensure_metadata(gm: fx.GraphModule, example_inputs: tuple | None, example_kwargs: dict | None) -> None:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    calls = [n for n in gm.graph.nodes if n.op.startswith("call_") and not _produces_nothing(n)]
    if all(_described(n) for n in placeholders) and (not calls or any(_node_meta(n) is not None for n in calls)):
        return
    if example_inputs is None and not example_kwargs:
        raise UsageError("this GraphModule carries no dtype metadata (node.meta['val'] or ['tensor_meta']): pass "
                         "example_inputs so amp-rewrite can run it once (ShapeProp) to learn every tensor's dtype")
    from torch.fx.passes.shape_prop import ShapeProp

    args, varkw = _positional(placeholders, tuple(example_inputs or ()), example_kwargs or {})
    prop = ShapeProp(gm)
    if varkw is not None:
        # (Interpreter gives a starred placeholder the list of the remaining positional arguments:
        # a '**kw' one is the dict of the keywords no parameter takes)
        starred = prop.placeholder
        prop.placeholder = lambda target, a, k: varkw if str(target).startswith("**") else starred(target, a, k)
    # The run is one forward, under no_grad (no autograd graph held for it). A forward that
    # differentiates inside (torch.autograd.grad of an energy w.r.t. its input: gradient
    # penalties, score matching, physics-informed nets) fails there, since symbolic_trace keeps no
    # `with torch.enable_grad():` block: a failed run is tried once more with autograd enabled, as
    # the module is called in training, and only if that fails too is the first error the
    # module's answer about its inputs. Either run must leave no trace: BatchNorm in training mode
    # updates its running statistics (restored), a backward inside forward fills .grad (put back);
    # the autograd graph dies with the run's values (ShapeProp keeps only their metadata).
    saved = {name: buffer.detach().clone() for name, buffer in gm.named_buffers()}
    grads = {p: p.grad for p in gm.parameters()}
    # an embedding with max_norm renormalises the rows it looks up, in place in its weight (the
    # only torch module that writes a parameter in forward): its weight is put back too
    renormed = {m.weight: m.weight.detach().clone() for m in gm.modules()
                if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.max_norm is not None
                and not m.weight.is_meta}

    def run(grad: bool) -> None:
        try:
            # (a traced module that raises prints its generated code to stderr first)
            with torch.set_grad_enabled(grad), contextlib.redirect_stderr(io.StringIO()):
                prop.propagate(*args)
        finally:
            with torch.no_grad():
                for weight, before in renormed.items():
                    weight.copy_(before)
                for name, buffer in gm.named_buffers():
                    # (only what the run changed: an expanded buffer, stride 0, cannot be written to)
                    if name in saved and not buffer.is_meta and buffer.layout == torch.strided \
                            and not torch.equal(buffer, saved[name]):  # (a sparse one: torch.equal has no kernel)
                        buffer.copy_(saved[name])
            for param, grad_before in grads.items():
                if param.grad is not grad_before:
                    param.grad = grad_before

    try:
        run(False)
    except Exception as exc:  # noqa: BLE001 - the module's own error, about its inputs
        if not isinstance(exc, torch.OutOfMemoryError):
            try:
                run(True)
                return
            except Exception:  # noqa: BLE001 - the same error, most likely: the first one is reported
                pass
        cause = exc.__cause__ or exc  # (ShapeProp wraps it in a dump of the node's internals)
        first = (str(cause).strip().splitlines() or [""])[0]
        raise UsageError(f"the example inputs do not run through the module ({type(cause).__name__}: {first}); "
                         f"pass example_inputs (and example_kwargs) it accepts") from exc


def _positional(placeholders: list[fx.Node], args: tuple, kwargs: dict) -> tuple[tuple, dict | None]:
    """The run's arguments by position (ShapeProp takes no keywords): each keyword at its
    parameter's place, and a parameter skipped before it at its default (a traced placeholder
    holds its default as its argument), not the next keyword slid into its place. A forward with
    ``**kw`` (symbolic_trace's '**kw' placeholder, the last) takes the keywords no parameter
    names: they are returned as its dict (None without one), every parameter before it filled."""
    varkw = placeholders[-1] if placeholders and str(placeholders[-1].target).startswith("**") else None
    if varkw is not None:
        placeholders = placeholders[:-1]
    names = [str(p.target) for p in placeholders]
    extra = {k: v for k, v in kwargs.items() if k not in names} if varkw is not None else None
    kwargs = {k: v for k, v in kwargs.items() if extra is None or k not in extra}
    unknown = sorted(set(kwargs) - set(names[len(args):]))
    if unknown:
        one = len(unknown) == 1
        listed = ", ".join(names + [str(varkw.target)] if varkw is not None else names) or "none"
        raise UsageError(f"example_kwargs names {', '.join(map(repr, unknown))}, which {'is' if one else 'are'} "
                         f"not {'a parameter' if one else 'parameters'} after the {len(args)} example_inputs "
                         f"(parameters: {listed})")
    wanted = [i for i, name in enumerate(names) if name in kwargs]
    filled = list(args)
    last = len(placeholders) - 1 if varkw is not None else max(wanted, default=-1)
    for node in placeholders[len(args):last + 1]:
        name = str(node.target)
        if name in kwargs:
            filled.append(kwargs[name])
        elif node.args:
            filled.append(node.args[0])
        else:
            given = [n for n in names if n in kwargs] + list(extra or ())
            said = f"example_kwargs gives {', '.join(given)} but not" if given else \
                f"the {len(args)} example_inputs do not reach"
            raise UsageError(f"{said} {name!r}, which comes before and has no default: pass it too")
    return tuple(filled), extra


def _produces_nothing(node: fx.Node) -> bool:
    return node.op == "call_module" and str(node.target) == "_guards_fn"


def _strip_inplace(name: str) -> str:
    if name.endswith("_") and not name.endswith("__") and len(name) > 1 and not name.startswith("_"):
        return name[:-1]
    return name


def dtype_read(arg: Any) -> torch.dtype | None:
    """A dtype argument: a ``torch.dtype``, or ``h.dtype`` read at run time (symbolic_trace keeps
    ``getattr(h, "dtype")`` as a node), taken as the type the source model gives ``h``: the
    emitter pins such a read to that type wherever the rewrite changes ``h``'s."""
    if isinstance(arg, torch.dtype):
        return arg
    if isinstance(arg, fx.Node) and arg.op == "call_function" and arg.target is builtins.getattr \
            and len(arg.args) == 2 and arg.args[1] == "dtype" and isinstance(arg.args[0], fx.Node):
        metas = leaf_metas(arg.args[0])
        if len(metas) == 1 and metas[0][0] == ():
            return torch_dtype_of(metas[0][1])
    return None


def _dtype_in_args(node: fx.Node) -> torch.dtype | None:
    given = dtype_read(node.kwargs.get("dtype"))
    if given is not None:
        return given
    for a in node.args[1:]:
        if (given := dtype_read(a)) is not None:
            return given
        if isinstance(a, fx.Node):  # x.to(other) / x.type_as(other): the other tensor's dtype
            metas = leaf_metas(a)
            if len(metas) == 1 and metas[0][0] == ():
                return torch_dtype_of(metas[0][1])
        if isinstance(a, str) and a.startswith("torch.") and hasattr(torch, a.split(".")[-1]):
            d = getattr(torch, a.split(".")[-1])  # x.type("torch.HalfTensor") is rare; dtype names only
            if isinstance(d, torch.dtype):
                return d
    return None


# -- building ------------------------------------------------------------------------------------------------
class _Builder:
    def __init__(self, gm: fx.GraphModule, source: FxSource, low: torch.dtype | None,
                 shared_storage: bool = True) -> None:
        self.gm = gm
        self.shared_storage = shared_storage
        self.source = source
        self.low = low
        self.graph = Graph(name=type(gm).__name__, origin=gm)
        self.values: dict[tuple[fx.Node, tuple], Value] = {}  # (fx node, leaf path) → value
        self.by_root: dict[fx.Node, list[tuple[tuple, Value]]] = {}
        self.tuples: dict[fx.Node, tuple[fx.Node, tuple]] = {}  # getitem result that is itself a tuple → (root, path)
        self.attrs: dict[str, Value] = {}
        # names a module tensor's value takes (its attribute path): a node's value named like one
        # (buffer ``mean`` beside ``x.mean()``) takes another, or the IR held two values ``mean``
        self.taken = {str(n.target) for n in gm.graph.nodes if n.op == "get_attr"} | {
            name for name, _ in itertools.chain(gm.named_parameters(), gm.named_buffers())}
        self.node_names = {n.name for n in gm.graph.nodes}
        self.tensor_names: dict[int, str] = {}  # id(module tensor) -> the first name it was read by
        self.order = {n: i for i, n in enumerate(gm.graph.nodes)}
        self.mutated = {_mutated_attribute(n, gm) for n in gm.graph.nodes if n.op.startswith("call_")} - {None}
        self.mutated |= _sharing_storage(gm, self.mutated)
        self.autocast = 0  # depth of dynamo's inline torch.autocast regions around the node being read
        self.storage_pins: list[tuple[fx.Node, fx.Node, list[fx.Node]]] = []  # (in-place op, base, its names)

    def build(self) -> Graph:
        for node in self.gm.graph.nodes:
            if node.op == "call_function" and getattr(node.target, "__name__", "") in AUTOCAST_MARKS:
                self.autocast += 1 if node.target.__name__ == AUTOCAST_MARKS[0] else -1
            if node.op == "placeholder":
                self._placeholder(node)
            elif node.op == "get_attr":
                self._get_attr(node)
            elif node.op in ("call_function", "call_method", "call_module"):
                self._call(node)
            elif node.op == "output":
                self._output(node)
        if self.storage_pins:
            self._keep_shared_storage()
        if self.low is not None:
            _mark_out_of_range_readers(self.graph, self.low)
        return self.graph

    def _keep_shared_storage(self) -> None:
        """An in-place write seen through another name of the tensor (``m[:, :2] = 1``, whose
        result is only visible through ``m``; ``v = h.view(-1); v.add_(1)`` with ``h`` read
        afterwards): the node that makes the storage, every view of it and the write keep their
        types, so no cast stands between two names of one tensor (a cast is a copy: the write would
        land in it, or miss it). Each of those tensors is marked ``amp.mutable``: a low reader
        casts it at its own use, after the writes before it and before those after it."""
        by_origin = {n.origin: n for n in self.graph.nodes if isinstance(n.origin, fx.Node)}
        for write, base, names in self.storage_pins:
            reason = (f"it shares storage with {base.name!r}, which {write.name!r} writes in place: the tensor and its "
                      f"views keep their types, so the write reaches every name of it (a cast would copy it)")
            for member in (*names, write):
                node = by_origin.get(member)
                if node is not None:
                    node.meta.setdefault("amp.keeps_types", reason)
                for _, value in self.by_root.get(member, ()):  # (its outputs; a lifted buffer's input)
                    value.meta["amp.mutable"] = True

    # -- sources --------------------------------------------------------------------------------------
    def _placeholder(self, node: fx.Node) -> None:
        metas = leaf_metas(node)
        lifted = _lifted_module_tensor(node)
        for path, m in metas:
            value = self._new_value(node, path, m)
            self.graph.add_input(value)
            if lifted is not None and path == ():
                # a parameter or buffer dynamo passes in as an input (torch.compile): its values are
                # the module's, as a module tensor's are (out-of-range numbers, epsilons, divisors,
                # rotary frequencies); it stays an input of the graph
                value.meta["fx.lifted_tensor"] = lifted
                self._note_beyond_range(value, lifted)
            elif path == () and node.meta.get("grapharg") is not None and value.dtype is not None \
                    and value.dtype.is_float and self.low is not None:
                # an activation input of a graph dynamo captured: a graph break hands values over as
                # inputs, so a padding mask (1 - m) * finfo.min built before the break arrives here;
                # cast as it was, it became -inf and a fully padded row NaN, where one graph clamps it
                value.meta["amp.sentinel"] = (
                    f"input {value.name!r}: torch.compile hands values over as inputs at a graph break",
                    float(torch.finfo(torch.float32).min))

    def _get_attr(self, node: fx.Node) -> None:
        target = str(node.target)
        self.source.attr_nodes.setdefault(target, []).append(node)
        if target in self.attrs:
            self.values[(node, ())] = self.attrs[target]
            return
        tensor = _fetch_attr(self.gm, target)
        if not isinstance(tensor, torch.Tensor):
            return  # a submodule or a constant object, not a tensor
        value = Value(target, TORCH_TO_DTYPE.get(tensor.dtype), tuple(tensor.shape), origin=("attr", target))
        value.const_numel = tensor.numel()
        value.meta["fx.attr"] = target
        self._note_alias(value, tensor)
        self._mark_mutable(value, target)
        self._note_beyond_range(value, tensor)
        self.graph.add_initializer(value)
        self.attrs[target] = value
        self.values[(node, ())] = value

    def _module_param(self, module_target: str, local: str, tensor: torch.Tensor) -> Value:
        qual = f"{module_target}.{local}"
        if qual in self.attrs:
            return self.attrs[qual]
        value = Value(qual, TORCH_TO_DTYPE.get(tensor.dtype), tuple(tensor.shape), origin=("attr", qual))
        value.const_numel = tensor.numel()
        value.meta["fx.attr"] = qual
        value.meta["fx.module_param"] = (module_target, local)
        self._note_alias(value, tensor)
        self._mark_mutable(value, qual)
        self._note_beyond_range(value, tensor)
        self.graph.add_initializer(value)
        self.attrs[qual] = value
        return value

    def _note_alias(self, value: Value, tensor: torch.Tensor) -> None:
        """A tensor the module holds under several names (tied weights: an embedding and the output
        projection) is one initializer per name here; the later names are marked ``amp.alias_of``
        the first, so the report counts its bytes once."""
        first = self.tensor_names.setdefault(id(tensor), value.name)
        if first != value.name:
            value.meta["amp.alias_of"] = first

    def _note_beyond_range(self, value: Value, tensor: torch.Tensor) -> None:
        """A module tensor (parameter, buffer, a traced constant) holding a finite value the low type
        cannot hold (and no mask sentinel): its readers are marked by ``_mark_out_of_range_readers``.
        A learned scale of 1e5 read by a ``mul`` between two Linears was clamped to 65504 in FP16
        and the product overflowed; a buffer of 70000 concatenated to an activation came out 5.5%
        off. (Weights of allow ops are converted with clamping as always, and counted.)"""
        # (one scan of the tensor: its magnitudes, which the optimal placement's growth bounds read
        # too, tell whether anything lies past the range)
        value.const_stats = _magnitudes(tensor)
        big = _beyond_range(tensor, self.low, value.const_stats) if self.low is not None else None
        if big is not None:
            value.meta["fx.out_of_range"] = big
        elif value.const_stats is not None and value.const_stats["max_abs"] >= _SENTINEL and self.low is not None \
                and tensor.dtype != self.low:
            # a mask buffer (finfo.min): its readers may run low, as a mask's do, but where it is cast
            # at use (training's FP32 master copy, a tensor torch.compile lifts) the cast clamps it, as
            # the offline conversion does; unclamped, a fully masked row was -inf, and NaN after softmax
            value.meta["amp.sentinel"] = (repr(value.name), value.const_stats["max_abs"])
        coarse = _coarse_values(tensor, self.low) if self.low is not None and big is None else None
        if coarse is not None:
            value.meta["fx.coarse"] = coarse  # (its mul readers: _mark_out_of_range_readers)

    def _mark_mutable(self, value: Value, target: str) -> None:
        """A module tensor the forward writes in place (a running sum, a cache) changes from call to
        call: cast placement casts it at each low use instead of making a low copy once, which
        the low readers would go on reading after the tensor moved on."""
        if target in self.mutated:
            value.meta["amp.mutable"] = True

    def _new_value(self, node: fx.Node, path: tuple, m: Any) -> Value:
        base, k = node.name, 0
        while base in self.taken or (k and base in self.node_names):  # (a module tensor's name: see __init__)
            k += 1
            base = f"{node.name}_v{k}"
        name = base if not path else f"{base}#{'.'.join(str(p) for p in path)}"
        dtype = TORCH_TO_DTYPE.get(torch_dtype_of(m))
        shape = tuple(_dim(d) for d in m.shape) if getattr(m, "shape", None) is not None else None
        value = Value(name, dtype, shape, origin=(node, path))
        self.values[(node, path)] = value
        self.by_root.setdefault(node, []).append((path, value))
        return value

    # -- calls ----------------------------------------------------------------------------------------
    def _call(self, node: fx.Node) -> None:
        if self._try_tuple_getitem(node):
            return
        metas = leaf_metas(node)
        if not metas and not _is_setitem(node):
            if _reads_values(node):
                self._value_reader(node)
            return  # else it reads metadata only (x.size(), _assert_tensor_metadata, guards)
        domain, name = canonical_name(node, self.gm)
        slots, inputs = self._tensor_inputs(node)
        dtype = cast_target(node)
        is_cast = dtype is not None and len(metas) == 1 and metas[0][0] == () and bool(inputs) \
            and slots[0].where == ("args", 0)
        if is_cast:
            # x.type_as(y) / x.to(y) read y's dtype only: the emitter spells the IR's target dtype
            # out (x.to(dtype)) when it changes, so y is no input of the IR Cast.
            other = inputs[1:]
            slots, inputs = slots[:1], inputs[:1]
        outputs = [self._new_value(node, path, m) for path, m in metas]
        ir = Node(CAST_OP if is_cast else name, inputs, name=ir_node_name(node), domain=domain, outputs=outputs,
                  origin=node)
        ir.meta["fx.module_path"] = module_path(node)
        ir.meta["fx.slots"] = slots
        ir.meta["fx.loaded"] = list(inputs)
        ir.meta["fx.torch_name"] = name
        ir.meta["input_names"] = _slot_labels(slots, node)
        if is_cast:
            ir.attrs["to"] = int(TORCH_TO_DTYPE.get(dtype, DType.UNDEFINED))
            ir.input_groups = ["T1"]
            ir.output_groups = ["T2"]
            ir.meta["fx.cast_other"] = other
        else:
            _refuse_mixed_operands(node, name, slots, inputs)
            ir.input_groups = [self._input_group(name, s, v) for s, v in zip(slots, inputs)]
            ir.output_groups = [self._output_group(name, i, v) for i, v in enumerate(outputs)]
            _split_promoted_types(ir)
            scalars = _arithmetic_scalars(node, name)
            if scalars:  # (the optimal placement's growth bounds: passes/optimal.py)
                ir.meta["amp.scalars"] = scalars
            big = _scalar_out_of_range(node, self.low, self.gm) if self.low is not None else None
            divisor = _small_divisor(node, self.low, self.gm, slots, inputs) \
                if self.low is not None and big is None else None
            if big is not None or divisor is not None:
                short, limit = TORCH_TO_DTYPE[self.low].short, torch.finfo(self.low).max
                big = big if big is not None else 1 / divisor
                ir.meta["fx.out_of_range"] = big  # (its readers: _mark_out_of_range_readers)
                ir.meta.setdefault("amp.keeps_types", (
                    f"its argument {big:g} is outside {short}'s finite range (±{limit:g}): in {short} torch "
                    f"would refuse it ('cannot be converted without overflow') or make it ±inf, so it keeps its "
                    f"types") if divisor is None else (
                    f"it divides by {divisor:g}, which multiplies by {big:g}, more than {short}'s largest value "
                    f"({limit:g}): in {short} its result overflows to ±inf, so it keeps its types"))
            lost = _lost_epsilon(node, name, self.low, self.gm, slots, inputs) \
                if self.low is not None and big is None and divisor is None else None
            if lost is not None:  # (classify: a deny seed, as onnx_constants marks one)
                what, number = lost
                short = TORCH_TO_DTYPE[self.low].short
                verb = "adds" if name in ("add", "sub", "addcmul", "addcdiv") else \
                    "compares with" if name in _COMPARES else "bounds below by"
                ir.meta["amp.lost_epsilon"] = (
                    f"{verb} {what} {number:g}, below {short}'s smallest value (it becomes 0 there: the "
                    f"epsilon is lost, and x / (x + eps) is 0/0): it keeps FP32, and so do the nodes after it "
                    f"up to a low-precision op")
        earlier = node.meta.get("amp_rewrite")  # an earlier rewrite's tag (fx_emitter writes it)
        if isinstance(earlier, dict) and earlier.get("category") == "deny" and earlier.get("precision") == "fp32":
            ir.meta["amp.kept_fp32_by"] = earlier.get("source", "")  # a user's pin survives a rewrite again
        bodies = body_modules(node, self.gm)
        if bodies is not None:
            ir.meta["amp.keeps_types"] = _body_reason(node, bodies)
        if self.autocast > 0:
            ir.meta.setdefault("amp.keeps_types", (
                "it runs inside a torch.autocast region (dynamo's _enter_autocast ... _exit_autocast), where torch "
                "decides the precision: left as written"))
        if is_inplace(node):
            ir.meta["fx.inplace"] = True
            self._check_aliasing(node)
            attribute = _mutated_attribute(node, self.gm)
            if attribute is not None:
                ir.meta.setdefault("amp.keeps_types", (
                    f"it writes the module's {attribute!r} in place: it keeps its types, so the update reaches "
                    f"the tensor the module holds (through a cast it would update a copy)"))
        self.graph.append(ir)

    def _value_reader(self, node: fx.Node) -> None:
        """A node that makes no tensor from the values it reads (a dataclass or namedtuple the module
        returns, ``x.item()``): it reads them as the module wrote them. Unseen, a dataclass output
        of a low value came back low despite keep_io_types."""
        slots, inputs = self._tensor_inputs(node)
        if not inputs:
            return
        domain, name = canonical_name(node, self.gm)
        ir = Node(name, inputs, name=ir_node_name(node), domain=domain, outputs=[], origin=node)
        ir.meta["fx.module_path"] = module_path(node)
        ir.meta["fx.slots"] = slots
        ir.meta["fx.loaded"] = list(inputs)
        ir.meta["fx.torch_name"] = name
        ir.meta["input_names"] = _slot_labels(slots, node)
        ir.input_groups = [self._input_group(name, s, v) for s, v in zip(slots, inputs)]
        ir.output_groups = []
        ir.meta["amp.keeps_types"] = ("it makes no tensor from the tensors it reads (an object the module returns, "
                                      "a Python number): it reads them in the types the module wrote")
        self.graph.append(ir)

    def _try_tuple_getitem(self, node: fx.Node) -> bool:
        """``getitem`` on a tuple result selects an output: no op, just a name for that output. So
        does a named tuple's field (``torch.topk(x, k).values``, ``x.max(-1).indices``), which
        symbolic_trace keeps as ``getattr`` (torch.export spells it as a getitem already)."""
        if node.op != "call_function" or node.target not in (operator.getitem, builtins.getattr) \
                or len(node.args) != 2:
            return False
        src, index = node.args[0], node.args[1]
        if not isinstance(src, fx.Node):
            return False
        root, path = self.tuples.get(src, (src, ()))
        if root is src and (src, ()) in self.values:
            return False  # getitem on a tensor: indexing, a real op (getattr: x.T, x.mT)
        if node.target is builtins.getattr:
            index = _field_index(src, index, self.gm)
        if not isinstance(index, (int, str)):
            return False
        path = path + (index,)
        value = self.values.get((root, path))
        if value is not None:
            self.values[(node, ())] = value
            self.source.leaf_nodes.setdefault((root, path), node)
            return True
        if any(p[:len(path)] == path for p, _ in self.by_root.get(root, ())):
            self.tuples[node] = (root, path)  # a nested tuple: its own getitems select the leaves
            self.source.tuple_nodes.setdefault((root, path), []).append(node)
            return True
        return False  # a tuple of non-tensors (sizes): not ours

    def _tensor_inputs(self, node: fx.Node) -> tuple[list[Slot], list[Value]]:
        slots: list[Slot] = []
        values: list[Value] = []
        for where, arg in _walk_args(node.args, ("args",)) + _walk_args(node.kwargs, ("kwargs",)):
            for leaf, value in self._values_of(arg):
                slots.append(Slot(where, leaf))
                values.append(value)
        if node.op == "call_module":
            sub = self.gm.get_submodule(str(node.target))
            for local, tensor in list(sub.named_parameters()) + list(sub.named_buffers()):
                if tensor is None or not tensor.is_floating_point():
                    continue
                slots.append(Slot(("param", local)))
                values.append(self._module_param(str(node.target), local, tensor))
        return slots, values

    def _values_of(self, arg: fx.Node) -> list[tuple[tuple, Value]]:
        if (arg, ()) in self.values:
            return [((), self.values[(arg, ())])]
        root, path = self.tuples.get(arg, (arg, ()))
        return [(p[len(path):], v) for p, v in self.by_root.get(root, ()) if p[:len(path)] == path and p != ()]

    def _input_group(self, name: str, slot: Slot, value: Value) -> str | None:
        if value.dtype is None or not value.dtype.is_float:
            return None
        if name in NORM_OPS and _slot_index(slot) != 0:
            return "U"
        return "T"

    def _output_group(self, name: str, index: int, value: Value) -> str | None:
        if value.dtype is None or not value.dtype.is_float:
            return None
        if name in NORM_OPS and index > 0:
            return None  # statistics: FP32 whatever the input type
        return "T"

    def _check_aliasing(self, node: fx.Node) -> None:
        """An in-place op is emitted out of place where a cast feeds it; that is only sound when
        nothing observes the mutation through another name: the input read again later, a view
        of it read later, the base it is a view of, or the caller, when that base is an input of
        the model (``x.add_(y)`` on an argument: the caller's tensor must change)."""
        target = node.args[0] if node.args else None
        if not isinstance(target, fx.Node):
            return
        dtypes = [torch_dtype_of(meta) for _, meta in leaf_metas(target)]
        if dtypes and not any(d is not None and d.is_floating_point for d in dtypes):
            return  # (an integer or bool tensor is never cast, so the op stays in place: T5's shift_tokens_right)
        after = lambda n: self.order.get(n, -1) > self.order[node]  # noqa: E731
        base = target  # the tensor it is a view of, however deep (out[0, 0]: select(select(out)))
        while _is_view(base, self.gm) and base.args and isinstance(base.args[0], fx.Node):
            base = base.args[0]
        if base.op == "get_attr" and not _is_setitem(node):
            # A write into a module attribute, directly or through a view of it (F.embedding(max_norm=...)
            # renormalises rows of a detached weight): the op keeps its types and stays in place, so
            # it writes the module's tensor, which is marked mutable: every later low reader casts
            # it where it reads it, after the write.
            return
        # Every name of that storage: the base and its views, however nested, siblings of the
        # target included (a = h.view(12); b = h.view(3, 4); a.sin_(): b sees it; so does
        # v = h.unsqueeze(0).squeeze(0) when h is mutated). A later reader of any of them observes it.
        aliases: dict[fx.Node, None] = {}
        stack = [base]
        while stack:
            alias = stack.pop()
            if alias in aliases:
                continue
            aliases[alias] = None
            stack.extend(v for v in alias.users if v is not node and _is_view(v, self.gm))
        observers = [u.name for alias in aliases for u in alias.users  # (a view's readers count, not the view)
                     if u is not node and u not in aliases and after(u)]
        # (a body's input is the enclosing graph's value, which has no caller of its own; there an
        # in-place update of a buffer passed in, an EMA under torch.no_grad(), kept its types)
        caller = base.op == "placeholder" and not self.gm.meta.get(BODY_MARK)
        own = base.op != "placeholder" or (not self.gm.meta.get(BODY_MARK) and _lifted_module_tensor(base) is not None)
        if (observers or _is_setitem(node)) and own and self.shared_storage:
            # The storage is the graph's own (made by a node, or a module tensor, which torch.compile
            # passes in as an input that keeps its type): the write and every name of it keep their
            # types, so no cast makes a copy that the write would miss or a reader would see stale;
            # low readers cast it at their use (build() applies it).
            self.storage_pins.append((node, base, list(aliases)))
            return
        if observers or caller or _is_setitem(node):
            seen = f"{', '.join(sorted(set(observers)))} read{'s' if len(set(observers)) == 1 else ''} it afterwards" \
                if observers else f"{base.name!r} is an input of the model, whose caller sees the change" if caller \
                else "the result is only visible through aliasing"
            raise InPlaceMutationError(
                f"node {node.name!r} ({node.format_node()}) mutates {target.name!r} in place and {seen}; casts "
                f"would break that aliasing",
                "Capture the model with torch.export and run_decompositions(), which functionalizes it "
                "(rewrite(model, example_inputs=..., decompose=True)), or make the operation out of place")

    # -- outputs -------------------------------------------------------------------------------------------
    def _output(self, node: fx.Node) -> None:
        slots: list[Slot] = []
        for where, arg in _walk_args(node.args, ("args",)):
            for leaf, value in self._values_of(arg):
                slots.append(Slot(where, leaf))
                self.graph.outputs.append(value)
        self.graph.meta["fx.output_slots"] = slots
        self.graph.meta["fx.loaded_outputs"] = list(self.graph.outputs)
        self.graph.meta["fx.output_node"] = node


# -- higher-order ops -----------------------------------------------------------------------------------
AUTOCAST_REGION = "wrap_with_autocast"
# a higher-order op's body graph, rewritten on its own (its ``meta``): its placeholders are the
# enclosing graph's values, not the model's inputs
BODY_MARK = "amp_rewrite.body"  # (its value: the body's path, the scope of its names in the report)
AUTOCAST_MARKS = ("_enter_autocast", "_exit_autocast")  # torch.amp.autocast_mode's, in dynamo's graphs


def body_modules(node: fx.Node, gm: fx.GraphModule) -> list[str] | None:
    """The attribute paths of the GraphModules a higher-order op runs (torch.cond's branches,
    while_loop's condition and body, a ``torch.no_grad()`` block's
    ``wrap_with_set_grad_enabled`` body, ...); None for any other node."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.HigherOrderOperator):
        return None
    found: list[str] = []
    for _, arg in _walk_args(node.args, ()) + _walk_args(node.kwargs, ()):
        if arg.op == "get_attr" and isinstance(_fetch_attr(gm, str(arg.target)), fx.GraphModule) \
                and str(arg.target) not in found:
            found.append(str(arg.target))
    return found


def hop_name(node: fx.Node) -> str:
    return getattr(node.target, "__name__", None) or str(node.target)


def _body_reason(node: fx.Node, bodies: list[str]) -> str:
    listed = ", ".join(bodies) or "none"
    if hop_name(node) == AUTOCAST_REGION:
        # wrap_with_autocast(device_type, dtype, enabled, cache_enabled, body, *args)
        dtype, enabled = (node.args[1], node.args[2]) if len(node.args) > 2 else (None, None)
        if enabled is False:
            how = "enabled=False: its ops run in the types they are given, FP32 here, on purpose"
        elif isinstance(dtype, torch.dtype):
            how = (f"enabled: torch runs its autocast-eligible ops in {str(dtype).replace('torch.', '')} at run time, "
                   f"so its results may be {str(dtype).replace('torch.', '')} whatever this node is listed as")
        else:
            how = "torch decides the precision inside it at run time"
        return f"a torch.autocast region (body {listed}): {how}; it is left as written"
    return (f"a higher-order op ({hop_name(node)}): its operands and results keep their types; its body graphs "
            f"({listed}) are rewritten as scopes of their own")


# Tensor methods that turn values into Python objects
_VALUE_METHODS = frozenset({"item", "tolist", "numpy", "__float__", "__int__", "__bool__", "__index__"})


def _reads_values(node: fx.Node) -> bool:
    """Whether a node that makes no tensor reads its tensors' values (not only their metadata): a
    class built from them (a dataclass, namedtuple or dict the module returns) or ``x.item()``."""
    if node.op == "call_method":
        return node.target in _VALUE_METHODS
    if node.op != "call_function":
        return False
    target = node.target
    if isinstance(target, type):
        return True
    return target in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default)


_LOW_TYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


# ops whose scalar arguments are values combined with their tensors' (an int there, ``-100000``,
# overflows like the float ``-1e5``); elsewhere an int is a size or an index (a 128256-word
# vocabulary in ``view(-1, 128256)``) and never becomes a value of the low type
_VALUE_SCALAR_OPS = frozenset({
    "add", "sub", "rsub", "mul", "div", "true_divide", "floor_divide", "remainder", "fmod", "clamp", "clamp_min",
    "clamp_max", "clip", "masked_fill", "fill", "full", "full_like", "new_full", "where", "threshold", "hardtanh",
    "maximum", "minimum", "addcmul", "addcdiv", "lerp", "nan_to_num", "pad", "constant_pad_nd", "index_fill",
    "scatter", "pow", "float_power", "eq", "ne", "lt", "le", "gt", "ge",
})
# the scalars a call_module leaf holds as attributes (nn.ConstantPad2d's value, nn.Threshold's,
# nn.Hardtanh's bounds), which symbolic_trace does not put among the node's arguments
_MODULE_SCALARS = ("value", "threshold", "min_val", "max_val")


# ops whose output holds values of their float inputs unchanged (or negated): a value beyond the
# low type's range read by them is still there in their output
_HOLDS_THROUGH = _VIEW_OPS | frozenset({
    "clone", "cat", "concat", "concatenate", "stack", "hstack", "vstack", "neg", "negative", "repeat", "tile",
    "index_select", "gather", "take", "masked_select", "where", "flip", "roll", "repeat_interleave", "index",
    "_to_copy", "copy", "lift_fresh_copy"})


def _mark_out_of_range_readers(graph: Graph, low: torch.dtype) -> None:
    """Keep FP32 what reads a value beyond the low type's range: a module tensor holding one
    (``_Builder._note_beyond_range``: a parameter, buffer or traced constant), or the output of a
    node with such a number. That node (``where(mask, 0.0, -1e5)``, ``full_like(h, 1e5)`` in FP16)
    keeps its types, and its output holds the number; an infer or clear op reading that output
    (``h + bias``) went low, so a cast at run time made the number ±inf (and an all-padding row
    NaN downstream), where FP32 is exact.
    Such readers, directly or through ops that copy values (views, concatenations, gathers,
    negation, where), are marked as the ONNX frontend marks readers of an out-of-range constant
    (``amp.exact_constant``): classify keeps an infer or clear one FP32. An allow op's inputs are
    cast as always."""
    short = TORCH_TO_DTYPE[low].short
    limit = torch.finfo(low).max
    holding: dict[int, tuple[str, float]] = {}  # id(value) → (the node or tensor with the number, the number)

    def hold(values, source: str, big: float) -> None:
        for v in values:
            if v.dtype is not None and v.dtype.is_float:
                holding[id(v)] = (source, big)
                # (cast placement clamps it to the type's limit before a run-time cast to the low
                # type: a mask fill, or any other number past the range)
                v.meta["amp.sentinel"] = (repr(source), big)

    # a parameter or buffer: converted offline with clamping, but cast at use where torch.compile
    # lifts it to an input or training keeps it FP32 (a mask buffer of finfo.min read by baddbmm
    # was -inf there, and a fully masked row NaN)
    for v in [*graph.initializers.values(), *graph.inputs]:
        if "fx.out_of_range" in v.meta:
            hold([v], v.name, v.meta["fx.out_of_range"])

    for node in graph.nodes:
        big = node.meta.get("fx.out_of_range")
        if big is not None:
            hold(node.outputs, node.name, big)
            continue
        factors = node.inputs if node.op_type in _MULS else node.inputs[:1] if node.op_type in _DIVS else ()
        coarse = next((v for v in factors if v is not None and "fx.coarse" in v.meta), None)
        if coarse is not None:  # (as onnx_constants._coarse_factor: a layer scale of 1e-6 is 1.3% off)
            value, error = coarse.meta["fx.coarse"]
            node.meta.setdefault("amp.exact_constant", (
                f"multiplies by {coarse.meta.get('fx.attr', coarse.name)!r} holding {value:g}, below {short}'s "
                f"smallest normal value: {short} holds it as a subnormal, {error:.1%} off, and every product would "
                f"be as far off, so the node keeps FP32 (as torch.autocast's type promotion keeps it)"))
        bias = _bias_beyond(node, holding)
        if bias is not None:  # (classify keeps an allow op with this FP32, as onnx_constants a Gemm's C)
            value, (source, big) = bias
            node.meta["amp.kernel_scalar"] = (
                f"its bias {value.meta.get('fx.attr', value.name)!r} holds {big:g}, beyond {short}'s finite range "
                f"(±{limit:g}): clamped, it would be added to every output as is (as matmul + add, the add keeps "
                f"FP32), so the node keeps FP32")
        found = next(((v, holding[id(v)]) for v in node.inputs if v is not None and id(v) in holding), None)
        if found is None:
            continue
        value, (source, big) = found
        origin = "" if source == value.name or (value.producer is not None and value.producer.name == source) \
            else f" (from {source!r})"
        node.meta.setdefault("amp.exact_constant", (
            f"reads {value.name!r}, which holds {big:g}{origin}, beyond {short}'s finite range "
            f"(±{limit:g}): in {short} it would be clamped or become ±inf, so the node keeps FP32"))
        if node.op_type in _HOLDS_THROUGH or (node.op_type == "Cast" and node.outputs[0].dtype is not None
                                              and node.outputs[0].dtype.is_float) or _keeps_magnitude(node):
            hold(node.outputs, source, big)  # (b.to(x.dtype) holds b's values)
        elif node.op_type in _MULS | _DIVS and value is node.inputs[0]:
            scalars = node.meta.get("amp.scalars", ())
            numerator = node.op_type in _MULS or (len(scalars) == 1 and scalars[0][0] in (("args", 1), ("kwargs", "other")))
            if len(scalars) == 1 and scalars[0][1] != 0 and numerator:  # (b * 1.0, b / 2: still past the range?)
                scaled = big * scalars[0][1] if node.op_type in _MULS else big / scalars[0][1]
                if abs(scaled) > limit:
                    hold(node.outputs, source, scaled)


# elementwise ops whose result keeps the magnitude of an operand past the range: a causal mask plus a
# padding mask (finfo.min + finfo.min is -inf in FP32 too, and finfo.min + a score still about finfo.min),
# ``p + 0.0``, OPT's ``torch.max(w, tensor(finfo.min))``
_MAGNITUDE_KEEPING = frozenset({"add", "sub", "rsub", "maximum", "minimum", "fmax", "fmin"})


def _keeps_magnitude(node: Node) -> bool:
    """``node`` adds, subtracts or takes the elementwise max/min of its operands (``max``/``min`` of
    two tensors, not a reduction): an operand past the range leaves the result there."""
    if node.op_type in _MAGNITUDE_KEEPING:
        return True
    return node.op_type in ("max", "min") and sum(v is not None and v.dtype is not None for v in node.inputs) >= 2


_ADDEND = frozenset({("args", 0), ("kwargs", "input")})
_BIAS = frozenset({("args", 2), ("kwargs", "bias"), ("param", "bias")})
# where a GEMM or convolution takes the tensor it adds to its result as it is (a bias)
_BIAS_SLOTS = {**dict.fromkeys(("addmm", "addmv", "addr", "addbmm", "baddbmm"), _ADDEND),
               **dict.fromkeys(("linear", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
                                "conv_transpose3d", "convolution", "_convolution"), _BIAS)}


def _bias_beyond(node: Node, holding: dict[int, tuple[str, float]]) -> tuple[Value, tuple[str, float]] | None:
    """(the bias, what it holds) where a GEMM or convolution adds one beyond the low type's range."""
    where = _BIAS_SLOTS.get(node.op_type)
    if where is None:
        return None
    for slot, value in zip(node.meta.get("fx.slots", ()), node.inputs):
        if value is not None and id(value) in holding and slot.where[:2] in where \
                and abs(holding[id(value)][1]) < _SENTINEL:  # (a mask sentinel saturates and still masks)
            return value, holding[id(value)]
    return None


# |x| at or above this is a mask sentinel (-1e9, finfo(float32).min): saturated to the low type's
# limit it still masks (as onnx_constants.SENTINEL: the report counts it, --check expects it)
_SENTINEL = 1e8


def _lifted_module_tensor(node: fx.Node) -> torch.Tensor | None:
    """The parameter or buffer a dynamo graph's placeholder stands for (torch.compile lifts them
    to inputs: ``l_self_modules_fc_parameters_weight_``), with its data; None for a real input or
    where dynamo does not say."""
    grapharg = node.meta.get("grapharg")
    source = getattr(grapharg, "source", None)
    if source is None:
        return None
    try:
        from torch._dynamo.source import is_from_unspecialized_param_buffer_source

        if not is_from_unspecialized_param_buffer_source(source):
            return None
        example = grapharg.example
    except Exception:  # noqa: BLE001 - dynamo internals: without them, it is an input like any other
        return None
    if not isinstance(example, torch.Tensor) or example.is_meta or type(example).__name__ == "FakeTensor":
        return None
    return example


def module_tensor(value: Value, gm: fx.GraphModule) -> torch.Tensor | None:
    """The module tensor ``value`` reads: a get_attr's (``fx.attr``), or a parameter or buffer
    torch.compile passes in (``fx.lifted_tensor``); else None."""
    if "fx.attr" in value.meta:
        tensor = _fetch_attr(gm, value.meta["fx.attr"])
        return tensor if isinstance(tensor, torch.Tensor) else None
    return value.meta.get("fx.lifted_tensor")


def _stored_values(tensor: torch.Tensor) -> torch.Tensor:
    """A sparse tensor's stored values (a GCN's adjacency buffer): the range checks have no sparse
    kernels (aminmax, abs); a dense tensor as it is."""
    if tensor.layout == torch.strided:
        return tensor
    with torch.no_grad():
        return tensor.coalesce().values() if tensor.layout == torch.sparse_coo else tensor.values()


def _magnitudes(tensor: torch.Tensor) -> dict | None:
    """max_abs of a float tensor's finite values (min_abs too for a small one), or None (no data:
    on the meta device, empty, not float)."""
    if not tensor.is_floating_point() or tensor.is_meta or tensor.numel() == 0:
        return None
    with torch.no_grad():
        data = _stored_values(tensor).detach()
        smallest, largest = torch.aminmax(data)  # (one pass, no copy: most tensors end here)
        if not (math.isfinite(float(smallest)) and math.isfinite(float(largest))):
            data = data[torch.isfinite(data)]
            if data.numel() == 0:
                return None
            smallest, largest = torch.aminmax(data)
        stats = {"max_abs": max(abs(float(smallest)), abs(float(largest)))}
        if data.numel() <= 1 << 16:
            stats["min_abs"] = float(data.abs().min())
    return stats


def _beyond_range(tensor: torch.Tensor, low: torch.dtype, stats: dict | None) -> float | None:
    """The largest finite magnitude in ``tensor`` past ``low``'s range and below a mask sentinel,
    or None (a tensor without data, on the meta device, is not looked into). ``stats``: its
    ``_magnitudes``, which settle most tensors (every finite value within the range)."""
    limit = torch.finfo(low).max
    if stats is None or stats["max_abs"] <= limit or tensor.dtype == low:
        return None
    with torch.no_grad():
        magnitude = _stored_values(tensor).detach().abs()
        beyond = magnitude[(magnitude > limit) & (magnitude < _SENTINEL)]
        return float(beyond.max()) if beyond.numel() else None


_MULS = frozenset({"mul", "mul_", "multiply"})
_DIVS = frozenset({"div", "div_", "true_divide", "divide"})  # (the numerator: their first tensor input)


def _coarse_values(tensor: torch.Tensor, low: torch.dtype) -> tuple[float, float] | None:
    """(its largest value, the error) for a small float tensor that ``low`` keeps to fewer than 7
    significant bits (``passes.base.coarse_rounding``: a scale of 1e-6 held as an FP16 subnormal);
    else None."""
    if not tensor.is_floating_point() or tensor.is_meta or tensor.dtype == low or not 0 < tensor.numel() <= 1 << 16:
        return None
    with torch.no_grad():
        data = _stored_values(tensor).detach().cpu().double()  # (at most 64k values: a scale, not a weight)
        return coarse_rounding(data.numpy(), data.to(low).double().numpy())


def _below_reciprocal_range(tensor: torch.Tensor, low: torch.dtype) -> float | None:
    """The smallest nonzero finite magnitude in a small float ``tensor`` whose reciprocal is past
    ``low``'s range (a divisor of 1e-6 multiplies by 1e6), signed, or None."""
    if not tensor.is_floating_point() or tensor.is_meta or not 0 < tensor.numel() <= 1 << 16:
        return None
    with torch.no_grad():
        data = _stored_values(tensor).detach().float().reshape(-1)
        magnitude = data.abs()
        usable = (magnitude > 0) & torch.isfinite(magnitude)
        if not bool(usable.any()):
            return None
        index = int(torch.where(usable, magnitude, torch.full_like(magnitude, float("inf"))).argmin())
        smallest = float(data[index])
    return smallest if 1 / abs(smallest) > torch.finfo(low).max else None


def _arithmetic_scalars(node: fx.Node, name: str) -> tuple:
    """((slot, number), ...) for the Python numbers a mul/div/add/sub/rsub combines with its tensors
    (``h * 5.66``, ``h / 8``, ``h + 3``), where they sit; () for other ops. add/sub's ``alpha``
    scales the other operand: it is listed as one more number of its size."""
    if node.op not in ("call_function", "call_method") or name not in ("mul", "div", "true_divide", "add", "sub", "rsub"):
        return ()
    found = [(("args", i), float(a)) for i, a in enumerate(node.args)
             if isinstance(a, (int, float)) and not isinstance(a, bool)]
    found += [(("kwargs", k), float(a)) for k, a in node.kwargs.items()
              if k in ("other", "input") and isinstance(a, (int, float)) and not isinstance(a, bool)]
    alpha = node.kwargs.get("alpha")
    if isinstance(alpha, (int, float)) and not isinstance(alpha, bool) and alpha != 1:
        found.append((("kwargs", "alpha"), float(alpha)))  # (a factor: counted as an addend bound, as large)
    return tuple(found)


def _scalar_out_of_range(node: fx.Node, low: torch.dtype, gm: fx.GraphModule) -> float | None:
    """A scalar argument of ``node`` that ``low`` cannot hold, or None. A mask fill (``new_full(s,
    -1e9)``, ``full_like(x, -1e9)``, ``masked_fill(m, -1e9)`` in FP16; ``finfo(float32).min`` in
    BF16) or a ``clamp(min=-1e9)`` is converted to the op's type when it runs: in the low type torch
    raises 'value cannot be converted ... without overflow' on every call (other ops make it
    ±inf). The node computes in FP32 as written, whatever type its tensors take around it. Floats
    count wherever they are; ints where the op combines them with its values
    (:data:`_VALUE_SCALAR_OPS`); a leaf module's scalar attributes too (:data:`_MODULE_SCALARS`)."""
    limit = torch.finfo(low).max
    ints = node.op != "call_module" and canonical_name(node, gm)[1] in _VALUE_SCALAR_OPS

    def number(x) -> bool:
        return isinstance(x, float) or (ints and isinstance(x, int) and not isinstance(x, bool))

    numbers: list[float] = []
    fx.node.map_aggregate((node.args, node.kwargs), lambda x: numbers.append(x) if number(x) else None)
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        numbers += [v for v in (getattr(module, a, None) for a in _MODULE_SCALARS)
                    if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return next((float(x) for x in numbers if math.isfinite(x) and abs(x) > limit), None)


def _small_divisor(node: fx.Node, low: torch.dtype, gm: fx.GraphModule, slots: list[Slot],
                  inputs: list[Value]) -> float | None:
    """The number a division divides by where its reciprocal is past ``low``'s range (``h / 1e-6``
    multiplies by 1e6: the FP32 ``h * 1e6`` beside it kept FP32, the division overflowed in FP16),
    or the smallest magnitude of a module tensor it divides by (a buffer of 1e-6), else None."""
    if node.op not in ("call_function", "call_method") or canonical_name(node, gm)[1] not in ("div", "floor_divide"):
        return None
    for slot, value in zip(slots, inputs):
        tensor = module_tensor(value, gm) if slot.where[:2] in (("args", 1), ("kwargs", "other")) else None
        if tensor is not None:  # (a module tensor, looked into only where it divides)
            return _below_reciprocal_range(tensor, low)
    divisor = node.args[1] if len(node.args) > 1 else node.kwargs.get("other")
    if not isinstance(divisor, (int, float)) or isinstance(divisor, bool) or divisor == 0 \
            or not math.isfinite(divisor):
        return None
    return float(divisor) if 1 / abs(divisor) > torch.finfo(low).max else None


# where the epsilon or lower bound sits: (positions, keyword) by op (torch and aten names alike)
_EPSILON_ARGUMENTS = {"add": ((0, 1), "other"), "sub": ((0, 1), "other"), "rsub": ((0, 1), "other"),
                      "clamp": ((1,), "min"), "clamp_min": ((1,), "min"), "maximum": ((0, 1), "other"),
                      "max": ((0, 1), "other"), "fmax": ((0, 1), "other"),
                      # a fill that stands in for zeros: where(r > 0, r, 1e-8), masked_fill(r == 0, 1e-8),
                      # full_like(r, 1e-8) added to r
                      "where": ((1, 2), "other"), "masked_fill": ((2,), "value"), "full_like": ((1,), "fill_value"),
                      "full": ((1,), "fill_value"), "new_full": ((2,), "fill_value"),
                      # the guard's test, where(r < 1e-8, 1e-8, r): compared in the low type, 1e-8 is 0,
                      # r < 0 is never true of a zero r, and the zero is kept
                      "lt": ((0, 1), "other"), "le": ((0, 1), "other"), "gt": ((0, 1), "other"),
                      "ge": ((0, 1), "other"), "less": ((0, 1), "other"), "less_equal": ((0, 1), "other"),
                      "greater": ((0, 1), "other"), "greater_equal": ((0, 1), "other")}
_COMPARES = frozenset({"lt", "le", "gt", "ge", "less", "less_equal", "greater", "greater_equal"})
# input + value * t1 * t2 (/ t2): the addend is value * t1 * t2, a constant where t1 and t2 are
_ADDC = frozenset({"addcmul", "addcdiv"})


def _lost_epsilon(node: fx.Node, name: str, low: torch.dtype, gm: fx.GraphModule, slots: list[Slot],
                  inputs: list[Value]) -> tuple[str, float] | None:
    """(what, its largest magnitude) of the epsilon an ``add``/``sub``/``addcmul``/``addcdiv`` adds, or the
    lower bound a ``clamp``/``clamp_min``/``maximum`` applies, where every nonzero value of it is 0 in ``low``
    (1e-8 in FP16, whose smallest value is 6e-8), or some of it where all its values have one sign
    (a per-channel epsilon): a number argument or a module tensor. In
    ``r / (r + 1e-8)`` after a relu, or ``x / x.clamp_min(1e-8)``, the low type lost it and every
    zero gave 0/0 = NaN. As the ONNX frontend's ``onnx_constants._vanishes``."""
    if node.op not in ("call_function", "call_method") or (name not in _EPSILON_ARGUMENTS and name not in _ADDC):
        return None
    if name in _ADDC:
        return _first_lost(_addc_addend(node, name, gm, slots, inputs), low)
    positions, keyword = _EPSILON_ARGUMENTS[name]
    candidates: list[tuple[str, Any]] = [("the number", node.args[i]) for i in positions
                                         if i < len(node.args) and not isinstance(node.args[i], fx.Node)]
    if keyword in node.kwargs and not isinstance(node.kwargs[keyword], fx.Node):
        candidates.append(("the number", node.kwargs[keyword]))
    where = {("args", i) for i in positions} | {("kwargs", keyword)}
    for slot, value in zip(slots, inputs):
        tensor = held_values(value, gm) if slot.where[:2] in where else None
        if tensor is not None:
            candidates.append((f"{value.meta.get('fx.attr', value.name)!r} holding", tensor))
    alpha = node.kwargs.get("alpha")
    if name in ("add", "sub", "rsub") and isinstance(alpha, (int, float)) and not isinstance(alpha, bool):
        # torch.add(r, 1e-4, alpha=1e-4) adds 1e-8; torch.add(r, ones_like(r), alpha=1e-8) too
        candidates = [(what, held * alpha if isinstance(held, (int, float, torch.Tensor)) and not isinstance(held, bool)
                       else held) for what, held in candidates]
    return _first_lost(candidates, low)


def _first_lost(candidates: list[tuple[str, Any]], low: torch.dtype) -> tuple[str, float] | None:
    """(what, its largest magnitude) of the first candidate epsilon ``low`` loses, or None."""
    for what, held in candidates:
        if isinstance(held, bool) or not isinstance(held, (int, float, torch.Tensor)):
            continue
        data = held if isinstance(held, torch.Tensor) else torch.tensor(float(held))
        if not data.is_floating_point() or data.is_meta or not 0 < data.numel() <= 1 << 16:
            continue  # (an integer is never below the smallest value; a big tensor is data, not an epsilon)
        with torch.no_grad():
            values = data.detach().float().reshape(-1).cpu()
            found = lost_epsilon(values.numpy(), values.to(low).float().numpy())
        if found is not None:
            return what, found
    return None


def _addc_addend(node: fx.Node, name: str, gm: fx.GraphModule, slots: list[Slot],
                 inputs: list[Value]) -> list[tuple[str, Any]]:
    """addcmul/addcdiv's addend ``value * t1 * t2`` (``/ t2``) where both tensors hold known values."""
    factors: dict[int, Any] = {i: node.args[i] for i in (1, 2) if i < len(node.args) and not isinstance(node.args[i], fx.Node)}
    for slot, value in zip(slots, inputs):
        index = {("args", 1): 1, ("kwargs", "tensor1"): 1, ("args", 2): 2, ("kwargs", "tensor2"): 2}.get(slot.where[:2])
        if index is not None:
            factors[index] = held_values(value, gm)
    scale = node.kwargs.get("value", 1)
    t1, t2 = factors.get(1), factors.get(2)
    if not all(isinstance(t, (int, float, torch.Tensor)) and not isinstance(t, bool) for t in (t1, t2, scale)):
        return []
    with torch.no_grad():
        try:
            addend = torch.as_tensor(scale, dtype=torch.float32) * torch.as_tensor(t1, dtype=torch.float32)
            addend = addend * torch.as_tensor(t2, dtype=torch.float32) if name == "addcmul" \
                else addend / torch.as_tensor(t2, dtype=torch.float32)
        except RuntimeError:  # (shapes that do not broadcast: not an addend known here)
            return []
    return [("the addend value * tensor1 " + ("* tensor2" if name == "addcmul" else "/ tensor2") + " =", addend)]


# torch ops that hand on their input's values (the set of them: a view, a copy, a conversion)
_VALUE_COPIES = frozenset({"detach", "clone", "contiguous", "alias", "lift_fresh_copy", "view", "reshape",
                           "_unsafe_view", "view_as", "reshape_as", "expand", "expand_as", "broadcast_to",
                           "unsqueeze", "squeeze", "flatten", "permute", "transpose", "t"})
_FILLS = {"ones": 1.0, "ones_like": 1.0, "new_ones": 1.0, "zeros": 0.0, "zeros_like": 0.0, "new_zeros": 0.0}
_FILL_ARGUMENT = {"full": (1, "fill_value"), "full_like": (1, "fill_value"), "new_full": (2, "fill_value"),
                  "scalar_tensor": (0, "s"), "fill": (1, "value"), "fill_": (1, "value")}


def held_values(value: Value, gm: fx.GraphModule, depth: int = 0) -> torch.Tensor | None:
    """The values ``value`` holds where they are known before the model runs: a module tensor's,
    through copies, views and float conversions of it (``b.to(x.dtype)``, ``eps.detach()``); a
    constant made in ``forward`` (``torch.ones(D) * 1e-8``, ``scalar_tensor(1e-8)``,
    ``zeros_like(r).fill_(1e-8)``: one number for a fill, whatever the shape); a product or
    quotient of such values and numbers (``b * 1.0``). None otherwise. For the range and epsilon
    checks, which read the set of values, not their places."""
    tensor = module_tensor(value, gm)
    if tensor is not None or depth > 8:
        return tensor
    node = value.producer
    origin = node.origin if node is not None else None
    if not isinstance(origin, fx.Node) or origin.op not in ("call_function", "call_method") \
            or len(node.outputs) != 1:
        return None
    name = node.meta.get("fx.torch_name", node.op_type)
    with torch.no_grad():
        if name in _FILLS:
            return torch.tensor(_FILLS[name])
        if name in _FILL_ARGUMENT:
            index, keyword = _FILL_ARGUMENT[name]
            fill = origin.args[index] if index < len(origin.args) else origin.kwargs.get(keyword)
            return torch.tensor(float(fill)) if isinstance(fill, (int, float)) and not isinstance(fill, bool) else None
        tensors = [v for v in node.inputs if v is not None]
        if node.op_type == "Cast" or name in _VALUE_COPIES:
            if len(tensors) < 1:
                return None
            held = held_values(tensors[0], gm, depth + 1)
            if node.op_type != "Cast" or held is None:
                return held
            if held.numel() > 1 << 16:
                return None  # (a big one is data, not an epsilon: not converted to look)
            dtype = node.outputs[0].dtype
            target = next((t for t, d in TORCH_TO_DTYPE.items() if d == dtype and t.is_floating_point), None)
            return held.to(target) if target is not None else None
        if name in ("mul", "div", "true_divide") and 1 <= len(tensors) <= 2:
            operands = []
            by_slot = {slot.where[:2]: v for slot, v in zip(node.meta.get("fx.slots", ()), node.inputs)}
            for i, arg in enumerate(origin.args[:2]):
                if isinstance(arg, fx.Node):
                    tensor_input = by_slot.get(("args", i))
                    held = held_values(tensor_input, gm, depth + 1) if tensor_input is not None else None
                elif isinstance(arg, (int, float)) and not isinstance(arg, bool):
                    held = torch.tensor(float(arg))
                else:
                    held = None
                if held is None or held.numel() > 1 << 16:
                    return None
                operands.append(held.float())
            if len(operands) != 2:
                return None
            try:
                return operands[0] * operands[1] if name == "mul" else operands[0] / operands[1]
            except RuntimeError:
                return None
    return None


def _field_index(node: fx.Node, field: Any, gm: fx.GraphModule) -> int | None:
    """Where the field named ``field`` sits in the named tuple ``node`` yields (``values`` is item
    0 of torch.topk's result), or None. symbolic_trace's metadata holds a plain tuple: the type is
    then torch's return type named after the op (``torch.return_types.topk``)."""
    if not isinstance(field, str):
        return None
    kinds = [type(_node_meta(node))]
    if node.op in ("call_function", "call_method"):
        kinds.append(getattr(torch.return_types, canonical_name(node, gm)[1], None))
    for kind in kinds:
        fields = getattr(kind, "__match_args__", ()) if isinstance(kind, type) and issubclass(kind, tuple) else ()
        if field in fields:
            return fields.index(field)
    return None


def _walk_args(obj: Any, prefix: tuple) -> list[tuple[tuple, fx.Node]]:
    """Every fx.Node inside (nested) args/kwargs with its path."""
    out: list[tuple[tuple, fx.Node]] = []
    if isinstance(obj, fx.Node):
        out.append((prefix, obj))
    elif isinstance(obj, (tuple, list)):
        for i, item in enumerate(obj):
            out += _walk_args(item, prefix + (i,))
    elif isinstance(obj, dict):
        for k, item in obj.items():
            out += _walk_args(item, prefix + (k,))
    return out


def _slot_index(slot: Slot) -> int:
    if slot.where[0] == "args" and len(slot.where) > 1 and isinstance(slot.where[1], int):
        return slot.where[1]
    return -1


def _slot_labels(slots: list[Slot], node: fx.Node) -> list[str]:
    """How rule files (``fp32_inputs``) and reasons name ``node``'s inputs: a module's own tensor by
    its name, an argument by the name the op's schema (or the Python function's signature) gives
    it, else by position; an item of a list argument as ``name.k`` (``tensors.1`` of a cat)."""
    target = node.target
    if node.op == "call_module":
        with contextlib.suppress(AttributeError):
            target = type(node.graph.owning_module.get_submodule(node.target)).forward
    names = _argument_names(target) if node.op in ("call_function", "call_module") else ()
    names = names[1:] if node.op == "call_module" else names  # (self)
    labels = []
    for slot in slots:
        if slot.where[0] == "param":
            labels.append(str(slot.where[1]))
            continue
        head, *rest = slot.where[1:]
        if slot.where[0] == "args" and head < len(names):
            head = names[head]
        labels.append(".".join(str(p) for p in (head, *rest)) + (f"#{'.'.join(map(str, slot.leaf))}" if slot.leaf else ""))
    return labels


def _argument_names(target: Any) -> tuple[str, ...]:
    """The positional argument names of a call's target (an op overload, a function, a module's
    forward), or () where it has none to read."""
    try:
        return _cached_argument_names(target)
    except TypeError:  # (an unhashable callable object)
        return _read_argument_names(target)


@functools.lru_cache(maxsize=None)
def _cached_argument_names(target: Any) -> tuple[str, ...]:
    return _read_argument_names(target)


# Python operators whose aten op has another name
_OPERATOR_ATEN = {"truediv": "div", "floordiv": "floor_divide", "and_": "bitwise_and", "or_": "bitwise_or",
                  "xor": "bitwise_xor", "inv": "bitwise_not", "invert": "bitwise_not"}


def _aten_schema(target: Any) -> Any:
    """The schema of the aten op a torch-level call runs (torch.cat, operator.mul, F.softmax), so
    that its arguments have the names they have under torch.export: a symbolic_trace capture named
    them by position (cat's 'tensors.1' was '0.1') or by Python's spelling (operator.mul's 'a', 'b'
    for 'self', 'other'), and one rule file did not fit both captures. None for anything else."""
    name = getattr(target, "__name__", None)
    module = getattr(target, "__module__", None) or ""
    if not isinstance(name, str) or not (module in ("_operator", "operator") or module.startswith("torch")
                                         or isinstance(target, type(torch.cat))):
        return None
    packet = getattr(torch.ops.aten, _OPERATOR_ATEN.get(name, name), None)
    if packet is None or not hasattr(packet, "overloads"):
        return None
    overloads = packet.overloads()
    for choice in ("Tensor", "default", "int", *overloads):
        if choice in overloads:
            return getattr(packet, choice)._schema
    return None


def _read_argument_names(target: Any) -> tuple[str, ...]:
    schema = getattr(target, "_schema", None)
    if schema is None:
        with contextlib.suppress(Exception):  # (a name torch.ops cannot look up)
            schema = _aten_schema(target)
    if schema is not None:
        return tuple(a.name for a in schema.arguments if not a.kwarg_only)
    try:
        params = inspect.signature(target).parameters.values()
    except (TypeError, ValueError):  # (a builtin without a signature: operator.add, torch.add)
        return ()
    names = []
    for p in params:
        if p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            break
        names.append(p.name)
    return tuple(names)


def _is_setitem(node: fx.Node) -> bool:
    """``t[i] = v``: dynamo writes ``operator.setitem``, symbolic_trace a ``__setitem__`` method call."""
    return (node.op == "call_function" and node.target is operator.setitem) \
        or (node.op == "call_method" and node.target == "__setitem__")


def _dim(d: Any) -> int | str | None:
    """A dim of a captured tensor's shape: an int, or the name of a symbolic size. A SymInt is
    read without ``int()``, which under torch.compile installs a guard that specialises the graph
    to this size (one recompile per batch size, then dynamo's recompile limit and plain FP32)."""
    if isinstance(d, int):
        return d
    if isinstance(d, torch.SymInt):
        value = d.node.maybe_as_int()
        return int(value) if value is not None else str(d)
    try:
        return int(d)
    except Exception:  # noqa: BLE001 - symbolic sizes stay symbolic
        return str(d)


def module_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``module`` by path, a tensor shared between paths under each."""
    tensors = dict(module.named_parameters(remove_duplicate=False))
    tensors.update(module.named_buffers(remove_duplicate=False))
    return tensors


def _sharing_storage(gm: fx.GraphModule, written: set[str]) -> set[str]:
    """The module tensors that share storage with one the forward writes: a buffer registered as a
    view of another (``self.k = kv[0]``, a cache handing out per-layer slices) sees the write, so
    it changes from call to call too. Converted once, its low copy went stale."""
    if not written:
        return set()

    def storage(tensor: Any) -> int | None:
        if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
            return None
        try:
            return tensor.untyped_storage().data_ptr() or None  # (0: an empty storage, shared with nothing)
        except (RuntimeError, NotImplementedError):  # (a tensor subclass without a storage)
            return None

    tensors = module_tensors(gm)
    for node in gm.graph.nodes:
        if node.op == "get_attr" and str(node.target) not in tensors:
            tensors[str(node.target)] = _fetch_attr(gm, str(node.target))
    pointers = {storage(tensors.get(name)) for name in written} - {None}
    return {name for name, tensor in tensors.items() if pointers and storage(tensor) in pointers}


def _fetch_attr(gm: fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for atom in target.split("."):
        if not hasattr(obj, atom):
            return None
        obj = getattr(obj, atom)
    return obj


# torch runs these on operands of one dtype only (no type promotion: 'mat1 and mat2 must have the
# same dtype'). A captured graph that mixes them was captured from example inputs of the wrong
# dtype: torch.export's fake tensors do not check, and the casts placed from those types would fail
# on the real inputs.
_ONE_DTYPE_OPS = frozenset({
    "linear", "mm", "bmm", "addmm", "matmul", "baddbmm", "addbmm", "addmv", "mv", "dot",
    "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
    "convolution", "_convolution",
})


def _refuse_mixed_operands(node: fx.Node, name: str, slots: list[Slot], inputs: list[Value]) -> None:
    if name not in _ONE_DTYPE_OPS:
        return
    typed = [(s, v) for s, v in zip(slots, inputs) if v is not None and v.dtype is not None]
    if len({v.dtype for _, v in typed}) < 2:
        return
    labels = _slot_labels([s for s, _ in typed], node)
    listed = ", ".join(f"{label} {v.dtype.short}" for label, (_, v) in zip(labels, typed))
    graph_inputs = [a.name for a in node.all_input_nodes if a.op == "placeholder"]
    hint = (f" (graph input {', '.join(map(repr, graph_inputs))} has the type its example had)" if graph_inputs
            else "")
    raise UsageError(f"{node.name} ({name}) reads tensors of different types ({listed}), which torch does not run: "
                     f"the graph was captured from example inputs of the wrong dtype{hint}; pass example_inputs "
                     f"of the dtypes the module takes")


def _split_promoted_types(node: Node) -> None:
    """A torch op may read and write floats of different types (``x * fp64_buffer``,
    ``softmax(x, dtype=torch.float64)``, ``linear(x) + fp16_tensor``, an autocast region):
    torch's type promotion, not one type variable, decides its result. Each type then gets its own
    group (the FP32 tensors keep ``T``, the group painting decides), so every group still has one
    type, and the node keeps the types it was written with: lowering its FP32 tensors could change
    what the promotion gives (FP16 with a BF16 tensor promotes to FP32)."""
    groups = [*zip(node.input_groups, node.inputs), *zip(node.output_groups, node.outputs)]
    types = {v.dtype for g, v in groups if g == "T" and v is not None}
    if len(types) < 2:
        return
    split = lambda g, v: f"T.{v.dtype.short}" if g == "T" and v is not None and v.dtype != DType.FLOAT else g  # noqa: E731
    node.input_groups = [split(g, v) for g, v in zip(node.input_groups, node.inputs)]
    node.output_groups = [split(g, v) for g, v in zip(node.output_groups, node.outputs)]
    listed = ", ".join(sorted(t.short for t in types))
    node.meta["amp.keeps_types"] = (f"its float tensors have different types ({listed}): torch's type promotion "
                                    f"decides its result, so it keeps the types it was written with")
