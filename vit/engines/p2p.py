"""Point-to-point channels of the asynchronous pipeline: one process group per direction per neighbour pair, so
that a stage sending activations forward and gradients back never shares a group with a transfer the other way
(FTPipe's broadcast deadlock), and sends in flight whose handles are always waited on.

Sends stay in flight in a ring as deep as the pipeline (two at two stages: double buffering): stage 0 runs up
to stages - 1 micro-batches ahead of the last, so a shallower ring could make two neighbours wait on each other.

gloo moves a message only once its receive is posted, so a receive waited on at once costs a round trip between
the two processes at the moment the tensor is needed. When the caller knows another message will come, the next
receive is posted as soon as one arrives (double buffering on the receiving side too), and the transfer overlaps
the work in between. It is posted only then: a receive left posted when nothing more is sent would never end.

A header (the tensor's rank, shape and dtype) goes first and again whenever the shape or dtype changes, so a
batch of another size (the last, partial one) needs no drop_last. torch.distributed has no probe, so each tensor
travels with one leading element: 0 for a tensor, 1 for a notice, sent in the previous size, that a new header
follows.
"""
import math
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
        self.sent = self.received = None  # the (shape, dtype) the peer expects: the last header's
        self.posted = None  # (work, buffer): the next message's receive, posted ahead

    def send(self, t: torch.Tensor) -> None:
        if len(self.pending) >= self.depth:
            self._wait_oldest()
        t = t.detach()
        meta = (tuple(t.shape), t.dtype)
        messages = []
        if meta != self.sent:
            if self.sent is not None:
                notice = self._buffer(self.sent)
                notice[0] = 1
                messages.append(notice)
            header = torch.zeros(MAX_DIMS + 2, dtype=torch.long)
            header[0], header[1] = t.dim(), DTYPES.index(t.dtype)
            header[2:2 + t.dim()] = torch.tensor(t.shape, dtype=torch.long)
            messages.append(header.to(self.device))
            self.sent = meta
        messages.append(torch.cat([t.new_zeros(1), t.reshape(-1)]))
        handles = [dist.isend(m, self.peer, group=self.group) for m in messages]
        self.pending.append((handles, messages))

    def recv(self, more: bool = False) -> torch.Tensor:
        """The next tensor. more: the peer is sure to send another message on this channel (the training schedule
        says so), so its receive is posted now."""
        posted, self.posted = self.posted, None
        if posted is None and self.received is not None:
            posted = self._post(self._buffer(self.received))
        buffer = _wait(posted) if posted else None
        if buffer is None or buffer[0] == 1:  # the first message, or a notice that a header follows
            header = _wait(self._post(torch.empty(MAX_DIMS + 2, dtype=torch.long, device=self.device))).tolist()
            self.received = (tuple(header[2:2 + header[0]]), DTYPES[header[1]])
            buffer = _wait(self._post(self._buffer(self.received)))
        if more:
            self.posted = self._post(self._buffer(self.received))
        return buffer[1:].view(self.received[0])

    def _buffer(self, meta: tuple) -> torch.Tensor:
        shape, dtype = meta
        return torch.empty(1 + math.prod(shape), dtype=dtype, device=self.device)

    def _post(self, t: torch.Tensor) -> tuple:
        return dist.irecv(t, self.peer, group=self.group), t

    def _wait_oldest(self) -> None:
        handles, _ = self.pending.popleft()
        for h in handles:
            h.wait()

    def flush(self) -> None:
        """Wait until every send has gone (its receiver has taken it)."""
        while self.pending:
            self._wait_oldest()


def _wait(posted: tuple) -> torch.Tensor:
    posted[0].wait()
    return posted[1]


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
