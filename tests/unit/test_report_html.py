"""The HTML report: one self-contained page whose pictures keep the wall clock (phases,
replacement, time to resume) apart from training progress (checkpoints, lost steps)."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from datetime import datetime, timedelta, timezone

import pytest

from cli.report_html import render_report_html, write_report_html
from contracts.models import (
    ActionRecord,
    FaultClass,
    Goodput,
    IncidentReport,
    JobReport,
    NodeFailureAlert,
    Phase,
    SkippedCheckpoint,
)
from tests.chromium import Chromium

T0 = datetime(2026, 11, 30, 12, 0, tzinfo=timezone.utc)
# (phase, start, end, result) in seconds after the failure, as a fatal XID's drill has them
PHASES = [
    ("classify", 0.0, 0.1, "XID 79 ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS: fatal"),
    ("drain", 0.1, 0.2, "allocated -> allocated+DRAIN"),
    ("find_jobs", 0.2, 0.2, "3"),
    ("signal", 0.2, 0.3, "SIGUSR1 to 1 job(s)"),
    ("grace", 0.3, 0.3, "skipped: fatal XID: the GPU is gone, no checkpoint to wait for"),
    ("requeue", 0.3, 0.5, "1 job(s) requeued off gpu-2"),
    ("mark_down", 0.5, 0.6, "idle+DRAIN -> down+DRAIN"),
    ("request_replacement", 0.6, 0.7, "slurm-hot-spare: gpu-5"),
    ("wait_for_spare", 0.7, 1.2, "health check passed <script>alert('x')</script>"),
    ("verify", 1.2, 13.6, "job 3: ok"),
]


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def recovered_report(**changes) -> IncidentReport:
    skipped = [SkippedCheckpoint(checkpoint_id="step-000000030", why="payload.bin: size 512 != 1024")]
    job = JobReport(
        job_id=3,
        restart_count=1,
        nodes_before=["gpu-1", "gpu-2"],
        nodes_after=["gpu-3", "gpu-4"],
        verified=True,
        resumed_step=20,
        latest_complete_step=20,
        last_step_before_failure=33,
        lost_steps=13,
        lost_seconds=2.6,
        skipped_checkpoints=skipped,
        time_to_resume_seconds=13.1,
    )
    report = IncidentReport(
        incident_id="gpu-2-20261130T120000Z",
        node="gpu-2",
        xid=79,
        fault_class=FaultClass.FATAL,
        action="recover",
        outcome="recovered",
        failure_at=T0,
        phases=[Phase(name=n, started_at=at(a), ended_at=at(b), result=r) for n, a, b, r in PHASES],
        spare_node="gpu-5",
        replacement_seconds=1.2,
        time_to_resume_seconds=13.1,
        lost_steps=13,
        lost_seconds=2.6,
        resumed_step=20,
        latest_complete_step=20,
        skipped_checkpoints=skipped,
        jobs=[job],
        alerts=[NodeFailureAlert(node="gpu-2", xid=79, source="drill", actor="drill by ops", observed_at=T0)],
        actions=[
            ActionRecord(
                at=at(0.1),
                action="drain",
                target="gpu-2",
                path="cli",
                detail="allocated -> DRAIN",
                actor="drill by ops",
                reason="drill: injected XID 79",
            )
        ],
    )
    return report.model_copy(update=changes)


def pictures(page: str) -> list[ET.Element]:
    """The page's SVG pictures, parsed as XML (which also proves them well-formed)."""
    return [ET.fromstring(svg) for svg in re.findall(r"<svg .*?</svg>", page, re.S)]


def by_class(root: ET.Element, css: str) -> list[ET.Element]:
    return [e for e in root.iter() if css in (e.get("class") or "").split()]


def test_every_phase_is_drawn_in_order_on_the_time_axis():
    timeline = pictures(render_report_html(recovered_report()))[0]
    phases = by_class(timeline, "phase")
    assert [p.get("data-phase") for p in phases] == [name for name, *_ in PHASES]
    starts = [float(p.get("data-start")) for p in phases]
    assert starts == sorted(starts) and starts[-1] == pytest.approx(1.2)
    assert [p.get("data-phase") for p in by_class(timeline, "skipped")] == ["grace"]


def test_replacement_and_resume_are_bars_from_the_failure_scaled_alike():
    timeline = pictures(render_report_html(recovered_report()))[0]
    [replacement] = [e for e in by_class(timeline, "replacement") if e.tag.endswith("rect")]
    [resume] = [e for e in by_class(timeline, "resume") if e.tag.endswith("rect")]
    assert replacement.get("x") == resume.get("x")  # both start at the failure
    ratio = float(replacement.get("width")) / float(resume.get("width"))
    assert ratio == pytest.approx(1.2 / 13.1, rel=0.01)


def test_lost_progress_and_checkpoints_are_drawn_apart_in_steps():
    page = render_report_html(recovered_report())
    timeline, progress = pictures(page)
    assert not by_class(timeline, "lost-progress") and not by_class(timeline, "checkpoint")
    [lost] = by_class(progress, "lost")
    assert (lost.get("data-steps"), lost.get("data-seconds")) == ("13", "2.6")
    marks = {m.get("data-checkpoint"): m for m in by_class(progress, "checkpoint")}
    assert marks["step-000000020"].get("class") == "checkpoint resumed"
    assert marks["step-000000030"].get("class") == "checkpoint skipped"
    assert "payload.bin: size 512 != 1024" in marks["step-000000030"].findtext("{*}title")
    # the lost segment runs from the checkpoint resumed from to the last step reached
    [segment] = by_class(progress, "lost-progress")
    assert float(segment.get("x")) == pytest.approx(
        float(marks["step-000000020"].find("{*}polygon").get("points").split(",")[0]), abs=0.1
    )


def test_text_from_the_cluster_is_escaped():
    page = render_report_html(recovered_report())
    assert "<script>" not in page
    assert "health check passed &lt;script&gt;" in page


def test_an_incident_without_jobs_or_spare_says_so():
    page = render_report_html(
        recovered_report(
            outcome="escalated: unknown XID, node drained, jobs left running",
            jobs=[],
            spare_node=None,
            replacement_seconds=None,
            time_to_resume_seconds=None,
            phases=recovered_report().phases[:2],
        )
    )
    [timeline] = pictures(page)
    assert by_class(timeline, "unknown") and "not measured" in page
    assert "No job ran on the node." in page
    assert 'class="outcome bad"' in page


def test_a_job_that_did_not_resume_says_why():
    job = (
        recovered_report()
        .jobs[0]
        .model_copy(
            update={"verified": False, "resumed_step": None, "why_not": ["job is PENDING (Resources), not RUNNING"]}
        )
    )
    page = render_report_html(recovered_report(jobs=[job], outcome="failed_verification: job 3: ..."))
    assert "Not resumed: job is PENDING (Resources), not RUNNING" in page


async def test_the_report_renders_in_a_browser_with_every_element_visible(tmp_path):
    path = write_report_html(recovered_report(), tmp_path / "report.html")
    async with Chromium(width=1100, height=900) as browser:
        await browser.open(path.as_uri())
        boxes = await browser.evaluate("""(() => {
            const box = (css) => [...document.querySelectorAll(css)].map(e => {
                const r = e.getBoundingClientRect();
                return {x: r.x, y: r.y, width: r.width, height: r.height};
            });
            return {phases: box('#timeline .phase rect'), replacement: box('rect.replacement'),
                    resume: box('rect.resume'), lost: box('rect.lost-progress'),
                    resumed: box('.checkpoint.resumed'), skipped: box('.checkpoint.skipped'),
                    timeline: box('#timeline svg'), progress: box('#progress svg'), page: document.body.scrollWidth};
        })()""")
        shot = await browser.screenshot("incident-report.png")
    assert len(boxes["phases"]) == len(PHASES)
    for kind in ("phases", "replacement", "resume", "lost", "resumed", "skipped"):
        for box in boxes[kind]:
            assert box["width"] > 0 and box["height"] > 0, (kind, box)
            assert 0 <= box["x"] and box["x"] + box["width"] <= boxes["page"], (kind, box)
    [timeline], [progress] = boxes["timeline"], boxes["progress"]
    assert timeline["y"] + timeline["height"] <= progress["y"]  # two pictures, one below the other
    assert boxes["skipped"][0]["x"] > boxes["resumed"][0]["x"]  # the skipped checkpoint is the newer one
    assert shot.stat().st_size > 10_000


def test_a_job_says_what_its_verification_rests_on_and_how_sure_it_is():
    job = (
        recovered_report()
        .jobs[0]
        .model_copy(
            update={
                "evidence": ["first checkpoint written after the restart: step_40 (no resume record)"],
                "confidence": "inferred",
            }
        )
    )
    page = render_report_html(recovered_report(jobs=[job]))
    assert "inferred: first checkpoint written after the restart: step_40 (no resume record)" in page


def test_goodput_and_its_terms_are_in_the_report():
    terms = Goodput(
        window_start=T0,
        window_end=T0,
        wall_seconds=120.0,
        lost_work_seconds=3.4,
        resume_seconds=2.5,
        reschedule_seconds=12.0,
        checkpoint_save_seconds=1.5,
        goodput=0.9296,
    )
    job = recovered_report().jobs[0].model_copy(update={"goodput": terms})
    page = render_report_html(recovered_report(jobs=[job]).model_copy(update={"goodput": terms}))
    [section] = re.findall(r'<section id="goodput">.*?</section>', page)
    assert section.count("0.9296") == 2 and "reschedule t_re" in section and "12.0 s" in section
