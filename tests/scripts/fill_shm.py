"""Fill /dev/shm in the middle of a run: training goes on, or stops with a clear error; no SIGBUS.

Run it inside a private 64 MB tmpfs on /dev/shm (tests/test_fault_matrix.py mounts one
with ``unshare -m``), as a small container's /dev/shm would be:

    python -m pardist.launch --nproc 2 fill_shm.py

The collectives' segment is made early and barely used; then rank 0 fills /dev/shm,
a 3 MiB psum writes pages of that segment nobody has touched yet, and a new
training step asks for a gradient segment that no longer fits.
"""

from __future__ import annotations

import errno
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for helpers

import helpers  # noqa: E402

import pardist  # noqa: E402


def fill(path: str) -> int:
    """Write ``path`` until the file system is full; return the bytes written."""
    chunk, written = bytes(2**20), 0
    with open(path, "wb", buffering=0) as f:
        while True:
            try:
                written += f.write(chunk)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                return written


def plain_torch(steps: int) -> dict:
    """One process on the whole batch, with torch's own AdamW: the reference."""
    model = helpers.mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for s in range(steps):
        x, y = helpers.global_batch(s, "mlp")
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return dict(model.named_parameters())


def main() -> None:
    pardist.init()
    rank = pardist.rank()
    pardist.psum(torch.ones(4), "gpu")  # the collectives' segment: made, one page touched
    if rank == 0:
        print(f"filled /dev/shm with {fill('/dev/shm/filler') / 2**20:.0f} MiB", flush=True)
    dist.barrier()
    n = 3 * 2**18  # 3 MiB of float32: pages of the segment that nobody has touched yet
    total = pardist.psum(torch.arange(n, dtype=torch.float32) * (rank + 1), "gpu")
    assert torch.equal(total, torch.arange(n, dtype=torch.float32) * 3), "psum is wrong"
    params, _, _, _ = helpers.train_pardist("mlp", "adamw", steps=3)  # a new gradient segment
    reference = plain_torch(3)
    for k, v in reference.items():
        torch.testing.assert_close(params[k], v.detach(), rtol=1e-5, atol=1e-6)
    print(f"rank {rank}: trained on with /dev/shm full; equals one process", flush=True)
    pardist.shutdown()


if __name__ == "__main__":
    main()
