"""Bad input, said precisely: every refusal is a 4xx whose JSON body names each problem."""

from __future__ import annotations

from pydantic import ValidationError


class Refused(Exception):
    """A request the hook will not act on; nothing was handed over."""

    def __init__(
        self, status: int, error: str, problems: list[dict[str, str]], headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(error)
        self.status = status
        self.error = error
        self.problems = problems
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": self.error, "problems": self.problems}


def problem(loc: str, msg: str) -> dict[str, str]:
    return {"loc": loc, "msg": msg}


def location(parts: tuple[str | int, ...] | list[str | int]) -> str:
    """('alerts', 0, 'labels') -> 'alerts[0].labels', the way a person reads a JSON path."""
    text = ""
    for part in parts:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or "body"


def from_validation(e: ValidationError, prefix: tuple[str | int, ...] = ()) -> list[dict[str, str]]:
    # Only the location and pydantic's message: the offending input is not echoed back (it may be
    # large, and echoing arbitrary input into responses and logs is how secrets and junk spread).
    return [problem(location(prefix + tuple(err["loc"])), err["msg"]) for err in e.errors(include_input=False)]
