"""Point-to-point channels of the asynchronous pipeline: one process group per direction per neighbour pair, so
that a stage sending activations forward and gradients back never shares a group with a transfer the other way
(FTPipe's broadcast deadlock), and sends in flight whose handles are always waited on.

Sends stay in flight in a ring as deep as the pipeline (two at two stages: double buffering): stage 0 runs up
to stages - 1 micro-batches ahead of the last, so a shallower ring could make two neighbours wait on each other.

Each message is a small header (the tensor's rank, shape and dtype) and the tensor. torch.distributed has no probe,
so a receiver cannot tell a header from a tensor unless both come every time; the header is 64 bytes, and the
receiver allocates each tensor from it, so a batch of another size (the last, partial one) needs no fixed buffer.
"""
from collections import deque

import torch
import torch.distributed as dist

MAX_DIMS = 6
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


class Channel:
    """One direction between this rank and `peer`, on a group of their own."""

    def __init__(self, group, peer: int, device: torch.device, depth: int):
        self.group, self.peer, self.device, self.depth = group, peer, device, depth
        self.pending: deque = deque()  # (handles, tensors kept alive until sent)

    def send(self, t: torch.Tensor) -> None:
        if len(self.pending) >= self.depth:
            self._wait_oldest()
        t = t.detach().contiguous()
        header = torch.zeros(MAX_DIMS + 2, dtype=torch.long)
        header[0], header[1] = t.dim(), DTYPES.index(t.dtype)
        header[2:2 + t.dim()] = torch.tensor(t.shape, dtype=torch.long)
        header = header.to(self.device)
        handles = [dist.isend(header, self.peer, group=self.group), dist.isend(t, self.peer, group=self.group)]
        self.pending.append((handles, (header, t)))

    def recv(self) -> torch.Tensor:
        header = torch.empty(MAX_DIMS + 2, dtype=torch.long, device=self.device)
        dist.irecv(header, self.peer, group=self.group).wait()
        header = header.tolist()
        t = torch.empty(header[2:2 + header[0]], dtype=DTYPES[header[1]], device=self.device)
        dist.irecv(t, self.peer, group=self.group).wait()
        return t

    def _wait_oldest(self) -> None:
        handles, _ = self.pending.popleft()
        for h in handles:
            h.wait()

    def flush(self) -> None:
        """Wait until every send has gone (its receiver has taken it)."""
        while self.pending:
            self._wait_oldest()


class Links:
    """This rank's channels: activations from the previous stage and to the next, gradients the other way, and the
    group of its stage's data-parallel copies (for the gradient all-reduce). Rank = stage x dp_size + copy, as in
    DeepSpeed's pipe-major topology (which vit.hetero's balanced plan assumes)."""

    def __init__(self, stages: int, dp_size: int, device: torch.device):
        rank = dist.get_rank()
        self.stage, self.dp_rank = divmod(rank, dp_size)
        self.recv_act = self.send_act = self.recv_grad = self.send_grad = None
        self.stage_group = None
        # Every rank creates every group, in one order (torch.distributed's rule for new_group).
        for copy in range(dp_size):
            for s in range(stages - 1):
                a, b = s * dp_size + copy, (s + 1) * dp_size + copy
                forward, backward = dist.new_group([a, b]), dist.new_group([a, b])
                if rank == a:
                    self.send_act = Channel(forward, b, device, stages)
                    self.recv_grad = Channel(backward, b, device, stages)
                if rank == b:
                    self.recv_act = Channel(forward, a, device, stages)
                    self.send_grad = Channel(backward, a, device, stages)
        for s in range(stages):
            group = dist.new_group([s * dp_size + copy for copy in range(dp_size)])
            if s == self.stage:
                self.stage_group = group

    def flush(self) -> None:
        for channel in (self.send_act, self.send_grad):
            if channel is not None:
                channel.flush()
