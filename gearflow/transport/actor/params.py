"""RemoteParams: the weights an actor on another machine loads, over a shard's ``params.get`` (the actor side).

    params = RemoteParams("10.0.0.5:7000", token=token)   # ParameterSource
    version = params.load_into(network, min_version=3)    # None: nothing newer than version 3
"""

from __future__ import annotations

from typing import Any

import torch

from gearflow.transport.client import as_client
from gearflow.transport.ops import RPC

__all__ = ["RemoteParams"]


class RemoteParams:
    """A :class:`~gearflow.params.protocol.ParameterSource` over a shard's ``params.get``: one
    round trip when nothing is newer, the weights only when the version changed."""

    def __init__(self, address: Any, token: str | None = None, *, timeout_s: float = 30.0, loop: str = "auto"):
        self._client, self._own = as_client(address, token, timeout_s, loop)
        self.timeout_s = float(timeout_s)
        self.fetches = 0  # replies that carried weights

    def load_into(self, module: Any, min_version: int = 0) -> int | None:
        meta, bufs = self._client.call(RPC.PARAMS_GET, {"min_version": int(min_version)}, timeout_s=self.timeout_s)
        if meta.get("version") is None:
            return None
        state = module.state_dict() if isinstance(module, torch.nn.Module) else dict(module)
        names = meta["names"]
        if missing := [k for k in names if k not in state]:
            raise ValueError(f"parameter {missing[0]!r} is not in the module (the store has it)")
        if extra := [k for k in state if k not in names]:
            raise ValueError(f"parameter {extra[0]!r} is missing from the published weights")
        for k, a in zip(names, bufs):  # every shape checked before anything is copied
            if tuple(state[k].shape) != a.shape:
                raise ValueError(f"parameter {k!r} is {list(a.shape)} in the store, {list(state[k].shape)} here")
        with torch.no_grad():
            for k, a in zip(names, bufs):
                state[k].copy_(torch.from_numpy(a))
        self.fetches += 1
        return int(meta["version"])

    def close(self) -> None:
        if self._own:
            self._client.close()
