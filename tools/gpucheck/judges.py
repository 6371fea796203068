"""How a check's outcome is judged: from its exit status and the records it wrote under its own directory.

Each judge returns (passed, one-line summary, figures). A judge that finds nothing says what it looked for and
where ("no run record under …"), so that a FAIL is never a bare "None".
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

Verdict = tuple[bool, str, dict]


@dataclass
class Outcome:
    """What running one check gave: its exit status (None: it did not finish), wall time, directory and output."""

    rc: int | None
    wall_s: float
    out: Path  # the check's directory: its --out, stdout.txt, stderr.txt
    stdout: str = ""
    stderr: str = ""
    extra: dict = field(default_factory=dict)


def last_lines(o: Outcome, n: int = 1) -> list[str]:
    """The last `n` non-empty lines of the check's output (stderr after stdout: errors come last)."""
    lines = [ln.strip() for ln in (o.stdout + "\n" + o.stderr).splitlines() if ln.strip()]
    return [ln[:300] for ln in lines[-n:]] or [f"exit status {o.rc}, no output"]


def last_line(o: Outcome) -> str:
    return last_lines(o)[0]


def records(out: Path) -> list[Any]:
    """The run records under a check's --out (harness.store's RunRecord, read by its bounded reader; one that
    cannot be read is left out, and the judge says so by what it lists)."""
    from harness.errors import UsageError
    from harness.store import RunPaths, RunRecord

    found = []
    for run in RunPaths.under(out):
        for path in run.record_files():
            try:
                found.append(RunRecord.load(path))
            except UsageError:
                continue
    return found


def run_figures(rec: Any) -> dict:
    """The figures of one run record (harness.store.RunRecord): status, median ms/step, last and best validation
    loss, FLOP/s, the step mode, compile time and its cache, contention, and the time to the config's target loss."""
    t, evals, reach = rec.timings, list(rec.curves.evals), rec.time_to_target
    best = min(evals, key=lambda e: e.val_loss) if evals else None
    median, info = t.step_median_s, rec.backend_info or {}
    return {"backend": rec.backend, "status": str(rec.status.value), "steps": rec.total_steps,
            "ms_per_step": None if median is None else round(median * 1e3, 3),
            "val_loss": evals[-1].val_loss if evals else None,
            "best_val_loss": best.val_loss if best else None, "best_step": best.step if best else None,
            "achieved_flops": t.achieved_flops, "compile_s": t.compile_s,
            "compile_cache": info.get("compile_cache"), "wall_s": t.wall_s, "step_mode": info.get("step"),
            "contended_fraction": t.contention.contended_fraction if t.contention else None,
            "target": reach.target_val_loss if reach else None, "target_step": reach.step if reach else None,
            "target_train_s": reach.train_s if reach else None}


def run(check: Any, o: Outcome) -> Verdict:
    """A run passes when it exits 0 and every record completed with a finite validation loss."""
    figs = [run_figures(d) for d in records(o.out)]
    if not figs:
        return False, f"no run record under {o.out / 'runs'} (exit status {o.rc}): {last_line(o)}", {"runs": []}
    ok = o.rc == 0 and all(f["status"] == "completed" and f["val_loss"] is not None and math.isfinite(f["val_loss"])
                           for f in figs)
    text = "; ".join(f"{f['backend']}: {f['status']}, {f['ms_per_step']} ms/step, val {f['val_loss']}" for f in figs)
    return ok, text if o.rc == 0 else f"exit status {o.rc}: {text}; {last_line(o)}", {"runs": figs}


def paired(need_verdict: bool) -> Callable[[Any, Outcome], Verdict]:
    """A two-backend run: the run passes, and its paired timing line exists and (on a GPU) gives a verdict: usable
    (not mostly disturbed) and conclusive (its interval excludes 1: one backend is faster)."""
    def judge(check: Any, o: Outcome) -> Verdict:
        ok, text, figs = run(check, o)
        line = next((ln.strip() for ln in (o.stdout + "\n" + o.stderr).splitlines()
                     if ln.strip().startswith("paired timing:") and "faster" in ln), "")
        figs["paired"] = line
        if not line:
            return False, f"no paired timing line on the console of {o.out} ({text})", figs
        interval = re.search(r"faster than \S+ \[([\d.]+), ([\d.]+)\]", line)
        verdict = "no verdict" not in line and interval is not None and float(interval[1]) > 1
        figs["verdict"] = verdict
        return ok and (verdict or not need_verdict), line if ok else f"{text}; {line}", figs

    return judge


VERDICT_PROBE = ("import json, sys; from pathlib import Path; from harness.report.sweep import sweep_verdict; "
                 "print(json.dumps(sweep_verdict(Path(sys.argv[1]), sys.argv[2])))")


def asked_of_a_child(code: str, *args: str) -> Any:
    """What `code` prints as JSON, run by a child interpreter with the checkout and tools/ on its path (this process
    never imports the frameworks); RuntimeError with the last line of its stderr when it fails."""
    tools = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tools.parent), str(tools),
                                                       os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300, env=env)
    if done.returncode != 0:
        raise RuntimeError((done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1][:300])
    return json.loads(done.stdout)


def sweep_levels(out: Path, sweep_id: str) -> dict:
    """The sweep's comparisons as its report judges them (harness.report.sweep.sweep_verdict), asked of a child."""
    return asked_of_a_child(VERDICT_PROBE, str(out), sweep_id)


def sweep(need_green: bool) -> Callable[[Any, Outcome], Verdict]:
    """A seeded sweep: every cell completed, and (on a GPU) a comparison whose speed verdict is green (3 seeds,
    an interval that excludes 1, paired ratios that agree: harness.timing.paired.judge)."""
    def judge(check: Any, o: Outcome) -> Verdict:
        found = sorted(o.out.glob("sweeps/*/sweep.json"))
        if not found:
            return False, f"no sweep manifest under {o.out / 'sweeps'} (exit status {o.rc}): {last_line(o)}", {}
        try:
            v = sweep_levels(o.out, found[-1].parent.name)
        except (RuntimeError, ValueError, OSError, subprocess.SubprocessError) as exc:
            return False, f"the sweep's verdict could not be read: {exc}", {}
        comps = v.get("comparisons") or []
        text = "; ".join(f"{c['name']}: {c['label']} ({c['level']})" for c in comps) or "no comparison"
        complete = o.rc == 0 and v.get("completed") == v.get("cells")
        green = any(c.get("level") == "ok" for c in comps)
        return (complete and (green or not need_green), f"{v.get('completed')}/{v.get('cells')} cells; {text}",
                {"verdict": v})

    return judge


def bench(check: Any, o: Outcome) -> Verdict:
    """bench overhead: exit 0 (with --check: every target met), one result per size (harness.store's
    OverheadRecord, read by its bounded reader; a failed size is listed with its reason)."""
    from harness.errors import UsageError
    from harness.store.bench import OverheadRecord

    paths = sorted(o.out.glob("bench/bench-*.json"))
    try:
        doc = OverheadRecord.load(paths[-1]) if paths else None
    except UsageError as exc:
        return False, f"{exc} (exit status {o.rc})", {}
    if doc is None:
        return False, f"no bench record under {o.out / 'bench'} (exit status {o.rc}): {last_line(o)}", {}

    def ms(loop: Any) -> float | None:
        return None if loop is None else round(loop.step_ms_median, 3)

    rows = [{"size": r.size, "status": str(r.status.value), "failure": r.failure,
             "overhead_pct": None if r.overhead_pct is None else round(r.overhead_pct, 2),
             "ci95_pct": [round((v - 1) * 100, 2) for v in r.overhead_ratio_ci95 or []],
             "runner_ms": ms(r.runner), "bare_ms": ms(r.bare),
             "harness_us_per_step": None if r.harness_only is None else round(r.harness_only.us_per_step_median, 1),
             "step": (r.backend_info or {}).get("step")} for r in doc.results]
    text = "; ".join(f"{r['size']} {r['overhead_pct']:+.2f}% ({r['runner_ms']}/{r['bare_ms']} ms)"
                     if r["overhead_pct"] is not None else f"{r['size']} {r['status']}: {r['failure']}" for r in rows)
    if doc.misses:
        text += f"; targets missed: {doc.misses}"
    ok = o.rc == 0 and bool(rows) and all(r["overhead_pct"] is not None for r in rows)
    return ok, text or last_line(o), {"results": rows, "misses": doc.misses}


PARTS_PROBE = ("import json, sys; from gpucheck.judges import parts_facts; "
               "print(json.dumps(parts_facts(sys.argv[1], sys.argv[2])))")


def parts_facts(out: str | Path, ident: str) -> dict:
    """What the parts judge reads, in the process that calls it (a child of the check: `parts_probe`): `harness
    report ID --out OUT`'s exit status (the record read back through the store's bounded reader, its page rebuilt),
    the record's status and rounds, and per contender its backend, clock, set-up and compile seconds, whether its
    calls and every burst cover every item, the fewest kernels any part's forward or backward launches (None: not
    counted) and its step's median (ms), from harness.bench.parts_analysis."""
    import contextlib
    import io

    from harness.bench.parts_analysis import summary
    from harness.cli.main import main
    from harness.core.parts import STEP, split_item
    from harness.store.parts import PartsRecord, record_path

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        report_rc = main(["report", ident, "--out", str(out)])
    record = PartsRecord.load(record_path(Path(out), ident))
    s = summary(record) if record.rounds else None
    items, part_items = set(record.items), [k for k in record.items if split_item(k)[1] is not None]
    rows = []
    for c in record.contenders:
        ready = c.ready
        launches = ready.launches if ready is not None else {}
        kernels = [(launches.get(k) or {}).get("kernels") or 0 for k in part_items] if launches else None
        step = s["tables"][c.name][STEP]["median_s"] if s else math.nan
        rows.append({"name": c.name, "backend": c.backend, "device": c.device,
                     "clock": ready.clock if ready is not None else None,
                     "setup_s": ready.setup_s if ready is not None else None,
                     "compile_s": ready.compile_s if ready is not None else None,
                     "covers": ready is not None and set(ready.calls) == items and all(
                         set(r.bursts[c.name].times) == items for r in record.rounds if c.name in r.bursts),
                     "fewest_kernels": min(kernels) if kernels else None, "step_ms": step * 1e3})
    return {"report_rc": report_rc, "status": record.status, "failure": record.failure,
            "rounds": s["rounds"] if s else None, "contenders": rows, "pairs": [p["line"] for p in s["pairs"]] if s
            else []}


def parts_probe(out: Path, ident: str) -> dict:
    """`parts_facts` asked of a child (this process never imports the frameworks)."""
    return asked_of_a_child(PARTS_PROBE, str(out), ident)


def parts_verdict(rc: int | None, f: dict) -> Verdict:
    """bench parts passes when it and `harness report ID` exit 0, its record completed, every contender's calls and
    bursts cover every item and its step's median is finite, and torch's clock is CUDA events with at least one
    kernel launched by every part's forward and backward."""
    problems = [] if rc == 0 else [f"bench parts exit status {rc}"]
    if f["report_rc"] != 0:
        problems.append(f"harness report exit status {f['report_rc']}")
    if f["status"] != "completed":
        problems.append(f"record {f['status']}" + (f" ({f['failure']})" if f.get("failure") else ""))
    for c in f["contenders"]:
        if not c["covers"]:
            problems.append(f"{c['name']}'s calls or bursts miss items")
        if not (isinstance(c["step_ms"], (int, float)) and math.isfinite(c["step_ms"])):
            problems.append(f"{c['name']}'s step median is not finite")
        if c["backend"] == "torch" and not str(c["clock"]).startswith("CUDA events"):
            problems.append(f"{c['name']}'s clock is {c['clock']!r}, not CUDA events")
        if c["backend"] == "torch" and not (c["fewest_kernels"] or 0) >= 1:
            problems.append(f"{c['name']}: a part launches {c['fewest_kernels']} kernels (or was not counted)")
    steps = ", ".join(f"{c['name']} step {c['step_ms']:.3g} ms" + (f" (compiled in {c['compile_s']:.1f} s)"
                                                                    if c.get("compile_s") else "")
                      for c in f["contenders"])
    r = f.get("rounds") or {}
    text = f"{steps}; {r.get('clean', 0)} of {r.get('total', 0)} rounds undisturbed"
    if f["pairs"]:
        text += f"; {f['pairs'][0]}"
    return not problems, "; ".join([*problems, text]), f


def parts(check: Any, o: Outcome) -> Verdict:
    """`harness bench parts`, judged from its record and `harness report ID` on it (`parts_verdict`)."""
    found = sorted(o.out.glob("bench/parts-*.json"))
    if not found:
        return False, f"no parts record under {o.out / 'bench'} (exit status {o.rc}): {last_line(o)}", {}
    try:
        facts = parts_probe(o.out, found[-1].stem)
    except (RuntimeError, ValueError, OSError, subprocess.SubprocessError) as exc:
        return False, f"the parts record could not be read: {exc}", {}
    return parts_verdict(o.rc, facts)


def exit_status(check: Any, o: Outcome) -> Verdict:
    """Exit 0; the summary is the command's last line on stdout (its logs go to stderr)."""
    tail = [ln.strip() for ln in o.stdout.splitlines() if ln.strip()][-6:]
    return o.rc == 0, (tail[-1][:300] if tail and o.rc == 0 else last_line(o)), {"tail": tail}


def refusal(check: Any, o: Outcome) -> Verdict:
    """A CUDA-only mode on the CPU: exit 2 and one line on stderr that names the device."""
    lines = [ln for ln in o.stderr.splitlines() if ln.strip()]
    ok = o.rc == 2 and len(lines) == 1 and "cuda" in lines[0].lower()
    return ok, f"refused on the CPU as it must be: {lines[0].strip() if lines else '(nothing)'}", {}


def recipe(target: float) -> Callable[[Any, Outcome], Verdict]:
    """The full recipe: completed, and its best validation loss at most `target` (--recipe-target), with the step
    and training time at which it first reached the preset's target (nanoGPT's published 1.4697)."""
    def judge(check: Any, o: Outcome) -> Verdict:
        ok, text, figs = run(check, o)
        if not figs["runs"]:
            return ok, text, figs
        f = figs["runs"][0]
        best = f.get("best_val_loss")
        ok = ok and best is not None and best <= target
        reach = (f"reached {f.get('target')} at step {f.get('target_step')} after {f.get('target_train_s')} s of "
                 "training" if f.get("target_step") is not None else f"did not reach {f.get('target')}")
        return ok, (f"best val {best} at step {f.get('best_step')} (passes at <= {target}); {reach}; "
                    f"{f.get('ms_per_step')} ms/step"), figs

    return judge


def parity(check: Any, o: Outcome) -> Verdict:
    """harness parity: exit 0 and its verdict line "PASS: ..."; the figures are its table (value, tolerance per
    check), which is how the GPU check reports whether the CUDA tolerances hold."""
    lines = [ln.rstrip() for ln in o.stdout.splitlines() if ln.strip()]
    verdict = next((ln.strip() for ln in lines if ln.startswith(("PASS:", "FAIL:"))), None)
    rows = {}
    for ln in lines:
        m = re.match(r"(.+?)\s{2,}(\S+)\s+(\S+)\s+(ok|FAIL\S*)\b", ln)
        if m:
            rows[m[1].strip()] = {"value": m[2], "tolerance": m[3], "result": m[4]}
    if verdict is None:
        return False, f"no PASS/FAIL line in {o.out / 'stdout.txt'} (exit status {o.rc}): {last_line(o)}", {}
    return o.rc == 0 and verdict.startswith("PASS:"), verdict, {"table": rows}


def speedup(target: float, eager_run: str, captured_run: str) -> Callable[[dict[str, dict]], Verdict]:
    """Derived from the benches: the captured small step (--cuda-graphs) at least `target` times faster than the
    eager one (bench runner ms, small); the medium runs' ratio is shown beside it when they ran."""
    def derive(results: dict[str, dict]) -> Verdict:
        def small(name: str) -> float | None:
            rows = ((results.get(name) or {}).get("figures") or {}).get("results") or []
            return next((r["runner_ms"] for r in rows if r.get("size") == "small"), None)

        eager, captured = small("bench-fp32"), small("bench-cuda-graphs")
        if not eager or not captured:
            return False, ("no small result in bench-fp32 and bench-cuda-graphs to compare (their figures in "
                           "summary.json)"), {}
        ratio = eager / captured
        runs = [((results.get(n) or {}).get("figures") or {}).get("runs") or [{}] for n in (eager_run, captured_run)]
        mid = [r[0].get("ms_per_step") for r in runs]
        extra = f"; medium runs {mid[0]} / {mid[1]} ms/step" if all(mid) else ""
        return ratio >= target, (f"small: captured {captured} ms, eager {eager} ms: {ratio:.2f}x (target >= "
                                 f"{target:g}x){extra}"), {"ratio": ratio, "medium_ms": mid}

    return derive
