"""The mean of a flat fp32 tensor over the ranks, on the wire in fp32, bf16 or int8.

fp32 is one all-reduce. bf16 and int8 reduce in two phases, as INTELLECT-1's quantised ring does:
every rank sends each other rank its share of the tensor compressed (all_to_all), sums the shares it
receives in fp32, compresses its summed share and sends it to every rank (all_gather). Each phase
moves (n - 1) / n of the tensor a rank, so the bytes are those of an all-reduce in the wire's dtype.
int8 keeps one fp32 scale per BLOCK values (their largest magnitude over 127), rounding to nearest.
Every rank ends with the same values, its own share included (decompressed like the others).

The mean is written over the input, which the caller gives up (padded to whole shares for bf16 and
int8: padded_length). fp32 needs no buffer beyond it; bf16 and int8 hold the compressed tensor sent
and received, one share more, and a chunk of fp32 at a time (buffer_bytes in __init__.py bounds
them)."""

import torch
import torch.distributed as dist

from vit.engines.diloco import BLOCK

CHUNK = 1 << 18  # values decompressed at a time (1 MiB of fp32)


def padded_length(length: int, wire: str, n: int) -> int:
    """The length of the flat tensor mean_over_ranks takes for `length` values on `n` ranks: whole
    shares of whole blocks for bf16 and int8."""
    if wire == "fp32" or n == 1:
        return length
    return -(-length // (n * BLOCK)) * n * BLOCK


def compress(x: torch.Tensor, wire: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(payload, scales): bf16 values, or int8 values and one fp32 scale per BLOCK. int8 scales
    and rounds `x` in place (the caller gives it up): no fp32 copy of it."""
    if wire == "bf16":
        return x.to(torch.bfloat16), None
    blocks = x.view(-1, BLOCK)
    largest = torch.linalg.vector_norm(blocks, ord=float("inf"), dim=1)
    scales = largest.clamp_min(torch.finfo(torch.float32).tiny) / 127
    return blocks.div_(scales[:, None]).round_().to(torch.int8).view(-1), scales


def decompress(payload: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    out = torch.zeros(payload.numel(), dtype=torch.float32, device=payload.device)
    add_decompressed(out, payload, scales)
    return out


def mean_over_ranks(flat: torch.Tensor, wire: str, group=None) -> torch.Tensor:
    """The mean of `flat` (fp32, 1-D, padded_length long) over the ranks of `group`, sent in `wire`
    (fp32, bf16, int8), written over `flat` and returned."""
    n = dist.get_world_size(group)
    if wire == "fp32" or n == 1:
        dist.all_reduce(flat, group=group)
        return flat.div_(n)
    if flat.numel() % (n * BLOCK):
        raise ValueError(f"{flat.numel()} values are not whole shares of {n} x {BLOCK}")
    share = flat.numel() // n
    mine = exchange(flat, wire, n, group).div_(n)  # the mean of this rank's share
    payload, scales = compress(mine, wire)
    del mine
    parts = all_gather(payload, n, group).split(share)
    scale_parts = all_gather(scales, n, group).split(share // BLOCK) if scales is not None else None
    del payload, scales
    for r, out in enumerate(flat.split(share)):
        add_decompressed(out.zero_(), parts[r], scale_parts[r] if scale_parts else None)
    return flat


def exchange(flat: torch.Tensor, wire: str, n: int, group) -> torch.Tensor:
    """Phase one: rank r receives every rank's share r, compressed, and sums them in fp32."""
    payload, scales = compress(flat, wire)
    received = torch.empty_like(payload)
    dist.all_to_all_single(received, payload, group=group)
    del payload
    got_scales = None
    if scales is not None:
        got_scales = torch.empty_like(scales)
        dist.all_to_all_single(got_scales, scales, group=group)
    share = flat.numel() // n
    total = torch.zeros(share, dtype=torch.float32, device=flat.device)
    for part, scale in zip(
        received.split(share),
        got_scales.split(share // BLOCK) if got_scales is not None else [None] * n,
    ):
        add_decompressed(total, part, scale)
    return total


def add_decompressed(out: torch.Tensor, payload: torch.Tensor, scales) -> None:
    """out += decompress(payload, scales), CHUNK values at a time: a temporary of a chunk, not of
    the whole."""
    for i in range(0, out.numel(), CHUNK):
        part = out[i : i + CHUNK]
        values = payload[i : i + CHUNK]
        if scales is None:
            part.add_(values)
        else:
            span = scales[i // BLOCK : (i + CHUNK) // BLOCK]
            part.view(-1, BLOCK).addcmul_(values.view(-1, BLOCK), span[:, None])


def all_gather(t: torch.Tensor, n: int, group) -> torch.Tensor:
    """Every rank's `t`, one after another in one tensor (no flattening copy in the backend)."""
    out = torch.empty(n * t.numel(), dtype=t.dtype, device=t.device)
    dist.all_gather_into_tensor(out, t, group=group)
    return out
