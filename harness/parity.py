"""`harness parity`: do two backends compute the same thing? (DESIGN.md, "Parity")

Parity mode trains both backends with dropout 0 from the same canonical weights on the same batches, each in its
own worker process (harness.launch), and compares them at three depths, in float64:

1. step-0 logits on the first training batch: max absolute difference;
2. step-0 gradients of the mean loss, per parameter: relative error ||ga - gb|| / max(||ga||, ||gb||, tiny),
   the worst parameter named;
3. the per-step training loss over N steps: max absolute deviation and the step where it peaks, plus the
   final evaluation's validation loss.

The comparison itself is the pure function `compare`, so tests (and other tools) can feed it the output of
in-process backends. Default tolerances depend on the precision pair and the size preset; they were measured
(docs/parity.md).
"""

from __future__ import annotations

import argparse
import inspect
import math
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from harness.errors import UsageError

SCHEMA = "nanogpt-parity/parity-record"
SCHEMA_VERSION = 1
DEFAULT_STEPS = 50
DEFAULT_BACKENDS = "torch,numpy"
TINY = 1e-300  # floor of the relative error's denominator: two all-zero gradients agree exactly
GRAD_PREFIX = "grad/"


@dataclass(frozen=True)
class Tolerances:
    """Pass thresholds: logits max |diff|, worst per-parameter gradient relative error, loss max |diff|."""

    logits: float
    grad: float
    loss: float

    def validate(self) -> None:
        """Raise UsageError unless every tolerance is a finite number >= 0."""
        for key, value in asdict(self).items():
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) \
                    or value < 0:
                raise UsageError(f"--tol-{key} must be a finite number >= 0, got {value!r}")


# 10x the worst deviation measured on CPU for each precision pair and size preset, rounded up to a power of ten
# (docs/parity.md has the measurements and the commands). Pairs are the two backends' dtypes, sorted, joined by "/".
# Two stated exceptions: float64/float64 medium loss 1e-7 (the rule gives 1e-8, but the float64 reference against
# itself from weights perturbed by 1e-15 already reaches 4.8e-9), and float32/float32 is never tighter than
# float32/float64. The loss tolerance depends on the size: medium and large pass through an unstable phase at
# lr 0.01 where any rounding difference grows by up to 1e5-1e6, so float32 pairs check the training loop sharply only
# on small; the float64/float64 pair checks it sharply on every size.
DEFAULT_TOLERANCES: dict[str, dict[str, Tolerances]] = {
    "float64/float64": {
        "small": Tolerances(logits=1e-14, grad=1e-13, loss=1e-13),
        "medium": Tolerances(logits=1e-14, grad=1e-13, loss=1e-7),
        "large": Tolerances(logits=1e-14, grad=1e-13, loss=1e-12),
    },
    "float32/float64": {
        "small": Tolerances(logits=1e-6, grad=1e-5, loss=1e-5),
        "medium": Tolerances(logits=1e-5, grad=1e-5, loss=1.0),
        "large": Tolerances(logits=1e-5, grad=1e-4, loss=1e-2),
    },
    "float32/float32": {
        "small": Tolerances(logits=1e-6, grad=1e-5, loss=1e-5),
        "medium": Tolerances(logits=1e-5, grad=1e-4, loss=10.0),
        "large": Tolerances(logits=1e-5, grad=1e-4, loss=1e-2),
    },
}
LOOSEST = "float32/float32"  # used for a dtype pair that was never measured

# A backend's default dtype when it is not said otherwise (used only if its class cannot be inspected).
FALLBACK_DTYPES = {"torch": "float32", "numpy": "float64", "flux": "float32"}


def precision_pair(dtype_a: str, dtype_b: str) -> str:
    """The precision pair of two backends' dtypes, e.g. "float32/float64" (order does not matter)."""
    return "/".join(sorted((str(dtype_a), str(dtype_b))))


def default_tolerances(pair: str, size: str | None = None) -> Tolerances:
    """The measured default tolerances of a precision pair and size preset.

    For a config of one's own (`size` None or not a preset) the loosest over the presets of that pair; for a pair
    never measured, those of the loosest pair.
    """
    table = DEFAULT_TOLERANCES.get(pair, DEFAULT_TOLERANCES[LOOSEST])
    if size in table:
        return table[size]
    return Tolerances(**{k: max(getattr(t, k) for t in table.values()) for k in ("logits", "grad", "loss")})


# --- the comparison (pure) ---------------------------------------------------------------------------------------
def max_abs_diff(a: np.ndarray, b: np.ndarray) -> tuple[float, tuple[int, ...]]:
    """max |a - b| in float64 and the index where it occurs (NaN anywhere gives NaN at the first NaN)."""
    a64, b64 = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a64.shape != b64.shape:
        raise ValueError(f"shapes differ: {a64.shape} vs {b64.shape}")
    if a64.size == 0:
        return 0.0, ()
    d = np.abs(a64 - b64)
    bad = ~np.isfinite(d)
    flat = int(np.argmax(bad)) if bad.any() else int(np.argmax(d))
    index = tuple(int(i) for i in np.unravel_index(flat, d.shape))
    return (math.nan if bad.any() else float(d.flat[flat])), index


def relative_error(a: np.ndarray, b: np.ndarray, tiny: float = TINY) -> float:
    """||a - b|| / max(||a||, ||b||, tiny), Frobenius norms in float64; NaN if either holds a non-finite value."""
    a64, b64 = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a64.shape != b64.shape:
        raise ValueError(f"shapes differ: {a64.shape} vs {b64.shape}")
    if not (np.isfinite(a64).all() and np.isfinite(b64).all()):
        return math.nan
    return float(np.linalg.norm(a64 - b64) / max(np.linalg.norm(a64), np.linalg.norm(b64), tiny))


def loss_deviation(losses_a: Sequence[float], losses_b: Sequence[float]) -> tuple[float, int, list[float]]:
    """Over the common steps: max |la - lb|, the step where it peaks (first NaN wins) and every step's |diff|."""
    n = min(len(losses_a), len(losses_b))
    if n == 0:
        return math.nan, -1, []
    d = np.abs(np.asarray(losses_a[:n], dtype=np.float64) - np.asarray(losses_b[:n], dtype=np.float64))
    bad = ~np.isfinite(d)
    step = int(np.argmax(bad)) if bad.any() else int(np.argmax(d))
    return (math.nan if bad.any() else float(d[step])), step, [float(v) for v in d]


def _within(value: float, tol: float) -> bool:
    return bool(value <= tol)  # False for NaN


def _fmt(value: float) -> str:
    return "nan" if value != value else f"{value:.1e}"


@dataclass
class ParityResult:
    """What `compare` found: the deviations, the tolerances they were held to, and what broke."""

    backends: tuple[str, str]
    tolerances: Tolerances
    logits_max_abs: float = math.nan
    logits_where: tuple[int, ...] = ()  # (batch row, position, token) of the largest difference
    grad_rel_err: dict[str, float] = field(default_factory=dict)
    worst_grad: str | None = None
    worst_grad_rel_err: float = math.nan
    loss_max_abs_dev: float = math.nan
    loss_peak_step: int = -1
    loss_steps: int = 0
    loss_abs_dev: list[float] = field(default_factory=list)
    val_loss: dict[str, float] | None = None
    val_loss_abs_diff: float | None = None
    failures: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        """True when every check is within its tolerance."""
        return not self.failures

    def rows(self) -> list[dict[str, Any]]:
        """The summary table: one row per check."""
        t = self.tolerances
        lw = self.logits_where
        where = f"batch row {lw[0]}, position {lw[1]}, token {lw[2]}" if len(lw) == 3 else ""
        rows = [
            {"check": "step-0 logits max |diff|", "value": self.logits_max_abs, "tolerance": t.logits,
             "where": where},
            {"check": "step-0 gradient rel err (worst)", "value": self.worst_grad_rel_err, "tolerance": t.grad,
             "where": self.worst_grad or ""},
            {"check": "training loss max |diff|", "value": self.loss_max_abs_dev, "tolerance": t.loss,
             "where": f"step {self.loss_peak_step} of {self.loss_steps}" if self.loss_steps else ""},
        ]
        if self.val_loss_abs_diff is not None:
            rows.append({"check": "final val loss |diff|", "value": self.val_loss_abs_diff, "tolerance": t.loss,
                         "where": ", ".join(f"{k} {v:.6f}" for k, v in (self.val_loss or {}).items())})
        for row in rows:
            row["result"] = "ok" if _within(row["value"], row["tolerance"]) else "FAIL"
        return rows

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready results (NaN stays NaN; json writes it as NaN)."""
        return {
            "passed": self.passed, "failures": list(self.failures),
            "tolerances": asdict(self.tolerances),
            "logits": {"max_abs_diff": self.logits_max_abs, "where": list(self.logits_where)},
            "gradients": {"worst": self.worst_grad, "worst_rel_err": self.worst_grad_rel_err,
                          "rel_err": dict(self.grad_rel_err)},
            "loss": {"max_abs_dev": self.loss_max_abs_dev, "peak_step": self.loss_peak_step,
                     "steps": self.loss_steps, "abs_dev": list(self.loss_abs_dev)},
            "val_loss": {"values": self.val_loss, "abs_diff": self.val_loss_abs_diff},
        }


def _grads(probe: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k[len(GRAD_PREFIX):]: v for k, v in probe.items() if k.startswith(GRAD_PREFIX)}


def compare(probe_a: Mapping[str, np.ndarray], probe_b: Mapping[str, np.ndarray],
            losses_a: Sequence[float], losses_b: Sequence[float], tolerances: Tolerances,
            val_losses: tuple[float, float] | None = None, backends: tuple[str, str] = ("a", "b")) -> ParityResult:
    """Compare two backends' step-0 probes and training-loss curves, in float64.

    A probe maps "logits" (B, T, V), "x", "y" (the batch) and "grad/<canonical name>" to arrays, as the worker's
    `<backend>.probe.npz`. `losses_*` are the per-step training losses, `val_losses` the two final validation
    losses (checked against the loss tolerance). Every deviation beyond its tolerance, a NaN, a missing or
    misshapen array or a different batch is a failure, named in `result.failures`.
    """
    a, b = backends
    r = ParityResult(backends=(a, b), tolerances=tolerances)
    fail = r.failures.append
    for key in ("x", "y"):
        if key in probe_a and key in probe_b and not np.array_equal(probe_a[key], probe_b[key]):
            fail(f"FAIL: the probes used different batches ({key} differs): the comparison is meaningless")
    # (a) logits
    if "logits" not in probe_a or "logits" not in probe_b:
        fail(f"FAIL: logits missing from the {a if 'logits' not in probe_a else b} probe")
    elif np.shape(probe_a["logits"]) != np.shape(probe_b["logits"]):
        fail(f"FAIL: logits shapes differ: {a} {np.shape(probe_a['logits'])} vs {b} {np.shape(probe_b['logits'])}")
    else:
        r.logits_max_abs, r.logits_where = max_abs_diff(probe_a["logits"], probe_b["logits"])
        if not _within(r.logits_max_abs, tolerances.logits):
            fail(f"FAIL: logits max abs diff {_fmt(r.logits_max_abs)} > tol {tolerances.logits:g}")
    # (b) gradients
    ga, gb = _grads(probe_a), _grads(probe_b)
    for name in sorted(set(ga) ^ set(gb)):
        fail(f"FAIL: gradient {name} missing from the {a if name not in ga else b} probe")
    for name in [n for n in ga if n in gb]:
        if np.shape(ga[name]) != np.shape(gb[name]):
            fail(f"FAIL: gradient {name} shapes differ: {a} {np.shape(ga[name])} vs {b} {np.shape(gb[name])}")
            r.grad_rel_err[name] = math.nan
        else:
            r.grad_rel_err[name] = relative_error(ga[name], gb[name])
    if not ga and not gb:
        fail("FAIL: no gradients in either probe")
    if r.grad_rel_err:
        r.worst_grad = max(r.grad_rel_err, key=lambda n: (not math.isfinite(r.grad_rel_err[n]), r.grad_rel_err[n]))
        r.worst_grad_rel_err = r.grad_rel_err[r.worst_grad]
        over = [n for n, e in r.grad_rel_err.items() if not _within(e, tolerances.grad)]
        if over:
            more = f" ({len(over) - 1} more parameter(s) over tol)" if len(over) > 1 else ""
            fail(f"FAIL: gradient {r.worst_grad} rel err {_fmt(r.worst_grad_rel_err)} > tol {tolerances.grad:g}"
                 + more)
    # (c) the training-loss curve
    r.loss_steps = min(len(losses_a), len(losses_b))
    if len(losses_a) != len(losses_b):
        fail(f"FAIL: training ran {len(losses_a)} steps in {a} but {len(losses_b)} in {b}")
    r.loss_max_abs_dev, r.loss_peak_step, r.loss_abs_dev = loss_deviation(losses_a, losses_b)
    if r.loss_steps == 0:
        fail("FAIL: no training losses to compare")
    elif not _within(r.loss_max_abs_dev, tolerances.loss):
        fail(f"FAIL: training loss max abs dev {_fmt(r.loss_max_abs_dev)} at step {r.loss_peak_step} "
             f"> tol {tolerances.loss:g}")
    if val_losses is not None:
        va, vb = (float(v) for v in val_losses)
        r.val_loss = {a: va, b: vb}
        r.val_loss_abs_diff = abs(va - vb) if math.isfinite(va) and math.isfinite(vb) else math.nan
        if not _within(r.val_loss_abs_diff, tolerances.loss):
            fail(f"FAIL: final val loss abs diff {_fmt(r.val_loss_abs_diff)} > tol {tolerances.loss:g}")
    return r


def format_table(result: ParityResult) -> str:
    """The summary table as text (pandas)."""
    import pandas as pd

    df = pd.DataFrame(result.rows()).set_index("check")
    df["value"] = df["value"].map(_fmt)
    df["tolerance"] = df["tolerance"].map(lambda v: f"{v:g}")
    return df[["value", "tolerance", "result", "where"]].to_string()


def format_gradients(result: ParityResult) -> str:
    """Per-parameter gradient relative errors as text, worst first."""
    import pandas as pd

    items = sorted(result.grad_rel_err.items(), key=lambda kv: (math.isfinite(kv[1]), -kv[1] if kv[1] == kv[1]
                                                                   else 0.0))
    df = pd.DataFrame({"rel err": [_fmt(v) for _, v in items]}, index=[k for k, _ in items])
    df.index.name = "parameter"
    return df.to_string()


# --- the command -------------------------------------------------------------------------------------------------
def _float(text: str) -> float:
    # parsed loosely here, validated in `command` (a UsageError: one line, exit 2, nothing written)
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of `harness parity` (the common --size/--config/--data/--device/--seed/--out/--dtype are added
    by the CLI)."""
    p.add_argument("--backends", default=DEFAULT_BACKENDS, metavar="A,B",
                   help=f"the two backends to compare, comma-separated: torch, numpy, flux ({DEFAULT_BACKENDS})")
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS, metavar="N",
                   help=f"training steps whose losses are compared ({DEFAULT_STEPS})")
    p.add_argument("--tol-logits", type=_float, metavar="X",
                   help="max abs difference of the step-0 logits (default: measured per precision pair and size, "
                        "see docs/parity.md)")
    p.add_argument("--tol-grad", type=_float, metavar="X",
                   help="max relative error of any parameter's step-0 gradient (default: measured)")
    p.add_argument("--tol-loss", type=_float, metavar="X",
                   help="max abs difference of the per-step training loss and the final val loss "
                        "(default: measured)")
    p.add_argument("--per-parameter", action="store_true", help="also print every parameter's gradient error")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def parse_backends(text: str) -> list[str]:
    """The two backend names of --backends; UsageError for anything else."""
    from harness.backends import check_names

    names = [n.strip() for n in str(text).split(",")]
    if any(not n for n in names):
        raise UsageError(f"--backends {text!r}: empty name; pass two names, e.g. --backends torch,numpy")
    check_names(names)
    if len(names) != 2:
        raise UsageError(f"--backends {text!r}: parity compares exactly two backends, got {len(names)}; "
                         "pass two, e.g. --backends torch,numpy")
    if names[0] == names[1]:
        raise UsageError(f"--backends {text!r}: the same backend twice; compare two different backends "
                         "(use --dtype to vary precision)")
    return names


def backend_dtype(name: str, requested: str | None) -> tuple[str, dict]:
    """The dtype backend `name` will compute in and the options that ask for it.

    --dtype applies to every backend whose constructor takes a dtype; the others keep their own default.
    """
    from harness.backends import backend_class

    default = FALLBACK_DTYPES.get(name, "float32")
    try:
        params = inspect.signature(backend_class(name).__init__).parameters
    except Exception:  # an unavailable backend: preflight reports it
        return (requested or default), ({"dtype": requested} if requested else {})
    if "dtype" not in params:
        return default, {}
    own = params["dtype"].default
    own = own if isinstance(own, str) else default
    return (requested, {"dtype": requested}) if requested else (own, {})


def resolve_tolerances(args: argparse.Namespace, pair: str) -> tuple[Tolerances, dict[str, str]]:
    """Command-line tolerances over the measured defaults of `pair` and the size preset (none for --config);
    also says where each came from."""
    size = None if getattr(args, "config", None) else getattr(args, "size", None)
    base = default_tolerances(pair, size)
    where = f"default ({pair} pair, {size} preset)" if size else f"default ({pair} pair, loosest over the presets)"
    chosen, source = {}, {}
    for key in ("logits", "grad", "loss"):
        given = getattr(args, f"tol_{key}", None)
        chosen[key] = getattr(base, key) if given is None else given
        source[key] = where if given is None else "command line"
    tol = Tolerances(**chosen)
    tol.validate()
    return tol, source


def _load_probe(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


def _final_val(rec: dict) -> float | None:
    evals = rec.get("evals") or []
    return float(evals[-1]["val_loss"]) if evals else None


def command(args: argparse.Namespace) -> int:
    """`harness parity`: run two backends in parity mode, compare, write parity.json; 0 pass, 1 fail, 2 usage."""
    from harness import launch, records
    from harness.config import load_config
    from harness.data import load_corpus
    from harness.devices import parity_options, parse_devices

    # --- validate everything before anything is written ---
    backends = parse_backends(args.backends)
    if not isinstance(args.steps, int) or args.steps <= 0:
        raise UsageError(f"--steps must be a positive whole number, got {args.steps!r}")
    dtypes, options = {}, {}
    for name in backends:
        dtypes[name], options[name] = backend_dtype(name, args.dtype)
        options[name].update(parity_options(name))  # torch: single-tensor AdamW, math attention on CUDA
    device, devices = parse_devices(args.device, backends)  # --device DEVICE or NAME=DEVICE (repeatable)
    pair = precision_pair(*(dtypes[n] for n in backends))
    tolerances, tol_source = resolve_tolerances(args, pair)
    config = load_config(args.size, args.config).replace(dropout=0.0, steps=args.steps)
    corpus = load_corpus(args.data)
    progress = not getattr(args, "quiet", False)
    plan = launch.Plan(config=config, corpus=corpus, backends=backends, device=device, seed=args.seed,
                       out=args.out, backend_options=options, text=False, parity=True, progress=progress,
                       devices=devices)
    try:
        launch.preflight(plan)
    except ImportError as exc:  # a registered backend whose module or framework is not installed
        raise UsageError(f"a backend cannot be loaded ({exc}); see `harness doctor`") from None

    # --- run ---
    run_id = launch.write_spec(plan)
    directory = records.run_dir(plan.out, run_id)
    print(f"parity {run_id}: {config.name}, {args.steps} steps, dropout 0, {backends[0]} ({dtypes[backends[0]]}) "
          f"vs {backends[1]} ({dtypes[backends[1]]}) on {' / '.join(devices[n] for n in backends)}", file=sys.stderr)
    codes = launch.execute(directory, backends, progress=progress)
    record: dict[str, Any] = {
        "schema": SCHEMA, "schema_version": SCHEMA_VERSION, "run_id": run_id,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "config": config.to_dict(), "config_name": config.name, "steps": args.steps, "seed": args.seed,
        "device": device, "devices": devices, "backends": backends, "dtypes": dtypes, "precision_pair": pair,
        "tolerances": asdict(tolerances), "tolerance_source": tol_source,
        "data": {"path": corpus.path, "sha256": corpus.sha256}, "worker_exit_codes": codes,
        "files": {n: {"record": f"{n}.json", "probe": f"{n}.probe.npz"} for n in backends},
    }
    path = directory / "parity.json"
    broken = {n: c for n, c in codes.items() if c != 0}
    if broken or len(codes) != len(backends):
        reason = ", ".join(f"{n} exited {c}" for n, c in broken.items()) or "a backend did not run"
        record.update(verdict="error", failures=[f"ERROR: {reason}; nothing compared"], results=None)
        records.atomic_write_json(path, record)
        print(f"ERROR: {reason}; nothing compared (see the messages above)", file=sys.stderr)
        print(f"parity record: {path}")
        return 130 if 130 in codes.values() else 2 if 2 in codes.values() else 1

    # --- compare ---
    _, recs = records.load_run(plan.out, run_id)
    by_name = {rec["backend"]: rec for rec in recs}
    ra, rb = by_name[backends[0]], by_name[backends[1]]
    for name, rec in ((backends[0], ra), (backends[1], rb)):
        actual = (rec.get("backend_info") or {}).get("dtype")
        if isinstance(actual, str) and actual != dtypes[name]:
            dtypes[name] = actual  # what the backend says it computed in wins
    if precision_pair(*(dtypes[n] for n in backends)) != pair:
        pair = precision_pair(*(dtypes[n] for n in backends))
        tolerances, tol_source = resolve_tolerances(args, pair)
        record.update(precision_pair=pair, tolerances=asdict(tolerances), tolerance_source=tol_source)
    missing = [n for n in backends if not (directory / f"{n}.probe.npz").is_file()]
    if missing:
        reason = f"no step-0 probe from {', '.join(missing)}"
        record.update(verdict="error", failures=[f"ERROR: {reason}; nothing compared"], results=None)
        records.atomic_write_json(path, record)
        print(f"ERROR: {reason}; nothing compared", file=sys.stderr)
        print(f"parity record: {path}")
        return 1
    va, vb = _final_val(ra), _final_val(rb)
    result = compare(_load_probe(directory / f"{backends[0]}.probe.npz"),
                     _load_probe(directory / f"{backends[1]}.probe.npz"),
                     ra["steps"]["loss"], rb["steps"]["loss"], tolerances,
                     val_losses=(va, vb) if va is not None and vb is not None else None,
                     backends=(backends[0], backends[1]))
    for problem in launch.compare_fingerprints([ra, rb]):
        result.failures.append(f"FAIL: {problem}")
    record.update(verdict="pass" if result.passed else "fail", failures=list(result.failures),
                  results=result.to_dict(), dtypes=dtypes,
                  backend_info={n: by_name[n].get("backend_info", {}) for n in backends})
    records.atomic_write_json(path, record)

    print(format_table(result))
    if getattr(args, "per_parameter", False):
        print()
        print(format_gradients(result))
    for line in result.failures:
        print(line)
    if result.passed:
        print(f"PASS: {backends[0]} ({dtypes[backends[0]]}) and {backends[1]} ({dtypes[backends[1]]}) agree "
              f"within tolerance over {result.loss_steps} steps")
    print(f"parity record: {path}")
    return 0 if result.passed else 1
