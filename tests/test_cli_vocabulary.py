"""One vocabulary on the command line, checked on the parsers themselves (harness.cli.main.build_parser):

- every option and positional of every command has help text;
- no parser accepts abbreviations (a prefix is an error, never silently another option);
- one concept, one spelling: options whose names differ only by case, `_`/`-`, a plural `s` or a known synonym
  (`--output` for `--out`) must be the canonical spelling below, or one of its listed aliases, or be declared a
  different concept in DISTINCT;
- a spelling means the same kind of thing in every command (a flag everywhere, or a value everywhere).

Data-driven: a new option needs only help text; a new spelling that looks like an existing one needs a line here.
"""

from __future__ import annotations

import argparse
import re

import pytest

from harness.cli.main import build_parser
from harness.cli.options import listed, pick_backends, pick_sizes
from harness.config.presets import SIZES

# canonical spelling -> the aliases an option with that spelling may also carry
CANONICAL: dict[str, set[str]] = {"--backend": {"--backends"}, "--size": {"--sizes"}, "--config": {"--configs"}}
# spellings that look like another but name a different concept, and why
DISTINCT: dict[str, str] = {
    "--seeds": "sweep: a count of seeds or the seed axis as a list; --seed is one seed value (repeatable in sweep)",
}
# words that mean the same as a canonical spelling's word
SYNONYMS = {"output": "out", "outdir": "out", "output-dir": "out", "out-dir": "out", "nthreads": "threads",
            "num-threads": "threads", "n-threads": "threads", "num-steps": "steps", "n-steps": "steps",
            "silent": "quiet", "backend-name": "backend", "model-size": "size", "preset": "size"}
# where a shared concept must exist: what a user can rely on in every command that trains or writes
EVERYWHERE = {
    "--backend": ("run", "parity", "bench", "sweep"),
    "--size": ("run", "parity", "bench", "sweep", "kit export"),
    "--out": ("run", "report", "parity", "bench", "sweep", "kit export", "kit check"),
    "--threads": ("run", "parity", "bench", "sweep"),
    "--quiet": ("run", "parity", "bench", "sweep", "kit export"),
    "--steps": ("run", "parity", "bench", "sweep", "kit export"),
    "--data": ("run", "parity", "bench", "sweep", "kit export"),
    "--seed": ("run", "parity", "bench", "sweep", "kit export"),
}


def commands() -> list[tuple[str, argparse.ArgumentParser]]:
    """Every parser of the CLI, named by its command line ("" for `harness` itself, "kit check", ...)."""
    found = []

    def walk(name: str, parser: argparse.ArgumentParser) -> None:
        found.append((name, parser))
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub, child in action.choices.items():
                    walk(f"{name} {sub}".strip(), child)

    walk("", build_parser())
    return found


def options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if not isinstance(a, (argparse._HelpAction, argparse._VersionAction,
                                                             argparse._SubParsersAction))]


def key(spelling: str) -> str:
    """What a spelling names, ignoring case, `_` vs `-`, a plural s and synonyms."""
    word = spelling.lstrip("-").lower().replace("_", "-")
    word = SYNONYMS.get(word, word)
    return re.sub(r"(?<=[a-z])s$", "", word) if len(word) > 3 else word


def test_every_parser_refuses_abbreviations():
    for name, parser in commands():
        assert parser.allow_abbrev is False, f"`harness {name}` accepts abbreviations"


def test_every_option_has_help():
    missing = [f"harness {name}: {a.option_strings or a.dest}" for name, parser in commands() for a in options(parser)
               if not a.help or a.help == argparse.SUPPRESS or not a.help.strip()]
    assert missing == [], "give these options help text"


def test_one_spelling_per_concept():
    aliases = {alias: canonical for canonical, names in CANONICAL.items() for alias in names}
    groups: dict[str, set[str]] = {}
    problems = []
    for name, parser in commands():
        for action in options(parser):
            long = [s for s in action.option_strings if s.startswith("--")]
            for spelling in long:
                groups.setdefault(key(spelling), set()).add(spelling)
                if spelling in aliases and aliases[spelling] not in long:
                    problems.append(f"harness {name}: {spelling} without its canonical spelling {aliases[spelling]}")
    for spellings in groups.values():
        plain = spellings - set(DISTINCT)
        canonical = [s for s in plain if s in CANONICAL]
        if len(plain) > 1 and (len(canonical) != 1 or plain - {canonical[0]} - CANONICAL[canonical[0]]):
            problems.append(f"one concept, several spellings: {sorted(plain)} (make one canonical in this test, or "
                            "declare the other a different concept in DISTINCT)")
    assert problems == []


def test_a_spelling_takes_the_same_kind_of_value_everywhere():
    kinds: dict[str, set[str]] = {}
    for _, parser in commands():
        for action in options(parser):
            for spelling in action.option_strings:
                kinds.setdefault(spelling, set()).add("flag" if action.nargs == 0 else "value")
    assert {s: k for s, k in kinds.items() if len(k) > 1} == {}


def test_shared_concepts_exist_in_every_command():
    have = {name: {s for a in options(p) for s in a.option_strings} for name, p in commands()}
    missing = [f"harness {cmd} has no {spelling}" for spelling, cmds in EVERYWHERE.items() for cmd in cmds
               if spelling not in have[cmd]]
    assert missing == []


def test_threads_help_says_its_default():
    """--threads defaults differ (parity pins 1 thread for bit-identical reruns); each help says its default."""
    for name, parser in commands():
        for action in options(parser):
            if "--threads" in action.option_strings:
                assert "default" in action.help, f"harness {name} --threads: say what the default is"


@pytest.mark.parametrize("command", ["run", "parity", "bench", "sweep"])
def test_backend_and_size_take_lists_repeats_and_plurals(command):
    parser = build_parser()
    a = parser.parse_args([command, "--backend", "torch,numpy", "--size", "small"])
    b = parser.parse_args([command, "--backends", "torch", "--backend", "numpy", "--sizes", "small"])
    assert listed(a.backend, "--backend") == listed(b.backend, "--backend") == ["torch", "numpy"]
    assert listed(a.size, "--size") == listed(b.size, "--size") == ["small"]


def test_all_and_lists():
    assert pick_sizes(["all"]) == list(SIZES)
    assert pick_sizes(["small,large"]) == ["small", "large"]
    assert pick_sizes(None, default=("small", "medium")) == ["small", "medium"]
    names = pick_backends(["all"])  # every backend that runs here: torch and numpy at least (flux needs Julia)
    assert {"torch", "numpy"} <= set(names)


def test_a_prefix_is_an_error(capsys):
    with pytest.raises(SystemExit) as exc:  # parsed only: were the prefix accepted, nothing would start training
        build_parser().parse_args(["run", "--thread", "1"])
    assert exc.value.code == 2 and "unrecognized arguments: --thread" in capsys.readouterr().err


def test_size_help_names_every_size_the_command_takes():
    """A command's --size help lists what pick_sizes accepts: the nanoGPT recipes too, wherever it takes presets."""
    from harness.config.presets import PRESETS

    for name, parser in commands():
        for action in options(parser):
            if "--size" in action.option_strings:
                missing = [p for p in PRESETS if p not in action.help]
                assert missing == [], f"`harness {name} --size` help leaves out {missing}: {action.help}"
