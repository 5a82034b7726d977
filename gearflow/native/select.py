"""Selection over a device priority vector: CPU references and the CUDA kernels.

The state is a mass vector indexed by slot, as in
:class:`gearflow.replay.selectors.PrioritizedSelector`:

    masses      float64[N]   m_i = p_i ** alpha (0 when p_i == 0, dead slots 0)
    chunk_sums  float64[NC]  NC = ceil(N / CHUNK), the sum of each CHUNK = 4096 masses

a two-level sum tree of fanout 4096. A priority update rewrites the masses of
its slots and the sums of their chunks; a sample scans the chunk sums and
searches one chunk per target. ``chunk_sums`` is optional everywhere: without
it a sample first sums every chunk (one pass over the N masses).

Distribution (the same as ``PrioritizedSelector``): ``P(i) = m_i / sum(m)``,
stratified — draw ``i`` of ``B`` targets the mass point ``(i + u_i) * total / B``
with ``u_i`` uniform in [0, 1) — and importance weights
``w_i = (N_live * P(i)) ** -beta / max_batch (N_live * P(k)) ** -beta``.
The uniforms ``u`` are an argument, drawn by the caller (``rng.random(B)`` on
the host, ``cupy.random.random(B)`` on the device), so a reference and a kernel
given the same ``u`` pick the same slots.

Two implementations with the same signatures:

* module functions — numpy references (:func:`sum_chunks`,
  :func:`update_priorities`, :func:`sample_proportional`, :func:`sample_uniform`,
  :func:`importance_weights`, :func:`top_k`);
* :class:`CudaSelect` — the kernels of ``kernels/select.cu`` (top-k uses CuPy's
  own ``argpartition``/``argsort``: no kernel of ours). Results are CuPy arrays;
  :func:`gearflow.native.cuda_backend.to_torch` hands them to torch (DLPack).

Example (GPU)::

    sel = CudaSelect(cupy)
    masses = cupy.zeros(capacity, cupy.float64)
    sums = cupy.zeros(num_chunks(capacity), cupy.float64)
    sel.update_priorities(masses, slots, priorities, alpha=0.6, chunk_sums=sums)
    slots, probs = sel.sample_proportional(masses, cupy.random.random(256), chunk_sums=sums)
    weights = sel.importance_weights(probs, num_live, beta=0.4)   # float32 (256,)

Invalid values: an update's slot outside ``[0, N)`` is not applied and a
priority that is negative, NaN or infinite is stored as mass 0; both
implementations count them and return the count (an int from the reference, a
0-d uint64 device array from CUDA, so that checking it is the caller's choice
of when to synchronize). A repeated slot takes its *last* priority in both.
With no mass at all, a sample returns slot -1 with probability 0.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from gearflow.native.cuda_backend import (
    Kernels,
    check_device,
    check_float,
    check_int,
    dptr,
    grid_for,
    ptr_arg,
    stream_scope,
)

THREADS = 256  # GF_THREADS in select.cu: threads per block of every kernel
PER_THREAD = 16  # GF_PER_THREAD: consecutive masses one thread sums
CHUNK = THREADS * PER_THREAD  # GF_CHUNK: masses per chunk sum
KERNELS = (
    "set_priorities_f64",
    "set_priorities_f32",
    "chunk_sums",
    "scan_chunk_sums",
    "sample_proportional",
    "sample_uniform",
    "importance_weights",
    "draw_items",
    "finish_batch",
    "mark_updates",
    "apply_updates_f64",
    "apply_updates_f32",
    "apply_ingest",
)
# The device replay's descriptors (select.cu's struct gf_replay / gf_draw): int64 fields, in order.
REPLAY_FIELDS = ("masses", "sums", "live", "live_sums", "start", "seq", "length", "winner", "prio_status",
                 "counters", "N", "NC", "P", "R", "counter_fields", "reserve_field", "trusted_steps")  # fmt: skip
DRAW_FIELDS = ("slots", "probs", "parts", "starts", "seqs", "lengths", "keys", "weights", "probabilities", "flags",
               "status")  # fmt: skip
STATUS_WORDS = ("impossible", "torn", "priorities_applied", "priorities_refused")  # gf_draw.status, int64 each
INGEST_ROWS = ("slot", "priority_bits", "start", "seq", "length", "live")  # apply_ingest's entries, int64 [6, n]
_REF_GROUP = 512  # targets searched at once by the reference ((512, CHUNK) float64 = 16 MiB)

__all__ = [
    "CHUNK",
    "DRAW_FIELDS",
    "REPLAY_FIELDS",
    "STATUS_WORDS",
    "CudaSelect",
    "descriptor",
    "draw_items",
    "importance_weights",
    "num_chunks",
    "sample_proportional",
    "sample_uniform",
    "sum_chunks",
    "top_k",
    "uniforms",
    "update_by_key",
    "update_priorities",
]


def num_chunks(n: int) -> int:
    """Chunk sums of a mass vector of ``n`` slots: ``ceil(n / CHUNK)``."""
    return -(-check_int("n", n, minimum=1) // CHUNK)


# ---------------------------------------------------------------------------- shared logic (numpy or cupy)
def _superseded(xp: Any, slots: Any, n: int) -> Any:
    """bool[K]: entry i is followed by a later entry with the same slot (so the last one wins).

    Sorts ``(slot, position)`` keys, which are distinct, so the result does not
    depend on the sort being stable. Slots outside ``[0, n)`` are clipped to
    -1 / n first (they are rejected later anyway) so the keys cannot overflow.
    """
    K = int(slots.shape[0])
    sup = xp.zeros(K, dtype=xp.bool_)
    if K < 2:
        return sup
    keyed = xp.clip(slots, -1, n)
    key = (keyed + 1) * K + xp.arange(K, dtype=xp.int64)  # (K,) distinct
    order = xp.argsort(key)
    s = keyed[order]
    sup[order[:-1]] = s[:-1] == s[1:]
    return sup


def _top_k(xp: Any, values: Any, k: int) -> Any:
    n = int(values.shape[0])
    k = min(k, n)
    idx = xp.argpartition(-values, k - 1)[:k] if k < n else xp.arange(n)
    return idx[xp.argsort(-values[idx])].astype(xp.int64)  # (k,) largest first


# ---------------------------------------------------------------------------- argument checks
def _host_1d(x: Any, name: str, kinds: str, length: int | None = None) -> np.ndarray:
    a = np.asarray(x)
    if a.ndim != 1:
        raise ValueError(f"{name} must be a 1-D array, got shape {a.shape}")
    if a.size and a.dtype.kind not in kinds:
        what = {"iu": "integers", "f": "floats", "if": "numbers", "iuf": "numbers"}[kinds]
        raise ValueError(f"{name} must hold {what}, got dtype {a.dtype}")
    if length is not None and a.shape != (length,):
        raise ValueError(f"{name} must have shape ({length},), got {a.shape}")
    return a


def _host_masses(masses: Any) -> np.ndarray:
    if not isinstance(masses, np.ndarray) or masses.dtype != np.float64 or masses.ndim != 1:
        raise ValueError(
            f"masses must be a 1-D float64 numpy array, got {type(masses).__name__} "
            f"{getattr(masses, 'dtype', '')} {getattr(masses, 'shape', '')}"
        )
    if masses.size == 0:
        raise ValueError("masses must not be empty")
    if not masses.flags.c_contiguous:
        raise ValueError("masses must be C-contiguous")
    return masses


def _check_u(u: Any) -> np.ndarray:
    u = _host_1d(u, "u", "f")
    if u.size == 0:
        raise ValueError("u must hold at least one uniform (one per draw)")
    return u.astype(np.float64, copy=False)


def _host_chunk_sums(chunk_sums: Any, n: int) -> np.ndarray:
    nc = num_chunks(n)
    if not isinstance(chunk_sums, np.ndarray) or chunk_sums.dtype != np.float64 or chunk_sums.shape != (nc,):
        raise ValueError(
            f"chunk_sums must be a float64 numpy array of shape ({nc},) for {n} masses, "
            f"got {type(chunk_sums).__name__} {getattr(chunk_sums, 'dtype', '')} {getattr(chunk_sums, 'shape', '')}"
        )
    return chunk_sums


# ---------------------------------------------------------------------------- CPU references
def sum_chunks(masses: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """float64[NC]: the sum of each chunk of CHUNK masses (zeros past the end)."""
    masses = _host_masses(masses)
    n = masses.shape[0]
    out = np.empty(num_chunks(n)) if out is None else _host_chunk_sums(out, n)
    full = n // CHUNK
    masses[: full * CHUNK].reshape(full, CHUNK).sum(axis=1, out=out[:full])
    if full < out.shape[0]:
        out[full] = masses[full * CHUNK :].sum()
    return out


def update_priorities(masses, slots, priorities, alpha, *, chunk_sums=None) -> int:
    """Reference: ``masses[slots] = priorities ** alpha`` (0 for priority 0), last repeat wins.

    ``chunk_sums``, when given, is kept current (the chunks of the updated slots
    are summed again). Returns the number of invalid entries (slot out of range:
    skipped; priority negative/NaN/inf: stored as mass 0).

    >>> m = np.zeros(8)
    >>> update_priorities(m, np.array([1, 3, 1]), np.array([4.0, -1.0, 9.0]), 0.5)   # -1.0 is invalid
    1
    >>> m[:4].tolist()                                                                # slot 1: last (9.0) wins
    [0.0, 3.0, 0.0, 0.0]
    """
    masses = _host_masses(masses)
    n = masses.shape[0]
    slots = _host_1d(slots, "slots", "iu").astype(np.int64, copy=False)
    priorities = _host_1d(priorities, "priorities", "f", slots.shape[0]).astype(np.float64, copy=False)
    alpha = check_float("alpha", alpha, minimum=0.0)
    if chunk_sums is not None:
        chunk_sums = _host_chunk_sums(chunk_sums, n)
    keep = ~_superseded(np, slots, n)
    s, p = slots[keep], priorities[keep]
    in_range = (s >= 0) & (s < n)
    ok = np.isfinite(p) & (p >= 0)
    invalid = int(np.count_nonzero(~in_range | ~ok))
    s, p, ok = s[in_range], p[in_range], ok[in_range]
    m = np.zeros(s.shape[0])
    good = ok & (p > 0)
    m[good] = p[good] ** alpha
    masses[s] = m
    if chunk_sums is not None and s.size:
        for k in np.unique(s // CHUNK).tolist():
            chunk_sums[k] = masses[k * CHUNK : (k + 1) * CHUNK].sum()
    return invalid


def sample_proportional(masses, u, *, chunk_sums=None) -> tuple[np.ndarray, np.ndarray]:
    """Reference: stratified proportional draws, ``(slots int64[B], probabilities float64[B])``.

    Target ``i`` is the mass point ``(i + u[i]) * (total / B)``; the chunk, then
    the slot, is the last one with nonzero mass whose exclusive prefix sum is
    <= the (remaining) target — the rule of ``SumTree.find`` and of the kernel.

    >>> m = np.array([1.0, 0.0, 3.0])
    >>> slots, probs = sample_proportional(m, np.array([0.5, 0.5]))   # targets 1.0 and 3.0 of 4.0
    >>> slots.tolist(), probs.tolist()
    ([2, 2], [0.75, 0.75])
    """
    masses = _host_masses(masses)
    n = masses.shape[0]
    u = _check_u(u)
    sums = sum_chunks(masses) if chunk_sums is None else _host_chunk_sums(chunk_sums, n)
    B = u.shape[0]
    prefix = np.cumsum(sums)  # (NC,) inclusive
    total = float(prefix[-1])
    slots = np.full(B, -1, dtype=np.int64)
    probs = np.zeros(B)
    if not total > 0:
        return slots, probs
    targets = np.clip((np.arange(B) + u) * (total / B), 0.0, total)  # (B,)
    k = np.searchsorted(prefix[:-1], targets, side="right")  # last chunk whose exclusive prefix <= target
    before = np.where(k > 0, prefix[k - 1], 0.0)
    empty = ~(prefix[k] > before)
    k = np.where(empty, np.searchsorted(prefix, prefix[k], side="left"), k)  # step back over zero chunks
    rest = targets - np.where(k > 0, prefix[np.maximum(k - 1, 0)], 0.0)  # (B,)
    padded = masses if n % CHUNK == 0 else np.concatenate((masses, np.zeros(sums.shape[0] * CHUNK - n)))
    grid = padded.reshape(-1, CHUNK)  # (NC, CHUNK)
    for lo in range(0, B, _REF_GROUP):
        g = slice(lo, lo + _REF_GROUP)
        block = grid[k[g]]  # (G, CHUNK)
        excl = np.zeros_like(block)
        np.cumsum(block[:, :-1], axis=1, out=excl[:, 1:])  # exclusive prefix within the chunk
        eligible = (block > 0) & (excl <= rest[g, None])
        found = eligible.any(axis=1)
        last = CHUNK - 1 - eligible[:, ::-1].argmax(axis=1)
        slots[g] = np.where(found, k[g] * CHUNK + last, -1)
    hit = slots >= 0
    probs[hit] = masses[slots[hit]] / total
    return slots, probs


def sample_uniform(num_live, u, live_slots=None) -> tuple[np.ndarray, np.ndarray]:
    """Reference: uniform draws with replacement among ``num_live`` slots.

    ``pick = min(floor(u * num_live), num_live - 1)``; the slot is
    ``live_slots[pick]`` (or ``pick`` itself without ``live_slots``);
    probability ``1 / num_live``. With ``live_slots = top_k(priorities, k)``
    this is the ``top_k`` selector.
    """
    n = check_int("num_live", num_live, minimum=1)
    u = _check_u(u)
    if live_slots is not None:
        live_slots = _host_1d(live_slots, "live_slots", "iu")
        if live_slots.shape[0] < n:
            raise ValueError(f"live_slots has {live_slots.shape[0]} entries, fewer than num_live={n}")
    picks = np.clip((u * n).astype(np.int64), 0, n - 1)
    slots = picks if live_slots is None else live_slots[picks].astype(np.int64)
    return slots, np.full(u.shape[0], 1.0 / n)


def importance_weights(probabilities, num_live, beta) -> np.ndarray:
    """Reference: ``(num_live * P) ** -beta`` normalised by its batch max, float32."""
    p = _host_1d(probabilities, "probabilities", "f").astype(np.float64, copy=False)
    if p.size == 0:
        raise ValueError("probabilities must not be empty")
    n = check_int("num_live", num_live, minimum=1)
    beta = check_float("beta", beta, minimum=0.0)
    w = (n * p) ** -beta
    return (w / w.max()).astype(np.float32)


def top_k(values, k) -> np.ndarray:
    """Reference: indices of the ``k`` largest ``values``, largest first (ties in any order)."""
    values = _host_1d(values, "values", "if")
    if values.size == 0:
        raise ValueError("values must not be empty")
    return _top_k(np, values, check_int("k", k, minimum=1))


# ---------------------------------------------------------------------------- the device replay's references
_GOLDEN, _MIX1, _MIX2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer on uint64 arrays (wrapping, as the kernel's gf_mix)."""
    with np.errstate(over="ignore"):
        x = x + _GOLDEN
        x = (x ^ (x >> np.uint64(30))) * _MIX1
        x = (x ^ (x >> np.uint64(27))) * _MIX2
        return x ^ (x >> np.uint64(31))


def uniforms(seed: int, counter: int, n: int) -> np.ndarray:
    """float64[n] in [0, 1): the uniforms ``draw_items`` makes itself (``u`` NULL) for draw number
    ``counter`` of a replay seeded ``seed``: ``(mix(seed ^ mix(counter << 32 + i)) >> 11) / 2**53``.

    >>> u = uniforms(7, 1, 4); bool(((0 <= u) & (u < 1)).all()), bool(uniforms(7, 2, 4)[0] != u[0])
    (True, True)
    """
    i = np.arange(n, dtype=np.uint64)
    with np.errstate(over="ignore"):
        inner = _mix((np.uint64(counter & (2**64 - 1)) << np.uint64(32)) + i)
    bits = _mix(np.uint64(seed & (2**64 - 1)) ^ inner)
    return (bits >> np.uint64(11)).astype(np.float64) / 9007199254740992.0


def _block_exclusive_scan(v: np.ndarray) -> np.ndarray:
    """The kernels' gf_block_exclusive_scan over THREADS values: Hillis-Steele in float64, the
    same additions in the same order, then ``inclusive - v``."""
    x = v.copy()
    offset = 1
    while offset < THREADS:
        x = x + np.concatenate((np.zeros(offset), x[:-offset]))
        offset <<= 1
    return x - v


def _find(masses: np.ndarray, sums: np.ndarray, ui: float, i: int, count: int) -> tuple[int, float, float]:
    """One block of ``draw_items``: (slot or -1, total, the slot's mass), arithmetic as the kernel."""
    N, NC = masses.shape[0], sums.shape[0]
    per = -(-NC // THREADS)
    lo = np.minimum(np.arange(THREADS) * per, NC)
    hi = np.minimum(lo + per, NC)
    run = np.array([np.cumsum(sums[a:b])[-1] if b > a else 0.0 for a, b in zip(lo, hi)])  # sequential adds
    before = _block_exclusive_scan(run)
    total = float(before[-1] + run[-1])
    target = min(max((i + ui) * (total / count), 0.0), total)
    holders = np.flatnonzero((run > 0) & (before <= target))
    chunk, rest = -1, 0.0
    if holders.size:
        t = int(holders[-1])
        acc = float(before[t])
        for k in range(int(lo[t]), int(hi[t])):
            if sums[k] > 0 and acc <= target:
                chunk, rest = k, target - acc
            acc += float(sums[k])
    if chunk < 0:
        return -1, total, 0.0
    first = chunk * CHUNK + np.arange(THREADS) * PER_THREAD
    mine = np.array([np.cumsum(np.concatenate(([0.0], masses[f : min(f + PER_THREAD, N)])))[-1] for f in first])
    in_before = _block_exclusive_scan(mine)
    runs = np.flatnonzero((mine > 0) & (in_before <= rest))
    if not runs.size:
        return -1, total, 0.0
    t = int(runs[-1])
    left, acc, pick = rest - float(in_before[t]), 0.0, -1
    for e in range(int(first[t]), min(int(first[t]) + PER_THREAD, N)):
        if masses[e] > 0 and acc <= left:
            pick = e
        acc += float(masses[e])
    return pick, total, float(masses[pick]) if pick >= 0 else 0.0


def draw_items(masses, live, u, *, chunk_sums=None, live_sums=None) -> tuple[np.ndarray, np.ndarray]:
    """Reference of the fused draw: ``(slots int64[B], probabilities float64[B])`` for the
    uniforms ``u``, stratified over B; proportional to ``masses``, or to ``live`` (1 per live slot)
    when there is no mass at all, as ``PrioritizedSelector`` samples uniformly then. The chunk and
    the slot are found with the kernel's additions in its order (so the picks agree bit for bit),
    and by the same rule as :func:`sample_proportional`.

    >>> draw_items(np.array([1.0, 0.0, 3.0]), np.ones(3), np.array([0.5, 0.5]))[0].tolist()
    [2, 2]
    >>> draw_items(np.zeros(3), np.array([1.0, 0.0, 1.0]), np.array([0.5, 0.5]))   # no mass: uniform
    (array([0, 2]), array([0.5, 0.5]))
    """
    masses, live = _host_masses(masses), _host_masses(live)
    u = _check_u(u)
    sums = sum_chunks(masses) if chunk_sums is None else _host_chunk_sums(chunk_sums, masses.shape[0])
    lsums = sum_chunks(live) if live_sums is None else _host_chunk_sums(live_sums, live.shape[0])
    B = u.shape[0]
    slots, probs = np.full(B, -1, dtype=np.int64), np.zeros(B)
    for i in range(B):
        slot, total, mass = _find(masses, sums, float(u[i]), i, B)
        if not total > 0:
            slot, total, mass = _find(live, lsums, float(u[i]), i, B)
        if slot >= 0:
            slots[i], probs[i] = slot, mass / total
    return slots, probs


def update_by_key(masses, live, seqs, keys, priorities, alpha, P: int, R: int) -> tuple[int, int]:
    """Reference of the device write-back by key (``mark_updates`` + ``apply_updates``): key ``k``
    names slot ``(k % P) * R + (k // P) % R``, held when ``live`` there and ``seqs`` there is
    ``k // P``; the last entry of a held slot wins; it sets ``masses[slot] = p ** alpha`` (0 for
    p == 0; ``alpha < 0``: masses untouched). A priority that is negative, NaN or infinite is
    never applied. Returns ``(applied, refused)``.

    >>> m = np.zeros(4); upd = update_by_key(m, np.ones(4), np.array([0, 0, 1, 1]), [0, 5, 5, 3], [4.0, 1.0, 9.0, 1.0], 0.5, 2, 2)
    >>> upd, m.tolist()    # P=2, R=2: key 5 = seq 2 of partition 1 -> slot 2 holds seq 1: ignored; key 3 -> slot 3
    ((2, 0), [2.0, 0.0, 0.0, 1.0])
    """
    keys = _host_1d(keys, "keys", "iu").astype(np.int64, copy=False)
    priorities = _host_1d(priorities, "priorities", "f", keys.shape[0]).astype(np.float64, copy=False)
    ok = np.isfinite(priorities) & (priorities >= 0)
    refused = int(np.count_nonzero(~ok))
    winners: dict[int, int] = {}
    for i, k in enumerate(keys.tolist()):
        if k < 0:
            continue
        seq = k // P
        s = (k % P) * R + seq % R
        if s < masses.shape[0] and live[s] > 0 and seqs[s] == seq:
            winners[s] = i
    applied = 0
    for s, i in winners.items():
        if not ok[i]:
            continue
        applied += 1
        if alpha >= 0:
            masses[s] = priorities[i] ** alpha if priorities[i] > 0 else 0.0
    return applied, refused


def descriptor(cupy: Any, fields: tuple[str, ...], values: dict[str, Any]) -> Any:
    """A select.cu descriptor (``struct gf_replay`` / ``gf_draw``): int64[len(fields)] on the
    device, each field the device pointer of an array (anything with ``__cuda_array_interface__``,
    or an int taken as a pointer) or an int. Made once per replay / buffer set."""
    missing = [f for f in fields if f not in values]
    if missing:
        raise ValueError(f"descriptor: no value for {', '.join(missing)}")
    row = [dptr(v) if hasattr(v, "__cuda_array_interface__") else int(v) for v in (values[f] for f in fields)]
    return cupy.asarray(np.array(row, dtype=np.int64))


# ---------------------------------------------------------------------------- CUDA
class CudaSelect:
    """The selection kernels of ``kernels/select.cu``, launched through an injected CuPy.

    ``cupy`` is the CuPy module (``require_cupy(...)``), ``module`` a compiled
    ``RawModule`` of ``select.cu`` (default: compiled on first use). Methods
    have the reference signatures plus ``stream=`` (a CuPy stream; default the
    current one). Arguments may be CuPy arrays, other device arrays (CUDA Array
    Interface, viewed without a copy) or host arrays (uploaded on the stream).
    ``masses`` and ``chunk_sums`` are device state and must be device arrays.
    Results are fresh CuPy arrays from CuPy's memory pool; nothing synchronizes.
    """

    def __init__(self, cupy: Any, module: Any = None) -> None:
        self.cupy = cupy
        self._kernels = Kernels(cupy, "select", module)

    @property
    def module(self) -> Any:
        """The compiled ``RawModule`` (compiled on first use unless one was injected)."""
        return self._kernels.module

    # -- argument helpers
    def _masses(self, masses: Any) -> Any:
        m = check_device(masses, "masses", dtype=np.float64, ndim=1)
        if m.shape[0] == 0:
            raise ValueError("masses must not be empty")
        return m

    def _chunk_sums(self, chunk_sums: Any, n: int) -> Any:
        return check_device(chunk_sums, "chunk_sums", dtype=np.float64, shape=(num_chunks(n),))

    def _array(self, x: Any, name: str, kinds: str, dtypes: tuple, length: int | None = None) -> Any:
        """``x`` as a 1-D contiguous CuPy array of one of ``dtypes`` (host arrays are converted
        to ``dtypes[0]`` and uploaded; device arrays must already have one of them)."""
        cp = self.cupy
        if hasattr(x, "__cuda_array_interface__"):
            a = check_device(x, name, ndim=1)
            if a.dtype not in [np.dtype(d) for d in dtypes]:
                allowed = " or ".join(str(np.dtype(d)) for d in dtypes)
                raise ValueError(f"{name} must have dtype {allowed}, got {a.dtype}")
            if length is not None and a.shape != (length,):
                raise ValueError(f"{name} must have shape ({length},), got {a.shape}")
            return cp.asarray(x)  # a CuPy view of the same memory
        host = _host_1d(x, name, kinds, length)
        dtype = host.dtype if host.dtype in [np.dtype(d) for d in dtypes] else np.dtype(dtypes[0])
        return cp.asarray(np.ascontiguousarray(host, dtype=dtype))

    # -- operations
    def sum_chunks(self, masses, out=None, *, stream=None):
        """Queue ``out[k] = sum of chunk k`` for every chunk; returns ``out`` (float64[NC])."""
        cp = self.cupy
        m = self._masses(masses)
        n = m.shape[0]
        nc = num_chunks(n)
        with stream_scope(stream):
            out = cp.empty(nc, dtype=cp.float64) if out is None else out
            o = self._chunk_sums(out, n)
            args = (ptr_arg(m.ptr), np.int64(n), ptr_arg(0), np.int64(nc), ptr_arg(o.ptr))
            self._kernels.launch("chunk_sums", grid_for(nc, 1), (THREADS, 1, 1), args)
        return out

    def update_priorities(self, masses, slots, priorities, alpha, *, chunk_sums=None, stream=None):
        """Queue the priority scatter (see :func:`update_priorities`); returns the invalid count
        as a 0-d uint64 CuPy array (read it when a synchronization is acceptable)."""
        cp = self.cupy
        m = self._masses(masses)
        n = m.shape[0]
        alpha = check_float("alpha", alpha, minimum=0.0)
        cs = None if chunk_sums is None else self._chunk_sums(chunk_sums, n)
        with stream_scope(stream):
            s = self._array(slots, "slots", "iu", (np.int64,))
            K = int(s.shape[0])
            if (n + 2) * K >= 2**63:
                raise ValueError(f"{K} slots over {n} masses overflow the de-duplication keys")
            p = self._array(priorities, "priorities", "f", (np.float64, np.float32), K)
            invalid = cp.zeros((), dtype=cp.uint64)
            if K == 0:
                return invalid
            skip = _superseded(cp, s, n)
            kernel = "set_priorities_f32" if p.dtype == np.float32 else "set_priorities_f64"
            args = (
                ptr_arg(m.ptr), np.int64(n), ptr_arg(dptr(s)), ptr_arg(dptr(p)),
                ptr_arg(dptr(skip)), np.int64(K), np.float64(alpha), ptr_arg(dptr(invalid)),
            )  # fmt: skip
            self._kernels.launch(kernel, grid_for(K, THREADS), (THREADS, 1, 1), args)
            if cs is not None:
                nc = num_chunks(n)
                if K < nc:  # re-sum the chunks of the updated slots: one block per slot
                    args = (ptr_arg(m.ptr), np.int64(n), ptr_arg(dptr(s)), np.int64(K), ptr_arg(cs.ptr))
                    self._kernels.launch("chunk_sums", grid_for(K, 1), (THREADS, 1, 1), args)
                else:  # as many updates as chunks: one pass over all of them costs no more
                    args = (ptr_arg(m.ptr), np.int64(n), ptr_arg(0), np.int64(nc), ptr_arg(cs.ptr))
                    self._kernels.launch("chunk_sums", grid_for(nc, 1), (THREADS, 1, 1), args)
        return invalid

    def sample_proportional(self, masses, u, *, chunk_sums=None, stream=None):
        """Queue stratified proportional draws; returns ``(slots int64[B], probabilities float64[B])``."""
        cp = self.cupy
        m = self._masses(masses)
        n = m.shape[0]
        nc = num_chunks(n)
        cs = None if chunk_sums is None else self._chunk_sums(chunk_sums, n)
        with stream_scope(stream):
            uu = self._array(u, "u", "f", (np.float64,))
            B = int(uu.shape[0])
            if B == 0:
                raise ValueError("u must hold at least one uniform (one per draw)")
            if cs is None:
                sums = self.sum_chunks(masses)
                cs = check_device(sums, "chunk_sums", dtype=np.float64, shape=(nc,))
            prefix = cp.empty(nc, dtype=cp.float64)
            slots = cp.empty(B, dtype=cp.int64)
            probs = cp.empty(B, dtype=cp.float64)
            self._kernels.launch("scan_chunk_sums", (1, 1, 1), (THREADS, 1, 1),
                   (ptr_arg(cs.ptr), np.int64(nc), ptr_arg(dptr(prefix))))  # fmt: skip
            args = (
                ptr_arg(m.ptr), np.int64(n), ptr_arg(dptr(prefix)), np.int64(nc),
                ptr_arg(dptr(uu)), np.int64(B), ptr_arg(dptr(slots)), ptr_arg(dptr(probs)),
            )  # fmt: skip
            self._kernels.launch("sample_proportional", grid_for(B, 1), (THREADS, 1, 1), args)
        return slots, probs

    def sample_uniform(self, num_live, u, live_slots=None, *, stream=None):
        """Queue uniform draws (see :func:`sample_uniform`); returns ``(slots, probabilities)``."""
        cp = self.cupy
        n = check_int("num_live", num_live, minimum=1)
        with stream_scope(stream):
            uu = self._array(u, "u", "f", (np.float64,))
            B = int(uu.shape[0])
            if B == 0:
                raise ValueError("u must hold at least one uniform (one per draw)")
            live_ptr = 0
            if live_slots is not None:
                live = self._array(live_slots, "live_slots", "iu", (np.int64,))
                if live.shape[0] < n:
                    raise ValueError(f"live_slots has {live.shape[0]} entries, fewer than num_live={n}")
                live_ptr = dptr(live)
            slots = cp.empty(B, dtype=cp.int64)
            probs = cp.empty(B, dtype=cp.float64)
            args = (
                ptr_arg(dptr(uu)), np.int64(B), np.int64(n), ptr_arg(live_ptr),
                ptr_arg(dptr(slots)), ptr_arg(dptr(probs)),
            )  # fmt: skip
            self._kernels.launch("sample_uniform", grid_for(B, THREADS), (THREADS, 1, 1), args)
        return slots, probs

    def importance_weights(self, probabilities, num_live, beta, *, stream=None):
        """Queue the IS weights (see :func:`importance_weights`); returns float32[B]."""
        cp = self.cupy
        n = check_int("num_live", num_live, minimum=1)
        beta = check_float("beta", beta, minimum=0.0)
        with stream_scope(stream):
            p = self._array(probabilities, "probabilities", "f", (np.float64,))
            B = int(p.shape[0])
            if B == 0:
                raise ValueError("probabilities must not be empty")
            weights = cp.empty(B, dtype=cp.float32)
            args = (ptr_arg(dptr(p)), np.int64(B), np.float64(n), np.float64(beta), ptr_arg(dptr(weights)))
            self._kernels.launch("importance_weights", (1, 1, 1), (THREADS, 1, 1), args)
        return weights

    # -- the device replay's kernels: arguments are device pointers (descriptors, scratch), checked
    # by their owner (DeviceReplay) once; no array is allocated here.
    def draw_items(self, replay: int, draw: int, count: int, *, rows: int = 0, u: int = 0, seed: int = 0,
                   counter: int = 0) -> None:  # fmt: skip
        """Queue ``count`` fused draws into the rows (``rows``: an int64[count] device array's pointer,
        0 for rows 0..count-1) of the draw descriptor ``draw`` over the replay descriptor ``replay``;
        uniforms from ``u`` (a float64[count] pointer) or made in the kernel from ``(seed, counter)``."""
        args = (ptr_arg(replay), ptr_arg(draw), ptr_arg(rows), np.int64(count), ptr_arg(u),
                np.uint64(seed & (2**64 - 1)), np.uint64(counter & (2**64 - 1)))  # fmt: skip
        self._kernels.launch("draw_items", grid_for(count, 1), (THREADS, 1, 1), args)

    def finish_batch(self, replay: int, draw: int, batch_size: int, num_live: int, beta: float) -> None:
        """Queue the batch's seqlock check, keys, probabilities, IS weights, flags and status word."""
        args = (ptr_arg(replay), ptr_arg(draw), np.int64(batch_size), np.float64(num_live), np.float64(beta))
        self._kernels.launch("finish_batch", (1, 1, 1), (THREADS, 1, 1), args)

    def update_by_key(self, replay: int, keys: int, priorities: int, count: int, f32: bool, tag: int, alpha: float,
                      scratch: int, masses: int, N: int, sums: int | None, num_chunks_: int) -> None:  # fmt: skip
        """Queue a write-back of ``count`` priorities (float32 when ``f32``, else float64) by
        int64 keys, all device pointers: mark (de-duplication by ``tag``), apply, re-sum the changed
        chunks (``sums`` None: the uniform selector, masses untouched, ``alpha`` ignored)."""
        grid = grid_for(count, THREADS)
        self._kernels.launch("mark_updates", grid, (THREADS, 1, 1),
                             (ptr_arg(replay), ptr_arg(keys), np.int64(count), np.uint64(tag), ptr_arg(scratch)))
        name = "apply_updates_f32" if f32 else "apply_updates_f64"
        self._kernels.launch(name, grid, (THREADS, 1, 1), (ptr_arg(replay), ptr_arg(scratch), ptr_arg(priorities),
                             np.int64(count), np.uint64(tag), np.float64(alpha if sums is not None else -1.0)))
        if sums is not None:
            self._resum(masses, N, scratch, count, sums, num_chunks_)

    def apply_ingest(self, replay: int, entries: int, count: int, alpha: float, vectors: tuple) -> None:
        """Queue ingest/eviction ``entries`` (int64 [6, count], a device-readable pointer: mapped
        host memory) and the re-sums of their chunks; ``vectors``: ``((masses, sums), ...)`` pointers
        to re-sum (masses, then live when it is another vector), with ``N`` and ``NC``."""
        self._kernels.launch("apply_ingest", grid_for(count, THREADS), (THREADS, 1, 1),
                             (ptr_arg(replay), ptr_arg(entries), np.int64(count), np.float64(alpha)))
        for vec, sums, N, NC in vectors:
            self._resum(vec, N, entries, count, sums, NC)

    def _resum(self, vec: int, N: int, slots: int, count: int, sums: int, NC: int) -> None:
        if count < NC:  # a block per entry's chunk (entries that changed nothing are -1: skipped)
            args = (ptr_arg(vec), np.int64(N), ptr_arg(slots), np.int64(count), ptr_arg(sums))
            self._kernels.launch("chunk_sums", grid_for(count, 1), (THREADS, 1, 1), args)
        else:  # as many entries as chunks: one pass over all of them costs no more
            args = (ptr_arg(vec), np.int64(N), ptr_arg(0), np.int64(NC), ptr_arg(sums))
            self._kernels.launch("chunk_sums", grid_for(NC, 1), (THREADS, 1, 1), args)

    def top_k(self, values, k, *, stream=None):
        """Indices of the ``k`` largest ``values``, largest first: CuPy's argpartition + argsort
        (no kernel of ours). Ties at the cutoff are broken in any order."""
        k = check_int("k", k, minimum=1)
        with stream_scope(stream):
            v = self._array(values, "values", "if", (np.float64, np.float32, np.int64, np.int32))
            if v.shape[0] == 0:
                raise ValueError("values must not be empty")
            return _top_k(self.cupy, v, k)
