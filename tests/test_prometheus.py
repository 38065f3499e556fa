"""deploy/prometheus and deploy/grafana against a real Prometheus.

``promtool`` checks both scrape configs and the rule file, and runs the rules' unit tests
(``deploy/prometheus/alerts_test.yml``: each alert fires, with its labels and text, on
synthetic series, and stays quiet beside healthy ones). Then a real ``kvstore serve``
and a real ``kvstore node`` joined to it, on free loopback ports, carry a little traffic
through ``kvclient`` (puts into pools small enough to evict, a read, a prefix that hits
and one that misses) and one request the node refuses (so the error series exist), and
a real ``prometheus`` scrapes both every second with deploy's own scrape config (only
targets and intervals swapped) and rule file. Every PromQL expression of the Grafana
dashboard and every recorded expression of the rules must return data; every alert
expression must evaluate, and every rule must report healthy; the error, node, index
and prefix series must count exactly that traffic. Skipped, saying so, where Debian's
``prometheus`` package (``prometheus``, ``promtool``) is not installed: ``.ci/run``
installs it.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

import kvclient
from kvclient.errors import ProtocolError
from kvstore.core.kvgen import realistic_kv
from kvstore.dataplane.messages import Ack, expect
from kvstore.transport import connect
from tests.cluster import Server, start_server

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
SCRAPE_CONFIG = DEPLOY / "prometheus" / "prometheus.yml"
K8S_SCRAPE_CONFIG = DEPLOY / "prometheus" / "kubernetes.yml"
RULES = DEPLOY / "prometheus" / "alerts.yml"
RULE_TESTS = DEPLOY / "prometheus" / "alerts_test.yml"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "kvstore.json"

PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
needs_prometheus = pytest.mark.skipif(
    not (PROMETHEUS and PROMTOOL),
    reason="prometheus/promtool not installed (Debian package 'prometheus'; .ci/run installs it)",
)

RATE_INTERVAL = "10s"
"""What the test puts for Grafana's ``$__rate_interval``: ten scrapes at 1 s."""
GRAFANA_VARIABLES = {"$__rate_interval": RATE_INTERVAL, "$__interval": "1s", "$__range": "1m"}
DATA_TIMEOUT_S = 30.0
"""How long Prometheus may take to scrape twice and evaluate the rules (~3 s here)."""


# -- the files --------------------------------------------------------------------------------


def dashboard_exprs() -> list[tuple[str, str]]:
    """(panel title, PromQL with Grafana's interval variables filled in) of every target."""
    found: list[tuple[str, str]] = []

    def walk(panels: list[dict[str, Any]]) -> None:
        for panel in panels:
            walk(panel.get("panels", []))
            for target in panel.get("targets", []):
                expr = target["expr"]
                for name, value in GRAFANA_VARIABLES.items():
                    expr = expr.replace(name, value)
                assert "$" not in expr, f"{panel['title']}: unknown Grafana variable in {expr}"
                found.append((panel["title"], expr))

    walk(json.loads(DASHBOARD.read_text())["panels"])
    return found


def rules() -> list[dict[str, Any]]:
    """Every rule of the rule file, in order."""
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


@needs_prometheus
def test_promtool_checks_configs_rules_and_rule_tests() -> None:
    assert PROMTOOL is not None
    for args in (
        ["check", "config", str(SCRAPE_CONFIG)],
        ["check", "config", str(K8S_SCRAPE_CONFIG)],
        ["check", "rules", str(RULES)],
        ["test", "rules", str(RULE_TESTS)],  # each alert fires on synthetic series
    ):
        out = subprocess.run(
            [PROMTOOL, *args], capture_output=True, text=True, timeout=30, check=False
        )
        assert out.returncode == 0, (args, out.stdout, out.stderr)
        assert "SUCCESS" in out.stdout, out.stdout


def test_every_alert_compares_a_recorded_series() -> None:
    """The rules' layout, which the live test relies on: each alert's expression uses
    only recorded series (``kvstore:...``) that the file records, and no raw metric."""
    recorded = {r["record"] for r in rules() if "record" in r}
    alerts = [r for r in rules() if "alert" in r]
    assert {a["alert"] for a in alerts} >= {
        "KVStoreNodeDown",
        "KVStoreMasterWithoutNodes",
        "KVStorePoolFull",
        "KVStoreEvictionStorm",
        "KVStoreStaleMissRate",
        "KVStoreTransferErrors",
    }
    for alert in alerts:
        used = set(re.findall(r"kvstore:[a-z0-9_:]+", alert["expr"]))
        assert used and used <= recorded, (alert["alert"], used - recorded)
        assert not re.search(r"\bkvstore_[a-z_]+", alert["expr"]), alert["alert"]
        assert not re.search(r"\bup\b", alert["expr"]), alert["alert"]


# -- a live pool, scraped --------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Prometheus:
    """A running ``prometheus`` on loopback."""

    proc: subprocess.Popen[bytes]
    url: str

    def get(self, path: str, **params: str) -> dict[str, Any]:
        """GET ``path`` of the HTTP API; the decoded JSON body, also for 4xx answers."""
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        try:
            with urllib.request.urlopen(f"{self.url}{path}{query}", timeout=5) as resp:
                return dict(json.load(resp))
        except urllib.error.HTTPError as exc:  # a bad query is a 400 with a JSON body
            return dict(json.load(exc))

    def query(self, expr: str) -> dict[str, Any]:
        """``/api/v1/query``: the whole answer (``status``, ``data`` or ``error``)."""
        return self.get("/api/v1/query", query=expr)


def scrape_config(tmp: Path, master: str, node: str) -> Path:
    """deploy's prometheus.yml with the compose targets replaced by the live processes, a
    1 s scrape and evaluation interval and the rule file by absolute path."""
    config = yaml.safe_load(SCRAPE_CONFIG.read_text())
    config["global"].update(scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s")
    config["rule_files"] = [str(RULES)]
    targets = {"kvstore-master": [master], "kvstore-node": [node]}
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == set(targets), jobs
    for name, job in jobs.items():
        job["static_configs"] = [{"targets": targets[name]}]
    path = tmp / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    return path


def start_prometheus(config: Path, tmp: Path) -> Prometheus:
    """``prometheus`` on a free loopback port, waited for on ``/-/ready`` (at most 20 s;
    ~0.5 s here)."""
    assert PROMETHEUS is not None
    port = free_port()
    log = tmp / "prometheus.log"  # a file, not a pipe nobody reads while it runs
    with log.open("wb") as stderr:  # Popen keeps its own copy of the descriptor
        proc = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(f"{url}/-/ready", timeout=1) as resp:
                if resp.status == 200:
                    return Prometheus(proc, url)
        except OSError:
            time.sleep(0.1)
    proc.kill()
    proc.wait(timeout=5)
    raise RuntimeError(f"prometheus did not become ready: {log.read_text(errors='replace')}")


def stop_prometheus(prom: Prometheus) -> None:
    prom.proc.terminate()
    try:
        prom.proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        prom.proc.kill()
        prom.proc.wait(timeout=5)


async def traffic(master: str, node_data: str) -> None:
    """40 one-block prompts into two 1 MiB pools that hold ~12 blocks each (so they
    evict; the node's to its disk tier), a read of the last one, reads of the first 20
    (the node's from its disk), a prefix match that hits and one that misses, and one
    request the node at ``node_data`` refuses: an unknown op on its data port, counted as
    ``kvstore_transfer_errors_total{op="other", reason="protocol"}``."""
    conn = await connect(node_data, timeout=5)
    try:
        await conn.send({"op": "no-such-op"}, timeout=5)
        with pytest.raises(ProtocolError):  # the node answers an error, not an Ack
            expect((await conn.recv_header(5)).header, Ack)
    finally:
        await conn.close()
    ns = kvclient.Namespace(
        model="prometheus-test",
        revision="r1",
        num_layers=1,
        num_kv_heads=2,
        head_dim=64,
        dtype=torch.float16,
    )
    # 60 s, not 10: a process's first put may compile the codec (kvstore.core.fused),
    # which takes over 10 s on a busy 2-core machine.
    async with await kvclient.KVClient.connect(master, ns, timeout_s=60) as kv:
        prompts = [list(range(i * 1000, i * 1000 + 256)) for i in range(40)]
        for i, tokens in enumerate(prompts):
            assert await kv.put_layer(tokens, 0, realistic_kv(256, 2, 64, torch.float16, seed=i))
        assert await kv.match_prefix(prompts[-1]) == 256
        assert await kv.match_prefix(list(range(999_000, 999_256))) == 0
        assert (await kv.get_layer(prompts[-1], 0)).shape[1] == 256
        await asyncio.sleep(1.0)  # (the node's disk tier writes behind the puts)
        for tokens in prompts[:20]:  # the node's share of these is on its disk only now
            await kv.get_layer(tokens, 0)


@dataclass
class Pool:
    serve: Server
    node: Server
    prometheus: Prometheus


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    """serve, then Prometheus (already scraping while the node starts: its metrics port is
    chosen here), then the node, then the traffic."""
    tmp = tmp_path_factory.mktemp("prometheus")
    serve = start_server("serve", "--grpc-port", "0", "--data-port", "0", "--metrics-port", "0",
                         "--host-mem", "1MiB")  # fmt: skip
    node = prom = None
    try:
        node_metrics = f"127.0.0.1:{free_port()}"
        prom = start_prometheus(scrape_config(tmp, serve.addresses["metrics"], node_metrics), tmp)
        node = start_server("node", "--master", serve.grpc, "--data-port", "0", "--metrics-port",
                            node_metrics.rsplit(":", 1)[1], "--host-mem", "1MiB",
                            "--disk-path", str(tmp / "disk"), "--disk-size", "64MiB")  # fmt: skip
        asyncio.run(traffic(serve.grpc, node.data))
        yield Pool(serve, node, prom)
    finally:
        if prom is not None:
            stop_prometheus(prom)
        results = [s.stop() for s in (node, serve) if s is not None]
    for rc, out in results:
        assert rc == 0 and "pinned_slots=0" in out, out


def wait_for_data(prom: Prometheus, exprs: list[str]) -> dict[str, dict[str, Any]]:
    """Each expression's first answer with data (else its last), each polled until it
    returned data or DATA_TIMEOUT_S passed. An expression is not asked again once it
    answered with data: a scrape that times out on a loaded machine marks its target's
    series stale until the next one, so asking for every expression at one instant could
    keep finding one of them empty."""
    answers: dict[str, dict[str, Any]] = {}
    deadline = time.monotonic() + DATA_TIMEOUT_S
    while True:
        for e in exprs:
            if not answers.get(e, {}).get("data", {}).get("result"):
                answers[e] = prom.query(e)
        if all(answers[e].get("data", {}).get("result") for e in exprs):
            return answers
        if time.monotonic() > deadline:
            return answers
        time.sleep(0.5)


@needs_prometheus
def test_both_processes_are_scraped(pool: Pool) -> None:
    answer = wait_for_data(pool.prometheus, ['up{job="kvstore-master"} == 1',
                                             'up{job="kvstore-node"} == 1'])  # fmt: skip
    for expr, a in answer.items():
        assert a["status"] == "success" and len(a["data"]["result"]) == 1, (expr, a)


@needs_prometheus
def test_every_dashboard_expression_returns_data(pool: Pool) -> None:
    exprs = dashboard_exprs()
    assert len(exprs) >= 15
    answers = wait_for_data(pool.prometheus, [e for _, e in exprs])
    empty = []
    for title, expr in exprs:
        answer = answers[expr]
        assert answer["status"] == "success", (title, expr, answer.get("error"))
        if not answer["data"]["result"]:
            empty.append(f"{title}: {expr}")
    assert not empty, "no data for:\n" + "\n".join(empty)


@needs_prometheus
def test_every_rule_evaluates_and_every_recorded_series_has_data(pool: Pool) -> None:
    all_rules = rules()
    recorded = [r for r in all_rules if "record" in r]
    # The recorded expressions themselves, and the series Prometheus recorded from them.
    exprs = [r["expr"] for r in recorded] + [r["record"] for r in recorded]
    answers = wait_for_data(pool.prometheus, exprs)
    empty = [e for e in exprs if not answers[e].get("data", {}).get("result")]
    assert not empty, "no data for:\n" + "\n".join(empty)
    # Alert expressions are comparisons, empty while the pool is healthy: they must
    # evaluate, and each recorded series they compare returned data above.
    for rule in all_rules:
        if "alert" in rule:
            answer = pool.prometheus.query(rule["expr"])
            assert answer["status"] == "success", (rule["alert"], answer.get("error"))
    # Prometheus evaluated every rule of every group without an error.
    deadline = time.monotonic() + DATA_TIMEOUT_S
    while True:
        groups = pool.prometheus.get("/api/v1/rules")["data"]["groups"]
        states = {(r.get("name")): (r["health"], r.get("lastError", "")) for g in groups
                  for r in g["rules"]}  # fmt: skip
        if all(h == "ok" for h, _ in states.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    names = {r.get("record") or r.get("alert") for r in all_rules}
    assert set(states) == names, set(states) ^ names
    assert all(h == "ok" for h, _ in states.values()), states


@needs_prometheus
def test_master_and_error_series_count_the_traffic(pool: Pool) -> None:
    """The series behind the hit ratio, nodes, index and transfer error panels and alerts
    say what the traffic did: the node's refused request by op, transport and reason, both
    nodes alive at the master and none dead, blocks in its index, the prefix that hit and
    the one that missed; the recorded error ratio has a series for each node and the
    recorded live node count is 2."""
    node, serve = pool.node.addresses["metrics"], pool.serve.addresses["metrics"]
    expected: dict[str, dict[tuple[tuple[str, str], ...], float | None]] = {
        'kvstore_transfer_errors_total{job="kvstore-node"}': {
            (("instance", node), ("op", "other"), ("reason", "protocol"), ("transport", "tcp")): 1
        },
        'sum by (state) (kvstore_nodes{state=~"alive|dead"})': {
            (("state", "alive"),): 2,
            (("state", "dead"),): 0,
        },
        "kvstore:nodes_alive": {(("instance", serve),): 2},
        'sum(kvstore_blocks{role="master"}) > 0': {(): None},  # any number
        # The match of the last prompt found its 256 tokens, the other found none of its 256.
        "sum(kvstore_prefix_hit_tokens_total)": {(): 256},
        "sum(kvstore_prefix_miss_tokens_total)": {(): 256},
        "kvstore:transfer_errors_per_exchange:rate5m >= 0": {
            (("instance", node),): None,
            (("instance", serve),): None,
        },
    }

    def labelled(answer: dict[str, Any]) -> dict[tuple[tuple[str, str], ...], float]:
        return {
            tuple(sorted((k, v) for k, v in r["metric"].items() if k not in ("__name__", "job"))):
            float(r["value"][1])
            for r in answer["data"]["result"]
        }  # fmt: skip

    deadline = time.monotonic() + DATA_TIMEOUT_S
    while True:
        got = {}
        for expr in expected:
            answer = pool.prometheus.query(expr)
            assert answer["status"] == "success", (expr, answer.get("error"))
            got[expr] = labelled(answer)
        wrong = {
            expr: got[expr]
            for expr, want in expected.items()
            if set(got[expr]) != set(want)
            or any(v is not None and got[expr][k] != v for k, v in want.items())
        }
        if not wrong or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert not wrong, wrong


@needs_prometheus
def test_deploy_files_name_only_metrics_the_processes_export(pool: Pool) -> None:
    """Every ``kvstore_*`` name in the dashboard and the rules is a family that the live
    processes' /metrics expose (a _total, _bucket, _count or _sum sample of it)."""
    exported = set()
    for server in (pool.serve, pool.node):
        url = f"http://{server.addresses['metrics']}/metrics"
        with urllib.request.urlopen(url, timeout=5) as resp:
            text = resp.read().decode()
        exported |= set(re.findall(r"^(kvstore_[a-z_]+)[{ ]", text, re.MULTILINE))
    exprs = [e for _, e in dashboard_exprs()] + [r["expr"] for r in rules()]
    named = set(re.findall(r"\bkvstore_[a-z_]+", " ".join(exprs)))
    assert named, "no kvstore metric named"
    assert named <= exported, named - exported
