"""Benchmark a training step of every residual variant against the standard residual, in one run.

    python -m tools.bench                         # CPU: a small model in float32
    python -m tools.bench --device cuda --n_layer 12 --n_embd 768 --n_head 6 --seq_len 1024 \\
        --batch_size 8 --dtype bf16 --compile     # the GPU size of the performance targets

Prints each variant's step time over `standard`'s and its saved activations, then the routing of one
block against its memory-traffic floor. Exit status 0, or 2 after one `error:` line. Reading the
figures (run it idle, or with OMP_NUM_THREADS=1): docs/performance.md.
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python tools/bench.py` as `python -m tools.bench`
import torch
import torch._dynamo

from common import UserError, cli, cpu_threads, need, os_error_message, write_atomic
from model import depth_attention
from model_fast import TwoPhaseRouter, compile_model, make_model, rms_inv
from tools import check_writable
from tools.diagnose import parse_device
from train import MODEL_TYPES, check_key, convert, model_config

DEFAULT_VARIANTS = "standard,full_attnres,block_attnres,rd_attnres,dar,hc,mhc,denseformer,muddformer,delta_attnres"
SHAPE_KEYS = ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "residual")  # bench's flags set them


def variant_config(spec, args):
    """The GPTConfig of a variant `residual[:key=value...]` at the benchmark's size."""
    name, *pairs = spec.split(":")
    kw = dict(vocab_size=args.vocab_size, block_size=args.seq_len, n_layer=args.n_layer, n_head=args.n_head,
              n_embd=args.n_embd, residual=name)
    try:
        for pair in pairs:
            key, sep, value = pair.partition("=")
            need(sep, f"{pair!r} is not key=value")
            need(key not in SHAPE_KEYS, f"{key} is set for every variant by bench's flags")
            need(check_key(key, "a variant") in MODEL_TYPES, f"{key} is a training key, not a model key")
            kw[key] = convert(key, value, MODEL_TYPES[key])
        return model_config(kw)
    except UserError as e:
        raise UserError(f"--variants {spec}: {e}") from None


# --- the instruments the fast path is measured with (here and in the tests) ---------------------------


class ReferenceRouter:
    """TwoPhaseRouter's interface over plain depth_attention: the reference of one chunk's routing.
    streams: DAR's (key stream, value stream) per target, else None."""

    def __init__(self, W, completed, inv=None, streams=None):
        self.W, self.completed, self.streams = W, completed, streams
        self.Qt = len(W) // (1 if streams is None else len(streams))

    def read(self, q, recent=(), inv=()):
        """h of query row q over the completed sources and `recent`."""
        sources = self.completed + list(recent)
        if self.streams is None:
            return depth_attention(self.W[q], sources)[0]
        ks, vs = self.streams[q // self.Qt]
        return depth_attention(self.W[q], [s[ks] for s in sources], [s[vs] for s in sources])[0]

    def read_rows(self, rows, recent=(), inv=()):
        """h of each of one site's query rows."""
        return [self.read(q, recent) for q in rows]

    def read_fused(self, rows, alpha, recent=(), inv=()):
        """DAR: h = alpha_0 r_0 + alpha_1 r_1 for one site's query rows."""
        return alpha[0] * self.read(rows[0], recent) + alpha[1] * self.read(rows[1], recent)


def saved_activation_bytes(fn, exclude=()):
    """Run fn(); the bytes autograd saved for backward meanwhile, each storage once, those of `exclude` left out."""
    storages, skip = {}, {t.untyped_storage().data_ptr() for t in exclude}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(n for ptr, n in storages.items() if ptr not in skip)


def timed(fn, device):
    """The seconds fn() takes, the device synchronised before and after."""
    synchronize = torch.get_device_module(device).synchronize  # (torch.cpu's: a no-op)
    synchronize()
    t0 = time.perf_counter()
    fn()
    synchronize()
    return time.perf_counter() - t0


class Runner:
    """One variant's model, optimizer and a fixed batch."""

    def __init__(self, spec, cfg, args, device, dtype):
        self.spec = spec
        self.model = make_model(cfg, seed=0).to(device)
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
        """((saved bytes, without parameters), the CUDA peak a step adds or None)."""
        saved = (saved_activation_bytes(lambda: self.step(self.model)),
                 saved_activation_bytes(lambda: self.step(self.model), exclude=list(self.model.parameters())))
        if self.device.type != "cuda":
            return saved, None
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        self.step()
        return saved, torch.cuda.max_memory_allocated() - base


def copy_bandwidth(device, nbytes=256 * 2**20, reps=10):
    """Bytes per second of a large device copy (read + write)."""
    a = torch.ones(nbytes // 2 // 4, device=device)  # float32: nbytes / 2 read, as many written
    b = torch.empty_like(a)
    return nbytes / statistics.median(timed(lambda: b.copy_(a), device) for _ in range(reps))


def bench_block_routing(args, device, bandwidth, reps=10):
    """One block of S sites over n completed sources: the router opened once, each site read."""
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
    p.add_argument("--out", default="bench.json")
    args = p.parse_args(argv)
    # every flag, variant and the output path, before any model is built
    for flag in ("n_layer", "n_embd", "n_head", "vocab_size", "seq_len", "batch_size", "repeats"):
        need(getattr(args, flag) >= 1, f"--{flag} must be at least 1, got {getattr(args, flag)}")
    need(args.warmup >= 0, f"--warmup must be at least 0, got {args.warmup}")
    need(all(len(b) == 2 and min(b) >= 1 for b in args.routing_blocks),
         "--routing_blocks: each block is sources:sites, both at least 1 (e.g. 4:4,8:4)")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else \
        parse_device(args.device, "auto, cpu, cuda or cuda:N")
    specs = args.variants.split(",")
    specs = specs if "standard" in specs else ["standard", *specs]
    configs = [variant_config(s, args) for s in specs]
    need(not os.path.isdir(args.out), f"--out {args.out} is a directory: pass the JSON file to write")
    try:
        check_writable(os.path.dirname(args.out) or ".")
    except OSError as e:
        raise UserError(os_error_message(e, args.out)) from None
    dtype = torch.bfloat16 if args.dtype == "bf16" or (args.dtype == "auto" and device.type == "cuda") else torch.float32
    if args.compile:  # one graph per variant (and per grad mode): never fall back to eager without a word
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 2 * len(specs) + 2)
        torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit,
                                                               8 * len(specs))
        torch._dynamo.config.fail_on_recompile_limit_hit = True
    if device.type == "cpu":
        torch.set_num_threads(cpu_threads())
    load, cores, threads = os.getloadavg()[0], os.cpu_count(), torch.get_num_threads()
    print(f"device {device}, {dtype}, compile={args.compile}: {args.n_layer} layers, width {args.n_embd}, "
          f"{args.batch_size} x {args.seq_len} tokens, vocab {args.vocab_size}; load {load:.1f} on {cores} cores, "
          f"{threads} torch threads")
    if device.type == "cpu" and load + threads > cores + 0.5:
        print(f"warning: this machine is busier than its cores (load {load:.1f} + {threads} threads > {cores} cores): "
              "the speed ratios are unreliable; run when it is idle, or with OMP_NUM_THREADS=1", file=sys.stderr)

    runners = [Runner(s, c, args, device, dtype) for s, c in zip(specs, configs)]
    for r in runners:
        for _ in range(args.warmup):
            r.step()
    for _ in range(args.repeats):  # interleaved
        for r in runners:
            r.times.append(timed(r.step, device))
    results, ref = [], runners[specs.index("standard")]
    for r in runners:
        saved, peak = r.memory()
        ratios = [t_ref / t for t, t_ref in zip(r.times, ref.times)]
        lo, mid, hi = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else ratios * 3  # mid: median
        ms = statistics.median(r.times)
        results.append(dict(variant=r.spec, params=r.model.num_params(), ms=1e3 * ms,
                            tokens_per_s=args.batch_size * args.seq_len / ms, speed_ratio=mid,
                            speed_ratio_quartiles=(lo, hi), saved_activation_bytes=saved[0],
                            saved_without_parameters_bytes=saved[1], cuda_peak_bytes=peak,
                            step_s=r.times))  # every timed step, in round order: ratios of any two variants
    base, cuda = results[specs.index("standard")], device.type == "cuda"
    for row in results:
        row["memory_ratio"] = row["saved_activation_bytes"] / base["saved_activation_bytes"]
        row["activation_ratio"] = row["saved_without_parameters_bytes"] / base["saved_without_parameters_bytes"]
        if cuda:
            row["peak_ratio"] = row["cuda_peak_bytes"] / base["cuda_peak_bytes"]
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
    report = dict(args=vars(args), device=str(device), dtype=str(dtype), bandwidth_bytes_per_s=bandwidth,
                  load=dict(load_1min=load, cores=cores, torch_threads=threads), steps=results, routing=routing)
    try:
        write_atomic(args.out, json.dumps(report, indent=1) + "\n")
    except OSError as e:  # checked before the benchmark ran: the disk filled, or the directory went away
        raise UserError(f"{os_error_message(e, args.out)}; the tables above hold the numbers") from None
    print(f"\nwrote {args.out}")
    return results, routing


if __name__ == "__main__":
    sys.exit(cli(main))
