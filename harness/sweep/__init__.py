"""Sweeps: many ordinary runs (cells) over sizes, backends, seeds and config fields, with intervals across seeds.

`spec` expands a sweep into validated cells, `plans` turns each into a run plan and checks them all before anything is
written, `manifest` keeps `<out>/sweeps/<id>/sweep.json`, `drive` creates, runs and resumes a sweep, `state` says where
it stands (squeue and the records), `executors` and `slurm` decide where each cell's worker runs. The command line
(harness.cli.sweep: options and the spec they make) only calls these. Aggregation reads RunRecords only
(harness.report.results, harness.report.sweep).
"""
