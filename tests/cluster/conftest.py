"""Fixtures for the platform tests: real services (PostgreSQL, Slurm, Chromium) or a clear skip.

With LUBAN_REQUIRE_SERVICES=1 (set by .ci/run after .ci/services.sh) a missing service FAILS
the test instead of skipping it.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from luban.cluster.client import Client
from luban.parallel.launch import free_port  # re-exported for the platform tests (outside the ephemeral ports)

ROOT = Path(__file__).resolve().parents[2]
PYTHON = sys.executable
PG_ADMIN = os.environ.get("LUBAN_TEST_PG", "postgresql://postgres@127.0.0.1:5432/postgres")
# The real `luban` entry point (luban.cli.main) with only this package's sub-commands registered,
# so these tests do not depend on other sub-packages importing cleanly.
LUBAN = [PYTHON, "-c", "import sys, luban.cli as c; c.SUBCOMMAND_MODULES[:] = ['luban.cluster.cli']; "
                       "sys.exit(c.main(sys.argv[1:]))"]


def require(available: bool, what: str) -> None:
    """Skip with a reason, or fail when LUBAN_REQUIRE_SERVICES=1."""
    if available:
        return
    message = f"{what} is not available (run .ci/services.sh as root)"
    if os.environ.get("LUBAN_REQUIRE_SERVICES") == "1":
        pytest.fail(message + " and LUBAN_REQUIRE_SERVICES=1")
    pytest.skip(message)


def wait_for(predicate, timeout: float = 60.0, every: float = 0.1, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(every)


@pytest.fixture(scope="session")
def pg_admin_url():
    try:
        import psycopg

        with psycopg.connect(PG_ADMIN, connect_timeout=3):
            pass
    except Exception as err:  # noqa: BLE001 - any failure means: no usable server
        require(False, f"PostgreSQL at {PG_ADMIN} ({err.__class__.__name__}: {err})".replace("\n", " "))
    return PG_ADMIN


@pytest.fixture
def pg_url(pg_admin_url):
    """A throwaway database, dropped afterwards."""
    import psycopg

    name = "luban_test_" + secrets.token_hex(4)
    with psycopg.connect(pg_admin_url, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    yield pg_admin_url.rsplit("/", 1)[0] + "/" + name
    with psycopg.connect(pg_admin_url, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request, tmp_path):
    """This test's own database, once of each kind (test ids ``[sqlite]``, ``[postgresql]``): a SQLite
    file in tmp_path, or a throwaway PostgreSQL database (``pg_url``: dropped afterwards, even when the
    test fails)."""
    if request.param == "postgresql":
        return request.getfixturevalue("pg_url")
    return str(tmp_path / "luban.db")


def migrate(conn, direction: str, revision: str) -> None:
    """``alembic upgrade|downgrade REVISION`` of the package's migrations on ``conn`` (in its transaction)."""
    from alembic import command
    from alembic.config import Config

    from luban.cluster import db

    cfg = Config()
    cfg.set_main_option("script_location", str(db.MIGRATIONS))
    cfg.attributes["connection"] = conn
    getattr(command, direction)(cfg, revision)


def api_client(scheduler, **app_options):
    """(TestClient, the admin's headers) of the API in this process over ``scheduler``'s database, no
    scheduler thread (nor lifespan): its ticks are the test's. The admin's token is the one
    ``ensure_admin`` wrote in the scheduler's state folder."""
    from fastapi.testclient import TestClient

    from luban.cluster.service import create_app

    http = TestClient(create_app(scheduler.sessions, scheduler, run_scheduler=False, **app_options))
    token = (Path(scheduler.settings.state_dir) / "admin.token").read_text().strip()
    return http, {"Authorization": f"Bearer {token}"}


class InProcess:
    """The service in this process on one database: its engine and sessions, a scheduler (ticked by the
    test), the API (``http``, no scheduler thread) and the admin's headers; ``state`` is the folder
    of its settings and admin token. Made by the ``in_process`` fixture."""

    def __init__(self, url: str, executor, state: Path, clock=None, **settings):
        from luban.cluster import db
        from luban.cluster.scheduler import Scheduler, Settings
        from luban.cluster.service import ensure_admin

        state.mkdir(parents=True, exist_ok=True)
        self.state = state
        self.engine = db.open_checked(url)
        self.sessions = db.sessions(self.engine)
        clocked = {} if clock is None else {"clock": clock}
        self.scheduler = Scheduler(self.sessions, executor, Settings(state_dir=str(state), **settings), **clocked)
        self.scheduler.sync_nodes()
        ensure_admin(self.sessions, state)
        self.http, self.admin = api_client(self.scheduler)

    def user(self, name: str, nodes: int | None = None, group: str | None = None,
             node_group: str | None = None) -> str:
        """Add user NAME (in ``group``) with a NORMAL quota of ``nodes`` (in ``node_group``, else the
        default one) unless None; returns its token."""
        r = self.http.post("/api/users", json={"name": name, **({"group": group} if group else {})},
                           headers=self.admin)
        assert r.status_code == 201, r.text
        if nodes is not None:
            quota = {"owner": f"user:{name}", "priority": "NORMAL", "nodes": nodes,
                     **({"node_group": node_group} if node_group else {})}
            q = self.http.put("/api/quota", json=quota, headers=self.admin)
            assert q.status_code == 200, q.text
        return r.json()["token"]


@pytest.fixture
def in_process(tmp_path, monkeypatch):
    """Factory: in_process(url=None, executor=None, state=None, time=None, **settings) -> InProcess, the
    service in this process on ``url`` (default: a fresh SQLite file in ``state``; pass ``pg_url`` or
    ``db_url`` for PostgreSQL) with ``executor`` (default: LocalExecutor(nodes=1)) and
    ``Settings(state_dir=state, **settings)`` (``state`` default: tmp_path). With ``time`` (a FakeTime)
    the scheduler and the API (clocks.CLOCK) run on its clock. Afterwards, even when the test fails,
    the jobs a local executor left are killed and every engine is disposed (a PostgreSQL database
    itself is dropped by ``pg_url``)."""
    made: list[InProcess] = []

    def make(url: str | None = None, executor=None, *, state: Path | None = None, time=None,
             **settings) -> InProcess:
        from luban.cluster import clock as clocks
        from luban.cluster.executors.local import LocalExecutor

        state = state or tmp_path
        if time is not None:
            monkeypatch.setattr(clocks, "CLOCK", time.clock())  # the API's clock (clocks.now)
        api = InProcess(url or str(state / "luban.db"), LocalExecutor(nodes=1) if executor is None else executor,
                        state, clock=None if time is None else time.clock(), **settings)
        made.append(api)
        return api

    yield make
    for api in made:
        kill_jobs(api.state)
        api.engine.dispose()


def listens(pid: int, port: int) -> bool:
    """Whether process ``pid`` holds a TCP socket listening on ``port``. A free port is free only
    when it is chosen: another test's service or rendezvous may bind it first, and then answers
    this test's requests (2026-12-03 CI: a service "up" with no admin.token — the answer was
    another worker's service, and this one exited 2 on the taken port)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()  # sl local_address rem_address st ... inode (the 10th)
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # 0A: TCP_LISTEN
                inodes.add(f"socket:[{fields[9]}]")
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                return True
        except OSError:
            continue
    return False


class Service:
    """A real `luban cluster serve` process; restartable on the same state and database."""

    def __init__(self, state: Path, args: list[str]):
        # jobs run as the service's account unless a test asks for per-user accounts (test_isolation):
        # pytest's tmp dirs and this venv are root's, closed to other accounts
        if "--run-jobs-as" not in args:
            args = [*args, "--run-jobs-as", "service"]
        self.state, self.args, self.port = state, args, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.log = state.with_name(state.name + ".service.log")  # beside STATE: luban writes only its own files there

    PORT_TRIES = 5  # a first start whose free port another test took meanwhile tries a new one

    def start(self) -> "Service":
        self.state.parent.mkdir(parents=True, exist_ok=True)
        first = self.proc is None  # a restart keeps its port: its jobs know the service's URL
        for _ in range(self.PORT_TRIES if first else 1):
            seen = self.log.stat().st_size if self.log.exists() else 0
            with open(self.log, "a") as log:
                self.proc = subprocess.Popen(
                    [*LUBAN, "cluster", "serve", "--state", str(self.state), "--port", str(self.port),
                     "--log-level", "info", *self.args], stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
            try:
                wait_for(self._up, 60, 0.2, f"service on {self.url} (log {self.log})")
                return self
            except BaseException:
                self.proc.kill()  # a service that did not come up in time must not outlive the test
                self.proc.wait(30)
                if not (first and self.proc.returncode == 2 and "another process listens on"
                        in self.log.read_text(errors="replace")[seen:]):
                    raise
            self.port = free_port()
            self.url = f"http://127.0.0.1:{self.port}"
        raise AssertionError(f"no free port in {self.PORT_TRIES} tries (log {self.log})")

    def _up(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"service exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
        if not listens(self.proc.pid, self.port):
            return False  # not yet, or another process holds the port: its answers are not this service's
        try:
            return httpx.get(self.url + "/api/whoami", timeout=1).status_code == 401
        except httpx.HTTPError:
            return False

    def stop(self, sig=signal.SIGTERM) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            from tests.child import wait_or_fail

            wait_or_fail(self.proc, 60, lambda: self.log.read_text(errors="replace"))

    @property
    def admin_token(self) -> str:
        return (self.state / "admin.token").read_text().strip()

    def admin(self) -> Client:
        return Client(self.url, self.admin_token)

    def user(self, name: str, quotas: dict[str, int], group: str | None = None, node_group: str = "default"):
        """Create a user with quotas {PRIORITY: nodes}; returns (token, Client)."""
        admin = self.admin()
        token = admin.add_user(name, group=group)["token"]
        for level, nodes in quotas.items():
            admin.set_quota(f"user:{name}", level, nodes, node_group)
        return token, Client(self.url, token)

    def cli(self, *args: str, token: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
        env = dict(os.environ, LUBAN_CLUSTER_URL=self.url, LUBAN_CLUSTER_TOKEN=token or self.admin_token)
        result = subprocess.run([*LUBAN, *args], env=env, capture_output=True, text=True, timeout=120)
        if check and result.returncode != 0:
            raise AssertionError(f"luban {' '.join(args)} -> {result.returncode}\n{result.stdout}\n{result.stderr}")
        return result


@pytest.fixture
def service(tmp_path):
    """Factory: service(*serve_args) starts a service; all are stopped and their jobs killed after."""
    started: list[Service] = []

    def make(*args: str, state: Path | None = None) -> Service:
        svc = Service(state or tmp_path / f"state{len(started)}", list(args)).start()
        started.append(svc)
        return svc

    yield make
    for svc in started:
        svc.stop()
        kill_jobs(svc.state)


def kill_jobs(state: Path, settle: float = 5.0) -> None:
    """Kill every job process a test left behind: the ranks' process groups (the pgid files the
    launcher writes) and the launchers themselves (their command line names this state folder's
    runs). A launcher the stopping service started a moment before may write its pgid file after a
    first pass (CI once kept a ``sleep 600`` job alive after the suite that way), so passes repeat
    until one finds no launcher, for at most ``settle`` seconds."""
    deadline = time.monotonic() + settle
    while True:
        for pgid_file in state.glob("runs/*/rank*.pgid"):
            try:
                os.killpg(int(pgid_file.read_text()), signal.SIGKILL)
            except (ProcessLookupError, ValueError, PermissionError):
                pass
        launchers = _launchers(state)
        for pid in launchers:
            try:
                os.killpg(pid, signal.SIGKILL)  # each launcher leads its own session and group
            except (ProcessLookupError, PermissionError):
                pass
        if not launchers or time.monotonic() > deadline:
            return
        time.sleep(0.2)


def _launchers(state: Path) -> list[int]:
    """Pids of live ``luban.cluster.launcher`` processes whose ``--run-dir`` is under ``state``
    (read from /proc; an empty list where there is none)."""
    runs = os.fsencode(str(state / "runs")) + b"/"
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"luban.cluster.launcher" in argv and any(arg.startswith(runs) for arg in argv):
            found.append(int(entry.name))
    return found


@pytest.fixture
def slurm(tmp_path, monkeypatch, caplog, in_process):
    """The scheduler over a fake Slurm (tests/cluster/fake_slurm.py): (scheduler, submit(), fake-Slurm
    folder, its calls.log, FakeTime)."""
    from tests.cluster import fake_slurm

    return fake_slurm.setup(tmp_path, monkeypatch, caplog, in_process)
