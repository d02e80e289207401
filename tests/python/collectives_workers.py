"""Rank bodies for test_collectives.py (module-level so that spawned processes can import them)."""

import torch
import torch.distributed as dist

import ciera
from ciera import _ext, data, fsdp

from fsdp_workers import build, local_bits, tiny_spec


def fsdp_reduce_scatter(rank, world, coding, reduce_dtype, steps=4):
    """The same FSDP2 training three times: CIERA's reduce-scatter with `coding`, its raw twin and
    FSDP2's own. Returns the comparisons and what the coded reduce-scatters sent."""
    corpus = data.load_corpus(1 << 20)
    spec = tiny_spec("olmoe")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[reduce_dtype]
    out = {}
    for name in ("fsdp2", "raw", coding):
        model = build(spec, world, reduce_dtype=dtype)
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
                     "calls": len(records)}
    ours, twin, own = out[coding], out["raw"], out["fsdp2"]
    return {
        "losses_equal": ours["losses"] == twin["losses"],
        "params_equal": all(torch.equal(a, b) for a, b in zip(ours["params"], twin["params"])),
        "max_loss_diff_vs_fsdp2": max(abs(a - b) for a, b in zip(ours["losses"], own["losses"])),
        "raw": ours["raw"], "wire": ours["wire"], "calls": ours["calls"], "twin_wire": twin["wire"],
        "twin_raw": twin["raw"],
    }


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
            "reduce_scatter_equal": torch.equal(mine.view(torch.int32), reference.view(torch.int32)),
            "coded": stats.coded_slices + rs.coded_slices, "wire": stats.wire_bytes + rs.wire_bytes,
            "raw": stats.raw_bytes + rs.raw_bytes}
