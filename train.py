"""
Train a GPT with a depth-routing residual, on CPU, one GPU, or many through torchrun (DDP or FSDP2).

    python train.py configs/demo.py                                  # CPU or one GPU
    python train.py configs/demo.py --residual=standard --lr=2e-3    # any key can be overridden
    torchrun --standalone --nproc_per_node=8 train.py configs/rd_s.py
    python train.py configs/demo.py --resume=true                    # continue runs/demo exactly
    python train.py configs/demo.py --overwrite=true                 # start runs/demo over

A config is a Python file that assigns keys; --key=value overrides it. `seed` fixes the initial weights and
`data_seed` the batches' order, so runs that differ only in `residual` are paired (VARIANTS.md section 8).
out_dir/run_name gets config.json, log.jsonl, ckpt.pt, summary.json (docs/training.md). SIGINT or SIGTERM
stops the run after the current step, with a checkpoint. Exit status 0; 2 after one `error:` line; 128 + N
after signal N.
"""

import difflib
import errno
import fcntl
import gc
import inspect
import json
import math
import os
import resource
import signal
import sys
import time
import traceback
import typing
from contextlib import nullcontext
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.nn.parallel import DistributedDataParallel

from common import (
    Stopped,
    UserError,
    any_rank,
    cli,
    cpu_threads,
    log_records,
    need,
    on_rank0,
    perplexity,
    provenance,
    read_json,
    say,
    signal_handlers,
    utc_now,
    world_size,
    write_atomic,
)
from data import TokenData, TokenLoader, check_data, eval_batches
from model import RESIDUALS, GPTConfig, InitialWeights, key
from model_fast import checkpoint_problem, compile_model, make_model, read_checkpoint

# --- Config: the training keys (TrainConfig), the model keys (model.GPTConfig), a config file, --key=value ---


@dataclass
class TrainConfig:
    data_dir: str = key("data/shakespeare", "prepared data (prepare_data.py); its meta.json names the tokenizer")
    out_dir: str = key("runs", "runs live in out_dir/run_name")
    run_name: str = key("", "default: the config file's name")
    resume: bool = key(False, "continue the run directory's checkpoint (a run without one starts from step 0)")
    overwrite: bool = key(False, "start afresh in a run directory that holds a run, deleting that run")
    seed: int = key(0, "model init (make_model(cfg, seed)); also torch's global seed")
    data_seed: int = key(0, "order of the training batches")
    batch_tokens: int = key(8192, "tokens per optimizer step, all ranks together")
    batch_size: int = key(8, "sequences per micro-batch on each rank")
    seq_len: int = key(256, "tokens per sequence; the model's block_size follows it unless set")
    max_steps: int = key(0, "optimizer steps; 0: max_tokens // batch_tokens")
    max_tokens: int = key(0, "token budget, used when max_steps is 0")
    lr: float = key(3e-3, "peak learning rate")
    min_lr: float = key(3e-4, "learning rate at the end of the schedule")
    lr_schedule: str = key("cosine", "cosine: warmup, cosine to min_lr | wsd: warmup, constant, linear decay to min_lr")
    warmup_steps: int = key(100, "linear warmup from lr / warmup_steps to lr")
    decay_frac: float = key(0.2, "wsd: fraction of max_steps spent decaying")
    weight_decay: float = key(0.1, "AdamW, on matrices only (model.param_groups)")
    beta1: float = key(0.9, "AdamW")
    beta2: float = key(0.95, "AdamW")
    eps: float = key(1e-8, "AdamW")
    grad_clip: float = key(1.0, "max global gradient norm; 0: off")
    eval_interval: int = key(250, "steps between validation evaluations (and one at the end)")
    eval_tokens: int = key(65536, "tokens per evaluation: a fixed prefix of the split, shared among ranks")
    threads: int = key(0, "CPU intra-op threads; 0: the cores other work leaves free (OMP_NUM_THREADS wins)")
    final_eval_tokens: int | None = key(None, "tokens of the final val and test scores (summary.json): None = "
                                              "eval_tokens, 0 = the whole split")
    log_interval: int = key(10, "steps between log lines")
    ckpt_interval: int = key(1000, "steps between checkpoints, each after a finite evaluation (and one at the end); "
                                   "0: only at the end")
    device: str = key("auto", "auto (cuda if available) | cpu | cuda; with torchrun, rank r uses cuda:LOCAL_RANK")
    compile: bool = key(False, "torch.compile the model")
    fsdp: bool = key(False, "with torchrun: shard parameters, gradients and AdamW state over the ranks (FSDP2) "
                            "instead of replicating them (DDP)")
    wandb_log: bool = key(False, "log the config and every train/eval record to W&B (rank 0; pip install wandb)")
    wandb_project: str = key("depth-routing", "W&B project")
    wandb_run_name: str = key("", "W&B run name; default: run_name")
    wandb_group: str = key("", "W&B group (sweep.py: the sweep's name)")
    wandb_tags: str = key("", "comma-separated W&B tags (sweep.py: the variant and seed<s>)")

    def __post_init__(self):
        for name in ("seed", "data_seed"):
            need(0 <= getattr(self, name) < 2**32, f"{name} must be in [0, 2**32), got {getattr(self, name)}")
        for name in ("batch_tokens", "batch_size", "seq_len", "eval_interval", "eval_tokens", "log_interval"):
            need(getattr(self, name) >= 1, f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_steps", "max_tokens", "warmup_steps", "ckpt_interval", "weight_decay", "grad_clip", "eps",
                     "threads"):
            need(getattr(self, name) >= 0, f"{name} must be >= 0, got {getattr(self, name)}")
        need(self.max_steps > 0 or self.max_tokens >= self.batch_tokens,
             f"set max_steps, or max_tokens of at least batch_tokens={self.batch_tokens}")
        need(0 <= self.min_lr <= self.lr and math.isfinite(self.lr) and self.lr > 0,
             f"need 0 <= min_lr <= lr and lr > 0, got min_lr={self.min_lr}, lr={self.lr}")
        need(self.eval_tokens >= self.seq_len, f"eval_tokens={self.eval_tokens} is less than seq_len={self.seq_len}")
        need(self.final_eval_tokens in (None, 0) or self.final_eval_tokens >= self.seq_len,
             f"final_eval_tokens={self.final_eval_tokens} is less than seq_len={self.seq_len} (0: the whole split)")
        need(self.lr_schedule in ("cosine", "wsd"), f"lr_schedule must be cosine or wsd, got {self.lr_schedule!r}")
        need(0 <= self.decay_frac <= 1, f"decay_frac must be in [0, 1], got {self.decay_frac}")
        need(0 <= self.beta1 < 1 and 0 <= self.beta2 < 1, f"betas must be in [0, 1), got {self.beta1}, {self.beta2}")
        need(self.device in ("auto", "cpu", "cuda"), f"device must be auto, cpu or cuda, got {self.device!r}")
        need(not (self.overwrite and self.resume), "resume=true continues the run that overwrite=true would delete")
        need(self.run_name not in (".", "..") and not set(self.run_name) & set("/\\"),
             f"run_name must be a plain directory name inside out_dir, got {self.run_name!r}: put the path in out_dir")

    @property
    def steps(self):
        return self.max_steps or self.max_tokens // self.batch_tokens


TRAIN_TYPES = typing.get_type_hints(TrainConfig)
MODEL_TYPES = typing.get_type_hints(GPTConfig)
# model keys that change how the model computes, not what: a resume may change them
EXECUTION_KEYS = ("depth_impl", "depth_chunk", "activation_checkpointing")
CKPT_FORMAT = "depthres-ckpt-3"  # one file of torch.distributed.checkpoint's full state dicts (issue 53)


def type_name(typ):
    return " | ".join("None" if t is type(None) else t.__name__ for t in typing.get_args(typ)) or typ.__name__


def convert(name, value, typ):
    """`value` (a command-line string or a config file's value) as type `typ`, or a UserError."""
    if type(None) in typing.get_args(typ) and (value is None or str(value).lower() in ("none", "null")):
        return None
    typ = next((t for t in typing.get_args(typ) if t is not type(None)), typ)
    word = value.lower() if isinstance(value, str) else value
    if typ is bool and word in ("true", "1", 1, "false", "0", 0):
        return word in ("true", "1", 1)
    if typ is str and isinstance(value, str):
        return value
    if typ in (int, float) and not isinstance(value, bool):
        try:
            number = float(value)
            if typ is float and math.isfinite(number):
                return number
            if typ is int and number.is_integer():
                return int(value) if isinstance(value, int) or str(value).strip().lstrip("+-").isdigit() else int(number)
        except (TypeError, ValueError):
            pass
    raise UserError(f"{name} expects {'true/false/1/0' if typ is bool else type_name(typ)}, got {value!r}")


def check_key(name, where):
    if name in TRAIN_TYPES or name in MODEL_TYPES:
        return name
    close = difflib.get_close_matches(name, [*TRAIN_TYPES, *MODEL_TYPES], n=3, cutoff=0.6)
    hint = f"; did you mean {' or '.join(close)}?" if close else ""
    raise UserError(f"unknown key {name!r} in {where}{hint} (python train.py --help lists every key)")


def read_settings(path, what="config file"):
    """The names a Python settings file (a config, a sweep file) assigns; an error in it is one line naming the line."""
    need(Path(path).is_file(), f"{what} {path} not found")
    names = {}  # one namespace, as a module's: a comprehension in the file sees its names
    try:
        exec(compile(Path(path).read_bytes(), str(path), "exec"), names)
    except SyntaxError as e:
        raise UserError(f"{what} {path}: line {e.lineno}: syntax error: {e.msg}") from None
    except (Exception, SystemExit) as e:  # (a file that calls sys.exit, too)
        line = next((f.lineno for f in reversed(traceback.extract_tb(e.__traceback__)) if f.filename == str(path)), "?")
        raise UserError(f"{what} {path}: line {line}: {type(e).__name__}: {e}") from None
    names.pop("__builtins__", None)
    return names


def parse_config(argv):
    """[CONFIG, --key=value or --key value, ...] -> (TrainConfig, the model keys that were set)."""
    need(argv and not argv[0].startswith("-"), "usage: python train.py CONFIG [--key=value ...]  (--help: the keys)")
    path = argv[0]
    names = read_settings(path)
    settings = {check_key(k, path): v for k, v in names.items()
                if not k.startswith("_") and not inspect.ismodule(v) and not callable(v)}
    args = list(argv[1:])
    while args:  # --key=value, or --key value as the other commands take it
        arg = args.pop(0)
        need(arg.startswith("--") and len(arg) > 2, f"expected --key=value, got {arg!r}")
        name, eq, value = arg[2:].partition("=")
        if not eq:
            need(args and not args[0].startswith("--"), f"--{name} needs a value: --{name}=VALUE")
            value = args.pop(0)
        settings[check_key(name, "the command line")] = value
    settings = {k: convert(k, v, TRAIN_TYPES.get(k) or MODEL_TYPES[k]) for k, v in settings.items()}
    train = {k: v for k, v in settings.items() if k in TRAIN_TYPES}
    train["run_name"] = train.get("run_name") or Path(path).stem
    return TrainConfig(**train), {k: v for k, v in settings.items() if k in MODEL_TYPES}


def model_config(settings):
    """model.GPTConfig(**settings), which checks itself: a bad value is one UserError line."""
    try:
        return GPTConfig(**settings)
    except ValueError as e:
        raise UserError(str(e)) from None


def build_model_config(model_settings, tc, meta):
    """GPTConfig of the keys set; vocab_size defaults to the data's (padded), block_size to seq_len."""
    kv = {"vocab_size": 64 * math.ceil(meta["vocab_size"] / 64), "block_size": tc.seq_len, **model_settings}
    need(kv["vocab_size"] >= meta["vocab_size"], f"vocab_size={kv['vocab_size']} is smaller than the "
         f"{meta['tokenizer']} tokenizer's {meta['vocab_size']} in {tc.data_dir}")
    need(kv["block_size"] >= tc.seq_len, f"block_size={kv['block_size']} is shorter than seq_len={tc.seq_len}")
    return model_config(kv)


def usage():
    """--help: the docstring, then every key with its type, default and meaning."""
    lines = [__doc__.strip(), "", "training keys:"]
    lines += [f"  {f.name:<14} {type_name(TRAIN_TYPES[f.name]):<6} {f.default!r:<18} {f.metadata['help']}"
              for f in fields(TrainConfig)]
    lines += ["", f"model keys (model.GPTConfig; residual: one of {', '.join(RESIDUALS)}):"]
    lines += [f"  {f.name:<24} {type_name(MODEL_TYPES[f.name]):<11} {f.default!r:<12} {f.metadata['help']}"
              for f in fields(GPTConfig)]
    return "\n".join(lines)


# --- Ranks and the model: DDP, or FSDP2 (fully_shard) from the meta device ----------------------------------


def setup_ranks(tc):
    """(rank, world_size, device) from torchrun's environment."""
    env = {k: os.environ.get(k, d) for k, d in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"))}
    need(all(v.isdigit() for v in env.values()) and int(env["RANK"]) < int(env["WORLD_SIZE"]), "RANK, WORLD_SIZE and "
         f"LOCAL_RANK are {env}, not a torchrun rank: start the ranks with torchrun, or unset them for one process")
    rank, world, local = (int(env[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    unset = [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    need(world == 1 or not unset, f"WORLD_SIZE={world} is set, but not by torchrun ({', '.join(unset)} missing): "
         "start the ranks with torchrun, or unset WORLD_SIZE for one process")
    cuda = tc.device == "cuda" or (tc.device == "auto" and torch.cuda.is_available())
    need(not cuda or torch.cuda.is_available(), "device=cuda, but CUDA is not available")
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:  # what is free, shared among this node's ranks
        torch.set_num_threads(tc.threads or cpu_threads(int(os.environ.get("LOCAL_WORLD_SIZE", world))))
    if world > 1:
        dist.init_process_group("nccl" if cuda else "gloo")
    return rank, world, device


def sharded_model(mc, seed, world, device):
    """A GPT sharded over the ranks (FSDP2), one unit per sublayer, initialised bit for bit as in one process."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    with torch.device("meta"):
        model = make_model(mc, seed=seed)
    mesh = init_device_mesh(device.type, (world,))
    for block in model.blocks:
        fully_shard(block.attn, mesh=mesh)
        fully_shard(block.mlp, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device=device)
    model.init_buffers()
    values = InitialWeights(mc, seed)
    with torch.no_grad():
        for name, p in model.named_parameters():  # every rank makes the whole tensor and keeps its shard
            p.copy_(distribute_tensor(values(name, p.shape).to(device), p.device_mesh, p.placements, src_data_rank=None))
    return model


def gradient_sync(model, on):
    """A context for one micro-step's backward: gradients stay local (accumulating) unless `on`."""
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(on)
        return nullcontext()
    return model.no_sync() if isinstance(model, DistributedDataParallel) and not on else nullcontext()


# --- The loop: lr_at, train_step, evaluate ------------------------------------------------------------------


def lr_at(it, tc, max_steps):
    """Learning rate of optimizer step `it` (0-based); both schedules reach min_lr at the last step."""
    if it < tc.warmup_steps:
        return tc.lr * (it + 1) / tc.warmup_steps
    if tc.lr_schedule == "cosine":
        progress = (it + 1 - tc.warmup_steps) / max(1, max_steps - tc.warmup_steps)
        return tc.min_lr + 0.5 * (tc.lr - tc.min_lr) * (1 + math.cos(math.pi * progress))
    decay_start = max_steps - round(tc.decay_frac * max_steps)
    if it < decay_start:
        return tc.lr
    return tc.lr + (tc.min_lr - tc.lr) * (it + 1 - decay_start) / (max_steps - decay_start)


def train_step(model, optimizer, loader, accum, lr, tc, device, autocast, max_loss, signals=None):
    """One optimizer step over `accum` micro-batches per rank, skipped on a non-finite or too large loss: (mean loss,
    gradient norm before clipping, any rank's signal), read in one sync."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    total = torch.zeros((), device=device)
    for micro in range(accum):
        x, y = loader.next_batch()
        if device.type == "cuda":
            x, y = x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
        with gradient_sync(model, micro == accum - 1):  # gradients are all-reduced on the last one only
            with autocast():
                _, loss = model(x, y)
            (loss / accum).backward()
        total += loss.detach()
    stop = torch.full((), float(signals.signum if signals else 0), device=device)
    world = world_size()
    if world > 1:
        dist.all_reduce(total)
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)  # a signal to any rank stops them all
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip or math.inf)
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP: over all shards
    total, norm, stop = torch.stack([total, norm.float(), stop]).tolist()  # the step's one sync
    loss = total / (accum * world)
    if math.isfinite(loss) and loss <= max_loss and math.isfinite(norm):
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss, norm, int(stop)


@torch.no_grad()
def evaluate(model, data, split, batch_size, seq_len, max_tokens=None, device="cpu", autocast=None, lockstep=False):
    """(mean loss over a split's first max_tokens targets, summed in float64 over the ranks; tokens). lockstep
    (FSDP, whose forwards gather from every rank): every rank runs as many batches as the busiest one."""
    world = world_size()
    rank = dist.get_rank() if world > 1 else 0
    sums = torch.zeros(2, dtype=torch.float64, device=device)  # loss sum, token count
    batches = eval_batches(data, split, batch_size, seq_len, max_tokens, rank, world)
    while True:
        batch = next(batches, None)
        if not (any_rank(batch is not None, device) if lockstep else batch is not None):
            break
        x, y = batch or (torch.zeros(1, seq_len, dtype=torch.long),) * 2  # idle: a forward, nothing counted
        with autocast or nullcontext():
            _, loss = model(x.to(device), y.to(device))
        if batch is not None:
            sums[0] += loss.double() * y.numel()
            sums[1] += y.numel()
    if world > 1:
        dist.all_reduce(sums)
    loss_sum, tokens = sums.tolist()
    return loss_sum / tokens, int(tokens)


# --- The run directory: its lock, its checkpoint, its log ---------------------------------------------------


def claim_run_dir(tc, run_dir, mc, data):
    """Rank 0: lock the run directory for this run's life; (the lock's fd, read_run_dir's checkpoint)."""
    if tc.wandb_log:
        try:
            import wandb  # noqa: F401
        except ImportError:
            raise UserError("wandb_log=true needs the wandb package: pip install wandb (or drop wandb_log)") from None
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(run_dir / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    for _ in range(20):  # a sweep's probe holds it for a moment: retry for about a second
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            time.sleep(0.05)
    else:
        os.close(fd)
        raise UserError(f"{run_dir} is in use by another run")
    try:
        for name in ("ckpt.pt", "config.json", "log.jsonl", "summary.json"):  # a killed save's (common.write_atomic)
            for tmp in run_dir.glob(f".{name}.*.tmp"):
                tmp.unlink(missing_ok=True)
        return fd, read_run_dir(tc, run_dir, mc, data)
    except BaseException:
        os.close(fd)
        raise


def read_run_dir(tc, run_dir, mc, data):
    """The checkpoint a resume continues, checked against this run and its data; None for a fresh run."""
    path, tokenizer = run_dir / "ckpt.pt", data.meta["tokenizer"]
    held = [n for n in ("ckpt.pt", "log.jsonl", "summary.json") if (run_dir / n).exists()]
    if tc.resume and path.exists():
        ckpt = read_checkpoint(path, "start over with --overwrite=true")
        need(ckpt.get("format") == CKPT_FORMAT, f"{path} is not a checkpoint of this "
             f"train.py (format {CKPT_FORMAT}): resume it with the version that wrote it, or start over with --overwrite=true")
        need((why := checkpoint_problem(ckpt)) is None, f"{path} is damaged ({why}): start over with --overwrite=true")
        try:
            need(ckpt["tokenizer"] == tokenizer, f"{path} was trained on {ckpt['tokenizer']} tokens, but "
                 f"{tc.data_dir} holds {tokenizer} tokens")
            differ = [f"{k}: {ckpt['model_config'].get(k, 'missing')!r} there, {v!r} here" for k, v in asdict(mc).items()
                      if k not in EXECUTION_KEYS and ckpt["model_config"].get(k, "missing") != v]
            differ += [f"{k}: {ckpt['train_config'][k]!r} there, {getattr(tc, k)!r} here"
                       for k in ("seed", "data_seed", "batch_tokens") if ckpt["train_config"][k] != getattr(tc, k)]
            need(not differ, f"{path} holds another run ({'; '.join(differ)}): resume with its config, or choose "
                 "another run_name")
            need(ckpt.get("data_fingerprint") in (None, data.fingerprint), f"{path} was trained on other data than "
                 f"{tc.data_dir} holds now (prepared again since?): resume it on the data it trained on, or start over "
                 "with --overwrite=true")
            need(ckpt["step"] <= tc.steps, f"{path} is at step {ckpt['step']}, past this run's last step {tc.steps}")
            wrong = misfit(ckpt, mc)
        except (KeyError, TypeError, AttributeError) as e:
            wrong = f"{type(e).__name__} {e}"
        need(wrong is None, f"{path} does not fit this run ({wrong}): it is damaged, or not this train.py's; start "
             "over with --overwrite=true")
        return ckpt
    if tc.resume:  # records past the first checkpoint's step, or a stop (written after its checkpoint): one now gone
        try:  # the run's own settings, not this command's
            ran_with = read_json(run_dir / "config.json")
            interval, steps = int(ran_with["train"]["ckpt_interval"]), int(ran_with["max_steps"])
        except (ValueError, KeyError, TypeError):
            interval, steps = tc.ckpt_interval, tc.steps
        first_ckpt, records = min(interval or steps, steps), log_records(run_dir)
        ran = max([r["step"] for r in records if isinstance(r.get("step"), int)], default=0) > first_ckpt
        lost = [n for n in ("summary.json", "ckpt") if (run_dir / n).exists()]  # (ckpt/: an older version's FSDP run)
        lost += ["log.jsonl"] * (ran or any(r.get("kind") == "stop" for r in records))
        need(not lost, f"{run_dir} holds a run's records ({', '.join(lost)}) but no ckpt.pt to resume: nothing was "
             "changed; start it over with --overwrite=true")
        print(f"note: {run_dir} holds no checkpoint yet: starting the run from step 0", file=sys.stderr)
    elif held and not tc.overwrite:
        raise UserError(f"{run_dir} already holds a run ({', '.join(held)}): continue it with --resume=true, or "
                        "start over with --overwrite=true")
    return None


def misfit(ckpt, mc):
    """What in a checkpoint does not fit this run's model, AdamW or RNG; None if it all fits."""
    with torch.device("meta"):
        want = {k: tuple(v.shape) for k, v in make_model(mc).state_dict().items()}

    def shape(t):  # a tensor's shape, else what it is
        return tuple(t.shape) if torch.is_tensor(t) else "missing" if t is None else type(t).__name__
    for k in sorted(set(want) | set(ckpt["model"])):
        if shape(ckpt["model"].get(k)) != want.get(k, "missing"):
            return f"weight {k}: {shape(ckpt['model'].get(k))} there, {want.get(k, 'missing')} here"
    if ckpt["step"] > 0 and not ckpt["optimizer"]["state"]:
        return "AdamW's state: empty after a step"
    for k, state in ckpt["optimizer"]["state"].items():
        for moment in ("exp_avg", "exp_avg_sq"):
            if k not in want or shape(state.get(moment)) != want[k]:
                return f"AdamW's {moment} of {k}: {shape(state.get(moment))}"
        if not torch.is_tensor(state.get("step")) or state["step"].numel() != 1:
            return f"AdamW's step of {k}: {shape(state.get('step'))}"
    if not isinstance(ckpt["loader"], dict):
        return f"the loader state: {shape(ckpt['loader'])}"
    try:
        set_rng_state(ckpt["rng"], torch.device("cpu"))  # (main seeds afterwards)
    except (ValueError, RuntimeError, IndexError) as e:
        return f"the RNG state: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
    return None


def rng_state(device):
    """torch's generators (a variant's randomness; the loader has its own, the model's init its seed)."""
    state = {"torch": torch.get_rng_state()}
    return {**state, "cuda": torch.cuda.get_rng_state(device)} if device.type == "cuda" else state


def set_rng_state(state, device):
    torch.set_rng_state(state["torch"])
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


def save_checkpoint(path, model, optimizer, state):
    """One file for one process, DDP and FSDP alike: the whole state gathered on rank 0 and written atomically."""
    model_sd, optim_sd = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True,
                                                                                  cpu_offload=True))
    def write(f):
        try:
            torch.save({**state, "model": model_sd, "optimizer": optim_sd}, f)
        except RuntimeError as e:  # torch's writer reports a refused write (a full disk) as an "enforce fail"
            cause = e.__cause__ or e.__context__
            raise OSError(getattr(cause, "errno", None) or errno.EIO, getattr(cause, "strerror", None) or
                          f"the write failed ({str(e).splitlines()[0][:80]})", str(path)) from None
    on_rank0(lambda: write_atomic(path, write))


def load_checkpoint(ckpt, model, optimizer, world):
    """Rank 0's checkpoint into the (sharded) model and AdamW, broadcast; AdamW keeps this run's settings."""
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=world > 1)
    settings = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    set_model_state_dict(model, ckpt.get("model", {}), options=options)
    set_optimizer_state_dict(model, optimizer, ckpt.get("optimizer", {}), options=options)
    for group, own in zip(optimizer.param_groups, settings):
        group.update(own)


class Log:
    """Log lines on stdout and JSON records appended to log.jsonl (and W&B), on rank 0 only."""

    def __init__(self, path, enabled, tracker=None):
        self.path, self.enabled, self.tracker = path, enabled, tracker

    def __call__(self, line, record=None):
        if not self.enabled:
            return
        if line is not None:
            say(line)
        if record is not None:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
            metrics = {f"{record.get('split', record['kind'])}/{k}": v for k, v in record.items()
                       if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"}
            if self.tracker is not None and metrics:
                self.tracker.log(metrics, step=record["step"])


def hms(seconds):
    s = round(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class GracefulStop:
    """The first SIGINT or SIGTERM to `handle` asks the run to stop after the current step (`signum`)."""

    def __init__(self, verbose=True):
        self.verbose, self.signum = verbose, 0

    def handle(self, signum, frame):
        if not self.signum:
            self.signum = signum
            if self.verbose:  # os.write: print() may be busy in the interrupted code
                os.write(2, f"\n{signal.Signals(signum).name}: stopping after this step, with a checkpoint "
                            "(Ctrl-C again to stop at once)\n".encode())
        elif signum == signal.SIGINT:
            raise Stopped("interrupted; the last checkpoint, if any, is kept (--resume=true continues from it)", signum)


# --- The run, top to bottom ---------------------------------------------------------------------------------


def autocast(device):
    """bfloat16 autocast on CUDA (float32 parameters); none on CPU."""
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()


def without_weights(ckpt):
    """What the other ranks need of rank 0's checkpoint: all but the weights, which come at loading."""
    return ckpt and {k: v for k, v in ckpt.items() if k not in ("model", "optimizer")}


def start_run_dir(tc, run_dir, ckpt, step, resolved):
    """Rank 0: config.json, the log up to the checkpoint (a resume's records once), W&B; returns the W&B run."""
    kept = [r for r in log_records(run_dir) if r.get("step", math.inf) < step or (r.get("step") == step and
            r.get("split") != "test" and r.get("kind") != "resume" and not r.get("final"))] if ckpt else []
    for name in ("summary.json",) + (() if ckpt else ("ckpt.pt",)):
        (run_dir / name).unlink(missing_ok=True)
    write_atomic(run_dir / "config.json", json.dumps(resolved, indent=2) + "\n")
    write_atomic(run_dir / "log.jsonl", "".join(json.dumps(r) + "\n" for r in kept))
    if not tc.wandb_log:
        return None
    import wandb
    try:
        return wandb.init(project=tc.wandb_project, name=tc.wandb_run_name or tc.run_name, config=resolved,
                          group=tc.wandb_group or None, tags=[t for t in tc.wandb_tags.split(",") if t] or None)
    except Exception as e:
        raise UserError(f"wandb_log=true, but W&B did not start: {str(e).strip().splitlines()[0]}") from None


def check_diverged(log, what, loss, norm, step, max_loss, saved, run_dir):
    """A loss non-finite or above max_loss (or a non-finite gradient norm) stops the run, its last checkpoint kept."""
    if not (math.isfinite(loss) and loss <= max_loss and math.isfinite(norm)):
        stop_with(log, step, f"{what} {loss:.4g} (gradient norm {norm:.4g}) at step {step} is non-finite or above "
                             f"{max_loss:.1f} nats: training diverged and stopped without saving step {step}; "
                             f"{kept(saved, run_dir)}. Try a lower lr or a longer warmup")


def kept(saved, run_dir):
    return "no checkpoint was written" if saved is None else (f"the checkpoint of step {saved[0]} (val loss "
                                                               f"{saved[1]:.4f}, evaluated finite) is kept in {run_dir}")


def stop_with(log, step, error):
    log(None, {"kind": "diverged", "step": step, "error": error})  # a sweep tabulates the run as diverged
    raise UserError(error)


def check_data_unchanged(data, step, saved, run_dir, device):
    """A shard rewritten in place under the run stops it (no divergence: the run's data changed)."""
    if any_rank((shard := data.changed()) is not None, device):
        raise UserError(f"{shard or 'a shard of ' + str(data.dir)} changed under this run (rewritten in place since it "
                        f"was opened): stopped at step {step} without saving; {kept(saved, run_dir)}. Restore the data "
                        "it trained on to resume, or start a new run on the new data")


def check_better(log, val_loss, step, saved, uniform, run_dir):
    """A checkpoint replaces the last only with a val loss at most ln 2 above both its and a uniform guess's (ln V)."""
    if saved is not None and saved[1] is not None and val_loss > min(saved[1], uniform) + math.log(2):
        stop_with(log, step, f"val loss {val_loss:.4f} at step {step} is more than ln 2 above the last checkpoint's "
                             f"or a uniform guess's ({uniform:.2f}): stopped without replacing it; {kept(saved, run_dir)}. "
                             "Try a lower lr or a longer warmup")


def log_eval(log, split, loss, tokens, step, max_steps, elapsed, final=False):
    log(f"step {step}/{max_steps} | {split} loss {loss:.4f} | ppl {perplexity(loss):.1f} | {tokens:,} tokens | "
        f"{hms(elapsed)} elapsed", {"kind": "eval", "split": split, "step": step, "loss": loss, "ppl": perplexity(loss),
                                    "tokens": tokens, "elapsed_s": elapsed, **({"final": True} if final else {})})


def main(argv=None):
    """Train as the command line says, top to bottom. Returns the summary (rank 0's view)."""
    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:
        print(usage())
        return None
    # config: every check before any compute
    tc, model_settings = parse_config(argv)
    data = TokenData(tc.data_dir)  # opened once: a later prepare_data.py --overwrite changes nothing for this run
    check_data(data, tc.seq_len)
    meta, mc = data.meta, build_model_config(model_settings, tc, data.meta)
    rank, world, device = setup_ranks(tc)
    master, max_steps, run_dir = rank == 0, tc.steps, Path(tc.out_dir) / tc.run_name
    lock = log = None
    try:
        per_micro = tc.batch_size * tc.seq_len * world
        need(tc.batch_tokens % per_micro == 0, f"batch_tokens={tc.batch_tokens} is not a multiple of batch_size * "
             f"seq_len * world_size = {per_micro} (e.g. batch_tokens={max(1, round(tc.batch_tokens / per_micro)) * per_micro})")
        accum, sharded = tc.batch_tokens // per_micro, tc.fsdp and world > 1
        # the run directory: rank 0 locks it and reads its checkpoint; the other ranks get all but the weights
        lock, ckpt = on_rank0(lambda: claim_run_dir(tc, run_dir, mc, data),
                              lambda claimed: (None, without_weights(claimed[1])))

        # model, optimizer, data: the seed fixes the weights, data_seed the batches, on any number of ranks
        torch.manual_seed(tc.seed)
        loader = TokenLoader(data, "train", tc.batch_size, tc.seq_len, rank, world, seed=tc.data_seed)
        raw_model = sharded_model(mc, tc.seed, world, device) if sharded else make_model(mc, seed=tc.seed).to(device)
        optimizer = torch.optim.AdamW(raw_model.param_groups(tc.weight_decay), lr=tc.lr, betas=(tc.beta1, tc.beta2),
                                      eps=tc.eps, fused=device.type == "cuda")
        step, before = 0, {}  # before: what the run's earlier segments add up to (seconds, speeds, provenance)
        if ckpt is not None:
            load_checkpoint(ckpt, raw_model, optimizer, world)
            loader.load_state_dict(ckpt["loader"])
            set_rng_state(ckpt["rng"], device)
            step, before = ckpt["step"], ckpt.get("segments") or {}
        model = compile_model(raw_model) if tc.compile else raw_model  # for evaluation
        train_model = model if world == 1 or sharded else DistributedDataParallel(  # (the rotary tables are constant)
            model, device_ids=[device.index] if device.type == "cuda" else None, forward_sync_buffers=False)
        uniform = math.log(mc.vocab_size)  # a uniform guess's loss
        max_loss = 4 * uniform  # diverged though finite
        final_tokens = tc.eval_tokens if tc.final_eval_tokens is None else tc.final_eval_tokens or None  # 0: all

        # the run directory's files and the log: config.json, the records up to the checkpoint, W&B
        resolved = {"config_file": argv[0], "train": asdict(tc), "model": asdict(mc), "tokenizer": meta["tokenizer"],
                    "data_fingerprint": data.fingerprint, "world_size": world, "grad_accum": accum, "max_steps": max_steps,
                    "threads": torch.get_num_threads()}
        log = Log(run_dir / "log.jsonl", master)
        log.tracker = on_rank0(lambda: start_run_dir(tc, run_dir, ckpt, step, resolved), lambda tracker: None)
        log(f"{mc.residual}: {raw_model.num_params() / 1e6:.2f}M parameters | {meta['tokenizer']} tokens, {world} x "
            f"{device.type}{' (FSDP)' if sharded else ' (DDP)' if world > 1 else ''}, {torch.get_num_threads()} threads | "
            f"{max_steps} steps of {tc.batch_tokens} tokens ({accum} micro-steps of {tc.batch_size}x{tc.seq_len} per "
            f"rank) | run dir {run_dir}")
        if ckpt is not None:
            log(f"resumed at step {step} from {run_dir / 'ckpt.pt'}", {"kind": "resume", "step": step})
        saved = (step, ckpt.get("val_loss")) if ckpt else None  # the last checkpoint: (step, its val loss)
        segments = provenance(before)

        # the loop: a step; once in a while a log line, an evaluation, a checkpoint; a signal stops it after a step
        t_start, first, signum = time.perf_counter(), step, 0
        step_seconds, logged, speeds, val_loss, evaluated = 0.0, step, list(before.get("speeds", [])), None, None
        signals = GracefulStop(verbose=master)
        with signal_handlers({signal.SIGINT: signals.handle, signal.SIGTERM: signals.handle}, over_ignored=True):
            while step < max_steps:
                lr = lr_at(step, tc, max_steps)
                t0 = time.perf_counter()
                loss, norm, signum = train_step(train_model, optimizer, loader, accum, lr, tc, device,
                                                lambda: autocast(device), max_loss, signals)
                step += 1
                step_seconds += time.perf_counter() - t0
                check_diverged(log, "loss", loss, norm, step, max_loss, saved, run_dir)  # stopped before its update
                last = step == max_steps
                if step % tc.log_interval == 0 or last:
                    steps_done, logged = step - logged, step
                    tok_s, elapsed = tc.batch_tokens * steps_done / step_seconds, time.perf_counter() - t_start
                    speeds.append(tok_s)
                    eta = elapsed / (step - first) * (max_steps - step)
                    log(f"step {step}/{max_steps} ({100 * step / max_steps:.1f}%) | loss {loss:.4f} | lr {lr:.2e} | "
                        f"norm {norm:.2f} | {tok_s:,.0f} tok/s | {1000 * step_seconds / steps_done:.0f} ms/step | "
                        f"{hms(elapsed)} elapsed, ETA {hms(eta)}",
                        {"kind": "train", "step": step, "loss": loss, "lr": lr, "grad_norm": norm, "tokens_per_s": tok_s,
                         "ms_per_step": 1000 * step_seconds / steps_done, "elapsed_s": elapsed, "eta_s": eta})
                    step_seconds = 0.0
                stopping = signum and not last
                checkpointing = (tc.ckpt_interval and step % tc.ckpt_interval == 0) or last or stopping
                if step % tc.eval_interval == 0 or checkpointing:  # a checkpoint holds weights just evaluated finite
                    check_data_unchanged(data, step, saved, run_dir, device)
                    val_loss, tokens = evaluate(model, data, "val", tc.batch_size, tc.seq_len, tc.eval_tokens, device,
                                                autocast(device), lockstep=sharded)
                    check_diverged(log, "val loss", val_loss, 0.0, step, max_loss, saved, run_dir)
                    log_eval(log, "val", val_loss, tokens, step, max_steps, time.perf_counter() - t_start)
                    evaluated = step
                if checkpointing:
                    check_better(log, val_loss, step, saved, uniform, run_dir)
                    seconds = before.get("seconds", 0.0) + time.perf_counter() - t_start
                    state = {"format": CKPT_FORMAT, "model_config": asdict(mc), "train_config": asdict(tc), "step": step,
                             "tokenizer": meta["tokenizer"], "loader": loader.state_dict(), "rng": rng_state(device),
                             "world_size": world, "val_loss": val_loss, "data_fingerprint": data.fingerprint,
                             "segments": {**segments, "seconds": seconds, "speeds": speeds}}
                    save_checkpoint(run_dir / "ckpt.pt", raw_model, optimizer, state)
                    saved = (step, val_loss)
                if stopping:
                    break
            # the final scores on final_eval_tokens: val (unless the last evaluation read those tokens), then test
            if evaluated != step and saved and saved[1] is not None:
                val_loss = saved[1]  # resumed at the last step: the checkpoint's evaluation
            test_loss, has_test = None, bool(meta["splits"].get("test", {}).get("tokens"))
            finals = ["val"] * (final_tokens != tc.eval_tokens or val_loss is None) + ["test"] * has_test
            for split in finals if not signum else []:
                if signum := int(any_rank(signals.signum, device)):
                    break
                loss, tokens = evaluate(model, data, split, tc.batch_size, tc.seq_len, final_tokens, device,
                                        autocast(device), lockstep=sharded)
                check_diverged(log, f"{split} loss", loss, 0.0, step, max_loss, saved, run_dir)
                log_eval(log, split, loss, tokens, step, max_steps, time.perf_counter() - t_start, final=True)
                val_loss, test_loss = (loss, test_loss) if split == "val" else (val_loss, loss)
            signum = signum or int(any_rank(signals.signum, device))
        if signum:
            name = signal.Signals(signum).name
            log(None, {"kind": "stop", "step": step, "signal": name})
            raise Stopped(f"stopped by {name} after step {step}; checkpoint written to {run_dir / 'ckpt.pt'}; "
                          "resume with --resume=true", signum)

        # the summary; time and speed over every segment; peak memory: CUDA's allocated tensors, or the resident set
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else \
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # (Linux: KiB)
        peaks = [torch.tensor([peak], device=device) for _ in range(world)]
        if world > 1:
            dist.all_gather(peaks, peaks[0].clone())
        peaks = [int(p) for p in peaks]
        seconds = before.get("seconds", 0.0) + time.perf_counter() - t_start
        summary = {"run_dir": str(run_dir), "step": step, "val_loss": val_loss, "test_loss": test_loss,
                   "final_eval_tokens": final_tokens or 0, "params": raw_model.num_params(), "seconds": seconds,
                   "tokens_per_s": float(np.median(speeds)) if speeds else None,  # over the log intervals
                   "peak_memory_bytes": max(peaks), "peak_memory_bytes_per_rank": peaks,
                   **segments, "finished_utc": utc_now()}
        if master:
            write_atomic(run_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
        test = f", test loss {test_loss:.4f}" if test_loss is not None else ""
        log(f"done: val loss {val_loss:.4f}{test} after {step} steps in {hms(seconds)}; {run_dir} holds the checkpoint, "
            "log.jsonl and summary.json")
        return summary
    finally:
        if log is not None and log.tracker is not None:
            log.tracker.finish(exit_code=0 if sys.exc_info()[0] in (None, Stopped) else 1)
        if lock is not None:
            os.close(lock)
        if world > 1:  # DDP's reducer released while its group lives; no collection from here on (see the end)
            train_model = model = None  # noqa: F841
            gc.disable()
            dist.destroy_process_group()


def command(argv=None):
    """train.py as a command: exits with cli's status."""
    status = cli(main, argv)
    if int(os.environ.get("WORLD_SIZE", 1)) > 1:
        # A torchrun rank ends here, without the interpreter's teardown: destroying DDP's reducer or the gloo group
        # holds the GIL while gloo's own thread, destroying a work under gloo's mutex, waits for it (a hang at exit,
        # docs/reliability.md); the reducer, kept alive by its reference cycles, is never destroyed.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    sys.exit(status)


if __name__ == "__main__":
    command()
