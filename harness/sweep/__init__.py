"""Sweeps: many ordinary runs (cells) over sizes, backends, seeds and config fields, with intervals across seeds.

`spec` expands a sweep into validated cells, `manifest` keeps `<out>/sweeps/<id>/sweep.json`, `executors` and `slurm`
decide where each cell's worker runs; `harness sweep` itself is harness.cli.sweep. Aggregation reads RunRecords only
(harness.report.results, harness.report.sweep).
"""
