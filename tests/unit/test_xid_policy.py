from pathlib import Path

import pytest

from activities.xid_policy import XidPolicyTable
from contracts.models import FaultClass
from contracts.settings import DEFAULT_XID_POLICY

TABLE = XidPolicyTable(DEFAULT_XID_POLICY)


@pytest.mark.parametrize("xid", [79, 48, 95])
def test_gpu_gone_is_fatal(xid):
    assert TABLE.classify(xid).fault_class == FaultClass.FATAL


@pytest.mark.parametrize("xid", [63, 64, 92, 94])
def test_gpu_still_usable_is_degrading(xid):
    assert TABLE.classify(xid).fault_class == FaultClass.DEGRADING


@pytest.mark.parametrize("xid", [13, 31, 43])
def test_application_faults_leave_the_node_alone(xid):
    assert TABLE.classify(xid).fault_class == FaultClass.APPLICATION


def test_xid_missing_from_the_table_is_unknown():
    result = TABLE.classify(999)
    assert result.fault_class == FaultClass.UNKNOWN
    assert "not in the XID policy table" in result.description


def test_classification_names_the_catalogue_entry():
    result = TABLE.classify(79)
    assert result.mnemonic == "ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS"
    assert result.catalogue_action == "RESTART_BM"
    assert result.policy_source == str(DEFAULT_XID_POLICY)


def test_the_table_is_configuration(tmp_path: Path):
    custom = tmp_path / "policy.csv"
    custom.write_text("# site policy\nxid,fault_class\n79,degrading\n13,fatal\n")
    table = XidPolicyTable(custom)
    assert table.classify(79).fault_class == FaultClass.DEGRADING
    assert table.classify(13).fault_class == FaultClass.FATAL
    assert table.classify(48).fault_class == FaultClass.UNKNOWN


def test_a_malformed_table_is_refused_with_the_row(tmp_path: Path):
    bad = tmp_path / "policy.csv"
    bad.write_text("xid,fault_class\n79,fatal\nxx,fatal\n")
    with pytest.raises(ValueError, match="row 3"):
        XidPolicyTable(bad)
    bad.write_text("xid,fault_class\n79,catastrophic\n")
    with pytest.raises(ValueError, match="row 2"):
        XidPolicyTable(bad)


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        ("GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)", "fatal"),
        ("GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)", "fatal"),
        ("GPU recovery action changed from 0x0 (None) to 0x3 (Drain P2P)", "degrading"),
        ("GPU recovery action changed from 0x0 (None) to 0x4 (Drain and Reset)", "degrading"),
        ("GPU recovery action changed from 0x1 (GPU Reset Required) to 0x0 (None)", "application"),
        ("GPU recovery action changed", "unknown"),  # no action named: drain and escalate
    ],
)
def test_xid_154_takes_the_drivers_recommended_action(message, expected):
    classification = XidPolicyTable(DEFAULT_XID_POLICY).classify(154, f"NVRM: Xid (PCI:0000:3b:00): 154, {message}")
    assert classification.fault_class.value == expected
