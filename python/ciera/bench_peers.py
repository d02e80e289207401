"""`ciera bench codec` from the Python package: the native tool's run, plus a ``zipnn`` row.

ZipNN (``pip install 'ciera[peers]'``) has no C API, so the native bench cannot time it. Here the
native bench runs as always, and also writes the steady-state shards its stateless, zstd and
zeropp-int8 rows were measured on (its hidden ``--save-shards``); then ZipNN compresses and
decompresses each of those shards here, one thread, and its row joins the report: the JSON object
(``--json``) or the table, which the native tool renders from that object (``--render-json``), so
both read as the native ones do. Same invocation, same data; every shard checked bit for bit.

Without zipnn the native output is unchanged, and one line on stderr says how to get the row."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ciera.cli import run_native

_INSTALL_HINT = "pip install 'ciera[peers]'"
# The `ciera` commands' status for a result that must be exact and was not (tools/exit_status.hpp).
NOT_EXACT = 3

# The native tool's dtype names, as torch names them.
_TORCH_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def _flag(args: list[str], name: str) -> bool:
    """Whether flag `name` is given, as the native tool's parser (CLI11) reads it: bare, or as
    name=VALUE with a VALUE other than false, 0, off or no."""
    return any(a == name or (a.startswith(name + "=") and a.split("=", 1)[1].lower() not in ("false", "0", "off", "no"))
               for a in args)


def _passes_through(args: list[str]) -> bool:
    """Runs the zipnn row cannot join: help, --no-compare (no comparison rows), a device other
    than the CPU, or the native tool's own hidden options."""
    if _flag(args, "--no-compare"):
        return True
    for i, arg in enumerate(args):
        if arg in ("-h", "--help") or arg.split("=", 1)[0] in ("--save-shards", "--render-json"):
            return True
        if arg == "--device" and i + 1 < len(args) and args[i + 1] != "cpu":
            return True
        if arg.startswith("--device=") and arg != "--device=cpu":
            return True
    return False


def _zipnn_problem() -> str | None:
    """Why the zipnn row cannot be measured here, or None."""
    try:
        import zipnn  # noqa: F401
    except ImportError as error:
        return f"the zipnn row needs zipnn ({error}): {_INSTALL_HINT}"
    return None


def measure_zipnn(shards_path: Path) -> dict:
    """The zipnn row, measured on every shard of a native --save-shards file: compress and
    decompress each (one thread; medians over the shards, in GB/s of raw shard bytes), its bytes
    on the wire per value, and whether every shard decompressed to exactly its bytes."""
    import importlib.metadata

    import torch

    from ciera.fsdp.zipnn import ZipnnCoder

    with open(shards_path, "rb") as file:
        header = json.loads(file.readline())
        if header.get("format") != "ciera-bench-shards" or header.get("version") != 1:
            raise ValueError(f"{shards_path}: not a shards file of this ciera's bench ({header})")
        values, value_bytes = int(header["values"]), int(header["value_bytes"])
        shard_bytes = values * value_bytes
        coder = ZipnnCoder(getattr(torch, _TORCH_DTYPES[header["dtype"]]))
        encode_s, decode_s, wire_bytes, verified = [], [], 0, True
        first = file.read(shard_bytes)
        if len(first) == shard_bytes:
            # ZipNN's first calls set it up (about 100x slower than the next ones): one untimed
            # round trip first, as a training's first gather would be before its steady state.
            coder.decompress_bytes(coder.compress_scratch(bytearray(first)))
        file.seek(-len(first), 1)
        while shard := file.read(shard_bytes):
            if len(shard) != shard_bytes:
                raise ValueError(f"{shards_path}: a shard of {len(shard)} bytes, expected {shard_bytes}")
            scratch = bytearray(shard)  # ZipNN rewrites what it compresses; the copy is not timed
            start = time.perf_counter()
            payload = coder.compress_scratch(scratch)
            encode_s.append(time.perf_counter() - start)
            start = time.perf_counter()
            decoded = coder.decompress_bytes(payload)
            decode_s.append(time.perf_counter() - start)
            verified = verified and decoded == shard
            wire_bytes += len(payload)
    samples = len(encode_s)
    if samples == 0:
        raise ValueError(f"{shards_path}: no shards")
    bits_per_value = 8 * wire_bytes / samples / values
    return {
        "name": "zipnn",
        "note": f"ZipNN {importlib.metadata.version('zipnn')} (Python package: byte grouping, Huffman-coded "
                "exponents), one thread, on the stateless rows' shards, after one untimed round trip; its input "
                "copy (ZipNN rewrites its input) not timed",
        "bits_per_value": bits_per_value,
        "ratio_vs_raw": 8 * value_bytes / bits_per_value,
        "encode_GBps": shard_bytes / statistics.median(encode_s) / 1e9,
        "decode_GBps": shard_bytes / statistics.median(decode_s) / 1e9,
        "samples": samples,
        "verified": verified,
        "lossy": False,
    }


def bench_codec(tool: Path, args: list[str]) -> int | None:
    """`ciera bench codec ARGS` with the zipnn row; None where the native tool alone answers
    (the caller then runs it as it runs every other command)."""
    if _passes_through(args):
        return None
    problem = _zipnn_problem()
    if problem is not None:
        status = run_native(tool, ["bench", "codec", *args]).returncode
        if status == 0:
            print(f"ciera bench codec: {problem}", file=sys.stderr)
        return status
    want_json = _flag(args, "--json")
    with tempfile.TemporaryDirectory(prefix="ciera-bench-codec-") as tmp:
        shards = Path(tmp) / "shards.bin"
        command = ["bench", "codec", *args, "--save-shards", str(shards)]
        if not want_json:
            command.append("--json")
        # stderr (progress, a bad option's one line) passes through; stdout is the report.
        done = run_native(tool, command, stdout=subprocess.PIPE, text=True)
        try:
            report = json.loads(done.stdout)
        except ValueError:
            sys.stdout.write(done.stdout)
            return done.returncode or 1
        if not _flag(args, "--quiet"):
            print("ciera bench codec: zipnn row (Python), on the same shards", file=sys.stderr, flush=True)
        row = measure_zipnn(shards)
        report["command"] = " ".join(["ciera", "bench", "codec", *args])  # as typed: not our additions
        report["comparisons"].append(row)
        report["verified"] = bool(report["verified"] and row["verified"])
        if want_json:
            print(json.dumps(report, indent=2, sort_keys=True))
        else:
            rendered = Path(tmp) / "report.json"
            rendered.write_text(json.dumps(report))
            sys.stdout.flush()
            status = run_native(tool, ["bench", "codec", "--render-json", str(rendered)]).returncode
            if status not in (0, NOT_EXACT):
                return status
    if done.returncode != 0:
        return done.returncode
    return 0 if report["verified"] else NOT_EXACT

