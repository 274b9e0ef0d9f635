"""Wire messages (msgpack-encoded msgspec Structs), grouped by who receives them.

Every message carries the request id and the trace headers (W3C ``traceparent`` …); fields are
only ever appended, with defaults, so old and new services interoperate.
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

from shared.ends import CancelKind, FinishReason
from shared.errors import ErrorInfo


class Msg(msgspec.Struct, kw_only=True, omit_defaults=True):
    id: str
    trace: dict[str, str] = {}


class Grammar(msgspec.Struct, omit_defaults=True):
    """A constraint on the generated text (structured output), checked by the gateway (``shared.grammar``),
    enforced by the engine's token masks: ``json_schema`` (a schema as JSON text), ``regex`` or ``lark``."""

    kind: str
    value: str
    field: str = ""  # the request field it came from (``guided_json``, ``response_format``, …): named in errors


class Sampling(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Sampling parameters, already validated by the gateway's family adapter."""

    do_sample: bool | None = None  # None: sample when any warper is set
    temperature: float = 1.0
    top_k: int = 0  # 0: disabled
    top_p: float = 1.0
    typical_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int | None = None  # None: the tokenizer draws one and reports it
    max_new_tokens: int = 20
    stop: list[str] = []
    ignore_eos: bool = False
    presence_penalty: float = 0.0  # OpenAI/vLLM: on generated tokens only
    frequency_penalty: float = 0.0
    stop_token_ids: list[int] = []  # end like eos (also with ignore_eos, as in vLLM)
    logprobs: int | None = None  # None: none; k: the sampled token's logprob and the k most likely
    prompt_logprobs: int | None = None  # None: none; k: each prompt token's logprob (after the first) and the k most likely
    grammar: Grammar | None = None  # structured output: every sampled token keeps the text within it
    include_stop_str_in_output: bool = False
    min_p: float = 0.0  # vLLM's: drop tokens less likely than min_p x the most likely one (when drawing)
    logit_bias: dict[int, float] = {}  # OpenAI's: added to the token's logit before sampling (greedy too)
    min_tokens: int = 0  # vLLM's: no EOS, stop id or stop string ends it before this many tokens
    skip_special_tokens: bool = True  # vLLM's: false puts special tokens' text in the answer (not the EOS it ends on)
    allowed_token_ids: list[int] = []  # vLLM's: only these may be sampled ([]: any)
    bad_words: list[str] = []  # vLLM's: words never generated (the tokenizer turns them into bad_words_ids)
    bad_words_ids: list[list[int]] = []  # each bad word's tokens: the last is banned where the answer ends in the rest

    @property
    def has_warpers(self) -> bool:
        return (self.temperature != 1.0 or self.top_k > 0 or self.top_p < 1.0 or self.typical_p < 1.0
                or self.min_p > 0.0)

    @property
    def sampling(self) -> bool:
        return self.has_warpers if self.do_sample is None else self.do_sample


# ---- to the tokenizer -------------------------------------------------------------------------


class MediaRef(msgspec.Struct, omit_defaults=True):
    """One media item of a request as the client named it; ``shared.media`` checks it before any fetch."""

    kind: str  # image | video | audio
    source: str  # an http(s) URL, a data: URL, or a local path


class ContentPart(msgspec.Struct, omit_defaults=True):
    """One item of a list-form input (TGI and native ``inputs``, chat content), in the client's order."""

    type: str  # text | image | video | audio
    text: str = ""
    media: MediaRef | None = None


class GenerateRequest(Msg):
    """The one internal request: every API family's adapter produces this."""

    model: str
    reply_to: str  # the gateway inbox subject for this request's events
    prompt: str = ""
    prompt_ids: list[int] | None = None  # token-id input (skips encoding)
    messages: list[dict[str, Any]] | None = None  # chat input: rendered by the model's chat template
    chat_template_kwargs: dict[str, Any] = {}
    tools: list[dict[str, Any]] = []  # chat: the declared tools (OpenAI's objects), rendered with the messages
    tool_choice: str = ""  # none | auto | required | named (auto needs a tool-call format the gateway parses)
    add_generation_prompt: bool = True  # chat: end with the assistant's turn opened ...
    continue_final_message: bool = False  # ... or leave the last (assistant) message open, for the answer to go on
    sampling: Sampling = msgspec.field(default_factory=Sampling)
    truncate: int = 0  # keep only the last n prompt tokens; 0 = off
    return_prompt_ids: bool = False
    priority: int = 3
    timeout_s: float | None = None
    arrival: float = 0.0  # unix time the gateway received it
    gateway: str = ""  # the owning gateway instance: when its lease runs out, its requests are cancelled
    resume_ids: list[int] = []  # a resumed request: the tokens its client already has (seed pinned)
    adapter: str = ""  # the LoRA adapter it runs with; "" = the base model
    cache_salt: str = ""  # vLLM's: its prefix-cache blocks are shared only with requests of the same salt
    add_special_tokens: bool = True  # a text prompt: the tokenizer's special tokens (BOS) added
    probe: bool = False  # /health/timed's one-token probe: not a client's request (no queue time is counted)
    parts: list[ContentPart] = []  # list-form input with media, in order (``prompt`` is then empty); for chat
    # input only the media, in order of appearance: their places are the {"type": <kind>} items of ``messages``


# ---- to the engine ----------------------------------------------------------------------------


class Tensor(msgspec.Struct, array_like=True):
    """A tensor on the bus: torch's dtype name ("float32", "int64", "bool"), shape, raw little-endian bytes."""

    dtype: str
    shape: list[int]
    data: bytes


class MediaInputs(msgspec.Struct, omit_defaults=True):
    """A request's media after the tokenizer's preprocessing: the model processor's tensors by name
    (``pixel_values``, ``pixel_attention_mask``, ``image_grid_thw``, ...; the engine's encoder for the
    architecture reads them) and a digest of them all, which salts the request's prefix-cache keys."""

    tensors: dict[str, Tensor]
    digest: str


class EngineRequest(Msg):
    prompt_ids: list[int]
    sampling: Sampling  # seed resolved, max_new_tokens capped
    reply_to: str  # the tokenizer inbox for token events
    priority: int = 3
    arrival: float = 0.0
    deadline: float | None = None  # unix time after which the request ends with a timeout
    deadline_reason: str = "server e2eTimeout"  # or "client timeout": said in the timeout error
    generated_ids: list[int] = []  # a resumed request: tokens generated before (the cache is recomputed)
    tokenizer: str = ""  # the tokenizer instance it reports to: when its lease runs out, the request ends
    adapter: str = ""  # the LoRA adapter it runs with; "" = the base model
    media: MediaInputs | None = None  # preprocessed media; their features go at the media tokens of prompt_ids
    handoff: bool = False  # PD split: compute the prompt and the first token, then hand over to a decode engine
    pull_from: str = ""  # fleet prefix cache: the engine holding a longer cached prefix, to pull it from first
    cache_salt: str = ""  # the client's: its prefix-cache keys are salted by it (shared.prefix_hash.client_salt)
    probe: bool = False  # a health probe (GenerateRequest.probe): its queue time is not a client's


class Cancel(Msg):
    """Fan-out: stop this request wherever it runs (disconnect, stopInfer, stop string)."""

    reason: CancelKind = CancelKind.CANCELLED


class StopInfer(msgspec.Struct, omit_defaults=True):
    """Gateway to gateways: end the request a client named ``user_id`` (Triton stopInfer)."""

    user_id: str


# ---- to the tokenizer, from the engine --------------------------------------------------------


class TokenLogprob(msgspec.Struct, array_like=True):
    """One sampled token's log-probability (of the model's raw distribution) and the most likely ids."""

    logprob: float
    top_ids: list[int] = []
    top_logprobs: list[float] = []
    rank: int = 0  # prompt logprobs: the token's rank in the whole vocabulary (1: the likeliest); 0: not counted


class TokenEvent(msgspec.Struct, omit_defaults=True):
    id: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None  # set on the request's last event
    error: ErrorInfo | None = None
    logprobs: list[TokenLogprob] = []  # one per token id when the request asked for them
    position: int = 0  # how many tokens the request had generated before these
    prompt_logprobs: list[TokenLogprob | None] = []  # with the first token, when asked: one per prompt token (the first None)
    cached_tokens: int = 0  # with the first token: prompt tokens found in the prefix cache (not computed)


class TokenBatch(msgspec.Struct, omit_defaults=True):
    """All token events of one engine step for one tokenizer instance."""

    events: list[TokenEvent]
    trace: dict[str, str] = {}
    engine: str = ""  # the engine instance that sent them
    moved: dict[str, str] = {}  # request id -> the decode engine that took it over (a prefill engine says so)


# ---- to the gateway ---------------------------------------------------------------------------


class TopToken(msgspec.Struct, array_like=True):
    id: int
    text: str
    logprob: float
    raw: bytes | None = None  # the token's own bytes (services/tokenizer/token_bytes.py)


class TokenOut(msgspec.Struct, array_like=True):
    id: int
    text: str  # what the token released into the answer's text (part of a character releases nothing yet)
    special: bool
    logprob: float | None = None
    top: list[TopToken] = []
    raw: bytes | None = None  # with logprobs: the token's own bytes (services/tokenizer/token_bytes.py)
    own: str | None = None  # the token's own text, where ``text`` differs (a stop string's hold-back moved it)
    rank: int = 0  # a prompt token's rank in the vocabulary (1: the likeliest), with prompt logprobs; else 0

    @property
    def own_text(self) -> str:
        """The text this token decodes to (TGI's and MindIE's per-token ``text``): what a hold-back for a stop
        string released on a later token (or left out, as the stop string) is still this token's."""
        return self.text if self.own is None else self.own


class Started(Msg, tag="started"):
    prompt_tokens: int
    seed: int
    prompt_ids: list[int] = []
    prompt_texts: list[str] = []
    tool_format: str = ""  # a chat with tools: the format the model writes calls in (hermes, mistral, llama3_json)
    tokenizer: str = ""  # the instances that own the request now: the gateway watches their leases
    engine: str = ""


class Output(Msg, tag="output"):
    position: int = 0  # how many tokens the request had generated before these (gaps are noticed)
    tokens: list[TokenOut] = []
    prompt: list[TokenOut] = []  # with the first token, when prompt logprobs were asked: the prompt's tokens
    finish_reason: FinishReason | None = None  # set on the last event
    generated_tokens: int = 0
    stop: str = ""  # finish_reason stop_sequence: the stop string that ended it (Anthropic's stop_sequence)
    cached_tokens: int = 0  # with the first token: prompt tokens the engine found in its prefix cache


class Failed(Msg, tag="failed"):
    error: ErrorInfo
    retryable: bool = False  # lost on the way (not the request's fault): the gateway resumes it


GatewayEvent = Union[Started, Output, Failed]


# ---- request/reply ----------------------------------------------------------------------------


class Ping(msgspec.Struct, omit_defaults=True):
    trace: dict[str, str] = {}


class Adapter(msgspec.Struct, omit_defaults=True):
    """A LoRA adapter an engine has loaded: its name and the folder it was read from (as resolved there)."""

    name: str
    path: str
    salt: bytes = b""  # its weights' digest: the salt of its prefix-cache keys (shared.prefix_hash)


class EngineInfo(msgspec.Struct, omit_defaults=True):
    """An engine's heartbeat (and health answer); ``instance`` is its id, stable for its life."""

    model: str
    loaded: bool
    device: str
    dtype: str  # the activations' (and a float model's weights') dtype
    max_batch_size: int
    total_blocks: int
    free_blocks: int
    running: int
    waiting: int
    free_slots: int = 0  # maxBatchSize - running
    prompt_tokens_total: int = 0  # counters since start: tokens prefilled (recomputes included) ...
    generation_tokens_total: int = 0  # ... tokens sampled
    preemptions_total: int = 0
    instance: str = ""
    stopping: bool = False  # draining: it takes no new request
    prefix_queried_tokens_total: int = 0  # prefix cache, since start: prompt tokens looked up (0 when off) ...
    prefix_hit_tokens_total: int = 0  # ... of those, tokens found cached (whole blocks)
    adapters: list[Adapter] = []  # LoRA adapters loaded and taking requests
    unloading: list[str] = []  # adapters unloaded that still finish the requests using them
    adapters_version: int = 0  # the adapter set's version: a peer with a newer one is followed
    modalities: list[str] = []  # media kinds the model takes besides text (image, video, audio); [] = text-only
    role: str = "both"  # prefill/decode disaggregation: both | prefill | decode
    device_index: int = -1  # the logical device it runs on (Switchboard.deviceIndex); -1 = none
    quantization: str = "none"  # its linear layers' weight format: none (dtype's) | int8 | int4 | fp8 | gguf | awq | gptq
    kv_dtype: str = ""  # its KV cache's element type; "" = dtype's
    block_size: int = 0  # its KV blocks' tokens (the prefix keys' unit)
    pid: int = 0  # its process (operators, fault tests)
    cache_seq: int = 0  # fleet prefix cache: the last CacheEvents it published ...
    cache_count: int = 0  # ... and, as of it, how many keys its cache held ...
    cache_xor: bytes = b""  # ... and their XOR: a router whose view differs asks for a digest
    host_total_blocks: int = 0  # the prefix cache's host tier (Switchboard.hostKvCacheMemoryMb): its blocks ...
    host_used_blocks: int = 0  # ... and those holding K/V evicted from device memory


class LoraCommand(msgspec.Struct, omit_defaults=True):
    """Gateway to one engine (``subjects.engine_lora``): load or unload an adapter; answered by LoraReply.
    ``version`` is the adapter set's version after this change (the gateway's newest seen plus one)."""

    op: str  # load | unload
    name: str
    path: str = ""
    version: int = 0
    trace: dict[str, str] = {}


class LoraReply(msgspec.Struct, omit_defaults=True):
    outcome: str  # a shared.lora.Outcome value
    message: str  # MindIE's text for it


class Heartbeat(msgspec.Struct, omit_defaults=True):
    """A gateway's or tokenizer's heartbeat on ``subjects.heartbeat(service)``."""

    service: str  # gateway | tokenizer
    instance: str
    model: str = ""
    stopping: bool = False
    server: str = ""  # a gateway's business listener, "ip:port" (what a coordinator's d-target names)
    role: str = ""  # a gateway's PD role (MindIE's /v1/role): prefill | decode | flex; "" = none
    dmi: bool = False  # a gateway in inferMode "dmi"
    in_flight: int = 0  # a gateway's requests in flight (a deployment's stop waits for every gateway's to end)


class Tokenize(msgspec.Struct, omit_defaults=True):
    """Gateway to tokenizer: count (and show) the tokens of a text, encoded as a generate would; or of a
    conversation (``messages``), rendered by the model's chat template as a chat request is."""

    text: str = ""
    add_special_tokens: bool = True  # text: the tokenizer's BOS (what a completion request does)
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] = []  # chat: OpenAI's tool objects, rendered with the messages
    tool_choice: str = ""
    chat_template_kwargs: dict[str, Any] = {}
    add_generation_prompt: bool = True  # chat: end with the assistant's turn opened ...
    continue_final_message: bool = False  # ... or leave the last (assistant) message open
    token_strs: bool = False  # also each token's own string (the vocabulary's, e.g. "Ġthe")
    offsets: bool = False  # text: also each token's [start, stop) character offsets in it (TGI's /tokenize)
    parts: list[ContentPart] = []  # chat with media: the messages' parts in order, expanded as a request's are
    trace: dict[str, str] = {}


class Tokenized(msgspec.Struct, omit_defaults=True):
    ids: list[int]
    pieces: list[str]  # text per token; a character spread over several tokens appears once, merged
    error: str = ""  # the input could not be encoded (a conversation that does not fit the template): why
    strs: list[str] = []  # with Tokenize.token_strs: each token's vocabulary string
    offsets: list[tuple[int, int]] = []  # with Tokenize.offsets: each token's characters of the text (a special
    # token the tokenizer added has (0, 0))


class Detokenize(msgspec.Struct, omit_defaults=True):
    """Gateway to tokenizer: the text of token ids."""

    ids: list[int]
    trace: dict[str, str] = {}


class Detokenized(msgspec.Struct, omit_defaults=True):
    text: str = ""
    error: str = ""  # an id outside the vocabulary: which


class TokenizerInfo(msgspec.Struct, omit_defaults=True):
    model: str
    vocab_size: int
    eos_token_ids: list[int]


class MetricsSnapshot(msgspec.Struct, omit_defaults=True):
    requests: int
    ttft_avg_ms: float
    tbt_avg_ms: float
    per_request: dict[str, tuple[float | None, float | None]] = {}  # id -> (ttft_ms, tbt_ms)


class PrometheusText(msgspec.Struct):
    body: bytes  # Prometheus text exposition format 0.0.4


_encoder = msgspec.msgpack.Encoder()


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decoder(kind):
    """A msgpack decoder for one message type (or tagged union)."""
    return msgspec.msgpack.Decoder(kind)
