"""The async pipeline's channels (vit.engines.async_pipeline.p2p) between two real gloo ranks: what
arrives is what was sent, in every shape and dtype change, each received tensor an allocation of its
own (offset 0, contiguous, no flag or header element beside it), and a receive never touches the
values of a tensor it receives: on a GPU that would be a host sync per message. Tensor ops are
observed with torch's dispatch mode, the same on a CPU as on a GPU."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import ROOT, STARTED, _wait_all, base_env, require_ranks_mark
from torch.utils._python_dispatch import TorchDispatchMode

# (shape, dtype, transposed): full batches, the last partial one, bf16, another rank, a
# non-contiguous tensor
MESSAGES = [
    ((4, 3), torch.float32, False),
    ((4, 3), torch.float32, False),
    ((2, 3), torch.float32, False),
    ((2, 3), torch.bfloat16, False),
    ((4, 3, 5), torch.float32, True),
    ((4, 3), torch.float32, False),
    ((4, 3), torch.float32, False),
]
# receives posted ahead, and not, across the changes
MORE = [True, True, False, True, True, True, False]


def message(i: int) -> torch.Tensor:
    shape, dtype, transposed = MESSAGES[i]
    t = (
        torch.arange(i * 100, i * 100 + torch.Size(shape).numel(), dtype=torch.float32)
        .view(shape)
        .to(dtype)
    )
    return t.transpose(0, 1) if transposed else t


class TensorOps(TorchDispatchMode):
    """The tensor ops that touch a floating-point tensor (the data; headers are integers), other
    than allocating one or handing it to torch.distributed."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        tensors = [
            a
            for a in (*args, *(kwargs or {}).values())
            for a in (a if isinstance(a, list) else [a])
            if isinstance(a, torch.Tensor)
        ]
        if any(t.is_floating_point() for t in tensors) and not name.startswith(
            ("aten.empty.", "c10d.")
        ):
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


def worker(out: str) -> None:
    """Rank 0 sends every message and receives it back doubled; rank 1 receives each (observed) and
    sends it back doubled."""
    import torch.distributed as dist

    from vit.engines.async_pipeline.p2p import Links

    dist.init_process_group("gloo")
    links, rank, report = Links(2, 1, torch.device("cpu")), dist.get_rank(), []
    for i, more in enumerate(MORE):
        if rank == 0:
            links.send_act.send(message(i))
            back = links.recv_grad.recv(more)
            report.append({"equal": torch.equal(back, 2 * message(i))})
        else:
            with TensorOps() as seen:
                t = links.recv_act.recv(more)
            links.send_grad.send(2 * t)
            report.append(
                {
                    "equal": torch.equal(t, message(i)) and t.dtype == message(i).dtype,
                    "offset": t.storage_offset(),
                    "contiguous": t.is_contiguous(),
                    "own_storage": t.untyped_storage().nbytes() == t.numel() * t.element_size(),
                    "ops": seen.ops,
                }
            )
    links.flush()
    report.append({"bytes": links.bytes_sent()})
    dist.barrier()
    dist.destroy_process_group()
    Path(f"{out}_rank{rank}.json").write_text(json.dumps(report))


@pytest.mark.ranks
@pytest.mark.timeout(120)
def test_received_tensors_are_their_own_and_their_values_unread(tmp_path):
    from vit.runtime.dist_env import free_port

    require_ranks_mark()
    out, port = tmp_path / "out", free_port()
    ranks = [
        subprocess.Popen(
            [sys.executable, __file__, str(out)],
            cwd=ROOT,
            start_new_session=True,
            env=base_env(
                RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
            ),
        )
        for rank in range(2)
    ]
    STARTED.extend(ranks)
    assert _wait_all(ranks, timeout=90) == [0, 0]
    sent, received = (json.loads(Path(f"{out}_rank{rank}.json").read_text()) for rank in range(2))
    (sent, [counted]), (received, [counted_back]) = (
        (sent[:-1], sent[-1:]),
        (received[:-1], received[-1:]),
    )
    # rank 1 sends each back (doubled)
    assert counted["bytes"] == counted_back["bytes"] == expected_bytes()
    assert all(r["equal"] for r in sent + received), (sent, received)
    for i, r in enumerate(received):
        assert (r["offset"], r["contiguous"], r["own_storage"]) == (0, True, True), (i, r)
        # no select, comparison, slice or .item() of what arrived
        assert r["ops"] == [], (i, r["ops"])


def expected_bytes() -> int:
    """The tensors' bytes of MESSAGES, with the dummy in the old shape that each change of shape or
    dtype sends."""
    total, last = 0, None
    for shape, dtype, _ in MESSAGES:
        size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        if last is not None and last != (shape, dtype):
            total += torch.Size(last[0]).numel() * torch.empty((), dtype=last[1]).element_size()
        total, last = total + size, (shape, dtype)
    return total


if __name__ == "__main__":  # a rank of the test above
    worker(sys.argv[1])
