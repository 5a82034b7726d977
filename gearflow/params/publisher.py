"""Weights published without the learn step waiting: :class:`WeightPublisher`.

On a CUDA learner a publish is a snapshot and a hand-over, never a blocking copy::

    learner's stream   snapshot ← parameters (one foreach copy on the device, µs)   → the next step
    side stream        waits for the snapshot, pinned host staging ← snapshot (non_blocking), event
    helper thread      waits for the event, then store.publish(staging) (the shared-memory copy,
                       or the push to the shard nodes), while the learner keeps learning

The snapshot keeps the next optimizer step from changing the weights under the device-to-host
copy; a publish asked for while the helper still holds the previous one is skipped (counted in
:attr:`WeightPublisher.skipped`: the next period publishes newer weights, and versions only grow).
On a CPU learner (``staged=False``, its default) the store copies the weights on the learner's
thread, as it always did: a memcpy of host memory, with nothing to overlap. ``staged=True`` runs
the helper path on a CPU too (the snapshot is the staging copy), which is how it is tested::

    publisher = WeightPublisher(store, agent.learner_network, torch.device("cuda"))
    publisher.publish()      # every learner.publish_every updates; returns at once
    publisher.flush()        # before a checkpoint: the version in the store is the last asked for
    publisher.close()
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["WeightPublisher"]

log = logging.getLogger(__name__)


class WeightPublisher:
    """Publishes ``network()``'s state to ``store`` (a ``ParameterStore``, or anything with
    ``publish(state_or_module)``); see the module docstring."""

    def __init__(self, store: Any, network: Callable[[], torch.nn.Module], device: torch.device | str,
                 staged: bool | None = None):  # fmt: skip
        self.store, self.network = store, network
        self.device = torch.device(device)
        self.staged = self.device.type == "cuda" if staged is None else bool(staged)
        self.published = self.skipped = 0
        self.error: BaseException | None = None  # the helper's last failure (logged; the learner goes on)
        self._names: list[str] = []
        self._source: list[torch.Tensor] = []  # the network's own tensors (state_dict: views, no copies)
        self._snapshot: list[torch.Tensor] = []  # on the device (CUDA only)
        self._staging: dict[str, torch.Tensor] = {}  # on the host (pinned with CUDA): what the store copies
        self._stream = None
        self._idle = threading.Event()  # clear while the helper holds a publish
        self._idle.set()
        self._requests: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None

    def publish(self) -> None:
        """Publish the network's weights now (direct), or hand them to the helper (staged)."""
        if not self.staged:
            self.store.publish(self.network())
            self.published += 1
            return
        if not self._idle.is_set():  # the previous one is still on its way: this period is skipped
            self.skipped += 1
            return
        if not self._source:
            self._setup()
        self._idle.clear()
        if self.device.type == "cuda":
            torch._foreach_copy_(self._snapshot, self._source)  # the learner's stream: D2D, before the next step
            current = torch.cuda.current_stream(self.device)
            with torch.cuda.stream(self._stream):
                self._stream.wait_stream(current)
                torch._foreach_copy_(list(self._staging.values()), self._snapshot, non_blocking=True)
                done = torch.cuda.Event()
                done.record(self._stream)
        else:
            torch._foreach_copy_(list(self._staging.values()), self._source)
            done = None
        self._requests.put(done)

    def _setup(self) -> None:
        state = self.network().state_dict()
        self._names = list(state)
        self._source = [t.detach() for t in state.values()]
        pin = self.device.type == "cuda"
        self._staging = {k: torch.empty(t.shape, dtype=t.dtype, pin_memory=pin) for k, t in zip(self._names, self._source)}
        if self.device.type == "cuda":
            self._snapshot = [torch.empty_like(t) for t in self._source]
            self._stream = torch.cuda.Stream(self.device)
        self._thread = threading.Thread(target=self._run, name="weight-publisher", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            done = self._requests.get()
            if done is False:  # close
                return
            try:
                if done is not None:
                    done.synchronize()  # the helper waits for the copy, never the learner
                self.store.publish(self._staging)
                self.published += 1
            except Exception as exc:  # noqa: BLE001 (a store closed under it at the run's end, a lost node: logged)
                self.error = exc
                log.warning("weights not published: %s", exc)
            finally:
                self._idle.set()

    def flush(self, timeout_s: float = 60.0) -> None:
        """Wait until a staged publish in flight has reached the store."""
        self._idle.wait(timeout_s)

    def close(self) -> None:
        """Stop the helper (after the publish it holds)."""
        if self._thread is not None:
            self._requests.put(False)
            self._thread.join(timeout=30)
            self._thread = None
