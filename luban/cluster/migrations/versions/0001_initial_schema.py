"""initial schema

Revision ID: 0001
Revises: 
"""
from alembic import op
import sqlalchemy as sa


revision = '0001'
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('events',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('t', sa.Float(), nullable=False),
    sa.Column('job_id', sa.Integer(), nullable=True),
    sa.Column('kind', sa.String(length=16), nullable=False),
    sa.Column('message', sa.Text(), nullable=False),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('events', schema=None) as batch_op:
        batch_op.create_index('ix_events_job', ['job_id'], unique=False)

    op.create_table('nodes',
    sa.Column('name', sa.String(length=128), nullable=False),
    sa.Column('node_group', sa.String(length=64), nullable=False),
    sa.Column('gpus', sa.Integer(), nullable=False),
    sa.Column('labels', sa.JSON(), nullable=False),
    sa.Column('addr', sa.String(length=256), nullable=False),
    sa.Column('state', sa.String(length=16), nullable=False),
    sa.PrimaryKeyConstraint('name')
    )
    op.create_table('quotas',
    sa.Column('owner', sa.String(length=80), nullable=False),
    sa.Column('node_group', sa.String(length=64), nullable=False),
    sa.Column('priority', sa.Integer(), nullable=False),
    sa.Column('nodes', sa.Integer(), nullable=False),
    sa.PrimaryKeyConstraint('owner', 'node_group', 'priority')
    )
    op.create_table('samples',
    sa.Column('t', sa.Float(), nullable=False),
    sa.Column('nodes', sa.Integer(), nullable=False),
    sa.Column('held', sa.Integer(), nullable=False),
    sa.Column('running', sa.Integer(), nullable=False),
    sa.Column('queued_jobs', sa.Integer(), nullable=False),
    sa.PrimaryKeyConstraint('t')
    )
    op.create_table('user_groups',
    sa.Column('name', sa.String(length=64), nullable=False),
    sa.Column('data_dir', sa.String(length=512), nullable=True),
    sa.Column('env_dir', sa.String(length=512), nullable=True),
    sa.PrimaryKeyConstraint('name')
    )
    op.create_table('users',
    sa.Column('name', sa.String(length=64), nullable=False),
    sa.Column('token_hash', sa.String(length=64), nullable=False),
    sa.Column('is_admin', sa.Boolean(), nullable=False),
    sa.Column('group', sa.String(length=64), nullable=True),
    sa.ForeignKeyConstraint(['group'], ['user_groups.name'], ),
    sa.PrimaryKeyConstraint('name'),
    sa.UniqueConstraint('token_hash')
    )
    op.create_table('jobs',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('chain_id', sa.String(length=32), nullable=False),
    sa.Column('first_id', sa.Integer(), nullable=True),
    sa.Column('restart_count', sa.Integer(), nullable=False),
    sa.Column('whole_life_state', sa.Integer(), nullable=False),
    sa.Column('user', sa.String(length=64), nullable=False),
    sa.Column('group', sa.String(length=64), nullable=True),
    sa.Column('owner', sa.String(length=80), nullable=False),
    sa.Column('name', sa.String(length=64), nullable=False),
    sa.Column('spec', sa.JSON(), nullable=False),
    sa.Column('priority', sa.Integer(), nullable=False),
    sa.Column('node_group', sa.String(length=64), nullable=False),
    sa.Column('nnodes', sa.Integer(), nullable=False),
    sa.Column('state', sa.String(length=16), nullable=False),
    sa.Column('stop_reason', sa.Integer(), nullable=False),
    sa.Column('requested', sa.Integer(), nullable=False),
    sa.Column('reason', sa.Text(), nullable=False),
    sa.Column('chain_submitted_at', sa.Float(), nullable=False),
    sa.Column('place', sa.Float(), nullable=False),
    sa.Column('queued_at', sa.Float(), nullable=False),
    sa.Column('started_at', sa.Float(), nullable=True),
    sa.Column('ended_at', sa.Float(), nullable=True),
    sa.Column('suspend_deadline', sa.Float(), nullable=True),
    sa.Column('acked', sa.Boolean(), nullable=False),
    sa.Column('exit_code', sa.Integer(), nullable=True),
    sa.Column('nodes', sa.JSON(), nullable=False),
    sa.Column('handle', sa.Text(), nullable=True),
    sa.Column('token_hash', sa.String(length=64), nullable=True),
    sa.ForeignKeyConstraint(['user'], ['users.name'], ),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('token_hash')
    )
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_jobs_chain_id'), ['chain_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_jobs_state'), ['state'], unique=False)
        batch_op.create_index(batch_op.f('ix_jobs_user'), ['user'], unique=False)

    op.create_table('allocations',
    sa.Column('node', sa.String(length=128), nullable=False),
    sa.Column('job_id', sa.Integer(), nullable=False),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], ),
    sa.ForeignKeyConstraint(['node'], ['nodes.name'], ),
    sa.PrimaryKeyConstraint('node')
    )
    with op.batch_alter_table('allocations', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_allocations_job_id'), ['job_id'], unique=False)



def downgrade() -> None:
    with op.batch_alter_table('allocations', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_allocations_job_id'))

    op.drop_table('allocations')
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_jobs_user'))
        batch_op.drop_index(batch_op.f('ix_jobs_state'))
        batch_op.drop_index(batch_op.f('ix_jobs_chain_id'))

    op.drop_table('jobs')
    op.drop_table('users')
    op.drop_table('user_groups')
    op.drop_table('samples')
    op.drop_table('quotas')
    op.drop_table('nodes')
    with op.batch_alter_table('events', schema=None) as batch_op:
        batch_op.drop_index('ix_events_job')

    op.drop_table('events')
