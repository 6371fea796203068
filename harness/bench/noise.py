"""`harness bench noise`: does a speed verdict survive other work on the machine? A benchmark, not a test.

It runs the same small comparison four times, as a user would, each in its own `harness` process:

1. `harness sweep --sizes S --backends A,B --seeds N --steps M --no-text`, quiet;
2. the same sweep again, with `--hogs` busy-loop processes (`while True: pass`) running during the middle third
   of it (from 1/3 to 2/3 of the quiet sweep's duration);
3. `harness run --size S --steps R --backend A --no-text`, quiet;
4. the same run, with the hogs during its middle third.

and prints, in one table, both sweeps' speed ratios (the verdicts' paired timing, and the separate training runs'
ratio for contrast), the cells judged disturbed with their `contended_fraction`, both runs' median step times
with theirs, and four checks (what a robust speed verdict must survive): the disturbed sweep's ratio is within 15 %
of the quiet one; the disturbed sweep has cells with `contended_fraction` > 0 and its report names them; the
disturbed run's median step is within 15 % of the quiet one's, or the run is marked mostly disturbed; the disturbed
run carries `contended_fraction` > 0. Everything goes under `<out>/bench/noise-<UTC time>-<random>/` with a JSON
summary.

Run it on a machine that is otherwise quiet: the "quiet" legs must be quiet for the comparison to mean anything
(the script prints the load average before each leg). The hogs and the legs are this process's children, started
with the parent-death signal and ended with it (harness.run.processes): Ctrl-C or SIGTERM ends the leg (SIGINT, as
from a terminal) and the hogs; SIGKILL of this process ends them all too.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from harness.environment import loadavg
from harness.errors import UsageError
from harness.run import processes, records

TOLERANCE = 0.15  # a verdict survives the hogs when its ratio (or median step) moves by at most 15 %


def _load() -> str:
    load = loadavg()
    return " ".join(f"{x:.2f}" for x in load) if load else "?"


HOG = [sys.executable, "-c", "while True: pass"]  # one busy loop


class Hogs:
    """`n` busy-loop processes from `start_s` to `stop_s` seconds after `begin()` (`stop_s` None: until `finish()`),
    started and stopped from the main thread by `tick()`, which the leg's wait loop calls, each with the harness's
    parent-death signal (harness.run.processes.start): they end with this process, even when it is killed.
    `epochs` says when they ran, as time.time(), to line them up with the records' chunks (`at`); `window` the same
    in seconds after `begin()`."""

    def __init__(self, n: int, start_s: float, stop_s: float | None = None):
        self.n, self.start_s, self.stop_s = n, start_s, stop_s
        self.procs: list[subprocess.Popen] = []
        self.epochs: list[float] = []
        self._begun = 0.0

    @property
    def window(self) -> list[float]:
        return [e - self._begun for e in self.epochs]

    def begin(self) -> None:
        self._begun = time.time()

    def tick(self) -> float | None:
        """Start or stop the hogs if it is time; the seconds until the next change (None: no change is due)."""
        now = time.time() - self._begun
        if not self.epochs and now >= self.start_s:
            self.epochs = [time.time()]
            for _ in range(self.n):
                self.procs.append(processes.start(HOG))
        if len(self.epochs) == 1 and self.stop_s is not None and now >= self.stop_s:
            self._kill()
        if not self.epochs:
            return self.start_s - now
        return self.stop_s - now if len(self.epochs) == 1 and self.stop_s is not None else None

    def _kill(self) -> None:
        processes.stop(self.procs, signal.SIGKILL, grace_s=0)  # our own children, by their pid
        if len(self.epochs) == 1:
            self.epochs.append(time.time())

    def finish(self) -> list[float]:
        """Stop the hogs (if still running) and return `window`."""
        self._kill()
        return self.window


def overlaps(at: float | None, wall_s: float | None, epochs: list[float]) -> bool:
    """Whether a chunk that began at `at` (time.time()) and lasted `wall_s` ran at least half inside `epochs`."""
    if at is None or not wall_s or len(epochs) != 2:
        return False
    inside = min(at + wall_s, epochs[1]) - max(at, epochs[0])
    return inside >= 0.5 * wall_s


def _during(items: list[tuple[str, str, dict, list[float]]], epochs: list[float]) -> list[dict]:
    """Of (kind, backend, chunk, its step times), those that ran mostly during the hogs: their median step time and
    whether the contention rule judged them disturbed."""
    from harness.timing import contention

    out = []
    for kind, backend, chunk, times in items:
        if overlaps(chunk.get("at"), chunk.get("wall_s"), epochs) and times:
            out.append({"kind": kind, "backend": backend, "median_s": float(np.median(times)),
                        "judged": bool(contention.judge(chunk))})
    return out


def _harness(args: list[str], hogs: Hogs | None, quiet: bool) -> tuple[int, float]:
    """Run `harness ARGS` in a fresh interpreter (hogs started part-way); (exit status, seconds)."""
    cmd = [sys.executable, "-m", "harness.cli", *args]
    if not quiet:
        when = "" if not hogs else ("for the whole invocation" if hogs.stop_s is None
                                    else f"from {hogs.start_s:.0f} s to {hogs.stop_s:.0f} s")
        print(f"noise: load average {_load()}; $ harness {' '.join(args)}"
              + (f"  (+{hogs.n} hogs {when})" if hogs else ""),
              file=sys.stderr, flush=True)
    t0 = time.monotonic()
    out = subprocess.DEVNULL if quiet else None
    with processes.ending() as children:  # Ctrl-C, SIGTERM or an error here: the leg gets SIGINT, as from a terminal
        children.append(proc := processes.start(cmd, stdout=out, stderr=out))
        if hogs:
            hogs.begin()
        try:
            while True:
                try:
                    code = proc.wait(timeout=hogs.tick() if hogs else None)
                    break
                except subprocess.TimeoutExpired:
                    continue  # a change of the hogs is due
        finally:
            if hogs:
                hogs.finish()
    return code, time.monotonic() - t0


def sweep_result(out: Path, epochs: list[float] | None = None) -> dict[str, Any]:
    """The first comparison of the one sweep under `out`: paired ratio, training ratio, disturbed cells; with the
    hogs' `epochs`, how many training chunks and paired bursts ran during them and how many of those were judged
    disturbed (the detection's recall)."""
    from harness.report.results import load_runs
    from harness.report.sweep import comparisons, paired_docs
    from harness.sweep import manifest as mf
    from harness.timing.paired import speed_words

    (sweep_dir,) = sorted(records.SweepPaths.root(out).iterdir())
    m = mf.Manifest.load(out, sweep_dir.name)
    df = load_runs(out, sweep_id=m.sweep_id).sort_values("cell", kind="stable")  # the spec's order of backends
    comps = comparisons(df, paired_docs(out, m))
    if not comps:
        return {"sweep_id": m.sweep_id, "error": "no comparison (did both backends complete?)"}
    c = comps[0]
    s, t = c["speed"], c["training"]
    page = (out / f"sweep-{m.sweep_id}.html").read_text(encoding="utf-8") if (
        out / f"sweep-{m.sweep_id}.html").exists() else ""
    cells = [{"backend": r["backend"], "seed": int(r["seed"]), "contended_fraction": r["contended_fraction"],
              "mostly_disturbed": bool(r["mostly_disturbed"]), "step_median_s": r["step_median_s"]}
             for _, r in df.iterrows()]
    hit = [x for x in cells if (x["contended_fraction"] or 0) > 0]
    named = all(f"{c['label']}/{x['backend']} seed {x['seed']} (contended_fraction" in page for x in hit)
    items = [("training chunk", cell["backend"], ch, times) for cell in m.cells if cell.get("run_id")
             for ch, times in _record_chunks(out, cell["run_id"], cell["backend"])]
    items += [("paired burst", name.split("[")[0], b.get("chunk") or {}, list(b.get("times") or []))
              for doc in paired_docs(out, m) for s_ in doc.get("sessions") or []
              for r in s_.get("rounds") or [] for name, b in (r.get("bursts") or {}).items()]
    return {
        "sweep_id": m.sweep_id, "comparison": c["name"], "a": c["a"], "b": c["b"], "verdict": c["sentence"],
        "level": c["level"],
        "paired": None if not s or s.get("ratio") is None else {
            "time_ratio": s["ratio"], "lo": s.get("lo"), "hi": s.get("hi"), "usable": s.get("usable"),
            "rounds": s.get("rounds"), "disturbed_rounds": s.get("disturbed_rounds"), "text": speed_words(s)["text"]},
        "training": None if t is None else {"time_ratio": t.estimate, "lo": t.lo, "hi": t.hi,
                                            "text": speed_words({"a": c["a"], "b": c["b"], "ratio": t.estimate,
                                                                 "lo": t.lo, "hi": t.hi})["text"]},
        "cells": cells, "disturbed_cells": hit, "report_names_them": bool(hit) and named,
        "during_hogs": _during(items, epochs or []),
        "report": str(out / f"sweep-{m.sweep_id}.html"),
    }


def _record_chunks(out: Path, run_id: str, backend: str) -> list[tuple[dict, list[float]]]:
    """A run record's chunks, each with the step times it covers."""
    try:
        rec = records.load_record(records.RunPaths(out, run_id).record(backend), backend)
    except UsageError:
        return []
    times = list((rec.get("steps") or {}).get("time_s") or [])
    return [(c, [t for t in times[c["step"]:c["step"] + c["n"]] if t is not None]) for c in rec.get("chunks") or []]


def run_result(out: Path, epochs: list[float] | None = None) -> dict[str, Any]:
    """The median step time and contention of the one single-backend run under `out` (with the hogs' `epochs`: how
    many of its chunks ran during them and were judged disturbed)."""
    (run_dir,) = sorted(records.RunPaths.root(out).iterdir())
    _, recs = records.load_run(out, run_dir.name)
    rec = recs[0]
    items = [("training chunk", rec["backend"], c, times) for c, times in _record_chunks(out, run_dir.name,
                                                                                       rec["backend"])]
    t = rec.get("timings") or {}
    cont = t.get("contention") or {}
    return {"run_id": run_dir.name, "backend": rec["backend"], "status": rec["status"],
            "step_median_s": t.get("step_median_s"), "steady_steps": t.get("steady_steps"),
            "figures_from": t.get("figures_from"),
            "disturbed_steps": t.get("disturbed_steps"), "contended_fraction": cont.get("contended_fraction"),
            "mostly_disturbed": bool(cont.get("mostly_disturbed")), "reasons": cont.get("reasons"),
            "during_hogs": _during(items, epochs or [])}


def _time_ratio(sweep: dict[str, Any]) -> float | None:
    """The paired time ratio of a sweep leg as first backend / second backend in alphabetical order (the two legs
    must not be compared the wrong way round)."""
    p = sweep.get("paired")
    if not p or not p.get("time_ratio"):
        return None
    return p["time_ratio"] if sweep["a"] < sweep["b"] else 1 / p["time_ratio"]


def _change(a: float | None, b: float | None) -> float | None:
    return None if not a or not b else b / a - 1


def detection(quiet: dict[str, Any], disturbed: dict[str, Any]) -> tuple[int, int, int]:
    """(slowed, slowed and judged disturbed, ran during the hogs) over the disturbed leg's chunks and bursts: a
    chunk is slowed when its median step exceeds its backend's quiet median step by more than 15 %. A chunk the
    hogs did not slow (the scheduler kept a core for it) need not be judged disturbed; one they slowed must be."""
    quiet_median: dict[str, float] = {}
    for backend in {c["backend"] for c in quiet.get("cells") or []}:
        values = [c["step_median_s"] for c in quiet["cells"] if c["backend"] == backend and c.get("step_median_s")]
        if values:
            quiet_median[backend] = float(np.median(values))
    if quiet.get("step_median_s") and quiet.get("backend"):  # a run leg
        quiet_median[quiet["backend"]] = quiet["step_median_s"]
    during = disturbed.get("during_hogs") or []
    slowed = [d for d in during if d["backend"] in quiet_median
              and d["median_s"] > (1 + TOLERANCE) * quiet_median[d["backend"]]]
    return len(slowed), sum(1 for d in slowed if d["judged"]), len(during)


def checks(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The four checks of a finished noise benchmark (the module docstring): does the speed verdict survive?"""
    sq, sd, rq, rd = (result[k] for k in ("sweep_quiet", "sweep_disturbed", "run_quiet", "run_disturbed"))
    out = []
    change = _change(_time_ratio(sq), _time_ratio(sd))
    out.append({"check": "sweep: disturbed paired ratio within 15 % of the quiet one", "value": change,
                "ok": change is not None and abs(change) <= TOLERANCE})
    slowed, judged, ran = detection(sq, sd)
    named = not sd.get("disturbed_cells") or bool(sd.get("report_names_them"))
    out.append({"check": "sweep: every training chunk or paired burst the hogs slowed by more than 15 % is judged "
                         "disturbed (and the report names the cells)",
                "value": f"{judged} of {slowed} ({ran} ran during the hogs)",
                "ok": ran > 0 and judged == slowed and named})
    change = _change(rq.get("step_median_s"), rd.get("step_median_s"))
    marked = rd.get("mostly_disturbed")
    out.append({"check": "run: disturbed median step within 15 % of the quiet one, or marked mostly disturbed",
                "value": change, "ok": (change is not None and abs(change) <= TOLERANCE) or bool(marked)})
    frac = rd.get("contended_fraction")
    out.append({"check": "run: the disturbed run carries contended_fraction > 0", "value": frac,
                "ok": bool(frac and frac > 0)})
    return out


def quiet_legs_disturbed(result: dict[str, Any]) -> str:
    """Why the quiet legs were not quiet ('' when they were): disturbed cells, a disturbed run, an unusable ratio."""
    why = []
    hit = result["sweep_quiet"].get("disturbed_cells") or []
    if hit:
        why.append(f"{len(hit)} quiet sweep cell(s) disturbed")
    p = result["sweep_quiet"].get("paired") or {}
    if p and not p.get("usable"):
        why.append("the quiet sweep's paired timing was mostly disturbed")
    frac = result["run_quiet"].get("contended_fraction")
    if frac:
        why.append(f"the quiet run has contended_fraction {frac:.2f}")
    return "; ".join(why)


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{x * 100:+.1f} %"


def format_result(result: dict[str, Any]) -> str:
    """The printed summary: both ratios side by side, the disturbed cells, both runs, the checks."""
    from harness.timing.steady import FIGURES_ALL

    o = result["options"]
    lines = [f"noise benchmark: {o['size']}, {' vs '.join(o['backends'])}, sweep {o['seeds']} seeds x {o['steps']} "
             f"steps, run {o['run_steps']} steps; {o['hogs']} busy-loop hog(s) during the middle third of the "
             f"disturbed sweep and all of the disturbed run ({o['cores']} usable cores)"]
    for leg in ("sweep_quiet", "sweep_disturbed"):
        r = result[leg]
        name = leg.replace("_", " ")
        if r.get("error"):
            lines.append(f"{name:<16} {r['error']}")
            continue
        p, t = r.get("paired"), r.get("training")
        ptxt = "no paired timing" if not p else (p["text"] + ("" if p["usable"] else " (mostly disturbed)")
                                                 + f", {p['disturbed_rounds']} of {p['rounds']} rounds disturbed")
        lines.append(f"{name:<16} paired timing: {ptxt}")
        lines.append(f"{'':<16} training runs (not paired): {t['text'] if t else '—'}")
        hit = r.get("disturbed_cells") or []
        cells = ", ".join(f"{x['backend']} seed {x['seed']} contended_fraction {x['contended_fraction']:.2f}"
                          f"{' (mostly)' if x['mostly_disturbed'] else ''}" for x in hit) or "none"
        lines.append(f"{'':<16} cells disturbed: {len(hit)} of {len(r.get('cells') or [])}: {cells}")
        if leg == "sweep_disturbed":
            slowed, judged, ran = detection(result["sweep_quiet"], r)
            flagged = sum(1 for d in r.get("during_hogs") or [] if d["judged"])
            lines.append(f"{'':<16} during the hogs: {ran} training chunks and paired bursts ran, {flagged} judged "
                         f"disturbed; {slowed} slowed by more than 15 %, {judged} of them judged disturbed")
    for leg in ("run_quiet", "run_disturbed"):
        r = result[leg]
        med = r.get("step_median_s")
        frac = r.get("contended_fraction")
        if r.get("error"):
            lines.append(f"{leg.replace('_', ' '):<16} {r['error']}")
            continue
        source = (f"over {r.get('steady_steps')} undisturbed steps ({r.get('disturbed_steps')} disturbed left out)"
                  if r.get("figures_from") != FIGURES_ALL
                  else f"over all {r.get('steady_steps')} steady steps (none undisturbed)")
        lines.append(f"{leg.replace('_', ' '):<16} {r.get('backend')} median step "
                     f"{'—' if med is None else f'{med * 1e3:.3f} ms'} {source}; contended_fraction "
                     f"{'—' if frac is None else f'{frac:.2f}'}"
                     f"{'; marked mostly disturbed' if r.get('mostly_disturbed') else ''}")
    noisy = quiet_legs_disturbed(result)
    if noisy:
        lines.append(f"warning: the quiet legs were not quiet ({noisy}): the machine had other work; rerun on an "
                     "idle machine before reading the checks as the done-when measurement")
    for c in result["checks"]:
        v = c["value"]
        shown = _pct(v) if isinstance(v, float) and "within" in c["check"] else v
        lines.append(f"check: {c['check']}: {shown} -> {'PASS' if c['ok'] else 'FAIL'}")
    return "\n".join(lines)


def _leg_failed(argv: list[str], code: int, root: Path) -> int:
    """A leg that did not complete ends the benchmark: no ratio or check would mean anything."""
    print(f"noise: `harness {' '.join(argv)}` exited {code} (run it alone to see why); the legs so far are under "
          f"{root}; no checks", file=sys.stderr)
    return 1
