"""A run on one machine listens on loopback only: the launcher's, rank 0's and spawn's stores.

torch's ``TCPStore`` server listens on every interface whatever host it is given, and
its protocol has no authentication. The tests look at what the run's processes
actually listen on, from ``/proc/net/tcp{,6}`` (Linux), while the run holds.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pardist.launch._spawn import Workers
from pardist.runtime._listen import bind_address

ROOT = Path(__file__).parents[1]
pytestmark = pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads /proc/net/tcp")


def _tree(root: int) -> set[int]:
    """``root`` and every process below it."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    tree, grew = {root}, True
    while grew:
        below = {pid for pid, ppid in parents.items() if ppid in tree} - tree
        tree |= below
        grew = bool(below)
    return tree


def _listening(pids: set[int]) -> list[str]:
    """The local addresses ``pids`` listen on, as 'address:port'."""
    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.read().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                    hex_address, hex_port = fields[1].split(":")
                    raw = bytes.fromhex(hex_address)
                    # the kernel prints each 32-bit word in host (little-endian) order
                    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
                    found.append(f"{ipaddress.ip_address(words)}:{int(hex_port, 16)}")
    return sorted(found)


def _is_loopback(entry: str) -> bool:
    address = ipaddress.ip_address(entry.rsplit(":", 1)[0])
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


def test_the_proc_reader_sees_every_interface_and_loopback():
    """The reader itself: a socket on every interface is seen as such (so the tests can fail)."""
    with socket.socket() as anywhere, socket.socket() as local:
        anywhere.bind(("0.0.0.0", 0))
        anywhere.listen()
        local.bind(("127.0.0.1", 0))
        local.listen()
        seen = _listening({os.getpid()})
        assert f"0.0.0.0:{anywhere.getsockname()[1]}" in seen
        assert f"127.0.0.1:{local.getsockname()[1]}" in seen
        assert not _is_loopback(f"0.0.0.0:{anywhere.getsockname()[1]}")


def test_the_address_a_store_listens_on():
    assert bind_address("localhost", single_node=False) == "127.0.0.1"
    assert bind_address("127.0.0.1", single_node=False) == "127.0.0.1"
    assert bind_address("[::1]", single_node=True) == "::1"
    assert bind_address("192.0.2.7", single_node=False) is None  # not this machine: torch's
    assert bind_address("no-such-host.invalid", single_node=True) is None


def _launch_and_look(tmp_path: Path, options: list[str]) -> tuple[list[str], str]:
    env = {**os.environ, "PARDIST_DEVICE": "cpu"}
    command = [sys.executable, "-m", "pardist.launch", "--nproc", "2", *options]
    proc = subprocess.Popen(
        [*command, "tests/scripts/hold.py", str(tmp_path)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 240
        while not all((tmp_path / f"ready{r}").exists() for r in (0, 1)):
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the ranks did not start within 240 s"
            time.sleep(0.1)
        seen = _listening(_tree(proc.pid))
    finally:
        (tmp_path / "go").touch()
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    return seen, out


@pytest.mark.timeout(400)
def test_launch_on_one_machine_listens_on_loopback_only(tmp_path):
    seen, out = _launch_and_look(tmp_path, [])
    # the rendezvous store (launcher) and rank 0's store for the process group
    assert len(seen) >= 2, seen
    assert all(_is_loopback(entry) for entry in seen), seen
    assert "rank 0 MASTER_ADDR 127.0.0.1 GLOO lo" in out  # gloo: its own listeners


@pytest.mark.timeout(400)
def test_launch_with_a_master_port_listens_on_loopback_only(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    seen, _ = _launch_and_look(tmp_path, ["--master-port", str(port)])
    assert seen and all(_is_loopback(entry) for entry in seen), seen
    assert any(entry.endswith(f":{port}") for entry in seen), seen


@pytest.mark.timeout(120)
def test_spawn_listens_on_loopback_only():
    with Workers(2) as workers:
        seen = _listening(_tree(os.getpid()))
        assert any(entry.endswith(f":{workers.port}") for entry in seen), seen
        assert all(_is_loopback(entry) for entry in seen), seen
