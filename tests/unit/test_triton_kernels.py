"""The engine's Triton kernels (what cuda runs) compute what their PyTorch versions compute.

No GPU here: ``TRITON_INTERPRET=1`` runs the same kernels on CPU tensors through numpy. It must be set
before ``services.engine.triton_ops`` is first imported (the kernels are made interpretable when
they are defined); no other CPU test imports that module."""

from __future__ import annotations

import importlib
import os

import pytest
import torch

from services.engine import kernels
from tests.unit.test_kernels import check_rope_store, reference_prefill

os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")
triton_ops = importlib.import_module("services.engine.triton_ops")  # (imports triton_fp8, interpretable now)
triton_fp8 = importlib.import_module("services.engine.triton_fp8")
triton, tl = importlib.import_module("triton"), importlib.import_module("triton.language")

HEADS, KV_HEADS, DIM, BLOCK = 6, 2, 16, 4
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}
OPS, REF = triton_ops.TritonOps(), kernels.TorchOps()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms_and_activation(dtype):
    torch.manual_seed(0)
    x, y = torch.randn(5, 48, dtype=dtype), torch.randn(5, 48, dtype=dtype)
    weight = torch.rand(48, dtype=dtype) + 0.5
    torch.testing.assert_close(OPS.rms_norm(x, weight, 1e-6), REF.rms_norm(x, weight, 1e-6), **TOLERANCE[dtype])
    res_triton, res_ref = x.clone(), x.clone()
    out_triton, out_ref = OPS.add_rms_norm(y, res_triton, weight, 1e-6), REF.add_rms_norm(y, res_ref, weight, 1e-6)
    # the residual is rounded like h + x (exactly on a GPU; the interpreter's bfloat16 casts truncate)
    torch.testing.assert_close(res_triton, res_ref, **(TOLERANCE[dtype] if dtype == torch.bfloat16 else dict(rtol=0, atol=0)))
    torch.testing.assert_close(out_triton, out_ref, **TOLERANCE[dtype])
    gate_up = torch.randn(5, 2 * 1100, dtype=dtype) * 4  # wider than one program's block, not a multiple of it
    torch.testing.assert_close(OPS.silu_mul(gate_up), REF.silu_mul(gate_up), **TOLERANCE[dtype])
    assert OPS.rms_norm(x[:0], weight, 1e-6).shape == (0, 48)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_rows_scale_each_row_by_its_largest_value(dtype):
    """fp8 W8A8's activations, one launch: each row's scale and the row over it, written here as float32 (the
    interpreter's e4m3 casts are not a GPU's; the cast itself is checked on cuda)."""
    torch.manual_seed(0)
    rows = (torch.randn(4, 2500) * torch.tensor([[0.01], [1.0], [300.0], [0.0]])).to(dtype)  # > 2 blocks; a zero row
    got, got_scale = OPS.fp8_rows(rows, torch.empty(4, 2500))
    want, want_scale = REF.fp8_rows(rows, torch.empty(4, 2500))
    torch.testing.assert_close(got_scale, want_scale, rtol=1e-6, atol=0)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert torch.equal(got[3], torch.zeros(2500)) and float(got[:3].abs().amax()) == pytest.approx(448.0)
    assert OPS.fp8_rows(rows[:0])[0].shape == (0, 2500)


@pytest.mark.parametrize("n,splits", [(100, 2), (300, 1)])  # 2 or 5 tiles of output channels (2 "processors" here)
@pytest.mark.parametrize("rows", [1, 5, 16])
@pytest.mark.parametrize("activations", ["e4m3", "bfloat16"])
def test_fp8_mm_is_the_rows_times_the_weights_codes_and_scales(n, splits, rows, activations):
    """fp8's decode products: the columns split in parts whose partial sums are added, or not split; edges that
    are no whole tile (neither 100 or 300 channels nor 1,100 columns are); rows in e4m3 with their scales
    (W8A8) or as they are (W8A16). (The e4m3 codes are made by PyTorch: the interpreter's casts are not a GPU's.)"""
    torch.manual_seed(0)
    k = 1100
    assert triton_fp8.fp8_split(n, k, torch.device("cpu"))[0] == splits
    codes, scale = REF.fp8_rows(torch.randn(n, k) * 0.05)  # each output channel in e4m3 with its scale
    x = torch.randn(rows, k, dtype=torch.bfloat16) * torch.logspace(-2, 1, rows, dtype=torch.bfloat16)[:, None]
    args = (REF.fp8_rows(x) if activations == "e4m3" else (x, None))
    got = OPS.fp8_mm(args[0], codes, scale.reshape(-1), args[1], torch.bfloat16)
    want = REF.fp8_mm(args[0], codes, scale.reshape(-1), args[1], torch.bfloat16)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    torch.testing.assert_close(got, want, **TOLERANCE[torch.bfloat16])
    assert OPS.fp8_mm(args[0][:0], codes, scale.reshape(-1), None, torch.bfloat16).shape == (0, n)


@pytest.mark.parametrize("n,splits", [(100, 2), (300, 1)])
@pytest.mark.parametrize("rows", [1, 5, 16])
def test_fp8_gemv_quantizes_the_rows_and_adds_the_splits_in_one_launch(n, splits, rows):
    """fp8's decode products in one launch: each 128 columns of a row quantized to e4m3 over their own scale
    as they load (a group of 1e-4-sized values among them: e4m3's subnormal codes), the columns split in parts
    whose last program to arrive adds them, or not split; edges that are no whole tile or group. The split
    counters are left at zero for the next product, which gives the same numbers; other tiles (channels per
    program, programs per processor) give them too."""
    torch.manual_seed(0)
    k = 1100
    assert triton_fp8.fp8_split(n, k, torch.device("cpu"))[0] == splits
    codes, scale = REF.fp8_rows(torch.randn(n, k) * 0.05)
    x = torch.randn(rows, k, dtype=torch.bfloat16) * torch.logspace(-2, 1, rows, dtype=torch.bfloat16)[:, None]
    x[0, 128:256] *= 1e-4
    want = REF.fp8_gemv(x, codes, scale.reshape(-1), torch.float32)
    for tile in (triton_fp8.GemvTile(), triton_fp8.GemvTile(), triton_fp8.GemvTile(32, 8, 8)):  # (the bench's sweep)
        got = OPS.fp8_gemv(x, codes, scale.reshape(-1), torch.float32, tile)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * float(want.abs().max()))
        assert not triton_fp8.arrival_counters(torch.device("cpu")).any()
    assert OPS.fp8_gemv(x, codes, scale.reshape(-1)).dtype == torch.bfloat16
    assert OPS.fp8_gemv(x[:0], codes, scale.reshape(-1)).shape == (0, n)


def test_the_interpreters_e4m3_rounding_is_a_gpus():
    """What stands in for the e4m3 cast in the interpreter (whose own cast loses the carry when a mantissa rounds
    up to the next power of 2) rounds as PyTorch's cast does: every e4m3 value, every midpoint between two (ties
    to even) and its float32 neighbours, subnormals, and random values up to 448."""

    @triton.jit
    def rounded(x_ptr, out_ptr, size, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(out_ptr + i, triton_fp8._e4m3_round(tl.load(x_ptr + i, mask=i < size)), mask=i < size)

    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    values = codes[codes.isfinite()].unique()
    mids = (values[1:] + values[:-1]) / 2
    torch.manual_seed(0)
    x = torch.cat([values, mids, mids.nextafter(torch.tensor(1e9)), mids.nextafter(torch.tensor(-1e9)),
                   (torch.rand(20000) * 2 - 1) * 448, torch.randn(5000) * 0.01])
    out = torch.empty_like(x)
    rounded[(triton.cdiv(x.numel(), 4096),)](x, out, x.numel(), BLOCK=4096)
    assert torch.equal(out, x.to(torch.float8_e4m3fn).float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_store_rotates_in_place_and_writes_the_cache(dtype):
    check_rope_store(OPS, dtype)


@pytest.mark.parametrize("cache", [torch.bfloat16, torch.float8_e4m3fn])
def test_rope_store_rounds_as_the_pytorch_operations_do(cache):
    """In bfloat16 the kernel rounds each product and sum as ``TorchOps.rotate``'s operations do (HF's rotary
    embedding too): the rotated rows are PyTorch's exactly, and so are an fp8 cache's e4m3 codes (large values
    held at 448), which a value one bfloat16 step off would change where it sits near a midpoint of e4m3's."""
    torch.manual_seed(6)
    heads, kv_heads, dim = 8, 2, 64
    qkv = torch.randn(6, (heads + 2 * kv_heads) * dim, dtype=torch.bfloat16) * 3
    qkv[0, -dim:] = torch.linspace(-900, 900, dim)  # V beyond e4m3's range
    cos, sin = torch.rand(64, dim // 2), torch.rand(64, dim // 2)
    positions, slots = torch.tensor([0, 3, 9, 33, 63, 20]), torch.tensor([4, 17, 40, 2, 9, 31])
    written = []
    for ops in (OPS, REF):
        rows = qkv.clone()
        k, v = (torch.zeros(kv_heads, 48, dim, dtype=cache) for _ in range(2))
        ops.rope_store(rows, cos, sin, positions, k, v, slots, heads, kv_heads, dim)
        written.append((rows, k.view(torch.int8) if cache != torch.bfloat16 else k,
                        v.view(torch.int8) if cache != torch.bfloat16 else v))
    for got, want in zip(*written):
        assert torch.equal(got, want)
    assert (written[0][2].view(cache).float().abs().amax() == 448) == (cache != torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,dim", [(HEADS, KV_HEADS, DIM), (4, 4, 12), (8, 1, 16)])
def test_paged_decode_matches_gathered_attention(dtype, heads, kv_heads, dim):
    """Grouped heads padded to a power of two, a head size that is not one, multi-head and multi-query."""
    torch.manual_seed(2)
    num_blocks = 24
    k_cache = torch.randn(kv_heads, num_blocks * BLOCK, dim, dtype=dtype)
    v_cache = torch.randn(kv_heads, num_blocks * BLOCK, dim, dtype=dtype)
    lens = torch.tensor([1, 5, 16, 13, 70])  # one position, a partial block, whole blocks, ragged, > one tile
    tables = torch.zeros(5, 18, dtype=torch.long)
    tables[:4, :4] = torch.tensor([[3, 0, 0, 0], [7, 1, 0, 0], [2, 9, 11, 4], [20, 5, 6, 0]])
    tables[4] = torch.tensor([23 - i for i in range(18)])
    q = torch.randn(5, heads * dim + 5, dtype=dtype)[:, : heads * dim]
    args = (tables, lens, BLOCK, heads, kv_heads, dim, dim ** -0.5)
    got = OPS.paged_decode(q, k_cache, v_cache, *args)
    want = REF.paged_decode(q, k_cache, v_cache, *args)
    torch.testing.assert_close(got, want, **TOLERANCE[dtype])
    grouped = OPS.paged_decode(q, k_cache, v_cache, *args, per_program=heads // kv_heads)  # a KV group per program
    torch.testing.assert_close(grouped, want, **TOLERANCE[dtype])
    only = REF.paged_decode(q[1:2], k_cache, v_cache, tables[1:2], lens[1:2], *args[2:])
    torch.testing.assert_close(got[1:2], only, **TOLERANCE[dtype])  # rows do not see each other's cache


@pytest.mark.parametrize("heads,kv_heads,dim", [(HEADS, KV_HEADS, DIM), (8, 1, 16)])
def test_long_rows_are_attended_in_pieces_at_once(heads, kv_heads, dim):
    """Flash-decoding: rows longer than ``split_from`` positions are attended in pieces (whole 32-position
    tiles, at least split_from, at most DECODE_SPLITS of them: bigger pieces for longer rows), walked by as
    many programs at once as the grid gives a row, the pieces' softmax states added by the program that stores
    the last of them. A row's pieces follow from its length alone: alone, where its pieces are walked by
    DECODE_SPLITS programs, it gets the numbers it gets in the batch, where fewer share them. The arrival
    counters are left at zero; rows of one piece are the unsplit kernel's numbers exactly."""
    torch.manual_seed(5)
    num_blocks = 160
    k_cache, v_cache = (torch.randn(kv_heads, num_blocks * BLOCK, dim) for _ in range(2))
    lens = torch.tensor([1, 16, 17, 100, 560, 611])  # 1, 1, 1, 4 pieces of 32, 9 and 10 of 64
    tables = torch.stack([torch.randperm(num_blocks)[:155] for _ in range(6)])
    q = torch.randn(6, heads * dim)
    args = (tables, lens, BLOCK, heads, kv_heads, dim, dim ** -0.5)
    want = REF.paged_decode(q, k_cache, v_cache, *args)
    whole = OPS.paged_decode(q, k_cache, v_cache, *args, split_from=4096)  # one piece a row
    for per_program in (1, heads // kv_heads):
        got = OPS.paged_decode(q, k_cache, v_cache, *args, per_program=per_program, split_from=16)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert not triton_fp8.arrival_counters(torch.device("cpu")).any()
        assert torch.equal(got[:3], whole[:3]) and not torch.equal(got[3:], whole[3:])
        alone = OPS.paged_decode(q[5:], k_cache, v_cache, tables[5:], lens[5:], *args[2:], per_program=per_program,
                                 split_from=16)
        assert torch.equal(alone, got[5:])
        narrow = OPS.paged_decode(q, k_cache, v_cache, tables[:, :100], lens.clamp(max=400), *args[2:],
                                  per_program=per_program, split_from=16)  # tables as wide as the rows need
        torch.testing.assert_close(narrow[:4], got[:4], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,dim", [(HEADS, KV_HEADS, DIM), (4, 4, 12), (8, 1, 16)])
def test_paged_prefill_matches_masked_attention_and_ignores_how_a_prompt_was_cut(dtype, heads, kv_heads, dim):
    """Chunks of one step in one launch: a whole prompt, a chunk after a cached prefix, a chunk longer
    than one program's rows; rows the plan does not name (decode rows here) are left alone. A row's
    result is the same when its prompt is cut differently: keys run from position 0 in fixed tiles."""
    torch.manual_seed(3)
    num_blocks = 40
    k_cache = torch.randn(kv_heads, num_blocks * BLOCK, dim, dtype=dtype)
    v_cache = torch.randn(kv_heads, num_blocks * BLOCK, dim, dtype=dtype)
    table_a = [5, 9, 2, 30, 31, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
    table_b = [7, 1, 3, 4, 6, 8, 10, 21, 22, 23, 24, 25]
    pieces = [(2, 0, 7, table_a[:2]), (9, 13, 35, table_b), (44, 50, 3, table_a)]  # rows 0-1: decode rows
    q = torch.randn(47, heads * dim + 3, dtype=dtype)[:, : heads * dim]
    out = torch.full((47, heads * dim), 7.0, dtype=dtype)
    plan = OPS.prefill_plan(pieces, BLOCK, q.device)
    OPS.paged_prefill(q, k_cache, v_cache, plan, out, BLOCK, heads, kv_heads, dim, dim ** -0.5)
    want = reference_prefill(q, k_cache, v_cache, pieces, BLOCK, heads, kv_heads, dim)
    assert torch.all(out[:2] == 7.0)
    torch.testing.assert_close(out[2:].float(), want[2:], **TOLERANCE[dtype])
    # rows 9-43 again, cut into three pieces at other boundaries (positions 13-47 of the same sequence)
    cut = [(9, 13, 4, table_b), (13, 17, 20, table_b), (33, 37, 11, table_b)]
    again = torch.zeros_like(out)
    OPS.paged_prefill(q, k_cache, v_cache, OPS.prefill_plan(cut, BLOCK, q.device), again, BLOCK, heads, kv_heads, dim,
                      dim ** -0.5)
    if dtype == torch.bfloat16:  # (in float32 the interpreter's numpy matmul rounds by a row's place in its tile)
        assert torch.equal(again[9:44], out[9:44])
    torch.testing.assert_close(again[9:44], out[9:44], rtol=1e-6, atol=1e-6)


def test_the_attentions_read_an_fp8_cache_as_its_values_in_the_models_dtype():
    """``kvCacheDtype: fp8_e4m3`` (cuda): the decode and prompt kernels convert the e4m3 codes as they load them,
    so they give what they give on the same cache held in bfloat16. (Writing e4m3 is checked on cuda: the
    interpreter's float32 → e4m3 casts are not a GPU's.)"""
    torch.manual_seed(4)
    heads, kv_heads, dim = HEADS, KV_HEADS, DIM
    k8 = (torch.randn(kv_heads, 40 * BLOCK, dim) * 4).to(torch.float8_e4m3fn)
    v8 = (torch.randn(kv_heads, 40 * BLOCK, dim) * 4).to(torch.float8_e4m3fn)
    k16, v16 = k8.to(torch.bfloat16), v8.to(torch.bfloat16)
    tables = torch.tensor([[3, 0, 0, 0], [7, 1, 9, 4]])
    lens = torch.tensor([3, 14])
    q = torch.randn(2, heads * dim, dtype=torch.bfloat16)
    args = (tables, lens, BLOCK, heads, kv_heads, dim, dim ** -0.5)
    assert torch.equal(OPS.paged_decode(q, k8, v8, *args), OPS.paged_decode(q, k16, v16, *args))
    torch.testing.assert_close(REF.paged_decode(q, k8, v8, *args), REF.paged_decode(q, k16, v16, *args), rtol=0, atol=0)
    pieces = [(0, 0, 7, [5, 9]), (7, 13, 20, [7, 1, 3, 4, 6, 8, 10])]
    qp = torch.randn(27, heads * dim, dtype=torch.bfloat16)
    got, want = (torch.zeros(27, heads * dim, dtype=torch.bfloat16) for _ in range(2))
    for out, (k, v) in ((got, (k8, v8)), (want, (k16, v16))):
        OPS.paged_prefill(qp, k, v, OPS.prefill_plan(pieces, BLOCK, qp.device), out, BLOCK, heads, kv_heads, dim,
                          dim ** -0.5)
    assert torch.equal(got, want)


def test_pytorch_operations_store_into_an_fp8_cache_and_read_it_back():
    """What npu (and cuda without the Triton kernels) runs: rotated K and V rounded into the cache's e4m3."""
    torch.manual_seed(5)
    qkv = torch.randn(3, (HEADS + 2 * KV_HEADS) * DIM, dtype=torch.bfloat16)
    cos, sin = torch.rand(64, DIM // 2), torch.rand(64, DIM // 2)
    positions, slots = torch.tensor([0, 9, 33]), torch.tensor([4, 17, 40])
    caches = {dt: [torch.zeros(KV_HEADS, 12 * BLOCK, DIM, dtype=dt) for _ in range(2)]
              for dt in (torch.bfloat16, torch.float8_e4m3fn)}
    for dt, (k, v) in caches.items():
        REF.rope_store(qkv.clone(), cos, sin, positions, k, v, slots, HEADS, KV_HEADS, DIM)
    (k16, v16), (k8, v8) = caches[torch.bfloat16], caches[torch.float8_e4m3fn]
    assert torch.equal(k8.view(torch.uint8), k16.to(torch.float8_e4m3fn).view(torch.uint8))
    assert torch.equal(v8.view(torch.uint8), v16.to(torch.float8_e4m3fn).view(torch.uint8))


def test_the_fp8_cache_holds_twice_bfloat16s_tokens_and_runs_where_its_kernels_do():
    from services.engine.kv_cache import check_dtype, token_bytes

    assert token_bytes(30, 3, 64, torch.bfloat16, "auto") == 2 * token_bytes(30, 3, 64, torch.bfloat16, "fp8_e4m3")
    with pytest.raises(ValueError, match='"fp8_e4m3" runs on cuda only; the engine\'s device is cpu'):
        check_dtype("fp8_e4m3", torch.device("cpu"))
    with pytest.raises(ValueError, match='"int8" runs on cpu only; the engine\'s device is cuda'):
        check_dtype("int8", torch.device("cuda"))


def test_a_runner_on_the_triton_kernels_gives_the_pytorch_operations_tokens(tiny_model_dir):
    """The runner as cuda runs it (every small operation a Triton kernel, a step's prompt chunks in one
    paged prefill, Mix steps from the step graphs' buffers), through the interpreter: the tokens and
    logprobs of the PyTorch operations' runner."""
    from services.engine.engine import Engine
    from services.engine.graphs import GraphPlan
    from services.engine.model_runner import ModelRunner
    from tests.unit.engine_helpers import BLOCK as CACHE_BLOCK, CPU, LOGPROB_ATOL, limits, outputs, prompt, request
    from tests.unit.engine_helpers import run_until_idle

    def tokens(ops, graphs):
        r = ModelRunner(str(tiny_model_dir), CPU, block_size=CACHE_BLOCK, kv_budget_bytes=1 << 24, max_blocks=64,
                        cpu_kernels=False, graphs=graphs)
        r.ops = ops
        engine = Engine(r, limits(mix=True, prefill_chunk_size=16), {2})
        for i, n in enumerate((5, 23, 40)):
            engine.add_request(request(f"r{i}", prompt(n, start=100 * i), max_new_tokens=6, ignore_eos=True, logprobs=2))
        return outputs(run_until_idle(engine)), r

    theirs, _ = tokens(REF, None)
    ours, r = tokens(OPS, GraphPlan(max_rows=4, max_seq_len=256, capture=False, max_tokens=32))
    assert r.pieces.steps >= 3 and r.graphs.steps >= 3
    for rid in theirs:
        assert [t for t, _, _ in ours[rid]] == [t for t, _, _ in theirs[rid]], rid
        assert [lp for _, lp, _ in ours[rid]] == pytest.approx([lp for _, lp, _ in theirs[rid]], abs=LOGPROB_ATOL)
