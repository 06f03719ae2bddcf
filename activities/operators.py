"""Verifying an operator's signed decision (contracts/operators.py) against the worker's operator
list (RECOVERY_OPERATOR_KEYS_FILE), as an activity: its verdict is in the workflow's history, so a
replay, or a key revoked since, never changes a decision already taken. The list is read again
whenever it changes, so that a key is added or revoked without a restart.

An activity, not a local one: the workflow goes on from the verdict, and code that goes on from a
local activity's result may run in another workflow task than on replay (docs/upgrades.md)."""

from __future__ import annotations

import base64
from datetime import datetime, timedelta
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from temporalio import activity

from contracts.models import utc_now
from contracts.operators import (
    CLOCK_SKEW_SECONDS,
    SIGNATURE_VALID_SECONDS,
    DecisionCheck,
    DecisionVerdict,
    fingerprint,
    parse_operator_keys,
)


class OperatorKeys:
    """The worker's operator list, read again when the file changes."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._seen: tuple[int, int] | None = None
        self._keys: dict[str, Ed25519PublicKey] = {}
        if path is not None:
            self.current()  # a list that cannot be read stops the worker at start

    def current(self) -> dict[str, Ed25519PublicKey]:
        assert self.path is not None
        stat = self.path.stat()
        if (stat.st_mtime_ns, stat.st_size) != self._seen:
            self._keys = parse_operator_keys(self.path.read_text(), str(self.path))
            self._seen = (stat.st_mtime_ns, stat.st_size)
        return self._keys

    def verify(self, check: DecisionCheck, now: datetime) -> DecisionVerdict:
        if self.path is None:
            return refused(
                "the worker lists no operator keys (RECOVERY_OPERATOR_KEYS_FILE): every operator decision is refused"
            )
        if check.signature is None:
            return refused("not signed: `recovery` signs a decision with the key in RECOVERY_OPERATOR_KEY_FILE")
        try:
            key = self.current().get(check.actor)
        except (OSError, ValueError) as err:
            return refused(f"the worker's operator list cannot be read: {err}")
        if key is None:
            return refused(f"{check.actor!r} is not among the worker's operators ({self.path})")
        signed_at = check.signature.signed_at
        if signed_at > now + timedelta(seconds=CLOCK_SKEW_SECONDS):
            return refused(f"signed at {signed_at.isoformat()}, later than the worker's clock ({now.isoformat()})")
        if signed_at < now - timedelta(seconds=SIGNATURE_VALID_SECONDS):
            return refused(f"signed at {signed_at.isoformat()}, more than {SIGNATURE_VALID_SECONDS} s ago: sign again")
        try:
            key.verify(base64.b64decode(check.signature.value, validate=True), check.signed_bytes())
        except (InvalidSignature, ValueError):
            return refused(
                f"the signature does not verify with {check.actor}'s key {fingerprint(key)} for "
                f"this {check.kind} of {check.workflow_id} (run {check.run_id})"
                + (f" at {check.subject}" if check.subject else "")
            )
        return DecisionVerdict(verified=True, detail=fingerprint(key))


def refused(why: str) -> DecisionVerdict:
    return DecisionVerdict(verified=False, detail=why)


class OperatorActivities:
    def __init__(self, keys: OperatorKeys) -> None:
        self._keys = keys

    @activity.defn
    async def verify_decision(self, check: DecisionCheck) -> DecisionVerdict:
        return self._keys.verify(check, utc_now())
