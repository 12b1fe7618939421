"""Point-to-point channels of the asynchronous pipeline: one process group per direction per
neighbour pair (and a gloo group beside it for the headers), so that a stage sending activations
forward and gradients back never shares a group with a transfer the other way (FTPipe's broadcast
deadlock), and sends in flight whose handles are always waited on.

Sends stay in flight in a ring as deep as the pipeline (two at two stages: double buffering): stage
0 runs up to stages - 1 micro-batches ahead of the last, so a shallower ring could make two
neighbours wait on each other.

gloo moves a message only once its receive is posted, so a receive waited on at once costs a round
trip between the two processes at the moment the tensor is needed. When the caller knows another
message will come, the next receive is posted as soon as one arrives (double buffering on the
receiving side too), and the transfer overlaps the work in between. It is posted only then: a
receive left posted when nothing more is sent would never end.

Every tensor travels with a header (its rank, shape and dtype) sent first on the gloo group beside,
as a CPU tensor: the receiver learns what comes from host memory, never by reading a GPU tensor (a
host sync per message), and each tensor it returns is an allocation of its own, at offset 0 and
contiguous. A batch of another size (the last, partial one) needs no drop_last: a receive posted
ahead is posted in the last header's shape, so a sender whose shape changes first sends a notice
header and a dummy tensor in the old shape for that receive to take.

On NCCL a receive posted ahead is a kernel waiting for the peer: a device-wide synchronize on this
rank would wait for it, and so for the peer, which may be waiting for this rank (a deadlock).
Nothing in the asynchronous pipeline synchronizes the device or empties the allocator's cache
(vit.runtime.gpu.wait_for_queued waits for one stream); torch's allocator still frees its cache
(cudaFree, which synchronizes) when an allocation fails on a nearly full GPU.
"""

from collections import deque

import torch
import torch.distributed as dist

MAX_DIMS = 6
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
# a header's rank field: the next tensor is a dummy in the old shape, another header follows
NOTICE = -1


class Channel:
    """One direction between this rank and `peer`: tensors on `group` (the job's backend), their
    headers on `headers` (gloo)."""

    def __init__(self, group, headers, peer: int, device: torch.device, depth: int):
        self.group, self.headers, self.peer, self.device, self.depth = (
            group,
            headers,
            peer,
            device,
            depth,
        )
        self.pending: deque = deque()  # (handles, tensors kept alive until sent)
        # the last header's (shape, dtype): what a receive posted ahead expects
        self.sent = self.received = None
        self.posted = None  # (header, tensor) receives of the next message, posted ahead
        self.bytes = 0  # the tensors' bytes sent so far (dummies included, the 64-byte headers not)

    def send(self, t: torch.Tensor) -> None:
        if len(self.pending) >= self.depth:
            self._wait_oldest()
        t = t.detach().contiguous()
        meta = (tuple(t.shape), t.dtype)
        messages = []
        if self.sent is not None and meta != self.sent:
            messages += [(header(None), self.headers), (self._buffer(self.sent), self.group)]
        messages += [(header(t), self.headers), (t, self.group)]
        self.sent = meta
        self.bytes += sum(m.numel() * m.element_size() for m, g in messages if g is self.group)
        handles = [dist.isend(m, self.peer, group=g) for m, g in messages]
        self.pending.append((handles, [m for m, _ in messages]))

    def recv(self, more: bool = False) -> torch.Tensor:
        """The next tensor. more: the peer is sure to send another message on this channel (the
        training schedule says so), so its receives are posted now."""
        head, tensor = self.posted or self._post()
        self.posted = None
        meta = read_header(_wait(head))
        # the shape changed: the tensor receive posted in the old one takes a dummy
        if meta is None:
            _wait(tensor)
            meta, tensor = read_header(_wait(self._post_header())), None
        if tensor is None:  # the first message, or a new shape
            self.received = meta
            tensor = self._post_tensor()
        t = _wait(tensor)
        if more:
            self.posted = self._post()
        return t

    def _post(self) -> tuple:
        """Receives for the next message: its header, and its tensor in the last shape (none before
        the first)."""
        return self._post_header(), self._post_tensor() if self.received else None

    def _post_header(self) -> tuple:
        h = torch.empty(MAX_DIMS + 2, dtype=torch.long)
        return dist.irecv(h, self.peer, group=self.headers), h

    def _post_tensor(self) -> tuple:
        t = self._buffer(self.received)
        return dist.irecv(t, self.peer, group=self.group), t

    def _buffer(self, meta: tuple) -> torch.Tensor:
        return torch.empty(meta[0], dtype=meta[1], device=self.device)

    def _wait_oldest(self) -> None:
        handles, _ = self.pending.popleft()
        for h in handles:
            h.wait()

    def flush(self) -> None:
        """Wait until every send has gone (its receiver has taken it)."""
        while self.pending:
            self._wait_oldest()


def header(t: torch.Tensor | None) -> torch.Tensor:
    """t's rank, dtype and shape as a CPU tensor; None: a notice."""
    fields = [NOTICE, 0] if t is None else [t.dim(), DTYPES.index(t.dtype), *t.shape]
    return torch.tensor(fields + [0] * (MAX_DIMS + 2 - len(fields)), dtype=torch.long)


def read_header(h: torch.Tensor) -> tuple | None:
    """(shape, dtype), or None for a notice."""
    dims, dtype, *shape = h.tolist()
    return None if dims == NOTICE else (tuple(shape[:dims]), DTYPES[dtype])


def _wait(posted: tuple) -> torch.Tensor:
    posted[0].wait()
    return posted[1]


class Links:
    """This rank's channels: activations from the previous stage and to the next, gradients the
    other way, and the group of its stage's data-parallel copies (for the gradient all-reduce). Rank
    = stage x dp_size + copy, as in DeepSpeed's pipe-major topology (which vit.planner's balanced
    plan assumes)."""

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
                forward_headers, backward_headers = (
                    dist.new_group([a, b], backend="gloo") for _ in range(2)
                )
                if rank == a:
                    self.send_act = Channel(forward, forward_headers, b, device, stages)
                    self.recv_grad = Channel(backward, backward_headers, b, device, stages)
                if rank == b:
                    self.recv_act = Channel(forward, forward_headers, a, device, stages)
                    self.send_grad = Channel(backward, backward_headers, a, device, stages)
        for s in range(stages):
            group = dist.new_group([s * dp_size + copy for copy in range(dp_size)])
            if s == self.stage:
                self.stage_group = group

    def flush(self) -> None:
        for channel in (self.send_act, self.send_grad):
            if channel is not None:
                channel.flush()

    def bytes_sent(self) -> int:
        """The tensors' bytes this rank has sent to its neighbours (activations and gradients) so
        far."""
        return sum(c.bytes for c in (self.send_act, self.send_grad) if c is not None)
