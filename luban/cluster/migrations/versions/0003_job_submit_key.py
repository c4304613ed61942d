"""jobs.submit_key: a submission's Idempotency-Key, unique per user (service.py, submit)

Revision ID: 0003
Revises: 0002
"""
from alembic import op
import sqlalchemy as sa


revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('submit_key', sa.String(length=64), nullable=True))
        batch_op.create_index('ux_jobs_user_submit_key', ['user', 'submit_key'], unique=True)


def downgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_index('ux_jobs_user_submit_key')
        batch_op.drop_column('submit_key')
