"""The SQL schema (SQLAlchemy ORM); migrations/ creates and upgrades it."""

from __future__ import annotations

import enum

from sqlalchemy import JSON, Boolean, Float, ForeignKey, Index, Integer, String, Text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class Base(DeclarativeBase):
    pass


# the lifecycle lives in states.py (one machine for service, scheduler and simulator)
from luban.cluster.states import ACTIVE, FINAL, LIVE, JobState  # noqa: E402,F401


class StopReason(enum.IntFlag):
    """Why a job attempt ended other than by succeeding; several may be set at once."""

    USER_STOP = 1
    ADMIN_STOP = 2
    PREEMPTED = 4          # suspended for a higher-priority job or a lowered quota
    TIME_SHARE = 8         # suspended to share its priority with a long-waiting job
    USER_SUSPEND = 16      # its user asked for a suspend
    SUSPEND_TIMEOUT = 32   # did not acknowledge the suspend before the deadline: killed
    NONZERO_EXIT = 64
    LOST = 128             # the executor lost track of it (node or launcher gone)
    TIME_LIMIT = 256       # ran past its spec's time_limit: killed
    HOLD = 512             # (a request, not an end) held by its user: not scheduled until released
    ADMIN_HOLD = 1024      # (with HOLD) held by an admin, not its user: only an admin releases it (as Slurm's
                           # JobHeldAdmin, which its user's `scontrol release` cannot lift)


class Node(Base):
    __tablename__ = "nodes"
    name: Mapped[str] = mapped_column(String(128), primary_key=True)
    node_group: Mapped[str] = mapped_column(String(64), default="default")
    gpus: Mapped[int] = mapped_column(Integer, default=0)
    labels: Mapped[dict] = mapped_column(JSON, default=dict)
    addr: Mapped[str] = mapped_column(String(256), default="127.0.0.1")
    # up | drain | down (an admin's) | gone | unavailable (the executor's: scheduler.sync_nodes); only up is scheduled
    state: Mapped[str] = mapped_column(String(16), default="up")
    # why the executor starts no new job there ("slurm: drained (reason)"), None where it does: the node is
    # unavailable while it is set, or stays as an admin drained it (scheduler.follow_executor)
    unavailable: Mapped[str | None] = mapped_column(Text, nullable=True)


class UserGroup(Base):
    """Members share environments and data directories (exported to their jobs)."""

    __tablename__ = "user_groups"
    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    data_dir: Mapped[str | None] = mapped_column(String(512), nullable=True)
    env_dir: Mapped[str | None] = mapped_column(String(512), nullable=True)


class User(Base):
    __tablename__ = "users"
    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    is_admin: Mapped[bool] = mapped_column(Boolean, default=False)
    group: Mapped[str | None] = mapped_column(ForeignKey("user_groups.name"), nullable=True)
    os_user: Mapped[str | None] = mapped_column(String(64), nullable=True)  # jobs run as this account


class Quota(Base):
    """At most ``nodes`` nodes held at once by ``owner`` (``user:x`` / ``group:g``) per level."""

    __tablename__ = "quotas"
    owner: Mapped[str] = mapped_column(String(80), primary_key=True)
    node_group: Mapped[str] = mapped_column(String(64), primary_key=True)
    priority: Mapped[int] = mapped_column(Integer, primary_key=True)
    nodes: Mapped[int] = mapped_column(Integer)


class Job(Base):
    """One attempt of a chain; a suspended attempt is followed by a queued one in the same chain."""

    __tablename__ = "jobs"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    chain_id: Mapped[str] = mapped_column(String(32), index=True)
    first_id: Mapped[int | None] = mapped_column(Integer, nullable=True)
    restart_count: Mapped[int] = mapped_column(Integer, default=0)
    whole_life_state: Mapped[int] = mapped_column(Integer, default=0)
    user: Mapped[str] = mapped_column(ForeignKey("users.name"), index=True)
    group: Mapped[str | None] = mapped_column(String(64), nullable=True)
    owner: Mapped[str] = mapped_column(String(80))
    name: Mapped[str] = mapped_column(String(64))
    spec: Mapped[dict] = mapped_column(JSON)
    priority: Mapped[int] = mapped_column(Integer)
    node_group: Mapped[str] = mapped_column(String(64))
    nnodes: Mapped[int] = mapped_column(Integer)
    state: Mapped[str] = mapped_column(String(16), index=True)
    stop_reason: Mapped[int] = mapped_column(Integer, default=0)
    requested: Mapped[int] = mapped_column(Integer, default=0)  # StopReason flags asked for
    reason: Mapped[str] = mapped_column(Text, default="")
    chain_submitted_at: Mapped[float] = mapped_column(Float)
    place: Mapped[float] = mapped_column(Float)  # queue order key (policy rule 1)
    queued_at: Mapped[float] = mapped_column(Float)
    started_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    ended_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    suspend_deadline: Mapped[float | None] = mapped_column(Float, nullable=True)
    acked: Mapped[bool] = mapped_column(Boolean, default=False)  # the job called go_suspend()
    exit_code: Mapped[int | None] = mapped_column(Integer, nullable=True)
    nodes: Mapped[list] = mapped_column(JSON, default=list)
    handle: Mapped[str | None] = mapped_column(Text, nullable=True)
    token_hash: Mapped[str | None] = mapped_column(String(64), unique=True, nullable=True)
    # the client's Idempotency-Key of the submission that made this chain (its first attempt only): a
    # submission repeated with it (a retry after an unanswered POST) answers this job instead of a new one
    submit_key: Mapped[str | None] = mapped_column(String(64), nullable=True)

    __table_args__ = (Index("ux_jobs_user_submit_key", "user", "submit_key", unique=True),)


class Allocation(Base):
    """A node held by a job; the primary key makes double allocation impossible."""

    __tablename__ = "allocations"
    node: Mapped[str] = mapped_column(ForeignKey("nodes.name"), primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id"), index=True)


class Event(Base):
    """The decision log: every start, suspend, kill, requeue and end, with its reason."""

    __tablename__ = "events"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    t: Mapped[float] = mapped_column(Float)
    job_id: Mapped[int | None] = mapped_column(Integer, nullable=True)
    kind: Mapped[str] = mapped_column(String(16))
    message: Mapped[str] = mapped_column(Text)

    __table_args__ = (Index("ix_events_job", "job_id"),)


class Sample(Base):
    """Cluster occupancy over time, one row per sampling interval (dashboard charts)."""

    __tablename__ = "samples"
    t: Mapped[float] = mapped_column(Float, primary_key=True)
    nodes: Mapped[int] = mapped_column(Integer)
    held: Mapped[int] = mapped_column(Integer)
    running: Mapped[int] = mapped_column(Integer)
    queued_jobs: Mapped[int] = mapped_column(Integer)
