"""``luban train | demo | sample | export | import``."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from luban import schema
from luban.errors import EXIT_SUSPENDED, CheckpointWriteError, LubanError, bad_value, for_terminal
from luban.model.config import MAX_SIZE

DEMO_CONFIG = Path(__file__).with_name("demo.toml")
# rendezvous flags: the same ranges check the flags and the values a luban job supplies (resolve_rendezvous)
RENDEZVOUS = {"nproc": schema.integer(1, 1024), "nnodes": schema.integer(*schema.CLUSTER_NODES),
              "node_rank": schema.integer(0, schema.CLUSTER_NODES[1] - 1), "master_port": schema.integer(*schema.PORT)}
MAX_NEW_TOKENS = 1 << 16  # per sample; the context slides past the model's positions, so this bounds time only


def register(sub) -> None:
    p = sub.add_parser("train", help="train a model from a TOML config",
                       description="Train a model. Exit code 75 means suspended: resume with --resume auto.")
    _train_args(p)
    p.add_argument("config", nargs="?", type=schema.path("file"), metavar="CONFIG",
                   help="TOML config ([model] [data] [train] [parallel] [run]); omitted: the defaults (docs/training.md)")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("demo", help="train the demo model on the embedded corpus, then print samples",
                       description="luban train on the packaged demo config with 4 ranks (CPU), or one per GPU "
                                   "up to 4: the first half of the steps on the planner's layout (--parallel "
                                   "auto), the second half resumed on pp=2 x dp=N/2 (ZeRO-1), then three samples.")
    _train_args(p)
    p.set_defaults(func=cmd_demo, config=str(DEMO_CONFIG), parallel="auto")

    p = sub.add_parser("sample", help="generate text from a checkpoint or run directory")
    p.add_argument("checkpoint", type=schema.path("dir"), metavar="CHECKPOINT",
                   help="checkpoint directory, or a run directory (newest valid checkpoint)")
    p.add_argument("--prompt", default="def ", type=schema.text(allowed="UTF-8 text", empty=True),
                   help="text to continue (default: %(default)r; empty: start a new document)")
    p.add_argument("--tokens", type=schema.integer(1, MAX_NEW_TOKENS), default=200, help="new tokens per sample")
    p.add_argument("--samples", type=schema.integer(1, 1000), default=1)
    p.add_argument("--temperature", type=schema.number(1e-3, 100, also=(0,)), default=0.8,
                   help="0: greedy (always the likeliest token)")
    p.add_argument("--top-k", type=schema.integer(0, MAX_SIZE["vocab"]), default=40,
                   help="sample among the k likeliest tokens; 0 or >= the vocabulary: among all")
    p.add_argument("--seed", type=schema.integer(*schema.SEED), default=0)
    p.add_argument("--data", type=schema.path("dir"),
                   help="dataset whose tokenizer to use (default: the one the run trained on)")
    p.set_defaults(func=cmd_sample)

    p = sub.add_parser("export", help="write a checkpoint as a Hugging Face folder")
    p.add_argument("checkpoint", type=schema.path("dir"), metavar="CHECKPOINT")
    p.add_argument("--format", choices=["hf"], default="hf")
    p.add_argument("out", type=schema.path("new-dir"), metavar="OUT", help="output folder (config.json, model.safetensors, the tokenizer files)")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("import", help="read a Hugging Face GPT-2/Llama/Mixtral/Qwen3-MoE folder into a luban checkpoint")
    p.add_argument("folder", type=schema.path("dir"), metavar="FOLDER", help="folder transformers saved: config.json and model.safetensors (or its shards, or pytorch_model.bin)")
    p.add_argument("out", type=schema.path("new-dir"), metavar="OUT", help="run directory to create (checkpoint at OUT/checkpoints/step_0000000)")
    p.set_defaults(func=cmd_import)


def _train_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a config value (TOML literal), repeatable")
    p.add_argument("--resume", metavar="auto|DIR", type=schema.text(allowed="auto or a checkpoint directory"),
                   help="resume from the newest valid checkpoint or a directory")
    p.add_argument("--parallel", choices=["config", "auto"], default="config",
                   help="auto: let the planner choose the [parallel] layout for the world size")
    p.add_argument("--nproc", type=RENDEZVOUS["nproc"], default=None,
                   help="ranks to start on this node (default 1; inside a luban job: one per GPU of the node)")
    p.add_argument("--nnodes", type=RENDEZVOUS["nnodes"], default=None, help="default 1, or the job's node count inside a luban job")
    p.add_argument("--node-rank", type=RENDEZVOUS["node_rank"], default=None)
    p.add_argument("--master-addr", type=schema.text(), default=None)
    p.add_argument("--master-port", type=RENDEZVOUS["master_port"], default=None)


def resolve_rendezvous(args) -> None:
    """Fill the unset rendezvous flags: from the luban job this runs in (``luban.jobenv``), else
    single-node defaults (Slurm's own variables are read later by ``parallel.launch``)."""
    from luban import jobenv

    job = None if "WORLD_SIZE" in os.environ else jobenv.rendezvous()
    defaults = ({"nproc": job.ranks_per_node, "nnodes": job.nnodes, "node_rank": job.node_rank,
                 "master_addr": job.master_addr, "master_port": job.master_port} if job else
                {"nproc": 1, "nnodes": 1, "node_rank": 0, "master_addr": "127.0.0.1", "master_port": 0})
    for key, value in defaults.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)


DEMO_RANKS = 4  # the demo's ranks on a CPU; on GPUs one per GPU up to this


def local_gpus(device: str) -> int:
    """GPUs the ranks of this node would use (``run.device``): 0 for CPU ranks."""
    if device == "cpu":
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def fit_ranks(nproc: int | None, gpus: int, demo: bool = False) -> int:
    """Ranks to start on this node: one per GPU at most (each rank owns ``cuda:LOCAL_RANK``).
    The demo, unless told, takes ``DEMO_RANKS`` on a CPU and one per GPU up to that (an even
    count, so that it can move to pp = 2); anything else asking for more ranks than GPUs is
    refused, naming the count and the way to CPU ranks."""
    if nproc is None:
        if not demo:
            return 1
        nproc = DEMO_RANKS if gpus == 0 else min(DEMO_RANKS, gpus)
        return nproc - nproc % 2 if nproc > 1 else nproc
    if gpus and nproc > gpus:
        raise bad_value("--nproc", nproc, f"at most {gpus}: this node has {gpus} GPU(s), one rank each; "
                        "set run.device = \"cpu\" for CPU ranks")
    return nproc


def _run_training(args) -> int:
    from luban.config import check_resume, load_config

    cfg = load_config(args.config, args.set)
    check_resume(args.resume)
    from luban.train.resolve import checkpoint_model, fit_vocab

    cfg, adopted = checkpoint_model(cfg, args.resume)  # every rank does the same: the same checkpoint
    cfg, note = fit_vocab(cfg)  # and the same dataset
    for line in (adopted, note) if "WORLD_SIZE" not in os.environ else ():
        if line:
            print(line, flush=True)
    resolve_rendezvous(args)
    if "WORLD_SIZE" not in os.environ:  # the launching process: its ranks' devices are on this node
        args.nproc = fit_ranks(args.nproc, local_gpus(cfg.run.device))
    for key, parse in RENDEZVOUS.items():
        schema.check("--" + key.replace("_", "-"), getattr(args, key), parse)
    schema.check("--node-rank", args.node_rank, schema.integer(0, args.nnodes - 1))
    world = args.nproc * args.nnodes
    sets = list(args.set)
    if "WORLD_SIZE" not in os.environ:  # the launching process (not a rank it started)
        from luban.parallel.layout import check_layout
        from luban.train import plan_check
        from luban.train.memcheck import check_fits
        from luban.train.resolve import pick_device
        from luban.train.rundir import check_run_dir, refuse_run_dir

        # every refusal before run.dir is made: a refused run leaves no folder behind
        refuse_run_dir(cfg.run.dir, args.resume)
        if cfg.run.system and args.parallel != "auto":  # read by --parallel auto only; a typo is named anyway
            from luban.plan.system import load_system

            load_system(cfg.run.system, key="run.system")
        if world > 1:  # (a multi-node launch without --master-port was refused after the planner ran)
            from luban.parallel.launch import check_rendezvous

            check_rendezvous(args.nnodes, args.node_rank, args.master_addr, args.master_port)
        if args.parallel == "auto":
            cfg, prediction = plan_check.plan(cfg, world)
        check_layout(cfg.parallel, cfg.model, cfg.train.global_batch, world, cfg.seq_len)
        check_fits(cfg, world, args.nproc, pick_device(cfg.run.device).type)  # before any rank allocates
        check_run_dir(cfg.run.dir, resume=args.resume, lock=args.node_rank == 0)  # held while its ranks run
        Path(cfg.run.dir, "plan.json").unlink(missing_ok=True)
        if args.parallel == "auto":
            plan_check.write_plan(Path(cfg.run.dir), prediction)
            print(plan_check.describe(prediction), flush=True)
            sets += plan_check.layout_overrides(prediction["layout"])
    if "WORLD_SIZE" not in os.environ and world > 1:
        from luban.parallel.launch import launch

        argv = ["train", args.config, *sum((["--set", s] for s in sets), [])]
        if args.resume:
            argv += ["--resume", args.resume]
        return launch([a for a in argv if a is not None], nproc=args.nproc, nnodes=args.nnodes,
                      node_rank=args.node_rank, master_addr=args.master_addr, master_port=args.master_port)
    from luban.parallel.launch import shutdown_distributed
    from luban.train.trainer import Trainer

    try:
        # the launching process checked the memory above (one process: this one)
        result = Trainer(cfg, memory_checked="WORLD_SIZE" not in os.environ).train(args.resume)
    finally:
        shutdown_distributed()
    return EXIT_SUSPENDED if result.suspended else 0


def cmd_train(args) -> int:
    return _run_training(args)


def cmd_demo(args) -> int:
    """The first half of the steps on the planner's layout, the second half resumed from its
    checkpoint on another one (pipeline x data parallel): a run moves between layouts."""
    from luban.config import load_config

    cfg = load_config(args.config, args.set)
    if args.nproc is None and "WORLD_SIZE" not in os.environ:
        args.nproc = fit_ranks(None, local_gpus(cfg.run.device), demo=True)
    resolve_rendezvous(args)
    world, half = args.nproc * args.nnodes, cfg.train.steps // 2
    from luban.owned import step_dirs

    held = [] if args.resume or "WORLD_SIZE" in os.environ else step_dirs(Path(cfg.run.dir) / "checkpoints")
    if held:  # a second demo: its first half would be a fresh start into the first demo's run (refused)
        raise bad_value("run.dir", cfg.run.dir, f"holds an earlier run (newest {held[0].name}); run this demo "
                        f"into a new folder (luban demo --set run.dir='\"{cfg.run.dir}-2\"') or remove that one "
                        "(nothing was changed)")
    if half == 0 and not (world % 2 or "WORLD_SIZE" in os.environ):  # the first half would be 0 steps
        raise bad_value("train.steps", cfg.train.steps, "at least 2 for the demo (half on each layout)")
    if world % 2 or "WORLD_SIZE" in os.environ:  # no second layout to move to (or already a rank)
        if "WORLD_SIZE" not in os.environ:
            print(f"luban: warning: {world} rank(s): the demo's move to another layout (pipeline x data parallel) "
                  "needs an even number, so every step runs on one layout and no resume is shown "
                  "(run it with --nproc 2 or 4 to see one)", file=sys.stderr, flush=True)
        rc = _run_training(args)
    else:
        dp = world // 2
        layout = {"pp": 2, "dp": dp, "zero": 1 if dp > 1 else 0, "schedule": '"1f1b"', "micro_batch": 2}
        second = argparse.Namespace(**{**vars(args), "parallel": "config", "resume": "auto",
                                       "set": [*args.set, *(f"parallel.{k}={v}" for k, v in layout.items())]})
        from luban.train.rundir import refuse_run_dir

        refuse_run_dir(cfg.run.dir, args.resume)  # (a folder of other files: named first, as in luban train)
        _check_second_half(second, world, dp)  # before the first half trains (it was refused after it)
        first = argparse.Namespace(**{**vars(args), "set": [*args.set, f"train.steps={half}"]})
        rc = _run_training(first)
        if rc == 0:
            print(f"\nsteps {half + 1}-{cfg.train.steps}: resuming step {half}'s checkpoint on another layout: "
                  + ", ".join(f"{k}={v}" for k, v in layout.items()).replace('"', ""), flush=True)
            rc = _run_training(second)
    if rc or os.environ.get("RANK", "0") != "0":
        return rc
    print(f"\nSamples from {cfg.run.dir}:")
    return cmd_sample(argparse.Namespace(checkpoint=cfg.run.dir, prompt="def ", tokens=160, samples=3,
                                         temperature=0.8, top_k=40, seed=0, data=None))


def _check_second_half(second, world: int, dp: int) -> None:
    """The demo's second layout with the user's settings (``--set parallel.tp=3``): refused before the
    first half runs, naming the demo's layout (its ``parallel.dp`` is the demo's, not the user's)."""
    from luban.config import load_config
    from luban.parallel.layout import check_layout

    cfg = load_config(second.config, second.set)
    try:
        check_layout(cfg.parallel, cfg.model, cfg.train.global_batch, world, cfg.seq_len)
    except LubanError as err:
        raise LubanError(f"{err} (in the demo's second half, pp 2 x dp {dp} on {world} ranks: leave the layout to "
                         "the demo, or run luban train)") from None


def cmd_sample(args) -> int:
    from luban.data.tokenizer import load_tokenizer
    from luban.train.sample import generate, load_model

    model, meta = load_model(args.checkpoint)
    _check_finite(args.checkpoint, model, "sample an earlier checkpoint")
    data = args.data or meta.get("dataset")
    if args.data and not Path(data, "manifest.json").is_file():
        raise bad_value("--data", data, "a luban dataset (a folder with manifest.json: `luban data build`), for its tokenizer")
    if not data or not Path(data, "manifest.json").is_file():
        where = f"its dataset {data!r} is gone" if data else "it names no dataset (an imported run)"
        raise LubanError(f"CHECKPOINT = {str(args.checkpoint)!r}: {where}; pass --data DIR, a dataset built "
                         "with its tokenizer")
    tok = load_tokenizer(data)
    _check_same_tokenizer(args, meta, data, model.cfg.vocab)
    prompt = tok.encode(args.prompt) or [tok.eos_id]  # nothing to continue: start a new document
    for i in range(args.samples):
        try:
            ids = generate(model, prompt, args.tokens, args.temperature, args.top_k, args.seed + i)
        except FloatingPointError:  # finite weights, so large that the logits overflow
            raise bad_value("CHECKPOINT", str(args.checkpoint), "its logits are not finite numbers (weights so "
                            "large they overflow: a diverged run); sample an earlier checkpoint") from None
        print(f"--- sample {i + 1} (step {meta['step']}) ---")
        print(for_terminal(tok.decode([t for t in ids if t < tok.vocab_size]), sys.stdout))  # a model's bytes
    return 0


def _describe_tokenizer(ident: dict) -> str:
    return (f"{ident.get('kind')}, vocab {ident.get('vocab_size')}, eos {ident.get('eos_id')}"
            + (f", sha256 {ident['sha256'][:12]}..." if ident.get("sha256") else ""))


def _tokenizer_differs(recorded: dict, given: dict) -> bool:
    """Whether two ``tokenizer_identity`` records (a run's, a dataset's) name different tokenizers."""
    return any(k in recorded and k in given and recorded[k] != given[k]
               for k in ("kind", "vocab_size", "eos_id", "sha256"))


def _check_same_tokenizer(args, meta: dict, data: str, model_vocab: int) -> None:
    """The dataset's tokenizer must be the one the run trained with (recorded in its checkpoints:
    kind, vocabulary, end-of-document id, and a BPE file's SHA-256); else its ids decode to garbage."""
    from luban.data.tokenizer import tokenizer_identity

    given = tokenizer_identity(data)
    recorded = meta.get("tokenizer")
    if recorded is None and args.data and meta.get("dataset") and Path(meta["dataset"], "manifest.json").is_file():
        try:  # a checkpoint from before runs recorded their tokenizer: the dataset it names, if intact
            recorded = tokenizer_identity(meta["dataset"])
        except LubanError:
            recorded = None
    if recorded is not None:
        if _tokenizer_differs(recorded, given):
            where = f"--data = {data!r}" if args.data else f"the run's dataset {data!r}"
            raise LubanError(f"{where}: its tokenizer ({_describe_tokenizer(given)}) is not the one "
                             f"{args.checkpoint} was trained with ({_describe_tokenizer(recorded)}); its ids "
                             "would decode to other text; pass --data with a dataset built with the run's tokenizer")
    elif given["vocab_size"] > model_vocab:
        raise bad_value("--data", data, f"its tokenizer has {given['vocab_size']} ids, more "
                        f"than the model's vocabulary {model_vocab}: not the run's tokenizer")


def cmd_export(args) -> int:
    from luban.model.hf import export_folder, export_warnings, exportable
    from luban.train.sample import load_model

    from luban import owned

    owned.check(args.out, "hf-export", "OUT")  # before the checkpoint is read: a refusal costs nothing
    model, meta = load_model(args.checkpoint)
    _check_finite(args.checkpoint, model)
    exportable(model.cfg)  # before OUT is made and marked
    tokenizer, why = _run_tokenizer(meta, model.cfg.vocab)
    written = export_folder(model.cfg, model.state_dict(), owned.claim(args.out, "hf-export", "OUT"), tokenizer,
                            meta.get("hf_extra"), record=True)
    if tokenizer is None:
        print(f"luban: warning: no tokenizer written: {why}", file=sys.stderr)
    for note in export_warnings(model.cfg):
        print(f"luban: warning: {note}", file=sys.stderr)
    print(for_terminal(f"wrote {args.out}: {', '.join(written)}", sys.stdout))  # a path is the user's bytes
    return 0


def _check_finite(checkpoint, model, advice: str = "export an earlier checkpoint (nothing was written)") -> None:
    """A diverged run's weights (NaN, inf) are refused: before an export's OUT is made (transformers would
    load them and every logit would be NaN, and ``luban import`` refuses them), and before sampling (no
    token can be drawn from NaN probabilities)."""
    from luban.model.hf import nonfinite

    found = nonfinite(model.state_dict())
    if found:
        raise bad_value("CHECKPOINT", str(checkpoint), f"its tensor {found[0]} has {found[1]}: a diverged run; "
                        f"{advice}")


def _run_tokenizer(meta: dict, vocab: int):
    """(the tokenizer of the dataset the run trained on, or None and why not)."""
    from luban.data.tokenizer import load_tokenizer, tokenizer_identity
    from luban.errors import LubanError

    data = meta.get("dataset")
    if not data:
        source = meta.get("source")
        return None, (f"the checkpoint was imported from {source}; copy its tokenizer files" if source else
                      "the checkpoint names no dataset")
    if not Path(data, "manifest.json").is_file():
        return None, f"the run's dataset {data} is gone"
    try:
        tokenizer = load_tokenizer(data)
        given = tokenizer_identity(data)
    except LubanError as err:
        return None, str(err)
    recorded = meta.get("tokenizer")
    if isinstance(recorded, dict) and _tokenizer_differs(recorded, given):  # the dataset rebuilt since
        return None, (f"the run's dataset {data} now holds another tokenizer ({_describe_tokenizer(given)}) than "
                      f"the run trained with ({_describe_tokenizer(recorded)}); copy the run's tokenizer files")
    if tokenizer.vocab_size > vocab:
        return None, f"the dataset's tokenizer has {tokenizer.vocab_size} tokens, the model {vocab}"
    return tokenizer, ""


def cmd_import(args) -> int:
    from luban import owned
    from luban.model.hf import import_folder
    from luban.train import checkpoint

    out = Path(args.out)
    owned.check(out, "run", "OUT")

    def refuse_a_run() -> None:  # an import starts a run: it never joins (or prunes) one that has checkpoints
        held = checkpoint.step_dirs(out / "checkpoints") if (out / "checkpoints").is_dir() else []
        if held:
            raise bad_value("OUT", str(out), f"already holds a run ({held[0].name} in checkpoints/); import into a "
                                             "new or empty folder (nothing was changed)")

    refuse_a_run()
    from luban.train.sample import check_host_memory

    from luban.model.hf import weight_bytes

    imported = import_folder(Path(args.folder), fits=lambda cfg: check_host_memory(
        str(args.folder), cfg, "FOLDER", weight_bytes(Path(args.folder))))
    for note in imported.warnings:
        print(f"luban: warning: {args.folder}/config.json: {note}", file=sys.stderr)
    meta = {"step": 0, "config": {"model": imported.cfg.to_dict()}, "world_size": 1, "source": str(args.folder),
            "hf_extra": imported.extra}
    owned.claim(out, "run", "OUT")
    from luban.train.rundir import lock_run_dir

    lock_run_dir(out, "OUT")  # one import (or run) at a time here: two at once saved one step_0000000 each
    refuse_a_run()  # (one that ended meanwhile)
    try:
        path = checkpoint.save(out / "checkpoints", 0, {"model": imported.state}, meta, keep=1)
    except CheckpointWriteError as err:  # there is no previous checkpoint, nor a run to resume
        raise CheckpointWriteError(f"OUT = {str(out)!r}: the imported checkpoint could not be written "
                                   f"({getattr(err, 'cause', err)}); free space or choose another folder, then "
                                   "import again") from None
    print(for_terminal(f"wrote {path}", sys.stdout))
    return 0
