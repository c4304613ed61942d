"""The scheduling policy: a pure function from a cluster snapshot to decisions.

The service and the simulator both call ``plan(snapshot)`` once per tick; it reads nothing else
and changes nothing, so the same code runs against the database and in virtual time.

Rules, in the order they apply (docs/platform.md states them for users):

1. **Order.** Candidates (queued, starting and running jobs) are sorted by priority, highest
   first; within one priority running jobs keep their nodes first, then queued jobs follow in
   the order of their ``place``: the chain's first submission, so a job suspended for a higher
   priority and requeued keeps its place; a job that yielded its time slice (rule 2) goes to the
   back, its place becoming the time it was requeued.
2. **Time-sharing.** Within one (node group, priority), when a queued job has waited at least
   ``quantum`` seconds, running jobs of *other* users at that priority that have run at least
   ``quantum`` seconds since their last start yield, longest-running first, until enough nodes
   would be free for that waiter (the oldest such whose own quota has room). Yielding jobs sort
   after the queued jobs of their priority, and queued jobs of a yielding job's own user sort
   after it, so a job is never displaced by a job of the same user and priority.
3. **Admission.** Walking that order, a job is admitted when its owner's quota in nodes at
   (node group, priority) and the node group's capacity both still have room; a job that does
   not fit is skipped (smaller jobs behind it may still fit), and the reason is recorded.
4. **Preemption.** A running job that is not admitted is suspended (suspend protocol); its
   nodes go to the admitted jobs once it has left them.
5. **Placement.** An admitted queued job gets whole free nodes of its node group, all in one
   network zone when possible (the zone with the fewest free nodes that still fits, to keep
   large zones whole), otherwise spread over the largest zones; it waits when the nodes it was
   admitted to are still being released.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

from luban.cluster.states import QUEUED, RUNNING, STARTING, SUSPENDING  # noqa: E402 - re-exported
INCUMBENT = (STARTING, RUNNING)


@dataclasses.dataclass(slots=True)
class NodeView:
    name: str
    node_group: str
    zone: str
    schedulable: bool = True
    down: bool = False  # taken down by an admin: its jobs are suspended now (rule 6)
    gone: bool = False  # no longer reported by the executor (removed from Slurm): not schedulable


@dataclasses.dataclass(slots=True)
class JobView:
    """One job as the policy sees it. ``owner`` is the quota holder (``user:x`` or ``group:g``);
    ``place`` orders the queue (rule 1); ``since`` is when it was queued (queued jobs) or last
    started (running jobs)."""

    id: int
    user: str
    owner: str
    priority: int
    node_group: str
    nnodes: int
    state: str
    place: float
    since: float
    nodes: tuple[str, ...] = ()


@dataclasses.dataclass(slots=True)
class Snapshot:
    now: float
    nodes: list[NodeView]
    jobs: list[JobView]
    quota: dict[tuple[str, str, int], int]
    quantum: float = 3600.0


@dataclasses.dataclass(slots=True)
class Plan:
    """``starts``: (job id, nodes, reason); ``suspends``: (job id, reason, time_share);
    ``off_down_nodes``: the suspended jobs whose node an admin took down (rule 6; every other
    suspend makes room for a queued job's start); ``waits``: job id -> why it is still queued;
    ``admitted``: every job that may hold nodes."""

    starts: list[tuple[int, tuple[str, ...], str]] = dataclasses.field(default_factory=list)
    suspends: list[tuple[int, str, bool]] = dataclasses.field(default_factory=list)
    off_down_nodes: set[int] = dataclasses.field(default_factory=set)
    waits: dict[int, str] = dataclasses.field(default_factory=dict)
    admitted: set[int] = dataclasses.field(default_factory=set)


def _yielders(snap: Snapshot, free_count: dict[str, int]) -> set[int]:
    """Running jobs that yield to a long-waiting queued job of another user (rule 2)."""
    cutoff = snap.now - snap.quantum
    held: dict[tuple[str, str, int], int] = defaultdict(int)
    running: dict[tuple[str, int], list[JobView]] = defaultdict(list)
    due: list[JobView] = []
    for job in snap.jobs:
        if job.state in INCUMBENT:
            held[(job.owner, job.node_group, job.priority)] += job.nnodes
            if job.state == RUNNING and job.since <= cutoff:
                running[(job.node_group, job.priority)].append(job)
        elif job.state == QUEUED and job.since <= cutoff:
            due.append(job)
    waiter: dict[tuple[str, int], JobView] = {}
    for job in due:  # the oldest place among waiters whose own quota has room
        block = (job.node_group, job.priority)
        if block not in running:
            continue
        best = waiter.get(block)
        if best is not None and (job.place, job.id) >= (best.place, best.id):
            continue
        key = (job.owner, job.node_group, job.priority)
        if held.get(key, 0) + job.nnodes <= snap.quota.get(key, 0):
            waiter[block] = job
    yielding: set[int] = set()
    for block, first in waiter.items():
        need = first.nnodes - free_count.get(block[0], 0)
        if need <= 0:
            continue
        chosen, freed = [], 0
        for job in sorted(running[block], key=lambda j: (j.since, j.id)):
            if freed >= need:
                break
            if job.user != first.user:
                chosen.append(job.id)
                freed += job.nnodes
        if freed >= need:
            yielding.update(chosen)
    return yielding


def _place(free: dict[str, list[str]], nnodes: int) -> tuple[tuple[str, ...], str]:
    """Take ``nnodes`` names from ``free`` (zone -> sorted names), one zone when possible."""
    fitting = [z for z, names in free.items() if len(names) >= nnodes]
    if fitting:
        zone = min(fitting, key=lambda z: (len(free[z]), z))
        taken, free[zone] = free[zone][:nnodes], free[zone][nnodes:]
        return tuple(taken), f"zone {zone}"
    taken: list[str] = []
    for zone in sorted(free, key=lambda z: (-len(free[z]), z)):
        take = free[zone][: nnodes - len(taken)]
        free[zone] = free[zone][len(take):]
        taken += take
        if len(taken) == nnodes:
            break
    return tuple(taken), "spans zones (no single zone had enough free nodes)"


def _capacity_reason(group: str, used: int, capacity: int, n: int, drained: int, gone: int,
                     ahead: list[int]) -> str:
    """Why a job does not fit: the jobs ahead that take the nodes (naming the newly admitted ones,
    so a preempted job's reason says which job it yields to) and the drained nodes (or nodes the
    executor no longer reports) it may wait for."""
    why = f"capacity: {used} of {capacity} nodes in node group {group} go to jobs ahead in order, needs {n}"
    if ahead:
        shown = ", ".join(str(i) for i in ahead[-3:]) + (f" and {len(ahead) - 3} more" if len(ahead) > 3 else "")
        why += f" (for job{'s' if len(ahead) > 1 else ''} {shown})"
    if (drained or gone) and n > capacity - used:
        out = [f"{drained} node(s) of {group} are drained"] if drained else []
        out += [f"{gone} node(s) of {group} are gone (the executor no longer reports them)"] if gone else []
        why += "; " + " and ".join(out) + (": it cannot run until they return" if n > capacity else "")
    return why


def plan(snap: Snapshot) -> Plan:
    """Decide which jobs start where and which running jobs are suspended (rules 1-5)."""
    held = {name for job in snap.jobs if job.state in INCUMBENT or job.state == SUSPENDING
            for name in job.nodes}
    capacity: dict[str, int] = defaultdict(int)
    free: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    free_count: dict[str, int] = defaultdict(int)
    drained: dict[str, int] = defaultdict(int)
    gone: dict[str, int] = defaultdict(int)
    # capacity: the nodes a job can be given. A node no longer schedulable (drained, by an admin or in
    # Slurm) that a job still holds counts for that job alone (``pinned``): suspending the job frees
    # nothing another job can be given, so none is preempted for it
    pinned: set[str] = set()
    for node in sorted(snap.nodes, key=lambda n: n.name):
        if not node.schedulable:
            (gone if node.gone else drained)[node.node_group] += 1
            if node.name in held:
                pinned.add(node.name)
        if node.schedulable:
            capacity[node.node_group] += 1
        if node.schedulable and node.name not in held:
            free[node.node_group][node.zone].append(node.name)
            free_count[node.node_group] += 1

    down = {node.name for node in snap.nodes if node.down}
    yielding = _yielders(snap, free_count)
    yielding_users = {(j.node_group, j.priority, j.user) for j in snap.jobs if j.id in yielding}
    # rule 1/2 order: (-priority, class, place, id); class 0 running, 1 queued, 2 yielding,
    # 3 queued behind a yielding job of the same user. One list per (-priority, class), each sorted
    # by (place, id): the same order as sorting every job by the whole key, at a fraction of the
    # comparisons (a deep queue's jobs share a few priorities; docs: bench/results/cluster.md)
    blocks: dict[tuple[int, int], list] = defaultdict(list)
    for job in snap.jobs:
        state = job.state
        if state == QUEUED:
            cls = 3 if yielding_users and (job.node_group, job.priority, job.user) in yielding_users else 1
        elif state in INCUMBENT:
            cls = 2 if job.id in yielding else 0
        else:
            continue
        blocks[(-job.priority, cls)].append((job.place, job.id, job))  # ids are unique: never compares jobs

    result = Plan()
    waits, admitted = result.waits, result.admitted
    used_capacity: dict[str, int] = defaultdict(int)
    used_quota: dict[tuple[str, str, int], int] = {}
    displaced: set[tuple[str, str, int]] = set()  # (node group, user, priority) losing a running job
    ahead: dict[str, list[int]] = defaultdict(list)  # queued jobs admitted this tick, per node group
    last_ahead: dict[str, tuple[int, ...]] = {}  # the last 3 of each (a reason's cache key)
    reasons: dict[tuple, str] = {}  # one string per distinct reason: ticks stay fast with deep queues
    quota = snap.quota
    for (_, cls), block in sorted(blocks.items()):
        block.sort()
        queued = cls in (1, 3)
        for _, _, job in block:
            group, n = job.node_group, job.nnodes
            lost = sorted(set(job.nodes) & down) if down and not queued else None
            if lost:  # rule 6: a job on a node taken down checkpoints and is requeued elsewhere
                result.suspends.append((job.id, f"node {', '.join(lost)} taken down by an admin", False))
                result.off_down_nodes.add(job.id)
                continue
            key = (job.owner, group, job.priority)
            held_quota = used_quota.get(key, 0)
            need = n - len(pinned.intersection(job.nodes)) if pinned and not queued else n  # of capacity
            if queued and displaced and (group, job.user, job.priority) in displaced:
                why = "a running job of the same user and priority is being suspended; it keeps its place"
            elif held_quota + n > quota.get(key, 0):
                rkey = (key, held_quota, n)
                why = reasons.get(rkey) or reasons.setdefault(rkey, (
                    f"quota: {job.owner} holds {held_quota} of {quota.get(key, 0)} nodes at priority "
                    f"{job.priority} in node group {group}, needs {n}"))
            elif (used := used_capacity[group]) + need > capacity[group]:
                rkey = (group, used, need, last_ahead.get(group))
                why = reasons.get(rkey) or reasons.setdefault(rkey, _capacity_reason(
                    group, used, capacity[group], need, drained[group], gone[group], ahead[group]))
            else:
                used_quota[key] = held_quota + n
                used_capacity[group] += need
                admitted.add(job.id)
                if queued:
                    ahead[group].append(job.id)
                    last_ahead[group] = tuple(ahead[group][-3:])  # what a capacity reason names of them
                    if free_count[group] >= n:
                        nodes, where = _place(free[group], n)
                        free_count[group] -= n
                        result.starts.append((job.id, nodes, f"admitted at priority {job.priority}; {where}"))
                    else:
                        waits[job.id] = (f"admitted; waiting for {n - free_count[group]} "
                                         f"node(s) being released in node group {group}")
                continue
            if queued:
                waits[job.id] = why
                continue
            displaced.add((group, job.user, job.priority))
            if job.id in yielding:
                result.suspends.append((job.id, f"time-share: ran >= {snap.quantum:g}s while another "
                                                 f"user's job waited >= {snap.quantum:g}s ({why})", True))
            else:
                result.suspends.append((job.id, f"preempted: {why}", False))
    return result
