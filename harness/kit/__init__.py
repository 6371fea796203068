"""`harness kit`: a conformance kit that checks anyone's nanoGPT port, in any language, against the oracle.

`harness kit export` writes the exact inputs (canonical initial weights, the batches, the dropout masks) and the
float64 NumPy oracle's answers (step-0 logits and gradients, parameters and AdamW moments after each step, the
per-step losses) as NPZ files with a schema-versioned manifest.json. A port reads them, runs, and writes a results
NPZ with the documented names; `harness kit check` grades it with the same comparison code and measured tolerances
as `harness parity` (harness.parity.compare and default_tolerances). docs/kit.md.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from harness.errors import UsageError

DEFAULT_STEPS = 5


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The `export` and `check` subcommands of `harness kit`."""
    from harness.config import PRESETS, seed_arg
    from harness.options import Parser, add_config, add_data, add_quiet, add_set, add_size, out_arg, positive_int

    sub = p.add_subparsers(dest="kit_command", required=True, metavar="export|check", parser_class=Parser)
    e = sub.add_parser("export", help="write a kit: inputs, the oracle's float64 answers and manifest.json")
    add_size(e, f"the size preset: one of {', '.join(PRESETS)} (default small; a kit is one size)", one=True)
    add_config(e)
    add_set(e)
    add_data(e)
    e.add_argument("--seed", type=seed_arg, default=1337, help="seed of the weights, batches and masks, 0 to "
                   "2**32-1 (1337)")
    e.add_argument("--steps", type=positive_int, default=DEFAULT_STEPS, metavar="N",
                   help=f"training steps whose losses, parameters and AdamW moments are exported ({DEFAULT_STEPS})")
    e.add_argument("--dropout", type=float, default=0.0, metavar="P",
                   help="dropout probability; > 0 exports the harness's dropout masks for every step (default 0)")
    e.add_argument("--out", type=out_arg, required=True, metavar="DIR",
                   help="output directory: a new or empty directory for the kit (required)")
    add_quiet(e)
    e.add_argument("--allow-large", action="store_true", help="export even when the memory estimate exceeds the "
                   "machine's available memory (as `harness run --allow-large`)")
    e.set_defaults(kit_func="export")

    c = sub.add_parser("check", help="grade a port's results file against a kit; exit 0 pass, 1 fail, 2 malformed")
    c.add_argument("kit", type=Path, metavar="KIT", help="the kit directory (holds manifest.json)")
    c.add_argument("results", type=Path, metavar="RESULTS", help="the port's results .npz")
    c.add_argument("--dtype", choices=("float32", "float64"),
                   help="the precision the port computed in (default: the dtype of the results' arrays)")
    c.add_argument("--out", type=out_arg, metavar="DIR",
                   help="output directory for RESULTS-name.check.html and .check.json (default: RESULTS' folder)")
    c.add_argument("--html", type=Path, metavar="PATH", help="the HTML page's exact path (overrides --out)")
    c.add_argument("--json", type=Path, metavar="PATH", help="the JSON verdict's exact path (overrides --out)")
    c.add_argument("--per-parameter", action="store_true", help="also print every parameter's gradient error")
    c.set_defaults(kit_func="check")


def command(args: argparse.Namespace) -> int:
    """Run `harness kit export` or `harness kit check`."""
    if args.kit_func == "export":
        from harness.kit.export import command as export_command

        return export_command(args)
    if args.kit_func == "check":
        from harness.kit.check import command as check_command

        return check_command(args)
    raise UsageError(f"unknown kit command {args.kit_func!r}; use export or check")
