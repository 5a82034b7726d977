"""Checkpoints of a replay table: storage, item records, selector, counters, rate limiter.

    save_checkpoint(table, "ckpt/replay")           # consistent even while writers run
    table2 = restore_checkpoint("ckpt/replay")      # a new shared-memory segment
    # table2 samples exactly what `table` would have sampled next

Layout of a checkpoint directory (written to ``<dir>.tmp-<pid>`` first, then
renamed into place, so a reader sees the old checkpoint or the new one, never
half of one)::

    meta.json        spec, sizes, item kind, selector name, rate limiter, counters
    columns/<c>.npy  each column's rows [P * S, *row_shape]
    step_offset.npy  with stacked-frame columns: each step's offset in its episode (uint8[P * S])
    table.npz        per-slot records and per-partition ingest/evict positions
    selector.npz     the selector's state (priorities, order, RNG)
    MANIFEST.json    size and CRC-32 of every file above; written last

Consistency with running writers: the table scans, then copies the columns,
then re-reads every partition's RESERVE counter; items whose steps may have
been overwritten during the copy are left out (as the next scan would evict
them). A checkpoint whose manifest is missing or does not match its files is
refused by :func:`restore_checkpoint` with :class:`CheckpointError`.
"""

from __future__ import annotations

import json
import os
import shutil
import zlib
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from gearflow.errors import GearflowError
from gearflow.kinds.registry import kind_from_dict
from gearflow.replay.rate_limiter import RateLimiter
from gearflow.replay.selectors import make_selector
from gearflow.replay.spec import TableSpec
from gearflow.replay.storage import COMMIT, EPISODES, PUBLISHED, RESERVE, SharedStorage
from gearflow.replay.table import Table

FORMAT = 1


class CheckpointError(GearflowError):
    """A checkpoint is missing, truncated or corrupt."""


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return crc


def write_manifest(directory: Path, subdirs: bool = True, extra: list[str] = ()) -> None:
    """``MANIFEST.json``: size and CRC-32 of every file under ``directory`` (written last).

    ``subdirs=False`` covers only the files directly in ``directory`` (a sub-directory
    with its own manifest is checked on its own; list that manifest in ``extra`` so that
    the sub-directory cannot go missing unnoticed)."""
    files = sorted(p for p in (directory.rglob("*") if subdirs else directory.iterdir()) if p.is_file())
    files += [directory / rel for rel in extra]
    manifest = {
        str(p.relative_to(directory)): {"bytes": p.stat().st_size, "crc32": _crc32(p)}
        for p in files
        if p.name != "MANIFEST.json" or p.parent != directory
    }
    (directory / "MANIFEST.json").write_text(json.dumps(manifest, indent=1))


def _entry_ok(rel: Any, want: Any) -> bool:
    return (
        isinstance(rel, str) and rel and not rel.startswith("/") and ".." not in Path(rel).parts
        and isinstance(want, dict) and all(type(want.get(k)) is int for k in ("bytes", "crc32"))
    )  # fmt: skip


def read_json_object(directory: Path, name: str) -> dict[str, Any]:
    """The JSON object in ``directory / name``, or :class:`CheckpointError` naming the file."""
    try:
        obj = json.loads((directory / name).read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{directory}: {name} cannot be read: {exc}") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{directory}: {name} is not a JSON object")
    return obj


def check_manifest(directory: Path, what: str, required: tuple[str, ...] = ()) -> None:
    """Raise :class:`CheckpointError` unless the manifest is a mapping of relative paths to
    size and CRC-32, lists every ``required`` file, and every file listed has its size and CRC."""
    manifest_path = directory / "MANIFEST.json"
    if not manifest_path.is_file():
        raise CheckpointError(f"{directory}: not a complete {what} (no MANIFEST.json)")
    try:
        manifest = json.loads(manifest_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{directory}: MANIFEST.json is corrupt: {exc}") from None
    if not isinstance(manifest, dict) or not all(_entry_ok(k, v) for k, v in manifest.items()):
        raise CheckpointError(f"{directory}: MANIFEST.json is corrupt: not a mapping of files to bytes and crc32")
    if missing := [r for r in required if r not in manifest]:
        raise CheckpointError(f"{directory}: MANIFEST.json is corrupt: it does not list {missing[0]}")
    for rel, want in manifest.items():
        f = directory / rel
        if not f.is_file():
            raise CheckpointError(f"{directory}: {rel} is missing")
        if f.stat().st_size != want["bytes"]:
            raise CheckpointError(f"{directory}: {rel} is truncated ({f.stat().st_size} of {want['bytes']} bytes)")
        if _crc32(f) != want["crc32"]:
            raise CheckpointError(f"{directory}: {rel} is corrupt (CRC-32 mismatch)")


def _plain_arrays(path: Path, name: str) -> dict[str, np.ndarray]:
    """The arrays of ``path / name`` (an ``.npz``), read without pickles: an object array (a
    pickle, which would run code on load) is a :class:`CheckpointError` naming the file."""
    with np.load(path / name) as f:  # allow_pickle=False: numpy refuses object arrays
        try:
            return {k: f[k] for k in f.files}
        except ValueError as exc:
            if "allow_pickle" not in str(exc):
                raise
            raise CheckpointError(f"{path}: {name} holds a pickled object array, refused "
                                  "(a replay checkpoint holds plain arrays only)") from None


def _scalarize(state: dict[str, Any]) -> dict[str, Any]:
    return {k: (v.item() if isinstance(v, np.ndarray) and v.ndim == 0 else v) for k, v in state.items()}


def save_checkpoint(table: Table, path: str | Path) -> Path:
    """Write ``table`` to the directory ``path`` atomically; returns the path."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "columns").mkdir(parents=True)
    st = table.storage
    P, S, R = st.num_partitions, st.steps_per_partition, st.items_per_partition

    table.scan()
    commit = st.counters[:, COMMIT].copy()
    for name, column in st.columns.items():
        np.save(tmp / "columns" / f"{name}.npy", column)
    if st.step_offset is not None:  # stacked frames: each step's offset in its episode
        np.save(tmp / "step_offset.npy", st.step_offset)
    reserve_after = st.counters[:, RESERVE].copy()

    state = table.state()
    live = state["slot_live"]
    slots = np.flatnonzero(live)
    overwritten = state["slot_start"][slots] < reserve_after[slots // R] - st.trusted_steps
    dropped = slots[overwritten]
    live[dropped] = False
    selector_state = table.selector.state_dict()

    np.savez(
        tmp / "table.npz",
        **{k: state[k] for k in ("slot_seq", "slot_start", "slot_length", "ingested", "live_lo")},
        slot_live=live,
        dropped=dropped,
    )
    np.savez(tmp / "selector.npz", **{k: np.asarray(v) for k, v in selector_state.items()})
    meta = {
        "format": FORMAT,
        "spec": st.spec.to_dict(),
        "num_partitions": P,
        "steps_per_partition": S,
        "items_per_partition": R,
        "kind": table.kind.to_dict(),
        "selector": table.selector.name,
        "rate_limiter": asdict(table.rate_limiter),
        # a restored writer continues after every step written before the copy
        "commit": np.maximum(commit, state["seen_reserve"]).tolist(),
        "published": state["ingested"].tolist(),
        "episodes": st.counters[:, EPISODES].tolist(),
        **{k: state[k] for k in Table.COUNTER_STATE},
        "evictions": state["evictions"] + int(dropped.size),
        "sample_timeout_s": table.sample_timeout_s,
        "num_buffers": table.num_buffers,
    }
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    write_manifest(tmp)

    old = path.with_name(f"{path.name}.old-{os.getpid()}")
    if path.exists():
        path.rename(old)
    tmp.rename(path)
    shutil.rmtree(old, ignore_errors=True)
    return path


def verify_checkpoint(path: str | Path) -> dict[str, Any]:
    """Check the manifest against the files; returns ``meta.json`` or raises CheckpointError."""
    path = Path(path)
    check_manifest(path, "replay checkpoint", required=("meta.json", "table.npz", "selector.npz"))
    meta = read_json_object(path, "meta.json")
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path}: checkpoint format {meta.get('format')} (this gearflow reads {FORMAT})")
    try:
        columns = [f"columns/{c.name}.npy" for c in TableSpec.parse(meta["spec"])]
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{path}: meta.json has no valid spec: {exc}") from None
    if TableSpec.parse(meta["spec"]).stacked:
        columns.append("step_offset.npy")  # stacked frames: where each stack stops reaching back
    listed = json.loads((path / "MANIFEST.json").read_text())  # checked above: every entry verified
    if missing := [c for c in columns if c not in listed]:
        raise CheckpointError(f"{path}: MANIFEST.json is corrupt: it does not list {missing[0]}")
    return meta


def restore_checkpoint(
    path: str | Path, name: str | None = None, pin_memory: bool | None = None, device: Any = "cpu",
    run_tag: int = 0, rate_limiter: RateLimiter | None = None, num_buffers: int | None = None,
    sample_timeout_s: float | None = None,
) -> Table:
    """A new table (in a new shared-memory segment) equal to the one saved at ``path``.

    Writers attached to the new segment continue each partition's step and item
    counters where the checkpoint left them. ``device``: as :class:`Table`'s (``"cuda"``:
    sampled on the GPU, its device vectors filled from the restored records). ``run_tag``: as
    :meth:`SharedStorage.create`'s. Arrays are read without pickles (``np.load`` refuses them).
``rate_limiter`` and ``sample_timeout_s`` replace the saved ones (a resumed run follows its
config); ``num_buffers`` is the fewest buffer sets the table keeps.
    """
    path = Path(path)
    meta = verify_checkpoint(path)
    spec = TableSpec.parse(meta["spec"])
    P, S, R = meta["num_partitions"], meta["steps_per_partition"], meta["items_per_partition"]
    storage = SharedStorage.create(spec, P, S, R, name=name, run_tag=run_tag)
    try:
        for c in spec:
            storage.columns[c.name][:] = np.load(path / "columns" / f"{c.name}.npy", mmap_mode="r")
        if storage.step_offset is not None:
            storage.step_offset[:] = np.load(path / "step_offset.npy", mmap_mode="r")
        commit = np.asarray(meta["commit"], dtype=np.int64)
        storage.counters[:, RESERVE] = commit
        storage.counters[:, COMMIT] = commit
        storage.counters[:, PUBLISHED] = np.asarray(meta["published"], dtype=np.int64)
        storage.counters[:, EPISODES] = np.asarray(meta["episodes"], dtype=np.int64)

        sel_state = _scalarize(_plain_arrays(path, "selector.npz"))
        selector = make_selector(meta["selector"], P * R)
        selector.load_state_dict(sel_state)
        arrays = _plain_arrays(path, "table.npz")
        if arrays["dropped"].size:
            selector.remove(arrays["dropped"])
        table = Table(
            storage,
            kind_from_dict(meta["kind"]),
            selector,
            rate_limiter or RateLimiter(**meta["rate_limiter"]),
            num_buffers=max(meta["num_buffers"], num_buffers or 1),
            sample_timeout_s=meta["sample_timeout_s"] if sample_timeout_s is None else sample_timeout_s,
            pin_memory=pin_memory,
            device=device,
        )
        table.load_state({**arrays, **{k: meta[k] for k in Table.COUNTER_STATE}, "seen_reserve": commit})
    except Exception:
        storage.close()
        storage.unlink()
        raise
    return table
