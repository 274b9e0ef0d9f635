"""Management status and control (reference §3.6, §3.8–§3.12): ``/v1/config``, ``/v1/status``,
``/v2/status``, ``/v1/role/{role}``, ``/v2/role/{role}``, ``/health/timed[-N]``.

Roles (``roles.py``): co-located ("standard") a role is a label and the status is always RoleReady; in
``inferMode`` "dmi" an assignment goes RoleSwitching until every peer it names is a live gateway of the
complementary role, then RoleReady. A decode server lists its linked prefill servers' IPs in ``peers``
(v1), and every server its links' state in ``linkStatus.peers`` (v2).

Status covers every live engine (``modelInstanceNumber`` of them, or however many run) — in dmi mode those of
the server's role: figures are sums, and an engine whose lease ran out (``Switchboard.leaseSeconds``) drops
out at once.
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
from typing import TYPE_CHECKING, Any

import msgspec
from litestar import Request, Response, get, post
from litestar.params import FromPath

from services.gateway.request.call import Call
from services.gateway.request.session import Session
from services.gateway.web.errors import mindie_error
from services.gateway.web.validation import BodyError, read_json_object
from shared import bus, subjects
from shared.engines import combined
from shared.errors import ErrorKind, SwitchboardError
from shared.messages import EngineInfo, Sampling
from shared.pd_messages import EngineRole
from shared.metrics_messages import PROBE_API
from shared.aio import within

if TYPE_CHECKING:
    from services.gateway.core import Gateway

TIMED = re.compile(r"^timed(?:-(\d+))?\Z")
ROLE_422_TYPE = "Input validation error"  # the PD role endpoints' own casing (reference §4.2)


@get("/v1/config")
async def config(request: Request) -> Response:
    """MindIE's seven keys, then the formats the engines serve in (Switchboard's own: the configured ones until
    an engine is live, which knows a folder's own format, e.g. AWQ)."""
    gateway = request.app.state.gateway
    cfg = gateway.cfg
    model = cfg.deploy.model_config[0]
    engine = gateway.engine_info()
    return Response({
        "modelName": model.model_name, "maxSeqLen": cfg.deploy.max_seq_len, "npuMemSize": model.npu_mem_size,
        "cpuMemSize": model.cpu_mem_size, "worldSize": model.world_size, "maxOutputLen": cfg.schedule.max_iter_times,
        "cacheBlockSize": cfg.schedule.cache_block_size,
        "quantization": engine.quantization if engine else cfg.switchboard.quantization,
        "kvCacheDtype": (engine.kv_dtype or engine.dtype) if engine else cfg.switchboard.dtype,
    }, media_type="application/json")


def _engines(request: Request) -> dict[str, EngineInfo]:
    """Every live engine by instance; 503 while stopping or when none is live."""
    gateway = request.app.state.gateway
    gateway.refuse_stopped()
    engines = gateway.role_engines()
    if not engines:
        raise SwitchboardError(ErrorKind.UNAVAILABLE, "no engine is serving; status is unknown")
    return engines


def _service(gateway: Gateway) -> dict[str, str]:
    status, role = gateway.roles.status()
    return {"roleStatus": status, "currentRole": role}


@get("/v1/status")
async def status_v1(request: Request) -> Response:
    """Free slots and blocks, running and waiting requests, summed over every live engine."""
    e = combined(_engines(request).values())
    resource = {"availSlotsNum": e.free_slots, "availBlockNum": e.free_blocks, "waitingRequestNum": e.waiting,
                "runningRequestNum": e.running, "swappedRequestNum": 0, "freeNpuBlockNums": e.free_blocks,
                "freeCpuBlockNums": 0, "totalNpuBlockNums": e.total_blocks, "totalCpuBlockNums": 0}
    gateway = request.app.state.gateway
    body = {"service": _service(gateway), "resource": resource}
    if gateway.roles.dmi and gateway.roles.role == "decode":  # the P servers this D server is linked to
        body["peers"] = [ip for ip, up in gateway.roles.links().items() if up]
    return Response(body, media_type="application/json")


@get("/v2/status")
async def status_v2(request: Request) -> Response:
    """MindIE's DP-aware view with an engine per DP group: totals over the engines, the largest engine's free
    blocks, and ``dpInstMap`` (as MindIE's source: group id -> free blocks) keyed by engine instance."""
    engines = _engines(request)
    e = combined(engines.values())
    resource = {"totalAvailNpuSlotsNum": e.free_slots, "totalAvailNpuBlockNum": e.free_blocks,
                "maxAvailNpuBlockNum": max(x.free_blocks for x in engines.values()),
                "dpInstMap": {instance: x.free_blocks for instance, x in sorted(engines.items())}}
    return Response({"service": _service(request.app.state.gateway), "resource": resource,
                     "linkStatus": {"peers": _links(request.app.state.gateway)}}, media_type="application/json")


def _links(gateway: Gateway) -> list[dict[str, str]]:
    return [{"target": ip, "link": "ok" if up else "linking"} for ip, up in gateway.roles.links().items()]


# ---- roles ------------------------------------------------------------------------------------


class Device(msgspec.Struct):
    device_ip: str
    device_logical_id: str | None = None
    device_id: str | None = None
    rank_id: str | None = None

    def __post_init__(self) -> None:
        """MindIE's checks (reference §3.11): an IPv4 ``device_ip``, ids that are numeric strings."""
        try:
            ipaddress.IPv4Address(self.device_ip)
        except ValueError:
            raise ValueError(f"device_ip must be an IPv4 address, got {self.device_ip!r}") from None
        for name in ("device_logical_id", "device_id", "rank_id"):
            value = getattr(self, name)
            if value is not None and not value.isdigit():
                raise ValueError(f"{name} must be a number as a string, got {value!r}")

    @property
    def logical_id(self) -> int | None:
        """Its logical id (older MindIE bodies name it ``device_id``), None when not a number."""
        value = self.device_logical_id if self.device_logical_id is not None else self.device_id
        return int(value) if value is not None and value.isdigit() else None


class NodeV1(msgspec.Struct):
    server_ip: str
    device: list[Device]

    def __post_init__(self) -> None:
        if not self.device:
            raise ValueError("device must list the node's devices")


class RoleV1(msgspec.Struct):
    local: NodeV1
    peers: list[NodeV1] = []

    def peer_ips(self) -> list[str]:
        return [node.server_ip for node in self.peers]

    def devices(self) -> list[Device]:
        return self.local.device


class DpInst(msgspec.Struct):
    dp_inst_id: int | str
    device: list[Device]


class NodeV2(msgspec.Struct):
    server_ip: str
    host_ip: str
    dp_inst_list: list[DpInst]


class RoleV2(msgspec.Struct):
    local: list[NodeV2]
    peers: list[list[NodeV2]] = []

    def peer_ips(self) -> list[str]:
        return [node.server_ip for instance in self.peers for node in instance]

    def devices(self) -> list[Device]:
        return [device for node in self.local for group in node.dp_inst_list for device in group.device]


async def _set_role(request: Request, role: str, allowed: tuple[str, ...], body: bytes, shape) -> Response:
    if role not in allowed:
        return mindie_error(ErrorKind.NOT_FOUND, f"role must be one of {', '.join(allowed)}, got {role}")
    try:
        assignment = msgspec.convert(read_json_object(body), type=shape)
    except (BodyError, msgspec.ValidationError) as exc:
        return Response({"error": f"Req body converts to json fail. Reset to previous node status. ({exc})",
                         "error_type": ROLE_422_TYPE}, status_code=422, media_type="application/json")
    gateway = request.app.state.gateway
    gateway.roles.assign(role, assignment.peer_ips())
    if gateway.roles.dmi:  # the engines on this server's devices take its role
        devices = sorted({d.logical_id for d in assignment.devices() if d.logical_id is not None})
        await bus.publish(gateway.nc, subjects.engine_role(gateway.model), EngineRole(role, devices))
    return Response({"result": "ok"}, media_type="application/json")


@post("/v1/role/{role:str}", status_code=200)
async def role_v1(request: Request, role: FromPath[str]) -> Response:
    return await _set_role(request, role, ("prefill", "decode", "flex"), await request.body(), RoleV1)


@post("/v2/role/{role:str}", status_code=200)
async def role_v2(request: Request, role: FromPath[str]) -> Response:
    return await _set_role(request, role, ("prefill", "decode"), await request.body(), RoleV2)


# ---- /health/timed[-N] ------------------------------------------------------------------------


def _probe_timeout(probe: str) -> int:
    match = TIMED.match(probe)
    if match is None:
        raise SwitchboardError(ErrorKind.NOT_FOUND, f"no route /health/{probe}")
    digits = match.group(1)
    if digits is None:
        return 10
    if len(digits) > 3:
        raise SwitchboardError(ErrorKind.NOT_FOUND, "Max wait time is 600, input is invalid or too long")
    if not 1 <= int(digits) <= 600:
        raise SwitchboardError(ErrorKind.NOT_FOUND, "Wait time should be in range of [1, 600], input is not valid")
    return int(digits)


async def _one_token(gateway: Gateway) -> Any:
    """A real inference through tokenizer and engine: one greedy token, highest priority."""
    ctx = gateway.context
    async with Call(ctx, [Session(ctx, "", Sampling(do_sample=False, max_new_tokens=1), prompt_ids=[1],
                                  priority=1, api=PROBE_API)]) as call:
        await call.start()
        await call.results()


@get("/health/{probe:str}")
async def health_timed(request: Request, probe: FromPath[str]) -> Response:
    timeout = _probe_timeout(probe)
    if request.app.state.gateway.stopping:  # as MindIE: the probe reports healthy while draining
        return Response({"status": "healthy"}, media_type="application/json")
    try:
        await within(_one_token(request.app.state.gateway), timeout)
    except asyncio.TimeoutError:
        return mindie_error(ErrorKind.INTERNAL, f"the health probe did not finish within {timeout} s")
    except SwitchboardError as exc:
        return mindie_error(ErrorKind.INTERNAL, f"the health probe failed: {exc.message}")
    return Response({"status": "healthy"}, media_type="application/json")


ROUTES = [config, status_v1, status_v2, role_v1, role_v2, health_timed]
