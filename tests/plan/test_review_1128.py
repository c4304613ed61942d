"""Review 2026-11-28 of ``luban plan``: each test is one defect, and fails without its fix."""

import numpy as np
import pytest

from luban.parallel.layout import ParallelLayout
from luban.plan.grid import Grid
from luban.plan.memory import memory
from luban.plan.time import step_time

from plan_helpers import make_problem


def _times(problem, layout):
    g = Grid.from_layout(layout)
    return step_time(problem, g, memory(problem, g))


# --- 1. the LM head is charged to the stage that holds it ------------------------------------------

@pytest.mark.parametrize("schedule,v", [("1f1b", 1), ("interleaved-1f1b", 2), ("zero-bubble", 2)])
def test_the_lm_head_is_charged_to_the_rank_of_the_last_stage_only(schedule, v):
    """The head (and loss) lives on the last stage (luban.parallel.pipeline). It was added to the rank
    with the most layers whatever that rank held: a pp_split of 11 layers, then 1 (the head's stage
    nearly empty) planned the same forward as 1, then 11 (the head beside 11 layers). Now the first is
    11 layers alone, the second 11 layers + the head, and the head's seconds are the pp = 1 forward's
    beyond its 12 layers."""
    problem = make_problem("gpt2-124m", gpus=2, seq=1024, batch=16, system="dgx-h100", runtime="megatron")
    stages = 2 * v

    def split(last):  # 11 layers over the ranks, the last stage gets ``last``
        counts = [1] * stages
        counts[0] += 12 - stages - (last - 1)
        counts[-1] = last
        return tuple(counts)

    light = _times(problem, ParallelLayout(pp=2, schedule=schedule, virtual_stages=v, pp_split=split(1), micro_batch=1))
    heavy_split = (1,) * (stages - 1) + (12 - stages + 1,)
    heavy = _times(problem, ParallelLayout(pp=2, schedule=schedule, virtual_stages=v, pp_split=heavy_split, micro_batch=1))
    whole = _times(problem, ParallelLayout(dp=2, micro_batch=1))  # one rank: 12 layers + the head
    rank0 = 12 - v  # layers of pipeline rank 0 under split(1): all but the last stage's one and v - 1 others
    layer_f = float(light["F"]) / rank0
    head_f = float(whole["F"]) - 12 * layer_f
    assert head_f > 0.05 * float(whole["F"])  # GPT-2's 50k-wide head: a real share of the forward
    heavy_layers = 12 - stages + 1 + (v - 1)  # the last rank: the heavy last stage + its other stages
    np.testing.assert_allclose(float(heavy["F"]), heavy_layers * layer_f + head_f, rtol=1e-9)
    assert float(light["F"]) < float(heavy["F"])


def test_an_interleaved_pipeline_is_paced_by_its_busiest_stage_not_by_the_head_added_to_it():
    """Llama 70B on pp 8 x 5 chunks (the Megatron-Bridge recipe's layout) under luban's split: rank 0
    holds 11 layers, the last rank 9 layers + the head (~1.1 layers); the step was planned as 11 layers
    + the head on one rank. The busiest rank is rank 0, 11 layers."""
    problem = make_problem("llama-70b", gpus=64, seq=8192, batch=128, system="dgx-h100", runtime="luban")
    layout = ParallelLayout(tp=4, pp=8, dp=2, sp=True, zero=1, schedule="interleaved-1f1b", virtual_stages=5,
                            micro_batch=1, precision="bf16")
    t = _times(problem, layout)
    flat = _times(problem, layout.replace(pp_split=(2,) * 40))  # 10 layers on every rank, the head on the last
    tail = _times(problem, layout.replace(pp_split=(1,) + (2,) * 38 + (3,)))  # the head's rank: 11 layers
    per_layer = float(tail["F"]) - float(flat["F"])
    np.testing.assert_allclose(float(t["F"]), 11 * per_layer, rtol=1e-9)
    assert float(tail["F"]) > float(t["F"])  # the same 11 layers beside the head


# --- 2. one overlap budget for the data-parallel collectives and the weights' fetch ------------------

def test_the_weights_fetch_and_the_data_parallel_collectives_share_one_compute_window():
    """ZeRO-3 with offload = params: the data-parallel all-gathers/reduce-scatters were hidden up to
    ``zero3_overlap`` x the step's compute, and the weights' fetch from the host again up to the same
    ``zero3_overlap`` x compute: llama-8b on 16 H100s (luban) hid 0.300 s + 0.080 s of communication
    behind 0.375 s of compute (0.8 of it: 0.300 s). Now the two share the one budget."""
    from luban.plan.problem import Problem
    from luban.plan.system import load_system
    from luban.model.presets import get_preset

    layout = ParallelLayout(dp=16, zero=3, offload="params", micro_batch=1, precision="bf16")
    g = Grid.from_layout(layout)

    def plan(*overrides):
        problem = Problem(get_preset("llama-8b"), load_system("dgx-h100", list(overrides)), 16, 4096, 16, runtime="luban")
        mem = memory(problem, g)
        return problem, mem, step_time(problem, g, mem)

    problem, mem, t = plan()
    _, _, exposed = plan("efficiency.zero3_overlap=0")  # nothing hidden: the whole fetch is in "offload"
    share = problem.system.efficiency["zero3_overlap"]
    busy = float(mem["microbatches"] * (t["F"] + t["B"]))
    fetch_hidden = float(exposed["parts"]["offload"] - t["parts"]["offload"])
    assert float(t["dp_hidden"]) > 0.5 * share * busy  # the collectives take most of the window here
    assert float(t["dp_hidden"]) + fetch_hidden <= share * busy * (1 + 1e-12)
    assert float(t["dp_hidden"]) + fetch_hidden == pytest.approx(share * busy)  # and all of it is used


# --- 3. `luban plan validate --system` plans the A100 tables on an A100 profile only -------------------

def _luban(*args, timeout=300):
    """``luban ARGS`` in a fresh process: (exit code, stdout, stderr); a hang fails with its output."""
    import subprocess
    import sys

    try:
        done = subprocess.run([sys.executable, "-m", "luban", *args], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"luban {' '.join(args)} ran past {timeout} s: {err.stdout!r} {err.stderr!r}")
    return done.returncode, done.stdout, done.stderr


def test_validate_refuses_to_plan_the_a100_tables_on_another_gpu(tmp_path):
    """`luban plan validate --system dgx-h100` planned Korthikanti's and Narayanan's A100 rows on an H100
    (mean |error| 56%, every row ~50% too fast) and reported it as the planner's error. An A100 profile
    (another node, a recalibrated file) is taken; another chip's is one line, exit 2."""
    from luban.errors import LubanError
    from luban.plan import validate
    from luban.plan.system import load_system

    code, out, err = _luban("plan", "validate", "--system", "dgx-h100", "--grid", "none")
    assert code == 2 and out == "" and err.count("\n") == 1 and "Traceback" not in err, err[-2000:]
    assert err.startswith("luban: error: --system = 'dgx-h100': the A100 tables"), err
    with pytest.raises(LubanError, match="fp16 peak 989.4 TFLOP/s"):
        validate.korthikanti_table5("hgx-h200")
    with pytest.raises(LubanError, match="an A100 profile"):
        validate.narayanan_table1(load_system("dgx-h100"))
    # an A100 profile from a file (here the shipped one, renamed) plans the tables as the built-in one
    raw = load_system("dgx-a100-80g").to_dict()
    from luban.plan.probe import write_profile

    write_profile({**raw, "name": "my-a100"}, str(tmp_path / "my-a100.json"))
    rows = validate.korthikanti_table5(str(tmp_path / "my-a100.json"))
    assert [r["predicted"] for r in rows] == [r["predicted"] for r in validate.korthikanti_table5()]


# --- 4. estimate's and search's errors name the flag the user typed ------------------------------------

@pytest.mark.parametrize("command,flags,start", [
    ("estimate", ["--tp", "5", "--dp", "1", "--gpus", "5"], "--tp / parallel.tp = 5: must divide heads=12"),
    ("estimate", ["--micro-batch", "3"], "--global-batch / train.global_batch = 64: must be divisible by dp * micro_batch"),
    ("estimate", ["--pp", "2", "--schedule", "dualpipev", "--virtual-stages", "3"],
     "--virtual-stages / parallel.virtual_stages = 3: schedule dualpipev"),
    ("estimate", ["--sp"], "--sp / parallel.sp = True: sequence parallel needs tp > 1"),
    ("search", ["--precision", "fp8", "--runtime", "megatron-core"], "--precision / parallel.precision = 'fp8': system"),
])
def test_layout_errors_name_the_flag_typed(command, flags, start):
    """`luban plan estimate --tp 5` answered `luban: error: parallel.tp = 5: ...`, a config key the user
    never typed; now the flag, with the key beside it (`--tp / parallel.tp = 5: ...`), in the one-line form."""
    args = ["--model", "gpt2-124m", "--gpus", "8", "--global-batch", "64"]
    if "--gpus" in flags:
        args = args[:2] + args[4:]
    code, out, err = _luban("plan", command, *args, *flags)
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err[-2000:]
    assert err.startswith("luban: error: " + start), err


# --- 5. the search counts the rows a rule rejects on their own over the axes the rules read -------------

@pytest.mark.parametrize("model,gpus,seq,batch,runtime", [
    ("gpt2-124m", 24, 1024, 48, "megatron"),
    ("mixtral-8x7b", 48, 4096, 48, "megatron-core"),
    ("llama-8b", 96, 4096, 96, "fsdp2"),
])
def test_rejected_rows_are_counted_as_every_layout_checked_one_by_one(model, gpus, seq, batch, runtime):
    """``rule_counts`` (the search's count of the rows a rule of their own knobs rejects: only the rules up
    to theirs, without the recompute and micro-batch axes those rules do not read) gives the counts of
    ``first_violation`` over every layout, and the search's answer is that of every layout estimated and
    checked at once."""
    from luban.plan.estimate import evaluate
    from luban.plan.rules import REASONS, first_violation, rule_counts
    from luban.plan.search import _row_rules, _rows, candidate_grid, search

    problem = make_problem(model, gpus, seq, batch, system="dgx-h100", runtime=runtime)
    g = candidate_grid(problem)
    row_rules = _row_rules(g, problem)
    rows = np.flatnonzero(row_rules)
    assert 0 < len(rows) < g.shape[0]
    part = _rows(g, rows)
    args = (problem.model, problem.global_batch, problem.gpus, problem.seq)
    brute = np.bincount(np.broadcast_to(first_violation(part, *args, rules=problem.runtime_model), part.shape).ravel(),
                        minlength=len(REASONS))
    np.testing.assert_array_equal(rule_counts(part, *args, problem.runtime_model, upto=int(row_rules.max())), brute)
    np.testing.assert_array_equal(rule_counts(g, *args, problem.runtime_model),  # every rule, every row
                                  np.bincount(np.broadcast_to(first_violation(g, *args, rules=problem.runtime_model),
                                                              g.shape).ravel(), minlength=len(REASONS)))
    result = search(problem, top=3)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        results = evaluate(problem, g)
        mem = results["memory"]
        codes = np.broadcast_to(first_violation(g, *args, extra=(~mem["fits_hbm"], ~mem["fits_host"]),
                                                rules=problem.runtime_model), g.shape).ravel()
    counts = np.bincount(codes, minlength=len(REASONS))
    assert result.evaluated == codes.size and result.valid == counts[0]
    assert result.rejected == {REASONS[k]: int(c) for k, c in enumerate(counts) if k and c}
    speed = np.broadcast_to(results["tokens_per_s"], g.shape).ravel()
    valid = np.flatnonzero(codes == 0)
    order = valid[np.lexsort((valid, -speed[valid]))[:3]]
    assert [e.layout for e in result.best] == [g.layout(int(i)) for i in order]


def test_megatron_runtimes_split_layers_as_megatron_does():
    """With the head charged to its own stage, a Megatron run was planned on luban's split (the last stage
    lightened by the head's cost): Llama 3 70B on pp 8 x 5 chunks as 11 layers on rank 0, where Megatron-Core
    builds 2 layers on each of the 40 stages (the last rank 10 layers + the head). Megatron's split: layers /
    stages, else (layers + 2) / stages with one fewer on the first and the last stage (account_for_embedding /
    account_for_loss, DeepSpeed's type:transformer|embedding); checked against placing such counts stage by
    stage (``schedules.split_rank_layers``)."""
    from luban.parallel import schedules
    from luban.plan.memory import even_rank_layers, rank_layers

    def megatron_counts(layers, stages):
        if layers % stages == 0:
            return [layers // stages] * stages
        q = (layers + 2) // stages
        return [q - 1] + [q] * (stages - 2) + [q - 1]

    for layers, pp, v, name in [(80, 8, 5, "interleaved-1f1b"), (126, 8, 8, "interleaved-1f1b"), (70, 12, 1, "1f1b"),
                                (94, 8, 4, "interleaved-1f1b"), (94, 32, 3, "interleaved-1f1b"), (36, 4, 1, "1f1b"),
                                (62, 4, 2, "dualpipev"), (64, 4, 2, "dualpipev"), (46, 2, 4, "zero-bubble")]:
        sched = schedules.get(name)
        counts = megatron_counts(layers, pp * v)
        expected = schedules.split_rank_layers(sched, pp, v, counts)
        got = even_rank_layers(layers, np.array(pp), np.array(v), np.array(sched.code), (np.array(-1),) * 3)
        assert tuple(int(x) for x in got) == tuple(expected), (layers, pp, v, name)
    layout = ParallelLayout(tp=4, pp=8, dp=2, sp=True, zero=1, schedule="interleaved-1f1b", virtual_stages=5,
                            micro_batch=1, precision="bf16")
    g = Grid.from_layout(layout)
    for runtime, expected in (("megatron-core", (10, 10, 10)), ("luban", (11, 9, 11))):
        problem = make_problem("llama-70b", gpus=64, seq=8192, batch=128, system="dgx-h100", runtime=runtime)
        assert tuple(int(x) for x in rank_layers(problem, g)) == expected
    # 80 layers (or 82) do not divide over 7 stages as Megatron's rule needs: luban's split stays
    problem = make_problem("llama-70b", gpus=56, seq=8192, batch=112, system="dgx-h100", runtime="megatron")
    assert tuple(int(x) for x in rank_layers(problem, Grid.from_layout(ParallelLayout(pp=7, dp=8)))) == tuple(
        int(x) for x in schedules.rank_layers(80, 7, 1, problem.derived["head_layers"], schedules.get("1f1b").code))


# --- hostile use ---------------------------------------------------------------------------------------

def test_a_broken_copy_of_the_reference_tables_is_one_line(tmp_path):
    """`LUBAN_REFERENCE_DIR` names the user's copy of the tables `luban plan validate` reads. A folder
    without them, or a table whose cell does not parse, was a FileNotFoundError / ValueError traceback;
    now one line naming the variable, the table and what went wrong, exit 2."""
    import os
    import shutil
    import subprocess
    import sys

    from luban.plan.validate import PACKAGED

    broken = tmp_path / "broken"
    shutil.copytree(PACKAGED, broken)
    table = broken / "korthikanti2022_table5_iteration_time_mfu.csv"
    lines = table.read_text().splitlines()
    header = next(i for i, line in enumerate(lines) if not line.startswith("#"))
    cells = lines[header + 1].split(",")
    cells[1] = "abc"  # attention_heads
    lines[header + 1] = ",".join(cells)
    table.write_text("\n".join(lines) + "\n")
    (tmp_path / "empty").mkdir()
    for folder, words in ((tmp_path / "empty", "korthikanti2022_table5_iteration_time_mfu.csv: No such file or directory"),
                          (broken, "korthikanti2022_table5_iteration_time_mfu.csv: ValueError: invalid literal")):
        try:
            done = subprocess.run([sys.executable, "-m", "luban", "plan", "validate", "--grid", "none"], capture_output=True,
                                  text=True, timeout=300, env={**os.environ, "LUBAN_REFERENCE_DIR": str(folder)})
        except subprocess.TimeoutExpired as err:
            pytest.fail(f"validate ran past 300 s: {err.stdout!r} {err.stderr!r}")
        err = done.stderr
        assert done.returncode == 2 and err.count("\n") == 1 and "Traceback" not in err, err[-2000:]
        assert err.startswith(f"luban: error: LUBAN_REFERENCE_DIR = '{folder}': ") and words in err, err


def test_the_gradient_reduce_and_the_tp_overlap_share_the_backwards_compute():
    """megatron-core hides its gradient reduce behind the last micro-batch's backward (``--overlap-grad-reduce``)
    and its TP collectives behind the GEMMs (``--tp-comm-overlap``): both subtracted the same backward, and the
    reduce the whole of it, exposed communication included. Llama 3 8B on 16 H100s (tp 8, dp 2, one
    micro-batch) hid 0.033 s of gradient reduce + 0.018 s of TP traffic behind 0.024 s of compute (2.2x).
    Now what the reduce hides is the compute the other overlaps left."""
    cases = [("llama-8b", 16, 2048, 2), ("llama-70b", 64, 4096, 8), ("llama-70b", 32, 1024, 4)]
    for model, gpus, seq, dp in cases:
        problem = make_problem(model, gpus=gpus, seq=seq, batch=dp, system="dgx-h100", runtime="megatron-core")
        t = _times(problem, ParallelLayout(tp=8, dp=dp, sp=True, zero=1, micro_batch=1, precision="bf16"))
        assert float(t["dp_hidden"]) > 0 and float(t["hidden_other"]) > 0
        assert float(t["dp_hidden"] + t["hidden_other"]) <= float(t["compute"]) * (1 + 1e-12), model


def test_dualpipev_charges_the_head_to_rank_0_only():
    """DualPipeV puts the first and the last stage on rank 0 (``Schedule.stage_ids``): the head is rank 0's.
    GPT-2 on pp 2: the split 1, 5, 5, 1 leaves rank 0 two layers + the head and rank 1 ten layers, which pace
    the step alone; 5, 1, 1, 5 gives rank 0 ten layers + the head."""
    problem = make_problem("gpt2-124m", gpus=2, seq=1024, batch=16, system="dgx-h100", runtime="megatron")
    base = ParallelLayout(pp=2, schedule="dualpipev", virtual_stages=2, micro_batch=1)
    light = _times(problem, base.replace(pp_split=(1, 5, 5, 1)))
    heavy = _times(problem, base.replace(pp_split=(5, 1, 1, 5)))
    whole = _times(problem, ParallelLayout(dp=2, micro_batch=1))
    layer_f = float(light["F"]) / 10
    np.testing.assert_allclose(float(heavy["F"]), float(whole["F"]) - 2 * layer_f, rtol=1e-9)  # 10 layers + the head
    assert float(light["F"]) < float(heavy["F"])
