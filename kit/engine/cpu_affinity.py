"""Pinning the process to the CPUs next to its GPU (config key ``gpu_local_cpu_affinity``, RETURNN's).

On a node with several sockets (or NUMA nodes) every GPU hangs off one of them. Unpinned, the host
side of training (data loader workers, collation, copies to the device) runs wherever the scheduler
puts it, often on the far socket. With the key on (the default, as in RETURNN) the engine's set-up
pins every thread of this process to the CPUs local to its CUDA device, before the datasets and
their worker processes exist (these inherit the pinning). Linux only; only for a CUDA device.

Which CPUs (:func:`choose_cpus`): the allowed CPUs (``os.sched_getaffinity``, e.g. a SLURM cpuset)
local to the GPU (``/sys/bus/pci/devices/<pci id>/local_cpulist``); when that NUMA node holds fewer
CPUs than the rank's fair share (allowed CPUs / ranks on this host), the whole socket of the GPU;
when several ranks of the host land on the same set, each gets its own contiguous slice if the
slices still cover the share. Nothing is pinned (a log line says why, never an error) when even the
socket is too small, when the launcher already bound the ranks to different CPUs (``srun``
per-task binding, ``mpirun``), or when the topology cannot be read. A notebook's Session shares its
kernel process with other sessions, so it pins only when the config sets the key itself (the kernel
then stays pinned after the session ends).

Every file root is a parameter (:class:`Roots`), so tests use fake sysfs/proc trees.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from kit.engine.distributed import DistributedContext

logger = logging.getLogger("kit")

CpuSet = frozenset[int]


@dataclass(frozen=True)
class Roots:
    """Where the kernel and the NVIDIA driver describe the hardware (replaced by fake trees in tests)."""

    pci_devices: str = "/sys/bus/pci/devices"
    cpus: str = "/sys/devices/system/cpu"
    nvidia_gpus: str = "/proc/driver/nvidia/gpus"
    threads: str = "/proc/self/task"


# ---- pure parts ----------------------------------------------------------------------------


def parse_cpulist(text: str) -> CpuSet:
    """The CPUs of a Linux cpulist such as ``"0-11,24-35"`` (blanks and a trailing newline allowed)."""
    cpus: set[int] = set()
    for item in text.replace(" ", "").replace("\n", "").split(","):
        if item:
            low, _, high = item.partition("-")
            cpus.update(range(int(low), int(high or low) + 1))
    return frozenset(cpus)


def choose_cpus(local_cpus: Sequence[Iterable[int]], me: int, allowed: Iterable[int],
                socket_of: Callable[[int], int]) -> CpuSet | None:
    """The CPUs rank ``me`` of this host should be pinned to; None: pin nothing.

    ``local_cpus[r]``: the CPUs local to the GPU of local rank ``r``; ``allowed``: the CPUs this
    process may use; ``socket_of``: a CPU's socket. A rank never gets fewer CPUs than its fair share
    ``len(allowed) // len(local_cpus)``: the GPU's NUMA node, else its socket, else None.
    """
    allowed = frozenset(allowed)
    share = max(1, len(allowed) // len(local_cpus))
    sockets = {cpu: socket_of(cpu) for cpu in allowed}

    def near(cpus: Iterable[int]) -> CpuSet:
        return allowed & frozenset(cpus)

    def same_socket(cpus: Iterable[int]) -> CpuSet:
        wanted = {socket_of(cpu) for cpu in cpus}
        return frozenset(cpu for cpu in allowed if sockets[cpu] in wanted)

    for scope in (near, same_socket):
        per_rank = [scope(cpus) for cpus in local_cpus]
        mine = per_rank[me]
        if len(mine) >= share:
            sharing = [rank for rank, cpus in enumerate(per_rank) if cpus == mine]
            return _slice_for(mine, sharing.index(me), len(sharing), share)
    return None


def _slice_for(cpus: CpuSet, position: int, parts: int, share: int) -> CpuSet:
    """Part ``position`` of ``parts`` contiguous slices of ``cpus`` (the last takes the rest); all of
    ``cpus`` when a slice would fall below ``share``."""
    if len(cpus) < share * parts:
        return cpus
    ordered, size = sorted(cpus), len(cpus) // parts
    end = None if position == parts - 1 else (position + 1) * size
    return frozenset(ordered[position * size:end])


# ---- reading the topology ------------------------------------------------------------------


def pci_id(properties: Any, roots: Roots = Roots()) -> str:
    """The sysfs PCI id (``"0000:1b:00.0"``) of a CUDA device, from its properties (torch >= 2.8 has
    the PCI fields) or by its UUID in the NVIDIA driver's files (CUDA order is not PCI order)."""
    bus = getattr(properties, "pci_bus_id", None)
    if bus is not None:
        domain, device = getattr(properties, "pci_domain_id", 0), getattr(properties, "pci_device_id", 0)
        return f"{domain:04x}:{bus:02x}:{device:02x}.0"
    return _pci_id_by_uuid(str(properties.uuid), roots.nvidia_gpus)


def _bare_uuid(uuid: str) -> str:
    uuid = uuid.strip().lower()
    return uuid.removeprefix("gpu-")


def _pci_id_by_uuid(uuid: str, gpus_dir: str) -> str:
    wanted = _bare_uuid(uuid)
    for name in sorted(os.listdir(gpus_dir)):
        with open(os.path.join(gpus_dir, name, "information")) as info:
            for line in info:
                field, _, value = line.partition(":")
                if field.strip() == "GPU UUID" and _bare_uuid(value) == wanted:
                    return name
    raise LookupError(f"no GPU with UUID {uuid} in {gpus_dir}")


def read_local_cpus(pci: str, roots: Roots = Roots()) -> CpuSet:
    """The CPUs the kernel lists as local to PCI device ``pci``."""
    with open(os.path.join(roots.pci_devices, pci, "local_cpulist")) as f:
        return parse_cpulist(f.read())


def read_socket(cpu: int, roots: Roots = Roots()) -> int:
    """The socket (physical package) of logical CPU ``cpu``."""
    with open(os.path.join(roots.cpus, f"cpu{cpu}", "topology", "physical_package_id")) as f:
        return int(f.read())


def pin_threads(cpus: CpuSet, roots: Roots = Roots()) -> None:
    """Pin every thread of this process (``sched_setaffinity`` of pid 0 would pin one thread only)."""
    for tid in os.listdir(roots.threads):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:  # the thread ended meanwhile
            pass


# ---- the decision --------------------------------------------------------------------------


def pin_to_gpu(pcis: Sequence[str], me: int, roots: Roots = Roots()) -> CpuSet | None:
    """Pin this process to the CPUs local to GPU ``pcis[me]``; ``pcis``: the GPU (PCI id) of each rank
    on this host (one entry without torchrun). The CPUs pinned, or None (logged why)."""
    allowed = frozenset(os.sched_getaffinity(0))
    try:
        local = [read_local_cpus(pci, roots) for pci in pcis]
        cpus = choose_cpus(local, me, allowed, lambda cpu: read_socket(cpu, roots))
    except (OSError, ValueError) as exc:
        logger.info("CPU affinity not set: the CPU topology is unknown (%s: %s)", type(exc).__name__, exc)
        return None
    if cpus is None:
        logger.info("CPU affinity not set: the CPUs near GPU %s (%s) and their socket are fewer than the share "
                    "of one of %d rank(s) of the %d allowed CPUs", pcis[me], _compact(local[me]), len(pcis),
                    len(allowed))
        return None
    pin_threads(cpus, roots)
    logger.info("CPU affinity: this process (pid %d) pinned to %d CPU(s) near GPU %s: %s (of %d allowed, %d local)",
                os.getpid(), len(cpus), pcis[me], _compact(cpus), len(allowed), len(local[me]))
    return cpus


def pin_for_engine(enabled: bool, device: torch.device, dist: DistributedContext | None, *,
                   properties: Callable[[int], Any] | None = None, roots: Roots = Roots()) -> CpuSet | None:
    """The engine set-up's call (once, before the datasets): pin when the key is on, on Linux, for a
    CUDA device; under torchrun the ranks on this host share the CPUs, unless the launcher bound them.
    ``properties``: a CUDA device's properties (``torch.cuda.get_device_properties``; fake in tests)."""
    if not enabled or device.type != "cuda" or not sys.platform.startswith("linux"):
        return None
    pci = _own_pci_id(device, properties or torch.cuda.get_device_properties, roots)
    allowed = sorted(os.sched_getaffinity(0))
    ranks: list[tuple[int, str | None, list[int]]]
    if dist is None:
        ranks = [(0, pci, allowed)]
        me = 0
    else:  # every rank reports its own GPU: CUDA_VISIBLE_DEVICES may differ between the ranks
        host = socket.gethostname()
        ranks = [entry[1:] for entry in dist.gather_from_ranks((host, dist.rank, pci, allowed)) if entry[0] == host]
        me = [entry[0] for entry in ranks].index(dist.rank)
    if any(entry[2] != allowed for entry in ranks):
        logger.info("CPU affinity not set: the launcher already bound the ranks on this host to different CPUs "
                    "(%s)", "; ".join(_compact(entry[2]) for entry in ranks))
        return None
    pcis = [entry[1] for entry in ranks]
    if None in pcis:  # this rank's own reason is logged; rank 0 alone logs info lines under torchrun
        unknown = [rank for rank, pci in zip([entry[0] for entry in ranks], pcis) if pci is None]
        logger.info("CPU affinity not set: the GPU of rank(s) %s on this host is unknown", unknown)
        return None
    return pin_to_gpu([pci for pci in pcis if pci is not None], me, roots)


def _own_pci_id(device: torch.device, properties: Callable[[int], Any], roots: Roots) -> str | None:
    """This process' GPU as a PCI id; None (logged) when neither torch nor the driver tells."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    try:
        return pci_id(properties(index), roots)
    except (OSError, LookupError, ValueError, RuntimeError, AttributeError) as exc:
        logger.info("CPU affinity not set: the PCI id of cuda:%d is unknown (%s: %s)", index, type(exc).__name__, exc)
        return None


def _compact(cpus: Iterable[int]) -> str:
    """A cpulist again (``0-3,8``): short log lines on machines with hundreds of CPUs."""
    runs: list[list[int]] = []
    for cpu in sorted(cpus):
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
