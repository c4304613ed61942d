"""The HTTP API (FastAPI) in front of the database; the scheduler runs in a thread beside it.

Every call needs ``Authorization: Bearer TOKEN``: a user's token, or the per-attempt job token
the executor hands to a running job (valid only for that job's own SDK calls). Users see and
control their own jobs and their group's group jobs; admins see and control everything, and
alone manage users, groups, quotas and nodes. A bad spec is a 422 naming the key and value.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
import time
from pathlib import Path

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import FileResponse, JSONResponse
from sqlalchemy import func, or_, select
from sqlalchemy.orm import Session, sessionmaker

from luban.cluster import priority as prio
from luban.cluster import spec as specs
from luban.cluster import states
from luban.cluster.models import ACTIVE, LIVE, Event, Job, Node, Quota, Sample, StopReason, User, UserGroup
from luban.cluster.scheduler import Scheduler, new_token, record, token_hash
from luban.errors import LubanError, bad_value

DASHBOARD = Path(__file__).with_name("dashboard")
LOG_CHUNK = 1 << 20


@dataclasses.dataclass
class Principal:
    user: User
    job_id: int | None = None  # set for a job token: only that job's own SDK calls are allowed


def job_dict(job: Job) -> dict:
    return {k: getattr(job, k) for k in (
        "id", "chain_id", "first_id", "restart_count", "whole_life_state", "user", "group", "name",
        "priority", "node_group", "nnodes", "state", "stop_reason", "reason", "chain_submitted_at", "place",
        "queued_at", "started_at", "ended_at", "exit_code", "nodes", "spec")} | {
        "priority_name": prio.Priority(job.priority).name,
        "stop_reasons": [f.name for f in StopReason if job.stop_reason & f]}


def ensure_admin(sessions: sessionmaker, state_dir: Path) -> Path | None:
    """First start: create user ``admin`` and write its token to STATE/admin.token (mode 600)."""
    path = state_dir / "admin.token"
    with sessions.begin() as s:
        if s.scalar(select(func.count()).select_from(User)):
            return None
        token = new_token()
        s.add(User(name="admin", token_hash=token_hash(token), is_admin=True))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return path


def create_app(sessions: sessionmaker, scheduler: Scheduler, run_scheduler: bool = True) -> FastAPI:
    state_dir = Path(scheduler.settings.state_dir)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        scheduler.sync_nodes()
        if run_scheduler:
            scheduler.start()
        yield
        scheduler.stop()

    app = FastAPI(title="luban cluster", lifespan=lifespan)

    @app.exception_handler(LubanError)
    async def _bad_input(_request, err: LubanError):
        return JSONResponse(status_code=422, content={"detail": str(err)})

    def db():
        with sessions() as s:
            yield s

    def principal(request: Request) -> Principal:
        header = request.headers.get("authorization", "")
        token = header[7:].strip() if header.lower().startswith("bearer ") else request.query_params.get("token")
        if not token:
            raise HTTPException(401, "missing bearer token (Authorization: Bearer TOKEN)")
        digest = token_hash(token)
        with sessions() as s:  # closed before the handler opens its own transaction
            user = s.scalar(select(User).where(User.token_hash == digest))
            if user is not None:
                return Principal(user)
            job = s.scalar(select(Job).where(Job.token_hash == digest))
            if job is not None:
                return Principal(s.get(User, job.user), job.id)
        raise HTTPException(401, "invalid token")

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

    def get_job(s: Session, p: Principal, job_id: int, latest: bool = False) -> Job:
        job = s.get(Job, job_id)
        allowed = job is not None and (p.user.is_admin or job.user == p.user.name
                                       or (job.group is not None and job.group == p.user.group))
        if p.job_id is not None:
            allowed = allowed and job.id == p.job_id
        if not allowed:
            raise HTTPException(404, f"job {job_id} not found")
        if latest:
            return s.scalars(select(Job).where(Job.chain_id == job.chain_id).order_by(Job.id.desc())).first()
        return job

    # -- jobs --------------------------------------------------------------------------------
    @app.get("/api/whoami")
    def whoami(p: Principal = Depends(principal)):
        return {"user": p.user.name, "admin": p.user.is_admin, "group": p.user.group, "job_id": p.job_id}

    @app.post("/api/jobs", status_code=201)
    def submit(body: dict, p: Principal = Depends(person)):
        if "yaml" in body:
            spec = specs.parse_yaml(body["yaml"])
        else:
            spec = specs.parse(body.get("spec"))
        with sessions.begin() as s:
            user = s.get(User, p.user.name)
            if spec.group is not None and spec.group != user.group:
                raise bad_value("group", spec.group, f"you are not a member (your group: {user.group})")
            known = sorted(set(s.scalars(select(Node.node_group))))
            if spec.node_group is None:
                spec.node_group = known[0] if len(known) == 1 else "default"
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
            now = time.time()
            job = Job(chain_id="c" + secrets.token_hex(6), restart_count=0, whole_life_state=0,
                      user=user.name, group=spec.group, owner=owner, name=spec.name, spec=spec.to_dict(),
                      priority=int(level), node_group=spec.node_group, nnodes=spec.nodes, state=states.QUEUED,
                      chain_submitted_at=now, place=now, queued_at=now, nodes=[], requested=0, stop_reason=0,
                      reason="queued")
            s.add(job)
            s.flush()
            job.first_id = job.id
            record(s, "submit", f"{spec.name} by {user.name}: {spec.nodes} node(s) at {level.name}", job.id)
            return job_dict(job)

    @app.get("/api/jobs")
    def jobs(all: bool = False, state: str | None = None, p: Principal = Depends(person), s: Session = Depends(db)):
        query = select(Job).where(visible(p)).order_by(Job.id)
        if state:
            query = query.where(Job.state.in_(state.split(",")))
        rows = s.scalars(query).all()
        if not all:  # the latest attempt of each chain
            latest = {}
            for job in rows:
                latest[job.chain_id] = job
            rows = sorted(latest.values(), key=lambda j: j.id)
        return [job_dict(j) for j in rows]

    @app.get("/api/jobs/{job_id}")
    def job(job_id: int, p: Principal = Depends(principal), s: Session = Depends(db)):
        return job_dict(get_job(s, p, job_id))

    @app.get("/api/jobs/{job_id}/events")
    def job_events(job_id: int, p: Principal = Depends(person), s: Session = Depends(db)):
        chain = get_job(s, p, job_id).chain_id
        ids = s.scalars(select(Job.id).where(Job.chain_id == chain)).all()
        return [{"t": e.t, "job_id": e.job_id, "kind": e.kind, "message": e.message}
                for e in s.scalars(select(Event).where(Event.job_id.in_(ids)).order_by(Event.id))]

    def request_flag(job_id: int, p: Principal, flag: StopReason) -> dict:
        with sessions.begin() as s:
            job = get_job(s, p, job_id, latest=True)
            allowed = (states.STARTING, states.RUNNING) if flag == StopReason.USER_SUSPEND else LIVE
            if job.state not in allowed:
                raise bad_value("job", job_id, f"is {job.state}; this needs a job that is {' or '.join(allowed)}")
            job.requested |= flag
            record(s, "request", f"{flag.name} by {p.user.name}", job.id)
            return job_dict(job)

    @app.post("/api/jobs/{job_id}/stop")
    def stop(job_id: int, p: Principal = Depends(person)):
        with sessions() as s:
            own = get_job(s, p, job_id).user == p.user.name
        return request_flag(job_id, p, StopReason.USER_STOP if own or not p.user.is_admin else StopReason.ADMIN_STOP)

    @app.post("/api/jobs/{job_id}/suspend")
    def suspend(job_id: int, p: Principal = Depends(person)):
        return request_flag(job_id, p, StopReason.USER_SUSPEND)

    @app.get("/api/jobs/{job_id}/logs")
    def logs(job_id: int, rank: int = 0, offset: int = 0, p: Principal = Depends(person), s: Session = Depends(db)):
        job = get_job(s, p, job_id, latest=True)
        path = state_dir / "logs" / job.chain_id / f"rank{rank}.log"
        if rank < 0 or rank >= job.nnodes:
            raise bad_value("rank", rank, f"0 to {job.nnodes - 1} (the job has {job.nnodes} node(s))")
        text = b""
        if path.exists():
            with open(path, "rb") as f:
                f.seek(offset)
                text = f.read(LOG_CHUNK)
        done = job.state not in LIVE
        return {"text": text.decode(errors="replace"), "offset": offset + len(text), "done": done,
                "state": job.state, "job_id": job.id}

    # -- the in-job SDK ----------------------------------------------------------------------
    @app.get("/api/jobs/{job_id}/suspend_command")
    def suspend_command(job_id: int, p: Principal = Depends(principal), s: Session = Depends(db)):
        return {"suspend": get_job(s, p, job_id).state == states.SUSPENDING}

    @app.post("/api/jobs/{job_id}/go_suspend")
    def go_suspend(job_id: int, p: Principal = Depends(principal)):
        with sessions.begin() as s:
            job = get_job(s, p, job_id)
            job.acked = True
            if job.state != states.SUSPENDING:
                job.requested |= StopReason.USER_SUSPEND
            record(s, "ack", "job called go_suspend()", job.id)
        return {"ok": True}

    @app.get("/api/jobs/{job_id}/whole_life_state")
    def get_wls(job_id: int, p: Principal = Depends(principal), s: Session = Depends(db)):
        return {"value": get_job(s, p, job_id, latest=True).whole_life_state}

    @app.put("/api/jobs/{job_id}/whole_life_state")
    def set_wls(job_id: int, body: dict, p: Principal = Depends(principal)):
        value = body.get("value")
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad_value("value", value, "an integer")
        with sessions.begin() as s:
            get_job(s, p, job_id, latest=True).whole_life_state = value
        return {"value": value}

    # -- nodes, quota, users -----------------------------------------------------------------
    @app.get("/api/nodes")
    def nodes(p: Principal = Depends(person), s: Session = Depends(db)):
        holders = {n: j for j in s.scalars(select(Job).where(Job.state.in_(ACTIVE))) for n in j.nodes or ()}
        return [{"name": n.name, "node_group": n.node_group, "gpus": n.gpus, "labels": n.labels, "state": n.state,
                 "job": ({"id": holders[n.name].id, "user": holders[n.name].user, "name": holders[n.name].name,
                          "state": holders[n.name].state} if n.name in holders else None)}
                for n in s.scalars(select(Node).order_by(Node.name))]

    @app.patch("/api/nodes/{name}")
    def set_node(name: str, body: dict, p: Principal = Depends(admin)):
        state = body.get("state")
        if state not in ("up", "drain"):
            raise bad_value("state", state, "up or drain")
        with sessions.begin() as s:
            node = s.get(Node, name)
            if node is None:
                raise HTTPException(404, f"node {name} not found")
            node.state = state
            record(s, "node", f"{name} set to {state} by {p.user.name}")
        return {"name": name, "state": state}

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
    def set_quota(body: dict, p: Principal = Depends(admin)):
        owner, group, nodes = body.get("owner", ""), body.get("node_group", "default"), body.get("nodes")
        kind, _, name = str(owner).partition(":")
        level = prio.parse(body.get("priority"))
        if level == prio.AUTO:
            raise bad_value("priority", "AUTO", "a quota needs a concrete level")
        if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 0:
            raise bad_value("nodes", nodes, "an integer >= 0")
        with sessions.begin() as s:
            table = {"user": User, "group": UserGroup}.get(kind)
            if table is None or s.get(table, name) is None:
                raise bad_value("owner", owner, "user:NAME or group:NAME of an existing user or group")
            s.merge(Quota(owner=owner, node_group=group, priority=int(level), nodes=nodes))
            record(s, "quota", f"{owner} {group} {level.name} = {nodes} node(s) by {p.user.name}")
        return {"owner": owner, "node_group": group, "priority": int(level), "nodes": nodes}

    @app.get("/api/users")
    def users(p: Principal = Depends(admin), s: Session = Depends(db)):
        return [{"name": u.name, "admin": u.is_admin, "group": u.group}
                for u in s.scalars(select(User).order_by(User.name))]

    @app.post("/api/users", status_code=201)
    def add_user(body: dict, p: Principal = Depends(admin)):
        name = body.get("name")
        if not isinstance(name, str) or not specs.NAME_RE.match(name):
            raise bad_value("name", name, f"must match {specs.NAME_RE.pattern}")
        token = new_token()
        with sessions.begin() as s:
            if s.get(User, name) is not None:
                raise bad_value("name", name, "already exists")
            group = body.get("group")
            if group is not None and s.get(UserGroup, group) is None:
                raise bad_value("group", group, "no such group")
            s.add(User(name=name, token_hash=token_hash(token), is_admin=bool(body.get("admin")), group=group))
            record(s, "user", f"{name} added by {p.user.name}")
        return {"name": name, "token": token}

    @app.patch("/api/users/{name}")
    def set_user(name: str, body: dict, p: Principal = Depends(admin)):
        with sessions.begin() as s:
            user = s.get(User, name)
            if user is None:
                raise HTTPException(404, f"user {name} not found")
            if "group" in body:
                if body["group"] is not None and s.get(UserGroup, body["group"]) is None:
                    raise bad_value("group", body["group"], "no such group")
                user.group = body["group"]
            if "admin" in body:
                user.is_admin = bool(body["admin"])
            record(s, "user", f"{name} changed by {p.user.name}: {body}")
            return {"name": user.name, "admin": user.is_admin, "group": user.group}

    @app.post("/api/users/{name}/token")
    def rotate(name: str, p: Principal = Depends(admin)):
        token = new_token()
        with sessions.begin() as s:
            user = s.get(User, name)
            if user is None:
                raise HTTPException(404, f"user {name} not found")
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
    def add_group(body: dict, p: Principal = Depends(admin)):
        name = body.get("name")
        if not isinstance(name, str) or not specs.NAME_RE.match(name):
            raise bad_value("name", name, f"must match {specs.NAME_RE.pattern}")
        with sessions.begin() as s:
            if s.get(UserGroup, name) is not None:
                raise bad_value("name", name, "already exists")
            s.add(UserGroup(name=name, data_dir=body.get("data_dir"), env_dir=body.get("env_dir")))
            record(s, "group", f"{name} added by {p.user.name}")
        return {"name": name}

    # -- dashboard ---------------------------------------------------------------------------
    @app.get("/api/samples")
    def samples(since: float = 0.0, p: Principal = Depends(person), s: Session = Depends(db)):
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
