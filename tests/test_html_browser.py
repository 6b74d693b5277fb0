"""The HTML report in a real headless browser (Debian's ``chromium``; CI installs it in .ci/run).

Chromium is driven over the DevTools protocol on a pipe (``--remote-debugging-pipe``: fd 3 in,
fd 4 out, NUL-terminated JSON), so no websocket library, driver download or network is needed.
Each page must render with no console errors or uncaught exceptions, request nothing from the
network, and show the report's key numbers in the DOM; a screenshot of the summary and the
precision picture goes to ``artifacts/`` (gitignored; CI keeps it as a test artifact).

Skipped, with the reason, when no chromium is installed (set AMP_REWRITE_CHROMIUM to a binary to
use another one).
"""

from __future__ import annotations

import base64
import json
import os
import queue
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest

from report_models import block_model, block_with_mask_constant, chain_model, overflow_model
from util import ROOT

from amp_rewrite.api import rewrite_onnx
from amp_rewrite.report import Report, write_report

pytestmark = pytest.mark.browser
ARTIFACTS = ROOT / "artifacts"


def _chromium() -> str | None:
    env = os.environ.get("AMP_REWRITE_CHROMIUM")
    if env:
        return env
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    return None


CHROMIUM = _chromium()
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="no headless chromium installed (apt-get install -y chromium; CI installs it)")


def _high_fd(fd: int) -> int:
    """Move ``fd`` above 9, so the child's dup2 onto 3 and 4 cannot clobber the other pipe end."""
    import fcntl

    high = fcntl.fcntl(fd, fcntl.F_DUPFD, 10)
    os.close(fd)
    return high


class Browser:
    """A minimal DevTools-protocol client over ``--remote-debugging-pipe``."""

    def __init__(self, binary: str, *, width: int = 1400, height: int = 1000) -> None:
        self.profile = tempfile.mkdtemp(prefix="amp-chromium-")
        to_child_r, self._to_child = (_high_fd(fd) for fd in os.pipe())
        self._from_child, from_child_w = (_high_fd(fd) for fd in os.pipe())
        # The child reads commands on fd 3 and writes replies on fd 4.
        args = [binary, "--headless=new", "--remote-debugging-pipe", "--no-sandbox", "--disable-gpu",
                "--disable-dev-shm-usage", "--no-first-run", "--no-default-browser-check", "--disable-extensions",
                "--disable-background-networking", "--disable-sync", "--mute-audio", "--hide-scrollbars",
                f"--user-data-dir={self.profile}", f"--window-size={width},{height}", "about:blank"]

        def fds() -> None:
            os.dup2(to_child_r, 3)
            os.dup2(from_child_w, 4)

        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=self.log, stderr=self.log,
                                     preexec_fn=fds, pass_fds=(3, 4))
        os.close(to_child_r)
        os.close(from_child_w)
        self._next_id = 0
        self._replies: dict[int, dict] = {}
        self._events: queue.Queue = queue.Queue()
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.session: str | None = None
        self.width, self.height = width, height

    def _read(self) -> None:
        buf = b""
        while True:
            try:
                chunk = os.read(self._from_child, 1 << 16)
            except OSError:
                chunk = b""
            if not chunk:
                with self._cond:
                    self._cond.notify_all()
                return
            buf += chunk
            while b"\0" in buf:
                raw, buf = buf.split(b"\0", 1)
                msg = json.loads(raw)
                if "id" in msg:
                    with self._cond:
                        self._replies[msg["id"]] = msg
                        self._cond.notify_all()
                else:
                    self._events.put(msg)

    def send(self, method: str, params: dict | None = None, *, session: bool = True, timeout: float = 60) -> dict:
        self._next_id += 1
        msg_id = self._next_id
        msg = {"id": msg_id, "method": method, "params": params or {}}
        if session and self.session:
            msg["sessionId"] = self.session
        os.write(self._to_child, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        with self._cond:
            while msg_id not in self._replies:
                left = deadline - time.monotonic()
                if left <= 0 or self.proc.poll() is not None:
                    self.log.seek(0)
                    tail = self.log.read()[-2000:].decode(errors="replace")
                    raise TimeoutError(f"chromium did not answer {method} (exit code {self.proc.poll()}):\n{tail}")
                self._cond.wait(min(left, 0.5))
            reply = self._replies.pop(msg_id)
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return reply.get("result", {})

    def events(self) -> list[dict]:
        out = []
        while True:
            try:
                out.append(self._events.get_nowait())
            except queue.Empty:
                return out

    def open(self) -> None:
        target = self.send("Target.createTarget", {"url": "about:blank"}, session=False)["targetId"]
        self.session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True},
                                 session=False)["sessionId"]
        for domain in ("Page", "Runtime", "Log", "Network"):
            self.send(f"{domain}.enable")
        self.send("Emulation.setDeviceMetricsOverride",
                  {"width": self.width, "height": self.height, "deviceScaleFactor": 1, "mobile": False})

    def evaluate(self, expression: str, timeout: float = 60):
        result = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True,
                                                "awaitPromise": True}, timeout=timeout)
        if "exceptionDetails" in result:
            raise RuntimeError(f"page script failed: {result['exceptionDetails']}")
        return result["result"].get("value")

    def load(self, url: str, ready: str, timeout: float = 60) -> list[dict]:
        """Navigate and wait until ``ready`` (a JS expression) is true; return the events seen."""
        self.send("Page.navigate", {"url": url})
        deadline = time.monotonic() + timeout
        while not self.evaluate(f"Boolean({ready})"):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url}: not ready after {timeout} s")
            time.sleep(0.05)
        time.sleep(0.3)  # let late console messages arrive
        return self.events()

    def screenshot(self, path: Path, clip: dict | None = None) -> None:
        params: dict = {"format": "png"}
        if clip is not None:
            params.update({"clip": {**clip, "scale": 1}, "captureBeyondViewport": True})
        data = self.send("Page.captureScreenshot", params)["data"]
        path.write_bytes(base64.b64decode(data))

    def close(self) -> None:
        try:
            self.send("Browser.close", session=False, timeout=5)
        except Exception:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for fd in (self._to_child, self._from_child):
            try:
                os.close(fd)
            except OSError:
                pass
        shutil.rmtree(self.profile, ignore_errors=True)


def problems(events: list[dict]) -> list[str]:
    """Console errors, uncaught exceptions, failed loads and any request leaving the file."""
    out = []
    for e in events:
        method, params = e.get("method"), e.get("params", {})
        if method == "Runtime.exceptionThrown":
            out.append(f"exception: {params['exceptionDetails']}")
        elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            out.append(f"console.{params['type']}: {[a.get('value', a.get('description')) for a in params['args']]}")
        elif method == "Log.entryAdded" and params["entry"]["level"] == "error":
            out.append(f"log: {params['entry']['text']}")
        elif method == "Network.requestWillBeSent":
            url = params["request"]["url"]
            if not url.startswith(("file:", "data:", "about:")):
                out.append(f"network request: {url}")
        elif method == "Network.loadingFailed":
            out.append(f"load failed: {params.get('errorText')}")
    return out


@pytest.fixture(scope="module")
def browser():
    if CHROMIUM is None:
        pytest.skip("no headless chromium installed (apt-get install -y chromium; CI installs it)")
    b = Browser(CHROMIUM)
    try:
        b.open()
        yield b
    finally:
        b.close()


def _rewrite(model, folder: Path, name: str):
    """Without fusion: the block's decomposed LayerNorm is the page's FP32-island example."""
    import onnx

    src = folder / f"{name}.onnx"
    onnx.save(model, src)
    return rewrite_onnx(src, folder / f"{name}.fp16.onnx", fuse=False)


_NUMBERS = """JSON.stringify({
  cards: Object.fromEntries([...document.querySelectorAll('.card')].map(c => [c.id, c.dataset.value || c.querySelector('.num').textContent])),
  nodeCount: document.getElementById('node-count').textContent,
  castCount: document.getElementById('cast-count').textContent,
  islandCount: document.getElementById('island-count').textContent,
  rows: document.querySelectorAll('#node-table tbody tr').length,
  canvas: [document.getElementById('strip').width, document.getElementById('strip').height],
  readyMs: +document.body.dataset.readyMs,
  painted: (() => { const c = document.getElementById('strip'); const d = c.getContext('2d').getImageData(0, 0, c.width, Math.min(c.height, 40)).data;
                    let n = 0; for (let i = 3; i < d.length; i += 4) if (d[i]) n++; return n; })(),
})"""


@needs_chromium
def test_block_report_renders_with_numbers_and_screenshot(browser, tmp_path):
    result = _rewrite(block_with_mask_constant(), tmp_path, "block")
    report = result.report
    page = tmp_path / "block.html"
    write_report(report, page)
    events = browser.load(page.as_uri(), "document.body && document.body.dataset.ready === '1'")
    assert problems(events) == []
    got = json.loads(browser.evaluate(_NUMBERS))
    s = report.summary()
    assert got["cards"]["sum-nodes"] == str(s["nodes_total"])
    assert got["cards"]["sum-low"] == str(s["nodes"]["fp16"])
    assert got["cards"]["sum-fp32"] == str(s["nodes"]["fp32"])
    assert got["cards"]["sum-casts"] == str(s["casts_inserted"])
    assert got["cards"]["sum-islands"] == str(s["islands"]) == "1"
    assert got["cards"]["sum-misaligned"] == str(s["alignment"]["misaligned"]) == "2"
    assert got["cards"]["sum-sentinels"] == "1"
    assert got["nodeCount"] == f"{s['nodes_total']} of {s['nodes_total']} nodes"
    assert got["castCount"] == f"{len(report.log.casts)} of {len(report.log.casts)} casts"
    assert got["rows"] == s["nodes_total"]
    assert got["painted"] > 0, "the precision picture is blank"

    # Search, sort and the why-panel work.
    browser.evaluate("(() => { const i = document.getElementById('node-search'); i.value = 'ln_div';"
                     " i.dispatchEvent(new Event('input')); })()")
    time.sleep(0.4)
    expected = [d.node for d in report.log.decisions.values() if "ln_div" in (d.node + d.reason).lower()]
    assert len(expected) == 2  # ln_div, and ln_mul whose paint came from it
    assert browser.evaluate("[...document.querySelectorAll('#node-table tbody tr td:nth-child(2)')]"
                            ".map(td => td.textContent)") == expected
    browser.evaluate("document.querySelector('#node-table tbody tr').click()")
    detail = browser.evaluate("document.getElementById('detail').textContent")
    assert "ln_div" in detail and "ln_sub" in detail and "ln_mean" in detail and "deny.ReduceMean" in detail
    browser.evaluate("(() => { const i = document.getElementById('node-search'); i.value = '';"
                     " i.dispatchEvent(new Event('input')); })()")
    time.sleep(0.4)
    browser.evaluate("document.querySelector('#node-table th[data-col=\"4\"]').click()")
    first = browser.evaluate("document.querySelector('#node-table tbody tr td:nth-child(5)').textContent")
    assert first == "fp16"
    browser.evaluate("document.querySelector('#island-list details').open = true")
    time.sleep(0.3)
    assert "ln_mean" in browser.evaluate("document.querySelector('#island-list details .body').textContent")
    assert problems(browser.events()) == []

    ARTIFACTS.mkdir(exist_ok=True)
    browser.evaluate("window.scrollTo(0, 0)")
    bottom = browser.evaluate("Math.ceil(document.getElementById('picture').getBoundingClientRect().bottom + 8)")
    shot = ARTIFACTS / "report-block.png"
    browser.screenshot(shot, {"x": 0, "y": 0, "width": browser.width, "height": bottom})
    assert shot.stat().st_size > 10_000


@needs_chromium
def test_ten_thousand_node_report_stays_responsive(browser, tmp_path):
    result = _rewrite(chain_model(10_000), tmp_path, "chain")
    report = result.report
    s = report.summary()
    assert s["nodes_total"] >= 9_900
    page = tmp_path / "chain.html"
    write_report(report, page)
    assert page.stat().st_size < 8 << 20
    start = time.monotonic()
    events = browser.load(page.as_uri(), "document.body && document.body.dataset.ready === '1'", timeout=60)
    load_s = time.monotonic() - start
    assert problems(events) == []
    got = json.loads(browser.evaluate(_NUMBERS))
    assert got["cards"]["sum-nodes"] == str(s["nodes_total"])
    assert got["cards"]["sum-casts"] == str(s["casts_inserted"])
    assert got["cards"]["sum-islands"] == str(s["islands"])
    assert got["nodeCount"] == f"{s['nodes_total']} of {s['nodes_total']} nodes"
    assert got["rows"] == 100  # paged, not 10,000 rows in the DOM
    assert got["painted"] > 0
    assert got["readyMs"] < 5_000, f"page script took {got['readyMs']} ms"
    assert load_s < 20

    # Filtering 10k rows and re-sorting stays interactive.
    t = browser.evaluate("""(() => { const t0 = performance.now();
        const i = document.getElementById('node-search'); i.value = 'reducemean';
        i.dispatchEvent(new Event('input'));
        return new Promise(r => setTimeout(() => r(performance.now() - t0), 300)); })()""")
    assert t < 1_500
    shown = browser.evaluate("document.getElementById('node-count').textContent")
    expected = sum(1 for d in report.to_dict()["nodes"]
                   if "reducemean" in "\1".join([d["node"], d["op"], d["rule"], d["source"], d["reason"]]).lower())
    assert shown == f"{expected} of {s['nodes_total']} nodes"
    sort_ms = browser.evaluate("""(() => { const t0 = performance.now();
        document.querySelector('#node-table th[data-col="9"]').click(); return performance.now() - t0; })()""")
    assert sort_ms < 1_500
    assert problems(browser.events()) == []
    ARTIFACTS.mkdir(exist_ok=True)
    browser.evaluate("window.scrollTo(0, 0)")
    bottom = browser.evaluate("Math.ceil(document.getElementById('picture').getBoundingClientRect().bottom + 8)")
    browser.screenshot(ARTIFACTS / "report-10k.png", {"x": 0, "y": 0, "width": browser.width, "height": min(bottom, 4000)})


@needs_chromium
def test_rebuilt_report_page_matches(browser, tmp_path):
    """A page written from the report rebuilt out of the saved model shows the same numbers."""
    result = _rewrite(block_model(big_weight=True), tmp_path, "big")
    pages = {}
    for label, report in (("live", result.report), ("rebuilt", Report.from_model(result.outputs[-1]))):
        page = tmp_path / f"{label}.html"
        write_report(report, page)
        assert problems(browser.load(page.as_uri(), "document.body && document.body.dataset.ready === '1'")) == []
        pages[label] = json.loads(browser.evaluate(_NUMBERS))["cards"]
    assert pages["live"] == pages["rebuilt"]
    assert pages["live"]["sum-clamped"] == "2"


@needs_chromium
def test_check_results_and_overflow_marks_render(browser, tmp_path):
    from amp_rewrite.cli import main

    src = tmp_path / "ovf.onnx"
    import onnx

    onnx.save(overflow_model(), src)
    page = tmp_path / "ovf.html"
    assert main([str(src), "-q", "-o", str(tmp_path / "o.onnx"), "--check", "--report", str(page)]) == 8
    events = browser.load(page.as_uri(), "document.body && document.body.dataset.ready === '1'")
    assert problems(events) == []
    assert browser.evaluate("document.getElementById('sum-check').querySelector('.num').textContent") == "FAILED"
    assert "overflow found by --check (3" in browser.evaluate("document.getElementById('legend').textContent")
    assert "MatMul:a" in browser.evaluate("document.getElementById('check').textContent")
