"""gpushare on Kubernetes (docs/kubernetes.md): the resources a pod asks for, the device
plugin each node runs beside its nodemgr, the scheduler extender, and the kubelet's
protocol files."""
