"""config.json's keys that Switchboard does not use: MindIE's own (listed as such) apart from keys neither MindIE
nor Switchboard has (misspelt, most likely: named with the key they were probably meant to be)."""

from __future__ import annotations

from pathlib import Path

from shared.mindie_keys import misspelt, unused_keys

SHIPPED = Path(__file__).resolve().parents[2] / "config" / "config.json"


def test_a_misspelt_key_is_named_with_the_key_it_was_meant_to_be():
    assert misspelt("ServerConfig.prot") == "ServerConfig.prot (port?)"
    assert misspelt("ServerConfig.managementPrt") == "ServerConfig.managementPrt (managementPort?)"
    assert misspelt("BackendConfig.zzzqqq") == "BackendConfig.zzzqqq"


def test_mindies_own_keys_are_not_misspelt():
    assert misspelt("ServerConfig.distDPServerEnabled") == misspelt("LogConfig") == ""
    assert misspelt("BackendConfig.ModelDeployConfig.ModelConfig[0].trustRemoteCode") == ""
    assert [key for key in unused_keys(SHIPPED.read_bytes()) if misspelt(key)] == []  # the shipped config's


def test_keys_from_mindies_own_docs_are_mindies():
    """Keys a config copied from MindIE's documentation has (reference §1): never called misspelt."""
    for path in ("EnableDynamicAdjustTimeoutConfig", "ServerConfig.kmcKsfStandby", "ServerConfig.interCommTlsCert",
                 "BackendConfig.interNodeKmcKsfMaster", "BackendConfig.ScheduleConfig.maxNumPartialPrefills",
                 "ServerConfig.layerwiseDisaggregatedRoleType"):
        assert misspelt(path) == "", path
