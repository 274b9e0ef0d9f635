"""The Triton kernels compile for the GPUs they run on, with no GPU here: Triton's own ptxas builds each one for
Hopper (sm90: H100, H200) and Ada (sm89: L4, the oldest with fp8), over bfloat16 and fp8 e4m3 K/V caches. The
interpreter (``test_triton_kernels.py``) checks what they compute; this catches what only a GPU's compiler
would refuse (an fp8 conversion, a dot of mixed types) before a device session does. In a subprocess: the
interpreter's switch is process-wide."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = r'''
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from services.engine import triton_fp8 as F, triton_ops as T

SCALARS = {"scale": "fp32", "eps": "fp32", "fp8_max": "fp32", "tiny": "fp32"}


def build(kernel, pointers, constants, arch, **options):
    signature = {}
    for name in kernel.arg_names:
        if name in constants:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = "*" + pointers.get(name, "bf16")
        else:
            signature[name] = SCALARS.get(name, "i32")
    built = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constants),
                           target=GPUTarget("cuda", arch, 32), options=options)
    print(kernel.__name__, arch, flush=True)
    return built


for arch in (90, 89):
    build(F._fp8_rows_kernel, {"q_ptr": "fp8e4nv", "scale_ptr": "fp32"}, {"BLOCK": 1024}, arch)
    build(T._rms_norm_kernel, {}, {"ADD": True, "BLOCK": 4096}, arch)
    build(T._silu_mul_kernel, {}, {"BLOCK": 1024}, arch)
    # fp8 GEMVs: rows in e4m3 (W8A8) or bfloat16 (W8A16); the product written whole, or its column splits' sums
    for x, out in (("fp8e4nv", "bf16"), ("fp8e4nv", "fp32"), ("bf16", "fp32")):
        build(F._fp8_mm_kernel, {"x_ptr": x, "x_scale_ptr": "fp32", "w_ptr": "fp8e4nv", "scale_ptr": "fp32",
                                 "out_ptr": out},
              {"BLOCK_M": 16, "BLOCK_N": F.FP8_MM_N, "BLOCK_K": F.FP8_MM_K, "ROW_SCALES": x != "bf16",
               "UPCAST": False}, arch)
    # fp8 decode products in one launch (the rows quantized in the kernel; the parts summed by the last split)
    for out in ("bf16", "fp32"):
        build(F._fp8_gemv_kernel, {"w_ptr": "fp8e4nv", "scale_ptr": "fp32", "out_ptr": out, "part_ptr": "fp32",
                                   "lock_ptr": "i32"},
              {"BLOCK_M": 16, "BLOCK_N": F.FP8_MM_N, "BLOCK_K": F.FP8_MM_K, "EMULATE": False}, arch)
    for kv in ("bf16", "fp8e4nv"):
        cache = {"k_ptr": kv, "v_ptr": kv}
        tables = {"cos_ptr": "fp32", "sin_ptr": "fp32", "pos_ptr": "i64", "slots_ptr": "i64"}
        rope = build(T._rope_store_kernel, {**cache, **tables},
                     {"NUM_HEADS": 32, "NUM_KV_HEADS": 8, "HALF": 64, "HALF_P": 64, "EMULATE": False}, arch,
                     enable_fp_fusion=False)  # (as TritonOps.rope_store launches it)
        # each product rounded to bfloat16 as PyTorch rounds it (sm89 has no bfloat16 mul or sub: it writes them as
        # fmas with -0 or +-1, which round once as they do)
        assert arch < 90 or "fma" not in rope.asm["ptx"]
        build(T._paged_decode_kernel, {**cache, "tables_ptr": "i32", "lens_ptr": "i32", "part_ptr": "fp32",
                                       "stats_ptr": "fp32", "lock_ptr": "i32"},
              {"GROUP": 4, "PER_PROGRAM": 4, "PER_PROGRAM_P": 4, "HEAD_DIM": 128, "DIM_P": 128, "TILE": 32,
               "MAX_PIECES": T.DECODE_SPLITS}, arch)
        build(T._paged_prefill_kernel, {**cache, "tables_ptr": "i64", "info_ptr": "i64", "tiles_ptr": "i64"},
              {"GROUP": 4, "HEAD_DIM": 128, "DIM_P": 128, "ROWS": 32, "TILE": 32, "PRECISION": "tf32",
               "UPCAST": False}, arch)
'''


def test_the_triton_kernels_compile_for_hopper_and_ada(tmp_path):
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=400)
    assert done.returncode == 0, done.stderr[-4000:]
    built = done.stdout.split()
    assert built.count("90") == built.count("89") == 14
