"""The command line's shared vocabulary: the parser that fails in one line, argument types and the options that
run, parity, bench, sweep and kit have in common. Below every command module, so none of them imports the CLI."""

from __future__ import annotations

import argparse
from pathlib import Path

from harness.config import PRESETS, load_config, seed_arg

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


def count_arg(text: str) -> int:
    """argparse type of a count that may be 0 (e.g. --paired-rounds 0: none)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be 0 or more")
    return value


def add_paired(p: argparse.ArgumentParser, default: int | None) -> None:
    """--paired-rounds (run, sweep): the paired timing that every speed comparison rests on (harness.paired)."""
    p.add_argument("--paired-rounds", type=count_arg, default=default, metavar="N",
                   help="with two or more backends: time them side by side after training, all alive at once, in "
                        "alternating short bursts, until N undisturbed rounds are in (default 10; 0: no paired "
                        "timing, and then no speed verdict)")


def out_arg(text: str) -> Path:
    """argparse type of --out: a non-empty path (an empty one would silently mean the current directory)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("--out is empty; pass a directory, e.g. --out reports")
    return Path(text)


def add_common(p: argparse.ArgumentParser, sizes: tuple[str, ...] = PRESETS, per_backend_device: bool = False) -> None:
    """Options shared by run, parity and bench: what to train on what data, and where to write.

    With `per_backend_device` (parity), --device is repeatable and takes DEVICE or NAME=DEVICE
    (harness.devices.parse_devices)."""
    p.add_argument("--size", default="small", choices=sizes, metavar="SIZE",
                   help=f"size preset: {', '.join(sizes)} (default small)")
    p.add_argument("--config", metavar="FILE", help="a TOML config of your own (see `harness sizes --toml small`), "
                   "or a nanoGPT config .py (read, never run; docs/nanogpt.md)")
    p.add_argument("--set", action="append", metavar="NAME=VALUE",
                   help="override one config value (repeatable): a field (tie_embeddings=true, gelu=exact, "
                        "lr_schedule=cosine, ...) or nanoGPT's name (max_iters=2000, lr_decay_iters=2000, ...)")
    p.add_argument("--data", metavar="PATH", help="UTF-8 text to train on (default: $HARNESS_DATA, else Tiny "
                   "Shakespeare, downloaded once into the user cache)")
    if per_backend_device:
        p.add_argument("--device", action="append", metavar="DEVICE|NAME=DEVICE",
                       help="cpu (default) or cuda for every backend, or NAME=DEVICE for one (repeatable), e.g. "
                            "--device torch=cuda: torch on the GPU, the other backend on the CPU")
    else:
        p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="cpu (default) or cuda")
    p.add_argument("--seed", type=seed_arg, default=1337, help="seed of the weights, batches and sampling, "
                   "0 to 2**32-1 (1337)")
    p.add_argument("--out", type=out_arg, default=DEFAULT_OUT, metavar="DIR", help="output directory (reports/)")
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
    from harness.nanogpt import parse_sets

    config = load_config(size or args.size, args.config, parse_sets(getattr(args, "set", None)))
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
