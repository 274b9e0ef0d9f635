"""Triton server, model and slot information (reference §3.5, §3.19-§3.21): fixed shapes from the config."""

from __future__ import annotations

from typing import Any

from shared.config import Config
from shared.messages import EngineInfo

SERVER_NAME = "MindIE Server"


def server_metadata(cfg: Config) -> dict[str, Any]:
    sc = cfg.schedule
    return {
        "name": SERVER_NAME,
        "version": cfg.version,
        "extensions": {
            "max_iter_times": sc.max_iter_times,
            "prefill_policy_type": sc.prefill_policy_type,
            "decode_policy_type": sc.decode_policy_type,
            "max_prefill_batch_size": sc.max_prefill_batch_size or sc.max_batch_size,
            "max_prefill_tokens": sc.max_prefill_tokens,
        },
    }


def model_metadata(model: str) -> dict[str, Any]:
    return {
        "name": model,
        "platform": SERVER_NAME,
        "inputs": [{"name": "input0", "shape": [-1], "datatype": "UINT32"}],
        "outputs": [{"name": "output0", "shape": [-1], "datatype": "UINT32"}],
    }


def model_config(cfg: Config) -> dict[str, Any]:
    """The datatypes are the documented ones (V2C-300: "INT64"); ``/infer`` itself takes UINT32 ids."""
    model = cfg.model
    return {
        "model_name": model.model_name,
        "input_datatype": "INT64",
        "output_datatype": "INT64",
        "max_seq_len": cfg.deploy.max_seq_len,
        "npu_mem_size": model.npu_mem_size or -1,
        "cpu_mem_size": model.cpu_mem_size,
        "world_size": model.world_size,
        "model_weight_path": _last_part(model.model_weight_path),
        "model_instance_type": model.model_instance_type,
    }


def slot_count(cfg: Config, engine: EngineInfo) -> dict[str, int]:
    """getSlotCount (reference §3.5) of ``engine``: every live engine combined (``Gateway.engine_info``), so
    slots and KV tokens are sums over the engines."""
    return {
        "total_slots": engine.max_batch_size,
        "free_slots": max(0, engine.free_slots),
        "available_tokens_length": engine.free_blocks * cfg.schedule.cache_block_size,
    }


def _last_part(path: str) -> str:
    return path.rstrip("/\\").replace("\\", "/").rsplit("/", 1)[-1]
