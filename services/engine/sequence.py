"""One request inside the engine: its tokens, its blocks, its scheduling state.

Sampling keeps no state here: each draw is seeded from (seed, len(token_ids)) by the sampler.
token_ids only ever grow, so hashes of its full blocks, once computed, stay valid. (A step launched ahead
appends a placeholder that its token replaces when read back, and a sequence that ends drops the one a newer
step appended: ``ahead.py``. Blocks are hashed only once every token in them is known.)
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from shared.messages import EngineRequest, MediaInputs, Sampling

if TYPE_CHECKING:  # annotations only: the engine's feature modules import this one
    from llguidance import LLMatcher

    from services.engine.kv_transfer import KvImport
    from services.engine.lora import Slot
    from services.engine.multimodal import MediaRows

_counter = itertools.count()


class Status(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


@dataclass(eq=False)
class Sequence:
    id: str
    prompt_ids: list[int]
    sampling: Sampling
    priority: int = 3
    deadline: float | None = None
    deadline_reason: str = "server e2eTimeout"
    last_event_at: float = 0.0  # receipt, then each new token: tokenTimeout counts from here
    arrival: float = 0.0  # unix time the gateway received it (0: unknown)
    scheduled_at: float | None = None  # first time it ran (queue time = scheduled_at - arrival)
    token_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0  # leading token_ids whose K/V are in block_table's blocks
    cached_tokens: int | None = None  # prompt tokens its first allocation found in the prefix cache
    block_hashes: list[bytes] = field(default_factory=list, repr=False)  # prefix-cache keys of its first full blocks
    status: Status = Status.WAITING
    num_preemptions: int = 0
    passed_over: int = 0  # Mix steps in a row it could have prefilled in but others went first (prefillOrder)
    order: int = field(default_factory=lambda: next(_counter))
    lora: Slot | None = None  # the LoRA adapter's Slot it runs with (held until it finishes); None = base model
    media: MediaInputs | None = None  # MediaInputs until encoded, then dropped: ``media_rows`` keeps the features
    media_rows: MediaRows | None = None  # features for its media tokens (kept for recompute)
    more_salt: bytes = b""  # its client's cache_salt: prefix-cache keys of such requests are their own
    media_from: int = -1  # the block holding its first media token, whose key's parent its media's salt joins
    media_salt: bytes = b""
    handoff: bool = False  # prefill role: after its first token its K/V go to a decode engine
    request: EngineRequest | None = None  # the EngineRequest it came as, kept only while it may be handed off (what the handoff sends on)
    kv_import: KvImport | None = None  # K/V received for its prompt, written when it gets blocks
    matcher: LLMatcher | None = None  # structured output: its llguidance matcher (engine/grammar.py); None = free
    wants_prompt_logprobs: bool = False  # computes its prompt's logprobs (new requests that asked; no prefix hits)
    prompt_logprobs: dict = field(default_factory=dict)  # prompt position -> TokenLogprob, as prefill chunks run
    held_ids: tuple[int, ...] = ()  # min_tokens: the ids that would end it (EOS, stop ids), not sampled before then

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_ids)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - len(self.prompt_ids)

    @property
    def num_uncomputed(self) -> int:
        """Tokens the model has still to compute: 1 while decoding, more while prefilling."""
        return len(self.token_ids) - self.num_computed

    @property
    def is_prefilling(self) -> bool:
        return self.num_uncomputed > 1

    @property
    def cache_salt(self) -> bytes:
        """The first block's hash parent: K/V computed with an adapter are that adapter's (load's) own, and K/V
        of a request with a client's cache_salt are shared only with requests giving that salt. (K/V from a
        prompt's first media token on are those media's own: ``media_from``.)"""
        return (self.lora.uid if self.lora is not None else b"") + self.more_salt

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]

    @property
    def sort_key(self) -> tuple[int, int]:
        """Waiting-queue order: priority 1 first, FIFO within a level."""
        return (self.priority, self.order)

    def append(self, token_id: int) -> None:
        self.token_ids.append(token_id)
