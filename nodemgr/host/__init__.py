"""The host machine, behind seams the rest of nodemgr calls: the GPUs and one backend that
asks NVML of them (the driver's, or the simulated one), the per-environment ledgers and
directories, /proc, GPU locks, the context-memory probe, the bypass audit and utilisation
sampling.
"""
