"""The SDK: ``Client`` for every API operation, and the calls a running job makes about itself
(the executor sets LUBAN_CLUSTER_URL, LUBAN_CLUSTER_TOKEN and LUBAN_JOB_ID): poll for a suspend,
acknowledge it, and keep an integer "whole-life state" that survives suspends and restarts.
"""

from __future__ import annotations

import os

from luban.cluster.client import Client
from luban.errors import LubanError

__all__ = ["Client", "get_whole_life_state", "go_suspend", "receive_suspend_command", "report_run_dir",
           "set_whole_life_state"]

RETRY_FOR = 300.0  # seconds a job keeps retrying while the service restarts


def _job() -> tuple[Client, int]:
    job_id = os.environ.get("LUBAN_JOB_ID")
    if not job_id:
        raise LubanError("LUBAN_JOB_ID is not set: this is only available inside a job started by luban's scheduler")
    return Client(retry_for=RETRY_FOR), int(job_id)


def receive_suspend_command() -> bool:
    """True once the scheduler wants this job to checkpoint and suspend."""
    client, job_id = _job()
    return bool(client.call("GET", f"/jobs/{job_id}/suspend_command")["suspend"])


def go_suspend() -> None:
    """Acknowledge: the checkpoint is saved; the scheduler stops this attempt and requeues it."""
    client, job_id = _job()
    client.call("POST", f"/jobs/{job_id}/go_suspend")


def report_run_dir(path: str) -> None:
    """Tell the scheduler where this job's run writes ``metrics.jsonl`` (and ``plan.json``): the
    dashboard's job page draws its loss, tokens/s and MFU from there. ``luban train`` calls it."""
    client, job_id = _job()
    client.call("PUT", f"/jobs/{job_id}/run", json={"dir": str(path)})


def get_whole_life_state() -> int:
    client, job_id = _job()
    return int(client.call("GET", f"/jobs/{job_id}/whole_life_state")["value"])


def set_whole_life_state(value: int) -> None:
    client, job_id = _job()
    client.call("PUT", f"/jobs/{job_id}/whole_life_state", json={"value": int(value)})
