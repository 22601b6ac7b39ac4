"""
The token-shard format: what prepare_data.py writes and training reads.

    tokenizers    "gpt2" (GPT-2 BPE through tiktoken, from the committed rank file) and "byte"
    a shard       {split}_NNNNNN.bin: a 64-byte little-endian header (HEADER: magic, format version, vocab
                  size, token count, tokenizer name and fingerprint, padding), then the token ids as uint16
    meta.json     the preparation's settings, vocabulary and splits (each split's files and token
                  counts); written last, so a directory without it is not a preparation
    reading       load_meta, check_split and check_data validate; TokenLoader gives seeded, resumable training
                  batches for any number of ranks; eval_batches a fixed prefix of a split, in order

Every reader checks what it opens and raises UserError, one line naming the file and what to do.
"""

import base64
import hashlib
import json
import math
import struct
from functools import cache
from pathlib import Path

import numpy as np
import tiktoken
import torch

from common import UserError, write_atomic

DATA_DIR = Path(__file__).resolve().parent.parent / "data"

GPT2_RANKS = DATA_DIR / "gpt2.tiktoken"
GPT2_RANKS_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
# the split pattern of the original GPT-2 release (tiktoken's r50k/gpt2 encodings use an equivalent one)
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

SPLITS = ("train", "val", "test")

SHARD_MAGIC = b"DRTOKENS"
FORMAT_VERSION = 1
HEADER = struct.Struct("<8sIIQ16s8s16x")


# -----------------------------------------------------------------------------
# tokenizers

def _fingerprint(*parts):
    return hashlib.sha256(":".join(map(str, parts)).encode()).hexdigest()[:16]


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255, EOT is 256: for tiny CPU runs and tests."""

    name = "byte"
    vocab_size = 257
    eot = 256

    def __init__(self):
        self.fingerprint = _fingerprint(self.name, self.vocab_size, self.eot)

    def encode(self, text):
        return list(text.encode("utf-8"))

    def decode_bytes(self, ids):
        return b"".join(b"<|endoftext|>" if i == self.eot else bytes([i]) for i in ids)

    def decode(self, ids):
        return self.decode_bytes(ids).decode("utf-8", errors="replace")


class GPT2Tokenizer:
    """GPT-2 BPE through tiktoken, built offline from the committed rank file."""

    name = "gpt2"
    vocab_size = 50257
    eot = 50256

    def __init__(self, ranks_path=GPT2_RANKS):
        ranks_path = Path(ranks_path)
        if not ranks_path.is_file():
            raise UserError(f"{ranks_path} not found: it is committed with the repository; restore it with git")
        raw = ranks_path.read_bytes()
        sha = hashlib.sha256(raw).hexdigest()
        if sha != GPT2_RANKS_SHA256:
            raise UserError(f"{ranks_path} has sha256 {sha}, expected {GPT2_RANKS_SHA256}: "
                            "the GPT-2 vocabulary is corrupt; restore it with git")
        ranks = {}
        for line in raw.splitlines():
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
        self.enc = tiktoken.Encoding(name="gpt2", pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
                                     special_tokens={"<|endoftext|>": self.eot})
        self.fingerprint = _fingerprint(self.name, self.vocab_size, self.eot, sha)

    def encode(self, text):
        return self.enc.encode_ordinary(text)  # "<|endoftext|>" inside a text is plain text

    def decode_bytes(self, ids):
        return self.enc.decode_bytes(ids)

    def decode(self, ids):
        return self.enc.decode(ids)


TOKENIZERS = {"gpt2": GPT2Tokenizer, "byte": ByteTokenizer}


@cache
def get_tokenizer(name):
    """The tokenizer called `name` ("gpt2" or "byte")."""
    if name not in TOKENIZERS:
        raise UserError(f"unknown tokenizer {name!r}: use one of {', '.join(TOKENIZERS)}")
    return TOKENIZERS[name]()


# -----------------------------------------------------------------------------
# shards

def check_fits_uint16(tokenizer):
    if tokenizer.vocab_size > 2**16:
        raise UserError(f"tokenizer {tokenizer.name!r} has {tokenizer.vocab_size} tokens but shards store "
                        f"uint16 ids (at most {2**16}): use a tokenizer with a smaller vocabulary")


def write_shard(path, tokens, tokenizer):
    """Write `tokens` (ids of `tokenizer`) as one shard at `path`."""
    check_fits_uint16(tokenizer)
    tokens = np.asarray(tokens, dtype=np.uint16)
    header = HEADER.pack(SHARD_MAGIC, FORMAT_VERSION, tokenizer.vocab_size, len(tokens),
                         tokenizer.name.encode(), bytes.fromhex(tokenizer.fingerprint))
    write_atomic(path, lambda f: f.writelines([header, memoryview(tokens)]))


def read_header(path):
    """The validated header of the shard at `path`, as a dict."""
    path = Path(path)
    redo = f"re-create it with `python prepare_data.py --overwrite --out_dir {path.parent}` and the same source"
    if not path.is_file():
        if path.exists() or path.is_symlink():
            raise UserError(f"shard {path} is {'a directory' if path.is_dir() else 'not a regular file'}, not a shard: "
                            f"move or remove it, then {redo}")
        raise UserError(f"shard {path} is missing: {redo}")
    size = path.stat().st_size
    if size == 0:
        raise UserError(f"shard {path} is empty (0 bytes; a write cut short?): {redo}")
    with open(path, "rb") as f:
        raw = f.read(HEADER.size)
    if raw[:len(SHARD_MAGIC)] != SHARD_MAGIC[:len(raw)]:
        raise UserError(f"{path} is not a token shard (wrong magic number): {redo}")
    if len(raw) < HEADER.size:
        raise UserError(f"{path} is truncated ({size} bytes, less than its {HEADER.size}-byte header): {redo}")
    _, version, vocab_size, count, name, fingerprint = HEADER.unpack(raw)
    if version != FORMAT_VERSION:
        raise UserError(f"{path} has shard format version {version}, this code reads {FORMAT_VERSION}: {redo}")
    expected = HEADER.size + 2 * count
    if size != expected or count == 0:
        raise UserError(f"{path} is truncated or corrupt: its header promises {count} tokens "
                        f"({expected} bytes) but the file has {size} bytes: {redo}")
    return {"tokenizer": name.rstrip(b"\0").decode(), "vocab_size": vocab_size,
            "tokens": count, "tokenizer_fingerprint": fingerprint.hex()}


def open_shard(path, fingerprint=None):
    """Memory-map the tokens of a shard (uint16); `fingerprint` checks the shard's tokenizer."""
    header = read_header(path)
    if fingerprint is not None and header["tokenizer_fingerprint"] != fingerprint:
        raise UserError(f"{path} was written with tokenizer {header['tokenizer']!r} (fingerprint "
                        f"{header['tokenizer_fingerprint']}), not the one in meta.json ({fingerprint}): "
                        f"re-run `python prepare_data.py --overwrite --out_dir {Path(path).parent}`")
    return np.memmap(path, dtype=np.uint16, mode="r", offset=HEADER.size, shape=(header["tokens"],))


def write_meta(out_dir, meta):
    """Write a preparation's meta.json (atomically): the last file of a preparation."""
    write_atomic(Path(out_dir) / "meta.json", json.dumps(meta, indent=2) + "\n")


# -----------------------------------------------------------------------------
# reading prepared data

def load_meta(data_dir):
    """The meta.json of a prepared data directory."""
    path = Path(data_dir) / "meta.json"
    if not path.is_file():
        raise UserError(f"{path} not found: prepare the data first, with `python prepare_data.py` "
                        f"(and --out_dir {data_dir} for another source; see --help)")
    redo = f"re-run `python prepare_data.py --overwrite --out_dir {data_dir}` with the same source"
    try:
        meta = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{path} is not valid JSON ({e}): {redo}") from e
    if not isinstance(meta, dict):
        raise UserError(f"{path} holds a JSON {type(meta).__name__}, not an object: {redo}")
    if meta.get("format_version") != FORMAT_VERSION:
        raise UserError(f"{path} has format version {meta.get('format_version')}, this code reads "
                        f"{FORMAT_VERSION}: {redo}")
    missing = [k for k in META_KEYS if k not in meta]
    if missing:
        raise UserError(f"{path} lacks {', '.join(missing)}: it is incomplete; {redo}")
    problem = _meta_problem(meta)
    if problem:
        raise UserError(f"{path}: {problem}: {redo}")
    return meta


def _meta_problem(meta):
    """What is wrong with a meta.json's keys that readers use (None: nothing)."""
    def count(x):
        return isinstance(x, int) and not isinstance(x, bool) and x >= 0

    if meta["tokenizer"] not in TOKENIZERS:
        return f"tokenizer {meta['tokenizer']!r} is not one of {', '.join(TOKENIZERS)}"
    if meta["vocab_size"] != TOKENIZERS[meta["tokenizer"]].vocab_size:
        return (f"vocab_size {meta['vocab_size']!r} is not the {meta['tokenizer']} tokenizer's "
                f"{TOKENIZERS[meta['tokenizer']].vocab_size}")
    if not isinstance(meta["tokenizer_fingerprint"], str):
        return f"tokenizer_fingerprint {meta['tokenizer_fingerprint']!r} is not a string"
    if not isinstance(meta["splits"], dict):
        return f"splits is a JSON {type(meta['splits']).__name__}, not an object"
    for split in ("train", "val"):  # (test is optional: train.py scores it when it has tokens)
        if split not in meta["splits"]:
            return f"splits lacks {split!r}: prepare_data.py writes train, val and test"
    baseline = meta.get("unigram_baseline_nats")
    if baseline is not None and (isinstance(baseline, bool) or not isinstance(baseline, (int, float))
                                 or not math.isfinite(baseline)):
        return f"unigram_baseline_nats {baseline!r} is not a number (nor null)"
    for split, info in meta["splits"].items():
        if not isinstance(info, dict) or "tokens" not in info or "files" not in info:
            return f"split {split!r} lacks its tokens or files"
        if not count(info["tokens"]):
            return f"split {split!r}: tokens {info['tokens']!r} is not a count"
        files = info["files"]
        if not isinstance(files, list) or not all(isinstance(f, str) and f and Path(f).name == f for f in files):
            return f"split {split!r}: files {files!r} is not a list of file names"
    return None


META_KEYS = ("tokenizer", "tokenizer_fingerprint", "vocab_size", "splits")  # what readers of meta.json need


def _open_split(data_dir, split):
    """The meta.json of data_dir and the memory-mapped shards of one split, checked against it."""
    meta = load_meta(data_dir)
    info = meta["splits"].get(split)
    if info is None:
        raise UserError(f"{data_dir} has no split {split!r}: use one of {', '.join(meta['splits'])}")
    if info["tokens"] == 0:
        raise UserError(f"split {split!r} of {data_dir} is empty: re-run prepare_data.py with --overwrite "
                        "and fractions that give it documents")
    return meta, [open_shard(Path(data_dir) / f, meta["tokenizer_fingerprint"]) for f in info["files"]]


def check_split(data_dir, split):
    """Open every shard of a split as the loaders will, and read each token id once (one pass over
    the split's bytes): a shard that is missing, truncated, from another tokenizer or holding an id
    outside the tokenizer's vocabulary is a UserError naming it. Returns the split's token count."""
    meta, shards = _open_split(data_dir, split)
    vocab, info, total = meta["vocab_size"], meta["splits"][split], 0
    for name, shard in zip(info["files"], shards):
        top = max(int(shard[i:i + (1 << 24)].max()) for i in range(0, len(shard), 1 << 24))
        if top >= vocab:
            raise UserError(f"shard {Path(data_dir) / name} holds token id {top}, outside the {meta['tokenizer']} "
                            f"tokenizer's ids 0..{vocab - 1}: it is corrupt or was written for another tokenizer; "
                            f"re-create it with `python prepare_data.py --overwrite --out_dir {data_dir}`")
        total += len(shard)
    if total != info["tokens"]:
        raise UserError(f"split {split!r} of {data_dir} holds {total:,} tokens in its shards, but its meta.json "
                        f"says {info['tokens']:,}: the shards and meta.json are from different "
                        f"preparations; re-create them with `python prepare_data.py --overwrite --out_dir {data_dir}`")
    return total


def check_data(data_dir, meta, seq_len):
    """Open and read every split a run uses (train, val, and test when it has tokens) as the run will: a
    bad shard, an id outside the vocabulary or a split too short for seq_len is an error before the run
    starts, not at the first evaluation or after the last step."""
    for split in ["train", "val"] + (["test"] if meta["splits"].get("test", {}).get("tokens") else []):
        tokens = check_split(data_dir, split)
        if split != "train" and tokens - 1 < seq_len:
            raise UserError(f"split {split!r} of {data_dir} has {tokens} tokens, too few for one evaluation "
                            f"sequence of seq_len + 1 = {seq_len + 1}: use seq_len <= {tokens - 1}, or prepare "
                            f"the data with a larger --{split}_fraction")
    TokenLoader(data_dir, "train", 1, seq_len)  # a training window of seq_len + 1 in some shard


class TokenLoader:
    """Seeded, resumable training batches of a split for any number of ranks.

    Every shard is cut into windows of seq_len + 1 tokens overlapping by one (x = w[:-1], y = w[1:]).
    The windows of all epochs form one stream, epoch e a permutation seeded by (seed, e). Each call
    consumes the next world_size * batch_size windows of the stream and rank r takes the r-th block
    of batch_size: a step sees the same windows whatever its split into ranks and micro-steps.
    """

    def __init__(self, data_dir, split, batch_size, seq_len, rank=0, world_size=1, seed=0):
        if not 0 <= rank < world_size:
            raise UserError(f"rank {rank} is not in 0..{world_size - 1}")
        self.split, self.batch_size, self.seq_len = split, batch_size, seq_len
        self.rank, self.world_size, self.seed = rank, world_size, seed
        _, self.shards = _open_split(data_dir, split)
        per_shard = [(len(s) - 1) // seq_len for s in self.shards]
        self.starts = np.cumsum([0] + per_shard)  # first window id of each shard
        self.n_windows = int(self.starts[-1])
        if self.n_windows == 0:
            raise UserError(f"split {split!r} of {data_dir} has no shard of seq_len + 1 = {seq_len + 1} tokens: "
                            "use a shorter seq_len or a larger corpus")
        self.epoch = self.pos = 0
        self._perms = {}

    def _perm(self, epoch):
        if epoch not in self._perms:
            self._perms = {e: p for e, p in self._perms.items() if e >= self.epoch}
            self._perms[epoch] = np.random.default_rng([self.seed, epoch]).permutation(self.n_windows)
        return self._perms[epoch]

    def _take(self, start, count):
        """Window ids at positions start .. start + count - 1 of the stream."""
        ids = []
        while count:
            epoch, pos = divmod(start, self.n_windows)
            n = min(count, self.n_windows - pos)
            ids.append(self._perm(epoch)[pos:pos + n])
            start += n
            count -= n
        return np.concatenate(ids)

    def next_batch(self):
        """(x, y): int64 CPU tensors [batch_size, seq_len], y is x shifted by one token."""
        B, T = self.batch_size, self.seq_len
        start = self.epoch * self.n_windows + self.pos
        ids = self._take(start + self.rank * B, B)
        self.epoch, self.pos = divmod(start + self.world_size * B, self.n_windows)
        shard = np.searchsorted(self.starts, ids, side="right") - 1
        offset = (ids - self.starts[shard]) * T
        buf = np.stack([self.shards[s][o:o + T + 1] for s, o in zip(shard, offset)]).astype(np.int64)
        return torch.from_numpy(buf[:, :-1].copy()), torch.from_numpy(buf[:, 1:].copy())

    def state_dict(self):
        return {"split": self.split, "seed": self.seed, "batch_size": self.batch_size, "seq_len": self.seq_len,
                "n_windows": self.n_windows, "epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state):
        mine = self.state_dict()
        for key in ("split", "seed", "batch_size", "seq_len", "n_windows"):
            if state.get(key) != mine[key]:
                raise UserError(f"loader state does not fit: {key} is {state.get(key)!r} in the saved state but "
                                f"{mine[key]!r} here; resume with the same data, seed, batch_size and seq_len")
        self.epoch, self.pos = int(state["epoch"]), int(state["pos"])


def eval_batches(data_dir, split, batch_size, seq_len, max_tokens, rank=0, world_size=1):
    """(x, y) batches over the first max_tokens targets of a split (None: all), in order.

    The split is cut into n = min(max_tokens, tokens - 1) // seq_len windows, the same for every
    world_size; rank r gets windows r, r + world_size, ... (when n is not a multiple of world_size,
    the first ranks get one window more: sum losses and token counts over ranks, then divide).
    """
    if not 0 <= rank < world_size:
        raise UserError(f"rank {rank} is not in 0..{world_size - 1}")
    _, shards = _open_split(data_dir, split)
    total = sum(len(s) for s in shards)
    n = (total - 1 if max_tokens is None else min(max_tokens, total - 1)) // seq_len
    if n == 0 and max_tokens is not None and max_tokens < seq_len:
        raise UserError(f"max_tokens={max_tokens} is less than one window of seq_len={seq_len} targets: "
                        f"raise max_tokens to at least {seq_len}")
    if n == 0:
        raise UserError(f"split {split!r} of {data_dir} has {total} tokens, too few for one window of "
                        f"seq_len + 1 = {seq_len + 1}: use seq_len <= {total - 1}, or prepare a larger {split} split")
    parts, left = [], n * seq_len + 1
    for s in shards:
        parts.append(np.asarray(s[:left]))
        left -= len(parts[-1])
        if left == 0:
            break
    tokens = np.concatenate(parts).astype(np.int64)
    x, y = tokens[:-1].reshape(n, seq_len), tokens[1:].reshape(n, seq_len)
    mine = np.arange(rank, n, world_size)

    def batches():
        for i in range(0, len(mine), batch_size):
            idx = mine[i:i + batch_size]
            yield torch.from_numpy(x[idx]), torch.from_numpy(y[idx])
    return batches()
