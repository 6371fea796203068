"""Where everything the harness stores lives: `RunPaths` (one run directory) and `SweepPaths` (one sweep directory),
the one form of a location, made once where an id or a directory enters (the command line, a worker's argv) and
passed down, never rebuilt.

`--out` holds `runs/<run_id>/` (spec.json, per backend `<backend>.json`, `.steps.csv`, `.evals.csv`, `.chunks.jsonl`,
`.ckpt.npz`, `.probe.npz`, and parity.json, paired.json, .lock), `sweeps/<sweep_id>/` (sweep.json, paired/<n>.json,
slurm/), `bench/` (the records of `harness bench`) and `data/<sha256>.txt`, the content-addressed copy of every
corpus a run trains on (shared by the runs of --out).

**--out means --out.** Every folder inside it is named through `inside`, which refuses a symbolic link on the way
(`runs/`, a run id's directory, `sweeps/`, a sweep's, `bench/`, `data/`): what the harness writes lands in --out,
never where a link in it points (a file is replaced by a rename, which replaces a link rather than following it, or
opened with O_NOFOLLOW). --out itself may be a link: it is the place the user named.
"""

from __future__ import annotations

import os
import re
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

from harness.errors import UsageError

# A run id is a name, never a path: <UTC time>-<config name>-<hex>, but any name of these characters is accepted.
RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,199}$")
# A sweep id likewise: <UTC time>-<sweep name>-<hex> (`new_sweep_id`).
SWEEP_ID_RE = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$"
RUNS, SWEEPS, BENCH, DATA = "runs", "sweeps", "bench", "data"  # the folders of --out


def inside(out: str | os.PathLike, *parts: str) -> Path:
    """`<out>/<parts...>`, where none of `parts` is a symbolic link (the one check of every path the harness writes
    under --out: the module docstring); UsageError in one line naming the link otherwise."""
    path = Path(out)
    for part in parts:
        path = path / part
        if path.is_symlink():
            try:
                target = f" (to {os.readlink(path)!r})"
            except OSError:
                target = ""
            raise UsageError(f"{str(path)!r} is a symbolic link{target}: nanogpt-parity writes only inside --out, "
                             "never through a link in it; replace the link with a directory, or pass --out where "
                             "the records should go")
    return path


def check_run_id(run_id: str) -> str:
    """A run id must be a plain name (no `/`, `..`, NUL): anything else could write outside --out."""
    if run_id == "":
        raise UsageError("the run id is empty (an unset shell variable?); pass a run id, a directory name from "
                         "<out>/runs")
    if not isinstance(run_id, str) or not RUN_ID_RE.match(run_id) or ".." in run_id:
        raise UsageError(f"{run_id!r} is not a run id (a name from <out>/runs, not a path); pass the directory "
                         "name only, and --out for where the runs are")
    return run_id


def check_sweep_id(sweep_id: str, out: Path) -> str:
    """A sweep id is a name from `<out>/sweeps` (never empty: an unset shell variable must not mean "new work")."""
    if not sweep_id:
        raise UsageError(f"the sweep id is empty (an unset shell variable?); pass one from "
                         f"`ls {SweepPaths.root(out)}`")
    if not isinstance(sweep_id, str) or not re.match(SWEEP_ID_RE, sweep_id) or ".." in sweep_id:
        raise UsageError(f"{sweep_id!r} is not a sweep id; pass one from `ls {SweepPaths.root(out)}`")
    return sweep_id


def corpus_copy(out: Path, sha256: str) -> Path:
    """`<out>/data/<sha256>.txt`: the checked copy of a corpus every run of --out trains on."""
    return inside(out, DATA) / f"{sha256}.txt"


@dataclass(frozen=True)
class RunPaths:
    """Every file of one run directory `<out>/runs/<run_id>/`, named once."""

    out: Path
    run_id: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "out", Path(self.out))
        check_run_id(self.run_id)

    @classmethod
    def of_dir(cls, directory: Path) -> RunPaths:
        """The RunPaths of run directory `<out>/runs/<run_id>` (where a directory enters: a child's argv)."""
        directory = Path(directory)
        return cls(directory.parent.parent, directory.name)

    @classmethod
    def new(cls, out: Path, label: str) -> RunPaths:
        """A fresh, unique run: UTC time, the config name and a random suffix; its directory is created here."""
        runs = cls.root(out)
        runs.mkdir(parents=True, exist_ok=True)
        while True:
            run_id = check_run_id(f"{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{label}-{secrets.token_hex(2)}")
            try:
                (runs / run_id).mkdir()  # exclusive: never reuse another run's directory
                return cls(Path(out), run_id)
            except FileExistsError:
                continue

    @staticmethod
    def root(out: Path) -> Path:
        """`<out>/runs`, where every run directory lives."""
        return inside(out, RUNS)

    @classmethod
    def under(cls, out: Path) -> list[RunPaths]:
        """Every run directory under `<out>/runs` (a folder whose name is no run id is none, nor a link: `inside`), by
        id."""
        root = cls.root(out)
        names = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.is_symlink()) if root.is_dir() else []
        return [cls(Path(out), n) for n in names if RUN_ID_RE.match(n) and ".." not in n]

    @property
    def dir(self) -> Path:
        return inside(self.out, RUNS, self.run_id)

    @property
    def spec(self) -> Path:
        return self.dir / "spec.json"

    @property
    def parity(self) -> Path:
        """The parity record of `harness parity` (harness.store.parity.ParityRecord)."""
        return self.dir / "parity.json"

    @property
    def lock(self) -> Path:
        return self.dir / ".lock"

    @property
    def paired_timing(self) -> Path:
        """The paired-timing record of a run with two or more backends (harness.store.paired.PairedRecord)."""
        return self.dir / "paired.json"

    def record(self, backend: str) -> Path:
        return self.dir / f"{backend}.json"

    def record_files(self) -> list[Path]:
        """The backend records in the directory (`<backend>.json`), whichever backends wrote them, sorted."""
        others = {self.spec.name, self.parity.name, self.paired_timing.name}
        return [p for p in sorted(self.dir.glob("*.json")) if p.name not in others and not p.name.startswith(".")]

    def steps_csv(self, backend: str) -> Path:
        return self.dir / f"{backend}.steps.csv"

    def evals_csv(self, backend: str) -> Path:
        return self.dir / f"{backend}.evals.csv"

    def chunks_jsonl(self, backend: str) -> Path:
        """The contention chunks of `backend`'s steps, one JSON object a line (harness.store.curves)."""
        return self.dir / f"{backend}.chunks.jsonl"

    def checkpoint(self, backend: str) -> Path:
        return self.dir / f"{backend}.ckpt.npz"

    def probe(self, backend: str) -> Path:
        return self.dir / f"{backend}.probe.npz"

    def corpus(self, sha256: str) -> Path:
        """The content-addressed copy of the corpus the run trains on (shared by every run in --out)."""
        return corpus_copy(self.out, sha256)


@dataclass(frozen=True)
class SweepPaths:
    """Every file of one sweep directory `<out>/sweeps/<sweep_id>/`, named once (the sweep's runs are ordinary run
    directories: RunPaths)."""

    out: Path
    sweep_id: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "out", Path(self.out))
        check_sweep_id(self.sweep_id, self.out)

    @classmethod
    def new(cls, out: Path, name: str) -> SweepPaths:
        """A fresh sweep (UTC time, the sweep's name, a random suffix); its directory is created here, exclusively."""
        root = cls.root(out)
        root.mkdir(parents=True, exist_ok=True)
        while True:
            sweep_id = f"{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{name}-{secrets.token_hex(2)}"
            try:
                (root / sweep_id).mkdir()
                return cls(Path(out), sweep_id)
            except FileExistsError:
                continue

    @staticmethod
    def root(out: Path) -> Path:
        """`<out>/sweeps`, where every sweep directory lives."""
        return inside(out, SWEEPS)

    @classmethod
    def under(cls, out: Path) -> list[SweepPaths]:
        """Every sweep directory under `<out>/sweeps` (a folder whose name is no sweep id is none, nor a link:
        `inside`), by id."""
        root = cls.root(out)
        names = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.is_symlink()) if root.is_dir() else []
        return [cls(Path(out), n) for n in names if re.match(SWEEP_ID_RE, n) and ".." not in n]

    @property
    def dir(self) -> Path:
        return inside(self.out, SWEEPS, self.sweep_id)

    @property
    def manifest(self) -> Path:
        """The sweep manifest (harness.store.sweep.SweepManifest)."""
        return self.dir / "sweep.json"

    @property
    def slurm(self) -> Path:
        """submitit's folder: job scripts, pickles and logs of the SLURM executor."""
        return inside(self.out, SWEEPS, self.sweep_id, "slurm")

    def paired(self, index: int) -> Path:
        """The record of the sweep's paired-timing entry `index` (harness.store.paired.PairedRecord)."""
        return inside(self.out, SWEEPS, self.sweep_id, "paired") / f"{int(index)}.json"

    def run(self, run_id: str) -> RunPaths:
        """The run directory of one of the sweep's cells."""
        return RunPaths(self.out, run_id)

