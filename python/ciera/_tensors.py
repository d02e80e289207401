"""Refusals of tensors that the engine reads and writes through their pointers (data_ptr()),
unseen by PyTorch: the Broadcaster's tensors and ciera.zero's parameters, checked before every
call. Each raises a ConfigError naming the tensor; `names`, where given, names them (else
"tensor i", i its position in `tensors`)."""

from ciera import _ext


def _name(names, i: int) -> str:
    return names[i] if names is not None else f"tensor {i}"


def short_storage(name: str, held: int, needed: int) -> _ext.ConfigError:
    """The error for a tensor `name` whose storage holds `held` of the `needed` bytes its values
    reach. Short: a peer hears a refusal cut to 76 bytes (kErrorTextBytes, src/engine/control.hpp)."""
    return _ext.ConfigError(f"{name}'s storage holds {held} of its {needed} bytes: freed or shrunk")


def refuse_short_storage(tensors: list, prefix: str) -> None:
    """ConfigError for a (contiguous) tensor whose storage no longer holds its values: freed or
    shrunk by untyped_storage().resize_(), as FSDP frees an unsharded parameter's, its shape
    kept. The engine writes numel() values from data_ptr(), past the end of what is left: a
    corrupted heap, or a null pointer where the storage is empty."""
    for i, t in enumerate(tensors):
        needed = (t.storage_offset() + t.numel()) * t.element_size()
        held = t.untyped_storage().nbytes()
        if t.numel() > 0 and held < needed:
            raise short_storage(f"{prefix}tensor {i}", held, needed)


def refuse_negated(tensors: list, prefix: str, names: list[str] | None = None) -> None:
    """ConfigError for a negated view (the neg bit: a one-value complex tensor's .conj().imag is a
    contiguous FP32 one): the engine reads and writes its memory, whose values are the negation
    of the tensor's, so a receiver would read the sender's values negated and a sender would send
    its own so."""
    for i, t in enumerate(tensors):
        if t.is_neg():
            raise _ext.ConfigError(f"{prefix}{_name(names, i)} is a negated view (its values are its memory's "
                                   "negated, e.g. .conj().imag); pass .resolve_neg()")


def refuse_shared_memory(tensors: list, prefix: str) -> None:
    """ConfigError when two of `tensors` share memory (the same tensor twice, overlapping views):
    each is the output of its own bucket, decoded concurrently, so one would hold the other's
    values."""
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), i)
                   for i, t in enumerate(tensors) if t.numel() > 0)
    for (_, end, i), (begin, _, j) in zip(spans, spans[1:]):
        if begin < end:
            first, second = sorted((i, j))
            raise _ext.ConfigError(f"{prefix}tensors {first} and {second} share memory; each must be a tensor "
                                   "of its own")


def refuse_unwritable(tensors: list, prefix: str) -> None:
    """What the Broadcaster's set-up and every broadcast() refuse in `tensors` beyond their dtype
    and layout: storage that no longer holds them, negated views, and memory they share."""
    refuse_short_storage(tensors, prefix)
    refuse_negated(tensors, prefix)
    refuse_shared_memory(tensors, prefix)
