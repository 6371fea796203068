"""`harness kit export` and `harness kit check`: their options and commands.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from harness.cli.options import print_json, result_stream
from harness.errors import UsageError
from harness.files import kind_of
from harness.kit import grade, page
from harness.kit.export import MANIFEST, MAX_STEPS, check_memory, check_out, export_kit
from harness.kit.load import load_kit, load_results, validate
from harness.parity.compare import BLIND_SPOTS
from harness.parity.format import format_gradients, format_optimizer, format_rows

DEFAULT_STEPS = 5


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The `export` and `check` subcommands of `harness kit`."""
    from harness.cli.options import (
        ALLOW_LARGE_HELP,
        DROPOUT_HELP,
        PER_PARAMETER_HELP,
        STEPS_HELP,
        Parser,
        add_config,
        add_data,
        add_dtype,
        add_json,
        add_out,
        add_quiet,
        add_seed,
        add_set,
        add_size,
        exit_statuses,
        positive_int,
        shared,
    )

    exit_statuses(p, {0: "export: the kit is written; check: pass", 1: "check: FAIL, the port differs from the "
                      "oracle (the table and the FAIL lines say where)"})
    sub = p.add_subparsers(dest="kit_command", required=True, metavar="export|check", parser_class=Parser)
    e = sub.add_parser("export", help="write a kit: inputs, the oracle's float64 answers and manifest.json",
                       description="Write a conformance kit into the directory --out names: the inputs (weights, "
                       "batches, masks), the float64 oracle's answers at every depth and manifest.json (written "
                       "last).")
    add_out(e, "the kit's directory, new or empty (required)", default=None, required=True)
    add_size(e, "one: a kit is one size (default small)", one=True)
    add_config(e)
    add_set(e)
    add_data(e)
    add_seed(e)
    e.add_argument("--steps", type=positive_int, default=DEFAULT_STEPS, metavar="N",
                   help=shared(STEPS_HELP, f"each step's losses, parameters and AdamW moments are exported "
                                           f"({DEFAULT_STEPS})"))
    e.add_argument("--dropout", type=float, default=0.0, metavar="P",
                   help=shared(DROPOUT_HELP, "> 0 exports the harness's dropout masks for every step (default 0)"))
    add_quiet(e)
    add_json(e, "the kit's directory, its files and sizes (without it stdout holds the kit's directory)")
    e.add_argument("--allow-large", action="store_true", help=ALLOW_LARGE_HELP)
    exit_statuses(e, {0: "the kit is written"})
    e.set_defaults(kit_func="export")

    c = sub.add_parser("check", help="grade a port's results file against a kit; exit 0 pass, 1 fail, 2 malformed",
                       description="Grade a port's results against a kit, depth by depth; print the table, write "
                       "an HTML page and a JSON verdict.")
    c.add_argument("kit", type=Path, metavar="KIT", help="the kit directory (holds manifest.json)")
    c.add_argument("results", type=Path, metavar="RESULTS", help="the port's results .npz")
    add_dtype(c, "the precision the port computed in (default: the dtype of the results' arrays)")
    add_out(c, "default: RESULTS' folder; RESULTS-name.check.html and .check.json are written there", default=None)
    c.add_argument("--page", type=Path, metavar="PATH", help="the HTML page's exact path (overrides --out)")
    c.add_argument("--verdict", type=Path, metavar="PATH", help="the JSON verdict's exact path (overrides --out)")
    c.add_argument("--per-parameter", action="store_true", help=PER_PARAMETER_HELP)
    add_json(c, "the verdict, its summary and the two files' paths (the table then goes to stderr)")
    exit_statuses(c, {0: "pass: the port agrees with the oracle at every depth it gives", 1: "FAIL: the port "
                      "differs (the first broken depth and its likely cause are printed)", 2: "bad input: a "
                      "malformed kit or results file (one line on stderr, nothing written)"})
    c.set_defaults(kit_func="check")


def command(args: argparse.Namespace) -> int:
    """Run `harness kit export` or `harness kit check`."""
    if args.kit_func == "export":
        return export_command(args)
    if args.kit_func == "check":
        return check_command(args)
    raise UsageError(f"unknown kit command {args.kit_func!r}; use export or check")


def export_command(args: argparse.Namespace) -> int:
    """`harness kit export`: validate, check the memory, compute with the oracle, write the files, then manifest.json
    last."""
    from harness.cli.options import configure, pick_sizes
    from harness.core.data import check_fits, load_corpus

    dropout = args.dropout
    if not isinstance(dropout, float) or not math.isfinite(dropout) or not 0 <= dropout < 1:
        raise UsageError(f"--dropout must be in [0, 1), got {dropout!r}")
    if args.steps > MAX_STEPS:
        raise UsageError(f"--steps {args.steps} is more than {MAX_STEPS}; a kit checks the first few steps "
                         "(5 is plenty), pass fewer")
    check_out(args.out)
    args.size = pick_sizes(args.size, one=True)[0]
    config = configure(args, args.size, changes={"dropout": dropout, "steps": args.steps})
    size = None if args.config or getattr(args, "set", None) else args.size  # measured tolerances: the preset's
    corpus = load_corpus(args.data)
    check_fits(corpus, config.block_size, config.batch_size)
    check_memory(config, corpus, args.seed, args.out, args.steps, getattr(args, "allow_large", False))
    print(f"kit: {config.name}, {args.steps} steps, dropout {dropout:g}, seed {args.seed} -> {args.out}",
          file=sys.stderr)
    blobs = export_kit(config, size, corpus, args.seed, args.steps, args.out,
                       progress=not getattr(args, "quiet", False))
    total = sum(len(b) for b in blobs.values()) + (args.out / MANIFEST).stat().st_size
    for name, blob in blobs.items():
        print(f"  {name}: {len(blob) / 1e6:.2f} MB", file=sys.stderr)
    print(f"kit written: {args.out} ({total / 1e6:.2f} MB); check a port's results with "
          f"`harness kit check {args.out} RESULTS.npz`", file=sys.stderr)
    if args.json:
        print_json("kit export", 0, kit=args.out, manifest=args.out / MANIFEST, bytes=total,
                   files={name: len(blob) for name, blob in blobs.items()})
    else:
        print(args.out, flush=True)
    return 0


def check_command(args: argparse.Namespace) -> int:
    """`harness kit check`: read the kit and the results, grade, write the page and the JSON verdict (both or
    neither), print; 0 pass, 1 fail, 2 malformed kit or results (one line, nothing written)."""
    from harness.store import atomic_write_all, json_bytes

    manifest, kit = load_kit(args.kit)
    results = load_results(args.results, manifest, kit)
    given, dtype, opt_steps = validate(results, kit["expected.npz"], list(manifest["parameters"]), args.dtype)
    folder, html_path, json_path = _check_paths(args, kit)

    checked = grade.check(manifest, kit, results, given, dtype, opt_steps, progress=_resync_progress())
    table = format_rows(checked.rows)
    verdict = grade.verdict(checked, manifest, args.kit, args.results, results)
    if grade.recorded_tolerances_differ(manifest, checked):
        print(f"note: this harness's measured tolerances for {dtype} differ from those recorded in the kit; "
              "this harness's apply (export the kit again to record them)", file=sys.stderr)
    folder.mkdir(parents=True, exist_ok=True)
    html = page.render_html(verdict, checked.rows, table).encode()
    atomic_write_all([(html_path, html), (json_path, json_bytes(verdict))])  # both written first

    out = result_stream(args)
    _print_check(checked, table, getattr(args, "per_parameter", False), out)
    print(f"check page: {html_path}\ncheck verdict: {json_path}", file=out)
    code = 0 if checked.passed else 1
    if args.json:
        print_json("kit check", code, verdict="pass" if checked.passed else "fail", summary=checked.summary,
                   dtype=checked.dtype, page=html_path, verdict_file=json_path, missing=list(checked.missing))
    return code


def _resync_progress(after_s: float = 2.0) -> Callable[[int, int], None]:
    """The progress of the oracle's optimizer steps from the port's states (harness.kit.resync), on stderr once
    they have taken `after_s` seconds: a large kit's steps take minutes, a small one's are not worth a line."""
    import time

    start = time.monotonic()

    def say(k: int, total: int) -> None:
        if time.monotonic() - start >= after_s:
            print(f"  oracle: optimizer step {k}/{total} from the port's state", file=sys.stderr, flush=True)
    return say


def _check_paths(args: argparse.Namespace, kit: dict) -> tuple[Path, Path, Path]:
    """(the folder, the page's path, the verdict's path) of `kit check`, from --out, --page and --verdict; UsageError
    for a path that is no file, in no directory, an input, or both the same."""
    from harness.store import check_writable

    folder = args.out if getattr(args, "out", None) is not None else args.results.parent
    html_path = args.page or folder / args.results.with_suffix(".check.html").name
    json_path = args.verdict or folder / args.results.with_suffix(".check.json").name
    if getattr(args, "out", None) is not None:
        check_writable(args.out)  # created below, once the inputs are known to be good
    inputs = (args.results.resolve(), *(args.kit.resolve() / n for n in (*kit, MANIFEST)))
    for option, p, default in (("--page", html_path, ".check.html"), ("--verdict", json_path, ".check.json")):
        if os.path.lexists(p) and not os.path.isfile(p):
            what = kind_of(os.stat(p).st_mode) if os.path.exists(p) else "a dangling symlink"
            raise UsageError(f"{option} {str(p)!r} is {what}, not a file; pass the path of the file to write, e.g. "
                             f"{option} {str(p / args.results.with_suffix(default).name)!r}")
        if p.parent != folder and not p.resolve().parent.is_dir():
            raise UsageError(f"cannot write {str(p)!r}: its directory does not exist; create it or pass another path")
        if p.resolve() in inputs:
            raise UsageError(f"{str(p)!r} would overwrite an input; pass another --page/--verdict path")
    if html_path.resolve() == json_path.resolve():
        raise UsageError(f"--page and --verdict are the same file {str(html_path)!r}; pass two paths")
    return folder, html_path, json_path


def _print_check(checked: grade.Check, table: str, per_parameter: bool, out: TextIO) -> None:
    """The table (with `per_parameter`, every parameter's errors too), the FAIL lines and notes, what broke first and
    why, what the depths given cannot see when some are missing, and the verdict; into `out`."""
    result = checked.result
    print(table, file=out)
    if per_parameter:
        if "gradients" in checked.given:
            print(file=out)
            print(format_gradients(result), file=out)
        if "optimizer" in checked.given:
            print(file=out)
            print(format_optimizer(result), file=out)
    for line in result.failures:
        print(line, file=out)
    for line in result.notes:
        print(line, file=out)
    diagnosis = checked.diagnosis
    if diagnosis:
        named = (f", tap {diagnosis['tap']}" if diagnosis.get("tap") else
                 f", parameter {diagnosis['parameter']}" if diagnosis.get("parameter") else "")
        print(f"first broken: {diagnosis['depth']}{named}" + (f" ({diagnosis['detail']})" if diagnosis.get("detail")
                                                               else ""), file=out)
        print(f"likely cause: {diagnosis['cause']}", file=out)
    if checked.missing:
        print(f"not given: {', '.join(checked.missing)} (not checked); what the depths given cannot see:", file=out)
        for d in checked.given:
            print(f"  {d}: {BLIND_SPOTS[d]}", file=out)
    print(f"{'PASS' if checked.passed else 'FAIL'}: {checked.summary} ({checked.dtype} results vs the float64 oracle)",
          file=out)
