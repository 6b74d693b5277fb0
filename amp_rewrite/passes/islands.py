"""FP32 islands: the connected regions that deny paint forced to FP32, named and counted.

An island is a connected component (networkx) of FP32 nodes linked by painted type-group edges,
in a scope the rewrite changes (:func:`changed_scopes`), holding at least one deny op or
deny-painted node (the FP32 infer/clear neighbours it reads from belong to it: they are where the cast enters). Each gets the ops that seeded it and a
recognised pattern name (LayerNorm, RMSNorm, softmax, loss, ...) so the report can say
"LayerNorm pattern, 9 nodes, 1 cast in, 1 out". The nodes of such a scope that painting left
alone (no allow op there) stop saying that nothing changes (``paint.restate_changed``).
"""

from __future__ import annotations

from typing import Iterator

import networkx as nx

from ..decisions import Category, DecisionLog, Island, Precision
from ..ir import DType, Graph, Model, Node, Value
from .base import Context, PassResult, accepts_any_float, group_inputs, group_outputs, node_label, participates, \
    precision, retypable_io, scope_label
from .paint import restate_changed, through_no_op_casts


_DENY = (Category.DENY, Category.UNLISTED)


def find_islands(model: Model, ctx: Context) -> PassResult:
    next_id = len(ctx.log.islands)
    io_low = not ctx.options.keep_io_types
    for scope in changed_scopes(model, ctx):
        restate_changed(scope)
        members = [n for n in scope.nodes if n.meta.get("amp.participates") and precision(n) == Precision.FP32]
        ug = nx.Graph()
        ug.add_nodes_from(id(n) for n in members)
        by_id = {id(n): n for n in members}
        ug.add_edges_from(_group_edges(members))
        order = {id(n): i for i, n in enumerate(scope.nodes)}
        components = sorted((sorted(c, key=order.get) for c in nx.connected_components(ug)), key=lambda c: order[c[0]])
        for component in components:
            nodes = [by_id[i] for i in component]
            # (a scope painting left alone, with no allow op, has no deny paint: its deny ops seed)
            if not any(n.meta.get("amp.deny_painted") or n.meta.get("amp.category") in _DENY for n in nodes):
                continue  # FP32 only because it is not between low ops: not forced, so not an island
            if not _borders_low(nodes, io_low):
                continue  # no low value enters or leaves it (a QuantizeLinear between FP32 QDQ units): no island
            island = Island(
                id=next_id,
                scope=scope_label(scope),
                members=[node_label(n) for n in nodes],
                seeds=[node_label(n) for n in nodes
                       if n.meta.get("amp.category") in _DENY and n.meta.get("amp.step") != "deny-spread"],
                pattern=recognise_pattern(nodes),
            )
            for n in nodes:
                n.meta["amp.island"] = next_id
            ctx.log.islands.append(island)
            next_id += 1
    return PassResult("islands", modified=False)


def changed_scopes(model: Model, ctx: Context) -> list[Graph]:
    """The scopes the rewrite changes: those with a low-precision node, and those reading a value
    that takes the low type from around them, whose FP32 readers a Cast then enters (an outer
    MatMul's output read by an Exp in an If branch that has no allow op; the output of an If the
    optimal placement made low), with the main graph under --no-keep-io-types once anything runs
    low (its inputs and outputs take the low type)."""
    scopes = list(model.graph.scopes())
    low = [any(precision(n) == Precision.LOW for n in scope.nodes) for scope in scopes]
    if not any(low):
        return []  # nothing runs low: the model is left as it is
    io_low = not ctx.options.keep_io_types
    out = []
    for scope, has_low in zip(scopes, low):
        if (has_low or (scope.parent is None and io_low)
                or any(v is not None and v.graph is not scope and _ends_low(v, io_low) and not accepts_any_float(n, k)
                       for n in scope.nodes for k, v in enumerate(n.inputs))
                or any(reader.graph is not scope and _reads_low(reader, k)
                       for n in scope.nodes for v in n.outputs for reader, k in v.uses())):
            # (the last: a low node in a body reads one of its values, through a Cast placed in the
            # body: an FP32 region of a scope with no low node of its own borders low all the same)
            out.append(scope)
    return out


def _reads_low(reader: Node, slot: int) -> bool:
    return participates(reader) and precision(reader) == Precision.LOW and slot in group_inputs(reader)


def _ends_low(value: Value, io_low: bool) -> bool:
    """Whether cast placement gives ``value`` the low type (a low node's painted output, a low If's
    output, a main-graph input under --no-keep-io-types)."""
    producer = value.producer
    if producer is None:
        return (io_low and value.is_graph_input and value.graph is not None and value.graph.parent is None
                and not value.is_initializer and value.dtype == DType.FLOAT and retypable_io(value))
    if value.is_constant:
        return False  # (converted offline for low readers only: an FP32 reader keeps the original)
    k = value.producer_index
    if k in producer.meta.get("amp.branch_outputs", ()):
        return True
    return participates(producer) and precision(producer) == Precision.LOW and k in group_outputs(producer)


def _borders_low(nodes: list[Node], io_low: bool) -> bool:
    """Whether a low value enters the region (a painted-group input that ends low) or one of its
    painted-group outputs leaves for a low reader (or a graph output that takes the low type): where
    a Cast goes, the region is an island in low precision; otherwise it is FP32 amid FP32."""
    for node in nodes:
        if any(node.inputs[k] is not None and _ends_low(node.inputs[k], io_low) for k in group_inputs(node)):
            return True
        for k in group_outputs(node):
            value = node.outputs[k]
            if io_low and value.is_graph_output and value.graph is not None and value.graph.parent is None:
                return True
            if _read_low(value, depth=0):
                return True
    return False


def _read_low(value: Value, depth: int) -> bool:
    """Whether a low node reads ``value`` in its painted group, directly or through the model's own
    Casts (a retargeted ``Cast(to=FLOAT)``: Llama's rotary cos/sin enter the FP16 attention so)."""
    for reader, slot in value.uses():  # (a reader in a body too: read there by FP32 nodes alone, no Cast enters)
        if _reads_low(reader, slot):
            return True
        if reader.op_type == "Cast" and reader.domain in ("", "ai.onnx") and depth < 4 \
                and any(_read_low(out, depth + 1) for out in reader.outputs):
            return True
    return False


def _group_edges(members: list[Node]) -> Iterator[tuple[int, int]]:
    """(producer id, consumer id) of every painted-group edge between ``members``, through the
    model's no-op ``Cast(to=FLOAT)`` of an FP32 value as painting sees it (deny paint crosses one: an
    island split there was half "seeded by -")."""
    outs = {id(n): group_outputs(n) for n in members}
    for node in members:
        for k in group_inputs(node):
            value = through_no_op_casts(node.inputs[k])
            producer = value.producer
            if producer is not None and id(producer) in outs and value.producer_index in outs[id(producer)]:
                yield id(producer), id(node)


# The op names each pattern is recognised by: ONNX's and the torch frontend's (aten and torch-level
# rule names, as fx_loader.canonical_name spells them; decomposed and fused spellings both). The two
# vocabularies never overlap, so an ONNX island is named as it was before torch names were added.
_LOSS = {"SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss",
         "cross_entropy", "cross_entropy_loss", "nll_loss", "nll_loss2d", "nll_loss_nd", "nll_loss_forward",
         "nll_loss2d_forward", "poisson_nll_loss", "gaussian_nll_loss", "kl_div", "l1_loss", "smooth_l1_loss",
         "huber_loss", "mse_loss", "binary_cross_entropy", "binary_cross_entropy_with_logits", "ctc_loss",
         "_ctc_loss", "margin_ranking_loss", "hinge_embedding_loss", "cosine_embedding_loss", "soft_margin_loss",
         "multilabel_margin_loss", "multilabel_soft_margin_loss", "multi_margin_loss", "triplet_margin_loss"}
_LOG_SOFTMAX = {"LogSoftmax", "log_softmax", "_log_softmax"}
_MEAN = {"ReduceMean", "mean"}
_SQUARE = {"Pow", "Mul", "pow", "mul", "square"}
_VARIANCE = {"var", "var_mean"}  # torch's mean of squared deviations in one op
_ROOT = {"Sqrt", "Reciprocal", "sqrt", "rsqrt", "reciprocal"}
_SUB = {"Sub", "sub"}
_NORMALISATION = {"LayerNormalization", "GroupNormalization", "InstanceNormalization", "BatchNormalization",
                  "layer_norm", "native_layer_norm", "rms_norm", "_fused_rms_norm", "group_norm",
                  "native_group_norm", "instance_norm", "batch_norm", "native_batch_norm", "_native_batch_norm_legit",
                  "_native_batch_norm_legit_no_training", "_native_batch_norm_legit_functional",
                  "cudnn_batch_norm", "local_response_norm"}
_EXP = {"Exp", "exp"}
_SUM = {"ReduceSum", "sum"}
_DIVIDE = {"Div", "Mul", "div", "mul"}
_SOFTMAX = {"Softmax", "LogSoftmax", "softmax", "_softmax", "log_softmax", "_log_softmax", "softmin"}
_REDUCTION = {"ReduceSum", "ReduceMean", "ReduceProd", "ReduceSumSquare", "ReduceL2", "ReduceLogSumExp", "CumSum",
              "sum", "nansum", "mean", "prod", "cumsum", "cumprod", "logcumsumexp", "logsumexp", "var", "std",
              "var_mean", "std_mean", "norm", "linalg_norm", "linalg_vector_norm", "frobenius_norm"}
_EXPONENTIAL = {"Exp", "Log", "Pow", "exp", "expm1", "log", "log2", "log10", "log1p", "pow"}


def recognise_pattern(nodes: list[Node]) -> str | None:
    names = {n.op_type for n in nodes}
    if names & _LOSS or (names & _LOG_SOFTMAX and len(nodes) > 1):
        return "loss"
    if (names & _MEAN and names & _SQUARE or names & _VARIANCE) and names & _ROOT:
        return "LayerNorm" if names & _SUB else "RMSNorm"
    if names & _NORMALISATION:
        return "normalisation"
    if names & _SOFTMAX or (names & _EXP and _decomposed_softmax(nodes)):
        return "softmax"
    if names & _REDUCTION:
        return "reduction"
    if names & _EXPONENTIAL:
        return "exponential"
    return None


def _decomposed_softmax(nodes: list[Node]) -> bool:
    """An Exp whose output a sum and a division (or product) in the island both read: exp(x) /
    sum(exp(x)). An Exp and a sum anywhere in the island named a GELU's backward pass beside a
    bias gradient's sum a softmax."""
    members = {id(n) for n in nodes}
    for node in nodes:
        if node.op_type in _EXP and node.outputs and node.outputs[0] is not None:
            readers = {r.op_type for r, _ in node.outputs[0].uses() if id(r) in members}
            if readers & _SUM and readers & _DIVIDE:
                return True
    return False


def attach_cast_counts(log: DecisionLog) -> None:
    """Count, per island, the casts that enter it and leave it (after cast placement)."""
    member_of: dict[str, int] = {}
    for island in log.islands:
        island.casts_in = island.casts_out = 0
        for m in island.members:
            member_of[m] = island.id
    by_id = {i.id: i for i in log.islands}
    for cast in log.casts:
        if cast.kind != "inserted":
            continue
        if cast.producer in member_of:
            by_id[member_of[cast.producer]].casts_out += 1
        entered = {member_of[c] for c in cast.consumers if c in member_of}
        for island_id in entered:
            by_id[island_id].casts_in += 1


def describe(island: Island) -> str:
    kind = f"{island.pattern} pattern" if island.pattern else "FP32 region"
    return (f"{kind}, {len(island.members)} node{'s' if len(island.members) != 1 else ''}, "
            f"{island.casts_in} cast{'s' if island.casts_in != 1 else ''} in, {island.casts_out} out")
