"""The network data plane over TCP: framing, an authenticated service, a client, the replay shard
service and the remote writer / sampler / parameter source (see README.md)."""
