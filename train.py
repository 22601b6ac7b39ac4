"""
Train a GPT with a depth-routing residual, on CPU, one GPU, or many through torchrun (DDP).

    python train.py configs/demo.py                                  # CPU or one GPU
    python train.py configs/demo.py --residual=standard --lr=2e-3    # any key can be overridden
    torchrun --standalone --nproc_per_node=8 train.py configs/rd_s.py
    python train.py configs/demo.py --resume=true                    # continue runs/demo exactly
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
finished, summary.json (final val and test loss, median tokens/s, peak memory).
"""

import difflib
import gc
import json
import math
import os
import random
import re
import resource
import runpy
import statistics
import sys
import textwrap
import time
import types
import typing
from contextlib import nullcontext, suppress
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np
import torch
import torch.distributed as torch_dist
from torch.nn.parallel import DistributedDataParallel

from model import GPT, GPTConfig, compile_model
from prepare_data import DataError, TokenLoader, eval_batches, load_meta

CKPT_FORMAT = "depthres-ckpt-1"
CKPT_KEYS = ("format", "model_config", "model", "tokenizer", "step", "train_config", "optimizer", "loader", "rng")


class ConfigError(ValueError):
    """A bad config file, override or combination of keys."""


class CheckpointError(ValueError):
    """A checkpoint that is missing, unreadable, or does not fit the requested run."""


class DivergedError(RuntimeError):
    """Training produced a non-finite loss, gradient or weight."""


def key(default, help):
    return field(default=default, metadata={"help": help})


@dataclass
class TrainConfig:
    data_dir: str = key("data/shakespeare", "prepared data (prepare_data.py); its meta.json names the tokenizer")
    out_dir: str = key("runs", "runs live in out_dir/run_name")
    run_name: str = key("", "default: the config file's name")
    resume: str = key("", "true: continue the run directory's checkpoint; or a run directory or checkpoint file")
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

    def __post_init__(self):
        def need(ok, msg):
            if not ok:
                raise ConfigError(msg)

        for name in ("batch_tokens", "batch_size", "seq_len", "eval_interval", "eval_tokens", "log_interval"):
            need(getattr(self, name) >= 1, f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_steps", "max_tokens", "warmup_steps", "ckpt_interval", "weight_decay", "grad_clip"):
            need(getattr(self, name) >= 0, f"{name} must be >= 0, got {getattr(self, name)}")
        need(self.max_steps > 0 or self.max_tokens >= self.batch_tokens,
             f"set max_steps, or max_tokens of at least batch_tokens={self.batch_tokens} "
             f"(got max_tokens={self.max_tokens})")
        need(0 <= self.min_lr <= self.lr, f"need 0 <= min_lr <= lr, got min_lr={self.min_lr}, lr={self.lr}")
        need(self.lr_schedule in ("cosine", "wsd"), f"lr_schedule must be cosine or wsd, got {self.lr_schedule!r}")
        need(0 <= self.decay_frac <= 1, f"decay_frac must be in [0, 1], got {self.decay_frac}")
        need(0 <= self.beta1 < 1 and 0 <= self.beta2 < 1, f"betas must be in [0, 1), got {self.beta1}, {self.beta2}")
        need(self.device in ("auto", "cpu", "cuda"), f"device must be auto, cpu or cuda, got {self.device!r}")


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
    lines += [f"  {f.name:<20} {type_name(MODEL_TYPES[f.name]):<11} {f.default!r}" for f in fields(GPTConfig)]
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
    if cuda:
        torch.cuda.set_device(dev)
        torch.set_float32_matmul_precision("high")
    if world_size > 1:
        torch_dist.init_process_group("nccl" if cuda else "gloo")
    return Dist(rank, world_size, dev)


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


def train_step(model, optimizer, loader, lr, accum, grad_clip, dist, autocast):
    """One optimizer step over `accum` micro-batches per rank. Returns (loss averaged over the whole
    batch, gradient norm before clipping); the update is applied only when both are finite."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    total = torch.zeros((), device=dist.device)
    for micro in range(accum):
        x, y = (t.to(dist.device, non_blocking=True) for t in loader.next_batch())
        sync = dist.world_size == 1 or micro == accum - 1  # DDP all-reduces gradients on the last one only
        with nullcontext() if sync else model.no_sync():
            with autocast:
                _, loss = model(x, y)
            (loss / accum).backward()
        total += loss.detach()
    if dist.world_size > 1:
        torch_dist.all_reduce(total)
    loss = total.item() / (accum * dist.world_size)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip or math.inf).item()
    if math.isfinite(loss) and math.isfinite(norm):
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss, norm


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
    return (sums[0] / sums[1]).item(), int(sums[1].item())


class RunLog:
    """Log lines on stdout and JSON objects in log.jsonl, on rank 0 only."""

    def __init__(self, path, enabled, resume_step=None):
        self.path, self.enabled = path, enabled
        if not enabled:
            return
        kept = []
        if resume_step is not None and path.exists():  # drop what a killed run logged after its checkpoint
            kept = [line for line in path.read_text().splitlines() if json.loads(line)["step"] <= resume_step]
        path.write_text("".join(line + "\n" for line in kept))

    def __call__(self, line, record=None):
        if not self.enabled:
            return
        print(line, flush=True)
        if record is not None:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")


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


def save_checkpoint(path, state):
    """Write atomically: a temporary file in the same directory, then a rename over `path`.

    The state is a dict with the keys CKPT_KEYS: "format" (CKPT_FORMAT), "model_config" (asdict of
    the GPTConfig), "model" (state_dict without wrapper prefixes), "tokenizer" (its name, for
    prepare_data.get_tokenizer), "step" (optimizer steps done), "train_config" (asdict of the
    TrainConfig), "optimizer", "loader" (TokenLoader.state_dict) and "rng" (python, numpy, torch,
    cuda). It holds only tensors and plain Python values, so torch.load(weights_only=True) reads it.
    """
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def load_checkpoint(path_or_run_dir, map_location="cpu"):
    """The checkpoint dict of a run directory (its ckpt.pt) or a checkpoint file, format checked."""
    path = Path(path_or_run_dir)
    if path.is_dir():
        path = path / "ckpt.pt"
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise CheckpointError(f"{path} is not a readable checkpoint (truncated or corrupt?): {reason}") from None
    if not isinstance(ckpt, dict) or "format" not in ckpt:
        raise CheckpointError(f"{path} is not a train.py checkpoint (no format tag)")
    if ckpt["format"] != CKPT_FORMAT:
        raise CheckpointError(f"{path} has format {ckpt['format']!r}; this train.py reads {CKPT_FORMAT!r}")
    missing = [k for k in CKPT_KEYS if k not in ckpt]
    if missing:
        raise CheckpointError(f"{path} lacks {', '.join(missing)}: it is incomplete")
    return ckpt


def resume_path(tc, run_dir):
    """Where to resume from: None (a fresh run), this run's directory, or the given path."""
    if tc.resume.lower() in ("", "false", "0"):
        return None
    return run_dir if tc.resume.lower() in ("true", "1") else Path(tc.resume)


def check_resumable(ckpt, path, mc, tokenizer):
    have, want = ckpt["model_config"], asdict(mc)
    differ = [k for k in sorted(set(have) | set(want)) if have.get(k, "(absent)") != want.get(k, "(absent)")]
    if differ:
        detail = ", ".join(f"{k}: {have.get(k, '(absent)')!r} there, {want.get(k, '(absent)')!r} here" for k in differ)
        raise CheckpointError(f"checkpoint {path} holds another model ({detail}); resume with its config, "
                              f"or start a fresh run under another run_name")
    if ckpt["tokenizer"] != tokenizer:
        raise CheckpointError(f"checkpoint {path} was trained on {ckpt['tokenizer']!r} tokens, "
                              f"but data_dir holds {tokenizer!r} tokens")


def last_good(saved_step, path):
    if saved_step is None:
        return "no checkpoint was written"
    return f"the last good checkpoint (step {saved_step}) is kept at {path}"


def weights_finite(model):
    return all(torch.isfinite(p).all() for p in model.parameters())


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
    run_dir = Path(tc.out_dir) / tc.run_name
    source = resume_path(tc, run_dir)
    ckpt = None
    if source is not None:
        ckpt = load_checkpoint(source)
        check_resumable(ckpt, source, mc, meta["tokenizer"])
    dist = setup_distributed(tc.device)
    try:
        summary = train_loop(tc, mc, meta, dist, accum, run_dir, ckpt, argv[0])
        if dist.world_size > 1:
            torch_dist.barrier()  # every rank is done with the group before any rank takes it down
        return summary
    finally:
        if dist.world_size > 1:
            # DDP's reducer sits in reference cycles; collect it while its process group still exists,
            # or its gloo threads are torn down at interpreter exit and abort the process
            gc.collect()
            torch_dist.destroy_process_group()


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


def wrap(raw_model, tc, dist):
    """(the model for evaluation: compiled if asked; the model for training: that one in DDP if distributed)"""
    model = compile_model(raw_model) if tc.compile else raw_model
    if dist.world_size == 1:
        return model, model
    return model, DistributedDataParallel(model, device_ids=[dist.device.index] if dist.device.type == "cuda" else None)


def start_log(tc, mc, meta, dist, raw_model, accum, run_dir, ckpt, config_path):
    """Create the run directory with config.json; print what this run is and the loss to beat."""
    if dist.master:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "summary.json").unlink(missing_ok=True)  # written when this run finishes
        resolved = {"config_file": config_path, "train": asdict(tc), "model": asdict(mc),
                    "tokenizer": meta["tokenizer"], "world_size": dist.world_size, "grad_accum": accum,
                    "max_steps": total_steps(tc)}
        (run_dir / "config.json").write_text(json.dumps(resolved, indent=2) + "\n")
    log = RunLog(run_dir / "log.jsonl", dist.master, ckpt["step"] if ckpt is not None else None)
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
                   if k != "resume" and getattr(tc, k, v) != v]
        log(f"resumed at step {ckpt['step']} from {resume_path(tc, run_dir)}"
            + (f"; changed: {', '.join(changed)}" if changed else ""))
    elif (run_dir / "ckpt.pt").exists():
        log(f"note: a fresh run; it will replace {run_dir / 'ckpt.pt'} (--resume=true would continue that one)")
    return log


def log_eval(log, split, step, loss, tokens):
    log(f"step {step:>6} | {split} loss {loss:.4f} | ppl {math.exp(loss):.1f} | {tokens:,} tokens",
        {"kind": "eval", "split": split, "step": step, "loss": loss, "ppl": math.exp(loss), "tokens": tokens})


def log_train(log, step, loss, lr, norm, seconds, steps, tc, mfu_per_token_s):
    """One line and record for the `steps` steps that took `seconds` since the previous one; returns tokens/s."""
    tok_s, ms = tc.batch_tokens * steps / seconds, 1000 * seconds / steps
    record = {"kind": "train", "step": step, "loss": loss, "lr": lr, "grad_norm": norm,
              "tokens_per_s": tok_s, "ms_per_step": ms}
    line = f"step {step:>6} | loss {loss:.4f} | lr {lr:.2e} | norm {norm:.2f} | {tok_s:,.0f} tok/s | {ms:.0f} ms/step"
    if mfu_per_token_s is not None:
        record["mfu"] = mfu_per_token_s * tok_s
        line += f" | MFU {100 * record['mfu']:.1f}%"
    log(line, record)
    return tok_s


def train_loop(tc, mc, meta, dist, accum, run_dir, ckpt, config_path):
    """The training loop, evaluations and checkpoints of one run; returns its summary."""
    raw_model, optimizer, loader, step = build(tc, mc, dist, ckpt)
    model, train_model = wrap(raw_model, tc, dist)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if dist.device.type == "cuda" else nullcontext()
    log = start_log(tc, mc, meta, dist, raw_model, accum, run_dir, ckpt, config_path)
    peak = peak_flops(dist.device)
    mfu_per_token_s = raw_model.flops_per_token() / (peak * dist.world_size) if peak else None
    max_steps, ckpt_path = total_steps(tc), run_dir / "ckpt.pt"
    saved_step = step if ckpt is not None else None
    val_loss, seconds, steps, speeds, t_start = None, 0.0, 0, [], time.time()
    while step < max_steps:
        lr = lr_at(step, tc, max_steps)
        t0 = time.perf_counter()
        loss, norm = train_step(train_model, optimizer, loader, lr, accum, tc.grad_clip, dist, autocast)
        seconds, steps, step = seconds + time.perf_counter() - t0, steps + 1, step + 1
        if not (math.isfinite(loss) and math.isfinite(norm)):
            raise DivergedError(f"non-finite loss {loss} (gradient norm {norm}) at step {step}: training diverged and "
                                f"stopped before this update; {last_good(saved_step, ckpt_path)}. "
                                "Try a lower lr or a longer warmup")
        if step % tc.log_interval == 0 or step == max_steps:
            speeds.append(log_train(log, step, loss, lr, norm, seconds, steps, tc, mfu_per_token_s))
            seconds, steps = 0.0, 0
        if step % tc.eval_interval == 0 or step == max_steps:
            val_loss, tokens = evaluate(model, "val", tc, dist, autocast)
            log_eval(log, "val", step, val_loss, tokens)
        if (tc.ckpt_interval and step % tc.ckpt_interval == 0) or step == max_steps:
            if not weights_finite(raw_model):
                raise DivergedError(f"non-finite weights after step {step}; {last_good(saved_step, ckpt_path)}")
            if dist.master:
                save_checkpoint(ckpt_path, {
                    "format": CKPT_FORMAT, "model_config": asdict(mc), "model": raw_model.state_dict(),
                    "tokenizer": meta["tokenizer"], "step": step, "train_config": asdict(tc),
                    "optimizer": optimizer.state_dict(), "loader": loader.state_dict(), "rng": rng_state(dist.device)})
            saved_step = step

    if val_loss is None:  # resumed at the last step: nothing to train, evaluate anyway
        val_loss, tokens = evaluate(model, "val", tc, dist, autocast)
        log_eval(log, "val", step, val_loss, tokens)
    test_loss = None
    if meta["splits"].get("test", {}).get("tokens"):
        test_loss, tokens = evaluate(model, "test", tc, dist, autocast)
        log_eval(log, "test", step, test_loss, tokens)
    cuda = dist.device.type == "cuda"
    summary = {"run_dir": str(run_dir), "step": step, "val_loss": val_loss, "test_loss": test_loss,
               "unigram_baseline": meta.get("unigram_baseline_nats"), "seconds": time.time() - t_start,
               "tokens_per_s": statistics.median(speeds) if speeds else None,  # median over log intervals
               # CUDA: peak allocated; CPU: the process' peak resident set (the whole run's, one process)
               "peak_memory_bytes": torch.cuda.max_memory_allocated(dist.device) if cuda else
               resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    if dist.master:
        tmp = run_dir / ".summary.json.tmp"
        tmp.write_text(json.dumps(summary, indent=2) + "\n")
        os.replace(tmp, run_dir / "summary.json")
    log("done: " + ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in summary.items()))
    return summary


if __name__ == "__main__":
    try:
        main()
    except (ConfigError, CheckpointError, DataError, DivergedError) as e:
        sys.exit(f"error: {e}")
