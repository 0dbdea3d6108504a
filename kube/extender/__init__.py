"""The gpushare scheduler extender (docs/kubernetes.md, "The scheduler extender"):
kube-scheduler asks it to filter and score nodes for a pod and to bind the pod, and it
answers with a policy of the placement engine. :mod:`.model` decides (pure);
:mod:`kube.apiserver` reads the cluster; :mod:`.server` serves kube-scheduler."""
