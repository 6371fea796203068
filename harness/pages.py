"""What every HTML page of the harness shares: the levels of a verdict, the one palette by meaning, inline code.

Every page (a run's or parity check's report, the index, a sweep's report, the kit's check page) colours a verdict by
what it means, in this palette and no other:

- `OK`, green: a pass, an agreement, a speed difference with a verdict ("torch 3× faster" with 3 seeds);
- `NEUTRAL`, grey: no verdict (one backend, an interval that includes "no difference", data too thin to carry one);
- `WARN`, amber: a caveat (a busy machine, an interrupted run, a record still being written);
- `ERROR`, red: a failure (a parity FAIL, losses that differ, a backend that failed, an unfair comparison).

An element takes the level of its own meaning, never the worst level of what surrounds it: a pass next to a caveat
stays green and the caveat is drawn beside it, amber. `css()` is the one stylesheet of those colours;
`inline()` is the one renderer of a message's Markdown-style inline code (`harness run`) into HTML.
"""

from __future__ import annotations

import re

from markupsafe import Markup, escape

# Levels of a verdict, a banner or a pill, best first.
OK, NEUTRAL, WARN, ERROR = "ok", "neutral", "warn", "error"
LEVELS = (OK, NEUTRAL, WARN, ERROR)
MEANING = {OK: "pass, agree, faster with a verdict", NEUTRAL: "no verdict", WARN: "a caveat", ERROR: "a failure"}

# level -> (text and border colour, background): each text colour on its background passes WCAG AA (4.5:1).
PALETTE = {
    OK: ("#237a35", "#ebfbee"),
    NEUTRAL: ("#495057", "#f1f3f5"),
    WARN: ("#a15c00", "#fff4e0"),
    ERROR: ("#c92a2a", "#fff0f0"),
}


def worse(a: str, b: str) -> str:
    """The worse of two levels (ERROR > WARN > NEUTRAL > OK): for what sums up several verdicts, e.g. an exit."""
    return max(a, b, key=LEVELS.index)


def css() -> Markup:
    """The palette as CSS: a custom property per level (`--ok`, `--ok-bg`, ...), the shape of a pill and a banner, and
    the rules that draw a pill, a banner, a verdict box and a table row (`tr.ok`) of each level in its colours."""
    rules = [":root { " + " ".join(f"--{lv}: {fg}; --{lv}-bg: {bg};" for lv, (fg, bg) in PALETTE.items()) + " }",
             ".banner { border-left: 6px solid; padding: 8px 14px; margin: 6px 0; border-radius: 4px; "
             "font-weight: 600; }",
             ".pill { display: inline-block; padding: 1px 8px; border-radius: 10px; font-size: 0.85em; "
             "font-weight: 600; }"]
    for lv in LEVELS:
        rules += [
            f".pill.{lv} {{ background: var(--{lv}-bg); color: var(--{lv}); }}",
            f".banner.{lv} {{ border-color: var(--{lv}); background: var(--{lv}-bg); color: var(--{lv}); }}",
            f".verdict.{lv} {{ border-left: 8px solid var(--{lv}); background: var(--{lv}-bg); }}",
            f".verdict.{lv} > .label {{ color: var(--{lv}); }}",
            f"tr.{lv} > td {{ background: var(--{lv}-bg); }}",
        ]
    rules.append(".num { white-space: nowrap; font-variant-numeric: tabular-nums; }")
    return Markup("\n".join(rules))


_CODE = re.compile(r"`([^`\n]+)`")
# A number in scientific notation (2.86e-07, -1.4E+01): never broken at its sign across lines.
_SCI = re.compile(r"(?<![\w.])[-+−]?\d+(?:\.\d+)?[eE][-+−]?\d+\b")


def _numbers(text: str) -> str:
    """Escaped `text` with each number in scientific notation kept on one line."""
    out, last = [], 0
    for m in _SCI.finditer(text):
        out += [escape(text[last:m.start()]), Markup('<span class="num">{}</span>').format(m.group())]
        last = m.end()
    out.append(escape(text[last:]))
    return "".join(out)


def inline(text: object) -> Markup:
    """A message as HTML: everything escaped, `inline code` (Markdown's backticks) as <code>, and numbers in
    scientific notation unbroken (`.num`). Nothing else of Markdown is read, so no message can bring markup."""
    s = "" if text is None else str(text)
    out, last = [], 0
    for m in _CODE.finditer(s):
        out += [_numbers(s[last:m.start()]), str(Markup("<code>{}</code>").format(m.group(1)))]
        last = m.end()
    out.append(_numbers(s[last:]))
    return Markup("".join(out))
