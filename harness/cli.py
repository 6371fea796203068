"""`harness`: the command line. Bad input ends with one line on stderr and exit status 2, never a traceback."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from harness.config import SIZES, load_config
from harness.errors import UsageError

DEFAULT_OUT = Path("reports")


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (the problem and where to look), exit 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}; see `{self.prog} --help`\n")


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be positive")
    return value


def add_common(p: argparse.ArgumentParser, sizes: tuple[str, ...] = SIZES) -> None:
    """Options shared by run, parity and bench: what to train on what data, and where to write."""
    p.add_argument("--size", default="small", choices=sizes, metavar="SIZE",
                   help=f"size preset: {', '.join(sizes)} (default small)")
    p.add_argument("--config", metavar="FILE", help="a TOML config of your own (see `harness sizes --toml small`)")
    p.add_argument("--data", metavar="PATH", help="UTF-8 text to train on (default: $HARNESS_DATA, else Tiny "
                   "Shakespeare, downloaded once into the user cache)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="cpu (default) or cuda")
    p.add_argument("--seed", type=int, default=1337, help="seed of the weights, batches and sampling (1337)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, metavar="DIR", help="output directory (reports/)")
    p.add_argument("--dtype", choices=("float32", "float64"),
                   help="floating type where the backend supports a choice (torch: float32, numpy: float64)")


def add_schedule(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--steps", type=positive_int, metavar="N", help="train exactly N steps")
    g.add_argument("--epochs", type=positive_int, metavar="N", help="train N epochs (preset: 20)")
    p.add_argument("--eval-interval", type=positive_int, metavar="N", help="evaluate every N steps")
    p.add_argument("--dropout", type=float, metavar="P", help="override the preset's dropout")
    p.add_argument("--scheme", choices=("epochs", "random"), help="batch scheme (preset: epochs)")


def configure(args: argparse.Namespace, size: str | None = None) -> object:
    """The validated Config for `size` (or --config) with the command line's overrides applied."""
    config = load_config(size or args.size, args.config)
    changes = {k: v for k, v in {
        "steps": getattr(args, "steps", None), "epochs": getattr(args, "epochs", None),
        "eval_interval": getattr(args, "eval_interval", None), "dropout": getattr(args, "dropout", None),
        "scheme": getattr(args, "scheme", None)}.items() if v is not None}
    if getattr(args, "epochs", None) is not None:
        changes["steps"] = None
    return config.replace(**changes) if changes else config


def backend_options(args: argparse.Namespace, backends: list[str]) -> dict[str, dict]:
    opts: dict[str, dict] = {}
    for name in backends:
        o: dict = {}
        if args.dtype:
            o["dtype"] = args.dtype
        if name == "torch" and getattr(args, "compile", False):
            o["compile"] = True
        if name in ("torch", "flux") and getattr(args, "precision", None):
            o["precision"] = args.precision
        opts[name] = o
    return opts


# --- run ---------------------------------------------------------------------------------------------------------
def cmd_run(args: argparse.Namespace) -> int:
    from harness import launch, records
    from harness.data import load_corpus

    if args.resume:
        return resume_run(args)
    backends = list(args.backend or [])
    if args.both:
        backends += [b for b in ("torch", "flux") if b not in backends]
    backends = backends or ["torch"]
    sizes = list(SIZES) if args.size == "all" else [args.size]
    if args.size == "all" and args.config:
        raise UsageError("--size all and --config exclude each other; pass one")
    corpus = load_corpus(args.data)
    plans = [launch.Plan(config=configure(args, size), corpus=corpus, backends=backends, device=args.device,
                         seed=args.seed, out=args.out, backend_options=backend_options(args, backends),
                         checkpoint_every=args.checkpoint_every or 0, text=not args.no_text,
                         progress=not args.quiet, threads=args.threads) for size in sizes]
    for plan in plans:
        launch.preflight(plan)
    worst = 0
    run_ids = []
    for plan in plans:
        run_id = launch.write_spec(plan)
        run_ids.append(run_id)
        directory = records.run_dir(plan.out, run_id)
        print(f"run {run_id}: {plan.config.name} on {plan.device}, backends {', '.join(backends)}", file=sys.stderr)
        codes = launch.execute(directory, backends, progress=plan.progress, threads=plan.threads)
        worst = max(worst, finish(plan.out, run_id, codes))
        if 130 in codes.values():
            worst = 130
            break
    if not args.no_report:
        write_reports(args.out, run_ids)
    return worst


def finish(out: Path, run_id: str, codes: dict[str, int]) -> int:
    """Print where the records are, check the backends saw identical inputs; returns the exit status."""
    from harness import launch, records

    _, recs = records.load_run(out, run_id)
    directory = records.run_dir(out, run_id)
    for rec in recs:
        last = rec["evals"][-1] if rec["evals"] else None
        val = f", val loss {last['val_loss']:.4f} at step {last['step']}" if last else ""
        tps = rec["timings"].get("tokens_per_s")
        speed = f", {tps:,.0f} tokens/s" if tps else ""
        print(f"  {rec['backend']}: {rec['status']}{val}{speed} -> {directory / (rec['backend'] + '.json')}",
              file=sys.stderr)
    problems = launch.compare_fingerprints(recs)
    for problem in problems:
        print(f"  warning: {problem}: the comparison is not fair", file=sys.stderr)
    if any(c == 2 for c in codes.values()):
        return 2
    if problems or any(c not in (0, 130) for c in codes.values()):
        return 1
    return 130 if 130 in codes.values() else 0


def write_reports(out: Path, run_ids: list[str]) -> None:
    from harness.report import write_index, write_report

    if run_ids:
        path = write_report(out, run_ids)
        write_index(out)
        print(f"report: {path}", file=sys.stderr)


def resume_run(args: argparse.Namespace) -> int:
    from harness import launch, records

    spec = launch.load_spec(args.out, args.resume)
    directory = records.run_dir(args.out, args.resume)
    print(f"resuming run {args.resume}", file=sys.stderr)
    codes = launch.execute(directory, spec["backends"], resume=True, progress=not args.quiet,
                           threads=spec.get("threads"))
    code = finish(args.out, args.resume, codes)
    if not args.no_report:
        write_reports(args.out, [args.resume])
    return code


# --- sizes -------------------------------------------------------------------------------------------------------
def cmd_sizes(args: argparse.Namespace) -> int:
    from harness.config import preset_path

    if args.toml:
        sys.stdout.write(preset_path(args.toml).read_text(encoding="utf-8"))
        return 0
    import pandas as pd

    rows = {}
    for size in SIZES:
        c = load_config(size)
        rows[size] = {"embedding d": c.n_embd, "block size n": c.block_size, "batch size": c.batch_size,
                      "layers": c.n_layer, "heads": c.n_head, "MLP hidden d_h": c.d_hidden, "dropout": c.dropout,
                      "learning rate": c.learning_rate, "epochs": c.epochs, "weight decay": c.weight_decay,
                      "grad clip": c.grad_clip, "eval every": c.eval_interval}
    print(pd.DataFrame({size: {k: f"{v:g}" for k, v in row.items()} for size, row in rows.items()}).to_string())
    return 0


# --- report ------------------------------------------------------------------------------------------------------
def cmd_report(args: argparse.Namespace) -> int:
    from harness import records
    from harness.report import write_index, write_report

    records.check_writable(args.out)
    for run_id in args.run_ids:
        records.load_run(args.out, run_id)  # a missing or corrupt record fails here, before anything is written
    path = write_report(args.out, args.run_ids)
    write_index(args.out)
    print(f"report: {path}")
    return 0


# --- doctor / setup ----------------------------------------------------------------------------------------------
def cmd_doctor(args: argparse.Namespace) -> int:
    from harness.doctor import doctor

    return doctor()


def cmd_setup(args: argparse.Namespace) -> int:
    from harness.doctor import setup_julia

    return setup_julia(force=args.force)


def build_parser() -> Parser:
    parser = Parser(prog="harness", description="Train the same nanoGPT in PyTorch, NumPy and Flux.jl, "
                    "with identical data and weights, and compare them.")
    from harness import __version__

    parser.add_argument("--version", action="version", version=f"nanogpt-parity {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=Parser)

    p = sub.add_parser("run", help="train one or more backends and write records and a report")
    add_common(p, (*SIZES, "all"))
    add_schedule(p)
    p.add_argument("--backend", action="append", metavar="NAME", help="torch, numpy or flux (repeatable)")
    p.add_argument("--both", action="store_true", help="same as --backend torch --backend flux")
    p.add_argument("--checkpoint-every", type=positive_int, metavar="N", help="save model+optimizer every N steps")
    p.add_argument("--resume", metavar="RUN_ID", help="continue an interrupted run from its checkpoints")
    p.add_argument("--compile", action="store_true", help="torch: torch.compile the model (time to first step "
                   "includes the compile)")
    p.add_argument("--precision", choices=("fp32", "tf32", "bf16"), help="torch on CUDA: matmul precision (fp32)")
    p.add_argument("--threads", type=positive_int, metavar="N", help="CPU threads per backend (OMP, OpenBLAS, "
                   "MKL, Julia); default: the frameworks' own choice")
    p.add_argument("--no-text", action="store_true", help="skip generation, BLEU and chrF")
    p.add_argument("--no-report", action="store_true", help="write records only, no HTML report")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("sizes", help="print the size presets")
    p.add_argument("--toml", choices=SIZES, metavar="SIZE", help="print that preset's TOML file instead")
    p.set_defaults(func=cmd_sizes)

    p = sub.add_parser("report", help="rebuild an HTML report from stored run records")
    p.add_argument("run_ids", nargs="+", metavar="RUN_ID")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, metavar="DIR", help="output directory (reports/)")
    p.set_defaults(func=cmd_report)

    from harness import bench, parity

    p = sub.add_parser("parity", help="check that two backends compute the same thing, depth by depth")
    add_common(p)
    parity.add_arguments(p)
    p.set_defaults(func=parity.command)

    p = sub.add_parser("bench", help="measure harness overhead, bare-loop speed and batch-stream speed")
    bench.add_arguments(p)
    p.set_defaults(func=bench.command)

    from harness import kit

    p = sub.add_parser("kit", help="a conformance kit for any nanoGPT port: export inputs and the oracle's answers, "
                       "check a port's results")
    kit.add_arguments(p)
    p.set_defaults(func=kit.command)

    p = sub.add_parser("doctor", help="report what is installed (Python, torch, CUDA, Julia, Flux) and what to do")
    p.set_defaults(func=cmd_doctor)

    p = sub.add_parser("setup", help="install and precompile optional parts ahead of time")
    p.add_argument("what", choices=("julia",), help="julia: the Flux.jl environment")
    p.add_argument("--force", action="store_true", help="re-resolve and re-precompile even if it looks done")
    p.set_defaults(func=cmd_setup)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except UsageError as exc:
        print(f"harness: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("harness: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
