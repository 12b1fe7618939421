"""The runs that compare the engines, by name, and the vit.train options of each: one map for the training
benchmark and scripts/compare.sh (which asks `python -m bench.runs NAME`, one option per line)."""
import argparse
import sys

from vit.settings import ROOT

CONFIGS = ROOT / "deepspeed_configs"
RUNS = ("ddp", "zero0", "zero1", "zero2", "zero3", "pipeline", "async-pipeline")


def engine_options(name: str, pipeline_stages: int = 2, pipeline_config: str | None = None) -> list[str]:
    """vit.train's engine options for run `name`; ValueError for a name that is not one of RUNS."""
    if name == "ddp":
        return ["--engine", "ddp", "--ds-config", str(CONFIGS / "zero0.json")]
    if name in ("zero0", "zero1", "zero2", "zero3"):
        return ["--engine", "zero", "--ds-config", str(CONFIGS / f"{name}.json")]
    if name in ("pipeline", "async-pipeline"):
        return ["--engine", name, "--pipeline-stages", str(pipeline_stages), "--ds-config",
                pipeline_config or str(CONFIGS / "pipeline.json")]
    raise ValueError(f"unknown run '{name}' (choose from {', '.join(RUNS)})")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.runs", description="Print the vit.train engine options of "
                                "one comparison run, one per line.")
    p.add_argument("name", help=", ".join(RUNS))
    p.add_argument("--pipeline-stages", type=int, default=2)
    p.add_argument("--pipeline-config", help="DeepSpeed JSON of the pipeline run (default deepspeed_configs/"
                   "pipeline.json)")
    a = p.parse_args(argv)
    try:
        print("\n".join(engine_options(a.name, a.pipeline_stages, a.pipeline_config)))
    except ValueError as e:
        print(f"bench.runs: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
