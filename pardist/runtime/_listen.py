"""Store servers that listen where the run needs them: loopback on one machine.

A ``TCPStore`` server listens on every interface whatever host it is given (torch
2.4-2.15), and its protocol has no authentication: a one-machine run would let
anyone on the network read and write its rendezvous. pardist binds the listening
socket itself, to the address the run names, and hands it to the store
(``master_listen_fd``):

- a loopback name or address (``localhost``, ``127.0.0.1``, ``::1``) listens there;
- on one machine, a name that resolves to loopback only (``/etc/hosts``' own
  hostname line) listens there too;
- an IP address of this machine listens on that address only (multi-node: the
  address the user gave);
- any other name keeps torch's every-interface socket, because the other nodes
  may reach this one by an address the name does not resolve to here.

gloo listens too, for its connections between ranks, on the address of this
machine's hostname (or ``GLOO_SOCKET_IFNAME``'s): on one machine pardist sets
``GLOO_SOCKET_IFNAME`` to the loopback interface unless the user set it. (NCCL's
bootstrap socket follows ``NCCL_SOCKET_IFNAME``, which pardist leaves to the user.)
"""

from __future__ import annotations

import datetime
import errno
import ipaddress
import os
import socket

import torch.distributed as dist

__all__ = ["bind_address", "gloo_on_loopback", "single_node", "store_server"]


def bind_address(host: str, *, single_node: bool) -> str | None:
    """The one address a server for ``host`` should listen on, or None for every interface."""
    try:
        literal = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        literal = None
    if literal is not None:
        return str(literal) if literal.is_loopback or _is_ours(str(literal)) else None
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return None
    addresses = [info[4][0] for info in infos]
    loopback = [a for a in addresses if ipaddress.ip_address(a.split("%")[0]).is_loopback]
    if loopback and len(loopback) == len(addresses) and (single_node or host == "localhost"):
        return next((a for a in loopback if ":" not in a), loopback[0])  # IPv4 first
    return None


def _is_ours(address: str) -> bool:
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((address, 0))
        return True
    except OSError:
        return False


def store_server(
    host: str, port: int, *, single_node: bool, timeout: datetime.timedelta, **kwargs
) -> dist.TCPStore:
    """A ``TCPStore`` server for ``host:port`` listening on :func:`bind_address` only.

    ``port=0`` lets the OS pick (read it from ``.port``). When the address cannot be
    bound here (the port is taken: perhaps by a store of this very process, which a
    ``multi_tenant`` store shares), torch's own constructor takes over, so that its
    sharing and its error messages stay as they are.
    """
    address = bind_address(host, single_node=single_node)
    if address is None:
        return dist.TCPStore(host, port, is_master=True, timeout=timeout, **kwargs)
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's own socket
        sock.bind((address, port))
        sock.listen(socket.SOMAXCONN)
    except OSError as exc:
        sock.close()
        if exc.errno != errno.EADDRINUSE:
            raise
        return dist.TCPStore(host, port, is_master=True, timeout=timeout, **kwargs)
    bound_port = sock.getsockname()[1]
    fd = sock.detach()  # the store owns the socket from here, and closes it
    return dist.TCPStore(
        address, bound_port, is_master=True, timeout=timeout, master_listen_fd=fd, **kwargs
    )


def single_node() -> bool:
    """Whether every rank of this run is on this machine (a process group of one included)."""
    if "WORLD_SIZE" not in os.environ:
        return True
    return os.environ.get("LOCAL_WORLD_SIZE") == os.environ["WORLD_SIZE"]


def gloo_on_loopback() -> None:
    """On one machine, gloo's listening sockets on the loopback interface (unless set)."""
    if "GLOO_SOCKET_IFNAME" in os.environ or not single_node():
        return
    try:
        names = {name for _, name in socket.if_nameindex()}
    except OSError:  # no interface list on this platform: gloo's own choice
        return
    for name in ("lo", "lo0"):  # Linux, macOS / BSD
        if name in names:
            os.environ["GLOO_SOCKET_IFNAME"] = name
            return
