"""Checks of the files frameworks write inside a checkpoint, each from the file's own structure and
size alone (no hashing, no PyTorch): a `torch.save` archive and a safetensors file."""

from __future__ import annotations

import json
import struct
import zipfile
from pathlib import Path
from typing import Any

from backends.checkpoints import pickled

SAFETENSORS_HEADER_LIMIT = 100 << 20  # the format's own bound on the JSON header


def torch_archive_problem(path: Path) -> str | None:
    """Why a `torch.save` file (a zip archive since PyTorch 1.6) is not whole: a truncated archive
    has lost the central directory at its end, or holds entries reaching past its end."""
    try:
        size = path.stat().st_size
        with zipfile.ZipFile(path) as archive:
            entries = archive.infolist()
    except FileNotFoundError:
        return f"{path.name} missing"
    except (zipfile.BadZipFile, OSError) as error:
        return f"{path.name} is not a whole torch.save archive ({error})"
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
    ends = [t["data_offsets"][1] for k, t in header.items() if k != "__metadata__" and isinstance(t, dict)]
    needed = 8 + header_len + max(ends, default=0)
    if size < needed:
        return f"{path.name} truncated: {size} bytes, its header needs {needed}"
    return None
