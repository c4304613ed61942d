"""Per-node launcher: runs one rank of a job, forwards signals, records the exit code.

``python -m luban.cluster.launcher --run-dir D --log F [--rank R] -- CMD...`` starts CMD in a
process group of its own with NODE_RANK/RANK set, appends its output to F, forwards SIGUSR1,
SIGTERM and SIGINT to that group, and writes D/rank<R>.exit when CMD ends, so the service can
read the result even after a restart. With no --rank the rank is Slurm's SLURM_NODEID.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def exit_file(run_dir: Path, rank: int) -> Path:
    return run_dir / f"rank{rank}.exit"


def pgid_file(run_dir: Path, rank: int) -> Path:
    return run_dir / f"rank{rank}.pgid"


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="luban.cluster.launcher")
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--log", required=True, help="log file; {rank} is replaced by the rank")
    parser.add_argument("--rank", type=int, default=None)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    rank = args.rank if args.rank is not None else int(os.environ.get("SLURM_NODEID", "0"))
    args.run_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, NODE_RANK=str(rank), RANK=str(rank), GROUP_RANK=str(rank))
    env.setdefault("LUBAN_NODE", env.get("SLURMD_NODENAME", "?"))
    log_path = Path(args.log.format(rank=rank))
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab", buffering=0) as log:
        log.write(f"== luban: job {env.get('LUBAN_JOB_ID', '?')} rank {rank} started "
                  f"{time.strftime('%Y-%m-%d %H:%M:%S')} on {env.get('LUBAN_NODE', '?')} ==\n".encode())
        try:
            child = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True, cwd=env.get("LUBAN_WORKDIR") or None)
        except OSError as err:
            log.write(f"== luban: cannot start {command[:1]}: {err} ==\n".encode())
            write_atomic(exit_file(args.run_dir, rank), "127")
            return 127
        write_atomic(pgid_file(args.run_dir, rank), str(child.pid))

        def forward(signum, _frame):
            try:
                os.killpg(child.pid, signum)
            except ProcessLookupError:
                pass

        for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, forward)
        code = child.wait()
        code = 128 - code if code < 0 else code
        log.write(f"== luban: rank {rank} exited with code {code} ==\n".encode())
    write_atomic(exit_file(args.run_dir, rank), str(code))
    return code


if __name__ == "__main__":
    sys.exit(main())
