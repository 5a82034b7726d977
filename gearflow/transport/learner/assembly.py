"""What a :class:`~gearflow.transport.learner.sampler.RemoteSampler` makes of the shards'
replies, apart from asking for them: the shards must agree on what they hold
(:func:`check_shards_agree`), their rows become one batch (:class:`BatchAssembly`: keys tagged
with their shard, probabilities ``q_i · m/T_i``, IS weights over the batch), their stats one
row (:func:`summed_stats`), and priorities go out as the arrays a shard takes
(:func:`priority_arrays`); torn rows are redrawn (:meth:`BatchAssembly.mend`).

    agree = check_shards_agree(infos, [c.address_text for c in clients])
    assembly = BatchAssembly(selector, num_buffers=3)
    batch = assembly.combine(batch_size, q, replies, count)
"""

from __future__ import annotations

import time

import numpy as np
import torch

from gearflow.replay.rate_limiter import RateLimiterTimeout
from gearflow.replay.layout import PROPORTIONAL_SELECTORS, SHARD_SHIFT, RedrawRounds, key_shard, shard_key
from gearflow.replay.selectors import check_priorities
from gearflow.replay.table import Sample

__all__ = ["SUMMED", "BatchAssembly", "check_shards_agree", "priority_arrays", "split_round", "summed_stats", "torn_of"]

SUMMED = ("replay/size", "replay/inserts", "replay/samples", "replay/evictions", "replay/torn_resampled",
          "replay/steps", "replay/bytes", "replay/remote_partitions")  # fmt: skip


def check_shards_agree(infos: list[dict], addresses: list[str]) -> None:
    """Several shards sample as one table only when each holds shard 0's spec, item kind,
    selector (a proportional one) and ``alpha``, and its rate limiter (``replay.info``'s
    ``rate_limiter``, where every shard reports one); ``ValueError`` naming the shard otherwise."""
    first, n = infos[0], len(infos)
    for i, info in enumerate(infos[1:], 1):
        if info["spec"] != first["spec"] or info["kind"] != first["kind"]:
            raise ValueError(f"shard {i} ({addresses[i]}) holds another spec or item kind than shard 0")
        if info["selector"] != first["selector"] or info.get("alpha") != first.get("alpha"):
            raise ValueError(f"shard {i} ({addresses[i]}) selects with {info['selector']} "
                             f"(alpha {info.get('alpha')}), shard 0 with {first['selector']} (alpha "
                             f"{first.get('alpha')}): several shards sample as one table only with one selector")  # fmt: skip
    if n > 1 and first["selector"] not in PROPORTIONAL_SELECTORS:
        raise ValueError(f"the shards' {first['selector']!r} selector ranks the items of one table: there is no "
                         f"global order over {n} shards, so their draws cannot be one table's; use "
                         f"{' or '.join(PROPORTIONAL_SELECTORS)}, or sample one shard")  # fmt: skip
    if n > 1 and all("rate_limiter" in info for info in infos):
        for i, info in enumerate(infos[1:], 1):
            if info["rate_limiter"] != first["rate_limiter"]:
                raise ValueError(f"shard {i} ({addresses[i]}) limits its rate with "
                                 f"{info['rate_limiter']}, shard 0 with {first['rate_limiter']}: several shards "
                                 f"are paced as one table only with one rate limiter")  # fmt: skip


def split_round(totals: np.ndarray, live: list[int], batch_size: int, rng) -> tuple[np.ndarray, list[int]]:
    """One round's split over the shards: ``q = T / ΣT`` over the live shards' ``totals`` (a
    down shard is out of it; nothing known yet: even over the live ones, and said so by ``q``)
    and ``b ~ Multinomial(batch_size, q)``. ``totals`` is changed (the down shards' set to 0)."""
    up = np.zeros(totals.size, dtype=bool)
    up[live] = True
    totals[~up] = 0.0
    s = float(totals.sum())
    q = totals / s if s > 0 else up / up.sum()
    return q, rng.multinomial(batch_size, q).tolist()


def torn_of(address: str, i: int, torn: np.ndarray, b: int) -> np.ndarray:
    """Positions a reply's ``torn`` buffer marks (checked: uint8, one per item)."""
    if torn.dtype != np.uint8 or torn.shape != (b,):
        raise ValueError(f"shard {i} ({address}) sent a torn buffer of {torn.dtype}{list(torn.shape)} for {b} items")
    return np.flatnonzero(torn)


def priority_arrays(keys, priorities) -> tuple[np.ndarray, np.ndarray]:
    """``(keys, priorities)`` as a shard takes them: int64 keys, float32 or float64 priorities
    as they are (the shard's table converts as a local one does), bf16/fp16 as float32; the
    same number of each and every priority valid (``ValueError`` otherwise)."""
    keys = np.ascontiguousarray(torch.as_tensor(keys).cpu().numpy(), dtype=np.int64).reshape(-1)
    if isinstance(priorities, torch.Tensor):
        p = priorities.detach()
        p = (p.float() if p.dtype in (torch.bfloat16, torch.float16) else p).cpu().numpy()
    else:
        p = np.asarray(priorities)
    prios = np.ascontiguousarray(p.reshape(-1), dtype=p.dtype if p.dtype in (np.float32, np.float64) else np.float64)
    if keys.shape != prios.shape:
        raise ValueError(f"{keys.size} keys but {prios.size} priorities")
    check_priorities(prios)
    return keys, prios


def summed_stats(per: list[dict]) -> dict[str, float]:
    """The shards' stats as one table's: counts (:data:`SUMMED`, ``transport/*``) summed,
    ``*_min`` the smallest, the rest (fill, rates) averaged."""
    out: dict[str, float] = {}
    for k in per[0]:
        vals = [s.get(k, 0.0) for s in per]
        out[k] = float(sum(vals)) if (k in SUMMED or k.startswith("transport/")) else (
            float(min(vals)) if k.endswith("_min") else float(np.mean(vals)))
    return out


class BatchAssembly:
    """The shards' replies of one round as one batch, into ``num_buffers`` reused sets of
    tensors (a batch stays valid until ``num_buffers`` more are made). ``selector``: the
    sampler's :class:`~gearflow.replay.protocols.SelectorInfo` (its ``beta`` and whether it
    weighs by importance)."""

    def __init__(self, selector, num_buffers: int):
        self.selector, self.num_buffers = selector, int(num_buffers)
        self._buffers: list[dict[str, torch.Tensor]] = []
        self._buffer_batch, self._next = -1, 0

    def is_weights(self, count: float, probs: np.ndarray, meta: dict) -> np.ndarray | None:
        """IS weights ``(N·P)^-β / max`` over the batch (a local table's rule); None without
        importance sampling (uniform: the shards' weights, ones, stand). β: the learner's, else
        the shard's (``meta``)."""
        beta = self.selector.beta if self.selector.beta is not None else meta.get("beta")
        if beta is None or not self.selector.importance_sampled:
            return None
        w = (count * probs) ** -float(beta)
        return w / w.max()

    def mend(self, reply: tuple, address: str, redraw, timeout_s: float, redrawn) -> tuple:
        """A reply sent out of the shard's segment ends with ``torn``: items a writer overwrote
        while the reply was written. Each is replaced by a fresh draw from the same shard
        (``redraw(n) -> (meta, bufs)``, until none is torn), and the batch reweighed against the
        shard's newest total, as a local table replaces torn items; :class:`RateLimiterTimeout`
        after ``timeout_s`` (``redrawn()``: items redrawn so far, for its message)."""
        i, b, meta, bufs = reply
        if not meta.get("torn"):
            return reply
        *bufs, torn = bufs
        bad = torn_of(address, i, torn, b)
        if not bad.size:
            return i, b, meta, bufs
        masses = bufs[1] * max(float(meta["total"]), 0.0)  # each item's mass at its draw
        deadline, rounds = time.monotonic() + timeout_s, RedrawRounds(bad.size)
        while bad.size:
            if time.monotonic() > deadline:  # as a local table gives up
                raise RateLimiterTimeout(f"replay: writers kept overwriting the drawn items of shard {i} faster than "
                                         f"they could be sent ({redrawn()} redrawn so far); its rings are too small "
                                         f"for the write rate")  # fmt: skip
            part, rest = rounds.take(bad)  # as many rows a round as a slowed link can win
            meta, fresh = redraw(int(part.size))
            again = torn_of(address, i, fresh.pop(), part.size) if meta.get("torn") else part[:0]
            for a, f in zip(bufs, fresh):
                a[part] = f
            masses[part] = fresh[1] * max(float(meta["total"]), 0.0)
            rounds.lost(part.size, again.size)
            bad = np.concatenate([part[again], rest])
        total = max(float(meta["total"]), 0.0)
        if total > 0:
            np.divide(masses, total, out=bufs[1])  # one normalisation, against the shard now
            w = self.is_weights(float(meta["count"]), bufs[1], meta)
            if w is not None:
                bufs[2][:] = w
        return i, b, meta, bufs

    def _out(self, batch_size: int, meta: dict, bufs: list) -> dict[str, torch.Tensor]:
        if batch_size != self._buffer_batch:
            names = ["keys", "probabilities", "weights", *meta["names"]]
            self._buffers = [{n: torch.empty((batch_size, *a.shape[1:]), dtype=torch.from_numpy(a[:0]).dtype)
                              for n, a in zip(names, bufs)} for _ in range(self.num_buffers)]  # fmt: skip
            self._buffer_batch = batch_size
        out = self._buffers[self._next]
        self._next = (self._next + 1) % self.num_buffers
        return out

    def combine(self, batch_size: int, q: np.ndarray, replies: list, count: float) -> Sample:
        """The shards' rows (``replies``: ``(shard, items, meta, bufs)``) in one batch: keys
        tagged with their shard, ``P = q_i · m/T_i`` (the shard reports ``m/T_i`` at its draw),
        IS weights ``(N·P)^-β / max`` over the batch with ``N = count``, the shards' live items
        at the draws (a local table's normalisation)."""
        out = self._out(batch_size, replies[0][2], replies[0][3])
        names = ["keys", "probabilities", "weights", *replies[0][2]["names"]]
        row = 0
        probs = np.empty(batch_size)
        for i, b, meta, bufs in replies:
            for n, a in zip(names, bufs):
                out[n][row:row + b] = torch.from_numpy(a)
            keys = out["keys"][row:row + b]
            if int(key_shard(keys.max())):
                raise ValueError(f"shard {i} returned a key ≥ 2^{SHARD_SHIFT}: cannot tag it with the shard")
            shard_key(keys, i)
            np.multiply(bufs[1], q[i], out=probs[row:row + b])
            row += b
        w = self.is_weights(count, probs, replies[0][2])
        if w is not None:
            out["weights"].copy_(torch.from_numpy(w))
        out["probabilities"].copy_(torch.from_numpy(probs))
        return Sample(data={n: out[n] for n in names[3:]}, keys=out["keys"], weights=out["weights"],
                      probabilities=out["probabilities"])  # fmt: skip
