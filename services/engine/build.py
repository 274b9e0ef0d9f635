"""Building the engine from config.json: the device, the model and its KV cache (and the prefix cache's host
tier), the LoRA modules it starts with, the scheduler's limits and the model's end tokens."""

from __future__ import annotations

import torch

from services.engine.devices import kv_budget_bytes, resolve_device
from services.engine.engine import Engine
from services.engine.graphs import GraphPlan
from services.engine.model_runner import ModelRunner
from services.engine.scheduler import Limits
from shared.config import Config, ConfigError


def build_engine(cfg: Config) -> tuple[Engine, str]:
    """Load the model named by the config and size the KV cache; returns (engine, device label)."""
    if cfg.switchboard.torch_threads:
        torch.set_num_threads(cfg.switchboard.torch_threads)
    device = resolve_device(cfg.switchboard.device, cfg.switchboard.dtype)
    check_host_tier(cfg, device.kind)
    sc, deploy = cfg.schedule, cfg.deploy
    blocks_per_seq = -(-deploy.max_seq_len // sc.cache_block_size)
    sb = cfg.switchboard
    runner = ModelRunner(
        str(cfg.model_path),
        device,
        block_size=sc.cache_block_size,
        # on an accelerator: its free memory once the weights are loaded
        kv_budget_bytes=lambda: kv_budget_bytes(device, sb.kv_cache_memory_mb, cfg.model.npu_mem_size),
        max_blocks=sc.max_batch_size * blocks_per_seq,
        batch_hint=sc.max_batch_size,
        cpu_kernels=sb.cpu_kernels if device.kind == "cpu" else sb.gpu_kernels,
        graphs=graph_plan(cfg) if device.kind == "cuda" and sb.cuda_graphs else None,
        max_loras=deploy.max_loras,
        max_lora_rank=deploy.max_lora_rank,
        quantization=sb.quantization,
        kv_cache_dtype=sb.kv_cache_dtype,
    )
    check_pool_holds_a_sequence(runner, cfg, device.kind)
    load_lora_modules(runner, cfg)
    limits = Limits(sc.max_batch_size, sc.prefill_batch_size, sc.max_prefill_tokens, deploy.max_seq_len,
                    token_timeout_s=float(cfg.server.token_timeout), max_preempt_count=sc.max_preempt_count,
                    max_queue_delay_s=sc.max_queue_delay_microseconds / 1e6,
                    prefill_chunk_size=sc.prefill_chunk_size, mix=sc.template_type == "Mix",
                    prefill_order=sb.prefill_order)
    return Engine(runner, limits, eos_token_ids(runner), prefix_cache=sc.enable_prefix_cache,
                  host_blocks=host_blocks(runner, cfg), steps_ahead=sb.async_scheduling), device.kind


def graph_plan(cfg: Config) -> GraphPlan:
    """Decode graphs up to maxBatchSize rows; step graphs up to the most tokens a step holds (Mix: a prompt
    chunk beside a token per decoding sequence; otherwise maxPrefillTokens)."""
    sc = cfg.schedule
    tokens = sc.prefill_chunk_size + sc.max_batch_size if sc.template_type == "Mix" else sc.max_prefill_tokens
    return GraphPlan(sc.max_batch_size, cfg.deploy.max_seq_len, max_tokens=tokens)


def check_pool_holds_a_sequence(runner: ModelRunner, cfg: Config, device_kind: str) -> None:
    """A K/V pool smaller than one sequence of maxSeqLen tokens would refuse long requests one by one, forever:
    refused at start, as vLLM refuses a max_model_len its cache cannot hold."""
    held, longest = runner.num_blocks * runner.block_size, cfg.deploy.max_seq_len
    if held < longest:
        budget = ("Switchboard.kvCacheMemoryMb" if device_kind == "cpu"
                  else "ModelConfig[0].npuMemSize (or the device's free memory)")
        raise ConfigError(f"BackendConfig.ModelDeployConfig.maxSeqLen: {longest} tokens do not fit the K/V cache, "
                          f"which holds {held} tokens ({runner.num_blocks} blocks of {runner.block_size}); raise "
                          f"{budget} or lower maxSeqLen")


def host_blocks(runner: ModelRunner, cfg: Config) -> int:
    """The blocks of the host tier (``Switchboard.hostKvCacheMemoryMb``); a budget that holds none is refused."""
    mb = cfg.switchboard.host_kv_cache_memory_mb
    blocks = mb * 1024 * 1024 // runner.block_bytes
    if mb and not blocks:
        raise ValueError(f"Switchboard.hostKvCacheMemoryMb: {mb} MiB holds no K/V block of this model "
                         f"({runner.block_bytes} bytes); raise it, or set 0 for no host tier")
    return blocks


def check_host_tier(cfg: Config, device_kind: str) -> None:
    """Refuse a host tier where it cannot work, before the model loads."""
    mb = cfg.switchboard.host_kv_cache_memory_mb
    if mb and device_kind == "cpu":
        raise ConfigError("Switchboard.hostKvCacheMemoryMb: the engine runs on cpu, whose K/V cache is host memory "
                         "already (one tier); give the memory to Switchboard.kvCacheMemoryMb instead")
    if mb and not cfg.schedule.enable_prefix_cache:
        raise ValueError("Switchboard.hostKvCacheMemoryMb: the host tier holds the prefix cache's evicted blocks; "
                         "set BackendConfig.ScheduleConfig.enablePrefixCache to true, or hostKvCacheMemoryMb to 0")


def load_lora_modules(runner: ModelRunner, cfg: Config) -> None:
    """The adapters of ``LoraModules``: a start-up failure names the adapter and why."""
    for i, module in enumerate(cfg.deploy.lora_modules):
        reply = runner.lora.load(module.name, str(cfg.resolve_path(module.path)))
        if not reply.outcome.ok:
            raise ConfigError(f"BackendConfig.ModelDeployConfig.LoraModules[{i}] ({module.name}): {reply.message}")


def eos_token_ids(runner: ModelRunner) -> set[int]:
    ids: set[int] = set()
    for source in (runner.config, getattr(runner.model, "generation_config", None)):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(value)
    return ids
