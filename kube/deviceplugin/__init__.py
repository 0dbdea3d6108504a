"""The gpushare device plugin (docs/kubernetes.md, "The device plugin"): one per node,
beside nodemgr. :mod:`.book` decides (pure); :mod:`.plugin` serves the kubelet and
carries the decisions out in nodemgr."""
