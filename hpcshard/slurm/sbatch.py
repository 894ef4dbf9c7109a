"""The sbatch script: a validated request rendered through a jinja2 template (login node).

`render` returns the text; `hpcshard render` prints it and `hpcshard submit` hands the very
same text to Slurm through submitit. Every user value reaches the script shell-quoted
(sbatch parses #SBATCH lines with shell quoting too); values that would break a line-based
directive (newlines, control characters) are refused.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Collection, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpcshard.rundir.paths import RunPaths
from hpcshard.rundir.rankenv import NOTICE, signal_name
from hpcshard.slurm.time import parse_mem, parse_time

if TYPE_CHECKING:  # jinja2 is imported when a template is rendered, not with the module
    import jinja2

# The top-level templates/ in a source tree (hpcshard/templates links to it); the package's
# own copy in an installed wheel.
BUILTIN_TEMPLATES = (Path(__file__).parents[1] / "templates").resolve()
DEFAULT_TEMPLATE = "sbatch.j2"

def _single_line(name: str, value: str) -> None:
    if any(ord(ch) < 32 or ord(ch) == 127 for ch in value):
        raise ValueError(f"{name}={value!r} contains a newline or control character; "
                         "an sbatch directive is one line")


@dataclass(kw_only=True)
class SbatchRequest:
    """Everything the template needs. Paths are absolute: the job starts elsewhere."""

    job_name: str
    nodes: int
    gpus_per_node: int
    time: str = "01:00:00"
    """Slurm time limit."""
    partition: str = ""
    account: str = ""
    qos: str = ""
    constraint: str = ""
    cpus_per_task: int = 0
    """CPUs for each node's launcher and its ranks; 0 lets Slurm decide."""
    mem: str = ""
    """Memory per node, e.g. 200G; empty lets Slurm decide."""
    requeue: bool = True
    """--requeue in sbatch (off for the chain and none policies)."""
    no_kill: bool = False
    """--no-kill: the allocation outlives a failed node (spares or min_nodes: the job goes
    on inside it without the node)."""
    exclude: list[str] = field(default_factory=list)
    """Nodes the run declared bad: never given to it again."""
    signal: str = NOTICE
    """The preemption notice; the ranks checkpoint on it."""
    signal_lead_s: int = 120
    """Seconds before the time limit that the notice comes (it must cover a save)."""
    run_dir: Path = Path(".")
    modules: list[str] = field(default_factory=list)
    """Environment modules loaded first (quoted)."""
    env: dict[str, str] = field(default_factory=dict)
    """Variables exported before the launch (quoted)."""
    setup: list[str] = field(default_factory=list)
    """Shell lines run before the launch (a site's own): not quoted."""
    secrets: list[str] = field(default_factory=list)
    """Variables the job takes from the submitting environment: named in the script (a
    check that each arrived), their values never written."""
    container: dict[str, Any] = field(default_factory=dict)
    """runtime (pyxis|apptainer), image, mounts, workdir, options; empty: no container."""
    python: str = ""
    """The interpreter on the compute nodes; empty: the one submitting."""
    template: str = DEFAULT_TEMPLATE
    template_dirs: list[str] = field(default_factory=list)
    """Site template directories, searched before the built-in ones."""
    vars: dict[str, Any] = field(default_factory=dict)
    """A site template's own variables (from the profile)."""
    array: str = ""
    """A sweep's job array, `0-N%M` (--array); each task's run directory is
    RUN_DIR/task-INDEX. Empty: one job."""
    dependency: str = ""
    """Slurm's --dependency, `KIND:JOB[:JOB...]` (`submit --after`, a `--then` job's);
    empty: none. Not kept for `resume`: the dependency was met by then."""

    @classmethod
    def from_settings(cls, v: Mapping[str, Any], template_dirs: Sequence[Path | str], *,
                      job_name: str, nodes: int, gpus: int, run_dir: Path, spares: int = 0,
                      min_nodes: int = 0) -> SbatchRequest:
        """The request that merged settings (a profile, the files, the options) describe:
        `nodes` plus `spares` nodes."""
        return cls(job_name=job_name, nodes=nodes + spares, gpus_per_node=gpus, time=v["time"],
                   no_kill=spares > 0 or 0 < min_nodes < nodes,
                   partition=v["partition"], account=v["account"], qos=v["qos"],
                   constraint=v["constraint"], cpus_per_task=v["cpus_per_gpu"] * gpus,
                   mem=v["mem"], signal=v["signal"], signal_lead_s=v["signal_lead"],
                   requeue=v["requeue_policy"] == "requeue", run_dir=run_dir.resolve(),
                   modules=v["modules"], env=v["env"], setup=v["setup"], secrets=v["secrets"],
                   container=v["container"], python=v["python"], template=v["template"],
                   template_dirs=[str(d) for d in template_dirs], vars=v["vars"])

    def record(self) -> dict[str, Any]:
        """What `RunSpec.slurm` keeps of it (JSON: the run directory as a string)."""
        return {**asdict(self), "run_dir": str(self.run_dir)}

    @classmethod
    def recorded(cls, raw: Mapping[str, Any]) -> SbatchRequest | None:
        """A run's recorded request (`RunSpec.slurm`; None where it has none: the local
        backend). A key this version does not know (a newer one's) is dropped."""
        if not raw:
            return None
        known = {f.name for f in fields(cls)}
        kept = {k: v for k, v in raw.items() if k in known}
        try:
            return cls(**{**kept, "run_dir": Path(kept.get("run_dir", "."))})
        except TypeError as err:  # (a hand-edited spec.json)
            raise ValueError(f"the run's spec.json records an incomplete sbatch request ({err}); "
                             "restore its `slurm` object, or submit the job again") from None

    def validate(self) -> None:
        for name in ("job_name", "time", "partition", "account", "qos", "constraint", "mem"):
            _single_line(name, getattr(self, name))
        for node in self.exclude:
            _single_line("exclude", node)
        _single_line("run_dir", str(self.run_dir))
        if self.array and not re.fullmatch(r"0-\d+(%\d+)?", self.array):
            raise ValueError(f"array {self.array!r} is not 0-N or 0-N%M")
        if self.dependency and not re.fullmatch(r"after(ok|any|notok)(:\d+(_\d+)?)+", self.dependency):
            raise ValueError(f"dependency {self.dependency!r} is not KIND:JOB[:JOB...]")
        if self.mem:
            parse_mem(self.mem)
        limit = parse_time(self.time)
        if self.signal_lead_s >= limit:
            raise ValueError(f"the notice lead time ({self.signal_lead_s} s) is not shorter than the "
                             f"time limit --time {self.time} ({limit} s); lower --signal-lead or "
                             "raise --time")
        signal_name(self.signal)
        for key in [*self.env, *self.secrets]:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
                raise ValueError(f"environment variable name {key!r} is not valid")
        for name in ("image", "workdir"):
            _single_line(f"container.{name}", str(self.container.get(name, "")))
        for value in [*self.modules, *self.container.get("mounts", []),
                      *self.container.get("options", [])]:
            _single_line("a module, mount or container option", value)


PINS = {"ntasks-per-node": len("ntasks-per-n"), "tasks-per-node": len("tasks"), "ntasks": len("ntasks"),
        "use-min-nodes": len("use-")}
"""The sbatch options that hold a job of N-M nodes to N (name: its shortest prefix sbatch
takes for it). `--ntasks-per-node` (alias `--tasks-per-node`) without `--ntasks` makes sbatch
count N tasks; `--ntasks` counts them itself; `--use-min-nodes` says so."""
TOKEN = re.compile(r"""(?:[^\s"'#]|"[^"]*"|'[^']*')+""")
"""One option of an #SBATCH line: up to blank space or a comment, quotes kept whole."""


def _pins(token: str) -> bool | None:
    """Whether `token` is one of PINS (True), and None where its value is the next token."""
    if token.startswith("--"):
        name, eq, _ = token[2:].partition("=")
        full = next((f for f, least in PINS.items() if len(name) >= least and f.startswith(name)), None)
        if full is None:
            return False
        return True if eq or full == "use-min-nodes" else None
    if token.startswith("-n"):
        return True if len(token) > 2 else None
    return False


def _unpinned(line: str) -> str | None:
    """An #SBATCH line without its PINS options (their values too); None: nothing else was
    on it. The other options are left as written."""
    keep, drop_next, last = [], False, len("#SBATCH")
    for m in TOKEN.finditer(line, last):
        if line[last:m.start()].lstrip().startswith("#"):
            break  # (a comment: the rest of the line)
        pinned = _pins(m.group())
        if drop_next or pinned is not False:
            drop_next = pinned is None and not drop_next
        else:
            keep.append(m.group())
        last = m.end()
    if last == len("#SBATCH"):
        return line  # (no option on it)
    return line[:len("#SBATCH")] + "".join(f" {t}" for t in keep) + line[last:] if keep else None


def ranged_script(script: str) -> str:
    """A job script for a range of node counts (sbatch `--nodes=N-M`: a guard's), without
    the options that hold it to N (PINS). With `--ntasks-per-node=1` and no `--ntasks`,
    sbatch takes the task count to be N (the least node count times it) and Slurm then
    allocates N nodes however many are idle: measured on Slurm 22.05, `-N2-3
    --ntasks-per-node=1` got 2 of 5 idle nodes, `-N2-3` alone 3, and both 2 where only 2
    were usable. Without them Slurm's default is a task per node; the launch line names its
    own task count (`srun --nodes=$SLURM_JOB_NUM_NODES --ntasks=$SLURM_JOB_NUM_NODES`).
    Only the directives sbatch reads are changed: the #SBATCH lines before the script's
    first command; every other byte is kept (the script is read and written with
    surrogateescape by the caller)."""
    lines = script.splitlines(keepends=True)
    out = []
    for i, line in enumerate(lines):
        body = line.rstrip("\r\n")
        if body.strip() and not body.lstrip().startswith("#"):
            out.extend(lines[i:])  # (the first command: sbatch reads no directive past it)
            break
        if body.startswith("#SBATCH"):
            edited = _unpinned(body)
            if edited is None:
                continue
            line = edited + line[len(body):]
        out.append(line)
    return "".join(out)


def search_path(template_dirs: list[str] | list[Path]) -> list[Path]:
    return [*(Path(d) for d in template_dirs), BUILTIN_TEMPLATES]


def environment(template_dirs: list[str] | list[Path] | None = None) -> jinja2.Environment:
    """Templates from the site directories first, then the built-in ones; `builtin/NAME`
    is always the built-in one (a site's own sbatch.j2 extends "builtin/sbatch.j2")."""
    import jinja2

    loader = jinja2.ChoiceLoader([
        jinja2.FileSystemLoader([str(d) for d in search_path(template_dirs or [])]),
        jinja2.PrefixLoader({"builtin": jinja2.FileSystemLoader(str(BUILTIN_TEMPLATES))}),
    ])
    env = jinja2.Environment(loader=loader, undefined=jinja2.StrictUndefined,
                             keep_trailing_newline=True, autoescape=False)
    env.filters["q"] = lambda value: shlex.quote(str(value))
    return env


def template_names(template_dirs: list[str] | list[Path]) -> list[tuple[str, Path, bool]]:
    """(name, file, shadowed) for every template on the search path, first found wins."""
    seen: set[str] = set()
    out = []
    for folder in search_path(template_dirs):
        if not folder.is_dir():
            continue
        for path in sorted(folder.rglob("*.j2")):
            name = path.relative_to(folder).as_posix()
            out.append((name, path, name in seen))
            seen.add(name)
    return out


def load_template(env: jinja2.Environment, name: str) -> tuple[jinja2.Template, set[str]]:
    """The template, and every variable it (or a template it extends or includes) reads.
    ValueError for a missing template (naming the search path) or a syntax error (file
    and line)."""
    import jinja2
    import jinja2.meta

    used: set[str] = set()
    pending, done = [name], set()
    dirs = ", ".join(str(d) for d in env.loader.loaders[0].searchpath)  # type: ignore[union-attr]
    try:
        while pending:
            current = pending.pop()
            if current in done:
                continue
            done.add(current)
            assert env.loader is not None
            source, filename, _ = env.loader.get_source(env, current)
            tree = env.parse(source, current, filename)
            used |= jinja2.meta.find_undeclared_variables(tree)
            parents = [t for t in jinja2.meta.find_referenced_templates(tree) if t]
            if current in parents:
                raise ValueError(f"template {current!r} ({filename}) extends or includes itself; a "
                                 f'site template of the same name extends "builtin/{current}"')
            pending.extend(parents)
        return env.get_template(name), used
    except jinja2.TemplateNotFound as err:
        via = "" if err.name == name else f" (needed by template {name!r})"
        raise ValueError(f"template {err.name!r}{via} not found; searched: {dirs}") from None
    except jinja2.TemplateSyntaxError as err:
        raise ValueError(f"template {err.filename or err.name} line {err.lineno}: syntax error: "
                         f"{err.message}") from None


DERIVED = ("directives", "stdout", "stderr", "task_stdout", "task_stderr", "submitit_folder",
           "command")
"""What a template receives besides the request's fields and the profile's own vars."""


def received_names() -> set[str]:
    """Every name a template receives from hpcshard (a profile's vars must not shadow one)."""
    return {f.name for f in fields(SbatchRequest)} | set(DERIVED)


def render(req: SbatchRequest, command: str, folder: Path, settings: Collection[str] = ()) -> str:
    """The sbatch text. `command` and `folder` are submitit's: the srun line runs
    `submitit.core._submit` in every task, which calls hpcshard's per-node launcher.
    `settings`: the names of the site settings, for a clearer error when a template uses
    one that templates do not receive."""
    import jinja2

    req.validate()
    container = {"runtime": "", "image": "", "mounts": [], "workdir": "", "options": [],
                 **req.container}
    # An array task's logs go to its own run directory; its id is ARRAY_TASK (%A_%a).
    paths, job = (RunPaths(req.run_dir / "task-%a"), "%A_%a") if req.array else (RunPaths(req.run_dir), "%j")
    values: dict[str, Any] = {
        **asdict(req), **req.vars, "container": container,
        "directives": {k: getattr(req, k) for k in ("partition", "account", "qos", "constraint")},
        "stdout": str(paths.slurm_log(job, "out")), "stderr": str(paths.slurm_log(job, "err")),
        # submitit's own per-task log names (JobPaths without ids; a test holds them equal)
        "task_stdout": str(folder / f"{job}_%t_log.out"), "task_stderr": str(folder / f"{job}_%t_log.err"),
        "submitit_folder": str(folder), "command": command,
    }
    env = environment(req.template_dirs)
    template, used = load_template(env, req.template)
    missing = sorted(used - set(values) - set(env.globals))
    settings_only = [m for m in missing if m in settings]
    if settings_only:
        raise ValueError(f"template {req.template!r} ({template.filename}) uses "
                         f"{', '.join(map(repr, settings_only))}: a setting, but not one a template "
                         f"receives; templates get: {', '.join(sorted(values))}")
    if missing:
        raise ValueError(f"template {req.template!r} ({template.filename}) uses "
                         f"{', '.join(map(repr, missing))}, which no setting or profile defines; "
                         "define it under the profile's [profiles.NAME.vars], or drop it from the template")
    try:
        return template.render(**values)
    except jinja2.UndefinedError as err:  # e.g. an attribute of a variable that is missing
        raise ValueError(f"template {req.template!r} ({template.filename}): {err.message}") from None
    except RecursionError:
        raise ValueError(f"template {req.template!r} ({template.filename}) extends or includes "
                         "templates in a cycle; break the cycle") from None
    except Exception as err:  # the template's own expressions: {{ x / 0 }}, a bad filter call
        raise ValueError(f"template {req.template!r} ({template.filename}) failed while "
                         f"rendering: {type(err).__name__}: {err}") from None
