"""The typed ops of a ``replay.write`` request: one encoder (the writers') and one decoder (the shard's).

* Every op round-trips: ``decode_ops(encode_ops(ops)) == ops``, and a wire list decoded and
  encoded again is the same list.
* The wire stays byte-compatible: the JSON of the encoded ops is the JSON the positional lists
  of the writers before the typed ops produced (``RemoteWriter``'s 8-field ``create_items``,
  ``ShippingWriter``'s 7-field one without the ``expired`` flag, which a shard reads as "raise").
* A truncated op, a wrong-typed field, a range past the buffers: a ``ValueError`` naming the
  op (position, name) and the field; over a real shard the whole batch is refused before its
  first op is applied, so nothing already stored changes and the session keeps writing.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from gearflow.replay.storage import COMMIT, PUBLISHED
from gearflow.transport.client import Client
from gearflow.transport.ops import (
    Append,
    CreateItems,
    EndEpisode,
    Episodes,
    Extend,
    Flush,
    decode_ops,
    encode_ops,
)

TOKEN = "test-token-0123456789"  # conftest's SHARD_TOKEN

EVERY_OP = [
    Append(count=3, ints_at=0),
    Extend(stream=1, count=4),
    Extend(stream=0, count=2, first_step=17),
    CreateItems(count=2, ints_at=3, floats_at=0, stream=-1, has_ends=True, timeout_s=60.0, drop=False),
    CreateItems(count=2, ints_at=9, floats_at=2, stream=1, has_ends=False, timeout_s=0.0, drop=True),
    CreateItems(count=1, ints_at=11, floats_at=4, stream=0, has_ends=True, timeout_s=5.0),  # no expired field
    EndEpisode(count=2, ints_at=13),
    EndEpisode(count=-1, ints_at=0),
    Episodes(stream=1, count=3),
    Flush(),
]
# what the writers sent before the ops were typed (remote.py's positional lists)
WIRE = [["a", 3, 0], ["x", 1, 4], ["x", 0, 2, 17], ["i", 2, 3, 0, -1, 1, 60.0, 0], ["i", 2, 9, 2, 1, 0, 0.0, 1],
        ["i", 1, 11, 4, 0, 1, 5.0], ["e", 2, 13], ["e", -1, 0], ["E", 1, 3], ["f"]]  # fmt: skip
SIZES = {"ints": 15, "floats": 5, "rows": 9}


def test_every_op_round_trips_and_encodes_to_the_bytes_writers_sent_before():
    raw = encode_ops(EVERY_OP)
    assert raw == WIRE
    assert json.dumps(raw) == json.dumps(WIRE)  # byte for byte in the request's envelope
    assert decode_ops(raw, **SIZES) == EVERY_OP
    assert encode_ops(decode_ops(json.loads(json.dumps(WIRE)), **SIZES)) == WIRE
    assert [op.expired for op in EVERY_OP if type(op) is CreateItems] == ["raise", "drop", "raise"]


@pytest.mark.parametrize("raw, words", [
    (["a", 3], ["op 0 (append)", "1 fields", "count, ints_at"]),                          # truncated
    (["x"], ["op 0 (extend)", "0 fields"]),
    (["i", 2, 3, 0, -1, 1], ["op 0 (create_items)", "5 fields", "6 to 7"]),               # no timeout
    (["a", 3, 0, 9], ["op 0 (append)", "3 fields"]),                                      # one too many
    (["a", "3", 0], ["op 0 (append) field 1 (count)", "int ≥ 0", "'3'"]),                 # wrong type
    (["a", 3, -1], ["op 0 (append) field 2 (ints_at)", "int ≥ 0"]),
    (["x", 1.0, 4], ["op 0 (extend) field 1 (stream)", "1.0"]),
    (["x", 0, 2, True], ["op 0 (extend) field 3 (first_step)", "True"]),
    (["i", 2, 3, 0, -2, 1, 60.0], ["op 0 (create_items) field 4 (stream)", "int ≥ -1"]),
    (["i", 2, 3, 0, -1, 2, 60.0], ["op 0 (create_items) field 5 (has_ends)", "0 or 1"]),
    (["i", 2, 3, 0, -1, 1, "60"], ["op 0 (create_items) field 6 (timeout_s)", "seconds"]),
    (["i", 2, 3, 0, -1, 1, 60.0, "drop"], ["op 0 (create_items) field 7 (drop)", "0 or 1"]),
    (["e", -2, 0], ["op 0 (end_episode) field 1 (count)", "int ≥ -1"]),
    (["E", 0, None], ["op 0 (episodes) field 2 (count)", "None"]),
    (["z", 1], ["op 0 is not one of"]),
    ([], ["op 0 is not one of"]),
    ("a", ["op 0 is not one of"]),
])  # fmt: skip
def test_a_malformed_op_names_the_op_and_the_field(raw, words):
    with pytest.raises(ValueError) as exc:
        decode_ops([raw], **SIZES)
    msg = str(exc.value)
    assert msg.startswith("replay.write: op 0"), msg
    for w in words:
        assert w in msg, (w, msg)


@pytest.mark.parametrize("ops, sizes, words", [
    ([["a", 3, 0], ["a", 3, 13]], SIZES, ["op 1 (append) reads ints[13:16]", "holds 15"]),
    ([["i", 4, 10, 0, -1, 0, 1.0]], SIZES, ["op 0 (create_items) reads ints[10:18]", "holds 15"]),  # num_steps + streams
    ([["i", 2, 0, 4, 0, 0, 1.0]], SIZES, ["op 0 (create_items) reads floats[4:6]", "holds 5"]),
    ([["e", 4, 12]], SIZES, ["op 0 (end_episode) reads ints[12:16]"]),
    ([["x", 0, 5], ["x", 1, 5]], SIZES, ["op 1 (extend) writes rows [5, 10)", "hold 9"]),
    ([["a", 1, 0]], {"ints": 15, "floats": 5, "rows": None}, ["op 0 (append) writes 1 rows but no column buffers"]),
    ({"a": 1}, SIZES, ["meta.ops must be a list"]),
])  # fmt: skip
def test_ranges_past_the_buffers_are_refused_naming_the_op(ops, sizes, words):
    with pytest.raises(ValueError) as exc:
        decode_ops(ops, **sizes)
    for w in words:
        assert w in str(exc.value), (w, str(exc.value))


def _stored(table):
    st = table.storage
    return {k: v.copy() for k, v in st.columns.items()}, st.counters.copy(), st.item_start.copy(), st.item_priority.copy()


def test_a_malformed_batch_is_refused_whole_and_nothing_stored_changes(make_table, shard_of):
    """Over a real shard: a batch whose first ops are valid and whose last is malformed (or whose
    ints buffer is truncated) raises the named error, applies none of its ops, and the session
    keeps writing."""
    table = make_table(P=2, S=32)
    _, port = shard_of(table)
    c = Client(("127.0.0.1", port), token=TOKEN, timeout_s=10)
    try:
        session = c.call("replay.open_writer", {"num_streams": 2, "insert_timeout_s": 1.0})[0]["session"]
        k = 6
        rows = [np.ones((k, 3), np.float32), np.full((k, 2, 4), 7, np.uint8), np.arange(k), np.zeros(k, bool)]

        def write(ops, ints, floats=np.zeros(0)):
            return c.call("replay.write", {"session": session, "ops": encode_ops(ops)},
                          [np.asarray(ints, np.int64), np.asarray(floats, np.float64), *rows], timeout_s=10)  # fmt: skip

        write([Extend(0, k), CreateItems(2, 0, 0, 0, False, 1.0, False)], [1, 1], [1.0, 2.0])
        before = _stored(table)
        ok = [Extend(1, k), CreateItems(1, 0, 0, 1, False, 1.0, False)]
        with pytest.raises(ValueError, match=r"op 2 \(create_items\) field 6 \(timeout_s\)"):
            c.call("replay.write", {"session": session, "ops": [*encode_ops(ok), ["i", 1, 0, 0, 1, 0, "soon"]]},
                   [np.ones(1, np.int64), np.ones(1), *rows], timeout_s=10)  # fmt: skip
        with pytest.raises(ValueError, match=r"op 1 \(create_items\) reads ints\[0:3\], the ints buffer holds 2"):
            write([Extend(1, k), CreateItems(3, 0, 0, 1, False, 1.0, False)], [1, 1], [1.0, 1.0, 1.0])  # truncated ints
        after = _stored(table)
        for a, b in zip(before[0].values(), after[0].values()):
            np.testing.assert_array_equal(a, b)
        for a, b in zip(before[1:], after[1:]):
            np.testing.assert_array_equal(a, b)
        assert int(table.storage.counters[1, COMMIT]) == 0 and int(table.storage.counters[:, PUBLISHED].sum()) == 2
        write(ok, [1], [3.0])  # the session goes on from where it was
        assert int(table.storage.counters[1, COMMIT]) == k and int(table.storage.counters[1, PUBLISHED]) == 1
    finally:
        c.close()


@pytest.mark.parametrize("side", ["gearflow.transport.actor.writer", "gearflow.transport.actor.shipping",
                                  "gearflow.transport.learner.sampler", "gearflow.transport.learner.shards",
                                  "gearflow.transport.server.node"])  # fmt: skip
def test_each_side_alone_raises_the_shards_errors_as_themselves(side):
    """A process that imports only one side (a remote actor, a learner over shards) turns the
    shard's ERROR replies back into replay's own types: a shard's ``RateLimiterTimeout`` is a
    ``TimeoutError`` there (the prefetcher's "no batch yet"), not a ``RemoteError``."""
    import subprocess
    import sys

    code = (f"import importlib; importlib.import_module({side!r}); "
            "from gearflow.transport.client import remote_exception; "
            "from gearflow.replay.rate_limiter import RateLimiterTimeout; from gearflow.replay.writer import InsertAborted; "
            "from gearflow.replay.storage import PartitionOwned, TableClosed; from gearflow.transport.errors import SessionLost; "
            "bad = [c.__name__ for c in (RateLimiterTimeout, InsertAborted, PartitionOwned, TableClosed, SessionLost) "
            "if type(remote_exception({'type': c.__name__, 'message': 'm'})) is not c]; print(bad)")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr
