"""How a URL that may hold a secret is shown in logs, errors, histories and `recovery config`.

A webhook URL often is the secret: user info, a Slack-style secret path, a ?token= query. Only
where it goes is shown, with a short fingerprint of the whole URL so that two configurations can
be told apart (is the worker using the new URL?) without revealing it.
"""

from __future__ import annotations

import hashlib
from urllib.parse import urlsplit

DEFAULT_PORTS = {"http": 80, "https": 443}
FINGERPRINT_HEX_DIGITS = 12


def fingerprint(secret: str) -> str:
    return "sha256:" + hashlib.sha256(secret.encode()).hexdigest()[:FINGERPRINT_HEX_DIGITS]


def fingerprinted_url(url: str) -> str:
    """scheme://host:port and the fingerprint: nothing of the user info, path or query."""
    parts = urlsplit(url)
    port = parts.port or DEFAULT_PORTS.get(parts.scheme) or ""
    return f"{parts.scheme}://{parts.hostname or ''}:{port} ({fingerprint(url)})"
