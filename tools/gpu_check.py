"""The GPU check: one command on a machine with CUDA GPUs (`make gpu-check`), one summary.
bench: tools.bench at 12 layers, width 768, context 1024, bf16, compiled. train: a small torchrun run
straight through, then stopped by SIGTERM and resumed: the losses must agree. sample: sample.py on that
checkpoint, with and without the cache. Exit status 0, 1 when a check fails, 2 after one `error:` line.

    python -m tools.gpu_check           # all of it, in a few minutes
    python -m tools.gpu_check --toy     # the same at toy size on CPU (gloo)
"""

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python tools/gpu_check.py` as `python -m tools.gpu_check`
import torch

from common import ROOT, UserError, cli, log_records

BENCH = ("--n_layer 12 --n_embd 768 --n_head 6 --seq_len 1024 --batch_size 8 --dtype bf16 --compile --repeats 5 "
         "--warmup 2 --routing_blocks 4:4,8:4,16:4").split()
TOY_BENCH = ("--n_layer 2 --n_embd 32 --n_head 2 --seq_len 16 --batch_size 2 --vocab_size 97 --compile --compile_backend "
             "aot_eager --repeats 2 --warmup 1 --routing_blocks 2:2 --device cpu").split()
TRAIN = ("residual=block_attnres n_layer=6 n_embd=384 n_head=6 seq_len=256 batch_size=16 max_steps=300 warmup_steps=30 "
         "lr=2e-3 min_lr=2e-4 eval_interval=150 eval_tokens=65536 log_interval=1 ckpt_interval=100 compile=true").split()
TOY_TRAIN = ("residual=block_attnres n_layer=2 n_embd=32 n_head=2 seq_len=32 batch_size=4 max_steps=150 warmup_steps=10 "
             "lr=1e-2 min_lr=1e-3 eval_interval=150 eval_tokens=1024 log_interval=1 ckpt_interval=0 device=cpu").split()


def run(cmd, timeout, env=None):
    """(stdout, stderr) of a finished command, or UserError with its output's end."""
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise UserError(f"`{' '.join(map(str, cmd))}` exited {done.returncode}:\n{(done.stdout + done.stderr)[-3000:]}")
    return done.stdout, done.stderr


def records(run_dir, kind):
    return [r for r in log_records(run_dir) if r.get("kind") == kind]


def check_bench(args, out):
    cmd = [sys.executable, "-m", "tools.bench", *(TOY_BENCH if args.toy else BENCH), "--out", str(out / "bench.json")]
    print(run(cmd + (["--variants", args.variants] if args.variants else []), timeout=args.timeout)[0], flush=True)
    return [f"{r['variant']}: {r['speed_ratio']:.3f} tokens/s, {r['memory_ratio']:.3f} saved activations"
            + (f", {r['peak_ratio']:.3f} CUDA peak" if r.get("peak_ratio") is not None else "")
            for r in json.loads((out / "bench.json").read_text())["steps"]]


def check_train(args, data_dir, out):
    """Straight through; stopped by SIGTERM and resumed; the losses must agree."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def torchrun(name, *extra):
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.gpus}",
                "train.py", "configs/test.py", f"--data_dir={data_dir}", f"--out_dir={out}", f"--run_name={name}",
                *[f"--{kv}" for kv in (TOY_TRAIN if args.toy else TRAIN)], f"--batch_tokens={args.batch_tokens}", *extra]
    t0 = time.time()
    run(torchrun("straight"), timeout=args.timeout, env=env)
    straight, seconds = {r["step"]: r["loss"] for r in records(out / "straight", "train")}, time.time() - t0
    proc = subprocess.Popen(torchrun("stopped"), cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    deadline = time.time() + args.timeout
    while not records(out / "stopped", "train") and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)  # until the first logged step: the signal handlers are up, the run has far to go
    os.killpg(proc.pid, signal.SIGTERM)  # what a cluster's preemption sends: torchrun passes it on to every rank
    output = proc.communicate(timeout=args.timeout)[0]
    stop = records(out / "stopped", "stop")
    if proc.returncode == 0 or not stop:
        raise UserError(f"SIGTERM did not stop the run with a checkpoint (exit {proc.returncode}):\n{output[-3000:]}")
    at = stop[-1]["step"]
    run(torchrun("stopped", "--resume=true"), timeout=args.timeout, env=env)
    resumed = {r["step"]: r["loss"] for r in records(out / "stopped", "train") if r["step"] > at}
    if not resumed or set(resumed) - set(straight):
        raise UserError(f"the resumed run logged steps {sorted(resumed)[:5]}.., the straight one {sorted(straight)[:5]}..")
    diffs = {s: abs(resumed[s] - straight[s]) for s in resumed}
    first, worst = diffs[min(resumed)], max(diffs.values())
    if first > 1e-4 or worst > 1e-2:
        raise UserError(f"resumed losses differ from the uninterrupted run's: first {first:.2e}, worst {worst:.2e}")
    summary = json.loads((out / "straight" / "summary.json").read_text())
    return [f"{args.gpus} ranks, {len(straight)} steps in {seconds:.0f}s (with compile), "
            f"{summary['tokens_per_s']:,.0f} tokens/s, val loss {summary['val_loss']:.3f}",
            f"SIGTERM stopped at step {at}, resumed; first resumed step |dloss| {first:.1e}, worst over "
            f"{len(resumed)} steps {worst:.1e}"]


def check_sample(args, out):
    speeds = {}
    for label, extra in (("cached", []), ("uncached", ["--no_cache"])):
        _, stderr = run([sys.executable, "sample.py", "--ckpt", str(out / "straight"), "--max_new_tokens",
                         str(args.new_tokens), "--temperature", "0", *(["--device", "cpu"] if args.toy else []), *extra],
                        timeout=args.timeout)
        match = re.search(r"\(([\d.]+) tokens/s", stderr)
        if not match:
            raise UserError(f"sample.py printed no tokens/s line:\n{stderr[-1000:]}")
        speeds[label] = float(match.group(1))
    return [f"{args.new_tokens} new tokens: {speeds['cached']:.1f} tokens/s cached, {speeds['uncached']:.1f} uncached "
            f"({speeds['cached'] / speeds['uncached']:.1f}x)"]


def prepare(args, work):
    """The embedded corpus as tokens (bytes in a temp dir for the toy)."""
    if not args.toy:
        if not (ROOT / "data" / "shakespeare" / "meta.json").exists():
            run([sys.executable, "prepare_data.py"], timeout=args.timeout)
        return ROOT / "data" / "shakespeare"
    run([sys.executable, "prepare_data.py", "--tokenizer", "byte", "--out_dir", str(work / "data")], timeout=args.timeout)
    return work / "data"


def check(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--toy", action="store_true", help="toy sizes on CPU with gloo: the script's own test")
    p.add_argument("--variants", default=None, help="bench.py's --variants (default: its own list)")
    p.add_argument("--gpus", type=int, default=None, help="ranks for torchrun (default: every GPU; toy: 2)")
    p.add_argument("--new_tokens", type=int, default=None, help="tokens per sample (default 256; toy 32)")
    p.add_argument("--timeout", type=int, default=600, help="seconds any one command may take")
    p.add_argument("--out", default=None, help="keep the runs and bench.json here (default: a temp dir, removed)")
    args = p.parse_args(argv)
    if not args.toy and not torch.cuda.is_available():
        raise UserError("no CUDA GPU here; `python -m tools.gpu_check --toy` runs the check at toy size on CPU")
    args.gpus = args.gpus or (2 if args.toy else torch.cuda.device_count())
    args.new_tokens = args.new_tokens or (32 if args.toy else 256)
    train = dict(kv.split("=") for kv in (TOY_TRAIN if args.toy else TRAIN))
    args.batch_tokens = int(train["batch_size"]) * int(train["seq_len"]) * args.gpus  # one micro-batch per rank
    work = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="gpu_check_"))
    work.mkdir(parents=True, exist_ok=True)
    results, failed, t0 = {}, [], time.time()
    try:
        data_dir = prepare(args, work)
        for name, part in (("bench", lambda: check_bench(args, work)),
                           ("train", lambda: check_train(args, data_dir, work / "runs")),
                           ("sample", lambda: check_sample(args, work / "runs"))):
            print(f"== {name}", flush=True)
            try:
                results[name] = part()
            except (UserError, subprocess.TimeoutExpired, OSError, KeyError, ValueError) as e:
                results[name], failed = [f"FAILED: {e}"], failed + [name]
    except UserError as e:
        results["data"], failed = [f"FAILED: {e}"], ["data"]
    finally:
        if not args.out:
            shutil.rmtree(work, ignore_errors=True)
    print(f"\n== gpu check summary ({time.time() - t0:.0f}s)")
    for name, lines in results.items():
        for i, line in enumerate(lines):
            print(f"{name if i == 0 else '':<7} {line}")
    print("all checks passed" if not failed else f"FAILED: {', '.join(failed)}")
    return 1 if failed else 0


def main(argv=None):
    return cli(check, argv)


if __name__ == "__main__":
    sys.exit(main())
