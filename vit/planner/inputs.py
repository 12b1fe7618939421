"""The cost model's inputs from a previous run: its cluster.json (the census: each rank's host, free
memory and measured layer or block times) and config.json (model, data set, global batch,
precision), the links from --link-mbit or setup/doctor.sh --link's output, and the model's layers
profiled on this machine's CPU at one sample (parameters, activations, boundary sizes, weight
matrices: what the census does not record)."""

import json
import re
from pathlib import Path

from vit.core.costs import USABLE_MEMORY, Layer, Network, Rank
from vit.core.errors import ConfigError

DOCTOR_LINE = re.compile(r"link from (\S+) to (\S+): ([\d.]+) Mbit/s")
PLAIN_LINE = re.compile(r"^\s*(\S+)\s+([\d.]+)\s*$")


def read_json(path: Path, what: str) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file ({what})") from None
    except OSError as e:  # a folder, unreadable
        raise ConfigError(f"{path}: cannot be read as a file ({what}): {e.strerror or e}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not JSON ({what}): {e}") from None


def load_run(where: str) -> tuple[dict, dict | None]:
    """(cluster.json, config.json or None) from a run's log dir or its cluster.json."""
    path = Path(where)
    cluster_path = path / "cluster.json" if path.is_dir() else path
    cluster = read_json(cluster_path, "a run's census")
    census = cluster.get("census") if isinstance(cluster, dict) else None
    if not census or not all(
        isinstance(r, dict) and "host" in r and "mem_free_gib" in r for r in census
    ):
        raise ConfigError(
            f"{cluster_path}: no census (a run's cluster.json lists each rank's host and memory)"
        )
    if not all("layer_ms" in r or "block_ms" in r for r in census):
        raise ConfigError(
            f"{cluster_path}: the census has no measured times (layer_ms or block_ms)"
        )
    config_path = cluster_path.parent / "config.json"
    return cluster, read_json(config_path, "the run's settings") if config_path.is_file() else None


def read_links(path: str) -> tuple[dict[str, float], dict[tuple[str, str], float]]:
    """(Mbit/s per host, Mbit/s per pair) from setup/doctor.sh --link's lines ("link from A to B: X
    Mbit/s": the pair, B's link, and A's at least the fastest it reached) or plain "HOST MBIT"
    lines."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigError(f"--link-file {path}: {e.strerror or e}") from None
    hosts, pairs = {}, {}
    for line in text.splitlines():
        if m := DOCTOR_LINE.search(line):
            a, b, mbit = m.group(1), m.group(2), float(m.group(3))
            pairs[(a, b)] = mbit
            hosts[b] = min(hosts.get(b, mbit), mbit)
            hosts[a] = max(hosts.get(a, 0.0), mbit)
        elif m := PLAIN_LINE.match(line):
            hosts[m.group(1)] = float(m.group(2))
    if not hosts:
        raise ConfigError(
            f"--link-file {path}: no link in it (doctor.sh --link's 'link from A to B: "
            "X Mbit/s' lines, or 'HOST MBIT' lines)"
        )
    return hosts, pairs


def network(
    hosts: list[str],
    link_mbit: float | None,
    link_file: str | None,
    latency_ms: float,
    same_host_gbit: float,
) -> Network:
    """The links between the census's hosts in bytes/s; ConfigError when a host has none."""
    per_host, pairs = read_links(link_file) if link_file else ({}, {})
    if link_mbit is not None:
        per_host = {h: per_host.get(h, link_mbit) for h in hosts}
    missing = sorted(set(hosts) - set(per_host))
    if len(set(hosts)) > 1 and missing:
        raise ConfigError(
            f"no link speed for host{'s' if len(missing) > 1 else ''} {', '.join(missing)}: "
            "give --link-mbit, or --link-file with setup/doctor.sh --link's output"
        )
    mbit = 1e6 / 8
    return Network(
        {h: v * mbit for h, v in per_host.items()},
        latency_ms / 1e3,
        {k: v * mbit for k, v in pairs.items()},
        same_host_gbit * 1e9 / 8,
    )


def ranks_from_census(
    census: list[dict], flops: list[float], run_micro_batch: int
) -> tuple[list[Rank], str]:
    """Each rank's per-sample layer seconds: the census's layer_ms at layer_ms_micro_batch where it
    measured them (--partition balanced), else its block_ms (one block's forward and backward at the
    run's micro-batch) shared over the layers by their FLOPs, 1/3 forward and 2/3 backward. Times
    scale linearly with the micro-batch (the fixed costs per micro-batch are the calibration's). The
    machine where the census has it; the contention where the reports are --engine auto's own
    (cluster.json's census has none: 1, nothing shared)."""
    ranks, how = [], "measured per layer (census layer_ms)"
    for r in census:
        if "layer_ms" in r:
            if len(r["layer_ms"]) != len(flops):
                raise ConfigError(
                    f"the census has {len(r['layer_ms'])} layer times, the "
                    f"model {len(flops)} layers"
                )
            per = r.get("layer_ms_micro_batch", run_micro_batch) * 1e3
            fwd, bwd = [f / per for f, _ in r["layer_ms"]], [b / per for _, b in r["layer_ms"]]
        else:
            how = "estimated from each rank's block_ms by the layers' FLOPs"
            # the census times layers[1], a block
            per_flop = r["block_ms"] / 1e3 / run_micro_batch / flops[1]
            fwd, bwd = [f * per_flop / 3 for f in flops], [2 * f * per_flop / 3 for f in flops]
        ranks.append(
            Rank(
                r["host"],
                tuple(fwd),
                tuple(bwd),
                USABLE_MEMORY * r["mem_free_gib"] * 2**30,
                gpu=r.get("capability") is not None,
                machine=r.get("machine", ""),
                contention=r.get("contention", 1.0),
            )
        )
    return ranks, how


def profile_model(
    model: str, dataset: str, img_size: int | None, precision: str, data_path: str | None = None
) -> tuple[list[Layer], list[float]]:
    """(layers, forward FLOPs per sample of each) of `model` as the run built it, profiled on the
    CPU at one sample (vit.planner.profile): parameters, activations kept for backward, output
    elements, weight matrices."""
    import torch

    from vit.data.datasets import load_dataset
    from vit.model.layers import build_layers, model_shape

    img = img_size or model_shape(model).img_size
    try:
        data = load_dataset(dataset, data_path, img, synthetic_size=16)
        classes, chans, img = data.num_classes, data.in_chans, data.img_size
    except (ConfigError, OSError):  # a data set not on this machine: its usual shape
        classes, chans = 10, 3
    layers = build_layers(model, classes, chans, img)
    return describe_layers(layers, torch.randn(1, chans, img, img), precision)


def describe_layers(layers: list, sample, precision: str) -> tuple[list[Layer], list[float]]:
    """(the cost model's Layer of each, forward FLOPs per sample of each) of built layers, profiled
    at `sample` (one input) on its device."""
    from vit.planner.profile import profile_layers

    return from_profile(profile_layers(layers, sample, precision), layers)


def from_profile(profile: list[dict], layers: list) -> tuple[list[Layer], list[float]]:
    """describe_layers from vit.planner.profile's profile of `layers`, made before."""
    return [
        Layer(
            p["params"],
            float(p["act_bytes"]),
            p["out_elems"],
            tuple((q.shape[0], q.numel() // q.shape[0]) for q in layer.parameters() if q.dim() > 1),
        )
        for p, layer in zip(profile, layers)
    ], [float(p["flops"]) for p in profile]
