"""The README's "Try it" Python examples run as written (only the address changed to the test stack's) and say
what the README promises: a client that the README shows working must work with the arguments it shows."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def try_it_blocks() -> list[str]:
    """The Python code blocks of the README's "Try it" section that talk to the default model (the vision
    example needs its demo folder and image made first)."""
    text = README.read_text()
    section = text[text.index("## Try it"):]
    section = section[: section.index("\n## ", 1)]
    return [b for b in re.findall(r"```python\n(.*?)```", section, re.DOTALL) if "smolvlm" not in b]


def test_the_readmes_python_examples_run_against_the_default_model(smol_stack):
    blocks = try_it_blocks()
    assert len(blocks) >= 2 and smol_stack.model == "SmolLM2-135M-Instruct"
    host, manager = smol_stack.url.removeprefix("http://"), smol_stack.mgmt_url.removeprefix("http://")
    printed, names = io.StringIO(), {"__name__": "readme"}
    for block in blocks:
        code = block.replace("http://127.0.0.1:1025", smol_stack.url).replace("127.0.0.1:1025", host)
        code = code.replace("127.0.0.1:1026", manager)
        with contextlib.redirect_stdout(printed):
            exec(compile(code, str(README), "exec"), names)
    out = printed.getvalue()
    assert out.count("Paris") >= 2, out  # the chat and Anthropic answers to "What is the capital of France?"
    assert "True True" in out, out  # tritonclient's health calls, on the management listener
    first, again = names["first"], names["again"]  # the stored response's conversation goes on from it
    assert again.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
