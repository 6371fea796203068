"""What every cell of a sweep becomes before it runs: its run plan (harness.run.plan), its manifest entry, and the
checks that a sweep is refused by before anything is written (each cell's preflight, the memory of cells and of
paired timings held at once).
"""

from __future__ import annotations

from pathlib import Path

from harness.config.fields import config_from_dict
from harness.errors import UsageError
from harness.run import plan as run_plan
from harness.store.sweep import PairedEntry, SweepCell
from harness.sweep import manifest as mf
from harness.sweep.spec import Cell, SweepSpec
from harness.units import fmt_bytes


def validate(spec: SweepSpec, cells: list[Cell], out: Path, data: str | None, entries: list[PairedEntry],
             jobs: int = 1) -> object:
    """Every check that can fail, for every cell and paired-timing entry (`entries`), before anything is written;
    returns the corpus.

    `jobs` workers at once (the local executor's --jobs) must fit in memory together: the `jobs` biggest cells'
    estimates are added up."""
    from harness.core.data import load_corpus

    corpus = load_corpus(data)
    plans = [plan_of_new(spec, cell, corpus, out) for cell in cells]
    check_plans(plans, jobs)
    check_paired_memory(dict(enumerate(plans)), entries)
    return corpus


def check_plans(plans: list[run_plan.Plan], jobs: int = 1) -> None:
    """`run.plan.preflight` for each distinct plan, then the memory of `jobs` workers at once."""
    need: dict[tuple, int] = {}
    sizes = []
    for plan in plans:
        (backend,) = plan.backends
        key = (plan.config.config_hash(), backend, plan.device, tuple(sorted(plan.backend_options[backend].items())))
        if key not in need:
            run_plan.preflight(plan)
            need[key] = run_plan.memory_need(plan)[0]
        sizes.append(need[key])
    if jobs > 1 and len(sizes) > 1:
        together = sum(sorted(sizes, reverse=True)[:jobs])
        total, available = run_plan.machine_memory()
        if together > available:
            raise UsageError(f"{min(jobs, len(sizes))} cells at once (--jobs {jobs}) need about "
                             f"{fmt_bytes(together)} of memory together but this machine has "
                             f"{fmt_bytes(available)} available of {fmt_bytes(total)}; pass a "
                             "smaller --jobs (--jobs 1 runs one cell at a time)")


def check_paired_memory(plans: dict[int, run_plan.Plan], entries: list[PairedEntry]) -> None:
    """A paired timing holds every contender of its block at once: their memory together must fit (`plans`: the
    plan of each cell index)."""
    total, available = run_plan.machine_memory()
    for entry in entries:
        together = sum(run_plan.memory_need(plans[i])[0] for i in entry.members if i in plans)
        if together > available:
            raise UsageError(f"the paired timing of {entry.key} holds {len(entry.members)} backends at once and "
                             f"needs about {fmt_bytes(together)} of memory together but this machine has "
                             f"{fmt_bytes(available)} available of {fmt_bytes(total)}; make the "
                             "model smaller or pass --paired-rounds 0 (no speed verdict)")


def plan_of_new(spec: SweepSpec, cell: Cell, corpus: object, out: Path) -> run_plan.Plan:
    """The run plan of a cell of a sweep being created."""
    return run_plan.Plan(config=cell.config, corpus=corpus, backends=[cell.backend], device=cell.device,  # type: ignore[arg-type]
                       seed=cell.seed, out=out, backend_options={cell.backend: dict(cell.options)},
                       checkpoint_every=spec.checkpoint_every, text=spec.text, progress=False, threads=spec.threads)


def cell_doc(cell: Cell, spec: SweepSpec) -> SweepCell:
    """A new cell's entry in the manifest: pending, no run yet."""
    return SweepCell(index=cell.index, key=cell.key, group=cell.group, label=cell.config.name, source=cell.source,
                     overrides=cell.overrides, config=cell.config.to_dict(), backend=cell.backend, seed=cell.seed,
                     device=cell.device, backend_options=cell.options, threads=spec.threads)


def plan_of(m: mf.Manifest, cell: SweepCell, corpus: object, progress: bool = False) -> run_plan.Plan:
    """The run plan of a stored cell (its config checked when the manifest was loaded)."""
    spec = m.doc.spec
    return run_plan.Plan(config=config_from_dict(cell.config, f"{m.path} cell {cell.index}"),
                         corpus=corpus, backends=[cell.backend], device=cell.device,  # type: ignore[arg-type]
                         seed=cell.seed, out=m.out, backend_options={cell.backend: dict(cell.backend_options)},
                         checkpoint_every=spec.checkpoint_every or 0, text=spec.text, progress=progress,
                         threads=cell.threads)


def has_run(m: mf.Manifest, cell: SweepCell) -> bool:
    """Whether the cell's run directory exists with its spec (a run id whose directory is gone gets a new run)."""
    return bool(cell.run_id) and m.run(cell).spec.is_file()
