"""Device placement: functional and data.shard put tensors on pardist.device(); a step
getting tensors on two devices names the argument and both devices."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

import pardist


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))


def test_functional_places_params_and_buffers():
    _, params, buffers = pardist.functional(_net(), device="meta")
    assert {t.device.type for t in [*params.values(), *buffers.values()]} == {"meta"}
    _, params, buffers = pardist.functional(_net())  # 'auto': pardist.device()
    assert {t.device for t in [*params.values(), *buffers.values()]} == {pardist.device()}
    _, params, _ = pardist.functional(_net().to("meta"))  # 'auto' moves only CPU tensors
    assert {t.device.type for t in params.values()} == {"meta"}
    _, params, _ = pardist.functional(_net(), device=None)
    assert {t.device.type for t in params.values()} == {"cpu"}
    with pytest.raises(ValueError, match=r"pardist.functional\(Sequential\): device='gpu0'"):
        pardist.functional(_net(), device="gpu0")


def _loader():
    data = [(torch.full((2,), float(i)), i) for i in range(8)]
    return DataLoader(data, batch_size=2)


def test_shard_yields_batches_on_the_device():
    batches = list(pardist.data.shard(_loader(), rank=0, world_size=2, device="meta"))
    assert len(batches) == 2
    assert all(x.device.type == "meta" and y.device.type == "meta" for x, y in batches)
    kept = list(pardist.data.shard(_loader(), rank=0, world_size=2, device=None))
    assert all(x.device.type == "cpu" for x, _ in kept)
    assert [x[:, 0].tolist() for x, _ in kept] == [[0.0, 1.0], [2.0, 3.0]]
    auto = list(pardist.data.shard(_loader(), rank=0, world_size=2))
    assert all(x.device == pardist.device() for x, _ in auto)
    with pytest.raises(ValueError, match="device='nowhere'"):
        pardist.data.shard(_loader(), rank=0, world_size=2, device="nowhere")


def test_a_batch_on_another_device_is_an_error(world1):
    @pardist.data_parallel
    def step(p, batch):
        return p["w"] * 2

    params = {"w": torch.ones(3)}
    with pytest.raises(ValueError) as e:
        step(params, (torch.ones(2, 3), torch.ones(2, 3, device="meta")))
    message = str(e.value)
    assert "pardist.data_parallel(step)" in message
    assert "args[1][1] is on meta" in message and "args[0]['w'] is on cpu" in message
    assert "pardist.device()" in message
    # a 0-dimensional tensor on another device is fine (as torch allows for CPU scalars)
    out = step({"w": torch.ones(3), "s": torch.zeros((), device="meta")}, (torch.ones(2, 3),))
    torch.testing.assert_close(out, torch.full((3,), 2.0))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_placement_and_step_randomness_on_cuda():
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parent / "scripts" / "cuda_placement.py"
    env = {k: v for k, v in os.environ.items() if k != "PARDIST_DEVICE"}
    out = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=240
    )
    assert out.returncode == 0, out.stdout + out.stderr
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines() if " " in line)
    assert lines["params"] == "['cuda:0']" and lines["pinned"] == "True", out.stdout
    assert lines["batches"] == "['cuda:0']" and lines["grads"] == "['cuda:0']", out.stdout
    assert lines["cuda_rng_restored"] == "True" and lines["masks_differ"] == "True", out.stdout
    assert lines["replayed"] == "True" and lines["error"] == "True", out.stdout
