"""Where a torch.distributed group meets: at its rank 0's node, on a port that rank holds.

The training group, the critic group and the weight-update group between training rank 0
and the engines each have a rank 0 that hosts the group's TCPStore. That rank picks the
address on its own node (:func:`rendezvous_host`): loopback when every member runs on that
node; else the node's address on the interface ``GLOO_SOCKET_IFNAME`` (or
``NCCL_SOCKET_IFNAME``) names, as the nodes' own environment sets them; else the node IP
Ray knows. Never the driver's, which may not even hold a rank. The store listens on a
socket bound to that address only (:func:`listening_store`: torch's own store binds every
interface) and holds the port from the moment rank 0 reports it, so nothing can take it
between its choice and its use.

    host, port = ray.get(rank0.open_rendezvous.remote(spans_nodes))  # on rank 0's node
    ray.get([w.join.remote(host, port) for w in workers])            # every rank
"""

import os
import socket
from datetime import timedelta

LOOPBACK = "127.0.0.1"
# NCCL's exclusion lists (^docker,lo) name where not to go, so they pick no address here
INTERFACE_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
TIMEOUT_S = 600.0  # rl-fsdp's process-group timeout
_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address


def interface_address(name: str, *, prefix: bool = False) -> str | None:
    """IPv4 address of the interface ``name`` of this machine (with ``prefix``, of the
    first interface whose name starts with it, NCCL's rule); None when there is none."""
    names = [n for _, n in socket.if_nameindex() if n.startswith(name)] if prefix else [name]
    for candidate in names:
        if (address := _ipv4_of(candidate)) is not None:
            return address
    return None


def _ipv4_of(name: str) -> str | None:
    import fcntl
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            request = struct.pack("256s", name.encode()[:15])
            return socket.inet_ntoa(fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, request)[20:24])
        except OSError:  # no such interface, or no IPv4 address on it
            return None


def named_interface(env) -> tuple[str, str, bool] | None:
    """``(variable, interface, prefix)`` from the first of :data:`INTERFACE_VARIABLES` set
    in ``env`` that names interfaces (the first of a comma-separated list); None if none.
    NCCL reads a bare name as a prefix and ``=name`` as exact; gloo reads exact names."""
    for variable in INTERFACE_VARIABLES:
        value = env.get(variable, "").strip()
        if not value or value.startswith("^"):
            continue
        first = value.split(",")[0].strip()
        nccl = variable.startswith("NCCL")
        return variable, first.removeprefix("="), nccl and not first.startswith("=")
    return None


def node_address(env=None) -> str:
    """This node's address for other nodes: the interface the environment names, else
    Ray's node IP; ValueError naming the variable when the interface has no IPv4 address."""
    env = os.environ if env is None else env
    named = named_interface(env)
    if named is None:
        import ray

        return ray.util.get_node_ip_address()
    variable, name, prefix = named
    address = interface_address(name, prefix=prefix)
    if address is None:
        raise ValueError(
            f"{variable}={env[variable]!r}: node {socket.gethostname()} has no IPv4 address "
            f"on {'an interface starting with ' if prefix else 'interface '}{name!r}; set it "
            "on every node to the interface of the network the nodes share (`ip -4 addr` "
            "lists them), or unset it to use the address Ray knows"
        )
    return address


def rendezvous_host(spans_nodes: bool) -> str:
    """Where a group's rank 0 listens: loopback when the group is on one node."""
    return node_address() if spans_nodes else LOOPBACK


def listening_store(host: str, world_size: int, timeout_s: float = TIMEOUT_S):
    """A master TCPStore listening on ``host`` only, on a port free there (``.port``);
    it does not wait for the other ranks."""
    from torch.distributed import TCPStore

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.create_server((host, 0), family=family) as sock:
        store = TCPStore(
            host,
            sock.getsockname()[1],
            world_size,
            True,
            timeout=timedelta(seconds=timeout_s),
            wait_for_workers=False,
            master_listen_fd=sock.fileno(),
        )
        sock.detach()  # the store owns the descriptor now (and closes it)
    return store


def join_default_group(
    *,
    device: str,
    rank: int,
    world_size: int,
    host: str,
    port: int,
    store=None,
    timeout_s: float = TIMEOUT_S,
) -> None:
    """Join the default process group (gloo on CPU; nccl and gloo on CUDA, as rl-fsdp
    asks) through the store at ``host:port``; rank 0 passes its :func:`listening_store`.
    The backends' ``init_distributed`` then finds the group and keeps it."""
    import torch.distributed as dist
    from torch.distributed import TCPStore

    timeout = timedelta(seconds=timeout_s)
    if store is None:
        store = TCPStore(host, port, world_size, False, timeout=timeout)
    backend = "cpu:gloo,cuda:nccl" if device == "cuda" else "gloo"
    dist.init_process_group(
        backend=backend, store=store, rank=rank, world_size=world_size, timeout=timeout
    )


class GroupMember:
    """A rank of a group that meets at its rank 0 (mixed into the training and critic
    actors): rank 0's :meth:`open_rendezvous`, then every rank's ``join(host, port)``,
    which calls :meth:`join_group` before building what it runs."""

    rank: int
    world_size: int
    _store = None

    def open_rendezvous(self, spans_nodes: bool) -> tuple[str, int]:
        """Rank 0: the address the group meets at, its store already listening there."""
        assert self.rank == 0, "only rank 0 hosts the group's store"
        host = rendezvous_host(spans_nodes)
        self._store = listening_store(host, self.world_size)
        return host, self._store.port

    def join_group(self, device: str, host: str, port: int) -> None:
        join_default_group(
            device=device,
            rank=self.rank,
            world_size=self.world_size,
            host=host,
            port=port,
            store=self._store,
        )


def meet(workers: list, *, spans_nodes: bool, join_args: tuple = ()) -> tuple[str, int]:
    """Start a group of :class:`GroupMember` actors (``workers[r]`` is rank r): rank 0
    opens the rendezvous, then every rank's ``join(host, port, *join_args)`` runs at
    once. Returns ``(host, port)``."""
    host, port = _get(workers[0].open_rendezvous.remote(spans_nodes))
    _get([worker.join.remote(host, port, *join_args) for worker in workers])
    return host, port


def _get(refs):
    """``ray.get``; a ValueError raised in an actor (an interface variable naming no
    address on its node) comes back as itself: one line for ``rl-train`` to print."""
    import ray

    try:
        return ray.get(refs)
    except ray.exceptions.RayTaskError as error:
        if isinstance(error.cause, ValueError):
            raise error.cause from None
        raise


def spans_nodes(placement, slots) -> bool:
    """Whether the placement slots ``slots`` lie on more than one node."""
    return len({placement.node_ids[slot] for slot in slots}) > 1
