"""`python -m hpcshard.runtime.evaluate RUN_DIR STEP`: the held-out loss of one committed
checkpoint of a run, in one process (a `--then eval` step: `launch.then`).

The trainer the run trained with, built as every rank built it (the job, its config, on a
world of one: DCP reshards the checkpoint), loads the checkpoint and runs its own
`evaluate` over the run's held-out split (`eval_batches` of the data section; a run that
trained with `eval_every=0` is evaluated all the same). The loss goes to the run's
metrics as an `eval_loss` record of that step (what `status` and `plot` show), and to
stdout as one JSON line."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from hpcshard.config import build_config, kept_sets
from hpcshard.errors import UserError
from hpcshard.rundir.files import append_line
from hpcshard.rundir.paths import RunPaths
from hpcshard.rundir.spec import RunSpec
from hpcshard.runtime.job import load_job


def evaluate(run_dir: Path, step: int) -> float:
    """The held-out loss of checkpoint `step` of the run in `run_dir`."""
    import torch.distributed as dist

    from hpcshard.runtime.device import init_distributed
    from hpcshard.runtime.train import Trainer

    spec = RunSpec.read(run_dir)
    if spec.script is not None:
        raise UserError(f"{run_dir} runs a script: its evaluation is its own")
    spec.use_code()
    job = load_job(spec.job)
    sets = kept_sets(spec.sets, spec.resolved.config)
    cfg = build_config(job.config, {**sets, "eval_every": "1"})  # (any: it only turns evaluation on)
    env = init_distributed()
    try:
        trainer = Trainer(job, cfg, env, run_dir)
        if not trainer.eval_count:
            raise UserError(f"{run_dir}: the held-out split holds less than one batch: nothing to evaluate")
        # Only read: the run may have been resumed meanwhile and be saving beside this.
        loaded = trainer.restore(str(step), pretrained=False, reader=True)
        if loaded is None or loaded.step != step:
            raise UserError(f"{run_dir}: checkpoint step {step} did not load")
        return trainer.evaluate()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    run_dir, step = Path(args[0]), int(args[1])
    try:
        loss = evaluate(run_dir, step)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return UserError.exit_code
    append_line(RunPaths(run_dir).metrics, json.dumps({"step": step, "time": time.time(), "eval_loss": loss,
                                                       "source": "then eval"}) + "\n")
    print(json.dumps({"step": step, "eval_loss": loss}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
