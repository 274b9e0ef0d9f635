"""The addresses the gateway listens on, and whether they are free: checked before a deployment starts, so a
port already in use is one line naming its key, not a bind error after every model has loaded."""

from __future__ import annotations

import socket

from shared.config import Config, ConfigError


def addresses(cfg: Config) -> dict[tuple[str, int], str]:
    """Each distinct (host, port) the gateway binds, and the first key that names it (planes may share one)."""
    server, out = cfg.server, {}
    for key, address in (("ServerConfig.port", (server.ip_address, server.port)),
                         ("ServerConfig.managementPort", (server.management_ip, server.management_listen_port)),
                         ("ServerConfig.metricsPort", (server.management_ip, server.metrics_port))):
        out.setdefault(address, key)
    return out


def check_free(cfg: Config) -> None:
    """ConfigError naming the key of an address something else already listens on."""
    for (host, port), key in addresses(cfg).items():
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is free
            try:
                probe.bind((host, port))
            except OSError as exc:
                raise ConfigError(f"{key}: cannot listen on {host}:{port}: {exc.strerror or exc}") from None
