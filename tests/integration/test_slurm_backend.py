"""The Slurm backends against a real cluster: each operation, its routing (REST where the
server's API version can, CLI otherwise), its errors, and the REST client's contract with the
OpenAPI document the running slurmrestd serves."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from backends.replacement import SPARE_STANDBY_REASON, HotSparePool
from backends.slurm import SlurmCli, SlurmClient, SlurmNotFound, SlurmRest, SlurmUnavailable, TokenFile
from backends.slurm.parse import JOB_FIELDS, NODE_FIELDS
from backends.slurm.rest import ENDPOINTS, KNOWN_VERSIONS
from contracts.models import ActionContext

pytestmark = [pytest.mark.slurm, pytest.mark.every_slurm_generation]
COMPUTE_NODE = "gpu-4"  # no drill job lands here while a test runs alone


@pytest.fixture
async def backends(slurm_cluster):
    cli = SlurmCli(slurm_conf=slurm_cluster["SLURM_CONF"], bin_dir=slurm_cluster.get("SLURM_BIN_DIR", ""))
    rest = SlurmRest(
        slurm_cluster["SLURMRESTD_URL"],
        slurm_cluster["SLURMRESTD_USER"],
        TokenFile(Path(slurm_cluster["SLURMRESTD_TOKEN_FILE"])),
    )
    await rest.discover()
    yield cli, rest, SlurmClient(cli, rest)
    await rest.aclose()


@pytest.fixture
async def openapi(slurm_cluster) -> dict:
    async with httpx.AsyncClient() as http:
        resp = await http.get(
            f"{slurm_cluster['SLURMRESTD_URL']}/openapi/v3",
            headers={
                "X-SLURM-USER-NAME": slurm_cluster["SLURMRESTD_USER"],
                "X-SLURM-USER-TOKEN": Path(slurm_cluster["SLURMRESTD_TOKEN_FILE"]).read_text().strip(),
            },
        )
        resp.raise_for_status()
        return resp.json()


async def test_rest_picks_the_newest_version_it_knows(backends, openapi):
    _, rest, _ = backends
    served = {p.split("/")[2] for p in openapi["paths"] if p.startswith("/slurm/v")}
    assert rest.version == max(served & KNOWN_VERSIONS.keys(), key=lambda v: int(v.rsplit(".", 1)[1]))


async def test_each_operation_takes_the_path_its_version_allows(backends):
    cli, rest, client = backends
    for operation in (
        "get_node",
        "list_jobs",
        "get_job",
        "update_node",
        "signal_job",
        "requeue_hold",
        "set_excluded_nodes",
        "release_job",
        "set_node_comment",
        "set_required_nodes",
        "list_nodes",
    ):
        expected = "rest" if operation in KNOWN_VERSIONS[rest.version] else "cli"
        assert client.path_for(operation) == expected, operation
    # only v0.0.45 (26.05) can requeue: there no operation needs the Slurm commands
    assert client.path_for("requeue_hold") == ("rest" if rest.version == "v0.0.45" else "cli")
    assert (SlurmClient(None, rest).without_a_path() == []) is (rest.version == "v0.0.45")


async def test_drain_and_resume_round_trip_with_reason(backends):
    cli, rest, client = backends
    reason = "recovery: test drain by pytest"
    await client.update_node(COMPUTE_NODE, "DRAIN", reason)
    try:
        node = await client.get_node(COMPUTE_NODE)
        assert node.drained and not node.in_service and node.reason == reason
    finally:
        await client.update_node(COMPUTE_NODE, "RESUME", None)
    node = await cli.get_node(COMPUTE_NODE)
    assert not node.drained


async def test_node_comment_marks_and_clears(backends):
    cli, _, client = backends
    await client.set_node_comment(COMPUTE_NODE, "recovery: spare for incident t")
    assert (await cli.get_node(COMPUTE_NODE)).comment == "recovery: spare for incident t"
    await client.set_node_comment(COMPUTE_NODE, "")
    assert (await cli.get_node(COMPUTE_NODE)).comment == ""


async def test_unknown_node_and_job_are_final_errors(backends):
    cli, rest, client = backends
    for backend in (cli, rest):
        with pytest.raises(SlurmNotFound):
            await backend.get_job(4_000_000)
    with pytest.raises(SlurmNotFound):
        await client.get_node("gpu-99")
    with pytest.raises(SlurmNotFound):
        await client.update_node("gpu-99", "DRAIN", "x")
    with pytest.raises(SlurmNotFound):
        await client.signal_job(4_000_000, "USR1")


async def test_unreachable_or_unauthorised_rest_is_unavailable(slurm_cluster):
    bad_token = SlurmRest(slurm_cluster["SLURMRESTD_URL"], "root", "not-a-token")
    with pytest.raises(SlurmUnavailable):
        await bad_token.discover()
    await bad_token.aclose()
    nobody = SlurmRest("http://127.0.0.1:9", "root", "x", timeout=2)
    with pytest.raises(SlurmUnavailable):
        await nobody.discover()
    await nobody.aclose()


# --- contract with the served OpenAPI document -------------------------------------------------


def _resolve(doc: dict, schema: dict) -> dict:
    while "$ref" in schema:
        schema = doc["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]
    return schema


def _operation(doc: dict, version: str, method: str, path: str) -> dict:
    paths = doc["paths"]
    key = next((k for k in (f"/slurm/{version}{path}", f"/slurm/{version}{path}/") if k in paths), None)
    assert key is not None, f"{method} {path} is not served for {version}"
    assert method.lower() in paths[key], f"{method} {path} is not allowed for {version}"
    return paths[key][method.lower()]


def _response_items(doc: dict, operation: dict, key: str) -> dict:
    content = operation["responses"]["200"]["content"]["application/json"]["schema"]
    listing = _resolve(doc, _resolve(doc, content)["properties"][key])
    return _resolve(doc, listing["items"])["properties"]


def _known_and_served(openapi: dict) -> list[str]:
    """Every API version this client knows that the server serves: a cluster may be answered in any
    of them (the newest is picked, but an older client of the same server keeps working)."""
    served = {p.split("/")[2] for p in openapi["paths"] if p.startswith("/slurm/v")}
    known = sorted(served & KNOWN_VERSIONS.keys())
    assert known, served
    return known


async def test_every_request_matches_the_served_openapi_document(openapi):
    for version in _known_and_served(openapi):
        for operation in KNOWN_VERSIONS[version]:
            method, path, query, body = ENDPOINTS[operation]
            op = _operation(openapi, version, method, path)
            served_query = {p["name"] for p in op.get("parameters", []) if p["in"] == "query"}
            sent_query = {q for q in query if not (q == "flags" and version == "v0.0.38")}
            assert sent_query <= served_query, (version, operation, sent_query - served_query)
            if body:
                schema = _resolve(openapi, op["requestBody"]["content"]["application/json"]["schema"])
                sent = set(body) - set(schema["properties"])
                assert not sent, (version, operation, sent)


async def test_every_field_read_is_in_the_served_response_schemas(openapi):
    for version in _known_and_served(openapi):
        jobs = _response_items(openapi, _operation(openapi, version, "GET", "/jobs"), "jobs")
        assert set(JOB_FIELDS) <= set(jobs), (version, set(JOB_FIELDS) - set(jobs))
        if "get_node" in KNOWN_VERSIONS[version]:
            nodes = _response_items(openapi, _operation(openapi, version, *ENDPOINTS["get_node"][:2]), "nodes")
            assert set(NODE_FIELDS) <= set(nodes), (version, set(NODE_FIELDS) - set(nodes))


# Whether a node keeps its drain reason after RESUME, by generation (measured).
REASON_KEPT_AFTER_RESUME = {"22.05": False, "24.11": True, "26.05": False}


async def test_a_resumed_node_is_in_service_whatever_reason_slurm_keeps(backends, local_stack):
    """24.11 keeps the drain reason after RESUME (22.05 and 26.05 clear it): state, not reason, decides."""
    from backends.replacement import SPARE_STANDBY_REASON, HotSparePool
    from contracts.models import ActionContext
    from drills.localstack import wait_async

    cli, _, client = backends
    await client.update_node(COMPUTE_NODE, "DRAIN", f"recovery: {SPARE_STANDBY_REASON}")
    await client.update_node(COMPUTE_NODE, "RESUME", None)

    async def in_service():
        node = await client.get_node(COMPUTE_NODE)
        return node if node.in_service else None

    node = await wait_async(in_service, 30, f"{COMPUTE_NODE} back in service")
    kept = REASON_KEPT_AFTER_RESUME[local_stack.slurm_generation]
    assert (node.reason == f"recovery: {SPARE_STANDBY_REASON}") is kept
    # A node in service is no spare on standby, even with the standby reason still on it.
    ctx = ActionContext(incident_id="t", owner="recovery", actor="pytest", reason="test", xid=79)
    result = await HotSparePool(client).request("gpu-1", [COMPUTE_NODE], ctx)
    assert result.node is None and result.actions == []


async def test_a_node_downed_by_the_controller_stays_down_when_its_slurmd_returns(backends, local_stack):
    """ReturnToService=1 on both generations: Slurm returns a node that was DOWN only for not
    responding, never one an administrator (here the controller) set DOWN. A fence that a
    rebooting node undid by itself would let jobs land on a broken GPU."""
    from drills.localstack import wait_async

    _, _, client = backends
    reason = "recovery: XID 79 test fence"
    await client.update_node(COMPUTE_NODE, "DOWN", reason)
    try:
        local_stack.kill_node(COMPUTE_NODE)
        await wait_async(lambda: _not_responding(client), 40, f"{COMPUTE_NODE} to stop responding")
        local_stack.start_slurm()  # the node boots again and its slurmd registers

        async def registered():
            node = await client.get_node(COMPUTE_NODE)
            return node if node.responding else None

        node = await wait_async(registered, 40, f"{COMPUTE_NODE} to register again")
        assert node.state == "down" and node.reason.startswith(reason), node
    finally:
        await client.update_node(COMPUTE_NODE, "RESUME", None)


async def test_a_node_reads_idle_as_soon_as_its_job_has_left(backends):
    """The CPUs Slurm counts on a node are current in every read: on 24.11 a single-node query
    answered with those of the last full listing, so a node whose job had just been requeued read
    MIXED (DOWN+DRAIN read MIXED+DRAIN) until someone listed every node, and the slurmd pod's
    eviction waited for minutes."""
    from drills.localstack import wait_async

    cli, _, client = backends
    job_id = await sleeper_on_the_compute_node(cli)
    try:

        async def counted_busy():  # a full listing while the job runs: it counts the job's CPU
            return any(n.name == COMPUTE_NODE and n.state in ("mixed", "allocated") for n in await cli.list_nodes())

        await wait_async(counted_busy, 40, f"job {job_id} to run on {COMPUTE_NODE}")
    finally:
        await cli.run("scancel", str(job_id))

    async def job_left():
        return not await client.jobs_on_node(COMPUTE_NODE)

    await wait_async(job_left, 40, f"job {job_id} to leave {COMPUTE_NODE}")

    async def idle():
        return (await client.get_node(COMPUTE_NODE)).state == "idle"

    await wait_async(idle, 10, f"{COMPUTE_NODE} to read idle with no job on it")


async def test_a_running_job_is_requeued_held_unpinned_and_released_on_the_paths_its_version_allows(backends):
    """The requeue's writes through the client, each on the path the server's API version allows
    (all of them over REST on 26.05): the job is requeued held (restart count one up), its pin is
    cleared and set again, and it is released. An empty list would leave the pin over REST."""
    from drills.localstack import wait_async

    cli, rest, client = backends
    job_id = await sleeper_on_the_compute_node(cli, "--requeue")
    try:

        async def running():
            return (await cli.get_job(job_id)).state == "RUNNING"

        await wait_async(running, 40, f"job {job_id} to run on {COMPUTE_NODE}")
        calls = [await client.requeue_hold(job_id)]

        async def requeued_held():
            job = await cli.get_job(job_id)
            return job if job.held and job.restart_count == 1 else None

        job = await wait_async(requeued_held, 30, f"job {job_id} to be pending, held, restarted once")
        assert job.required_nodes == [COMPUTE_NODE]
        calls.append(await client.set_required_nodes(job_id, []))
        assert (await cli.get_job(job_id)).required_nodes == []
        calls.append(await client.set_required_nodes(job_id, [COMPUTE_NODE]))
        assert (await cli.get_job(job_id)).required_nodes == [COMPUTE_NODE]
        calls.append(await client.release_job(job_id))
        assert not (await cli.get_job(job_id)).held
        operations = ("requeue_hold", "set_required_nodes", "set_required_nodes", "release_job")
        assert [c.path for c in calls] == [client.path_for(op) for op in operations]
        assert all(c.executed for c in calls)
    finally:
        await cli.run("scancel", str(job_id))


async def test_a_pending_jobs_exclusions_are_set_and_cleared_on_the_path_its_version_allows(backends):
    """The exclusion list of a pending job, set and emptied through the client: over REST an empty
    list was silently ignored (the exclusions kept); one empty name clears them, as the CLI does."""
    cli, rest, client = backends
    job_id = await sleeper_on_the_compute_node(cli, "--hold")
    try:
        calls = [await client.set_excluded_nodes(job_id, ["gpu-2", "gpu-3"])]
        assert (await cli.get_job(job_id)).excluded_nodes == ["gpu-2", "gpu-3"]
        calls.append(await client.set_excluded_nodes(job_id, []))
        assert (await cli.get_job(job_id)).excluded_nodes == []
        assert {c.path for c in calls} == {client.path_for("set_excluded_nodes")} and all(c.executed for c in calls)
    finally:
        await cli.run("scancel", str(job_id))


async def sleeper_on_the_compute_node(cli: SlurmCli, *options: str) -> int:
    """A one-task job that sleeps on COMPUTE_NODE: its id."""
    out = await cli.run(
        "sbatch",
        "--parsable",
        *options,
        f"--nodelist={COMPUTE_NODE}",
        "--ntasks=1",
        "--output=/dev/null",
        "--wrap=sleep 300",
    )
    return int(out.split(";")[0])


async def _not_responding(client) -> bool:
    return not (await client.get_node(COMPUTE_NODE)).responding


async def test_two_incidents_asking_at_once_for_the_last_spare_get_it_once(backends, slurm_cluster):
    """Two incidents of one worker ask for the last spare at the same moment (the game day's
    storm once gave it to both): one gets it, the other comes away with nothing."""
    *_, client = backends
    [spare] = slurm_cluster["SLURM_SPARE_NODES"].split(",")
    pool = HotSparePool(client)

    def incident(n: int) -> ActionContext:
        return ActionContext(incident_id=f"race-{n}", owner="recovery", actor="pytest", reason="spare race", xid=79)

    try:
        for attempt in range(3):
            await client.set_node_comment(spare, "")
            await client.update_node(spare, "DRAIN", f"recovery: {SPARE_STANDBY_REASON}")
            first, second = await asyncio.gather(
                pool.request("gpu-1", [spare], incident(2 * attempt)),
                pool.request("gpu-2", [spare], incident(2 * attempt + 1)),
            )
            winners = [r for r in (first, second) if r.node == spare]
            assert len(winners) == 1, (attempt, first, second)
            [winner] = winners
            loser = second if winner is first else first
            assert loser.node is None and "no hot spare" in loser.detail
            node = await client.get_node(spare)
            assert not node.drained
            winner_ctx, loser_ctx = (
                (incident(2 * attempt), incident(2 * attempt + 1))
                if winner is first
                else (incident(2 * attempt + 1), incident(2 * attempt))
            )
            assert node.comment == HotSparePool.claim_comment(winner_ctx)
            # Nor does a retry of the loser's request take it, or a retry of the winner's take another.
            assert (await pool.request("gpu-2", [spare], loser_ctx)).node is None
            assert (await pool.request("gpu-1", [spare], winner_ctx)).node == spare
    finally:
        await client.set_node_comment(spare, "")
        await client.update_node(spare, "DRAIN", f"recovery: {SPARE_STANDBY_REASON}")


async def test_the_hooks_know_the_nodes_over_rest_when_there_are_no_slurm_commands(slurm_cluster, backends):
    """RECOVERY_SLURM_CLI=false: the alert hooks read the cluster's nodes from slurmrestd, where its
    version can list them (v0.0.40 on); on 22.05's v0.0.38 the hooks fail closed."""
    from contracts.settings import Settings
    from hooks.inventory import InventoryUnavailable
    from hooks.server import node_inventory
    from hooks.settings import HookSettings

    _, rest, _ = backends
    settings = Settings(
        TEMPORAL_ADDRESS="unused",
        slurm_cli=False,
        SLURMRESTD_URL=slurm_cluster["SLURMRESTD_URL"],
        SLURMRESTD_USER=slurm_cluster["SLURMRESTD_USER"],
        SLURMRESTD_TOKEN_FILE=slurm_cluster["SLURMRESTD_TOKEN_FILE"],
    )
    inventory = node_inventory(settings, HookSettings(token="tok-9c2e41d7a0b3f5"))
    if rest.supports("list_nodes"):
        assert await inventory.unknown([COMPUTE_NODE, "gpu-99"]) == ["gpu-99"]
    else:
        with pytest.raises(InventoryUnavailable):
            await inventory.unknown([COMPUTE_NODE])
