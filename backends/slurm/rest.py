"""Slurm through slurmrestd over HTTP with a JWT, for what the server's API version can do."""

from __future__ import annotations

import json
from collections.abc import Callable, Generator
from pathlib import Path
from typing import Any

import httpx

from backends.slurm.api import (
    NodeUpdate,
    SlurmError,
    SlurmNotFound,
    SlurmUnavailable,
    Unsupported,
)
from backends.slurm.parse import job_from_json, node_from_json
from contracts.models import Invocation, SlurmJob, SlurmNode

_JOB_READS = frozenset({"ping", "list_jobs", "get_job"})
_READS = _JOB_READS | {"get_node", "list_nodes"}
_NODE_UPDATES = frozenset({"update_node", "set_node_comment"})
_JOB_UPDATES = frozenset({"set_excluded_nodes", "release_job"})
# What each OpenAPI version of slurmrestd can do for a recovery (measured on 22.05.8, 24.11.5 and
# 26.05.5). v0.0.38 (22.05) cannot update nodes, and its node schema has no `comment` (where a
# spare's claim is kept): nodes are read with the CLI there. v0.0.40 and v0.0.41 answer a failed
# signal with HTTP 200 and no error at all, so signals go over REST from v0.0.42 on, which reports
# the failure in `status[]` (as v0.0.43-45 do). A job's pin (required_nodes) is set over REST from
# v0.0.43 on (measured on 26.05; on 24.11 it stays with scontrol). Only v0.0.45 (26.05) can
# requeue a job (POST /jobs/requeue with Hold): on it every operation has a REST path, and a worker
# can run with no Slurm commands at all (RECOVERY_SLURM_CLI=false).
_CURRENT = _READS | _NODE_UPDATES | _JOB_UPDATES | {"signal_job", "set_required_nodes"}
KNOWN_VERSIONS: dict[str, frozenset[str]] = {
    "v0.0.38": _JOB_READS | {"signal_job"},
    "v0.0.40": _READS | _NODE_UPDATES | _JOB_UPDATES,
    "v0.0.41": _READS | _NODE_UPDATES | _JOB_UPDATES,
    "v0.0.42": _READS | _NODE_UPDATES | _JOB_UPDATES | {"signal_job"},
    "v0.0.43": _CURRENT,
    "v0.0.44": _CURRENT,
    "v0.0.45": _CURRENT | {"requeue_hold"},
}


# Every request this client makes, by operation: method, path under /slurm/{version}, the query
# parameters and body fields it may send. The contract tests check each against the OpenAPI
# document that the running slurmrestd serves, so a renamed field fails a test, not a recovery.
ENDPOINTS: dict[str, tuple[str, str, tuple[str, ...], tuple[str, ...]]] = {
    "ping": ("GET", "/ping", (), ()),
    # A node is read from the full listing, never GET /node/{node_name}: slurmctld answers the
    # single-node request without recomputing the nodes' allocated CPUs (24.11.5 proc_req.c,
    # _slurm_rpc_dump_node_single: select_g_select_nodeinfo_set_all() under "#if 0"), so a node
    # whose job has left keeps the CPUs of the last full listing, and the client library shows a
    # node with some CPUs allocated as MIXED, even a DOWN one (node_info.c _set_node_mixed_op):
    # an eviction waited minutes for a node that was DOWN and empty. Every full listing recomputes.
    "get_node": ("GET", "/nodes", (), ()),
    "list_nodes": ("GET", "/nodes", (), ()),
    "list_jobs": ("GET", "/jobs", (), ()),
    "get_job": ("GET", "/job/{job_id}", (), ()),
    "update_node": ("POST", "/node/{node_name}", (), ("state", "reason")),
    "set_node_comment": ("POST", "/node/{node_name}", (), ("comment",)),
    "signal_job": ("DELETE", "/job/{job_id}", ("signal", "flags"), ()),
    "set_excluded_nodes": ("POST", "/job/{job_id}", (), ("excluded_nodes",)),
    "release_job": ("POST", "/job/{job_id}", (), ("hold",)),
    "set_required_nodes": ("POST", "/job/{job_id}", (), ("required_nodes",)),
    "requeue_hold": ("POST", "/jobs/requeue", (), ("jobs", "flags")),
}


def _says_not_found(error: dict[str, Any]) -> bool:
    text = f"{error.get('error', '')} {error.get('description', '')}"
    # 24.11 reports a missing node as "Failure to query node X" with "No error" (error number 0);
    # the same description with another number is some other failure (1007: authentication).
    return (
        "Invalid job id" in text
        or "Invalid node name" in text
        or (text.strip().startswith("No error Failure to query node") and not error.get("error_number"))
    )


def _answers(ping: dict[str, Any]) -> bool:
    if "responding" in ping:
        return ping["responding"] is True
    return ping.get("pinged", ping.get("ping")) == "UP"


class TokenFile:
    """A JWT in a file that a renewer replaces (a new file renamed over the old one, as
    `scontrol token` output or the bare token): read again whenever the file has changed, so a
    short-lived token is rotated without restarting the worker."""

    def __init__(self, path: Path):
        self.path = path
        self._token = ""
        self._read_version: tuple[int, int, int] | None = None  # (inode, mtime, size) of the file read

    def __call__(self) -> str:
        try:
            stat = self.path.stat()
            version = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
            if version != self._read_version:
                token = self.path.read_text().strip().removeprefix("SLURM_JWT=")
                if not token:
                    raise SlurmUnavailable(f"the slurmrestd token file {self.path} is empty")
                self._token, self._read_version = token, version
        except OSError as e:
            raise SlurmUnavailable(f"cannot read the slurmrestd token file {self.path}: {e.strerror}") from None
        return self._token


class _SlurmJwt(httpx.Auth):
    """slurmrestd's headers, the token as it is now on each request."""

    def __init__(self, user: str, token: Callable[[], str]):
        self._user = user
        self._token = token

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        request.headers["X-SLURM-USER-NAME"] = self._user
        request.headers["X-SLURM-USER-TOKEN"] = self._token()
        yield request


class SlurmRest:
    path = "rest"
    # In dry-run every write is described, not sent (SlurmClient.planning()); reads still run.
    dry_run = False

    def __init__(self, url: str, user: str, token: str | TokenFile, timeout: float = 10.0):
        self._http = httpx.AsyncClient(
            base_url=url.rstrip("/"),
            auth=_SlurmJwt(user, token if isinstance(token, TokenFile) else lambda: token),
            timeout=timeout,
        )
        self.version: str | None = None

    async def aclose(self) -> None:
        await self._http.aclose()

    async def discover(self) -> str:
        """Pick the newest API version that both the server serves and this client knows, and
        check that the token is accepted (the OpenAPI document itself needs no token)."""
        doc = await self._request("GET", "/openapi/v3")
        served = {p.split("/")[2] for p in doc.get("paths", {}) if p.startswith("/slurm/v")}
        usable = sorted(served & KNOWN_VERSIONS.keys(), key=lambda v: [int(x) for x in v[1:].split(".")])
        if not usable:
            raise Unsupported(f"slurmrestd serves {sorted(served)}; this client knows {sorted(KNOWN_VERSIONS)}")
        self.version = usable[-1]
        # 24.11 and 26.05 answer a ping with a bad token 200, saying slurmctld is DOWN (`pinged`,
        # until v0.0.44) or not responding (v0.0.45 has only `responding`, and a `status`)
        pings = (await self._call("ping")).get("pings") or []
        if not pings or not all(_answers(p) for p in pings):
            raise SlurmUnavailable(f"slurmctld does not answer through slurmrestd (token refused?): {pings}")
        return self.version

    def supports(self, operation: str) -> bool:
        return self.version is not None and operation in KNOWN_VERSIONS[self.version]

    async def _request(self, method: str, url: str, **kw: Any) -> dict[str, Any]:
        try:
            resp = await self._http.request(method, url, **kw)
        except httpx.TransportError as e:
            raise SlurmUnavailable(f"slurmrestd unreachable: {e!r}") from e
        try:
            body = resp.json() if resp.content else {}
        except ValueError:
            body = {}
        raw_errors = body.get("errors") or []
        errors = [e.get("error") or e.get("description") or str(e) for e in raw_errors]
        if resp.status_code == 404 or any(_says_not_found(e) for e in raw_errors):
            raise SlurmNotFound(f"{method} {url}: {resp.status_code} {errors}")
        if resp.status_code >= 500 or resp.status_code in (401, 403, 429):
            raise SlurmUnavailable(f"{method} {url}: {resp.status_code} {errors or resp.text[:200]}")
        if resp.status_code >= 400 or errors:
            raise SlurmError(f"{method} {url}: {resp.status_code} {errors or resp.text[:200]}")
        return body

    def _route(self, operation: str, path_params: dict[str, str | int]) -> tuple[str, str]:
        if not self.supports(operation):
            raise Unsupported(f"slurmrestd {self.version} cannot {operation}")
        method, path, _, _ = ENDPOINTS[operation]
        return method, f"/slurm/{self.version}" + path.format(**path_params)

    async def _call(self, operation: str, **path_params: str | int) -> dict[str, Any]:
        method, url = self._route(operation, path_params)
        return await self._request(method, url)

    async def _write(
        self,
        operation: str,
        params: dict[str, str] | None = None,
        body: dict[str, Any] | None = None,
        **path_params: str | int,
    ) -> tuple[dict[str, Any], Invocation]:
        method, url = self._route(operation, path_params)
        query = "?" + str(httpx.QueryParams(params)) if params else ""
        command = f"{method} {url}{query}" + (f" {json.dumps(body, sort_keys=True)}" if body else "")
        call = Invocation(path=self.path, command=command, executed=not self.dry_run)
        if self.dry_run:
            return {}, call
        return await self._request(method, url, params=params, json=body), call

    async def get_node(self, name: str) -> SlurmNode:
        body = await self._call("get_node")
        for raw in body.get("nodes") or []:
            if raw.get("name") == name:
                return node_from_json(raw)
        raise SlurmNotFound(f"node {name} is not in this cluster")

    async def list_nodes(self) -> list[SlurmNode]:
        body = await self._call("list_nodes")
        return [node_from_json(raw) for raw in body.get("nodes") or []]

    async def list_jobs(self) -> list[SlurmJob]:
        body = await self._call("list_jobs")
        return [job_from_json(raw) for raw in body.get("jobs") or []]

    async def get_job(self, job_id: int) -> SlurmJob:
        body = await self._call("get_job", job_id=job_id)
        jobs = body.get("jobs") or []
        if not jobs:
            raise SlurmNotFound(f"job {job_id} is not known to slurmctld")
        return job_from_json(jobs[0])

    async def update_node(self, name: str, state: NodeUpdate, reason: str | None) -> Invocation:
        body: dict[str, Any] = {"state": [state]}
        if reason is not None:
            body["reason"] = reason
        return (await self._write("update_node", body=body, node_name=name))[1]

    async def set_node_comment(self, name: str, comment: str) -> Invocation:
        return (await self._write("set_node_comment", body={"comment": comment}, node_name=name))[1]

    async def signal_job(self, job_id: int, signal: str) -> Invocation:
        # The batch shell and every step, like scancel --full (v0.0.38 has no flags: it does that).
        # Needs an administrator's token: a REST signal with a non-admin token deadlocks
        # slurmctld 24.11.5 (3 of 3 tries); scancel's older RPC refuses it cleanly.
        params = {"signal": signal}
        if self.version != "v0.0.38":
            params["flags"] = "FULL_JOB"
        body, call = await self._write("signal_job", params=params, job_id=job_id)
        # 24.11 answers 200 for a failed signal; v0.0.42 says why in status[].error.
        failures = [s["error"] for s in body.get("status") or [] if (s.get("error") or {}).get("code")]
        if any("Invalid job id" in str(f.get("string")) for f in failures):
            raise SlurmNotFound(f"job {job_id}: {failures}")
        if failures:
            raise SlurmError(f"signal {signal} to job {job_id} failed: {failures}")
        return call

    async def requeue_hold(self, job_id: int) -> Invocation:
        # As `scontrol requeuehold`: a job not running (pending, say) is refused, with 422.
        body, call = await self._write("requeue_hold", body={"jobs": [str(job_id)], "flags": ["Hold"]})
        failures = [entry for batch in body.get("status") or [] for entry in batch if entry.get("error_code")]
        if failures:
            raise SlurmError(f"requeue of job {job_id} failed: {failures}")
        return call

    async def set_excluded_nodes(self, job_id: int, nodes: list[str]) -> Invocation:
        # As the pin below: an empty list is ignored (measured on 24.11.5 and 26.05.5), one empty name clears.
        return (await self._write("set_excluded_nodes", body={"excluded_nodes": nodes or [""]}, job_id=job_id))[1]

    async def set_required_nodes(self, job_id: int, nodes: list[str]) -> Invocation:
        # An empty list is ignored (200, no error, the pin kept: measured on 26.05.5, v0.0.42-45);
        # one empty name clears the pin, as `scontrol update ReqNodeList=` does.
        return (await self._write("set_required_nodes", body={"required_nodes": nodes or [""]}, job_id=job_id))[1]

    async def release_job(self, job_id: int) -> Invocation:
        # Releases a job held by `scontrol requeuehold` as `scontrol release` does (measured on 24.11).
        return (await self._write("release_job", body={"hold": False}, job_id=job_id))[1]
