"""Runs one service in this process: logging, tracing, signals, and the ready line."""

from __future__ import annotations

import asyncio
import importlib
import signal
import sys

from shared import bus, subjects
from shared.config import Config, ConfigError
from shared.logs import setup_logging
from shared.model_folder import ModelFolderError
from shared.telemetry import setup_tracing

SERVICES = ("gateway", "tokenizer", "engine", "metrics")
READY_LINE = "SWITCHBOARD-READY"
FLEET_STOP_LINE = "SWITCHBOARD-STOPPING-FOR-STOPSERVICE"  # this service stops because /stopService said so


def run_service(name: str, cfg: Config, nats_url: str, label: str | None = None) -> int:
    """Run service ``name``; ``label`` (e.g. engine-1, one of several) names it in its log lines."""
    setup_logging(label or name, cfg.switchboard.log_level)
    setup_tracing(name, cfg.switchboard.otlp_endpoint)
    _quiet_transformers()
    module = importlib.import_module(f"services.{name}.service")
    try:
        asyncio.run(_main(module.serve, cfg, nats_url))
    except ModelFolderError as exc:  # a file of the model folder the service read at start
        print(f"switchboard {label or name}: ModelConfig.modelWeightPath: {exc}", file=sys.stderr, flush=True)
        return 2
    except ConfigError as exc:  # a setting the service found it cannot run with (fp8 on cpu, an adapter, ...)
        print(f"switchboard {label or name}: {exc}", file=sys.stderr, flush=True)
        return 2
    return 0


async def _main(serve, cfg: Config, nats_url: str) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    watcher = asyncio.create_task(_stop_on_shutdown(nats_url, stop))
    try:
        await serve(cfg, nats_url, stop, announce_ready)
    except bus.Stopped:
        pass  # (SIGTERM while NATS was down: nothing was started)
    finally:
        watcher.cancel()


async def _stop_on_shutdown(nats_url: str, stop: asyncio.Event) -> None:
    """Stop this service when the gateway broadcasts the end of a /stopService drain."""
    try:
        nc = await bus.connect(nats_url, "switchboard-control", stop)
    except bus.Stopped:
        return

    async def on_shutdown(_msg) -> None:
        print(FLEET_STOP_LINE, flush=True)  # (a launcher stops the deployment; a service's own SIGTERM it restarts)
        stop.set()

    await nc.subscribe(subjects.SHUTDOWN, cb=on_shutdown)
    try:
        await stop.wait()
    finally:
        await bus.close(nc, timeout=1.0)


def announce_ready() -> None:
    """Tell a supervising launcher (which reads our stdout) that this service is serving."""
    print(READY_LINE, flush=True)


def _quiet_transformers() -> None:
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # the gateway's environment need not have transformers
        return
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


__all__ = ["run_service", "SERVICES", "READY_LINE"]
