"""Row digests: a sample reply's MAC over its wide rows' digests, kept by the shard.

What must hold (see ``gearflow/transport/integrity.py``, "Row digests", and
``gearflow/transport/server/row_digests.py``): the receiver's MAC input is the sender's whichever
way the block is fed; a changed byte of any unmarked row, of a key, of the marks or of the
``digested`` list is refused, a marked row's is not; the shard computes a row's digest once per
write of the row (again after a writer overwrote it); a learner
that does not ask gets the MAC over the rows as before. Real shard services, real sockets.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

from gearflow.kinds.transition import Transition
from gearflow.replay.layout import key_partition, record_slot, step_rows
from gearflow.replay.writer import Writer
from gearflow.transport import auth, integrity
from gearflow.transport.client import Client, ServiceUnavailable
from gearflow.transport.framing import (
    HEADER,
    REPLY,
    Chunks,
    FrameError,
    FrameLimits,
    FrameReader,
    encode,
    frame_buffers,
)
from gearflow.transport.learner import RemoteSampler
from gearflow.transport.torn_marks import row_plan
from tests.test_wire_security import Relay, _nh_reference

pytestmark = pytest.mark.skipif(not integrity.rows_available(), reason="row digests need _mac.c and OpenSSL 3")

TOKEN = "test-token-0123456789"  # conftest.SHARD_TOKEN
KEY = b"k" * integrity.KEY_BYTES
ROW_KEY = integrity.row_key(b"learner-secret")


def _digests_by_definition(rows: np.ndarray, rb: int) -> bytes:
    """Each row's NH under the row key, from the definition (chunks from the row's start)."""
    flat = np.ascontiguousarray(rows).reshape(-1).view(np.uint8)
    return b"".join(_nh_reference(ROW_KEY, flat[i:i + rb].tobytes())[:-8] for i in range(0, flat.size, rb))


def test_a_row_digest_is_nh_of_the_row_by_its_definition():
    """``RowNH.digests``: 32 bytes of NH per KiB of each row, the row's last chunk zero-padded —
    rows of whole chunks, of a short last chunk, of less than a chunk."""
    rng = np.random.default_rng(3)
    nh = integrity.RowNH(ROW_KEY)
    for rb in (2048, 3000, 700, 1060, 28224):  # last chunks of 0, 60, 44, 3 (odd) and 36 units
        rows = rng.integers(0, 256, (3, rb), dtype=np.uint8)
        got = nh.digests(rows, rb)
        assert got.nbytes == 3 * integrity.digest_bytes(rb)
        assert got.tobytes() == _digests_by_definition(rows, rb), rb


def test_row_steps_reads_the_row_rule_back():
    """``layout.row_steps``: the step a storage row holds after ``commit`` steps of its partition —
    the latest one the row rule puts there (``step_rows`` of it gives the row back, and the next
    one there is not committed yet); negative for a row not written yet."""
    from gearflow.replay.layout import row_steps, step_rows

    S, rng = 16, np.random.default_rng(4)
    for _ in range(50):
        commit = rng.integers(0, 200, 3)
        rows = np.arange(3 * S)
        t = row_steps(rows, commit, S)
        p = rows // S
        ok = t >= 0
        np.testing.assert_array_equal(step_rows(p[ok], t[ok], S), rows[ok])
        assert (t < commit[p]).all() and (t + S >= commit[p]).all()
        np.testing.assert_array_equal(ok, rows % S < commit[p])


def _digested_frame(marks: np.ndarray, rb: int = 1500) -> tuple[bytes, list]:
    """A reply sealed as a shard seals one with row digests whose tail marked ``marks``: 4 items,
    each two rows of ``rb`` bytes sent as pieces (the MAC takes their digests), the marks last."""
    rows = np.random.default_rng(5).integers(0, 256, (4, 2, rb), dtype=np.uint8)
    chunks = Chunks(np.uint8, (4, 2, rb), [memoryview(rows[i].reshape(-1)) for i in range(4)],
                    digests=integrity.RowNH(ROW_KEY).digests(rows, rb))  # fmt: skip
    bufs = [np.arange(4, dtype=np.int64), chunks, marks]
    seal = integrity.Sealer(KEY)
    spans: list = []
    parts = encode(REPLY, 7, "replay.sample", {"torn": True, "names": ["obs"], "digested": [[1, rb]]}, bufs, spans=spans)
    seal.begin()
    seal.update_spans(spans[:-1])
    if marks.any():  # the reseal: again, without the marked items' digests
        seal.restart()
        seal.update_spans(list(integrity.masked_frame([parts[0]], frame_buffers(bufs), marks)))
    seal.update(marks)
    parts.append(seal.trailer())
    return b"".join(bytes(p) for p in parts), bufs


def _open(frame: bytes, pieces=None, threaded: bool = False, row_key: bytes | None = ROW_KEY):
    """``frame`` through a real FrameReader with the row key: the delivered arrays, or the
    IntegrityError / FrameError it raised. ``pieces``: sizes of the recvs; ``threaded``: the
    block MACed in a MAC thread."""
    got = []
    reader = FrameReader(lambda *a: got.append(a[4]), FrameLimits(), {REPLY})
    reader.opener = integrity.Opener(KEY, row_key)
    if threaded:
        reader.opener.thread_bytes = 0
    pos = 0
    try:
        for n in pieces or [len(frame)]:
            n = min(n, len(frame) - pos)
            buf = reader.get_buffer(-1)
            n = min(n, len(buf))
            buf[:n] = frame[pos:pos + n]
            reader.buffer_updated(n)
            pos += n
        while pos < len(frame):
            buf = reader.get_buffer(-1)
            n = min(len(buf), len(frame) - pos)
            buf[:n] = frame[pos:pos + n]
            reader.buffer_updated(n)
            pos += n
    except (integrity.IntegrityError, FrameError) as exc:
        return exc
    return got[0]


@pytest.mark.parametrize("threaded", [False, True], ids=["inline", "mac-thread"])
def test_a_digested_reply_covers_every_unmarked_row_and_nothing_marked(threaded):
    """The receiver feeds the block's rows to the row NH as they land (in any pieces) and checks
    the tag over their digests: the frame as sent opens; a changed byte of an unmarked row, of a
    key, of a mark, or of the ``digested`` list (another row size) is refused; a marked item's row
    is not authenticated (the sampler redraws it) and is accepted."""
    marks = np.array([0, 1, 0, 0], np.uint8)
    frame, bufs = _digested_frame(marks)
    block = HEADER.size + HEADER.unpack(frame[:HEADER.size])[4]  # keys at 0, rows at 64 (2 x 1500 a item), marks after
    row = lambda i, j=0: block + 64 + 3000 * i + 1500 * j + 7

    def flip(at: int) -> bytes:
        b = bytearray(frame)
        b[at] ^= 0x20
        return bytes(b)

    for pieces in (None, [block + 100, 1, 2999, 5, 4000], [HEADER.size + 9, 700, 1501, 1499]):
        ok = _open(frame, pieces, threaded)
        assert not isinstance(ok, Exception), pieces
        assert np.array_equal(ok[1].reshape(4, 2, 1500), np.stack([np.frombuffer(p, np.uint8).reshape(2, 1500)
                                                                   for p in bufs[1].parts]))  # fmt: skip
    assert not isinstance(_open(flip(row(1, 1)), None, threaded), Exception)  # marked: redrawn, not used
    for what, at in [("item 0's first row", row(0)), ("item 2's second row", row(2, 1)), ("item 3's last byte",
                     block + 64 + 12000 - 1), ("a key", block + 3), ("item 1's mark", block + 64 + 12000 + 1)]:  # fmt: skip
        assert isinstance(_open(flip(at), None, threaded), integrity.IntegrityError), what
    other = frame.replace(b'"digested":[[1,1500]]', b'"digested":[[1,3000]]')
    assert other != frame and isinstance(_open(other, None, threaded), integrity.IntegrityError)


def test_a_malformed_digested_list_is_a_frame_error_naming_it():
    """``digested`` must name data buffers in order with whole rows (per item, with marks): a
    hostile list is refused at the envelope, before any byte of the block is MACed; an end
    without a row key refuses any frame with the list."""
    layout = [(np.dtype(np.int64), (4,), 0), (np.dtype(np.uint8), (4, 3000), 64), (np.dtype(np.uint8), (4,), 12064)]
    torn = {"torn": True}
    assert row_plan({}, layout) is None
    assert row_plan({**torn, "digested": [[1, 1500]]}, layout).tolist() == [[64, 12064, 1500]]
    for bad, what in [("x", "non-empty list"), ([], "non-empty list"), ([[1]], "buffer index, row bytes"),
                      ([[2, 4]], "not a data buffer"), ([[1, 1500], [1, 1500]], "out of order"),
                      ([[1, 7]], "not rows of 7"), ([[1, 4000]], "not rows of 4000"),
                      ([[1, 2400]], "a whole number per item"), ([[5, 1500]], "not a data buffer")]:  # fmt: skip
        with pytest.raises(ValueError, match=what):
            row_plan({**torn, "digested": bad}, layout)
    with pytest.raises(ValueError, match="not rows of 1400 bytes$"):  # no marks: whole rows of the buffer
        row_plan({"digested": [[1, 1400]]}, layout)
    assert row_plan({"digested": [[1, 2400], [2, 64]]}, [*layout[:2], (np.dtype(np.uint8), (128,), 12064)]).tolist() == \
        [[64, 12064, 2400], [12064, 12192, 64]]  # fmt: skip
    frame, _ = _digested_frame(np.zeros(4, np.uint8))
    bad = frame.replace(b'"digested":[[1,1500]]', b'"digested":[[1,1400]]')
    got = _open(bad)
    assert isinstance(got, FrameError) and "not rows of 1400" in str(got)
    got = _open(frame, row_key=None)  # an end that never asks (a service, a learner without _mac.c)
    assert isinstance(got, integrity.IntegrityError) and "no row key" in str(got)


SPEC = {"obs": "uint8[4096]", "action": "int64"}


def _fill(table, lap: int) -> None:
    """One lap of every partition's ring: rows stamped with (partition, step, lap) in their first
    bytes, random after; 2-step items over every step."""
    st = table.storage
    P, S = st.num_partitions, st.steps_per_partition
    w = Writer(st, np.arange(P), prefault=False)
    rng = np.random.default_rng(lap)
    for p in range(P):
        obs = rng.integers(0, 256, (S, 4096), dtype=np.uint8)
        obs[:, 0], obs[:, 1], obs[:, 2] = p, np.arange(S) % 256, lap
        w.extend({"obs": obs, "action": np.arange(S)}, stream=p)
        w.create_items(np.ones(S - 1), 2, streams=p, ends=lap * S + np.arange(2, S + 1))
    w.end_episode()  # the next lap is an episode of its own
    w.close()


def _rows_of(table, keys: np.ndarray, window: int | None = None) -> np.ndarray:
    """The storage row of each item's first step, by the layout's rules; with ``window``, the rows
    of its first ``window`` steps, ``(N, window)``."""
    st = table.storage
    P, S, R = st.num_partitions, st.steps_per_partition, st.items_per_partition
    p, seq = key_partition(keys, P), keys // P
    start = st.item_start.reshape(-1)[record_slot(p, seq, R)]
    if window is None:
        return step_rows(p, start, S)
    return step_rows(p[:, None], start[:, None] + np.arange(window), S)


def test_the_shard_digests_each_written_row_once_and_again_after_it_is_overwritten(make_table, shard_of):
    """A learner's batches from a shard with 4 KiB rows (obs and next obs out of the segment):
    every batch checks and holds the table's rows; the shard computed each row's digest at most
    once while no writer moved (fewer than the rows drawn); after a writer overwrote every row, the
    batches still check (the digests kept for the old steps are not used) and hold the new rows."""
    table = make_table(spec=SPEC, P=2, S=64, kind=Transition(next_columns=("obs",)))
    _fill(table, 0)
    shard, port = shard_of(table, wire_min_row_bytes=1024)
    sampler = RemoteSampler([("127.0.0.1", port)], token=TOKEN, prefetch=0, timeout_s=10)
    try:
        drawn = 0
        for _ in range(24):
            got = sampler.sample(32)
            drawn += 64
            rows = _rows_of(table, got.keys.numpy())
            np.testing.assert_array_equal(got.data["obs"].numpy(), table.storage.columns["obs"][rows])
        (digests,) = shard.wire._digests.values()
        # 128 rows; a row that is one item's obs and another's next obs in one reply may be digested
        # for each (two buffers), never again in a later reply
        assert 0 < digests.computed <= 2 * 128 < drawn / 3, "a kept digest was computed again"
        before = digests.computed
        _fill(table, 1)  # every row overwritten: (p, step, lap 1)
        for _ in range(6):
            got = sampler.sample(32)
            rows = _rows_of(table, got.keys.numpy())
            obs = got.data["obs"].numpy()
            assert (obs[:, 2] == 1).all()
            np.testing.assert_array_equal(obs, table.storage.columns["obs"][rows])
        assert digests.computed > before
    finally:
        sampler.close()


def test_a_changed_byte_of_a_wide_row_on_the_way_is_refused(make_table, shard_of, caplog):
    """A relay without the secret flips one byte in the middle of a sample reply's rows (the part
    the MAC takes as digests): the learner refuses the frame and drops the connection."""
    caplog.set_level(logging.WARNING)
    table = make_table(spec=SPEC, P=2, S=64, kind=Transition(next_columns=("obs",)))
    _fill(table, 0)
    _, port = shard_of(table, wire_min_row_bytes=1024)
    seen = []

    def tamper(d, i, f):
        if d == "s2c" and b'"digested"' in f[:4096]:
            seen.append(i)
            if len(seen) == 2:
                b = bytearray(f)
                b[len(f) // 2] ^= 0x01
                return [bytes(b)]
        return [f]

    relay = Relay(port, tamper)
    client = Client(("127.0.0.1", relay.port), TOKEN, timeout_s=10)
    sampler = RemoteSampler([client], token=TOKEN, prefetch=0, timeout_s=10)
    try:
        sampler.sample(32)  # the first reply with row digests: as sent
        with pytest.raises(ServiceUnavailable, match="integrity check failed"):
            sampler.sample(32)
    finally:
        sampler.close()
        relay.close()
    assert len(seen) == 2


def test_a_learner_that_does_not_ask_gets_the_mac_over_the_rows(make_table, shard_of, monkeypatch):
    """``transport.row_digests=false`` (``auth.configure``, as the entry points call it; or no
    ``_mac.c``): the client does not ask, the shard's replies carry no ``digested`` list and it
    keeps no digests; the batches check and hold the rows as before."""
    monkeypatch.setenv(auth.ROW_DIGESTS_ENV, "1")  # restored at teardown, whatever configure sets
    monkeypatch.setattr(auth, "_row_digests_default", True)
    assert Client(("127.0.0.1", 1), TOKEN).row_digests
    auth.configure({"integrity": True, "row_digests": False})
    table = make_table(spec=SPEC, P=2, S=64, kind=Transition(next_columns=("obs",)))
    _fill(table, 0)
    shard, port = shard_of(table, wire_min_row_bytes=1024)
    seen = []
    relay = Relay(port, lambda d, i, f: (seen.append(b'"digested"' in f[:4096]), [f])[1] if d == "s2c" else [f])
    client = Client(("127.0.0.1", relay.port), TOKEN, timeout_s=10)
    assert not client.row_digests
    sampler = RemoteSampler([client], token=TOKEN, prefetch=0, timeout_s=10)
    try:
        for _ in range(3):
            got = sampler.sample(32)
            np.testing.assert_array_equal(got.data["obs"].numpy(),
                                          table.storage.columns["obs"][_rows_of(table, got.keys.numpy())])  # fmt: skip
    finally:
        sampler.close()
        relay.close()
    assert not shard.wire._digests and not any(seen)


def test_a_row_nh_feeds_only_the_frame_nh_it_was_given():
    """A row NH made alone (``NH(key, 0, 0, rows=True)``) or outliving the frame NH that took it
    (``set_rows``) has nowhere to put its outputs: feeding it is a ValueError, never a write
    through a stale pointer; ``NH(key, 0, 0)`` without ``rows`` is still refused."""
    from gearflow.transport import _mac

    with pytest.raises(ValueError, match="non-null fn"):
        _mac.NH(ROW_KEY, 0, 0)
    alone = integrity.RowNH(ROW_KEY).nh
    alone.update(bytes(4096))
    with pytest.raises(ValueError, match="update of its outputs failed"):
        alone.finish()
    opener = integrity.Opener(KEY, ROW_KEY)
    rows = opener.row_nh.nh
    opener.begin()
    opener.set_rows(np.array([[0, 2048, 1024]], np.int64))
    opener.update(bytes(3000))  # two rows through it, into the frame's NH; the rest plain
    del opener  # the frame's NH goes; the row NH stays (held here)
    rows.update(bytes(2048))
    with pytest.raises(ValueError, match="update of its outputs failed"):
        rows.finish()


def test_padding_rows_of_short_sequences_are_digested_as_the_zeros_sent(make_table, shard_of):
    """Sequence windows of 8 over episodes of 5 steps: each item's last 3 rows go out as zeros
    (padding), digested as zeros; the batches check, the valid steps hold the storage's rows and
    the padding is zero."""
    from gearflow.kinds.sequence import Sequence

    table = make_table(spec={"obs": "uint8[2048]"}, P=2, S=64, kind=Sequence(length=8, period=4))
    st = table.storage
    w = Writer(st, np.arange(2), prefault=False)
    rng = np.random.default_rng(9)
    for p in range(2):
        for e in range(10):  # episodes of 5 steps, one item each
            obs = rng.integers(1, 256, (5, 2048), dtype=np.uint8)
            w.extend({"obs": obs}, stream=p)
            w.create_items(np.ones(1), 5, streams=p, ends=np.array([5 * (e + 1)]))
            w.end_episode(streams=[p])
    w.close()
    _, port = shard_of(table, wire_min_row_bytes=1024)
    sampler = RemoteSampler([("127.0.0.1", port)], token=TOKEN, prefetch=0, timeout_s=10)
    try:
        for _ in range(4):
            got = sampler.sample(8)
            obs, length = got.data["obs"].numpy(), got.data["length"].numpy()
            assert (length == 5).all()
            assert not obs[:, 5:].any()  # padding: zeros
            np.testing.assert_array_equal(obs[:, :5], st.columns["obs"][_rows_of(table, got.keys.numpy(), 5)])
    finally:
        sampler.close()
