"""What a failed save says about the run's storage, and whether this job still owns the run.

A save that fails because the storage is full, over its quota or read-only fails again at
every later save until someone frees space or fixes the mount: training on loses every step
since the newest checkpoint at the next fault, so by default the run stops there
(`on_storage_full`). Any other failure costs one save; the next one tries again.

A job commits and cleans checkpoints only while it owns the run (`rundir.lease`): a job that
was taken over (a guard's take-over, a `resume` that found this job over, a node thawed
after the run went on without it) would otherwise commit into, or clean, the new owner's
store. Rank 0 asks the lease right before it acts; the ranks then stop together, without
an end record: the run is someone else's now.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from hpcshard.rundir import lease
from hpcshard.rundir.files import STORAGE_ERRNOS
from hpcshard.runtime.checkpoint.failures import causes

STORAGE_WORDS = {errno.ENOSPC: "no space left on the device holding {}",
                 errno.EDQUOT: "{} is over its disk quota",
                 errno.EROFS: "the device holding {} is read-only"}
"""What each of files.STORAGE_ERRNOS says of a save."""


class Disowned(Exception):
    """This job no longer owns its run directory: it stops without committing or cleaning
    anything (every rank raises it together)."""


def storage_trouble(err: BaseException, root: Path, need: int) -> str:
    """What is wrong with the storage of `root` after a save that failed with `err` and
    needed about `need` bytes; "" when nothing is (the save failed for another reason).

    DCP gathers every rank's exception; a write into a full file system often comes back
    not as ENOSPC but as torch.save's "unexpected pos N vs M", so the room left (with the
    failed save removed) is compared with `need` too."""
    found = [c.errno for c in causes(err) if isinstance(c, OSError) and c.errno in STORAGE_ERRNOS]
    existing = next(p for p in (root, *root.parents) if os.path.exists(p))  # (no raise: ESTALE)
    try:
        fs = os.statvfs(existing)
    except OSError:
        return STORAGE_WORDS[found[0]].format(root) if found else ""
    free = fs.f_bavail * fs.f_frsize
    if not found and fs.f_flag & os.ST_RDONLY:
        found = [errno.EROFS]
    if not found and free < need:
        found = [errno.ENOSPC]
    if not found:
        return ""
    return (f"{STORAGE_WORDS[found[0]].format(root)} ({free / 1e6:.1f} MB free, the next "
            f"checkpoint needs about {need / 1e6:.1f} MB)")


def disowned(run_dir: Path, token: str, doing: str) -> str:
    """"" while the owner with `token` still owns `run_dir`; else the line the ranks stop
    with (`doing`: what they would have done). The lease is read afresh (another host's
    take-over is a rename, which NFS shows at once); OSError when it cannot be read."""
    if lease.owns(run_dir, token):
        return ""
    try:
        now = lease.read(run_dir)
        who = (now.what or now.name) if now is not None else "nobody"
    except lease.Busy as err:  # a lease that does not parse is nobody's to act on either
        who = f"an owner it cannot read: {err}"
    return f"this job no longer owns {run_dir} (now: {who}); it stops without {doing}"
