"""The key names of MindIE's config.json (every section; ../shared/reference/mindie-api.md §1), to tell a MindIE key
Switchboard does not use from a key that is neither MindIE's nor Switchboard's: most likely a misspelt one, whose
setting then has no effect (``ServerConfig.prot`` leaves ``port`` at its default)."""

from __future__ import annotations

import difflib

MINDIE_KEYS = frozenset({
    "BackendConfig", "HealthCheckConfig", "LogConfig", "LoraModules", "ModelConfig", "ModelDeployConfig",
    "ScheduleConfig", "ServerConfig", "Version", "allowAllZeroIpListening", "async_scheduler_wait_time",
    "backendName", "backendType", "cacheBlockSize", "cpuMemSize", "decodePolicyType", "decodeTimeMsPerReq",
    "distDPServerEnabled", "dynamicLogLevel", "dynamicLogLevelValidHours", "dynamicLogLevelValidTime",
    "fullTextEnabled", "httpsEnabled", "inferMode", "interCommPort", "interCommTLSEnabled", "interCommTlsCaPath",
    "interNodeTLSEnabled", "interNodeTlsCaPath", "ipAddress", "kmcKsfMaster", "kvPoolConfig", "kv_link_timeout",
    "kv_trans_timeout", "logFileNum", "logFileSize", "logLevel", "logPath", "managementIpAddress", "managementPort",
    "managementTlsCaFile", "managementTlsCert", "managementTlsCrlFiles", "managementTlsCrlPath", "managementTlsPk",
    "managementTlsPkPwd", "maxBatchSize", "maxFirstTokenWaitTime", "maxInputTokenLen", "maxIterTimes",
    "maxJsonDepth", "maxLinkNum", "maxLoras", "maxN", "maxPreemptCount", "maxPrefillBatchSize", "maxPrefillTokens",
    "maxQueueDelayMicroseconds", "maxRequestLength", "maxSeqLen", "metricsPort", "metricsTlsCaFile",
    "modelInstanceNumber", "modelInstanceType", "modelName", "modelWeightPath", "multiNodesInferEnabled",
    "multiNodesInferPort", "npuDeviceIds", "npuMemSize", "npuUsageThreshold", "openAiSupport", "pluginParams",
    "port", "prefillPolicyType", "prefillTimeMsPerReq", "supportSelectBatch", "templateName", "templateType",
    "tlsCaFile", "tlsCaPath", "tlsCert", "tlsCrlFiles", "tlsCrlPath", "tlsPk", "tlsPkPwd", "tokenTimeout",
    "tokenizerProcessNumber", "truncation", "trustRemoteCode", "worldSize"
})


def misspelt(path: str) -> str:
    """``path``'s last key with the MindIE key it most likely meant, e.g. ``ServerConfig.prot (port?)``;
    "" for a key of MindIE's."""
    key = path.rsplit(".", 1)[-1].split("[", 1)[0]
    if key in MINDIE_KEYS:
        return ""
    close = difflib.get_close_matches(key, MINDIE_KEYS, n=1, cutoff=0.6)
    return f"{path} ({close[0]}?)" if close else path
