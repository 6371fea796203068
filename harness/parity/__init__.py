"""`harness parity`'s comparison, its diagnoses and its record, each layer importing only those below it:

record.py       the parity run: its plan, parity.json, the exit statuses, the workers' records and probes read back
compare.py      the five depths: `compare` (two probes and two loss curves in, a ParityResult out), BLIND_SPOTS
format.py       the result as text tables
result.py       ParityResult: what `compare` found, its summary rows and its JSON
forward.py      the likely cause of a forward-pass difference (the taps, the logits; dropout's placement)
optimizer.py    the likely cause of an optimizer-step difference (`diagnose_optimizer`, one function per hypothesis)
options.py      the likely cause of a model option or learning-rate schedule done another way
states.py       what a probe holds: arrays under a prefix, the optimizer state and update after step k
tolerances.py   the measured default tolerances per precision pair and size preset, the reference backend
numeric.py      relative errors, "worst first", least-squares factors
"""
