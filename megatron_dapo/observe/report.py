"""``<run_dir>/report.html``: one static page to read a run by, wherever the run dir was copied to.

    python -m megatron_dapo.observe.report RUN_DIR      (then open RUN_DIR/report.html)

The page is self-contained (the curves are a base64 data URI, the style is inline, no script and
nothing fetched), so it can be mailed, attached to a ticket or opened from a laptop's copy of the
run dir. Sections, with element ids the tests look up: the curves (``id="curves"``), the latest
key numbers (``id="numbers"``), the alarm events of alarms.jsonl, newest first (``id="alarms"``),
and the latest regular sample dump with links to the newest alarm dumps (``id="samples"``).

Every piece is optional: a run with no metrics, no alarms or no dumps still gets a page that says
so, and nothing here raises on what a run lacks. All text from the run (responses are model
output: ``<script>``, ``&``) is HTML-escaped.
"""

from __future__ import annotations

import base64
import html
import sys
from pathlib import Path

from megatron_dapo import plotting
from megatron_dapo.observe.alarms import read_events
from megatron_dapo.observe.audit import answer_line
from megatron_dapo.observe.rows import SampleRow, dump_files, read_rows

REPORT_FILE = "report.html"
MAX_ALARMS = 50
MAX_SAMPLES = 16
MAX_ALARM_DUMPS = 10
# The numbers a reader checks first; the held-out keys are added for the largest n logged.
KEY_NUMBERS = ("reward/acc_mean", "response_length/mean", "actor/entropy")

_STYLE = """body{font-family:sans-serif;margin:1.5em;max-width:1300px}
table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ccc;padding:2px 8px;text-align:left}
pre{white-space:pre-wrap;background:#f6f6f6;padding:.5em;max-height:30em;overflow:auto}
mark{background:#ffe066}.sample{border-top:1px solid #aaa;margin-top:1em}.bad{color:#b00}
img{max-width:100%}"""


def esc(value) -> str:
    """Any value as HTML text: model output and file contents are never markup."""
    return html.escape(str(value), quote=True)


def write_report(run_dir: str | Path) -> Path | None:
    """Writes ``<run_dir>/report.html`` (temporary name, then rename) and returns its path; None
    when the run dir cannot be written (a report is never worth failing a run for)."""
    run_dir = Path(run_dir)
    body = "\n".join([f"<h1>Run {esc(run_dir)}</h1>"] + [_section(ident, title, fn, run_dir)
                                                         for ident, title, fn in _SECTIONS])
    page = (f'<!DOCTYPE html>\n<html><head><meta charset="utf-8"><title>{esc(run_dir)}</title>'
            f"<style>{_STYLE}</style></head>\n<body>\n{body}\n</body></html>\n")
    out = run_dir / REPORT_FILE
    try:
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(page, encoding="utf-8")
        tmp.replace(out)
    except OSError as e:
        print(f"megatron-dapo: no {REPORT_FILE} ({e})", file=sys.stderr)
        return None
    return out


def _section(ident: str, title: str, fn, run_dir: Path) -> str:
    """One section; a piece of the run that cannot be read (a garbled file) costs that section's
    content only, never the page."""
    try:
        content = fn(run_dir)
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
        content = f'<p class="bad">could not be read: {esc(type(e).__name__)}: {esc(e)}</p>'
    return f'<section id="{ident}"><h2>{esc(title)}</h2>\n{content}\n</section>'


def _curves(run_dir: Path) -> str:
    """curves.png inline; drawn first when missing or older than metrics.jsonl (a run still going,
    or resumed since its last plot, would otherwise show stale curves)."""
    png, metrics = run_dir / "curves.png", run_dir / "metrics.jsonl"
    if metrics.is_file() and (not png.is_file() or png.stat().st_mtime < metrics.stat().st_mtime):
        plotting.plot_run(run_dir)
    if not png.is_file():
        return "<p>no curves (no metrics.jsonl, or nothing to plot)</p>"
    data = base64.b64encode(png.read_bytes()).decode("ascii")
    return f'<img alt="training curves" src="data:image/png;base64,{data}">'


def _numbers(run_dir: Path) -> str:
    """The latest value of each key number with the step it was logged at (evaluation runs only on
    some steps, so the last record alone often lacks it)."""
    path = run_dir / "metrics.jsonl"
    series = plotting.load_series(path) if path.is_file() else {}
    if not series:
        return "<p>no metrics.jsonl records</p>"
    last_step = max(steps[-1] for steps, _ in series.values())
    held_out = [k for k in plotting.held_out(series) if "/pass@" not in k]
    rows = [f"<tr><th>step</th><td>{last_step}</td><td></td></tr>"]
    for key in (*held_out, *KEY_NUMBERS):
        steps, values = series.get(key, ([], []))
        value, at = (f"{values[-1]:.4g}", f"step {steps[-1]}") if steps else ("-", "not logged")
        rows.append(f"<tr><th>{esc(key)}</th><td>{esc(value)}</td><td>{esc(at)}</td></tr>")
    return "<table>" + "".join(rows) + "</table>"


def newest_alarms(run_dir: Path) -> list[dict]:
    """alarms.jsonl's events, newest first (by step; the later line first within a step); an event
    without a step is skipped, a missing file gives none."""
    events = []
    for event in reversed(read_events(run_dir)):
        try:
            events.append({**event, "step": int(event["step"])})
        except (ValueError, KeyError, TypeError):
            continue
    return sorted(events, key=lambda e: -e["step"])


def _alarms(run_dir: Path) -> str:
    events = newest_alarms(run_dir)
    if not events:
        return "<p>no alarms</p>"
    head = "<tr><th>step</th><th>alarm</th><th>value</th><th>threshold</th><th>message</th></tr>"
    rows = [f'<tr class="alarm"><td>{e["step"]}</td><td>{esc(e.get("alarm", "?"))}</td>'
            f'<td>{esc(_num(e.get("value")))}</td><td>{esc(_num(e.get("threshold")))}</td>'
            f'<td>{esc(e.get("message", ""))}</td></tr>' for e in events[:MAX_ALARMS]]
    more = f"<p>{len(events) - MAX_ALARMS} older events not shown</p>" if len(events) > MAX_ALARMS else ""
    return f"<p>{len(events)} events</p><table>{head}{''.join(rows)}</table>{more}"


def _num(value) -> str:
    return f"{value:.4g}" if isinstance(value, (int, float)) and not isinstance(value, bool) else str(value)


def _samples(run_dir: Path) -> str:
    """The latest regular dump's first rows (whole groups come first) and the newest alarm dumps."""
    files = dump_files(run_dir)
    regular = [p for p in files if p.name.startswith("step_")]
    alarm_dumps = [p for p in files if p.name.startswith("alarm_")][::-1][:MAX_ALARM_DUMPS]
    parts = []
    if regular:
        rows = read_rows(regular[-1])
        shown = min(len(rows), MAX_SAMPLES)
        parts.append(f"<p>{esc(regular[-1].name)}: {shown} of {len(rows)} responses</p>")
        parts += [_sample(row) for row in rows[:MAX_SAMPLES]]
    else:
        parts.append("<p>no sample dumps</p>")
    if alarm_dumps:
        links = "".join(f'<li><a href="samples/{esc(p.name)}">{esc(p.name)}</a></li>' for p in alarm_dumps)
        parts.append(f"<h3>Newest alarm dumps</h3><ul>{links}</ul>")
    return "\n".join(parts)


def _sample(row: SampleRow) -> str:
    """One response: who it is, what each scorer said, and its text with the answer line marked."""
    verdicts = f"{esc(row.scorer)}: {_verdict(row.acc)}"
    if row.audit_scorer:
        verdicts += f", {esc(row.audit_scorer)}: {_verdict(row.audit_acc)}"
    flags = ", ".join(esc(f) for f in row.flags) or "none"
    return (f'<div class="sample"><p>{esc(row.phase)} step {row.step}, prompt {row.prompt_index}, '
            f"response {row.response_index} ({row.response_tokens} tokens, {esc(row.finish_reason)})<br>"
            f"verdict {verdicts}<br>pred <code>{esc(row.pred)}</code> vs ground truth "
            f"<code>{esc(row.ground_truth)}</code><br>flags: {flags}</p>"
            f"<details><summary>prompt</summary><pre>{esc(row.prompt)}</pre></details>"
            f"<pre>{marked(row.response)}</pre></div>")


def _verdict(acc) -> str:
    return "-" if acc is None else ("correct" if acc else '<span class="bad">wrong</span>')


def marked(text: str) -> str:
    """``text`` escaped, its answer line (the one the scorers read, observe/audit.py) in <mark>."""
    line = answer_line(text)
    at = text.rfind(line) if line else -1
    if at < 0:
        return esc(text)
    return f"{esc(text[:at])}<mark>{esc(line)}</mark>{esc(text[at + len(line):])}"


_SECTIONS = (("curves", "Curves", _curves), ("numbers", "Latest numbers", _numbers),
             ("alarms", "Alarms", _alarms), ("samples", "Latest samples", _samples))

if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m megatron_dapo.observe.report RUN_DIR")
    written = write_report(sys.argv[1])
    print(written or "no report written")
    sys.exit(0 if written else 1)
