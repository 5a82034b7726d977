"""The server side of the transport: a machine's replay shard served over TCP, and a shard
node's control messages (see README.md)."""
