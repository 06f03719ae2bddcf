"""AlertLog: what an incident keeps of the alerts it absorbs does not grow with what is sent."""

from datetime import datetime, timedelta, timezone

from contracts.models import AlertDigest, NodeFailureAlert
from workflows.alert_log import KEEP_FIRST, KEEP_LAST, MAX_SOURCES, OTHER_SOURCES, AlertLog

T0 = datetime(2026, 12, 3, tzinfo=timezone.utc)


def alert(i: int, source: str = "kernel-log") -> NodeFailureAlert:
    return NodeFailureAlert(
        node="gpu-2", xid=79, source=source, actor="hook", reason=f"line {i}", observed_at=T0 + timedelta(seconds=i)
    )


def test_keeps_the_first_and_last_few_of_each_source_and_counts_all():
    log = AlertLog()
    for i in range(10_000):
        log.add(alert(i, "kernel-log" if i % 2 else "alertmanager"))
    kept = log.kept()
    assert len(kept) == 2 * (KEEP_FIRST + KEEP_LAST)
    assert log.first is not None and log.first.reason == "line 0"
    assert [a.reason for a in kept if a.source == "alertmanager"] == [
        "line 0",
        "line 2",
        "line 4",
        "line 9994",
        "line 9996",
        "line 9998",
    ]
    assert [a.observed_at for a in kept] == sorted(a.observed_at for a in kept)  # arrival order
    assert log.counts() == {"alertmanager": 5_000, "kernel-log": 5_000}


def test_a_digest_adds_its_sample_and_its_counts():
    log = AlertLog()
    log.add(alert(0))
    log.add_digest(AlertDigest(alerts=[alert(7), alert(8)], omitted={"kernel-log": 98_000, "gpu-health": 5}))
    assert log.counts() == {"kernel-log": 98_003, "gpu-health": 5}
    assert [a.reason for a in log.kept()] == ["line 0", "line 7", "line 8"]


def test_invented_sources_are_counted_together_past_a_limit():
    log = AlertLog()
    for i in range(1_000):
        log.add(alert(i, f"source-{i}"))
    counts = log.counts()
    assert len(counts) == MAX_SOURCES + 1 and counts[OTHER_SOURCES] == 1_000 - MAX_SOURCES
    assert len(log.kept()) <= (MAX_SOURCES + 1) * (KEEP_FIRST + KEEP_LAST)
