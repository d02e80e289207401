"""The gather schemes ``ciera train`` can run beside plain FSDP2 (``--codec``, ``--schemes``,
``--baselines``): CIERA's own (exponent reuse, value-delta frames) and the alternatives it is
compared with. All but ZipNN run in the same C++ engine over the same transport as shard
policies (include/ciera/peers.hpp), so only the scheme differs; ZipNN has no C API and runs on
the Python side (ciera.fsdp.zipnn)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from ciera import _ext


@dataclass(frozen=True)
class Scheme:
    name: str
    lossy: bool
    what: str


SCHEMES = {s.name: s for s in (
    Scheme("ciera", False, "exponent reuse after warmup (CIERA, paper §3.1)"),
    Scheme("auto", False, "exponent reuse or raw, whichever the engine measures faster"),
    Scheme("delta", False, "value-delta frames from step 1 (receivers keep the previous values)"),
    Scheme("stateless", False, "every exponent rANS-coded every step with tables from its own counts, no cache (ZipCCL's stateless "
           "setting; ZipCCL's own coder uses a fixed Gaussian-derived code instead of counts)"),
    Scheme("zipnn", False, "ZipNN 0.5.4 on each shard (Python), bytes exchanged over gloo"),
    Scheme("zeropp-int8", True, "ZeRO++ qwZ: int8 weights, one FP32 scale per 8000 values (LOSSY)"),
    Scheme("sdp4bit", True, "SDP4Bit qWD: 4-bit weight differences, one FP32 scale per 2048 (LOSSY)"),
)}

# --baselines: every scheme this installation can run, CIERA's first.
BASELINES = ("ciera", "delta", "stateless", "zipnn", "zeropp-int8", "sdp4bit")

# Schemes that go through the engine with one policy on every shard from the first step (no
# warmup: their first frame carries the values); ciera and auto start raw and switch after warmup.
_FROM_FIRST_STEP = {"delta": "delta", "stateless": "stateless", "zeropp-int8": "zeropp_int8", "sdp4bit": "sdp4bit"}


def zipnn_installed() -> bool:
    return importlib.util.find_spec("zipnn") is not None


def unknown(name: str) -> str | None:
    """Why `name` is no scheme (None: it is one)."""
    if name not in SCHEMES:
        return f"unknown scheme {name!r} (expected one of {', '.join(BASELINES)}, or auto)"
    return None


def unavailable(name: str) -> str | None:
    """Why this installation cannot run scheme `name` (None: it can)."""
    if unknown(name):
        return unknown(name)
    if name == "zipnn" and not zipnn_installed():
        return "zipnn needs the zipnn package: pip install 'ciera[peers]'"
    if name in _FROM_FIRST_STEP and not hasattr(_ext.ShardPolicy, _FROM_FIRST_STEP[name]):
        return f"{name}: this build of CIERA has no {name} shard policy (rebuild it)"
    return None


def available_baselines() -> list[str]:
    return [name for name in BASELINES if unavailable(name) is None]


def parse(text: str) -> list[str]:
    """--schemes a,b,c: the names in order, each once; ValueError naming the first bad one.
    Whether this installation can run them is unavailable()'s question, asked after the options'
    conflicts (a run that cannot be is refused for that before a package is asked for)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise ValueError("--schemes needs at least one scheme name")
    for name in names:
        if names.count(name) > 1:
            raise ValueError(f"--schemes lists {name} twice")
        problem = unknown(name)
        if problem:
            raise ValueError(f"--schemes: {problem}")
    return names


def is_lossy(name: str) -> bool:
    return SCHEMES[name].lossy


def first_policy(name: str):
    """The shard policy every parameter of scheme `name` starts with (ciera and auto: raw, until
    warmup ends)."""
    return getattr(_ext.ShardPolicy, _FROM_FIRST_STEP.get(name, "raw"))


def switches_after_warmup(name: str) -> bool:
    return name in ("ciera", "auto")


def end_warmup(handle) -> None:
    """Every parameter of `handle`'s buckets through exponent reuse from now on (collective:
    every rank at the same step)."""
    for bucket in handle.buckets:
        for k in range(len(bucket.params)):
            handle.set_policy(bucket.index, k, _ext.ShardPolicy.ciera)
