"""The shipped monitoring configuration, checked by the real tools and run end to end: Debian's
prometheus scrapes a stand-in dcgm-exporter, evaluates the shipped rule, and Debian's
prometheus-alertmanager delivers to the hook with the shipped receiver configuration (its grouping
and intervals as shipped; only the hook's URL and token file are this test's). An XID 79 on one
node ends in exactly one incident for that node.
"""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import pytest_asyncio
import yaml
from temporalio.api.enums.v1 import EventType

from contracts.models import NodeFailureAlert
from contracts.settings import Settings
from drills.localstack import wait_async
from hooks.server import build_app, listening
from hooks.settings import HookSettings
from tests.hook_support import gpu_uuid
from workflows.node_recovery import incident_workflow_id

MONITORING = Path(__file__).resolve().parents[2] / "deploy" / "monitoring"
RULES = MONITORING / "prometheus" / "gpu-xid.rules.yml"
RULE_TESTS = MONITORING / "prometheus" / "gpu-xid.rules.test.yml"
ALERTMANAGER = MONITORING / "alertmanager" / "alertmanager.yml"


def tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is missing: install Debian's prometheus and prometheus-alertmanager (./dev.sh does)")
    return path


def check(*argv: str) -> str:
    done = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=60)
    assert done.returncode == 0, done.stdout
    return done.stdout


def test_the_shipped_rule_passes_promtool_check():
    assert "SUCCESS: 1 rules found" in check(tool("promtool"), "check", "rules", str(RULES))


def test_the_shipped_rule_fires_as_its_unit_tests_say():
    check(tool("promtool"), "test", "rules", str(RULE_TESTS))


def test_the_shipped_alertmanager_configuration_passes_amtool():
    check(tool("amtool"), "check-config", str(ALERTMANAGER))


# --- end to end ------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FakeDcgmExporter:
    """One node's dcgm-exporter: DCGM_FI_DEV_XID_ERRORS per GPU, in its exposition format."""

    def __init__(self, hostname: str, gpus: int = 4) -> None:
        self.hostname = hostname
        self.xid = {gpu: 0 for gpu in range(gpus)}
        exporter = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                body = exporter.exposition().encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.address = f"127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def exposition(self) -> str:
        lines = [
            "# HELP DCGM_FI_DEV_XID_ERRORS Value of the last XID error encountered.",
            "# TYPE DCGM_FI_DEV_XID_ERRORS gauge",
        ]
        for gpu, xid in self.xid.items():
            labels = (
                f'gpu="{gpu}",UUID="{gpu_uuid(self.hostname, gpu)}",device="nvidia{gpu}",'
                f'modelName="NVIDIA H100 80GB HBM3",Hostname="{self.hostname}",'
                'DCGM_FI_DRIVER_VERSION="550.54.15"'
            )
            lines.append(f"DCGM_FI_DEV_XID_ERRORS{{{labels}}} {xid}")
        return "\n".join(lines) + "\n"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@contextmanager
def process(argv: list[str], log: Path) -> Iterator[subprocess.Popen]:
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest_asyncio.fixture
async def exporters():
    nodes = [f"mon{uuid.uuid4().hex[:6]}-{i}" for i in (1, 2)]
    started = [FakeDcgmExporter(node) for node in nodes]
    yield started
    for exporter in started:
        exporter.close()


async def test_xid_79_through_prometheus_and_alertmanager_makes_one_incident(temporal_env, exporters, tmp_path):
    prometheus, alertmanager = tool("prometheus"), tool("prometheus-alertmanager")
    failing, healthy = exporters
    token = uuid.uuid4().hex
    (tmp_path / "hook-token").write_text(token + "\n")
    task_queue = f"hooks-monitoring-{uuid.uuid4()}"
    app = build_app(
        Settings(TEMPORAL_ADDRESS="unused", task_queue=task_queue),
        HookSettings(token=token, port=0),
        temporal_env.client,
    )

    async with listening(app.asgi(), app.settings) as hook_url:
        am_port, prom_port = free_port(), free_port()
        am_config = yaml.safe_load(ALERTMANAGER.read_text())
        [webhook] = next(r for r in am_config["receivers"] if r["name"] == "training-recovery")["webhook_configs"]
        webhook["url"] = f"{hook_url}/v1/alerts/alertmanager"
        webhook["http_config"]["authorization"]["credentials_file"] = str(tmp_path / "hook-token")
        (tmp_path / "alertmanager.yml").write_text(yaml.safe_dump(am_config))
        (tmp_path / "prometheus.yml").write_text(
            yaml.safe_dump(
                {
                    # short scrape and evaluation intervals keep the test short; grouping is Alertmanager's, as shipped
                    "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                    "rule_files": [str(RULES)],
                    "alerting": {"alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{am_port}"]}]}]},
                    "scrape_configs": [
                        {"job_name": "dcgm-exporter", "static_configs": [{"targets": [e.address for e in exporters]}]}
                    ],
                }
            )
        )
        with (
            process(
                [
                    alertmanager,
                    f"--config.file={tmp_path / 'alertmanager.yml'}",
                    f"--storage.path={tmp_path / 'am-data'}",
                    f"--web.listen-address=127.0.0.1:{am_port}",
                    "--cluster.listen-address=",
                ],
                tmp_path / "alertmanager.log",
            ) as am,
            process(
                [
                    prometheus,
                    f"--config.file={tmp_path / 'prometheus.yml'}",
                    f"--storage.tsdb.path={tmp_path / 'prom-data'}",
                    f"--web.listen-address=127.0.0.1:{prom_port}",
                ],
                tmp_path / "prometheus.log",
            ) as prom,
        ):
            logs = lambda: "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in tmp_path.glob("*.log"))  # noqa: E731
            failed_at = datetime.now(timezone.utc)
            failing.xid[1] = 79  # GPU 1 falls off the bus; GPU 2 reports it too
            failing.xid[2] = 79

            async def incident_opened():
                assert am.poll() is None and prom.poll() is None, logs()
                return app.intake.outcomes["accepted"] >= 2

            await wait_async(incident_opened, 90, "the alerts to reach the hook through Prometheus and Alertmanager")
            await asyncio.sleep(3)  # further evaluations and notifications change nothing

            client = temporal_env.client
            runs = [wf async for wf in client.list_workflows(f"WorkflowId='{incident_workflow_id(failing.hostname)}'")]
            assert len(runs) == 1, logs()
            assert [
                wf async for wf in client.list_workflows(f"WorkflowId='{incident_workflow_id(healthy.hostname)}'")
            ] == []

    alerts = []
    async for event in client.get_workflow_handle(incident_workflow_id(failing.hostname)).fetch_history_events():
        if event.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED:
            payloads = event.workflow_execution_signaled_event_attributes.input.payloads
            alerts += (await client.data_converter.decode(payloads, [list[NodeFailureAlert]]))[0]
    assert sorted(a.reason for a in alerts) == [f"XID 79 on GPU {g} of {failing.hostname}" for g in (1, 2)]
    assert {(a.node, a.xid, a.source) for a in alerts} == {(failing.hostname, 79, "alertmanager")}
    assert all(a.observed_at >= failed_at - timedelta(seconds=2) for a in alerts)  # startsAt: the evaluation
    assert app.intake.outcomes["dropped"] == 0
