"""The engine on cuda: greedy tokens equal HF ``generate``; graph replay equals the eager step; the Triton
kernels equal the PyTorch operations; prompt logprobs work; int4 and fp8 weights give the dequantized model's tokens;
an fp8 K/V cache gives the bfloat16 cache's. Skipped without a CUDA device (CI has none):
run on a GPU machine with ``SWITCHBOARD_GPU_TOKENIZER`` naming a folder with SmolLM2's config.json and
tokenizer files (a random-weight model of its shape is built from them):

    SWITCHBOARD_GPU_TOKENIZER=DIR python3 -m pytest -q -p no:cacheprovider tests/unit/test_cuda_engine.py

Run it in its own pytest process: ``test_triton_kernels.py`` switches Triton to its CPU interpreter."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or not os.environ.get("SWITCHBOARD_GPU_TOKENIZER"),
                                reason="needs a CUDA device and SWITCHBOARD_GPU_TOKENIZER")

BLOCK = 16
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """SmolLM2-135M's shape with random weights (float32), as transformers initialises it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    source = Path(os.environ["SWITCHBOARD_GPU_TOKENIZER"])
    out = tmp_path_factory.mktemp("cuda-model")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig.from_pretrained(source)).save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (source / name).exists():
            (out / name).write_bytes((source / name).read_bytes())
    return out


def runner(model_dir, dtype=torch.float32, graphs=True, quantization="none", kv_cache_dtype="auto"):
    from services.engine.devices import Device
    from services.engine.graphs import GraphPlan
    from services.engine.model_runner import ModelRunner

    return ModelRunner(str(model_dir), Device("cuda", dtype), block_size=BLOCK, kv_budget_bytes=1 << 30,
                       max_blocks=2048, graphs=GraphPlan(16, 1024, max_tokens=64) if graphs else None,
                       quantization=quantization, kv_cache_dtype=kv_cache_dtype)


def generate(r, reqs, mix=True, steps_ahead=False):
    from services.engine.engine import Engine
    from services.engine.scheduler import Limits

    engine = Engine(r, Limits(16, 16, 8192, 1024, mix=mix, prefill_chunk_size=32), {2}, steps_ahead=steps_ahead)
    for req in reqs:
        engine.add_request(req)
    tokens, events = {}, {}
    for _ in range(2000):
        if not engine.has_work:
            break
        for e in engine.step():
            tokens.setdefault(e.id, []).extend(e.token_ids)
            events.setdefault(e.id, []).append(e)
    assert not steps_ahead or engine.ahead.launches > 0
    return tokens, events


def request(rid, ids, **sampling):
    from shared.messages import EngineRequest, Sampling

    sampling.setdefault("do_sample", False)
    return EngineRequest(id=rid, prompt_ids=ids, sampling=Sampling(**sampling), reply_to="x")


def prompt(n, start=100):
    return [start + (7 * i) % 5000 for i in range(n)]


def test_greedy_tokens_equal_hf_generate_float32(model_dir):
    from transformers import AutoModelForCausalLM

    prompts = [prompt(5), prompt(19, 300), prompt(33, 700), prompt(64, 40)]
    r = runner(model_dir)
    ours, _ = generate(r, [request(f"r{i}", p, max_new_tokens=24, ignore_eos=True) for i, p in enumerate(prompts)])
    assert r.graphs.replays > 0 and r.pieces.replays > 0
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    for i, p in enumerate(prompts):
        out = model.generate(torch.tensor([p], device="cuda"), max_new_tokens=24, min_new_tokens=24, do_sample=False)
        assert ours[f"r{i}"] == out[0, len(p):].tolist(), f"prompt {i}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graph_replay_equals_the_eager_step(model_dir, dtype):
    from shared.grammar import json_schema

    schema = {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]}

    def reqs():
        return [request("greedy", prompt(7), max_new_tokens=40, logprobs=3, ignore_eos=True),
                request("seeded", prompt(21, 900), max_new_tokens=33, do_sample=True, temperature=0.8, top_p=0.9,
                        seed=3, logprobs=3, ignore_eos=True),
                request("json", prompt(12, 50), max_new_tokens=30, do_sample=True, seed=4, grammar=json_schema(schema)),
                request("long", prompt(300, 11), max_new_tokens=9, logprobs=3, ignore_eos=True)]

    graphed, eager = runner(model_dir, dtype), runner(model_dir, dtype, graphs=False)
    ours, our_events = generate(graphed, reqs())
    theirs, their_events = generate(eager, reqs())
    assert graphed.graphs.replays > 10 and graphed.pieces.replays > 3
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    for rid in theirs:
        if dtype == torch.float32:
            assert ours[rid] == theirs[rid], rid
        else:  # bfloat16: equal up to the first near tie (different GEMM shapes round differently)
            n = next((i for i, (a, b) in enumerate(zip(ours[rid], theirs[rid])) if a != b), None)
            assert n is None or n >= 5, rid
            ours[rid], theirs[rid] = ours[rid][:n], theirs[rid][:n]
        a = [lp.logprob for e in our_events[rid] for lp in e.logprobs or []][: len(ours[rid])]
        b = [lp.logprob for e in their_events[rid] for lp in e.logprobs or []][: len(theirs[rid])]
        assert a == pytest.approx(b, abs=tolerance), rid


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_steps_launched_ahead_give_the_replayed_steps_tokens(model_dir, dtype, monkeypatch):
    """Token ids copied on the device from the last replay's argmax and seeded draws (ahead.py) give the tokens
    read back step by step (float32 exactly; bfloat16 to the near-tie rule). Requests end at different steps, with
    logprobs, draws and penalties; a constrained one makes steps the ordinary kind while it runs. A launch never
    waits on the GPU: torch's sync debug mode raises at any synchronizing call inside one."""
    from services.engine.ahead import StepsAhead
    from shared.grammar import json_schema

    schema = {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]}

    launch = StepsAhead.launch

    def checked(self, items):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return launch(self, items)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    def reqs():
        return [request(f"g{i}", prompt(5 + 9 * i, 100 * i), max_new_tokens=12 + 11 * i, ignore_eos=True,
                        logprobs=2 if i == 1 else None) for i in range(5)] + [
                request("eos", prompt(9, 77), max_new_tokens=50),
                request("seeded", prompt(15, 40), max_new_tokens=40, do_sample=True, temperature=0.9, top_k=40,
                        top_p=0.95, seed=5, ignore_eos=True),
                request("penalised", prompt(11, 60), max_new_tokens=30, repetition_penalty=1.2, presence_penalty=0.3,
                        do_sample=True, typical_p=0.9, seed=6, ignore_eos=True),
                request("json", prompt(12, 50), max_new_tokens=15, do_sample=True, seed=4, grammar=json_schema(schema))]

    r = runner(model_dir, dtype)
    theirs, _ = generate(r, reqs())
    monkeypatch.setattr(StepsAhead, "launch", checked)
    ours, events = generate(r, reqs(), steps_ahead=True)
    for rid, evs in events.items():
        assert [e.position for e in evs if e.token_ids] == list(range(len(ours[rid]))), rid
    if dtype == torch.float32:
        assert ours == theirs
        return
    # bfloat16: a step launched ahead holds a row for each sequence that finished in the step before (dropped when
    # it lands), so some steps replay a larger graph, whose GEMMs may round a near tie the other way
    for rid in theirs:
        n = next((i for i, (a, b) in enumerate(zip(ours[rid], theirs[rid])) if a != b), None)
        assert n is None or n >= 5, rid


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_kernels_equal_the_pytorch_operations_on_cuda(dtype):
    from services.engine import triton_fp8
    from services.engine.kernels import TorchOps
    from services.engine.triton_ops import TritonOps

    ops, ref = TritonOps(), TorchOps()
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.manual_seed(0)
    heads, kv_heads, dim, n = 32, 8, 128, 5
    k_cache = torch.randn(kv_heads, 64 * BLOCK, dim, dtype=dtype, device="cuda")
    v_cache = torch.randn_like(k_cache)
    lens = torch.tensor([1, 17, 300, 64, 1000], device="cuda")
    tables = torch.stack([torch.randperm(64, device="cuda")[:63] for _ in range(n)])
    q = torch.randn(n, heads * dim, dtype=dtype, device="cuda")
    args = (tables, lens, BLOCK, heads, kv_heads, dim, dim ** -0.5)
    want = ref.paged_decode(q, k_cache, v_cache, *args)
    for per_program in (None, 1, 2, 4):  # rows 300 and 1000 in pieces of 256 and 256 (flash-decoding)
        torch.testing.assert_close(ops.paged_decode(q, k_cache, v_cache, *args, per_program=per_program), want, **tol)
        torch.testing.assert_close(ops.paged_decode(q, k_cache, v_cache, *args, per_program=per_program,
                                                    split_from=32), want, **tol)  # up to 16 pieces of 64
    assert not triton_fp8.arrival_counters(q.device).any()
    x, w = torch.randn(n, 4096, dtype=dtype, device="cuda"), torch.rand(4096, dtype=dtype, device="cuda") + 0.5
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-5), ref.rms_norm(x, w, 1e-5), **tol)
    r1, r2 = x.clone(), x.clone()
    torch.testing.assert_close(ops.add_rms_norm(x * 2, r1, w, 1e-5), ref.add_rms_norm(x * 2, r2, w, 1e-5), **tol)
    assert torch.equal(r1, r2)
    gu = torch.randn(n, 2 * 14336, dtype=dtype, device="cuda")
    torch.testing.assert_close(ops.silu_mul(gu), ref.silu_mul(gu), **tol)
    if torch.cuda.get_device_capability() >= (8, 9):  # fp8 W8A8's activations: the same codes and scales
        (q, s), (q_ref, s_ref) = ops.fp8_rows(gu[:, :14336]), ref.fp8_rows(gu[:, :14336])
        assert torch.equal(s, s_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
        check_fp8_gemv(ops, ref, dtype)
    # one paged prefill for three prompt pieces: a whole prompt, one after 300 cached positions, a short one
    pieces = [(5, 0, 40, tables[0].tolist()), (45, 300, 70, tables[2].tolist()), (115, 900, 3, tables[4].tolist())]
    qp = torch.randn(118, heads * dim, dtype=dtype, device="cuda")
    got = torch.zeros(118, heads * dim, dtype=dtype, device="cuda")
    ops.paged_prefill(qp, k_cache, v_cache, ops.prefill_plan(pieces, BLOCK, qp.device), got, BLOCK, heads, kv_heads,
                      dim, dim ** -0.5)
    for row, pos, n_rows, table in pieces:
        slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(pos + n_rows)], device="cuda")
        mask = torch.arange(pos + n_rows, device="cuda")[None, :] <= (pos + torch.arange(n_rows, device="cuda"))[:, None]
        q3 = qp[row:row + n_rows].view(n_rows, heads, dim).transpose(0, 1)[None]
        want = torch.nn.functional.scaled_dot_product_attention(
            q3, k_cache[:, slots][None], v_cache[:, slots][None], attn_mask=mask, scale=dim ** -0.5, enable_gqa=True)
        torch.testing.assert_close(got[row:row + n_rows], want[0].transpose(0, 1).reshape(n_rows, heads * dim), **tol)


def check_fp8_gemv(ops, ref, dtype):
    """The decode rows' fp8 product in one launch, the 8B shape's down (split across the processors, the last
    split adding the parts) and gate_up (not split), eagerly and replayed as a graph, each time with the
    arrival counters back at zero."""
    from services.engine import triton_fp8

    for n, k in ((4096, 14336), (28672, 4096)):
        codes, scale = ref.fp8_rows(torch.randn(n, k, device="cuda") * 0.02)
        scale = scale.reshape(-1)
        for rows in (1, 5, 16):
            x = torch.randn(rows, k, dtype=dtype, device="cuda")
            want = ref.fp8_gemv(x, codes, scale, torch.float32)
            tol = dict(rtol=1e-3, atol=1e-4 * float(want.abs().max()))
            torch.testing.assert_close(ops.fp8_gemv(x, codes, scale, torch.float32), want, **tol)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = ops.fp8_gemv(x, codes, scale, torch.float32)
            for _ in range(3):
                out.zero_()
                graph.replay()
                torch.testing.assert_close(out, want, **tol)
            assert not triton_fp8.arrival_counters(x.device).any()


def test_prompt_logprobs_on_cuda(model_dir):
    """The 500 of issue 23: prompt logprobs ran lm_head outside inference mode on cuda."""
    from transformers import AutoModelForCausalLM

    ids = prompt(40)
    _, events = generate(runner(model_dir), [request("p", ids, max_new_tokens=2, prompt_logprobs=0)])
    got = [lp.logprob for lp in events["p"][0].prompt_logprobs[1:]]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    with torch.inference_mode():
        logits = model(torch.tensor([ids], device="cuda")).logits[0].float().log_softmax(-1)
    want = [float(logits[i, ids[i + 1]]) for i in range(len(ids) - 1)]
    assert got == pytest.approx(want, abs=1e-3)


def test_the_host_tier_brings_evicted_prefixes_back_with_the_same_tokens(model_dir):
    """Eight device blocks: b's prompt evicts a's blocks to pinned host memory; a's next turn copies them back
    (queued on the stream the CUDA graphs replay on) and gives the tokens a cache without a tier gives."""
    from services.engine.devices import Device
    from services.engine.engine import Engine
    from services.engine.graphs import GraphPlan
    from services.engine.model_runner import ModelRunner
    from services.engine.scheduler import Limits

    def small(host_blocks):
        r = ModelRunner(str(model_dir), Device("cuda", torch.bfloat16), block_size=BLOCK, kv_budget_bytes=1 << 30,
                        max_blocks=8, graphs=GraphPlan(4, 256))
        return Engine(r, Limits(4, 4, 4096, 256, mix=True, prefill_chunk_size=32), {2}, prefix_cache=True,
                      host_blocks=host_blocks)

    first = prompt(3 * BLOCK + 5, 600)
    turns = [("a", first), ("b", prompt(7 * BLOCK, 40)), ("a2", first + prompt(4, 300))]  # b takes all 8
    results = []
    for host_blocks in (0, 8):
        engine, tokens = small(host_blocks), {}
        for rid, ids in turns:
            engine.add_request(request(rid, ids, max_new_tokens=8))
            for _ in range(200):
                if not engine.has_work:
                    break
                for e in engine.step():
                    tokens.setdefault(e.id, []).extend(e.token_ids)
        results.append((tokens, engine.blocks.prefix_hit_tokens))
    (plain, plain_hits), (tiered, tiered_hits) = results
    assert tiered == plain and plain_hits == 0 and tiered_hits == 3 * BLOCK


class Dequantized(torch.nn.Module):
    """A GPU-format layer's reference: its dequantized weight in float32 times the activations it multiplies
    (fp8: rounded to e4m3 as the layer rounds them: a decode step's rows by 128 columns, ``TorchOps.fp8_gemv``,
    in float32; more rows each with its scale)."""

    def __init__(self, layer):
        super().__init__()
        self.layer, self.weight = layer, layer.dequantized(torch.float32)
        self.in_features, self.out_features = layer.in_features, layer.out_features

    def forward(self, x):
        from services.engine.kernels import TorchOps
        from services.engine.quant_cuda import Fp8Linear

        a = x.float()
        if isinstance(self.layer, Fp8Linear):
            if self.layer._as_gemv(x):
                return TorchOps.fp8_gemv(x, self.layer.weight_t.T, self.layer.scale.reshape(-1),
                                         torch.float32).to(x.dtype)
            q, scale = TorchOps.fp8_rows(x)
            a = q.float() * scale
        return (a @ self.weight.T).to(x.dtype)


@pytest.mark.parametrize("fmt", ["int4", "fp8"])
def test_quantized_weights_give_the_dequantized_models_tokens_on_cuda(model_dir, fmt):
    """``Switchboard.quantization`` on cuda (``quant_cuda.py``): every projection in the format, decode and step
    graphs replayed, the lm_head bfloat16; greedy tokens equal the same runner's with each projection replaced
    by its dequantized float32 product, run eagerly, up to the first near tie; the layers hold the format's bytes."""
    from services.engine.quant_cuda import Fp8Linear, Int4Linear

    if fmt == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs compute capability 8.9")
    quantized = runner(model_dir, torch.bfloat16, quantization=fmt)
    reference = runner(model_dir, torch.bfloat16, graphs=False, quantization=fmt)
    cls = Int4Linear if fmt == "int4" else Fp8Linear
    names = ("qkv", "o", "gate_up", "down")
    assert all(isinstance(getattr(lin, name), cls) for lin in quantized.linears for name in names)
    assert type(quantized.model.lm_head) is torch.nn.Linear
    weights = sum(getattr(lin, name).nbytes for lin in quantized.linears for name in names)
    params = sum(getattr(lin, name).in_features * getattr(lin, name).out_features
                 for lin in quantized.linears for name in names)
    assert weights <= params * (0.63 if fmt == "int4" else 1.01)
    for mine, theirs in zip(quantized.linears, reference.linears):
        for name in names:
            setattr(theirs, name, Dequantized(getattr(mine, name)))
    assert_greedy_alike(quantized, reference)
    assert quantized.graphs.replays > 10


def assert_greedy_alike(ours, theirs):
    """Greedy tokens of three requests (one prompt chunked beside decodes) equal up to the first near tie."""
    def reqs():
        return [request("a", prompt(7), max_new_tokens=24, ignore_eos=True),
                request("b", prompt(60, 900), max_new_tokens=24, ignore_eos=True),
                request("c", prompt(200, 50), max_new_tokens=12, ignore_eos=True)]

    mine, _ = generate(ours, reqs())
    other, _ = generate(theirs, reqs())
    for rid in other:
        n = next((i for i, (a, b) in enumerate(zip(mine[rid], other[rid])) if a != b), None)
        assert n is None or n >= 5, (rid, mine[rid], other[rid])


def test_an_fp8_kv_cache_gives_the_bfloat16_caches_tokens_on_cuda(model_dir):
    """``kvCacheDtype: fp8_e4m3``: half a bfloat16 cache's bytes per block; the Triton kernels write e4m3 as the
    PyTorch operations round it; greedy tokens (decode and step graphs replayed, prompts chunked beside decodes)
    equal the bfloat16 cache's up to the first near tie; a block's bytes round-trip (prefill/decode handoffs)."""
    from services.engine.kernels import TorchOps
    from services.engine.triton_ops import TritonOps

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs compute capability 8.9")
    torch.manual_seed(0)
    qkv = torch.randn(5, (32 + 16) * 128, dtype=torch.bfloat16, device="cuda")
    cos, sin = torch.rand(64, 64, device="cuda"), torch.rand(64, 64, device="cuda")
    positions, slots = torch.tensor([0, 3, 9, 33, 63], device="cuda"), torch.tensor([4, 17, 40, 2, 9], device="cuda")
    written = []
    for ops in (TritonOps(), TorchOps()):
        k, v = (torch.zeros(8, 64, 128, dtype=torch.float8_e4m3fn, device="cuda") for _ in range(2))
        ops.rope_store(qkv.clone(), cos, sin, positions, k, v, slots, 32, 8, 128)
        written.append((k.view(torch.uint8), v.view(torch.uint8)))
    assert all(torch.equal(a, b) for a, b in zip(*written))

    fp8, plain = runner(model_dir, torch.bfloat16, kv_cache_dtype="fp8_e4m3"), runner(model_dir, torch.bfloat16)
    assert fp8.kv.k.dtype == torch.float8_e4m3fn and 2 * fp8.block_bytes == plain.block_bytes
    assert_greedy_alike(fp8, plain)
    data = fp8.kv.block_bytes(3, BLOCK)
    assert len(data) == fp8.block_bytes
    fp8.kv.write_block(5, BLOCK, data)
    assert fp8.kv.block_bytes(5, BLOCK) == data
