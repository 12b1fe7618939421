"""The mean of a flat fp32 tensor over the ranks, on the wire in fp32, bf16 or int8.

fp32 is one all-reduce. bf16 and int8 reduce in two phases, as INTELLECT-1's quantised ring does:
every rank sends each other rank its share of the tensor compressed (all_to_all), sums the shares it
receives in fp32, compresses its summed share and sends it to every rank (all_gather). Each phase
moves (n - 1) / n of the tensor a rank, so the bytes are those of an all-reduce in the wire's dtype.
int8 keeps one fp32 scale per BLOCK values (their largest magnitude over 127), rounding to nearest.
Every rank ends with the same values, its own share included (decompressed like the others)."""

import torch
import torch.distributed as dist

BLOCK = 256  # int8: values per scale


def compress(x: torch.Tensor, wire: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(payload, scales): bf16 values, or int8 values and one fp32 scale per BLOCK."""
    if wire == "bf16":
        return x.to(torch.bfloat16), None
    blocks = x.view(-1, BLOCK)
    scales = blocks.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / 127
    return torch.round(blocks / scales[:, None]).to(torch.int8).view(-1), scales


def decompress(payload: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    if scales is None:
        return payload.float()
    return (payload.view(-1, BLOCK).float() * scales[:, None]).view(-1)


def mean_over_ranks(flat: torch.Tensor, wire: str, group=None) -> torch.Tensor:
    """The mean of `flat` (fp32, 1-D) over the ranks of `group`, sent in `wire` (fp32, bf16,
    int8)."""
    n = dist.get_world_size(group)
    if wire == "fp32" or n == 1:
        out = flat.clone()
        dist.all_reduce(out, group=group)
        return out / n
    length = flat.numel()
    share = -(-length // (n * BLOCK)) * BLOCK  # each rank's share, whole blocks
    padded = torch.zeros(share * n, dtype=torch.float32, device=flat.device)
    padded[:length] = flat
    mine = exchange(padded, wire, n, share, group).view(n, share).sum(dim=0) / n
    payload, scales = compress(mine, wire)
    gathered = all_gather(payload, n, group)
    scale_parts = all_gather(scales, n, group) if scales is not None else [None] * n
    whole = torch.cat([decompress(p, s) for p, s in zip(gathered, scale_parts)])
    return whole[:length]


def exchange(padded: torch.Tensor, wire: str, n: int, share: int, group) -> torch.Tensor:
    """Phase one: rank r receives every rank's share r, compressed, and decompresses it
    ([n, share])."""
    payload, scales = compress(padded, wire)
    received = torch.empty_like(payload)
    dist.all_to_all_single(received, payload, group=group)
    if scales is None:
        return decompress(received, None)
    got_scales = torch.empty_like(scales)
    dist.all_to_all_single(got_scales, scales, group=group)
    return decompress(received, got_scales)


def all_gather(t: torch.Tensor, n: int, group) -> list[torch.Tensor]:
    parts = [torch.empty_like(t) for _ in range(n)]
    dist.all_gather(parts, t, group=group)
    return parts
