"""The command line's shared vocabulary: the parser that fails in one line, argument types, the exit-status
section of every --help, and the options that run, parity, bench, sweep, kit and the verbs on stored runs and sweeps
have in common. Below every command module, so none of them imports the CLI.

One spelling and one meaning per concept in every command (tests/test_cli_vocabulary.py checks the parsers):

- a shared option's help is its one sentence here (`*_HELP`), then "; " and what the command adds (`shared`);
- `--backend` and `--size` take one or more values, repeated or as a comma list (`--backend torch,numpy` =
  `--backend torch --backend numpy`), and `all`; the plural spellings `--backends`, `--sizes`, `--configs` are
  aliases. A command that takes exactly one (parity: one size, two backends; kit export: one size) says so, and
  its --size help offers no `all`;
- `--steps` is always training steps, `--threads` the CPU threads of each backend process, `--out` the output
  directory (also of `kit export`), `--device` a plain device or NAME=DEVICE (`parse_devices`), `--set` one config
  value, `--json` the command's result as one JSON object on stdout (`print_json`);
- there are no hidden spellings: every option is in its command's --help.

docs/usage.md has the whole table.
"""

from __future__ import annotations

import argparse
import copy
import sys
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn, TextIO

from harness.backends import BOTH, DEFAULT_BACKEND
from harness.backends.declaration import DEVICES, DTYPES, PRECISIONS, listing
from harness.config.fields import Config, seed_arg
from harness.config.load import load_config
from harness.config.presets import PRESETS, SIZES
from harness.errors import UsageError

DEFAULT_OUT = Path("reports")


class HelpFormatter(argparse.HelpFormatter):
    """argparse's, but the "exit status" section keeps one line per status (wrapped under its text), and a help text
    may name the backends through the placeholders of BACKEND_FACTS (`%(backends)s`, ...): filled from the
    backends' declarations only when the help is printed, so that building the parser reads no declaration."""

    def _expand_help(self, action: argparse.Action) -> str:
        if action.help and "%(" in action.help:
            filled = _fill_facts(action.help, escape=True)
            if filled != action.help:
                action = copy.copy(action)
                action.help = filled
        return super()._expand_help(action)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if not text.startswith(EXIT_HEADER):
            return super()._fill_text(text, width, indent)
        lines = [textwrap.fill(line, width, initial_indent=indent, subsequent_indent=indent + " " * 7)
                 for line in text.splitlines()]
        return "\n".join(lines)


ERROR_PREFIX = "harness: error: "  # every usage error of every command starts so (harness.cli.main prints the rest)


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (the problem and the command's own --help), exit 2, and no
    abbreviations: a prefix (`--thread`, or `--size` where only `--sizes` exists) is an error, never silently another
    option. A parser without subcommands refuses what it does not know itself, so that the line points at its own
    --help (`harness run --help`), not its parent's."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        kwargs["allow_abbrev"] = False
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def format_help(self) -> str:
        """argparse's, with the backends' facts (BACKEND_FACTS' placeholders) filled into the description."""
        text = self.description
        if text and "%(" in text:
            self.description = _fill_facts(text)
        try:
            return super().format_help()
        finally:
            self.description = text

    def error(self, message: str) -> NoReturn:  # type: ignore[override]
        self.exit(2, f"{ERROR_PREFIX}{message}; see `{self.prog} --help`\n")

    def parse_known_args(self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
                         ) -> tuple[argparse.Namespace, list[str]]:
        ns, extra = super().parse_known_args(args, namespace)
        if extra and self._subparsers is None:  # a leaf command: nothing of it is left for a parent to read
            self.error(f"unrecognized arguments: {' '.join(extra)}")
        return ns, extra


# --- exit statuses -----------------------------------------------------------------------------------------------
# What every command may end with, whatever it does (harness.cli.main.main): bad input, an interrupt, a closed pipe.
COMMON_EXIT = {2: "bad input: one line on stderr naming the problem and the fix, nothing written",
               130: "interrupted (Ctrl-C or SIGTERM)",
               141: "its output was closed early (e.g. `| head`)"}


EXIT_HEADER = "exit status:"


def exit_statuses(p: argparse.ArgumentParser, statuses: dict[int, str]) -> None:
    """An "exit status" section at the end of `p`'s --help: `statuses` (the command's own), then COMMON_EXIT's."""
    codes = {**statuses, **{k: v for k, v in COMMON_EXIT.items() if k not in statuses}}
    p.epilog = EXIT_HEADER + "\n" + "\n".join(f"  {code:<4} {text}" for code, text in sorted(codes.items()))


def shared(sentence: str, detail: str | None = None) -> str:
    """The help of an option many commands share: its one sentence (the same in every command; the vocabulary
    test checks it), then "; " and what this command adds (its default, what it applies to)."""
    return f"{sentence}; {detail}" if detail else sentence


# --- the backends named in the help, from their declarations (harness.backends.declaration) --------------------
def _declared() -> dict:
    from harness.backends import declarations

    return declarations()


def _taking(what: str) -> str:
    from harness.backends import taking

    return listing(taking(what, list(_declared())))


def _dtype_defaults() -> str:
    """"torch and jax float32, numpy float64": the default dtype of each backend that offers a choice."""
    by_default: dict[str, list[str]] = {}
    for name, d in _declared().items():
        if len(d.dtypes) > 1:
            by_default.setdefault(d.default_dtype, []).append(name)
    return ", ".join(f"{listing(names)} {dtype}" for dtype, names in by_default.items())


def _both_needs() -> str:
    from harness.backends import declaration

    needs = [f"{name} needs {d.needs}: {d.install}" for name in BOTH[1:] for d in [declaration(name)] if d.install]
    return f" ({'; '.join(needs)})" if needs else ""


def _fill_facts(text: str, escape: bool = False) -> str:
    """`text` with each placeholder of BACKEND_FACTS (`%(backends)s`, ...) replaced by its fact (with `escape`, a
    "%" of the fact doubled, for argparse's own %-formatting of an option's help)."""
    for key, fact in BACKEND_FACTS.items():
        if f"%({key})s" in text:
            value = fact()
            text = text.replace(f"%({key})s", value.replace("%", "%%") if escape else value)
    return text


BACKEND_FACTS = {
    "backends": lambda: ", ".join(_declared()),
    "dtype_defaults": _dtype_defaults,
    "precision_backends": lambda: _taking("precision"),
    "compile_backends": lambda: _taking("compile"),
    "cuda_graphs_backends": lambda: _taking("cuda_graphs"),
    "own_process_backends": lambda: listing([n for n, d in _declared().items() if d.own_process] or ["none"]),
    "both_needs": _both_needs,
}


# one sentence per shared option: its meaning, the same in every command
BACKEND_HELP = "backends: %(backends)s, or all (every backend that can run here), repeated or comma-separated"
SIZE_HELP = f"size preset: {', '.join(PRESETS)}"
SIZE_ALL = f"all = {', '.join(SIZES)}"  # what a command that takes several sizes adds
CONFIG_HELP = ("a TOML config of your own instead of a preset (see `harness sizes --toml small`), or a nanoGPT "
               "config .py (read, never run: docs/nanogpt.md)")
SET_HELP = ("override one config value (repeatable): a field (tie_embeddings=true, gelu=exact, lr_schedule=cosine, "
            "...) or nanoGPT's name (max_iters=2000, lr_decay_iters=2000, ...)")
DATA_HELP = ("UTF-8 text to train on, or `sample`: the harness's own sample text, made offline (default: "
             "$HARNESS_DATA, else Tiny Shakespeare, downloaded once into the user cache)")
DEVICE_HELP = (f"cpu or cuda for every backend, or NAME=DEVICE for one backend (repeatable), e.g. --device "
               f"{DEFAULT_BACKEND}=cuda: {DEFAULT_BACKEND} on the GPU, the others on the CPU")
SEED_HELP = "seed of the weights, batches, dropout masks and sampling, 0 to 2**32-1"
DTYPE_HELP = "floating type: float32 or float64"
DTYPE_DETAIL = "where the backend supports a choice (default: %(dtype_defaults)s)"
PRECISION_HELP = "matmul precision on a CUDA GPU of compute capability 8.0+"
COMPILE_HELP = ("%(compile_backends)s: torch.compile the model with mode MODE: default (`--compile` alone), "
                "reduce-overhead (its CUDA graphs, CUDA only) or max-autotune (compiled before step 0, recorded as "
                "compile_s)")
CUDA_GRAPHS_HELP = ("%(cuda_graphs_backends)s on CUDA: capture the whole training step (forward, backward, clipping, "
                    "AdamW) once as a CUDA graph and replay it, one launch per step (captured before step 0, recorded "
                    "as compile_s)")
THREADS_HELP = "CPU threads per backend process (OMP, OpenBLAS, MKL, Julia, XLA)"
STEPS_HELP = "train exactly N steps"
EPOCHS_HELP = "train N epochs (preset: 20)"
OUT_HELP = "the output directory"
QUIET_HELP = "no progress bars or progress lines on stderr"
JSON_HELP = ("print the result as one JSON object on stdout, and nothing else there (what people read goes to "
             "stderr; docs/usage.md, \"Scripting\")")
NO_REPORT_HELP = "no HTML report, records only"
NO_TEXT_HELP = "skip generation, BLEU and chrF"
ALLOW_LARGE_HELP = "go on even when the memory estimate exceeds the machine's available memory"
DROPOUT_HELP = "dropout probability"
PER_PARAMETER_HELP = "also print every parameter's gradient and optimizer-step error"
CHECKPOINT_HELP = "save model and optimizer state every N steps"
EVAL_HELP = "evaluate every N steps"
JOBS_HELP = "N cells at once on this machine (the local executor; their timings then contend)"
NO_WAIT_HELP = "slurm: submit and return; follow with `harness status SWEEP_ID`"
CHECK_HELP = "exit 1 on a miss"
SEEDS_HELP = "a count N: the N seeds from 1337"
PAIRED_HELP = ("with two or more backends: time them side by side after training, all alive at once, in alternating "
               "short bursts, until N undisturbed rounds are in (default 10; 0: no paired timing, and then no speed "
               "verdict)")


@dataclass(frozen=True)
class Word:
    """One option of the shared vocabulary: the sentence its help starts with in every command (what a command
    adds follows "; "), its choices (None: any value), and whether it is a flag (takes no value)."""

    sentence: str
    choices: tuple[str, ...] | None = None
    flag: bool = False


def _vocabulary() -> dict[str, Word]:
    from harness.backends.declaration import COMPILE_MODES

    return {
        "--backend": Word(BACKEND_HELP), "--size": Word(SIZE_HELP), "--config": Word(CONFIG_HELP),
        "--set": Word(SET_HELP), "--data": Word(DATA_HELP), "--device": Word(DEVICE_HELP), "--seed": Word(SEED_HELP),
        "--dtype": Word(DTYPE_HELP, DTYPES), "--precision": Word(PRECISION_HELP, PRECISIONS),
        "--compile": Word(COMPILE_HELP, COMPILE_MODES), "--cuda-graphs": Word(CUDA_GRAPHS_HELP, flag=True),
        "--threads": Word(THREADS_HELP), "--steps": Word(STEPS_HELP), "--epochs": Word(EPOCHS_HELP),
        "--eval-interval": Word(EVAL_HELP), "--out": Word(OUT_HELP), "--dropout": Word(DROPOUT_HELP),
        "--checkpoint-every": Word(CHECKPOINT_HELP), "--paired-rounds": Word(PAIRED_HELP),
        "--jobs": Word(JOBS_HELP), "--seeds": Word(SEEDS_HELP),
        **{option: Word(sentence, flag=True) for option, sentence in (
            ("--quiet", QUIET_HELP), ("--json", JSON_HELP), ("--no-report", NO_REPORT_HELP),
            ("--no-text", NO_TEXT_HELP), ("--allow-large", ALLOW_LARGE_HELP), ("--per-parameter", PER_PARAMETER_HELP),
            ("--no-wait", NO_WAIT_HELP), ("--check", CHECK_HELP))},
    }


# The shared vocabulary, in one table: every option two or more commands have is here, and in every command it
# starts its help with this sentence, takes these choices and is a flag or not as said (tests/test_cli_vocabulary.py
# walks every parser against it). docs/usage.md, "One vocabulary on the command line", is its table for people.
VOCABULARY: dict[str, Word] = _vocabulary()


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


def add_paired(p: argparse.ArgumentParser | argparse._ArgumentGroup, default: int | None) -> None:
    """--paired-rounds (run, sweep, resume): the paired timing that every speed comparison rests on
    (harness.run.paired_timing)."""
    p.add_argument("--paired-rounds", type=rounds_arg, default=default, metavar="N", help=PAIRED_HELP)


def out_arg(text: str) -> Path:
    """argparse type of --out: a non-empty path (an empty one would silently mean the current directory)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("--out is empty; pass a directory, e.g. --out reports")
    return Path(text)


def add_out(p: argparse.ArgumentParser | argparse._ArgumentGroup, detail: str = "default reports/; nothing is "
            "written outside it", **kwargs: object) -> None:
    """--out DIR: the output directory (reports/ unless the command says otherwise in `detail`)."""
    kwargs.setdefault("default", DEFAULT_OUT)
    p.add_argument("--out", type=out_arg, metavar="DIR", help=shared(OUT_HELP, detail), **kwargs)  # type: ignore[arg-type]


def add_device(p: argparse.ArgumentParser | argparse._ArgumentGroup, detail: str = "default cpu") -> None:
    """--device DEVICE|NAME=DEVICE (repeatable): parsed by `parse_devices` once the backends are known."""
    p.add_argument("--device", action="append", metavar="DEVICE|NAME=DEVICE", help=shared(DEVICE_HELP, detail))


def add_seed(p: argparse.ArgumentParser | argparse._ArgumentGroup, detail: str = "default 1337",
             **kwargs: object) -> None:
    kwargs.setdefault("default", 1337)
    p.add_argument("--seed", type=seed_arg, metavar="S", help=shared(SEED_HELP, detail), **kwargs)  # type: ignore[arg-type]


def add_dtype(p: argparse.ArgumentParser | argparse._ArgumentGroup, detail: str = DTYPE_DETAIL,
              **kwargs: object) -> None:
    kwargs.setdefault("choices", DTYPES)
    p.add_argument("--dtype", help=shared(DTYPE_HELP, detail), **kwargs)  # type: ignore[arg-type]


def add_precision(p: argparse.ArgumentParser | argparse._ArgumentGroup, detail: str, **kwargs: object) -> None:
    kwargs.setdefault("choices", PRECISIONS)
    p.add_argument("--precision", help=shared(PRECISION_HELP, detail), **kwargs)  # type: ignore[arg-type]


def add_compile(p: argparse.ArgumentParser | argparse._ArgumentGroup, detail: str | None = None) -> None:
    """--compile [MODE] and --cuda-graphs (run, bench overhead): the torch step's launch-free modes; `--compile`
    alone is mode default, as before modes existed."""
    from harness.backends.declaration import COMPILE_MODES

    p.add_argument("--compile", nargs="?", const="default", choices=COMPILE_MODES, metavar="MODE",
                   help=shared(COMPILE_HELP, detail))
    add_cuda_graphs(p, detail)


def add_cuda_graphs(p: argparse.ArgumentParser | argparse._ArgumentGroup, detail: str | None = None) -> None:
    p.add_argument("--cuda-graphs", action="store_true", help=shared(CUDA_GRAPHS_HELP, detail))


def add_threads(p: argparse.ArgumentParser | argparse._ArgumentGroup,
                detail: str = "default: the frameworks' own choice", **kwargs: object) -> None:
    """--threads N: the CPU threads of each backend process, capped through its environment
    (harness.run.processes.thread_env), in every command."""
    kwargs.setdefault("type", positive_int)
    p.add_argument("--threads", metavar="N", help=shared(THREADS_HELP, detail), **kwargs)  # type: ignore[arg-type]


def add_common(p: argparse.ArgumentParser, size_detail: str, one_size: bool = False) -> None:
    """Options shared by run and parity: what to train on what data, on which device, and where to write."""
    add_size(p, size_detail, one=one_size)
    add_config(p)
    add_set(p)
    add_data(p)
    add_device(p)
    add_seed(p)
    add_out(p)
    add_dtype(p)


# --- the options every command spells the same way ---------------------------------------------------------------
LIST_METAVAR = "NAME[,NAME...]"


def add_backend(p: argparse.ArgumentParser | argparse._ArgumentGroup, detail: str) -> None:
    """--backend (alias --backends): one or more names, repeated or comma-separated; `all` = every backend that can
    run here (see available_backends). Parsed by pick_backends."""
    p.add_argument("--backend", "--backends", dest="backend", action="append", metavar=LIST_METAVAR,
                   help=shared(BACKEND_HELP, detail))


def add_size(p: argparse.ArgumentParser | argparse._ArgumentGroup, detail: str, one: bool = False) -> None:
    """--size (alias --sizes): one or more presets, repeated or comma-separated, or `all`; a command that takes one
    (`one`) shows SIZE and offers no `all`. Parsed by pick_sizes."""
    p.add_argument("--size", "--sizes", dest="size", action="append", metavar="SIZE" if one else "SIZE[,SIZE...]",
                   help=shared(SIZE_HELP, detail if one else f"{detail}; {SIZE_ALL}"))


def add_config(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """--config FILE (run, parity, kit export): a config of one's own instead of a preset; read by `configure`."""
    p.add_argument("--config", metavar="FILE", help=CONFIG_HELP)


def add_set(p: argparse.ArgumentParser | argparse._ArgumentGroup, detail: str | None = None) -> None:
    """--set NAME=VALUE (repeatable): one config value; read by `configure` (harness.config.nanogpt.parse_sets)."""
    p.add_argument("--set", action="append", metavar="NAME=VALUE", help=shared(SET_HELP, detail))


def add_data(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """--data PATH: the text to train on (harness.core.data.load_corpus)."""
    p.add_argument("--data", metavar="PATH", help=DATA_HELP)


def add_quiet(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    p.add_argument("--quiet", action="store_true", help=QUIET_HELP)


def add_json(p: argparse.ArgumentParser | argparse._ArgumentGroup, detail: str | None = None) -> None:
    """--json: the command's result as one JSON object on stdout (`print_json`); its tables go to stderr."""
    p.add_argument("--json", action="store_true", help=shared(JSON_HELP, detail))


def result_stream(args: argparse.Namespace) -> TextIO:
    """Where a command prints its result for people (tables, verdict lines): stdout, or stderr under --json (stdout
    then holds the JSON object alone)."""
    return sys.stderr if getattr(args, "json", False) else sys.stdout


def print_json(command: str, exit_status: int, **result: object) -> None:
    """The result of `command` as one JSON object on stdout: {"command", "exit_status", ...result}, paths as
    strings (the one shape every --json has; docs/usage.md, "Scripting")."""
    import json

    doc = {"command": command, "exit_status": exit_status, **result}
    print(json.dumps(doc, indent=2, default=str, ensure_ascii=False), flush=True)


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
            also = "" if one else f" or all ({', '.join(SIZES)})"
            raise UsageError(f"unknown size {name!r} in {option}; choose from {', '.join(PRESETS)}{also}")
    _once(names, option)
    if one and len(names) != 1:
        raise UsageError(f"{option} {given}: this command takes one size; run it once per size")
    return names


def available_backends(device: str = "cpu") -> tuple[list[str], dict[str, str]]:
    """What `--backend all` means: every backend (shipped, and installed from outside) that can run on `device`
    here without installing anything first (flux only where Julia and Flux are installed), and why each other one
    cannot (a plugin that is refused: the line that says why)."""
    from harness.backends import REGISTRY, BackendUnavailable, PluginRefused, declared, names, options_class, refusals

    ready, missing = [], {}
    for name in names():
        try:
            cls = options_class(name)
            if device not in cls.declaration.devices:
                raise BackendUnavailable(f"{name} backend: it does not run on {device}")
            (cls.check_installed if declared(cls, "check_installed") else cls.check_available)(device)
            ready.append(name)
        except (BackendUnavailable, ImportError, PluginRefused) as exc:
            missing[name] = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        except Exception as exc:  # a backend from outside whose check breaks: left out, saying why
            if name in REGISTRY:
                raise
            missing[name] = f"{name} backend: its check failed ({type(exc).__name__}: {str(exc)[:120]})"
    missing.update({name: why for name, why in refusals().items() if name not in missing and name not in ready})
    return ready, missing


def pick_backends(values: str | list[str] | None, default: tuple[str, ...] = (DEFAULT_BACKEND,),
                  device: str = "cpu", option: str = "--backend", repeats: bool = False) -> list[str]:
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


def add_schedule(p: argparse.ArgumentParser | argparse._ArgumentGroup, detail: str | None = None) -> None:
    """--steps/--epochs (one or the other), --eval-interval: the training schedule (run, sweep; `detail`: what the
    command adds, e.g. "every cell")."""
    g = p.add_mutually_exclusive_group()
    g.add_argument("--steps", type=positive_int, metavar="N", help=shared(STEPS_HELP, detail))
    g.add_argument("--epochs", type=positive_int, metavar="N", help=shared(EPOCHS_HELP, detail))
    p.add_argument("--eval-interval", type=positive_int, metavar="N", help=EVAL_HELP)


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
    """Each backend's constructor options from the command line: --dtype for every one, and --compile,
    --cuda-graphs and --precision for those that declare them (harness.backends.taking)."""
    from harness.backends import taking

    takes = {what: set(taking(what, backends)) for what in ("compile", "cuda_graphs", "precision")}
    opts: dict[str, dict] = {}
    for name in backends:
        o: dict = {}
        if args.dtype:
            o["dtype"] = args.dtype
        if name in takes["compile"] and getattr(args, "compile", None):
            o["compile"] = args.compile  # the mode: default, reduce-overhead or max-autotune
        if name in takes["cuda_graphs"] and getattr(args, "cuda_graphs", False):
            o["cuda_graphs"] = True
        if name in takes["precision"] and getattr(args, "precision", None):
            o["precision"] = args.precision
        opts[name] = o
    return opts


def check_option_targets(args: argparse.Namespace, backends: list[str], what: str = "run") -> None:
    """Options that apply to some backends only (--compile, --cuda-graphs, --precision: those that declare them) must
    apply to one of this command's `backends`, not be ignored."""
    from harness.backends import names, taking

    for option, given, kind in (("--compile", getattr(args, "compile", None), "compile"),
                                ("--cuda-graphs", getattr(args, "cuda_graphs", False), "cuda_graphs"),
                                ("--precision", getattr(args, "precision", None), "precision")):
        if given and not taking(kind, backends):
            takers = taking(kind, names())
            if kind == "precision":
                raise UsageError(f"--precision applies to {listing(takers)} only, and this {what} has "
                                 f"{', '.join(backends)}; drop --precision")
            raise UsageError(f"{option} applies to the {listing(takers)} backend{'s' if len(takers) > 1 else ''} "
                             f"only, and this {what} has {', '.join(backends)}; drop {option} or add --backend "
                             f"{takers[0]}")


DEFAULT_DEVICE = "cpu"


def common_device(values: Sequence[str] | str | None) -> str:
    """The device of every backend not named in `--device NAME=DEVICE` (the plain `--device DEVICE`, else cpu):
    what `--backend all` is resolved on, before the backends are known. Errors are `parse_devices`'s."""
    values = [values] if isinstance(values, str) else list(values or [])
    plain = [d.strip() for v in values for d in str(v).split(",") if "=" not in d]  # a sweep's old `cpu,cuda` too
    return plain[0] if plain and plain[0] in DEVICES else DEFAULT_DEVICE


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
                             f"NAME=DEVICE (e.g. --device {DEFAULT_BACKEND}=cuda)")
        if sep and not name:
            raise UsageError(f"--device {value!r}: no backend name before '='; e.g. --device {DEFAULT_BACKEND}=cuda")
        if not sep:
            if common is not None and common != device:
                raise UsageError(f"--device given twice without a backend name ({common}, {device}); pass one, "
                                 "and NAME=DEVICE for a single backend")
            common = device
            continue
        if name not in backends:
            raise UsageError(f"--device {value!r}: {name!r} is not one of the backends this command runs "
                             f"({', '.join(backends)}); add it to --backend or drop it")
        if name in named and named[name] != device:
            raise UsageError(f"--device names {name} twice ({named[name]}, {device}); name each backend once")
        named[name] = device
    base = common or DEFAULT_DEVICE
    return base, {b: named.get(b, base) for b in backends}


# --- the id of `harness status|report|resume ID`: a run or a sweep ------------------------------------------------
def stored_kind(out: Path, ident: str) -> str:
    """"run" or "sweep": what `ident` names under `out` (`<out>/runs/ID` or `<out>/sweeps/ID`); a UsageError naming
    it when it is empty, names neither, or names both."""
    import os
    import re

    from harness.store import RUN_ID_RE, SWEEP_ID_RE

    if not ident:
        raise UsageError("the id is empty (an unset shell variable?); pass a run id or a sweep id from "
                         f"`ls {Path(out) / 'runs'} {Path(out) / 'sweeps'}`")
    if ".." in ident or not (RUN_ID_RE.match(ident) or re.match(SWEEP_ID_RE, ident)):
        raise UsageError(f"{ident!r} is not a run id or a sweep id (a name from {Path(out) / 'runs'} or "
                         f"{Path(out) / 'sweeps'}, not a path); pass the name only, and --out for where it is")
    found = [kind for kind, folder in (("run", "runs"), ("sweep", "sweeps"))
             if os.path.lexists(Path(out) / folder / ident)]
    if not found:
        raise UsageError(f"no run or sweep {ident!r} under {str(out)!r}; pass an id from "
                         f"`ls {Path(out) / 'runs'} {Path(out) / 'sweeps'}` and the --out it was written under")
    if len(found) == 2:
        raise UsageError(f"{ident!r} names both a run ({Path(out) / 'runs' / ident}) and a sweep "
                         f"({Path(out) / 'sweeps' / ident}); rename one of the two directories")
    return found[0]
