"""One rank of ``ciera train`` (started by the launcher under mpirun or torchrun): builds the
baseline and the CIERA model(s) from the same seed, trains them side by side one step at a time,
and writes the per-step metrics (rank 0) and, at the end, the summary."""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

import ciera
from ciera import fsdp
from ciera.fsdp import lifecycle
from ciera.train import checkpoint, schemes
from ciera.train.watch import RankStatus, error_text
from ciera.train.metrics import BASELINE, CONTROL, PLAIN, Run, StepMetrics, resident_bytes, sent_bytes
from ciera.train.options import budget_bytes, scheme_names


def placement(launcher: str) -> tuple[int, int, int, int]:
    """(rank, world size, rank on this host, ranks on this host), as the launcher passes them."""
    env = os.environ
    if launcher == "torchrun":
        return (int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["LOCAL_RANK"]),
                int(env["LOCAL_WORLD_SIZE"]))
    world = int(env.get("OMPI_COMM_WORLD_SIZE", "1"))
    return (int(env.get("OMPI_COMM_WORLD_RANK", "0")), world, int(env.get("OMPI_COMM_WORLD_LOCAL_RANK", "0")),
            int(env.get("OMPI_COMM_WORLD_LOCAL_SIZE", world)))


def core_share(cores: list[int], local_rank: int, local_ranks: int) -> list[int]:
    """Rank `local_rank`'s cores among `local_ranks` ranks on `cores`: disjoint shares, at most
    a core apart in size, where there are enough; else core local_rank mod len(cores), so that
    ranks share cores as evenly as whole ranks allow."""
    if len(cores) < local_ranks:
        return [cores[local_rank % len(cores)]]
    return cores[local_rank * len(cores) // local_ranks:(local_rank + 1) * len(cores) // local_ranks]


def pin_to_cores(local_rank: int, local_ranks: int) -> list[int]:
    """Confines every thread of this process to its core_share() of the cores it may run on now.
    With ranks free to move, the scheduler keeps migrating them between the cores, and on a host
    with fewer cores than ranks, where they stand in for nodes, one rank then falls behind the
    others for a while: the others wait for it at the next collective (docs/benchmarks.md,
    "Ranks pinned to cores"). Threads started later inherit the share."""
    share = core_share(sorted(os.sched_getaffinity(0)), local_rank, local_ranks)
    for task in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(task), share)
        except (ProcessLookupError, FileNotFoundError):   # a thread that ended meanwhile
            pass
        except OSError as e:
            raise RuntimeError(f"--pin-cores: could not confine this rank to cores {share}: {e} "
                               "(--no-pin-cores leaves the ranks where the launcher put them)") from e
    return share


def nccl_shares_gpus() -> bool:
    """Whether NCCL lets several ranks use one GPU here: NCCL 2.30 or later, asked to with
    NCCL_MULTI_RANK_GPU_ENABLE=1 (earlier ones refuse: "Duplicate GPU detected")."""
    if os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE") != "1":
        return False
    version = torch.cuda.nccl.version()
    return isinstance(version, tuple) and version >= (2, 30, 0)


class RankProgram:
    def __init__(self, args):
        self.args = args
        self.rank, self.world, self.local_rank, self.local_ranks = placement(args.launcher)
        self.device = torch.device("cpu")   # --device cuda: this rank's GPU, chosen in run()
        self.backend = "gloo"               # the process group's backend(s)
        self.run_dir = Path(args.run_dir)
        self.tracer = None
        self.stats = None
        self.trackers: dict = {}
        self.grad_bytes: dict[int, int] = {}
        self.first_step = 0   # steps done before this run (--resume)
        self.memory: list[dict] = []   # resident memory samples (rank 0)
        self.checkpoints: list[str] = []
        self.checkpoint_group = None   # --checkpoint-every / --resume: the checkpoints' gloo group
        self.captured: dict[int, list] = {}   # --capture-activations: MoE block inputs per layer
        self.cores: list[int] = []            # the cores this rank may run on (--pin-cores: its share)
        self.rank_cores: list[list[int]] = []  # every rank's, after init_process_group

    def run(self) -> int:
        torch.set_num_threads(1)
        self.status = RankStatus(self.run_dir, self.rank)
        try:
            self.cores = (pin_to_cores(self.local_rank, self.local_ranks) if self.args.pin_cores
                          else sorted(os.sched_getaffinity(0)))
            self.init_process_group()
            self.train_all()
        except BaseException as e:
            # This rank ends the job now: a peer may be dead or stopped, and anything that waits
            # for it (destroy_process_group, MPI_Finalize) would wait forever. The launcher
            # tells the user which rank failed from the status files (ciera.train.watch).
            self.status.failed(e)
            traceback.print_exc()
            lifecycle.abort(1)
        self.status.update("done")
        dist.destroy_process_group()
        return 0

    def init_process_group(self) -> None:
        """torch.distributed through torchrun's store (env://), or under mpirun and in the link
        lab a file store in the run folder: the ranks share this host's filesystem (the lab's
        namespaces too), and no port has to be picked ahead (a port the launcher found free and
        closed could be taken by another process before rank 0 bound it)."""
        timeout = _dt.timedelta(seconds=self.args.timeout)
        if self.args.launcher == "torchrun":
            rendezvous = {"init_method": "env://"}
        else:
            if "CIERA_LINKLAB_PREFIX" in os.environ:
                os.environ["GLOO_SOCKET_IFNAME"] = "eth0"
            # The store itself, not a file:// URL: any folder name works ('#', '?', spaces).
            store = dist.FileStore(str((self.run_dir / "rendezvous").resolve()), self.world)
            store.set_timeout(timeout)
            rendezvous = {"store": store}
        if self.args.device == "cuda":
            self.use_gpu()
        try:
            dist.init_process_group(self.backend, rank=self.rank, world_size=self.world, timeout=timeout,
                                    **rendezvous)
        except RuntimeError as e:  # the store's own words are terse ("Wait timeout")
            raise RuntimeError(f"torch.distributed's set-up (every rank joining, {self.args.timeout:g} s "
                               f"allowed) failed: {error_text(e).removeprefix('RuntimeError: ')}") from e
        self.rank_cores = [None] * self.world   # the summary's rank_cores: where each rank runs
        dist.all_gather_object(self.rank_cores, self.cores)
        if self.args.checkpoint_every or self.args.resume:
            # A checkpoint writes and fsyncs every rank's files between its collectives, and a
            # busy disk can hold one rank there far longer than any step takes (a CI run saw
            # the ranks give up after the default 60 s). So its collectives wait on a gloo group
            # of their own with --checkpoint-timeout; the training's keep --timeout.
            self.checkpoint_group = dist.new_group(
                backend="gloo", timeout=_dt.timedelta(seconds=self.args.checkpoint_timeout))

    def use_gpu(self) -> None:
        """--device cuda: this rank's GPU (ranks may share one), deterministic algorithms in every
        training (their results are compared bit for bit), and the process group's backends: gloo
        for the CPU tensors (metrics, checks), NCCL for GPU tensors, or gloo for them too when ranks
        share a GPU, which NCCL refuses. CUBLAS_WORKSPACE_CONFIG comes from the launcher."""
        gpus = torch.cuda.device_count()
        torch.cuda.set_device(self.local_rank % gpus)
        self.device = torch.device("cuda", torch.cuda.current_device())
        # warn_only: an op without a deterministic CUDA kernel warns instead of ending the run;
        # whether the training really is deterministic is what the control run shows, bit for bit.
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True
        self.backend = "cpu:gloo,cuda:nccl" if self.local_ranks <= gpus or nccl_shares_gpus() else "cpu:gloo,cuda:gloo"

    def clock(self) -> float:
        """time.perf_counter() once the work queued on this rank's GPU has finished (--device cuda):
        kernels run asynchronously, and a step's times must include them."""
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    def on_host(self, stats):
        """The TrainingStats observer as CIERA's gathers call it, with GPU outputs copied to host
        memory first: its counters read their input in C++. It counts a bucket's first gather of a
        step only (`seen`), so only that one is copied. (ExponentTracker copies by itself.)"""
        if self.device.type != "cuda":
            return stats

        def observe(bucket, output):
            if output.is_cuda and bucket.index not in stats.seen:
                output = output.cpu()
            stats(bucket, output)

        return observe

    def emit(self, record: dict) -> None:
        if self.rank == 0:
            with open(self.run_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")

    def build(self, reduce_dtype=torch.float32):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        from ciera import models

        a = self.args
        spec = models.ModelSpec(family=a.model, hidden=a.hidden, layers=a.layers, experts=a.experts,
                                expert_intermediate=a.expert_intermediate, max_positions=max(1024, a.seq_len))
        # Built on the CPU from the seed whatever the device, so every training starts from the same bits.
        model = models.build(spec, a.seed).to(self.device)
        if a.hsdp:   # replicated across nodes, sharded inside each
            mesh = init_device_mesh(self.device.type, (a.nodes, a.ranks_per_node),
                                    mesh_dim_names=("replicate", "shard"))
        else:
            mesh = init_device_mesh(self.device.type, (self.world,))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
        reshard = a.reshard_after_forward if a.reshard_after_forward is not None else True
        for layer in models.decoder_layers(model):
            fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        return model, spec

    def inter_node_bytes(self, records) -> int:
        """Bytes this rank's gathers sent across node boundaries: its payload once per receiver on
        another node (--nodes; without it every rank is a node). Summed over ranks, what a gather
        moves between nodes when each payload goes straight to each receiver."""
        per_node = self.args.ranks_per_node or 1
        mine = self.rank // per_node
        return sum(r.payload_bytes * sum(1 for k in r.ranks if k // per_node != mine) for r in records)

    def variants(self) -> list[tuple[str, float | None, bool]]:
        """(name, cache budget in MiB or None for every shard, overlap) of each CIERA training:
        with --schemes one per scheme, named by it."""
        a = self.args
        if a.schemes:
            return [(name, None, a.overlap) for name in scheme_names(a)]
        if not a.ablation:
            return [("ciera", a.budget_mb, a.overlap)]
        budget = a.budget_mb if a.budget_mb is not None else float("inf")  # BSC by gain alone
        # The paper's Table 3, cumulative: exponent reuse on every shard, + selection, + pipelining.
        # Each training selects for itself: "bsc" without overlap counts the encode time in each
        # shard's gain, "ciera" with overlap does not (the paper's formula assumes pipelining), so
        # "ciera" may select more shards than "bsc", and its row then adds selection as well as
        # overlap.
        return [("er", None, False), ("bsc", budget, False), ("ciera", budget, True)]

    def add_plain(self, runs: dict, name: str) -> None:
        """Plain FSDP2, its gathers and reduce-scatters timed: the baseline, or its control (the
        same training again, which must match it bit for bit). Exponent statistics are collected in
        every training alike (same cost for all); they are identical anyway, since the parameters are."""
        a = self.args
        plain, _ = self.build()
        self.trackers[name] = fsdp.ExponentTracker()
        records = fsdp.time_plain_all_gathers(plain, self.trackers[name], overlap=a.overlap and not a.ablation)

        def take_plain_records():
            taken = list(records)
            records.clear()
            return taken

        runs[name] = Run(name, plain, a.lr, take_plain_records)
        runs[name].rs_records = fsdp.time_reduce_scatters(plain, all_reduces=runs[name].ar_records)
        if a.trace and name == BASELINE:
            from ciera import trace

            shard_ranks = a.ranks_per_node if a.hsdp else self.world
            self.tracer = trace.Tracer(len(fsdp.describe_buckets(plain)), shard_ranks)

    def scheme_of(self, name: str) -> str:
        """The gather scheme of the training `name` (--schemes names them by it; else --codec's)."""
        return name if self.args.schemes else self.args.codec

    def add_ciera(self, runs: dict, handles: dict, name: str, budget_mb: float | None, overlap: bool):
        """One training through CIERA's engine (or, for zipnn, ZipNN's Python gather); returns its
        model and spec."""
        a = self.args
        model, spec = self.build()
        scheme = self.scheme_of(name)
        if scheme == "zipnn":
            handle = fsdp.enable_zipnn(model, verify=a.verify)
            return self.add_handle(runs, handles, name, model, handle, None), spec
        config = ciera.EngineConfig()
        config.codec.block_values = a.block
        config.warmup_steps = 0  # warmup is driven per training step below
        config.adaptive = scheme == "auto"
        config.worker_threads = a.threads
        config.timeout_s = a.timeout
        if budget_mb is not None:
            # The selector counts steps itself and selects at the start of step `warmup`.
            # With --codec delta the selector chooses among raw, exponent reuse and delta.
            # forward_prefetch as the plain FSDP2 run gets it (time_plain_all_gathers): the model
            # runs every module in order, every forward.
            handle = fsdp.enable(model, config, transport=a.transport, verify=a.verify, overlap=overlap,
                                 forward_prefetch=overlap,
                                 cache_budget_bytes=budget_bytes(budget_mb), select_after_steps=a.warmup,
                                 reselect_every=a.reselect_every, allow_delta=scheme == "delta")
        else:
            # Exponent reuse starts after warmup (train_step); value-delta streams and the peer
            # schemes need no warmup (their first frame carries the values), so they start at once.
            # A lossy scheme's gathers never match torch's: --verify checks the lossless ones.
            first = schemes.first_policy(scheme)
            handle = fsdp.enable(model, config, transport=a.transport, verify=a.verify and not schemes.is_lossy(scheme),
                                 overlap=overlap, forward_prefetch=overlap, policy=lambda bucket, param: first)
        return self.add_handle(runs, handles, name, model, handle, budget_mb), spec

    def add_handle(self, runs: dict, handles: dict, name: str, model, handle, budget_mb: float | None):
        """Registers a training whose gathers go through `handle`; returns its model."""
        a = self.args
        # The main run's tracker counts per parameter: a trace takes its change rates from it.
        self.trackers[name] = (fsdp.ExponentTracker(handle.buckets, a.block) if name == "ciera"
                               else fsdp.ExponentTracker())
        handle.set_gather_observer(self.trackers[name])
        if a.stats and name == "ciera":
            from ciera.train.characterisation import TrainingStats

            self.stats = TrainingStats(handle.buckets, self.world, self.rank, a.warmup)
            handle.set_output_observer(self.on_host(self.stats))
        runs[name] = Run(name, model, a.lr, handle.take_records)
        runs[name].budget_mb = budget_mb
        runs[name].rs_records = fsdp.time_reduce_scatters(model)
        handles[name] = handle
        return model

    def train_all(self) -> None:
        """Trains the baseline and the CIERA model(s) side by side, one step of each in turn: all
        start from the same seed and see the same data, and interleaving keeps the machine's state
        (memory warm-up, other load) the same for all, so their times are comparable. (Run one
        after the other, the first training in a process is about twice as slow.)"""
        from ciera import data
        from ciera.train.summary import finish

        a = self.args
        if a.zero:
            from ciera.train.zero import train_zero

            return train_zero(self)
        if a.reduce_scatter != "fsdp2":   # FSDP2's or, with --framework deepspeed, ZeRO-3's
            from ciera.train.reduce_scatter import train_reduce_scatter

            return train_reduce_scatter(self)
        if a.framework == "deepspeed":
            from ciera.train.deepspeed import train_deepspeed

            return train_deepspeed(self)
        corpus = data.load_corpus()
        runs, handles = {}, {}
        if not a.no_baseline:
            self.add_plain(runs, BASELINE)
            if a.control:
                self.add_plain(runs, CONTROL)
        for name, budget_mb, overlap in self.variants():
            model, spec = self.add_ciera(runs, handles, name, budget_mb, overlap)
        # Checkpoints hold each training once: the control is the baseline again.
        kept = {name: run for name, run in runs.items() if name != CONTROL}
        if a.resume:
            self.first_step = checkpoint.load(self, kept, handles, Path(a.resume))
            if CONTROL in runs:
                self.load_control(runs[CONTROL], Path(a.resume))
        for step in range(self.first_step, a.steps):
            tokens = data.batch(corpus, step, self.rank, a.batch, a.seq_len, a.seed).to(self.device)
            self.train_step(runs, handles, step, tokens)
            done = step + 1
            if done == self.first_step + 1 or done % a.rss_every == 0 or done == a.steps:
                self.sample_memory(done, handles)
            if a.checkpoint_every and done % a.checkpoint_every == 0:
                self.checkpoints.append(str(checkpoint.save(self, kept, handles, done)))
        self.status.between_steps("final comparison", a.steps)
        for run in runs.values():
            run.final = self.local_params(run.model)
            run.digest = self.param_digest(run.model)
        self.write_captured()
        finish(self, runs, handles, spec, sum(p.numel() for p in model.parameters()))
        for handle in handles.values():
            handle.disable()

    def load_control(self, control: Run, folder: Path) -> None:
        """The control resumes from the baseline's state in the checkpoint (models and optimizers
        as built, as checkpoint.load does). Collective."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model, optimizer = get_state_dict(control.model, control.optimizer)
        dcp.load({BASELINE: {"model": model, "optimizer": optimizer}}, checkpoint_id=str(folder),
                 process_group=self.checkpoint_group)
        set_state_dict(control.model, control.optimizer, model_state_dict=model, optim_state_dict=optimizer)

    def train_step(self, runs: dict, handles: dict, step: int, tokens) -> None:
        """Step `step` of every training, in an order that rotates from step to step."""
        a = self.args
        if step == max(a.warmup, self.first_step):
            # Warmup over (or a run resumed after it starts): without a selector every parameter
            # of an exponent-reuse training now goes through it (all ranks at once).
            for name, handle in handles.items():
                if handle.selector is None and schemes.switches_after_warmup(self.scheme_of(name)):
                    schemes.end_warmup(handle)
        # Whichever model steps first after the previous pair is measurably slower on an
        # oversubscribed machine (caches and schedulers settle); rotating the order every
        # step gives every run the same share of that cost.
        order = list(runs.values())
        shift = step % len(order)
        order = order[shift:] + order[:shift]
        if step == a.warmup and "ciera" in self.trackers:
            self.trackers["ciera"].clear_counts()  # per-parameter rates of the steady state only
        if self.stats is not None:
            self.stats.new_step()
        if a.save_checkpoints:
            self.save_checkpoint(runs["ciera"].model, step)
        for run in order:
            self.status.update("training", run.name, step)
            self.trackers[run.name].new_step()
            self.emit(self.step(run, step, tokens, self.trackers[run.name]))
            if run.name in handles:
                run.peak_cache_bytes = max(run.peak_cache_bytes, handles[run.name].cache_bytes)

    def step(self, run: Run, step: int, tokens, tracker) -> dict:
        """One optimizer step of `run`; returns its line of metrics.jsonl."""
        self.status.phase("forward pass")
        capture = self.capture_hooks(run, step)
        start = self.clock()
        loss = run.model(input_ids=tokens, labels=tokens).loss
        for hook in capture:
            hook.remove()
        loss_done = self.clock()
        self.status.phase("backward pass")
        loss.backward()
        backward_done = self.clock()
        self.status.phase("optimizer step")
        run.optimizer.step()
        run.optimizer.zero_grad(set_to_none=True)
        end = self.clock()
        records = run.take_records()
        rs_records, ar_records = list(run.rs_records), list(run.ar_records)
        run.rs_records.clear()
        run.ar_records.clear()
        for r in rs_records:
            self.grad_bytes[r.bucket] = r.input_bytes
        if step >= self.args.warmup:
            for r in records:   # what the transport carried, as sent_bytes counts it for train's report
                run.bucket_wire.setdefault((r.group, r.bucket), []).append(r.wire_bytes + r.control_bytes)
            if self.tracer is not None and run.name == BASELINE:
                from ciera import trace

                self.tracer.add(trace.StepEvents(start, loss_done, backward_done, end, records, rs_records, ar_records))
        local = loss.detach().float()
        mine = StepMetrics(
            loss=float(local), iteration_s=end - start,
            allgather_s=sum(r.seconds if r.exposed_s < 0 else r.exposed_s for r in records),
            reduce_scatter_s=sum(r.seconds for r in rs_records),
            raw_bytes=sum(r.raw_bytes for r in records), wire_bytes=sent_bytes(records),
            changed_values=tracker.changed, compared_values=tracker.total,
            encode_s=sum(r.encode_s for r in records), gather_duration_s=sum(r.seconds for r in records),
            inter_node_bytes=self.inter_node_bytes(records), control_bytes=sum(r.control_bytes for r in records))
        # Two small all-reduces per step: the mean loss, and each time's slowest rank.
        self.status.phase("metrics all-reduce")
        summed = mine.all_reduce(dist.ReduceOp.SUM)
        peak = mine.all_reduce(dist.ReduceOp.MAX)
        run.record(int(local.view(torch.int32).item()), summed, peak, mine, self.world)
        record = {"run": run.name, "step": step, "loss": run.results["loss"][-1], "iteration_ms": 1e3 * peak.iteration_s,
                  "allgather_ms": 1e3 * peak.allgather_s, "reduce_scatter_ms": 1e3 * peak.reduce_scatter_s,
                  # mean over ranks; control_bytes: the engine's records, of wire_bytes
                  "raw_bytes": run.results["raw"][-1], "wire_bytes": run.results["wire"][-1],
                  "control_bytes": run.results["control"][-1]}
        if summed.compared_values > 0:
            record["exponent_change_rate"] = summed.changed_values / summed.compared_values
        if run.name not in PLAIN:
            record["ratio"] = summed.raw_bytes / max(1.0, summed.wire_bytes)
            record["bits_per_value"] = 16.0 * summed.wire_bytes / max(1.0, summed.raw_bytes)
        return record

    def capture_hooks(self, run: Run, step: int) -> list:
        """--capture-activations: on rank 0, in the plain FSDP2 training's last 16 steps, hooks that
        keep the input of every MoE block (its tokens' hidden states, BF16)."""
        a = self.args
        if not a.capture_activations or self.rank != 0 or run.name != BASELINE or step < a.steps - 16:
            return []
        from ciera import models

        def keep(index):
            def hook(module, args):
                hidden = args[0].detach()
                self.captured.setdefault(index, []).append(hidden.reshape(-1, hidden.shape[-1]).to(torch.bfloat16).cpu())
            return hook

        return [block.register_forward_pre_hook(keep(i)) for i, block in enumerate(models.moe_blocks(run.model))]

    def write_captured(self) -> None:
        if not self.captured:
            return
        from safetensors.torch import save_file

        save_file({f"layer{i}": torch.cat(rows) for i, rows in sorted(self.captured.items())},
                  self.args.capture_activations, metadata={"what": "inputs of the MoE blocks, rank 0",
                                                           "model": self.args.model})

    def local_params(self, model) -> list:
        return [p.to_local().detach().clone() if hasattr(p, "to_local") else p.detach().clone()
                for p in model.parameters()]

    def param_digest(self, model) -> str | None:
        """sha256 of the full parameters (FP32 masters: names, shapes and bytes in order), on rank 0;
        independent of the rank count, so runs can be compared across files. Collective."""
        digest = hashlib.sha256()
        for name, p in model.named_parameters():
            full = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().contiguous()  # collective
            if self.rank == 0:
                digest.update(f"{name} {tuple(full.shape)} {full.dtype}\n".encode())
                digest.update(full.reshape(-1).view(torch.uint8).cpu().numpy().tobytes())
        return digest.hexdigest() if self.rank == 0 else None

    def sample_memory(self, steps_done: int, handles: dict) -> None:
        """Every rank's resident memory (now and its peak) and codec state after `steps_done` steps;
        rank 0 keeps them and appends them to memory.jsonl. The trainings share each rank's
        process, so the resident numbers are all of them together. Collective."""
        self.status.between_steps("memory sample", steps_done)
        rss, peak = resident_bytes()
        codec_bytes = sum(h.cache_bytes for h in handles.values())
        gpu = [torch.cuda.max_memory_allocated()] if self.device.type == "cuda" else []
        mine = torch.tensor([rss, peak, codec_bytes, *gpu], dtype=torch.int64)
        everyone = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(everyone, mine)
        if self.rank == 0:
            rows = torch.stack(everyone).tolist()
            sample = {"step": steps_done, "rss_bytes": [r[0] for r in rows], "peak_rss_bytes": [r[1] for r in rows],
                      "codec_state_bytes": [r[2] for r in rows]}
            if gpu:
                sample["cuda_peak_allocated_bytes"] = [r[3] for r in rows]
            self.memory.append(sample)
            with open(self.run_dir / "memory.jsonl", "a") as f:
                f.write(json.dumps(sample) + "\n")

    def save_checkpoint(self, model, step: int) -> None:
        """The parameters as FSDP gathers them (BF16 casts of the FP32 masters). Collective."""
        from safetensors.torch import save_file

        tensors = {name: p.full_tensor().detach().to(torch.bfloat16).contiguous().cpu()
                   for name, p in model.named_parameters()}
        if self.rank == 0:
            folder = Path(self.args.save_checkpoints)
            folder.mkdir(parents=True, exist_ok=True)
            save_file(tensors, str(folder / f"step_{step:05d}.safetensors"))
