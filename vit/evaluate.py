"""Evaluation on the held-out split at --eval-interval steps and at the end."""
from vit.data import DataSplit, eval_batches, make_loader


def alive(batches, watchdog):
    """The batches, telling the watchdog of progress at each one."""
    for b in batches:
        watchdog.beat()
        yield b


class Evaluator:
    """evaluator.maybe(step) after every step; evaluator.run(step) at the end. One metrics record and a line on
    rank 0 per evaluation."""

    def __init__(self, engine, data: DataSplit, *, micro_batch: int, workers: int, pin_memory: bool, metrics,
                 watchdog, interval: int, total_steps: int, is_main: bool):
        self.engine, self.data, self.metrics, self.watchdog = engine, data, metrics, watchdog
        self.micro_batch, self.workers, self.pin_memory = micro_batch, workers, pin_memory
        self.interval, self.total_steps, self.is_main = interval, total_steps, is_main
        self.loader = None  # built once: the same batches every evaluation, and its workers persist

    def maybe(self, step: int) -> None:
        if self.interval and step % self.interval == 0 and step != self.total_steps:
            self.run(step)

    def run(self, step: int) -> tuple[float, float]:
        engine = self.engine
        lists = eval_batches(len(self.data.test), self.micro_batch, engine.dp_rank, engine.dp_size)
        if engine.reads_data:
            if self.loader is None:
                self.loader = make_loader(self.data.test, lists, self.workers, self.pin_memory)
            batches = self.loader
        else:
            batches = [(None, None)] * len(lists)
        loss_sum, correct, count = engine.evaluate(alive(batches, self.watchdog))
        eval_loss, top1 = loss_sum / count, correct / count
        self.metrics.write("eval", step, eval_loss=eval_loss, top1=top1)
        if self.is_main:
            print(f"eval at step {step}: loss {eval_loss:.4f} | top-1 {100 * top1:.2f}% ({correct}/{count})",
                  flush=True)
        return eval_loss, top1
