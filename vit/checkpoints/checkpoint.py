"""Checkpoints that are never half-loaded.

<save-dir>/step<N>/ counts as a checkpoint only when it holds manifest.json: every file with its
size and sha256, the step, the config hash and the world layout. A save writes into
<save-dir>/.tmp-step<N>/, adds the manifest, renames the folder into place, then points
<save-dir>/latest at it, and keeps the newest K. Loading looks at complete checkpoints only, newest
first, verifies the manifest and falls back to the previous one when the newest is damaged. Every
rank must see the folder (shared storage).
"""

import hashlib
import json
import os
import random
import re
import shutil
import socket
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from timm.models import split_model_name_tag

from vit.checkpoints.universal import converted
from vit.core.errors import CannotGoOn, ConfigError
from vit.core.spec import EngineSpec
from vit.runtime import plugins

MANIFEST = "manifest.json"
TMP_PREFIX = ".tmp-"
TAG = re.compile(r"^step(\d+)$")
# What resuming reads from a manifest; one without any of them is a damaged checkpoint.
MANIFEST_KEYS = (
    "step",
    "files",
    "engine",
    "world_size",
    "data_parallel_size",
    "pipeline_stages",
    "zero_stage",
)


class CheckpointError(RuntimeError):
    pass


def tag_for(step: int) -> str:
    return f"step{step}"


def complete_tags(save_dir) -> list[str]:
    """Tags of the complete checkpoints in save_dir (those with a manifest), newest first."""
    d = Path(save_dir)
    if not d.is_dir():
        return []
    tags = [p.name for p in d.iterdir() if TAG.match(p.name) and (p / MANIFEST).is_file()]
    return sorted(tags, key=lambda t: int(TAG.match(t).group(1)), reverse=True)


def locate(path: str) -> tuple[str, list[str]]:
    """(save dir, candidate tags newest first) for --resume PATH: a save dir, or one checkpoint
    folder."""
    p = Path(path)
    if (p / MANIFEST).is_file() and TAG.match(p.name):
        return str(p.parent), [p.name]
    tags = complete_tags(p)
    if tags:
        return str(p), tags
    partial = sorted(q.name for q in p.glob(f"{TMP_PREFIX}*")) if p.is_dir() else []
    note = f" (only unfinished saves: {', '.join(partial)})" if partial else ""
    raise ConfigError(f"--resume {path}: no complete checkpoint there{note}")


class DamagedManifest(ValueError):
    """A manifest that cannot be read, is not JSON, or lacks what loading and checking the
    checkpoint need."""


def read_manifest(save_dir: str, tag: str) -> dict:
    try:
        manifest = json.loads((Path(save_dir) / tag / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise DamagedManifest(f"unreadable manifest: {e}") from None
    missing = (
        [k for k in MANIFEST_KEYS if k not in manifest]
        if isinstance(manifest, dict)
        else ["everything"]
    )
    if missing:
        raise DamagedManifest(f"its manifest lacks {', '.join(missing)}")
    if not isinstance(manifest["files"], dict) or not all(
        isinstance(m, dict) and {"size", "sha256"} <= m.keys() for m in manifest["files"].values()
    ):
        raise DamagedManifest("its manifest's files are not a list of sizes and sha256 sums")
    return manifest


def check_shape(saved: dict, current: dict, where: str, engine: EngineSpec) -> bool:
    """Refuse to resume under a layout the checkpoint cannot be loaded into, and say what would;
    True where it loads through DeepSpeed's universal checkpoint (ZeRO state sharded over another
    number of data-parallel ranks or pipeline stages, or resumed by an engine that takes ZeRO's:
    vit.checkpoints.universal). Which checkpoints `engine` takes, and on which stages, its spec
    says."""
    # the architecture: a pretrained tag (.augreg_in21k) makes no other shapes
    model = saved.get("model")
    if model and split_model_name_tag(model)[0] != split_model_name_tag(current["model"])[0]:
        raise ConfigError(
            f"{where} was written by --model {model}, this run uses --model {current['model']}; "
            f"resume with --model {model}"
        )
    takes = engine.resumes(saved, where)
    if takes == "universal":
        return True
    if takes is None:
        raise ConfigError(
            f"{where} was written by --engine {saved['engine']}, this run uses --engine "
            f"{current['engine']}; resume with --engine {saved['engine']}"
        )
    # 1 for an engine without stages; an engine that restages takes another number (by name, or
    # ZeRO's state through DeepSpeed's universal checkpoint)
    restaged = saved["pipeline_stages"] != current["pipeline_stages"]
    if restaged and not engine.restages(saved):
        world = current["data_parallel_size"] * current["pipeline_stages"]
        # on ranks its stages do not divide, the run goes on only once a host is back (exit 3)
        refusal = CannotGoOn if world % saved["pipeline_stages"] else ConfigError
        raise refusal(
            f"{where} has {saved['pipeline_stages']} pipeline stages, this run "
            f"{current['pipeline_stages']}; resume with --pipeline-stages "
            f"{saved['pipeline_stages']} on a multiple of {saved['pipeline_stages']} ranks (its "
            f"ZeRO-{saved['zero_stage']} state loads only into its own stages; "
            "--export writes its weights)"
        )
    if saved["zero_stage"] != current["zero_stage"]:
        raise ConfigError(
            f"{where} was written with ZeRO stage {saved['zero_stage']}, this run uses stage "
            f"{current['zero_stage']}; resume with the same DeepSpeed config"
        )
    resharded = saved["data_parallel_size"] != current["data_parallel_size"]
    return (resharded or restaged) and saved["zero_stage"] > 0


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def verify(folder: Path) -> str | None:
    """None when every file of the manifest is there with its size and sha256, else what is
    wrong."""
    try:
        manifest = read_manifest(str(folder.parent), folder.name)
    except DamagedManifest as e:
        return str(e)
    for name, meta in manifest["files"].items():
        f = folder / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != meta["size"]:
            return f"{name} has {f.stat().st_size} bytes, the manifest says {meta['size']}"
        if _sha256(f) != meta["sha256"]:
            return f"{name} does not match its sha256"
    return None


def choose(save_dir: str, tags: list[str]) -> str:
    """Rank 0: the newest candidate that verifies; warns about each damaged one it skips."""
    for tag in tags:
        problem = verify(Path(save_dir) / tag)
        if problem is None:
            return tag
        print(
            f"warning: checkpoint {save_dir}/{tag} is damaged ({problem}); trying the previous one",
            flush=True,
        )
    # a ConfigError (exit 2): a relaunch would find the same files, so retry.sh does not relaunch
    raise ConfigError(
        f"no undamaged checkpoint in {save_dir} (tried {', '.join(tags)}): nothing to resume "
        "from; move them aside (or give another --log-dir) to start over"
    )


def rng_state() -> dict:
    state = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def save(
    engine, save_dir: str, step: int, client_state: dict, meta: dict, keep: int, ema=None
) -> None:
    """Collective: every rank calls it. Raises CheckpointError naming the checkpoint that stays
    valid."""
    tag, rank = tag_for(step), dist.get_rank()
    tmp = Path(save_dir) / (TMP_PREFIX + tag)
    previous = (complete_tags(save_dir) or ["none"])[0]
    try:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # left by a crash
        dist.barrier()
        engine.save(save_dir, tmp.name, client_state)
        torch.save(rng_state(), tmp / f"rng_rank{rank}.pt")
        if ema is not None:  # --model-ema: each rank's average of the layers it holds
            torch.save(ema.state_dict(), tmp / f"ema_rank{rank}.pt")
        plugins.call("checkpoint_written", tag)  # tests: die between the files and the manifest
        seen = [None] * dist.get_world_size()
        dist.all_gather_object(seen, (socket.gethostname(), _files(tmp)))
        if rank == 0:
            _commit(save_dir, tmp, tag, step, meta, seen, keep)
        dist.barrier()
    except Exception as e:
        free_mib = (
            shutil.disk_usage(save_dir).free / 2**20 if os.path.isdir(save_dir) else float("nan")
        )
        if rank == 0:  # never a checkpoint: nothing half-written stays (rank 0 ends here too)
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(
            f"saving checkpoint {tag} in {save_dir} failed on rank {rank} "
            f"({socket.gethostname()}; {free_mib:.1f} MiB free there): {e}; the previous "
            f"checkpoint ({previous}) is still valid"
        ) from e


def _commit(
    save_dir: str, tmp: Path, tag: str, step: int, meta: dict, seen: list, keep: int
) -> None:
    mine = set(_files(tmp))
    for host, files in seen:
        missing = set(files) - mine
        if missing:
            raise CheckpointError(
                f"rank 0 cannot see {sorted(missing)[0]} written on host {host}: "
                "put --save-dir on storage every host shares"
            )
    files = {
        name: {"size": (tmp / name).stat().st_size, "sha256": _sha256(tmp / name)}
        for name in sorted(mine)
    }
    manifest = {"step": step, "tag": tag, "created": time.time(), "files": files, **meta}
    with open(tmp / MANIFEST, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    final = Path(save_dir) / tag
    # a damaged checkpoint the resume fell back past: kept for a look, never overwritten
    if final.exists():
        aside = _free_name(final, ".damaged")
        os.rename(final, aside)
        print(f"warning: moved the damaged checkpoint {final} aside to {aside.name}", flush=True)
    os.rename(tmp, final)
    latest = Path(save_dir) / "latest"
    with open(f"{latest}.tmp", "w") as f:
        f.write(tag)
        f.flush()
        os.fsync(f.fileno())
    os.replace(f"{latest}.tmp", latest)
    for old in complete_tags(save_dir)[keep:]:
        shutil.rmtree(Path(save_dir) / old)


def _free_name(folder: Path, suffix: str) -> Path:
    """step8.damaged, else step8.damaged2, ...: a name beside `folder` that nothing uses yet."""
    n = 1
    while (candidate := folder.with_name(f"{folder.name}{suffix}{n if n > 1 else ''}")).exists():
        n += 1
    return candidate


def load(engine, save_dir: str, tag: str, ema=None, universal: bool = False) -> dict:
    """Load a checkpoint chosen by `choose`; restores this rank's random state and the EMA's.
    `universal`: its ZeRO state is of another data-parallel size (vit.checkpoints.universal)."""
    if universal:
        with converted(save_dir, tag) as load_dir:
            client_state = engine.load(load_dir, tag)
    else:
        client_state = engine.load(save_dir, tag)
    rng = Path(save_dir) / tag / f"rng_rank{dist.get_rank()}.pt"
    if rng.is_file():
        set_rng_state(torch.load(rng, weights_only=False))
    if ema is not None:
        load_ema(ema, Path(save_dir) / tag)
    return client_state


def load_ema(ema, folder: Path) -> None:
    """--model-ema's average of the layers this rank holds, by name (a layer's global index), from
    whichever rank's file holds them: each data-parallel copy saved its whole model or its pipeline
    stage, so another number of ranks or stages finds every name it needs (this rank's own file
    first: on the same layout the only one read)."""
    own = f"ema_rank{dist.get_rank()}.pt"
    files = sorted(folder.glob("ema_rank*.pt"), key=lambda f: (f.name != own, f.name))
    if not files:
        raise ConfigError(
            f"{folder} holds no EMA weights (written without "
            "--model-ema); resume without --model-ema"
        )
    want, found = ema.state_dict(), {}
    for f in files:
        state = torch.load(f, map_location="cpu", weights_only=True)
        found.update({k: v for k, v in state.items() if k in want and k not in found})
        if len(found) == len(want):
            break
    missing = [k for k in want if k not in found]
    misfit = [k for k in want if k in found and found[k].shape != want[k].shape]
    if missing or misfit:
        k = (missing or misfit)[0]
        held = tuple(found[k].shape) if k in found else "missing"
        raise ConfigError(
            f"{folder}'s EMA weights do not fit this rank's layers: {k} is {held}, the model's is "
            f"{tuple(want[k].shape)} ({len(missing) + len(misfit)} of its tensors missing or of "
            "another shape); resume on the layout that wrote it, or without --model-ema"
        )
    ema.load_state_dict(found)


class Checkpointer:
    """Decides its own cadence: save(engine, step) after every step saves at each --save-interval;
    save(engine, step, last_step=True) at the end saves unless that step was just saved."""

    def __init__(
        self,
        save_dir: str,
        *,
        interval: int,
        enabled: bool,
        keep: int,
        meta: dict,
        on_progress,
        extra_state=None,
        ema=None,
    ):
        """extra_state(): a collective returning what the manifest and the client state also record
        (--freeze's state: the manifest says how many layers to freeze before the engine that loads
        it is built); ema: --model-ema's average, saved beside the engine's state."""
        self.save_dir, self.interval, self.enabled = save_dir, interval, enabled
        self.keep, self.meta, self.on_progress, self.extra_state = (
            keep,
            meta,
            on_progress,
            extra_state,
        )
        self.saved_step, self.ema = None, ema

    def due(self, step: int, last_step: bool = False) -> bool:
        """Whether save(step) writes a checkpoint."""
        at = last_step or (self.interval and step % self.interval == 0)
        return bool(self.enabled and at and step != self.saved_step)

    def save(self, engine, step: int, last_step: bool = False) -> None:
        if not self.due(step, last_step):
            return
        self.on_progress()
        extra = self.extra_state() if self.extra_state else {}
        save(
            engine,
            self.save_dir,
            step,
            {"step": step, "engine": self.meta["engine"], **extra},
            {**self.meta, **extra},
            self.keep,
            self.ema,
        )
        self.saved_step = step


def step_of(tag: str) -> int:
    return int(TAG.match(tag).group(1))
