"""Site, user and project configuration, and the profiles they name (login node, stdlib only).

Layers, each optional, later wins:

    built-in defaults < site file < user file < project file < command line

    site     $HPCSHARD_SITE, else /etc/hpcshard/site.toml   (the cluster's admins)
    user     $XDG_CONFIG_HOME/hpcshard/config.toml, else ~/.config/hpcshard/config.toml
    project  ./hpcshard.toml                                 (checked in beside the code)

Every file has the same shape:

    profile = "a100"                   # the profile used when --profile is not given
    template_dirs = ["templates"]      # searched before the built-in templates (relative to the file)
    [defaults]                         # settings for every profile
    account = "ml-research"
    [profiles.a100]                    # a named set of settings
    partition = "gpu"

Within a layer the profile's settings apply after the layer's [defaults]; the next layer
then applies on top of both. `env` and `vars` merge key by key; every other setting is
replaced whole. Each value remembers where it came from (`hpcshard config show`).
"""

from __future__ import annotations

import contextlib
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpcshard.rundir.rankenv import short_name
from hpcshard.site.settings import (
    CONTAINER_KEYS,
    CONTAINER_RUNTIMES,
    MERGED,
    SETTINGS,
    TOP_KEYS,
)
from hpcshard.slurm.time import parse_time

SITE_FILE = Path("/etc/hpcshard/site.toml")
PROJECT_FILE = "hpcshard.toml"


@dataclass(frozen=True)
class Layer:
    """One configuration file (or the built-in defaults, or the command line)."""

    kind: str
    """built-in, site, user, project, command line."""
    path: Path | None
    profile: str
    template_dirs: tuple[Path, ...]
    defaults: dict[str, Any]
    profiles: dict[str, dict[str, Any]]

    def label(self, section: str = "") -> str:
        where = f"{self.kind} {self.path}" if self.path else self.kind
        return f"{where} [{section}]" if section else where


def _str_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _type_error(where: str, key: str, want: str, value: Any) -> ValueError:
    return ValueError(f"{where}: {key} must be {want}, not {type(value).__name__} {value!r}")


def _check_setting(where: str, key: str, value: Any) -> Any:
    """The value, type-checked (env scalars become strings); ValueError naming file and key."""
    if key not in SETTINGS:
        raise ValueError(f"{where}: unknown key {key!r}; valid keys: {', '.join(SETTINGS)}")
    setting = SETTINGS[key]
    if setting.kind == "str" and not isinstance(value, str):
        raise _type_error(where, key, "a string", value)
    if setting.kind == "int" and (not isinstance(value, int) or isinstance(value, bool)):
        raise _type_error(where, key, "an integer", value)
    if setting.kind == "list" and not _str_list(value):
        raise _type_error(where, key, "a list of strings", value)
    if setting.kind in ("env", "vars", "container", "sets") and not isinstance(value, dict):
        raise _type_error(where, key, "a table", value)
    if setting.kind == "sets":  # as --set spells them: true/false, numbers, strings
        bad = {k: v for k, v in value.items() if not isinstance(v, str | int | float | bool)}
        if bad:
            name, v = next(iter(bad.items()))
            raise _type_error(where, f"{key}.{name}", "a string, number or boolean", v)
        value = {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in value.items()}
    if setting.kind == "env":
        bad = {k: v for k, v in value.items() if isinstance(v, bool) or not isinstance(v, str | int | float)}
        if bad:
            name, v = next(iter(bad.items()))
            raise _type_error(where, f"env.{name}", "a string or number (quote booleans)", v)
        value = {k: str(v) for k, v in value.items()}
    if setting.kind == "container":
        value = _check_container(where, value)
    if key in ("signal", "script_signal") and value != "none":  # usr2, SIGUSR2 -> USR2
        with contextlib.suppress(ValueError):  # the setting's own check says what is accepted
            value = short_name(value)
    try:
        setting.validate(value)
    except ValueError as err:
        raise ValueError(f"{where}: {key} = {value!r}: {err}") from None
    return value


def _check_container(where: str, value: dict[str, Any]) -> dict[str, Any]:
    for key, v in value.items():
        if key not in CONTAINER_KEYS:
            raise ValueError(f"{where}: unknown key 'container.{key}'; valid keys: "
                             + ", ".join(CONTAINER_KEYS))
        kind = CONTAINER_KEYS[key]
        if kind == "str" and not isinstance(v, str):
            raise _type_error(where, f"container.{key}", "a string", v)
        if kind == "list" and not _str_list(v):
            raise _type_error(where, f"container.{key}", "a list of strings", v)
    if value and value.get("runtime") not in CONTAINER_RUNTIMES:
        raise ValueError(f"{where}: container.runtime = {value.get('runtime')!r}: use one of "
                         + ", ".join(CONTAINER_RUNTIMES))
    if value and not value.get("image"):
        raise ValueError(f"{where}: container.image is missing; name the image (pyxis: "
                         "registry#image:tag or a .sqsh file; apptainer: a .sif file)")
    return value


def read_layer(kind: str, path: Path) -> Layer:
    """One TOML file, validated; ValueError naming the file, the key and the valid keys."""
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as err:
        raise ValueError(f"{path}: not valid TOML: {err}") from None
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: not UTF-8 text (byte {err.start}); save it as UTF-8") from None
    except OSError as err:
        raise ValueError(f"{path}: cannot be read ({err.strerror}); fix it or point "
                         "HPCSHARD_SITE elsewhere") from None
    for key in data:
        if key not in TOP_KEYS:
            hint = " (settings go under [defaults] or [profiles.NAME])" if key in SETTINGS else ""
            raise ValueError(f"{path}: unknown key {key!r}{hint}; valid top-level keys: "
                             + ", ".join(TOP_KEYS))
    profile = data.get("profile", "")
    if not isinstance(profile, str):
        raise _type_error(str(path), "profile", "a string", profile)
    dirs = data.get("template_dirs", [])
    if not _str_list(dirs):
        raise _type_error(str(path), "template_dirs", "a list of strings", dirs)
    defaults = data.get("defaults", {})
    if not isinstance(defaults, dict):
        raise _type_error(str(path), "defaults", "a table", defaults)
    defaults = {k: _check_setting(f"{path} [defaults]", k, v) for k, v in defaults.items()}
    profiles = data.get("profiles", {})
    if not isinstance(profiles, dict):
        raise _type_error(str(path), "profiles", "a table of profiles", profiles)
    checked: dict[str, dict[str, Any]] = {}
    for name, body in profiles.items():
        if not isinstance(body, dict):
            raise _type_error(str(path), f"profiles.{name}", "a table", body)
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name):
            raise ValueError(f"{path}: profile name {name!r} is not valid; use letters, digits, . _ -")
        checked[name] = {k: _check_setting(f"{path} [profiles.{name}]", k, v) for k, v in body.items()}
    base = path.resolve().parent
    return Layer(kind, path, profile, tuple(_expand(d, base) for d in dirs), defaults, checked)


def _expand(text: str, base: Path) -> Path:
    path = Path(os.path.expandvars(os.path.expanduser(text)))
    return path if path.is_absolute() else base / path


def files(environ: Mapping[str, str] | None = None, cwd: Path | None = None) -> list[tuple[str, Path]]:
    """The configuration files that exist, lowest precedence first."""
    env = os.environ if environ is None else environ
    found: list[tuple[str, Path]] = []
    site = env.get("HPCSHARD_SITE")
    if site:  # set: it must exist (an empty value means "no site file")
        path = Path(site)
        if path.is_dir():
            path = path / "site.toml"
        if not path.is_file():
            raise ValueError(f"HPCSHARD_SITE={site!r}: no such file; point it at the site's "
                             "site.toml, or unset it")
        found.append(("site", path))
    elif site is None and SITE_FILE.is_file():
        found.append(("site", SITE_FILE))
    xdg = env.get("XDG_CONFIG_HOME") or str(Path(env.get("HOME", "~")).expanduser() / ".config")
    user = Path(xdg) / "hpcshard" / "config.toml"
    if user.is_file():
        found.append(("user", user))
    project = (cwd or Path.cwd()) / PROJECT_FILE
    if project.is_file():
        found.append(("project", project))
    return found


def builtin() -> Layer:
    return Layer("built-in", None, "", (), {k: s.default for k, s in SETTINGS.items()}, {})


def load(environ: Mapping[str, str] | None = None, cwd: Path | None = None) -> list[Layer]:
    """The built-in defaults and every configuration file, lowest precedence first."""
    return [builtin(), *(read_layer(kind, path) for kind, path in files(environ, cwd))]


@dataclass
class Resolved:
    """The merged settings for one profile, and where each came from."""

    profile: str
    values: dict[str, Any]
    origin: dict[str, str]
    """setting (or env.NAME / vars.NAME) -> the layer that set it."""
    template_dirs: list[Path] = field(default_factory=list)
    """Site template directories, highest precedence first (the built-in ones come last)."""
    template_dirs_origin: list[str] = field(default_factory=list)

    def source(self, key: str) -> str:
        return self.origin.get(key, "built-in")


def profile_names(layers: list[Layer]) -> dict[str, list[Layer]]:
    names: dict[str, list[Layer]] = {}
    for layer in layers:
        for name in layer.profiles:
            names.setdefault(name, []).append(layer)
    return names


def resolve(layers: list[Layer], profile: str | None = None,
            cli: Mapping[str, Any] | None = None) -> Resolved:
    """Merge the layers (and the command line's values that are not None) for one profile.

    The profile is --profile, else the last layer's `profile =`; no profile is fine when
    no layer names one."""
    chosen = profile or next((layer.profile for layer in reversed(layers) if layer.profile), "")
    known = profile_names(layers)
    if chosen and chosen not in known:
        named_by = "" if profile else " (named by {})".format(next(
            layer.label() for layer in reversed(layers) if layer.profile == chosen))
        listing = ", ".join(sorted(known)) if known else "none (no site, user or project file defines any)"
        raise ValueError(f"profile {chosen!r}{named_by} does not exist; profiles: {listing}")
    values: dict[str, Any] = {}
    origin: dict[str, str] = {}

    def apply(settings: Mapping[str, Any], label: str) -> None:
        for key, value in settings.items():
            if key in MERGED:
                values[key] = {**values.get(key, {}), **value}
                origin.update({f"{key}.{k}": label for k in value})
            else:
                values[key] = value
                origin[key] = label

    for layer in layers:
        apply(layer.defaults, layer.label("defaults") if layer.path else layer.label())
        if chosen in layer.profiles:
            apply(layer.profiles[chosen], layer.label(f"profiles.{chosen}"))
    if cli:
        apply({k: v for k, v in cli.items() if v is not None}, "command line")
    for key in MERGED:
        origin.pop(key, None)
    dirs, dirs_origin = [], []
    for layer in reversed(layers):
        for d in layer.template_dirs:
            dirs.append(d)
            dirs_origin.append(layer.label())
    res = Resolved(chosen, values, origin, dirs, dirs_origin)
    check(res)
    return res


def check(res: Resolved) -> None:
    """Checks across settings (each alone was checked where it was read)."""
    v = res.values
    if v["max_time"] and parse_time(v["time"]) > parse_time(v["max_time"]):
        raise ValueError(f"time {v['time']} (from {res.source('time')}) is longer than the "
                         f"{v['max_time']} that {_who(res)} allows (max_time, from "
                         f"{res.source('max_time')}); ask for less with --time")


def _who(res: Resolved) -> str:
    return f"profile {res.profile!r}" if res.profile else "the configuration"


def storage_root(res: Resolved) -> Path:
    text = res.values["storage_root"]
    path = os.path.expandvars(os.path.expanduser(text))
    unset = re.findall(r"\$\{?(\w+)", path)
    if unset:
        raise ValueError(f"storage_root {text!r} (from {res.source('storage_root')}) names "
                         f"${unset[0]}, which is not set here; set it, or give --run-dir")
    return Path(path)


def show_value(value: Any) -> str:
    if isinstance(value, list):
        return "; ".join(value) if value else "-"
    if isinstance(value, dict):
        return " ".join(f"{k}={show_value(v)}" for k, v in value.items()) if value else "-"
    return str(value) if value != "" else "-"


def rows(res: Resolved) -> list[tuple[str, str, str]]:
    """(setting, value, source) for `config show` and `profiles show`."""
    out: list[tuple[str, str, str]] = []
    for key in SETTINGS:
        value = res.values[key]
        if key in MERGED and value:
            out.extend((f"{key}.{k}", str(v), res.source(f"{key}.{k}")) for k, v in value.items())
        else:
            out.append((key, show_value(value), res.source(key)))
    return out
