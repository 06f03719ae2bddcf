"""An operator's signing key: signs decisions (contracts/operators.py) for `recovery approve`,
`deny`, `abort`, `reset-breaker` and `release-quarantine`.

RECOVERY_OPERATOR_KEY_FILE is an OpenSSH Ed25519 private key without a passphrase (`ssh-keygen
-t ed25519 -N ''`, or this module's `new`); the worker's operator list carries its public half under
the operator's name. A new key and its operator-list line:

    python -m starter.operator_key new NAME DIR    # DIR/NAME (0600) and DIR/NAME.pub
"""

from __future__ import annotations

import base64
import os
import sys
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    NoEncryption,
    PrivateFormat,
    PublicFormat,
    load_ssh_private_key,
)

from contracts.models import OperatorSignature, utc_now
from contracts.operators import signed_bytes


def load_signing_key(path: Path) -> Ed25519PrivateKey:
    """ValueError (naming the file) unless it is an unencrypted OpenSSH Ed25519 private key."""
    try:
        key = load_ssh_private_key(path.read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as err:
        raise ValueError(f"{path}: not an OpenSSH private key without a passphrase ({err})") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise ValueError(f"{path}: not an Ed25519 key (ssh-keygen -t ed25519)")
    return key


def sign(
    key: Ed25519PrivateKey,
    kind: str,
    workflow_id: str,
    run_id: str,
    subject: str,
    actor: str,
    reason: str,
    now: datetime | None = None,
) -> OperatorSignature:
    signed_at = now or utc_now()
    message = signed_bytes(kind, workflow_id, run_id, subject, actor, reason, signed_at.isoformat())
    return OperatorSignature(signed_at=signed_at, value=base64.b64encode(key.sign(message)).decode())


@dataclass(frozen=True)
class OperatorSigner:
    """An operator's name and key: signs each decision where it applies (contracts/operators.py)."""

    actor: str
    key: Ed25519PrivateKey

    def sign(self, kind: str, workflow_id: str, run_id: str, subject: str, reason: str) -> OperatorSignature:
        return sign(self.key, kind, workflow_id, run_id, subject, self.actor, reason)


def operator_signer(key_file: Path | None, actor: str) -> OperatorSigner:
    """The CLI's signer; ValueError without a usable key (RECOVERY_OPERATOR_KEY_FILE)."""
    if key_file is None:
        raise ValueError(
            "RECOVERY_OPERATOR_KEY_FILE is not set: an operator decision is signed with the "
            'operator\'s key (docs/security.md, "Verified operators")'
        )
    return OperatorSigner(actor=actor, key=load_signing_key(key_file))


def operator_line(name: str, key: Ed25519PrivateKey) -> str:
    """The key's line in the worker's operator list (RECOVERY_OPERATOR_KEYS_FILE)."""
    public = key.public_key().public_bytes(Encoding.OpenSSH, PublicFormat.OpenSSH).decode()
    return f"{name} {public} {name}@training-recovery"


def new_key(name: str, directory: Path) -> tuple[Path, str]:
    """A new key in directory/name (0600) and directory/name.pub; returns the path and its operator line."""
    key = Ed25519PrivateKey.generate()
    directory.mkdir(parents=True, exist_ok=True)
    private = directory / name
    fd = os.open(private, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(key.private_bytes(Encoding.PEM, PrivateFormat.OpenSSH, NoEncryption()))
    line = operator_line(name, key)
    (directory / f"{name}.pub").write_text(line + "\n")
    return private, line


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[0] != "new":
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    path, line = new_key(argv[1], Path(argv[2]))
    print(f"private key: {path}\noperator list line (RECOVERY_OPERATOR_KEYS_FILE):\n{line}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
