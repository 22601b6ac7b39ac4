"""
Sample text from a checkpoint, decoding incrementally with a key/value cache.

    python sample.py --ckpt runs/demo --prompt "ROMEO:" --num_samples 3 --max_new_tokens 200
    python sample.py --ckpt runs/demo/ckpt.pt --temperature 0          # greedy, unconditional

The prompt is prefilled once, then the model decodes one token per step against its KVCache. Depth
routing in every residual variant works per position, so the attention keys and values are all a
variant needs cached: this file touches the model only through forward() and KVCache.

Prompt: without --prompt or --prompt_file the prompt is the end-of-text token alone. prepare_data.py
puts EOT before every document, so this samples the start of a new document (unconditional).
A sample ends after --max_new_tokens tokens or at an end-of-text token, whichever comes first.

Context: the model sees a window of at most block_size tokens. A longer prompt keeps its last
block_size tokens (with a warning). When the window is full and one more token arrives, the window
slides: its last block_size // 2 tokens start a fresh window (with the cache: a fresh cache, prefilled
with them) and decoding goes on. --no_cache runs a full forward pass over the same window at every
step, so both paths give the same tokens under greedy decoding.
"""

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from model import GPT, GPTConfig, KVCache
from prepare_data import DataError, get_tokenizer
from train import CheckpointError, load_checkpoint


class UsageError(ValueError):
    """Bad input (flags, prompt, a checkpoint that does not fit): `error: ...`, exit code 2."""


# -----------------------------------------------------------------------------
# generation


class Window:
    """The tokens the model conditions on, under the sliding rule of the module docstring, and
    (use_cache=True) their key/value cache. Batch size 1."""

    def __init__(self, model, prompt_ids, use_cache=True):
        self.model, self.use_cache = model, use_cache
        self.block_size = model.cfg.block_size
        self.tokens = list(prompt_ids)[-self.block_size:]
        self.cache = None  # created on first use, dropped when the window slides

    def append(self, token):
        self.tokens.append(token)
        if len(self.tokens) > self.block_size:
            self.tokens = self.tokens[-max(1, self.block_size // 2):]
            self.cache = None

    @torch.no_grad()
    def next_logits(self):
        """Logits [vocab] for the token after the window; call once per appended token."""
        weight = self.model.wte.weight
        new = self.tokens
        if self.use_cache:
            if self.cache is None:
                self.cache = KVCache(self.model.cfg, 1, weight.device, weight.dtype)
            new = self.tokens[self.cache.pos:]  # the whole window after a slide, else the last token
        logits, _ = self.model(torch.tensor([new], device=weight.device), kv_cache=self.cache)
        return logits[0, -1]


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
        before = probs.cumsum(-1) - probs  # probability of the more likely tokens
        ordered = ordered.masked_fill(before >= top_p, float("-inf"))
        logits = torch.empty_like(logits).scatter_(-1, order, ordered)
    return logits


def sample_logits(logits, temperature=1.0, top_k=None, top_p=None, generator=None):
    """One token id from logits [vocab]: the argmax when temperature is 0, else a draw from
    softmax(logits / temperature) after filter_logits."""
    if temperature == 0:
        return int(logits.argmax())
    probs = filter_logits(logits / temperature, top_k, top_p).softmax(-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def generate(model, prompt_ids, max_new_tokens, temperature=1.0, top_k=None, top_p=None,
             generator=None, use_cache=True, vocab_size=None):
    """Yield max_new_tokens token ids that continue prompt_ids (a non-empty list), one per step.
    vocab_size: draw only from the first vocab_size ids (a model's vocabulary is padded past its
    tokenizer's). use_cache=False runs a full forward pass over the window at every step."""
    if len(prompt_ids) == 0:
        raise ValueError("generate needs a prompt of at least one token")
    window = Window(model, prompt_ids, use_cache)
    for _ in range(max_new_tokens):
        token = sample_logits(window.next_logits()[:vocab_size], temperature, top_k, top_p, generator)
        yield token
        window.append(token)


class TextStream:
    """Writes the text of tokens as they come. A character whose UTF-8 bytes are split across
    tokens decodes to U+FFFD until its last byte arrives, so tokens are held back until the text
    they decode to ends cleanly; the longest clean prefix is written at once."""

    def __init__(self, tokenizer, out):
        self.tokenizer, self.out, self.pending = tokenizer, out, []

    def write(self, token):
        self.pending.append(token)
        for n in range(len(self.pending), 0, -1):
            text = self.tokenizer.decode(self.pending[:n])
            if not text.endswith("\ufffd"):
                self._emit(text, n)
                return

    def close(self):
        """Write what is held back (bytes that never completed a character print as U+FFFD)."""
        if self.pending:
            self._emit(self.tokenizer.decode(self.pending), len(self.pending))

    def _emit(self, text, n):
        self.out.write(text)
        self.out.flush()
        del self.pending[:n]


# -----------------------------------------------------------------------------
# command line


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", required=True, help="a run directory (holding ckpt.pt) or a checkpoint file")
    prompt = p.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", help="prompt text (default: the end-of-text token alone)")
    prompt.add_argument("--prompt_file", help="read the prompt from this UTF-8 file")
    p.add_argument("--num_samples", type=int, default=1, help="samples, one after another (default 1)")
    p.add_argument("--max_new_tokens", type=int, default=256, help="tokens per sample at most (default 256)")
    p.add_argument("--temperature", type=float, default=1.0, help="softmax temperature; 0 is greedy (default 1)")
    p.add_argument("--top_k", type=int, help="draw from the k most likely tokens only (default: all)")
    p.add_argument("--top_p", type=float, help="draw from the nucleus of this probability, in (0, 1] (default: 1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling generator (default 0)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: cuda if available, else cpu (default auto)")
    p.add_argument("--no_cache", action="store_true", help="a full forward pass per token, for comparison")
    return p.parse_args(argv)


def check_args(args):
    def need(ok, msg):
        if not ok:
            raise UsageError(msg)

    need(args.num_samples >= 1, f"--num_samples must be at least 1, got {args.num_samples}")
    need(args.max_new_tokens >= 1, f"--max_new_tokens must be at least 1, got {args.max_new_tokens}")
    need(args.temperature >= 0, f"--temperature must be >= 0 (0 is greedy), got {args.temperature}")
    need(args.top_k is None or args.top_k >= 1, f"--top_k must be at least 1, got {args.top_k}")
    need(args.top_p is None or 0 < args.top_p <= 1, f"--top_p must be in (0, 1], got {args.top_p}")
    need(args.device != "cuda" or torch.cuda.is_available(), "--device cuda: no CUDA device is available")


def read_prompt(args):
    """The prompt text, or None for the default (unconditional) prompt."""
    if args.prompt_file is not None:
        path = Path(args.prompt_file)
        if not path.is_file():
            raise UsageError(f"prompt file {path} not found")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise UsageError(f"prompt file {path} is not UTF-8 text ({e})") from e
        if not text:
            raise UsageError(f"prompt file {path} is empty: write a prompt in it, "
                             "or drop --prompt_file to sample unconditionally")
        return text
    if args.prompt == "":
        raise UsageError("the prompt is empty: pass some text, or drop --prompt to sample unconditionally")
    return args.prompt


def load_model(ckpt_path, device):
    """(model in eval mode on device, tokenizer) from a checkpoint file or run directory."""
    ckpt = load_checkpoint(ckpt_path, map_location="cpu")
    try:
        model = GPT(GPTConfig(**ckpt["model_config"]))
        model.load_state_dict(ckpt["model"])
    except (TypeError, ValueError, RuntimeError) as e:
        raise UsageError(f"{ckpt_path}: the checkpoint's model does not fit this model.py: {e}") from e
    return model.to(device).eval(), get_tokenizer(ckpt["tokenizer"])


def run(args):
    check_args(args)
    text = read_prompt(args)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    model, tokenizer = load_model(args.ckpt, device)
    prompt_ids = [tokenizer.eot] if text is None else tokenizer.encode(text)
    block_size = model.cfg.block_size
    if len(prompt_ids) > block_size:
        print(f"warning: the prompt has {len(prompt_ids)} tokens, more than block_size={block_size}; "
              f"the model sees its last {block_size}", file=sys.stderr)
    generator = torch.Generator(device).manual_seed(args.seed)
    out = sys.stdout
    n_tokens, t0 = 0, time.perf_counter()
    for i in range(args.num_samples):
        if i > 0:
            out.write("-" * 40 + "\n")
        out.write(text or "")
        stream = TextStream(tokenizer, out)
        for token in generate(model, prompt_ids, args.max_new_tokens, args.temperature, args.top_k, args.top_p,
                              generator, use_cache=not args.no_cache, vocab_size=tokenizer.vocab_size):
            n_tokens += 1
            if token == tokenizer.eot:
                break
            stream.write(token)
        stream.close()
        out.write("\n")
        out.flush()
    dt = time.perf_counter() - t0
    print(f"{n_tokens} tokens in {dt:.2f}s ({n_tokens / dt:.1f} tokens/s, "
          f"{'no cache' if args.no_cache else 'kv cache'}, {device})", file=sys.stderr)
    return 0


def main(argv=None):
    args = parse_args(argv)
    try:
        return run(args)
    except (UsageError, CheckpointError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader (`| head`) has what it wants; silence the flush at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
