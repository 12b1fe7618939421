"""The links the cost model needs, measured once the process group runs: rank 0 and each other
host's first rank exchange messages (latency from a byte's round trip, bandwidth from a message
grown until its transfer takes PROBE_S). Used by --engine auto and --partition balanced."""

import statistics
import time

import torch
import torch.distributed as dist

from vit.core.costs import Network

PROBE_S = 0.2  # a link's message grows until its transfer takes this long
PROBE_MAX_BYTES = 64 * 2**20


def network(reports: list[dict], links: dict[str, tuple[float, float]]) -> Network:
    """Each host's link (bytes/s, latency) as measured from the first host: a host's, the pair's
    with the first; the first's, its fastest pair's; the latency, the pairs' median."""
    if not links:  # one host: two ranks on it at Network's assumed bandwidth
        return Network({}, 0.0)
    per_host = {h: b for h, (b, _) in links.items()}
    per_host[reports[0]["host"]] = max(per_host.values())
    return Network(per_host, statistics.median(lat for _, lat in links.values()))


def measure_links(hosts: list[str], rank: int, dev: torch.device) -> dict[str, tuple[float, float]]:
    """Collective: the first host's first rank (rank 0) and each other host's first rank in turn
    exchange messages (probe). On rank 0, {host: (bytes/s, latency s)}; elsewhere {}."""
    firsts = {}
    for r, h in enumerate(hosts):
        firsts.setdefault(h, r)
    found = {}
    for host, peer in list(firsts.items())[1:]:
        if rank == 0:
            found[host] = probe(peer, dev, sender=True)
        elif rank == peer:
            probe(0, dev, sender=False)
        dist.barrier()
    return found


def probe(peer: int, dev: torch.device, sender: bool) -> tuple[float, float] | None:
    """The sender's (bytes/s, latency s) to `peer`: latency, half the fastest of five round trips of
    a byte; bandwidth, a message grown 8x from 64 KiB until its transfer takes PROBE_S (or
    PROBE_MAX_BYTES), its bytes over its round trip less the byte's. Before each message a control
    message tells the receiver its size (0: done)."""
    ctl = torch.zeros(1, dtype=torch.int64, device=dev)
    if not sender:
        while True:
            dist.recv(ctl, peer)
            if (n := int(ctl.item())) == 0:
                return None
            dist.recv(torch.empty(n, dtype=torch.uint8, device=dev), peer)
            dist.send(ctl, peer)

    def round_trip(n: int) -> float:
        ctl.fill_(n)
        dist.send(ctl, peer)
        buf = torch.empty(n, dtype=torch.uint8, device=dev)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        begin = time.perf_counter()
        dist.send(buf, peer)
        dist.recv(ctl, peer)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return time.perf_counter() - begin

    tiny = min(round_trip(1) for _ in range(5))
    n, took = grow(round_trip, tiny)
    ctl.fill_(0)
    dist.send(ctl, peer)
    return n / max(took - tiny, 1e-9), tiny / 2


def grow(round_trip, tiny: float) -> tuple[int, float]:
    """The message size (8x from 64 KiB, never above PROBE_MAX_BYTES) whose transfer first takes
    PROBE_S beyond a byte's round trip `tiny`, and its faster of two round trips."""
    n = 64 * 2**10
    while (took := round_trip(n)) - tiny < PROBE_S and n < PROBE_MAX_BYTES:
        n = min(n * 8, PROBE_MAX_BYTES)
    return n, min(took, round_trip(n))
