"""What a request needs of its gateway, and nothing more: one frozen ``SessionContext`` per gateway.

Calls and sessions hold this instead of the whole gateway, so what they can reach is named here: the
bus, the mailboxes their events come to, the slots they are admitted by, the in-flight registry, the
failover watch (which tokenizer to ask, whether anything serves), the PD roles (MindIE's coordinator
mode), metrics emission, and the timeouts. Nothing here calls back into the gateway object."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Awaitable, Callable

if TYPE_CHECKING:
    from nats.aio.client import Client

    from services.gateway.pd.roles import Roles
    from services.gateway.request.failover import Failover
    from services.gateway.request.inflight import InFlight
    from services.gateway.request.mailbox import Mailboxes
    from services.gateway.request.slots import Slots
    from shared.messages import EngineInfo
    from shared.metrics_messages import MetricsEvent


@dataclass(frozen=True)
class SessionContext:
    nc: Client
    model: str
    instance: str  # this gateway's id: in its requests (tokenizers cancel a dead gateway's)
    mailboxes: Mailboxes
    slots: Slots
    inflight: InFlight
    failover: Failover
    roles: Roles
    admit: Callable[[], None]  # raises 503 while stopping or while no engine or tokenizer serves
    restored: Callable[[set[str]], Awaitable[None]]  # waits while named LoRA adapters are given back to engines
    engine_info: Callable[[], EngineInfo | None]  # every live engine as one (Triton's batch_size)
    emit: Callable[[MetricsEvent], None]  # fire-and-forget a lifecycle event to the metrics service
    spawn: Callable[[Awaitable], asyncio.Task]  # run a coroutine in the background
    heartbeat_s: float
    token_timeout_s: float  # tokenTimeout: the longest wait for a request's next token
    resume_timeout_s: float  # how long a resumed attempt waits for a tokenizer's answer
    media_timeout_s: float = 0.0  # Switchboard.mediaRequestTimeoutSeconds: a tokenizer's longest media preparation
    keep_alive_s: float = 15.0  # Switchboard.streamKeepAliveSeconds: a stream's longest silence (0 = no keep-alives)
