"""Placement and step randomness on CUDA (world size 1): run by tests/test_devices.py.

    python tests/scripts/cuda_placement.py

Prints one ``name value`` line per check.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import pardist


def main() -> None:
    pardist.init()
    pardist.seed_everything(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 2))  # built on the CPU
    apply, params, buffers = pardist.functional(net)
    print("params", sorted({str(t.device) for t in params.values()}))
    data = TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,)))
    loader = pardist.data.shard(DataLoader(data, batch_size=8))
    print("pinned", loader._inner.pin_memory)
    masks = []

    @pardist.data_parallel
    def step(p, batch):
        masks.append(F.dropout(torch.ones(64, device=pardist.device()), 0.5) != 0)
        x, y = batch
        return pardist.grad(lambda p: F.cross_entropy(apply(p, buffers, x)[0], y))(p)

    devices = set()
    before = torch.cuda.get_rng_state()
    for batch in loader:
        devices |= {str(t.device) for t in batch}
        grads = step(params, batch)
    print("batches", sorted(devices))
    print("grads", sorted({str(t.device) for t in grads.values()}))
    print("cuda_rng_restored", torch.equal(before, torch.cuda.get_rng_state()))
    print("masks_differ", not torch.equal(masks[0], masks[1]))
    pardist.set_rng_count(1)
    step(params, batch)
    print("replayed", torch.equal(masks[-1], masks[1]))
    fresh = pardist.data_parallel(lambda p, b: p)  # its first call checks the devices
    try:
        fresh(params, [t.cpu() for t in batch])
        print("error", False)
    except ValueError as e:
        print("error", "is on cpu, but" in str(e) and "cuda:0" in str(e))
    pardist.shutdown()


if __name__ == "__main__":
    main()
