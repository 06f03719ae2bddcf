"""Bad input is refused at the edge, with a message that names the problem."""

import pytest
from pydantic import ValidationError

from contracts.models import ActionContext, NodeFailureAlert, SlurmJob, canonical_pci_address
from contracts.settings import Settings


@pytest.mark.parametrize("node", ["gpu-1", "a", "node001.cluster", "GPU_7"])
def test_plain_host_names_are_accepted(node):
    assert NodeFailureAlert(node=node, xid=79, source="cli", actor="me").node == node


@pytest.mark.parametrize("node", ["", "gpu-[1-4]", "gpu-1,gpu-2", "gpu 1", "-gpu", "gpu;rm", "a" * 64, "State=DOWN"])
def test_host_lists_and_odd_names_are_refused(node):
    with pytest.raises(ValidationError, match="invalid node name"):
        NodeFailureAlert(node=node, xid=79, source="cli", actor="me")


@pytest.mark.parametrize("xid", [0, -1, 1000])
def test_xid_out_of_range_is_refused(xid):
    with pytest.raises(ValidationError, match="xid"):
        NodeFailureAlert(node="gpu-1", xid=xid, source="cli", actor="me")


def test_actor_is_required_and_single_line():
    with pytest.raises(ValidationError):
        NodeFailureAlert(node="gpu-1", xid=79, source="cli", actor="")
    with pytest.raises(ValidationError):
        NodeFailureAlert(node="gpu-1", xid=79, source="cli", actor="me\nState=RESUME")


@pytest.mark.parametrize("job_id", [0, -5, 2**32])
def test_job_ids_are_positive_32_bit(job_id):
    with pytest.raises(ValidationError):
        SlurmJob(job_id=job_id, state="RUNNING")


def test_checkpoint_dir_comes_from_the_job_comment():
    job = SlurmJob(job_id=7, state="RUNNING", comment="team=x; checkpoint_dir=/lustre/run7")
    assert job.checkpoint_dir == "/lustre/run7"
    assert SlurmJob(job_id=7, state="RUNNING", comment="nothing").checkpoint_dir is None


def test_slurm_reason_names_owner_fault_incident_and_actor():
    ctx = ActionContext(
        incident_id="gpu-2-20261130T000000Z",
        owner="recovery",
        actor="alertmanager",
        reason="r",
        xid=79,
        mnemonic="ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS",
    )
    assert ctx.slurm_reason() == (
        "recovery: XID 79 ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS incident gpu-2-20261130T000000Z by alertmanager"
    )


def test_settings_refuse_bad_spares_and_missing_policy_file(monkeypatch, tmp_path):
    monkeypatch.setenv("RECOVERY_SPARE_NODES", "gpu-5,gpu-[6-7]")
    with pytest.raises(ValidationError, match="invalid node name"):
        Settings()
    monkeypatch.setenv("RECOVERY_SPARE_NODES", "gpu-5, gpu-6")
    assert Settings().policy().spare_nodes == ["gpu-5", "gpu-6"]
    monkeypatch.setenv("RECOVERY_XID_POLICY_FILE", str(tmp_path / "missing.csv"))
    with pytest.raises(ValidationError, match="does not exist"):
        Settings()


UUID = "GPU-2ad0b6c5-8f5c-1d1a-8e4e-3c3f8f0c2f4b"


@pytest.mark.parametrize(
    "ids, gpu",
    [
        ({"gpu_index": 3, "gpu_uuid": UUID, "pci_address": "0000:3b:00.0"}, UUID),
        ({"gpu_index": 3, "pci_address": "0000:3b:00.0"}, "0000:3b:00.0"),
        ({"gpu_index": 0}, "0"),
        ({"gpu": "7", "gpu_uuid": UUID}, "7"),  # named by the sender: kept
        ({}, None),
    ],
)
def test_the_alerts_gpu_is_its_best_identifier(ids, gpu):
    alert = NodeFailureAlert(node="gpu-2", xid=13, source="test", actor="pytest", **ids)
    assert alert.gpu == gpu
    assert NodeFailureAlert.model_validate_json(alert.model_dump_json()) == alert


@pytest.mark.parametrize(
    "ids",
    [
        {"gpu_index": 64},
        {"gpu_index": -1},
        {"gpu_uuid": "GPU-3"},
        {"pci_address": "0000:3B:00.0"},
        {"pci_address": "PCI:0000:3b:00"},
    ],
)
def test_gpu_identifiers_of_the_wrong_shape_are_refused(ids):
    with pytest.raises(ValidationError):
        NodeFailureAlert(node="gpu-2", xid=13, source="test", actor="pytest", **ids)


@pytest.mark.parametrize(
    "text, address",
    [
        ("PCI:0000:3B:00", "0000:3b:00.0"),
        ("00000000:3b:00.0", "0000:3b:00.0"),
        ("0001:18:1f.3", "0001:18:1f.3"),
        ("10000000:3b:00.0", None),
        ("0000:3b", None),
        ("", None),
    ],
)
def test_pci_addresses_have_one_spelling(text, address):
    assert canonical_pci_address(text) == address
