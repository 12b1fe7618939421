"""The preflight's rules: hostfile slots, every problem in one message."""

import re

import pytest

from vit.core.errors import ConfigError
from vit.core.hostfile import hostfile_slots


def test_hostfile_slots(tmp_path):
    hf = tmp_path / "hosts.txt"
    hf.write_text("# cluster\ncn0 slots=2\ncn1 slots=1  # old card\n\ncn2\n")
    assert hostfile_slots(str(hf)) == 4


@pytest.mark.parametrize(
    "text, message",
    [
        ("localhost slots=abc\n", "line 1: slots=abc is not a whole number above 0"),
        ("cn0\ncn1 slots=0\n", "line 2: slots=0 is not a whole number above 0"),
        ("", "no host in it (one line per host: NAME slots=N)"),
        ("# only a comment\n\n", "no host in it (one line per host: NAME slots=N)"),
    ],
)
def test_a_hostfile_without_hosts_or_with_bad_slots_is_one_line(tmp_path, text, message):
    """Each one line before any process group (the run's exit 2), not a traceback on every rank."""
    from vit.config.cli import parse

    hf = tmp_path / "hosts.txt"
    hf.write_text(text)
    said = (
        f"hostfile {hf}, {message}" if message.startswith("line") else f"hostfile {hf}: {message}"
    )
    with pytest.raises(ConfigError, match=f"^{re.escape(said)}$"):
        hostfile_slots(str(hf))
    with pytest.raises(ConfigError, match=f"^{re.escape(said)}$"):
        parse(["--hostfile", str(hf)])
