"""The checkpoint store on disk, without torch: layout, manifest, verification, retention.

    RUN_DIR/checkpoints/
        step-00000040/          committed: a DCP directory plus manifest.json
            .metadata  __0_0.distcp  __1_0.distcp  ...  manifest.json
        step-00000060.tmp/      being written, or left by a crash: never loaded
        latest                  the name of the newest committed checkpoint

A directory is a checkpoint only once rank 0 has written its manifest and renamed it from
`.tmp` into place, after every rank finished writing and every file DCP's `.metadata`
names was found with at least the bytes it says it wrote: whatever else happened to
`step-N.tmp` in between (a second job's start cleans every `*.tmp`) never commits. The
manifest records those files and their sizes; a checkpoint whose files no longer match it
is never loaded and never counts for retention. DCP's `.metadata` is a pickle, so a
checkpoint someone else can write is code someone else can run: the loader refuses
directories and files that another user owns or that are group- or world-writable (the
group of a run shared through the profile's `run_group` excepted).

    step-00000020.deleting.tmp/ retired, being deleted beside training (`hpcshard ckpt list`
                                shows one a deletion left behind; the next start removes it)
    step-00000010.corrupt/      failed to load while an older one loaded: kept for inspection
"""

from __future__ import annotations

import atexit
import json
import os
import pwd
import re
import shutil
import stat
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpcshard.errors import UserError
from hpcshard.rundir import paths
from hpcshard.rundir.files import TMP_SUFFIX, fsync_dir, write_atomic
from hpcshard.rundir.manifest import problem as shape_problem

CHECKPOINTS = paths.CHECKPOINTS
MANIFEST = "manifest.json"
METADATA = ".metadata"
"""DCP's index of a checkpoint (a pickle): every item, and the file, offset and length of
its bytes. Written last, by rank 0, once every rank's writes returned."""
LATEST = "latest"
FORMAT = 2
"""2: the manifest lists exactly the files `.metadata` names (and itself); 1 listed every
file found in `step-N.tmp` at the commit."""
DELETING = ".deleting" + TMP_SUFFIX
PROBE = "save-probe"
"""The write probe after a failed save (`runtime.checkpoint.guard.probe`), written beside
the checkpoints under a side name (`.save-probe.HOST.PID.RANDOM.tmp`) and removed at once;
one a killed rank left is removed by the next start."""
CORRUPT = ".corrupt"
RETIRE_WAIT_S = 10.0
"""How long a process that retired checkpoints waits at its exit for their deletion, at
least (the runtime waits as long as its slowest save took, if that is longer)."""


class Incomplete(Exception):
    """A save that must not be committed: a file DCP's `.metadata` names is missing or
    shorter than the bytes DCP wrote into it, or `.metadata` itself is missing."""


def step_name(step: int) -> str:
    return f"step-{step:08d}"


def parse_step(name: str) -> int | None:
    if not name.startswith("step-"):
        return None
    digits = name[5:].removesuffix(TMP_SUFFIX)
    return int(digits) if digits.isdigit() else None


@dataclass
class Checkpoint:
    """One entry of RUN_DIR/checkpoints, committed or not."""

    path: Path
    step: int
    manifest: dict[str, Any] = field(default_factory=dict)
    problem: str = ""
    """Why it cannot be loaded; empty when it is a valid committed checkpoint."""
    unreadable: bool = False
    """The file system failed to answer (not a missing file): the problem may be gone on
    the next look, and says nothing about the checkpoint."""

    @property
    def committed(self) -> bool:
        return not self.problem

    @property
    def bytes(self) -> int:
        return int(self.manifest.get("bytes", 0))


def unsafe_permissions(path: Path, trusted_gid: int | None = None) -> str:
    """A reason to refuse `path` (dir or file) if someone else wrote it or may write it:
    its owner is not this user, or others than its owner can write it. `trusted_gid`: the
    group the run is shared with (the profile's `run_group`), whose members' files and
    group-writable ones are accepted when they belong to that group."""
    st = path.lstat()
    trusted = trusted_gid is not None and st.st_gid == trusted_gid
    if st.st_uid != os.geteuid() and not trusted:
        return (f"{path} belongs to {_user(st.st_uid)}, not to you; a checkpoint is a pickle "
                "that runs code when loaded: load your own, or share the run with a group you "
                "trust (the profile's run_group)")
    mode = st.st_mode
    if mode & stat.S_IWOTH or (mode & stat.S_IWGRP and not trusted):
        who = "others" if mode & stat.S_IWOTH else "its group"
        return (f"{path} is writable by {who} (mode {stat.filemode(mode)}); a checkpoint is "
                f"a pickle that runs code when loaded: fix with `chmod go-w {path}`")
    return ""


def _user(uid: int) -> str:
    """`name (uid N)`, or `uid N` where the name is unknown here."""
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def file_sizes(path: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in sorted(path.iterdir())
            if p.is_file() and p.name != MANIFEST}


def sizes_by_name(path: Path, names: list[str] | set[str] | dict[str, int]) -> dict[str, int]:
    """The size of each named file in `path`; absent names are left out. Each file is
    looked up by its name, never found by listing `path`: on NFS a host's listing of a
    directory can lag behind files other hosts created (attribute caching, 30-60 s), while
    the lookup of a name this host never asked for goes to the server."""
    found = {}
    for name in sorted(names):
        try:
            found[name] = (path / name).stat().st_size
        except FileNotFoundError:
            continue
    return found


def written(tmp: Path, least: dict[str, int]) -> dict[str, int]:
    """The files of a save that `.metadata` names (`least`: each file and the fewest bytes
    it must have, as DCP's `.metadata` says), with their sizes; `Incomplete` when one is
    missing or short, or `.metadata` itself is missing."""
    least = {METADATA: 1, **least}
    found = sizes_by_name(tmp, least)
    wrong = [f"{name} is missing" if name not in found else
             f"{name} has {found[name]} of the {need} bytes DCP wrote"
             for name, need in sorted(least.items()) if found.get(name, -1) < need]
    if wrong:
        more = f" (and {len(wrong) - 3} more)" if len(wrong) > 3 else ""
        raise Incomplete(f"{'; '.join(wrong[:3])}{more} in {tmp}")
    return found


def inspect(path: Path) -> Checkpoint:
    """Read and verify one checkpoint directory against its manifest (sizes, not content).

    A file system error other than a missing file (ESTALE, EIO on NFS or Lustre) says
    nothing about the checkpoint: it is `unreadable`, never taken for damage."""
    step = parse_step(path.name)
    ckpt = Checkpoint(path=path, step=-1 if step is None else step)
    if path.name.endswith(TMP_SUFFIX):
        ckpt.problem = "incomplete (never committed: a save was interrupted)"
        return ckpt
    try:
        ckpt.problem = _check(ckpt, step)
    except OSError as err:
        ckpt.problem, ckpt.unreadable = f"unreadable ({err})", True
    return ckpt


def _check(ckpt: Checkpoint, step: int | None) -> str:
    """What is wrong with `ckpt` against its manifest ("" when nothing); fills its manifest
    once its shape is one hpcshard writes (`rundir.manifest`): a reader never gets another."""
    try:
        raw = json.loads((ckpt.path / MANIFEST).read_text())
    except FileNotFoundError:
        return "incomplete (no manifest)"
    except (json.JSONDecodeError, UnicodeDecodeError, IsADirectoryError, RecursionError) as err:
        return f"corrupt manifest ({err})"
    shape = shape_problem(raw)  # (one that parses but is not one hpcshard wrote)
    if shape:
        return f"corrupt manifest ({shape})"
    ckpt.manifest = raw
    if step is None:
        ckpt.step = int(ckpt.manifest["step"])
    expected: dict[str, int] = ckpt.manifest.get("files", {})
    found = sizes_by_name(ckpt.path, expected)
    missing = sorted(set(expected) - set(found))
    wrong = sorted(n for n in expected if n in found and found[n] != expected[n])
    if METADATA not in expected:
        return f"the manifest lists no {METADATA} (DCP's index): it cannot be loaded"
    if missing:
        return f"missing files: {', '.join(missing)}"
    if wrong:
        return "size differs from the manifest: " + ", ".join(
            f"{n} ({found[n]} != {expected[n]} bytes)" for n in wrong)
    if ckpt.manifest.get("step") != ckpt.step:
        return f"manifest says step {ckpt.manifest.get('step')}, directory says {ckpt.step}"
    return ""


def commit(tmp: Path, step: int, manifest: dict[str, Any], keep_last: int, keep_every: int = 0,
           *, least: dict[str, int]) -> tuple[Path, dict[str, Any], list[Path]]:
    """Rank 0, once every rank has written its shards into `tmp` (step-N.tmp): check that
    every file `least` names (what DCP's `.metadata` says was written: file -> fewest
    bytes, from `runtime.checkpoint.io.written_by_dcp`) is there, add the manifest, rename
    into place, fsync, move `latest`, retire old checkpoints. Returns the committed path,
    the full manifest and the retired paths. Raises `Incomplete` (nothing published, no
    older checkpoint touched) when a file is missing or short."""
    files = written(tmp, least)
    for f in (tmp, *tmp.iterdir()):  # shards (and the directory) may come from a loose umask
        f.chmod(f.stat().st_mode & ~0o022)
    manifest = {"format": FORMAT, "step": step, **manifest, "files": files,
                "bytes": sum(files.values()), "time": time.time()}
    write_atomic(tmp / MANIFEST, json.dumps(manifest, indent=1))
    final = tmp.parent / step_name(step)
    if final.exists():  # never replace a committed checkpoint in place
        raise FileExistsError(f"{final} already exists")
    os.replace(tmp, final)
    fsync_dir(tmp.parent)
    write_atomic(tmp.parent / LATEST, final.name + "\n")
    return final, manifest, retire(tmp.parent, keep_last, keep_every)


def scan(root: Path) -> list[Checkpoint]:
    """Every step-* entry under RUN_DIR/checkpoints, oldest first."""
    if not root.is_dir():
        return []
    entries = [inspect(p) for p in root.iterdir() if p.is_dir() and parse_step(p.name) is not None]
    return sorted(entries, key=lambda c: (c.step, c.path.name))


def with_newest(entries: list[Checkpoint], root: Path, newest: int) -> list[Checkpoint]:
    """`entries` (a listing), and the checkpoint of step `newest` when the listing lacks it:
    a directory another NFS client created can be missing from this one's listing for its
    attribute cache (acdirmin-acdirmax, 30-60 s), while a lookup of its exact name, never
    looked up here before, goes to the server."""
    if newest <= 0 or any(c.step == newest for c in entries):
        return entries
    path = root / step_name(newest)
    if not path.is_dir():
        return entries
    return sorted([*entries, inspect(path)], key=lambda c: (c.step, c.path.name))


def committed(root: Path) -> list[Checkpoint]:
    return [c for c in scan(root) if c.committed]


def check_safe(ckpt: Checkpoint, trusted_gid: int | None = None) -> None:
    """Refuse (ValueError) a checkpoint that someone else wrote or can write: its dirs and
    every file (`unsafe_permissions`; `trusted_gid`: the run's shared group, if any)."""
    for path in [ckpt.path.parent, ckpt.path, *sorted(ckpt.path.iterdir())]:
        reason = unsafe_permissions(path, trusted_gid)
        if reason:
            raise UserError(f"refusing checkpoint {ckpt.path}: {reason}")


def select(root: Path, resume: str, exclude: frozenset[Path] = frozenset(), newest: int = 0,
           ) -> tuple[Checkpoint | None, list[Checkpoint]]:
    """The checkpoint `resume` asks for, and the ones skipped on the way (newest first).

    auto: the newest valid committed checkpoint (None when there is none);
    never: None; STEP: that committed step; PATH: that checkpoint directory. `newest`: a
    step known committed (by the host that made it), looked up by name when this host's
    listing does not show it (`with_newest`).
    `Unreadable` when the file system fails to answer about one it would take or skip:
    a checkpoint is never skipped (and later quarantined) for an ESTALE.
    """
    if resume == "never":
        return None, []
    if resume.isdigit():
        entries = scan(root)
        match = [c for c in entries if c.committed and c.step == int(resume)]
        if not match:
            for c in entries:
                readable(c)
            steps = ", ".join(str(c.step) for c in entries if c.committed) or "none"
            raise UserError(f"resume={resume}: no committed checkpoint at step {resume} in "
                            f"{root}; committed steps: {steps}")
        return match[0], []
    if resume != "auto":
        ckpt = readable(inspect(Path(resume)))
        if not ckpt.committed:
            raise UserError(f"resume={resume!r} is not a usable checkpoint: {ckpt.problem}; "
                            "give a step-N directory with a manifest, a step number, auto or never")
        return ckpt, []
    skipped: list[Checkpoint] = []
    for ckpt in reversed(with_newest(scan(root), root, newest)):
        if ckpt.path in exclude:
            continue
        if readable(ckpt).committed:
            return ckpt, skipped
        skipped.append(ckpt)
    return None, skipped


class Unreadable(OSError):
    """The file system failed to answer about a checkpoint (ESTALE, EIO): it is neither
    loaded nor skipped; a later look (a retry, the restarted ranks) decides."""


def readable(ckpt: Checkpoint) -> Checkpoint:
    """`ckpt`, or `Unreadable` when the file system failed to answer about it."""
    if ckpt.unreadable:
        raise Unreadable(f"checkpoint {ckpt.path} is {ckpt.problem}")
    return ckpt


def clean_incomplete(root: Path) -> list[str]:
    """Remove what interrupted saves and deletions left (`*.tmp`); returns their names. A
    write probe a killed rank left (`PROBE`) goes too, unnamed: it is no checkpoint."""
    if not root.is_dir():
        return []
    entries = list(root.iterdir())
    stale = sorted(p for p in entries if p.is_dir() and p.name.endswith(TMP_SUFFIX))
    for p in stale:
        shutil.rmtree(p, ignore_errors=True)
    for p in entries:
        if p.name.startswith(f".{PROBE}.") and p.name.endswith(TMP_SUFFIX):
            p.unlink(missing_ok=True)
    return [p.name for p in stale]


def supersede(root: Path, after_step: int) -> list[str]:
    """Move committed checkpoints newer than `after_step` into `superseded-TIME/`.

    Resuming an older step starts a new timeline: its saves would collide with the old
    timeline's names, and a later `auto` resume would jump back onto the old timeline.
    They are moved aside, not deleted: they are still the user's data.
    """
    newer = [c for c in committed(root) if c.step > after_step]
    if not newer:
        return []
    aside = root / f"superseded-{time.strftime('%Y%m%d-%H%M%S')}"
    aside.mkdir(mode=0o750, exist_ok=True)
    for c in newer:
        os.replace(c.path, aside / c.path.name)
    fsync_dir(root)
    return [c.path.name for c in newer]


def retire(root: Path, keep_last: int, keep_every: int = 0) -> list[Path]:
    """Delete committed checkpoints beyond the newest `keep_last` (keeping multiples of
    `keep_every`). Only checkpoints that pass `inspect` count, and the newest of them
    always stays: a checkpoint whose files went missing after its commit never makes an
    older, loadable one go."""
    keep_last = max(1, keep_last)
    valid = committed(root)
    doomed = [c for c in valid[:-keep_last]
              if not (keep_every and c.step % keep_every == 0)]
    trash = []
    for c in doomed:
        # Rename first: a crash mid-delete leaves a .tmp the loader ignores (and the next
        # start removes), never a half-deleted directory that still looks committed.
        trash.append(c.path.with_name(c.path.name + DELETING))
        os.replace(c.path, trash[-1])
    # Deleting hundreds of MB is not part of the save: it runs beside training.
    if trash:
        thread = threading.Thread(target=_delete, args=(trash,), name="hpcshard-retire", daemon=True)
        if not _RETIRING:  # a script's interpreter exit; the runtime leaves by os._exit
            atexit.register(wait_retired, RETIRE_WAIT_S)
        _RETIRING.append((thread, trash))
        thread.start()
    return [c.path for c in doomed]


_RETIRING: list[tuple[threading.Thread, list[Path]]] = []
"""This process's deleting threads and what each deletes."""


def _delete(paths: list[Path]) -> None:
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)


def wait_retired(timeout: float) -> list[Path]:
    """Wait up to `timeout` seconds for this process's retired checkpoints to be deleted;
    returns those still there. A process must call this before it leaves by `os._exit`
    (a rank does) or ends its interpreter (an `atexit` hook does): either kills a daemon
    thread mid-deletion, and nothing would ever remove what it left. What is still there
    after the bound is `step-N.deleting.tmp`: never loaded, removed by the next start,
    shown by `hpcshard ckpt list`."""
    deadline = time.monotonic() + timeout
    for thread, _ in _RETIRING:
        thread.join(max(0.0, deadline - time.monotonic()))
    _RETIRING[:] = [(t, paths) for t, paths in _RETIRING if t.is_alive()]
    return [p for _, paths in _RETIRING for p in paths if p.exists()]


def leftovers(root: Path) -> list[Checkpoint]:
    """What `scan` leaves out, for `hpcshard ckpt list`: retired checkpoints still being
    deleted, or left for good by a deletion cut short (`step-N.deleting.tmp`), and
    quarantined ones (`step-N.corrupt`). Oldest first."""
    if not root.is_dir():
        return []
    why = {DELETING: "retired, not yet deleted (a deletion cut short leaves it; the next "
                     "start removes it)",
           CORRUPT: "quarantined: failed to load while an older checkpoint loaded; kept for "
                    "inspection (delete it when done)"}
    found = []
    for p in root.iterdir():
        kind = next((k for k in why if p.name.endswith(k)), None)
        step = parse_step(p.name.removesuffix(kind)) if kind else None
        if kind and step is not None and p.is_dir():
            found.append(Checkpoint(path=p, step=step, problem=why[kind]))
    return sorted(found, key=lambda c: (c.step, c.path.name))


# -- a script's own checkpoints, found by their names ----------------------------------

INCOMPLETE = "checkpoint-is-incomplete.txt"
"""Hugging Face's marker of a checkpoint that is still being written."""
_STEP = re.compile(r"(?:^|[^a-z])(?:step|checkpoint|ckpt|iter|global_step)[-_=]?0*(\d+)", re.I)


def last_save(run_dir: Path) -> dict[str, Any]:
    """The script's newest save in HPCSHARD_CHECKPOINT_DIR, for the ledger: its step (from
    the name: hpcshard's step-N, Hugging Face's checkpoint-N, Lightning's step=N, ...),
    and how long before now it was written (the training a hard stop lost)."""
    root = run_dir / CHECKPOINTS
    found: list[tuple[int, float, str]] = []
    if root.is_dir():
        for entry in root.iterdir():
            m = _STEP.search(entry.name)
            # .tmp: hpcshard's uncommitted saves; the marker: Hugging Face's, cut short
            if m and not entry.name.endswith(TMP_SUFFIX) and not (entry / INCOMPLETE).exists():
                found.append((int(m.group(1)), entry.stat().st_mtime, entry.name))
    if not found:
        return {"saved_step": None, "saved": None}
    step, mtime, name = max(found)
    return {"saved_step": step, "saved": name, "lost_seconds": round(time.time() - mtime, 1)}


def age(seconds_since_epoch: float) -> str:
    s = max(0, int(time.time() - seconds_since_epoch))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size:
            return f"{s // size}{unit}"
    return f"{s}s"
