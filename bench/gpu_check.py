"""One command checks a GPU (issue #22 item 7): luban against its peers, the planner against
luban, every single-GPU option, the checkpoint stall and deterministic resume, in one process.

    python3 bench/gpu_check.py                    # a CUDA machine: $OUT/gpu.md if $OUT is set, else
                                                  # bench/results/gpu.md (stops starting rows at 8 min)
    python3 bench/gpu_check.py --cpu --out FILE   # the smoke mode CI runs: tiny shapes, every section

The report is rewritten after every row (and each row printed as it ends), so a run killed at its
time limit still leaves every row it finished. ``--budget-s`` (default 480 on a GPU) bounds the
run: a row is not started with less than ``ROW_RESERVE_S`` (60 s) left (it reads "skipped: time
budget"), and one still running ``OVERRUN_S`` (60 s) past the budget is stopped ("stopped: time
budget"); on an H100 the whole check takes longer than 8 minutes, so the last sections may be skipped
(``--sections`` picks which run).
luban need not be installed: the script puts its own checkout first on ``sys.path``.

Sections of the report (each a table; a row that fails says why instead of stopping the run):

(a) **Peers.** GPT-2 124M, Llama 1B and a MoE of GPT-2-124M width (Llama-style, 8 experts,
    top 2) at batch × seq, bf16: ``luban train``'s own path (``Trainer`` on a real run folder,
    figures read back from its metrics.jsonl), Hugging Face ``AutoModelForCausalLM`` built
    from the same config (``luban.model.hf.hf_config``; compiled on a GPU), and a minimal
    reference loop written below (same shapes, same FLOPs: one compiled module with the loss
    inside, fused AdamW, bf16 autocast — the nanoGPT recipe). Step time (median after the
    warm-up steps, which include compiling), tokens/s, MFU (``luban.model.flops``, the
    device's dense bf16 peak) and peak memory. Hugging Face runs twice: as shipped, and with
    its causal mask skipped while compiling (``causal_mask_skipped``); the difference beside
    what the planner's ``transformers`` runtime charges for the mask (``masks_attention``).
(b) **Planner vs measured.** ``luban plan``'s prediction for each luban row (runtime
    ``luban``) next to the measurement: with the built-in profile of this device, and with a
    profile ``luban plan probe --device cuda`` measures here first (``probe_device``: GEMM curve,
    attention, HBM, elementwise traffic, launch cost, unaligned GEMM) — issue #25 item 4. Then
    that item as written: the reference file's single-GPU rows (luban 3457f4b, Hugging Face, the
    reference loop; 2026-11-25) planned on both profiles, with each column's mean |error|.
(c) **Options.** Every single-GPU option of issue #22 item 1 through ``luban train`` on the
    first model: precision, recompute, offload, ZeRO at dp 1, compile on and off, each a row.
(d) **Checkpoint stall.** Asynchronous vs synchronous saves through ``luban train``: the stall
    reported in metrics.jsonl and the steps while the write runs.
(e) **Deterministic resume.** ``[train] deterministic = true``: two fresh runs, and one
    suspended and resumed half-way, compared tensor by tensor (bitwise).
(f) **MoE layer pieces.** One rank's forward of one MoE layer at the MoE validation rows' shapes
    (Qwen3-30B-A3B, GPT-OSS-120B, Qwen3-235B-A22B): the routed experts' GEMMs (per-expert loop,
    ``torch._grouped_mm``, fp8 ``torch._scaled_mm``), the token permutation and the dropless
    dispatcher's host synchronisation, each beside what the planner charges for it — where the
    fine-grained MoE rows' missing time is (docs/planner.md, MoE).

The CPU mode runs every section on tiny shapes (compile off, HF eager): its numbers mean
nothing, it keeps the script from rotting (tests/bench/test_gpu_check.py runs it).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `python3 bench/gpu_check.py` on a machine where luban is not installed
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from luban.config import config_from_dict  # noqa: E402
from luban.model import flops  # noqa: E402
from luban.model.config import ModelConfig  # noqa: E402
from luban.model.moe import grouped_gemm_ok  # noqa: E402
from luban.model.presets import get_preset  # noqa: E402

# dense bf16 peak FLOP/s of the devices this is run on (NVIDIA H100/H200 SXM datasheets:
# 989.4 TFLOP/s without sparsity); luban.train.peak measures the CPU's
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12}


def moe_of_gpt2_width(vocab: int = 50257, seq: int = 1024) -> ModelConfig:
    """GPT-2 124M's width and depth as a Llama-style MoE: 8 experts, top 2 (issue #22 7a)."""
    return get_preset("llama-1b").replace(name="moe-124m-8x2", hidden=768, layers=12, heads=12, kv_heads=12,
                                          head_dim=64, ffn_hidden=2048, vocab=vocab, seq_len=seq, experts=8,
                                          experts_per_token=2, expert_ffn_hidden=2048, tie_embeddings=True,
                                          rope_theta=10000.0)


# a row is started only with this much of the budget left (a compiled Llama 1B row on an H100
# takes about a minute or two), and one still running this long past the budget is stopped;
# both at most an eighth of the budget (a short budget: the tests)
ROW_RESERVE_S = 60.0
OVERRUN_S = 60.0


def reserve_s(budget: float) -> float:
    return min(ROW_RESERVE_S, budget / 8)


def overrun_s(budget: float) -> float:
    return min(OVERRUN_S, budget / 8)


class TimeUp(BaseException):
    """Raised in the main thread ``OVERRUN_S`` after the budget (not an ``Exception``: the
    sections' per-row handlers let it through to ``main``)."""


class Rows(list):
    """A section's rows: each append rewrites the report (``Setup.live``)."""

    def __init__(self, on_append):
        super().__init__()
        self.on_append = on_append

    def append(self, row) -> None:
        super().append(row)
        self.on_append(row)


class Setup:
    """Shapes and models for one mode, the time budget, and the live rows of the section running."""

    def __init__(self, cpu: bool, budget_s: float = 0.0):
        self.cpu = cpu
        self.start, self.budget_s = time.perf_counter(), budget_s
        self.current: Rows | None = None  # the running section's rows
        self.stopped: str | None = None  # a signal suspended a run: start nothing more
        self.on_row = lambda row: None  # main: print the row, rewrite the report
        self.device = torch.device("cpu" if cpu else "cuda")
        if cpu:
            self.batch, self.seq, self.steps, self.warmup = 2, 32, 4, 1
            tiny = {n: get_preset(n).replace(seq_len=32, layers=2) for n in ("tiny", "tiny-llama")}
            self.models = {"gpt2 (tiny)": tiny["tiny"], "llama (tiny)": tiny["tiny-llama"],
                           "moe 8x2 (tiny)": tiny["tiny-llama"].replace(name="tiny-moe-8x2", experts=8,
                                                                         experts_per_token=2, expert_ffn_hidden=64)}
        else:
            self.batch, self.seq, self.steps, self.warmup = 16, 1024, 30, 10
            self.models = {"GPT-2 124M": get_preset("gpt2-124m"),
                           "Llama 1B": get_preset("llama-1b").replace(seq_len=1024),
                           "MoE 124M 8x2": moe_of_gpt2_width()}
        name = torch.cuda.get_device_name() if not cpu else platform.processor() or platform.machine()
        self.device_name = name
        self.peak = next((v for k, v in PEAK_BF16.items() if k in name), None) if not cpu else None
        if self.peak is None:
            from luban.train.peak import peak_flops

            self.peak = peak_flops(self.device.type, "bf16")

    def rows(self) -> Rows:
        """A new section's rows (every append is reported at once)."""
        self.current = Rows(lambda row: self.on_row(row))
        return self.current

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def out_of_time(self) -> str | None:
        """Why a new row must not start (a signal arrived, too little of the budget left), or None."""
        if self.stopped:
            return self.stopped
        if self.budget_s and self.elapsed() > self.budget_s - reserve_s(self.budget_s):
            return f"skipped: time budget ({self.elapsed():.0f} s of {self.budget_s:.0f} s used)"
        return None


# ---- luban train's own path ------------------------------------------------------------------
def luban_train(setup: Setup, model: ModelConfig, run_dir: Path, steps: int | None = None,
                train: dict | None = None, parallel: dict | None = None, resume: str | None = None) -> dict:
    """A real ``luban train`` run (the ``Trainer`` the CLI's ranks run) on random-free data:
    the embedded corpus at this sequence length; figures from its metrics.jsonl."""
    from luban.train.trainer import Trainer

    raw = {"model": {k: v for k, v in model.to_dict().items() if k != "name"},
           "data": {"seq_len": setup.seq, "eval_batches": 1},
           "train": {"steps": steps or setup.steps, "global_batch": setup.batch, "eval_every": 0,
                     "checkpoint_every": 0, "warmup_steps": 1, **(train or {})},
           "parallel": {"micro_batch": setup.batch, "precision": "bf16", **(parallel or {})},
           "run": {"dir": str(run_dir), "device": setup.device.type, "tensorboard": False, "progress": "none"}}
    if setup.cpu:
        raw["train"].setdefault("compile", "false")
    cfg = config_from_dict(raw)
    if setup.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    if Trainer(cfg).train(resume).suspended:  # luban's handlers took a SIGTERM/SIGINT/SIGUSR1 (a time limit?)
        setup.stopped = "skipped: a signal suspended a luban train run (SIGUSR1/SIGTERM/SIGINT)"
        raise TimeUp("stopped: the run was suspended by a signal (SIGUSR1/SIGTERM/SIGINT)")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps_ = [r for r in records if "time_step_s" in r]
    # a record's times are means over the steps since the previous record (``log_every``): only
    # windows after the warm-up count
    every = raw["train"].get("log_every", 1)
    times = [r["time_step_s"] for r in steps_ if r["step"] - every >= setup.warmup] or [r["time_step_s"] for r in steps_]
    step_s = statistics.median(times)
    tokens = setup.batch * setup.seq
    return {"step_s": step_s, "first_step_s": steps_[0]["time_step_s"], "tokens_s": tokens / step_s,
            "mfu": tokens * flops.flops_per_token(cfg.model, setup.seq) / step_s / setup.peak,
            "peak_gib": max(r.get("peak_memory_bytes", 0) for r in steps_) / 2**30,
            "activation_bytes": steps_[-1].get("activation_bytes"),
            "checkpoints": [r["checkpoint"] for r in records if "checkpoint" in r], "steps": steps_, "cfg": cfg}


# ---- Hugging Face ----------------------------------------------------------------------------
def hf_model(model: ModelConfig) -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    from luban.model import hf

    family = hf._moe_family(model) if model.experts else hf._family(model)
    raw = hf.hf_config(model, family)
    kind = raw.pop("model_type")
    raw.pop("architectures", None)
    config = AutoConfig.for_model(kind, **raw)
    config._attn_implementation = "sdpa"
    return AutoModelForCausalLM.from_config(config)


def hf_forward_loss(module: nn.Module):
    def loss(x, y):
        logits = module(input_ids=x).logits
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.view(-1))
    return loss


# ---- the reference: a minimal single-file loop ------------------------------------------------
class RefBlock(nn.Module):
    """One pre-norm block of GPT-2 (LayerNorm, GELU) or Llama (RMSNorm, SwiGLU, rope, GQA), or a
    MoE feed-forward (softmax top-k, experts looped): the FLOPs of luban.model.flops."""

    def __init__(self, c: ModelConfig):
        super().__init__()
        norm = nn.RMSNorm if c.norm == "rmsnorm" else nn.LayerNorm
        self.c, self.n1, self.n2 = c, norm(c.hidden), norm(c.hidden)
        self.qkv = nn.Linear(c.hidden, c.q_dim + 2 * c.kv_dim, bias=c.bias)
        self.o = nn.Linear(c.q_dim, c.hidden, bias=c.bias)
        width = c.expert_ffn_hidden if c.experts else c.ffn_hidden
        n = c.experts or 1
        self.up = nn.Parameter(torch.randn(n, (2 if c.activation == "swiglu" else 1) * width, c.hidden) * 0.02)
        self.down = nn.Parameter(torch.randn(n, c.hidden, width) * 0.02)
        self.router = nn.Linear(c.hidden, c.experts, bias=False) if c.experts else None

    def ffn(self, x, e):
        h = x @ self.up[e].t()
        if self.c.activation == "swiglu":
            a, b = h.chunk(2, dim=-1)
            h = F.silu(a) * b
        else:
            h = F.gelu(h, approximate="tanh")
        return h @ self.down[e].t()

    def forward(self, x, cos, sin):
        c, (b, s, _) = self.c, x.shape
        q, k, v = self.qkv(self.n1(x)).split([c.q_dim, c.kv_dim, c.kv_dim], dim=-1)
        q, k, v = (t.view(b, s, -1, c.head_dim).transpose(1, 2) for t in (q, k, v))
        if cos is not None:
            rot = lambda t: t * cos + torch.cat([-t[..., c.head_dim // 2:], t[..., :c.head_dim // 2]], -1) * sin
            q, k = rot(q), rot(k)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=c.kv_heads != c.heads)
        x = x + self.o(y.transpose(1, 2).reshape(b, s, -1))
        h = self.n2(x)
        if self.router is None:
            return x + self.ffn(h, 0)
        flat = h.view(-1, c.hidden)
        weights, ids = self.router(flat).softmax(-1).topk(c.experts_per_token, dim=-1)
        out = torch.zeros_like(flat)
        for e in range(c.experts):
            rows, slot = (ids == e).nonzero(as_tuple=True)
            out.index_add_(0, rows, (self.ffn(flat[rows], e) * weights[rows, slot, None]).to(out.dtype))
        return x + out.view_as(x)


class RefModel(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.c = c
        self.emb = nn.Embedding(c.vocab, c.hidden)
        self.pos = nn.Embedding(c.seq_len, c.hidden) if c.position == "learned" else None
        self.blocks = nn.ModuleList(RefBlock(c) for _ in range(c.layers))
        self.norm = nn.RMSNorm(c.hidden) if c.norm == "rmsnorm" else nn.LayerNorm(c.hidden)
        self.head = nn.Linear(c.hidden, c.vocab, bias=False)
        if c.tie_embeddings:
            self.head.weight = self.emb.weight
        if c.position == "rope":
            inv = 1.0 / c.rope_theta ** (torch.arange(0, c.head_dim, 2).float() / c.head_dim)
            ang = torch.outer(torch.arange(c.seq_len).float(), inv).repeat(1, 2)
            self.register_buffer("cos", ang.cos(), persistent=False)
            self.register_buffer("sin", ang.sin(), persistent=False)

    def forward(self, x, y):
        s = x.shape[1]
        h = self.emb(x) + (self.pos.weight[:s] if self.pos is not None else 0)
        cos, sin = (self.cos[:s], self.sin[:s]) if self.pos is None else (None, None)
        for block in self.blocks:
            h = block(h, cos, sin)
        logits = self.head(self.norm(h))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.view(-1))


def timed_loop(setup: Setup, model: nn.Module, loss_fn) -> dict:
    """Median step of a bare loop: bf16 autocast, fused AdamW, synchronised timing."""
    model.to(setup.device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=setup.device.type == "cuda")
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, model_vocab(model), (setup.batch, setup.seq), generator=g).to(setup.device)
    y = torch.randint(0, model_vocab(model), (setup.batch, setup.seq), generator=g).to(setup.device)
    if setup.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(setup.warmup + setup.steps):
        sync(setup)
        t0 = time.perf_counter()
        with torch.autocast(setup.device.type, dtype=torch.bfloat16):
            loss = loss_fn(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(setup)
        if i >= setup.warmup:
            times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    peak = torch.cuda.max_memory_allocated() / 2**30 if setup.device.type == "cuda" else float("nan")
    return {"step_s": step_s, "tokens_s": setup.batch * setup.seq / step_s, "peak_gib": peak}


def model_vocab(model: nn.Module) -> int:
    return getattr(getattr(model, "config", None), "vocab_size", None) or model.c.vocab


def sync(setup: Setup) -> None:
    if setup.device.type == "cuda":
        torch.cuda.synchronize()


def maybe_compile(setup: Setup, fn):
    return fn if setup.cpu else torch.compile(fn)


# ---- the sections ------------------------------------------------------------------------------
def peers(setup: Setup, root: Path) -> tuple[list, list]:
    rows, plan_rows = setup.rows(), []
    for name, model in setup.models.items():
        cfg = model.replace(seq_len=max(model.seq_len, setup.seq))
        fpt = flops.flops_per_token(cfg, setup.seq)
        result = {}
        for runner in ("luban train", LUBAN_LOG_10, "Hugging Face", HF_NO_MASK, "reference loop"):
            if skipped := setup.out_of_time():
                rows.append([name, runner, skipped, "", "", ""])
                continue
            try:
                if runner == "luban train":
                    r = luban_train(setup, cfg, root / f"peer-{len(rows)}")
                    plan_rows.append((name, r, r["cfg"]))
                elif runner == LUBAN_LOG_10:
                    r = luban_train(setup, cfg, root / f"peer-{len(rows)}", train={"log_every": LOG_EVERY})
                elif runner in ("Hugging Face", HF_NO_MASK):
                    m = hf_model(cfg).to(setup.device)
                    with causal_mask_skipped(runner == HF_NO_MASK):
                        r = timed_loop(setup, m, maybe_compile(setup, hf_forward_loss(m)))
                else:
                    m = RefModel(cfg).to(setup.device)
                    r = timed_loop(setup, m, maybe_compile(setup, m))
                r["mfu"] = r["tokens_s"] * fpt / setup.peak
                result[runner] = r
                rows.append([name, runner, ms(r["step_s"]), f"{r['tokens_s']:,.0f}", pct(r["mfu"]), gib(r["peak_gib"])])
            except Exception as err:  # noqa: BLE001 - a failing row is reported, the rest still run
                rows.append([name, runner, "failed", one_line(err), "", ""])
            finally:
                free(setup)
        if "luban train" in result and "reference loop" in result:
            ratio = result["reference loop"]["step_s"] / result["luban train"]["step_s"]
            rows.append([name, "luban / reference (tokens/s)", f"{ratio:.2f}x", "", "", ""])
        if LUBAN_LOG_10 in result and "reference loop" in result:
            ratio = result["reference loop"]["step_s"] / result[LUBAN_LOG_10]["step_s"]
            rows.append([name, f"luban (log_every {LOG_EVERY}) / reference (tokens/s)", f"{ratio:.2f}x", "", "", ""])
        if cfg.moe:  # which expert path luban's MoE took here (docs/training.md "What a step waits for")
            grouped = grouped_gemm_ok(setup.device, torch.bfloat16, (cfg.expert_ffn_hidden, cfg.hidden), cfg.experts)
            rows.append([name, "luban's experts (bf16)", "torch._grouped_mm, device-side offsets" if grouped
                         else "per-expert loop (a host read of the counts per MoE layer)", "", "", ""])
        if "luban train" in result and "Hugging Face" in result:
            ratio = result["Hugging Face"]["step_s"] / result["luban train"]["step_s"]
            rows.append([name, "luban / Hugging Face (tokens/s)", f"{ratio:.2f}x", "", "", ""])
        if "Hugging Face" in result and HF_NO_MASK in result:  # the planner's runtime transformers, masks_attention
            cost = result["Hugging Face"]["step_s"] - result[HF_NO_MASK]["step_s"]
            rows.append([name, "HF's causal mask: measured / planned", f"{ms(cost)} / {ms(planned_mask_cost(setup, cfg))}",
                         "", "", ""])
    return rows, plan_rows


HF_NO_MASK = "Hugging Face, causal mask skipped"
# luban train reading the device only every LOG_EVERY steps (its loss, grad norm and timing; docs/training.md
# "What a step waits for"), as nanoGPT's loop does with log_interval; the "luban train" row logs every step,
# a host read and a device drain per step, as the reference loop's timing does
LOG_EVERY = 10
LUBAN_LOG_10 = f"luban train, log_every {LOG_EVERY}"


@contextlib.contextmanager
def causal_mask_skipped(skip: bool):
    """transformers (5.17-5.24 with torch < 2.14) never skips the causal mask while compiling
    (``masking_utils._ignore_causal_mask_sdpa`` returns False under ``is_tracing``), so SDPA gets
    an explicit mask and no flash kernel; ``skip`` makes it take ``is_causal`` as it does eager
    (these rows have no padding). The difference is what the planner's ``transformers`` runtime
    charges as ``masks_attention``."""
    from transformers import masking_utils

    original = masking_utils._ignore_causal_mask_sdpa
    if skip:
        masking_utils._ignore_causal_mask_sdpa = lambda padding_mask, *args, **kwargs: padding_mask is None
    try:
        yield
    finally:
        masking_utils._ignore_causal_mask_sdpa = original


def planned_mask_cost(setup: Setup, cfg) -> float:
    """Seconds a step the planner charges for the mask: runtime ``transformers`` minus ``pytorch``,
    both compiled, the layers' elementwise work excepted (``activation_extra_bytes`` is 0 compiled)."""
    from luban.parallel.layout import ParallelLayout
    from luban.plan.estimate import Estimate, evaluate
    from luban.plan.grid import Grid
    from luban.plan.problem import Problem
    from luban.plan.system import load_system

    g = Grid.from_layout(ParallelLayout(precision="bf16", micro_batch=setup.batch))
    steps = []
    for rt in ("transformers", "pytorch"):  # SDPA's flash kernel is FA2-class (validate.h100_single_gpu)
        problem = Problem(cfg, load_system(builtin_system(setup)), 1, setup.seq, setup.batch, runtime=rt,
                          attention_kernel="fa2", compiled=True)
        steps.append(Estimate.from_results(problem, g, evaluate(problem, g)).step_time_s)
    return steps[0] - steps[1]


# the planner's profile of each device this is run on (luban/plan/systems/); the CPU mode
# plans for the H100 too: its numbers only exercise the code
SYSTEMS = {"H100": "dgx-h100", "H200": "hgx-h200", "A100": "dgx-a100-80g"}


def builtin_system(setup: Setup) -> str:
    return next((v for k, v in SYSTEMS.items() if k in setup.device_name), "dgx-h100")


def planned(setup: Setup, cfg, system=None) -> dict:
    """The planner's step time and peak memory for this run (runtime luban, one GPU), on ``system``
    (a profile; default: the built-in profile of this device)."""
    from luban.plan.estimate import estimate

    system = system or builtin_system(setup)
    try:
        est = estimate(cfg.model, system, cfg.parallel, global_batch=cfg.train.global_batch, seq=setup.seq,
                       gpus=1, runtime="luban", optimizer=cfg.train.optimizer)
        return {"step_s": est.step_time_s, "peak_bytes": est.memory_bytes.get("total")}
    except Exception as err:  # noqa: BLE001
        return {"error": one_line(err)}


def probed_system(setup: Setup):
    """A profile of this device measured by ``luban plan probe --device cuda``'s code (small shapes
    in the CPU mode)."""
    from luban.plan.probe_device import probe_device
    from luban.plan.system import System

    raw = probe_device("cpu" if setup.cpu else "cuda", builtin_system(setup), scale=1e-3 if setup.cpu else 1.0,
                       budget=0.01 if setup.cpu else 0.2)
    return System.from_dict(raw, source="probed")


def plan_table(setup: Setup, plan_rows) -> list:
    probed, probe_error = None, setup.out_of_time()
    if probe_error is None:
        try:
            probed = probed_system(setup)
        except Exception as err:  # noqa: BLE001 - the builtin column still reports
            probe_error = one_line(err)
    rows = setup.rows()
    for name, measured, cfg in plan_rows:
        row, builtin = [name, ms(measured["step_s"])], planned(setup, cfg)
        for plan in (builtin, planned(setup, cfg, probed) if probed else {"error": "probe: " + probe_error}):
            step = plan.get("step_s")
            row += ([ms(step), f"{(step / measured['step_s'] - 1) * 100:+.0f}%"] if step
                    else ["not planned: " + plan.get("error", ""), ""])
        mem = builtin.get("peak_bytes")
        rows.append(row + [gib(measured["peak_gib"]), gib(mem / 2**30) if mem else ""])
    for row in reference_rows(setup, probed):
        rows.append(row)
    return rows


def reference_rows(setup: Setup, probed) -> list:
    """Issue #25 item 4 as written: the single-GPU rows of the reference file
    (``h100_single_gpu_measured.csv``, one H100, 2026-11-25, luban 3457f4b, Hugging Face and the
    reference loop; ``luban plan validate``'s table h100-single-gpu) planned on the built-in
    dgx-h100 profile and on the profile probed here, with the mean |error| of each. The probed
    column is scored only on an H100 (the rows were measured on one) and in the CPU smoke mode."""
    from luban.plan.validate import h100_single_gpu

    comparable = setup.cpu or "H100" in setup.device_name
    columns = [h100_single_gpu()]
    if probed is not None and comparable:
        columns.append(h100_single_gpu({"dgx-h100": probed}))
    rows, errors = [], [[] for _ in columns]
    for i, ref in enumerate(columns[0]):
        row = [f"reference file: {ref['row']}", ms(ref["reference"])]
        for col, planned_rows in enumerate(columns):
            errors[col].append(abs(planned_rows[i]["error"]))
            row += [ms(planned_rows[i]["predicted"]), f"{planned_rows[i]['error'] * 100:+.0f}%"]
        rows.append(row + [""] * (8 - len(row)))
    means = [f"{sum(e) / len(e) * 100:.1f}%" for e in errors]
    if len(columns) == 1:
        means.append("no probed profile" if probed is None else f"not scored: rows measured on an H100, this is {setup.device_name}")
    rows.append(["reference file: mean abs. error (item 4: within 10%)", "", "", means[0], "", means[1], "", ""])
    return rows


OPTIONS = [("bf16 (default)", {}, {}), ("fp32", {}, {"precision": "fp32"}), ("fp16", {}, {"precision": "fp16"}),
           ("recompute selective", {}, {"recompute": "selective"}), ("recompute full", {}, {"recompute": "full"}),
           ("offload activations", {}, {"offload": "activations"}),
           ("offload optimizer (zero 1)", {}, {"offload": "optimizer", "zero": 1}),
           ("zero 1", {}, {"zero": 1}), ("zero 3", {}, {"zero": 3}),
           ("compile off", {"compile": "false"}, {}), ("compile on", {"compile": "true"}, {})]


def options(setup: Setup, root: Path) -> list:
    name, model = next(iter(setup.models.items()))
    rows = setup.rows()
    for i, (label, train, parallel) in enumerate(OPTIONS):
        if setup.cpu and label == "compile on":
            continue  # minutes of compiling on a CPU; tests/train/test_compile.py covers it there
        if skipped := setup.out_of_time():
            rows.append([f"{name}: {label}", skipped, "", "", "", ""])
            continue
        try:
            r = luban_train(setup, model, root / f"opt-{i}", train=train, parallel=parallel)
            rows.append([f"{name}: {label}", ms(r["step_s"]), f"{r['tokens_s']:,.0f}", pct(r["mfu"]),
                         gib(r["peak_gib"]), f"{r['first_step_s']:.1f} s"])
        except Exception as err:  # noqa: BLE001
            rows.append([f"{name}: {label}", "failed", one_line(err), "", "", ""])
        finally:
            free(setup)
    return rows


def checkpoint_stall(setup: Setup, root: Path) -> list:
    name, model = next(iter(setup.models.items()))
    rows, every = setup.rows(), max(2, setup.steps // 3)
    for mode in ("sync", "async"):
        if skipped := setup.out_of_time():
            rows.append([name, mode, skipped, "", ""])
            continue
        try:
            r = luban_train(setup, model, root / f"ckpt-{mode}", steps=setup.warmup + 3 * every,
                            train={"checkpoint_every": every, "async_checkpoint": mode == "async"})
            saves = [c for c in r["checkpoints"] if c["step"] < setup.warmup + 3 * every]
            stall = statistics.median(c["stall_s"] for c in saves) if saves else float("nan")
            after = [s["time_step_s"] for s in r["steps"] if (s["step"] - 1) % every == 0 and s["step"] > every]
            rows.append([name, mode, f"{stall * 1e3:.0f} ms", ms(r["step_s"]),
                         ms(statistics.median(after)) if after else ""])
        except Exception as err:  # noqa: BLE001
            rows.append([name, mode, "failed", one_line(err), ""])
        finally:
            free(setup)
    return rows


def deterministic_resume(setup: Setup, root: Path) -> list:
    from luban.train import checkpoint

    name, model = next(iter(setup.models.items()))
    steps = setup.warmup + 4
    det = {"deterministic": True, "checkpoint_every": steps // 2}
    if skipped := setup.out_of_time():
        return [[name, "first vs second, first vs resumed", skipped, ""]]
    try:
        finals = {}
        for label in ("first", "second"):
            luban_train(setup, model, root / f"det-{label}", steps=steps, train=det)
            finals[label] = state_of(checkpoint.resolve("auto", root / f"det-{label}" / "checkpoints"))
        luban_train(setup, model, root / "det-resumed", steps=steps // 2, train=det)
        luban_train(setup, model, root / "det-resumed", steps=steps, train=det, resume="auto")
        finals["resumed"] = state_of(checkpoint.resolve("auto", root / "det-resumed" / "checkpoints"))
    except Exception as err:  # noqa: BLE001
        return [[name, "failed", one_line(err), ""]]
    finally:
        torch.use_deterministic_algorithms(False)
    rows = []
    for label in ("second", "resumed"):
        diff = [k for k in finals["first"] if not torch.equal(finals["first"][k], finals[label][k])]
        rows.append([name, f"first vs {label}", "bitwise equal" if not diff else f"{len(diff)} tensors differ",
                     str(len(finals["first"]))])
    return rows


def moe_shapes(setup: Setup) -> list:
    """(label, model, ep, tokens per rank, precision) of the MoE validation rows (luban/plan/validate.py:
    Megatron-Bridge's Qwen3-30B-A3B fp8 and GPT-OSS-120B bf16 at ep 8, Qwen3-235B-A22B at ep 32 with tp 2,
    whose sequence-parallel ranks each dispatch half of a 4096-token micro-batch)."""
    from luban.plan import validate

    if setup.cpu:
        return [("tiny-moe ep2", get_preset("tiny-moe"), 2, 64, "fp8")]  # fp8: the planned row runs, the GEMM is n/a
    oss = next(validate._moe_model(r) for r in validate.read_table(validate.MOE_TABLE)
               if r["model_as_published"].startswith("GPT OSS"))
    return [("Qwen3-30B-A3B ep8", get_preset("qwen3-30b-a3b"), 8, 4096, "fp8"),
            ("GPT-OSS-120B ep8", oss, 8, 4096, "bf16"),
            ("Qwen3-235B-A22B ep32", validate.QWEN3_235B, 32, 2048, "fp8")]


def median_seconds(setup: Setup, fn, reps: int) -> float:
    fn()
    sync(setup)
    times = []
    for _ in range(reps):
        sync(setup)
        t0 = time.perf_counter()
        fn()
        sync(setup)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def moe_pieces(setup: Setup) -> list:
    """(f) One MoE layer's pieces on one rank, forward, timed here beside what the planner charges
    (issue #25 item 5; docs/planner.md, MoE): the routed experts' GEMMs (a loop of per-expert GEMMs,
    ``torch._grouped_mm`` where it runs, fp8 ``torch._scaled_mm`` for the fp8 rows) against
    ``time.expert_gemm_seconds``; token permutation (gather the k copies into expert order,
    scatter-add them back) against ``time.moe_permutation_bytes`` at the profile's HBM rate; and the
    dropless dispatcher's per-layer host synchronisation (the token counts read on the host in a
    stream of small kernels): the planner charges what it exposes, max(0, host - device) per MoE layer
    forward with Megatron-Core's host time fitted (``time.moe_host_stall``), not this wait itself."""
    from luban.parallel.layout import ParallelLayout
    from luban.plan.grid import Grid
    from luban.plan.problem import Problem
    from luban.plan.system import load_system
    from luban.plan.time import expert_gemm_seconds, moe_permutation_bytes, peak_flops

    reps = 3 if setup.cpu else 20
    dtype = torch.bfloat16
    rows = setup.rows()
    for label, model, ep, tokens, precision in moe_shapes(setup):
        if skipped := setup.out_of_time():
            rows.append([label, "all pieces", skipped, "", ""])
            continue
        h, f, k, experts = model.hidden, model.expert_ffn_hidden, model.experts_per_token, model.experts
        local, per_expert = experts // ep, tokens * k * ep // experts
        problem = Problem(model, load_system(builtin_system(setup)), ep, tokens, ep, runtime="megatron-core")
        share = problem.derived["moe_share"]

        def plan(prec):
            g = Grid.from_layout(ParallelLayout(dp=ep, ep=ep, zero=1, precision=prec, micro_batch=1))
            return float(expert_gemm_seconds(problem, g, tokens, peak_flops(problem, g, gemm=True))) / share

        try:
            x = torch.randn(local * per_expert, h, device=setup.device, dtype=dtype)
            w1 = torch.randn(local, h, 2 * f, device=setup.device, dtype=dtype) / h ** 0.5
            w2 = torch.randn(local, f, h, device=setup.device, dtype=dtype) / f ** 0.5

            def loop():  # each expert's fc1 (gate and up) and fc2 GEMM; the activation is left out
                for i in range(local):
                    y = x[i * per_expert:(i + 1) * per_expert] @ w1[i]
                    y[:, :f] @ w2[i]
            measured = median_seconds(setup, loop, reps)
            planned_s = plan("bf16")
            rows.append([label, f"expert GEMMs bf16, {local} experts x {per_expert} rows (loop)", ms(measured),
                         ms(planned_s), f"{measured / planned_s:.2f}"])
            grouped = getattr(torch, "_grouped_mm", None)
            if grouped is None or setup.device.type != "cuda":
                rows.append([label, "expert GEMMs bf16 (torch._grouped_mm)", "n/a (needs CUDA and torch._grouped_mm)",
                             ms(planned_s), ""])
            else:
                offs = torch.arange(1, local + 1, device=setup.device, dtype=torch.int32) * per_expert
                # the weights column-major, as torchtitan passes them (``w.transpose(-2, -1)`` of [E, out, in])
                w1c, w2c = (w.transpose(-2, -1).contiguous().transpose(-2, -1) for w in (w1, w2))

                def grouped_fn():
                    y = grouped(x, w1c, offs=offs)
                    grouped(y[:, :f].contiguous(), w2c, offs=offs)
                try:
                    m = median_seconds(setup, grouped_fn, reps)
                    rows.append([label, "expert GEMMs bf16 (torch._grouped_mm)", ms(m), ms(planned_s),
                                 f"{m / planned_s:.2f}"])
                except Exception as err:  # noqa: BLE001 - this torch/GPU has no grouped GEMM
                    rows.append([label, "expert GEMMs bf16 (torch._grouped_mm)", "n/a: " + one_line(err),
                                 ms(planned_s), ""])
            if precision == "fp8":
                piece, planned_8 = "expert GEMMs fp8 (torch._scaled_mm loop)", plan("fp8")
                try:
                    m = fp8_expert_loop(setup, x, w1, w2, local, per_expert, f, reps)
                    rows.append([label, piece, ms(m), ms(planned_8), f"{m / planned_8:.2f}"])
                except Exception as err:  # noqa: BLE001 - no fp8 GEMMs here (a CPU, an older GPU)
                    rows.append([label, piece, "n/a: " + one_line(err), ms(planned_8), ""])
            src = torch.randn(tokens, h, device=setup.device, dtype=dtype)
            order = torch.randperm(tokens * k, device=setup.device) // k  # each token's k copies, in expert order

            def permute():
                copies = src.index_select(0, order)
                torch.zeros_like(src).index_add_(0, order, copies)
            s = problem.system
            hbm = s.hbm_bandwidth * s.efficiency["hbm_efficiency"]
            planned_p = moe_permutation_bytes(problem, 2.0) / share * tokens / hbm
            m = median_seconds(setup, permute, reps)
            rows.append([label, f"permute + unpermute ({tokens * k} copies of {h})", ms(m), ms(planned_p),
                         f"{m / planned_p:.2f}"])
        except Exception as err:  # noqa: BLE001 - a failing row is reported, the rest still run
            rows.append([label, "failed", one_line(err), "", ""])
        finally:
            free(setup)
    counts = torch.zeros(128, device=setup.device)

    def kernels(host_sync: bool):
        for _ in range(20):
            for _ in range(10):
                counts.add_(1)
            if host_sync:
                counts.tolist()
    with_sync, without = median_seconds(setup, lambda: kernels(True), reps), median_seconds(setup, lambda: kernels(False), reps)
    from luban.plan.runtimes import MegatronCore

    rows.append(["any", "host sync per layer (token counts to the host among small kernels)",
                 f"{(with_sync - without) / 20 * 1e6:.1f} us",
                 f"max(0, {MegatronCore.moe_layer_host_s * 1e3:g} ms - device) per layer (megatron-core host, fitted)", ""])
    return rows


def fp8_expert_loop(setup: Setup, x, w1, w2, local: int, per_expert: int, f: int, reps: int) -> float:
    """Seconds of the experts' GEMMs in fp8 (e4m3, per-tensor scales of 1, bf16 out) through
    ``torch._scaled_mm``, inputs cast once beforehand (the planner charges the casts apart:
    ``Runtime.fp8_cast_bytes``)."""
    if setup.device.type != "cuda":
        raise RuntimeError("fp8 GEMMs need CUDA")
    e4m3, one = torch.float8_e4m3fn, torch.ones((), device=setup.device)
    xq = x.to(e4m3)
    w1q = [w1[i].t().contiguous().to(e4m3).t() for i in range(local)]  # column-major, as _scaled_mm wants
    w2q = [w2[i].t().contiguous().to(e4m3).t() for i in range(local)]
    mid = torch.randn(per_expert, f, device=setup.device).to(e4m3)

    def loop():
        for i in range(local):
            torch._scaled_mm(xq[i * per_expert:(i + 1) * per_expert], w1q[i], one, one, out_dtype=torch.bfloat16)
            torch._scaled_mm(mid, w2q[i], one, one, out_dtype=torch.bfloat16)
    return median_seconds(setup, loop, reps)


def state_of(ckpt: Path) -> dict:
    """Every tensor of a checkpoint (DCP folder), by name."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict = {}
    _load_state_dict(state, storage_reader=FileSystemReader(str(ckpt)), planner=_EmptyStateDictLoadPlanner(),
                     no_dist=True)
    flat = {}

    def walk(prefix, value):
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(value, torch.Tensor):
            flat[prefix] = value
    walk("", state)
    return flat


# ---- formatting --------------------------------------------------------------------------------
def ms(s: float) -> str:
    return f"{s * 1e3:.4g} ms"


def pct(x: float) -> str:
    return f"{x * 100:.1f}%"


def gib(x: float) -> str:
    return "n/a" if x != x else f"{x:.2f} GiB"


def one_line(err: BaseException) -> str:
    return f"{type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else ''}".replace("|", "/")


def free(setup: Setup) -> None:
    import gc

    gc.collect()
    if setup.device.type == "cuda":
        torch.cuda.empty_cache()
    torch._dynamo.reset()


def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows])


def default_out() -> str:
    """Where the report goes: ``$OUT/gpu.md`` where ``OUT`` is set (the device machine brings back
    only what is written under ``$OUT``), else bench/results/gpu.md of this checkout."""
    out = os.environ.get("OUT")
    return str(Path(out) / "gpu.md") if out else str(ROOT / "bench" / "results" / "gpu.md")


def write_report(path: Path, lines: list[str]) -> None:
    """The whole report, replaced in one rename (a kill mid-write leaves the previous one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, path)


@contextlib.contextmanager
def watchdog(seconds: float):
    """Raise ``TimeUp`` in the main thread after ``seconds`` (0: never), where SIGALRM exists."""
    import signal

    if not seconds or not hasattr(signal, "SIGALRM"):
        yield
        return

    def alarm(signum, frame):
        raise TimeUp(f"stopped: time budget ({seconds:.0f} s)")
    previous, (pending, _) = signal.signal(signal.SIGALRM, alarm), signal.getitimer(signal.ITIMER_REAL)
    armed = time.monotonic()
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if pending:  # someone else's alarm (pytest-timeout's): put it back, what is left of it
            signal.setitimer(signal.ITIMER_REAL, max(0.001, pending - (time.monotonic() - armed)))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="smoke mode: tiny shapes on the CPU")
    parser.add_argument("--out", default=None, help="the report (default: $OUT/gpu.md where OUT is set, "
                        "else bench/results/gpu.md)")
    parser.add_argument("--sections", default="abcdef", help="which of (a)-(f) to run")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="seconds for the whole check: no row starts with less than "
                             f"{ROW_RESERVE_S:.0f} s left, one running {OVERRUN_S:.0f} s past it is stopped "
                             "(each at most budget/8; default 480 on a GPU, none with --cpu; 0: none)")
    args = parser.parse_args(argv)
    if not args.cpu and not torch.cuda.is_available():
        print("gpu_check: no CUDA device; run with --cpu for the smoke mode", file=sys.stderr)
        return 2
    budget = args.budget_s if args.budget_s is not None else (0.0 if args.cpu else 480.0)
    out_path = Path(args.out or default_out())
    setup = Setup(args.cpu, budget)
    start = setup.start
    out = [f"# GPU check ({'CPU smoke mode' if args.cpu else setup.device_name})", "",
           f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
           f"- device: {setup.device_name}" + (f", CUDA {torch.version.cuda}" if not args.cpu else ""),
           f"- torch {torch.__version__}, Python {platform.python_version()}",
           f"- command: `python {' '.join(shlex.quote(a) for a in [sys.argv[0], *(argv or sys.argv[1:])])}`",
           f"- shapes: batch {setup.batch} x seq {setup.seq}, bf16, median of {setup.steps} steps after "
           f"{setup.warmup} warm-up steps; MFU against {setup.peak / 1e12:.0f} TFLOP/s",
           f"- time budget: {f'{budget:.0f} s' if budget else 'none'}", ""]
    running: list = []  # the title and header of the section running (its rows: setup.current)

    def flush(note: str | None = None) -> None:
        lines = list(out)
        if running:
            title, header = running
            lines += [f"## {title}", "", table(header, list(setup.current or [])), "",
                      note or f"(section running: {setup.elapsed():.0f} s so far)", ""]
        write_report(out_path, lines + [f"Wall time so far: {setup.elapsed():.0f} s."])

    def on_row(row) -> None:
        try:  # the file first: a row printed is a row written
            flush()
        except OSError as err:  # the rows are on stdout too
            print(f"gpu_check: could not write {out_path}: {err}", file=sys.stderr, flush=True)
        print("gpu_check: | " + " | ".join(str(c) for c in row) + " |", flush=True)
    setup.on_row = on_row
    write_report(out_path, out + ["(no section finished yet)"])
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp, \
            watchdog(max(1.0, budget + overrun_s(budget) - setup.elapsed()) if budget else 0):
        root = Path(tmp)
        sections = [
            ("a", "(a) luban against its peers", ["model", "runner", "step", "tokens/s", "MFU", "peak memory"]),
            ("b", "(b) planner vs measured (luban runtime)", ["model", "measured step", "planned step (built-in profile)",
                                                              "error", "planned step (probed profile)", "error",
                                                              "measured peak", "planned peak"]),
            ("c", "(c) single-GPU options through luban train", ["option", "step", "tokens/s", "MFU", "peak memory",
                                                                 "first step"]),
            ("d", "(d) checkpoint stall", ["model", "save", "stall (median)", "step", "step after a save"]),
            ("e", "(e) deterministic resume", ["model", "comparison", "result", "tensors"]),
            ("f", "(f) MoE layer pieces vs the planner (one rank, forward)", ["shape", "piece", "measured",
                                                                              "planned", "measured / planned"])]
        plan_rows: list = []
        for key, title, header in sections:
            if key not in args.sections:
                continue
            running[:] = [title, header]
            setup.current = None
            try:
                if skipped := setup.out_of_time():
                    rows = [[f"section {skipped}"] + [""] * (len(header) - 1)]
                elif key == "a":
                    rows, plan_rows = peers(setup, root)
                elif key == "b":
                    rows = plan_table(setup, plan_rows)
                elif key == "c":
                    rows = options(setup, root)
                elif key == "d":
                    rows = checkpoint_stall(setup, root)
                elif key == "e":
                    rows = deterministic_resume(setup, root)
                else:
                    rows = moe_pieces(setup)
            except TimeUp as err:  # the row in progress is stopped; the rows before it stand
                rows = list(setup.current or []) + [[str(err)] + [""] * (len(header) - 1)]
                with contextlib.suppress(Exception):
                    free(setup)
            except Exception:  # noqa: BLE001 - the report says what broke
                rows = list(setup.current or []) + [
                    ["section failed: " + traceback.format_exc().splitlines()[-1].replace("|", "/")]
                    + [""] * (len(header) - 1)]
            running.clear()
            out += [f"## {title}", "", table(header, rows), ""]
            flush()
            print(f"gpu_check: {title} done ({time.perf_counter() - start:.0f} s)", flush=True)
    out.append(f"Total wall time: {time.perf_counter() - start:.0f} s.")
    write_report(out_path, out)
    print(f"gpu_check: wrote {out_path}")
    return 0

if __name__ == "__main__":
    sys.exit(main())
