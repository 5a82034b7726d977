"""The transport choice: ``transport.kind = auto | tcp | rdma`` resolved once, with the reason.

    choice = choose_transport(cfg.transport.kind)   # TransportChoice("tcp", "transport=auto: pyverbs is not importable ...")
    if choice.transport == "rdma": ...               # the learner reads rows with one-sided READs (gearflow.transport.rdma)

``auto`` is ``rdma`` where pyverbs imports and an RDMA device is listed, else ``tcp``; ``rdma``
without them is a one-line error saying how to install pyverbs. The learner's shard client
(:class:`~gearflow.transport.learner.RemoteShards`) and a shard node's server
(:class:`~gearflow.transport.server.NodeService`) both ask here, and start what the answer
names without knowing any transport themselves::

    extra = choice.serve(shard_service)       # the node: RDMA's region export (TCP: None)
    sampler = choice.sampler(shards, cfg)     # the learner: RdmaSampler (TCP: None, the TCP sampler)

Each transport beside TCP is one :class:`DataPath` entry in :data:`DATA_PATHS` (its probe, and
where its server and learner ends are); the config's ``transport.kind`` check follows from it
(:func:`transport_names`). pyverbs is imported only by the probes below and by
:mod:`gearflow.transport.rdma.fabric`'s Verbs classes, never at import.
"""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable

from gearflow.errors import ConfigError, MissingDependencyError

__all__ = [
    "DATA_PATHS",
    "DataPath",
    "PYVERBS_HINT",
    "TransportChoice",
    "choose_transport",
    "load",
    "parse_ibv_devices",
    "pyverbs_status",
    "pyverbs_version",
    "rdma_devices",
    "rdma_probe",
    "transport_names",
    "require_rdma",
]


@dataclass(frozen=True)
class DataPath:
    """A transport beside TCP: how learners read a shard node's rows other than by the TCP
    service's ``replay.sample``. ``probe(requested, **overrides)`` resolves ``auto`` or the
    transport's own name to a :class:`TransportChoice` (its name, or ``tcp`` with the reason) or
    raises a one-line error; ``serve`` (``(shard_service) -> closeable``, run by the node beside
    its TCP service) and ``sampler`` (``(shards, cfg) -> SamplerLike``, shards being the learner's
    :class:`~gearflow.transport.learner.RemoteShards`) are ``"module:function"``, imported only
    when the transport is chosen."""

    probe: Callable[..., "TransportChoice"]
    serve: str
    sampler: str


def load(target: str) -> Callable[..., Any]:
    """The function a ``"module:function"`` names."""
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


PYVERBS_HINT = (
    "pyverbs ships with rdma-core, not PyPI: apt-get install python3-pyverbs "
    "(Debian/Ubuntu) or dnf install python3-pyverbs, for the same Python as gearflow"
)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def pyverbs_status() -> tuple[bool, str]:
    """(pyverbs importable and at least one RDMA device present, the device names or why not):
    what ``gearflow info`` shows."""
    try:
        device = importlib.import_module("pyverbs.device")
    except ImportError as exc:
        return False, f"not importable ({_first_line(exc)}); {PYVERBS_HINT}"
    try:
        devices = device.get_device_list()
    except Exception as exc:
        return False, f"pyverbs imports but {_first_line(exc)}"
    if not devices:
        return False, "pyverbs imports but there is no RDMA device"
    return True, ", ".join(d.name.decode() if isinstance(d.name, bytes) else str(d.name) for d in devices)


@dataclass(frozen=True)
class TransportChoice:
    """What ``transport=auto|tcp|rdma`` resolved to (``"tcp"`` or ``"rdma"``) and why."""

    transport: str
    reason: str

    def serve(self, shard_service) -> Any:
        """Start this transport's server end beside the node's TCP service (what the node closes
        when it stops), or None for TCP: the service itself is the server end."""
        path = DATA_PATHS.get(self.transport)
        return None if path is None else load(path.serve)(shard_service)

    def sampler(self, shards, cfg) -> Any:
        """This transport's learner end over ``shards`` (a ``SamplerLike``), or None for TCP: the
        caller's own TCP sampler."""
        path = DATA_PATHS.get(self.transport)
        return None if path is None else load(path.sampler)(shards, cfg)


def pyverbs_version() -> tuple[bool, str]:
    """(pyverbs importable, where it is or why not)."""
    try:
        module = importlib.import_module("pyverbs")
    except ImportError as exc:
        return False, f"pyverbs is not importable ({type(exc).__name__}: {exc}); {PYVERBS_HINT}"
    return True, f"pyverbs at {os.path.dirname(getattr(module, '__file__', '') or '?')}"


def parse_ibv_devices(text: str) -> list[str]:
    """Device names from ``ibv_devices`` output (a header, a dashed line, then one device a line)::

        parse_ibv_devices("    device   node GUID\\n    ------   ----\\n    mlx5_0   b8ce...\\n")  # ['mlx5_0']
    """
    names = []
    for line in text.splitlines():
        fields = line.split()
        if not fields or fields[0] in ("device", "------") or set(fields[0]) == {"-"}:
            continue
        names.append(fields[0])
    return names


def rdma_devices() -> tuple[list[str], str]:
    """(RDMA device names, how they were found or why there are none): ``ibv_devices`` where it
    is installed (rdma-core's ibverbs-utils), else pyverbs' device list, else /sys/class/infiniband."""
    tool = shutil.which("ibv_devices")
    if tool is not None:
        try:
            out = subprocess.run([tool], check=False, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError) as exc:
            return [], f"ibv_devices failed: {exc}"
        names = parse_ibv_devices(out.stdout)
        if names:
            return names, "listed by ibv_devices"
        err = (out.stderr or out.stdout).strip().splitlines()
        return [], "ibv_devices lists no device" + (f" ({err[-1]})" if err else "")
    try:
        device = importlib.import_module("pyverbs.device")
        found = device.get_device_list()
        names = [d.name.decode() if isinstance(d.name, bytes) else str(d.name) for d in found]
        return names, "listed by pyverbs (ibv_devices is not installed)" if names else "pyverbs lists no device"
    except ImportError:
        pass
    except Exception as exc:  # noqa: BLE001 - PyverbsRDMAError without kernel support
        return [], f"no RDMA device: pyverbs cannot list devices ({type(exc).__name__}: {exc})"
    sys_dir = "/sys/class/infiniband"
    names = sorted(os.listdir(sys_dir)) if os.path.isdir(sys_dir) else []
    return names, f"found in {sys_dir}" if names else f"no RDMA device ({sys_dir} is empty or missing)"


def choose_transport(requested: str = "auto", *, pyverbs: tuple[bool, str] | None = None,
                     devices: tuple[list[str], str] | None = None) -> TransportChoice:
    """Resolve ``transport=auto|tcp|rdma``.

    ``auto``: ``rdma`` when pyverbs imports and an RDMA device is listed, else ``tcp``, the
    reason naming what was missing. ``rdma`` without pyverbs or a device raises a one-line
    :class:`MissingDependencyError` (how to install pyverbs) or :class:`ConfigError`.
    ``pyverbs`` / ``devices`` override the probes (``(importable, detail)`` and the
    :func:`rdma_devices` result), so the rule is tested without hardware.
    """
    names = transport_names()
    if requested not in names:
        raise ConfigError(f"transport must be one of {', '.join(names)}, got {requested!r}")
    if requested == "tcp":
        return TransportChoice("tcp", "transport=tcp asked for")
    choice = TransportChoice("tcp", f"transport={requested}")
    for name, path in DATA_PATHS.items():  # auto: the first one usable here, in this order
        if requested in ("auto", name):
            choice = path.probe(requested, pyverbs=pyverbs, devices=devices)
            if choice.transport != "tcp":
                return choice
    return choice


def rdma_probe(requested: str, *, pyverbs: tuple[bool, str] | None = None,
               devices: tuple[list[str], str] | None = None, **_: Any) -> TransportChoice:
    """RDMA's :attr:`DataPath.probe`: usable when pyverbs imports and an RDMA device is listed."""
    ok, detail = pyverbs if pyverbs is not None else pyverbs_version()
    if not ok:
        if requested == "rdma":
            raise MissingDependencyError(f"transport=rdma needs pyverbs: {detail}")
        return TransportChoice("tcp", f"transport=auto: {detail}")
    names, how = devices if devices is not None else rdma_devices()
    if not names:
        if requested == "rdma":
            raise ConfigError(f"transport=rdma needs an RDMA device: {how}")
        return TransportChoice("tcp", f"transport=auto: {detail} imports, but {how}")
    return TransportChoice("rdma", f"transport={requested}: {detail}; device(s) {', '.join(names)} {how}")


def require_rdma(purpose: str) -> ModuleType:
    """The pyverbs package, or a one-line :class:`MissingDependencyError` naming ``purpose``
    and how to install it."""
    ok, detail = pyverbs_version()
    if not ok:
        raise MissingDependencyError(f"{purpose} needs pyverbs: {detail}")
    return importlib.import_module("pyverbs")


DATA_PATHS: dict[str, DataPath] = {
    "rdma": DataPath(rdma_probe, serve="gearflow.transport.rdma.replay:serve_node",
                     sampler="gearflow.transport.rdma.replay:node_sampler"),
}  # fmt: skip


def transport_names() -> tuple[str, ...]:
    """``auto``, ``tcp`` and every :data:`DATA_PATHS` entry (the config's ``transport.kind`` check)."""
    return ("auto", "tcp", *DATA_PATHS)
