"""A table's device path (``Table(..., device="cuda")``), run by the table against its
:class:`~gearflow.native.protocol.DeviceSampler` (``DeviceReplay``, or the CPU emulation in
the tests): the sample's draw, gather, seqlock check and redraw loop, and priority updates
applied to the selector and mirrored to the device.

The rules are the CPU path's: the RESERVE counters are read after the gather's one host sync;
torn items are evicted through the table (:meth:`Table.evict_torn`, which also rescans and
waits for replacements) and only the torn or impossible rows are redrawn, so each row keeps the
record it was drawn with and its key names the item whose rows were gathered; nothing is
returned before every row passed. The table counts the sample (:meth:`Table.note_sampled`).

    sample = sample_on_device(table, dev, 256, None)   # data: CUDA tensors over dev's buffer set
    sample.release(stream)                              # the set may be refilled after stream
"""

from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np

from gearflow.replay.host_batch import Sample
from gearflow.replay.selectors import check_priorities
from gearflow.replay.storage import RESERVE

__all__ = ["sample_on_device", "update_on_device"]


def sample_on_device(table: Any, dev: Any, batch_size: int, timeout_s: float | None) -> Sample:
    """:meth:`Table.sample` with selection and gather on ``dev`` (the table's device sampler):
    the same seqlock rule and torn-item replacement, a batch of CUDA tensors. Each row keeps the
    record it was drawn with (only redrawn rows get new ones), so its key names the item whose
    rows were gathered; a slot outside the table (< 0 or ≥ capacity) is redrawn."""
    draw = dev.draw(batch_size, table.size)  # the device first waits for the consumer's queued work
    out = dev.buffers(batch_size, table.num_buffers)
    dev.gather(draw, out)  # the one host sync: the counters below postdate the copy
    deadline = None
    while True:
        redo = dev.invalid(draw)  # impossible slots: redrawn, never returned (no device read if none)
        if table.writers_moved():  # a writer moved since this sample's scan
            torn = dev.torn(draw, table.storage.counters[:, RESERVE])
            if torn.size:
                deadline = table.evict_torn(dev.slots_at(draw, torn), deadline, timeout_s,
                                            "the GPU could gather them")  # fmt: skip
                redo = np.union1d(redo, torn)
        if not redo.size:
            break
        draw = dev.redraw(draw, redo, table.size)  # new records for those rows only
        dev.gather(draw, out)  # the whole batch again (rare path): every item is re-checked
    table.note_sampled(batch_size)
    data, keys, weights, probs = dev.batch(out)
    return Sample(data=data, keys=keys, weights=weights, probabilities=probs, on_release=partial(dev.release, out))


def update_on_device(table: Any, dev: Any, keys: np.ndarray, prios: np.ndarray) -> int:
    """:meth:`Table.update_priorities` of a device table (``keys`` int64, ``prios`` float, host):
    checked, mapped to the slots still holding them (keys of evicted items ignored), applied to
    the table's selector and mirrored to ``dev``'s priority vector. Returns how many applied."""
    check_priorities(prios)
    slots = table.slots_of(keys)
    held = slots >= 0
    if not held.all():
        slots, prios = slots[held], prios[held]
    table.selector.update(slots, prios)
    dev.update(slots, prios)  # the device path: its priority vector mirrors the selector's
    return int(slots.size)
