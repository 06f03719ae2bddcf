"""Issue #22, "Safe to switch on": the hook refuses to start with an empty secret, and an empty
bearer credential never matches (before: RECOVERY_HOOKS_TOKEN="" started the hook, and
`Authorization: Bearer ` with nothing after it was accepted)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from pydantic import SecretStr

from hooks.auth import Authenticator
from hooks.problems import Refused
from hooks.settings import HookSettings

HOOK = [sys.executable, "-m", "cli.app", "hooks"]  # `recovery hooks`, from this checkout


@pytest.mark.parametrize(
    "variable, value",
    [
        ("RECOVERY_HOOKS_TOKEN", ""),
        ("RECOVERY_HOOKS_TOKEN", "  "),
        ("RECOVERY_HOOKS_HMAC_KEY", ""),
        ("RECOVERY_HOOKS_HMAC_KEY", " \t "),
    ],
)
def test_the_hook_refuses_to_start_with_an_empty_secret(variable, value):
    env = {k: v for k, v in os.environ.items() if not k.startswith("RECOVERY_HOOKS_")} | {
        "RECOVERY_HOOKS_AUTH": "bearer,hmac",
        "RECOVERY_HOOKS_TOKEN": "a-real-token",
        "RECOVERY_HOOKS_HMAC_KEY": "a-real-key",
        variable: value,
        "RECOVERY_HOOKS_PORT": "0",
        "TEMPORAL_ADDRESS": "127.0.0.1:9",  # nothing listens: a hook that got this far would not start either
    }
    done = subprocess.run(HOOK, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{variable} is empty or only whitespace" in lines[0], done.stderr


@pytest.mark.parametrize("authorization", ["Bearer", "Bearer ", "Bearer    ", "bearer \t"])
def test_an_empty_bearer_credential_never_matches(authorization):
    # Even a configuration that bypassed validation (an empty token) accepts no empty credential.
    settings = HookSettings.model_construct(auth=["bearer"], token=SecretStr(""), hmac_key=None)
    with pytest.raises(Refused) as refused:
        Authenticator(settings).check({"authorization": authorization}, b"{}")
    assert refused.value.status == 401
