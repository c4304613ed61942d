"""The variables luban's scheduler gives a job: the one contract between the platform and a job.

The scheduler (``cluster.scheduler.Scheduler.job_env``) and the per-node launcher
(``cluster.launcher``) set them; ``luban train`` (``train/cli.py``) and the SDK read them. They are
luban's own names, not torchrun's: RANK/WORLD_SIZE/LOCAL_RANK mean "this process is a rank" to
torch and to ``luban train``, and a job's first process is a node's launcher, not a rank.

| variable | meaning |
|---|---|
| ``LUBAN_JOB_ID``, ``LUBAN_CHAIN_ID``, ``LUBAN_RESTART_COUNT`` | this attempt, its chain, attempts before it |
| ``LUBAN_NNODES`` | nodes of the job (whole nodes) |
| ``LUBAN_NODE_RANK`` | this node's index in ``LUBAN_NODES`` (0 = the rendezvous host) |
| ``LUBAN_NODES`` | the job's nodes, comma-separated, in rank order |
| ``LUBAN_GPUS_PER_NODE`` | GPUs of each node (0 on a CPU-only node) |
| ``LUBAN_MASTER_ADDR``, ``LUBAN_MASTER_PORT`` | the rendezvous address and a port free on it |
| ``LUBAN_JOB_TAG`` | the tag every process of the job carries (``luban.procs``) |
| ``LUBAN_CLUSTER_URL``, ``LUBAN_CLUSTER_TOKEN`` | the API and this attempt's own token (SDK) |
| ``LUBAN_WORKDIR``, ``LUBAN_NODE`` | working directory; this node's name |

Inside a job, ``luban train CONFIG`` with no --nproc starts one rank per GPU of the node (one on a
CPU node) and joins the other nodes' ranks through this rendezvous: n nodes x g GPUs = n*g ranks.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from luban import procs

NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")  # also the job spec's rule (cluster.spec.ENV_RE)

NNODES = "LUBAN_NNODES"
NODE_RANK = "LUBAN_NODE_RANK"
GPUS_PER_NODE = "LUBAN_GPUS_PER_NODE"
MASTER_ADDR = "LUBAN_MASTER_ADDR"
MASTER_PORT = "LUBAN_MASTER_PORT"
JOB_ID = "LUBAN_JOB_ID"


@dataclass(frozen=True)
class Rendezvous:
    nnodes: int
    node_rank: int
    gpus_per_node: int
    master_addr: str
    master_port: int

    @property
    def ranks_per_node(self) -> int:
        """One rank per GPU; one on a CPU-only node."""
        return max(1, self.gpus_per_node)


def rendezvous(env=os.environ) -> Rendezvous | None:
    """The job's rendezvous when this process runs inside a luban job (a launcher, not a rank)."""
    if NNODES not in env or JOB_ID not in env:
        return None
    return Rendezvous(int(env[NNODES]), int(env.get(NODE_RANK, "0")), int(env.get(GPUS_PER_NODE, "0")),
                      env.get(MASTER_ADDR, "127.0.0.1"), int(env.get(MASTER_PORT, "0")))


# never carried into a job from the submitter's or the service's environment: a token (the job
# gets its own), torchrun's "I am a rank" variables, and the variables the scheduler sets itself
NOT_INHERITED = ("LUBAN_CLUSTER_TOKEN", "LUBAN_CLUSTER_URL", "LUBAN_CLUSTER_DB", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                 "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT",
                 procs.PARENT_VAR, procs.TAG_VAR)
# the contract's names (the table above, and a group's directories, docs/platform.md): luban sets each
# for every job or, where it has none for a job (no group), leaves it out; never the submitter's
# environment nor a spec's env (a job submitted from inside another carried that job's LUBAN_NODE and
# LUBAN_GROUP_DATA_DIR into a job of no group)
OWN = (JOB_ID, "LUBAN_CHAIN_ID", "LUBAN_RESTART_COUNT", NNODES, NODE_RANK, "LUBAN_NODES", "LUBAN_NODE",
       GPUS_PER_NODE, MASTER_ADDR, MASTER_PORT, procs.TAG_VAR, "LUBAN_CLUSTER_URL", "LUBAN_CLUSTER_TOKEN",
       "LUBAN_WORKDIR", "LUBAN_GROUP", "LUBAN_GROUP_DATA_DIR", "LUBAN_GROUP_ENV_DIR")
# what every job's environment starts from (``base_environment``): PATH, a UTF-8 locale, and Python's output
# unbuffered, so that a job's prints reach its log (``luban logs -f``) as they are made, not at 8 KiB
MINIMAL = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8",
           "PYTHONUNBUFFERED": "1"}


def inheritable(env) -> dict[str, str]:
    """``env`` without secrets, rank variables and the job contract's own names (LUBAN_JOB_*, ...)."""
    return {k: v for k, v in without_own(env).items()
            if NAME_RE.fullmatch(k) and k not in NOT_INHERITED and not k.startswith(("LUBAN_JOB_", "LUBAN_CHAIN_"))}


def without_own(env) -> dict[str, str]:
    """``env`` less the contract's names (``OWN``): what a spec's ``env`` may give a job."""
    return {k: v for k, v in env.items() if k not in OWN}


def base_environment(spec: dict) -> dict[str, str]:
    """What a job's environment starts from, before the spec's ``env`` (with ``--export ALL``, the
    submitter's environment, ``luban submit`` sends it) and luban's variables: ``MINIMAL``, never the
    service's. It was the service's, scrubbed of luban's names only (a review of 2026-12-04): every job
    of every user read the admin's shell (a ``PGPASSWORD``, a cloud key, root's PATH)."""
    return dict(MINIMAL)
