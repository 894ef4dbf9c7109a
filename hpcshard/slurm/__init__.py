"""Every conversation with Slurm, in one package (stdlib; submitit and jinja2 are imported
only where they are needed):

    time     Slurm's time and memory values, parsed the way Slurm parses them
    sbatch   the request (SbatchRequest) and its rendering through a jinja2 template
    client   one way to run Slurm's commands: a timeout, a bounded retry where it is safe
    cluster  queries and commands: sinfo, scontrol, sacct, scancel, sbatch
    states   JobState: Slurm's job states, mapped from its strings once
    submit   submission through submitit, with hpcshard's own sbatch text
    arrays   a sweep past the cluster's MaxArraySize as several arrays, one throttle
    env      SlurmEnv: the one object that reads SLURM_* inside an allocation
"""
