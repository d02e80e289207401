"""ciera.broadcast: one rank's tensors to the others in value-delta frames, bit for bit."""

import pytest

from conftest import all_ok, error_of, grown, needs_torch, ranks_store, spawn, stage_failing, until

torch = needs_torch()

import ciera
import ciera.broadcast  # noqa: F401  (the submodule)


def _weights(step: int, dtype):
    """The root's tensors at `step`: weights that move a little every step, plus special values."""
    g = torch.Generator().manual_seed(7)
    base = torch.randn(5003, generator=g) * 0.02
    drift = torch.randn(5003, generator=g) * 1e-5   # Adam-like steps: a fraction of a BF16 ulp
    w = (base + step * drift).to(dtype)
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 1e-40], dtype=torch.float32)
    w[:6] = specials.to(dtype)
    # The second tensor jumps every step (doubling, sign flips): exact all the same.
    jumping = base[:777] * (1 + step) * (-1) ** step
    return [w, jumping.to(dtype).reshape(7, 111)]


def broadcast_rounds(rank, world, policy, root, steps):
    dtypes = [torch.bfloat16, torch.float32, torch.float16]
    tensors = []
    for dtype in dtypes:
        tensors += [torch.full_like(t, 3.0) for t in _weights(0, dtype)]
    config = None
    if policy == "ciera":   # the default warmup (30 gathers) would leave every step raw
        config = ciera.EngineConfig()
        config.warmup_steps = 2
    bcast = ciera.broadcast.Broadcaster(tensors, root=root, policy=policy, config=config)
    wire, raw = [], []
    try:
        for step in range(steps):
            if rank == root:
                fresh = [t for dtype in dtypes for t in _weights(step, dtype)]
                for t, f in zip(tensors, fresh):
                    t.copy_(f)
            stats = bcast.broadcast()
            wire.append(stats.wire_bytes)
            raw.append(stats.raw_bytes)
            expected = [t for dtype in dtypes for t in _weights(step, dtype)]
            for t, e in zip(tensors, expected):
                assert torch.equal(t.view(torch.uint8), e.view(torch.uint8)), f"step {step}: not bit-exact"
        cache = bcast.cache_bytes
    finally:
        bcast.close()
    bcast.close()   # a second close() is harmless
    return {"wire": wire, "raw": raw, "cache": cache, "after_close": error_of(bcast.broadcast),
            "cache_after_close": error_of(lambda: bcast.cache_bytes)}


def _policies():
    return ["delta", "ciera", "raw"] if hasattr(ciera.ShardPolicy, "delta") else ["ciera", "raw"]


@pytest.mark.parametrize("policy", _policies())
def test_broadcast_is_bit_exact_and_small(policy):
    results = spawn(broadcast_rounds, 3, policy, 1, 6)
    assert all(status == "ok" for status, _ in results.values()), results
    wire, raw = results[0][1]["wire"], results[0][1]["raw"]
    for _, r in results.values():   # the Broadcaster's own text: it has no Handle.disable()
        assert r["after_close"] == "ValueError: Broadcaster is closed (close()); it cannot broadcast", r
        assert r["cache_after_close"] == "ValueError: Broadcaster is closed (close()); it holds no cache", r
    if policy == "delta":
        # After the first (key) frames, the differences of weights that barely move are small:
        # BF16's and FP16's a fraction of a bit per value, FP32's (half of the raw bytes, and
        # thousands of its ulps per step) about half its raw bits; the jumping tensor's are key
        # frames.
        assert max(wire[1:]) < raw[0] / 2, wire
    if policy == "ciera":
        # Past the warmup, exponent reuse leaves the exponents of the slowly moving weights out.
        assert sum(wire[2:]) < 0.9 * sum(raw[2:]), (wire, raw)
    if policy == "raw":
        assert wire == raw, (wire, raw)
        assert results[0][1]["cache"] == 0


def bad_root(rank, world):
    with pytest.raises(ValueError, match="root 5"):
        ciera.broadcast.Broadcaster([torch.zeros(4)], root=5)
    with pytest.raises(ValueError, match="policy"):
        ciera.broadcast.Broadcaster([torch.zeros(4)], root=0, policy="zstd")
    with pytest.raises(ciera.ConfigError, match="int64"):
        ciera.broadcast.Broadcaster([torch.zeros(4, dtype=torch.int64)], root=0)
    # 0.5 is in range(2) but no rank: it used to be taken, and broadcast() failed obscurely.
    with pytest.raises(TypeError, match=r"root must be an int \(a rank of the group\), got float 0.5"):
        ciera.broadcast.Broadcaster([torch.zeros(4)], root=0.5)
    with pytest.raises(TypeError, match="process_group must be a torch.distributed ProcessGroup or None, got str"):
        ciera.broadcast.Broadcaster([torch.zeros(4)], root=0, process_group="x")
    import numpy as np   # a NumPy integer is a rank like any int
    ciera.broadcast.Broadcaster([torch.zeros(4)], root=np.int64(1)).close()
    return True


def refused_on_one_rank(rank, world, receivers):
    """The root's tensors are fine; the receivers' are not (`receivers`: what they pass)."""
    config = ciera.EngineConfig()
    config.timeout_s = 20   # the root's wait, had it waited for them in the transport's set-up
    tensors = [torch.zeros(4)] if rank == 0 else {"empty": [], "int64": [torch.zeros(4, dtype=torch.int64)],
                                                  "config": [torch.zeros(4)]}[receivers]
    if receivers == "config" and rank > 0:
        config = 3
    return error_of(lambda: ciera.broadcast.Broadcaster(tensors, root=0, config=config))


@pytest.mark.parametrize("receivers,error", [("empty", "ValueError: Broadcaster: on rank 1: no tensors"),
                                             ("int64", "ConfigError: Broadcaster: on rank 1: tensor 0 is torch.int64"),
                                             ("config", "TypeError: Broadcaster: on rank 1: config must be a "
                                                        "ciera.EngineConfig, got int")])
def test_a_receivers_refused_tensors_fail_every_rank_at_once(receivers, error):
    results = spawn(refused_on_one_rank, 3, receivers)
    assert all(status == "ok" for status, _ in results.values()), results
    # Before the transport is made: with the old checks the root waited there for the receivers
    # and failed at its 20 s timeout ("RuntimeError: Wait timeout").
    for rank, (_, text) in results.items():
        assert text is not None and text.startswith(error), (rank, text)


def changed_on_one_rank(rank, world):
    """Rank 2 replaces a tensor's data by FP16 values of the same size after set-up: every rank's
    next broadcast fails at once (rank 2's with its reason), and the one after it works."""
    import time

    config = ciera.EngineConfig()
    config.timeout_s = 20
    tensors = [torch.full((4,), float(rank)), torch.full((8,), float(rank), dtype=torch.bfloat16)]
    broadcaster = ciera.broadcast.Broadcaster(tensors, root=0, config=config)
    broadcaster.broadcast()
    before = tensors[1].data
    if rank == 2:
        tensors[1].data = torch.zeros(8, dtype=torch.float16)
    start = time.perf_counter()
    error = error_of(broadcaster.broadcast)
    seconds = time.perf_counter() - start
    tensors[1].data = before
    broadcaster.broadcast()
    same = all(torch.equal(t, torch.zeros_like(t)) for t in tensors)
    broadcaster.close()
    return error, seconds, same


def test_a_tensor_changed_on_one_rank_fails_every_rank_at_once():
    results = spawn(changed_on_one_rank, 3)
    assert all(status == "ok" for status, _ in results.values()), results
    reason = "Broadcaster: tensor 1 is now torch.float16; it was torch.bfloat16 at set-up"
    for rank, (_, (error, seconds, same)) in results.items():
        expected = (f"ConfigError: {reason}" if rank == 2
                    else f"ConfigError: rank 2 rejected its gather of bucket 'tensor0': {reason}")
        assert error == expected and seconds < 15 and same, (rank, error, seconds, same)


class _StartFails:
    """A Broadcaster's engine whose start() of `bucket` raises on this rank (as a CUDA stream
    error would), the rest as the engine does."""

    def __init__(self, engine, bucket):
        self.engine, self.bucket = engine, bucket

    def start(self, bucket, *args, **kwargs):
        if bucket == self.bucket:
            raise RuntimeError("the start failed")
        return self.engine.start(bucket, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.engine, name)


def a_start_fails_on_one_rank(rank, world):
    """Rank 2 cannot start the second tensor's gather after starting the first: what each rank's
    broadcast raised and how long it took, and whether the next broadcast delivered the root's."""
    import time

    config = ciera.EngineConfig()
    config.timeout_s = 20   # the peers' wait, had they waited for rank 2's second gather
    tensors = [torch.full((4,), float(rank)), torch.full((8,), float(rank), dtype=torch.bfloat16)]
    broadcaster = ciera.broadcast.Broadcaster(tensors, root=0, config=config)
    engine = broadcaster.engine
    if rank == 2:
        broadcaster.engine = _StartFails(engine, 1)
    start = time.perf_counter()
    error = error_of(broadcaster.broadcast)
    seconds = time.perf_counter() - start
    broadcaster.engine = engine
    for t in tensors:
        t.fill_(float(rank))
    broadcaster.broadcast()   # nothing left in flight: the next one works on every rank
    same = all(bool((t == 0).all()) for t in tensors)
    broadcaster.close()
    return error, seconds, same


def test_a_gather_one_rank_cannot_start_fails_every_rank_at_once():
    results = spawn(a_start_fails_on_one_rank, 3)
    assert all(status == "ok" for status, _ in results.values()), results
    for rank, (_, (error, seconds, same)) in results.items():
        expected = ("RuntimeError: the start failed" if rank == 2
                    else "ConfigError: rank 2 rejected its gather of bucket 'tensor1': the start failed")
        assert error == expected and seconds < 15 and same, (rank, error, seconds, same)


def a_set_up_stage_fails_on_one_rank(rank, world, stage):
    """The Broadcaster's transport or engine (`stage`: make_transport, or the extension's Engine)
    failing on the last rank alone just after it was made: what each rank raised, its seconds and
    what it held (conftest.stage_failing); then a second Broadcaster in the same processes
    delivers the root's values."""
    from ciera import _ext
    from ciera.fsdp import lifecycle

    config = ciera.EngineConfig()
    config.timeout_s = 20   # the peers' wait in the engine's configuration agreement, had they waited
    tensors = [torch.full((64,), float(rank)), torch.full((8,), float(rank), dtype=torch.bfloat16)]
    owner, error, close = {
        "make_transport": (ciera.broadcast, RuntimeError("no route to the peers on this node"), None),
        "Engine": (_ext, MemoryError("no room for the codec state"), lifecycle.close_engine)}[stage]
    out = stage_failing(rank == world - 1, lambda: ciera.broadcast.Broadcaster(tensors, root=0, config=config),
                        owner, stage, error, close)
    with ciera.broadcast.Broadcaster(tensors, root=0, config=config) as bcast:
        bcast.broadcast()
    out["delivered"] = all(bool((t == 0).all()) for t in tensors)
    return out


@pytest.mark.parametrize("stage,error", [("make_transport", "RuntimeError: no route to the peers on this node"),
                                         ("Engine", "MemoryError: no room for the codec state")])
def test_a_set_up_stage_failing_on_one_rank_fails_every_rank_at_once_leaving_nothing(stage, error):
    """Each stage is agreed on every rank. Until stop 72 a transport failing on rank 1 left rank 0
    in the engine's configuration agreement until its 20 s timeout (a CommError naming gloo), an
    engine failing there left rank 0 with a Broadcaster whose peer had none; and each rank kept
    what it had made (a gloo group: 3 threads, 5 descriptors) as long as its error was held."""
    results = all_ok(spawn(a_set_up_stage_fails_on_one_rank, 2, stage))
    for rank, r in enumerate(results):
        assert r["error"] == f"ConfigError: Broadcaster: rank 1 could not set up CIERA: {error}", (rank, r)
        assert r["seconds"] < 10, (rank, r)   # not the 20 s timeout
        assert not grown(r["before"], r["held"]), (rank, r)
        assert not grown(r["before"], r["after"]), (rank, r)
        assert r["delivered"], (rank, r)


def misused(rank, world, case):
    """The root's arguments are fine; the receivers' make a broadcast that cannot be bit-exact."""
    config = None
    if rank == 0:
        tensors = [torch.zeros(2, 3)] if case == "shape" else [torch.zeros(8), torch.zeros(8)]
    elif case == "shape":
        tensors = [torch.zeros(3, 2)]   # the same count and dtype: the engine alone took it
    elif case == "alias":
        a = torch.zeros(8)
        tensors = [a, a]
    elif case == "overlap":
        buffer = torch.zeros(12)
        tensors = [buffer[0:8], buffer[4:12]]
    elif case == "negated":
        # A one-value complex tensor's .conj().imag: a contiguous FP32 view whose values are the
        # negation of the memory the engine writes, so it read -1.0 where the root held 1.0.
        tensors = [torch.zeros(8), torch.ones(1, dtype=torch.complex64).conj().imag]
    else:
        tensors, config = [torch.zeros(8), torch.zeros(8)], ciera.EngineConfig()
    if rank == 0 and case == "negated":
        tensors = [torch.zeros(8), torch.zeros(1)]
    return error_of(lambda: ciera.broadcast.Broadcaster(tensors, root=0, config=config))


@pytest.mark.parametrize("case,error", [
    ("shape", "ConfigError: Broadcaster: the ranks differ in the shape of tensor 0: [2, 3] on rank 0; [3, 2] on "
              "rank 1; [3, 2] on rank 2"),
    ("alias", "ConfigError: Broadcaster: on rank 1: tensors 0 and 1 share memory"),
    ("overlap", "ConfigError: Broadcaster: on rank 1: tensors 0 and 1 share memory"),
    ("config", "ConfigError: Broadcaster: the ranks differ in config: 'None' on rank 0; 'an EngineConfig' on "
               "ranks 1, 2"),
    ("negated", "ConfigError: Broadcaster: on rank 1: tensor 1 is a negated view (its values are its memory's "
                "negated, e.g. .conj().imag); pass .resolve_neg()")])
def test_tensors_that_cannot_come_out_bit_exact_are_refused_on_every_rank(case, error):
    # Each was taken before: the receivers' tensors then held the root's bytes in another shape,
    # or one bucket's values over another's (the audit's [1, 1, 1, 1, 2, 2, 2, 2] for [1] * 8).
    results = spawn(misused, 3, case)
    assert all(status == "ok" for status, _ in results.values()), results
    for rank, (_, text) in results.items():
        assert text is not None and text.startswith(error), (rank, text)


def overlapping_calls(rank, world):
    """Rank 0 calls broadcast() from a second thread while its first call waits for rank 1: the
    second is refused on rank 0 alone, nothing started, and the Broadcaster goes on working."""
    import threading

    tensors = [torch.full((16,), float(rank + 1)), torch.full((16,), float(rank + 1), dtype=torch.bfloat16)]
    broadcaster = ciera.broadcast.Broadcaster(tensors, root=1)
    second, store = None, ranks_store()
    if rank == 0:
        first = threading.Thread(target=broadcaster.broadcast)
        first.start()
        until(broadcaster._calling.locked, "the first thread's broadcast() began")
        second = error_of(broadcaster.broadcast)
        closing = error_of(broadcaster.close)   # refused too: the first call still runs
        store.set("overlapped", "1")            # rank 1 joins the first call only now
        first.join()
    else:
        closing = None
        store.wait(["overlapped"])
        broadcaster.broadcast()
    for t in tensors:
        t.fill_(5.0 if rank == 1 else 0.0)
    broadcaster.broadcast()
    exact = all(torch.equal(t, torch.full_like(t, 5.0)) for t in tensors)
    broadcaster.close()
    return second, closing, exact


def test_a_second_threads_call_is_refused_and_leaves_the_broadcaster_working():
    results = spawn(overlapping_calls, 2)
    assert all(status == "ok" for status, _ in results.values()), results
    assert results[0][1] == ("RuntimeError: Broadcaster.broadcast: another thread's broadcast() on this Broadcaster "
                             "is in flight; calls must not overlap",
                             "RuntimeError: Broadcaster.close: a broadcast() on this Broadcaster is in flight; close it "
                             "after", True), results[0]
    assert results[1][1] == (None, None, True), results[1]


def reshaped_on_one_rank(rank, world):
    """Rank 1 gives a tensor data of the same size and dtype but another shape after set-up."""
    config = ciera.EngineConfig()
    config.timeout_s = 20
    tensors = [torch.zeros(2, 3)]
    broadcaster = ciera.broadcast.Broadcaster(tensors, root=0, config=config)
    if rank == 1:
        tensors[0].data = torch.zeros(3, 2)
    error = error_of(broadcaster.broadcast)
    broadcaster.close()
    return error


def test_a_tensor_reshaped_after_set_up_is_refused_on_every_rank():
    results = spawn(reshaped_on_one_rank, 2)
    assert all(status == "ok" for status, _ in results.values()), results
    reason = "Broadcaster: tensor 0 is now of shape [3, 2]; it was [2, 3] at set-up"
    assert results[1][1] == f"ConfigError: {reason}", results[1]
    assert results[0][1] == f"ConfigError: rank 1 rejected its gather of bucket 'tensor0': {reason}", results[0]


def backward_across_a_broadcast(rank, world):
    """A receiver's forward saves its weight for backward, then a broadcast overwrites the weight."""
    weight = torch.nn.Parameter(torch.full((4,), float(rank + 1)))
    broadcaster = ciera.broadcast.Broadcaster([weight], root=0)
    loss = (weight * weight).sum()   # d loss / d weight = 2 * the weight of the forward
    broadcaster.broadcast()          # rank 1's weight: 2.0 -> the root's 1.0
    error = error_of(loss.backward)
    broadcaster.close()
    return error, weight.tolist()


def test_a_broadcast_into_a_weight_saved_for_backward_fails_that_backward():
    # The engine writes through the tensor's pointer, which autograd does not see: rank 1's
    # backward went on with the new weight, a gradient of 2.0 each where the forward's was 4.0.
    results = spawn(backward_across_a_broadcast, 2)
    assert all(status == "ok" for status, _ in results.values()), results
    assert results[0][1] == (None, [1.0] * 4), results[0]   # the root's values are unchanged
    error, weight = results[1][1]
    assert weight == [1.0] * 4 and error is not None and error.startswith(
        "RuntimeError: one of the variables needed for gradient computation has been modified by an inplace "
        "operation"), results[1]


def storage_shrunk_on_one_rank(rank, world, storage_bytes):
    """Rank 1 frees or shrinks its tensor's storage after set-up (as FSDP frees an unsharded
    parameter's), its shape kept: what each rank's next broadcast raised, and whether the one
    after the storage is given back its size delivered the root's values."""
    config = ciera.EngineConfig()
    config.timeout_s = 20
    tensors = [torch.full((1024,), float(rank))]
    broadcaster = ciera.broadcast.Broadcaster(tensors, root=0, config=config)
    broadcaster.broadcast()
    if rank == 1:
        tensors[0].untyped_storage().resize_(storage_bytes)
    error = error_of(broadcaster.broadcast)
    if rank == 1:
        tensors[0].untyped_storage().resize_(4096)
    broadcaster.broadcast()
    exact = torch.equal(tensors[0], torch.zeros(1024))
    broadcaster.close()
    return error, exact


@pytest.mark.parametrize("storage_bytes", [0, 16])
def test_a_tensor_whose_storage_shrank_on_one_rank_is_refused_on_every_rank(storage_bytes):
    # 16 bytes: the engine wrote the root's 4096 past their end (glibc: "free(): invalid next size",
    # rank 1 killed) while rank 0's broadcast succeeded; 0: a null pointer, named as such only.
    results = spawn(storage_shrunk_on_one_rank, 2, storage_bytes)
    assert all(status == "ok" for status, _ in results.values()), results
    reason = f"Broadcaster: tensor 0's storage holds {storage_bytes} of its 4096 bytes: freed or shrunk"
    assert results[1][1] == (f"ConfigError: {reason}", True), results[1]
    assert results[0][1] == (f"ConfigError: rank 1 rejected its gather of bucket 'tensor0': {reason}", True), \
        results[0]


def test_broadcast_rejects_bad_arguments():
    results = spawn(bad_root, 2)
    assert all(status == "ok" for status, _ in results.values()), results


def mpi_without_mpirun(rank, world):
    return error_of(lambda: ciera.broadcast.Broadcaster([torch.zeros(4)], root=0, transport="mpi"))


@pytest.mark.skipif(not ciera._ext.with_mpi, reason="this build has no MPI transport")
def test_transport_mpi_outside_mpirun_says_so():
    # Each process started apart (as torchrun does) is an MPI world of one: said as such on every
    # rank, where the engine's agreement said "bucket 'tensor0' describes 2 ranks but the
    # transport has 1", on rank 1 too as "rank 0".
    results = spawn(mpi_without_mpirun, 2)
    for rank, (status, text) in results.items():
        assert status == "ok" and text is not None, (rank, status, text)
        assert text.startswith("ConfigError: transport 'mpi' found an MPI world of 1 process, but the process "
                               "group has 2 ranks: start the ranks with mpirun"), (rank, text)
