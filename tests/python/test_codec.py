"""ciera.ShardEncoder / ciera.ShardDecoder from Python: bit-exact round trips over training-like
steps (NumPy uint16 views of BF16, and torch tensors), corrupted payloads refused with the decoder
left usable, key-frame resynchronisation, and misuse refused with a message."""

import numpy as np
import pytest
from conftest import ROOT  # noqa: F401  (puts the package on sys.path)

import ciera


def bf16_steps(values, steps, seed):
    """BF16 weights (as uint16) after each of `steps` small training-like updates."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal(values) * 0.02).astype(np.float32)
    out = []
    for _ in range(steps):
        w += (rng.standard_normal(values) * 2e-4).astype(np.float32)
        out.append((w.view(np.uint32) >> 16).astype(np.uint16))
    return out


def codec(values, warmup_steps=2):
    config = ciera.CodecConfig()
    config.warmup_steps = warmup_steps
    return ciera.ShardEncoder(config, values), ciera.ShardDecoder(config, values)


@pytest.mark.parametrize("values", [1, 511, 4097, 50_001])
def test_round_trip_over_steps_is_bit_exact(values):
    encoder, decoder = codec(values)
    out = np.empty(values, dtype=np.uint16)
    for step, shard in enumerate(bf16_steps(values, 8, values)):
        payload, sent = encoder.encode(shard)
        assert isinstance(payload, bytes) and len(payload) == sent.payload_bytes <= encoder.max_payload_bytes
        got = decoder.decode(payload, out)
        assert np.array_equal(out, shard), step
        assert got.kind == sent.kind == (ciera.FrameKind.key if step < 2 else ciera.FrameKind.delta)
        assert got.sequence == sent.sequence == step
    assert encoder.cache_bytes == values and decoder.cache_bytes == values  # one byte per value
    assert decoder.has_cache


def test_value_delta_frames_through_the_public_names():
    """ciera.StreamKind was bound but not exported (a value-delta codec needed ciera._ext), and a
    value-delta frame's kind and section printed as FrameKind.??? and ExponentSection.???."""
    values = 4097
    config = ciera.CodecConfig()
    config.stream_kind = ciera.StreamKind.value_delta
    encoder, decoder = ciera.ShardEncoder(config, values), ciera.ShardDecoder(config, values)
    out = np.empty(values, dtype=np.uint16)
    for step, shard in enumerate(bf16_steps(values, 3, 7)):
        payload, sent = encoder.encode(shard)
        got = decoder.decode(payload, out)
        assert np.array_equal(out, shard), step
        if step:
            assert got.kind == sent.kind == ciera.FrameKind.value_delta
            assert sent.section == ciera.ExponentSection.differences
            assert "???" not in repr(sent.kind) + repr(sent.section)
    assert decoder.cache_bytes == 2 * values   # the previous BF16 values


def test_round_trip_of_torch_bf16_tensors():
    torch = pytest.importorskip("torch")
    values = 10_000
    encoder, decoder = codec(values)
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(values, generator=gen) * 0.02
    out = torch.empty(values, dtype=torch.bfloat16)
    for step in range(6):
        w += torch.randn(values, generator=gen) * 2e-4
        shard = w.to(torch.bfloat16)
        payload, _ = encoder.encode(shard)
        decoder.decode(payload, out)
        assert torch.equal(out.view(torch.int16), shard.view(torch.int16)), step
    with pytest.raises(ValueError, match="contiguous"):
        encoder.encode(torch.zeros(2 * values, dtype=torch.bfloat16)[::2])


def test_encode_into_a_caller_buffer():
    encoder, decoder = codec(3000)
    payload = np.empty(encoder.max_payload_bytes, dtype=np.uint8)
    out = np.empty(3000, dtype=np.uint16)
    for shard in bf16_steps(3000, 4, 7):
        sent = encoder.encode_into(shard, payload)
        decoder.decode(payload[: sent.payload_bytes], out)
        assert np.array_equal(out, shard)
    with pytest.raises(ValueError, match="max_payload_bytes"):
        encoder.encode_into(shard, np.empty(10, dtype=np.uint8))


@pytest.mark.parametrize("where", ["header", "middle", "end"])
def test_corrupted_payload_raises_and_leaves_the_decoder_usable(where):
    values = 20_000
    encoder, decoder = codec(values)
    out = np.empty(values, dtype=np.uint16)
    steps = bf16_steps(values, 6, 3)
    for step, shard in enumerate(steps):
        payload, _ = encoder.encode(shard)
        if step in (1, 4):  # a key frame and a delta frame
            bad = bytearray(payload)
            bad[{"header": 5, "middle": len(bad) // 2, "end": len(bad) - 1}[where]] ^= 0x10
            with pytest.raises(ciera.FormatError) as error:
                decoder.decode(bytes(bad), out)
            assert str(error.value)  # names the problem
            with pytest.raises(ciera.FormatError, match="truncated"):
                decoder.decode(payload[:-3], out)
        decoder.decode(payload, out)  # the genuine payload still decodes against the same cache
        assert np.array_equal(out, shard), step


def test_request_key_frame_resynchronises_a_fresh_receiver():
    values = 5000
    encoder, decoder = codec(values, warmup_steps=0)
    steps = bf16_steps(values, 5, 11)
    out = np.empty(values, dtype=np.uint16)
    for shard in steps[:3]:
        decoder.decode(encoder.encode(shard)[0], out)
    # A restarted receiver knows its stream (agreed at setup) but holds no cache.
    restarted = ciera.ShardDecoder(encoder.config, values, stream=encoder.stream, epoch=encoder.epoch)
    with pytest.raises(ciera.FormatError, match="no exponent cache"):
        restarted.decode(encoder.encode(steps[3])[0], out)  # a delta frame without a cache
    epoch = encoder.epoch
    encoder.request_key_frame()
    payload, sent = encoder.encode(steps[4])
    assert sent.kind == ciera.FrameKind.key and sent.epoch == epoch + 1
    with pytest.raises(ciera.FormatError, match="no resynchronisation"):
        restarted.decode(payload, out)  # a new epoch the receiver did not ask for
    restarted.request_resync()
    restarted.decode(payload, out)
    assert np.array_equal(out, steps[4])


def test_payloads_are_bound_to_their_stream():
    config = ciera.CodecConfig()
    values = 1000
    epoch = ciera.new_stream_epoch()
    mine = ciera.ShardEncoder(config, values, stream=3, epoch=epoch)
    other = ciera.ShardEncoder(config, values, stream=4, epoch=epoch)
    decoder = ciera.ShardDecoder(config, values, stream=3, epoch=epoch)
    shard = bf16_steps(values, 1, 5)[0]
    out = np.empty(values, dtype=np.uint16)
    with pytest.raises(ciera.FormatError, match="misrouted"):
        decoder.decode(other.encode(shard)[0], out)
    key, stats = mine.encode(shard)
    assert (stats.stream, stats.epoch) == (3, epoch)
    decoder.decode(key, out)
    with pytest.raises(ciera.FormatError, match="stale"):
        decoder.decode(key, out)  # replayed
    assert np.array_equal(out, shard)


def test_misuse_is_refused_with_a_message():
    encoder, decoder = codec(100)
    with pytest.raises(ValueError, match="100 bf16 values"):
        encoder.encode(np.zeros(99, dtype=np.uint16))
    payload, _ = encoder.encode(np.zeros(100, dtype=np.uint16))
    with pytest.raises(ValueError, match="writable"):
        decoder.decode(payload, bytes(200))
    with pytest.raises(ValueError, match="100 bf16 values"):
        decoder.decode(payload, np.empty(101, dtype=np.uint16))
    with pytest.raises(ValueError, match="C-contiguous"):
        encoder.encode(np.zeros(200, dtype=np.uint16)[::2])
    with pytest.raises(TypeError, match="buffer"):
        encoder.encode([0] * 100)
