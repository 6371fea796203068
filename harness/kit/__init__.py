"""`harness kit`: a conformance kit that checks anyone's nanoGPT port, in any language, against the oracle.

`harness kit export` writes the exact inputs (canonical initial weights, the batches, the dropout masks) and the float64
NumPy oracle's answers (step-0 logits and gradients, parameters and AdamW moments after each step, the per-step losses)
as NPZ files with a schema-versioned manifest.json. A port reads them, runs, and writes a results NPZ with the
documented names; `harness kit check` (harness.cli.kit) grades it with the same comparison code and measured tolerances
as `harness parity` (harness.parity.compare.compare and default_tolerances). docs/kit.md.
"""
