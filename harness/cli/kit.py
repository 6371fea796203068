"""`harness kit export` and `harness kit check`: their options and commands.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from harness.errors import UsageError
from harness.files import kind_of
from harness.kit import check
from harness.kit.check import (
    DEPTHS,
    diagnose,
    float32_hint,
    format_table,
    grade,
    load_kit,
    load_results,
    table_rows,
    validate,
)
from harness.kit.export import (
    MANIFEST,
    MAX_STEPS,
    _check_out,
    build_manifest,
    compute,
    npz_bytes,
    write_kit,
)

DEFAULT_STEPS = 5


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The `export` and `check` subcommands of `harness kit`."""
    from harness.cli.options import (
        ALLOW_LARGE_HELP,
        DROPOUT_HELP,
        PER_PARAMETER_HELP,
        STEPS_HELP,
        Once,
        Parser,
        add_config,
        add_data,
        add_dtype,
        add_out,
        add_quiet,
        add_seed,
        add_set,
        add_size,
        alias,
        exit_statuses,
        out_arg,
        positive_int,
        shared,
    )

    exit_statuses(p, {0: "export: the kit is written; check: pass", 1: "check: FAIL, the port differs from the "
                      "oracle (the table and the FAIL lines say where)"})
    sub = p.add_subparsers(dest="kit_command", required=True, metavar="export|check", parser_class=Parser)
    e = sub.add_parser("export", help="write a kit: inputs, the oracle's float64 answers and manifest.json",
                       description="Write a conformance kit into KIT_DIR: the inputs (weights, batches, masks), the "
                       "float64 oracle's answers at every depth and manifest.json (written last).")
    e.add_argument("out", nargs="?", type=out_arg, action=Once, metavar="KIT_DIR",
                   help="the kit's directory: new or empty (formerly --out DIR)")
    alias(e, "--out", dest="out", type=out_arg, action=Once, metavar="KIT_DIR")
    e.needs = {"out": "the kit's directory is missing; pass it: harness kit export KIT_DIR"}  # type: ignore[attr-defined]
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
    e.add_argument("--allow-large", action="store_true", help=ALLOW_LARGE_HELP)
    exit_statuses(e, {0: "the kit is written"})
    e.usage = e.format_usage().removeprefix("usage: ").replace("[KIT_DIR]", "KIT_DIR")  # needed, or its --out
    e.set_defaults(kit_func="export")

    c = sub.add_parser("check", help="grade a port's results file against a kit; exit 0 pass, 1 fail, 2 malformed",
                       description="Grade a port's results against a kit, depth by depth; print the table, write "
                       "an HTML page and a JSON verdict.")
    c.add_argument("kit", type=Path, metavar="KIT", help="the kit directory (holds manifest.json)")
    c.add_argument("results", type=Path, metavar="RESULTS", help="the port's results .npz")
    add_dtype(c, "the precision the port computed in (default: the dtype of the results' arrays)")
    add_out(c, "default: RESULTS' folder; RESULTS-name.check.html and .check.json are written there", default=None)
    c.add_argument("--html", type=Path, metavar="PATH", help="the HTML page's exact path (overrides --out)")
    c.add_argument("--json", type=Path, metavar="PATH", help="the JSON verdict's exact path (overrides --out)")
    c.add_argument("--per-parameter", action="store_true", help=PER_PARAMETER_HELP)
    exit_statuses(c, {0: "pass: the port agrees with the oracle at every depth it gives", 1: "FAIL: the port "
                      "differs (the first broken depth and its likely cause are printed)", 2: "bad input: a "
                      "malformed kit or results file (one line on stderr, nothing written)"})
    c.set_defaults(kit_func="check")


def command(args: argparse.Namespace) -> int:
    """Run `harness kit export` or `harness kit check`."""
    if args.kit_func == "export":
        from harness.cli.kit import export_command

        return export_command(args)
    if args.kit_func == "check":
        from harness.cli.kit import check_command

        return check_command(args)
    raise UsageError(f"unknown kit command {args.kit_func!r}; use export or check")


def export_command(args: argparse.Namespace) -> int:
    """`harness kit export`: validate, compute with the oracle, write the files, then manifest.json last."""
    from harness.cli.options import configure, pick_sizes
    from harness.core.data import check_fits, load_corpus
    from harness.run import plan

    dropout = args.dropout
    if not isinstance(dropout, float) or not math.isfinite(dropout) or not 0 <= dropout < 1:
        raise UsageError(f"--dropout must be in [0, 1), got {dropout!r}")
    if args.steps > MAX_STEPS:
        raise UsageError(f"--steps {args.steps} is more than {MAX_STEPS}; a kit checks the first few steps "
                         "(5 is plenty), pass fewer")
    _check_out(args.out)
    args.size = pick_sizes(args.size, one=True)[0]
    config = configure(args, args.size, changes={"dropout": dropout, "steps": args.steps})
    size = None if args.config or getattr(args, "set", None) else args.size  # measured tolerances: the preset's
    corpus = load_corpus(args.data)
    check_fits(corpus, config.block_size, config.batch_size)
    # the memory preflight of `harness run` and `harness parity`, before anything is computed: the oracle is one
    # float64 NumPy worker, and the parameters and AdamW moments after each of the --steps steps are kept (in the
    # arrays and again in their NPZ bytes), as a parity probe keeps them for its optimizer steps
    plan.check_memory(plan.Plan(config=config, corpus=corpus, backends=["numpy"], seed=args.seed, out=args.out,
                                    backend_options={"numpy": {"dtype": "float64"}},
                                    parity={"opt_steps": args.steps}, probe_fix="export fewer steps (--steps N)",
                                    allow_large=getattr(args, "allow_large", False)))
    print(f"kit: {config.name}, {args.steps} steps, dropout {dropout:g}, seed {args.seed} -> {args.out}",
          file=sys.stderr)
    files, _ = compute(config, corpus, args.seed, args.steps, progress=not getattr(args, "quiet", False))
    blobs = {name: npz_bytes(arrays) for name, arrays in files.items()}
    manifest = build_manifest(config, size, corpus, args.seed, args.steps, files, blobs)
    write_kit(args.out, blobs, (json.dumps(manifest, indent=1) + "\n").encode())
    total = sum(len(b) for b in blobs.values()) + (args.out / MANIFEST).stat().st_size
    for name, blob in blobs.items():
        print(f"  {name}: {len(blob) / 1e6:.2f} MB", file=sys.stderr)
    print(f"kit written: {args.out} ({total / 1e6:.2f} MB); check a port's results with "
          f"`harness kit check {args.out} RESULTS.npz`")
    return 0


def check_command(args: argparse.Namespace) -> int:
    """`harness kit check`: 0 pass, 1 fail, 2 malformed kit or results (one line, nothing written)."""
    from harness.parity import diagnose as parity_diagnose
    from harness.run import records

    manifest, kit = load_kit(args.kit)
    expected = kit["expected.npz"]
    params = list(manifest["parameters"])
    steps = int(manifest["steps"])
    results = load_results(args.results, manifest, kit)
    given, dtype, opt_steps = validate(results, expected, params, args.dtype)
    folder = args.out if getattr(args, "out", None) is not None else args.results.parent
    html_path = args.html or folder / args.results.with_suffix(".check.html").name
    json_path = args.json or folder / args.results.with_suffix(".check.json").name
    if getattr(args, "out", None) is not None:
        records.check_writable(args.out)  # created below, once the inputs are known to be good
    inputs = (args.results.resolve(), *(args.kit.resolve() / n for n in (*kit, MANIFEST)))
    for option, p, default in (("--html", html_path, ".check.html"), ("--json", json_path, ".check.json")):
        if os.path.lexists(p) and not os.path.isfile(p):
            what = kind_of(os.stat(p).st_mode) if os.path.exists(p) else "a dangling symlink"
            raise UsageError(f"{option} {str(p)!r} is {what}, not a file; pass the path of the file to write, e.g. "
                             f"{option} {str(p / args.results.with_suffix(default).name)!r}")
        if p.parent != folder and not p.resolve().parent.is_dir():
            raise UsageError(f"cannot write {str(p)!r}: its directory does not exist; create it or pass another path")
        if p.resolve() in inputs:
            raise UsageError(f"{str(p)!r} would overwrite an input; pass another --html/--json path")
    if html_path.resolve() == json_path.resolve():
        raise UsageError(f"--html and --json are the same file {str(html_path)!r}; pass two paths")

    result, tol = grade(manifest, kit, results, dtype, opt_steps)
    rows = table_rows(result, given)
    table = format_table(rows)
    diagnosis = diagnose(result, rows, params)
    hint = None if result.passed else float32_hint(manifest, kit, results, dtype, opt_steps)
    if hint and diagnosis:
        diagnosis["cause"] = hint
    offered = [d for d in DEPTHS if d != "learning_rate"  # read from the optimizer states, not an array a port gives
               and (d != "dropout_gradients" or any(k.startswith("dropout_grad/") for k in expected))]
    missing = [d for d in offered if d not in given]
    passed = result.passed
    where = ""
    if diagnosis:
        where = f", first at {diagnosis['depth']}" + (f" ({diagnosis['tap']})" if diagnosis.get("tap") else
                                                      f" ({diagnosis['parameter']})" if diagnosis.get("parameter")
                                                      else "")
    summary = (f"the port agrees with the oracle at {', '.join(given)}" if passed
               else f"the port differs from the oracle{where}")
    first_line = _first_broken_line(result, diagnosis)
    cfg = manifest["config"]
    verdict: dict[str, Any] = {
        "schema": "nanogpt-parity/kit-check", "schema_version": 1,
        "verdict": "pass" if passed else "fail", "summary": summary,
        "kit": str(args.kit), "results_file": str(args.results), "config_name": cfg.get("name"),
        "size": manifest.get("size"), "steps": steps, "seed": manifest.get("seed"), "dropout": cfg.get("dropout"),
        "dtype": dtype, "precision_pair": f"{dtype}/float64" if dtype == "float32" else "float64/float64",
        "tolerances": asdict(tol), "depths_given": given, "depths_not_given": missing,
        "optimizer_steps_given": opt_steps, "loss_steps_given": len(results["loss"]) if "loss" in results else 0,
        "failures": list(result.failures), "other_failures": [f for f in result.failures if f != first_line],
        "diagnosis": diagnosis, "hint": hint, "notes": list(result.notes),
        "blind_spots": {d: parity_diagnose.BLIND_SPOTS[d] for d in given if d in parity_diagnose.BLIND_SPOTS},
        "results": result.to_dict(),
    }
    for depth, key in (("taps", "taps"), ("logits", "logits"), ("gradients", "gradients"),
                       ("dropout_gradients", "dropout_gradients"), ("optimizer", "optimizer"), ("loss", "loss")):
        if depth not in given and key in verdict["results"]:
            verdict["results"][key] = None  # the oracle compared with itself: nothing measured
    recorded = (manifest.get("tolerances") or {}).get(dtype)
    if recorded is not None and recorded != asdict(tol):
        print(f"note: this harness's measured tolerances for {dtype} differ from those recorded in the kit; "
              "this harness's apply (export the kit again to record them)", file=sys.stderr)
    folder.mkdir(parents=True, exist_ok=True)
    page = check.render_html(verdict, rows, table).encode()
    records.atomic_write_all([(html_path, page), (json_path, records.json_bytes(verdict))])  # both written first

    print(table)
    if getattr(args, "per_parameter", False):
        from harness.parity.compare import format_gradients, format_optimizer

        if "gradients" in given:
            print()
            print(format_gradients(result))
        if "optimizer" in given:
            print()
            print(format_optimizer(result))
    for line in result.failures:
        print(line)
    for line in result.notes:
        print(line)
    if diagnosis:
        named = (f", tap {diagnosis['tap']}" if diagnosis.get("tap") else
                 f", parameter {diagnosis['parameter']}" if diagnosis.get("parameter") else "")
        print(f"first broken: {diagnosis['depth']}{named}" + (f" ({diagnosis['detail']})" if diagnosis.get("detail")
                                                               else ""))
        print(f"likely cause: {diagnosis['cause']}")
    if missing:
        print(f"not given: {', '.join(missing)} (not checked); what the depths given cannot see:")
        for d in given:
            print(f"  {d}: {parity_diagnose.BLIND_SPOTS[d]}")
    print(f"{'PASS' if passed else 'FAIL'}: {summary} ({dtype} results vs the float64 oracle)")
    print(f"check page: {html_path}\ncheck verdict: {json_path}")
    return 0 if passed else 1


def _first_broken_line(result: Any, diagnosis: dict[str, Any] | None) -> str | None:
    """The FAIL line that states the first broken depth (shown once on the page, as "First broken")."""
    if not diagnosis:
        return None
    prefix = {"taps": "FAIL: forward:", "logits": "FAIL: logits", "gradients": "FAIL: gradient ",
              "dropout_gradients": "FAIL: gradient with dropout", "optimizer": "FAIL: optimizer step",
              "loss": "FAIL: training loss"}.get(diagnosis["depth"], "")
    return next((f for f in result.failures if prefix and f.startswith(prefix)), None)
