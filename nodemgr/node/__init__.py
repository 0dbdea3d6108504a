"""The node's state: the Node (GPUs, environments, tasks, grants), its data model, the
turns of time-sliced GPUs, the store that keeps quotas and records across restarts, and
recovery from that store at start.
"""
