from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from hpcshard.launch.node import NodeEnv, torchrun_argv
from hpcshard.rundir import events
from hpcshard.rundir.events import EndReason
from hpcshard.slurm.states import JobState


def test_node_env_round_trips_through_the_environment() -> None:
    node = NodeEnv(node_rank=1, nnodes=2, per_node=4, rdzv_host="10.0.0.1", rdzv_port=29400,
                   run_id="abc")
    assert NodeEnv.from_environ(node.to_environ()) == node


def test_torchrun_command_for_one_node() -> None:
    node = NodeEnv(node_rank=1, nnodes=2, per_node=4, rdzv_host="n1", rdzv_port=29400,
                   run_id="abc")
    argv = torchrun_argv(node, Path("/runs/x"))
    assert argv[1:3] == ["-m", "torch.distributed.run"]
    for arg in ("--nnodes=2", "--nproc_per_node=4", "--rdzv_backend=static", "--node_rank=1",
                "--rdzv_endpoint=n1:29400", "--rdzv_id=abc", "--max_restarts=0"):
        assert arg in argv
    assert argv[-3:] == ["-m", "hpcshard.entry", "/runs/x"]


def test_warm_ranks_take_torchruns_own_options(monkeypatch: pytest.MonkeyPatch) -> None:
    """hpcshard jobs fork warm ranks through torchrun's own parser and agent; scripts and
    other modules, and HPCSHARD_WARM_START=0, get plain torchrun."""
    import torch.distributed.run as torchrun

    from hpcshard.launch.node import warm_start
    from hpcshard.rundir.spec import Script

    node = NodeEnv(node_rank=0, nnodes=2, per_node=4, rdzv_host="n1", rdzv_port=29400, run_id="abc")
    plain, warm = torchrun_argv(node, Path("/runs/x")), torchrun_argv(node, Path("/runs/x"), warm=True)
    assert warm[1:3] == ["-m", "hpcshard.launch.warm"] and warm[3:] == plain[3:-3] + ["/runs/x"]
    config, _, _ = torchrun.config_from_args(torchrun.get_args_parser().parse_args(warm[3:]))
    assert (config.min_nodes, config.max_nodes, config.nproc_per_node) == (2, 2, 4)
    assert config.rdzv_endpoint == "n1:29400" and config.run_id == "abc" and config.max_restarts == 0
    monkeypatch.delenv("HPCSHARD_WARM_START", raising=False)
    assert warm_start("hpcshard.entry", None)
    own = Script(kind="file", target="/x/train.py")
    assert not warm_start("hpcshard.entry", own) and not warm_start("x.smoke", None)
    monkeypatch.setenv("HPCSHARD_WARM_START", "0")
    assert not warm_start("hpcshard.entry", None)


def test_the_warm_agent_asks_torch_about_cuda_through_nvml_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Building torchrun's LaunchConfig asks `torch.cuda.is_available()` and `device_count()`
    (for its default NUMA binding); answered by the CUDA runtime, that poisons every later
    fork, and each forked rank died with "Cannot re-initialize CUDA in forked subprocess"
    (an H100, torch 2.11). The warm agent has NVML answer them, and leaves the ranks'
    environment as it was."""
    import torch
    import torch.distributed.run as torchrun

    from hpcshard.launch import warm

    asked: list[str | None] = []

    def available() -> bool:
        asked.append(os.environ.get(warm.NVML_CHECK))
        return True

    def count() -> int:
        asked.append(os.environ.get(warm.NVML_CHECK))
        return 4

    monkeypatch.setattr(torch.cuda, "is_available", available)
    monkeypatch.setattr(torch.cuda, "device_count", count)
    monkeypatch.delenv(warm.NVML_CHECK, raising=False)
    node = NodeEnv(node_rank=0, nnodes=1, per_node=4, rdzv_host="n1", rdzv_port=29400, run_id="abc")
    args = torchrun.get_args_parser().parse_args(torchrun_argv(node, Path("/runs/x"), warm=True)[3:])
    config = warm._config(torchrun, args)
    assert asked and set(asked) == {"1"}
    assert warm.NVML_CHECK not in os.environ and config.nproc_per_node == 4
    monkeypatch.setenv(warm.NVML_CHECK, "0")
    warm._config(torchrun, args)
    assert os.environ[warm.NVML_CHECK] == "0"


@pytest.mark.parametrize("visible", ["MIG-4f1c2a9e-0d6b-5e2f-9a8c-3b7d1e6f0a42", None])
def test_the_warm_agent_never_asks_the_cuda_runtime_even_where_nvml_cannot_count(
        monkeypatch: pytest.MonkeyPatch, visible: str | None) -> None:
    """NVML answers `torch.cuda.device_count()` only where it can count: for MIG instances
    (CUDA_VISIBLE_DEVICES=MIG-..., how CUDA names them) or without libnvidia-ml, torch asks
    the CUDA runtime after all, and every forked rank died again ("Cannot re-initialize
    CUDA in forked subprocess"). torch's own `is_available` and `device_count` run here;
    only the runtime's call is a stand-in (this torch has none), which must never be made."""
    import torch
    import torch.distributed.run as torchrun

    from hpcshard.launch import warm

    runtime: list[str] = []

    def cuda_get_device_count() -> int:
        runtime.append("cudaGetDeviceCount")  # (the call that poisons every later fork)
        return 4

    monkeypatch.setattr(torch._C, "_cuda_getDeviceCount", cuda_get_device_count, raising=False)
    monkeypatch.setattr(torch.cuda, "_raw_device_count_nvml", lambda: -1)  # (no libnvidia-ml)
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    node = NodeEnv(node_rank=0, nnodes=1, per_node=4, rdzv_host="n1", rdzv_port=29400, run_id="abc")
    args = torchrun.get_args_parser().parse_args(torchrun_argv(node, Path("/runs/x"), warm=True)[3:])
    config = warm._config(torchrun, args)
    assert not runtime and config.nproc_per_node == 4
    assert os.environ.get("CUDA_VISIBLE_DEVICES") == visible  # (the ranks' own, as it was)


def test_nodelist_expansion() -> None:
    from hpcshard.launch.slurm import expand_nodelist

    assert expand_nodelist("n[1-2],gpu[01-03,07],login") == [
        "n1", "n2", "gpu01", "gpu02", "gpu03", "gpu07", "login"]
    assert expand_nodelist("rack[1-2]-n[8-9]") == ["rack1-n8", "rack1-n9", "rack2-n8", "rack2-n9"]
    assert expand_nodelist("node007") == ["node007"]


def test_slurm_env_gives_the_node_its_place_and_rendezvous() -> None:
    from hpcshard.launch.slurm import SlurmEnv, node_env, rdzv_port

    env = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_NODEID": "1",
           "SLURM_GPUS_ON_NODE": "8"}
    slurm = SlurmEnv.from_environ(env)
    assert (slurm.nodes, slurm.node_id, slurm.restart_count, slurm.gpus_on_node) == (
        ["gpu07", "gpu08"], 1, 0, 8)
    node = node_env(slurm, 8)
    assert (node.node_rank, node.nnodes, node.rdzv_host) == (1, 2, "gpu07")
    requeued = node_env(SlurmEnv.from_environ({**env, "SLURM_RESTART_COUNT": "2"}), 8)
    assert requeued.rdzv_port != node.rdzv_port and requeued.run_id == "4242-2"
    ports = {rdzv_port(str(j), 0) for j in range(1000, 1100)}
    assert len(ports) == 100 and all(20000 <= p < 30000 for p in ports)
    # a sweep's task: its own job id, and the name the run's spec and accounting give it
    task = SlurmEnv.from_environ({**env, "SLURM_JOB_ID": "4250", "SLURM_ARRAY_JOB_ID": "4242",
                                  "SLURM_ARRAY_TASK_ID": "3"})
    assert (task.job_id, task.ref, slurm.ref) == ("4250", "4242_3", "4242")


def test_job_state_falls_back_to_sacct_when_scontrol_forgot(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from hpcshard.slurm import cluster

    (tmp_path / "scontrol").write_text("#!/bin/sh\necho 'Invalid job id specified' >&2\nexit 1\n")
    (tmp_path / "sacct").write_text(
        "#!/bin/sh\necho '77|PREEMPTED|0:0|00:01:00|n[3-4]|2026-01-01T10:00:00|2026-01-01T10:01:00'\n"
        "echo '77|CANCELLED by 0|0:15|00:03:10|n[1-2]|2026-01-01T10:02:00|2026-01-01T10:05:10'\n")
    for name in ("scontrol", "sacct"):
        (tmp_path / name).chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert cluster.job_state("77") == cluster.JobInfo(
        "77", JobState.CANCELLED, "CANCELLED", restarts=1, nodes="n[1-2]", run_time="00:03:10",
        exit_code="0:15", start="2026-01-01T10:02:00", end="2026-01-01T10:05:10", from_accounting=True)
    (tmp_path / "sacct").write_text("#!/bin/sh\necho 'accounting storage is disabled' >&2\nexit 1\n")
    assert cluster.job_state("77") is None


def test_a_late_notice_cannot_kill_a_finished_rank() -> None:
    import signal

    from hpcshard.runtime.stop import StopRequest

    stop = StopRequest("USR2").install()
    try:
        stop.ignore_from_now()
        # Ignored, not a Python handler: CPython resets handlers to "terminate" at shutdown.
        assert signal.getsignal(signal.SIGUSR2) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGUSR2, signal.SIG_DFL)


def test_a_node_with_almost_no_memory_available_fails_its_health_check(tmp_path: Path) -> None:
    from hpcshard.launch.health import memory_short

    info = tmp_path / "meminfo"
    info.write_text("MemTotal:       25165824 kB\nMemFree:  100 kB\nMemAvailable:     524288 kB\n")
    assert "0.5 GiB of 24 GiB memory available" in memory_short(info)
    info.write_text("MemTotal:       25165824 kB\nMemAvailable:   20000000 kB\n")
    assert memory_short(info) == ""
    assert memory_short(tmp_path / "absent") == ""


def test_a_peer_is_lost_by_the_readers_clock_not_the_writers() -> None:
    """Defect 10: heartbeats compared the writer's wall clock with the reader's; 9 s of skew
    made a healthy node "lost" at once. A peer is alive while its sequence number moves,
    timed on the reader's monotonic clock, whatever time its records carry."""
    from hpcshard.launch.liveness import LOST_S, UNHEARD_S, Peers

    peers = Peers(began=100.0, heard_since=100.0)
    skewed = {1: {"seq": 1, "time": 100.0 - 9}, 2: {"seq": 1, "time": 100.0 + 3600}}
    assert peers.lost([1, 2], skewed, now=100.0) == []
    for t in range(101, 130):  # node 1 beats every second; node 2 stands still
        skewed[1] = {"seq": t, "time": 0.0}
        found = peers.lost([1, 2], skewed, now=float(t))
        assert 1 not in found
        assert (2 in found) == (t - 100.0 > LOST_S)
    assert peers.lost([3], skewed, now=100.0 + UNHEARD_S + 0.1) == [3]  # never heard of
    assert peers.lost([3], {3: {"seq": 0, "done": 0}}, now=500.0) == []  # it ended


def test_a_peer_is_not_lost_while_this_launchers_own_heartbeats_cannot_be_written() -> None:
    """On a full (or hung) disk nobody's heartbeat lands: silence then says nothing about a
    peer. It counts again from the first beat of this launcher's that lands."""
    from hpcshard.launch.liveness import LOST_S, Peers

    peers = Peers(began=0.0, heard_since=0.0)
    beats = {1: {"seq": 5}}
    assert peers.lost([1], beats, now=1.0) == []
    assert peers.lost([1], beats, now=LOST_S + 2) == [1]  # stood still while ours landed
    peers.cannot_beat()
    assert peers.lost([1], beats, now=100.0) == []
    peers.beat_landed(now=100.0)  # the disk has room again
    assert peers.lost([1], beats, now=100.0 + LOST_S - 1) == []
    assert peers.lost([1], beats, now=100.0 + LOST_S + 1) == [1]


def test_a_guard_s_other_launchers_take_its_word_from_the_guard_file_not_a_new_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One launcher of a guard job decides whether it takes the run over; the others wait
    for its word. They waited for its attempt file to appear: on NFS a name this host looked
    up before another created it stays hidden for the negative lookup cache (30-60 s), and in
    the chaos soak on NFS-like views the guard's ranks started 42 s after it took the run
    over, against 14 s for a continuation job. The word is now a line in the guard file, which
    every launcher of the guard has seen since it was submitted (new content in a known file
    shows at the next open). Here the attempt file never shows at all."""
    import threading

    from hpcshard.launch import slurm
    from hpcshard.rundir import launchers
    from hpcshard.rundir.launchers import LAUNCH, attempt_file

    (tmp_path / LAUNCH).mkdir()
    monkeypatch.setattr(slurm, "GUARD_WAIT_S", 20.0)
    env = slurm.SlurmEnv(job_id="9", ref="9", nodes=["n1", "n2"], node_id=1, restart_count=0, gpus_on_node=1)
    launchers.guard_file(tmp_path, "9").write_text("7\n")
    assert launchers.claim(tmp_path, "take-over-9")  # (another launcher of job 9 decides)
    assert launchers.guard_decision(tmp_path, "9") is None
    threading.Timer(0.3, launchers.decide_guard, (tmp_path, "9", 3)).start()
    began = time.monotonic()
    assert slurm._take_over(tmp_path, env, "7", 0, 2) == 3  # (the attempt it trains as)
    assert time.monotonic() - began < 10 and not attempt_file(tmp_path, "9").exists()
    assert launchers.guard_decision(tmp_path, "9") == (3, "") and launchers.guarded_job(tmp_path, "9") == "7"
    # Declined: said at once, and why.
    launchers.guard_file(tmp_path, "10").write_text("8\n")
    launchers.decide_guard(tmp_path, "10", None, "job 8 ended\nCANCELLED")
    other = slurm.SlurmEnv(job_id="10", ref="10", nodes=["n1", "n2"], node_id=1, restart_count=0,
                           gpus_on_node=1)
    assert slurm._take_over(tmp_path, other, "8", 0, 2) is None
    assert launchers.guard_decision(tmp_path, "10") == (None, "job 8 ended CANCELLED")
    # A line still being written is no word yet.
    launchers.guard_file(tmp_path, "11").write_text("8\ntaken 4")
    assert launchers.guard_decision(tmp_path, "11") is None
    # A guard that took over before its word went into its file (an older hpcshard), then
    # requeued by Slurm: its attempt file, long there, says the attempt at once.
    launchers.guard_file(tmp_path, "12").write_text("8\n")
    assert launchers.claim(tmp_path, "take-over-12")
    attempt_file(tmp_path, "12").write_text("2\n")
    again = slurm.SlurmEnv(job_id="12", ref="12", nodes=["n1"], node_id=0, restart_count=1, gpus_on_node=1)
    assert slurm._take_over(tmp_path, again, "8", 0, 2) == 2
    # Guards listed in submission order (job ids), though a decision rewrote a file's mtime.
    assert launchers.guards(tmp_path) == ["9", "10", "11", "12"]


@pytest.mark.parametrize("state,records,jobs,owner,takes", [
    ("FAILED", [], ["7"], "7", True),  # its batch node failed: nothing closed the attempt
    ("NODE_FAIL", [events.Start(attempt=2, cycle=0, world=2, nodes=2, host="n1")], ["7"], "7", True),
    ("FAILED", [], ["7"], None, True),  # a run of an older hpcshard: no lease
    ("CANCELLED", [], ["7"], "7", False),  # somebody cancelled it
    ("COMPLETED", [], ["7"], "7", False),
    ("FAILED", [events.End(attempt=0, reason=EndReason.ERROR)], ["7"], "7", False),  # a real failure
    ("FAILED", [events.Chain(attempt=0, job="7", next="8")], ["7"], "7", False),  # continued already
    ("FAILED", [], ["7", "8"], None, False),  # a newer job has the run
    ("FAILED", [], ["7"], "8", False),  # another job owns the run (a resume)
    # defect 1: take-overs count against max_requeues (2 here), or a run that dies the same
    # way every time takes itself over forever
    ("FAILED", [events.Requeue(attempt=0, job="7"),
                events.Guard(attempt=1, job="7", next="8", state="FAILED"),
                events.Start(attempt=2, cycle=0, world=2, nodes=2, host="n1")], ["7"], "7", False),
])
def test_a_guard_takes_the_run_over_only_from_a_job_that_failed_without_a_word(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, state: str, records: list[events.Event],
        jobs: list[str], owner: str | None, takes: bool) -> None:
    from hpcshard.launch import slurm
    from hpcshard.rundir import launchers, lease, ledger
    from hpcshard.rundir.launchers import LAUNCH, attempt_file
    from hpcshard.rundir.spec import RunSpec

    RunSpec(job="jobs/charlm.py", sets={}, nodes=2, gpus=1, backend="slurm", name="x", spares=1,
            jobs=jobs).write(tmp_path)
    (tmp_path / LAUNCH).mkdir()
    launchers.guard_file(tmp_path, "9").write_text("7\n")  # (job 9 guards job 7: `slurm.guard`)
    if owner is not None:
        lease.take(tmp_path, lease.Owner.of_job(owner), lambda job: None)
    for r in records:
        ledger.append(tmp_path, r)
    monkeypatch.setattr(slurm.cluster, "show_job",
                        lambda job, timeout=0: slurm.cluster.JobInfo.of_scontrol(job, {"JobState": state}))
    monkeypatch.setattr(slurm.cluster, "job_alive", lambda job, timeout=0: state not in (
        "FAILED", "NODE_FAIL", "CANCELLED", "COMPLETED"))
    env = slurm.SlurmEnv(job_id="9", ref="9", nodes=["n1", "n2"], node_id=0, restart_count=0, gpus_on_node=1)
    assert (slurm._take_over(tmp_path, env, "7", 0, 2) is not None) is takes
    if takes:
        now = lease.read(tmp_path)
        assert now is not None and now.job == "9"  # the guard owns the run now
        attempt = max([0, *(r.attempt for r in records)])
        assert attempt_file(tmp_path, "9").read_text() == f"{attempt + 1}\n"
        assert launchers.guard_decision(tmp_path, "9") == (attempt + 1, "")  # (its other launchers' word)
        assert RunSpec.read(tmp_path).jobs == [*jobs, "9"]
        (guard,) = [r for r in ledger.read(tmp_path) if r["event"] == "guard"]
        assert guard["job"] == "7" and guard["state"] == state
    else:
        assert not attempt_file(tmp_path, "9").exists() and RunSpec.read(tmp_path).jobs == jobs
        said = [r for r in ledger.read(tmp_path)][len(records):]
        # only a spent budget is recorded: the run ends there, and status must say why
        assert [r["event"] for r in said] == (["gave_up"] if len(records) == 3 else [])


def test_the_local_backends_ports_are_picked_together_and_differ() -> None:
    """The rendezvous and the launchers' store: two picks one after the other could get the
    same port (the store would take the rendezvous's and cost a restart)."""
    from hpcshard.launch.local import free_ports

    for _ in range(20):
        found = free_ports(2)
        assert len(set(found)) == 2


def test_descendants_finds_a_whole_process_tree_in_one_look() -> None:
    """What lies below a launcher (agent, forked ranks, what they started), grandchildren
    too; children() only the first level."""
    import subprocess
    import time

    from hpcshard.launch.procs import children, descendants

    tree = subprocess.Popen(["sh", "-c", "(sleep 30; true) & sleep 30 & wait"], start_new_session=True)
    try:
        deadline = time.monotonic() + 5
        while len(descendants(tree.pid)) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        below = descendants(tree.pid)  # the subshell and its sleep, the other sleep
        assert len(below) == 3 and len(children(tree.pid)) == 2
        assert set(children(tree.pid)) < set(below)
    finally:
        os.killpg(tree.pid, 9)
        tree.wait()


def test_a_continuation_starts_from_submitits_own_files_under_its_new_id(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A chained job is the same submission script and pickle under the new job id, named
    as submitit names them (its JobPaths), and it excludes the run's bad nodes."""
    from hpcshard.launch import slurm as launch_slurm
    from hpcshard.rundir.paths import RunPaths

    folder = RunPaths(tmp_path).submitit
    folder.mkdir()
    (folder / "41_submission.sh").write_text("#!/bin/bash\n")
    (folder / "41_submitted.pkl").write_bytes(b"pickle")
    asked: list[tuple[str, ...]] = []

    def sbatch(*args: str, **kw: object) -> str:
        asked.append(args)
        return "42"

    monkeypatch.setattr(launch_slurm.cluster, "sbatch", sbatch)
    assert launch_slurm._resubmit(tmp_path, "41", "--dependency=afterany:41") == "42"
    assert asked == [("--dependency=afterany:41", str(folder / "41_submission.sh"))]
    assert (folder / "42_submitted.pkl").read_bytes() == b"pickle"
    assert (folder / "42_submission.sh").read_text() == "#!/bin/bash\n"


def test_a_guard_is_submitted_for_a_range_of_nodes_without_the_scripts_task_count(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A guard asks for N to N+S nodes; with the script's `--ntasks-per-node=1` Slurm gives
    it N however many are idle (tests/slurm/test_slurm_values.py shows it on the real
    sbatch): the guard's script is the job's without its task-count directives, every other
    byte and its mode kept, sbatch does not see SBATCH_USE_MIN_NODES, and the guard's own
    continuations are submitted from that script."""
    from hpcshard.launch import slurm as launch_slurm
    from hpcshard.rundir.paths import RunPaths
    from hpcshard.rundir.spec import RunSpec

    RunSpec(job="jobs/charlm.py", sets={}, nodes=2, gpus=2, spares=1, name="g",
            backend="slurm").write(tmp_path)
    folder = RunPaths(tmp_path).submitit
    folder.mkdir()
    (tmp_path / "launch").mkdir()
    script = ("#!/bin/bash\n#SBATCH --job-name=r\xe9sum\xe9\n#SBATCH --nodes=3\n#SBATCH --ntasks-per-node=1\n"
              "#SBATCH --no-kill\nsrun x\n").encode("latin-1")  # (not UTF-8: kept as it is)
    (folder / "41_submission.sh").write_bytes(script)
    (folder / "41_submission.sh").chmod(0o700)
    (folder / "41_submitted.pkl").write_bytes(b"pickle")
    asked: list[tuple[tuple[str, ...], dict[str, object]]] = []
    sent: list[bytes] = []

    def sbatch(*args: str, **kw: object) -> str:
        asked.append((args, kw))
        sent.append(Path(args[-1]).read_bytes())
        return "42"

    monkeypatch.setattr(launch_slurm.cluster, "sbatch", sbatch)
    assert launch_slurm.guard(tmp_path, "41") == "42"
    (args, kw), = asked
    assert args[:3] == ("--dependency=afternotok:41", "--kill-on-invalid-dep=yes", "--nodes=2-3")
    assert kw == {"unset": ("SBATCH_USE_MIN_NODES",)}
    assert sent == [script.replace(b"#SBATCH --ntasks-per-node=1\n", b"")]
    assert (folder / "42_submission.sh").read_bytes() == sent[0]
    assert (folder / "42_submission.sh").stat().st_mode & 0o777 == 0o700
    assert (folder / "41_submission.sh").read_bytes() == script


@pytest.mark.parametrize(("directive", "left"), [
    ("#SBATCH --ntasks-per-node=1", None),
    ("#SBATCH --tasks-per-node=1", None),  # (Slurm's alias)
    ("#SBATCH --ntasks-per-n=1", None),  # (an abbreviation sbatch takes)
    ("#SBATCH --ntasks 4", None),
    ("#SBATCH -n 4", None),
    ("#SBATCH -n4", None),
    ("#SBATCH --use-min-nodes", None),
    ("#SBATCH   --ntasks=4 # four", None),
    ("#SBATCH --gpus-per-node=2 --ntasks-per-node=1", "#SBATCH --gpus-per-node=2"),
    ("#SBATCH -c1 -n2 --constraint=a100", "#SBATCH -c1 --constraint=a100"),
    ("#SBATCH --job-name='a -n 2' -n 2 --comment=\"x # y\"",
     "#SBATCH --job-name='a -n 2' --comment=\"x # y\""),
    ("#SBATCH --nodes=3 # --ntasks-per-node=1", "#SBATCH --nodes=3 # --ntasks-per-node=1"),
    ("#SBATCH -N 3", "#SBATCH -N 3"),
    ("#SBATCH --ntasks-per-core=1", "#SBATCH --ntasks-per-core=1"),
    ("#SBATCH --ntasks-per-gpu=1", "#SBATCH --ntasks-per-gpu=1"),
    ("#SBATCH --nodelist=n1", "#SBATCH --nodelist=n1"),
])
def test_a_ranged_script_loses_only_what_holds_a_range_to_its_least_count(directive: str,
                                                                          left: str | None) -> None:
    """`sbatch.ranged_script`, option by option: only the options that hold a job of N-M
    nodes to N go, the rest of their line stays as written, and only in the directives
    sbatch reads (none after the first command)."""
    from hpcshard.slurm.sbatch import ranged_script

    tail = "srun x\n#SBATCH -n 3\n"
    got = ranged_script(f"#!/bin/bash\n{directive}\r\n{tail}")
    assert got == f"#!/bin/bash\n{left}\r\n{tail}" if left else got == f"#!/bin/bash\n{tail}"


def test_listen_ports_are_picked_below_the_ephemeral_range(monkeypatch: pytest.MonkeyPatch) -> None:
    """A port from bind(0) is ephemeral: any outgoing connection may take it as its source
    port before the rendezvous listens on it (a torchrun agent exited 1 before its ranks
    started, under the suite's load). Below the range no source port lands."""
    import socket

    from hpcshard.launch import ports

    found = ports.listen_ports(5, "127.0.0.1")
    assert len(set(found)) == 5 and all(ports.LOW <= p < ports.ephemeral_low() for p in found)
    for port in found:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # (free: given back once picked)
    monkeypatch.setattr(ports, "ephemeral_low", lambda: ports.LOW + 10)  # no room below it
    assert len(set(ports.listen_ports(2, "127.0.0.1"))) == 2


def test_a_launcher_gives_the_attempts_end_record_time_before_it_requeues(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A requeue kills every process of the job: node 1's launcher, first to claim the
    continuation, once cut node 0's end record of a script's attempt off. Every launcher
    now waits for that record (bounded: a lost leader writes none); the one that wrote it
    finds it at once."""
    import threading

    from hpcshard.launch import slurm
    from hpcshard.rundir import ledger

    monkeypatch.setattr(slurm, "END_POLL_S", 0.05)
    ledger.append(tmp_path, events.End(attempt=0, reason=EndReason.STOP))
    started = time.monotonic()
    slurm._await_end(tmp_path, 0, 30.0)  # written (by itself, the leader): no wait
    assert time.monotonic() - started < 10.0  # (far below the 30 s it waits for a record not there)
    started = time.monotonic()
    reads = []
    monkeypatch.setattr(ledger, "end_of", lambda run, attempt: reads.append(attempt))
    slurm._await_end(tmp_path, 1, 0.5)  # nothing written: it gives up after `within`...
    assert 0.5 <= time.monotonic() - started < 3.0
    assert reads == [1]  # ...having read the unchanged ledger once, not at every poll
    monkeypatch.undo()
    monkeypatch.setattr(slurm, "END_POLL_S", 0.05)
    stop = events.End(attempt=2, reason=EndReason.STOP)
    timer = threading.Timer(0.3, lambda: ledger.append(tmp_path, stop))
    timer.start()
    begun = time.monotonic()
    slurm._await_end(tmp_path, 2, 30.0)  # returns once the record is there, long before 30 s
    timer.join()
    assert ledger.end_of(tmp_path, 2) is not None and time.monotonic() - begun < 10.0
