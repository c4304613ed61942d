"""The training loop: data → engine.forward_backward → engine.step, with metrics,
validation, checkpoints and preemption. Layout-agnostic: everything parallel hides behind
``luban.parallel.engine.Engine``.

Exactness: the sample order is a function of (seed, global sample index) (``luban.data``),
the learning rate a function of the step, parameters are initialised from (seed, name),
and checkpoints restore model, optimizer, scaler, loader position and RNG; so N straight
steps and any sequence of suspend/resume that adds up to N give bitwise-equal weights.
"""

from __future__ import annotations

import itertools
import json
import os
import resource
import time
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from luban import procs
from luban.config import RunConfig
from luban.data.order import UNVERSIONED_ORDER
from luban.errors import EXIT_SUSPENDED, LubanError, bad_value, escaped
from luban.model import flops
from luban.model.config import ModelConfig
from luban.owned import STEP_DIR
from luban.parallel.engine import Engine, OptimizerConfig, build_engine, resolve_compile
from luban.parallel.launch import check_rank_env
from luban.parallel.layout import check_layout
from luban.parallel.recompute import recomputed_flops_mode
from luban.train import checkpoint, plan_check
from luban.train.metrics import MetricsLogger, StepWindow
from luban.train.peak import run_peak
from luban.train import preempt
from luban.train.rundir import check_run_dir, unlock_run_dir
from luban.train.resolve import dataset_path, pick_device
from luban.train.schedule import lr_at


# cuBLAS needs a fixed workspace to be deterministic (NVIDIA cuBLAS docs, "Results
# reproducibility"; PyTorch's randomness notes): set before the first cuBLAS call
CUBLAS_WORKSPACE = ":4096:8"
# this process's first steps, left out of plan_check's measured step time: compiling, the allocator's
# and the optimizer's first states (the trainer's own choice, ``step_times[3:]`` since plan_check began)
PLAN_WARMUP_STEPS = 3


def set_deterministic(on: bool, device: torch.device) -> None:
    """``[train] deterministic``: only deterministic kernels (an operation without one raises,
    naming itself), a fixed cuBLAS workspace and no cuDNN autotuning. SDPA follows the same
    switch: in strict mode its flash and memory-efficient backward run their deterministic
    paths and the cuDNN backend is excluded (PyTorch's randomness notes, "CUDA Scaled Dot
    Product Attention", pytorch/pytorch#182551). Off: PyTorch's defaults, which on a GPU let
    two identical runs differ in the last bits from the first step (issue #22)."""
    if not on:
        return
    if device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True
    torch.use_deterministic_algorithms(True)


def drain(device: torch.device) -> None:
    """Wait until the device has run everything queued (a GPU; a CPU's work is done already). The
    loop calls it only on the steps that read the device anyway (``Trainer._train``)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _mem_available() -> int | None:
    """Linux's MemAvailable in bytes (None where /proc/meminfo is absent)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


@dataclass
class TrainResult:
    step: int
    suspended: bool
    checkpoint: Path | None
    final_loss: float | None


class Trainer:
    def __init__(self, cfg: RunConfig, memory_checked: bool = False):
        self.cfg = cfg
        self.run_dir = Path(cfg.run.dir)
        self.ckpt_root = self.run_dir / "checkpoints"
        self.device = pick_device(cfg.run.device)
        world = check_rank_env()  # a stale WORLD_SIZE without the rest: one line, not torch's traceback
        check_layout(cfg.parallel, cfg.model, cfg.train.global_batch, world, cfg.seq_len)
        if "WORLD_SIZE" not in os.environ and not memory_checked:  # one process no launcher checked
            from luban.train.memcheck import check_fits

            check_fits(cfg, world, 1, self.device.type)  # before anything is allocated
        data_dir = dataset_path(cfg)
        self._check_vocab(data_dir)
        from luban.data.tokenizer import tokenizer_identity

        self.tokenizer = tokenizer_identity(data_dir)  # in every checkpoint: `luban sample --data` checks it
        from luban.data.manifest import load_manifest

        self.data_checksum = load_manifest(data_dir)["checksum"]  # in every checkpoint: a resume on other data is named
        t = cfg.train
        optim = OptimizerConfig(name=t.optimizer, weight_decay=t.weight_decay, betas=(t.beta1, t.beta2),
                                momentum=t.momentum)
        torch.manual_seed(t.seed)
        set_deterministic(t.deterministic, self.device)
        self.engine: Engine = build_engine(cfg.model, cfg.parallel, optim, t.global_batch, t.seed, self.device,
                                           compile=resolve_compile(t.compile, self.device), seq_len=cfg.seq_len)
        self.is_main = self.engine.rank == 0
        self.data_dir = data_dir
        from luban.data.loader import TokenLoader

        self.loader = TokenLoader(data_dir, split="train", seq_len=cfg.seq_len, global_batch=t.global_batch,
                                  seed=t.seed, dp_rank=self.engine.dp_rank, dp_size=self.engine.dp_size,
                                  prefetch=cfg.data.prefetch, seq_key=cfg.seq_len_key)
        if t.eval_every:  # a val split too small to evaluate is refused now, not at the first eval step
            try:
                TokenLoader(data_dir, split="val", seq_len=cfg.seq_len, global_batch=t.global_batch,
                            dp_rank=self.engine.dp_rank, dp_size=self.engine.dp_size, prefetch=0).close()
            except LubanError as err:
                raise bad_value("train.eval_every", t.eval_every, f"0 for this dataset, whose validation split "
                                f"cannot be read ({err})") from None
        self.step = 0
        self.saves: list[checkpoint.SaveRecord] = []
        self._last_save_time = time.monotonic()
        self.writer: checkpoint.AsyncCheckpointer | None = None
        self.async_ok = False
        self.model_flops = flops.flops_per_token(cfg.model, cfg.seq_len)
        self.hw_flops = flops.flops_per_token(
            cfg.model, cfg.seq_len, recompute=recomputed_flops_mode(cfg.parallel.recompute, cfg.parallel.cp))

    def _check_vocab(self, data_dir: Path) -> None:
        from luban.data.tokenizer import load_tokenizer

        vocab = load_tokenizer(data_dir).vocab_size
        if vocab > self.cfg.model.vocab:
            raise bad_value("model.vocab", self.cfg.model.vocab,
                            f"must be >= the dataset's tokenizer vocabulary {vocab} ({data_dir}); set "
                            f"model.vocab = {vocab}, or leave it unset to follow the dataset (a new run; a resumed "
                            "checkpoint's model keeps its vocabulary: train it on a dataset of its tokenizer)")

    # -- checkpoints ---------------------------------------------------------------------
    def meta(self) -> dict:
        return {"step": self.step, "loader": self.loader.state_dict(), "config": self.cfg.to_dict(),
                "world_size": self.engine.world_size, "layout": self.cfg.parallel.to_dict(),
                "dataset": str(self.data_dir.absolute()), "dataset_checksum": self.data_checksum, "tokenizer": self.tokenizer,
                "peak": getattr(self, "peak", None)}

    def save(self, blocking: bool = False) -> Path:
        """Collective. Asynchronous unless ``blocking`` (suspend, end of training) or async is off/unsafe;
        a blocking save first waits for the one in flight. A synchronous save's ``SaveRecord`` goes to
        ``self.saves``; an asynchronous one's comes back from the writer once its write ended."""
        t0 = time.perf_counter()
        self._last_save_time = time.monotonic()
        if self.writer is None and self.async_ok and not blocking:  # created at the first save: collective
            self.writer = checkpoint.AsyncCheckpointer(self.ckpt_root, self.cfg.train.keep_checkpoints)
            self.engine.before_update = self.writer.wait_staged  # the next optimizer step waits for the copy
        if self.writer is not None and not blocking:
            state, meta = self.engine.state_dict(), self.meta()
            before = time.perf_counter() - t0  # creating the writer, building the state dict: training waits too
            record = self.writer.save(self.step, state, meta)
            record.stall_s += before
            return checkpoint.step_dir(self.ckpt_root, self.step)
        if self.writer is not None:
            self.writer.wait()
        path = checkpoint.save(self.ckpt_root, self.step, self.engine.state_dict(), self.meta(),
                               self.cfg.train.keep_checkpoints)
        stall = time.perf_counter() - t0
        self.saves.append(checkpoint.SaveRecord(self.step, stall, stall))
        return path

    def async_unsafe(self) -> str | None:
        """Why a background save is unsafe here (then saves are synchronous), or None.

        The staged copy needs host memory for one more checkpoint next to the running process."""
        if not self.cfg.train.async_checkpoint:
            return "off"
        available = _mem_available()
        if available is not None and available < 2 * self.checkpoint_bytes():
            return (f"host memory available {available / 2**30:.1f} GiB < twice one checkpoint "
                    f"({self.checkpoint_bytes() / 2**30:.1f} GiB)")
        return None

    def _checkpoint_due(self) -> bool:
        """``checkpoint_every_minutes``: rank 0's clock decides, so every rank saves the same step
        (agreed on the host, ``preempt.any_rank``: no wait for the GPU)."""
        minutes = self.cfg.train.checkpoint_every_minutes
        if not minutes:
            return False
        return preempt.any_rank(self.is_main and time.monotonic() - self._last_save_time >= 60 * minutes)

    def log_saves(self, log: MetricsLogger) -> None:
        """metrics.jsonl ``{"step", "checkpoint": {step, stall_s, write_s, async}}`` for each save whose write ended."""
        for record in self.writer.drain() if self.writer is not None else []:
            log.event({"checkpoint": record.to_dict()})
        for record in self.saves:
            log.event({"checkpoint": record.to_dict()})
        self.saves.clear()

    def checkpoint_bytes(self) -> int:
        """About one checkpoint's size: the model's fp32 weights, times (1 + optimizer states). From the
        config, not ``engine.state_dict()``: building an optimizer state dict initialises its states."""
        weights = flops.param_count(self.cfg.model) * 4
        t = self.cfg.train
        states = 2 if t.optimizer == "adamw" else (1 if t.momentum else 0)
        return int(weights * (1 + states) * 1.05) + (1 << 20)  # + metadata, RNG, meta.json

    def resume(self, resume: str) -> Path | None:
        ckpt = checkpoint.resolve(resume, self.ckpt_root)
        held = checkpoint.step_dirs(self.ckpt_root) if ckpt is None else []
        if held:  # every one damaged: a fresh start would save over them (an imported run: random weights)
            raise checkpoint.everywhere(bad_value(
                "--resume", resume, f"none of run.dir's {len(held)} checkpoint(s) is valid (the newest {held[0].name}: "
                "each is named above); resume one by name once repaired, or choose a new run.dir"))
        if ckpt is None:
            return None
        # meta.json's structure (step, config, loader, ...) was checked by resolve (verify); here again,
        # with what training needs too (the loader position, [train]): one line naming the field
        named = resume if resume != "auto" else str(ckpt)  # the errors below name the checkpoint
        meta = checkpoint.read_meta(ckpt, "--resume", named, training=True)
        imported = checkpoint.imported(meta)  # weights alone: step 0, a new optimizer and data order
        try:  # before loading: DCP's own errors are tracebacks; alike on every rank (one meta.json): one line
            self._check_compatible(ckpt, meta["config"])
            if not imported:
                self._check_order(ckpt, meta["loader"])
        except LubanError as err:
            raise checkpoint.everywhere(err) from None
        state = self.engine.state_dict(optimizer=not imported)
        if (meta.get("layout") or {}).get("precision") != "fp16":  # its scaler was off (scale 1): an fp16 run
            state.pop("scaler", None)  # resumed from it starts at the initial loss scale, not at 1
        failed = None
        try:
            checkpoint.load(ckpt, state, "--resume", named, rng=not imported)
        except LubanError as err:  # a damaged file: every rank stops, with one line
            failed = err
        if self.engine.any_rank(failed is not None):
            raise failed or LubanError(f"--resume = {named!r}: the checkpoint could not be read on another rank")
        self.engine.load_state_dict(state)
        if imported:
            self.resume_notes = [f"the weights imported from {escaped(meta['source'])}, as step 0: a new optimizer, "
                                 "learning-rate schedule and data order"]
        else:
            self.step = meta["step"]
            self.resumed_peak = meta.get("peak")  # the run's MFU peak (run_peak), if its folder lost peak.json
            # a loader position saved before order versions is in the order it had then (UNVERSIONED_ORDER)
            self.loader.load_state_dict({"order_version": UNVERSIONED_ORDER, **meta["loader"]})
            self.resume_notes = [f"[train] {k} = {meta['config']['train'].get(k)!r} in the checkpoint, {v!r} now"
                                 for k, v in self.cfg.to_dict()["train"].items()
                                 if meta["config"].get("train", {}).get(k) != v]
            if meta.get("dataset_checksum") not in (None, self.data_checksum):  # another dataset of as many samples
                self.resume_notes.append(
                    f"the dataset is not the one the checkpoint was trained on ({escaped(str(meta.get('dataset')))}: "
                    f"another manifest checksum): the run goes on at sample {self.loader.consumed_samples} of "
                    f"{self.data_dir}'s order")
        if resume != "auto":
            self._branch_from(ckpt, meta["step"])
        return ckpt

    def _check_compatible(self, ckpt: Path, saved: dict) -> None:
        """The checkpoint's model shape and optimizer must be the config's: the first key that is not
        is named, with every model key that differs (a model from ``luban import`` has them all to set)."""
        now = self.cfg.to_dict()
        try:  # keys added since the checkpoint was written take their defaults (e.g. experts = 0)
            saved = {**saved, "model": ModelConfig(**saved.get("model", {})).to_dict()}
        except (TypeError, LubanError):
            pass  # unreadable: the comparison below names the first difference
        labels = {f.name for f in fields(ModelConfig) if not f.compare}  # the name: a label, not the shape
        differ = {key: saved["model"].get(key) for key, value in now["model"].items()
                  if key not in labels and saved["model"].get(key) != value}
        if differ:
            key = next(iter(differ))
            every = ", ".join(f"{k} = {json.dumps(v)}" for k, v in differ.items())
            raise bad_value(f"model.{key}", now["model"][key], f"{differ[key]!r}, as in the checkpoint --resume names "
                            f"({ckpt}), whose [model] differs in {len(differ)} key(s): {every}; resume with the "
                            "checkpoint's [model] (or start a new run.dir)")
        if "train" in saved and saved["train"].get("optimizer") != now["train"]["optimizer"]:
            raise bad_value("train.optimizer", now["train"]["optimizer"],
                            f"{saved['train'].get('optimizer')!r}, as in the checkpoint --resume names "
                            f"({ckpt}): its optimizer state cannot be loaded into another optimizer")

    def _check_order(self, ckpt: Path, saved: dict) -> None:
        """The settings the run's sample order follows (``TokenLoader.load_state_dict`` refuses another),
        named as the config names them: it said ``loader state_dict['seed'] = 0: must equal this
        loader's 5``, no setting a user has."""
        for key, setting, now in (("seed", "train.seed", self.cfg.train.seed),
                                  ("seq_len", self.cfg.seq_len_key, self.cfg.seq_len)):
            if key in saved and saved[key] != now:
                raise bad_value(setting, now, f"{saved[key]!r}, as in the checkpoint --resume names ({ckpt}): the "
                                f"run's sample order follows it; resume with {setting} = {saved[key]!r} (or start "
                                "a new run.dir)")

    def _branch_from(self, ckpt: Path, step: int) -> None:
        """Resuming from an explicit older checkpoint of this run starts a branch: the newer ones are
        moved aside (kept, named) so retention cannot delete the branch point and --resume auto
        follows the branch. A checkpoint elsewhere under ``checkpoints/`` (an ``aside-*`` folder, a
        copy under a name of the user's) branches the same way: the checkpoints of ``checkpoints/``
        from its ``step`` (meta.json's; the folder's name may be any) on are another branch's, which
        this run's saves would replace (the same step numbers) and retention prune."""
        newer = [p for p in checkpoint.step_dirs(self.ckpt_root) if p.resolve() != ckpt.resolve()
                 and int(STEP_DIR.match(p.name).group(1)) >= step] \
            if ckpt.resolve().is_relative_to(self.ckpt_root.resolve()) else []
        aside = self.ckpt_root / f"aside-{time.strftime('%Y%m%d-%H%M%S')}-after-{ckpt.name}"
        if newer and self.is_main:
            for k in itertools.count(2):  # a branch from the same checkpoint in the same second: a name of its own
                try:
                    aside.mkdir()
                    break
                except FileExistsError:
                    aside = aside.with_name(f"{aside.name.split('~')[0]}~{k}")
            for path in newer:
                path.rename(aside / path.name)
        if newer:
            self.resume_notes.append(f"branching from {ckpt.name}: {len(newer)} newer checkpoint(s) kept in {aside}")
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.barrier()

    # -- the loop ------------------------------------------------------------------------
    def validate(self) -> float:
        from luban.data.loader import val_batches

        losses = [self.engine.eval_loss(x, y) for x, y in
                  val_batches(self.data_dir, self.cfg.seq_len, self.cfg.train.global_batch,
                              self.cfg.data.eval_batches, self.engine.dp_rank, self.engine.dp_size,
                              order_version=self.loader.order_version)]  # the run's order (a resumed one's too)
        return sum(losses) / max(1, len(losses))

    def train(self, resume: str | None = None) -> TrainResult:
        try:
            return self._train(resume)
        finally:
            unlock_run_dir(self.run_dir)  # where this process locked it (check_run_dir)

    def _train(self, resume: str | None) -> TrainResult:
        cfg, t = self.cfg, self.cfg.train
        suspend = preempt.install()
        if self.is_main:  # before anything is written there (luban.owned: a foreign folder is refused untouched)
            check_run_dir(self.run_dir, self.checkpoint_bytes(), resume=resume,
                          lock=not os.environ.get(procs.PARENT_VAR))  # luban's launcher holds it for its ranks
        log = MetricsLogger(self.run_dir, t.steps, cfg.run.tensorboard, cfg.run.progress, enabled=self.is_main,
                            on_closed=lambda: suspend.request("a closed output pipe"))
        unsafe = self.async_unsafe()
        self.async_ok = unsafe is None
        if unsafe not in (None, "off"):
            log.message(f"asynchronous checkpoints off: {unsafe}; saving synchronously")
        if resume:
            ckpt = self.resume(resume)
            log.message(f"resumed from {ckpt} at step {self.step}" if ckpt else "no checkpoint found: starting fresh")
            for note in getattr(self, "resume_notes", []) if ckpt else []:
                log.message(note)
        finished = self.step >= t.steps  # resumed at or past the end: nothing to train, the run's config kept
        if finished:
            log.message(f"step {self.step} is at or past train.steps = {t.steps}: nothing to train "
                        "(raise train.steps to train on)")
        if self.is_main and not finished:
            (self.run_dir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=1))
            self._report_to_cluster(log)
        tokens_per_step = t.global_batch * cfg.seq_len
        self.peak = run_peak(self.run_dir, self.device.type, cfg.parallel.precision,
                             getattr(self, "resumed_peak", None), write=self.is_main)
        peak = self.peak["flops"] * self.engine.world_size
        implausible = False  # MFU/HFU above 100%: reported as not measured, with one warning
        loss, saved, step_times, memory = None, None, [], {}
        window = StepWindow(self.device)  # the timing figures since the last logged step
        # --parallel auto: its plan's step time is compared with the steps after the warm-up, whose end is
        # drained once for that (a log window may hold warm-up and later steps: its mean mixes them)
        timed, run_steps = plan_check.planned(self.run_dir), 0
        try:
            signalled = suspend.agreed()
            suspend.start_up_over()
            if signalled:  # signalled during start-up: nothing new to save
                log.message(f"suspended on {suspend.reason or 'a peer rank signal'} before the first step "
                            f"(step {self.step}); exit {EXIT_SUSPENDED} (resume with --resume auto)")
                return TrainResult(self.step, True, None, None)
            while self.step < t.steps:
                # loss and grad norm stay on the device: read (and the device drained) only on the steps
                # that log; the rest queue their kernels behind the previous step's (StepWindow)
                t0 = time.perf_counter()
                tokens, labels = next(self.loader)
                t1 = time.perf_counter()
                marks = [window.mark()]
                loss = self.engine.forward_backward(tokens, labels, host=False)
                t2 = time.perf_counter()
                marks.append(window.mark())
                lr = lr_at(self.step, t.lr, t.min_lr, t.warmup_steps, t.steps)
                grad_norm = self.engine.step(lr, t.grad_clip, host=False)
                marks.append(window.mark())
                self.step += 1
                run_steps += 1
                evaluating = bool(t.eval_every) and self.step % t.eval_every == 0
                logging = self.step % t.log_every == 0 or self.step == t.steps or evaluating
                timing_compile = self.engine.compiled and run_steps == 1  # the first step
                # a periodic save reads the device (its state dict); drained first, the steps queued since the
                # last drain end inside the window, not in the save's time (a GPU's mean read low before)
                periodic = bool(t.checkpoint_every and self.step % t.checkpoint_every == 0) or self._checkpoint_due()
                drained = logging or periodic or timing_compile or (timed and run_steps == PLAN_WARMUP_STEPS)
                if drained:
                    drain(self.device)
                t3 = time.perf_counter()
                window.add(t0, t1, t2, t3, tuple(marks))
                if drained:
                    span = window.span()
                    if run_steps > PLAN_WARMUP_STEPS:
                        step_times += span
                if timing_compile:
                    log.message(f"first step {t3 - t0:.1f} s, compiling included (train.compile = {t.compile!r})")
                if logging:
                    times = window.means()
                    # after the step: a fresh optimizer makes its state there (step 1 read 0 optimizer bytes before)
                    memory = self.engine.memory_report()
                    time_s = times["time_step_s"]
                    record = {"step": self.step, "tokens": self.step * tokens_per_step, "loss": float(loss), "lr": lr,
                              "grad_norm": float(grad_norm), "tokens_per_s": tokens_per_step / time_s,
                              "tflops": tokens_per_step * self.model_flops / time_s / 1e12,
                              "mfu": tokens_per_step * self.model_flops / time_s / peak,
                              "hfu": tokens_per_step * self.hw_flops / time_s / peak,
                              **times, "peak_memory_bytes": peak_memory_bytes(self.device), **memory,
                              **self.engine.moe_metrics()}
                    if record["hfu"] > 1 or record["mfu"] > 1:
                        if not implausible:
                            log.message(f"MFU {100 * record['mfu']:.0f}% / HFU {100 * record['hfu']:.0f}% is above "
                                        f"100%: the peak {self.peak['flops'] / 1e12:.3g} TFLOP/s per rank "
                                        f"({self.peak['source']}, {self.run_dir / 'peak.json'}) is below what this "
                                        "machine does; mfu and hfu are reported as not measured (null); set "
                                        "LUBAN_PEAK_FLOPS to this machine's peak")
                        implausible = True
                        record["mfu"] = record["hfu"] = None
                    if evaluating:
                        record["val_loss"] = self.validate()
                    log.log(record)
                stop = suspend.agreed()
                final = stop or self.step == t.steps
                if final or periodic:
                    saved = self.save(blocking=final)
                self.log_saves(log)
                if stop and self.step < t.steps:
                    log.message(f"suspended on {suspend.reason or 'a peer rank signal'} at step {self.step}; "
                                f"checkpoint {saved}; exit {EXIT_SUSPENDED} (resume with --resume auto)")
                    return TrainResult(self.step, True, saved, float(loss))
            self._report_plan(memory, step_times, log)
        finally:
            if self.writer is not None:
                self.writer.close()
            self.loader.close()
            log.close()
        return TrainResult(self.step, False, saved, None if loss is None else float(loss))

    def _report_to_cluster(self, log: MetricsLogger) -> None:
        """Inside a luban job: tell the scheduler where metrics.jsonl is (its dashboard's job page)."""
        if not (os.environ.get("LUBAN_JOB_ID") and os.environ.get("LUBAN_CLUSTER_TOKEN")):
            return
        from luban.cluster.sdk import report_run_dir

        try:
            report_run_dir(str(self.run_dir.resolve()))
        except Exception as err:  # noqa: BLE001 - the dashboard is a convenience, training goes on
            log.message(f"could not tell the cluster where this run writes ({err}); its job page shows no curves")

    def _report_plan(self, memory: dict, step_times: list[float], log: MetricsLogger) -> None:
        """Predicted vs measured, when ``--parallel auto`` planned this run (``plan_check``)."""
        import torch.distributed as dist

        memory_by_rank = [memory]
        if dist.is_available() and dist.is_initialized():
            memory_by_rank = [None] * dist.get_world_size()
            dist.all_gather_object(memory_by_rank, memory)
        if self.is_main:
            rows = plan_check.compare(self.run_dir, memory_by_rank, step_times)
            for key, row in (rows or {}).items():
                log.message(f"plan vs measured: {key:16s} predicted {row['predicted']:.4g}  "
                            f"measured {row['measured']:.4g}  error {100 * (row['error'] or 0):+.1f}%")
