"""Rank program of ``test_resume_layouts``: for each layout, in one spawn of gloo ranks, train
straight through, then the same run suspended by a real SIGUSR1 on one rank and resumed with
``--resume auto`` semantics (``Trainer.train("auto")``). The test compares the run folders.

``python -m tests.train.resume_ranks CASES.json``: CASES is a list of ``{"name", "straight",
"split", "stop_at"}`` (the two runs' ``--set`` overrides; the split run is signalled after step
``stop_at``). A case without ``split`` trains ``straight`` only (test_async_checkpoint's
synchronous references: several runs in one spawn). A failing case writes
``<split (or straight) run.dir>/error.rank<R>.txt`` and ends the spawn.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path

import torch

from luban.config import load_config
from luban.train import preempt
from luban.train.preempt import SuspendFlag
from luban.train.trainer import Trainer


def run_case(case: dict, rank: int) -> None:
    Trainer(load_config(None, case["straight"])).train()
    if "split" not in case:
        return
    trainer = Trainer(load_config(None, case["split"]))
    agreed = SuspendFlag.agreed

    def signalled_after_step(flag):  # one rank gets SIGUSR1 after step ``stop_at``; the ranks agree as usual
        if rank == 0 and trainer.step == case["stop_at"] and not flag.requested:
            os.kill(os.getpid(), signal.SIGUSR1)
        return agreed(flag)

    SuspendFlag.agreed = signalled_after_step
    try:
        first = trainer.train()
    finally:
        SuspendFlag.agreed = agreed
        preempt.install().requested = False  # the process's flag: the next run starts unsignalled
    assert first.suspended and first.step == case["stop_at"], (first.suspended, first.step)
    second = Trainer(load_config(None, case["split"])).train("auto")
    assert not second.suspended, second


def main(cases_file: str) -> int:
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))
    for case in json.loads(Path(cases_file).read_text()):
        t0 = time.perf_counter()
        try:
            run_case(case, rank)
        except Exception:  # noqa: BLE001 - reported to the test, which names the case
            run_dir = load_config(None, case.get("split", case["straight"])).run.dir
            Path(run_dir).mkdir(parents=True, exist_ok=True)
            (Path(run_dir) / f"error.rank{rank}.txt").write_text(traceback.format_exc())
            print(f"[rank {rank}] {case['name']}: {traceback.format_exc()}", file=sys.stderr, flush=True)
            return 1
        if rank == 0:
            print(f"{case['name']}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
