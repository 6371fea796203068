"""Which checks fit the budget: one rule for the run (`pick`, with the time really left) and for `--plan`
(`simulate`, call after call on the estimates).

Checks go in their fixed order. A check starts only when its estimate fits the time left; one that does not is
passed over ("not run: budget") and a later, shorter one may still fit. Untimed checks (parity, doctor) next to each
other run side by side, up to --jobs at once: their group's estimate is max(longest, total / jobs).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from gpucheck.plan import TIERS

PREFLIGHT = "preflight"
RESERVE_S = 3.0  # kept back from the budget for the last summary


def group_estimate(group: list[Any], jobs: int) -> float:
    return max(max(c.estimate_s for c in group), sum(c.estimate_s for c in group) / max(1, jobs))


def pick(pending: list[Any], left: float | None, jobs: int) -> tuple[list[Any], list[Any]]:
    """(the next group to run, the checks passed over because their estimate exceeds `left`): the first pending
    check that fits, alone when it is timed, else with the untimed checks right after it that fit beside it."""
    over: list[Any] = []
    for i, c in enumerate(pending):
        if left is not None and c.estimate_s > left:
            over.append(c)
            continue
        group = [c]
        if c.untimed:
            for d in pending[i + 1:]:
                if not d.untimed or len(group) >= jobs:
                    break
                if left is None or group_estimate([*group, d], jobs) <= left:
                    group.append(d)
        return group, over
    return [], over


def simulate(checks: list[Any], budget: float | None, jobs: int, done: Iterable[str] = (),
             calls_max: int = 20) -> tuple[dict[str, int | None], dict[int, float]]:
    """The call (1, 2, ...) in which each check would run, calling again and again with `budget` seconds, on the
    estimates (0: done already; None: it fits no call of that budget), and the seconds each call would take. The
    preflight runs in every call."""
    pre = next((c for c in checks if c.name == PREFLIGHT), None)
    where: dict[str, int | None] = {c.name: (0 if c.name in set(done) else None) for c in checks}
    pending = [c for c in checks if where[c.name] is None and c.name != PREFLIGHT]
    used: dict[int, float] = {}
    for call in range(1, calls_max + 1):
        if pre is not None:
            where[PREFLIGHT] = 1 if where[PREFLIGHT] is None else where[PREFLIGHT]
        used[call] = pre.estimate_s if pre else 0.0
        left = None if budget is None else budget - used[call] - RESERVE_S
        queue, ran = list(pending), False
        while queue:
            group, over = pick(queue, left, jobs)
            queue = [c for c in queue if c not in group and c not in over]
            for c in group:
                where[c.name], ran = call, True
            if group:
                used[call] += group_estimate(group, jobs)
                left = None if left is None else left - group_estimate(group, jobs)
        pending = [c for c in pending if where[c.name] is None]
        if not pending or not ran:
            break
    return where, {k: v for k, v in used.items() if any(w == k for w in where.values())}


def plan_text(checks: list[Any], budget: float | None, jobs: int, done: dict[str, str], source: str) -> str:
    """`--plan`: the order by tier, each check's estimate and the call it fits in, and the calls' totals."""
    where, used = simulate(checks, budget, jobs, done)
    lines = [f"GPU check plan: {len(checks)} checks in priority order; estimates: {source}",
             f"calls of {budget:g} s each (--budget)" if budget else "one call (no --budget)", ""]
    for tier in sorted({c.tier for c in checks}):
        lines.append(f"tier {tier}: {TIERS.get(tier, '')}")
        for c in (c for c in checks if c.tier == tier):
            call = where[c.name]
            at = (f"done earlier ({done[c.name]})" if call == 0 else "fits no call of this budget" if call is None
                  else f"call {call}")
            needs = ", ".join(f"{p} (else without {c.optional[p]})" if p in c.optional else p
                              for p in sorted(c.needs - {"harness"}))
            lines.append(f"  {c.name:<34} {c.estimate_s:6.0f} s  {at:<12}{'  needs ' + needs if needs else ''}")
    lines.append("")
    for call in sorted(used):
        tiers = sorted({c.tier for c in checks if where[c.name] == call})
        lines.append(f"call {call}: about {used[call]:.0f} s (untimed checks {jobs} at once); tiers "
                     f"{', '.join(map(str, tiers))}")
    never = [c.name for c in checks if where[c.name] is None]
    if never:
        lines.append(f"longer than a call of {budget:g} s: {', '.join(never)}")
    return "\n".join(lines)
