"""The network data plane, by side (see README.md): the common wire (framing, auth, service,
client, the typed write ops, the shard's errors, the TCP/RDMA choice), ``actor`` (remote
writers and weights), ``learner`` (the remote sampler and shard nodes' client), ``server``
(the shard service and a node's handlers) and ``rdma`` (one-sided READs beside TCP)."""
