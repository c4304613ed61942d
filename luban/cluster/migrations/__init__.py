"""Alembic migrations for the cluster database (run by ``luban.cluster.db.upgrade``)."""
