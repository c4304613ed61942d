"""A suspend signal during a start-up that does not end, a hostile review of 2026-12-04.

``luban train`` turns SIGTERM (SIGUSR1, a first SIGINT) into "finish the step, checkpoint, exit
75"; one during start-up (before the first step: nothing to save) was answered only when the
start-up reached the first step's check. A start-up of minutes (``model.layers = 65536``: still
building 90 s after a ``timeout 200``'s SIGTERM, at 6.4 GB) kept ``timeout`` and ``kill`` waiting
for all of it, or forever. The process now ends itself with 75 ``preempt.START_GRACE_S`` after
such a signal. A second Ctrl-C ended the process at once (130) without a word: it says
``luban: interrupted`` now, as every other command does.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

from luban.train import preempt
from tests.child import Child
from tests.conftest import tiny_toml

ROOT = Path(__file__).resolve().parents[2]

# ``python -m luban ...`` as the interpreter runs it, whose start-up signals itself and then never
# ends (a model that takes hours to build): at the first import of luban.train.trainer, which
# ``luban train`` makes after its suspend handlers are in
STALLED = r'''
import os, runpy, signal, sys, time
signals, seen = [int(s) for s in sys.argv[1].split(",")], []
def hook(event, args):
    if event == "import" and args[0] == "luban.train.trainer" and not seen:
        seen.append(args[0])
        for sig in signals:
            os.kill(os.getpid(), sig)
        while True:
            time.sleep(3600)
sys.addaudithook(hook)
sys.argv = ["-m", *sys.argv[2:]]
runpy._run_module_as_main("luban")
'''


@pytest.mark.parametrize("signals, code, said", [
    ([signal.SIGTERM], 75, f"luban: suspended on SIGTERM during start-up, which had not ended "
                           f"{preempt.START_GRACE_S:g} s later; nothing to save; exit 75"),
    ([signal.SIGUSR1, signal.SIGTERM], 75, "luban: suspended on SIGTERM during start-up"),
    ([signal.SIGINT, signal.SIGINT], 130, "luban: interrupted"),
])
def test_a_signal_during_a_start_up_that_does_not_end_ends_the_run(tmp_path, signals, code, said):
    config = tmp_path / "c.toml"
    config.write_text(tiny_toml(tmp_path / "run", {"steps": 2, "global_batch": 2, "eval_every": 0}))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LUBAN_CACHE": str(tmp_path / "cache")}
    with Child([sys.executable, "-c", STALLED, ",".join(str(int(s)) for s in signals), "train", config],
               env=env, cwd=ROOT) as child:
        assert child.wait(120) == code, child.tail()  # it waited forever
        out = child.output()
    assert said in out and "Traceback" not in out, out[-3000:]


# a rank (of luban's launcher) signalled during start-up whose peer ended its start-up first (its grace
# over): the collective it waits in raises "peer lost"; it exited 1, and the launcher with it
PEER_GONE = r'''
import os, signal, sys
import luban.train.cli as train_cli

def peer_gone(args):
    os.kill(os.getpid(), signal.SIGTERM)  # forwarded by the launcher: recorded, start-up goes on
    raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer")
train_cli.cmd_train = peer_gone
sys.argv = ["luban", "train"]
from luban.cli import main
sys.exit(main())
'''


def test_a_rank_that_loses_its_peer_during_a_signalled_start_up_exits_75(tmp_path):
    from luban import procs

    env = {**os.environ, "PYTHONPATH": str(ROOT), procs.PARENT_VAR: str(os.getpid())}
    with Child([sys.executable, "-c", PEER_GONE], env=env, cwd=ROOT) as child:
        assert child.wait(60) == 75, child.tail()
        assert "Traceback" not in child.output(), child.tail()


# a demo's launcher: its ranks ran (the first half, then the second), now it samples; a SIGTERM there
# set off the start-up grace of the launcher's own flag (never marked over) and ended it 75 "during
# start-up" with the run finished
AFTER_LAUNCH = r'''
import os, signal, sys, time
from luban.train import preempt
preempt.install()
from luban.parallel.launch import launch
assert launch(["--help"], nproc=1, module="json.tool") == 0
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(preempt.START_GRACE_S + 2)
print("sampled")
'''


def test_a_signal_after_the_ranks_ran_does_not_end_the_launcher_as_a_start_up():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with Child([sys.executable, "-c", AFTER_LAUNCH], env=env, cwd=ROOT) as child:
        assert child.wait(120) == 0, child.tail()
        assert "sampled" in child.output() and "during start-up" not in child.output(), child.tail()
