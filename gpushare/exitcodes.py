"""Exit codes of nodemgr's commands and of gpushare-run, defined once. Most are sysexits.h
codes, so scripts can tell a node that is down (69) from a request refused (77)."""

from __future__ import annotations

EXIT_ADMIN_REFUSED = 1  # a nodemgr command: nodemgr refused the request
EXIT_USAGE = 2  # bad usage: an option or a GPUSHARE_* value (click's own code too)
EXIT_DATA = 65  # EX_DATAERR: an input file that is not what it should be (a trace's CSV)
EXIT_UNREACHABLE = 69  # EX_UNAVAILABLE: nodemgr unreachable, or its socket refuses this user
EXIT_NO_RESOURCES = 75  # EX_TEMPFAIL: no GPUs free, now or within the wait
EXIT_REFUSED = 77  # EX_NOPERM: gpushare-run's request refused (quota, node, environment)
EXIT_CONFIG = 78  # EX_CONFIG: bad configuration, or nodemgr could not start
EXIT_SOFTWARE = 70  # EX_SOFTWARE: nodemgr's loop kept failing; it stopped to be restarted
EXIT_INTERNAL = 125  # gpushare-run itself failed
EXIT_NOT_EXECUTABLE = 126  # as a shell says: CMD cannot be executed
EXIT_NOT_FOUND = 127  # as a shell says: CMD not found
EXIT_CANCELLED = 130  # 128 + SIGINT: interrupted while waiting for GPUs
# gpushare-run's command ended because nodemgr reclaimed the task's GPUs (docs/client.md,
# "Reclaimed tasks"): one code per reason, clear of the codes above and of 128+N.
EXIT_RECLAIMED_IDLE = 90  # no kernel launched for the environment's idle timeout
EXIT_RECLAIMED_TIMEOUT = 91  # nodemgr heard no heartbeat for its heartbeat timeout
EXIT_RECLAIMED_ADMIN = 92  # an operator reclaimed the task (nodemgr reclaim)
EXIT_RECLAIMED_DELETED = 93  # an operator deleted the environment (nodemgr quota delete)
EXIT_RECLAIMED_OTHER = 94  # reclaimed for a reason this client does not know
# Requeued for a latency-sensitive task (docs/scheduling.md, "Classes") with --no-requeue
# (without it gpushare-run waits for GPUs again and runs the command again).
EXIT_PREEMPTED = 95
# A latency-sensitive request refused: the environment may not run such tasks.
EXIT_CLASS_REFUSED = 96
# gpushare-run --predict made no prediction: the command failed in the dry run before it
# reported the iterations asked for (docs/prediction.md).
EXIT_NOT_PREDICTED = 97
RECLAIM_EXIT_CODES = {
    "idle": EXIT_RECLAIMED_IDLE,
    "timeout": EXIT_RECLAIMED_TIMEOUT,
    "admin": EXIT_RECLAIMED_ADMIN,
    "deleted": EXIT_RECLAIMED_DELETED,
    "preempted": EXIT_PREEMPTED,
}
