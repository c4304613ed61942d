"""Per-step metrics: ``<run>/metrics.jsonl``, TensorBoard, and a terminal progress line.

Each line of metrics.jsonl is one JSON object, one per logged step (every ``log_every``-th, the
last, and each eval step). Fields (docs/training.md):
  step, tokens (cumulative), loss, lr, grad_norm (of the logged step itself), tokens_per_s,
  tflops (achieved model TFLOP/s over all ranks), mfu, hfu, time_data_s, time_fwd_bwd_s,
  time_optimizer_s, time_step_s (these six: means over the steps since the previous logged
  one, ``StepWindow``; with log_every = 1 the step's own), peak_memory_bytes, param_bytes,
  grad_bytes, optimizer_bytes, activation_bytes (this rank, from tensor storages),
  host_optimizer_bytes (optimizer offload only), val_loss (on eval steps only).
MFU = tokens/s · model FLOPs per token / (world size · peak FLOP/s); HFU uses hardware
FLOPs (recompute included); both null where above 100% (the run's peak is too low:
``luban.train.peak.run_peak``). FLOPs per token come from ``luban.model.flops``.
"""

from __future__ import annotations

import json
import os
import sys
import time

from luban import interrupt
from pathlib import Path


class StepWindow:
    """The timing figures of one metrics.jsonl record: means over the steps since the last logged
    one. The trainer reads the device only on the steps it logs (a GPU -> host read stalls the
    host until the device drains, so the next step's kernels are not queued while it runs), so
    one step's own time on a GPU is unknown: the host has moved on while its kernels run. A
    window's is known: its last step waits for the device (``add`` after the drain), so the host
    times summed over the window cover its device work. ``time_data_s`` and ``time_step_s`` are
    host wall-clock times; on a GPU ``time_fwd_bwd_s`` and ``time_optimizer_s`` are device times
    between CUDA events recorded at the step's marks (``mark``), read once the window drained; on
    a CPU, where the work is done when the call returns, host times like the others."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.span_s, self.span_steps = 0.0, 0  # ``span``: the steps since the device was last drained
        self.reset()

    def reset(self) -> None:
        self.steps = 0
        self.data_s = self.fwd_bwd_s = self.optimizer_s = self.step_s = 0.0
        self.marks: list = []

    def mark(self):
        """A point of the step in the device's stream: a CUDA event (None on a CPU)."""
        if not self.cuda:
            return None
        import torch

        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def add(self, t0: float, t1: float, t2: float, t3: float, marks: tuple = (None, None, None)) -> None:
        """One step: host times at its start, after the batch, after forward+backward, at its end;
        ``marks``: ``mark()`` after the batch, after forward+backward, after the optimizer step."""
        self.steps += 1
        self.data_s += t1 - t0
        self.fwd_bwd_s += t2 - t1
        self.optimizer_s += t3 - t2
        self.step_s += t3 - t0
        self.span_s += t3 - t0
        self.span_steps += 1
        if self.cuda:
            self.marks.append(marks)

    def span(self) -> list[float]:
        """Once the device drained (at a logged step, or elsewhere: the end of the warm-up that
        ``plan_check`` leaves out): the mean seconds per step since the last call, once per step."""
        times = [self.span_s / self.span_steps] * self.span_steps if self.span_steps else []
        self.span_s, self.span_steps = 0.0, 0
        return times

    def means(self) -> dict:
        """The window's mean seconds per step (once the device drained); a new window begins."""
        n, fwd_bwd, optimizer = self.steps, self.fwd_bwd_s, self.optimizer_s
        if self.cuda:  # elapsed_time: milliseconds between two completed events
            fwd_bwd = sum(a.elapsed_time(b) for a, b, _ in self.marks) / 1e3
            optimizer = sum(b.elapsed_time(c) for _, b, c in self.marks) / 1e3
        means = {"time_data_s": self.data_s / n, "time_fwd_bwd_s": fwd_bwd / n, "time_optimizer_s": optimizer / n,
                 "time_step_s": self.step_s / n}
        self.reset()
        return means


class MetricsLogger:
    def __init__(self, run_dir: Path, total_steps: int, tensorboard: bool, progress: str, enabled: bool = True,
                 on_closed=None):
        """``on_closed()``: called once when stdout or stderr turns out to be a closed pipe (the
        trainer then saves and suspends at the end of the step, as on SIGTERM)."""
        self.enabled = enabled
        self.on_closed = on_closed
        self.closed: set = set()  # the streams whose reader is gone (now /dev/null)
        self.total = total_steps
        self.start = time.perf_counter()
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        # never through a symbolic link (luban.owned refuses a run folder holding one; O_NOFOLLOW
        # keeps a link made since from being written through)
        fd = os.open(run_dir / "metrics.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        self.file = os.fdopen(fd, "a", buffering=1)
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(run_dir / "tensorboard"))
        if progress == "auto":
            progress = "bar" if sys.stderr.isatty() else "plain"
        self.progress = progress

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps(record) + "\n")
        if self.tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self.tb.add_scalar(f"train/{key}", value, record["step"])
        self._show(record)

    def event(self, record: dict) -> None:
        """A metrics.jsonl line that is not a training step (e.g. a checkpoint's stall); not shown."""
        if self.enabled:
            self.file.write(json.dumps(record) + "\n")

    def _show(self, r: dict) -> None:
        if self.progress == "none":
            return
        parts = [f"step {r['step']}/{self.total}"]
        if "loss" in r:
            parts += [f"loss {r['loss']:.4f}", f"lr {r['lr']:.2e}", f"{r['tokens_per_s']:.0f} tok/s",
                      "mfu n/a" if r["mfu"] is None else f"mfu {100 * r['mfu']:.1f}%"]
        if "val_loss" in r:
            parts.append(f"val {r['val_loss']:.4f}")
        line = "  ".join(parts)
        if self.progress == "bar":
            done = int(30 * r["step"] / max(1, self.total))
            end = "\n" if r["step"] >= self.total or "val_loss" in r else ""
            self._write(sys.stderr, f"\r[{'#' * done}{'.' * (30 - done)}] {line}\033[K{end}")
        else:
            self._write(sys.stdout, line + "\n")

    def message(self, text: str) -> None:
        """A line for the user: on stdout, or on stderr once stdout's reader is gone."""
        if self.enabled:
            if self.progress == "bar":
                self._write(sys.stderr, "\n")
            self._write(sys.stderr if sys.stdout in self.closed else sys.stdout, text + "\n")

    def _write(self, stream, text: str) -> None:
        """``luban train | head``: the reader of a pipe went away. The output stops, not the run:
        the stream goes to /dev/null and ``on_closed`` has the trainer save and exit 75 at the end
        of the step (a closed pipe ended the run at once, losing every step since the last save)."""
        if stream in self.closed:
            return
        try:
            stream.write(text)
            stream.flush()
        except BrokenPipeError:
            self.closed.add(stream)
            interrupt.quiet(stream)
            if self.on_closed is not None:
                self.on_closed()

    def close(self) -> None:
        if self.enabled:
            self.file.close()
            if self.tb is not None:
                self.tb.close()
