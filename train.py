"""
Train a GPT with a depth-routing residual, on CPU, one GPU, or many through torchrun (DDP or FSDP2).

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
The run directory out_dir/run_name receives config.json, log.jsonl (one JSON record per logged step and
per evaluation), ckpt.pt and, once the run has finished, summary.json (depthres/run.py, which holds the
run's machinery). The first SIGINT or SIGTERM stops the run after the current step, with a checkpoint.
"""

import math
import random
import sys
import time
from dataclasses import asdict

import numpy as np
import torch
import torch.distributed as torch_dist

import depthres
from data import TokenLoader, load_meta
from depthres.config import build_model_config, parse_config, usage
from depthres.distributed import ddp, gradient_sync, sharded_model, whole
from depthres.run import (
    DeviceBatches,
    GracefulStop,
    Run,
    evaluate,
    failures,
    open_run,
    restore,
    start_log,
    summarize,
    write_checkpoint,
)
from depthres.runlog import log_eval, log_train
from model_fast import compile_model, make_model

# ----------------------------------------------------------------------------------------------
# The loop: one optimizer step, then the steps of a run with their logs, evaluations and checkpoints.


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
    if run.healthy(loss, norm):
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss, norm, int(signum)


def train_loop(run):
    """The training loop, evaluations and checkpoints of one run; returns its summary."""
    tc = run.tc
    progress = start_log(run)
    val_loss = None
    with failures(run), GracefulStop(verbose=run.dist.master) as signals:
        while run.step < run.max_steps:
            lr = lr_at(run.step, tc, run.max_steps)
            t0 = time.perf_counter()
            loss, norm, signum = train_step(run, lr, signals)
            run.step += 1
            progress.stepped(run.step, time.perf_counter() - t0)
            run.check("loss", loss, norm)  # a diverged step stops the run, before any update
            last = run.step == run.max_steps
            if run.step % tc.log_interval == 0 or last:
                log_train(run.log, progress, run.step, loss, lr, norm)
            if run.step % tc.eval_interval == 0 or last:
                val_loss = evaluation(run, "val", progress)
            stopping = signum and not last
            if (tc.ckpt_interval and run.step % tc.ckpt_interval == 0) or last or stopping:
                save(run)
            if stopping:
                run.stop(signum)

        # the last step is checkpointed; a signal from here on stops the run before what comes next
        if val_loss is None:  # resumed at the last step: its final evaluations are redone
            val_loss = evaluation(run, "val", progress)
        test_loss = None
        if run.has_test:
            run.stop_if_signalled(signals)
            test_loss = evaluation(run, "test", progress)
        run.stop_if_signalled(signals)
        return summarize(run, val_loss, test_loss, progress)


def evaluation(run, split, progress):
    """The split's loss over its first eval_tokens tokens at this step, logged; past run.max_loss it is a
    divergence. Under FSDP the ranks run their forwards in lockstep."""
    tc = run.tc
    loss, tokens = evaluate(run.model, tc.data_dir, split, tc.batch_size, tc.seq_len, tc.eval_tokens, run.dist,
                            run.autocast, lockstep=run.sharded)
    run.check(f"{split} loss", loss)
    log_eval(run.log, split, run.step, loss, tokens, progress)
    return loss


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
# Model, optimizer and data; the checkpoint.


def build(tc, mc, dist, ckpt):
    """The training loader, the model (sharded with fsdp=true) and its optimizer, restored from `ckpt`
    when resuming; and the step. FSDP builds the model on the meta device and gives each rank its shards
    (distributed.sharded_model): no rank holds the whole model. A whole checkpoint: each rank keeps its shard.
    A sharded checkpoint (ckpt["sharded"]): each rank reads its part, whatever the number of ranks."""
    random.seed(tc.seed)
    np.random.seed(tc.seed)
    torch.manual_seed(tc.seed)  # CUDA too
    loader = TokenLoader(tc.data_dir, "train", tc.batch_size, tc.seq_len, dist.rank, dist.world_size, seed=tc.data_seed)
    weights = ckpt["model"] if ckpt is not None and "sharded" not in ckpt else None
    if tc.fsdp and dist.world_size > 1:
        model = sharded_model(mc, tc.seed, dist, weights, init=ckpt is None)
    else:
        model = make_model(mc, seed=tc.seed).to(dist.device)
        if weights is not None:
            model.load_state_dict(weights)
    optimizer = torch.optim.AdamW(model.param_groups(tc.weight_decay), lr=tc.lr, betas=(tc.beta1, tc.beta2),
                                  eps=tc.eps, fused=dist.device.type == "cuda")  # over the (sharded) parameters
    if ckpt is None:
        return model, optimizer, loader, 0
    restore(ckpt, model, optimizer, loader, dist)
    return model, optimizer, loader, ckpt["step"]


def wrap(raw_model, tc, dist):
    """(the model for evaluation: compiled if asked; the model for training: that one in DDP when
    distributed without FSDP, which shards the model itself)"""
    model = compile_model(raw_model) if tc.compile else raw_model
    return model, ddp(model, dist) if dist.world_size > 1 and not tc.fsdp else model


def save(run):
    """A checkpoint of the run at its step: the configs, where the data loader is, and (written with
    them) the weights, AdamW state and random generators, so that a resume continues bit for bit."""
    write_checkpoint(run, {"model_config": asdict(run.mc), "tokenizer": run.meta["tokenizer"], "step": run.step,
                           "train_config": asdict(run.tc), "loader": run.batches.state_dict(),
                           "world_size": run.dist.world_size})


# ----------------------------------------------------------------------------------------------
# The command line.


def main(argv=None):
    """Train as the command line says. Returns a summary dict (rank 0's view)."""
    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:
        print(usage(__doc__))
        return None
    tc, model_settings = parse_config(argv)  # the config file, then --key=value
    meta = load_meta(tc.data_dir)  # the prepared data: its tokenizer, vocabulary and splits
    mc = build_model_config(model_settings, tc, meta)
    with open_run(tc, mc, meta) as (dist, claim, ckpt):  # ranks, every check before any compute, the run directory
        raw_model, optimizer, loader, step = build(tc, mc, dist, ckpt)
        model, train_model = wrap(raw_model, tc, dist)
        run = Run(tc, mc, meta, dist, claim, ckpt, argv[0], raw_model, model, train_model, optimizer,
                  DeviceBatches(loader, dist.device), step)
        return train_loop(run)


def cli(argv=None):
    """The command line: exit status 0 done; 2 with one `error:` line; 128 + signal number after a stop
    (depthres.cli, the exit statuses of every command)."""
    return depthres.cli(main, argv)


if __name__ == "__main__":
    sys.exit(cli())
