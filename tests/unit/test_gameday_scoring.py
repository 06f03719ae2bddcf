"""Game day scoring: how measurements become met or missed objectives, a scenario's verdict and
the command's exit code; and the unknown-scenario refusal before anything starts."""

from __future__ import annotations

import subprocess
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from contracts.models import FaultClass, IncidentReport, JobReport, Phase
from drills.gameday import (
    SCENARIOS,
    SideEffects,
    Targets,
    detect_slo,
    exit_code,
    lost_progress_slo,
    result_of,
    resume_slo,
    scenario_names,
    score,
    side_effects_slo,
)

RECOVERY = str(Path(sys.executable).parent / "recovery")
T0 = datetime(2026, 11, 30, 12, 0, tzinfo=timezone.utc)


def report(**fields) -> IncidentReport:
    base = dict(
        incident_id="gpu-2-20261130T120000Z",
        node="gpu-2",
        xid=79,
        fault_class=FaultClass.FATAL,
        action="recover",
        outcome="recovered",
        failure_at=T0,
        phases=[Phase(name="classify", started_at=T0 + timedelta(seconds=0.4))],
    )
    return IncidentReport(**{**base, **fields})


def job(**fields) -> JobReport:
    base = dict(
        job_id=7,
        restart_count=1,
        nodes_before=["gpu-1", "gpu-2"],
        nodes_after=["gpu-3", "gpu-4"],
        verified=True,
        resumed_step=20,
        latest_complete_step=20,
        last_step_before_failure=23,
        lost_steps=3,
    )
    return JobReport(**{**base, **fields})


@pytest.mark.parametrize(
    "comparison, measured, limit, met",
    [
        ("<=", 4.9, 5.0, True),
        ("<=", 5.0, 5.0, True),
        ("<=", 5.1, 5.0, False),
        ("==", 1, 1, True),
        ("==", 2, 1, False),
        (">=", 3, 2, True),
        (">=", 1, 2, False),
        ("<=", None, 5.0, False),  # nothing measured is a miss, never a pass
    ],
)
def test_score_compares_the_measurement_with_its_limit(comparison, measured, limit, met):
    slo = score("x", measured, comparison, limit, " s")
    assert slo.met is met and slo.measured == measured and slo.target == f"{comparison} {limit:g} s"


def test_a_missed_objective_fails_the_scenario_and_the_command():
    scenario = SCENARIOS["xid79-fatal"]
    good = result_of(scenario, [score("detect", 0.4, "<=", 5.0), score("fence", 0.3, "<=", 10.0)], ["i"])
    missed = result_of(scenario, [score("detect", 0.4, "<=", 5.0), score("resume", 130.0, "<=", 120.0)], ["i"])
    assert good.passed and not missed.passed
    assert exit_code([good]) == 0
    assert exit_code([good, missed]) == 1
    assert exit_code([]) == 1  # nothing ran: nothing was shown to work
    # No objective at all is no evidence either.
    assert not result_of(scenario, [], []).passed
    assert set(missed.model_dump(mode="json")) >= {"scenario", "passed", "slos"}
    assert set(missed.model_dump(mode="json")["slos"][0]) >= {"name", "target", "measured", "met"}


def test_detect_is_the_slowest_incident_to_start():
    reports = [report(), report(phases=[Phase(name="classify", started_at=T0 + timedelta(seconds=6))])]
    slo = detect_slo(reports, Targets())
    assert (slo.measured, slo.met) == (6.0, False)
    assert detect_slo([report(phases=[])], Targets()).met is False


def test_resume_counts_only_jobs_verified_off_the_failed_node():
    assert resume_slo(report(jobs=[job()], time_to_resume_seconds=14.0), Targets()).met
    still_on_node = job(nodes_after=["gpu-2", "gpu-3"])
    assert not resume_slo(report(jobs=[still_on_node], time_to_resume_seconds=14.0), Targets()).met
    unverified = job(verified=False, why_not=["restart count 2, expected 1"])
    assert not resume_slo(report(jobs=[unverified], time_to_resume_seconds=14.0), Targets()).met
    assert not resume_slo(report(jobs=[job()], time_to_resume_seconds=121.0), Targets()).met


def test_lost_progress_is_bounded_by_the_steps_since_the_latest_complete_checkpoint():
    # 3 steps since checkpoint 20: losing them (and the step in flight) is within the objective.
    assert lost_progress_slo(report(jobs=[job()])).met
    assert lost_progress_slo(report(jobs=[job()])).target == "<= 4 steps"
    # Resumed from an older checkpoint than the latest complete one: more was lost than allowed.
    older = job(resumed_step=10, lost_steps=13)
    assert not lost_progress_slo(report(jobs=[older])).met
    assert not lost_progress_slo(report(jobs=[job(lost_steps=None)])).met


def test_side_effects_must_each_happen_exactly_once():
    once = SideEffects(
        requeues={7: 1}, drains={"i": 1}, drain_reasons={"gpu-2": True}, spare_claims={"i": 1}, spare_comments={"i": 1}
    )
    assert side_effects_slo(once, spares_expected=1).met
    for twice in (
        SideEffects(**{**once.__dict__, "requeues": {7: 2}}),
        SideEffects(**{**once.__dict__, "drains": {"i": 2}}),
        SideEffects(**{**once.__dict__, "drain_reasons": {"gpu-2": False}}),
        SideEffects(**{**once.__dict__, "spare_claims": {"i": 2}, "spare_comments": {"i": 2}}),
        SideEffects(**{**once.__dict__, "spare_comments": {"i": 0}}),
    ):
        slo = side_effects_slo(twice, spares_expected=1)
        assert not slo.met, twice
        assert slo.detail != "as expected"
    # No spare to claim: a claim is a side effect too many.
    assert not side_effects_slo(once, spares_expected=0).met


def test_scenario_names():
    assert scenario_names("all") == list(SCENARIOS)
    assert list(SCENARIOS)[-1] == "storm-20"  # the storm resizes the cluster: last
    assert {
        "xid79-fatal",
        "xid94-degrading",
        "xid13-application",
        "storm-20",
        "worker-crash",
        "incomplete-checkpoint",
        "no-spare",
    } == set(SCENARIOS)
    with pytest.raises(KeyError, match="choose one of xid79-fatal"):
        scenario_names("xid80")


def test_unknown_scenario_is_refused_before_anything_starts(tmp_path):
    state = tmp_path / "stack"
    result = subprocess.run(
        [RECOVERY, "drill", "--scenario", "meteor-strike", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        env={
            "PATH": "/usr/bin:/bin",
            "RECOVERY_STATE_DIR": str(state),
            "RECOVERY_LOCAL_TEMPORAL_PORT": "9",
            "TEMPORAL_ADDRESS": "127.0.0.1:9",
        },
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 2, result.stderr
    assert "bad input, nothing was changed" in result.stderr and "meteor-strike" in result.stderr
    for name in SCENARIOS:
        assert name in result.stderr
    assert result.stdout == "" and not state.exists()


def test_a_scenario_with_a_failure_option_is_refused(tmp_path):
    state = tmp_path / "stack"
    result = subprocess.run(
        [RECOVERY, "drill", "--scenario", "xid79-fatal", "--xid", "94"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "RECOVERY_STATE_DIR": str(state), "TEMPORAL_ADDRESS": "127.0.0.1:9"},
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 2, result.stderr
    assert "a scenario injects its own failure" in result.stderr and not state.exists()
