"""The planner: estimate, search and validate parallel layouts analytically (docs/planner.md)."""

# fused attention generations the time model knows (``Problem.attention_kernel``): FlashAttention-2
# class (any GPU) and FA3 class (Hopper: TMA, WGMMA, warp specialisation). Here, not in problem.py,
# so that the command line can declare its flag without importing numpy.
ATTENTION_KERNELS = ("fa2", "fa3")
