"""Site configuration: the five layers and their provenance, profiles, the template search
path, and every kind of bad input (one line, exit 2, naming the file and the fix)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpcshard import site
from hpcshard.slurm.sbatch import SbatchRequest, render
from tests.unit.test_cli_submit import invoke

JOB = str(Path(__file__).resolve().parents[2] / "jobs" / "charlm.py")
COMMAND = "/usr/bin/python3 -u -m submitit.core._submit /r/submitit"


@pytest.fixture
def layers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    """A site file, a user file (through XDG_CONFIG_HOME) and a project directory."""
    files = {"site": tmp_path / "etc" / "site.toml",
             "user": tmp_path / "xdg" / "hpcshard" / "config.toml",
             "project": tmp_path / "project" / "hpcshard.toml"}
    for path in files.values():
        path.parent.mkdir(parents=True)
    monkeypatch.setenv("HPCSHARD_SITE", str(files["site"]))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.chdir(files["project"].parent)
    files["site"].write_text("")
    return files


def one_line_error(code: int, output: str, *needles: str) -> None:
    assert code == 2, output
    lines = [line for line in output.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error:"), output
    for needle in needles:
        assert needle in output, output


def test_five_layers_later_wins_and_each_value_knows_its_source(layers: dict[str, Path]) -> None:
    layers["site"].write_text('profile = "gpu"\n[defaults]\naccount = "site-acct"\nqos = "site-qos"\n'
                              'env = { A = "site", B = "site" }\n'
                              '[profiles.gpu]\npartition = "site-part"\ngpus_per_node = 8\n'
                              'mem = "10G"\nconstraint = "site-c"\ntime = "02:00:00"\n')
    layers["user"].write_text('[defaults]\nqos = "user-qos"\nmem = "20G"\nenv = { B = "user" }\n'
                              '[profiles.gpu]\nconstraint = "user-c"\n')
    layers["project"].write_text('[defaults]\nconstraint = "project-c"\nmem = "30G"\n')
    res = site.resolve(site.load(), cli={"mem": "40G", "qos": None})
    v = res.values
    assert res.profile == "gpu"
    assert (v["account"], v["qos"], v["partition"], v["constraint"], v["mem"]) == \
        ("site-acct", "user-qos", "site-part", "project-c", "40G")
    assert v["env"] == {"A": "site", "B": "user"}  # tables merge key by key
    assert v["time"] == "02:00:00" and v["gpus_per_node"] == 8 and v["signal"] == "USR2"
    site_file, user_file = str(layers["site"]), str(layers["user"])
    assert res.source("account") == f"site {site_file} [defaults]"
    assert res.source("partition") == f"site {site_file} [profiles.gpu]"
    assert res.source("qos") == f"user {user_file} [defaults]"
    assert res.source("constraint") == f"project {layers['project']} [defaults]"
    assert res.source("mem") == "command line"
    assert res.source("env.A") == f"site {site_file} [defaults]"
    assert res.source("env.B") == f"user {user_file} [defaults]"
    assert res.source("signal") == "built-in"


def test_within_a_layer_the_profile_beats_the_defaults(layers: dict[str, Path]) -> None:
    layers["site"].write_text('[defaults]\npartition = "cpu"\n[profiles.a]\npartition = "gpu"\n')
    assert site.resolve(site.load(), "a").values["partition"] == "gpu"
    assert site.resolve(site.load()).values["partition"] == "cpu"  # no profile chosen


def test_the_default_profile_comes_from_the_last_file_that_names_one(layers: dict[str, Path]) -> None:
    layers["site"].write_text('profile = "a"\n[profiles.a]\nqos = "qa"\n[profiles.b]\nqos = "qb"\n')
    layers["user"].write_text('profile = "b"\n')
    assert site.resolve(site.load()).values["qos"] == "qb"
    assert site.resolve(site.load(), "a").values["qos"] == "qa"  # --profile wins


def test_config_show_prints_every_value_with_its_source(layers: dict[str, Path]) -> None:
    layers["site"].write_text('profile = "p"\n[profiles.p]\npartition = "gpu"\n'
                              'env = { NCCL_IB_HCA = "mlx5" }\n')
    layers["project"].write_text('[defaults]\ntime = "00:30:00"\n')
    code, out = invoke("config", "show")
    assert code == 0, out
    rows = {line.split()[0]: line for line in out.splitlines() if line.strip()}
    assert rows["partition"].split()[1] == "gpu"
    assert f"site {layers['site']} [profiles.p]" in rows["partition"]
    assert rows["time"].split()[1] == "00:30:00" and f"project {layers['project']}" in rows["time"]
    assert "mlx5" in rows["env.NCCL_IB_HCA"]
    assert rows["signal"].split()[1:] == ["USR2", "built-in"]
    assert "profile: p" in out


def test_user_file_follows_xdg_and_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("XDG_CONFIG_HOME")
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / ".config" / "hpcshard").mkdir(parents=True)
    (tmp_path / ".config" / "hpcshard" / "config.toml").write_text('[defaults]\nqos = "home"\n')
    assert site.resolve(site.load(cwd=tmp_path)).values["qos"] == "home"


def test_an_empty_hpcshard_site_means_no_site_file(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HPCSHARD_SITE", "")
    assert [layer.kind for layer in site.load()] == ["built-in"]


@pytest.mark.parametrize("text,needles", [
    ('[profiles.a]\npartition = "gpu"\ngpus = 4\n', ["[profiles.a]", "unknown key 'gpus'", "gpus_per_node"]),
    ('partition = "gpu"\n', ["unknown key 'partition'", "[defaults] or [profiles.NAME]"]),
    ('[profiles.a]\ngpus_per_node = "8"\n', ["gpus_per_node must be an integer", "'8'"]),
    ('[profiles.a]\nmodules = "cuda"\n', ["modules must be a list of strings"]),
    ('[profiles.a]\ntime = "forever"\n', ["time = 'forever'", "HH:MM:SS"]),
    ('[profiles.a]\nrequeue_policy = "sometimes"\n', ["requeue_policy", "requeue, chain, none"]),
    ('[profiles.a]\nsignal = "KILL"\n', ["signal = 'KILL'"]),
    ('[profiles.a]\ncontainer = { runtime = "docker", image = "x" }\n',
     ["container.runtime", "pyxis, apptainer"]),
    ('[profiles.a]\ncontainer = { runtime = "pyxis" }\n', ["container.image is missing"]),
    ('[profiles.a]\ncontainer = { runtime = "pyxis", image = "x", binds = [] }\n',
     ["container.binds", "mounts"]),
    ('[profiles.a]\nenv = { "BAD-NAME" = "1" }\n', ["'BAD-NAME' is not a valid environment variable"]),
    ('[profiles.a]\nenv = { X = true }\n', ["env.X must be a string or number"]),
    ('[profiles.a]\nvars = { partition = "x" }\n', ["'partition' is already a template variable"]),
    ('[profiles.a]\npartition = "gpu"\npartition = "cpu"\n', ["not valid TOML", "line 3"]),
    ('[profiles.a\n', ["not valid TOML", "line 1, column"]),
])
def test_bad_site_files_are_one_line_naming_file_and_key(layers: dict[str, Path], text: str,
                                                         needles: list[str]) -> None:
    layers["site"].write_text(text)
    code, out = invoke("render", JOB, "--profile", "a")
    one_line_error(code, out, str(layers["site"]), *needles)


def test_a_missing_profile_lists_the_ones_that_exist(layers: dict[str, Path]) -> None:
    layers["site"].write_text("[profiles.a100]\n[profiles.h100]\n")
    code, out = invoke("render", JOB, "--profile", "v100")
    one_line_error(code, out, "profile 'v100' does not exist; profiles: a100, h100")
    layers["user"].write_text('profile = "gone"\n')
    code, out = invoke("render", JOB)
    one_line_error(code, out, "profile 'gone'", f"named by user {layers['user']}", "a100, h100")


def test_hpcshard_site_pointing_nowhere_is_an_error(layers: dict[str, Path],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HPCSHARD_SITE", str(layers["site"].parent / "nope.toml"))
    code, out = invoke("config", "show")
    one_line_error(code, out, "HPCSHARD_SITE=", "nope.toml", "no such file")


def test_max_time_caps_the_requested_time(layers: dict[str, Path]) -> None:
    layers["site"].write_text('[profiles.debug]\ntime = "00:10:00"\nmax_time = "00:30:00"\n')
    code, out = invoke("render", JOB, "--profile", "debug", "--time", "02:00:00")
    one_line_error(code, out, "time 02:00:00 (from command line) is longer than the 00:30:00",
                   "profile 'debug'", "--time")
    code, out = invoke("render", JOB, "--profile", "debug", "--time", "00:20:00")
    assert code == 0 and "#SBATCH --time=00:20:00" in out


def test_profile_values_reach_the_rendered_script(layers: dict[str, Path], tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    layers["site"].write_text(f'''
[defaults]
storage_root = "{tmp_path}/shared/$HPCSHARD_TEST_USER"
[profiles.h100]
partition = "gpu-h100"
account = "ml"
gpus_per_node = 4
cpus_per_gpu = 12
modules = ["cuda/12.4", "nccl/2.21"]
env = {{ NCCL_IB_HCA = "mlx5_0,mlx5_1", NCCL_IB_TIMEOUT = 22 }}
setup = ["source /opt/venv/bin/activate"]
signal = "USR1"
signal_lead = 300
requeue_policy = "chain"
''')
    monkeypatch.setenv("HPCSHARD_TEST_USER", "alice")
    code, out = invoke("render", JOB, "--nodes", "2", "--profile", "h100")
    assert code == 0, out
    for line in ("#SBATCH --partition=gpu-h100", "#SBATCH --account=ml", "#SBATCH --gpus-per-node=4",
                 "#SBATCH --cpus-per-task=48", "module load cuda/12.4 nccl/2.21",
                 "export NCCL_IB_HCA=mlx5_0,mlx5_1", "export NCCL_IB_TIMEOUT=22",
                 "source /opt/venv/bin/activate", "#SBATCH --signal=USR1@300", "#SBATCH --no-requeue",
                 f"#SBATCH --output={tmp_path}/shared/alice/charlm-"):
        assert line in out, line
    code, out = invoke("render", JOB, "--profile", "h100", "--gpus", "2", "--cpus-per-gpu", "4")
    assert "#SBATCH --gpus-per-node=2" in out and "#SBATCH --cpus-per-task=8" in out


def site_template(layers: dict[str, Path], name: str, text: str, profile: str = "") -> None:
    folder = layers["site"].parent / "templates"
    folder.mkdir(exist_ok=True)
    (folder / name).write_text(text)
    layers["site"].write_text(f'template_dirs = ["templates"]\n[profiles.p]\ntemplate = "{name}"\n{profile}')


def test_a_site_template_overrides_one_block_and_shadows_nothing_else(layers: dict[str, Path]) -> None:
    site_template(layers, "site.j2", '{% extends "sbatch.j2" %}\n{% block launch %}'
                  "echo {{ reservation | q }}\n{{ super() }}{% endblock %}",
                  'vars = { reservation = "big day" }\n')
    code, out = invoke("render", JOB, "--profile", "p")
    assert code == 0, out
    assert "echo 'big day'\n# one launcher per node" in out and "#SBATCH --nodes=1" in out
    code, out = invoke("templates", "list", "--profile", "p")
    assert code == 0 and "*  site.j2" in out and "sbatch.j2" in out
    code, out = invoke("templates", "show", "site.j2", "--profile", "p")
    assert code == 0 and "{% block launch %}" in out and str(layers["site"].parent) in out


def test_a_site_template_of_the_same_name_shadows_the_built_in_one(layers: dict[str, Path]) -> None:
    folder = layers["site"].parent / "templates"
    folder.mkdir()
    (folder / "sbatch.j2").write_text("#!/bin/bash\n# site's own\n{{ command }}\n")
    layers["site"].write_text('template_dirs = ["templates"]\n')
    code, out = invoke("render", JOB)
    assert code == 0 and "# site's own" in out
    code, out = invoke("templates", "list")
    assert "shadowed" in out


def test_a_site_sbatch_j2_extends_the_built_in_one_by_its_builtin_name(layers: dict[str, Path]) -> None:
    folder = layers["site"].parent / "templates"
    folder.mkdir()
    layers["site"].write_text('template_dirs = ["templates"]\n')
    (folder / "sbatch.j2").write_text('{% extends "sbatch.j2" %}{% block container %}# mine\n{% endblock %}')
    code, out = invoke("render", JOB)
    one_line_error(code, out, "'sbatch.j2'", "extends or includes itself", 'extends "builtin/sbatch.j2"')
    (folder / "sbatch.j2").write_text('{% extends "builtin/sbatch.j2" %}{% block container %}# mine\n'
                                      "{% endblock %}")
    code, out = invoke("render", JOB)
    assert code == 0 and "# mine" in out and "#SBATCH --nodes=1" in out, out


def test_a_storage_root_naming_an_unset_variable_is_an_error(layers: dict[str, Path]) -> None:
    layers["site"].write_text('[defaults]\nstorage_root = "/shared/$HPCSHARD_UNSET_VAR/runs"\n')
    code, out = invoke("render", JOB)
    one_line_error(code, out, "storage_root '/shared/$HPCSHARD_UNSET_VAR/runs'", "[defaults]",
                   "$HPCSHARD_UNSET_VAR, which is not set here")


def test_a_template_using_a_setting_it_does_not_receive_says_so(layers: dict[str, Path]) -> None:
    site_template(layers, "site.j2", "#!/bin/bash\n{{ storage_root }}\n")
    code, out = invoke("render", JOB, "--profile", "p")
    one_line_error(code, out, "uses 'storage_root': a setting, but not one a template receives",
                   "templates get:", "partition")


@pytest.mark.parametrize("text,needles", [
    ("#!/bin/bash\n{{ reservation }}\n", ["uses 'reservation'", "no setting or profile defines",
                                          "[profiles.NAME.vars]"]),
    ("#!/bin/bash\n\n{% if nodes %}\n", ["line 3", "syntax error", "site.j2"]),
    ('{% extends "base-missing.j2" %}', ["'base-missing.j2' (needed by template 'site.j2') not found",
                                         "searched:"]),
])
def test_broken_site_templates_are_one_line_errors(layers: dict[str, Path], text: str,
                                                   needles: list[str]) -> None:
    site_template(layers, "site.j2", text)
    code, out = invoke("render", JOB, "--profile", "p")
    one_line_error(code, out, *needles)


def test_a_missing_template_lists_the_search_path(layers: dict[str, Path]) -> None:
    layers["site"].write_text('template_dirs = ["tpl"]\n[profiles.p]\ntemplate = "nope.j2"\n')
    code, out = invoke("render", JOB, "--profile", "p")
    one_line_error(code, out, "'nope.j2' not found", str(layers["site"].parent / "tpl"), "templates")


def test_profiles_list_and_show(layers: dict[str, Path]) -> None:
    layers["site"].write_text('profile = "a"\n[profiles.a]\ndescription = "A100 nodes"\n'
                              'partition = "gpu"\ngpus_per_node = 8\nmax_time = "2-00:00:00"\n'
                              '[profiles.dbg]\npartition = "debug"\n')
    layers["user"].write_text('[profiles.a]\naccount = "me"\n')
    code, out = invoke("profiles", "list")
    assert code == 0, out
    line_a = next(line for line in out.splitlines() if " a " in line)
    assert line_a.startswith("*") and "gpu" in line_a and "8 GPU/node" in line_a and "A100 nodes" in line_a
    assert str(layers["user"]) in line_a and "(max 2-00:00:00)" in line_a
    code, out = invoke("profiles", "show", "a")
    assert code == 0 and f"user {layers['user']} [profiles.a]" in out
    code, out = invoke("profiles", "show", "zzz")
    one_line_error(code, out, "'zzz' does not exist; profiles: a, dbg")


@pytest.mark.usefixtures("fake_srun")
def test_request_from_settings_matches_the_profile(layers: dict[str, Path]) -> None:
    layers["site"].write_text('[profiles.p]\ncontainer = { runtime = "apptainer", image = "/img/pt.sif", '
                              'mounts = ["/shared"] }\npython = "/opt/py env/bin/python"\n')
    res = site.resolve(site.load(), "p")
    req = SbatchRequest.from_settings(res.values, res.template_dirs, job_name="j", nodes=2, gpus=2,
                                      run_dir=Path("/r"))
    text = render(req, COMMAND, Path("/r/submitit"))
    assert "HPCSHARD_WRAP=(apptainer exec --nv --bind /shared /img/pt.sif)" in text
    from hpcshard.slurm.submit import executor

    assert executor(req, Path("/r"))._submitit_command_str.startswith("'/opt/py env/bin/python' -u -m")


def test_doctor_without_slurm_names_the_failure_and_its_fix(layers: dict[str, Path],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    layers["site"].write_text(f'[defaults]\nstorage_root = "{layers["site"].parent}"\n')
    monkeypatch.setenv("PATH", str(layers["site"].parent))  # no sbatch, squeue, ...
    code, out = invoke("doctor")
    assert code == 1, out
    assert "FAIL    slurm commands        not on PATH: sbatch, squeue, scontrol, sinfo" in out
    assert "skip    partition             needs Slurm" in out
    assert "pass    storage root" in out and "pass    template" in out
    assert "slurm commands: install Slurm's client commands" in out


def test_doctor_names_a_missing_storage_root(layers: dict[str, Path],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    layers["site"].write_text('[profiles.p]\nstorage_root = "/nonexistent/runs"\n')
    monkeypatch.setenv("PATH", str(layers["site"].parent))
    code, out = invoke("doctor", "--profile", "p")
    assert code == 1 and "FAIL    storage root          /nonexistent/runs does not exist" in out
    assert f"create it (mkdir -p /nonexistent/runs) or set storage_root in site {layers['site']} " \
           "[profiles.p]" in out


@pytest.mark.parametrize("text,needles", [
    ('[profiles.a]\nsignal = "TERM"\n', ["signal = 'TERM'", "USR1 or USR2", "torchrun"]),
    ('[profiles.a]\nsignal = "CHLD"\n', ["signal = 'CHLD'", "USR1 or USR2"]),
    ('[profiles.a]\nrun_group = "a b"\n', ["run_group = 'a b'", "Unix group name"]),
    ('[profiles.a]\nvars = { when = 2026-01-01 }\n', ["vars.when", "string, number, boolean"]),
])
def test_values_the_launch_cannot_carry_are_refused(layers: dict[str, Path], text: str,
                                                     needles: list[str]) -> None:
    layers["site"].write_text(text)
    code, out = invoke("render", JOB, "--profile", "a")
    one_line_error(code, out, str(layers["site"]), *needles)


def test_a_run_group_that_is_not_the_users_is_one_line_and_nothing_is_made(
        layers: dict[str, Path], tmp_path: Path) -> None:
    """Whether the group exists (and the user is in it) is asked at submit, of the user it
    concerns: a site profile is read by users of other groups too."""
    layers["site"].write_text('[profiles.a]\nrun_group = "no-such-group-x"\n')
    code, out = invoke("render", JOB, "--profile", "a", "--run-dir", str(tmp_path / "r"))
    one_line_error(code, out, "run_group 'no-such-group-x' is not a group", "id -Gn")
    assert not (tmp_path / "r").exists()


def test_signal_names_are_normalised(layers: dict[str, Path]) -> None:
    layers["site"].write_text('[profiles.a]\nsignal = "sigusr1"\n')
    assert site.resolve(site.load(), "a").values["signal"] == "USR1"


def test_a_site_file_that_is_not_utf8_names_the_file(layers: dict[str, Path]) -> None:
    layers["site"].write_bytes('[profiles.a]\ndescription = "café"\n'.encode("latin-1"))
    code, out = invoke("profiles", "list")
    one_line_error(code, out, str(layers["site"]), "not UTF-8")


@pytest.mark.parametrize("text,needles", [
    ("#!/bin/bash\n{{ nodes / 0 }}\n", ["'site.j2'", "division by zero"]),
    ('{% include "b.j2" %}', ["'site.j2'", "cycle"]),
])
def test_templates_that_fail_while_rendering_are_one_line(layers: dict[str, Path], text: str,
                                                          needles: list[str]) -> None:
    site_template(layers, "site.j2", text)
    (layers["site"].parent / "templates" / "b.j2").write_text('{% include "site.j2" %}')
    code, out = invoke("render", JOB, "--profile", "p")
    one_line_error(code, out, *needles)


def test_doctor_with_a_storage_root_naming_an_unset_variable_is_one_line(
        layers: dict[str, Path]) -> None:
    layers["site"].write_text('[defaults]\nstorage_root = "/shared/$HPCSHARD_UNSET_VAR"\n')
    code, out = invoke("doctor")
    one_line_error(code, out, "$HPCSHARD_UNSET_VAR, which is not set here")


@pytest.mark.usefixtures("fake_srun")
def test_hostile_values_in_modules_and_container_stay_quoted(layers: dict[str, Path]) -> None:
    from tests.unit.test_slurm_sbatch import HOSTILE, unquoted

    q = json.dumps  # JSON strings are TOML basic strings
    layers["site"].write_text(f"""
[profiles.p]
modules = [{q(HOSTILE[0])}, {q(HOSTILE[1])}]
python = {q(HOSTILE[1])}
[profiles.p.container]
runtime = "apptainer"
image = {q(HOSTILE[1])}
mounts = [{q(HOSTILE[2])}, {q(HOSTILE[3])}]
workdir = {q(HOSTILE[0])}
options = [{q(HOSTILE[5])}]
""")
    res = site.resolve(site.load(), "p")
    req = SbatchRequest.from_settings(res.values, res.template_dirs, job_name="j", nodes=1, gpus=1,
                                      run_dir=Path("/r"))
    from hpcshard.slurm.submit import executor

    ex = executor(req, Path("/r"))
    text = render(req, ex._submitit_command_str, Path("/r/submitit"))
    for line in text.splitlines():
        for fragment in ("$(", "`", "; echo", "pwned"):
            assert fragment not in unquoted(line), line


def test_the_admin_guide_shows_the_settings_registry() -> None:
    """docs/admins.md's table of settings is generated from `SETTINGS` (help, choices, the
    option); HPCSHARD_REFRESH_GOLDEN=1 rewrites it."""
    import os
    import re

    from hpcshard.site.settings import markdown_table
    from tests.conftest import ROOT

    guide = ROOT / "docs" / "admins.md"
    text = guide.read_text()
    table = re.compile(r"^\| setting \| type \|.*?\n(?=\n)", re.S | re.M)
    assert table.search(text), "docs/admins.md has no settings table"
    if os.environ.get("HPCSHARD_REFRESH_GOLDEN"):
        guide.write_text(table.sub(lambda _: markdown_table(), text, count=1))
        text = guide.read_text()
    assert markdown_table() in text, ("docs/admins.md's settings table is stale; refresh with: "
                                      "HPCSHARD_REFRESH_GOLDEN=1 python -m pytest tests/unit/test_site.py")


def test_a_profile_gives_training_settings_under_the_jobs_own_set(layers: dict[str, Path],
                                                                 tmp_path: Path) -> None:
    """`train` (fault limits, nan policy, ...): merged key by key like env, spelled as --set
    would spell them, and a job's --set wins."""
    from hpcshard.cli import request

    layers["site"].write_text('[defaults]\ntrain = { watchdog_floor_s = 30, nan_policy = "rollback", '
                              'compile = true }\n')
    layers["user"].write_text('[defaults]\ntrain = { watchdog_floor_s = 60 }\n')
    res = site.resolve(site.load())
    assert res.values["train"] == {"watchdog_floor_s": "60", "nan_policy": "rollback", "compile": "true"}
    assert res.source("train.watchdog_floor_s").startswith("user ")
    req = request.new(res, JOB, nodes=1, backend="local", run_dir=tmp_path / "r",
                      sets=("nan_policy=stop",))
    assert req.spec.sets == {"watchdog_floor_s": "60", "nan_policy": "stop", "compile": "true"}


def test_an_unknown_training_setting_in_a_profile_is_one_line(layers: dict[str, Path],
                                                             tmp_path: Path) -> None:
    layers["site"].write_text("[defaults]\ntrain = { watchdog_flor_s = 30 }\n")
    code, out = invoke("submit", JOB, "--backend", "local", "--run-dir", str(tmp_path / "r"))
    one_line_error(code, out, "watchdog_flor_s", "watchdog_floor_s", str(layers["site"]))
    assert not (tmp_path / "r").exists()


def test_a_profiles_secrets_are_named_in_the_script_and_their_values_never_written(
        layers: dict[str, Path], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    layers["site"].write_text('[profiles.p]\nsecrets = ["HF_TOKEN", "WANDB_API_KEY"]\n'
                              'env = { NCCL_DEBUG = "WARN" }\n')
    planted = "hf_planted" + "Zq7" * 10
    monkeypatch.setenv("HF_TOKEN", planted)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    code, out = invoke("render", JOB, "--profile", "p")
    one_line_error(code, out, "WANDB_API_KEY is not set in your environment", "profile 'p' names it",
                   "export WANDB_API_KEY first")
    monkeypatch.setenv("WANDB_API_KEY", planted[::-1])
    code, out = invoke("render", JOB, "--profile", "p", "--run-dir", str(tmp_path / "r"))
    assert code == 0, out
    assert planted not in out and planted[::-1] not in out
    assert ': "${HF_TOKEN:?the secret HF_TOKEN is not in the environment of the job' in out
    assert "export NCCL_DEBUG=WARN" in out
    layers["site"].write_text('[profiles.p]\nsecrets = ["HF_TOKEN"]\nenv = { HF_TOKEN = "x" }\n')
    code, out = invoke("render", JOB, "--profile", "p")
    one_line_error(code, out, "HF_TOKEN is both a secret and an env value of profile 'p'", "drop it from env")
    layers["site"].write_text('[profiles.p]\nsecrets = ["HF-TOKEN"]\n')
    code, out = invoke("render", JOB, "--profile", "p")
    one_line_error(code, out, "secrets: 'HF-TOKEN' is not a valid environment variable name")


def test_resuming_a_slurm_run_checks_its_secrets_again(monkeypatch: pytest.MonkeyPatch,
                                                       tmp_path: Path) -> None:
    """The resumed job takes the secrets from the environment `resume` runs in: one missing
    is one line before Slurm is asked anything."""
    from hpcshard.rundir.spec import RunSpec
    from hpcshard.slurm.sbatch import SbatchRequest

    run = tmp_path / "r"
    run.mkdir()
    recorded = SbatchRequest(job_name="r", nodes=1, gpus_per_node=1, secrets=["HF_TOKEN"]).record()
    RunSpec(job=JOB, sets={}, nodes=1, gpus=1, backend="slurm", name="r", profile="p", jobs=["77"],
            slurm=recorded).write(run)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no Slurm command is run
    code, out = invoke("resume", str(run))
    one_line_error(code, out, "HF_TOKEN is not set in your environment", "profile 'p' names it")


def test_the_settings_reference_in_the_docs_is_generated_from_the_config_classes() -> None:
    """docs/user/settings.md holds the `--set` keys as `markdown_reference` writes them; a
    field added, renamed or re-documented without refreshing the page fails here."""
    import os

    from hpcshard.config import TrainConfig, markdown_reference
    from hpcshard.runtime.data import DataConfig
    from hpcshard.sections import SECTIONS
    from tests.conftest import ROOT

    page = ROOT / "docs" / "user" / "settings.md"
    text, tables = page.read_text(), markdown_reference(TrainConfig, DataConfig, sections=SECTIONS)
    first = text.index("## `")  # (the prose above the tables is written by hand)
    if os.environ.get("HPCSHARD_REFRESH_GOLDEN"):
        page.write_text(text[:first] + tables)
        text = page.read_text()
    assert text[first:] == tables, ("docs/user/settings.md is stale; refresh with: "
                                    "HPCSHARD_REFRESH_GOLDEN=1 python -m pytest tests/unit/test_site.py")
