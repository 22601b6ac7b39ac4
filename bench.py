"""
Benchmark a training step of every residual variant against the standard residual, in one run.

    python bench.py                                   # CPU: a small model in float32
    python bench.py --device cuda --n_layer 12 --n_embd 768 --n_head 6 --seq_len 1024 \\
        --batch_size 8 --dtype bf16 --compile         # the GPU size of the performance targets

Each variant runs a full training step (forward, backward, AdamW). Repeats are interleaved across
variants and the median is reported, so a slow moment of the machine hits every variant alike.
Ratios are against `standard` from the same run. Memory is what a step adds on top of weights and
optimizer state: on GPU the CUDA peak; on CPU the bytes autograd saves for backward (each storage
counted once) and the growth of the process' peak RSS. A second table times the depth-routing
operation alone against its memory-traffic floor: the bytes it must move over the bandwidth of a
plain copy on the same device.

Variants are `residual[:key=value...]`, e.g. `rd_attnres:rd_mode=tied`, `full_attnres:depth_impl=reference`.
"""

import argparse
import json
import statistics
import time

import torch

from model import GPT, GPTConfig, depth_attention

DEFAULT_VARIANTS = "standard,full_attnres,block_attnres,rd_attnres,dar,hc,mhc"


def parse_variant(spec):
    name, *pairs = spec.split(":")
    kw = dict(residual=name)
    for pair in pairs:
        key, value = pair.split("=")
        field = GPTConfig.__dataclass_fields__[key]
        kw[key] = {int: int, float: float, bool: lambda v: v.lower() in ("1", "true")}.get(field.type, str)(value)
    return kw


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


class Runner:
    """One variant's model, optimizer and a fixed batch."""

    def __init__(self, spec, args, device, dtype):
        self.spec = spec
        cfg = GPTConfig(vocab_size=args.vocab_size, block_size=args.seq_len, n_layer=args.n_layer,
                        n_head=args.n_head, n_embd=args.n_embd, **parse_variant(spec))
        self.model = GPT(cfg, seed=0).to(device)
        self.step_fn = torch.compile(self.model) if args.compile else self.model
        self.opt = torch.optim.AdamW(self.model.param_groups(0.1), lr=1e-4, fused=device.type == "cuda")
        g = torch.Generator().manual_seed(0)
        self.x = torch.randint(0, args.vocab_size, (args.batch_size, args.seq_len), generator=g).to(device)
        self.autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
        self.device, self.times = device, []

    def step(self):
        with self.autocast:
            loss = self.step_fn(self.x, self.x)[1]
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def timed_step(self):
        sync(self.device)
        t0 = time.perf_counter()
        self.step()
        sync(self.device)
        self.times.append(time.perf_counter() - t0)

    def memory(self):
        """Bytes a step adds: (CUDA peak or saved activations, peak RSS growth or None)."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            self.step()
            return torch.cuda.max_memory_allocated() - base, None
        rss0 = reset_peak_rss()
        saved = saved_activation_bytes(self.step)
        return saved, peak_rss() - rss0


def saved_activation_bytes(fn):
    """Run fn(); return the bytes autograd saved for backward meanwhile, each storage counted once
    (several ops often save the same tensor)."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(storages.values())


def reset_peak_rss():
    """Reset the kernel's peak-RSS mark of this process; return the current RSS in bytes."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_kb("VmRSS") * 1024


def peak_rss():
    return _status_kb("VmHWM") * 1024


def _status_kb(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))


def copy_bandwidth(device, dtype, nbytes=256 * 2**20, reps=10):
    """Bytes per second of a large device copy (read + write): the traffic ceiling in practice."""
    a = torch.empty(nbytes // 2 // dtype.itemsize, dtype=dtype, device=device).fill_(1)
    b = torch.empty_like(a)
    times = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        b.copy_(a)
        sync(device)
        times.append(time.perf_counter() - t0)
    return 2 * a.numel() * dtype.itemsize / statistics.median(times)


def bench_routing_op(args, device, dtype, bandwidth, reps=10):
    """Depth attention over n sources alone, forward and forward + backward, per implementation."""
    rows = []
    B, T, d = args.batch_size, args.seq_len, args.n_embd
    source_bytes = B * T * d * dtype.itemsize
    g = torch.Generator().manual_seed(0)
    for n in args.routing_sources:
        srcs = [torch.randn(B, T, d, generator=g).to(device, dtype).requires_grad_() for _ in range(n)]
        w = torch.randn(d, generator=g).to(device).requires_grad_()
        grad = torch.randn(B, T, d, generator=g).to(device, dtype)
        floors = {"forward": (n + 1) * source_bytes, "forward+backward": (3 * n + 2) * source_bytes}
        for impl in ("lean", "reference"):
            for what, floor in floors.items():
                def run():
                    h = depth_attention(w, srcs, impl=impl)[0]
                    if what == "forward+backward":
                        torch.autograd.grad(h, [w, *srcs], grad)

                run()
                times = []
                for _ in range(reps):
                    sync(device)
                    t0 = time.perf_counter()
                    run()
                    sync(device)
                    times.append(time.perf_counter() - t0)
                t = statistics.median(times)
                rows.append(dict(sources=n, impl=impl, pass_=what, ms=1e3 * t, floor_ms=1e3 * floor / bandwidth,
                                 of_floor=floor / bandwidth / t))
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
    p.add_argument("--routing_sources", type=lambda s: [int(x) for x in s.split(",")], default=[9, 17],
                   help="source counts for the routing-op table (9: Block S=4 readout at 16 sublayers; 17: Full)")
    p.add_argument("--out", default="bench.json")
    args = p.parse_args(argv)

    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          "cpu" if args.device == "auto" else args.device)
    dtype = torch.bfloat16 if args.dtype == "bf16" or (args.dtype == "auto" and device.type == "cuda") else torch.float32
    specs = args.variants.split(",")
    if "standard" not in specs:
        specs.insert(0, "standard")
    print(f"device {device}, {dtype}, compile={args.compile}: {args.n_layer} layers, width {args.n_embd}, "
          f"{args.batch_size} x {args.seq_len} tokens, vocab {args.vocab_size}")

    runners = [Runner(s, args, device, dtype) for s in specs]
    for r in runners:
        for _ in range(args.warmup):
            r.step()
    for _ in range(args.repeats):  # interleaved
        for r in runners:
            r.timed_step()
    results = []
    for r in runners:
        mem, rss = r.memory()
        results.append(dict(variant=r.spec, params=r.model.num_params(), ms=1e3 * statistics.median(r.times),
                            tokens_per_s=args.batch_size * args.seq_len / statistics.median(r.times),
                            memory_bytes=mem, peak_rss_growth_bytes=rss))
    ref = results[0]
    for row in results:
        row["speed_ratio"] = row["tokens_per_s"] / ref["tokens_per_s"]
        row["memory_ratio"] = row["memory_bytes"] / ref["memory_bytes"]
    mem_name = "CUDA peak" if device.type == "cuda" else "saved activations"
    print(f"\n| variant | params | ms/step | tokens/s | vs standard | {mem_name} MiB | vs standard |"
          + (" peak RSS growth MiB |" if device.type == "cpu" else ""))
    print("| --- | --- | --- | --- | --- | --- | --- |" + (" --- |" if device.type == "cpu" else ""))
    for r in results:
        rss = f" {r['peak_rss_growth_bytes'] / 2**20:.0f} |" if device.type == "cpu" else ""
        print(f"| `{r['variant']}` | {r['params'] / 1e6:.2f}M | {r['ms']:.0f} | {r['tokens_per_s']:,.0f} | "
              f"{r['speed_ratio']:.3f} | {r['memory_bytes'] / 2**20:.1f} | {r['memory_ratio']:.3f} |{rss}")

    bandwidth = copy_bandwidth(device, dtype)
    routing = bench_routing_op(args, device, dtype, bandwidth)
    print(f"\nDepth attention alone, {args.batch_size} x {args.seq_len} x {args.n_embd} sources; "
          f"copy bandwidth {bandwidth / 1e9:.1f} GB/s")
    print("| sources | impl | pass | ms | floor ms | fraction of floor speed |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in routing:
        print(f"| {r['sources']} | {r['impl']} | {r['pass_']} | {r['ms']:.2f} | {r['floor_ms']:.2f} | {r['of_floor']:.2f} |")

    with open(args.out, "w") as f:
        json.dump(dict(args=vars(args), device=str(device), dtype=str(dtype), bandwidth_bytes_per_s=bandwidth,
                       steps=results, routing_op=routing), f, indent=1)
    print(f"\nwrote {args.out}")
    return results, routing


if __name__ == "__main__":
    main()
