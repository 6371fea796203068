"""The command line's shared vocabulary: the parser that fails in one line, argument types and the options that
run, parity, bench, sweep and kit have in common. Below every command module, so none of them imports the CLI.

One spelling per concept in every command (tests/test_cli_vocabulary.py holds the table): `--backend` and `--size`
take one or more values, repeated or as a comma list (`--backend torch,numpy` = `--backend torch --backend numpy`),
and `all`; the plural spellings `--backends`, `--sizes`, `--configs` are aliases. A command that takes exactly one
(parity: one size, two backends; kit export: one size) says so in one line. docs/usage.md has the whole table.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from harness.config.fields import Config, seed_arg
from harness.config.load import load_config
from harness.config.presets import PRESETS, SIZES
from harness.errors import UsageError

DEFAULT_OUT = Path("reports")


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (the problem and where to look), exit 2, and no abbreviations: a
    prefix (`--thread`, or `--size` where only `--sizes` exists) is an error, never silently another option."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

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


def rounds_arg(text: str) -> int:
    """argparse type of --paired-rounds: 0 (none) to harness.timing.paired.MAX_ROUNDS."""
    from harness.timing.paired import MAX_ROUNDS

    value = count_arg(text)
    if value > MAX_ROUNDS:
        raise argparse.ArgumentTypeError(f"{text!r} is more than {MAX_ROUNDS} rounds; 10 to 30 give a tight interval")
    return value


def add_paired(p: argparse.ArgumentParser, default: int | None) -> None:
    """--paired-rounds (run, sweep): the paired timing that every speed comparison rests on
    (harness.run.paired_timing)."""
    p.add_argument("--paired-rounds", type=rounds_arg, default=default, metavar="N",
                   help="with two or more backends: time them side by side after training, all alive at once, in "
                        "alternating short bursts, until N undisturbed rounds are in (default 10; 0: no paired "
                        "timing, and then no speed verdict)")


def out_arg(text: str) -> Path:
    """argparse type of --out: a non-empty path (an empty one would silently mean the current directory)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("--out is empty; pass a directory, e.g. --out reports")
    return Path(text)


def add_common(p: argparse.ArgumentParser, size_help: str | None = None, per_backend_device: bool = False,
               one_size: bool = False) -> None:
    """Options shared by run and parity: what to train on what data, and where to write.

    With `per_backend_device` (parity), --device is repeatable and takes DEVICE or NAME=DEVICE
    (harness.cli.options.parse_devices)."""
    add_size(p, size_help or f"size preset(s): {', '.join(PRESETS)}, or all ({', '.join(SIZES)}); repeat or "
             "comma-separate (default small)",
             one=one_size)
    add_config(p)
    add_set(p)
    add_data(p)
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
                   help="floating type where the backend supports a choice (torch, jax: float32; numpy: float64)")


# --- the options every command spells the same way ---------------------------------------------------------------
LIST_METAVAR = "NAME[,NAME...]"


def add_backend(p: argparse.ArgumentParser, help: str) -> None:
    """--backend (alias --backends): one or more names, repeated or comma-separated; `all` = every backend that can
    run here (see available_backends). Parsed by pick_backends."""
    p.add_argument("--backend", "--backends", dest="backend", action="append", metavar=LIST_METAVAR, help=help)


def add_size(p: argparse.ArgumentParser, help: str, one: bool = False) -> None:
    """--size (alias --sizes): one or more presets, repeated or comma-separated, or `all`; a command that takes one
    (`one`) shows SIZE. Parsed by pick_sizes."""
    p.add_argument("--size", "--sizes", dest="size", action="append", metavar="SIZE" if one else "SIZE[,SIZE...]",
                   help=help)


def add_config(p: argparse.ArgumentParser) -> None:
    """--config FILE (run, parity, kit export): a config of one's own instead of a preset; read by `configure`."""
    p.add_argument("--config", metavar="FILE", help="a TOML config of your own instead of a preset "
                   "(see `harness sizes --toml small`), or a nanoGPT config .py (read, never run; docs/nanogpt.md)")


def add_set(p: argparse.ArgumentParser) -> None:
    """--set NAME=VALUE (repeatable): one config value; read by `configure` (harness.config.nanogpt.parse_sets)."""
    p.add_argument("--set", action="append", metavar="NAME=VALUE",
                   help="override one config value (repeatable): a field (tie_embeddings=true, gelu=exact, "
                        "lr_schedule=cosine, ...) or nanoGPT's name (max_iters=2000, lr_decay_iters=2000, ...)")


def add_data(p: argparse.ArgumentParser) -> None:
    """--data PATH: the text to train on (harness.core.data.load_corpus)."""
    p.add_argument("--data", metavar="PATH", help="UTF-8 text to train on (default: $HARNESS_DATA, else Tiny "
                   "Shakespeare, downloaded once into the user cache)")


def add_quiet(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quiet", action="store_true", help="no progress bars or progress lines on stderr")


THREADS_HELP = "CPU threads per backend process (OMP, OpenBLAS, MKL, Julia)"


def listed(values: str | list[str] | None, option: str) -> list[str]:
    """`--option a,b --option c` (argparse gives ["a,b", "c"]) -> ["a", "b", "c"]; an empty entry is a UsageError."""
    if values is None:
        return []
    texts = [values] if isinstance(values, str) else list(values)
    names = []
    for text in texts:
        parts = [t.strip() for t in str(text).split(",")]
        if not all(parts):
            raise UsageError(f"{option} {text!r} has an empty entry; pass names separated by commas, "
                             f"e.g. {option} a,b")
        names += parts
    return names


def _once(names: list[str], option: str) -> list[str]:
    for name in names:
        if names.count(name) > 1:
            raise UsageError(f"{option} names {name!r} twice; name each once")
    return names


def pick_sizes(values: str | list[str] | None, default: tuple[str, ...] = ("small",), one: bool = False,
               option: str = "--size") -> list[str]:
    """The size presets of --size: any preset (harness.config.presets.PRESETS: the sizes and nanoGPT's recipes); `all`
    is the harness's own sizes (small, medium, large); unknown or repeated names are a UsageError, and with `one` so is
    more than one size."""
    names = listed(values, option) or list(default)
    given = ",".join(names)
    if "all" in names:
        if names != ["all"]:
            raise UsageError(f"{option} all already names every size ({', '.join(SIZES)}); drop the others")
        names = list(SIZES)
    for name in names:
        if name not in PRESETS:
            raise UsageError(f"unknown size {name!r} in {option}; choose from {', '.join(PRESETS)} or all "
                             f"({', '.join(SIZES)})")
    _once(names, option)
    if one and len(names) != 1:
        raise UsageError(f"{option} {given}: this command takes one size; run it once per size")
    return names


def available_backends(device: str = "cpu") -> tuple[list[str], dict[str, str]]:
    """What `--backend all` means: every registered backend that can run on `device` here without installing
    anything first (flux only where Julia and Flux are installed), and why each other one cannot."""
    from harness.backends import REGISTRY, BackendUnavailable, backend_class

    ready, missing = [], {}
    for name in REGISTRY:
        try:
            cls = backend_class(name)
            check = getattr(cls, "check_installed", None) or getattr(cls, "check_available", None)
            if check is not None:
                check(device)
            ready.append(name)
        except (BackendUnavailable, ImportError) as exc:
            missing[name] = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return ready, missing


def pick_backends(values: str | list[str] | None, default: tuple[str, ...] = ("torch",), device: str = "cpu",
                  option: str = "--backend", repeats: bool = False) -> list[str]:
    """The backend names of --backend: `all` is every backend available on `device` (stderr says which were left
    out and why); unknown names (and, unless `repeats`, repeated ones) are a UsageError."""
    from harness.backends import check_names

    names = listed(values, option) or list(default)
    if "all" in names:
        if names != ["all"]:
            raise UsageError(f"{option} all already names every available backend; drop the others")
        names, missing = available_backends(device)
        if not names:
            raise UsageError(f"{option} all: no backend can run here on {device} "
                             f"({'; '.join(missing.values())})")
        left = "; ".join(missing.values())
        print(f"{option} all: {', '.join(names)} on {device}" + (f" (left out: {left})" if left else ""),
              file=sys.stderr)
    check_names(names)
    return names if repeats else _once(names, option)


def add_schedule(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--steps", type=positive_int, metavar="N", help="train exactly N steps")
    g.add_argument("--epochs", type=positive_int, metavar="N", help="train N epochs (preset: 20)")
    p.add_argument("--eval-interval", type=positive_int, metavar="N", help="evaluate every N steps")
    p.add_argument("--dropout", type=float, metavar="P", help="override the preset's dropout")
    p.add_argument("--scheme", choices=("epochs", "random"), help="batch scheme (preset: epochs)")


def configure(args: argparse.Namespace, size: str | None = None, changes: dict[str, object] | None = None
              ) -> Config:
    """The validated Config of the command line: `size` (else the one --size, default small) or --config, then
    --set, then the schedule options the command has (--steps, --epochs, --eval-interval, --dropout, --scheme),
    then `changes` (field -> value: what a command fixes itself, e.g. parity's and kit export's dropout and steps).
    The one place a command turns --config/--set into a Config, so every command reads them alike."""
    from harness.config.nanogpt import parse_sets

    config = load_config(size or pick_sizes(args.size, one=True)[0], args.config,
                         parse_sets(getattr(args, "set", None)))
    fixed = {k: v for k, v in {
        "steps": getattr(args, "steps", None), "epochs": getattr(args, "epochs", None),
        "eval_interval": getattr(args, "eval_interval", None), "dropout": getattr(args, "dropout", None),
        "scheme": getattr(args, "scheme", None)}.items() if v is not None}
    if getattr(args, "epochs", None) is not None:
        fixed["steps"] = None
    fixed.update(changes or {})
    return config.replace(**fixed) if fixed else config


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


DEVICES = ("cpu", "cuda")


DEFAULT_DEVICE = "cpu"


def parse_devices(values: Sequence[str] | str | None, backends: Sequence[str]) -> tuple[str, dict[str, str]]:
    """(the common device, {backend: device} for every backend) from `--device` values; UsageError when bad.

    `values` are the repeated `--device` arguments: `DEVICE` at most once, `NAME=DEVICE` at most once per backend,
    NAME one of `backends`, DEVICE one of cpu, cuda.
    """
    if values is None:
        values = []
    elif isinstance(values, str):
        values = [values]
    common: str | None = None
    named: dict[str, str] = {}
    for value in values:
        name, sep, device = str(value).partition("=")
        if not sep:
            name, device = "", name
        name, device = name.strip(), device.strip()
        if device not in DEVICES:
            raise UsageError(f"--device {value!r}: unknown device {device!r}; use cpu or cuda, for one backend "
                             "NAME=DEVICE (e.g. --device torch=cuda)")
        if sep and not name:
            raise UsageError(f"--device {value!r}: no backend name before '='; e.g. --device torch=cuda")
        if not sep:
            if common is not None and common != device:
                raise UsageError(f"--device given twice without a backend name ({common}, {device}); pass one, "
                                 "and NAME=DEVICE for a single backend")
            common = device
            continue
        if name not in backends:
            raise UsageError(f"--device {value!r}: {name!r} is not one of the backends compared "
                             f"({', '.join(backends)})")
        if name in named and named[name] != device:
            raise UsageError(f"--device names {name} twice ({named[name]}, {device}); name each backend once")
        named[name] = device
    base = common or DEFAULT_DEVICE
    return base, {b: named.get(b, base) for b in backends}
