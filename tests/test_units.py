"""The pieces under the engines: model layers, data sets in their real file formats, sampling, launcher
discovery, rank 0's address, the LR schedule."""
import ipaddress
import pickle
import sys

import numpy as np
import pytest
import torch
from helpers import base_env, run_cmd
from torch import nn

from vit.data import PAD_LABEL, TrainBatches, eval_batches, load_dataset
from vit.dist_env import choose_master_addr, discover
from vit.engines import warmup_cosine
from vit.model import create_vit, to_layers


@pytest.mark.parametrize("name,in_chans,img", [("vit_digits", 1, 8), ("vit_tiny_cifar", 3, 32)])
def test_layer_list_is_the_timm_model(name, in_chans, img):
    vit = create_vit(name, num_classes=10, in_chans=in_chans, seed=3).eval()
    x = torch.randn(4, in_chans, img, img)
    assert torch.allclose(nn.Sequential(*to_layers(vit))(x), vit(x), atol=1e-6)
    a, b = create_vit(name, 10, in_chans, seed=3), create_vit(name, 10, in_chans, seed=3)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))  # same seed, same weights


def test_digits_split_is_fixed_and_stratified():
    load_digits_twice = [load_dataset("digits", None, 8) for _ in range(2)]
    d = load_digits_twice[0]
    assert (len(d.train), len(d.test), d.num_classes, d.in_chans, d.img_size) == (1437, 360, 10, 1, 8)
    assert torch.equal(d.test.tensors[0], load_digits_twice[1].test.tensors[0])
    assert torch.bincount(d.test.tensors[1]).min() >= 35  # every class held out


def write_cifar(root, name, n_train=24, n_test=12):
    rng = np.random.default_rng(0)
    folder, files, test, key, classes = {
        "cifar10": ("cifar-10-batches-py", [f"data_batch_{i}" for i in range(1, 6)], "test_batch", b"labels", 10),
        "cifar100": ("cifar-100-python", ["train"], "test", b"fine_labels", 100)}[name]
    (root / folder).mkdir(parents=True)
    for f, n in [*[(f, n_train) for f in files], (test, n_test)]:
        batch = {b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
                 key: rng.integers(0, classes, n).tolist()}
        with open(root / folder / f, "wb") as fh:
            pickle.dump(batch, fh)
    return classes, len(files) * n_train, n_test


@pytest.mark.parametrize("name", ["cifar10", "cifar100"])
def test_cifar_pickle_batches(tmp_path, name):
    classes, n_train, n_test = write_cifar(tmp_path, name)
    d = load_dataset(name, str(tmp_path), 32)
    assert (len(d.train), len(d.test), d.num_classes, d.img_size) == (n_train, n_test, classes, 32)
    x, y = d.train[0]
    assert x.shape == (3, 32, 32) and x.dtype == torch.float32 and 0 <= int(y) < classes
    assert -3 < float(x.mean()) < 3


def test_cifar_missing_files_name_them(tmp_path):
    with pytest.raises(ValueError, match="lacks data_batch_1"):
        load_dataset("cifar10", str(tmp_path), 32)


def test_imagefolder(tmp_path):
    from PIL import Image

    for split, n in (("train", 3), ("val", 2)):
        for cls, color in (("cat", (200, 30, 30)), ("dog", (30, 30, 200))):
            (tmp_path / split / cls).mkdir(parents=True)
            for i in range(n):
                Image.new("RGB", (40 + i, 36), color).save(tmp_path / split / cls / f"{i}.png")
    d = load_dataset("imagefolder", str(tmp_path), 16)
    assert (len(d.train), len(d.test), d.num_classes) == (6, 4, 2)
    x, y = d.test[3]
    assert x.shape == (3, 16, 16) and y == 1
    (tmp_path / "val" / "dog").rename(tmp_path / "val" / "bird")
    with pytest.raises(ValueError, match="class folders"):
        load_dataset("imagefolder", str(tmp_path), 16)


@pytest.mark.ranks
@pytest.mark.timeout(120)
def test_training_reads_cifar_folder(tmp_path):
    write_cifar(tmp_path / "data", "cifar10")
    r = run_cmd([sys.executable, "-m", "vit.train", "--dataset", "cifar10", "--data-path", str(tmp_path / "data"),
                 "--model", "vit_tiny_cifar", "--steps", "2", "--micro-batch-size", "8", "--no-save",
                 "--monitor-interval", "0", "--log-dir", str(tmp_path / "run")], env=base_env(), timeout=110)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "eval at step 2" in r.stdout


@pytest.mark.parametrize("dp,ga", [(1, 1), (2, 1), (2, 3), (4, 2)])
def test_data_parallel_micro_batches_make_up_the_global_batch(dp, ga):
    n, mb = 103, 4
    single = list(TrainBatches(n, mb * ga * dp, 1, 0, 1, seed=5, start_step=0, end_step=7))
    per_rank = [list(TrainBatches(n, mb, ga, r, dp, seed=5, start_step=0, end_step=7)) for r in range(dp)]
    for step in range(7):
        shards = [i for r in range(dp) for i in sum(per_rank[r][step * ga:(step + 1) * ga], [])]
        assert sorted(shards) == sorted(single[step]) and len(set(shards)) == mb * ga * dp


def test_sampler_resumes_mid_run_and_reshuffles_per_epoch():
    full = list(TrainBatches(50, 5, 2, 1, 2, seed=1, start_step=0, end_step=9))
    assert list(TrainBatches(50, 5, 2, 1, 2, seed=1, start_step=4, end_step=9)) == full[8:]
    one_epoch = TrainBatches(50, 10, 1, 0, 1, seed=1, start_step=0, end_step=10)
    batches = list(one_epoch)
    assert one_epoch.per_epoch == 5 and batches[:5] != batches[5:10]


def test_eval_batches_pad_every_rank_to_the_same_count():
    lists = [eval_batches(11, 4, r, 3) for r in range(3)]
    assert {len(b) for b in lists} == {1} and all(len(b) == 4 for rank in lists for b in rank)
    real = sorted(i for rank in lists for b in rank for i in b if i >= 0)
    assert real == list(range(11))
    assert PAD_LABEL == -100


def test_discover_launchers():
    assert discover({}).launcher == "single"
    ompi = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "5", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    d = discover(ompi)
    assert (d.rank, d.world_size, d.local_rank, d.local_world_size, d.launcher) == (3, 5, 1, 2, "Open MPI")
    # mpirun inside a Slurm allocation: the Slurm variables belong to the launcher's daemon, MPI wins.
    assert discover({**ompi, "SLURM_PROCID": "0", "SLURM_NTASKS": "2"}).rank == 3
    d = discover({"SLURM_PROCID": "2", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0", "SLURM_NTASKS_PER_NODE": "2(x2)"})
    assert (d.rank, d.world_size, d.local_world_size) == (2, 4, 2)
    assert discover({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1"}).launcher == "MPICH/PMI"
    with pytest.raises(ValueError, match="launcher variables disagree: torchrun says rank 0 of 2; Open MPI says"):
        discover({"RANK": "0", "WORLD_SIZE": "2", **ompi})
    with pytest.raises(ValueError, match="outside world size"):
        discover({"RANK": "4", "WORLD_SIZE": "2"})


def iface(addr):
    return ("eth0", ipaddress.IPv4Interface(addr))


def test_master_address_is_the_one_every_host_reaches():
    one_host = [("a", [iface("10.0.0.1/24")]), ("a", [iface("10.0.0.1/24")])]
    assert choose_master_addr(one_host, None) == "127.0.0.1"
    hosts = [("a", [("docker0", ipaddress.IPv4Interface("172.17.0.1/16")), iface("192.168.5.10/24")]),
             ("b", [iface("192.168.5.11/24")]), ("c", [iface("192.168.5.12/24")])]
    assert choose_master_addr(hosts, None) == "192.168.5.10"
    assert choose_master_addr(hosts, "docker0") == "172.17.0.1"
    with pytest.raises(ValueError, match="no IPv4 address on interface ib0"):
        choose_master_addr(hosts, "ib0")
    with pytest.raises(ValueError, match="shares no subnet"):
        choose_master_addr([hosts[0], ("d", [iface("10.9.9.9/24")])], None)


def test_warmup_then_cosine():
    lr = [warmup_cosine(s, total=100, warmup=10, min_ratio=0.01) for s in range(100)]
    assert lr[0] == pytest.approx(0.1) and lr[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lr[9:], lr[10:])) and lr[-1] == pytest.approx(0.01, abs=1e-3)


def test_hostfile_slots(tmp_path):
    from vit.preflight import hostfile_slots

    hf = tmp_path / "hosts.txt"
    hf.write_text("# cluster\ncn0 slots=2\ncn1 slots=1  # old card\n\ncn2\n")
    assert hostfile_slots(str(hf)) == 4


def test_preflight_lists_every_problem_in_one_message():
    from vit.preflight import problems

    ok = {"host": "cn0", "python": "3.11.7", "torch": "2.14.1", "deepspeed": "0.19.8", "timm": "1.0.31",
          "GLOO_SOCKET_IFNAME": "eno1", "NCCL_SOCKET_IFNAME": "eno1"}
    reports = [ok, {**ok, "host": "cn1", "NCCL_SOCKET_IFNAME": "enp3s0"},
               {**ok, "host": "cn2", "torch": "2.13.0", "GLOO_SOCKET_IFNAME": ""}]
    assert problems(reports[:2], 2, 2) == []  # another interface name on another host is fine
    found = problems(reports, 3, 2)
    assert found == ["world size 3 is more than the hostfile's 2 slots",
                     "torch: rank 0 (cn0) has 2.14.1, but rank 2 (cn2) has 2.13.0",
                     "GLOO_SOCKET_IFNAME: rank 0 (cn0) has eno1, but rank 2 (cn2) has none"]


@pytest.mark.parametrize("name", ["vit_digits", "vit_base_patch16_224"])
def test_attention_runs_through_fused_scaled_dot_product_attention(name):
    from vit.model import create_vit

    vit = create_vit(name, num_classes=10, in_chans=3)
    assert all(block.attn.fused_attn for block in vit.blocks)  # F.scaled_dot_product_attention, not q @ k.T
