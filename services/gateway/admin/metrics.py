"""``GET /metrics-json`` (management plane, reference §3.13) and ``GET /metrics`` (metrics plane, §3.14).

Both read the metrics service over NATS; ``/metrics-json``'s engine figures (waiting, processing, remaining
blocks) are sums over the live engines' heartbeats (in dmi mode, those of the server's PD role; TTFT and
TBT are the deployment's).
``/metrics`` is served without MindIE's ``MIES_SERVICE_MONITOR_MODE`` switch: Prometheus scrapes it as is.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from litestar import Request, Response, get

from shared import bus, subjects
from shared.engines import combined
from shared.errors import ErrorKind, SwitchboardError
from shared.messages import MetricsSnapshot, Ping, PrometheusText

if TYPE_CHECKING:
    from services.gateway.core import Gateway

PROMETHEUS_TYPE = "text/plain; version=0.0.4"  # (Litestar adds "; charset=utf-8" to a text/ type)


async def _ask(gateway: Gateway, subject: str, reply_type):
    try:
        return await bus.request(gateway.nc, subject, Ping(), reply_type, timeout=2.0)
    except Exception:  # no metrics service: the scrape fails loudly but the gateway keeps serving
        raise SwitchboardError(ErrorKind.INTERNAL, "the metrics service did not answer") from None


@get("/metrics-json")
async def metrics_json(request: Request) -> Response:
    gateway = request.app.state.gateway
    gateway.refuse_stopped()
    snapshot: MetricsSnapshot = await _ask(gateway, subjects.METRICS_SNAPSHOT, MetricsSnapshot)
    engine = combined(gateway.role_engines().values())  # in dmi mode: the engines of this server's role
    if engine is None:
        raise SwitchboardError(ErrorKind.UNAVAILABLE, f"no engine is serving model {gateway.model}")
    server = gateway.cfg.server
    labels = {"job": "node", "instance": f"{server.management_ip}:{server.management_listen_port}"}
    values = {
        "TTFT": round(snapshot.ttft_avg_ms), "TBT": round(snapshot.tbt_avg_ms),
        "waitingInferRequestNum": engine.waiting, "processingInferRequestNum": engine.running,
        "remainBlocks": engine.free_blocks,
    }
    result = [{"metric": [{"__name__": name, **labels}], "value": str(value)} for name, value in values.items()]
    return Response({"resultType": "vector", "result": result}, media_type="application/json")


@get("/metrics")
async def prometheus(request: Request) -> Response:
    reply: PrometheusText = await _ask(request.app.state.gateway, subjects.METRICS_PROMETHEUS, PrometheusText)
    return Response(reply.body, media_type=PROMETHEUS_TYPE)


MANAGEMENT_ROUTES = [metrics_json]
METRICS_ROUTES = [prometheus]
