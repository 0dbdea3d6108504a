"""The host machine, behind seams the rest of nodemgr calls: the GPUs (NVML or the
simulated driver), the per-environment ledgers and directories, /proc, GPU locks, the
context-memory probe, the bypass audit and utilisation sampling.
"""
