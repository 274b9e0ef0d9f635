"""A LoRA load or unload across the engines: ask each at once, combine their outcomes into one answer,
undo a load that did not succeed everywhere, and wait until the heartbeats show the change.

A load goes to every serving engine, an unload to every live one (a draining engine still holds its
adapters). Each command carries the adapter set's next version: one more than the newest any live
engine reports or this gateway sent. One gateway runs its LoRA commands one at a time.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import msgspec
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from shared import bus, subjects, telemetry
from shared.engines import adapter_names
from shared.lora import Outcome, message
from shared.messages import EngineInfo, LoraCommand, LoraReply

if TYPE_CHECKING:
    from services.gateway.core import Gateway

log = logging.getLogger("switchboard.gateway")
ENGINE_TIMEOUT_S = 120.0  # loading reads the adapter's weights: well under a second for usual ranks
UNDO_TIMEOUT_S = 10.0
POLL_S = 0.05
FAILED = "Call to load LoRA method failed: "


@dataclass(frozen=True)
class Answer:
    """What the client gets: a status and MindIE's plain text."""

    status: int
    text: str


@dataclass(frozen=True)
class Verdict:
    answer: Answer
    undo: tuple[str, ...] = ()  # engines to unload from: the load did not succeed everywhere
    settle: tuple[str, ...] = ()  # engines whose heartbeats must show the change before the answer


# ---- combining the engines' replies (pure) ----------------------------------------------------------


def outcome(reply: LoraReply | None) -> Outcome | None:
    """None for an engine that did not answer; an answer this gateway cannot read counts as invalid."""
    if reply is None:
        return None
    try:
        return Outcome(reply.outcome)
    except ValueError:
        return Outcome.INVALID


def _first(replies: dict[str, LoraReply | None], wanted: Callable[[Outcome], bool]) -> LoraReply | None:
    """The reply of the first engine (by instance id) whose outcome ``wanted`` accepts."""
    for _, reply in sorted(replies.items()):
        kind = outcome(reply)
        if kind is not None and wanted(kind):
            return reply
    return None


def silence(engines: list[str], gone: frozenset[str], timeout_s: float) -> str:
    """Why engines gave no answer: gone (no longer on the bus: it died, and its lease has not run out yet) or
    silent for ``timeout_s``."""
    said = [f"engine {', '.join(e)} {why}" for e, why in (
        ([e for e in engines if e in gone], "is gone (it died or stopped)"),
        ([e for e in engines if e not in gone], f"did not answer within {timeout_s:g} s")) if e]
    return "; ".join(said)


def combine_load(name: str, replies: dict[str, LoraReply | None], held: set[str],
                 timeout_s: float = ENGINE_TIMEOUT_S, gone: frozenset[str] = frozenset()) -> Verdict:
    """One answer for a load from every engine's reply; ``held``: engines that listed the adapter before.

    A failure (first by instance id) wins, then silence (503), then "waiting to unload": each undoes the
    load on the engines that added it and on silent ones that did not hold it (they may add it late).
    Otherwise added, when any engine added it, else already added."""
    added = {i for i, r in replies.items() if outcome(r) is Outcome.ADDED}
    silent = sorted(i for i, r in replies.items() if r is None)
    undo = tuple(sorted(added | (set(silent) - held)))
    failure = _first(replies, lambda o: not o.ok and o is not Outcome.WAITING)
    if failure is not None:
        return Verdict(Answer(200, failure.message), undo)
    if silent:
        text = f"{FAILED}{silence(silent, gone, timeout_s)}; LoRA adapter '{name}' was not loaded."
        return Verdict(Answer(503, text), undo)
    waiting = _first(replies, lambda o: o is Outcome.WAITING)
    if waiting is not None:
        return Verdict(Answer(200, waiting.message), undo)
    done = Outcome.ADDED if added else Outcome.ALREADY
    return Verdict(Answer(200, message(done, name)), settle=tuple(sorted(replies)))


def combine_unload(name: str, replies: dict[str, LoraReply | None], timeout_s: float = ENGINE_TIMEOUT_S,
                   gone: frozenset[str] = frozenset()) -> Verdict:
    """Removed when any engine removed it, else cannot be found; silent engines are ignored unless all are."""
    if all(r is None for r in replies.values()):
        why = silence(sorted(replies), gone, timeout_s)
        return Verdict(Answer(503, f"no engine answered the unload of LoRA adapter '{name}': {why}"))
    if _first(replies, lambda o: o is Outcome.REMOVED) is not None:
        return Verdict(Answer(200, message(Outcome.REMOVED, name)), settle=tuple(sorted(replies)))
    return Verdict(Answer(200, message(Outcome.MISSING, name)))


def shows(command: LoraCommand, instances: tuple[str, ...], engines: dict[str, EngineInfo]) -> bool:
    """Whether the heartbeats show the change: a loaded adapter listed by each of ``instances`` still live,
    an unloaded one listed by no live engine."""
    if command.op == "load":
        return all(command.name in adapter_names(engines[i]) for i in instances if i in engines)
    return not any(command.name in adapter_names(e) for e in engines.values())


# ---- talking to the engines -------------------------------------------------------------------------


async def ask(gateway: Gateway, instances: list[str], command: LoraCommand,
              timeout_s: float) -> tuple[dict[str, LoraReply | None], frozenset[str]]:
    """Every engine's reply at once (None for one that did not answer in time, or is gone), and the gone ones."""
    answers = await asyncio.gather(*(_request(gateway, i, command, timeout_s) for i in instances))
    replies = {i: reply for i, (reply, _) in zip(instances, answers)}
    return replies, frozenset(i for i, (_, gone) in zip(instances, answers) if gone)


async def ask_one(gateway: Gateway, instance: str, command: LoraCommand, timeout_s: float) -> LoraReply | None:
    return (await _request(gateway, instance, command, timeout_s))[0]


async def _request(gateway: Gateway, instance: str, command: LoraCommand,
                   timeout_s: float) -> tuple[LoraReply | None, bool]:
    """The engine's reply, or None and whether it is gone (nothing listens on its subject: NATS says so at once)."""
    subject = subjects.engine_lora(gateway.model, instance)
    try:
        return await bus.request(gateway.nc, subject, command, LoraReply, timeout=timeout_s), False
    except (NatsTimeout, NoRespondersError, asyncio.TimeoutError, msgspec.DecodeError) as exc:
        log.warning("engine did not answer a LoRA command", extra={"engine": instance, "op": command.op,
                                                                  "adapter": command.name, "error": repr(exc)})
        return None, isinstance(exc, NoRespondersError)


def next_version(gateway: Gateway) -> int:
    """One more than the newest adapter-set version any live engine reports or this gateway sent."""
    newest = max([gateway.lora_version, *(e.adapters_version for e in gateway.live_engines().values())])
    gateway.lora_version = newest + 1
    return gateway.lora_version


async def _undo(gateway: Gateway, name: str, instances: tuple[str, ...]) -> None:
    if instances:
        command = LoraCommand(op="unload", name=name, version=next_version(gateway))
        await ask(gateway, list(instances), command, UNDO_TIMEOUT_S)


async def _settle(gateway: Gateway, command: LoraCommand, instances: tuple[str, ...]) -> None:
    """Wait (a lease at most) until the heartbeats show the change, so the next request sees it."""
    if not instances:
        return
    deadline = time.monotonic() + gateway.cfg.switchboard.lease_seconds
    while not shows(command, instances, gateway.live_engines()):
        if time.monotonic() > deadline:
            log.warning("heartbeats did not show a LoRA change in time", extra={"op": command.op,
                                                                                "adapter": command.name})
            return
        await asyncio.sleep(POLL_S)


def _targets(gateway: Gateway, op: str) -> dict[str, EngineInfo]:
    return gateway.serving_engines() if op == "load" else gateway.live_engines()


async def run(gateway: Gateway, command: LoraCommand) -> Answer:
    """Load or unload on every engine and the one answer for the client. Shielded: a client that goes
    away mid-way does not cut a change short between engines (the undo of a failed load, the wait for
    the heartbeats); the change completes and only its answer is lost."""
    return await asyncio.shield(gateway.spawn(_run(gateway, command)))


async def _run(gateway: Gateway, command: LoraCommand) -> Answer:
    async with gateway.lora_lock:
        if gateway.stopping:
            return Answer(503, "The service has been stopped.")
        engines = _targets(gateway, command.op)
        if not engines:
            return Answer(503, f"no engine is serving model {gateway.model}")
        span = telemetry.start_span("gateway.lora", None, **{"switchboard.adapter": command.name,
                                                             "switchboard.lora_op": command.op})
        answer = Answer(500, "Server internal error")
        try:
            answer = await _apply(gateway, engines, msgspec.structs.replace(command, trace=telemetry.inject(span)))
            return answer
        finally:
            telemetry.end_span(span, None if answer.status == 200 else answer.text)


async def _apply(gateway: Gateway, engines: dict[str, EngineInfo], command: LoraCommand) -> Answer:
    command = msgspec.structs.replace(command, version=next_version(gateway))
    replies, gone = await ask(gateway, sorted(engines), command, ENGINE_TIMEOUT_S)
    if command.op == "load":
        held = {i for i, e in engines.items() if command.name in adapter_names(e)}
        verdict = combine_load(command.name, replies, held, gone=gone)
    else:
        verdict = combine_unload(command.name, replies, gone=gone)
    await _undo(gateway, command.name, verdict.undo)
    await _settle(gateway, command, verdict.settle)
    return verdict.answer
