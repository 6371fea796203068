"""Grading a port's results against a kit with `harness parity`'s comparison.

`probes_of` lays the oracle's float64 answers and the port's results out as two parity probes, the oracle's
optimizer steps taken from the port's own states (harness.kit.resync: re-synchronised, as `harness parity`); `grade`
hands them to `harness.parity.compare.compare`, held to the tolerances measured for the port's precision and the
kit's config (`harness.parity.tolerances.tolerances_for`: the same code and numbers as `harness parity`); a depth
the results do not hold is handed to the comparison as the oracle's own values and reported "not given". `check`
adds what the command reports (the summary rows, the first broken depth and its likely cause, the float32 hint,
given only with float32 evidence) and `verdict` is the JSON verdict written beside the page.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from harness.core.taps import MASK_PREFIX as TAP_MASK_PREFIX
from harness.core.taps import PREFIX as TAP_PREFIX
from harness.errors import UsageError
from harness.kit.export import MANIFEST, opt_key
from harness.kit.load import DEPTHS, OPT_NAME
from harness.kit.resync import oracle_steps, resync_problem
from harness.parity.compare import BLIND_SPOTS, compare
from harness.parity.forward import dropout_cause
from harness.parity.numeric import float32_stored_as_float64, fmt, within
from harness.parity.optimizer import WRONG_STEP_INPUTS
from harness.parity.result import ParityResult
from harness.parity.tolerances import Tolerances, default_tolerances, precision_pair, tolerances_for

ORACLE, PORT = "oracle", "port"


@dataclass
class Check:
    """A port's results graded against a kit: the comparison and its tolerances, the port's precision, the depths it
    gave and those the kit offers that it did not, the summary rows, the first broken depth (None: it passed) and
    the float32 hint."""

    result: ParityResult
    tolerances: Tolerances
    dtype: str
    given: list[str]
    missing: list[str]
    opt_steps: int
    rows: list[dict[str, Any]]
    diagnosis: dict[str, Any] | None
    hint: str | None

    @property
    def passed(self) -> bool:
        return self.result.passed

    @property
    def summary(self) -> str:
        """One sentence: where the port agrees with the oracle, or where it first differs."""
        d = self.diagnosis
        where = ""
        if d:
            where = f", first at {d['depth']}" + (f" ({d['tap']})" if d.get("tap") else
                                                  f" ({d['parameter']})" if d.get("parameter") else "")
        return (f"the port agrees with the oracle at {', '.join(self.given)}" if self.passed
                else f"the port differs from the oracle{where}")


def check(manifest: dict[str, Any], kit: dict[str, dict[str, np.ndarray]], results: dict[str, np.ndarray],
          given: list[str], dtype: str, opt_steps: int,
          progress: Callable[[int, int], None] | None = None) -> Check:
    """Grade `results` (read and validated by harness.kit.load: `given`, `dtype`, `opt_steps`) against the kit.
    `progress(k, K)`: called before the oracle takes the port's optimizer step k of K from its state."""
    probes = probes_of(manifest, kit, results, opt_steps, progress)
    result, tol = grade(manifest, probes, results, dtype)
    rows = table_rows(result, given)
    diagnosis = diagnose(result, rows, list(manifest["parameters"]))
    hint = None if result.passed else float32_hint(manifest, probes, results, result, given, dtype)
    if hint and diagnosis:
        diagnosis["cause"] = hint
    offered = [d for d in DEPTHS if d != "learning_rate"  # read from the optimizer states, not an array a port gives
               and (d != "dropout_gradients" or any(k.startswith("dropout_grad/") for k in kit["expected.npz"]))]
    missing = [d for d in offered if d not in given]
    return Check(result=result, tolerances=tol, dtype=dtype, given=given, missing=missing, opt_steps=opt_steps,
                 rows=rows, diagnosis=diagnosis, hint=hint)


@dataclass
class Probes:
    """What the comparison reads: the oracle's and the port's probes (a depth the port did not give: the oracle's
    own values on both sides), the losses compared, the config, and why the optimizer steps were compared
    free-running, if they were (None: re-synchronised, harness.kit.resync)."""

    oracle: dict[str, np.ndarray]
    port: dict[str, np.ndarray]
    oracle_loss: list[float]
    port_loss: list[float]
    config: Any
    free_running: str | None
    masks: dict[str, np.ndarray]  # the kit's masks.npz (empty without dropout)


def probes_of(manifest: dict[str, Any], kit: dict[str, dict[str, np.ndarray]], results: dict[str, np.ndarray],
              opt_k: int, progress: Callable[[int, int], None] | None = None) -> Probes:
    """The two probes as a parity run holds them. The taps are compared where the port gave them. The learning rate
    each side's steps took is read from its own free-running states (harness.core.schedule.effective_rate); then
    the oracle's optimizer states are replaced by its steps from the port's states (harness.kit.resync), so that
    each of the port's steps is graded from the same state, as `harness parity` grades them."""
    expected, weights = kit["expected.npz"], kit["weights.npz"]
    params = list(manifest["parameters"])
    k_max = opt_k or int(manifest["steps"])
    oracle = {key: value for key, value in expected.items() if key not in ("loss", "logits_loss")
              and not (OPT_NAME.match(key) and int(OPT_NAME.match(key).group(1)) > k_max)}  # type: ignore[union-attr]
    port = {key: (results[key] if key in results else value) for key, value in oracle.items()
            if not key.startswith(TAP_PREFIX) or key in results}
    for n in params:  # the state before step 1, the same on both sides: the kit's initial weights
        oracle[opt_key(0, "param", n)] = port[opt_key(0, "param", n)] = np.asarray(weights[n], dtype=np.float64)
    batches = kit.get("batches.npz") or {}
    for key in ("x", "y"):  # step 0's batch, as a parity probe holds it (the taps' rows are its first; the option
        if key in batches:  # diagnoses read it)
            oracle[key] = port[key] = np.asarray(batches[key][0])
    config = _config(manifest)
    if config is not None and opt_k and "lr" in batches:  # the rate each side's steps took, from its own states,
        for probe in (oracle, port):  # against the kit's schedule (harness.parity's learning-rate check)
            probe["lr"] = np.asarray(batches["lr"], dtype=np.float64)
            probe["lr_used"] = np.asarray([_rate(probe, k, params, config) for k in range(1, opt_k + 1)])
    masks = kit.get("masks.npz") or {}
    rows = int(manifest["taps"]["rows"])
    for site in manifest["taps"].get("masks", []):  # the taps were taken with these (the port's too, as asked)
        oracle[TAP_MASK_PREFIX + site] = port[TAP_MASK_PREFIX + site] = np.asarray(masks[site][0][:rows])
    exp_loss = [float(v) for v in expected["loss"]]
    port_loss = [float(v) for v in results["loss"]] if "loss" in results else exp_loss
    why = resync_problem(config, kit, opt_k) if opt_k else None
    if opt_k and why is None:
        oracle.update(oracle_steps(manifest, kit, port, opt_k, config,
                                   len(results["loss"]) if "loss" in results else 0, progress))
    return Probes(oracle, port, exp_loss[:len(port_loss)], port_loss, config, why, masks)


def grade(manifest: dict[str, Any], probes: Probes, results: dict[str, np.ndarray], dtype: str
          ) -> tuple[ParityResult, Tolerances]:
    """harness.parity.compare.compare of the oracle against the port (`probes`, from `probes_of`), with
    the measured tolerances of the port's precision for the kit's config (harness.parity.tolerances.tolerances_for:
    its preset's, with tied embeddings those measured so, else the loosest), and the kit's dropout masks (the causes
    of a mistake of the masks are read from them)."""
    pair = precision_pair(dtype, "float64")
    tol = tolerances_for(pair, probes.config)[0] if probes.config is not None else \
        default_tolerances(pair, manifest.get("size"))
    masks = probes.masks
    result = compare(probes.oracle, probes.port, probes.oracle_loss, probes.port_loss, tol,
                     backends=(ORACLE, PORT), config=probes.config, hyper=manifest.get("config"), precision=dtype,
                     masks=(lambda k: {key: m[k] for key, m in masks.items()}) if masks else None)
    if probes.free_running:
        result.notes.append(f"the optimizer steps were compared free-running, each side from its own state "
                            f"({probes.free_running}): rounding grows over the steps, so a late step may fail "
                            "a correct port")
    return result, tol


def _rate(probe: dict[str, np.ndarray], k: int, params: list[str], config: Any) -> float:
    """The learning rate optimizer step k took in `probe` (harness.core.schedule.effective_rate)."""
    from harness.core.schedule import effective_rate

    def state(step: int, kind: str) -> dict[str, np.ndarray]:
        return {n: probe[opt_key(step, kind, n)] for n in params}

    return effective_rate(state(k - 1, "param"), state(k, "param"), state(k, "adam_m"), state(k, "adam_v"), k,
                          config)


def _config(manifest: dict[str, Any]) -> Any:
    """The kit's harness Config (for the option and schedule diagnoses), or None when the manifest's is not one."""
    from harness.config.fields import config_from_dict

    try:
        return config_from_dict(manifest.get("config"), MANIFEST)
    except (UsageError, TypeError):
        return None


def table_rows(result: ParityResult, given: list[str]) -> list[dict[str, Any]]:
    """parity's summary rows; a depth the port did not give is marked so (its comparison was the oracle itself)."""
    rows = []
    for row in result.rows():
        if row["depth"] == "step_loss":  # the port's loss of step k against the oracle's from the port's state
            row = {**row, "check": "loss of each step from the port's state"}
        # the learning rate each step took is read from the optimizer states the port gave, the loss of each step
        # from the port's state compares the losses it gave with the oracle's steps from its states
        read = {"learning_rate": "optimizer" in given, "step_loss": {"optimizer", "loss"} <= set(given)}
        if row["depth"] not in given and not read.get(row["depth"]):
            row = {**row, "value": math.nan, "result": "not given", "first_broken": "", "worst": ""}
        rows.append(row)
    if "taps" not in given and not any(r["depth"] == "taps" for r in rows):
        rows.insert(0, {"depth": "taps", "check": "step-0 activation taps max |diff| (scaled)", "value": math.nan,
                        "tolerance": result.tolerances.tap, "result": "not given", "first_broken": "", "worst": ""})
    return rows


# What a broken depth usually means, where harness.parity does not say it itself.
CAUSES = {
    "logits": "the forward pass: attention scale 1/sqrt(head size) or causal mask, q/k/v order in c_attn, head "
              "split, LayerNorm eps or variance, GELU form (tanh), lm_head tied or not, a weight read in the wrong "
              "layout, token ids not shifted; write the activation taps (tap/<name>) to have the layer named",
    "gradients": "the backward pass (the first broken parameter, in backward order, is nearest the defect)",
    "dropout_gradients": dropout_cause(),
    "loss": "the training step after step 0 (clipping, AdamW) or the dropout masks of later steps; write the "
            "optimizer depth (opt/<k>/...) to have the parameter named",
}


FAIL_LINE = {"logits": "FAIL: logits", "gradients": "FAIL: gradient ", "dropout_gradients": "FAIL: gradient with",
             "learning_rate": "FAIL: learning rate"}


def diagnose(result: ParityResult, rows: list[dict[str, Any]], params: list[str]) -> dict[str, Any] | None:
    """The first broken depth (in the order the model computes them), the tap or parameter that breaks first
    there (and the worst, when it is another) and the likely cause. The learning rate a step took comes before the
    optimizer depth when it broke at an earlier step (the port's free-running states then differ from that step on
    because of it); at the same step, the optimizer's own diagnosis."""
    failed = {r["depth"] for r in rows if r["result"] == "FAIL"}
    if result.opt_first_bad is not None:
        failed.add("optimizer")
    if "step_loss" in failed:  # the losses the port wrote: the loss depth
        failed.add("loss")
    for depth in DEPTHS:
        if depth not in failed:
            continue
        named = next((f.split("likely cause: ", 1)[1] for f in result.failures
                      if f.startswith(FAIL_LINE.get(depth, "-")) and "likely cause: " in f), None)
        if depth == "taps" and result.first_tap:
            t = result.first_tap
            return {"depth": depth, "tap": t, "parameter": None, "cause": result.tap_cause,
                    "detail": f"first divergent activation {t}: max abs {fmt(result.taps_max_abs[t])} at "
                              f"[{','.join(map(str, result.taps_where[t]))}]"}
        if depth == "logits":
            w = result.logits_where
            return {"depth": depth, "parameter": None, "cause": named or result.logits_cause or CAUSES[depth],
                    "detail": f"largest difference at batch row {w[0]}, position {w[1]}, token {w[2]}"
                    if len(w) == 3 else ""}
        if depth in ("gradients", "dropout_gradients"):
            errs = result.grad_rel_err if depth == "gradients" else result.dropout_grad_rel_err
            worst = result.worst_grad if depth == "gradients" else result.worst_dropout_grad
            first = result.first_grad if depth == "gradients" else result.first_dropout_grad
            over = [n for n in params if not errs.get(n, math.nan) <= result.tolerances.grad]
            # the first broken in backward order points at a defect of the backward pass only when the gradients
            # nearest the loss agree; when even those differ the forward pass differs, and the worst is the hint
            param = first if first and first != next(reversed(params), None) else worst
            return {"depth": depth, "parameter": param, "worst": worst, "cause": named or CAUSES[depth],
                    "detail": f"first broken in backward order {first}, worst {worst} (rel err "
                              f"{errs.get(worst, math.nan):.1e}); {len(over)} of {len(params)} parameters over "
                              "tolerance"}
        rate_earlier = ("learning_rate" in failed and result.rate_first_bad is not None
                        and result.opt_first_bad is not None and result.rate_first_bad[1] < result.opt_first_bad[0])
        if depth == "optimizer" and result.opt_first_bad is not None and not rate_earlier:
            k, quantity, name = result.opt_first_bad
            return {"depth": depth, "parameter": name, "cause": result.opt_cause,
                    "detail": f"first at step {k}, {quantity} of {name}"}
        if depth == "learning_rate" and result.rate_first_bad is not None:
            who, k = result.rate_first_bad
            return {"depth": depth, "parameter": None, "cause": result.rate_cause,
                    "detail": f"{who}'s optimizer step {k} took another learning rate than the schedule's"}
        if depth != "loss":
            continue
        k = result.loss_first_bad
        if k < 0:  # only the loss of a step from the port's own state differs: the loss the port wrote
            k = result.step_loss_first_bad
            return {"depth": depth, "parameter": None, "cause": WRONG_STEP_INPUTS,
                    "detail": f"the port's loss of step {k} differs from the oracle's loss of that step from the "
                              "port's state"}
        return {"depth": depth, "parameter": None,
                "cause": WRONG_STEP_INPUTS if k == 0 and "logits" not in failed else CAUSES[depth],
                "detail": f"first over tolerance at step {k}, largest deviation at step {result.loss_peak_step}"}
    return None


def float32_hint(manifest: dict[str, Any], probes: Probes, results: dict[str, np.ndarray], result: ParityResult,
                 given: list[str], dtype: str) -> str | None:
    """For float64 results that fail: the hint that the port computed in float32 (pass --dtype float32), only with
    the evidence it names. Every check must pass at the float32 tolerances, and the port's step-0 values must show
    float32: every value a float32 number stored as float64, or every early depth given (taps, logits, gradients)
    deviating by more than float64 rounding (over its float64 tolerance). An early depth within its float64
    tolerance is evidence of a float64 computation (float32 cannot reach it), so a port whose only difference is
    late (e.g. an optimizer step) never gets the hint."""
    if dtype != "float64":
        return None
    exact, early = float32_stored_as_float64(results), _early_depths_at_float32_level(result, given)
    if not (exact or early):
        return None
    again, _ = grade(manifest, probes, results, "float32")
    if not again.passed:
        return None
    evidence = " and ".join(e for e, shown in (("every value is a float32 number stored as float64", exact),
                                               ("the step-0 values deviate by more than float64 rounding", early))
                            if shown)
    return (f"float32 computed, float64 written: {evidence}, and every check passes at the float32 tolerances; "
            "check again with --dtype float32")


def _early_depths_at_float32_level(result: ParityResult, given: list[str]) -> bool:
    """Whether the port gave at least one early depth (step-0 taps, logits, gradients) and every one it gave
    deviates by more than its float64 tolerance."""
    t = result.tolerances
    early = {"taps": (max(result.taps_rel_err.values(), default=math.nan), t.tap),
             "logits": (result.logits_max_abs, t.logits), "gradients": (result.worst_grad_rel_err, t.grad)}
    measured = [early[d] for d in given if d in early]
    return bool(measured) and all(not within(v, tol) for v, tol in measured)


def recorded_tolerances_differ(manifest: dict[str, Any], c: Check) -> bool:
    """Whether the kit recorded other tolerances for the port's precision than this harness applies."""
    recorded = (manifest.get("tolerances") or {}).get(c.dtype)
    return recorded is not None and recorded != asdict(c.tolerances)


def first_broken_line(result: ParityResult, diagnosis: dict[str, Any] | None) -> str | None:
    """The FAIL line that states the first broken depth (shown once on the page, as "First broken")."""
    if not diagnosis:
        return None
    prefix = {"taps": "FAIL: forward:", "logits": "FAIL: logits", "gradients": "FAIL: gradient ",
              "dropout_gradients": "FAIL: gradient with dropout", "optimizer": "FAIL: optimizer step",
              "loss": "FAIL: training loss"}.get(diagnosis["depth"], "")
    return next((f for f in result.failures if prefix and f.startswith(prefix)), None)


def verdict(c: Check, manifest: dict[str, Any], kit: Path, results_file: Path, results: dict[str, np.ndarray]
            ) -> dict[str, Any]:
    """The JSON verdict (schema nanogpt-parity/kit-check): what was checked, the verdict and summary, the
    tolerances, the depths given and not, every FAIL line, the diagnosis, what the depths given cannot see and the
    comparison's results (a depth not given: None, the oracle compared with itself measured nothing)."""
    result, cfg = c.result, manifest["config"]
    first_line = first_broken_line(result, c.diagnosis)
    out: dict[str, Any] = {
        "schema": "nanogpt-parity/kit-check", "schema_version": 1,
        "verdict": "pass" if c.passed else "fail", "summary": c.summary,
        "kit": str(kit), "results_file": str(results_file), "config_name": cfg.get("name"),
        "size": manifest.get("size"), "steps": int(manifest["steps"]), "seed": manifest.get("seed"),
        "dropout": cfg.get("dropout"), "dtype": c.dtype,
        "precision_pair": f"{c.dtype}/float64" if c.dtype == "float32" else "float64/float64",
        "tolerances": asdict(c.tolerances), "depths_given": c.given, "depths_not_given": c.missing,
        "optimizer_steps_given": c.opt_steps, "loss_steps_given": len(results["loss"]) if "loss" in results else 0,
        "failures": list(result.failures), "other_failures": [f for f in result.failures if f != first_line],
        "diagnosis": c.diagnosis, "hint": c.hint, "notes": list(result.notes),
        "blind_spots": {d: BLIND_SPOTS[d] for d in c.given if d in BLIND_SPOTS},
        "results": result.to_dict(),
    }
    for depth, key in (("taps", "taps"), ("logits", "logits"), ("gradients", "gradients"),
                       ("dropout_gradients", "dropout_gradients"), ("optimizer", "optimizer"), ("loss", "loss")):
        if depth not in c.given and key in out["results"]:
            out["results"][key] = None  # the oracle compared with itself: nothing measured
    return out
