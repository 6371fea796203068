"""The checks, in their fixed priority order (tiers), with the parts each needs and its estimated time.

The order is what a person holding a GPU for minutes wants proved first: the machine (preflight), a paired speed
verdict of two backends on one GPU, a green verdict (3 seeds), the harness's overhead, the launch-free step, nanoGPT's
recipe beside nanoGPT, then the rest. `--dry-run` plans the same checks on the CPU, tiny (one preset, a few steps);
the CUDA-only modes must then be refused in one line (exit 2), which proves their command lines.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from gpucheck import judges, nanogpt

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "gpu_check.py"
SIZES = ("small", "medium", "large")
RECIPE = "nanogpt-shakespeare-char"
RECIPE_TARGET = 1.48  # this project's bound on the recipe's best validation loss (nanoGPT's published: 1.4697)
# a run's modes of the torch step, as `harness run` and `bench` take them
MODES = {"fp32": [], "bf16": ["--precision", "bf16"], "cuda-graphs": ["--cuda-graphs"],
         "reduce-overhead": ["--compile", "reduce-overhead"]}
CUDA_ONLY = {"bf16", "cuda-graphs", "reduce-overhead"}
# the recipe's modes (--recipe-mode): the harness's step options for each
RECIPE_MODES = {"eager": [], "compile": ["--compile"], "cuda-graphs": ["--cuda-graphs"],
                "reduce-overhead": ["--compile", "reduce-overhead"]}
TIERS = {1: "preflight: what this machine has, and what each missing part skips",
         2: "a paired speed verdict: torch,numpy on the GPU (the oracle on CuPy)",
         3: "a green verdict: a 3-seed paired sweep",
         4: "bench overhead, fp32 and --cuda-graphs, at every preset",
         5: "medium with --cuda-graphs against eager (the small-step speedup judged from the bench)",
         6: "the 5000-step recipe (attention dropout) beside nanoGPT's train.py",
         7: "the rest: bf16, reduce-overhead, the other presets, profiler tables, torch,jax, where the time goes "
            "part by part, parity at every size, doctor"}
GPU_PARTS = {"cuda", "cupy", "jax-cuda", "compiler"}  # what only the GPU plan needs (a dry run runs on the CPU)
SPEEDUP_TARGET = 4.0  # --cuda-graphs: a small step at least this many times faster than eager (bench, small)

# Seconds on one H100, from its first run's figures (docs/benchmarks.md, "CUDA results", and the notes of that run):
# a harness command costs about 15 s beyond its steps (interpreter, torch, CUDA initialisation, evaluation,
# records); steps of 2.7 (small), 4.0 (medium) and 7.7 ms (large), numpy on CuPy 14.6 ms (medium); the recipe 10.96
# ms a step (bf16), nanoGPT's train.py 11.73 ms an iteration; --compile 19 to 28 s of compiling; parity 15, 15, 31
# and 23 s; bench overhead 30 paired repeats of 50 steps per loop and preset. `--estimates FILE` replaces them with
# a summary's measured times.
ESTIMATES: dict[str, float] = {
    "preflight": 20,  # nvidia-smi, a child importing torch and NVML, CuPy's readiness kernels, JAX's devices
    "paired-torch-numpy": 60,  # 2 workers (15 s each), timing processes (10 s), 10 to 40 rounds of 2 x 0.25 s
    "sweep-3-seeds": 150,  # 6 cells (13 s each), 3 paired timings (20 s each)
    "bench-fp32": 75,  # 30 x 2 x 50 steps at 2.6, 4.9 and 7.0 ms (64 s), setup
    "bench-cuda-graphs": 65,  # as fp32, the captured steps shorter
    "run-medium-fp32": 15, "run-medium-cuda-graphs": 15, "cuda-graphs-speedup": 0,
    "recipe-5000": 110,  # 5000 x 10.96 ms (55 s), 21 evaluations of 2 x 200 batches (30 s), start
    "nanogpt-5000": 110,  # 5000 x 11.73 ms (59 s), its 21 evaluations (30 s), start and data
    "bench-bf16": 80, "bench-reduce-overhead": 70,  # two compiles of small (20 s each)
    "run-small-fp32": 15, "run-small-cuda-graphs": 15, "run-large-fp32": 18, "run-large-cuda-graphs": 18,
    "recipe-300-eager": 25, "recipe-300-compile": 60, "recipe-300-cuda-graphs": 25, "recipe-300-reduce-overhead": 70,
    "profile-eager": 25, "profile-cuda-graphs": 25,
    "nanogpt-300-compile-false": 25, "nanogpt-300-compile-true": 70,
    "paired-torch-jax": 70, "doctor": 15,
    # bench parts at small, torch,jax,numpy, 5 rounds: about 100 s of wall time on an H200 (JAX's compilation of its
    # parts and step 16 to 19 s of it, in parallel with the others' set-up), measured by its first GPU run
    "parts-small": 100,
    "parity-small-float32-cpu-oracle": 15, "parity-small-float64-cpu-oracle": 15,
    "parity-medium-float32-cpu-oracle": 15, "parity-medium-float64-cupy": 23, "parity-large-float32-cupy": 31,
}
# the dry run's checks on a 2-core CPU (tiny): a process start with torch is a few seconds
DRY_ESTIMATES: dict[str, float] = {"preflight": 3, "paired-torch-numpy": 12, "sweep-3-seeds": 6, "bench-fp32": 6,
                                   "parity-small-float64-cpu-oracle": 8, "doctor": 5}
DRY_DEFAULT_S, REFUSAL_S = 5.0, 1.0

Judge = Callable[..., tuple[bool, str, dict]]


@dataclass
class Check:
    """One check: its command, its tier, what it needs, how long it should take and how it is judged."""

    name: str
    tier: int
    argv: list[str]  # [] for a check made in this process (preflight, a figure derived from other checks)
    estimate_s: float
    timeout_s: float
    judge: Judge | None = None
    needs: frozenset[str] = frozenset()  # parts the preflight must find (harness.preflight.PARTS)
    refuse: bool = False  # a dry run of a CUDA-only mode: passes when refused in one line with exit 2
    long: bool = False  # the 5000-step runs (--skip-long)
    untimed: bool = False  # times nothing (parity, doctor): may run beside other untimed checks (--jobs)
    prepare: Callable[[Path], None] | None = None  # run before the command, given the check's directory
    cleanup: Callable[[Path], None] | None = None  # run after it (nanoGPT's checkpoints are deleted)
    cwd: str | None = None  # where the command runs, relative to the check's directory (default: the directory)
    after: tuple[str, ...] = ()  # checks whose results it reads (a derived check)
    derive: Callable[[dict[str, dict]], tuple[bool, str, dict]] | None = None
    # parts the check can do without, each with the backend left out of its --backend list when the preflight does
    # not find it (bench parts runs torch,numpy where JAX's CUDA plugin is missing), and what was left out (the
    # summary's row says it)
    optional: dict[str, str] = field(default_factory=dict)
    left_out: str = ""

    def without(self, parts: dict[str, str]) -> Check:
        """This check with the backends of the missing optional `parts` (part -> why it is missing) left out of its
        --backend list, and its row saying so."""
        drop = {self.optional[p] for p in parts}
        at = self.argv.index("--backend") + 1
        argv = [*self.argv[:at], ",".join(b for b in self.argv[at].split(",") if b not in drop), *self.argv[at + 1:]]
        said = "; ".join(f"{self.optional[p]} left out: needs {p} ({why})" for p, why in parts.items())
        return dataclasses.replace(self, argv=argv, needs=self.needs - set(parts), optional={}, left_out=said)


@dataclass
class Scale:
    """What differs between the GPU plan and the dry run: the device, the presets, the step counts."""

    dry: bool
    device: str
    sizes: tuple[str, ...]
    mid: str  # the preset of the paired run, the sweep and the captured-against-eager runs
    run: list[str]
    bench: list[str]
    parity_steps: list[str]
    paired: list[str]
    sweep: list[str]
    recipe_short: list[str]
    recipe_long: list[str]
    estimates: dict[str, float] = field(default_factory=dict)

    def estimate(self, name: str, refuse: bool = False) -> float:
        if not self.dry:
            return float(self.estimates.get(name, ESTIMATES.get(name, 30.0)))
        return REFUSAL_S if refuse else float(self.estimates.get(name, DRY_ESTIMATES.get(name, DRY_DEFAULT_S)))


def scale(dry: bool) -> Scale:
    if dry:
        tiny = ["--set", "eval_batches=1"]
        recipe = ["--set", "batch_size=2", "--set", "n_layer=1", "--set", "block_size=32", "--set", "n_embd=48",
                  "--set", "eval_batches=1"]
        return Scale(True, "cpu", ("small",), "small", ["--steps", "2", *tiny],
                     ["--timed-steps", "2", "--warmup", "1", "--repeats", "2"], ["--steps", "2"],
                     ["--steps", "2", "--paired-rounds", "2", *tiny],
                     ["--backend", "numpy", "--seeds", "3", "--steps", "1", "--paired-rounds", "0", *tiny],
                     ["--steps", "2", *recipe], ["--steps", "3", *recipe])
    return Scale(False, "cuda", SIZES, "medium", ["--steps", "300"], ["--check"], [], ["--steps", "300"],
                 ["--backend", "torch,numpy", "--seeds", "3", "--steps", "300"],
                 ["--steps", "300", "--set", "eval_interval=1000", "--set", "eval_batches=20"], [])


def harness(*args: str) -> list[str]:
    return [sys.executable, "-m", "harness", *args]


QUIET = ["--no-text", "--no-report", "--quiet"]


def make(s: Scale, name: str, tier: int, argv: list[str], judge: Judge | None, needs: tuple[str, ...] = (),
         **kw: object) -> Check:
    """A check of the plan at scale `s`: its estimate from the table, a timeout of four estimates (at least two
    minutes; a dry run's five minutes: the CPU is shared), and what it needs (every harness command needs the
    harness's dependencies; on a GPU, CUDA)."""
    est, cpu = s.estimate(name, bool(kw.get("refuse"))), bool(kw.pop("cpu", False))
    parts = set(needs) | ({"harness"} if argv else set()) | (set() if s.dry or cpu else {"cuda"})
    if s.dry:
        parts -= GPU_PARTS
    timeout = 60.0 if kw.get("refuse") else 300.0 if s.dry else max(120.0, 4 * est)
    return Check(name, tier, argv, est, timeout, judge, frozenset(parts), **kw)  # type: ignore[arg-type]


def mode_check(s: Scale, name: str, tier: int, mode: str, argv: list[str], judge: Judge,
               needs: tuple[str, ...] = ()) -> Check:
    """A check of one step mode: in a dry run a CUDA-only mode must be refused instead."""
    if s.dry and mode in CUDA_ONLY:
        return make(s, name, tier, argv, judges.refusal, refuse=True)
    compiles = mode in ("reduce-overhead", "compile")
    return make(s, name, tier, argv, judge, (*needs, *(("compiler",) if compiles else ())))


def plan(args: object) -> list[Check]:
    """Every check in priority order. `args`: dry_run, nanogpt, data, recipe_mode, recipe_target, estimates."""
    s = scale(bool(getattr(args, "dry_run", False)))
    s.estimates = dict(getattr(args, "estimates", None) or {})
    checks = [make(s, "preflight", 1, [], None, cpu=True)]
    dev = ["--device", s.device]
    checks.append(make(s, "paired-torch-numpy", 2, harness("run", "--size", s.mid, *dev, "--backend", "torch,numpy",
                                                          *s.paired, *QUIET), judges.paired(not s.dry), ("cupy",)))
    checks.append(make(s, "sweep-3-seeds", 3, harness("sweep", "--size", s.mid, *dev, *s.sweep, "--no-text", "--yes",
                                                      "--quiet", "--no-report"), judges.sweep(not s.dry), ("cupy",)))
    for mode in ("fp32", "cuda-graphs"):
        checks.append(bench_check(s, mode, 4, s.sizes))
    for mode in ("fp32", "cuda-graphs"):
        checks.append(run_check(s, s.mid, mode, 5))
    if not s.dry:  # the captured bench is refused on the CPU: nothing to compare
        checks.append(make(s, "cuda-graphs-speedup", 5, [], None, after=("bench-fp32", "bench-cuda-graphs"),
                           derive=judges.speedup(SPEEDUP_TARGET, f"run-{s.mid}-fp32", f"run-{s.mid}-cuda-graphs")))
    checks += long_checks(args, s)
    checks += rest(args, s)
    return checks


def bench_check(s: Scale, mode: str, tier: int, sizes: tuple[str, ...]) -> Check:
    argv = harness("bench", "overhead", "--size", ",".join(sizes), "--device", s.device, *s.bench, *MODES[mode],
                   "--quiet")
    return mode_check(s, f"bench-{mode}", tier, mode, argv, judges.bench)


def run_check(s: Scale, size: str, mode: str, tier: int) -> Check:
    argv = harness("run", "--size", size, "--device", s.device, *s.run, *MODES[mode], *QUIET)
    return mode_check(s, f"run-{size}-{mode}", tier, mode, argv, judges.run)


def long_checks(args: object, s: Scale) -> list[Check]:
    """Tier 6: the full recipe (5000 steps; bf16 on a GPU, as nanoGPT trains it; the preset has nanoGPT's attention
    dropout), judged by its best validation loss, and nanoGPT's own train.py on the same config."""
    mode = getattr(args, "recipe_mode", "eager")
    prec = [] if s.dry else ["--precision", "bf16"]
    argv = harness("run", "--size", RECIPE, "--device", s.device, *prec, *s.recipe_long, *RECIPE_MODES[mode], *QUIET)
    target = float(getattr(args, "recipe_target", RECIPE_TARGET))
    recipe = mode_check(s, "recipe-5000", 6, mode, argv, judges.recipe(float("inf") if s.dry else target))
    recipe.long = True
    return [recipe, nanogpt_check(args, s, 6, 5000, compiled=False)]


def nanogpt_check(args: object, s: Scale, tier: int, iters: int, compiled: bool) -> Check:
    """nanoGPT's train.py on its shakespeare-char config in a copy of the checkout given (--nanogpt), its data
    written from the harness's data file; skipped (a row says why) without a checkout."""
    name = f"nanogpt-{iters}" + ("" if iters == 5000 else f"-compile-{str(compiled).lower()}")
    checkout, data = getattr(args, "nanogpt", None), getattr(args, "data", None)
    argv = nanogpt.argv(s.dry, iters, compiled)
    check = make(s, name, tier, argv, nanogpt.judge, ("nanogpt", *(("compiler",) if compiled else ())),
                 cwd="nanoGPT", cleanup=nanogpt.cleanup, long=iters == 5000,
                 prepare=nanogpt.preparer(Path(checkout), Path(data)) if checkout and data else None)
    check.needs -= {"harness"}  # nanoGPT runs on torch and numpy alone
    return check


def rest(args: object, s: Scale) -> list[Check]:
    """Tier 7: bf16 and reduce-overhead benches, the other presets, the recipe's 300-step modes with their
    profiler tables and nanoGPT beside them, torch,jax, doctor, and parity at every size."""
    checks = [bench_check(s, "bf16", 7, s.sizes), bench_check(s, "reduce-overhead", 7, ("small",))]
    checks += [run_check(s, size, mode, 7) for size in s.sizes if size != s.mid for mode in ("fp32", "cuda-graphs")]
    prec = [] if s.dry else ["--precision", "bf16"]
    for mode, flags in RECIPE_MODES.items():
        if s.dry and mode == "compile":
            continue  # Inductor's C++ compile of the model takes minutes on a small CPU; on a GPU it runs
        argv = harness("run", "--size", RECIPE, "--device", s.device, *prec, *s.recipe_short, *flags, *QUIET)
        checks.append(mode_check(s, f"recipe-300-{mode}", 7, mode, argv, judges.run))
    for mode in ("eager",) if s.dry else ("eager", "cuda-graphs"):
        argv = [sys.executable, str(TOOL), "--profile", mode, "--device", s.device, *(["--dry-run"] if s.dry else [])]
        checks.append(make(s, f"profile-{mode}", 7, argv, judges.exit_status))
    checks += [nanogpt_check(args, s, 7, 300, compiled) for compiled in ((False,) if s.dry else (False, True))]
    if not s.dry:
        checks.append(make(s, "paired-torch-jax", 7, harness("run", "--size", s.mid, "--device", "cuda", "--backend",
                                                             "torch,jax", *s.paired, *QUIET), judges.paired(True),
                           ("jax-cuda",)))
        checks.append(parts_check(s))
    checks.append(make(s, "doctor", 7, harness("doctor"), judges.exit_status, untimed=True, cpu=True))
    return checks + parity_checks(s)


def parts_check(s: Scale) -> Check:
    """`harness bench parts` at small on the GPU, torch,jax,numpy (the oracle on CuPy) in 5 rounds, and its page
    rebuilt by `harness report ID` (the judge); without JAX's CUDA plugin it runs torch,numpy, its row saying why
    jax was left out."""
    argv = harness("bench", "parts", "--size", "small", "--backend", "torch,jax,numpy", "--device", s.device,
                   "--rounds", "5", "--quiet")
    return make(s, "parts-small", 7, argv, judges.parts, ("cupy", "jax-cuda"), optional={"jax-cuda": "jax"})


def parity_checks(s: Scale) -> list[Check]:
    """Parity float32 and float64 against the oracle on the CPU (`--device torch=cuda`) and on CuPy (`--device
    cuda`, large with 20 steps); a dry run's one check is float64 on the CPU."""
    if s.dry:
        rows = [("small", "float64", "cpu", s.parity_steps)]
    else:
        rows = [("small", "float32", "torch=cuda", []), ("small", "float64", "torch=cuda", []),
                ("medium", "float32", "torch=cuda", []), ("medium", "float64", "cuda", []),
                ("large", "float32", "cuda", ["--steps", "20"])]
    out = []
    for size, dt, dev, extra in rows:
        # float32: torch float32 against the float64 oracle, parity's default pair (no --dtype, which sets both)
        argv = harness("parity", "--size", size, "--device", dev, *(["--dtype", dt] if dt == "float64" else []),
                       *extra, "--quiet")
        name = f"parity-{size}-{dt}-{'cupy' if dev == 'cuda' else 'cpu-oracle'}"
        out.append(make(s, name, 7, argv, judges.parity, ("cupy",) if dev == "cuda" else (), untimed=True))
    return out


def select(checks: list[Check], only: str | None) -> tuple[list[Check], list[str]]:
    """The checks `--only` names (comma-separated: an exact name, else a prefix), preflight always; and the items
    that match nothing."""
    if not only:
        return checks, []
    items = [i.strip() for i in only.split(",") if i.strip()]
    names = {c.name for c in checks}
    chosen, unmatched = set(), []
    for item in items:
        hits = {item} if item in names else {n for n in names if n.startswith(item)}
        chosen |= hits
        if not hits:
            unmatched.append(item)
    return [c for c in checks if c.name in chosen or c.name == "preflight"], unmatched


def normalise_mode(value: str) -> str | None:
    """A --recipe-mode value in either spelling (`cuda-graphs`, `--cuda-graphs`, `--compile reduce-overhead`) as
    a RECIPE_MODES key, or None."""
    v = " ".join(value.replace("=", " ").split()).removeprefix("--")
    v = {"compile reduce-overhead": "reduce-overhead", "fp32": "eager", "": "eager"}.get(v, v)
    return v if v in RECIPE_MODES else None
