"""config.json's ``Switchboard`` section: the keys MindIE lacks (shared/config.py reads the file, checks the
keys across sections, and names this section's keys in its errors)."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta, field


class RoutingConfig(msgspec.Struct, rename="camel", kw_only=True, forbid_unknown_fields=True):
    """How a tokenizer picks the engine for a request (``services/tokenizer/routing.py``). With
    ``ScheduleConfig.enablePrefixCache`` on, the engines announce their prefix caches, and a request's
    prompt is scored on each engine by the share of its blocks cached there against the engine's load."""

    policy: Literal["load", "cache", "mix"] = "mix"
    """``load``: the least loaded engine. ``cache``: the engine holding the longest prefix of the prompt
    (load breaks ties). ``mix``: cacheWeight x (the prompt's share cached there) - loadWeight x (its extra
    requests over the least loaded engine, per maxLoadGap). All three keep to maxLoadGap."""
    cache_weight: Annotated[float, Meta(ge=0, le=100)] = 1.0
    load_weight: Annotated[float, Meta(ge=0, le=100)] = 0.25
    """with the defaults, an engine holding the prompt's history is passed over for load only when another holds
    nearly as much (within a quarter of the prompt per maxLoadGap requests): one more request in a batch costs
    little next to recomputing a history (bench/fleet_bench.py measured weight 1 below weight 0.25)."""
    max_load_gap: Annotated[int, Meta(ge=0, le=100000)] = 4
    """an engine with this many more requests (running, waiting, just sent) than the least loaded one gets
    no request for its cache's sake: a shared prefix cannot pile every request onto one engine."""
    pull_min_tokens: Annotated[int, Meta(ge=0, le=1048576)] = 64
    """when the chosen engine lacks at least this many prompt tokens that another engine holds, it pulls
    them from there over the bus (if its measured pull rate beats its prefill rate) instead of computing
    them; 0 = never pull. On CPUs a pull costs ~0.14 ms a token against ~1 ms to compute one on a core, so
    even a few blocks are worth pulling (bench/fleet_bench.py: 256 left the turns a busy holder passed on
    with 150-250 history tokens to recompute, a tenth of its mean TTFT)."""


class SwitchboardConfig(msgspec.Struct, rename="camel", kw_only=True, forbid_unknown_fields=True):
    """Keys MindIE lacks: the bus, the torch device, observability. A key this section does not know is an
    error (a misspelt key would otherwise change nothing in silence)."""

    nats_url: Annotated[str, Meta(pattern=r"^(?:(?:nats|tls|ws|wss)://\S+)?\Z")] = ""  # "" = embedded
    """NATS server URL; empty = the launcher starts an embedded nats-server on a free loopback port."""
    device: Literal["cpu", "cuda", "npu", "auto"] = "cpu"
    """torch device of the engine; npu imports torch_npu only when chosen."""
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "float32"
    quantization: Literal["none", "int8", "int4", "gguf", "fp8"] = "none"
    """the linear layers' weights, quantized at load from the model folder's float weights. On cpu:
    ``int8`` with a scale per output channel (half of bfloat16's bytes; W8A8 on CPUs with AVX-512 VNNI),
    ``int4`` in blocks of 32 with a scale and an offset (GGUF's Q4_1 layout, about a third); the lm_head is
    int8 in all of them, the embeddings stay float. ``gguf`` takes the layers from the model folder's one
    ``*.gguf`` file as it stores them (Q4_0, Q4_1 exactly; other types converted to int4 or int8; the default
    model's folder holds its own Q4_1 file). ``none`` keeps ``dtype``'s weights, or an AWQ / GPTQ folder's
    own packed 4-bit layers (services/engine/prequantized.py). On cuda: ``int4`` (the same blocks, on PyTorch's
    tensor-core int4 kernel, sm80+) and ``fp8`` (float8 e4m3 weights with a scale per output channel, each
    row of activations quantized on the fly; sm89+), the lm_head in the model's dtype
    (services/engine/quant_cuda.py)."""
    kv_cache_dtype: Literal["auto", "int8", "fp8_e4m3"] = "auto"
    """the KV cache's element type: ``auto`` = ``dtype``'s; ``int8`` (cpu only) stores each head's K and V of a
    position as int8 codes with one float16 scale, so ``kvCacheMemoryMb`` holds about twice the tokens of a
    bfloat16 cache (four times float32's); ``fp8_e4m3`` (cuda, compute capability 8.9+) stores each element as
    float8 e4m3, twice a bfloat16 cache's tokens in the same memory."""
    cpu_kernels: bool = True
    """on cpu, the engine's fused C++ kernels (built for this CPU on first use); false runs the same
    operations as PyTorch calls."""
    gpu_kernels: bool = True
    """on cuda, the engine's Triton kernels (paged decode attention, fused norms, rotary + cache write,
    SiLU * up); false runs the same operations as PyTorch calls."""
    cuda_graphs: bool = True
    """on cuda, decode steps replay CUDA graphs captured at start for batch sizes 1, 2, 4, 8, 16, 24, 32,
    48, 64, ... up to maxBatchSize (at most 256; larger batches run eagerly), and prompt and Mix steps replay
    graphs between their attentions for token counts 16, 32, 64, 96, 128, 192, ... up to the most a step holds
    (at most 2,048); false runs every step eagerly."""
    async_scheduling: bool = True
    """on cuda with cudaGraphs, a decode step whose every row's token can be drawn on the device (any sampling
    parameters, penalties and logprobs included; not a grammar's masked rows, which need the last token on the
    host) is launched before the last one's tokens are read back, its token ids copied on the device, so the GPU
    does not wait while the host reads, appends and publishes tokens (vLLM's async scheduling); false reads each
    step's tokens before the next step is scheduled."""
    prefill_order: Literal["arrival", "shortest"] = "shortest"
    """Mix: which prompts get a step's prefillChunkSize tokens first, within a priority level: ``arrival``
    (prompts already being computed, then new ones, each in arrival order) or ``shortest`` (the fewest tokens
    left to compute after the prefix cache first, so a conversation's next turn, mostly cached, does not wait
    behind another's long document; a prompt passed over 8 steps in a row goes first)."""
    torch_threads: Annotated[int, Meta(ge=0, le=1024)] = 0
    """intra-op threads of the engine's torch; 0 = torch's default (one per core)."""
    engine_role: Literal["both", "prefill", "decode"] = "both"
    """an engine's part in prefill/decode disaggregation: ``both`` (co-located), ``prefill`` (computes
    prompts and first tokens, then hands each request to a decode engine) or ``decode`` (continues
    handed-over requests; takes new ones only when no other engine does). ``switchboard engine --role``."""
    device_index: Annotated[int, Meta(ge=-1, le=1023)] = -1
    """the logical device this engine runs on (MindIE's ``device_logical_id``), as ``switchboard engine
    --device-index`` sets it; -1 = none. In ``inferMode`` "dmi" a role assignment (``/v1/role``) whose
    ``local`` devices name it gives the engine that role."""
    kv_trans_timeout_seconds: Annotated[float, Meta(gt=0, le=3600)] = 10.0
    """a prefill engine's limit for handing one request's K/V to a decode engine; past it the request
    is recomputed where it is (MindIE's kv_trans_timeout)."""
    jetstream_dir: str = ".cache/jetstream"
    """the embedded nats-server's JetStream files (stored /v1/responses survive a restart there); relative to the
    directory the server starts in."""
    responses_ttl_seconds: Annotated[int, Meta(ge=1, le=31536000)] = 2592000
    """how long a stored /v1/responses response (store: true) is kept; 30 days, as OpenAI keeps them."""
    responses_max_mb: Annotated[int, Meta(ge=1, le=1048576)] = 256
    responses_replicas: Annotated[int, Meta(ge=1, le=5)] = 1
    """copies of the stored responses a NATS cluster keeps (JetStream's replicas; at most its members): with
    1 they live on one member, whose restart makes /v1/responses 503s and whose lost volume loses them."""
    """the stored responses' bucket size; past it the oldest go first."""
    stream_keep_alive_seconds: Annotated[float, Meta(ge=0, le=3600)] = 15.0
    """a stream silent this long (queued for a slot, in a long prefill) sends the family's keep-alive: an SSE
    comment (OpenAI, TGI, Triton), Anthropic's ping event, vLLM's empty chunk; 0 sends none. Proxies close
    connections idle for 60-120 s."""
    cors_allow_origins: list[Annotated[str, Meta(min_length=1, max_length=2048)]] = []
    """the origins a browser may call the HTTP API from (CORS, as vLLM's --allowed-origins and TGI's
    --cors-allow-origin), e.g. ["http://localhost:3000"], or ["*"] for any; empty (the default): no CORS headers,
    so browsers allow same-origin calls only."""
    shutdown_grace_seconds: Annotated[float, Meta(ge=0, le=3600)] = 30.0
    """on SIGTERM (or Ctrl-C) the gateway takes no new connections and gives the requests it is serving this long
    to finish before the services stop (as TGI and vLLM drain); a second signal stops at once."""
    kv_cache_memory_mb: Annotated[int, Meta(ge=16, le=1048576)] = 1024
    """KV-cache budget in MiB on cpu (accelerators follow npuMemSize: -1 = 80% of free memory)."""
    host_kv_cache_memory_mb: Annotated[int, Meta(ge=0, le=16777216)] = 0
    """on an accelerator with the prefix cache on (enablePrefixCache), the prefix cache's second tier: blocks
    evicted from device memory keep their K/V in this many MiB of pinned host memory (least recently stored
    dropped first) and are copied back on a hit; 0 = none. A cpu engine's cache is host memory already: one
    tier (give the memory to kvCacheMemoryMb), so it is refused there."""
    otlp_endpoint: str = ""
    """OTLP/HTTP traces endpoint; empty = no spans exported."""
    log_level: Literal["debug", "info", "warning", "error"] = "warning"
    # Slow clients, per listener. The request head is a few hundred bytes, so 10 s is ample even on a
    # bad mobile link (Go services commonly set ReadHeaderTimeout to 5-10 s; nginx's 60 s dates from
    # dial-up). The body gets a whole deadline, not nginx's gap between reads, so a body sent a byte at a
    # time cannot hold a connection forever; 30 s carries a typical request body over any link.
    header_timeout_seconds: Annotated[int, Meta(ge=1, le=3600)] = 10
    """a connection that has not sent a whole request head this long after it opened (or after the
    first byte of a keep-alive request) gets 408 and is closed."""
    body_timeout_seconds: Annotated[int, Meta(ge=1, le=3600)] = 30
    """a request whose body has not fully arrived this long after its head gets 408 and is closed;
    answers, streams included, are never cut by either timeout."""
    # maxLinkNum (1000 by default) admits 3 x maxLinkNum requests (in progress plus queued); 4096
    # connections leave room for all of them and for idle keep-alive connections, so overload is still a
    # 429 in the family's shape, while a flood of idle or slow sockets cannot exhaust file descriptors.
    max_connections: Annotated[int, Meta(ge=1, le=65536)] = 4096
    """open connections per listener; beyond it a new connection gets 503 (and is closed) on its request."""
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    """request routing across engines: by load, by what their prefix caches hold, or a mix (RoutingConfig)."""
    lease_seconds: Annotated[float, Meta(ge=0.5, le=60.0)] = 2.0
    """an engine, tokenizer or gateway instance not heard from this long is dead for every other one;
    heartbeats go out four times per lease."""

    # Media of multimodal requests (shared/media.py): by default nothing is fetched.
    media_root: str = ""
    """local media files must lie under this folder (relative to the config file; MindIE uses
    /data/multimodal_inputs/); empty = local files are refused."""
    allowed_media_domains: list[str] = field(default_factory=list)
    """hosts remote media may come from, each with its subdomains, joined with the comma-separated
    environment variable ALLOWED_MEDIA_DOMAINS_ENV; empty (and no variable) = no remote media."""
    allow_private_media_addresses: bool | list[str] = False
    """media may come from loopback, link-local, private and other non-global addresses: true = any,
    a list of networks ("10.1.0.0/16", "127.0.0.1") = those; false = none."""
    media_max_request_mb: Annotated[int, Meta(ge=1, le=16384)] = 600
    """all the media of one request together, in MiB (one item: image 20, video 512, audio 20)."""
    media_fetch_timeout_seconds: Annotated[int, Meta(ge=1, le=3600)] = 30
    """one remote item: name resolution, connection, redirects and the whole body."""
    media_request_timeout_seconds: Annotated[int, Meta(ge=1, le=3600)] = 120
    """all the media of one request."""

    @property
    def heartbeat_s(self) -> float:
        return self.lease_seconds / 4
