"""GPU benchmark: Switchboard on cuda against HF ``generate`` (static cache, compiled) on the same weights.

    python3 bench/gpu_bench.py --tokenizer DIR [--shapes 8b,135m] [--levels 1,16,64] [--out FILE.json]

Run on a machine with an NVIDIA GPU (see ../shared/reference/gpu-machine.md for what it takes). One run:

1. The device's measured copy bandwidth and bfloat16 matmul peak, and the tokens/s the bandwidth
   allows when every step reads every weight once (the roofline at 1, 16 and 64 rows).
2. Random-weight Llama models built on the GPU from SmolLM2's config and tokenizer (``--tokenizer``):
   the 8B shape (Llama-3.1-8B's layers with SmolLM2's vocabulary) and SmolLM2-135M's shape, bfloat16.
   Weights do not change speed.
3. Per shape: ``switchboard serve`` with ``device: cuda``, driven by one closed-loop load generator
   (streaming ``/v1/completions``, ``--tokens`` new tokens with ``ignore_eos``, distinct prompts of
   25-45 tokens) at each concurrency level: output tokens/s and TTFT p50.
4. HF ``generate`` with ``cache_implementation="static"`` (transformers compiles the decode step into
   CUDA graphs) on the same weights, at batch 1 (and ``--hf-batches``): tokens/s after a warm-up.
5. With ``--quantizations int4,fp8``: the 8B shape served again in each weight format
   (``Switchboard.quantization``), with its tokens/s against bfloat16's at the same concurrency.
6. The engine's step in process (no NATS, no HTTP) on the 8B shape at 1, 16 and 64 decode rows: step
   time, kernel launches from Python per step, and the GPU's busy fraction (kernel time / step time).

Prints the table with ratios and writes every number to ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from engine_bench import SWITCHBOARD_READY, Api, openai_tokens, run_batch  # noqa: E402  bench/engine_bench.py
from processes import free_port, log_tail, server  # noqa: E402  bench/processes.py
from gpu_steps import step_profile  # noqa: E402  bench/gpu_steps.py
from results import Run  # noqa: E402  bench/results.py

ROOT = Path(__file__).resolve().parent.parent
SHAPES = {
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, tie_word_embeddings=False, max_position_embeddings=8192),
    "135m": {},
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
                   "special_tokens_map.json")
WORDS = "the of and to in is was for on that with as by at from his an were are which this be or".split()


# ---- the device ------------------------------------------------------------------------------


def device_figures() -> dict:
    """Copy bandwidth (bytes read + written per second) and bfloat16 matmul TFLOP/s, best of a few."""
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    best = float("inf")
    for _ in range(10):
        torch.cuda.synchronize()
        start = time.perf_counter()
        y.copy_(x)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    bandwidth = 2 * x.numel() / best
    del x, y
    torch.cuda.empty_cache()
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn_like(a)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(20):
        a @ b
    torch.cuda.synchronize()
    tflops = 20 * 2 * 8192 ** 3 / (time.perf_counter() - start) / 1e12
    del a, b
    torch.cuda.empty_cache()
    return {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "bandwidth_gb_s": bandwidth / 1e9,
            "bf16_tflops": tflops}


# ---- models ----------------------------------------------------------------------------------


def build_model(tokenizer_dir: Path, shape: str, out: Path) -> tuple[Path, int]:
    """A random-weight bfloat16 Llama of ``shape`` in ``out``; its folder and weight bytes."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig.from_pretrained(tokenizer_dir)
    for key, value in SHAPES[shape].items():
        setattr(config, key, value)
    started = time.perf_counter()
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out)
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    del model
    torch.cuda.empty_cache()
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out / name)
    print(f"[model] {shape}: {size / 1e9:.2f} GB of weights in {time.perf_counter() - started:.1f}s", flush=True)
    return out, size


def make_prompts(n: int, seed: int) -> list[str]:
    """Distinct prompts of 25-45 words (about as many tokens)."""
    rng = random.Random(seed)
    return [f"Request {seed}-{i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(22, 42))) for i in range(n)]


# ---- Switchboard over HTTP -------------------------------------------------------------------


def write_config(folder: Path, model: Path, max_batch: int, quantization: str = "none",
                 extra: dict | None = None) -> tuple[Path, str]:
    cfg = json.loads((ROOT / "config" / "config.json").read_text())
    srv = cfg["ServerConfig"]
    srv["port"], srv["managementPort"], srv["metricsPort"] = (free_port() for _ in range(3))
    deploy = cfg["BackendConfig"]["ModelDeployConfig"]
    deploy["ModelConfig"][0]["modelWeightPath"] = str(model)
    deploy["ModelConfig"][0]["modelName"] = "bench"
    deploy["maxSeqLen"], deploy["maxInputTokenLen"] = 2048, 1024
    sched = cfg["BackendConfig"]["ScheduleConfig"]
    sched["maxBatchSize"], sched["maxPrefillBatchSize"] = max_batch, max_batch
    sched["maxQueueDelayMicroseconds"] = 500
    cfg.setdefault("Switchboard", {}).update({"device": "cuda", "dtype": "bfloat16", "quantization": quantization,
                                              **(extra or {})})
    path = folder / "config.json"
    path.write_text(json.dumps(cfg, indent=2))
    return path, f"http://127.0.0.1:{srv['port']}"


def completion_body(prompt: str, tokens: int) -> dict:
    return {"model": "bench", "prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}


def bench_stack(shape: str, model: Path, levels: list[int], tokens: int, log_dir: Path,
                quantization: str = "none", extra: dict | None = None, mode: str = "") -> list[dict]:
    """``switchboard serve`` on cuda (``quantization``: its weight format; ``extra``: other Switchboard keys, named
    ``mode`` in the report); per level: 2 x level requests (at least 4), closed loop."""
    api = Api("/v1/completions", completion_body, openai_tokens)
    results = []
    name = " ".join(filter(None, [shape, quantization if quantization != "none" else "", mode]))
    with tempfile.TemporaryDirectory(prefix="sb-gpu-") as tmp:
        config, url = write_config(Path(tmp), model, max(levels), quantization, extra)
        log = log_dir / f"switchboard-{name.replace(' ', '-')}.log"
        cmd = [sys.executable, "-m", "switchboard.cli", "serve", "--config", str(config)]
        with server(f"switchboard {name}", cmd, log, lambda: SWITCHBOARD_READY in log_tail(log, 200), cwd=ROOT,
                    env={"PYTHONPATH": os.environ.get("PYTHONPATH", "") + os.pathsep + str(ROOT)}, start_timeout=400):
            asyncio.run(run_batch(url, api, make_prompts(max(levels), 99), 16, max(levels)))  # warm-up
            for level in levels:
                wall, samples = asyncio.run(run_batch(url, api, make_prompts(max(4, 2 * level), level), tokens, level))
                run = Run(f"switchboard {shape}", level, wall, samples)
                results.append({"shape": shape, "quantization": quantization, "mode": mode, "concurrency": level,
                                "tok_s": run.tok_s,
                                "ttft_p50_s": run.ttft(50), "tokens": run.tokens, "ttfts_s": [s.ttft for s in samples]})
                print(f"[switchboard {name}] c{level}: {run.tok_s:.1f} tok/s, TTFT p50 {run.ttft(50) * 1000:.0f} ms "
                      f"(each: {' '.join(f'{s.ttft * 1000:.0f}' for s in samples[:16])})", flush=True)
    return results


# ---- HF generate, static cache ---------------------------------------------------------------


def bench_hf_static(model_dir: Path, batches: list[int], tokens: int) -> list[dict]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    tok.pad_token = tok.pad_token or tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    results = []
    for batch in batches:
        enc = tok(make_prompts(batch, 7), return_tensors="pt", padding=True).to("cuda")
        kw = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=tok.pad_token_id,
                  cache_implementation="static")
        with torch.inference_mode():
            started = time.perf_counter()
            model.generate(**enc, **kw)  # compiles
            warm = time.perf_counter() - started
            torch.cuda.synchronize()
            started = time.perf_counter()
            out = model.generate(**enc, **kw)
            torch.cuda.synchronize()
            wall = time.perf_counter() - started
        made = (out.shape[1] - enc.input_ids.shape[1]) * batch
        results.append({"batch": batch, "tok_s": made / wall, "warm_up_s": warm})
        print(f"[HF static] batch {batch}: {made / wall:.1f} tok/s (warm-up {warm:.0f}s)", flush=True)
    del model
    torch.cuda.empty_cache()
    return results


# ---- main ------------------------------------------------------------------------------------


def report(figures: dict, sizes: dict, stack: list[dict], hf: list[dict], steps: list[dict]) -> str:
    lines = [f"GPU: {figures['gpu']}, torch {figures['torch']}; copy {figures['bandwidth_gb_s']:.0f} GB/s, "
             f"bf16 matmul {figures['bf16_tflops']:.0f} TFLOP/s"]
    for shape, size in sizes.items():
        roof = figures["bandwidth_gb_s"] * 1e9 / size
        lines.append(f"{shape}: {size / 1e9:.2f} GB of weights; bandwidth roofline {roof:.0f} tok/s at 1 row, "
                     f"{16 * roof:.0f} at 16, {64 * roof:.0f} at 64")
    hf_by_batch = {r["batch"]: r["tok_s"] for r in hf}
    plain = {(r["shape"], r["concurrency"]): r["tok_s"] for r in stack if r["quantization"] == "none" and not r.get("mode")}
    lines.append("| shape | weights | concurrency | Switchboard tok/s | vs bf16 | TTFT p50 | HF static tok/s | ratio | "
                 "of bf16 roofline |")
    lines.append("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in stack:
        theirs = hf_by_batch.get(r["concurrency"]) if r["shape"] == "8b" and r["quantization"] == "none" else None
        theirs = None if r.get("mode") else theirs
        roof = figures["bandwidth_gb_s"] * 1e9 / sizes[r["shape"]] * r["concurrency"]
        hf_cell, ratio = (f"{theirs:.1f}", f"{r['tok_s'] / theirs:.2f}x") if theirs else ("-", "-")
        base = plain.get((r["shape"], r["concurrency"]))
        vs = f"{r['tok_s'] / base:.2f}x" if base else "-"
        weights = ("bfloat16" if r["quantization"] == "none" else r["quantization"]) + (f", {r['mode']}" if r.get("mode") else "")
        lines.append(f"| {r['shape']} | {weights} | {r['concurrency']} | {r['tok_s']:.1f} | {vs} | "
                     f"{r['ttft_p50_s'] * 1000:.0f} ms | {hf_cell} | {ratio} | {100 * r['tok_s'] / roof:.0f}% |")
    lines.append("| rows | mode | step ms | launches per step | GPU busy |")
    lines.append("|---:|---|---:|---:|---:|")
    for s in steps:
        busy = "-" if s.get("mixed") else f"{100 * s['gpu_busy']:.0f}%"
        mode = ("graphs, launched ahead" if s.get("ahead") else "graphs") if s["graph"] else "eager"
        lines.append(f"| {s['rows']} | {mode} | {s['step_ms']:.2f} | "
                     f"{s['launches_per_step']:.0f} | {busy} |")
    return "\n".join(lines)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", type=Path, required=True, help="SmolLM2's config.json and tokenizer files")
    p.add_argument("--shapes", default="8b,135m")
    p.add_argument("--levels", default="1,16,64", help="concurrency levels for the 8B shape")
    p.add_argument("--small-levels", default="1", help="concurrency levels for the 135M shape")
    p.add_argument("--quantizations", default="", help="also serve the 8B shape in these weight formats "
                   "(Switchboard.quantization on cuda: int4,fp8), each at --quant-levels")
    p.add_argument("--quant-levels", default="1,16", help="concurrency levels for --quantizations")
    p.add_argument("--sync-levels", default="", help="also serve the 8B shape in bfloat16 with "
                   "Switchboard.asyncScheduling false (each step's tokens read back before the next) at these levels")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--hf-batches", default="1", help="HF static batches ('' = skip; 16 compiles for ~2 min)")
    p.add_argument("--step-rows", default="1,16,64", help="in-process step profile ('' = skip)")
    p.add_argument("--eager-steps", action="store_true", help="also profile the step without graphs")
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "sb-gpu-bench")
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args(argv)


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def attempt(name: str, fn, *args) -> list:
    """One part of the run; a failure is printed and the rest still runs (device time is scarce)."""
    try:
        return fn(*args)
    except Exception:
        import traceback

        print(f"[{name}] FAILED:\n{traceback.format_exc()}", flush=True)
        torch.cuda.empty_cache()
        return []


def main(argv=None) -> int:
    args = parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    figures = device_figures()
    print(f"[device] {figures}", flush=True)
    sizes, models, stack, hf, steps = {}, {}, [], [], []
    for shape in args.shapes.split(","):
        models[shape], sizes[shape] = build_model(args.tokenizer, shape, args.work / shape)
    big = "8b" if "8b" in models else next(iter(models))
    for shape in models:
        levels = ints(args.levels if shape == "8b" else args.small_levels)
        stack += attempt(f"switchboard {shape}", bench_stack, shape, models[shape], levels, args.tokens, args.work)
    for fmt in filter(None, args.quantizations.split(",")):
        stack += attempt(f"switchboard {big} {fmt}", bench_stack, big, models[big], ints(args.quant_levels),
                         args.tokens, args.work, fmt)
    if args.sync_levels:
        stack += attempt(f"switchboard {big} read back each step", bench_stack, big, models[big], ints(args.sync_levels),
                         args.tokens, args.work, "none", {"asyncScheduling": False}, "each step read back")
    if args.hf_batches:
        hf = attempt("HF static", bench_hf_static, models[big], ints(args.hf_batches), args.tokens)
    if args.step_rows:
        steps = attempt("step profile", step_profile, models[big], ints(args.step_rows))
        if args.eager_steps:
            steps += attempt("step profile, eager", step_profile, models[big], ints(args.step_rows), False)
    text = report(figures, sizes, stack, hf, steps)
    print(text, flush=True)
    if args.out:
        args.out.write_text(json.dumps({"device": figures, "weights": sizes, "stack": stack, "hf_static": hf,
                                        "steps": steps, "report": text}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
