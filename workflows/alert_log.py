"""What an incident keeps of the alerts it absorbs: a count per source, and the first and last few
alerts of each. An incident may wait for hours at a gate while a failing GPU keeps reporting, and
what it keeps is in its status, its report and the history of every activity that reads them: so
it must not grow with what senders send (an unbounded list once grew a history to Temporal's limit,
and the server terminated the incident with its node left DOWN). Pure and deterministic.
"""

from __future__ import annotations

from collections import Counter, deque

from contracts.models import AlertDigest, NodeFailureAlert

KEEP_FIRST = 3  # per source: the alerts that opened the story
KEEP_LAST = 3  # per source: how it goes on
MAX_SOURCES = 16  # sources kept apart; a sender inventing more is counted under OTHER_SOURCES
OTHER_SOURCES = "(other sources)"


class AlertLog:
    def __init__(self) -> None:
        self.first: NodeFailureAlert | None = None
        # per source, (arrival number, alert): the first few, then a window of the latest
        self._first: dict[str, list[tuple[int, NodeFailureAlert]]] = {}
        self._last: dict[str, deque[tuple[int, NodeFailureAlert]]] = {}
        self._counts: Counter[str] = Counter()

    def add(self, alert: NodeFailureAlert) -> None:
        source = self._source(alert.source)
        self._counts[source] += 1
        arrival = (self.total, alert)
        if self.first is None:
            self.first = alert
        first = self._first.setdefault(source, [])
        if len(first) < KEEP_FIRST:
            first.append(arrival)
        else:
            self._last.setdefault(source, deque(maxlen=KEEP_LAST)).append(arrival)

    def add_digest(self, digest: AlertDigest) -> None:
        for alert in digest.alerts:
            self.add(alert)
        for source, count in digest.omitted.items():
            self._counts[self._source(source)] += count

    def _source(self, source: str) -> str:
        if source in self._counts or len(self._counts) < MAX_SOURCES:
            return source
        return OTHER_SOURCES

    @property
    def total(self) -> int:
        return sum(self._counts.values())

    def kept(self) -> list[NodeFailureAlert]:
        """The first and last few alerts of each source, in the order they arrived."""
        kept = [a for first in self._first.values() for a in first] + [a for last in self._last.values() for a in last]
        return [alert for _, alert in sorted(kept, key=lambda arrival: arrival[0])]

    def counts(self) -> dict[str, int]:
        return dict(self._counts)
