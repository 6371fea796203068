#!/usr/bin/env python3
"""Regenerate docs/benchmarks.md's planted-slowdown table: one part of one backend made 20x slower or more
(tests/plants.py, SLOWDOWNS), and what `harness bench parts`' diagnosis names first.

Each plant is timed as the tests time it (tests/test_bench_parts.py): the same backend twice side by side, one of
its two timed processes carrying the plant (through a sitecustomize, as every planted test process), by the command's
own coordinator (harness.bench.parts.run) and analysis. A row says where the plant is, what the diagnosis names
first (and its share of the difference), whether that is the planted part and direction, the rounds it rests on
and the machine's load.

    python tools/planted_slowdowns.py --sizes small,medium --rounds 5 --write docs/benchmarks.md

With --write the table replaces the lines between the markers `<!-- planted-slowdowns:begin -->` and
`<!-- planted-slowdowns:end -->`; without it, it is printed.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests"), str(REPO / "tools")]
import doc_tables  # noqa: E402  (beside this script)

BEGIN, END = "<!-- planted-slowdowns:begin -->", "<!-- planted-slowdowns:end -->"
HEADER = ["| size | backend | planted in | what | named first | share of the difference | right? | whole step | "
          "rounds (undisturbed of made) |", "|---|---|---|---|---|---|---|---|---|"]


def plant_env(site: Path, plant: str) -> dict:
    """The environment of a timed process that carries `plant`."""
    import plants

    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(plants.SITECUSTOMIZE)
    path = os.pathsep.join([str(site), str(REPO / "tests"), str(REPO), os.environ.get("PYTHONPATH", "")])
    return {"PYTHONPATH": path, "HARNESS_TEST_PLANT": plant}


def row(size: str, plant: str, corpus: object, rounds: int, threads: int, out: Path) -> list[str]:
    """Time one plant at one size; its table row."""
    import plants

    from harness.bench import parts as bench_parts
    from harness.bench.parts_analysis import label, summary
    from harness.config.load import load_config
    from harness.core.parts import part_names
    from harness.store.parts import record_path

    backend, part, direction, what, _ = plants.SLOWDOWNS[plant]
    config = load_config(size)
    contenders = [{"name": backend, "backend": backend, "device": "cpu", "options": {}},
                  {"name": f"{backend}+plant", "backend": backend, "device": "cpu", "options": {},
                   "env": plant_env(out / "site", plant)}]
    record, jobs = bench_parts.new_record(config, corpus, contenders, part_names(config.n_layer), rounds, 1337,
                                          {"backends": [backend, f"{backend}+plant"], "threads": threads})
    print(f"{size} {plant}: timing", file=sys.stderr, flush=True)
    record = bench_parts.run(record_path(out, record.id), record, jobs, threads, progress=False)
    s = summary(record)
    pair, r = s["pairs"][0], s["rounds"]
    first = pair["named"][0] if pair["named"] else None
    right = bool(first and first["row"] == f"{part}/{direction}" and pair["slow"] == f"{backend}+plant")
    step = (f"{pair['ratio']:.2f}× [{pair['lo']:.2f}, {pair['hi']:.2f}]" if pair.get("lo") is not None
            else "-")
    return [size, backend, f"{part} {direction}", what, label(first["row"]) if first else "nothing",
            f"{first['share']:.0%}" if first else "-", "yes" if right else "**no**", step,
            f"{r['clean']} of {r['total']}" + ("" if r["usable"] else " (mostly disturbed)")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="small")
    ap.add_argument("--plants", metavar="NAME,...", help="these only (default: every planted slowdown)")
    ap.add_argument("--rounds", type=int, default=5, help="undisturbed rounds wanted per plant (5)")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads of each timed process (1)")
    ap.add_argument("--data", default=os.environ.get("HARNESS_DATA"))
    ap.add_argument("--write", type=Path, metavar="MARKDOWN", help="replace the table between the markers there")
    args = ap.parse_args()

    import plants

    from harness.core.data import load_corpus
    from harness.environment import cpu_model, loadavg, usable_cores

    names = args.plants.split(",") if args.plants else list(plants.SLOWDOWNS)
    unknown = [n for n in names if n not in plants.SLOWDOWNS]
    if unknown:
        print(f"--plants: unknown plant(s) {', '.join(unknown)}; choose from {', '.join(plants.SLOWDOWNS)}",
              file=sys.stderr)
        return 2
    corpus = load_corpus(args.data)
    load_start = f"{(loadavg() or (0.0,))[0]:.2f}"
    with tempfile.TemporaryDirectory() as tmp:
        rows = [row(size, plant, corpus, args.rounds, args.threads, Path(tmp) / f"{size}-{plant}")
                for size in args.sizes.split(",") for plant in names]
    load_end = f"{(loadavg() or (0.0,))[0]:.2f}"
    text = (f"Generated by `python tools/planted_slowdowns.py --sizes {args.sizes} --rounds {args.rounds} --write "
            f"docs/benchmarks.md` (seed 1337, one thread per process, CPU; load average {load_start} at the start, "
            f"{load_end} at the end, on {usable_cores()} usable of the {os.cpu_count()} CPUs of an {cpu_model()}). "
            "\"Named first\" is the first part the diagnosis of "
            "the pair (the backend, and the backend with the plant) names; \"right?\" whether it is the planted "
            "part and direction.\n\n" + "\n".join([*HEADER, *("| " + " | ".join(r) + " |" for r in rows)]) + "\n")
    if args.write is None:
        print(text)
        return 0
    some = args.plants is not None or set(args.sizes.split(",")) != {"small", "medium"}

    def new(old: str) -> str:  # some plants or sizes only: the other rows as they are
        if not some or HEADER[1] not in old:
            return text
        head, table_text = old.lstrip("\n").split(HEADER[0], 1)
        return head + doc_tables.merge_rows(HEADER[0] + table_text, HEADER[1], rows, key=3, group=slice(0, 1))

    problem = doc_tables.write_between(args.write, BEGIN, END, new)
    if problem:
        print(problem, file=sys.stderr)
        return 2
    print(f"{args.write}: {len(rows)} rows written")
    return 0 if all(r[6] == "yes" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
