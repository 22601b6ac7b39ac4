"""Tokens on disk: what prepare_data.py writes and training reads (format and rules: docs/data.md)."""

import base64
import hashlib
import json
import os
import struct
from functools import cache, lru_cache
from pathlib import Path

import numpy as np
import tiktoken
import torch

from common import UserError, need, write_atomic

DATA_DIR = Path(__file__).resolve().parent / "data"
DEFAULT_CORPUS = DATA_DIR / "shakespeare.jsonl.gz"
GPT2_RANKS = DATA_DIR / "gpt2.tiktoken"
GPT2_RANKS_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
# the split pattern of the original GPT-2 release (tiktoken's r50k/gpt2 encodings use an equivalent one)
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

SPLITS = ("train", "val", "test")
SHARD_MAGIC = b"DRTOKENS"
FORMAT_VERSION = 1
HEADER = struct.Struct("<8sIIQ16s8s16x")  # magic, version, vocab size, tokens, tokenizer name, fingerprint


# --- tokenizers ---------------------------------------------------------------------------------------------

def _fingerprint(*parts):
    return hashlib.sha256(":".join(map(str, parts)).encode()).hexdigest()[:16]


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255, EOT is 256: for tiny CPU runs and tests."""

    name, vocab_size, eot = "byte", 257, 256

    def __init__(self):
        self.fingerprint = _fingerprint(self.name, self.vocab_size, self.eot)

    def encode(self, text):  # (a command line's bytes that are not UTF-8: as it gave them)
        return list(text.encode("utf-8", "surrogateescape"))

    def decode(self, ids):
        return b"".join(b"<|endoftext|>" if i == self.eot else bytes([i]) for i in ids).decode("utf-8", errors="replace")


class GPT2Tokenizer:
    """GPT-2 BPE through tiktoken, built offline from the committed rank file."""

    name, vocab_size, eot = "gpt2", 50257, 50256

    def __init__(self, ranks_path=GPT2_RANKS):
        raw = Path(ranks_path).read_bytes()
        sha = hashlib.sha256(raw).hexdigest()
        need(sha == GPT2_RANKS_SHA256, f"{ranks_path} has sha256 {sha}, not the GPT-2 vocabulary's: restore it with git")
        ranks = {base64.b64decode(token): int(rank) for token, rank in map(bytes.split, raw.splitlines())}
        self.enc = tiktoken.Encoding(name="gpt2", pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
                                     special_tokens={"<|endoftext|>": self.eot})
        self.fingerprint = _fingerprint(self.name, self.vocab_size, self.eot, sha)

    def encode(self, text):
        return self.enc.encode_ordinary(text)  # "<|endoftext|>" inside a text is plain text

    def decode(self, ids):
        return self.enc.decode(ids)


TOKENIZERS = {"gpt2": GPT2Tokenizer, "byte": ByteTokenizer}


@cache
def get_tokenizer(name):
    """The tokenizer called `name` ("gpt2" or "byte")."""
    need(name in TOKENIZERS, f"unknown tokenizer {name!r}: use one of {', '.join(TOKENIZERS)}")
    return TOKENIZERS[name]()


# --- shards and meta.json -----------------------------------------------------------------------------------

def write_shard(path, tokens, tokenizer):
    """Write `tokens` as one shard at `path` (fsynced); the blake2b digest of its bytes (meta.json keeps it)."""
    tokens = np.asarray(tokens, dtype=np.uint16)
    header = HEADER.pack(SHARD_MAGIC, FORMAT_VERSION, tokenizer.vocab_size, len(tokens),
                         tokenizer.name.encode(), bytes.fromhex(tokenizer.fingerprint))
    write_atomic(path, lambda f: f.writelines([header, memoryview(tokens)]))
    return hashlib.blake2b(header + memoryview(tokens).cast("B"), digest_size=16).hexdigest()


def open_shard(path, fingerprint=None):
    """The tokens of a shard, memory-mapped (uint16), after checking its header and size."""
    redo = f"re-create it with `{prepare_command(Path(path).parent)} --overwrite`"
    need(Path(path).is_file(), f"shard {path} is missing or not a file: {redo}")
    with open(path, "rb") as f:
        raw, size = f.read(HEADER.size), os.fstat(f.fileno()).st_size
    need(len(raw) == HEADER.size and raw[:8] == SHARD_MAGIC, f"{path} is not a token shard: {redo}")
    _, version, _, count, name, fp = HEADER.unpack(raw)
    need(version == FORMAT_VERSION and size == HEADER.size + 2 * count and count > 0,
         f"{path} is truncated or corrupt (format {version}, {count} tokens in its header, {size} bytes): {redo}")
    if fingerprint is not None and fp.hex() != fingerprint:
        raise UserError(f"{path} was written by tokenizer {name.rstrip(bytes(1)).decode()!r}, not the one its "
                        f"meta.json names: {redo}")
    return np.memmap(path, dtype=np.uint16, mode="r", offset=HEADER.size, shape=(count,))


def implied_tokenizer(data_dir):
    """The tokenizer a directory's name promises (_byte, _gpt2), or None."""
    return next((t for t in TOKENIZERS if Path(data_dir).name.endswith(f"_{t}")), None)


def prepare_command(data_dir):
    """The command that prepares the data directory `data_dir`."""
    tok = implied_tokenizer(data_dir) or "gpt2"
    flag = f" --tokenizer {tok}" if tok != "gpt2" else ""
    if Path(data_dir).name == "shakespeare" + (f"_{tok}" if flag else ""):  # the embedded corpus, the default source
        out = "" if Path(data_dir).resolve() == DATA_DIR / Path(data_dir).name else f" --out_dir {data_dir}"
        return f"python prepare_data.py{flag}{out}"
    return f"python prepare_data.py --data_files YOUR_FILES{flag} --out_dir {data_dir}"


def check_tokenizer(data_dir, tokenizer):
    """UserError if the directory's name promises another tokenizer than `tokenizer`."""
    implied = implied_tokenizer(data_dir)
    need(implied in (None, tokenizer), f"{data_dir} is named for the {implied} tokenizer but holds (or would hold) "
         f"{tokenizer} tokens: prepare it with `{prepare_command(data_dir)} --overwrite`, or rename it")


def _need(ok, what):
    if not ok:
        raise ValueError(what)


def load_meta(data_dir):
    """A prepared directory's meta.json, checked."""
    path = Path(data_dir) / "meta.json"
    need(path.is_file(), f"{path} not found: prepare the data first, with `{prepare_command(data_dir)}`")
    redo = f"re-create it with `{prepare_command(data_dir)} --overwrite`"
    try:
        meta = json.loads(path.read_text())
        _need(meta["format_version"] == FORMAT_VERSION, f"format version {meta['format_version']!r}")
        _need(meta["tokenizer"] in TOKENIZERS, f"tokenizer {meta['tokenizer']!r} is not one of {', '.join(TOKENIZERS)}")
        tok = get_tokenizer(meta["tokenizer"])
        _need(isinstance(meta["tokenizer_fingerprint"], str), "tokenizer_fingerprint is not a string")
        _need(meta["vocab_size"] == tok.vocab_size, f"vocab_size {meta['vocab_size']!r} is not the {tok.name} "
              f"tokenizer's {tok.vocab_size}")
        _need(isinstance(meta["splits"], dict), f"splits is a JSON {type(meta['splits']).__name__}, not an object")
        for split in ("train", "val"):
            _need(split in meta["splits"], f"splits lacks {split!r}: prepare_data.py writes train, val and test")
        for split, info in meta["splits"].items():
            names = isinstance(info["files"], list) and all(Path(f).name == f for f in info["files"])
            _need(names, f"split {split!r}: files {info['files']!r} is not a list of file names")
            _need(isinstance(info["tokens"], int), f"split {split!r}: tokens is not a count")
            digests = info.get("blake2b", [])
            _need(isinstance(digests, list) and len(digests) in (0, len(info["files"])),
                  f"split {split!r}: blake2b is not one digest per file")
        baseline = meta.get("unigram_baseline_nats")  # train.py prints it
        _need(baseline is None or type(baseline) in (int, float), f"unigram_baseline_nats {baseline!r} is not a number")
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        why = f"lacks {e.args[0]}" if isinstance(e, KeyError) else f"is not valid ({type(e).__name__}: {e})"
        raise UserError(f"{path} {why}: {redo}") from None
    check_tokenizer(data_dir, meta["tokenizer"])
    return meta


def data_fingerprint(meta):
    """What identifies prepared data: its tokenizer and every shard's name and digest in meta.json (none kept: None)."""
    digests = [(f, d) for info in meta["splits"].values() for f, d in zip(info["files"], info.get("blake2b") or [])]
    if len(digests) != sum(len(info["files"]) for info in meta["splits"].values()):
        return None
    return hashlib.blake2b(json.dumps([meta["tokenizer_fingerprint"], digests]).encode(), digest_size=16).hexdigest()


class TokenData:
    """A prepared directory opened once: meta.json, every split's shards memory-mapped, and their stat (`changed`)."""

    def __init__(self, data_dir):
        self.dir, self.meta = Path(data_dir), load_meta(data_dir)
        self.fingerprint, self.splits, self.stats = data_fingerprint(self.meta), {}, {}
        for split, info in self.meta["splits"].items():
            shards = [open_shard(self.dir / f, self.meta["tokenizer_fingerprint"]) for f in info["files"]]
            need(sum(map(len, shards)) == info["tokens"], f"split {split!r} of {data_dir} holds {sum(map(len, shards)):,} "
                 f"tokens in its shards, but its meta.json says {info['tokens']:,}: re-create it with "
                 f"`{prepare_command(data_dir)} --overwrite`")
            self.splits[split] = shards
            self.stats |= {f: self._stat(f) for f in info["files"]}

    def _stat(self, name):
        st = os.stat(self.dir / name)
        return st.st_ino, st.st_size, st.st_mtime_ns

    def changed(self):
        """The first shard rewritten in place since it was opened (same file, other size or time), or None."""
        for name, (ino, size, mtime) in self.stats.items():
            try:
                now = self._stat(name)
            except OSError:
                continue  # removed or replaced: the map holds the file this run opened
            if now[0] == ino and now != (ino, size, mtime):
                return self.dir / name
        return None

    def shards(self, split):
        """The memory-mapped shards of a split that holds tokens."""
        need(split in self.splits, f"{self.dir} has no split {split!r}: use one of {', '.join(self.splits)}")
        need(self.splits[split], f"split {split!r} of {self.dir} is empty: prepare the data with a larger --{split}_fraction")
        return self.splits[split]


def opened(data):
    """`data` as TokenData: opened now when it is a directory's path."""
    return data if isinstance(data, TokenData) else TokenData(data)


def check_data(data, seq_len):
    """Check every split a run uses before it starts: each shard's header and size, and length >= seq_len."""
    data = opened(data)
    for split in ["train", "val"] + (["test"] if data.meta["splits"].get("test", {}).get("tokens") else []):
        tokens = sum(map(len, data.shards(split)))
        need(split == "train" or tokens - 1 >= seq_len, f"split {split!r} of {data.dir} has {tokens} tokens, too few for "
             f"one evaluation sequence of seq_len + 1 = {seq_len + 1}: use seq_len <= {tokens - 1}, or prepare the data "
             f"with a larger --{split}_fraction")
    TokenLoader(data, "train", 1, seq_len)  # a training window of seq_len + 1 in some shard


# --- batches ------------------------------------------------------------------------------------------------

class TokenLoader:
    """Seeded, resumable training batches of a split: windows of seq_len + 1 tokens, shuffled per epoch by (seed, epoch);
    rank r takes the r-th block of each step's windows, so a step sees the same windows for any number of ranks."""

    def __init__(self, data, split, batch_size, seq_len, rank=0, world_size=1, seed=0):
        need(0 <= rank < world_size, f"rank {rank} is not in 0..{world_size - 1}")
        self.split, self.batch_size, self.seq_len = split, batch_size, seq_len
        self.rank, self.world_size, self.seed = rank, world_size, seed
        data = opened(data)
        self.shards, self.data = data.shards(split), data
        self.starts = np.cumsum([0] + [(len(s) - 1) // seq_len for s in self.shards])  # first window id of each shard
        self.n_windows = n = int(self.starts[-1])
        need(n > 0, f"split {split!r} of {data.dir} has no shard of seq_len + 1 = {seq_len + 1} tokens: "
             "use a shorter seq_len or a larger corpus")
        self.epoch = self.pos = 0
        self._perm = lru_cache(4)(lambda epoch: np.random.default_rng([seed, epoch]).permutation(n))  # epoch's order

    def next_batch(self):
        """(x, y): int64 tensors [batch_size, seq_len], y is x shifted by one."""
        B, T = self.batch_size, self.seq_len
        start = self.epoch * self.n_windows + self.pos
        epochs, pos = np.divmod(np.arange(start + self.rank * B, start + (self.rank + 1) * B), self.n_windows)
        ids = np.concatenate([self._perm(int(e))[pos[epochs == e]] for e in np.unique(epochs)])  # this rank's block
        self.epoch, self.pos = divmod(start + self.world_size * B, self.n_windows)
        shard = np.searchsorted(self.starts, ids, side="right") - 1
        offset = (ids - self.starts[shard]) * T
        buf = check_ids(self.data, np.stack([self.shards[s][o:o + T + 1] for s, o in zip(shard, offset)]))
        return torch.from_numpy(buf[:, :-1].copy()), torch.from_numpy(buf[:, 1:].copy())

    def state_dict(self):
        return {"split": self.split, "seed": self.seed, "batch_size": self.batch_size, "seq_len": self.seq_len,
                "n_windows": self.n_windows, "epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state):
        mine = self.state_dict()
        for key in ("split", "seed", "batch_size", "seq_len", "n_windows"):
            need(state.get(key) == mine[key], f"loader state does not fit: {key} is {state.get(key)!r} in the saved state "
                 f"but {mine[key]!r} here; resume with the same data, seed, batch_size and seq_len")
        epoch, pos = state.get("epoch"), state.get("pos")
        need(type(epoch) is int and type(pos) is int and epoch >= 0 and 0 <= pos < self.n_windows, f"loader state does "
             f"not fit: epoch {epoch!r}, position {pos!r} of {self.n_windows} windows; the checkpoint is damaged: start "
             "over with --overwrite=true")
        self.epoch, self.pos = epoch, pos


def check_ids(data, tokens):
    """tokens as int64, each checked to be an id of the data's tokenizer (a damaged shard is one line)."""
    if tokens.size and int(tokens.max()) >= data.meta["vocab_size"]:
        raise UserError(f"{data.dir} holds token id {int(tokens.max())}, beyond its {data.meta['tokenizer']} tokenizer's "
                        f"{data.meta['vocab_size']} ids (a damaged shard): re-create it with "
                        f"`{prepare_command(data.dir)} --overwrite`")
    return tokens.astype(np.int64)


def eval_batches(data, split, batch_size, seq_len, max_tokens, rank=0, world_size=1):
    """(x, y) batches over the first max_tokens targets of a split (None: all), in order; rank r gets
    windows r, r + world_size, ... (sum losses and token counts over ranks, then divide)."""
    need(0 <= rank < world_size, f"rank {rank} is not in 0..{world_size - 1}")
    data = opened(data)
    shards = data.shards(split)
    starts = np.cumsum([0] + [len(s) for s in shards])  # each shard's first token in the split, then their total
    total = int(starts[-1])
    n = (total - 1 if max_tokens is None else min(max_tokens, total - 1)) // seq_len
    need(n != 0 or max_tokens is None or max_tokens >= seq_len, f"max_tokens={max_tokens} is less than one window of "
         f"seq_len={seq_len} targets: raise max_tokens to at least {seq_len}")
    need(n != 0, f"split {split!r} has {total} tokens, too few for one window of seq_len + 1 = {seq_len + 1}: "
         f"use seq_len <= {total - 1}, or prepare a larger {split} split")
    tokens = check_ids(data, np.concatenate([np.asarray(s[:max(0, n * seq_len + 1 - a)]) for s, a in zip(shards, starts)]))
    x, y = tokens[:-1].reshape(n, seq_len), tokens[1:].reshape(n, seq_len)
    mine = np.arange(rank, n, world_size)
    batches = (mine[i:i + batch_size] for i in range(0, len(mine), batch_size))
    return ((torch.from_numpy(x[idx]), torch.from_numpy(y[idx])) for idx in batches)
