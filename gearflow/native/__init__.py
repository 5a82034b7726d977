"""Native back ends: CuPy raw kernels (CUDA) and pyverbs (RDMA).

Both are optional. Nothing here imports CuPy or pyverbs at module import time;
the ``probe_*`` functions tell whether each is usable and why not, and the
``require_*`` functions return the module or raise a one-line
:class:`~gearflow.errors.MissingDependencyError` saying how to install it.
"""

from __future__ import annotations

import importlib
import shutil
import subprocess
from dataclasses import dataclass
from types import ModuleType

from gearflow.errors import MissingDependencyError


CUPY_HINT = "pip install 'gearflow[gpu]' (CUDA 12) or 'gearflow[gpu-cu13]' (CUDA 13)"
PYVERBS_HINT = (
    "pyverbs ships with rdma-core, not PyPI: apt-get install python3-pyverbs "
    "(Debian/Ubuntu) or dnf install python3-pyverbs, for the same Python as gearflow"
)


@dataclass(frozen=True)
class Probe:
    """Whether a capability is usable here; ``detail`` is a version or the reason it is not."""

    name: str
    ok: bool
    detail: str


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def probe_cuda() -> Probe:
    """torch's view of CUDA."""
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - torch is a core dependency
        return Probe("cuda (torch)", False, _first_line(exc))
    if not torch.backends.cuda.is_built():
        return Probe("cuda (torch)", False, f"torch {torch.__version__} is a CPU-only build")
    if not torch.cuda.is_available():
        return Probe("cuda (torch)", False, "no CUDA device visible to torch")
    name = torch.cuda.get_device_name(0)
    return Probe("cuda (torch)", True, f"{torch.cuda.device_count()} device(s), {name}")


def probe_cupy() -> Probe:
    """CuPy importable *and* able to run a kernel on a device."""
    try:
        cupy = importlib.import_module("cupy")
    except ImportError as exc:
        return Probe("cupy", False, f"not installed ({_first_line(exc)}); {CUPY_HINT}")
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # CUDARuntimeError without a driver or device
        return Probe("cupy", False, f"cupy {cupy.__version__} imports but {_first_line(exc)}")
    if count == 0:
        return Probe("cupy", False, f"cupy {cupy.__version__}: no CUDA device")
    return Probe("cupy", True, f"cupy {cupy.__version__}, {count} device(s)")


def probe_nvcc() -> Probe:
    """The CUDA compiler (used to compile the .cu sources to PTX in tests)."""
    path = shutil.which("nvcc")
    if path is None:
        return Probe("nvcc", False, "nvcc not on PATH")
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        return Probe("nvcc", False, _first_line(exc))
    release = [ln for ln in out.stdout.splitlines() if "release" in ln]
    return Probe("nvcc", out.returncode == 0, release[0].strip() if release else path)


def probe_pyverbs() -> Probe:
    """pyverbs importable and at least one RDMA device present."""
    try:
        device = importlib.import_module("pyverbs.device")
    except ImportError as exc:
        return Probe("pyverbs (rdma)", False, f"not importable ({_first_line(exc)}); {PYVERBS_HINT}")
    try:
        devices = device.get_device_list()
    except Exception as exc:
        return Probe("pyverbs (rdma)", False, f"pyverbs imports but {_first_line(exc)}")
    if not devices:
        return Probe("pyverbs (rdma)", False, "pyverbs imports but there is no RDMA device")
    names = ", ".join(d.name.decode() if isinstance(d.name, bytes) else str(d.name) for d in devices)
    return Probe("pyverbs (rdma)", True, names)


def require_cupy(purpose: str) -> ModuleType:
    """Return the cupy module or raise a one-line error naming ``purpose``."""
    probe = probe_cupy()
    if not probe.ok:
        raise MissingDependencyError(f"{purpose} needs CuPy and a CUDA GPU: {probe.detail}")
    return importlib.import_module("cupy")


def require_pyverbs(purpose: str) -> ModuleType:
    """Return the pyverbs package or raise a one-line error naming ``purpose``."""
    probe = probe_pyverbs()
    if not probe.ok:
        raise MissingDependencyError(f"{purpose} needs pyverbs and an RDMA device: {probe.detail}")
    return importlib.import_module("pyverbs")
