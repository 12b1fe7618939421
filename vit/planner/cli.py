"""`python -m vit.planner RUN`: every candidate's predicted step for the cluster a previous run
measured, ranked (docs/planner.md). Bad input: one line on stderr, exit 2."""

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

from vit.core.costs import Calibration, Network, Prediction, Workload
from vit.core.errors import ConfigError
from vit.core.hostfile import hostfile_slots
from vit.core.paths import ROOT
from vit.core.settings import positive_int
from vit.engines.registry import planner_inputs
from vit.planner.inputs import load_run, network, profile_model, ranks_from_census, read_json
from vit.planner.predict import calibration_keys, label
from vit.planner.search import rank_candidates

PROG = "python -m vit.planner"
# the fixed costs bench planner --save-calibration measured; else
CALIBRATION = "VIT_PLANNER_CALIBRATION"
CALIBRATION_FILE = ROOT / "logs" / "planner_calibration.json"  # when it exists; else the defaults
# --engine auto with it: rank 0 writes the table to this file, nothing trains
PLAN_ONLY = "VIT_ENGINE_AUTO_PLAN_ONLY"
NO_FILE = "-"  # PLAN_ONLY without --json: the table printed, no file written


class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, not argparse's usage and message
        print(f"{PROG}: error: {message}", file=sys.stderr)
        sys.exit(2)


def rate(text: str, zero_ok: bool = False) -> float:
    """argparse type: a finite number above zero (or at least zero)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok):
        raise argparse.ArgumentTypeError(
            f"must be a finite number {'of at least' if zero_ok else 'above'} 0, got {text}"
        )
    return value


def parser() -> argparse.ArgumentParser:
    p = Parser(
        prog=PROG,
        usage=f"{PROG} RUN [options] | {PROG} --hostfile FILE [--json OUT] [-- TRAIN_OPTIONS]",
        description="Rank every engine, ZeRO stage, pipeline split, batch split, compression and "
        "micro-batch by predicted step time, from a previous run's census (its cluster.json) "
        "and the links between its hosts, or measured now on every slot of a hostfile (--engine "
        "auto's measurements, then it stops). Predictions only: nothing trains (docs/planner.md).",
    )
    p.add_argument(
        "run",
        nargs="?",
        help="a run's log dir (with cluster.json and config.json) or a cluster.json",
    )
    p.add_argument(
        "--hostfile",
        help="measure now: mpirun a rank on each of its slots with --engine auto and the vit.train "
        "options after --, print the top 10 and stop before training (no RUN then)",
    )
    p.add_argument("--link-mbit", type=rate, help="every host's link in Mbit/s")
    p.add_argument(
        "--link-file",
        help="setup/doctor.sh --link's output ('link from A to B: X Mbit/s'), or 'HOST MBIT' "
        "lines; --link-mbit fills hosts it lacks",
    )
    p.add_argument(
        "--latency-ms",
        type=lambda t: rate(t, zero_ok=True),
        default=0.1,
        help="one message's latency between hosts (default 0.1)",
    )
    p.add_argument(
        "--same-host-gbit",
        type=rate,
        default=40.0,
        help="bandwidth between two ranks on one host, assumed (default 40 Gbit/s)",
    )
    p.add_argument("--model", help="default: the run's (config.json)")
    p.add_argument("--dataset", help="default: the run's")
    p.add_argument("--img-size", type=positive_int, help="default: the run's, else the model's")
    p.add_argument("--global-batch", type=positive_int, help="default: the run's")
    p.add_argument(
        "--precision",
        choices=("fp32", "fp16", "bf16"),
        help="default: what the run trained in; another changes the bytes and the memory, not "
        "the times the census measured",
    )
    p.add_argument(
        "--census-micro-batch",
        type=positive_int,
        help="the micro-batch the census's block_ms was measured at (default: the run's)",
    )
    p.add_argument(
        "--calibration",
        help="JSON of fixed costs and factors overriding the defaults "
        f"({', '.join(f.name for f in dataclasses.fields(Calibration))})",
    )
    p.add_argument(
        "--top", type=positive_int, default=20, help="rows printed (default 20; --json gets all)"
    )
    p.add_argument("--json", metavar="OUT", help="write every candidate's prediction here")
    return p


def calibration(path: str | None, name: str = "--calibration") -> Calibration:
    """The Calibration a JSON file gives (the defaults for what it leaves out); `name`: what errors
    call it."""
    if not path:
        return Calibration()
    given = read_json(Path(path), name)
    known = {f.name for f in dataclasses.fields(Calibration)}
    if not isinstance(given, dict):
        raise ConfigError(f"{name} {path}: a JSON object of {', '.join(sorted(known))}")
    if set(given) - known:
        raise ConfigError(
            f"{name} {path}: unknown keys {sorted(set(given) - known)}; known: "
            f"{', '.join(sorted(known))}"
        )
    defaults = dataclasses.asdict(Calibration())
    for key, value in given.items():
        default = defaults[key]
        if isinstance(default, bool):
            ok, want = isinstance(value, bool), "true or false"
        elif isinstance(default, dict):
            ok, want = (
                isinstance(value, dict) and all(map(number, value.values())),
                "an object of seconds >= 0 per engine (ddp, zero0..zero3, pipeline, "
                "async-pipeline, 'ddp bf16')",
            )
            keys = calibration_keys()
            if ok and (unknown := sorted(set(value) - set(keys))):
                raise ConfigError(
                    f"{name} {path}: {key}: unknown keys {unknown}; known: {', '.join(keys)}"
                )
        elif isinstance(default, tuple):
            ok, want = (
                isinstance(value, list) and len(value) == len(default) and all(map(number, value)),
                f"a list of {len(default)} numbers >= 0 (one per ZeRO stage)",
            )
            given[key] = tuple(value) if ok else value
        else:
            ok, want = number(value), "a number >= 0"
        if not ok:
            raise ConfigError(f"{name} {path}: {key}: {want}, not {value!r}")
    return Calibration(**given)


def run_calibration() -> tuple[Calibration, str | None]:
    """A run's fixed costs (--engine auto, --partition balanced): $VIT_PLANNER_CALIBRATION, else
    logs/planner_calibration.json where it exists, else the defaults (None)."""
    source = os.environ.get(CALIBRATION) or (
        str(CALIBRATION_FILE) if CALIBRATION_FILE.is_file() else None
    )
    return calibration(source, CALIBRATION), source


def number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0


def setting(args, config: dict | None, name: str, value):
    """--name, else the run's config.json value, else ConfigError."""
    if value is not None:
        return value
    if not config or name not in config:
        raise ConfigError(
            f"no {name} in a config.json beside the cluster.json: give --{name.replace('_', '-')}"
        )
    return config[name]


def inputs(args) -> tuple[list, object, Workload, Calibration, str]:
    cluster, config = load_run(args.run)
    run_args = (config or {}).get("args", {})
    model = setting(args, config and run_args, "model", args.model)
    dataset = args.dataset or run_args.get("dataset", "synthetic")
    precision = args.precision or cluster.get("precision", "fp32")
    global_batch = setting(args, config, "global_batch", args.global_batch)
    micro = args.census_micro_batch or (config or {}).get("deepspeed", {}).get(
        "train_micro_batch_size_per_gpu"
    )
    if not micro and not all("layer_ms" in r for r in cluster["census"]):
        raise ConfigError(
            "the census's block_ms needs the micro-batch it was measured at: give "
            "--census-micro-batch"
        )
    if global_batch < 1:
        raise ConfigError(f"--global-batch {global_batch}: must be at least 1")
    layers, flops = profile_model(
        model,
        dataset,
        args.img_size or run_args.get("img_size"),
        precision,
        run_args.get("data_path"),
    )
    # the run's own profile (its precision, its device), where it made one
    measured = cluster.get("layers")
    if measured and len(measured) == len(layers) and precision == cluster.get("precision"):
        layers = [
            dataclasses.replace(x, act_bytes=float(m["act_bytes"]))
            for x, m in zip(layers, measured)
        ]
    # An --engine auto run: what auto measured and ranked with (config.json's engine_auto), so that
    # both rank with the same model on the same inputs, save its layer times, timed every rank at
    # once, which the census (timed in turns) does not hold.
    auto = (config or {}).get("engine_auto") or {}
    census, taken = cluster["census"], []
    if len(auto.get("contention", [])) == len(census):
        census = [{**r, "contention": k} for r, k in zip(census, auto["contention"])]
        taken.append("contention")
    ranks, how = ranks_from_census(census, flops, micro or 1)
    if "links_mbit" in auto and args.link_mbit is None and not args.link_file:
        net = Network(
            {h: m * 1e6 / 8 for h, m in auto["links_mbit"].items()},
            auto.get("latency_ms", args.latency_ms) / 1e3,
            same_host_bytes_s=args.same_host_gbit * 1e9 / 8,
        )
        taken.append("links")
    else:
        net = network(
            [r.host for r in ranks],
            args.link_mbit,
            args.link_file,
            args.latency_ms,
            args.same_host_gbit,
        )
    calib = calibration(args.calibration)
    if not args.calibration and "calibration" in auto:
        calib = Calibration(**auto["calibration"])
        taken.append("fixed costs")
    if taken:
        how += f"; {', '.join(taken)} from the run's engine_auto"
    work = Workload(tuple(layers), global_batch, precision, planner_inputs(run_args))
    return (
        ranks,
        net,
        work,
        calib,
        f"{model}, global batch {global_batch}, {precision}; "
        f"{len(ranks)} ranks on {len({r.host for r in ranks})} hosts; layer times {how}",
    )


def row(p: Prediction, global_batch: int) -> dict:
    c = p.candidate
    return {
        "candidate": label(c),
        **dataclasses.asdict(c),
        "step_ms": 1e3 * p.step_s,
        "images_per_s": p.images_per_s(global_batch),
        "compute_ms": 1e3 * p.compute_s,
        "link_ms": 1e3 * p.link_s,
        "bubble_ms": 1e3 * p.bubble_s,
        "fixed_ms": 1e3 * p.fixed_s,
        "bottleneck": p.bottleneck,
        "mem_gib": [m / 2**30 for m in p.mem_bytes],
        "capacity_gib": [m / 2**30 for m in p.capacity_bytes],
        "fits": p.fits,
        "slots": p.slots_paid,
    }


def table(rows: list[dict], top: int) -> str:
    width = max([len("candidate")] + [len(r["candidate"]) for r in rows[:top]])
    lines = [
        f"{'#':>3}  {'candidate':<{width}} {'ms/step':>9} {'images/s':>9} {'bottleneck':<10} "
        f"{'per-rank GiB':<24} fits"
    ]
    for i, r in enumerate(rows[:top], 1):
        mem = "/".join(f"{m:.2f}" for m in r["mem_gib"])
        lines.append(
            f"{i:>3}  {r['candidate']:<{width}} {r['step_ms']:>9.2f} {r['images_per_s']:>9.1f} "
            f"{r['bottleneck']:<10} {mem:<24} {'yes' if r['fits'] else 'no'}"
        )
    if len(rows) > top:
        lines.append(f"     ... {len(rows) - top} more (--top, --json)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    train = argv[argv.index("--") + 1 :] if "--" in argv else []
    p = parser()
    args = p.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    if (args.run is None) == (args.hostfile is None):
        p.error("give a run's log dir or --hostfile, one of the two")
    if args.json and (problem := unwritable(args.json)):
        p.error(f"--json {args.json}: {problem}")
    if args.hostfile:
        given = [
            k
            for k, v in vars(args).items()
            if k not in ("run", "hostfile", "json") and v != p.get_default(k)
        ]
        if given:
            p.error(
                f"--{given[0].replace('_', '-')} plans from a run's census; with --hostfile the "
                "ranks measure (vit.train options such as --model go after --)"
            )
        return measure_hostfile(args.hostfile, args.json, train)
    if train:
        p.error("vit.train options after -- go with --hostfile")
    try:
        ranks, net, work, calib, what = inputs(args)
        rows = [row(p, work.global_batch) for p in rank_candidates(ranks, net, work, calib)]
    except ConfigError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    links = (
        ", ".join(f"{h} {8 * b / 1e6:g} Mbit/s" for h, b in net.host_bytes_s.items())
        or "none (one host)"
    )
    print(f"planner: {what}; links {links}, latency {1e3 * net.latency_s:g} ms")
    print(table(rows, args.top))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "inputs": what,
                    "ranks": [
                        {
                            "host": r.host,
                            "capacity_gib": r.capacity_bytes / 2**30,
                            "layer_ms_per_sample": [
                                [1e3 * a, 1e3 * b] for a, b in zip(r.fwd_s, r.bwd_s)
                            ],
                        }
                        for r in ranks
                    ],
                    "links_mbit": {h: 8 * b / 1e6 for h, b in net.host_bytes_s.items()},
                    "latency_ms": 1e3 * net.latency_s,
                    "calibration": dataclasses.asdict(calib),
                    "candidates": rows,
                },
                f,
                indent=2,
            )
    return 0


def unwritable(out: str) -> str | None:
    """Why `out` cannot be written as a file (None: it can)."""
    folder = os.path.dirname(os.path.abspath(out))
    if os.path.isdir(out):
        return "a folder; give a file's path"
    if not os.path.isdir(folder):
        return f"its folder {folder} does not exist"
    if not os.access(folder, os.W_OK):
        return f"its folder {folder} is not writable"
    return None


def measure_hostfile(hostfile: str, out: str | None, train: list[str]) -> int:
    """--hostfile: `mpirun --hostfile HOSTFILE ./entry_cn.sh --engine auto TRAIN...` with
    $VIT_ENGINE_AUTO_PLAN_ONLY set, so that every rank measures, rank 0 prints the table and writes
    it (JSON) to `out`, and all stop."""
    try:
        slots = hostfile_slots(hostfile)
    except OSError as e:
        print(f"{PROG}: error: --hostfile {hostfile}: {e.strerror or e}", file=sys.stderr)
        return 2
    except ConfigError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    env = {**os.environ, PLAN_ONLY: os.path.abspath(out) if out else NO_FILE}
    cmd = [
        str(ROOT / "scripts" / "mpirun"),
        "-np",
        str(slots),
        "--hostfile",
        hostfile,
        "-x",
        PLAN_ONLY,
        str(ROOT / "entry_cn.sh"),
        "--engine",
        "auto",
        *train,
    ]
    return subprocess.run(cmd, env=env, cwd=ROOT).returncode
