"""``switchboard serve|gateway|tokenizer|engine|metrics|prepare-model``."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

from shared import model_folder
from shared.config import Config, ConfigError, load_config
from shared.listen import check_free
from shared.mindie_keys import misspelt, unused_keys
from switchboard.runner import SERVICES

DEFAULT_CONFIG = "config/config.json"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="switchboard", description="Every LLM serving API on one endpoint.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="start NATS and all four services")
    serve.add_argument("--config", default=DEFAULT_CONFIG)
    sub.add_parser("certs", help="make development TLS certificates (see switchboard/certs.py)", add_help=False)
    prepare = sub.add_parser("prepare-model", help="prepare the model the config names (the default model)")
    prepare.add_argument("--config", default=DEFAULT_CONFIG)
    for name in SERVICES:
        one = sub.add_parser(name, help=f"run the {name} service alone")
        one.add_argument("--config", default=DEFAULT_CONFIG)
        one.add_argument("--nats", default="", help="NATS URL (default: Switchboard.natsUrl from the config)")
        one.add_argument("--name", default=name, help="this process's name in its logs, e.g. engine-1")
    engine = sub.choices["engine"]
    engine.add_argument("--torch-threads", type=_positive, default=0,
                        help="intra-op torch threads, instead of Switchboard.torchThreads (serve splits the cores)")
    engine.add_argument("--role", choices=["both", "prefill", "decode"], default=None,
                        help="prefill/decode disaggregation role, instead of Switchboard.engineRole")
    engine.add_argument("--device-index", type=_natural, default=None,
                        help="logical cuda/npu device id to run on (serve gives engine i npuDeviceIds[i][0])")
    return parser.parse_args(argv)


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return int(text)


def _natural(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return int(text)


def load(path: str, tls: bool = False) -> Config:
    """The config, and with ``tls`` its TLS material checked (httpsEnabled); exit 2 with the key on error."""
    try:
        cfg = load_config(path)
        if tls:
            from services.gateway.web.tls import server_contexts

            server_contexts(cfg)
        return cfg
    except ConfigError as exc:
        print(f"switchboard: {path}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def ensure_model(cfg: Config) -> None:
    """The default model is prepared on first use; any other model folder must already exist, and each file
    of it that a service reads must parse (exit 2 naming the file)."""
    from switchboard.model_prep import DEFAULT_MODEL_DIR_NAME, add_gguf, prepare_default_model

    path = cfg.model_path
    if path.name == DEFAULT_MODEL_DIR_NAME:
        prepare_default_model(path, progress=lambda line: print(f"[model] {line}", flush=True))
        if cfg.switchboard.quantization == "gguf":
            add_gguf(path, progress=lambda line: print(f"[model] {line}", flush=True))
    elif not (path / "config.json").exists():
        what = ("does not exist" if not path.exists() else "is a file, not the model's folder" if not path.is_dir()
                else "holds no config.json")
        print(f"switchboard: ModelConfig.modelWeightPath: {path} {what}", file=sys.stderr)
        raise SystemExit(2)
    check_model(cfg)


def check_model(cfg: Config) -> None:
    try:
        model_folder.check(cfg.model_path, cfg.switchboard.quantization)
    except model_folder.ModelFolderError as exc:
        print(f"switchboard: ModelConfig.modelWeightPath: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def report_unused_keys(path: str) -> None:
    """Once at start: the keys of config.json that Switchboard does not use (MindIE's own features)."""
    unused = unused_keys(Path(path).read_bytes())
    foreign = [named for named in map(misspelt, unused) if named]  # neither MindIE's nor Switchboard's
    mindie = [key for key in unused if not misspelt(key)]
    if mindie:
        print(f"[config] keys Switchboard does not use: {', '.join(mindie)}", flush=True)
    if foreign:
        print(f"[config] keys neither MindIE nor Switchboard has, with no effect (misspelt?): {', '.join(foreign)}",
              file=sys.stderr, flush=True)


def ensure_kernels(cfg: Config) -> None:
    """Build the engine's CPU kernels for this machine ahead of the first engine start (once per
    kernel source and torch version; the engine falls back to PyTorch operations if this fails)."""
    if cfg.switchboard.device != "cpu" or not cfg.switchboard.cpu_kernels:
        return
    import subprocess

    subprocess.run([sys.executable, "-m", "services.engine.kernels"], check=False)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["certs"]:
        from switchboard import certs

        return certs.main(argv[1:])
    args = parse_args(argv)
    cfg = load(args.config, tls=args.command in ("serve", "gateway"))
    if args.command == "prepare-model":
        ensure_model(cfg)
        ensure_kernels(cfg)
        return 0
    if args.command == "serve":
        from switchboard.launcher import launch

        report_unused_keys(args.config)
        try:
            check_free(cfg)  # a port something else listens on: named before anything is prepared or started
            ensure_model(cfg)
            ensure_kernels(cfg)
            return asyncio.run(launch(Path(args.config).resolve(), cfg))
        except ConfigError as exc:
            print(f"switchboard: {args.config}: {exc}", file=sys.stderr)
            return 2
    url = args.nats or cfg.switchboard.nats_url
    if not url:
        print("switchboard: no NATS URL: pass --nats or set Switchboard.natsUrl", file=sys.stderr)
        return 2
    if args.command in ("engine", "tokenizer"):
        check_model(cfg)
    if args.command == "engine":
        place_engine(cfg, args)
    from switchboard.runner import run_service

    return run_service(args.command, cfg, url, label=args.name)


def bind_openmp_threads(environ=os.environ) -> None:
    """One engine alone on the CPU: each of torch's OpenMP threads bound to a core of its own, as
    vLLM's CPU guide does (measured here: +10-30% tokens/s at concurrency 16; a thread that the kernel
    moves between cores loses its caches, and meets the other at the next barrier late). libgomp reads
    these when torch loads it, so this runs before torch is imported. A setting already in the
    environment wins; engines that share the CPU are not bound (``owns_its_cores``)."""
    if not any(var in environ for var in ("OMP_PROC_BIND", "OMP_PLACES", "GOMP_CPU_AFFINITY", "KMP_AFFINITY")):
        environ["OMP_PROC_BIND"] = "true"
        environ["OMP_PLACES"] = "cores"


def owns_its_cores(threads: int) -> bool:
    """Whether torch's threads (0: one per core) are as many as the CPUs this process may run on: then each
    is bound to one of them. A set number below them is not bound: engines sharing a host (``serve``'s
    replicas, pods of a node without the static CPU manager) would bind theirs to the same first cores."""
    return not threads or threads == len(os.sched_getaffinity(0))


def place_engine(cfg: Config, args: argparse.Namespace) -> None:
    """Apply ``--torch-threads`` and ``--device-index`` (before torch starts)."""
    from switchboard.replicas import pin_device

    if getattr(args, "role", None):
        cfg.switchboard.engine_role = args.role
    if args.torch_threads:
        cfg.switchboard.torch_threads = args.torch_threads
    if cfg.switchboard.device == "cpu" and owns_its_cores(cfg.switchboard.torch_threads):
        bind_openmp_threads()
    if args.device_index is not None:
        cfg.switchboard.device_index = args.device_index
        try:
            pin_device(args.device_index)
        except ConfigError as exc:
            print(f"switchboard: --device-index: {exc}", file=sys.stderr)
            raise SystemExit(2) from None


if __name__ == "__main__":
    sys.exit(main())
