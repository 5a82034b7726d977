"""The RDMA data plane beside TCP: GEAR's one-sided READs of a shard's segment (see README.md).

``fabric`` (queue pairs, regions, READ chains; pyverbs and a loopback double), ``replay``
(:class:`~gearflow.transport.rdma.replay.RdmaShard` / ``RdmaSampler``: replay batches over the
fabric) and ``bench`` (``python -m gearflow.transport.rdma.bench``). Importing them never imports
pyverbs; :func:`gearflow.transport.choice.choose_transport` says whether RDMA is usable here.
"""
