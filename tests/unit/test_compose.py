"""compose.yaml against the Compose Specification's JSON schema, and every command it runs is real.

No Docker engine runs here, so this is what `docker compose config` would check, plus ours.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import yaml

from shared.config import load_config
from switchboard.cli import parse_args

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = ROOT.parent / "shared" / "reference" / "compose-spec.json"
COMPOSE = yaml.safe_load((ROOT / "compose.yaml").read_text())
OURS = {name: svc for name, svc in COMPOSE["services"].items() if svc.get("image") == "switchboard:latest"}


def test_compose_file_is_valid_against_the_compose_spec():
    if not SCHEMA.exists():
        pytest.skip(f"{SCHEMA} is not beside the project")
    jsonschema.Draft7Validator(json.loads(SCHEMA.read_text())).validate(COMPOSE)


def test_it_runs_nats_the_four_services_tracing_and_monitoring():
    assert set(OURS) == {"gateway", "tokenizer", "engine", "metrics"}
    assert {"nats", "otel-collector", "prometheus", "grafana"} <= set(COMPOSE["services"])


@pytest.mark.parametrize("name", sorted(OURS))
def test_each_command_is_a_real_subcommand_with_a_valid_config(name):
    command = OURS[name]["command"]
    assert command[0] == "switchboard"
    args = parse_args(command[1:])  # argparse exits on an unknown subcommand or flag
    assert args.command == name
    cfg = load_config(ROOT / args.config)  # raises ConfigError naming the key on a bad file
    assert not args.nats and cfg.switchboard.nats_url == "nats://nats:4222"  # the config's URL: one knob
    service = COMPOSE["services"][name]
    grace = float(service["stop_grace_period"].removesuffix("s"))
    assert grace >= cfg.switchboard.shutdown_grace_seconds + 10  # (docker's default, 10 s, cut the drain)
    assert service["restart"] == "on-failure"  # /stopService's exit 0 is a stop, a crash is restarted


def test_only_the_api_is_published_beyond_this_host_and_nats_not_at_all():
    cfg = load_config(ROOT / "config" / "compose.json").server
    for name, svc in COMPOSE["services"].items():
        for port in svc.get("ports", []):
            if int(port.split(":")[-1]) != cfg.port:
                assert port.startswith("127.0.0.1:"), (name, port)
    assert "ports" not in COMPOSE["services"]["nats"]


def test_the_gateway_healthcheck_asks_its_readiness_route():
    from services.gateway.web import app

    test = COMPOSE["services"]["gateway"]["healthcheck"]["test"]
    assert test[:3] == ["CMD", "python", "-c"]
    compile(test[3], "healthcheck", "exec")
    (url,) = re.findall(r"'(http://[^']+)'", test[3])
    cfg = load_config(ROOT / "config" / "compose.json").server
    assert url == f"http://127.0.0.1:{cfg.management_listen_port}/v2/health/ready"
    assert "/v2/health/ready" in {path for h in app.MANAGEMENT_ROUTES for path in h.paths}


def test_mounted_files_exist_and_ports_line_up():
    for svc in COMPOSE["services"].values():
        for volume in svc.get("volumes", []):
            source = volume.split(":")[0]
            if source in COMPOSE.get("volumes", {}):  # a named volume (NATS's JetStream files)
                continue
            assert (ROOT / source).exists(), f"{source} is mounted but missing"
    cfg = load_config(ROOT / "config" / "compose.json").server
    published = {int(p.split(":")[-1]) for p in COMPOSE["services"]["gateway"]["ports"]}
    assert {cfg.port, cfg.management_listen_port, cfg.metrics_port} == published
    scrape = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    assert scrape["scrape_configs"][0]["static_configs"][0]["targets"] == [f"gateway:{cfg.metrics_port}"]


def test_the_grafana_dashboard_charts_metrics_we_export():
    from services.metrics.prometheus import PrometheusMetrics

    suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"], "gauge": [""]}
    exported = {f.name + suffix for f in PrometheusMetrics("m").registry.collect() for suffix in suffixes[f.type]}
    dashboard = json.loads((ROOT / "deploy/grafana/dashboards/switchboard.json").read_text())
    titles = {p["title"] for p in dashboard["panels"]}
    assert {"Time to first token", "Time between tokens", "Queue", "KV-cache blocks in use", "Tokens per second"} <= titles
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            expr = re.sub(r"\{[^}]*\}|\b(by|without) \([^)]*\)", " ", target["expr"])  # label matchers, groupings
            names = [w for w in expr.replace("(", " ").replace(")", " ").replace("[", " ").split()
                     if "_" in w and not w.startswith("histogram")]
            for metric in names:
                assert metric in exported, metric
            # every gateway exports the fleet's view: a sum over them would count it once per gateway
            assert not re.match(r"(sum|avg)\b", target["expr"]), target["expr"]


def test_the_images_own_command_serves_the_shipped_config_on_every_interface():
    """config.json listens on loopback: in a container (`docker run -p 1025:1025`) nothing could reach it."""
    (cmd,) = re.findall(r"^CMD (.+)$", (ROOT / "Dockerfile").read_text(), re.M)
    args = parse_args(json.loads(cmd)[1:])
    assert args.command == "serve" and args.config == "config/docker.json"
    docker, shipped = (json.loads((ROOT / "config" / name).read_text()) for name in ("docker.json", "config.json"))
    addresses = {"ipAddress": "0.0.0.0", "managementIpAddress": "0.0.0.0", "allowAllZeroIpListening": True}
    assert {k: docker["ServerConfig"][k] for k in addresses} == addresses
    assert {**docker, "ServerConfig": {**docker["ServerConfig"], **{k: shipped["ServerConfig"][k] for k in addresses}}} \
        == shipped
    load_config(ROOT / "config" / "docker.json")
