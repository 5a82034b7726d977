"""Where a transport round's time goes, per phase and per thread (``gearflow bench transport --profile``).

:class:`PhaseProfile` wraps the transport's own functions in this process (the shard's sample
handler and its kept row digests, the frame send, the MAC calls, the frame reader's receive, the trailer check, the torn
rows' reseal, the client's submit and wait) with counters of calls, items (MAC updates, bytes
received), wall time and the calling thread's CPU time, and reads every thread's CPU time from
``/proc/self/task/*/schedstat``. It is a measuring tool: the wrappers cost ~1 µs a call (on the
order of 0.5 ms per 14.5 MB round with per-row MAC updates), so a profiled round is slower
than a plain one; compare phases, not rates, and take rates from the plain bench.

    prof = PhaseProfile().install()
    ...                                  # rounds
    report = prof.read()                 # {"phases": {name: {...}}, "threads": {name: cpu_ns}}
    prof.uninstall()

A phase counts every call of the functions it names; ``items`` is what a call moves (MAC update
calls for ``mac``, bytes for ``recv`` and ``wire_recv``), so ``mac.items`` per round is the number of
NH update calls a frame costs (each takes its spans in one call). Phases that nest (``send`` holds the sender's inline
``mac``) are each timed whole.
"""

from __future__ import annotations

import importlib
import os
import threading
import time
from collections.abc import Callable

__all__ = ["PHASES", "PhaseProfile", "thread_cpu_ns"]


def _spans_count(args, kwargs) -> int:
    spans = args[1] if len(args) > 1 else kwargs.get("spans", ())
    return len(spans)


def _one(args, kwargs) -> int:
    return 1


def _recv_bytes(args, kwargs) -> int:
    return int(args[1]) if len(args) > 1 else 0


def _view_bytes(args, kwargs) -> int:
    return memoryview(args[1]).nbytes if len(args) > 1 else 0


# phase: [(module, qualified name, items of one call)]: what is timed (functions that do not exist
# in this version are skipped, so one profile reads old and new code alike)
PHASES: dict[str, list[tuple[str, str, Callable]]] = {
    "handler": [("gearflow.transport.server.shard", "ShardService._sample", _one)],  # draw + reply buffers
    "digests": [("gearflow.transport.server.row_digests", "RowDigests.of", _one)],  # a buffer's kept row digests
    "send": [("gearflow.transport.framing", "FramedProtocol.send", _one)],  # a frame handed to the socket
    "mac": [  # MAC update calls (NH, feeding Poly1305)
        ("gearflow.transport.integrity", "_Mac.update", _one),
        ("gearflow.transport.integrity", "_Mac.update_spans", _spans_count),
        ("gearflow.transport.integrity", "BlockMac._update", _one),  # a receiving MAC thread's call
    ],
    "mac_wait": [("gearflow.transport.integrity", "BlockMac.finish", _one)],  # the receiver waits for its MAC thread
    "recv": [("gearflow.transport.framing", "FrameReader.buffer_updated", _recv_bytes)],  # bytes landed, parsed
    # a big block read (and MACed as it lands) by the connection's wire thread: one call a block
    "wire_recv": [("gearflow.transport.wire_io", "WireIO._recv_job", _view_bytes)],
    "check": [("gearflow.transport.integrity", "Opener.check", _one)],  # a frame's trailer checked
    "unmark": [("gearflow.transport.framing", "FrameReader._unmark", _one)],  # receiver: a torn frame's re-MAC
    "tail": [("gearflow.transport.service", "_ServerProtocol._tail", _one)],  # marks filled, trailer sent
    "reseal": [("gearflow.transport.service", "_ServerProtocol._reseal", _one)],  # sender: a torn frame's re-MAC
    "submit": [("gearflow.transport.client", "Client.submit", _one)],  # a request sent (caller's thread)
    "wait": [("gearflow.transport.client", "Client.result", _one)],  # a caller waiting for a reply
}


def thread_cpu_ns() -> dict[str, int]:
    """CPU time (ns, on a CPU since the thread started) of every live thread of this process, by
    Python thread name (``tid:<n>`` for threads Python did not start)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, int] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                ns = int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue
        name = names.get(int(tid), f"tid:{tid}")
        out[name] = out.get(name, 0) + ns
    return out


class PhaseProfile:
    """Counters of the transport's phases in this process (see the module docstring)."""

    def __init__(self, phases: dict | None = None):
        self.phases = PHASES if phases is None else phases
        self._lock = threading.Lock()
        self._stats: dict[str, list[int]] = {}
        self._saved: list[tuple] = []
        self._cpu0: dict[str, int] = {}
        self._t0 = 0

    def install(self) -> PhaseProfile:
        for phase, targets in self.phases.items():
            for mod_name, qual, items in targets:
                owner, attr, fn = self._resolve(mod_name, qual)
                if fn is None:
                    continue
                self._saved.append((owner, attr, fn))
                setattr(owner, attr, self._wrap(phase, fn, items))
        self.reset()
        return self

    def uninstall(self) -> None:
        for owner, attr, fn in reversed(self._saved):
            setattr(owner, attr, fn)
        self._saved.clear()

    @staticmethod
    def _resolve(mod_name: str, qual: str):
        try:
            owner = importlib.import_module(mod_name)
        except ImportError:
            return None, "", None
        *path, attr = qual.split(".")
        for p in path:
            owner = getattr(owner, p, None)
            if owner is None:
                return None, "", None
        fn = owner.__dict__.get(attr) if isinstance(owner, type) else getattr(owner, attr, None)
        return owner, attr, fn

    def _wrap(self, phase: str, fn: Callable, items: Callable) -> Callable:
        wall, cpu = time.perf_counter_ns, time.thread_time_ns
        stats, lock = self._stats, self._lock

        def timed(*args, **kwargs):
            w0, c0 = wall(), cpu()
            try:
                return fn(*args, **kwargs)
            finally:
                dw, dc, k = wall() - w0, cpu() - c0, items(args, kwargs)
                with lock:
                    s = stats.setdefault(phase, [0, 0, 0, 0])
                    s[0] += 1
                    s[1] += k
                    s[2] += dw
                    s[3] += dc

        timed.__wrapped__ = fn  # type: ignore[attr-defined]
        return timed

    def reset(self) -> None:
        with self._lock:
            self._stats.clear()
        self._cpu0 = thread_cpu_ns()
        self._t0 = time.perf_counter_ns()

    def read(self) -> dict:
        """``{"wall_ns", "phases": {phase: {"calls", "items", "wall_ns", "cpu_ns"}}, "threads": {name: cpu_ns}}``
        since :meth:`install` or the last :meth:`reset`."""
        with self._lock:
            phases = {k: dict(zip(("calls", "items", "wall_ns", "cpu_ns"), v)) for k, v in self._stats.items()}
        now = thread_cpu_ns()
        threads = {k: v - self._cpu0.get(k, 0) for k, v in now.items() if v - self._cpu0.get(k, 0) > 0}
        return {"wall_ns": time.perf_counter_ns() - self._t0, "phases": phases, "threads": threads}
