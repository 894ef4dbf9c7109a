"""On PYTHONPATH for one test only (tests/distributed/test_profile.py): torch.profiler's
trace export takes SLOW_EXPORT_S seconds, as a large trace on busy shared storage does."""

import os

_SLOW = float(os.environ.get("SLOW_EXPORT_S", "0") or 0)
if _SLOW:
    import time

    import torch.profiler

    _export = torch.profiler.profile.export_chrome_trace

    def export_chrome_trace(self, path):  # type: ignore[no-untyped-def]
        time.sleep(_SLOW)
        return _export(self, path)

    torch.profiler.profile.export_chrome_trace = export_chrome_trace  # type: ignore[method-assign,assignment]
