"""An incident's report as one self-contained HTML page: no external assets, no script.

Two pictures, on two axes, so that the costs of a failure are never added up by mistake:
- wall clock since the failure: every phase on its own row, the node-replacement time (failure to
  spare in service) and the time to resume (failure to training again);
- each job's training progress in steps: how far it got before the failure, the checkpoint it
  resumed from, the incomplete checkpoints it skipped, and the progress lost in between.
Then the tables behind them: phases, jobs, alerts and every action taken (the audit trail).

Elements carry classes and data attributes (phase, replacement, resume, lost-progress,
checkpoint resumed/skipped) that the tests look for in a browser.
"""

from __future__ import annotations

import math
import re
from datetime import datetime
from html import escape
from pathlib import Path

from contracts.models import IncidentReport, JobReport, Phase

WIDTH = 960
LABEL_WIDTH = 200  # the row labels, left of the plot
RIGHT_MARGIN = 40
ROW = 24
BAR = 14
PLOT_WIDTH = WIDTH - LABEL_WIDTH - RIGHT_MARGIN
CHARACTER_WIDTH = 7  # about, at the notes' 12 px
COLOURS = {
    "phase": "#3b6fb6",
    "skipped": "#9aa5b1",
    "replacement": "#d9822b",
    "resume": "#2e8b57",
    "trained": "#9cc3e6",
    "lost": "#c0392b",
    "checkpoint": "#1d5d2f",
    "failure": "#c0392b",
}
_STEP_OF_CHECKPOINT = re.compile(r"(\d+)$")


def write_report_html(report: IncidentReport, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_report_html(report), encoding="utf-8")
    return path


def render_report_html(report: IncidentReport) -> str:
    progress = "".join(_job_progress(job) for job in report.jobs) or "<p>No job ran on the node.</p>"
    return f"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>Incident {escape(report.incident_id)}</title>
<style>{_CSS}</style>
</head>
<body>
<header>
<h1>Incident {escape(report.incident_id)}</h1>
<p class="outcome {"good" if report.outcome in ("recovered", "no_node_action") else "bad"}">{escape(report.outcome)}</p>
</header>
{_summary(report)}
<section id="timeline"><h2>Wall clock since the failure</h2>
{_time_svg(report)}
<p class="legend">{
        _legend(
            ("phase", "phase"),
            ("skipped", "phase skipped"),
            ("replacement", "node replacement"),
            ("resume", "time to resume"),
        )
    }</p>
</section>
<section id="progress"><h2>Training progress</h2>
<p>Counted in training steps, apart from the wall clock above: what a job lost is the training between
the checkpoint it resumed from and the last step it had reached.</p>
{progress}
<p class="legend">{_legend(("trained", "trained before the failure"), ("lost", "lost progress"))}
<span style="color:{COLOURS["checkpoint"]}">◆</span> checkpoint resumed from
<span style="color:{COLOURS["lost"]}">⊗</span> incomplete checkpoint, skipped</p>
</section>
{_phase_table(report)}
{_jobs_table(report)}
{_goodput_table(report)}
{_alerts_table(report)}
{_actions_table(report)}
</body>
</html>
"""


# --- the summary --------------------------------------------------------------------------------


def _summary(r: IncidentReport) -> str:
    lost = (
        "-"
        if r.lost_steps is None
        else f"{r.lost_steps} steps, {_seconds(r.lost_seconds)} of training"
        f" (resumed at step {_value(r.resumed_step)}, latest complete checkpoint step {_value(r.latest_complete_step)})"
    )
    rows = [
        ("node", r.node),
        ("XID", f"{r.xid} ({r.fault_class.value})"),
        ("action", r.action),
        ("failure at", _time(r.failure_at)),
        ("spare", r.spare_node or "-"),
        ("node replacement", _seconds(r.replacement_seconds)),
        ("time to resume", _seconds(r.time_to_resume_seconds)),
        ("lost training progress", lost),
    ]
    items = "".join(f"<dt>{escape(k)}</dt><dd>{escape(v)}</dd>" for k, v in rows)
    return f'<dl class="summary">{items}</dl>'


# --- wall clock ---------------------------------------------------------------------------------


def _time_svg(r: IncidentReport) -> str:
    spans = [(_offset(r, p.started_at), _offset(r, p.ended_at) if p.ended_at else None) for p in r.phases]
    ends = [end for _, end in spans if end is not None] + [
        s for s in (r.replacement_seconds, r.time_to_resume_seconds) if s is not None
    ]
    start = min([0.0] + [s for s, _ in spans])
    scale = _Scale(start, max([1.0] + ends), PLOT_WIDTH)
    rows: list[str] = []
    for (begin, end), phase in zip(spans, r.phases):
        rows.append(_phase_row(len(rows), phase, begin, end, scale))
    for css, label, seconds, what in (
        (
            "replacement",
            "node replacement",
            r.replacement_seconds,
            f"failure to spare {r.spare_node or '-'} in service",
        ),
        ("resume", "time to resume", r.time_to_resume_seconds, "failure to training again"),
    ):
        rows.append(_interval_row(len(rows), css, label, seconds, what, scale))
    height = len(rows) * ROW
    failure = (
        f'<line class="failure" x1="{scale.x(0):.1f}" x2="{scale.x(0):.1f}" y1="0" y2="{height}" '
        f'stroke="{COLOURS["failure"]}" stroke-dasharray="4 3"><title>the failure</title></line>'
    )
    return _svg(rows, failure, _axis(scale, height, "s"), height)


def _phase_row(index: int, phase: Phase, begin: float, end: float | None, scale: _Scale) -> str:
    skipped = phase.result.startswith("skipped")
    css = "phase skipped" if skipped else "phase"
    x, width = scale.x(begin), scale.width(begin, end if end is not None else begin)
    duration = "running" if end is None else _seconds(end - begin)
    fill = COLOURS["skipped"] if skipped else COLOURS["phase"]
    mark = (
        f'<rect x="{x - 1:.1f}" y="{_bar_y(index)}" width="3" height="{BAR}" fill="{fill}"/>'
        if skipped
        else f'<rect x="{x:.1f}" y="{_bar_y(index)}" width="{max(width, 2):.1f}" height="{BAR}" fill="{fill}"/>'
    )
    note = f'<text x="{x + max(width, 2) + 6:.1f}" y="{_text_y(index)}" class="note">{escape(duration)}</text>'
    return (
        f'<g class="{css}" data-phase="{escape(phase.name)}" data-start="{begin:.3f}" '
        f'data-duration="{"" if end is None else f"{end - begin:.3f}"}">'
        f"<title>{escape(phase.name)}: {escape(duration)}; {escape(phase.result)}</title>"
        f"{_label(index, phase.name)}{mark}{note}</g>"
    )


def _interval_row(index: int, css: str, label: str, seconds: float | None, what: str, scale: _Scale) -> str:
    if seconds is None:
        return f'<g class="{css} unknown">{_label(index, label)}{_note(index, scale.x(0) + 6, "not measured")}</g>'
    x, width = scale.x(0), scale.width(0, seconds)
    return (
        f'<g class="{css}" data-seconds="{seconds:.3f}">'
        f"<title>{escape(label)}: {_seconds(seconds)} ({escape(what)})</title>"
        f'{_label(index, label)}<rect class="{css}" x="{x:.1f}" y="{_bar_y(index)}" width="{max(width, 2):.1f}" '
        f'height="{BAR}" fill="{COLOURS[css]}"/>{_note(index, x + max(width, 2) + 6, _seconds(seconds))}</g>'
    )


# --- training progress --------------------------------------------------------------------------


def _job_progress(job: JobReport) -> str:
    title = f"<h3>job {job.job_id}: {', '.join(job.nodes_before)} → {', '.join(job.nodes_after) or '-'}</h3>"
    if job.resumed_step is None or job.last_step_before_failure is None:
        why = "; ".join(job.why_not) or "it did not report where it resumed"
        return f'{title}<p class="not-resumed">Not resumed: {escape(why)}</p>'
    skipped = [(s.checkpoint_id, _checkpoint_step(s.checkpoint_id), s.why) for s in job.skipped_checkpoints]
    steps = [job.last_step_before_failure, job.resumed_step] + [step for _, step, _ in skipped if step is not None]
    scale = _Scale(0, max(max(steps), 1), PLOT_WIDTH)
    trained = (
        f'<g class="trained">{_label(0, "trained before the failure")}'
        f'<rect x="{scale.x(0):.1f}" y="{_bar_y(0)}" width="{scale.width(0, job.last_step_before_failure):.1f}" '
        f'height="{BAR}" fill="{COLOURS["trained"]}"/>'
        f"{_note(0, scale.x(job.last_step_before_failure) + 6, f'step {job.last_step_before_failure}')}</g>"
    )
    lost_width = scale.width(job.resumed_step, job.last_step_before_failure)
    lost_text = f"lost {_value(job.lost_steps)} steps, {_seconds(job.lost_seconds)} of training"
    lost = (
        f'<g class="lost" data-steps="{_value(job.lost_steps)}" data-seconds="{_value(job.lost_seconds)}">'
        f"<title>{escape(lost_text)}</title>{_label(1, 'lost progress')}"
        f'<rect class="lost-progress" x="{scale.x(job.resumed_step):.1f}" y="{_bar_y(1)}" '
        f'width="{max(lost_width, 2):.1f}" height="{BAR}" fill="url(#hatch)" stroke="{COLOURS["lost"]}"/>'
        f"{_note_beside(1, scale.x(job.resumed_step), scale.x(job.resumed_step) + max(lost_width, 2), lost_text)}</g>"
    )
    marks = [
        _checkpoint_mark(
            2,
            "resumed",
            f"step-{job.resumed_step:09d}",
            job.resumed_step,
            f"resumed from step {job.resumed_step}",
            scale,
        )
    ]
    marks += [
        _checkpoint_mark(2, "skipped", checkpoint_id, step, f"skipped {checkpoint_id}: {why}", scale)
        for checkpoint_id, step, why in skipped
        if step is not None
    ]
    checkpoints = f'<g class="checkpoints">{_label(2, "checkpoints")}{"".join(marks)}</g>'
    height = 3 * ROW
    return title + _svg([trained, lost, checkpoints], "", _axis(scale, height, " steps"), height)


def _checkpoint_mark(index: int, kind: str, checkpoint_id: str, step: int, text: str, scale: _Scale) -> str:
    x, y = scale.x(step), _bar_y(index) + BAR / 2
    if kind == "resumed":
        r = BAR / 2
        shape = (
            f'<polygon points="{x:.1f},{y - r:.1f} {x + r:.1f},{y:.1f} {x:.1f},{y + r:.1f} {x - r:.1f},{y:.1f}" '
            f'fill="{COLOURS["checkpoint"]}"/>'
        )
    else:
        r = BAR / 2 - 1
        shape = (
            f'<circle cx="{x:.1f}" cy="{y:.1f}" r="{r:.1f}" fill="white" stroke="{COLOURS["lost"]}" stroke-width="2"/>'
            f'<path d="M{x - 3:.1f},{y - 3:.1f} L{x + 3:.1f},{y + 3:.1f} '
            f'M{x - 3:.1f},{y + 3:.1f} L{x + 3:.1f},{y - 3:.1f}" '
            f'stroke="{COLOURS["lost"]}" stroke-width="2"/>'
        )
    return (
        f'<g class="checkpoint {kind}" data-checkpoint="{escape(checkpoint_id)}" data-step="{step}">'
        f"<title>{escape(text)}</title>{shape}</g>"
    )


def _checkpoint_step(checkpoint_id: str) -> int | None:
    match = _STEP_OF_CHECKPOINT.search(checkpoint_id)
    return int(match.group(1)) if match else None


# --- SVG pieces ---------------------------------------------------------------------------------


class _Scale:
    """Values from lo to hi onto width pixels right of the labels, with a little room at the end."""

    def __init__(self, lo: float, hi: float, width: float):
        self.lo, self.hi, self.pixels = lo, hi * 1.05, width

    def x(self, value: float) -> float:
        return LABEL_WIDTH + (value - self.lo) / (self.hi - self.lo) * self.pixels

    def width(self, start: float, end: float) -> float:
        return max(0.0, (end - start) / (self.hi - self.lo) * self.pixels)

    def ticks(self) -> list[float]:
        """Round values (1, 2 or 5 times a power of ten) about a sixth of the range apart."""
        raw = (self.hi - self.lo) / 6
        power = 10 ** math.floor(math.log10(raw))
        step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
        first = math.ceil(self.lo / step) * step
        return [first + i * step for i in range(int((self.hi - first) / step) + 1)]


def _svg(rows: list[str], overlay: str, axis: str, height: int) -> str:
    total = height + 30
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{total}" viewBox="0 0 {WIDTH} {total}" '
        f'role="img">{_HATCH}{"".join(rows)}{overlay}{axis}</svg>'
    )


def _axis(scale: _Scale, y: int, unit: str) -> str:
    ticks = "".join(
        f'<line x1="{scale.x(t):.1f}" x2="{scale.x(t):.1f}" y1="{y}" y2="{y + 5}" stroke="#444"/>'
        f'<text x="{scale.x(t):.1f}" y="{y + 18}" text-anchor="middle" class="tick">{t:g}{unit}</text>'
        for t in scale.ticks()
    )
    return (
        f'<g class="axis"><line x1="{LABEL_WIDTH}" x2="{LABEL_WIDTH + PLOT_WIDTH}" y1="{y}" y2="{y}" '
        f'stroke="#444"/>{ticks}</g>'
    )


_HATCH = (
    '<defs><pattern id="hatch" width="6" height="6" patternUnits="userSpaceOnUse" '
    'patternTransform="rotate(45)"><rect width="6" height="6" fill="#f6d5d1"/>'
    f'<line x1="0" y1="0" x2="0" y2="6" stroke="{COLOURS["lost"]}" stroke-width="2"/></pattern></defs>'
)


def _bar_y(index: int) -> float:
    return index * ROW + (ROW - BAR) / 2


def _text_y(index: int) -> float:
    return index * ROW + ROW / 2 + 4


def _label(index: int, text: str) -> str:
    return f'<text x="{LABEL_WIDTH - 8}" y="{_text_y(index)}" text-anchor="end" class="label">{escape(text)}</text>'


def _note(index: int, x: float, text: str) -> str:
    return f'<text x="{x:.1f}" y="{_text_y(index)}" class="note">{escape(text)}</text>'


def _note_beside(index: int, start: float, end: float, text: str) -> str:
    """A note right of a bar, or left of it where it would run off the picture."""
    if end + 6 + len(text) * CHARACTER_WIDTH <= WIDTH:
        return _note(index, end + 6, text)
    return f'<text x="{start - 6:.1f}" y="{_text_y(index)}" text-anchor="end" class="note">{escape(text)}</text>'


def _legend(*entries: tuple[str, str]) -> str:
    return " ".join(
        f'<span class="swatch" style="background:{COLOURS[colour]}"></span>{escape(text)}' for colour, text in entries
    )


# --- tables -------------------------------------------------------------------------------------


def _table(section_id: str, title: str, header: tuple[str, ...], rows: list[tuple[object, ...]]) -> str:
    if not rows:
        return f'<section id="{section_id}"><h2>{escape(title)}</h2><p>None.</p></section>'
    head = "".join(f"<th>{escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{escape(str(c))}</td>" for c in row) + "</tr>" for row in rows)
    return f'<section id="{section_id}"><h2>{escape(title)}</h2><table><tr>{head}</tr>{body}</table></section>'


def _phase_table(r: IncidentReport) -> str:
    rows = [
        (
            p.name,
            _seconds(_offset(r, p.started_at)),
            "running" if p.ended_at is None else _seconds((p.ended_at - p.started_at).total_seconds()),
            p.result,
        )
        for p in r.phases
    ]
    return _table("phases", "Phases", ("phase", "start", "duration", "result"), rows)


def _jobs_table(r: IncidentReport) -> str:
    rows = [
        (
            j.job_id,
            ", ".join(j.nodes_before),
            ", ".join(j.nodes_after) or "-",
            j.restart_count,
            _value(j.resumed_step),
            _value(j.lost_steps),
            _seconds(j.lost_seconds),
            "; ".join(f"{s.checkpoint_id} ({s.why})" for s in j.skipped_checkpoints) or "-",
            "verified" if j.verified else "NOT verified: " + "; ".join(j.why_not),
            f"{j.confidence}: " + "; ".join(j.evidence) if j.confidence else "-",
        )
        for j in r.jobs
    ]
    return _table(
        "jobs",
        "Jobs",
        (
            "job",
            "nodes before",
            "nodes after",
            "restarts",
            "resumed at step",
            "lost steps",
            "lost training",
            "skipped checkpoints",
            "verification",
            "evidence",
        ),
        rows,
    )


def _goodput_table(r: IncidentReport) -> str:
    """CRE's goodput and its terms, per job and for the incident (their sums)."""
    rows = [
        (
            who,
            _seconds(g.wall_seconds),
            _seconds(g.lost_work_seconds),
            _seconds(g.resume_seconds),
            _seconds(g.reschedule_seconds),
            _seconds(g.checkpoint_save_seconds),
            _value(g.goodput),
        )
        for who, g in [*((f"job {j.job_id}", j.goodput) for j in r.jobs), ("incident", r.goodput)]
        if g is not None
    ]
    if not rows:
        return ""
    return _table(
        "goodput",
        "Goodput: (t_w - t_ch - t_rm - t_re - t_save) / (t_w - t_re), from the interrupted run's start",
        ("", "wall t_w", "lost work t_ch", "resume t_rm", "reschedule t_re", "checkpoint saves t_save", "goodput"),
        rows,
    )


def _alerts_table(r: IncidentReport) -> str:
    rows = [(_time(a.observed_at), a.source, a.xid, a.observed_on or a.node, a.actor, a.reason) for a in r.alerts]
    return _table("alerts", "Alerts", ("observed", "source", "XID", "seen on", "actor", "reason"), rows)


def _actions_table(r: IncidentReport) -> str:
    rows = [(_time(a.at), a.action, a.target, a.path, a.detail, a.actor, a.reason) for a in r.actions]
    return _table("actions", "Actions taken", ("at", "action", "target", "how", "detail", "asked by", "why"), rows)


# --- numbers ------------------------------------------------------------------------------------


def _offset(r: IncidentReport, at: datetime) -> float:
    return (at - r.failure_at).total_seconds()


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} s"


def _value(value: object) -> str:
    return "-" if value is None else str(value)


def _time(at: datetime) -> str:
    return at.strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + " UTC"


_CSS = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 24px; color: #1f2933; max-width: 1100px; }
h1 { font-size: 22px; margin: 0 0 4px; } h2 { font-size: 17px; margin: 28px 0 8px; } h3 { font-size: 14px; }
.outcome { display: inline-block; padding: 2px 10px; border-radius: 10px; font-weight: 600; }
.outcome.good { background: #d9f2e3; color: #1d5d2f; } .outcome.bad { background: #f8d7d3; color: #8e2418; }
dl.summary { display: grid; grid-template-columns: max-content auto; gap: 2px 16px; }
dl.summary dt { color: #52606d; } dl.summary dd { margin: 0; }
svg text { font: 12px system-ui, sans-serif; fill: #1f2933; } svg text.note, svg text.tick { fill: #52606d; }
.legend { color: #52606d; } .swatch { display: inline-block; width: 12px; height: 12px; margin: 0 4px 0 12px;
  vertical-align: -1px; }
table { border-collapse: collapse; } th, td { border-bottom: 1px solid #e4e7eb; padding: 3px 8px;
  text-align: left; vertical-align: top; } th { color: #52606d; font-weight: 600; }
"""
