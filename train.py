"""
Train a GPT with a depth-routing residual, on CPU, one GPU, or many through torchrun (DDP).

    python train.py configs/demo.py                                  # CPU or one GPU
    python train.py configs/demo.py --residual=standard --lr=2e-3    # any key can be overridden
    torchrun --standalone --nproc_per_node=8 train.py configs/rd_s.py
    python train.py configs/demo.py --resume=true                    # continue runs/demo exactly
    python train.py configs/demo.py --overwrite=true                 # start runs/demo over
    python train.py --help                                           # every key, its type and default

A config is a Python file that assigns keys (`residual = "block_attnres"`); `--key=value` overrides
it. The keys are TrainConfig's fields below and model.GPTConfig's.

Batch: batch_tokens tokens per optimizer step, in micro-batches of batch_size x seq_len per rank,
accumulated over batch_tokens / (batch_size * seq_len * world_size) micro-steps.
Length: max_steps optimizer steps; with max_steps = 0, max_tokens // batch_tokens of them.
Pairing (VARIANTS.md section 8): `seed` fixes the initial weights, `data_seed` the order of the
batches, so runs that differ only in `residual` start from the same shared weights and see the same
batches, whatever their number of ranks.
The run directory out_dir/run_name receives config.json (the resolved config), log.jsonl (one JSON
object per logged step and per evaluation), ckpt.pt (see save_checkpoint) and, once the run has
finished, summary.json (final val and test loss, median tokens/s, peak memory). A run holds the
directory's .lock for its life; a fresh run refuses a directory that holds another run unless
overwrite=true. The first SIGINT or SIGTERM stops the run after the current step, with a checkpoint.
"""

import difflib
import gc
import hashlib
import inspect
import json
import math
import os
import random
import re
import resource
import runpy
import signal
import statistics
import sys
import textwrap
import threading
import time
import types
import typing
from contextlib import contextmanager, nullcontext, suppress
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np
import torch
import torch.distributed as torch_dist
from torch.nn.parallel import DistributedDataParallel

from model import GPT, GPTConfig, compile_model
from prepare_data import DataError, DirLock, TokenLoader, check_split, eval_batches, load_meta, os_error_message

CKPT_FORMAT = "depthres-ckpt-2"
CKPT_KEYS = ("format", "model_config", "model", "tokenizer", "step", "train_config", "optimizer", "loader", "rng",
             "checksum")
RUN_FILES = ("config.json", "log.jsonl", "ckpt.pt", "summary.json", "wandb_id.txt")  # what a run directory holds
# model keys that change how the model computes, not what: a run may resume with other values
EXECUTION_KEYS = ("depth_impl", "depth_chunk", "activation_checkpointing")


class ConfigError(ValueError):
    """A bad config file, override or combination of keys."""


class CheckpointError(ValueError):
    """A checkpoint that is missing, unreadable, or does not fit the requested run."""


class DivergedError(RuntimeError):
    """Training produced a non-finite loss, gradient or weight."""


class RunDirError(RuntimeError):
    """A run directory that is in use, holds another run, or cannot be written (disk full, read-only)."""


USER_ERRORS = (ConfigError, CheckpointError, DataError, DivergedError, RunDirError)  # one `error:` line each


class Stopped(Exception):
    """The run stopped early on SIGINT or SIGTERM, after writing a checkpoint; exit status 128 + signum."""

    def __init__(self, signum, message):
        super().__init__(message)
        self.signum = signum


def key(default, help):
    return field(default=default, metadata={"help": help})


@dataclass
class TrainConfig:
    data_dir: str = key("data/shakespeare", "prepared data (prepare_data.py); its meta.json names the tokenizer")
    out_dir: str = key("runs", "runs live in out_dir/run_name")
    run_name: str = key("", "default: the config file's name")
    resume: str = key("", "true: continue the run directory's checkpoint; or a run directory or checkpoint file")
    overwrite: bool = key(False, "start afresh in a run directory that holds a run, deleting that run")
    seed: int = key(0, "model init, GPT(cfg, seed); also torch's global seed")
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
    log_interval: int = key(10, "steps between log lines")
    ckpt_interval: int = key(1000, "steps between checkpoints (and one at the end); 0: only at the end")
    device: str = key("auto", "auto (cuda if available) | cpu | cuda; with torchrun, rank r uses cuda:LOCAL_RANK")
    compile: bool = key(False, "torch.compile the model")
    wandb_log: bool = key(False, "log the config and every train/eval record to W&B (rank 0; pip install wandb)")
    wandb_project: str = key("depth-routing", "W&B project")
    wandb_run_name: str = key("", "W&B run name; default: run_name")
    wandb_group: str = key("", "W&B group (sweep.py: the sweep's name)")
    wandb_tags: str = key("", "comma-separated W&B tags (sweep.py: the variant and seed<s>)")

    def __post_init__(self):
        def need(ok, msg):
            if not ok:
                raise ConfigError(msg)

        for name in ("seed", "data_seed"):
            need(0 <= getattr(self, name) < 2**32, f"{name} must be in [0, 2**32), got {getattr(self, name)}")
        for name, typ in TRAIN_TYPES.items():
            if typ is float:
                need(math.isfinite(getattr(self, name)), f"{name} must be a finite number, got {getattr(self, name)}")
        for name in ("batch_tokens", "batch_size", "seq_len", "eval_interval", "eval_tokens", "log_interval"):
            need(getattr(self, name) >= 1, f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_steps", "max_tokens", "warmup_steps", "ckpt_interval", "weight_decay", "grad_clip"):
            need(getattr(self, name) >= 0, f"{name} must be >= 0, got {getattr(self, name)}")
        need(self.max_steps > 0 or self.max_tokens >= self.batch_tokens,
             f"set max_steps, or max_tokens of at least batch_tokens={self.batch_tokens} "
             f"(got max_tokens={self.max_tokens})")
        need(0 <= self.min_lr <= self.lr and self.lr > 0,
             f"need 0 <= min_lr <= lr and lr > 0, got min_lr={self.min_lr}, lr={self.lr}")
        need(self.eps >= 0, f"eps must be >= 0, got {self.eps}")
        need(self.eval_tokens >= self.seq_len, f"eval_tokens={self.eval_tokens} is less than one sequence of "
             f"seq_len={self.seq_len} tokens: set eval_tokens >= {self.seq_len}")
        need(self.lr_schedule in ("cosine", "wsd"), f"lr_schedule must be cosine or wsd, got {self.lr_schedule!r}")
        need(0 <= self.decay_frac <= 1, f"decay_frac must be in [0, 1], got {self.decay_frac}")
        need(0 <= self.beta1 < 1 and 0 <= self.beta2 < 1, f"betas must be in [0, 1), got {self.beta1}, {self.beta2}")
        need(self.device in ("auto", "cpu", "cuda"), f"device must be auto, cpu or cuda, got {self.device!r}")
        need(not (self.overwrite and self.resume.lower() in ("true", "1")),
             "resume=true continues the run that overwrite=true would delete: pass one of them")
        need(self.wandb_project and not set(self.wandb_project) & set("/\\#?%:"),
             f"wandb_project must be a non-empty name without / \\ # ? % :, got {self.wandb_project!r}")
        for tag in self.tags():
            need(len(tag) <= 64, f"wandb_tags: a W&B tag is at most 64 characters, got {tag!r}")

    def tags(self):
        return [t.strip() for t in self.wandb_tags.split(",") if t.strip()]


TRAIN_TYPES = typing.get_type_hints(TrainConfig)
MODEL_TYPES = typing.get_type_hints(GPTConfig)

# ----------------------------------------------------------------------------------------------
# Configuration: config file, then --key=value overrides, each value checked against its key's type.


def type_name(typ):
    return " | ".join("None" if t is type(None) else t.__name__ for t in typing.get_args(typ)) or typ.__name__


def convert(name, value, typ):
    """`value` (a command-line string or a config file's Python value) as type `typ`."""
    args = typing.get_args(typ)
    if type(None) in args:
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            return None
        (typ,) = [t for t in args if t is not type(None)]
    text = isinstance(value, str)
    if typ is str and text:
        return value
    if typ is bool:
        word = value.lower() if text else value
        if word in ("true", "1", 1):  # True == 1
            return True
        if word in ("false", "0", 0):
            return False
    if typ is float and not isinstance(value, bool):
        with suppress(TypeError, ValueError):
            return float(value)
    if typ is int and not isinstance(value, bool):
        if isinstance(value, int):
            return value
        with suppress(TypeError, ValueError):
            if text and value.strip().lstrip("+-").isdigit():
                return int(value)
            if float(value).is_integer():  # 1e5, 2.0
                return int(float(value))
    raise ConfigError(f"{name} expects {'true/false/1/0' if typ is bool else type_name(typ)}, got {value!r}")


def check_key(name, where):
    if name in TRAIN_TYPES or name in MODEL_TYPES:
        return name
    close = difflib.get_close_matches(name, [*TRAIN_TYPES, *MODEL_TYPES], n=3, cutoff=0.6)
    hint = f"; did you mean {' or '.join(close)}?" if close else ""
    raise ConfigError(f"unknown key {name!r} in {where}{hint} (python train.py --help lists every key)")


def read_config_file(path):
    """The keys a config file assigns (its names that are not private, modules, functions or classes)."""
    if not Path(path).is_file():
        raise ConfigError(f"config file {path} not found")
    names = runpy.run_path(str(path))
    return {k: v for k, v in names.items()
            if not k.startswith("_") and not isinstance(v, (types.ModuleType, types.FunctionType, type))}


def parse_config(argv):
    """argv = [CONFIG, --key=value, ...] -> (TrainConfig, the model keys that were set)."""
    if not argv or argv[0].startswith("-"):
        raise ConfigError("usage: python train.py CONFIG [--key=value ...]  (--help lists the keys)")
    path, overrides = argv[0], argv[1:]
    settings = {}
    for name, value in read_config_file(path).items():
        settings[check_key(name, path)] = value
    for arg in overrides:
        if not arg.startswith("--") or "=" not in arg:
            raise ConfigError(f"expected --key=value, got {arg!r}")
        name, value = arg[2:].split("=", 1)
        settings[check_key(name, "the command line")] = value
    settings = {k: convert(k, v, TRAIN_TYPES.get(k) or MODEL_TYPES[k]) for k, v in settings.items()}
    train = {k: v for k, v in settings.items() if k in TRAIN_TYPES}
    train["run_name"] = train.get("run_name") or Path(path).stem
    return TrainConfig(**train), {k: v for k, v in settings.items() if k in MODEL_TYPES}


def build_model_config(model_settings, tc, meta):
    """GPTConfig from the keys that were set; vocab_size defaults to the data's vocabulary padded to
    a multiple of 64, block_size to seq_len."""
    kv = {"vocab_size": 64 * math.ceil(meta["vocab_size"] / 64), "block_size": tc.seq_len, **model_settings}
    if kv["vocab_size"] < meta["vocab_size"]:
        raise ConfigError(f"vocab_size={kv['vocab_size']} is smaller than the {meta['tokenizer']} "
                          f"tokenizer's {meta['vocab_size']}")
    if kv["block_size"] < tc.seq_len:
        raise ConfigError(f"block_size={kv['block_size']} is shorter than seq_len={tc.seq_len}")
    try:
        return GPTConfig(**kv)
    except ValueError as e:
        raise ConfigError(f"model config: {e}") from None


def grad_accum_steps(tc, world_size):
    per_micro = tc.batch_size * tc.seq_len * world_size
    if tc.batch_tokens % per_micro:
        fit = max(1, round(tc.batch_tokens / per_micro)) * per_micro
        raise ConfigError(f"batch_tokens={tc.batch_tokens} is not a multiple of batch_size * seq_len * world_size "
                          f"= {tc.batch_size} * {tc.seq_len} * {world_size} = {per_micro} (e.g. batch_tokens={fit})")
    return tc.batch_tokens // per_micro


def total_steps(tc):
    return tc.max_steps or tc.max_tokens // tc.batch_tokens


def usage():
    lines = [__doc__.strip(), "", "training keys:"]
    lines += [f"  {f.name:<14} {type_name(TRAIN_TYPES[f.name]):<6} {f.default!r:<20} {f.metadata['help']}"
              for f in fields(TrainConfig)]
    lines += ["", "model keys (model.GPTConfig; vocab_size defaults to the data's, padded to a multiple of 64):"]
    lines += [f"  {f.name:<24} {type_name(MODEL_TYPES[f.name]):<11} {f.default!r}" for f in fields(GPTConfig)]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# Distributed setup, model and optimizer.


@dataclass
class Dist:
    rank: int
    world_size: int
    device: torch.device

    @property
    def master(self):
        return self.rank == 0


def setup_distributed(device):
    """Rank, world size and device from torchrun's environment (one process without it)."""
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if cuda and not torch.cuda.is_available():
        raise ConfigError("device=cuda, but CUDA is not available")
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:  # float32 matmuls stay float32 (no TF32): the depth routing and the loss are computed in float32
        torch.cuda.set_device(dev)
    if world_size > 1:
        torch_dist.init_process_group("nccl" if cuda else "gloo")
    return Dist(rank, world_size, dev)


def agreed(dist, fn):
    """fn() on this rank, its error shared: when fn raises one of USER_ERRORS on any rank, every rank
    raises the first such error, so all of them exit with the same line instead of waiting on the others."""
    try:
        result, error = fn(), None
    except USER_ERRORS as e:
        result, error = None, e
    if dist.world_size > 1:
        errors = [None] * dist.world_size
        torch_dist.all_gather_object(errors, error)
        error = next((e for e in errors if e is not None), None)
    if error is not None:
        raise error
    return result


def from_rank0(dist, obj):
    """Rank 0's `obj` on every rank."""
    if dist.world_size == 1:
        return obj
    box = [obj]
    torch_dist.broadcast_object_list(box, src=0)
    return box[0]


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # CUDA too


def build_optimizer(model, tc, device):
    return torch.optim.AdamW(model.param_groups(tc.weight_decay), lr=tc.lr, betas=(tc.beta1, tc.beta2),
                             eps=tc.eps, fused=device.type == "cuda")


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


# Dense bf16 tensor-core peak per GPU, matched against the words of torch.cuda.get_device_name();
# the first entry whose words all appear wins.
PEAK_BF16_FLOPS = (
    ({"H100", "PCIe"}, 756e12), ({"H100", "NVL"}, 835e12), ({"H100"}, 989e12),
    ({"H200", "NVL"}, 835e12), ({"H200"}, 989e12), ({"GH200"}, 989e12), ({"B200"}, 2250e12),
    ({"A100"}, 312e12), ({"L40S"}, 362e12), ({"L4"}, 121e12), ({"A10"}, 125e12),
)


def peak_flops(device):
    """The device's bf16 peak in FLOP/s, or None (CPU, or a GPU not in the table)."""
    if device.type != "cuda":
        return None
    words = set(re.split(r"[\s\-_]+", torch.cuda.get_device_name(device)))
    return next((peak for need, peak in PEAK_BF16_FLOPS if need <= words), None)


# ----------------------------------------------------------------------------------------------
# Training and evaluation.


class DeviceBatches:
    """The batches of a TokenLoader on the device, one micro-batch ahead: the next batch is read and
    its host-to-device copy issued (from pinned memory, asynchronously, on CUDA) before the current
    one is computed on. state_dict() is the loader's state after the batches handed out, not after
    the one read ahead, so a checkpoint resumes at the next batch training would have used."""

    def __init__(self, loader, device):
        self.loader, self.device = loader, device
        self.ahead = self._read()

    def _read(self):
        state = self.loader.state_dict()  # the state before this batch
        x, y = self.loader.next_batch()
        if self.device.type == "cuda":
            x, y = x.pin_memory(), y.pin_memory()
        return state, x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def next_batch(self):
        _, x, y = self.ahead
        self.ahead = self._read()
        return x, y

    def state_dict(self):
        return self.ahead[0]


class GracefulStop:
    """While active, the first SIGINT or SIGTERM asks the run to stop after the current optimizer step
    (train_loop writes a checkpoint, then raises Stopped); `signum` is that signal (None: none yet).
    A second SIGINT stops at once (KeyboardInterrupt); a second SIGTERM is ignored (torchrun forwards
    the signal it gets, so a worker may see one of each). Outside the main thread it does nothing."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, verbose=True):
        self.verbose, self.signum, self.previous = verbose, None, {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self.previous = {s: signal.signal(s, self.handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc):
        for s, handler in self.previous.items():
            signal.signal(s, handler)

    def handle(self, signum, frame):
        if self.signum is None:
            self.signum = signum
            if self.verbose:  # os.write: print() may be busy in the interrupted code
                os.write(2, f"\n{signal.Signals(signum).name}: stopping after this step, with a checkpoint "
                            "(Ctrl-C again to stop at once)\n".encode())
        elif signum == signal.SIGINT:
            raise KeyboardInterrupt


def train_step(model, optimizer, batches, lr, accum, grad_clip, dist, autocast, stop=None):
    """One optimizer step over `accum` micro-batches per rank. Returns (loss averaged over the whole
    batch, gradient norm before clipping, the signal number `stop` holds or 0), the same on every
    rank, read from the device in one synchronisation; the update is applied only when loss and
    norm are both finite."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    total = torch.zeros((), device=dist.device)
    for micro in range(accum):
        x, y = batches.next_batch()
        sync = dist.world_size == 1 or micro == accum - 1  # DDP all-reduces gradients on the last one only
        with nullcontext() if sync else model.no_sync():
            with autocast:
                _, loss = model(x, y)
            (loss / accum).backward()
        total += loss.detach()
    signum = torch.full((), float(stop.signum or 0) if stop else 0.0, device=dist.device)
    if dist.world_size > 1:
        torch_dist.all_reduce(total)
        torch_dist.all_reduce(signum, op=torch_dist.ReduceOp.MAX)  # a signal to any rank stops them all
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip or math.inf)
    total, norm, signum = torch.stack([total, norm.float(), signum]).tolist()  # the step's one sync
    loss = total / (accum * dist.world_size)
    if math.isfinite(loss) and math.isfinite(norm):
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss, norm, int(signum)


@torch.no_grad()
def evaluate(model, split, tc, dist, autocast):
    """Mean loss over the first eval_tokens tokens of a split, over all ranks. Returns (loss, tokens)."""
    sums = torch.zeros(2, dtype=torch.float64, device=dist.device)  # loss sum, token count
    for x, y in eval_batches(tc.data_dir, split, tc.batch_size, tc.seq_len, tc.eval_tokens, dist.rank, dist.world_size):
        x, y = x.to(dist.device), y.to(dist.device)
        with autocast:
            _, loss = model(x, y)
        sums[0] += loss.double() * y.numel()
        sums[1] += y.numel()
    if dist.world_size > 1:
        torch_dist.all_reduce(sums)
    loss_sum, tokens = sums.tolist()
    return loss_sum / tokens, int(tokens)


@contextmanager
def writing(path):
    """An OSError while writing `path` (disk full, read-only, no permission) becomes one RunDirError line."""
    try:
        yield
    except OSError as e:
        raise RunDirError(os_error_message(e, path)) from None


def write_file(path, data):
    """Write bytes atomically and durably: a temporary file, fsync, rename, fsync of the directory.
    A crash or a full disk leaves the old file or the new one, never part of one."""
    tmp = path.with_name(f".{path.name}.tmp")
    with writing(path):
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        sync_dir(path.parent)


def sync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class RunLog:
    """Log lines on stdout and JSON objects appended to log.jsonl, on rank 0 only; with a tracker (a
    W&B run), every record goes there too."""

    def __init__(self, path, enabled):
        self.path, self.enabled, self.tracker = path, enabled, None

    def __call__(self, line, record=None):
        """Print `line` (unless None) and append `record` (unless None)."""
        if not self.enabled:
            return
        if line is not None:
            print(line, flush=True)
        if record is not None:
            with writing(self.path), open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
            track(self.tracker, record)

    def finish(self, clean):
        if self.tracker is not None:
            self.tracker.finish(exit_code=0 if clean else 1)
            self.tracker = None


# ----------------------------------------------------------------------------------------------
# Weights & Biases (optional: imported only with wandb_log=true).


def require_wandb():
    try:
        import wandb  # noqa: F401
    except ImportError:
        raise ConfigError("wandb_log=true needs the wandb package, which is not installed: pip install wandb "
                          "(or drop wandb_log)") from None


def start_wandb(tc, run_dir, resolved, claim):
    """This run's W&B run, with the resolved config. A resumed run continues the W&B run of its run
    directory, whose id is kept in wandb_id.txt; a fresh one starts a new W&B run and writes its id."""
    import wandb
    id_file = run_dir / "wandb_id.txt"
    run_id = (id_file.read_text().strip() or None) if claim.continuing and id_file.exists() else None
    try:
        run = wandb.init(project=tc.wandb_project, name=tc.wandb_run_name or tc.run_name, id=run_id,
                         resume="allow" if run_id else None, group=tc.wandb_group or None, tags=tc.tags() or None)
        run.config.update(resolved, allow_val_change=True)  # a resume may change keys
    except Exception as e:  # not logged in, no network, a bad setting: wandb's first line
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConfigError(f"wandb_log=true, but W&B did not start: {reason} (wandb login, or WANDB_MODE=offline "
                          "to log locally)") from None
    if run_id is None:
        write_file(id_file, (run.id + "\n").encode())
        for line in claim.kept_log:  # a run that starts logging to W&B on resume: what it logged before, too
            track(run, json.loads(line))
    return run


def track(run, record):
    """A log.jsonl record into W&B at its step, keys under its kind: train/loss, val/loss, test/ppl, .."""
    if run is None:
        return
    kind = record.get("split", record["kind"])
    metrics = {f"{kind}/{k}": v for k, v in record.items()
               if k not in ("kind", "split", "step") and isinstance(v, (int, float))}
    if metrics:
        run.log(metrics, step=record["step"])


def read_log(path, last_step):
    """The lines of a log.jsonl whose step is at most `last_step`: what a run resumed from a
    checkpoint at that step keeps (what a killed run logged after its checkpoint is redone). A
    line that is not a JSON record (the torn last line of a kill or a full disk) is dropped, with
    a note."""
    if not path.exists():
        return []
    kept, torn = [], []
    with writing(path):
        lines = path.read_bytes().decode("utf-8", errors="replace").splitlines()
    for n, line in enumerate(lines, 1):
        try:
            step = json.loads(line)["step"]
        except (ValueError, TypeError, KeyError):
            if line.strip():
                torn.append(n)
            continue
        if step <= last_step:
            kept.append(line)
    if torn:
        print(f"note: {path}: dropped {len(torn)} unreadable line(s) ({', '.join(map(str, torn[:5]))}), "
              "as a kill or a full disk leaves them", file=sys.stderr)
    return kept


# ----------------------------------------------------------------------------------------------
# Checkpoints.


def rng_state(device):
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"python": random.getstate(), "numpy": (name, keys.tolist(), pos, has_gauss, gauss),
             "torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state, device):
    random.setstate(state["python"])
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def moved(x, device):
    """A checkpoint-like tree of dicts, lists and tuples with every tensor on `device`."""
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, dict):
        return {k: moved(v, device) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(moved(v, device) for v in x)
    return x


def checksum(state):
    """sha256 over a checkpoint's contents but "checksum": every tensor's dtype, shape and bytes and
    every other value's type and repr, in order. Tensors must be on the CPU."""
    h = hashlib.sha256()

    def walk(x):
        if isinstance(x, torch.Tensor):
            t = x.contiguous().reshape(-1)
            h.update(f"<tensor {t.dtype} {tuple(x.shape)}>".encode())
            h.update(t.view(torch.uint8).numpy())
        elif isinstance(x, dict):
            h.update(f"<dict {len(x)}>".encode())
            for k, v in x.items():
                walk(k)
                walk(v)
        elif isinstance(x, (list, tuple)):
            h.update(f"<{type(x).__name__} {len(x)}>".encode())
            for v in x:
                walk(v)
        else:
            h.update(f"<{type(x).__name__} {x!r}>".encode())

    walk({k: v for k, v in state.items() if k != "checksum"})
    return h.hexdigest()


class _RememberingWriter:
    """A file's write(), remembering the OSError it raised: torch.save reports one as a RuntimeError."""

    def __init__(self, f):
        self.f, self.error = f, None

    def write(self, data):
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = e
            raise

    def flush(self):
        self.f.flush()


def save_checkpoint(path, state):
    """Write atomically and durably: a temporary file in the same directory, fsync, then a rename over
    `path`. A kill or a full disk at any point leaves the previous checkpoint intact.

    The state is a dict with the keys CKPT_KEYS: "format" (CKPT_FORMAT), "model_config" (asdict of
    the GPTConfig), "model" (state_dict without wrapper prefixes), "tokenizer" (its name, for
    prepare_data.get_tokenizer), "step" (optimizer steps done), "train_config" (asdict of the
    TrainConfig), "optimizer", "loader" (TokenLoader.state_dict), "rng" (python, numpy, torch,
    cuda) and "checksum" (see checksum(); added here, verified by load_checkpoint). It holds only
    tensors and plain Python values, so torch.load(weights_only=True) reads it.
    """
    state = moved({k: v for k, v in state.items() if k != "checksum"}, "cpu")
    state["checksum"] = checksum(state)
    tmp = path.with_name(f".{path.name}.tmp")
    with writing(path):
        try:
            with open(tmp, "wb") as f:
                out = _RememberingWriter(f)
                try:
                    torch.save(state, out)
                except RuntimeError:
                    if out.error is not None:
                        raise out.error from None
                    raise
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        sync_dir(path.parent)


def load_checkpoint(path_or_run_dir, map_location="cpu"):
    """The checkpoint dict of a run directory (its ckpt.pt) or a checkpoint file, format and checksum checked."""
    path = Path(path_or_run_dir)
    if path.is_dir():
        path = path / "ckpt.pt"
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise CheckpointError(f"{path} is not a readable checkpoint (truncated or corrupt?): {reason}") from None
    if not isinstance(ckpt, dict) or "format" not in ckpt:
        raise CheckpointError(f"{path} is not a train.py checkpoint (no format tag)")
    if ckpt["format"] != CKPT_FORMAT:
        older = " (an older train.py's, without a checksum)" if ckpt["format"] == "depthres-ckpt-1" else ""
        raise CheckpointError(f"{path} has format {ckpt['format']!r}{older}; this train.py reads {CKPT_FORMAT!r}")
    missing = [k for k in CKPT_KEYS if k not in ckpt]
    if missing:
        raise CheckpointError(f"{path} lacks {', '.join(missing)}: it is incomplete")
    if checksum(ckpt) != ckpt["checksum"]:
        raise CheckpointError(f"{path} is corrupt: its contents do not match the checksum written with it "
                              "(damaged on disk or in a copy); use an intact copy or another checkpoint")
    return ckpt if map_location in (None, "cpu") else moved(ckpt, map_location)


def resume_path(tc, run_dir):
    """Where to resume from: None (a fresh run), this run's directory, or the given path."""
    if tc.resume.lower() in ("", "false", "0"):
        return None
    return run_dir if tc.resume.lower() in ("true", "1") else Path(tc.resume)


def check_resumable(ckpt, path, mc, tokenizer):
    """The checkpoint's model is this run's model (EXECUTION_KEYS may differ) on the same tokens."""
    # a key an older checkpoint lacks had its default then (keys are only ever added with the old behaviour)
    have = {**{f.name: f.default for f in fields(GPTConfig)}, **ckpt["model_config"]}
    want = asdict(mc)
    differ = [k for k in sorted(set(have) | set(want))
              if k not in EXECUTION_KEYS and have.get(k, "(absent)") != want.get(k, "(absent)")]
    if differ:
        detail = ", ".join(f"{k}: {have.get(k, '(absent)')!r} there, {want.get(k, '(absent)')!r} here" for k in differ)
        raise CheckpointError(f"checkpoint {path} holds another model ({detail}); resume with its config, "
                              f"or start a fresh run under another run_name")
    if ckpt["tokenizer"] != tokenizer:
        raise CheckpointError(f"checkpoint {path} was trained on {ckpt['tokenizer']!r} tokens, "
                              f"but data_dir holds {tokenizer!r} tokens")


def last_good(saved, good=True):
    """What is kept of the run: `saved` is (step, path) of its last checkpoint, or None."""
    if saved is None:
        return "no checkpoint was written"
    return f"the last {'good ' if good else ''}checkpoint (step {saved[0]}) is kept at {saved[1]}"


def diverged(loss, norm, step, saved):
    what = " and ".join(name for name, v in (("loss", loss), ("gradient norm", norm)) if not math.isfinite(v))
    return (f"non-finite {what} at step {step} (loss {loss}, gradient norm {norm}): training diverged and "
            f"stopped before this update; {last_good(saved)}. Try a lower lr or a longer warmup")


def weights_finite(model):
    return bool(torch.stack([torch.isfinite(p).all() for p in model.parameters()]).all())


# ----------------------------------------------------------------------------------------------
# The run.


def main(argv=None):
    """Train as the command line says. Returns a summary dict (rank 0's view)."""
    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:
        print(usage())
        return None
    tc, model_settings = parse_config(argv)
    meta = load_meta(tc.data_dir)
    mc = build_model_config(model_settings, tc, meta)
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    accum = grad_accum_steps(tc, world_size)
    if tc.warmup_steps > total_steps(tc) and int(os.environ.get("RANK", 0)) == 0:
        print(f"warning: warmup_steps={tc.warmup_steps} is more than the run's {total_steps(tc)} steps: the "
              f"learning rate ends its warmup at {lr_at(total_steps(tc) - 1, tc, total_steps(tc)):.3g}, "
              f"never reaching lr={tc.lr:g}", file=sys.stderr)
    run_dir = Path(tc.out_dir) / tc.run_name
    dist = setup_distributed(tc.device)
    claim = None
    try:
        # before any compute: wandb if asked, the data (one process per node reads it), the run directory (rank 0)
        if tc.wandb_log:
            agreed(dist, lambda: require_wandb() if dist.master else None)
        agreed(dist, lambda: check_data(tc, meta) if int(os.environ.get("LOCAL_RANK", 0)) == 0 else None)
        claim = agreed(dist, lambda: claim_run_dir(tc, run_dir, mc, meta["tokenizer"]) if dist.master else None)
        ckpt = from_rank0(dist, claim.ckpt if claim else None)  # only rank 0 reads out_dir
        summary = train_loop(tc, mc, meta, dist, accum, run_dir, ckpt, claim, argv[0])
        if dist.world_size > 1:
            torch_dist.barrier()  # every rank is done with the group before any rank takes it down
        return summary
    finally:
        if claim is not None:
            claim.lock.release()
        if dist.world_size > 1:
            # DDP's reducer sits in reference cycles; collect it while its process group still exists,
            # or its gloo threads are torn down at interpreter exit and abort the process
            gc.collect()
            torch_dist.destroy_process_group()


def check_data(tc, meta):
    """Open and read every split this run uses (train, val, and test when it has tokens) as the run
    will: a bad shard, an id outside the vocabulary or a split too short for seq_len is an error
    now, not at the first evaluation or after the last step."""
    for split in ["train", "val"] + (["test"] if meta["splits"].get("test", {}).get("tokens") else []):
        tokens = check_split(tc.data_dir, split)
        if split != "train" and tokens - 1 < tc.seq_len:
            raise DataError(f"split {split!r} of {tc.data_dir} has {tokens} tokens, too few for one evaluation "
                            f"sequence of seq_len + 1 = {tc.seq_len + 1}: use seq_len <= {tokens - 1}, or prepare "
                            f"the data with a larger --{split}_fraction")
    TokenLoader(tc.data_dir, "train", tc.batch_size, tc.seq_len, seed=tc.data_seed)  # a window of seq_len + 1


@dataclass
class Claim:
    """What rank 0 holds of the run directory: its lock, the checkpoint to start from (or None),
    whether that is this directory's own run (resume=true), and the log lines that run keeps."""
    lock: DirLock
    ckpt: dict | None
    continuing: bool
    kept_log: list


def claim_run_dir(tc, run_dir, mc, tokenizer):
    """Lock the run directory for this run's life and check what it holds against what this run
    would do with it; a Claim. Writes nothing in run_dir but its .lock."""
    source = resume_path(tc, run_dir)
    continuing = source is not None and source.resolve() in (run_dir.resolve(), (run_dir / "ckpt.pt").resolve())
    ckpt = None
    if source is not None and not continuing:  # a new run here, from another run's checkpoint
        ckpt = load_checkpoint(source)
        check_resumable(ckpt, source, mc, tokenizer)
    if continuing and not run_dir.is_dir():
        raise CheckpointError(f"no checkpoint at {run_dir / 'ckpt.pt'} (there is no run directory {run_dir})")
    with writing(run_dir):
        run_dir.mkdir(parents=True, exist_ok=True)
    lock = DirLock(run_dir, "run", RunDirError)
    try:
        if continuing:
            ckpt = load_checkpoint(source)
            check_resumable(ckpt, source, mc, tokenizer)
            return Claim(lock, ckpt, True, read_log(run_dir / "log.jsonl", ckpt["step"]))
        held = [name for name in RUN_FILES if (run_dir / name).exists()]
        if held and not tc.overwrite:
            ways = ("continue it with --resume=true, or start over with --overwrite=true"
                    if "ckpt.pt" in held and source is None else
                    "replace it with --overwrite=true, or choose another run_name")
            raise RunDirError(f"{run_dir} already holds a run ({', '.join(held)}): {ways}")
        return Claim(lock, ckpt, False, [])
    except BaseException:
        lock.release()
        raise


def build(tc, mc, dist, ckpt):
    """Model, optimizer and training loader, restored from `ckpt` when resuming; and the step."""
    seed_everything(tc.seed)
    raw_model = GPT(mc, seed=tc.seed).to(dist.device)
    optimizer = build_optimizer(raw_model, tc, dist.device)
    loader = TokenLoader(tc.data_dir, "train", tc.batch_size, tc.seq_len, dist.rank, dist.world_size, seed=tc.data_seed)
    if ckpt is None:
        return raw_model, optimizer, loader, 0
    raw_model.load_state_dict(ckpt["model"])
    optimizer.load_state_dict(ckpt["optimizer"])
    loader.load_state_dict(ckpt["loader"])
    set_rng_state(ckpt["rng"], dist.device)
    return raw_model, optimizer, loader, ckpt["step"]


# DDP's flag for broadcasting buffers before every forward (torch 2.13 renamed broadcast_buffers)
NO_BUFFER_SYNC = next(name for name in ("forward_sync_buffers", "broadcast_buffers")
                      if name in inspect.signature(DistributedDataParallel).parameters)


def wrap(raw_model, tc, dist):
    """(the model for evaluation: compiled if asked; the model for training: that one in DDP if distributed)"""
    model = compile_model(raw_model) if tc.compile else raw_model
    if dist.world_size == 1:
        return model, model
    # the model's only buffers are the constant rotary tables: nothing to broadcast before every forward
    return model, DistributedDataParallel(model, device_ids=[dist.device.index] if dist.device.type == "cuda" else None,
                                          **{NO_BUFFER_SYNC: False})


def start_log(tc, mc, meta, dist, raw_model, accum, run_dir, ckpt, claim, config_path):
    """Make the run directory this run's (rank 0): drop what this run replaces, write config.json and
    the log it keeps. Print what this run is and the loss to beat."""
    log = RunLog(run_dir / "log.jsonl", dist.master)
    resolved = {"config_file": config_path, "train": asdict(tc), "model": asdict(mc),
                "tokenizer": meta["tokenizer"], "world_size": dist.world_size, "grad_accum": accum,
                "max_steps": total_steps(tc)}
    if dist.master:
        for name in ("summary.json",) if claim.continuing else ("summary.json", "ckpt.pt", "wandb_id.txt"):
            with writing(run_dir / name):
                (run_dir / name).unlink(missing_ok=True)
        write_file(run_dir / "config.json", (json.dumps(resolved, indent=2) + "\n").encode())
        write_file(run_dir / "log.jsonl", "".join(line + "\n" for line in claim.kept_log).encode())
    if tc.wandb_log:  # a failure to start W&B stops every rank, before step 1
        log.tracker = agreed(dist, lambda: start_wandb(tc, run_dir, resolved, claim) if dist.master else None)
    log(textwrap.fill(" ".join(f"{k}={v}" for k, v in {**asdict(tc), **asdict(mc)}.items()), 110,
                      initial_indent="config: ", subsequent_indent="        "))
    log(f"{mc.residual}: {raw_model.num_params() / 1e6:.2f}M parameters, "
        f"{raw_model.flops_per_token() / 1e6:.1f} MFLOP/token | {meta['tokenizer']} tokens, "
        f"{dist.world_size} x {dist.device.type} | {total_steps(tc)} steps of {tc.batch_tokens} tokens "
        f"({accum} micro-steps of {tc.batch_size}x{tc.seq_len} per rank) | run dir {run_dir}")
    baseline = meta.get("unigram_baseline_nats")
    if baseline is not None:
        log(f"unigram baseline (val): {baseline:.4f} nats/token, perplexity {math.exp(baseline):.1f}: the loss to beat")
    if ckpt is not None:
        changed = [f"{k} {v!r} -> {getattr(tc, k)!r}" for k, v in ckpt["train_config"].items()
                   if k not in ("resume", "overwrite") and getattr(tc, k, v) != v]
        changed += [f"{k} {ckpt['model_config'][k]!r} -> {getattr(mc, k)!r} (execution only)" for k in EXECUTION_KEYS
                    if k in ckpt["model_config"] and ckpt["model_config"][k] != getattr(mc, k)]
        log(f"resumed at step {ckpt['step']} from {resume_path(tc, run_dir)}"
            + (f"; changed: {', '.join(changed)}" if changed else ""))
    return log


def hms(seconds):
    s = round(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class Progress:
    """How far a run is: its step out of max_steps, the seconds since this process started training,
    and an ETA: the mean wall time per step since the end of the first step (which holds compilation
    and warm-up; evaluations and checkpoints are averaged in), times the steps left."""

    def __init__(self, step, max_steps, clock=time.perf_counter):
        self.max_steps, self.clock, self.start = max_steps, clock, clock()
        self.marks = [(step, self.start)]  # (step, time): at the start, then after the first step

    def stepped(self, step):
        if len(self.marks) == 1:
            self.marks.append((step, self.clock()))

    def elapsed(self):
        return self.clock() - self.start

    def eta(self, step):
        first, t = self.marks[-1] if self.marks[-1][0] < step else self.marks[0]
        return (self.clock() - t) / (step - first) * (self.max_steps - step)

    def at(self, step):
        return f"step {step:>{len(str(self.max_steps))}}/{self.max_steps}"


def log_eval(log, split, step, loss, tokens, progress):
    elapsed = progress.elapsed()
    log(f"{progress.at(step)} | {split} loss {loss:.4f} | ppl {math.exp(loss):.1f} | {tokens:,} tokens | "
        f"{hms(elapsed)} elapsed",
        {"kind": "eval", "split": split, "step": step, "loss": loss, "ppl": math.exp(loss), "tokens": tokens,
         "elapsed_s": elapsed})


def log_train(log, step, loss, lr, norm, seconds, steps, tc, mfu_per_token_s, progress):
    """One line and record for the `steps` steps that took `seconds` since the previous one; returns tokens/s."""
    tok_s, ms = tc.batch_tokens * steps / seconds, 1000 * seconds / steps
    elapsed, eta = progress.elapsed(), progress.eta(step)
    record = {"kind": "train", "step": step, "loss": loss, "lr": lr, "grad_norm": norm,
              "tokens_per_s": tok_s, "ms_per_step": ms, "elapsed_s": elapsed, "eta_s": eta}
    line = (f"{progress.at(step)} ({100 * step / progress.max_steps:.1f}%) | loss {loss:.4f} | lr {lr:.2e} | "
            f"norm {norm:.2f} | {tok_s:,.0f} tok/s | {ms:.0f} ms/step")
    if mfu_per_token_s is not None:
        record["mfu"] = mfu_per_token_s * tok_s
        line += f" | MFU {100 * record['mfu']:.1f}%"
    log(line + f" | {hms(elapsed)} elapsed, ETA {hms(eta)}", record)
    return tok_s


def train_loop(tc, mc, meta, dist, accum, run_dir, ckpt, claim, config_path):
    """The training loop, evaluations and checkpoints of one run; returns its summary."""
    raw_model, optimizer, loader, step = build(tc, mc, dist, ckpt)
    batches = DeviceBatches(loader, dist.device)
    model, train_model = wrap(raw_model, tc, dist)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if dist.device.type == "cuda" else nullcontext()
    log = start_log(tc, mc, meta, dist, raw_model, accum, run_dir, ckpt, claim, config_path)
    peak = peak_flops(dist.device)
    mfu_per_token_s = raw_model.flops_per_token() / (peak * dist.world_size) if peak else None
    max_steps, ckpt_path = total_steps(tc), run_dir / "ckpt.pt"
    source = resume_path(tc, run_dir)
    saved = None  # (step, path) of the last checkpoint
    if ckpt is not None:
        saved = (step, source / "ckpt.pt" if source.is_dir() else source)

    def save():
        save_checkpoint(ckpt_path, {
            "format": CKPT_FORMAT, "model_config": asdict(mc), "model": raw_model.state_dict(),
            "tokenizer": meta["tokenizer"], "step": step, "train_config": asdict(tc),
            "optimizer": optimizer.state_dict(), "loader": batches.state_dict(), "rng": rng_state(dist.device)})

    val_loss, seconds, steps, speeds = None, 0.0, 0, []
    progress, clean = Progress(step, max_steps), False  # clean: finished, or stopped by a signal with a checkpoint
    try:
        with GracefulStop(verbose=dist.master) as stop:
            while step < max_steps:
                lr = lr_at(step, tc, max_steps)
                t0 = time.perf_counter()
                loss, norm, signum = train_step(train_model, optimizer, batches, lr, accum, tc.grad_clip, dist,
                                                autocast, stop)
                seconds, steps, step = seconds + time.perf_counter() - t0, steps + 1, step + 1
                progress.stepped(step)
                if not (math.isfinite(loss) and math.isfinite(norm)):
                    raise DivergedError(diverged(loss, norm, step, saved))
                if step % tc.log_interval == 0 or step == max_steps:
                    speeds.append(log_train(log, step, loss, lr, norm, seconds, steps, tc, mfu_per_token_s, progress))
                    seconds, steps = 0.0, 0
                if step % tc.eval_interval == 0 or step == max_steps:
                    val_loss, tokens = evaluate(model, "val", tc, dist, autocast)
                    log_eval(log, "val", step, val_loss, tokens, progress)
                stopping = signum and step < max_steps
                if (tc.ckpt_interval and step % tc.ckpt_interval == 0) or step == max_steps or stopping:
                    if not weights_finite(raw_model):
                        raise DivergedError(f"non-finite weights after step {step}; {last_good(saved)}")
                    agreed(dist, lambda: save() if dist.master else None)  # a failed write stops every rank
                    saved = (step, ckpt_path)
                if stopping:
                    name = signal.Signals(signum).name
                    log(None, {"kind": "stop", "step": step, "signal": name})
                    clean = True
                    raise Stopped(signum, f"stopped by {name} after step {step}; checkpoint written to {ckpt_path}; "
                                          "resume with --resume=true")

        if val_loss is None:  # resumed at the last step: nothing to train, evaluate anyway
            val_loss, tokens = evaluate(model, "val", tc, dist, autocast)
            log_eval(log, "val", step, val_loss, tokens, progress)
        test_loss = None
        if meta["splits"].get("test", {}).get("tokens"):
            test_loss, tokens = evaluate(model, "test", tc, dist, autocast)
            log_eval(log, "test", step, test_loss, tokens, progress)
        cuda = dist.device.type == "cuda"
        summary = {"run_dir": str(run_dir), "step": step, "val_loss": val_loss, "test_loss": test_loss,
                   "params": raw_model.num_params(),
                   "unigram_baseline": meta.get("unigram_baseline_nats"), "seconds": progress.elapsed(),
                   "tokens_per_s": statistics.median(speeds) if speeds else None,  # median over log intervals
                   # CUDA: peak allocated; CPU: the process' peak resident set (the whole run's, one process)
                   "peak_memory_bytes": torch.cuda.max_memory_allocated(dist.device) if cuda else
                   resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
        if dist.master:
            write_file(run_dir / "summary.json", (json.dumps(summary, indent=2) + "\n").encode())
        log("done: " + ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in summary.items()))
        clean = True
    except RunDirError as e:  # a write failed: say what is kept
        raise RunDirError(f"{e}; {last_good(saved, good=False)}") from None
    finally:
        log.finish(clean)  # the W&B run, if any: exit code 0, or 1 (failed)
    return summary


def cli(argv=None):
    """The command line. Exit status: 0 done; 1 with one `error:` line (bad input, a failed write,
    divergence); 128 + signal number after a stop on SIGINT (130) or SIGTERM (143)."""
    try:
        main(argv)
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except Stopped as e:
        if int(os.environ.get("RANK", 0)) == 0:
            print(e, file=sys.stderr)
        return 128 + e.signum
    except KeyboardInterrupt:
        print("interrupted; the last checkpoint, if any, is kept (--resume=true continues from it)", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(cli())
