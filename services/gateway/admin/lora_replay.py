"""The fleet's adapter set given again to an engine that came back without it.

Engines follow each other's adapter set (a newer ``adapters_version`` in a peer's heartbeat), so a restarted
engine of several gets the runtime loads and unloads from the others. One that has no peer with the set (the
only engine, restarted by its supervisor; or every engine restarted) came back with its ``LoraModules`` only:
the adapters loaded at runtime were gone and those unloaded were back, and clients naming them got 404s. Each
gateway keeps the newest set the engines' heartbeats showed, and when a live engine reports an older version
while no live engine has the set, it sends that engine the loads and unloads that make it the set, at the
set's version (the engine's own lock takes them one at a time; a second gateway's are answered "already").

Until it is given back (a second or two once an engine is live: the adapters' weights are read) the set's
adapters stay servable here: they are listed, and a request naming one waits (``restored``) until an engine
lists it, or is a 503 while no engine is live, instead of a 404 that a client takes for the adapter's removal.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Awaitable, Callable

from shared.lora import Outcome
from shared.messages import EngineInfo, LoraCommand, LoraReply

if TYPE_CHECKING:
    from shared.leases import Leases

log = logging.getLogger("switchboard.gateway")
Ask = Callable[[str, LoraCommand], Awaitable["LoraReply | None"]]  # (engine instance, command) -> its reply
RESTORE_WAIT_S = 30.0  # the longest a request waits for an adapter being given back
GRACE_S = 1.0  # after the last replay: its engine's heartbeat listing the adapters may be on its way
POLL_S = 0.05


class AdapterSet:
    def __init__(self, engines: Leases[EngineInfo], ask: Ask, spawn: Callable[[Awaitable], asyncio.Task]):
        self.engines, self.ask, self.spawn = engines, ask, spawn
        self.version = 0
        self.adapters: dict[str, str] = {}  # name -> path, as of ``version``
        self.given: dict[str, int] = {}  # engine instance -> the set version it was given (once each)
        self.replays = 0  # given back now
        self.replayed_at = -GRACE_S  # monotonic time the last one ended

    def heard(self, info: EngineInfo) -> None:
        """An engine's heartbeat: a newer set is remembered; an engine behind it, with no peer to follow, is
        given it."""
        if info.adapters_version > self.version:
            self.version, self.adapters = info.adapters_version, {a.name: a.path for a in info.adapters}
            return
        if info.adapters_version == self.version or self.given.get(info.instance, -1) >= self.version:
            return
        live = self.engines.live()
        if any(e.adapters_version >= self.version for e in live.values()):
            return  # a peer has the set: the engine follows it
        if len(self.given) > 64:  # (departed engines are forgotten)
            self.given = {i: v for i, v in self.given.items() if i in live}
        self.given[info.instance] = self.version
        self.replays += 1
        self.spawn(self._replay(info))

    def restoring(self) -> dict[str, str]:
        """The set's adapters (name -> path) while no engine is live (a request naming one is then a 503, not a
        404: the engines that come back are given the set), while it is given back, and a moment after; else
        none."""
        if self.version and (not self.engines.live() or self.replays or time.monotonic() - self.replayed_at < GRACE_S):
            return dict(self.adapters)
        return {}

    async def restored(self, names: set[str], listed: Callable[[], set[str]]) -> None:
        """Wait until every adapter of ``names`` that is being given back is listed by a live engine (``listed``),
        the giving back ended, or RESTORE_WAIT_S passed; what then is still not listed is the request's 404."""
        deadline = time.monotonic() + RESTORE_WAIT_S
        while (names & self.restoring().keys()) - listed() and time.monotonic() < deadline:
            await asyncio.sleep(POLL_S)

    async def _replay(self, info: EngineInfo) -> None:
        try:
            await self._give(info)
        finally:
            self.replays -= 1
            self.replayed_at = time.monotonic()

    async def _give(self, info: EngineInfo) -> None:
        version, wanted = self.version, dict(self.adapters)
        held = {a.name for a in info.adapters}
        commands = [LoraCommand("unload", name, version=version) for name in sorted(held - wanted.keys())]
        commands += [LoraCommand("load", name, wanted[name], version=version) for name in sorted(wanted.keys() - held)]
        for command in commands:  # (none: the same adapters, only the version behind; once per engine)
            reply = await self.ask(info.instance, command)
            if reply is not None and not Outcome(reply.outcome).ok:
                log.warning("an engine could not take the fleet's adapter back", extra={
                    "engine": info.instance, "op": command.op, "adapter": command.name, "why": reply.message})
        log.info("adapter set given again", extra={"engine": info.instance, "version": version,
                                                   "adapters": sorted(wanted)})
