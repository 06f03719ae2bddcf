"""Who may post alerts: a bearer token, or an HMAC-SHA256 signature over a timestamp, a nonce and the body.

A bearer token is looked up by its SHA-256 (credentials.BearerTokens), a signature compared in
constant time (hmac.compare_digest); either gives the credential, whose nodes the request may
name. Secrets live in SecretStr and are only unwrapped here and in credentials.py; nothing in this
module logs a header, a token or a signature.

A signature is valid within a window around its timestamp, and once: the nonces of accepted
signatures are remembered until their timestamp leaves the window, so a captured request cannot be
replayed (docs/alert-hooks.md, "Authentication").
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import re
import secrets
import time
from collections.abc import Callable, Mapping

from hooks.credentials import Credential
from hooks.problems import Refused, problem
from hooks.settings import HookSettings

SIGNATURE_HEADER = "x-recovery-signature"  # "sha256=<hex HMAC-SHA256 of timestamp.nonce.body>"
TIMESTAMP_HEADER = "x-recovery-timestamp"  # Unix seconds, when the request was signed
NONCE_HEADER = "x-recovery-nonce"  # random, used once
SIGNATURE_PREFIX = "sha256="
NONCE_CHARACTERS = "A-Za-z0-9._~+/=-"  # hex, base64, base64url or a UUID
NONCE = re.compile(f"[{NONCE_CHARACTERS}]{{16,128}}")
_TIMESTAMP = re.compile(r"[0-9]{1,12}")
HMAC_CREDENTIAL = Credential("hmac", None)  # the one shared key: every node


def sign(key: bytes, body: bytes, timestamp: int, nonce: str) -> str:
    """The X-Recovery-Signature value for this body, sent with this timestamp and nonce."""
    message = b"%d.%s." % (timestamp, nonce.encode()) + body
    return SIGNATURE_PREFIX + hmac.new(key, message, hashlib.sha256).hexdigest()


def signed_headers(key: bytes, body: bytes, now: float | None = None) -> dict[str, str]:
    """The headers a client sends with this body: the time, a fresh nonce and their signature.
    Sign every attempt anew: a retry with the same nonce is refused as a replay."""
    timestamp = int(time.time() if now is None else now)
    nonce = secrets.token_urlsafe(24)
    return {TIMESTAMP_HEADER: str(timestamp), NONCE_HEADER: nonce, SIGNATURE_HEADER: sign(key, body, timestamp, nonce)}


class SeenNonces:
    """The nonces of accepted signatures, each until its timestamp leaves the window (after that
    the timestamp alone refuses the request). Bounded: when full of unexpired nonces it refuses
    new ones (503) rather than grow."""

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._expiry: dict[str, float] = {}
        self._by_expiry: list[tuple[float, str]] = []

    def __len__(self) -> int:
        return len(self._expiry)

    def remember(self, nonce: str, expires: float, now: float) -> bool:
        """False if the nonce was seen; Refused(503) if there is no room for it."""
        while self._by_expiry and self._by_expiry[0][0] <= now:
            del self._expiry[heapq.heappop(self._by_expiry)[1]]
        if nonce in self._expiry:
            return False
        if len(self._expiry) >= self._capacity:
            raise Refused(
                503,
                "unavailable",
                [
                    problem(
                        f"headers.{NONCE_HEADER}",
                        f"{self._capacity} signatures in the replay window already; retry later",
                    )
                ],
            )
        self._expiry[nonce] = expires
        heapq.heappush(self._by_expiry, (expires, nonce))
        return True


class Authenticator:
    def __init__(self, settings: HookSettings, clock: Callable[[], float] = time.time) -> None:
        self._bearer = settings.bearer_tokens() if "bearer" in settings.auth else None
        hmac_key = settings.hmac_key if "hmac" in settings.auth else None
        self._hmac_key = None if hmac_key is None else hmac_key.get_secret_value().encode()
        self._window = settings.signature_window_seconds
        self._seen = SeenNonces(settings.nonce_cache_size)
        self._clock = clock

    def check(self, headers: Mapping[str, str], body: bytes) -> Credential:
        """The credential of the request, or Refused(401) unless one configured scheme accepts it
        (503: no room to remember its nonce). Headers by lower-case name."""
        authorization, signature = headers.get("authorization"), headers.get(SIGNATURE_HEADER)
        if self._bearer is not None and authorization is not None:
            scheme, _, credentials = authorization.partition(" ")
            presented = credentials.strip().encode()
            # Empty credentials never match, whatever the configuration let through.
            credential = self._bearer.find(presented) if scheme.lower() == "bearer" and presented else None
            if credential is not None:
                return credential
        if self._hmac_key is not None and signature is not None:
            self._check_signature(self._hmac_key, signature, headers, body)
            return HMAC_CREDENTIAL
        raise self._unauthorized(self._what_was_wrong(authorization, signature))

    def _unauthorized(self, what: dict[str, str]) -> Refused:
        challenge = {"www-authenticate": 'Bearer realm="training-recovery"'} if self._bearer is not None else {}
        return Refused(401, "unauthorized", [what], headers=challenge)

    def _check_signature(self, key: bytes, signature: str, headers: Mapping[str, str], body: bytes) -> None:
        stamp, nonce = headers.get(TIMESTAMP_HEADER, "").strip(), headers.get(NONCE_HEADER, "").strip()
        if not _TIMESTAMP.fullmatch(stamp):
            raise self._unauthorized(problem(f"headers.{TIMESTAMP_HEADER}", "missing or not Unix seconds"))
        if not NONCE.fullmatch(nonce):
            raise self._unauthorized(
                problem(f"headers.{NONCE_HEADER}", f"missing or not 16-128 characters of {NONCE_CHARACTERS}")
            )
        timestamp = int(stamp)
        if not hmac.compare_digest(signature.strip().encode(), sign(key, body, timestamp, nonce).encode()):
            raise self._unauthorized(
                problem(f"headers.{SIGNATURE_HEADER}", "the signature does not match the timestamp, nonce and body")
            )
        now = self._clock()
        if abs(now - timestamp) > self._window:
            raise self._unauthorized(
                problem(
                    f"headers.{TIMESTAMP_HEADER}",
                    f"{timestamp - now:+.0f} s from the hook's clock; "
                    f"a signature is valid for {self._window:g} s either side",
                )
            )
        # Only a valid signature's nonce is remembered: without the key nobody can fill the cache.
        if not self._seen.remember(nonce, expires=timestamp + self._window, now=now):
            raise self._unauthorized(
                problem(f"headers.{NONCE_HEADER}", "replay: this nonce was already used; sign every request anew")
            )

    def _what_was_wrong(self, authorization: str | None, signature: str | None) -> dict[str, str]:
        if authorization is None and signature is None:
            accepted = " or ".join(
                (["an Authorization: Bearer token"] if self._bearer is not None else [])
                + (
                    [f"an {SIGNATURE_HEADER} HMAC-SHA256 signature (with {TIMESTAMP_HEADER} and {NONCE_HEADER})"]
                    if self._hmac_key is not None
                    else []
                )
            )
            return problem("headers", f"no credentials: send {accepted}")
        if authorization is not None and self._bearer is not None:
            return problem("headers.authorization", "the bearer token is not valid")
        return problem("headers", "these credentials are for a scheme this hook does not accept")
