"""One service per state folder: a second `luban cluster serve` on the same --state is refused in
one line before it touches anything. Found 2026-11-27: it started, and the two shared the logs, the
run records and the SQLite file, each free to adopt and sweep the other's jobs."""

from __future__ import annotations

import os
import socket
import subprocess

from tests.cluster.conftest import LUBAN, ROOT, free_port


def _listing(state) -> tuple[set[str], str]:
    """Every entry of the state folder (the first service's database changes on its own), and who
    holds its lock."""
    names = {os.path.relpath(os.path.join(root, n), state) for root, dirs, files in os.walk(state) for n in dirs + files}
    lock = state / "serve.lock"
    return names, lock.read_text() if lock.exists() else None


def test_a_second_service_on_one_state_folder_is_refused_untouched(service):
    first = service("--nodes", "1", "--tick", "0.2")
    first.admin().whoami()
    before, port = _listing(first.state), free_port()
    second = subprocess.run([*LUBAN, "cluster", "serve", "--state", str(first.state), "--port", str(port),
                             "--run-jobs-as", "service"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert second.returncode == 2, (second.returncode, second.stderr[-2000:])
    assert second.stderr.count("\n") == 1 and second.stderr.startswith(
        f"luban: error: --state = '{first.state}': in use by another luban cluster serve (pid {first.proc.pid})"), \
        second.stderr
    assert _listing(first.state) == before  # nothing touched: no file written, no database migrated
    with socket.socket() as s:  # nor the port bound: refused before it
        s.bind(("127.0.0.1", port))
    assert first.admin().whoami()["user"] == "admin"  # the first one serves on
    first.stop()
    first.start()  # its lock went with it: the next start on the folder is not refused
    assert first.admin().whoami()["user"] == "admin"
