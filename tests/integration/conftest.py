"""Session-wide stacks, each on its own nats-server: a tiny random model for plumbing, the default
model for end-to-end runs."""

from __future__ import annotations

import pytest

from switchboard.natsd import EmbeddedNats
from tests.conftest import write_config
from tests.integration.stack import Stack


def _start(tmp_path_factory, name: str, model_dir, **sections):
    nats_server = EmbeddedNats()
    url = nats_server.start()
    sections["Switchboard"] = {"natsUrl": url, **sections.get("Switchboard", {})}
    stack = Stack(write_config(tmp_path_factory.mktemp(name), model_dir, **sections), url)
    try:
        stack.start()
    except BaseException:
        stack.stop()
        nats_server.stop()
        raise
    return stack, nats_server


@pytest.fixture(scope="session")
def tiny_stack(tmp_path_factory, tiny_model_dir):
    stack, nats_server = _start(
        tmp_path_factory, "tiny", tiny_model_dir,
        ServerConfig={"maxRequestLength": 1},
        **{"BackendConfig.ModelDeployConfig": {"maxInputTokenLen": 64}},
    )
    yield stack
    stack.stop()
    nats_server.stop()


@pytest.fixture(scope="session")
def smol_stack(tmp_path_factory, smol_dir):
    stack, nats_server = _start(tmp_path_factory, "smol", smol_dir)
    yield stack
    stack.stop()
    nats_server.stop()
