"""A worker without the Slurm commands (RECOVERY_SLURM_CLI=false) and a slurmrestd that does not
answer: it asks again for a while (slurmrestd may start after it), then stops as a crash, to be
restarted; before, it exited 2, as for a bad configuration, which a supervisor must not retry."""

from __future__ import annotations

from contextlib import AsyncExitStack

import pytest

import worker
from contracts.settings import ConfigError, load_settings


async def test_an_unreachable_slurmrestd_is_retried_then_a_crash_not_a_bad_configuration(monkeypatch):
    monkeypatch.setattr(worker, "SLURMRESTD_START_ATTEMPTS", 3)
    monkeypatch.setattr(worker, "SLURMRESTD_RETRY_SECONDS", 0.01)
    tries = []
    real = worker.SlurmRest.discover

    async def counted(self):
        tries.append(1)
        return await real(self)

    monkeypatch.setattr(worker.SlurmRest, "discover", counted)
    settings = load_settings(slurm_cli=False, SLURMRESTD_URL="http://127.0.0.1:9", SLURMRESTD_TOKEN="t")
    async with AsyncExitStack() as stack:
        with pytest.raises(RuntimeError, match="did not answer within 3 tries") as raised:
            await worker.build_slurm(settings, stack)
    assert not isinstance(raised.value, ConfigError) and len(tries) == 3
