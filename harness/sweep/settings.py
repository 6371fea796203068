"""A sweep's executor settings (`executor` in sweep.json), checked wherever they come from: the sweep file's
`[slurm]` table and top-level `executor`/`jobs`, the command line, and a stored sweep.json on `harness resume`.

Why so strict: submitit writes every SLURM setting into the job script as a line `#SBATCH --NAME=VALUE` that sbatch
reads and bash then runs. The value is shell-quoted but the name is not, and a quoted value may still hold a
newline, so `sbatch = ["requeue\\ntouch PWNED\\n#SBATCH --comment=b"]` would run `touch PWNED` inside the job.
Hence: an option name is `[a-z0-9_-]+`, no value holds a newline or any other control character, every field has
its type and range, and the settings the harness sets itself (the array, the log files, the signal) cannot be
overridden. A stored sweep.json whose settings fail these checks is refused before anything is submitted.

What sbatch itself would still refuse (an option it does not know, a partition's limits) is asked of sbatch with
`--test-only` before anything is written (harness.sweep.slurm.check_submission).
"""

from __future__ import annotations

import math
import re
import unicodedata
from typing import Any

from harness.errors import UsageError

KINDS = ("local", "slurm")
SLURM_KEYS = ("partition", "gpus_per_job", "cpus_per_job", "mem_gb", "time_min", "array_parallelism", "sbatch")
DEFAULT_TIME_MIN = 60
OPTION_RE = re.compile(r"[a-z0-9_-]+")
PARTITION_RE = re.compile(r"[A-Za-z0-9_.,+-]{1,128}")
MAX_VALUE_CHARS = 1000
# sbatch options the harness (through submitit) writes itself: a second value would break the job or its logs
MANAGED = {"array": "--array-parallelism", "partition": "--partition", "time": "--time-min", "mem": "--mem-gb",
           "cpus-per-task": "--cpus-per-job", "gpus-per-node": "--gpus-per-job", "output": None, "error": None,
           "open-mode": None, "signal": None, "job-name": None, "wrap": None,
           "dependency": None}  # the paired timings' array waits for the training arrays (afterany)


def _control(text: str) -> str | None:
    """The first control character of `text` (newline, tab, NUL, DEL, ...), as Python writes it; None if none."""
    for ch in text:
        if unicodedata.category(ch) == "Cc":
            return repr(ch)
    return None


def check_text(value: Any, field: str) -> str:
    """A string that may go into a job script: no control character, not absurdly long."""
    if not isinstance(value, str):
        raise UsageError(f"{field} must be a string, got {value!r}")
    bad = _control(value)
    if bad is not None:
        raise UsageError(f"{field} holds the control character {bad}; a SLURM setting is one line of plain text "
                         "(a newline would end the #SBATCH line and run the rest as a shell command)")
    if len(value) > MAX_VALUE_CHARS:
        raise UsageError(f"{field} is {len(value)} characters long; at most {MAX_VALUE_CHARS}")
    return value


def _whole(value: Any, field: str, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise UsageError(f"{field} must be a positive whole number{what}, got {value!r}")
    return value


def parse_sbatch(items: list[str], field: str = "sbatch") -> dict[str, str | bool]:
    """`["account=abc", "exclusive"]` -> {"account": "abc", "exclusive": True}: sbatch long options, checked.

    A name is `[a-z0-9_-]+` (a leading `--` is allowed); a value is one line of plain text; options the harness
    sets itself are refused with the flag that sets them.
    """
    if not isinstance(items, list):
        raise UsageError(f"{field} must be a list of sbatch options such as [\"account=abc\", \"exclusive\"], "
                         f"got {items!r}")
    extra: dict[str, str | bool] = {}
    for i, item in enumerate(items):
        where = f"{field}[{i}]"
        check_text(item, where)
        name, sep, value = item.partition("=")
        name = name[2:] if name.startswith("--") else name
        if not OPTION_RE.fullmatch(name):
            raise UsageError(f"{where} {item!r}: {name!r} is not an sbatch option name (lower-case letters, digits, "
                             "'-' and '_'); write KEY=VALUE or KEY, e.g. account=abc")
        if name.replace("_", "-") in MANAGED:
            flag = MANAGED[name.replace("_", "-")]
            fix = f"use {flag}" if flag else "the harness sets it for every job"
            raise UsageError(f"{where} {item!r}: sbatch option --{name.replace('_', '-')} cannot be given here; {fix}")
        key = name.replace("-", "_")
        if key in extra:
            raise UsageError(f"{where}: sbatch option --{name} is given twice; give it once")
        extra[key] = value if sep else True
    return extra


def check_slurm(slurm: Any, where: str = "[slurm]") -> dict[str, Any]:
    """The `[slurm]` settings, every field checked for its type and range; returns them (unchanged)."""
    if not isinstance(slurm, dict):
        raise UsageError(f"{where} must be a table of SLURM settings ({', '.join(SLURM_KEYS)}), got {slurm!r}")
    unknown = sorted(set(slurm) - set(SLURM_KEYS))
    if unknown:
        raise UsageError(f"unknown key(s) in {where}: {', '.join(map(repr, unknown))}; allowed: "
                         f"{', '.join(SLURM_KEYS)}")
    s = slurm
    if s.get("partition") is not None:
        check_text(s["partition"], f"{where} partition")
        if not PARTITION_RE.fullmatch(s["partition"]):
            raise UsageError(f"{where} partition {s['partition']!r} is not a partition name (letters, digits, "
                             "'.', '_', '-', ',')")
    for key, what in (("gpus_per_job", " of GPUs"), ("cpus_per_job", " of CPUs"),
                      ("time_min", " of minutes (e.g. 90, not \"1h\")"),
                      ("array_parallelism", " of array elements running at once")):
        if s.get(key) is not None:
            _whole(s[key], f"{where} {key}", what)
    mem = s.get("mem_gb")
    if mem is not None:
        if not isinstance(mem, (int, float)) or isinstance(mem, bool) or not math.isfinite(mem) or mem * 1024 < 1:
            raise UsageError(f"{where} mem_gb must be a finite number of GB, at least 1/1024 (1 MB), got {mem!r}")
    if s.get("sbatch") is not None:
        parse_sbatch(s["sbatch"], f"{where} sbatch")
    return slurm


def check_executor(executor: Any, slurm_where: str = "[slurm]") -> dict[str, Any]:
    """The whole executor document ({"kind", "jobs", "slurm"}), as stored in sweep.json; returns it."""
    if not isinstance(executor, dict):
        raise UsageError(f"the executor settings must be a table with kind, jobs and slurm, got {executor!r}")
    unknown = sorted(set(executor) - {"kind", "jobs", "slurm"})
    if unknown:
        raise UsageError(f"unknown executor setting(s) {', '.join(map(repr, unknown))}; allowed: kind, jobs, slurm")
    if executor.get("kind") not in KINDS:
        raise UsageError(f"executor {executor.get('kind')!r} is not an executor; use local or slurm")
    _whole(executor.get("jobs", 1), "jobs", " of cells at once")
    check_slurm(executor.get("slurm", {}), slurm_where)
    return executor
