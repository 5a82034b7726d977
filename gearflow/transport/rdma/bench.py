"""What an RDMA batch costs the learner's CPU, measured without a NIC.

    python -m gearflow.transport.rdma.bench [--batches 50] [--threads N]

One JSON line per workload. Each samples the same table (written by a real Writer) two
ways in one run: ``Table.sample`` (the shared-memory floor) and :class:`RdmaSampler` over
the loopback double (select, plan, one chain, the counter re-read, the seqlock check, the
kind's gather from the staged rows). ``chain_copy_ms`` is the double's own copy of the
chain (a NIC's work); ``learner_cpu_ms`` is the rest, what the learner pays per batch over
a real NIC too. Where pyverbs imports, ``pyverbs_chain_build_ms`` is the cost of making
the batch's SendWR chain (no device needed).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from gearflow.kinds.sequence import Sequence
from gearflow.kinds.transition import Transition
from gearflow.replay import (
    SharedStorage,
    Table,
    TableSpec,
    Writer,
    make_selector,
)
from gearflow.transport.rdma.fabric import LoopbackMemory
from gearflow.transport.rdma.replay import RdmaSampler, RdmaShard, direct_call

ATARI = {"obs": "uint8[4,84,84] stack=4", "action": "int64", "reward": "float32", "done": "bool"}
VECTOR = {"obs": "float32[64]", "action": "int64", "reward": "float32", "done": "bool"}


def _chain_build_ms(n: int) -> float | None:
    """Best of 10: making ``n`` RDMA READ SendWRs (one SGE each), linked, as VerbsMemory does."""
    try:
        import pyverbs.enums as e
        from pyverbs.wr import SGE, SendWR
    except ImportError:
        return None
    best = float("inf")
    for _ in range(10):
        t0 = time.perf_counter()
        nxt, chain = None, []
        for i in range(n):
            wr = SendWR(opcode=e.IBV_WR_RDMA_READ, num_sge=1, sg=[SGE(4096 + 64 * i, 64, 1)], send_flags=0, next_wr=nxt)
            wr.set_wr_rdma(1, 1 << 40)
            chain.append(wr)
            nxt = wr
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def workload(case: str, spec: dict, kind, P: int, S: int, B: int, steps: int, batches: int) -> dict:
    st = SharedStorage.create(TableSpec.parse(spec), P, S)
    table = Table(SharedStorage.attach(st.name), kind, make_selector("prioritized", P * st.items_per_partition, seed=0))
    writer = Writer(SharedStorage.attach(st.name), np.arange(P))
    rng = np.random.default_rng(0)
    try:
        for _ in range(steps):
            writer.append({c.name: rng.integers(0, 255, (P, *c.row_shape)).astype(c.dtype) for c in st.spec})
            L = writer.episode_lengths()
            if isinstance(kind, Sequence):
                for n in kind.due_on_append(int(L[0])):
                    writer.create_items(np.ones(P), np.full(P, n))
            else:
                writer.create_items(np.ones(P), np.minimum(L, 3))
        shard = RdmaShard.loopback(table)
        memory = LoopbackMemory()
        sampler = RdmaSampler(direct_call(shard), memory)
        copy_s = [0.0]
        read_chain = memory.read_chain

        def timed(reads, rkey, fence_last=True):
            t0 = time.perf_counter()
            read_chain(reads, rkey, fence_last)
            copy_s[0] += time.perf_counter() - t0

        memory.read_chain = timed
        for _ in range(8):  # warm-up, and GatherThreads' measuring
            table.sample(B)
            sampler.sample(B)
        t0 = time.perf_counter()
        for _ in range(batches):
            table.sample(B)
        floor = (time.perf_counter() - t0) / batches
        copy_s[0] = 0.0
        t0 = time.perf_counter()
        for _ in range(batches):
            sampler.sample(B)
        rdma = (time.perf_counter() - t0) / batches
        copy = copy_s[0] / batches
        out = {"bench": "rdma_loopback", "case": case, "batch": B, "columns": len(st.spec),
               "table_sample_ms": round(floor * 1e3, 3), "rdma_sample_ms": round(rdma * 1e3, 3),
               "chain_copy_ms": round(copy * 1e3, 3), "learner_cpu_ms": round((rdma - copy) * 1e3, 3),
               "reads_per_batch": sampler.reads_per_batch, "torn_resampled": sampler.torn}  # fmt: skip
        build = _chain_build_ms(sampler.reads_per_batch)
        if build is not None:
            out["pyverbs_chain_build_ms"] = round(build, 3)
        sampler.close()
        shard.close()
        return out
    finally:
        writer.storage.close()
        table.close()
        st.close()
        st.unlink()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m gearflow.transport.rdma.bench", description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=50)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    for case, spec, kind, B in (
        ("apex_transitions_stacked_frames", ATARI, Transition(next_columns=("obs",)), 256),
        ("r2d2_windows_80", VECTOR, Sequence(length=80, period=40), 64),
    ):
        print(json.dumps(workload(case, spec, kind, P=4, S=4000, B=B, steps=3000, batches=args.batches)), flush=True)


if __name__ == "__main__":
    main()
