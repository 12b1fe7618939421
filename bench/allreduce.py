"""all-reduce time, algbw and busbw per message size through torch.distributed and, under mpirun,
MPI (mpi4py):
    mpirun -np N python -m bench allreduce   (or scripts/mpirun ...)"""

import argparse
import socket
import sys
import time
from collections import Counter

import torch
import torch.distributed as dist

from bench.common import device_name, load_avg, publish
from vit.core.settings import positive_int
from vit.runtime.dist_env import MPI_LAUNCHERS, device, discover, init_process_group, resolve_master


def parse_bytes(text: str) -> int:
    units = {"": 1, "K": 2**10, "KIB": 2**10, "M": 2**20, "MIB": 2**20, "G": 2**30, "GIB": 2**30}
    t = text.strip().upper()
    digits = t.rstrip("KMGIB")
    if not digits.isdigit() or t[len(digits) :] not in units:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 65536, 64K, 64M, 1G)")
    size = int(digits) * units[t[len(digits) :]]
    if size <= 0 or size % 4:
        raise argparse.ArgumentTypeError(
            f"{text!r}: a message is float32s, so its size must be a positive multiple of 4 bytes"
        )
    return size


def iterations(n: int, size: int) -> int:
    # at most 1 GiB per size and phase: big messages stay quick on a CPU
    return max(1, min(n, 2**30 // size))


def time_torch(size: int, a, dev) -> float:
    world = dist.get_world_size()
    check = torch.full((size // 4,), float(dist.get_rank() + 1), device=dev)
    dist.all_reduce(check)
    if not torch.all(check == world * (world + 1) / 2):
        raise RuntimeError(f"all_reduce of {size} bytes gave a wrong sum")
    buf = torch.zeros(size // 4, device=dev)
    for _ in range(iterations(a.warmup, size)):
        dist.all_reduce(buf)
    n = iterations(a.iters, size)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(n):
        dist.all_reduce(buf)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / n


def time_mpi(size: int, a) -> float:
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    send, recv = np.full(size // 4, comm.rank + 1, np.float32), np.empty(size // 4, np.float32)
    comm.Allreduce(send, recv, op=MPI.SUM)
    if not np.all(recv == comm.size * (comm.size + 1) / 2):
        raise RuntimeError(f"MPI Allreduce of {size} bytes gave a wrong sum")
    for _ in range(iterations(a.warmup, size)):
        comm.Allreduce(send, recv, op=MPI.SUM)
    n = iterations(a.iters, size)
    comm.Barrier()
    start = MPI.Wtime()
    for _ in range(n):
        comm.Allreduce(send, recv, op=MPI.SUM)
    return (MPI.Wtime() - start) / n


def allreduce_table(r: dict) -> str:
    ways = [w for w in ("torch", "mpi") if w in r["rows"][0]]
    names = {"torch": f"torch.distributed ({r['backend']})", "mpi": "MPI (mpi4py, host memory)"}
    link = r.get("link_gbps")
    per_way = " time us | algbw GB/s | busbw GB/s |" + (" busbw / link |" if link else "")
    head = "| bytes |" + "".join(f" {names[w]}{per_way}" for w in ways)
    link_note = (
        f"; busbw / link = busbw x 8 / {link:g} Gbit/s (TCP over 1500-byte frames carries "
        "at most 0.94-0.96 of a link)"
        if link
        else ""
    )
    lines = [
        f"all-reduce, float32 sum, {r['world_size']} ranks on {r['placement']}; "
        "algbw = bytes / time, busbw = algbw x 2(n-1)/n = algbw x "
        f"{r['bus_factor']:.3f}{link_note}; time = slowest rank's mean; load average "
        f"{r['load_avg_before']} -> {r['load_avg_after']}",
        "",
        head,
        "| ---: |" + (" ---: |" * per_way.count("|")) * len(ways),
    ]
    for row in r["rows"]:
        cells = ""
        for w in ways:
            cells += f" {1e6 * row[w]['time_s']:.1f} | {row[w]['algbw_gbps']:.3f} |"
            cells += f" {row[w]['busbw_gbps']:.3f} |"
            if link:
                cells += f" {row[w]['busbw_gbps'] * 8 / link:.2f} |"
        lines.append(f"| {row['bytes']} |{cells}")
    return "\n".join(lines) + "\n"


def run(a) -> int:

    if a.link_gbps is not None and not a.link_gbps > 0:
        print(
            f"bench allreduce: --link-gbps must be a positive rate in Gbit/s, got {a.link_gbps}",
            file=sys.stderr,
        )
        return 2
    job = resolve_master(discover())
    if a.no_torch and (a.no_mpi or job.launcher not in MPI_LAUNCHERS):
        print(
            "bench allreduce: --no-torch leaves nothing to time without MPI (run "
            "under mpirun, without --no-mpi)",
            file=sys.stderr,
        )
        return 2
    max_bytes = a.max_bytes or (256 * 2**20 if torch.cuda.is_available() else 64 * 2**20)
    sizes, size = [], a.min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size *= 2
    if not sizes:
        sys.exit(
            f"bench allreduce: --min-bytes {a.min_bytes} is above the largest size, {max_bytes}"
        )
    backend = init_process_group(job, a.timeout)
    dev = device(job)
    world = job.world_size
    hosts = [None] * world
    dist.all_gather_object(hosts, socket.gethostname())
    placement = " ".join(f"{h}:{n}" for h, n in Counter(hosts).items())
    use_mpi = job.launcher in MPI_LAUNCHERS and not a.no_mpi
    factor = 2 * (world - 1) / world
    before, rows = load_avg(), []
    for size in sizes:
        row = {"bytes": size}
        timings = {} if a.no_torch else {"torch": time_torch(size, a, dev)}
        if use_mpi:
            timings["mpi"] = time_mpi(size, a)
        for way, t in timings.items():
            slowest = torch.tensor([t], dtype=torch.float64, device=dev)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            t = slowest.item()
            row[way] = {
                "time_s": t,
                "algbw_gbps": size / t / 1e9,
                "busbw_gbps": size / t / 1e9 * factor,
            }
        rows.append(row)
        if job.is_main:
            print(f"{size} bytes done", file=sys.stderr, flush=True)
    result = {
        "benchmark": "allreduce",
        "backend": backend,
        "world_size": world,
        "placement": placement,
        "bus_factor": factor,
        "link_gbps": a.link_gbps,
        "device": device_name(),
        "load_avg_before": before,
        "load_avg_after": load_avg(),
        "rows": rows,
    }
    if job.is_main:
        publish(a.out, "allreduce", result, allreduce_table(result))
    dist.barrier()
    dist.destroy_process_group()
    return 0


def add_arguments(p) -> None:
    p.add_argument(
        "--min-bytes",
        type=parse_bytes,
        default=1024,
        help="smallest message; sizes double from here",
    )
    p.add_argument(
        "--max-bytes",
        type=parse_bytes,
        help="largest message (default 256M on a GPU, 64M on a CPU)",
    )
    p.add_argument(
        "--iters",
        type=positive_int,
        default=20,
        help="timed iterations per size (fewer where they would move more than 1 GiB)",
    )
    p.add_argument("--warmup", type=positive_int, default=5, help="untimed iterations per size")
    p.add_argument("--no-mpi", action="store_true", help="torch.distributed only")
    p.add_argument(
        "--no-torch",
        action="store_true",
        help="MPI only (torch.distributed still gathers the results): time each without the "
        "other's processes in the way, e.g. MPI's busy-polling on shared cores",
    )
    p.add_argument(
        "--link-gbps",
        type=float,
        help="the rate of each host's link in Gbit/s (1 for 1 GbE): adds a busbw / link column, "
        "the share of the link that the all-reduce uses",
    )
    p.add_argument("--timeout", type=float, default=300, help="seconds before a collective fails")
    p.add_argument("--out", help="folder for allreduce.md and allreduce.json")


COMMANDS = {
    "allreduce": (
        "all-reduce time, algbw and busbw per message size (torch.distributed "
        "and MPI); run it under mpirun",
        add_arguments,
        run,
    )
}
