"""`hpcshard doctor`: check a site and a profile before anyone wastes an allocation.

Each check is one row: what was checked, pass/FAIL (or skip, when an earlier failure makes
it meaningless), what was found, and for a failure the fix. Checks that need the compute
nodes submit a tiny probe job (one node, a minute) with the profile's partition, account
and QOS: it writes into the storage root, loads the profile's modules, looks for the
container runtime and asks Slurm to requeue it; the login node then reads what it wrote.
`--smoke` runs a multi-node all-reduce through the same path a training job takes.
"""

from __future__ import annotations

import contextlib
import json
import shlex
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import click

from hpcshard import site
from hpcshard.cli.common import FiniteFloat, table
from hpcshard.rundir.paths import RunPaths
from hpcshard.rundir.spec import probe_writable
from hpcshard.slurm import cluster, states
from hpcshard.slurm.cluster import Partition
from hpcshard.slurm.sbatch import SbatchRequest, render
from hpcshard.slurm.submit import job_paths
from hpcshard.slurm.time import hms, parse_time

SLURM_COMMANDS = ("sbatch", "squeue", "scontrol", "sinfo")


@dataclass
class Check:
    name: str
    status: str
    """pass, FAIL or skip."""
    detail: str
    fix: str = ""


class Doctor:
    def __init__(self, res: site.Resolved, wait: float, min_free_gb: float) -> None:
        self.res, self.v = res, res.values
        self.wait, self.min_free_gb = wait, min_free_gb
        self.checks: list[Check] = []
        self.partition: Partition | None = None
        self.probe_dir: Path | None = None
        self.keep = False
        """Keep the probe's directory: its logs explain a failure."""

    # -- bookkeeping --------------------------------------------------------------------
    def add(self, name: str, ok: bool, detail: str, fix: str = "") -> bool:
        self.checks.append(Check(name, "pass" if ok else "FAIL", detail, "" if ok else fix))
        return ok

    def skip(self, name: str, why: str) -> None:
        self.checks.append(Check(name, "skip", why))

    def where(self, key: str) -> str:
        """Where to change a setting: the file (and section) it came from."""
        source = self.res.source(key)
        if source == "built-in":
            profile = f"[profiles.{self.res.profile}]" if self.res.profile else "[defaults]"
            return f"set {key} in {profile} of the site file"
        return f"set {key} in {source}" if source != "command line" else f"change --{key.replace('_', '-')}"

    # -- the checks -----------------------------------------------------------------------
    def run(self, smoke: bool) -> list[Check]:
        template_ok = self.template()
        slurm_ok = self.slurm_commands() and self.controller()
        storage_ok = self.storage()
        if slurm_ok:
            part_ok = self.partition_checks()
            self.pyxis()
            why = ("needs the partition checks to pass" if not part_ok else
                   "needs a usable storage root")
            if not template_ok:
                why = "needs a template that renders"
            if part_ok and storage_ok and template_ok:
                self.probe()
            else:
                for name in self.probe_checks():
                    self.skip(name, why)
            if smoke:
                if part_ok and storage_ok and template_ok:
                    self.smoke()
                else:
                    self.skip("all-reduce", why)
        else:
            for name in ("partition", "gpus per node", "time limit", *self.probe_checks()):
                self.skip(name, "needs Slurm")
        return self.checks

    def probe_checks(self) -> list[str]:
        """What the probe job finds out."""
        names = ["storage from compute", "modules", "requeue"]
        if self.v["container"].get("runtime"):
            names.append("container (compute)")
        return names

    def template(self) -> bool:
        req = self.request("hpcshard-doctor", 1, Path("/doctor/run"))
        try:
            render(req, "python -u -m submitit.core._submit /doctor/run/submitit",
                   Path("/doctor/run/submitit"), site.SETTINGS)
        except ValueError as err:
            return self.add("template", False, str(err), "fix the template, or " + self.where("template"))
        return self.add("template", True, f"{req.template} renders ({len(req.template_dirs)} site "
                 "template director" + ("y" if len(req.template_dirs) == 1 else "ies") + ")")

    def slurm_commands(self) -> bool:
        missing = [c for c in SLURM_COMMANDS if not shutil.which(c)]
        return self.add("slurm commands", not missing,
                        f"not on PATH: {', '.join(missing)}" if missing else ", ".join(SLURM_COMMANDS),
                        "install Slurm's client commands (Debian: slurm-client) or run doctor on a "
                        "login node; without Slurm, set backend = 'local'")

    def controller(self) -> bool:
        ok, said = cluster.ping(timeout=20)
        return self.add("controller", ok, said,
                        "start slurmctld, or point SLURM_CONF at the cluster's slurm.conf")

    def partition_checks(self) -> bool:
        try:
            parts = cluster.partitions()
        except ValueError as err:
            return self.add("partition", False, str(err), "check that sinfo works here")
        name = self.v["partition"] or next((p.name for p in parts.values() if p.default), "")
        if name not in parts:
            self.add("partition", False, f"{name!r} does not exist",
                     self.where("partition") + f" to one of: {', '.join(sorted(parts))}")
            self.skip("gpus per node", "needs a valid partition")
            self.skip("time limit", "needs a valid partition")
            return False
        part = parts[name]
        self.partition = part
        shown = name if self.v["partition"] else f"{name} (the cluster's default)"
        self.add("partition", True, f"{shown}: {part.nodes} node(s)")
        want = self.v["gpus_per_node"]
        gpus_ok = self.add("gpus per node", want <= part.gpus_per_node,
                           f"profile asks {want}, {name} nodes have {part.gpus_per_node}",
                           self.where("gpus_per_node") + f" to {part.gpus_per_node} or fewer")
        cap = parse_time(self.v["max_time"]) if self.v["max_time"] else 0
        longest = max(parse_time(self.v["time"]), cap)
        if part.max_time_s is None:
            self.add("time limit", True, f"{name} has no MaxTime")
        else:
            self.add("time limit", longest <= part.max_time_s,
                     f"profile allows {hms(longest)}, {name} MaxTime is {hms(part.max_time_s)}",
                     self.where("max_time" if self.v["max_time"] else "time")
                     + f" to {hms(part.max_time_s)} or less")
        return gpus_ok

    def pyxis(self) -> None:
        runtime = self.v["container"].get("runtime", "")
        if runtime != "pyxis":
            return
        proc = subprocess.run(["srun", "--help"], capture_output=True, text=True)
        self.add("container runtime", "--container-image" in proc.stdout + proc.stderr,
                 "srun " + ("has" if "--container-image" in proc.stdout else "lacks")
                 + " --container-image (the pyxis plugin)",
                 "install pyxis and enroot on the cluster, or remove [container] from the profile")

    def storage(self) -> bool:
        root = site.storage_root(self.res).resolve()
        fix_where = self.where("storage_root")
        if not root.is_dir():
            return self.add("storage root", False, f"{root} does not exist",
                            f"create it (mkdir -p {shlex.quote(str(root))}) or {fix_where}")
        try:
            probe_writable(root)
        except ValueError:
            return self.add("storage root", False, f"{root} is not writable",
                            f"make it writable for this user or {fix_where}")
        free = shutil.disk_usage(root).free / 2**30
        if free < self.min_free_gb:
            return self.add("storage root", False, f"{root}: {free:.1f} GiB free",
                            f"free space (checkpoints need at least {self.min_free_gb:g} GiB) or "
                            f"{fix_where}")
        return self.add("storage root", True, f"{root}: writable, {free:.0f} GiB free")

    def probe(self) -> None:
        """One tiny job rendered from the profile's own template (directives, environment,
        container, launch): its job step writes into the storage root, sees whether it runs
        in the container, and asks Slurm to requeue it from where a launcher would."""
        root = site.storage_root(self.res).resolve()
        probe = root / f".hpcshard-doctor-{uuid.uuid4().hex[:8]}"
        RunPaths(probe).logs.mkdir(parents=True)
        self.probe_dir = probe
        requeue, chain = (self.v["requeue_policy"] == p for p in ("requeue", "chain"))
        d = shlex.quote(str(probe))
        lines = ["#!/bin/bash", f"d={d}",
                 'if [ -e "$d/first" ]; then hostname > "$d/restarted"; exit 0; fi',
                 'stat -c %d:%i / > "$d/root.step"',
                 'hostname > "$d/host.tmp" && mv "$d/host.tmp" "$d/first"']
        if requeue:
            lines += ['scontrol requeue "$SLURM_JOB_ID" > "$d/requeue.log" 2>&1; '
                      'echo $? > "$d/requeue.rc"', "sleep 120"]
        if chain:  # what a continuation (and a guard) needs: sbatch from a compute node
            lines += ['j=$(sbatch --parsable --hold -o /dev/null --wrap true 2> "$d/chain.log"); '
                      'rc=$?; [ -n "$j" ] && scancel "$j"; echo $rc > "$d/chain.rc"']
        script = probe / "probe.sh"
        script.write_text("\n".join(lines) + "\n")
        req = self.request("hpcshard-doctor", 1, probe)
        req.time, req.signal_lead_s, req.requeue = "5", 60, requeue
        # The batch shell records its root (the step compares: a container has another one)
        # and whether the modules load: again in a subshell, after the template's own load,
        # so the output is the probe's while the job keeps what the template loaded.
        check = [f"stat -c %d:%i / > {d}/root.batch"]
        if req.modules:
            mods = " ".join(shlex.quote(m) for m in req.modules)
            check.append(f"(module load {mods}) > {d}/modules.log 2>&1; echo $? > {d}/modules.rc")
        req.setup = [*check, *req.setup]
        batch = probe / "probe.sbatch"
        batch.write_text(render(req, f"bash {shlex.quote(str(script))}", probe))
        try:
            job = cluster.sbatch(str(batch))
        except ValueError as err:
            self.add("storage from compute", False, f"the probe job: {err}",
                     "check partition, account and qos with your admins")
            return
        # Slurm may kill the step before it records scontrol's answer: a restart also says yes.
        wants = ("requeue.rc", "restarted") if requeue else ("chain.rc",) if chain else ("first",)
        state = self._wait_for(job, lambda: any((probe / w).exists() for w in wants))
        _cancel(job)
        if not (probe / "first").exists():
            self._probe_failed(job, state, probe)
            return
        host = (probe / "first").read_text().strip()
        self.add("storage from compute", True, f"probe job {job} on {host} wrote {root}")
        self._module_result(probe)
        runtime = self.v["container"].get("runtime", "")
        if runtime:
            roots = [(probe / f).read_text().strip() if (probe / f).exists() else "?"
                     for f in ("root.batch", "root.step")]
            inside = "?" not in roots and roots[0] != roots[1]
            self.add("container (compute)", inside, f"{runtime}: the job step ran "
                     + ("in the image (its own root file system)" if inside else
                        "on the host's root file system"),
                     "the launch line does not use the container: keep \"${HPCSHARD_SRUN_ARGS[@]}\" "
                     "\"${HPCSHARD_WRAP[@]}\" in the template's launch block")
        if requeue:
            rc = 0 if (probe / "restarted").exists() else _rc(probe / "requeue.rc")
            said = (probe / "requeue.log").read_text().strip() if (probe / "requeue.log").exists() else ""
            where = " inside the container" if runtime else ""
            self.add("requeue", rc == 0, f"scontrol requeue{where} accepted" if rc == 0 else
                     f"scontrol requeue{where} failed: {said.splitlines()[-1] if said else 'no answer'}",
                     ("make Slurm's client commands and munge socket visible in the image, or "
                      if runtime else "") + self.where("requeue_policy")
                     + " to 'chain' (a continuation job per stop)")
        elif chain:
            rc = _rc(probe / "chain.rc")
            said = (probe / "chain.log").read_text().strip() if (probe / "chain.log").exists() else ""
            self.add("requeue", rc == 0, "chain: sbatch from a compute node accepted (a held job, "
                     "cancelled)" if rc == 0 else f"chain: sbatch from a compute node failed: "
                     f"{said.splitlines()[-1] if said else 'no answer'}",
                     self.where("requeue_policy") + " to 'requeue' (scontrol requeue of the job)")
        else:
            self.skip("requeue", f"requeue_policy is {self.v['requeue_policy']}")

    def _probe_failed(self, job: str, state: str, probe: Path) -> None:
        if not states.parse(state).over:
            self.add("storage from compute", False, f"probe job {job} did not run within "
                     f"{self.wait:.0f} s ({state})", "rerun with a longer --wait, or a partition "
                     "with idle nodes")
            return
        logs = [job_paths(probe, job).stderr, RunPaths(probe).slurm_log(job)]
        said = [line for log in logs if log.exists() for line in log.read_text().splitlines()
                if line.strip()]
        if said:  # the logs are here, so the storage is shared: the step itself failed
            self.add("storage from compute", False, f"probe job {job} ended {state}: {said[-1]}",
                     f"read {probe}/*.err (kept); check the template's container and launch blocks")
            self.keep = True
            return
        self.add("storage from compute", False, f"probe job {job} ended {state} but nothing it "
                 f"wrote is in {probe}", self.where("storage_root")
                 + " to a file system that the compute nodes and this node share")

    def _module_result(self, probe: Path) -> None:
        if not self.v["modules"]:
            self.skip("modules", "the profile loads none")
            return
        rc = _rc(probe / "modules.rc")
        log = (probe / "modules.log").read_text().strip() if (probe / "modules.log").exists() else ""
        self.add("modules", rc == 0, f"module load {' '.join(self.v['modules'])}: "
                 + ("ok" if rc == 0 else (log.splitlines() or ['exit ' + str(rc)])[-1]),
                 "fix the module names (module avail), or " + self.where("modules"))

    def _wait_for(self, job: str, done: Callable[[], bool], extra: float = 0) -> str:
        """The probe's files are looked for every 0.5 s; Slurm is asked one scontrol a poll,
        1 s apart, doubling while the job's state stays the same up to the profile's poll_s."""
        from hpcshard.slurm.poll import Backoff

        deadline = time.monotonic() + self.wait + extra
        state = states.JobState.PENDING.value
        backoff, due = Backoff(1.0, max(1.0, self.v["poll_s"])), 0.0
        while not done() and time.monotonic() < deadline:
            if time.monotonic() >= due:
                info = cluster.job_state(job) or cluster.JobInfo.forgotten(job)
                if info.state.over:
                    time.sleep(1)  # files written just before the end may land a moment later
                    return info.state_text
                said = f"{info.state_text}, reason {info.reason or '?'}" if info.state.pending \
                    else info.state_text
                due = time.monotonic() + backoff.next(said != state)
                state = said
            time.sleep(0.5)
        return state

    def smoke(self) -> None:
        from hpcshard.launch.smoke import node_main
        from hpcshard.slurm.submit import submit

        part = self.partition
        nodes = min(2, part.nodes if part else 1)
        gpus = self.v["gpus_per_node"]
        root = site.storage_root(self.res).resolve()
        run_dir = (self.probe_dir or root / f".hpcshard-doctor-{uuid.uuid4().hex[:8]}") / "smoke"
        RunPaths(run_dir).logs.mkdir(parents=True)
        req = self.request("hpcshard-doctor-smoke", nodes, run_dir)
        req.time, req.signal_lead_s, req.requeue = "10", 60, False
        try:
            job = submit(req, run_dir, node_main, str(run_dir), gpus)
        except ValueError as err:
            self.add("all-reduce", False, str(err), "check the profile's partition and template")
            return
        result = run_dir / "smoke.json"
        state = self._wait_for(job, result.exists, extra=300)
        if not result.exists():
            _cancel(job)
            log = job_paths(RunPaths(run_dir).submitit, job).stderr
            tail = log.read_text().strip().splitlines()[-1:] if log.exists() else []
            self.add("all-reduce", False, f"job {job} ({state}) wrote no result"
                     + (f": {tail[0]}" if tail else ""), f"read {log}")
            return
        out = json.loads(result.read_text())
        self.add("all-reduce", out["ok"], f"{out['world']} ranks on {','.join(out['hosts'])} "
                 f"({out['backend']}): {out['megabytes']} MB in {out['median_s'] * 1e3:.0f} ms, "
                 f"bus bandwidth {out['busbw_gbs']:.2f} GB/s",
                 "the sum was wrong: check the network settings (env) of the profile")

    def request(self, name: str, nodes: int, run_dir: Path) -> SbatchRequest:
        return SbatchRequest.from_settings(self.v, self.res.template_dirs, job_name=name,
                                           nodes=nodes, gpus=self.v["gpus_per_node"], run_dir=run_dir)

    def cleanup(self) -> None:
        if self.probe_dir is not None and not self.keep:
            shutil.rmtree(self.probe_dir, ignore_errors=True)


def _rc(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _cancel(job: str) -> None:
    with contextlib.suppress(ValueError):  # it may have ended already
        cluster.scancel(job)


@click.command()
@click.option("--profile", help="Site profile to check [default: the configuration's `profile`].")
@click.option("--smoke", is_flag=True, help="Also run a 2-node all-reduce through the profile's template.")
@click.option("--wait", type=FiniteFloat(min=1), default=120, show_default=True,
              help="Seconds to wait for the probe job to start.")
@click.option("--min-free", type=FiniteFloat(min=0), default=5, show_default=True,
              help="GiB the storage root must have free.")
def doctor(profile: str | None, smoke: bool, wait: float, min_free: float) -> None:
    """Check that this site and a profile can run jobs: Slurm, partition, GPUs, storage
    (seen from the compute nodes), modules, container runtime, requeue. Exit 1 on any failure."""
    res = site.resolve(site.load(), profile)
    site.storage_root(res)  # an unset $VAR in it is bad input, not a failed check
    click.echo(f"profile: {res.profile or '- (no profile: built-in defaults and files)'}")
    doc = Doctor(res, wait, min_free)
    try:
        checks = doc.run(smoke)
    finally:
        doc.cleanup()
    table(("result", "check", "detail"), [(c.status, c.name, c.detail) for c in checks])
    failures = [c for c in checks if c.status == "FAIL"]
    if failures:
        click.echo("\nto fix:")
        for c in failures:
            click.echo(f"  {c.name}: {c.fix}")
        raise SystemExit(1)
    click.echo("\nall checks passed")
