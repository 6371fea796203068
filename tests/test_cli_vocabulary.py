"""One vocabulary on the command line, checked on the parsers themselves (harness.cli.main.build_parser):

- every option and positional of every command has help text (a hidden alias has none: see below);
- no parser accepts abbreviations (a prefix is an error, never silently another option);
- one concept, one spelling: options whose names differ only by case, `_`/`-`, a plural `s` or a known synonym
  (`--output` for `--out`) must be the canonical spelling below, or one of its listed aliases, or be declared a
  different concept in DISTINCT;
- one spelling, one meaning: a spelling is a flag everywhere or a value everywhere, and its help starts with the same
  sentence in every command (up to the first "; ", where the command's own details begin; the command's noun aside);
- every command's and subcommand's help has an "exit status" section, listing at least the statuses its code returns;
- every old spelling (a hidden alias, help=SUPPRESS) is parsed to its new spelling's dest, or is an old flag for a
  verb (VERB_ALIASES), which still reaches that verb.

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
    "--backend": ("run", "parity", "bench overhead", "bench noise", "bench parts", "sweep"),
    "--size": ("run", "parity", "bench overhead", "bench noise", "bench parts", "sweep", "kit export"),
    "--out": ("run", "status", "report", "resume", "parity", "bench overhead", "bench noise", "bench parts", "sweep",
              "kit check"),
    "--threads": ("run", "resume", "parity", "bench overhead", "bench noise", "bench parts", "sweep"),
    "--quiet": ("run", "resume", "parity", "bench overhead", "bench noise", "bench parts", "sweep", "kit export"),
    "--steps": ("run", "parity", "bench noise", "sweep", "kit export"),
    "--device": ("run", "parity", "bench overhead", "bench parts", "sweep"),
    "--set": ("run", "parity", "bench parts", "sweep", "kit export"),
    "--data": ("run", "parity", "bench overhead", "bench noise", "bench parts", "sweep", "kit export"),
    "--seed": ("run", "parity", "bench overhead", "bench parts", "sweep", "kit export"),
}
# the exit statuses each command's code can end with (read from the code: its returns, and harness.cli.main's 2, 130
# and 141 for every command); its --help must list each
EXIT = {"": {0, 1, 2, 3, 130, 141}, "run": {0, 1, 2, 130, 141}, "parity": {0, 1, 2, 3, 130, 141},
        "sweep": {0, 1, 2, 130, 141}, "status": {0, 2, 130, 141}, "report": {0, 2, 130, 141},
        "resume": {0, 1, 2, 130, 141}, "bench": {0, 1, 2, 130, 141}, "bench overhead": {0, 1, 2, 130, 141},
        "bench noise": {0, 1, 2, 130, 141}, "bench parts": {0, 1, 2, 130, 141}, "kit": {0, 1, 2, 130, 141},
        "kit export": {0, 2, 130, 141},
        "kit check": {0, 1, 2, 130, 141}, "sizes": {0, 2, 130, 141}, "doctor": {0, 130, 141},
        "setup": {0, 2, 130, 141}}
# old flags that became verbs (or subcommands): (command, spelling) -> the new spelling
VERB_ALIASES = {("run", "--resume"): "harness resume RUN_ID", ("sweep", "--status"): "harness status SWEEP_ID",
                ("sweep", "--resume"): "harness resume SWEEP_ID", ("sweep", "--report"): "harness report SWEEP_ID"}
# a value for each hidden alias's dest, to parse the old and the new spelling with
ALIAS_VALUES = {"timed_steps": "3", "seeds": "2", "steps": "7", "run_steps": "9", "out": "some-dir"}
# words that name the command itself in a help sentence ("every cell", "the run"): the same sentence otherwise
NOUNS = re.compile(r"\b(runs?|sweeps?|cells?|kits?|checks?|benchmarks?|legs?)\b")


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


def options(parser: argparse.ArgumentParser, hidden: bool = False) -> list[argparse.Action]:
    """The options and positionals of `parser` shown in its help (or, with `hidden`, its hidden aliases only)."""
    return [a for a in parser._actions if not isinstance(a, (argparse._HelpAction, argparse._VersionAction,
                                                             argparse._SubParsersAction))
            and (a.help == argparse.SUPPRESS) == hidden]


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


@pytest.mark.parametrize("command", ["run", "parity", "bench", "bench overhead", "bench noise", "sweep"])
def test_backend_and_size_take_lists_repeats_and_plurals(command):
    parser = build_parser()
    a = parser.parse_args([*command.split(), "--backend", "torch,numpy", "--size", "small"])
    b = parser.parse_args([*command.split(), "--backends", "torch", "--backend", "numpy", "--sizes", "small"])
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


def first_clause(help_text: str) -> str:
    """The sentence a shared option's help starts with (harness.cli.options.shared), the command's noun aside."""
    return NOUNS.sub("NOUN", help_text.split("; ")[0])


def test_one_help_sentence_per_option():
    """An option name means one thing: its help starts with the same sentence in every command that has it."""
    sentences: dict[str, dict[str, list[str]]] = {}
    for name, parser in commands():
        for action in options(parser):
            for spelling in (s for s in action.option_strings if s.startswith("--")):
                sentences.setdefault(spelling, {}).setdefault(first_clause(action.help), []).append(name)
    differ = {spelling: found for spelling, found in sentences.items() if len(found) > 1}
    assert differ == {}, "say these options' meaning in one sentence (harness.cli.options.shared)"


def test_the_noun_aside_is_all_that_may_differ():
    """The check above can fail: two meanings of one spelling are two sentences."""
    assert first_clause("train exactly N steps; every cell") == first_clause("train exactly N steps")
    assert first_clause("the run's output directory") == first_clause("the sweep's output directory")
    assert first_clause("timed steps of each repeat") != first_clause("train exactly N steps")


def test_every_help_has_an_exit_status_section():
    from harness.cli.options import EXIT_HEADER

    found = {}
    for name, parser in commands():
        text = parser.format_help()
        assert EXIT_HEADER in text, f"`harness {name} --help` has no exit status section"
        section = text[text.index(EXIT_HEADER):]
        found[name] = {int(m) for m in re.findall(r"^ {2}(\d+) ", section, flags=re.M)}
    assert set(found) == set(EXIT), "a command was added or removed: list its exit statuses in EXIT"
    missing = {name: EXIT[name] - codes for name, codes in found.items() if EXIT[name] - codes}
    assert missing == {}, "these commands' --help leaves out statuses their code returns"


def test_every_hidden_alias_is_parsed_to_the_new_dest():
    """Each old spelling (help=SUPPRESS) stores where its new spelling does, and parses to the same value; an old
    flag of a verb still reaches that verb's dest."""
    checked = set()
    parser = build_parser()
    for name, sub in commands():
        visible = {a.dest: a for a in options(sub)}
        for action in options(sub, hidden=True):
            spelling = action.option_strings[0]
            checked.add((name, spelling))
            if (name, spelling) in VERB_ALIASES:
                args = parser.parse_args([*name.split(), spelling, "ID-1"])
                assert getattr(args, action.dest) == "ID-1", f"harness {name} {spelling}"
                continue
            assert action.dest in visible, f"harness {name} {spelling}: no new spelling stores to {action.dest}"
            new = visible[action.dest]
            value = ALIAS_VALUES[action.dest]
            old_args = parser.parse_args([*name.split(), spelling, value])
            new_line = [value] if not new.option_strings else [new.option_strings[0], value]
            new_args = parser.parse_args([*name.split(), *new_line])
            assert getattr(old_args, action.dest) == getattr(new_args, action.dest), f"harness {name} {spelling}"
            assert "formerly " + spelling in new.help, f"harness {name}: say 'formerly {spelling}' in its new help"
    assert set(VERB_ALIASES) <= checked


def test_the_old_subcommand_spellings_of_bench():
    """`harness bench ...` is `harness bench overhead ...`, `harness bench --noise ...` is `harness bench noise ...`."""
    from harness.cli import bench

    parser = build_parser()
    plain = parser.parse_args(["bench", "--size", "small", "--steps", "4"])
    assert plain.func is bench.command and plain.timed_steps == 4 and plain.size == ["small"]
    assert parser.parse_args(["bench"]).func is bench.command
    noise = parser.parse_args(["bench", "--noise", "--size", "small", "--noise-seeds", "2", "--noise-steps", "5"])
    assert noise.func is bench.noise_command and (noise.seeds, noise.steps) == (2, 5)
    assert parser.parse_args(["bench", "noise", "--run-steps", "8"]).run_steps == 8


def test_kit_export_takes_its_directory_once(capsys):
    parser = build_parser()
    assert str(parser.parse_args(["kit", "export", "k"]).out) == "k"
    assert str(parser.parse_args(["kit", "export", "--out", "k"]).out) == "k"  # its old spelling
    for argv in (["kit", "export"], ["kit", "export", "k", "--out", "j"]):
        with pytest.raises(SystemExit) as exc:
            parser.parse_args(argv)
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "KIT_DIR" in err, err


def test_device_is_one_syntax_everywhere():
    """--device takes DEVICE or NAME=DEVICE, repeatable, in every command that runs backends (parse_devices)."""
    from harness.cli.options import parse_devices

    parser = build_parser()
    for command in EVERYWHERE["--device"]:
        args = parser.parse_args([*command.split(), "--device", "cpu", "--device", "torch=cuda"])
        assert args.device == ["cpu", "torch=cuda"], command
        assert parse_devices(args.device, ["torch", "numpy"]) == ("cpu", {"torch": "cuda", "numpy": "cpu"})
