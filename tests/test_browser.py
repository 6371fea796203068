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
import re
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

    def wait_event(self, method: str, session: str | None = None) -> dict:
        """Wait for (and return) the first event `method` (of tab `session`, where given), looking at those already
        received first."""
        def wanted(ev: dict) -> bool:
            return ev.get("method") == method and (session is None or ev.get("sessionId") == session)

        for i, ev in enumerate(self.events):
            if wanted(ev):
                return self.events.pop(i)
        while True:
            ev = self._read()
            if wanted(ev):
                return ev
            self.events.append(ev)

    def take_events(self, session: str) -> list[dict]:
        """The events received so far from tab `session`, removed from `events`."""
        mine = [ev for ev in self.events if ev.get("sessionId") == session]
        self.events = [ev for ev in self.events if ev.get("sessionId") != session]
        return mine

    def __enter__(self) -> DevTools:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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


def render(tools: DevTools | str, page: Path, screenshot: Path | None = None,
           expression: str = MEASURE, width: int = WIDTH) -> dict[str, Any]:
    """Load `page` in a new tab, `width` pixels wide, of the browser session `tools` (or of a browser `tools` names,
    started for this page alone); return what `expression` measures (figure sizes, pills, ...), the console errors
    and requests of that tab, and save a screenshot."""
    if isinstance(tools, str):
        with DevTools(tools) as own:
            return render(own, page, screenshot, expression, width)
    url = page.resolve().as_uri()
    target = tools.send("Target.createTarget", {"url": "about:blank"})["targetId"]
    session = tools.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
    try:
        for domain in ("Page", "Runtime", "Log", "Network"):
            tools.send(f"{domain}.enable", session=session)
        tools.send("Emulation.setDeviceMetricsOverride", {"width": width, "height": 900, "deviceScaleFactor": 1,
                                                          "mobile": False}, session=session)
        tools.send("Page.navigate", {"url": url}, session=session)
        tools.wait_event("Page.loadEventFired", session)
        measured = json.loads(tools.send("Runtime.evaluate", {"expression": expression, "returnByValue": True},
                                         session=session)["result"]["value"])
        if screenshot is not None:
            height = int(min(measured.get("height", 900), 16000))
            shot = tools.send("Page.captureScreenshot", {
                "format": "png", "captureBeyondViewport": True,
                "clip": {"x": 0, "y": 0, "width": width, "height": height, "scale": 1}}, session=session)
            screenshot.write_bytes(base64.b64decode(shot["data"]))
        errors, requests = [], []
        for ev in tools.take_events(session):
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
        tools.send("Target.closeTarget", {"targetId": target})


# --- the tests -------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def browser() -> Any:
    """One browser session for the whole module: each page opens in a tab of its own."""
    binary, why = find_browser()
    if binary is None:
        pytest.skip(why)
    with DevTools(binary) as tools:
        yield tools


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


def test_report_renders_in_chromium(browser: DevTools, tmp_path: Path) -> None:
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


def test_failed_report_shows_banner_first(browser: DevTools, tmp_path: Path) -> None:
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


# --- markup planted in what a record holds must never run -------------------------------------------------------------
PWNED = "PWNED"
PAYLOADS = [f'x"><script>document.title="{PWNED}"</script>', f"<img src=x onerror=\"document.title='{PWNED}'\">",
            f"</pre><script>document.title='{PWNED}'</script>"]


def _unexecuted(result: dict) -> None:
    assert PWNED not in result["title"], result["title"]
    assert result["scripts"] == 0 and result["handlers"] == 0, result
    assert result["requests"] == [result["url"]], "the page loaded something besides itself"
    assert result["errors"] == [], result["errors"]


def test_markup_in_a_sweep_record_does_not_run(browser: DevTools, tmp_path: Path) -> None:
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


def test_markup_in_a_run_record_does_not_run(browser: DevTools, tmp_path: Path) -> None:
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


def test_markup_in_kit_check_paths_does_not_run(browser: DevTools, tmp_path: Path) -> None:
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


def test_sweep_verdicts_and_index_row_render_in_chromium(browser: DevTools, tmp_path: Path) -> None:
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


# --- every verdict in the colour of its meaning, one palette on every page ------------------------------------------
MARKS = """JSON.stringify((() => {
  const words = e => e.textContent.replace(/\\s+/g, ' ').trim();
  const own = e => Array.from(e.childNodes).filter(n => n.nodeType === 3).map(n => n.textContent).join(' ')
    .replace(/\\s+/g, ' ').trim();
  const drawn = (e, box) => ({color: getComputedStyle(e).color, background: getComputedStyle(box).backgroundColor});
  const marks = [];
  for (const e of document.querySelectorAll('.pill')) marks.push({kind: 'pill', text: words(e), ...drawn(e, e)});
  for (const e of document.querySelectorAll('.banner')) marks.push({kind: 'banner', text: words(e), ...drawn(e, e)});
  for (const e of document.querySelectorAll('.verdict > .label'))
    marks.push({kind: 'label', text: own(e), ...drawn(e, e.parentElement)});
  const broken = [], sci = /(?<![\\w.])[-+]?\\d+(\\.\\d+)?[eE][-+]?\\d+\\b/g;  // harness.pages._SCI
  let numbers = 0;
  const walk = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
  for (let n = walk.nextNode(); n; n = walk.nextNode()) {
    if (n.parentElement.closest('svg')) continue;
    for (const m of n.textContent.matchAll(sci)) {
      const r = document.createRange();
      r.setStart(n, m.index);
      r.setEnd(n, m.index + m[0].length);
      const lines = new Set(Array.from(r.getClientRects()).map(x => Math.round(x.top)));
      numbers += 1;
      if (lines.size > 1) broken.push(m[0]);
    }
  }
  const text = document.body.innerText;
  return {marks, broken, numbers, ticks: text.match(/`[^`\\n]+`/g) || [], text,
          codes: document.querySelectorAll('code').length, height: document.documentElement.scrollHeight};
})())"""

# What a verdict's words mean, hence the level of harness.pages it must be drawn in (the first match wins).
MEANINGS = [
    ("neutral", r"no verdict|no clear difference|not compared|single backend|\(\d+ seeds?\)|\(noisy\)|not given"),
    ("error", r"\bFAIL|\bdiffer|\bfailed\b|\bno records?\b|not a fair|unreadable|nothing compared"),
    ("warn", r"too busy|incomplete|interrupted|still running|disturbed|busy machine"),
    ("ok", r"\bpass\b|\bagree\b|× faster|^ok$"),
]


PASS = re.compile(r"\bpass\b|\bagree\b", re.I)  # whatever else the words say, never drawn as a caveat or failure


def meaning(text: str) -> str | None:
    return next((level for level, words in MEANINGS if re.search(words, text, re.I)), None)


def drawn_level(mark: dict) -> str:
    """The level of harness.pages.PALETTE whose text colour and background the browser drew `mark` in."""
    from harness.pages import PALETTE

    def rgb(hex_colour: str) -> str:
        return "rgb({}, {}, {})".format(*(int(hex_colour[i:i + 2], 16) for i in (1, 3, 5)))

    fg = [lv for lv, (f, _) in PALETTE.items() if rgb(f) == mark["color"]]
    bg = [lv for lv, (_, b) in PALETTE.items() if rgb(b) == mark["background"]]
    assert fg == bg and len(fg) == 1, f"drawn outside the one palette: {mark}"
    return fg[0]


@pytest.fixture(scope="module")
def verdict_pages(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A run, a parity check, a sweep, their index and two kit checks, built in this process from synthetic records
    (figures stubbed: only the words and colours are read) and one real kit."""
    from test_report import _chunks, make_run, make_sweep, parity_record, write_paired

    from harness import store
    from harness.report import figures, sweep, write_index, write_report

    out = tmp_path_factory.mktemp("pages")
    with pytest.MonkeyPatch.context() as mp:
        for name in ("loss_figure", "deviation_figure", "cost_figure", "scaling_figure"):
            mp.setattr(figures, name, lambda *a, **k: None)
        mp.setattr(sweep, "wallclock_figures", lambda *a, **k: [])
        # a run whose losses agree (0.4 % apart), torch interrupted, numpy on a busy machine, the paired timing too
        run_id = make_run(out, val_offset={"numpy": 0.01}, statuses={"torch": "interrupted"})
        _busy(store.RunPaths(out, run_id).dir / "numpy.json", _chunks)
        write_paired(out, run_id, [2.0] * 3 + [5.0] * 9, tuple(range(3, 12)))
        pages = {"run": write_report(out, [run_id])}
        # a parity check that passes, numpy on a busy machine (a parity check times nothing: no caveat of speed)
        parity_id = make_run(out, dropout=0.0, loss_noise=1e-6, text=False)
        directory = store.RunPaths(out, parity_id).dir
        spec = json.loads((directory / "spec.json").read_text())
        store.atomic_write_json(directory / "spec.json", dict(spec, parity={"opt_steps": 3, "reference": "numpy"}))
        _busy(directory / "numpy.json", _chunks)
        store.atomic_write_json(directory / "parity.json", parity_record(directory, ("torch", "numpy")))
        pages["parity"] = write_report(out, [parity_id])
        # a sweep whose losses are 0.3 to 0.5 % apart in every seed: inside the band, a pass; torch 3x faster
        sweep_id = make_sweep(out, seeds=3)
        for i, path in enumerate(sorted(out.glob("runs/*/numpy.json"))):
            rec = json.loads(path.read_text())
            if rec["run_id"] != parity_id and rec["run_id"] != run_id:
                for e in rec["evals"]:
                    e["val_loss"] += 0.008 + 0.002 * (i % 3)
                store.atomic_write_json(path, rec)
        pages["sweep"] = sweep.write_sweep_report(out, sweep_id)
        pages["index"] = write_index(out)
    pages.update(_kit_pages(tmp_path_factory.mktemp("kit")))
    return pages


def _busy(path: Path, chunks: Any) -> None:
    """Make the record at `path` one of a backend that trained on a busy machine (most steady steps disturbed)."""
    rec = json.loads(path.read_text())
    rec["chunks"] = chunks(len(rec["steps"]["step"]), 10, len(rec["steps"]["step"]))
    del rec["timings"]["step_median_s"]
    path.write_text(json.dumps(rec))


def _kit_pages(tmp: Path) -> dict[str, Path]:
    """`harness kit check` pages of a port that passes (the oracle's own answers) and of one that fails (every
    number it gives off by 1 %: every depth fails, the table's columns fill up)."""
    import numpy as np

    from harness.cli.main import main

    kit = tmp / "kit"
    assert main(["kit", "export", "--steps", "1", "--out", str(kit), "--quiet"]) == 0
    with np.load(kit / "expected.npz") as f:
        arrays = {k: f[k] for k in f.files if k != "logits_loss"}
    np.savez(tmp / "good.npz", **arrays)
    np.savez(tmp / "bad.npz", **{k: v * 1.01 if v.dtype.kind == "f" else v for k, v in arrays.items()})
    for name in ("good", "bad"):
        code = main(["kit", "check", str(kit), str(tmp / f"{name}.npz"), "--out", str(tmp)])
        assert code == (0 if name == "good" else 1)
    return {"kit-pass": tmp / "good.check.html", "kit-fail": tmp / "bad.check.html"}


EXPECTED = {  # marks each page must show, in the level of their meaning (so that no page passes by showing none)
    "run": {("label", "losses agree"), ("pill", "losses agree"), ("pill", "incomplete"),
            ("pill", "speed: machine too busy")},
    "parity": {("label", "parity: pass"), ("pill", "parity: pass"), ("pill", "ok")},
    "sweep": {("pill", "losses agree"), ("pill", "speed: torch 3× faster")},
    "index": {("pill", "losses agree"), ("pill", "parity: pass"), ("pill", "speed: torch 3× faster")},
    "kit-pass": {("pill", "ok")},
    "kit-fail": {("pill", "FAIL")},
}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_every_verdict_is_drawn_in_the_colour_of_its_meaning(browser: DevTools, verdict_pages: dict[str, Path],
                                                             name: str, tmp_path: Path) -> None:
    """Read from the browser: every pill, banner and verdict box is drawn in harness.pages' palette, in the level
    its words mean (a pass green, never in a caveat's amber); numbers stay on one line; inline code is code."""
    shot = tmp_path / f"{name}.png"
    result = render(browser, verdict_pages[name], shot, MARKS)
    assert result["errors"] == [] and result["requests"] == [result["url"]], result["errors"]
    seen = set()
    for mark in result["marks"]:
        level, means = drawn_level(mark), meaning(mark["text"])
        assert not (PASS.search(mark["text"]) and level in ("warn", "error")), f"{name}: a pass drawn {level}: {mark}"
        assert means is None or level == means, f"{name}: {mark['text']!r} means {means}, drawn {level}"
        seen.add((mark["kind"], mark["text"]))
    assert EXPECTED[name] <= seen, EXPECTED[name] - seen
    assert result["broken"] == [], f"{name}: numbers broken across lines: {result['broken']}"
    assert result["ticks"] == [], f"{name}: backticks shown as text: {result['ticks']}"
    if name.startswith("kit"):
        assert result["numbers"] > 10 and result["codes"] >= 3
    if name == "parity":  # a correctness page: nothing of speed (but the note of how to read it, that says so)
        text = result["text"][:result["text"].rindex("How to read this")]
        assert not [w for w in ("tokens/s", "faster", "throughput", "Speed", "speed", "paired timing") if w in text]
        assert text.startswith("nanogpt-parity parity check: small — torch vs numpy")
    keep = os.environ.get("HARNESS_SCREENSHOT_DIR")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, Path(keep) / f"palette-{name}.png")


if __name__ == "__main__":  # python tests/test_browser.py REPORT.html SHOT.png
    binary, why = find_browser()
    if binary is None:
        sys.exit(why)
    print(json.dumps(render(binary, Path(sys.argv[1]), Path(sys.argv[2])), indent=1))
