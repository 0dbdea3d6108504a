"""gpushare's placement engine: which node and which GPUs of it a task gets, in a cluster.

Pure policies, state in and decision out (docs/placement.md): :mod:`placement.cluster`
holds a cluster's state (nodes with CPU, memory and typed GPUs, each GPU's free share) and
the tasks asking for it; :mod:`placement.policies` registers the policies by name; the
trace replays (:mod:`placement.replay` and :mod:`placement.timeline`, ``gpushare-cluster``)
call them, as the Kubernetes integration will. Only the edges read files
(:mod:`placement.trace`) or print (:mod:`placement.cli`).

It needs numpy, installed with ``pip install 'gpushare[cluster]'``.
"""

from __future__ import annotations
