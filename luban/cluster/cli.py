"""Command line: ``luban submit|jobs|logs|stop|suspend|nodes|quota``, ``luban cluster serve|
simulate|trace`` and ``luban admin user|group|quota|node``. All but serve/simulate/trace talk to
the service through ``Client`` (LUBAN_CLUSTER_URL / LUBAN_CLUSTER_TOKEN or --url / --token)."""

from __future__ import annotations

import argparse
import errno
import getpass
import json
import math
import os
import re
import shlex
import shutil
import sys
from pathlib import Path

from luban import schema
from luban.cluster import joblog
from luban.cluster import priority as prio
from luban.cluster import trace as traces
from luban.cluster.spec import JOBS_LIMIT, JOBS_LIMIT_MAX, MAX_TIME_LIMIT, NAME_RE, SUBMIT_KEY_RE  # (not client: httpx)
from luban.errors import EXIT_USAGE, LubanError, bad_value, escaped, for_terminal, for_terminal_chunks, without_password

# the flags' declarations (luban.schema); what the service checks again, the client checks first
NAME = schema.text(NAME_RE.pattern, f"a name matching {NAME_RE.pattern}")
NODES = schema.integer(*schema.CLUSTER_NODES)
JOB_ID = schema.integer(1, schema.INT32[1])  # the SQL Integer id column
SECONDS = schema.number(0, MAX_TIME_LIMIT, open_lo=True)
QUANTUM = schema.number(0, MAX_TIME_LIMIT, open_lo=True, also=(math.inf,))  # inf: no time-sharing
LEVELS = ", ".join(p.name for p in prio.LEVELS)
DB_URL = "a file path, or a database URL whose driver is installed (sqlite:///FILE, postgresql://USER@HOST/DB)"
PUBLIC_URL = "the URL jobs reach this service at: http(s)://HOST[:PORT], no user:password@ (jobs send their token)"
# luban submit's flags that set a spec field as given (field, flag): cmd_submit reads them, _submit_again writes them
SPEC_FLAGS = (("nodes", "-n"), ("priority", "-p"), ("name", "--name"), ("group", "--group"),
              ("node_group", "--node-group"), ("workdir", "--workdir"))
TIME_FORMS = f"MINUTES, MM:SS, H:MM:SS, D-H, D-H:MM or D-H:MM:SS (as Slurm's --time), from 1 s to {MAX_TIME_LIMIT} s"


def _client(args):
    from luban.cluster.client import Client

    return Client(args.url, args.token)


def _table(rows: list[dict], columns: list[str]) -> None:
    """Print ``rows`` as aligned columns; ``key:HEADER`` renames a column."""
    keys = [c.split(":")[0] for c in columns]
    heads = [c.split(":")[-1].upper() for c in columns]
    cells = [["-" if r.get(k) is None else str(r[k]) for k in keys] for r in rows]
    widths = [max([len(h)] + [len(row[i]) for row in cells]) for i, h in enumerate(heads)]
    for row in [heads] + cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip())


# -- user commands -------------------------------------------------------------------------------
def cmd_submit(args) -> int:
    from luban.cluster import spec as specs

    rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
    file, command = (None, rest) if args.rest[:1] == ["--"] or not rest else (rest[0], rest[1:])
    if file is not None and command and command[0] != "--":
        raise bad_value("submit", " ".join(rest), "options go before JOB.yaml; a command goes after --")
    command = command[1:] if command[:1] == ["--"] else command
    if file is None and not command:  # not "name is missing": the name comes from the command or the file
        raise bad_value("submit", " ".join(args.rest) or "(nothing)",
                        "a job spec JOB.yaml, or a command after --, e.g. luban submit -- python train.py")
    if file is not None and not file.endswith((".yaml", ".yml", ".json")):
        raise bad_value("job file", file,
                        "a .yaml/.yml file; put a command after --, e.g. luban submit -- python train.py")
    data: dict = {}
    if file:
        path = Path(file)
        if not path.exists():
            raise bad_value("job file", file, "no such file")
        if not (path.is_file() or path.is_dir()):  # a named pipe would block the read, a device never end it
            raise bad_value("job file", file, "a regular file (this is a named pipe, a device or a socket)")
        import yaml

        try:
            # no aliases, as the service's parse_yaml: nested ones expand a few hundred bytes into gigabytes
            data = yaml.load(path.read_bytes().decode("utf-8"), Loader=specs._NoAliasLoader)  # noqa: S506
        except yaml.YAMLError as err:
            raise LubanError(f"{file} is not valid YAML: {err}".replace("\n", " ")) from None
        except (OSError, ValueError, RecursionError) as err:  # UnicodeDecodeError is a ValueError
            why = err.strerror if isinstance(err, OSError) else "not UTF-8 text" if isinstance(
                err, UnicodeDecodeError) else "nested too deeply" if isinstance(
                err, RecursionError) else str(err).split(";")[0]  # an integer of 5000 digits
            raise bad_value("job file", file, f"a readable YAML file ({why})") from None
        if data is None:
            raise bad_value("job file", file, "a YAML mapping (name, command, args, ...); the file is empty")
        if not isinstance(data, dict):
            raise bad_value("job file", file, "a YAML mapping (name, command, args, ...)")
    if command:
        data["command"], data["args"] = command[0], command[1:]
    for key, _ in SPEC_FLAGS:
        if getattr(args, key) is not None:
            data[key] = getattr(args, key)
    if "workdir" not in data and command:
        data["workdir"] = os.getcwd()
    if args.time is not None:
        data["time_limit"] = args.time
    _export(data, args.export)
    for item in args.env:
        key, sep, value = item.partition("=")
        if not sep:
            raise bad_value("--env", item, "KEY=VALUE")
        data.setdefault("env", {})[key] = value
    if "name" not in data and data.get("command"):  # the command's file name, made a valid job name
        data["name"] = re.sub(r"[^A-Za-z0-9_.-]", "_", Path(str(data["command"])).name).lstrip("_.-")[:64] or "job"
    spec = specs.parse(data)  # one-line error before anything is sent
    from luban.cluster.client import new_key

    key = args.key or new_key()
    job = _client(args).submit(spec.to_dict(), key=key, again="run in this shell: " + _submit_again(args, key))
    if job.get("repeated") and args.key:  # the user's own key again (not this run's retry of an unanswered POST)
        print(f"job {job['first_id']} was submitted with --key {args.key} before (it is {job['state']}); "
              "nothing new submitted")
        return 0
    print(f"submitted job {job['id']} ({job['name']}, {job['nnodes']} node(s), {job['priority_name']})")
    return 0


def _submit_again(args, key: str) -> str:
    """This ``luban submit`` as a command line with ``--key KEY``: what repeats it at most once when its
    answer was lost (the service answers the job the key made, or makes it). It starts in this
    directory (``cd DIR &&``: a relative job file, and the workdir a command gets by default) and names
    the service it was sent to (--url, or $LUBAN_CLUSTER_URL's value). Secrets are never printed: a
    token reads TOKEN (a URL with a password never got this far: ``Client`` refuses it). What --export ALL sent
    is this shell's environment: from another shell the repeat differs and is refused (409), never a
    second job."""
    url = args.url or os.environ.get("LUBAN_CLUSTER_URL")
    words = ["luban", "submit", "--key", key]
    words += ["--url", url] if url else []  # (Client refused a URL with credentials before any request)
    words += ["--token", "TOKEN"] if args.token else []
    for key_name, flag in SPEC_FLAGS:
        value = getattr(args, key_name)
        words += [flag, str(value)] if value is not None else []
    for item in args.env:
        words += ["-e", item]
    if args.time is not None:  # seconds (parse_duration), as H:MM:SS
        words += ["-t", f"{args.time // 3600}:{args.time // 60 % 60:02d}:{args.time % 60:02d}"]
    words += ["--export", args.export] if args.export != "ALL" else []
    try:
        here = f"cd {_shell_word(_this_directory())} && "
    except OSError:  # this directory was removed: a repeat from elsewhere is refused if the spec differs
        here = ""
    return here + " ".join(_shell_word(word) for word in words + list(args.rest))


def _this_directory() -> str:
    """This directory as the shell named it ($PWD, a symbolic link's path where it came through one), else
    its resolved path: ``cd`` to the resolved path sets $PWD to it, which --export ALL sends, and the
    repeat was another spec (409)."""
    cwd, pwd = os.getcwd(), os.environ.get("PWD", "")
    try:
        return pwd if os.path.isabs(pwd) and os.path.samefile(pwd, cwd) else cwd
    except OSError:  # $PWD names nothing now
        return cwd


def _shell_word(word: str) -> str:
    """``word`` as a shell reads it back: ``shlex.quote``, or where it holds a line feed, a tab or another
    control (which luban's one-line error shows escaped, ``luban.cli.error_line``: another word when
    pasted) bash's ``$'...'``, each control as its escape there (``$'a\\nb'``, ``\\x1b``, ``\\u202e``;
    zsh and ksh read them alike)."""
    if escaped(word) == word:
        return shlex.quote(word)
    return "$'" + "".join(_ansi_c(c) for c in word) + "'"


def _ansi_c(c: str) -> str:
    """One character inside bash's ``$'...'``: a control as its escape, a backslash or quote escaped."""
    if c in "\\'":
        return "\\" + c
    if escaped(c) == c:
        return c
    return {"\n": "\\n", "\t": "\\t"}.get(c) or (f"\\x{ord(c):02x}" if ord(c) < 0x80 else f"\\u{ord(c):04x}")


DURATION = re.compile(r"(?:(?P<days>[0-9]+)-)?(?P<a>[0-9]+)(?::(?P<b>[0-9]+))?(?::(?P<c>[0-9]+))?")


def parse_duration(text: str) -> int:
    """Slurm's --time forms: MINUTES, MM:SS, H:MM:SS, D-H, D-H:MM, D-H:MM:SS -> seconds. Only the
    first field may exceed its unit (90 minutes, 30 hours), not the ones after it (1:99:99)."""
    found = DURATION.fullmatch(text) if isinstance(text, str) else None
    try:
        fields = [int(found[k] or 0) for k in ("days", "a", "b", "c")] if found else None
    except ValueError:  # more digits than int() reads
        fields = None
    if fields:
        days, a, b, c = fields
        hours_first = found["days"] is not None or found["c"] is not None  # D-H..., H:MM:SS
        h, m, sec = (a, b, c) if hours_first else (0, a, b)
        seconds = ((days * 24 + h) * 60 + m) * 60 + sec
        if sec > 59 or (hours_first and m > 59) or (found["days"] is not None and h > 23) or \
                not 1 <= seconds <= MAX_TIME_LIMIT:
            fields = None
    if not fields:
        raise bad_value("--time", text, TIME_FORMS)
    return seconds


def _priority(auto: bool):
    """A priority level's name or number; AUTO too where ``auto``."""
    allowed = f"one of {LEVELS}" + (f" or {prio.AUTO}" if auto else " (a concrete level)")

    def level(text):
        if prio.parse(text) == prio.AUTO and not auto:
            raise ValueError(text)
        return text

    return schema.custom(level, allowed)


def _db_url(text: str) -> str:
    from luban.cluster import db

    return db.check_url(schema.text()(text))


def _public_url(text: str) -> str:
    """What jobs get as LUBAN_CLUSTER_URL: checked as the client would (a bad one fails every job's SDK call)."""
    import httpx

    try:
        url = httpx.URL(schema.text()(text))
    except httpx.InvalidURL as err:
        raise ValueError(text) from err
    if url.scheme not in ("http", "https") or not url.host or (url.port is not None and not 1 <= url.port <= 65535):
        raise ValueError(text)
    if url.userinfo:  # every job's SDK call would send these as Basic auth in place of its token (client.Client)
        raise ValueError(text)
    return text.rstrip("/")


def service_url(host: str, port: int) -> str:
    """The URL jobs get when no --public-url is given; an IPv6 address in brackets (http://[::1]:8765:
    'http://::1:8765' is no URL, and every SDK call of every job failed on it)."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _check_zones(zones: int, nodes: int) -> None:
    """Nodes are split into zones (``serve`` and ``simulate`` alike): at most one zone per node."""
    if zones > nodes:
        raise bad_value("--zones", zones, f"an integer from 1 to --nodes = {nodes}")


# what a shell's `cd` moves but the job has no use for: the retry command's `cd DIR &&` sets $OLDPWD to DIR,
# and sent with --export ALL it made that repeat another spec, refused (409) in the very shell it names
SHELL_MOVED = ("OLDPWD",)


def _export(data: dict, export: str) -> None:
    """Slurm's --export: ALL (default) sends the submitter's environment (less secrets and rank
    variables, ``luban.jobenv.inheritable``); NONE or NAME,NAME... sends exactly those names."""
    from luban import jobenv
    from luban.cluster import spec as specs

    if not isinstance(data.get("env") or {}, dict):
        raise bad_value("env", data["env"], "a mapping of NAME: value")
    if export.upper() == "ALL":
        sent = {k: v for k, v in jobenv.inheritable(os.environ).items() if k not in SHELL_MOVED}
        data["env"] = {**sent, **(data.get("env") or {})}
        return
    names = [] if export.upper() == "NONE" else [n for n in export.split(",") if n]
    for name in names:
        if not specs.ENV_RE.fullmatch(name):
            raise bad_value("--export", export, "ALL, NONE or a comma-separated list of variable names")
    data["env"] = {**{n: os.environ[n] for n in names if n in os.environ}, **(data.get("env") or {})}
    data["env_only"] = True


def _check_states(value: str | None) -> None:
    from luban.cluster.states import JobState

    allowed = [s.value for s in JobState]
    for name in (value.split(",") if value is not None else []):  # `--state ''` was no filter at all: all jobs
        if name not in allowed:
            raise bad_value("--state", name, "one of " + ", ".join(allowed) + " (comma-separated)")


def cmd_jobs(args) -> int:
    """Like squeue / sacct: the latest attempt of each chain, or with --all every attempt with its
    exit code, node-hours and how it ended."""
    _check_states(args.state)
    rows = _client(args).jobs(all_attempts=args.all, state=args.state, limit=args.limit)
    if rows.total > len(rows):  # on stderr: stdout (the table, --json's list) stays only the rows
        print(f"(showing the newest {len(rows)} of {rows.total} {'attempts' if args.all else 'jobs'}; "
              f"--limit N for more, --limit 0 for all)", file=sys.stderr)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    for r in rows:
        r["where"] = ",".join(r["nodes"]) or r["nnodes"]
        r["state_shown"] = r["state"] + (" (held)" if r.get("held") else "")
        r["hours"] = f"{r['node_hours']:.2f}"
    _table(rows, ["id", "chain_id:chain", "name", "user", "priority_name:priority", "where:nodes", "state_shown:state",
                  "exit_code:exit", "hours:node-hours", "restart_count:restarts", "reason"])
    return 0


def cmd_usage(args) -> int:
    """Node-hours per user (or per quota owner) over a period, like sreport."""
    import time

    since = time.time() - args.days * 86400
    rows = _client(args).usage(since=since, by=args.by)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"node-hours since {time.strftime('%Y-%m-%d %H:%M', time.localtime(since))} ({args.days:g} days)")
    for r in rows:
        r["hours"] = f"{r['node_hours']:.2f}"
    _table(rows, ["who:" + ("user" if args.by == "user" else "owner"), "attempts", "hours:node-hours"])
    return 0


# RFC 9110 status codes: the job's state does not allow the request (service.conflict); no such job of yours
CONFLICT, NOT_FOUND = 409, 404


def cmd_hold(args) -> int:
    """Hold (or release) each job; one the service refuses (not queued, already held, not held) is one
    line on stderr, changes nothing, and does not keep the others from being asked; exit 2 if any was."""
    from luban.cli import error_line
    from luban.cluster.client import ApiError

    client = _client(args)
    refused = 0
    for job_id in args.jobs:
        try:
            job = client.hold(job_id) if args.command_name == "hold" else client.release(job_id)
        except ApiError as err:
            if err.status not in (CONFLICT, NOT_FOUND):  # the service or the token, not this job: said once
                raise
            print(error_line(err), file=sys.stderr, flush=True)
            refused += 1
            continue
        print(f"job {job['id']}: {job['reason']}", flush=True)
    return EXIT_USAGE if refused else 0


def cmd_logs(args) -> int:
    client = _client(args)
    chunks = client.follow(args.job, args.rank) if args.follow else _log_chunks(client, args.job, args.rank)
    for text in chunks if args.raw else for_terminal_chunks(chunks, sys.stdout):
        sys.stdout.write(text)
        sys.stdout.flush()
    if args.follow:  # until the chain ends; then exit with its status, as a foreground job would
        job = client.latest(args.job)
        print(f"== job {job['id']} {job['state']}: {job['reason']} ==", file=sys.stderr)
        return 0 if job["state"] == "succeeded" else min(255, job["exit_code"] or 1)
    return 0


def _log_chunks(client, job, rank):
    """The log as written so far, chunk by chunk."""
    offset = 0
    while True:
        chunk = client.logs(job, rank, offset)
        if not chunk["text"]:
            return
        yield chunk["text"]
        offset = chunk["offset"]


def cmd_stop(args) -> int:
    """Request the stop (or suspend) of each job; then, unless --no-wait, return only when each
    attempt has ended — for the local and Slurm executors that means none of its processes runs
    (the launchers write the exit code only after killing the whole job, luban.procs)."""
    import time

    from luban.cluster.states import FINAL

    client = _client(args)
    ids = []  # the attempts asked: a chain's latest, which an earlier attempt's id names (luban stop FIRST_ID)
    for job_id in args.jobs:
        try:
            job = client.suspend(job_id) if args.command_name == "suspend" else client.stop(job_id)
        except LubanError:  # one that ended meanwhile (`luban stop 1 2 3` as 2 ends) does not keep 3 running
            job = client.latest(job_id)
            if job["state"] not in FINAL:
                raise
            print(f"job {job['id']} already {job['state']}", flush=True)
            continue
        print(f"{args.command_name} requested for job {job['id']} ({job['state']})", flush=True)
        ids.append(job["id"])
    deadline = time.monotonic() + args.timeout
    for job_id in [] if args.no_wait else ids:
        while (state := client.job(job_id)["state"]) not in FINAL:
            if time.monotonic() > deadline:
                print(f"luban: error: job {job_id} is still {state} after {args.timeout:g}s", file=sys.stderr)
                return 1
            time.sleep(0.2)
        print(f"job {job_id} {state}")
    return 0


def cmd_nodes(args) -> int:
    rows = _client(args).nodes()
    for r in rows:
        r["zone"] = r["labels"].get("zone", "-")
        r["holder"] = f"{r['job']['id']} {r['job']['user']} {r['job']['name']} ({r['job']['state']})" if r["job"] else "-"
    _table(rows, ["name", "node_group", "gpus", "zone", "state", "holder:job", "why"])  # why: the executor's reason
    return 0


def cmd_quota(args) -> int:
    _table(_client(args).quota(), ["owner", "node_group", "priority_name:priority", "nodes", "used"])
    return 0


# -- admin commands ------------------------------------------------------------------------------
def cmd_admin(args) -> int:
    client = _client(args)
    what, action = args.what, args.action
    if what == "user" and action == "add":
        print(client.add_user(args.name, admin=args.admin, group=args.group, os_user=args.os_user)["token"])
    elif what == "user" and action == "token":
        print(client.rotate_token(args.name)["token"])
    elif what == "user" and action == "set":
        user = client.set_user(args.name, group=None if args.no_group else args.group)
        print(f"user {user['name']}: group {user['group'] or '-'}{' (admin)' if user['admin'] else ''}")
    elif what == "user":
        _table(client.users(), ["name", "admin", "group"])
    elif what == "group" and action == "add":
        client.add_group(args.name, args.data_dir, args.env_dir)
        print(f"group {args.name} added")
    elif what == "group":
        rows = client.groups()
        for r in rows:
            r["members"] = ",".join(r["members"])
        _table(rows, ["name", "members", "data_dir", "env_dir"])
    elif what == "quota":
        q = client.set_quota(args.owner, args.priority, args.nodes, args.node_group)
        print(f"quota {q['owner']} {q['node_group']} priority {q['priority']}: {q['nodes']} node(s)")
    elif what == "node":
        node = client.set_node(args.name, action)
        print(f"node {node['name']}: {node['state']}" + (f" ({node['why']})" if node.get("why") else ""))
    return 0


# -- service-side commands -----------------------------------------------------------------------
def secret_dirs(state: Path, db_url: str | None) -> tuple[str, ...]:
    """What a job must not reach: the state directory and, for SQLite, the database's folder."""
    from luban.cluster import db

    dirs = [str(state)]
    url = db.url_for(db_url) if db_url else ""
    if url.startswith("sqlite:///"):
        dirs.append(str(Path(url[len("sqlite:///"):]).absolute().parent))
    return tuple(dict.fromkeys(dirs))


def _listen(host: str, port: int):
    """The service's listening socket, bound before anything is written: a port in use (or a host
    that is not this machine's) is one line naming the flag, not uvicorn's error after start-up."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as err:
        raise bad_value("--host", host, f"a host name or address of this machine ({err})") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: restart over TIME_WAIT
        sock.bind(address)
        sock.listen(2048)
    except OSError as err:
        sock.close()
        if err.errno == errno.EADDRINUSE:
            raise bad_value("--port", port, f"a free port (another process listens on {host}:{port}); stop it "
                                            "or choose another --port") from None
        if err.errno in (errno.EACCES, errno.EPERM):
            raise bad_value("--port", port, f"a port this account may listen on ({err.strerror}; below 1024 "
                                            "needs root)") from None
        raise bad_value("--host", host, f"an address of this machine to listen on ({err.strerror})") from None
    sock.set_inheritable(False)
    return sock


SERVICE_UMASK = 0o077  # the service's files (database, logs, run records) are its account's alone
DB_ENV = "LUBAN_CLUSTER_DB"  # --db's default: a URL with a password stays off the command line (ps)


def hold_sqlite(db_url: str | None) -> int | None:
    """An ``flock`` on the service's SQLite database (an fd kept for the service's life; SQLite's own
    locks are POSIX ``fcntl`` locks, which ``flock`` does not meet), or a refusal while another service holds
    it: two services on one file both started jobs on the same nodes, each job's log in the other's state
    (``luban logs`` printed nothing); the default file in ``--state`` too (another state's ``--db`` named it).
    None for a server (PostgreSQL)."""
    from luban.cluster import db

    url = db.url_for(db_url) if db_url else ""
    if not url.startswith("sqlite:///"):
        return None
    from luban import owned

    path = url[len("sqlite:///"):]
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None  # (open_checked made or read it just now: a file that went since fails the service's first query)
    held = owned.try_lock(fd)
    if not held:
        os.close(fd)
        if held is False:
            raise bad_value("--db", without_password(db_url), "in use by another luban cluster serve; stop it "
                                                              "first, or choose another --db")
        return None  # a file system without flock: unguarded, as before
    return fd


STATE_LOCK = "serve.lock"  # in STATE, flock'ed for the service's life: one service per state folder (two would
                           # share its logs, run records and SQLite file and each adopt and sweep the other's jobs)


class StateInUse(LubanError):
    """Another service holds the state folder: refused, and nothing of that folder is touched."""


def hold_state(state: Path) -> int | None:
    """The state folder's lock (an fd to keep open for the service's life: it is not inherited by
    job launchers, so a restarted service is not refused while jobs run), or ``StateInUse``. None
    while the folder is not marked as luban's (absent, empty, made before the marker): a file of ours
    there would make it foreign to ``owned.claim``; ``cmd_serve`` takes the lock once it is claimed."""
    from luban import owned

    path = state / STATE_LOCK
    if owned.marked_kind(state) != "cluster-state":
        return None
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    except OSError as err:
        raise bad_value("--state", str(state), f"cannot lock {STATE_LOCK} there ({err.strerror})") from None
    import fcntl

    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
        os.close(fd)
        if err.errno not in (errno.EWOULDBLOCK, errno.EACCES):
            raise bad_value("--state", str(state), f"cannot lock {STATE_LOCK} there ({err.strerror})") from None
        refusal = bad_value("--state", str(state), f"in use by another luban cluster serve"
                            f"{f' (pid {holder})' if holder.isdigit() else ''}; stop it first, or choose another --state")
        raise StateInUse(str(refusal)) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)  # who holds it: named when another start is refused
    return fd


def cmd_serve(args) -> int:
    """Every check first (the state folder's owner, the job mode, the port, the database), then
    the state folder is created: a refusal leaves nothing behind that was not there before."""
    import uvicorn

    from luban import owned
    from luban.cluster import accounts, db, jobguard
    from luban.cluster.executors import make
    from luban.cluster.scheduler import Scheduler, Settings
    from luban.cluster.service import ACCEPT_BATCH, bounded_http, create_app, ensure_admin

    _check_zones(args.zones, args.nodes)
    os.umask(SERVICE_UMASK)  # what the service writes is its own: a SQLite file outside --state was 0644
    state = Path(args.state).absolute()
    owned.check(state, "cluster-state", "--state")
    lock = hold_state(state)  # before anything is bound, opened or written
    run_as = args.run_jobs_as or ("user" if accounts.privileged() else "namespace")
    if args.db is None and os.environ.get(DB_ENV):
        args.db = schema.custom(_db_url, DB_URL, shown=without_password)(os.environ[DB_ENV])
    elif args.db is not None and run_as == "user" and without_password(args.db) != args.db:
        raise bad_value("--db", without_password(args.db), f"no password on the command line here (jobs run as "
                        "other accounts on this machine and read every command line, ps); put the URL in "
                        f"${DB_ENV}, or the password in ~/.pgpass (PGPASSFILE)")
    hidden = secret_dirs(state, args.db)
    if run_as == "user" and not accounts.privileged():
        raise bad_value("--run-jobs-as", "user", "needs the service to run as root (it creates OS accounts and "
                                                 "starts jobs as them)")
    if run_as == "namespace" and accounts.privileged():
        raise bad_value("--run-jobs-as", "namespace", "is for a service that is not root: as root every job would "
                                                      "run as root; use --run-jobs-as user (per-user OS accounts, "
                                                      "the default for root) or start the service as an "
                                                      "unprivileged account")
    if run_as == "namespace":
        why = jobguard.available()
        if why:
            raise bad_value("--run-jobs-as", "namespace", f"{why}; pass --run-jobs-as service to run jobs "
                                                          "unisolated, as this service's account")
    from luban import interrupt

    with interrupt.sigterm_unwinds():  # a SIGTERM during start-up (a service manager's stop) cleans up too
        sock = _listen(args.host, args.port)
        existed, fresh = state.exists(), owned.owner(state) == "empty"
        mode = state.stat().st_mode & 0o7777 if existed else None
        try:
            engine = db.open_checked(args.db) if args.db else None  # a server: before the state folder exists
            owned.claim(state, "cluster-state", "--state")
            lock = lock if lock is not None else hold_state(state)  # a folder made just now
            try:
                os.chmod(state, 0o700)  # database, tokens, logs, run records: the service's alone
            except OSError as err:
                raise bad_value("--state", args.state, f"cannot make it private ({err.strerror})") from None
            if engine is None:
                engine = db.open_checked(str(state / "luban.db"))
            db_lock = hold_sqlite(args.db or str(state / "luban.db"))  # noqa: F841 - open for the service's life
            sessions = db.sessions(engine)
            options = ({"nodes": args.nodes, "gpus": args.gpus, "zones": args.zones, "node_group": args.node_group}
                       if args.executor == "local" else {"partition": args.partition, "state_dir": str(state)})
            settings = Settings(state_dir=str(state), url=args.public_url or service_url(args.host, args.port),
                                tick=args.tick, quantum=args.quantum, suspend_timeout=args.suspend_timeout,
                                sample_every=args.sample_every, run_jobs_as=run_as, on_shutdown=args.on_shutdown,
                                secret_dirs=hidden, max_log=args.max_log)
            executor = make(args.executor, **options)
            executor.check()  # what it needs is there (a missing Slurm client: one line now, not at the first job)
            scheduler = Scheduler(sessions, executor, settings)
            token_path = ensure_admin(sessions, state)
            app = create_app(sessions, scheduler, max_body=args.max_body, max_queued=args.max_queued,
                             body_timeout=args.body_timeout)
        except BaseException as err:
            sock.close()
            if isinstance(err, StateInUse):  # another service made the folder at the same moment: it is its
                raise
            if not existed:  # made by this start-up, which did not start: leave nothing behind
                shutil.rmtree(state, ignore_errors=True)
            elif fresh:  # an empty folder: empty again, its mode as it was
                for entry in state.iterdir():
                    shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink(missing_ok=True)
                os.chmod(state, mode)
            raise
    if run_as == "namespace":
        jobguard.undumpable()  # jobs share our uid: they must not read /proc/<service>/environ|mem|root
        print(f"luban cluster: not root: jobs run as this service's OS account ({getpass.getuser()}) in namespaces "
              f"that hide {', '.join(hidden)} and make {', '.join(jobguard.protected())} "
              "read-only; other files of this account stay writable to jobs (docs/platform.md); run as root "
              "for per-user accounts", file=sys.stderr, flush=True)
    if run_as == "service":
        fix = ("this service is root, so every job runs as root and can do anything on this machine; "
               "--run-jobs-as user (the default for root) gives per-user accounts" if accounts.privileged()
               else "run as root for per-user accounts")
        print("luban cluster: WARNING: jobs run as this service's own OS account "
              f"({getpass.getuser()}) and can read its state directory (tokens, database): "
              f"share it only with users you trust; {fix}", file=sys.stderr, flush=True)
    if token_path:
        print(f"luban cluster: admin token written to {token_path}", flush=True)
    with interrupt.own_handling():  # Ctrl-C: uvicorn's graceful shutdown, then one line and 130
        uvicorn.Server(uvicorn.Config(app, log_level=args.log_level, http=bounded_http(),
                                      backlog=ACCEPT_BATCH)).run(sockets=[sock])
    return 0


def cmd_trace(args) -> int:
    from luban.cluster import trace

    jobs = trace.synthetic(_trace_config(args))
    trace.save(jobs, args.output)
    print(for_terminal(f"wrote {len(jobs)} jobs to {args.output}", sys.stdout))
    return 0


def cmd_simulate(args) -> int:
    from luban.cluster import simulate, trace

    # not given: SimConfig's zones, or one per node when fewer (`--nodes 4` alone was refused for --zones = 10)
    zones = args.zones if args.zones is not None else min(simulate.SimConfig.zones, args.nodes)
    _check_zones(zones, args.nodes)
    if not args.trace:
        simulate.check_synthetic(args.jobs, args.days, args.nodes, args.tick)
    jobs = trace.load(args.trace) if args.trace else trace.synthetic(_trace_config(args))
    report = simulate.run(jobs, simulate.SimConfig(nodes=args.nodes, zones=zones, quantum=args.quantum,
                                                   tick=args.tick, checkpoint_s=args.checkpoint_s))
    print(json.dumps(report, indent=1) if args.json else simulate.format_report(report))
    return 0


def _trace_config(args):
    from luban.cluster import trace

    return trace.TraceConfig(**{key: getattr(args, key) for key in ("jobs", "days", "nodes", "users", "load", "seed")})


def register(subparsers) -> None:
    conn = argparse.ArgumentParser(add_help=False)
    text = schema.text()
    conn.add_argument("--url", type=schema.custom(text, text.allowed, shown=without_password), help="service URL (default $LUBAN_CLUSTER_URL or http://127.0.0.1:8765)")
    conn.add_argument("--token", type=schema.text(), help="API token (default $LUBAN_CLUSTER_TOKEN)")

    p = subparsers.add_parser("submit", parents=[conn], help="submit a job to the cluster scheduler")
    p.add_argument("-n", "--nodes", type=NODES, help="whole nodes")
    p.add_argument("-p", "--priority", type=_priority(auto=True), help="EXTREME_HIGH ... LOW, or AUTO")
    p.add_argument("--name", type=NAME)
    p.add_argument("--group", type=NAME, help="charge the job to this user group's quota")
    p.add_argument("--node-group", type=NAME)
    p.add_argument("--workdir", type=schema.text())
    p.add_argument("-e", "--env", action="append", default=[], type=schema.text(), help="KEY=VALUE (repeatable)")
    p.add_argument("-t", "--time", type=schema.custom(parse_duration, TIME_FORMS),
                   help="time limit of each attempt, as Slurm: MINUTES, H:MM:SS or D-HH:MM:SS")
    p.add_argument("--export", default="ALL", metavar="ALL|NONE|NAME,...", type=schema.text(),
                   help="environment for the job, as Slurm's --export: ALL (default) = yours, less tokens and "
                        "rank variables; NONE or NAME,... = exactly those (plus --env and luban's variables)")
    p.add_argument("--key", type=schema.text(SUBMIT_KEY_RE.pattern, f"a key matching {SUBMIT_KEY_RE.pattern}"),
                   help="idempotency key (default: a new one): a submission repeated with the same key and spec "
                        "makes no second job (an error that says the job may have been submitted ends with this "
                        "command and its key: run that)")
    p.add_argument("rest", nargs=argparse.REMAINDER, metavar="JOB.yaml | -- COMMAND ARGS...",
                   help="a job spec YAML (name, command, args, env, workdir, nodes, priority, group, node_group) "
                        "and/or a command after --")
    p.set_defaults(func=cmd_submit)

    p = subparsers.add_parser("jobs", parents=[conn], help="list your jobs (latest attempt of each chain)")
    p.add_argument("--all", action="store_true", help="every attempt, not only the latest")
    p.add_argument("--state", help="comma-separated states to show (queued, running, succeeded, ...)")
    p.add_argument("--limit", type=schema.integer(0, JOBS_LIMIT_MAX), default=JOBS_LIMIT, metavar="N",
                   help=f"show the newest N (default {JOBS_LIMIT}, at most {JOBS_LIMIT_MAX}); 0: all of them "
                        "(fetched in pages); a line on stderr says how many were left out")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_jobs)

    p = subparsers.add_parser("logs", parents=[conn], help="print a job's log (all attempts of its chain)")
    p.add_argument("job", type=JOB_ID)
    p.add_argument("-f", "--follow", action="store_true", help="keep printing until the chain ends")
    p.add_argument("--rank", type=schema.integer(0, schema.CLUSTER_NODES[1] - 1), default=0)
    p.add_argument("--raw", action="store_true", help="on a terminal too, print control characters as the job "
                   "wrote them (default there: escaped, ESC as \\x1b, so a job's output cannot drive the terminal)")
    p.set_defaults(func=cmd_logs)

    for name, text in (("stop", "stop jobs"), ("suspend", "suspend jobs (checkpoint, requeue)")):
        p = subparsers.add_parser(name, parents=[conn], help=text)
        p.add_argument("jobs", nargs="+", type=JOB_ID)
        p.add_argument("--no-wait", action="store_true", help="return once requested, not when the job has ended")
        p.add_argument("--timeout", type=schema.number(0, MAX_TIME_LIMIT), default=900.0, help="seconds to wait for the end (default 900)")
        p.set_defaults(func=cmd_stop, command_name=name)

    for name, text in (("hold", "keep queued jobs from starting"), ("release", "let held jobs start")):
        p = subparsers.add_parser(name, parents=[conn], help=text)
        p.add_argument("jobs", nargs="+", type=JOB_ID)
        p.set_defaults(func=cmd_hold, command_name=name)

    p = subparsers.add_parser("usage", parents=[conn], help="node-hours per user over a period (like sreport)")
    p.add_argument("--days", type=schema.number(0, 36500, open_lo=True), default=30.0, help="the period: the last N days (default 30)")
    p.add_argument("--by", choices=["user", "owner"], default="user", help="owner: per quota owner (user:/group:)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_usage)

    p = subparsers.add_parser("nodes", parents=[conn], help="list nodes and the jobs on them")
    p.set_defaults(func=cmd_nodes)
    p = subparsers.add_parser("quota", parents=[conn], help="show quotas and their use")
    p.set_defaults(func=cmd_quota)

    admin = subparsers.add_parser("admin", help="manage users, groups, quotas and nodes (admin token)")
    what = admin.add_subparsers(dest="what", required=True, metavar="WHAT")
    user = what.add_parser("user").add_subparsers(dest="action", required=True, metavar="ACTION")
    p = user.add_parser("add", parents=[conn], help="create a user; prints its token")
    p.add_argument("name", type=NAME)
    p.add_argument("--admin", action="store_true")
    p.add_argument("--os-user", type=schema.text(),
                   help="user add: run this user's jobs as this existing OS account (service as root)")
    p.add_argument("--group", type=NAME)
    p = user.add_parser("token", parents=[conn], help="issue a new token (the old one stops working)")
    p.add_argument("name", type=NAME)
    p = user.add_parser("set", parents=[conn], help="move a user to a group (--group G) or out of any (--no-group)")
    p.add_argument("name", type=NAME)
    moved = p.add_mutually_exclusive_group(required=True)  # a bare `set NAME` took the user out of its group
    moved.add_argument("--group", type=NAME)
    moved.add_argument("--no-group", action="store_true", help="take the user out of its group")
    user.add_parser("list", parents=[conn])
    group = what.add_parser("group").add_subparsers(dest="action", required=True, metavar="ACTION")
    p = group.add_parser("add", parents=[conn])
    p.add_argument("name", type=NAME)
    p.add_argument("--data-dir", type=schema.text())
    p.add_argument("--env-dir", type=schema.text())
    group.add_parser("list", parents=[conn])
    quota = what.add_parser("quota").add_subparsers(dest="action", required=True, metavar="ACTION")
    p = quota.add_parser("set", parents=[conn], help="OWNER (user:NAME or group:NAME) PRIORITY NODES")
    p.add_argument("owner", type=schema.text(f"(user|group):{NAME_RE.pattern.strip('^$')}",
                                             "user:NAME or group:NAME"))
    p.add_argument("priority", type=_priority(auto=False))
    p.add_argument("nodes", type=schema.integer(0, schema.CLUSTER_NODES[1]))
    p.add_argument("--node-group", type=NAME, help="default: the nodes' group when the cluster has one")
    node = what.add_parser("node").add_subparsers(dest="action", required=True, metavar="ACTION")
    for action in ("drain", "down", "up"):
        node.add_parser(action, parents=[conn]).add_argument("name", type=schema.text())
    admin.set_defaults(func=cmd_admin)

    cluster = subparsers.add_parser("cluster", help="run the scheduler service, simulate, make traces")
    sub = cluster.add_subparsers(dest="cluster_command", required=True, metavar="ACTION")
    p = sub.add_parser("serve", help="run the scheduler and its HTTP API")
    p.add_argument("--state", default="luban-cluster", type=schema.path("new-dir"),
                   help="state directory (logs, SQLite file, admin token)")
    p.add_argument("--db", type=schema.custom(_db_url, DB_URL, shown=without_password),
                   help=f"database URL (postgresql://...); default ${DB_ENV}, else STATE/luban.db (SQLite); "
                        "where jobs run as per-user accounts, a password goes in ~/.pgpass or that variable, "
                        "never on the command line (ps shows it to every job)")
    p.add_argument("--host", default="127.0.0.1", type=schema.text())
    p.add_argument("--port", type=schema.integer(1, schema.PORT[1]), default=8765)
    p.add_argument("--public-url", type=schema.custom(_public_url, PUBLIC_URL, shown=without_password), help="URL jobs use to reach the service (default http://HOST:PORT)")
    p.add_argument("--executor", choices=["local", "slurm"], default="local")
    p.add_argument("--nodes", type=NODES, default=1, help="local: virtual nodes on this machine")
    p.add_argument("--gpus", type=schema.integer(0, 1024), default=0, help="local: GPUs per virtual node")
    p.add_argument("--zones", type=NODES, default=1, help="local: network zones the nodes are split into (<= --nodes)")
    p.add_argument("--node-group", default="default", type=NAME, help="local: the nodes' group")
    p.add_argument("--partition", type=schema.text(), help="slurm: only this partition's nodes")
    p.add_argument("--tick", type=schema.number(0.01, 3600), default=1.0,
                   help="seconds between scheduling ticks (from 0.01: a smaller tick is a busy loop)")
    p.add_argument("--quantum", type=QUANTUM, default=3600.0, help="time-sharing quantum, seconds (inf: none)")
    p.add_argument("--suspend-timeout", type=SECONDS, default=600.0, help="seconds to checkpoint before a kill")
    p.add_argument("--sample-every", type=SECONDS, default=10.0, help="seconds between occupancy samples")
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--on-shutdown", choices=["keep", "kill"], default="keep",
                   help="keep (default): jobs run on and are adopted when the service starts again; "
                        "kill: stop every job (all its processes) before the service exits")
    p.add_argument("--run-jobs-as", choices=["user", "namespace", "service"], default=None,
                   help="user: each user's own OS account (default when root); namespace: this service's account "
                        "in namespaces that hide its state (default otherwise); service: this service's account, "
                        "unisolated")
    p.add_argument("--max-body", type=schema.integer(1024, 1 << 30), default=1 << 20, help="largest request body in bytes (default 1 MiB)")
    p.add_argument("--body-timeout", type=schema.number(0.1, 3600), default=30.0, metavar="SECONDS",
                   help="seconds a request's whole body has to arrive; past it one-line 408, connection closed "
                        "(default 30)")
    p.add_argument("--max-queued", type=schema.integer(1, 10_000_000), default=1000, help="queued jobs one user may have (default 1000)")
    p.add_argument("--max-log", type=schema.integer(joblog.MIN_LOG, 1 << 50), default=joblog.MAX_LOG, metavar="BYTES",
                   help="bytes of each rank's log of a job (all its attempts); past it the job's output is dropped "
                        "and one line says so: a job cannot fill the state folder's disk (default 1 GiB)")
    p.set_defaults(func=cmd_serve)

    sim_args = argparse.ArgumentParser(add_help=False)
    limits = traces.LIMITS
    sim_args.add_argument("--jobs", type=limits["jobs"], default=10_000)
    sim_args.add_argument("--days", type=limits["days"], default=30.0)
    sim_args.add_argument("--nodes", type=limits["nodes"], default=1000)
    sim_args.add_argument("--users", type=limits["users"], default=50)
    sim_args.add_argument("--load", type=limits["load"], default=0.9, help="offered load / capacity")
    sim_args.add_argument("--seed", type=limits["seed"], default=0)
    p = sub.add_parser("trace", parents=[sim_args], help="write a synthetic job trace (JSON lines)")
    p.add_argument("-o", "--output", required=True, type=schema.path("new-file"))
    p.set_defaults(func=cmd_trace)
    p = sub.add_parser("simulate", parents=[sim_args], help="replay a trace through the policy in virtual time")
    p.add_argument("--trace", type=schema.path("file"),
                   help="JSON-lines trace (default: a synthetic one from the options; make one with luban cluster trace)")
    p.add_argument("--zones", type=NODES, help="network zones the nodes are split into (<= --nodes; default 10, "
                                               "or --nodes when fewer)")
    p.add_argument("--quantum", type=QUANTUM, default=4 * 3600.0, help="time-sharing quantum (inf: none)")
    p.add_argument("--tick", type=SECONDS, default=60.0, help="virtual seconds between ticks")
    p.add_argument("--checkpoint-s", type=SECONDS, default=120.0, help="virtual seconds a job needs to suspend")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_simulate)
