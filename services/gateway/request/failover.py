"""The gateway's watch over the instances its requests depend on.

Every request has one owner at each step: the gateway's session owns it end to end (its client is
here), and for each attempt a tokenizer and an engine serve it (named in ``Started``). Four times
per lease this watch publishes the gateway's own heartbeat (tokenizers cancel the requests of a dead
gateway) and asks a session to resume when the tokenizer or engine of its attempt is no longer live,
or when the gateway's NATS connection came back (messages in flight may have been lost; resuming from
the delivered position repairs that, and positions drop whatever arrives twice).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import TYPE_CHECKING, Callable, Iterable

from shared import bus, subjects
from shared.errors import ErrorKind, SwitchboardError
from shared.leases import Leases
from shared.messages import EngineInfo, Heartbeat, decoder

if TYPE_CHECKING:
    from nats.aio.client import Client

    from services.gateway.request.session import Session

log = logging.getLogger("switchboard.gateway")


class Failover:
    """``engines`` is the gateway's lease table of engines; ``sessions`` its in-flight registry;
    ``heartbeat`` makes the gateway's own heartbeat (its PD role and whether it is stopping)."""

    def __init__(self, nc: Client, model: str, lease_s: float, heartbeat_s: float, engines: Leases[EngineInfo],
                 sessions: Iterable[Session], heartbeat: Callable[[], Heartbeat]):
        self.nc, self.model, self.lease_s, self.heartbeat_s = nc, model, lease_s, heartbeat_s
        self.engines, self.sessions, self.heartbeat = engines, sessions, heartbeat
        self.tokenizers: Leases[Heartbeat] = Leases(lease_s)
        self.beats = decoder(Heartbeat)
        self.reconnects = 0
        self.tokenizer_deaths = 0  # leases run out so far: a request published meanwhile may be lost with one
        self.reconnected_at = -1e9  # monotonic time the bus came back (leases may have run out meanwhile)
        self._watch: asyncio.Task | None = None

    async def start(self) -> None:
        await bus.subscribe(self.nc, subjects.heartbeat("tokenizer"), self.on_tokenizer_heartbeat)
        self._watch = asyncio.ensure_future(self.run())

    async def on_tokenizer_heartbeat(self, msg) -> None:
        beat = self.beats.decode(msg.data)
        if beat.model in ("", self.model):
            self.tokenizers.beat(beat.instance, beat)

    def tokenizer_live(self) -> bool:
        return bool(self.tokenizers.live())

    def serving_engines(self) -> dict[str, EngineInfo]:
        """The live engines that take new requests (not draining)."""
        return {i: e for i, e in self.engines.live().items() if not e.stopping}

    def heard(self) -> bool:
        """An engine (draining ones too: they finish what they took) and a tokenizer are live."""
        return bool(self.engines.live()) and self.tokenizer_live()

    def require_serving(self, context: str = "") -> None:
        """503 unless a live engine and a live tokenizer can take the request (``context`` prefixes the message)."""
        prefix = f"{context} " if context else ""
        cut_off = "" if self.nc.is_connected else " (this gateway cannot reach the message bus)"
        if not self.serving_engines():
            raise SwitchboardError(ErrorKind.UNAVAILABLE, f"{prefix}no engine is serving model {self.model}{cut_off}")
        if not self.tokenizer_live():
            raise SwitchboardError(ErrorKind.UNAVAILABLE,
                                   f"{prefix}no tokenizer is serving model {self.model}{cut_off}")

    def bus_epoch(self) -> int:
        """How many times the gateway's bus connection has come back so far."""
        return self.nc.stats.get("reconnects", 0)

    def lost_in_outage(self, epoch: int) -> bool:
        """A message published at bus epoch ``epoch`` may be lost (sent on a dead connection, or buffered while a
        tokenizer had not subscribed again): the bus came back since, and a tokenizer has been heard since then,
        so its subscriptions are back and asking again reaches it."""
        return self.reconnects > epoch and self.tokenizers.heard_since(self.reconnected_at)

    def tokenizer_subject(self) -> str:
        """Where a retried or resumed request goes: a live tokenizer's own subject (the queue group could hand
        it to a member that is connected but dead, e.g. frozen), else the queue group."""
        live = list(self.tokenizers.live())
        return subjects.tokenizer_instance(random.choice(live)) if live else subjects.TOKENIZER_GENERATE

    async def run(self) -> None:
        while not self.nc.is_closed:
            try:
                await bus.publish(self.nc, subjects.heartbeat("gateway"), self.heartbeat())
                self.check()
            except Exception:  # noqa: BLE001 - the watch must outlive any one failure
                log.exception("failover watch failed")
            await asyncio.sleep(self.heartbeat_s)

    def check(self) -> None:
        """Ask each in-flight session whose owners died (or whose messages may be lost) to resume."""
        reconnects = self.nc.stats.get("reconnects", 0)
        reconnected, self.reconnects = reconnects != self.reconnects, reconnects
        if reconnected:
            self.reconnected_at = time.monotonic()
        self.tokenizer_deaths += len(self.tokenizers.expire())
        for session in self.sessions:
            reason = "the message bus reconnected" if reconnected else self.dead_owner(session)
            if reason:
                session.ask_resume(reason)

    async def wait_serving(self, context: str) -> None:
        """Raise 503 unless a live engine and tokenizer can take a resumed request within a lease: an instance
        whose lease just ran out may only be late (an engine on an overloaded machine), and one restarted by its
        supervisor may come up meanwhile. Right after the bus came back, every lease may have run out during
        the outage: the instances get two leases from then to be heard again."""
        deadline = max(time.monotonic() + self.lease_s, self.reconnected_at + 2 * self.lease_s)
        while not self.nc.is_closed:
            try:
                return self.require_serving(context)
            except SwitchboardError:
                if time.monotonic() >= deadline:
                    raise
            await asyncio.sleep(0.05)

    def dead_owner(self, session: Session) -> str | None:
        """Why the session's attempt is lost, if its tokenizer or engine is gone (one this gateway has not
        heard yet, e.g. an engine that just started, is given a lease from when the attempt was answered)."""
        tokenizer, engine = session.owners
        gone = [f"tokenizer {tokenizer}"] if tokenizer and self.tokenizers.is_gone(tokenizer, session.owned_since) else []
        if engine and self.engines.is_gone(engine, session.owned_since):
            gone.append(f"engine {engine}")
        if not gone:
            return None
        if not self.nc.is_connected:  # their silence may be the bus's: nobody can be heard
            return f"the message bus is unreachable: {' and '.join(gone)} went silent"
        return f"{gone[0]} died"
