"""Versioned, double-buffered model parameters in one POSIX shared-memory segment.

The learner publishes its weights; actor processes pick up newer versions
between env steps without blocking and never see a torn copy. Layout of
``/dev/shm/<name>`` (same header conventions as :mod:`gearflow.replay.storage`,
so ``list_segments``/``gc_segments`` find leftovers; ``SharedStorage.attach``
refuses it because the layout version differs)::

    header   int64[16]: magic, layout version, latest slot, latest version,
             layout JSON length, owner pid, slot bytes, total size,
             seq[0], version[0], seq[1], version[1], then the owner identity
             (boot id, PID namespace, start time, run tag) as in replay.storage,
             then the layout as JSON: [[name, dtype, shape, byte offset], ...]
    slot 0   every tensor of the state_dict, flat, 64-byte aligned (4096-aligned block)
    slot 1   the same again

Protocol (one writer, any number of readers; x86-TSO: stores become visible
in program order and loads are not reordered with older loads, so plain int64
stores in a numpy view of the mapping are enough):

    writer (publish)                      reader (load_into / read)
    s = 1 - latest_slot                   v = latest_version   -> None if v <= min_version
    seq[s] += 1        (odd: busy)        s = latest_slot
    copy tensors into slot s              a = seq[s]           -> retry if odd
    version[s] = latest_version + 1       v = version[s]; copy out of slot s
    seq[s] += 1        (even: done)       b = seq[s]           -> retry if b != a
    latest_slot = s                       return v
    latest_version = version[s]

The writer never touches the slot marked latest, so a reader only retries when
a whole publish finished and the *next* one reused its slot mid-copy. The slot's
version is written inside the odd window, so a reader that sees an unchanged
even seq has a version and bytes from the same publish. Worked example:

    store = ParameterStore.create(model)          # learner: layout from model.state_dict()
    store.publish(model)                          # -> 1 (slot 1), then 2 (slot 0), ...
    actor = ParameterStore.attach(store.name)     # in an actor process
    v = actor.load_into(policy, min_version=0)    # -> 2: copied into policy's parameters
    actor.load_into(policy, min_version=v)        # -> None until the learner publishes again
    store.close()                                 # the owner also unlinks the segment
"""

from __future__ import annotations

import json
import mmap
import os
import time
import uuid
from collections.abc import Callable

import numpy as np
import torch

from gearflow.replay import storage as _storage
from gearflow.replay.storage import (
    ALIGN,
    HEADER_FIELDS,
    MAGIC,
    PREFIX,
    create_segment,
    map_segment,
    write_owner,
)

LAYOUT_VERSION = 0x5041_0001  # "PA" v1: not the replay table's version, so it refuses us
(H_MAGIC, H_VERSION, H_LATEST_SLOT, H_LATEST_VERSION,
 H_LAYOUT_LEN, H_OWNER, H_SLOT_BYTES, H_SIZE) = range(8)  # H_MAGIC, H_OWNER as in replay.storage
H_SEQ = (8, 10)  # seq of slot 0 / 1; the slot's version follows its seq
MAX_RETRIES = 10_000

StateLike = dict[str, torch.Tensor] | torch.nn.Module  # what the store reads and writes


def _align(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def _state(params: StateLike) -> dict[str, torch.Tensor]:
    return params.state_dict() if isinstance(params, torch.nn.Module) else dict(params)


class ParameterStore:
    """Two copies of a state_dict in shared memory; see the module docstring."""

    def __init__(self, name: str, mm: mmap.mmap, owner: bool):
        self.name, self.owner, self._mm = name, owner, mm
        header = np.frombuffer(mm, dtype=np.int64, count=HEADER_FIELDS)
        if header[H_MAGIC] != MAGIC or header[H_VERSION] != LAYOUT_VERSION:
            raise ValueError(f"shared-memory segment {name!r} is not a gearflow parameter store")
        self.header = header
        n = int(header[H_LAYOUT_LEN])
        self.layout = [(k, getattr(torch, d.split(".")[-1]), tuple(s), o) for k, d, s, o
                       in json.loads(bytes(mm[HEADER_FIELDS * 8: HEADER_FIELDS * 8 + n]))]
        slot_bytes, base = int(header[H_SLOT_BYTES]), _align(HEADER_FIELDS * 8 + n)
        self.nbytes = int(header[H_SIZE])
        self.retries = 0  # seqlock retries of this process's reads
        # zero-copy torch views of both slots: {name: tensor}
        self.slots = [{k: self._view(base + i * slot_bytes + off, dtype, shape)
                       for k, dtype, shape, off in self.layout} for i in range(2)]

    def _view(self, offset: int, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
        count = int(np.prod(shape, dtype=np.int64))
        if count == 0:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(self._mm, dtype=dtype, count=count, offset=offset).view(shape)

    # ------------------------------------------------------------------ lifecycle
    @classmethod
    def create(cls, template: StateLike, name: str | None = None, run_tag: int = 0) -> ParameterStore:
        """Zero-filled store with the names, shapes and dtypes of ``template``'s state_dict.

        Every page is reserved now (``posix_fallocate``): a /dev/shm too full for it is a
        one-line :class:`~gearflow.replay.storage.SharedMemoryError` here, not a SIGBUS when
        the first publish touches a page that cannot be backed."""
        layout, pos = [], 0
        for k, t in _state(template).items():
            pos = _align(pos, 64)
            layout.append([k, str(t.dtype), list(t.shape), pos])
            pos += t.numel() * t.element_size()
        layout_json = json.dumps(layout).encode()
        slot_bytes = _align(max(pos, 1))
        size = _align(HEADER_FIELDS * 8 + len(layout_json)) + 2 * slot_bytes
        name = name or f"{PREFIX}_params_{os.getpid()}_{uuid.uuid4().hex[:10]}"
        mm = create_segment(name, size, "parameter store")
        header = np.frombuffer(mm, dtype=np.int64, count=HEADER_FIELDS)
        header[[H_LAYOUT_LEN, H_OWNER, H_SLOT_BYTES, H_SIZE]] = (
            len(layout_json), os.getpid(), slot_bytes, size)
        write_owner(header, run_tag)  # fields 12-15, after seq/version of both slots
        mm[HEADER_FIELDS * 8: HEADER_FIELDS * 8 + len(layout_json)] = layout_json
        header[H_VERSION] = LAYOUT_VERSION
        header[H_MAGIC] = MAGIC  # last: a half-made segment is never mistaken for a store
        del header
        return cls(name, mm, owner=True)

    @classmethod
    def attach(cls, name: str) -> ParameterStore:
        """Map an existing store by name."""
        return cls(name, map_segment(name, "parameter store"), owner=False)

    def close(self) -> None:
        """Drop this process's mapping; the owner also unlinks the segment."""
        if self._mm is None:
            return
        self.slots, self.header = [], None
        try:
            self._mm.close()
        except BufferError:
            pass  # a caller still holds a view; the mapping goes when it is freed
        self._mm = None
        if self.owner:
            self.unlink()

    def unlink(self) -> None:
        (_storage.SHM_DIR / self.name).unlink(missing_ok=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ writer
    def _check(self, state: dict[str, torch.Tensor]) -> None:
        names = {k for k, _, _, _ in self.layout}
        if missing := [k for k in names if k not in state]:
            raise ValueError(f"parameter {missing[0]!r} is missing (store layout has it)")
        if extra := [k for k in state if k not in names]:
            raise ValueError(f"parameter {extra[0]!r} is not in the store's layout")
        for k, dtype, shape, _ in self.layout:
            t = state[k]
            if tuple(t.shape) != shape or t.dtype != dtype:
                raise ValueError(f"parameter {k!r} is {t.dtype}{list(t.shape)}, "
                                 f"the store holds {dtype}{list(shape)}")

    def publish(self, params: StateLike, version: int | None = None) -> int:
        """Copy ``params`` into the slot not marked latest and make it latest (single writer).

        The new version is the latest + 1, or ``version`` when given (a resumed run
        continues its numbering); it must be newer than the latest."""
        state = _state(params)
        self._check(state)  # before touching anything
        h = self.header
        latest = int(h[H_LATEST_VERSION])
        if version is not None and int(version) <= latest:
            raise ValueError(f"version {version} is not newer than the latest published version {latest}")
        s = 1 - int(h[H_LATEST_SLOT])
        version = latest + 1 if version is None else int(version)
        seq = H_SEQ[s]
        h[seq] = int(h[seq]) | 1  # odd: slot s is being written (stays odd after a failed copy)
        with torch.no_grad():
            for k, dst in self.slots[s].items():
                dst.copy_(state[k])  # CUDA -> CPU included
        h[seq + 1] = version
        h[seq] += 1  # even: slot s is consistent
        h[H_LATEST_SLOT] = s
        h[H_LATEST_VERSION] = version
        return version

    # ------------------------------------------------------------------ readers
    def latest_version(self) -> int:
        return int(self.header[H_LATEST_VERSION])

    def _read_consistent(self, copy: Callable[[dict[str, torch.Tensor]], None]) -> int:
        h = self.header
        for _ in range(MAX_RETRIES):
            s = int(h[H_LATEST_SLOT])
            a = int(h[H_SEQ[s]])
            if a & 1:
                self.retries += 1
                time.sleep(0)
                continue
            version = int(h[H_SEQ[s] + 1])
            copy(self.slots[s])
            if int(h[H_SEQ[s]]) == a:
                return version
            self.retries += 1
        raise RuntimeError(f"parameter store {self.name!r}: no consistent read in {MAX_RETRIES} "
                           "tries (is a writer stuck mid-publish?)")

    def load_into(self, module_or_state: StateLike, min_version: int = 0) -> int | None:
        """Copy the latest version into ``module_or_state`` if newer than ``min_version``."""
        if int(self.header[H_LATEST_VERSION]) <= min_version:
            return None
        state = _state(module_or_state)
        self._check(state)

        def copy(slot: dict[str, torch.Tensor]) -> None:
            with torch.no_grad():
                for k, src in slot.items():
                    state[k].copy_(src)

        return self._read_consistent(copy)

    def read(self) -> tuple[int, dict[str, torch.Tensor]]:
        """(version, a private copy of every tensor) of the latest version (zeros, 0 before any)."""
        out: dict[str, torch.Tensor] = {}

        def copy(slot: dict[str, torch.Tensor]) -> None:
            out.update({k: src.clone() for k, src in slot.items()})

        return self._read_consistent(copy), out
