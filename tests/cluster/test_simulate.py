"""The simulator: the same policy in virtual time, exact on a hand-made trace, sane on synthetic ones."""

from __future__ import annotations

import json
import subprocess

import pytest

from luban.cluster import policy, simulate, trace
from luban.cluster.trace import TraceJob
from tests.cluster.conftest import LUBAN


def two_jobs(checkpointable: bool):
    return [TraceJob(0, 0.0, "lo", 2, 1000.0, 0, checkpointable), TraceJob(1, 100.0, "hi", 2, 100.0, 30)]


def test_preemption_timeline_is_exact():
    cfg = simulate.SimConfig(nodes=2, zones=1, tick=10.0, checkpoint_s=20.0)
    r = simulate.run(two_jobs(True), cfg)
    assert r["finished"] == 2 and r["preemptions"] == r["priority_suspends"] == 1
    assert r["wait_s"]["HIGH"]["p50"] == 20.0  # LOW checkpoints for 20 s before HIGH gets the nodes
    assert r["wait_s"]["LOW"]["p50"] == 100.0  # requeued at 120, resumed at 220 when HIGH ended
    assert r["makespan_s"] == 1120.0 and r["work_lost_node_hours"] == 0.0
    assert r["checkpoint_node_hours"] == pytest.approx(2 * 20 / 3600)
    lost = simulate.run(two_jobs(False), cfg)  # no checkpoint: the first 100 s are lost, no delay
    assert lost["work_lost_node_hours"] == pytest.approx(2 * 100 / 3600)
    assert lost["makespan_s"] == 1200.0 and lost["wait_s"]["HIGH"]["p50"] == 0.0


def test_simulator_calls_the_service_policy(monkeypatch):
    calls = []
    real = policy.plan

    def spy(snap):
        calls.append(len(snap.jobs))
        return real(snap)

    monkeypatch.setattr(policy, "plan", spy)
    r = simulate.run(two_jobs(True), simulate.SimConfig(nodes=2, zones=1, tick=10.0, checkpoint_s=20.0))
    assert len(calls) == r["ticks"] > 0


def test_synthetic_trace_is_deterministic_and_round_trips(tmp_path):
    cfg = trace.TraceConfig(jobs=300, days=2, nodes=40, users=5, load=0.8, seed=3)
    jobs = trace.synthetic(cfg)
    assert jobs == trace.synthetic(cfg) and len(jobs) == 300
    offered = sum(j.nodes * j.duration for j in jobs) / (40 * 2 * 86400)
    assert 0.6 < offered < 0.85  # durations are clipped to [60 s, 7 days] after scaling
    assert all(1 <= j.nodes <= 40 and 0 <= j.submit <= 2 * 86400 for j in jobs)
    trace.save(jobs, tmp_path / "t.jsonl")
    assert trace.load(tmp_path / "t.jsonl") == jobs


def test_synthetic_run_finishes_everything_and_favours_high_priority():
    jobs = trace.synthetic(trace.TraceConfig(jobs=600, days=3, nodes=50, users=8, load=1.0, seed=1))
    r = simulate.run(jobs, simulate.SimConfig(nodes=50, zones=5, quantum=7200.0))
    assert r["finished"] == 600
    assert 0 < r["useful_utilisation"] <= r["occupancy"] <= 1
    assert r["preemptions"] == r["priority_suspends"] + r["time_share_suspends"] > 0
    assert r["wait_s"]["HIGH"]["p90"] <= r["wait_s"]["LOW"]["p90"]
    assert "occupancy" in simulate.format_report(r)


def test_cli_trace_and_simulate(tmp_path):
    out = tmp_path / "trace.jsonl"
    made = subprocess.run([*LUBAN, "cluster", "trace", "--jobs", "200", "--nodes", "20", "--days", "1",
                           "-o", str(out)], capture_output=True, text=True, check=True, timeout=300)
    assert "wrote 200 jobs" in made.stdout
    ran = subprocess.run([*LUBAN, "cluster", "simulate", "--trace", str(out), "--nodes", "20", "--zones", "2",
                          "--json"], capture_output=True, text=True, check=True, timeout=300)
    assert json.loads(ran.stdout)["finished"] == 200
    bad = subprocess.run([*LUBAN, "cluster", "simulate", "--jobs", "0"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "jobs = 0" in bad.stderr


def test_one_state_machine_for_service_scheduler_and_simulator():
    """The simulator moves jobs only along the edges of luban.cluster.states (move raises on any
    other), and the machine itself: final states are final, every state can reach one."""
    from luban.cluster import models, policy, states
    from luban.cluster.states import TRANSITIONS, JobState, IllegalTransition

    assert models.JobState is JobState and models.ACTIVE == states.ACTIVE  # one enum, re-exported
    assert (policy.QUEUED, policy.RUNNING, policy.SUSPENDING) == ("queued", "running", "suspending")
    for final in states.FINAL:
        assert TRANSITIONS[JobState(final)] == frozenset()
    reach = {s: set(t) for s, t in TRANSITIONS.items()}
    for _ in range(len(reach)):
        for s in reach:
            reach[s] |= set().union(*(reach[t] for t in reach[s])) if reach[s] else set()
    assert all(set(map(JobState, states.FINAL)) & reach[s] for s in TRANSITIONS if s.value not in states.FINAL)

    class J:
        state = "succeeded"

    with pytest.raises(IllegalTransition, match="succeeded -> running"):
        states.move(J(), "running")
    assert states.requeue(5.0, 9.0, time_share=True) == ("queued", 9.0)
    assert states.requeue(5.0, 9.0, time_share=False) == ("queued", 5.0)
