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


@pytest.fixture(scope="session")
def spans():
    """Every span this process ends, in memory (cleared by the test that reads it)."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    memory = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    return memory
