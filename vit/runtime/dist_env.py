"""Who am I in the job: rank, world size, local rank and rank 0's address, from whichever launcher
started us (Open MPI, MPICH/PMI, Slurm, torchrun or the DeepSpeed launcher, or none)."""

import gc
import ipaddress
import os
import random
import socket
import sys
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from vit.core.errors import ConfigError
from vit.core.spec import EngineSpec

DEFAULT_PORT = 29500
NCCL_GRACE_S = 30  # NCCL's collective timeout beyond --dist-timeout (init_process_group)

# (launcher, rank, world size, local rank, local world size)
SOURCES = [
    ("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
    (
        "Open MPI",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
    ),
    ("MPICH/PMI", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    ("Slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"),
]
MPI_LAUNCHERS = ("Open MPI", "MPICH/PMI")
IFACE_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


@dataclass
class Job:
    """This process's place in the job, as its launcher tells it."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    launcher: str
    master_addr: str | None = None
    master_port: int | None = None
    device_type: str = "cpu"  # the job's, as every rank agreed in init_process_group

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _int(environ, name):
    v = environ.get(name)
    if v is None:
        return None
    try:
        return int(v.split("(")[0].split(",")[0])  # SLURM_NTASKS_PER_NODE can read "2(x3)"
    except ValueError:
        raise ConfigError(f"environment variable {name}={v!r} is not an integer") from None


def discover(environ=None) -> Job:
    """Rank and world size from the launcher's variables; an error if two launchers disagree."""
    environ = os.environ if environ is None else environ
    found = []
    for launcher, r, w, lr, lw in SOURCES:
        if r not in environ or w not in environ:
            continue
        # mpirun inside a Slurm allocation inherits the Slurm daemon's variables: MPI wins there.
        if launcher == "Slurm" and any(f[0] in MPI_LAUNCHERS for f in found):
            continue
        found.append(
            (
                launcher,
                _int(environ, r),
                _int(environ, w),
                _int(environ, lr) or 0,
                _int(environ, lw),
            )
        )
    if not found:
        return Job(rank=0, world_size=1, local_rank=0, local_world_size=1, launcher="single")
    if len({(f[1], f[2]) for f in found}) > 1:
        seen = "; ".join(f"{f[0]} says rank {f[1]} of {f[2]}" for f in found)
        raise ConfigError(f"launcher variables disagree: {seen} (unset the stale ones)")
    launcher, rank, world, local, local_world = found[0]
    if not 0 <= rank < world:
        raise ConfigError(f"{launcher}: rank {rank} is outside world size {world}")
    return Job(
        rank=rank,
        world_size=world,
        local_rank=local,
        local_world_size=local_world or 1,
        launcher=launcher,
    )


def ipv4_interfaces() -> list[tuple[str, ipaddress.IPv4Interface]]:
    """(name, address/netmask) of this host's non-loopback IPv4 interfaces."""
    import psutil

    out = []
    for name, addrs in psutil.net_if_addrs().items():
        for a in addrs:
            if a.family == socket.AF_INET and a.netmask and not a.address.startswith("127."):
                out.append((name, ipaddress.IPv4Interface(f"{a.address}/{a.netmask}")))
    return out


def choose_master_addr(hosts: list[tuple[str, list]], ifname: str | None) -> str:
    """Rank 0's address that every other host can reach: the one sharing a subnet with all of them.

    `hosts[i]` is rank i's (hostname, ipv4_interfaces()). With one host, loopback.
    """
    host0, ifaces0 = hosts[0]
    if all(h == host0 for h, _ in hosts):
        return "127.0.0.1"
    if ifname:
        for name, iface in ifaces0:
            if name == ifname:
                return str(iface.ip)
        raise ConfigError(
            f"rank 0 ({host0}) has no IPv4 address on interface {ifname} (GLOO_SOCKET_IFNAME)"
        )
    others = [ifaces for h, ifaces in hosts if h != host0]
    for _, iface in ifaces0:
        if all(any(o.ip in iface.network for _, o in ifaces) for ifaces in others):
            return str(iface.ip)
    mine = ", ".join(f"{n}={i}" for n, i in ifaces0) or "none"
    raise ConfigError(
        f"rank 0 ({host0}) shares no subnet with every other host (its addresses: {mine}); "
        "set MASTER_ADDR or the interface (IFACE in setup/cluster.env)"
    )


def interface_toward(addr: str, ifaces: list[tuple[str, ipaddress.IPv4Interface]]) -> str | None:
    """The name of this host's interface on the subnet of `addr` (rank 0's), if it has one."""
    try:
        ip = ipaddress.IPv4Address(socket.gethostbyname(addr))
    except (OSError, ValueError):
        return None
    return (
        None
        if ip.is_loopback
        else next((name for name, iface in ifaces if ip in iface.network), None)
    )


def pin_interface(master_addr: str, environ=None) -> str | None:
    """Without IFACE (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME), gloo and NCCL use the interface that
    reaches rank 0: left to themselves they may pick a bridge (virbr0, docker0) or a VPN and hang.
    Returns the one chosen."""
    environ = os.environ if environ is None else environ
    if any(environ.get(v) for v in IFACE_VARS):
        return None
    name = interface_toward(master_addr, ipv4_interfaces())
    if name:
        environ.update({v: name for v in IFACE_VARS})
    return name


def ephemeral_ports(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> range:
    """The ports the kernel hands to outgoing connections (Linux's default where it does not
    say)."""
    try:
        low, high = map(int, Path(path).read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    return range(low, high + 1)


def free_port() -> int:
    """A port no one listens on, for rank 0 to listen on, outside the ephemeral range: a port of
    that range (what binding port 0 gives) can be taken by any outgoing connection on this host
    before rank 0 binds it, and then the run stops with "in use". Drawn from the system's entropy,
    not `random`'s state, which a seeded process (or two test workers) would repeat."""
    ephemeral = ephemeral_ports()
    ports = [p for p in range(20000, 65536) if p not in ephemeral and p != DEFAULT_PORT]
    for port in random.SystemRandom().sample(ports, min(64, len(ports))):
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    raise ConfigError(
        f"no free port among 64 tried outside the ephemeral range {ephemeral.start}-"
        f"{ephemeral.stop - 1}: set MASTER_PORT"
    )


def resolve_master(job: Job, environ=None) -> Job:
    """Fill in rank 0's address and port; under MPI without MASTER_ADDR, agree on them via
    mpi4py."""
    environ = os.environ if environ is None else environ
    if environ.get("MASTER_ADDR"):
        job.master_addr, job.master_port = (
            environ["MASTER_ADDR"],
            _int(environ, "MASTER_PORT") or DEFAULT_PORT,
        )
    elif job.world_size == 1:
        job.master_addr, job.master_port = "127.0.0.1", _int(environ, "MASTER_PORT") or free_port()
    elif job.launcher in MPI_LAUNCHERS:
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        hosts = comm.gather((socket.gethostname(), ipv4_interfaces()), root=0)
        answer = None
        if job.rank == 0:
            try:
                addr = choose_master_addr(hosts, environ.get("GLOO_SOCKET_IFNAME"))
                answer = (addr, _int(environ, "MASTER_PORT") or free_port())
            except ConfigError as e:
                answer = str(e)
        answer = comm.bcast(answer, root=0)
        if isinstance(answer, str):
            raise ConfigError(answer)
        job.master_addr, job.master_port = answer
    elif job.launcher == "Slurm" and environ.get("SLURM_JOB_NODELIST"):
        import subprocess

        first = subprocess.run(
            ["scontrol", "show", "hostnames", environ["SLURM_JOB_NODELIST"]],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()[0]
        job.master_addr, job.master_port = first, _int(environ, "MASTER_PORT") or DEFAULT_PORT
    else:
        raise ConfigError(
            f"{job.launcher} started {job.world_size} ranks but MASTER_ADDR is not set"
        )
    return job


def rank_cores(local_world_size: int) -> int:
    """The cores this rank's torch threads use: the process's CPU affinity, which a launcher that
    binds (Open MPI binds each rank to one core when np <= 2, to a socket otherwise) has already
    made this rank's share; unbound (every core allowed), the host's cores split between the ranks
    that share it."""
    allowed = len(os.sched_getaffinity(0))
    if allowed < (os.cpu_count() or allowed):
        return allowed
    return max(1, allowed // local_world_size)


def init_process_group(
    job: Job,
    timeout_s: float,
    wanted_device: str = "auto",
    requested_precision: str | None = None,
    engine: "EngineSpec | None" = None,
) -> str:
    """Start torch.distributed on the backend every rank can run (nccl on GPUs, gloo on CPUs),
    decided from every rank's device report before any collective (vit.runtime.gpu, which with an
    engine also checks the precision); export the torchrun variables DeepSpeed reads."""
    from vit.runtime import gpu

    timeout = timedelta(seconds=timeout_s)
    pin_interface(job.master_addr)
    try:
        store = dist.TCPStore(
            job.master_addr,
            job.master_port,
            job.world_size,
            is_master=job.rank == 0,
            timeout=timeout,
        )
    except dist.DistNetworkError as e:
        if "EADDRINUSE" not in str(e):
            raise
        raise ConfigError(
            f"rank 0's port {job.master_port} (MASTER_PORT) is in use on {socket.gethostname()}: "
            "another run or program holds it; choose a free one, or unset MASTER_PORT"
        ) from None
    reports = gpu.exchange(
        store, job.world_size, gpu.local_report(wanted_device, job.rank, job.local_rank), timeout_s
    )
    job.device_type = gpu.decide(reports, wanted_device, requested_precision, engine)
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(rank_cores(job.local_world_size))
    device_id = None
    if job.device_type == "cuda":
        device_id = device(job)
        torch.cuda.set_device(device_id)
    # --device cpu on a GPU host: DeepSpeed must not pick CUDA either
    elif torch.cuda.is_available():
        os.environ["DS_ACCELERATOR"] = "cpu"
    os.environ.update(
        RANK=str(job.rank),
        WORLD_SIZE=str(job.world_size),
        LOCAL_RANK=str(job.local_rank),
        MASTER_ADDR=job.master_addr,
        MASTER_PORT=str(job.master_port),
    )
    backend = "nccl" if job.device_type == "cuda" else "gloo"
    # NCCL's own watchdog (TORCH_NCCL_ASYNC_ERROR_HANDLING) ends the process when a collective
    # times out, and no thread of ours says which rank stopped: it waits NCCL_GRACE_S longer than
    # vit.runtime.faults' watchdog, which names that rank (gloo's timeout raises in the main thread,
    # which names it the same way).
    grace = timedelta(seconds=NCCL_GRACE_S if backend == "nccl" else 0)
    # With device_id NCCL creates its communicators here, and a full GPU fails it (vit.train words
    # that error).
    dist.init_process_group(
        backend,
        store=store,
        rank=job.rank,
        world_size=job.world_size,
        timeout=timeout + grace,
        device_id=device_id,
    )
    return backend


def device(job: Job) -> torch.device:
    """This rank's device: GPU LOCAL_RANK of its host, the one DeepSpeed picks too."""
    return (
        torch.device("cuda", job.local_rank) if job.device_type == "cuda" else torch.device("cpu")
    )


def rank0_decides(decide):
    """Collective: rank 0 runs decide() and every rank gets its answer, or raises the ConfigError
    (or other exception of the project's) that it raised, so that all ranks stop alike with one
    message."""
    answer = [None]
    if dist.get_rank() == 0:
        try:
            answer[0] = decide()
        except Exception as e:  # handed to every rank, raised there
            answer[0] = e
    dist.broadcast_object_list(answer, src=0)
    if isinstance(answer[0], Exception):
        raise answer[0]
    return answer[0]


def live_process_groups() -> int:
    """The process groups alive in this process, the default one included (torch's public
    get_pg_count() counts every group ever created, destroyed ones too)."""
    return len(dist.distributed_c10d._world.pg_map)  # noqa: SLF001


def destroy_groups(groups: list) -> None:
    """Destroy process groups nothing uses again (NCCL: their communicators and the GPU memory these
    hold), in the order given, the same on every rank."""
    for group in groups:
        dist.destroy_process_group(group)


def end_process_group() -> None:
    """Destroy the default group after everything that uses it: dynamo's caches hold a compiled DDP
    module, and a DDP reducer that outlives its group can abort the process at exit ('terminate
    called without an active exception')."""
    if "torch._dynamo" in sys.modules:
        torch._dynamo.reset()
    gc.collect()
    dist.destroy_process_group()
