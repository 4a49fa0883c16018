"""Checking a rendezvous port before a launcher trusts it.

torch's rendezvous clients hang when the port they are given belongs to another
program: a ``TCPStore`` client connects, sends its handshake, and waits for an
answer that never comes, whatever its timeout (seen here: over 500 s, torch
2.13). So before launching, pardist looks at the port: nothing there is fine
(this node will host the store, or the host is not up yet); a torch store there
is fine (another node, or another agent on this machine, hosts it); anything
else is an error that says what to do, raised in seconds.
"""

from __future__ import annotations

import datetime
import errno
import socket
import threading

import torch.distributed as dist

__all__ = ["PortInUseError", "check_endpoint", "is_local_address", "listening", "port_owner"]

PROBE_TIMEOUT_S = 3.0


class PortInUseError(RuntimeError):
    """A port that pardist was told to use belongs to another program."""


def listening(host: str, port: int, timeout: float) -> bool:
    """Whether something accepts TCP connections at ``host:port``."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:  # refused, unreachable, not resolvable yet: nothing to object to
        return False


def _answers_as_store(host: str, port: int, timeout: float) -> bool:
    """Whether the listener at ``host:port`` completes a TCPStore handshake in time.

    The client is torch's own, run in a daemon thread because it does not time out
    against a listener that never answers; it releases the GIL while it waits.
    """
    outcome: list[bool] = []

    def probe() -> None:
        try:
            dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout))
            outcome.append(True)
        except Exception:  # noqa: BLE001 - any failure means "not a store that answers"
            outcome.append(False)

    thread = threading.Thread(target=probe, daemon=True, name="pardist-port-probe")
    thread.start()
    thread.join(timeout)
    return bool(outcome and outcome[0])


def is_local_address(host: str) -> bool:
    """Whether ``host`` names an address of this machine (or network namespace)."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, kind, proto, _, address in infos:
        try:
            with socket.socket(family, kind, proto) as s:
                s.bind((address[0], 0))
                return True
        except OSError:
            continue
    return False


def port_owner(host: str, port: int, *, timeout: float = PROBE_TIMEOUT_S) -> str:
    """Who holds ``host:port``: ``'free'``, ``'store'`` (a torch TCPStore) or ``'other'``."""
    if not listening(host, port, timeout=min(timeout, 2.0)):
        if is_local_address(host) and not _bindable(host, port):
            return "other"  # bound but not accepting (e.g. not yet listening)
        return "free"
    return "store" if _answers_as_store(host, port, timeout) else "other"


def _bindable(host: str, port: int) -> bool:
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
        return True
    except OSError as exc:
        return exc.errno != errno.EADDRINUSE


def check_endpoint(
    host: str,
    port: int,
    *,
    must_host: bool,
    where: str,
    option: str,
    timeout: float = PROBE_TIMEOUT_S,
) -> str:
    """Fail fast if ``host:port`` cannot serve as this job's rendezvous store.

    Args:
        host, port: the endpoint.
        must_host: this process will host the store there, so the port must be free.
        where: the caller's name, for the message.
        option: the option the user gave the port with, for the message.
        timeout: seconds for the handshake probe.

    Returns:
        What holds the port now: ``'free'`` or ``'store'``.

    Raises:
        PortInUseError: naming the port, who holds it, and what to do.
    """
    owner = port_owner(host, port, timeout=timeout)
    if owner == "free" or (owner == "store" and not must_host):
        return owner
    what = (
        "the torch rendezvous store of another job (this node must host its own store, "
        "as a one-machine job or the node given is_host does)"
        if owner == "store"
        else "another program (it does not answer as a torch rendezvous store, and torch's "
        "rendezvous would wait for it forever)"
    )
    raise PortInUseError(
        f"{where}: port {port} on {host} ({option}) is already in use by {what}. "
        f"Pick a free port for {option} (the same on every node), or stop the program "
        f"that holds it (find it with: ss -ltnp 'sport = :{port}'). On a single machine, "
        "leave the port out, or pass --standalone, and a free one is picked for you."
    )
