"""What nodemgr tells: the admin views (status, tasks, quotas, grants), the one
environment's view a user may see, and the Prometheus metrics.
"""
