"""Sample replies written straight out of the shard's segment (gearflow.transport.server.wire).

* Every item kind (transitions with next columns, padded sequences, whole episodes, with a
  stacked-frame column beside): what a RemoteSampler receives equals, byte for byte, the
  table's own gather of the same keys — padding zeros included — over rings that wrapped.
* Torn while on the wire: the learner stops reading mid-reply, a writer laps the ring under
  the rows the socket has not taken yet, then the learner reads on. The shard marks the
  items (the reply's last buffer, written after the rest has left the process), the sampler
  redraws them, and every row it returns is intact (each frame's bytes are its step's).
  With transport.integrity on the frame's MAC leaves the marked rows out: the connection
  stays up (no integrity error) though the bytes sent are not the ones first MACed.
* Both with transport.integrity on and off.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from gearflow.kinds.episode import Episode
from gearflow.kinds.sequence import Sequence
from gearflow.kinds.transition import Transition
from gearflow.replay import Writer
from gearflow.transport import auth
from gearflow.transport.client import Client
from gearflow.transport.learner import RemoteSampler

TOKEN = "test-token-0123456789"  # conftest.SHARD_TOKEN: shard_of's shards


@pytest.fixture(autouse=True, params=[True, False], ids=["integrity", "no-integrity"])
def frame_integrity(request):
    """Every test with transport.integrity on (the default: the frame MAC reads the rows out of
    the segment as well and leaves rows marked torn out) and off."""
    auth.set_default_integrity(request.param)
    yield request.param
    auth.set_default_integrity(True)


def _frame(step: np.ndarray, part: np.ndarray, n: int) -> np.ndarray:
    """(k, n) uint8: every byte of step ``t`` of partition ``p`` is ``(7 t + 3 p + 1) % 251``."""
    return np.repeat(((7 * step + 3 * part + 1) % 251).astype(np.uint8)[:, None], n, axis=1)


def _fill(table, steps: int, L: int, seed: int = 0) -> None:
    """``steps`` steps per partition (rings of 64 wrap), episodes of 5 to 20 steps, an item
    ending at every step, of ``L`` steps or the episode so far (short ones: padded in sequence
    kinds)."""
    st = table.storage
    P = st.num_partitions
    w = Writer(st, np.arange(P), prefault=False)
    rng = np.random.default_rng(seed)
    left = rng.integers(5, 21, P)
    in_ep = np.zeros(P, np.int64)
    parts = np.arange(P)
    for t in range(steps):
        pos = w.positions.copy()
        w.append({"frame": _frame(pos, parts, 1500), "stk": rng.integers(0, 255, (P, 8, 8), dtype=np.uint8),
                  "step": pos})  # fmt: skip
        in_ep += 1
        n = np.minimum(L, in_ep)  # short (padded) items at every episode's start
        w.create_items(rng.random(P) + 0.1, n, streams=parts)
        left -= 1
        done = np.flatnonzero(left == 0)
        if done.size:
            w.end_episode(done)
            left[done] = rng.integers(5, 21, done.size)
            in_ep[done] = 0
    w.flush()


def _reference(table, keys: np.ndarray) -> dict[str, torch.Tensor]:
    """The table's own gather of the items ``keys`` name."""
    st = table.storage
    P, R = st.num_partitions, st.items_per_partition
    slots = (keys % P) * R + (keys // P) % R
    rec = table.records(slots)
    np.testing.assert_array_equal(rec[1] * P + slots // R, keys)  # the items are still there
    rows, lengths = table.rows_of(slots, rec)
    out = {k: torch.empty(shape, dtype=dt) for k, (shape, dt) in table.kind.layout(st.spec, keys.size).items()}
    table.kind.gather(st.tensors, out, rows, lengths)
    return out


SPEC = {"frame": "uint8[1500]", "stk": "uint8[2,8,8] stack=2", "step": "int64"}


@pytest.mark.parametrize("kind", [Transition(next_columns=("frame", "stk", "step")), Sequence(length=8, period=4),
                                  Episode(max_episode_length=20)], ids=["transition", "sequence", "episode"])  # fmt: skip
def test_out_of_segment_replies_equal_the_tables_gather(make_table, shard_of, kind):
    table = make_table(spec=SPEC, P=3, S=64, kind=kind, selector="prioritized",
                       selector_kwargs={"alpha": 0.6, "beta": 0.4})  # fmt: skip
    L = 3 if isinstance(kind, Transition) else 20
    _fill(table, 150, L)  # every ring wrapped twice
    shard, _ = shard_of(table)  # default: rows of ≥ 1024 bytes go out of the segment
    assert shard.wire.columns == ["frame"]  # not the stacked column, not the narrow one
    sampler = RemoteSampler(("127.0.0.1", shard.port), token=TOKEN, prefetch=1, timeout_s=10)
    padded = 0
    try:
        for _ in range(12):
            got = sampler.sample(48)
            want = _reference(table, got.keys.numpy())
            assert set(got.data) == set(want)
            for k in want:
                np.testing.assert_array_equal(got.data[k].numpy(), want[k].numpy(), err_msg=k)
            if "mask" in want:
                padded += int((~want["mask"]).sum())
    finally:
        sampler.close()
    assert sampler.torn == 0  # nothing was written meanwhile
    if not isinstance(kind, Transition):
        assert padded > 100  # padding rows went out as zeros, and were compared


def test_rows_overwritten_while_on_the_wire_are_redrawn(make_table, shard_of):
    """A 16 MiB reply, the learner's socket paused after the draw: the kernel's buffers take a
    few MiB; a writer then overwrites the whole ring before the rest is written."""
    n = 1 << 18  # 256 KiB frames
    spec = {"frame": f"uint8[{n}]", "step": "int64"}
    table = make_table(spec=spec, P=1, S=64, kind=Transition(next_columns=()))
    w = Writer(table.storage, np.arange(1), prefault=False)

    def write(k: int) -> None:
        for _ in range(k):
            pos = w.positions.copy()
            w.append({"frame": _frame(pos, np.zeros(1, np.int64), n), "step": pos})
            w.create_items(np.ones(1), np.ones(1, np.int64), streams=np.zeros(1, np.int64))
        w.flush()

    write(64)
    shard, _ = shard_of(table)
    client = Client(("127.0.0.1", shard.port), token=TOKEN, timeout_s=30)
    sampler = RemoteSampler(client, token=TOKEN, prefetch=0, timeout_s=30)
    out: dict = {}

    def learner():
        try:
            out["batch"] = sampler.sample(64)
        except BaseException as exc:  # pragma: no cover - reported below
            out["error"] = exc

    try:
        client._loop.call_soon_threadsafe(client._proto.transport.pause_reading)
        before = table.samples
        th = threading.Thread(target=learner)
        th.start()
        deadline = time.monotonic() + 30
        while table.samples == before:  # the shard has drawn: its reply is being written
            assert time.monotonic() < deadline, "the shard never drew"
            time.sleep(0.005)
        write(64)  # a whole lap: every drawn item's rows are overwritten
        client._loop.call_soon_threadsafe(client._proto.transport.resume_reading)
        th.join(60)
        assert not th.is_alive() and "error" not in out, out.get("error")
        b = out["batch"]
        steps = b.data["step"].numpy()
        assert (steps >= 64).all()  # only items of the second lap: the first lap's were all torn
        frames = b.data["frame"].numpy()
        np.testing.assert_array_equal(frames, _frame(steps, np.zeros_like(steps), n))  # every byte intact
        assert sampler.torn == 64
        assert sampler.stats()["replay/torn_resampled"] >= 64
    finally:
        sampler.close()
        client.close()
