"""Where groups meet (rl_launcher.infra.rendezvous) and the shared-directory probe
(rl_launcher.infra.shared_dirs), on this machine: interfaces named by the environment, a
store that listens on one address only, a node that does not see the driver's files."""

import datetime
import socket
from pathlib import Path

import pytest

from rl_launcher.infra import rendezvous, shared_dirs


def listening_addresses(port: int) -> list[str]:
    """Local addresses of the LISTEN sockets on ``port`` (IPv4 and IPv6 tables)."""
    found = []
    for table, size in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:
                raw = b"".join(
                    bytes.fromhex(address[i : i + 8])[::-1] for i in range(0, 8 * size // 4, 8)
                )
                family = socket.AF_INET if size == 4 else socket.AF_INET6
                found.append(socket.inet_ntop(family, raw))
    return found


def test_interfaces_named_by_the_environment():
    assert rendezvous.named_interface({}) is None
    assert rendezvous.named_interface({"GLOO_SOCKET_IFNAME": "eth1,eth2"}) == (
        "GLOO_SOCKET_IFNAME",
        "eth1",
        False,
    )
    # gloo's variable wins; NCCL reads a bare name as a prefix, "=name" as exact, "^..." excludes
    both = {"GLOO_SOCKET_IFNAME": "ib0", "NCCL_SOCKET_IFNAME": "eth"}
    assert rendezvous.named_interface(both) == ("GLOO_SOCKET_IFNAME", "ib0", False)
    assert rendezvous.named_interface({"NCCL_SOCKET_IFNAME": "eth"}) == (
        "NCCL_SOCKET_IFNAME",
        "eth",
        True,
    )
    assert rendezvous.named_interface({"NCCL_SOCKET_IFNAME": "=eth0"}) == (
        "NCCL_SOCKET_IFNAME",
        "eth0",
        False,
    )
    assert rendezvous.named_interface({"NCCL_SOCKET_IFNAME": "^docker,lo"}) is None


def test_interface_addresses_of_this_machine():
    assert rendezvous.interface_address("lo") == "127.0.0.1"
    assert rendezvous.interface_address("l", prefix=True) == "127.0.0.1"
    assert rendezvous.interface_address("l") is None  # exact: there is no interface "l"
    assert rendezvous.node_address({"GLOO_SOCKET_IFNAME": "lo"}) == "127.0.0.1"
    assert rendezvous.node_address({"NCCL_SOCKET_IFNAME": "=lo"}) == "127.0.0.1"
    with pytest.raises(
        ValueError, match=r"GLOO_SOCKET_IFNAME='nosuch9': node .* interface 'nosuch9'"
    ):
        rendezvous.node_address({"GLOO_SOCKET_IFNAME": "nosuch9"})
    assert rendezvous.rendezvous_host(spans_nodes=False) == "127.0.0.1"


def test_the_store_listens_on_its_address_only_and_serves_clients():
    from torch.distributed import TCPStore

    store = rendezvous.listening_store("127.0.0.1", world_size=2, timeout_s=30)
    assert listening_addresses(store.port) == ["127.0.0.1"]  # torch's own store: "::"
    client = TCPStore("127.0.0.1", store.port, 2, False, timeout=datetime.timedelta(seconds=30))
    client.set("rank1", "here")
    assert store.get("rank1") == b"here"
    port = store.port
    del client, store  # the store owns the socket: closing it frees the port
    assert listening_addresses(port) == []


def test_probe_sees_the_drivers_file_and_writes_its_own(tmp_path):
    (tmp_path / f"{shared_dirs.PROBE_PREFIX}abc").write_text("abc")
    assert shared_dirs.probe_node(str(tmp_path), "abc", "node1", None) is None
    assert (tmp_path / f"{shared_dirs.PROBE_PREFIX}abc-node1").read_text() == "abc"


def test_probe_on_a_node_without_the_drivers_files(tmp_path):
    # what a node with its own local directory under the same path finds
    why = shared_dirs.probe_node(str(tmp_path), "abc", "node1", None)
    assert why.startswith("No such file or directory") and "abc" in why
    (tmp_path / f"{shared_dirs.PROBE_PREFIX}abc").write_text("an older run's")
    assert shared_dirs.probe_node(str(tmp_path), "abc", "node1", None) == (
        "the driver's probe file holds something else"
    )
    (tmp_path / "config.json").write_text("{}")
    assert shared_dirs.probe_node(str(tmp_path), "0" * 64, "n", "config.json") == (
        "its config.json differs from the driver's"
    )


@pytest.mark.integration
def test_ranks_meet_on_loopback_and_a_bad_interface_is_one_error():
    import ray

    class Member(rendezvous.GroupMember):
        """A rank that joins its group and sums the ranks (gloo, through the rendezvous);
        local to the test so that Ray ships it by value."""

        def __init__(self, rank: int, world_size: int):
            self.rank, self.world_size = rank, world_size

        def join(self, host: str, port: int) -> None:
            self.join_group("cpu", host, port)

        def rank_sum(self) -> int:
            import torch
            import torch.distributed as dist

            total = torch.tensor([self.rank])
            dist.all_reduce(total)
            return int(total)

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        member = ray.remote(num_cpus=0)(Member)
        ranks = [member.remote(rank, 2) for rank in range(2)]
        host, port = rendezvous.meet(ranks, spans_nodes=False)  # one node: loopback
        assert host == "127.0.0.1" and port > 0
        assert ray.get([r.rank_sum.remote() for r in ranks]) == [1, 1]
        # over nodes rank 0 looks up the interface its node's environment names
        env = {"env_vars": {"GLOO_SOCKET_IFNAME": "nosuch9"}}
        lost = [member.options(runtime_env=env).remote(rank, 2) for rank in range(2)]
        with pytest.raises(ValueError, match=r"^GLOO_SOCKET_IFNAME='nosuch9': node "):
            rendezvous.meet(lost, spans_nodes=True)
    finally:
        ray.shutdown()
