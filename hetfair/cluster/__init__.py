"""The cluster description: the cluster file (:mod:`~hetfair.cluster.description`) and the GPU catalogue
(:mod:`~hetfair.cluster.catalogue`) its device kinds come from. Pure Python: no torch."""

from hetfair.cluster.catalogue import CATALOGUE, DeviceKind, device_kind
from hetfair.cluster.description import (DEFAULT_INTRA_NODE, DEFAULT_NETWORK, Cluster, Device, Link, Node,
                                         cluster_from_dict, load_cluster, parse_bandwidth, parse_flops,
                                         parse_latency, parse_memory)

__all__ = ["CATALOGUE", "DEFAULT_INTRA_NODE", "DEFAULT_NETWORK", "Cluster", "Device", "DeviceKind", "Link", "Node",
           "cluster_from_dict", "device_kind", "load_cluster", "parse_bandwidth", "parse_flops", "parse_latency",
           "parse_memory"]
