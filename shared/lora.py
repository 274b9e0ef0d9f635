"""LoRA adapters: the name and path rules and the plain-text outcomes of MindIE's load and unload
APIs (reference §3.15, §3.16), shared by the gateway (which checks and combines) and the engines
(which load and unload).
"""

from __future__ import annotations

import enum
import re

NAME = re.compile(r"^[a-zA-Z0-9_-]{1,256}\Z")  # lora_name (load and unload), LoraModules[].name
INVALID_NAME = "Input invalid lora name"  # 503, plain text
INVALID_PATH = "Input invalid lora path"  # 503, plain text
NOT_JSON = "Req body converts to json fail."  # 200, plain text


def valid_name(name: object) -> bool:
    return isinstance(name, str) and NAME.match(name) is not None


def valid_path(path: object) -> bool:
    """A plain absolute or relative path: non-empty, at most 4096 characters, no ``..`` component and
    no control character."""
    if not isinstance(path, str) or not 0 < len(path) <= 4096:
        return False
    if any(ord(c) < 32 for c in path):
        return False
    return ".." not in path.replace("\\", "/").split("/")


class Outcome(str, enum.Enum):
    """What one engine did with a load or unload; ``message`` gives MindIE's text for it."""

    ADDED = "added"
    ALREADY = "already"
    WAITING = "waiting"  # loading a name that is still unloading
    INVALID = "invalid"  # the folder is not a LoRA adapter this engine can apply (detail says why)
    NOT_FOUND = "not_found"  # no adapter folder at the path
    RANK = "rank"  # rank > maxLoraRank
    TOO_MANY = "too_many"  # maxLoras adapters loaded already
    REMOVED = "removed"
    MISSING = "missing"  # unloading a name that is not loaded

    @property
    def ok(self) -> bool:
        return self in (Outcome.ADDED, Outcome.ALREADY, Outcome.REMOVED)


def message(outcome: Outcome, name: str, path: str = "", detail: str = "") -> str:
    """MindIE's message for an outcome; ``detail`` (why an adapter is invalid, or that one is unloading
    for too_many) is appended where MindIE's text leaves room for it."""
    failed = "Call to load LoRA method failed: "
    if outcome is Outcome.ADDED:
        return f"Success: LoRA adapter '{name}' added successfully."
    if outcome is Outcome.ALREADY:
        return f"The LoRA adapter '{name}' has already been added."
    if outcome is Outcome.WAITING:
        return f"The LoRA adapter '{name}' is waiting to unload."
    if outcome is Outcome.INVALID:
        return f"{failed}The LoRA adapter '{name}' is invalid." + (f" {detail}" if detail else "")
    if outcome is Outcome.NOT_FOUND:
        return f"{failed}Loading LoRA '{name}' failed: No adapter found for {path}'."
    if outcome is Outcome.RANK:
        return f"{failed}LoRA rank is greater than max_lora_rank." + (f" {detail}" if detail else "")
    if outcome is Outcome.TOO_MANY:
        return (f"{failed}The number of LoRA adapters exceeds 'max_loras', and none are currently unloading."
                if not detail else f"{failed}The number of LoRA adapters exceeds 'max_loras'; {detail}")
    if outcome is Outcome.REMOVED:
        return f"Success: LoRA adapter '{name}' removed successfully."
    return f"The LoRA adapter '{name}' cannot be found."
