"""Atomic, self-verifying training checkpoints and the progress files of a job's run directory.

Standard library only: users copy this module into their own training jobs.

A run directory holds (the recovery controller reads these names and fields exactly):

    step-000000120/           a complete checkpoint: payload files, manifest.json written last
    .tmp-step-000000130-…/    a checkpoint being written; renamed to step-… once complete
    progress.json             rank 0's latest step, replaced atomically every step
    resume-log.jsonl          one JSON record appended at every start of the job

A checkpoint is complete only if its manifest parses, has every field, and every file it lists
exists with the listed size and sha256. Anything else is incomplete, with a reason for a person.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

MANIFEST_FORMAT = 1
MANIFEST_NAME = "manifest.json"
PROGRESS_NAME = "progress.json"
RESUME_LOG_NAME = "resume-log.jsonl"
TMP_PREFIX = ".tmp-"
BEING_WRITTEN = "being written (temporary directory)"

# Checkpoints being deleted are first renamed into this namespace, so that a reader never
# mistakes a half-deleted checkpoint for an incomplete one.
_DELETING_PREFIX = ".deleting-"
_STEP_DIR = re.compile(r"step-(\d{9,})")
_TMP_STEP_DIR = re.compile(re.escape(TMP_PREFIX) + r"step-(\d{9,})-")
_MANIFEST_FIELDS = ("format", "checkpoint_id", "step", "train_seconds", "created_at", "files")
_HASH_CHUNK_BYTES = 1 << 20
_RESERVED_NAMES = (".", "..", MANIFEST_NAME)


class CheckpointError(Exception):
    """A checkpoint that was expected to be complete is not."""


class _Incomplete(Exception):
    """Internal: the message is the human reason a checkpoint is incomplete."""


@dataclass(frozen=True)
class Checkpoint:
    checkpoint_id: str
    step: int
    train_seconds: float
    created_at: datetime
    path: Path


@dataclass(frozen=True)
class Skipped:
    checkpoint_id: str
    why: str


@dataclass(frozen=True)
class CheckpointStatus:
    checkpoint_id: str
    path: Path
    step: int | None
    complete: bool
    why: str | None


@dataclass(frozen=True)
class _Found:
    """One scanned directory: its status, when it was made, and its checkpoint if complete."""

    status: CheckpointStatus
    created_at: datetime
    checkpoint: Checkpoint | None


def checkpoint_id(step: int) -> str:
    return f"step-{step:09d}"


def utc_now_iso() -> str:
    return datetime.now(timezone.utc).isoformat()


# --- checkpoints -------------------------------------------------------------------------------


def save_checkpoint(run_dir: Path, step: int, train_seconds: float, files: dict[str, bytes]) -> Checkpoint:
    """Write a checkpoint atomically: it appears as ``step-…`` only once every byte is durable.

    If a complete checkpoint for ``step`` exists it is returned as is; an incomplete one (left by
    an earlier run) is replaced.
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, not {step}")
    for name in files:
        if not _is_plain_name(name):
            raise ValueError(f"invalid checkpoint file name {name!r}: use a plain file name")
    final = run_dir / checkpoint_id(step)
    if final.exists():
        try:
            return _checkpoint_from(final, _verified_manifest(final))
        except _Incomplete:
            _remove_dir(final)
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / f"{TMP_PREFIX}{final.name}-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    created_at = datetime.now(timezone.utc)
    try:
        entries = []
        for name, data in files.items():
            _write_durably(tmp / name, data)
            digest = hashlib.sha256(data).hexdigest()
            entries.append({"name": name, "size": len(data), "sha256": digest})
        manifest = {
            "format": MANIFEST_FORMAT,
            "checkpoint_id": final.name,
            "step": step,
            "train_seconds": train_seconds,
            "created_at": created_at.isoformat(),
            "files": entries,
        }
        # the manifest goes last: its presence is what marks the payload as written
        _write_durably(tmp / MANIFEST_NAME, (json.dumps(manifest, indent=2) + "\n").encode())
        _fsync_dir(tmp)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync_dir(run_dir)
    return Checkpoint(final.name, step, train_seconds, created_at, final)


def verify_checkpoint(path: Path) -> str | None:
    """None if the checkpoint at ``path`` is complete, else why it is not."""
    try:
        _verified_manifest(path)
    except _Incomplete as incomplete:
        return str(incomplete)
    return None


def checked_checkpoint(path: Path) -> Checkpoint | str:
    """The complete checkpoint at ``path``, or why it is not complete."""
    try:
        return _checkpoint_from(path, _verified_manifest(path))
    except _Incomplete as incomplete:
        return str(incomplete)


def name_step(name: str) -> tuple[int | None, bool] | None:
    """A run directory entry's step (None when a temporary name has none) and whether it is being
    written; None when the name is not a checkpoint's."""
    if step_match := _STEP_DIR.fullmatch(name):
        return int(step_match[1]), False
    if name.startswith(TMP_PREFIX):
        tmp_match = _TMP_STEP_DIR.match(name)
        return (int(tmp_match[1]) if tmp_match else None), True
    return None


def list_checkpoints(run_dir: Path) -> list[CheckpointStatus]:
    """Every checkpoint and temporary checkpoint directory, ordered by step (unknown steps last)."""
    return [found.status for found in _scan(run_dir)]


def find_latest_complete(
    run_dir: Path, created_before: datetime | None = None
) -> tuple[Checkpoint | None, list[Skipped]]:
    """The newest complete checkpoint, and the incomplete ones newer than it (newest first).

    Temporary directories count as newer whatever their step. With ``created_before``, anything
    created at or after it is ignored (manifest time for complete checkpoints, directory mtime
    for the rest).
    """
    found = [f for f in _scan(run_dir) if created_before is None or f.created_at < created_before]
    latest = next((f.checkpoint for f in reversed(found) if f.checkpoint), None)
    skipped = [
        Skipped(f.status.checkpoint_id, f.status.why or "")
        for f in reversed(found)
        if not f.status.complete
        and (
            latest is None
            or f.status.checkpoint_id.startswith(TMP_PREFIX)
            or (f.status.step is not None and f.status.step > latest.step)
        )
    ]
    return latest, skipped


def load_checkpoint(cp: Checkpoint) -> dict[str, bytes]:
    """The checkpoint's files, checked against its manifest as they are read."""
    try:
        manifest = _verified_manifest(cp.path, check_files=False)
        files = {}
        for entry in manifest["files"]:
            name = entry["name"]
            try:
                data = (cp.path / name).read_bytes()
            except FileNotFoundError:
                raise _Incomplete(f"manifest names missing file {name}") from None
            except OSError as error:
                raise _Incomplete(f"{name} unreadable: {error.strerror}") from None
            problem = _file_problem(entry, len(data), lambda: hashlib.sha256(data).hexdigest())  # noqa: B023 (called here)
            if problem:
                raise _Incomplete(problem)
            files[name] = data
    except _Incomplete as incomplete:
        raise CheckpointError(
            f"checkpoint {cp.checkpoint_id} at {cp.path} is not complete any more: {incomplete}"
        ) from None
    return files


def prune_checkpoints(run_dir: Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` complete checkpoints (always keeping the newest one).

    Incomplete checkpoints are left alone: the resume log already points at them.
    """
    complete = [f.status for f in _scan(run_dir) if f.status.complete]
    doomed = complete[: -max(keep, 1)]
    for status in doomed:
        _remove_dir(status.path)
    # leftovers of a deletion interrupted by a crash
    for leftover in run_dir.glob(_DELETING_PREFIX + "*"):
        shutil.rmtree(leftover, ignore_errors=True)
    return [status.path for status in doomed]


# --- progress and resume log -------------------------------------------------------------------


def read_progress(run_dir: Path) -> dict[str, Any] | None:
    """The job's last progress record; None if there is none or it is not a JSON object."""
    try:
        progress = json.loads((run_dir / PROGRESS_NAME).read_bytes())
    except FileNotFoundError:
        return None
    except ValueError:
        # replaced atomically, so this is outside damage; progress is advisory: do not fail
        return None
    return progress if isinstance(progress, dict) else None


def write_progress(run_dir: Path, progress: dict[str, Any]) -> None:
    """Replace progress.json atomically (readers see the old or the new record, never a mix)."""
    tmp = run_dir / f"{PROGRESS_NAME}.{os.getpid()}.tmp"
    _write_durably(tmp, (json.dumps(progress) + "\n").encode())
    os.replace(tmp, run_dir / PROGRESS_NAME)


def append_resume_record(run_dir: Path, record: dict[str, Any]) -> None:
    """Append one record to resume-log.jsonl and make it durable."""
    path = run_dir / RESUME_LOG_NAME
    line = (json.dumps(record) + "\n").encode()
    created = not path.exists()
    with open(path, "ab+") as log:
        # a crash mid-append leaves a torn last line: start afresh so this record stays readable
        if log.seek(0, os.SEEK_END) > 0:
            log.seek(-1, os.SEEK_END)
            if log.read(1) != b"\n":
                line = b"\n" + line
        log.write(line)
        log.flush()
        os.fsync(log.fileno())
    if created:
        _fsync_dir(run_dir)


def read_resume_records(run_dir: Path) -> list[dict[str, Any]]:
    """Every resume record, oldest first; torn lines (a crash mid-append) are left out."""
    try:
        text = (run_dir / RESUME_LOG_NAME).read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return []
    records = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


# --- internals ---------------------------------------------------------------------------------


def _scan(run_dir: Path) -> list[_Found]:
    try:
        children = list(run_dir.iterdir())
    except FileNotFoundError:
        return []
    found = []
    for child in children:
        named = name_step(child.name)
        if named is None:
            continue
        step = named[0]
        try:
            if not child.is_dir():
                continue
            mtime = datetime.fromtimestamp(child.stat().st_mtime, timezone.utc)
        except FileNotFoundError:  # deleted while we looked
            continue
        try:
            checkpoint = _checkpoint_from(child, _verified_manifest(child))
            status = CheckpointStatus(child.name, child, step, True, None)
            found.append(_Found(status, checkpoint.created_at, checkpoint))
        except _Incomplete as incomplete:
            status = CheckpointStatus(child.name, child, step, False, str(incomplete))
            found.append(_Found(status, mtime, None))
    # for one step, ".tmp-…" sorts before "step-…", so the complete one is the later of the two
    found.sort(key=lambda f: (f.status.step is None, f.status.step or 0, f.status.checkpoint_id))
    return found


def _verified_manifest(path: Path, check_files: bool = True) -> dict[str, Any]:
    """The checkpoint's manifest, validated; raises _Incomplete with the reason if it is not."""
    if path.name.startswith(TMP_PREFIX):
        # the rename to step-… is the commit point: a temporary directory is never complete
        raise _Incomplete(BEING_WRITTEN)
    try:
        raw = (path / MANIFEST_NAME).read_bytes()
    except FileNotFoundError:
        raise _Incomplete("no manifest") from None
    except OSError as error:
        raise _Incomplete(f"manifest unreadable: {error.strerror}") from None
    try:
        manifest = json.loads(raw)
    except ValueError as error:
        raise _Incomplete(f"manifest unreadable: {error}") from None
    if not isinstance(manifest, dict):
        raise _Incomplete("manifest unreadable: not a JSON object")
    missing = [field for field in _MANIFEST_FIELDS if field not in manifest]
    if missing:
        raise _Incomplete(f"manifest lacks {', '.join(missing)}")
    if manifest["format"] != MANIFEST_FORMAT:
        raise _Incomplete(f"manifest format {manifest['format']!r} is not {MANIFEST_FORMAT}")
    _check_manifest_types(manifest)
    described = manifest["checkpoint_id"]
    if described != path.name or described != checkpoint_id(manifest["step"]):
        raise _Incomplete(f"manifest describes {described} (step {manifest['step']}), not {path.name}")
    if check_files:
        for entry in manifest["files"]:
            _check_file(path, entry)
    return manifest


def _check_manifest_types(manifest: dict[str, Any]) -> None:
    def is_int(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    def invalid(field: str) -> _Incomplete:
        return _Incomplete(f"manifest field {field} is invalid: {manifest[field]!r}")

    if not isinstance(manifest["checkpoint_id"], str):
        raise invalid("checkpoint_id")
    if not is_int(manifest["step"]) or manifest["step"] < 0:
        raise invalid("step")
    if not (is_int(manifest["train_seconds"]) or isinstance(manifest["train_seconds"], float)):
        raise invalid("train_seconds")
    try:
        created_at = datetime.fromisoformat(manifest["created_at"])
    except (TypeError, ValueError):
        raise invalid("created_at") from None
    if created_at.tzinfo is None:
        raise invalid("created_at")
    files = manifest["files"]
    if not isinstance(files, list) or not all(
        isinstance(entry, dict)
        and isinstance(entry.get("name"), str)
        and _is_plain_name(entry["name"])
        and is_int(entry.get("size"))
        and isinstance(entry.get("sha256"), str)
        for entry in files
    ):
        raise invalid("files")


def _check_file(checkpoint_dir: Path, entry: dict[str, Any]) -> None:
    name = entry["name"]
    path = checkpoint_dir / name
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise _Incomplete(f"manifest names missing file {name}") from None
    problem = _file_problem(entry, size, lambda: _sha256_of(path))
    if problem:
        raise _Incomplete(problem)


def _file_problem(entry: dict[str, Any], size: int, sha256: Callable[[], str]) -> str | None:
    """Why a file does not match its manifest entry; the hash is computed only if sizes agree."""
    name, expected = entry["name"], entry["size"]
    if size < expected:
        return f"{name} truncated: {size} of {expected} bytes"
    if size > expected:
        return f"{name} too long: {size} bytes, manifest says {expected}"
    if sha256() != entry["sha256"]:
        return f"{name} checksum mismatch"
    return None


def _sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as file:
            while chunk := file.read(_HASH_CHUNK_BYTES):
                digest.update(chunk)
    except OSError as error:
        raise _Incomplete(f"{path.name} unreadable: {error.strerror}") from None
    return digest.hexdigest()


def _checkpoint_from(path: Path, manifest: dict[str, Any]) -> Checkpoint:
    return Checkpoint(
        checkpoint_id=manifest["checkpoint_id"],
        step=manifest["step"],
        train_seconds=float(manifest["train_seconds"]),
        created_at=datetime.fromisoformat(manifest["created_at"]),
        path=path,
    )


def _is_plain_name(name: str) -> bool:
    return bool(name) and "/" not in name and "\0" not in name and name not in _RESERVED_NAMES


def _write_durably(path: Path, data: bytes) -> None:
    with open(path, "wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_dir(path: Path) -> None:
    # rename first (atomic), so no reader ever sees the directory half deleted
    doomed = path.with_name(f"{_DELETING_PREFIX}{path.name}-{secrets.token_hex(4)}")
    os.rename(path, doomed)
    shutil.rmtree(doomed)
