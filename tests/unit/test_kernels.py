"""The engine's fused CPU kernels compute what their PyTorch versions (kernels.TorchOps) compute."""

from __future__ import annotations

import pytest
import torch

from services.engine import kernels

HEADS, KV_HEADS, DIM, BLOCK = 6, 2, 16, 4
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


@pytest.fixture(scope="module")
def cpu_ops():
    ops = kernels.for_device(torch.device("cpu"))
    if not ops.fused:
        pytest.skip("no C++ compiler here: the engine runs the PyTorch operations")
    return ops


def rope_tables(positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000 ** (torch.arange(0, DIM, 2).float() / DIM))
    angles = torch.arange(positions)[:, None].float() * inv
    return angles.cos(), angles.sin()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms_and_activation(cpu_ops, dtype):
    torch.manual_seed(0)
    x, y = torch.randn(5, 48, dtype=dtype), torch.randn(5, 48, dtype=dtype)
    weight = torch.rand(48, dtype=dtype) + 0.5
    ref = kernels.TorchOps()
    torch.testing.assert_close(cpu_ops.rms_norm(x, weight, 1e-6), ref.rms_norm(x, weight, 1e-6), **TOLERANCE[dtype])
    res_cpu, res_ref = x.clone(), x.clone()
    out_cpu, out_ref = cpu_ops.add_rms_norm(y, res_cpu, weight, 1e-6), ref.add_rms_norm(y, res_ref, weight, 1e-6)
    torch.testing.assert_close(res_cpu, res_ref, rtol=0, atol=0)  # the residual is rounded exactly like h + x
    torch.testing.assert_close(out_cpu, out_ref, **TOLERANCE[dtype])
    gate_up = torch.randn(5, 64, dtype=dtype) * 4
    torch.testing.assert_close(cpu_ops.silu_mul(gate_up), ref.silu_mul(gate_up), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_store_rotates_in_place_and_writes_the_cache(cpu_ops, dtype):
    check_rope_store(cpu_ops, dtype)


def check_rope_store(ops, dtype) -> None:
    """``ops.rope_store`` rotates q and k like ``TorchOps`` and writes k and v at the slots (also the Triton kernels')."""
    torch.manual_seed(1)
    cos, sin = rope_tables(64)
    width = (HEADS + 2 * KV_HEADS) * DIM
    strided = torch.randn(7, width + 8, dtype=dtype)[:, :width]  # rows with a stride, as a slice of a larger output
    positions, slots = torch.tensor([0, 3, 9, 17, 33, 40, 63]), torch.tensor([5, 0, 31, 8, 12, 2, 20])
    results = []
    for each in (ops, kernels.TorchOps()):
        qkv = strided.clone()
        k_cache, v_cache = torch.zeros(KV_HEADS, 32, DIM, dtype=dtype), torch.zeros(KV_HEADS, 32, DIM, dtype=dtype)
        each.rope_store(qkv, cos, sin, positions, k_cache, v_cache, slots, HEADS, KV_HEADS, DIM)
        results.append((qkv, k_cache, v_cache))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, **TOLERANCE[dtype])
    assert torch.equal(results[0][2][:, slots], strided[:, (HEADS + KV_HEADS) * DIM:].view(7, KV_HEADS, DIM).transpose(0, 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_decode_matches_gathered_attention(cpu_ops, dtype):
    torch.manual_seed(2)
    num_blocks = 24
    k_cache = torch.randn(KV_HEADS, num_blocks * BLOCK, DIM, dtype=dtype)
    v_cache = torch.randn(KV_HEADS, num_blocks * BLOCK, DIM, dtype=dtype)
    lens = torch.tensor([1, 5, 16, 13])  # one position, a partial block, whole blocks, ragged
    tables = torch.tensor([[3, 0, 0, 0], [7, 1, 0, 0], [2, 9, 11, 4], [20, 5, 6, 0]])
    q = torch.randn(4, HEADS * DIM + 5, dtype=dtype)[:, : HEADS * DIM]
    args = (tables, lens, BLOCK, HEADS, KV_HEADS, DIM, DIM ** -0.5)
    got = cpu_ops.paged_decode(q, k_cache, v_cache, *args)
    want = kernels.TorchOps().paged_decode(q, k_cache, v_cache, *args)
    torch.testing.assert_close(got, want, **TOLERANCE[dtype])
    only = kernels.TorchOps().paged_decode(q[1:2], k_cache, v_cache, tables[1:2], lens[1:2], *args[2:])
    torch.testing.assert_close(got[1:2], only, **TOLERANCE[dtype])  # rows do not see each other's cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (8, 2, 128), (3, 3, 32), (24, 3, 64)])
def test_paged_decode_at_model_shapes(cpu_ops, dtype, heads, kv_heads, dim):
    """Head sizes of real models (where bfloat16 scores take the vdpbf16ps path on CPUs that have it: 16
    positions at a time, a last partial group, one position), and a KV group past that path's largest."""
    torch.manual_seed(4)
    block = 16
    k_cache = torch.randn(kv_heads, 40 * block, dim, dtype=dtype)
    v_cache = torch.randn(kv_heads, 40 * block, dim, dtype=dtype)
    lens = torch.tensor([1, 16, 17, 130, 300])
    tables = torch.stack([torch.randperm(40)[:19] for _ in range(5)])
    q = torch.randn(5, heads * dim, dtype=dtype)
    args = (tables, lens, block, heads, kv_heads, dim, dim ** -0.5)
    got = cpu_ops.paged_decode(q, k_cache, v_cache, *args)
    torch.testing.assert_close(got, kernels.TorchOps().paged_decode(q, k_cache, v_cache, *args), **TOLERANCE[dtype])


def reference_prefill(q, k_cache, v_cache, pieces, block, heads, kv_heads, dim):
    """Each piece's rows attend to positions [0, own position], gathered through the block table (float32)."""
    out = torch.zeros(q.shape[0], heads * dim)
    for row, pos, n, table in pieces:
        slots = torch.tensor([table[p // block] * block + p % block for p in range(pos + n)])
        k = k_cache[:, slots].float().repeat_interleave(heads // kv_heads, 0)  # [heads, P, dim]
        v = v_cache[:, slots].float().repeat_interleave(heads // kv_heads, 0)
        qs = q[row:row + n].float().view(n, heads, dim).transpose(0, 1)  # [heads, n, dim]
        scores = qs @ k.transpose(1, 2) * dim ** -0.5
        visible = torch.arange(pos + n)[None, :] <= (pos + torch.arange(n))[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        out[row:row + n] = (scores.softmax(-1) @ v).transpose(0, 1).reshape(n, heads * dim)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (8, 2, 128), (5, 5, 80), (10, 2, 32), (2, 1, 16)])
def test_paged_prefill_matches_masked_attention_and_ignores_how_a_prompt_was_cut(cpu_ops, dtype, heads, kv_heads,
                                                                                  dim):
    """Pieces of one step in one call: a whole prompt, a piece after a cached prefix longer than a unit's rows,
    a short piece late in a long sequence; rows the plan does not name (decode rows) are left alone. Model head
    sizes, and query heads per KV head of 3, 4 and 5 (taken 4 at a time). A row's result is the same, bit for
    bit, when its prompt is cut differently: keys run from position 0 in fixed tiles, each row on its own."""
    if not cpu_ops.module.prefill_supported(dtype, dim):
        pytest.skip(f"this CPU's build attends {dtype} prompts with SDPA")
    torch.manual_seed(3)
    block, num_blocks = 16, 40
    k_cache = torch.randn(kv_heads, num_blocks * block, dim, dtype=dtype)
    v_cache = torch.randn(kv_heads, num_blocks * block, dim, dtype=dtype)
    table_a = torch.randperm(num_blocks)[:30].tolist()
    table_b = torch.randperm(num_blocks)[:12].tolist()
    pieces = [(2, 0, 7, table_a[:1]), (9, 13, 75, table_b), (84, 450, 3, table_a)]  # rows 0-1: decode rows
    q = torch.randn(87, heads * dim + 3, dtype=dtype)[:, : heads * dim]
    out = torch.full((87, heads * dim), 7.0, dtype=dtype)
    cpu_ops.paged_prefill(q, k_cache, v_cache, cpu_ops.prefill_plan(pieces, block, q.device), out, block, heads,
                          kv_heads, dim, dim ** -0.5)
    want = reference_prefill(q, k_cache, v_cache, pieces, block, heads, kv_heads, dim)
    assert torch.all(out[:2] == 7.0)
    torch.testing.assert_close(out[2:].float(), want[2:], **TOLERANCE[dtype])
    cut = [(9, 13, 4, table_b), (13, 17, 33, table_b), (46, 50, 38, table_b)]  # rows 9-83 again, cut elsewhere
    again = torch.zeros_like(out)
    cpu_ops.paged_prefill(q, k_cache, v_cache, cpu_ops.prefill_plan(cut, block, q.device), again, block, heads,
                          kv_heads, dim, dim ** -0.5)
    assert torch.equal(again[9:84], out[9:84])


def test_the_engine_attends_prompts_with_the_kernel_where_it_runs_them(cpu_ops):
    """The int8 cache and head sizes off the 16-lane grid take SDPA per chunk; PyTorch's operations always do."""
    assert cpu_ops.prefills(torch.float32, 64, False) == cpu_ops.module.prefill_supported(torch.float32, 64)
    assert not cpu_ops.prefills(torch.float32, 64, True)
    assert not cpu_ops.prefills(torch.float32, 24, False)
    assert not kernels.TorchOps().prefills(torch.float32, 64, False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_int8_cache_write_and_read_match_pytorchs(cpu_ops, dtype):
    """rope_store_q8 writes the codes and float16 scales kv_cache.quantize gives (one per head and position,
    within one code where the rotation rounds differently), and paged_decode_q8 attends over them like the
    PyTorch reference, and like the float attention over the dequantized cache."""
    from services.engine import kv_cache

    torch.manual_seed(3)
    cos, sin = rope_tables(64)
    width = (HEADS + 2 * KV_HEADS) * DIM
    source = torch.randn(7, width, dtype=dtype) * 3
    positions, slots = torch.tensor([0, 3, 9, 17, 33, 40, 63]), torch.tensor([5, 0, 31, 8, 12, 2, 20])
    caches = []
    for each in (cpu_ops, kernels.TorchOps()):
        qkv = source.clone()
        k, v = torch.zeros(KV_HEADS, 32, DIM, dtype=torch.int8), torch.zeros(KV_HEADS, 32, DIM, dtype=torch.int8)
        ks, vs = torch.zeros(KV_HEADS, 32, dtype=torch.float16), torch.zeros(KV_HEADS, 32, dtype=torch.float16)
        each.rope_store_q8(qkv, cos, sin, positions, k, v, ks, vs, slots, HEADS, KV_HEADS, DIM)
        caches.append((qkv, k, v, ks, vs))
    (qkv, k, v, ks, vs), (ref_qkv, ref_k, ref_v, ref_ks, ref_vs) = caches
    torch.testing.assert_close(qkv, ref_qkv, **TOLERANCE[dtype])
    assert (k.int() - ref_k.int()).abs().max() <= 1 and torch.equal(v, ref_v)  # v is not rotated: exact
    torch.testing.assert_close(ks, ref_ks, rtol=1e-3 if dtype == torch.float32 else 1e-2, atol=0)  # k: rotated apart
    assert torch.equal(vs, ref_vs)
    values = source[:, (HEADS + KV_HEADS) * DIM:].view(7, KV_HEADS, DIM).transpose(0, 1).float()
    back = kv_cache.dequantize(v[:, slots], vs[:, slots], torch.float32)
    assert ((back - values).abs() <= vs[:, slots].float()[..., None] / 2 + 1e-6).all()  # half a step at most

    tables, lens = torch.tensor([[1, 0, 0, 0], [5, 2, 0, 0], [7, 3, 4, 6]]), torch.tensor([3, 7, 16])
    q = torch.randn(3, HEADS * DIM, dtype=dtype)
    args = (tables, lens, BLOCK, HEADS, KV_HEADS, DIM, DIM ** -0.5)
    got = cpu_ops.paged_decode_q8(q, k, v, ks, vs, *args)
    torch.testing.assert_close(got, kernels.TorchOps().paged_decode_q8(q, k, v, ks, vs, *args), **TOLERANCE[dtype])
    dense = kernels.TorchOps().paged_decode(q, kv_cache.dequantize(k, ks, dtype), kv_cache.dequantize(v, vs, dtype), *args)
    torch.testing.assert_close(got, dense, **TOLERANCE[dtype])


def test_dtype_auto_picks_bfloat16_only_with_native_bfloat16():
    from services.engine.devices import cpu_has_native_bf16, resolve_device

    assert cpu_has_native_bf16("flags : fpu avx2 avx512f avx512_bf16")
    assert cpu_has_native_bf16("flags : fpu avx2 amx_bf16 amx_tile")
    assert not cpu_has_native_bf16("flags : fpu avx2 fma avx512f avx512bw")
    expected = torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    assert resolve_device("cpu", "auto").dtype == expected


def test_the_kernels_let_other_threads_run_python(cpu_ops):
    """A kernel releases the GIL while it runs: the engine's event loop (its heartbeats) keeps running while a
    step runs on the engine's thread, instead of waiting for each kernel to end."""
    import threading
    import time

    heads, kv_heads, dim, block = 8, 2, 64, 16
    dtype = torch.float32 if cpu_ops.module.prefill_supported(torch.float32, dim) else None
    if dtype is None:
        pytest.skip("this CPU's build attends prompts with SDPA")
    n = 4096  # (~0.1 s a call on a 2-core EPYC)
    k_cache, v_cache = (torch.randn(kv_heads, n, dim) for _ in range(2))
    q, out = torch.randn(n, heads * dim), torch.empty(n, heads * dim)
    plan = cpu_ops.prefill_plan([(0, 0, n, list(range(n // block)))], block, q.device)
    done, ticks = threading.Event(), []

    def attend():
        for _ in range(3):
            cpu_ops.paged_prefill(q, k_cache, v_cache, plan, out, block, heads, kv_heads, dim, dim ** -0.5)
        done.set()

    started = time.monotonic()
    worker = threading.Thread(target=attend)
    worker.start()
    while not done.is_set():  # the "event loop": a tick every millisecond it is given the GIL
        ticks.append(time.monotonic())
        time.sleep(0.001)
    worker.join()
    took = time.monotonic() - started
    gaps = [b - a for a, b in zip([started, *ticks], ticks)]
    assert max(gaps) < 0.5 * took / 3, (took, max(gaps))  # (holding the GIL, the longest gap was a whole call)
