"""A synthetic checkpoint series for `ciera analyze`'s memory and progress benchmark
(docs/benchmarks.md, "ciera analyze: resident memory"): safetensors files of MoE-like tensors,
two of them large (a 32 MB embedding and a 32 MB fused expert weight), each step changing 5% of
the values by a few percent, so that some exponents change.

    python bench/analyze_checkpoints.py DIR STEPS

writes DIR/step_000000.safetensors, step_000010..., about 68.5 MB each. The values are not a
model's: only the sizes and a plausible rate of exponent changes matter here."""

import json
import struct
import sys
from pathlib import Path

import numpy as np

SPECS = [  # name, dtype, shape
    ("model.embed_tokens.weight", "BF16", (16384, 1024)),
    ("model.layers.0.mlp.experts.gate_up_proj", "BF16", (8, 1024, 2048)),
    ("model.layers.0.self_attn.q_proj.weight", "F32", (512, 512)),
    ("model.layers.0.mlp.gate.weight", "BF16", (8, 1024)),
    ("model.layers.0.input_layernorm.weight", "F32", (1024,)),
    ("model.layers.0.self_attn.o_proj.weight", "F16", (333, 517)),
]


def encode(dtype: str, x: np.ndarray) -> bytes:
    if dtype == "F32":
        return x.astype("<f4").tobytes()
    if dtype == "F16":
        return x.astype("<f2").tobytes()
    return (x.astype("<f4").view("<u4") >> 16).astype("<u2").tobytes()   # BF16, truncated


def main(out: Path, steps: int) -> None:
    rng = np.random.default_rng(1)
    state = {name: rng.standard_normal(shape, dtype=np.float32) * 0.02 for name, _, shape in SPECS}
    out.mkdir(parents=True, exist_ok=True)
    for step in range(steps):
        if step > 0:
            for x in state.values():
                moved = rng.random(x.shape) < 0.05
                x[moved] *= 1 + rng.standard_normal(moved.sum()).astype(np.float32) * 0.3
        header, blobs, offset = {"__metadata__": {"format": "pt"}}, [], 0
        for name, dtype, shape in SPECS:
            blob = encode(dtype, state[name])
            header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(blob)]}
            blobs.append(blob)
            offset += len(blob)
        text = json.dumps(header).encode()
        text += b" " * (-len(text) % 8)
        with open(out / f"step_{step * 10:06d}.safetensors", "wb") as f:
            f.write(struct.pack("<Q", len(text)))
            f.write(text)
            for blob in blobs:
                f.write(blob)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: analyze_checkpoints.py DIR STEPS")
    main(Path(sys.argv[1]), int(sys.argv[2]))
