"""FSDP2 through CIERA in one call (README, "PyTorch (FSDP2)"), on CPU ranks over gloo.

A small mixture-of-experts model is trained twice from the same seed on the same batches: once
with FSDP2's own all-gather, once with ``ciera.torch.enable(model)``. The two trainings must give
bitwise identical losses and parameters; rank 0 prints them and the bytes CIERA's gathers carried.

    torchrun --nproc-per-node 2 examples/fsdp2_train.py [--steps 40]

Exit status 1 on every rank if the two trainings differ in any bit.
"""

import argparse

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import ciera
import ciera.torch


class MoE(torch.nn.Module):
    """A residual block of `experts` feed-forward experts; each token goes to its top-1 expert,
    scaled by its gate."""

    def __init__(self, dim: int, experts: int, hidden: int):
        super().__init__()
        self.router = torch.nn.Linear(dim, experts, bias=False)
        self.w_in = torch.nn.Parameter(torch.randn(experts, dim, hidden) * dim ** -0.5)
        self.w_out = torch.nn.Parameter(torch.randn(experts, hidden, dim) * hidden ** -0.5)

    def forward(self, x):
        gates = self.router(x).softmax(-1)
        choice = gates.argmax(-1)
        out = torch.zeros_like(x)
        for e in range(self.w_in.shape[0]):
            tokens = (choice == e).nonzero(as_tuple=True)[0]
            if tokens.numel():
                y = torch.relu(x[tokens] @ self.w_in[e]) @ self.w_out[e]
                out = out.index_add(0, tokens, y * gates[tokens, e:e + 1])
        return x + out


def build(world: int) -> torch.nn.Module:
    torch.manual_seed(0)   # the same initial weights in both trainings
    model = torch.nn.Sequential(*[MoE(128, 8, 256) for _ in range(4)], torch.nn.Linear(128, 128))
    mesh = init_device_mesh("cpu", (world,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def train(model, rank: int, steps: int) -> list[int]:
    """Regression on a fixed random teacher; the losses' bits, step by step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    teacher = torch.Generator().manual_seed(1)
    target_map = torch.randn(128, 128, generator=teacher) * 128 ** -0.5
    losses = []
    for step in range(steps):
        batch = torch.Generator().manual_seed(1000 * step + rank)   # each rank's own batch
        x = torch.randn(256, 128, generator=batch)
        loss = torch.nn.functional.mse_loss(model(x).float(), x @ target_map)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(int(loss.detach().view(torch.int32)))
    return losses


def local_bits(model) -> list[torch.Tensor]:
    return [p.to_local().detach().clone().view(torch.uint8) for p in model.parameters()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup-gathers", type=int, default=30,
                        help="gathers of each layer that go raw before exponent reuse starts")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)

    plain = build(world)
    plain_losses, plain_params = train(plain, rank, args.steps), local_bits(plain)

    model = build(world)
    config = ciera.EngineConfig()
    config.warmup_steps = args.warmup_gathers
    handle = ciera.torch.enable(model, config)   # collective: every rank, once FSDP2 is applied
    losses = train(model, rank, args.steps)
    records = handle.take_records()
    handle.disable()

    params = local_bits(model)
    same = torch.tensor([int(losses == plain_losses and len(params) == len(plain_params) > 0 and
                             all(torch.equal(a, b) for a, b in zip(params, plain_params)))])
    dist.all_reduce(same, op=dist.ReduceOp.MIN)   # identical on every rank, or a failure on every rank
    raw, wire = sum(r.raw_bytes for r in records), sum(r.wire_bytes for r in records)
    if rank == 0:
        verdict = "bitwise identical" if same.item() else "NOT IDENTICAL"
        print(f"{world} ranks, {args.steps} steps: losses and parameters {verdict} to plain FSDP2; "
              f"CIERA's gathers carried {wire} of {raw} bytes ({raw / max(1, wire):.2f}x fewer, "
              f"{sum(r.compressed for r in records)} of {len(records)} gathers compressed)")
    dist.destroy_process_group()
    return 0 if same.item() else 1


if __name__ == "__main__":
    raise SystemExit(main())
