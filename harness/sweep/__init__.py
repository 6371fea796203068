"""Sweeps: many ordinary runs (cells) over sizes, backends, seeds and config fields, with intervals across seeds.

`spec` expands a sweep into validated cells, `manifest` keeps `<out>/sweeps/<id>/sweep.json`, `executors` and
`slurm` decide where each cell's worker runs, `command` is `harness sweep`. Aggregation reads RunRecords only
(harness.results, harness.report.sweep).
"""

from harness.sweep.command import add_arguments, command

__all__ = ["add_arguments", "command"]
