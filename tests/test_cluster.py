"""The cluster tools on three simulated hosts (scripts/sim_cluster.sh): network namespaces with their
own address, hostname, home and sshd, driven from host cn0 as a person drives a real cluster from
its first machine. Needs root, network namespaces and sshd (apt-get install openssh-server)."""
import importlib.metadata
import json
import os
import pwd
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SIM = str(ROOT / "scripts" / "sim_cluster.sh")
HOSTS = ["cn0", "cn1", "cn2"]
STEPS = 30

pytestmark = [pytest.mark.cluster, pytest.mark.ranks]

FAKE_NVIDIA_SMI = """#!/bin/sh
# nvidia-smi of a host with two GPUs: the true outer boundary of setup/make_hostfile.sh.
case "$*" in
  -L) printf 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)\\nGPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-1)\\n' ;;
  --query-gpu=*) gpu='NVIDIA H100 80GB HBM3, 81559 MiB, 550.54.15'; printf '%s\\n%s\\n' "$gpu" "$gpu" ;;
  *) exit 1 ;;
esac
"""


def skip_reason():
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    for tool in ("ip", "unshare", "nsenter", "ssh", "ssh-copy-id", "ssh-agent"):
        if not shutil.which(tool):
            return f"needs {tool} (apt-get install iproute2 util-linux openssh-client)"
    if not os.path.exists("/usr/sbin/sshd"):
        return "needs sshd (apt-get install openssh-server)"
    if not (ROOT / ".venv" / "bin" / "mpirun").exists():
        return "needs the project's .venv with Open MPI (scripts/bootstrap.sh)"
    probe = subprocess.run(["unshare", "--net", "--uts", "--mount", "true"], capture_output=True, timeout=10)
    if probe.returncode:
        return f"cannot create namespaces here: {probe.stderr.decode().strip()}"
    return None


class Result:
    def __init__(self, argv, rc, output, duration_s):
        self.argv, self.rc, self.output, self.duration_s = argv, rc, output, duration_s

    def __str__(self):
        return f"$ {shlex.join(self.argv)}\nexit {self.rc} after {self.duration_s:.1f}s\n{self.output[-6000:]}"


def run(argv, env, timeout, check=True) -> Result:
    """Run argv with its output in a file (a stray grandchild holding a pipe cannot block us); after
    `timeout` seconds its whole process group is killed and the test fails."""
    with tempfile.TemporaryFile("w+") as out:
        start = time.monotonic()
        p = subprocess.Popen(argv, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=out,
                             stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = p.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            rc = None
        except BaseException:  # the test's own timeout: leave nothing running
            os.killpg(p.pid, signal.SIGKILL)
            raise
        out.seek(0)
        r = Result(argv, rc, out.read(), time.monotonic() - start)
    if rc is None:
        pytest.fail(f"did not finish within {timeout}s:\n{r}")
    if check and rc != 0:
        pytest.fail(f"failed:\n{r}")
    return r


class Cluster:
    def __init__(self, state_dir: Path):
        self.dir = state_dir
        self.hostfile = state_dir / "hostfile"
        self.env = {k: v for k, v in os.environ.items()
                    if not k.startswith(("SSH_", "OMPI_", "PRTE_", "PMIX_", "MASTER_", "GLOO_", "NCCL_"))
                    and k not in ("IFACE", "RANK", "WORLD_SIZE", "LOCAL_RANK", "HOSTFILE", "VIRTUAL_ENV")}
        cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
        self.env.update(
            SIM_DIR=str(state_dir), SIM_PREFIX="vitsimtest", PYTHONUNBUFFERED="1",
            OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
            # The hosts share this machine's build of DeepSpeed's CPU op, as hosts sharing a home
            # would; each building its own costs ~80 s of CPU per host.
            TORCH_EXTENSIONS_DIR=os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(cache, "torch_extensions"))

    def sim(self, *args, timeout=60, check=True) -> Result:
        return run([SIM, *args], self.env, timeout, check)

    def on(self, host: int, script: str, timeout: float, check=True, **env) -> Result:
        """Run a bash script as simulated host cn{host}, in this checkout."""
        return run([SIM, "exec", str(host), "--", "bash", "-c", script], {**self.env, **env}, timeout, check)

    def authorized_keys(self, host: int) -> list[str]:
        return (self.dir / f"cn{host}" / "home" / ".ssh" / "authorized_keys").read_text().splitlines()


def real_ssh_dir_snapshot():
    d = Path(pwd.getpwuid(os.getuid()).pw_dir) / ".ssh"
    return sorted((p.name, p.stat().st_mtime_ns) for p in d.iterdir()) if d.is_dir() else None


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    c = Cluster(tmp_path_factory.mktemp("cluster") / "sim")
    c.real_ssh_before = real_ssh_dir_snapshot()
    try:
        c.sim("up", str(len(HOSTS)))
        # The bootstrap key in an agent stands in for the password each host would ask once.
        c.first_setup = c.on(0, 'eval "$(ssh-agent -s)" >/dev/null && trap "ssh-agent -k >/dev/null" EXIT && '
                                'ssh-add -q "$SIM_DIR/bootstrap_key" && setup/setup_ssh.sh "$SIM_DIR/hostfile"',
                             timeout=90, check=False)
        yield c
    finally:
        c.sim("down", check=False)


@pytest.fixture
def two_gpus_on_cn1(cluster):
    fake = cluster.dir / "cn1" / "bin" / "nvidia-smi"
    fake.write_text(FAKE_NVIDIA_SMI)
    fake.chmod(0o755)
    yield
    fake.unlink()


@pytest.mark.timeout(240, method="signal")
def test_setup_ssh_connects_every_pair_and_is_safe_to_rerun(cluster):
    assert cluster.first_setup.rc == 0, cluster.first_setup
    assert "between all 9 host pairs" in cluster.first_setup.output
    # From here on only the keys setup_ssh.sh installed may open a door.
    for i in range(len(HOSTS)):
        path = cluster.dir / f"cn{i}" / "home" / ".ssh" / "authorized_keys"
        path.write_text("".join(k + "\n" for k in cluster.authorized_keys(i) if "vit-sim-bootstrap" not in k))
    again = cluster.on(0, 'setup/setup_ssh.sh "$SIM_DIR/hostfile"', timeout=90)
    assert "between all 9 host pairs" in again.output
    for i in range(len(HOSTS)):
        keys = cluster.authorized_keys(i)
        assert len(keys) == len(set(keys)) == len(HOSTS), keys  # one key per host, none twice
    hop = cluster.on(1, "ssh -o BatchMode=yes cn2 hostname", timeout=30)
    assert hop.output.strip().splitlines()[-1] == "cn2"
    assert real_ssh_dir_snapshot() == cluster.real_ssh_before, "the real ~/.ssh was touched"


@pytest.mark.timeout(120, method="signal")
def test_make_hostfile_counts_gpus_and_replaces_the_file_whole(cluster, two_gpus_on_cn1):
    out = cluster.dir / "made" / "hosts.txt"
    out.parent.mkdir()
    out.write_text("old content\n")
    for _ in range(2):  # the second run rewrites the same file
        cluster.on(0, f"setup/make_hostfile.sh --out {out}", timeout=60, HOSTFILE=str(cluster.hostfile))
        lines = [line for line in out.read_text().splitlines() if not line.startswith("#")]
        assert lines == ["cn0 slots=1", "cn1 slots=2", "cn2 slots=1"]
    assert os.listdir(out.parent) == ["hosts.txt"]  # no temporary file left behind


@pytest.mark.timeout(120, method="signal")
def test_cn_connection_table_and_version_mismatch(cluster, two_gpus_on_cn1):
    r = cluster.on(0, 'setup/test_cn_connection.sh "$SIM_DIR/hostfile"', timeout=30)
    rows = {line.split()[0]: line for line in r.output.splitlines() if line.split()[:1] in (["cn0"], ["cn1"], ["cn2"])}
    assert sorted(rows) == HOSTS, r
    for host, row in rows.items():
        assert row.split()[1] == host
        for package in ("torch", "deepspeed", "timm"):
            assert importlib.metadata.version(package) in row.split(), (package, row)
    assert "2x NVIDIA H100 80GB HBM3 (81559 MiB), driver 550.54.15" in rows["cn1"]
    assert rows["cn0"].split()[-1] == "none"

    # cn2 alone sees another timm: a bind mount inside its own mount namespace.
    timm = importlib.metadata.distribution("timm")
    dist_info = Path(timm._path)  # the .dist-info folder
    fake = cluster.dir / "fake-timm.dist-info"
    fake.mkdir()
    (fake / "METADATA").write_text("Metadata-Version: 2.1\nName: timm\nVersion: 0.0.1\n")
    cluster.sim("exec", "2", "--", "mount", "--bind", str(fake), str(dist_info))
    try:
        r = cluster.on(0, 'setup/test_cn_connection.sh "$SIM_DIR/hostfile"', timeout=30, check=False)
    finally:
        cluster.sim("exec", "2", "--", "umount", str(dist_info))
    assert r.rc == 1, r
    assert f"cn2: timm 0.0.1 differs from cn0's {timm.version}" in r.output, r


@pytest.mark.timeout(300, method="signal")
def test_mpi_hello_mpi4py_and_gloo_across_hosts(cluster):
    r = cluster.on(0, 'setup/test_mpi.sh "$SIM_DIR/hostfile"', timeout=240, IFACE="eth0")
    assert "test_mpi.sh: ok: 3 ranks on cn0 cn1 cn2" in r.output, r
    for rank, host in enumerate(HOSTS):
        assert f"hello from rank {rank} of 3 on {host}" in r.output
        assert f"rank {rank} of 3 on {host}: mpi4py allreduce ok, gloo all_reduce ok" in r.output


MPIRUN_HELLO = '. setup/cluster.env && exec .venv/bin/mpirun -np 3 --hostfile "$SIM_DIR/hostfile" setup/hello_mpi'


@pytest.mark.timeout(240, method="signal")
def test_unreachable_host_is_named_fast_and_mpirun_does_not_hang(cluster):
    try:
        cluster.sim("stop-sshd", "2")  # logins refused at once
        r = cluster.on(0, 'setup/test_cn_connection.sh "$SIM_DIR/hostfile"', timeout=30, check=False)
        assert r.rc == 1 and "cn2: unreachable" in r.output and r.duration_s < 10, r
        r = cluster.on(0, MPIRUN_HELLO, timeout=60, check=False)
        assert r.rc != 0 and "cn2" in r.output and r.duration_s < 20, r
        r = cluster.on(0, 'setup/setup_ssh.sh "$SIM_DIR/hostfile"', timeout=60, check=False)
        assert r.rc != 0 and "cn2: ssh-copy-id failed" in r.output, r
        r = cluster.on(0, 'setup/doctor.sh', timeout=60, check=False, HOSTFILE=str(cluster.hostfile))
        assert r.rc == 1 and "cn2: unreachable" in r.output, r

        cluster.sim("unplug", "1")  # nothing answers: only timeouts can tell
        r = cluster.on(0, 'setup/test_cn_connection.sh "$SIM_DIR/hostfile"', timeout=30, check=False)
        assert r.rc == 1 and "cn1: unreachable" in r.output and "cn2: unreachable" in r.output, r
        assert r.duration_s < 10, r
        # cn0 and cn1 only: mpirun's ssh must give up on cn1 (cluster.env), not wait for TCP's 2 minutes.
        (cluster.dir / "hostfile-01").write_text("cn0 slots=1\ncn1 slots=1\n")
        r = cluster.on(0, MPIRUN_HELLO.replace("-np 3", "-np 2").replace("/hostfile", "/hostfile-01"),
                       timeout=90, check=False)
        assert r.rc != 0 and "cn1" in r.output and r.duration_s < 25, r
    finally:
        cluster.sim("plug", "1", check=False)
        cluster.sim("start-sshd", "2", check=False)
    cluster.on(0, 'setup/test_cn_connection.sh "$SIM_DIR/hostfile"', timeout=30)  # all back


@pytest.mark.timeout(420, method="signal")
@pytest.mark.parametrize("engine_args", [
    ["--engine", "zero", "--ds-config", "deepspeed_configs/zero2.json"],
    ["--engine", "pipeline", "--pipeline-stages", "3", "--ds-config", "deepspeed_configs/pipeline.json"],
], ids=["zero2", "pipeline3"])
def test_training_runs_one_rank_per_host(cluster, tmp_path, engine_args):
    hostfile = tmp_path / "hosts.txt"
    cluster.on(0, f"setup/make_hostfile.sh --out {hostfile} {' '.join(HOSTS)}", timeout=60)
    log_dir = tmp_path / "logs"
    cmd = (f". setup/cluster.env && exec .venv/bin/mpirun -x TORCH_EXTENSIONS_DIR -x IFACE -np 3 --hostfile {hostfile} "
           f"./entry_cn.sh {shlex.join(engine_args)} --steps {STEPS} --log-dir {log_dir}")
    r = cluster.on(0, cmd, timeout=360, IFACE="eth0")  # gloo over the simulated network only
    assert f"step {STEPS}/{STEPS}" in r.output, r
    for rank, host in enumerate(HOSTS):
        records = [json.loads(line) for line in (log_dir / f"metrics_rank{rank}.jsonl").read_text().splitlines()]
        assert records, f"rank {rank} wrote no metrics"
        assert {(rec["rank"], rec["host"]) for rec in records} == {(rank, host)}, records[:2]
    steps = {rec["step"] for rec in map(json.loads, (log_dir / "metrics_rank0.jsonl").read_text().splitlines())
             if rec["kind"] == "train"}
    assert STEPS in steps
