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
    from vit.run.cli import parse

    hf = tmp_path / "hosts.txt"
    hf.write_text(text)
    said = (
        f"hostfile {hf}, {message}" if message.startswith("line") else f"hostfile {hf}: {message}"
    )
    with pytest.raises(ConfigError, match=f"^{re.escape(said)}$"):
        hostfile_slots(str(hf))
    with pytest.raises(ConfigError, match=f"^{re.escape(said)}$"):
        parse(["--hostfile", str(hf)])


def test_preflight_lists_every_problem_in_one_message():
    from vit.runtime.preflight import problems

    ok = {
        "host": "cn0",
        "python": "3.11.7",
        "torch": "2.14.1",
        "deepspeed": "0.19.8",
        "timm": "1.0.31",
        "GLOO_SOCKET_IFNAME": "eno1",
        "NCCL_SOCKET_IFNAME": "eno1",
    }
    reports = [
        ok,
        {**ok, "host": "cn1", "NCCL_SOCKET_IFNAME": "enp3s0"},
        {**ok, "host": "cn2", "torch": "2.13.0", "GLOO_SOCKET_IFNAME": ""},
    ]
    assert problems(reports[:2], 2, 2) == []  # another interface name on another host is fine
    found = problems(reports, 3, 2)
    assert found == [
        "world size 3 is more than the hostfile's 2 slots",
        "torch: rank 0 (cn0) has 2.14.1, but rank 2 (cn2) has 2.13.0",
        "GLOO_SOCKET_IFNAME: rank 0 (cn0) has eno1, but rank 2 (cn2) has none",
    ]


def fake_cuda_home(tmp_path, release):
    """A CUDA toolkit folder whose bin/nvcc answers --version as NVIDIA's does."""
    home = tmp_path / f"cuda-{release}"
    (home / "bin").mkdir(parents=True)
    nvcc = home / "bin" / "nvcc"
    nvcc.write_text(
        "#!/bin/sh\necho 'nvcc: NVIDIA (R) Cuda compiler driver'\n"
        f"echo 'Cuda compilation tools, release {release}, V{release}.41'\n"
    )
    nvcc.chmod(0o755)
    return str(home)


def test_zero_offload_on_gpus_says_which_cuda_toolkit_to_install(tmp_path):
    from vit.runtime.preflight import cpu_adam_problem, offloads_optimizer

    assert offloads_optimizer(
        {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    )
    assert not offloads_optimizer({"zero_optimization": {"stage": 2}})
    assert (
        cpu_adam_problem("13.0", None, built=True) is None
    )  # prebuilt, or already in the extensions cache
    assert cpu_adam_problem("13.0", fake_cuda_home(tmp_path, "13.0"), built=False) is None
    assert (
        cpu_adam_problem("13.0", fake_cuda_home(tmp_path, "13.1"), built=False) is None
    )  # DeepSpeed: same major
    assert cpu_adam_problem("13.0", None, built=False).startswith(
        "no CUDA toolkit (CUDA_HOME unset, no nvcc on PATH or in /usr/local/cuda): install the "
        "CUDA 13.0 toolkit "
        "(NVIDIA's cuda-toolkit-13-0 package) and set CUDA_HOME to it"
    )
    old = fake_cuda_home(tmp_path, "12.4")
    assert cpu_adam_problem("13.0", old, built=False).startswith(
        f"the CUDA toolkit at {old} is 12.4, this torch is built with CUDA 13.0: install the CUDA "
        f"13.0 toolkit"
    )
    assert "has no working bin/nvcc" in cpu_adam_problem(
        "12.6", str(tmp_path / "empty"), built=False
    )
