"""An unmodified training script stand-in (no hpcshard, no torch): counts steps, saves
its own checkpoint-N.json every --save-every steps into $HPCSHARD_CHECKPOINT_DIR (else
./checkpoints) and resumes from the newest one. It does nothing about preemption unless
--requeue-on-usr1: then, like Lightning's SLURMEnvironment, rank 0 answers SIGUSR1 with
`scontrol requeue $SLURM_JOB_ID` itself. --progress: it tells hpcshard each step
(`hpcshard.preemption.progress`), which then also sees a hung rank."""

import argparse
import json
import os
import signal
import subprocess
import time
from pathlib import Path

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--save-every", type=int, default=5)
parser.add_argument("--step-seconds", type=float, default=0.5)
parser.add_argument("--requeue-on-usr1", action="store_true")
parser.add_argument("--save-on-term", action="store_true",
                    help="like Hugging Face's JIT checkpoint: on SIGTERM save and end cleanly")
parser.add_argument("--progress", action="store_true", help="report each step to hpcshard")
args = parser.parse_args()
if args.progress:
    from hpcshard import preemption

rank = int(os.environ.get("RANK", "0"))
ckpt = Path(os.environ.get("HPCSHARD_CHECKPOINT_DIR", "checkpoints"))
if args.requeue_on_usr1:
    def requeue(_signum, _frame):
        if rank == 0:
            print("SIGUSR1: requeueing myself", flush=True)
            subprocess.run(["scontrol", "requeue", os.environ["SLURM_JOB_ID"]])
    signal.signal(signal.SIGUSR1, requeue)

stop: list[bool] = []
if args.save_on_term:
    signal.signal(signal.SIGTERM, lambda _signum, _frame: stop.append(True))

saved = sorted(int(p.stem.split("-")[1]) for p in ckpt.glob("checkpoint-*.json"))
start = saved[-1] if saved else 0
print(f"pid {os.getpid()}", flush=True)
print(f"rank {rank} starts after step {start}; deadline {os.environ.get('HPCSHARD_DEADLINE')}",
      flush=True)
for step in range(start + 1, args.steps + 1):
    if args.progress:
        preemption.progress(step)
    time.sleep(args.step_seconds)
    print(f"rank {rank} step {step}", flush=True)
    if rank == 0 and (step % args.save_every == 0 or stop):
        ckpt.mkdir(parents=True, exist_ok=True)
        (ckpt / f"checkpoint-{step}.json").write_text(json.dumps({"step": step}))
    if stop:
        print(f"rank {rank} saved on SIGTERM at step {step}; exiting 0", flush=True)
        break
