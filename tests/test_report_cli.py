"""--report from the command line, and progress bars that stay quiet when output is not a terminal."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys

import onnx
import pytest

from report_models import block_model, chain_model, overflow_model
from util import ROOT

from amp_rewrite import progress
from amp_rewrite.cli import main
from amp_rewrite.report import Report, validate


@pytest.fixture()
def block(tmp_path):
    path = tmp_path / "block.onnx"
    onnx.save(block_model(), path)
    return path


@pytest.mark.parametrize("suffix", [".json", ".html", ".md"])
def test_cli_report_by_extension(block, tmp_path, suffix, capsys):
    out = tmp_path / f"report{suffix}"
    assert main([str(block), "--no-fuse", "-o", str(tmp_path / "out.onnx"), "--report", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "FP32 islands: 1" in printed and f"report: {out}" in printed
    text = out.read_text()
    rebuilt = Report.from_model(tmp_path / "out.onnx")
    if suffix == ".json":
        d = json.loads(text)
        validate(d)
        assert d["source"] == str(block) and d["output"] == str(tmp_path / "out.onnx")
        assert {k: v for k, v in d.items() if k != "source"} == {
            k: v for k, v in json.loads(rebuilt.to_json()).items() if k != "source"}
    elif suffix == ".html":
        assert text.startswith("<!DOCTYPE html>") and 'id="sum-islands" data-value="1"' in text
    else:
        assert text.startswith("# amp-rewrite report") and "## FP32 islands" in text
        assert "| ln_div | Div | infer | fp32 | deny-spread | ln_sub | 0 |" in text


def test_cli_check_results_go_into_every_report_format(tmp_path, capsys):
    src = tmp_path / "ovf.onnx"
    onnx.save(overflow_model(), src)
    code = main([str(src), "-o", str(tmp_path / "o.onnx"), "--check", "--report", str(tmp_path / "r.json")])
    assert code == 8  # the check fails: fp16 intermediates overflow
    d = json.loads((tmp_path / "r.json").read_text())
    validate(d)
    assert d["check"]["passed"] is False and d["check"]["first_overflow"] == "MatMul:a"
    assert main([str(src), "-o", str(tmp_path / "o2.onnx"), "--check", "--report", str(tmp_path / "r.html")]) == 8
    html = (tmp_path / "r.html").read_text()
    assert 'id="sum-check"' in html and ">FAILED<" in html and "first_overflow" in html
    assert re.search(r'"overflow":\[\[0,true\]', html)  # the picture marks where overflow starts
    assert main([str(src), "-o", str(tmp_path / "o3.onnx"), "--check", "--report", str(tmp_path / "r.md")]) == 8
    assert "## Accuracy check" in (tmp_path / "r.md").read_text()
    capsys.readouterr()


def test_cli_report_repeated_writes_every_file(block, tmp_path, capsys):
    """--report r.json --report r.md --report r.html wrote r.html alone, silently (the last one won)."""
    paths = [tmp_path / "r.json", tmp_path / "r.md", tmp_path / "r.html"]
    args = [str(block), "-o", str(tmp_path / "out.onnx")] + [a for p in paths for a in ("--report", str(p))]
    assert main(args) == 0
    assert f"report: {', '.join(map(str, paths))}" in capsys.readouterr().out
    validate(json.loads(paths[0].read_text()))
    assert paths[1].read_text().startswith("# amp-rewrite report")
    assert paths[2].read_text().startswith("<!DOCTYPE html>")
    # one file named twice is a mistake, refused before anything is written
    again = [str(block), "-o", str(tmp_path / "o2.onnx"), "--report", str(tmp_path / "x.json"),
             "--report", str(tmp_path / "." / "x.json")]
    assert main(again) == 2
    assert "given twice" in capsys.readouterr().err
    assert not (tmp_path / "o2.onnx").exists() and not (tmp_path / "x.json").exists()


def test_cli_check_passing_report_validates(block, tmp_path, capsys):
    assert main([str(block), "-o", str(tmp_path / "o.onnx"), "--check", "--report", str(tmp_path / "r.json")]) == 0
    d = json.loads((tmp_path / "r.json").read_text())
    validate(d)
    assert d["check"]["passed"] is True and d["check"]["outputs"][0]["output"] == "y"
    capsys.readouterr()


def test_cli_report_unknown_extension(block, tmp_path, capsys):
    assert main([str(block), "--report", str(tmp_path / "r.txt")]) == 2
    assert "the format comes from the extension" in capsys.readouterr().err
    assert not (tmp_path / "block.fp16.onnx").exists()


def test_html_is_self_contained_and_escapes_names(tmp_path):
    model = block_model()
    model.graph.node[0].name = "</script><script>alert(1)</script><!--"
    src = tmp_path / "m.onnx"
    onnx.save(model, src)
    assert main([str(src), "-q", "--report", str(tmp_path / "r.html")]) == 0
    text = (tmp_path / "r.html").read_text()
    assert text.count("</script>") == 2  # the data block's and the code's, nothing injected
    assert "<script>alert" not in text
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:|//)""", text, re.I)
    assert not re.search(r"url\(\s*['\"]?(https?:|//)", text, re.I)
    assert "@import" not in text
    data = re.search(r'<script type="application/json" id="amp-data">(.*?)</script>', text, re.S).group(1)
    assert json.loads(data)["nodes"]["name"][0] == model.graph.node[0].name


def test_html_fills_its_placeholders_once(tmp_path):
    """The page was filled by chained replaces, each scanning the text the one before had put in:
    a node named %%JS%% (shown in the "kept FP32" table and its reason) got the page's whole script
    pasted in its place, twice."""
    model = block_model()
    model.graph.node[0].name = "%%JS%%"
    src = tmp_path / "m.onnx"
    onnx.save(model, src)
    assert main([str(src), "-q", "--fp32-nodes", "%%JS%%", "--report", str(tmp_path / "r.html")]) == 0
    text = (tmp_path / "r.html").read_text()
    assert text.count('"use strict"') == 1
    assert "%%JS%%" in text  # the name itself, shown as it is
    assert not re.search(r"%%(TITLE|SUBTITLE|TARGET|SUMMARY|WEIGHTS|CHECK|NOTES|CSS|DATA)%%", text)


def test_markdown_escapes_table_cells(tmp_path):
    from amp_rewrite.report_render import render_markdown
    from util import rewrite

    model = block_model()
    model.graph.node[0].name = "a|b"
    md = render_markdown(rewrite(model).report)
    assert "| a\\|b | MatMul |" in md


def test_a_name_with_a_newline_keeps_the_summary_one_line_per_item(tmp_path, capsys):
    """A node named "a\\nb" split its "kept FP32" line in two in the terminal summary."""
    model = block_model()
    model.graph.node[0].name = "mm\nrest\tof"
    src = tmp_path / "m.onnx"
    onnx.save(model, src)
    assert main([str(src), "-o", str(tmp_path / "o.onnx"), "--fp32-nodes", "mm\nrest\tof"]) == 0
    out = capsys.readouterr().out
    assert "mm\\nrest\\tof" in out
    assert all(not line.startswith("rest") for line in out.splitlines())


def test_quiet_prints_nothing(block, tmp_path, capsys):
    assert main([str(block), "-q", "-o", str(tmp_path / "o.onnx")]) == 0
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""


# -- progress bars -------------------------------------------------------------------------------------
class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture()
def fresh_progress(monkeypatch):
    monkeypatch.setattr(progress, "_disabled", False)
    monkeypatch.delenv(progress.ENV_OFF, raising=False)
    monkeypatch.setattr(progress, "DELAY_S", 0)


def test_progress_quiet_when_not_a_terminal(fresh_progress):
    stream = io.StringIO()
    items = [1, 2, 3]
    assert progress.bar(items, desc="x", stream=stream) is items
    with progress.stages(["a", "b"], stream=stream) as stage:
        stage("a")
        stage("b")
    with progress.bytes_bar(100, stream=stream) as advance:
        advance(50)
    assert stream.getvalue() == ""


def test_progress_shown_on_a_terminal(fresh_progress):
    stream = FakeTTY()
    assert list(progress.bar(range(3), desc="comparing", stream=stream)) == [0, 1, 2]
    assert "comparing" in stream.getvalue()
    stream = FakeTTY()
    with progress.stages(["load", "rewrite"], desc="model.onnx", stream=stream) as stage:
        stage("load")
        stage("rewrite")
    assert "model.onnx" in stream.getvalue() and "rewrite" in stream.getvalue()


def test_stages_of_quick_work_show_nothing_and_a_shown_bar_is_cleared(fresh_progress, monkeypatch):
    """A stage's name was drawn at once, whatever the delay, and close() then left that line on the
    terminal (the summary went on after it): quick work shows nothing now, and a bar shown past the
    delay is erased when the work ends."""
    monkeypatch.setattr(progress, "DELAY_S", 60)
    stream = FakeTTY()
    with progress.stages(["load", "rewrite", "write"], desc="model.onnx", stream=stream) as stage:
        for name in ("load", "rewrite", "write"):
            stage(name)
    assert stream.getvalue() == ""
    monkeypatch.setattr(progress, "DELAY_S", 0)
    stream = FakeTTY()
    with progress.stages(["load", "rewrite"], desc="model.onnx", stream=stream) as stage:
        stage("load")
        stage("rewrite")
    shown = stream.getvalue()
    assert "rewrite" in shown and shown.rsplit("\r", 1)[-1].strip() == ""  # (the last thing drawn: blanks)


def test_progress_can_be_turned_off(fresh_progress, monkeypatch):
    assert progress.enabled(FakeTTY())
    monkeypatch.setenv(progress.ENV_OFF, "1")
    assert not progress.enabled(FakeTTY())
    monkeypatch.delenv(progress.ENV_OFF)
    progress.disable()
    assert not progress.enabled(FakeTTY())


def _run_with_tty_stderr(args: list[str], cwd) -> str:
    """Run the CLI with stderr on a pseudo-terminal; return what the terminal received."""
    import pty
    import select

    master, slave = pty.openpty()
    env = {k: v for k, v in os.environ.items() if k != progress.ENV_OFF}
    proc = subprocess.Popen([sys.executable, "-m", "amp_rewrite", *args], cwd=cwd, stdout=subprocess.DEVNULL,
                            stderr=slave, env=env)
    os.close(slave)
    chunks = []
    while True:
        ready, _, _ = select.select([master], [], [], 0.2)
        if ready:
            try:
                data = os.read(master, 4096)
            except OSError:  # the child closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        elif proc.poll() is not None:
            break
    proc.wait(timeout=300)
    os.close(master)
    assert proc.returncode == 0
    return b"".join(chunks).decode(errors="replace")


def test_long_rewrite_shows_a_bar_on_a_terminal_only(tmp_path):
    src = tmp_path / "chain.onnx"
    onnx.save(chain_model(10_000), src)  # (about 2 s of work: bars show past half a second)
    on_tty = _run_with_tty_stderr([str(src), "-o", str(tmp_path / "a.onnx")], ROOT)
    assert "chain.onnx" in on_tty and "/3" in on_tty  # e.g. "chain.onnx: 1/3 rewrite [00:01]"
    quiet = _run_with_tty_stderr([str(src), "-q", "-o", str(tmp_path / "b.onnx")], ROOT)
    assert quiet == ""
    piped = subprocess.run([sys.executable, "-m", "amp_rewrite", str(src), "-o", str(tmp_path / "c.onnx")],
                           capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert piped.returncode == 0 and piped.stderr == ""


def test_cli_report_takes_every_extension_the_renderer_knows(block, tmp_path, capsys):
    """.htm and .markdown were refused by the CLI although the renderer writes them."""
    for i, (name, marker) in enumerate((("r.htm", "<html"), ("r.markdown", "# amp-rewrite report"))):
        assert main([str(block), "-o", str(tmp_path / f"o{i}.onnx"), "--report", str(tmp_path / name)]) == 0
        assert marker in (tmp_path / name).read_text()
    capsys.readouterr()


def test_cli_explain_refuses_options_it_would_ignore(block, tmp_path, capsys):
    assert main([str(block), "--explain", "x", "--check"]) == 2
    assert "drop --check/--auto-fp32" in capsys.readouterr().err


def test_a_failed_check_is_failed_in_markdown_and_its_values_are_escaped_in_html(tmp_path):
    """The Markdown report says FAILED for a check that failed; the HTML check section shows a
    value naming a node (the first overflow) as text, never as markup."""
    model = overflow_model()
    model.graph.node[0].name = "<i>mm</i>"
    src = tmp_path / "ovf.onnx"
    onnx.save(model, src)
    assert main([str(src), "-o", str(tmp_path / "o.onnx"), "--check", "--report", str(tmp_path / "r.md")]) == 8
    md = (tmp_path / "r.md").read_text()
    assert "**FAILED**" in md and "**passed**" not in md
    assert main([str(src), "-o", str(tmp_path / "o2.onnx"), "--check", "--report", str(tmp_path / "r.html")]) == 8
    html = (tmp_path / "r.html").read_text()
    assert "first_overflow</b>: &lt;i&gt;mm&lt;/i&gt;" in html
    assert "<i>mm</i>" not in html


def test_html_data_block_holds_no_comment_or_script_opener(tmp_path):
    """A node name opening an HTML comment and a script tag inside the page's JSON data would put
    the parser in its double-escaped state, where the data block's own </script> no longer ends
    it: the data escapes every '<'."""
    model = block_model()
    model.graph.node[0].name = "<!--<script x"
    src = tmp_path / "m.onnx"
    onnx.save(model, src)
    assert main([str(src), "-q", "--report", str(tmp_path / "r.html")]) == 0
    text = (tmp_path / "r.html").read_text()
    assert "<!--" not in text and "<script x" not in text
    data = re.search(r'<script type="application/json" id="amp-data">(.*?)</script>', text, re.S).group(1)
    assert json.loads(data)["nodes"]["name"][0] == "<!--<script x"
