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


def test_the_device_replay_reads_the_reserve_counter_the_storage_writes():
    from gearflow.native import device_replay
    from gearflow.replay import storage

    assert device_replay.RESERVE == storage.RESERVE  # finish_batch reads counters[p, RESERVE] on the device


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
        self.ops, self.syncs, self.events, self.sync_threads = [], [], 0, []

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
        self.sync_threads.append(threading.current_thread().name)
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
    was made, and entering it under another device fails, as in CUDA.

    Host syncs are counted as a GPU would charge them, pessimistically: the emulated kernels run
    at once, but an event counts as passed only once the host waited for it or for a later event
    on its stream (``query()`` is False until then), so every wait for a batch is one sync; an
    upload from host (pageable) memory (``asarray`` of a host array) is a sync too, as
    ``cudaMemcpyAsync`` from pageable memory first waits for the stream; and so is ``asnumpy``."""

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
            HostCupy.Event.passed(self.ptr, None)

        def wait_event(self, event):
            TRACE.op(f"wait for an event recorded on stream 0x{event.recorded_on:x}", stream=self)

        def __repr__(self):
            return f"Stream(0x{self.ptr:x}, cuda:{self.device_id})"

    class Event:
        made: ClassVar[list] = []  # every event made: (block, disable_timing)
        recorded: ClassVar[list] = []  # every record: (sequence number, stream ptr, event)
        count: ClassVar[int] = 0

        def __init__(self, block=False, disable_timing=False):
            TRACE.events += 1
            HostCupy.Event.made.append((block, disable_timing))
            self.recorded_on, self.block, self.seq, self.done = None, block, -1, True

        def record(self, stream=None):  # CuPy reads stream.ptr only
            self.recorded_on = stream.ptr
            HostCupy.Event.count += 1
            self.seq, self.done = HostCupy.Event.count, False
            HostCupy.Event.recorded.append((self.seq, stream.ptr, self))
            TRACE.op("event.record", stream=stream if isinstance(stream, HostCupy.Stream) else stream.ptr)

        # ``done`` (CuPy's property): True only once the host waited for it or a later event on its stream

        def synchronize(self):
            TRACE.sync("event.synchronize")
            HostCupy.Event.passed(self.recorded_on, self.seq)

        @staticmethod
        def passed(stream_ptr, upto):
            """The host waited for ``stream_ptr`` up to record ``upto`` (None: all of it)."""
            keep = []
            for seq, ptr, event in HostCupy.Event.recorded:
                if ptr == stream_ptr and (upto is None or seq <= upto):
                    if event.seq == seq:
                        event.done = True
                else:
                    keep.append((seq, ptr, event))
            HostCupy.Event.recorded = keep

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
                                    get_elapsed_time=lambda start, end: float("nan"))  # no GPU clock here  # fmt: skip
        self.random = SimpleNamespace(RandomState=HostCupy.RandomState)

    class RandomState:
        def __init__(self, seed):
            self._rng = np.random.RandomState(seed)

        def random_sample(self, n):
            TRACE.op("random_sample")
            return _wrap(self._rng.random_sample(n))

    def asarray(self, x):
        if isinstance(x, Tracked):
            TRACE.op("asarray")
            return x
        TRACE.sync("asarray (an upload from pageable memory waits for the stream)")
        return _wrap(np.array(x))

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
    """Runs ``during_gather`` once, inside the first gather (a writer racing the copy: after the
    batch's draw, before its rows are copied), and ``every_gather`` inside every gather."""

    during_gather = None
    every_gather = None

    def _gather_and_finish(self, out, num_live):
        if self.during_gather is not None:
            fn, self.during_gather = self.during_gather, None
            fn()
        if self.every_gather is not None:
            self.every_gather()
        return super()._gather_and_finish(out, num_live)


class DeviceOnly:
    """An array in (emulated) device memory as a learner hands it over: its CUDA Array Interface
    and nothing else (no ``__array__``: the host cannot read it without a copy, which on a GPU
    waits for the device). Keeps ``host`` (the memory) alive."""

    def __init__(self, host):
        self.host = np.ascontiguousarray(host)

    @property
    def __cuda_array_interface__(self):
        iface = self.host.__array_interface__
        return {"shape": self.host.shape, "typestr": self.host.dtype.str, "data": iface["data"],
                "strides": None, "version": 3}  # fmt: skip


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
    """``emulated_table(selector, kind, P, S, devices=1, device=None, ahead=1, ...) -> (Table, its
    DeviceReplay)`` on the emulation."""

    def make(selector, kind, P=2, S=32, devices=1, device=None, select_cls=CudaSelect, ahead=1, **kw):
        made = []
        device_for = lambda st, k, sel: emulated_device(st, k, sel, devices, select_cls, device=device, ahead=ahead)
        table = make_table(SPEC, P=P, S=S, kind=kind, selector=selector, table_cls=_factory(device_for, made), **kw)
        return table, made[0]

    return make


def _factory(device_for, made):
    """A ``table_cls`` for ``make_table`` that builds the table over ``device_for(...)``, kept in ``made``."""

    def table_cls(storage, kind, selector, limiter, **kw):
        made.append(device_for(storage, kind, selector))
        return Table(storage, kind, selector, limiter, device=made[-1], **kw)

    return table_cls


def sample_after_the_batches_drawn_ahead(table, batch_size):
    """The first batch drawn after now: a device table returns the batches it drew ahead first
    (``DeviceReplay.ahead`` of them), so a priority change shows from the sample after those."""
    for _ in range(getattr(table._device, "ahead", 0)):
        table.sample(batch_size)
    return table.sample(batch_size)


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
        elif i == 3:  # three buffer sets used in turn (two, and one for the batch drawn ahead), made once
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
    """Whatever a scan ingested and evicted (many partitions' worth) reaches the device in one
    kernel before the next draw, read in place from mapped host memory: no upload (which would
    first wait for the stream, where the batches drawn ahead are still being gathered)."""
    kind = KINDS["transition"]
    table, _ = emulated_table("prioritized", kind, S=16)
    rec = _fill(table, kind)  # 2 partitions, ingest + ring evictions
    table.sample(4)  # the first: buffer sets made (their descriptors uploaded once)
    rec.episode(0, 9, kind)
    rec.episode(1, 5, kind)  # more items in both partitions, and evictions
    table.scan()
    select_module = emulated_kernels[1]
    before = len(select_module.launches)
    TRACE.reset()
    table.sample(4)
    launched = select_module.launches[before:]
    assert launched.count("apply_ingest") == 1 and launched.index("apply_ingest") < launched.index("draw_items")
    assert not [w for w in TRACE.syncs if w.startswith("asarray")]  # read in place: no upload waited for the stream
    before = len(select_module.launches)
    table.sample(4)  # nothing new: no ingest kernel
    assert "apply_ingest" not in select_module.launches[before:]


@needs_emulation
def test_emulated_a_learner_pays_no_host_sync_and_the_sampler_one_per_batch_with_writers_moving(emulated_table):
    """Issue 46, done means 1: a sampling thread draws (one batch ahead) while writers move during
    every gather (their counters change; nothing drawn is overwritten), and the learner's thread
    writes priorities back as device arrays and releases each batch. The sampler pays at most
    one host sync per batch (the wait for the batch it returns; the seqlock check ran on the
    device and came back in the status word), the learner none: the write-back is three kernels
    after a device-side wait for its stream. (The code before: two syncs per sample with a writer
    moving, the event and the torn check's asnumpy; and the keys and priorities brought to the host.)"""
    import queue

    kind = KINDS["transition"]
    table, device = emulated_table("prioritized", kind, S=512, num_buffers=3)
    rec = Recorder(table.storage, [0, 1])
    for stream in (0, 1):
        rec.episode(stream, 60, kind)
    table.scan()
    device.every_gather = lambda: [rec.append(p) for p in (0, 1)]  # a step each, mid-episode: no new item
    table.sample(16).release(SIDE)  # the first: buffer sets made (their descriptors uploaded once)
    TRACE.reset()
    n, batches, moved = 12, queue.Queue(maxsize=1), table.writers_moved  # the prefetcher's queue

    def sampler():
        for _ in range(n):
            s = table.sample(16)
            batches.put((s, moved()))

    thread = threading.Thread(target=sampler, name="sampler")
    thread.start()
    rng = np.random.default_rng(0)
    for _ in range(n):
        s, writers_moved = batches.get(timeout=60)
        assert writers_moved  # the writers moved since the sample's scan: the seqlock check had work
        check_batch(s, rec, kind, 2, 16)
        keys = DeviceOnly(s.keys.numpy())  # the learner's CUDA tensors
        assert table.update_priorities(keys, DeviceOnly(rng.random(16))) == 16
        s.release(SIDE)
        hot = int(s.keys[0])
    thread.join(timeout=60)
    table.update_priorities(DeviceOnly(np.array([hot])), DeviceOnly(np.array([1e9])))
    learner = [w for w, t in zip(TRACE.syncs, TRACE.sync_threads) if t != "sampler"]
    sampler_syncs = [w for w, t in zip(TRACE.syncs, TRACE.sync_threads) if t == "sampler"]
    assert learner == [], learner
    assert len(sampler_syncs) <= n and set(sampler_syncs) == {"event.synchronize"}, sampler_syncs
    assert device.priority_counts["applied"] > 0 and device.buffer_sets.consumer_waits == 0
    assert (sample_after_the_batches_drawn_ahead(table, 16).keys == hot).sum() >= 8  # the write-backs took


@needs_emulation
def test_emulated_a_bad_device_priority_is_not_applied_and_the_next_sample_says_so(emulated_table):
    """Device priorities are not read on the host: one that is not finite and >= 0 is skipped on the
    device (the others applied), counted in the status word of the next batch drawn, and the sample
    that returns that batch raises ValueError naming it; host priorities are checked at once
    (nothing applied)."""
    kind = KINDS["transition"]
    table, device = emulated_table("prioritized", kind, S=64)
    rec = _fill(table, kind)
    s = table.sample(8)
    keys = s.keys.numpy().copy()
    with pytest.raises(ValueError, match="priority must be finite"):
        table.update_priorities(keys, np.full(8, np.nan))
    table.update_priorities(DeviceOnly(keys), DeviceOnly(np.array([1.0, np.inf, 2, 3, -1, 4, 5, 6])))
    table.sample(8)  # the batch drawn ahead, before the write-back
    with pytest.raises(ValueError, match=r"2 priorities handed in since the last sample were not finite"):
        table.sample(8)
    check_batch(table.sample(8), rec, kind, 2, 8)  # said once: sampling goes on
    assert device.priority_counts["refused"] == 2
    with pytest.raises(ValueError, match="keys and the other argument must both be CUDA tensors or both host"):
        table.update_priorities(torch.tensor(keys), DeviceOnly(np.ones(8)))


@needs_emulation
def test_emulated_close_unregisters_before_the_segment_goes(emulated_table):
    table, device = emulated_table("uniform", KINDS["transition"])
    runtime = device.cupy.cuda.runtime
    base = table.storage.header.ctypes.data
    assert runtime.registered[base] == (table.storage.nbytes, 0)  # (bytes, device): the segment
    _fill(table, KINDS["transition"])
    table.sample(4)  # buffer sets' status words and ingest staging: small mapped areas of their own
    assert len(runtime.registered) > 1
    table.close()
    assert runtime.registered == {}


def _ops_of(device):
    """The traced operations since the last reset, with the sample's stream named."""
    return [(what, dev_id, "stream" if st is device.stream else st) for what, dev_id, st in TRACE.ops]


@needs_emulation
@pytest.mark.parametrize("kind_name", ["transition", "sequence"])
def test_emulated_sample_is_one_stream_on_its_device_with_one_host_sync(emulated_table, kind_name):
    """Issue 18 points 1, 2, 4, 6 and issue 46 under the emulation: every device operation of a
    sample is issued on the table's stream under its device (cuda:1 here, while the caller's
    current device is 0); a consumer that releases its batches (the learner) is never waited for
    as a whole: no wait on torch's stream at all; the one host sync is the wait for the batch
    returned (drawn one sample before), and comes last; no event is created per sample."""
    kind = KINDS[kind_name]
    table, device = emulated_table("prioritized", kind, devices=2, device=1, num_buffers=2)
    assert device.device_id == 1 and device.stream.device_id == 1
    assert device.cupy.cuda.runtime.registered[table.storage.header.ctypes.data] == (table.storage.nbytes, 1)
    rec = _fill(table, kind)
    first = table.sample(7)  # the first: buffer sets made, their descriptors uploaded once
    first.release(SIDE)
    for i in range(1, 6):
        TRACE.reset()
        s = table.sample(7)
        check_batch(s, rec, kind, 2, 7)
        s.release(SIDE)  # the learner, after its step (no wait: an event recorded on its stream)
        ops = _ops_of(device)
        assert {d for what, d, _ in ops if not what.startswith("host sync")} == {1}, ops  # none on cuda:0
        assert not _waits_on(ops, CONSUMER), ops  # torch's stream as a whole: never
        assert all(st == "stream" for what, _, st in ops[:-2] if not what.startswith("host sync")), ops
        assert TRACE.syncs == ["event.synchronize"] and ops[-2][0] == "host sync: event.synchronize"
        assert ops[-1] == ("event.record", 1, SIDE)
        assert TRACE.events == (1 if i <= 2 else 0)  # one release event per (set, stream), made once
    # what torch holds: the rotating buffer sets (preallocated), keys/weights/probabilities too
    s = table.sample(7)  # the 7th: sets 0, 1, 2 in turn (two, and one for the batch drawn ahead)
    assert s.keys.data_ptr() == first.keys.data_ptr() and s.weights.data_ptr() == first.weights.data_ptr()
    assert s.probabilities.data_ptr() == first.probabilities.data_ptr()
    assert all(s.data[k].data_ptr() == first.data[k].data_ptr() for k in s.data)


SIDE = 0x51DE  # a consumer's side stream (a raw cudaStream_t): not torch's current one when sampling


def _waits_on(ops, stream_ptr):
    return [i for i, (what, _, st) in enumerate(ops)
            if what == f"wait for an event recorded on stream 0x{stream_ptr:x}" and st == "stream"]  # fmt: skip


@needs_emulation
def test_emulated_a_device_write_back_reads_its_inputs_only_after_the_callers_stream(emulated_table):
    """A write-back's device keys and priorities are written on the caller's stream (torch's): the
    replay stream waits for it (an event, device-side) before the write-back's first kernel reads
    them, and the host waits for nothing. Host arrays are uploaded instead: no wait on the caller."""
    kind = KINDS["transition"]
    table, device = emulated_table("prioritized", kind)
    _fill(table, kind)
    s = table.sample(8)
    s.release(SIDE)
    TRACE.reset()
    assert table.update_priorities(DeviceOnly(s.keys.numpy()), DeviceOnly(np.ones(8))) == 8
    ops = _ops_of(device)
    reads = next(i for i, (what, _, _) in enumerate(ops) if what == "kernel mark_updates")
    assert _waits_on(ops[:reads], CONSUMER) and ops[reads][2] == "stream", ops
    assert not TRACE.syncs
    TRACE.reset()
    assert table.update_priorities(s.keys.numpy(), np.ones(8)) == 8
    assert not _waits_on(_ops_of(device), CONSUMER) and "kernel mark_updates" in [w for w, _, _ in _ops_of(device)]


def _first_write(ops):
    """The first kernel that writes a buffer set: the draw (its rows), then the gathers."""
    return next(i for i, (what, _, _) in enumerate(ops) if what in ("kernel draw_items",) or what.startswith("kernel gather_"))


@needs_emulation
@pytest.mark.parametrize("kind_name", ["transition", "sequence"])
def test_emulated_buffers_are_refilled_only_after_their_consumer_released_them(emulated_table, kind_name):
    """A learner reading its batches on a side stream: ``Sample.release(stream)`` records an event
    there, and the batch's set is refilled only after the replay stream waited for it (before the
    draw writes the set), once, with no wait for torch's stream; the other sets are not held back
    by it. A consumer that never releases a batch it was handed (it reads on torch's stream) has
    that set refilled only after the replay stream waited for torch's current stream. Release
    events are made once per (set, stream) and reused. Three sets: two, and one drawn ahead."""
    kind = KINDS[kind_name]
    table, device = emulated_table("uniform", kind, num_buffers=2)
    rec = _fill(table, kind)
    a = table.sample(7)  # set 0 (sets 0 and 1 drawn)
    TRACE.reset()
    a.release(SIDE)  # the consumer queued every read of a on SIDE
    assert _ops_of(device) == [("event.record", 0, SIDE)] and TRACE.events == 1 and not TRACE.syncs
    TRACE.reset()
    b = table.sample(7)  # set 1 (set 2 drawn: a new set, nobody to wait for)
    assert not _waits_on(_ops_of(device), SIDE) and not _waits_on(_ops_of(device), CONSUMER)
    TRACE.reset()
    c = table.sample(7)  # set 2 (set 0, a's, drawn: after SIDE passed a's release; not after torch's stream)
    ops = _ops_of(device)
    (wait,) = _waits_on(ops, SIDE)
    assert wait < _first_write(ops) and not _waits_on(ops, CONSUMER)
    check_batch(c, rec, kind, 2, 7)
    TRACE.reset()
    d = table.sample(7)  # set 0 (set 1, b's, drawn: b was never released: torch's current stream first)
    ops = _ops_of(device)
    assert d.keys.data_ptr() == a.keys.data_ptr() and b.keys.data_ptr() != a.keys.data_ptr()
    (wait,) = _waits_on(ops, CONSUMER)
    assert wait < _first_write(ops) and not _waits_on(ops, SIDE) and device.buffer_sets.consumer_waits == 1
    TRACE.reset()
    c.release(SIDE)  # (set 2, SIDE): a new event; then the default stream: another
    c.release()
    assert TRACE.events == 2
    TRACE.reset()
    table.sample(7)  # set 1 (set 2, c's, drawn: both its releases waited for, torch's stream not as a whole)
    ops = _ops_of(device)
    assert len(_waits_on(ops, SIDE)) == 1 and len(_waits_on(ops, CONSUMER)) == 1
    assert device.buffer_sets.consumer_waits == 1


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
    assert wait < _first_write(ops)
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
    table, device = emulated_table("uniform", KINDS["transition"])
    _fill(table, KINDS["transition"])
    table.sample(4)
    assert all(out.event.block is True for out in device.buffer_sets.sets) and (True, True) in HostCupy.Event.made
    assert device.buffer_sets._consumer_done.block is False  # only ever waited for on the device


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
    # the rare path reads the device (which rows are torn, their slots to evict) and gathers again:
    # more host syncs, every device operation still on the stream
    assert TRACE.syncs.count("event.synchronize") == 2 and "asnumpy" in TRACE.syncs
    assert all(st == "stream" for what, _, st in ops if not what.startswith("host sync")), ops


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


def _draw_rows(cupy, draw_desc, field, dtype, n):
    """The ``field`` array (``n`` of ``dtype``) of a gf_draw descriptor at device pointer
    ``draw_desc``: a view of the device memory (the emulation's host memory, or CuPy's)."""
    from gearflow.native.select import DRAW_FIELDS

    i = DRAW_FIELDS.index(field)
    if isinstance(cupy, HostCupy):
        ptr = ctypes.c_int64.from_address(draw_desc + 8 * i).value
        return np.ctypeslib.as_array((ctypes.c_byte * (n * np.dtype(dtype).itemsize)).from_address(ptr)).view(dtype)
    desc = cupy.ndarray((len(DRAW_FIELDS),), cupy.int64, cupy.cuda.MemoryPointer(
        cupy.cuda.UnownedMemory(draw_desc, 8 * len(DRAW_FIELDS), None), 0))  # fmt: skip
    ptr = int(desc[i].get())
    return cupy.ndarray((n,), dtype, cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(ptr, n * 8, None), 0))


class ImpossibleSelect(CudaSelect):
    """The fused draw returns -1 at row 0 and N at the last row for ``bad_rounds`` draws (what the
    kernel does when rounding at a chunk boundary makes an empty chunk look full)."""

    bad_rounds = 0

    def draw_items(self, replay, draw, count, *, rows=0, u=0, seed=0, counter=0):
        super().draw_items(replay, draw, count, rows=rows, u=u, seed=seed, counter=counter)
        if ImpossibleSelect.bad_rounds > 0:
            ImpossibleSelect.bad_rounds -= 1
            slots = _draw_rows(self.cupy, draw, "slots", np.int64, count)
            parts = _draw_rows(self.cupy, draw, "parts", np.int64, count)
            probs = _draw_rows(self.cupy, draw, "probs", np.float64, count)
            slots[0], parts[0], probs[0] = -1, -1, 0.0
            slots[count - 1], parts[count - 1] = 1 << 40, -1  # a slot past the vector


@needs_emulation
@pytest.mark.parametrize("kind_name", sorted(KINDS))
def test_emulated_impossible_slots_are_redrawn_never_returned(emulated_table, kind_name):
    kind = KINDS[kind_name]
    table, _ = emulated_table("prioritized", kind, select_cls=ImpossibleSelect, ahead=0)
    rec = _fill(table, kind)
    size = table.size
    for rounds in (1, 3):
        ImpossibleSelect.bad_rounds = rounds
        TRACE.reset()
        s = table.sample(9)
        check_batch(s, rec, kind, 2, 9)  # every key a real item, its rows gathered; weights in (0, 1]
        assert torch.isfinite(s.weights).all() and s.weights.max() == 1
        assert sum(what == "kernel draw_items" for what, _, _ in TRACE.ops) == rounds + 1
        assert ImpossibleSelect.bad_rounds == 0
    assert table.size == size and table.torn == 0  # redrawn, not evicted (-1 is no item)
    ImpossibleSelect.bad_rounds = 100
    with pytest.raises(RuntimeError, match=r"outside \[0, \d+\) in 8 redraws in a row"):
        table.sample(9)
    ImpossibleSelect.bad_rounds = 0


def _eight_items(table) -> Recorder:
    """Partition 0 of ``table`` (S=16, R=8) filled: 16 steps, seqs 0..7 one item per step 8..15,
    in slots 0..7, scanned in."""
    rec = Recorder(table.storage, [0])
    for t in range(16):
        rec.append(0)
        if t >= 8:
            rec.item(0, 1)
    table.scan()
    return rec


def check_redraw_keeps_the_records_of_the_rows_not_redrawn(table, device, to_cpu=lambda s: s):
    """The keys invariant on the device path: a torn row is redrawn after a scan that laps the
    record ring, so new items take the slots that other rows of the batch still hold. Those rows
    keep the key they were drawn with, and their rows are that item's (stamp-checked per row).
    ``table``: uniform, transitions, P=1, S=16, R=8, over ``device`` (an OverwritingDeviceReplay)."""
    kind = table.kind
    rec = _eight_items(table)
    assert table.size == 8
    drawn = []
    gather_and_finish = device._gather_and_finish

    def recording(out, num_live):  # each draw's rows as the gather will read them
        device.stream.synchronize()  # the test's own read of the draw (asnumpy runs on another stream)
        drawn.append((device.cupy.asnumpy(out.draw.seqs), device.cupy.asnumpy(out.draw.slots)))
        return gather_and_finish(out, num_live)

    device._gather_and_finish = recording

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
def test_emulated_a_torn_row_of_a_batch_drawn_ahead_evicts_its_item_not_the_slots_new_one(emulated_table):
    """A batch drawn ahead is returned after a later scan. A writer lapped the rings while it was
    gathered: its row 0's item (seq 0) is torn, and by the time it is returned the scan has put a
    new item (seq 8) into that slot. The torn row is redrawn and its item's eviction must not
    evict the new one that holds the slot now (nothing stored is lost)."""
    table, device = emulated_table("uniform", KINDS["transition"], P=1, S=16, R=8, num_buffers=2)
    rec = _eight_items(table)
    gathers = []

    def lap_during_the_batch_drawn_ahead():
        gathers.append(1)
        if len(gathers) == 2:  # the second gather of the first sample: the batch drawn ahead
            for _ in range(9):  # steps 16..24: step 8 (seq 0) overwritten
                rec.append(0)
            rec.item(0, 1)  # seq 8 at step 24: record slot 0

    device.every_gather = lap_during_the_batch_drawn_ahead
    check_batch(table.sample(8), rec, table.kind, 1, 8)  # the first batch: intact
    device.every_gather = None
    s = table.sample(8)  # the batch drawn ahead: row 0 torn (seq 0), slot 0 now holds seq 8
    check_batch(s, rec, table.kind, 1, 8)
    assert table.torn >= 1 and 0 not in s.keys.tolist()
    assert table._slot_seq[0] == 8 and table._slot_live[0]  # seq 8 kept: it was never torn
    assert table.size == 8  # seqs 1..7 and 8


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
        s = sample_after_the_batches_drawn_ahead(restored, 16)
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


def draws_for_every_key(p, min_expected=100, alpha=1e-6):
    """Draws from the distribution ``p`` (any scale) after which every key has been drawn at least
    ``min_expected`` times (what :func:`distribution_mismatch` requires of its reference) except
    with probability ``alpha``: the least likely key's expected count ``m`` solves the Chernoff
    bound ``K · exp(-(1 - min_expected/m)² m / 2) = alpha`` (about 189 for 800 keys). The first
    H200 call sized its draws for an expected 120 and its CPU reference drew a key 90 and 99 times."""
    p = np.asarray(p, np.float64)
    bound = np.log(len(p) / alpha)  # (1 - M/m)² m / 2 >= this
    m = float(min_expected)
    while (1 - min_expected / m) ** 2 * m / 2 < bound:
        m *= 1.01
    return int(np.ceil(m * p.sum() / p.min()))


def check_draw_distribution(table, draw_keys, known, p, batch=1000):
    """``draw_keys(batch)`` (the sampler under test: host int64 keys) against ``table``'s own CPU
    selector, by :func:`distribution_mismatch`, each side drawn :func:`draws_for_every_key` times."""
    batches = -(-draws_for_every_key(p) // batch)
    got = np.zeros(len(known))
    for _ in range(batches):
        got += _key_counts(draw_keys(batch), known)
    return distribution_mismatch(got, _cpu_selector_counts(table, batches * batch, known, batch))


def _draw_test_table(make_table, selector, **kw):
    """About 800 keys of priorities 1..11 over two partitions (the draw-distribution tests)."""
    kind = KINDS["transition"]
    table = make_table(SPEC, P=2, S=512, kind=kind, selector=selector,
                       selector_kwargs={"alpha": 1.0} if selector == "prioritized" else None, **kw)  # fmt: skip
    rec = Recorder(table.storage, [0, 1])
    for stream in (0, 1):
        rec.episode(stream, 400, kind)
    table.scan()
    known = np.array(sorted(rec.key(p, s) for p, s in rec.items))
    p = np.array([rec.items[(k % 2, k // 2)][2] for k in known]) if selector == "prioritized" else np.ones(len(known))
    return table, known, p


@pytest.mark.parametrize("selector", ["uniform", "prioritized"])
def test_the_distribution_test_draws_enough_for_its_power_floor(make_table, selector):
    """The CUDA draw-distribution test's sizing, on the CPU: its own reference (the CPU selector) must
    draw every key >= 100 times, or the check refuses to judge. Here the CPU selector stands in for
    the device too: the sizing lets the check run and pass (with the expected-120 sizing of the
    first H200 call, some key of the 800 falls short almost surely: P(Poisson(120) < 100) ≈ 3 %)."""
    table, known, p = _draw_test_table(make_table, selector)
    assert len(known) >= 790 and draws_for_every_key(np.ones(800)) == pytest.approx(800 * 189, rel=0.02)
    cpu = lambda n: table._slot_seq[s := table.selector.sample(n).slots] * 2 + s // table.storage.items_per_partition
    assert check_draw_distribution(table, cpu, known, p) is None


def _key_counts(keys, known):
    """Counts of ``keys`` per key of the sorted array ``known`` (every key must be known)."""
    keys = np.asarray(keys, dtype=np.int64)
    at = np.minimum(np.searchsorted(known, keys), len(known) - 1)
    assert (known[at] == keys).all(), f"unknown keys drawn: {sorted(set(keys[known[at] != keys].tolist()))[:5]}"
    return np.bincount(at, minlength=len(known)).astype(np.float64)


def _cpu_selector_counts(table, draws, known, batch=1000):
    """Counts per key of ``draws`` draws by the table's own selector on the CPU (the reference; a
    device table's: a CPU copy of its DeviceSelector, the priorities read back from the device)."""
    sel = table.selector.host_selector() if hasattr(table.selector, "host_selector") else table.selector
    P, R = table.storage.num_partitions, table.storage.items_per_partition
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
def test_cuda_write_back_of_cuda_tensors_reads_nothing_on_the_host_and_takes(make_table):
    """The learner's write-back on a GPU: CUDA keys (the batch's own) and priorities computed on
    torch's stream behind a long kernel, handed over as they are. torch's sync debug mode raises
    on any synchronizing torch call in it (a .cpu(), .item() or pageable copy); the call returns
    while the kernel still runs (nothing waited for it), and the batches drawn after it follow
    the new priorities."""
    kind = KINDS["transition"]
    table, rec = _stamp_table(make_table, kind)
    s = table.sample(24)
    hot = int(s.keys[0])  # a read for the test's own check, before the measured call
    torch.cuda._sleep(BUSY_CYCLES)  # the learner's step still running ...
    prios = torch.where(s.keys == hot, 1e6, 1e-6).float()  # ... and its priorities queued behind it
    torch.cuda.set_sync_debug_mode("error")
    try:
        assert table.update_priorities(s.keys, prios) == 24
        s.release()
        busy = not torch.cuda.current_stream().query()  # cudaStreamQuery: no wait
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert busy  # the learner's kernel still ran: the write-back did not wait for it on the host
    check_batch(_cpu(s), rec, kind, 2, 24)
    later = sample_after_the_batches_drawn_ahead(table, 24)
    assert (later.keys == hot).sum() >= 20


@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize("selector", ["uniform", "prioritized"])
def test_cuda_draw_distribution_matches_the_cpu_selector(make_table, selector):
    """Device draws through ``Table(device="cuda")`` against the table's own CPU selector, by the
    power-checked :func:`distribution_mismatch` (about 800 keys; :func:`draws_for_every_key`
    draws on each side, so the reference draws every key >= 100 times and a never-drawn key
    fails with z >= 10)."""
    table, known, p = _draw_test_table(make_table, selector, device="cuda")
    why = check_draw_distribution(table, lambda n: table.sample(n).keys.cpu().numpy(), known, p)
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
    mine = lambda: {n for n, owner, _ in list_segments() if owner == os.getpid()}  # others' tests share /dev/shm
    before = mine()
    with pytest.raises(MissingDependencyError, match=r"^replay.device=cuda needs CuPy"):
        restore_checkpoint(tmp_path / "replay", device="cuda")
    assert mine() == before  # the new segment was unlinked
    restored = restore_checkpoint(tmp_path / "replay")  # the checkpoint is intact for a CPU restore
    restored.close()


@needs_emulation
def test_emulated_bench_cuda_select_part_runs_and_checks_its_kernels(emulated_kernels, monkeypatch):
    """``gearflow bench replay --device cuda``'s ``select`` part (the device replay's sample and
    write-back by key against the CPU selector's) on the CuPy emulation at a smoke size: it runs,
    its own checks of the kernels pass, every record has its floor. (Its times here are the
    emulation's; only a GPU call measures.)"""
    import argparse

    from gearflow.bench import replay_cuda
    from gearflow.native import bench_cuda

    _, select_module = emulated_kernels
    real_select, real_args = bench_cuda.CudaSelect, replay_cuda._native_args
    monkeypatch.setattr(bench_cuda, "CudaSelect", lambda cupy: real_select(cupy, TracedModule(select_module)))
    monkeypatch.setattr(replay_cuda, "_native_args", lambda scale: argparse.Namespace(
        **{**vars(real_args(scale)), "repeats": 1, "sizes": [5000], "batch": 16}))  # fmt: skip
    rows, failures = [], []
    replay_cuda.select(rows.append, HostCupy(), 0.01, failures)
    assert failures == []
    by = {r["metric"]: r for r in rows}
    N = 5000 // 8 * 8
    assert by[f"sample_us_at_{N}_items"]["floor"] == by["cpu_selector_sample_us_at_5000_items"]["value"] > 0
    assert by[f"update_us_at_{N}_items"]["floor"] == by["cpu_selector_update_us_at_5000_items"]["value"] > 0
    assert by[f"sample_us_at_{N}_items"]["value"] > 0 and by[f"update_us_at_{N}_items"]["value"] > 0


@needs_emulation
def test_emulated_bench_cuda_table_part_runs_and_verifies_every_row(emulated_device):
    """``gearflow bench replay --device cuda``'s ``Table(device="cuda")`` part (the H200 call:
    ``stamp_obs`` handed one column instead of the chunk, ``verify_stamps`` called without the
    writer's bases and reading CUDA keys with ``.numpy()``), run on the CuPy emulation at a
    smoke scale: every sampled row verified, every record well formed."""
    from gearflow.bench import replay_cuda

    rows, failures = [], []
    replay_cuda.table(rows.append, None, 0.01, failures, device=emulated_device)
    assert failures == []
    by = {r["metric"]: r for r in rows}
    assert by["torn_or_corrupt_rows_returned"]["value"] == 0
    assert by["sample_GB_per_s"]["value"] > 0 and by["sample_GB_per_s"]["floor"] > 0
    assert by["priority_updates_per_s"]["value"] > 0 and by["sample_us_at_1000_items"]["value"] > 0
    assert all(r["bench"] == "replay" and r["workload"] == "cuda_table" for r in rows)
