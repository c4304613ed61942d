"""``[train] compile`` and ``[train] deterministic``: the config keys, and compiled training
agreeing with eager on the CPU for a GPT-2, a Llama and a MoE (one process: the layouts that
compile here; multi-rank compile costs minutes per launch on 2 cores)."""

from __future__ import annotations

import pytest
import torch

from luban.config import load_config
from luban.errors import LubanError
from luban.model.presets import get_preset
from luban.parallel.engine import OptimizerConfig, build_engine, resolve_compile
from luban.parallel.layout import ParallelLayout
from luban.train.trainer import set_deterministic


@pytest.mark.parametrize("value,stored", [("true", "true"), ("false", "false"), ('"auto"', "auto"), ("auto", "auto")])
def test_compile_key_takes_auto_or_a_boolean(value, stored):
    assert load_config(None, [f"train.compile={value}"]).train.compile == stored


@pytest.mark.parametrize("override,words", [
    ("train.compile=yes", "train.compile = 'yes': one of auto, true, false"),
    ("train.compile=1", "train.compile = 1: must be of type str"),
    ("train.deterministic=1", "train.deterministic = 1: must be of type bool"),
])
def test_bad_compile_and_deterministic_values(override, words):
    with pytest.raises(LubanError, match=words.replace("(", r"\(")):
        load_config(None, [override])


def test_auto_compiles_on_cuda_only():
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert resolve_compile("auto", cuda) and not resolve_compile("auto", cpu)
    assert resolve_compile("true", cpu) and not resolve_compile("false", cuda)


# fp32 CPU kernels of Inductor reorder reductions: agreement, not bitwise equality. The
# gradients are compared (what compiling could get wrong), and the optimizer is SGD: AdamW's
# first steps move every weight by about lr whatever the gradient's size, so a rounding-level
# gradient difference near zero became a 1e-4 weight difference (CI failed on it).
TOLERANCE = dict(rtol=1e-4, atol=1e-6)


@pytest.mark.slow
@pytest.mark.timeout(2400)  # Inductor compiles C++ kernels: ~1-3 min per model on an idle 2-core machine
@pytest.mark.parametrize("preset", ["tiny", "tiny-llama", "tiny-moe"])
def test_compiled_training_agrees_with_eager(preset):
    cfg = get_preset(preset).replace(layers=2, seq_len=32)
    layout = ParallelLayout(recompute="selective" if preset == "tiny-llama" else "none")
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, cfg.vocab, (4, 32), generator=g), torch.randint(0, cfg.vocab, (4, 32), generator=g))
               for _ in range(2)]
    runs = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        engine = build_engine(cfg, layout, OptimizerConfig(name="sgd", weight_decay=0.0), 4, seed=0,
                              device=torch.device("cpu"), compile=compiled)
        losses, grads = [], []
        for step, (x, y) in enumerate(batches):
            # compiled once, in the first step: a MoE's expert loop (its split sizes are data) had Dynamo
            # recompile the layer at every new count of 0 or 1 (Experts.loop is now left eager)
            with torch._dynamo.config.patch(error_on_recompile=compiled and step > 0):
                losses.append(engine.forward_backward(x, y))
            grads.append({n: p.grad.detach().clone() for n, p in engine.model.named_parameters() if p.grad is not None})
            engine.step(0.1, 1.0)
        runs[compiled] = losses, grads, {k: v.detach().clone() for k, v in engine.model.state_dict().items()}
        assert engine.compiled == compiled
    (eager_loss, eager_grads, eager_state), (comp_loss, comp_grads, comp_state) = runs[False], runs[True]
    torch.testing.assert_close(torch.tensor(comp_loss, dtype=torch.float64),
                               torch.tensor(eager_loss, dtype=torch.float64), **TOLERANCE)
    for step, (eager, comp) in enumerate(zip(eager_grads, comp_grads)):
        assert comp.keys() == eager.keys() and eager, step  # every parameter has a gradient, under its name
        # rounding is relative to the model's gradients, not to each tensor's: some are rounding
        # noise themselves (a key bias: softmax cancels it, its true gradient is 0)
        scale = max(value.abs().max().item() for value in eager.values())
        for name, value in eager.items():
            torch.testing.assert_close(comp[name], value, rtol=1e-4, atol=1e-5 * scale, msg=f"step {step}: {name}")
    assert comp_state.keys() == eager_state.keys()  # compiling in place keeps the names
    for name, value in eager_state.items():
        torch.testing.assert_close(comp_state[name], value, **TOLERANCE, msg=name)


def test_deterministic_mode_runs_every_family_on_the_cpu():
    """Strict mode raises on any kernel without a deterministic implementation: none on the
    path of a GPT-2, Llama or MoE step (the CPU half of the check; bench/gpu_check.py runs the
    GPU half: two runs and a resumed run bitwise equal)."""
    try:
        set_deterministic(True, torch.device("cpu"))
        assert torch.are_deterministic_algorithms_enabled()
        for preset in ("tiny", "tiny-llama", "tiny-moe"):
            cfg = get_preset(preset).replace(layers=2, seq_len=16)
            losses = []
            for _ in range(2):
                engine = build_engine(cfg, ParallelLayout(precision="bf16"), OptimizerConfig(name="adamw"), 2,
                                      seed=0, device=torch.device("cpu"))
                x = torch.arange(32).reshape(2, 16) % cfg.vocab
                losses.append((engine.forward_backward(x, x), engine.step(1e-3, 1.0)))
            assert losses[0] == losses[1], preset
    finally:
        torch.use_deterministic_algorithms(False)
