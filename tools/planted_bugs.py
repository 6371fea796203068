#!/usr/bin/env python3
"""Regenerate docs/parity.md's planted-bug table: every known bug, planted, and what parity says about it.

Three kinds of plant, all from the repository:

- in the NumPy oracle (tests/plants.py, `where` numpy): the planted oracle trains as the reference and torch
  re-synchronises every step from it, exactly as `harness parity --backends torch,numpy` (harness.run.probe.run is the
  worker's code, harness.parity.compare.compare the command's comparison);
- in the torch model or optimizer (tests/plants.py, `where` torch): the same, the oracle unplanted;
- in the outside torch port (examples/kit_torch_port.py --plant, `where` port): a kit is exported, the port run as a
  separate program, and its results graded as `harness kit check` grades them.

For each size and precision pair (torch's or the port's dtype against the float64 oracle) a row says where the bug
is caught first (the depth, and the tap, parameter or step named there) and the likely cause printed.

    python tools/planted_bugs.py --sizes small,medium --dtypes float32,float64 --steps 8 --write docs/parity.md

With --write the table replaces the lines between the markers `<!-- planted-bugs:begin -->` and
`<!-- planted-bugs:end -->`; without it, it is printed. With --plants and/or --port-plants only the rows of those
plants are computed: printed, or with --write put in place of their rows in the table (new ones after the last row of
the same kind and size), the other rows left as they are:

    python tools/planted_bugs.py --plants attn-drop-missing --port-plants attn-drop-missing --write docs/parity.md
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # as `harness parity --threads 1` (its default)

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
import doc_tables  # noqa: E402  (beside this script)

sys.path[:0] = [str(REPO), str(REPO / "tests")]
BEGIN, END = "<!-- planted-bugs:begin -->", "<!-- planted-bugs:end -->"

ATTN = " (attn_dropout)"  # a row whose config has attention dropout too (its taps are taken under the masks)
# (plant, dropout it needs, attention dropout): the masks' bugs need dropout > 0, the attention dropout's the option
PARITY_PLANTS = [
    ("ln-eps", 0.0, False), ("mask-wide", 0.0, False), ("scale-1/D", 0.0, False), ("gelu-exact", 0.0, False),
    ("pos-shift", 0.0, False), ("adam-t-stops", 0.0, False), ("clip-per-param", 0.0, False),
    ("no-decay-emb", 0.0, False), ("masks-off-by-one", 0.2, False), ("dropout-in-step", 0.0, False),
    ("attn-drop-after-v", 0.2, True), ("attn-drop-unscaled", 0.2, True), ("attn-drop-missing", 0.2, True),
    ("masks-transposed", 0.2, False), ("masks-transposed", 0.2, True), ("masks-previous-step", 0.2, False),
    ("masks-previous-step", 0.2, True),
    ("torch-unscaled", 0.0, False), ("torch-gelu-exact", 0.0, False), ("torch-ln-eps", 0.0, False),
    ("torch-attn-drop-after-v", 0.2, True), ("torch-attn-drop-unscaled", 0.2, True),
    ("torch-attn-drop-missing", 0.2, True),
    ("torch-no-bias-correction", 0.0, False), ("torch-decay-on-1-D-parameters", 0.0, False),
    ("torch-clip-at-0.5", 0.0, False), ("torch-eps-1e-6", 0.0, False), ("torch-beta2-0.99", 0.0, False),
    ("torch-coupled-weight-decay", 0.0, False),
]
# (port plant, dropout, attention dropout, depths the port writes)
PORT_PLANTS = [
    ("tied", 0.0, False, None), ("no-lm-bias", 0.0, False, None),
    ("no-lm-bias (taps and logits only)", 0.0, False, "taps,logits"), ("no-decay-emb", 0.0, False, None),
    ("aliased", 0.0, False, None), ("masks-off-by-one", 0.2, False, None), ("float64-file", 0.0, False, None),
    ("dropout-before-proj", 0.2, False, None), ("dropout-on-attn-probs", 0.2, False, None),
    ("attn-drop-after-v", 0.2, True, None), ("attn-drop-unscaled", 0.2, True, None),
    ("attn-drop-missing", 0.2, True, None), ("masks-transposed", 0.2, False, None),
    ("masks-transposed", 0.2, True, None), ("masks-previous-step", 0.2, False, None),
    ("masks-previous-step", 0.2, True, None),
]


def caught(result: object) -> tuple[str, str]:
    """Where a parity result first breaks (depth and what it names) and the likely cause printed there."""
    from harness.parity.optimizer import WRONG_STEP_INPUTS

    r = result
    if r.first_tap:
        return f"taps: `{r.first_tap}`", r.tap_cause or ""
    if any(f.startswith("FAIL: logits") for f in r.failures):
        return "logits", r.logits_cause or "the forward-pass checklist"
    if any(f.startswith("FAIL: gradient with dropout") for f in r.failures):
        named = next((f.split("likely cause: ", 1)[1] for f in r.failures
                      if f.startswith("FAIL: gradient with dropout") and "likely cause: " in f), "")
        return f"dropout gradients: `{r.worst_dropout_grad}`", named
    if any(f.startswith("FAIL: gradient ") for f in r.failures):
        return f"gradients: `{r.first_grad}` first, `{r.worst_grad}` worst", "the backward pass"
    if r.opt_first_bad:
        k, _, name = r.opt_first_bad
        return f"optimizer step {k}: `{name}`", r.opt_cause or ""
    if r.step_loss_first_bad > 0:
        return f"step loss, step {r.step_loss_first_bad}", WRONG_STEP_INPUTS
    if r.loss_first_bad >= 0 and not r.passed:
        return f"loss, step {r.loss_first_bad}", ""
    return "passes", ""


def short(text: str, limit: int = 170) -> str:
    text = " ".join(text.split()).replace("|", "/")
    return text if len(text) <= limit else text[:limit - 1].rstrip() + "…"


def parity_rows(sizes: list[str], dtypes: list[str], steps: int, corpus: object,
                only: list[str] | None = None) -> list[list[str]]:
    """The rows of the numpy and torch plants (`only`: those named), each run as `harness parity` runs it."""
    import plants

    from harness.backends.numpy_backend import NumpyBackend
    from harness.backends.torch_backend import TorchBackend
    from harness.config.load import load_config
    from harness.parity.compare import compare
    from harness.parity.record import step_masks
    from harness.parity.tolerances import default_tolerances, precision_pair
    from harness.run import probe

    rows, references = [], {}
    for size in sizes:
        for name, dropout, attn in PARITY_PLANTS:
            if only is not None and name not in only:
                continue
            where, what, _ = plants.PLANTS[name]
            what += ATTN if attn else ""
            config = load_config(size).replace(dropout=dropout, attn_dropout=attn, steps=steps)
            for dtype in dtypes:
                t0 = time.time()
                if where == "numpy":
                    with plants.planted(name):
                        ref = probe.run(NumpyBackend(), config, corpus, 1337)
                    other = probe.run(TorchBackend(dtype=dtype, parity=True), config, corpus, 1337,
                                      reference=ref[0], reference_name="numpy")
                else:
                    if (size, dropout, attn) not in references:
                        references[size, dropout, attn] = probe.run(NumpyBackend(), config, corpus, 1337)
                    ref = references[size, dropout, attn]
                    with plants.planted(name):
                        other = probe.run(TorchBackend(dtype=dtype, parity=True), config, corpus, 1337,
                                          reference=ref[0], reference_name="numpy")
                tol = default_tolerances(precision_pair(dtype, "float64"), size)
                # config=, as the command passes it: the option and schedule diagnoses need the config
                r = compare(other[0], ref[0], other[1], ref[1], tol, backends=("torch", "numpy"), config=config,
                            masks=step_masks(config, 1337))
                depth, cause = caught(r)
                rows.append([what, where, size, f"{dtype}/float64", depth, short(cause)])
                print(f"{name} {size} {dtype}: {depth} ({time.time() - t0:.0f} s)", file=sys.stderr, flush=True)
    return rows


def port_rows(sizes: list[str], dtypes: list[str], data: str, only: list[str] | None = None) -> list[list[str]]:
    """The rows of the outside port's plants (`only`: those named), each graded as `harness kit check` grades it."""
    rows = []
    port = REPO / "examples" / "kit_torch_port.py"
    with tempfile.TemporaryDirectory() as tmp:
        for size in sizes:
            kits = {}
            for name, dropout, attn, depths in PORT_PLANTS:
                plant = name.split(" ")[0]
                if only is not None and plant not in only:
                    continue
                if (dropout, attn) not in kits:
                    kits[dropout, attn] = Path(tmp) / f"kit-{size}-{dropout}-{attn}"
                    subprocess.run([sys.executable, "-m", "harness.cli", "kit", "export", "--out",
                                    str(kits[dropout, attn]), "--size", size, "--steps", "5", "--dropout",
                                    str(dropout), "--data", data,
                                    *(["--set", "attn_dropout=true"] if attn else [])],
                                   check=True, capture_output=True, env=dict(os.environ, PYTHONPATH=str(REPO)))
                kit = kits[dropout, attn]
                for dtype in dtypes:
                    out = Path(tmp) / f"{size}-{plant}-{dtype}.npz"
                    args = [sys.executable, str(port), str(kit), str(out), "--dtype", dtype, "--plant", plant]
                    args += ["--depths", depths] if depths else []
                    subprocess.run(args, check=True, capture_output=True)
                    proc = subprocess.run([sys.executable, "-m", "harness.cli", "kit", "check", str(kit), str(out)],
                                          capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(REPO)))
                    verdict = json.loads(out.with_suffix(".check.json").read_text())
                    d = verdict["diagnosis"]
                    if proc.returncode == 0:
                        depth = "passes"
                        cause = "what the depths given cannot see: " + verdict["blind_spots"].get("logits", "")
                    else:
                        named = d.get("tap") or d.get("parameter")
                        depth = d["depth"] + (f": `{named}`" if named else "") + (
                            f" ({d['detail'].split(', ')[0]})" if d["depth"] == "optimizer" else "")
                        cause = d["cause"]
                    pair = f"{verdict['dtype']}/float64" if verdict["dtype"] == "float32" else "float64/float64"
                    what = kit_check_plants()[plant] + (" (taps and logits only)" if depths else "") + (
                        ATTN if attn else "")
                    rows.append([what, "port", size, pair, depth, short(cause)])
                    print(f"port {name} {size} {dtype}: {depth}", file=sys.stderr, flush=True)
    return rows


def kit_check_plants() -> dict[str, str]:
    """The port's plants and their descriptions (examples/kit_torch_port.py PLANTS)."""
    import runpy

    return runpy.run_path(str(REPO / "examples" / "kit_torch_port.py"), run_name="plants")["PLANTS"]


HEADER = ["| planted bug | where | size | pair | caught at (first) | likely cause printed |",
          "|---|---|---|---|---|---|"]


def table(rows: list[list[str]], steps: int, sizes: list[str]) -> str:
    head = (f"Generated by `python tools/planted_bugs.py --sizes {','.join(sizes)} --steps {steps} --write "
            "docs/parity.md` (seed 1337; `harness parity` re-synchronising every step for the numpy and torch "
            "plants, `harness kit check` of a 5-step kit for the port's; \"(attn_dropout)\": the config has "
            "attention dropout too, and the taps are taken under the step-0 attention masks). \"Caught at\" is "
            "the first depth that fails, in forward order, and what it names there.\n\n")
    return head + "\n".join([*HEADER, *("| " + " | ".join(r) + " |" for r in rows)]) + "\n"


def merge_rows(text: str, rows: list[list[str]]) -> str:
    """The table `text` (between the markers) with `rows` in place of the rows of the same plant, kind, size and
    pair; a new row goes after the last row of the same kind and size (else at the end)."""
    return doc_tables.merge_rows(text, HEADER[1], rows, key=4, group=slice(1, 3))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="small,medium")
    ap.add_argument("--dtypes", default="float32,float64", help="torch's (and the port's) dtypes")
    ap.add_argument("--steps", type=int, default=8, help="training steps of each parity run (8)")
    ap.add_argument("--only", choices=("parity", "port"), help="one kind of plant only")
    ap.add_argument("--plants", metavar="NAME,...",
                    help="these parity plants only (their rows replaced with --write): "
                         + ", ".join(dict.fromkeys(p for p, *_ in PARITY_PLANTS)))
    ap.add_argument("--port-plants", metavar="NAME,...",
                    help="these port plants only (their rows replaced with --write): "
                         + ", ".join(dict.fromkeys(p.split(" ")[0] for p, *_ in PORT_PLANTS)))
    ap.add_argument("--data", default=os.environ.get("HARNESS_DATA"))
    ap.add_argument("--write", type=Path, metavar="MARKDOWN", help="replace the table between the markers there")
    args = ap.parse_args()

    import torch

    from harness.core.data import load_corpus

    torch.set_num_threads(1)
    corpus = load_corpus(args.data)
    sizes, dtypes = args.sizes.split(","), args.dtypes.split(",")
    only = args.plants.split(",") if args.plants else None
    only_port = args.port_plants.split(",") if args.port_plants else None
    unknown = [n for n in only or [] if n not in {p for p, *_ in PARITY_PLANTS}] + [
        n for n in only_port or [] if n not in {p.split(" ")[0] for p, *_ in PORT_PLANTS}]
    if unknown:
        print(f"--plants/--port-plants: unknown plant(s) {', '.join(unknown)}", file=sys.stderr)
        return 2
    some = only is not None or only_port is not None
    rows = []
    if args.only in (None, "parity") and (only is not None or not some):
        rows += parity_rows(sizes, dtypes, args.steps, corpus, only)
    if args.only in (None, "port") and (only_port is not None or not some):
        rows += port_rows(sizes, dtypes, corpus.path, only_port)
    text = table(rows, args.steps, sizes)
    if args.write is None:
        print(text)
        return 0
    def new(old: str) -> str:
        if not some:
            return text
        head, _, table_text = old.lstrip("\n").partition(HEADER[0])  # the other rows as they are
        return head + merge_rows(HEADER[0] + table_text, rows)

    problem = doc_tables.write_between(args.write, BEGIN, END, new)
    if problem:
        print(problem, file=sys.stderr)
        return 2
    print(f"{args.write}: {len(rows)} rows written")
    return 0


if __name__ == "__main__":
    sys.exit(main())
