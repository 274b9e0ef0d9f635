"""The gateway's shared state: the bus connection, mailboxes, readiness probes, metrics emission."""

from __future__ import annotations

import asyncio
import logging
import uuid

import msgspec
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from services.gateway.admin import lora_engines
from services.gateway.admin.lora_replay import AdapterSet
from services.gateway.common.served import Served
from services.gateway.pd.dresult import DResults
from services.gateway.pd.roles import Roles
from services.gateway.request.context import SessionContext
from services.gateway.request.failover import Failover
from services.gateway.request.inflight import InFlight
from services.gateway.request.mailbox import Mailboxes
from services.gateway.request.slots import Slots
from shared import bus, subjects
from shared.config import Config
from shared.engines import adapter_names, combined
from shared.errors import ErrorKind, SwitchboardError, validation
from shared.leases import Leases
from shared.media import MediaPolicy
from shared.response_store import ResponseStore
from shared.messages import (
    Cancel,
    CancelKind,
    Detokenize,
    Detokenized,
    EngineInfo,
    LoraCommand,
    LoraReply,
    Ping,
    StopInfer,
    Tokenize,
    Tokenized,
    TokenizerInfo,
    decoder,
    encode,
)
from shared.metrics_messages import MetricsEvent

log = logging.getLogger("switchboard.gateway")
PROBE_TIMEOUT_S = 1.0
STOP_INFER_TIMEOUT_S = 0.5  # how long other gateways get to claim a stopInfer id


class Gateway:
    def __init__(self, cfg: Config, nc):
        self.cfg = cfg
        self.nc = nc
        self.model = cfg.model.model_name
        self.instance = uuid.uuid4().hex[:12]  # this gateway's id: in its heartbeats and its requests
        self.mailboxes = Mailboxes(nc)
        self._tasks: set[asyncio.Task] = set()
        self.engines: Leases[EngineInfo] = Leases(cfg.switchboard.lease_seconds)  # engines by instance
        self._heartbeats = decoder(EngineInfo)
        self._stops = decoder(StopInfer)
        self.inflight = InFlight()  # every in-flight Session (the stop drain waits on it; stopInfer finds by it)
        self.stopping = False  # set by /stopService: new inference is refused
        self.stop_scope = ""  # then: "deployment" (MindIE's stop: everything goes) or "instance" (this gateway)
        sb = cfg.switchboard
        self.roles = Roles(cfg, nc, self.instance, lambda: self.stopping,  # PD role (/v1/role), peers, gateways heard
                           lambda: len(self.inflight))
        self.failover = Failover(nc, self.model, sb.lease_seconds, sb.heartbeat_s, self.engines, self.inflight,
                                 self.roles.heartbeat)
        self.dresults = DResults(nc, self.instance, self.roles, sb.heartbeat_s, sb.lease_seconds)  # decode role
        self.responses = ResponseStore(nc, sb.responses_ttl_seconds, sb.responses_max_mb << 20,  # /v1/responses
                                       replicas=sb.responses_replicas)
        self.slots = Slots(cfg.server.max_link_num)  # maxLinkNum in progress, 2 x maxLinkNum waiting (§2.2)
        self.lora_lock = asyncio.Lock()  # this gateway's LoRA loads and unloads, one at a time
        self.lora_version = 0  # the newest adapter-set version this gateway sent
        self.adapter_set = AdapterSet(self.engines, self._ask_engine, self.spawn)  # given again to a bare engine
        self.media_policy = MediaPolicy.from_config(cfg)  # what list-form media items may name (shared.media)
        self.context = SessionContext(
            nc=nc, model=self.model, instance=self.instance, mailboxes=self.mailboxes, slots=self.slots,
            inflight=self.inflight, failover=self.failover, roles=self.roles, admit=self.require_engine,
            restored=self.restored,
            engine_info=self.engine_info, emit=self.emit, spawn=self.spawn, heartbeat_s=sb.heartbeat_s,
            token_timeout_s=float(cfg.server.token_timeout) + 5.0, resume_timeout_s=max(3.0, 2 * sb.lease_seconds),
            media_timeout_s=float(sb.media_request_timeout_seconds), keep_alive_s=sb.stream_keep_alive_seconds)

    async def start(self) -> None:
        await self.mailboxes.start()
        await bus.subscribe(self.nc, subjects.engine_heartbeat(self.model), self.on_heartbeat)
        await bus.subscribe(self.nc, subjects.STOP_INFER, self.on_stop_infer)
        await bus.subscribe(self.nc, subjects.STOPPING, self.on_stopping)
        await self.roles.start()
        await self.dresults.start()
        await self.failover.start()
        await self.responses.open()

    # ---- in-flight requests by the id their client gave (Triton stopInfer) -------------------

    async def stop_infer(self, user_id: str) -> bool:
        """End the request ``user_id`` on whichever gateway runs it; False when none does."""
        if await self._stop_local(user_id):
            return True
        try:
            await self.nc.request(subjects.STOP_INFER, encode(StopInfer(user_id)), timeout=STOP_INFER_TIMEOUT_S)
            return True
        except (NatsTimeout, NoRespondersError, asyncio.TimeoutError):
            return False

    async def on_stop_infer(self, msg) -> None:
        if await self._stop_local(self._stops.decode(msg.data).user_id):
            await msg.respond(b"")

    async def _stop_local(self, user_id: str) -> bool:
        sessions = self.inflight.by_user(user_id)
        for session in sessions:
            await bus.publish(self.nc, subjects.CANCEL, Cancel(id=session.current_id, reason=CancelKind.STOP_INFER))
        return bool(sessions)

    async def on_stopping(self, _msg) -> None:
        """A gateway's /stopService began the deployment's stop: new inference is refused here too and the status
        routes say so (a load balancer takes this gateway out), while the requests in flight here finish."""
        self.stopping, self.stop_scope = True, "deployment"

    async def on_heartbeat(self, msg) -> None:
        info = self._heartbeats.decode(msg.data)
        self.engines.expire()  # forget the departed, so the table holds only engines heard within a lease
        self.engines.beat(info.instance, info)
        self.adapter_set.heard(info)

    async def _ask_engine(self, instance: str, command: LoraCommand) -> LoraReply | None:
        return await lora_engines.ask_one(self, instance, command, lora_engines.ENGINE_TIMEOUT_S)

    def live_engines(self) -> dict[str, EngineInfo]:
        """Every engine heard within its lease, by instance id (an engine whose lease ran out is gone at once)."""
        return self.engines.live()

    def role_engines(self) -> dict[str, EngineInfo]:
        """The live engines behind this server's PD role (dmi: prefill or decode engines, and co-located
        ones); every live engine otherwise. What /v1/status, /v2/status and /metrics-json report."""
        role = self.roles.role
        engines = self.live_engines()
        if not self.roles.dmi or role not in ("prefill", "decode"):
            return engines
        return {i: e for i, e in engines.items() if e.role in (role, "both")}

    def serving_engines(self) -> dict[str, EngineInfo]:
        """The live engines that take new requests (not draining)."""
        return self.failover.serving_engines()

    def adapter_names(self) -> set[str]:
        """The LoRA adapters that at least one live engine has loaded and takes requests for."""
        return set().union(*map(adapter_names, self.live_engines().values()))

    def adapter_paths(self) -> dict[str, str]:
        """The LoRA adapters a request may name, name -> path: those a live engine lists, and the fleet's set
        while it is given back to engines that came back without it (``AdapterSet.restoring``)."""
        listed = {a.name: a.path for e in self.live_engines().values() for a in e.adapters}
        return {**self.adapter_set.restoring(), **listed}

    async def restored(self, names: set[str]) -> None:
        """Hold a request naming adapters being given back until a live engine lists them (bounded)."""
        await self.adapter_set.restored(names, self.adapter_names)

    def modalities(self) -> frozenset[str]:
        """Media kinds the served model takes besides text, as live engines say; none for a text model."""
        return frozenset().union(*(e.modalities for e in self.live_engines().values()))

    @property
    def pd_split(self) -> bool:
        """PD split mode (``inferMode`` "dmi", or a prefill/decode role): LoRA adapters are refused."""
        return self.roles.dmi or self.roles.role in ("prefill", "decode")

    def served(self) -> Served:
        """The names a request may run under now: the model and every adapter a live engine holds (or is given
        back)."""
        return Served(self.model, frozenset(self.adapter_paths()), self.pd_split)

    def engine_info(self) -> EngineInfo | None:
        """All live engines as one (``shared.engines.combined``: loads and capacities summed), or None when
        no engine is live."""
        return combined(self.live_engines().values())

    def refuse_stopped(self) -> None:
        """After /stopService the status routes answer 503 "The service has been stopped." (reference §2.3)."""
        if self.stopping:
            raise SwitchboardError(ErrorKind.UNAVAILABLE, "The service has been stopped.")

    def require_engine(self) -> None:
        """Refuse new inference at once (503) while stopping or when no engine or tokenizer is live."""
        if self.stopping:
            raise SwitchboardError(ErrorKind.UNAVAILABLE, "The service has been stopped")
        self.failover.require_serving()

    def emit(self, event: MetricsEvent) -> None:
        """Fire-and-forget a lifecycle event to the metrics service."""
        self.spawn(bus.publish(self.nc, subjects.METRICS_EVENTS, event))

    def spawn(self, work) -> asyncio.Task:
        """Run a coroutine in the background, keeping a reference until it is done."""
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def tokenizer_info(self) -> TokenizerInfo | None:
        return await self._probe(subjects.TOKENIZER_HEALTH, TokenizerInfo)

    async def tokenize(self, request: Tokenize) -> Tokenized:
        """The tokens of a text as a completion request encodes it, or of a conversation as a chat request
        renders it (/v1/tokenizer, /tokenize, count_tokens); a conversation the template refuses is a 400/422."""
        reply = await self._probe(subjects.TOKENIZER_TOKENIZE, Tokenized, request, timeout=30.0)
        if reply is None:
            raise SwitchboardError(ErrorKind.UNAVAILABLE, "the tokenizer service did not answer")
        if reply.error:
            raise validation(reply.error)
        return reply

    async def detokenize(self, ids: list[int]) -> str:
        """The text of token ids (/detokenize); an id outside the vocabulary is a validation error."""
        reply = await self._probe(subjects.TOKENIZER_DETOKENIZE, Detokenized, Detokenize(ids=ids), timeout=30.0)
        if reply is None:
            raise SwitchboardError(ErrorKind.UNAVAILABLE, "the tokenizer service did not answer")
        if reply.error:
            raise validation(reply.error, "tokens")
        return reply.text

    async def is_ready(self) -> bool:
        """Ready when a request would be taken: a loaded engine and a tokenizer heard (by the heartbeats that
        ``require_engine`` goes by: a gateway started a moment ago has heard none yet) and answering."""
        if self.stopping:
            return False
        loaded = any(e.loaded for e in self.serving_engines().values())
        return loaded and self.failover.tokenizer_live() and await self.tokenizer_info() is not None

    async def _probe(self, subject: str, reply_type, message=None, timeout: float = PROBE_TIMEOUT_S):
        try:
            return await bus.request(self.nc, subject, message or Ping(), reply_type, timeout=timeout)
        except (NatsTimeout, NoRespondersError, msgspec.DecodeError, asyncio.TimeoutError):
            return None
