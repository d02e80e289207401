"""ciera.fsdp.enable_zipnn: ZipNN as an FSDP2 gather scheme (a peer scheme, issue 18). Training
through it on 2 CPU ranks is bitwise identical to FSDP2's own all-gather, every gather checked
against a plain one; the shard FSDP hands in stays untouched, although ZipNN 0.5.4 rewrites the
buffer it is given; without zipnn installed the call says how to install it."""

import importlib.util
import re
import sys

import pytest
from conftest import all_ok, needs_torch, spawn

torch = needs_torch()

from ciera import _ext, fsdp
from ciera.fsdp.layout import AllGather

# The peers extra (pip install 'ciera[peers]', which scripts/test.sh installs); without it only the
# test of the error that says so runs.
needs_zipnn = pytest.mark.skipif(importlib.util.find_spec("zipnn") is None,
                                 reason="zipnn is not installed: pip install 'ciera[peers]'")

STEPS = 6


class _InputWatch(AllGather):
    """Wraps a module's custom all-gather and counts the gathers after which the input shard
    FSDP handed in is not bit for bit what it was before."""

    def __init__(self, inner):
        self.inner = inner
        self.calls = 0
        self.changed = 0

    def allocate(self, size, *, dtype, device):
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        before = input_tensor.detach().clone()
        result = self.inner(output_tensor, input_tensor, group, async_op)
        self.calls += 1
        self.changed += not torch.equal(before.view(torch.uint8), input_tensor.detach().view(torch.uint8))
        return result


def zipnn_vs_plain(rank, world, dtype_name):
    """Trains the same model with FSDP2's all-gather and through ZipNN; returns the comparison."""
    import fsdp_workers as w

    from ciera import data

    dtype = getattr(torch, dtype_name)
    corpus = data.load_corpus(1 << 20)
    spec = w.tiny_spec("olmoe")
    plain = w.build(spec, world, dtype=dtype)
    plain_losses = w.train(plain, rank, STEPS, corpus)
    plain_params = w.local_bits(plain)

    model = w.build(spec, world, dtype=dtype)
    handle = fsdp.enable_zipnn(model, verify=True)
    observed = []
    handle.set_gather_observer(lambda index, shard: observed.append(index))
    outputs = []
    handle.set_output_observer(lambda bucket, output: outputs.append((bucket.index, output.numel())))
    watches = []
    for module, _ in fsdp.describe_buckets(model):
        watch = _InputWatch(fsdp.all_gather_comm(module))
        module.set_custom_all_gather(watch)
        watches.append(watch)
    losses = w.train(model, rank, STEPS, corpus)
    records = handle.take_records()
    params = w.local_bits(model)
    result = {
        "losses_equal": losses == plain_losses,
        "params_equal": w.same_bits(params, plain_params),
        "wrong_bytes": handle.wrong_bytes,
        "verified_bytes": handle.verified_bytes,
        "gathers": len(records),
        "buckets": len(handle.buckets),
        "all_compressed": all(r.compressed and not r.resynchronised and r.exposed_s == -1 for r in records),
        # What the inter-node byte counts read: the group, and this rank's own payload in the wire bytes.
        "records_name_the_group": all(r.ranks == tuple(range(world)) and 0 < r.payload_bytes < r.wire_bytes
                                      for r in records),
        "encode_s": min(r.encode_s for r in records),
        "wire_bytes": sum(r.wire_bytes for r in records),
        "raw_bytes": sum(r.raw_bytes for r in records),
        "raw_matches_buckets": all(r.raw_bytes == handle.buckets[r.bucket].numel * world * torch.tensor(
            [], dtype=dtype).element_size() for r in records),
        "observed": len(observed),
        "outputs": len(outputs),
        "watched_calls": sum(x.calls for x in watches),
        "inputs_changed": sum(x.changed for x in watches),
        "cache_bytes": handle.cache_bytes,
        "engine": handle.engine,
        "selector": handle.selector,
        "overlap": handle.overlap,
    }
    handle.disable()
    result["comms_after_disable"] = sorted({type(fsdp.all_gather_comm(m)).__name__
                                            for m, _ in fsdp.describe_buckets(model)})
    w.train(model, rank, 1, corpus)  # the plain path works again
    return result


@needs_zipnn
@pytest.mark.parametrize("dtype_name", ["bfloat16", "float16", "float32"])
def test_training_through_zipnn_is_bitwise_identical_to_plain_fsdp2(dtype_name):
    for r in all_ok(spawn(zipnn_vs_plain, 2, dtype_name)):
        assert r["losses_equal"] and r["params_equal"], r
        assert r["wrong_bytes"] == 0 and r["verified_bytes"] > 0, r
        # Every step gathers each group for forward and the decoder layers again for backward.
        assert r["gathers"] > STEPS * r["buckets"] and r["all_compressed"] and r["records_name_the_group"], r
        assert r["raw_matches_buckets"] and r["encode_s"] > 0, r
        assert r["observed"] == r["outputs"] == r["gathers"] == r["watched_calls"], r
        # ZipNN 0.5.4 reorders the bits of the buffer it compresses: FSDP's shard must not be it.
        assert r["inputs_changed"] == 0, r
        assert r["cache_bytes"] == 0 and r["engine"] is None and r["selector"] is None and r["overlap"] is False, r
        assert r["comms_after_disable"] == ["DefaultAllGather"], r
        if dtype_name == "bfloat16":
            assert r["wire_bytes"] < r["raw_bytes"], r   # exponent bytes Huffman-coded


@needs_zipnn
def test_zipnn_rewrites_its_input_so_the_coder_compresses_a_copy():
    """The trap enable_zipnn() avoids: ZipNN's compress() scrambles a BF16 buffer in place.
    ZipnnCoder.compress leaves the tensor as it was, and its bytes decompress to that tensor."""
    from zipnn import ZipNN

    values = (torch.randn(10_007, generator=torch.Generator().manual_seed(3)) * 0.02).to(torch.bfloat16)
    exposed = bytearray(values.view(torch.uint8).numpy().tobytes())
    ZipNN(input_format="byte", bytearray_dtype="bfloat16", threads=1).compress(exposed)
    assert bytes(exposed) != values.view(torch.uint8).numpy().tobytes()   # the trap is real

    from ciera.fsdp.zipnn import ZipnnCoder

    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        shard = values.to(dtype)
        before = shard.clone()
        coder = ZipnnCoder(dtype)
        payload = coder.compress(shard)
        assert torch.equal(shard.view(torch.uint8), before.view(torch.uint8)), dtype
        out = torch.empty(shard.numel() * shard.element_size(), dtype=torch.uint8)
        coder.decompress(payload, out)
        assert torch.equal(out, before.view(torch.uint8)), dtype


@needs_zipnn
@pytest.mark.parametrize("values", [0, 1, 3, 4097])
def test_coder_roundtrips_small_and_odd_shards(values):
    from ciera.fsdp.zipnn import ZipnnCoder

    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        shard = torch.tensor([float("inf"), float("-inf"), float("nan"), -0.0, 1e-40, 3.5] * (values // 6 + 1),
                             dtype=torch.float32)[:values].to(dtype)
        coder = ZipnnCoder(dtype)
        out = torch.empty(shard.numel() * shard.element_size(), dtype=torch.uint8)
        coder.decompress(coder.compress(shard), out)
        assert torch.equal(out, shard.view(torch.uint8)), (dtype, values)


@needs_zipnn
def test_coder_refuses_a_wrong_size_and_an_unsupported_dtype():
    import ciera
    from ciera.fsdp.zipnn import ZipnnCoder

    coder = ZipnnCoder(torch.bfloat16)
    payload = coder.compress(torch.ones(100, dtype=torch.bfloat16))
    with pytest.raises(ciera.FormatError, match="decompressed to 200 bytes, expected 198"):
        coder.decompress(payload, torch.empty(198, dtype=torch.uint8))
    with pytest.raises(TypeError, match="bf16, fp16 and fp32"):
        ZipnnCoder(torch.int8)


def test_without_zipnn_the_error_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "zipnn", None)   # `import zipnn` raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'ciera\[peers\]'") as raised:
        fsdp.enable_zipnn(torch.nn.Linear(4, 4))
    assert isinstance(raised.value, fsdp.ZipnnUnavailable)


def zipnn_twice(rank, world):
    """enable_zipnn() on a model whose gathers already go through ZipNN, then through CIERA, then
    again after disable()."""
    import fsdp_workers as w

    import ciera.torch as ct

    model = w.build(w.tiny_spec("olmoe"), world)
    messages = []
    for first in (lambda: fsdp.enable_zipnn(model), lambda: ct.enable(model)):
        handle = first()
        try:
            fsdp.enable_zipnn(model)
            messages.append("no error")
        except ValueError as e:
            messages.append(str(e))
        handle.disable()
    handle = fsdp.enable_zipnn(model)   # and CIERA's enable() on a model routed through ZipNN
    try:
        ct.enable(model)
        messages.append("no error")
    except ValueError as e:
        messages.append(str(e))
    handle.disable()
    fsdp.enable_zipnn(model).disable()
    try:   # `verify` adds a collective to each gather: it must be the same on every rank
        fsdp.enable_zipnn(model, verify=rank == 1).disable()
        messages.append("no error")
    except _ext.ConfigError as e:
        messages.append(str(e))
    return messages


@needs_zipnn
def test_enable_zipnn_on_a_model_already_routed_is_refused():
    for messages in all_ok(spawn(zipnn_twice, 2)):
        assert len(messages) == 4, messages
        for message in messages[:3]:
            assert "already go through CIERA or ZipNN" in message and "disable()" in message, messages
        assert messages[3] == "enable_zipnn(): the ranks differ in verify: False on rank 0; True on rank 1", messages


def zipnn_refused_on_one_rank(rank, world):
    """The ZipNN gather called with an input of the wrong size on the last rank only: what each
    rank raised, then whether the next gather works."""
    import fsdp_workers as w

    import torch.distributed as dist

    model = w.build(w.tiny_spec("olmoe"), world)
    handle = fsdp.enable_zipnn(model)
    module, bucket = fsdp.describe_buckets(model)[0]
    gather = fsdp.all_gather_comm(module)
    output = torch.empty(bucket.numel * world, dtype=bucket.dtype)
    values = bucket.numel + (1 if rank == world - 1 else 0)
    try:
        gather(output, torch.zeros(values, dtype=bucket.dtype), dist.group.WORLD)
        error = None
    except Exception as e:  # noqa: BLE001 - compared by the test
        error = f"{type(e).__name__}: {e}"
    gather(output, torch.full((bucket.numel,), float(rank), dtype=bucket.dtype), dist.group.WORLD)
    gathered = output.view(world, -1)[:, 0].tolist()
    handle.disable()
    return error, gathered


@needs_zipnn
def test_a_zipnn_gather_one_rank_refuses_fails_every_rank_at_once():
    results = all_ok(spawn(zipnn_refused_on_one_rank, 2))
    assert results[1][0].startswith("ConfigError: FSDP all-gather input for "), results
    assert results[0][0].startswith("ConfigError: enable_zipnn(): rank 1 refused its gather of "), results
    assert all(gathered == [0.0, 1.0] for _, gathered in results), results


def zipnn_bad_payload_from_one_rank(rank, world, fault):
    """The last rank's ZipNN payload goes wrong once: 7 bytes lost on the way ("damaged"; its
    checksum is the whole payload's), or ZipNN bytes of one value fewer than the shard ("short").
    What each rank raised, then whether the next gather works."""
    import fsdp_workers as w

    import torch.distributed as dist

    from ciera.fsdp import zipnn

    model = w.build(w.tiny_spec("olmoe"), world)
    handle = fsdp.enable_zipnn(model)
    module, bucket = fsdp.describe_buckets(model)[0]
    gather = fsdp.all_gather_comm(module)
    output = torch.empty(bucket.numel * world, dtype=bucket.dtype)
    shard = torch.full((bucket.numel,), float(rank + 1), dtype=bucket.dtype)
    if rank == world - 1:
        compress, frames, whole = gather.coder.compress, gather._frames, {}
        if fault == "damaged":
            def damaged(values):
                whole["payload"] = compress(values)
                return whole["payload"][:-7]
            gather.coder.compress = damaged
            gather._frames = lambda length, checksum: frames(length, zipnn._checksum(whole["payload"]))
        else:
            gather.coder.compress = lambda values: compress(values[:-1])
    try:
        gather(output, shard, dist.group.WORLD)
        error = None
    except Exception as e:  # noqa: BLE001 - compared by the test
        error = f"{type(e).__name__}: {e}"
    gather.coder = type(gather.coder)(bucket.dtype)
    gather.__dict__.pop("_frames", None)
    gather(output, shard, dist.group.WORLD)
    gathered = output.view(world, -1)[:, 0].tolist()
    handle.disable()
    return error, gathered


@needs_zipnn
@pytest.mark.parametrize("fault, cause", [
    ("damaged", r"FormatError: the \d+ bytes received do not match their XXH3-64"),
    ("short", r"FormatError: ZipNN payload decompressed to \d+ bytes, expected \d+")])
def test_a_payload_one_peer_cannot_decompress_fails_every_rank_its_sender_too(fault, cause):
    """Damaged bytes never reach ZipNN's decoder (ZipNN 0.5.4 aborts the process on a payload one
    byte short), and what one receiver cannot decompress fails the gather on every rank."""
    results = all_ok(spawn(zipnn_bad_payload_from_one_rank, 2, fault))
    expected = "FormatError: enable_zipnn(): rank 0 could not decompress rank 1's payload of "
    assert all(error is not None and error.startswith(expected) for error, _ in results), results
    assert re.search(": " + cause + "$", results[0][0]), results   # the receiver names its cause
    assert not re.search(cause, results[1][0]), results
    assert all(gathered == [1.0, 2.0] for _, gathered in results), results
