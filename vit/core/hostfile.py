"""The launch's hostfile (Open MPI's and DeepSpeed's format: `host slots=N` a line, # comments)."""

from pathlib import Path

from vit.core.errors import ConfigError


def hostfile_slots(path: str) -> int:
    """Total slots of an Open MPI / DeepSpeed hostfile (`host slots=N`; a host without slots= counts
    1). A slots= that is not a whole number above 0, or a file without a host, is a ConfigError."""
    total = 0
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        words = line.split("#")[0].split()
        if not words:
            continue
        slots = [w.split("=", 1)[1] for w in words[1:] if w.startswith("slots=")]
        if slots and not (slots[0].isdigit() and int(slots[0]) > 0):
            raise ConfigError(
                f"hostfile {path}, line {number}: slots={slots[0]} is not a whole number above 0"
            )
        total += int(slots[0]) if slots else 1
    if total == 0:
        raise ConfigError(f"hostfile {path}: no host in it (one line per host: NAME slots=N)")
    return total
