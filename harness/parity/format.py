"""Parity's results as text tables (pandas): the summary `harness parity` and `harness kit check` print, and the
per-parameter errors of `--per-parameter`."""

from __future__ import annotations

from typing import Any

from harness.parity.numeric import fmt, worst_key
from harness.parity.result import ParityResult
from harness.parity.states import OPT_QUANTITIES


def format_rows(rows: list[dict[str, Any]]) -> str:
    """Summary rows (`ParityResult.rows`, or the kit's with "not given" for the depths a port left out: their value
    shows as "-") as the table both commands print."""
    import pandas as pd

    df = pd.DataFrame(rows).set_index("check")
    df["value"] = [("-" if r["result"] in ("not given",) else fmt(r["value"])) for r in rows]
    df["tolerance"] = df["tolerance"].map(lambda v: f"{v:g}")
    df = df.rename(columns={"first_broken": "first broken"})
    return df[["value", "tolerance", "result", "first broken", "worst"]].to_string()


def format_table(result: ParityResult) -> str:
    """The summary table of `result` as text."""
    return format_rows(result.rows())


def format_gradients(result: ParityResult) -> str:
    """Per-parameter gradient relative errors as text, worst first."""
    import pandas as pd

    items = sorted(result.grad_rel_err.items(), key=lambda kv: worst_key(kv[1]), reverse=True)
    df = pd.DataFrame({"rel err": [fmt(v) for _, v in items]}, index=[k for k, _ in items])
    df.index.name = "parameter"
    return df.to_string()


def format_optimizer(result: ParityResult) -> str:
    """Per-parameter optimizer-step relative errors (update, m, v; worst over the steps) as text, worst first."""
    import pandas as pd

    names = sorted({n for step in result.opt_rel_err.values() for errs in step.values() for n in errs})
    table = {q: [max((step[q].get(n, 0.0) for step in result.opt_rel_err.values()), key=worst_key) for n in names]
             for q in OPT_QUANTITIES}
    df = pd.DataFrame(table, index=names)
    df = df.loc[df.max(axis=1).sort_values(ascending=False).index].map(fmt)
    df.index.name = "parameter"
    return df.to_string()
