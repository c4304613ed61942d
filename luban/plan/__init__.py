"""The planner: estimate, search and validate parallel layouts analytically (docs/planner.md)."""

# fused attention generations the time model knows (``Problem.attention_kernel``): FlashAttention-2
# class (any GPU) and FA3 class (Hopper: TMA, WGMMA, warp specialisation). Here, not in problem.py,
# so that the command line can declare its flag without importing numpy.
ATTENTION_KERNELS = ("fa2", "fa3")

# MoE token dispatchers (``Problem.dispatcher``): ``alltoall`` sends one copy of a token per routed
# expert (Megatron-Core's alltoall dispatcher, luban); ``deepep`` one per destination node, then
# forwards over NVLink (DeepEP, Megatron-Core's flex dispatcher, at DeepEP's measured link rates);
# ``hybridep`` deduplicates per node as DeepEP does (NVIDIA's HybridEP, the flex dispatcher's other
# backend) with the links at the profile's collective curve: it publishes no link figures of its own
DISPATCHERS = ("alltoall", "deepep", "hybridep")
DEDUPLICATING = ("deepep", "hybridep")  # dispatchers that send a token once per destination node
