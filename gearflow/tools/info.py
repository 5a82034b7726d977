"""``gearflow info``: versions of the dependencies and which accelerators are usable."""

from __future__ import annotations

import importlib
import importlib.metadata
import platform
from dataclasses import dataclass

from gearflow.native import Probe, probe_cuda, probe_cupy, probe_nvcc
from gearflow.transport.choice import pyverbs_status

PACKAGES = ("gearflow", "torch", "numpy", "envpool", "gymnasium", "omegaconf", "uvloop", "rich", "ray")


@dataclass(frozen=True)
class Row:
    name: str
    ok: bool
    detail: str


def _package(name: str) -> Row:
    try:
        module = importlib.import_module(name)
    except Exception as exc:  # a broken install can raise more than ImportError
        return Row(name, False, f"not importable: {type(exc).__name__}: {exc}")
    version = getattr(module, "__version__", None)
    if version is None:
        try:
            version = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            version = "installed"
    return Row(name, True, str(version))


def collect() -> list[Row]:
    rows = [Row("python", True, f"{platform.python_version()} ({platform.machine()})")]
    rows += [_package(name) for name in PACKAGES]
    rows.append(_c_module("replay C hot path", "gearflow.replay._hotpath", "using the numpy reference (slower)"))
    rows.append(_c_module("C decode step", "agents._r2d2_decode", "transformer actors step with TorchScript (slower)"))
    rows.append(_c_module("frame MAC (NH)", "gearflow.transport._mac", "NH in numpy, ~0.9 GB/s (integrity costs far more)",
                          lambda m: "built, AVX2" if getattr(m, "avx2", lambda: False)() else "built, scalar (no AVX2 here)"))
    probes: list[Probe] = [probe_cuda(), probe_cupy(), probe_nvcc(), Probe("pyverbs (rdma)", *pyverbs_status())]
    rows += [Row(p.name, p.ok, p.detail) for p in probes]
    return rows


def _c_module(label: str, module: str, fallback: str, detail=None) -> Row:
    """A C module of the package (setup.py builds it at install where a compiler exists);
    ``detail(module)``: what the row says when it is built."""
    try:
        m = importlib.import_module(module)
    except ImportError as exc:
        return Row(label, False, f"not built ({exc}); {fallback}")
    return Row(label, True, detail(m) if detail else "built")


def render(rows: list[Row]) -> str:
    width = max(len(r.name) for r in rows)
    lines = [f"{'component':<{width}}  usable  version / reason", "-" * (width + 40)]
    for r in rows:
        lines.append(f"{r.name:<{width}}  {'yes' if r.ok else 'no':<6}  {r.detail}")
    return "\n".join(lines)
