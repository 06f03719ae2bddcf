"""Read the pickles that checkpoints carry (DCP's `.metadata`, the `data.pkl` inside a `torch.save`
archive) without PyTorch and without running any of their code.

Every class or function a pickle names becomes an inert `Stub` that only remembers its name, the
arguments it was called with and the state it was given: the controller reads the plain values it
needs (file names, offsets, lengths, steps) out of them. Unpickling an untrusted file with pickle's
own loader could run anything; this one calls nothing but the builtins below.
"""

from __future__ import annotations

import collections
import io
import pickle
from typing import Any, BinaryIO

# Containers a pickle may name that are safe to build for real (the state they are given needs them;
# none of them can be asked for a huge allocation by a number, as bytearray(10**12) could)
_SAFE = {
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "slice"): slice,
    ("collections", "OrderedDict"): collections.OrderedDict,
}


class Stub:
    """A stand-in for an object of a class the controller does not import."""

    stub_name = "?"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args
        self.kwargs = kwargs
        self.state: Any = None

    def __setstate__(self, state: Any) -> None:
        # dataclasses and plain objects: a dict; with __slots__: (dict | None, slots dict)
        if isinstance(state, tuple) and len(state) == 2 and (state[0] is None or isinstance(state[0], dict)):
            state = {**(state[0] or {}), **(state[1] or {})}
        self.state = state

    def field(self, name: str, default: Any = None) -> Any:
        return self.state.get(name, default) if isinstance(self.state, dict) else default

    def __repr__(self) -> str:
        return f"<{self.stub_name} {self.args or ''}{self.state if self.state is not None else ''}>"


def _stub_class(module: str, name: str) -> type[Stub]:
    return type(name, (Stub,), {"stub_name": f"{module}.{name}", "__module__": "stub"})


class _StubUnpickler(pickle.Unpickler):
    def __init__(self, file: BinaryIO) -> None:
        super().__init__(file)
        self._classes: dict[tuple[str, str], type[Stub]] = {}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _SAFE:
            return _SAFE[(module, name)]
        return self._classes.setdefault((module, name), _stub_class(module, name))

    def persistent_load(self, pid: Any) -> Any:
        # torch.save's tensors: ('storage', storage type, key, location, numel); their bytes stay unread
        return _stub_class("persistent", "storage")(pid)


def load(data: bytes | BinaryIO) -> Any:
    """The pickle's object tree, every foreign object a `Stub`. Raises ValueError if it is not a
    whole pickle (truncated, or not a pickle at all)."""
    file = io.BytesIO(data) if isinstance(data, bytes) else data
    try:
        return _StubUnpickler(file).load()
    except (pickle.UnpicklingError, EOFError, TypeError, AttributeError, IndexError, KeyError) as error:
        raise ValueError(f"not a readable pickle ({type(error).__name__}: {error})") from None
