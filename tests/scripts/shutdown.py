"""After pardist.shutdown() no gloo thread may be left, whatever the script still holds.

A gloo group that outlives shutdown is torn down during interpreter exit, where its
worker threads can abort the process or hang it. This script keeps a step (with its
gradient buckets), a mesh and a checkpoint's imports alive across shutdown, and
leaves a torch DDP model in a reference cycle (its reducer holds the group) that
the garbage collector has not reached yet; then it counts threads.
"""

import gc
import os
import tempfile

import torch
from torch import nn

import pardist


def main() -> None:
    pardist.init()
    step = pardist.data_parallel(lambda w, x: pardist.grad(lambda w, x: (x @ w).sum())(w, x))
    grads = step(torch.ones(3), torch.ones(2, 3))
    held = [step, grads, pardist.psum(torch.ones(1), "gpu"), pardist.Mesh({"gpu": -1})]
    folder = pardist.gather_object(tempfile.mkdtemp() if pardist.rank() == 0 else None)[0]
    pardist.checkpoint.save(folder, {"w": grads}, step=1)
    gc.disable()  # the collector may run at any time; here it has not run yet
    ddp = nn.parallel.DistributedDataParallel(nn.Linear(3, 1))
    ddp(torch.ones(2, 3)).sum().backward()
    del ddp  # garbage, but in a cycle: only the collector frees it (and its group)
    pardist.shutdown()  # while everything above is still held
    threads = [
        open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")
    ]
    print(
        f"rank {os.environ.get('RANK')}: gloo threads after shutdown: "
        f"{sum('gloo' in name for name in threads)}",
        flush=True,
    )
    assert len(held) == 4  # held until here


if __name__ == "__main__":
    main()
