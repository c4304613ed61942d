"""``luban plan estimate | search | validate | probe | study``: the planner's command line.

Layout flags are the keys of ``ParallelLayout`` with dashes (``--virtual-stages`` ↔
``virtual_stages``), so a plan pastes into a training config's ``[parallel]`` section.
"""

from __future__ import annotations

import argparse
import json
import sys
import tomllib
import time
from pathlib import Path

from luban import schema
from luban.plan import ATTENTION_KERNELS, DISPATCHERS
from luban.plan.probe_device import BASE
from luban.errors import LubanError, bad_value, for_terminal

DEGREE = schema.integer(1, 1 << 20)  # a parallel degree or a count of micro-batches / stages
COUNT = schema.integer(1, 1 << 24)  # GPUs, sequences per step, tokens per sequence
NAME = schema.text()
LAYOUT_FLAGS = {"dp": DEGREE, "dp_replicate": DEGREE, "zero": schema.integer(0, 3), "tp": DEGREE, "pp": DEGREE,
                "schedule": NAME, "virtual_stages": DEGREE, "cp": DEGREE, "micro_batch": DEGREE, "recompute": NAME,
                "offload": NAME, "precision": NAME, "ep": DEGREE}
GIB = 2**30
# the config keys a layout check names (``luban.parallel.layout``) and the flag that set each here
TYPED_FLAGS = {**{f"parallel.{key}": "--" + key.replace("_", "-") for key in (*LAYOUT_FLAGS, "sp")},
               "train.global_batch": "--global-batch"}


def typed_flags(command):
    """``command`` whose errors name the flag the user typed beside the config key the check names:
    ``--tp / parallel.tp = 3: ...`` for ``parallel.tp = 3: ...`` (keys no flag sets are left as they are)."""
    import functools

    @functools.wraps(command)
    def run(args) -> int:
        try:
            return command(args)
        except LubanError as err:
            key, sep, rest = str(err).partition(" = ")
            if type(err) is not LubanError or not sep or key not in TYPED_FLAGS:
                raise
            raise LubanError(f"{TYPED_FLAGS[key]} / {key} = {rest}") from None
    return run


def register(sub) -> None:
    plan = sub.add_parser("plan", help="estimate, search and validate parallel layouts analytically")
    cmds = plan.add_subparsers(dest="plan_command", required=True, metavar="ACTION")

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--model", required=True, help="preset name or ModelConfig TOML/JSON file")
    common.add_argument("--system", default="dgx-a100-80g", help="built-in profile name or profile file")
    common.add_argument("--system-set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a profile field for a what-if system, repeatable: e.g. hbm_gib=120, "
                             "nvlink_domain=16, offload_gib=1024, offload_gbps=100 (inf: unlimited), gpus_per_node=8, "
                             "peak_tflops.bf16=1979, efficiency.zero3_overlap=0.5, or any field in its own unit")
    common.add_argument("--gpus", type=COUNT, required=True)
    common.add_argument("--seq", type=COUNT, help="sequence length (default: the model's seq_len)")
    common.add_argument("--global-batch", type=COUNT, required=True, help="sequences per optimizer step")
    common.add_argument("--runtime", default=None,
                        help="whose layout rules, memory and overlap to model: megatron, megatron-core, fsdp2, luban, "
                             "megatron-deepspeed, composer-fsdp, pytorch or transformers (luban.plan.runtimes; default: luban, the runtime "
                             "'luban train' runs)")
    common.add_argument("--optimizer", default="adamw", help="adamw, sgd or sgd-momentum")
    common.add_argument("--expert-imbalance", type=schema.number(1, 1 << 20), default=1.0,
                        help="MoE: the busiest expert rank's tokens over the mean (1 = balanced routing)")
    common.add_argument("--attention-kernel", type=schema.choice(*ATTENTION_KERNELS), default="fa3",
                        help="fused attention generation: fa3 (Hopper's FA3 class: TE/cuDNN, FlashAttention-3; "
                             "as fa2 on GPUs without one) or fa2 (FlashAttention-2 class)")
    common.add_argument("--dispatcher", type=schema.choice(*DISPATCHERS), default="alltoall",
                        help="MoE token dispatch: alltoall (a copy per routed expert), deepep (a copy per "
                             "destination node, then NVLink, at DeepEP's measured link rates) or hybridep (the same "
                             "deduplication at the profile's collective efficiency)")
    common.add_argument("--ep-overlap", action="store_true",
                        help="MoE: the all-to-alls overlap another micro-batch's compute (Megatron-Core's 1F1B "
                             "A2A overlap; planned as an upper bound)")
    common.add_argument("--compile", choices=("auto", "on", "off", "blocks"), default="auto",
                        help="torch.compile in the planned runtime (luban.plan.runtimes): auto (the runtime's default; "
                             "luban: on), on (model, head and loss), blocks (each block; head and loss eager), off")
    common.add_argument("--pad-vocab", choices=("auto", "on", "off"), default="auto",
                        help="the LM head's GEMMs on a vocabulary padded to an aligned width: auto (the runtime's "
                             "default: megatron and luban pad), on, off (an odd vocabulary such as GPT-2's 50,257 "
                             "then runs one head GEMM on a generic kernel: the profile's efficiency.unaligned_gemm)")
    common.add_argument("--tp-overlap", choices=("auto", "on", "off"), default="auto",
                        help="tensor-parallel collectives pipelined with the adjacent GEMMs (needs --sp): auto "
                             "(the runtime's default: megatron-core's --tp-comm-overlap on, others off), on "
                             "(torchtitan: async TP), off")
    common.add_argument("--grad-reduce-in-fp32", choices=("auto", "on", "off"), default="auto",
                        help="megatron-core: main gradients kept and reduced in fp32 (auto: on, Megatron-LM's "
                             "default under bf16) or in the 16-bit compute dtype (off: the Megatron-Bridge "
                             "performance recipes' grad_reduce_in_fp32 = False)")
    common.add_argument("--json", action="store_true", help="one JSON object on stdout")

    est = cmds.add_parser("estimate", parents=[common], help="memory, time, MFU and cost of one layout")
    for key, typ in LAYOUT_FLAGS.items():
        est.add_argument("--" + key.replace("_", "-"), type=typ, default=None,
                         help=f"[parallel] {key}" + (" (default: bf16 where the system is faster in it, else fp32; a profile of one: that one)"
                                                     if key == "precision" else ""))
    est.add_argument("--sp", action="store_true", default=None, help="[parallel] sp (sequence parallel)")
    est.add_argument("--price-per-gpu-hour", type=schema.number(0, 1e9), default=0.0)
    est.add_argument("--train-tokens", type=schema.number(0, 1e18), default=0.0, help="tokens to train (for time, GPU-hours, cost)")
    est.add_argument("--explain", action="store_true", help="show where every byte and millisecond goes")
    est.set_defaults(func=typed_flags(cmd_estimate))

    srch = cmds.add_parser("search", parents=[common], help="every valid layout; the fastest that fit")
    srch.add_argument("--top", type=schema.integer(1, 10_000), default=5)
    srch.add_argument("--precision", type=NAME, default=None,
                      help="the precision every layout runs in (default: as estimate's: bf16 where the system is faster "
                           "in it, else fp32; a profile of one: that one)")
    srch.add_argument("--chart", type=schema.path("new-file"),
                      help="write a PNG of the best layouts' memory and time (the best 50 at most: luban.plan.chart)")
    srch.add_argument("--ep", type=DEGREE, action="append", default=None,
                      help="MoE: search only these expert-parallel sizes (repeatable; default: every size that "
                           "divides dp*cp and the experts)")
    srch.set_defaults(func=typed_flags(cmd_search))

    val = cmds.add_parser("validate", help="reproduce the published tables")
    val.add_argument("--system", default="dgx-a100-80g",
                     help="the A100 profile (built-in name or file) the A100 tables (Korthikanti 2022, Narayanan 2021) are "
                          "planned on; another GPU's profile is refused (the H100 tables and the sources use their own machines')")
    val.add_argument("--json", action="store_true")
    val.add_argument("--grid", choices=("full", "small", "fine", "none"), default="full",
                     help="leave-one-source-out refit grid (luban.plan.loso): full (default, 729 combinations), "
                          "small, fine (9,450 combinations, minutes: how much the headline depends on the grid), "
                          "or none to skip it (and the MoE refit of moe_host)")
    val.set_defaults(func=cmd_validate)

    study = cmds.add_parser("study", help="rerun a published planning study and compare (charts + table)")
    study.add_argument("name", help="the study: seed003 (the Calculon multi-trillion-parameter scaling study)")
    study.add_argument("--out", type=schema.path("new-dir"), default="seed003", help="folder for results.json, PNG charts and the table")
    study.set_defaults(func=cmd_study)

    probe = cmds.add_parser("probe", help="measure this machine and write a system profile")
    probe.add_argument("--out", type=schema.path("new-file"), help="profile file to write (.toml or .json); default: print it")
    probe.add_argument("--device", default="cpu", type=schema.custom(_probe_device, "cpu, cuda or cuda:N"), help="cpu (default: luban's CPU ranks) or cuda[:N]: an accelerator's "
                       "GEMM curve, attention, elementwise traffic, HBM and host link (luban.plan.probe_device)")
    probe.add_argument("--base", default=None, help="with --device cuda: the built-in profile of the same GPU "
                       f"whose datasheet figures are kept (default {BASE})")
    probe.set_defaults(func=cmd_probe)


def load_model(spec: str):
    """A preset name or a TOML/JSON file holding a ModelConfig (flat, or a run config's [model])."""
    from luban.config import SECTIONS, config_from_dict
    from luban.model.config import ModelConfig
    from luban.model.presets import PRESETS, get_preset
    from luban.plan.system import is_json, read_small_text

    path = Path(spec)
    if spec in PRESETS:
        return get_preset(spec)
    if not path.is_file():
        raise bad_value("--model", spec, f"a .toml/.json file or a preset: {', '.join(PRESETS)}")
    kind = "JSON" if is_json(path) else "TOML"
    try:
        text = read_small_text(path, "--model", spec)
        raw = json.loads(text) if kind == "JSON" else tomllib.loads(text)
    except (ValueError, tomllib.TOMLDecodeError, RecursionError) as err:
        raise LubanError(f"--model = {spec!r}: cannot parse: {err}".replace("\n", " ")) from None
    except OSError as err:
        raise bad_value("--model", spec, f"a readable {kind} file ({err.strerror})") from None
    if not isinstance(raw, dict) or not raw:
        what = type(raw).__name__ if not isinstance(raw, dict) else "an empty table"
        raise bad_value("--model", spec, f"a {kind} table of model keys (flat, or a run config's [model]), not {what}")
    try:
        if any(key in SECTIONS for key in raw):  # a run config: the model `luban train` builds of it, checked as
            return config_from_dict(raw).model  # train checks the file (sections, tables, keys)
        return ModelConfig.from_dict(raw)  # a flat table: the model's keys
    except LubanError as err:
        raise LubanError(f"{spec}: {err}") from None


def _problem(args):
    from luban.plan.problem import Problem
    from luban.plan.system import load_system

    model = load_model(args.model)
    seq = args.seq or model.seq_len
    if args.seq is not None and model.position == "learned" and args.seq > model.seq_len:
        raise bad_value("--seq", args.seq, f"from 1 to {model.seq_len}, the model's learned positions")
    system = load_system(args.system, args.system_set)
    runtime = args.runtime if args.runtime is not None else "luban"  # plan what `luban train` will run
    compiled = {"auto": None, "on": True, "off": False, "blocks": "blocks"}[getattr(args, "compile", "auto")]
    switch = {"auto": None, "on": True, "off": False}
    return Problem(model, system, args.gpus, seq, args.global_batch, runtime, args.optimizer, args.expert_imbalance,
                   args.attention_kernel, compiled, args.dispatcher, args.ep_overlap,
                   pads_vocab=switch[getattr(args, "pad_vocab", "auto")],
                   tp_overlap=switch[getattr(args, "tp_overlap", "auto")],
                   grad_reduce_fp32=switch[getattr(args, "grad_reduce_in_fp32", "auto")])


def _layout(args, gpus: int, rules=None):
    from luban.parallel import schedules
    from luban.parallel.layout import ParallelLayout

    raw = {k: getattr(args, k) for k in LAYOUT_FLAGS if getattr(args, k) is not None}
    if args.sp:
        raw["sp"] = True
    if "dp" not in raw:
        inner = raw.get("tp", 1) * raw.get("pp", 1) * raw.get("cp", 1)
        if gpus % inner:
            raise bad_value("--gpus", gpus, f"must be divisible by tp*pp*cp = {inner}")
        raw["dp"] = gpus // inner
    if raw.get("schedule") in schedules.BY_NAME and "virtual_stages" not in raw:
        raw["virtual_stages"] = schedules.get(raw["schedule"]).min_virtual
    return ParallelLayout.from_dict(raw, section="parallel", rules=rules)


def cmd_estimate(args) -> int:
    from luban.parallel.layout import check_layout
    from luban.plan.estimate import Estimate, evaluate
    from luban.plan.explain import describe, explain, nearest_feasible, why_not
    from luban.plan.grid import Grid

    if args.explain and args.json:
        raise bad_value("--explain", "with --json", "one or the other: --explain is the text report, --json the machine-readable one")

    problem = _problem(args)
    layout = _layout(args, problem.gpus, problem.runtime_model)
    if args.precision is None:  # as the search and choose_layout do: the system's faster of bf16 and fp32
        layout = layout.replace(precision=problem.system.faster_precision())
    check_layout(layout, problem.model, problem.global_batch, problem.gpus, problem.seq, rules=problem.runtime_model)
    if problem.tp_overlap and not layout.sp:  # asked for, on a layout where it cannot apply (the search keeps it per layout)
        raise bad_value("--tp-overlap", "on", "needs tensor + sequence parallel (--tp > 1 --sp); leave it at auto or off")
    g = Grid.from_layout(layout)
    est = Estimate.from_results(problem, g, evaluate(problem, g), train_tokens=args.train_tokens,
                                price_per_gpu_hour=args.price_per_gpu_hour)
    near = [] if est.fits else nearest_feasible(problem, layout, progress=ProgressLine(what="nearest layouts that fit: "))
    if args.json:
        out = est.to_dict()
        if not est.fits:
            out["why_not"] = why_not(est)
            out["nearest_feasible"] = None if near is None else [n.layout.to_dict() for n in near]
        print(json_text(out))
        return 0
    print(for_terminal(f"{problem.model.name} on {args.gpus}x {problem.system.name}, seq {problem.seq}, "  # names from files
                       f"global batch {problem.global_batch}: {describe(layout)}", sys.stdout))
    print(explain(est, problem) if args.explain else _summary(est))
    if est.train_tokens:
        print(f"training {est.train_tokens:.3g} tokens{'' if est.fits else ' (were it to fit)'}: "
              f"{est.train_time_s / 86400:,.2f} days, "
              f"{est.gpu_hours:,.0f} GPU-hours, cost {est.cost:,.0f} at {est.price_per_gpu_hour:g}/GPU-hour")
    if not est.fits:
        print("does not fit:")
        for line in why_not(est):
            print("  " + line)
        print("nearest layouts that fit:" + (" not searched (too many layouts on this many GPUs)" if near is None else
                                             "" if near else f" none on {args.gpus} GPUs (more GPUs, offload or a "
                                                             "smaller model: luban plan search)"))
        for n in near or []:
            print(f"  {describe(n.layout)}: {n.memory_bytes['total'] / GIB:.1f} GiB, {n.step_time_s:.3f} s/step, MFU {n.mfu:.1%}")
    print("\n" + est.toml_block())
    return 0


def _summary(est) -> str:
    from luban.plan.explain import capacity, over_peak

    mem = "  ".join(f"{k} {v / GIB:.2f}" for k, v in est.memory_bytes.items())
    times = "  ".join(f"{k} {v * 1e3:.1f}" for k, v in est.time_breakdown_s.items() if v)
    where = capacity(est.hbm_bytes, 0)
    verdict = (f"fits in {where}" if est.fits else f"DOES NOT FIT in {where}" if est.memory_bytes["total"] > est.hbm_bytes
               else f"fits in {where}, but the offloaded state DOES NOT FIT in host memory")  # (said "in 80 GiB")
    return (f"memory GiB/GPU: {mem}  -> {verdict}\n"
            f"step {est.step_time_s * 1e3:,.1f} ms: {times}\n"
            f"{est.tokens_per_s:,.0f} tokens/s  MFU {est.mfu:.1%}  HFU {est.hfu:.1%}  {est.tflops_per_gpu:.1f} TFLOP/s/GPU"
            + "".join(f"\n({note})" for note in [over_peak(est)] if note))


PROGRESS_AFTER_S = 5.0  # a search shorter than this prints nothing but its result


class ProgressLine:
    """``search``'s progress: a line on stderr every ``PROGRESS_AFTER_S`` seconds once a search has
    run that long (millions of GPUs make hundreds of millions of layouts: minutes), so a long
    search shows it is working and how far it has come; ``what`` names a search the user did not ask
    for by name (estimate's nearest layouts that fit)."""

    def __init__(self, clock=time.monotonic, out=None, what: str = ""):
        self.clock, self.out, self.what = clock, out, what
        self.start = self.last = clock()

    def __call__(self, done: int, total: int) -> None:
        now = self.clock()
        if now - self.last >= PROGRESS_AFTER_S:
            self.last = now
            elapsed = now - self.start
            left = elapsed * (total - done) / max(done, 1)
            print(f"{self.what}searched {done:,} of {total:,} layouts ({done / total:.0%}) in {elapsed:.0f} s; "
                  f"about {left:.0f} s left", file=self.out or sys.stderr, flush=True)


def cmd_search(args) -> int:
    from luban.parallel.layout import PRECISIONS
    from luban.plan.explain import describe

    if args.precision is not None and args.precision not in PRECISIONS:
        raise bad_value("--precision", args.precision, f"one of {', '.join(PRECISIONS)}")
    from luban.plan.search import search

    if args.chart:
        from luban.plan.chart import chart_format

        chart_format(args.chart)  # a bad suffix before the search, not after it
    problem = _problem(args)
    precision = args.precision or problem.system.faster_precision()  # as estimate and choose_layout
    for ep in args.ep or ():
        if ep < 1 or (problem.model.moe and problem.model.experts % ep) or (not problem.model.moe and ep > 1):
            raise bad_value("--ep", ep, f"a divisor of experts = {problem.model.experts}" if problem.model.moe
                            else "1 (the model has no experts)")
    result = search(problem, top=args.top, precision=precision, eps=args.ep, progress=ProgressLine())
    if args.chart and result.best:
        from luban.plan.chart import write_chart

        write_chart(result.best, args.chart, f"{problem.model.name} on {problem.gpus}x {problem.system.name}")
    elif args.chart:  # said under --json too (it printed nothing, and the file was simply not there)
        print(f"luban: warning: no layout fits: no chart written ({args.chart})", file=sys.stderr)
    if args.json:
        print(json_text({"evaluated": result.evaluated, "seconds": result.seconds, "layouts_per_s": result.rate,
                          "cpu_seconds": result.cpu_seconds, "layouts_per_cpu_s": result.cpu_rate,
                          "valid": result.valid, "rejected": result.rejected,
                          "best": [e.to_dict() for e in result.best]}))
        return 0
    print(f"{result.evaluated:,} layouts in {result.seconds:.2f} s ({result.rate:,.0f} layouts/s; "
          f"{result.cpu_rate:,.0f} per CPU-second); "
          f"{result.valid:,} valid and fit")
    print(f"{'#':>2} {'layout':58s} {'step s':>8s} {'tok/s':>10s} {'MFU':>6s} {'mem GiB':>8s}")
    for i, e in enumerate(result.best, 1):
        print(f"{i:>2} {describe(e.layout):58s} {e.step_time_s:8.3f} {e.tokens_per_s:10,.0f} {e.mfu:6.1%} "
              f"{e.memory_bytes['total'] / GIB:8.1f}")
        print("     " + _summary(e).replace("\n", "\n     "))
    print("rejected:")
    for reason, count in sorted(result.rejected.items(), key=lambda kv: -kv[1]):
        print(f"  {count:>10,}  {reason}")
    if result.best:
        print("\nbest:\n" + result.best[0].toml_block())
    else:
        print("no layout fits", file=sys.stderr)
    return 0


def cmd_validate(args) -> int:
    from luban.plan.validate import validate_all

    from luban.plan import loso

    tables = validate_all(args.system)
    by_source = None if args.grid == "none" else loso.fit(loso.GRIDS[args.grid])
    moe = None if args.grid == "none" else loso.fit_moe()
    if args.json:
        out = {name: {"summary": t["summary"], "rows": [{k: v for k, v in r.items() if k != "estimate"} for r in t["rows"]]}
               for name, t in tables.items()}
        if by_source:
            out["leave-one-source-out"] = by_source
            out["leave-one-source-out-moe"] = moe
        print(json_text(out))
        return 0
    if by_source:
        print(f"leave-one-source-out (dense, {len(by_source['sources'])} sources, {by_source['candidates']} knob "
              f"combinations): mean |error| {by_source['headline']:.2%} held out "
              f"(at the shipped knobs: {by_source['fitted_mean']:.2%})")
        def source_line(name, s, refit):
            print(f"  {name:34s} {s['rows']:3d} rows  held out {s['held_out']:7.2%} (max {s['max_held_out']:6.2%})"
                  f"  shipped {s['fitted']:7.2%}  refit without it: {refit}")

        for name, s in by_source["sources"].items():
            source_line(name, s, " ".join(f"{k} {v:g}" for k, v in s["knobs"].items()))
        print(f"leave-one-source-out (MoE, {len(moe['sources'])} sources, moe_host over {moe['grid']} values, shipped "
              f"{moe['shipped'] * 1e3:g} ms): mean |error| {moe['headline']:.2%} held out")
        for name, s in moe["sources"].items():
            source_line(name, s, f"moe_host {s['moe_host'] * 1e3:g} ms")
    for name, t in tables.items():
        s = t["summary"]
        print(f"{name}: {s['rows']} rows, mean |error| {s['mean_abs_error']:.2%}, max {s['max_abs_error']:.2%}")
        for r in t["rows"]:
            exact = "" if "exact" not in r else ("  exact" if r["exact"] else "  MISMATCH")
            print(f"  {r['row']:42s} ref {r['reference']:>10.4g} {r['unit']:8s} planned {r['predicted']:>10.4g}"
                  f"  {r['error']:+7.2%}{exact}")
    return 0


def cmd_study(args) -> int:
    from luban.plan.study import STUDIES

    if args.name not in STUDIES:
        raise bad_value("study", args.name, f"one of {', '.join(STUDIES)}")
    out = Path(args.out)
    from luban import owned

    owned.claim(out, "plan-study", "--out")  # before a run of minutes, not after (luban.owned: refused untouched)
    try:
        (out / ".luban-write-test").touch()
        (out / ".luban-write-test").unlink()
    except OSError as err:
        raise bad_value("--out", args.out, f"a folder that exists and is writable, or can be created ({err.strerror})") from None
    try:
        STUDIES[args.name](out, log=lambda line: print(line, file=sys.stderr))
    except OSError as err:
        raise LubanError(f"--out = {args.out!r}: writing the study's results failed: {err}") from None
    print(for_terminal(f"wrote {out / 'seed003.md'} and charts (a_model_size.png, b_strong_scaling.png, "
                       "c_blocks.png)", sys.stdout))
    return 0


def json_text(value) -> str:
    """Strict JSON (RFC 8259 has no NaN or Infinity): numpy numbers as Python's, a non-finite
    number (an unlimited tier: ``--system-set hbm_gib=inf``) as null."""
    import math

    import numpy as np

    def plain(v):
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        if isinstance(v, np.ndarray):
            return plain(v.tolist())
        if isinstance(v, np.generic):
            v = v.item()
        if isinstance(v, float) and not math.isfinite(v):
            return None
        return v
    return json.dumps(plain(value), allow_nan=False, default=float)


def _probe_device(value: str) -> str:
    """``cpu``, ``cuda`` or ``cuda:N`` (ASCII digits); whether this machine has it is checked by
    ``cmd_probe`` (torch is imported only then)."""
    kind, colon, index = value.partition(":")
    if value == "cpu" or (kind == "cuda" and (not colon or (index.isascii() and index.isdigit()))):
        return value
    raise ValueError(value)


def cmd_probe(args) -> int:
    from luban.plan.probe import probe_system, write_profile

    if args.out and Path(args.out).suffix.lower() not in (".toml", ".json"):  # before minutes of probing
        raise bad_value("--out", args.out, "a new .toml or .json file (the profile's format follows its suffix; "
                                           "--system reads it so)")
    if args.device == "cpu" and args.base is not None:  # it would be ignored: the CPU profile has no datasheet base
        raise bad_value("--base", args.base, "only with --device cuda[:N] (the CPU probe measures every figure)")
    if args.device != "cpu":
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = int(args.device.partition(":")[2] or 0)
        if index >= count:
            raise bad_value("--device", args.device, "cpu: this machine has no CUDA device" if not count else
                            f"cpu, or cuda[:N] with N < {count}: this machine has {count} CUDA device{'s' * (count > 1)}")
    if args.device == "cpu":
        profile = probe_system()
    else:
        from luban.plan.probe_device import probe_device

        profile = probe_device(args.device, args.base or BASE)
    if args.out:
        write_profile(profile, args.out)
        print(for_terminal(f"wrote {args.out}", sys.stdout))
    else:
        print(json.dumps(profile, indent=2))
    return 0
