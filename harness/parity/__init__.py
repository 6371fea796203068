"""`harness parity`'s comparison: tolerances, the depth-by-depth comparison and its diagnoses."""
