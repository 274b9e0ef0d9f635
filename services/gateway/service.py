"""The gateway service: connect to NATS, serve every listener with uvicorn until stopped."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl

import uvicorn

from services.gateway.core import Gateway
from services.gateway.web.app import listeners
from services.gateway.web.slowloris import ClientLimits, protocol_class, tls_protocols
from services.gateway.web.tls import server_contexts
from shared import bus
from shared.config import Config
from shared.listen import check_free

log = logging.getLogger("switchboard.gateway")


async def serve(cfg: Config, nats_url: str, stop: asyncio.Event, ready=lambda: None) -> None:
    contexts = server_contexts(cfg)  # plane -> SSLContext with httpsEnabled, else {}
    check_free(cfg)  # a port in use: one line naming its key (the runner's exit 2), before joining the bus
    nc = await bus.connect(nats_url, "switchboard-gateway", stop)
    gateway = Gateway(cfg, nc)
    await gateway.start()
    limits = ClientLimits.from_config(cfg)
    grace_s = cfg.switchboard.shutdown_grace_seconds
    servers = [_server(listener, contexts.get(listener.planes[0]), limits, grace_s) for listener in listeners(gateway)]
    tasks = [asyncio.create_task(s.serve()) for s in servers]
    stopper = asyncio.create_task(stop.wait())
    announcer = asyncio.create_task(_announce_when_started(gateway, servers, ready))
    try:
        done, _ = await asyncio.wait([*tasks, stopper], return_when=asyncio.FIRST_COMPLETED)
        for task in done & set(tasks):
            task.result()  # a listener that could not start raises here
            raise RuntimeError("a listener stopped unexpectedly")
    finally:
        for server in servers:
            server.should_exit = True
        cutter = asyncio.create_task(_cut_at_grace(gateway, grace_s))
        await asyncio.gather(*tasks, return_exceptions=True)
        cutter.cancel()
        stopper.cancel()
        announcer.cancel()
        await bus.close(nc)


async def _announce_when_started(gateway: Gateway, servers: list[uvicorn.Server], ready) -> None:
    """Ready once every listener is up and an engine's and a tokenizer's heartbeats have been heard."""
    while not all(s.started for s in servers) or not gateway.live_engines() or not gateway.failover.tokenizer_live():
        await asyncio.sleep(0.02)
    ready()


CUT_MARGIN_S = 0.5  # before uvicorn cancels the handlers still running at the grace's end


async def _cut_at_grace(gateway: Gateway, grace_s: float) -> None:
    """Just before the shutdown grace ends, the requests still running end with their family's 503 (uvicorn's
    cancellation would answer a plain-text 500, or cut a stream without its error event)."""
    await asyncio.sleep(max(0.0, grace_s - CUT_MARGIN_S))
    why = (f"the server is shutting down: the request was still running at the end of "
           f"Switchboard.shutdownGraceSeconds ({grace_s:g} s)")
    for session in gateway.inflight:
        session.cut(why)


def _server(listener, ssl_context: ssl.SSLContext | None, limits: ClientLimits, grace_s: float) -> uvicorn.Server:
    """One listener's uvicorn, its h11 protocol bounding slow clients and open connections; stopped, it takes no
    new connections and gives the requests in flight ``grace_s`` to finish (Switchboard.shutdownGraceSeconds)."""
    protocol = protocol_class(limits)
    config = uvicorn.Config(
        listener.app, host=listener.host, port=listener.port, log_level="warning", access_log=False,
        lifespan="off", timeout_keep_alive=60, timeout_graceful_shutdown=grace_s,
        http=tls_protocols(protocol, ssl_context) if ssl_context else protocol,
    )
    server = uvicorn.Server(config)
    server.capture_signals = contextlib.nullcontext  # the service runner owns signals
    return server
