"""What the two DeepSpeed engines (ZeRO and pipeline) share: DeepSpeed's comm layer, its checkpoints, its loss
scaler's skipped steps."""
import torch.distributed as dist

from vit.engines.base import Engine


def deepspeed_comm() -> None:
    """DeepSpeed's comm layer over the torch.distributed group that is already running."""
    import deepspeed

    deepspeed.init_distributed(dist_backend=dist.get_backend())


class DeepSpeedEngine(Engine):
    """A subclass sets ds_engine (the DeepSpeedEngine or PipelineEngine that deepspeed.initialize returned) and
    optimizer."""

    @property
    def skipped_steps(self) -> int:
        return self.ds_engine.skipped_steps

    @property
    def loss_scale(self) -> float | None:
        return float(self.ds_engine.optimizer.loss_scale) if self.ds_engine.fp16_enabled() else None

    @property
    def lr(self) -> float:
        return max(g["lr"] for g in self.optimizer.param_groups)  # the head's, under --layer-decay

    def save(self, save_dir, tag, client_state):
        # No 'latest' from DeepSpeed: vit.checkpoint points at a checkpoint once it is complete.
        self.ds_engine.save_checkpoint(save_dir, tag=tag, client_state=client_state, save_latest=False)

    def load(self, load_dir, tag):
        path, client_state = self.ds_engine.load_checkpoint(load_dir, tag=tag)
        if path is None:
            raise RuntimeError(f"DeepSpeed could not load checkpoint {tag} from {load_dir}")
        return client_state
