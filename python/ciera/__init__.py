"""CIERA: lossless compressed allgather for sharded training of Mixture-of-Experts models.

All algorithmic work happens in the C++ library (``ciera._ext``); this package is the binding,
the PyTorch FSDP2 integration (:mod:`ciera.torch`) and the training harness (:mod:`ciera.train`).
"""

from ciera._ext import (  # noqa: F401
    BucketLayout,
    ChangeDetection,
    CodecConfig,
    CommError,
    ConfigError,
    DType,
    Engine,
    EngineConfig,
    Error,
    ExponentCoding,
    FormatError,
    GatherStats,
    ShardPolicy,
    WarmupMode,
    __version__,
    decode_stateless,
    encode_stateless,
    format_version,
    loopback_transport,
    loopback_world,
    max_payload_bytes,
    python_transport,
    with_mpi,
)

__all__ = [
    "BucketLayout", "ChangeDetection", "CodecConfig", "CommError", "ConfigError", "DType", "Engine",
    "EngineConfig", "Error", "ExponentCoding", "FormatError", "GatherStats", "ShardPolicy",
    "WarmupMode", "decode_stateless", "encode_stateless", "loopback_transport", "loopback_world",
    "max_payload_bytes", "python_transport",
]
