"""Where things are in this checkout (vit is installed from it with `pip install -e .`)."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DS_CONFIGS = ROOT / "deepspeed_configs"  # the DeepSpeed JSON files users edit
LOGS = ROOT / "logs"  # run folders, unless --log-dir says otherwise
