#!/usr/bin/env python3
"""The GPU check: everything a GPU has to prove about the harness, in priority order, within a time budget,
resumable, with one summary. `python tools/gpu_check.py --help`; the code is tools/gpucheck/ (its __init__ says
which module does what); docs/benchmarks.md, "The GPU check", says how to run it on a lent GPU."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/: the gpucheck package beside this file

from gpucheck.cli import main

if __name__ == "__main__":
    sys.exit(main())
