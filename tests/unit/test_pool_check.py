"""A K/V pool that cannot hold one sequence of maxSeqLen is refused at start, naming the keys to change
(services/engine/build.py; the engine's start turns the ConfigError into one line and exit 2, as
tests/integration/test_launcher.py checks for the engine's other start-up refusals)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from services.engine.build import check_pool_holds_a_sequence
from shared.config import ConfigError, parse_config

BASE = json.loads((Path(__file__).resolve().parents[2] / "config" / "config.json").read_text())


def config(max_seq_len: int):
    data = json.loads(json.dumps(BASE))
    data["BackendConfig"]["ModelDeployConfig"]["maxSeqLen"] = max_seq_len
    return parse_config(json.dumps(data).encode())


def test_a_pool_smaller_than_one_sequence_names_the_budget():
    runner = SimpleNamespace(num_blocks=2048, block_size=16)  # 32,768 tokens
    with pytest.raises(ConfigError) as info:
        check_pool_holds_a_sequence(runner, config(40000), "cpu")
    assert str(info.value) == ("BackendConfig.ModelDeployConfig.maxSeqLen: 40000 tokens do not fit the K/V cache, "
                               "which holds 32768 tokens (2048 blocks of 16); raise Switchboard.kvCacheMemoryMb or "
                               "lower maxSeqLen")
    with pytest.raises(ConfigError, match="npuMemSize"):
        check_pool_holds_a_sequence(runner, config(40000), "cuda")
    check_pool_holds_a_sequence(runner, config(32768), "cpu")  # exactly one sequence fits
