"""Two "nodes" on one machine: network namespaces joined by a veth pair, its rate limited.

    python benchmarks/twonodes.py --rate 500 --probe    # checks the set-up: MB/s across the link

A helper for benchmarks/calibrate.py and benchmarks/diloco.py, as tests/test_multinode.py
builds it (root and iproute2's ``ip`` and ``tc``). Each node is a namespace with one end
of the veth; ``tc qdisc ... tbf`` limits the rate of each end (each direction). This
kernel has no ``netem``, so latency cannot be added: the models add it on paper
(benchmarks/scaling.py). Ranks are plain processes started with torchrun's variables
(node-major: ranks ``g*node .. g*node+g-1`` on a node), gloo bound to the veth; between
the ranks of one node pardist uses shared memory, as on a real host (its host identity
includes the network namespace). ``run`` starts ``fn(**kwargs)`` of a benchmark module on
every rank and returns rank 0's JSON result. Namespaces and processes are removed on exit.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TAG = "RESULT "


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=10)


class TwoNodes:
    """``with TwoNodes(rate_mbit) as nodes: nodes.run(...)``."""

    def __init__(self, rate_mbit: float | None = None):
        tag = os.getpid() % 10000
        self.names = (f"pdbench{tag}a", f"pdbench{tag}b")
        self.ifaces = (f"pdb{tag}a", f"pdb{tag}b")
        net = f"10.{150 + tag % 50}.{tag // 50 % 250}"
        self.addrs = (f"{net}.1", f"{net}.2")
        self.rate = rate_mbit
        self.port = 29600

    def __enter__(self) -> TwoNodes:
        try:
            for name in self.names:
                _ip("netns", "add", name)
            _ip("link", "add", self.ifaces[0], "type", "veth", "peer", "name", self.ifaces[1])
            for name, iface, addr in zip(self.names, self.ifaces, self.addrs):
                _ip("link", "set", iface, "netns", name)
                _ip("-n", name, "addr", "add", f"{addr}/24", "dev", iface)
                _ip("-n", name, "link", "set", iface, "up")
                _ip("-n", name, "link", "set", "lo", "up")
                if self.rate:  # a token bucket: the burst is a few ms of traffic at the rate
                    burst = max(64 * 1024, int(self.rate * 1e6 / 8 * 0.004))
                    cmd = ["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", iface]
                    cmd += ["root", "tbf", "rate", f"{self.rate}mbit", "burst", str(burst)]
                    subprocess.run([*cmd, "latency", "200ms"], check=True, timeout=10)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for name in self.names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)

    def run(self, module: str, fn: str, kwargs: dict, per_node: int, timeout: float = 600):
        """``module.fn(**kwargs)`` on ``2 * per_node`` ranks; rank 0's returned dict."""
        self.port += 1  # a fresh store port per run: the last one may linger in TIME_WAIT
        world, procs = 2 * per_node, []
        for rank in range(world):
            node = rank // per_node
            env = {
                **os.environ,
                "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank % per_node),
                "LOCAL_WORLD_SIZE": str(per_node), "GROUP_RANK": str(node),
                "MASTER_ADDR": self.addrs[0], "MASTER_PORT": str(self.port),
                "GLOO_SOCKET_IFNAME": self.ifaces[node], "PARDIST_TIMEOUT": "300",
                "PARDIST_BENCH_IFACE": self.ifaces[node], "OMP_NUM_THREADS": "1",
            }  # fmt: skip
            cmd = ["ip", "netns", "exec", self.names[node], sys.executable, __file__]
            cmd += ["--worker", module, fn, json.dumps(kwargs)]
            out = subprocess.PIPE if rank == 0 else subprocess.DEVNULL
            procs.append(subprocess.Popen(cmd, cwd=HERE, env=env, stdout=out, text=True))
        try:
            text, _ = procs[0].communicate(timeout=timeout)
            codes = [p.wait(timeout=60) for p in procs]
        finally:
            for p in procs:  # only the processes this run started
                if p.poll() is None:
                    p.kill()
                    p.wait()
        if any(codes):
            raise RuntimeError(f"{module}.{fn} failed on the two nodes: exit codes {codes}")
        line = [ln for ln in text.splitlines() if ln.startswith(TAG)][-1]
        return json.loads(line[len(TAG) :])


def link_bytes() -> int:
    """Bytes this node has sent over the veth so far (0 outside the namespaces)."""
    iface = os.environ.get("PARDIST_BENCH_IFACE")
    if not iface:
        return 0
    return int(Path(f"/sys/class/net/{iface}/statistics/tx_bytes").read_text())


def crossed(start: list[int] | None = None) -> list[int] | int:
    """Every node's bytes sent so far (call on every rank; one reading per node);
    with ``start`` (an earlier result), the bytes that crossed between nodes since."""
    import torch.distributed as dist

    import pardist

    mine = link_bytes() if pardist.local_rank() == 0 else 0
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return every if start is None else sum(every) - sum(start)


def _probe(mb: int = 64) -> dict:
    """Rate across the link: rank 0 sends ``mb`` MB to rank 1 (torch point-to-point)."""
    import torch
    import torch.distributed as dist

    buf = torch.zeros(mb * 2**18)
    dist.barrier()
    t = time.perf_counter()
    dist.send(buf, 1) if dist.get_rank() == 0 else dist.recv(buf, 0)
    dist.barrier()
    return {"MB/s": mb / (time.perf_counter() - t)}


def _worker(module: str, fn: str, kwargs: str) -> None:
    import importlib

    import torch

    import pardist

    torch.set_num_threads(1)
    pardist.init()
    out = getattr(importlib.import_module(module), fn)(**json.loads(kwargs))
    if pardist.rank() == 0:
        print(TAG + json.dumps(out), flush=True)
    pardist.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--rate", type=float, default=None, help="Mbit/s per direction")
    parser.add_argument("--probe", action="store_true")
    args = parser.parse_args()
    if args.worker:
        sys.path.insert(0, str(HERE))
        return _worker(*args.worker)
    with TwoNodes(args.rate) as nodes:
        print(nodes.run("twonodes", "_probe", {}, 1))


if __name__ == "__main__":
    main()
