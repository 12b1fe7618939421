"""The runs that compare the engines, by name, and the vit.train options of each: one map for the
training benchmark and scripts/compare.sh (which asks `python -m bench.runs NAME`, one option per
line). Made from the engine registry: each engine's runs() (the ZeRO engine once per stage,
zero0..zero3, each with its zeroN.json)."""

import argparse
import sys

from vit.core.paths import DS_CONFIGS as CONFIGS
from vit.core.spec import EngineSpec
from vit.engines.registry import SPECS


def _runs() -> dict[str, tuple[EngineSpec, str]]:
    """Run name -> (its engine, its DeepSpeed JSON under CONFIGS), each engine's runs as its spec
    names them (EngineSpec.runs: ZeRO once per stage): the plain data-parallel baseline first, then
    DeepSpeed's data parallelism, then the pipelines."""
    engines = sorted(SPECS.values(), key=lambda e: (e.pipeline, not e.pipeline and e.deepspeed))
    return {name: (engine, config) for engine in engines for name, config in engine.runs().items()}


RUN_ENGINES = _runs()
RUNS = tuple(RUN_ENGINES)


def engine_options(
    name: str, pipeline_stages: int = 2, pipeline_config: str | None = None
) -> list[str]:
    """vit.train's engine options for run `name`; ValueError for a name that is not one of RUNS."""
    if name not in RUN_ENGINES:
        raise ValueError(f"unknown run '{name}' (choose from {', '.join(RUNS)})")
    engine, config = RUN_ENGINES[name]
    if engine.pipeline:
        return [
            "--engine",
            engine.name,
            "--pipeline-stages",
            str(pipeline_stages),
            "--ds-config",
            pipeline_config or str(CONFIGS / config),
        ]
    return ["--engine", engine.name, "--ds-config", str(CONFIGS / config)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.runs",
        description="Print the vit.train engine options of one comparison run, one per line.",
    )
    p.add_argument("name", help=", ".join(RUNS))
    p.add_argument("--pipeline-stages", type=int, default=2)
    p.add_argument(
        "--pipeline-config",
        help="DeepSpeed JSON of the pipeline run (default deepspeed_configs/pipeline.json)",
    )
    a = p.parse_args(argv)
    try:
        print("\n".join(engine_options(a.name, a.pipeline_stages, a.pipeline_config)))
    except ValueError as e:
        print(f"bench.runs: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
