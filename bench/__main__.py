"""python -m bench COMMAND ...: see bench/__init__.py."""

import argparse
import os
import sys

import bench
from bench import (
    allreduce,
    async_pipeline,
    compare,
    finetune,
    freeze,
    gpu,
    hetero,
    monitor,
    peak,
    planner,
    recipe,
    train,
    transfer,
)
from vit.run.cli import HelpFormatter
from vit.train import prepare_environment

MODULES = (
    train,
    allreduce,
    peak,
    hetero,
    monitor,
    recipe,
    compare,
    finetune,
    transfer,
    freeze,
    async_pipeline,
    gpu,
    planner,
)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench",
        description=bench.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", required=True)
    runs = {}
    for module in MODULES:
        for name, (text, add_arguments, run) in module.COMMANDS.items():
            add_arguments(
                sub.add_parser(name, help=text, description=text, formatter_class=HelpFormatter)
            )
            runs[name] = run
    a = p.parse_args(argv)
    if getattr(a, "out", None) and os.path.exists(a.out) and not os.path.isdir(a.out):
        # before any run: every benchmark writes its files there
        p.error(f"--out {a.out}: a file, not a folder")
    prepare_environment()  # DeepSpeed's op cache, as vit.train has it
    return runs[a.command](a)


if __name__ == "__main__":
    sys.exit(main())
