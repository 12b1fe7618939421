"""The preflight's rules: hostfile slots, every problem in one message."""




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
