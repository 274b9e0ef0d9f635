"""Health and model information: ``/health``, ``/v2/health/live``, ``/v2/health/ready``, ``/info`` (the management
plane); ``/ping`` and ``/version`` beside the APIs (vLLM's; SageMaker probes ``/ping`` where it sends
``/invocations``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from litestar import MediaType, Request, Response, get, route

from services.gateway.common.version import version as switchboard_version
from services.gateway.web.errors import mindie_error
from shared.errors import ErrorKind

if TYPE_CHECKING:
    from services.gateway.core import Gateway


def _links_down(gateway: Gateway) -> Response | None:
    """In dmi mode, once a role is assigned: 500 while a peer it named is not linked (reference §3.1)."""
    roles = gateway.roles
    if roles.dmi and roles.role != "none" and not all(roles.links().values()):
        return Response({"message": "DMI connection is unhealthy"}, status_code=500, media_type="application/json")
    return None


@get("/health")
async def health(request: Request) -> Response:
    request.app.state.gateway.refuse_stopped()
    if (down := _links_down(request.app.state.gateway)) is not None:
        return down
    ready = await request.app.state.gateway.is_ready()
    return _empty(200 if ready else 503)


@get("/v2/health/live")
async def live(request: Request) -> Response:
    """200, also while this gateway alone drains (``/stopService?scope=instance``: a Kubernetes liveness probe
    must not restart the pod it is draining); after MindIE's own stop, 503 as the other status routes."""
    if request.app.state.gateway.stop_scope == "deployment":
        request.app.state.gateway.refuse_stopped()
    return _empty(200)


@get("/v2/health/ready")
async def ready(request: Request) -> Response:
    request.app.state.gateway.refuse_stopped()
    if (down := _links_down(request.app.state.gateway)) is not None:
        return down
    ready = await request.app.state.gateway.is_ready()
    return _empty(200 if ready else 503)


@get("/info")
async def info(request: Request) -> Response:
    gateway = request.app.state.gateway
    gateway.refuse_stopped()
    engine = gateway.engine_info()
    if engine is None:
        return mindie_error(ErrorKind.UNAVAILABLE, "the engine service is not answering")
    cfg = gateway.cfg
    return Response({
        "docker_label": None,
        "max_batch_total_tokens": cfg.schedule.max_prefill_tokens,
        "max_best_of": 1,
        "max_concurrent_requests": cfg.schedule.max_batch_size,
        "max_stop_sequences": None,
        "max_waiting_tokens": None,
        "sha": None,
        "validation_workers": None,
        "version": "1.0.0",
        "waiting_served_ratio": None,
        "models": [{
            "model_device_type": engine.device,
            "model_dtype": engine.dtype,
            "model_quantization": engine.quantization,
            "model_kv_cache_dtype": engine.kv_dtype or engine.dtype,
            "model_id": gateway.model,
            "model_pipeline_tag": "text-generation",
            "model_sha": None,
            "max_total_tokens": cfg.deploy.max_seq_len,
        }],
        "max_input_length": cfg.deploy.max_input_token_len,
    })


@route("/ping", http_method=["GET", "POST"])
async def ping(request: Request) -> Response:
    """vLLM's ``/ping`` (SageMaker's health check): as ``/health``, on the business port."""
    return await health.fn(request)


@get("/version")
async def version() -> Response:
    """vLLM's ``/version``: the server's version."""
    return Response({"version": switchboard_version()}, media_type="application/json")


ROUTES = [health, live, ready, info]
BUSINESS_ROUTES = [ping, version]


def _empty(status: int) -> Response:
    """No body (reference §3.1, §3.3), so none is labelled JSON (a client that parses a JSON label fails on b"")."""
    return Response(b"", status_code=status, media_type=MediaType.TEXT)
