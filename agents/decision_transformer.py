"""Online Decision Transformer: Zheng, Zhang & Grover 2022, "Online Decision Transformer", https://arxiv.org/abs/2202.05607

A Decision Transformer (Chen et al. 2021) models a trajectory as the token
sequence (R̂_1, s_1, a_1, R̂_2, s_2, a_2, ...), R̂_t the return-to-go, and is
trained to predict a_t from the tokens up to s_t. Online (ODT): actors act
conditioned on a *target* return, whole episodes go into replay, and the
learner relabels every stored episode with the returns it actually got
(hindsight), so the model learns which actions lead to which returns. Reads top
to bottom: the config, returns-to-go and windows (shared by tests and the
offline loader), then the agent. The network and its tanh-Gaussian policy head
are :mod:`agents.dt_model`, the cached actor's compiled step :mod:`agents.dt_accel`;
both are importable from here too.

Replay layout (one row per step; an episode of L actions is L rows, the final
observation is not stored: a DT never bootstraps)::

    row t:  obs_t  action_t  reward_t (r after action_t)  timestep t (step index in the episode)

Items are ``Episode`` items: the last ``min(L, T)`` rows of a finished episode,
``T = replay.max_episode_length`` (an item always ends at its episode's end, so
the returns-to-go of its rows are exact). Priority = the item's return
(``agent.priority=return``, plus ``agent.return_offset``, clipped at 0) or its
length (``length``); ``replay.selector=top_k`` / ``max_heap`` then train on the
best episodes, ``prioritized`` with α = 1 and ``length`` is ODT's
length-proportional trajectory sampling. Per learner batch::

    item b (rows 0..L_b-1)  →  R̂_t = Σ_{t' ≥ t} r_t'                  (hindsight relabelling)
    window start s_b ~ U{0 .. L_b-1} (ODT), rows s_b .. s_b+K-1, masked at L_b
    loss = masked mean over valid steps of  −log π(a_t | R̂_≤t, s_≤t, a_<t)
           (discrete: cross-entropy; continuous: tanh-Gaussian NLL − λ·entropy, λ learned
            toward the target entropy −|A|, as in ODT)

Acting (``gearflow.kinds.episode.EpisodeActor``): each env keeps its last K
(R̂, obs, action, timestep); R̂_0 = ``agent.target_return`` and R̂_{t+1} = R̂_t −
r_{t+1}. Per env, with probability ε (the actor's ε ladder) the action is sampled
from the policy, otherwise it is the policy's mode; ε = 0 is greedy evaluation.

Windows are left-aligned (valid steps first) and attention is causal, so padding
after a window's last step never changes a valid step's output: no key mask is
needed, in the learner or the actor.

Actors cache keys and values (``agent.kv_cache``, :meth:`Agent.act_cached`,
:mod:`agents.kv_cache`): each env step runs the network on its three new
tokens a_{t−1}, R̂_t, s_t only. A full context hops (drops its oldest
``agent.context_hop`` steps, default K // 2) and is re-encoded, as at an
episode's start and after new weights; the actions then equal a full recompute
over the same K − H + 1 .. K steps (timesteps are embedded by episode step, so
a step's tokens do not depend on where the context starts).
A step's three tokens run through :class:`~agents.dt_accel.StepTokens`, compiled
with TorchScript (written into the env's next three slots in place, no
per-module Python); rows that re-encode take
:meth:`~agents.dt_model.DecisionTransformer.extend`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from agents.dt_accel import StepTokens, compile_step_tokens
from agents.dt_model import Block, DecisionTransformer, tanh_normal, tanh_normal_mode
from agents.kv_cache import KVCache, hop_length
from gearflow.agent import ActOutput, AgentSettings, EnvSpec, learner_state, load_learner_state
from gearflow.errors import ConfigError
from gearflow.kinds.episode import Episode
from gearflow.precision import bf16_forward

# Block, DecisionTransformer, tanh_normal(_mode): agents/dt_model.py; StepTokens, compile_step_tokens:
# agents/dt_accel.py (importable from here, as before they moved)
__all__ = ["Agent", "Block", "Config", "DecisionTransformer", "StepTokens", "compile_step_tokens", "item_priority",
           "returns_to_go", "sample_windows", "tanh_normal", "tanh_normal_mode"]  # fmt: skip


@dataclass
class Config:
    context: int = 20
    """K: steps per training window and per actor context (3K tokens)."""
    d_model: int = 128
    """Width of the transformer's residual stream."""
    num_layers: int = 3
    """Transformer blocks."""
    num_heads: int = 1
    """Attention heads per block (``d_model`` must be divisible by it)."""
    mlp_ratio: int = 4
    """Hidden width of each block's MLP, in multiples of ``d_model``."""
    dropout: float = 0.1
    """Dropout on embeddings, attention output and MLP (learner only; actors run in eval mode)."""
    max_timestep: int = 0
    """Size of the timestep embedding; 0: ``replay.max_episode_length`` (later steps share the last)."""
    target_return: float = 500.0
    """R̂_0: the return actors condition on (ODT uses a multiple of the best return seen)."""
    rtg_scale: float = 100.0
    """Returns-to-go are divided by this before they are embedded."""
    priority: str = "return"
    """Item priority: ``return`` (the episode's return, for top_k / max_heap selection) or ``length``."""
    return_offset: float = 0.0
    """Added to returns for priorities (priorities must be ≥ 0: e.g. 2000 for Pendulum's negative returns)."""
    lr: float = 1e-4
    """AdamW learning rate (after warm-up)."""
    weight_decay: float = 5e-4
    """AdamW weight decay."""
    warmup_updates: int = 1000
    """Updates of linear learning-rate warm-up (ODT: 10000)."""
    max_grad_norm: float = 0.25
    """Global gradient-norm clip."""
    init_temperature: float = 0.1
    """Continuous actions: initial entropy temperature λ."""
    target_entropy: float | None = None
    """Continuous actions: entropy target of λ's update; None: −(action dimensions), as in ODT."""
    kv_cache: bool = True
    """Actors cache each env's keys and values and run the network on a step's new tokens only
    (a_{t−1}, R̂_t, s_t), re-encoding the context when it hops and when the weights change (false:
    re-run the last ``context`` steps every step)."""
    context_hop: int = 0
    """With ``kv_cache``: steps a full context drops at once (0: ``context // 2``); the actor's context
    is then ``context − hop + 1`` to ``context`` steps, the same steps a recompute attends over."""


# ----------------------------------------------------------------------------- returns-to-go and windows


def returns_to_go(reward: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """R̂_t = Σ_{t' ≥ t} r_t' over the valid steps of each row (B, T); 0 on padding.

    >>> returns_to_go(torch.tensor([[1., 0., 2., 0.]]), torch.tensor([[True, True, True, False]]))
    tensor([[3., 2., 2., 0.]])
    """
    r = torch.where(mask, reward.float(), torch.zeros((), dtype=torch.float32, device=reward.device))
    rtg = r.flip(1).cumsum(1).flip(1)  # (B, T)
    return torch.where(mask, rtg, torch.zeros_like(rtg))


def item_priority(ret: torch.Tensor, length: torch.Tensor, how: str, offset: float) -> torch.Tensor:
    """Priority of episode items (B,): ``return`` → max(ret + offset, 0), ``length`` → length."""
    if how == "length":
        return length.double()
    return (ret.double() + offset).clamp(min=0.0)


def sample_windows(data: dict, K: int, generator: torch.Generator | None = None, starts=None) -> dict:
    """K-step windows of episode items, hindsight-relabelled.

    ``data``: an ``Episode`` batch (``obs`` (B, T, ...), ``action``, ``reward``, ``timestep``,
    ``mask`` (B, T), ``length`` (B,)). Window b starts at ``starts[b]`` (default U{0..L_b-1},
    as ODT samples) and is masked after the item's last row. Returns (B, K, ...) tensors
    ``obs``, ``action``, ``rtg`` (from the item's own rewards), ``timestep``, ``mask``.
    """
    lengths = data["length"].long()  # (B,)
    B, T = data["mask"].shape
    if starts is None:
        u = torch.rand(B, generator=generator)
        starts = (u * lengths.float()).long().clamp(max=lengths - 1)  # (B,)
    idx = starts[:, None] + torch.arange(K)[None, :]  # (B, K)
    mask = idx < lengths[:, None]  # (B, K)
    idx = idx.clamp(max=T - 1)
    rtg = returns_to_go(data["reward"], data["mask"])  # (B, T) hindsight: the rewards it got

    def take(x):  # (B, T, ...) → (B, K, ...)
        i = idx.view(B, K, *([1] * (x.dim() - 2))).expand(B, K, *x.shape[2:])
        return x.gather(1, i)

    out = {"obs": take(data["obs"]), "action": take(data["action"]), "rtg": take(rtg),
           "timestep": take(data["timestep"]), "mask": mask}  # fmt: skip
    for k in ("obs", "action", "rtg", "timestep"):  # padding: zeros, like the table's gather
        v = out[k]
        out[k] = v.masked_fill(~mask.view(B, K, *([1] * (v.dim() - 2))), 0)
    return out


# ----------------------------------------------------------------------------- agent


class Agent:
    """Online Decision Transformer; see the module docstring."""

    def __init__(self, cfg: Config, spec: EnvSpec, settings: AgentSettings, device: torch.device):
        if len(spec.obs_shape) != 1:
            raise ConfigError(
                f"agent.name=agents.decision_transformer embeds vector observations; got obs shape {spec.obs_shape}"
            )
        if cfg.d_model % cfg.num_heads:
            raise ConfigError(f"agent.d_model={cfg.d_model} must be divisible by agent.num_heads={cfg.num_heads}")
        if cfg.context < 1:
            raise ConfigError(f"agent.context={cfg.context}: must be ≥ 1")
        if cfg.context_hop < 0:
            raise ConfigError(f"agent.context_hop={cfg.context_hop}: must be ≥ 0 (0: half the context)")
        if cfg.priority not in ("return", "length"):
            raise ConfigError(f"agent.priority={cfg.priority!r}: must be 'return' or 'length'")
        if cfg.rtg_scale <= 0:
            raise ConfigError(f"agent.rtg_scale={cfg.rtg_scale}: must be > 0")
        self.cfg, self.spec, self.device = cfg, spec, torch.device(device)
        # what acting reads every recv or episode, as plain values (a config attribute costs tens of µs)
        self._rtg_scale, self._target_return = float(cfg.rtg_scale), float(cfg.target_return)
        self._priority_rule = (cfg.priority, cfg.return_offset)
        self._step_held: tuple | None = None  # (network, slots, its StepTokens) for acting
        self.step_compiled = False  # whether that step is the TorchScript one
        self.discrete = spec.num_actions is not None
        if self.discrete:
            self.act_dim, self.act_shape = int(spec.num_actions), ()
        else:
            space = spec.action_space
            shape = tuple(getattr(space, "shape", None) or ())
            low, high = np.asarray(getattr(space, "low", np.nan), np.float64), np.asarray(getattr(space, "high", np.nan), np.float64)
            if len(shape) != 1 or not (np.isfinite(low).all() and np.isfinite(high).all()):
                raise ConfigError(
                    f"agent.name=agents.decision_transformer needs a Discrete or a bounded 1-D Box action space; "
                    f"env {spec.env_id or '?'!r} has {space}"
                )
            self.act_dim, self.act_shape = int(shape[0]), shape
            self.low = torch.as_tensor(low, dtype=torch.float32).expand(shape).clone()
            self.high = torch.as_tensor(high, dtype=torch.float32).expand(shape).clone()
        self.kind = settings.learns_from(Episode, type(self).__module__)
        T = self.kind.max_episode_length
        self.max_timestep = int(cfg.max_timestep) or T
        self.target_entropy = -float(self.act_dim) if cfg.target_entropy is None else float(cfg.target_entropy)
        self.rng = np.random.default_rng(settings.seed)
        self.generator = torch.Generator().manual_seed(settings.seed)
        self.bf16 = settings.bf16  # the learner's forward pass under bf16 autocast
        self.online: nn.Module | None = None

    # ---- replay: one row per step; items are whole episodes (their last T rows)
    def replay_columns(self) -> dict[str, str]:
        obs = f"{np.dtype(self.spec.obs_dtype).name}[{self.spec.obs_shape[0]}]"
        action = "int64" if self.discrete else f"float32[{self.act_dim}]"
        return {"obs": obs, "action": action, "reward": "float32", "timestep": "int64"}

    def item_kind(self) -> Episode:
        return self.kind

    def context_length(self) -> int:
        """K: the steps an actor keeps per env and passes to :meth:`act`."""
        return int(self.cfg.context)

    def initial_rtg(self) -> float:
        """R̂_0 of every episode an actor starts."""
        return self._target_return

    def episode_priority(self, ret: np.ndarray, length: np.ndarray) -> np.ndarray:
        """Priorities (k,) of items with returns ``ret`` and ``length`` rows (the learner's rule)."""
        return item_priority(torch.as_tensor(ret), torch.as_tensor(length), *self._priority_rule).numpy()

    # ---- actions: env units ↔ the network's [-1, 1]
    def _to_unit(self, a: torch.Tensor) -> torch.Tensor:
        lo, hi = self.low.to(a.device), self.high.to(a.device)
        return (2.0 * (a.float() - lo) / (hi - lo) - 1.0).clamp(-1.0, 1.0)

    def _to_env(self, u: torch.Tensor) -> torch.Tensor:
        lo, hi = self.low.to(u.device), self.high.to(u.device)
        return lo + (u + 1.0) * 0.5 * (hi - lo)

    # ---- acting
    def make_network(self) -> nn.Module:
        obs_dim = int(self.spec.obs_shape[0])
        return DecisionTransformer(obs_dim, self.act_dim, self.discrete, self.max_timestep, self.cfg).to(self.device)

    def act(self, network, obs, epsilon, rng=None, lengths=None, rtg=None, actions=None, timesteps=None) -> ActOutput:
        """Actions at the last step of each context. ``obs`` (k, K, obs_dim), ``rtg`` (k, K)
        unscaled, ``actions`` (k, K[, A]) in env units (the last step's is a placeholder),
        ``timesteps`` (k, K), ``lengths`` (k,); contexts are left-aligned. Row i samples from
        the policy with probability ``epsilon[i]``, else takes its mode."""
        rng = self.rng if rng is None else rng
        obs = torch.as_tensor(obs, device=self.device)
        if obs.dim() == 2:  # one step without context: R̂ = target, timestep 0
            obs = obs[:, None]
        k, K = obs.shape[:2]
        if rtg is None:
            rtg = np.full((k, K), self.initial_rtg(), np.float32)
        if timesteps is None:
            timesteps = np.zeros((k, K), np.int64)
        if actions is None:
            actions = np.zeros((k, K, *self.act_shape), np.int64 if self.discrete else np.float32)
        a = torch.as_tensor(actions, device=self.device)
        if not self.discrete:
            a = self._to_unit(a)
        rtg = torch.as_tensor(rtg, device=self.device, dtype=torch.float32) / self._rtg_scale
        out = network(rtg, obs, a, torch.as_tensor(timesteps, device=self.device))  # (k, K, H)
        last = torch.as_tensor(np.full(k, K) if lengths is None else lengths, device=self.device) - 1
        return self._choose(out[torch.arange(k, device=self.device), last], epsilon, rng)  # (k, H)

    def _choose(self, out: torch.Tensor, epsilon, rng) -> ActOutput:
        """Actions from the head's output at s_t (k, H): sampled with probability ε, else the mode."""
        k = out.shape[0]
        explore = torch.as_tensor(rng.random(k) < np.asarray(epsilon), device=self.device)
        seed = int(rng.integers(2**62))
        g = torch.Generator(device=self.device).manual_seed(seed)  # exploration follows the actor's rng
        if self.discrete:
            probs = torch.softmax(out.float(), dim=-1)
            sampled = torch.multinomial(probs, 1, generator=g).squeeze(1)
            chosen = torch.where(explore, sampled, probs.argmax(dim=-1))
            return ActOutput(actions=chosen.cpu().numpy().astype(np.int64), values=None)
        mean, log_std = out.float().chunk(2, dim=-1)
        noise = torch.randn(mean.shape, generator=g, device=self.device)
        sampled = torch.tanh(mean + log_std.clamp(-5.0, 2.0).exp() * noise)
        unit = torch.where(explore[:, None], sampled, torch.tanh(mean))
        return ActOutput(actions=self._to_env(unit).cpu().numpy().astype(np.float32), values=None)

    # ---- acting with a key/value cache (agents/kv_cache.py; the episode actor calls these when
    # make_kv_cache returns a cache)
    def make_kv_cache(self, num_envs: int) -> KVCache | None:
        """A cache of a full context's tokens (3K − 1: up to s_t) per env, or None when
        ``agent.kv_cache`` is false."""
        if not self.cfg.kv_cache:
            return None
        d, nh = self.cfg.d_model, self.cfg.num_heads
        return KVCache(num_envs, self.cfg.num_layers, nh, d // nh, 3 * self.context_length() - 1, self.device)

    def context_hop(self) -> int:
        """Steps a full context drops at once when acting with a cache (``agent.context_hop``)."""
        return hop_length(self.context_length(), self.cfg.context_hop)

    def act_cached(self, network, cache: KVCache, ids, obs, epsilon, rng=None, lengths=None, rtg=None,
                   actions=None, timesteps=None) -> ActOutput:  # fmt: skip
        """:meth:`act` over the same contexts (``obs``/``rtg``/``actions``/``timesteps`` (k, K, ...)
        of envs ``ids``, left-aligned, ``lengths`` (k,) steps), running the network only on each
        context's tokens after its ``cache.length`` cached ones: a_{t−1}, R̂_t, s_t per env step;
        all ``3n − 1`` tokens up to s_t after ``cache.clear``.

        Rows with one env step after cached ones (almost all) take the compiled :class:`StepTokens`
        (:meth:`step_tokens`); the others (re-encodes after a clear) take
        :meth:`DecisionTransformer.extend` in a second call over those rows only."""
        rng = self.rng if rng is None else rng
        ids, lengths = np.asarray(ids, dtype=np.int64), np.asarray(lengths, dtype=np.int64)
        n_new = 3 * lengths - 1 - cache.length[ids]  # (k,) tokens up to s_t not in the cache
        step = n_new == 3
        if not isinstance(network, DecisionTransformer) or network.training or not step.any():
            out = self._extend(network, cache, ids, obs, lengths, rtg, actions, timesteps)
        elif step.all():
            out = self._step(network, cache, ids, obs, lengths, rtg, actions, timesteps)
        else:
            out = torch.empty(len(ids), network.head.out_features, device=self.device)  # (k, H)
            rest = ~step
            out[torch.as_tensor(step, device=self.device)] = self._step(
                network, cache, ids[step], obs[step], lengths[step], rtg[step], actions[step], timesteps[step])
            out[torch.as_tensor(rest, device=self.device)] = self._extend(
                network, cache, ids[rest], obs[rest], lengths[rest], rtg[rest], actions[rest], timesteps[rest])
        return self._choose(out, epsilon, rng)

    def _extend(self, network, cache: KVCache, ids, obs, lengths, rtg, actions, timesteps) -> torch.Tensor:
        """The head's output (k, H) of rows with any number of new tokens (:meth:`DecisionTransformer.extend`)."""
        cached = cache.length[ids]
        n_new = 3 * lengths - 1 - cached  # (k,) tokens up to s_t not in the cache
        first_step = cached // 3
        Ts = int((lengths - first_step).max())
        steps = np.minimum(first_step[:, None] + np.arange(Ts)[None, :], (lengths - 1)[:, None])  # (k, Ts)
        r = np.arange(len(ids))[:, None]
        a = torch.as_tensor(actions[r, steps], device=self.device)
        if not self.discrete:
            a = self._to_unit(a)
        rtg_t = torch.as_tensor(rtg[r, steps], device=self.device, dtype=torch.float32) / self._rtg_scale
        allowed, _ = cache.attention_bias(ids, n_new, int(n_new.max()))
        out, kv_new = network.extend(rtg_t, torch.as_tensor(obs[r, steps], device=self.device), a,
                                     torch.as_tensor(timesteps[r, steps], device=self.device), cached,
                                     cache.gather(ids), allowed, n_new)  # fmt: skip
        cache.append(ids, kv_new, n_new)
        return out

    def _step(self, network, cache: KVCache, ids, obs, lengths, rtg, actions, timesteps) -> torch.Tensor:
        """The head's output (k, H) of rows with one env step after cached ones (:class:`StepTokens`)."""
        length = cache.length[ids]  # (k,) cached tokens: up to s_{t−1}
        if (length + 3 > cache.slots).any():
            r = int(np.argmax(length + 3 > cache.slots))
            raise ValueError(f"env {int(ids[r])}: {int(length[r])} cached + 3 new tokens exceed the cache's "
                             f"{cache.slots} slots")  # fmt: skip
        dev, r, t = self.device, np.arange(len(ids)), lengths - 1  # t: the new step's index in the context
        prev = torch.as_tensor(actions[r, t - 1], device=dev)
        if not self.discrete:
            prev = self._to_unit(prev)
        out = self.step_tokens(network, cache.slots)(
            torch.as_tensor(obs[r, t], device=dev), cache.kv, torch.as_tensor(ids, device=dev),
            torch.as_tensor(length, device=dev), int(length.max()) + 3,
            torch.as_tensor(rtg[r, t], device=dev, dtype=torch.float32) / self._rtg_scale, prev,
            torch.as_tensor(timesteps[r, t - 1], device=dev), torch.as_tensor(timesteps[r, t], device=dev))  # fmt: skip
        cache.length[ids] = length + 3
        return out

    def step_tokens(self, network: DecisionTransformer, slots: int):
        """``network``'s :class:`StepTokens`, compiled where that gives the same results
        (:func:`compile_step_tokens`); made on first use and kept. ``step_compiled`` says which."""
        held = self._step_held
        if held is None or held[0] is not network or held[1] != slots:
            step, self.step_compiled = compile_step_tokens(network, slots, int(self.spec.obs_shape[0]), self.act_shape)
            held = self._step_held = (network, slots, step)
        return held[2]

    # ---- learning
    def setup_learner(self) -> None:
        cfg = self.cfg
        self.online = self.make_network()
        self.optimizer = torch.optim.AdamW(self.online.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        warmup = max(1, int(cfg.warmup_updates))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda u: min(1.0, (u + 1) / warmup))
        self.log_temperature = torch.tensor(math.log(cfg.init_temperature), device=self.device, requires_grad=True)
        self.temperature_optimizer = torch.optim.Adam([self.log_temperature], lr=1e-4, betas=(0.9, 0.999))
        self.updates = 0

    def learner_network(self) -> nn.Module:
        if self.online is None:
            raise RuntimeError("call setup_learner() first")
        return self.online

    def loss(self, w: dict):
        """Masked action loss of windows ``w`` (:func:`sample_windows`): (loss, entropy, metrics).

        Only steps with ``mask`` count; each window's valid steps are averaged over the batch's
        valid steps (ODT), so padding changes nothing. The forward pass under bf16 autocast with
        ``learner.bf16``; the losses from its fp32 head output."""
        mask = w["mask"]  # (B, K)
        steps = mask.sum().clamp(min=1)
        a = w["action"] if self.discrete else self._to_unit(w["action"])
        with bf16_forward(self.device, self.bf16):
            out = self.online(w["rtg"] / self.cfg.rtg_scale, w["obs"], a, w["timestep"]).float()  # (B, K, H)
        if self.discrete:
            ce = F.cross_entropy(out.flatten(0, 1).float(), w["action"].long().flatten(), reduction="none")
            ce = torch.where(mask.flatten(), ce, torch.zeros_like(ce))
            loss = ce.sum() / steps
            hit = (out.argmax(-1) == w["action"]) & mask
            return loss, None, {"learner/action_ce": loss.detach(), "learner/action_accuracy": hit.sum() / steps}
        dist = tanh_normal(out.float())
        log_lik = dist.log_prob(a.clamp(-1.0 + 1e-6, 1.0 - 1e-6))  # (B, K)
        log_lik = torch.where(mask, log_lik, torch.zeros_like(log_lik)).sum() / steps
        sample = dist.rsample()
        neg_logp = -dist.log_prob(sample.clamp(-1.0 + 1e-6, 1.0 - 1e-6))  # (B, K) entropy estimate
        entropy = torch.where(mask, neg_logp, torch.zeros_like(neg_logp)).sum() / steps
        temperature = self.log_temperature.exp().detach()
        loss = -(log_lik + temperature * entropy)
        return loss, entropy, {"learner/nll": -log_lik.detach(), "learner/entropy": entropy.detach(),
                               "learner/temperature": temperature}  # fmt: skip

    def learn(self, batch):
        d = {k: batch.data[k].to(self.device, non_blocking=True)
             for k in ("obs", "action", "reward", "timestep", "mask", "length")}  # fmt: skip
        w = sample_windows(d, self.cfg.context, self.generator)
        self.online.train()
        loss, entropy, parts = self.loss(w)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = nn.utils.clip_grad_norm_(self.online.parameters(), self.cfg.max_grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        if entropy is not None:  # λ ← λ − lr · ∂/∂λ [λ (H − H_target)]
            t_loss = self.log_temperature.exp() * (entropy.detach() - self.target_entropy)
            self.temperature_optimizer.zero_grad(set_to_none=True)
            t_loss.backward()
            self.temperature_optimizer.step()
        self.updates += 1

        ret = (d["reward"] * d["mask"]).sum(dim=1)  # (B,) the item's return
        priorities = item_priority(ret, d["length"], self.cfg.priority, self.cfg.return_offset)  # unchanged
        # 0-dim tensors, read by the learner once per metric row (never here: that would wait for the device)
        metrics = {"learner/loss": loss.detach(), "learner/grad_norm": grad_norm, "learner/return_mean": ret.mean(),
                   **parts, "learner/updates": float(self.updates)}  # fmt: skip
        return metrics, priorities

    def state_dict(self) -> dict:
        return {**learner_state(self, "online", "optimizer", "scheduler", "temperature_optimizer"),
                "log_temperature": self.log_temperature.detach().clone()}

    def load_state_dict(self, state: dict) -> None:
        load_learner_state(self, state, "online", "optimizer", "scheduler", "temperature_optimizer")
        with torch.no_grad():
            self.log_temperature.copy_(state["log_temperature"])
