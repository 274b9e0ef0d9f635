"""The key names of MindIE's config.json (every section; ../shared/reference/mindie-api.md §1), to tell a MindIE key
Switchboard does not use from a key that is neither MindIE's nor Switchboard's: most likely a misspelt one, whose
setting then has no effect (``ServerConfig.prot`` leaves ``port`` at its default); and which keys of a config.json
Switchboard reads nothing from (``unused_keys``), listed once at start."""

from __future__ import annotations

import difflib

import msgspec

from shared.config import Config, unwrap

MINDIE_KEYS = frozenset({
    "allowAllZeroIpListening", "async_scheduler_wait_time", "BackendConfig", "backendName", "backendType",
    "bufferResponseEnabled", "cacheBlockSize", "cpuMemSize", "decodeExpectedTime", "decodePolicyType",
    "decodeTimeMsPerReq", "distDPServerEnabled", "distributedEnable", "dynamicBatchSizeEnable", "dynamicLogLevel",
    "dynamicLogLevelValidHours", "dynamicLogLevelValidTime", "e2eTimeout", "enablChunkedPrefill",
    "EnableDynamicAdjustTimeoutConfig", "enablePrefixCache", "enableSplit", "fullTextEnabled", "HealthCheckConfig",
    "httpsEnabled", "inferMode", "interCommPk", "interCommPkPwd", "interCommPort", "interCommTlsCaFiles",
    "interCommTlsCaPath", "interCommTlsCert", "interCommTlsCrlFiles", "interCommTlsCrlPath", "interCommTLSEnabled",
    "interNodeKmcKsfMaster", "interNodeKmcKsfStandby", "interNodeTlsCaFiles", "interNodeTlsCaPath",
    "interNodeTlsCert", "interNodeTlsCrlFiles", "interNodeTlsCrlPath", "interNodeTLSEnabled", "interNodeTlsPk",
    "interNodeTlsPkPwd", "ipAddress", "kmcKsfMaster", "kmcKsfStandby", "kv_link_timeout", "kv_trans_timeout",
    "kvPoolConfig", "layerwiseDisaggregated", "LogConfig", "logFileNum", "logFileSize", "logLevel", "logPath",
    "longPrefillTokenThreshold", "LoraModules", "managementIpAddress", "managementPort", "managementTlsCaFile",
    "managementTlsCert", "managementTlsCrlFiles", "managementTlsCrlPath", "managementTlsPk", "managementTlsPkPwd",
    "maxBatchSize", "maxFirstTokenWaitTime", "maxInputTokenLen", "maxIterTimes", "maxJsonDepth", "maxLinkNum",
    "maxLongPartialPrefills", "maxLoraRank", "maxLoras", "maxN", "maxNumPartialPrefills", "maxPreemptCount",
    "maxPrefillBatchSize", "maxPrefillTokens", "maxQueueDelayMicroseconds", "maxRequestLength", "maxSeqLen",
    "metricsPort", "metricsTlsCaFile", "metricsTlsCert", "metricsTlsCrlFiles", "metricsTlsCrlPath", "metricsTlsPk",
    "metricsTlsPkPwd", "ModelConfig", "ModelDeployConfig", "modelInstanceNumber", "modelInstanceType", "modelName",
    "models", "modelWeightPath", "multiNodesInferEnabled", "multiNodesInferPort", "nextPHeadPrior", "npuDeviceIds",
    "npuMemSize", "npuUsageThreshold", "openAiSupport", "pluginParams", "policyType", "port", "prefillChunkSize",
    "prefillExpectedTime", "prefillPolicyType", "prefillTimeMsPerReq", "ScheduleConfig", "ServerConfig",
    "splitChunkTokens", "splitStartBatchSize", "splitStartType", "splitType", "stageSelectPolicy",
    "supportSelectBatch", "templateName", "templateType", "tlsCaFile", "tlsCaPath", "tlsCert", "tlsCrlFiles",
    "tlsCrlPath", "tlsPk", "tlsPkPwd", "tokenizerProcessNumber", "tokenTimeout", "truncation", "trustRemoteCode",
    "Version", "worldSize"
})

FAMILIES = ("layerwiseDisaggregated",)  # MindIE's keys named by a prefix (layerwiseDisaggregatedRoleType, ...)


def misspelt(path: str) -> str:
    """``path``'s last key with the MindIE key it most likely meant, e.g. ``ServerConfig.prot (port?)``;
    "" for a key of MindIE's."""
    key = path.rsplit(".", 1)[-1].split("[", 1)[0]
    if key in MINDIE_KEYS or key.startswith(FAMILIES):
        return ""
    close = difflib.get_close_matches(key, MINDIE_KEYS, n=1, cutoff=0.6)
    return f"{path} ({close[0]}?)" if close else path


# MindIE keys the schema checks (their types and ranges) but nothing reads: set to anything but their default,
# they are listed with the unused keys (a user who set them expects an effect)
NO_EFFECT = frozenset({"support_select_batch", "prefill_time_ms_per_req", "decode_time_ms_per_req",
                       "npu_usage_threshold", "trust_remote_code", "backend_name", "max_first_token_wait_time"})


def unused_keys(raw: bytes) -> list[str]:
    """The keys of config.json that Switchboard reads nothing from (MindIE's sections hold keys for MindIE's
    own features), as paths such as ``BackendConfig.ModelDeployConfig.ModelConfig[0].trustRemoteCode``: those
    the schema does not have, and those of ``NO_EFFECT`` set to anything but their default."""
    try:
        return list(_unused(msgspec.json.decode(raw), msgspec.inspect.type_info(Config), ""))
    except msgspec.DecodeError:
        return []


def _unused(value, info, path: str):
    info = unwrap(info)
    if isinstance(info, msgspec.inspect.StructType) and isinstance(value, dict):
        fields = {f.encode_name: f for f in info.fields}
        for key, item in value.items():
            where = f"{path}.{key}" if path else key
            if key in fields and fields[key].name in NO_EFFECT and item != fields[key].default:
                yield where
            elif key in fields:
                yield from _unused(item, fields[key].type, where)
            elif not key.startswith("_"):
                yield where
    elif isinstance(info, msgspec.inspect.ListType) and isinstance(value, list):
        for index, item in enumerate(value):
            yield from _unused(item, info.item_type, f"{path}[{index}]")
