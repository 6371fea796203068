"""`harness kit`: a conformance kit that checks anyone's nanoGPT port, in any language, against the oracle.

`harness kit export` writes the exact inputs (canonical initial weights, the batches, the dropout masks) and the float64
NumPy oracle's answers (step-0 logits and gradients, parameters and AdamW moments after each step, the per-step losses)
as NPZ files with a schema-versioned manifest.json. A port reads them, runs, and writes a results NPZ with the
documented names; `harness kit check` (harness.cli.kit) grades it with the same comparison code and measured tolerances
as `harness parity` (harness.parity.compare.compare and harness.parity.tolerances.tolerances_for), each optimizer step
from the port's own state (resync.py). docs/kit.md.

export.py  the oracle's answers and manifest.json, written into a new kit directory
schema.py  manifest.json's JSON schema, and reading a manifest against it
layout.py  every array's axes, and its layout for column-major frameworks (Flux)
load.py    reading a kit (against its manifest) and a port's results (against the kit), through harness.npz
resync.py  the oracle's optimizer steps taken from the port's states (each step graded from the same state)
grade.py   grading the results with parity's comparison: the rows, the first broken depth, the JSON verdict
page.py    the verdict as one self-contained HTML page
"""
