"""PD roles for MindIE's coordinator surface (reference §3.9–§3.12, §3.33): this gateway's role, the peers
its role assignment named, and every gateway heard on the bus.

In ``inferMode`` "dmi" each gateway is one MindIE *server*: a coordinator assigns it a role
(``POST /v1/role/{role}``), sends requests to a prefill server with a ``d-target`` header naming a
decode server, and reads their results from that decode server's ``GET /dresult``. The role status goes

* ``RoleUnknown``: no role yet (inference is refused with 503);
* ``RoleSwitching``: a role is assigned, but some peer it named is not a live gateway of the
  complementary role yet (still 503);
* ``RoleReady``: every peer named is heard (at that IP, in dmi mode, in the complementary role).

Co-located ("standard") gateways are always ``RoleReady``. Peers are matched by their heartbeat's
``server`` (the business listener's ``ip:port``); a heartbeat proves the link, since all traffic
between the two servers goes over the bus both are connected to.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from shared import bus, subjects
from shared.leases import Leases
from shared.messages import Heartbeat, decoder

if TYPE_CHECKING:
    from nats.aio.client import Client

    from shared.config import Config

# which roles a peer may hold to be linked to a gateway of each role
COMPLEMENT = {"prefill": ("decode", "flex"), "decode": ("prefill", "flex"), "flex": ("prefill", "decode", "flex")}


class Roles:
    """``instance`` is this gateway's id; ``stopping()`` says whether it refuses new inference."""

    def __init__(self, cfg: Config, nc: Client, instance: str, stopping: Callable[[], bool],
                 in_flight: Callable[[], int] = lambda: 0):
        self.cfg, self.nc, self.instance, self.stopping, self.in_flight_count = cfg, nc, instance, stopping, in_flight
        self.model = cfg.model.model_name
        self.role = "none"  # set by /v1/role, /v2/role
        self.peers: list[str] = []  # the peer server IPs the last assignment named
        self.in_flight: set[str] = set()  # the req-ids of the coordinator's requests under way here (dmi)
        self.gateways: Leases[Heartbeat] = Leases(cfg.switchboard.lease_seconds)  # every gateway, this one too
        self.beats = decoder(Heartbeat)

    async def start(self) -> None:
        await bus.subscribe(self.nc, subjects.heartbeat("gateway"), self.on_beat)

    async def on_beat(self, msg) -> None:
        beat = self.beats.decode(msg.data)
        if beat.model in ("", self.model):
            self.gateways.expire()
            self.gateways.beat(beat.instance, beat)

    @property
    def dmi(self) -> bool:
        return self.cfg.server.infer_mode == "dmi"

    def assign(self, role: str, peers: list[str]) -> None:
        self.role, self.peers = role, list(dict.fromkeys(peers))

    def heartbeat(self) -> Heartbeat:
        server = self.cfg.server
        return Heartbeat(service="gateway", instance=self.instance, model=self.model,
                         stopping=self.stopping(), server=f"{server.ip_address}:{server.port}",
                         role="" if self.role == "none" else self.role, dmi=self.dmi,
                         in_flight=self.in_flight_count())

    # ---- status -----------------------------------------------------------------------------------

    def links(self) -> dict[str, bool]:
        """Each peer IP the assignment named: is a gateway of the complementary role live there?"""
        wanted = COMPLEMENT.get(self.role, ())
        live = [b for i, b in self.gateways.live().items() if i != self.instance and b.dmi and b.role in wanted]
        return {ip: any(_host(b.server) == ip for b in live) for ip in self.peers}

    def status(self) -> tuple[str, str]:
        """(roleStatus, currentRole) as /v1/status and /v2/status report them."""
        if not self.dmi:
            return "RoleReady", self.role
        if self.role == "none":
            return "RoleUnknown", "none"
        if not all(self.links().values()):
            return "RoleSwitching", "none"
        return "RoleReady", self.role

    @property
    def ready(self) -> bool:
        return self.status()[0] == "RoleReady"

    # ---- the coordinator's d-target ------------------------------------------------------------

    def decode_server(self, target: str) -> str | None:
        """The live decode gateway a ``d-target`` (``ip`` or ``ip;port``, the port being its business port)
        names; None when no such gateway is heard. Several at one IP without a port: the first by id."""
        ip, _, port = target.partition(";")
        for instance, beat in sorted(self.gateways.live().items()):
            host, _, their_port = beat.server.rpartition(":")
            if beat.dmi and beat.role in ("decode", "flex") and host == ip and port in ("", their_port):
                return instance
        return None

    def is_live(self, instance: str) -> bool:
        return self.gateways.is_live(instance)


def _host(server: str) -> str:
    return server.rpartition(":")[0]
