"""Contention evidence: was a worker's timing disturbed by other work on the machine, and which steps?

A training loop is cut into *chunks* of steps, about `CHUNK_S` seconds each (the chunk closes at the first step
boundary after that, and before and after every evaluation). At each chunk boundary, never per step, the sampler
reads the machine's state once (`Probe.snapshot`, ~0.1 ms; docs/benchmarks.md gives the measured cost): the reading
that ends a chunk starts the next. A chunk records, for the steps it covers:

- `wall_s` and `cpu_s`: wall time and the worker process's own CPU time (all its threads), `threads`: its thread
  count at the end;
- `exec_s` / `wait_s`: summed over the worker's threads, the time they ran on a CPU and the time they were
  runnable but waited for one (`/proc/self/task/*/schedstat`, fields 1 and 2: the scheduler's run-queue delay);
- the machine: `busy_s` (all CPUs' non-idle time, `/proc/stat`), `steal_s` (time the hypervisor gave the
  machine's virtual CPUs to someone else), `others_cpu_s` (busy time not ours: other processes), `load` (the
  1-minute load average at the start and the end), `psi_some_s` (`/proc/pressure/cpu`: time some task waited
  for a CPU, anywhere on the machine), `ncpu`. `load`, `others_cpu_s` and `psi_some_s` are not part of the rule:
  they are machine-wide and cannot say whose work waited (PSI counts the worker's own threads and every other
  cgroup alike); they are recorded as evidence for a person reading a record, to tell a machine that was
  oversubscribed as a whole from a worker that starved itself (one small file read per chunk boundary);
- on CUDA, `gpu` (NVML through `nvidia-ml-py`, when installed): SM clock, clock-event ("throttle") reasons and
  the other compute processes on the device, at the start and the end.

**The rule** (`RULE`, version `RULE_VERSION`): a chunk is disturbed when its threads waited for a CPU for more
than `WAIT_MAX` of their runnable time (wait / (wait + exec)), when the hypervisor stole more than `STEAL_MAX` of
the machine's CPU time, or, on a GPU, when another compute process was on the device or the clocks were held down
by a thermal, power-brake or hardware slowdown. Every step of a disturbed chunk is disturbed. Steady-state figures
come from the undisturbed steps only; a run with more than `MOSTLY` of its steady steps disturbed is *mostly
disturbed* and is kept out of every speed verdict. Where the kernel offers no per-thread schedstat (not Linux),
the CPU part cannot be judged: the record says `evidence: "none"` and `contended_fraction: null`.

Everything reads through `Probe(root=..., clock=..., cpu_clock=...)`, so tests give it a fake `/proc` tree and
fake clocks. No framework is imported here.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from harness.store.contention import Contention

RULE_VERSION = 1
CHUNK_S = 0.5  # seconds of training per chunk (the machine state is read at its two ends)
WAIT_MAX = 0.10  # a chunk whose threads waited for a CPU more than this share of their runnable time is disturbed
STEAL_MAX = 0.10  # ... or whose machine lost more than this share of its CPU time to the hypervisor
MOSTLY = 0.5  # more than this share of the steady steps disturbed: the run's speed figures are not used
# NVML clock-event reasons that mean the GPU is slowed against the workload's will (nvml.h values); SwPowerCap
# (0x4) is the normal state of a GPU under full load, idle (0x1) and application clocks (0x2) are not slowdowns.
GPU_SLOWDOWNS = {0x8: "hw_slowdown", 0x20: "sw_thermal_slowdown", 0x40: "hw_thermal_slowdown",
                 0x80: "hw_power_brake_slowdown"}
RULE = {
    "version": RULE_VERSION, "chunk_s": CHUNK_S, "wait_max": WAIT_MAX, "steal_max": STEAL_MAX, "mostly": MOSTLY,
    "text": (f"a chunk of about {CHUNK_S:g} s of steps is disturbed when the worker's threads waited for a CPU more "
             f"than {WAIT_MAX:.0%} of their runnable time (schedstat run delay), when the hypervisor stole more "
             f"than {STEAL_MAX:.0%} of the machine's CPU time, or when another compute process or a thermal, "
             "power-brake or hardware slowdown was on the GPU; steady-state figures use the undisturbed steps; "
             f"a run with more than {MOSTLY:.0%} of its steady steps disturbed is kept out of speed verdicts"),
}
RULE_SENTENCE = RULE["text"][0].upper() + RULE["text"][1:] + "."  # the rule as the reports state it


# --- reading the machine ---------------------------------------------------------------------------------------
@dataclass
class Snapshot:
    """The machine and this process at one instant. None: not available here."""

    wall: float
    cpu: float  # this process's CPU seconds (user + system, every thread)
    threads: int | None = None
    tasks: dict[str, tuple[float, float]] | None = None  # per thread id: (exec seconds, run-queue wait seconds)
    machine: tuple[float, float, float] | None = None  # /proc/stat "cpu" line: (busy, steal, total) seconds
    ncpu: int | None = None
    load1: float | None = None
    psi_some_s: float | None = None  # /proc/pressure/cpu "some" total, seconds
    gpu: dict | None = None
    epoch: float | None = None  # time.time(): when, on the calendar, this instant was (lines chunks up with events)


def _read(path: Path) -> str | None:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read()
    except OSError:
        return None


class Probe:
    """Reads a `Snapshot`. `root` is the /proc to read (a fake tree in tests); `gpu` an `NvmlProbe` or None."""

    def __init__(self, root: str | Path = "/proc", clock: Callable[[], float] = time.perf_counter,
                 cpu_clock: Callable[[], float] = time.process_time, gpu: NvmlProbe | None = None,
                 clk_tck: int | None = None):
        self.root, self.clock, self.cpu_clock, self.gpu = Path(root), clock, cpu_clock, gpu
        try:
            self.clk_tck = clk_tck or os.sysconf("SC_CLK_TCK")
        except (ValueError, OSError, AttributeError):
            self.clk_tck = 100

    def tasks(self) -> dict[str, tuple[float, float]] | None:
        """{thread id: (exec s, wait s)} from /proc/self/task/*/schedstat; None where there is no schedstat."""
        base = self.root / "self" / "task"
        try:
            tids = os.listdir(base)
        except OSError:
            return None
        out = {}
        for tid in tids:
            text = _read(base / tid / "schedstat")
            if text is None:
                continue  # the thread ended between listdir and open
            parts = text.split()
            try:
                out[tid] = (int(parts[0]) / 1e9, int(parts[1]) / 1e9)
            except (IndexError, ValueError):
                return None
        return out or None

    def machine(self) -> tuple[tuple[float, float, float] | None, int | None]:
        """((busy, steal, total) seconds over every CPU, number of CPUs) from /proc/stat."""
        text = _read(self.root / "stat")
        if text is None:
            return None, None
        agg, ncpu = None, 0
        for line in text.splitlines():
            if line.startswith("cpu "):
                agg = line
            elif line.startswith("cpu") and line[3:4].isdigit():
                ncpu += 1
        if agg is None:
            return None, ncpu or None
        try:
            v = [int(x) for x in agg.split()[1:]]
        except ValueError:
            return None, ncpu or None
        v += [0] * (8 - len(v))
        user, nice, system, idle, iowait, irq, softirq, steal = v[:8]
        tck = float(self.clk_tck)
        busy = (user + nice + system + irq + softirq) / tck
        return (busy, steal / tck, (busy * tck + idle + iowait + steal) / tck), ncpu or None

    def load1(self) -> float | None:
        text = _read(self.root / "loadavg")
        try:
            return float(text.split()[0]) if text else None
        except (IndexError, ValueError):
            return None

    def psi_some(self) -> float | None:
        """Seconds some task waited for a CPU, machine-wide (PSI); None without /proc/pressure. Recorded for a
        person reading the record, not used by the rule (see the module docstring)."""
        text = _read(self.root / "pressure" / "cpu")
        if not text:
            return None
        for line in text.splitlines():
            if line.startswith("some"):
                for item in line.split():
                    if item.startswith("total="):
                        try:
                            return int(item[6:]) / 1e6
                        except ValueError:
                            return None
        return None

    def snapshot(self) -> Snapshot:
        """Everything at once; the clocks first and last so that the reading's own cost falls outside a chunk."""
        tasks = self.tasks()
        machine, ncpu = self.machine()
        snap = Snapshot(wall=0.0, cpu=0.0, threads=len(tasks) if tasks else None, tasks=tasks, machine=machine,
                        ncpu=ncpu, load1=self.load1(), psi_some_s=self.psi_some(),
                        gpu=self.gpu.state() if self.gpu is not None else None)
        snap.cpu, snap.wall, snap.epoch = self.cpu_clock(), self.clock(), time.time()
        return snap


# --- GPU (NVML) --------------------------------------------------------------------------------------------------
def others_busy(probe: Probe, seconds: float = 0.2, sleep: Callable[[float], None] = time.sleep
                ) -> tuple[float, int] | None:
    """(CPUs kept busy by other processes, CPUs of the machine) over `seconds` while this process sleeps: /proc/stat
    busy time less this process's own CPU time, per second of wall time; None where /proc/stat cannot say."""
    a = probe.snapshot()
    sleep(seconds)
    b = probe.snapshot()
    wall = b.wall - a.wall
    if a.machine is None or b.machine is None or not b.ncpu or wall <= 0:
        return None
    busy = (b.machine[0] - a.machine[0]) - max(0.0, b.cpu - a.cpu)
    return min(float(b.ncpu), max(0.0, busy / wall)), b.ncpu


class NvmlProbe:
    """The state of one GPU through NVML (`pynvml`, from the `nvidia-ml-py` package): SM clock, clock-event
    reasons, other compute processes. `nvml` is the module (a stub in tests); `device` an index or a "GPU-..."
    UUID (default: the first of CUDA_VISIBLE_DEVICES, else 0; NVML numbers GPUs in PCI bus order, so set
    CUDA_DEVICE_ORDER=PCI_BUS_ID for CUDA to number them alike); `proc` the /proc to read (a fake tree in tests).

    Which listed processes are ours (never contention): this process; in a paired timing its `siblings` (the other
    contenders, which never run at the same time as this one) and every process descended from `tree_root` (the
    coordinator: the contenders' own children and the coordinator itself, were it to hold a context). NVML lists
    processes by their pid in the *host's* pid namespace: where that is this process's namespace (a bare machine, a
    container sharing the host's pids), each listed pid is judged as above ("pid" matching); where it is not (a
    container with a pid namespace of its own: our own pid is then not in the list), pids cannot be matched and
    are counted instead: every listed process beyond this one and its siblings is another's ("count" matching; a
    contender's own child holding a context would then count as another's: none does in this harness)."""

    def __init__(self, nvml: Any, device: str | int | None = None, pid: int | None = None,
                 proc: str | Path = "/proc"):
        self.nvml, self.pid = nvml, os.getpid() if pid is None else pid
        self.siblings: set[int] = set()  # paired timing: the other contenders' processes (idle, not disturbing)
        self.tree_root: int | None = None  # paired timing: the coordinator; its descendants are ours
        self.proc = Path(proc)
        nvml.nvmlInit()
        if device is None:
            device = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0].strip() or "0"
        text = str(device)
        self.handle = (nvml.nvmlDeviceGetHandleByUUID(text) if text.startswith(("GPU-", "MIG-"))
                       else nvml.nvmlDeviceGetHandleByIndex(int(text)))
        self.sm = getattr(nvml, "NVML_CLOCK_SM", 1)

    def _reasons(self) -> int | None:
        for name in ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"):
            get = getattr(self.nvml, name, None)
            if get is None:
                continue
            try:
                return int(get(self.handle))
            except Exception:  # NVMLError_NotSupported and friends: try the older name, else unknown
                continue
        return None

    def parent(self, pid: int) -> int | None:
        """The parent of `pid` from /proc/PID/stat (None: gone, or not visible here). The command name (field 2)
        may hold spaces and parentheses, so the fields are read after its last ')'."""
        text = _read(self.proc / str(pid) / "stat")
        if not text or ")" not in text:
            return None
        fields = text[text.rindex(")") + 1:].split()
        try:
            return int(fields[1])
        except (IndexError, ValueError):
            return None

    def ours(self, pid: int) -> bool:
        """Whether listed process `pid` (in our pid namespace) is this process, a sibling or a descendant of
        `tree_root` (ancestors followed through /proc, at most 64 generations)."""
        if pid == self.pid or pid in self.siblings or pid == self.tree_root:
            return True
        if self.tree_root is None:
            return False
        for _ in range(64):
            up = self.parent(pid)
            if up is None or up <= 1:
                return False
            if up == self.tree_root or up in self.siblings:
                return True
            pid = up
        return False

    def state(self) -> dict:
        """{"sm_mhz", "reasons" (bit mask), "others" (other compute processes), "own_listed", "listed" (every
        compute process NVML lists), "match" ("pid" or "count", see the class)}; None per item that NVML refuses."""
        nvml, out = self.nvml, {}
        try:
            out["sm_mhz"] = int(nvml.nvmlDeviceGetClockInfo(self.handle, self.sm))
        except Exception:
            out["sm_mhz"] = None
        out["reasons"] = self._reasons()
        try:
            pids = [int(p.pid) for p in nvml.nvmlDeviceGetComputeRunningProcesses(self.handle)]
        except Exception:
            out.update(others=None, own_listed=None, listed=None, match=None)
            return out
        own = self.pid in pids
        out["others"] = (sum(1 for p in pids if not self.ours(p)) if own
                         else max(0, len(pids) - 1 - len(self.siblings)))
        out.update(own_listed=own, listed=len(pids), match="pid" if own else "count")
        return out


def nvml_probe(device: str | int | None = None) -> tuple[NvmlProbe | None, str]:
    """An NvmlProbe of the GPU this process uses, or (None, why not): NVML is optional (`pip install
    nvidia-ml-py`, in the `cuda` extra)."""
    try:
        import pynvml
    except ImportError:
        return None, "nvidia-ml-py is not installed (pip install nvidia-ml-py): no GPU contention evidence"
    try:
        return NvmlProbe(pynvml, device), ""
    except Exception as exc:
        return None, f"NVML did not answer ({type(exc).__name__}: {exc}): no GPU contention evidence"


# --- chunks ------------------------------------------------------------------------------------------------------
def chunk(a: Snapshot, b: Snapshot, first_step: int, steps: int) -> dict:
    """The evidence of one chunk of `steps` steps from `first_step`, between snapshots `a` and `b`."""
    wall = max(0.0, b.wall - a.wall)
    out: dict[str, Any] = {"step": int(first_step), "n": int(steps), "wall_s": wall, "cpu_s": max(0.0, b.cpu - a.cpu),
                           "threads": b.threads, "exec_s": None, "wait_s": None}
    if a.tasks is not None and b.tasks is not None:
        exec_s = wait_s = 0.0
        for tid, (e1, w1) in b.tasks.items():
            e0, w0 = a.tasks.get(tid, (0.0, 0.0))  # a thread started during the chunk counts from zero
            exec_s += max(0.0, e1 - e0)
            wait_s += max(0.0, w1 - w0)
        out["exec_s"], out["wait_s"] = exec_s, wait_s
    if a.machine is not None and b.machine is not None:
        busy, steal, total = (max(0.0, y - x) for x, y in zip(a.machine, b.machine))
        out.update(busy_s=busy, steal_s=steal, total_s=total, others_cpu_s=max(0.0, busy - out["cpu_s"]))
    out["ncpu"] = b.ncpu
    if a.epoch is not None:
        out["at"] = a.epoch
    out["load"] = [a.load1, b.load1]
    if a.psi_some_s is not None and b.psi_some_s is not None:
        out["psi_some_s"] = max(0.0, b.psi_some_s - a.psi_some_s)
    if a.gpu is not None or b.gpu is not None:
        out["gpu"] = [a.gpu, b.gpu]
    return out


def wait_fraction(c: dict) -> float | None:
    """Share of the threads' runnable time spent waiting for a CPU: wait / (wait + exec)."""
    w, e = c.get("wait_s"), c.get("exec_s")
    if w is None or e is None or w + e <= 0:
        return None
    return w / (w + e)


def steal_fraction(c: dict) -> float | None:
    s, t = c.get("steal_s"), c.get("total_s")
    return None if s is None or not t else s / t


# the short name of each kind of reason, as `summarize` counts them in a record's `reasons` (stored: never renamed)
CPU_WAIT, STEAL, GPU_OTHER, GPU_SLOWDOWN = "cpu wait", "steal", "gpu: other process", "gpu slowdown"


def reasons(c: dict) -> list[tuple[str, str]]:
    """Why chunk `c` is disturbed, by `RULE`: (kind, sentence) pairs, the kind one of CPU_WAIT, STEAL, GPU_OTHER,
    GPU_SLOWDOWN; empty: it is not. A sentence said twice (the same GPU state at both ends) is given once."""
    why = []
    w = wait_fraction(c)
    if w is not None and w > WAIT_MAX:
        why.append((CPU_WAIT, f"waited for a CPU {w:.0%} of the time"))
    s = steal_fraction(c)
    if s is not None and s > STEAL_MAX:
        why.append((STEAL, f"hypervisor steal {s:.0%}"))
    for state in c.get("gpu") or []:
        if not state:
            continue
        if state.get("others"):
            why.append((GPU_OTHER, f"{state['others']} other compute process(es) on the GPU"))
        slow = [name for bit, name in GPU_SLOWDOWNS.items() if (state.get("reasons") or 0) & bit]
        if slow:
            why.append((GPU_SLOWDOWN, "GPU " + ", ".join(slow)))
    return list(dict.fromkeys(why))


def judge(c: dict) -> list[str]:
    """Why chunk `c` is disturbed, by `RULE`, in words (empty: it is not)."""
    return [text for _, text in reasons(c)]


def evidence(chunks: list[dict]) -> str:
    """"schedstat" when the CPU part of the rule could be applied, "none" when it could not."""
    return "schedstat" if any(c.get("wait_s") is not None for c in chunks) else "none"


def _flags(chunks: list[dict], n_steps: int, bad: list[bool]) -> np.ndarray | None:
    """Per step 0..n_steps-1: True when its chunk is `bad` (one verdict per chunk); None without CPU evidence."""
    if not chunks or evidence(chunks) == "none":
        return None
    flags = np.zeros(n_steps, dtype=bool)
    for c, b in zip(chunks, bad):
        if b:
            flags[max(0, c["step"]):max(0, min(n_steps, c["step"] + c["n"]))] = True
    return flags


def disturbed_steps(chunks: list[dict], n_steps: int) -> np.ndarray | None:
    """Per step 0..n_steps-1: True when its chunk was judged disturbed; None without CPU evidence."""
    return _flags(chunks, n_steps, [bool(reasons(c)) for c in chunks])


def summarize(chunks: list[dict], n_steps: int, first: int) -> Contention:
    """`timings.contention` of a record: the share of steady steps disturbed, the rule, the evidence in short.
    `first`: the first steady step (harness.timing.steady.steady_start(n_steps)), used as given."""
    verdicts = [reasons(c) for c in chunks]  # each chunk judged once
    flags = _flags(chunks, n_steps, [bool(v) for v in verdicts])
    steady = max(0, n_steps - first)
    out = Contention(rule=RULE, evidence=evidence(chunks), chunks=len(chunks), steady_steps=steady)
    if flags is not None and steady > 0:
        bad = int(flags[first:].sum())
        out.disturbed_steps, out.contended_fraction, out.mostly_disturbed = bad, bad / steady, bad / steady > MOSTLY
    counts: dict[str, int] = {}
    for v in verdicts:
        for kind, _ in v:
            counts[kind] = counts.get(kind, 0) + 1
    out.disturbed_chunks = sum(1 for v in verdicts if v)
    out.reasons = counts
    ratios = [c["cpu_s"] / c["wall_s"] for c in chunks if c.get("wall_s")]
    waits = [w for w in map(wait_fraction, chunks) if w is not None]
    steals = [s for s in map(steal_fraction, chunks) if s is not None]
    others = [c["others_cpu_s"] / c["wall_s"] for c in chunks if c.get("others_cpu_s") is not None and c["wall_s"]]
    loads = [x for c in chunks for x in c.get("load") or [] if x is not None]
    out.cpu_per_wall = float(np.median(ratios)) if ratios else None
    out.wait_fraction_median = float(np.median(waits)) if waits else None
    out.wait_fraction_max = float(max(waits)) if waits else None
    out.steal_fraction_max = float(max(steals)) if steals else None
    out.others_cpus_median = float(np.median(others)) if others else None
    out.load_range = [min(loads), max(loads)] if loads else None
    out.threads_max = max((c["threads"] for c in chunks if c.get("threads")), default=None)
    out.ncpu = next((c["ncpu"] for c in reversed(chunks) if c.get("ncpu")), None)
    return out


def disturbed_tag(summary: Contention | None) -> str:
    """"mostly disturbed, 87% of steps" for a run whose `timings.contention` (`summarize`) is mostly disturbed,
    else "": every console line and table cell that shows such a run's speed carries it."""
    if summary is None or not summary.mostly_disturbed:
        return ""
    frac = summary.contended_fraction
    return "mostly disturbed" + (f", {frac:.0%} of steps" if isinstance(frac, (int, float)) else "")


def sentence(summary: Contention | None, name: str = "") -> str:
    """One line for a report: how much of the steady state was disturbed, and by what."""
    who = f"{name}: " if name else ""
    if summary is None:
        return f"{who}no contention evidence (no chunk of steps recorded)"
    if summary.contended_fraction is None:
        return f"{who}contention not measurable here (no per-thread schedstat)"
    frac, n = summary.contended_fraction, summary.steady_steps or 0
    if not summary.disturbed_steps:
        return f"{who}undisturbed ({n:,} steady steps, none judged disturbed)"
    why = ", ".join(sorted(summary.reasons, key=lambda k: -summary.reasons[k]))
    mark = "; mostly disturbed: kept out of speed verdicts" if summary.mostly_disturbed else ""
    clean = n - summary.disturbed_steps
    source = f"figures from the {clean:,} undisturbed ones" if clean else "figures from all of them (none undisturbed)"
    return f"{who}{frac:.0%} of {n:,} steady steps disturbed ({why}); {source}{mark}"


# --- the sampler the training loop drives --------------------------------------------------------------------------
@dataclass
class Sampler:
    """Cuts a training loop into chunks: `open(step)` at a boundary, `tick(done)` after every step (a clock read
    and one comparison, unless a chunk is due), `close(step)` before an evaluation and at the end. Chunks go to
    `chunks`."""

    probe: Probe
    chunk_s: float = CHUNK_S
    chunks: list[dict] = field(default_factory=list)
    _start: Snapshot | None = None
    _first: int = 0

    def open(self, step: int) -> None:
        """Start a chunk at step `step` (after an evaluation, a checkpoint, or at the start of training)."""
        self._start, self._first = self.probe.snapshot(), step

    def close(self, step: int) -> Snapshot | None:
        """End the open chunk at step `step` (exclusive); a chunk with no step is dropped. Returns the closing
        snapshot (None when no chunk was open)."""
        if self._start is None:
            return None
        end = self.probe.snapshot()
        if step > self._first:
            self.chunks.append(chunk(self._start, end, self._first, step - self._first))
        self._start = None
        return end

    def tick(self, done: int) -> None:
        """After every step: when the open chunk has lasted `chunk_s`, end it at step `done` and start the next one
        there. Between two steps nothing else runs, so the closing snapshot is also the next chunk's start: the
        machine is read once per boundary on the training loop's path, not twice."""
        if self._start is not None and self.probe.clock() - self._start.wall >= self.chunk_s:
            self._start, self._first = self.close(done), done


def default_probe(device: str = "cpu") -> tuple[Probe, str]:
    """The probe of this process: /proc, the real clocks, and NVML on CUDA when nvidia-ml-py is installed; with
    why there is no GPU evidence on CUDA ("" when there is, or on another device)."""
    gpu, note = nvml_probe() if device == "cuda" else (None, "")
    return Probe(gpu=gpu), note


