"""Verified operators (contracts/operators.py, activities/operators.py): what a signature covers,
when it counts, and the worker's operator list."""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from activities.operators import OperatorKeys
from contracts.models import utc_now
from contracts.operators import SIGNATURE_VALID_SECONDS, DecisionCheck, parse_operator_keys
from starter.operator_key import load_signing_key, new_key, operator_signer, sign

WORKFLOW, RUN = "node-recovery-gpu-3", "0f6c3a52-5b0e-4ad4-9f9a-1d2e3f4a5b6c"


@pytest.fixture
def keys(tmp_path: Path):
    """alice and bob listed; mallory has a key the list does not have."""
    lines = [new_key(name, tmp_path)[1] for name in ("alice", "bob")]
    new_key("mallory", tmp_path)
    listed = tmp_path / "operators.list"
    listed.write_text("# the on-call rota\n" + "\n".join(lines) + "\n")
    return tmp_path, OperatorKeys(listed)


def check(signer, at=None, **changed) -> DecisionCheck:
    """alice's approval at the replacement gate as signed, then with `changed` as the workflow sees it."""
    signed = dict(
        kind="approve",
        workflow_id=WORKFLOW,
        run_id=RUN,
        subject="replacement",
        actor=signer.actor,
        reason="spare checked",
    )
    signature = sign(
        signer.key, *(signed[f] for f in ("kind", "workflow_id", "run_id", "subject", "actor", "reason")), now=at
    )
    return DecisionCheck(**{**signed, "signature": signature, **changed})


def test_a_decision_signed_by_a_listed_operator_is_verified_with_its_key(keys):
    directory, listed = keys
    verdict = listed.verify(check(operator_signer(directory / "alice", "alice")), utc_now())
    assert verdict.verified and verdict.detail.startswith("SHA256:")


@pytest.mark.parametrize(
    "changed, why",
    [
        ({"kind": "deny"}, "does not verify"),
        ({"subject": "requeue"}, "does not verify"),  # another gate
        ({"run_id": "another-run"}, "does not verify"),  # the same node's next incident
        ({"workflow_id": "node-recovery-gpu-4"}, "does not verify"),
        ({"reason": "a reason someone else wrote"}, "does not verify"),
        ({"actor": "bob"}, "does not verify with bob's key"),  # alice's signature under bob's name
        ({"signature": None}, "not signed"),
    ],
)
def test_a_signature_covers_the_decision_and_where_it_applies(keys, changed, why):
    directory, listed = keys
    verdict = listed.verify(check(operator_signer(directory / "alice", "alice"), **changed), utc_now())
    assert not verdict.verified and why in verdict.detail, verdict.detail


def test_an_unlisted_key_a_stale_and_a_future_signature_are_refused(keys):
    directory, listed = keys
    mallory = operator_signer(directory / "mallory", "mallory")
    alice = operator_signer(directory / "alice", "alice")
    now = utc_now()
    assert "'mallory' is not among the worker's operators" in listed.verify(check(mallory), now).detail
    stale = check(alice, at=now - timedelta(seconds=SIGNATURE_VALID_SECONDS + 1))
    assert "more than 300 s ago" in listed.verify(stale, now).detail
    assert listed.verify(check(alice, at=now - timedelta(seconds=SIGNATURE_VALID_SECONDS - 5)), now).verified
    assert "later than the worker's clock" in listed.verify(check(alice, at=now + timedelta(minutes=5)), now).detail


def test_a_worker_without_an_operator_list_refuses_every_decision(keys):
    directory, _ = keys
    verdict = OperatorKeys(None).verify(check(operator_signer(directory / "alice", "alice")), utc_now())
    assert not verdict.verified and "RECOVERY_OPERATOR_KEYS_FILE" in verdict.detail


def test_a_revoked_key_is_refused_without_a_restart(keys):
    directory, listed = keys
    alice = operator_signer(directory / "alice", "alice")
    assert listed.verify(check(alice), utc_now()).verified
    path = directory / "operators.list"
    path.write_text("".join(line + "\n" for line in path.read_text().splitlines() if not line.startswith("alice ")))
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 1_000_000_000))
    assert "'alice' is not among" in listed.verify(check(alice), utc_now()).detail


def test_the_operator_list_is_refused_line_by_line(tmp_path):
    _, line = new_key("alice", tmp_path)
    rsa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048).public_key()
    rsa_line = "carol " + rsa_key.public_bytes(Encoding.OpenSSH, PublicFormat.OpenSSH).decode()
    for text, why in [
        ("alice\n", "list:1: expected `NAME ssh-ed25519 KEY"),
        ("alice ssh-ed25519 bm90IGEga2V5\n", "list:1: not an OpenSSH public key"),
        (f"{line}\n{rsa_line}\n", "list:2: ssh-rsa is not an Ed25519 key"),
        (f"{line}\n{line}\n", "list:2: operator 'alice' is listed twice"),
    ]:
        with pytest.raises(ValueError, match=why):
            parse_operator_keys(text, "list")
    assert list(parse_operator_keys(f"# comment only\n\n{line}  # trailing\n", "list")) == ["alice"]


def test_a_new_key_is_private_to_its_owner_and_signs(tmp_path):
    path, line = new_key("alice", tmp_path / "keys")
    assert path.stat().st_mode & 0o777 == 0o600
    assert line.startswith("alice ssh-ed25519 ")
    load_signing_key(path)
    with pytest.raises(ValueError, match="not an OpenSSH private key"):
        load_signing_key(tmp_path / "keys" / "alice.pub")
    with pytest.raises(ValueError, match="RECOVERY_OPERATOR_KEY_FILE is not set"):
        operator_signer(None, "alice")


def test_a_starter_can_only_make_the_workers_policy_safer():
    from contracts.models import RecoveryPolicy

    worker = RecoveryPolicy(approval_required=["replacement"], spare_nodes=["gpu-9"], degrading_grace_seconds=120)
    asked = RecoveryPolicy(
        approval_required=["requeue"], spare_nodes=[], degrading_grace_seconds=0, dry_run=True, fleet_budget=False
    )
    policy = worker.narrowed_by(asked)
    assert policy.approval_required == ["replacement", "requeue"] and policy.dry_run
    assert policy.spare_nodes == ["gpu-9"] and policy.degrading_grace_seconds == 120 and policy.fleet_budget
    assert worker.narrowed_by(RecoveryPolicy()) == worker
    # Pinned jobs: a starter may ask to leave them; it cannot make a worker that leaves them unpin.
    assert policy.pinned_jobs == "unpin"
    assert worker.narrowed_by(RecoveryPolicy(pinned_jobs="leave")).pinned_jobs == "leave"
    leaving = worker.model_copy(update={"pinned_jobs": "leave"})
    assert leaving.narrowed_by(RecoveryPolicy(pinned_jobs="unpin")).pinned_jobs == "leave"
