"""``OffloadedOptimizer`` in one process: the same updates as the optimizer it wraps, state dicts
interchangeable with a plain optimizer's, and parameters changed from outside noticed.
(Across ranks, with FSDP2's DTensor shards and DCP resharding: tests/parallel/test_layouts.py.)"""

import pytest
import torch

from luban.parallel.optimizer import OptimizerConfig, build_optimizer
from luban.parallel.offload import OffloadedOptimizer

CONFIGS = [OptimizerConfig(name="adamw"), OptimizerConfig(name="sgd", momentum=0.9)]


def model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))


def train(net, opt, steps, start=0):
    for i in range(start, start + steps):
        torch.manual_seed(100 + i)
        net(torch.randn(5, 8)).pow(2).mean().backward()
        for group in opt.param_groups:
            group["lr"] = 0.01 * (1 + i)
        opt.step()
        opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.name)
def test_same_updates_as_the_plain_optimizer(cfg):
    plain, off = model(), model()
    opt_plain = build_optimizer(plain.parameters(), cfg, torch.device("cpu"))
    opt_off = build_optimizer(off.parameters(), cfg, torch.device("cpu"), offload=True)
    assert isinstance(opt_off, OffloadedOptimizer) and opt_off.state_dict()["param_groups"]
    train(plain, opt_plain, 3)
    train(off, opt_off, 3)
    for a, b in zip(plain.parameters(), off.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert len(opt_off.state) == len(list(off.parameters())) and all(p in opt_off.state for p in off.parameters())
    assert opt_off.host_bytes() > 0


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.name)
@pytest.mark.parametrize("save_offloaded", [True, False])
def test_state_dicts_move_between_offloaded_and_plain(cfg, save_offloaded):
    ref = model()
    opt_ref = build_optimizer(ref.parameters(), cfg, torch.device("cpu"))
    train(ref, opt_ref, 4)

    first = model()
    opt_first = build_optimizer(first.parameters(), cfg, torch.device("cpu"), offload=save_offloaded)
    train(first, opt_first, 2)
    second = model(seed=1)  # different weights: the loaded ones must win
    opt_second = build_optimizer(second.parameters(), cfg, torch.device("cpu"), offload=not save_offloaded)
    with torch.no_grad():
        for a, b in zip(second.parameters(), first.parameters()):
            a.copy_(b)  # as a checkpoint load does, in place
    opt_second.load_state_dict(opt_first.state_dict())
    train(second, opt_second, 2, start=2)
    for a, b in zip(ref.parameters(), second.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_a_step_without_closure_only():
    net = model()
    opt = build_optimizer(net.parameters(), CONFIGS[1], torch.device("cpu"), offload=True)
    with pytest.raises(ValueError, match="closure"):
        opt.step(lambda: 0.0)
