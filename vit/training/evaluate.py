"""Evaluation on the held-out split at --eval-interval steps and at the end."""

from vit.data.augment import without_images
from vit.data.datasets import DataSplit
from vit.data.sampling import eval_batches, make_loader

TOP5_CLASSES = 5  # top-5 is reported only with more classes than this


def alive(batches, watchdog):
    """The batches, telling the watchdog of progress at each one."""
    for b in batches:
        watchdog.beat()
        yield b


class Evaluator:
    """evaluator.maybe(engine, step) after every step; evaluator.run(engine, step) at the end. One
    metrics record and a line on rank 0 per evaluation."""

    def __init__(
        self,
        data: DataSplit,
        *,
        micro_batch: int,
        workers: int,
        metrics,
        watchdog,
        interval: int,
        total_steps: int,
        is_main: bool,
    ):
        self.data, self.metrics, self.watchdog = data, metrics, watchdog
        self.micro_batch, self.workers = micro_batch, workers
        self.interval, self.total_steps, self.is_main = interval, total_steps, is_main
        # built once per data-parallel layout; its workers persist
        self.loader, self.loader_for = None, None

    def due(self, step: int) -> bool:
        """Whether maybe(step) evaluates (the last step's evaluation is the finish's)."""
        return bool(self.interval) and step % self.interval == 0 and step != self.total_steps

    def maybe(self, engine, step: int, ema=None) -> None:
        if self.due(step):
            self.run(engine, step, ema)

    def _once(self, engine, step: int, label: str) -> dict:
        lists = eval_batches(len(self.data.test), self.micro_batch, engine.dp_rank, engine.dp_size)
        if engine.reads_data:
            # a rebuilt engine may shard otherwise
            layout = (engine.dp_rank, engine.dp_size, engine.reads_images)
            if self.loader_for != layout:
                self.loader_for = layout
                test = (
                    self.data.test
                    if engine.reads_images
                    else without_images(self.data.test, self.data)
                )
                pin = engine.device.type == "cuda"
                self.loader = make_loader(test, lists, self.workers, pin)
            batches = self.loader
        else:
            batches = [(None, None)] * len(lists)
        loss_sum, correct, correct5, count = engine.evaluate(alive(batches, self.watchdog))
        result = {"eval_loss": loss_sum / count, "top1": correct / count}
        said = (
            f"loss {loss_sum / count:.4f} | top-1 {100 * correct / count:.2f}% ({correct}/{count})"
        )
        if self.data.num_classes > TOP5_CLASSES:  # with five classes or fewer top-5 is always 100%
            result["top5"] = correct5 / count
            said += f" | top-5 {100 * correct5 / count:.2f}%"
        if self.is_main:
            print(f"eval{label} at step {step}: {said}", flush=True)
        return result

    def run(self, engine, step: int, ema=None) -> dict:
        """The held-out loss, top-1 and top-5; with --model-ema (`ema`) also the average's, as
        ema_eval_loss, ema_top1, ..."""
        result = self._once(engine, step, "")
        if ema is not None:
            with ema.swapped_in(engine):
                result.update(
                    {f"ema_{k}": v for k, v in self._once(engine, step, " (EMA)").items()}
                )
        self.metrics.write("eval", step, **result)
        return result
