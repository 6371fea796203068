"""`harness kit check KIT RESULTS`: grade a port's results against a kit with harness.parity.compare's comparison.

The results file is one NPZ holding any subset of the four depths (logits; grad/<name>; opt/<k>/...; loss), each
complete. It is validated first (unknown or missing names, shapes, dtypes, NaN: one line, exit 2), the kit's files
against the sha256s of its manifest, then `harness.parity.compare.compare` grades it against the oracle's float64
answers with `harness.parity.compare.default_tolerances` of the port's precision (the same code and numbers as `harness
parity`). A depth the results do not hold is handed to the comparison as the oracle's own values and reported "not
given".
"""

from __future__ import annotations

import hashlib
import html
import math
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from harness.core.taps import PREFIX as TAP_PREFIX
from harness.errors import UsageError
from harness.files import open_regular
from harness.kit.export import KINDS, MANIFEST, opt_key
from harness.kit.npz import describe_dtype, read_npz, read_npz_file
from harness.kit.schema import FIX, kit_file, load_manifest
from harness.parity.diagnose import DROPOUT_CAUSE

DEPTHS = ("taps", "logits", "gradients", "dropout_gradients", "optimizer", "learning_rate", "loss")


ORACLE, PORT = "oracle", "port"


OPT_NAME = re.compile(r"^opt/(\d+)/(param|adam_m|adam_v)/(.+)$")


# --- reading ------------------------------------------------------------------------------------------------------
RESULTS_FIX = "write it with numpy.savez or NPZ.jl's npzwrite"


def _kit_array_check(name: str, declared: dict[str, Any]) -> Callable[[str, tuple[int, ...], np.dtype], None]:
    """The header check of kit file `name`: every array as the manifest declares it (name, shape, dtype)."""
    def check(key: str, shape: tuple[int, ...], dtype: np.dtype) -> None:
        entry = declared.get(key)
        if entry is None:
            raise UsageError(f"kit file {name} holds array {key!r}, which {MANIFEST} does not list; {FIX}")
        # kits exported before export.npz_bytes kept 0-d arrays wrote logits_loss as (1,) under a declared (): the
        # same one number, still read
        same = list(shape) == entry["shape"] or math.prod(shape) == math.prod(entry["shape"]) == 1
        if not same or dtype.newbyteorder("=") != np.dtype(entry["dtype"]):
            raise UsageError(f"kit file {name}: array {key!r} is {describe_dtype(dtype)} {shape} but {MANIFEST} "
                             f"says {entry['dtype']} {tuple(entry['shape'])}; {FIX}")
    return check


def load_kit(kit: Path) -> tuple[dict[str, Any], dict[str, dict[str, np.ndarray]]]:
    """The manifest and every file of a kit, each verified against its sha256; UsageError if anything is off.

    The manifest is checked against its schema (harness.kit.schema); every file must be a regular file inside the
    kit, of the size and sha256 the manifest gives, holding exactly the arrays it declares (headers checked before
    any data is read; a kit's members are uncompressed, so what is read is at most the files' sizes).
    """
    manifest = load_manifest(kit)
    arrays: dict[str, dict[str, np.ndarray]] = {}
    for name, entry in manifest["files"].items():
        file = kit_file(kit, name)
        if not os.path.lexists(file):
            raise UsageError(f"kit file {name} is missing from {str(kit)!r}; {FIX}")
        with open_regular(file, "kit file", FIX) as f:  # hashed and read through one descriptor
            size = os.fstat(f.fileno()).st_size
            if size != entry["bytes"]:
                raise UsageError(f"kit file {name} is {size:,} bytes, {MANIFEST} says {entry['bytes']:,} (the kit was "
                                 f"changed or damaged); {FIX}")
            digest = hashlib.sha256()
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
            if digest.hexdigest() != entry["sha256"]:
                raise UsageError(f"kit file {name} does not match its sha256 in {MANIFEST} (the kit was changed or "
                                 "damaged); export it again")
            arrays[name] = read_npz_file(f, file, "kit file", FIX, _kit_array_check(name, entry["arrays"]),
                                         stored_only=True)
        missing = sorted(set(entry["arrays"]) - set(arrays[name]))
        if missing:
            raise UsageError(f"kit file {name} lacks array {missing[0]!r}, which {MANIFEST} lists; {FIX}")
    for name in ("weights.npz", "expected.npz"):  # the schema requires both entries; their arrays must be right too
        params = manifest["parameters"]
        want = params if name == "weights.npz" else {f"grad/{n}": s for n, s in params.items()}
        for key, shape in want.items():
            if key not in arrays[name] or list(arrays[name][key].shape) != shape:
                raise UsageError(f"kit file {name} has no array {key!r} of shape {tuple(shape)} (field 'parameters' "
                                 f"of {MANIFEST}); {FIX}")
    expected, steps = arrays["expected.npz"], manifest["steps"]
    need = {"logits": None, "loss": (steps,), **{opt_key(k, kind, n): tuple(shape) for k in range(1, steps + 1)
                                                 for kind in KINDS for n, shape in manifest["parameters"].items()}}
    for key, shape in need.items():
        if key not in expected or (shape is not None and expected[key].shape != shape):
            raise UsageError(f"kit file expected.npz has no array {key!r}" + (f" of shape {shape}" if shape else "")
                             + f" (fields 'steps' and 'parameters' of {MANIFEST}); {FIX}")
    return manifest, arrays


def load_results(path: Path, manifest: dict[str, Any], kit: dict[str, dict[str, np.ndarray]]
                 ) -> dict[str, np.ndarray]:
    """The port's results file, every array's name, shape and dtype checked (from its .npy header) against the kit
    before any array is read; the file may be at most twice the kit's expected.npz plus 16 MiB."""
    expected = {k: v.shape for k, v in kit["expected.npz"].items()}
    params, steps = list(manifest["parameters"]), int(manifest["steps"])
    cap = 2 * manifest["files"]["expected.npz"]["bytes"] + (16 << 20)
    return read_npz(path, "results file", RESULTS_FIX,
                    lambda key, shape, dtype: check_array(key, shape, dtype, expected, params, steps), cap)


def _depth_of(name: str) -> str | None:
    if name in ("logits", "loss"):
        return name
    if name.startswith(TAP_PREFIX):
        return "taps"
    if name.startswith("grad/"):
        return "gradients"
    if name.startswith("dropout_grad/"):
        return "dropout_gradients"
    if OPT_NAME.match(name):
        return "optimizer"
    return None


def _names(expected: Mapping[str, Any]) -> str:
    """The array names a results file may hold, as the messages list them."""
    valid = ["tap/<name>", "logits", "grad/<name>"] + (["dropout_grad/<name>"] if any(
        k.startswith("dropout_grad/") for k in expected) else [])
    return ", ".join([*valid, "opt/<k>/param|adam_m|adam_v/<name>", "loss"])


def check_array(key: str, shape: tuple[int, ...], dtype: np.dtype, expected: Mapping[str, tuple[int, ...]],
                params: list[str], steps: int) -> None:
    """One results array's name, shape and dtype against the kit (`expected`: the shape of every array of
    expected.npz). Called on each .npy header before any data is read, so nothing undeclared is ever allocated."""
    names = _names(expected)
    if key == "logits_loss" or key not in expected or _depth_of(key) is None:
        m = OPT_NAME.match(key)
        hint = (f"k must be 1..{steps} and the name a parameter of this kit" if m else
                f"the names are {names}; parameters: {', '.join(params)}")
        raise UsageError(f"results: unknown array {key!r}; {hint} (docs/kit.md)")
    want = tuple(expected[key])
    if key == "loss" and len(shape) == 1 and 0 < shape[0] <= steps:
        want = tuple(shape)  # a port may check the first few steps only
    if tuple(shape) != want:
        raise UsageError(f"results: {key!r} has shape {tuple(shape)}, expected {want} (canonical layout, "
                         "docs/kit.md)")
    if dtype.kind != "f" or dtype.itemsize not in (4, 8):
        raise UsageError(f"results: {key!r} has dtype {describe_dtype(dtype)}; write float32 or float64")


def validate(results: dict[str, np.ndarray], expected: dict[str, np.ndarray], params: list[str],
             dtype: str | None) -> tuple[list[str], str, int]:
    """Check the results file as a whole against the kit; returns (depths given, precision, optimizer steps given).

    `results` comes from `load_results`, which has already held every array's name, shape and dtype to the kit
    (`check_array`: valid names are those of expected.npz but logits_loss; `loss` may hold the first 1..steps
    losses). Here: a depth given is given whole (every parameter, and for the optimizer every step 1..K for some
    K <= steps; the taps, `tap/<name>`, may be any subset), every value is finite, and the precision is one.
    """
    names = _names(expected)
    given = [d for d in DEPTHS if any(_depth_of(k) == d for k in results)]
    if not given:
        raise UsageError(f"results hold no arrays; write at least one depth: {names}")
    opt_k = max((int(m.group(1)) for m in map(OPT_NAME.match, results) if m), default=0)
    required = ([f"grad/{n}" for n in params] if "gradients" in given else []) + \
        ([f"dropout_grad/{n}" for n in params] if "dropout_gradients" in given else []) + \
        [opt_key(k, kind, n) for k in range(1, opt_k + 1) for kind in KINDS for n in params]
    for key in required:
        if key not in results:
            raise UsageError(f"results: {key!r} is missing (a depth is checked whole: every parameter"
                             + (f", every step 1..{opt_k}" if key.startswith("opt/") else "") + ")")
    float_dtypes = set()
    for key, value in results.items():
        float_dtypes.add(value.dtype.newbyteorder("=").name)
        bad = ~np.isfinite(value)
        if bad.any():
            first = int(np.argmax(bad))
            where = tuple(int(i) for i in np.unravel_index(first, value.shape)) if value.ndim else ()
            raise UsageError(f"results: {key!r} holds {value.flat[first]} at index {where}; a port that produces "
                             "NaN or inf is broken before it can be compared")
    if dtype is None:
        if len(float_dtypes) > 1:
            raise UsageError("results mix float32 and float64 arrays; write one dtype or say which the port "
                             "computed in with --dtype")
        dtype = float_dtypes.pop()
    elif dtype == "float64" and "float32" in float_dtypes:
        raise UsageError("--dtype float64 but the results hold float32 arrays, which cannot carry float64 "
                         "results; write float64 or pass --dtype float32")
    return given, dtype, opt_k


# --- grading ------------------------------------------------------------------------------------------------------
def grade(manifest: dict[str, Any], kit: dict[str, dict[str, np.ndarray]], results: dict[str, np.ndarray],
          dtype: str, opt_k: int) -> tuple[Any, Any]:
    """harness.parity.compare.compare of the oracle against the port, with harness.parity.compare.default_tolerances of
    the port's precision. A depth not given is the oracle's own values on both sides (reported "not given"); the taps
    are
    compared where the port gave them."""
    from harness.parity import compare

    expected, weights = kit["expected.npz"], kit["weights.npz"]
    params = list(manifest["parameters"])
    tol = compare.default_tolerances(compare.precision_pair(dtype, "float64"), manifest.get("size"))
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
    exp_loss = [float(v) for v in expected["loss"]]
    port_loss = [float(v) for v in results["loss"]] if "loss" in results else exp_loss
    result = compare.compare(oracle, port, exp_loss[:len(port_loss)], port_loss, tol, backends=(ORACLE, PORT),
                            config=config, hyper=manifest.get("config"))
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


def table_rows(result: Any, given: list[str]) -> list[dict[str, Any]]:
    """parity's summary rows; a depth the port did not give is marked so (its comparison was the oracle itself)."""
    rows = []
    for row in result.rows():
        if row["depth"] == "step_loss":
            continue  # the kit's steps are not re-synchronised
        # the learning rate each step took is read from the optimizer states the port gave
        if row["depth"] not in given and not (row["depth"] == "learning_rate" and "optimizer" in given):
            row = {**row, "value": math.nan, "result": "not given", "first_broken": "", "worst": ""}
        rows.append(row)
    if "taps" not in given and not any(r["depth"] == "taps" for r in rows):
        rows.insert(0, {"depth": "taps", "check": "step-0 activation taps max |diff| (scaled)", "value": math.nan,
                        "tolerance": result.tolerances.tap, "result": "not given", "first_broken": "", "worst": ""})
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    """The same table as `harness parity` prints (pandas), with "not given" for the depths left out."""
    import pandas as pd

    from harness.parity.compare import _fmt

    df = pd.DataFrame(rows).set_index("check")
    df["value"] = [("-" if r["result"] in ("not given",) else _fmt(r["value"])) for r in rows]
    df["tolerance"] = df["tolerance"].map(lambda v: f"{v:g}")
    df = df.rename(columns={"first_broken": "first broken"})
    return df[["value", "tolerance", "result", "first broken", "worst"]].to_string()


# What a broken depth usually means, where harness.parity does not say it itself.
CAUSES = {
    "logits": "the forward pass: attention scale 1/sqrt(head size) or causal mask, q/k/v order in c_attn, head "
              "split, LayerNorm eps or variance, GELU form (tanh), lm_head tied or not, a weight read in the wrong "
              "layout, token ids not shifted; write the activation taps (tap/<name>) to have the layer named",
    "gradients": "the backward pass (the first broken parameter, in backward order, is nearest the defect)",
    "dropout_gradients": DROPOUT_CAUSE,
    "loss": "the training step after step 0 (clipping, AdamW) or the dropout masks of later steps; write the "
            "optimizer depth (opt/<k>/...) to have the parameter named",
}


FAIL_LINE = {"logits": "FAIL: logits", "gradients": "FAIL: gradient ", "dropout_gradients": "FAIL: gradient with",
             "learning_rate": "FAIL: learning rate"}


def diagnose(result: Any, rows: list[dict[str, Any]], params: list[str]) -> dict[str, Any] | None:
    """The first broken depth (in the order the model computes them), the tap or parameter that breaks first
    there (and the worst, when it is another) and the likely cause. The learning rate a step took comes before the
    optimizer depth when it broke at an earlier step (the port's free-running states then differ from that step on
    because of it); at the same step, the optimizer's own diagnosis."""
    from harness.parity.compare import WRONG_STEP_INPUTS, _fmt

    failed = {r["depth"] for r in rows if r["result"] == "FAIL"}
    if result.opt_first_bad is not None:
        failed.add("optimizer")
    for depth in DEPTHS:
        if depth not in failed:
            continue
        named = next((f.split("likely cause: ", 1)[1] for f in result.failures
                      if f.startswith(FAIL_LINE.get(depth, "-")) and "likely cause: " in f), None)
        if depth == "taps" and result.first_tap:
            t = result.first_tap
            return {"depth": depth, "tap": t, "parameter": None, "cause": result.tap_cause,
                    "detail": f"first divergent activation {t}: max abs {_fmt(result.taps_max_abs[t])} at "
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
        return {"depth": depth, "parameter": None,
                "cause": WRONG_STEP_INPUTS if k == 0 and "logits" not in failed else CAUSES[depth],
                "detail": f"first over tolerance at step {k}, largest deviation at step {result.loss_peak_step}"}
    return None


# --- writing ------------------------------------------------------------------------------------------------------


def render_html(verdict: dict[str, Any], rows: list[dict[str, Any]], table: str) -> str:
    """A small self-contained page (inline CSS, no scripts, no external files). The failure is stated once: the
    banner says where it first breaks, the "First broken" section says why, the other failed checks follow."""
    e = html.escape
    ok = verdict["verdict"] == "pass"
    body_rows = "".join(
        f"<tr class='{e(r['result'].replace(' ', '-'))}'><td>{e(r['check'])}</td>"
        f"<td>{'-' if r['result'] in ('not given',) else e(format(r['value'], '.2e'))}</td>"
        f"<td>{e(format(r['tolerance'], 'g'))}</td><td>{e(r['result'])}</td><td>{e(str(r['first_broken']))}</td>"
        f"<td>{e(str(r['worst']))}</td></tr>"
        for r in rows)
    res = verdict["results"]
    cols = {title: res[key]["rel_err"] for key, title in (("gradients", "dropout off"),
                                                          ("dropout_gradients", "dropout masks")) if res.get(key)}
    names = list(next(iter(cols.values()))) if cols else []
    grad_rows = ("<tr><th>parameter</th>" + "".join(f"<th>{e(t)}</th>" for t in cols) + "</tr>"
                 + "".join(f"<tr><td>{e(n)}</td>" + "".join(f"<td>{c.get(n, math.nan):.2e}</td>" for c in cols.values())
                           + "</tr>" for n in names))
    diag = verdict.get("diagnosis")
    named = "" if not diag else (f": tap <code>{e(diag['tap'])}</code>" if diag.get("tap") else
                                 f": parameter <code>{e(str(diag['parameter']))}</code>" if diag.get("parameter")
                                 else "")
    diag_html = "" if not diag else (
        f"<h2>First broken</h2><p><b>{e(diag['depth'])}</b>{named}</p><p>{e(diag.get('detail') or '')}</p>"
        f"<p>Likely cause: {e(str(diag['cause']))}</p>")
    others = verdict.get("other_failures") or []
    fails = "".join(f"<li>{e(f)}</li>" for f in others)
    blind = "".join(f"<li><b>{e(d)}</b>: {e(text)}</li>" for d, text in (verdict.get("blind_spots") or {}).items())
    hint = (f"<p><b>Hint:</b> {e(verdict['hint'])}</p>" if verdict.get("hint") and verdict["hint"] != (diag or {})
            .get("cause") else "")
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>kit check: {e(verdict['verdict'])}</title>
<style>
body {{ font: 15px/1.45 system-ui, sans-serif; max-width: 60rem; margin: 2rem auto; padding: 0 1rem; color: #222; }}
.banner {{ padding: .6rem 1rem; border-radius: 6px; font-weight: 600; color: #fff;
          background: {'#2e7d32' if ok else '#c62828'}; }}
table {{ border-collapse: collapse; margin: 1rem 0; }} td, th {{ border: 1px solid #ccc; padding: .25rem .6rem; }}
tr.FAIL td {{ background: #fdecea; }} tr.ok td {{ background: #edf7ed; }} tr.not-given td {{ color: #888; }}
code, pre {{ font-family: ui-monospace, monospace; }}
</style></head><body>
<h1>nanoGPT conformance kit: check</h1>
<p class="banner">{'PASS' if ok else 'FAIL'}: {e(verdict['summary'])}</p>
<p>Kit <code>{e(verdict['kit'])}</code> ({e(str(verdict['config_name']))}, {verdict['steps']} steps, dropout
{verdict['dropout']:g}, seed {verdict['seed']}); results <code>{e(verdict['results_file'])}</code>,
{e(verdict['dtype'])} against the float64 oracle; tolerances of the {e(verdict['precision_pair'])} pair,
as <code>harness parity</code>.</p>
<table><tr><th>check</th><th>value</th><th>tolerance</th><th>result</th><th>first broken</th><th>worst</th></tr>
{body_rows}</table>
{diag_html}
{hint}
{'<h2>Other checks that failed</h2><ul>' + fails + '</ul>' if fails else ''}
{'<h2>Step-0 gradient relative error per parameter</h2><table>' + grad_rows + '</table>' if names else ''}
{'<h2>What the depths given cannot see</h2><ul>' + blind + '</ul>' if blind else ''}
</body></html>
"""


def float32_hint(manifest: dict[str, Any], kit: dict[str, dict[str, np.ndarray]], results: dict[str, np.ndarray],
                 dtype: str, opt_k: int) -> str | None:
    """For float64 results that fail: the hint to pass --dtype float32 when every check passes at the float32
    tolerances (the deviations are at float32 rounding level), stronger when every value is a float32 number."""
    from harness.parity import diagnose as parity_diagnose

    if dtype != "float64":
        return None
    again, _ = grade(manifest, kit, results, "float32", opt_k)
    if not again.passed:
        return None
    exact = (" and every value is a float32 number stored as float64"
             if parity_diagnose.float32_stored_as_float64(results) else "")
    return (f"float32 computed, float64 written: every deviation is at float32 rounding level (all checks pass at "
            f"the float32 tolerances){exact}; check again with --dtype float32")
