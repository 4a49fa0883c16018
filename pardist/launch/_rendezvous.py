"""The launcher's rendezvous stores, listening where the run needs them.

torchrun's ``c10d`` and ``static`` rendezvous create their ``TCPStore`` server with
torch's constructor, which listens on every interface. pardist.launch runs the
same rendezvous with the server made by :func:`pardist.runtime._listen.store_server`:
loopback on one machine, the given address on several (see that module for the
rule). Everything else is torch's: the handlers below are torch's own classes,
only handed a store that listens in the right place.
"""

from __future__ import annotations

import datetime

__all__ = ["register"]

NAMES = {"c10d": "pardist-c10d", "static": "pardist-static"}


def _c10d(params):
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous import RendezvousConnectionError
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
        C10dRendezvousBackend,
    )
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    from pardist.runtime import _listen, matches_machine_hostname

    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=29400)
    told = params.get_as_bool("is_host")
    timeout = datetime.timedelta(seconds=params.get_as_int("read_timeout", 60))
    store = None
    if told or (told is None and matches_machine_hostname(host)):
        try:  # as torch's _create_tcp_store: a guessed host may find another agent hosting
            store = _listen.store_server(
                host, port, single_node=params.max_nodes == 1, timeout=timeout, multi_tenant=True
            )
        except (ValueError, RuntimeError, TimeoutError) as exc:
            if told:
                raise RendezvousConnectionError(
                    "The connection to the C10d store has failed. See inner exception for details."
                ) from exc
    if store is None:
        store = dist.TCPStore(host, port, is_master=False, multi_tenant=True, timeout=timeout)
    # The agents' keys behind the run's secret, as the workers' (runtime._join.secret_keys);
    # the workers do not share this store (TORCH_DISABLE_SHARE_RDZV_TCP_STORE).
    from pardist.runtime import _join

    store = _join.secret_keys(store)

    class Backend(C10dRendezvousBackend):
        name = property(lambda self: NAMES["c10d"])  # what the registry checks

    return create_handler(store, Backend(store, params.run_id), params)


def _static(params):
    from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import (
        StaticTCPRendezvous,
        create_rdzv_handler,
    )

    from pardist.runtime import _listen

    class Static(StaticTCPRendezvous):
        def get_backend(self) -> str:
            return NAMES["static"]

        def next_rendezvous(self):
            if self._store is None and self.rank == 0:
                self._store = _listen.store_server(
                    self.master_addr,
                    self.master_port,
                    single_node=self.world_size == 1,
                    timeout=self.timeout,
                    world_size=self.world_size,
                    multi_tenant=True,
                )
            return super().next_rendezvous()

    torch_ = create_rdzv_handler(params)  # its checks of the parameters, then ours
    seconds = int(torch_.timeout.total_seconds())
    return Static(
        torch_.master_addr,
        torch_.master_port,
        torch_.rank,
        torch_.world_size,
        torch_.run_id,
        seconds,
    )


def register(backend: str) -> str:
    """The name under which pardist's version of torch's ``backend`` is registered."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry as registry

    if backend not in NAMES:
        return backend  # etcd and others: as torch has them
    creator = {"c10d": _c10d, "static": _static}[backend]
    name = NAMES[backend]
    registry.register(name, creator)  # again with the same creator: a no-op
    return name
