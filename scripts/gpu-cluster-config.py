#!/usr/bin/env python3
"""Turns a GPU device check's measured codec throughputs into a `ciera simulate` cluster preset,
so that the simulator projects multi-node iteration times from measured GPU codec costs instead
of its assumed ones (issue 16). The links stay the base preset's (they were not measured: a
one-GPU machine has none); the output says so in its notes and `source` fields.

    scripts/device-check.sh all OUT              # on a lent GPU: OUT/bench-256M.json (and -16M)
    scripts/gpu-cluster-config.py OUT/bench-256M.json > measured.json
    ciera simulate --cluster-config measured.json --cluster h200-measured --model all

Reads the largest shard size of the benchmark file: CIERA's steady-state encode and decode (GB/s of raw
shard bytes, the simulator's unit) and the change-detection kernel. Exits 1 with one line if the
file is not a device-check benchmark or its run failed."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys


def fail(message: str):
    sys.exit(f"gpu-cluster-config: {message}")


def builtin_presets(tool: str) -> dict:
    try:
        out = subprocess.run([tool, "simulate", "--print-cluster-config"], check=True, capture_output=True, text=True)
    except (OSError, subprocess.CalledProcessError) as e:
        fail(f"cannot read the built-in presets from `{tool} simulate --print-cluster-config`: {e}")
    return json.loads(out.stdout)


def measured_kernels(bench: dict) -> dict:
    sizes = bench.get("sizes") or fail("no 'sizes' in the benchmark file (not a device-check bench-*.json?)")
    size = max(sizes, key=lambda s: s.get("values", 0))
    codec = size.get("codec", {})
    if codec.get("failure"):
        fail(f"the benchmark's codec run failed: {codec['failure']}")
    ciera = next((c for c in codec.get("coders", []) if c.get("name", "").startswith("ciera")), None)
    if ciera is None:
        fail("no CIERA coder in the benchmark file")
    detect = next((k for k in size.get("kernels", []) if k.get("op", "").startswith("changed_blocks")), None)
    where = f"measured on {bench.get('gpu', 'the GPU')} by scripts/device-check.sh codec, {size['values']} BF16 values"
    return {
        "detect_GBps": detect["gb_per_s"] if detect else ciera["encode_gb_per_s"],
        "encode_GBps": ciera["encode_gb_per_s"],
        "decode_GBps": ciera["decode_gb_per_s"],
        "source": where + ("" if detect else "; detection taken as part of encode"),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("bench", help="bench-256M.json (or bench-16M.json) of scripts/device-check.sh")
    p.add_argument("--base", default="h200-ndr", help="preset whose links and GPU are kept")
    p.add_argument("--name", default="h200-measured", help="name of the new preset")
    p.add_argument("--tool", default=shutil.which("ciera") or "build/release/tools/ciera", help="the ciera tool")
    args = p.parse_args(argv)
    try:
        bench = json.load(open(args.bench))
    except (OSError, ValueError) as e:
        fail(f"cannot read {args.bench}: {e}")
    config = builtin_presets(args.tool)
    base = config["clusters"].get(args.base) or fail(f"no preset {args.base!r}")
    preset = json.loads(json.dumps(base))
    kernels = preset["kernels"]
    kernels.update(measured_kernels(bench))  # (de)quantise stay assumed: ZeRO++ was not measured
    preset["description"] = f"{base['description']}; CIERA's kernels as measured (links as in {args.base})"
    config["clusters"][args.name] = preset
    config["notes"] = config.get("notes", []) + [
        f"Preset {args.name}: the codec throughputs are measured, the links are {args.base}'s assumptions; "
        "its iteration times are a projection, not a measurement."]
    json.dump(config, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
