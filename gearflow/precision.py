"""bf16 learning (``learner.bf16``): autocast over the forward passes only, fp32 for what is computed from them.

The rule every agent's ``learn`` follows (agents/apex_dqn.py, apex_dpg.py,
r2d2_transformer.py, decision_transformer.py)::

    with bf16_forward(self.device, self.bf16):   # the torsos' matmuls and convs in bf16
        q = self.online(obs)                     # (B, A) float32: the network's head runs in fp32
    y = ret + disc * q_next                      # targets, value rescaling, TD errors, priorities,
    td = y - q_sa                                # losses: fp32 tensors, outside autocast
    loss.backward(); clip_grad_norm_(...); optimizer.step()   # outside autocast (PyTorch's advice)

and a network's output layer runs under :func:`fp32` on an fp32 input, so the Q-values /
logits leave the network in fp32::

    with fp32(x):
        return self.head(self.ln(x.float()))     # (B, T, A) float32

Why the head too: bf16 keeps 8 significant bits, so a Q-value near 10 moves in steps of
2⁻⁴ (a TD error of 0.1 is then ±30 %), and R2D2's h⁻¹ turns a bf16 rescaled Q of 0.5 into
−1.0 instead of 1.246 (1 + 4ε(|x| + 1 + ε) rounds to 1). The torso's bf16 error reaches an
fp32 head as a sum of many small independent roundings: on tests/test_bf16_learning.py's
batches the largest target error against fp32 is 0.0018 (Ape-X) and 0.0057 (R2D2), where
the whole-``learn`` autocast gave 0.078 and 0.86.

The learner no longer wraps ``agent.learn`` in autocast: an agent reads ``learner.bf16``
(``settings.bf16``, :class:`~gearflow.agent.AgentSettings`) and applies :func:`bf16_forward` itself, where it knows which
calls are forward passes.
"""

from __future__ import annotations

import contextlib

import torch


def bf16_forward(device: torch.device | str, enabled: bool):
    """bfloat16 autocast on ``device``'s type for a learner's forward passes; when off, nothing
    (an autocast the caller entered still applies)."""
    kind = torch.device(device).type
    if not enabled or not torch.amp.is_autocast_available(kind):
        return contextlib.nullcontext()
    return torch.autocast(kind, dtype=torch.bfloat16)


def fp32(x: torch.Tensor):
    """Autocast off on ``x``'s device type: a network's output layer and what follows it.
    On a device type without autocast (``meta``: the dry run's memory plan) there is nothing
    to turn off."""
    if not torch.amp.is_autocast_available(x.device.type):
        return contextlib.nullcontext()
    return torch.autocast(x.device.type, enabled=False)
