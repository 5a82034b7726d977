"""Stacked-frame columns (``obs: uint8[4,84,84] stack=4``): one frame stored per step, the
stack gathered at sample time.

Every test writes what a frame-stacking env returns (a gym/EnvPool-style stack: reset fills
it with the first frame, each step pushes the newest), stores only the newest frame, and
checks that every sampled ``obs`` / ``next_obs`` equals the stack the env returned at that
step: transitions, R2D2 windows with burn-in, episodes, first steps of episodes, ring
wrap-around, the one-stream writer, checkpoints; then the stamp stress with a writer process
(a stack whose oldest frame was overwritten is never returned).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from gearflow.replay import SharedStorage, TableSpec, TrajectoryWriter, Writer
from gearflow.kinds.episode import Episode
from gearflow.kinds.sequence import Sequence
from gearflow.kinds.transition import Transition
from gearflow.replay.table_checkpoint import restore_checkpoint, save_checkpoint
from gearflow.replay.items import stack_rows
from gearflow.replay.spec import Column

try:  # the emulated CUDA tier (g++ on x86-64 Linux): test_native's CPU emulation of the kernels
    from test_device_replay import emulated_device, emulated_kernels  # noqa: F401 (fixtures)
    from test_native import needs_emulation
except ImportError:  # pragma: no cover
    needs_emulation = pytest.mark.skip(reason="the kernel emulation helpers are not importable")

K = 4
FRAME = (3, 5)
SPEC = {"obs": f"uint8[{K},{FRAME[0]},{FRAME[1]}] stack={K}", "step": "int64", "action": "int64"}


class StackEnv:
    """``E`` streams of episodes with random lengths and random frames; ``stack`` is what a
    frame-stacking env shows (reset: the first frame K times; step: the newest pushed)."""

    def __init__(self, E: int, seed: int = 0, min_len: int = 1, max_len: int = 12):
        self.rng = np.random.default_rng(seed)
        self.E, self.min_len, self.max_len = E, min_len, max_len
        self.stack = np.zeros((E, K, *FRAME), np.uint8)
        self.left = np.zeros(E, np.int64)  # steps left in the current episode
        self.first = np.ones(E, bool)

    def step(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(stacked obs (E, K, *FRAME), first (E,), last (E,)): the obs of this step."""
        frames = self.rng.integers(0, 256, (self.E, *FRAME), dtype=np.uint8)
        first = self.left == 0
        self.left[first] = self.rng.integers(self.min_len, self.max_len + 1, first.sum())
        self.stack[first] = frames[first][:, None]  # reset: the first frame, K times
        self.stack[~first] = np.concatenate([self.stack[~first, 1:], frames[~first, None]], axis=1)
        self.left -= 1
        return self.stack.copy(), first, self.left == 0


def _fill(writer: Writer, env: StackEnv, steps: int, log: dict, make_items) -> None:
    """Run ``env`` for ``steps`` recvs: write the newest frame of each step (the stacked obs
    sliced), remember the stack the env returned per (stream, step), create items."""
    E = env.E
    for _ in range(steps):
        stacked, first, last = env.step()
        pos = writer.positions
        writer.append({"obs": stacked[:, -1], "step": pos, "action": np.zeros(E, np.int64)})
        for e in range(E):
            log[(e, int(pos[e]))] = stacked[e]
        make_items(writer, last)
        if last.any():
            writer.end_episode(np.flatnonzero(last))


def _expected(log, streams, steps) -> np.ndarray:
    return np.stack([log[(int(e), int(t))] for e, t in zip(streams, steps)])


# ---------------------------------------------------------------------- spec and layout


def test_spec_round_trips_and_stores_one_frame():
    spec = TableSpec.parse({"obs": "uint8[4,84,84] stack=4", "action": "int64"})
    c = spec["obs"]
    assert (c.shape, c.row_shape, c.stack, c.nbytes, c.item_nbytes) == ((4, 84, 84), (84, 84), 4, 7056, 28224)
    assert spec.to_dict()["obs"] == "uint8[4,84,84] stack=4"
    assert TableSpec.parse(spec.to_dict()) == spec
    assert TableSpec.parse({"obs": ((4, 84, 84), "uint8", 4)}) == TableSpec([Column("obs", (4, 84, 84), np.dtype("uint8"), 4)])
    plain = TableSpec.parse({"obs": "uint8[4,84,84]", "action": "int64"})
    assert spec.step_nbytes / plain.step_nbytes <= 0.27
    st = SharedStorage.create(spec, 2, 64)
    try:
        assert st.columns["obs"].shape == (128, 84, 84) and st.step_offset.shape == (128,)
        other = SharedStorage.attach(st.name)  # the segment's JSON spec
        assert other.spec == spec and other.spec["obs"].stack == 4
        other.close()
    finally:
        st.close()
        st.unlink()
    plain_st = SharedStorage.create(plain, 2, 64)  # the old layout is unchanged
    try:
        assert plain_st.step_offset is None and plain_st.columns["obs"].shape == (128, 4, 84, 84)
        assert plain_st.nbytes == SharedStorage.segment_nbytes(plain, 2, 64, 64)
    finally:
        plain_st.close()
        plain_st.unlink()


def test_replay_frame_stack_makes_the_obs_column_frames_or_names_the_problem():
    from gearflow.errors import ConfigError
    from gearflow.replay.spec import replay_spec

    atari = {"obs": "uint8[4,84,84]", "action": "int64", "ret": "float32", "disc": "float32", "version": "int64"}
    assert replay_spec(atari) == TableSpec.parse(atari)  # off: the agent's columns as they are
    spec = replay_spec(atari, frame_stack=True)
    assert spec.to_dict()["obs"] == "uint8[4,84,84] stack=4" and spec["action"] == TableSpec.parse(atari)["action"]
    assert spec.stored_step_nbytes == 7056 + 24 + 1 and TableSpec.parse(atari).stored_step_nbytes == 28224 + 24
    with pytest.raises(ConfigError, match=r"replay.frame_stack=true: column 'obs' is float32\[4\]: storing one frame"):
        replay_spec({"obs": "float32[4]", "action": "int64"}, frame_stack=True)
    with pytest.raises(ConfigError, match="have no 'obs'"):
        replay_spec({"x": "uint8[4,84,84]"}, frame_stack=True)


@pytest.mark.parametrize(
    "desc, msg",
    [
        ("uint8[84,84] stack=4", "needs a shape [4, ...]"),
        ("uint8[3,84,84] stack=4", "needs a shape [4, ...]"),
        ("uint8 stack=4", "needs a shape [4, ...]"),
        ("uint8[4,84,84] stack=0", "stack must be an int in [1, 256]"),
        ("uint8[4,84,84] stack=x", "cannot parse type"),
    ],
)
def test_bad_stack_options_are_named(desc, msg):
    with pytest.raises(ValueError, match=r"column 'obs'.*" + msg.replace("[", r"\[").replace("]", r"\]")):
        TableSpec.parse({"obs": desc})


def test_writes_of_whole_stacks_or_wrong_frames_are_refused(make_table):
    table = make_table(SPEC, P=2, S=16, kind=Transition())
    w = Writer(table.storage, [0, 1])
    stacked = np.zeros((2, K, *FRAME), np.uint8)
    with pytest.raises(ValueError, match=r"column 'obs': expected shape \[2, 3, 5\], got \[2, 4, 3, 5\].*stack=4: write only the newest frame"):
        w.append({"obs": stacked, "step": np.zeros(2, np.int64), "action": np.zeros(2, np.int64)})
    tw_table = make_table(SPEC, P=1, S=16, kind=Transition())
    tw = TrajectoryWriter(tw_table.storage, 0)
    with pytest.raises(ValueError, match=r"column 'obs': expected shape \[3, 5\], got \[4, 3, 5\]"):
        tw.append({"obs": stacked[0], "step": 0, "action": 0})
    with pytest.raises(ValueError, match="steps_per_partition must be ≥ 5 for stacks of 4 frames"):
        SharedStorage.create(TableSpec.parse(SPEC), 1, 4)


def test_stack_rows_repeat_the_first_frame_and_wrap():
    rows = stack_rows(np.array([0, 1]), np.array([5, 9]), np.array([1, 0]), 4, 8)
    np.testing.assert_array_equal(rows, [[4, 4, 4, 5], [8 + 1, 8 + 1, 8 + 1, 8 + 1]])
    rows = stack_rows(np.array([0]), np.array([9]), np.array([7]), 4, 8)  # wraps: steps 6..9
    np.testing.assert_array_equal(rows, [[6, 7, 0, 1]])


# ---------------------------------------------------------------------- every sampled stack


def _transition_items(n):
    def make(writer, last):
        # a 1..n+1-step item ending at this step for every stream (never crossing its episode)
        L = writer.episode_lengths()
        m = np.minimum(L, n + 1)
        ok = m >= 1
        writer.create_items(np.ones(ok.sum()), m[ok], np.flatnonzero(ok))

    return make


@pytest.mark.parametrize("S", [16, 64])  # 16: the ring wraps many times over
def test_transitions_sample_the_env_stacks(make_table, S):
    E, n = 3, 3
    table = make_table(SPEC, P=E, S=S, kind=Transition(next_columns=("obs", "step")), selector="uniform")
    w = Writer(table.storage, list(range(E)))
    env, log = StackEnv(E, seed=1, max_len=9), {}
    checked = firsts = 0
    for _ in range(12):
        _fill(w, env, 11, log, _transition_items(n))
        s = table.sample(64)
        P = table.storage.num_partitions
        streams = s.keys.numpy() % P
        t, last = s.data["step"].numpy(), s.data["next_step"].numpy()
        assert s.data["obs"].shape == (64, K, *FRAME) and s.data["obs"].dtype == torch.uint8
        np.testing.assert_array_equal(s.data["obs"].numpy(), _expected(log, streams, t))
        np.testing.assert_array_equal(s.data["next_obs"].numpy(), _expected(log, streams, last))
        firsts += sum(bool((log[(int(e), int(x))] == log[(int(e), int(x))][:1]).all()) for e, x in zip(streams, t))
        checked += 64
    assert checked == 768 and firsts > 0  # episode starts (a repeated first frame) were sampled
    assert int(table.storage.counters[:, 0].min()) > 2 * S  # the rings wrapped


@pytest.mark.parametrize(
    "kind",
    [Sequence(length=6, period=3, burn_in=2), Episode(max_episode_length=7)],
    ids=["r2d2_window_burn_in", "episode"],
)
def test_windows_and_episodes_sample_the_env_stacks(make_table, kind):
    E, S = 2, 40
    table = make_table(SPEC, P=E, S=S, kind=kind, selector="uniform")
    w = Writer(table.storage, list(range(E)))
    env, log = StackEnv(E, seed=2, max_len=11), {}
    T = kind.max_length
    pads = 0
    for _ in range(10):
        _fill_windows(w, env, 13, log, kind)
        s = table.sample(32)
        P = table.storage.num_partitions
        streams = s.keys.numpy() % P
        obs, step, mask = s.data["obs"].numpy(), s.data["step"].numpy(), s.data["mask"].numpy()
        assert obs.shape == (32, T, K, *FRAME)
        for b in range(32):
            n = int(s.data["length"][b])
            assert mask[b].sum() == n
            np.testing.assert_array_equal(obs[b, :n], _expected(log, [streams[b]] * n, step[b, :n]))
            np.testing.assert_array_equal(np.diff(step[b, :n]), 1)
            assert not obs[b, n:].any()  # padding is zeros
            pads += T - n
    assert pads > 0
    assert int(table.storage.counters[:, 0].min()) > 2 * S


def _fill_windows(writer: Writer, env: StackEnv, steps: int, log: dict, kind) -> None:
    """As :func:`_fill`, with windows on the kind's schedule (the WindowAdder's)."""
    E = env.E
    for _ in range(steps):
        stacked, first, last = env.step()
        pos = writer.positions
        writer.append({"obs": stacked[:, -1], "step": pos, "action": np.zeros(E, np.int64)})
        for e in range(E):
            log[(e, int(pos[e]))] = stacked[e]
        L = writer.episode_lengths()
        ends = writer.positions
        items = []
        for e in range(E):
            l = int(L[e])
            items += [(e, n, int(ends[e])) for n in kind.due_on_append(l)]
            if last[e]:
                items += [(e, n, int(ends[e])) for n in kind.due_at_end(l)]
        if items:
            a = np.array(items)
            # a stream's items in order of their first step
            a = a[np.lexsort((a[:, 2] - a[:, 1], a[:, 0]))]
            writer.create_items(np.ones(len(a)), a[:, 1], a[:, 0], a[:, 2])
        if last.any():
            writer.end_episode(np.flatnonzero(last))


def test_trajectory_writer_extend_and_checkpoint_keep_the_stacks(make_table, tmp_path):
    """The one-stream writer (append and extend) stores the offsets too; a checkpoint restores
    frames and offsets: the restored table samples the same stacks."""
    table = make_table(SPEC, P=1, S=24, kind=Transition(next_columns=("obs", "step")), selector="uniform")
    tw = TrajectoryWriter(table.storage, 0)
    env, log = StackEnv(1, seed=3, max_len=8), {}
    for i in range(60):
        stacked, first, last = env.step()
        step = {"obs": stacked[0, -1], "step": tw.position, "action": 0}
        log[(0, tw.position)] = stacked[0]
        if i % 2:
            tw.append(step)
        else:
            tw.extend({k: np.asarray(v)[None] for k, v in step.items()})
        tw.create_item(1.0, min(tw.episode_length, 4))
        if last[0]:
            tw.end_episode()
    s = table.sample(40)
    np.testing.assert_array_equal(s.data["obs"].numpy(), _expected(log, [0] * 40, s.data["step"].numpy()))
    np.testing.assert_array_equal(s.data["next_obs"].numpy(), _expected(log, [0] * 40, s.data["next_step"].numpy()))
    save_checkpoint(table, tmp_path / "ckpt")
    meta = json.loads((tmp_path / "ckpt" / "meta.json").read_text())
    assert meta["spec"]["obs"] == f"uint8[{K},3,5] stack={K}"
    restored = restore_checkpoint(tmp_path / "ckpt")
    try:
        assert restored.storage.spec == table.storage.spec
        np.testing.assert_array_equal(restored.storage.step_offset, table.storage.step_offset)
        r = restored.sample(40)
        np.testing.assert_array_equal(r.data["obs"].numpy(), _expected(log, [0] * 40, r.data["step"].numpy()))
        assert restored.size == table.size
    finally:
        restored.close()
    (tmp_path / "ckpt" / "step_offset.npy").unlink()
    from gearflow.replay.table_checkpoint import CheckpointError

    with pytest.raises(CheckpointError, match="step_offset.npy"):
        restore_checkpoint(tmp_path / "ckpt")


def test_eviction_covers_the_frames_a_stack_reaches_back_to(make_table):
    """An item whose first step is intact but whose stack reaches back to an overwritten
    step is evicted by the scan (and counted torn by the re-check)."""
    table = make_table(SPEC, P=1, S=8, kind=Transition(next_columns=()), selector="uniform")
    w = Writer(table.storage, [0])
    for t in range(8):  # one long episode: every stack reaches 3 steps back
        w.append({"obs": np.full((1, *FRAME), t, np.uint8), "step": [t], "action": [0]})
        w.create_items([1.0], 1, [0])
    table.scan()
    # the rule is one bound per partition (first step ≥ RESERVE - S + K - 1): the first K - 1
    # items are dropped although their stacks stop at their episode's start (K - 1 steps of
    # each ring given up for a check without a per-item offset)
    assert table.size == 8 - (K - 1)
    # one more step overwrites step 0: item 3 (stack 0..3) is now torn, item 4 (1..4) is intact
    w.append({"obs": np.full((1, *FRAME), 8, np.uint8), "step": [8], "action": [0]})
    w.create_items([1.0], 1, [0])
    table.scan()
    s = table.sample(64)
    steps = s.data["step"].numpy()
    assert steps.min() >= 4
    np.testing.assert_array_equal(s.data["obs"][:, 0, 0, 0].numpy(), steps - 3)


# ---------------------------------------------------------------------- stamp stress (writer process)


@pytest.mark.parametrize(
    "kind, steps, batch",
    [("transition", 256, 128), ("sequence", 4096, 32), ("episode", 4096, 32)],
)
def test_no_torn_stack_under_a_concurrent_writer(kind, steps, batch):
    """A writer process laps small rings with stamped frames in episodes of 3..9 steps; every
    frame of every sampled stack is the step its stamp and key name, with redraws happening."""
    from gearflow.bench.replay_stack import check

    res = check(kind, 1.5, steps=steps, batch_size=batch, min_redraws=1, min_batches=1, max_seconds=60)
    assert res["rows_checked"] >= batch
    assert res["bad_keys"] == 0
    assert res["torn_stacks"] == 0
    assert res["redrawn_items"] >= 1


def test_the_stress_sees_stacks_torn_by_the_old_rule():
    """With the rule that ignores a stack's reach (first step ≥ RESERVE - S), transitions near
    the ring's tail keep frames a later lap overwrote: the stress must report them. (It samples
    until it has seen one, up to 60 s: on a loaded machine 1.5 s of writer and sampler may not
    overlap enough — a hogged full-suite run saw none once. And a sample that loses every
    redraw round to the writer for 5 s is drawn again: a hogged run had one sample give up
    after 60 s of 182,912 redraws.)"""
    from gearflow.bench.replay_stack import check

    res = check("transition", 1.5, steps=256, batch_size=128, trust_reach=False, min_torn_stacks=1, max_seconds=60)
    assert res["torn_stacks"] > 0


def test_bench_w6_smoke_reports_every_figure_against_the_stacked_copy():
    from gearflow.bench.replay import WORKLOADS

    rows: list[dict] = []
    WORKLOADS["W6"](rows.append, 0.01, 0)
    by = {r["metric"]: r for r in rows}
    assert by["bytes_per_step"]["ratio"] <= 0.27
    assert by["ape_x_replay_GiB_frames"]["value"] <= 0.27 * by["ape_x_replay_GiB_stacked_copy"]["value"]
    for metric in ("insert_steps_per_s", "sample_per_s", "actor_insert_steps_per_s"):
        assert by[metric]["value"] > 0 and by[metric]["floor"] > 0, metric


# ---------------------------------------------------------------------- the adders write frames

ADDER_SPECS = {
    "transition": {"obs": SPEC["obs"], "action": "int64", "ret": "float32", "disc": "float32", "version": "int64"},
    "sequence": {"obs": SPEC["obs"], "action": "int64", "reward": "float32", "discount": "float32",
                 "first": "bool", "version": "int64"},
    "episode": {"obs": SPEC["obs"], "action": "int64", "reward": "float32", "timestep": "int64"},
}  # fmt: skip


@pytest.mark.parametrize("name", ["transition", "sequence", "episode"])
def test_adders_write_the_newest_frame_and_batches_rebuild_the_env_stacks(make_table, name):
    """Each adder fed an env's stacked observations (as the actors do) stores one frame per
    row; every sampled stack is the env's stack of that row's observation."""
    from gearflow.kinds.episode import EpisodeAdder
    from gearflow.kinds.sequence import WindowAdder
    from gearflow.kinds.transition import TransitionAdder

    E, S = 3, 48
    kind = {"transition": Transition(next_columns=("obs",)), "sequence": Sequence(length=6, period=3, burn_in=2),
            "episode": Episode(max_episode_length=10)}[name]  # fmt: skip
    table = make_table(ADDER_SPECS[name], P=E, S=S, kind=kind, selector="uniform")
    w = Writer(table.storage, list(range(E)))
    if name == "transition":
        adder = TransitionAdder(w, n=3, gamma=0.9)
    elif name == "sequence":
        adder = WindowAdder(w, kind)
    else:
        adder = EpisodeAdder(w, kind, lambda ret, n: np.ones(len(n)))
    env = StackEnv(E, seed=5, min_len=2, max_len=9)
    rows: dict[int, list[np.ndarray]] = {e: [] for e in range(E)}  # the obs each row holds, in order
    ids = np.arange(E)
    for _ in range(3):
        for _ in range(60):
            stacked, first, last = env.step()  # `last`: this obs is the episode's final obs
            for e in range(E):
                if not (name == "episode" and last[e]):  # a DT episode stores no final obs
                    rows[e].append(stacked[e])
            adder.add(ids, stacked, np.zeros(E, np.float32), last, np.zeros(E, bool), first,
                      np.zeros(E, np.int64), None, 0)  # fmt: skip
        adder.finish()
        s = table.sample(32)
        keys = s.keys.numpy()
        P, R = table.storage.num_partitions, table.storage.items_per_partition
        slots = (keys % P) * R + (keys // P) % R
        start, length = table._slot_rec[slots, 0], table._slot_rec[slots, 2]
        for b, (e, t, n) in enumerate(zip((keys % P).tolist(), start.tolist(), length.tolist())):
            if name == "transition":
                np.testing.assert_array_equal(s.data["obs"][b].numpy(), rows[e][t])
                np.testing.assert_array_equal(s.data["next_obs"][b].numpy(), rows[e][t + n - 1])
            else:
                np.testing.assert_array_equal(s.data["obs"][b, :n].numpy(), np.stack(rows[e][t : t + n]))
    assert int(table.storage.counters[:, 0].max()) > S  # the rings wrapped


# ---------------------------------------------------------------------- the CUDA kernel (emulated on the CPU)


@pytest.fixture(scope="module")
def emulated_gather(tmp_path_factory):
    from test_native import EmulatedModule, FakeCupy, compile_emulated

    from gearflow.native.cuda_backend import KERNEL_DIR
    from gearflow.native.gather import CudaGather

    out = tmp_path_factory.mktemp("emu_stack")
    return CudaGather(FakeCupy(), EmulatedModule(compile_emulated(KERNEL_DIR / "gather.cu", out)))


def _naive_stacks(col, off, S, K, parts, starts, lengths, T):
    """The stacks one step at a time, by walking back through the episode (no shared formula)."""
    B = len(parts)
    out = np.zeros((B, T, K, *col.shape[1:]), col.dtype)
    for b in range(B):
        for j in range(min(int(lengths[b]), T)):
            t = int(starts[b]) + j
            p = int(parts[b])
            frames = [t]
            for _ in range(K - 1):  # one step back while the step is not its episode's first
                u = frames[0]
                frames.insert(0, u - 1 if off[p * S + u % S] > 0 else u)
            out[b, j] = col[[p * S + u % S for u in frames]]
    return out


@needs_emulation
@pytest.mark.parametrize("row_bytes", [1, 12, 16, 33, 7056])
def test_cuda_stack_kernel_and_its_cpu_reference_match_a_naive_walk(emulated_gather, row_bytes):
    """gather_stacks (kernels/gather.cu, run by the CPU emulation) and its numpy reference
    (native/gather.py) both equal a step-by-step walk back through each episode: ring wrap,
    episode starts, offsets capped at 255, padding, device indices it cannot address."""
    from test_native import column, dev

    from gearflow.native.gather import gather_stacks

    rng = np.random.default_rng(row_bytes)
    P, S, K, T, B = 2, 24, 4, 5, 16
    col = column(rng, P * S, row_bytes)
    # episodes of 1..7 steps (partition 1: then one of 1000 steps, capped offsets), through the rings
    off = np.zeros(P * S, np.uint8)
    for p in range(P):
        t, ep = 0, 0
        while t < 16 * S:
            L = 1000 if (p == 1 and ep == 2) else int(rng.integers(1, 8))
            for i in range(min(L, 16 * S - t)):  # the rings end at step 16 S
                off[p * S + (t + i) % S] = min(i, 255)
            t, ep = t + L, ep + 1
    assert off.max() == 255  # the capped offsets of the long episode are in partition 1's ring
    top = 16 * S  # the rings' next step: items within the last S - K + 1 steps are intact
    parts = rng.integers(0, P, B)
    starts = top - (S - K + 1) + rng.integers(0, S - K - T, B)
    lengths = rng.integers(0, T + 1, B).astype(np.int32)
    want = _naive_stacks(col, off, S, K, parts, starts, lengths, T)
    ref = np.full(want.shape, 7, col.dtype)
    gather_stacks(col, row_bytes, S, K, off, parts, starts, lengths, T, ref)
    assert ref.tobytes() == want.tobytes()
    for offset in (0, 1):
        raw = dev(np.full(want.nbytes + 16, 0xAB, np.uint8))
        dst = raw[offset : offset + want.nbytes].reshape(B, T, K, row_bytes)
        emulated_gather.gather_stacks(col.ctypes.data, row_bytes, S, K, off.ctypes.data, parts, starts, lengths, T,
                                      dst, num_rows=P * S)  # fmt: skip
        assert dst.tobytes() == want.tobytes()
    # an item the kernel cannot address is padding; a torn (too large) offset stays in the ring
    dst = dev(np.full((3, 1, K, row_bytes), 9, np.uint8))
    emulated_gather.gather_stacks(col.ctypes.data, row_bytes, S, K, off.ctypes.data, dev(np.array([P, -1, 0])),
                                  dev(np.array([0, 0, -5])), dev(np.array([1, 1, 1], np.int32)), 1, dst,
                                  num_rows=P * S)  # fmt: skip
    assert not dst.any()
    bad = off.copy()
    bad[:] = 255
    dst = dev(np.zeros((1, 1, K, row_bytes), np.uint8))
    emulated_gather.gather_stacks(col.ctypes.data, row_bytes, S, K, bad.ctypes.data, np.array([0]), np.array([1]),
                                  np.array([1], np.int32), 1, dst, num_rows=P * S)  # fmt: skip
    assert dst.tobytes() == col[[S - 2, S - 1, 0, 1]].tobytes()  # steps -2..1 wrapped into partition 0


@needs_emulation
@pytest.mark.parametrize("kind_name", ["transition", "sequence", "episode"])
def test_emulated_device_table_samples_the_env_stacks(make_table, emulated_device, kind_name):
    """Table(device=DeviceReplay) over a stacked-frame segment, with the .cu kernels run by the
    CPU emulation: every batch's stacks are the env's; the torn rule covers the stack's reach."""
    from gearflow.replay import Table

    kind = {"transition": Transition(next_columns=("obs", "step")), "sequence": Sequence(length=6, period=3, burn_in=2),
            "episode": Episode(max_episode_length=7)}[kind_name]  # fmt: skip
    made = []

    def table_cls(storage, kind, selector, limiter, **kw):
        made.append(emulated_device(storage, kind, selector))
        return Table(storage, kind, selector, limiter, device=made[-1], **kw)

    E, S = 2, 40
    table = make_table(SPEC, P=E, S=S, kind=kind, selector="prioritized", table_cls=table_cls)
    assert table.device == "cuda" and made[0]._S_trust == S - (K - 1)
    w = Writer(table.storage, list(range(E)))
    env, log = StackEnv(E, seed=7, max_len=11), {}
    for _ in range(4):
        if kind_name == "transition":
            _fill(w, env, 13, log, _transition_items(3))
        else:
            _fill_windows(w, env, 13, log, kind)
        s = table.sample(16)
        streams = s.keys.numpy() % E
        obs, step = s.data["obs"].numpy(), s.data["step"].numpy()
        if kind_name == "transition":
            np.testing.assert_array_equal(obs, _expected(log, streams, step))
            np.testing.assert_array_equal(s.data["next_obs"].numpy(), _expected(log, streams, s.data["next_step"].numpy()))
        else:
            for b in range(16):
                n = int(s.data["length"][b])
                np.testing.assert_array_equal(obs[b, :n], _expected(log, [streams[b]] * n, step[b, :n]))
                assert not obs[b, n:].any()
    assert int(table.storage.counters[:, 0].min()) > S
