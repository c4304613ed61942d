"""A job flooding its log cannot fill the disk under the service: the launcher reads the job's
output through a pipe and keeps at most --max-log bytes per rank's log (all attempts), then one
line says the log was cut; the job is neither blocked nor killed by SIGPIPE, and its own files
are not capped. Found 2026-11-27: the job wrote straight into STATE/logs, beside the database."""

from __future__ import annotations

import subprocess
from pathlib import Path

from luban.cluster import joblog
from tests.cluster.conftest import PYTHON, ROOT, wait_for

CAP = 4096  # bytes: far below what the job writes
FLOOD = r"""
import os, sys, time
out, go = sys.argv[1], sys.argv[2]
print("first line", flush=True)
while not os.path.exists(go):  # the test reads the log while the job runs
    time.sleep(0.05)
block = b"x" * 65535 + b"\n"
for _ in range(128):  # 8 MiB on stdout, 8 MiB on stderr
    os.write(1, block)
    os.write(2, block)
with open(out, "wb") as f:  # the job's own file, larger than the log cap: not capped
    f.write(b"c" * (1 << 20))
print("last line", flush=True)
"""


def test_a_flooding_job_is_cut_at_the_cap_and_runs_on(tmp_path):
    log, go, own = tmp_path / "logs" / "rank0.log", tmp_path / "go", tmp_path / "checkpoint.bin"
    launcher = subprocess.Popen([PYTHON, "-m", "luban.cluster.launcher", "--run-dir", str(tmp_path / "run"),
                                 "--log", str(tmp_path / "logs" / "rank{rank}.log"), "--rank", "0", "--tag", "flood",
                                 "--max-log", str(CAP), "--", PYTHON, "-c", FLOOD, str(own), str(go)], cwd=ROOT)
    try:
        # live: the job's output is in the log while it runs (the pump writes as it reads)
        wait_for(lambda: launcher.poll() is not None or (log.exists() and b"first line" in log.read_bytes()),
                 60, what="the job's first line in its log")
        assert launcher.poll() is None, launcher.returncode
        go.touch()
        assert launcher.wait(120) == 0  # neither blocked on a full pipe nor killed by SIGPIPE (141)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(30)
    text = log.read_bytes()
    assert (tmp_path / "run" / "rank0.exit").read_text() == "0"
    assert own.stat().st_size == 1 << 20  # the job's own files are not capped
    assert text.count(joblog.cut_line(CAP)) == 1 and b"last line" not in text
    assert text.endswith(b"== luban: rank 0 exited with code 0 ==\n"), text[-300:]
    before_cut = text[:text.index(joblog.cut_line(CAP))]
    assert len(before_cut) <= CAP + 1  # the cut line starts a line of its own: at most one "\n" added


def test_the_cap_counts_earlier_attempts_and_cuts_whole_characters(tmp_path):
    """The log of a chain is appended across attempts: a job that suspends itself again and again
    does not get a fresh cap each time. The kept part ends on a whole UTF-8 character."""
    path = tmp_path / "rank0.log"
    with open(path, "ab", buffering=0) as log:
        pump = joblog.Pump(-1, log, 10)  # driven by hand: no thread, no pipe
        pump.take("ab日本".encode())  # 8 bytes: fits
        pump.take("語x".encode())    # the cap falls inside 語: none of it is kept
        pump.take(b"more")          # after the cut: dropped, no second cut line
    assert path.read_bytes() == "ab日本".encode() + b"\n" + joblog.cut_line(10)
    assert "\ufffd" not in path.read_bytes().decode(errors="replace")
    with open(path, "ab", buffering=0) as log:  # the next attempt: already at the cap
        pump = joblog.Pump(-1, log, 10)  # driven by hand: no thread, no pipe
        pump.take(b"next attempt\n")
    assert path.read_bytes().count(joblog.cut_line(10)) == 2 and b"next attempt" not in path.read_bytes()


def test_serve_max_log_caps_a_jobs_log(service):
    svc = service("--nodes", "1", "--tick", "0.2", "--max-log", str(CAP))
    _, alice = svc.user("alice", {"NORMAL": 1})
    code = "import os\nfor _ in range(64): os.write(1, b'y' * 65535 + b'\\n')\nprint('done', flush=True)"
    job = alice.submit({"name": "flood", "command": PYTHON, "args": ["-c", code]})
    assert alice.wait(job["id"], timeout=120)["state"] == "succeeded"
    log = Path(svc.state) / "logs" / job["chain_id"] / "rank0.log"
    assert log.stat().st_size < CAP + 1024  # the cut line and luban's own start and end lines
    shown = svc.cli("logs", str(job["id"])).stdout
    assert joblog.cut_line(CAP).decode() in shown and shown.endswith("exited with code 0 ==\n"), shown[-300:]


def test_the_logs_api_cuts_characters_with_joblog_cut_char():
    """One function decides where a log read in chunks may end (a whole UTF-8 character): the
    service read it through an alias (``service._cut_char``), removed 2026-11-28."""
    import inspect

    from luban.cluster import service

    assert not hasattr(service, "_cut_char")
    assert "joblog.cut_char(" in inspect.getsource(service.create_app)
    assert joblog.cut_char("ab\u00e9".encode()[:-1]) == 1 and joblog.cut_char(b"ab") == 0
