"""
Benchmark a training step of every residual variant against the standard residual, in one run.

    python -m tools.bench                                   # CPU: a small model in float32
    python -m tools.bench --device cuda --n_layer 12 --n_embd 768 --n_head 6 --seq_len 1024 \\
        --batch_size 8 --dtype bf16 --compile         # the GPU size of the performance targets

Each variant runs a full training step (forward, backward, AdamW). Repeats are interleaved across
variants, so a slow moment of the machine hits every variant alike, and each repeat gives each
variant a speed ratio against `standard` in the same round; the table reports the median ratio and
the spread (lowest and highest quartile) of those per-round ratios. Memory, on every device: the
bytes autograd saves for backward in one eager step, each storage counted once ("saved
activations"); on CUDA also the peak memory a step adds on top of weights and optimizer state
(which counts gradients, logits and the optimizer's temporaries too).

A second table times the depth routing of one block alone, forward and forward + backward, for the
two implementations, against its memory-traffic floor over the bandwidth of a plain copy: forward,
each completed source and each site's partial sum read once and each output written once;
backward, the same reads again plus each output's gradient, and each source gradient written once.

`--memory` measures, instead, what a process holds (peak resident set), which depends on the allocator,
the torch build and the machine, so it is a figure here and not a threshold in a test (the tests check the
mechanisms: a stream's bounded window, FSDP's shards): prepare_data.py on a 4 and a 16 MB corpus, in shards of
10^5 tokens, whose peak stays where it was (the source is read as a stream), and each rank of a 2-rank DDP and FSDP run of a
16 x 512 model (FSDP's ranks hold shards: docs/training.md, "the memory rule").

Variants are `residual[:key=value...]`, e.g. `rd_attnres:rd_mode=tied`, `full_attnres:depth_impl=reference`,
`block_attnres:activation_checkpointing=true` (each sublayer recomputed in backward).

Exit status: 0 done; 2 with one `error:` line before any model is built (a flag, a variant or a key
that does not parse or build, a device that is not there, an --out that cannot be written). The JSON
is written whole or not at all, and where it goes is checked before the benchmark runs.
"""

import argparse
import difflib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import typing
from pathlib import Path

import torch
import torch._dynamo

from depthres import UserError, cli, os_error_message
from depthres.config import MODEL_TYPES, convert, model_config, need
from depthres.files import check_writable, write_file
from depthres.runlog import ROOT
from model import depth_attention
from model_fast import TwoPhaseRouter, compile_model, make_model, rms_inv
from tools.diagnose import parse_device

DEFAULT_VARIANTS = "standard,full_attnres,block_attnres,rd_attnres,dar,hc,mhc,denseformer,muddformer,delta_attnres"
SHAPE_KEYS = {"vocab_size": "--vocab_size", "block_size": "--seq_len", "n_layer": "--n_layer", "n_head": "--n_head",
              "n_embd": "--n_embd", "residual": "the variant's name"}  # set for every variant by bench's flags
KINDS = {int: "an integer", float: "a number", bool: "true or false"}  # what a variant's key=value takes


def parse_variant(spec):
    """The GPTConfig keys of a variant `residual[:key=value...]`, each value read as train.py reads its
    --key=value (depthres.config.convert); UserError naming what does not parse."""
    name, *pairs = spec.split(":")
    kw = dict(residual=name)
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise UserError(f"{pair!r} is not key=value")
        if key in SHAPE_KEYS:
            raise UserError(f"{key} is set for every variant by {SHAPE_KEYS[key]}")
        if key not in MODEL_TYPES:
            close = difflib.get_close_matches(key, list(MODEL_TYPES), n=1)
            raise UserError(f"unknown key {key!r}" + (f" (did you mean {close[0]}?)" if close else ""))
        try:
            kw[key] = convert(key, value, MODEL_TYPES[key])
        except UserError:  # convert fails only for these types (alone or "| None")
            typ = MODEL_TYPES[key]
            kind = next(KINDS[t] for t in (typ, *typing.get_args(typ)) if t in KINDS)
            raise UserError(f"{key} takes {kind}, not {value!r}") from None
    return kw


def variant_config(spec, args):
    """The GPTConfig of a variant at the benchmark's size; UserError naming the variant if it does not build."""
    try:
        return model_config(dict(vocab_size=args.vocab_size, block_size=args.seq_len, n_layer=args.n_layer,
                                 n_head=args.n_head, n_embd=args.n_embd, **parse_variant(spec)))
    except UserError as e:
        raise UserError(f"--variants {spec}: {e}") from None


def check_args(args):
    """Every flag, variant and the output path, before any model is built; returns (device, specs)."""
    for flag in ("n_layer", "n_embd", "n_head", "vocab_size", "seq_len", "batch_size", "repeats"):
        need(getattr(args, flag) >= 1, f"--{flag} must be at least 1, got {getattr(args, flag)}")
    need(args.warmup >= 0, f"--warmup must be at least 0, got {args.warmup}")
    need(all(len(b) == 2 and min(b) >= 1 for b in args.routing_blocks),
         "--routing_blocks: each block is sources:sites, both at least 1 (e.g. 4:4,8:4), got "
         + ",".join(":".join(map(str, b)) for b in args.routing_blocks))
    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = parse_device(args.device, "auto, cpu, cuda or cuda:N")
    model_config(dict(vocab_size=args.vocab_size, block_size=args.seq_len, n_layer=args.n_layer, n_head=args.n_head,
                      n_embd=args.n_embd))
    specs = args.variants.split(",")
    if "standard" not in specs:
        specs.insert(0, "standard")
    for spec in specs:
        variant_config(spec, args)
    check_out(args.out)
    return device, specs


def check_out(path):
    """That --out can be written, before the benchmark runs."""
    need(not os.path.isdir(path), f"--out {path} is a directory: pass the JSON file to write")
    try:
        check_writable(os.path.dirname(path) or ".")
    except OSError as e:
        raise UserError(os_error_message(e, path)) from None


def write_report(path, report):
    try:
        write_file(path, json.dumps(report, indent=1) + "\n")
    except OSError as e:  # checked before the benchmark ran: the disk filled, or the directory went away
        raise UserError(f"{os_error_message(e, path)}; the tables above hold the numbers") from None
    print(f"\nwrote {path}")


# --- the instruments the fast path is measured with (here and in the tests): the router's plain
# counterpart, and what autograd keeps for backward


class ReferenceRouter:
    """TwoPhaseRouter's interface over depth_attention, site by site: the plain reference of one
    chunk's routing (tools/bench.py's routing table times it; tests/test_routing.py checks the router
    against it). The chunk's query rows W [Q, d] are known when it opens, over the sources
    completed by then; each read adds the sources that arrived since. streams: None for one stream of
    sources [*, d]; DAR: per target (key stream, value stream) of its sources [2, *, d], the rows
    target-major. The norm factors `inv` are the two-phase path's, unused here."""

    def __init__(self, W, completed, inv=None, streams=None):
        self.W, self.completed, self.streams = W, completed, streams
        self.Qt = len(W) // (1 if streams is None else len(streams))

    def attend(self, q, recent=()):
        """(h, a) for query row q over the completed sources and `recent`."""
        sources = self.completed + list(recent)
        if self.streams is None:
            return depth_attention(self.W[q], sources)
        ks, vs = self.streams[q // self.Qt]
        return depth_attention(self.W[q], [s[ks] for s in sources], [s[vs] for s in sources])

    def read(self, q, recent=(), inv=()):
        return self.attend(q, recent)[0]

    def read_rows(self, rows, recent=(), inv=()):
        """h of each query row in rows (one site's)."""
        return [self.read(q, recent) for q in rows]

    def read_fused(self, rows, alpha, recent=(), inv=()):
        """DAR: h = alpha_0 r_0 + alpha_1 r_1 for one site's query rows (target 0's, target 1's)."""
        return alpha[0] * self.read(rows[0], recent) + alpha[1] * self.read(rows[1], recent)


def saved_activation_bytes(fn, exclude=()):
    """Run fn(); return the bytes autograd saved for backward meanwhile, each storage counted once
    (several ops often save the same tensor), leaving out the storages of the tensors in `exclude`
    (pass the parameters to count activations alone: a saved weight is a reference to memory the
    model holds anyway). With activation checkpointing, a checkpointed region saves its inputs
    (counted) and recomputes its internals in backward (not saved, not counted)."""
    storages, skip = {}, {t.untyped_storage().data_ptr() for t in exclude}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(n for ptr, n in storages.items() if ptr not in skip)


def timed(fn, device):
    """The seconds fn() takes, the device synchronised before and after."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


class Runner:
    """One variant's model, optimizer and a fixed batch."""

    def __init__(self, spec, args, device, dtype):
        self.spec = spec
        self.model = make_model(variant_config(spec, args), seed=0).to(device)
        self.step_fn = compile_model(self.model, backend=args.compile_backend) if args.compile else self.model
        self.opt = torch.optim.AdamW(self.model.param_groups(0.1), lr=1e-4, fused=device.type == "cuda")
        g = torch.Generator().manual_seed(0)
        self.x = torch.randint(0, args.vocab_size, (args.batch_size, args.seq_len), generator=g).to(device)
        self.autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
        self.device, self.times = device, []

    def step(self, fn=None):
        with self.autocast:
            loss = (fn or self.step_fn)(self.x, self.x)[1]
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def memory(self):
        """(saved for backward in an eager step: every storage, and the activations alone (no parameter);
        the CUDA peak a compiled-or-not step adds, or None)."""
        saved = (saved_activation_bytes(lambda: self.step(self.model)),
                 saved_activation_bytes(lambda: self.step(self.model), exclude=list(self.model.parameters())))
        if self.device.type != "cuda":
            return saved, None
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        self.step()
        return saved, torch.cuda.max_memory_allocated() - base


def quartiles(xs):
    q = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else [xs[0]] * 3
    return q[0], statistics.median(xs), q[2]


def copy_bandwidth(device, nbytes=256 * 2**20, reps=10):
    """Bytes per second of a large device copy (read + write): the traffic ceiling in practice."""
    a = torch.ones(nbytes // 2 // 4, device=device)  # float32: nbytes / 2 read, as many written
    b = torch.empty_like(a)
    return nbytes / statistics.median(timed(lambda: b.copy_(a), device) for _ in range(reps))


def bench_block_routing(args, device, bandwidth, reps=10):
    """One block of S sites over n completed sources (float32, as the streams keep them): the
    router opened once, then each site reads with its partial sum. Per implementation and pass."""
    rows = []
    B, T, d = args.batch_size, args.seq_len, args.n_embd
    source = B * T * d * 4
    g = torch.Generator().manual_seed(0)
    for n, S in args.routing_blocks:
        completed = [torch.randn(B, T, d, generator=g).to(device).requires_grad_() for _ in range(n)]
        partials = [torch.randn(B, T, d, generator=g).to(device).requires_grad_() for _ in range(S - 1)]
        W = (0.1 * torch.randn(S, d, generator=g)).to(device).requires_grad_()
        grads = [torch.randn(B, T, d, generator=g).to(device) for _ in range(S)]
        floors = {"forward": (n + 2 * S - 1) * source, "forward+backward": (3 * n + 5 * S - 3) * source}
        for Router in (TwoPhaseRouter, ReferenceRouter):
            for what, floor in floors.items():
                def run():
                    router = Router(W, completed, [rms_inv(s) for s in completed])
                    hs = [router.read(i, partials[i - 1:i], [rms_inv(p) for p in partials[i - 1:i]]) for i in range(S)]
                    if what == "forward+backward":
                        torch.autograd.backward(hs, grads)

                run()
                t = statistics.median(timed(run, device) for _ in range(reps))
                rows.append(dict(sources=n, sites=S, impl=Router.__name__, pass_=what, ms=1e3 * t,
                                 floor_ms=1e3 * floor / bandwidth, of_floor=floor / bandwidth / t))
    return rows


MEMORY_MODEL = ["--n_layer=16", "--n_embd=512", "--n_head=8", "--max_steps=1", "--batch_size=1", "--seq_len=16",
                "--batch_tokens=32", "--eval_tokens=32"]


# The peak resident set of a command (ru_maxrss, KiB on Linux), read by a small launcher process: a child forked
# from this one would count this process's pages (the corpora it wrote) until its exec
LAUNCHER = """import os, subprocess, sys
p = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
err = p.stderr.read().decode(errors="replace")
_, status, usage = os.wait4(p.pid, 0)
print(usage.ru_maxrss if os.waitstatus_to_exitcode(status) == 0 else "failed: " + err.strip()[-300:])
"""


def peak_rss_bytes(cmd):
    """Run cmd (a list) from the project root with one thread; its peak resident set in bytes."""
    out = subprocess.run([sys.executable, "-c", LAUNCHER, *map(str, cmd)], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"}).stdout.strip()
    if not out.isdigit():
        raise UserError(f"{' '.join(map(str, cmd[1:3]))} {out or 'failed'}")
    return int(out) * 1024


def memory_figures():
    """{prepare_data: {MB: peak RSS}, ddp/fsdp: [peak RSS of each rank]} (see the module's doc)."""
    import gzip

    from prepare_data import DEFAULT_CORPUS
    out = {"prepare_data": {}}
    with tempfile.TemporaryDirectory() as tmp, gzip.open(DEFAULT_CORPUS, "rt") as f:
        text = "".join(json.loads(line)["text"] for line in f)
        for mb in (4, 16):
            src = Path(tmp) / f"c{mb}.txt"
            src.write_text((text * (mb * 2**20 // len(text) + 1))[:mb * 2**20])
            out["prepare_data"][mb] = peak_rss_bytes([sys.executable, "prepare_data.py", "--data_files", src,  # small
                                                      "--out_dir", Path(tmp) / f"data{mb}", "--tokenizer", "byte",  # shards:
                                                      "--shard_tokens", "1e5"])  # a shard's mapped pages count too
        for fsdp in ("false", "true"):
            run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py",
                   "configs/test.py", f"--data_dir={Path(tmp) / 'data4'}", f"--out_dir={tmp}", f"--run_name={fsdp}",
                   f"--fsdp={fsdp}", *MEMORY_MODEL]
            peak_rss_bytes(run)
            summary = json.loads((Path(tmp) / fsdp / "summary.json").read_text())
            out["fsdp" if fsdp == "true" else "ddp"] = summary["peak_memory_bytes_per_rank"]
    print("| what | peak resident set per process, MiB |\n| --- | --- |")
    for mb, peak in out["prepare_data"].items():
        print(f"| prepare_data.py, a {mb} MB corpus | {peak / 2**20:.0f} |")
    for kind in ("ddp", "fsdp"):
        print(f"| 2 ranks, {kind.upper()}, 16 x 512 model | {', '.join(f'{b / 2**20:.0f}' for b in out[kind])} |")
    print(f"FSDP's largest rank / DDP's smallest: {max(out['fsdp']) / min(out['ddp']):.2f}")
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default=DEFAULT_VARIANTS, help="comma-separated residual[:key=value...]")
    p.add_argument("--n_layer", type=int, default=8)
    p.add_argument("--n_embd", type=int, default=256)
    p.add_argument("--n_head", type=int, default=4)
    p.add_argument("--vocab_size", type=int, default=50304)
    p.add_argument("--seq_len", type=int, default=256)
    p.add_argument("--batch_size", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bf16"], help="auto: bf16 on CUDA, else float32")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--compile_backend", default="inductor", help="torch.compile backend (aot_eager: no code generation)")
    p.add_argument("--routing_blocks", default=[(4, 4), (8, 4), (16, 4)],
                   type=lambda s: [tuple(int(x) for x in b.split(":")) for b in s.split(",") if b],
                   help="completed sources:sites of the blocks in the routing table; empty: no table")
    p.add_argument("--memory", action="store_true", help="the process-level memory figures instead (see above)")
    p.add_argument("--out", default="bench.json")
    args = p.parse_args(argv)
    if args.memory:
        check_out(args.out)
        report = memory_figures()
        write_report(args.out, report)
        return report
    device, specs = check_args(args)
    dtype = torch.bfloat16 if args.dtype == "bf16" or (args.dtype == "auto" and device.type == "cuda") else torch.float32
    if args.compile:  # one graph per variant (and per grad mode): never fall back to eager without a word
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 2 * len(specs) + 2)
        torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit,
                                                               8 * len(specs))
        torch._dynamo.config.fail_on_recompile_limit_hit = True
    print(f"device {device}, {dtype}, compile={args.compile}: {args.n_layer} layers, width {args.n_embd}, "
          f"{args.batch_size} x {args.seq_len} tokens, vocab {args.vocab_size}")

    runners = [Runner(s, args, device, dtype) for s in specs]
    for r in runners:
        for _ in range(args.warmup):
            r.step()
    for _ in range(args.repeats):  # interleaved
        for r in runners:
            r.times.append(timed(r.step, device))
    results, ref = [], runners[specs.index("standard")]
    for r in runners:
        saved, peak = r.memory()
        lo, mid, hi = quartiles([t_ref / t for t, t_ref in zip(r.times, ref.times)])
        ms = statistics.median(r.times)
        results.append(dict(variant=r.spec, params=r.model.num_params(), ms=1e3 * ms,
                            tokens_per_s=args.batch_size * args.seq_len / ms, speed_ratio=mid,
                            speed_ratio_quartiles=(lo, hi), saved_activation_bytes=saved[0],
                            saved_without_parameters_bytes=saved[1], cuda_peak_bytes=peak,
                            step_s=r.times))  # every timed step, in round order: ratios of any two variants
    base = results[specs.index("standard")]
    for row in results:
        row["memory_ratio"] = row["saved_activation_bytes"] / base["saved_activation_bytes"]
        row["activation_ratio"] = row["saved_without_parameters_bytes"] / base["saved_without_parameters_bytes"]
        if row["cuda_peak_bytes"] is not None:
            row["peak_ratio"] = row["cuda_peak_bytes"] / base["cuda_peak_bytes"]
    cuda = device.type == "cuda"
    if cuda:
        from depthres.runlog import peak_flops
        peak = peak_flops(device)
        if peak:
            base["mfu"] = ref.model.flops_per_token() * base["tokens_per_s"] / peak
            print(f"standard: MFU {100 * base['mfu']:.1f}% of {peak / 1e12:.0f} TFLOP/s bf16")
    print("\n| variant | params | ms/step | tokens/s | vs standard (quartiles) | saved activations MiB | vs standard | "
          "without parameters | vs standard |" + (" CUDA step peak MiB | vs standard |" if cuda else ""))
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |" + (" --- | --- |" if cuda else ""))
    for r in results:
        peak = f" {r['cuda_peak_bytes'] / 2**20:.0f} | {r['peak_ratio']:.3f} |" if cuda else ""
        lo, hi = r["speed_ratio_quartiles"]
        print(f"| `{r['variant']}` | {r['params'] / 1e6:.2f}M | {r['ms']:.0f} | {r['tokens_per_s']:,.0f} | "
              f"{r['speed_ratio']:.3f} ({lo:.3f}-{hi:.3f}) | {r['saved_activation_bytes'] / 2**20:.1f} | "
              f"{r['memory_ratio']:.3f} | {r['saved_without_parameters_bytes'] / 2**20:.1f} | {r['activation_ratio']:.3f} |"
              f"{peak}")

    routing, bandwidth = [], None
    if args.routing_blocks:
        bandwidth = copy_bandwidth(device)
        routing = bench_block_routing(args, device, bandwidth)
        print(f"\nDepth routing of one block, {args.batch_size} x {args.seq_len} x {args.n_embd} float32 sources; "
              f"copy bandwidth {bandwidth / 1e9:.1f} GB/s")
        print("| completed sources | sites | impl | pass | ms | floor ms | fraction of floor speed |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for r in routing:
            print(f"| {r['sources']} | {r['sites']} | {r['impl']} | {r['pass_']} | {r['ms']:.2f} | {r['floor_ms']:.2f} "
                  f"| {r['of_floor']:.2f} |")

    write_report(args.out, dict(args=vars(args), device=str(device), dtype=str(dtype), bandwidth_bytes_per_s=bandwidth,
                                steps=results, routing=routing))
    return results, routing


if __name__ == "__main__":
    sys.exit(cli(main))
