"""luban's cluster platform: a time-sharing scheduler for whole nodes, its API, CLI and SDK.

Inside a job: ``receive_suspend_command()``, ``go_suspend()``, ``get_whole_life_state()`` and
``set_whole_life_state()``, ``report_run_dir()``; elsewhere ``Client`` talks to the service (see docs/platform.md).
"""

from luban.cluster.client import Client
from luban.cluster.sdk import (get_whole_life_state, go_suspend, receive_suspend_command, report_run_dir,
                               set_whole_life_state)

__all__ = ["Client", "get_whole_life_state", "go_suspend", "receive_suspend_command", "report_run_dir",
           "set_whole_life_state"]
