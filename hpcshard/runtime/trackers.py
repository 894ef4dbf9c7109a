"""TensorBoard and Weights & Biases beside RUN_DIR/metrics.jsonl (which stays the source of
truth the CLI reads): rank 0 sends them the same step records.

One hpcshard run is one TensorBoard run and one W&B run, whatever stops and resumes it:

- TensorBoard: event files in RUN_DIR/tensorboard; each start opens a writer with
  `purge_step` = the step it resumes after + 1, so TensorBoard hides what an earlier attempt
  logged past that checkpoint (a resume from an older checkpoint, or the steps a crash
  lost) and shows the steps trained again instead. Flushed at every record: a rank killed
  loses nothing that was logged.
- W&B: the run id comes from the run directory and its creation time, and every start
  resumes it (`resume="allow"`); W&B keeps a step once, so steps at or below the highest
  one already logged (the metrics file says which) are not sent again. Offline mode
  (`wandb_mode=offline`) writes RUN_DIR/wandb and needs no network: `wandb sync` uploads it.

Credentials (WANDB_API_KEY, ...) reach the ranks through their environment, never through
hpcshard's files. Both packages are optional extras (the config names the one missing).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from hpcshard.config import TrainConfig
from hpcshard.rundir.spec import wandb_id
from hpcshard.sections import TrackerSection

log = logging.getLogger("hpcshard")


def scalars(values: dict[str, Any]) -> dict[str, float]:
    """The numbers of a step record, under the names both trackers show: train/loss,
    eval/loss, ...; a dict's under its key (split_s: train/split_s/forward, ...)."""
    out = {}
    for key, value in values.items():
        if isinstance(value, dict):
            out.update({f"train/{key}/{k.removeprefix('train/')}": v for k, v in scalars(value).items()})
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
            continue
        out["eval/loss" if key == "eval_loss" else f"train/{key}"] = float(value)
    return out


class Trackers:
    """The trackers a run asked for, on rank 0 (`Trackers.none()` elsewhere)."""

    def __init__(self, run_dir: Path, cfg: TrainConfig, *, resumed: int, logged: int,
                 created: float) -> None:
        self.run_dir, self.cfg = run_dir, cfg
        """`cfg`: the whole config, W&B's record of the run; what opens follows `settings`."""
        self.settings = TrackerSection.of(cfg)
        self.tb: Any = None
        self.wandb: Any = None
        self.logged = logged
        """The highest step a tracker already has from an earlier start (W&B skips up to it)."""
        if self.settings.tensorboard:
            self._open_tensorboard(resumed)
        if self.settings.wandb_project:
            self._open_wandb(created, resumed)

    @classmethod
    def none(cls) -> Trackers:
        self = cls.__new__(cls)
        self.tb = self.wandb = None
        self.logged = 0
        return self

    def _open_tensorboard(self, resumed: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        purge = resumed + 1 if resumed else None
        self.tb = SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=purge)

    def _open_wandb(self, created: float, resumed: int) -> None:
        import dataclasses

        import wandb

        run_id = wandb_id(self.run_dir, created)
        quiet = wandb.Settings(console="off", silent=True)
        mode: Any = self.settings.wandb_mode or None  # checked by TrainConfig: online | offline
        self.wandb = wandb.init(
            project=self.settings.wandb_project, entity=self.settings.wandb_entity or None, id=run_id,
            name=self.run_dir.name, resume="allow", dir=str(self.run_dir),
            mode=mode, config=dataclasses.asdict(self.cfg), settings=quiet)
        log.info("wandb: run %s (%s), resumed after step %d; steps up to %d already logged",
                 run_id, self.settings.wandb_mode or "mode from the environment", resumed, self.logged)

    def log(self, step: int, values: dict[str, Any]) -> None:
        numbers = scalars(values)
        if self.tb is not None:
            for key, value in numbers.items():
                self.tb.add_scalar(key, value, step)
            self.tb.flush()
        if self.wandb is not None and numbers and step > self.logged:
            self.wandb.log(numbers, step=step)

    def rewound(self, step: int) -> None:
        """Training went back to `step` (a rollback): TensorBoard drops what followed it."""
        if self.tb is not None:
            self.tb.close()
            self._open_tensorboard(step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
            self.tb = None
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None
