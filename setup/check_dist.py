"""Run once per rank under mpirun (setup/test_mpi.sh does): an mpi4py allreduce, then a gloo
all_reduce through torch.distributed with rank 0's address found the way training finds it."""
import os
import socket
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mpi4py import MPI  # noqa: E402

from vit import dist_env  # noqa: E402


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
    dist_env.init_process_group(de, timeout_s=60)
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    dist.destroy_process_group()
    if t.item() != expected:
        sys.exit(f"rank {rank} on {host}: gloo all_reduce gave {t.item()}, expected {expected}")
    print(f"rank {rank} of {size} on {host}: mpi4py allreduce ok, gloo all_reduce ok "
          f"(rank 0 at {de.master_addr}:{de.master_port}, {time.perf_counter() - start:.1f}s)", flush=True)


if __name__ == "__main__":
    main()
