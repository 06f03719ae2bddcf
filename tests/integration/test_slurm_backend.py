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
    ):
        expected = "rest" if operation in KNOWN_VERSIONS[rest.version] else "cli"
        assert client.path_for(operation) == expected, operation
    assert client.path_for("requeue_hold") == "cli"  # no slurmrestd version can requeue


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


async def test_every_request_matches_the_served_openapi_document(backends, openapi):
    _, rest, _ = backends
    for operation in KNOWN_VERSIONS[rest.version]:
        method, path, query, body = ENDPOINTS[operation]
        op = _operation(openapi, rest.version, method, path)
        served_query = {p["name"] for p in op.get("parameters", []) if p["in"] == "query"}
        sent_query = {q for q in query if not (q == "flags" and rest.version == "v0.0.38")}
        assert sent_query <= served_query, (operation, sent_query - served_query)
        if body:
            schema = _resolve(openapi, op["requestBody"]["content"]["application/json"]["schema"])
            assert set(body) <= set(schema["properties"]), (operation, set(body) - set(schema["properties"]))


async def test_every_field_read_is_in_the_served_response_schemas(backends, openapi):
    _, rest, _ = backends
    jobs = _response_items(openapi, _operation(openapi, rest.version, "GET", "/jobs"), "jobs")
    assert set(JOB_FIELDS) <= set(jobs), set(JOB_FIELDS) - set(jobs)
    if rest.supports("get_node"):
        nodes = _response_items(openapi, _operation(openapi, rest.version, *ENDPOINTS["get_node"][:2]), "nodes")
        assert set(NODE_FIELDS) <= set(nodes), set(NODE_FIELDS) - set(nodes)


async def test_a_resumed_node_is_in_service_whatever_reason_slurm_keeps(backends, local_stack):
    """24.11 keeps the drain reason after RESUME (22.05 clears it): state, not reason, decides."""
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
    kept = local_stack.slurm_generation != "22.05"
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


async def test_a_node_reads_idle_as_soon_as_its_job_has_left(backends, local_stack, slurm_cluster):
    """The CPUs Slurm counts on a node are current in every read: on 24.11 a single-node query
    answered with those of the last full listing, so a node whose job had just been requeued read
    MIXED (DOWN+DRAIN read MIXED+DRAIN) until someone listed every node, and the slurmd pod's
    eviction waited for minutes."""
    from drills.localstack import wait_async

    cli, _, client = backends
    env = local_stack.slurm_cli_env(slurm_cluster)
    submitted = await asyncio.create_subprocess_exec(
        "sbatch",
        "--parsable",
        f"--nodelist={COMPUTE_NODE}",
        "--ntasks=1",
        "--output=/dev/null",
        "--wrap=sleep 300",
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await submitted.communicate()
    assert submitted.returncode == 0, err.decode()
    job_id = int(out.decode().split(";")[0])
    try:

        async def counted_busy():  # a full listing while the job runs: it counts the job's CPU
            return any(n.name == COMPUTE_NODE and n.state in ("mixed", "allocated") for n in await cli.list_nodes())

        await wait_async(counted_busy, 40, f"job {job_id} to run on {COMPUTE_NODE}")
    finally:
        cancel = await asyncio.create_subprocess_exec("scancel", str(job_id), env=env)
        await cancel.wait()

    async def job_left():
        return not await client.jobs_on_node(COMPUTE_NODE)

    await wait_async(job_left, 40, f"job {job_id} to leave {COMPUTE_NODE}")

    async def idle():
        return (await client.get_node(COMPUTE_NODE)).state == "idle"

    await wait_async(idle, 10, f"{COMPUTE_NODE} to read idle with no job on it")


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
