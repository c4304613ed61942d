"""``luban plan probe --device cuda`` (``luban.plan.probe_device``) on the paths that differ on a GPU:
which device its timer waits for, and that a timed step does only the work it is charged for.

No GPU here: the waits are observed (the call ``torch.cuda.synchronize`` receives), and the timed
steps run on the CPU under a dispatch mode that lists every operator they run, the same list a
CUDA run dispatches."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from luban.plan import probe_device as pd


def test_the_timer_waits_for_the_probed_device_not_the_current_one(monkeypatch):
    """``--device cuda:1``: a bare ``torch.cuda.synchronize()`` waits for the current device
    (cuda:0), so every figure would time the kernel launches on cuda:1, not the kernels."""
    waited = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args, **kwargs: waited.append(args or kwargs))
    pd._sync("cuda:1")
    pd._sync("cuda")
    pd._sync("cpu")
    assert waited == [("cuda:1",), ("cuda",)]


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def test_timed_backward_steps_do_not_accumulate_into_grad():
    """The GELU and attention steps are timed over many repetitions: ``.backward()`` into a leaf
    adds each repetition's gradient to ``.grad`` (one more read-read-write pass over the input:
    the GELU's measured traffic 8 bytes per byte instead of its 5), which the probe would then
    charge to every elementwise pass the planner counts."""
    for run in (lambda: pd.gelu_traffic("cpu", 1 << 12, 1e9, budget=0),
                lambda: pd.attention_seconds("cpu", 1, 2, 16, 8, budget=0)):
        with _Ops() as ops:
            run()
        accumulations = [n for n in ops.names if n.startswith("aten.add")]
        assert not accumulations, accumulations
