"""Session-wide stacks, each on its own nats-server: a tiny random model for plumbing, the default
model for end-to-end runs."""

from __future__ import annotations

import pytest

from tests.integration.stack import running_stack


@pytest.fixture(scope="session")
def tiny_stack(tmp_path_factory, tiny_model_dir):
    with running_stack(tmp_path_factory.mktemp("tiny"), tiny_model_dir,
                       ServerConfig={"maxRequestLength": 1},
                       **{"BackendConfig.ModelDeployConfig": {"maxInputTokenLen": 64}}) as stack:
        yield stack


@pytest.fixture(scope="session")
def smol_stack(tmp_path_factory, smol_dir):
    with running_stack(tmp_path_factory.mktemp("smol"), smol_dir) as stack:
        yield stack
