"""The engine's LoRA adapters: which are loaded, who uses them, and their stacked weights.

The base weights are never touched. Every loaded adapter owns a range of a shared "rank space"
([offset, offset + r)), and for each decoder layer and projection the adapters' A matrices are
stacked along it (``A [R, in]``) and so are their B matrices, transposed and scaled (``Bt [R, out]``).
A step then knows, per token row, the range of its request's adapter (or none), and
``ops.lora_apply`` adds ``(x A_range^T) Bt_range`` to each row's base output: every row of a batch
with its own adapter, in one pass per projection group (as punica's BGMV kernels and S-LoRA do).
A step with no adapter row does no LoRA work at all.

Adapters that a projection lacks have zero rows there. The stacks are rebuilt when the set changes
(a load, or the end of an unload): offsets move then, and a sequence reads its adapter's offset
through its ``Slot`` at each step.

Unloading waits for the adapter's requests: ``unload`` stops new requests from taking it at once,
and its slot is freed when the last request holding it ends (``release``).
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from services.engine.lora_files import AdapterError, AdapterWeights, read_adapter, target_shapes
from shared.lora import Outcome, message
from shared.messages import Adapter

log = logging.getLogger("switchboard.engine")

# Projections that share an input, in the order their outputs sit side by side in the merged linears.
GROUPS = (("qkv", ("q_proj", "k_proj", "v_proj")), ("o", ("o_proj",)),
          ("gate_up", ("gate_proj", "up_proj")), ("down", ("down_proj",)))


@dataclass(eq=False)
class Slot:
    name: str
    weights: AdapterWeights
    offset: int = 0
    users: int = 0  # requests holding it
    unloading: bool = False
    uid: bytes = b""  # its weights' digest: the prefix-cache keys' salt, the same on every engine loading them

    def __post_init__(self):
        self.uid = self.uid or weights_digest(self.weights)

    @property
    def rank(self) -> int:
        return self.weights.rank


def weights_digest(weights: AdapterWeights) -> bytes:
    """A digest of an adapter's matrices as loaded: K/V computed with equal weights are equal, whatever the
    adapter's name or folder, on any engine; a reload of changed weights gets new keys."""
    digest = hashlib.blake2b(digest_size=16)
    for key in sorted(weights.weights):
        digest.update(repr(key).encode())
        for matrix in weights.weights[key]:
            digest.update(matrix.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return digest.digest()


@dataclass
class GroupStack:
    """One projection group's stacked adapters in one layer: ``a_parts`` [R, in] and ``bts`` [R, out_t],
    one of each per target."""

    a_parts: list[torch.Tensor]
    bts: list[torch.Tensor]


@dataclass
class Rows:
    """A step's rows' adapters: rank range [off, off + rank) of each token row; rank 0 = base model."""

    off: torch.Tensor
    rank: torch.Tensor
    _mask: torch.Tensor | None = field(default=None, repr=False)

    def mask(self, rank_space: int, dtype: torch.dtype) -> torch.Tensor:
        """[T, rank_space]: 1 where column j lies in row i's range. The PyTorch ops' form of the rows,
        built on first use and shared by every layer and projection group of the step."""
        if self._mask is None:
            cols = torch.arange(rank_space, device=self.off.device)[None]
            self._mask = ((cols >= self.off[:, None]) & (cols < (self.off + self.rank)[:, None])).to(dtype)
        return self._mask


@dataclass(frozen=True)
class Reply:
    outcome: Outcome
    message: str


class LoraSet:
    def __init__(self, config, device: torch.device, dtype: torch.dtype, max_loras: int, max_rank: int):
        self.config = config
        self.device, self.dtype = device, dtype
        self.max_loras, self.max_rank = max_loras, max_rank
        self.slots: dict[str, Slot] = {}
        self.stacks: list[dict[str, GroupStack]] = []  # per layer; empty with no adapter
        self.version = 0  # the adapter set's version (see EngineInfo.adapters_version)

    # ---- load and unload --------------------------------------------------------------------

    def load(self, name: str, path: str) -> Reply:
        slot = self.slots.get(name)
        if slot is not None:
            return self._reply(Outcome.WAITING if slot.unloading else Outcome.ALREADY, name, path)
        if len(self.slots) >= self.max_loras:
            unloading = [s.name for s in self.slots.values() if s.unloading]
            detail = (f"'{unloading[0]}' is still unloading; try again when its requests have finished."
                      if unloading else "")
            return self._reply(Outcome.TOO_MANY, name, path, detail if self.max_loras else
                               "LoRA is disabled: maxLoras is 0.")
        try:
            weights = read_adapter(Path(path).absolute(), self.config, self.max_rank)
        except AdapterError as exc:
            reply = self._reply(exc.outcome, name, path, exc.detail)
            log.warning("lora adapter refused", extra={"adapter": name, "path": path, "why": reply.message})
            return reply
        self.slots[name] = Slot(name, weights)
        self._rebuild()
        log.info("lora adapter loaded", extra={"adapter": name, "rank": weights.rank, "path": weights.path})
        return self._reply(Outcome.ADDED, name, path)

    def unload(self, name: str) -> Reply:
        slot = self.slots.get(name)
        if slot is None or slot.unloading:
            return self._reply(Outcome.MISSING, name)
        slot.unloading = True
        self._free_if_unused(slot)
        return self._reply(Outcome.REMOVED, name)

    @staticmethod
    def _reply(outcome: Outcome, name: str, path: str = "", detail: str = "") -> Reply:
        return Reply(outcome, message(outcome, name, path, detail))

    # ---- requests ---------------------------------------------------------------------------

    def acquire(self, name: str) -> Slot | None:
        """The adapter for a new request (held until ``release``); None when it is not loaded or unloading."""
        slot = self.slots.get(name)
        if slot is None or slot.unloading:
            return None
        slot.users += 1
        return slot

    def release(self, slot: Slot) -> None:
        slot.users -= 1
        self._free_if_unused(slot)

    def _free_if_unused(self, slot: Slot) -> None:
        if slot.unloading and slot.users <= 0 and self.slots.get(slot.name) is slot:
            del self.slots[slot.name]
            self._rebuild()
            log.info("lora adapter unloaded", extra={"adapter": slot.name})

    # ---- state for heartbeats ---------------------------------------------------------------

    # Read by the service's event loop while the stepper thread may change the set: list() copies the
    # dict's values in one step under the GIL.

    def listed(self) -> list[Adapter]:
        return [Adapter(s.name, s.weights.path, s.uid) for s in list(self.slots.values()) if not s.unloading]

    def salt(self, name: str) -> bytes | None:
        """The prefix-cache salt of the adapter loaded as ``name`` (None when it is not)."""
        slot = self.slots.get(name)
        return None if slot is None or slot.unloading else slot.uid

    def unloading(self) -> list[str]:
        return [s.name for s in list(self.slots.values()) if s.unloading]

    def rows(self, slots: list[tuple[Slot | None, int]], device: torch.device) -> Rows | None:
        """Each item's adapter repeated over its ``n`` rows; None when no row has one (no LoRA work)."""
        if not any(slot for slot, _ in slots):
            return None
        off: list[int] = []
        rank: list[int] = []
        for slot, n in slots:
            off += [slot.offset if slot else 0] * n
            rank += [slot.rank if slot else 0] * n
        return Rows(torch.tensor(off, dtype=torch.long, device=device), torch.tensor(rank, dtype=torch.long, device=device))

    # ---- stacks -----------------------------------------------------------------------------

    def _rebuild(self) -> None:
        """Lay the adapters out in rank space and stack their weights per layer and group."""
        offset = 0
        for slot in self.slots.values():
            slot.offset, offset = offset, offset + slot.rank
        self.stacks = [self._layer(layer, offset) for layer in range(self.config.num_hidden_layers)] if offset else []

    def _layer(self, layer: int, total: int) -> dict[str, GroupStack]:
        shapes = target_shapes(self.config)
        stacks = {}
        for group, targets in GROUPS:
            n_in = shapes[targets[0]][0]
            a_parts = [torch.zeros(total, n_in) for _ in targets]
            bts = [torch.zeros(total, shapes[t][1]) for t in targets]
            for slot in self.slots.values():
                for t, target in enumerate(targets):
                    pair = slot.weights.weights.get((layer, target))
                    if pair is not None:
                        a_parts[t][slot.offset:slot.offset + slot.rank] = pair[0]
                        bts[t][slot.offset:slot.offset + slot.rank] = pair[1].t()
            stacks[group] = GroupStack([a.to(self.device, self.dtype) for a in a_parts],
                                       [b.to(self.device, self.dtype) for b in bts])
        return stacks
