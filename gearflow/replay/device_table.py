"""A table's device path (``Table(..., device="cuda")``), run by the table against its
:class:`~gearflow.native.protocol.DeviceSampler` (``DeviceReplay``, or the CPU emulation in
the tests): the sample's batch, its seqlock failures' eviction and redraw, priority write-backs
applied on the device, and the selector a device table keeps on the host.

A device table keeps no priorities on the host: its selector becomes a :class:`DeviceSelector`
(live slots, ``len``, ``beta``, checkpoints), and the priority vector lives only on the device
(no CPU sum tree is built or updated; a checkpoint reads the device vector back).

The sample rules are the CPU path's: a batch is checked against the RESERVE counters after its
gather (on the device, the status word tells the host); torn items are evicted through the table
(:meth:`Table.evict_torn`, which also rescans and waits for replacements) and only the torn or
impossible rows are redrawn, so each row keeps the record it was drawn with and its key names
the item whose rows were gathered; nothing is returned before every row passed. The table counts
the sample (:meth:`Table.note_sampled`).

    sample = sample_on_device(table, dev, 256, None)   # data: CUDA tensors over dev's buffer set
    update_on_device(table, dev, sample.keys, td)       # CUDA tensors: applied on the device
    sample.release(stream)                              # the set may be refilled after stream
"""

from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np

from gearflow.replay.host_batch import Sample
from gearflow.replay.selectors import Selector, StateDict, SumTree, check_priorities, make_selector

__all__ = ["DeviceSelector", "sample_on_device", "update_on_device"]


def _non_negative(name: str, value: float) -> float:
    value = float(value)
    if not (np.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be finite and >= 0, got {value}")
    return value


class DeviceSelector(Selector):
    """The selector of a device table: which slots are live (packed, as every selector keeps
    them: ``len``, :attr:`live_slots`, the table's ingest and eviction through
    :meth:`insert_ingested` / :meth:`remove_known`), ``alpha`` and ``beta``; the priorities are
    the device's (``device``: the table's DeviceSampler, which draws with them).

    Built by the table from the selector it was given (its live slots, RNG state, ``alpha`` and
    ``beta`` are taken over, and the device takes its priorities). Its :meth:`state_dict` is the
    given selector's format, priorities read back from the device (one wait: a checkpoint), so a
    checkpoint restores onto the CPU or a GPU alike. It does not sample on the CPU
    (:meth:`host_selector` is a CPU copy, for checks).

        table = Table(storage, kind, make_selector("prioritized", N), device="cuda")
        type(table.selector).__name__, table.selector.name      # ('DeviceSelector', 'prioritized')
    """

    def __init__(self, source: Selector, device: Any) -> None:
        super().__init__(source.capacity)
        self.source_class, self.device = type(source), device
        self.name, self.importance_sampled, self.config_args = source.name, source.importance_sampled, source.config_args
        self.prioritized = source.name == "prioritized"
        self.alpha = _non_negative("alpha", getattr(source, "alpha", 1.0))
        self.beta = getattr(source, "beta", 0.0)
        self._fanout = source.tree.fanout if self.prioritized else 16
        state = source.state_dict()
        Selector.load_state_dict(self, {k: state[k] for k in ("capacity", "slots", "rng_state")})

    @property
    def beta(self) -> float:
        """Importance-sampling exponent of the device's weights; assignable between samples."""
        return self._beta

    @beta.setter
    def beta(self, value: float) -> None:
        self._beta = _non_negative("beta", value)

    def _refuse(self, what: str):
        raise TypeError(f"{what}: a device table's priorities are on the GPU (Table.update_priorities and "
                        "Table.sample use them; host_selector() is a CPU copy)")  # fmt: skip

    def update(self, slots: np.ndarray, priorities: np.ndarray) -> None:
        self._refuse("DeviceSelector.update")

    def update_known(self, slots: np.ndarray, priorities: np.ndarray) -> int:
        self._refuse("DeviceSelector.update_known")

    def update_by_key(self, keys: np.ndarray, priorities: np.ndarray, index: Any) -> int:
        self._refuse("DeviceSelector.update_by_key")

    def _sample(self, batch_size: int):
        self._refuse("DeviceSelector.sample")

    def state_dict(self) -> StateDict:
        """The given selector's format: live slots, RNG state and, prioritized, ``alpha``,
        ``beta``, ``fanout`` and a sum tree over the device's masses (read back: one wait)."""
        state = super().state_dict()
        if self.prioritized:
            tree = SumTree(self.capacity, self._fanout)
            tree.leaves[: self.capacity] = self.device.masses()[: self.capacity]
            tree.rebuild()
            state.update(alpha=self.alpha, beta=self.beta, fanout=self._fanout, tree=np.concatenate(tree.levels))
        return state

    def load_state_dict(self, state: StateDict) -> None:
        """Take over a state of the given selector's format (live slots, RNG; the masses to the device)."""
        source = make_selector(self.name, self.capacity)
        source.load_state_dict(state)
        Selector.load_state_dict(self, {k: state[k] for k in ("capacity", "slots", "rng_state")})
        if self.prioritized:
            self.alpha, self.beta = source.alpha, source.beta
            live = np.zeros(self.capacity, dtype=bool)
            live[source.live_slots] = True
            self.device.load_masses(np.where(live, source.tree.leaves[: self.capacity], 0.0))

    def host_selector(self) -> Selector:
        """A CPU selector of the given kind in this one's state now (priorities read back from the
        device): what the device draws, for checks and tools."""
        copy = make_selector(self.name, self.capacity)
        copy.load_state_dict(self.state_dict())
        return copy


def sample_on_device(table: Any, dev: Any, batch_size: int, timeout_s: float | None) -> Sample:
    """:meth:`Table.sample` with selection and gather on ``dev`` (the table's device sampler):
    the oldest batch drawn ahead (one host wait, usually passed already); torn rows evicted and,
    with the impossible ones, redrawn until every row passed. Each row keeps the record it was
    drawn with (only redrawn rows get new ones), so its key names the item whose rows were gathered."""
    out = dev.next_batch(batch_size, table.size, table.num_buffers)
    deadline = None
    while True:
        impossible, torn = dev.bad_rows(out)  # the status word: no device read when both are 0
        if not impossible.size and not torn.size:
            break
        if torn.size:  # evicted where the slot still holds the item drawn (a batch drawn ahead: a scan
            slots, seqs = dev.drawn_at(out, torn)  # since may have put a newer item there, intact)
            held = table.records(slots)[1] == seqs
            deadline = table.evict_torn(slots[held], deadline, timeout_s, "the GPU could gather them", rows=torn.size)
        dev.redraw(out, np.union1d(impossible, torn), table.size)  # new records for those rows only
    table.note_sampled(batch_size)
    data, keys, weights, probs = dev.batch(out)
    return Sample(data=data, keys=keys, weights=weights, probabilities=probs, on_release=partial(dev.release, out))


def _on_device(x: Any) -> bool:
    """A device array: a CUDA torch tensor (asked directly: its interface raises for one that
    requires grad), or anything with ``__cuda_array_interface__`` (a CuPy array)."""
    if type(x).__module__.startswith("torch") and hasattr(x, "is_cuda"):
        return bool(x.is_cuda)
    return hasattr(x, "__cuda_array_interface__")


def update_on_device(table: Any, dev: Any, keys: Any, priorities: Any) -> int:
    """:meth:`Table.update_priorities` of a device table. Device keys and priorities (the
    learner's CUDA tensors) go to the device as they are: no host sync, nothing read back;
    returns how many were handed in (a priority not finite and >= 0 is not applied, and the sample
    that returns the next batch drawn raises ValueError). Host arrays are checked here (ValueError,
    nothing applied), and
    the count of keys the table still holds is returned, as on the CPU path."""
    if _on_device(keys) or _on_device(priorities):
        return dev.update_keys(keys, priorities)
    k = _host(keys, np.int64)
    p = _host(priorities, np.float64)
    if k.shape != p.shape:
        raise ValueError(f"{k.size} keys but {p.size} priorities")
    check_priorities(p)
    dev.update_keys(k, p)
    return int((table.slots_of(k) >= 0).sum())


def _host(x: Any, dtype: Any) -> np.ndarray:
    if type(x).__module__.startswith("torch"):
        x = x.detach().float().numpy() if x.dtype.is_floating_point and x.dtype.itemsize < 4 else x.detach().numpy()
    a = np.asarray(x)
    if dtype == np.float64 and a.dtype in (np.float32, np.float64):
        return np.ascontiguousarray(a.reshape(-1))
    return np.ascontiguousarray(a.reshape(-1), dtype=dtype)
