"""Mixture-of-experts feed-forward layer (``[model] experts > 0``).

One ``MoE`` replaces the ``MLP`` of every block from ``dense_layers`` on:

    y = shared(x) + sum_{e in topk(x)} w_e(x) * expert_e(x)

* ``Router`` scores each token against every routed expert (a bias-free linear layer) and
  picks ``experts_per_token`` of them:
  - ``softmax`` (Switch / Mixtral / Qwen3-MoE): p = softmax(logits); the top-k p, renormalised
    to sum to 1 (Mixtral always, Qwen3-MoE with ``norm_topk_prob = true``);
  - ``sigmoid`` (DeepSeek-V3, Liu et al. 2024, Sec. 2.1.2): s = sigmoid(logits); the top-k of
    s + b choose the experts, the gate weights are s (without b) renormalised over the k
    chosen. b (``expert_bias``, a buffer: not trained by the optimizer, saved in checkpoints)
    is the auxiliary-loss-free balancing bias: after every optimizer step each expert's
    b_i += gamma * sign(mean load - load_i) (``router_bias_rate`` = gamma, 0.001 in the
    paper), the load counted over the whole global batch (``update_router_bias``). The load
    is the *routed* count (the top-k decisions), also under a capacity limit: the bias only
    enters the top-k, so what it can balance is the routing; the paper adjusts it by whether
    an expert is "overloaded" by that routing (and DeepSeek-V3 drops no tokens, Sec. 2.1.2).
    Kept counts are clamped at the capacity, so they hide how overloaded an expert is and can
    flip the sign: an expert routed below the mean but above the kept mean looked overloaded.
    DeepSeek-V3's node-limited group routing and routed scaling factor are not modelled.
* ``Experts`` holds the routed experts as three stacked weights ``[E, ...]`` (one parameter
  per projection, so every expert has a gradient every step and DDP/FSDP need no
  unused-parameter handling) and runs each expert on the rows sorted to it: the grouped GEMM
  interface that expert parallel reuses after its all-to-all (``luban.parallel.expert_parallel``).
  Where ``torch._grouped_mm`` has its fused kernel (``grouped_gemm_ok``: bf16 on a Hopper GPU,
  at most ``GROUPED_MM_MAX_GROUPS`` experts; Blackwell's miscomputes an expert without tokens)
  the three projections are three grouped GEMMs whose group boundaries stay on the device;
  elsewhere a loop over the experts, which reads the counts on the host (one device
  wait per MoE layer and micro-batch on a GPU; none under a capacity cut, whose sizes are the
  host's). Without expert parallel the layer's forward then reads nothing on the host (the
  counts are an ``index_add_``, not ``bincount``, which reads its input's maximum on a GPU).
* Dropless by default: every token reaches all its k experts. ``capacity_factor`` c > 0
  caps an expert at C = ceil(c * T * k / E) of the T tokens of a micro-batch (GShard, Lepikhin
  et al. 2020); later tokens in the micro-batch are dropped for that expert (their other
  experts and the residual still carry them). Each expert then computes a fixed buffer of C
  rows, its kept ones padded with zero rows (``capacity_slots``, ``MoE.capped``): every size
  is known on the host, so the cut reads nothing from the device and the GEMMs are C·E rows.
* The load-balancing loss (Switch Transformer, Fedus et al. 2021, Eq. 4):
  aux = E * sum_i f_i * P_i with f_i the fraction of the T*k assignments that go to expert i
  and P_i the mean router probability of expert i (for ``sigmoid`` the scores normalised per
  token, DeepSeek-V3's Eq. 18 over the micro-batch); under context parallel f counts the
  whole sequence (``sequence_group``), so the loss is the one of the unsplit micro-batch. Its gradient ``aux_loss_coef`` * d aux is
  injected in the backward of the layer output (``_AttachAux``, the way Megatron-Core's
  ``MoEAuxLossAutoScaler`` does), so the language-model loss the engine and the pipeline
  schedules see is unchanged; the engine tells the layers the factor its loss is scaled by
  (``set_aux_grad_scale``: micro-batch averaging, fp16 loss scale).
* Each layer counts, during training forwards only (not recompute, not evaluation, not a
  pipeline stage's shape inference), the tokens routed to each expert, those kept after the
  capacity cut (equal when dropless), the tokens dropped and the aux loss: ``collect_stats``
  / ``reset_stats`` for metrics.jsonl (per layer) and the bias update (routed counts).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from luban.model import flops
from luban.model.config import ModelConfig


def is_moe_layer(cfg: ModelConfig, layer: int) -> bool:
    """Global layer index -> whether its feed-forward is a mixture of experts."""
    return cfg.experts > 0 and layer >= cfg.dense_layers


def _in_backward() -> bool:
    """True while autograd runs a backward (activation recompute calls forward again there)."""
    return torch._C._current_graph_task_id() != -1


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.kind, self.k = cfg.router, cfg.experts_per_token
        self.weight = nn.Parameter(torch.empty(cfg.experts, cfg.hidden))
        self.register_buffer("expert_bias", torch.zeros(cfg.experts), persistent=cfg.router == "sigmoid")

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, h] -> (gate weights [T, k] fp32, expert ids [T, k], per-token probabilities [T, E] fp32)."""
        logits = F.linear(x, self.weight).float()
        if self.kind == "softmax":
            probs = logits.softmax(-1)
            weights, ids = probs.topk(self.k, dim=-1)
        else:
            scores = logits.sigmoid()
            ids = (scores + self.expert_bias).topk(self.k, dim=-1).indices
            weights = scores.gather(1, ids)
            probs = scores / scores.sum(-1, keepdim=True)
        return weights / weights.sum(-1, keepdim=True), ids, probs


# torch._grouped_mm runs its CUTLASS kernel for bf16 inputs and output on compute capability 9.x and 10.x
# (aten/src/ATen/native/cuda/GroupedBlas.cpp, torch 2.10-2.13: ``_scaled_mm_allowed_device(sm90_only,
# sm100_only)``); elsewhere ATen's ``_grouped_mm_fallback`` copies the offsets to the host and loops over
# the groups, no better than ``Experts``' own loop. Its operands' strides must be 16-byte multiples.
# 10.x is left out: its kernel (CUTLASS's sm100 grouped GEMM) writes an uncleared accumulator for a group
# of zero length along K, so an expert that got no tokens in a micro-batch gets leftovers, not zeros, as
# its weight gradient (pytorch/pytorch#172439, NVIDIA/cutlass#2674, open; Hopper gives zeros): the loop there
GROUPED_MM_CAPABILITIES = (9,)
GROUPED_MM_ALIGN_BYTES = 16
# the kernel refuses more groups (GroupMM.cu: ``TORCH_CHECK(group_count < 1024, ...)``); experts may be 2^16
GROUPED_MM_MAX_GROUPS = 1023


def grouped_gemm_ok(device: torch.device, dtype: torch.dtype, widths: tuple[int, ...], groups: int) -> bool:
    """Whether ``Experts`` runs ``torch._grouped_mm`` (device-side group offsets, no host read) for
    ``groups`` experts' operands of ``dtype`` on ``device`` whose inner dimensions are ``widths``."""
    if device.type != "cuda" or dtype != torch.bfloat16 or not hasattr(torch, "_grouped_mm"):
        return False
    if any(w * dtype.itemsize % GROUPED_MM_ALIGN_BYTES for w in widths) or groups > GROUPED_MM_MAX_GROUPS:
        return False
    return torch.cuda.get_device_capability(device)[0] in GROUPED_MM_CAPABILITIES


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a matmul of ``x`` runs in: autocast's where it is on for x's device, else x's."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype


class Experts(nn.Module):
    """E feed-forward networks (SwiGLU or GELU, no biases) as stacked weights."""

    def __init__(self, cfg: ModelConfig, num_experts: int | None = None):
        super().__init__()
        n, h, f = num_experts or cfg.experts, cfg.hidden, cfg.expert_ffn_hidden
        self.swiglu = cfg.activation == "swiglu"
        self.expert_offset = 0  # global index of the first expert held here (expert parallel)
        if self.swiglu:
            self.w_gate = nn.Parameter(torch.empty(n, f, h))
        self.w_up = nn.Parameter(torch.empty(n, f, h))
        self.w_down = nn.Parameter(torch.empty(n, h, f))

    def forward(self, x: torch.Tensor, counts: torch.Tensor, sizes: list[int] | None = None) -> torch.Tensor:
        """x [sum(counts), h]: rows sorted by (local) expert, ``counts[e]`` rows for expert e (a
        tensor on x's device); ``sizes``: the same counts as a list, where the caller has them on
        the host already (the loop then reads nothing)."""
        dtype = compute_dtype(x)
        groups, *widths = self.w_up.shape
        if grouped_gemm_ok(x.device, dtype, tuple(widths), groups):
            return self.grouped(x, counts, dtype)
        return self.loop(x, counts if sizes is None else sizes)

    def grouped(self, x: torch.Tensor, counts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The three projections as grouped GEMMs over all experts at once (``torch._grouped_mm``;
        group ends ``cumsum(counts)`` computed on the device) in ``dtype``. Each GEMM casts its own
        operands, as autocast does for the loop's: the gate's and the up projection's gradients of
        x meet in x's dtype, not rounded to ``dtype`` first."""
        offs = counts.cumsum(0).to(torch.int32)

        def mm(rows, w):  # rows [n, in] x expert e's w [out, in]^T for the rows of group e
            return torch._grouped_mm(rows.to(dtype), _local(w, dtype).transpose(-2, -1), offs=offs)

        if self.swiglu:
            hidden = F.silu(mm(x, self.w_gate)) * mm(x, self.w_up)
        else:
            hidden = F.gelu(mm(x, self.w_up), approximate="tanh")
        return mm(hidden, self.w_down)

    # Not traced by torch.compile: the split sizes are data (a host read, a graph break), and Dynamo
    # specialised the code after it on each count of 0 or 1 it met, recompiling step after step until
    # its recompile limit left the whole layer eager (a 2-layer tiny-moe compiled 6 graphs in 2 steps,
    # test_compile.py). Run eagerly, the loop is one graph break and no recompile.
    @torch.compiler.disable
    def loop(self, x: torch.Tensor, counts: torch.Tensor | list[int]) -> torch.Tensor:
        """One GEMM per expert on its rows (``counts`` read on the host where it is a tensor)."""
        counts = counts.tolist() if isinstance(counts, torch.Tensor) else counts
        # expert parallel holds DTensor shards: compute with the local experts, in x's dtype
        up = _local(self.w_up, x.dtype)
        gate = _local(self.w_gate, x.dtype) if self.swiglu else None
        down = _local(self.w_down, x.dtype)
        outs = []
        for e, rows in enumerate(x.split(counts)):
            if self.swiglu:
                hidden = F.silu(rows @ gate[e].t()) * (rows @ up[e].t())
            else:
                hidden = F.gelu(rows @ up[e].t(), approximate="tanh")
            outs.append(hidden @ down[e].t())
        return torch.cat(outs) if outs else x[:0]


def _local(p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (p.to_local() if isinstance(p, DTensor) else p).to(dtype)


class _AttachAux(torch.autograd.Function):
    """Identity on y whose backward also sends ``scale`` as the gradient of ``aux``."""

    @staticmethod
    def forward(ctx, y, aux, scale: float):
        ctx.scale = scale
        return y

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full((), ctx.scale, device=grad.device), None


def aux_loss(probs: torch.Tensor, ids: torch.Tensor, num_experts: int, group=None) -> torch.Tensor:
    """Switch load-balancing loss E * sum_i f_i * P_i (1.0 when perfectly balanced). With
    ``group`` (context parallel: the other sequence shards of the same samples) f counts the
    whole sequence; P stays this shard's mean, whose average over the group (the gradient
    averaging of dp x cp) is the whole sequence's."""
    counts = expert_counts(ids.flatten(), num_experts).float()
    total = torch.tensor(float(ids.numel()), device=ids.device)
    if group is not None:
        both = torch.cat([counts, total[None]])
        dist.all_reduce(both, group=group)
        counts, total = both[:-1], both[-1]
    return num_experts * (counts / total * probs.mean(0)).sum()


def expert_counts(flat: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Assignments per expert [E] (int64) of flat expert ids, without a host read: ``bincount``
    reads its input's maximum on a GPU to size its output; ``index_add_`` into E zeros does not."""
    return torch.zeros(num_experts, dtype=torch.long, device=flat.device).index_add_(0, flat, torch.ones_like(flat))


def sort_by_expert(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Assignments [T, k] -> (flat assignment indices sorted by expert (stable: token order within
    an expert), tokens per expert [E])."""
    flat = ids.flatten()
    return flat.argsort(stable=True), expert_counts(flat, num_experts)


def capacity_slots(ids: torch.Tensor, num_experts: int, capacity: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """GShard's fixed expert buffers (Lepikhin et al. 2020, Sec. 2.2; Megatron-Core's drop-and-pad):
    assignments [T, k] -> (flat assignment indices sorted by expert, the slot of each in a buffer of
    E * capacity rows (expert e's kept rows from e * capacity on, in token order; a dropped one gets
    a slot of its own past the buffer), tokens kept per expert [E], tokens routed to each [E]).
    Every size is the host's: the cut is a slot, not a boolean index (whose length is data: a host
    read per MoE layer on a GPU)."""
    order, routed = sort_by_expert(ids, num_experts)
    n = order.numel()
    expert = ids.flatten()[order]
    position = torch.arange(n, device=ids.device) - (routed.cumsum(0) - routed)[expert]
    past = num_experts * capacity + torch.arange(n, device=ids.device)
    slot = torch.where(position < capacity, expert * capacity + position, past)
    return order, slot, routed.clamp(max=capacity), routed


class MoE(nn.Module):
    """Routed experts (+ shared experts) replacing one block's MLP."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        from luban.model.transformer import MLP

        self.num_experts, self.k = cfg.experts, cfg.experts_per_token
        self.capacity_factor, self.aux_coef, self.bias_rate = cfg.capacity_factor, cfg.aux_loss_coef, cfg.router_bias_rate
        self.router = Router(cfg)
        self.experts = Experts(cfg)
        self.shared = (MLP(cfg.replace(ffn_hidden=cfg.shared_experts * cfg.expert_ffn_hidden, bias=False))
                       if cfg.shared_experts else None)
        self.aux_grad_scale = 1.0  # d(engine's backward loss)/d(lm loss): set by the engine
        self.dispatch = None  # expert parallel replaces this (luban.parallel.expert_parallel)
        self.counting = True  # off while a pipeline stage infers its shapes (``not_counted``)
        self.sequence_group = None  # context parallel: ranks holding the rest of the sequence
        # tokens routed to each expert (the top-k decisions) and kept after the capacity cut
        self.register_buffer("load", torch.zeros(cfg.experts, dtype=torch.float64), persistent=False)
        self.register_buffer("kept", torch.zeros(cfg.experts, dtype=torch.float64), persistent=False)
        self.register_buffer("stats", torch.zeros(2, dtype=torch.float64), persistent=False)  # aux sum, forwards

    def capacity(self, tokens: int) -> int | None:
        """An expert's capacity for a micro-batch of ``tokens`` tokens; None where nothing can be dropped:
        dropless, or a capacity of ``tokens`` or more (an expert gets a token at most once), which as a
        fixed buffer would only compute zero rows (c = 1000: 1000x the GEMM rows of dropless)."""
        capacity = flops.expert_capacity(self.capacity_factor, tokens, self.k, self.num_experts)
        return capacity or None

    def run_experts(self, rows: torch.Tensor, counts: torch.Tensor, sizes: list[int] | None = None) -> torch.Tensor:
        """The experts on ``rows`` sorted by global expert: here (``sizes``: the counts on the host, if
        known), or on their expert-parallel ranks (which exchange the counts whatever they are)."""
        if self.dispatch is None:
            return self.experts(rows, counts, sizes)
        return self.dispatch(self.experts, rows, counts)

    def capped(self, rows: torch.Tensor, slot: torch.Tensor, capacity: int) -> torch.Tensor:
        """The experts on fixed buffers of ``capacity`` rows each (``capacity_slots``): expert e
        computes its kept rows, then zero rows up to ``capacity``; a dropped assignment's output is a
        zero row. The buffer's sizes are known on the host, and its GEMMs are capacity x E rows
        (what a capacity factor bounds), not the kept count."""
        size, n = self.num_experts * capacity, rows.shape[0]
        source = torch.full((size + n,), n, dtype=torch.long, device=rows.device)  # n: the zero row
        source[slot] = torch.arange(n, device=rows.device)  # slots are distinct: no write order to pick
        zero = rows.new_zeros(1, rows.shape[1])
        buffer = torch.cat([rows, zero])[source[:size]]
        counts = torch.full((self.num_experts,), capacity, dtype=torch.long, device=rows.device)
        out = self.run_experts(buffer, counts, [capacity] * self.num_experts)
        return torch.cat([out, out.new_zeros(1, out.shape[1])])[slot.clamp(max=size)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, ids, probs = self.router(x)
        capacity = self.capacity(x.shape[0])
        if capacity is None:
            order, counts = sort_by_expert(ids, self.num_experts)
            routed = counts
            token = order // self.k
            out = self.run_experts(x[token], counts)
        else:
            order, slot, counts, routed = capacity_slots(ids, self.num_experts, capacity)
            token = order // self.k
            out = self.capped(x[token], slot, capacity)
        out = out * weights.flatten()[order, None].to(out.dtype)
        y = torch.zeros_like(x, dtype=out.dtype).index_add_(0, token, out)  # autocast: out may be bf16
        if self.training:
            aux = aux_loss(probs, ids, self.num_experts, self.sequence_group)
            if self.aux_coef and torch.is_grad_enabled():
                y = _AttachAux.apply(y, aux, self.aux_coef * self.aux_grad_scale)
            if self.counting and not _in_backward():
                with torch.no_grad():
                    self.load += routed.to(self.load.dtype)
                    self.kept += counts.to(self.kept.dtype)
                    self.stats += torch.stack([aux.detach().double(), torch.ones_like(self.stats[0])])
        if self.shared is not None:
            y = y + self.shared(x)
        return y.reshape(shape)


def moe_layers(parts) -> list[tuple[str, MoE]]:
    """(global layer index, layer) of every MoE layer in these model parts, in layer order."""
    found = []
    for part in parts:
        for name, module in part.named_modules():
            if isinstance(module, MoE):
                found.append((name.split("layers.", 1)[1].split(".", 1)[0], module))
    return sorted(found, key=lambda item: int(item[0]))


@contextlib.contextmanager
def not_counted(module: nn.Module):
    """Forwards that are not training steps (a pipeline stage's shape inference) leave the load alone."""
    layers = [m for m in module.modules() if isinstance(m, MoE)]
    for layer in layers:
        layer.counting = False
    try:
        yield
    finally:
        for layer in layers:
            layer.counting = True


def set_sequence_group(module: nn.Module, group) -> None:
    """Context parallel: the aux loss counts routing over the whole sequence (``aux_loss``)."""
    for layer in module.modules():
        if isinstance(layer, MoE):
            layer.sequence_group = group


def set_aux_grad_scale(parts, scale: float) -> None:
    for _, layer in moe_layers(parts):
        layer.aux_grad_scale = scale


@torch.no_grad()
def sum_stats(parts, all_reduce=None) -> torch.Tensor | None:
    """On the device, no host read: every layer's counters of the last step's training forwards
    (routed and kept tokens per expert, aux-loss sum, forwards) in one tensor, summed over the
    data-parallel ranks by ``all_reduce`` (sums a tensor in place) and written back, so each
    layer's ``load`` is the global routed load ``update_router_bias`` needs. Returns that tensor
    (its own storage: ``reset_stats`` leaves it) for ``read_stats``; None without MoE layers."""
    layers = moe_layers(parts)
    if not layers:
        return None
    flat = torch.cat([torch.cat([layer.load, layer.kept, layer.stats]) for _, layer in layers])
    if all_reduce is not None:
        all_reduce(flat)
    for (_, layer), chunk in zip(layers, flat.split([2 * layer.num_experts + 2 for _, layer in layers])):
        layer.load.copy_(chunk[:layer.num_experts])
        layer.kept.copy_(chunk[layer.num_experts:-2])
    return flat


def collect_stats(parts, all_reduce=None) -> dict:
    """``sum_stats`` then ``read_stats``: the last step's per-layer metrics, summed over dp."""
    return read_stats(parts, sum_stats(parts, all_reduce))


@torch.no_grad()
def read_stats(parts, flat: torch.Tensor | None) -> dict:
    """Per-layer metrics (read on the host) from ``sum_stats``' tensor: tokens routed to each expert
    and their max/mean (the routing's balance), the same for the tokens kept after the capacity
    cut (what the experts computed; equal when dropless), mean aux loss (over micro-batches,
    before the coefficient) and dropped tokens (routed - kept). Layers are keyed by global
    index, so the dicts of several pipeline stages merge with ``merge_stats``."""
    layers = moe_layers(parts)
    if flat is None or not layers:
        return {}
    flat = flat.cpu()  # one read for every layer
    metrics: dict = {key: {} for key in STAT_KEYS}
    for (name, layer), chunk in zip(layers, flat.split([2 * layer.num_experts + 2 for _, layer in layers])):
        load, kept, (aux_sum, forwards) = chunk[:layer.num_experts], chunk[layer.num_experts:-2], chunk[-2:].tolist()
        metrics["moe_tokens_per_expert"][name] = [int(v) for v in load.tolist()]
        metrics["moe_load_max_over_mean"][name] = _max_over_mean(load)
        metrics["moe_kept_tokens_per_expert"][name] = [int(v) for v in kept.tolist()]
        metrics["moe_kept_load_max_over_mean"][name] = _max_over_mean(kept)
        metrics["moe_aux_loss"][name] = aux_sum / forwards if forwards else 0.0
        metrics["moe_dropped_tokens"][name] = int(load.sum() - kept.sum())
    return metrics


def _max_over_mean(load: torch.Tensor) -> float:
    mean = float(load.mean())
    return float(load.max()) / mean if mean else 0.0


STAT_KEYS = ("moe_tokens_per_expert", "moe_load_max_over_mean", "moe_kept_tokens_per_expert",
             "moe_kept_load_max_over_mean", "moe_aux_loss", "moe_dropped_tokens")


def merge_stats(per_stage: list[dict]) -> dict:
    """One metrics dict from the ``collect_stats`` of several pipeline stages (disjoint layers)."""
    merged: dict = {}
    for stats in per_stage:
        for key, by_layer in stats.items():
            merged.setdefault(key, {}).update(by_layer)
    return {key: dict(sorted(v.items(), key=lambda kv: int(kv[0]))) for key, v in merged.items()}


@torch.no_grad()
def update_router_bias(parts) -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing, once per optimizer step, from the routed
    loads ``collect_stats`` summed (not the kept ones: module docstring): b_i += gamma *
    sign(mean load - load_i)."""
    for _, layer in moe_layers(parts):
        if layer.router.kind == "sigmoid" and layer.bias_rate:
            layer.router.expert_bias += layer.bias_rate * torch.sign(layer.load.mean() - layer.load).to(
                layer.router.expert_bias.dtype)


@torch.no_grad()
def reset_stats(parts) -> None:
    """Zero the per-step counters (after the step that used them)."""
    for _, layer in moe_layers(parts):
        layer.load.zero_()
        layer.kept.zero_()
        layer.stats.zero_()
