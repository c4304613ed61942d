"""A rank process for test_launch: behaviour chosen by argv[1] (env | suspend | fail | join)."""

import json
import os
import signal
import sys
import time
from pathlib import Path

mode, out = sys.argv[1], Path(sys.argv[2])
rank = int(os.environ["RANK"])
if mode == "env":
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS")
    (out / f"env{rank}.json").write_text(json.dumps({k: os.environ[k] for k in keys}))
    sys.exit(0)
if mode == "suspend":  # exit 75 on SIGUSR1, like the trainer after saving a checkpoint
    signal.signal(signal.SIGUSR1, lambda *_: sys.exit(75))
    (out / f"ready{rank}").touch()
    time.sleep(3600)  # the test fails on its bound unless a signal or the launcher ends this
    sys.exit(0)
if mode == "fail":  # rank 1 crashes once rank 0 runs; rank 0 would hang forever
    (out / f"ready{rank}").touch()
    if rank == 1:
        # on a loaded machine rank 0 may start seconds later: crashing before it is up let the
        # launcher end it before it wrote ready0, and the test saw no running rank to be killed
        deadline = time.monotonic() + 300
        while not (out / "ready0").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        sys.exit(3)
    time.sleep(3600)  # the test fails on its bound unless a signal or the launcher ends this
if mode == "join":  # a rank of luban's (the suspend handlers in) joining a rendezvous no other rank comes to
    from luban.parallel.launch import init_distributed
    from luban.train import preempt

    preempt.install()
    import torch.distributed  # noqa: F401 - loaded: ready means about to join

    (out / f"ready{rank}").touch()
    init_distributed("cpu")  # blocks up to torch's 30-minute timeout: the test's bound fails first
    sys.exit(0)
