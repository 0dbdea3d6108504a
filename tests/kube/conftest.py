"""The Kubernetes tests' set-up: gRPC's fork handlers off in the test process, which
forks children (nodemgr, the plugin, tasks) while its own gRPC servers run; a child
execs at once, so it needs none, and gRPC would log each fork otherwise."""

import os

os.environ["GRPC_ENABLE_FORK_SUPPORT"] = "false"
