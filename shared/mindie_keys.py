"""The key names of MindIE's config.json (every section; ../shared/reference/mindie-api.md §1), to tell a MindIE key
Switchboard does not use from a key that is neither MindIE's nor Switchboard's: most likely a misspelt one, whose
setting then has no effect (``ServerConfig.prot`` leaves ``port`` at its default)."""

from __future__ import annotations

import difflib

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
