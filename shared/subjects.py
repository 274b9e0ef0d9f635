"""Every NATS subject and queue group name, in one place."""

from __future__ import annotations

PREFIX = "sb"

TOKENIZER_GENERATE = f"{PREFIX}.tokenizer.generate"  # gateway -> tokenizer (queue group)
TOKENIZER_HEALTH = f"{PREFIX}.tokenizer.health"  # request/reply (queue group)
TOKENIZER_TOKENIZE = f"{PREFIX}.tokenizer.tokenize"  # request/reply (queue group)
TOKENIZER_DETOKENIZE = f"{PREFIX}.tokenizer.detokenize"  # request/reply (queue group)
TOKENIZER_QUEUE = "tokenizer"

CANCEL = f"{PREFIX}.cancel"  # fan-out: every engine and tokenizer hears it
SHUTDOWN = f"{PREFIX}.control.shutdown"  # fan-out: every service stops (GET /stopService)
STOPPING = f"{PREFIX}.control.stopping"  # fan-out: a deployment's stop began: every gateway refuses new inference
STOP_INFER = f"{PREFIX}.stopinfer"  # request to every gateway: the one running the named request answers
METRICS_EVENTS = f"{PREFIX}.metrics.events"  # lifecycle events -> metrics
METRICS_SNAPSHOT = f"{PREFIX}.metrics.snapshot"  # request/reply
METRICS_PROMETHEUS = f"{PREFIX}.metrics.prometheus"  # request/reply: Prometheus text
METRICS_QUEUE = "metrics"


def engine_generate(model: str) -> str:
    """tokenizer -> engine, queue group per model."""
    return f"{PREFIX}.engine.{model}.generate"


def engine_health(model: str) -> str:
    return f"{PREFIX}.engine.{model}.health"


def engine_heartbeat(model: str) -> str:
    return f"{PREFIX}.engine.{model}.heartbeat"


def engine_instance(model: str, instance: str) -> str:
    """tokenizer -> one engine instance, chosen by load from the engines' heartbeats."""
    return f"{PREFIX}.engine.{model}.{instance}.generate"


def engine_lora(model: str, instance: str) -> str:
    """gateway -> one engine instance: load or unload a LoRA adapter (request/reply)."""
    return f"{PREFIX}.engine.{model}.{instance}.lora"


def engine_role(model: str) -> str:
    """gateway -> every engine (fan-out): a dmi role assignment for the engines on the devices it names."""
    return f"{PREFIX}.engine.{model}.role"


def engine_kv(model: str, instance: str) -> str:
    """prefill engine -> one decode engine: a handed-off request's K/V (request/reply, part by part)."""
    return f"{PREFIX}.engine.{model}.{instance}.kv"


def engine_cache(model: str) -> str:
    """every engine -> every router (fan-out): CacheEvents, what enters and leaves its prefix cache."""
    return f"{PREFIX}.engine.{model}.cache"


def engine_cache_sync(model: str, instance: str) -> str:
    """router -> one engine: CacheSync, answered by its digest (request/reply)."""
    return f"{PREFIX}.engine.{model}.{instance}.cachesync"


def engine_kv_fetch(model: str, instance: str) -> str:
    """engine -> the engine holding a cached prefix: KvFetch, answered by KvBlocks (request/reply)."""
    return f"{PREFIX}.engine.{model}.{instance}.kvfetch"


def tokenizer_instance(instance: str) -> str:
    """gateway -> one tokenizer instance: a retried or resumed request goes to one known to be live."""
    return f"{PREFIX}.tokenizer.{instance}.generate"


def heartbeat(service: str) -> str:
    """Every instance of ``service`` (gateway, tokenizer) says it is alive here (engines: engine_heartbeat)."""
    return f"{PREFIX}.{service}.heartbeat"


def engine_queue(model: str) -> str:
    return f"engine.{model}"


def tokens_inbox(instance: str) -> str:
    """engine -> one tokenizer instance: token events of the requests it owns."""
    return f"{PREFIX}.tokens.{instance}"


def gateway_dresult(instance: str) -> str:
    """prefill gateway -> one decode gateway: PD-split results for its ``GET /dresult`` (DResultFrame)."""
    return f"{PREFIX}.dresult.{instance}"


def gateway_inbox(instance: str) -> str:
    """tokenizer -> one gateway instance; the gateway subscribes to ``<inbox>.>``."""
    return f"{PREFIX}.gw.{instance}"
