"""scripts/bootstrap.sh's choice of torch build, with a fake nvidia-smi on PATH (the true outer
boundary: there is no GPU here) answering exactly the two queries the script makes, and with no
nvidia-smi at all; and the .venv stamp that makes a different choice replace torch."""

import hashlib
import os
import shutil
import sys

import pytest
from helpers import ROOT, base_env, run_cmd

pytestmark = [pytest.mark.ranks, pytest.mark.timeout(60)]  # every test here starts processes

BOOTSTRAP = str(ROOT / "scripts" / "bootstrap.sh")
PYPI = "pip install torch==2.14.1 torchvision==0.29.1 from PyPI"
CU126 = "pip install torch==2.14.1 torchvision==0.29.1 from https://download.pytorch.org/whl/cu126"
# The commands bootstrap.sh runs for --print-torch, and nothing else: PATH holds only these (and, in
# a test that wants one, the fake nvidia-smi), so that a real nvidia-smi on a GPU machine cannot
# answer instead.
TOOLS = ["bash", "dirname", "basename", "awk", "sed", "grep", "sort", "head", "paste", "cut"]
NO_GPU_ADAM = "DeepSpeed's CPU Adam: not prebuilt: no GPU build of torch on a GPU host"

FAKE_SMI = """#!/bin/sh
# nvidia-smi of a host with driver $FAKE_DRIVER and one GPU per compute capability in $FAKE_CAPS;
# other arguments fail as the real one fails on a field it does not know.
case "$*" in
  "--query-gpu=driver_version --format=csv,noheader")
    for cap in $FAKE_CAPS; do echo "$FAKE_DRIVER"; done ;;
  "--query-gpu=compute_cap --format=csv,noheader")
    for cap in $FAKE_CAPS; do echo "$cap"; done ;;
  *) echo "fake nvidia-smi: unexpected arguments: $*"; exit 2 ;;
esac
"""


@pytest.fixture
def path(tmp_path):
    """PATH with the tools bootstrap.sh needs and no nvidia-smi; fake_smi(driver, caps) adds one."""
    tools = tmp_path / "tools"
    tools.mkdir()
    for tool in TOOLS:
        (tools / tool).symlink_to(shutil.which(tool))
    return str(tools)


def fake_smi(tmp_path, path):
    smi_dir = tmp_path / "smi"
    smi_dir.mkdir()
    (smi_dir / "nvidia-smi").write_text(FAKE_SMI)
    (smi_dir / "nvidia-smi").chmod(0o755)
    return f"{smi_dir}:{path}"


def fake_nvcc(folder, release):
    """A CUDA toolkit at `folder` whose bin/nvcc prints what the real one prints for `release`."""
    (folder / "bin").mkdir(parents=True)
    nvcc = folder / "bin" / "nvcc"
    nvcc.write_text(
        "#!/bin/sh\necho 'nvcc: NVIDIA (R) Cuda compiler driver'\n"
        f"echo 'Cuda compilation tools, release {release}, V{release}.88'\n"
    )
    nvcc.chmod(0o755)
    return folder


def print_torch(tmp_path, path, **env):
    hidden = ("TORCH_CUDA", "CUDA_HOME", "CUDA_PATH")
    env = {k: v for k, v in base_env().items() if k not in hidden} | dict(
        PATH=path, VENV=str(tmp_path / "venv"), **env
    )
    r = run_cmd([BOOTSTRAP, "--print-torch"], timeout=30, env=env)
    assert not (tmp_path / "venv").exists(), "--print-torch made a venv"
    return r


@pytest.mark.parametrize(
    "driver, caps, build, why, pip",
    [
        (
            "550.54.15",
            "8.6",
            "cu126",
            "driver 550.54.15, compute capability 8.6; cu130 needs driver >= 580.65.06",
            CU126,
        ),
        (
            "535.183.01",
            "8.6 8.6",
            "cu126",
            "driver 535.183.01, compute capability 8.6; cu130 needs driver >= 580.65.06",
            CU126,
        ),
        ("580.65.06", "8.6", "cu130", "driver 580.65.06, compute capability 8.6", PYPI),
        (
            "580.65.06",
            "6.1 8.6",
            "cu126",  # a GTX 1080 beside an RTX 3070
            "driver 580.65.06, compute capability 6.1 8.6; cu130 has no kernels for compute "
            "capability "
            "6.1",
            CU126,
        ),
    ],
)
def test_print_torch_follows_the_driver_and_gpus(tmp_path, path, driver, caps, build, why, pip):
    """550 (CUDA 12.4, an RTX 3070 host), 535 (CUDA 12.2): cu126; 580 (CUDA 13.0): the PyPI wheel,
    cu130, unless a GPU is older than Turing."""
    r = print_torch(tmp_path, fake_smi(tmp_path, path), FAKE_DRIVER=driver, FAKE_CAPS=caps)
    assert r.returncode == 0 and r.stderr == "", r
    first, second, adam = r.stdout.splitlines()
    assert first.startswith(f"{build}: {why}"), r.stdout
    assert second == pip
    assert adam.startswith("DeepSpeed's CPU Adam: "), r.stdout


@pytest.mark.parametrize(
    "driver, caps, why",
    [
        (
            "470.256.02",
            "8.6",
            "(driver 470.256.02, compute capability 8.6); cu130 needs driver >= "
            "580.65.06; "
            "cu126 needs driver >= 525.60.13: update the NVIDIA driver, or TORCH_CUDA=cpu",
        ),  # CUDA 11.4
        (
            "570.124.06",
            "12.0",
            "cu130 needs driver >= 580.65.06; cu126 has no kernels for compute "
            "capability 12.0: "
            "update the NVIDIA driver",
        ),  # an RTX 5090 on a driver before 580
    ],
)
def test_print_torch_refuses_a_host_no_build_runs_on(tmp_path, path, driver, caps, why):
    r = print_torch(tmp_path, fake_smi(tmp_path, path), FAKE_DRIVER=driver, FAKE_CAPS=caps)
    assert r.returncode == 2 and r.stdout == "", r
    assert (
        r.stderr.startswith("bootstrap.sh: no torch 2.14.1 build runs on this host")
        and why in r.stderr
    ), r
    assert len(r.stderr.splitlines()) == 1


def test_print_torch_without_nvidia_smi_takes_the_pypi_wheel(tmp_path, path):
    r = print_torch(tmp_path, path, CUDA_HOME=str(fake_nvcc(tmp_path / "cuda", "13.0")))
    assert r.returncode == 0 and r.stderr == "", r
    first, second, adam = r.stdout.splitlines()
    assert first.startswith("cu130: no nvidia-smi here") and "runs on the CPU" in first, r.stdout
    assert second == PYPI
    assert adam.startswith(NO_GPU_ADAM), r.stdout  # a toolkit without a GPU prebuilds nothing


@pytest.mark.parametrize(
    "driver, toolkit, where, adam",
    [
        (
            "580.65.06",
            "13.0",
            "CUDA_HOME",
            "prebuilt (DS_BUILD_CPU_ADAM=1) with the CUDA 13.0 toolkit at {home}",
        ),
        (
            "580.65.06",
            "13.0",
            "PATH",
            "prebuilt (DS_BUILD_CPU_ADAM=1) with the CUDA 13.0 toolkit at {home}",
        ),
        (
            "550.54.15",
            "12.4",
            "CUDA_HOME",
            "prebuilt (DS_BUILD_CPU_ADAM=1) with the CUDA 12.4 toolkit at {home}",
        ),
        (
            "580.65.06",
            "12.4",
            "CUDA_HOME",
            "not prebuilt: {home} has CUDA 12.4; for ZeRO-Offload "
            "install NVIDIA's "
            "cuda-toolkit-13-0 and set CUDA_HOME to it, then rerun this script",
        ),
        (
            "580.65.06",
            "13.2",
            "CUDA_HOME",
            "not prebuilt: {home} has CUDA 13.2, and DeepSpeed's "
            "installer wants 13.0 "
            "(the op builds on first use)",
        ),
        (
            "580.65.06",
            None,
            "CUDA_HOME",
            "not prebuilt: {home} has no working bin/nvcc; for "
            "ZeRO-Offload install "
            "NVIDIA's cuda-toolkit-13-0 and set CUDA_HOME to it, then rerun this script",
        ),
    ],
)
def test_cpu_adam_is_prebuilt_only_with_a_toolkit_of_torchs_cuda(
    tmp_path, path, driver, toolkit, where, adam
):
    """ZeRO-Offload's CPU Adam builds against CUDA on GPU hosts. DeepSpeed's installer
    (DS_BUILD_CPU_ADAM=1) accepts a toolkit of torch's CUDA version (13.x: the same minor; 12.x: any
    12.x, its cuda_minor_mismatch_ok); torch's JIT build on first use accepts the same major
    (vit.runtime.preflight checks that). The toolkit is found where torch looks: CUDA_HOME, then
    nvcc on PATH (its folder's parent)."""
    home = tmp_path / "cuda"
    fake_nvcc(home, toolkit) if toolkit else home.mkdir()
    path = fake_smi(tmp_path, path)
    env = dict(CUDA_HOME=str(home)) if where == "CUDA_HOME" else {}
    path = f"{home}/bin:{path}" if where == "PATH" else path
    r = print_torch(tmp_path, path, FAKE_DRIVER=driver, FAKE_CAPS="8.6", **env)
    assert r.returncode == 0 and r.stderr == "", r
    assert r.stdout.splitlines()[2] == "DeepSpeed's CPU Adam: " + adam.format(home=home), r.stdout


@pytest.mark.parametrize(
    "torch_cuda, pip",
    [
        (
            "cpu",
            "pip install torch==2.14.1 torchvision==0.29.1 from "
            "https://download.pytorch.org/whl/cpu",
        ),
        ("cu126", CU126),
        ("cu130", PYPI),
    ],
)
def test_torch_cuda_overrides_the_choice(tmp_path, path, torch_cuda, pip):
    r = print_torch(
        tmp_path,
        fake_smi(tmp_path, path),
        FAKE_DRIVER="580.65.06",
        FAKE_CAPS="8.6",
        TORCH_CUDA=torch_cuda,
    )
    assert r.returncode == 0 and r.stdout.startswith(f"{torch_cuda}: set by TORCH_CUDA\n{pip}\n"), r


def test_torch_cuda_must_name_a_build(tmp_path, path):
    r = print_torch(tmp_path, path, TORCH_CUDA="cuda 12")
    assert (
        r.returncode == 2
        and r.stdout == ""
        and r.stderr
        == "bootstrap.sh: TORCH_CUDA=cuda 12 is not a build name (cu126, cu130, cpu, ...)\n"
    ), r


@pytest.mark.timeout(240)
def test_a_different_choice_replaces_torch(tmp_path):
    """A venv stamped for the PyPI wheel (an old stamp without a build means that) and
    TORCH_CUDA=cpu: torch and torchvision are uninstalled before the install, which fails here
    because pip gets no index (the outer boundary: no network), and the stamp is left as it was.
    With the stamp's own build nothing happens."""
    venv = tmp_path / "venv"
    run_cmd([sys.executable, "-m", "venv", str(venv)], timeout=120).check_returncode()
    site = next((venv / "lib").glob("python3*/site-packages"))
    # a stand-in for the 2 GB wheels
    for name, version in (("torch", "2.14.1"), ("torchvision", "0.29.1")):
        info = site / f"{name}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        (info / "RECORD").write_text(f"{info.name}/METADATA,,\n{info.name}/RECORD,,\n")
    (site / "project.pth").write_text(f"{ROOT}\n")  # a stand-in for the project's editable install
    stamp = venv / ".requirement.sha256"
    requirement_hash = hashlib.sha256((ROOT / "requirement.txt").read_bytes()).hexdigest()
    stamp.write_text(f"{requirement_hash}\n")
    env = {k: v for k, v in base_env(VENV=str(venv)).items() if not k.startswith("PIP_")}
    offline = dict(env, PIP_NO_INDEX="1", PIP_CONFIG_FILE=os.devnull, TORCH_CUDA="cpu")

    r = run_cmd([BOOTSTRAP], timeout=120, env=dict(env, TORCH_CUDA="cu130"))
    # the old stamp means cu130: up to date
    assert r.returncode == 0 and r.stdout == r.stderr == "", r

    r = run_cmd([BOOTSTRAP], timeout=120, env=offline)
    assert "bootstrap.sh: replacing torch and torchvision (cu130) with the cpu build" in r.stdout, r
    assert r.returncode != 0, r
    assert not list(site.glob("torch*.dist-info")), "torch and torchvision are still installed"
    assert stamp.read_text() == f"{requirement_hash}\n"


@pytest.mark.timeout(60)
def test_a_venv_path_with_a_space_is_refused_in_one_line(tmp_path):
    """torch's cpp_extension does not quote paths: DeepSpeed's op would fail to link there and the
    first run end in a traceback. bootstrap.sh says so before it makes anything."""
    venv = tmp_path / "my checkout" / ".venv"
    env = {k: v for k, v in base_env(VENV=str(venv)).items() if k != "TORCH_CUDA"}
    r = run_cmd([BOOTSTRAP], timeout=50, env=dict(env, TORCH_CUDA="cpu"))
    assert r.returncode == 2 and r.stdout == "", r
    assert r.stderr == (
        f"bootstrap.sh: the venv's path '{venv}' has a space, which DeepSpeed's op build cannot "
        "take (torch's cpp_extension does not quote paths): clone the checkout where the path has "
        "none, or give VENV=/a/path/without/spaces\n"
    ), r
    assert not venv.parent.exists()


def entry_help(cwd, env):
    """./entry_cn.sh --help, from outside the checkout (so that `python -m` cannot find vit in the
    current folder)."""
    return run_cmd([str(ROOT / "entry_cn.sh"), "--help"], timeout=100, env=env, cwd=cwd)


@pytest.mark.timeout(300)
def test_the_checkout_is_installed_and_entry_cn_runs_it(tmp_path):
    """A venv made before pyproject.toml (stamp up to date, project not installed): entry_cn.sh says
    in one line that its python has no vit; bootstrap.sh installs this checkout (pip install -e .,
    offline: no index), after which entry_cn.sh runs the installed package from any folder; a second
    bootstrap.sh does nothing. The venv sees the test's own site-packages through a .pth (torch,
    deepspeed, setuptools: the 2 GB that an offline test cannot install), never this checkout."""
    venv = tmp_path / "venv"
    run_cmd([sys.executable, "-m", "venv", str(venv)], timeout=120).check_returncode()
    site = next((venv / "lib").glob("python3*/site-packages"))
    (site / "zz_deps.pth").write_text(
        "".join(f"{p}\n" for p in sys.path if p.endswith("site-packages"))
    )
    requirement_hash = hashlib.sha256((ROOT / "requirement.txt").read_bytes()).hexdigest()
    (venv / ".requirement.sha256").write_text(f"{requirement_hash} torch=cu130 cpu_adam=-\n")
    env = {
        k: v
        for k, v in base_env().items()
        if not k.startswith("PIP_") and k not in ("PYTHONPATH", "CUDA_HOME")
    }
    env = dict(
        env, PIP_NO_INDEX="1", PIP_CONFIG_FILE=os.devnull, TORCH_CUDA="cu130", VENV=str(venv)
    )
    active = dict(env, VIRTUAL_ENV=str(venv), PATH=f"{venv}/bin:{env['PATH']}")

    r = entry_help(tmp_path, active)
    assert (
        r.returncode == 2
        and r.stdout == ""
        and r.stderr
        == f"entry_cn.sh: error: {venv}/bin/python has no vit package: run scripts/bootstrap.sh "
        f"(or pip install -e {ROOT})\n"
    ), r

    r = run_cmd([BOOTSTRAP], timeout=180, env=env)
    assert (
        r.returncode == 0
        and r.stdout == f"bootstrap.sh: installing this checkout into {venv} (pip install -e .)\n"
    ), r
    r = entry_help(tmp_path, active)
    assert (
        r.returncode == 0 and r.stdout.startswith("usage: entry_cn.sh") and "--engine" in r.stdout
    ), r
    r = run_cmd([BOOTSTRAP], timeout=60, env=env)
    assert r.returncode == 0 and r.stdout == r.stderr == "", r


@pytest.mark.timeout(60)
def test_entry_cn_refuses_another_checkouts_vit(tmp_path):
    """A vit found first elsewhere (another clone on PYTHONPATH, or its editable install) is not
    run."""
    (tmp_path / "vit").mkdir()
    (tmp_path / "vit" / "__init__.py").write_text("")
    r = entry_help(ROOT / "tests", dict(base_env(), PYTHONPATH=str(tmp_path)))
    assert r.returncode == 2 and r.stdout == "" and len(r.stderr.splitlines()) == 1, r
    assert r.stderr.startswith("entry_cn.sh: error: ") and r.stderr.endswith(
        f"/python imports vit from {tmp_path}/vit, not from {ROOT}/vit: run scripts/bootstrap.sh "
        f"(or pip install -e "
        f"{ROOT})\n"
    ), r


@pytest.mark.ranks
@pytest.mark.timeout(60)
@pytest.mark.skipif(os.geteuid() != 0, reason="installs as root (else through sudo)")
def test_fonts_installs_only_the_missing_packages_and_a_failure_is_one_line(tmp_path):
    """--fonts with dpkg-query and apt-get faked (the system's package manager is the outer
    boundary): only the packages dpkg does not list as installed go to apt-get; when apt-get fails,
    one line and exit 2."""
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "dpkg-query").write_text(  # fonts-lato is missing, every other package installed
        '#!/bin/sh\nfor p; do :; done\n[ "$p" = fonts-lato ] && exit 1\nprintf "ii "\n'
    )
    (fake / "apt-get").write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/apt.log\nexit $APT_RC\n')
    for tool in fake.iterdir():
        tool.chmod(0o755)
    env = dict(base_env(), PATH=f"{fake}:{os.environ['PATH']}")
    r = run_cmd([BOOTSTRAP, "--fonts"], timeout=30, env=dict(env, APT_RC="0"))
    assert r.returncode == 0 and r.stdout == (
        "bootstrap.sh: installing the glyphs task's fonts (1 Debian packages, apt-get)\n"
        "bootstrap.sh: the glyphs task's fonts are installed\n"
    ), r
    assert (tmp_path / "apt.log").read_text().splitlines() == [
        "update -qq",
        "install -y -qq --no-install-recommends fonts-lato",
    ]
    r = run_cmd([BOOTSTRAP, "--fonts"], timeout=30, env=dict(env, APT_RC="100"))
    assert r.returncode == 2 and r.stderr == (
        "bootstrap.sh: apt-get could not install the glyphs task's fonts (fonts-lato ...)\n"
    ), r
