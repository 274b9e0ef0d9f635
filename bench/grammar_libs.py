"""Which grammar engine for structured output: llguidance against xgrammar on the default model's tokenizer.

For each of a few JSON schemas (and a regex), it compiles the grammar and walks a valid output token by
token, timing the compile and each next-token mask (the work that must fit beside every decode step).
xgrammar is not a Switchboard dependency (it pulls triton and a TVM runtime); install it beside:

    .venv/bin/pip install --no-deps --target /tmp/xgr xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2
    PYTHONPATH=/tmp/xgr .venv/bin/python bench/grammar_libs.py

Prints a table (ms per mask, median and p99; compile ms) and the CPU.
"""

from __future__ import annotations

import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

MODEL = Path(".cache/models/SmolLM2-135M-Instruct")

PERSON = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
    "email": {"type": "string", "format": "email"}, "tags": {"type": "array", "items": {"type": "string"}},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string",
                "pattern": "^[0-9]{5}$"}}, "required": ["city", "zip"]}},
    "required": ["name", "age", "tags", "address"], "additionalProperties": False}
PERSON_VALUE = {"name": "Alice Smith", "age": 34, "email": "alice@example.com", "tags": ["admin", "ops", "owner"],
                "address": {"city": "Paris", "zip": "75001"}}
ENUMS = {"type": "object", "properties": {
    "sentiment": {"enum": ["positive", "negative", "neutral"]}, "score": {"type": "number"},
    "reasons": {"type": "array", "items": {"type": "string"}, "maxItems": 5}}, "required": ["sentiment", "score"]}
ENUMS_VALUE = {"sentiment": "positive", "score": 0.93, "reasons": ["great service", "fast delivery"]}
ANY_JSON = {"type": "object"}
REGEX = r"[0-9]{3}-[0-9]{3}-[0-9]{4}"

CASES = [("person schema", "schema", PERSON, json.dumps(PERSON_VALUE)),
         ("enum schema", "schema", ENUMS, json.dumps(ENUMS_VALUE)),
         ("json_object", "schema", ANY_JSON, json.dumps({"a": [1, 2, {"b": "text " * 10}], "c": None})),
         ("phone regex", "regex", REGEX, "555-123-4567")]


def llguidance_walk(hf, kind: str, spec, text: str) -> tuple[float, list[float]]:
    import llguidance
    import llguidance.hf

    tok = llguidance_walk.tok = getattr(llguidance_walk, "tok", None) or llguidance.hf.from_tokenizer(hf)
    start = time.perf_counter()
    grammar = (llguidance.LLMatcher.grammar_from_json_schema(spec) if kind == "schema"
               else llguidance.LLMatcher.grammar_from_regex(spec))
    matcher = llguidance.LLMatcher(tok, grammar, log_level=0)
    compile_ms = (time.perf_counter() - start) * 1e3
    times = []
    for token in hf(text, add_special_tokens=False).input_ids:
        start = time.perf_counter()
        matcher.compute_bitmask()
        times.append((time.perf_counter() - start) * 1e3)
        assert matcher.consume_token(token), matcher.get_error()
    return compile_ms, times


def xgrammar_walk(hf, kind: str, spec, text: str) -> tuple[float, list[float]]:
    import xgrammar as xgr

    if not hasattr(xgrammar_walk, "compiler"):
        info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=len(hf))
        xgrammar_walk.compiler, xgrammar_walk.vocab = xgr.GrammarCompiler(info, cache_enabled=False), len(hf)
    start = time.perf_counter()
    compiled = (xgrammar_walk.compiler.compile_json_schema(json.dumps(spec)) if kind == "schema"
                else xgrammar_walk.compiler.compile_regex(spec))
    matcher = xgr.GrammarMatcher(compiled)
    compile_ms = (time.perf_counter() - start) * 1e3
    bitmask = xgr.allocate_token_bitmask(1, xgrammar_walk.vocab)
    times = []
    for token in hf(text, add_special_tokens=False).input_ids:
        start = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask)
        times.append((time.perf_counter() - start) * 1e3)
        assert matcher.accept_token(token)
    return compile_ms, times


def cpu() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in out.splitlines() if line.startswith("Flags")), [])
    return f"{model}; {' '.join(f for f in flags if f.startswith(('avx', 'amx')))}"


def main() -> None:
    torch.set_num_threads(1)
    hf = AutoTokenizer.from_pretrained(MODEL)
    print(f"CPU: {cpu()}; python {platform.python_version()}; vocab {len(hf)}")
    print("| case | library | compile ms | mask ms median | mask ms p99 | tokens |")
    print("|---|---|---|---|---|---|")
    for name, kind, spec, text in CASES:
        for library, walk in (("llguidance", llguidance_walk), ("xgrammar", xgrammar_walk)):
            try:
                walk(hf, kind, spec, text)  # warm
                compile_ms, times = walk(hf, kind, spec, text)
            except ImportError:
                print(f"| {name} | {library} | not installed | | | |")
                continue
            times.sort()
            p99 = times[min(len(times) - 1, int(len(times) * 0.99))]
            print(f"| {name} | {library} | {compile_ms:.1f} | {statistics.median(times):.3f} | {p99:.3f} | {len(times)} |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
