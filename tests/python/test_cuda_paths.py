"""What of the CUDA paths can be checked without a GPU: the choices and refusals made before any
device is touched (transports for CPU and CUDA models, the backend a job uses for CUDA tensors,
the engine asked for a device this machine lacks). The paths themselves run in the GPU device
check (scripts/device-check.sh collective)."""

from __future__ import annotations

import pytest
from conftest import ROOT, needs_torch  # noqa: F401  (puts the package on sys.path)

torch = needs_torch()

import ciera
from ciera import _ext
from ciera.fsdp import transport


def test_a_transport_of_the_other_memory_is_refused_in_one_line():
    with pytest.raises(_ext.ConfigError, match="transport 'nccl' moves device memory: the model must be on a CUDA device"):
        transport.make_transport("nccl", None, 30.0, torch.device("cpu"))
    with pytest.raises(_ext.ConfigError, match="transport 'mpi' moves host memory; for a CUDA model use 'torch' or 'nccl'"):
        transport.make_transport("mpi", None, 30.0, torch.device("cuda", 0))
    with pytest.raises(_ext.ConfigError, match="unknown transport 'gloo'"):
        transport.make_transport("gloo", None, 30.0, torch.device("cpu"))


@pytest.mark.parametrize("backend,expected", [
    ("cpu:gloo,cuda:nccl", "nccl"),   # ciera train's group where ranks have GPUs of their own
    ("cpu:gloo,cuda:gloo", "gloo"),   # ranks sharing a GPU with an NCCL that refuses it
    ("nccl", "nccl"),
    ("gloo", "gloo"),
])
def test_the_torch_transport_follows_the_jobs_cuda_backend(monkeypatch, backend, expected):
    monkeypatch.setattr(transport.dist, "get_backend", lambda group=None: backend)
    assert transport._cuda_backend(None) == expected


def test_an_engine_on_a_missing_device_is_a_config_error_naming_it():
    layout = ciera.BucketLayout.fsdp_split("b", ciera.DType.bf16, [100], 1)
    loopback = ciera.loopback_transport(ciera.loopback_world(1), 0)
    with pytest.raises(ciera.ConfigError) as raised:
        ciera.Engine(loopback, ciera.EngineConfig(), [layout], device=0)
    text = str(raised.value)
    # Without the CUDA backend in this build, or without a usable device 0.
    assert "device 0" in text or "no CUDA backend" in text, text
    assert "\n" not in text


def test_the_host_engine_takes_no_stream():
    layout = ciera.BucketLayout.fsdp_split("b", ciera.DType.bf16, [100], 1)
    engine = ciera.Engine(ciera.loopback_transport(ciera.loopback_world(1), 0), ciera.EngineConfig(), [layout])
    data = torch.zeros(100, dtype=torch.bfloat16)
    out = torch.empty(100, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="host codec backend has no streams"):
        engine.run(0, data.data_ptr(), 200, out.data_ptr(), 200, 0x1234)
    engine.run(0, data.data_ptr(), 200, out.data_ptr(), 200)
    assert engine.backend == "host"
    engine.close()
