"""One vocabulary on the command line, checked on the parsers themselves (harness.cli.main.build_parser):

- every option and positional of every command has help text (a hidden alias has none: see below);
- no parser accepts abbreviations (a prefix is an error, never silently another option);
- one concept, one spelling: options whose names differ only by case, `_`/`-`, a plural `s` or a known synonym
  (`--output` for `--out`) must be the canonical spelling below, or one of its listed aliases, or be declared a
  different concept in DISTINCT;
- one spelling, one meaning, from ONE table (harness.cli.options.VOCABULARY): every option two or more commands
  have is in it, and in every command its help starts with the table's sentence (what the command adds follows
  "; "), it takes the table's choices, and it is a flag or takes a value as the table says;
- every command's and subcommand's help has an "exit status" section, listing at least the statuses its code returns;
- nothing is hidden: no option without its line in --help, no old spelling.

Data-driven: a new option needs only help text; a new shared one a line in VOCABULARY; a new spelling that looks like
an existing one a line here.
"""

from __future__ import annotations

import argparse
import re

import pytest

from harness.cli.main import build_parser
from harness.cli.options import VOCABULARY, listed, pick_backends, pick_sizes
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
              "kit export", "kit check"),
    "--json": ("run", "resume", "parity", "sweep", "bench overhead", "bench noise", "bench parts", "kit export",
               "kit check", "status"),
    "--dropout": ("run", "parity", "sweep", "kit export"),
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
        "setup": {0, 2, 130, 141}, "setup julia": {0, 2, 130, 141}}


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
    """The options and positionals of `parser` (but --help, --version and its subcommands)."""
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


def test_every_option_has_help_and_none_is_hidden():
    """No option without its line in --help: no hidden old spellings (release 0.1.0 keeps none)."""
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


@pytest.mark.parametrize("command", ["run", "parity", "bench overhead", "bench noise", "sweep"])
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
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "unrecognized arguments: --thread" in err and "`harness run --help`" in err, err


def test_size_help_names_every_size_the_command_takes():
    """A command's --size help lists what pick_sizes accepts: the nanoGPT recipes too, wherever it takes presets."""
    from harness.config.presets import PRESETS

    for name, parser in commands():
        for action in options(parser):
            if "--size" in action.option_strings:
                missing = [p for p in PRESETS if p not in action.help]
                assert missing == [], f"`harness {name} --size` help leaves out {missing}: {action.help}"


def vocabulary_problems(found: list[tuple[str, argparse.ArgumentParser]]) -> list[str]:
    """Where the options of the parsers `found` depart from harness.cli.options.VOCABULARY: a help that does not
    start with the table's sentence, other choices, a flag for a value or a value for a flag, and an option two or
    more commands have that the table does not list."""
    where: dict[str, set[str]] = {}
    problems = []
    for name, parser in found:
        for action in options(parser):
            for spelling in (s for s in action.option_strings if s.startswith("--")):
                where.setdefault(spelling, set()).add(name)
                word = VOCABULARY.get(spelling)
                if word is None:
                    continue
                text = action.help or ""
                if not (text == word.sentence or text.startswith(word.sentence + "; ")):
                    problems.append(f"harness {name} {spelling}: its help does not start with the vocabulary's "
                                    f"sentence {word.sentence[:50]!r}...")
                choices = tuple(action.choices) if action.choices is not None else None
                if choices != word.choices:
                    problems.append(f"harness {name} {spelling}: choices {choices}, the vocabulary's {word.choices}")
                if (action.nargs == 0) != word.flag:
                    problems.append(f"harness {name} {spelling}: {'a flag' if action.nargs == 0 else 'a value'}, "
                                    f"the vocabulary's {'a flag' if word.flag else 'a value'}")
    aliases = {a for names in CANONICAL.values() for a in names}
    problems += [f"{spelling} is in {sorted(cmds)}: give it its line in VOCABULARY" for spelling, cmds in where.items()
                 if len(cmds) > 1 and spelling not in VOCABULARY and spelling not in aliases]
    return problems


def test_shared_options_match_the_one_vocabulary():
    assert vocabulary_problems(commands()) == []


def test_the_vocabulary_check_can_fail():
    """Planted departures are each found: the check above is real."""
    from harness.cli.options import Parser

    a, b = Parser(prog="harness a"), Parser(prog="harness b")
    a.add_argument("--dtype", choices=("float16",), help="the precision of the floats")
    a.add_argument("--quiet", metavar="LEVEL", help="how quiet")
    for p in (a, b):
        p.add_argument("--verbosity", help="how much to say")
    found = vocabulary_problems([("a", a), ("b", b)])
    assert len(found) == 5, found  # --dtype: sentence and choices; --quiet: sentence and kind; --verbosity unlisted
    assert any("--verbosity" in f and "VOCABULARY" in f for f in found)


def test_size_help_offers_all_only_where_all_is_taken():
    """`--size all` is refused by the commands that take one size (parity, kit export, bench noise): their help
    must not offer it, and those that take several must."""
    from harness.cli.options import SIZE_ALL

    for name, parser in commands():
        for action in options(parser):
            if "--size" in action.option_strings:
                one = action.metavar == "SIZE"
                assert (SIZE_ALL in action.help) != one, f"`harness {name} --size`: {action.help}"
    with pytest.raises(Exception, match="takes one size"):
        pick_sizes(["all"], one=True)
    with pytest.raises(Exception) as exc:
        pick_sizes(["tiny"], one=True)
    assert " or all" not in str(exc.value)


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


@pytest.mark.parametrize("argv", [
    ["bench", "overhead", "--steps", "2"],  # --timed-steps, never a prefix or an old spelling of it
    ["bench", "--size", "small"],  # `harness bench` alone is no command: overhead or noise
    ["bench", "noise", "--noise-seeds", "2"], ["run", "--resume", "X"], ["sweep", "--status", "X"],
    ["sweep", "--resume", "X"], ["sweep", "--report", "X"], ["kit", "export", "k"]])
def test_old_spellings_are_errors(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and len(err.strip().splitlines()) == 1 and err.startswith("harness: error: "), err


def test_kit_export_takes_out_like_every_command(capsys):
    parser = build_parser()
    assert str(parser.parse_args(["kit", "export", "--out", "k"]).out) == "k"
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["kit", "export"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--out" in err and "`harness kit export --help`" in err, err


@pytest.mark.parametrize("argv, command", [(["run", "--thread", "1"], "harness run"),
                                           (["bench", "noise", "--size", "small", "--hog", "2"], "harness bench noise"),
                                           (["kit", "check", "k", "r", "--html", "p"], "harness kit check"),
                                           (["--frobnicate"], "harness")])
def test_a_usage_error_points_to_its_own_command_s_help(argv, command, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(argv)
    err = capsys.readouterr().err
    assert err.startswith("harness: error: ") and err.rstrip().endswith(f"see `{command} --help`"), err


def test_one_error_prefix_for_argparse_and_the_commands(capsys):
    """A usage error caught by argparse and one found by a command start alike."""
    from harness.cli.main import main

    assert main(["run", "--size", "tiny"]) == 2
    assert capsys.readouterr().err.startswith("harness: error: unknown size 'tiny'")
    with pytest.raises(SystemExit):
        main(["run", "--steps", "x"])
    assert capsys.readouterr().err.startswith("harness: error: argument --steps")


def test_setup_julia_has_its_own_help(capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["setup", "julia", "--help"])
    out = capsys.readouterr().out
    assert exc.value.code == 0 and out.startswith("usage: harness setup julia") and "--force" in out, out


def test_the_top_level_help_names_every_backend():
    """From the declarations: every backend, shipped or from outside, in `harness --help`."""
    from harness.backends import declarations

    text = " ".join(build_parser().format_help().split())
    assert all(name in text for name in declarations()), text


def test_sweep_takes_dropout_for_every_cell():
    from harness.cli.sweep import spec_from_args

    spec, _ = spec_from_args(build_parser().parse_args(["sweep", "--dropout", "0.1", "--steps", "3"]))
    assert spec.fields == {"dropout": [0.1]}
    for argv, fragment in ((["--dropout", "0.1", "--set", "dropout=0.2"], "--set dropout= both given"),
                           (["--dropout", "0.1", "--axis", "dropout=0,0.2"], "--dropout and --axis dropout"),
                           (["--set", "learning_rate=0.1,0.2"], "--axis learning_rate=0.1,0.2"),
                           (["--device", "cpu,cuda"], "--axis device=cpu,cuda")):
        with pytest.raises(Exception, match=re.escape(fragment)):
            spec_from_args(build_parser().parse_args(["sweep", *argv]))


def test_device_is_one_syntax_everywhere():
    """--device takes DEVICE or NAME=DEVICE, repeatable, in every command that runs backends (parse_devices)."""
    from harness.cli.options import parse_devices

    parser = build_parser()
    for command in EVERYWHERE["--device"]:
        args = parser.parse_args([*command.split(), "--device", "cpu", "--device", "torch=cuda"])
        assert args.device == ["cpu", "torch=cuda"], command
        assert parse_devices(args.device, ["torch", "numpy"]) == ("cpu", {"torch": "cuda", "numpy": "cpu"})
