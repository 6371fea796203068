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

import numpy as np

from harness.environment import loadavg
from harness.errors import UsageError
from harness.run import processes
from harness.store import RunPaths, RunRecord, SweepPaths, load_run
from harness.store.bench import (
    DuringHogs,
    NoiseCell,
    NoiseCheck,
    NoiseRecord,
    PairedLeg,
    RunLeg,
    SweepLeg,
    TrainingLeg,
)

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


def _during(items: list[tuple[str, str, dict, list[float]]], epochs: list[float]) -> list[DuringHogs]:
    """Of (kind, backend, chunk, its step times), those that ran mostly during the hogs: their median step time and
    whether the contention rule judged them disturbed."""
    from harness.timing import contention

    out = []
    for kind, backend, chunk, times in items:
        if overlaps(chunk.get("at"), chunk.get("wall_s"), epochs) and times:
            out.append(DuringHogs(kind=kind, backend=backend, median_s=float(np.median(times)),
                                  judged=bool(contention.judge(chunk))))
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


def sweep_result(out: Path, epochs: list[float] | None = None) -> SweepLeg:
    """The first comparison of the one sweep under `out`: paired ratio, training ratio, disturbed cells; with the
    hogs' `epochs`, how many training chunks and paired bursts ran during them and how many of those were judged
    disturbed (the detection's recall)."""
    from harness.report.results import load_runs
    from harness.report.sweep import comparisons, paired_docs
    from harness.sweep import manifest as mf
    from harness.timing.paired import speed_words

    (sweep,) = SweepPaths.under(out)
    m = mf.Manifest.load(out, sweep.sweep_id)
    df = load_runs(out, sweep_id=m.sweep_id).sort_values("cell", kind="stable")  # the spec's order of backends
    comps = comparisons(df, paired_docs(out, m))
    if not comps:
        return SweepLeg(sweep_id=m.sweep_id, error="no comparison (did both backends complete?)")
    c = comps[0]
    s, t = c["speed"], c["training"]
    page = (out / f"sweep-{m.sweep_id}.html").read_text(encoding="utf-8") if (
        out / f"sweep-{m.sweep_id}.html").exists() else ""
    cells = [NoiseCell(backend=r["backend"], seed=int(r["seed"]), contended_fraction=r["contended_fraction"],
                       mostly_disturbed=bool(r["mostly_disturbed"]), step_median_s=r["step_median_s"])
             for _, r in df.iterrows()]
    hit = [x for x in cells if (x.contended_fraction or 0) > 0]
    named = all(f"{c['label']}/{x.backend} seed {x.seed} (contended_fraction" in page for x in hit)
    items = [("training chunk", cell.backend, ch, times) for cell in m.cells if cell.run_id
             for ch, times in _record_chunks(m.run(cell), cell.backend)]
    items += [("paired burst", name.split("[")[0], b.chunk or {}, list(b.times))
              for doc in paired_docs(out, m) for s_ in doc.sessions
              for r in s_.rounds for name, b in r.bursts.items()]
    return SweepLeg(
        sweep_id=m.sweep_id, comparison=c["name"], a=c["a"], b=c["b"], verdict=c["sentence"], level=c["level"],
        paired=None if not s or s.get("ratio") is None else PairedLeg(
            time_ratio=s["ratio"], lo=s.get("lo"), hi=s.get("hi"), usable=s.get("usable"), rounds=s.get("rounds"),
            disturbed_rounds=s.get("disturbed_rounds"), text=speed_words(s)["text"]),
        training=None if t is None else TrainingLeg(
            time_ratio=t.estimate, lo=t.lo, hi=t.hi,
            text=speed_words({"a": c["a"], "b": c["b"], "ratio": t.estimate, "lo": t.lo, "hi": t.hi})["text"]),
        cells=cells, disturbed_cells=hit, report_names_them=bool(hit) and named,
        during_hogs=_during(items, epochs or []), report=str(out / f"sweep-{m.sweep_id}.html"))


def _record_chunks(paths: RunPaths, backend: str) -> list[tuple[dict, list[float]]]:
    """A run record's chunks, each with the step times it covers."""
    try:
        rec = RunRecord.load(paths.record(backend), backend)
    except UsageError:
        return []
    times = rec.curves.time_s
    return [(c, [t for t in times[c["step"]:c["step"] + c["n"]] if t is not None]) for c in rec.curves.chunks]


def run_result(out: Path, epochs: list[float] | None = None) -> RunLeg:
    """The median step time and contention of the one single-backend run under `out` (with the hogs' `epochs`: how
    many of its chunks ran during them and were judged disturbed)."""
    (paths,) = RunPaths.under(out)
    _, recs = load_run(paths)
    rec = recs[0]
    items = [("training chunk", rec.backend, c, times) for c, times in _record_chunks(paths, rec.backend)]
    t = rec.timings
    cont = t.contention
    return RunLeg(run_id=paths.run_id, backend=rec.backend, status=rec.status_text, step_median_s=t.step_median_s,
                  steady_steps=t.steady_steps, figures_from=t.figures_from, disturbed_steps=t.disturbed_steps,
                  contended_fraction=cont.contended_fraction if cont else None,
                  mostly_disturbed=bool(cont and cont.mostly_disturbed), reasons=cont.reasons if cont else None,
                  during_hogs=_during(items, epochs or []))


def failed_leg(kind: str, error: str) -> SweepLeg | RunLeg:
    """A leg that could not be read: its error."""
    return SweepLeg(error=error) if kind == "sweep" else RunLeg(error=error)


def _time_ratio(sweep: SweepLeg) -> float | None:
    """The paired time ratio of a sweep leg as first backend / second backend in alphabetical order (the two legs
    must not be compared the wrong way round)."""
    p = sweep.paired
    if not p or not p.time_ratio:
        return None
    return p.time_ratio if sweep.a < sweep.b else 1 / p.time_ratio


def _change(a: float | None, b: float | None) -> float | None:
    return None if not a or not b else b / a - 1


def detection(quiet: SweepLeg | RunLeg, disturbed: SweepLeg | RunLeg) -> tuple[int, int, int]:
    """(slowed, slowed and judged disturbed, ran during the hogs) over the disturbed leg's chunks and bursts: a
    chunk is slowed when its median step exceeds its backend's quiet median step by more than 15 %. A chunk the
    hogs did not slow (the scheduler kept a core for it) need not be judged disturbed; one they slowed must be."""
    quiet_median: dict[str, float] = {}
    cells = (quiet.cells or []) if isinstance(quiet, SweepLeg) else []
    for backend in {c.backend for c in cells}:
        values = [c.step_median_s for c in cells if c.backend == backend and c.step_median_s]
        if values:
            quiet_median[backend] = float(np.median(values))
    if isinstance(quiet, RunLeg) and quiet.step_median_s and quiet.backend:  # a run leg
        quiet_median[quiet.backend] = quiet.step_median_s
    during = disturbed.during_hogs or []
    slowed = [d for d in during if d.backend in quiet_median
              and d.median_s > (1 + TOLERANCE) * quiet_median[d.backend]]
    return len(slowed), sum(1 for d in slowed if d.judged), len(during)


def checks(result: NoiseRecord) -> list[NoiseCheck]:
    """The four checks of a finished noise benchmark (the module docstring): does the speed verdict survive?"""
    sq, sd, rq, rd = result.sweep_quiet, result.sweep_disturbed, result.run_quiet, result.run_disturbed
    out = []
    change = _change(_time_ratio(sq), _time_ratio(sd))
    out.append(NoiseCheck(check="sweep: disturbed paired ratio within 15 % of the quiet one", value=change,
                          ok=change is not None and abs(change) <= TOLERANCE))
    slowed, judged, ran = detection(sq, sd)
    named = not sd.disturbed_cells or bool(sd.report_names_them)
    out.append(NoiseCheck(check="sweep: every training chunk or paired burst the hogs slowed by more than 15 % is "
                                "judged disturbed (and the report names the cells)",
                          value=f"{judged} of {slowed} ({ran} ran during the hogs)",
                          ok=ran > 0 and judged == slowed and named))
    change = _change(rq.step_median_s, rd.step_median_s)
    marked = rd.mostly_disturbed
    out.append(NoiseCheck(check="run: disturbed median step within 15 % of the quiet one, or marked mostly disturbed",
                          value=change, ok=(change is not None and abs(change) <= TOLERANCE) or bool(marked)))
    frac = rd.contended_fraction
    out.append(NoiseCheck(check="run: the disturbed run carries contended_fraction > 0", value=frac,
                          ok=bool(frac and frac > 0)))
    return out


def quiet_legs_disturbed(result: NoiseRecord) -> str:
    """Why the quiet legs were not quiet ('' when they were): disturbed cells, a disturbed run, an unusable ratio."""
    why = []
    hit = result.sweep_quiet.disturbed_cells or []
    if hit:
        why.append(f"{len(hit)} quiet sweep cell(s) disturbed")
    p = result.sweep_quiet.paired
    if p and not p.usable:
        why.append("the quiet sweep's paired timing was mostly disturbed")
    frac = result.run_quiet.contended_fraction
    if frac:
        why.append(f"the quiet run has contended_fraction {frac:.2f}")
    return "; ".join(why)


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{x * 100:+.1f} %"


def format_result(result: NoiseRecord) -> str:
    """The printed summary: both ratios side by side, the disturbed cells, both runs, the checks."""
    o = result.options
    lines = [f"noise benchmark: {o.size}, {' vs '.join(o.backends)}, sweep {o.seeds} seeds x {o.steps} "
             f"steps, run {o.run_steps} steps; {o.hogs} busy-loop hog(s) during the middle third of the "
             f"disturbed sweep and all of the disturbed run ({o.cores} usable cores)"]
    for name, r in (("sweep quiet", result.sweep_quiet), ("sweep disturbed", result.sweep_disturbed)):
        lines += _sweep_lines(name, r, result.sweep_quiet)
    for name, r in (("run quiet", result.run_quiet), ("run disturbed", result.run_disturbed)):
        lines += _run_lines(name, r)
    noisy = quiet_legs_disturbed(result)
    if noisy:
        lines.append(f"warning: the quiet legs were not quiet ({noisy}): the machine had other work; rerun on an "
                     "idle machine before reading the checks as the done-when measurement")
    for c in result.checks:
        v = c.value
        shown = _pct(v) if isinstance(v, float) and "within" in c.check else v
        lines.append(f"check: {c.check}: {shown} -> {'PASS' if c.ok else 'FAIL'}")
    return "\n".join(lines)


def _sweep_lines(name: str, r: SweepLeg, quiet: SweepLeg) -> list[str]:
    """A sweep leg's lines of the summary: its ratios, its disturbed cells, and (the disturbed leg) the detection."""
    if r.error:
        return [f"{name:<16} {r.error}"]
    p, t = r.paired, r.training
    ptxt = "no paired timing" if not p else (p.text + ("" if p.usable else " (mostly disturbed)")
                                             + f", {p.disturbed_rounds} of {p.rounds} rounds disturbed")
    lines = [f"{name:<16} paired timing: {ptxt}", f"{'':<16} training runs (not paired): {t.text if t else '—'}"]
    hit = r.disturbed_cells or []
    cells = ", ".join(f"{x.backend} seed {x.seed} contended_fraction {x.contended_fraction:.2f}"
                      f"{' (mostly)' if x.mostly_disturbed else ''}" for x in hit) or "none"
    lines.append(f"{'':<16} cells disturbed: {len(hit)} of {len(r.cells or [])}: {cells}")
    if name == "sweep disturbed":
        slowed, judged, ran = detection(quiet, r)
        flagged = sum(1 for d in r.during_hogs or [] if d.judged)
        lines.append(f"{'':<16} during the hogs: {ran} training chunks and paired bursts ran, {flagged} judged "
                     f"disturbed; {slowed} slowed by more than 15 %, {judged} of them judged disturbed")
    return lines


def _run_lines(name: str, r: RunLeg) -> list[str]:
    """A run leg's line of the summary: its median step, where it comes from, its contention."""
    from harness.timing.steady import FIGURES_ALL

    if r.error:
        return [f"{name:<16} {r.error}"]
    med, frac = r.step_median_s, r.contended_fraction
    source = (f"over {r.steady_steps} undisturbed steps ({r.disturbed_steps} disturbed left out)"
              if r.figures_from != FIGURES_ALL else f"over all {r.steady_steps} steady steps (none undisturbed)")
    return [f"{name:<16} {r.backend} median step {'—' if med is None else f'{med * 1e3:.3f} ms'} {source}; "
            f"contended_fraction {'—' if frac is None else f'{frac:.2f}'}"
            f"{'; marked mostly disturbed' if r.mostly_disturbed else ''}"]


def _leg_failed(argv: list[str], code: int, root: Path) -> int:
    """A leg that did not complete ends the benchmark: no ratio or check would mean anything."""
    print(f"noise: `harness {' '.join(argv)}` exited {code} (run it alone to see why); the legs so far are under "
          f"{root}; no checks", file=sys.stderr)
    return 1
