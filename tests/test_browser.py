"""Render a generated report in headless Chromium and check what a reader would see.

Mechanism (no extra Python dependency): Chromium is started with `--remote-debugging-pipe` and driven with the
DevTools protocol over that pipe (fd 3: commands in, fd 4: replies and events out, each message NUL-terminated
JSON). The page is loaded from its file:// URL with no network; the test collects console errors, uncaught
exceptions, log errors and every request the page makes, measures each inline SVG figure with
getBoundingClientRect, and takes a full-page screenshot.

Skips with a reason only where no Chromium/Chrome binary can be found (install: `.ci/install-browser`).
Run by hand on any report: `python tests/test_browser.py REPORT.html SHOT.png`.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--hide-scrollbars", "--mute-audio", "--remote-debugging-pipe"]
WIDTH = 1280


def find_browser() -> tuple[str | None, str]:
    """($CHROME or the first Chromium/Chrome on PATH that starts, why not) — a wrapper that cannot run is no browser."""
    candidates = [os.environ["CHROME"]] if os.environ.get("CHROME") else [p for p in map(shutil.which, BROWSERS) if p]
    if not candidates:
        return None, "no Chromium or Chrome on PATH (install it with .ci/install-browser, or set CHROME=/path)"
    why = ""
    for binary in candidates:
        try:
            proc = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=60)
            if proc.returncode == 0:
                return binary, ""
            why = f"{binary} --version exited {proc.returncode}: {(proc.stderr or proc.stdout).strip()[:200]}"
        except (OSError, subprocess.TimeoutExpired) as exc:
            why = f"{binary} does not start ({exc})"
    return None, why


class DevTools:
    """A Chromium started with --remote-debugging-pipe, and the DevTools protocol spoken over that pipe."""

    def __init__(self, binary: str, timeout: float = 60.0):
        self.timeout = timeout
        self.profile = tempfile.mkdtemp(prefix="harness-chromium-")
        self._log = open(os.path.join(self.profile, "stderr.log"), "w+b")  # closed in close()
        to_child_r, self._to_child = os.pipe()
        self._from_child, from_child_w = os.pipe()
        # Chromium reads commands from fd 3 and writes to fd 4. Move the child's ends above 9 first, so that the
        # dup2 onto 3 and 4 in the child cannot overwrite one with the other.
        ends = []
        for fd in (to_child_r, from_child_w):
            ends.append(fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10))
            os.close(fd)
        to_child_r, from_child_w = ends

        def wire() -> None:  # in the child, before exec: fds made by dup2 are inheritable, the others are not
            os.dup2(to_child_r, 3)
            os.dup2(from_child_w, 4)

        self.proc = subprocess.Popen([binary, *FLAGS, f"--user-data-dir={self.profile}", "about:blank"],
                                     preexec_fn=wire, close_fds=False, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=self._log)
        os.close(to_child_r)
        os.close(from_child_w)
        self._buf = b""
        self._next_id = 0
        self.events: list[dict] = []

    def send(self, method: str, params: dict | None = None, session: str | None = None) -> dict:
        """Send one command and wait for its reply (events that arrive meanwhile are kept in `events`)."""
        self._next_id += 1
        msg: dict[str, Any] = {"id": self._next_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self._to_child, json.dumps(msg).encode() + b"\0")
        while True:
            reply = self._read()
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def wait_event(self, method: str) -> dict:
        """Wait for (and return) the first event `method`, looking at those already received first."""
        for i, ev in enumerate(self.events):
            if ev.get("method") == method:
                return self.events.pop(i)
        while True:
            ev = self._read()
            if ev.get("method") == method:
                return ev
            self.events.append(ev)

    def _read(self) -> dict:
        deadline = time.monotonic() + self.timeout
        while b"\0" not in self._buf:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self._from_child], [], [], max(0.0, left))
            if not ready:
                raise TimeoutError(f"no reply from the browser within {self.timeout:.0f} s")
            chunk = os.read(self._from_child, 1 << 20)
            if not chunk:
                self._log.flush()
                self._log.seek(0)
                err = self._log.read().decode(errors="replace")[-2000:]
                raise RuntimeError(f"the browser closed the DevTools pipe; its stderr ends with:\n{err}")
            self._buf += chunk
        msg, self._buf = self._buf.split(b"\0", 1)
        return json.loads(msg)

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                try:
                    self.send("Browser.close")
                except (RuntimeError, TimeoutError, OSError):
                    pass
                try:
                    self.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
        finally:
            for fd in (self._to_child, self._from_child):
                try:
                    os.close(fd)
                except OSError:
                    pass
            self._log.close()
            shutil.rmtree(self.profile, ignore_errors=True)


MEASURE = """JSON.stringify({
  figures: Array.from(document.querySelectorAll('svg.figure')).map(s => {
    const r = s.getBoundingClientRect(); return {label: s.getAttribute('aria-label'), width: r.width, height: r.height,
      paths: s.querySelectorAll('path').length}; }),
  banners: Array.from(document.querySelectorAll('.banner')).map(b => b.textContent.trim()),
  firstHeading: (document.querySelector('h1') || {}).textContent,
  firstBannerTop: (document.querySelector('.banner') || {getBoundingClientRect: () => ({top: -1})})
    .getBoundingClientRect().top,
  height: document.documentElement.scrollHeight, width: document.documentElement.scrollWidth,
  tables: document.querySelectorAll('table').length,
  title: document.title,
  scripts: document.querySelectorAll('script').length,
  handlers: Array.from(document.querySelectorAll('*')).filter(e => Array.from(e.attributes)
    .some(a => a.name.toLowerCase().startsWith('on'))).length,
  pills: Array.from(document.querySelectorAll('.pill')).map(p => {
    const r = p.getBoundingClientRect(), c = getComputedStyle(p);
    return {text: p.textContent.trim(), cls: p.className, width: r.width, height: r.height, color: c.color,
      background: c.backgroundColor}; }),
})"""


def render(binary: str, page: Path, screenshot: Path | None = None) -> dict[str, Any]:
    """Load `page` in headless Chromium; return figure sizes, console errors, requests, and save a screenshot."""
    url = page.resolve().as_uri()
    tools = DevTools(binary)
    try:
        target = tools.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = tools.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Page", "Runtime", "Log", "Network"):
            tools.send(f"{domain}.enable", session=session)
        tools.send("Emulation.setDeviceMetricsOverride", {"width": WIDTH, "height": 900, "deviceScaleFactor": 1,
                                                          "mobile": False}, session=session)
        tools.send("Page.navigate", {"url": url}, session=session)
        tools.wait_event("Page.loadEventFired")
        measured = json.loads(tools.send("Runtime.evaluate", {"expression": MEASURE, "returnByValue": True},
                                         session=session)["result"]["value"])
        if screenshot is not None:
            height = int(min(measured["height"], 16000))
            shot = tools.send("Page.captureScreenshot", {
                "format": "png", "captureBeyondViewport": True,
                "clip": {"x": 0, "y": 0, "width": WIDTH, "height": height, "scale": 1}}, session=session)
            screenshot.write_bytes(base64.b64decode(shot["data"]))
        errors, requests = [], []
        for ev in tools.events:
            method, params = ev.get("method"), ev.get("params", {})
            if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
                errors.append("console: " + " ".join(str(a.get("value", a.get("description"))) for a in
                                                     params.get("args", [])))
            elif method == "Runtime.exceptionThrown":
                errors.append("exception: " + json.dumps(params.get("exceptionDetails", {}))[:500])
            elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
                errors.append("log: " + params["entry"].get("text", ""))
            elif method == "Network.requestWillBeSent":
                requests.append(params.get("request", {}).get("url", ""))
            elif method == "Network.loadingFailed":
                errors.append(f"load failed: {params.get('errorText')}")
        measured.update(errors=errors, requests=requests, url=url)
        return measured
    finally:
        tools.close()


# --- the tests -------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def browser() -> str:
    binary, why = find_browser()
    if binary is None:
        pytest.skip(why)
    return binary


def _check(result: dict, expect_figures: int) -> None:
    figures = result["figures"]
    assert len(figures) == expect_figures, figures
    for fig in figures:
        assert fig["width"] > 200 and fig["height"] > 100, fig  # drawn at a readable size, not collapsed
        assert fig["paths"] > 5, fig  # something was drawn in it
        assert fig["width"] <= WIDTH, fig
    assert result["errors"] == [], result["errors"]
    assert result["requests"] == [result["url"]], "the page loaded something besides itself"
    assert result["width"] <= WIDTH, "the page scrolls sideways"


def test_report_renders_in_chromium(browser: str, tmp_path: Path) -> None:
    """A two-backend, three-size report: every figure drawn, no console error, nothing fetched, a screenshot."""
    from test_report import make_sized_runs

    from harness.report import write_index, write_report

    out = tmp_path / "out"
    run_ids = make_sized_runs(out)
    page = write_report(out, run_ids)
    shot = tmp_path / "report.png"
    result = render(browser, page, shot)
    # scaling + per run (loss, deviation, cost) x 3 runs
    _check(result, 1 + 3 * 3)
    assert result["banners"] == []
    assert shot.stat().st_size > 50_000
    keep = os.environ.get("HARNESS_SCREENSHOT_DIR")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, Path(keep) / "report.png")
    index = render(browser, write_index(out), tmp_path / "index.png")
    assert index["errors"] == [] and index["requests"] == [index["url"]]


def test_failed_report_shows_banner_first(browser: str, tmp_path: Path) -> None:
    """A failed record's report renders, and its banner is the first thing under the title."""
    from test_report import make_run

    from harness.report import write_report

    out = tmp_path / "out"
    run_id = make_run(out, backends=("torch", "numpy"), statuses={"numpy": "failed: RuntimeError: boom"})
    result = render(browser, write_report(out, [run_id]), tmp_path / "failed.png")
    assert result["errors"] == []
    assert result["banners"] and "failed" in result["banners"][0]
    assert 0 <= result["firstBannerTop"] < 250  # visible without scrolling
    assert all(f["width"] > 200 and f["height"] > 100 for f in result["figures"])


# --- markup planted in what a record holds must never run ------------------------------------------------------------
PWNED = "PWNED"
PAYLOADS = [f'x"><script>document.title="{PWNED}"</script>', f"<img src=x onerror=\"document.title='{PWNED}'\">",
            f"</pre><script>document.title='{PWNED}'</script>"]


def _unexecuted(result: dict) -> None:
    assert PWNED not in result["title"], result["title"]
    assert result["scripts"] == 0 and result["handlers"] == 0, result
    assert result["requests"] == [result["url"]], "the page loaded something besides itself"
    assert result["errors"] == [], result["errors"]


def test_markup_in_a_sweep_record_does_not_run(browser: str, tmp_path: Path) -> None:
    """The attack: a sweep cell's record whose config name is `x"><script>...`; also markup in the
    sweep manifest's cell keys and spec."""
    from conftest import run_cli

    from harness.errors import UsageError
    from harness.report.sweep import write_sweep_report

    out = tmp_path / "out"
    proc = run_cli("sweep", "--backends", "numpy", "--seeds", "2", "--steps", "2", "--eval-interval", "1",
                   "--set", "n_embd=16", "--no-text", "--no-report", "--quiet", "--threads", "1", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    for i, path in enumerate(sorted(out.glob("runs/*/numpy.json"))):
        rec = json.loads(path.read_text())
        rec["config"]["name"] = PAYLOADS[i % 2]
        path.write_text(json.dumps(rec))
    (manifest,) = out.glob("sweeps/*/sweep.json")
    _unexecuted(render(browser, write_sweep_report(out, manifest.parent.name)))
    original = manifest.read_text()
    doc = json.loads(original)
    doc["spec"]["name"] = PAYLOADS[2]  # the manifest's schema holds the sweep's name to plain text: refused on load
    manifest.write_text(json.dumps(doc))
    with pytest.raises(UsageError, match="spec/name"):
        write_sweep_report(out, manifest.parent.name)
    doc = json.loads(original)
    doc["cells"][0]["key"] = PAYLOADS[1]  # a cell's key the schema admits as any text: it must be drawn as text
    manifest.write_text(json.dumps(doc))
    _unexecuted(render(browser, write_sweep_report(out, manifest.parent.name)))


def test_markup_in_a_run_record_does_not_run(browser: str, tmp_path: Path) -> None:
    """Markup in every free-text field of a run's records that reaches the run report: sample text, the
    continuations, the traceback of a failure, environment and backend info, parity.json; the names themselves are
    refused by the record schema (tests/test_untrusted_input.py)."""
    from test_report import make_run, parity_record

    from harness.report import write_index, write_report

    out = tmp_path / "out"
    run_id = make_run(out, statuses={"numpy": "failed: RuntimeError: boom"})
    directory = out / "runs" / run_id
    for backend in ("torch", "numpy"):
        path = directory / f"{backend}.json"
        rec = json.loads(path.read_text())
        rec["environment"]["hostname"] = PAYLOADS[0]
        rec["backend_info"]["version"] = PAYLOADS[1]
        rec["error"] = PAYLOADS[2]
        if rec.get("text"):
            for sample in rec["text"]["samples"]:
                sample["text"] = PAYLOADS[2]
            for c in rec["text"]["continuations"]:
                c.update(prompt=PAYLOADS[0], reference=PAYLOADS[1], hypothesis=PAYLOADS[2])
            rec["text"]["sample_prompt"] = PAYLOADS[2]
        path.write_text(json.dumps(rec))
    parity = parity_record(directory, ("torch", "numpy"))
    parity["dtypes"] = {"torch": PAYLOADS[0]}
    (directory / "parity.json").write_text(json.dumps(parity))
    _unexecuted(render(browser, write_report(out, [run_id])))
    _unexecuted(render(browser, write_index(out)))


def test_markup_in_kit_check_paths_does_not_run(browser: str, tmp_path: Path) -> None:
    """`harness kit check` writes the kit's and the results' paths into its page."""
    import numpy as np

    from harness.cli.main import main

    kit = tmp_path / "kit"
    assert main(["kit", "export", "--steps", "1", "--out", str(kit)]) == 0
    results = tmp_path / (PAYLOADS[1].replace("src=x", "src=y") + ".npz")  # a name may hold anything but "/"
    with np.load(kit / "expected.npz") as f:
        np.savez(results, **{k: f[k] for k in f.files if k != "logits_loss"})
    page = tmp_path / "check.html"
    assert main(["kit", "check", str(kit), str(results), "--page", str(page),
                 "--verdict", str(tmp_path / "c.json")]) == 0
    _unexecuted(render(browser, page))


def test_sweep_verdicts_and_index_row_render_in_chromium(browser: str, tmp_path: Path) -> None:
    """A sweep report's per-dtype verdicts and the index's one row for the sweep: visible pills whose colours tell a
    clear verdict (green) from an inconclusive one (grey), no console error, nothing fetched."""
    from test_report import make_sweep

    from harness.report import write_index
    from harness.report.sweep import write_sweep_report

    out = tmp_path / "out"
    sweep_id = make_sweep(out, seeds=3, dtypes=("float32", "float64"),
                          ratios={("float64", s): 1.0 + 0.02 * (s - 1338) for s in (1337, 1338, 1339)})
    for page in (write_sweep_report(out, sweep_id), write_index(out)):
        result = render(browser, page, tmp_path / f"{page.stem}.png")
        assert result["errors"] == [] and result["requests"] == [result["url"]], result["errors"]
        assert result["width"] <= WIDTH, "the page scrolls sideways"
        pills = {p["text"]: p for p in result["pills"]}
        clear, unclear = pills["speed: torch 3× faster"], pills["speed: no clear difference"]
        for pill in (clear, unclear):
            assert pill["width"] > 40 and pill["height"] > 10, pill  # drawn, not collapsed
        assert "ok" in clear["cls"] and "neutral" in unclear["cls"]
        assert clear["background"] != unclear["background"] and clear["color"] != unclear["color"]


if __name__ == "__main__":  # python tests/test_browser.py REPORT.html SHOT.png
    binary, why = find_browser()
    if binary is None:
        sys.exit(why)
    print(json.dumps(render(binary, Path(sys.argv[1]), Path(sys.argv[2])), indent=1))
