"""HTML reports: one self-contained file per invocation, plus `<out>/index.html` listing every report.

`write_report(out, run_ids)` reads only the RunRecords (and parity.json where there is one) of `run_ids` under
`<out>/runs/` and writes `<out>/<name>.html`: the name is the run id for one run, `<first run id>+<k>-<hash>` for
several (the same ids always give the same name, so rebuilding replaces the file). Figures are inline SVG
(matplotlib, Agg), tables come from pandas, the page is built with Jinja2; it needs no network, script or other
file to be read. `write_index(out)` lists every report in `<out>` with its runs' headline numbers, read afresh
from the records. Every write is atomic. A missing or corrupt record raises UsageError before anything is
written.

Every verdict is drawn in the colour of its own meaning (harness.pages: green pass, amber caveat, red failure, grey no
verdict), the headline first; a page of parity checks only (`harness parity` writes it) is a correctness page: its
own title, and no speed at all.
"""

from __future__ import annotations

import hashlib
import html as html_lib
import re
import time
import urllib.parse
from pathlib import Path
from typing import Any

from jinja2 import Environment, PackageLoader, StrictUndefined, select_autoescape

import harness
from harness import pages
from harness.errors import UsageError
from harness.pages import ERROR, NEUTRAL, OK, WARN
from harness.report import analysis, tables
from harness.report.analysis import RunView
from harness.report.results import costs, step_median_interval
from harness.store import RunPaths, atomic_write_bytes
from harness.store.parity import ParityRecord
from harness.store.record import TextProtocol
from harness.timing import contention
from harness.timing.steady import FIGURES_ALL

SAMPLE_CONTINUATIONS = 3  # prompted continuations shown in full per run (all are in the records)

__all__ = ["report_name", "write_index", "write_report"]


def _env() -> Environment:
    env = Environment(loader=PackageLoader("harness.report", "templates"), autoescape=select_autoescape(
        enabled_extensions=("html", "j2"), default_for_string=True, default=True), undefined=StrictUndefined,
        trim_blocks=True, lstrip_blocks=True)
    env.filters["loss"] = tables.fmt_loss
    env.filters["rate"] = tables.fmt_rate
    env.filters["score"] = tables.fmt_score
    env.filters["known"] = lambda v: "?" if v is None else v  # a value a record left out
    env.filters["inline"] = pages.inline  # a message's `inline code` as <code>, everything else escaped
    env.globals["palette_css"] = pages.css()
    return env


def report_name(run_ids: list[str]) -> str:
    """`<run_id>` for one run; `<first>+<k>-<hash of all ids>` for several (the same ids give the same name)."""
    if len(run_ids) == 1:
        return run_ids[0]
    digest = hashlib.sha256("\n".join(run_ids).encode()).hexdigest()[:6]
    return f"{run_ids[0]}+{len(run_ids) - 1}-{digest}"


# --- words ------------------------------------------------------------------------------------------------------------
def _pair_sentence(c: analysis.PairComparison, dropout: float | None, parity: bool = False) -> str:
    """The loss comparison of a pair in words, ending with the conclusion of its one verdict (`loss_judgement`).
    In a parity check the verdict is the parity check's (its loss rows, against measured tolerances), so the
    numbers are given without the band's verdict, which could only contradict it."""
    if c.val_diff is None:
        return f"{c.a} vs {c.b}: no evaluation step in common, so the validation losses cannot be compared."
    band = f"{analysis.LOSS_BAND_REL:.0%}"
    where = "within" if c.val_rel is not None and c.val_rel <= analysis.LOSS_BAND_REL else "outside"
    s = (f"Validation loss at step {c.eval_step:,}: {c.a} {c.val_a:.4f}, {c.b} {c.val_b:.4f}; {c.a} − {c.b} = "
         f"{tables.fmt_diff(c.val_diff)}")
    s += "." if parity else f" ({c.val_rel:.2%} of their mean), {where} the {band} band."
    tail = c.tail_interval
    if tail is not None:
        lo, hi = tail
        sign = ("consistent with no difference" if lo <= 0 <= hi
                else f"{c.a} {'higher' if c.tail_mean > 0 else 'lower'} on average")
        scale = (f", at most {max(abs(lo), abs(hi)) / c.tail_scale:.2%} of the loss" if c.tail_scale and not parity
                 else "")
        s += (f" On the same batches over the last {c.tail_steps} steps, the per-step training loss {c.a} − {c.b} "
              f"averages {tables.fmt_diff(c.tail_mean)} ± {c.tail_ci:.2g} (95 % CI{scale}): {sign}.")
    if not parity:
        s += f" Verdict: {analysis.loss_judgement(c).why}."
    if dropout == 0:
        s += f" Dropout is 0, so any difference is numerical; the largest per-step |Δ| is {c.max_dev:.2e}."
    return s


def speed_verdict(c: analysis.PairComparison) -> dict[str, Any]:
    """The speed verdict of one pair: level, short label, sentence (with its interval) from the paired timing, by
    `paired.judge`'s rule (one run is one seed: stated with its interval, never green).
    Without paired timing there is no speed verdict (training step times of separate runs are not compared)."""
    from harness.timing import paired

    s = c.paired
    if s is None and c.paired_failure:
        return {"level": WARN, "label": "speed: paired timing failed" if c.paired_crashed else
                "speed: no paired round", "text": (
                    f"Speed of {c.a} and {c.b}: not compared: the paired timing measured no round "
                    f"({c.paired_failure}); `harness resume RUN_ID` tries again.")}
    if s is None:
        return {"level": NEUTRAL, "label": "speed: not compared", "text": (
            f"Speed of {c.a} and {c.b}: not compared: this run has no paired timing (--paired-rounds 0, or a run "
            "from before it existed); the step times below come from separate training runs made one after "
            "another, under whatever else the machine was doing, so no ratio is drawn from them.")}
    j = paired.judge(s)
    how = f"paired timing: {c.a} and {c.b} alive at once, timed in alternating short bursts; interval {j['over']}"
    notes = f"; {'; '.join(j['notes'])}" if j["notes"] else ""
    return {"level": j["level"], "label": j["label"], "text": f"Speed: {j['claim']} ({how}{notes})."}


def _contention_sentence(view: RunView) -> str:
    """One line: how disturbed each backend's training was, and the paired timing's rounds."""
    parts = [contention.sentence(costs(r).contention, r.backend) for r in view.records]
    if view.paired is not None:
        from harness.timing import paired

        n, clean = len(paired.rounds_of(view.paired)), paired.clean_rounds(view.paired)
        parts.append(f"paired timing: {n - clean} of {n} rounds disturbed (left out of the ratio)")
    return "Contention: " + "; ".join(parts) + "."


def _speed(view: RunView, comparisons: list[analysis.PairComparison]) -> list[dict[str, Any]]:
    """A speed verdict per pair; none in a parity check (a correctness check: its exactness trades speed away)."""
    if analysis.is_parity(view):
        return []
    return [dict(speed_verdict(c), pair=f"{c.a} vs {c.b}") for c in comparisons]


def _primary(view: RunView, comparisons: list[analysis.PairComparison]) -> tuple[str, str]:
    """(level, label) of what a run found, the most important first: no records, an unfair comparison, the parity
    verdict, or the loss verdict of its pairs (each pair's `loss_judgement`, the worst one)."""
    if not view.records:
        return ERROR, "no records"
    if analysis.fairness_problems(view.records):
        return ERROR, "not a fair comparison"
    if view.parity is not None:
        if view.parity.compared_nothing:
            return ERROR, "parity: nothing compared"
        return {True: (OK, "parity: pass"), False: (ERROR, "parity: FAIL"),
                None: (NEUTRAL, "parity: no verdict")}[view.parity.passed]
    if view.parity_error:
        return ERROR, "parity: unreadable"
    if len(view.records) == 1:
        return NEUTRAL, "single backend"
    judged = [analysis.loss_judgement(c) for c in comparisons]
    worst = max(judged, key=lambda j: pages.LEVELS.index(j.level))
    return worst.level, worst.label


def _caveats(view: RunView) -> list[dict[str, str]]:
    """What qualifies the verdict, each drawn in its own colour beside it: an unfinished or missing backend (amber
    while interrupted or running, red when one failed or left no record)."""
    if not view.records:
        return []
    levels = [analysis.status_of(r, view.age_s.get(r.backend))[0] for r in view.records]
    levels += [ERROR] * len(view.missing)
    level = max(levels, key=pages.LEVELS.index)
    return [] if level == OK else [{"level": level, "label": "incomplete"}]


def _headline(view: RunView, comparisons: list[analysis.PairComparison]) -> dict[str, Any]:
    """What the index and the summary show first: the verdict's level and label (`_primary`), its caveats and the
    speed verdicts, each in the colour of its own meaning (harness.pages): a pass beside a caveat stays green."""
    level, label = _primary(view, comparisons)
    return {"level": level, "label": label, "caveats": _caveats(view), "speed": _speed(view, comparisons)}


def _verdict(view: RunView, comparisons: list[analysis.PairComparison]) -> dict[str, Any]:
    """The headline (`_headline`) and the sentences of one run's summary."""
    head = _headline(view, comparisons)
    lines: list[str] = []
    dropout = view.spec.config.dropout
    unfair = analysis.fairness_problems(view.records)
    if unfair:
        lines.append("Not a fair comparison: " + "; ".join(unfair) + ".")
    if view.parity is not None:
        lines.append(analysis.parity_sentence(view.parity))
    if len(view.records) == 1:
        lines.append(_single_sentence(view, view.records[0]))
    lines += [_pair_sentence(c, dropout, analysis.is_parity(view)) for c in comparisons]
    if analysis.is_parity(view):
        return dict(head, lines=lines)  # a correctness check: no speed, no contention (it times nothing)
    lines += [v["text"] for v in head["speed"]]
    if view.records:
        lines.append(_contention_sentence(view))
    scored = [r for r in view.records if r.text is not None and r.text.chrf is not None]
    if scored:
        protocol = scored[0].text.protocol
        temp = protocol.temperature if protocol is not None else None
        lines.append(f"Text (chrF / BLEU of continuations at temperature {temp}): " + "; ".join(
            f"{r.backend} {r.text.chrf:.1f} / {r.text.bleu:.2f}" for r in scored) + ".")
    return dict(head, lines=lines)


def _single_sentence(view: RunView, rec: Any) -> str:
    """The summary of a run of one backend: its final loss, and its speed unless it is a parity check."""
    c = analysis.costs(rec)
    last = analysis.last_eval(rec)
    parts = [f"Only {rec.backend} ran, so there is nothing to compare"]
    if last:
        parts.append(f"final validation loss {last.val_loss:.4f} at step {last.step:,}")
    if c.tokens_per_s and not analysis.is_parity(view):
        ci = step_median_interval(rec)
        which = "undisturbed" if c.figures_from != FIGURES_ALL else "steady"
        interval = (f" (median {which} step {tables.fmt_seconds(c.step_median_s)}, 95 % interval "
                    f"[{tables.fmt_seconds(ci[0])}, {tables.fmt_seconds(ci[1])}] over {c.steady_steps:,} "
                    "steps)") if len(ci) == 2 and c.steady_steps else ""
        tag = contention.disturbed_tag(c.contention)
        parts.append(f"{c.tokens_per_s:,.0f} tokens/s{interval}" + (f" ({tag})" if tag else ""))
    return "; ".join(parts) + "."


# --- page model -------------------------------------------------------------------------------------------------------
def _temperature_label(t: Any) -> str:
    return "greedy" if t is None else f"T = {t:g}"


def _samples(view: RunView) -> dict[str, Any] | None:
    with_text = [r for r in view.records if r.text is not None and r.text.samples]
    if not with_text:
        return None
    rows: dict[str, dict[str, str]] = {}
    for rec in with_text:
        for s in rec.text.samples:
            rows.setdefault(_temperature_label(s.temperature), {})[rec.backend] = s.text
    prompts = {r.text.sample_prompt for r in with_text}
    conts = []
    first = with_text[0].text
    for i, c in enumerate(first.continuations[:SAMPLE_CONTINUATIONS]):
        hyps = {}
        for rec in with_text:
            cc = rec.text.continuations
            if i < len(cc):
                hyps[rec.backend] = cc[i].hypothesis
        conts.append({"prompt": c.prompt, "reference": c.reference, "hypotheses": hyps})
    return {"backends": [r.backend for r in with_text], "rows": rows,
            "prompt": next(iter(prompts)) if len(prompts) == 1 else None, "continuations": conts,
            "protocol": first.protocol or TextProtocol(),
            "signatures": {"bleu": first.bleu_signature, "chrf": first.chrf_signature}}


def _parity_note(doc: ParityRecord) -> str:
    parts = []
    if doc.dtypes:
        parts.append("computed in " + ", ".join(f"{k} {v}" for k, v in doc.dtypes.items()))
    if doc.tolerance_source:
        parts.append("tolerances: " + ", ".join(f"{k} {v}" for k, v in doc.tolerance_source.items()))
    return "; ".join(parts)


def _run_model(view: RunView) -> dict[str, Any]:
    from harness.report import figures

    comparisons = analysis.pairs(view)
    parity = analysis.is_parity(view)
    return {
        "id": view.run_id, "label": view.label, "anchor": f"run-{view.run_id}", "is_parity": parity,
        "device": view.spec.device, "created_at": view.spec.created_at,
        "backends": view.backends, "missing": view.missing,
        "banners": view.banners, "verdict": _verdict(view, comparisons),
        "summary_table": tables.summary_table(view, speed=not parity) if view.records or view.missing else None,
        "pair_table": tables.pair_table(comparisons, parity=parity) if comparisons else None,
        "parity": view.parity, "parity_table": tables.parity_table(view.parity) if view.parity else None,
        "parity_note": _parity_note(view.parity) if view.parity else "",
        "config_table": tables.config_table(view), "env_table": tables.environment_table(view),
        "fingerprint_table": tables.fingerprint_table(view) if len(view.records) > 1 else None,
        "loss_fig": figures.loss_figure(view), "dev_fig": figures.deviation_figure(comparisons),
        "n_pairs": len(comparisons),
        "cost_fig": None if parity else figures.cost_figure(view),
        "cost_table": tables.cost_table(view) if view.records and not parity else None,
        "text_table": tables.text_table(view), "samples": _samples(view),
        "errors": {r.backend: r.error for r in view.records if r.error},
    }


def _scaling(views: list[RunView]) -> dict[str, Any] | None:
    """A scaling section when the report covers runs of more than one model size."""
    from harness.report import figures

    sizes = {v.label for v in views if v.records}
    if len(sizes) < 2 or all(analysis.is_parity(v) for v in views):
        return None
    rows = []
    for v in views:
        for rec in v.records:
            c = analysis.costs(rec)
            rows.append({"size": v.label, "backend": rec.backend, "parameters": tables.fmt_int(c.n_params),
                         "median step": tables.fmt_seconds(c.step_median_s),
                         "p10 – p90": f"{tables.fmt_seconds(c.step_p10_s)} – {tables.fmt_seconds(c.step_p90_s)}",
                         "tokens/s": tables.fmt_speed(c.tokens_per_s, c.contention),
                         "achieved FLOP/s": tables.fmt_flops(c.achieved_flops),
                         "peak memory": tables.fmt_bytes(c.peak_bytes)})
    import pandas as pd

    return {"fig": figures.scaling_figure(views), "table": tables.html_table(pd.DataFrame(rows), "scaling",
                                                                            index=False)}


def _title(views: list[RunView]) -> str:
    """'nanogpt-parity: small — torch vs numpy'; a page of parity checks only says so: 'nanogpt-parity parity
    check: small — torch vs numpy'."""
    sizes = ", ".join(dict.fromkeys(v.label for v in views))
    backends = list(dict.fromkeys(b for v in views for b in (v.spec.backends or v.backends)))
    what = "nanogpt-parity parity check" if all(analysis.is_parity(v) for v in views) else "nanogpt-parity"
    return f"{what}: {sizes} — {' vs '.join(backends) or 'no backends'}"


def write_report(out: Path, run_ids: list[str]) -> Path:
    """Build the report of `run_ids` under `out` and return its path, `<out>/<report_name(run_ids)>.html`.

    Raises UsageError (before writing anything) when a run or one of its records is missing or corrupt.
    """
    out = Path(out)
    if not run_ids:
        raise UsageError("no run id given; pass one or more run ids from <out>/runs")
    run_ids = list(dict.fromkeys(run_ids))
    views = [analysis.load_view(RunPaths(out, run_id)) for run_id in run_ids]
    runs = [_run_model(v) for v in views]
    parity_page = all(analysis.is_parity(v) for v in views)  # a page of correctness checks only: no speed at all
    page = _env().get_template("report.html.j2").render(
        title=_title(views), parity_page=parity_page,
        generated=time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime()),
        version=harness.__version__, run_ids=run_ids, runs=runs, banners=[b for v in views for b in v.banners],
        scaling=_scaling(views), band=f"{analysis.LOSS_BAND_REL:.0%}",
        convention=analysis.CONVENTION_PARITY if parity_page else analysis.CONVENTION,
        rule=contention.RULE_SENTENCE,
        tail_fraction=f"{analysis.TAIL_FRACTION:.0%}", stale=analysis.human_age(analysis.STALE_AFTER_S))
    path = out / f"{report_name(run_ids)}.html"
    atomic_write_bytes(path, page.encode("utf-8"))
    return path


# --- index ------------------------------------------------------------------------------------------------------------
_RUNS_META = re.compile(r'<meta name="nanogpt-parity-runs" content="([^"]*)">')
_SWEEP_META = re.compile(r'<meta name="nanogpt-parity-sweep" content="([^"]*)">')
_GENERATED_META = re.compile(r'<meta name="nanogpt-parity-generated" content="([^"]*)">')
_TITLE = re.compile(r"<title>(.*?)</title>", re.S)


def _per_backend(values: dict[str, Any], fmt: Any) -> list[str]:
    """'backend value' per backend (one line each in the index)."""
    return [f"{b} {fmt(v)}" for b, v in values.items()] or [tables.DASH]


def _index_row(out: Path, run_id: str) -> dict[str, Any]:
    """Headline numbers of one run, read from its records now (so the index never shows stale numbers)."""
    try:
        view = analysis.load_view(RunPaths(out, run_id))
        head = analysis.headline(view)
        verdict = _headline(view, analysis.pairs(view))
    except UsageError as exc:
        return {"run_id": run_id, "error": str(exc)}
    except Exception as exc:  # one malformed run must never break the index of every other run
        return {"run_id": run_id, "error": f"run {run_id} could not be read ({type(exc).__name__}: {exc})"}
    return {
        "run_id": run_id, "error": None, "size": head["size"], "device": head["device"],
        "params": tables.fmt_int(head["n_params"]), "verdict": verdict["label"], "level": verdict["level"],
        "caveats": verdict["caveats"], "speed": verdict["speed"],
        "status": _per_backend(head["status"], str),
        "val_loss": _per_backend(head["val_loss"], tables.fmt_loss),
        "tokens_per_s": ["— (a parity check times nothing)"] if analysis.is_parity(view) else
        [f"{b} {tables.fmt_speed(v, head['contention'][b])}" for b, v in head["tokens_per_s"].items()] or [tables.DASH],
        "bleu": [tables.DASH] if analysis.is_parity(view) else _per_backend(head["bleu"], tables.fmt_score),
        "chrf": [tables.DASH] if analysis.is_parity(view) else _per_backend(head["chrf"], tables.fmt_score),
    }


def _sweep_row(out: Path, sweep_id: str) -> dict[str, Any]:
    """The index row of a sweep: its cells and its comparisons' verdicts, read from the records now."""
    from harness.report.sweep import sweep_verdict

    try:
        return {"sweep_id": sweep_id, "error": None, **sweep_verdict(out, sweep_id)}
    except UsageError as exc:
        return {"sweep_id": sweep_id, "error": str(exc)}
    except Exception as exc:  # one malformed sweep must never break the index
        return {"sweep_id": sweep_id, "error": f"sweep {sweep_id} could not be read ({type(exc).__name__}: {exc})"}


def _clean_old_tmp(out: Path, older_than_s: float = 3600.0) -> None:
    """Remove temporary files a kill left in `<out>` (reports, the index): only old ones, another process may be
    writing a fresh one right now. Run directories are cleaned by their lock holder."""
    now = time.time()
    for path in out.glob(".*.tmp"):
        try:
            if now - path.stat().st_mtime > older_than_s:
                path.unlink()
        except OSError:
            pass


def write_index(out: Path) -> Path:
    """Write `<out>/index.html` and return its path.

    It lists every report in `<out>` (newest first; a report is an .html file carrying the
    `nanogpt-parity-runs` meta tag) with each run's headline numbers, read from the run records as they are now,
    and the runs under `<out>/runs/` that no report covers yet.
    """
    out = Path(out)
    entries, covered = [], set()
    for html in sorted(out.glob("*.html")) if out.is_dir() else []:
        if html.name == "index.html":
            continue
        try:
            head = html.read_text(encoding="utf-8", errors="replace")[:8192]
        except OSError:
            continue
        found = _RUNS_META.search(head)
        if not found:
            continue  # not a nanogpt-parity report
        run_ids = found.group(1).split()
        covered.update(run_ids)
        generated, title = _GENERATED_META.search(head), _TITLE.search(head)
        entry = {"href": urllib.parse.quote(html.name, safe="+"),  # a relative path, whatever the name holds
                 "name": html.stem, "mtime": html.stat().st_mtime,
                 "title": html_lib.unescape(title.group(1).strip()) if title else html.stem,
                 "generated": generated.group(1) if generated else "", "sweep": None, "runs": []}
        sweep = _SWEEP_META.search(head)
        if sweep:  # a sweep is one row: its verdicts and a link, never a row per cell
            entry["sweep"] = _sweep_row(out, html_lib.unescape(sweep.group(1)))
        else:
            entry["runs"] = [_index_row(out, run_id) for run_id in run_ids]
        entries.append(entry)
    entries.sort(key=lambda e: e["mtime"], reverse=True)
    uncovered = sorted((p.run_id for p in RunPaths.under(out) if p.run_id not in covered and p.spec.exists()),
                       reverse=True)
    _clean_old_tmp(out)
    page = _env().get_template("index.html.j2").render(
        entries=entries, uncovered=uncovered, out=str(out), version=harness.__version__,
        generated=time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime()))
    path = out / "index.html"
    atomic_write_bytes(path, page.encode("utf-8"))
    return path
