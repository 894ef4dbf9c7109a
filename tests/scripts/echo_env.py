"""A plain script (no hpcshard, no torch): each rank writes what it was given."""

import json
import os
import sys
from pathlib import Path

out = Path(os.environ["HPCSHARD_RUN_DIR"]) / f"echo-{os.environ['RANK']}.json"
out.write_text(json.dumps({"argv": sys.argv, "name": __name__, "cwd": os.getcwd(),
                           "path0": sys.path[0],
                           "env": {k: v for k, v in os.environ.items()
                                   if k.startswith(("HPCSHARD_", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                    "MASTER_ADDR"))}}))
if os.environ.get("ECHO_FAIL"):
    print(f"rank {os.environ['RANK']} is about to fail", flush=True)
    raise RuntimeError("broken on purpose")
