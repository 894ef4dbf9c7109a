"""What a failed save says about the run's storage, and whether this job still owns the run.

A save that fails because the storage is full, over its quota or read-only fails again at
every later save until someone frees space or fixes the mount: training on loses every step
since the newest checkpoint at the next fault, so by default the run stops there
(`on_storage_full`). A failed save is the storage's unless shown otherwise: DCP's writer
reports a write the storage refused as torch.save's "unexpected pos N vs M", with no errno,
and under a user or project quota, or with one full Lustre OST, `statvfs` shows plenty of
room. So a save that fails without naming full storage is followed by a small write probe
in the checkpoint directory (`probe`), whose error names the cause (EDQUOT, ENOSPC, EIO...).
Any other failure costs one save; the next one tries again, and a few in a row stop the
run by the same rule (`manager.SAVE_FAILURES_STOP`, counted across restarts and requeues):
whatever they failed with, the storage takes no checkpoint.

A job commits and cleans checkpoints only while it owns the run (`rundir.lease`): a job that
was taken over (a guard's take-over, a `resume` that found this job over, a node thawed
after the run went on without it) would otherwise commit into, or clean, the new owner's
store. Rank 0 asks the lease right before it acts; the ranks then stop together, without
an end record: the run is someone else's now.
"""

from __future__ import annotations

import contextlib
import errno
import os
from dataclasses import dataclass
from pathlib import Path

from hpcshard.rundir import lease, store
from hpcshard.rundir.files import STORAGE_ERRNOS, side_name
from hpcshard.runtime.checkpoint.failures import causes
from hpcshard.runtime.checkpoint.io import one_line, private_dir

STORAGE_WORDS = {errno.ENOSPC: "no space left on the device holding {}",
                 errno.EDQUOT: "{} is over its disk quota",
                 errno.EROFS: "the device holding {} is read-only"}
"""What each of files.STORAGE_ERRNOS says of a save."""


class Disowned(Exception):
    """This job no longer owns its run directory: it stops without committing or cleaning
    anything (every rank raises it together)."""


PROBE_BYTES = 1 << 20
"""What the write probe writes: 1 MiB, random (a compressing or deduplicating file system
stores zeros for nothing). More than the room a quota leaves once a save has filled it,
little to write beside training."""


@dataclass(frozen=True)
class Probe:
    """The write probe after a failed save: whether it ran, and the error it got (None: the
    storage took its write)."""

    ran: bool = False
    error: OSError | None = None

    def words(self, root: Path) -> str:
        """What it found, for the failure's line ("" when it did not run)."""
        return f"a write probe in {root} {self.result}" if self.ran else ""

    @property
    def result(self) -> str:
        """"succeeded", or "got ERRNO: what it says"."""
        if self.error is None:
            return "succeeded"
        code = errno.errorcode.get(self.error.errno or 0, "no errno")
        return f"got {code}: {self.error.strerror or self.error}"

    @property
    def brief(self) -> str:
        """For the ledger (`events.SaveFailed.probe`): "" (not run), "ok" or "ERRNO: ..."."""
        if not self.ran:
            return ""
        return "ok" if self.error is None else self.result.removeprefix("got ")


def full_errno(err: BaseException) -> int | None:
    """The errno of full, over-quota or read-only storage that some rank's failure names."""
    return next((c.errno for c in causes(err) if isinstance(c, OSError) and c.errno in STORAGE_ERRNOS),
                None)


def probe(root: Path, err: BaseException) -> Probe:
    """After a save that failed with `err` and before the failed save is removed (under a
    quota its bytes are what fills it: the room they leave would take the probe): unless
    `err` already names full storage, write, fsync (NFS and Lustre report a quota at the
    flush, not at the write) and remove PROBE_BYTES in `root`. `root` is made first, as a
    save makes it (the save may have failed before): a probe a killed rank left is then
    where the next start removes it (`store.clean_incomplete`), and a refused mkdir is
    the probe's answer. An OSError is what it found; anything else raises."""
    if full_errno(err) is not None:
        return Probe()
    path = side_name(root / store.PROBE)
    try:
        private_dir(root)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            _write_all(fd, os.urandom(PROBE_BYTES))
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as refused:
        return Probe(ran=True, error=refused)
    finally:
        with contextlib.suppress(OSError):
            path.unlink()
    return Probe(ran=True)


def _write_all(fd: int, data: bytes) -> None:
    """os.write until `data` is written: a write cut short at a quota's or a device's edge
    returns what it wrote; the next one fails with the errno."""
    view = memoryview(data)
    while view:
        wrote = os.write(fd, view)
        if not wrote:
            raise OSError(errno.ENOSPC, "No space left on device (a write of nothing)")
        view = view[wrote:]


def storage_trouble(err: BaseException, root: Path, need: int, probed: Probe | None = None) -> str:
    """What is wrong with the storage of `root` after a save that failed with `err` and
    needed about `need` bytes; "" when nothing is (the save failed for another reason).

    DCP gathers every rank's exception; a write into a full file system often comes back
    not as ENOSPC but as torch.save's "unexpected pos N vs M": then the write probe's error
    (`probed`) says it, or the room left (with the failed save removed) is compared with
    `need` (a quota is not seen there, nor one full OST)."""
    found = full_errno(err)
    said = []
    if found is None and probed is not None and probed.error is not None \
            and probed.error.errno in STORAGE_ERRNOS:
        found = probed.error.errno
        said.append(probed.words(root))
    existing = next(p for p in (root, *root.parents) if os.path.exists(p))  # (no raise: ESTALE)
    with contextlib.suppress(OSError):
        fs = os.statvfs(existing)
        free = fs.f_bavail * fs.f_frsize
        if found is None and fs.f_flag & os.ST_RDONLY:
            found = errno.EROFS
        if found is None and free < need:
            found = errno.ENOSPC
        said.append(f"{free / 1e6:.1f} MB free, the next checkpoint needs about {need / 1e6:.1f} MB")
    if found is None:
        return ""
    return STORAGE_WORDS[found].format(root) + (f" ({'; '.join(said)})" if said else "")


FREE = "free space (or fix the mount)"
"""What a user does before `hpcshard resume` when the storage said why it took no save."""
FIND = "find and fix the cause"
"""...and when it did not (`in_a_row`)."""


def in_a_row(failed: int, err: BaseException, root: Path, probed: Probe) -> str:
    """The storage rule's line for `failed` saves in a row that failed, the last with `err`,
    none naming full storage: the last error, what the probe found, the path (once)."""
    said = {"": "", "ok": "; a write probe beside them wrote fine"}.get(
        probed.brief, f"; a write probe beside them {probed.result}")
    unknown = (" for a reason not known (a quota on one OST, a failing server, or the job's state "
               "not saving)") if probed.brief == "ok" else ""
    return (f"the saves failed {failed} times in a row, the last with {one_line(err)}{said}, so the "
            f"checkpoint directory {root} takes no checkpoint{unknown}")


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
