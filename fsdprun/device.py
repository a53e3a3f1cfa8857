"""Accelerator abstraction: which device a worker uses, its collective backend, memory readings.

Everything device-specific goes through here (`torch.get_device_module` for cuda/npu/xpu), so a
new accelerator is one entry in `BACKENDS` plus its import hook, not edits across the engine.

Never imports an fsdprun module but `errors`: every layer may ask it.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import platform
import resource
import shutil
import subprocess
import time
from dataclasses import dataclass

import torch

from fsdprun.errors import UserError

# Device kind → torch.distributed backend.
BACKENDS = {"cuda": "nccl", "cpu": "gloo", "npu": "hccl", "xpu": "xccl"}

# Accelerators whose PyTorch support lives in a separate package that registers the device.
_PLUGINS = {"npu": ("torch_npu", "pip install torch-npu (the release matching your torch)")}


def _import_plugin(kind: str) -> None:
    if kind not in _PLUGINS:
        return
    module, how = _PLUGINS[kind]
    try:
        importlib.import_module(module)
    except ImportError as e:
        raise UserError(
            f"launch.device is '{kind}' but {module} is not importable ({e}); {how}, "
            "or set launch.device=cpu"
        ) from e


def _available(kind: str) -> bool:
    if kind == "cpu":
        return True
    if kind in _PLUGINS:
        try:
            _import_plugin(kind)
        except UserError:
            return False
    mod = getattr(torch, kind, None)
    return bool(mod is not None and mod.is_available())


ACCELERATORS = ("cuda", "npu", "xpu")


def resolve_device_kind(requested: str) -> str:
    """`auto` → the first available of cuda, npu, xpu, else cpu; `accelerator` → the same but
    never cpu; a named kind must exist.

    Raises:
        UserError: the requested accelerator is missing.
    """
    if requested in ("auto", "accelerator"):
        for kind in ACCELERATORS:
            # npu only counts when torch_npu is installed; auto never fails for its absence.
            if kind == "npu" and importlib.util.find_spec("torch_npu") is None:
                continue
            if _available(kind):
                return kind
        if requested == "accelerator":
            raise UserError(
                "launch.device is 'accelerator' (the recipe is sized for GPUs) but torch sees no "
                f"{', '.join(ACCELERATORS)} device here; launch.device=cpu forces a CPU run"
            )
        return "cpu"
    if requested not in BACKENDS:
        raise UserError(
            f"launch.device: '{requested}' is not one of auto, accelerator, {', '.join(BACKENDS)}"
        )
    _import_plugin(requested)
    if not _available(requested):
        raise UserError(
            f"launch.device is '{requested}' but no {requested} device is available here; "
            "use launch.device=auto or cpu"
        )
    return requested


def process_group_backend(kind: str, *, cpu_offload: bool) -> str:
    """The backend string for `init_process_group` on `kind` devices.

    With fsdp.cpu_offload on an accelerator the sharded gradients live in host memory, and
    gradient clipping all-reduces their norm as a CPU tensor: an NCCL-only group fails there
    ("No backend type associated with device type cpu"). Such runs get gloo for CPU tensors
    beside the accelerator's backend for device tensors (what torchtitan does too).
    """
    backend = BACKENDS[kind]
    if cpu_offload and kind != "cpu":
        return f"cpu:gloo,{kind}:{backend}"
    return backend


def device_count(kind: str) -> int:
    if kind == "cpu":
        return 0
    return torch.get_device_module(kind).device_count()


def check_nproc(kind: str, nproc_per_node: int) -> None:
    """More ranks than accelerators on a node is a user error (CPU ranks are processes)."""
    if kind == "cpu":
        return
    count = device_count(kind)
    if nproc_per_node > count:
        raise UserError(
            f"launch.nproc_per_node is {nproc_per_node} but this node has {count} {kind} "
            f"device(s); use --nproc-per-node {count} or fewer"
        )


def nvidia_smi_total_memory(visible_devices: str | None) -> int | None:
    """The total memory in bytes of the first GPU that CUDA_VISIBLE_DEVICES (`visible_devices`)
    leaves visible, read by nvidia-smi through NVML, or None. Asking torch instead initializes
    CUDA in the launcher (torch's lazy init, for the whole run), and torch then refuses CUDA in
    any process forked after it."""
    exe = shutil.which("nvidia-smi")
    first = (visible_devices.split(",")[0] if visible_devices is not None else "0").strip()
    if exe is None or not first or first == "-1":
        return None
    try:
        proc = subprocess.run(
            [exe, "--query-gpu=memory.total", "--format=csv,noheader,nounits", f"--id={first}"],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        return int(proc.stdout.split()[0]) * 2**20 if proc.returncode == 0 else None  # MiB
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def memory_per_rank(kind: str, nproc_per_node: int) -> tuple[int | None, str]:
    """What one rank may use, and how it was found: a device's total memory (CUDA: from
    nvidia-smi, without initializing CUDA in this process); on CPU the machine's RAM shared by the
    node's ranks. (None, why) when it cannot be read."""
    if kind == "cpu":
        try:
            ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError):
            return None, "RAM unknown"
        ranks = f"{nproc_per_node} rank{'s' if nproc_per_node > 1 else ''}"
        return ram // nproc_per_node, f"RAM {ram / 2**30:.1f} GiB / {ranks}"
    if kind == "cuda":
        total = nvidia_smi_total_memory(os.environ.get("CUDA_VISIBLE_DEVICES"))
        if total is None:
            return None, "cuda memory unknown (nvidia-smi gave none)"
        return total, f"one cuda device, {total / 2**30:.1f} GiB"
    props = torch.get_device_module(kind).get_device_properties(0)
    total = getattr(props, "total_memory", None)
    if total is None:
        return None, f"{kind} memory unknown"
    return total, f"one {kind} device, {total / 2**30:.1f} GiB"


@dataclass(frozen=True)
class Device:
    """The device of one worker."""

    kind: str
    index: int | None

    @property
    def torch_device(self) -> torch.device:
        return (
            torch.device(self.kind, self.index) if self.index is not None else torch.device("cpu")
        )

    @property
    def backend(self) -> str:
        return BACKENDS[self.kind]

    @property
    def module(self):
        return torch.get_device_module(self.kind) if self.kind != "cpu" else None

    def name(self) -> str:
        if self.kind == "cpu":
            return f"CPU ({platform.processor() or platform.machine()})"
        return self.module.get_device_name(self.index)

    def synchronize(self) -> None:
        if self.module is not None:
            self.module.synchronize(self.index)

    def reset_peak_memory(self) -> None:
        if self.module is not None:
            self.module.reset_peak_memory_stats(self.index)

    def peak_memory(self) -> dict[str, int]:
        """Peak bytes: allocated and reserved on an accelerator; resident set size on CPU."""
        if self.module is None:
            # ru_maxrss is in KiB on Linux. It is the whole process's peak, torch runtime included.
            return {"peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
        return {
            "peak_allocated_bytes": self.module.max_memory_allocated(self.index),
            "peak_reserved_bytes": self.module.max_memory_reserved(self.index),
        }


def build_worker_device(kind: str, local_rank: int) -> Device:
    """The device of the worker with this local rank, made current."""
    if kind == "cpu":
        return Device("cpu", None)
    _import_plugin(kind)
    torch.get_device_module(kind).set_device(local_rank)
    return Device(kind, local_rank)


class StepTimer:
    """Step times without a host sync per step.

    On an accelerator each step is bracketed by two timing events recorded on the device's
    stream, read back only when asked (`times`, at logging steps and at the end, where the loop
    reads the loss anyway). A `synchronize` at the end of every step would leave the device idle
    while the host prepares the next step (its data, FSDP's pre-forward hooks, the first
    launches); here the host queues the next step while the device finishes this one. A step's
    time is then the device's: from when it reached the step's first work to the step's last,
    idle gaps inside the step included. On CPU (`event` None) work runs as it is issued, and the
    host's clock is the step's time.

    Args:
        event: the device module's Event class (`torch.cuda.Event`), or None for the host clock.
    """

    def __init__(self, event: type | None = None):
        self._event = event
        self._done: list[float] = []
        self._pending: list[tuple] = []  # (start, end) events not yet read
        self._start = None

    @classmethod
    def for_device(cls, device: Device) -> StepTimer:
        return cls(getattr(device.module, "Event", None) if device.module is not None else None)

    def start(self) -> None:
        if self._event is None:
            self._start = time.perf_counter()
        else:
            self._start = self._event(enable_timing=True)
            self._start.record()

    def stop(self) -> None:
        if self._event is None:
            self._done.append(time.perf_counter() - self._start)
            return
        end = self._event(enable_timing=True)
        end.record()
        self._pending.append((self._start, end))

    def times(self) -> list[float]:
        """Every stopped step's time in seconds (waits for the device to reach the last)."""
        if self._pending:
            self._pending[-1][1].synchronize()  # a CPU-GPU sync, only where times are read
            self._done += [start.elapsed_time(end) / 1000 for start, end in self._pending]
            self._pending.clear()
        return self._done
