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
        self._by_user: dict[str, Session] = {}

    def add(self, session: Session) -> None:
        self._by_id[session.id] = session
        self._by_user[session.user_id] = session

    def remove(self, session: Session) -> None:
        self._by_id.pop(session.id, None)
        if self._by_user.get(session.user_id) is session:
            del self._by_user[session.user_id]

    def by_user(self, user_id: str) -> Session | None:
        """The in-flight session a client named ``user_id`` (Triton's request ``id``), if any."""
        return self._by_user.get(user_id)

    def __iter__(self) -> Iterator[Session]:
        return iter(list(self._by_id.values()))

    def __len__(self) -> int:
        return len(self._by_id)
