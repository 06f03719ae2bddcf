"""The Temporal worker: runs NodeRecoveryWorkflow and its activities.

Configured from the environment (see contracts/settings.py and the README); stops cleanly on
SIGTERM or SIGINT, finishing the activities in flight.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from datetime import timedelta
from pathlib import Path
from typing import get_args

from temporalio.api.operatorservice.v1 import AddSearchAttributesRequest, ListSearchAttributesRequest
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.service import RPCError, TLSConfig
from temporalio.worker import Worker
from temporalio.worker.workflow_sandbox import SandboxedWorkflowRunner, SandboxRestrictions

from activities.audit import write_audit, write_audit_lines
from activities.budget import BudgetActivities, ensure_fleet_budget
from activities.fencing import FencingActivities
from activities.job_recovery import JobRecoveryActivities
from activities.jobs import JobActivities
from activities.kubernetes import KubernetesActivities
from activities.notify import NotifyActivities
from activities.operators import OperatorActivities, OperatorKeys
from activities.platform import PlatformActivities
from activities.policy import PolicyActivities
from activities.telemetry import TelemetryActivities
from activities.xid_policy import ClassifyActivities, XidPolicyTable
from backends.checkpoints import CheckpointStore
from backends.health import HealthCheck
from backends.kubernetes import load_api_client
from backends.replacement import BareSlurm
from backends.slurm import SlurmCli, SlurmClient, SlurmRest, SlurmUnavailable, TokenFile, Unsupported
from backends.slurm.api import SlurmOperation
from contracts import search_attributes
from contracts.audit import configure_sink, remove_sink
from contracts.k8s_settings import KubernetesSettings
from contracts.settings import ConfigError, Settings, load_settings, load_telemetry_settings, loaded
from observability.metrics import DEFAULT as DEFAULT_METRICS, RecoveryMetrics
from observability.telemetry import Telemetry
from workflows.fleet_budget import FleetBudgetWorkflow, fleet_budget_workflow_id
from workflows.job_recovery import JobRecoveryWorkflow
from workflows.node_recovery import NodeRecoveryWorkflow
from workflows.notify import NotificationWorkflow
from workflows.return_to_service import ReturnToServiceWorkflow
from workflows.spare_claim import SpareClaimWorkflow

log = logging.getLogger("training_recovery.worker")

EXIT_BAD_CONFIG = 2


def temporal_tls(settings: Settings) -> TLSConfig | bool | None:
    """The SDK's `tls` argument: a TLSConfig when a CA, client certificate or server name is set;
    otherwise RECOVERY_TEMPORAL_TLS as given (None: the SDK turns TLS on with an API key)."""
    if not (settings.temporal_tls_ca or settings.temporal_tls_cert or settings.temporal_tls_server_name):
        return settings.temporal_tls

    def read(path: Path | None) -> bytes | None:
        return path.read_bytes() if path else None

    return TLSConfig(
        server_root_ca_cert=read(settings.temporal_tls_ca),
        domain=settings.temporal_tls_server_name,
        client_cert=read(settings.temporal_tls_cert),
        client_private_key=read(settings.temporal_tls_key),
    )


async def connect(settings: Settings, attempts: int = 50, **options) -> Client:
    """Connect to Temporal as the settings say (address, namespace, TLS, API key), retrying the
    first dial (the SDK does not) while a server starts. `options` go to Client.connect and win."""
    api_key = settings.temporal_api_key.get_secret_value() if settings.temporal_api_key else None
    options = {"tls": temporal_tls(settings), "api_key": api_key, **options}
    for attempt in range(1, attempts + 1):
        try:
            return await Client.connect(
                settings.temporal_address,
                namespace=settings.temporal_namespace,
                data_converter=pydantic_data_converter,
                **options,
            )
        except RuntimeError as e:
            if attempt == attempts:
                # The SDK says what failed (e.g. InvalidCertificate(UnknownIssuer)), not with what.
                raise RuntimeError(
                    f"cannot connect to Temporal at {settings.temporal_address} ({_security(settings, options)}): {e}"
                ) from e
            await asyncio.sleep(0.2)
    raise AssertionError("unreachable")


def _security(settings: Settings, options: dict) -> str:
    tls, api_key = options["tls"], options["api_key"]
    if tls is False or (tls is None and not api_key):
        said = ["without TLS"]
    elif isinstance(tls, TLSConfig):
        said = [f"TLS, CA {settings.temporal_tls_ca or '(system roots)'}"]
        if tls.client_cert:
            said.append(f"client certificate {settings.temporal_tls_cert}")
        if tls.domain:
            said.append(f"server name {tls.domain}")
    else:
        said = ["TLS, CA (system roots)"]
    return ", ".join(said + (["API key"] if api_key else []))


async def register_search_attributes(client: Client, namespace: str) -> None:
    """Create the incident search attributes the workflow sets (idempotent: existing ones stay)."""
    listed = await client.operator_service.list_search_attributes(ListSearchAttributesRequest(namespace=namespace))
    missing = {
        key.name: key.indexed_value_type for key in search_attributes.ALL if key.name not in listed.custom_attributes
    }
    if missing:
        await client.operator_service.add_search_attributes(
            AddSearchAttributesRequest(
                namespace=namespace, search_attributes={name: int(kind) for name, kind in missing.items()}
            )
        )
        log.info("registered search attributes %s", ", ".join(sorted(missing)))


def slurmrestd_token(settings: Settings) -> str | TokenFile | None:
    """The JWT as configured: a file, read again whenever a renewer replaces it, or the value."""
    if settings.slurmrestd_token_file is not None:
        return TokenFile(settings.slurmrestd_token_file)
    return settings.slurmrestd_token.get_secret_value() if settings.slurmrestd_token else None


# With no Slurm CLI the worker needs slurmrestd, which may start after it (a pod beside it): asked
# this many times, SLURMRESTD_RETRY_SECONDS apart, before the worker stops.
SLURMRESTD_START_ATTEMPTS = 30
SLURMRESTD_RETRY_SECONDS = 2.0


async def _discover(rest: SlurmRest, required: bool) -> str:
    for attempt in range(1, SLURMRESTD_START_ATTEMPTS + 1):
        try:
            return await rest.discover()
        except SlurmUnavailable as e:
            if not required or attempt == SLURMRESTD_START_ATTEMPTS:
                raise
            log.warning("slurmrestd does not answer yet (%s): asking again in %.0f s", e, SLURMRESTD_RETRY_SECONDS)
            await asyncio.sleep(SLURMRESTD_RETRY_SECONDS)
    raise AssertionError("unreachable")


async def build_slurm(settings: Settings, stack: AsyncExitStack) -> SlurmClient:
    """slurmrestd where its version can, the CLI for the rest; with RECOVERY_SLURM_CLI=false slurmrestd
    alone, which must then be able to do everything (ConfigError if it cannot) and answer within
    about a minute (RuntimeError if it does not: restart and try again)."""
    cli = SlurmCli(slurm_conf=settings.slurm_conf, bin_dir=settings.slurm_bin_dir) if settings.slurm_cli else None
    token = slurmrestd_token(settings)
    if not (settings.slurmrestd_url and token):
        return SlurmClient(cli)
    rest = SlurmRest(settings.slurmrestd_url, settings.slurmrestd_user, token)
    stack.push_async_callback(rest.aclose)
    try:
        version = await _discover(rest, required=cli is None)
    except SlurmUnavailable as e:
        if cli is None:
            # Unreachable is not a bad configuration: a crash, for the supervisor to restart.
            raise RuntimeError(
                f"RECOVERY_SLURM_CLI=false, and slurmrestd at {settings.slurmrestd_url} did not answer "
                f"within {SLURMRESTD_START_ATTEMPTS} tries: {e}"
            ) from e
        log.warning(
            "slurmrestd at %s not usable (%s): every Slurm call goes through the CLI", settings.slurmrestd_url, e
        )
        return SlurmClient(cli)
    except Unsupported as e:
        if cli is None:
            raise ConfigError(f"RECOVERY_SLURM_CLI=false, and slurmrestd at {settings.slurmrestd_url}: {e}") from e
        log.warning(
            "slurmrestd at %s not usable (%s): every Slurm call goes through the CLI", settings.slurmrestd_url, e
        )
        return SlurmClient(cli)
    client = SlurmClient(cli, rest)
    if missing := client.without_a_path():
        raise ConfigError(
            f"RECOVERY_SLURM_CLI=false, and slurmrestd {version} cannot {', '.join(missing)}: "
            "it needs v0.0.45 (Slurm 26.05 or later), or the Slurm commands"
        )
    cli_ops = [op for op in get_args(SlurmOperation) if client.path_for(op) == "cli"]
    log.info(
        "slurmrestd %s at %s; %s",
        version,
        settings.slurmrestd_url,
        f"through the CLI: {', '.join(cli_ops)}" if cli_ops else "no Slurm command is run",
    )
    return client


def activities_for(
    settings: Settings,
    slurm: SlurmClient,
    temporal: Client,
    metrics: RecoveryMetrics = DEFAULT_METRICS,
    kubernetes: KubernetesSettings | None = None,
    resources: AsyncExitStack | None = None,
) -> list:
    """Every activity this worker runs. The platform seam is bound here: Slurm on Kubernetes when
    `kubernetes` configures it (`resources` then closes its API client when the worker stops),
    bare Slurm otherwise."""
    checkpoints = CheckpointStore(default_format=settings.checkpoint_format)
    classify = ClassifyActivities(XidPolicyTable(settings.xid_policy_file), temporal)
    health = HealthCheck(settings.health_check_argv())
    fencing = FencingActivities(slurm, health)
    jobs = JobActivities(slurm, checkpoints)
    k8s = None
    if kubernetes is not None:
        assert resources is not None, "resources close the Kubernetes API client"
        k8s = kubernetes_activities(kubernetes, slurm, health, resources)
    platform = PlatformActivities(k8s.platform if k8s is not None else BareSlurm(slurm, health), health)
    telemetry = TelemetryActivities(metrics)
    budget = BudgetActivities(
        temporal,
        settings.budget_policy(),
        settings.task_queue,
        workflow_id=fleet_budget_workflow_id(settings.task_queue),
    )
    return [
        classify.classify_fault,
        classify.count_application_incidents,
        fencing.partition_shares,
        fencing.fence_scope,
        fencing.drain_node,
        fencing.mark_node_down,
        fencing.return_to_service,
        jobs.find_jobs,
        jobs.signal_job,
        jobs.wait_for_checkpoint,
        jobs.requeue_job,
        jobs.readmit_node,
        jobs.verify_restart,
        *JobRecoveryActivities(temporal, settings.task_queue).all(),
        *platform.all(),
        telemetry.record_incident,
        telemetry.record_budget_in_use,
        budget.request_lease,
        budget.check_quarantine,
        budget.quarantined_among,
        budget.find_closed_holders,
        NotifyActivities(settings.webhook_target()).deliver_notification,
        OperatorActivities(OperatorKeys(settings.operator_keys_file)).verify_decision,
        PolicyActivities(settings.policy(), settings.accept_starter_policy).incident_policy,
        write_audit,
        write_audit_lines,
        *(k8s.all() if k8s is not None else []),
    ]


def kubernetes_activities(
    settings: KubernetesSettings, slurm: SlurmClient, health: HealthCheck, resources: AsyncExitStack
) -> KubernetesActivities:
    loaded = load_api_client(settings)  # one ApiClient for this worker, never the global default
    resources.callback(loaded.api.close)  # its connection and thread pools, once the worker has stopped
    log.info("Kubernetes API from %s; replacement provider %s", loaded.source, settings.replacement)
    return KubernetesActivities(loaded.api, settings, slurm, health=health)


# Workflow runs the worker keeps in memory (the SDK's default is 1,000). A run pushed out of the
# cache replays its whole history at its next task: with 1,000 incidents at once, the fleet budget
# (one workflow answering them all) was pushed out and replayed up to 10,000 events for each
# answer, and after 1,060 s only 42 of the 1,000 had signalled their jobs; with 5,000 all had in
# 370 s, worker peak RSS 630 MiB (`python -m bench scale`, one run each).
WORKFLOW_CACHE_SIZE = 5000


@asynccontextmanager
async def serving(client: Client, settings: Settings, activities: list, **options) -> AsyncIterator[Worker]:
    """The worker polling its task queue, and the fleet budget running with this worker's policy
    (a larger K admits waiting incidents at once; a budget already running answers the first
    incident's lease request in its reply, not by signal)."""
    async with build_worker(
        client, settings.task_queue, activities, max_concurrent_workflow_tasks=settings.workflow_task_slots, **options
    ) as worker:
        if settings.fleet_budget:
            await ensure_fleet_budget(
                client,
                settings.budget_policy(),
                settings.task_queue,
                workflow_id=fleet_budget_workflow_id(settings.task_queue),
            )
        yield worker


# Temporal's sandbox imports a workflow's modules anew for every run, so that runs share no
# module state. This project's workflow modules hold constants only, and the fresh import took
# 45-80 ms between a new incident's first workflow task reaching the worker and its first step
# (8-22 ms passed through, on a 2-core machine), for every run of every workflow: incidents,
# returns to service, notifications. So they are imported once and passed through. The sandbox
# then no longer checks the calls made in them (datetime.now(), random, I/O): the replay tests
# (tests/replay) run every recorded history in the full sandbox, which does.
WORKFLOW_RUNNER = SandboxedWorkflowRunner(
    restrictions=SandboxRestrictions.default.with_passthrough_modules("workflows", "contracts", "activities")
)


def build_worker(client: Client, task_queue: str, activities: list, **options) -> Worker:
    options = {
        "max_cached_workflows": WORKFLOW_CACHE_SIZE,
        "max_concurrent_workflow_tasks": Settings.model_fields["workflow_task_slots"].default,
        **options,
    }
    return Worker(
        client,
        task_queue=task_queue,
        workflow_runner=WORKFLOW_RUNNER,
        workflows=[
            NodeRecoveryWorkflow,
            ReturnToServiceWorkflow,
            FleetBudgetWorkflow,
            NotificationWorkflow,
            SpareClaimWorkflow,
            JobRecoveryWorkflow,
        ],
        activities=activities,
        # After a crash the next workflow task would wait this long on the dead worker's sticky queue.
        sticky_queue_schedule_to_start_timeout=timedelta(seconds=2),
        graceful_shutdown_timeout=timedelta(seconds=10),
        **options,
    )


# httpx logs every request's full URL at INFO, and a webhook's URL may be its secret
# (contracts/redaction.py); httpcore's DEBUG lines hold hosts and headers.
QUIET_LOGGERS = ("httpx", "httpcore")


def configure_logging() -> None:
    logging.basicConfig(
        level=os.environ.get("RECOVERY_LOG_LEVEL", "INFO"), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)


async def main() -> None:
    configure_logging()
    try:
        settings = load_settings()
        kubernetes = loaded(KubernetesSettings) if settings.k8s_enabled else None
        telemetry = Telemetry.start(load_telemetry_settings(), settings.prometheus_address)
    except ConfigError as e:
        # One line and exit 2, like `recovery`: a bad environment is not a crash to restart from.
        print(f"worker: {e}", file=sys.stderr)
        sys.exit(EXIT_BAD_CONFIG)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with AsyncExitStack() as stack:
        stack.callback(telemetry.shutdown)
        client = await connect(settings, runtime=telemetry.runtime)
        if settings.search_attributes:
            try:
                await register_search_attributes(client, settings.temporal_namespace)
            except RPCError as e:
                # An incident whose attributes are not defined cannot make progress: say so now.
                sys.exit(
                    f"cannot register the incident search attributes ({e}): create them as the README "
                    "shows, or set RECOVERY_SEARCH_ATTRIBUTES=false"
                )
        if settings.audit_log is not None:
            stack.callback(remove_sink, configure_sink(settings.audit_log))
        try:
            slurm = await build_slurm(settings, stack)
        except ConfigError as e:
            print(f"worker: {e}", file=sys.stderr)
            sys.exit(EXIT_BAD_CONFIG)
        async with serving(
            client,
            settings,
            activities_for(settings, slurm, client, kubernetes=kubernetes, resources=stack),
            **telemetry.worker_options(),
        ):
            log.info(
                "worker polling %s on %s/%s",
                settings.task_queue,
                settings.temporal_address,
                settings.temporal_namespace,
            )
            await stop.wait()
            log.info("stopping: finishing activities in flight")
    log.info("stopped")


if __name__ == "__main__":
    asyncio.run(main())
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: the SDK's Rust threads can crash it (sdk-python#300).
    os._exit(0)
