"""What admins configure and users inherit: `config show`, `profiles`, `templates`
(login node: click, jinja2 and the stdlib)."""

from __future__ import annotations

from pathlib import Path

import click

from hpcshard import site
from hpcshard.cli.common import table
from hpcshard.cli.options import PROFILE
from hpcshard.slurm import sbatch


@click.group("config")
def config() -> None:
    """The merged configuration (built-in < site < user < project < options)."""


@config.command("show")
@PROFILE
def config_show(profile: str | None) -> None:
    """Every setting, its value and the file (and section) it came from."""
    layers = site.load()
    res = site.resolve(layers, profile)
    click.echo("files (lowest precedence first):")
    for layer in layers[1:] or []:
        click.echo(f"  {layer.kind:<8} {layer.path}")
    if len(layers) == 1:
        click.echo("  none: built-in defaults only (site: $HPCSHARD_SITE or /etc/hpcshard/site.toml; "
                   "user: ~/.config/hpcshard/config.toml; project: ./hpcshard.toml)")
    click.echo(f"profile: {res.profile or '-'}\n")
    _settings(res)


def _settings(res: site.Resolved) -> None:
    table(("setting", "value", "from"), site.rows(res))
    dirs = [(str(d), o) for d, o in zip(res.template_dirs, res.template_dirs_origin, strict=True)]
    click.echo("\ntemplate path:")
    for folder, origin in [*dirs, (str(sbatch.BUILTIN_TEMPLATES), "built-in")]:
        missing = "" if Path(folder).is_dir() else "  (missing)"
        click.echo(f"  {folder}  [{origin}]{missing}")


@click.group("profiles")
def profiles() -> None:
    """The profiles the site, user and project files define."""


@profiles.command("list")
def profiles_list() -> None:
    """One line per profile: where it is defined and what it asks Slurm for."""
    layers = site.load()
    names = site.profile_names(layers)
    default = site.resolve(layers).profile
    rows = []
    for name in sorted(names):
        v = site.resolve(layers, name).values
        shape = f"{v['gpus_per_node']} GPU/node"
        rows.append(("*" if name == default else " ", name, v["partition"] or "-", shape,
                     v["time"] + (f" (max {v['max_time']})" if v["max_time"] else ""),
                     ", ".join(str(layer.path) for layer in names[name]),
                     v["description"]))
    if not rows:
        click.echo("no profiles: a site file ($HPCSHARD_SITE or /etc/hpcshard/site.toml) defines "
                   "them under [profiles.NAME]; see docs/admins.md")
        return
    table(("", "profile", "partition", "gpus", "time", "defined in", "description"), rows)


@profiles.command("show")
@click.argument("name")
def profiles_show(name: str) -> None:
    """The merged settings of profile NAME and where each came from."""
    res = site.resolve(site.load(), name)
    click.echo(f"profile: {name}\n")
    _settings(res)


@click.group("templates")
def templates() -> None:
    """sbatch templates on the search path (site directories first, then built-in)."""


@templates.command("list")
@PROFILE
def templates_list(profile: str | None) -> None:
    """Every template found, the directory it is in, and which one a profile uses."""
    res = site.resolve(site.load(), profile)
    rows = []
    for name, path, shadowed in sbatch.template_names(res.template_dirs):
        mark = "*" if name == res.values["template"] and not shadowed else " "
        rows.append((mark, name, "shadowed" if shadowed else "", str(path)))
    table(("", "template", "", "file"), rows)


@templates.command("show")
@click.argument("name")
@PROFILE
def templates_show(name: str, profile: str | None) -> None:
    """Print template NAME as the search path finds it (first its file, then its text)."""
    res = site.resolve(site.load(), profile)
    template, _ = sbatch.load_template(sbatch.environment(res.template_dirs), name)
    click.echo(f"# {template.filename}")
    click.echo(Path(str(template.filename)).read_text(), nl=False)
