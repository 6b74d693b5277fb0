"""``--explain NODE``: why one node has its precision, followed back to the rule entries.

Runs the pipeline in memory (nothing is written), finds the node by exact name and prints its
reason chain: the node, the node its paint came from, and so on back to a node whose precision a
rule entry decided; then, for a node inside an FP32 island, the deny ops that seeded the island
with their rule entries, and the casts on the node's edges.
"""

from __future__ import annotations

import difflib
import os
from typing import Any

from .decisions import Decision
from .errors import UsageError
from .report import Report, _precision_name

_STEPS = {
    "classify": "decided by its rule entry",
    "allow": "allow op: always low precision",
    "deny-spread": "FP32 paint spread from a deny op",
    "between-allow": "sits between low-precision ops",
    "clear-spread": "moves data next to a low-precision op",
    "safety": "kept FP32 to avoid an FP32→low→FP32 round trip",
    "optimal": "re-decided by the min-cut placement (fewest bytes cast or moved in FP32)",
}


def _from_rule(source: str | None) -> bool:
    """Whether a decision's source is a rule entry: a rule file's "<file>: <list>.<op>", a command-line
    flag (--fp16-ops, --fp32-nodes ...), or the unlisted verdict; not one of classify's own checks."""
    return bool(source) and (": " in source or source.startswith("--") or source == "unlisted")


def explain_node(model_path: str | os.PathLike, node_name: str, **options: Any) -> str:
    """Explain ``node_name``'s precision in the rewrite of ``model_path`` (options as for
    ``rewrite_onnx``). Raises UsageError, naming the closest node names, if there is no such node."""
    from .api import context_for, run_pipeline
    from .frontends.onnx_loader import load_onnx
    from .passes.base import node_label

    from . import progress

    if not str(node_name).strip():
        raise UsageError("--explain needs a node name (or the name of a tensor it writes); got an empty one")
    # (rewrite_onnx's options about the file it writes mean nothing here: nothing is written)
    options = {k: v for k, v in options.items() if k not in ("overwrite", "external_data")}
    ctx = context_for("onnx", options, "explain_node()")
    with progress.stages(["load", "rewrite"], desc=os.path.basename(str(model_path))) as stage:
        stage("load")
        model = load_onnx(model_path, inline_functions=ctx.options.inline_functions)
        # tensor names as the user's model has them: the rewrite renames a value that goes low
        # (y → y/amp_fp16) and fusion removes producers, and "an output tensor name works too"
        producers = {o.name: n for n in model.graph.walk() for o in n.outputs if o is not None and o.name}
        stage("rewrite")
        run_pipeline(model, ctx)
    report = Report.from_log(ctx.log, source=str(model_path))
    nodes = {node_label(n): n for n in model.graph.walk() if not n.meta.get("amp.inserted")}
    casts = {c.name: c for c in ctx.log.casts}
    fused = {member: record for record in ctx.log.fusions for member in record.members}
    label = node_name  # (the text names what the user asked for; lookups use the label)
    if label not in nodes and label not in casts and label not in fused and label in producers:
        label = node_label(producers[label])
    if label in fused and label not in nodes:
        record = fused[label]
        text = (f"{node_name}: fused, with the rest of its {record.pattern} pattern, into {record.node} ({record.op}): "
                f"{record.reason} (--no-fuse keeps the pattern as it is)")
        return text + ("\n\n" + explain_decision(report, record.node) if record.node in report.log.decisions else "")
    clamps = _saturating_nodes(model, casts)
    if label in clamps and label not in nodes and label not in casts:
        kind, target = clamps[label]
        if kind == "cast":
            record = casts[target]
            return (f"{node_name}: inserted with {record.name}, to clamp {record.tensor!r} before that Cast (a "
                    f"number past the range, a mask sentinel, that the Cast would make ±inf)\n\n"
                    + _explain_cast(report, record))
        text = (f"{node_name}: inserted after {target}, to clamp its fp16 sum to ±65504 (it adds a mask sentinel "
                f"saturated to ±65504, and the sum with a score could overflow to ±inf)")
        return text + ("\n\n" + explain_decision(report, target) if target in report.log.decisions else "")
    name = _resolve(label, nodes, casts, model_path, also=[*fused, *clamps])
    if name in casts:
        return _explain_cast(report, casts[name])
    if name not in report.log.decisions:
        node = nodes[name]
        text = (f"{name} ({node.qualified_op}): unchanged — {node.meta.get('amp.reason') or 'no FP32 float tensor to paint'}; "
                f"its types are left as they are")
    else:
        text = explain_decision(report, name)
    # the main graph's node answers to the bare name; a body's node of that name is labelled with
    # its scope, and would otherwise go unmentioned
    others = [other for other, n in nodes.items() if n.name == name and other != name]
    if others:
        text += (f"\n\n({len(others)} other node(s) named {name!r}, in If/Loop/Scan bodies: ask for "
                 f"{', '.join(others)})")
    return text


def _saturating_nodes(model, casts: dict) -> dict[str, tuple[str, str]]:
    """The names of the nodes place_casts inserted to clamp (their kind ``saturate``): a Clip and
    its bound Constants before a Cast, each with ("cast", the Cast's name); a Clip (Max and Min
    before opset 12) and its bounds after an FP16 sum, with ("node", the sum's label)."""
    from .passes.base import node_label

    found: dict[str, tuple[str, str]] = {}
    for node in model.graph.walk():
        if node.meta.get("amp.inserted_kind") != "saturate" or not node.name:
            continue
        frontier, cast = [node], None
        for _ in range(2):  # Constant -> Clip -> Cast
            readers = [r for n in frontier for out in n.outputs if out is not None for r, _ in out.uses()]
            cast = next((r.name for r in readers if r.name in casts), None)
            if cast is not None:
                break
            frontier = readers
        if cast is not None:
            found[node.name] = ("cast", cast)
            continue
        clamp = node if node.op_type in ("Clip", "Max", "Min") else next(
            (r for out in node.outputs if out is not None for r, _ in out.uses() if r.op_type in ("Clip", "Max", "Min")),
            None)
        while clamp is not None and clamp.meta.get("amp.inserted_kind") == "saturate":
            source = clamp.inputs[0].producer if clamp.inputs and clamp.inputs[0] is not None else None
            if source is None or source.meta.get("amp.inserted_kind") != "saturate":
                if source is not None:
                    found[node.name] = ("node", node_label(source))
                break
            clamp = source  # (a Min after a Max: the sum is before both)
    return found


def _resolve(query: str, nodes: dict, casts: dict, model_path, also: list[str] = ()) -> str:
    """``also``: names that are no node of the rewritten graph but can be explained (fused nodes)."""
    if query in nodes or query in casts:
        return query
    # a body node whose name another scope uses too is labelled with its scope (If:y.then_branch/mm)
    scoped = [label for label, n in nodes.items() if n.name == query]
    if len(scoped) == 1:
        return scoped[0]
    if scoped:
        raise UsageError(f"--explain {query!r}: {len(scoped)} nodes of {model_path} have that name, in different "
                         f"scopes; ask for one by its label: {', '.join(scoped)}")
    by_output = [label for label, n in nodes.items() if any(o.name == query for o in n.outputs)]
    if len(by_output) == 1:
        return by_output[0]
    names = list(nodes) + list(casts) + list(also)
    close = difflib.get_close_matches(query, names, n=5, cutoff=0.5)
    if not close:
        close = [n for n in names if query.lower() in n.lower()][:5]
    hint = f"; closest: {', '.join(close)}" if close else ""
    raise UsageError(f"--explain {query!r}: no node of that name in {model_path}{hint}")


def explain_decision(report: Report, name: str) -> str:
    """The explanation text for a decided node of ``report``."""
    log = report.log
    d = log.decisions[name]
    lines = [f"{d.node} ({d.op}) computes in {_label(report, d)}",
             f"  category: {_category(d)}, from {d.source or '-'}"]
    chain = report.chain(name)
    lines.append("")
    lines.append("why:")
    for i, link in enumerate(chain):
        arrow = "  " if i == 0 else "  ← "
        step = _STEPS.get(link.step, link.step)
        if link.step == "classify" and link.source == "unlisted":
            step = "no rule entry names it at its opset: unlisted ops keep FP32"
        elif link.step == "classify" and not _from_rule(link.source):
            step = ("a check at classification, over its rule entry" if link.source in (None, "", "classify")
                    else f"decided by the {link.source}, over its rule entry")
        lines.append(f"{arrow}{link.node} ({link.op}) {_label(report, link)} [{link.step}: {step}]")
        lines.append(f"{' ' * len(arrow)}    {link.reason}")
    root = chain[-1]
    if _from_rule(root.source):
        lines.append(f"  rule entry: {root.source} ({_listed(root)})"
                     + (f" — {root.reason}" if root.step == "classify" and root is not d else ""))
    else:  # (a safety check of classify, the kernel table, the op's schema, the frontend: not a rule)
        by = "a check at classification" if root.source in (None, "", "classify") else f"the {root.source}"
        lines.append(f"  decided by: {by}, not a rule entry (the op's category: {_category(root)})"
                     + (f" — {root.reason}" if root.step == "classify" and root is not d else ""))
    if len(chain) > 1 and chain[-1].via and chain[-1].via not in log.decisions:
        lines.append(f"  (the chain continues at {chain[-1].via}, which has no decision)")
    if d.island is not None:
        island = next((i for i in log.islands if i.id == d.island), None)
        if island is not None:
            from .passes.islands import describe

            lines.append("")
            lines.append(f"FP32 island {island.id} ({island.scope}): {describe(island)}")
            lines.append("  seeded by:")
            for seed in island.seeds:
                s = log.decisions.get(seed)
                if s is not None:
                    listed = _list_of(s)
                    lines.append(f"    {s.node} ({s.op}): {_category(s)} rule {s.source} — {s.reason}"
                                 if listed in (None, _category(s)) else
                                 f"    {s.node} ({s.op}): {_category(s)}: {s.source} lists it {listed}, but {s.reason}")
            if name not in island.seeds and not any(link.node in island.seeds for link in chain):
                lines.append(f"  {name} joined it as an FP32 neighbour of the seeds (it is not between "
                             f"{log.target} ops), so the cast enters the island before it")
    edges = [c for c in log.casts if c.kind != "removed" and (c.producer == name or name in c.consumers)]
    if edges:
        lines.append("")
        lines.append("casts on its edges:")
        for c in edges:
            where = "out of" if c.producer == name else "into"
            lines.append(f"  {c.name}: {c.tensor} {c.src}→{c.dst} {where} {name}"
                         + (f", {c.numel} elements" if c.numel is not None else ""))
    return "\n".join(lines)


def _explain_cast(report: Report, c) -> str:
    lines = [f"{c.name}: Cast {c.kind} on {c.tensor} ({c.src}→{c.dst})",
             f"  edge: {c.producer or '<graph input/initializer>'} → {', '.join(c.consumers) or '-'}",
             f"  shape: {list(c.shape) if c.shape is not None else 'unknown'}"
             + (f", {c.numel} elements" if c.numel is not None else "")
             + (f", {c.bytes_per_run} bytes moved per run" if c.bytes_per_run is not None else "")
             + (f" (it runs {c.runs} times per model run: in a loop body)" if c.runs not in (None, 1) else "")
             + (", in a loop body whose trip count is not known statically" if c.runs is None else ""),
             f"  why: {c.reason}"]
    first = next((n for n in c.consumers if n in report.log.decisions), None)
    if first is not None:
        lines.append("")
        lines.append(explain_decision(report, first))
    return "\n".join(lines)


def _label(report: Report, d: Decision) -> str:
    return _precision_name(d.precision, report.log.target)


def _category(d: Decision) -> str:
    return getattr(d.category, "value", d.category) or "-"


def _listed(d: Decision) -> str:
    """The list the rule entry puts the op in, and the category the node took where that differs
    (an allow entry whose fp32_inputs pin an input sharing its type: held FP32, deny). 'deny Mul'
    next to 'allow.Mul' read as a contradiction."""
    category, listed = _category(d), _list_of(d)
    if listed not in (None, category):
        return f"{listed} {d.op}; this node is {category}: {d.reason}"
    return f"{category} {d.op}"


def _list_of(d: Decision) -> str | None:
    """The list of the rule entry ``d.source`` names (``<file>: <list>.<op>``), or None."""
    listed = (d.source or "").rsplit(": ", 1)[-1].split(".", 1)[0]
    return listed if listed in ("allow", "infer", "clear", "deny") else None
