"""How many of each service ``switchboard serve`` starts, and what each engine is given.

``BackendConfig.modelInstanceNumber`` engines and ``BackendConfig.tokenizerProcessNumber`` tokenizers, one
metrics service, one gateway. With several of a kind each child is named ``engine-0``, ``engine-1`` … (in
its log lines' ``service`` field and in the launcher's death reports); a lone one keeps the service's name.

Each engine gets its share of the machine through flags of ``switchboard engine``:

- ``--torch-threads N`` (cpu and auto): with several engines and ``Switchboard.torchThreads`` 0, each gets
  ``max(1, cores // engines)`` intra-op threads, so the engines do not fight over cores; a set
  ``torchThreads`` is each engine's own count. A lone engine keeps torch's default.
- ``--device-index I`` (cuda, npu, and auto when ``npuDeviceIds`` has an entry per engine): engine *i* runs on
  the first device of ``npuDeviceIds[i]``, a logical id as MindIE numbers it (counted within an existing
  ``CUDA_VISIBLE_DEVICES`` / ``ASCEND_RT_VISIBLE_DEVICES``). The engine process then sees that device only
  (``pin_device``), so its ``cuda`` / ``npu`` is that one; one engine uses one device (no tensor parallelism).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import MutableMapping

from shared.config import Config, ConfigError

VISIBLE_DEVICES = ("CUDA_VISIBLE_DEVICES", "ASCEND_RT_VISIBLE_DEVICES")


@dataclass(frozen=True)
class Replica:
    service: str  # metrics | tokenizer | engine | gateway
    name: str  # the child's name in logs and death reports
    flags: tuple[str, ...] = ()  # extra flags of `switchboard <service>`


def replicas(cfg: Config, cores: int | None = None) -> list[Replica]:
    """Every child of ``switchboard serve``, in start order; ConfigError when npuDeviceIds is too short."""
    engines = cfg.backend.model_instance_number
    devices = device_indexes(cfg, engines)
    threads = thread_share(cfg, engines, cores or available_cores())
    return [
        Replica("metrics", "metrics"),
        *numbered("tokenizer", cfg.backend.tokenizer_process_number),
        *(Replica("engine", name, engine_flags(threads, device))
          for (_, name), device in zip(names("engine", engines), devices)),
        Replica("gateway", "gateway"),
    ]


def names(service: str, count: int) -> list[tuple[str, str]]:
    """(service, name) for ``count`` children: the service's name when alone, else numbered from 0."""
    if count == 1:
        return [(service, service)]
    return [(service, f"{service}-{i}") for i in range(count)]


def numbered(service: str, count: int) -> list[Replica]:
    return [Replica(service, name) for service, name in names(service, count)]


def engine_flags(threads: int | None, device: int | None) -> tuple[str, ...]:
    flags: list[str] = []
    if threads is not None:
        flags += ["--torch-threads", str(threads)]
    if device is not None:
        flags += ["--device-index", str(device)]
    return tuple(flags)


def thread_share(cfg: Config, engines: int, cores: int) -> int | None:
    """Each engine's torch threads when several engines share the cpu; None: leave the config's (or torch's)."""
    if engines == 1 or cfg.switchboard.device not in ("cpu", "auto") or cfg.switchboard.torch_threads:
        return None
    return max(1, cores // engines)


def device_indexes(cfg: Config, engines: int) -> list[int | None]:
    """Engine i's logical device id (the first of ``npuDeviceIds[i]``), or None each where none is chosen."""
    device = cfg.switchboard.device
    ids = cfg.backend.npu_device_ids
    if device == "cpu" or (device == "auto" and len(ids) < engines):
        return [None] * engines
    if len(ids) < engines or not all(ids[:engines]):
        raise ConfigError(f"BackendConfig.npuDeviceIds: modelInstanceNumber={engines} engines on {device} need one "
                          f"non-empty list of device ids each, got {ids}")
    return [group[0] for group in ids[:engines]]


def available_cores() -> int:
    """The cores this process may run on (its affinity: a container's cpuset), else every core."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def pin_device(index: int, environ: MutableMapping[str, str] = os.environ) -> None:
    """Let this process see logical device ``index`` only (before torch initialises cuda or npu): numbered
    within what ``CUDA_VISIBLE_DEVICES`` / ``ASCEND_RT_VISIBLE_DEVICES`` already show, as MindIE's ids are."""
    for var in VISIBLE_DEVICES:
        visible = [d.strip() for d in environ[var].split(",")] if environ.get(var) else None
        if visible is not None and index >= len(visible):
            raise ConfigError(f"device index {index}: {var}={environ[var]} shows only {len(visible)} device(s)")
        environ[var] = visible[index] if visible is not None else str(index)
