"""The learner side of the transport: a learner samples shards, pushes weights to shard nodes
and reads their progress (see README.md)."""

from gearflow.transport.learner.sampler import LEARNER_PREFETCH, RemoteSampler
from gearflow.transport.learner.shards import PushedParams, RemoteShards, ShardsUnavailable, TolerantSampler

__all__ = ["LEARNER_PREFETCH", "PushedParams", "RemoteSampler", "RemoteShards", "ShardsUnavailable", "TolerantSampler"]
