"""gearflow.native.device_replay: ``replay.device`` resolution and ``Table(device="cuda")``.

Tiers (as in test_native.py):

* CPU: backend resolution and its errors here (no CuPy), the table's refusal
  of ``device="cuda"`` without CuPy (the caller's storage left intact),
  argument checks, ``launch/gpu_check.sh`` stopping at its first step, and the
  power check of the distribution test used on the device draws.
* Emulated (g++ on x86-64 Linux): ``DeviceReplay`` driven through a real
  ``Table`` with a small host-memory stand-in for CuPy and the ``.cu`` kernel
  sources compiled for the CPU (test_native's emulation). It checks the Python
  control logic — ingest mirroring, records, keys, the torn-item loop,
  impossible slots, redraws after a record-ring lap, buffer rotation,
  restore into a new segment — and the kernels' indexing on the table's own
  segment. The stand-in traces which device and stream each operation is
  issued on, so stream ordering (issue 18) is checked as a call sequence. It
  is not a GPU test and says nothing about CUDA memory or DLPack on a device.
* CUDA (``-m cuda``; skipped with the reason unless CuPy can run a kernel and
  torch has CUDA; launch/gpu_check.sh fails on such a skip): the same batches
  from ``Table(device="cuda")`` against what was written, rows against keys
  while the learner's stream is busy, a batch torch still reads not
  overwritten, device indices, the draw distribution against the CPU selector,
  torn-item replacement, restore.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import logging
import os
import statistics
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import ClassVar

import numpy as np
import pytest
import torch
from helpers_replay import SPEC
from test_native import EmulatedModule, FakeCupy, FakeDeviceArray, compile_emulated, needs_emulation
from test_replay_table import KINDS, Recorder, check_batch

from gearflow.errors import ConfigError, MissingDependencyError
from gearflow.kinds.transition import Transition
from gearflow.native import probe_cuda, probe_cupy
from gearflow.native.cuda_backend import KERNEL_DIR
from gearflow.native.device_replay import DeviceReplay, resolve_replay_device
from gearflow.native.gather import CudaGather
from gearflow.native.select import CudaSelect
from gearflow.replay import RateLimiter, SharedStorage, Table, make_selector
from gearflow.replay.storage import SHM_DIR

CUPY, TORCH_CUDA = probe_cupy(), probe_cuda()
GPU = CUPY.ok and TORCH_CUDA.ok
needs_gpu = pytest.mark.skipif(
    not GPU, reason=f"needs CuPy and a CUDA GPU ({CUPY.detail}) and torch with CUDA ({TORCH_CUDA.detail})"
)
no_cupy_here = pytest.mark.skipif(importlib.util.find_spec("cupy") is not None,
                                  reason="checks the errors of a machine without CuPy (it is installed here)")  # fmt: skip


# ============================================================================ CPU
@no_cupy_here
def test_resolution_here_cpu_auto_and_cuda(caplog):
    assert resolve_replay_device("cpu") == "cpu"
    with caplog.at_level(logging.INFO, logger="gearflow.native.device_replay"):
        assert resolve_replay_device("auto") == "cpu"
    assert "replay.device=auto: cpu (GPU replay needs CuPy and a CUDA GPU" in caplog.text
    with pytest.raises(MissingDependencyError) as info:
        resolve_replay_device("cuda")
    msg = str(info.value)
    assert msg.startswith("replay.device=cuda needs CuPy and a CUDA GPU: ") and "\n" not in msg
    assert "pip install 'gearflow[gpu]'" in msg


def test_resolution_rejects_unknown_names_and_cpu_only_selectors(caplog):
    with pytest.raises(ConfigError, match=r"replay.device='tpu': must be one of auto, cpu, cuda"):
        resolve_replay_device("tpu")
    with pytest.raises(ConfigError, match=r"replay.device=cuda: replay.selector='fifo' samples on the CPU only"):
        resolve_replay_device("cuda", "fifo")
    with caplog.at_level(logging.INFO, logger="gearflow.native.device_replay"):
        assert resolve_replay_device("auto", "top_k") == "cpu"
    assert "replay.selector='top_k' samples on the CPU only" in caplog.text


@no_cupy_here
def test_cli_bench_replay_device_cuda_here_is_a_one_line_error():
    proc = subprocess.run([sys.executable, "-m", "gearflow", "bench", "replay", "--device", "cuda"],
                          capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("gearflow bench: error: replay.device=cuda needs CuPy and a CUDA GPU")
    assert "pip install 'gearflow[gpu]'" in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stdout == ""


@no_cupy_here
def test_table_on_cuda_without_cupy_fails_cleanly_and_leaves_the_storage_to_its_owner():
    storage = SharedStorage.create(SPEC, num_partitions=2, steps_per_partition=16)
    try:
        selector = make_selector("prioritized", 2 * storage.items_per_partition, seed=0)
        with pytest.raises(MissingDependencyError, match=r"^replay.device=cuda needs CuPy .*gearflow\[gpu\]"):
            Table(storage, Transition(), selector, device="cuda")
        # nothing was half set up: a CPU table takes the same storage and closes it
        table = Table(storage, Transition(), selector, RateLimiter(min_size_to_sample=1))
        assert table.device == "cpu" and (SHM_DIR / storage.name).exists()
    except BaseException:
        storage.close()
        storage.unlink()
        raise
    table.close()
    assert not (SHM_DIR / storage.name).exists()  # and the leak fixture checks /dev/shm


@no_cupy_here
def test_gpu_check_stops_at_its_first_step_naming_what_is_missing(tmp_path):
    """launch/gpu_check.sh on a machine where the CUDA tests would only skip: every import of
    every step passes, then it names the first CUDA requirement missing (with the install
    command) and exits 1 before running any test, a JSON line per result written."""
    script = Path(__file__).resolve().parents[1] / "launch" / "gpu_check.sh"
    proc = subprocess.run(["bash", str(script), "--out", str(tmp_path)], capture_output=True, text=True,
                          timeout=300, check=False, env={**os.environ, "PYTHON": sys.executable})  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    missing = [ln for ln in proc.stderr.splitlines() if ln.startswith("gpu_check: MISSING: ")]
    assert len(missing) == 1 and "would only skip" in proc.stderr, proc.stderr
    if not TORCH_CUDA.ok and "CPU-only" in TORCH_CUDA.detail:
        assert "is a CPU-only build: a CUDA build of torch is needed (pip install torch --index-url" in missing[0]
    elif not TORCH_CUDA.ok:
        assert "sees no GPU" in missing[0]
    else:
        assert "CuPy cannot run a kernel: not installed" in missing[0] and "pip install 'gearflow[gpu]'" in missing[0]
    assert "cuda tests" not in proc.stdout and "prerequisites FAILED" in proc.stdout
    rows = [json.loads(ln) for ln in (tmp_path / "gpu_check.jsonl").read_text().splitlines()]
    imports = {r["check"]: r["ok"] for r in rows if r.get("check", "").startswith("import ")}
    assert imports["import gearflow.runner"] and imports["import envpool"] and imports["import tests/conftest.py"]
    assert all(ok for name, ok in imports.items() if name not in ("import gearflow.replay._hotpath", "import agents._r2d2_decode"))
    assert rows[-1] == {**rows[-1], "step": "prerequisites", "status": "failed", "exit": 1}


def test_table_device_argument_is_checked(make_table):
    with pytest.raises(ValueError, match="device must be 'cpu', 'cuda' or 'cuda:N', got 'gpu'"):
        make_table(SPEC, device="gpu")
    with pytest.raises(ValueError, match="a DeviceReplay over this table's storage"):
        make_table(SPEC, device=object())
    assert make_table(SPEC).device == "cpu"


def test_device_replay_refuses_cpu_only_selectors_before_touching_cuda(storage_factory):
    st = storage_factory(SPEC, P=2, S=16)
    for name in ("fifo", "top_k", "max_heap"):
        with pytest.raises(ValueError, match=f"prioritized and uniform selectors, not '{name}'"):
            DeviceReplay(st, Transition(), make_selector(name, 2 * st.items_per_partition))


def test_import_device_replay_does_not_import_cupy():
    code = "import sys, gearflow.native.device_replay, gearflow.bench.replay; assert 'cupy' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# ============================================================================ emulated kernels (CPU)
class Trace:
    """What the CuPy stand-in saw: every device operation as (what, device, stream) with the CUDA
    device and stream current when it was issued (None: CuPy's legacy default stream), host
    synchronizations, and CUDA events created. The emulated kernels run at once, so the
    ordering a GPU would give is checked here as "which stream was each operation issued on"."""

    def __init__(self):
        self.local = threading.local()
        self.reset()

    def reset(self):
        self.ops, self.syncs, self.events = [], [], 0

    def _stack(self, name):
        if not hasattr(self.local, name):
            setattr(self.local, name, [])
        return getattr(self.local, name)

    def device(self):
        devices = self._stack("devices")
        return devices[-1] if devices else 0

    def stream(self):
        streams = self._stack("streams")
        return streams[-1] if streams else None

    def op(self, what, stream=None):
        self.ops.append((what, self.device(), self.stream() if stream is None else stream))

    def sync(self, what):
        self.syncs.append(what)
        self.ops.append(("host sync: " + what, self.device(), None))


TRACE = Trace()


class Tracked(FakeDeviceArray):
    """A stand-in device array whose every operation (ufunc, reduction, indexing, copy) is traced."""

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        TRACE.op(f"{ufunc.__name__}.{method}")
        args = [x.view(np.ndarray) if isinstance(x, np.ndarray) else x for x in inputs]
        out = kwargs.get("out")
        if out is not None:
            kwargs["out"] = tuple(o.view(np.ndarray) if isinstance(o, np.ndarray) else o for o in out)
        result = getattr(ufunc, method)(*args, **kwargs)
        if out is not None:
            return out[0] if len(out) == 1 else out
        return _wrap(result)

    def __getitem__(self, index):
        TRACE.op("getitem")
        return super().__getitem__(index)

    def __setitem__(self, index, value):
        TRACE.op("setitem")
        super().__setitem__(index, value)

    def copy(self, *a, **k):
        TRACE.op("copy")
        return super().copy(*a, **k)

    def astype(self, *a, **k):
        TRACE.op("astype")
        return super().astype(*a, **k)


def _wrap(x):
    if isinstance(x, np.ndarray):
        return (x if x.flags.c_contiguous else x.copy()).view(Tracked)
    return x


class TracedModule:
    """A kernel module (emulated) whose launches are traced with their device and stream."""

    def __init__(self, module):
        self.module = module

    def get_function(self, name):
        fn = self.module.get_function(name)

        def kernel(grid, block, args):
            TRACE.op("kernel " + name)
            fn(grid, block, args)

        return kernel


class HostCupy(FakeCupy):
    """CuPy's calls used by DeviceReplay, on host memory. "Device pointers" are host addresses,
    so the emulated kernels read the table's shared-memory segment in place. Devices, streams
    and events are bookkeeping for :data:`TRACE`: a stream belongs to the device current when it
    was made, and entering it under another device fails, as in CUDA."""

    class Device:
        def __init__(self, index):
            self.id = index

        def __enter__(self):
            TRACE._stack("devices").append(self.id)
            return self

        def __exit__(self, *exc):
            TRACE._stack("devices").pop()

    class Stream:
        made = 0

        def __init__(self, non_blocking=False):
            HostCupy.Stream.made += 1
            self.ptr, self.device_id, self.non_blocking = 0x5000 + HostCupy.Stream.made, TRACE.device(), non_blocking

        def __enter__(self):
            assert TRACE.device() == self.device_id, f"stream of cuda:{self.device_id} used on cuda:{TRACE.device()}"
            TRACE._stack("streams").append(self)
            return self

        def __exit__(self, *exc):
            TRACE._stack("streams").pop()

        def synchronize(self):  # the emulated kernels ran synchronously
            TRACE.sync("stream.synchronize")

        def wait_event(self, event):
            TRACE.op(f"wait for an event recorded on stream 0x{event.recorded_on:x}", stream=self)

        def __repr__(self):
            return f"Stream(0x{self.ptr:x}, cuda:{self.device_id})"

    class Event:
        made: ClassVar[list] = []  # every event made: (block, disable_timing)

        def __init__(self, block=False, disable_timing=False):
            TRACE.events += 1
            HostCupy.Event.made.append((block, disable_timing))
            self.recorded_on, self.block = None, block

        def record(self, stream=None):  # CuPy reads stream.ptr only
            self.recorded_on = stream.ptr
            TRACE.op("event.record", stream=stream if isinstance(stream, HostCupy.Stream) else stream.ptr)

        def synchronize(self):
            TRACE.sync("event.synchronize")

    class Runtime:
        def __init__(self, devices=1):
            self.registered, self.devices = {}, devices

        def getDevice(self):
            return TRACE.device()

        def getDeviceCount(self):
            return self.devices

        def deviceGetAttribute(self, attr, device):
            return 1  # can map host memory

        def hostRegister(self, ptr, size, flags):
            assert ptr not in self.registered
            self.registered[ptr] = (size, TRACE.device())

        def hostUnregister(self, ptr):
            del self.registered[ptr]

        def hostGetDevicePointer(self, ptr, flags):
            return ptr  # unified addressing: the host address

        def memcpyAsync(self, dst, src, size, kind, stream_ptr):
            current = TRACE.stream()
            assert current is not None and current.ptr == stream_ptr, "memcpyAsync on another stream than the current"
            TRACE.op("memcpyAsync")
            ctypes.memmove(dst, src, size)

    def __init__(self, devices=1):
        super().__init__()
        self.cuda = SimpleNamespace(Stream=HostCupy.Stream, Event=HostCupy.Event, Device=HostCupy.Device,
                                    runtime=HostCupy.Runtime(devices),
                                    alloc_pinned_memory=lambda n: bytearray(n))  # fmt: skip
        self.random = SimpleNamespace(RandomState=HostCupy.RandomState)

    class RandomState:
        def __init__(self, seed):
            self._rng = np.random.RandomState(seed)

        def random_sample(self, n):
            TRACE.op("random_sample")
            return _wrap(self._rng.random_sample(n))

    def asarray(self, x):
        TRACE.op("asarray")
        return x if isinstance(x, Tracked) else _wrap(np.array(x))

    def empty(self, shape, dtype):
        TRACE.op("empty")
        return _wrap(np.empty(shape, dtype))

    def zeros(self, shape, dtype):
        TRACE.op("zeros")
        return _wrap(np.zeros(shape, dtype))

    def asnumpy(self, a):
        TRACE.sync("asnumpy")
        return np.array(a)

    def __getattr__(self, name):  # full, ones, where, flatnonzero, clip, ...: numpy's, traced, "device" results
        fn = getattr(np, name)
        if not callable(fn):
            return fn

        def call(*a, **k):
            TRACE.op(name)
            return _wrap(fn(*a, **k))

        return call


@pytest.fixture(scope="module")
def emulated_kernels(tmp_path_factory):
    out = tmp_path_factory.mktemp("emu_device_replay")
    return (EmulatedModule(compile_emulated(KERNEL_DIR / "gather.cu", out)),
            EmulatedModule(compile_emulated(KERNEL_DIR / "select.cu", out)))  # fmt: skip


class OverwritingDeviceReplay(DeviceReplay):
    """Runs ``during_gather`` once, inside the first gather (a writer racing the copy)."""

    during_gather = None

    def gather(self, draw, out):
        if self.during_gather is not None:
            fn, self.during_gather = self.during_gather, None
            fn()
        return super().gather(draw, out)


CONSUMER = 0x7C0  # the emulated consumer's (torch's) stream, a raw cudaStream_t


@pytest.fixture
def emulated_device(emulated_kernels):
    """``emulated_device(storage, kind, selector, devices=1, **DeviceReplay kwargs)``: an
    :class:`OverwritingDeviceReplay` on a fresh :class:`HostCupy` with the traced emulated kernels
    and :data:`CONSUMER` as the consumer's stream."""
    gather_module, select_module = emulated_kernels

    def make(storage, kind, selector, devices=1, select_cls=CudaSelect, **kw):
        cp = HostCupy(devices)
        kw.setdefault("consumer_stream", lambda: CONSUMER)
        return OverwritingDeviceReplay(storage, kind, selector, cupy=cp, gather=CudaGather(cp, TracedModule(gather_module)),
                                       select=select_cls(cp, TracedModule(select_module)), **kw)  # fmt: skip

    return make


@pytest.fixture
def emulated_table(make_table, emulated_device):
    """``emulated_table(selector, kind, P, S, devices=1, device=None, ...) -> (Table, its DeviceReplay)``
    on the emulation."""

    def make(selector, kind, P=2, S=32, devices=1, device=None, select_cls=CudaSelect, **kw):
        made = []
        device_for = lambda st, k, sel: emulated_device(st, k, sel, devices, select_cls, device=device)
        table = make_table(SPEC, P=P, S=S, kind=kind, selector=selector, table_cls=_factory(device_for, made), **kw)
        return table, made[0]

    return make


def _factory(device_for, made):
    """A ``table_cls`` for ``make_table`` that builds the table over ``device_for(...)``, kept in ``made``."""

    def table_cls(storage, kind, selector, limiter, **kw):
        made.append(device_for(storage, kind, selector))
        return Table(storage, kind, selector, limiter, device=made[-1], **kw)

    return table_cls


def _fill(table, kind):
    rec = Recorder(table.storage, [0, 1])
    for length in (7, 12, 1, 5):
        rec.episode(0, length, kind)
    for length in (10, 9, 3):
        rec.episode(1, length, kind)
    table.scan()
    return rec


@needs_emulation
@pytest.mark.parametrize("kind_name", sorted(KINDS))
@pytest.mark.parametrize("selector", ["uniform", "prioritized"])
def test_emulated_device_table_returns_what_was_written(emulated_table, selector, kind_name):
    kind = KINDS[kind_name]
    table, _ = emulated_table(selector, kind, num_buffers=2)
    rec = _fill(table, kind)
    assert table.device == "cuda" and table.size == len(rec.items)
    prios = {rec.key(p, s): v[2] for (p, s), v in rec.items.items()}
    masses = {k: v**0.6 for k, v in prios.items()}
    first = None
    for i in range(4):
        s = table.sample(7)
        keys = check_batch(s, rec, kind, 2, 7)
        probs = s.probabilities.numpy()
        if selector == "uniform":
            np.testing.assert_allclose(probs, 1 / len(prios))
            assert (s.weights == 1).all()
        else:
            want = np.array([masses[k] for k in keys.tolist()]) / sum(masses.values())
            np.testing.assert_allclose(probs, want, rtol=1e-9)
            w = (len(prios) * want) ** -0.4
            np.testing.assert_allclose(s.weights.numpy(), w / w.max(), rtol=1e-5)
        if i == 0:
            first = s.data
        elif i == 2:  # two buffer sets used in turn, preallocated once
            assert all(first[k].data_ptr() == s.data[k].data_ptr() for k in first)
    assert table.stats()["replay/samples"] == 28


@needs_emulation
def test_emulated_device_table_follows_updates_and_evictions(emulated_table):
    kind = KINDS["transition"]
    table, _ = emulated_table("prioritized", kind, S=16)
    rec = _fill(table, kind)  # partition 0 laps its 16-step ring: its oldest items are evicted
    live = {rec.key(p, s) for (p, s), (start, _, _) in rec.items.items()
            if start >= rec.w.positions[p] - 16}  # fmt: skip
    assert table.size == len(live) and table.evictions > 0
    keys = sorted(live)
    hot = keys[3]
    table.update_priorities(torch.tensor(keys), torch.tensor([1e-6 if k != hot else 1e6 for k in keys]))
    s = table.sample(16)
    check_batch(s, rec, kind, 2, 16)
    assert (s.keys == hot).sum() >= 15  # the update reached the device priority vector
    for _ in range(3):
        assert set(check_batch(table.sample(9), rec, kind, 2, 9).tolist()) <= live  # evicted: never drawn
    state = table.state()  # a restore rebuilds the mirrors from the table's state and the selector
    table.load_state(state)
    assert (table.sample(8).keys == hot).sum() >= 7


@needs_emulation
def test_emulated_all_zero_priorities_sample_uniformly_as_the_cpu_selector(emulated_table):
    """Every live priority 0: the device table samples uniformly (P = 1/N, weights 1) as the CPU
    selector does (issue 33), instead of raising; one positive priority makes it proportional."""
    kind = KINDS["transition"]
    table, _ = emulated_table("prioritized", kind, S=64)
    rec = _fill(table, kind)
    keys = sorted(rec.key(p, s) for (p, s) in rec.items)
    table.update_priorities(torch.tensor(keys), torch.zeros(len(keys)))
    seen = []
    for _ in range(20):
        s = table.sample(16)
        check_batch(s, rec, kind, 2, 16)
        np.testing.assert_allclose(s.probabilities.numpy(), 1 / len(keys))
        assert (s.weights == 1).all()
        seen += s.keys.tolist()
    counts = np.array([seen.count(k) for k in keys])
    assert counts.min() > 0 and counts.sum() == 320  # stratified: every key drawn, ~320/N each
    hot = keys[5]
    table.update_priorities(torch.tensor([hot]), torch.tensor([1.0]))
    assert (table.sample(8).keys == hot).all()


@needs_emulation
@pytest.mark.parametrize("kind_name", sorted(KINDS))
def test_emulated_torn_items_are_redrawn_never_returned(emulated_table, kind_name):
    kind = KINDS[kind_name]
    S = 16
    table, device = emulated_table("uniform", kind, P=1, S=S)
    rec = Recorder(table.storage, [0])
    for _ in range(S):
        rec.append(0)
        rec.item(0, min(rec.w.positions[0], 3))  # starts 0, 0, 0, 1, 2, ..., 13
    table.scan()

    def overwrite():  # steps 16..21 overwrite steps 0..5 during the first gather; the table has not scanned
        for _ in range(6):
            rec.append(0)

    device.during_gather = overwrite
    s = table.sample(32)
    keys = check_batch(s, rec, kind, 1, 32)
    assert all(rec.items[(0, k)][0] >= 6 for k in keys.tolist())
    assert table.torn > 0 and table.stats()["replay/torn_resampled"] == table.torn
    for _ in range(3):  # the torn items are gone from the table and the device vector
        assert all(rec.items[(0, k)][0] >= 6 for k in check_batch(table.sample(16), rec, kind, 1, 16).tolist())


@needs_emulation
def test_emulated_ingest_reaches_the_device_in_one_batch_per_draw(emulated_table, emulated_kernels):
    kind = KINDS["transition"]
    table, _ = emulated_table("prioritized", kind, S=16)
    _fill(table, kind)  # 2 partitions, ingest + ring evictions
    select_module = emulated_kernels[1]
    before = len(select_module.launches)
    table.sample(4)
    scatters = [k for k in select_module.launches[before:] if k.startswith("set_priorities")]
    assert scatters == ["set_priorities_f64"]  # every queued ingest/evict: one scatter before the draw
    before = len(select_module.launches)
    table.sample(4)  # nothing new: no scatter
    assert not [k for k in select_module.launches[before:] if k.startswith("set_priorities")]


@needs_emulation
def test_emulated_close_unregisters_before_the_segment_goes(emulated_table):
    table, device = emulated_table("uniform", KINDS["transition"])
    runtime = device.cupy.cuda.runtime
    assert list(runtime.registered.values()) == [(table.storage.nbytes, 0)]  # (bytes, device)
    table.close()
    assert runtime.registered == {}


def _ops_of(device):
    """The traced operations since the last reset, with the sample's stream named."""
    return [(what, dev_id, "stream" if st is device.stream else st) for what, dev_id, st in TRACE.ops]


@needs_emulation
@pytest.mark.parametrize("kind_name", ["transition", "sequence"])
def test_emulated_sample_is_one_stream_on_its_device_with_one_host_sync(emulated_table, kind_name):
    """Issue 18 points 1, 2, 4, 6 under the emulation: every device operation of a sample is issued
    on the table's stream under its device (cuda:1 here, while the caller's current device is 0);
    the first is the wait for the consumer's stream; the one host sync comes last; no event is
    created per sample."""
    kind = KINDS[kind_name]
    table, device = emulated_table("prioritized", kind, devices=2, device=1, num_buffers=2)
    assert device.device_id == 1 and device.stream.device_id == 1
    assert list(device.cupy.cuda.runtime.registered.values()) == [(table.storage.nbytes, 1)]
    rec = _fill(table, kind)
    for i in range(3):
        TRACE.reset()
        s = table.sample(7)
        check_batch(s, rec, kind, 2, 7)
        ops = _ops_of(device)
        assert {d for what, d, _ in ops if not what.startswith("host sync")} == {1}, ops  # none on cuda:0
        # first: the consumer's queued work is waited for, before anything this sample writes
        assert ops[0][0] == "event.record" and ops[0][2] == CONSUMER
        assert ops[1][0] == f"wait for an event recorded on stream 0x{CONSUMER:x}" and ops[1][2] == "stream"
        assert all(st == "stream" for _, _, st in ops[1:-1]), [op for op in ops if op[2] != "stream"]
        assert TRACE.syncs == ["event.synchronize"] and ops[-1][0] == "host sync: event.synchronize"
        assert TRACE.events == 0  # the two events were made with the table, and are reused
        if i == 0:
            first = s
    # what torch holds: the rotating buffer sets (preallocated), keys/weights/probabilities too
    assert s.keys.data_ptr() == first.keys.data_ptr() and s.weights.data_ptr() == first.weights.data_ptr()
    assert s.probabilities.data_ptr() == first.probabilities.data_ptr()
    assert all(s.data[k].data_ptr() == first.data[k].data_ptr() for k in s.data)


SIDE = 0x51DE  # a consumer's side stream (a raw cudaStream_t): not torch's current one when sampling


def _waits_on(ops, stream_ptr):
    return [i for i, (what, _, st) in enumerate(ops)
            if what == f"wait for an event recorded on stream 0x{stream_ptr:x}" and st == "stream"]  # fmt: skip


def _first_gather(ops):
    return next(i for i, (what, _, _) in enumerate(ops) if what.startswith("kernel gather_"))


@needs_emulation
@pytest.mark.parametrize("kind_name", ["transition", "sequence"])
def test_emulated_buffers_are_refilled_only_after_a_side_stream_consumer_released_them(emulated_table, kind_name):
    """A learner reading its batches on a side stream (not the stream the table samples from):
    ``Sample.release(stream)`` records an event there, and the batch's buffer set is refilled
    only after the replay stream waited for it (before the first gather kernel writes the set);
    the other set is not held back by it; the wait happens once per release; the event is
    made once per (set, stream) and reused."""
    kind = KINDS[kind_name]
    table, device = emulated_table("uniform", kind, num_buffers=2)
    rec = _fill(table, kind)
    a = table.sample(7)  # set 0
    TRACE.reset()
    a.release(SIDE)  # the consumer queued every read of a on SIDE
    assert _ops_of(device) == [("event.record", 0, SIDE)] and TRACE.events == 1 and not TRACE.syncs
    TRACE.reset()
    b = table.sample(7)  # set 1: a's release does not concern it
    assert not _waits_on(_ops_of(device), SIDE)
    TRACE.reset()
    c = table.sample(7)  # set 0 again: after SIDE passed a's release, and after torch's current stream
    ops = _ops_of(device)
    (wait,) = _waits_on(ops, SIDE)
    assert wait < _first_gather(ops) and _waits_on(ops, CONSUMER) == [1]
    check_batch(c, rec, kind, 2, 7)
    assert c.keys.data_ptr() == a.keys.data_ptr() and b.keys.data_ptr() != a.keys.data_ptr()
    for _ in range(2):  # set 1, set 0: the release was waited for once, not again
        TRACE.reset()
        table.sample(7)
        assert not _waits_on(_ops_of(device), SIDE)
    TRACE.reset()
    c.release(SIDE)  # the same (set, stream): its event is reused
    c.release()  # default: torch's current stream (the emulated consumer's)
    assert TRACE.events == 1  # one new event, for (set 0, CONSUMER)
    table.sample(7)  # set 1
    TRACE.reset()
    table.sample(7)  # set 0: both releases waited for
    ops = _ops_of(device)
    assert len(_waits_on(ops, SIDE)) == 1 and len(_waits_on(ops, CONSUMER)) == 2


@needs_emulation
def test_emulated_buffers_replaced_on_a_batch_size_change_live_while_torch_may_read_them(emulated_table):
    """A batch-size change replaces the buffer sets; the old ones are not dropped (their CuPy
    memory back in the pool for this stream's next allocation) while a consumer may still read
    them: their releases are still waited for, and they go only after num_buffers samples."""
    import gc
    import weakref

    kind = KINDS["sequence"]
    table, device = emulated_table("uniform", kind, num_buffers=2)
    _fill(table, kind)
    a = table.sample(7)
    old = [weakref.ref(x) for x in device.buffer_sets.sets]
    a.release(SIDE)
    del a
    TRACE.reset()
    table.sample(5)  # new sets; a's (retired) release is waited for before anything is gathered
    ops = _ops_of(device)
    (wait,) = _waits_on(ops, SIDE)
    assert wait < _first_gather(ops)
    gc.collect()
    assert all(r() is not None for r in old)  # still held: a batch lives num_buffers - 1 samples
    table.sample(5)
    gc.collect()
    assert all(r() is None for r in old)  # two samples on, each after the consumer's stream: freed
    table.sample(5)


@needs_emulation
def test_emulated_gather_sync_is_a_blocking_event(emulated_table):
    """The sample's one host sync waits on an event made with cudaEventBlockingSync (CuPy's
    block=True): the sampling thread sleeps in the driver instead of spinning a core."""
    HostCupy.Event.made.clear()
    _, device = emulated_table("uniform", KINDS["transition"])
    assert device._gathered.block is True and (True, True) in HostCupy.Event.made
    assert device._consumer_done.block is False  # only ever waited for on the device


@needs_emulation
def test_emulated_torn_redraw_stays_on_the_stream(emulated_table):
    kind = KINDS["transition"]
    table, device = emulated_table("uniform", kind, P=1, S=16)
    rec = Recorder(table.storage, [0])
    for _ in range(16):
        rec.append(0)
        rec.item(0, min(rec.w.positions[0], 3))
    table.scan()
    device.during_gather = lambda: [rec.append(0) for _ in range(6)]
    TRACE.reset()
    check_batch(table.sample(32), rec, kind, 1, 32)
    assert table.torn > 0
    ops = _ops_of(device)
    # the rare path reads the device (torn positions, slots to evict) and gathers again: more host
    # syncs, every device operation still on the stream
    assert TRACE.syncs.count("event.synchronize") == 2 and "asnumpy" in TRACE.syncs
    assert all(st == "stream" for what, _, st in ops[1:] if not what.startswith("host sync")), ops


@needs_emulation
def test_emulated_table_on_cuda_n_and_unknown_devices(make_table, emulated_device, monkeypatch):
    from gearflow.native import device_replay

    monkeypatch.setattr(device_replay, "DeviceReplay",
                        lambda st, k, sel, device=None: emulated_device(st, k, sel, devices=2, device=device))  # fmt: skip
    assert make_table(SPEC, selector="prioritized", device="cuda:1")._device.device_id == 1
    assert make_table(SPEC, selector="prioritized", device="cuda")._device.device_id == 0  # the current device
    with pytest.raises(ValueError, match=r"replay device cuda:2 does not exist \(2 CUDA device"):
        make_table(SPEC, selector="prioritized", device="cuda:2")
    with pytest.raises(ValueError, match="got 'cuda:x'"):
        make_table(SPEC, device="cuda:x")


def test_replay_device_names_with_an_index():
    from gearflow.native.device_replay import cuda_device_index

    assert cuda_device_index("cuda") is None and cuda_device_index("cuda:3") == 3
    for bad in ("cuda:", "cuda:-1", "gpu:0", "cuda:1:2"):
        with pytest.raises(ValueError):
            cuda_device_index(bad)
    with pytest.raises(ConfigError, match="a device index is a number"):
        resolve_replay_device("cuda:x")
    with pytest.raises(ConfigError, match=r"replay.device=cuda:1: replay.selector='fifo' samples on the CPU only"):
        resolve_replay_device("cuda:1", "fifo")


class ImpossibleSelect(CudaSelect):
    """The proportional draw returns -1 at row 0 and N at the last row for ``bad_rounds`` draws
    (what the kernel does when rounding at a scan-chunk boundary makes an empty chunk look full)."""

    bad_rounds = 0

    def sample_proportional(self, masses, u, *, chunk_sums=None, stream=None):
        slots, probs = super().sample_proportional(masses, u, chunk_sums=chunk_sums, stream=stream)
        if ImpossibleSelect.bad_rounds > 0:
            ImpossibleSelect.bad_rounds -= 1
            slots[0], probs[0] = -1, 0.0
            slots[-1] = masses.shape[0]
        return slots, probs


@needs_emulation
@pytest.mark.parametrize("kind_name", sorted(KINDS))
def test_emulated_impossible_slots_are_redrawn_never_returned(emulated_table, kind_name):
    kind = KINDS[kind_name]
    table, _ = emulated_table("prioritized", kind, select_cls=ImpossibleSelect)
    rec = _fill(table, kind)
    size = table.size
    for rounds in (1, 3):
        ImpossibleSelect.bad_rounds = rounds
        TRACE.reset()
        s = table.sample(9)
        check_batch(s, rec, kind, 2, 9)  # every key a real item, its rows gathered; weights in (0, 1]
        assert torch.isfinite(s.weights).all() and s.weights.max() == 1
        assert sum(what == "kernel sample_proportional" for what, _, _ in TRACE.ops) == rounds + 1
        assert ImpossibleSelect.bad_rounds == 0
    assert table.size == size and table.torn == 0  # redrawn, not evicted (-1 is no item)
    ImpossibleSelect.bad_rounds = 100
    with pytest.raises(RuntimeError, match=r"outside \[0, \d+\) in 8 redraws in a row"):
        table.sample(9)
    ImpossibleSelect.bad_rounds = 0


def check_redraw_keeps_the_records_of_the_rows_not_redrawn(table, device, to_cpu=lambda s: s):
    """The keys invariant on the device path: a torn row is redrawn after a scan that laps the
    record ring, so new items take the slots that other rows of the batch still hold. Those rows
    keep the key they were drawn with, and their rows are that item's (stamp-checked per row).
    ``table``: uniform, transitions, P=1, S=16, R=8, over ``device`` (an OverwritingDeviceReplay)."""
    kind = table.kind
    rec = Recorder(table.storage, [0])
    for t in range(16):
        rec.append(0)
        if t >= 8:
            rec.item(0, 1)  # seqs 0..7: one item per step 8..15, in slots 0..7
    table.scan()
    assert table.size == 8
    drawn = []
    draw = device.draw

    def recording_draw(batch_size, num_live):
        d = draw(batch_size, num_live)
        device.stream.synchronize()  # the test's own read of the draw (asnumpy runs on another stream)
        drawn.append((device.cupy.asnumpy(d.seqs), device.cupy.asnumpy(d.slots)))
        return d

    device.draw = recording_draw

    def writer_laps_the_record_ring():  # during the first gather
        for _ in range(9):  # steps 16..24: step 8 (seq 0) is overwritten, steps 9..15 are not
            rec.append(0)
        for _ in range(3):  # seqs 8, 9, 10 at step 24: the record ring laps into slots 0, 1, 2
            rec.item(0, 1)

    device.during_gather = writer_laps_the_record_ring
    s = to_cpu(table.sample(8))  # stratified over 8 equal masses: row i draws slot i
    keys = check_batch(s, rec, kind, 1, 8)  # each row's data is its key's item (obs stamps (p, t))
    first_keys, first_slots = drawn[0]
    assert first_slots.tolist() == list(range(8)) and table.torn == 1  # row 0 (seq 0) torn, redrawn
    assert keys[1:].tolist() == first_keys[1:].tolist() == list(range(1, 8))  # rows 1, 2 keep seqs 1, 2
    assert table._slot_seq[1] == 9 and table._slot_seq[2] == 10  # ... though their slots were reused


@needs_emulation
def test_emulated_redraw_keeps_the_records_of_the_rows_not_redrawn(emulated_table):
    table, device = emulated_table("uniform", KINDS["transition"], P=1, S=16, R=8, num_buffers=1)
    check_redraw_keeps_the_records_of_the_rows_not_redrawn(table, device)


@needs_emulation
def test_emulated_restore_checkpoint_onto_a_device_in_a_new_segment(emulated_table, emulated_device, monkeypatch,
                                                                    tmp_path):  # fmt: skip
    """Issue 19: ``restore_checkpoint(device=...)`` builds a new segment and a new device mirror
    from the checkpoint: batches, priorities and further writes as before the save."""
    from gearflow.native import device_replay
    from gearflow.replay.table_checkpoint import restore_checkpoint, save_checkpoint

    kind = KINDS["sequence"]
    table, _ = emulated_table("prioritized", kind)
    rec = _fill(table, kind)
    keys = sorted(rec.key(p, s) for p, s in rec.items)
    hot = keys[2]
    table.update_priorities(torch.tensor(keys), torch.tensor([1e-6 if k != hot else 1e6 for k in keys]))
    save_checkpoint(table, tmp_path / "replay")
    made = []

    def factory(st, k, sel, device=None):
        made.append(emulated_device(st, k, sel, devices=2, device=device))
        return made[-1]

    monkeypatch.setattr(device_replay, "DeviceReplay", factory)
    restored = restore_checkpoint(tmp_path / "replay", device="cuda:1")
    try:
        assert restored.storage.name != table.storage.name and made[0].storage is restored.storage
        assert restored.device == "cuda" and made[0].device_id == 1 and restored.size == table.size
        table.close()  # the original segment is gone: the batches below come from the new one
        s = restored.sample(16)
        check_batch(s, rec, kind, 2, 16)
        assert (s.keys == hot).sum() >= 15  # the priorities came back onto the device
        rec2 = Recorder(restored.storage, [0, 1])  # writers continue where the checkpoint left off
        rec2.items.update(rec.items)
        rec2.episode(1, 6, kind)
        restored.scan()
        new = [rec2.key(p, q) for p, q in rec2.items if (p, q) not in rec.items]
        assert new and restored.size == table.size + len(new)
        restored.update_priorities(torch.tensor(new), torch.full((len(new),), 1e9))
        s = restored.sample(16)
        assert set(check_batch(s, rec2, kind, 2, 16).tolist()) <= set(new)
    finally:
        restored.close()


def distribution_mismatch(got, reference, alpha=1e-6, min_expected=100):
    """None when the counts ``got`` and ``reference`` (same keys, any totals) could come from one
    distribution; otherwise why not. Two checks at family-wise level ``alpha``: the homogeneity
    chi-square of the 2 × K table (critical value by Wilson–Hilferty) and, per key, the z of the
    difference in frequencies against a Bonferroni bound. Power: a key that ``got`` never draws
    has z ≈ sqrt(its reference count), so the check refuses (ValueError) a reference in which a
    key was drawn fewer than ``min_expected`` times (100: z ≈ 10 against a bound of about 6)."""
    a, b = np.asarray(got, np.float64), np.asarray(reference, np.float64)
    if b.min() < min_expected:
        raise ValueError(f"too few draws to detect a never-drawn key: a key drawn {b.min():.0f} < "
                         f"{min_expected} times in the reference")  # fmt: skip
    na, nb = a.sum(), b.sum()
    pooled = (a + b) / (na + nb)
    ea, eb = na * pooled, nb * pooled
    K = len(a)
    normal = statistics.NormalDist()
    chi2 = float(((a - ea) ** 2 / ea).sum() + ((b - eb) ** 2 / eb).sum())
    dof = K - 1
    z = normal.inv_cdf(1 - alpha / 2)
    critical = dof * (1 - 2 / (9 * dof) + z * np.sqrt(2 / (9 * dof))) ** 3
    diff = (a / na - b / nb) / np.sqrt(pooled * (1 - pooled) * (1 / na + 1 / nb))
    bound = normal.inv_cdf(1 - alpha / (4 * K))
    why = []
    if chi2 > critical:
        why.append(f"chi-square {chi2:.0f} > {critical:.0f} ({dof} dof)")
    if np.abs(diff).max() > bound:
        k = int(np.abs(diff).argmax())
        why.append(f"key #{k}: {a[k]:.0f} of {na:.0f} vs {b[k]:.0f} of {nb:.0f} (z={diff[k]:.1f}, bound {bound:.1f})")
    return "; ".join(why) or None


def test_distribution_check_passes_equal_draws_and_catches_a_never_drawn_or_biased_key():
    """The power check of the GPU chi-square test, on the CPU: over 20 seeds, samples of one
    distribution always pass, a sample missing one key always fails, one with a key drawn twice as
    often always fails; an underpowered sample is refused rather than passed."""
    rng = np.random.default_rng(7)
    K = 800
    p = rng.random(K) + 0.2
    p /= p.sum()
    n = int(160 / p.min())
    low = int(p.argmin())
    for seed in range(20):
        r = np.random.default_rng(seed)
        a, b = r.multinomial(n, p), r.multinomial(n, p)
        assert distribution_mismatch(a, b) is None, seed
        missing = b.copy()
        missing[(low + 1) % K] += missing[low]
        missing[low] = 0  # a key the device never draws
        assert distribution_mismatch(missing, a) is not None, seed
        q = p.copy()
        q[int(p.argmax())] *= 2  # one key drawn twice as often
        assert distribution_mismatch(r.multinomial(n, q / q.sum()), a) is not None, seed
    with pytest.raises(ValueError, match="too few draws"):
        distribution_mismatch(a // 10, b // 10)


def _key_counts(keys, known):
    """Counts of ``keys`` per key of the sorted array ``known`` (every key must be known)."""
    keys = np.asarray(keys, dtype=np.int64)
    at = np.minimum(np.searchsorted(known, keys), len(known) - 1)
    assert (known[at] == keys).all(), f"unknown keys drawn: {sorted(set(keys[known[at] != keys].tolist()))[:5]}"
    return np.bincount(at, minlength=len(known)).astype(np.float64)


def _cpu_selector_counts(table, draws, known, batch=1000):
    """Counts per key of ``draws`` draws by the table's own CPU selector (the reference)."""
    sel, P, R = table.selector, table.storage.num_partitions, table.storage.items_per_partition
    counts = np.zeros(len(known))
    for _ in range(-(-draws // batch)):
        slots = sel.sample(batch).slots
        counts += _key_counts(table._slot_seq[slots] * P + slots // R, known)
    return counts


@needs_emulation
@pytest.mark.parametrize("selector", ["uniform", "prioritized"])
def test_emulated_draw_distribution_matches_the_cpu_selector(emulated_table, selector):
    """The emulated kernels' draws through ``Table(device=...)`` against the table's own CPU
    selector, by :func:`distribution_mismatch` (6 keys of priority 2, 3, 4; the emulation runs a
    block of 256 fibers per draw, so one batch of 1000, every key expected >= 111 times)."""
    kind = KINDS["transition"]
    table, _ = emulated_table(selector, kind, P=2, S=16,
                              selector_kwargs={"alpha": 1.0} if selector == "prioritized" else None)  # fmt: skip
    rec = Recorder(table.storage, [0, 1])
    for stream in (0, 1):
        for j in range(3):
            rec.append(stream)
            rec.item(stream, 1, priority=2 + j)
    table.scan()
    known = np.array(sorted(rec.key(p, s) for p, s in rec.items))
    gpu = _key_counts(table.sample(1000).keys, known)
    assert distribution_mismatch(gpu, _cpu_selector_counts(table, 5000, known)) is None


# ============================================================================ CUDA
def _cpu(sample):
    assert sample.keys.is_cuda and sample.weights.is_cuda and sample.probabilities.is_cuda
    assert all(v.is_cuda for v in sample.data.values())
    return SimpleNamespace(data={k: v.cpu() for k, v in sample.data.items()}, keys=sample.keys.cpu(),
                           weights=sample.weights.cpu(), probabilities=sample.probabilities.cpu())  # fmt: skip


def _cuda_table(make_table, selector, kind, **kw):
    return make_table(SPEC, P=2, S=32, kind=kind, selector=selector, device="cuda", **kw)


@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize("kind_name", sorted(KINDS))
@pytest.mark.parametrize("selector", ["uniform", "prioritized"])
def test_cuda_table_returns_what_was_written(make_table, selector, kind_name):
    kind = KINDS[kind_name]
    table = _cuda_table(make_table, selector, kind)
    rec = _fill(table, kind)
    prios = {rec.key(p, s): v[2] for (p, s), v in rec.items.items()}
    masses = {k: v**0.6 for k, v in prios.items()}
    for _ in range(5):
        s = _cpu(table.sample(33))
        keys = check_batch(s, rec, kind, 2, 33)
        if selector == "prioritized":
            want = np.array([masses[k] for k in keys.tolist()]) / sum(masses.values())
            np.testing.assert_allclose(s.probabilities.numpy(), want, rtol=1e-9)
        else:
            np.testing.assert_allclose(s.probabilities.numpy(), 1 / len(prios))
    # priority updates by CUDA keys (as a learner hands them back)
    batch = table.sample(8)
    assert table.update_priorities(batch.keys, torch.ones(8, device=batch.keys.device)) == 8


@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize("selector", ["uniform", "prioritized"])
def test_cuda_draw_distribution_matches_the_cpu_selector(make_table, selector):
    """Device draws through ``Table(device="cuda")`` against the table's own CPU selector, by the
    power-checked :func:`distribution_mismatch` (about 800 keys; enough draws that every key is
    expected >= 120 times on each side, so a never-drawn key fails with z >= 11)."""
    kind = KINDS["transition"]
    table = make_table(SPEC, P=2, S=512, kind=kind, selector=selector, device="cuda",
                       selector_kwargs={"alpha": 1.0} if selector == "prioritized" else None)  # fmt: skip
    rec = Recorder(table.storage, [0, 1])
    for stream in (0, 1):
        rec.episode(stream, 400, kind)
    table.scan()
    known = np.array(sorted(rec.key(p, s) for p, s in rec.items))
    p = np.array([rec.items[(k % 2, k // 2)][2] for k in known]) if selector == "prioritized" else np.ones(len(known))
    batches = int(np.ceil(120 * p.sum() / p.min() / 1000))
    gpu = np.zeros(len(known))
    for _ in range(batches):
        gpu += _key_counts(table.sample(1000).keys.cpu().numpy(), known)
    why = distribution_mismatch(gpu, _cpu_selector_counts(table, batches * 1000, known))
    assert why is None, why


@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize("kind_name", sorted(KINDS))
def test_cuda_torn_items_are_redrawn_never_returned(make_table, kind_name):
    kind = KINDS[kind_name]
    S = 16
    made = []
    table = make_table(SPEC, P=1, S=S, kind=kind, selector="uniform",
                       table_cls=_factory(OverwritingDeviceReplay, made))  # fmt: skip
    rec = Recorder(table.storage, [0])
    for _ in range(S):
        rec.append(0)
        rec.item(0, min(rec.w.positions[0], 3))
    table.scan()

    def overwrite():
        for _ in range(6):
            rec.append(0)

    made[0].during_gather = overwrite
    keys = check_batch(_cpu(table.sample(32)), rec, kind, 1, 32)
    assert all(rec.items[(0, k)][0] >= 6 for k in keys.tolist())
    assert table.torn > 0


def _stamp_table(make_table, kind, **kw):
    table = make_table(SPEC, P=2, S=64, kind=kind, selector="prioritized", device="cuda", num_buffers=2, **kw)
    rec = Recorder(table.storage, [0, 1])
    for stream in (0, 1):
        for length in (9, 14, 6, 11):
            rec.episode(stream, length, kind)
    table.scan()
    return table, rec


def _prefetch(table, batch_size):
    """``table.sample`` in another thread, as the learner's prefetcher calls it."""
    box = {}

    def run():
        try:
            box["sample"] = table.sample(batch_size)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            box["error"] = exc

    t = threading.Thread(target=run)
    t.start()
    t.join(timeout=60)
    assert not t.is_alive(), "sample hung"
    if "error" in box:
        raise box["error"]
    return box["sample"]


BUSY_CYCLES = 20_000_000  # torch.cuda._sleep: about 10 ms of one kernel at ~2 GHz


@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize("kind_name", ["transition", "sequence"])
def test_cuda_rows_match_their_keys_while_the_learner_stream_is_busy(make_table, kind_name):
    """Issue 18 point 1 on a GPU: the learner's stream (torch's current stream, the legacy
    default stream CuPy also calls current) is busy with a long kernel while the prefetcher
    samples. Priorities change before each sample, so a gather that read stale records would
    return another batch's rows; every row is stamp-checked against its key."""
    kind = KINDS[kind_name]
    table, rec = _stamp_table(make_table, kind)
    keys = torch.tensor(sorted(rec.key(p, s) for p, s in rec.items))
    rng = np.random.default_rng(0)
    seen = set()
    for _ in range(30):
        table.update_priorities(keys, torch.from_numpy(rng.random(len(keys)) ** 4 + 1e-3))
        torch.cuda._sleep(BUSY_CYCLES)  # the learner's forward/backward, still running
        s = _prefetch(table, 24)
        got = check_batch(_cpu(s), rec, kind, 2, 24)
        seen.add(tuple(got.tolist()))
    assert len(seen) > 20  # the batches differed: stale rows would have shown


@pytest.mark.cuda
@needs_gpu
def test_cuda_a_batch_torch_still_reads_is_not_overwritten(make_table):
    """Issue 18 point 2 on a GPU: the learner queues reads of batch 0 (keys, weights,
    probabilities, data) behind a long kernel; the prefetcher then samples until the buffer
    sets wrap around to batch 0's. What the learner read must be batch 0 as it was returned."""
    kind = KINDS["transition"]
    table, _ = _stamp_table(make_table, kind)  # two buffer sets: the third sample reuses the first's
    s0 = table.sample(16)
    want = _cpu(s0)
    torch.cuda._sleep(BUSY_CYCLES)  # the learner is busy ...
    read = {"keys": s0.keys.clone(), "weights": s0.weights.clone(), "probabilities": s0.probabilities.clone(),
            **{k: v.clone() for k, v in s0.data.items()}}  # ... and reads batch 0 after it  # fmt: skip
    for _ in range(3):
        _prefetch(table, 16)
    torch.cuda.synchronize()
    assert torch.equal(read["keys"].cpu(), want.keys) and torch.equal(read["weights"].cpu(), want.weights)
    assert torch.equal(read["probabilities"].cpu(), want.probabilities)
    assert all(torch.equal(read[k].cpu(), want.data[k]) for k in want.data)


@pytest.mark.cuda
@needs_gpu
def test_cuda_a_batch_read_on_a_side_stream_is_not_overwritten_once_released(make_table):
    """A learner on a side stream (not the stream the table samples from): its reads of batch 0
    are queued behind a long kernel there, it releases the batch on that stream, and the
    prefetcher samples until batch 0's set is refilled. What the side stream read must be
    batch 0 as it was returned (without the release the refill would not wait for it)."""
    kind = KINDS["transition"]
    table, _ = _stamp_table(make_table, kind)  # two buffer sets: the third sample reuses the first's
    side = torch.cuda.Stream()
    s0 = table.sample(16)
    want = _cpu(s0)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(BUSY_CYCLES)  # the learner's step, on its own stream ...
        read = {"keys": s0.keys.clone(), "weights": s0.weights.clone(), **{k: v.clone() for k, v in s0.data.items()}}
    s0.release(side)  # ... every read of batch 0 is queued there
    for _ in range(3):
        _prefetch(table, 16)
    torch.cuda.synchronize()
    assert torch.equal(read["keys"].cpu(), want.keys) and torch.equal(read["weights"].cpu(), want.weights)
    assert all(torch.equal(read[k].cpu(), want.data[k]) for k in want.data)


@pytest.mark.cuda
@needs_gpu
def test_cuda_table_on_an_explicit_device_index(make_table):
    kind = KINDS["sequence"]
    table, _ = _stamp_table(make_table, kind)
    assert table._device.device_id == torch.cuda.current_device()
    made = []
    t0 = make_table(SPEC, P=2, S=64, kind=kind, selector="prioritized",
                    table_cls=_factory(lambda st, k, sel: DeviceReplay(st, k, sel, device=0), made))  # fmt: skip
    assert made[0].device_id == 0 and made[0].stream.device_id == 0
    rec0 = _fill(t0, kind)
    s = t0.sample(8)
    assert all(v.device == torch.device("cuda", 0) for v in (s.keys, s.weights, s.probabilities, *s.data.values()))
    check_batch(_cpu(s), rec0, kind, 2, 8)


@pytest.mark.cuda
@needs_gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (cuda:1 while cuda:0 is current)")
def test_cuda_table_on_the_second_gpu_keeps_everything_there(make_table):
    kind = KINDS["transition"]
    with torch.cuda.device(0):
        table = make_table(SPEC, P=2, S=32, kind=kind, selector="prioritized", device="cuda:1")
        rec = _fill(table, kind)
        assert table._device.device_id == 1 and table._device.stream.device_id == 1
        s = table.sample(8)
        assert all(v.device == torch.device("cuda", 1) for v in (s.keys, s.weights, *s.data.values()))
        check_batch(_cpu(s), rec, kind, 2, 8)
        assert table.update_priorities(s.keys, torch.ones(8, device=s.keys.device)) == 8


@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize("kind_name", sorted(KINDS))
def test_cuda_impossible_slots_are_redrawn_never_returned(make_table, kind_name):
    import cupy

    kind = KINDS[kind_name]
    table = make_table(SPEC, P=2, S=32, kind=kind, selector="prioritized",
                       table_cls=_factory(lambda st, k, sel: DeviceReplay(st, k, sel, select=ImpossibleSelect(cupy)),
                                          []))  # fmt: skip
    rec = _fill(table, kind)
    ImpossibleSelect.bad_rounds = 2
    s = table.sample(9)
    assert ImpossibleSelect.bad_rounds == 0
    check_batch(_cpu(s), rec, kind, 2, 9)
    assert torch.isfinite(s.weights).all() and table.torn == 0


@pytest.mark.cuda
@needs_gpu
def test_cuda_redraw_keeps_the_records_of_the_rows_not_redrawn(make_table):
    made = []
    table = make_table(SPEC, P=1, S=16, R=8, kind=KINDS["transition"], selector="uniform", num_buffers=1,
                       table_cls=_factory(OverwritingDeviceReplay, made))  # fmt: skip
    check_redraw_keeps_the_records_of_the_rows_not_redrawn(table, made[0], _cpu)


@pytest.mark.cuda
@needs_gpu
def test_cuda_restore_checkpoint_onto_the_device(make_table, tmp_path):
    from gearflow.replay.table_checkpoint import restore_checkpoint, save_checkpoint

    kind = KINDS["sequence"]
    table = make_table(SPEC, P=2, S=32, kind=kind, selector="prioritized")
    rec = _fill(table, kind)
    save_checkpoint(table, tmp_path / "replay")
    restored = restore_checkpoint(tmp_path / "replay", device="cuda:0")
    try:
        assert restored.device == "cuda" and restored.size == table.size
        check_batch(_cpu(restored.sample(16)), rec, kind, 2, 16)
    finally:
        restored.close()


@pytest.mark.cuda
@needs_gpu
def test_cuda_probe_compiled_and_ran_a_kernel():
    assert CUPY.ok and "a test kernel ran on cuda:" in CUPY.detail, CUPY.detail


@no_cupy_here
def test_restore_checkpoint_on_cuda_without_cupy_is_a_clear_error_and_leaks_nothing(tmp_path):
    from gearflow.replay.storage import list_segments
    from gearflow.replay.table_checkpoint import restore_checkpoint, save_checkpoint

    storage = SharedStorage.create(SPEC, num_partitions=2, steps_per_partition=16)
    table = Table(storage, Transition(), make_selector("uniform", 2 * storage.items_per_partition, seed=0),
                  RateLimiter(min_size_to_sample=1))  # fmt: skip
    try:
        save_checkpoint(table, tmp_path / "replay")
    finally:
        table.close()
    before = {n for n, _, _ in list_segments()}
    with pytest.raises(MissingDependencyError, match=r"^replay.device=cuda needs CuPy"):
        restore_checkpoint(tmp_path / "replay", device="cuda")
    assert {n for n, _, _ in list_segments()} == before  # the new segment was unlinked
    restored = restore_checkpoint(tmp_path / "replay")  # the checkpoint is intact for a CPU restore
    restored.close()
