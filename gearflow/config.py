"""Typed run configuration: one OmegaConf structured dataclass per component.

A run is configured by a YAML file whose top-level groups mirror the
components (``env``, ``actor``, ``replay``, ``learner``, ``agent``, ``run``),
merged over the dataclass defaults, then by command-line dotlist overrides::

    cfg = load_config("configs/cartpole_apex.yaml", ["replay.capacity=2e5", "run.seed=3"])
    cfg.replay.capacity          # 200000 (an int: "2e5" is accepted for int fields)

Every field carries a docstring (the string literal under it); ``gearflow
config FILE --explain`` prints them next to the values. Unknown keys, wrong
types and impossible values raise :class:`~gearflow.errors.ConfigError`
naming the key and where the bad value came from (the file or the override).

The ``agent`` group is typed by the agent itself: ``agent.name`` is an import
path (``agents.apex_dqn`` or a user's own module) whose ``Config`` dataclass
gives the remaining fields of the group.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import importlib
import inspect
import logging
import math
import re
import textwrap
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from gearflow.errors import ConfigError
from gearflow.geometry import replay_geometry
from gearflow.kinds.registry import kind_def, kind_names
from gearflow.native.protocol import DEVICE_SELECTORS
from gearflow.replay.selectors import SELECTORS
from gearflow.topology.plan import LAUNCHERS, RUN_MODES  # a leaf of data
from gearflow.transport.choice import transport_names

log = logging.getLogger(__name__)

ENV_BACKENDS = ("auto", "envpool", "gymnasium")
DEVICES = ("auto", "cpu", "cuda")  # and "cuda:N" (a GPU by index): see _device_ok
_CUDA_N = re.compile(r"cuda:[0-9]+")


def _device_ok(name: str) -> bool:
    return name in DEVICES or _CUDA_N.fullmatch(str(name)) is not None


_ADDRESS = re.compile(r"^\[?[A-Za-z0-9_.:-]*\]?:[0-9]{1,5}$")


def _address_ok(text: Any) -> bool:
    """``HOST:PORT`` with a port in [1, 65535]."""
    return _ADDRESS.match(str(text)) is not None and 0 < int(str(text).rpartition(":")[2]) <= 65535


PROGRESS_MODES = ("auto", "live", "log")
_PERIOD = re.compile(r"^\s*(\d+(?:\.\d*)?)\s*([smh]?)\s*$")


def parse_period(text: Any) -> tuple[str, float] | None:
    """``"500"`` → ``("updates", 500)``, ``"90s"``/``"10m"``/``"2h"`` → ``("seconds", ...)``,
    ``"0"`` → ``("off", 0)``; None when ``text`` is none of these."""
    m = _PERIOD.match(str(text))
    if m is None:
        return None
    value, unit = float(m.group(1)), m.group(2)
    if value == 0:
        return ("off", 0.0)
    if not unit:
        return ("updates", value) if value.is_integer() else None
    return ("seconds", value * {"s": 1, "m": 60, "h": 3600}[unit])


def eval_period(cfg: DictConfig) -> tuple[str, float] | None:
    """``run.eval_every`` parsed: ``("steps", n)`` (env steps; learner updates in ``run.mode=offline``)
    or ``("seconds", s)``; None when evaluation during training is off."""
    every = cfg.run.get("eval_every")
    period = parse_period(0 if every is None else every)
    if period is None or period[0] == "off":
        return None
    return ("steps", period[1]) if period[0] == "updates" else period


@dataclass
class EnvConfig:
    id: str = "CartPole-v1"
    """Environment id: an EnvPool task id (see ``envpool.list_all_envs()``) or a gymnasium id."""
    backend: str = "auto"
    """``envpool``, ``gymnasium``, or ``auto`` (EnvPool when it has the id, else gymnasium)."""
    num_envs: int = 8
    """Environments per actor process; each environment stream is one replay partition."""
    batch_size: int = 0
    """EnvPool async batch (envs returned per ``recv``); 0 means ``num_envs // 2`` (at least 1)."""
    factory: Optional[str] = None
    """Import path ``module:function(num_envs, seed)`` returning a gymnasium vector env."""
    obs_transform: Optional[str] = None
    """Import path ``module:function(obs) -> obs`` applied to every observation batch."""
    seed: int = 0
    """Base seed of the environments (each actor adds its own offset)."""
    kwargs: Dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments passed to ``envpool.make`` or ``gymnasium.make``."""


@dataclass
class ActorConfig:
    num_actors: int = 2
    """Actor processes; the ε ladder spans all ``num_actors * env.num_envs`` environments."""
    epsilon: float = 0.4
    """Ape-X base ε: environment i of N explores with ε^(1 + α·i/(N−1))."""
    epsilon_alpha: float = 7.0
    """Ape-X ladder exponent α."""
    n_step: int = 3
    """Steps in the n-step return computed by the actors."""
    gamma: float = 0.99
    """Discount factor."""
    weight_sync_period: int = 400
    """Env steps (per actor) between checks for newer weights in the parameter store."""
    max_restarts: int = 3
    """Times the supervisor restarts a dead actor before the run fails."""
    device: str = "cpu"
    """Device the actors' policy runs on."""
    nice: int = 5
    """Niceness added to actor processes, so that a contended CPU goes to the learner first."""
    remote_actors: int = 0
    """How many of the ``num_actors`` actors run on other machines: the learner serves its replay
    and weights on ``transport.host:port`` and waits for them (``gearflow actor --connect``)."""
    ladder_offset: int = 0
    """Actors of the whole run placed before this machine's in the Ape-X ε ladder (and env seeds):
    a shard node of a several-node run (``gearflow serve``, the Ray launcher) sets it."""
    ladder_total: int = 0
    """Actors of the whole run on the ε ladder; 0: ``num_actors`` (one machine)."""


@dataclass
class ReplayConfig:
    capacity: int = 100_000
    """Total steps held in host memory, split evenly over the partitions."""
    item: str = "transition"
    """What is sampled: an item kind's name (``gearflow/kinds``): ``transition`` (n-step), ``sequence`` (fixed
    windows), ``episode``, or one registered with ``gearflow.kinds.register_kind``."""
    sequence_length: int = 80
    """Steps per sequence item (R2D2: 80)."""
    sequence_period: int = 40
    """Steps between the starts of consecutive sequence items (R2D2: 40)."""
    burn_in: int = 40
    """Leading steps of a sequence used only as context (no loss) (R2D2: 40)."""
    max_episode_length: int = 1000
    """Longest episode item; longer episodes are cut (``item=episode``)."""
    selector: str = "prioritized"
    """Item selector: uniform, prioritized, fifo, lifo, max_heap, min_heap or top_k."""
    alpha: float = 0.6
    """Priority exponent α of the prioritized selector."""
    beta: float = 0.4
    """Importance-weight exponent β (annealed to 1 over the run by the learner)."""
    top_k: int = 1000
    """k of the top_k selector."""
    min_size_to_sample: int = 1000
    """Items that must be in the table before the first sample."""
    samples_per_insert: float = 0.0
    """Target sampled items per inserted item (Reverb's ratio); 0 disables the ratio limit."""
    error_buffer: float = 1000.0
    """Slack, in sampled items, around the samples-per-insert ratio before either side blocks."""
    timeout_s: float = 60.0
    """Seconds a blocked insert or sample waits before raising instead of hanging."""
    frame_stack: bool = False
    """Store one frame per step instead of the env's whole frame stack (``obs`` ``uint8[4,84,84]`` →
    ``stack=4``: 7 KiB a step instead of 28 KiB); batches are unchanged (stacks gathered at sample time)."""
    device: str = "cpu"
    """Where selection and the batch gather run: ``cpu``; ``cuda`` (device priority vector, zero-copy gather
    from the shared memory; CuPy + a GPU, prioritized/uniform selectors; the learner's GPU) or ``cuda:N``;
    ``auto`` (cuda when usable)."""


@dataclass
class LearnerConfig:
    batch_size: int = 256
    """Items per learner batch."""
    device: str = "auto"
    """Device the learner trains on: ``cpu``, ``cuda``, ``cuda:N`` or ``auto``."""
    prefetch: int = 2
    """Batches sampled ahead in the background (≥ 1). The thread refills once half are taken, and
    over a local table with a prioritized or uniform selector draws a refill's ``prefetch -
    prefetch // 2`` batches in one table call (one lock, scan and gather for all of them: on a
    CPU learner with a ~1 ms update, 16 ran DQN CartPole's loop at ~0.90 of its learn step, 4 at
    ~0.83). Host memory for batches: 4 sets of a refill's batches
    (``gearflow.learner.batches.GROUP_SETS``) beside the table's ``prefetch + 2`` single-batch
    sets (made only if the rate limiter holds a refill back)."""
    publish_every: int = 10
    """Learner updates between weight publications to the actors."""
    bf16: bool = False
    """bfloat16 autocast over the agent's forward passes (CUDA; also accepted on CPU); targets, TD
    errors, priorities, backward and the optimizer step stay fp32 (gearflow/precision.py)."""
    compile: bool = False
    """``torch.compile`` the learner network in place before training."""
    graph: bool = False
    """CUDA: capture each form of the agent's update (forward, backward, clipping, optimizer step) in a
    CUDA graph after a few eager steps and replay it every update (one launch instead of hundreds; fixed
    batch shapes; optimizers made capturable). Agents whose ``learn`` takes ``update=`` (the reference
    ones but the Decision Transformer) and CUDA only: elsewhere the learner learns eagerly and says so."""
    device_batches: int = 3
    """A CUDA learner sampling a host table (``replay.device=cpu``, shard nodes): static device buffer
    sets the prefetch thread fills on a side stream, each refilled only after the step that read it
    (batches ahead on the GPU); 0: batches stay in pinned host memory and the agent copies them."""
    world_size: int = 1
    """Data-parallel learners training one model (``torch.distributed``): each samples
    ``batch_size / world_size`` items, gradients are averaged; rank 0 publishes and checkpoints."""
    rank: int = 0
    """This learner's rank in ``[0, world_size)``."""
    dist_address: str = "127.0.0.1:29511"
    """``HOST:PORT`` where rank 0 meets the other learners (``torch.distributed`` TCP rendezvous)."""
    dist_backend: str = "auto"
    """``auto`` (NCCL when the learner is on CUDA, else gloo), ``gloo`` or ``nccl``."""


@dataclass
class RunConfig:
    name: str = ""
    """Run name; empty means the config file's stem."""
    dir: str = ""
    """Run directory; empty means ``runs/<name>-<timestamp>``."""
    seed: int = 0
    """Seed of the learner, the replay selector and the actors."""
    serial: bool = False
    """Run one actor and the learner in one process with the same classes (debugging)."""
    mode: str = "online"
    """``online`` (actors fill the replay) or ``offline`` (the replay is filled once from ``run.dataset``;
    no actors)."""
    dataset: str = ""
    """Offline mode: a Minari/D4RL-style HDF5 file (observations, actions, rewards, terminals, timeouts)."""
    dry_run: bool = False
    """Build the learner on the meta device, print its memory plan (parameters, optimizer, activations,
    replay bytes) as a table and JSON, and exit: no actors, no shared memory, no run directory."""
    max_env_steps: int = 100_000
    """Stop after this many environment steps in total (0: no limit)."""
    max_seconds: float = 0.0
    """Stop after this many seconds of wall-clock time (0: no limit)."""
    max_updates: int = 0
    """Stop after this many learner updates (0: no limit)."""
    stop_at_return: float = 0.0
    """Stop once the greediest acting actor's mean return over its last 100 episodes reaches this (0: never);
    acting: it reported within the last 30 s (``gearflow.learner.ACTING_S``), so a starved or dead actor is passed over."""
    log_every_s: float = 5.0
    """Seconds between progress lines and metric rows."""
    checkpoint_every: str = "10m"
    """Checkpoint period: ``500`` (learner updates), ``90s``/``10m``/``2h`` (wall time), or ``0`` (off)."""
    keep_checkpoints: int = 3
    """Checkpoints kept in ``<run dir>/checkpoints``; older ones are deleted."""
    checkpoint_replay: bool = True
    """Include the replay table in checkpoints (resume keeps every committed item; costs its bytes on disk)."""
    progress: str = "auto"
    """Terminal progress: ``auto`` (a live panel on a TTY, log lines otherwise), ``live`` or ``log``."""
    tensorboard: bool = True
    """Write TensorBoard event files into the run directory (next to metrics.jsonl/.csv)."""
    eval_every: Optional[str] = None
    """Greedy evaluation during training, in a process of its own: every ``50000`` env steps (as
    SB3's ``eval_freq`` and CleanRL's step counters count; ``run.mode=offline``, which takes no env
    steps: learner updates), or every ``90s``/``10m``/``2h`` of wall time; ``0`` or null: off.
    Logged as ``eval/return_mean``, ``eval/return_std``, ``eval/episodes``, ``eval/env_steps``
    (the steps the evaluation itself took) at the training step of the weights evaluated."""
    eval_episodes: int = 10
    """Episodes per evaluation during training (``run.eval_every``), on up to 32 envs of its own."""
    module_dirs: list = field(default_factory=list)
    """Directories searched, after installed packages, for the agent, env factory and obs transform
    modules the config names (a relative one in a YAML file: from that file's directory). A config
    file's own directory is searched too, and added here when the file does not set this key, so
    a run's saved config finds them again (``--resume``, ``gearflow eval``, actor processes,
    remote actors, Ray roles)."""


@dataclass
class TransportLimitsConfig:
    """What one client may make a service (``gearflow serve``, the learner's remote-actor service)
    hold; see docs/security.md. Per connection: at most ``max_queued_bytes + max_frame_bytes``
    of receive buffers."""

    max_connections: int = 64
    """Authenticated connections at once; a login past it is refused."""
    max_preauth: int = 16
    """Sockets that have not logged in yet, in their own pool (the oldest is dropped for a newcomer)."""
    auth_timeout_s: float = 5.0
    """A socket that has not logged in by then is closed."""
    max_in_flight: int = 8
    """Requests of one connection read and not yet answered; past it the connection is not read."""
    max_frame_bytes: int = 256 << 20
    """Largest frame (header, envelope, buffers) a service accepts."""
    max_queued_bytes: int = 64 << 20
    """Receive buffers one connection may hold before it is not read any further (beyond its last frame)."""
    max_wait_s: float = 60.0
    """Longest server-side wait of one request (a sample's or an insert's ``timeout_s`` is capped to it)."""
    max_batch: int = 65536
    """Items one ``replay.sample`` may ask for."""
    max_reply_bytes: int = 256 << 20
    """Bytes one reply may hold (a larger sample is refused before anything is allocated)."""
    refusal_log_interval_s: float = 10.0
    """Refused connections log one WARNING per interval, with the count of the others."""


@dataclass
class TransportConfig:
    host: str = "127.0.0.1"
    """Address the learner's service binds (remote actors); 0.0.0.0 to accept other machines."""
    port: int = 0
    """TCP port of that service; 0 picks a free one (logged)."""
    token: str = ""
    """Shared secret every connection proves it holds (HMAC); empty: ``transport.token_file``, else
    ``$GEARFLOW_TOKEN``. The learner's secret, or on an actor machine an actor credential
    (``gearflow secret actor NAME``): an actor-role connection may only join, write its partitions,
    report and read weights. Never written to the run directory nor sent to joiners; on the
    command line it shows in ``ps`` (a warning says so): prefer the environment or a token file."""
    token_file: str = ""
    """File holding the shared secret (mode 0600: one readable by others is refused); used when
    ``transport.token`` is empty."""
    integrity: bool = True
    """Every frame after the handshake carries a MAC (NH-Poly1305, keys per connection and frame) and a
    sequence number, checked before it is acted on: an altered, injected, replayed or dropped frame
    closes the connection. Both ends must agree (a mismatch is refused at the handshake). false:
    frames are unprotected after the login (a benchmark on a trusted network)."""
    row_digests: bool = True
    """With ``integrity``: a learner asks its shards to MAC a sample reply's wide rows (observations)
    by their digests, which a shard keeps from a row's first draw to its overwrite, so a row drawn
    again is not read again for the MAC (``gearflow/transport/server/row_digests.py``). false: the
    MAC reads every row at every send — ~0.04 cheaper where nearly every draw is a row's first
    (far fewer samples than inserts), ~0.12 dearer where rows are drawn again (2-core figures)."""
    tls: str = ""
    """Mutual TLS (confidentiality): a directory with ``ca.pem``, ``node.pem``, ``node.key`` from
    ``gearflow tls init DIR``; every end of the run needs one from the same CA. Empty: no TLS
    (frames are in clear, integrity-protected when ``integrity`` is on)."""
    tls_records: str = "gearflow"
    """What carries the frames under ``tls``: ``gearflow`` — the TLS handshake (certificates, fresh
    keys inside it), then gearflow's records: every byte AES-128-CTR under those keys, each frame
    under the frame MAC (needs ``integrity``; ``gearflow/transport/records.py``), ~1.7× TLS's
    throughput here; ``tls`` — TLS's own records for everything. Both ends must agree. With
    ``integrity`` false frames always stay in TLS records."""
    loop: str = "auto"
    """Event loop of the transport threads: ``auto`` (uvloop when installed), ``uvloop`` or ``asyncio``."""
    shards: list = field(default_factory=list)
    """``HOST:PORT`` of the shard services (``gearflow serve``) this learner samples; empty: its own
    table on this machine. Several shards sample like one table (exact global prioritized draws)."""
    kind: str = "auto"
    """How the learner reads remote shards: ``tcp``, ``rdma`` (one-sided reads through pyverbs) or
    ``auto`` (RDMA where an RDMA device and pyverbs are usable, else TCP); any other transport
    added to ``gearflow.transport.choice.DATA_PATHS`` by its name."""
    node_timeout_s: float = 15.0
    """Seconds a shard node (``transport.shards``) may be silent before the learner marks it down:
    its heartbeats (a ``ping`` every quarter of this) unanswered that long, or a call's reply
    waited for that long (a sample: ``replay.timeout_s`` more, the node's rate limiter may hold
    it). Down: left out of the sampling split, the weights' push and the progress poll, re-probed
    in the background, re-admitted when it answers. The default: healthy nodes answered within
    1.2 s at worst (p99.9 0.2 s) on a 2-core box at load 12-17 with unthrottled actors (issue 47);
    15 s is 12 × that, and a dead host costs 15 s. 0: the default."""
    limits: TransportLimitsConfig = field(default_factory=TransportLimitsConfig)
    """Server-side bounds per client (connections, login, frames, queued bytes, waits, batches, replies)."""


@dataclass
class ClusterConfig:
    address: str = ""
    """Ray cluster to join (``launcher=ray``): empty starts a Ray instance on this machine, ``auto``
    joins the one ``ray start`` made, or ``ray://HOST:PORT``."""
    shards: int = 1
    """Shard nodes: one shard service (replay + parameter store) with its actor group per node,
    spread over the cluster's nodes; each node runs ``actor.num_actors`` actors."""
    learners: int = 1
    """Data-parallel learners (``learner.world_size``), sampling every shard."""
    learner_gpus: float = 0.0
    """GPUs each learner asks Ray for (0: CPU learners; 1 with ``learner.device=cuda``)."""
    shard_cpus: float = 1.0
    """CPUs a shard node's service asks Ray for; its node must also hold its actor group's
    ``actor.num_actors`` × ``cluster.actor_cpus`` (placement checks both before any role starts)."""
    actor_cpus: float = 1.0
    """CPUs each actor process of a node's actor group asks Ray for."""
    learner_cpus: float = 1.0
    """CPUs each learner asks Ray for."""
    shard_resources: Dict[str, float] = field(default_factory=dict)
    """Custom Ray resources a shard node asks for (``{"shard_host": 1}`` keeps shards on the nodes
    started with ``ray start --resources='{"shard_host": 1}'``)."""
    max_restarts: int = 3
    """Times Ray restarts a dead actor group before the run fails."""
    file_sync_s: float = 10.0
    """How often the driver pulls into its ``run.dir`` the new run files (metrics, ``train.log``,
    checkpoints) of a learner on a host that does not share its disk."""


@dataclass
class GearflowConfig:
    env: EnvConfig = field(default_factory=EnvConfig)
    """The environments the actors step."""
    actor: ActorConfig = field(default_factory=ActorConfig)
    """Actor processes: exploration, n-step returns, weight syncing."""
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    """The embedded replay table."""
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    """The learner loop around ``agent.learn``."""
    agent: Any = None
    """The agent: ``name`` is its import path, the other keys its ``Config`` dataclass."""
    run: RunConfig = field(default_factory=RunConfig)
    """Stopping, logging, checkpoints and run directory."""
    transport: TransportConfig = field(default_factory=TransportConfig)
    """The network data plane (remote actors, shard services)."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """Roles on a Ray cluster (``launcher=ray``)."""
    launcher: str = "local"
    """Where ``gearflow train`` runs the roles: ``local`` (this machine) or ``ray`` (shard nodes,
    actor groups and learners placed and restarted by Ray: ``cluster.*``)."""


GROUPS = {
    "env": EnvConfig,
    "actor": ActorConfig,
    "replay": ReplayConfig,
    "learner": LearnerConfig,
    "run": RunConfig,
    "transport": TransportConfig,
    "cluster": ClusterConfig,
}
DEFAULT_AGENT = "agents.apex_dqn"


# --------------------------------------------------------------------------- docs


@lru_cache(maxsize=None)
def field_docs(cls: type) -> Dict[str, str]:
    """Attribute docstrings of a dataclass: the string literal under each field."""
    docs: Dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body  # type: ignore[attr-defined]
        for node, nxt in zip(body, body[1:]):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def explain(cfg: DictConfig) -> str:
    """Every key of a resolved config with its value and its docstring."""
    lines = []
    for group, cls in [*GROUPS.items(), ("agent", agent_config_class(cfg.agent.name))]:
        lines.append(f"{group}:  # {field_docs(GearflowConfig).get(group, '')}")
        docs = field_docs(cls)
        if group == "agent":
            docs = {"name": "Import path of the agent module (e.g. agents.apex_dqn).", **docs}
        for key, value in cfg[group].items():
            rendered = OmegaConf.to_yaml({key: value}).strip().replace("\n", " ")
            lines.append(f"  {rendered:<40} # {docs.get(key, '')}")
    lines.append(f"{'launcher: ' + str(cfg.launcher):<42} # {field_docs(GearflowConfig).get('launcher', '')}")
    return "\n".join(lines)


# ------------------------------------------------------------------------ agents


def import_agent_module(name: str, key: str = "agent.name"):
    """The agent module ``name`` (an import path: ``agents.apex_dqn``, or a user's module found on
    ``sys.path``, where :func:`load_config` also puts ``run.module_dirs`` and the config file's directory). The one place agent
    modules are loaded: its ``Config`` here, its ``Agent`` in :func:`gearflow.agent.load_agent_class`.
    ``key`` starts the error message."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise ConfigError(f"{key}: cannot import agent module '{name}': {exc}") from exc


def agent_config_class(name: str) -> type:
    """The ``Config`` dataclass of the agent module ``name`` (an import path)."""
    module = import_agent_module(name)
    cls = getattr(module, "Config", None)
    if cls is None or not dataclasses.is_dataclass(cls):
        raise ConfigError(f"agent.name: module '{name}' has no Config dataclass")
    return cls


def _agent_schema(name: str) -> DictConfig:
    """The agent's Config dataclass plus the ``name`` key that selected it."""
    cls = agent_config_class(name)
    named = dataclasses.make_dataclass(
        f"{cls.__name__}WithName", [("name", str, field(default=name))], bases=(cls,)
    )
    return OmegaConf.structured(named)


# ------------------------------------------------------------------------ loading


_INT_LIKE = re.compile(r"^[+-]?\d+(\.\d*)?([eE][+-]?\d+)?$")


def _coerce_ints(schema: DictConfig, data: Any) -> Any:
    """Turn "2e6" / 2000000.0 into 2000000 where the schema field is an int."""
    if not isinstance(data, dict) or not isinstance(schema, DictConfig) or schema._is_none():
        return data
    out = {}
    for key, value in data.items():
        node = schema._get_node(key) if key in schema else None
        if isinstance(value, dict) and isinstance(node, DictConfig):
            out[key] = _coerce_ints(node, value)
            continue
        if node is not None and type(node).__name__ == "IntegerNode":
            text = str(value)
            if not isinstance(value, bool) and _INT_LIKE.match(text) and float(text).is_integer():
                value = int(float(text))
        out[key] = value
    return out


def _describe_omegaconf_error(exc: OmegaConfBaseException, source: str, schema: DictConfig) -> str:
    key = getattr(exc, "full_key", None) or "?"
    if isinstance(exc, ConfigKeyError) or "not in" in str(exc):
        parent = key.rsplit(".", 1)[0] if "." in key else ""
        node = OmegaConf.select(schema, parent) if parent else schema
        valid = list(node.keys()) if isinstance(node, DictConfig) else []
        leaf = key.rsplit(".", 1)[-1]
        close = difflib.get_close_matches(leaf, valid, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        where = f"'{parent}'" if parent else "the top level"
        return (
            f"{source}: unknown key '{key}'{hint}; valid keys in {where}: {', '.join(valid)}"
        )
    first = str(exc).strip().splitlines()[0]
    return f"{source}: {key}: {first}"


def _merge(schema: DictConfig, data: dict, source: str) -> DictConfig:
    try:
        return OmegaConf.merge(schema, _coerce_ints(schema, data))  # type: ignore[return-value]
    except (ConfigKeyError, ValidationError, OmegaConfBaseException) as exc:
        raise ConfigError(_describe_omegaconf_error(exc, source, schema)) from None


def _read_yaml(path: Path) -> dict:
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
    try:
        data = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    except Exception as exc:  # yaml.YAMLError and OmegaConf errors
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of groups, got {type(data).__name__}")
    return data


def _parse_overrides(overrides: Sequence[str]) -> list[tuple[str, dict]]:
    parsed = []
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"override '{item}': expected KEY=VALUE, e.g. replay.capacity=200000")
        try:
            parsed.append((item, OmegaConf.to_container(OmegaConf.from_dotlist([item]))))
        except OmegaConfBaseException as exc:
            raise ConfigError(f"override '{item}': {exc}") from None
    return parsed


def _module_dirs(path: Path | None, yaml_data: dict, parsed: list[tuple[str, dict]]) -> tuple[list[str], list[str]]:
    """``(searched, recorded)``: ``run.module_dirs`` as absolute paths (the last that gives it wins,
    as a merge would), then the config file's own directory — searched always, recorded in
    ``run.module_dirs`` when the file does not set that key (a run's saved config does: reading
    it back gives what was saved)."""
    dirs: list[str] = []
    for where, data, base in [(str(path), yaml_data, path.parent if path is not None else Path.cwd()),
                              *((f"override '{i}'", d, Path.cwd()) for i, d in parsed)]:  # fmt: skip
        run = data.get("run")
        if not isinstance(run, dict) or "module_dirs" not in run:
            continue
        given = run["module_dirs"]
        if not isinstance(given, (list, tuple)) or not all(isinstance(d, str) and d for d in given):
            raise ConfigError(f"{where}: run.module_dirs must be a list of directory paths, got {given!r}")
        dirs = [str((base / Path(d).expanduser()).resolve()) for d in given]
    recorded = list(dict.fromkeys(dirs))
    if path is None:
        return recorded, recorded
    own = str(path.resolve().parent)
    if "module_dirs" not in (yaml_data.get("run") or {}):
        recorded = list(dict.fromkeys([*recorded, own]))
    return list(dict.fromkeys([*recorded, own])), recorded


def use_module_dirs(dirs: Sequence[str]) -> None:
    """Append ``dirs`` (``run.module_dirs``) to ``sys.path`` after what is there, so a user's
    modules are found and shadow no installed package; a directory missing here (a run's config
    read on another machine) is skipped."""
    import os
    import sys

    for d in dirs:
        if d not in sys.path and os.path.isdir(d):
            sys.path.append(d)


def load_config(path: str | Path | None, overrides: Sequence[str] = ()) -> DictConfig:
    """Defaults ← YAML file ← overrides, then validation. Raises :class:`ConfigError`.
    The modules the config names are searched for in ``run.module_dirs`` and the file's own
    directory too (added to ``sys.path``, after installed packages)."""
    yaml_data = _read_yaml(Path(path)) if path is not None else {}
    parsed = _parse_overrides(overrides)
    if any(str(o).split("=", 1)[0].strip() in ("transport.token", "+transport.token") for o in overrides):
        log.warning("transport.token= on the command line is visible to every user of this machine (ps, "
                    "/proc/*/cmdline): set $GEARFLOW_TOKEN or transport.token_file instead")  # fmt: skip
    source = str(path) if path is not None else "defaults"
    for group in yaml_data:
        if group not in GearflowConfig.__dataclass_fields__:
            valid = ", ".join(GearflowConfig.__dataclass_fields__)
            raise ConfigError(f"{source}: unknown group '{group}'; valid groups: {valid}")
    searched, module_dirs = _module_dirs(Path(path) if path is not None else None, yaml_data, parsed)
    use_module_dirs(searched)

    agent_name, agent_source = DEFAULT_AGENT, "defaults"
    for where, data in [(source, yaml_data), *((f"override '{i}'", d) for i, d in parsed)]:
        group = data.get("agent")
        if not isinstance(group, dict):
            if "agent" in data:
                raise ConfigError(f"{where}: agent must be a mapping with a 'name' key, got {group!r}")
        elif "name" in group:
            agent_name, agent_source = str(group["name"]), where

    schema = OmegaConf.structured(GearflowConfig)
    OmegaConf.set_struct(schema, False)
    try:
        schema.agent = _agent_schema(agent_name)
    except ConfigError as exc:
        raise ConfigError(f"{agent_source}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - the agent module's own code raised while importing
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise ConfigError(
            f"{agent_source}: agent.name: importing agent module '{agent_name}' raised "
            f"{type(exc).__name__}{': ' + first if first else ''}"
        ) from None
    OmegaConf.set_struct(schema, True)
    _open_free_dicts(schema)

    cfg = _merge(schema, yaml_data, source)
    provenance = {key: source for key in _leaf_keys(yaml_data)}
    for item, data in parsed:
        cfg = _merge(cfg, data, f"override '{item}'")
        provenance.update({key: f"override '{item}'" for key in _leaf_keys(data)})
    if not cfg.run.name:
        cfg.run.name = Path(path).stem if path is not None else "gearflow"
    cfg.run.module_dirs = module_dirs
    validate(cfg, provenance)
    return cfg


def _open_free_dicts(node: DictConfig) -> None:
    """Let ``Dict[str, Any]`` fields (``env.kwargs``) take any key under the struct flag."""
    for key in node:
        child = node._get_node(key)
        if not isinstance(child, DictConfig):
            continue
        if dataclasses.is_dataclass(child._metadata.object_type):
            if not child._is_none():
                _open_free_dicts(child)
        else:
            OmegaConf.set_struct(child, False)


def _leaf_keys(data: dict, prefix: str = "") -> list[str]:
    keys = []
    for key, value in data.items():
        full = f"{prefix}{key}"
        keys.extend(_leaf_keys(value, full + ".") if isinstance(value, dict) else [full])
    return keys


# ---------------------------------------------------------------------- validation


def validate(cfg: DictConfig, provenance: Dict[str, str] | None = None) -> None:
    """Reject impossible values with a message naming the key and its source."""
    provenance = provenance or {}

    def check(ok: bool, key: str, why: str) -> None:
        if not ok:
            value = OmegaConf.select(cfg, key)
            where = provenance.get(key, "defaults")
            raise ConfigError(f"{where}: {key}={value!r}: {why}")

    r, e, a, le, run = cfg.replay, cfg.env, cfg.actor, cfg.learner, cfg.run
    check(r.capacity > 0, "replay.capacity", "must be a positive number of steps")
    check(r.item in kind_names(), "replay.item", f"must be one of {', '.join(kind_names())} (the item kinds known)")
    check(r.selector in SELECTORS, "replay.selector", f"must be one of {', '.join(SELECTORS)}")
    check(r.alpha >= 0, "replay.alpha", "must be ≥ 0")
    check(0 <= r.beta <= 1, "replay.beta", "must be in [0, 1]")
    check(r.top_k >= 1, "replay.top_k", "must be ≥ 1")
    check(r.sequence_length >= 1, "replay.sequence_length", "must be ≥ 1")
    check(r.sequence_period >= 1, "replay.sequence_period", "must be ≥ 1")
    check(0 <= r.burn_in < r.sequence_length, "replay.burn_in", "must be in [0, sequence_length)")
    check(r.max_episode_length >= 1, "replay.max_episode_length", "must be ≥ 1")
    check(r.min_size_to_sample >= 1, "replay.min_size_to_sample", "must be ≥ 1")
    check(r.samples_per_insert >= 0, "replay.samples_per_insert", "must be ≥ 0 (0 disables)")
    check(r.error_buffer >= 0, "replay.error_buffer", "must be ≥ 0")
    check(r.timeout_s > 0, "replay.timeout_s", "must be > 0 seconds")
    check(_device_ok(r.device), "replay.device", f"must be one of {', '.join(DEVICES)} or cuda:N")
    check(not str(r.device).startswith("cuda") or r.selector in DEVICE_SELECTORS, "replay.device",
          f"samples on the GPU with the {' or '.join(DEVICE_SELECTORS)} selector only, not replay.selector={r.selector!r}")  # fmt: skip
    check(le.batch_size >= 1, "learner.batch_size", "must be ≥ 1")
    check(
        le.batch_size <= r.capacity,
        "learner.batch_size",
        f"is larger than replay.capacity ({r.capacity})",
    )
    check(_device_ok(le.device), "learner.device", f"must be one of {', '.join(DEVICES)} or cuda:N")
    check(not (str(r.device).startswith("cuda:") and str(le.device).startswith("cuda:") and r.device != le.device),
          "replay.device", f"assembles batches on {r.device}, but the learner trains on {le.device}")  # fmt: skip
    check(le.prefetch >= 1, "learner.prefetch", "must be ≥ 1")
    check(le.publish_every >= 1, "learner.publish_every", "must be ≥ 1")
    check(le.device_batches == 0 or le.device_batches >= 2, "learner.device_batches",
          "must be 0 (off) or ≥ 2 (one the learner reads, one being filled)")  # fmt: skip
    check(e.num_envs >= 1, "env.num_envs", "must be ≥ 1")
    check(0 <= e.batch_size <= e.num_envs, "env.batch_size", "must be in [0, env.num_envs]")
    check(e.backend in ENV_BACKENDS, "env.backend", f"must be one of {', '.join(ENV_BACKENDS)}")
    check(a.num_actors >= 1, "actor.num_actors", "must be ≥ 1")
    check(0 <= a.epsilon <= 1, "actor.epsilon", "must be in [0, 1]")
    check(a.epsilon_alpha >= 0, "actor.epsilon_alpha", "must be ≥ 0")
    check(a.n_step >= 1, "actor.n_step", "must be ≥ 1")
    check(0 <= a.gamma <= 1, "actor.gamma", "must be in [0, 1]")
    check(a.weight_sync_period >= 1, "actor.weight_sync_period", "must be ≥ 1")
    check(a.max_restarts >= 0, "actor.max_restarts", "must be ≥ 0")
    check(0 <= a.nice <= 19, "actor.nice", "must be in [0, 19]")
    check(0 <= a.remote_actors <= a.num_actors, "actor.remote_actors", f"must be in [0, actor.num_actors={a.num_actors}]")
    check(a.remote_actors == 0 or not (run.serial or run.mode == "offline"), "actor.remote_actors",
          "needs actor processes (not run.serial=true or run.mode=offline)")  # fmt: skip
    t = cfg.transport
    check(0 <= t.port <= 65535, "transport.port", "must be in [0, 65535] (0: any free port)")
    check(t.loop in ("auto", "uvloop", "asyncio"), "transport.loop", "must be one of auto, uvloop, asyncio")
    check(t.kind in transport_names(), "transport.kind", f"must be one of {', '.join(transport_names())}")
    check(all(isinstance(x, str) and _address_ok(x) for x in t.shards), "transport.shards",
          "must be a list of HOST:PORT strings (the addresses gearflow serve logs)")  # fmt: skip
    check(not t.shards or not (run.serial or run.mode == "offline"), "transport.shards",
          "samples remote shards: not with run.serial=true or run.mode=offline")  # fmt: skip
    lim = t.limits
    check(lim.max_connections >= 1, "transport.limits.max_connections", "must be ≥ 1")
    check(lim.max_preauth >= 1, "transport.limits.max_preauth", "must be ≥ 1")
    check(lim.max_in_flight >= 1, "transport.limits.max_in_flight", "must be ≥ 1")
    check(lim.max_queued_bytes >= 1, "transport.limits.max_queued_bytes", "must be ≥ 1")
    check(lim.max_batch >= 1, "transport.limits.max_batch", "must be ≥ 1")
    check(lim.max_reply_bytes >= 1, "transport.limits.max_reply_bytes", "must be ≥ 1")
    check(lim.max_frame_bytes >= (64 << 10) + 32, "transport.limits.max_frame_bytes", "must be ≥ 65568 (a header and an envelope)")
    check(math.isfinite(cfg.transport.node_timeout_s) and cfg.transport.node_timeout_s >= 0, "transport.node_timeout_s",
          "must be a finite number of seconds ≥ 0 (0: the default, 15)")
    check(math.isfinite(lim.auth_timeout_s) and lim.auth_timeout_s > 0, "transport.limits.auth_timeout_s", "must be a finite number of seconds > 0")
    check(math.isfinite(lim.max_wait_s) and lim.max_wait_s > 0, "transport.limits.max_wait_s", "must be a finite number of seconds > 0")
    check(math.isfinite(lim.refusal_log_interval_s) and lim.refusal_log_interval_s > 0, "transport.limits.refusal_log_interval_s",
          "must be a finite number of seconds > 0")  # fmt: skip
    check(a.ladder_offset >= 0, "actor.ladder_offset", "must be ≥ 0")
    check(a.ladder_total == 0 or a.ladder_total >= a.ladder_offset + a.num_actors, "actor.ladder_total",
          f"must be 0 or ≥ actor.ladder_offset + actor.num_actors ({a.ladder_offset + a.num_actors})")  # fmt: skip
    check(le.world_size >= 1, "learner.world_size", "must be ≥ 1")
    check(0 <= le.rank < le.world_size, "learner.rank", f"must be in [0, learner.world_size={le.world_size})")
    check(le.batch_size % le.world_size == 0, "learner.batch_size",
          f"must be a multiple of learner.world_size={le.world_size} (each learner samples its share)")  # fmt: skip
    check(le.world_size == 1 or bool(t.shards), "learner.world_size",
          "> 1 needs transport.shards: data-parallel learners sample shard services (gearflow serve)")  # fmt: skip
    check(_address_ok(le.dist_address), "learner.dist_address", "must be HOST:PORT")
    cl = cfg.cluster
    check(cfg.launcher in LAUNCHERS, "launcher", f"must be {', '.join(LAUNCHERS[:-1])} or {LAUNCHERS[-1]}")
    check(cl.shards >= 1, "cluster.shards", "must be ≥ 1")
    check(cl.learners >= 1, "cluster.learners", "must be ≥ 1")
    check(cl.learner_gpus >= 0, "cluster.learner_gpus", "must be ≥ 0")
    check(cl.max_restarts >= 0, "cluster.max_restarts", "must be ≥ 0")
    check(cl.file_sync_s > 0, "cluster.file_sync_s", "must be > 0")
    check(cfg.launcher == "local" or le.batch_size % cl.learners == 0, "learner.batch_size",
          f"must be a multiple of cluster.learners={cl.learners} (each learner samples its share)")  # fmt: skip
    check(cfg.launcher == "local" or not (run.serial or run.mode == "offline"), "launcher",
          "=ray places actors and shard nodes: not with run.serial=true or run.mode=offline")  # fmt: skip
    check(le.dist_backend in ("auto", "gloo", "nccl"), "learner.dist_backend", "must be one of auto, gloo, nccl")
    geom = replay_geometry(cfg)
    need = kind_def(r.item).config_min_steps(cfg)  # what the config alone says the kind needs (Ape-X: 2 (n + 1))
    check(
        need is None or geom.steps_per_partition >= need,
        "replay.capacity",
        f"gives {geom.steps_per_partition} steps per partition "
        f"({geom.num_actors} actors × {geom.num_envs} envs); need at least {need}",
    )
    check(r.min_size_to_sample <= r.capacity, "replay.min_size_to_sample",
          f"is larger than replay.capacity ({r.capacity}): the table never holds that many items, "
          "so no batch would ever be sampled")  # fmt: skip
    check(run.max_env_steps >= 0, "run.max_env_steps", "must be ≥ 0")
    check(run.max_seconds >= 0, "run.max_seconds", "must be ≥ 0")
    check(run.max_updates >= 0, "run.max_updates", "must be ≥ 0")
    check(run.log_every_s > 0, "run.log_every_s", "must be > 0")
    check(parse_period(run.checkpoint_every) is not None, "run.checkpoint_every",
          "must be a number of updates (500), a duration (90s, 10m, 2h) or 0 (off)")  # fmt: skip
    check(run.keep_checkpoints >= 1, "run.keep_checkpoints", "must be ≥ 1")
    check(parse_period(0 if run.eval_every is None else run.eval_every) is not None, "run.eval_every",
          "must be a number of env steps (50000), a duration (90s, 10m, 2h), 0 or null (off)")  # fmt: skip
    check(run.eval_episodes >= 1, "run.eval_episodes", "must be ≥ 1")
    check(not eval_period(cfg) or not (t.shards or cfg.launcher == "ray"), "run.eval_every",
          "evaluates from this machine's parameter store: not with transport.shards or launcher=ray yet "
          "(evaluate their checkpoints with gearflow eval)")  # fmt: skip
    check(run.progress in PROGRESS_MODES, "run.progress", f"must be one of {', '.join(PROGRESS_MODES)}")
    check(run.mode in RUN_MODES, "run.mode", f"must be one of {', '.join(RUN_MODES)}")
    offline = run.mode == "offline"
    check(not offline or bool(run.dataset), "run.dataset", "run.mode=offline needs a dataset file (HDF5)")
    check(offline or not run.dataset, "run.dataset", "is only read when run.mode=offline")
    check(not offline or run.max_env_steps == 0, "run.max_env_steps",
          "run.mode=offline takes no env steps: set run.max_env_steps=0 and stop with run.max_updates or run.max_seconds")  # fmt: skip
    check(not offline or run.max_updates > 0 or run.max_seconds > 0, "run.max_updates",
          "run.mode=offline needs run.max_updates or run.max_seconds to stop")  # fmt: skip
    check(not offline or r.samples_per_insert == 0, "replay.samples_per_insert",
          "run.mode=offline inserts nothing after loading the dataset: the samples-per-insert limit must be 0")  # fmt: skip
    if e.factory is None:
        known, why = env_id_known(e.id, e.backend)
        check(known, "env.id", why)


@lru_cache(maxsize=None)
def envpool_ids() -> frozenset[str]:
    """Task ids this EnvPool install can make (empty without EnvPool, or when it cannot be
    imported: envpool without its assets raises FileNotFoundError for ``atari/roms``; point
    ``ENVPOOL_ASSETS_PATH`` at a folder that has them, launch/device_kit.sh); cached."""
    try:
        import envpool
    except ImportError:
        return frozenset()
    except OSError as exc:  # FileNotFoundError: envpool-assets missing, ENVPOOL_ASSETS_PATH not set
        log.warning("envpool cannot be imported (%s: %s); using gymnasium's ids only "
                    "(install envpool-assets or set ENVPOOL_ASSETS_PATH)", type(exc).__name__, exc)
        return frozenset()
    return frozenset(envpool.list_all_envs())


def env_id_known(env_id: str, backend: str) -> tuple[bool, str]:
    """Whether the chosen backend can make ``env_id``; otherwise a reason with suggestions."""
    available = envpool_ids() if backend in ("auto", "envpool") else frozenset()
    if env_id in available:
        return True, ""
    if backend == "envpool":
        if not available:
            return False, "env.backend=envpool but envpool is not installed (pip install envpool)"
        close = difflib.get_close_matches(env_id, sorted(available), n=3)
        return False, f"unknown EnvPool task id; close matches: {', '.join(close) or 'none'}"
    import gymnasium

    if env_id in gymnasium.registry:
        return True, ""
    candidates = sorted(set(gymnasium.registry) | available)
    close = difflib.get_close_matches(env_id, candidates, n=3)
    return False, (
        f"unknown environment id (not in EnvPool nor gymnasium); close matches: "
        f"{', '.join(close) or 'none'}; set env.factory for a custom environment"
    )


# ------------------------------------------------------------------- save / reload


def to_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg, resolve=True)


def save_config(cfg: DictConfig, path: str | Path) -> Path:
    """Write the resolved config (the run directory's ``config.yaml``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    from gearflow.run.private import redacted

    tmp = path.with_suffix(".tmp")
    tmp.write_text(to_yaml(redacted(cfg)))  # never the secret: a resume reads it from the environment / token file
    tmp.replace(path)
    return path
