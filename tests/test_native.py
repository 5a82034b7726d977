"""gearflow.native: the CUDA replay kernels, their CPU references and the Python around them.

Tiers:

* nvcc (wherever the compiler exists, no GPU needed): every ``kernels/*.cu``
  compiles to PTX for sm_80 and sm_90; the entry points the wrappers launch
  exist, and each launch's argument list matches the kernel's parameter list
  (count and byte size, int vs float) read from the PTX.
* CPU: the numpy references against straightforward numpy (ring-end windows,
  padding and mask, unaligned row widths, transitions, torn flags, prioritized
  distribution and IS weights against ``PrioritizedSelector``), and the CUDA
  wrappers' argument checking and launch geometry with a recording stand-in
  for CuPy's ``RawModule`` (STYLE 6: the native handle is injected).
* CUDA (``-m cuda``; skipped with the reason unless CuPy can run a kernel):
  the kernels against the references on random inputs, reading a registered
  shared-memory segment in place; selection distribution; registration round trip.
"""

from __future__ import annotations

import ctypes
import doctest
import mmap
import platform
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import gearflow.native.gather as gather_mod
import gearflow.native.select as select_mod
from gearflow.native import probe_cupy
from gearflow.native.cuda_backend import KERNEL_DIR, check_device, device_array
from gearflow.native.gather import (
    CudaGather,
    gather_rows,
    gather_windows,
    plan_gather,
    torn_items,
    transition_rows,
)
from gearflow.native.hostmem import (
    PAGE_SIZE,
    HostRegistration,
    buffer_address,
    register_host,
    register_storage,
)
from gearflow.native.select import (
    CHUNK,
    CudaSelect,
    draw_items,
    importance_weights,
    num_chunks,
    sample_proportional,
    sample_uniform,
    sum_chunks,
    top_k,
    update_by_key,
    update_priorities,
)
from gearflow.replay.selectors import make_selector

NVCC = shutil.which("nvcc")
ARCHES = ("sm_80", "sm_90")
CUPY = probe_cupy()
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH")
needs_cupy = pytest.mark.skipif(not CUPY.ok, reason=f"needs CuPy and a CUDA GPU: {CUPY.detail}")


# ============================================================================ nvcc
@pytest.fixture(scope="module")
def ptx(tmp_path_factory):
    """{arch: {stem: PTX text}}: every .cu compiled with nvcc --ptx, the two arches in parallel."""
    sources = sorted(KERNEL_DIR.glob("*.cu"))
    assert sources, f"no .cu sources in {KERNEL_DIR}"
    procs = {}
    t0 = time.perf_counter()
    for arch in ARCHES:
        out = tmp_path_factory.mktemp(f"ptx_{arch}")
        cmd = [NVCC, "--ptx", f"-arch={arch}", "--Werror", "all-warnings", "-odir", str(out), *map(str, sources)]
        procs[arch] = (out, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    result = {}
    for arch, (out, proc) in procs.items():
        stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, f"nvcc --ptx -arch={arch} failed:\n{stderr}\n{stdout}"
        result[arch] = {src.stem: (out / f"{src.stem}.ptx").read_text() for src in sources}
    print(f"nvcc: {len(sources)} sources x {len(ARCHES)} arches in {time.perf_counter() - t0:.1f} s")
    return result


def ptx_params(text: str) -> dict[str, list[str]]:
    """Entry name -> PTX parameter types (e.g. ['u64', 'u32', 'f64'])."""
    return {
        m.group(1): re.findall(r"\.param\s+\.(\w+)", m.group(2))
        for m in re.finditer(r"\.entry\s+(\w+)\s*\((.*?)\)", text, re.DOTALL)
    }


@needs_nvcc
def test_every_kernel_source_compiles_to_ptx_for_sm80_and_sm90(ptx):
    for arch in ARCHES:
        for stem, text in ptx[arch].items():
            assert f".target {arch}" in text, f"{stem}.cu for {arch}: unexpected target"
            assert ".entry" in text, f"{stem}.cu for {arch}: no kernel entry"


@needs_nvcc
def test_wrappers_launch_only_kernels_the_sources_define(ptx):
    for arch in ARCHES:
        assert set(ptx_params(ptx[arch]["gather"])) == set(gather_mod.KERNELS)
        assert set(ptx_params(ptx[arch]["select"])) == set(select_mod.KERNELS)


def test_python_constants_match_the_kernel_sources():
    gather_src = (KERNEL_DIR / "gather.cu").read_text()
    select_src = (KERNEL_DIR / "select.cu").read_text()
    define = lambda src, name: re.search(rf"#define\s+{name}\s+(.+)", src).group(1).strip()
    assert int(define(gather_src, "GF_GATHER_THREADS")) == gather_mod.THREADS
    assert int(define(select_src, "GF_THREADS")) == select_mod.THREADS
    assert int(define(select_src, "GF_PER_THREAD")) == select_mod.PER_THREAD
    assert define(select_src, "GF_CHUNK") == "(GF_THREADS * GF_PER_THREAD)"
    assert not re.search(r"^\s*#\s*include", gather_src + select_src, re.MULTILINE)  # NVRTC: no host headers


# ============================================================================ stand-in for CuPy (CPU)
class FakeDeviceArray(np.ndarray):
    """A host array that presents the CUDA Array Interface: lets the wrappers run on a CPU.
    Kernels never run on it (the module below only records launches)."""

    @property
    def __cuda_array_interface__(self):
        iface = self.__array_interface__
        return {"shape": self.shape, "typestr": self.dtype.str, "data": iface["data"],
                "strides": iface["strides"], "version": 3}  # fmt: skip


def dev(a) -> FakeDeviceArray:
    a = np.asarray(a)
    return (a if a.flags.c_contiguous else a.copy()).view(FakeDeviceArray)  # 0-d stays 0-d


class RecordingModule:
    """Stands in for a ``cupy.RawModule``: records (kernel, grid, block, args)."""

    def __init__(self):
        self.launches = []

    def get_function(self, name):
        def kernel(grid, block, args):
            self.launches.append((name, tuple(grid), tuple(block), tuple(args)))

        return kernel


class FakeCupy:
    """The few CuPy calls the wrappers make, on host arrays that present the CUDA Array Interface."""

    float64, float32, int64, int32, uint64, uint8, bool_ = (
        np.float64, np.float32, np.int64, np.int32, np.uint64, np.uint8, np.bool_,
    )  # fmt: skip

    def __init__(self):
        self.uploads = 0

    def asarray(self, x):
        if isinstance(x, FakeDeviceArray):
            return x
        self.uploads += 1
        return dev(np.array(x))

    def empty(self, shape, dtype):
        return dev(np.empty(shape, dtype))

    def zeros(self, shape, dtype):
        return dev(np.zeros(shape, dtype))

    def __getattr__(self, name):  # clip, arange, argsort, argpartition: numpy's
        return getattr(np, name)


@pytest.fixture
def fake():
    cp, module = FakeCupy(), RecordingModule()
    return cp, module, CudaGather(cp, module), CudaSelect(cp, module)


def exercise_every_kernel(g: CudaGather, s: CudaSelect) -> None:
    """Calls that between them launch every kernel variant (for the ABI check)."""
    base = dev(np.zeros(64 * 64 + 16, np.uint8))
    for row_bytes, offset in ((16, 0), (8, 0), (12, 0), (33, 0), (16, 1), (100, 1)):
        B, T = 3, 4
        n = B * T * row_bytes
        dst = base[offset : offset + n].reshape(B, T, row_bytes)
        mask = dev(np.zeros((B, T), bool))
        g.gather_windows(4096, row_bytes, 8, [0, 1, 0], [0, 7, 30], np.array([4, 2, 0], np.int32), T,
                         dst, mask, num_rows=16)  # fmt: skip
        g.gather_rows(4096, row_bytes, [0, 5, 15], base[offset : offset + 3 * row_bytes].reshape(3, row_bytes),
                      num_rows=16)  # fmt: skip
        g.gather_stacks(4096, row_bytes, 8, 2, 8192, [0, 1, 0], [0, 7, 30], np.array([4, 2, 0], np.int32), T,
                        base[offset : offset + 2 * n].reshape(B, T, 2, row_bytes), num_rows=16)  # fmt: skip
    masses = dev(np.zeros(5000))
    sums = dev(np.zeros(num_chunks(5000)))
    s.sum_chunks(masses, sums)
    s.update_priorities(masses, [1, 2, 1], [0.5, 1.0, 2.0], 0.6, chunk_sums=sums)
    s.update_priorities(masses, dev(np.array([3], np.int64)), dev(np.array([1.0], np.float32)), 0.6)
    s.sample_proportional(masses, np.random.default_rng(0).random(4))
    s.sample_uniform(10, np.random.default_rng(0).random(4), live_slots=np.arange(10))
    s.importance_weights(np.full(4, 0.25), 10, 0.4)
    # the device replay's: pointers only (descriptors, scratch)
    s.draw_items(0x1000, 0x2000, 4, rows=0x3000, u=0x4000, seed=2**63 + 5, counter=7)
    s.finish_batch(0x1000, 0x2000, 4, 100, 0.4)
    for f32 in (False, True):
        s.update_by_key(0x1000, 0x5000, 0x6000, 8, f32, 3 << 32, 0.6, 0x7000, 0x8000, 5000, 0x9000, 2)
    s.apply_ingest(0x1000, 0xA000, 3, 0.6, ((0x8000, 0x9000, 5000, 2),))


@needs_nvcc
def test_every_launch_matches_the_kernel_parameters_in_the_ptx(ptx, fake):
    _, module, g, s = fake
    exercise_every_kernel(g, s)
    params = {**ptx_params(ptx["sm_90"]["gather"]), **ptx_params(ptx["sm_90"]["select"])}
    launched = set()
    for name, grid, block, args in module.launches:
        types = params[name]
        assert len(args) == len(types), f"{name}: {len(args)} args for {len(types)} parameters"
        for i, (arg, t) in enumerate(zip(args, types)):
            a = np.asarray(arg)
            assert a.shape == (), f"{name} arg {i}: not a scalar"
            assert a.itemsize == int(re.sub(r"\D", "", t)) // 8, f"{name} arg {i}: {a.dtype} for .{t}"
            assert (a.dtype.kind == "f") == t.startswith("f"), f"{name} arg {i}: {a.dtype} for .{t}"
        assert np.prod(block) <= 256 and all(x >= 1 for x in grid)
        launched.add(name)
    assert launched == set(gather_mod.KERNELS) | set(select_mod.KERNELS)


# ============================================================================ gather: CPU reference
def column(rng, num_rows: int, row_bytes: int) -> np.ndarray:
    """A column of ``num_rows`` rows of ``row_bytes`` random bytes, with a dtype that fits the width."""
    dtype = np.float32 if row_bytes % 4 == 0 else np.uint8
    width = row_bytes // np.dtype(dtype).itemsize
    return rng.integers(0, 256, size=num_rows * row_bytes, dtype=np.uint8).view(dtype).reshape(num_rows, width)


def naive_windows(col, S, parts, starts, lengths, T):
    B = len(parts)
    out = np.zeros((B, T, *col.shape[1:]), col.dtype)
    mask = np.zeros((B, T), bool)
    for b in range(B):
        for j in range(T):
            if j < lengths[b]:
                out[b, j] = col[parts[b] * S + (starts[b] + j) % S]
                mask[b, j] = True
    return out, mask


@pytest.mark.parametrize("row_bytes", [1, 12, 16, 28, 33, 68])
def test_reference_windows_wrap_pad_and_mask_like_naive_numpy(row_bytes):
    rng = np.random.default_rng(row_bytes)
    P, S, T, B = 3, 20, 7, 64
    col = column(rng, P * S, row_bytes)
    parts = rng.integers(0, P, B)
    starts = rng.integers(0, 5 * S, B)
    starts[:8] = S * rng.integers(1, 4, 8) - rng.integers(1, T, 8)  # windows at the ring's end: wrap
    lengths = rng.integers(0, T + 1, B).astype(np.int32)
    lengths[:4] = T
    out = np.full((B, T, *col.shape[1:]), 7, col.dtype)  # stale bytes must be overwritten
    mask = np.zeros((B, T), bool)
    gather_windows(col, row_bytes, S, parts, starts, lengths, T, out, mask)
    want, want_mask = naive_windows(col, S, parts, starts, lengths, T)
    assert np.array_equal(mask, want_mask)
    assert out.tobytes() == want.tobytes()
    assert not out.view(np.uint8)[~mask].any()  # padding is zeros, bit for bit


def test_reference_windows_write_into_a_differently_typed_or_torch_buffer():
    import torch

    rng = np.random.default_rng(1)
    col = column(rng, 40, 12)  # float32[3] rows
    out = torch.empty((2, 5, 12), dtype=torch.uint8)  # raw bytes
    mask = torch.empty((2, 5), dtype=torch.bool)
    gather_windows(col, 12, 20, [1, 0], [18, 3], np.array([5, 2], np.int32), 5, out, mask)
    want, want_mask = naive_windows(col, 20, [1, 0], [18, 3], [5, 2], 5)
    assert out.numpy().tobytes() == want.tobytes() and np.array_equal(mask.numpy(), want_mask)


@pytest.mark.parametrize("row_bytes", [4, 12, 28, 33])
def test_reference_rows_give_transitions_first_and_last_steps(row_bytes):
    rng = np.random.default_rng(7)
    P, S, B = 2, 16, 50
    col = column(rng, P * S, row_bytes)
    parts = rng.integers(0, P, B)
    starts = rng.integers(0, 4 * S, B)
    lengths = rng.integers(1, 6, B)
    first, last = transition_rows(parts, starts, lengths, S)
    assert np.array_equal(first, [p * S + s % S for p, s in zip(parts, starts)])
    assert np.array_equal(last, [p * S + (s + n - 1) % S for p, s, n in zip(parts, starts, lengths)])
    for rows in (first, last):
        out = np.empty((B, *col.shape[1:]), col.dtype)
        gather_rows(col, row_bytes, rows, out)
        assert out.tobytes() == col[rows].tobytes()
    # a transition is the T=1 window at its first step
    win, mask = np.empty((B, 1, *col.shape[1:]), col.dtype), np.empty((B, 1), bool)
    gather_windows(col, row_bytes, S, parts, starts, np.ones(B, np.int32), 1, win, mask)
    assert win[:, 0].tobytes() == col[first].tobytes() and mask.all()


def test_reference_gather_rejects_bad_arguments_naming_them():
    col = np.zeros((40, 3), np.float32)
    out, mask = np.zeros((2, 4, 3), np.float32), np.zeros((2, 4), bool)
    ok = {"src_base": col, "row_bytes": 12, "S": 20, "parts": [0, 1], "starts": [0, 5],
          "lengths": np.array([4, 1], np.int32), "T": 4, "dst": out, "mask": mask}  # fmt: skip
    gather_windows(**ok)
    for change, word in [
        ({"row_bytes": 16}, "row_bytes"),
        ({"S": 0}, "S"),
        ({"S": 7}, "S=7"),
        ({"parts": [0, 2]}, "parts"),
        ({"parts": [[0, 1]]}, "parts"),
        ({"parts": [0.0, 1.0]}, "parts"),
        ({"starts": [0, -1]}, "starts"),
        ({"starts": [0]}, "starts"),
        ({"lengths": np.array([5, 1], np.int32)}, "lengths"),
        ({"dst": np.zeros((2, 3, 3), np.float32)}, "dst"),
        ({"dst": np.zeros((2, 4, 3), np.float32)[:, ::-1]}, "dst"),
        ({"mask": np.zeros((2, 4), np.uint8)}, "mask"),
        ({"src_base": np.zeros((40, 2), np.float32)}, "row_bytes"),
        ({"src_base": np.zeros((3, 40), np.float32).T}, "src_base"),
        ({"T": 0}, "T"),
    ]:
        with pytest.raises(ValueError, match=word):
            gather_windows(**{**ok, **change})
    with pytest.raises(ValueError, match="num_rows"):
        gather_windows(**ok, num_rows=39)
    with pytest.raises(ValueError, match="rows"):
        gather_rows(col, 12, [0, 40], np.zeros((2, 3), np.float32))


def test_torn_flags_follow_the_tables_seqlock_rule():
    rng = np.random.default_rng(3)
    P, S, B = 4, 100, 500
    reserve = rng.integers(0, 1000, P)
    parts = rng.integers(0, P, B)
    starts = rng.integers(0, 1000, B)
    flags = torn_items(parts, starts, reserve, S)
    assert flags.dtype == bool
    assert flags.tolist() == [bool(s < reserve[p] - S) for p, s in zip(parts, starts)]
    assert 0 < flags.sum() < B
    with pytest.raises(ValueError, match="starts"):
        torn_items(parts, starts[:-1], reserve, S)
    with pytest.raises(ValueError, match="reserve"):
        torn_items(parts, starts, reserve.astype(float), S)


# ============================================================================ gather: wrapper logic (CPU)
def test_plan_picks_the_widest_load_all_three_pointers_allow_or_the_any_alignment_variant():
    """Small rows take the widest load their alignment allows; rows of >= 64 bytes that are not all
    16-byte aligned (the H200's 28225-byte rows ran at 0.44x the link on byte loads) take _va:
    16-byte loads at any alignment. Stacks keep their widths."""
    assert plan_gather("windows", 28224, 10, 4096, 512).kernel == "gather_windows_v16"
    assert plan_gather("windows", 28224, 10, 4096, 516).kernel == "gather_windows_va"  # dst only 4-byte aligned
    assert plan_gather("windows", 28224, 10, 4100, 512).kernel == "gather_windows_va"  # src only 4-byte aligned
    assert plan_gather("rows", 28225, 10, 4096, 512).kernel == "gather_rows_va"  # rows at every offset mod 16
    assert plan_gather("rows", 8, 10, 4096, 512).kernel == "gather_rows_v8"
    assert plan_gather("rows", 12, 10, 4096, 512).width == 4
    assert plan_gather("rows", 28, 10, 4096, 512).width == 4
    assert plan_gather("rows", 33, 10, 4096, 512).width == 1
    assert plan_gather("stacks", 7057, 10, 4096, 512).kernel == "gather_stacks_v1"
    assert plan_gather("rows", 28224, 10, 4096, 512, piece=4096).pieces == 7
    with pytest.raises(ValueError, match="kind"):
        plan_gather("cols", 8, 1, 0, 0)
    with pytest.raises(ValueError, match="multiple of the load width 16"):
        plan_gather("rows", 28225, 10, 4096, 512, piece=100)


@pytest.mark.parametrize("row_bytes", [1, 4, 12, 16, 28, 33, 1000, 28224, 28225, 10**6])
def test_plan_geometry_covers_every_piece_of_every_row_with_256_thread_blocks(row_bytes):
    for rows in (1, 7, 256 * 80, 10**6):
        p = plan_gather("windows", row_bytes, rows, 0, 0)
        tx, ty, tz = p.block
        assert tx * ty * tz == 256 and tz == 1
        assert p.units == -(-row_bytes // p.width) and p.pieces == -(-row_bytes // p.piece)
        assert tx >= min(-(-min(p.piece, row_bytes) // p.width), 256) and tx & (tx - 1) == 0
        assert 1 <= p.grid[0] <= 65535 and p.grid[1:] == (1, 1)
        assert p.grid[0] * ty >= rows * p.pieces or p.grid[0] == 65535  # the rest is grid-stride


def test_cuda_gather_checks_arguments_before_any_launch(fake):
    cp, module, g, _ = fake
    dst, mask = dev(np.zeros((2, 4, 12), np.uint8)), dev(np.zeros((2, 4), bool))
    ok = {"src_base": 4096, "row_bytes": 12, "S": 8, "parts": [0, 1], "starts": [0, 9],
          "lengths": np.array([4, 2], np.int32), "T": 4, "dst": dst, "mask": mask, "num_rows": 16}  # fmt: skip
    for change, word in [
        ({"src_base": dst}, "src_base"),
        ({"src_base": 0}, "src_base"),
        ({"num_rows": None}, "num_rows"),
        ({"num_rows": 15}, "num_rows"),
        ({"parts": [0, 2]}, "parts"),
        ({"lengths": np.array([4, 5], np.int32)}, "lengths"),
        ({"lengths": np.array([4, -1], np.int32)}, "lengths"),
        ({"parts": dev(np.array([0, 1], np.int32))}, "parts must have dtype int64"),
        ({"lengths": dev(np.array([4, 2], np.int64))}, "lengths must have dtype int32"),
        ({"starts": dev(np.array([0, 9, 1], np.int64))}, "starts"),
        ({"dst": np.zeros((2, 4, 12), np.uint8)}, "dst must be a device array"),
        ({"dst": dev(np.zeros((2, 4, 11), np.uint8))}, "dst"),
        ({"dst": dev(np.zeros((4, 2, 12), np.uint8))}, "dst"),
        ({"dst": dev(np.zeros((2, 4, 24), np.uint8))[:, :, ::2]}, "dst must be C-contiguous"),
        ({"mask": dev(np.zeros((2, 4), np.uint8))}, "mask"),
        ({"mask": dev(np.zeros((2, 5), bool))}, "mask"),
        ({"T": True}, "T"),
    ]:
        with pytest.raises(ValueError, match=word):
            g.gather_windows(**{**ok, **change})
    assert module.launches == [] and cp.uploads == 0
    with pytest.raises(ValueError, match="rows"):
        g.gather_rows(4096, 12, [0, 16], dev(np.zeros((2, 12), np.uint8)), num_rows=16)
    with pytest.raises(ValueError, match="dst"):
        g.gather_rows(4096, 12, [0, 1], dev(np.zeros((2, 13), np.uint8)), num_rows=16)
    assert module.launches == []


def test_cuda_gather_launch_uploads_host_indices_and_passes_device_ones(fake):
    cp, module, g, _ = fake
    B, T, row_bytes = 5, 80, 28224
    dst = dev(np.zeros((B, T, 4, 84, 84), np.uint8))  # any dtype/shape with [B, T] leading and row_bytes rows
    mask = dev(np.zeros((B, T), bool))
    plan = g.gather_windows(1 << 20, row_bytes, 100, [0, 1, 2, 0, 1], [0, 95, 300, 7, 1], np.full(B, T, np.int32),
                            T, dst, mask, num_rows=300)  # fmt: skip
    assert cp.uploads == 3
    (name, grid, block, args), = module.launches
    assert name == plan.kernel == "gather_windows_v16" and block == (256, 1, 1) and grid == (4 * B * T, 1, 1)
    assert int(args[3]) == 3 and int(args[11]) == 8192  # num_parts = num_rows / S; 8 KiB pieces (4 per row)
    assert int(args[9]) == device_array(dst, "dst").ptr and int(args[10]) == device_array(mask, "mask").ptr
    parts = dev(np.array([0, 1, 2, 0, 1], np.int64))
    g.gather_windows(1 << 20, row_bytes, 100, parts, dev(np.zeros(B, np.int64)), dev(np.ones(B, np.int32)),
                     T, dst, mask, num_rows=300)  # fmt: skip
    assert cp.uploads == 3 and int(module.launches[-1][3][4]) == parts.ctypes.data
    assert g.gather_windows(1 << 20, 12, 8, [], [], [], 3, dev(np.zeros((0, 3, 12), np.uint8)),
                            dev(np.zeros((0, 3), bool)), num_rows=8) is None  # fmt: skip
    assert len(module.launches) == 2


def test_check_device_reports_dtype_shape_and_layout():
    a = dev(np.zeros((3, 4), np.float32))
    assert check_device(a, "x", dtype=np.float32, shape=(3, -1)).shape == (3, 4)
    with pytest.raises(ValueError, match=r"x must have shape \(3, 5\)"):
        check_device(a, "x", shape=(3, 5))
    with pytest.raises(ValueError, match="x must have dtype float64"):
        check_device(a, "x", dtype=np.float64)
    with pytest.raises(ValueError, match="x must be C-contiguous"):
        check_device(a.T, "x")
    with pytest.raises(ValueError, match="x must be a device array"):
        check_device(np.zeros(3), "x")


# ============================================================================ selection: CPU reference
def straightforward_draws(masses, u):
    """cumsum over all masses; the last nonzero slot whose exclusive prefix <= target."""
    incl = np.cumsum(masses)
    total = incl[-1]
    B = len(u)
    targets = np.clip((np.arange(B) + u) * (total / B), 0, total)
    excl = incl - masses
    out = []
    for t in targets:
        ok = np.flatnonzero((masses > 0) & (excl <= t))
        out.append(ok[-1])
    return np.array(out), masses[out] / total


@pytest.mark.parametrize("n", [1, 37, CHUNK, 3 * CHUNK + 5])
def test_reference_proportional_draws_match_a_flat_cumsum_search(n):
    rng = np.random.default_rng(n)
    masses = rng.random(n) ** 3
    masses[rng.random(n) < 0.3] = 0.0
    if n > 10:
        masses[CHUNK : 2 * CHUNK] = 0.0  # a whole empty chunk to step over
    masses[-1] = 0.0 if n > 1 else 1.0  # trailing zero mass: never picked
    for B in (1, 64, 1000):
        u = rng.random(B)
        slots, probs = sample_proportional(masses, u)
        want, want_probs = straightforward_draws(masses, u)
        assert np.array_equal(slots, want)
        np.testing.assert_allclose(probs, want_probs, rtol=1e-12)
        assert (masses[slots] > 0).all()
    # edges: u -> 1 and u == 0 stay on nonzero mass
    for u in (np.zeros(8), np.full(8, np.nextafter(1.0, 0.0))):
        slots, _ = sample_proportional(masses, u)
        assert (masses[slots] > 0).all()


def test_reference_matches_prioritized_selector_draw_for_draw():
    rng = np.random.default_rng(11)
    N, B, alpha, beta, seed = 3 * CHUNK + 100, 256, 0.6, 0.4, 1234
    priorities = rng.random(N) * 10
    priorities[rng.random(N) < 0.2] = 0.0
    sel = make_selector("prioritized", N, seed=seed, alpha=alpha, beta=beta)
    sel.insert(np.arange(N), priorities, np.arange(N))
    masses, sums = np.zeros(N), np.zeros(num_chunks(N))
    assert update_priorities(masses, np.arange(N), priorities, alpha, chunk_sums=sums) == 0
    np.testing.assert_allclose(sums, sum_chunks(masses), rtol=1e-12)
    u_rng = np.random.default_rng(seed)  # the selector's generator, same seed, same draws
    for _ in range(3):
        want = sel.sample(B)
        slots, probs = sample_proportional(masses, u_rng.random(B), chunk_sums=sums)
        assert np.array_equal(slots, want.slots)
        np.testing.assert_allclose(probs, want.probabilities, rtol=1e-10)
        weights = importance_weights(probs, N, beta)
        assert weights.dtype == np.float32
        np.testing.assert_allclose(weights, want.weights, rtol=1e-6)


def test_reference_draw_frequencies_are_proportional_to_p_alpha():
    rng = np.random.default_rng(5)
    N, alpha, B, rounds = 40, 0.7, 64, 400
    priorities = rng.random(N) * 5
    priorities[:5] = 0.0
    masses = np.zeros(N)
    update_priorities(masses, np.arange(N), priorities, alpha)
    expected_p = np.where(priorities > 0, priorities**alpha, 0) / np.where(priorities > 0, priorities**alpha, 0).sum()
    counts = np.zeros(N)
    for _ in range(rounds):
        slots, probs = sample_proportional(masses, rng.random(B))
        np.testing.assert_allclose(probs, expected_p[slots], rtol=1e-12)
        counts += np.bincount(slots, minlength=N)
    assert counts[:5].sum() == 0  # zero priority: never drawn
    draws = B * rounds
    live = expected_p > 0
    chi2 = (((counts - draws * expected_p) ** 2)[live] / (draws * expected_p[live])).sum()
    df = live.sum() - 1
    assert chi2 < df + 6 * np.sqrt(2 * df), chi2  # stratified draws only make it smaller


def test_reference_importance_weights_follow_the_formula():
    rng = np.random.default_rng(2)
    probs = rng.random(100) / 100
    for beta in (0.0, 0.4, 1.0):
        w = importance_weights(probs, 1000, beta)
        raw = (1000 * probs) ** -beta
        np.testing.assert_allclose(w, raw / raw.max(), rtol=1e-6)
        assert w.max() == 1.0
    with pytest.raises(ValueError, match="beta"):
        importance_weights(probs, 10, -1)
    with pytest.raises(ValueError, match="num_live"):
        importance_weights(probs, 0, 0.4)


def test_reference_update_last_repeat_wins_and_invalid_values_are_counted():
    masses, sums = np.zeros(2 * CHUNK), np.zeros(2)
    slots = np.array([3, CHUNK + 1, 3, 2 * CHUNK, -1, 7, 7])
    prios = np.array([1.0, 4.0, 9.0, 1.0, 1.0, np.nan, 2.0])
    assert update_priorities(masses, slots, prios, 0.5, chunk_sums=sums) == 2  # 2*CHUNK and -1
    assert masses[3] == 3.0 and masses[CHUNK + 1] == 2.0 and masses[7] == 2.0**0.5
    np.testing.assert_allclose(sums, sum_chunks(masses))
    assert update_priorities(masses, [7, 8, 9], [np.nan, -1.0, np.inf], 1.0, chunk_sums=sums) == 3
    assert masses[7:10].tolist() == [0.0, 0.0, 0.0]
    update_priorities(masses, [3, 4], [0.0, 5.0], 0.0, chunk_sums=sums)  # alpha 0: positive weighs 1
    assert masses[3] == 0.0 and masses[4] == 1.0
    np.testing.assert_allclose(sums, sum_chunks(masses))  # kept current through every update
    with pytest.raises(ValueError, match="priorities"):
        update_priorities(masses, [1, 2], [1.0], 0.5)
    with pytest.raises(ValueError, match="slots"):
        update_priorities(masses, [1.5], [1.0], 0.5)
    with pytest.raises(ValueError, match="alpha"):
        update_priorities(masses, [1], [1.0], -0.5)
    with pytest.raises(ValueError, match="chunk_sums"):
        update_priorities(masses, [1], [1.0], 0.5, chunk_sums=np.zeros(3))
    with pytest.raises(ValueError, match="masses"):
        update_priorities(masses.astype(np.float32), [1], [1.0], 0.5)


def test_reference_uniform_top_k_and_empty_mass():
    u = np.array([0.0, 0.5, np.nextafter(1.0, 0.0)])
    slots, probs = sample_uniform(4, u)
    assert slots.tolist() == [0, 2, 3] and np.allclose(probs, 0.25)
    slots, _ = sample_uniform(2, u, live_slots=np.array([10, 20, 30]))
    assert slots.tolist() == [10, 20, 20]
    with pytest.raises(ValueError, match="live_slots"):
        sample_uniform(4, u, live_slots=np.array([1, 2]))
    values = np.random.default_rng(0).permutation(100).astype(float)
    assert top_k(values, 5).tolist() == np.argsort(-values)[:5].tolist()
    assert sorted(top_k(values, 500).tolist()) == list(range(100))
    slots, probs = sample_proportional(np.zeros(10), np.full(3, 0.5))  # no mass: -1, probability 0
    assert slots.tolist() == [-1, -1, -1] and probs.tolist() == [0, 0, 0]


# ============================================================================ selection: wrapper logic (CPU)
def test_cuda_select_checks_arguments_and_queues_a_sample_as_three_launches(fake):
    _, module, _, s = fake
    masses, sums = dev(np.zeros(10_000)), dev(np.zeros(num_chunks(10_000)))
    for call, word in [
        (lambda: s.sample_proportional(np.zeros(10), [0.5]), "masses must be a device array"),
        (lambda: s.sample_proportional(dev(np.zeros(10, np.float32)), [0.5]), "masses must have dtype float64"),
        (lambda: s.sample_proportional(masses, []), "u"),
        (lambda: s.sample_proportional(masses, [0.5], chunk_sums=dev(np.zeros(2))), "chunk_sums"),
        (lambda: s.sample_proportional(masses, dev(np.zeros(2, np.float32))), "u must have dtype float64"),
        (lambda: s.update_priorities(masses, [1, 2], [1.0], 0.6), "priorities"),
        (lambda: s.update_priorities(masses, [1], [1.0], float("nan")), "alpha"),
        (lambda: s.update_priorities(masses, dev(np.array([1], np.int32)), [1.0], 0.6), "slots must have dtype int64"),
        (lambda: s.importance_weights([0.5], 0, 0.4), "num_live"),
        (lambda: s.sample_uniform(0, [0.5]), "num_live"),
        (lambda: s.sample_uniform(3, [0.5], live_slots=[1]), "live_slots"),
    ]:
        with pytest.raises(ValueError, match=word):
            call()
    assert module.launches == []
    slots, probs = s.sample_proportional(masses, np.random.default_rng(0).random(300), chunk_sums=sums)
    assert slots.shape == (300,) and slots.dtype == np.int64 and probs.dtype == np.float64
    names = [(n, g, b) for n, g, b, _ in module.launches]
    assert names == [("scan_chunk_sums", (1, 1, 1), (256, 1, 1)), ("sample_proportional", (300, 1, 1), (256, 1, 1))]
    module.launches.clear()
    s.sample_proportional(masses, np.random.default_rng(0).random(4))  # no cached sums: one pass first
    assert [n for n, *_ in module.launches] == ["chunk_sums", "scan_chunk_sums", "sample_proportional"]


def test_cuda_select_update_skips_superseded_repeats(fake):
    _, module, _, s = fake
    slots = np.array([5, 9000, 5, 5, 1, -3, 10_000, -7])
    skip = select_mod._superseded(np, slots, 10_000)  # what the kernel is given: last repeat wins
    assert skip.tolist() == [True, False, True, False, False, True, False, False]  # out-of-range: clipped
    masses, sums = dev(np.zeros(100_000)), dev(np.zeros(num_chunks(100_000)))  # 25 chunks
    s.update_priorities(masses, slots[:5], np.array([1.0, 2.0, 3.0, 4.0, 5.0], np.float32), 0.6,
                        chunk_sums=sums)  # fmt: skip
    (name, grid, _, args), (name2, grid2, _, args2) = module.launches
    assert name == "set_priorities_f32" and grid == (1, 1, 1) and int(args[5]) == 5
    assert name2 == "chunk_sums" and grid2 == (5, 1, 1) and int(args2[2]) != 0  # a block per slot's chunk
    module.launches.clear()
    s.update_priorities(masses, np.arange(30), np.ones(30), 0.6, chunk_sums=sums)  # >= 25 updates
    (name2, grid2, _, args2) = module.launches[-1]
    assert name2 == "chunk_sums" and grid2 == (25, 1, 1) and int(args2[2]) == 0  # one pass over all chunks


# ============================================================================ hostmem (CPU, stand-in runtime)
class FakeRuntime:
    def __init__(self, can_map=1, with_get_device_pointer=True):
        self.calls = []
        self.can_map = can_map
        if with_get_device_pointer:
            self.hostGetDevicePointer = lambda ptr, flags: self.calls.append(("get", ptr, flags)) or ptr + 1

    def getDevice(self):
        return 0

    def deviceGetAttribute(self, attr, device):
        assert attr == 19
        return self.can_map

    def hostRegister(self, ptr, size, flags):
        self.calls.append(("register", ptr, size, flags))

    def hostUnregister(self, ptr):
        self.calls.append(("unregister", ptr))

    def pointerGetAttributes(self, ptr):
        self.calls.append(("attributes", ptr))
        return type("Attrs", (), {"devicePointer": ptr + 2})()


class FakeCupyRuntime:
    def __init__(self, runtime):
        self.cuda = type("cuda", (), {"runtime": runtime})()


def test_register_host_checks_pages_and_unregisters_once():
    rt = FakeRuntime()
    mm = mmap.mmap(-1, 4 * PAGE_SIZE)
    addr = buffer_address(mm)
    assert addr % PAGE_SIZE == 0
    with register_host(FakeCupyRuntime(rt), addr, 4 * PAGE_SIZE) as reg:
        assert isinstance(reg, HostRegistration) and reg.device_ptr == addr + 1
        assert reg.device_pointer(PAGE_SIZE) == addr + 1 + PAGE_SIZE
        with pytest.raises(ValueError, match="offset"):
            reg.device_pointer(4 * PAGE_SIZE)
    reg.close()
    assert rt.calls == [("register", addr, 4 * PAGE_SIZE, 3), ("get", addr, 0), ("unregister", addr)]
    assert reg.closed
    with pytest.raises(ValueError, match="closed"):
        reg.device_pointer(0)
    for args, word in [((addr + 8, PAGE_SIZE), "address"), ((addr, PAGE_SIZE + 1), "nbytes"),
                       ((addr, 0), "nbytes"), ((0, PAGE_SIZE), "address")]:  # fmt: skip
        with pytest.raises(ValueError, match=word):
            register_host(FakeCupyRuntime(rt), *args)
    with pytest.raises(ValueError, match="flags"):
        register_host(FakeCupyRuntime(rt), addr, PAGE_SIZE, flags=1)
    with pytest.raises(ValueError, match="cannot map host memory"):
        register_host(FakeCupyRuntime(FakeRuntime(can_map=0)), addr, PAGE_SIZE)
    mm.close()


def test_register_storage_covers_the_whole_segment(storage_factory):
    st = storage_factory({"obs": "uint8[4,84,84]", "reward": "float32"}, P=2, S=8)
    rt = FakeRuntime(with_get_device_pointer=False)  # older CuPy: device pointer from the attributes
    reg = register_storage(FakeCupyRuntime(rt), st)
    base = st.header.ctypes.data
    assert rt.calls[0] == ("register", base, st.nbytes, 3) and st.nbytes % PAGE_SIZE == 0
    assert reg.device_ptr == base + 2
    assert reg.device_pointer(st.column_offsets["obs"]) % 16 == 2  # offset 4096-aligned: base alignment kept
    reg.close()


# ============================================================================ kernels under a CPU emulation (g++)
# The .cu sources compiled as C++ with a shim for the CUDA built-ins: blocks in
# turn, a block's threads as fibers that switch at __syncthreads. It runs the
# kernels' own indexing, ring arithmetic, padding, load-width variants, scans
# and searches through the real wrappers, on every x86-64 Linux box with g++.
# It says nothing about GPU memory semantics, warps, NVRTC or the driver: that
# is what the CUDA tier below is for.
EMU_SHIM = r"""
// CPU emulation of the CUDA built-ins the gearflow kernels use: tests only.
// Blocks run one after the other. The threads of a block are fibers
// (ucontext) run round-robin on one OS thread: each runs until its next
// __syncthreads() or its end, then the next one runs; a round ends when every
// thread has reached the barrier. A round in which some threads end while
// others wait at a barrier is a barrier divergence (undefined on a GPU) and
// fails the launch. __shared__ becomes a function-static variable, which one
// block at a time shares.
#include <cmath>
#include <ucontext.h>
#include <vector>
using std::pow;
struct gf_dim3 { unsigned x, y, z; };
static gf_dim3 threadIdx, blockIdx, blockDim, gridDim;
struct uint4 { unsigned x, y, z, w; };
struct uint2 { unsigned x, y; };
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(n)
#define __shared__ static
static ucontext_t gf_scheduler;
static std::vector<ucontext_t> gf_fibers;
static unsigned gf_current;
static inline void __syncthreads() { swapcontext(&gf_fibers[gf_current], &gf_scheduler); }
// host-link reads the kernels count (GF_COUNT_READ in gather.cu), read and reset by the tests
static unsigned long long gf_bytes_read = 0;
extern "C" unsigned long long gf_emu_bytes_read() { unsigned long long n = gf_bytes_read; gf_bytes_read = 0; return n; }
#define GF_COUNT_READ(bytes) (gf_bytes_read += (bytes))
static inline int atomicMax(int* p, int v) { int old = *p; if (v > old) *p = v; return old; }
static inline unsigned long long atomicMax(unsigned long long* p, unsigned long long v) {
    unsigned long long old = *p; if (v > old) *p = v; return old;
}
static inline void __threadfence_system() {}
static inline double __longlong_as_double(long long x) { double d; __builtin_memcpy(&d, &x, sizeof d); return d; }
static inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
    unsigned long long old = *p; *p = old + v; return old;
}
// x86-64 System V: integer/pointer arguments and double arguments travel in
// separate registers (integer ones past the sixth on the stack, in order), so
// any kernel with <= 12 integer and <= 4 double parameters can be called
// through this one type, its integers and its doubles each listed in order.
typedef unsigned long long gf_u64;
typedef void (*gf_kernel)(gf_u64, gf_u64, gf_u64, gf_u64, gf_u64, gf_u64, gf_u64, gf_u64, gf_u64,
                          gf_u64, gf_u64, gf_u64, double, double, double, double);
static gf_kernel gf_fn;
// 1: blocks and the threads of a block run in reverse order (a kernel whose result depends on
// the order its threads run in, which a GPU does not fix, then gives another result)
static int gf_reverse = 0;
extern "C" void gf_emu_set_reverse(int on) { gf_reverse = on; }
static gf_u64 gf_ints[12];
static double gf_dbls[4];
static std::vector<int> gf_done;
static void gf_fiber_main(int t) {
    gf_fn(gf_ints[0], gf_ints[1], gf_ints[2], gf_ints[3], gf_ints[4], gf_ints[5], gf_ints[6],
          gf_ints[7], gf_ints[8], gf_ints[9], gf_ints[10], gf_ints[11], gf_dbls[0], gf_dbls[1],
          gf_dbls[2], gf_dbls[3]);
    gf_done[t] = 1;  // returning resumes uc_link: the scheduler
}
extern "C" int gf_emu_launch(void* fn, unsigned gx, unsigned bx, unsigned by, const gf_u64* ints,
                             const double* dbls) {
    const unsigned n = bx * by;
    const size_t stack = 1 << 16;
    std::vector<char> stacks((size_t)n * stack);
    gf_fn = reinterpret_cast<gf_kernel>(fn);
    for (int k = 0; k < 12; ++k) gf_ints[k] = ints[k];
    for (int k = 0; k < 4; ++k) gf_dbls[k] = dbls[k];
    gridDim = {gx, 1, 1};
    blockDim = {bx, by, 1};
    gf_fibers.assign(n, ucontext_t());
    for (unsigned bb = 0; bb < gx; ++bb) {
        const unsigned b = gf_reverse ? gx - 1 - bb : bb;
        blockIdx = {b, 0, 0};
        gf_done.assign(n, 0);
        for (unsigned t = 0; t < n; ++t) {
            getcontext(&gf_fibers[t]);
            gf_fibers[t].uc_stack.ss_sp = stacks.data() + (size_t)t * stack;
            gf_fibers[t].uc_stack.ss_size = stack;
            gf_fibers[t].uc_link = &gf_scheduler;
            makecontext(&gf_fibers[t], (void (*)())gf_fiber_main, 1, (int)t);
        }
        for (;;) {
            unsigned ended = 0, waiting = 0;
            for (unsigned tt = 0; tt < n; ++tt) {
                const unsigned t = gf_reverse ? n - 1 - tt : tt;
                if (gf_done[t]) continue;
                gf_current = t;
                threadIdx = {t % bx, t / bx, 0};
                swapcontext(&gf_scheduler, &gf_fibers[t]);
                if (gf_done[t]) ++ended; else ++waiting;
            }
            if (waiting == 0) break;
            if (ended != 0) return -2;  // barrier divergence
        }
    }
    return 0;
}
"""
GXX = shutil.which("g++")
needs_emulation = pytest.mark.skipif(
    GXX is None or platform.machine() != "x86_64" or not sys.platform.startswith("linux"),
    reason="the kernel emulation needs g++ on x86-64 Linux (System V calling convention)",
)


class EmulatedModule:
    """Stands in for a ``cupy.RawModule``: runs the kernel source compiled for the CPU, synchronously."""

    def __init__(self, path: Path):
        self.lib = ctypes.CDLL(str(path))
        self.lib.gf_emu_launch.restype = ctypes.c_int
        self.launches = []

    def get_function(self, name):
        fn = ctypes.cast(getattr(self.lib, name), ctypes.c_void_p).value

        def kernel(grid, block, args):
            ints = [int(a) & (2**64 - 1) for a in args if np.asarray(a).dtype.kind in "iub"]
            dbls = [float(a) for a in args if np.asarray(a).dtype.kind == "f"]
            assert len(ints) <= 12 and len(dbls) <= 4 and grid[1:] == (1, 1) and block[2] == 1
            rc = self.lib.gf_emu_launch(ctypes.c_void_p(fn), grid[0], block[0], block[1],
                                        (ctypes.c_ulonglong * 12)(*ints), (ctypes.c_double * 4)(*dbls))  # fmt: skip
            assert rc == 0, f"{name}: barrier divergence (some threads ended while others waited)"
            self.launches.append(name)

        return kernel


def compile_emulated(source: Path, out_dir: Path) -> Path:
    shim = out_dir / "gf_emu_shim.h"
    shim.write_text(EMU_SHIM)
    lib = out_dir / f"lib{source.stem}_emu.so"
    cmd = [GXX, "-std=c++17", "-O2", "-fPIC", "-shared", "-Wall", "-Werror", "-include", str(shim),
           "-x", "c++", str(source), "-o", str(lib)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, f"g++ could not build the emulation of {source.name}:\n{proc.stderr}"
    return lib


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    """(CudaGather, CudaSelect, FakeCupy) running the kernel sources on the CPU."""
    out = tmp_path_factory.mktemp("emu")
    cp = FakeCupy()
    g = CudaGather(cp, EmulatedModule(compile_emulated(KERNEL_DIR / "gather.cu", out)))
    s = CudaSelect(cp, EmulatedModule(compile_emulated(KERNEL_DIR / "select.cu", out)))
    return g, s, cp


@needs_emulation
def test_emulated_stack_kernel_reads_each_frame_once_per_window(tmp_path):
    """gather_stacks reads a frame over the host link once per window, however many stack slots
    hold it (bytes counted by the emulation): an 80-step window of 4-frame stacks reads 83
    frames, not 320; one that crosses an episode start, or starts at an episode's first step
    (its first frame repeated), reads only the frames its stacks hold. The output equals the
    numpy reference."""
    from gearflow.native.gather import gather_stacks, stack_frames_read, stack_rows

    module = EmulatedModule(compile_emulated(KERNEL_DIR / "gather.cu", tmp_path))
    g = CudaGather(FakeCupy(), module)
    P, S, K, T, row = 1, 400, 4, 80, 64
    col = np.random.default_rng(0).integers(0, 256, size=(P * S, row), dtype=np.uint8)
    ep_start = np.where(np.arange(S) < 150, 0, 150)  # episodes start at steps 0 and 150
    off = np.minimum(np.arange(S) - ep_start, 255).astype(np.uint8)
    parts, starts, lengths = np.zeros(3, np.int64), np.array([100, 140, 1]), np.array([80, 80, 40], np.int32)
    dst = dev(np.zeros((3, T, K, row), np.uint8))
    module.lib.gf_emu_bytes_read.restype = ctypes.c_ulonglong
    module.lib.gf_emu_bytes_read()
    g.gather_stacks(col.ctypes.data, row, S, K, off.ctypes.data, parts, starts, lengths, T, dst, num_rows=P * S)
    read = module.lib.gf_emu_bytes_read()
    ref = np.empty((3, T, K, row), np.uint8)
    gather_stacks(col, row, S, K, off, parts, starts, lengths, T, ref)
    assert dst.tobytes() == ref.tobytes()
    frames = [stack_frames_read(off, parts[i : i + 1], starts[i : i + 1], lengths[i : i + 1], S, K) for i in range(3)]
    assert frames == [83, 83, 41] and stack_rows(T, K) == 83  # steps 97..179, 137..219, 0..40
    assert read == sum(frames) * row  # each once: 207 frames, where one read per slot is 800
    assert int(lengths.sum()) * K == 800


@needs_emulation
def test_emulator_catches_barrier_divergence(tmp_path):
    src = tmp_path / "diverge.cu"
    src.write_text(
        'extern "C" __global__ void ok(int* out) { __syncthreads(); out[threadIdx.x] = 1; }\n'
        'extern "C" __global__ void bad(int* out) { if (threadIdx.x) __syncthreads(); out[0] = 1; }\n'
    )
    module = EmulatedModule(compile_emulated(src, tmp_path))
    out = np.zeros(4, np.int32)
    module.get_function("ok")((1, 1, 1), (4, 1, 1), (np.uint64(out.ctypes.data),))
    assert out.tolist() == [1, 1, 1, 1]
    with pytest.raises(AssertionError, match="divergence"):
        module.get_function("bad")((1, 1, 1), (4, 1, 1), (np.uint64(out.ctypes.data),))


@needs_emulation
@pytest.mark.parametrize("row_bytes,piece", [(1, None), (8, None), (12, None), (16, None), (28, None), (33, None),
                                             (64, None), (100, 32), (1000, None), (28224, 4096), (28225, 4096)])  # fmt: skip
def test_emulated_gather_kernels_match_the_reference(emulated, row_bytes, piece):
    """Every variant (v16 .. v1, and va for rows at any alignment: 100-, 1000-, 28225-byte rows, or
    any row into a 4- or 1-byte aligned output) and rows split into pieces (28224 bytes in 4 KiB
    pieces: the last one shorter) against numpy, stale bytes everywhere, rows at the ring's end."""
    g, _, _ = emulated
    rng = np.random.default_rng(row_bytes)
    P, S, T, B = 3, 20, 7, 24
    col = column(rng, P * S, row_bytes)
    widths = set()
    for offset in (0, 4, 1):  # dst 16-, 4- and 1-byte aligned
        parts = rng.integers(0, P, B)
        starts = rng.integers(0, 5 * S, B)
        starts[:6] = S * rng.integers(1, 4, 6) - rng.integers(1, T, 6)  # ring's end: wrap
        lengths = rng.integers(0, T + 1, B).astype(np.int32)
        raw = dev(np.full(B * T * row_bytes + 16, 0xAB, np.uint8))  # stale bytes everywhere
        dst = raw[offset : offset + B * T * row_bytes].reshape(B, T, row_bytes)
        mask = dev(np.ones((B, T), bool))
        idx = (parts, starts, lengths) if offset != 4 else tuple(dev(a.astype(a.dtype)) for a in
                                                                  (parts.astype(np.int64), starts.astype(np.int64), lengths))  # fmt: skip
        plan = g.gather_windows(col.ctypes.data, row_bytes, S, *idx, T, dst, mask, num_rows=P * S, piece=piece)
        widths.add(plan.kernel.rsplit("_", 1)[1])
        want, want_mask = naive_windows(col, S, parts, starts, lengths, T)
        assert np.array_equal(mask, want_mask)
        assert dst.tobytes() == want.tobytes(), plan
        first, last = transition_rows(parts, starts, np.maximum(lengths, 1), S)
        for rows in (first, last):
            out = raw[offset : offset + B * row_bytes].reshape(B, row_bytes)
            g.gather_rows(col.ctypes.data, row_bytes, rows, out, num_rows=P * S, piece=piece)
            assert out.tobytes() == col[rows].tobytes(), plan
    # device indices the kernel cannot address become padding / zero rows, never reads outside the column
    dst, mask = dev(np.full((3, 2, row_bytes), 9, np.uint8)), dev(np.ones((3, 2), bool))
    g.gather_windows(col.ctypes.data, row_bytes, S, dev(np.array([P, -1, 0])), dev(np.array([0, 0, -5])),
                     dev(np.array([2, 2, 2], np.int32)), 2, dst, mask, num_rows=P * S, piece=piece)  # fmt: skip
    out = dev(np.full((2, row_bytes), 9, np.uint8))
    g.gather_rows(col.ctypes.data, row_bytes, dev(np.array([-1, P * S])), out, num_rows=P * S, piece=piece)
    assert not dst.any() and not mask.any() and not out.any()
    if row_bytes >= 64:  # not all aligned: the any-alignment variant took the rows
        assert "va" in widths
    assert len(widths) >= (2 if row_bytes % 16 == 0 or (row_bytes < 64 and row_bytes % 4 == 0) else 1)


@needs_emulation
def test_emulated_select_kernels_match_the_reference(emulated):
    _, s, _ = emulated
    rng = np.random.default_rng(17)
    for N in (1, 1000, 3 * CHUNK + 77):
        priorities = rng.random(N) * 3
        priorities[rng.random(N) < 0.25] = 0.0
        masses_h, sums_h = np.zeros(N), np.zeros(num_chunks(N))
        update_priorities(masses_h, np.arange(N), priorities, 0.6, chunk_sums=sums_h)
        masses, sums = dev(np.zeros(N)), dev(np.zeros(num_chunks(N)))
        assert int(s.update_priorities(masses, np.arange(N), priorities, 0.6, chunk_sums=sums)) == 0
        np.testing.assert_allclose(masses, masses_h, rtol=1e-14)
        np.testing.assert_allclose(sums, sums_h, rtol=1e-12)
        np.testing.assert_allclose(s.sum_chunks(masses), sums_h, rtol=1e-12)
        if masses_h.sum() > 0:
            for B in (1, 7, 40):
                u = rng.random(B)
                slots, probs = s.sample_proportional(masses, u, chunk_sums=sums)
                want, want_probs = sample_proportional(masses_h, u, chunk_sums=sums_h)
                assert np.array_equal(slots, want), (N, B)
                assert np.array_equal(slots, straightforward_draws(masses_h, u)[0])
                np.testing.assert_allclose(probs, want_probs, rtol=1e-12)
                weights = s.importance_weights(probs, N, 0.4)
                assert weights.dtype == np.float32
                np.testing.assert_allclose(weights, importance_weights(want_probs, N, 0.4), rtol=1e-6)
            slots, _ = s.sample_proportional(masses, u)  # without cached sums: same draws
            assert np.array_equal(slots, want)
        # a few updates: repeats (last wins), float32 and invalid values, chunk sums kept current
        k = 6
        upd = rng.integers(-1, N + 1, k)
        upd[1] = upd[4] = rng.integers(0, N)  # a repeated slot
        prios = (rng.random(k) * 2).astype(np.float32)
        prios[2] = np.nan
        want_bad = update_priorities(masses_h, upd, prios, 0.6, chunk_sums=sums_h)
        bad = s.update_priorities(masses, dev(upd.astype(np.int64)), dev(prios), 0.6, chunk_sums=sums)
        assert int(bad) == want_bad
        np.testing.assert_allclose(masses, masses_h, rtol=1e-6)
        np.testing.assert_allclose(sums, sums_h, rtol=1e-6)
    u = rng.random(500)
    slots, probs = s.sample_uniform(37, u, live_slots=np.arange(100, 137))
    want, want_probs = sample_uniform(37, u, live_slots=np.arange(100, 137))
    assert np.array_equal(slots, want) and np.allclose(probs, want_probs)
    slots, probs = s.sample_proportional(dev(np.zeros(100)), [0.5, 0.1])  # no mass: -1, probability 0
    assert slots.tolist() == [-1, -1] and probs.tolist() == [0.0, 0.0]
    values = rng.permutation(1000).astype(np.float64)
    assert np.array_equal(s.top_k(values, 10), top_k(values, 10))


# ============================================================================ the device replay's kernels
class ReplayArrays:
    """The arrays behind select.cu's gf_replay / gf_draw descriptors, on the CPU (stand-in device
    arrays whose host addresses the emulated kernels use): N slots of P partitions of R, a
    counters block [P, 8] standing in for the segment's, one draw of B rows."""

    def __init__(self, cp, P, R, B, uniform=False, trusted=16, gpu=False):
        N = P * R
        self.cp, self.gpu = cp, gpu
        dev = cp.asarray if gpu else globals()["dev"]  # CuPy arrays, or the stand-in's host arrays
        self.P, self.R, self.N, self.B = P, R, N, B
        self.masses, self.sums = dev(np.zeros(N)), dev(np.zeros(num_chunks(N)))
        self.live, self.live_sums = (self.masses, self.sums) if uniform else (dev(np.zeros(N)), dev(np.zeros(num_chunks(N))))
        self.start, self.seq, self.length = dev(np.zeros(N, np.int64)), dev(np.full(N, -1, np.int64)), dev(np.zeros(N, np.int32))
        self.winner, self.prio_status = dev(np.zeros(N, np.uint64)), dev(np.zeros(2, np.uint64))
        if gpu:  # the counters and the status word in mapped host memory, as the device replay's
            from gearflow.native.hostmem import MappedArea

            self._areas = (MappedArea(cp, P * 64), MappedArea(cp, 64))
            self.counters = self._areas[0].host[: P * 64].view(np.int64).reshape(P, 8)
            self.counters[...] = 0
            counters_ptr, status_ptr = self._areas[0].device_ptr, self._areas[1].device_ptr
            self.status = self._areas[1].host[:32].view(np.int64)
        else:
            self.counters = np.zeros((P, 8), np.int64)  # RESERVE is field 0 here
            self.status = np.zeros(4, np.int64)
            counters_ptr, status_ptr = self.counters.ctypes.data, self.status.ctypes.data
        self.desc = select_mod.descriptor(cp, select_mod.REPLAY_FIELDS, {
            "masses": self.masses, "sums": self.sums, "live": self.live, "live_sums": self.live_sums,
            "start": self.start, "seq": self.seq, "length": self.length, "winner": self.winner,
            "prio_status": self.prio_status, "counters": counters_ptr, "N": N, "NC": num_chunks(N),
            "P": P, "R": R, "counter_fields": 8, "reserve_field": 0, "trusted_steps": trusted})  # fmt: skip
        self.draw = {"slots": dev(np.zeros(B, np.int64)), "probs": dev(np.zeros(B)), "parts": dev(np.zeros(B, np.int64)),
                     "starts": dev(np.zeros(B, np.int64)), "seqs": dev(np.zeros(B, np.int64)),
                     "lengths": dev(np.zeros(B, np.int32)), "keys": dev(np.zeros(B, np.int64)),
                     "weights": dev(np.zeros(B, np.float32)), "probabilities": dev(np.zeros(B)),
                     "flags": dev(np.zeros(B, np.uint8))}  # fmt: skip
        self.draw_desc = select_mod.descriptor(cp, select_mod.DRAW_FIELDS, {**self.draw, "status": status_ptr})

    def ingest(self, s, slots, prios, starts, seqs, lengths, live, alpha):
        n = len(slots)
        entries = np.stack([np.asarray(slots, np.int64), np.asarray(prios, np.float64).view(np.int64),
                            np.asarray(starts, np.int64), np.asarray(seqs, np.int64),
                            np.asarray(lengths, np.int64), np.asarray(live, np.int64)])  # fmt: skip
        vectors = [(dptr_of(self.masses), dptr_of(self.sums), self.N, num_chunks(self.N))]
        if self.live is not self.masses:
            vectors.append((dptr_of(self.live), dptr_of(self.live_sums), self.N, num_chunks(self.N)))
        if self.gpu:  # the kernel reads the entries where they are: mapped host memory
            from gearflow.native.hostmem import MappedArea

            area = MappedArea(self.cp, entries.nbytes)
            area.host[: entries.nbytes] = entries.reshape(-1).view(np.uint8)
            s.apply_ingest(dptr_of(self.desc), area.device_ptr, n, alpha, tuple(vectors))
            self.cp.cuda.get_current_stream().synchronize()
            area.close()
        else:
            s.apply_ingest(dptr_of(self.desc), entries.ctypes.data, n, alpha, tuple(vectors))
        return entries

    def get(self, a):
        """A host copy (or the stand-in's array itself)."""
        if self.gpu:
            self.cp.cuda.get_current_stream().synchronize()
            return a.get()
        return np.asarray(a)

    def close(self):
        for area in getattr(self, "_areas", ()):
            area.close()


def dptr_of(a):
    return int(a.__cuda_array_interface__["data"][0])


def test_descriptor_fields_match_the_structs_in_select_cu():
    src = (KERNEL_DIR / "select.cu").read_text()

    def fields(struct):
        body = re.search(rf"struct {struct} \{{(.*?)\n\}};", src, re.DOTALL).group(1)
        body = re.sub(r"//[^\n]*", "", body)
        names = []
        for decl in body.split(";"):
            decl = decl.strip()
            if decl:
                names += [re.sub(r"[^\w].*", "", part.strip().split()[-1].lstrip("*")) for part in
                          (decl.split(",") if "," in decl else [decl])]  # fmt: skip
        return tuple(names)

    assert fields("gf_replay") == select_mod.REPLAY_FIELDS
    assert fields("gf_draw") == select_mod.DRAW_FIELDS
    with pytest.raises(ValueError, match="no value for status"):
        select_mod.descriptor(FakeCupy(), select_mod.DRAW_FIELDS, {f: 0 for f in select_mod.DRAW_FIELDS[:-1]})


def check_replay_kernels(s, cp, uniform, gpu=False, reverse=None):
    """draw_items (the fused two-level draw, with the kernel's own uniforms or given ones, a subset of
    rows, the no-mass fallback to the live slots), apply_ingest, the update by key (repeated keys:
    the last wins on the device, also with the threads run in reverse order where ``reverse`` can
    do that; evicted keys ignored; invalid priorities refused and counted, never applied) and
    finish_batch (keys, torn and impossible rows against the counters, IS weights, the status
    word) against numpy. ``s``: a CudaSelect on the emulation or on CuPy (``gpu``)."""
    rng = np.random.default_rng(5)
    P, R, B = 3, 3000, 40  # N = 9000: three chunks, the last one partial
    a = ReplayArrays(cp, P, R, B, uniform=uniform, gpu=gpu)
    D, G = (cp.asarray if gpu else dev), a.get
    try:
        N = a.N
        slots = rng.permutation(N)[: N // 2]
        prios = rng.random(slots.size) * 3
        prios[rng.random(slots.size) < 0.2] = 0.0
        prios[: slots.size // 4] = 0.0
        seqs = slots % R + R * rng.integers(0, 4, slots.size)  # the slot rule: seq % R == slot % R
        starts = rng.integers(0, 200, slots.size)
        alpha = -1.0 if uniform else 0.6
        a.ingest(s, slots, prios, starts, seqs, np.full(slots.size, 3), np.ones(slots.size), alpha)
        gone = slots[:50]
        a.ingest(s, gone, np.zeros(50), np.zeros(50), np.zeros(50), np.zeros(50), np.zeros(50), alpha)
        live_h = np.zeros(N)
        live_h[slots[50:]] = 1
        masses_h = live_h.copy() if uniform else np.zeros(N)
        if not uniform:
            masses_h[slots[50:]] = np.where(prios[50:] > 0, prios[50:] ** 0.6, 0.0)
        np.testing.assert_allclose(G(a.masses), masses_h, rtol=1e-14)
        np.testing.assert_array_equal(G(a.live), live_h)
        np.testing.assert_allclose(G(a.sums), sum_chunks(masses_h), rtol=1e-12)
        assert G(a.seq)[slots[60]] == seqs[60] and G(a.start)[slots[60]] == starts[60] and G(a.length)[slots[60]] == 3

        def check_draw(u_host, rows=None, given=True):
            count = len(u_host)
            u_dev, rows_dev = D(np.asarray(u_host)), None if rows is None else D(np.asarray(rows, np.int64))
            s.draw_items(dptr_of(a.desc), dptr_of(a.draw_desc), count, rows=0 if rows is None else dptr_of(rows_dev),
                         u=dptr_of(u_dev) if given else 0, seed=7, counter=3)  # fmt: skip
            want, want_p = draw_items(G(a.masses), G(a.live), u_host, chunk_sums=G(a.sums), live_sums=G(a.live_sums))
            at = np.arange(count) if rows is None else np.asarray(rows)
            got = {k: G(v)[at] for k, v in a.draw.items()}
            if gpu:  # the same additions in the same order; allow a boundary case or so (contracted arithmetic)
                m = G(a.masses) if G(a.masses).any() else G(a.live)
                assert (got["slots"] == want).mean() > 0.97 and (m[got["slots"]] > 0).all()
            else:
                assert np.array_equal(got["slots"], want)
                np.testing.assert_allclose(got["probs"], want_p, rtol=1e-12)
            w = got["slots"]
            assert np.array_equal(got["parts"], w // R) and np.array_equal(got["seqs"], G(a.seq)[w])
            assert np.array_equal(got["starts"], G(a.start)[w]) and (got["lengths"] == 3).all()
            return w

        u = rng.random(B)
        drawn = check_draw(u)
        assert live_h[drawn].all() and (uniform or (masses_h[drawn] > 0).all())
        check_draw(select_mod.uniforms(7, 3, B), given=False)  # the kernel's own uniforms
        check_draw(u[:5], rows=[3, 9, 0, 30, 1])  # a redraw of 5 rows
        # finish: the counters say partition 1 overwrote everything before step 150 + 16
        a.counters[1, 0] = 150 + 16
        a.draw["slots"][7], a.draw["parts"][7] = -1, -1  # an impossible row
        s.finish_batch(dptr_of(a.desc), dptr_of(a.draw_desc), B, int(live_h.sum()), 0.4)
        parts, starts_d, probs_d = (G(a.draw[k]) for k in ("parts", "starts", "probs"))
        valid = parts >= 0
        torn = valid & (starts_d < a.counters[np.maximum(parts, 0), 0] - 16)
        assert torn.any() and np.array_equal(G(a.draw["flags"]), (~valid) * 1 + torn * 2)
        assert a.status.tolist()[:2] == [int((~valid).sum()), int(torn.sum())]
        keys_d = G(a.draw["keys"])
        assert np.array_equal(keys_d[valid], G(a.draw["seqs"])[valid] * P + parts[valid]) and keys_d[7] == -1
        w = np.where(valid, (live_h.sum() * probs_d) ** -0.4, 0.0)
        np.testing.assert_allclose(G(a.draw["weights"]), w / w.max(), rtol=1e-6)
        # write-back by key: held keys, an evicted one, a stale seq, a repeat (the last wins), bad values
        held = slots[50:60]
        seq_h = G(a.seq)
        keys = list((seq_h[held] * P + held // R).tolist())
        keys += [int(seq_h[gone[0]] * P + gone[0] // R), int((seq_h[held[0]] + R) * P + held[0] // R), keys[2], -4]
        upd = rng.random(len(keys)) * 2
        upd[3], upd[len(keys) - 2] = np.nan, 0.25  # entry 3 refused; key 2 repeated: 0.25 wins
        for dtype, rev in ((np.float64, 0), (np.float32, 1)):  # threads in reverse: the last entry still wins
            if reverse is not None:
                reverse(rev)
            u_h, want_m = upd.astype(dtype), G(a.masses).copy()
            want_applied, want_refused = update_by_key(want_m, G(a.live), G(a.seq), keys, u_h, alpha, P, R)
            before = G(a.prio_status).copy()
            scratch = D(np.zeros(len(keys), np.int64))
            k_dev, u_dev = D(np.array(keys, np.int64)), D(u_h)
            s.update_by_key(dptr_of(a.desc), dptr_of(k_dev), dptr_of(u_dev), len(keys), dtype == np.float32,
                            (2 if dtype == np.float32 else 1) << 32, alpha, dptr_of(scratch), dptr_of(a.masses), N,
                            None if uniform else dptr_of(a.sums), num_chunks(N))  # fmt: skip
            assert (G(a.prio_status) - before).tolist() == [want_applied, want_refused] == [9, 1]
            np.testing.assert_allclose(G(a.masses), want_m, rtol=1e-6)
            np.testing.assert_allclose(G(a.sums), sum_chunks(G(a.masses)), rtol=1e-12)
            if reverse is not None:
                reverse(0)
            if not uniform:
                assert G(a.masses)[held[2]] == pytest.approx(0.25**0.6) and G(a.masses)[held[3]] == masses_h[held[3]]
        # no mass at all: the draw is uniform over the live slots (probability 1 / live), as the CPU selector
        if not uniform:
            a.ingest(s, slots[50:], np.zeros(slots.size - 50), starts[50:], seqs[50:], np.full(slots.size - 50, 3),
                     np.ones(slots.size - 50), alpha)  # fmt: skip
            assert not G(a.masses).any()
            drawn = check_draw(u)
            assert live_h[drawn].all() and np.allclose(G(a.draw["probs"]), 1 / live_h.sum())
    finally:
        a.close()


@needs_emulation
@pytest.mark.parametrize("uniform", [False, True])
def test_emulated_replay_kernels_match_their_references(emulated, uniform):
    _, s, cp = emulated
    check_replay_kernels(s, cp, uniform, reverse=s.module.lib.gf_emu_set_reverse)


# ============================================================================ probe (CPU, injected CuPy)
class ProbeCupy:
    """A CuPy module for :func:`probe_cupy`: each step can fail as it does on a real machine;
    the probe kernel itself runs under the g++ emulation when ``kernel_dir`` is given."""

    int64 = np.int64

    def __init__(self, tmp_path, fail=None, devices=1, wrong=False):
        self.__version__, self.fail, self.tmp_path, self.wrong = "13.6.0", fail, tmp_path, wrong
        self.launched = []

        class Runtime:
            def getDeviceCount(_):
                if fail == "driver":
                    raise RuntimeError("cudaErrorInsufficientDriver: CUDA driver version is insufficient")
                return devices

            def getDevice(_):
                return 0

        class Nvrtc:
            def getVersion(_):
                if fail == "nvrtc":
                    raise OSError("libnvrtc.so.12: cannot open shared object file: No such file or directory")
                return (12, 8)

        self.cuda = SimpleNamespace(runtime=Runtime(), nvrtc=Nvrtc())

    def RawKernel(self, code, name):
        probe = self

        class Kernel:
            def compile(_):
                if probe.fail == "compile":
                    raise RuntimeError("CompileException: catastrophic error: cannot open source file")

            def __call__(_, grid, block, args):
                if probe.fail == "launch":
                    raise RuntimeError("CUDARuntimeError: cudaErrorNoKernelImageForDevice")
                src = probe.tmp_path / "probe.cu"
                src.write_text(code)
                fn = EmulatedModule(compile_emulated(src, probe.tmp_path)).get_function(name)
                a, out, n = args
                pad = lambda t: tuple(t) + (1,) * (3 - len(t))
                fn(pad(grid), pad(block), (np.uint64(a.ctypes.data), np.uint64(out.ctypes.data), n))
                if probe.wrong:
                    out[0] += 1
                probe.launched.append(name)

        return Kernel()

    def arange(self, n, dtype):
        return np.arange(n, dtype=dtype)

    def zeros(self, n, dtype):
        return np.zeros(n, dtype=dtype)

    def asnumpy(self, a):
        return np.asarray(a)


@needs_emulation
def test_probe_cupy_compiles_and_runs_a_kernel_and_names_what_is_missing(tmp_path):
    ok = ProbeCupy(tmp_path)
    p = probe_cupy(ok)
    assert p.ok and p.detail == "cupy 13.6.0, NVRTC 12.8, 1 device(s); a test kernel ran on cuda:0", p
    assert ok.launched == ["gearflow_probe"]  # the kernel source itself ran (under the emulation)
    cases = {
        "driver": "imports but the CUDA driver or device is missing: RuntimeError: cudaErrorInsufficientDriver",
        "nvrtc": "but NVRTC is missing (OSError: libnvrtc.so.12: cannot open shared object file",
        "compile": "NVRTC 12.8: a test kernel does not compile (RuntimeError: CompileException",
        "launch": "a test kernel compiled but did not run (RuntimeError: CUDARuntimeError: cudaErrorNoKernelImage",
    }
    for fail, why in cases.items():
        p = probe_cupy(ProbeCupy(tmp_path, fail=fail))
        assert not p.ok and why in p.detail and "\n" not in p.detail, (fail, p.detail)
    assert "pip install 'cupy-cuda12x[ctk]'" in probe_cupy(ProbeCupy(tmp_path, fail="nvrtc")).detail
    assert probe_cupy(ProbeCupy(tmp_path, devices=0)).detail == "cupy 13.6.0: no CUDA device"
    assert "returned wrong values" in probe_cupy(ProbeCupy(tmp_path, wrong=True)).detail


@needs_nvcc
def test_probe_kernel_compiles_to_ptx(tmp_path):
    from gearflow.native import PROBE_KERNEL

    (tmp_path / "probe.cu").write_text(PROBE_KERNEL)
    proc = subprocess.run([NVCC, "--ptx", "-arch=sm_90", "-o", str(tmp_path / "probe.ptx"), str(tmp_path / "probe.cu")],
                          capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert ".entry gearflow_probe" in (tmp_path / "probe.ptx").read_text()


# ============================================================================ packaging
def test_import_gearflow_and_native_modules_does_not_import_cupy():
    code = (
        "import sys, gearflow, gearflow.native.gather, gearflow.native.select, gearflow.native.hostmem, "
        "gearflow.native.cuda_backend, gearflow.native.bench_cuda; "
        "assert 'cupy' not in sys.modules, 'cupy imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_kernel_sources_ship_with_the_package():
    text = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    assert '"native/kernels/*.cu"' in text


def test_docstring_examples_run():
    for mod in (gather_mod, select_mod):
        assert doctest.testmod(mod).failed == 0


# ============================================================================ CUDA
@pytest.fixture
def cupy():
    import cupy

    return cupy


RING_SPEC = {"b1": "uint8", "b12": "float32[3]", "b16": "int32[4]", "b28": "uint8[28]", "b33": "uint8[33]",
             "b64": "float64[8]", "obs": "uint8[4,84,84]", "odd": "uint8[28225]"}  # odd: rows at every offset mod 16  # fmt: skip


@pytest.fixture
def filled_storage(storage_factory):
    st = storage_factory(RING_SPEC, P=3, S=40)
    rng = np.random.default_rng(0)
    for col in st.columns.values():
        col.view(np.uint8).reshape(-1)[:] = rng.integers(0, 256, col.nbytes, dtype=np.uint8)
    return st


def random_windows(rng, P, S, B, T):
    parts = rng.integers(0, P, B).astype(np.int64)
    starts = rng.integers(0, 6 * S, B).astype(np.int64)
    starts[: B // 4] = (S * rng.integers(1, 5, B // 4) - rng.integers(1, T, B // 4)).astype(np.int64)  # wrap
    lengths = rng.integers(0, T + 1, B).astype(np.int32)
    lengths[: B // 3] = T
    return parts, starts, lengths


@pytest.mark.cuda
@needs_cupy
@pytest.mark.parametrize("dst_offset", [0, 4, 1])
def test_cuda_gather_windows_match_the_reference_from_registered_memory(cupy, filled_storage, dst_offset):
    st, rng = filled_storage, np.random.default_rng(dst_offset)
    P, S, T, B = st.num_partitions, st.steps_per_partition, 9, 50
    g = CudaGather(cupy)
    with register_storage(cupy, st) as reg:
        for c in st.spec:
            parts, starts, lengths = random_windows(rng, P, S, B, T)
            col = st.columns[c.name]
            want = np.empty((B, T, *c.shape), c.dtype)
            want_mask = np.empty((B, T), bool)
            gather_windows(col, c.nbytes, S, parts, starts, lengths, T, want, want_mask)
            raw = cupy.zeros(B * T * c.nbytes + 16, cupy.uint8)  # dst_offset != 0: unaligned dst
            dst = raw[dst_offset : dst_offset + B * T * c.nbytes].reshape(B, T, c.nbytes)
            dst[...] = 0xAB  # stale bytes
            mask = cupy.zeros((B, T), cupy.bool_)
            device_idx = c.name in ("b12", "obs")  # some columns with device index arrays
            idx = [cupy.asarray(a) for a in (parts, starts, lengths)] if device_idx else [parts, starts, lengths]
            piece = 4096 if c.name == "obs" and dst_offset == 1 else None  # short last piece too
            plan = g.gather_windows(reg.device_pointer(st.column_offsets[c.name]), c.nbytes, S, *idx, T,
                                    dst, mask, num_rows=P * S, piece=piece)  # fmt: skip
            cupy.cuda.get_current_stream().synchronize()
            assert np.array_equal(mask.get(), want_mask), c.name
            assert dst.get().tobytes() == want.tobytes(), (c.name, plan)


@pytest.mark.cuda
@needs_cupy
def test_cuda_gather_rows_transitions_and_zero_copy(cupy, filled_storage):
    st, rng = filled_storage, np.random.default_rng(9)
    P, S, B = st.num_partitions, st.steps_per_partition, 64
    g = CudaGather(cupy)
    parts = rng.integers(0, P, B).astype(np.int64)
    starts = rng.integers(0, 5 * S, B).astype(np.int64)
    lengths = rng.integers(1, 6, B).astype(np.int64)
    first, last = transition_rows(parts, starts, lengths, S)
    with register_storage(cupy, st) as reg:
        for c in st.spec:
            ptr = reg.device_pointer(st.column_offsets[c.name])
            for rows in (first, last):
                out = cupy.empty((B, *c.shape), c.dtype)
                g.gather_rows(ptr, c.nbytes, cupy.asarray(rows), out, num_rows=P * S)
                want = np.empty((B, *c.shape), c.dtype)
                gather_rows(st.columns[c.name], c.nbytes, rows, want)
                assert out.get().tobytes() == want.tobytes(), c.name
        # zero-copy: a host write after registration is what the next gather sees
        st.columns["b28"][first[0]] = 77
        out = cupy.empty((1, 28), cupy.uint8)
        g.gather_rows(reg.device_pointer(st.column_offsets["b28"]), 28, first[:1], out, num_rows=P * S)
        assert (out.get() == 77).all()
        # device indices the kernel cannot address: padding / zeros, never a read outside the column
        out = cupy.full((2, 28), 5, cupy.uint8)
        g.gather_rows(reg.device_pointer(st.column_offsets["b28"]), 28, cupy.asarray([-1, P * S]), out,
                      num_rows=P * S)  # fmt: skip
        win, mask = cupy.full((2, 3, 28), 5, cupy.uint8), cupy.ones((2, 3), cupy.bool_)
        g.gather_windows(reg.device_pointer(st.column_offsets["b28"]), 28, S, cupy.asarray([P, 0]),
                         cupy.asarray([0, -3]), cupy.asarray(np.array([3, 3], np.int32)), 3, win, mask,
                         num_rows=P * S)  # fmt: skip
        cupy.cuda.get_current_stream().synchronize()
        assert not out.get().any() and not win.get().any() and not mask.get().any()
        # DLPack: the batch reaches torch without a copy
        import torch

        if torch.cuda.is_available():
            from gearflow.native.cuda_backend import to_torch

            t = to_torch(win)
            assert t.is_cuda and t.data_ptr() == win.data.ptr and t.shape == (2, 3, 28)


@pytest.mark.cuda
@needs_cupy
def test_cuda_selection_matches_the_reference(cupy):
    rng = np.random.default_rng(21)
    s = CudaSelect(cupy)
    for N in (1, 1000, 5 * CHUNK + 77, 300_000):
        priorities = rng.random(N) * 3
        priorities[rng.random(N) < 0.25] = 0.0
        masses_h, sums_h = np.zeros(N), np.zeros(num_chunks(N))
        update_priorities(masses_h, np.arange(N), priorities, 0.6, chunk_sums=sums_h)
        masses, sums = cupy.zeros(N, cupy.float64), cupy.zeros(num_chunks(N), cupy.float64)
        invalid = s.update_priorities(masses, cupy.arange(N, dtype=cupy.int64), cupy.asarray(priorities), 0.6,
                                      chunk_sums=sums)  # fmt: skip
        assert int(invalid) == 0
        np.testing.assert_allclose(masses.get(), masses_h, rtol=1e-14)
        np.testing.assert_allclose(sums.get(), sums_h, rtol=1e-12)
        np.testing.assert_allclose(s.sum_chunks(masses).get(), sums_h, rtol=1e-12)
        if masses_h.sum() == 0:
            continue
        for B in (1, 256, 5000):
            u = rng.random(B)
            slots, probs = s.sample_proportional(masses, cupy.asarray(u), chunk_sums=sums)
            want, _ = sample_proportional(masses_h, u, chunk_sums=sums_h)
            got = slots.get()
            assert (got == want).mean() > 0.999 and (masses_h[got] > 0).all(), (N, B)
            np.testing.assert_allclose(probs.get(), masses_h[got] / masses_h.sum(), rtol=1e-9)
            w = s.importance_weights(probs, N, 0.4).get()
            np.testing.assert_allclose(w, importance_weights(probs.get(), N, 0.4), rtol=1e-6)
        # updates: repeats (last wins), float32 priorities, invalid values counted
        slots_u = np.array([0, N - 1, 0, N, -2] if N > 1 else [0, 0, 1])
        prios_u = np.array([1.0, 2.0, 3.0, 1.0, 1.0] if N > 1 else [4.0, np.nan, 1.0], np.float32)
        n_bad = update_priorities(masses_h, slots_u, prios_u, 0.6, chunk_sums=sums_h)
        bad = s.update_priorities(masses, cupy.asarray(slots_u), cupy.asarray(prios_u), 0.6, chunk_sums=sums)
        assert int(bad) == n_bad
        np.testing.assert_allclose(masses.get(), masses_h, rtol=1e-6)
        np.testing.assert_allclose(sums.get(), sums_h, rtol=1e-6)
    # distribution over many draws
    N = 2 * CHUNK
    p = rng.random(N) + 0.1  # no vanishing expected counts
    masses_h = np.zeros(N)
    update_priorities(masses_h, np.arange(N), p, 1.0)
    masses = cupy.asarray(masses_h)
    counts = np.zeros(N)
    for _ in range(100):
        slots, _ = s.sample_proportional(masses, cupy.random.random(4096))
        counts += np.bincount(slots.get(), minlength=N)
    expected = counts.sum() * masses_h / masses_h.sum()
    chi2 = ((counts - expected) ** 2 / expected).sum()
    assert chi2 < N + 6 * np.sqrt(2 * N)
    # uniform and top-k
    u = rng.random(1000)
    got, got_p = s.sample_uniform(37, cupy.asarray(u), live_slots=cupy.arange(100, 137, dtype=cupy.int64))
    want, want_p = sample_uniform(37, u, live_slots=np.arange(100, 137))
    assert np.array_equal(got.get(), want) and np.allclose(got_p.get(), want_p)
    values = rng.permutation(10_000).astype(np.float64)
    assert s.top_k(cupy.asarray(values), 50).get().tolist() == top_k(values, 50).tolist()
    slots, probs = s.sample_proportional(cupy.zeros(100, cupy.float64), cupy.asarray([0.5]))
    assert slots.get().tolist() == [-1] and probs.get().tolist() == [0.0]


@pytest.mark.cuda
@needs_cupy
@pytest.mark.parametrize("uniform", [False, True])
def test_cuda_replay_kernels_match_their_references(cupy, uniform):
    """The device replay's kernels (draw_items, finish_batch reading the counters and writing the
    status word in mapped host memory, the write-back by key with its atomicMax de-duplication,
    apply_ingest reading its entries in place) on a GPU against the numpy references."""
    check_replay_kernels(CudaSelect(cupy), cupy, uniform, gpu=True)


@pytest.mark.cuda
@needs_cupy
def test_cuda_host_registration_round_trip(cupy):
    nbytes = 16 * PAGE_SIZE
    mm = mmap.mmap(-1, nbytes)
    host = np.frombuffer(mm, dtype=np.uint8)
    host[:] = np.arange(nbytes) % 251
    reg = register_host(cupy, buffer_address(mm), nbytes)
    try:
        mem = cupy.cuda.UnownedMemory(reg.device_pointer(0), nbytes, None, cupy.cuda.runtime.getDevice())
        view = cupy.ndarray((nbytes,), cupy.uint8, cupy.cuda.MemoryPointer(mem, 0))
        assert np.array_equal(view.get(), host)  # the device reads the host bytes in place
        view[:PAGE_SIZE] = 3  # ... and writes them
        cupy.cuda.get_current_stream().synchronize()
        assert (host[:PAGE_SIZE] == 3).all()
        with pytest.raises(cupy.cuda.runtime.CUDARuntimeError, match="AlreadyRegistered"):  # overlap
            register_host(cupy, buffer_address(mm), PAGE_SIZE)
    finally:
        reg.close()
    reg.close()  # idempotent
    with register_host(cupy, buffer_address(mm), nbytes):  # registrable again after close
        pass
    del host, view
    mm.close()
