"""Messages of the fleet-wide prefix cache: what each engine's cache holds, for the tokenizers' routers
(``CacheEvents`` on ``subjects.engine_cache``, a digest on request), and K/V blocks one engine pulls from
another's cache (``KvFetch`` answered by ``KvBlocks``). Keys are ``shared.prefix_hash`` block keys."""

from __future__ import annotations

from typing import Any

import msgspec


class CacheEvents(msgspec.Struct, omit_defaults=True):
    """Engine -> every router: keys that entered (``stored``) and left (``removed``) its prefix cache since
    its last CacheEvents, numbered by ``seq`` (1, 2, ... per engine) so a lost one is noticed. As a digest
    (``digest``: the answer to a CacheSync), ``stored`` is every key it holds as of ``seq``."""

    instance: str
    seq: int
    stored: list[bytes] = []
    removed: list[bytes] = []
    digest: bool = False


class CacheSync(msgspec.Struct, omit_defaults=True):
    """Router -> one engine (request/reply on ``subjects.engine_cache_sync``): send your digest."""

    router: str = ""


class KvFetch(msgspec.Struct, omit_defaults=True):
    """Engine -> the engine holding a prefix (request/reply on ``subjects.engine_kv_fetch``): the K/V of the
    blocks keyed ``keys`` (a chain's consecutive keys), as many leading ones as it holds."""

    keys: list[bytes]
    layout: list[Any] = []  # the asker's kv_transfer.KvLayout fields: a holder with another layout sends none


class KvBlocks(msgspec.Struct, omit_defaults=True):
    """The answer to a KvFetch: one chunk per leading key held (kv_transfer's per-block bytes)."""

    chunks: list[bytes] = []
    error: str = ""
