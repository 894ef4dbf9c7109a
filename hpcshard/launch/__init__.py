"""What runs in the allocation, one process per node: the node's environment, the
rendezvous, and torchrun for that node. Stdlib only; torch is only exec'd (torchrun)."""
