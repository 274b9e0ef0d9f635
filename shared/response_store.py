"""Stored /v1/responses responses, in a JetStream key-value bucket of the deployment's own nats-server.

Every gateway replica sees the same bucket, and it outlives any of them (the embedded server keeps its
files in ``Switchboard.jetstreamDir``; compose's and Kubernetes' NATS run JetStream on a volume). A record is
a response object and the conversation it continues (``previous_response_id``), JSON. The bucket has a TTL
(``responsesTtlSeconds``) and a size cap (``responsesMaxMb``; the oldest records go first). Without JetStream
(a NATS server started without it) ``available`` is false: ``store: true`` is then a clear error.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
import time
from typing import Any

import msgspec
from nats.aio.client import Client
from nats.errors import Error as NatsError
from nats.js import api
from nats.js.errors import BucketNotFoundError, KeyDeletedError, KeyNotFoundError, NoKeysError
from nats.js.errors import Error as JetStreamError

from shared.errors import ErrorKind, SwitchboardError

log = logging.getLogger("switchboard.gateway")

RETRY_S = 10.0  # a bucket that could not be opened is tried again this often, when a request needs it
BUCKET = "switchboard_responses"
STREAM = f"KV_{BUCKET}"  # the key-value bucket's JetStream stream


class ResponseStore:
    def __init__(self, nc: Client, ttl_s: int, max_bytes: int, retry_s: float = RETRY_S, replicas: int = 1):
        self.nc, self.ttl_s, self.max_bytes, self.retry_s, self.replicas = nc, ttl_s, max_bytes, retry_s, replicas
        self.kv = None
        self.why = "not opened"
        self.tried_at = -math.inf  # monotonic time of the last open

    @property
    def available(self) -> bool:
        return self.kv is not None

    async def ready(self) -> bool:
        """Whether the bucket is open. One that could not be opened (JetStream not up yet as the gateway
        started, a cluster without a leader) is opened again when asked, at most every ``retry_s``: the
        gateway's first try is not its last."""
        if self.kv is None and time.monotonic() - self.tried_at >= self.retry_s:
            await self.open()
        return self.kv is not None

    async def open(self) -> None:
        """Open (or create) the bucket, with this configuration's TTL and size cap and the oldest records going
        first when it is full; without JetStream, remember why and go on."""
        self.tried_at = time.monotonic()
        js = self.nc.jetstream(timeout=5)
        try:
            try:
                self.kv = await js.key_value(BUCKET)
            except BucketNotFoundError:
                self.kv = await js.create_key_value(api.KeyValueConfig(
                    bucket=BUCKET, ttl=float(self.ttl_s), max_bytes=self.max_bytes, history=1, replicas=self.replicas,
                    description="Switchboard's stored /v1/responses"))
        except (JetStreamError, NatsError, TimeoutError, OSError) as exc:
            self.kv, self.why = None, f"the NATS server has no JetStream ({exc!r})"
            log.warning("stored responses unavailable", extra={"error": self.why})
            return
        if self.why != "not opened":
            log.info("stored responses available")
        self.why = ""
        await self._configure(js)

    async def _configure(self, js) -> None:
        """The bucket's stream as configured now: nats-py creates a key-value stream that refuses new records
        when full (DiscardPolicy.NEW: every store a 503 for good once the cap was reached), and a bucket made
        under an earlier responsesMaxMb / responsesTtlSeconds / responsesReplicas keeps its own unless they are
        updated."""
        try:
            config = (await js.stream_info(STREAM)).config
            wanted = {"discard": api.DiscardPolicy.OLD, "max_bytes": self.max_bytes, "max_age": float(self.ttl_s),
                      "num_replicas": self.replicas}
            if any(getattr(config, key) != value for key, value in wanted.items()):
                await js.update_stream(dataclasses.replace(config, **wanted))
        except (JetStreamError, NatsError, TimeoutError, OSError) as exc:
            log.warning("stored responses: the bucket's limits could not be updated", extra={"error": repr(exc)})

    async def put(self, key: str, record: dict[str, Any]) -> None:
        try:
            await self.kv.put(key, msgspec.json.encode(record))
        except (JetStreamError, NatsError, TimeoutError) as exc:
            raise unreachable(exc) from None

    async def get(self, key: str) -> dict[str, Any] | None:
        if not KEY.fullmatch(key):
            return None  # no response is stored under it (a client's id with "*", ">", a space, or empty)
        try:
            entry = await self.kv.get(key)
        except (KeyNotFoundError, KeyDeletedError, NoKeysError):
            return None
        except (JetStreamError, NatsError, TimeoutError) as exc:
            raise unreachable(exc) from None
        return msgspec.json.decode(entry.value) if entry.value else None

    async def delete(self, key: str) -> bool:
        if await self.get(key) is None:
            return False
        await self.kv.purge(key)
        return True


# A key NATS can store, matched whole: nats-py's rule (whose "$" lets a trailing newline through, into the
# subject) without empty subject tokens ("a..b")
KEY = re.compile(r"[-/_=a-zA-Z0-9]+(?:\.[-/_=a-zA-Z0-9]+)*")


def unreachable(exc: Exception) -> SwitchboardError:
    """NATS did not answer a read or write of the bucket (a reconnect, a JetStream leader change): a 503."""
    return SwitchboardError(ErrorKind.UNAVAILABLE, f"the stored responses cannot be reached now ({exc!r}); retry")
