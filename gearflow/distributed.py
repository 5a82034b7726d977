"""Data-parallel learners: K processes train one model with ``torch.distributed``.

Each learner samples its own ``batch_size / world_size`` share of the global batch from
replay, runs the agent's unchanged ``learn()``, and the gradients are averaged across the
learners inside ``optimizer.step()`` (a step pre-hook), so every rank applies the same
update to the same weights. Rank 0 publishes weights to the actors and writes checkpoints::

    parallel = DataParallel.from_config(cfg, device)  # None when learner.world_size == 1
    if parallel is not None:
        parallel.init()            # rendezvous at learner.dist_address (gloo on CPU, NCCL on CUDA)
        parallel.setup(agent)      # rank 0's learner state everywhere; gradient averaging hooks
    learner = Learner(cfg.learner, agent, table, params, progress, run=cfg.run, ..., parallel=parallel)
    learner.run(batches.next_batch)   # learns only when every rank has a batch; stops together
    parallel.close()

Why the averaging is a step pre-hook and not DDP or hooks on ``backward``:

* the agents stay as they are (``zero_grad / backward / clip_grad_norm_ / step``): no wrapper
  module whose ``forward`` they would have to call, and the target networks, the DT
  temperature and every other tensor that has no gradient are not touched;
* one flattened all_reduce per optimizer step (a coalesced buffer of every parameter's
  gradient, plus one flag per parameter): gradients that backward left ``None`` count as
  zero, and a parameter gets the averaged gradient on every rank when it had one on any rank,
  so the optimizers keep the same state everywhere (Adam steps a parameter only when its
  gradient is not ``None``); hooks on ``backward`` would have to know which parameters
  never receive a gradient, or they wait forever;
* **clipping applies to each rank's local gradient, before the average**: the agent clips
  between ``backward`` and ``step``, the hook runs inside ``step``. The update is the mean of
  the K clipped local gradients, so its norm is still ≤ ``max_grad_norm`` (triangle
  inequality), and it equals the single-learner update exactly whenever no rank's local norm
  exceeds the limit (the equivalence test makes clipping inactive). Clipping the averaged
  gradient instead would need the average before ``clip_grad_norm_``, i.e. a call inside each
  agent's ``learn()`` (or a wrapped ``backward``). A share's gradient is noisier than the
  global batch's, so its norm is larger and local clipping starts a little earlier; that is
  harmless at the reference agents' limits and was not worth changing the
  agent contract for. ``learner/grad_norm`` is the local (pre-average) norm of each rank.

Each agent's loss is a mean over its local batch, so the average of K equal-share gradients
is the gradient of the mean over the global batch: the same update as one learner with the
global batch (up to float summation order) when the IS weights are the same. Two things that
are not global in the agents today: prioritized IS weights are max-normalised within each
rank's share (the table normalises what it sampled), and the DT loss divides by the valid
steps of the local share (exact when shares hold the same number of valid steps).

The loop needs one more collective: :meth:`DataParallel.agree` (one three-integer all_reduce
per iteration) makes every rank learn in the same iterations (only when all have a batch) and
stop in the same one (when any wants to); otherwise one rank's gradient all_reduce would pair
with another rank's next-iteration one, or wait for a rank that stopped. Its third integer is
the ranks' highest env-step count: each rank counts what the shard nodes report to it, and a
shard killed between two of a rank's polls takes the steps since that rank's last poll with it,
so the counts can differ; every rank then uses the highest (its rows, its limits, β).

Every rank's ``learn()`` must call ``optimizer.step()`` the same number of times in the same
order (the reference agents do: the DT temperature step depends only on the config). A learner
that dies fails the others at their next collective (gloo: at once, connection reset); one
that hangs, after ``timeout_s``; both as a GearflowError naming the rank and the address.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import os
import socket
import threading
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gearflow.errors import GearflowError

log = logging.getLogger("gearflow.distributed")

__all__ = ["DataParallel", "fingerprint", "hold_rendezvous", "interface_of", "resolve_backend", "socket_interfaces"]

_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


# ---------------------------------------------------------------------- the learners' network
#
# gloo and NCCL do not use the rendezvous address for their own connections: unless told an
# interface (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME) gloo resolves the machine's hostname and
# falls back to loopback when that fails (a container, a namespace, a host whose name is not in
# DNS), so learners on two hosts each advertise 127.0.0.1 and never meet. Each rank therefore
# names the interface that holds its own address on the learners' network: rank 0 the
# rendezvous host, the others the source address the kernel picks to reach it.

_SIOCGIFADDR = 0x8915


def interface_of(ip: str) -> str | None:
    """The name of this machine's network interface that holds ``ip`` (``"lo"`` for 127.0.0.1),
    or None when no interface does (Linux: SIOCGIFADDR per interface; IPv6 from /proc)."""
    addr = ipaddress.ip_address(ip)
    if addr.version == 6:
        try:
            with open("/proc/net/if_inet6") as f:  # hex address, index, prefix, scope, flags, name
                for line in f:
                    fields = line.split()
                    if len(fields) >= 6 and ipaddress.ip_address(int(fields[0], 16)) == addr:
                        return fields[5]
        except OSError:
            pass
        return None
    import fcntl
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # an interface without an IPv4 address
                continue
            if socket.inet_ntoa(raw[20:24]) == str(addr):
                return name
    return None


def _local_ip(host: str, port: int, rank: int) -> str:
    """This rank's address on the learners' network: the rendezvous host on rank 0, else the
    source address the kernel would use to reach it (a UDP connect sends nothing)."""
    ip = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][4][0]
    if rank == 0:
        return ip
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect((ip, port))
        except OSError as exc:
            raise GearflowError(f"learner rank {rank}: no route from this machine to rank 0 at {host}:{port} "
                                f"(learner.dist_address): {exc}") from None  # fmt: skip
        return s.getsockname()[0]


_SET_HERE: dict[str, str] = {}  # what socket_interfaces set in this process (not the user's)


def socket_interfaces(local_ip: str) -> dict[str, str]:
    """Set ``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME`` to the interface holding
    ``local_ip`` unless the user set them; returns the two as they now are (for the log and the
    errors). An address no interface holds leaves them unset (gloo's own resolution)."""
    name = interface_of(local_ip)
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        now = os.environ.get(var)
        if name and (not now or now == _SET_HERE.get(var)):  # unset, or set by an earlier call here
            os.environ[var] = _SET_HERE[var] = name
    return {var: os.environ.get(var, "") for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}


_HELD: dict[str, socket.socket] = {}
_HELD_LOCK = threading.Lock()


def hold_rendezvous(host: str) -> str:
    """A ``HOST:PORT`` for rank 0's store whose port is held, not guessed: a socket is bound on
    ``host`` port 0 and listening now, and rank 0's :meth:`DataParallel.init` in this process
    serves its store on that very socket (no other process can take the port in between)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind((host, 0))
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise GearflowError(f"cannot listen on {host} for the learners' rendezvous: {exc}") from None
    port = sock.getsockname()[1]
    address = f"[{host}]:{port}" if family == socket.AF_INET6 else f"{host}:{port}"
    with _HELD_LOCK:
        _HELD[address] = sock
    return address


def resolve_backend(backend: str, device: torch.device) -> str:
    """``auto`` → ``nccl`` when the learner runs on CUDA, else ``gloo``."""
    if backend == "auto":
        return "nccl" if torch.device(device).type == "cuda" else "gloo"
    if backend not in ("gloo", "nccl"):
        raise GearflowError(f"learner.dist_backend={backend!r}: must be one of auto, gloo, nccl")
    if backend == "nccl" and torch.device(device).type != "cuda":
        raise GearflowError(f"learner.dist_backend=nccl needs the learner on CUDA, but learner.device is {device}; "
                            "use learner.dist_backend=gloo (or auto)")  # fmt: skip
    return backend


def fingerprint(module: nn.Module) -> int:
    """An exact fingerprint of ``module``'s parameters and buffers: their bits, position-weighted
    and summed in int64 (wrapping), so one changed bit anywhere changes it (with overwhelming
    likelihood). Ranks compare these to check they hold the same weights bit for bit."""
    total = torch.zeros((), dtype=torch.int64)
    offset = 0
    for t in [*module.parameters(), *module.buffers()]:
        flat = t.detach().contiguous().reshape(-1)
        if flat.dtype.is_floating_point or flat.dtype.is_complex:
            flat = flat.view(_INT_VIEW[flat.element_size()]) if flat.element_size() in _INT_VIEW else flat.view(torch.int8)
        bits = flat.to(torch.int64).cpu()  # (n,)
        weights = torch.arange(offset + 1, offset + 1 + bits.numel(), dtype=torch.int64) * 2654435761 + 97
        total += (bits * weights).sum()
        offset += bits.numel()
    return int(total)


def _to_cpu(obj: Any) -> Any:
    """A copy of a nested state dict with every tensor on the CPU (what rank 0 broadcasts)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


class _GradientAverager:
    """The step pre-hook of one optimizer: its parameters' gradients averaged in one all_reduce.

    Buffer layout (allocated once, on the parameters' device; float32, float64 if any
    parameter is)::

        buf = [ grad(p0).flatten() | grad(p1).flatten() | ... | has_grad flags (P,) ]
    """

    def __init__(self, owner: DataParallel, optimizer: torch.optim.Optimizer):
        self.owner = owner
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        if not self.params:
            raise GearflowError(f"{type(optimizer).__name__} has no parameters to average")
        dtype = torch.float64 if any(p.dtype == torch.float64 for p in self.params) else torch.float32
        sizes = [p.numel() for p in self.params]
        n = sum(sizes)
        self.buf = torch.zeros(n + len(self.params), dtype=dtype, device=self.params[0].device)
        self.views = [v.view_as(p) for v, p in zip(torch.split(self.buf[:n], sizes), self.params)]
        self.flags = self.buf[n:]  # (P,) 1 where this rank has a gradient; after the sum: how many ranks had one
        self.handle = optimizer.register_step_pre_hook(self)

    def __call__(self, optimizer, args, kwargs) -> None:
        t0 = time.perf_counter()
        grads = [p.grad for p in self.params]
        have = [i for i, g in enumerate(grads) if g is not None]
        missing = len(have) < len(grads)
        if missing:  # rare (a parameter this batch did not reach): zero its slot, flag it
            for i, g in enumerate(grads):
                if g is None:
                    self.views[i].zero_()
            self.flags.copy_(torch.tensor([g is not None for g in grads], dtype=self.buf.dtype))
        else:
            self.flags.fill_(1.0)
        if have:
            torch._foreach_copy_([self.views[i] for i in have], [grads[i] for i in have])
        self.owner._all_reduce(self.buf, "the gradient all_reduce")  # SUM over ranks
        self.buf.div_(self.owner.world_size)
        if have:
            torch._foreach_copy_([grads[i] for i in have], [self.views[i] for i in have])
        if missing:  # another rank may have had one: then this rank steps the parameter too
            for i in torch.nonzero(self.flags > 0).flatten().tolist():  # a host sync, only here
                if grads[i] is None:
                    self.params[i].grad = self.views[i].clone()
        self.owner._note_allreduce(time.perf_counter() - t0)


class DataParallel:
    """One learner's membership in a group of ``world_size`` data-parallel learners.

    ``init()`` joins the process group, ``setup(agent)`` makes every rank's learner state rank
    0's and installs the gradient averaging, ``agree()`` is called once per learner-loop
    iteration, ``close()`` leaves the group. See the module docstring for the design.
    """

    def __init__(self, rank: int, world_size: int, address: str, backend: str = "auto",
                 device: torch.device | str = "cpu", timeout_s: float = 1800.0):  # fmt: skip
        if not 0 <= rank < world_size:
            raise GearflowError(f"learner.rank={rank} must be in [0, learner.world_size={world_size})")
        host, sep, port = address.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise GearflowError(f"learner.dist_address={address!r}: must be HOST:PORT")
        self.rank, self.world_size, self.address = int(rank), int(world_size), address
        self.device = torch.device(device)
        self.backend = resolve_backend(backend, self.device)
        self.timeout_s = float(timeout_s)
        # collectives run on the learner's GPU under NCCL, on the CPU under gloo
        self.comm_device = self.device if self.backend == "nccl" else torch.device("cpu")
        self._averagers: list[_GradientAverager] = []
        self._joined = False
        self.interface = ""  # this rank's address and the interface gloo/NCCL use (set by init)
        self.allreduce_s = 0.0  # seconds in gradient all_reduce hooks (host time; NCCL: enqueue + flag sync)
        self.allreduce_calls = 0
        self.agree_s = 0.0  # seconds in agree()
        self.env_steps = 0  # the highest env-step count a rank gave the last agree()
        self.agree_calls = 0
        self._reported = (0.0, 0, 0.0, 0)

    @classmethod
    def from_config(cls, cfg, device: torch.device | str, *, timeout_s: float = 1800.0) -> DataParallel | None:
        """The learner's group from ``learner.world_size/rank/dist_address/dist_backend``;
        None for a single learner (``world_size == 1``): the loop then runs as it always did.
        ``timeout_s`` bounds the rendezvous and every collective (a checkpoint that rank 0
        writes while the others wait in :meth:`agree` must fit in it)."""
        le = cfg.learner
        if int(le.world_size) == 1:
            return None
        return cls(int(le.rank), int(le.world_size), str(le.dist_address), str(le.dist_backend), device,
                   timeout_s=timeout_s)  # fmt: skip

    @property
    def is_publisher(self) -> bool:
        """Rank 0 publishes weights to the actors and writes checkpoints."""
        return self.rank == 0

    # ------------------------------------------------------------------ group
    def _store(self):
        """The rendezvous store at :attr:`address`. Rank 0's listens on that address only (a
        socket bound there, handed to torch's TCPStore), not on every interface as torch's own
        ``tcp://`` init would; the store has no credential, so the address should be one of
        the cluster's private network (docs/security.md)."""
        host, _, port = self.address.rpartition(":")
        host = host.strip("[]")
        timeout = datetime.timedelta(seconds=self.timeout_s)
        if self.rank != 0:
            return dist.TCPStore(host, int(port), self.world_size, False, timeout)
        with _HELD_LOCK:
            held = _HELD.pop(self.address, None)
        if held is not None:  # hold_rendezvous() bound it: the port was never free
            fd = held.detach()
            return dist.TCPStore(host, int(port), self.world_size, True, timeout, master_listen_fd=fd, use_libuv=False)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, int(port)))
            sock.listen(max(128, self.world_size))
        except BaseException:
            sock.close()
            raise
        fd = sock.detach()  # the store's daemon owns the listening socket from now on
        return dist.TCPStore(host, int(port), self.world_size, True, timeout, master_listen_fd=fd, use_libuv=False)

    def init(self) -> DataParallel:
        """Join the process group (rank 0 listens at ``dist_address``, the others connect);
        returns when all ``world_size`` learners have joined, or raises GearflowError."""
        if self._joined:
            return self
        if dist.is_initialized():
            raise GearflowError("torch.distributed is already initialised in this process; one DataParallel per process")
        if self.backend == "nccl" and self.device.index is not None:  # "cuda": the current device (Ray: the only one)
            torch.cuda.set_device(self.device)
        t0 = time.monotonic()
        host, _, port = self.address.rpartition(":")
        try:
            local_ip = _local_ip(host.strip("[]"), int(port), self.rank)
        except OSError as exc:
            raise GearflowError(f"learner rank {self.rank}: learner.dist_address={self.address}: cannot resolve "
                                f"{host}: {exc}") from None  # fmt: skip
        ifnames = socket_interfaces(local_ip)
        var = "NCCL_SOCKET_IFNAME" if self.backend == "nccl" else "GLOO_SOCKET_IFNAME"
        self.interface = f"{local_ip} on {var}={ifnames[var] or '(unset: no interface holds it)'}"
        try:
            dist.init_process_group(self.backend, store=self._store(), rank=self.rank, world_size=self.world_size,
                                    timeout=datetime.timedelta(seconds=self.timeout_s))  # fmt: skip
        except Exception as exc:  # DistStoreError / RuntimeError / TimeoutError, depending on where it failed
            waited, text = time.monotonic() - t0, str(exc)
            if "listen" in text or "EADDRINUSE" in text or "in use" in text:
                what = "rank 0 could not listen there (is the port taken, the host this machine's?)"
            elif "connectFullMesh" in text or "Connection refused" in text or "loopback" in text:
                what = (f"the learners met at the store but could not connect to each other over {self.backend} "
                        f"(this rank: {self.interface}; set {var} on every node to the interface of the "
                        "learners' network)")  # fmt: skip
            elif self.rank == 0:
                what = (f"the other {self.world_size - 1} learner(s) did not all arrive within {self.timeout_s:g} s "
                        "(are ranks 1.. started, with this same address?)")  # fmt: skip
            else:
                what = (f"rank 0 could not be reached / the group did not form within {self.timeout_s:g} s "
                        "(is rank 0 running, the address right, the port open?)")  # fmt: skip
            raise GearflowError(
                f"learner rank {self.rank} of {self.world_size} could not join the data-parallel learners at "
                f"learner.dist_address={self.address} after {waited:.1f} s: {what}; "
                f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"
            ) from exc
        self._joined = True
        log.info("learner rank %d of %d joined at %s (%s, %s) in %.2f s", self.rank, self.world_size, self.address,
                 self.backend, self.interface, time.monotonic() - t0)  # fmt: skip
        return self

    def close(self) -> None:
        """Remove the hooks and leave the process group (idempotent)."""
        for averager in self._averagers:
            averager.handle.remove()
        self._averagers = []
        if self._joined:
            self._joined = False
            if dist.is_initialized():
                dist.destroy_process_group()

    def __enter__(self) -> DataParallel:
        return self.init()

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ learner state
    def setup(self, agent) -> None:
        """Make every rank's learner state rank 0's and install gradient averaging on every
        ``torch.optim.Optimizer`` attribute of ``agent`` (after ``agent.setup_learner()`` and
        after a checkpoint restore: a resumed run continues from rank 0's checkpoint).

        With ``agent.state_dict/load_state_dict`` (the reference agents) the whole learner state
        travels: networks, target networks, optimizer and scheduler state, counters. Without
        them, every parameter and buffer of every ``nn.Module`` attribute is broadcast."""
        self._require_joined()
        if callable(getattr(agent, "state_dict", None)) and callable(getattr(agent, "load_state_dict", None)):
            box = [_to_cpu(agent.state_dict()) if self.rank == 0 else None]
            dist.broadcast_object_list(box, src=0, device=self.comm_device)
            if self.rank != 0:
                agent.load_state_dict(box[0])
        else:
            for _, module in self._attributes(agent, nn.Module):
                with torch.no_grad():
                    for t in [*module.parameters(), *module.buffers()]:
                        self._broadcast_tensor(t)
        optimizers = self._attributes(agent, torch.optim.Optimizer)
        if not optimizers:
            raise GearflowError(f"{type(agent).__module__}.{type(agent).__name__} has no torch.optim.Optimizer "
                                "attribute: data-parallel learners average gradients in an optimizer step hook "
                                "(keep the optimizer as an attribute of the agent, e.g. self.optimizer)")  # fmt: skip
        for averager in self._averagers:
            averager.handle.remove()
        self._averagers = [_GradientAverager(self, opt) for _, opt in optimizers]
        log.info("learner rank %d: state of rank 0 loaded; gradients averaged for %s", self.rank,
                 ", ".join(f"{n} ({len(a.params)} tensors, {a.buf.numel() - len(a.params)} values)"
                           for (n, _), a in zip(optimizers, self._averagers)))  # fmt: skip

    def _broadcast_tensor(self, t: torch.Tensor) -> None:
        if t.device == self.comm_device:
            dist.broadcast(t.data, src=0)
        else:
            tmp = t.detach().to(self.comm_device)
            dist.broadcast(tmp, src=0)
            t.data.copy_(tmp)

    @staticmethod
    def _attributes(agent, kind) -> list[tuple[str, Any]]:
        """``(name, value)`` of the agent's attributes of type ``kind``, in definition order
        (the same on every rank: the same code built them)."""
        return [(n, v) for n, v in vars(agent).items() if isinstance(v, kind)]

    def fingerprints(self, module: nn.Module) -> list[int]:
        """Every rank's :func:`fingerprint` of ``module`` (a collective: all ranks call it); equal
        entries mean identical weights. A cheap check a test or a periodic audit can run."""
        self._require_joined()
        mine = torch.tensor([fingerprint(module)], dtype=torch.int64, device=self.comm_device)
        every = [torch.zeros_like(mine) for _ in range(self.world_size)]
        dist.all_gather(every, mine)
        return [int(t) for t in every]

    # ------------------------------------------------------------------ the loop
    def agree(self, have_batch: bool, stop: bool, env_steps: int = 0) -> tuple[bool, bool]:
        """One per learner-loop iteration, on every rank: ``(learn, stop)`` with ``learn`` true
        only when every rank has a batch (one that has a batch and does not learn keeps it for
        the next iteration) and ``stop`` true when any rank wants to stop. ``env_steps``: this
        rank's count; :attr:`env_steps` is then the highest any rank gave."""
        self._require_joined()
        t0 = time.perf_counter()
        votes = torch.tensor([0 if have_batch else 1, 1 if stop else 0, int(env_steps)], dtype=torch.int64,
                             device=self.comm_device)  # fmt: skip
        self._all_reduce(votes, "agree()", dist.ReduceOp.MAX)  # any rank without a batch, any that stops, the count
        missing, stopping, self.env_steps = votes.tolist()
        self.agree_s += time.perf_counter() - t0
        self.agree_calls += 1
        return missing == 0 and not stopping, stopping > 0

    def stats(self) -> dict[str, float]:
        """Metric row fields: the group size, and the mean time of a gradient all_reduce and of
        an :meth:`agree` since the previous call (host time)."""
        s0, c0, a0, n0 = self._reported
        calls, agrees = self.allreduce_calls - c0, self.agree_calls - n0
        row = {
            "learner/world_size": float(self.world_size),
            "learner/grad_allreduce_ms": 1e3 * (self.allreduce_s - s0) / calls if calls else 0.0,
            "learner/agree_ms": 1e3 * (self.agree_s - a0) / agrees if agrees else 0.0,
        }
        self._reported = (self.allreduce_s, self.allreduce_calls, self.agree_s, self.agree_calls)
        return row

    def _all_reduce(self, tensor: torch.Tensor, what: str, op=dist.ReduceOp.SUM) -> None:
        """``dist.all_reduce`` (``op``); a peer that died (gloo: connection reset, at once) or hangs
        (after ``timeout_s``) is a GearflowError that says so."""
        try:
            dist.all_reduce(tensor, op=op)
        except (RuntimeError, dist.DistError) as exc:
            text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise GearflowError(
                f"learner rank {self.rank} of {self.world_size} lost the other data-parallel learners in {what} "
                f"(learner.dist_address={self.address}): a learner died or hung for {self.timeout_s:g} s; "
                f"its own log says why. {type(exc).__name__}: {text[:300]}"
            ) from exc

    def _note_allreduce(self, seconds: float) -> None:
        self.allreduce_s += seconds
        self.allreduce_calls += 1

    def _require_joined(self) -> None:
        if not self._joined:
            raise GearflowError("DataParallel.init() first: this learner has not joined its process group")
