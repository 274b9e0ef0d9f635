"""Quantized weights and K/V: Switchboard at float32, bfloat16, int8 and int4 (and int8 K/V), side by side in one run.

    .venv/bin/python bench/quant_bench.py [--requests 32] [--concurrency 16] [--tokens 64] [--llama-cpp]

Each variant is `switchboard serve` with the default model (SmolLM2-135M-Instruct) and one
``Switchboard`` setting changed (``dtype``, ``quantization``), driven like bench/engine_bench.py (greedy
TGI streams at concurrency 1 and --concurrency, after a warm-up). Quality is measured on the same server:
the perplexity of a fixed English text written below (its prompt logprobs through ``/v1/completions``
with ``echo``), and the accuracy lm-evaluation-harness gives it on the tests' multiple-choice task (needs the
test extras: ``make install-test``). Ratios are against float32 and bfloat16 of the same run; the CPU's model and flags are
printed with them. ``--llama-cpp`` adds llama.cpp's server on the Q8_0 and Q4_1 GGUFs of the same model
(bench/llama_cpp.py; build it first), driven by the same load generator through its streaming
``/v1/completions`` (its quality columns stay empty). Each row also says how many 1,000-token sequences the KV cache holds in the default
``kvCacheMemoryMb`` (from ``/v1/status``). The Markdown table is written to .cache/bench/quant.md.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import httpx
from engine_bench import (  # bench/engine_bench.py
    MODEL,
    openai_tokens,
    SWITCHBOARD_READY,
    WORK,
    Api,
    bench_server,
    make_prompts,
    switchboard_config,
    tgi_body,
    tgi_tokens,
)
from peers_report import cpu  # bench/peers_report.py
from processes import log_tail, server  # bench/processes.py

ROOT = Path(__file__).resolve().parent.parent
REPORT = WORK / "quant.md"
VARIANTS = {  # name -> the Switchboard keys it sets
    "float32": {"dtype": "float32"},
    "bfloat16": {"dtype": "bfloat16"},
    "int8": {"dtype": "float32", "quantization": "int8"},
    "int4": {"dtype": "float32", "quantization": "int4"},
    "gguf Q4_1": {"dtype": "float32", "quantization": "gguf"},  # the default model's own file
    # one engine thread: at one stream an int4 step is bound by memory, and the other core is left to the gateway,
    # the tokenizer, NATS and the client (two threads stall at each barrier when either is preempted)
    "int4 1 thread": {"dtype": "float32", "quantization": "int4", "torchThreads": 1},
    "gguf Q4_1 1 thread": {"dtype": "float32", "quantization": "gguf", "torchThreads": 1},
    "bfloat16 + int8 KV": {"dtype": "bfloat16", "kvCacheDtype": "int8"},
    "int8 + int8 KV": {"dtype": "float32", "quantization": "int8", "kvCacheDtype": "int8"},
}
SAME_BITS = [("int8", "llama.cpp Q8_0"), ("int8 + int8 KV", "llama.cpp Q8_0"), ("int4", "llama.cpp Q4_1"),
             ("gguf Q4_1", "llama.cpp Q4_1"), ("int4 1 thread", "llama.cpp Q4_1"), ("gguf Q4_1 1 thread", "llama.cpp Q4_1")]
TEXT = """The lighthouse stood at the end of a narrow spit of rock, and for most of the year the only people who
saw it up close were the keeper and the men who brought his supplies. The keeper had lived there for eleven
years. He kept a log of the weather, the ships that passed, and the birds that rested on the gallery rail
during storms. In winter the wind came from the north and carried salt so far inland that the farmers
complained their fences rusted in a single season. In summer the sea was calm and green, and children from
the village rowed out to the rocks to look for crabs in the pools that the tide left behind.

Every evening the keeper climbed the spiral stair, one hundred and twelve steps, to light the lamp. He
trimmed the wick, polished the lens, and wound the clockwork that turned the light. The beam swept across
the water once every ten seconds, and sailors who knew the coast could tell from the rhythm which light
they were looking at. A ship that mistook one light for another could end up on the wrong side of the
reef, and the records of the harbour office listed more than forty wrecks in the century before the tower
was built.

When the government decided to replace the clockwork with an electric motor, the keeper was asked to
write a report on the old mechanism. He described how the weights descended through a shaft in the middle
of the tower, how the governor kept the speed even, and how the gears had been cut by hand in a workshop
in the city. He added that the mechanism had never failed in his time, except once, when a gull had
flown through an open window and become tangled in the chain. The engineers read the report with
interest, thanked him, and installed the motor the following spring.

The village changed more slowly than the lighthouse. The school closed when the last family with young
children moved to the town, and the bakery became a shop that sold maps and postcards to the visitors who
came in July and August. The fishermen still went out before dawn, but there were fewer boats each year,
and the younger men preferred work on the ferries, which paid a steady wage and brought them home every
night. On Sundays the church was half full, and the priest, who also served two other parishes, arrived
by bicycle in good weather and by bus in bad.

Scientists began to visit the spit in the nineteen seventies to count the seabirds. They stayed in a hut
behind the keeper's cottage and walked the cliffs with notebooks and binoculars. They found that the
number of puffins had fallen by half in twenty years, and they wrote letters to the newspapers asking for
the fishing of sand eels to be limited near the colonies. Some of the fishermen were angry at first, but
the limits were set, and within a decade the birds began to return. The keeper noted each spring in his
log the day the first puffin landed on the rocks below the tower.

In the end the light was automated, as all the lights along the coast were. The keeper moved to a house in
the village with a view of the sea, and on clear nights he could see the beam from his kitchen window. He
said that he did not miss the stairs, but that he missed the sound of the clockwork, which he had heard
every night for eleven years and which had told him, without his thinking about it, that everything was
as it should be. He kept his logs in a wooden chest, and when the museum in the town asked for them, he
gave them the weather and the ships but kept the birds for himself."""


def perplexity(url: str) -> tuple[float, int]:
    """exp of the mean negative log-likelihood of TEXT's tokens after the first, and how many were scored."""
    model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
    body = {"model": model, "prompt": TEXT, "max_tokens": 1, "echo": True, "logprobs": 0, "temperature": 0}
    answer = httpx.post(url + "/v1/completions", json=body, timeout=600).json()
    if "choices" not in answer:
        raise RuntimeError(f"/v1/completions: {answer}")
    logprobs = [lp for lp in answer["choices"][0]["logprobs"]["token_logprobs"] if lp is not None][:-1]
    return math.exp(-sum(logprobs) / len(logprobs)), len(logprobs)


def run_variant(name: str, keys: dict, prompts: list[str], tokens: int, levels: list[int]) -> dict:
    log = WORK / f"quant-{name}.log"
    with tempfile.TemporaryDirectory(prefix="sb-quant-") as tmp:
        config, url = switchboard_config(Path(tmp))
        data = json.loads(config.read_text())
        data.setdefault("Switchboard", {}).update(keys)
        # enough sequences that the KV budget, not maxBatchSize x maxSeqLen, bounds the cache (c16 never reaches it)
        data["BackendConfig"]["ScheduleConfig"]["maxBatchSize"] = 128
        data["Switchboard"]["logLevel"] = "warning"
        config.write_text(json.dumps(data, indent=2))
        cmd = [sys.executable, "-m", "switchboard.cli", "serve", "--config", str(config)]
        with server(name, cmd, log, lambda: SWITCHBOARD_READY in log_tail(log, 200), cwd=ROOT):
            seqs = sequences_held(url, data)
            ppl, scored = perplexity(url)
            acc = accuracy(url, Path(tmp))
            print(f"[{name}] perplexity {ppl:.3f} over {scored} tokens; multiple-choice accuracy {acc:.3f}", flush=True)
            runs = bench_server(name, url, Api("/generate_stream", tgi_body, tgi_tokens), prompts, tokens, levels)
    return {"ppl": ppl, "scored": scored, "seqs": seqs, "acc": acc, **{run.concurrency: run for run in runs}}


def llama_body(prompt: str, tokens: int) -> dict:
    return {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True, "ignore_eos": True}


def run_llama_cpp(name: str, gguf: Path, prompts: list[str], tokens: int, levels: list[int]) -> dict:
    import llama_cpp  # bench/llama_cpp.py

    with llama_cpp.running(name, gguf, WORK / f"quant-{name}.log") as url:
        runs = bench_server(name, url, Api("/v1/completions", llama_body, openai_tokens, keep_alive=False), prompts,
                            tokens, levels)
    return {run.concurrency: run for run in runs}


def accuracy(url: str, folder: Path) -> float:
    """lm-evaluation-harness's accuracy on the multiple-choice task the tests use (tests/integration/
    test_prompt_logprobs.py), through the server's /v1/completions, as users run it."""
    import os

    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    sys.path.insert(0, str(ROOT))
    from tests.integration.test_prompt_logprobs import write_task

    os.environ.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", HF_DATASETS_CACHE=str(folder / "datasets"))
    task = write_task(folder)
    model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
    result = simple_evaluate(
        model="local-completions", tasks=[task], task_manager=TaskManager(include_path=str(folder)),
        model_args=f"base_url={url}/v1/completions,model={model},tokenizer={MODEL},tokenizer_backend=huggingface,"
                   "tokenized_requests=True,num_concurrent=1,max_retries=1")
    return float(result["results"][task]["acc,none"])


def sequences_held(url: str, config: dict) -> int:
    """How many 1,000-token sequences the engine's KV cache holds (its blocks, from /v1/status)."""
    block = config["BackendConfig"]["ScheduleConfig"]["cacheBlockSize"]
    port = config["ServerConfig"]["managementPort"]
    mgmt = url.rsplit(":", 1)[0] + f":{port}"
    blocks = httpx.get(mgmt + "/v1/status", timeout=30).json()["resource"]["totalNpuBlockNums"]
    return blocks // -(-1000 // block)


def render(results: dict[str, dict], levels: list[int], args: argparse.Namespace, seconds: float) -> str:
    c_lo, c_hi = levels[0], levels[-1]
    model, flags = cpu()
    lines = [f"CPU: {model}; {' '.join(flags)}", f"Command: `.venv/bin/python bench/quant_bench.py {' '.join(sys.argv[1:])}` "
             f"({args.requests} requests of {args.tokens} greedy tokens; {seconds:.0f} s)", "",
             f"| weights | c{c_lo} tok/s | vs f32 | vs bf16 | c{c_hi} tok/s | vs f32 | vs bf16 | TTFT p50 c{c_hi} | "
             "perplexity | vs bf16 | MC accuracy | 1k-token seqs in KV |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    f32, bf16 = results.get("float32"), results.get("bfloat16")
    for name, r in results.items():
        row = [name]
        for level in (c_lo, c_hi):
            tok_s = r[level].tok_s
            row += [f"{tok_s:.1f}", f"{tok_s / f32[level].tok_s:.2f}x" if f32 else "",
                    f"{tok_s / bf16[level].tok_s:.2f}x" if bf16 else ""]
        row.append(f"{r[c_hi].ttft(0.5) * 1000:.0f} ms")
        if "ppl" in r:
            row += [f"{r['ppl']:.3f}", f"{(r['ppl'] / bf16['ppl'] - 1) * 100:+.2f}%" if bf16 else "", f"{r['acc']:.3f}",
                    str(r["seqs"])]
        else:
            row += ["", "", "", ""]
        lines.append("| " + " | ".join(row) + " |")
    lines += [""] + [f"- {ours} vs {theirs}: c{c_lo} {results[ours][c_lo].tok_s / results[theirs][c_lo].tok_s:.2f}x, "
                     f"c{c_hi} {results[ours][c_hi].tok_s / results[theirs][c_hi].tok_s:.2f}x"
                     for ours, theirs in SAME_BITS if ours in results and theirs in results]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, of " + ", ".join(VARIANTS))
    parser.add_argument("--llama-cpp", action="store_true", help="add llama.cpp's server on Q8_0 and Q4_1")
    args = parser.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    prompts, levels = make_prompts(args.requests), sorted({1, args.concurrency})
    started = time.monotonic()
    results = {name: run_variant(name, VARIANTS[name], prompts, args.tokens, levels)
               for name in args.variants.split(",")}
    if args.llama_cpp:
        import llama_cpp  # bench/llama_cpp.py

        for name, gguf in (("llama.cpp Q8_0", llama_cpp.q8_0()), ("llama.cpp Q4_1", llama_cpp.q4_1())):
            results[name] = run_llama_cpp(name, gguf, prompts, args.tokens, levels)
    report = render(results, levels, args, time.monotonic() - started)
    REPORT.write_text(report + "\n")
    print(f"\n{report}\n(written to {REPORT})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
