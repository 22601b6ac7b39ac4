"""
A training run's machinery, so that train.py can show the run's assembly and its loop: the Run (what one
run holds), how it opens (open_run: ranks, data and run directory checked before any compute) and starts its
log, the batches on the device, the graceful stop on a signal, divergence, the checkpoint write, the
evaluation (also experiments/rescore.py's), the summary, and which failures are one `error:` line.
"""

import gc
import json
import math
import os
import signal
import statistics
import sys
import textwrap
import threading
from contextlib import contextmanager, nullcontext, suppress
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as torch_dist

from data import check_data, eval_batches
from depthres import Stopped, UserError
from depthres.checkpoint import (
    CKPT_FORMAT,
    EXECUTION_KEYS,
    IDENTITY_KEYS,
    claim_run_dir,
    last_good,
    load_sharded,
    logged_compute,
    remove_sharded,
    resume_path,
    rng_state,
    save_checkpoint,
    save_sharded,
    set_rng_state,
)
from depthres.config import TrainConfig, total_steps
from depthres.distributed import (
    Dist,
    agreed,
    any_rank,
    check_same_keys,
    from_rank0,
    launch_env,
    load_optimizer_state,
    local,
    map_large_allocations,
    peak_memory,
    setup_distributed,
    state_bytes,
    wants_cuda,
)
from depthres.files import write_file, writing
from depthres.runlog import (
    Progress,
    RunLog,
    log_records,
    peak_flops,
    provenance,
    require_wandb,
    run_provenance,
    start_wandb,
)
from model import GPT, GPTConfig
from model_fast import make_model

TRAINING_BYTES_PER_PARAM = 16  # float32 weight and gradient, AdamW's two moments (docs/training.md)


@dataclass
class Run:
    """One run, as train.py assembles it: what it was asked (tc, mc), its data (meta), its ranks (dist),
    the claim on its directory, the checkpoint it continues, its model, optimizer and batches; then what
    the loop changes (step, log, the last checkpoint saved, divergence)."""

    tc: TrainConfig
    mc: GPTConfig
    meta: dict
    dist: Dist
    claim: object = None  # checkpoint.Claim on rank 0; None on the other ranks
    ckpt: dict | None = None  # the checkpoint resumed from
    config_path: str | None = None
    raw_model: GPT | None = None  # the parameters (sharded under FSDP)
    model: torch.nn.Module | None = None  # for evaluation: raw_model, compiled if asked
    train_model: torch.nn.Module | None = None  # for training: model, in DDP when distributed without FSDP
    optimizer: torch.optim.Optimizer | None = None
    batches: object = None  # DeviceBatches of the training split
    step: int = 0  # optimizer steps done
    log: object = None  # runlog.RunLog (start_log)
    saved: tuple | None = None  # (step, path) of the last checkpoint written or resumed from
    diverged: bool = False  # the run's loss, gradient or weights went non-finite (or past max_loss)

    @property
    def run_dir(self):
        return Path(self.tc.out_dir) / self.tc.run_name

    @property
    def autocast(self):
        """bfloat16 autocast on CUDA (float32 parameters); none on CPU."""
        return torch.autocast("cuda", dtype=torch.bfloat16) if self.dist.device.type == "cuda" else nullcontext()

    @property
    def accum(self):
        return grad_accum_steps(self.tc, self.dist.world_size)

    @property
    def max_steps(self):
        return total_steps(self.tc)

    @property
    def max_loss(self):
        """The loss above which a run has diverged though finite: 4 times a uniform guess's ln(vocab) (every
        variant starts at ln(vocab); a perplexity of vocab^4 predicts nothing)."""
        return 4 * math.log(self.mc.vocab_size)

    @property
    def sharded(self):
        """FSDP: the model and optimizer are sharded, and so are the checkpoints (depthres/checkpoint.py)."""
        return self.tc.fsdp and self.dist.world_size > 1

    @property
    def ckpt_path(self):
        return self.run_dir / ("ckpt" if self.sharded else "ckpt.pt")

    @property
    def has_test(self):
        return bool(self.meta["splits"].get("test", {}).get("tokens"))

    def healthy(self, loss, norm=0.0):
        """A finite loss of at most max_loss and a finite gradient norm."""
        return math.isfinite(loss) and loss <= self.max_loss and math.isfinite(norm)

    def check(self, what, loss, norm=0.0):
        """A UserError when `what` ("loss", "val loss") is non-finite or above max_loss, or the norm is non-finite."""
        if not self.healthy(loss, norm):
            self.diverged = True
            raise UserError(diverged(what, loss, norm, self.step, self.saved, self.max_loss))

    def stop(self, signum):
        """Stop after a checkpoint at this step."""
        name = signal.Signals(signum).name
        self.log(None, {"kind": "stop", "step": self.step, "signal": name})
        raise Stopped(f"stopped by {name} after step {self.step}; checkpoint written to {self.ckpt_path}; "
                      "resume with --resume=true", signum)

    def stop_if_signalled(self, signals):
        """After the last step: the ranks agree on whether any of them got a signal, and stop if one did."""
        if signum := int(any_rank(self.dist, signals.signum or 0)):
            self.stop(signum)


# ----------------------------------------------------------------------------------------------
# Opening a run: every check before any compute.


@contextmanager
def open_run(tc, mc, meta):
    """Open the run of a parsed config: its ranks set up; the batch, the memory, wandb (if asked) and the
    data checked; its run directory claimed by rank 0 and the checkpoint it continues read, every rank
    given it. Yields (dist, claim, ckpt). On leaving, the claim is released and the process group taken
    down."""
    rank, world_size, local_rank = launch_env()  # a stray WORLD_SIZE without torchrun: one line
    if tc.fsdp and world_size > 1 and not wants_cuda(tc.device):
        map_large_allocations()  # FSDP on CPUs: freed gathered weights and gradients leave the resident set
    grad_accum_steps(tc, world_size)  # a batch that does not split over the ranks: an error before any compute
    check_memory(mc, tc, world_size)  # a model too large for any rank's memory (vocab_size=1e10): the same
    if tc.warmup_steps > total_steps(tc) and rank == 0:  # the last step's lr is lr * steps / warmup_steps
        print(f"warning: warmup_steps={tc.warmup_steps} is more than the run's {total_steps(tc)} steps: the "
              f"learning rate ends its warmup at {tc.lr * total_steps(tc) / tc.warmup_steps:.3g}, "
              f"never reaching lr={tc.lr:g}", file=sys.stderr)
    run_dir = Path(tc.out_dir) / tc.run_name
    dist = setup_distributed(tc.device)
    claim = None
    try:
        data = f"{meta['tokenizer']} tokens, " + ", ".join(f"{s} {i['tokens']:,}" for s, i in meta["splits"].items())
        check_same_keys(dist, {**asdict(tc), **asdict(mc), "data": data})  # (data_dir may differ: its tokens may not)
        # before any compute: wandb if asked, the data (one process per node reads it), the run directory (rank 0)
        if tc.wandb_log:
            agreed(dist, lambda: require_wandb() if dist.master else None)
        agreed(dist, lambda: check_data(tc.data_dir, meta, tc.seq_len) if local_rank == 0 else None)
        claim = agreed(dist, lambda: claim_run_dir(tc, run_dir, mc, meta["tokenizer"]) if dist.master else None)
        ckpt = from_rank0(dist, claim.ckpt if claim else None)  # only rank 0 reads out_dir
        yield dist, claim, ckpt
        if dist.world_size > 1:
            torch_dist.barrier()  # every rank is done with the group before any rank takes it down
    finally:
        if claim is not None:
            claim.lock.release()
        if dist.world_size > 1:
            # DDP's reducer sits in reference cycles; collect it while its process group still exists,
            # or its gloo threads are torn down at interpreter exit and abort the process
            gc.collect()
            torch_dist.destroy_process_group()


def check_memory(mc, tc, world_size):
    """A model whose training state (TRAINING_BYTES_PER_PARAM a parameter, split over the ranks under FSDP)
    cannot fit in one rank's memory (a GPU's, or the whole host's) is a UserError, before any tensor is
    allocated: the parameters are counted on the meta device."""
    with torch.device("meta"):
        n = make_model(mc).num_params()
    need = TRAINING_BYTES_PER_PARAM * n / (world_size if tc.fsdp else 1)
    if wants_cuda(tc.device) and torch.cuda.is_available():
        have, where = torch.cuda.get_device_properties(0).total_memory, "a GPU's memory"
    else:
        have, where = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this host's memory"
    if need > have:
        raise UserError(f"the model would have {n:,} parameters ({mc.vocab_size:,} x {mc.n_embd} in the embedding "
                        f"alone): training them needs about {need / 2**30:,.0f} GiB per rank ({TRAINING_BYTES_PER_PARAM} "
                        f"bytes a parameter{', split over the ranks' if tc.fsdp else ''}), more than the "
                        f"{have / 2**30:,.0f} GiB of {where}; set a smaller vocab_size, n_embd or n_layer")


def grad_accum_steps(tc, world_size):
    per_micro = tc.batch_size * tc.seq_len * world_size
    if tc.batch_tokens % per_micro:
        fit = max(1, round(tc.batch_tokens / per_micro)) * per_micro
        raise UserError(f"batch_tokens={tc.batch_tokens} is not a multiple of batch_size * seq_len * world_size "
                        f"= {tc.batch_size} * {tc.seq_len} * {world_size} = {per_micro} (e.g. batch_tokens={fit})")
    return tc.batch_tokens // per_micro


def restore(ckpt, model, optimizer, loader, dist):
    """Continue from `ckpt`: the optimizer state (and the weights, from a sharded checkpoint: each rank
    reads its part, whatever the number of ranks), the loader's place and the random generators. AdamW's
    settings (weight_decay, betas, eps: each group's, as this run built them) are this run's: a checkpoint
    gives its moments and step counts, and its loading, which would bring back its own settings, is undone."""
    settings = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    if "sharded" in ckpt:
        load_sharded(ckpt["sharded"], model, optimizer, dist)
    else:
        load_optimizer_state(optimizer, ckpt["optimizer"])
    for group, own in zip(optimizer.param_groups, settings, strict=True):
        group.update(own)
    loader.load_state_dict(ckpt["loader"])
    set_rng_state(ckpt["rng"], dist.device)


def start_log(run):
    """Make the run directory this run's (rank 0): drop what this run replaces, write config.json and
    the log it keeps. Print what this run is and the loss to beat. Sets run.log (and run.saved when it
    resumes); returns the run's Progress."""
    tc, mc, meta, dist, run_dir, claim = run.tc, run.mc, run.meta, run.dist, run.run_dir, run.claim
    log = run.log = RunLog(run_dir / "log.jsonl", dist.master)
    resolved = {"config_file": run.config_path, "train": asdict(tc), "model": asdict(mc),
                "tokenizer": meta["tokenizer"], "world_size": dist.world_size, "grad_accum": run.accum,
                "max_steps": run.max_steps}
    if dist.master:
        dropped = ("summary.json", "scores.json") + (() if claim.continuing else ("ckpt.pt", "wandb_id.txt"))
        for name in dropped:
            with writing(run_dir / name, UserError):
                (run_dir / name).unlink(missing_ok=True)
        remove_sharded(run_dir, checkpoint=not claim.continuing)  # continuing: what a kill left of a save
        write_file(run_dir / "config.json", (json.dumps(resolved, indent=2) + "\n").encode(), UserError)
        write_file(run_dir / "log.jsonl", "".join(line + "\n" for line in claim.kept_log).encode(), UserError)
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
        # the checkpoint this run continues is its last good one until it writes its own
        run.saved = (run.step, run.ckpt.get("sharded") or (source / "ckpt.pt" if source.is_dir() else source))
    log(None, provenance(run.step))
    peak = peak_flops(dist.device)
    # tokens/s of each log interval, those a resumed run kept too: the summary gives their median
    speeds = [r["tokens_per_s"] for r in map(json.loads, claim.kept_log if claim else [])
              if isinstance(r.get("tokens_per_s"), (int, float)) and not isinstance(r["tokens_per_s"], bool)]
    return Progress(run.step, run.max_steps, batch_tokens=tc.batch_tokens, speeds=speeds,
                    mfu_per_token_s=run.raw_model.flops_per_token() / (peak * dist.world_size) if peak else None)


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


# ----------------------------------------------------------------------------------------------
# The batches, the signals, divergence.


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
    (train.py writes a checkpoint, then raises Stopped); `signum` is that signal (None: none yet).
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
            raise Stopped("interrupted; the last checkpoint, if any, is kept (--resume=true continues from it)", signum)


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


# ----------------------------------------------------------------------------------------------
# Checkpoint, evaluation, summary.


def write_checkpoint(run, state):
    """Write the run's checkpoint at its step: `state` with the checkpoint format, the random generators,
    the weights and AdamW state: under FSDP every rank writes its own shards; else rank 0 writes the one file
    and every rank hears whether it could."""
    finite = all(bool(torch.isfinite(local(p)).all()) for p in run.raw_model.parameters())  # this rank's shard
    if any_rank(run.dist, not finite):
        run.diverged = True
        raise UserError(f"non-finite weights after step {run.step}; {last_good(run.saved)}")
    state = {"format": CKPT_FORMAT, **state, "rng": rng_state(run.dist.device)}
    if run.sharded:  # every rank writes its own shards
        save_sharded(run.run_dir, run.raw_model, run.optimizer, state, run.dist)
        run.saved = (run.step, run.ckpt_path)
        return

    def write():  # rank 0 writes (its CPU copy of the state: save_checkpoint); a failed write stops every rank
        save_checkpoint(run.ckpt_path, {**state, "model": run.raw_model.state_dict(),
                                        "optimizer": run.optimizer.state_dict()})
        remove_sharded(run.run_dir)  # an older sharded checkpoint (an FSDP run resumed without FSDP)
    agreed(run.dist, lambda: write() if run.dist.master else None)
    run.saved = (run.step, run.ckpt_path)


ONE_CPU = Dist(rank=0, world_size=1, device=torch.device("cpu"))


@torch.no_grad()
def evaluate(model, data_dir, split, batch_size, seq_len, max_tokens=None, dist=ONE_CPU, autocast=None,
             lockstep=False):
    """Mean loss over the first max_tokens targets of a split (None: all of it), over all ranks, summed in
    float64. Returns (loss, tokens). train.py's evaluation and experiments/rescore.py both call it, so a rescore
    of a run's eval_tokens repeats its logged losses bit for bit. lockstep (FSDP, where every forward
    gathers weights from all ranks): every rank runs as many batches as the rank with the most (the
    split's windows need not divide evenly); the extra ones count nothing."""
    sums = torch.zeros(2, dtype=torch.float64, device=dist.device)  # loss sum, token count
    batches = eval_batches(data_dir, split, batch_size, seq_len, max_tokens, dist.rank, dist.world_size)
    while True:
        batch = next(batches, None)
        if not (any_rank(dist, batch is not None) if lockstep else batch is not None):
            break
        x, y = batch or (torch.zeros(1, seq_len, dtype=torch.long),) * 2  # idle: a forward, nothing counted
        x, y = x.to(dist.device), y.to(dist.device)
        with autocast or nullcontext():
            _, loss = model(x, y)
        if batch is not None:
            sums[0] += loss.double() * y.numel()
            sums[1] += y.numel()
    if dist.world_size > 1:
        torch_dist.all_reduce(sums)
    loss_sum, tokens = sums.tolist()
    return loss_sum / tokens, int(tokens)


def summarize(run, val_loss, test_loss, progress):
    """A finished run's summary, written to summary.json by rank 0 and logged: its last step is checkpointed."""
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
        summary |= run_provenance([r for r in log_records(run.run_dir) if r.get("kind") == "start"])
        write_file(run.run_dir / "summary.json", (json.dumps(summary, indent=2) + "\n").encode(), UserError)
    run.log("done: " + ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in summary.items()))
    return summary


# ----------------------------------------------------------------------------------------------
# Failures: one line each.


@contextmanager
def failures(run):
    """Around the loop: a failed write says what is kept, a divergence is recorded in the run directory
    (experiments/sweep.py tabulates the run as diverged), a failed torch.compile is one line; the W&B run, if
    any, ends with exit code 0 (finished, or stopped with a checkpoint) or 1 (failed)."""
    clean = False
    try:
        yield
        clean = True
    except Stopped:
        clean = True  # with a checkpoint
        raise
    except UserError as e:
        if run.diverged:  # its line says which checkpoint is good; the run directory records it
            with suppress(UserError):
                run.log(None, {"kind": "diverged", "step": run.step, "error": str(e)})
            raise
        raise UserError(f"{e}; {last_good(run.saved, good=False)}") from None  # a failed write, say
    except Exception as e:
        if run.tc.compile and (message := compile_message(e, run)):
            raise UserError(message) from None
        raise
    finally:
        run.log.finish(clean)


def compile_message(e, run):
    """One line for an exception that came out of torch.compile (dynamo or inductor), itself or what it wraps,
    with torch's first line (its message runs to a hundred); None for any other exception."""
    cause = e
    while cause is not None and not type(cause).__module__.startswith(("torch._dynamo", "torch._inductor")):
        cause = cause.__cause__ or cause.__context__
    if cause is None:
        return None
    first = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
    first = first if len(first) <= 300 else first[:297] + "..."
    logged = run.dist.master and logged_compute(run.log.path)
    again = "resume with --resume=true" if run.saved or logged else "run the same command again"
    when = f"after step {run.step}" if run.step else "at step 1"
    return (f"compile=true, but torch.compile failed {when} ({type(e).__name__}: {first}); "
            f"{last_good(run.saved, good=False)}: run without compile=true, or fix the compiler (on CPU "
            f"torch.compile needs a working C++ compiler: g++ or clang, or the one $CXX names), then {again}")
