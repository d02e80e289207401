"""Misuse of the binding is an error naming the problem, never a crash or a silently wrong value:
DTensors and null data pointers as host memory, a python_transport rank outside its world,
memoryviews kept past a transport call, buffers whose own dtype is not the declared one, and
codec input and output that overlap. Calls that used to crash run in a fresh interpreter, so that
a regression fails its test rather than the whole run."""

import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
from conftest import needs_torch

torch = needs_torch()

import ciera
from ciera import _ext

# Prints what each call raised, as "Type: text" (or "accepted").
_CHILD_PRELUDE = """
import numpy as np, ciera
from ciera import _ext
def refused(call):
    try:
        call()
    except Exception as e:
        print(f"{type(e).__name__}: {e}", flush=True)
    else:
        print("accepted", flush=True)
"""


def _child_output(code: str) -> list[str]:
    done = subprocess.run([sys.executable, "-c", _CHILD_PRELUDE + textwrap.dedent(code)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"rc {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done.stdout.splitlines()


def test_a_dtensor_or_a_null_data_pointer_is_refused_as_host_memory():
    lines = _child_output("""
        import tempfile, torch, torch.distributed as dist, ciera.broadcast
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor
        dist.init_process_group("gloo", store=dist.FileStore(tempfile.mktemp(), 1), rank=0, world_size=1)
        dt = distribute_tensor(torch.arange(8.0), init_device_mesh("cpu", (1,)), [Shard(0)])
        config = ciera.CodecConfig()
        config.dtype = _ext.DType.fp32
        payload, _ = ciera.ShardEncoder(config, 8).encode(dt.to_local())
        refused(lambda: ciera.ShardEncoder(config, 8).encode(dt))
        refused(lambda: ciera.ShardDecoder(config, 8).decode(payload, dt))
        refused(lambda: ciera.broadcast.Broadcaster([dt]))
        dist.destroy_process_group()

        class Unallocated:  # a tensor-like object whose data pointer is 0
            def data_ptr(self): return 0
            def numel(self): return 8
            def element_size(self): return 4
        refused(lambda: ciera.ShardEncoder(config, 8).encode(Unallocated()))
    """)
    advice = "DTensor (a sharded tensor, e.g. an FSDP2 parameter)"
    assert lines[0].startswith("TypeError: shard is a DTensor") and ".to_local()" in lines[0], lines
    assert lines[1].startswith("TypeError: out is a DTensor") and ".to_local()" in lines[1], lines
    assert lines[2].startswith("TypeError: Broadcaster: on rank 0: tensor 0 is a") and advice in lines[2], lines
    assert lines[3] == "ValueError: shard has no memory: a null data pointer for 32 bytes", lines


@pytest.mark.parametrize("rank, size, message", [
    (1, 1, "rank 1 is not in 0..0 (size 1)"),
    (-1, 2, "rank -1 is not in 0..1 (size 2)"),
    (0, 0, "size must be at least 1, got 0"),
])
def test_python_transport_refuses_a_rank_outside_its_world(rank, size, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _ext.python_transport(rank, size, lambda i, o: None, lambda i, o, c, d: None, lambda: None)


def _one_rank_gather(allgather, allgatherv):
    """A one-rank engine over `allgather`/`allgatherv` gathers 4096 BF16 values once."""
    transport = _ext.python_transport(0, 1, allgather, allgatherv, lambda: None)
    layout = ciera.BucketLayout.fsdp_split("b", ciera.DType.bf16, [4096], 1)
    engine = ciera.Engine(transport, ciera.EngineConfig(), [layout])
    data, out = np.ones(4096, np.uint16), np.zeros(4096, np.uint16)
    try:
        engine.run(0, data.ctypes.data, data.nbytes, out.ctypes.data, out.nbytes)
    finally:
        engine.close()


def test_memoryviews_lent_to_transport_callables_are_released_when_they_return():
    kept = []

    def allgather(i, o):
        o[:len(i)] = i
        kept.extend([i, o])

    def allgatherv(i, o, counts, displs):
        o[displs[0]:displs[0] + counts[0]] = i
        kept.extend([i, o])

    _one_rank_gather(allgather, allgatherv)
    assert kept
    for view in kept:
        with pytest.raises(ValueError, match="released memoryview"):
            len(view)
        with pytest.raises(ValueError, match="released memoryview"):
            view[:1] = b"\xab"

    # Also when the callable raises.
    kept.clear()

    def failing(i, o, *lists):
        kept.extend([i, o])
        raise RuntimeError("the peer is gone")

    with pytest.raises(ciera.CommError, match="the peer is gone"):
        _one_rank_gather(failing, failing)
    assert kept
    for view in kept:
        with pytest.raises(ValueError, match="released memoryview"):
            view[:1] = b"\xab"


def test_a_null_pointer_with_bytes_is_refused():
    lines = _child_output("""
        layout = ciera.BucketLayout.fsdp_split("b", ciera.DType.bf16, [100], 1)
        engine = ciera.Engine(ciera.loopback_transport(ciera.loopback_world(1), 0), ciera.EngineConfig(), [layout])
        buffer = np.zeros(100, np.uint16)
        refused(lambda: engine.run(0, 0, 200, buffer.ctypes.data, buffer.nbytes))
        refused(lambda: engine.run(0, buffer.ctypes.data, buffer.nbytes, 0, 200))
        refused(lambda: _ext.ChangeMonitor(_ext.DType.bf16, [100], 512).observe(0, 200))
        refused(lambda: _ext.ExponentChangeCounter(_ext.DType.bf16, 100).observe(0, 200))
        engine.close()
    """)
    assert lines == ["ValueError: input is a null pointer (0) for 200 bytes",
                     "ValueError: output is a null pointer (0) for 200 bytes",
                     "ValueError: data_ptr is a null pointer (0) for 200 bytes",
                     "ValueError: data_ptr is a null pointer (0) for 200 bytes"]


def _loopback(world, body, make=ciera.LosslessCollectives):
    """body(rank, make(transport)) on `world` loopback threads: each rank's result or error."""
    shared = _ext.loopback_world(world)
    outcomes = [None] * world

    def run(rank):
        try:
            outcomes[rank] = body(rank, make(_ext.loopback_transport(shared, rank)))
        except Exception as e:  # noqa: BLE001 - compared below, per rank
            outcomes[rank] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads), "a rank is still waiting in the collective"
    return outcomes


def test_collectives_refuse_buffers_whose_own_dtype_is_not_the_declared_one():
    bf16, fp32, ok = _ext.DType.bf16, _ext.DType.fp32, ciera.CollectiveStats

    def fp32_as_bf16(rank, collectives):
        return collectives.reduce_scatter(bf16, _ext.ReduceOp.sum, torch.ones(4), torch.empty(2))

    outcomes = _loopback(2, fp32_as_bf16)
    assert all(isinstance(e, ciera.ConfigError) for e in outcomes), outcomes
    assert str(outcomes[0]) == "reduce_scatter input holds torch.float32 values, but dtype is bf16"

    # Only rank 1's buffers disagree: rank 0 is told which rank refused, not left waiting.
    def rank_1_float16(rank, collectives):
        x = np.ones(4, np.float16 if rank == 1 else np.uint16)
        return collectives.alltoallv(bf16, x, [2, 2], np.empty(4, np.uint16), [2, 2])

    outcomes = _loopback(2, rank_1_float16)
    assert isinstance(outcomes[0], ciera.ConfigError) and "rank 1 refused its arguments" in str(outcomes[0])
    assert isinstance(outcomes[1], ciera.ConfigError)
    assert str(outcomes[1]) == "alltoallv input holds float16 values, but dtype is bf16"

    outcomes = _loopback(2, lambda rank, c: c.reduce_scatter(fp32, _ext.ReduceOp.sum, np.ones(4, np.float64),
                                                             np.empty(2, np.float32)))
    assert "reduce_scatter input holds float64 values, but dtype is fp32" in str(outcomes[0]), outcomes

    # Untyped bytes and same-sized integers are the values of the declared dtype: moved as they
    # are by alltoallv; added by reduce_scatter only from a buffer (NumPy has no bfloat16).
    def untyped(rank, collectives):
        bf16_bits = torch.ones(4, dtype=torch.bfloat16).view(torch.int16)
        out = torch.empty(8, dtype=torch.uint8)
        return collectives.alltoallv(bf16, bf16_bits, [2, 2], out, [2, 2])

    outcomes = _loopback(2, untyped)
    assert all(isinstance(s, ok) for s in outcomes), outcomes

    def numpy_bits(rank, collectives):
        bf16_bits = torch.ones(4, dtype=torch.bfloat16).view(torch.int16).numpy()
        out = np.empty(4, np.uint8)
        return collectives.reduce_scatter(bf16, _ext.ReduceOp.sum, bf16_bits, out), out

    outcomes = _loopback(2, numpy_bits)
    assert all(isinstance(s, ok) for s, _ in outcomes), outcomes
    assert torch.from_numpy(outcomes[0][1]).view(torch.bfloat16).tolist() == [2.0, 2.0]

    # An integer or bool torch tensor is not added as if its bits were floats: a sum of int32
    # 2^24 read as fp32 would be 0x01800000 (subnormals add like integers, so small ones would
    # have looked right).
    for dtype in (torch.int32, torch.bool, torch.uint8):
        def integers(rank, collectives, dtype=dtype):
            size = 4 if dtype == torch.int32 else 16
            x = torch.full((size,), 1 << 24 if dtype == torch.int32 else 1, dtype=dtype)
            return collectives.reduce_scatter(fp32, _ext.ReduceOp.sum, x, torch.empty(2))

        outcomes = _loopback(2, integers)
        assert all(isinstance(e, ciera.ConfigError) for e in outcomes), outcomes
        assert f"reduce_scatter input holds {dtype} values, but dtype is fp32" in str(outcomes[0]), outcomes


def test_a_tensor_written_by_a_collective_is_seen_by_autograd():
    """A collective writes its output through a pointer, behind autograd's back: an output that
    requires grad is refused on every rank, and the version counter of one that does not is
    bumped, so a tensor autograd saved before the call fails backward() instead of giving a wrong
    gradient (what torch's own in-place operations and collectives do)."""
    fp32 = _ext.DType.fp32
    outcomes = _loopback(2, lambda rank, c: c.reduce_scatter(fp32, _ext.ReduceOp.sum, torch.ones(4),
                                                             torch.zeros(2, requires_grad=True)))
    assert all(isinstance(e, ValueError) and str(e).startswith("reduce_scatter output requires grad")
               for e in outcomes), outcomes

    def saved_then_written(rank, collectives):
        w = torch.ones(2, requires_grad=True)
        x = torch.full((2,), 2.0, requires_grad=True)
        y = (x * w).sum()  # saves w for x's gradient
        before = w._version
        collectives.reduce_scatter(fp32, _ext.ReduceOp.sum, torch.full((4,), 5.0), w.detach())
        assert w._version == before + 1
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.backward()
        return w.detach().clone()

    outcomes = _loopback(2, saved_then_written)
    assert all(isinstance(w, torch.Tensor) and w.tolist() == [10.0, 10.0] for w in outcomes), outcomes


def test_arguments_one_rank_cannot_pass_fail_the_call_on_every_rank_at_once():
    """What the binding refuses on one rank (not a buffer, a null pointer) or a caller refuses
    itself still takes part in the call: its peers fail at once with an error naming that rank,
    not at the timeout, and the next call works everywhere."""
    fp32, started = _ext.DType.fp32, time.monotonic()

    def rank_1_passes_a_list(rank, collectives):
        x = [1.0] * 4 if rank == 1 else np.ones(4, np.float32)
        try:
            collectives.reduce_scatter(fp32, _ext.ReduceOp.sum, x, np.empty(2, np.float32))
        except Exception as e:  # noqa: BLE001 - compared below, per rank
            failure = e
        out = np.empty(2, np.float32)
        collectives.reduce_scatter(fp32, _ext.ReduceOp.sum, np.ones(4, np.float32), out)
        return failure, out

    outcomes = _loopback(2, rank_1_passes_a_list)
    assert isinstance(outcomes[1][0], TypeError) and "reduce_scatter input must be a buffer" in str(outcomes[1][0])
    assert isinstance(outcomes[0][0], ciera.ConfigError)
    assert "rank 1 refused its arguments to its reduce_scatter call 0" in str(outcomes[0][0])
    assert all(np.array_equal(out, [2.0, 2.0]) for _, out in outcomes)

    # A count that is not a count on one rank (a routing bug): pybind11 used to refuse it there
    # alone, before the call.
    for counts, error in (([2, -1], "send_values holds -1: a count must be >= 0"),
                          ([2, 1.5], "send_values holds 1.5, not a whole number"),
                          (7, "send_values must be a sequence of counts, not int")):
        def bad_counts_on_rank_1(rank, collectives, counts=counts):
            send = counts if rank == 1 else np.array([2, 2], np.int64)
            return collectives.alltoallv(fp32, np.ones(4, np.float32), send, np.empty(4, np.float32), (2, 2))

        outcomes = _loopback(2, bad_counts_on_rank_1)
        assert str(outcomes[1]) == error, outcomes
        assert "rank 1 refused its arguments to its alltoallv call 0" in str(outcomes[0]), outcomes

    def rank_0_refuses(rank, collectives):
        if rank == 0:
            collectives.refuse_alltoallv("alltoallv: the tokens are on another device")
        return collectives.alltoallv(fp32, np.ones(4, np.float32), [2, 2], np.empty(4, np.float32), [2, 2])

    outcomes = _loopback(2, rank_0_refuses)
    assert str(outcomes[0]) == "alltoallv: the tokens are on another device"
    assert "rank 0 refused its arguments to its alltoallv call 0" in str(outcomes[1])

    layout = ciera.BucketLayout.fsdp_split("b", ciera.DType.bf16, [100], 2)

    def engine(transport):
        config = ciera.EngineConfig()
        config.timeout_s = 20.0
        return ciera.Engine(transport, config, [layout])

    def rank_1_null_input(rank, engine):
        mine = np.full(layout.rank_bytes(rank) // 2, rank + 1, np.uint16)
        out = np.empty(layout.total_bytes() // 2, np.uint16)
        try:
            engine.run(0, 0 if rank == 1 else mine.ctypes.data, mine.nbytes, out.ctypes.data, out.nbytes)
        except Exception as e:  # noqa: BLE001 - compared below, per rank
            failure = e
        engine.run(0, mine.ctypes.data, mine.nbytes, out.ctypes.data, out.nbytes)
        engine.close()
        return failure, out

    outcomes = _loopback(2, rank_1_null_input, engine)
    assert str(outcomes[1][0]) == "input is a null pointer (0) for 100 bytes"
    assert isinstance(outcomes[0][0], ciera.ConfigError)
    assert "rank 1 rejected its gather of bucket 'b': input is a null pointer (0) for 100 bytes" in str(outcomes[0][0])
    assert all(np.array_equal(out, np.repeat([1, 2], 50)) for _, out in outcomes)
    assert time.monotonic() - started < 15, "a peer waited for the refusing rank until its timeout"


def test_codec_refuses_overlapping_input_and_output():
    config = ciera.CodecConfig()
    config.content_checksum = False
    n = 4096
    values = (np.random.default_rng(0).standard_normal(n) * 0.02).astype(np.float32)
    shard = (values.view(np.uint32) >> 16).astype(np.uint16)
    encoder = ciera.ShardEncoder(config, n)
    buffer = np.zeros(encoder.max_payload_bytes + shard.nbytes, np.uint8)
    buffer[:shard.nbytes] = shard.view(np.uint8)
    with pytest.raises(ValueError, match="shard and payload overlap"):
        encoder.encode_into(buffer[:shard.nbytes].view(np.uint16), buffer)
    # Side by side in one buffer is fine.
    stats = encoder.encode_into(buffer[:shard.nbytes].view(np.uint16), buffer[shard.nbytes:])
    payload = bytes(buffer[shard.nbytes:shard.nbytes + stats.payload_bytes])

    both = bytearray(max(len(payload), shard.nbytes))
    both[:len(payload)] = payload
    view = memoryview(both)
    with pytest.raises(ValueError, match="payload and out overlap"):
        ciera.ShardDecoder(config, n).decode(view[:len(payload)], view[:shard.nbytes])
    with pytest.raises(ValueError, match="payload and out overlap"):
        _ext.decode_stateless(config, view[:len(payload)], view[len(payload) - 1:][:shard.nbytes])
    out = np.empty(n, np.uint16)
    ciera.ShardDecoder(config, n).decode(payload, out)
    assert np.array_equal(out, shard)


def test_codec_refuses_arrays_of_another_float_type():
    """A BF16 codec given an FP32 array of the right byte count coded its bytes as BF16 values,
    and decoded BF16 values into it, which then read as garbage FP32 numbers."""
    config = ciera.CodecConfig()   # BF16
    n = 4096
    shard = (np.random.default_rng(1).standard_normal(n) * 0.02).astype(np.float32)
    bf16 = (shard.view(np.uint32) >> 16).astype(np.uint16)
    as_fp32 = bf16.view(np.float32)   # the same bytes, typed as n / 2 FP32 values
    message = "holds float32 values, but dtype is bf16"
    with pytest.raises(ciera.ConfigError, match="shard " + message):
        ciera.ShardEncoder(config, n).encode(as_fp32)
    with pytest.raises(ciera.ConfigError, match="shard " + message):
        _ext.encode_stateless(config, as_fp32)
    payload, _ = ciera.ShardEncoder(config, n).encode(bf16)
    with pytest.raises(ciera.ConfigError, match="out " + message):
        ciera.ShardDecoder(config, n).decode(payload, np.empty(n // 2, np.float32))
    stateless = _ext.encode_stateless(config, bf16)
    with pytest.raises(ciera.ConfigError, match="out " + message):
        _ext.decode_stateless(config, stateless, np.empty(n // 2, np.float32))
    # BF16 tensors, and the same bytes untyped or as 16-bit integers, are BF16 values.
    out = torch.empty(n, dtype=torch.bfloat16)
    ciera.ShardDecoder(config, n).decode(payload, out)
    assert np.array_equal(out.view(torch.int16).numpy().view(np.uint16), bf16)
    _ext.decode_stateless(config, stateless, bytearray(bf16.nbytes))


def test_monitors_and_counters_take_one_thread_at_a_time():
    """ChangeMonitor.observe and ExponentChangeCounter.observe release the GIL while they scan:
    two threads on one object swapped its buffers at once (a crash, a double free, torn counts).
    A second thread's call is now refused while one is in flight; every call either counts or
    is refused, and the counts agree with the calls that counted; and calls made again and again
    while another thread's runs meet a refusal."""
    n = 1 << 22
    values = np.random.default_rng(1).standard_normal(n).astype(np.float32).view(np.uint32)
    shard = (values >> 16).astype(np.uint16)   # BF16 bits
    monitor = _ext.ChangeMonitor(_ext.DType.bf16, [n], 512)
    counter = _ext.ExponentChangeCounter(_ext.DType.bf16, n)
    outcomes = {"monitor": [], "counter": []}

    def hammer(name, call, times=12):
        for _ in range(times):
            try:
                call()
                outcomes[name].append("ok")
            except RuntimeError as e:
                assert "is in use by another thread" in str(e), e
                outcomes[name].append("refused")

    calls = {"monitor": lambda: monitor.observe(shard.ctypes.data, shard.nbytes),
             "counter": lambda: counter.observe(shard.ctypes.data, shard.nbytes)}
    threads = [threading.Thread(target=hammer, args=(name, call)) for name, call in calls.items() for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    counted = outcomes["monitor"].count("ok")
    # The first observation is the baseline; each later one adds an observation of every shard.
    assert monitor.counts[0].observations == counted - 1, (outcomes, monitor.counts[0].observations)
    assert counter.transitions == outcomes["counter"].count("ok") - 1, (outcomes, counter.transitions)
    # And the guard is there: a call made while another thread's is in flight is refused. Each
    # try calls again and again for as long as the other thread's call runs (milliseconds), so
    # that some call lands inside it; without a guard none is ever refused.
    for name, call in calls.items():
        refused = False
        for _ in range(200):
            other = threading.Thread(target=hammer, args=(name, call, 1))   # refused or not, it says so
            other.start()
            while other.is_alive() and not refused:
                try:
                    call()
                except RuntimeError as e:
                    assert "is in use by another thread" in str(e), e
                    refused = True
            other.join()
            if refused:
                break
        assert refused, f"{name}: no call was refused in 200 tries while another thread's ran"


def test_the_engine_called_or_collected_inside_its_own_transport_call():
    """A transport callable runs on the engine's communication thread. close() there destroyed the
    engine on the thread its destructor joins (std::terminate, the process gone) and wait() there
    waited for itself for ever: both are a ValueError now. The garbage collector dropping the
    engine there ends the process, with a message that says why (the gather in flight would write
    into buffers the same collection may have freed), unless start(keep=) holds those buffers: then
    another thread finishes the gather and lets them go."""
    transport = """
        import gc, threading, time, numpy as np
        layout = ciera.BucketLayout.fsdp_split("b", ciera.DType.bf16, [1000], 1)
        def transport(during):
            def allgather(inp, out):
                out[:] = inp
                during()
            def allgatherv(inp, out, counts, displs):
                out[displs[0]:displs[0] + counts[0]] = inp
            return ciera.python_transport(0, 1, allgather, allgatherv, lambda: None)
        inp, out = np.ones(2000, np.uint8), np.zeros(2000, np.uint8)
        class Buffers:   # a gather's input and output, which say when they go
            def __init__(self):
                self.inp, self.out = np.ones(2000, np.uint8), np.zeros(2000, np.uint8)
            def __del__(self):
                print("buffers let go", flush=True)
    """
    lines = _child_output(transport + """
        held, started = {}, threading.Event()
        def call_back():
            if held.get("engine") is not None and held.pop("armed", False):
                # start() returns while this call may already run: wait until the main thread
                # holds the ticket, so the calls below are made whatever the threads' order.
                assert started.wait(30), "start() did not return while its gather ran"
                for call in (lambda e: e.close(), lambda e: e.wait(held["ticket"])):
                    try:
                        call(held["engine"])
                    except ValueError as e:
                        print("refused:", e)
        held["engine"] = engine = ciera.Engine(transport(call_back), ciera.EngineConfig(), [layout])
        held["armed"] = True
        held["ticket"] = engine.start(0, inp.ctypes.data, inp.nbytes, out.ctypes.data, out.nbytes)
        started.set()
        engine.wait(held["ticket"])
        engine.close()
        print("survived")
    """)
    assert lines[-1] == "survived", lines
    refusals = [line for line in lines if line.startswith("refused:")]
    assert len(refusals) == 2 and all("its own transport's calls" in line for line in refusals), lines
    lines = _child_output(transport + """
        import weakref
        class Buffers: pass
        buffers = Buffers()
        buffers.inp, buffers.out = np.ones(2000, np.uint8), np.zeros(2000, np.uint8)
        engine = ciera.Engine(transport(lambda: None), ciera.EngineConfig(), [layout])
        ticket = engine.start(0, buffers.inp.ctypes.data, 2000, buffers.out.ctypes.data, 2000, keep=buffers)
        kept = weakref.ref(buffers)
        del buffers
        print("held until wait:", kept() is not None)
        engine.wait(ticket)
        print("let go by wait:", kept() is None)
        engine.close()
    """)
    assert lines == ["held until wait: True", "let go by wait: True"], lines
    # A wait() refused (here from inside the gather's own transport call) leaves the gather its
    # buffers: they go once the wait that took the ticket returns, not when the refused one did.
    lines = _child_output(transport + """
        held, started = {}, threading.Event()
        def call_back():
            if held.pop("armed", False):
                assert started.wait(30), "start() did not return while its gather ran"
                try:
                    held["engine"].wait(held["ticket"])
                except ValueError:
                    print("refused inside the gather", flush=True)
        held["engine"] = engine = ciera.Engine(transport(call_back), ciera.EngineConfig(), [layout])
        buffers = Buffers()
        held["armed"] = True
        held["ticket"] = engine.start(0, buffers.inp.ctypes.data, 2000, buffers.out.ctypes.data, 2000, keep=buffers)
        del buffers
        started.set()
        engine.wait(held["ticket"])
        print("waited", flush=True)
        engine.close()
    """)
    assert lines == ["refused inside the gather", "buffers let go", "waited"], lines
    # Two threads wait for one ticket while its gather runs: one is refused, and the buffers go
    # only once the other's wait returns, after the gather.
    lines = _child_output(transport + """
        held, release_gather, results = {}, threading.Event(), []
        def call_back():
            if held.pop("armed", False):
                assert release_gather.wait(30), "the test never let the gather go on"
        engine = ciera.Engine(transport(call_back), ciera.EngineConfig(), [layout])
        buffers = Buffers()
        held["armed"] = True
        ticket = engine.start(0, buffers.inp.ctypes.data, 2000, buffers.out.ctypes.data, 2000, keep=buffers)
        del buffers
        def waiter():
            try:
                engine.wait(ticket)
                results.append("returned")
            except ValueError:
                print("refused", flush=True)
                results.append("refused")
        threads = [threading.Thread(target=waiter) for _ in range(2)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while "refused" not in results and time.monotonic() < deadline:
            time.sleep(0.01)
        print("gather let go on", flush=True)
        release_gather.set()
        for t in threads:
            t.join()
        print(sorted(results), flush=True)
        engine.close()
    """)
    assert lines == ["refused", "gather let go on", "buffers let go", "['refused', 'returned']"], lines
    for keep in (False, True):
        done = subprocess.run([sys.executable, "-c", _CHILD_PRELUDE + textwrap.dedent(transport) + textwrap.dedent(f"""
            gc.disable()
            class Owner: pass
            class Buffers:
                def __init__(self):
                    self.inp, self.out = np.ones(2000, np.uint8), np.zeros(2000, np.uint8)
                def __del__(self):
                    print("buffers let go, gathered:", bool((self.out == 1).all()), flush=True)
                    freed.set()
            freed = threading.Event()
            owner = Owner(); owner.cycle = owner
            owner.buffers = buffers = Buffers()
            armed, dropped = threading.Event(), threading.Event()
            # The agreement in the constructor calls the transport too: only the gather collects.
            during = lambda: armed.is_set() and (dropped.wait(30), gc.collect())
            owner.engine = ciera.Engine(transport(during), ciera.EngineConfig(), [layout])
            armed.set()
            owner.engine.start(0, buffers.inp.ctypes.data, 2000, buffers.out.ctypes.data, 2000,
                               keep=buffers if {keep} else None)
            del owner, buffers  # collected inside the gather's own transport call, by gc.collect() there
            dropped.set()
            if {keep}:
                freed.wait(30)  # let go once another thread has finished the gather
            else:
                time.sleep(30)  # the process ends long before this does
            print("went on", flush=True)
        """)], capture_output=True, text=True, timeout=60)
        if keep:  # the buffers outlive the gather, which another thread finishes
            assert done.returncode == 0, (done.returncode, done.stdout, done.stderr)
            assert done.stdout.splitlines() == ["buffers let go, gathered: True", "went on"], done.stdout
        else:
            assert done.returncode != 0 and "went on" not in done.stdout, (done.returncode, done.stdout, done.stderr)
            assert "ciera: an Engine was garbage-collected inside one of its own transport's calls" in done.stderr, \
                done.stderr
