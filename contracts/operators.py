"""Verified operators (issue #22): what an operator's signature covers, and the worker's verdict.

An operator decision (approve, deny, abort an incident; reset the fence circuit breaker; release a
quarantined node) counts only when it is signed with the operator's Ed25519 key and the worker's
operator list (RECOVERY_OPERATOR_KEYS_FILE) has that key under the name the decision gives. The
signature covers the decision and where it applies, as the workflow that receives it sees them:
its kind, the workflow's id and run, the gate or node it answers, the actor, the reason and when it
was signed. So a captured signature (histories are readable by anyone with namespace read access)
cannot approve another gate, another incident or another run, and expires after
SIGNATURE_VALID_SECONDS. docs/security.md says how to issue and list keys.

The worker's operator list (RECOVERY_OPERATOR_KEYS_FILE) has one operator per line,
`NAME ssh-ed25519 KEY [comment]` (the key as in an OpenSSH public key file); `#` starts a comment.
"""

from __future__ import annotations

import base64
import hashlib
import json
from typing import Literal, Protocol

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat, load_ssh_public_key
from pydantic import Field

from contracts.models import Actor, Contract, OperatorSignature

DecisionKind = Literal["approve", "deny", "abort", "reset_breaker", "release_quarantine"]
# How long a signed decision may take to reach the worker; and how far the signer's clock may run ahead.
SIGNATURE_VALID_SECONDS = 300
CLOCK_SKEW_SECONDS = 30
SIGNED_PREFIX = b"training-recovery operator decision v1\n"


class DecisionCheck(Contract):
    """A decision as the workflow that received it sees it, for the worker to verify."""

    kind: DecisionKind
    workflow_id: str
    run_id: str
    subject: str = Field(
        "",
        description="the gate an approve or deny answers, the node a release frees; "
        "empty for an abort and a breaker reset",
    )
    actor: Actor
    reason: str
    signature: OperatorSignature | None

    def signed_bytes(self) -> bytes:
        """The bytes the operator signs: the same for the CLI that signs and the worker that verifies."""
        assert self.signature is not None
        return signed_bytes(
            self.kind,
            self.workflow_id,
            self.run_id,
            self.subject,
            self.actor,
            self.reason,
            self.signature.signed_at.isoformat(),
        )


def signed_bytes(
    kind: str, workflow_id: str, run_id: str, subject: str, actor: str, reason: str, signed_at: str
) -> bytes:
    body = {
        "kind": kind,
        "workflow_id": workflow_id,
        "run_id": run_id,
        "subject": subject,
        "actor": actor,
        "reason": reason,
        "signed_at": signed_at,
    }
    return SIGNED_PREFIX + json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


class DecisionSigner(Protocol):
    """Who decides, and their signature on a decision where it applies (starter/operator_key.py)."""

    actor: str

    def sign(
        self, kind: DecisionKind, workflow_id: str, run_id: str, subject: str, reason: str
    ) -> OperatorSignature: ...


class DecisionVerdict(Contract):
    """The worker's word on a decision: verified (by which key) or refused (why)."""

    verified: bool
    detail: str = Field(description="the key's fingerprint when verified; why not, when refused")


def fingerprint(key: Ed25519PublicKey) -> str:
    """As `ssh-keygen -l` prints it: SHA256 of the key's OpenSSH blob, base64 without padding."""
    blob = base64.b64decode(key.public_bytes(Encoding.OpenSSH, PublicFormat.OpenSSH).split()[1])
    return "SHA256:" + base64.b64encode(hashlib.sha256(blob).digest()).decode().rstrip("=")


def parse_operator_keys(text: str, source: str) -> dict[str, Ed25519PublicKey]:
    """NAME -> key; ValueError naming the line when a line is not `NAME ssh-ed25519 KEY [comment]`."""
    keys: dict[str, Ed25519PublicKey] = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        fields = line.split()
        if len(fields) < 3:
            raise ValueError(f"{source}:{number}: expected `NAME ssh-ed25519 KEY [comment]`")
        name, key_text = fields[0], " ".join(fields[1:3])
        try:
            key = load_ssh_public_key(key_text.encode())
        except (ValueError, TypeError) as err:
            raise ValueError(f"{source}:{number}: not an OpenSSH public key ({err})") from None
        if not isinstance(key, Ed25519PublicKey):
            raise ValueError(f"{source}:{number}: {fields[1]} is not an Ed25519 key (ssh-ed25519)")
        if name in keys:
            raise ValueError(f"{source}:{number}: operator {name!r} is listed twice")
        keys[name] = key
    return keys
