"""Several nodes: the cluster map (a file, or etcd), each node's slice of the vbuckets, the
nodes' registrations, and scans across them."""
