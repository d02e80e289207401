"""The Python binding: the stateful codec and one-shot entry points, errors as exceptions, the engine
from Python threads and after close()."""

import threading

import numpy as np
import pytest
from conftest import ROOT  # noqa: F401  (puts the package on sys.path)

import ciera


def bf16_weights(n, seed):
    x = (np.random.default_rng(seed).standard_normal(n) * 0.02).astype(np.float32)
    return (x.view(np.uint32) >> 16).astype(np.uint16)


def test_stateless_round_trip_and_errors():
    config = ciera.CodecConfig()
    values = bf16_weights(50_001, 1)
    payload = ciera.encode_stateless(config, values)
    assert len(payload) < values.nbytes
    out = np.empty_like(values)
    ciera.decode_stateless(config, payload, out)
    assert np.array_equal(out, values)
    with pytest.raises(ciera.FormatError, match="truncated"):
        ciera.decode_stateless(config, payload[:-1], out)
    corrupt = bytearray(payload)
    corrupt[200] ^= 1
    with pytest.raises(ciera.FormatError):
        ciera.decode_stateless(config, bytes(corrupt), out)


def test_engine_over_loopback_threads():
    world = 3
    layout = ciera.BucketLayout.fsdp_split("b", ciera.DType.bf16, [30_000, 17], world)
    shared = ciera.loopback_world(world)
    data = [bf16_weights(30_017 * world, s) for s in range(6)]
    errors = []

    def rank_body(rank):
        try:
            config = ciera.EngineConfig()
            config.warmup_steps = 2
            engine = ciera.Engine(ciera.loopback_transport(shared, rank), config, [layout])
            for step, full in enumerate(data):
                full = np.concatenate([full[:30_017 * world]])  # the bucket's gathered contents
                mine = np.ascontiguousarray(full.view(np.uint8)[layout.rank_offset(rank):][:layout.rank_bytes(rank)])
                out = np.empty(layout.total_bytes(), dtype=np.uint8)
                stats = engine.run(0, mine.ctypes.data, mine.nbytes, out.ctypes.data, out.nbytes)
                assert np.array_equal(out, full.view(np.uint8)[: layout.total_bytes()]), (rank, step)
                assert stats.compressed == (step >= 2)
            engine.close()
        except Exception as e:  # noqa: BLE001
            errors.append((rank, e))

    threads = [threading.Thread(target=rank_body, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_configuration_errors_are_python_exceptions():
    config = ciera.CodecConfig()
    config.block_values = 10
    with pytest.raises(ciera.ConfigError, match="block_values"):
        config.validate()


def test_engine_timeout_is_a_whole_millisecond_the_transports_can_take():
    config = ciera.EngineConfig()
    config.timeout_s = 0.0004   # rounded up, as the transports round theirs (it was truncated to 0)
    assert config.timeout_s == 0.001
    for bad in (0.0, -1.0, float("nan"), float("inf"), 1e12):   # 1e12: past what a transport takes
        with pytest.raises(ValueError, match="timeout_s must be a finite number of seconds > 0 and below 1e9"):
            config.timeout_s = bad
    assert config.timeout_s == 0.001


def test_engine_after_close_raises_instead_of_crashing():
    layout = ciera.BucketLayout.fsdp_split("b", ciera.DType.bf16, [100], 1)
    engine = ciera.Engine(ciera.loopback_transport(ciera.loopback_world(1), 0), ciera.EngineConfig(), [layout])
    assert engine.cache_bytes >= 0 and not engine.closed
    engine.close()
    assert engine.closed
    with pytest.raises(ValueError, match="engine is closed"):
        engine.cache_bytes
    data = np.zeros(100, dtype=np.uint16)
    with pytest.raises(ValueError, match="engine is closed"):
        engine.run(0, data.ctypes.data, data.nbytes, data.ctypes.data, data.nbytes)
    with pytest.raises(ValueError, match="engine is closed"):
        engine.set_policy(0, 0, ciera.ShardPolicy.raw)
    engine.close()  # closing twice is harmless


def test_a_missing_transport_is_a_type_error_not_a_crash():
    layout = ciera.BucketLayout.fsdp_split("b", ciera.DType.bf16, [100], 1)
    with pytest.raises(TypeError):
        ciera.Engine(None, ciera.EngineConfig(), [layout])
    with pytest.raises(TypeError):
        ciera.measure_cost_model(None, 1 << 20, [ciera.DType.bf16], ciera.CodecConfig())
