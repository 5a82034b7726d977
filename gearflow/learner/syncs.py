"""Counting what a learner thread reads back from its tensors: blocking host reads and aten ops.

A host read is a call that, on a CUDA learner, waits for the device: ``.item()``, ``float(t)``,
``int(t)``, ``if t:`` (each is ``aten._local_scalar_dense``, which a ``TorchDispatchMode`` sees
on any device), and ``.tolist()``, ``.numpy()``, ``.cpu()`` (which reach no aten op on a CPU
tensor, so they are counted where Python calls them). Only the thread that entered the counter
is counted: the prefetch thread, the weight publisher's helper and the sampling side may read
what they like. A learner on a CPU proves with it what only a GPU could measure::

    with HostReads() as reads:          # on the learner's thread
        for _ in range(100):
            learner.learn_step(next_batch())
    reads.host_reads, reads.aten_ops   # 0, 10_600 (DQN CartPole)
    reads.sites                        # where the reads were made: ["agents/apex_dqn.py:242 tolist", ...]

``gearflow bench learner`` reports both per update; ``tests/test_learner_host_reads.py`` holds the
reference agents to 0 host reads per update outside metric rows.
"""

from __future__ import annotations

import threading
import traceback
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["HostReads"]

_PATCHED = ("tolist", "numpy", "cpu")  # host reads no dispatch mode sees on a CPU tensor
_SCALAR = torch.ops.aten._local_scalar_dense.default
_active: dict[int, HostReads] = {}  # thread id -> its counter
_originals: dict[str, object] = {}
_patch_lock = threading.Lock()


def _counting(name: str, original):
    def method(self, *args, **kwargs):
        counter = _active.get(threading.get_ident())
        if counter is not None:
            counter._read(name)
        return original(self, *args, **kwargs)

    method.__name__ = name
    method.__wrapped__ = original
    return method


class _Ops(TorchDispatchMode):
    def __init__(self, owner: HostReads):
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        owner = self.owner
        owner.aten_ops += 1
        owner.ops[func.__name__] += 1
        if func is _SCALAR:
            owner._read("item")
        return func(*args, **(kwargs or {}))


class HostReads:
    """Counts host reads (:attr:`host_reads`) and aten ops (:attr:`aten_ops`) of the thread that
    enters it, while it is entered; :attr:`sites` names the first ``keep_sites`` call sites of
    the reads (file:line and what was called), :attr:`ops` counts each aten op by name."""

    def __init__(self, keep_sites: int = 8):
        self.host_reads = 0
        self.aten_ops = 0
        self.ops: Counter = Counter()
        self.sites: list[str] = []
        self.keep_sites = keep_sites
        self._mode: _Ops | None = None
        self._thread = 0

    def _read(self, what: str) -> None:
        self.host_reads += 1
        if len(self.sites) < self.keep_sites:
            frames = [f for f in traceback.extract_stack() if "/torch/" not in f.filename and f.filename != __file__]
            where = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"
            self.sites.append(f"{where} {what}")

    def __enter__(self):
        self._thread = threading.get_ident()
        with _patch_lock:
            if self._thread in _active:
                raise RuntimeError("HostReads: this thread already counts its host reads")
            if not _active:
                for name in _PATCHED:
                    _originals[name] = getattr(torch.Tensor, name)
                    setattr(torch.Tensor, name, _counting(name, _originals[name]))
            _active[self._thread] = self
        self._mode = _Ops(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
        with _patch_lock:
            _active.pop(self._thread, None)
            if not _active:
                for name in _PATCHED:
                    setattr(torch.Tensor, name, _originals.pop(name))

    def reset(self) -> None:
        """Start counting again from 0 (after a warm-up), still entered."""
        self.host_reads = self.aten_ops = 0
        self.ops.clear()
        self.sites.clear()
