"""qatlib.device: the per-rank device / backend decisions, for the machines a run meets (decided
from the environment and what CUDA reports, so every case is checked on a CPU machine)."""

from __future__ import annotations

import pytest
import torch

from qatlib import device

pytestmark = pytest.mark.device_aware


def test_cpu_machine_uses_gloo_on_the_cpu_for_every_rank():
    for local in range(4):
        rd = device.resolve(
            {"LOCAL_RANK": str(local), "RANK": str(local + 4), "WORLD_SIZE": "8"}, cuda_available=False
        )
        assert rd.device == torch.device("cpu")
        assert rd.backend == "gloo"
        assert (rd.rank, rd.local_rank, rd.world_size) == (local + 4, local, 8)


def test_each_rank_of_an_8_gpu_node_owns_the_gpu_of_its_local_rank():
    # node 1 of a 2 x 8 job: global ranks 8..15, local ranks 0..7
    got = [
        device.resolve(
            {"LOCAL_RANK": str(lr), "RANK": str(8 + lr), "WORLD_SIZE": "16"}, cuda_available=True, n_gpus=8
        )
        for lr in range(8)
    ]
    assert [rd.device for rd in got] == [torch.device("cuda", i) for i in range(8)]
    assert {rd.backend for rd in got} == {"nccl"}
    assert [rd.rank for rd in got] == list(range(8, 16))


def test_plain_process_without_launcher_env_is_rank_0_of_1():
    rd = device.resolve({}, cuda_available=True, n_gpus=1)
    assert (rd.rank, rd.local_rank, rd.world_size, rd.device, rd.backend) == (
        0,
        0,
        1,
        torch.device("cuda", 0),
        "nccl",
    )


def test_more_local_ranks_than_gpus_is_an_error_naming_both():
    with pytest.raises(device.DeviceError, match=r"LOCAL_RANK=2 .* 2 visible GPU"):
        device.resolve({"LOCAL_RANK": "2"}, cuda_available=True, n_gpus=2)


def test_forced_cpu_on_a_gpu_machine_and_bad_values():
    rd = device.resolve({"QATLIB_DEVICE": "cpu", "LOCAL_RANK": "1"}, cuda_available=True, n_gpus=8)
    assert (rd.device, rd.backend) == (torch.device("cpu"), "gloo")
    with pytest.raises(device.DeviceError, match="QATLIB_DEVICE='tpu'"):
        device.resolve({"QATLIB_DEVICE": "tpu"}, cuda_available=False)
    with pytest.raises(device.DeviceError, match="no CUDA device"):
        device.resolve({"QATLIB_DEVICE": "cuda"}, cuda_available=False)
    with pytest.raises(device.DeviceError, match="LOCAL_RANK='x'"):
        device.resolve({"LOCAL_RANK": "x"}, cuda_available=False)


def test_this_machine_and_autocast():
    rd = device.bind()
    assert rd.device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert device.use_cpu() is (not torch.cuda.is_available())
    # no process group: collectives (none) would use the CPU
    assert device.collective_device() == torch.device("cpu")
    with device.autocast("cpu"):  # the CPU path keeps fp32 numerics
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32
    if torch.cuda.is_available():
        with device.autocast("cuda"):
            a = torch.ones(2, 2, device="cuda")
            assert (a @ a).dtype == torch.bfloat16


def test_single_process_stages_device_map(monkeypatch):
    """PTQ / evaluation load with accelerate's map on the CUDA path and plain CPU tensors on the
    CPU path, also on a GPU machine forced to the CPU (the stages used torch.cuda.is_available())."""
    monkeypatch.setenv(device.FORCE_ENV, "cpu")
    assert device.device_map() is None and device.device_map({"": 0}) is None
    monkeypatch.delenv(device.FORCE_ENV)
    if torch.cuda.is_available():
        assert device.device_map() == "auto" and device.device_map({"": 0}) == {"": 0}
    else:
        assert device.device_map("auto") is None


def test_whole_model_on_one_device_when_it_fits():
    """An evaluation reads the whole model onto its device (qatlib's reader) when it fits: always
    on the CPU path; on CUDA when the free memory holds 1.2 x the model (on a GPU machine: 1 byte
    fits, 1 PB does not, and the reported free memory decides at the 1.2 margin)."""
    if not torch.cuda.is_available():
        assert device.fits_current(1) and device.fits_current(10**15)
        return
    assert device.fits_current(1) and not device.fits_current(10**15)
    assert device.fits_current(1000, free_bytes=1200) and not device.fits_current(1001, free_bytes=1200)
