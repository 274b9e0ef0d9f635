"""The engine service's side of LoRA across the fleet: commands from gateways, and following peers.

A gateway sends each load or unload to every live engine (``subjects.engine_lora``) with the adapter
set's next version. Each engine says its set and version in its heartbeats, so a gateway serves an
adapter while some live engine lists it, and the tokenizers route its requests only to those.

An engine that missed a change (it started later, restarted, or was busy) hears a peer's heartbeat
with a newer version and makes its own set equal to that peer's: it loads what it lacks (from the
path the peer loaded it from) and unloads what the peer no longer has. Until it has loaded an adapter
it does not list it, so it takes no request for it. Each newer version is followed once: an adapter
this engine cannot load (a path missing on its machine) is not retried at every heartbeat.

Every load and unload runs on the engine's stepper thread, between steps (the model's tensors are
only ever touched there).
"""

from __future__ import annotations

import asyncio
import logging

from nats.aio.msg import Msg as NatsMsg

from services.engine.lora import Reply
from shared import bus, subjects, telemetry
from shared.messages import EngineInfo, LoraCommand, LoraReply, decoder

log = logging.getLogger("switchboard.engine")


class AdapterControl:
    def __init__(self, nc, model: str, instance: str, lora, stepper, announce):
        self.nc = nc
        self.announce = announce  # coroutine function: publish this engine's heartbeat now
        self.model, self.instance = model, instance
        self.lora = lora  # the runner's LoraSet
        self.stepper = stepper
        self.lock = asyncio.Lock()  # one change at a time
        self.followed = 0  # the newest peer version this engine has tried to follow
        self.following: set[asyncio.Task] = set()  # referenced until done (the loop keeps only weak ones)
        self.commands = decoder(LoraCommand)
        self.beats = decoder(EngineInfo)

    async def start(self) -> None:
        await bus.subscribe(self.nc, subjects.engine_lora(self.model, self.instance), self.on_command)
        await bus.subscribe(self.nc, subjects.engine_heartbeat(self.model), self.on_peer)

    async def on_command(self, msg: NatsMsg) -> None:
        cmd = self.commands.decode(msg.data)
        span = telemetry.start_span(f"engine.lora.{cmd.op}", cmd.trace, **{"switchboard.adapter": cmd.name})
        async with self.lock:
            reply = await self._apply(cmd.op, cmd.name, cmd.path)
            self.lora.version = max(self.lora.version, cmd.version)
        await self.announce()  # gateways and tokenizers see the new set without waiting for the next beat
        telemetry.end_span(span, None if reply.outcome.ok else reply.message)
        await bus.respond(msg, LoraReply(outcome=reply.outcome.value, message=reply.message))

    async def on_peer(self, msg: NatsMsg) -> None:
        info = self.beats.decode(msg.data)
        if info.instance == self.instance or info.adapters_version <= max(self.lora.version, self.followed):
            return
        self.followed = info.adapters_version
        task = asyncio.ensure_future(self.follow(info))
        self.following.add(task)
        task.add_done_callback(self.following.discard)

    async def follow(self, peer: EngineInfo) -> None:
        """Make this engine's adapter set the peer's (a newer version of it)."""
        async with self.lock:
            if peer.adapters_version <= self.lora.version:
                return  # a command got here first
            wanted = {a.name: a.path for a in peer.adapters}
            mine = {a.name for a in self.lora.listed()}
            for name in sorted(mine - wanted.keys()):
                await self._apply("unload", name)
            for name in sorted(wanted.keys() - mine):
                reply = await self._apply("load", name, wanted[name])
                if not reply.outcome.ok:
                    log.warning("could not load a peer's adapter", extra={"adapter": name, "why": reply.message})
            self.lora.version = max(self.lora.version, peer.adapters_version)
            await self.announce()
            log.info("adapter set followed", extra={"peer": peer.instance, "version": peer.adapters_version,
                                                    "adapters": sorted(wanted)})

    async def _apply(self, op: str, name: str, path: str = "") -> Reply:
        loop = asyncio.get_running_loop()
        if op == "load":
            return await loop.run_in_executor(self.stepper, self.lora.load, name, path)
        return await loop.run_in_executor(self.stepper, self.lora.unload, name)
