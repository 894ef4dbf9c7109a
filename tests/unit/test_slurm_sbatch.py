"""The rendered sbatch script: golden files, hostile values, and the request's checks."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from hpcshard.slurm.sbatch import SbatchRequest, render
from hpcshard.slurm.time import parse_time

GOLDEN = Path(__file__).with_name("golden")
REFRESH = "refresh with: HPCSHARD_REFRESH_GOLDEN=1 python -m pytest tests/unit/test_slurm_sbatch.py"
HOSTILE = ["a'; echo pwned", "$(touch /tmp/hpcshard-pwned)", "`id`", "x  y z", "ünï ☃", 'q"uo"te']
COMMAND = "/usr/bin/python3 -u -m submitit.core._submit '/runs/x/submitit'"


def request(**kw: object) -> SbatchRequest:
    base: dict[str, object] = dict(job_name="charlm", nodes=2, gpus_per_node=8, time="04:00:00",
                                   partition="gpu", account="ml", qos="high", constraint="h100",
                                   cpus_per_task=64, mem="900G", run_dir=Path("/runs/x"),
                                   env={"NCCL_DEBUG": "WARN"}, setup=["module load cuda/12.4"])
    return SbatchRequest(**{**base, **kw})  # type: ignore[arg-type]


def unquoted(line: str) -> str:
    """The characters of a shell line that are outside single and double quotes."""
    out, quote = [], ""
    for ch in line:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        else:
            out.append(ch)
    return "".join(out)


def check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("HPCSHARD_REFRESH_GOLDEN"):
        path.write_text(text)
    assert path.exists(), f"no golden file {path}; {REFRESH}"
    assert text == path.read_text(), f"{name} changed; if intended, {REFRESH}"


def test_default_template_golden() -> None:
    check_golden("default.sbatch", render(request(), COMMAND, Path("/runs/x/submitit")))


def test_hostile_values_golden_and_only_quoted() -> None:
    hostile = request(job_name=HOSTILE[0], partition=HOSTILE[2], account=HOSTILE[1],
                      qos=HOSTILE[3], constraint=HOSTILE[4], mem="200G",
                      run_dir=Path("/runs/" + HOSTILE[0] + " " + HOSTILE[1]),
                      env={"A": HOSTILE[1], "B": HOSTILE[0], "C": HOSTILE[2]}, setup=[])
    text = render(hostile, COMMAND, Path("/runs/s"))
    check_golden("hostile.sbatch", text)
    # Outside of quotes, nothing of any hostile value remains on any line.
    for line in text.splitlines():
        bare = unquoted(line)
        for fragment in ("$(", "`", "; echo", "pwned", "☃", 'q"uo'):
            assert fragment not in bare, line
    # And bash, running the environment block, executes none of it.
    env_block = "\n".join(line for line in text.splitlines() if line.startswith("export "))
    out = subprocess.run(["bash", "-c", env_block + '\nprintf "%s|%s|%s" "$A" "$B" "$C"'],
                         capture_output=True, text=True, check=True)
    assert out.stdout == f"{HOSTILE[1]}|{HOSTILE[0]}|{HOSTILE[2]}"
    assert not Path("/tmp/hpcshard-pwned").exists()


def test_the_script_checks_each_secret_arrived_by_name(tmp_path: Path) -> None:
    """bash runs the rendered script's guards: silent with the secrets set, one line naming
    the missing one otherwise (and the whole script parses)."""
    text = render(request(secrets=["HF_TOKEN", "WANDB_API_KEY"]), COMMAND, Path("/runs/x/submitit"))
    script = tmp_path / "job.sh"
    script.write_text(text)
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    guards = "\n".join(line for line in text.splitlines() if line.startswith(": "))
    env = {"PATH": os.environ["PATH"], "HF_TOKEN": "x", "WANDB_API_KEY": "y"}
    def run() -> subprocess.CompletedProcess[str]:
        return subprocess.run(["bash", "-c", guards + "\necho arrived"], capture_output=True, text=True,
                              env=env)

    ok = run()
    assert (ok.returncode, ok.stdout, ok.stderr) == (0, "arrived\n", "")
    del env["WANDB_API_KEY"]
    missing = run()
    assert missing.returncode != 0 and "arrived" not in missing.stdout
    assert "WANDB_API_KEY: the secret WANDB_API_KEY is not in the environment of the job" in missing.stderr


def test_memory_is_checked_the_way_slurm_parses_it() -> None:
    for text in HOSTILE:  # never a memory size: refused before anything is rendered
        with pytest.raises(ValueError, match="is not a Slurm memory size"):
            render(request(mem=text), COMMAND, Path("/x"))
    assert "#SBATCH --mem=0" in render(request(mem="0"), COMMAND, Path("/x"))


def test_newlines_cannot_break_out_of_a_directive() -> None:
    for field in ("job_name", "partition", "account", "qos", "constraint", "mem"):
        with pytest.raises(ValueError, match="contains a newline"):
            render(request(**{field: "ok\n#SBATCH --wrap=evil"}), COMMAND, Path("/x"))


@pytest.mark.parametrize("text,seconds", [("30", 1800), ("1:30", 90), ("04:00:00", 14400),
                                          ("2-00", 172800), ("1-02:03", 93780),
                                          ("1-00:00:10", 86410)])
def test_slurm_time_formats(text: str, seconds: int) -> None:
    assert parse_time(text) == seconds


@pytest.mark.parametrize("bad", ["1h", "", "10m", "1:2:3:4", "-5"])
def test_bad_time_names_the_formats(bad: str) -> None:
    with pytest.raises(ValueError, match="MM, HH:MM:SS or D-HH:MM:SS"):
        parse_time(bad)


def test_lead_time_must_fit_in_the_limit() -> None:
    with pytest.raises(ValueError, match="not shorter than the time limit"):
        request(time="2", signal_lead_s=120).validate()


def test_unknown_template_lists_the_search_path(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'site.j2' not found; searched: .*templates"):
        render(request(template="site.j2"), COMMAND, Path("/x"))


def test_site_template_overrides_one_block(tmp_path: Path) -> None:
    (tmp_path / "site.j2").write_text('{% extends "sbatch.j2" %}{% block environment %}'
                                      "module load site/1.0{% endblock %}")
    text = render(request(template="site.j2", template_dirs=[str(tmp_path)]), COMMAND, Path("/x"))
    assert "module load site/1.0" in text and "NCCL_DEBUG" not in text and "#SBATCH --nodes=2" in text


def test_missing_variable_is_an_error_not_empty(tmp_path: Path) -> None:
    (tmp_path / "bad.j2").write_text("#!/bin/bash\n#SBATCH --x={{ undefined_thing }}\n")
    with pytest.raises(ValueError, match="'bad.j2'.*undefined_thing"):
        render(request(template="bad.j2", template_dirs=[str(tmp_path)]), COMMAND, Path("/x"))


def test_submit_warns_when_the_lead_time_is_shorter_than_the_last_save(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from hpcshard.cli.request import _warn_lead_time
    from hpcshard.rundir import store

    ckpt = tmp_path / store.CHECKPOINTS / store.step_name(10)
    ckpt.mkdir(parents=True)
    (ckpt / store.METADATA).write_bytes(b"x")
    (ckpt / store.MANIFEST).write_text(json.dumps({"step": 10, "files": {store.METADATA: 1},
                                                   "save_seconds": 200.0}))
    _warn_lead_time(tmp_path, request(signal_lead_s=120))
    assert "--signal-lead 120s is short: the last checkpoint of this run took 200s" in capsys.readouterr().err
    _warn_lead_time(tmp_path, request(signal_lead_s=600))
    assert capsys.readouterr().err == ""


@pytest.mark.usefixtures("fake_srun")
def test_render_agrees_with_submitit_without_importing_it(tmp_path: Path) -> None:
    """`render` builds submitit's task command and log names itself (importing submitit
    would make it slow); they must stay what submitit's executor produces."""
    from submitit.core.utils import JobPaths

    from hpcshard.slurm.submit import executor, sbatch_text, submit_command

    for python in ("", "/opt/my env/bin/python"):
        req = request(python=python)
        ex = executor(req, tmp_path)
        assert submit_command(req, tmp_path) == ex._submitit_command_str
        assert sbatch_text(req, tmp_path) == ex._make_submission_file_text(ex._submitit_command_str, "x")
    paths = JobPaths(folder=tmp_path / "submitit")
    text = sbatch_text(request(), tmp_path)
    assert f"--output {paths.stdout} --error {paths.stderr}" in text


def test_spares_ask_for_more_nodes_with_no_kill_and_bad_nodes_are_excluded() -> None:
    v = {"time": "01:00:00", "partition": "gpu", "account": "", "qos": "", "constraint": "",
         "cpus_per_gpu": 0, "mem": "", "signal": "USR2", "signal_lead": 120,
         "requeue_policy": "requeue", "modules": [], "env": {}, "setup": [], "secrets": [], "container": {},
         "python": "", "template": "sbatch.j2", "vars": {}}
    spared = SbatchRequest.from_settings(v, [], job_name="x", nodes=4, gpus=8, run_dir=Path("/r"),
                                         spares=1)
    text = render(spared, COMMAND, Path("/r/submitit"))
    assert "#SBATCH --nodes=5\n" in text and "#SBATCH --no-kill\n" in text
    plain = render(SbatchRequest.from_settings(v, [], job_name="x", nodes=4, gpus=8, run_dir=Path("/r")),
                   COMMAND, Path("/r/submitit"))
    assert "--no-kill" not in plain and "--exclude" not in plain
    fewer = SbatchRequest.from_settings(v, [], job_name="x", nodes=4, gpus=8, run_dir=Path("/r"),
                                        min_nodes=2)
    assert fewer.no_kill and fewer.nodes == 4
    excluded = render(request(exclude=["n3", "n7"]), COMMAND, Path("/r/submitit"))
    assert "#SBATCH --exclude=n3,n7\n" in excluded
    with pytest.raises(ValueError, match="exclude"):
        request(exclude=["n3\n#SBATCH --x"]).validate()
