"""The HTTP API (FastAPI) in front of the database; the scheduler runs in a thread beside it.

Every call needs ``Authorization: Bearer TOKEN``: a user's token, or the per-attempt job token
the executor hands to a running job (valid only for that job's own SDK calls). Users see and
control their own jobs and their group's group jobs; admins see and control everything, and
alone manage users, groups, quotas and nodes. A bad spec is a 422 naming the key and value.
"""

from __future__ import annotations

import asyncio
import contextlib
import pwd
import stat
import json
import logging
import re
import math
import dataclasses
import os
import secrets
import time
from pathlib import Path

from fastapi import Depends, FastAPI, Header, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from sqlalchemy import and_, exists, func, or_, select
from sqlalchemy.exc import IntegrityError, OperationalError
from sqlalchemy.orm import Session, aliased, sessionmaker

from luban import jobenv
from luban.cluster import accounts, jobcheck, joblog
from luban.cluster import clock as clocks
from luban.cluster import priority as prio
from luban.cluster import spec as specs
from luban.cluster import states
from luban.cluster.client import SERVICE_HEADER  # on every answer: clients know they reach luban
from luban.cluster.client import TOTAL_HEADER  # GET /api/jobs: how many rows in all
from luban.cluster.client import SUBMIT_KEY_HEADER  # POST /api/jobs: a submission made at most once
from luban.cluster.spec import JOBS_LIMIT, JOBS_LIMIT_MAX  # GET /api/jobs: rows
from luban.cluster.models import ACTIVE, LIVE, Event, Job, Node, Quota, Sample, StopReason, User, UserGroup
from luban.cluster.scheduler import GONE, Scheduler, follow_executor, new_token, record, token_hash
from luban.errors import LubanError, bad_value, shown
from luban.schema import INT32  # the SQL Integer columns; the CLI checks ids against it too

DASHBOARD = Path(__file__).with_name("dashboard")
LOG_CHUNK = 1 << 20
MAX_BODY = 1 << 20            # bytes of a request body (--max-body); checked before reading it
MAX_QUEUED_PER_USER = 1000    # queued attempts one user may have (--max-queued)
ID_MAX = INT32[1]


def int_field(body: dict, key: str, lo: int, hi: int, default=None) -> int:
    """A JSON integer (not a bool, not a float) in [lo, hi], or a one-line 422."""
    value = body.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise bad_value(key, value, f"an integer from {lo} to {hi}")
    return value


def str_field(body: dict, key: str, optional: bool = False, limit: int = 4096) -> str | None:
    value = body.get(key)
    if value is None and optional:
        return None
    if not isinstance(value, str) or not value or len(value) > limit:
        raise bad_value(key, value if not isinstance(value, str) else value[:80], f"a string of 1 to {limit} characters")
    return value


def object_body(body) -> dict:
    if not isinstance(body, dict):
        raise bad_value("body", type(body).__name__, "a JSON object")
    return body


JSON_BODY = "a JSON object (Content-Type: application/json)"  # what every call with a body takes
BODY_SHOWN = 60  # characters (or bytes) of a body that cannot be read shown in the one-line answer


def parse_body(raw: bytes, content_type: str | None) -> dict:
    """A request body as a JSON object, or a one-line 422 that says what is wrong with it: the
    Content-Type, UTF-8, the JSON (line and column), nesting or an integer too long to convert
    (FastAPI's own parsing answered '1 = {}: JSON decode error', or a 400 naming nothing)."""
    kind = (content_type or "").split(";")[0].strip().lower()
    if kind != "application/json" and not (kind.startswith("application/") and kind.endswith("+json")):
        raise bad_value("Content-Type", content_type or "(none)", f"application/json: the body is {JSON_BODY}")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise bad_value("body", raw[:BODY_SHOWN], f"{JSON_BODY}; byte {err.start} is not UTF-8") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise bad_value("body", text[:BODY_SHOWN], f"{JSON_BODY}; invalid JSON at line {err.lineno} "
                                                   f"column {err.colno}: {err.msg}") from None
    except RecursionError:
        raise bad_value("body", text[:BODY_SHOWN], f"{JSON_BODY}; nested too deeply") from None
    except ValueError as err:  # an integer of more digits than int() converts (sys.get_int_max_str_digits)
        raise bad_value("body", text[:BODY_SHOWN], f"{JSON_BODY}; {str(err).split(';')[0]}") from None
    if not isinstance(value, dict):
        raise bad_value("body", text[:BODY_SHOWN], JSON_BODY)
    return value


async def json_body(request: Request) -> dict:
    """The request's body, read and checked by ``parse_body`` (a dependency in place of ``body: dict``)."""
    return parse_body(await request.body(), request.headers.get("content-type"))


@dataclasses.dataclass
class Principal:
    user: User
    job_id: int | None = None  # set for a job token: only that job's own SDK calls are allowed


def node_hours(job: Job, since: float = 0.0, until: float | None = None, now: float | None = None) -> float:
    """Node-hours the attempt held nodes within [since, until] (until: now, the service's clock)."""
    if job.started_at is None:
        return 0.0
    end = job.ended_at if job.ended_at is not None else (now if now is not None else clocks.now())
    end = min(end, until) if until is not None else end
    return max(0.0, end - max(job.started_at, since)) * job.nnodes / 3600.0


HIDDEN_ENV = "(hidden: another user's)"  # an env value of a group member's job, as its group sees it


def job_dict(job: Job, viewer: User | None = None) -> dict:
    """A job as the API answers it; to ``viewer`` (not its owner, nor an admin: a member of its group) its
    spec's ``env`` values read ``HIDDEN_ENV``: ``--export ALL`` sends the submitter's whole environment (an
    ``HF_TOKEN``, a cloud key), and every member of the group read it (a review of 2026-12-04)."""
    spec = job.spec
    if viewer is not None and viewer.name != job.user and not viewer.is_admin and isinstance(spec.get("env"), dict):
        spec = {**spec, "env": dict.fromkeys(spec["env"], HIDDEN_ENV)}
    return {k: getattr(job, k) for k in (
        "id", "chain_id", "first_id", "restart_count", "whole_life_state", "user", "group", "name",
        "priority", "node_group", "nnodes", "state", "stop_reason", "reason", "chain_submitted_at", "place",
        "queued_at", "started_at", "ended_at", "exit_code", "nodes")} | {"spec": spec} | {
        "priority_name": prio.Priority(job.priority).name, "node_hours": round(node_hours(job), 4),
        "held": bool(job.requested & StopReason.HOLD) and job.state == states.QUEUED,  # a stopped job is not held
        "stop_reasons": [f.name for f in StopReason if job.stop_reason & f]}


def ensure_admin(sessions: sessionmaker, state_dir: Path) -> Path | None:
    """First start: create user ``admin`` and write its token to STATE/admin.token (mode 600)."""
    path = state_dir / "admin.token"
    try:
        with sessions.begin() as s:
            if s.scalar(select(func.count()).select_from(User)):
                return None
            token = new_token()
            s.add(User(name="admin", token_hash=token_hash(token), is_admin=True))
            s.flush()  # another service starting on this database at once: IntegrityError here, not later
            # the token is on disk before the user is committed: a kill between the two leaves a
            # token no user has (the next start makes both again), never an admin no one can act as
            tmp = path.with_name(f".admin.token.{os.getpid()}")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(token + "\n")
            os.replace(tmp, path)
    except IntegrityError:
        return None  # the other service made the admin (its token is in its own state folder)
    return path


TOKEN_IN_QUERY = re.compile(r"(token=)[^&\s]*")


class _RedactTokens(logging.Filter):
    """Access-log lines show ``?token=***``, never the token (the dashboard's login link has one)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(TOKEN_IN_QUERY.sub(r"\1***", a) if isinstance(a, str) else a for a in record.args)
        record.msg = TOKEN_IN_QUERY.sub(r"\1***", str(record.msg))
        return True


def redact_access_log() -> None:
    for name in ("uvicorn.access", "uvicorn.error", "uvicorn"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _RedactTokens) for f in logger.filters):
            logger.addFilter(_RedactTokens())


def database_unavailable(err: OperationalError) -> str:
    """The one answer (503) to a request the database cannot serve now (a PostgreSQL restart, a
    SQLite file locked past its timeout), wherever it fails: the cause goes to the service log in
    one line, the client gets a retryable status (the SDK rides it out, ``client.RETRY_STATUS``)."""
    log = logging.getLogger("luban.cluster")
    log.warning("database error: %s", " ".join(str(getattr(err, "orig", err)).split())[:300])
    return "the service's database is unavailable now; retry later (the service log says why)"


BODY_TIMEOUT_S = 30.0       # seconds a request's whole body has, from the moment the service starts reading it
                            # (--body-timeout): a body trickled a byte at a time, or never sent, held its
                            # connection and request forever (the head's bound, HEAD_TIMEOUT_S, ends where it starts)


class Guard:
    """ASGI middleware in front of every request that has a body: the size is checked against
    ``max_body`` before a byte is read (Content-Length, or counted while a chunked body arrives),
    the token before the body is parsed — an anonymous 60 MiB body costs one header read — and
    the whole body must arrive within ``body_timeout`` seconds of the first read (else one-line
    408). Every refusal here closes the connection (``Connection: close``): what the client still
    sends is not read."""

    def __init__(self, app, max_body: int, authenticate, body_timeout: float = BODY_TIMEOUT_S):
        self.app, self.max_body, self.authenticate = app, max_body, authenticate
        self.body_timeout = body_timeout

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        send = _signed(send)
        if scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        length = headers.get(b"content-length", b"0")
        if not length.isdigit() or int(length) > self.max_body:
            return await self._reject(send, 413, f"request body of {length.decode(errors='replace')} bytes: "
                                                 f"at most {self.max_body} bytes")
        from starlette.concurrency import run_in_threadpool

        auth = headers.get(b"authorization", b"").decode(errors="replace")
        token = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
        try:  # out here the app's exception handlers do not apply: a database outage was a bare 500
            known = bool(token) and await run_in_threadpool(self.authenticate, token) is not None
        except OperationalError as err:
            return await self._reject(send, 503, database_unavailable(err))
        if not known:
            return await self._reject(send, 401, "missing or invalid bearer token (Authorization: Bearer TOKEN)")
        seen, rejected, deadline = 0, False, None

        async def counted():
            nonlocal seen, rejected, deadline
            if rejected:
                return {"type": "http.disconnect"}
            loop = asyncio.get_running_loop()
            if deadline is None:  # from the app's first read: the time it took to get there is not the client's
                deadline = loop.time() + self.body_timeout
            try:  # a body already received is returned at once, whatever is left of the deadline
                async with asyncio.timeout(max(0.0, deadline - loop.time())):
                    message = await receive()
            except TimeoutError:
                rejected = True
                await self._reject(send, 408, f"request body of {seen} bytes so far not complete within "
                                              f"{self.body_timeout:g}s: send the whole body at once")
                return {"type": "http.disconnect"}
            seen += len(message.get("body", b""))
            if seen > self.max_body and not rejected:
                rejected = True
                await self._reject(send, 413, f"request body over {self.max_body} bytes")
                return {"type": "http.disconnect"}
            return message

        async def unless_rejected(message):  # the 413 is the answer: the app's own reply is dropped
            if not rejected:
                await send(message)

        try:
            await self.app(scope, counted, unless_rejected)
        except Exception:
            if not rejected:
                raise
            # the app saw the body end early (ClientDisconnect) after our 413: expected, not logged

    @staticmethod
    async def _reject(send, status: int, detail: str) -> None:
        body = json.dumps({"detail": detail}).encode()
        await send({"type": "http.response.start", "status": status,  # the rest of the body is not read: close
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


HEAD_TIMEOUT_S = 10.0       # seconds a connection has to send a request's head (line and headers), when it
                            # opens and after each answer: a client that never finishes one (slowloris) is cut
CONNECTION_SHARE = 2        # at most 1/2 of the open-file limit in connections: the rest stays for the
                            # database, job launches and logs (a flood of idle connections made launches fail)
ACCEPT_BATCH = 64           # connections accepted per turn of the event loop (uvicorn's backlog, 2048 by default,
                            # took a whole burst of them before any could be refused for the cap above)


def connection_cap() -> int:
    """Open connections the service keeps at once; past it a new connection is closed at once."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(16, (soft if soft != resource.RLIM_INFINITY else 1 << 16) // CONNECTION_SHARE)


def bounded_http():
    """uvicorn's h11 protocol with the two bounds above (uvicorn has neither: an idle or half-sent
    request held its connection forever, and a thousand of them took every file descriptor)."""
    import asyncio

    from uvicorn.protocols.http.h11_impl import H11Protocol

    cap = connection_cap()

    class BoundedH11(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None
        _cycle_at_arm = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > cap:
                transport.close()
                return
            self._arm()

        def _arm(self) -> None:
            self._disarm()
            self._cycle_at_arm = self.cycle
            self._head_timer = self.loop.call_later(HEAD_TIMEOUT_S, self._head_timed_out)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timed_out(self) -> None:
            if not self.transport.is_closing():
                self.transport.close()

        def handle_events(self) -> None:
            super().handle_events()
            if self.cycle is not self._cycle_at_arm:  # a request's head arrived: the app has it now
                self._disarm()

        def on_response_complete(self) -> None:
            self._arm()  # first: a pipelined request handled inside super() disarms it again
            super().on_response_complete()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

    return BoundedH11


def _signed(send):
    """``send`` that adds ``SERVICE_HEADER`` to the response's headers (``client.Client`` refuses,
    in one line, a successful answer without it: a web server or another API at the URL)."""
    async def signed(message):
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), (SERVICE_HEADER.encode(), b"1")]}
        await send(message)

    return signed


METRIC_KEYS = ("step", "loss", "val_loss", "tokens_per_s", "mfu", "time_step_s", "tokens")
MAX_METRICS = 16 << 20  # bytes of metrics.jsonl the service reads for a job page


def _read_json(path: Path, owner: str | None, lines: bool = False) -> list[dict]:
    """JSON objects from a file a job named: no symlinks, owned by ``owner`` (per-user mode),
    at most MAX_METRICS bytes; anything else reads as nothing."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return []
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or (owner is not None and st.st_uid != pwd.getpwnam(owner).pw_uid):
            return []
        f.seek(max(0, st.st_size - MAX_METRICS))
        text = f.read(MAX_METRICS).decode(errors="replace")
    out = []
    for chunk in (text.splitlines() if lines else [text]):
        try:
            value = json.loads(chunk)
        except ValueError:
            continue
        if isinstance(value, dict):
            out.append(value)
    return out


def conflict(job_id: int, why: str) -> HTTPException:
    """A request the job's state does not allow now (a release of a job not held, a stop of an ended
    one): 409, in the one-line form ``job = ID: <why>``; nothing was changed."""
    return HTTPException(409, str(bad_value("job", job_id, why)))


def hold_refusal(job: Job, hold: bool, admin: bool, over_user: bool) -> str | None:
    """Why ``job`` (a chain's latest attempt) cannot be held (``hold``) or released now by a user
    (``admin``: an admin; ``over_user``: an admin, on another user's job); None: it can. Only a queued
    attempt is held or released (a started one is stopped or suspended instead: its next attempt can
    be held), each only once, not while a stop of it is under way; a hold an admin put on another
    user's job is released only by an admin, and an admin's hold on a job its user holds makes it one."""
    action = "held" if hold else "released"
    if job.state != states.QUEUED:
        return f"is {job.state}; only a queued job can be {action}" + (
            " (it is not held)" if not hold else "")
    if job.requested & (StopReason.USER_STOP | StopReason.ADMIN_STOP):
        return f"is being stopped; it cannot be {action}"
    held = bool(job.requested & StopReason.HOLD)
    if hold and held and not (over_user and not job.requested & StopReason.ADMIN_HOLD):
        return f"is already held; luban release {job.id} lets it start"
    if not hold and not held:
        return "is queued and not held; only a held job can be released"
    if not hold and job.requested & StopReason.ADMIN_HOLD and not admin:
        return "is held by an admin; only an admin can release it"
    return None


def check_command(spec: specs.JobSpec, account: str) -> None:
    """Refuse, in one line, a job whose OS account could not start its command (``jobcheck``):
    the job's environment is the one the scheduler will give it (``Scheduler.job_env``)."""
    try:
        who = accounts.identity(account)
    except KeyError:
        return  # the launcher says "cannot run as" (an admin's mapping, not the submitter's doing)
    env = {**jobenv.base_environment(spec.to_dict()), **jobenv.without_own(spec.env)}
    why = jobcheck.problem(spec.command, env, spec.workdir, who)
    if why is not None:
        raise LubanError(why)


def create_app(sessions: sessionmaker, scheduler: Scheduler, run_scheduler: bool = True,
               max_body: int = MAX_BODY, max_queued: int = MAX_QUEUED_PER_USER,
               body_timeout: float = BODY_TIMEOUT_S) -> FastAPI:
    state_dir = Path(scheduler.settings.state_dir)
    per_user = scheduler.settings.run_jobs_as == "user"

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        scheduler.refresh_nodes(scheduler.clock.now())  # slurmctld down at start-up: the ticks ask again
        if run_scheduler:
            scheduler.start()
        yield
        scheduler.stop()
        if scheduler.settings.on_shutdown == "kill":
            scheduler.kill_all()

    # no /docs, /redoc, /openapi.json: they answered without a token (every call needs one) and /docs
    # loads Swagger UI from a CDN
    app = FastAPI(title="luban cluster", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(LubanError)
    async def _bad_input(_request, err: LubanError):
        return JSONResponse(status_code=422, content={"detail": str(err)})

    @app.exception_handler(IntegrityError)
    async def _conflict(_request, _err: IntegrityError):  # two admins adding one user at once (PostgreSQL)
        return JSONResponse(status_code=409, content={"detail": "the request conflicts with a change made at the "
                                                                "same moment (the name exists now?): look, then retry"})

    @app.exception_handler(OperationalError)
    async def _no_database(_request, err: OperationalError):
        return JSONResponse(status_code=503, content={"detail": database_unavailable(err)})

    @app.exception_handler(RequestValidationError)
    async def _bad_request(_request, err: RequestValidationError):
        first = err.errors()[0] if err.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ()) if x not in ("body", "query", "path"))
        value = first.get("input")
        shown = repr(value if not isinstance(value, str) else value[:80])[:100]  # one line, whatever was sent
        return JSONResponse(status_code=422, content={"detail": f"{where or 'request'} = {shown}: "
                                                                f"{' '.join(str(first.get('msg')).split())}"})


    def db():
        with sessions() as s:
            yield s

    def lookup(token: str) -> Principal | None:
        if len(token) > 256:
            return None
        digest = token_hash(token)
        with sessions() as s:  # closed before the handler opens its own transaction
            user = s.scalar(select(User).where(User.token_hash == digest))
            if user is not None:
                return Principal(user)
            job = s.scalar(select(Job).where(Job.token_hash == digest))
            if job is not None:
                return Principal(s.get(User, job.user), job.id)
        return None

    app.add_middleware(Guard, max_body=max_body, authenticate=lookup, body_timeout=body_timeout)
    redact_access_log()

    def principal(request: Request) -> Principal:
        header = request.headers.get("authorization", "")
        token = header[7:].strip() if header.lower().startswith("bearer ") else request.query_params.get("token")
        if not token:
            raise HTTPException(401, "missing bearer token (Authorization: Bearer TOKEN)")
        found = lookup(token)
        if found is None:
            raise HTTPException(401, "invalid token")
        return found

    def person(p: Principal = Depends(principal)) -> Principal:
        if p.job_id is not None:
            raise HTTPException(403, "a job token may only call its own job's SDK endpoints")
        return p

    def admin(p: Principal = Depends(person)) -> Principal:
        if not p.user.is_admin:
            raise HTTPException(403, f"user {p.user.name} is not an admin")
        return p

    def visible(p: Principal):
        if p.user.is_admin:
            return True
        mine = Job.user == p.user.name
        return or_(mine, Job.group == p.user.group) if p.user.group else mine

    def get_job(s: Session, p: Principal, job_id: int, latest: bool = False, lock: bool = False) -> Job:
        """``lock``: the row locked (FOR UPDATE) until the transaction ends, for a request that reads the
        job's flags and writes them back: two at once (a stop and a hold) each wrote its own over the
        other's on PostgreSQL, and one was lost."""
        job = s.get(Job, job_id, with_for_update=lock) if 1 <= job_id <= ID_MAX else None
        allowed = job is not None and (p.user.is_admin or job.user == p.user.name
                                       or (job.group is not None and job.group == p.user.group))
        if p.job_id is not None:
            allowed = allowed and job.id == p.job_id
        if not allowed:
            raise HTTPException(404, f"job {job_id} not found")
        if latest:
            newest = select(Job).where(Job.chain_id == job.chain_id).order_by(Job.id.desc()).limit(1)
            return s.scalars(newest.with_for_update() if lock else newest).first()
        return job

    # -- jobs --------------------------------------------------------------------------------
    @app.get("/api/whoami")
    def whoami(p: Principal = Depends(principal)):
        return {"user": p.user.name, "admin": p.user.is_admin, "group": p.user.group, "job_id": p.job_id}

    @app.post("/api/jobs", status_code=201)
    def submit(p: Principal = Depends(person), body: dict = Depends(json_body),
               key: str | None = Header(None, alias=SUBMIT_KEY_HEADER)):
        """A new job (201); with an ``Idempotency-Key`` the submission is made at most once per user and
        key: a repeat (the client's retry of a POST it got no answer to) answers the job that key made,
        as its chain's latest attempt (200, ``repeated``: true; ``first_id`` is the id it was made with), and the key with another spec is a one-line 409 — for
        ``SUBMIT_KEY_TTL_S`` after that job's submission; later the key is free again: the old job's
        key is cleared and a new job takes it (``jobs.submit_key`` stays unique per user)."""
        body = object_body(body)
        if key is not None and not specs.SUBMIT_KEY_RE.fullmatch(key):
            raise bad_value(SUBMIT_KEY_HEADER, key[:80], f"a key matching {specs.SUBMIT_KEY_RE.pattern} (a uuid4)")
        if "yaml" in body:
            spec = specs.parse_yaml(str_field(body, "yaml", limit=specs.MAX_YAML))
        else:
            spec = specs.parse(body.get("spec"))
        if per_user and not p.user.os_user:  # (the first start's admin) its jobs would run as the service: root
            raise HTTPException(403, str(bad_value(
                "user", p.user.name, "a user with an OS account to run jobs as: jobs run as per-user OS accounts "
                                     "here, never as root, and this one has none (made at the service's first "
                                     "start, to administer it); submit as a user made with luban admin user add")))
        if per_user and getattr(scheduler.executor, "runs_here", False):
            check_command(spec, p.user.os_user)  # file system reads: outside the (serialised) transaction
        with sessions.begin() as s:
            # the user's row locked: one submission of a user at a time, so the queued count below holds
            # under concurrent submissions (PostgreSQL; SQLite serialises every write transaction anyway)
            user = s.get(User, p.user.name, with_for_update={"key_share": True})  # FOR NO KEY UPDATE
            now = clocks.now()
            known = sorted(set(s.scalars(select(Node.node_group))))
            if spec.node_group is None:
                spec.node_group = known[0] if len(known) == 1 else "default"
            if key is not None:  # before the limits: the job this key made counts against them already
                made = s.scalar(select(Job).where(Job.user == user.name, Job.submit_key == key))
                if made is not None and now - made.chain_submitted_at >= specs.SUBMIT_KEY_TTL_S:
                    made.submit_key = None  # expired: free for the job made below (the user's row lock and
                    s.flush()  # the unique index keep it one job per key); flushed before that INSERT
                    made = None
                if made is not None:
                    differ = sorted(k for k in set(made.spec) | set(spec.to_dict())
                                    if made.spec.get(k) != spec.to_dict().get(k))
                    if differ:  # (`luban submit` sends the submitter's environment: another shell's differs)
                        raise HTTPException(409, str(bad_value(
                            SUBMIT_KEY_HEADER, key, f"already submitted job {made.id} with another spec ("
                                                    f"{', '.join(differ)} differ); a new submission needs a new key "
                                                    f"(a key is free again {specs.SUBMIT_KEY_TTL_S // 3600} h after "
                                                    "its job was submitted)")))
                    latest = s.scalar(select(Job).where(Job.chain_id == made.chain_id).order_by(Job.id.desc())
                                      .limit(1))  # the chain as it is now: its latest attempt (a requeue's)
                    return JSONResponse(status_code=200, content=job_dict(latest) | {"repeated": True})
            queued = s.scalar(select(func.count()).select_from(Job).where(Job.user == user.name,
                                                                           Job.state == states.QUEUED))
            if queued >= max_queued:
                raise HTTPException(429, f"user {user.name} already has {queued} queued jobs (the limit is "
                                         f"{max_queued}); wait for some to start or stop some")
            if spec.group is not None and spec.group != user.group:
                raise bad_value("group", spec.group, "you are not a member (" + (
                    f"your group: {user.group})" if user.group else "you are in no group)"))
            size = s.scalar(select(func.count()).select_from(Node).where(Node.node_group == spec.node_group))
            if not size:
                raise bad_value("node_group", spec.node_group, f"unknown; node groups: {', '.join(known)}")
            if spec.nodes > size:
                raise bad_value("nodes", spec.nodes, f"at most {size} (the size of node group {spec.node_group})")
            owner = f"group:{spec.group}" if spec.group else f"user:{user.name}"
            quota = {q.priority: q.nodes for q in s.scalars(select(Quota).where(
                Quota.owner == owner, Quota.node_group == spec.node_group))}
            level = prio.parse(spec.priority)
            if level == prio.AUTO:
                used = dict(s.execute(select(Job.priority, func.sum(Job.nnodes)).where(
                    Job.owner == owner, Job.node_group == spec.node_group, Job.state.in_(ACTIVE)
                ).group_by(Job.priority)).all())
                level = prio.resolve_auto(quota, used, spec.nodes)
                if level is None:
                    raise bad_value("priority", "AUTO", f"{owner} has no quota for {spec.nodes} node(s) "
                                                        f"at any level in node group {spec.node_group}")
            if quota.get(level, 0) < spec.nodes:
                have = ", ".join(f"{prio.Priority(k).name}={v}" for k, v in sorted(quota.items())) or "none"
                raise bad_value("priority", level.name, f"{owner} may hold {quota.get(level, 0)} node(s) at "
                                f"{level.name} in node group {spec.node_group}, the job needs {spec.nodes} "
                                f"(quotas: {have})")
            job = Job(chain_id="c" + secrets.token_hex(6), restart_count=0, whole_life_state=0,
                      user=user.name, group=spec.group, owner=owner, name=spec.name, spec=spec.to_dict(),
                      priority=int(level), node_group=spec.node_group, nnodes=spec.nodes, state=states.QUEUED,
                      chain_submitted_at=now, place=now, queued_at=now, nodes=[], requested=0, stop_reason=0,
                      reason="queued", submit_key=key)
            s.add(job)
            s.flush()
            job.first_id = job.id
            record(s, "submit", f"{spec.name} by {user.name}: {spec.nodes} node(s) at {level.name}", job.id)
            return job_dict(job)

    @app.get("/api/jobs")
    def jobs(response: Response, all: bool = False, state: str | None = None, limit: int = JOBS_LIMIT,
             before: int | None = None, p: Principal = Depends(person), s: Session = Depends(db)):
        """The newest ``limit`` visible rows by id (before ``before``, when given: the next page), in
        ascending id order: the latest attempt of each chain, or with ``all`` every attempt. The
        ``X-Total-Count`` header is how many rows match in all (``before`` aside), so a caller
        knows what was left out. Selection, order and limit are SQL: the table grows with every
        job ever run, an answer does not."""
        if not 1 <= limit <= JOBS_LIMIT_MAX:
            raise bad_value("limit", limit, f"an integer from 1 to {JOBS_LIMIT_MAX} (rows, newest first; "
                                            "page further with before=ID)")
        if before is not None and not 1 <= before <= ID_MAX:
            raise bad_value("before", before, f"a job id from 1 to {ID_MAX} (rows with smaller ids)")
        match = [visible(p)]
        if state:
            wanted = state.split(",")
            for name in wanted:
                if name not in [x.value for x in states.JobState]:
                    raise bad_value("state", name, "one of " + ", ".join(x.value for x in states.JobState))
            match.append(Job.state.in_(wanted))
        if all:
            total = s.scalar(select(func.count()).select_from(Job).where(*match))
            rows = select(Job).where(*match)
        else:  # the latest attempt of each chain among the matching ones: no newer matching attempt
            newer = aliased(Job)  # of its chain exists (a chain's attempts share user and group: visibility)
            later = [newer.chain_id == Job.chain_id, newer.id > Job.id] + ([newer.state.in_(wanted)] if state else [])
            total = s.scalar(select(func.count(Job.chain_id.distinct())).where(*match))
            rows = select(Job).where(*match, ~exists().where(and_(*later)))
        if before is not None:
            rows = rows.where(Job.id < before)
        page = s.scalars(rows.order_by(Job.id.desc()).limit(limit)).all()
        response.headers[TOTAL_HEADER] = str(total)
        return [job_dict(j, p.user) for j in reversed(page)]

    @app.get("/api/jobs/{job_id}")
    def job(job_id: int, latest: bool = False, p: Principal = Depends(principal), s: Session = Depends(db)):
        """One attempt; with ``latest`` the newest attempt of its chain (``Client.latest``, ``wait``)."""
        return job_dict(get_job(s, p, job_id, latest=latest), p.user)

    @app.get("/api/jobs/{job_id}/events")
    def job_events(job_id: int, p: Principal = Depends(person), s: Session = Depends(db)):
        chain = get_job(s, p, job_id).chain_id
        ids = s.scalars(select(Job.id).where(Job.chain_id == chain)).all()
        return [{"t": e.t, "job_id": e.job_id, "kind": e.kind, "message": e.message}
                for e in s.scalars(select(Event).where(Event.job_id.in_(ids)).order_by(Event.id))]

    def request_flag(job_id: int, p: Principal, flag: StopReason) -> dict:
        with sessions.begin() as s:
            job = get_job(s, p, job_id, latest=True, lock=True)
            allowed = (states.STARTING, states.RUNNING) if flag == StopReason.USER_SUSPEND else LIVE
            if job.state not in allowed:
                raise conflict(job_id, f"is {job.state}; this needs a job that is {' or '.join(allowed)}")
            job.requested |= flag
            record(s, "request", f"{flag.name} by {p.user.name}", job.id)
            return job_dict(job, p.user)

    @app.post("/api/jobs/{job_id}/stop")
    def stop(job_id: int, p: Principal = Depends(person)):
        with sessions() as s:
            own = get_job(s, p, job_id).user == p.user.name
        return request_flag(job_id, p, StopReason.USER_STOP if own or not p.user.is_admin else StopReason.ADMIN_STOP)

    @app.post("/api/jobs/{job_id}/suspend")
    def suspend(job_id: int, p: Principal = Depends(person)):
        return request_flag(job_id, p, StopReason.USER_SUSPEND)

    def hold_flag(job_id: int, p: Principal, hold: bool) -> dict:
        """Hold a queued job that is not held, release a held one; anything else is a one-line 409 that
        changes nothing (``hold_refusal``: a release of a job that was not held answered "released;
        queued" and rewrote its reason)."""
        with sessions.begin() as s:
            job = get_job(s, p, job_id, latest=True, lock=True)
            over_user = p.user.is_admin and job.user != p.user.name
            why = hold_refusal(job, hold, p.user.is_admin, over_user)
            if why is not None:
                raise conflict(job_id, why)
            if hold:
                job.requested = job.requested | StopReason.HOLD | (StopReason.ADMIN_HOLD if over_user else 0)
            else:
                job.requested = job.requested & ~(StopReason.HOLD | StopReason.ADMIN_HOLD)
            job.reason = f"held by {p.user.name} (luban release {job.id})" if hold else "released; queued"
            record(s, "hold" if hold else "release", f"by {p.user.name}", job.id)
            return job_dict(job, p.user)

    @app.post("/api/jobs/{job_id}/hold")
    def hold(job_id: int, p: Principal = Depends(person)):
        return hold_flag(job_id, p, True)

    @app.post("/api/jobs/{job_id}/release")
    def release(job_id: int, p: Principal = Depends(person)):
        return hold_flag(job_id, p, False)

    @app.put("/api/jobs/{job_id}/run")
    def set_run(job_id: int, p: Principal = Depends(principal), body: dict = Depends(json_body)):
        """The job (its own token) says where its run writes metrics; recorded as a ``run`` event."""
        if p.job_id is None:
            raise HTTPException(403, "only the job itself (its LUBAN_CLUSTER_TOKEN) reports its run directory")
        path = str_field(object_body(body), "dir", limit=1024)
        if not path.startswith("/"):
            raise bad_value("dir", path, "an absolute path")
        with sessions.begin() as s:
            record(s, "run", path, get_job(s, p, job_id).id)
        return {"dir": path}

    @app.get("/api/jobs/{job_id}/metrics")
    def metrics(job_id: int, p: Principal = Depends(person), s: Session = Depends(db)):
        """Numbers only, from the chain's reported run: the job chose the path, so the service reads
        two fixed file names there, never through a symlink, only files the job's account owns, and
        returns nothing but the known numeric fields (no file content can leak through this)."""
        job = get_job(s, p, job_id)
        ids = s.scalars(select(Job.id).where(Job.chain_id == job.chain_id)).all()
        event = s.scalars(select(Event).where(Event.job_id.in_(ids), Event.kind == "run")
                          .order_by(Event.id.desc())).first()
        if event is None:
            return {"dir": None, "points": [], "plan": None}
        owner = s.get(User, job.user).os_user if per_user else None
        points = [{k: r[k] for k in METRIC_KEYS if isinstance(r.get(k), (int, float)) and math.isfinite(r[k])}
                  for r in _read_json(Path(event.message) / "metrics.jsonl", owner, lines=True)]
        plan = (_read_json(Path(event.message) / "plan.json", owner) or [None])[0]
        plan = {k: plan[k] for k in ("step_time_s",) if isinstance(plan.get(k), (int, float))} if plan else None
        return {"dir": event.message, "points": [q for q in points if "step" in q], "plan": plan}

    def overlapping(p: Principal, since: float, until: float | None = None):
        """The attempts ``p`` may see that ran during [since, until), chosen in SQL: the table holds every
        attempt ever run (`luban usage --days 1` read them all into the service at each call)."""
        return select(Job).where(visible(p), Job.started_at.is_not(None),
                                 or_(Job.ended_at.is_(None), Job.ended_at >= since),
                                 *([Job.started_at < until] if until is not None else []))

    @app.get("/api/usage")
    def usage(since: float = 0.0, until: float | None = None, by: str = "user", p: Principal = Depends(person),
              s: Session = Depends(db)):
        """Node-hours per user (or per owner: user:x / group:g) of attempts overlapping [since, until]."""
        if by not in ("user", "owner"):
            raise bad_value("by", by, "user or owner")
        for key, value in (("since", since), ("until", until)):
            if value is not None and not math.isfinite(value):
                raise bad_value(key, value, "a finite time in seconds since the epoch")
        rows: dict[str, dict] = {}
        for job in s.scalars(overlapping(p, since, until)):
            hours = node_hours(job, since, until)
            if hours <= 0:
                continue
            row = rows.setdefault(job.user if by == "user" else job.owner,
                                  {"who": job.user if by == "user" else job.owner, "attempts": 0, "node_hours": 0.0})
            row["attempts"] += 1
            row["node_hours"] += hours
        return sorted(({**r, "node_hours": round(r["node_hours"], 4)} for r in rows.values()),
                      key=lambda r: -r["node_hours"])

    @app.get("/api/usage/daily")
    def usage_daily(days: int = 7, p: Principal = Depends(person), s: Session = Depends(db)):
        """Node-hours per user per calendar day (UTC) over the last ``days`` days, oldest first."""
        if not 1 <= days <= 366:
            raise bad_value("days", days, "an integer from 1 to 366")
        today = math.floor(clocks.now() / 86400) * 86400
        starts = [today - 86400 * i for i in range(days - 1, -1, -1)]
        jobs = s.scalars(overlapping(p, starts[0])).all()
        out = []
        for t in starts:
            per: dict[str, float] = {}
            for job in jobs:
                hours = node_hours(job, t, t + 86400)
                if hours > 0:
                    per[job.user] = per.get(job.user, 0.0) + hours
            out.append({"day": time.strftime("%Y-%m-%d", time.gmtime(t)), "t": t,
                        "users": {u: round(h, 4) for u, h in sorted(per.items())}})
        return out

    @app.get("/api/jobs/{job_id}/logs")
    def logs(job_id: int, rank: int = 0, offset: int = 0, p: Principal = Depends(person), s: Session = Depends(db)):
        job = get_job(s, p, job_id, latest=True)
        path = state_dir / "logs" / job.chain_id / f"rank{rank}.log"
        if rank < 0 or rank >= job.nnodes:
            raise bad_value("rank", rank, f"0 to {job.nnodes - 1} (the job has {job.nnodes} node(s))")
        if not 0 <= offset <= 1 << 62:
            raise bad_value("offset", offset, "an integer >= 0 (a byte offset into the log)")
        text = b""
        if path.exists():
            with open(path, "rb") as f:
                f.seek(offset)
                text = f.read(LOG_CHUNK)
        done = job.state not in LIVE
        if not (done and len(text) < LOG_CHUNK):  # a character cut by the chunk or a write under way: next time
            text = text[:len(text) - joblog.cut_char(text)]
        return {"text": text.decode(errors="replace"), "offset": offset + len(text), "done": done,
                "state": job.state, "job_id": job.id}

    # -- the in-job SDK ----------------------------------------------------------------------
    @app.get("/api/jobs/{job_id}/suspend_command")
    def suspend_command(job_id: int, p: Principal = Depends(principal), s: Session = Depends(db)):
        return {"suspend": get_job(s, p, job_id).state == states.SUSPENDING}

    @app.post("/api/jobs/{job_id}/go_suspend")
    def go_suspend(job_id: int, p: Principal = Depends(principal)):
        """The job's acknowledgement that its checkpoint is saved: its own token only. A user's token (a
        script, the SDK outside a job) marked the attempt acknowledged: at its next suspend it was
        killed at once, before it had saved anything (a queued one: as soon as it started)."""
        if p.job_id is None:
            raise HTTPException(403, "only the job itself (its LUBAN_CLUSTER_TOKEN) acknowledges a suspend; "
                                     f"luban suspend {job_id} asks for one")
        with sessions.begin() as s:
            job = get_job(s, p, job_id, lock=True)
            job.acked = True
            if job.state != states.SUSPENDING:
                job.requested |= StopReason.USER_SUSPEND
            record(s, "ack", "job called go_suspend()", job.id)
        return {"ok": True}

    @app.get("/api/jobs/{job_id}/whole_life_state")
    def get_wls(job_id: int, p: Principal = Depends(principal), s: Session = Depends(db)):
        return {"value": get_job(s, p, job_id, latest=True).whole_life_state}

    @app.put("/api/jobs/{job_id}/whole_life_state")
    def set_wls(job_id: int, p: Principal = Depends(principal), body: dict = Depends(json_body)):
        value = int_field(object_body(body), "value", *INT32)
        with sessions.begin() as s:
            get_job(s, p, job_id, latest=True).whole_life_state = value
        return {"value": value}

    # -- nodes, quota, users -----------------------------------------------------------------
    @app.get("/api/nodes")
    def nodes(p: Principal = Depends(person), s: Session = Depends(db)):
        holders = {n: j for j in s.scalars(select(Job).where(Job.state.in_(ACTIVE))) for n in j.nodes or ()}
        return [{"name": n.name, "node_group": n.node_group, "gpus": n.gpus, "labels": n.labels, "state": n.state,
                 "why": n.unavailable,  # the executor's reason it starts no new job there (None: it does)
                 "job": ({"id": holders[n.name].id, "user": holders[n.name].user, "name": holders[n.name].name,
                          "state": holders[n.name].state} if n.name in holders else None)}
                for n in s.scalars(select(Node).order_by(Node.name))]

    @app.patch("/api/nodes/{name}")
    def set_node(name: str, p: Principal = Depends(admin), body: dict = Depends(json_body)):
        state = object_body(body).get("state")
        if state not in ("up", "drain", "down"):
            raise bad_value("state", state, "up, drain (no new jobs) or down (no new jobs; its jobs are suspended now)")
        with sessions.begin() as s:
            node = s.get(Node, name)
            if node is None:
                raise HTTPException(404, f"node {shown(name)} not found")
            if node.state == GONE and state == "up":  # sbatch --nodelist would name a node Slurm does not know
                raise HTTPException(409, f"node {name} is gone: the executor no longer reports it; it is up again "
                                         "by itself once it does")
            node.state = state
            follow_executor(s, node, node.unavailable)  # up, but the executor starts no job there: unavailable
            record(s, "node", f"{name} set to {state} by {p.user.name}" + (
                f" (it is {node.state}: {node.unavailable})" if node.state != state else ""))
            return {"name": name, "state": node.state, "why": node.unavailable}

    @app.get("/api/quota")
    def quota(p: Principal = Depends(person), s: Session = Depends(db)):
        query = select(Quota).order_by(Quota.owner, Quota.node_group, Quota.priority.desc())
        if not p.user.is_admin:
            owners = [f"user:{p.user.name}"] + ([f"group:{p.user.group}"] if p.user.group else [])
            query = query.where(Quota.owner.in_(owners))
        used = {(o, g, pr): n for o, g, pr, n in s.execute(select(
            Job.owner, Job.node_group, Job.priority, func.sum(Job.nnodes)).where(Job.state.in_(ACTIVE)).group_by(
            Job.owner, Job.node_group, Job.priority)).all()}
        return [{"owner": q.owner, "node_group": q.node_group, "priority": q.priority,
                 "priority_name": prio.Priority(q.priority).name, "nodes": q.nodes,
                 "used": int(used.get((q.owner, q.node_group, q.priority), 0))} for q in s.scalars(query)]

    @app.put("/api/quota")
    def set_quota(p: Principal = Depends(admin), body: dict = Depends(json_body)):
        body = object_body(body)
        owner, group = str_field(body, "owner", limit=200), body.get("node_group")
        with sessions() as s:
            known = sorted(set(s.scalars(select(Node.node_group))))
        if group is None:  # the nodes' own group when there is one; "default" otherwise
            group = known[0] if len(known) == 1 else "default"
        if not isinstance(group, str) or group not in known:
            raise bad_value("node_group", group, "one of the node groups: " + ", ".join(known))
        nodes = int_field(body, "nodes", 0, INT32[1])
        kind, _, name = owner.partition(":")
        level = prio.parse(body.get("priority"))
        if level == prio.AUTO:
            raise bad_value("priority", "AUTO", "a quota needs a concrete level")
        for again in (True, False):  # two admins setting a new quota at once (PostgreSQL): both read no
            try:                     # row, the second insert failed (a 409); it is the update it meant
                with sessions.begin() as s:
                    table = {"user": User, "group": UserGroup}.get(kind)
                    if table is None or s.get(table, name) is None:
                        raise bad_value("owner", owner, "user:NAME or group:NAME of an existing user or group")
                    s.merge(Quota(owner=owner, node_group=group, priority=int(level), nodes=nodes))
                    record(s, "quota", f"{owner} {group} {level.name} = {nodes} node(s) by {p.user.name}")
                break
            except IntegrityError:
                if not again:
                    raise
        return {"owner": owner, "node_group": group, "priority": int(level), "nodes": nodes}

    def account_groups(s: Session, account: str, name: str, group: str | None) -> set[str]:
        """The luban groups OS account ``account`` is to be in (``accounts.set_groups``) once user
        ``name`` is in ``group``: that one and those of other users whose jobs run as the account
        too (one account mapped with --os-user for several users)."""
        others = s.scalars(select(User.group).where(User.os_user == account, User.name != name))
        return {g for g in [group, *others] if g is not None}

    @app.get("/api/users")
    def users(p: Principal = Depends(admin), s: Session = Depends(db)):
        return [{"name": u.name, "admin": u.is_admin, "group": u.group, "os_user": u.os_user}
                for u in s.scalars(select(User).order_by(User.name))]

    @app.post("/api/users", status_code=201)
    def add_user(p: Principal = Depends(admin), body: dict = Depends(json_body)):
        body = object_body(body)
        name = body.get("name")
        unknown = sorted(set(body) - {"name", "admin", "group", "os_user"})
        if unknown:
            raise bad_value(unknown[0], body[unknown[0]], "unknown field; allowed: name, admin, group, os_user")
        if not isinstance(body.get("admin", False), bool):
            raise bad_value("admin", body.get("admin"), "true or false (a JSON boolean)")
        if not isinstance(name, str) or not specs.NAME_RE.fullmatch(name):  # "$" would let "x\n" through
            raise bad_value("name", name, f"must match {specs.NAME_RE.pattern}")
        token = new_token()
        with sessions.begin() as s:
            if s.get(User, name) is not None:
                raise bad_value("name", name, "already exists")
            group = body.get("group")
            if group is not None and (not isinstance(group, str) or s.get(UserGroup, group) is None):
                raise bad_value("group", group, "no such group")
            os_user = str_field(body, "os_user", optional=True, limit=64)
            if os_user is not None and not per_user:  # refused, not ignored: jobs would not run as it
                raise bad_value("os_user", os_user, "only where jobs run as per-user OS accounts (a root service, "
                                                    "--run-jobs-as user); this service runs every job as its own "
                                                    f"account (--run-jobs-as {scheduler.settings.run_jobs_as})")
            if per_user:  # the OS account first: a failure leaves no luban user behind
                os_user = accounts.ensure_user(name, os_user)
                # a mapped or a leftover account may be in other luban groups: in this user's alone
                accounts.set_groups(os_user, account_groups(s, os_user, name, group))
            s.add(User(name=name, token_hash=token_hash(token), is_admin=bool(body.get("admin")), group=group,
                       os_user=os_user))
            record(s, "user", f"{name} added by {p.user.name}" + (f" (OS account {os_user})" if os_user else ""))
        return {"name": name, "token": token, "os_user": os_user}

    @app.patch("/api/users/{name}")
    def set_user(name: str, p: Principal = Depends(admin), body: dict = Depends(json_body)):
        body = object_body(body)
        unknown = sorted(set(body) - {"group", "admin"})
        if unknown:
            raise bad_value(unknown[0], body[unknown[0]], "unknown field; allowed: group, admin")
        if "admin" in body and not isinstance(body["admin"], bool):
            raise bad_value("admin", body["admin"], "true or false (a JSON boolean)")
        with sessions.begin() as s:
            user = s.get(User, name)
            if user is None:
                raise HTTPException(404, f"user {shown(name)} not found")
            if "group" in body:
                if body["group"] is not None and (not isinstance(body["group"], str)
                                                  or s.get(UserGroup, body["group"]) is None):
                    raise bad_value("group", body["group"], "no such group")
                user.group = body["group"]
                if per_user and user.os_user:  # out of the old group's Unix group too, not only into the new
                    accounts.set_groups(user.os_user, account_groups(s, user.os_user, name, user.group))
            if "admin" in body:
                # the admins' rows locked before counting them: two admins demoting each other at once
                # (PostgreSQL) would each count two and leave none
                if user.is_admin and not body["admin"] and len(
                        s.scalars(select(User.name).where(User.is_admin).with_for_update()).all()) <= 1:
                    raise bad_value("admin", False, f"{name} is the only admin: make another user an admin first "
                                                    "(no one could manage the cluster)")
                user.is_admin = body["admin"]
            record(s, "user", f"{name} changed by {p.user.name}: {body}")
            return {"name": user.name, "admin": user.is_admin, "group": user.group}

    @app.post("/api/users/{name}/token")
    def rotate(name: str, p: Principal = Depends(admin)):
        token = new_token()
        with sessions.begin() as s:
            user = s.get(User, name)
            if user is None:
                raise HTTPException(404, f"user {shown(name)} not found")
            user.token_hash = token_hash(token)
        return {"name": name, "token": token}

    @app.get("/api/groups")
    def groups(p: Principal = Depends(person), s: Session = Depends(db)):
        members: dict[str, list[str]] = {}
        for u in s.scalars(select(User).where(User.group.is_not(None))):
            members.setdefault(u.group, []).append(u.name)
        return [{"name": g.name, "data_dir": g.data_dir, "env_dir": g.env_dir, "members": members.get(g.name, [])}
                for g in s.scalars(select(UserGroup).order_by(UserGroup.name))
                if p.user.is_admin or g.name == p.user.group]

    @app.post("/api/groups", status_code=201)
    def add_group(p: Principal = Depends(admin), body: dict = Depends(json_body)):
        body = object_body(body)
        name = body.get("name")
        for key in ("data_dir", "env_dir"):  # 512: the column; no NUL: it is in its members' jobs' environment
            value = str_field(body, key, optional=True, limit=512)
            if value is not None and (not value.startswith("/") or "\x00" in value):
                raise bad_value(key, value, "an absolute path without NUL bytes")
            state = os.path.realpath(scheduler.settings.state_dir)
            if value is not None and os.path.commonpath([os.path.realpath(value), state]) in (os.path.realpath(value), state):
                raise bad_value(key, value, "a directory neither inside the service's state nor holding it "
                                            "(members would reach its logs and run records)")
        if not isinstance(name, str) or not specs.NAME_RE.fullmatch(name):  # "$" would let "x\n" through
            raise bad_value("name", name, f"must match {specs.NAME_RE.pattern}")
        with sessions.begin() as s:
            if s.get(UserGroup, name) is not None:
                raise bad_value("name", name, "already exists")
            if per_user:
                accounts.ensure_group(name, {"data_dir": body.get("data_dir"), "env_dir": body.get("env_dir")})
            s.add(UserGroup(name=name, data_dir=body.get("data_dir"), env_dir=body.get("env_dir")))
            record(s, "group", f"{name} added by {p.user.name}")
        return {"name": name}

    # -- dashboard ---------------------------------------------------------------------------
    @app.get("/api/samples")
    def samples(since: float = 0.0, p: Principal = Depends(person), s: Session = Depends(db)):
        if not math.isfinite(since):
            raise bad_value("since", since, "a finite time in seconds since the epoch")
        rows = s.scalars(select(Sample).where(Sample.t >= since).order_by(Sample.t.desc()).limit(2000)).all()
        return [{"t": r.t, "nodes": r.nodes, "held": r.held, "running": r.running, "queued": r.queued_jobs}
                for r in reversed(rows)]

    @app.get("/")
    def index():
        return FileResponse(DASHBOARD / "index.html")

    @app.get("/dashboard.js")
    def script():
        return FileResponse(DASHBOARD / "dashboard.js", media_type="application/javascript")

    return app
