"""Images per second through preprocessing and prefill, with 1 and 2 tokenizer instances, in one run.

The model is the test SmolVLM (``tests/vlm_models.py``: SmolLM2-135M as the text model, a small random
vision tower). Each request is one photo-sized JPEG (``--width`` x ``--height``, a different one per
request, as a data: URL) and a question, through TGI ``/generate`` with ``max_new_tokens`` 1, so a
request is: fetch (decode the data: URL), decode the JPEG, resize, tile and normalise it (the
tokenizer service), encode it and prefill the prompt (the engine). Two deployments run side by side
as separate processes on one nats-server each: 1 engine + 1 tokenizer, and 1 engine + 2 tokenizers.
The machine drifts, so rounds alternate between them (the order reversed every other round) and the
ratio is the median over rounds of (2 tokenizers ÷ 1 tokenizer). In-process timings split one image's
cost into preprocessing (``MediaProcessor.process``) and the engine's encode + prefill.

    .venv/bin/python bench/vision_bench.py [--rounds 4] [--requests 32] [--concurrency 8]

Prints a Markdown report (also written to .cache/bench/vision.md).
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from peers_report import cpu, git_head  # noqa: E402
from processes import run_main  # noqa: E402
from rounds import alternate, publish  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / ".cache" / "bench" / "vision.md"
QUESTION = "What is in this image?"


def photo(seed: int, width: int, height: int) -> bytes:
    """A JPEG of a seeded picture (gradients plus noise: compresses like a photo, not like a flat image)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([(x * (seed % 7 + 1)) % 256, (y * 3) % 256, ((x + y) * (seed % 5 + 2)) % 256], axis=-1)
    noisy = np.clip(base + rng.normal(0, 24, base.shape), 0, 255).astype("uint8")
    out = io.BytesIO()
    Image.fromarray(noisy).save(out, format="JPEG", quality=90)
    return out.getvalue()


def data_url(jpeg: bytes) -> str:
    import base64

    return "data:image/jpeg;base64," + base64.b64encode(jpeg).decode()


def body(jpeg: bytes) -> dict:
    return {"inputs": [{"type": "text", "text": QUESTION}, {"type": "image_url", "image_url": data_url(jpeg)}],
            "parameters": {"max_new_tokens": 1, "do_sample": False}}


def images_per_s(base: str, photos: list[bytes], concurrency: int) -> float:
    """Send one request per photo, ``concurrency`` at a time; every answer must be a 200."""
    def one(jpeg: bytes) -> None:
        r = httpx.post(base + "/generate", json=body(jpeg), timeout=300)
        r.raise_for_status()
    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, photos))
    return len(photos) / (time.perf_counter() - started)


def in_process(model_dir: Path, jpeg: bytes, repeats: int = 5) -> tuple[float, float]:
    """(preprocessing s, engine encode + prefill s) of one image, medians of ``repeats``."""
    from services.engine.engine import Engine
    from services.tokenizer.media.multimodal import MediaProcessor
    from tests.unit.engine_helpers import limits, make_runner, request, run_until_idle

    processor = MediaProcessor.load(str(model_dir))
    text = f"{QUESTION}{processor.placeholder}"
    pre, prefill = [], []
    runner = make_runner(model_dir, 64)
    for i in range(repeats):
        started = time.perf_counter()
        prepared = processor.process(text, [("image", jpeg)])
        pre.append(time.perf_counter() - started)
        engine = Engine(runner, limits(), set())
        req = request(f"r{i}", prepared.ids, max_new_tokens=1)
        req.media = prepared.media
        engine.add_request(req)
        started = time.perf_counter()
        run_until_idle(engine)
        prefill.append(time.perf_counter() - started)
    return statistics.median(pre), statistics.median(prefill)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--width", type=int, default=1280)
    parser.add_argument("--height", type=int, default=960)
    args = parser.parse_args()

    from tests.conftest import SMOL_DIR
    from tests.integration.cluster import Cluster
    from tests.vlm_models import make_smolvlm

    work = Path(tempfile.mkdtemp(prefix="vision-bench-"))
    model_dir = make_smolvlm(work / "smolvlm", SMOL_DIR)
    photos = [photo(i, args.width, args.height) for i in range(args.requests)]
    pre_s, prefill_s = in_process(model_dir, photos[0])
    clusters = {}
    try:
        for n in (1, 2):
            folder = work / f"tokenizers-{n}"
            folder.mkdir()
            clusters[n] = Cluster(folder, model_dir, engines=1, tokenizers=n,
                                  Switchboard={"kvCacheMemoryMb": 256}).wait_ready(600)
        rates = alternate([1, 2], args.rounds, lambda n, _: images_per_s(clusters[n].base, photos, args.concurrency),
                          lambda rate: f"{rate:.2f} images/s",
                          warm_up=lambda n: images_per_s(clusters[n].base, photos[:4], 4))
    finally:
        for cluster in clusters.values():
            cluster.stop()
    report(args, rates, pre_s, prefill_s, len(photos[0]))
    return 0


def report(args, rates: dict[int, list[float]], pre_s: float, prefill_s: float, jpeg_bytes: int) -> None:
    model, flags = cpu()
    ratios = [b / a for a, b in zip(rates[1], rates[2])]
    lines = [
        f"# Vision: images/s through preprocessing and prefill (git {git_head()})",
        "",
        f"CPU: {model}; flags: {' '.join(flags)}",
        f"Workload: {args.requests} TGI /generate requests per round, each one {args.width}x{args.height} JPEG "
        f"({jpeg_bytes / 1024:.0f} KiB) as a data: URL, max_new_tokens 1, concurrency {args.concurrency}; "
        f"{args.rounds} rounds, alternating.",
        "",
        "| deployment | images/s (median) | per round |",
        "|---|---|---|",
    ]
    for n in (1, 2):
        lines.append(f"| 1 engine + {n} tokenizer{'s' if n > 1 else ''} | {statistics.median(rates[n]):.2f} | "
                     f"{', '.join(f'{v:.2f}' for v in rates[n])} |")
    lines += ["", f"2 tokenizers ÷ 1 tokenizer: **{statistics.median(ratios):.2f}×** "
                  f"(per round {', '.join(f'{v:.2f}' for v in ratios)})",
              "", f"One image in process: preprocessing {pre_s * 1000:.1f} ms, engine encode + prefill "
                  f"{prefill_s * 1000:.1f} ms."]
    publish(OUT, lines)


if __name__ == "__main__":
    run_main(main)
