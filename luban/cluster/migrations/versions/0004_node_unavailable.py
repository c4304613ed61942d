"""nodes.unavailable: why the executor starts no new job on a node (Slurm drained, down; scheduler.sync_nodes)

Revision ID: 0004
Revises: 0003
"""
from alembic import op
import sqlalchemy as sa


revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('nodes', schema=None) as batch_op:
        batch_op.add_column(sa.Column('unavailable', sa.Text(), nullable=True))


def downgrade() -> None:
    # 'unavailable' is the executor's state (scheduler.UNAVAILABLE), which the code before 0004 neither
    # schedules nor ever leaves: such a node is 'up' again, as that code had it (it did not follow Slurm)
    op.execute("UPDATE nodes SET state = 'up' WHERE state = 'unavailable'")
    with op.batch_alter_table('nodes', schema=None) as batch_op:
        batch_op.drop_column('unavailable')
