"""Who may post alerts: a bearer token, or an HMAC-SHA256 signature over the body.

Both compare in constant time (hmac.compare_digest). Secrets live in SecretStr and are only
unwrapped here; nothing in this module logs a header, a token or a signature.
"""

from __future__ import annotations

import hashlib
import hmac

from pydantic import SecretStr

from starter.hooks.problems import Refused, problem
from starter.hooks.settings import HookSettings

SIGNATURE_HEADER = "x-recovery-signature"  # "sha256=<hex digest of the body>", as GitHub's webhooks do
SIGNATURE_PREFIX = "sha256="


def sign(key: bytes, body: bytes) -> str:
    """The signature header value a client sends for this body."""
    return SIGNATURE_PREFIX + hmac.new(key, body, hashlib.sha256).hexdigest()


def _unwrap(secret: SecretStr | None) -> bytes | None:
    return None if secret is None else secret.get_secret_value().encode()


class Authenticator:
    def __init__(self, settings: HookSettings) -> None:
        self._bearer = _unwrap(settings.token) if "bearer" in settings.auth else None
        self._hmac_key = _unwrap(settings.hmac_key) if "hmac" in settings.auth else None

    def check(self, authorization: str | None, signature: str | None, body: bytes) -> None:
        """Raise Refused(401) unless one configured scheme accepts the request."""
        if self._bearer is not None and authorization is not None:
            scheme, _, credentials = authorization.partition(" ")
            presented = credentials.strip().encode()
            # Empty credentials never match, whatever the configuration let through.
            if scheme.lower() == "bearer" and presented and hmac.compare_digest(presented, self._bearer):
                return
        if self._hmac_key is not None and signature is not None:
            expected = sign(self._hmac_key, body).encode()
            if hmac.compare_digest(signature.strip().encode(), expected):
                return
        raise Refused(401, "unauthorized", [self._what_was_wrong(authorization, signature)],
                      headers={"www-authenticate": 'Bearer realm="training-recovery"'} if self._bearer else {})

    def _what_was_wrong(self, authorization: str | None, signature: str | None) -> dict[str, str]:
        if authorization is None and signature is None:
            accepted = " or ".join(
                (["an Authorization: Bearer token"] if self._bearer else [])
                + ([f"an {SIGNATURE_HEADER} HMAC-SHA256 signature of the body"] if self._hmac_key else [])
            )
            return problem("headers", f"no credentials: send {accepted}")
        if signature is not None and self._hmac_key is not None:
            return problem(f"headers.{SIGNATURE_HEADER}", "the signature does not match the body")
        if authorization is not None and self._bearer is not None:
            return problem("headers.authorization", "the bearer token is not valid")
        return problem("headers", "these credentials are for a scheme this hook does not accept")
