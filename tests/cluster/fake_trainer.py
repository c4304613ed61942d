"""A stand-in for a trainer: counts steps, checkpoints the counter on SIGUSR1 and exits 75.

Usage: fake_trainer.py STATE_PREFIX STEPS [--sleep S] [--mode signal|poll|ignore]
  signal: SIGUSR1 -> save the step to the state file, record it as whole-life state, exit 75
  poll:   ignore SIGUSR1; poll receive_suspend_command(), save, call go_suspend(), wait
  ignore: ignore SIGUSR1 entirely (the scheduler must kill it after the deadline)
Rank R keeps its counter in STATE_PREFIX.rankR and resumes from it on start. Every step is
printed, so the log shows the resume point.
"""

import argparse
import os
import signal
import sys
import time
from pathlib import Path

parser = argparse.ArgumentParser()
parser.add_argument("state", type=Path)
parser.add_argument("steps", type=int)
parser.add_argument("--sleep", type=float, default=0.1)
parser.add_argument("--mode", default="signal", choices=["signal", "poll", "ignore"])
args = parser.parse_args()
args.state = Path(f"{args.state}.rank{os.environ['LUBAN_NODE_RANK']}")

import luban.cluster as sdk  # noqa: E402 - after argument parsing, like a real script

step = int(args.state.read_text()) if args.state.exists() else 0
print(f"start: resumed at step {step}, whole-life state {sdk.get_whole_life_state()}, "
      f"rank {os.environ['LUBAN_NODE_RANK']} of {os.environ['LUBAN_NNODES']}, master {os.environ['LUBAN_MASTER_ADDR']}:"
      f"{os.environ['LUBAN_MASTER_PORT']}", flush=True)
asked = False


def on_usr1(signum, frame):
    global asked
    asked = True


def checkpoint():
    tmp = args.state.with_name(args.state.name + ".tmp")  # per rank: with_suffix would give every rank one file
    tmp.write_text(str(step))
    os.replace(tmp, args.state)
    if os.environ["LUBAN_NODE_RANK"] == "0":
        sdk.set_whole_life_state(step)
    print(f"checkpoint at step {step}", flush=True)


signal.signal(signal.SIGUSR1, on_usr1 if args.mode == "signal" else signal.SIG_IGN)
while step < args.steps:
    if args.mode == "signal" and asked:
        checkpoint()
        sys.exit(75)
    if args.mode == "poll" and sdk.receive_suspend_command():
        checkpoint()
        sdk.go_suspend()
        while True:
            time.sleep(1)
    time.sleep(args.sleep)
    step += 1
    print(f"step {step}", flush=True)
print(f"done at step {step}", flush=True)
