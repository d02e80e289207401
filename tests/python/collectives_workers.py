"""Rank bodies for test_collectives.py (module-level so that spawned processes can import them)."""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import ciera
from ciera import _ext, data, fsdp, models
from ciera.fsdp.layout import DefaultReduceScatter, describe_buckets, reduce_scatter_comm

from fsdp_workers import build, local_bits, same_bits, tiny_spec, train


def _build(spec, world, reduce_dtype, layout):
    """The tiny model under FSDP2: "flat" (one shard group) or "hsdp" (replicated over nodes of 2
    ranks, sharded inside each: FSDP2 reduce-scatters inside a node, then all-reduces across)."""
    if layout == "flat":
        return build(spec, world, reduce_dtype=reduce_dtype)
    model = models.build(spec, 0)
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("replicate", "shard"))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
    for layer in models.decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def fsdp_reduce_scatter(rank, world, coding, reduce_dtype, layout="flat", steps=4):
    """The same FSDP2 training three times: CIERA's reduce-scatter with `coding`, its raw twin and
    FSDP2's own. Returns the comparisons and what the coded reduce-scatters sent."""
    corpus = data.load_corpus(1 << 20)
    spec = tiny_spec("olmoe")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[reduce_dtype]
    out = {}
    for name in ("fsdp2", "raw", coding):
        model = _build(spec, world, dtype, layout)
        handle = None if name == "fsdp2" else fsdp.enable_reduce_scatter(model, name)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        losses = []
        for step in range(steps):
            tokens = data.batch(corpus, step, rank, 2, 24)
            loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.detach().float().item())
        records = handle.records if handle else []
        out[name] = {"losses": losses, "params": local_bits(model),
                     "raw": sum(r.raw_bytes for r in records), "wire": sum(r.wire_bytes for r in records),
                     "calls": len(records), "group": list(handle.ranks) if handle else None}
    ours, twin, own = out[coding], out["raw"], out["fsdp2"]
    return {
        "losses_equal": ours["losses"] == twin["losses"],
        "params_equal": same_bits(ours["params"], twin["params"]),
        "max_loss_diff_vs_fsdp2": max(abs(a - b) for a, b in zip(ours["losses"], own["losses"])),
        "raw": ours["raw"], "wire": ours["wire"], "calls": ours["calls"], "twin_wire": twin["wire"],
        "twin_raw": twin["raw"], "group": ours["group"],
    }


def disable_reduce_scatter(rank, world):
    """enable_reduce_scatter() twice without disable() is refused; disable() restores FSDP2's own
    reduce-scatter: a model enabled then disabled trains bit for bit as one never enabled, and a
    disabled handle records no more calls; the model can be enabled again."""
    corpus = data.load_corpus(1 << 20)
    spec = tiny_spec("olmoe")
    plain = build(spec, world)
    plain_losses = train(plain, rank, 2, corpus)

    restored = build(spec, world)
    fsdp.enable_reduce_scatter(restored, "exponent").disable()
    restored_losses = train(restored, rank, 2, corpus)

    model = build(spec, world)
    handle = fsdp.enable_reduce_scatter(model, "exponent")
    train(model, rank, 1, corpus)
    calls = len(handle.records)
    try:
        fsdp.enable_reduce_scatter(model, "raw")
        refused = None
    except ValueError as e:
        refused = str(e)
    handle.disable()
    handle.disable()   # a second call does nothing
    comms = {type(reduce_scatter_comm(m)).__name__ for m, _ in describe_buckets(model)}
    train(model, rank, 1, corpus)
    again = fsdp.enable_reduce_scatter(model, "exponent")
    train(model, rank, 1, corpus)

    # A model sharded on a 1-D slice of a larger mesh (here each rank alone): its mesh shows only
    # this rank's row, not the world's groups; refused at enable, on every rank.
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
    sliced = models.build(spec, 0)
    fully_shard(sliced, mesh=mesh["shard"])
    try:
        fsdp.enable_reduce_scatter(sliced, "exponent")
        sliced_refused = None
    except ciera.ConfigError as e:
        sliced_refused = str(e)
    return {"restored_equal": restored_losses == plain_losses
            and same_bits(local_bits(restored), local_bits(plain)),
            "calls": calls, "calls_after_disable": len(handle.records), "refused": refused,
            "comms": sorted(comms), "default": DefaultReduceScatter.__name__, "enabled": handle.enabled,
            "calls_again": len(again.records), "sliced_refused": sliced_refused}


def _gapped_alltoallv_lands(rank, world, x, expected, send, recv) -> bool:
    """The torch transport's alltoallv with each side's parts in reverse rank order and 3 bytes
    apart (the transport contract allows any displacements): every part lands where its
    displacement says, and no byte between them is written."""
    def laid_out(counts):
        displs, at = [0] * world, 3
        for p in reversed(range(world)):
            displs[p], at = at, at + counts[p] + 3
        return displs, at

    def placed(flat, counts, displs, extent, fill):
        """The consecutive parts of `flat` at `displs`, in `extent` bytes of `fill`."""
        buffer, at = torch.full((extent,), fill, dtype=torch.uint8), 0
        for p in range(world):
            buffer[displs[p]:displs[p] + counts[p]] = flat[at:at + counts[p]]
            at += counts[p]
        return buffer

    send_bytes, recv_bytes = [2 * c for c in send], [2 * c for c in recv]   # BF16 values
    send_displs, send_extent = laid_out(send_bytes)
    recv_displs, recv_extent = laid_out(recv_bytes)
    inp = placed(x, send_bytes, send_displs, send_extent, 0xAB)
    out = torch.full((recv_extent,), 0xCD, dtype=torch.uint8)
    fsdp.transport.TorchTransport(None).alltoallv(memoryview(inp.numpy()), memoryview(out.numpy()), send_bytes,
                                                  send_displs, recv_bytes, recv_displs)
    want = placed(expected, recv_bytes, recv_displs, recv_extent, 0xCD)
    return torch.equal(out, want)


def torch_alltoallv(rank, world):
    """LosslessCollectives over the torch transport (gloo): an alltoallv with uneven counts and a
    reduce-scatter, checked against torch's own collectives."""
    transport = fsdp.transport.make_transport("torch", None, 60.0)
    collectives = _ext.LosslessCollectives(transport)
    g = torch.Generator().manual_seed(rank)
    send = [(rank + 1) * 1000 + 7 * p for p in range(world)]
    recv = [(p + 1) * 1000 + 7 * rank for p in range(world)]
    x = (torch.randn(sum(send), generator=g) * 0.01).to(torch.bfloat16)
    y = torch.empty(sum(recv), dtype=torch.bfloat16)
    stats = collectives.alltoallv(_ext.DType.bf16, x, send, y, recv)
    expected = torch.empty_like(y)
    dist.all_to_all_single(expected, x, output_split_sizes=recv, input_split_sizes=send)
    grads = torch.randn(world * 4099, generator=g) * 1e-3
    mine = torch.empty(4099)
    rs = collectives.reduce_scatter(_ext.DType.fp32, _ext.ReduceOp.sum, grads, mine)
    everyone = [torch.empty_like(grads) for _ in range(world)]
    dist.all_gather(everyone, grads)
    reference = everyone[0][rank * 4099:(rank + 1) * 4099].clone()
    for p in range(1, world):
        reference += everyone[p][rank * 4099:(rank + 1) * 4099]   # rank order, FP32
    return {"alltoallv_equal": torch.equal(y.view(torch.int16), expected.view(torch.int16)),
            "gapped_equal": _gapped_alltoallv_lands(rank, world, x.view(torch.uint8), expected.view(torch.uint8),
                                                    send, recv),
            "reduce_scatter_equal": torch.equal(mine.view(torch.int32), reference.view(torch.int32)),
            "coded": stats.coded_slices + rs.coded_slices, "wire": stats.wire_bytes + rs.wire_bytes,
            "raw": stats.raw_bytes + rs.raw_bytes}


def groups_released_at_exit(rank, world):
    """What the exit handler does (lifecycle._release_groups), called here while the test can look:
    CIERA's own gloo group is destroyed and freed (no strong reference left anywhere, so its worker
    threads are joined while the interpreter is whole), and a call after it raises CommError
    instead of running on another group."""
    import gc
    import weakref

    from ciera.fsdp import lifecycle

    spec = tiny_spec("olmoe")
    model = build(spec, world)
    handle = fsdp.enable_reduce_scatter(model, "exponent")
    tokens = data.batch(data.load_corpus(1 << 16), 0, rank, 2, 24)
    model(input_ids=tokens, labels=tokens).loss.backward()
    calls = len(handle.records)
    own = weakref.ref(lifecycle._own_groups[-1])
    lifecycle._release_groups()
    gc.collect()
    after = None
    try:
        model(input_ids=tokens, labels=tokens).loss.backward()
    except Exception as e:  # noqa: BLE001 - the test reads the type and the words
        after = f"{type(e).__name__}: {e}"
    return {"calls": calls, "freed": own() is None, "after": after}


def enable_reduce_scatter_refusals(rank, world):
    """Arguments that are wrong on one rank only: every rank raises at once, naming that rank,
    before any transport is made (no rank waits for the other until a timeout). Returns each
    case's error text and how long it took."""
    import time

    spec = tiny_spec("olmoe")
    model = build(spec, world)
    cases = {
        "niceness": lambda: fsdp.enable_reduce_scatter(model, worker_niceness=25 if rank == 1 else None),
        "timeout": lambda: fsdp.enable_reduce_scatter(model, timeout_s=-1 if rank == 1 else 30.0),
        "niceness_type": lambda: fsdp.enable_reduce_scatter(model, worker_niceness="x" if rank == 1 else None),
        "model": lambda: fsdp.enable_reduce_scatter(None if rank == 0 else model),
        "group": lambda: fsdp.enable_reduce_scatter(model, process_group="world" if rank == 0 else None),
    }
    out = {}
    for name, call in cases.items():
        start = time.monotonic()
        try:
            call().disable()
            out[name] = (None, time.monotonic() - start)
        except Exception as e:  # noqa: BLE001 - the test reads the type and the words
            out[name] = (f"{type(e).__name__}: {e}", time.monotonic() - start)
    return out
