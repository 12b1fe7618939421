"""Where checkpoints live: <save-dir>/<tag>/ per checkpoint and <save-dir>/latest naming the newest."""
from pathlib import Path

from vit.config import ConfigError


def tag_for(step: int) -> str:
    return f"step{step}"


def locate(path: str) -> tuple[str, str]:
    """(checkpoint folder, tag) for --resume PATH: a save dir with a `latest` file, or one tag folder."""
    p = Path(path)
    if (p / "latest").is_file():
        tag = (p / "latest").read_text().strip()
        if not (p / tag).is_dir():
            raise ConfigError(f"--resume {path}: 'latest' names {tag}, which is not there")
        return str(p), tag
    if p.is_dir() and any(p.iterdir()) and (p.parent / "latest").is_file():
        return str(p.parent), p.name
    raise ConfigError(f"--resume {path}: no checkpoint there (neither a 'latest' file nor a checkpoint folder)")
