"""Site, user and project configuration, and the profiles they name (login node, stdlib).

`settings` is the registry of what can be set; `layers` reads the files and merges them
(built-in < site < user < project < command line) with provenance. The names below are
the package's interface; `hpcshard.site.SETTINGS` is what the admin guide is made from.
"""

from hpcshard.site.layers import (
    PROJECT_FILE,
    SITE_FILE,
    Layer,
    Resolved,
    builtin,
    files,
    load,
    profile_names,
    read_layer,
    resolve,
    rows,
    show_value,
    storage_root,
)
from hpcshard.site.settings import BACKENDS, SETTINGS, Setting

__all__ = ["BACKENDS", "PROJECT_FILE", "SETTINGS", "SITE_FILE", "Layer", "Resolved", "Setting",
           "builtin", "files", "load", "profile_names", "read_layer", "resolve", "rows",
           "show_value", "storage_root"]
