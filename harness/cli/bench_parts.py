"""`harness bench parts`: its options and its command (harness/bench/parts.py does the timing)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from harness.backends import DEFAULT_BACKEND, ORACLE
from harness.cli.options import (
    add_backend,
    add_config,
    add_data,
    add_device,
    add_dtype,
    add_json,
    add_out,
    add_quiet,
    add_seed,
    add_set,
    add_size,
    add_threads,
    common_device,
    configure,
    exit_statuses,
    listed,
    parse_devices,
    pick_backends,
    print_json,
)
from harness.errors import UsageError
from harness.store.parts import PartsRecord, record_path

PARTS_EXIT = {0: "measured (the record, the table, the diagnosis and the page are written)",
              1: "a backend's timed process failed (its reason is on stderr and in the record)"}


def rounds_arg(text: str) -> int:
    """argparse type of --rounds: 1 to harness.bench.parts.MAX_ROUNDS."""
    from harness.bench.parts import MAX_ROUNDS

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if not 1 <= value <= MAX_ROUNDS:
        raise argparse.ArgumentTypeError(f"{text!r} must be 1 to {MAX_ROUNDS}")
    return value


def add_parts_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `harness bench parts`."""
    add_backend(p, f"default {DEFAULT_BACKEND},{ORACLE}; the first is the one the others are compared with; "
                "`all`: every backend here that can time its parts")
    add_size(p, "one (default small)", one=True)
    add_config(p)
    add_set(p)
    add_device(p)
    add_dtype(p)
    add_threads(p, "of each backend's timed process; default: the frameworks' own choice")
    p.add_argument("--parts", action="append", metavar="NAME[,NAME...]",
                   help="time only these parts (and the whole step): a part (emb, ln_f, logits, loss, h.0.ln_1), a "
                        "block part in every block (attn.probs or h.*.attn.probs); default: every part")
    p.add_argument("--per-block", action="store_true", help="one row per block in the table (default: block parts "
                   "summed over the blocks, h.*.NAME)")
    p.add_argument("--rounds", type=rounds_arg, default=None, metavar="N",
                   help="undisturbed rounds wanted (default 10; at most 4x as many are made)")
    add_data(p)
    add_seed(p)
    add_out(p, "default reports/; the record and its page go to DIR/bench/parts-<UTC time>-<random>.json/.html")
    add_quiet(p)
    add_json(p, "the record's path, its page, its status, the rounds and each pair's diagnosis (the table then goes "
             "to stderr)")
    exit_statuses(p, PARTS_EXIT)


def plan(args: argparse.Namespace) -> tuple:
    """Check every input (nothing is written on failure): (backends, devices, config, corpus, part names). A
    backend whose declaration has no part runner is refused (`--backend all` leaves it out, saying so)."""
    from harness.backends import check_backend
    from harness.backends.parts import check_supported, supports
    from harness.core.data import check_fits, load_corpus
    from harness.core.parts import select
    from harness.store import check_writable

    backends = pick_backends(args.backend, default=(DEFAULT_BACKEND, ORACLE), device=common_device(args.device))
    if listed(args.backend, "--backend") == ["all"]:
        without = [n for n in backends if not supports(n)]
        backends = [n for n in backends if n not in without]
        if without:
            print(f"--backend all: {', '.join(without)} left out (no part runner)", file=sys.stderr)
        if not backends:
            raise UsageError("--backend all: no backend here can time its parts; name one with --backend")
    check_supported(backends)
    _, devices = parse_devices(args.device, backends)
    config = configure(args)
    for name in backends:  # what each declares, its own checks (dtype, the device) and the config's options
        check_backend(name, devices[name], {"dtype": args.dtype} if args.dtype else {}, config.options())
    names = select(listed(args.parts, "--parts"), config.n_layer)
    corpus = load_corpus(args.data)
    check_fits(corpus, config.block_size, config.batch_size)
    check_writable(args.out)
    return backends, devices, config, corpus, names


def command(args: argparse.Namespace) -> int:
    """`harness bench parts`: check, time every backend's parts side by side, write the record and its page, print
    the table and the diagnosis."""
    from harness.bench import parts as bench_parts

    backends, devices, config, corpus, names = plan(args)
    contenders = [{"name": n, "backend": n, "device": devices[n],
                   "options": {"dtype": args.dtype} if args.dtype else {}} for n in backends]
    record, jobs = bench_parts.new_record(
        config, corpus, contenders, names, args.rounds or bench_parts.ROUNDS, args.seed,
        {"backends": backends, "devices": devices, "dtype": args.dtype, "threads": args.threads,
         "parts": listed(args.parts, "--parts") or None, "per_block": args.per_block})
    bench_parts.run(record_path(args.out, record.id), record, jobs, args.threads, progress=not args.quiet)
    return report(record, Path(args.out), args.per_block, args.json)


def report(record: PartsRecord, out: Path, per_block: bool, as_json: bool = False) -> int:
    """Write the page of a finished record and print its result (docs/usage.md, "Scripting"): the table, the notes,
    the diagnosis and last the record's path on stdout (the page's on stderr), or with `as_json` one JSON object on
    stdout and the table on stderr; returns the exit status."""
    from harness.bench.parts_analysis import format_table, summary
    from harness.bench.parts_page import notes, write_page

    stream = sys.stderr if as_json else sys.stdout
    s = summary(record, per_block) if record.rounds else None
    if s is not None:
        print(format_table(record, s), file=stream)
        for line in [*notes(record, s), *(f"diagnosis: {pair['line']}" for pair in s["pairs"])]:
            print(line, file=stream)
    page = write_page(record, out, per_block, s)
    path = record_path(out, record.id)
    code = 1 if record.status == "failed" else 0
    print(f"bench parts: {page}", file=sys.stderr)
    if as_json:
        pairs = [{k: p.get(k) for k in ("slow", "fast", "ratio", "lo", "hi", "conclusive", "line")}
                 for p in (s["pairs"] if s else [])]
        print_json("bench parts", code, id=record.id, record=path, page=page, status=record.status,
                   failure=record.failure, stopped=record.stopped, rounds=s["rounds"] if s else None, pairs=pairs)
    else:
        print(f"bench parts: {path}", file=stream)
    return code
