"""Real text that ships with the system, as byte-level tokens: nothing is fetched."""

from __future__ import annotations

import glob
import sysconfig
from pathlib import Path

import torch

VOCAB = 256  # byte-level tokens

# The Python documentation's reStructuredText sources (Debian package python3.X-doc), then the
# licence texts every Debian system carries, then (on a bare image, e.g. the GPU machine) the
# running Python's own standard library sources, which every Python has.
_SOURCES = ["/usr/share/doc/python3*/html/_sources/**/*.rst.txt", "/usr/share/common-licenses/*",
            sysconfig.get_paths()["stdlib"] + "/*.py"]


def corpus_files() -> list[str]:
    for pattern in _SOURCES:
        files = sorted(f for f in glob.glob(pattern, recursive=True) if Path(f).is_file())
        if files:
            return files
    raise FileNotFoundError("no text corpus found: install Debian's python3-doc "
                            "(apt-get install python3-doc)")


def load_corpus(max_bytes: int = 16 << 20) -> torch.Tensor:
    """The corpus as a uint8 tensor of byte tokens (deterministic: files in sorted order)."""
    chunks, total = [], 0
    for path in corpus_files():
        data = Path(path).read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    text = b"\n".join(chunks)[:max_bytes]
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).clone()


def batch(corpus: torch.Tensor, step: int, rank: int, batch_size: int, seq_len: int,
          seed: int = 0) -> torch.Tensor:
    """Token ids [batch_size, seq_len] for one rank and step: a pure function of its arguments,
    so a baseline run and a CIERA run see exactly the same data."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 4099 + rank)
    starts = torch.randint(0, corpus.numel() - seq_len - 1, (batch_size,), generator=g)
    return torch.stack([corpus[s : s + seq_len] for s in starts.tolist()]).long()
