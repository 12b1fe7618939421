#!/usr/bin/env python3
"""Charts, a comparison table and one self-contained report.html from run folders written by
vit.train: the command line of vit.reports.charts, which reads only the logs' schema
(vit.reports.runlogs), never stdout."""

import argparse
import os
import sys
from pathlib import Path

from vit.reports.charts import write
from vit.reports.runlogs import LogError, Run


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="plot_logs.py",
        description="Charts (PNG), a comparison table (markdown and CSV) and "
        "report.html "
        "from one or more run folders of vit.train. Charts: loss.png (train/eval loss, eval top-1 "
        "and top-5), "
        "throughput.png (images/s), resources.png (GPU utilisation and memory per host and GPU; "
        "host CPU % and "
        "process RSS), breakdown.png (step-time phases per rank, stacked), for several runs "
        "compare.png, and for runs "
        "that froze layers (--freeze) freeze.png (frozen layers over the steps, images/s per "
        "phase) and a table of "
        "the phases in comparison.md.",
    )
    p.add_argument("runs", nargs="+", help="run folders (logs/<run>)")
    p.add_argument(
        "--out",
        help="output folder (default: <run>/plots for one run, <common parent "
        "of the runs>/plots "
        "for several)",
    )
    args = p.parse_args(argv)
    try:
        runs = [Run(r) for r in args.runs]
        seen = {}
        for run in runs:  # same folder name under different parents
            seen[run.name] = seen.get(run.name, 0) + 1
            if seen[run.name] > 1:
                run.name = f"{run.name}-{seen[run.name]}"
        if args.out:
            out = Path(args.out)
        elif len(runs) == 1:
            out = runs[0].path / "plots"
        else:
            out = Path(os.path.commonpath([r.path.resolve() for r in runs])) / "plots"
        md, charts = write(runs, out)
    except (LogError, OSError) as e:
        print(f"plot_logs.py: error: {e}", file=sys.stderr)
        return 1
    print(md, end="")
    print(f"wrote {len(charts)} charts, comparison.md, comparison.csv and report.html to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
