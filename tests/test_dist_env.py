"""Launcher discovery and rank 0's address."""

import ipaddress

import pytest

from vit.core.errors import ConfigError
from vit.runtime.dist_env import choose_master_addr, discover


def test_discover_launchers():
    assert discover({}).launcher == "single"
    ompi = {
        "OMPI_COMM_WORLD_RANK": "3",
        "OMPI_COMM_WORLD_SIZE": "5",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    }
    d = discover(ompi)
    assert (d.rank, d.world_size, d.local_rank, d.local_world_size, d.launcher) == (
        3,
        5,
        1,
        2,
        "Open MPI",
    )
    # mpirun inside a Slurm allocation: the Slurm variables belong to the launcher's daemon, MPI
    # wins.
    assert discover({**ompi, "SLURM_PROCID": "0", "SLURM_NTASKS": "2"}).rank == 3
    d = discover(
        {
            "SLURM_PROCID": "2",
            "SLURM_NTASKS": "4",
            "SLURM_LOCALID": "0",
            "SLURM_NTASKS_PER_NODE": "2(x2)",
        }
    )
    assert (d.rank, d.world_size, d.local_world_size) == (2, 4, 2)
    assert (
        discover({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1"}).launcher == "MPICH/PMI"
    )
    with pytest.raises(
        ConfigError, match="launcher variables disagree: torchrun says rank 0 of 2; Open MPI says"
    ):
        discover({"RANK": "0", "WORLD_SIZE": "2", **ompi})
    with pytest.raises(ConfigError, match="outside world size"):
        discover({"RANK": "4", "WORLD_SIZE": "2"})


def iface(addr):
    return ("eth0", ipaddress.IPv4Interface(addr))


def test_master_address_is_the_one_every_host_reaches():
    one_host = [("a", [iface("10.0.0.1/24")]), ("a", [iface("10.0.0.1/24")])]
    assert choose_master_addr(one_host, None) == "127.0.0.1"
    hosts = [
        ("a", [("docker0", ipaddress.IPv4Interface("172.17.0.1/16")), iface("192.168.5.10/24")]),
        ("b", [iface("192.168.5.11/24")]),
        ("c", [iface("192.168.5.12/24")]),
    ]
    assert choose_master_addr(hosts, None) == "192.168.5.10"
    assert choose_master_addr(hosts, "docker0") == "172.17.0.1"
    with pytest.raises(ConfigError, match="no IPv4 address on interface ib0"):
        choose_master_addr(hosts, "ib0")
    with pytest.raises(ConfigError, match="shares no subnet"):
        choose_master_addr([hosts[0], ("d", [iface("10.9.9.9/24")])], None)


def test_gloo_and_nccl_use_the_interface_that_reaches_rank_0(monkeypatch):
    """A host with a libvirt bridge, a VPN and the cluster's network (psutil's answer faked: the
    outer boundary)."""
    from vit.runtime import dist_env

    mine = [
        ("virbr0", ipaddress.IPv4Interface("192.168.122.1/24")),
        ("tun0", ipaddress.IPv4Interface("10.8.0.6/24")),
        ("enp3s0", ipaddress.IPv4Interface("192.168.5.12/24")),
    ]
    monkeypatch.setattr(dist_env, "ipv4_interfaces", lambda: mine)
    env = {}
    assert dist_env.pin_interface("192.168.5.10", env) == "enp3s0"
    assert env == {"GLOO_SOCKET_IFNAME": "enp3s0", "NCCL_SOCKET_IFNAME": "enp3s0"}
    env = {"NCCL_SOCKET_IFNAME": "eth1"}  # IFACE (or the user) said: left alone
    assert dist_env.pin_interface("192.168.5.10", env) is None and env == {
        "NCCL_SOCKET_IFNAME": "eth1"
    }
    env = {}
    # one host: nothing to choose
    assert dist_env.pin_interface("127.0.0.1", env) is None and env == {}
    # routed: no interface on its subnet
    assert dist_env.pin_interface("172.16.0.9", env) is None and env == {}


def test_a_port_in_use_is_one_line_naming_it():
    """MASTER_PORT held by another program: a traceback of torch's EADDRINUSE before, one line
    now (vit.train prints it after "entry_cn.sh: error: " and exits 2)."""
    import socket

    from vit.runtime.dist_env import Job, init_process_group

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        job = Job(0, 1, 0, 1, "single", master_addr="127.0.0.1", master_port=port)
        with pytest.raises(ConfigError) as e:
            init_process_group(job, 5, "cpu", "fp32", None)
    assert f"port {port} (MASTER_PORT) is in use on " in str(e.value), str(e.value)


def test_a_free_port_is_outside_the_ephemeral_range_and_not_random_state(tmp_path):
    """Rank 0's port when MASTER_PORT is not set (and the tests' ranks'): a port the kernel gives
    outgoing connections could be taken by one before rank 0 binds it (two pytest workers hit
    that: "rank 0's port 44291 (MASTER_PORT) is in use"); a seeded `random` would give two test
    workers the same port."""
    import random
    import socket

    from vit.runtime import dist_env

    ephemeral = dist_env.ephemeral_ports()
    draws = []
    for _ in range(2):
        random.seed(0)
        draws.append([dist_env.free_port() for _ in range(3)])
    ports = draws[0] + draws[1]
    assert draws[0] != draws[1] and not any(p in ephemeral for p in ports), ports
    assert dist_env.DEFAULT_PORT not in ports
    with socket.socket() as s:
        s.bind(("", ports[-1]))  # free: nothing listens there
    (tmp_path / "range").write_text("1024\t65535\n")
    assert dist_env.ephemeral_ports(str(tmp_path / "range")) == range(1024, 65536)
