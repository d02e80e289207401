"""CIERA: lossless compressed allgather for sharded training of Mixture-of-Experts models.

All algorithmic work happens in the C++ library (``ciera._ext``); this package is the binding,
the PyTorch FSDP2 integration (:mod:`ciera.torch`, implemented in :mod:`ciera.fsdp`) and the
training harness (:mod:`ciera.train`); ZeRO-1/2 parameter sync through CIERA is
:mod:`ciera.zero` (imported on its own: it needs torch, this package does not).

The codec itself, over NumPy arrays, bytes-like objects or CPU tensors::

    encoder = ciera.ShardEncoder(ciera.CodecConfig(), values.size)   # sender, one per shard
    decoder = ciera.ShardDecoder(ciera.CodecConfig(), values.size)   # receiver, one per peer shard
    payload, stats = encoder.encode(shard)                      # every step
    decoder.decode(payload, out)                                # bit-exact, or ciera.FormatError

The C++ library this package was built with, for a CMake project (``find_package(ciera)``)::

    cmake -DCMAKE_PREFIX_PATH="$(python -c 'import ciera; print(ciera.cmake_prefix_path)')" ...
"""

from pathlib import Path as _Path

from ciera._ext import (  # noqa: F401
    BucketLayout,
    ChangeCounts,
    ChangeDetection,
    ChangeGrid,
    ChangeMonitor,
    ChangeStatistics,
    CodecConfig,
    CodecThroughput,
    CollectiveCoding,
    CollectivesConfig,
    CollectiveStats,
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
    ExponentSection,
    FormatError,
    FrameKind,
    FrameStats,
    GatherStats,
    LosslessCollectives,
    Selection,
    SelectorOptions,
    ShardCandidate,
    ShardChangeCounts,
    ShardChoice,
    ShardDecoder,
    ShardEncoder,
    ShardPolicy,
    ShardType,
    StreamKind,
    ReduceOp,
    WarmupMode,
    __version__,
    classify_parameter,
    decode_stateless,
    encode_stateless,
    format_version,
    loopback_transport,
    loopback_world,
    max_payload_bytes,
    new_stream_epoch,
    measure_codec,
    measure_cost_model,
    python_transport,
    select_shards,
    with_mpi,
)


def _sdk_prefix() -> str | None:
    here = _Path(__file__).resolve().parent
    # lib, lib64 or a multiarch lib/<triplet>: wherever GNUInstallDirs put it.
    configs = (*here.glob("lib*/cmake/ciera/cieraConfig.cmake"), *here.glob("lib/*/cmake/ciera/cieraConfig.cmake"))
    return str(here) if configs else None


#: The prefix under which find_package(ciera) finds the C++ library of a pip-installed package
#: (its include/ and lib/ are inside the package); None where there is none (a source tree).
cmake_prefix_path = _sdk_prefix()

__all__ = [
    "BucketLayout", "ChangeCounts", "ChangeDetection", "ChangeGrid", "ChangeMonitor", "ChangeStatistics",
    "CodecConfig", "CodecThroughput", "CollectiveCoding", "CollectivesConfig", "CollectiveStats", "CommCurve",
    "CommError", "ConfigError", "CostModel", "DType", "Engine", "EngineConfig", "Error", "ExponentChangeCounter",
    "ExponentCoding", "ExponentSection", "FormatError", "FrameKind", "FrameStats", "GatherStats",
    "LosslessCollectives", "ReduceOp", "Selection", "SelectorOptions", "ShardCandidate", "ShardChangeCounts",
    "ShardChoice", "ShardDecoder", "ShardEncoder", "ShardPolicy", "ShardType", "StreamKind", "WarmupMode",
    "classify_parameter",
    "decode_stateless", "encode_stateless", "loopback_transport", "loopback_world", "max_payload_bytes",
    "measure_codec", "measure_cost_model", "python_transport", "select_shards", "cmake_prefix_path",
    "format_version", "new_stream_epoch", "with_mpi",
]
