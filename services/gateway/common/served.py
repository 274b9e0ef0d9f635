"""The names a generation request may run under: the served model, or a LoRA adapter a live engine holds.

Every family names its adapter in its own field (TGI ``parameters.adapter_id``, OpenAI ``model``, vLLM
``model``); the parsers turn that name into ``GenerateRequest.adapter`` through :class:`Served`, a snapshot
the route takes from the gateway, so the parsers stay pure functions of their input.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.errors import validation

PD_SPLIT = "LoRA adapters are not supported in PD split mode"


@dataclass(frozen=True)
class Served:
    model: str
    adapters: frozenset[str] = field(default_factory=frozenset)  # loaded on at least one live engine
    pd_split: bool = False  # inferMode "dmi", or a prefill/decode role: base model only

    def adapter(self, name: str, param: str) -> str | None:
        """The adapter a request naming ``name`` (in field ``param``) runs with: "" for the served model,
        ``name`` for a loaded adapter, None when nothing by that name is served. In PD split mode any
        other name is a validation error (each family's handlers shape it)."""
        if name == self.model:
            return ""
        if self.pd_split:
            raise validation(f"{param} {name!r}: {PD_SPLIT}.", param)
        return name if name in self.adapters else None

