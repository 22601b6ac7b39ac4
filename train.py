"""
Train a GPT with a depth-routing residual, on CPU, one GPU, or many through torchrun (DDP).

    python train.py configs/demo.py                                  # CPU or one GPU
    python train.py configs/demo.py --residual=standard --lr=2e-3    # any key can be overridden
    torchrun --standalone --nproc_per_node=8 train.py configs/rd_s.py
    python train.py configs/demo.py --resume=true                    # continue runs/demo exactly
    python train.py configs/demo.py --overwrite=true                 # start runs/demo over
    python train.py --help                                           # every key, its type and default

A config is a Python file that assigns keys (`residual = "block_attnres"`); `--key=value` overrides
it. The keys are depthres.config.TrainConfig's fields and model.GPTConfig's; --help lists them all.
Batch: batch_tokens tokens per optimizer step, in micro-batches of batch_size x seq_len per rank,
accumulated over batch_tokens / (batch_size * seq_len * world_size) micro-steps.
Pairing (VARIANTS.md section 8): `seed` fixes the initial weights, `data_seed` the order of the
batches, so runs that differ only in `residual` start from the same shared weights and see the same
batches, whatever their number of ranks.
The run directory out_dir/run_name (depthres/checkpoint.py) receives config.json (the resolved config),
log.jsonl (depthres/runlog.py: one JSON record per logged step and per evaluation), ckpt.pt and, once the
run has finished, summary.json (final val and test loss, median tokens/s, peak memory); a run that
starts or continues drops the summary.json and scores.json (tools/rescore.py) of what it replaces. A fresh
run refuses a directory that holds another run unless overwrite=true. The first SIGINT or SIGTERM
stops the run after the current step, with a checkpoint.
"""

import gc
import json
import math
import os
import random
import signal
import statistics
import sys
import textwrap
import threading
import time
from contextlib import nullcontext, suppress
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as torch_dist

from depthres.checkpoint import (
    CKPT_FORMAT,
    EXECUTION_KEYS,
    IDENTITY_KEYS,
    RunDirError,
    claim_run_dir,
    last_good,
    resume_path,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from depthres.config import (
    TrainConfig,
    build_model_config,
    check_memory,
    grad_accum_steps,
    parse_config,
    total_steps,
    usage,
)
from depthres.distributed import (
    SHARED_ERRORS,
    Dist,
    agreed,
    any_rank,
    ddp,
    from_rank0,
    full_state,
    gradient_sync,
    launch_env,
    load_optimizer_state,
    local,
    map_large_allocations,
    peak_memory,
    setup_distributed,
    state_bytes,
    whole,
)
from depthres.files import write_file, writing
from depthres.runlog import Progress, RunLog, log_eval, log_train, peak_flops, require_wandb, start_wandb
from depthres.sharded import load_sharded, remove_sharded, save_sharded, sharded_model
from depthres.shards import DataError, TokenLoader, check_split, eval_batches, load_meta
from model import GPT, GPTConfig, compile_model


class DivergedError(RuntimeError):
    """Training produced a non-finite loss, gradient or weight."""


class CompileError(RuntimeError):
    """compile=true, and torch.compile failed (no working C++ compiler, say)."""


USER_ERRORS = (*SHARED_ERRORS, DivergedError, CompileError)  # one `error:` line each


class Stopped(Exception):
    """The run stopped early on SIGINT or SIGTERM, after writing a checkpoint; exit status 128 + signum."""

    def __init__(self, signum, message):
        super().__init__(message)
        self.signum = signum


@dataclass
class Run:
    """One run: what it was asked (tc, mc), its data (meta), its ranks (dist), its directory and the
    claim on it, the checkpoint it continues; train_loop fills in the rest as it builds it."""

    tc: TrainConfig
    mc: GPTConfig
    meta: dict
    dist: Dist
    run_dir: Path
    claim: object = None  # checkpoint.Claim on rank 0; None on the other ranks
    ckpt: dict | None = None  # the checkpoint resumed from
    config_path: str | None = None
    raw_model: GPT | None = None  # the parameters (sharded under FSDP)
    model: torch.nn.Module | None = None  # for evaluation: raw_model, compiled if asked
    train_model: torch.nn.Module | None = None  # for training: model, in DDP when distributed without FSDP
    optimizer: torch.optim.Optimizer | None = None
    batches: object = None  # DeviceBatches of the training split
    autocast: object = field(default_factory=nullcontext)
    log: object = None  # runlog.RunLog
    step: int = 0  # optimizer steps done
    saved: tuple | None = None  # (step, path) of the last checkpoint written or resumed from

    @property
    def accum(self):
        return grad_accum_steps(self.tc, self.dist.world_size)

    @property
    def max_steps(self):
        return total_steps(self.tc)

    @property
    def max_loss(self):
        return loss_limit(self.mc.vocab_size)

    @property
    def sharded(self):
        """FSDP: the model and optimizer are sharded, and so are the checkpoints (depthres/sharded.py)."""
        return self.tc.fsdp and self.dist.world_size > 1

    @property
    def ckpt_path(self):
        return self.run_dir / ("ckpt" if self.sharded else "ckpt.pt")


# ----------------------------------------------------------------------------------------------
# Model, optimizer, schedule.


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


def train_step(run, lr, stop=None):
    """One optimizer step over run.accum micro-batches per rank. Returns (loss averaged over the whole
    batch, gradient norm before clipping, the signal number `stop` holds or 0), the same on every
    rank, read from the device in one synchronisation; the update is applied only when the step is
    healthy (a finite loss of at most run.max_loss, a finite norm)."""
    model, optimizer, dist, accum = run.train_model, run.optimizer, run.dist, run.accum
    for group in optimizer.param_groups:
        group["lr"] = lr
    total = torch.zeros((), device=dist.device)
    for micro in range(accum):
        x, y = run.batches.next_batch()
        with gradient_sync(model, micro == accum - 1):  # gradients are all-reduced on the last one only
            with run.autocast:
                _, loss = model(x, y)
            (loss / accum).backward()
        total += loss.detach()
    signum = torch.full((), float(stop.signum or 0) if stop else 0.0, device=dist.device)
    if dist.world_size > 1:
        torch_dist.all_reduce(total)
        torch_dist.all_reduce(signum, op=torch_dist.ReduceOp.MAX)  # a signal to any rank stops them all
    norm = whole(torch.nn.utils.clip_grad_norm_(model.parameters(), run.tc.grad_clip or math.inf))  # FSDP: all shards
    total, norm, signum = torch.stack([total, norm.float(), signum]).tolist()  # the step's one sync
    loss = total / (accum * dist.world_size)
    if healthy(loss, norm, run.max_loss):
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss, norm, int(signum)


@torch.no_grad()
def evaluate(model, split, tc, dist, autocast):
    """Mean loss over the first eval_tokens tokens of a split, over all ranks. Returns (loss, tokens).
    Under FSDP every forward gathers weights from all ranks, so every rank runs as many as the rank
    with the most batches (the split's windows need not divide evenly); the extra ones count nothing."""
    sums = torch.zeros(2, dtype=torch.float64, device=dist.device)  # loss sum, token count
    batches = eval_batches(tc.data_dir, split, tc.batch_size, tc.seq_len, tc.eval_tokens, dist.rank, dist.world_size)
    lockstep = tc.fsdp and dist.world_size > 1
    while True:
        batch = next(batches, None)
        if not (any_rank(dist, batch is not None) if lockstep else batch is not None):
            break
        x, y = batch or (torch.zeros(1, tc.seq_len, dtype=torch.long),) * 2  # idle: a forward, nothing counted
        x, y = x.to(dist.device), y.to(dist.device)
        with autocast:
            _, loss = model(x, y)
        if batch is not None:
            sums[0] += loss.double() * y.numel()
            sums[1] += y.numel()
    if dist.world_size > 1:
        torch_dist.all_reduce(sums)
    loss_sum, tokens = sums.tolist()
    return loss_sum / tokens, int(tokens)


def loss_limit(vocab_size):
    """The loss above which a run has diverged though finite: 4 times a uniform guess's ln(vocab)
    (every variant starts at ln(vocab); a perplexity of vocab^4 predicts nothing)."""
    return 4 * math.log(vocab_size)


def healthy(loss, norm, max_loss):
    return math.isfinite(loss) and loss <= max_loss and math.isfinite(norm)


def diverged(what, loss, norm, step, saved, max_loss):
    """The divergence error's line: `what` ("loss", "val loss") at `step` was non-finite or above max_loss."""
    if not (math.isfinite(loss) and math.isfinite(norm)):
        bad = " and ".join(name for name, v in ((what, loss), ("gradient norm", norm)) if not math.isfinite(v))
        reason = f"non-finite {bad} at step {step} ({what} {loss}, gradient norm {norm})"
    else:
        reason = (f"{what} {loss:.4g} at step {step} is above {max_loss:.1f} nats (4 ln(vocab), far worse than a "
                  f"uniform guess)")
    return (f"{reason}: training diverged and stopped before this {'update' if what == 'loss' else 'checkpoint'}; "
            f"{last_good(saved)}. Try a lower lr or a longer warmup")


def weights_finite(model, dist):
    """Whether every weight is finite, on every rank (each checks its shard, under FSDP)."""
    mine = all(bool(torch.isfinite(local(p)).all()) for p in model.parameters())
    return any_rank(dist, not mine) == 0


# ----------------------------------------------------------------------------------------------
# The run.


def build(tc, mc, dist, ckpt):
    """Model (sharded with fsdp=true), optimizer and training loader, restored from `ckpt` when
    resuming; and the step. FSDP builds the model on the meta device and gives each rank its shards
    (depthres/sharded.py): no rank holds the whole model. A whole checkpoint: each rank keeps its shard.
    A sharded checkpoint (ckpt["sharded"]): each rank reads its part, whatever the number of ranks."""
    seed_everything(tc.seed)
    whole = ckpt is not None and "sharded" not in ckpt
    if tc.fsdp and dist.world_size > 1:
        raw_model = sharded_model(mc, tc.seed, dist, ckpt["model"] if whole else None, init=ckpt is None)
    else:
        raw_model = GPT(mc, seed=tc.seed).to(dist.device)
        if whole:
            raw_model.load_state_dict(ckpt["model"])
    optimizer = build_optimizer(raw_model, tc, dist.device)  # over the (sharded) parameters
    loader = TokenLoader(tc.data_dir, "train", tc.batch_size, tc.seq_len, dist.rank, dist.world_size, seed=tc.data_seed)
    if ckpt is None:
        return raw_model, optimizer, loader, 0
    if whole:
        load_optimizer_state(optimizer, ckpt["optimizer"])
    else:
        load_sharded(ckpt["sharded"], raw_model, optimizer, dist)
    loader.load_state_dict(ckpt["loader"])
    set_rng_state(ckpt["rng"], dist.device)
    return raw_model, optimizer, loader, ckpt["step"]


def wrap(raw_model, tc, dist):
    """(the model for evaluation: compiled if asked; the model for training: that one in DDP when
    distributed without FSDP, which shards the model itself)"""
    model = compile_model(raw_model) if tc.compile else raw_model
    return model, ddp(model, dist) if dist.world_size > 1 and not tc.fsdp else model


def start_log(run):
    """Make the run directory this run's (rank 0): drop what this run replaces, write config.json and
    the log it keeps. Print what this run is and the loss to beat. Sets run.log."""
    tc, mc, meta, dist, run_dir, claim = run.tc, run.mc, run.meta, run.dist, run.run_dir, run.claim
    log = run.log = RunLog(run_dir / "log.jsonl", dist.master)
    resolved = {"config_file": run.config_path, "train": asdict(tc), "model": asdict(mc),
                "tokenizer": meta["tokenizer"], "world_size": dist.world_size, "grad_accum": run.accum,
                "max_steps": run.max_steps}
    if dist.master:
        dropped = ("summary.json", "scores.json") + (() if claim.continuing else ("ckpt.pt", "wandb_id.txt"))
        for name in dropped:
            with writing(run_dir / name, RunDirError):
                (run_dir / name).unlink(missing_ok=True)
        if not claim.continuing:
            remove_sharded(run_dir)
        write_file(run_dir / "config.json", (json.dumps(resolved, indent=2) + "\n").encode(), RunDirError)
        write_file(run_dir / "log.jsonl", "".join(line + "\n" for line in claim.kept_log).encode(), RunDirError)
    if tc.wandb_log:  # a failure to start W&B stops every rank, before step 1
        log.tracker = agreed(dist, lambda: start_wandb(tc, run_dir, resolved, claim) if dist.master else None)
    log(textwrap.fill(" ".join(f"{k}={v}" for k, v in {**asdict(tc), **asdict(mc)}.items()), 110,
                      initial_indent="config: ", subsequent_indent="        "))
    ranks = f"{dist.world_size} x {dist.device.type}" + (f" ({'FSDP' if tc.fsdp else 'DDP'})" if dist.world_size > 1 else "")
    log(f"{mc.residual}: {run.raw_model.num_params() / 1e6:.2f}M parameters, "
        f"{run.raw_model.flops_per_token() / 1e6:.1f} MFLOP/token | {meta['tokenizer']} tokens, {ranks} | "
        f"{run.max_steps} steps of {tc.batch_tokens} tokens ({run.accum} micro-steps of {tc.batch_size}x{tc.seq_len} "
        f"per rank) | run dir {run_dir}")
    baseline = meta.get("unigram_baseline_nats")
    if baseline is not None:
        log(f"unigram baseline (val): {baseline:.4f} nats/token, perplexity {math.exp(baseline):.1f}: the loss to beat")
    if run.ckpt is not None:
        changed = resume_changes(run.ckpt, tc, mc, dist.world_size)
        text = [f"{k} {old!r} -> {new!r}" + (f" ({EXECUTION_KEYS[k]})" if k in EXECUTION_KEYS else "")
                for k, (old, new) in changed.items()]
        source = resume_path(tc, run_dir)
        # the record keeps what changed at which step in the run directory (the line alone would scroll away)
        log(f"resumed at step {run.ckpt['step']} from {source}" + (f"; changed: {', '.join(text)}" if text else ""),
            {"kind": "resume", "step": run.ckpt["step"], "from": str(source), "changed": changed})


def resume_changes(ckpt, tc, mc, world_size):
    """{key: [the checkpoint's value, this run's]} for every key a resume changes: training keys (never
    IDENTITY_KEYS, which check_resumable refuses to change), EXECUTION_KEYS, and world_size."""
    changed = {k: [v, getattr(tc, k)] for k, v in ckpt["train_config"].items()
               if k not in ("resume", "overwrite", *IDENTITY_KEYS) and getattr(tc, k, v) != v}
    changed |= {k: [ckpt["model_config"][k], getattr(mc, k)] for k in EXECUTION_KEYS
                if k in ckpt["model_config"] and ckpt["model_config"][k] != getattr(mc, k)}
    if ckpt.get("world_size", world_size) != world_size:  # a checkpoint from before the key: not known
        changed["world_size"] = [ckpt["world_size"], world_size]
    return changed


def save(run):
    """A checkpoint of the run at its step (every rank takes part: FSDP gathers the shards)."""
    if not weights_finite(run.raw_model, run.dist):
        raise DivergedError(f"non-finite weights after step {run.step}; {last_good(run.saved)}")
    state = {"format": CKPT_FORMAT, "model_config": asdict(run.mc), "tokenizer": run.meta["tokenizer"],
             "step": run.step, "train_config": asdict(run.tc), "loader": run.batches.state_dict(),
             "rng": rng_state(run.dist.device), "world_size": run.dist.world_size}
    if run.sharded:  # every rank writes its own shards
        save_sharded(run.run_dir, run.raw_model, run.optimizer, state, run.dist)
        run.saved = (run.step, run.ckpt_path)
        return
    weights, optimizer_state = full_state(run.raw_model, run.optimizer, run.dist)

    def write():  # rank 0 writes; a failed write stops every rank
        save_checkpoint(run.ckpt_path, {**state, "model": weights, "optimizer": optimizer_state})
        remove_sharded(run.run_dir)  # an older sharded checkpoint (an FSDP run resumed without FSDP)
    agreed(run.dist, lambda: write() if run.dist.master else None)
    run.saved = (run.step, run.ckpt_path)


def evaluation(run, split, progress):
    """The split's loss at this step, logged; a loss past run.max_loss is a divergence."""
    loss, tokens = evaluate(run.model, split, run.tc, run.dist, run.autocast)
    if not healthy(loss, 0.0, run.max_loss):
        raise DivergedError(diverged(f"{split} loss", loss, 0.0, run.step, run.saved, run.max_loss))
    log_eval(run.log, split, run.step, loss, tokens, progress)
    return loss


def stop(run, signum):
    """Stop after a checkpoint at this step."""
    name = signal.Signals(signum).name
    run.log(None, {"kind": "stop", "step": run.step, "signal": name})
    raise Stopped(signum, f"stopped by {name} after step {run.step}; checkpoint written to {run.ckpt_path}; "
                          "resume with --resume=true")


def train_loop(run):
    """The training loop, evaluations and checkpoints of one run; returns its summary."""
    tc, dist = run.tc, run.dist
    run.raw_model, run.optimizer, loader, run.step = build(tc, run.mc, dist, run.ckpt)
    run.batches = DeviceBatches(loader, dist.device)
    run.model, run.train_model = wrap(run.raw_model, tc, dist)
    if dist.device.type == "cuda":
        run.autocast = torch.autocast("cuda", dtype=torch.bfloat16)
    start_log(run)
    if run.ckpt is not None:  # the checkpoint this run continues is its last good one until it writes its own
        source = resume_path(tc, run.run_dir)
        run.saved = (run.step, run.ckpt.get("sharded") or (source / "ckpt.pt" if source.is_dir() else source))
    peak = peak_flops(dist.device)
    # tokens/s of each log interval, those a resumed run kept too: the summary gives their median
    speeds = [r["tokens_per_s"] for r in map(json.loads, run.claim.kept_log if run.claim else []) if "tokens_per_s" in r]
    progress = Progress(run.step, run.max_steps, batch_tokens=tc.batch_tokens, speeds=speeds,
                        mfu_per_token_s=run.raw_model.flops_per_token() / (peak * dist.world_size) if peak else None)
    val_loss, clean = None, False  # clean: finished, or stopped by a signal with a checkpoint
    try:
        with GracefulStop(verbose=dist.master) as signals:
            while run.step < run.max_steps:
                lr = lr_at(run.step, tc, run.max_steps)
                t0 = time.perf_counter()
                loss, norm, signum = train_step(run, lr, signals)
                run.step += 1
                progress.stepped(run.step, time.perf_counter() - t0)
                if not healthy(loss, norm, run.max_loss):
                    raise DivergedError(diverged("loss", loss, norm, run.step, run.saved, run.max_loss))
                last = run.step == run.max_steps
                if run.step % tc.log_interval == 0 or last:
                    log_train(run.log, progress, run.step, loss, lr, norm)
                if run.step % tc.eval_interval == 0 or last:
                    val_loss = evaluation(run, "val", progress)
                stopping = signum and not last
                if (tc.ckpt_interval and run.step % tc.ckpt_interval == 0) or last or stopping:
                    save(run)
                if stopping:
                    stop(run, signum)

            # the last step is checkpointed; a signal from here on stops the run before what comes next
            if val_loss is None:  # resumed at the last step: its final evaluations are redone
                val_loss = evaluation(run, "val", progress)
            test_loss = None
            if run.meta["splits"].get("test", {}).get("tokens"):
                stop_if_signalled(run, signals)
                test_loss = evaluation(run, "test", progress)
            stop_if_signalled(run, signals)
            summary = summarize(run, val_loss, test_loss, progress)
        run.log("done: " + ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in summary.items()))
        clean = True
    except Stopped:
        clean = True  # with a checkpoint
        raise
    except RunDirError as e:  # a write failed: say what is kept
        raise RunDirError(f"{e}; {last_good(run.saved, good=False)}") from None
    except DivergedError as e:  # the run directory tells (tools/sweep.py tabulates the run as diverged)
        with suppress(RunDirError):
            run.log(None, {"kind": "diverged", "step": run.step, "error": str(e)})
        raise
    except Exception as e:
        if tc.compile and compile_failure(e):
            raise CompileError(compile_message(e, run)) from None
        raise
    finally:
        run.log.finish(clean)  # the W&B run, if any: exit code 0, or 1 (failed)
    return summary


def compile_failure(e):
    """Whether an exception came out of torch.compile (dynamo or inductor), itself or what it wraps."""
    while e is not None:
        if type(e).__module__.startswith(("torch._dynamo", "torch._inductor")):
            return True
        e = e.__cause__ or e.__context__
    return False


def compile_message(e, run):
    """One line for a compilation that failed: torch's first line (its message runs to a hundred)."""
    first = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
    first = first if len(first) <= 300 else first[:297] + "..."
    logged = run.dist.master and run.log.path.exists() and run.log.path.read_bytes().strip()
    again = "resume with --resume=true" if run.saved or logged else "run the same command again"
    when = f"after step {run.step}" if run.step else "at step 1"
    return (f"compile=true, but torch.compile failed {when} ({type(e).__name__}: {first}); "
            f"{last_good(run.saved, good=False)}: run without compile=true, or fix the compiler (on CPU "
            f"torch.compile needs a working C++ compiler: g++ or clang, or the one $CXX names), then {again}")


def stop_if_signalled(run, signals):
    """After the last step: the ranks agree on whether any of them got a signal, and stop if one did."""
    if signum := int(any_rank(run.dist, signals.signum or 0)):
        stop(run, signum)


def summarize(run, val_loss, test_loss, progress):
    """A finished run's summary, written to summary.json by rank 0: its last step is checkpointed."""
    peak, peaks = peak_memory(run.dist)
    summary = {"run_dir": str(run.run_dir), "step": run.step, "val_loss": val_loss, "test_loss": test_loss,
               "params": run.raw_model.num_params(),
               # rank 0's weights and AdamW state (gradients, as large as the weights, live during a step)
               "state_bytes_per_rank": state_bytes(run.raw_model, run.optimizer),
               "unigram_baseline": run.meta.get("unigram_baseline_nats"), "seconds": progress.elapsed(),
               "tokens_per_s": statistics.median(progress.speeds) if progress.speeds else None,  # over log intervals
               # CUDA: peak allocated; CPU: peak resident set; the largest of any rank's, then each rank's
               "peak_memory_bytes": peak, "peak_memory_bytes_per_rank": peaks}
    if run.dist.master:
        write_file(run.run_dir / "summary.json", (json.dumps(summary, indent=2) + "\n").encode(), RunDirError)
    return summary


def main(argv=None):
    """Train as the command line says. Returns a summary dict (rank 0's view)."""
    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:
        print(usage(__doc__))
        return None
    tc, model_settings = parse_config(argv)
    rank, world_size, local_rank = launch_env()  # a stray WORLD_SIZE without torchrun: one line
    if tc.fsdp and world_size > 1 and not (tc.device == "cuda" or (tc.device == "auto" and torch.cuda.is_available())):
        map_large_allocations()  # FSDP on CPUs: freed gathered weights and gradients leave the resident set
    meta = load_meta(tc.data_dir)
    mc = build_model_config(model_settings, tc, meta)
    grad_accum_steps(tc, world_size)  # a batch that does not split over the ranks: an error before any compute
    check_memory(mc, tc, world_size)  # a model too large for any rank's memory (vocab_size=1e10): the same
    if tc.warmup_steps > total_steps(tc) and rank == 0:
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
        agreed(dist, lambda: check_data(tc, meta) if local_rank == 0 else None)
        claim = agreed(dist, lambda: claim_run_dir(tc, run_dir, mc, meta["tokenizer"]) if dist.master else None)
        ckpt = from_rank0(dist, claim.ckpt if claim else None)  # only rank 0 reads out_dir
        summary = train_loop(Run(tc, mc, meta, dist, run_dir, claim, ckpt, argv[0]))
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
