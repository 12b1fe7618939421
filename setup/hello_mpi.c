/* Smallest MPI program: each process prints its rank, the world size and its host, then all
 * meet in a barrier so that a process that cannot reach the others shows up as a failure. */
#include <mpi.h>
#include <stdio.h>

int main(int argc, char **argv) {
  int rank, size, name_len;
  char host[MPI_MAX_PROCESSOR_NAME];

  MPI_Init(&argc, &argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  MPI_Get_processor_name(host, &name_len);
  printf("hello from rank %d of %d on %s\n", rank, size, host);
  fflush(stdout);
  MPI_Barrier(MPI_COMM_WORLD);
  MPI_Finalize();
  return 0;
}
