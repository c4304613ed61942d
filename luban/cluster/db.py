"""Database access: engines for SQLite or PostgreSQL URLs, and migrations to the latest schema."""

from __future__ import annotations

import os
from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import create_engine, event
from sqlalchemy.engine import Engine
from sqlalchemy.orm import sessionmaker

MIGRATIONS = Path(__file__).with_name("migrations")
MIGRATION_LOCK = 0x6C7562616E  # "luban": the PostgreSQL advisory lock held while migrating


def url_for(path_or_url: str) -> str:
    """A SQLAlchemy URL: URLs pass through, a file path becomes a SQLite URL."""
    if "://" in path_or_url:
        return path_or_url.replace("postgresql://", "postgresql+psycopg://", 1)
    return "sqlite:///" + os.path.abspath(path_or_url)


def check_url(path_or_url: str) -> str:
    """``path_or_url`` if SQLAlchemy can parse it and has its driver, else ValueError; nothing is
    created or connected to."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    try:
        make_url(url_for(path_or_url)).get_dialect()
    except (ArgumentError, NoSuchModuleError, ImportError, ValueError) as err:
        raise ValueError(f"{path_or_url!r}: {err}") from None
    return path_or_url


def make_engine(url: str) -> Engine:
    """An engine; SQLite gets WAL mode and a busy timeout so the API and the scheduler share it."""
    url = url_for(url)
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})

        @event.listens_for(engine, "connect")
        def _pragmas(conn, _):
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA foreign_keys=ON")
            conn.isolation_level = None  # let SQLAlchemy's BEGIN below start transactions

        @event.listens_for(engine, "begin")
        def _begin(conn):
            conn.exec_driver_sql("BEGIN IMMEDIATE")  # writers serialize: no lost updates

        return engine
    return create_engine(url, pool_pre_ping=True, pool_size=10, max_overflow=20)


def upgrade(engine: Engine) -> None:
    """Bring the schema to the newest migration shipped in the package."""
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    with engine.begin() as conn:
        if conn.dialect.name == "postgresql":  # services starting at once on one database: one migrates,
            conn.exec_driver_sql(f"SELECT pg_advisory_xact_lock({MIGRATION_LOCK})")  # the others wait, then see it
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "head")


def open_checked(path_or_url: str) -> Engine:
    """``make_engine`` + ``upgrade``, or one ``LubanError`` naming ``--db`` (password hidden) and why
    it cannot be used (unreachable server, refused login, unwritable SQLite file) — no traceback."""
    from sqlalchemy.exc import DBAPIError, OperationalError

    from luban.errors import bad_value, without_password

    engine = make_engine(path_or_url)
    try:
        upgrade(engine)
    except (OperationalError, DBAPIError, OSError) as err:
        engine.dispose()
        shown = without_password(path_or_url)  # as typed (not url_for's driver name)
        why = str(getattr(err, "orig", None) or err).strip().splitlines()
        raise bad_value("--db", shown, f"cannot be used ({why[0] if why else type(err).__name__}); "
                                       "check that the server runs and the URL, user and password") from None
    return engine


def sessions(engine: Engine) -> sessionmaker:
    return sessionmaker(engine, expire_on_commit=False)
