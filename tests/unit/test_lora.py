"""LoRA in the engine: PEFT adapters on the default model, against PEFT's own generation.

Greedy tokens with an adapter equal PEFT's ``generate`` with it (vLLM's near-tie rule at a first
difference); one batch of [base, X, Y] gives each row what it gives alone; the C++ kernel and the
PyTorch ops (cuda, npu) agree; loading refuses what the engine cannot apply, naming it; an unload
waits for the requests holding the adapter.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.engine.devices import resolve_device
from services.engine.engine import Engine
from services.engine.lora import Rows
from services.engine.model_runner import ModelRunner
from shared.lora import Outcome
from tests.lora_adapters import make_adapter, peft_greedy
from tests.unit.engine_helpers import BLOCK, block_bytes, limits, request, run_until_idle
from tests.unit.test_engine_outputs import check_greedy_close

NEW_TOKENS = 16
TEXTS = ["The capital of France is", "Write a haiku about the sea.", "def add(a, b):\n    return",
         "You are a helpful assistant who answers in one short sentence, plainly and kindly, without lists. "
         "Question: why is the sea salty? Answer:"]  # over two KV blocks: the prefix cache has whole blocks


@pytest.fixture(scope="module")
def adapters(smol_dir, tmp_path_factory):
    """X: rank 8 on every projection; Y: rank 4 rsLoRA on q, v and down only."""
    root = tmp_path_factory.mktemp("loras")
    x = make_adapter(smol_dir, root / "x", seed=1, r=8, alpha=16)
    y = make_adapter(smol_dir, root / "y", seed=2, r=4, alpha=8, targets=("q_proj", "v_proj", "down_proj"),
                     rslora=True, b_scale=0.5)
    return {"x": x, "y": y}


@pytest.fixture(scope="module")
def prompts(smol_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smol_dir)
    return [tokenizer(text).input_ids for text in TEXTS]


@pytest.fixture(scope="module")
def references(smol_dir, adapters, prompts):
    """PEFT's greedy tokens and logits per adapter (None: the base model) and prompt."""
    return {name: peft_greedy(smol_dir, adapters.get(name), prompts, NEW_TOKENS) for name in (None, "x", "y")}


def runner(smol_dir, cpu_kernels: bool = True, max_loras: int = 4, max_rank: int = 16) -> ModelRunner:
    return ModelRunner(str(smol_dir), resolve_device("cpu", "float32"), block_size=BLOCK,
                       kv_budget_bytes=48 * block_bytes(smol_dir), max_blocks=48, cpu_kernels=cpu_kernels,
                       max_loras=max_loras, max_lora_rank=max_rank)


@pytest.fixture(scope="module")
def loaded(smol_dir, adapters):
    r = runner(smol_dir)
    for name, path in adapters.items():
        assert r.lora.load(name, str(path)).outcome is Outcome.ADDED
    return r


def generate(engine: Engine, jobs: list[tuple[str, list[int], str]]) -> dict[str, list[int]]:
    for rid, ids, adapter in jobs:
        req = request(rid, ids, max_new_tokens=NEW_TOKENS, ignore_eos=True)
        req.adapter = adapter
        engine.add_request(req)
    run = run_until_idle(engine)
    return run.tokens


def check(tokens, references, adapter, index, label):
    theirs, logits = references[adapter or None][index]
    check_greedy_close(tokens, theirs, logits, label)


@pytest.mark.parametrize("adapter", ["x", "y"])
def test_each_adapter_equals_peft(loaded, prompts, references, adapter):
    engine = Engine(loaded, limits(), set())
    tokens = generate(engine, [(f"r{i}", ids, adapter) for i, ids in enumerate(prompts)])
    for i in range(len(prompts)):
        check(tokens[f"r{i}"], references, adapter, i, f"{adapter} prompt {i}")
    assert tokens["r0"] != references[None][0][0]  # the adapter changes the output


def test_one_batch_of_base_x_y_equals_separate_runs(loaded, prompts, references):
    """Three rows with three different adapters in every step give what each gives alone."""
    engine = Engine(loaded, limits(), set())
    jobs = [(f"{a or 'base'}-{i}", ids, a) for i, ids in enumerate(prompts) for a in ("", "x", "y")]
    together = generate(engine, jobs)
    for rid, ids, adapter in jobs:
        alone = generate(Engine(loaded, limits(), set()), [(rid, ids, adapter)])
        assert together[rid] == alone[rid], rid
        check(together[rid], references, adapter, prompts.index(ids), rid)


def test_base_outputs_unchanged_while_adapters_are_loaded(smol_dir, loaded, prompts):
    bare = runner(smol_dir, max_loras=0)
    jobs = [(f"r{i}", ids, "") for i, ids in enumerate(prompts)]
    assert generate(Engine(loaded, limits(), set()), jobs) == generate(Engine(bare, limits(), set()), jobs)


def test_mixed_steps_and_prefix_cache_keep_adapters_apart(loaded, prompts, references):
    """Mix (prompt chunks beside decode rows) and the prefix cache: the same prompt with and without an
    adapter shares no KV block, and each still matches PEFT."""
    engine = Engine(loaded, limits(mix=True, prefill_chunk_size=4), set(), prefix_cache=True)
    jobs = [(f"{a or 'base'}-{i}", ids, a) for a in ("", "x", "y", "x") for i, ids in enumerate(prompts)]
    jobs = [(f"{rid}-{n}", ids, a) for n, (rid, ids, a) in enumerate(jobs)]
    tokens = generate(engine, jobs)
    for rid, ids, adapter in jobs:
        check(tokens[rid], references, adapter, prompts.index(ids), rid)
    assert engine.blocks.prefix_hit_tokens > 0  # the second round of x hit x's own blocks


def test_torch_ops_agree_with_the_cpu_kernel(smol_dir, adapters, prompts, references):
    """What cuda and npu run (PyTorch ops) on the CPU."""
    r = runner(smol_dir, cpu_kernels=False)
    for name, path in adapters.items():
        r.lora.load(name, str(path))
    engine = Engine(r, limits(), set())
    jobs = [(f"{a or 'base'}-{i}", ids, a) for i, ids in enumerate(prompts[:2]) for a in ("", "x", "y")]
    tokens = generate(engine, jobs)
    for rid, ids, adapter in jobs:
        check(tokens[rid], references, adapter, prompts.index(ids), rid)


def test_kernel_matches_torch_reference_in_bfloat16():
    from services.engine import kernels

    ops = kernels.for_device(torch.device("cpu"))
    if not ops.fused:
        pytest.skip("no C++ kernels here")
    torch.manual_seed(0)
    x = torch.randn(5, 64).bfloat16()
    a_parts = [torch.randn(12, 64).bfloat16() for _ in range(3)]
    bts = [torch.randn(12, w).bfloat16() for w in (64, 32, 32)]
    rows = Rows(torch.tensor([0, 4, 0, 9, 4]), torch.tensor([4, 5, 0, 3, 5]))
    y = torch.randn(5, 128).bfloat16()
    expected = y.float().clone()
    kernels.TorchOps.lora_apply(expected, x.float(), [a.float() for a in a_parts], [b.float() for b in bts], rows)
    ops.lora_apply(y, x, a_parts, bts, rows)
    assert torch.allclose(y.float(), expected, atol=0.05, rtol=0.02)


# ---- loading and unloading ------------------------------------------------------------------


@pytest.fixture(scope="module")
def small(smol_dir):
    return runner(smol_dir, max_loras=2, max_rank=8)


def refused(small, path, outcome: Outcome, words: str):
    reply = small.lora.load("bad", str(path))
    assert reply.outcome is outcome, reply.message
    assert words in reply.message, reply.message
    assert "bad" not in {a.name for a in small.lora.listed()}


def edit_config(path, **changes):
    config = json.loads((path / "adapter_config.json").read_text())
    config.update(changes)
    (path / "adapter_config.json").write_text(json.dumps(config))


def test_unsupported_adapters_are_refused_by_name(small, adapters, tmp_path, smol_dir):
    import shutil

    refused(small, tmp_path / "nothing-here", Outcome.NOT_FOUND, "No adapter found for")
    for change, words in ((dict(use_dora=True), "DoRA"), (dict(modules_to_save=["lm_head"]), "modules_to_save"),
                          (dict(peft_type="IA3"), "IA3"), (dict(rank_pattern={"q_proj": 4}), "rank_pattern"),
                          (dict(bias="all"), "bias"), (dict(alora_invocation_tokens=[19842, 42]), "Activated LoRA"),
                          (dict(arrow_config={"top_k": 2}), "Arrow")):
        folder = tmp_path / f"edited-{len(list(tmp_path.iterdir()))}"
        shutil.copytree(adapters["y"], folder)
        edit_config(folder, **change)
        refused(small, folder, Outcome.INVALID, words)
    folder = tmp_path / "lm-head"
    shutil.copytree(adapters["y"], folder)
    tensors = load_file(folder / "adapter_model.safetensors")
    tensors["base_model.model.lm_head.lora_A.weight"] = torch.zeros(4, 576)
    save_file(tensors, folder / "adapter_model.safetensors")
    refused(small, folder, Outcome.INVALID, "'base_model.model.lm_head.lora_A.weight'")
    big = make_adapter(smol_dir, tmp_path / "big", r=16, targets=("q_proj",))
    refused(small, big, Outcome.RANK, "max_lora_rank")


def test_adapter_for_another_model_is_refused(small, tiny_model_dir, tmp_path):
    other = make_adapter(tiny_model_dir, tmp_path / "tiny", r=4, targets=("q_proj",))
    refused(small, other, Outcome.INVALID, "another base model")


def test_unload_waits_for_the_requests_holding_the_adapter(small, adapters):
    lora = small.lora
    assert lora.load("y1", str(adapters["y"])).outcome is Outcome.ADDED
    assert lora.load("y1", str(adapters["y"])).outcome is Outcome.ALREADY
    assert lora.load("y2", str(adapters["y"])).outcome is Outcome.ADDED
    assert lora.load("y3", str(adapters["y"])).message.endswith("none are currently unloading.")
    held = lora.acquire("y1")
    assert lora.unload("y1").outcome is Outcome.REMOVED
    assert lora.acquire("y1") is None  # no new request takes it
    assert lora.unload("y1").outcome is Outcome.MISSING
    assert lora.load("y1", str(adapters["y"])).outcome is Outcome.WAITING
    assert "'y1' is still unloading" in lora.load("y3", str(adapters["y"])).message
    assert lora.unloading() == ["y1"] and [a.name for a in lora.listed()] == ["y2"]
    assert lora.stacks[0]["qkv"].bts[0].shape[0] == 8  # y1's rows still there
    lora.release(held)
    assert lora.unloading() == [] and lora.stacks[0]["qkv"].bts[0].shape[0] == 4
    assert lora.unload("y2").outcome is Outcome.REMOVED
    assert lora.stacks == [] and lora.slots == {}


def test_engine_refuses_a_request_for_an_adapter_it_lacks(loaded, prompts):
    engine = Engine(loaded, limits(), set())
    req = request("r", prompts[0], max_new_tokens=4)
    req.adapter = "nope"
    engine.add_request(req)
    run = run_until_idle(engine)
    assert run.tokens["r"] == [] and run.finish["r"].error.kind == "not_found"
    assert "'nope' is not loaded" in run.finish["r"].error.message


QUANTIZED_MAX_GAP = 0.3  # the base's activations are rounded by its kernel (int4: to bfloat16): bfloat16's rule


def test_an_adapter_on_a_quantized_base_equals_peft_on_the_dequantized_base(smol_dir, adapters, prompts, tmp_path):
    """int4 base layers and lm_head as the engine holds them, dequantized into a float folder for PEFT."""
    r = ModelRunner(str(smol_dir), resolve_device("cpu", "float32"), block_size=BLOCK,
                    kv_budget_bytes=48 * block_bytes(smol_dir), max_blocks=48, max_loras=2, max_lora_rank=16,
                    quantization="int4")
    assert r.lora.load("x", str(adapters["x"])).outcome is Outcome.ADDED
    references = peft_greedy(dequantized_folder(r, smol_dir, tmp_path / "dequantized"), adapters["x"], prompts[:2],
                             NEW_TOKENS)
    tokens = generate(Engine(r, limits(), set()), [(f"r{i}", ids, "x") for i, ids in enumerate(prompts[:2])])
    for i, (theirs, logits) in enumerate(references):
        check_greedy_close(tokens[f"r{i}"], theirs, logits, f"int4 base + x, prompt {i}", QUANTIZED_MAX_GAP)
    assert tokens["r0"] != generate(Engine(r, limits(), set()), [("r0", prompts[0], "")])["r0"]  # x changes it


def dequantized_folder(r: ModelRunner, smol_dir, folder):
    """The model folder whose float weights are the runner's quantized layers dequantized."""
    import shutil

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smol_dir, dtype=torch.float32)
    for layer, lin in zip(model.model.layers, r.linears):
        attn, mlp = layer.self_attn, layer.mlp
        q, k, v = lin.qkv.dequantized().split(list(lin.qkv_sizes))
        gate, up = lin.gate_up.dequantized().split(lin.intermediate)
        for module, weight in ((attn.q_proj, q), (attn.k_proj, k), (attn.v_proj, v), (attn.o_proj, lin.o.dequantized()),
                               (mlp.gate_proj, gate), (mlp.up_proj, up), (mlp.down_proj, lin.down.dequantized())):
            module.weight.data = weight.contiguous()
    model.lm_head.weight = torch.nn.Parameter(r.model.lm_head.dequantized())  # untied: the embeddings stay float
    model.config.tie_word_embeddings = False
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (smol_dir / name).exists():
            shutil.copy(smol_dir / name, folder / name)
    return folder
