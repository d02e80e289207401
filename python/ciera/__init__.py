"""CIERA: lossless compressed allgather for sharded training of Mixture-of-Experts models.

All algorithmic work happens in the C++ library (``ciera._ext``); this package is the binding,
the PyTorch FSDP2 integration (:mod:`ciera.torch`) and the training harness (:mod:`ciera.train`).
"""

from ciera._ext import (  # noqa: F401
    BucketLayout,
    ChangeDetection,
    ChangeMonitor,
    CodecConfig,
    CodecThroughput,
    CommCurve,
    CommError,
    ConfigError,
    CostModel,
    DType,
    Engine,
    EngineConfig,
    Error,
    ExponentChangeCounter,
    ExponentCoding,
    FormatError,
    GatherStats,
    SelectorOptions,
    ShardCandidate,
    ShardPolicy,
    WarmupMode,
    __version__,
    classify_parameter,
    decode_stateless,
    encode_stateless,
    format_version,
    loopback_transport,
    loopback_world,
    max_payload_bytes,
    measure_codec,
    measure_cost_model,
    python_transport,
    select_shards,
    with_mpi,
)

__all__ = [
    "BucketLayout", "ChangeDetection", "ChangeMonitor", "CodecConfig", "CodecThroughput", "CommCurve",
    "CommError", "ConfigError", "CostModel", "DType", "Engine", "EngineConfig", "Error",
    "ExponentChangeCounter", "ExponentCoding", "FormatError", "GatherStats", "SelectorOptions",
    "ShardCandidate", "ShardPolicy", "WarmupMode", "classify_parameter", "decode_stateless",
    "encode_stateless", "loopback_transport", "loopback_world", "max_payload_bytes", "measure_codec",
    "measure_cost_model", "python_transport", "select_shards",
]
