"""Review 2026-11-28: the training loop reads the device only on the steps it logs; Ctrl-C at any
moment of ``luban train``'s start-up ends with one line, never a traceback.

1. Each step read the loss and the grad norm to the host (``float``), drained the GPU for its
   timing and agreed on suspending with an all-reduce + ``.item()``: every step stalled the host
   until the device finished. Now only logging steps (``log_every``, eval, the last) read; the
   suspend agreement runs on a CPU (gloo) group; logged values are bitwise the old ones; the
   timing figures are means over the steps since the last logged one.
2. A Ctrl-C while ``luban.cli`` imported ``signal`` (before its recorder was installed) was a
   ``KeyboardInterrupt`` traceback.
"""

from __future__ import annotations

import collections
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch

from luban.config import load_config
from luban.parallel.engine import Engine
from luban.parallel.memory import local as _local
from luban.parallel.microbatch import MicroBatchLoop
from luban.train import preempt
from luban.train import trainer as trainer_module
from luban.train.trainer import Trainer
from tests.conftest import tiny_toml

from .conftest import assert_bitwise_equal, final_weights

ROOT = Path(__file__).resolve().parents[2]
READS = ("__float__", "item", "tolist", "__bool__", "__int__", "__index__")  # a tensor's value to the host
CHILD_TIMEOUT_S = 300  # a tiny training start-up on a loaded 2-core box takes seconds; never wait forever


def _records(run: Path) -> list[dict]:
    return [r for line in (run / "metrics.jsonl").open() if "step" in (r := json.loads(line)) and "loss" in r]


def _steps_that_read(monkeypatch, overrides) -> tuple[dict, list[int]]:
    """Train; return {step: host reads of tensors during it} and the steps that drained the device.
    A step runs from its ``forward_backward`` to the next one's (its logging and saving included)."""
    step, reads, drains = [0], collections.Counter(), []
    forward_backward = Engine.forward_backward

    def counted_forward_backward(self, *args, **kwargs):
        step[0] += 1
        return forward_backward(self, *args, **kwargs)

    def counting(name):
        original = getattr(torch.Tensor, name)

        def read(self, *args, **kwargs):
            if step[0]:
                reads[step[0]] += 1
            return original(self, *args, **kwargs)
        return read

    monkeypatch.setattr(Engine, "forward_backward", counted_forward_backward)
    for name in READS:
        monkeypatch.setattr(torch.Tensor, name, counting(name))
    monkeypatch.setattr(trainer_module, "drain", lambda device: drains.append(step[0]), raising=False)
    Trainer(load_config(None, overrides)).train()
    monkeypatch.undo()
    return dict(reads), drains


def test_only_logging_steps_read_the_device(tiny, tmp_path, monkeypatch):
    """log_every = 10 over 25 steps: the loss and grad norm reach the host (and the device is
    drained for the timing) on steps 10, 20 and 25 alone; before, on every step."""
    reads, drains = _steps_that_read(monkeypatch, tiny(**{"train.steps": 25, "train.log_every": 10,
                                                          "train.eval_every": 0}))
    assert sorted(reads) == [10, 20, 25], reads
    assert drains == [10, 20, 25]
    assert [r["step"] for r in _records(tmp_path / "run")] == [10, 20, 25]
    reads, drains = _steps_that_read(monkeypatch, tiny("every", **{"train.steps": 6, "train.log_every": 1,
                                                                   "train.eval_every": 0}))
    assert sorted(reads) == [1, 2, 3, 4, 5, 6] and drains == [1, 2, 3, 4, 5, 6]  # log_every = 1: as before


def _host_step(self, lr: float, max_norm: float, host: bool = True) -> float:
    """``Engine.step`` as it was before the device-side clip: the norm read to the host with
    ``math.sqrt(float(...))``, the clip factor a Python float applied where below 1."""
    self._sync_grads()
    grads = [_local(p.grad) for p in self._params() if p.grad is not None]
    terms = self._norm_terms()
    norms = torch.stack(list(torch._foreach_norm([_local(g) for g, _ in terms]))).double()
    copies = torch.tensor([c for _, c in terms], dtype=torch.float64)
    norm = math.sqrt(float((norms.pow(2) / copies).sum()))
    coef = max_norm / (norm + 1e-6) if max_norm > 0 else 1.0
    if coef < 1.0:
        torch._foreach_mul_(grads, coef)
    for opt in self.optimizers:
        for group in opt.param_groups:
            group["lr"] = lr
        opt.step()
    for opt in self.optimizers:
        opt.zero_grad(set_to_none=True)
    return norm


def test_logged_losses_norms_and_weights_are_bitwise_the_host_ones(tiny, tmp_path, monkeypatch):
    """The device-side clip and the tensors read late give the same bits as the host arithmetic:
    losses (the schedule's own fp32 loss, read with ``float``), grad norms and final weights; and
    log_every = 5 logs exactly log_every = 1's values at its steps."""
    extra = {"train.steps": 10, "train.eval_every": 0, "train.grad_clip": 0.05}  # small: every step clips
    totals: list[float] = []
    loop_forward_backward = MicroBatchLoop.forward_backward

    def recorded(self, *args, **kwargs):  # the schedule's loss of the step, as a host float
        total = loop_forward_backward(self, *args, **kwargs)
        totals.append(float(total))
        return total

    with monkeypatch.context() as patch:
        patch.setattr(Engine, "step", _host_step)
        patch.setattr(MicroBatchLoop, "forward_backward", recorded)
        Trainer(load_config(None, tiny("host", **extra))).train()
    Trainer(load_config(None, tiny("device", **extra))).train()
    Trainer(load_config(None, tiny("every5", **extra, **{"train.log_every": 5}))).train()
    host, device, every5 = (_records(tmp_path / name) for name in ("host", "device", "every5"))
    assert [r["loss"] for r in host] == totals  # the host path logs the schedule's loss, as before
    assert all(r["grad_norm"] > 0.05 for r in host)  # the clip was applied on every step
    for key in ("loss", "grad_norm", "lr"):
        assert [r[key] for r in device] == [r[key] for r in host], key
        assert [r[key] for r in every5] == [r[key] for r in host if r["step"] % 5 == 0], key
    assert [r["step"] for r in every5] == [5, 10]
    assert_bitwise_equal(final_weights(tmp_path / "host"), final_weights(tmp_path / "device"))
    assert_bitwise_equal(final_weights(tmp_path / "host"), final_weights(tmp_path / "every5"))


def test_timing_figures_are_means_over_the_steps_since_the_last_log(tiny, tmp_path, monkeypatch):
    """A clock that advances 0.25 s per reading, and 10 s more inside step 3's optimizer step: the
    record of step 10 (log_every = 10) carries the mean of steps 1-10, that of step 20 of 11-20."""
    clock = {"now": 0.0}

    def perf_counter():
        clock["now"] += 0.25
        return clock["now"]

    step = Engine.step

    def slow_third(self, *args, **kwargs):
        if trainer.step == 2:  # the third step (``trainer.step`` counts the steps done)
            clock["now"] += 10.0
        return step(self, *args, **kwargs)

    monkeypatch.setattr(trainer_module, "time", types.SimpleNamespace(
        perf_counter=perf_counter, monotonic=time.monotonic, strftime=time.strftime))
    monkeypatch.setattr(Engine, "step", slow_third)
    trainer = Trainer(load_config(None, tiny(**{"train.steps": 20, "train.log_every": 10, "train.eval_every": 0})))
    trainer.train()
    first, second = _records(tmp_path / "run")
    tokens_per_step = 4 * 32
    assert (first["time_data_s"], first["time_fwd_bwd_s"], first["time_optimizer_s"], first["time_step_s"]) == \
        (0.25, 0.25, 0.25 + 10.0 / 10, 0.75 + 10.0 / 10)
    assert first["tokens_per_s"] == tokens_per_step / 1.75
    assert (second["time_optimizer_s"], second["time_step_s"]) == (0.25, 0.75)
    assert second["tokens_per_s"] == tokens_per_step / 0.75


def test_suspend_agreement_is_a_cpu_all_reduce_over_a_gloo_group(monkeypatch):
    """Under NCCL the suspend flag was a CUDA tensor all-reduced and read with ``.item()`` every
    step (a full device sync); now a CPU tensor over one gloo group made beside it, once."""
    import torch.distributed as dist

    made, reduced = [], []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(dist, "new_group", lambda *a, **k: made.append(k.get("backend")) or "gloo-group")

    def all_reduce(tensor, op=None, group=None, **_):
        reduced.append((tensor.device.type, group))
        tensor.fill_(1 if len(reduced) == 2 else 0)  # another rank was signalled before the second check
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    monkeypatch.setattr(preempt, "_HOST_GROUP", None)
    flag = preempt.SuspendFlag.__new__(preempt.SuspendFlag)
    flag.requested, flag.reason = False, ""
    assert [flag.agreed(), flag.agreed()] == [False, True]
    assert made == ["gloo"] and reduced == [("cpu", "gloo-group")] * 2


# ---- 2. Ctrl-C at any moment of start-up ----------------------------------------------------
# A child that runs ``python -m luban ...`` exactly as the interpreter does (runpy), and sends itself
# SIGINT at the first import of module NAME once ``luban.cli`` has begun: a Ctrl-C at that moment,
# every time (a timed Ctrl-C lands there one run in many).
AT_IMPORT = r'''
import os, runpy, sys
name, seen = sys.argv[1], []
def hook(event, args):
    if event != "import" or (not seen and args[0] != "luban.cli"):
        return
    seen.append(args[0])
    if args[0] == name and seen.count(name) == 1:
        os.kill(os.getpid(), 2)
sys.addaudithook(hook)
assert "signal" not in sys.modules  # luban.cli imports it: the moment of the defect
sys.argv = ["-m", *sys.argv[2:]]
runpy._run_module_as_main("luban")
'''


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    try:
        return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired as err:
        raise AssertionError(f"{cmd}: still running after {CHILD_TIMEOUT_S} s: {err.stderr}") from None


@pytest.mark.parametrize("module", ["signal", "argparse", "luban.train.preempt", "torch", "luban.train.trainer"])
def test_ctrl_c_during_any_import_of_train_start_up_is_one_line(module, tmp_path):
    """From ``signal`` (imported by luban.cli before its recorder, then: a traceback) through torch to
    the trainer: a first Ctrl-C suspends the run before its first step (75, one line)."""
    child = tmp_path / "at_import.py"
    child.write_text(AT_IMPORT)
    cfg = tmp_path / "c.toml"
    cfg.write_text(tiny_toml(tmp_path / "run", {"steps": 3, "global_batch": 2, "checkpoint_every": 0,
                                                "eval_every": 0}))
    proc = _run([sys.executable, str(child), module, "train", str(cfg)], tmp_path)
    assert "Traceback" not in proc.stderr and proc.returncode == 75, (proc.returncode, proc.stderr[-3000:])
    assert "suspended on SIGINT before the first step" in proc.stdout, proc.stdout


def test_ctrl_c_during_start_up_of_another_command_is_one_line(tmp_path):
    """Not train: the recorded Ctrl-C is answered as soon as ``main`` runs, ``luban: interrupted``, 130."""
    child = tmp_path / "at_import.py"
    child.write_text(AT_IMPORT)
    proc = _run([sys.executable, str(child), "signal", "--help"], tmp_path)
    assert (proc.returncode, proc.stderr) == (130, "luban: interrupted\n"), proc.stderr[-3000:]


def test_ctrl_c_while_runpy_loads_luban_cli_is_one_line(tmp_path):
    """Before ``luban.cli``'s first line (its recorder) runs, ``python -m luban`` is in runpy and
    ``luban/__main__.py``: a Ctrl-C there was a KeyboardInterrupt traceback, exit 1."""
    child = tmp_path / "at_cli.py"
    child.write_text(AT_IMPORT.replace('os.kill(os.getpid(), 2)', 'raise KeyboardInterrupt'))
    proc = _run([sys.executable, str(child), "luban.cli", "plan", "--help"], tmp_path)
    assert (proc.returncode, proc.stderr) == (130, "luban: interrupted\n"), (proc.returncode, proc.stderr[-3000:])


def _before_luban(returncode: int, err: str) -> bool:
    """A KeyboardInterrupt traceback with no frame of luban's: runpy compiling ``luban/__main__.py``
    before its first line (its ``try``) runs. Seen in CI on a fresh clone, 2026-12-02: with
    PYTHONDONTWRITEBYTECODE=1 (this machine's environment) no .pyc is kept, so every ``python -m luban``
    compiles ``__main__.py`` and a 0.2 s Ctrl-C on a loaded machine landed in ``source_to_code``.
    Or, earlier still, CPython importing ``runpy`` itself for ``-m``: "Could not import runpy module",
    the traceback in ``importlib._bootstrap`` and exit 1 (CI, 2026-12-03, at 0.05 s): the interpreter's
    own start-up, which no code of luban's can reach."""
    frames = re.findall(r'^\s*File "([^"]+)"', err, re.MULTILINE)
    runpy = returncode == 1 and err.startswith("Could not import runpy module")
    return ((returncode == -signal.SIGINT or runpy) and err.rstrip().endswith("KeyboardInterrupt") and bool(frames)
            and all(frame.startswith("<frozen ") for frame in frames))


@pytest.mark.parametrize("delay", [0.05, 0.2, 1.0])  # at 0 s the signal lands before any code of luban: always skipped
def test_ctrl_c_at_delays_after_spawning_luban_train(delay, tmp_path):
    """The real command, Ctrl-C (SIGINT to its process group) ``delay`` s after spawn: one line and 75
    (0 if it finished first), never a traceback of luban's. Before any code of luban runs, the
    interpreter is on its own: SIGINT's default action kills it quietly (rc -2, a shell's 130), and in
    ``site`` (an editable install's finder imports pathlib: ~40 ms here) CPython reports "Fatal Python
    error: init_import_site"; those moments are outside luban (see test_ctrl_c_during_any_import_...)."""
    cfg = tmp_path / "c.toml"
    cfg.write_text(tiny_toml(tmp_path / "run", {"steps": 3, "global_batch": 2, "checkpoint_every": 0,
                                                "eval_every": 0}))
    proc = subprocess.Popen([sys.executable, "-m", "luban", "train", str(cfg)], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    time.sleep(delay)
    os.killpg(proc.pid, signal.SIGINT)
    try:
        out, err = proc.communicate(timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=30)
        raise AssertionError(f"still running {CHILD_TIMEOUT_S} s after Ctrl-C: {err[-3000:]}") from None
    if (proc.returncode, err) == (-signal.SIGINT, "") or err.startswith("Fatal Python error: init_import_site") \
            or _before_luban(proc.returncode, err):
        pytest.skip(f"Ctrl-C came before luban's first line (rc {proc.returncode}): the interpreter's start-up")
    assert "Traceback" not in err and proc.returncode in (0, 75), (proc.returncode, err[-3000:])
    assert proc.returncode == 0 or "suspended on SIGINT" in out, out


def test_train_help_then_ctrl_c_during_teardown_changes_nothing(tmp_path):
    """``luban train --help`` decided exit 0, but its parse ended before ``preempt.settle``: a Ctrl-C
    while the interpreter shut down met the default action again (killed, rc -2)."""
    code = ("import sys; sys.argv = ['luban', 'train', '--help']\n"
            "from luban import cli\n"
            "import signal\n"
            "code = cli.main()\n"
            "print('ignored' if signal.getsignal(signal.SIGINT) is signal.SIG_IGN else 'handled', code)\n")
    proc = _run([sys.executable, "-c", code], tmp_path)
    assert proc.stdout.splitlines()[-1] == "ignored 0", proc.stdout[-2000:] + proc.stderr[-2000:]
