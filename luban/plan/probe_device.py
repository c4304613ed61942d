"""``luban plan probe --device cuda``: measure an accelerator into a GPU system profile.

A GPU profile keeps its datasheet figures (peak FLOP/s per precision, link bandwidths, memory
size: ``--base``, a built-in profile of the same GPU) and replaces what the planner's time model
takes as efficiencies with measurements on this device:

* ``efficiency.matmul`` at the profile's ``matmul_size`` points: a bf16 GEMM of each FLOP count
  (the shapes the planner's ``compute_seconds`` sees: ``tokens x h x n``, here square, multiples
  of 64), achieved FLOP/s over the datasheet peak;
* ``efficiency.attention_matmul``: causal ``scaled_dot_product_attention`` forward + backward at
  ``seq`` tokens (FLOPs: 4·s²·d per head forward, halved for causal, x3.5 with backward as
  FlashAttention-2 counts it, Dao 2023 Sec. 4.1), over the GEMM curve at that FLOP count
  (``luban.plan.time.attention_share``); ``attention_fa3_speedup`` is set to 1 (the measured
  kernel is whatever SDPA dispatches to);
* ``hbm_bandwidth`` x ``hbm_efficiency``: a large device copy (read + write); the probe stores
  the measured bandwidth with efficiency 1;
* ``elementwise_traffic``: HBM bytes a GELU forward + backward moves per byte of its input
  (x, out; grad, x, grad-in), measured as time x copy bandwidth over the input bytes;
* ``host_link_bandwidth``/``offload_bandwidth``: a pinned host -> device copy;
* ``kernel_launch_s``: host seconds per eager kernel (a chain of tiny in-place adds), which
  paces an eager runtime whose kernels are shorter than their dispatch (``time.host_bound``);
* ``unaligned_gemm``: the LM head's three GEMMs at GPT-2's odd vocabulary (50,257) against the
  same at the next multiple of 64, expressed as the share of the peak one of the three would run
  at to account for the difference (``time.unaligned_head_seconds`` charges one that way); no
  difference gives the GEMM curve itself (no penalty).

Every function takes ``device``: on ``cpu`` the same code path runs at small sizes (the tests),
so it cannot rot while no GPU is at hand.
"""

from __future__ import annotations

import math

from luban.plan.probe import _best_seconds

BASE = "dgx-h100"  # the built-in profile whose datasheet figures a probe keeps (plan probe --base)


def _sync(device: str):
    """Wait for ``device`` itself (``cuda:1`` is not the current device: a bare synchronize would
    wait for device 0 and time only the launches)."""
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def _timed(fn, device: str, budget: float) -> float:
    def run():
        fn()
        _sync(device)
    return _best_seconds(run, budget, min_reps=3, warmup=2)


def gemm_efficiency(device: str, peak: float, sizes, dtype=None, budget: float = 0.2, cap: int = 16384) -> list:
    """Achieved FLOP/s over ``peak`` of a square GEMM of each FLOP count in ``sizes`` (n = the
    cube root of FLOPs/2, a multiple of 64, at most ``cap``)."""
    import torch

    dtype = dtype or torch.bfloat16
    out = []
    for flops in sizes:
        n = min(cap, max(64, int(round((flops / 2) ** (1 / 3) / 64)) * 64))
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        seconds = _timed(lambda: torch.mm(a, b), device, budget)
        out.append(min(1.0, 2 * n**3 / seconds / peak))
    return out


def attention_flops(batch: int, heads: int, seq: int, head_dim: int) -> float:
    """Causal forward + backward FLOPs of the attention core: 4·s²·d per head forward, half of it
    causal, x3.5 with the backward (FlashAttention-2's count, Dao 2023 Sec. 4.1)."""
    return 3.5 * 4 * batch * heads * seq * seq * head_dim / 2


def attention_seconds(device: str, batch: int, heads: int, seq: int, head_dim: int, dtype=None, budget: float = 0.3) -> float:
    import torch
    import torch.nn.functional as F

    dtype = dtype or torch.bfloat16
    q, k, v = (torch.randn(batch, heads, seq, head_dim, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    grad = torch.randn(batch, heads, seq, head_dim, device=device, dtype=dtype)

    def step():  # the gradients returned, not accumulated into .grad (one more pass over q, k, v a rep)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.autograd.grad(out, (q, k, v), grad)
    return _timed(step, device, budget)


def copy_bandwidth(device: str, nbytes: int, budget: float = 0.3) -> float:
    """Bytes/s of a device-to-device copy (each byte read once and written once)."""
    import torch

    src = torch.ones(nbytes // 2, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    return 2 * nbytes / _timed(lambda: dst.copy_(src), device, budget)


def gelu_traffic(device: str, nbytes: int, bandwidth: float, budget: float = 0.3) -> float:
    """HBM bytes per input byte of a GELU forward + backward, from its time at ``bandwidth``."""
    import torch
    import torch.nn.functional as F

    x = torch.randn(nbytes // 2, device=device, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.ones_like(x)

    def step():  # autograd.grad: accumulating into x.grad would add a read-read-write pass (5 -> 8 bytes)
        torch.autograd.grad(F.gelu(x, approximate="tanh"), x, grad)
    return _timed(step, device, budget) * bandwidth / nbytes


def host_link_bandwidth(device: str, nbytes: int, budget: float = 0.3) -> float:
    """Bytes/s of a pinned host -> device copy (a plain copy on ``cpu``)."""
    import torch

    pinned = device.startswith("cuda")
    src = torch.ones(nbytes // 2, dtype=torch.bfloat16, pin_memory=pinned)
    dst = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    return nbytes / _timed(lambda: dst.copy_(src, non_blocking=pinned), device, budget)


def kernel_launch_seconds(device: str, kernels: int = 2000, budget: float = 0.3) -> float:
    """Host seconds per eager kernel: ``kernels`` dependent in-place adds on a one-element tensor
    (each too small to keep the GPU busy), timed from the first dispatch to the last completion."""
    import torch

    x = torch.zeros(1, device=device)

    def chain():
        for _ in range(kernels):
            x.add_(1.0)
    return _timed(chain, device, budget) / kernels


def unaligned_gemm_share(device: str, peak: float, curve, tokens: int = 16384, hidden: int = 768, vocab: int = 50257,
                         dtype=None, budget: float = 0.2) -> float:
    """Share of ``peak`` at which one head GEMM (2·tokens·hidden·vocab FLOPs) would have to run,
    the other two on the GEMM curve (``curve(flops)``), to take the time the three head GEMMs
    (logits, input gradient, weight gradient) take at the odd ``vocab`` beyond the same GEMMs at
    the next multiple of 64 (scaled to the same width); ``curve(flops)`` when nothing is lost."""
    import torch

    dtype = dtype or torch.bfloat16
    aligned = -(-vocab // 64) * 64

    def head_seconds(v: int) -> float:
        x = torch.randn(tokens, hidden, device=device, dtype=dtype)
        w = torch.randn(v, hidden, device=device, dtype=dtype)
        g = torch.randn(tokens, v, device=device, dtype=dtype)
        return sum(_timed(f, device, budget) for f in (lambda: x @ w.t(), lambda: g @ w, lambda: g.t() @ x))

    extra = max(0.0, head_seconds(vocab) - head_seconds(aligned) * vocab / aligned)
    flops = 2.0 * tokens * hidden * vocab
    return min(1.0, flops / (peak * (flops / (peak * curve(flops)) + extra)))


def probe_device(device: str = "cuda", base: str = BASE, scale: float = 1.0, budget: float = 0.2) -> dict:
    """A profile of ``base`` with the efficiencies measured on ``device``. ``scale`` < 1 shrinks
    every buffer and GEMM (the tests run it on ``cpu`` at 1e-3); sizes are those of the planner."""
    from luban.plan.system import load_system

    raw = load_system(base).to_dict()
    eff = dict(raw["efficiency"])
    peak = float(raw["peak_flops"]["bf16"]) if device.startswith("cuda") else None
    big = max(1 << 16, int((1 << 30) * scale))  # bytes of the bandwidth buffers
    hbm = copy_bandwidth(device, big, budget)
    sizes = [s * scale for s in eff["matmul_size"]]
    if peak is None:  # a CPU run: its own best GEMM stands in for the datasheet peak
        from luban.plan.probe import measure_matmul_peak
        peak = measure_matmul_peak(0.2)
    eff["matmul"] = gemm_efficiency(device, peak, sizes, budget=budget, cap=16384 if scale >= 1 else 256)
    log_sizes, log_eff = [math.log(x) for x in sizes], [math.log(max(e, 1e-6)) for e in eff["matmul"]]

    def curve(flops: float) -> float:
        """The measured GEMM curve at ``flops`` (log-log interpolation, as the planner reads it)."""
        return math.exp(_interp(math.log(flops), log_sizes, log_eff))
    seq = 8192 if scale >= 1 else 128
    heads, head_dim, batch = (16, 128, 1) if scale >= 1 else (2, 32, 1)
    flops = attention_flops(batch, heads, seq, head_dim)
    achieved = flops / attention_seconds(device, batch, heads, seq, head_dim, budget=budget)
    eff["attention_matmul"] = min(1.0, achieved / peak / curve(flops))
    eff["attention_fa3_speedup"] = 1.0
    eff["elementwise_traffic"] = gelu_traffic(device, big, hbm, budget)
    eff["hbm_efficiency"] = 1.0
    eff["kernel_launch_s"] = kernel_launch_seconds(device, 2000 if scale >= 1 else 200, budget)
    head = dict(tokens=16384, hidden=768, vocab=50257) if scale >= 1 else dict(tokens=256, hidden=64, vocab=1001)
    eff["unaligned_gemm"] = unaligned_gemm_share(device, peak, curve, budget=budget, **head)
    raw.update(name=f"{base}-probed", description=f"{raw['description']}; efficiencies probed on {device}",
               hbm_bandwidth=hbm, efficiency=eff)
    link = host_link_bandwidth(device, big, budget)
    raw["host_link_bandwidth"] = raw["offload_bandwidth"] = link
    return raw


def _interp(x, xs, ys):
    if x <= xs[0]:
        return ys[0]
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return ys[-1]
