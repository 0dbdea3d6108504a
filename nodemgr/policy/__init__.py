"""Pure policies: state in, decision out, no I/O. The scheduler (which GPUs a request
gets), time-slice turns, the wait queue's order, idle-task rules and rate limits. The same
code serves the live daemon, tests and simulators.
"""
