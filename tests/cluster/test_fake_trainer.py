"""The e2e tests' stand-in trainer must itself be sound: two ranks suspended at the same moment
each save their own state and exit 75. Both once wrote through one shared ``low.state.tmp``
(``with_suffix``), so a rank's ``os.replace`` could find the file gone and exit 1 — a preemption
test failed on a loaded machine with "suspended, exit code 1"."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

TRAINER = str(Path(__file__).with_name("fake_trainer.py"))
STUB = "def get_whole_life_state():\n    return 0\n\n\ndef set_whole_life_state(value):\n    pass\n"


def test_two_ranks_suspended_at_once_each_save_their_own_state(tmp_path):
    pkg = tmp_path / "stub" / "luban" / "cluster"  # the SDK without a service: only the two calls it makes
    pkg.mkdir(parents=True)
    (pkg.parent / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text(STUB)
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "stub"), LUBAN_NNODES="2", LUBAN_MASTER_ADDR="127.0.0.1",
               LUBAN_MASTER_PORT="1")
    for trial in range(8):  # the old shared temporary file failed about 3 trials in 4
        state = tmp_path / f"t{trial}" / "low.state"
        state.parent.mkdir()
        logs = [state.parent / f"rank{r}.log" for r in range(2)]
        files = [log.open("w") for log in logs]
        ranks = [subprocess.Popen([sys.executable, TRAINER, str(state), "1000000", "--sleep", "0.0005"],
                                  env=dict(env, LUBAN_NODE_RANK=str(r)), stdout=f,
                                  stderr=subprocess.STDOUT) for r, f in enumerate(files)]
        try:
            deadline = time.monotonic() + 60  # "step 1" comes after the handler is installed
            while not all("step 1\n" in log.read_text() for log in logs):
                assert time.monotonic() < deadline and all(p.poll() is None for p in ranks), \
                    [log.read_text() for log in logs]
                time.sleep(0.05)
            for p in ranks:
                p.send_signal(signal.SIGUSR1)
            for p in ranks:
                p.wait(timeout=60)
        finally:
            for p, f in zip(ranks, files):
                p.kill()
                p.wait(timeout=60)
                f.close()
        outs = [log.read_text() for log in logs]
        assert [p.returncode for p in ranks] == [75, 75], outs
        for r in range(2):
            saved = int(Path(f"{state}.rank{r}").read_text())
            assert f"checkpoint at step {saved}" in outs[r]
