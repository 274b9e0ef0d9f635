"""The gateway's registry of in-flight sessions: what the failover watch checks, what a stop drain waits
on, what Triton's stopInfer finds by the id its client gave. A session enters when it is published and
leaves in its ``close()``, the one place that removes it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

if TYPE_CHECKING:
    from services.gateway.request.session import Session


class InFlight:
    def __init__(self) -> None:
        self._by_id: dict[str, Session] = {}
        self._by_user: dict[str, dict[str, Session]] = {}  # a client's id may name several running requests

    def add(self, session: Session) -> None:
        self._by_id[session.id] = session
        self._by_user.setdefault(session.user_id, {})[session.id] = session

    def remove(self, session: Session) -> None:
        self._by_id.pop(session.id, None)
        named = self._by_user.get(session.user_id, {})
        if named.pop(session.id, None) is not None and not named:
            del self._by_user[session.user_id]

    def by_user(self, user_id: str) -> list[Session]:
        """The in-flight sessions a client named ``user_id`` (Triton's request ``id``): every one, when
        clients gave two running requests the same id."""
        return list(self._by_user.get(user_id, {}).values())

    def __iter__(self) -> Iterator[Session]:
        return iter(list(self._by_id.values()))

    def __len__(self) -> int:
        return len(self._by_id)
