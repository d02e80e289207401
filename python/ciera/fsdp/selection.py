"""Benefit-driven selection (paper §3.2) inside a training: warmup statistics, the C++ selector,
and its choice applied on every rank at the same step."""

from __future__ import annotations

import torch

from ciera import _ext
from ciera.fsdp.layout import DTYPES
from ciera.fsdp.tracking import ExponentTracker


class _Hooks:
    """Module hooks removed together."""

    def __init__(self, *handles):
        self.handles = handles

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def shard_type(name: str) -> str:
    """expert_ffn, attention, router, norm, embedding, dense_ffn or other, from the parameter name."""
    return _ext.classify_parameter(name)


class Selector:
    """Chooses how each parameter travels on every rank alike: raw or exponent reuse, or with
    `allow_delta` also value-delta frames (the receivers keep the previous values), from warmup
    statistics (q_i, the block change rate of each parameter's shards, and with `allow_delta` the
    estimated size of its value-delta frames, measured in C++ on the shards about to be gathered),
    a cost model measured at enable() on the same transport, and a cache budget. Training steps are
    counted by a forward pre-hook on the root module (training mode with gradients; an evaluation
    pass and its gathers are not counted); each bucket's first
    gather of a step is observed."""

    def __init__(self, runtime, cost_model, budget_bytes: int, select_after: int,
                 reselect_every: int, overlap: bool, codec, group=None, allow_delta: bool = False):
        """`cost_model`: one CostModel for runtime.engine's gathers, or with runtime.groups (FSDP2
        gathering on several groups) one per group, in their order, the same on every rank: each
        group's shards are priced on its own link, and all of them share the budget."""
        self.runtime = runtime
        self.models = list(cost_model) if isinstance(cost_model, (list, tuple)) else [cost_model]
        groups = runtime.groups or [None]
        if len(self.models) != len(groups):
            raise _ext.ConfigError(f"Selector: {len(self.models)} cost models for {len(groups)} groups")
        # Per group: (its buckets, its engine, the buckets FSDP gathers on it).
        self.kinds = [(runtime.buckets, runtime.engine, {b.index for b in runtime.buckets}) if g is None
                      else (g.buckets, g.engine, g.gathered) for g in groups]
        self.budget_bytes = budget_bytes
        self.select_after = select_after
        self.reselect_every = reselect_every
        self.overlap = overlap
        self.codec = codec
        self.group = group
        self.allow_delta = allow_delta
        self.trackers = [ExponentTracker(buckets, codec.block_values, track_values=allow_delta)
                         for buckets, _, _ in self.kinds]
        self.step = 0
        self.counting = True         # gathers now are a training step's (on_step, after_forward)
        self._resume: bool | None = None   # during an evaluation pass: `counting` before it
        self.gathers: dict = {}      # (kind, bucket) -> gathers since the last selection
        self.counted_steps = 0       # training steps those gathers came from
        self.selected_regathers: dict = {}   # (kind, bucket) -> re-gathers the latest selection counted
        self.policies = {(kind, b.index, k): _ext.ShardPolicy.raw for kind, (buckets, _, _) in enumerate(self.kinds)
                         for b in buckets for k in range(len(b.params))}
        self.memory: dict = {}   # (kind, bucket, param) -> cache bytes of its policy (absent: raw, none)
        self.selection: _ext.Selection | None = None   # the latest
        self.selection_step: int | None = None         # the training step it was made at
        self.history: list[dict] = []   # one entry per selection: step, chosen count, cache bytes
        self.selected_from: list | None = None   # merged counts the latest selection was made from, per group
        self.carried: list | None = None   # counts a resumed training brought from its checkpoint, per group

    @property
    def cost_model(self):
        """The shard group's cost model."""
        return self.models[0]

    @property
    def tracker(self) -> ExponentTracker:
        """The shard group's tracker (call it with (bucket, shard) for each gather)."""
        return self.trackers[0]

    @property
    def finished(self) -> bool:
        """No selection will follow the latest one (reselect_every 0): statistics are no longer
        needed, and the monitors are gone."""
        return self.reselect_every == 0 and self.selection is not None

    def observe(self, kind: int, bucket: int, shard) -> None:
        """Counts a gather of `bucket` on the group of `kind`: how many there are per step, and
        (its first of the step) the changes since the previous step. Nothing once `finished`: the
        monitors cost a pass over the shard on each gather's critical path and, with delta, 1.5x a
        BF16 shard of memory that no budget counts."""
        if self.finished or not self.counting:
            return
        self.gathers[(kind, bucket)] = self.gathers.get((kind, bucket), 0) + 1
        self.trackers[kind](bucket, shard)

    def regathers(self, kind: int, bucket: int) -> int:
        """Gathers of `bucket` per step on the group of `kind` beyond the first (FSDP2's backward
        re-gather of a layer resharded to the same group: its values unchanged since forward),
        from the steps since the last selection."""
        if not self.counted_steps:
            return 0
        return max(0, round(self.gathers.get((kind, bucket), 0) / self.counted_steps) - 1)

    @property
    def monitor_bytes(self) -> int:
        return sum(t.memory_bytes for t in self.trackers)

    def install(self, root: torch.nn.Module):
        """Counts training steps on `root`: a forward pre-hook, prepended so that the step is
        counted before FSDP's own pre-forward hook gathers the root, and a forward hook that ends
        an evaluation pass. Returns what removes both (.remove())."""
        return _Hooks(root.register_forward_pre_hook(self.on_step, prepend=True),
                      root.register_forward_hook(self.after_forward))

    def on_step(self, module, args) -> None:
        # An evaluation pass (eval mode, or no gradients) is no training step, and its gathers
        # are not counted, until it ends (after_forward): they made the re-gathers per step look
        # higher than training has, and a no-grad pass between a training forward and its
        # backward must not drop that backward's re-gathers.
        if not (module.training and torch.is_grad_enabled()):
            if self._resume is None:
                self._resume = self.counting
            self.counting = False
            return
        self.counting = True
        for tracker in self.trackers:
            tracker.new_step()
        done = self.step
        self.step += 1
        if done == self.select_after or (self.reselect_every > 0 and done > self.select_after
                                         and (done - self.select_after) % self.reselect_every == 0):
            self.select()
        self.counted_steps += 1   # the step starting now

    def after_forward(self, module, args, output) -> None:
        if self._resume is not None:
            self.counting, self._resume = self._resume, None

    def candidates(self, merged: list, regathers: dict) -> list:
        """Every parameter of every group as the selector sees it, from the statistics merged over
        ranks (per group, per bucket, per parameter) and the re-gathers per step of each
        (kind, bucket)."""
        out = []
        for kind, (buckets, _, gathered) in enumerate(self.kinds):
            world = self.models[kind].world_size
            for b in buckets:
                if b.index not in gathered:
                    continue
                for k, p in enumerate(b.params):
                    counts = merged[kind][b.index][k]
                    c = _ext.ShardCandidate()
                    c.group, c.bucket, c.param, c.name, c.type = kind, b.index, k, p.name, shard_type(p.name)
                    c.dtype = DTYPES[b.dtype]
                    c.shard_values = [p.numel] * world
                    # No statistics yet: assume every block changes, so nothing is selected blindly.
                    c.block_change_rate = counts.block_change_rate if counts.observations else 1.0
                    c.value_change_rate = counts.value_change_rate if counts.observations else 1.0
                    # -1: not measured, so delta is not considered for it.
                    c.delta_bits_per_value = (counts.delta_bits_per_value
                                              if self.allow_delta and counts.observations else -1.0)
                    c.regathers = regathers.get((kind, b.index), 0)
                    out.append(c)
        return out

    def counts_since_selection(self) -> list:
        """Per group, per bucket, per parameter: the statistics since the latest selection, merged
        over ranks (over the world: every rank has a group of each kind, of the same shape), plus
        those a resumed training carried over. Collective."""
        merged = [tracker.merged_counts(buckets, self.group) for tracker, (buckets, _, _) in zip(self.trackers, self.kinds)]
        if self.carried is not None:
            # Counts of successive steps add up, observations included (merge() is for ranks).
            merged = [rows if kept is None else
                      [[_counts(tuple(x + y for x, y in zip(now.__getstate__(), before.__getstate__())))
                        for now, before in zip(row, carried)] for row, carried in zip(rows, kept)]
                      for rows, kept in zip(merged, self.carried)]
        return merged

    def select(self) -> _ext.Selection:
        """Runs the selector on the statistics since the last selection and applies it. Collective."""
        selection = self.choose(self.counts_since_selection())
        for tracker in self.trackers:
            tracker.clear_counts()
        self.gathers, self.counted_steps = {}, 0
        self.carried = None
        self.selection_step = self.step - 1
        self.history.append({"step": self.selection_step, "chosen": selection.chosen_count(),
                             "delta": selection.count(_ext.ShardPolicy.delta),
                             "cache_bytes": selection.cache_bytes})
        return selection

    def choose(self, merged: list, regathers: dict | None = None) -> _ext.Selection:
        """Selects from `merged` statistics (the same on every rank) and the re-gathers per step
        (default: those counted since the last selection), and applies the choice."""
        if regathers is None:
            regathers = {(kind, b.index): self.regathers(kind, b.index)
                         for kind, (buckets, _, _) in enumerate(self.kinds) for b in buckets}
        self.selected_regathers = {key: n for key, n in regathers.items() if n}
        options = _ext.SelectorOptions()
        options.cache_budget_bytes = self.budget_bytes
        options.overlap = self.overlap
        options.codec = self.codec
        options.allow_delta = self.allow_delta
        selection = _ext.select_shards(self.candidates(merged, regathers), self.models, options)
        changes = [x for x in selection.shards if self.policies[(x.group, x.bucket, x.param)] != x.policy]
        # The changes that free cache first, then those that take it: the selection fits the budget,
        # and so does every moment of the switch from the previous one.
        changes.sort(key=lambda x: x.chosen_memory_bytes - self.memory.get((x.group, x.bucket, x.param), 0))
        for shard in changes:
            key = (shard.group, shard.bucket, shard.param)
            self.kinds[shard.group][1].set_policy(shard.bucket, shard.param, shard.policy)
            self.policies[key] = shard.policy
            self.memory[key] = shard.chosen_memory_bytes
        self.selection, self.selected_from = selection, merged
        if self.finished:
            for tracker in self.trackers:
                tracker.release()
        return selection

    def state_dict(self) -> dict:
        """What a resumed training needs to go on selecting as this one would (plain data, for
        JSON; the shard group's counts under "counts" and "selected_from", as a one-group training
        writes them, the other groups' under "group_counts" and "group_selected_from"). Collective:
        the statistics are merged over ranks."""
        def plain(rows):
            return None if rows is None else [[list(c.__getstate__()) for c in row] for row in rows]

        counts = self.counts_since_selection()
        chosen_from = self.selected_from or [None] * len(self.kinds)
        return {"step": self.step, "selection_step": self.selection_step, "history": list(self.history),
                "counts": plain(counts[0]), "selected_from": plain(chosen_from[0]),
                "group_counts": [plain(rows) for rows in counts[1:]],
                "group_selected_from": [plain(rows) for rows in chosen_from[1:]],
                "regathers": [[kind, bucket, n] for (kind, bucket), n in sorted(self.selected_regathers.items())]}

    def load_state_dict(self, state: dict) -> None:
        """Continues a checkpointed selector in a fresh engine, the same on every rank: the same step
        count (warmup ends and re-selections come at the same steps), the latest selection made
        again from the statistics it was made from (with this run's cost model, so the same shards
        unless the machine measures differently), and the statistics counted since carried into the
        next selection. The monitors' last exponents are not kept, so that selection misses the one
        change across the checkpoint. Selected shards start with key frames: the codec is lossless,
        so training results do not depend on any of this."""
        extra = len(self.kinds) - 1
        for key in ("group_counts", "group_selected_from"):
            if len(state.get(key) or [None] * extra) != extra:
                raise _ext.ConfigError(f"Selector.load_state_dict: the state is for {len(state[key]) + 1} groups, "
                                       f"this training gathers on {extra + 1}")

        def counts(kind, rows):
            if rows is None:
                return None
            if [len(row) for row in rows] != [len(b.params) for b in self.kinds[kind][0]]:
                raise _ext.ConfigError("Selector.load_state_dict: the state is for other parameter groups")
            return [[_counts(tuple(c)) for c in row] for row in rows]

        def per_group(first, rest):
            rows = [counts(0, state[first])] + [counts(k + 1, r) for k, r in enumerate(state.get(rest) or [None] * extra)]
            return None if all(r is None for r in rows) else rows

        self.step = state["step"]
        self.history = list(state["history"])
        self.carried = per_group("counts", "group_counts")
        selected_from = per_group("selected_from", "group_selected_from")
        if selected_from is not None:
            if any(rows is None for rows in selected_from):
                raise _ext.ConfigError("Selector.load_state_dict: a selection without statistics for every group")
            self.choose(selected_from, {(kind, bucket): n for kind, bucket, n in state.get("regathers", [])})
            self.selection_step = state["selection_step"]


def _counts(fields: tuple) -> _ext.ShardChangeCounts:
    """ShardChangeCounts from its counts (its pickled form: seven, or five from before value-delta
    frames)."""
    counts = _ext.ShardChangeCounts.__new__(_ext.ShardChangeCounts)
    counts.__setstate__(fields)
    return counts


def selection_table(selection: _ext.Selection) -> str:
    """The selection as a readable table: one row per shard type, then the chosen shards' totals."""
    by_type: dict[str, list] = {}
    for s in selection.shards:
        by_type.setdefault(s.type, []).append(s)
    lines = [f"{'shard type':<12} {'shards':>6} {'chosen':>6} {'delta':>5} {'values chg':>10} {'blocks chg':>10} "
             f"{'gain/gather':>12} {'cache':>10}"]
    for kind, shards in sorted(by_type.items()):
        chosen = [s for s in shards if s.chosen]
        delta = sum(1 for s in chosen if s.policy == _ext.ShardPolicy.delta)
        q = sum(s.block_change_rate for s in shards) / len(shards)
        p = sum(s.value_change_rate for s in shards) / len(shards)
        gain = sum(s.chosen_gain_s for s in chosen)
        cache = sum(s.chosen_memory_bytes for s in chosen)
        lines.append(f"{kind:<12} {len(shards):>6} {len(chosen):>6} {delta:>5} {100 * p:>9.3f}% {100 * q:>9.2f}% "
                     f"{1e3 * gain:>9.3f} ms "
                     f"{cache / 2**20:>7.2f} MiB")
    budget = selection.budget_bytes
    budget_text = "unlimited" if budget >= 2**63 else f"{budget / 2**20:.2f} MiB"
    lines.append(f"cache {selection.cache_bytes / 2**20:.2f} MiB of {budget_text}; expected gain "
                 f"{1e3 * selection.gain_s:.3f} ms per gather round")
    return "\n".join(lines)
