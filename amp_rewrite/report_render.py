"""Report renderers beyond JSON: one self-contained HTML page and Markdown.

The HTML page needs no network: CSS and JS are inline and the report travels inside it as JSON
(node columns with interned strings, so a 10,000-node report stays a few MB). The summary and
the fixed tables are written here, in Python, so the key numbers are in the DOM before any script
runs; the script draws the precision picture on a canvas (nodes in topological order, coloured by
precision, islands as bands, casts as marks) and pages the node, cast and island views, so the
page stays responsive on large graphs.
"""

from __future__ import annotations

import html
import json
import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .report import Report


RENDERED_SUFFIXES = (".html", ".htm", ".md", ".markdown")  # (.json is Report.to_json)


def render(report: "Report", suffix: str) -> str | None:
    """The report as text in the format ``suffix`` names (RENDERED_SUFFIXES); None if unknown."""
    suffix = suffix.lower()
    if suffix in (".html", ".htm"):
        return render_html(report)
    if suffix in (".md", ".markdown"):
        return render_markdown(report)
    return None


# -- shared ------------------------------------------------------------------------------------------------
def _bytes(n: float | int | None) -> str:
    from .report import _bytes as fmt

    return fmt(n)


def _count_line(counts: dict[str, int]) -> str:
    return ", ".join(f"{n} {k}" for k, n in counts.items()) or "none"


def _num(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


# -- Markdown ----------------------------------------------------------------------------------------------
def _md(text: Any) -> str:
    """Text for a Markdown table cell or line: one line (CommonMark ends a line at \\r as at \\n),
    no raw HTML, no cell breaks, no inline syntax (a name with ``![x](url)`` would load an image,
    ``__add__`` would turn bold). Node names are arbitrary strings."""
    s = "" if text is None else str(text)
    s = s.replace("\r\n", " ").replace("\r", " ").replace("\n", " ")
    s = s.replace("&", "&amp;").replace("<", "&lt;")
    return _MD_SPECIAL.sub(lambda m: "\\" + m.group(0), s)


# (an underscore inside a word, as in ln_div, opens no emphasis in CommonMark: left as it is)
_MD_SPECIAL = re.compile(r"[\\|`*\[\]!~]|(?<![0-9A-Za-z])_|_(?![0-9A-Za-z])")


def _md_table(headers: list[str], rows: list[list[Any]]) -> list[str]:
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(_md(c) for c in row) + " |" for row in rows]
    return out


def render_markdown(report: "Report") -> str:
    d = report.to_dict()
    s = d["summary"]
    low = s["target"]
    w = s["weights"]
    heavy = s["heavy_ops"]
    al = s["alignment"]
    lines = ["# amp-rewrite report", ""]
    if d["source"] or d["output"]:
        lines += [f"{_md(d['source'] or '?')} → {_md(d['output'] or '?')}, target **{low}** "
                  f"(schema {d['schema_version']})", ""]
    lines += ["## Summary", ""]
    lines += _md_table(["", ""], [
        ["nodes", f"{s['nodes_total']} ({_count_line(s['nodes'])})"],
        [f"MatMul/Gemm/Conv/attention in {low}", f"{heavy['low']} of {heavy['total']}"],
        ["casts inserted", f"{s['casts_inserted']} ({_bytes(s['cast_bytes_per_run'])} per run"
                           + (f"; {s['casts_unknown_size']} of unknown size" if s["casts_unknown_size"] else "") + ")"],
        ["casts retargeted / removed / fused away",
         f"{s['casts_retargeted']} / {s['casts_removed']} / {s.get('casts_fused', 0)}"],
        ["FP32 islands", s["islands"]],
        ["weights", f"{_bytes(w['bytes_before'])} → {_bytes(w['bytes_after'])} ({w['converted']} tensors converted)"],
        ["values clamped / flushed to zero", f"{w['clamped']} / {w['flushed_to_zero']}"],
        ["tensor-core alignment", f"{al['misaligned']} misaligned, {al['aligned']} aligned, {al['unknown']} unknown "
                                  f"of {al['checked']}"],
        ["unlisted ops", ", ".join(f"{op} ×{n}" for op, n in s["unlisted_ops"].items()) or "none"],
    ])
    for k in heavy["kept_fp32"]:
        lines.append(f"- kept FP32: {_md(k['node'])} ({_md(k['op'])}): {_md(k['reason'])}")
    if d["check"] is not None:
        lines += ["", "## Accuracy check", ""]
        lines += _check_markdown(d["check"])
    if d.get("auto_fp32"):
        lines += ["", "## --auto-fp32", ""]
        lines += _check_markdown(d["auto_fp32"])
    if d["islands"]:
        lines += ["", "## FP32 islands", ""]
        lines += _md_table(["id", "scope", "pattern", "nodes", "casts in", "casts out", "seeded by (rule)"], [
            [i["id"], i["scope"], i["pattern"] or "-", len(i["members"]), i["casts_in"], i["casts_out"],
             "; ".join(f"{r['node']} ({r['source']})" for r in i["seed_rules"])] for i in d["islands"]])
        for i in d["islands"]:
            lines += ["", f"### Island {i['id']}: {i['description']}", "",
                      "members: " + ", ".join(_md(m) for m in i["members"])]
    if d["fusions"]:
        lines += ["", "## Fusions", "", "Decomposed patterns replaced by one fused op (the nodes they replaced are "
                  "no longer in the model):", ""]
        lines += _md_table(_FUSION_COLUMNS, _fusion_rows(d))
    if d["casts"]:
        lines += ["", "## Casts", ""]
        lines += _md_table(["cast", "kind", "tensor", "direction", "producer → consumers", "shape", "elements",
                            "runs", "bytes/run", "reason"], [
            [c["name"], c["kind"], c["tensor"], c["direction"],
             f"{c['producer'] or '(input)'} → {', '.join(c['consumers']) or '-'}",
             "?" if c["shape"] is None else "×".join(str(x) for x in c["shape"]) or "scalar",
             "?" if c["numel"] is None else c["numel"], "?" if c["runs"] is None else c["runs"],
             "?" if c["bytes_per_run"] is None else c["bytes_per_run"], c["reason"]] for c in d["casts"]])
    if d["alignment"]:
        lines += ["", "## Tensor-core alignment", "",
                  f"{low} tensor cores want GEMM dims and channel counts in multiples of 8.", ""]
        lines += _md_table(["node", "op", "dims", "not multiples of 8", "status"], [
            [a["node"], a["op"], ", ".join(f"{k}={v}" for k, v in a["dims"].items()), ", ".join(a["misaligned"]) or "-",
             a["status"]] for a in d["alignment"]])
    lines += ["", "## Weights", ""]
    lines += _md_table(["", ""], [[k, v] for k, v in _weight_rows(w)])
    if w["sentinels"]:
        lines += ["", "### Sentinel constants", ""]
        lines += _md_table(["tensor", "values", "min", "max"],
                           [[x["tensor"], x["count"], _num(x["min"]), _num(x["max"])] for x in w["sentinels"]])
    if d["notes"]:
        lines += ["", "## Notes", ""] + [f"- {_md(n)}" for n in d["notes"]]
    lines += ["", "## Nodes", ""]
    lines += _md_table(["node", "op", "category", "precision", "step", "via", "island", "rule", "reason"], [
        [n["node"], n["op"], n["category"], n["precision"], n["step"], n["via"] or "",
         "" if n["island"] is None else n["island"], n["rule"], n["reason"]] for n in d["nodes"]])
    return "\n".join(lines) + "\n"


def _check_markdown(check: dict) -> list[str]:
    lines = []
    if "passed" in check:
        lines.append(f"**{'passed' if check['passed'] else 'FAILED'}**"
                     + (f" (tolerance {check['tolerance']})" if "tolerance" in check else ""))
        lines.append("")
    for key, value in check.items():
        if key in ("passed", "tolerance"):
            continue
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            headers = list(dict.fromkeys(k for v in value for k in v))
            lines += ["", f"**{key}**", ""] + _md_table(headers, [[_num(v.get(h, "")) for h in headers] for v in value])
            lines.append("")
        else:
            lines.append(f"- {key}: {_md(json.dumps(value, default=str) if isinstance(value, (dict, list)) else value)}")
    return lines


# -- HTML --------------------------------------------------------------------------------------------------
def _e(text: Any) -> str:
    return html.escape("" if text is None else str(text), quote=True)


def _payload(d: dict[str, Any]) -> dict[str, Any]:
    """The report for the page's script: node fields as columns of indices into one string table."""
    strings: list[str] = []
    index: dict[str, int] = {}

    def intern(s: Any) -> int:
        if s is None:
            return -1
        s = str(s)
        if s not in index:
            index[s] = len(strings)
            strings.append(s)
        return index[s]

    nodes = d["nodes"]
    position = {n["node"]: i for i, n in enumerate(nodes)}
    columns = {
        "name": [n["node"] for n in nodes],
        "op": [intern(n["op"]) for n in nodes],
        "category": [intern(n["category"]) for n in nodes],
        "precision": [intern(n["precision"]) for n in nodes],
        "step": [intern(n["step"]) for n in nodes],
        "reason": [intern(n["reason"]) for n in nodes],
        "source": [intern(n["source"]) for n in nodes],
        "rule": [intern(n["rule"]) for n in nodes],
        "via": [position.get(n["via"], -1) if n["via"] else -1 for n in nodes],
        "via_name": [intern(n["via"]) if n["via"] and n["via"] not in position else -1 for n in nodes],
        "root": [position.get(n["root"], i) for i, n in enumerate(nodes)],
        "island": [-1 if n["island"] is None else n["island"] for n in nodes],
    }
    overflow = [[position[o["node"]], bool(o.get("root"))] for o in ((d.get("check") or {}).get("overflow") or [])
                if isinstance(o, dict) and o.get("node") in position]
    return {"target": d["summary"]["target"], "strings": strings, "nodes": columns, "casts": d["casts"],
            "islands": d["islands"], "alignment": d["alignment"], "overflow": overflow}


def _script_json(obj: Any) -> str:
    """JSON safe inside <script>: no '</script>', no HTML comment openers, no inf/nan."""
    text = json.dumps(obj, separators=(",", ":"), allow_nan=False, default=str, ensure_ascii=False)
    return (text.replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e")
            .replace("\u2028", "\\u2028").replace("\u2029", "\\u2029"))


def _card(card_id: str, value: Any, label: str, detail: str = "", cls: str = "", raw: Any = None) -> str:
    """A summary number; ``data-value`` holds it raw (bytes as an integer) for scripts and tests."""
    if raw is None:
        raw = value if isinstance(value, (int, float)) else ""
    return (f'<div class="card {cls}" id="{card_id}" data-value="{_e(raw)}"><div class="num">{_e(value)}</div>'
            f'<div class="lbl">{_e(label)}</div>' + (f'<div class="det">{_e(detail)}</div>' if detail else "") + "</div>")


def _summary_html(d: dict[str, Any]) -> str:
    s = d["summary"]
    low = s["target"]
    w = s["weights"]
    heavy = s["heavy_ops"]
    al = s["alignment"]
    counts = s["nodes"]
    saved = w["bytes_before"] - w["bytes_after"]
    cards = [
        _card("sum-nodes", s["nodes_total"], "nodes decided", _count_line(counts)),
        _card("sum-low", counts.get(low, 0), f"nodes in {low}", "", "low"),
        _card("sum-fp32", counts.get("fp32", 0), "nodes in fp32", "", "fp32"),
        _card("sum-heavy", f"{heavy['low']}/{heavy['total']}", f"MatMul/Gemm/Conv/attention in {low}",
              f"{len(heavy['kept_fp32'])} kept FP32" if heavy["kept_fp32"] else ""),
        _card("sum-casts", s["casts_inserted"], "casts inserted",
              f"{_bytes(s['cast_bytes_per_run'])} per run"
              + (f", {s['casts_unknown_size']} of unknown size" if s["casts_unknown_size"] else "")
              + (f"; {s['casts_retargeted']} retargeted" if s["casts_retargeted"] else "")
              + (f"; {s['casts_removed']} removed" if s["casts_removed"] else "")
              + (f"; {s['casts_fused']} fused away" if s.get("casts_fused") else "")),
        _card("sum-cast-bytes", _bytes(s["cast_bytes_per_run"]), "cast traffic per run",
              f"{s['cast_bytes_per_run']} bytes read + written", raw=s["cast_bytes_per_run"]),
        _card("sum-islands", s["islands"], "FP32 islands"),
        _card("sum-weights", _bytes(w["bytes_after"]), "weights after", f"from {_bytes(w['bytes_before'])}"
              + (f", {_bytes(saved)} saved" if saved > 0 else "") + f"; {w['converted']} tensors converted",
              raw=w["bytes_after"]),
        _card("sum-clamped", w["clamped"], "values clamped", f"{w['flushed_to_zero']} flushed to zero"),
        _card("sum-unlisted", sum(s["unlisted_ops"].values()), "unlisted-op nodes",
              ", ".join(s["unlisted_ops"]) if s["unlisted_ops"] else "every op has a rule",
              "warn" if s["unlisted_ops"] else ""),
        _card("sum-misaligned", al["misaligned"], "GEMM/conv dims not multiple of 8",
              f"of {al['checked']} {low} MatMul/Gemm/Conv; {al['unknown']} unknown", "warn" if al["misaligned"] else ""),
        _card("sum-sentinels", len(w["sentinels"]), "tensors with sentinels", "−1e9 masks, ±inf",
              "warn" if w["sentinels"] else ""),
    ]
    check = d["check"]
    if check is not None and "passed" in check:
        cards.append(_card("sum-check", "passed" if check["passed"] else "FAILED", "accuracy check",
                           f"tolerance {check.get('tolerance', '?')}", "ok" if check["passed"] else "bad"))
    return "\n".join(cards)


_FUSION_COLUMNS = ["fused node", "op", "pattern", "precision", "replaced", "reason"]


def _fusion_rows(d: dict[str, Any]) -> list[list[str]]:
    precision = {n["node"]: n["precision"] for n in d["nodes"]}
    return [[f["node"], f["op"], f["pattern"], precision.get(f["node"], "?"), ", ".join(f["members"]), f["reason"]]
            for f in d["fusions"]]


def _fusions_html(d: dict[str, Any]) -> str:
    """The fused nodes and the nodes each replaced: those names are in no other table, so a search
    of the page for a node of the input model finds it here."""
    if not d["fusions"]:
        return '<p class="muted">No fusions.</p>'
    head = "".join(f"<th>{_e(c)}</th>" for c in _FUSION_COLUMNS)
    rows = "".join("<tr>" + "".join(f"<td>{_e(c)}</td>" for c in row) + "</tr>" for row in _fusion_rows(d))
    return ('<p class="help">Decomposed patterns replaced by one fused op; the nodes they replaced are no longer '
            f'in the model.</p><table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>')


def _weight_rows(w: dict[str, Any]) -> list[tuple[str, Any]]:
    """The Weights section's rows, in the HTML and the Markdown report alike."""
    return [("bytes before", f"{w['bytes_before']} ({_bytes(w['bytes_before'])})"),
            ("bytes after", f"{w['bytes_after']} ({_bytes(w['bytes_after'])})"),
            ("tensors converted", w["converted"]), ("elements converted", w["converted_elements"]),
            ("values clamped at the type's limit", w["clamped"]), ("values flushed to zero", w["flushed_to_zero"]),
            ("initializers duplicated (FP32 + low copy)", w["duplicated"])]


def _weights_html(d: dict[str, Any]) -> str:
    s = d["summary"]
    w = s["weights"]
    rows = _weight_rows(w)
    out = ['<table class="kv" id="weights-table">'] + [f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in rows]
    out.append("</table>")
    if w["sentinels"]:
        out.append('<h3>Sentinel constants</h3><table class="grid" id="sentinels-table"><thead><tr><th>tensor</th>'
                   "<th>values</th><th>min</th><th>max</th></tr></thead><tbody>")
        out += [f"<tr><td>{_e(x['tensor'])}</td><td>{_e(x['count'])}</td><td>{_e(_num(x['min']))}</td>"
                f"<td>{_e(_num(x['max']))}</td></tr>" for x in w["sentinels"]]
        out.append("</tbody></table>")
    if s["unlisted_ops"]:
        out.append('<h3>Unlisted ops (kept FP32)</h3><p>No rule names these ops; classify them in a rule file '
                   '(<code>--rules</code>).</p><table class="grid" id="unlisted-table"><thead><tr><th>op</th>'
                   "<th>nodes</th></tr></thead><tbody>")
        out += [f"<tr><td>{_e(op)}</td><td>{_e(n)}</td></tr>" for op, n in s["unlisted_ops"].items()]
        out.append("</tbody></table>")
    heavy = s["heavy_ops"]["kept_fp32"]
    if heavy:
        out.append('<h3>MatMul/Gemm/Conv kept FP32</h3><table class="grid"><thead><tr><th>node</th><th>op</th>'
                   "<th>reason</th></tr></thead><tbody>")
        out += [f"<tr><td>{_e(k['node'])}</td><td>{_e(k['op'])}</td><td>{_e(k['reason'])}</td></tr>" for k in heavy]
        out.append("</tbody></table>")
    return "\n".join(out)


def _check_html(check: dict[str, Any] | None) -> str:
    if check is None:
        return '<p class="muted" id="check-none">--check did not run.</p>'
    out = []
    if "passed" in check:
        out.append(f'<p id="check-result" class="{"ok" if check["passed"] else "bad"}"><b>'
                   f'{"passed" if check["passed"] else "FAILED"}</b>'
                   + (f" (tolerance {_e(check['tolerance'])})" if "tolerance" in check else "") + "</p>")
    for key, value in check.items():
        if key in ("passed", "tolerance"):
            continue
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            headers = list(dict.fromkeys(k for v in value for k in v))
            out.append(f"<h3>{_e(key)}</h3><table class=\"grid\"><thead><tr>"
                       + "".join(f"<th>{_e(h)}</th>" for h in headers) + "</tr></thead><tbody>")
            out += ["<tr>" + "".join(f"<td>{_e(_num(v.get(h, '')))}</td>" for h in headers) + "</tr>" for v in value]
            out.append("</tbody></table>")
        else:
            text = json.dumps(value, default=str) if isinstance(value, (dict, list)) else value
            out.append(f"<p><b>{_e(key)}</b>: {_e(text)}</p>")
    return "\n".join(out)


def _auto_fp32_html(auto: dict[str, Any] | None) -> str:
    if not auto:
        return ""
    return '<h3 id="auto-fp32">--auto-fp32</h3>' + _check_html(auto)


def render_html(report: "Report") -> str:
    d = report.to_dict()
    s = d["summary"]
    title = f"amp-rewrite report — {d['output'] or d['source'] or 'in-memory model'}"
    sub = (f"{_e(d['source'] or '?')} → {_e(d['output'] or '?')} · target <b>{_e(s['target'])}</b> · "
           f"schema {_e(d['schema_version'])}")
    notes = "".join(f"<li>{_e(n)}</li>" for n in d["notes"])
    parts = {
        "TITLE": _e(title),
        "SUBTITLE": sub,
        "TARGET": _e(s["target"]),
        "SUMMARY": _summary_html(d),
        "WEIGHTS": _weights_html(d),
        "FUSIONS": _fusions_html(d),
        "CHECK": _check_html(d["check"]) + _auto_fp32_html(d.get("auto_fp32")),
        "NOTES": f"<ul>{notes}</ul>" if notes else '<p class="muted">none</p>',
        "CSS": _CSS,
        "JS": _JS,
        "DATA": _script_json(_payload(d)),
    }
    # One pass over the template: text filled in (a node named %%JS%%) is never scanned again.
    return _PLACEHOLDER.sub(lambda m: parts[m.group(1)], _TEMPLATE)


_PLACEHOLDER = re.compile(r"%%([A-Z]+)%%")


_TEMPLATE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta name="generator" content="amp-rewrite">
<link rel="icon" href="data:,">
<title>%%TITLE%%</title>
<style>%%CSS%%</style>
</head>
<body>
<header>
  <h1>amp-rewrite report</h1>
  <div class="sub">%%SUBTITLE%%</div>
  <nav>
    <a href="#summary">Summary</a><a href="#picture">Precision picture</a><a href="#nodes">Nodes</a>
    <a href="#casts">Casts</a><a href="#islands">Islands</a><a href="#fusions">Fusions</a><a href="#alignment">Tensor cores</a>
    <a href="#weights">Weights</a><a href="#check">Check</a><a href="#notes">Notes</a>
  </nav>
</header>
<main>
<section id="summary">
  <h2>Summary</h2>
  <div class="cards">%%SUMMARY%%</div>
</section>
<section id="picture">
  <h2>Precision along the graph</h2>
  <p class="help">Every decided node in topological order, left to right and wrapping like text.
  Colour: precision. Band under a node: its FP32 island. Marks under it: a Cast after it
  (&#9650; into %%TARGET%%, &#9660; into fp32). Hover for the node, click for why.</p>
  <div class="legend" id="legend"></div>
  <div class="stripwrap" id="stripwrap"><canvas id="strip" aria-label="precision of every node along the graph"></canvas>
  <div id="tip" class="tip" hidden></div></div>
  <div id="detail" class="detail"><p class="muted">Click a node in the picture or in the table to see why it has its precision.</p></div>
</section>
<section id="nodes">
  <h2>Nodes</h2>
  <div class="controls">
    <input id="node-search" type="search" placeholder="search name, op, rule, reason" aria-label="search nodes">
    <select id="node-prec" aria-label="precision"><option value="">any precision</option></select>
    <select id="node-cat" aria-label="category"><option value="">any category</option></select>
    <select id="node-island" aria-label="island"><option value="">any island</option><option value="in">in an island</option></select>
    <span id="node-count" class="muted"></span>
  </div>
  <div id="node-table"></div>
</section>
<section id="casts">
  <h2>Casts</h2>
  <div class="controls"><input id="cast-search" type="search" placeholder="search cast, tensor, node" aria-label="search casts">
  <span id="cast-count" class="muted"></span></div>
  <div id="cast-table"></div>
</section>
<section id="islands">
  <h2>FP32 islands</h2>
  <div class="controls"><input id="island-search" type="search" placeholder="search pattern, member, seed" aria-label="search islands">
  <span id="island-count" class="muted"></span></div>
  <div id="island-list"></div>
</section>
<section id="fusions">
  <h2>Fusions</h2>
  %%FUSIONS%%
</section>
<section id="alignment">
  <h2>Tensor-core alignment</h2>
  <p class="help">%%TARGET%% tensor cores run GEMMs and convolutions fastest when M, N, K and channel counts are multiples of 8.</p>
  <div id="align-table"></div>
</section>
<section id="weights">
  <h2>Weights</h2>
  %%WEIGHTS%%
</section>
<section id="check">
  <h2>Accuracy check</h2>
  %%CHECK%%
</section>
<section id="notes">
  <h2>Notes</h2>
  %%NOTES%%
</section>
</main>
<script type="application/json" id="amp-data">%%DATA%%</script>
<script>%%JS%%</script>
</body>
</html>
"""

_CSS = r"""
:root { --low:#2563eb; --fp32:#ea580c; --none:#cbd5e1; --ink:#0f172a; --muted:#64748b; --line:#e2e8f0; --bg:#f8fafc; }
* { box-sizing: border-box; }
body { margin:0; font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,"DejaVu Sans",sans-serif; color:var(--ink); background:var(--bg); }
header { background:#0f172a; color:#f8fafc; padding:14px 24px 0; position:sticky; top:0; z-index:5; }
header h1 { margin:0; font-size:20px; }
header .sub { color:#cbd5e1; font-size:13px; margin:2px 0 8px; word-break:break-all; }
nav a { color:#e2e8f0; text-decoration:none; display:inline-block; padding:6px 10px; font-size:13px; border-bottom:2px solid transparent; }
nav a:hover { border-color:#60a5fa; }
main { padding:8px 24px 48px; max-width:1600px; margin:0 auto; }
section { background:#fff; border:1px solid var(--line); border-radius:8px; padding:12px 16px; margin:16px 0; scroll-margin-top:96px; }
h2 { margin:0 0 10px; font-size:17px; }
h3 { font-size:15px; margin:14px 0 6px; }
.cards { display:grid; grid-template-columns:repeat(auto-fill,minmax(190px,1fr)); gap:10px; }
.card { border:1px solid var(--line); border-radius:8px; padding:10px 12px; background:#fff; }
.card .num { font-size:24px; font-weight:650; }
.card .lbl { color:var(--muted); font-size:12px; text-transform:uppercase; letter-spacing:.03em; overflow-wrap:anywhere; }
.card .det { font-size:12px; color:#334155; margin-top:2px; word-break:break-word; }
.card.low .num { color:var(--low); } .card.fp32 .num { color:var(--fp32); }
.card.warn { border-color:#fbbf24; background:#fffbeb; } .card.ok { border-color:#22c55e; background:#f0fdf4; }
.card.bad { border-color:#ef4444; background:#fef2f2; }
.help, .muted { color:var(--muted); font-size:13px; }
.legend { display:flex; flex-wrap:wrap; gap:14px; font-size:13px; margin:6px 0; }
.legend span.sw { display:inline-block; width:14px; height:14px; border-radius:3px; vertical-align:-2px; margin-right:5px; }
.stripwrap { position:relative; width:100%; border:1px solid var(--line); border-radius:6px; padding:6px; background:#fff; }
canvas#strip { display:block; cursor:crosshair; }
.tip { position:absolute; pointer-events:none; background:#0f172a; color:#f8fafc; font-size:12px; padding:6px 8px; border-radius:6px; max-width:420px; z-index:3; box-shadow:0 2px 8px rgba(0,0,0,.25); }
.detail { margin-top:10px; border-left:3px solid var(--line); padding:4px 12px; }
.detail .link { margin:4px 0; } .detail .why { color:#334155; margin-left:18px; font-size:13px; }
.controls { display:flex; flex-wrap:wrap; gap:8px; align-items:center; margin-bottom:8px; }
.controls input[type=search] { min-width:280px; padding:5px 8px; border:1px solid #cbd5e1; border-radius:6px; font:inherit; }
.controls select { padding:4px 6px; border:1px solid #cbd5e1; border-radius:6px; font:inherit; background:#fff; }
table { border-collapse:collapse; }
table.grid { width:100%; font-size:13px; }
table.grid th, table.grid td { border-bottom:1px solid var(--line); padding:4px 6px; text-align:left; vertical-align:top; }
table.grid th { background:#f1f5f9; position:sticky; top:0; }
table.grid th.sortable { cursor:pointer; user-select:none; white-space:nowrap; }
table.grid th.sortable:after { content:" \2195"; color:#94a3b8; }
table.grid th.asc:after { content:" \25B2"; color:var(--ink); } table.grid th.desc:after { content:" \25BC"; color:var(--ink); }
table.grid td.reason { max-width:520px; color:#334155; }
table.grid tr.sel td { background:#eff6ff; }
table.grid tbody tr:hover td { background:#f8fafc; cursor:pointer; }
table.kv th { text-align:left; font-weight:500; color:var(--muted); padding:3px 16px 3px 0; }
.pill { display:inline-block; padding:0 7px; border-radius:10px; font-size:12px; color:#fff; }
.pill.p-fp16, .pill.p-bf16 { background:var(--low); } .pill.p-fp32 { background:var(--fp32); } .pill.p-unchanged { background:#94a3b8; }
.pager { display:flex; gap:6px; align-items:center; margin-top:6px; font-size:13px; }
.pager button { font:inherit; padding:2px 10px; border:1px solid #cbd5e1; background:#fff; border-radius:5px; cursor:pointer; }
.pager button:disabled { opacity:.4; cursor:default; }
details.island { border:1px solid var(--line); border-radius:6px; margin:6px 0; padding:4px 10px; }
details.island summary { cursor:pointer; padding:3px 0; }
details.island .chips span { display:inline-block; border:1px solid var(--line); border-radius:4px; padding:0 5px; margin:2px; font-size:12px; cursor:pointer; }
details.island .chips span.seed { border-color:var(--fp32); background:#fff7ed; }
code { background:#f1f5f9; padding:0 3px; border-radius:3px; }
.ok { color:#15803d; } .bad { color:#b91c1c; }
"""

_JS = r"""
(function () {
"use strict";
var D = JSON.parse(document.getElementById("amp-data").textContent);
var S = D.strings, N = D.nodes, n = N.name.length, TARGET = D.target;
var COLORS = {fp16: "#2563eb", bf16: "#7c3aed", fp32: "#ea580c", unchanged: "#cbd5e1"};
var ISLAND = ["#a21caf", "#0d9488", "#b45309", "#be123c", "#4d7c0f", "#1d4ed8", "#7c2d12", "#0369a1"];
function str(i) { return i < 0 ? "" : S[i]; }
function esc(s) { return String(s == null ? "" : s).replace(/[&<>"']/g, function (c) {
  return {"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"}[c]; }); }
function $(id) { return document.getElementById(id); }
function fmtBytes(b) { if (b == null) return "?"; var u = ["B", "KiB", "MiB", "GiB"], i = 0;
  while (b >= 1024 && i < 3) { b /= 1024; i++; } return (i ? b.toFixed(1) : b) + " " + u[i]; }
function pill(p) { return '<span class="pill p-' + esc(p) + '">' + esc(p) + "</span>"; }
function islandColor(id) { return ISLAND[id % ISLAND.length]; }

var byName = new Map();
for (var i = 0; i < n; i++) byName.set(N.name[i], i);
var castsOf = new Map();  // node index -> cast indices on its edges
var marks = [];           // {pos, toLow}
D.casts.forEach(function (c, k) {
  var pos = -1;
  if (c.producer != null && byName.has(c.producer)) pos = byName.get(c.producer);
  var touched = [];
  if (pos >= 0) touched.push(pos);
  c.consumers.forEach(function (name) { if (byName.has(name)) touched.push(byName.get(name)); });
  touched.forEach(function (t) { if (!castsOf.has(t)) castsOf.set(t, []); castsOf.get(t).push(k); });
  if (c.kind === "removed") return;
  if (pos < 0) pos = touched.length ? Math.min.apply(null, touched) : 0;  // from an input: at its first reader
  marks.push({pos: pos, toLow: c.dst !== "fp32", k: k});
});
var islandById = new Map();
D.islands.forEach(function (isl) { islandById.set(isl.id, isl); });

// ---- legend ----------------------------------------------------------------------------------------
(function legend() {
  var counts = {};
  for (var i = 0; i < n; i++) { var p = str(N.precision[i]); counts[p] = (counts[p] || 0) + 1; }
  var html = "";
  [TARGET, "fp32", "unchanged"].forEach(function (p) {
    html += '<span><span class="sw" style="background:' + COLORS[p] + '"></span>' + esc(p) + " (" + (counts[p] || 0) + ")</span>";
  });
  html += '<span><span class="sw" style="background:' + ISLAND[0] + ';height:5px;vertical-align:2px"></span>FP32 island band (' + D.islands.length + ")</span>";
  html += "<span>&#9650; cast into " + esc(TARGET) + " &nbsp;&#9660; cast into fp32 (" + marks.length + ")</span>";
  if (D.overflow.length) html += '<span><span class="sw" style="border:3px solid #dc2626;background:none"></span>' +
    "overflow found by --check (" + D.overflow.length + ", thick: where it starts)</span>";
  $("legend").innerHTML = html;
})();

// ---- precision picture (canvas) --------------------------------------------------------------------
var ROW = 32, CELL_H = 14, layout = null, selected = -1, selectedIsland = -1;
function drawStrip() {
  var canvas = $("strip"), wrap = $("stripwrap");
  var width = Math.max(320, wrap.clientWidth - 14);
  var cell = Math.max(3, Math.min(36, Math.floor(width / Math.max(1, n))));
  var perRow = Math.max(1, Math.floor(width / cell));
  var rows = Math.max(1, Math.ceil(n / perRow));
  var height = rows * ROW;
  var dpr = window.devicePixelRatio || 1;
  canvas.width = Math.round(width * dpr); canvas.height = Math.round(height * dpr);
  canvas.style.width = width + "px"; canvas.style.height = height + "px";
  var ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, width, height);
  var gap = cell > 5 ? 1 : 0;
  layout = {cell: cell, perRow: perRow, rows: rows, width: width};
  for (var i = 0; i < n; i++) {
    var x = (i % perRow) * cell, y = Math.floor(i / perRow) * ROW;
    ctx.fillStyle = COLORS[str(N.precision[i])] || "#999";
    ctx.fillRect(x, y, cell - gap, CELL_H);
    var isl = N.island[i];
    if (isl >= 0) {
      ctx.fillStyle = islandColor(isl);
      ctx.fillRect(x, y + CELL_H + 2, cell, selectedIsland === isl ? 7 : 5);
    }
  }
  D.overflow.forEach(function (o) {  // --check found inf/NaN here in the low type; root: where it starts
    var x = (o[0] % perRow) * cell, y = Math.floor(o[0] / perRow) * ROW;
    ctx.strokeStyle = "#dc2626"; ctx.lineWidth = o[1] ? 3 : 1.5;
    ctx.strokeRect(x + 0.5, y + 0.5, Math.max(cell - 1, 2), CELL_H - 1);
  });
  marks.forEach(function (m) {
    var x = (m.pos % perRow) * cell + cell / 2, y = Math.floor(m.pos / perRow) * ROW + CELL_H + 10;
    var r = Math.max(2.5, Math.min(5, cell / 2));
    ctx.fillStyle = m.toLow ? "#1e3a8a" : "#9a3412";
    ctx.beginPath();
    if (m.toLow) { ctx.moveTo(x, y); ctx.lineTo(x - r, y + 6); ctx.lineTo(x + r, y + 6); }
    else { ctx.moveTo(x - r, y); ctx.lineTo(x + r, y); ctx.lineTo(x, y + 6); }
    ctx.closePath(); ctx.fill();
  });
  if (selected >= 0) {
    var sx = (selected % perRow) * cell, sy = Math.floor(selected / perRow) * ROW;
    ctx.strokeStyle = "#0f172a"; ctx.lineWidth = 2;
    ctx.strokeRect(sx - 1, sy - 1, Math.max(cell, 3) + 1, CELL_H + 2);
  }
}
function hit(ev) {
  if (!layout) return -1;
  var rect = $("strip").getBoundingClientRect();
  var x = ev.clientX - rect.left, y = ev.clientY - rect.top;
  var col = Math.floor(x / layout.cell), row = Math.floor(y / ROW);
  if (col < 0 || col >= layout.perRow || row < 0) return -1;
  var i = row * layout.perRow + col;
  return i < n ? i : -1;
}
$("strip").addEventListener("mousemove", function (ev) {
  var i = hit(ev), tip = $("tip");
  if (i < 0) { tip.hidden = true; return; }
  var isl = N.island[i];
  tip.innerHTML = "<b>" + esc(N.name[i]) + "</b> (" + esc(str(N.op[i])) + ") " + pill(str(N.precision[i])) +
    "<br>" + esc(str(N.category[i])) + " · " + esc(str(N.step[i])) + (isl >= 0 ? " · island " + isl : "") +
    ((castsOf.get(i) || []).length ? " · " + castsOf.get(i).length + " cast(s)" : "");
  var wrap = $("stripwrap").getBoundingClientRect();
  tip.style.left = Math.min(ev.clientX - wrap.left + 12, wrap.width - 300) + "px";
  tip.style.top = (ev.clientY - wrap.top + 14) + "px";
  tip.hidden = false;
});
$("strip").addEventListener("mouseleave", function () { $("tip").hidden = true; });
$("strip").addEventListener("click", function (ev) { var i = hit(ev); if (i >= 0) select(i, false); });
var resizeTimer = null;
window.addEventListener("resize", function () { clearTimeout(resizeTimer); resizeTimer = setTimeout(drawStrip, 120); });

// ---- why panel --------------------------------------------------------------------------------------
function nodeLink(i) { return '<a href="#picture" data-node="' + i + '">' + esc(N.name[i]) + "</a>"; }
function select(i, scroll) {
  selected = i;
  drawStrip();
  var html = "<h3>" + esc(N.name[i]) + " (" + esc(str(N.op[i])) + ") " + pill(str(N.precision[i])) + "</h3>";
  html += '<div class="muted">category ' + esc(str(N.category[i])) + ", from " + esc(str(N.source[i])) + "</div>";
  var seen = new Set(), cur = i, first = true;
  while (cur >= 0 && !seen.has(cur)) {
    seen.add(cur);
    html += '<div class="link">' + (first ? "" : "&larr; ") + nodeLink(cur) + " (" + esc(str(N.op[cur])) + ") " +
      pill(str(N.precision[cur])) + " [" + esc(str(N.step[cur])) + ']<div class="why">' + esc(str(N.reason[cur])) + "</div></div>";
    first = false;
    if (N.via[cur] < 0 && N.via_name[cur] >= 0) html += '<div class="muted">&larr; ' + esc(str(N.via_name[cur])) + " (no decision)</div>";
    cur = N.via[cur];
  }
  html += "<div>rule entry: <code>" + esc(str(N.rule[i])) + "</code></div>";
  var isl = N.island[i];
  if (isl >= 0 && islandById.has(isl)) {
    var I = islandById.get(isl);
    html += "<div>FP32 island " + isl + ": " + esc(I.description) + "; seeded by " +
      I.seed_rules.map(function (r) { return esc(r.node) + " (<code>" + esc(r.source) + "</code>)"; }).join(", ") + "</div>";
  }
  var cs = castsOf.get(i) || [];
  if (cs.length) {
    html += "<div>casts on its edges: " + cs.map(function (k) { var c = D.casts[k];
      return "<code>" + esc(c.name) + "</code> " + esc(c.direction) + (c.kind !== "inserted" ? " (" + esc(c.kind) + ")" : ""); }).join("; ") + "</div>";
  }
  $("detail").innerHTML = html;
  nodeTable.highlight(i);
  if (scroll) $("picture").scrollIntoView();
}
document.addEventListener("click", function (ev) {
  var t = ev.target.closest ? ev.target.closest("[data-node]") : null;
  if (t) { ev.preventDefault(); select(+t.getAttribute("data-node"), true); }
});

// ---- sortable, filterable, paged table --------------------------------------------------------------
function Table(el, columns, count, get, opts) {
  opts = opts || {};
  var self = this, page = 0, size = opts.pageSize || 100, sortKey = null, sortDir = 1;
  var rows = [], filter = null, selectedRow = -1;
  var allRows = []; for (var r = 0; r < count; r++) allRows.push(r);
  el.innerHTML = '<table class="grid"><thead><tr>' + columns.map(function (c, k) {
    return '<th class="sortable" data-col="' + k + '">' + esc(c.label) + "</th>"; }).join("") +
    '</tr></thead><tbody></tbody></table><div class="pager"><button data-p="first">&laquo;</button>' +
    '<button data-p="prev">&lsaquo; prev</button><span class="pageinfo"></span><button data-p="next">next &rsaquo;</button>' +
    '<button data-p="last">&raquo;</button><select class="size"><option>50</option><option selected>100</option>' +
    "<option>500</option></select></div>";
  var tbody = el.querySelector("tbody"), info = el.querySelector(".pageinfo");
  el.querySelector(".size").value = String(size);
  el.querySelector("thead").addEventListener("click", function (ev) {
    var th = ev.target.closest("th"); if (!th) return;
    var k = +th.getAttribute("data-col");
    if (sortKey === k) sortDir = -sortDir; else { sortKey = k; sortDir = 1; }
    el.querySelectorAll("th").forEach(function (h) { h.classList.remove("asc", "desc"); });
    th.classList.add(sortDir > 0 ? "asc" : "desc");
    self.refresh();
  });
  el.querySelector(".pager").addEventListener("click", function (ev) {
    var p = ev.target.getAttribute && ev.target.getAttribute("data-p"); if (!p) return;
    var last = Math.max(0, Math.ceil(rows.length / size) - 1);
    page = p === "first" ? 0 : p === "prev" ? Math.max(0, page - 1) : p === "next" ? Math.min(last, page + 1) : last;
    self.render();
  });
  el.querySelector(".size").addEventListener("change", function (ev) { size = +ev.target.value; page = 0; self.render(); });
  tbody.addEventListener("click", function (ev) {
    var tr = ev.target.closest("tr"); if (!tr || !opts.onRow || ev.target.closest("a")) return;
    opts.onRow(+tr.getAttribute("data-row"));
  });
  this.setFilter = function (fn) { filter = fn; page = 0; self.refresh(); };
  this.refresh = function () {
    rows = filter ? allRows.filter(filter) : allRows.slice();
    if (sortKey !== null) {
      var c = columns[sortKey];
      var key = rows.map(function (r) { return [get(r, c.key), r]; });
      key.sort(function (a, b) {
        var x = a[0], y = b[0];
        if (c.num) { x = x == null ? -Infinity : +x; y = y == null ? -Infinity : +y; return (x - y) * sortDir || a[1] - b[1]; }
        x = String(x == null ? "" : x); y = String(y == null ? "" : y);
        return (x < y ? -1 : x > y ? 1 : 0) * sortDir || a[1] - b[1];
      });
      rows = key.map(function (p) { return p[1]; });
    }
    self.render();
    if (opts.onCount) opts.onCount(rows.length, count);
  };
  this.render = function () {
    var pages = Math.max(1, Math.ceil(rows.length / size));
    if (page >= pages) page = pages - 1;
    var html = [];
    for (var j = page * size; j < Math.min(rows.length, (page + 1) * size); j++) {
      var r = rows[j];
      html.push('<tr data-row="' + r + '"' + (r === selectedRow ? ' class="sel"' : "") + ">" + columns.map(function (c) {
        var v = get(r, c.key);
        return "<td" + (c.cls ? ' class="' + c.cls + '"' : "") + ">" + (c.render ? c.render(v, r) : esc(v)) + "</td>";
      }).join("") + "</tr>");
    }
    tbody.innerHTML = html.join("");
    info.textContent = rows.length ? "page " + (page + 1) + " of " + pages + " (" + rows.length + " rows)" : "no rows";
  };
  this.highlight = function (r) {
    selectedRow = r;
    var at = rows.indexOf(r);
    if (at >= 0) page = Math.floor(at / size);
    self.render();
  };
  this.refresh();
}

// ---- nodes -------------------------------------------------------------------------------------------
var nodeCols = [
  {key: "idx", label: "#", num: true},
  {key: "name", label: "node", render: function (v, r) { return nodeLink(r); }},
  {key: "op", label: "op"}, {key: "category", label: "category"},
  {key: "precision", label: "precision", render: function (v) { return pill(v); }},
  {key: "step", label: "step"},
  {key: "via", label: "via", render: function (v, r) { return N.via[r] >= 0 ? nodeLink(N.via[r]) : esc(v); }},
  {key: "island", label: "island", num: true},
  {key: "rule", label: "rule entry"}, {key: "reason", label: "reason", cls: "reason"}];
function nodeGet(r, key) {
  switch (key) {
    case "idx": return r; case "name": return N.name[r];
    case "via": return N.via[r] >= 0 ? N.name[N.via[r]] : str(N.via_name[r]);
    case "island": return N.island[r] >= 0 ? N.island[r] : null;
    default: return str(N[key][r]);
  }
}
var nodeTable = new Table($("node-table"), nodeCols, n, nodeGet, {
  onRow: function (r) { select(r, true); },
  onCount: function (shown, total) { $("node-count").textContent = shown + " of " + total + " nodes"; }});
(function nodeFilters() {
  var precs = new Set(), cats = new Set();
  for (var i = 0; i < n; i++) { precs.add(str(N.precision[i])); cats.add(str(N.category[i])); }
  precs.forEach(function (p) { $("node-prec").insertAdjacentHTML("beforeend", "<option>" + esc(p) + "</option>"); });
  cats.forEach(function (c) { $("node-cat").insertAdjacentHTML("beforeend", "<option>" + esc(c) + "</option>"); });
  D.islands.forEach(function (I) { $("node-island").insertAdjacentHTML("beforeend", '<option value="' + I.id + '">island ' + I.id + "</option>"); });
  var timer = null;
  function apply() {
    var q = $("node-search").value.trim().toLowerCase(), p = $("node-prec").value, c = $("node-cat").value,
        isl = $("node-island").value;
    nodeTable.setFilter(function (r) {
      if (p && str(N.precision[r]) !== p) return false;
      if (c && str(N.category[r]) !== c) return false;
      if (isl === "in" && N.island[r] < 0) return false;
      if (isl && isl !== "in" && N.island[r] !== +isl) return false;
      if (!q) return true;
      return (N.name[r] + "\u0001" + str(N.op[r]) + "\u0001" + str(N.rule[r]) + "\u0001" + str(N.source[r]) +
        "\u0001" + str(N.reason[r])).toLowerCase().indexOf(q) >= 0;
    });
  }
  $("node-search").addEventListener("input", function () { clearTimeout(timer); timer = setTimeout(apply, 150); });
  ["node-prec", "node-cat", "node-island"].forEach(function (id) { $(id).addEventListener("change", apply); });
  window.ampShowIsland = function (id) { $("node-island").value = String(id); apply(); $("nodes").scrollIntoView(); };
})();

// ---- casts -------------------------------------------------------------------------------------------
function nodeRef(name) { return byName.has(name) ? nodeLink(byName.get(name)) : esc(name); }
var castCols = [
  {key: "name", label: "cast"}, {key: "kind", label: "kind"}, {key: "tensor", label: "tensor"},
  {key: "direction", label: "direction"},
  {key: "producer", label: "producer", render: function (v) { return v == null ? '<span class="muted">(input)</span>' : nodeRef(v); }},
  {key: "consumers", label: "consumers", render: function (v, r) { return D.casts[r].consumers.map(nodeRef).join(", "); }},
  {key: "shape", label: "shape", render: function (v, r) { var s = D.casts[r].shape; return s == null ? "?" : esc("[" + s.join(", ") + "]"); }},
  {key: "numel", label: "elements", num: true},
  {key: "runs", label: "runs", num: true, render: function (v) { return v == null ? "?" : esc(String(v)); }},
  {key: "bytes_per_run", label: "bytes/run", num: true, render: function (v) { return v == null ? "?" : esc(fmtBytes(v)); }},
  {key: "scope", label: "scope"}, {key: "reason", label: "reason", cls: "reason"}];
function castGet(r, key) { var v = D.casts[r][key]; return Array.isArray(v) ? v.join(", ") : v; }
var castTable = new Table($("cast-table"), castCols, D.casts.length, castGet, {
  onCount: function (shown, total) { $("cast-count").textContent = shown + " of " + total + " casts"; }});
$("cast-search").addEventListener("input", function (ev) {
  var q = ev.target.value.trim().toLowerCase();
  castTable.setFilter(q ? function (r) { var c = D.casts[r];
    return [c.name, c.tensor, c.producer || "", c.consumers.join(" "), c.reason, c.direction].join("\u0001").toLowerCase().indexOf(q) >= 0; } : null);
});

// ---- islands: one view each, drawn when opened ------------------------------------------------------
function islandView(I, body) {
  var members = I.members.filter(function (m) { return byName.has(m); }).map(function (m) { return byName.get(m); });
  var seeds = new Set(I.seeds);
  var lo = members.length ? Math.max(0, Math.min.apply(null, members) - 6) : 0;
  var hi = members.length ? Math.min(n - 1, Math.max.apply(null, members) + 6) : -1;
  var html = '<div class="muted">scope ' + esc(I.scope) + " · pattern " + esc(I.pattern || "none") + " · " +
    I.casts_in + " cast(s) in, " + I.casts_out + ' out · <a href="#nodes" data-island="' + I.id + '">show in node table</a></div>';
  html += "<div>seeded by: " + I.seed_rules.map(function (r) { return nodeRef(r.node) + " " + esc(r.op || "") +
    " (<code>" + esc(r.source || "") + "</code>)"; }).join("; ") + "</div>";
  html += '<canvas class="islandstrip" height="40"></canvas>';
  html += '<div class="chips">' + I.members.map(function (m) {
    var i = byName.has(m) ? byName.get(m) : -1;
    return '<span class="' + (seeds.has(m) ? "seed" : "") + '"' + (i >= 0 ? ' data-node="' + i + '"' : "") + ">" + esc(m) +
      (i >= 0 ? " · " + esc(str(N.op[i])) : "") + "</span>"; }).join("") + "</div>";
  var cs = D.casts.filter(function (c) { return c.kind === "inserted" && (I.members.indexOf(c.producer) >= 0 ||
    c.consumers.some(function (x) { return I.members.indexOf(x) >= 0; })); });
  if (cs.length) html += "<div>casts: " + cs.map(function (c) { return "<code>" + esc(c.name) + "</code> " + esc(c.direction); }).join("; ") + "</div>";
  body.innerHTML = html;
  var cv = body.querySelector("canvas"), count = hi - lo + 1;
  if (count <= 0) return;
  var w = Math.max(200, Math.min(body.clientWidth || 600, 1200)), cell = Math.max(2, Math.min(24, Math.floor(w / count)));
  var dpr = window.devicePixelRatio || 1;
  cv.width = cell * count * dpr; cv.height = 40 * dpr; cv.style.width = cell * count + "px"; cv.style.height = "40px";
  var ctx = cv.getContext("2d"); ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  for (var i = lo; i <= hi; i++) {
    var x = (i - lo) * cell;
    ctx.globalAlpha = N.island[i] === I.id ? 1 : 0.35;
    ctx.fillStyle = COLORS[str(N.precision[i])] || "#999";
    ctx.fillRect(x, 4, cell - (cell > 5 ? 1 : 0), 18);
    if (N.island[i] === I.id) { ctx.fillStyle = islandColor(I.id); ctx.fillRect(x, 25, cell, 6); }
    if (seeds.has(N.name[i])) { ctx.fillStyle = "#0f172a"; ctx.fillRect(x + cell / 2 - 1, 33, 2, 6); }
  }
  ctx.globalAlpha = 1;
}
(function islands() {
  var list = $("island-list"), shown = 0;
  function build(q) {
    var hits = D.islands.filter(function (I) {
      return !q || (I.description + " " + I.members.join(" ") + " " + I.seeds.join(" ")).toLowerCase().indexOf(q) >= 0; });
    shown = hits.length;
    list.innerHTML = hits.slice(0, 300).map(function (I) {
      return '<details class="island" data-id="' + I.id + '"><summary><span class="sw" style="display:inline-block;width:10px;height:10px;background:' +
        islandColor(I.id) + '"></span> <b>island ' + I.id + "</b>: " + esc(I.description) + "</summary><div class=\"body\"></div></details>"; }).join("") +
      (hits.length > 300 ? '<p class="muted">' + (hits.length - 300) + " more: narrow the search</p>" : "") +
      (D.islands.length ? "" : '<p class="muted">No FP32 islands.</p>');
    $("island-count").textContent = shown + " of " + D.islands.length + " islands";
  }
  list.addEventListener("toggle", function (ev) {
    var det = ev.target; if (!det.open) return;
    var id = +det.getAttribute("data-id"), body = det.querySelector(".body");
    selectedIsland = id; drawStrip();
    if (!body.hasChildNodes()) islandView(islandById.get(id), body);
  }, true);
  list.addEventListener("click", function (ev) {
    var a = ev.target.closest("[data-island]"); if (!a) return;
    ev.preventDefault(); window.ampShowIsland(+a.getAttribute("data-island"));
  });
  $("island-search").addEventListener("input", function (ev) { build(ev.target.value.trim().toLowerCase()); });
  build("");
})();

// ---- tensor-core alignment ---------------------------------------------------------------------------
var alignCols = [
  {key: "node", label: "node", render: function (v) { return nodeRef(v); }}, {key: "op", label: "op"},
  {key: "dims", label: "dims"}, {key: "misaligned", label: "not multiples of 8"}, {key: "status", label: "status"},
  {key: "shapes", label: "operand shapes"}];
function alignGet(r, key) {
  var a = D.alignment[r];
  if (key === "dims") return Object.keys(a.dims).map(function (k) { return k + "=" + a.dims[k]; }).join(", ");
  if (key === "misaligned") return a.misaligned.join(", ");
  if (key === "shapes") return a.shapes.map(function (s) { return s == null ? "?" : "[" + s.join(", ") + "]"; }).join(" × ");
  return a[key];
}
var alignTable = new Table($("align-table"), alignCols, D.alignment.length, alignGet, {pageSize: 50});
alignTable.setFilter(null);

drawStrip();
document.body.setAttribute("data-ready-ms", String(Math.round(performance.now())));
document.body.setAttribute("data-ready", "1");
})();
"""
