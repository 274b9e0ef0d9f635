"""config.json in MindIE's schema, typed with msgspec and validated at start.

Key names follow MindIE exactly (camelCase; Pascal-case section names). Keys MindIE lacks live in
one extra section, ``Switchboard``. Unknown keys are ignored, as MindIE's own loader does.
A bad file raises :class:`ConfigError` whose message names the key path and the allowed range.
"""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path
from typing import Annotated, Literal

import msgspec
from msgspec import Meta, field

from shared.media_urls import normalize_domain, private_networks
from shared.switchboard_config import SwitchboardConfig

Port = Annotated[int, Meta(ge=1024, le=65535)]
U32 = Annotated[int, Meta(ge=0, le=4294967295)]
MAX_CONFIG_BYTES = 10 * 1024 * 1024


class ConfigError(ValueError):
    """config.json could not be loaded; the message names the key path."""


class Struct(msgspec.Struct, rename="camel", kw_only=True):
    pass


class HealthCheckConfig(Struct, kw_only=True):
    npu_usage_threshold: Annotated[int, Meta(ge=0, le=100)] = 0


class ServerConfig(Struct, kw_only=True):
    """ServerConfig (reference §1.1): listeners, TLS, limits and timeouts."""

    ip_address: str = "127.0.0.1"
    management_ip_address: str | None = None
    port: Port = 1025
    management_port: Port | None = None
    metrics_port: Port = 1027
    allow_all_zero_ip_listening: bool = False
    max_link_num: Annotated[int, Meta(ge=1, le=4096)] = 1000
    https_enabled: bool = False
    full_text_enabled: bool = False
    tls_ca_path: str = "security/ca/"
    tls_ca_file: list[str] = field(default_factory=lambda: ["ca.pem"])
    tls_cert: str = "security/certs/server.pem"
    tls_pk: str = "security/keys/server.key.pem"
    tls_pk_pwd: str = ""
    tls_crl_path: str = ""
    tls_crl_files: list[str] = field(default_factory=list)
    # Used by a separate management / metrics listener (reference §1.1); CA files are under tlsCaPath.
    management_tls_ca_file: list[str] = field(default_factory=lambda: ["management_ca.pem"])
    management_tls_cert: str = "security/certs/management/server.pem"
    management_tls_pk: str = "security/keys/management/server.key.pem"
    management_tls_pk_pwd: str = ""
    management_tls_crl_path: str = ""
    management_tls_crl_files: list[str] = field(default_factory=list)
    metrics_tls_ca_file: list[str] = field(default_factory=lambda: ["metrics_ca.pem"])
    metrics_tls_cert: str = "security/certs/metrics/server.pem"
    metrics_tls_pk: str = "security/keys/metrics/server.key.pem"
    metrics_tls_pk_pwd: str = ""
    metrics_tls_crl_path: str = ""
    metrics_tls_crl_files: list[str] = field(default_factory=list)
    infer_mode: Literal["standard", "dmi"] = "standard"
    open_ai_support: str = "vllm"
    token_timeout: Annotated[int, Meta(ge=1, le=3600)] = 600
    e2e_timeout: Annotated[int, Meta(ge=1, le=65535)] = 600
    max_request_length: Annotated[int, Meta(ge=1, le=100)] = 40
    dist_dp_server_enabled: bool = False
    health_check_config: HealthCheckConfig = field(
        default_factory=HealthCheckConfig, name="HealthCheckConfig"
    )

    @property
    def management_ip(self) -> str:
        return os.environ.get("MIES_CONTAINER_MANAGEMENT_IP") or self.management_ip_address or self.ip_address

    @property
    def management_listen_port(self) -> int:
        return self.management_port if self.management_port is not None else self.port


class ModelConfig(Struct, kw_only=True):
    """One element of ModelDeployConfig.ModelConfig (reference §1.4)."""

    model_instance_type: Literal["Standard", "StandardMock", "TargetModel", "AssistantModel"] = "Standard"
    model_name: Annotated[str, Meta(pattern=r"^[A-Za-z0-9](?:[A-Za-z0-9._-]{0,254}[A-Za-z0-9])?\Z")]
    model_weight_path: Annotated[str, Meta(min_length=1)]
    world_size: Annotated[int, Meta(ge=1)] = 1
    cpu_mem_size: U32 = 0
    npu_mem_size: Annotated[int, Meta(ge=-1, le=2147483647)] = -1
    backend_type: Literal["atb", "torch", "ms"] = "torch"
    trust_remote_code: bool = False


class LoraModule(Struct, kw_only=True):
    """One element of ModelDeployConfig.LoraModules: an adapter loaded at start (reference §1.4)."""

    name: Annotated[str, Meta(pattern=r"^[a-zA-Z0-9_-]{1,256}\Z")]
    path: Annotated[str, Meta(min_length=1)]
    """the PEFT adapter folder; relative to the config file's folder, as modelWeightPath."""
    base_model_name: str = ""
    """must be the served modelName; empty = that model."""


class ModelDeployConfig(Struct, kw_only=True):
    """BackendConfig.ModelDeployConfig (reference §1.4)."""

    max_seq_len: Annotated[int, Meta(ge=1)] = 2560
    max_input_token_len: Annotated[int, Meta(ge=1, le=4194304)] = 2048
    truncation: int | bool = 0
    max_loras: Annotated[int, Meta(ge=0, le=1024)] = 8
    """LoRA adapters an engine holds at once (loaded ones and ones still unloading); 0 = none."""
    max_lora_rank: Annotated[int, Meta(ge=1, le=1024)] = 64
    """the largest adapter rank a load accepts."""
    lora_modules: list[LoraModule] = field(default_factory=list, name="LoraModules")
    model_config: Annotated[list[ModelConfig], Meta(min_length=1)] = field(name="ModelConfig")

    @property
    def effective_max_input_len(self) -> int:
        return min(self.max_input_token_len, self.max_seq_len - 1)

    @property
    def truncates_left(self) -> bool:
        """truncation 1: keep the last tokens (true and -1 keep the first)."""
        return type(self.truncation) is int and self.truncation == 1

    @property
    def truncates(self) -> bool:
        """-1/true truncate; 0/false refuse over-long prompts (1 = left, kept as truncate)."""
        return self.truncation is True or (type(self.truncation) is int and self.truncation != 0)


class ScheduleConfig(Struct, kw_only=True):
    """BackendConfig.ScheduleConfig (reference §1.5)."""

    template_type: Literal["Standard", "Mix"] = "Standard"
    template_name: Literal["Standard_LLM"] = "Standard_LLM"
    cache_block_size: Annotated[int, Meta(ge=1, le=128)] = 128
    max_prefill_batch_size: Annotated[int, Meta(ge=0)] = 50
    max_prefill_tokens: Annotated[int, Meta(ge=1, le=4194304)] = 8192
    prefill_time_ms_per_req: Annotated[int, Meta(ge=0, le=1000)] = 150
    prefill_policy_type: Literal[0] = 0
    decode_time_ms_per_req: Annotated[int, Meta(ge=0, le=1000)] = 50
    decode_policy_type: Literal[0] = 0
    max_batch_size: Annotated[int, Meta(ge=1, le=5000)] = 200
    max_iter_times: Annotated[int, Meta(ge=1)] = 512
    max_preempt_count: U32 = 0
    support_select_batch: bool = False
    max_queue_delay_microseconds: Annotated[int, Meta(ge=500, le=1000000)] = 5000
    max_first_token_wait_time: Annotated[int, Meta(ge=0, le=3600000)] = 2500
    max_n: Annotated[int, Meta(ge=1, le=8192)] = 128
    prefill_chunk_size: Annotated[int, Meta(ge=1, le=4194304)] = 512
    """templateType Mix: prompt tokens computed per step beside the decoding sequences' tokens."""
    enable_prefix_cache: bool = False
    """reuse the KV cache of prompt prefixes (whole blocks) computed for earlier requests."""

    @property
    def prefill_batch_size(self) -> int:
        return self.max_prefill_batch_size or self.max_batch_size


class BackendConfig(Struct, kw_only=True):
    """BackendConfig (reference §1.3)."""

    backend_name: str = "mindieservice_llm_engine"
    model_instance_number: Annotated[int, Meta(ge=1, le=10)] = 1
    npu_device_ids: list[list[int]] = field(default_factory=lambda: [[0]])
    tokenizer_process_number: Annotated[int, Meta(ge=1, le=32)] = 1
    model_deploy_config: ModelDeployConfig = field(name="ModelDeployConfig")
    schedule_config: ScheduleConfig = field(default_factory=ScheduleConfig, name="ScheduleConfig")


class Config(msgspec.Struct, kw_only=True):
    version: Literal["1.0.0"] = field(default="1.0.0", name="Version")
    server: ServerConfig = field(default_factory=ServerConfig, name="ServerConfig")
    backend: BackendConfig = field(name="BackendConfig")
    switchboard: SwitchboardConfig = field(default_factory=SwitchboardConfig, name="Switchboard")
    source_dir: str = field(default=".", name="_sourceDir")

    @property
    def model(self) -> ModelConfig:
        return self.backend.model_deploy_config.model_config[0]

    @property
    def deploy(self) -> ModelDeployConfig:
        return self.backend.model_deploy_config

    @property
    def schedule(self) -> ScheduleConfig:
        return self.backend.schedule_config

    def resolve_path(self, path: str) -> Path:
        """A path from the file, absolute or relative to the config file's folder."""
        p = Path(os.path.expanduser(path))
        return p if p.is_absolute() else (Path(self.source_dir) / p).resolve()

    @property
    def model_path(self) -> Path:
        return self.resolve_path(self.model.model_weight_path)


def load_config(path: str | os.PathLike) -> Config:
    """Read, decode and validate config.json; raise ConfigError naming the key on failure."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {p}: {exc.strerror}") from None
    if not 0 < len(raw) <= MAX_CONFIG_BYTES:
        raise ConfigError(f"config file {p} must be between 1 byte and 10 MB, got {len(raw)} bytes")
    return parse_config(raw, source_dir=str(p.resolve().parent))


def parse_config(raw: bytes, source_dir: str = ".") -> Config:
    raw = raw.removeprefix(UTF8_BOM)  # (an editor's byte-order mark: MindIE's JSON reader skips it too)
    try:
        cfg = msgspec.json.decode(raw, type=Config)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"invalid config: {_readable(str(exc))}") from None
    except msgspec.DecodeError as exc:
        raise ConfigError(f"config is not valid JSON: {exc}") from None
    cfg.source_dir = source_dir
    _check_cross_keys(cfg)
    return cfg


UTF8_BOM = b"\xef\xbb\xbf"


def _readable(msg: str) -> str:
    """msgspec says "... - at `$.ServerConfig.port`"; say the key path first, then the allowed range."""
    if " - at `$." not in msg:
        return msg
    text, where = msg.split(" - at `$.", 1)
    path = where.rstrip("`")
    if text.startswith("Object contains unknown field `"):
        key = text.split("`")[1]
        return f"{path}.{key}: not a key of the {path} section (its keys: {', '.join(_keys(path))})"
    if path in PATTERN_HINTS and "matching regex" in text:
        return f"{path}: {PATTERN_HINTS[path]}"
    allowed = _allowed(path)
    return f"{path}: {text}" + (f" (allowed: {allowed})" if allowed else "")


PATTERN_HINTS = {  # what a key's pattern means, said instead of the regex
    "Switchboard.natsUrl": 'must be "" (the launcher starts an embedded nats-server) or one NATS URL: nats://, '
                           "tls://, ws:// or wss:// and a host",
}


def _keys(path: str) -> list[str]:
    """The keys the section at ``path`` takes."""
    info = msgspec.inspect.type_info(Config)
    for part in path.split("."):
        info = {f.encode_name: unwrap(f.type) for f in unwrap(info).fields}[part]
    return sorted(f.encode_name for f in info.fields)


def _allowed(path: str) -> str:
    """The range or choices of the key at ``path`` (e.g. "[1024, 65535]"), from the type's constraints."""
    info = msgspec.inspect.type_info(Config)
    for part in path.replace("[", ".[").split("."):
        if part.startswith("["):
            info = getattr(info, "item_type", info)
            continue
        info = unwrap(info)
        fields = {f.encode_name: f.type for f in getattr(info, "fields", ())}
        if part not in fields:
            return ""
        info = fields[part]
    return _describe(unwrap(info))


def unwrap(info):
    if isinstance(info, msgspec.inspect.UnionType):
        return next((t for t in info.types if not isinstance(t, msgspec.inspect.NoneType)), info)
    return info


def _describe(info) -> str:
    if isinstance(info, msgspec.inspect.LiteralType):
        return " | ".join(repr(v) for v in info.values)
    ge, gt, le, lt = (getattr(info, bound, None) for bound in ("ge", "gt", "le", "lt"))
    if ge is None and gt is None and le is None and lt is None:
        return ""
    low = f"[{ge}" if ge is not None else f"({gt}" if gt is not None else "(-inf"
    high = f"{le}]" if le is not None else f"{lt})" if lt is not None else "inf)"
    return f"{low}, {high}"


def _check_cross_keys(cfg: Config) -> None:
    s, d, sc = cfg.server, cfg.deploy, cfg.schedule
    for key, ip in (("ServerConfig.ipAddress", s.ip_address), ("ServerConfig.managementIpAddress", s.management_ip_address)):
        if ip is None:
            continue
        try:
            addr = ipaddress.ip_address(ip)
        except ValueError:
            raise ConfigError(f"{key}: expected an IPv4 or IPv6 address, got {ip!r}") from None
        if addr.is_unspecified and not s.allow_all_zero_ip_listening:
            raise ConfigError(f"{key}: {ip} listens on all addresses; set ServerConfig.allowAllZeroIpListening to true to allow it")
    if sc.max_prefill_batch_size > sc.max_batch_size:
        raise ConfigError(
            f"BackendConfig.ScheduleConfig.maxPrefillBatchSize: must be in [0, maxBatchSize={sc.max_batch_size}], got {sc.max_prefill_batch_size}"
        )
    if sc.max_prefill_tokens < d.max_input_token_len:
        raise ConfigError(
            "BackendConfig.ScheduleConfig.maxPrefillTokens: must be >= "
            f"ModelDeployConfig.maxInputTokenLen ({d.max_input_token_len}), got {sc.max_prefill_tokens}"
        )
    if d.max_seq_len < 2:
        raise ConfigError(f"BackendConfig.ModelDeployConfig.maxSeqLen: must be >= 2, got {d.max_seq_len}")
    _check_schedule_bounds(cfg)
    _check_lora_modules(cfg)
    _check_media(cfg.switchboard)
    if isinstance(d.truncation, int) and not isinstance(d.truncation, bool) and d.truncation not in (-1, 0, 1):
        raise ConfigError(f"BackendConfig.ModelDeployConfig.truncation: must be -1, 0, 1, true or false, got {d.truncation}")


def _check_schedule_bounds(cfg: Config) -> None:
    """The ranges the reference gives in terms of other keys (§1.4, §1.5), and one model per deployment."""
    d, sc, models = cfg.deploy, cfg.schedule, cfg.deploy.model_config
    if len(models) > 1:
        raise ConfigError(f"BackendConfig.ModelDeployConfig.ModelConfig[1]: a deployment serves one model "
                          f"(ModelConfig holds one element), got {len(models)}")
    if sc.max_preempt_count > sc.max_batch_size:
        raise ConfigError(f"BackendConfig.ScheduleConfig.maxPreemptCount: must be in [0, maxBatchSize="
                          f"{sc.max_batch_size}], got {sc.max_preempt_count}")
    if sc.max_iter_times > d.max_seq_len:
        raise ConfigError(f"BackendConfig.ScheduleConfig.maxIterTimes: must be in [1, ModelDeployConfig.maxSeqLen="
                          f"{d.max_seq_len}], got {sc.max_iter_times}")
    if cfg.model.npu_mem_size == 0:
        raise ConfigError("BackendConfig.ModelDeployConfig.ModelConfig[0].npuMemSize: must be -1 (automatic) or in "
                          "(0, 2147483647], got 0")


def _check_lora_modules(cfg: Config) -> None:
    d, key = cfg.deploy, "BackendConfig.ModelDeployConfig.LoraModules"
    if len(d.lora_modules) > d.max_loras:
        raise ConfigError(f"{key}: {len(d.lora_modules)} adapters, more than maxLoras ({d.max_loras})")
    seen: set[str] = set()
    for i, module in enumerate(d.lora_modules):
        if module.base_model_name and module.base_model_name != cfg.model.model_name:
            raise ConfigError(f"{key}[{i}].baseModelName: must be the modelName {cfg.model.model_name!r}, "
                              f"got {module.base_model_name!r}")
        if module.name == "None":  # (the load route refuses it too)
            raise ConfigError(f"{key}[{i}].name: 'None' is the name TGI's adapter_id and vLLM's model use for no "
                              "adapter; name it otherwise")
        if module.name in seen or module.name == cfg.model.model_name:
            raise ConfigError(f"{key}[{i}].name: {module.name!r} is already the name of "
                              + ("another adapter" if module.name in seen else "the model"))
        seen.add(module.name)


def _check_media(s: SwitchboardConfig) -> None:
    for i, entry in enumerate(s.allowed_media_domains):
        try:
            normalize_domain(entry)
        except ValueError as exc:
            raise ConfigError(f"Switchboard.allowedMediaDomains[{i}]: {exc}") from None
    try:
        private_networks(s.allow_private_media_addresses)
    except ValueError as exc:
        raise ConfigError(f"Switchboard.allowPrivateMediaAddresses{exc}") from None
    if s.media_request_timeout_seconds < s.media_fetch_timeout_seconds:
        raise ConfigError("Switchboard.mediaRequestTimeoutSeconds: must be >= mediaFetchTimeoutSeconds "
                          f"({s.media_fetch_timeout_seconds}), got {s.media_request_timeout_seconds}")
