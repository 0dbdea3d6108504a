"""Exit codes of nodemgr's commands and of gpushare-run, defined once. Most are sysexits.h
codes, so scripts can tell a node that is down (69) from a request refused (77)."""

from __future__ import annotations

EXIT_ADMIN_REFUSED = 1  # a nodemgr command: nodemgr refused the request
EXIT_USAGE = 2  # bad usage: an option or a GPUSHARE_* value (click's own code too)
EXIT_UNREACHABLE = 69  # EX_UNAVAILABLE: nodemgr unreachable, or its socket refuses this user
EXIT_NO_RESOURCES = 75  # EX_TEMPFAIL: no GPUs free, now or within the wait
EXIT_REFUSED = 77  # EX_NOPERM: gpushare-run's request refused (quota, node, environment)
EXIT_CONFIG = 78  # EX_CONFIG: bad configuration, or nodemgr could not start
EXIT_INTERNAL = 125  # gpushare-run itself failed
EXIT_NOT_EXECUTABLE = 126  # as a shell says: CMD cannot be executed
EXIT_NOT_FOUND = 127  # as a shell says: CMD not found
EXIT_CANCELLED = 130  # 128 + SIGINT: interrupted while waiting for GPUs
