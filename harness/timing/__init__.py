"""How time is measured and judged, below the run machinery: contention evidence, steady-state figures, intervals, and
the paired-timing record and its verdicts."""
