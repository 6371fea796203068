"""`harness kit check`'s page: the verdict as one self-contained HTML file, in the reports' palette
(harness.pages: green pass, red failure, grey not given) with their one renderer of messages."""

from __future__ import annotations

import math
from typing import Any

from markupsafe import escape as e

from harness.pages import ERROR, NEUTRAL, OK, css, inline

_ROW_LEVEL = {"ok": OK, "FAIL": ERROR, "not given": NEUTRAL}  # a check's result -> its level in the palette


def _row(r: dict[str, Any]) -> str:
    """One check of the table: its row in the colour of its result, numbers never broken across lines."""
    value = "-" if r["result"] == "not given" else e(format(r["value"], ".2e"))
    level = _ROW_LEVEL.get(r["result"], NEUTRAL)
    return (f"<tr class='{level}'><td>{e(r['check'])}</td>"
            f"<td class='num'>{value}</td><td class='num'>{e(format(r['tolerance'], 'g'))}</td>"
            f"<td><span class='pill {level}'>{e(r['result'])}</span></td><td>{e(str(r['first_broken']))}</td>"
            f"<td>{e(str(r['worst']))}</td></tr>")


def render_html(verdict: dict[str, Any], rows: list[dict[str, Any]], table: str) -> str:
    """A small self-contained page (inline CSS, no scripts, no external files). The failure is stated once: the
    banner says where it first breaks, the "First broken" section says why, the other failed checks follow."""
    ok = verdict["verdict"] == "pass"
    body_rows = "".join(_row(r) for r in rows)
    res = verdict["results"]
    cols = {title: res[key]["rel_err"] for key, title in (("gradients", "dropout off"),
                                                          ("dropout_gradients", "dropout masks")) if res.get(key)}
    names = list(next(iter(cols.values()))) if cols else []
    grad_rows = ("<tr><th>parameter</th>" + "".join(f"<th>{e(t)}</th>" for t in cols) + "</tr>"
                 + "".join(f"<tr><td>{e(n)}</td>" + "".join(f"<td class='num'>{c.get(n, math.nan):.2e}</td>"
                                                            for c in cols.values()) + "</tr>" for n in names))
    diag = verdict.get("diagnosis")
    named = "" if not diag else (f": tap <code>{e(diag['tap'])}</code>" if diag.get("tap") else
                                 f": parameter <code>{e(str(diag['parameter']))}</code>" if diag.get("parameter")
                                 else "")
    diag_html = "" if not diag else (
        f"<h2>First broken</h2><p><b>{e(diag['depth'])}</b>{named}</p><p>{inline(diag.get('detail') or '')}</p>"
        f"<p>Likely cause: {inline(diag['cause'])}</p>")
    others = verdict.get("other_failures") or []
    fails = "".join(f"<li>{inline(f)}</li>" for f in others)
    blind = "".join(f"<li><b>{e(d)}</b>: {inline(text)}</li>" for d, text in (verdict.get("blind_spots") or {}).items())
    hint = (f"<p><b>Hint:</b> {inline(verdict['hint'])}</p>" if verdict.get("hint") and verdict["hint"] != (diag or {})
            .get("cause") else "")
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>kit check: {e(verdict['verdict'])}</title>
<style>
{css()}
body {{ font: 15px/1.45 system-ui, sans-serif; max-width: 60rem; margin: 2rem auto; padding: 0 1rem; color: #222; }}
table {{ border-collapse: collapse; margin: 1rem 0; }} td, th {{ border: 1px solid #ccc; padding: .25rem .6rem; }}
tr.neutral td {{ color: #5c636a; }} td.num {{ white-space: nowrap; }}
code, pre {{ font-family: ui-monospace, monospace; }}
</style></head><body>
<h1>nanoGPT conformance kit: check</h1>
<p class="banner {OK if ok else ERROR}">{'PASS' if ok else 'FAIL'}: {inline(verdict['summary'])}</p>
<p>Kit <code>{e(verdict['kit'])}</code> ({e(str(verdict['config_name']))}, {verdict['steps']} steps, dropout
{verdict['dropout']:g}, seed {verdict['seed']}); results <code>{e(verdict['results_file'])}</code>,
{e(verdict['dtype'])} against the float64 oracle; tolerances of the {e(verdict['precision_pair'])} pair,
as <code>harness parity</code>.</p>
<table><tr><th>check</th><th>value</th><th>tolerance</th><th>result</th><th>first broken</th><th>worst</th></tr>
{body_rows}</table>
{diag_html}
{hint}
{'<h2>Other checks that failed</h2><ul>' + fails + '</ul>' if fails else ''}
{'<h2>Step-0 gradient relative error per parameter</h2><table>' + grad_rows + '</table>' if names else ''}
{'<h2>What the depths given cannot see</h2><ul>' + blind + '</ul>' if blind else ''}
</body></html>
"""
