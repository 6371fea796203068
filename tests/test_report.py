"""HTML reports and the index: sections with real numbers, banners for unfinished or unfair runs, the CLI.

Most reports here are built from synthesised RunRecords whose numbers are planted (so every figure the report
states can be checked against a value computed independently); one end-to-end test trains 12 steps through the
CLI and rebuilds the report with `harness report`.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import time
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
from conftest import data_path, record_doc

from harness import store
from harness.config.load import load_config
from harness.core.weights import count_parameters
from harness.errors import UsageError
from harness.report import report_name, write_index, write_report
from harness.run.worker import flops_per_token
from harness.store.paired import PairedRecord
from harness.timing.steady import summarize_times

REPO = Path(__file__).resolve().parents[1]
VOCAB = 65


# --- synthetic records -----------------------------------------------------------------------------------------------
def _curve(t: np.ndarray) -> np.ndarray:
    return 2.5 + 1.7 * np.exp(-t / 30.0)


def make_run(out: Path, backends: tuple[str, ...] = ("torch", "numpy"), *, size: str = "small", steps: int = 120,
             statuses: dict[str, str] | None = None, val_offset: dict[str, float] | None = None,
             step_time: dict[str, float] | None = None, dropout: float | None = None,
             fingerprints: dict[str, dict] | None = None, text: bool = True, missing: tuple[str, ...] = (),
             loss_noise: float = 0.01) -> str:
    """Write a run directory with spec.json and one synthetic RunRecord per backend; returns the run id. The records
    are of schema version 3 (the previous release's: the curves in the JSON, where a test can edit them), which every
    reader still reads; real runs write the current version.

    Per-step losses are a common curve plus common batch noise plus `loss_noise` of backend-specific noise; the
    validation loss at every evaluation is the curve + 0.02 + `val_offset[backend]`. Step times are constant
    `step_time[backend]` (first step 20x: compilation). Status "interrupted" keeps half the steps, "failed: ..."
    a third, "running" two thirds and no summary timings.
    """
    statuses, val_offset = statuses or {}, val_offset or {}
    step_time = step_time or {"torch": 0.01, "numpy": 0.03, "flux": 0.02}
    config = load_config(size).replace(steps=steps, eval_interval=40)
    if dropout is not None:
        config = config.replace(dropout=dropout)
    run_id = store.RunPaths.new(out, config.name).run_id
    directory = store.RunPaths(out, run_id).dir
    spec = {"schema": "nanogpt-parity/run-spec", "schema_version": store.spec.SPEC_SCHEMA_VERSION, "run_id": run_id,
            "label": config.name,
            "created_at": "2026-01-01T00:00:00Z", "config": config.to_dict(), "seed": 1337, "device": "cpu",
            "data": {"path": "/data/tiny.txt", "sha256": "ab" * 32}, "backends": [*backends, *missing],
            "backend_options": {b: {} for b in backends}, "checkpoint_every": 0, "text": text,
            "parity": False}
    store.atomic_write_json(directory / "spec.json", spec)
    common = np.random.default_rng(0).normal(0, 0.05, steps)
    for b in backends:
        status = statuses.get(b, "completed")
        keep = {"interrupted": steps // 2, "running": 2 * steps // 3}.get(status, steps)
        keep = steps // 3 if status.startswith("failed") else keep
        rng = np.random.default_rng(sum(map(ord, b)))
        t = np.arange(keep)
        loss = _curve(t) + common[:keep] + rng.normal(0, loss_noise, keep)
        times = np.full(keep, step_time.get(b, 0.02))
        times[0] *= 20
        eval_steps = [s for s in range(0, steps + 1, 40) if s <= keep]
        if status == "completed" and eval_steps[-1] != steps:
            eval_steps.append(steps)
        evals = [{"step": s, "train_loss": float(_curve(np.array(s))), "time_s": 0.05,
                  "val_loss": float(_curve(np.array(s)) + 0.02 + val_offset.get(b, 0.0))} for s in eval_steps]
        tokens = config.batch_size * config.block_size
        timings = {"setup_s": 0.5}
        if status != "running":
            timings.update(first_step_s=float(times[0]), **summarize_times(list(times), tokens),
                           train_s=float(times.sum()), eval_s=0.05 * len(evals), wall_s=float(times.sum()) + 2)
            timings["achieved_flops"] = timings["tokens_per_s"] * flops_per_token(config, VOCAB)
        rec = {
            "schema": store.record.SCHEMA, "schema_version": 3, "run_id": run_id,
            "backend": b, "backend_options": {}, "status": status, "started_at": "2026-01-01T00:00:01Z",
            "finished_at": None if status == "running" else "2026-01-01T00:01:00Z",
            "error": "Traceback (most recent call last):\n  RuntimeError: boom" if status.startswith("failed")
            else None,
            "config": config.to_dict(), "config_hash": config.config_hash(), "seed": 1337, "device": "cpu",
            "data": {"path": "/data/tiny.txt", "sha256": "ab" * 32, "n_chars": 1000, "vocab_size": VOCAB,
                     "n_train": 900, "n_val": 100},
            "fingerprints": {"weights": "w" * 64, "batches": "b" * 64, "eval_batches": "e" * 64,
                             **(fingerprints or {}).get(b, {})},
            "environment": {"python": "3.11.7", "platform": "Linux", "hostname": "box", "cpu_model": "CPU",
                            "cpu_count": 2, "cpu_affinity": 2, "memory_bytes": 2**34, "numpy": "2.0",
                            "harness_version": "0.1.0", "git_commit": "abc", "omp_num_threads": None},
            "total_steps": steps, "batches_per_epoch": 1000, "epochs": steps / 1000, "tokens_per_step": tokens,
            "n_params": count_parameters(config, VOCAB),
            "n_params_non_embedding": count_parameters(config, VOCAB, False),
            "flops_per_token": flops_per_token(config, VOCAB),
            "backend_info": {"framework": b, "version": "1.0", "device": "cpu"},
            "timings": timings, "memory": {"kind": "rss", "peak_bytes": 300 * 2**20},
            "text": synthetic_text(b) if text and status == "completed" else None, "checkpoint": None,
            "steps": {"step": t.tolist(), "loss": loss.tolist(), "time_s": times.tolist()}, "evals": evals,
        }
        store.atomic_write_json(directory / f"{b}.json", rec)
    return run_id


def synthetic_text(backend: str) -> dict:
    from harness.run import text as run_text

    refs = ["the quick brown fox jumps over the lazy dog"] * 4
    hyps = ["the quick brown fox jumps over the lazy cat", "the quick red fox", "a slow dog", "the lazy dog"]
    if backend != "torch":
        hyps = [*hyps[:3], "the lazy dogs"]
    scores = run_text.score_text(hyps, refs, bootstrap=0)
    return {"protocol": {"n_prompts": 4, "prompt_chars": 8, "continuation_chars": 40, "temperature": 0.8,
                         "seed": 1337},
            **scores, "generation_s": 0.5, "generation_tokens": 160, "generation_tokens_per_s": 320.0,
            "sample_prompt": "ROMEO:\n",
            "samples": [{"temperature": t, "text": f"<{backend}> sample & text at {t}\nsecond line"}
                        for t in (1.5, 1.0, 0.8, 0.5, 0.1, None)],
            "continuations": [{"prompt": "p", "reference": r, "hypothesis": h} for r, h in zip(refs, hyps)]}


def make_sized_runs(out: Path) -> list[str]:
    """Three two-backend runs (small, medium, large), numpy 3x slower than torch at every size."""
    return [make_run(out, size=s, steps=60, step_time={"torch": 0.01 * k, "numpy": 0.03 * k})
            for s, k in (("small", 1), ("medium", 2), ("large", 4))]


# --- reading the HTML -------------------------------------------------------------------------------------------------
class Page(HTMLParser):
    """Ids, links, classes and the text of the first elements of a report."""

    def __init__(self, html: str):
        super().__init__()
        self.ids: list[str] = []
        self.links: list[str] = []
        self.tags: list[str] = []
        self.banners: list[str] = []
        self._in_banner = 0
        self.feed(html)

    def handle_starttag(self, tag: str, attrs: list) -> None:
        a = dict(attrs)
        self.tags.append(tag)
        if "id" in a:
            self.ids.append(a["id"])
        if tag == "a" and "href" in a:
            self.links.append(a["href"])
        if tag == "div" and "banner" in (a.get("class") or "").split():
            self._in_banner = 1
            self.banners.append("")

    def handle_endtag(self, tag: str) -> None:
        if tag == "div":
            self._in_banner = 0

    def handle_data(self, data: str) -> None:
        if self._in_banner:
            self.banners[-1] += data


def text_of(html: str) -> str:
    """The visible text, whitespace collapsed (so that a sentence broken over template lines matches)."""
    html = re.sub(r"<svg.*?</svg>", " ", html, flags=re.S)
    html = re.sub(r"<style.*?</style>", " ", html, flags=re.S)
    import html as h

    return " ".join(h.unescape(re.sub(r"<[^>]+>", " ", html)).split())


def section(html: str, start: str, end: str) -> str:
    return html[html.index(start):html.index(end, html.index(start))]


@pytest.fixture
def no_figures(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stub the matplotlib figures (the slow part) in tests that read only the page's words."""
    from markupsafe import Markup

    from harness.report import figures

    for name in ("loss_figure", "deviation_figure", "cost_figure", "scaling_figure"):
        monkeypatch.setattr(figures, name, lambda *a, **k: Markup('<svg class="figure"></svg>'))


# --- tests: content --------------------------------------------------------------------------------------------------
def test_two_backend_report_has_every_section_with_planted_numbers(tmp_path: Path) -> None:
    run_id = make_run(tmp_path, val_offset={"numpy": 0.025})
    path = write_report(tmp_path, [run_id])
    assert path == tmp_path / f"{run_id}.html"
    html = path.read_text()
    page = Page(html)
    text = text_of(html)
    for anchor in ("summary", f"run-{run_id}", "method"):
        assert anchor in page.ids
    for heading in ("Summary", "Loss agreement and speed", "Loss curves", "Per-step loss deviation",
                    "Cost: time, throughput, memory", "Text quality", "Samples side by side", "Configuration",
                    "Input fingerprints", "Environment"):
        assert heading in text, heading
    assert html.count('class="figure"') == 3  # loss curves, deviation, cost bars
    assert page.banners == []
    # planted: val loss at step 120 = curve + 0.02 (+ 0.025 for numpy)
    va = float(_curve(np.array(120)) + 0.02)
    vb = va + 0.025
    summary = text[text.index("Summary"):text.index("Run " + run_id)]
    assert f"Validation loss at step 120: torch {va:.4f}, numpy {vb:.4f}; torch − numpy = -0.0250 " \
           f"({0.025 / ((va + vb) / 2):.2%} of their mean), within the 2% band" in summary
    assert "losses agree" in summary
    assert "Convention: a difference is written first − second with both names" in summary  # said once
    assert text.count("Convention: a difference is written") == 1
    # numpy's training steps took 3x as long, but separate runs are never a speed verdict
    assert "Speed of torch and numpy: not compared: this run has no paired timing" in summary
    assert "torch 3× faster" in section(text, "Loss agreement and speed", "Loss curves")  # table: information
    assert f"{16 * 64 / 0.01:,.0f}" in summary and f"{16 * 64 / 0.03:,.0f}" in summary
    assert "Contention: torch: no contention evidence" in summary  # a record without chunks says so
    # paired per-step differences: same common noise, so the CI is narrow and contains 0
    assert "consistent with no difference. Verdict: both within the 2% band: the losses agree." in summary
    # costs: setup, first step (20 x 10 ms), FLOPs per token from the formula, memory
    cfg = load_config("small")
    n_non_emb = count_parameters(cfg, VOCAB, embeddings=False)
    fpt = 6 * n_non_emb + 12 * cfg.n_layer * cfg.n_embd * cfg.block_size
    costs = section(text, "Cost: time", "Text quality")
    assert "500 ms" in costs and "200 ms" in costs and f"{fpt:,}" in costs and "300 MiB" in costs
    assert f"{fpt * 16 * 64 / 0.01 / 1e9:.4g} GFLOP/s" in costs  # achieved = FLOPs/token x tokens/s
    # text: scores, signatures, samples of both backends side by side, escaped
    assert "tok:13a" in text and "nc:6" in text
    assert "&lt;torch&gt; sample &amp; text at 1.5" in html and "&lt;numpy&gt; sample &amp; text at 1.5" in html
    assert "continuations identical to torch's" in text and "3 of 4 (mean common prefix" in text


def test_losses_outside_band_are_called_different(tmp_path: Path, no_figures: None) -> None:
    run_id = make_run(tmp_path, val_offset={"numpy": 0.2})
    html = write_report(tmp_path, [run_id]).read_text()
    text = text_of(html)
    assert "outside the 2% band. On the same batches" in text
    assert "Verdict: the validation losses differ by more than the 2% band: the losses differ." in text
    assert "losses differ" in text[:text.index("Run " + run_id)] and ("error", "losses differ") in _pills(html)


def test_dropout_zero_reports_numerical_difference(tmp_path: Path, no_figures: None) -> None:
    run_id = make_run(tmp_path, dropout=0.0, loss_noise=1e-6)
    text = text_of(write_report(tmp_path, [run_id]).read_text())
    assert "Dropout is 0, so any difference is numerical" in text


def test_single_backend_with_real_text_metrics(tmp_path: Path) -> None:
    """One backend, whose `text` is what metrics.text_quality really returns (oracle backend: scores 100)."""
    from test_metrics import OracleBackend, random_corpus

    from harness.run import text as run_text

    run_id = make_run(tmp_path, backends=("torch",))
    path = store.RunPaths(tmp_path, run_id).dir / "torch.json"
    rec = json.loads(path.read_text())
    corpus = random_corpus()
    rec["text"] = run_text.text_quality(OracleBackend(corpus), corpus, load_config("small"), seed=1).to_dict()
    store.atomic_write_json(path, rec)
    html = write_report(tmp_path, [run_id]).read_text()
    text = text_of(html)
    assert "Only torch ran, so there is nothing to compare" in text and "Needs two backends" in text
    assert html.count('class="figure"') == 2
    assert "torch 100.0 / 100.00" in text  # chrF / BLEU in the summary
    assert rec["text"]["bleu_signature"] in text and rec["text"]["chrf_signature"] in text
    assert f"{run_text.N_PROMPTS} prompts of {run_text.PROMPT_CHARS} characters" in text
    assert "T = 1.5" in text and "greedy" in text


@pytest.fixture(scope="module")
def sized_report(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """One report over three runs of different sizes (built once: figures are the slow part)."""
    out = tmp_path_factory.mktemp("sized")
    run_ids = make_sized_runs(out)
    return write_report(out, run_ids), run_ids


def test_svgs_are_inline_with_unique_ids_and_nothing_external(sized_report: tuple[Path, list[str]]) -> None:
    html = sized_report[0].read_text()
    page = Page(html)
    assert len(page.ids) == len(set(page.ids)), "duplicate element ids across inline SVGs"
    refs = set(re.findall(r'href="#([^"]+)"', html)) | set(re.findall(r"url\(#([^)]+)\)", html))
    assert refs <= set(page.ids), refs - set(page.ids)
    assert "<script" not in html and "<link" not in html and " src=" not in html and "@import" not in html
    assert [u for u in re.findall(r'href="([^"#][^"]*)"', html)] == ["index.html"]


# --- tests: unfinished, failed, unfair --------------------------------------------------------------------------------
def _first_banner(html: str) -> str:
    page = Page(html)
    assert page.banners, "no banner"
    # the banner comes before the summary
    assert html.index('class="banner') < html.index('id="summary"')
    return " ".join(page.banners[0].split())


def test_interrupted_record_renders_with_banner_on_top(tmp_path: Path, no_figures: None) -> None:
    run_id = make_run(tmp_path, statuses={"numpy": "interrupted"})
    html = write_report(tmp_path, [run_id]).read_text()
    banner = _first_banner(html)
    assert "numpy interrupted after 60 of 120 steps" in banner and f"harness resume {run_id}" in banner
    text = text_of(html)
    # compared where both got: last common evaluation step is 40 (numpy has evals 0, 40 after 60 steps)
    assert "at step 40" in text and "incomplete" in text


def test_failed_record_renders_with_banner_and_traceback(tmp_path: Path, no_figures: None) -> None:
    run_id = make_run(tmp_path, statuses={"torch": "failed: RuntimeError: boom"})
    html = write_report(tmp_path, [run_id]).read_text()
    assert "torch failed: RuntimeError: boom (after 40 of 120 steps)" in _first_banner(html)
    assert "traceback of the failure" in html and "RuntimeError: boom" in html


def test_running_records_fresh_and_stale(tmp_path: Path, no_figures: None) -> None:
    run_id = make_run(tmp_path, statuses={"numpy": "running"})
    html = write_report(tmp_path, [run_id]).read_text()
    assert "numpy still running (80 of 120 steps" in _first_banner(html)
    assert "snapshot" in _first_banner(html)
    # no summary timings in a running record: recomputed from the per-step times (0.03 s each)
    assert f"{16 * 64 / 0.03:,.0f}" in text_of(html)
    old = time.time() - 3 * 3600
    os.utime(store.RunPaths(tmp_path, run_id).dir / "numpy.json", (old, old))
    html = write_report(tmp_path, [run_id]).read_text()
    assert "last written 3.0 h ago: the worker is no longer alive" in _first_banner(html)


def test_different_fingerprints_say_not_fair(tmp_path: Path, no_figures: None) -> None:
    run_id = make_run(tmp_path, fingerprints={"numpy": {"weights": "x" * 64}})
    html = write_report(tmp_path, [run_id]).read_text()
    assert "numpy got different weights than torch: the comparison is not fair" in _first_banner(html)
    summary = text_of(html)[:text_of(html).index("Run " + run_id)]
    assert "not a fair comparison" in summary


def test_missing_backend_record_is_reported(tmp_path: Path, no_figures: None) -> None:
    run_id = make_run(tmp_path, backends=("torch",), missing=("flux",))
    html = write_report(tmp_path, [run_id]).read_text()
    assert "flux has no record" in _first_banner(html)
    assert ("neutral", "single backend") in _pills(html) and ("error", "incomplete") in _pills(html)
    nothing = make_run(tmp_path, backends=(), missing=("torch", "numpy"))
    html = write_report(tmp_path, [nothing]).read_text()
    assert "no backend wrote a record" in _first_banner(html) and ("error", "no records") in _pills(html)


def parity_record(run_dir: Path, backends: tuple[str, str], logits_shift: float = 0.0) -> dict:
    """A parity.json as `harness parity` writes it, from harness.parity.compare.compare on the run's records."""
    from harness.parity.compare import compare
    from harness.parity.tolerances import default_tolerances
    from harness.store.parity import SCHEMA, SCHEMA_VERSION

    recs = {b: json.loads((run_dir / f"{b}.json").read_text()) for b in backends}
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 4, 5))
    grads = {"grad/lm_head.weight": rng.normal(size=(5, 3)), "grad/wte.weight": rng.normal(size=(5, 3))}
    rates = {"lr": np.full(3, 0.01), "lr_used": np.full(3, 0.01)}  # the rate each step took, as the schedule's
    probe_a = {"logits": logits, **grads, **rates}
    probe_b = {"logits": logits + logits_shift, **grads, **rates}
    a, b = backends
    tol = default_tolerances("float32/float64", "large")  # logits 1e-5, loss 1e-4
    result = compare(probe_a, probe_b, recs[a]["steps"]["loss"], recs[b]["steps"]["loss"], tol,
                     backends=backends)
    return {"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "run_id": run_dir.name,
            "verdict": "pass" if result.passed else "fail",
            "failures": result.failures, "results": result.to_dict(), "checks": result.rows(),
            "tolerances": {"logits": tol.logits,
            "grad": tol.grad, "loss": tol.loss}, "precision_pair": "float32/float64",
            "steps": len(recs[a]["steps"]["loss"]),
            "dtypes": {a: "float32", b: "float64"},
            "tolerance_source": dict.fromkeys(("logits", "grad", "loss"), "default (float32/float64 pair)")}


def test_parity_json_verdicts(tmp_path: Path, no_figures: None) -> None:
    """parity.json as `harness parity` writes it: PASS with every check shown; FAIL with a banner and the reason."""
    run_id = make_run(tmp_path, dropout=0.0, loss_noise=1e-6)  # per-step |diff| ~ 1e-6 < 1e-4
    directory = store.RunPaths(tmp_path, run_id).dir
    store.atomic_write_json(directory / "parity.json", parity_record(directory, ("torch", "numpy")))
    html = write_report(tmp_path, [run_id]).read_text()
    text = text_of(html)
    assert Page(html).banners == []
    assert "parity: pass" in text and "Parity (float32/float64 pair, 120 steps, dropout 0): PASS" in text
    assert "step-0 logits max |diff| 0.0e+00 ≤ 1e-05" in text  # harness.parity's own rows, as parity.json holds them
    assert "learning rate per step vs schedule 0.0e+00 ≤ 0.0001" in text
    assert "computed in torch float32, numpy float64" in text
    store.atomic_write_json(directory / "parity.json", parity_record(directory, ("torch", "numpy"), 1e-3))
    html = write_report(tmp_path, [run_id]).read_text()
    assert "parity check FAILED" in _first_banner(html)
    text = text_of(html)
    assert "Parity (float32/float64 pair, 120 steps, dropout 0): FAIL" in text
    assert "step-0 logits max |diff| 1.0e-03 > 1e-05" in text and "FAIL: logits max abs diff" in text
    assert "<th>first broken</th>" in html and "<th>worst</th>" in html  # two labelled columns, one place each
    from harness.store import parity as record

    error = {"schema": record.SCHEMA, "schema_version": record.SCHEMA_VERSION, "verdict": "error",
             "failures": ["ERROR: numpy exited 1"]}
    store.atomic_write_json(directory / "parity.json", error)
    assert "compared nothing (ERROR: numpy exited 1)" in _first_banner(write_report(tmp_path, [run_id]).read_text())
    # a parity.json of an older harness is refused in one line, never read in its old format
    store.atomic_write_json(directory / "parity.json", dict(error, schema_version=0, results={"passed": False}))
    assert "parity.json' was written by an older nanogpt-parity (schema 0); re-run it" in _first_banner(
        write_report(tmp_path, [run_id]).read_text())


def make_parity_run(out: Path, logits_shift: float = 0.0) -> str:
    """A run of `harness parity` (its spec's parity options, parity.json), numpy on a busy machine."""
    run_id = make_run(out, dropout=0.0, loss_noise=1e-6, text=False)
    directory = store.RunPaths(out, run_id).dir
    spec = json.loads((directory / "spec.json").read_text())
    store.atomic_write_json(directory / "spec.json", dict(spec, parity={"opt_steps": 3, "reference": "numpy"}))
    path = directory / "numpy.json"
    rec = json.loads(path.read_text())
    rec["chunks"] = _chunks(120, 10, 120)
    store.atomic_write_json(path, rec)
    store.atomic_write_json(directory / "parity.json", parity_record(directory, ("torch", "numpy"), logits_shift))
    return run_id


def test_a_parity_page_is_a_correctness_page(tmp_path: Path, no_figures: None) -> None:
    """Its own title, its verdict first, no speed anywhere (no banner of a busy machine, no tokens/s, no cost
    section, no speed columns), and its index row shows no tokens/s; a FAIL is not contradicted by the band's
    "the losses agree" (a parity check's verdict is its own)."""
    run_id = make_parity_run(tmp_path)
    html = write_report(tmp_path, [run_id]).read_text()
    page, text = Page(html), text_of(html)
    assert "<title>nanogpt-parity parity check: small — torch vs numpy</title>" in html
    assert ">Parity check small</a>" in html and ">Run small</a>" not in html  # its section named as such
    assert page.banners == [] and ("ok", "parity: pass") in _pills(html)
    before = text[:text.rindex("How to read this")]  # the note there says why a parity check times nothing
    assert not [w for w in ("tokens/s", "faster", "throughput", "Speed", "speed", "Cost: time", "step (median)",
                            "Contention", "busy") if w in before]
    assert "a correctness check" in text[text.rindex("How to read this"):]
    index = text_of(write_index(tmp_path).read_text())
    assert "parity: pass" in index and "— (a parity check times nothing)" in index and "102,400" not in index
    failed = write_report(tmp_path, [make_parity_run(tmp_path, 1e-3)]).read_text()
    assert ("error", "parity: FAIL") in _pills(failed) and "the losses agree" not in text_of(failed)


# --- tests: a headline agrees with its own details -------------------------------------------------------------------
def _plant_tail(out: Path, run_id: str, offset: float, noise: float) -> None:
    """numpy's per-step training loss made torch's − `offset`, plus N(0, `noise`): torch − numpy averages `offset`."""
    directory = store.RunPaths(out, run_id).dir
    torch_loss = np.array(json.loads((directory / "torch.json").read_text())["steps"]["loss"])
    path = directory / "numpy.json"
    rec = json.loads(path.read_text())
    rec["steps"]["loss"] = (torch_loss - offset + np.random.default_rng(1).normal(0, noise, len(torch_loss))).tolist()
    store.atomic_write_json(path, rec)


@pytest.mark.parametrize("offset, noise, level, label, conclusion", [
    # torch higher by 0.2 % of the loss, an interval that excludes 0: inside the 2 % band, so they agree
    (0.005, 0.002, "ok", "losses agree", "torch higher on average. Verdict: both within the 2% band: the losses "
                                         "agree."),
    # validation losses the same, but every step's training loss 4 % apart: they differ
    (0.1, 0.002, "error", "losses differ", "Verdict: the per-step training losses differ by more than the 2% band: "
                                           "the losses differ."),
    # an interval across the band's edge: no verdict, said as such
    (0.045, 0.05, "neutral", "losses: no verdict", "Verdict: the per-step interval reaches beyond the 2% band: too "
                                                   "noisy to say whether the losses agree."),
])
def test_the_headline_and_its_sentence_come_from_one_judgement(tmp_path: Path, no_figures: None, offset: float,
                                                                noise: float, level: str, label: str,
                                                                conclusion: str) -> None:
    """The contradiction a torch,jax run showed: headline "losses agree", next sentence "a systematic difference
    (torch higher)". Both now come from one judgement against one band, in the headline, the sentence and the
    table alike."""
    run_id = make_run(tmp_path)
    _plant_tail(tmp_path, run_id, offset, noise)
    html = write_report(tmp_path, [run_id]).read_text()
    text = text_of(html)
    summary = text[text.index("Summary"):text.index("Run " + run_id)]
    assert (level, label) in _pills(html) and f"{label} " in summary  # the box's label, then its sentences
    assert conclusion in summary and "systematic difference" not in text
    verdict = label.removeprefix("losses").lstrip(": ")
    assert f" {verdict} torch − numpy = " in section(text, "Loss agreement and speed", "Loss curves")  # the table


# --- tests: several sizes, the index ----------------------------------------------------------------------------------
def test_scaling_section_for_several_sizes(sized_report: tuple[Path, list[str]]) -> None:
    path, run_ids = sized_report
    assert path.name == report_name(run_ids) + ".html" and path.name.startswith(run_ids[0] + "+2-")
    html = path.read_text()
    assert 'id="scaling"' in html and html.count('class="figure"') == 1 + 3 * 3
    scaling = text_of(section(html, 'id="scaling"', "</section>"))
    for size in ("small", "medium", "large"):
        assert size in scaling
    assert "40 ms" in scaling and "120 ms" in scaling  # large: torch 0.04 s, numpy 0.12 s


def test_index_links_every_report_with_headline_numbers(tmp_path: Path, no_figures: None) -> None:
    a = make_run(tmp_path, val_offset={"numpy": 0.01})
    b = make_run(tmp_path, backends=("torch",), statuses={"torch": "interrupted"})
    lonely = make_run(tmp_path, backends=("torch",))
    pa, pb = write_report(tmp_path, [a]), write_report(tmp_path, [b])
    (tmp_path / "notes.html").write_text("<html><title>mine</title></html>")  # not a report: not listed
    index = write_index(tmp_path)
    assert index == tmp_path / "index.html"
    html = index.read_text()
    links = Page(html).links
    assert sorted(links) == sorted([pa.name, pb.name])
    for link in links:
        assert (tmp_path / link).is_file()
    text = text_of(html)
    va = _curve(np.array(120)) + 0.02
    assert f"torch {va:.4f} numpy {va + 0.01:.4f}" in text
    assert f"torch {16 * 64 / 0.01:,.0f} numpy {16 * 64 / 0.03:,.0f}" in text
    assert "torch interrupted" in text
    assert {("ok", "losses agree"), ("neutral", "single backend"), ("warn", "incomplete")} <= set(_pills(html))
    assert "Runs without a report" in text and lonely in text
    assert not list(tmp_path.glob(".*.tmp"))


def test_index_reads_the_records_afresh(tmp_path: Path, no_figures: None) -> None:
    run_id = make_run(tmp_path, backends=("torch",))
    write_report(tmp_path, [run_id])
    (store.RunPaths(tmp_path, run_id).dir / "torch.json").write_text("{not json")
    text = text_of(write_index(tmp_path).read_text())
    assert f"{run_id} records unavailable: run record" in text and "is corrupt" in text


def test_missing_and_corrupt_records_raise_usage_error(tmp_path: Path) -> None:
    with pytest.raises(UsageError):
        write_report(tmp_path, ["no-such-run"])
    run_id = make_run(tmp_path, backends=("torch",))
    (store.RunPaths(tmp_path, run_id).dir / "torch.json").write_text('{"schema": "nanogpt-parity/run-record"')
    with pytest.raises(UsageError, match="corrupt"):
        write_report(tmp_path, [run_id])
    assert not list(tmp_path.glob("*.html"))


# --- tests: the command line ------------------------------------------------------------------------------------------
def harness(*args: str) -> tuple[int, str, str]:
    """`harness ARGS...` in this process (the run's workers are still their own processes): (status, out, err)."""
    from harness.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    data = data_path()
    pytest.importorskip("torch")
    out = tmp_path_factory.mktemp("cli") / "out"
    code, _, err = harness("run", "--size", "small", "--steps", "12", "--backend", "torch", "--out", str(out),
                           "--data", str(data), "--quiet", "--no-text")  # text: test_metrics, and above
    assert code == 0, err
    (run_id,) = [p.name for p in (out / "runs").iterdir()]
    return out, run_id


def test_cli_run_writes_report_and_index(cli_run: tuple[Path, str]) -> None:
    out, run_id = cli_run
    report = out / f"{run_id}.html"
    assert report.is_file() and (out / "index.html").is_file()
    rec = record_doc(out / "runs" / run_id / "torch.json")
    text = text_of(report.read_text())
    assert f"final validation loss {rec['evals'][-1]['val_loss']:.4f} at step 12" in text
    assert f"{rec['timings']['tokens_per_s']:,.0f} tokens/s" in text
    assert "No text metrics" in text  # --no-text
    assert f'href="{run_id}.html"' in (out / "index.html").read_text()


def test_cli_report_rebuilds(cli_run: tuple[Path, str]) -> None:
    out, run_id = cli_run
    report = out / f"{run_id}.html"
    report.unlink()
    code, stdout, err = harness("report", run_id, "--out", str(out))
    assert code == 0, err
    assert report.is_file() and str(report) in stdout


@pytest.mark.parametrize("problem", ["missing", "corrupt"])
def test_cli_report_bad_record_exit_2_one_line_nothing_written(tmp_path: Path, problem: str) -> None:
    out = tmp_path / "out"
    run_id = "no-such-run"
    if problem == "corrupt":
        run_id = make_run(out, backends=("torch",))
        (store.RunPaths(out, run_id).dir / "torch.json").write_text("{truncated")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    code, stdout, err = harness("report", run_id, "--out", str(out))
    assert code == 2 and stdout == ""
    assert len(err.strip().splitlines()) == 1 and err.startswith("harness: error:") and "Traceback" not in err
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


# --- tests: speed verdicts, contention, conventions ------------------------------------------------------------------
def write_paired(out: Path, run_id: str, ratios: list[float], disturbed: tuple[int, ...] = (),
                 rounds: int = 10) -> PairedRecord:
    """A paired.json for run `run_id` whose round r has numpy steps ratios[r] times as long as torch's."""
    from test_paired import planted

    doc = planted(ratios, disturbed, rounds=rounds)
    doc.dump(store.RunPaths(out, run_id).paired_timing)
    return doc


def _pills(html: str) -> list[tuple[str, str]]:
    return re.findall(r'<span class="pill (\w+)">([^<]*)</span>', html)


def test_speed_verdict_comes_from_the_paired_timing_with_its_interval_in_one_direction(tmp_path: Path,
                                                                                      no_figures: None) -> None:
    run_id = make_run(tmp_path)
    write_paired(tmp_path, run_id, [3.0, 2.9, 3.1, 3.05, 2.95, 3.0, 2.98, 3.02, 3.01, 2.99])
    # by hand (scipy): exp(mean(log r) ± t(0.975, 9) sd(log r) / sqrt(10)) = 3 [2.96, 3.04]; the CV of the time
    # ratios torch / numpy (1 / r) is 1.8 %
    html = write_report(tmp_path, [run_id]).read_text()
    text = text_of(html)
    summary = text[text.index("Summary"):text.index("Run " + run_id)]
    assert "Speed: torch is 3× faster than numpy [2.96, 3.04] (paired timing: torch and numpy alive at once, timed " \
           "in alternating short bursts; interval over 10 undisturbed of 10 rounds of one seed, coefficient of " \
           "variation 1.8%; 1 seed, fewer than 3" in summary
    assert "paired timing: 0 of 10 rounds disturbed" in summary  # the contention line of the speed verdict
    table = section(text, "Loss agreement and speed", "Loss curves")
    assert "torch 3× faster [2.96, 3.04]" in table  # the table says what the sentence says
    assert "0.333" not in table and "numpy 3" not in table  # ... and never the other way round
    # one pair of processes cannot show how much a process's own speed varies: stated, but not green
    assert ("neutral", "speed: torch 3× faster (1 seed)") in _pills(html)


@pytest.mark.parametrize("ratios, disturbed, level, label, words", [
    ([0.9, 1.1, 1.0, 1.05, 0.95, 1.0, 1.02, 0.98, 1.01, 0.99], (), "neutral", "speed: no clear difference",
     "the interval includes 1, so no clear difference"),
    ([1.5, 2.4, 1.6, 2.2, 1.8, 2.5, 1.7, 2.3, 1.9, 2.0], (), "neutral", "(noisy)",
     "(coefficient of variation over 10%)"),
    ([2.0] * 3 + [5.0] * 9, tuple(range(3, 12)), "warn", "speed: machine too busy",
     "9 of 12 paired rounds were disturbed by other work on the machine"),
])
def test_speed_verdicts_the_data_cannot_carry_are_never_green(tmp_path: Path, no_figures: None, ratios: list[float],
                                                              disturbed: tuple[int, ...], level: str, label: str,
                                                              words: str) -> None:
    run_id = make_run(tmp_path)
    write_paired(tmp_path, run_id, ratios, disturbed)
    html = write_report(tmp_path, [run_id]).read_text()
    speed = [(lv, lab) for lv, lab in _pills(html) if lab.startswith("speed")]
    assert speed and all(lv == level and label in lab for lv, lab in speed), speed
    assert words in text_of(html)


def _chunks(n: int, busy_from: int, busy_to: int) -> list[dict]:
    quiet = {"wall_s": 0.5, "cpu_s": 0.5, "exec_s": 0.5, "wait_s": 0.0, "threads": 1, "ncpu": 2, "load": [0.5, 0.6]}
    busy = dict(quiet, cpu_s=0.3, exec_s=0.3, wait_s=0.2, load=[2.5, 2.6])
    return [dict(busy if busy_from <= s < busy_to else quiet, step=s, n=10) for s in range(0, n, 10)]


def test_a_mostly_disturbed_backend_is_named_and_kept_out_of_speed(tmp_path: Path, no_figures: None) -> None:
    run_id = make_run(tmp_path)
    path = store.RunPaths(tmp_path, run_id).dir / "numpy.json"
    rec = json.loads(path.read_text())
    rec["chunks"] = _chunks(120, 20, 100)  # 80 of the 110 steady steps disturbed
    del rec["timings"]["step_median_s"]  # recomputed from the steps and the chunks, as for a killed worker
    store.atomic_write_json(path, rec)
    html = write_report(tmp_path, [run_id]).read_text()
    banner = " ".join(Page(html).banners)
    assert "numpy trained on a busy machine: 73% of its steady steps were disturbed" in banner
    assert "kept out of every speed verdict (its losses still count)" in banner
    text = text_of(html)
    assert "numpy: 73% of 110 steady steps disturbed (cpu wait); figures from the 30 undisturbed ones; mostly " \
           "disturbed: kept out of speed verdicts" in text
    assert "73% (mostly: no speed verdict)" in text  # the summary table
    costs = section(text, "Cost: time", "Text quality")
    assert "over 30 undisturbed steps (80 disturbed left out)" in costs
    assert "waited for a CPU (median / worst chunk)" in costs and "40.0%" in costs


def test_a_record_of_an_older_harness_is_refused_in_one_line(tmp_path: Path, no_figures: None) -> None:
    """One schema-version check per record kind: an older run record (schema 2: no contention evidence) is refused
    with the file and the fix, never read in its old format; so is a newer one."""
    run_id = make_run(tmp_path, backends=("torch",))
    path = store.RunPaths(tmp_path, run_id).dir / "torch.json"
    rec = json.loads(path.read_text())
    rec["schema_version"] = 2
    rec.pop("chunks", None)
    store.atomic_write_json(path, rec)
    older = r"torch.json' was written by an older nanogpt-parity \(schema 2\); re-run it$"
    with pytest.raises(UsageError, match=older):
        store.RunRecord.load(path)
    with pytest.raises(UsageError, match="re-run it"):
        write_report(tmp_path, [run_id])
    rec["schema_version"] = store.record.SCHEMA_VERSION + 1
    store.atomic_write_json(path, rec)
    with pytest.raises(UsageError, match=r"written by a newer nanogpt-parity .*upgrade nanogpt-parity"):
        store.RunRecord.load(path)
    spec = store.RunPaths(tmp_path, run_id).spec
    doc = json.loads(spec.read_text())
    del doc["schema_version"]
    store.atomic_write_json(spec, doc)
    with pytest.raises(UsageError, match=r"spec.json' was written by an older nanogpt-parity \(schema 0\)"):
        store.RunSpec.load(store.RunPaths(tmp_path, run_id))

def make_sweep(out: Path, seeds: int = 3, dtypes: tuple[str | None, ...] = (None,),
               ratios: dict | None = None) -> str:
    """A sweep as `harness sweep` leaves it: one single-backend run per cell (torch and numpy per seed and dtype),
    its manifest, and per block a paired-timing record whose numpy steps take ratios[(dtype, seed)] times torch's
    (default 3, with a little spread). Returns the sweep id."""
    from test_paired import planted


    sweep_id = store.SweepPaths.new(out, "synthetic").sweep_id
    cells, entries = [], []
    for seed in range(1337, 1337 + seeds):
        for dtype in dtypes:
            members = []
            for backend in ("torch", "numpy"):
                run_id = make_run(out, backends=(backend,), text=False)
                path = store.RunPaths(out, run_id).dir / f"{backend}.json"
                rec = json.loads(path.read_text())
                rec["seed"], rec["backend_options"] = seed, ({"dtype": dtype} if dtype else {})
                store.atomic_write_json(path, rec)
                cell = {"index": len(cells), "key": f"small/{backend}/cpu/seed={seed}", "label": "small",
                        "config": rec["config"], "backend": backend, "seed": seed, "device": "cpu",
                        "backend_options": rec["backend_options"],
                        "run_id": run_id, "status": "completed", "job_ids": [], "attempts": 1, "contended": False}
                cells.append(cell)
                members.append(cell)
            r = (ratios or {}).get((dtype, seed), 3.0)
            doc = planted([r * (1 + 0.01 * ((i % 3) - 1)) for i in range(10)]).to_dict()
            for c, m in zip(doc["contenders"], members):
                c.update(run_id=m["run_id"], cell=m["index"])
            entry = {"index": len(entries), "kind": "paired", "key": f"small/cpu/seed={seed}/paired", "label": "small",
                     "seed": seed, "device": "cpu", "dtype": dtype, "members": [m["index"] for m in members],
                     "rounds": 10, "path": f"sweeps/{sweep_id}/paired/{len(entries)}.json", "status": "completed",
                     "job_ids": [], "attempts": 1}
            store.atomic_write_json(out / entry["path"], doc)
            entries.append(entry)
    store.atomic_write_json(store.SweepPaths(out, sweep_id).manifest, {
        "schema": "nanogpt-parity/sweep", "schema_version": 1, "sweep_id": sweep_id,
        "created_at": "2026-01-01T00:00:00Z",
        "spec": {"backends": ["torch", "numpy"], "checkpoint_every": 0, "text": False},
        "executor": {"kind": "local", "jobs": 1}, "data": {"path": "/data/tiny.txt", "sha256": "ab" * 32},
        "cells": cells, "paired": entries})
    return sweep_id


def test_sweep_verdicts_one_per_dtype_green_only_when_the_data_carries_it(tmp_path: Path, no_figures: None) -> None:
    from harness.report.sweep import write_sweep_report

    sweep_id = make_sweep(tmp_path, seeds=3, dtypes=("float32", "float64"),
                          ratios={("float64", s): 1.0 + 0.02 * (s - 1338) for s in (1337, 1338, 1339)})
    html = write_sweep_report(tmp_path, sweep_id).read_text()
    text = text_of(html)
    # one verdict per dtype, each naming it: float32 clear (3x), float64 no clear difference (0.98 .. 1.02)
    assert "small on cpu, dtype float32: torch vs numpy" in text
    assert "small on cpu, dtype float64: torch vs numpy" in text
    pills = [p for p in _pills(html) if p[1].startswith("speed")]
    assert ("ok", "speed: torch 3× faster") in pills and ("neutral", "speed: no clear difference") in pills
    assert "torch is 3× faster than numpy [" in text and "(paired timing, interval across 3 seeds" in text
    table = section(text, "Convention: a difference", "Groups (config")
    assert "torch 3× faster [" in table  # the table says it as the sentence does
    index = write_index(tmp_path).read_text()
    itext = text_of(index)
    assert f"sweep {sweep_id}" in itext and "12 of 12 cells completed" in itext
    assert ("ok", "speed: torch 3× faster") in _pills(index)
    assert not any(run_id in index for run_id in (json.loads(p.read_text())["run_id"]
                                                  for p in (tmp_path / "runs").glob("*/spec.json")))


def test_fewer_than_three_seeds_is_said_and_not_green(tmp_path: Path, no_figures: None) -> None:
    from harness.report.sweep import write_sweep_report

    html = write_sweep_report(tmp_path, make_sweep(tmp_path, seeds=2)).read_text()
    assert ("neutral", "speed: torch 3× faster (2 seeds)") in _pills(html)
    assert "Said plainly: 2 seeds, fewer than 3: the interval cannot show how much a process's own speed varies." \
        in text_of(html)


def test_three_seeds_whose_ratios_vary_over_ten_percent_are_not_green(tmp_path: Path, no_figures: None) -> None:
    from harness.report.sweep import write_sweep_report

    # numpy about 2, 3 and 4.5 times as slow (make_sweep spreads each seed's rounds by ±1 %): by hand (scipy),
    # geometric mean 3, t interval (2 df) [1.09, 8.21] excludes 1, but the time ratios have a CV of 40 %
    sweep_id = make_sweep(tmp_path, seeds=3, ratios={(None, 1337): 2.0, (None, 1338): 3.0, (None, 1339): 4.5})
    html = write_sweep_report(tmp_path, sweep_id).read_text()
    assert ("neutral", "speed: torch 3× faster (noisy)") in _pills(html)
    assert "torch is 3× faster than numpy [1.09, 8.21]" in text_of(html)
    assert "the paired ratios vary by 40% (coefficient of variation over 10%): noisy" in text_of(html)


def test_a_failed_paired_timing_says_why_and_is_not_a_verdict(tmp_path: Path, no_figures: None) -> None:
    from harness.run import paired_timing
    from harness.store.paired import Contender, Session

    run_id = make_run(tmp_path)
    doc = paired_timing.new_doc([Contender(name="torch", backend="torch"), Contender(name="numpy", backend="numpy")],
                                "small", 1)
    doc.sessions.append(Session(status="failed", failure="numpy: the timing process exited with status 1"))
    doc.dump(store.RunPaths(tmp_path, run_id).paired_timing)
    html = write_report(tmp_path, [run_id]).read_text()
    assert ("warn", "speed: paired timing failed") in _pills(html)
    assert "the paired timing measured no round (numpy: the timing process exited with status 1)" in text_of(html)


def test_each_seed_band_encloses_its_line_in_the_figure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Validation loss against elapsed time, read from the figure as drawn: the seeds' times differ (a busy
    machine, a compilation cache warm for later seeds), and each backend's shaded band encloses its line at every
    vertex and between them. The band was drawn on a grid from 0 to the fastest seed's end."""
    from harness.report import figures
    from harness.report.sweep import write_sweep_report

    sweep_id = make_sweep(tmp_path, seeds=3)
    for path in (tmp_path / "runs").glob("*/*.json"):
        if path.name == "spec.json":
            continue
        rec = json.loads(path.read_text())
        slow = {1337: 4.0, 1338: 1.0, 1339: 0.5}[rec["seed"]]
        times = [t * slow for t in rec["steps"]["time_s"]]
        times[0] += 4.0 if rec["seed"] == 1337 else 0.0  # the first seed compiles; the others hit the cache
        rec["steps"]["time_s"] = times
        store.atomic_write_json(path, rec)
    drawn = []
    real = figures.to_svg
    monkeypatch.setattr(figures, "to_svg", lambda fig, title: drawn.append((title, fig)) or real(fig, title))
    write_sweep_report(tmp_path, sweep_id)
    (fig,) = [f for title, f in drawn if title.startswith("validation loss against time")]
    ax = fig.axes[0]
    bands = {tuple(np.round(c.get_facecolor()[0][:3], 3)): c for c in ax.collections}
    lines = [ln for ln in ax.get_lines() if ln.get_linestyle() != ":"]  # the target's dotted line is no seed
    assert len(lines) == 2 and len(bands) == 2
    for line in lines:
        band = bands[tuple(np.round(matplotlib_rgb(line.get_color()), 3))]
        verts = np.concatenate([p.vertices for p in band.get_paths()])
        xs = np.unique(verts[:, 0])
        lo = np.array([verts[verts[:, 0] == x, 1].min() for x in xs])
        hi = np.array([verts[verts[:, 0] == x, 1].max() for x in xs])
        x, y = (np.asarray(v, dtype=float) for v in line.get_data())
        x, y = np.concatenate([x, (x[1:] + x[:-1]) / 2]), np.concatenate([y, (y[1:] + y[:-1]) / 2])  # and between
        assert xs[0] <= x.min() and x.max() <= xs[-1], (line.get_label(), xs[[0, -1]], x[[0, -1]])
        assert np.all(np.interp(x, xs, lo) <= y + 1e-9) and np.all(y <= np.interp(x, xs, hi) + 1e-9), line.get_label()


def matplotlib_rgb(colour: str) -> tuple[float, float, float]:
    from matplotlib.colors import to_rgb

    return to_rgb(colour)


def test_one_renderer_turns_inline_code_into_code_and_escapes_the_rest() -> None:
    """Messages carry Markdown's inline code ("use `harness run`"); every page renders them with harness.pages.inline:
    code as <code>, everything else escaped (a message may quote a record's text), numbers unbroken."""
    from harness.pages import inline

    assert str(inline("use `harness run` & <b>")) == "use <code>harness run</code> &amp; &lt;b&gt;"
    assert str(inline("`<script>x</script>` then <img src=x>")) == \
        "<code>&lt;script&gt;x&lt;/script&gt;</code> then &lt;img src=x&gt;"
    assert str(inline("a ` lone tick")) == "a ` lone tick"
    assert str(inline("rel err 2.86e-07 > tol 1e-06")) == \
        'rel err <span class="num">2.86e-07</span> &gt; tol <span class="num">1e-06</span>'
    assert str(inline(None)) == ""
