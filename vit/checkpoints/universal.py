"""A ZeRO checkpoint resumed on another layout: DeepSpeed's universal checkpoint. The ZeRO and
pipeline engines save what DeepSpeed's converter needs (engines/zero/engine.py,
engines/pipeline/engine.py); a resume that changes the data-parallel size (or, for the pipeline,
the stages) has rank 0 convert the checkpoint with `python -m deepspeed.checkpoint.ds_to_universal`
into a folder beside it (a pipeline's layer files linked in), every rank's engine load it with the
JSON's checkpoint.load_universal set (vit.run.plan), and rank 0 remove the folder."""

import shutil
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import torch.distributed as dist

from vit.core.errors import ConfigError
from vit.runtime.dist_env import rank0_decides

LOAD_UNIVERSAL = "load_universal"  # DeepSpeed's JSON: "checkpoint": {"load_universal": true}


def convert(save_dir: str, tag: str, out: Path) -> None:
    """DeepSpeed's converter on checkpoint save_dir/tag, into out/tag; one line when it cannot."""
    shutil.rmtree(out, ignore_errors=True)  # what an earlier attempt left
    args = ["--input_folder", str(Path(save_dir) / tag), "--output_folder", str(out / tag)]
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "deepspeed.checkpoint.ds_to_universal",
            *args,
            "--num_extract_workers",
            "1",
            "--num_merge_workers",
            "1",
        ],
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        shutil.rmtree(out, ignore_errors=True)
        lines = [line for line in (r.stderr or r.stdout).splitlines() if line.strip()]
        why = lines[-1] if lines else f"exit {r.returncode}"
        raise ConfigError(
            f"checkpoint {save_dir}/{tag} holds ZeRO state of another layout (data-parallel "
            f"ranks or pipeline stages) and DeepSpeed's ds_to_universal could not convert it "
            f"({why}); resume it on the layout that wrote it"
        )
    # a pipeline's weights load layer by layer (PipelineModule.load_state_dir), from the folder
    # the universal checkpoint is read from
    for layer in (Path(save_dir) / tag).glob("layer_*-model_states.pt"):
        (out / tag / layer.name).symlink_to(layer.resolve())


@contextmanager
def converted(save_dir: str, tag: str):
    """Collective: the folder to load checkpoint `tag` from as a universal checkpoint, for the
    with-block; removed after it."""
    out = Path(save_dir) / f".universal-{tag}"
    rank0_decides(lambda: convert(save_dir, tag, out))
    try:
        yield str(out)
    finally:
        dist.barrier()  # every rank has read it
        if dist.get_rank() == 0:
            shutil.rmtree(out, ignore_errors=True)
