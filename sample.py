"""Sample text from a checkpoint, with a key/value cache (docs/sampling.md). Exit status 0, or 2 after one `error:` line.

    python sample.py --ckpt runs/demo --prompt "ROMEO:" --num_samples 3 --max_new_tokens 200
    python sample.py --ckpt runs/demo/ckpt.pt --temperature 0   # greedy, unconditional
"""

import argparse
import math
import sys
import time
from pathlib import Path

import torch

from common import UserError, cli, cpu_threads, need, os_error_message
from data import get_tokenizer
from model import stable_seed
from model_fast import load_model

DEFAULT_BATCH_SIZE = 32  # samples decoded together at most (--batch_size)


class KVCache:
    """Keys and values of past positions, per layer."""

    def __init__(self, cfg, batch_size, device=None, dtype=torch.float32):
        shape = (cfg.n_layer, batch_size, cfg.n_head, cfg.block_size, cfg.n_embd // cfg.n_head)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.pos = 0  # positions filled so far

    def update(self, layer, k, v):
        T = k.size(2)
        self.k[layer, :, :, self.pos:self.pos + T] = k
        self.v[layer, :, :, self.pos:self.pos + T] = v
        return self.k[layer, :, :, :self.pos + T], self.v[layer, :, :, :self.pos + T]


class Window:
    """The tokens the model conditions on, one row per sample, and their cache."""

    def __init__(self, model, prompts, use_cache=True):
        self.model, self.use_cache = model, use_cache
        self.tokens = torch.tensor([list(p)[-model.cfg.block_size:] for p in prompts], device=model.wte.weight.device)
        self.cache = None  # created on first use, dropped when the window slides

    def append(self, tokens):
        """tokens [B]: the next token of every row."""
        self.tokens = torch.cat([self.tokens, tokens.view(-1, 1).to(self.tokens.device)], 1)
        if self.tokens.size(1) > self.model.cfg.block_size:  # slide: the last half starts a fresh window
            self.tokens = self.tokens[:, -max(1, self.model.cfg.block_size // 2):]
            self.cache = None

    @torch.no_grad()
    def next_logits(self):
        """Logits [B, vocab] for the token after each row."""
        if self.use_cache and self.cache is None:
            weight = self.model.wte.weight
            self.cache = KVCache(self.model.cfg, len(self.tokens), weight.device, weight.dtype)
        new = self.tokens if self.cache is None else self.tokens[:, self.cache.pos:]  # all after a slide, else the last
        return self.model(new, kv_cache=self.cache)[0][:, -1]


def filter_logits(logits, top_k=None, top_p=None):
    """-inf outside the top_k largest logits, then outside the top_p nucleus."""
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        ordered, order = logits.sort(-1, descending=True)
        probs = ordered.softmax(-1)
        outside = probs.cumsum(-1) - probs >= top_p  # the more likely tokens already reach top_p
        outside[..., 0] = False
        logits = torch.empty_like(logits).scatter_(-1, order, ordered.masked_fill(outside, float("-inf")))
    return logits


def sample_logits(logits, temperature=1.0, top_k=None, top_p=None, generators=None):
    """Token ids [B] from logits [B, vocab]: argmax at temperature 0, else drawn per row."""
    if temperature < torch.finfo(logits.dtype).tiny:  # 0, or so small that dividing by it overflows: greedy
        return logits.argmax(-1)
    scaled = (logits - logits.amax(-1, keepdim=True)) / temperature  # max first: a tiny temperature gives -inf, not NaN
    probs = filter_logits(scaled, top_k, top_p).softmax(-1)
    generators = generators or [None] * len(probs)
    return torch.cat([torch.multinomial(p, 1, generator=g) for p, g in zip(probs, generators)])


def generate(model, prompts, max_new_tokens, temperature=1.0, top_k=None, top_p=None,
             generators=None, use_cache=True, vocab_size=None):
    """Yield the next token ids [B] continuing the B prompts (of one length), max_new_tokens times."""
    window = Window(model, prompts, use_cache)
    for _ in range(max_new_tokens):
        tokens = sample_logits(window.next_logits()[:, :vocab_size], temperature, top_k, top_p, generators)
        yield tokens
        window.append(tokens)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", required=True, help="a run directory (holding ckpt.pt) or a checkpoint file")
    prompt = p.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", help="prompt text (default: the end-of-text token alone)")
    prompt.add_argument("--prompt_file", help="read the prompt from this UTF-8 file")
    p.add_argument("--num_samples", type=int, default=1, help="samples (default 1)")
    p.add_argument("--batch_size", type=int, default=DEFAULT_BATCH_SIZE,
                   help=f"samples decoded together at most (default {DEFAULT_BATCH_SIZE})")
    p.add_argument("--max_new_tokens", type=int, default=256, help="tokens per sample at most (default 256)")
    p.add_argument("--temperature", type=float, default=1.0, help="softmax temperature; 0 is greedy (default 1)")
    p.add_argument("--top_k", type=int, help="draw from the k most likely tokens only (default: all)")
    p.add_argument("--top_p", type=float, help="draw from the nucleus of this probability, in (0, 1] (default: 1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the samples' random streams (default 0)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: cuda if available, else cpu (default auto)")
    p.add_argument("--no_cache", action="store_true", help="a full forward pass per token, for comparison")
    args = p.parse_args(argv)
    for name in ("num_samples", "batch_size", "max_new_tokens"):
        need(getattr(args, name) >= 1, f"--{name} must be at least 1, got {getattr(args, name)}")
    need(math.isfinite(args.temperature) and args.temperature >= 0,
         f"--temperature must be a finite number >= 0 (0 is greedy), got {args.temperature}")
    need(args.top_k is None or args.top_k >= 1, f"--top_k must be at least 1, got {args.top_k}")
    need(args.top_p is None or 0 < args.top_p <= 1, f"--top_p must be in (0, 1], got {args.top_p}")
    need(args.device != "cuda" or torch.cuda.is_available(), "--device cuda: no CUDA device is available")
    return args


def run(args):
    text = args.prompt
    if args.prompt_file is not None:
        try:
            text = Path(args.prompt_file).read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise UserError(f"prompt file {args.prompt_file} is not UTF-8 text ({e})") from None
        except OSError as e:  # (missing, a directory, unreadable)
            raise UserError(os_error_message(e, args.prompt_file, "read the prompt file")) from None
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if device == "cpu":
        torch.set_num_threads(cpu_threads())
    model, ckpt = load_model(args.ckpt, device)
    tok = get_tokenizer(ckpt["tokenizer"])
    prompt = tok.encode(text) if text else [tok.eot]  # no prompt: the start of a new document
    if len(prompt) > model.cfg.block_size:
        print(f"warning: the prompt has {len(prompt)} tokens, more than block_size={model.cfg.block_size}; "
              f"the model sees its last {model.cfg.block_size}", file=sys.stderr)
    n, batch_size = args.num_samples, min(args.batch_size, args.num_samples)
    n_tokens, t0 = 0, time.perf_counter()
    for first in range(0, n, batch_size):  # a batch at a time: its cache and generators, then the next
        rows = range(first, min(n, first + batch_size))
        generators = [torch.Generator(device).manual_seed(stable_seed(args.seed, i)) for i in rows]
        samples, done = [[] for _ in rows], [False] * len(rows)
        for tokens in generate(model, [prompt] * len(rows), args.max_new_tokens, args.temperature, args.top_k,
                               args.top_p, generators, use_cache=not args.no_cache, vocab_size=tok.vocab_size):
            for r, t in enumerate(tokens.tolist()):
                if not done[r]:  # a sample ends at end-of-text (counted, not printed)
                    n_tokens += 1
                    done[r] = t == tok.eot
                    samples[r] += [] if done[r] else [t]
            if all(done):
                break
        for i, sample in zip(rows, samples):
            print(("-" * 40 + "\n") * (i > 0) + tok.decode(prompt * bool(text) + sample), flush=True)
    dt = time.perf_counter() - t0
    batch = (f"{n} samples in batches of {batch_size}, " if n > batch_size else
             f"{n} samples in one batch, " if n > 1 else "")
    print(f"{n_tokens} tokens in {dt:.2f}s ({n_tokens / dt:.1f} tokens/s, {batch}"
          f"{'no cache' if args.no_cache else 'kv cache'}, {device})", file=sys.stderr)


def main(argv=None):
    return cli(lambda argv: run(parse_args(argv)), argv)


if __name__ == "__main__":
    sys.exit(main())
