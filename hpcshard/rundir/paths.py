"""Every path in a run directory, in one place: what the CLI, the launchers and the ranks
write and read there (the run directory's contract, file by file, is in
docs/contributors/architecture.md). submitit's own files under `submitit/` are named by
submitit's `JobPaths` (`launch.slurm`, `cli.doctor`), not here."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

SPEC = "spec.json"
LEDGER = "attempts.jsonl"
METRICS = "metrics.jsonl"
CHECKPOINTS = "checkpoints"
LAUNCH = "launch"
LOGS = "logs"
SUBMITIT = "submitit"
CODE = "code"
PROFILES = "profiles"
CHAIN = "chain.json"


@dataclass(frozen=True)
class RunPaths:
    """The paths of the run directory `root`."""

    root: Path

    @property
    def spec(self) -> Path:
        """The run's request (`rundir.spec`)."""
        return self.root / SPEC

    @property
    def ledger(self) -> Path:
        """The attempts ledger (`rundir.ledger`)."""
        return self.root / LEDGER

    @property
    def metrics(self) -> Path:
        """Rank 0's metrics, one JSON record a line (`rundir.metrics`)."""
        return self.root / METRICS

    @property
    def checkpoints(self) -> Path:
        """The checkpoint store (`rundir.store`)."""
        return self.root / CHECKPOINTS

    @property
    def launch(self) -> Path:
        """The launchers' files (`rundir.launchers`)."""
        return self.root / LAUNCH

    @property
    def logs(self) -> Path:
        return self.root / LOGS

    @property
    def submitit(self) -> Path:
        """submitit's folder: its pickles, submission scripts, and logs where a site's
        template leaves them there."""
        return self.root / SUBMITIT

    @property
    def code(self) -> Path:
        """The copies of the code the run runs, one folder per digest (`cli.snapshot`)."""
        return self.root / CODE

    @property
    def profiles(self) -> Path:
        """Profiler traces and memory snapshots, and the asks for them (`rundir.profiles`)."""
        return self.root / PROFILES

    @property
    def then(self) -> Path:
        """The scripts and logs of the `--then` jobs (`launch.then`)."""
        return self.root / "then"

    def rank_log(self, rank: int) -> Path:
        """One rank's log, every attempt and cycle appended."""
        return self.logs / f"rank-{rank}.log"

    def flight(self, attempt: int, cycle: int) -> Path:
        """The flight records the ranks of one cycle wrote (`rundir.flight`)."""
        return self.logs / "flight" / f"a{attempt}-c{cycle}"

    def slurm_log(self, job: str, stream: str = "err") -> Path:
        """A job's batch output as the default template names it (`%j`: the job id)."""
        return self.logs / f"slurm-{job}.{stream}"
