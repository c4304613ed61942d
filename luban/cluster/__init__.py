"""luban's cluster platform: a time-sharing scheduler for whole nodes, its API, CLI and SDK.

Inside a job: ``receive_suspend_command()``, ``go_suspend()``, ``get_whole_life_state()`` and
``set_whole_life_state()``, ``report_run_dir()``; elsewhere ``Client`` talks to the service (see docs/platform.md).
"""

import importlib

# Imported when first used (PEP 562), not with the package: every `luban` process, training ranks
# included, imports luban.cluster.cli to build its command line, and the client pulls in httpx
# (~0.1 s of CPU) that only the cluster commands and the SDK use.
_EXPORTS = {"Client": "luban.cluster.client", "get_whole_life_state": "luban.cluster.sdk",
            "go_suspend": "luban.cluster.sdk", "receive_suspend_command": "luban.cluster.sdk",
            "report_run_dir": "luban.cluster.sdk", "set_whole_life_state": "luban.cluster.sdk"}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
