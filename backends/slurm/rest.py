"""Slurm through slurmrestd over HTTP with a JWT, for what the server's API version can do."""

from __future__ import annotations

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
from contracts.models import SlurmJob, SlurmNode

# What each OpenAPI version of slurmrestd can do for a recovery. v0.0.38 (Slurm 22.05) cannot
# update nodes and no version can requeue a job; those go through the CLI.
KNOWN_VERSIONS: dict[str, frozenset[str]] = {
    "v0.0.38": frozenset({"get_node", "list_jobs", "get_job", "signal_job"}),
}


class SlurmRest:
    path = "rest"

    def __init__(self, url: str, user: str, token: str, timeout: float = 10.0):
        self._http = httpx.AsyncClient(
            base_url=url.rstrip("/"),
            headers={"X-SLURM-USER-NAME": user, "X-SLURM-USER-TOKEN": token},
            timeout=timeout,
        )
        self.version: str | None = None

    async def aclose(self) -> None:
        await self._http.aclose()

    async def discover(self) -> str:
        """Pick the newest API version that both the server serves and this client knows."""
        doc = await self._request("GET", "/openapi/v3")
        served = {p.split("/")[2] for p in doc.get("paths", {}) if p.startswith("/slurm/v")}
        usable = sorted(served & KNOWN_VERSIONS.keys(), key=lambda v: [int(x) for x in v[1:].split(".")])
        if not usable:
            raise Unsupported(f"slurmrestd serves {sorted(served)}; this client knows {sorted(KNOWN_VERSIONS)}")
        self.version = usable[-1]
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
        errors = [e.get("error") or e.get("description") or str(e) for e in body.get("errors") or []]
        if resp.status_code == 404 or any("Invalid job id" in str(e) or "Invalid node name" in str(e) for e in errors):
            raise SlurmNotFound(f"{method} {url}: {resp.status_code} {errors}")
        if resp.status_code >= 500 or resp.status_code in (401, 403, 429):
            raise SlurmUnavailable(f"{method} {url}: {resp.status_code} {errors or resp.text[:200]}")
        if resp.status_code >= 400 or errors:
            raise SlurmError(f"{method} {url}: {resp.status_code} {errors or resp.text[:200]}")
        return body

    def _url(self, operation: str, path: str) -> str:
        if not self.supports(operation):
            raise Unsupported(f"slurmrestd {self.version} cannot {operation}")
        return f"/slurm/{self.version}{path}"

    async def get_node(self, name: str) -> SlurmNode:
        body = await self._request("GET", self._url("get_node", f"/node/{name}"))
        nodes = body.get("nodes") or []
        if not nodes:
            raise SlurmNotFound(f"node {name} is not in this cluster")
        return node_from_json(nodes[0])

    async def list_jobs(self) -> list[SlurmJob]:
        body = await self._request("GET", self._url("list_jobs", "/jobs"))
        return [job_from_json(raw) for raw in body.get("jobs") or []]

    async def get_job(self, job_id: int) -> SlurmJob:
        body = await self._request("GET", self._url("get_job", f"/job/{job_id}"))
        jobs = body.get("jobs") or []
        if not jobs:
            raise SlurmNotFound(f"job {job_id} is not known to slurmctld")
        return job_from_json(jobs[0])

    async def update_node(self, name: str, state: NodeUpdate, reason: str | None) -> None:
        raise Unsupported(f"slurmrestd {self.version} cannot update nodes")

    async def set_node_comment(self, name: str, comment: str) -> None:
        raise Unsupported(f"slurmrestd {self.version} cannot update nodes")

    async def signal_job(self, job_id: int, signal: str) -> None:
        # DELETE with a signal reaches the batch shell and every step, like scancel --full.
        await self._request("DELETE", self._url("signal_job", f"/job/{job_id}"), params={"signal": signal})

    async def requeue_hold(self, job_id: int) -> None:
        raise Unsupported("slurmrestd has no requeue")

    async def set_excluded_nodes(self, job_id: int, nodes: list[str]) -> None:
        raise Unsupported(f"slurmrestd {self.version}: excluded nodes go through the CLI")

    async def release_job(self, job_id: int) -> None:
        raise Unsupported(f"slurmrestd {self.version}: release goes through the CLI")
