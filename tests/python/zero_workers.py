"""Rank bodies for test_zero.py (module-level so that spawned processes can import them)."""

import copy
import gc
import weakref

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

import ciera
from ciera import zero
from ciera.broadcast import Broadcaster
from conftest import _failing_after, held_by_process, stage_failing

# The shard policy under test: value deltas where this build has them.
POLICY = "delta" if hasattr(ciera.ShardPolicy, "delta") else "ciera"


def model(dtype, seed=0, sizes=(48, 96, 24), bias=True):
    torch.manual_seed(seed)
    layers = []
    for a, b in zip(sizes, sizes[1:]):
        layers += [torch.nn.Linear(a, b, bias=bias), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers[:-1]).to(dtype)


def step(net, optimizer, rank, world, step_index, dtype):
    """One data-parallel step: this rank's batch, gradients averaged over ranks (what DDP does),
    then the optimizer. Returns the loss's bits."""
    g = torch.Generator().manual_seed(1000 * step_index + rank)
    x = torch.randn(8, net[0].in_features, generator=g).to(dtype)
    loss = net(x).float().pow(2).mean()
    loss.backward()
    for p in net.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= world
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return int(loss.detach().view(torch.int32).item())


def same_bits(a, b) -> bool:
    return all(torch.equal(x.detach().view(torch.uint8), y.detach().view(torch.uint8))
               for x, y in zip(a.parameters(), b.parameters()))


def compare(rank, world, dtype, sizes, steps=10, lr=1e-4, policy=POLICY, bias=True, freeze_at=None,
            zero_sized=False):
    """Trains the same model with PyTorch's ZeRO and with CIERA's, step by step; returns every
    step's comparison and the sync statistics. `zero_sized`: the first layer holds a trainable
    parameter of no values too (a [0, 4] one, after its weight and bias)."""
    optimizer_class = zero.fp32_master(torch.optim.AdamW) if dtype != torch.float32 else torch.optim.AdamW
    plain_net, net = model(dtype, sizes=sizes, bias=bias), model(dtype, sizes=sizes, bias=bias)
    if zero_sized:
        for n in (plain_net, net):
            n[0].register_parameter("nothing", torch.nn.Parameter(torch.empty(0, 4, dtype=dtype)))
    plain = TorchZero(plain_net.parameters(), optimizer_class, parameters_as_bucket_view=True, lr=lr)
    ours = zero.ZeroRedundancyOptimizer(net.parameters(), optimizer_class, policy=policy, lr=lr)
    equal, losses_equal, stats = [], [], []
    for s in range(steps):
        if s == freeze_at:
            # Trainability changes: both ZeROs rebuild their buckets (CIERA's its engine too).
            for n in (plain_net, net):
                n[0].weight.requires_grad_(False)
        losses_equal.append(step(plain_net, plain, rank, world, s, dtype) == step(net, ours, rank, world, s, dtype))
        equal.append(same_bits(plain_net, net))
        stats.append((ours.last_sync.raw_bytes, ours.last_sync.wire_bytes, ours.last_sync.bits_per_value))
    # Views: every rank's bucket lies in the one flat tensor that is gathered in place.
    flat = ours._syncs[0].flat
    in_flat = all(p.data_ptr() >= flat.data_ptr() and
                  p.data_ptr() + p.numel() * p.element_size() <= flat.data_ptr() + flat.numel() * flat.element_size()
                  for p in net.parameters() if p.requires_grad and p.numel())   # no values: no address
    mine = sum(p.numel() for g in ours.optim.param_groups for p in g["params"])
    result = {"equal": equal, "losses_equal": losses_equal, "stats": stats, "in_flat": in_flat, "mine": mine,
              "cache_bytes": ours.cache_bytes, "changed": not same_bits(net, model(dtype, sizes=sizes, bias=bias))}
    ours.close()
    return result


def exact_vs_torch(rank, world):
    """BF16 with FP32 masters, FP32, a partition in which the last rank holds nothing, and the
    state_dict round trip (one set of processes for all: starting them is the slow part)."""
    import time

    times = {}
    out = {}
    for name, body in (("bf16", lambda: compare(rank, world, torch.bfloat16, (48, 96, 24))),
                       ("fp32", lambda: compare(rank, world, torch.float32, (48, 96, 24), steps=4)),
                       ("frozen", lambda: compare(rank, world, torch.bfloat16, (48, 96, 24), steps=5, freeze_at=2)),
                       # One parameter: every rank but one holds nothing.
                       ("empty", lambda: compare(rank, world, torch.bfloat16, (16, 8), steps=3, bias=False)),
                       # A parameter of no values, whose data_ptr() is 0: the check that each
                       # parameter still lies in its bucket refused every step.
                       ("zero_sized", lambda: compare(rank, world, torch.bfloat16, (48, 96, 24), steps=3,
                                                      zero_sized=True)),
                       # The comparison policies: exponent reuse, and no coding at all.
                       ("ciera", lambda: compare(rank, world, torch.bfloat16, (48, 96, 24), steps=3, policy="ciera")),
                       ("raw", lambda: compare(rank, world, torch.bfloat16, (48, 96, 24), steps=2, policy="raw")),
                       ("resume", lambda: state_dict_round_trip(rank, world)),
                       ("differing", lambda: arguments_that_differ(rank)),
                       ("step_fails", lambda: a_step_that_fails_on_one_rank(rank))):
        start = time.perf_counter()
        out[name] = body()
        times[name] = time.perf_counter() - start
    out["times"] = times
    return out


def state_dict_round_trip(rank, world):
    """ZeRO's consolidated state_dict (with the FP32 masters of every rank) loaded into a fresh
    CIERA ZeRO continues bitwise like the optimizer it came from; plus the lifecycle: the engine
    closes, and a closed optimizer refuses to sync."""
    optimizer_class = zero.fp32_master(torch.optim.AdamW)
    net = model(torch.bfloat16)
    ours = zero.ZeroRedundancyOptimizer(net.parameters(), optimizer_class, policy=POLICY, lr=1e-3)
    for s in range(3):
        step(net, ours, rank, world, s, torch.bfloat16)
    ours.consolidate_state_dict(to=0)
    box = [ours.state_dict() if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    resumed_net = copy.deepcopy(net)
    resumed = zero.ZeroRedundancyOptimizer(resumed_net.parameters(), optimizer_class, policy=POLICY, lr=1.0)
    resumed.load_state_dict(box[0])
    lr_restored = resumed.param_groups[0]["lr"] == 1e-3 and resumed.optim.param_groups[0]["lr"] == 1e-3
    for s in range(3, 6):
        step(net, ours, rank, world, s, torch.bfloat16)
        step(resumed_net, resumed, rank, world, s, torch.bfloat16)
    # The wrapper hands its param_groups' hyperparameters to the inner optimizer at each step.
    lr_restored &= resumed.optim.inner.param_groups[0]["lr"] == 1e-3
    identical = same_bits(net, resumed_net)
    ours.close()
    resumed.close()
    ours.close()   # twice is harmless
    # A step after close() is refused before PyTorch's local step changes this rank's partition.
    net(torch.randn(8, net[0].in_features).to(torch.bfloat16)).float().pow(2).mean().backward()
    before = [p.detach().clone() for p in net.parameters()]
    try:
        ours.step()
        closed_error = None
    except ValueError as e:
        closed_error = str(e)
    untouched = all(torch.equal(a.view(torch.int16), b.detach().view(torch.int16))
                    for a, b in zip(before, net.parameters()))
    return {"identical": identical, "lr_restored": lr_restored, "closed_error": closed_error,
            "untouched_after_close": untouched}


def arguments_that_differ(rank):
    """Rank 1 alone passes a bad policy, then another chunk_values, then float64 parameters:
    every rank raises, naming it, at once (the engines' set-up would otherwise wait for rank 1
    until its timeout)."""
    import time

    out = {}
    for name, kwargs in (("bad_policy", {"policy": "fast"}), ("chunk_values", {"chunk_values": 512}),
                         ("fp64", {}), ("empty", {}), ("mixed_dense", {}), ("extra_layer", {}),
                         ("transposed", {})):
        start = time.perf_counter()
        dtype = torch.float64 if name == "fp64" and rank == 1 else torch.bfloat16
        params = list(model(dtype).parameters())
        if rank == 1 and name == "empty":
            params = []
        if rank == 1 and name == "mixed_dense":   # a frozen FP32 tensor among BF16 parameters
            params.append(torch.zeros(3, requires_grad=False))
        if rank == 1 and name == "extra_layer":   # another model: the same layers and one more
            params.append(torch.zeros(2, dtype=torch.bfloat16, requires_grad=True))
        if rank == 1 and name == "transposed":    # the same sizes, another shape
            params[0] = torch.zeros(tuple(reversed(params[0].shape)), dtype=torch.bfloat16, requires_grad=True)
        try:
            zero.ZeroRedundancyOptimizer(params, torch.optim.SGD, lr=0.1, **(kwargs if rank == 1 else {}))
            out[name] = "accepted"
        except Exception as e:  # noqa: BLE001 - compared by the test
            out[name] = f"{type(e).__name__}: {e}"
        out[name + "_s"] = time.perf_counter() - start
    return out


class _FailsOnRank1(torch.optim.SGD):
    """SGD whose second step raises on rank 1 (an out-of-memory as its state is made, say)."""

    steps = 0

    def step(self, closure=None):
        if dist.get_rank() == 1 and self.steps == 1:
            raise RuntimeError("out of memory on rank 1")
        self.steps += 1
        return super().step(closure)


def a_step_that_fails_on_one_rank(rank):
    """Rank 1's local step raises at the second step: what each rank's step() raised, and when
    (rank 0, already in the parameter sync, would otherwise wait out the 20 s timeout)."""
    import time

    net = model(torch.bfloat16)
    config = ciera.EngineConfig()
    config.warmup_steps = 0
    config.timeout_s = 20
    optimizer = zero.ZeroRedundancyOptimizer(list(net.parameters()), _FailsOnRank1, lr=0.1, engine_config=config)
    for p in net.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    start = time.perf_counter()
    try:
        optimizer.step()
        error = None
    except Exception as e:  # noqa: BLE001 - compared by the test
        error = f"{type(e).__name__}: {e}"
    seconds = time.perf_counter() - start
    # No rank's parameters are torch's ZeRO's any more (rank 0 stepped its partition, rank 1 did
    # not reach it): a later step is refused on every rank, not run on them.
    return {"error": error, "seconds": seconds, "next": _timed(optimizer.step)[0]}


def _timed(call):
    """(what call() raised as "Type: text", or None; its seconds)."""
    import time

    start = time.perf_counter()
    try:
        call()
        error = None
    except Exception as e:  # noqa: BLE001 - compared by the test
        error = f"{type(e).__name__}: {e}"
    return error, time.perf_counter() - start


def _optimizer(net, optimizer_class=torch.optim.SGD, **kwargs):
    config = ciera.EngineConfig()
    config.warmup_steps = 0
    config.timeout_s = 20
    return zero.ZeroRedundancyOptimizer(list(net.parameters()), optimizer_class, engine_config=config,
                                        **{"lr": 0.1, **kwargs})


def _ones_grads(net):
    for p in net.parameters():
        p.grad = torch.ones_like(p) if p.requires_grad else None


def rebuilds_and_their_failures(rank, world):
    """What a user audit found around the buckets' rebuilds (add_param_group, a change of
    trainability): each case's error and seconds on this rank."""
    from ciera.fsdp import lifecycle

    out = {}
    # An argument the optimizer class refuses on rank 1 alone: every rank, at once.
    out["bad_lr"] = _timed(lambda: _optimizer(model(torch.bfloat16), lr=-1.0 if rank == 1 else 0.1))

    # Rebuilds keep one transport (and one process group) per device; close() releases them.
    groups_before = len(lifecycle._own_groups)
    net = model(torch.bfloat16)
    optimizer = _optimizer(net)
    groups_built = len(lifecycle._own_groups)
    for k in range(6):   # six rebuilds: layer 0 frozen, unfrozen, ...
        net[0].weight.requires_grad_(k % 2 == 0)
        _ones_grads(net)
        optimizer.step()
    out["groups"] = (groups_before, groups_built, len(lifecycle._own_groups))
    optimizer.close()
    out["groups_after_close"] = len(lifecycle._own_groups)
    # Dropped without close(): its groups go when it is collected.
    dropped = _optimizer(model(torch.bfloat16))
    out["groups_of_dropped"] = len(lifecycle._own_groups) - groups_before
    del dropped
    gc.collect()
    out["groups_after_drop"] = len(lifecycle._own_groups)
    out["add_group_after_close"] = _timed(
        lambda: optimizer.add_param_group({"params": [torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))]}))[0]

    # A step that fails on rank 1 in the step that rebuilds: rank 0 is told at once.
    net = model(torch.bfloat16)
    optimizer = _optimizer(net)
    _ones_grads(net)
    optimizer.step()
    net[0].weight.requires_grad_(False)
    _ones_grads(net)

    def closure():
        if rank == 1:
            raise RuntimeError("a closure that fails on rank 1")
        return torch.zeros(())

    out["fails_in_rebuild"] = _timed(lambda: optimizer.step(closure))
    optimizer.close()

    # Ranks that differ in trainability: every rank at once, naming it.
    net = model(torch.bfloat16)
    optimizer = _optimizer(net)
    if rank == 1:
        net[0].weight.requires_grad_(False)
    _ones_grads(net)
    out["differing_trainability"] = _timed(optimizer.step)
    optimizer.close()

    # A rebuild that fails (an FP32 group on BF16 parameters): no later step runs as if it synced.
    net = model(torch.bfloat16)
    optimizer = _optimizer(net)
    out["bad_group"] = _timed(
        lambda: optimizer.add_param_group({"params": [torch.nn.Parameter(torch.ones(4))]}))[0]
    _ones_grads(net)
    out["step_after_bad_group"] = _timed(optimizer.step)[0]
    optimizer.close()
    return out


def _failing_stage(stage: str):
    """(the module whose `stage` ciera.zero calls, the error it fails with, what closes what it
    made) for conftest.stage_failing: the transport, the trainability check's group, the engine."""
    from ciera import _ext
    from ciera.fsdp import lifecycle

    return {"make_transport": (zero, RuntimeError("no route to the peers on this node"), None),
            "group_beside": (zero, RuntimeError("no route to the peers on this node"), lifecycle.release_group),
            "Engine": (_ext, MemoryError("no room for the codec state"), lifecycle.close_engine)}[stage]


def a_set_up_stage_fails_on_one_rank(rank, world, stage):
    """The constructor's transport, trainability check group or engine (`stage`) failing on the
    last rank alone just after it was made: what each rank raised, its seconds and what it held
    (conftest.stage_failing); then a second optimizer on the same model steps."""
    net = model(torch.bfloat16)
    owner, error, close = _failing_stage(stage)
    out = stage_failing(rank == world - 1, lambda: _optimizer(net), owner, stage, error, close)
    optimizer = _optimizer(net)
    _ones_grads(net)
    out["step"] = _timed(optimizer.step)[0]
    optimizer.close()
    return out


def a_rebuild_fails_on_one_rank(rank, world, rebuild):
    """The engine of a rebuild (`rebuild`: a step after a layer was frozen, or add_param_group)
    failing on the last rank alone: what each rank raised and its seconds, the engines left open,
    the next step's error, and what the process held before the optimizer and after close()."""
    from ciera.fsdp import lifecycle

    before = held_by_process()
    net = model(torch.bfloat16)
    optimizer = _optimizer(net)
    _ones_grads(net)
    optimizer.step()
    if rebuild == "step":
        net[0].weight.requires_grad_(False)
        _ones_grads(net)
        call = optimizer.step
    else:
        call = lambda: optimizer.add_param_group({"params": [torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))]})
    owner, error, close = _failing_stage("Engine")
    out = stage_failing(rank == world - 1, call, owner, "Engine", error, close)
    out["open_engines"] = len(lifecycle.open_engines())
    # What the optimizer says of its closed engines (an AttributeError on None, once).
    out["engines"], out["cache_bytes"] = len(optimizer.engines), _timed(lambda: optimizer.cache_bytes)[0]
    _ones_grads(net)
    out["next_step"] = _timed(optimizer.step)[0]
    optimizer.close()
    out.update(before=before, after=held_by_process())
    return out


def a_rebuild_check_fails_on_one_rank(rank, world, case):
    """A rebuild whose local work before its set-up fails on the last rank alone (`case`:
    "add_param_group", a group whose parameter is float64 there; "unfreeze", a frozen parameter
    whose .data that rank replaced by a float64 tensor, then unfrozen; "fill", making a flat bucket
    failing there, an out-of-memory): what each rank raised and its seconds, and the next step's
    error. The failing rank keeps its optimizer until its peers' call has ended, as one that
    reports its error first would: closed, its groups' connections would end their wait early."""
    import datetime

    from conftest import ranks_store

    failing = rank == world - 1
    net = model(torch.bfloat16)
    optimizer = _optimizer(net)
    _ones_grads(net)
    optimizer.step()
    original = zero._DeviceSync
    if case == "add_param_group":
        extra = torch.nn.Parameter(torch.ones(4, dtype=torch.float64 if failing else torch.bfloat16))
        call = lambda: optimizer.add_param_group({"params": [extra]})
    elif case == "unfreeze":
        net[0].bias.requires_grad_(False)
        _ones_grads(net)
        optimizer.step()
        if failing:   # not in a bucket while frozen: no check of the views sees it
            net[0].bias.data = net[0].bias.data.double()
        net[0].bias.requires_grad_(True)
        _ones_grads(net)
        call = optimizer.step
    else:
        net[0].weight.requires_grad_(False)
        _ones_grads(net)
        call = optimizer.step
        zero._DeviceSync = _failing_after(original, failing, MemoryError("no room for the flat bucket"))
    try:
        error, seconds = _timed(call)
    finally:
        zero._DeviceSync = original
    store = ranks_store()
    if failing:
        store.set_timeout(datetime.timedelta(seconds=120))
        for r in range(world - 1):
            store.get(f"rebuild_check_{case}_{r}")
    else:
        store.set(f"rebuild_check_{case}_{rank}", "done")
    _ones_grads(net)
    out = {"error": error, "seconds": seconds, "next_step": _timed(optimizer.step)[0]}
    optimizer.close()
    return out


def a_peer_that_leaves(rank, world):
    """Rank 1 ends (os._exit) after one step; rank 0's next step fails with a ciera.CommError
    (it was gloo's RuntimeError from the check before the step) within the timeout."""
    import os
    import time

    config = ciera.EngineConfig()
    config.timeout_s = 5
    config.warmup_steps = 0
    net = model(torch.bfloat16)
    optimizer = zero.ZeroRedundancyOptimizer(net.parameters(), torch.optim.SGD, lr=0.1, engine_config=config)
    _ones_grads(net)
    optimizer.step()
    if rank == 1:
        os._exit(0)
    time.sleep(0.5)
    start = time.perf_counter()
    try:
        optimizer.step()
        return None, time.perf_counter() - start
    except Exception as e:  # noqa: BLE001 - compared by the test
        return type(e).__name__, time.perf_counter() - start


def overlapping_steps(rank, world):
    """Rank 0 calls step() from a second thread while its first step waits in the sync for rank 1
    (which steps only once rank 0 has tried): the second is refused before its local step; the
    next steps work."""
    import threading

    from conftest import error_of, ranks_store, until

    net = model(torch.bfloat16)
    optimizer = zero.ZeroRedundancyOptimizer(net.parameters(), torch.optim.SGD, lr=0.1)
    _ones_grads(net)
    second, store = None, ranks_store()
    if rank == 0:
        first = threading.Thread(target=optimizer.step)
        first.start()
        until(optimizer._stepping.locked, "the first thread's step() began")
        try:
            optimizer.step()
        except Exception as e:  # noqa: BLE001 - compared by the test
            second = f"{type(e).__name__}: {e}"
        # Nor is close() under the first step: it would still rewrite the partition, then fail.
        closing = error_of(optimizer.close)
        second = (second, closing, optimizer.closed)
        store.set("overlapped", "1")   # rank 1 joins the first step only now
        first.join()
    else:
        store.wait(["overlapped"])
        optimizer.step()
    optimizer.step()
    bits = [p.detach().view(torch.int16).tolist() for p in net.parameters()]
    optimizer.close()
    return second, bits


def in_two_subgroups(rank, world):
    """Four ranks in two data-parallel groups ([0, 1] and [2, 3], each its own model), each with
    CIERA's ZeRO beside PyTorch's and a Broadcaster on its group: the groups CIERA makes beside
    each subgroup are its members' alone (until stop 67 both took one name: the second group's
    connections failed; and a name torch derived from the groups each process holds came back
    after close(), or differed between members). Returns per step whether CIERA's parameters equal
    PyTorch's, what the Broadcasters delivered, and how many process groups they left after close()
    (the second one: after it was collected unclosed; the third: at the end of a with block)."""
    from torch.distributed.distributed_c10d import _world

    from ciera.fsdp import lifecycle

    group, _ = dist.new_subgroups_by_enumeration([[0, 1], [2, 3]])
    # A group of ranks 0-2 only: rank 2 now holds one more group than rank 3 (torch's local names
    # count them, and differed between the two).
    dist.new_group([0, 1, 2])
    index = rank // 2
    config = ciera.EngineConfig()
    config.warmup_steps = 0
    config.timeout_s = 30
    plain_net, net = model(torch.bfloat16, seed=index), model(torch.bfloat16, seed=index)
    plain = TorchZero(plain_net.parameters(), torch.optim.SGD, process_group=group, parameters_as_bucket_view=True,
                      lr=0.1)
    ours = zero.ZeroRedundancyOptimizer(net.parameters(), torch.optim.SGD, process_group=group, lr=0.1,
                                        engine_config=config)
    equal = []
    for s in range(3):
        for n, optimizer in ((plain_net, plain), (net, ours)):
            g = torch.Generator().manual_seed(100 * s + index)   # the group's averaged gradients
            for p in n.parameters():
                p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        equal.append(same_bits(plain_net, net))
    ours.close()
    groups = len(_world.pg_map)
    received = []
    for round_ in range(3):   # each after the last one's group was destroyed: no name comes back
        x = torch.full((1000,), float(10 * index + round_) if dist.get_rank(group) == 0 else -1.0,
                       dtype=torch.bfloat16)
        if round_ == 2:   # closed at the end of a with block
            with Broadcaster([x], root=0, process_group=group, config=config) as bcast:
                bcast.broadcast()
            received.append(x.unique().tolist())
            continue
        bcast = Broadcaster([x], root=0, process_group=group, config=config)
        bcast.broadcast()
        received.append(x.unique().tolist())
        if round_ == 1:   # dropped, not closed: its engine is closed, then its group goes
            engine = weakref.ref(bcast.engine)
            engine_closed_first = []
            destroy = lifecycle.destroy_group
            lifecycle.destroy_group = lambda g: (engine_closed_first.append(engine().closed), destroy(g))
            try:
                del bcast
                gc.collect()
            finally:
                lifecycle.destroy_group = destroy
        else:
            bcast.close()
    return equal, received, len(_world.pg_map) - groups, engine_closed_first


def _partition(optimizer, params):
    """The rank that steps each of `params` (PyTorch's partition)."""
    return [next(r for r, groups in enumerate(optimizer._partition_parameters())
                 if any(q is p for g in groups for q in g["params"])) for p in params]


def parameters_out_of_their_buckets(rank, world, cases=("replaced", "shrunk", "negated")):
    """On one rank, a parameter that no longer holds its values where the optimizer's flat
    bucket has them (the engine reads and writes the bucket through its pointer): its .data
    replaced, the bucket's storage shrunk, a negated view of its memory. Each case: what each
    rank's step() raised and in how many seconds, and the digest of this rank's parameters' values
    (None where reading them would read past the shrunk storage)."""
    out = {}
    for case in cases:
        net = model(torch.bfloat16)
        optimizer = _optimizer(net)
        params = list(net.parameters())
        owners = _partition(optimizer, params)
        _ones_grads(net)
        if case == "replaced" and rank == 0:   # one of rank 0's own partition
            params[0].data = params[0].data.clone()
        if case == "shrunk" and rank == 0:
            # The bucket (14064 bytes) cut to 10000: rank 0's own partition (its first 9216 bytes)
            # still fits, so its local step (none here: no gradients) and its input are whole;
            # the sync wrote the peers' values past the end.
            params[0].untyped_storage().resize_(10000)
            for p in params:
                p.grad = None
        if case == "negated" and rank == 1:   # one of rank 1's own partition, the same memory negated
            mine = owners.index(1)
            params[mine].data = params[mine].data._neg_view()
            out["negated_index"] = mine
        error, seconds = _timed(optimizer.step)
        digest = None if case == "shrunk" else [p.detach().float().sum().item() for p in params]
        out[case] = (error, seconds, digest)
        optimizer.close()
    return out


def versions_after_a_sync(rank, world):
    """A backward that saved parameter 0 (rank 0's partition) before step() and runs after it:
    whether step() moved each parameter's version on this rank, and what the backward raised."""
    net = model(torch.bfloat16)
    optimizer = _optimizer(net)
    params = list(net.parameters())
    assert _partition(optimizer, params)[0] == 0
    x = torch.ones(params[0].shape[1], dtype=torch.bfloat16, requires_grad=True)
    saved = (params[0] @ x).float().sum()   # saves parameter 0 for x's gradient
    before = [p._version for p in params]
    _ones_grads(net)
    optimizer.step()
    moved = [p._version > v for p, v in zip(params, before)]
    error = _timed(saved.backward)[0]
    optimizer.close()
    return moved, error


def a_lone_rebuild(rank, world):
    """add_param_group on the last rank alone (a misuse: every rank must call it), its peers in
    their next step(): what each raised and in how many seconds, with the engine's timeout at 5 s.
    The peers stay until the last rank's call has ended, as processes that go on would: gone, their
    connections would end its wait early."""
    import datetime

    from conftest import ranks_store

    net = model(torch.bfloat16)
    config = ciera.EngineConfig()
    config.warmup_steps = 0
    config.timeout_s = 5
    optimizer = zero.ZeroRedundancyOptimizer(list(net.parameters()), torch.optim.SGD, engine_config=config, lr=0.1)
    _ones_grads(net)
    optimizer.step()
    alone = rank == world - 1
    _ones_grads(net)
    extra = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    error, seconds = _timed(lambda: optimizer.add_param_group({"params": [extra]}) if alone else optimizer.step())
    store = ranks_store()
    if alone:
        store.set("lone_rebuild_done", "yes")
    else:
        store.set_timeout(datetime.timedelta(seconds=120))
        store.get("lone_rebuild_done")
    optimizer.close()
    return {"error": error, "seconds": seconds}


def added_parameters(rank, world):
    """Parameter groups added after construction: one frozen, then unfrozen on every rank and
    stepped (each rank's values of it, which must agree); and one whose parameter's shape differs
    on the last rank ([3, 2] there, [2, 3] elsewhere: the same number of values), what each raised."""
    net = model(torch.bfloat16)
    optimizer = _optimizer(net)
    _ones_grads(net)
    optimizer.step()
    added = torch.nn.Parameter(torch.zeros(6, dtype=torch.bfloat16), requires_grad=False)
    optimizer.add_param_group({"params": [added]})
    _ones_grads(net)
    optimizer.step()
    added.requires_grad_(True)
    for _ in range(2):
        _ones_grads(net)
        added.grad = torch.ones_like(added)
        optimizer.step()
    values = [torch.zeros_like(added) for _ in range(world)]
    dist.all_gather(values, added.detach())
    unfrozen_alike = all(torch.equal(v.view(torch.int16), values[0].view(torch.int16)) for v in values)
    unfrozen_moved = not torch.equal(added.detach(), torch.zeros_like(added))
    optimizer.close()
    net = model(torch.bfloat16)
    optimizer = _optimizer(net)
    shape = (3, 2) if rank == world - 1 else (2, 3)
    other = torch.nn.Parameter(torch.ones(shape, dtype=torch.bfloat16))
    error, _ = _timed(lambda: optimizer.add_param_group({"params": [other]}))
    optimizer.close()
    return {"unfrozen_alike": unfrozen_alike, "unfrozen_moved": unfrozen_moved, "shape_error": error}
