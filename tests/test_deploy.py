"""deploy/ checked offline, without Docker or a cluster.

Every YAML file parses and passes yamllint (deploy/.yamllint.yaml); the Kubernetes
manifests validate, strictly (no unknown fields), against the Kubernetes JSON schemas that
``kubernetes-validate`` bundles; every ``kvstore`` and ``kvctl`` command line in
compose.yaml and the manifests parses with our own CLI parsers, its settings resolved
against the environment that container gets (ConfigMap, ``env``, ``$(VAR)`` expansion);
every ``KVSTORE_*`` variable set is one that ``kvstore`` reads; the Dockerfile installs
torch before the project; and the files agree with each other (Prometheus targets and
compose services, Grafana mounts and provisioning, Services and pods). ``docker compose
config`` runs where a working ``docker compose`` exists.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from yamllint import linter
from yamllint.config import YamlLintConfig

from kvctl.main import build_parser as kvctl_parser
from kvstore.cli import _check_exposure, configure
from kvstore.config import SETTINGS, Resolved
from kvstore.errors import InvalidArgument

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
COMPOSE = DEPLOY / "compose.yaml"
IMAGE = "kvstore"
KUBERNETES_VERSIONS = ("1.29.0", kubernetes_validate.latest_version())
"""The oldest Kubernetes the manifests are written for, and the newest schemas bundled."""
FIELD_REFS = {"status.podIP": "10.1.2.3", "spec.nodeName": "gpu-host-7"}
"""What the Downward API gives a pod, for the command lines that use it."""
KVSTORE_ENV = {s.env for s in SETTINGS} | {"KVSTORE_CONFIG"}


def yaml_files() -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".yml", ".yaml"))


def load_all(path: Path) -> list[Any]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


# -- every file ------------------------------------------------------------------------------


def test_every_yaml_parses_and_lints_clean() -> None:
    files = yaml_files()
    assert len(files) >= 12, files
    config = YamlLintConfig(file=str(DEPLOY / ".yamllint.yaml"))
    problems = []
    for path in files:
        assert load_all(path), f"{path} is empty"
        text = path.read_text()
        for p in linter.run(text, config, str(path)):
            problems.append(f"{path.relative_to(ROOT)}:{p.line}:{p.column} {p.level} {p.desc}")
    assert not problems, "\n".join(problems)


def test_no_file_refers_outside_the_repository() -> None:
    for path in DEPLOY.rglob("*"):
        if path.is_file():
            text = path.read_text()
            assert "../shared" not in text and "DESIGN.md" not in text, path


# -- Kubernetes ------------------------------------------------------------------------------


def k8s_resources() -> list[dict[str, Any]]:
    """Every object the kustomization lists, in order."""
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    return [doc for name in kustomization["resources"] for doc in load_all(K8S / name)]


def test_kustomization_lists_every_manifest_once() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert kustomization["kind"] == "Kustomization"
    listed = kustomization["resources"]
    present = sorted(p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
    assert sorted(listed) == present and len(set(listed)) == len(listed)
    assert [i["name"] for i in kustomization["images"]] == [IMAGE]
    for res in k8s_resources():
        if res["kind"] != "Namespace":
            assert res["metadata"]["namespace"] == kustomization["namespace"], res["metadata"]


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_manifests_validate_against_kubernetes_schemas(version: str) -> None:
    resources = k8s_resources()
    kinds = {r["kind"] for r in resources}
    assert {"Deployment", "DaemonSet", "Service", "ConfigMap", "Namespace"} <= kinds
    for res in resources:
        try:
            kubernetes_validate.validate(res, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            pytest.fail(f"{res['kind']}/{res['metadata']['name']}: {path}: {exc.message}")


def workloads() -> Iterator[dict[str, Any]]:
    for res in k8s_resources():
        if res["kind"] in ("Deployment", "DaemonSet", "StatefulSet"):
            yield res


def test_services_select_pods_and_name_their_ports() -> None:
    pods = [w["spec"]["template"] for w in workloads()]
    for svc in (r for r in k8s_resources() if r["kind"] == "Service"):
        selector = svc["spec"]["selector"]
        chosen = [p for p in pods if selector.items() <= p["metadata"]["labels"].items()]
        assert len(chosen) == 1, (svc["metadata"]["name"], selector)
        ports = {p["name"] for c in chosen[0]["spec"]["containers"] for p in c["ports"]}
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in ports, (svc["metadata"]["name"], port)
    for w in workloads():
        template = w["spec"]["template"]
        assert (
            w["spec"]["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
        )
        for c in template["spec"]["containers"]:
            names = {p["name"] for p in c.get("ports", [])}
            for probe in ("readinessProbe", "livenessProbe"):
                for kind in ("tcpSocket", "httpGet"):
                    if kind in c.get(probe, {}):
                        assert c[probe][kind]["port"] in names, (w["metadata"]["name"], probe)


def container_env(
    container: dict[str, Any], config_maps: dict[str, dict[str, str]]
) -> dict[str, str]:
    """The environment Kubernetes gives ``container``: envFrom first, env over it."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update(config_maps[source["configMapRef"]["name"]])
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
        elif "configMapKeyRef" in var["valueFrom"]:
            ref = var["valueFrom"]["configMapKeyRef"]
            env[var["name"]] = config_maps[ref["name"]][ref["key"]]
        else:
            env[var["name"]] = FIELD_REFS[var["valueFrom"]["fieldRef"]["fieldPath"]]
    return env


def expand(word: str, env: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion of command and args (``$$`` escapes)."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        assert m.group(1) in env, f"$({m.group(1)}) is not in the container's environment"
        return env[m.group(1)]

    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", sub, word)


def k8s_command_lines() -> list[tuple[str, list[str], dict[str, str]]]:
    """(where, argv, environment) of every kvstore container and exec probe."""
    config_maps = {
        r["metadata"]["name"]: r["data"] for r in k8s_resources() if r["kind"] == "ConfigMap"
    }
    found = []
    for w in workloads():
        for c in w["spec"]["template"]["spec"]["containers"]:
            if c["image"] != IMAGE:
                continue
            env = container_env(c, config_maps)
            where = f"{w['kind']}/{w['metadata']['name']}"
            found.append((where, [expand(a, env) for a in c["command"] + c["args"]], env))
            for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                if "exec" in c.get(probe, {}):
                    argv = [expand(a, env) for a in c[probe]["exec"]["command"]]
                    found.append((f"{where} {probe}", argv, env))
    return found


def compose_command_lines() -> list[tuple[str, list[str], dict[str, str]]]:
    """(where, argv, environment) of every command and health check of a kvstore service."""
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    found = []
    for name, svc in services.items():
        if not svc.get("image", "").startswith(f"{IMAGE}:"):
            continue
        env = {k: str(v) for k, v in svc.get("environment", {}).items()}
        found.append((name, [*svc.get("entrypoint", []), *svc["command"]], env))
        test = svc.get("healthcheck", {}).get("test")
        if test:
            assert test[0] in ("CMD", "CMD-SHELL"), (name, test)
            argv = test[1:] if test[0] == "CMD" else shlex.split(test[1])
            found.append((f"{name} healthcheck", argv, env))
    return found


def _starts(where: str, resolved: Any) -> None:
    """A server command line passes the start-up check of its exposure: a non-loopback
    address needs an auth file or --insecure."""
    try:
        _check_exposure(resolved)
    except InvalidArgument as exc:
        pytest.fail(f"{where} would refuse to start: {exc}")


def parse_command_line(where: str, argv: list[str], env: dict[str, str]) -> Any:
    """``argv`` through our own parser: kvstore's (settings resolved against ``env``) or
    kvctl's. Returns the resolved configuration (kvstore) or namespace (kvctl); None for
    other programs."""
    out, err = io.StringIO(), io.StringIO()
    try:
        if argv[0] == "kvstore":
            with contextlib.redirect_stderr(err):
                command, resolved = configure(argv[1:], environ=env)
            assert command == argv[1], where
            if command in ("serve", "master", "node"):
                _starts(where, resolved)
            return resolved
        if argv[0] == "kvctl":
            return kvctl_parser(out, err).parse_args(argv[1:])
    except SystemExit as exc:
        pytest.fail(f"{where}: {shlex.join(argv)} exits {exc.code}: {err.getvalue()}")
    return None


def test_kubernetes_command_lines_parse(capsys: pytest.CaptureFixture[str]) -> None:
    lines = k8s_command_lines()
    resolved = {}
    for where, argv, env in lines:
        resolved[where] = parse_command_line(where, argv, env)
        err = capsys.readouterr().err
        assert not err, (where, err)
    master = resolved["Deployment/kvstore-master"]
    node = resolved["DaemonSet/kvstore-node"]
    assert master["redis"].startswith("redis://kvstore-redis:")
    assert (node["host"], node["node_id"]) == (
        FIELD_REFS["status.podIP"],
        FIELD_REFS["spec.nodeName"],
    )
    assert node["master"] == f"kvstore-master:{master['grpc_port']}"
    assert sum(1 for _, argv, _ in lines if argv[0] == "kvctl") >= 1


def test_every_kvstore_variable_set_is_read() -> None:
    """A misspelt KVSTORE_* variable would be ignored silently."""
    sets = [r["data"] for r in k8s_resources() if r["kind"] == "ConfigMap"]
    sets += [
        svc.get("environment", {})
        for svc in yaml.safe_load(COMPOSE.read_text())["services"].values()
    ]
    for env in sets:
        unknown = {k for k in env if k.startswith("KVSTORE_")} - KVSTORE_ENV
        assert not unknown, unknown


# -- compose ---------------------------------------------------------------------------------


def compose_configs() -> dict[str, Resolved]:
    """The resolved configuration of every compose service that runs ``kvstore``."""
    found = {}
    for where, argv, env in compose_command_lines():
        resolved = parse_command_line(where, argv, env)
        if isinstance(resolved, Resolved):
            found[where] = resolved
    return found


def test_compose_command_lines_parse(capsys: pytest.CaptureFixture[str]) -> None:
    lines = compose_command_lines()
    for where, argv, env in lines:
        parse_command_line(where, argv, env)
        err = capsys.readouterr().err
        assert not err, (where, err)
    assert sum(1 for _, argv, _ in lines if argv[0] == "kvctl") >= 3  # 2 health checks, 1 tool
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    configs = compose_configs()
    masters = {n: c for n, c in configs.items() if c.command == "master"}
    nodes = {n: c for n, c in configs.items() if c.command == "node"}
    assert len(masters) == 2 and len(nodes) == 2, configs
    for cfg in masters.values():
        assert cfg["redis"].startswith("redis://redis:") and "redis" in services
        assert cfg["host"] == "0.0.0.0"
    for name, cfg in nodes.items():
        # A node advertises the address it binds: its own name on the network.
        assert cfg["host"] == services[name]["hostname"] == name
        named = [a.rsplit(":", 1) for a in cfg["master"].split(",")]
        assert {m for m, _ in named} == set(masters), "a node names every master: failover"
        assert all(int(port) == masters[m]["grpc_port"] for m, port in named)
    for name, svc in services.items():
        assert "healthcheck" in svc or "tools" in svc.get("profiles", []), name


def test_prometheus_targets_are_the_compose_services() -> None:
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    metrics = {f"{n}:{c['metrics_port']}": c.command for n, c in compose_configs().items()}
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    jobs = {
        j["job_name"]: sorted(t for sc in j["static_configs"] for t in sc["targets"])
        for j in config["scrape_configs"]
    }
    assert jobs == {
        "kvstore-master": sorted(t for t, c in metrics.items() if c == "master"),
        "kvstore-node": sorted(t for t, c in metrics.items() if c == "node"),
    }
    assert "./prometheus:/etc/prometheus:ro" in services["prometheus"]["volumes"]
    assert "--config.file=/etc/prometheus/prometheus.yml" in services["prometheus"]["command"]


def test_grafana_provisioning_matches_compose_and_dashboard() -> None:
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    mounts = dict(v.split(":")[:2] for v in services["grafana"]["volumes"])
    [datasource] = yaml.safe_load(
        (DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text()
    )["datasources"]
    [provider] = yaml.safe_load(
        (DEPLOY / "grafana/provisioning/dashboards/kvstore.yml").read_text()
    )["providers"]
    assert mounts["./grafana/provisioning"] == "/etc/grafana/provisioning"
    assert mounts["./grafana/dashboards"] == provider["options"]["path"]
    assert datasource["url"] == "http://prometheus:9090" and "prometheus" in services
    dashboard = json.loads((DEPLOY / "grafana/dashboards/kvstore.json").read_text())
    [variable] = [v for v in dashboard["templating"]["list"] if v["type"] == "datasource"]
    assert variable["current"]["value"] == datasource["uid"]
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in panels:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]
    titles = " ".join(p["title"].lower() for p in panels)
    for topic in (
        "pool bytes by tier and state",
        "hit rate",
        "transfer throughput by op and transport",
        "latency percentiles",
        "evictions",
        "nodes alive",
        "nodes by state",
        "blocks in the index",
        "hit ratio",
        "transfer errors by reason",
    ):
        assert topic in titles, topic


def test_docker_compose_config() -> None:
    docker = shutil.which("docker")
    if docker is None:
        pytest.skip("docker is not installed")
    probe = subprocess.run(
        [docker, "compose", "version"], capture_output=True, text=True, timeout=30, check=False
    )
    if probe.returncode != 0:
        reason = (probe.stderr or probe.stdout).strip().splitlines()[0]
        pytest.skip(f"docker compose does not work here: {reason}")
    out = subprocess.run(
        [docker, "compose", "-f", str(COMPOSE), "config", "--quiet"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr


# -- the image -------------------------------------------------------------------------------


def dockerfile() -> list[tuple[str, str]]:
    """(instruction, rest) of deploy/Dockerfile, continuation lines joined."""
    joined = re.sub(r"\\\n", " ", (DEPLOY / "Dockerfile").read_text())
    lines = [ln.strip() for ln in joined.splitlines()]
    return [
        (ln.split()[0].upper(), ln.split(None, 1)[1])
        for ln in lines
        if ln and not ln.startswith("#")
    ]


def test_dockerfile_installs_torch_before_the_project() -> None:
    steps = dockerfile()
    args = {
        rest.split("=")[0]: rest.split("=", 1)[1].strip('"')
        for op, rest in steps
        if op == "ARG" and "=" in rest
    }
    assert args["TORCH_VERSION"] == "2.13.0" and args["TORCH_INDEX_URL"].endswith("/cpu")
    assert "BASE_IMAGE" in args and "EXTRAS" in args
    runs = [i for i, (op, rest) in enumerate(steps) if op == "RUN" and "pip install" in rest]
    torch = [i for i in runs if '"torch==${TORCH_VERSION}"' in steps[i][1]]
    project = [i for i in runs if re.search(r'pip install "\.', steps[i][1])]
    copies = [i for i, (op, _) in enumerate(steps) if op == "COPY"]
    assert torch and project and copies
    assert torch[0] < min(copies) < project[0], (
        "torch must be installed before the project is copied"
    )
    assert runs[0] == torch[0]
    # Every COPY source exists and is let through by Dockerfile.dockerignore.
    allowed = {
        ln[1:].rstrip("/")
        for ln in (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
        if ln.startswith("!")
    }
    for i in copies:
        *sources, _ = steps[i][1].split()
        for src in sources:
            assert (ROOT / src).exists() and src.rstrip("/") in allowed, src
    assert any(op == "USER" for op, _ in steps), "the image runs as a non-root user"
    # setup.py goes in, and the install checks that the codec's C kernels built (the image
    # was built without them: no setup.py, and no compiler in the slim base).
    assert any("setup.py" in rest.split() for op, rest in steps if op == "COPY")
    assert "kvstore.core._native" in steps[project[0]][1] and "gcc" in steps[project[0]][1]


def test_kubernetes_scrape_config_finds_the_headless_services() -> None:
    """deploy/prometheus/kubernetes.yml's DNS names are headless Services of k8s/ whose
    pods serve /metrics on the scraped port, one job per component."""
    config = yaml.safe_load((DEPLOY / "prometheus" / "kubernetes.yml").read_text())
    namespace = yaml.safe_load((K8S / "kustomization.yaml").read_text())["namespace"]
    services = {
        f"{r['metadata']['name']}.{namespace}.svc.cluster.local": r
        for r in k8s_resources()
        if r["kind"] == "Service"
    }
    pods = [w["spec"]["template"] for w in workloads()]
    jobs = {}
    for job in config["scrape_configs"]:
        [sd] = job["dns_sd_configs"]
        [name] = sd["names"]
        svc = services[name]
        assert svc["spec"]["clusterIP"] == "None", name
        [pod] = [
            p for p in pods if svc["spec"]["selector"].items() <= p["metadata"]["labels"].items()
        ]
        assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(sd["port"])
        jobs[job["job_name"]] = pod["metadata"]["labels"]["app.kubernetes.io/component"]
    assert jobs == {"kvstore-master": "master", "kvstore-node": "node"}
