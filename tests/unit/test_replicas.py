"""What `switchboard serve` starts (switchboard/replicas.py): modelInstanceNumber engines and
tokenizerProcessNumber tokenizers, each engine with its share of the cores or its own device."""

from __future__ import annotations

import json

import pytest

from shared.config import ConfigError, parse_config
from switchboard.cli import parse_args
from switchboard.replicas import pin_device, replicas
from tests.conftest import DEFAULT_CONFIG


def config(engines: int = 1, tokenizers: int = 1, device: str = "cpu", threads: int = 0, ids=None):
    data = json.loads(DEFAULT_CONFIG.read_text())
    data["BackendConfig"].update({"modelInstanceNumber": engines, "tokenizerProcessNumber": tokenizers})
    if ids is not None:
        data["BackendConfig"]["npuDeviceIds"] = ids
    data.setdefault("Switchboard", {}).update({"device": device, "torchThreads": threads})
    return parse_config(json.dumps(data).encode())


def test_one_of_each_keeps_the_plain_names_and_no_flags():
    plan = replicas(config(), cores=8)
    assert [(r.service, r.name, r.flags) for r in plan] == [("metrics", "metrics", ()), ("tokenizer", "tokenizer", ()),
                                                             ("engine", "engine", ()), ("gateway", "gateway", ())]


def test_several_engines_on_cpu_split_the_cores():
    plan = replicas(config(engines=3, tokenizers=2), cores=8)
    assert [r.name for r in plan] == ["metrics", "tokenizer-0", "tokenizer-1",
                                      "engine-0", "engine-1", "engine-2", "gateway"]
    assert {r.flags for r in plan if r.service == "engine"} == {("--torch-threads", "2")}
    assert {r.flags for r in replicas(config(engines=4), cores=2) if r.service == "engine"} == {("--torch-threads", "1")}


def test_a_configured_thread_count_is_each_engines_own():
    assert all(not r.flags for r in replicas(config(engines=2, threads=3), cores=8))


def test_accelerator_engines_take_one_npu_device_ids_entry_each():
    plan = replicas(config(engines=2, device="cuda", ids=[[2, 3], [5]]), cores=8)
    assert [r.flags for r in plan if r.service == "engine"] == [("--device-index", "2"), ("--device-index", "5")]
    with pytest.raises(ConfigError, match="npuDeviceIds"):
        replicas(config(engines=2, device="npu", ids=[[0]]))


def test_auto_uses_devices_when_listed_and_splits_threads():
    listed = replicas(config(engines=2, device="auto", ids=[[0], [1]]), cores=4)
    assert [r.flags for r in listed if r.service == "engine"] == [
        ("--torch-threads", "2", "--device-index", "0"), ("--torch-threads", "2", "--device-index", "1")]
    unlisted = replicas(config(engines=2, device="auto"), cores=4)
    assert {r.flags for r in unlisted if r.service == "engine"} == {("--torch-threads", "2")}


def test_every_planned_command_line_parses():
    for replica in replicas(config(engines=2, tokenizers=2, device="cuda", ids=[[0], [1]]), cores=4):
        args = parse_args([replica.service, "--name", replica.name, *replica.flags])
        assert args.command == replica.service and args.name == replica.name


def test_pin_device_counts_within_the_visible_devices():
    env: dict[str, str] = {}
    pin_device(1, env)
    assert env == {"CUDA_VISIBLE_DEVICES": "1", "ASCEND_RT_VISIBLE_DEVICES": "1"}
    env = {"CUDA_VISIBLE_DEVICES": "4,6"}
    pin_device(1, env)
    assert env["CUDA_VISIBLE_DEVICES"] == "6"
    with pytest.raises(ConfigError, match="shows only 2"):
        pin_device(2, {"CUDA_VISIBLE_DEVICES": "4,6"})


def test_a_lone_cpu_engine_binds_its_openmp_threads_unless_the_environment_says_otherwise():
    from switchboard.cli import bind_openmp_threads

    environ: dict[str, str] = {}
    bind_openmp_threads(environ)
    assert environ == {"OMP_PROC_BIND": "true", "OMP_PLACES": "cores"}
    mine = {"OMP_PROC_BIND": "false"}
    bind_openmp_threads(mine)
    assert mine == {"OMP_PROC_BIND": "false"}


def test_threads_are_bound_only_where_they_own_their_cores():
    """A set thread count below the process's CPUs is not bound (two engines on one host bound theirs to the
    same first cores); one per CPU it may run on is (a pod with the static CPU manager's exclusive cores)."""
    import os

    from switchboard.cli import owns_its_cores

    cpus = len(os.sched_getaffinity(0))
    assert owns_its_cores(0) and owns_its_cores(cpus)
    assert not owns_its_cores(cpus + 1)
    if cpus > 1:
        assert not owns_its_cores(cpus - 1)
