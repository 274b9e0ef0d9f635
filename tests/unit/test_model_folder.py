"""shared/model_folder.py and the config's own checks: what a user's folder or config.json gets wrong is
named at start, with the file or key and what it needs."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from shared.config import ConfigError, parse_config
from shared.mindie_keys import unused_keys
from shared.model_folder import ModelFolderError, check, processor_config
from tests.conftest import write_config
from tests.unit.test_config import BASE, patched


@pytest.fixture
def folder(tmp_path, tiny_model_dir):
    out = tmp_path / "model"
    shutil.copytree(tiny_model_dir, out)
    return out


def test_a_good_folder_passes(folder):
    check(folder)


@pytest.mark.parametrize("name", ["config.json", "tokenizer_config.json", "generation_config.json"])
def test_a_malformed_json_file_is_named(folder, name):
    (folder / name).write_text("{not json")
    with pytest.raises(ModelFolderError, match=f"{name}: is not valid JSON"):
        check(folder)


def test_a_missing_config_tokenizer_or_weights_is_named(folder):
    (folder / "tokenizer.json").unlink()
    with pytest.raises(ModelFolderError, match="holds no tokenizer"):
        check(folder)
    for path in folder.glob("*.safetensors"):
        path.unlink()
    (folder / "tokenizer.json").write_text("{}")
    with pytest.raises(ModelFolderError, match="holds no weights"):
        check(folder)
    (folder / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ModelFolderError, match="names neither model_type nor architectures"):
        check(folder)


def test_the_processor_class_is_found_where_transformers_looks(folder):
    with pytest.raises(ModelFolderError, match="names the model's processor_class"):
        processor_config(folder)
    (folder / "preprocessor_config.json").write_text(json.dumps({"processor_class": "Qwen2VLProcessor"}))
    assert processor_config(folder)["processor_class"] == "Qwen2VLProcessor"
    (folder / "processor_config.json").write_text(json.dumps({"processor_class": "Idefics3Processor"}))
    assert processor_config(folder)["processor_class"] == "Idefics3Processor"


def test_an_unknown_switchboard_key_is_refused_with_its_path():
    with pytest.raises(ConfigError, match=r"Switchboard.quantisation: not a key of the Switchboard section \(its keys: "):
        parse_config(json.dumps(patched(Switchboard={"quantisation": "int8"})).encode())


def test_the_keys_switchboard_does_not_use_are_listed():
    data = patched(**{"BackendConfig.ModelDeployConfig.ModelConfig.0": {"pluginParams": ""}})
    unused = unused_keys(json.dumps(data).encode())
    assert "BackendConfig.ModelDeployConfig.ModelConfig[0].pluginParams" in unused
    assert not any(key.startswith("Switchboard") for key in unused)
    assert unused_keys(json.dumps(BASE).encode()) == [k for k in unused if "pluginParams" not in k]
    # keys the schema checks but nothing reads: listed once set to anything but their default
    data = patched(**{"BackendConfig.ModelDeployConfig.ModelConfig.0": {"trustRemoteCode": True},
                      "BackendConfig.ScheduleConfig": {"supportSelectBatch": True, "prefillTimeMsPerReq": 150}})
    unused = unused_keys(json.dumps(data).encode())
    assert "BackendConfig.ModelDeployConfig.ModelConfig[0].trustRemoteCode" in unused
    assert "BackendConfig.ScheduleConfig.supportSelectBatch" in unused
    assert "BackendConfig.ScheduleConfig.prefillTimeMsPerReq" not in unused  # (its default)


def test_prepare_model_exits_2_naming_the_bad_file(folder, tmp_path):
    (folder / "tokenizer_config.json").write_text("[1, 2]")
    config = write_config(tmp_path, folder)
    done = subprocess.run([sys.executable, "-m", "switchboard.cli", "prepare-model", "--config", str(config)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "tokenizer_config.json: must hold a JSON object, not list" in done.stderr


def test_a_shard_the_index_names_must_be_there(folder):
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(ModelFolderError, match="names model-00002-of-00002.safetensors, which the folder does not hold"):
        check(folder)


def test_the_weights_and_config_json_must_be_of_one_model(tiny_model_dir, tmp_path):
    """transformers fills a tensor the weights lack with random numbers in silence (a model that answers noise),
    and refuses another shape with the names in its log only: each is a start-up error naming the tensor."""
    import torch
    from safetensors.torch import load_file, save_file

    from services.engine.model_loading import load_model

    for change, named in ((lambda s, c: s.pop("model.layers.1.mlp.down_proj.weight"), "no tensor model.layers.1.mlp"),
                          (lambda s, c: c.update(num_hidden_layers=3), "no tensor model.layers.2.input_layernorm"),
                          (lambda s, c: c.update(intermediate_size=256), "hold model.layers.0.mlp.down_proj.weight as"),
                          (lambda s, c: c.pop("architectures"), "names no architectures.*LlamaForCausalLM")):
        folder = tmp_path / named.split()[-1].replace("*", "")
        shutil.copytree(tiny_model_dir, folder)
        state, config = load_file(str(folder / "model.safetensors")), json.loads((folder / "config.json").read_text())
        change(state, config)
        save_file(state, str(folder / "model.safetensors"))
        (folder / "config.json").write_text(json.dumps(config))
        with pytest.raises(ModelFolderError, match=named):
            load_model(str(folder), torch.device("cpu"), torch.float32)


def test_a_tokenizer_file_that_parses_but_is_no_tokenizer_is_named(tiny_model_dir, tmp_path):
    from services.tokenizer.encoder import load_tokenizer

    shutil.copytree(tiny_model_dir, tmp_path / "model")
    (tmp_path / "model" / "tokenizer.json").write_text("{}")
    with pytest.raises(ModelFolderError, match="cannot make its tokenizer"):
        load_tokenizer(str(tmp_path / "model"))
