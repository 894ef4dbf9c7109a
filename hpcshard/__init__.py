"""hpcshard: FSDP2/HSDP training jobs from a Slurm login node to many GPU nodes.

Importing this package loads nothing heavy: the CLI runs on login nodes where
`hpcshard --help` must be instant. Torch lives in `hpcshard.runtime`.
"""

__version__ = "0.1.0"
