"""Run once per rank under mpirun (setup/test_mpi.sh does): an mpi4py allreduce, then an all_reduce
through torch.distributed the way training starts it: rank 0's address, the backend every rank
agrees on (nccl on GPUs, gloo on CPUs) and the rank's own device (NCCL refuses CPU tensors)."""

import os
import socket
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mpi4py import MPI  # noqa: E402

from vit.runtime import dist_env  # noqa: E402


def main() -> None:
    comm = MPI.COMM_WORLD
    rank, size, host = comm.Get_rank(), comm.Get_size(), socket.gethostname()
    expected = size * (size + 1) // 2
    mpi_sum = comm.allreduce(rank + 1, op=MPI.SUM)
    if mpi_sum != expected:
        sys.exit(f"rank {rank} on {host}: mpi4py allreduce gave {mpi_sum}, expected {expected}")

    import torch
    import torch.distributed as dist

    de = dist_env.resolve_master(dist_env.discover())
    start = time.perf_counter()
    backend = dist_env.init_process_group(de, timeout_s=60)
    dev = dist_env.device(de)
    t = torch.tensor([float(rank + 1)], device=dev)
    dist.all_reduce(t)
    # before the group goes: on NCCL the all_reduce may still be queued on its stream
    got = t.item()
    dist.destroy_process_group()
    if got != expected:
        sys.exit(
            f"rank {rank} on {host}: {backend} all_reduce on {dev} gave {got}, expected {expected}"
        )
    print(
        f"rank {rank} of {size} on {host}: mpi4py allreduce ok, {backend} all_reduce on {dev} ok "
        f"(rank 0 at {de.master_addr}:{de.master_port}, {time.perf_counter() - start:.1f}s)",
        flush=True,
    )


if __name__ == "__main__":
    main()
