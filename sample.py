"""
Sample text from a checkpoint, decoding incrementally with a key/value cache.

    python sample.py --ckpt runs/demo --prompt "ROMEO:" --num_samples 3 --max_new_tokens 200
    python sample.py --ckpt runs/demo/ckpt.pt --temperature 0          # greedy, unconditional

The prompt is prefilled once, then the model decodes one token per step against its KVCache. Depth
routing in every residual variant works per position, so the attention keys and values are all a
variant needs cached.

Prompt: without --prompt or --prompt_file the prompt is the end-of-text token alone. prepare_data.py
puts EOT before every document, so this samples the start of a new document (unconditional).
A sample ends after --max_new_tokens tokens or at an end-of-text token, whichever comes first.

Batches: --num_samples N decodes the N samples in batches of at most --batch_size (default 32), one
forward pass per token for all the samples of a batch, so memory stays bounded however many samples
are asked for (a batch holds its key/value cache: 2 x n_layer x batch x block_size x n_embd floats).
Each sample draws from its own random stream, a torch.Generator seeded with
model.stable_seed(seed, i), a hash of (--seed, i): so the samples of a batch are independent, and sample i
is the same text whatever the batch size (the first k samples of a run of N are the run of k with
the same seed). One caveat: matrix products of another batch size may round differently (float32
logits here differ by about 1e-6), which can, rarely, tip a draw or a near-tie the other way.
Samples end independently; a finished row keeps decoding with the others, and its text stops at its
end. Text is printed in order: the first unfinished sample streams as it is decoded, a later one
prints what it has when its turn comes and streams from there.

Context: the model sees a window of at most block_size tokens. A longer prompt keeps its last
block_size tokens (with a warning). When the window is full and one more token arrives, the window
slides: its last block_size // 2 tokens start a fresh window (with the cache: a fresh cache, prefilled
with them) and decoding goes on. The rows of a batch share their positions, so they slide together.
--no_cache runs a full forward pass over the same window at every step, so both paths give the same
tokens under greedy decoding.

Exit status: 0 done; 2 with one `error:` line (bad flags, prompt or checkpoint); 130 on Ctrl-C.
"""

import argparse
import codecs
import math
import sys
import time
from pathlib import Path

import torch

from common import UserError, cli, load_model, need
from depthres.token_data import get_tokenizer
from model import stable_seed

DEFAULT_BATCH_SIZE = 32  # samples decoded together at most (--batch_size)


# -----------------------------------------------------------------------------
# generation


class KVCache:
    """Keys and values of past positions, per layer: what model.forward reads (pos) and fills (update)."""

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
    """The tokens the model conditions on, one row per sample (all of one length), under the sliding
    rule of the module docstring, and (use_cache=True) their key/value cache."""

    def __init__(self, model, prompts, use_cache=True):
        self.model, self.use_cache = model, use_cache
        self.block_size = model.cfg.block_size
        rows = [list(p)[-self.block_size:] for p in prompts]
        self.tokens = torch.tensor(rows, device=model.wte.weight.device)  # [B, T]
        self.cache = None  # created on first use, dropped when the window slides

    def append(self, tokens):
        """tokens [B]: the next token of every row."""
        self.tokens = torch.cat([self.tokens, tokens.view(-1, 1).to(self.tokens.device)], 1)
        if self.tokens.size(1) > self.block_size:
            self.tokens = self.tokens[:, -max(1, self.block_size // 2):]
            self.cache = None

    @torch.no_grad()
    def next_logits(self):
        """Logits [B, vocab] for the token after each row; call once per appended token."""
        weight = self.model.wte.weight
        new = self.tokens
        if self.use_cache:
            if self.cache is None:
                self.cache = KVCache(self.model.cfg, len(self.tokens), weight.device, weight.dtype)
            new = self.tokens[:, self.cache.pos:]  # the whole window after a slide, else the last token
        logits, _ = self.model(new, kv_cache=self.cache)
        return logits[:, -1]


def filter_logits(logits, top_k=None, top_p=None):
    """Set to -inf every logit outside the top_k largest (ties with the k-th stay), then, of the
    rest, every one outside the nucleus: the most likely tokens whose probabilities, renormalised
    after top_k, first reach top_p in total. The most likely token always stays. logits [..., vocab]."""
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        ordered, order = logits.sort(-1, descending=True)
        probs = ordered.softmax(-1)
        outside = probs.cumsum(-1) - probs >= top_p  # the probability of the more likely tokens reaches top_p
        outside[..., 0] = False  # but the most likely one's (a top_p that rounds to 0 in float32 reaches 0)
        ordered = ordered.masked_fill(outside, float("-inf"))
        logits = torch.empty_like(logits).scatter_(-1, order, ordered)
    return logits


def sample_logits(logits, temperature=1.0, top_k=None, top_p=None, generators=None):
    """Token ids [B] from logits [B, vocab]: the argmax of each row when temperature is 0 (or below the
    smallest normal float, its limit), else row b draws from softmax(logits[b] / temperature) after
    filter_logits, with generators[b] (None: the global generator)."""
    if temperature < torch.finfo(logits.dtype).tiny:  # 0, or so small that dividing by it overflows: greedy
        return logits.argmax(-1)
    # the row's largest logit subtracted first: a tiny temperature then sends the others to -inf, not NaN
    scaled = (logits - logits.amax(-1, keepdim=True)) / temperature
    probs = filter_logits(scaled, top_k, top_p).softmax(-1)
    generators = generators or [None] * len(probs)
    return torch.cat([torch.multinomial(p, 1, generator=g) for p, g in zip(probs, generators)])


def generate(model, prompts, max_new_tokens, temperature=1.0, top_k=None, top_p=None,
             generators=None, use_cache=True, vocab_size=None):
    """Yield max_new_tokens steps, each the next token ids [B] of the B = len(prompts) rows that
    continue prompts (non-empty token lists of one length), one forward pass per step.
    generators: one per row, its random stream. vocab_size: draw only from the first vocab_size ids
    (a model's vocabulary is padded past its tokenizer's)."""
    if len(prompts) == 0 or any(len(p) == 0 for p in prompts):
        raise ValueError("generate needs at least one prompt, each of at least one token")
    if len({len(p) for p in prompts}) > 1:
        raise ValueError(f"the prompts of a batch must have one length, got {sorted({len(p) for p in prompts})}")
    if generators is not None and len(generators) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(generators)} generators")
    window = Window(model, prompts, use_cache)
    for _ in range(max_new_tokens):
        tokens = sample_logits(window.next_logits()[:, :vocab_size], temperature, top_k, top_p, generators)
        yield tokens
        window.append(tokens)


class SampleWriter:
    """Prints the samples of a batch in the order the module docstring states, each starting with the
    prompt text, a line of dashes between them. A sample ends at the stop token (not printed) or at
    finish(). Its text goes through an incremental UTF-8 decoder: a character whose bytes are split
    across tokens is held back until its last byte arrives, and bytes that can never complete one
    print as U+FFFD at once (each token's bytes are decoded once)."""

    def __init__(self, n, tokenizer, out, prompt_text, stop_token, first=0):
        """first: how many samples were printed before these (a later batch: a separator before its first)."""
        self.tokenizer, self.out, self.prompt_text, self.stop_token = tokenizer, out, prompt_text, stop_token
        self.first = first
        self.tokens = [[] for _ in range(n)]  # of each sample, up to its end
        self.done = [False] * n
        self.current, self.decoder, self.written = 0, None, 0  # the sample being printed

    def add(self, tokens):
        """tokens: the next token of every sample (ignored for the finished ones). Returns how many
        count: the tokens of samples that had not ended, stop tokens included."""
        counted = 0
        for row, token in enumerate(tokens):
            if self.done[row]:
                continue
            counted += 1
            if token == self.stop_token:
                self.done[row] = True
            else:
                self.tokens[row].append(token)
        self._print()
        return counted

    def finish(self):
        """End every sample (at max_new_tokens) and print the rest."""
        self.done = [True] * len(self.done)
        self._print()

    def _print(self):
        while self.current < len(self.tokens):
            if self.decoder is None:  # the current sample's start
                if self.first + self.current > 0:
                    self._write("-" * 40 + "\n")
                self._write(self.prompt_text)
                self.decoder, self.written = codecs.getincrementaldecoder("utf-8")(errors="replace"), 0
            row = self.tokens[self.current]
            for token in row[self.written:]:
                self._write(self.decoder.decode(self.tokenizer.decode_bytes([token])))
            self.written = len(row)
            if not self.done[self.current]:
                return
            self._write(self.decoder.decode(b"", final=True) + "\n")  # what is held back: U+FFFD
            self.current, self.decoder = self.current + 1, None

    def _write(self, text):
        if text:
            self.out.write(text)
            self.out.flush()

    @property
    def all_done(self):
        return all(self.done)


# -----------------------------------------------------------------------------
# command line


def parse_args(argv):
    """The flags, each checked."""
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
    need(args.num_samples >= 1, f"--num_samples must be at least 1, got {args.num_samples}")
    need(args.batch_size >= 1, f"--batch_size must be at least 1, got {args.batch_size}")
    need(args.max_new_tokens >= 1, f"--max_new_tokens must be at least 1, got {args.max_new_tokens}")
    need(math.isfinite(args.temperature) and args.temperature >= 0,
         f"--temperature must be a finite number >= 0 (0 is greedy), got {args.temperature}")
    need(args.top_k is None or args.top_k >= 1, f"--top_k must be at least 1, got {args.top_k}")
    need(args.top_p is None or 0 < args.top_p <= 1, f"--top_p must be in (0, 1], got {args.top_p}")
    need(args.device != "cuda" or torch.cuda.is_available(), "--device cuda: no CUDA device is available")
    return args


def read_prompt(args):
    """The prompt text, or None for the default (unconditional) prompt."""
    if args.prompt_file is not None:
        path = Path(args.prompt_file)
        if not path.is_file():
            raise UserError(f"prompt file {path} not found")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise UserError(f"prompt file {path} is not UTF-8 text ({e})") from e
        if not text:
            raise UserError(f"prompt file {path} is empty: write a prompt in it, "
                            "or drop --prompt_file to sample unconditionally")
        return text
    if args.prompt == "":
        raise UserError("the prompt is empty: pass some text, or drop --prompt to sample unconditionally")
    if args.prompt is not None:
        try:  # argv bytes that are not UTF-8 arrive as lone surrogates
            args.prompt.encode("utf-8")
        except UnicodeEncodeError:
            raise UserError("--prompt is not valid UTF-8 text: pass UTF-8, or put the prompt in a UTF-8 file "
                            "and use --prompt_file") from None
    return args.prompt


def run(args):
    text = read_prompt(args)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    model, ckpt = load_model(args.ckpt, device)
    tokenizer = get_tokenizer(ckpt["tokenizer"])
    if model.cfg.vocab_size < tokenizer.vocab_size:  # its ids would index past the embedding
        raise UserError(f"{args.ckpt}: the model's vocab_size={model.cfg.vocab_size} is smaller than its "
                        f"tokenizer {tokenizer.name!r}'s {tokenizer.vocab_size} tokens: the checkpoint does not "
                        "match its tokenizer; use an intact copy or another checkpoint")
    prompt_ids = [tokenizer.eot] if text is None else tokenizer.encode(text)
    block_size = model.cfg.block_size
    if len(prompt_ids) > block_size:
        print(f"warning: the prompt has {len(prompt_ids)} tokens, more than block_size={block_size}; "
              f"the model sees its last {block_size}", file=sys.stderr)
    n, batch_size = args.num_samples, min(args.batch_size, args.num_samples)
    n_tokens, t0 = 0, time.perf_counter()
    for first in range(0, n, batch_size):  # a batch at a time: its cache, generators and texts, then the next
        rows = range(first, min(n, first + batch_size))
        generators = [torch.Generator(device).manual_seed(stable_seed(args.seed, i)) for i in rows]
        writer = SampleWriter(len(rows), tokenizer, sys.stdout, text or "", tokenizer.eot, first)
        for tokens in generate(model, [prompt_ids] * len(rows), args.max_new_tokens, args.temperature, args.top_k,
                               args.top_p, generators, use_cache=not args.no_cache, vocab_size=tokenizer.vocab_size):
            n_tokens += writer.add(tokens.tolist())
            if writer.all_done:  # every sample of the batch reached end-of-text
                break
        writer.finish()
    dt = time.perf_counter() - t0
    batch = (f"{n} samples in batches of {batch_size}, " if n > batch_size else
             f"{n} samples in one batch, " if n > 1 else "")
    print(f"{n_tokens} tokens in {dt:.2f}s ({n_tokens / dt:.1f} tokens/s, {batch}"
          f"{'no cache' if args.no_cache else 'kv cache'}, {device})", file=sys.stderr)
    return 0


def main(argv=None):
    """The command line; its exit status (depthres.cli: a closed stdout, `| head`, ends it quietly)."""
    return cli(lambda argv: run(parse_args(argv)), argv)


if __name__ == "__main__":
    sys.exit(main())
