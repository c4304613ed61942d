"""The simulator: the same policy in virtual time, exact on a hand-made trace, sane on synthetic ones."""

from __future__ import annotations

import json
import subprocess

import pytest

from luban.cluster import policy, simulate, trace
from luban.cluster.trace import TraceJob
from luban.errors import LubanError
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


# -- a hostile tester's traces and flags: a successful run where valid, else one line and exit 2 ---
JOB = {"id": 0, "submit": 0, "user": "u", "nodes": 1, "duration": 10, "priority": 0, "checkpointable": True,
       "node_group": "default"}
SMALL = ["--nodes", "4", "--zones", "1"]


def cli(capsys, argv) -> tuple[int, str, str]:
    from luban.cli import main

    code = main(argv)
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


def refused(capsys, argv, words: str) -> str:
    code, _, err = cli(capsys, argv)
    assert code == 2 and err.startswith("luban: error: ") and err.count("\n") == 1 and words in err, err
    return err


def write_trace(tmp_path, *lines) -> str:
    path = tmp_path / "t.jsonl"
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return str(path)


def test_all_jobs_submitted_at_time_zero_has_no_arrival_period(capsys, tmp_path):
    """Was ZeroDivisionError: occupancy while jobs arrive is n/a (JSON null) when all arrive at 0."""
    code, out, _ = cli(capsys, ["cluster", "simulate", "--trace", write_trace(tmp_path, JOB), *SMALL, "--json"])
    r = json.loads(out)
    assert code == 0 and r["finished"] == 1 and r["occupancy_while_arriving"] is None
    assert r["occupancy"] == pytest.approx(0.25)  # 1 of 4 nodes held until the tick at 60 s
    code, out, _ = cli(capsys, ["cluster", "simulate", "--trace", str(tmp_path / "t.jsonl"), *SMALL])
    assert code == 0 and "n/a while jobs arrive" in out


def test_duplicate_job_ids_are_refused_naming_both_lines(capsys, tmp_path):
    err = refused(capsys, ["cluster", "simulate", "--trace", write_trace(tmp_path, JOB, JOB), *SMALL], "t.jsonl:2 = ")
    assert "a trace job (id = 0: unique (line 1 has it too))" in err


@pytest.mark.parametrize("field,value,words", [
    ("submit", 1e308, "submit = 1e+308: a finite number from 0 to 3153600000 s (100 years)"),
    ("duration", 1e308, "duration = 1e+308: a finite number > 0, at most 3153600000 s (100 years)"),
    ("duration", 1e300, "duration = 1e+300"),
    ("submit", -1, "submit = -1: a finite number from 0"),
])
def test_trace_times_are_bounded(capsys, tmp_path, field, value, words):
    """Were OverflowError (1e308) and a 150-digit offered figure (1e300)."""
    refused(capsys, ["cluster", "simulate", "--trace", write_trace(tmp_path, {**JOB, field: value}), *SMALL], words)


def test_longest_trace_times_still_simulate():
    """The bounds themselves are fine: a 100-year job submitted after 100 years runs in 2 ticks."""
    job = trace.TraceJob(0, trace.MAX_TRACE_S, "u", 1, trace.MAX_TRACE_S, 0)
    r = simulate.run([job], simulate.SimConfig(nodes=1, zones=1, tick=3600.0))
    assert r["finished"] == 1 and r["ticks"] == 3 and r["makespan_s"] >= 2 * trace.MAX_TRACE_S  # + its quantum's look


def test_tick_too_fine_for_the_span_is_refused_at_once(capsys, monkeypatch):
    """Was minutes of ticking (1 day at 1 us ticks); refused before the run (the policy never
    called), saying the finest tick."""
    monkeypatch.setattr(simulate.policy, "plan", lambda *a, **k: pytest.fail("the run started"))
    err = refused(capsys, ["cluster", "simulate", "--jobs", "50", "--days", "1", *SMALL, "--quantum", "1e-6",
                           "--tick", "1e-6"], "--tick = 1e-06: at least ")
    assert f"{simulate.MAX_GRID_TICKS:,} ticks" in err


def test_too_much_work_is_refused_before_the_run(capsys, monkeypatch):
    """--jobs 1000000 --days 3650 --nodes 100000 ran for hours; the estimate (ticks that must happen
    x nodes) refuses it up front. Shown here with the bound scaled down, to stay fast."""
    monkeypatch.setattr(simulate, "MAX_PLAN_VISITS", 10_000)
    monkeypatch.setattr(simulate.policy, "plan", lambda snap: pytest.fail("planned before refusing"))
    refused(capsys, ["cluster", "simulate", "--jobs", "200", "--days", "1", "--nodes", "100", "--zones", "1"],
            "simulation = '200 jobs on 100 nodes': at most 10,000 node and job visits")


def test_a_run_past_the_work_bound_ends_with_one_line(monkeypatch):
    """The up-front estimate counts only ticks that must happen; a long queue (or time-sharing that
    never lets a non-checkpointable job finish) needs more, and the bound ends the run. Here 100
    jobs queue on 2 nodes: the estimate is 2 ticks x 2 nodes, the run ~50 ticks x ~50 jobs."""
    monkeypatch.setattr(simulate, "MAX_PLAN_VISITS", 1000)
    jobs = [trace.TraceJob(i, 0.0, f"u{i % 3}", 1, 100.0, 0) for i in range(100)]
    with pytest.raises(LubanError, match=r"simulation = '100 jobs on 2 nodes': at most 1,000 .* jobs unfinished"):
        simulate.run(jobs, simulate.SimConfig(nodes=2, zones=1, tick=10.0))


@pytest.mark.parametrize("change,words", [
    ({"nodes": 99999}, "--trace line 2: nodes = 99999: an integer from 1 to 4: the simulated cluster's --nodes"),
    ({"node_group": "nope"}, "--trace line 2: node_group = 'nope': 'default', the simulated cluster's only node"),
])
def test_a_job_that_could_never_run_is_refused_naming_its_line(capsys, tmp_path, change, words):
    """Were accepted silently (the job waited forever; node_group 'nope' was a ZeroDivisionError)."""
    path = write_trace(tmp_path, JOB, {**JOB, "id": 1, **change})
    refused(capsys, ["cluster", "simulate", "--trace", path, *SMALL], words)


def test_quota_narrower_than_a_job_is_refused():
    with pytest.raises(LubanError, match="trace job 0: nodes = 3: an integer from 1 to 2: .* and quota"):
        simulate.run([trace.TraceJob(0, 0.0, "u", 3, 10.0, 0)], simulate.SimConfig(nodes=4, zones=1, quota=2))


@pytest.mark.parametrize("line,words", [
    (json.dumps({**JOB, "extra\nkey": 1}), "unknown key 'extra\\nkey'; allowed: id, submit, user, nodes"),
    (json.dumps({k: v for k, v in JOB.items() if k not in ("user", "duration")}), "missing keys user, duration"),
    (json.dumps({**JOB, "user": ["x" * 1000]}), "user = ['xxxx"),
])
def test_bad_keys_are_one_line_naming_the_key(capsys, tmp_path, line, words):
    """Was two lines leaking ``TraceJob.__init__() got an unexpected keyword argument``."""
    err = refused(capsys, ["cluster", "simulate", "--trace", write_trace(tmp_path, line), *SMALL], words)
    assert "__init__" not in err and len(err) < 400


def test_saved_traces_carry_no_line_numbers(tmp_path):
    jobs = trace.load(write_trace(tmp_path, JOB, {**JOB, "id": 1}))
    assert [j.line for j in jobs] == [1, 2]
    trace.save(jobs, tmp_path / "again.jsonl")
    assert json.loads((tmp_path / "again.jsonl").read_text().splitlines()[0]) == JOB


def test_time_sharing_looks_at_a_quantum_s_end_even_with_no_other_event():
    """Two users' long jobs on one node: after a quantum the waiting one takes its turn. The end of a
    quantum was an event only when it fell within one tick of another event, so here (nothing else
    happening for 10,000 s) time-sharing never ran (found while fixing the simulator, 2026-11-27)."""
    jobs = [trace.TraceJob(i, float(i), f"u{i}", 1, 10_000.0, 0) for i in range(2)]
    r = simulate.run(jobs, simulate.SimConfig(nodes=1, zones=1, quantum=600.0, tick=60.0))
    assert r["finished"] == 2 and r["time_share_suspends"] >= 10


def test_a_synthetic_run_too_large_is_refused_before_its_trace_is_made(capsys, monkeypatch):
    """--jobs 1000000 --days 3650 --nodes 100000 was refused only after ~16 s of making the trace."""
    monkeypatch.setattr(trace, "synthetic", lambda *a, **k: pytest.fail("the trace was made first"))
    refused(capsys, ["cluster", "simulate", "--jobs", "1000000", "--days", "3650", "--nodes", "100000"],
            "simulation = '1000000 jobs on 100000 nodes': at most 300,000,000")
