"""Fixtures for the engine tests: runners over the tiny random model."""

from __future__ import annotations

import pytest

from tests.unit.engine_helpers import make_runner


@pytest.fixture(scope="module")
def tiny_runner(tiny_model_dir):
    return make_runner(tiny_model_dir, num_blocks=64)


@pytest.fixture(scope="module")
def small_pool_runner(tiny_model_dir):
    return make_runner(tiny_model_dir, num_blocks=6)

