"""The ``gearflow`` command line.

    gearflow train CONFIG [KEY=VALUE ...]      train (single machine)
    gearflow train --resume RUN_DIR [KEY=VALUE ...]   continue a run from its latest checkpoint
    gearflow train CONFIG launcher=ray         shard nodes, actor groups and learners on a Ray cluster
    gearflow actor --connect HOST:PORT [CONFIG]  actors for a run elsewhere (actor.remote_actors there)
    gearflow serve CONFIG [KEY=VALUE ...]      this node's replay shard and actors, for learners elsewhere
    gearflow eval RUN_DIR [--episodes N]       greedy evaluation of a run's latest (or --checkpoint) checkpoint
    gearflow plot RUN_DIR [RUN_DIR ...]        learning curves as a PNG (a metric; seeds of one config:
                                               mean/IQM with a bootstrap band; resumes marked)
    gearflow config CONFIG [KEY=VALUE ...]     print the resolved config
    gearflow check-env CONFIG [KEY=VALUE ...]  the env and agent through the actors' checks and one learn step
    gearflow bench {replay,keys,actors,transport,cluster}   benchmarks that print JSON lines
    gearflow replay gc                         remove shared memory left by crashed runs
    gearflow info                              versions and what is usable here

Every sub-command has ``--help``. Errors in the user's input (a bad config, a
missing optional dependency) print one line and exit with status 2, never a
traceback. ``gearflow train`` exits 0 when a stopping limit was reached, 3 when an
actor failed more than ``actor.max_restarts`` times (after its final checkpoint),
and 128 + the signal (143 for SIGTERM, 130 for SIGINT) when a signal stopped it
(after its final checkpoint): a scheduler can tell "stopped and checkpointed,
resume me" from "finished".
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Callable, Sequence

from gearflow.errors import GearflowError
from gearflow.log import setup_logging

log = logging.getLogger("gearflow.cli")

OVERRIDES_HELP = "dotlist overrides applied after the file, e.g. replay.capacity=2e5 run.seed=3"


def _add_verbosity(parser: argparse.ArgumentParser, top: bool = False) -> None:
    # Sub-commands SUPPRESS their defaults so `gearflow -v train` is not reset by `train`.
    default = False if top else argparse.SUPPRESS
    group = parser.add_mutually_exclusive_group()
    group.add_argument("-v", "--verbose", action="store_true", default=default, help="debug logging")
    group.add_argument(
        "-q", "--quiet", action="store_true", default=default, help="warnings and errors only"
    )


def _cmd_config(args: argparse.Namespace) -> int:
    from gearflow.config import explain, load_config, to_yaml

    cfg = load_config(args.config, args.overrides)
    print(explain(cfg) if args.explain else to_yaml(cfg), end="\n" if args.explain else "")
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    from pathlib import Path

    from gearflow.config import load_config
    from gearflow.topology.plan import plan_run
    from gearflow.topology.run import run_plan

    if args.resume is None:
        if args.config is None:
            raise GearflowError("give a CONFIG file, or --resume RUN_DIR")
        cfg = load_config(args.config, args.overrides)
    else:
        overrides = list(args.overrides)
        if args.config is not None:
            if "=" not in args.config:
                raise GearflowError(
                    f"give either a CONFIG file ({args.config}) or --resume RUN_DIR, not both; "
                    "a resumed run uses RUN_DIR/config.yaml (KEY=VALUE overrides still apply)"
                )
            overrides.insert(0, args.config)
        run_dir = Path(args.resume)
        if not (run_dir / "config.yaml").is_file():
            raise GearflowError(f"--resume {run_dir}: no config.yaml there (not a gearflow run directory)")
        cfg = load_config(run_dir / "config.yaml", overrides)
        cfg.run.dir = str(run_dir)
    resume = args.resume is not None
    summary = run_plan(cfg, plan_run(cfg, resume=resume), resume=resume)  # the plan, chosen once, and run
    print(json.dumps(summary))
    if summary.get("stop_signal"):  # stopped (and checkpointed), not finished
        import signal

        return 128 + int(signal.Signals[summary["stop_signal"]])
    return 0


def _cli_token(args: argparse.Namespace) -> str | None:
    """The secret of ``gearflow actor``: ``--token-file``, else ``$GEARFLOW_TOKEN``; ``--token`` still
    works but warns (a command line is visible to every user of the machine)."""
    from gearflow.run.private import config_token

    if args.token:
        log.warning("--token puts the secret in every process listing (ps, /proc/*/cmdline): "
                    "set $GEARFLOW_TOKEN or use --token-file PATH instead")  # fmt: skip
        return args.token
    if args.token_file:
        return config_token({"token_file": args.token_file})
    return None


def _cmd_actor(args: argparse.Namespace) -> int:
    from gearflow.actors.connect import ActorSet
    from gearflow.config import load_config, to_yaml
    from gearflow.log import inherited_verbosity

    from gearflow.transport.auth import configure

    local = None
    if args.config is not None:
        cfg = load_config(args.config, args.overrides)
        configure(cfg.transport)  # without CONFIG: $GEARFLOW_INTEGRITY (else on), $GEARFLOW_TLS (else none)
        local = to_yaml(cfg)
    elif args.overrides:
        raise GearflowError("KEY=VALUE overrides need a CONFIG file")
    if args.actors < 1:
        raise GearflowError(f"--actors must be ≥ 1, got {args.actors}")
    from gearflow.transport.auth import resolve_token
    from gearflow.transport.client import parse_address

    try:
        parse_address(args.connect)
        token = resolve_token(_cli_token(args)).decode()
    except ValueError as exc:
        raise GearflowError(f"--connect {args.connect}: {exc}") from None
    actors = ActorSet(args.connect, local, args.actors, token=token, first_actor=args.actor, wait_s=args.wait,
                      verbosity=inherited_verbosity())  # fmt: skip
    import signal

    stopped = []

    def on_signal(signum, frame):
        stopped.append(signum)
        actors.stop_event.set()

    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, on_signal)
    actors.start()
    code = actors.wait()
    if stopped:
        return 128 + int(stopped[0])
    return 0 if code == 0 else (2 if code == 2 else 3)


def _cmd_serve(args: argparse.Namespace) -> int:
    from gearflow.config import load_config
    from gearflow.topology.plan import plan_run
    from gearflow.topology.run import run_plan

    cfg = load_config(args.config, args.overrides)
    summary = run_plan(cfg, plan_run(cfg, command="serve"), address_file=args.address_file)
    print(json.dumps(summary))
    if summary.get("stop_signal"):
        import signal

        return 128 + int(signal.Signals[summary["stop_signal"]])
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    from gearflow.run.evaluate import evaluate

    result = evaluate(args.run_dir, episodes=args.episodes, video=args.video, seed=args.seed,
                      checkpoint=args.checkpoint)
    print(json.dumps(result))
    return 0


def _cmd_plot(args: argparse.Namespace) -> int:
    from gearflow.run.plot import plot_runs

    out = plot_runs(args.run_dirs, out=args.out, metric=args.metric, x=args.x, smoothing=args.smooth, agg=args.agg,
                    ci=args.ci, group=not args.separate)  # fmt: skip
    print(out)
    return 0


def _cmd_check_env(args: argparse.Namespace) -> int:
    from gearflow.config import load_config
    from gearflow.tools.check_env import check_env

    return 1 if check_env(load_config(args.config, args.overrides), steps=args.steps) else 0


def _cmd_secret(args: argparse.Namespace) -> int:
    from gearflow.transport.auth import TOKEN_ENV, actor_credential, resolve_token

    try:
        if args.secret_file:
            secret = resolve_token(open(args.secret_file, encoding="utf-8").read().strip())
        else:
            secret = resolve_token(None)
        print(actor_credential(secret, args.name))
    except (OSError, ValueError) as exc:
        raise GearflowError(f"gearflow secret actor: {exc} (the learner's secret: ${TOKEN_ENV} or --secret-file)") from None
    return 0


def _cmd_tls_init(args: argparse.Namespace) -> int:
    from gearflow.transport.tls import TlsError, init

    try:
        for path in init(args.dir, args.name or ""):
            print(path)
    except (TlsError, OSError) as exc:
        raise GearflowError(f"gearflow tls init: {exc}") from None
    return 0


def _cmd_info(args: argparse.Namespace) -> int:
    from gearflow.tools.info import collect, render

    print(render(collect()))
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from gearflow import bench

    return bench.main(args)


def _cmd_replay_gc(args: argparse.Namespace) -> int:
    from gearflow.replay.storage import gc_segments

    from gearflow.replay.storage import SHM_DIR

    kept: list[tuple[str, str]] = []
    removed = gc_segments(prefix=args.prefix, dry_run=args.dry_run, include_live=args.force, kept=kept)
    verb = "would remove" if args.dry_run else "removed"
    for name, size in removed:
        print(f"{verb} {SHM_DIR}/{name} ({size / 2**20:.1f} MiB)")
    for name, why in kept:
        print(f"kept {SHM_DIR}/{name} (owner {why})")
    print(f"{verb} {len(removed)} segment(s)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gearflow",
        description="Asynchronous actor/learner RL with embedded, GPU-centric replay.",
    )
    _add_verbosity(parser, top=True)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def add(name: str, func: Callable[[argparse.Namespace], int], help_: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_, description=help_)
        _add_verbosity(p)
        p.set_defaults(func=func)
        return p

    p = add("train", _cmd_train, "train from a YAML config on this machine")
    p.add_argument("config", nargs="?", help="YAML config file (see configs/); omitted with --resume")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help=OVERRIDES_HELP)
    p.add_argument("--resume", metavar="RUN_DIR",
                   help="continue the run in RUN_DIR from its latest valid checkpoint (its config.yaml)")  # fmt: skip

    p = add("actor", _cmd_actor, "actor processes on this machine for a gearflow train run elsewhere "
            "(actor.remote_actors > 0 there)")
    p.add_argument("--connect", required=True, metavar="HOST:PORT", help="the learner's transport address (its log names it)")
    p.add_argument("config", nargs="?", help="YAML config: checked against the learner's (env and agent must match); "
                   "actor.device and actor.nice apply here")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help=OVERRIDES_HELP)
    p.add_argument("--actors", type=int, default=1, help="actor processes to start (default 1)")
    p.add_argument("--actor", type=int, default=None, metavar="K",
                   help="take remote actor places K, K+1, ... (default: any free ones)")
    p.add_argument("--token-file", default=None, metavar="PATH",
                   help="file holding the shared secret (mode 0600; default: $GEARFLOW_TOKEN)")
    p.add_argument("--token", default=None, help=argparse.SUPPRESS)  # shows in ps: warned, kept for old scripts
    p.add_argument("--wait", type=float, default=60.0, metavar="S",
                   help="keep retrying an unreachable learner for S seconds before giving up (default 60)")

    p = add("serve", _cmd_serve, "this node's replay shard and actors, served to learners on other machines "
            "(their transport.shards lists this node's HOST:PORT); exits when a learner ends the run")
    p.add_argument("config", help="YAML config: the run's (env, agent, replay), with this node's actor.num_actors, "
                   "actor.ladder_offset/ladder_total and transport.host/port")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help=OVERRIDES_HELP)
    p.add_argument("--address-file", metavar="FILE", help="write HOST:PORT there once listening")

    p = add("eval", _cmd_eval, "greedy evaluation of a run's latest checkpoint; prints mean/std return")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (runs/<name>-<time>)")
    p.add_argument("--episodes", type=int, default=10, help="episodes to play (default 10)")
    p.add_argument("--seed", type=int, default=12345, help="environment seed (default 12345)")
    p.add_argument("--video", metavar="OUT.mp4", help="also record one episode (envs that render)")
    p.add_argument("--checkpoint", metavar="DIR", help="a checkpoint directory (default: the newest valid one)")

    p = add("plot", _cmd_plot, "learning curves of one or more runs as a PNG")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories to overlay")
    p.add_argument("-o", "--out", help="output PNG (default: RUN_DIR/curves.png of the first run)")
    p.add_argument("--metric", help="the logged scalar to draw (default: eval/return_mean if logged, else "
                   "actor/return_last100)")
    p.add_argument("--x", choices=["steps", "time", "updates"], default="steps", help="x axis (default steps)")
    p.add_argument("--smooth", type=float, default=0.0, metavar="W",
                   help="TensorBoard-style smoothing weight in [0, 1) (default 0: none)")
    p.add_argument("--agg", choices=["mean", "iqm"], default="mean",
                   help="aggregate of runs that are seeds of one config (default mean; iqm: interquartile mean)")
    p.add_argument("--ci", type=float, default=0.95, help="bootstrap confidence level of the band (default 0.95)")
    p.add_argument("--separate", action="store_true", help="one curve per run, no aggregation over seeds")

    p = add("config", _cmd_config, "print the resolved config (defaults ← file ← overrides)")
    p.add_argument("config", help="YAML config file (see configs/)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help=OVERRIDES_HELP)
    p.add_argument("--explain", action="store_true", help="print every key with its meaning")

    p = add("check-env", _cmd_check_env, "check a config's env and agent against the actors' contract: a few "
            "recvs with random actions, then through the actor, then one learn step; one line per problem, exit 1")
    p.add_argument("config", help="YAML config file (env.factory / env.id and agent.name as in training)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help=OVERRIDES_HELP)
    p.add_argument("--steps", type=int, default=200, help="recvs of each stage (default 200)")

    p = add("secret", lambda a: a.secret_func(a), "credentials derived from the learner's secret")
    ssub = p.add_subparsers(dest="secret_command", metavar="KIND", required=True)
    sa = ssub.add_parser(
        "actor",
        help="print the actor credential of NAME (give it to that actor machine as $GEARFLOW_TOKEN)",
        description="print the actor credential of NAME, derived from the learner's secret ($GEARFLOW_TOKEN, or "
        "--secret-file): an actor machine that holds it may join, write its partitions, report and read "
        "weights, nothing else, and cannot pose as the learner to another actor (give each machine its own NAME).",
    )
    sa.add_argument("name", help="the actor machine's name: letters, digits, '-', '_' (at most 64)")
    sa.add_argument("--secret-file", metavar="FILE", help="read the learner's secret from FILE (default: $GEARFLOW_TOKEN)")
    sa.set_defaults(secret_func=_cmd_secret)

    p = add("tls", lambda a: a.tls_func(a), "mutual TLS files for transport.tls")
    tsub = p.add_subparsers(dest="tls_command", metavar="ACTION", required=True)
    ti = tsub.add_parser(
        "init",
        help="make DIR's certificate authority (if none) and a node certificate (needs the openssl command)",
        description="make DIR/ca.pem + ca.key (once) and DIR/node.pem + node.key, or with --name NAME "
        "DIR/NAME/{ca.pem,node.pem,node.key} for another machine; then transport.tls=DIR (or DIR/NAME there). "
        "Keep ca.key where certificates are made.",
    )
    ti.add_argument("dir", help="the directory (created 0700; keys 0600)")
    ti.add_argument("--name", default="", help="another machine's certificate, under DIR/NAME")
    ti.set_defaults(tls_func=_cmd_tls_init)

    add("info", _cmd_info, "versions of the dependencies and whether CUDA, CuPy, nvcc, RDMA are usable")

    p = add("bench", _cmd_bench, "benchmarks; each prints one JSON object per measurement")
    from gearflow import bench

    bench.add_arguments(p)

    p = add("replay", lambda a: a.replay_func(a), "replay table maintenance")
    rsub = p.add_subparsers(dest="replay_command", metavar="ACTION", required=True)
    gc = rsub.add_parser(
        "gc",
        help="remove gearflow shared-memory segments whose owning process is provably gone",
        description="remove gearflow shared-memory segments whose owning process is provably gone: "
        "the machine rebooted since, or, in this PID namespace, no process has its PID and start time. "
        "Segments of owners in another PID namespace (another container sharing /dev/shm) are kept.",
    )
    gc.add_argument("--prefix", default="gearflow", help="segment name prefix (default: gearflow)")
    gc.add_argument("--dry-run", action="store_true", help="list what would be removed, remove nothing")
    gc.add_argument("--force", action="store_true",
                    help="also remove segments whose owner may be alive (another PID namespace included)")
    gc.set_defaults(replay_func=_cmd_replay_gc)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    # Agents, env factories and obs transforms are named by import path: find a user's module in
    # the current directory, as `python -m gearflow` does, after installed packages, so it shadows
    # none; load_config adds the CONFIG file's directory and run.module_dirs (so `gearflow train
    # examples/custom_agent/my_dqn.yaml` finds my_dqn.py from anywhere, and so do --resume and
    # eval of its run). Actor processes are spawned with this sys.path, so they import it too.
    import os

    parser = build_parser()
    args = parser.parse_args(argv)
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    verbosity = -1 if args.quiet else (1 if args.verbose else 0)
    setup_logging(verbosity)
    if args.command in ("train", "serve", "actor"):  # what a run writes (logs, metrics, checkpoints): 0600
        from gearflow.run.private import private_umask

        private_umask()
    try:
        return args.func(args)
    except GearflowError as exc:
        print(f"gearflow {args.command}: error: {exc}", file=sys.stderr)
        return getattr(exc, "exit_code", 2)
    except KeyboardInterrupt:
        print(f"gearflow {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
