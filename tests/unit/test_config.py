"""shared/config.py: the default file loads; bad files raise ConfigError naming the key and its range."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from shared.config import ConfigError, load_config, parse_config

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CONFIG = ROOT / "config" / "config.json"
BASE = json.loads(DEFAULT_CONFIG.read_text())


def patched(**sections) -> dict:
    """The default config with ``sections`` ("BackendConfig.ScheduleConfig": {...}) merged in."""
    data = copy.deepcopy(BASE)
    for section, values in sections.items():
        target = data
        for key in section.split("."):
            target = target[int(key)] if isinstance(target, list) else target[key]
        target.update(values)
    return data


def write(tmp_path: Path, data: dict | str | bytes, name: str = "config.json") -> Path:
    path = tmp_path / name
    if isinstance(data, dict):
        data = json.dumps(data)
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    return path


def load_error(tmp_path: Path, data) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, data))
    return str(info.value)


# ---- the default file -------------------------------------------------------------------------


def test_default_config_loads():
    cfg = load_config(DEFAULT_CONFIG)
    assert cfg.version == "1.0.0"
    assert cfg.server.ip_address == "127.0.0.1"
    assert cfg.server.port == 1025
    assert cfg.server.management_port == 1026
    assert cfg.server.metrics_port == 1027
    assert cfg.model.model_name == "SmolLM2-135M-Instruct"
    assert cfg.model.backend_type == "torch"
    assert cfg.deploy.max_seq_len == 2560
    assert cfg.deploy.max_input_token_len == 2048
    assert cfg.deploy.effective_max_input_len == 2048
    assert cfg.deploy.truncates is False
    assert cfg.schedule.cache_block_size == 16
    assert cfg.schedule.max_batch_size == 32
    assert cfg.schedule.prefill_batch_size == 16
    assert cfg.switchboard.device == "cpu"
    assert cfg.switchboard.dtype == "float32"


def test_default_model_path_resolves_against_the_config_folder():
    cfg = load_config(DEFAULT_CONFIG)
    assert cfg.source_dir == str(DEFAULT_CONFIG.parent.resolve())
    assert cfg.model_path == (ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct").resolve()


# ---- paths and fallbacks ----------------------------------------------------------------------


def test_relative_model_weight_path_resolves_against_the_config_file_folder(tmp_path, monkeypatch):
    folder = tmp_path / "deploy" / "conf"
    folder.mkdir(parents=True)
    data = patched(**{"BackendConfig.ModelDeployConfig.ModelConfig.0": {"modelWeightPath": "../weights/m"}})
    path = write(folder, data)
    monkeypatch.chdir(ROOT)  # the working directory must not matter
    cfg = load_config(path)
    assert cfg.model_path == (tmp_path / "deploy" / "weights" / "m").resolve()


def test_absolute_model_weight_path_is_kept(tmp_path):
    weights = tmp_path / "abs" / "model"
    data = patched(**{"BackendConfig.ModelDeployConfig.ModelConfig.0": {"modelWeightPath": str(weights)}})
    cfg = load_config(write(tmp_path, data))
    assert cfg.model_path == weights


def test_management_port_absent_falls_back_to_port(tmp_path):
    data = patched()
    del data["ServerConfig"]["managementPort"]
    data["ServerConfig"]["port"] = 2025
    cfg = load_config(write(tmp_path, data))
    assert cfg.server.management_port is None
    assert cfg.server.management_listen_port == 2025


def test_management_port_present_is_used(tmp_path):
    cfg = load_config(write(tmp_path, patched(ServerConfig={"port": 2025, "managementPort": 2026})))
    assert cfg.server.management_listen_port == 2026


def test_unknown_keys_are_ignored(tmp_path):
    data = patched(ServerConfig={"someFutureKey": 1}, **{"BackendConfig.ScheduleConfig": {"bogus": [1, 2]}})
    data["TopLevelExtra"] = {"a": "b"}
    data["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]["pluginParams"] = "{}"
    cfg = load_config(write(tmp_path, data))
    assert cfg.server.port == 1025
    assert cfg.schedule.cache_block_size == 16


def test_minimal_config_gets_defaults():
    raw = json.dumps({"BackendConfig": {"ModelDeployConfig": {"ModelConfig": [
        {"modelName": "m", "modelWeightPath": "/w"}]}}}).encode()
    cfg = parse_config(raw)
    assert cfg.server.port == 1025
    assert cfg.server.management_listen_port == 1025
    assert cfg.schedule.max_batch_size == 200
    assert cfg.model.backend_type == "torch"
    assert cfg.switchboard.kv_cache_memory_mb == 1024
    assert cfg.switchboard.header_timeout_seconds == 10
    assert cfg.switchboard.body_timeout_seconds == 30
    assert cfg.switchboard.max_connections == 4096


def test_slow_client_keys_are_read(tmp_path):
    data = patched(Switchboard={"headerTimeoutSeconds": 1, "bodyTimeoutSeconds": 3600, "maxConnections": 8})
    s = load_config(write(tmp_path, data)).switchboard
    assert (s.header_timeout_seconds, s.body_timeout_seconds, s.max_connections) == (1, 3600, 8)


@pytest.mark.parametrize("value, truncates", [(-1, True), (0, False), (1, True), (True, True), (False, False)])
def test_truncation_values(tmp_path, value, truncates):
    cfg = load_config(write(tmp_path, patched(**{"BackendConfig.ModelDeployConfig": {"truncation": value}})))
    assert cfg.deploy.truncates is truncates


def test_all_zero_ip_allowed_with_flag(tmp_path):
    data = patched(ServerConfig={"ipAddress": "0.0.0.0", "allowAllZeroIpListening": True})
    cfg = load_config(write(tmp_path, data))
    assert cfg.server.ip_address == "0.0.0.0"


# ---- bad values: the message names the key path and the allowed range -------------------------


@pytest.mark.parametrize(
    "sections, key, allowed",
    [
        ({"ServerConfig": {"port": 80}}, "ServerConfig.port", "[1024, 65535]"),
        ({"ServerConfig": {"port": 70000}}, "ServerConfig.port", "[1024, 65535]"),
        ({"ServerConfig": {"managementPort": 1}}, "ServerConfig.managementPort", "[1024, 65535]"),
        ({"ServerConfig": {"metricsPort": 80}}, "ServerConfig.metricsPort", "[1024, 65535]"),
        ({"ServerConfig": {"tokenTimeout": 0}}, "ServerConfig.tokenTimeout", "[1, 3600]"),
        ({"ServerConfig": {"maxLinkNum": 5000}}, "ServerConfig.maxLinkNum", "[1, 4096]"),
        ({"ServerConfig.HealthCheckConfig": {"npuUsageThreshold": 101}},
         "ServerConfig.HealthCheckConfig.npuUsageThreshold", "[0, 100]"),
        ({"BackendConfig.ScheduleConfig": {"cacheBlockSize": 0}}, "BackendConfig.ScheduleConfig.cacheBlockSize",
         "[1, 128]"),
        ({"BackendConfig.ScheduleConfig": {"cacheBlockSize": 129}}, "BackendConfig.ScheduleConfig.cacheBlockSize",
         "[1, 128]"),
        ({"BackendConfig.ScheduleConfig": {"maxBatchSize": 0}}, "BackendConfig.ScheduleConfig.maxBatchSize",
         "[1, 5000]"),
        ({"BackendConfig": {"modelInstanceNumber": 11}}, "BackendConfig.modelInstanceNumber", "[1, 10]"),
        ({"BackendConfig.ModelDeployConfig.ModelConfig.0": {"backendType": "x"}},
         "BackendConfig.ModelDeployConfig.ModelConfig[0].backendType", "'atb' | 'ms' | 'torch'"),
        ({"Switchboard": {"device": "tpu"}}, "Switchboard.device", "'auto' | 'cpu' | 'cuda' | 'npu'"),
        ({"Switchboard": {"kvCacheMemoryMb": 1}}, "Switchboard.kvCacheMemoryMb", "[16, 1048576]"),
        ({"Switchboard": {"headerTimeoutSeconds": 0}}, "Switchboard.headerTimeoutSeconds", "[1, 3600]"),
        ({"Switchboard": {"headerTimeoutSeconds": 3601}}, "Switchboard.headerTimeoutSeconds", "[1, 3600]"),
        ({"Switchboard": {"bodyTimeoutSeconds": 0}}, "Switchboard.bodyTimeoutSeconds", "[1, 3600]"),
        ({"Switchboard": {"bodyTimeoutSeconds": 86400}}, "Switchboard.bodyTimeoutSeconds", "[1, 3600]"),
        ({"Switchboard": {"maxConnections": 0}}, "Switchboard.maxConnections", "[1, 65536]"),
        ({"Switchboard": {"maxConnections": 65537}}, "Switchboard.maxConnections", "[1, 65536]"),
        ({"Switchboard": {"kvTransTimeoutSeconds": 0}}, "Switchboard.kvTransTimeoutSeconds", "(0, 3600]"),
    ],
)
def test_out_of_range_value_names_key_and_range(tmp_path, sections, key, allowed):
    message = load_error(tmp_path, patched(**sections))
    assert f"{key}:" in message
    assert f"(allowed: {allowed})" in message


@pytest.mark.parametrize(
    "sections, key, allowed",
    [
        ({"ServerConfig": {"port": "1025"}}, "ServerConfig.port", "[1024, 65535]"),
        ({"ServerConfig": {"httpsEnabled": "no"}}, "ServerConfig.httpsEnabled", None),
        ({"BackendConfig.ScheduleConfig": {"maxBatchSize": 1.5}}, "BackendConfig.ScheduleConfig.maxBatchSize",
         "[1, 5000]"),
        ({"BackendConfig.ModelDeployConfig": {"ModelConfig": {"modelName": "m"}}},
         "BackendConfig.ModelDeployConfig.ModelConfig", None),
        ({"Switchboard": {"headerTimeoutSeconds": "10"}}, "Switchboard.headerTimeoutSeconds", "[1, 3600]"),
        ({"Switchboard": {"bodyTimeoutSeconds": 2.5}}, "Switchboard.bodyTimeoutSeconds", "[1, 3600]"),
        ({"Switchboard": {"maxConnections": None}}, "Switchboard.maxConnections", "[1, 65536]"),
    ],
)
def test_wrong_type_names_key(tmp_path, sections, key, allowed):
    message = load_error(tmp_path, patched(**sections))
    assert f"{key}:" in message
    assert "Expected" in message
    if allowed:
        assert f"(allowed: {allowed})" in message


def test_missing_model_config_names_the_key(tmp_path):
    data = patched()
    del data["BackendConfig"]["ModelDeployConfig"]["ModelConfig"]
    message = load_error(tmp_path, data)
    assert "BackendConfig.ModelDeployConfig" in message
    assert "ModelConfig" in message
    assert "missing" in message


def test_empty_model_config_list_is_refused(tmp_path):
    message = load_error(tmp_path, patched(**{"BackendConfig.ModelDeployConfig": {"ModelConfig": []}}))
    assert "BackendConfig.ModelDeployConfig.ModelConfig:" in message


def test_missing_model_weight_path_is_refused(tmp_path):
    data = patched()
    del data["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]["modelWeightPath"]
    message = load_error(tmp_path, data)
    assert "BackendConfig.ModelDeployConfig.ModelConfig[0]" in message
    assert "modelWeightPath" in message


def test_bad_model_name_is_refused(tmp_path):
    data = patched(**{"BackendConfig.ModelDeployConfig.ModelConfig.0": {"modelName": "bad name!"}})
    assert "BackendConfig.ModelDeployConfig.ModelConfig[0].modelName:" in load_error(tmp_path, data)


def test_prefill_batch_larger_than_batch_is_refused(tmp_path):
    data = patched(**{"BackendConfig.ScheduleConfig": {"maxBatchSize": 8, "maxPrefillBatchSize": 9}})
    message = load_error(tmp_path, data)
    assert message.startswith("BackendConfig.ScheduleConfig.maxPrefillBatchSize:")
    assert "[0, maxBatchSize=8]" in message
    assert "got 9" in message


def test_prefill_batch_equal_to_batch_is_accepted(tmp_path):
    data = patched(**{"BackendConfig.ScheduleConfig": {"maxBatchSize": 8, "maxPrefillBatchSize": 8}})
    assert load_config(write(tmp_path, data)).schedule.prefill_batch_size == 8


def test_prefill_batch_zero_means_max_batch(tmp_path):
    data = patched(**{"BackendConfig.ScheduleConfig": {"maxBatchSize": 8, "maxPrefillBatchSize": 0}})
    assert load_config(write(tmp_path, data)).schedule.prefill_batch_size == 8


def test_prefill_tokens_below_max_input_len_is_refused(tmp_path):
    data = patched(**{"BackendConfig.ScheduleConfig": {"maxPrefillTokens": 1000},
                      "BackendConfig.ModelDeployConfig": {"maxInputTokenLen": 2048}})
    message = load_error(tmp_path, data)
    assert message.startswith("BackendConfig.ScheduleConfig.maxPrefillTokens:")
    assert "maxInputTokenLen (2048)" in message
    assert "got 1000" in message


def test_truncation_out_of_set_is_refused(tmp_path):
    message = load_error(tmp_path, patched(**{"BackendConfig.ModelDeployConfig": {"truncation": 2}}))
    assert message.startswith("BackendConfig.ModelDeployConfig.truncation:")


def test_max_seq_len_below_two_is_refused(tmp_path):
    message = load_error(tmp_path, patched(**{"BackendConfig.ModelDeployConfig": {"maxSeqLen": 1}}))
    assert message.startswith("BackendConfig.ModelDeployConfig.maxSeqLen:")


@pytest.mark.parametrize("key, ip", [("ipAddress", "0.0.0.0"), ("managementIpAddress", "0.0.0.0"),
                                     ("ipAddress", "::")])
def test_all_zero_ip_without_flag_is_refused(tmp_path, key, ip):
    message = load_error(tmp_path, patched(ServerConfig={key: ip}))
    assert message.startswith(f"ServerConfig.{key}:")
    assert "allowAllZeroIpListening" in message


def test_not_an_ip_is_refused(tmp_path):
    message = load_error(tmp_path, patched(ServerConfig={"ipAddress": "localhost"}))
    assert message.startswith("ServerConfig.ipAddress:")


def test_https_enabled_loads_with_the_tls_keys(tmp_path):
    """The TLS files themselves are checked when the gateway starts (tests/integration/test_tls.py)."""
    server = load_config(write(tmp_path, patched(ServerConfig={"httpsEnabled": True, "metricsTlsCaFile": ["m.pem"]}))).server
    assert server.https_enabled and server.tls_ca_file == ["ca.pem"] and server.metrics_tls_ca_file == ["m.pem"]
    assert server.management_tls_cert == "security/certs/management/server.pem"


# ---- files that are not configs at all --------------------------------------------------------


def test_non_json_file_is_refused(tmp_path):
    message = load_error(tmp_path, "this is { not json")
    assert "not valid JSON" in message


def test_truncated_json_is_refused(tmp_path):
    message = load_error(tmp_path, DEFAULT_CONFIG.read_text()[:200])
    assert "not valid JSON" in message


def test_json_array_is_refused(tmp_path):
    message = load_error(tmp_path, "[]")
    assert "Expected `object`" in message


def test_empty_file_is_refused(tmp_path):
    message = load_error(tmp_path, b"")
    assert "between 1 byte and 10 MB" in message


def test_missing_file_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "absent.json")


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


@pytest.mark.parametrize("url", ["not a url", "127.0.0.1:4222", "nats://", "nats://a:4222\n"])
def test_a_nats_url_that_is_not_one_is_refused(url):
    """It was taken, and the services tried to reach it for ever (the start never ended)."""
    with pytest.raises(ConfigError, match=r'Switchboard.natsUrl: must be "" .* or one NATS URL'):
        parse_config(json.dumps(patched(Switchboard={"natsUrl": url})).encode())
    for good in ("", "nats://nats:4222", "tls://10.0.0.1:4222"):
        parse_config(json.dumps(patched(Switchboard={"natsUrl": good})).encode())


@pytest.mark.parametrize(
    "sections, message",
    [
        ({"BackendConfig.ScheduleConfig": {"maxPreemptCount": 100, "maxBatchSize": 4,
                                           "maxPrefillBatchSize": 4}},
         "BackendConfig.ScheduleConfig.maxPreemptCount: must be in [0, maxBatchSize=4], got 100"),
        ({"BackendConfig.ScheduleConfig": {"maxIterTimes": 4000}},
         "BackendConfig.ScheduleConfig.maxIterTimes: must be in [1, ModelDeployConfig.maxSeqLen=2560], got 4000"),
        ({"BackendConfig.ModelDeployConfig.ModelConfig.0": {"npuMemSize": 0}},
         "ModelConfig[0].npuMemSize: must be -1 (automatic) or in (0, 2147483647], got 0"),
    ],
)
def test_ranges_given_by_other_keys_are_checked(tmp_path, sections, message):
    """The reference's ranges in terms of other keys (§1.4, §1.5): refused at start, naming both."""
    assert message in load_error(tmp_path, patched(**sections))


def test_a_second_model_config_is_refused(tmp_path):
    data = patched()
    models = data["BackendConfig"]["ModelDeployConfig"]["ModelConfig"]
    models.append({**models[0], "modelName": "second"})
    assert "ModelConfig[1]: a deployment serves one model" in load_error(tmp_path, data)


def test_a_utf8_byte_order_mark_is_skipped(tmp_path):
    """A config saved by an editor that writes a BOM reads as without it (MindIE's JSON reader skips it too)."""
    cfg = load_config(write(tmp_path, b"\xef\xbb\xbf" + json.dumps(patched()).encode()))
    assert cfg.server.port == BASE["ServerConfig"]["port"]


def test_a_static_adapter_named_none_is_refused(tmp_path):
    """TGI's adapter_id and vLLM's model say "None" for no adapter: an adapter by that name ran on OpenAI's
    routes and silently not on theirs (the load route refused the name already)."""
    message = load_error(tmp_path, patched(**{"BackendConfig.ModelDeployConfig": {
        "LoraModules": [{"name": "None", "path": "adapters/x"}]}}))
    assert "BackendConfig.ModelDeployConfig.LoraModules[0].name: 'None' is the name" in message
