"""The CUDA back end: CuPy raw kernels for the GPU-centric replay path (RDMA is
:mod:`gearflow.transport.rdma`).

CuPy is optional. Nothing here imports CuPy at module import time;
the ``probe_*`` functions tell whether each is usable and why not, and the
``require_*`` functions return the module or raise a one-line
:class:`~gearflow.errors.MissingDependencyError` saying how to install it.
"""

from __future__ import annotations

import functools
import importlib
import shutil
import subprocess
from dataclasses import dataclass
from types import ModuleType

from gearflow.errors import MissingDependencyError

CUPY_HINT = "pip install 'gearflow[gpu]' (CUDA 12) or 'gearflow[gpu-cu13]' (CUDA 13)"


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


PROBE_KERNEL = r"""
extern "C" __global__ void gearflow_probe(const long long* a, long long* out, long long n)
{
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = 2 * a[i] + 1;
}
"""
CTK_HINT = (
    "a CUDA toolkit (NVRTC): the system's (/usr/local/cuda) or pip install 'cupy-cuda12x[ctk]' "
    "('cupy-cuda13x[ctk]' for CUDA 13)"
)


def probe_cupy(cupy: ModuleType | None = None) -> Probe:
    """CuPy importable *and* able to compile (NVRTC) and run a raw kernel on the current device.

    Steps, the first that fails named in ``detail``: import; the driver and a
    device (``getDeviceCount``); NVRTC (CuPy's runtime compiler, from a CUDA
    toolkit or CuPy's ``[ctk]`` extra); compiling a tiny kernel; running it
    and reading its result back. ``cupy`` may be injected (tests); the
    imported module's result is cached for the process.
    """
    if cupy is not None:
        return _probe_cupy(cupy)
    return _probe_cupy_imported()


@functools.lru_cache(maxsize=1)
def _probe_cupy_imported() -> Probe:
    try:
        cupy = importlib.import_module("cupy")
    except ImportError as exc:
        return Probe("cupy", False, f"not installed ({_first_line(exc)}); {CUPY_HINT}")
    return _probe_cupy(cupy)


def _probe_cupy(cupy: ModuleType) -> Probe:
    version = f"cupy {getattr(cupy, '__version__', '?')}"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001 - CUDARuntimeError without a driver or device
        return Probe("cupy", False, f"{version} imports but the CUDA driver or device is missing: {_first_line(exc)}")
    if count == 0:
        return Probe("cupy", False, f"{version}: no CUDA device")
    try:
        nvrtc = cupy.cuda.nvrtc.getVersion()
        nvrtc = ".".join(map(str, nvrtc)) if isinstance(nvrtc, tuple) else str(nvrtc)
    except Exception as exc:  # noqa: BLE001 - libnvrtc not found (no toolkit and no [ctk] wheels)
        return Probe("cupy", False, f"{version}, {count} device(s), but NVRTC is missing ({_first_line(exc)}): "
                     f"CuPy compiles its kernels at run time and needs {CTK_HINT}")  # fmt: skip
    try:
        kernel = cupy.RawKernel(PROBE_KERNEL, "gearflow_probe")
        kernel.compile()
    except Exception as exc:  # noqa: BLE001 - NVRTC present but the compile fails (headers, builtins, arch)
        return Probe("cupy", False, f"{version}, NVRTC {nvrtc}: a test kernel does not compile "
                     f"({_first_line(exc)}); check {CTK_HINT}")  # fmt: skip
    try:
        n = 64
        a = cupy.arange(n, dtype=cupy.int64)
        out = cupy.zeros(n, dtype=cupy.int64)
        kernel((1,), (n,), (a, out, cupy.int64(n)))
        got = [int(v) for v in cupy.asnumpy(out).tolist()]
    except Exception as exc:  # noqa: BLE001 - no kernel image for this GPU, driver too old for the toolkit, ...
        return Probe("cupy", False, f"{version}, NVRTC {nvrtc}: a test kernel compiled but did not run "
                     f"({_first_line(exc)}): is the driver as new as the toolkit?")  # fmt: skip
    if got != [2 * i + 1 for i in range(n)]:
        return Probe("cupy", False, f"{version}: a test kernel ran but returned wrong values")
    device = int(cupy.cuda.runtime.getDevice())
    return Probe("cupy", True, f"{version}, NVRTC {nvrtc}, {count} device(s); a test kernel ran on cuda:{device}")


def probe_nvcc() -> Probe:
    """The CUDA compiler (used to compile the .cu sources to PTX in tests)."""
    path = shutil.which("nvcc")
    if path is None:
        return Probe("nvcc", False, "nvcc not on PATH")
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        return Probe("nvcc", False, _first_line(exc))
    release = [ln for ln in out.stdout.splitlines() if "release" in ln]
    return Probe("nvcc", out.returncode == 0, release[0].strip() if release else path)


def require_cupy(purpose: str) -> ModuleType:
    """Return the cupy module or raise a one-line error naming ``purpose``."""
    probe = probe_cupy()
    if not probe.ok:
        raise MissingDependencyError(f"{purpose} needs CuPy and a CUDA GPU: {probe.detail}")
    return importlib.import_module("cupy")

