"""Checks of the files frameworks write inside a checkpoint, each from the file's own structure and
size alone (no hashing, no PyTorch): a `torch.save` archive and a safetensors file."""

from __future__ import annotations

import json
import struct
import zipfile
import zlib
from pathlib import Path
from typing import Any

from backends.checkpoints import pickled

SAFETENSORS_HEADER_LIMIT = 100 << 20  # the format's own bound on the JSON header
# What reading a damaged zip archive raises (a bad CRC, a bad deflate stream, an unknown method)
ARCHIVE_ERRORS = (zipfile.BadZipFile, zlib.error, OSError, RuntimeError, NotImplementedError, EOFError, ValueError)


def torch_archive_problem(path: Path) -> str | None:
    """Why a `torch.save` file (a zip archive since PyTorch 1.6) is not whole: a truncated archive
    has lost the central directory at its end, or holds entries reaching past its end."""
    try:
        size = path.stat().st_size
        with zipfile.ZipFile(path) as archive:
            entries = archive.infolist()
    except FileNotFoundError:
        return f"{path.name} missing"
    except ARCHIVE_ERRORS as error:
        return f"{path.name} is not a whole torch.save archive ({type(error).__name__}: {error})"
    if not any(e.filename.endswith("data.pkl") for e in entries):
        return f"{path.name} has no data.pkl: not a torch.save archive"
    if any(e.header_offset + e.compress_size > size for e in entries):
        return f"{path.name} truncated: an entry reaches past its {size} bytes"
    return None


def torch_archive_object(path: Path) -> Any:
    """The object a `torch.save` archive holds, tensors left unread (pickled.Stub for each)."""
    with zipfile.ZipFile(path) as archive:
        name = next(n for n in archive.namelist() if n.endswith("data.pkl"))
        return pickled.load(archive.read(name))


def safetensors_problem(path: Path) -> str | None:
    """Why a safetensors file is not whole: its 8-byte header length, JSON header and the end of
    its last tensor give the size it must have."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as file:
            head = file.read(8)
            if len(head) < 8:
                return f"{path.name} truncated: {size} bytes"
            (header_len,) = struct.unpack("<Q", head)
            if header_len > SAFETENSORS_HEADER_LIMIT:
                return f"{path.name} is not a safetensors file (header of {header_len} bytes)"
            header = json.loads(file.read(header_len))
    except FileNotFoundError:
        return f"{path.name} missing"
    except (OSError, ValueError) as error:
        return f"{path.name} header unreadable ({error})"
    ends = _tensor_ends(header)
    if ends is None:
        return f"{path.name} header unreadable (not a map of tensors with two integer data_offsets each)"
    needed = 8 + header_len + max(ends, default=0)
    if size < needed:
        return f"{path.name} truncated: {size} bytes, its header needs {needed}"
    return None


def _tensor_ends(header: object) -> list[int] | None:
    """Where each tensor of a safetensors header ends; None when the header is not well formed."""
    if not isinstance(header, dict):
        return None
    ends = []
    for name, tensor in header.items():
        if name == "__metadata__":
            continue
        offsets = tensor.get("data_offsets") if isinstance(tensor, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
            return None
        ends.append(offsets[1])
    return ends
