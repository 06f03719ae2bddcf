"""Which incident this is: its node (known from the start) and its id (once the run opens it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class IncidentRef:
    node: str
    incident_id: str = ""

    @property
    def name(self) -> str:
        """How messages name the incident: its id, or its node before the id is known."""
        return self.incident_id or self.node
