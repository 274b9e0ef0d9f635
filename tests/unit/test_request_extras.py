"""vLLM's request extras that reach the tokenizer and the prefix cache: add_special_tokens on a text prompt,
documents for the chat template, cache_salt in the prefix-cache keys."""

from __future__ import annotations

from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from services.engine.sequence import Sequence
from services.tokenizer.encoder import encode_prompt, render_chat
from shared.config import ModelConfig, ModelDeployConfig
from shared.messages import GenerateRequest, Sampling
from shared.prefix_hash import chain, client_salt

DEPLOY = ModelDeployConfig(model_config=[ModelConfig(model_name="m", model_weight_path="/m")])


def bos_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer whose post-processor puts <s> first (as Llama 2's and Mistral's do)."""
    vocab = {"<unk>": 0, "<s>": 1, "hello": 2, "world": 3}
    model = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    model.pre_tokenizer = pre_tokenizers.Whitespace()
    model.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=model, unk_token="<unk>", bos_token="<s>")


def request(**fields) -> GenerateRequest:
    return GenerateRequest(id="r", model="m", reply_to="x", **fields)


def test_add_special_tokens_false_leaves_the_bos_out():
    tok = bos_tokenizer()
    assert encode_prompt(tok, request(prompt="hello world"), DEPLOY) == [1, 2, 3]
    assert encode_prompt(tok, request(prompt="hello world", add_special_tokens=False), DEPLOY) == [2, 3]


def test_documents_reach_the_chat_template():
    tok = bos_tokenizer()
    tok.chat_template = ("{% for d in documents or [] %}{{ d.text }} {% endfor %}"
                         "{% for m in messages %}{{ m.content }} {% endfor %}")
    messages = [{"role": "user", "content": "hello"}]
    assert render_chat(tok, request(messages=messages)) == [2]
    assert render_chat(tok, request(messages=messages, chat_template_kwargs={"documents": [{"text": "world"}]})) \
        == [3, 2]


def test_a_cache_salt_changes_every_key_and_no_salt_changes_none():
    ids = list(range(64))
    plain, salted, other = (chain(ids, 16, client_salt(s)) for s in ("", "a", "b"))
    assert plain == chain(ids, 16) and not set(plain) & set(salted) and not set(salted) & set(other)
    seq = Sequence("s", ids, Sampling())
    seq.more_salt = client_salt("a")
    assert seq.cache_salt == client_salt("a")
