"""Review of 2026-12-02 (e): the rendezvous port a cluster job gets.

The scheduler gave every job a ``MASTER_PORT`` from a ``bind(("", 0))``: a port in the kernel's
ephemeral range, where any outgoing connection (the job's own calls to the service, PostgreSQL's
clients, gloo) can take it as its source port before rank 0 listens on it. A fresh-clone CI run
failed so: ``--master-port = 37473: ... it is in use`` (test_luban_train_nproc2_inside_a_slurm_job).
The launcher had already moved below that range (``luban.parallel.launch.free_port``); the
scheduler now uses that one function.
"""

from __future__ import annotations

from luban.cluster import scheduler
from luban.parallel import launch


def test_a_job_s_rendezvous_port_comes_from_the_launcher_s_range():
    assert scheduler.free_port is launch.free_port
    low, high = launch.RENDEZVOUS_PORTS
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral = int(f.read().split()[0])
    for _ in range(20):
        assert low <= scheduler.free_port() < min(high, ephemeral)
