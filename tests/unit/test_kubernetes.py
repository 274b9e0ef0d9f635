"""deploy/kubernetes against Kubernetes' own schemas (kubernetes-validate ships them: no cluster, no
network), and against the project: every command a real `switchboard` subcommand, every port one
config.json opens, every probe and preStop path a route the gateway serves on that port, every
config.json one shared.config accepts, the drain's grace period longer than a request can last."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import kubernetes_validate
import pytest
import yaml

from shared.config import parse_config
from switchboard.cli import parse_args
from switchboard.runner import SERVICES

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"
# Strictly validated against the oldest and the newest schemas kubernetes-validate ships (all offline).
KUBERNETES_VERSIONS = ("1.25.0", "1.37.0")
COMPOSE = yaml.safe_load((ROOT / "compose.yaml").read_text())
MANIFESTS = sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
DOCS = [(p.name, d) for p in MANIFESTS for d in yaml.safe_load_all(p.read_text()) if d]
IMAGE_APP_DIR = Path("/app")  # the Dockerfile's WORKDIR, where it prepares the model


def objects(kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for _, d in DOCS if d["kind"] == kind}


def container(name: str) -> dict:
    (one,) = objects("Deployment")[name]["spec"]["template"]["spec"]["containers"]
    return one


def switchboard_config():
    cm = objects("ConfigMap")["switchboard-config"]
    return parse_config(cm["data"]["config.json"].encode(), source_dir=str(IMAGE_APP_DIR / "config"))


def port_number(c: dict, port) -> int:
    if isinstance(port, int):
        return port
    return next(p["containerPort"] for p in c["ports"] if p["name"] == port)


def routes_on_port(cfg, port: int) -> set[str]:
    """The paths the gateway serves on ``port``: the planes app.listeners() puts there."""
    from services.gateway.web import app

    server = cfg.server
    planes = [(server.port, app.BUSINESS_ROUTES), (server.management_listen_port, app.MANAGEMENT_ROUTES),
              (server.metrics_port, app.METRICS_ROUTES)]
    return {path for p, handlers in planes if p == port for h in handlers for path in h.paths}


def test_kustomization_lists_every_manifest():
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == sorted(p.name for p in MANIFESTS)


def test_the_kubernetes_versions_are_ones_the_package_ships():
    from kubernetes_validate import utils

    assert set(KUBERNETES_VERSIONS) <= set(utils.all_versions())


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("name,doc", DOCS, ids=[f"{n}:{d['kind']}/{d['metadata']['name']}" for n, d in DOCS])
def test_every_manifest_is_valid_kubernetes(name, doc, version):
    kubernetes_validate.validate(doc, version, strict=True)  # raises on any unknown or bad field


@pytest.mark.parametrize("service", SERVICES)
def test_each_service_runs_compose_image_and_command_on_the_configmap(service):
    c = container(service)
    ours = COMPOSE["services"][service]
    assert c["image"] == ours["image"]
    command = c["command"]
    assert command[0] == "switchboard"
    args = parse_args(command[1:])  # argparse exits on an unknown subcommand or flag
    assert args.command == service
    # the same command as compose.yaml but for the config's path
    assert [a for a in command if a != args.config] == [a for a in ours["command"] if not a.endswith(".json")]
    cfg = switchboard_config()
    assert not args.nats and cfg.switchboard.nats_url  # the ConfigMap's natsUrl is the one knob
    spec = objects("Deployment")[service]["spec"]["template"]["spec"]
    mount = next(m for m in c["volumeMounts"] if Path(args.config).parent == Path(m["mountPath"]))
    volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
    assert volume["configMap"]["name"] == "switchboard-config" and Path(args.config).name == "config.json"
    assert {"cpu"} <= set(c["resources"]["requests"]) and {"cpu"} <= set(c["resources"]["limits"])


def test_the_configmap_config_parses_and_matches_the_image_and_ports():
    cfg = switchboard_config()  # raises ConfigError naming the key on a bad file
    compose_json = ROOT / "config" / "compose.json"
    compose_cfg = parse_config(compose_json.read_bytes(), source_dir=str(IMAGE_APP_DIR / "config"))
    default = parse_config((ROOT / "config" / "config.json").read_bytes(), source_dir=str(IMAGE_APP_DIR / "config"))
    assert cfg.model_path == default.model_path  # where `prepare-model --config config/config.json` put it
    s, d = cfg.server, default.server
    assert (s.port, s.management_listen_port, s.metrics_port) == (d.port, d.management_listen_port, d.metrics_port)
    assert (s.ip_address, s.management_ip) == (compose_cfg.server.ip_address, compose_cfg.server.management_ip)
    assert cfg.model.model_name == compose_cfg.model.model_name


def test_the_nats_url_names_the_nats_client_service():
    url = urlsplit(switchboard_config().switchboard.nats_url)
    service = objects("Service")[url.hostname]
    assert service["spec"]["selector"] == objects("StatefulSet")["nats"]["spec"]["selector"]["matchLabels"]
    assert url.port in {p["port"] for p in service["spec"]["ports"]}


def test_gateway_ports_are_config_ports():
    cfg = switchboard_config().server
    c = container("gateway")
    assert {p["containerPort"] for p in c["ports"]} == {cfg.port, cfg.management_listen_port, cfg.metrics_port}
    service = objects("Service")["gateway"]
    assert {p["port"] for p in service["spec"]["ports"]} == {cfg.port, cfg.management_listen_port, cfg.metrics_port}
    for p in service["spec"]["ports"]:
        assert port_number(c, p["targetPort"]) == p["port"]
    annotations = objects("Deployment")["gateway"]["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == cfg.metrics_port
    assert annotations["prometheus.io/path"] in routes_on_port(switchboard_config(), cfg.metrics_port)


def test_gateway_probes_are_real_health_routes_on_their_port():
    cfg = switchboard_config()
    c = container("gateway")
    for probe, path in (("livenessProbe", "/v2/health/live"), ("readinessProbe", "/v2/health/ready")):
        get = c[probe]["httpGet"]
        assert get["path"] == path
        port = port_number(c, get["port"])
        assert port == cfg.server.management_listen_port
        assert path in routes_on_port(cfg, port)


def test_services_without_http_have_no_fake_probes():
    for service in ("tokenizer", "engine", "metrics"):
        c = container(service)
        assert "ports" not in c
        assert not {"livenessProbe", "readinessProbe", "startupProbe"} & set(c)


def test_gateway_prestop_drains_this_instance_within_the_grace_period():
    from services.gateway.admin import stop

    cfg = switchboard_config()
    c = container("gateway")
    command = c["lifecycle"]["preStop"]["exec"]["command"]
    assert command[:2] == ["python", "-c"]  # the image (python:3.11-slim) has python, not curl
    compile(command[2], "preStop", "exec")
    (url,) = re.findall(r"'(http://[^']+)'", command[2])
    parts = urlsplit(url)
    assert parts.hostname == "127.0.0.1" and parts.port == cfg.server.management_listen_port
    assert parts.path in routes_on_port(cfg, parts.port)
    assert parse_qs(parts.query) == {"scope": ["instance"]} and "instance" in stop.SCOPES
    longest_request = max(cfg.server.token_timeout, cfg.server.e2e_timeout)
    (timeout,) = [float(t) for t in re.findall(r"timeout=(\d+)", command[2])]
    (sleep,) = [float(t) for t in re.findall(r"sleep\((\d+)\)", command[2])]
    grace = objects("Deployment")["gateway"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert longest_request < timeout and sleep + longest_request + 10 <= grace


def test_engine_cpu_is_its_torch_threads():
    c = container("engine")
    threads = switchboard_config().switchboard.torch_threads
    assert str(threads) == str(c["resources"]["limits"]["cpu"]) == str(c["resources"]["requests"]["cpu"])


def test_a_three_node_nats_cluster():
    sts = objects("StatefulSet")["nats"]
    assert sts["spec"]["replicas"] == 3
    headless = objects("Service")[sts["spec"]["serviceName"]]
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"]
    conf = objects("ConfigMap")["nats-config"]["data"]["nats.conf"]
    (c,) = sts["spec"]["template"]["spec"]["containers"]
    cluster_port = port_number(c, "cluster")
    routes = re.findall(r"nats://([\w.-]+):(\d+)", conf)
    assert routes == [(f"nats-{i}.{headless['metadata']['name']}", str(cluster_port)) for i in range(3)]
    assert re.search(rf"^\s*port: {cluster_port}$", conf, re.M)  # the cluster block listens where routes dial
    assert re.search(rf"^port: {port_number(c, 'client')}$", conf, re.M)
    assert re.search(rf"^http_port: {port_number(c, 'monitor')}$", conf, re.M)
    compose_conf = (ROOT / "config" / "nats.conf").read_text()
    assert re.findall(r"max_payload: (\d+)", conf) == re.findall(r"max_payload: (\d+)", compose_conf)
    assert c["image"] == COMPOSE["services"]["nats"]["image"]
    (pid_file,) = re.findall(r'pid_file: "([^"]+)"', conf)
    assert c["lifecycle"]["preStop"]["exec"]["command"] == ["/nats-server", f"-sl=ldm={pid_file}"]
    lame_duck = sum(int(s) for s in re.findall(r"lame_duck_(?:duration|grace_period): (\d+)s", conf))
    assert lame_duck < sts["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]


def test_disruption_budgets_cover_gateway_engine_tokenizer_and_nats():
    pdbs = objects("PodDisruptionBudget")
    workloads = {**objects("Deployment"), **objects("StatefulSet")}
    for name in ("gateway", "engine", "tokenizer", "nats"):
        assert pdbs[name]["spec"]["selector"]["matchLabels"] == workloads[name]["spec"]["selector"]["matchLabels"]


def test_engine_autoscaler_uses_a_metric_we_export():
    from services.metrics.prometheus import PrometheusMetrics

    (hpa,) = objects("HorizontalPodAutoscaler").values()
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "engine"}
    exported = {f.name for f in PrometheusMetrics("m").registry.collect() if f.type == "gauge"}
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "External"
    assert metric["external"]["metric"]["name"] in exported
    labels = metric["external"]["metric"]["selector"]["matchLabels"]
    assert labels == {"model_name": switchboard_config().model.model_name}
    assert "replicas" not in objects("Deployment")["engine"]["spec"]  # each apply would reset the HPA's count


def test_the_engine_drains_within_its_grace_period():
    from services.engine.service import DRAIN_MAX_S

    grace = objects("Deployment")["engine"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert DRAIN_MAX_S + 10 <= grace


def test_nats_takes_clients_from_the_services_only_and_management_from_the_namespace():
    policies = objects("NetworkPolicy")
    nats = policies["nats"]["spec"]
    assert nats["podSelector"]["matchLabels"] == objects("StatefulSet")["nats"]["spec"]["selector"]["matchLabels"]
    (clients, members) = nats["ingress"]
    (expression,) = clients["from"][0]["podSelector"]["matchExpressions"]
    assert expression["operator"] == "In" and set(expression["values"]) == set(SERVICES)
    for name in SERVICES:
        assert objects("Deployment")[name]["spec"]["template"]["metadata"]["labels"] == {
            "app.kubernetes.io/name": name}
    assert [p["port"] for p in clients["ports"]] == [urlsplit(switchboard_config().switchboard.nats_url).port]
    assert [p["port"] for p in members["ports"]] == [6222]
    cfg = switchboard_config().server
    gateway = policies["gateway"]["spec"]
    open_to_all, namespace = gateway["ingress"]
    assert "from" not in open_to_all and {p["port"] for p in open_to_all["ports"]} == {cfg.port, cfg.metrics_port}
    assert namespace["from"] == [{"podSelector": {}}]
    assert [p["port"] for p in namespace["ports"]] == [cfg.management_listen_port]


def test_every_service_runs_as_the_images_non_root_user():
    (user,) = re.findall(r"^USER (\S+)$", (ROOT / "Dockerfile").read_text(), re.M)
    assert user.isdigit() and int(user) > 0  # numeric: runAsNonRoot can check it
    for name in SERVICES:
        context = container(name)["securityContext"]
        assert context["runAsNonRoot"] and context["allowPrivilegeEscalation"] is False
        assert context["capabilities"]["drop"] == ["ALL"]


def test_each_nats_member_keeps_the_stored_responses():
    assert switchboard_config().switchboard.responses_replicas == objects("StatefulSet")["nats"]["spec"]["replicas"]
