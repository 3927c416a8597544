"""gpu_local_cpu_affinity (RETURNN's key): which CPUs a rank is pinned to, read from fake sysfs/proc
trees, and a real os.sched_setaffinity of this test process (restored afterwards)."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kit.engine.cpu_affinity import Roots, choose_cpus, parse_cpulist, pci_id, pin_for_engine, pin_to_gpu

GPU = "0000:1b:00.0"
UUID = "8ff8d0c7-8d30-8e55-0980-ac69fc03a6b8"


def two_sockets(cpu: int) -> int:
    """16 CPUs: 0-7 on socket 0, 8-15 on socket 1."""
    return cpu // 8


# ---- parsing -------------------------------------------------------------------------------


@pytest.mark.parametrize("text, cpus", [
    ("0-3\n", {0, 1, 2, 3}),
    ("0-2,8,10-11", {0, 1, 2, 8, 10, 11}),
    (" 4 , 6-7 \n", {4, 6, 7}),
    ("5", {5}),
    ("\n", set()),
])
def test_parse_cpulist(text, cpus):
    assert parse_cpulist(text) == cpus


# ---- choosing ------------------------------------------------------------------------------


def test_a_big_enough_numa_node_is_taken_as_is():
    # 2 ranks on 16 CPUs: share 8; rank 1's GPU hangs off CPUs 8-15
    assert choose_cpus([range(0, 8), range(8, 16)], 1, range(16), two_sockets) == set(range(8, 16))


def test_a_node_below_the_share_widens_to_the_socket():
    # NPS4-like: 2 ranks on 16 CPUs (share 8), rank 1's GPU node is CPUs 8-11: its socket 8-15 instead
    got = choose_cpus([range(0, 4), range(8, 12)], 1, range(16), two_sockets)
    assert got == set(range(8, 16))
    # negative control: a node as big as the share is not widened
    assert choose_cpus([range(0, 8), range(8, 16)], 0, range(16), two_sockets) == set(range(8))


def test_ranks_sharing_one_node_get_disjoint_contiguous_slices():
    local = [range(0, 8), range(0, 8), range(8, 16), range(8, 16)]  # 4 ranks, share 4
    slices = [choose_cpus(local, rank, range(16), two_sockets) for rank in range(4)]
    assert slices == [set(range(0, 4)), set(range(4, 8)), set(range(8, 12)), set(range(12, 16))]


def test_an_uneven_slice_gives_the_last_rank_the_rest():
    # 2 ranks on one node of 7 allowed CPUs: share 3, slices of 3, the last takes the 7th CPU
    local = [range(0, 7), range(0, 7)]
    got = [choose_cpus(local, rank, range(7), lambda cpu: 0) for rank in range(2)]
    assert got == [{0, 1, 2}, {3, 4, 5, 6}]


def test_even_the_socket_below_the_share_pins_nothing():
    # one process may use all 16 CPUs: its socket (8) would halve it
    assert choose_cpus([range(8, 16)], 0, range(16), two_sockets) is None


def test_the_allowed_cpus_restrict_the_choice():
    # a cpuset of CPUs 4-11 for 2 ranks: share 4; rank 0's node 0-7 gives 4-7, rank 1's 8-15 gives 8-11
    allowed = range(4, 12)
    assert choose_cpus([range(0, 8), range(8, 16)], 0, allowed, two_sockets) == {4, 5, 6, 7}
    assert choose_cpus([range(0, 8), range(8, 16)], 1, allowed, two_sockets) == {8, 9, 10, 11}
    # a cpuset holding none of the node's CPUs nor its socket's: nothing
    assert choose_cpus([range(0, 8)], 0, range(8, 12), two_sockets) is None


def test_ranks_sharing_a_set_too_small_to_split_share_it_whole():
    # 2 ranks, 16 allowed -> share 8; both GPUs on socket 0 (0-7): socket 0 (8 CPUs) is not split in 4s
    local = [range(0, 4), range(0, 4)]
    assert choose_cpus(local, 0, range(16), two_sockets) == set(range(8))
    assert choose_cpus(local, 1, range(16), two_sockets) == set(range(8))


# ---- the topology files --------------------------------------------------------------------


def fake_tree(tmp_path: Path, *, local_cpulist: str | None = "1\n", gpus: dict[str, str] | None = None) -> Roots:
    """sysfs with one GPU (``GPU``) and CPUs 0 and 1 on socket 0, the NVIDIA driver's GPU files."""
    roots = Roots(pci_devices=str(tmp_path / "pci"), cpus=str(tmp_path / "cpu"),
                  nvidia_gpus=str(tmp_path / "nvidia"), threads="/proc/self/task")
    if local_cpulist is not None:
        (tmp_path / "pci" / GPU).mkdir(parents=True)
        (tmp_path / "pci" / GPU / "local_cpulist").write_text(local_cpulist)
    for cpu in (0, 1):
        (tmp_path / "cpu" / f"cpu{cpu}" / "topology").mkdir(parents=True)
        (tmp_path / "cpu" / f"cpu{cpu}" / "topology" / "physical_package_id").write_text("0\n")
    for name, uuid in (gpus or {}).items():
        (tmp_path / "nvidia" / name).mkdir(parents=True)
        (tmp_path / "nvidia" / name / "information").write_text(f"Model: \t\t Fake\nGPU UUID: \t GPU-{uuid}\nBus Type: \t PCIe\n")
    return roots


def with_pci_fields(index: int) -> Any:
    assert index == 0
    return SimpleNamespace(pci_domain_id=0, pci_bus_id=0x1B, pci_device_id=0, uuid=UUID)


def uuid_only(index: int) -> Any:
    return SimpleNamespace(uuid=f"GPU-{UUID.upper()}")


def test_pci_id_from_the_device_properties_or_by_uuid(tmp_path):
    roots = fake_tree(tmp_path, gpus={"0000:3d:00.0": "00000000-0000-0000-0000-000000000000", GPU: UUID})
    assert pci_id(with_pci_fields(0), roots) == GPU
    assert pci_id(uuid_only(0), roots) == GPU
    with pytest.raises(LookupError):
        pci_id(SimpleNamespace(uuid="GPU-ffffffff-0000-0000-0000-000000000000"), roots)


@pytest.fixture
def restore_affinity():
    """Every thread's affinity back as it was, whatever the test pinned."""
    saved = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            saved[int(tid)] = os.sched_getaffinity(int(tid))
        except ProcessLookupError:
            pass
    try:
        yield saved
    finally:
        for tid, cpus in saved.items():
            try:
                os.sched_setaffinity(tid, cpus)
            except ProcessLookupError:
                pass


needs_two_cpus = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or not {0, 1} <= os.sched_getaffinity(0),
    reason="needs Linux and CPUs 0 and 1 allowed",
)


@needs_two_cpus
@pytest.mark.parametrize("properties, cpulist, expected", [
    (with_pci_fields, "0-1\n", {1}),  # both ranks' GPUs on node 0-1: rank 1 gets the second slice
    (uuid_only, "0\n", {0}),  # a node of 1 CPU cannot be split: both ranks share it
])
def test_the_engine_call_pins_every_thread_to_the_gpu_local_cpus(tmp_path, restore_affinity, properties, cpulist,
                                                                 expected, caplog):
    roots = fake_tree(tmp_path, local_cpulist=cpulist, gpus={GPU: UUID})
    allowed = os.sched_getaffinity(0)
    # this process is rank 1 of 2 on this host, both on the same GPU: the share is one CPU
    with caplog.at_level(logging.INFO, logger="kit"):
        got = pin_for_engine(True, torch.device("cuda", 0), _TwoRanksOneHost(allowed),
                             properties=properties, roots=roots)
    assert got == expected
    for tid in os.listdir("/proc/self/task"):
        assert os.sched_getaffinity(int(tid)) == expected
    assert "pinned to 1 CPU(s)" in caplog.text and GPU in caplog.text


@needs_two_cpus
def test_a_single_process_is_widened_to_its_socket(tmp_path, restore_affinity):
    roots = fake_tree(tmp_path, local_cpulist="1\n")
    os.sched_setaffinity(0, {0, 1})
    assert pin_for_engine(True, torch.device("cuda", 0), None, properties=with_pci_fields, roots=roots) == {0, 1}
    # allowed only CPU 1: the node is the whole share, CPU 0 is never added
    os.sched_setaffinity(0, {1})
    assert pin_to_gpu([GPU], 0, roots) == {1}
    assert os.sched_getaffinity(0) == {1}


class _TwoRanksOneHost:
    """A DistributedContext's gather as rank 1 of 2 on this host would see it (rank 0 on the same GPU)."""

    rank = 1

    def __init__(self, allowed: set[int], other_allowed: set[int] | None = None):
        self.other_allowed = sorted(allowed if other_allowed is None else other_allowed)

    def gather_from_ranks(self, obj: Any) -> list[Any]:
        host, rank, pci, allowed = obj
        return [(host, 0, pci, self.other_allowed), obj, ("another-host", 2, pci, [5])]


def test_ranks_the_launcher_bound_to_different_cpus_are_left_alone(tmp_path, restore_affinity, caplog):
    roots = fake_tree(tmp_path)
    before = os.sched_getaffinity(0)
    with caplog.at_level(logging.INFO, logger="kit"):
        got = pin_for_engine(True, torch.device("cuda", 0), _TwoRanksOneHost(before, {7}),
                             properties=with_pci_fields, roots=roots)
    assert got is None and os.sched_getaffinity(0) == before
    assert "already bound" in caplog.text


def test_cpu_device_or_option_off_pins_nothing(tmp_path, restore_affinity):
    roots = fake_tree(tmp_path)

    def never(index: int) -> Any:
        raise AssertionError("the GPU must not be looked up")

    before = os.sched_getaffinity(0)
    assert pin_for_engine(True, torch.device("cpu"), None, properties=never, roots=roots) is None
    assert pin_for_engine(False, torch.device("cuda", 0), None, properties=never, roots=roots) is None
    assert os.sched_getaffinity(0) == before


@pytest.mark.parametrize("properties, local_cpulist, says", [
    (with_pci_fields, None, "topology is unknown"),  # no local_cpulist in sysfs
    (uuid_only, "1\n", "PCI id of cuda:0 is unknown"),  # no NVIDIA driver files
])
def test_unknown_topology_is_logged_and_pins_nothing(tmp_path, restore_affinity, caplog, properties, local_cpulist,
                                                     says):
    roots = fake_tree(tmp_path, local_cpulist=local_cpulist)
    before = os.sched_getaffinity(0)
    with caplog.at_level(logging.INFO, logger="kit"):
        got = pin_for_engine(True, torch.device("cuda", 0), None, properties=properties, roots=roots)
    assert got is None and os.sched_getaffinity(0) == before
    assert "CPU affinity not set" in caplog.text and says in caplog.text


def test_the_key_is_known_with_returnns_default():
    from kit.compat.returnn_keys import RETURNN_KEYS
    from kit.config import Config

    assert Config({}).bool("gpu_local_cpu_affinity") is True
    assert Config({"gpu_local_cpu_affinity": False}).bool("gpu_local_cpu_affinity") is False
    assert RETURNN_KEYS["gpu_local_cpu_affinity"].status == "kit"


class _Stop(Exception):
    pass


@pytest.mark.parametrize("device, value", [
    (torch.device("cuda", 0), None),  # the key's default: on
    (torch.device("cuda", 0), False),
    (torch.device("cpu"), True),
])
def test_engine_set_up_pins_once_before_the_datasets(monkeypatch, device, value):
    """build_parts calls the pinning for a CUDA device only, with the key's value, before any dataset exists."""
    from kit.config import Config
    from kit.engine import build, cpu_affinity, parts

    calls: list[str] = []
    monkeypatch.setattr(build, "select_device", lambda requested: (device, "test"))
    monkeypatch.setattr(cpu_affinity, "pin_for_engine",
                        lambda enabled, dev, dist: calls.append(f"pin {enabled} {dev} {dist}"))

    def datasets(config: Any) -> Any:
        calls.append("datasets")
        raise _Stop

    monkeypatch.setattr(parts, "build_datasets", datasets)
    config = Config({} if value is None else {"gpu_local_cpu_affinity": value})
    with pytest.raises(_Stop):
        build.build_parts(config, events=None, training=False)  # type: ignore[arg-type]
    expected_pin = [f"pin {value is not False} {device} None"] if device.type == "cuda" else []
    assert calls == expected_pin + ["datasets"]


@pytest.mark.parametrize("value, pins", [(None, False), (True, True)])
def test_a_notebook_session_pins_its_shared_kernel_only_when_the_config_asks(monkeypatch, caplog, value, pins):
    """A Session's engine runs in a kernel shared with other sessions: RETURNN's default (pin the run's own
    process) applies to the CLI and torchrun; a Session pins only with gpu_local_cpu_affinity set explicitly."""
    import logging

    from kit.config import Config
    from kit.engine import build, cpu_affinity, parts

    calls: list[str] = []
    monkeypatch.setattr(build, "select_device", lambda requested: (torch.device("cuda", 0), "test"))
    monkeypatch.setattr(cpu_affinity, "pin_for_engine", lambda enabled, dev, dist: calls.append("pin"))

    def datasets(config: Any) -> Any:
        raise _Stop

    monkeypatch.setattr(parts, "build_datasets", datasets)
    config = Config({} if value is None else {"gpu_local_cpu_affinity": value})
    with caplog.at_level(logging.INFO, logger="kit"), pytest.raises(_Stop):
        build.build_parts(config, events=None, training=False, shared_process=True)  # type: ignore[arg-type]
    assert calls == (["pin"] if pins else [])
    assert ("other sessions too" in caplog.text) is not pins
