"""
Tokenize a text corpus into binary shards, and read them back for training and evaluation.

    python prepare_data.py                              # embedded Shakespeare -> data/shakespeare/
    python prepare_data.py --tokenizer byte             # same corpus as bytes -> data/shakespeare_byte/
    python prepare_data.py --data_files 'corpus/*.parquet' --out_dir data/corpus --num_proc 8
    python prepare_data.py --dataset HuggingFaceFW/fineweb-edu --name sample-10BT --streaming \
        --val_fraction 0.001 --test_fraction 0.001 --num_proc 16

An output directory holds {train,val,test}_NNNNNN.bin shards and meta.json (written last), and a
.lock file: one preparation at a time writes into it (a second one is refused). A run that fails
removes what it wrote; a directory it created is removed too.
Documents: each one is tokenized as <|endoftext|> followed by its text, so EOT marks the start
of every document (nanoGPT's convention), and a split is the concatenation of its documents.
Splits: document i (its position in the source) goes to val, test or train by the fractional
part of (i + 1) / golden ratio (Fibonacci hashing): the same on every machine and for every
--num_proc, it needs no document count (streaming works), and it spreads each split evenly over
the corpus, so even the 42 Shakespeare documents give 2 val and 2 test documents at 5% each.
The fractions count documents, not tokens.
"""

import argparse
import base64
import errno
import fcntl
import glob
import gzip
import hashlib
import json
import multiprocessing
import os
import re
import socket
import struct
import sys
import time
from collections import deque
from contextlib import suppress
from functools import lru_cache
from pathlib import Path

import numpy as np
import tiktoken
import torch

DATA_DIR = Path(__file__).resolve().parent / "data"
DEFAULT_CORPUS = DATA_DIR / "shakespeare.jsonl.gz"
GPT2_RANKS = DATA_DIR / "gpt2.tiktoken"
GPT2_RANKS_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
# the split pattern of the original GPT-2 release (tiktoken's r50k/gpt2 encodings use an equivalent one)
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

SPLITS = ("train", "val", "test")

# Shard layout, the only place it is defined: a 64-byte little-endian header
# (magic, format version, vocab size, token count, tokenizer name, tokenizer fingerprint, padding)
# followed by `token count` uint16 tokens.
SHARD_MAGIC = b"DRTOKENS"
FORMAT_VERSION = 1
HEADER = struct.Struct("<8sIIQ16s8s16x")
OUR_FILES = re.compile(r"(train|val|test)_\d{6}\.bin(\.tmp)?|meta\.json(\.tmp)?")


class DataError(ValueError):
    """Bad input: the message says which file and what to do."""


def os_error_message(e, path):
    """One line for an OSError met while writing `path`."""
    reason = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded",
              errno.EROFS: "read-only file system", errno.EACCES: "permission denied",
              errno.EPERM: "permission denied"}.get(e.errno, e.strerror or str(e))
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"{reason} writing {path}"
    return f"cannot write {path}: {reason}"


class DirLock:
    """An exclusive lock on a directory for this process' life: flock on its .lock file, which
    holds the owner's pid and host. The OS releases it when the process exits, however it exits."""

    def __init__(self, directory, owner, error=DataError, name=".lock"):
        """Lock `directory` (which must exist) through its file `name`, or raise `error` naming the
        process that holds it; `owner` says what holds such locks ("run", "prepare_data.py run")."""
        self.path = Path(directory) / name
        try:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise error(os_error_message(e, self.path)) from None
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self.fd, 256, 0).decode(errors="replace").split()
            os.close(self.fd)
            pid = holder[0] if holder else "unknown"
            where = f" on {holder[1]}" if len(holder) > 1 and holder[1] != socket.gethostname() else ""
            raise error(f"{directory} is in use by another {owner} (pid {pid}{where})") from None
        with suppress(OSError):  # the pid is for messages only; a full disk must not stop the lock
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)

    def release(self):
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


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

    def decode(self, ids):
        out = bytearray()
        for i in ids:
            out += b"<|endoftext|>" if i == self.eot else bytes([i])
        return out.decode("utf-8", errors="replace")


class GPT2Tokenizer:
    """GPT-2 BPE through tiktoken, built offline from the committed rank file."""

    name = "gpt2"
    vocab_size = 50257
    eot = 50256

    def __init__(self, ranks_path=GPT2_RANKS):
        ranks_path = Path(ranks_path)
        if not ranks_path.is_file():
            raise DataError(f"{ranks_path} not found: it is committed with the repository; restore it with git")
        raw = ranks_path.read_bytes()
        sha = hashlib.sha256(raw).hexdigest()
        if sha != GPT2_RANKS_SHA256:
            raise DataError(f"{ranks_path} has sha256 {sha}, expected {GPT2_RANKS_SHA256}: "
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

    def decode(self, ids):
        return self.enc.decode(ids)


TOKENIZERS = {"gpt2": GPT2Tokenizer, "byte": ByteTokenizer}


@lru_cache(maxsize=None)
def get_tokenizer(name):
    """The tokenizer called `name` ("gpt2" or "byte")."""
    if name not in TOKENIZERS:
        raise DataError(f"unknown tokenizer {name!r}: use one of {', '.join(TOKENIZERS)}")
    return TOKENIZERS[name]()


# -----------------------------------------------------------------------------
# shards

def _write_atomic(path, chunks):
    """Write byte chunks to a temporary name, then rename: an interrupted write leaves no `path`."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise DataError(os_error_message(e, path)) from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _check_fits_uint16(tokenizer):
    if tokenizer.vocab_size > 2**16:
        raise DataError(f"tokenizer {tokenizer.name!r} has {tokenizer.vocab_size} tokens but shards store "
                        f"uint16 ids (at most {2**16}): use a tokenizer with a smaller vocabulary")


def write_shard(path, tokens, tokenizer):
    """Write `tokens` (ids of `tokenizer`) as one shard at `path`."""
    _check_fits_uint16(tokenizer)
    tokens = np.asarray(tokens, dtype=np.uint16)
    header = HEADER.pack(SHARD_MAGIC, FORMAT_VERSION, tokenizer.vocab_size, len(tokens),
                         tokenizer.name.encode(), bytes.fromhex(tokenizer.fingerprint))
    _write_atomic(Path(path), [header, memoryview(tokens)])


def read_header(path):
    """The validated header of the shard at `path`, as a dict."""
    path = Path(path)
    redo = f"re-create it with `python prepare_data.py --overwrite --out_dir {path.parent}` and the same source"
    if not path.is_file():
        raise DataError(f"shard {path} is missing: {redo}")
    size = path.stat().st_size
    if size == 0:
        raise DataError(f"shard {path} is empty (0 bytes; a write cut short?): {redo}")
    with open(path, "rb") as f:
        raw = f.read(HEADER.size)
    if raw[:len(SHARD_MAGIC)] != SHARD_MAGIC[:len(raw)]:
        raise DataError(f"{path} is not a token shard (wrong magic number): {redo}")
    if len(raw) < HEADER.size:
        raise DataError(f"{path} is truncated ({size} bytes, less than its {HEADER.size}-byte header): {redo}")
    _, version, vocab_size, count, name, fingerprint = HEADER.unpack(raw)
    if version != FORMAT_VERSION:
        raise DataError(f"{path} has shard format version {version}, this code reads {FORMAT_VERSION}: {redo}")
    expected = HEADER.size + 2 * count
    if size != expected or count == 0:
        raise DataError(f"{path} is truncated or corrupt: its header promises {count} tokens "
                        f"({expected} bytes) but the file has {size} bytes: {redo}")
    return {"tokenizer": name.rstrip(b"\0").decode(), "vocab_size": vocab_size,
            "tokens": count, "tokenizer_fingerprint": fingerprint.hex()}


def open_shard(path, fingerprint=None):
    """Memory-map the tokens of a shard (uint16); `fingerprint` checks the shard's tokenizer."""
    header = read_header(path)
    if fingerprint is not None and header["tokenizer_fingerprint"] != fingerprint:
        raise DataError(f"{path} was written with tokenizer {header['tokenizer']!r} (fingerprint "
                        f"{header['tokenizer_fingerprint']}), not the one in meta.json ({fingerprint}): "
                        f"re-run `python prepare_data.py --overwrite --out_dir {Path(path).parent}`")
    return np.memmap(path, dtype=np.uint16, mode="r", offset=HEADER.size, shape=(header["tokens"],))


class ShardWriter:
    """Cuts the token stream of one split into shards of `shard_tokens` tokens."""

    def __init__(self, out_dir, split, tokenizer, shard_tokens):
        self.out_dir, self.split, self.tokenizer = out_dir, split, tokenizer
        self.buf = np.empty(shard_tokens, dtype=np.uint16)
        self.fill = 0
        self.files = []
        self.docs = self.tokens = 0
        self.counts = np.zeros(tokenizer.vocab_size, dtype=np.int64)  # unigram counts

    def add(self, tokens, docs):
        self.docs += docs
        self.tokens += len(tokens)
        while len(tokens):
            n = min(len(tokens), len(self.buf) - self.fill)
            self.buf[self.fill:self.fill + n] = tokens[:n]
            self.fill += n
            tokens = tokens[n:]
            if self.fill == len(self.buf):
                self.flush()

    def flush(self):
        if self.fill == 0:
            return
        shard = self.buf[:self.fill]
        self.counts += np.bincount(shard, minlength=len(self.counts))
        name = f"{self.split}_{len(self.files):06d}.bin"
        write_shard(self.out_dir / name, shard, self.tokenizer)
        self.files.append(name)
        self.fill = 0


# -----------------------------------------------------------------------------
# preparing a corpus

def split_of(index, val_fraction, test_fraction):
    """The split ("train", "val" or "test") of the document at position `index` of the source."""
    u = ((index + 1) * 0x9E3779B97F4A7C15 % 2**64) / 2**64  # frac((index + 1) / golden ratio)
    if u < val_fraction:
        return "val"
    if u < val_fraction + test_fraction:
        return "test"
    return "train"


def unigram_baseline(train_counts, val_counts):
    """Cross-entropy (nats/token) of val under the add-one-smoothed unigram distribution of train."""
    logp = np.log(train_counts + 1.0) - np.log(train_counts.sum() + len(train_counts))
    return float(-(val_counts * logp).sum() / val_counts.sum())


BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text"}


def _local_files(patterns):
    """Expand and check local source files; sorted, so the document order is the same everywhere."""
    files, seen = [], {}
    for pattern in patterns:
        matches = sorted(glob.glob(os.path.expanduser(pattern)))
        if not matches:
            raise DataError(f"source file {pattern} not found: check the path (a hub dataset goes in --dataset)")
        for f in matches:
            if not os.path.isfile(f):
                raise DataError(f"source {f} is not a file: pass files or a pattern such as '{f}/*.parquet'")
            if os.path.getsize(f) == 0:
                raise DataError(f"source file {f} is empty: pass a file with documents")
            st = os.stat(f)
            if (st.st_dev, st.st_ino) in seen:  # the same file twice, by path, glob or link
                first, by = seen[(st.st_dev, st.st_ino)]
                raise DataError(f"source file {f} (from {pattern!r}) is also {first} (from {by!r}): pass each "
                                "file once (its documents would be counted twice, some in val and in train)")
            seen[(st.st_dev, st.st_ino)] = (f, pattern)
            files.append(f)
    return [str(Path(f).resolve()) for f in files]


def _builder(files):
    """The `datasets` builder (json, parquet or text) for local files, from their extension."""
    builders = set()
    for f in files:
        stem = f[:-3] if f.endswith(".gz") else f
        builder = BUILDERS.get(os.path.splitext(stem)[1])
        if builder is None:
            raise DataError(f"cannot tell the format of {f} from its extension "
                            f"({', '.join(BUILDERS)}, optionally .gz): pass --dataset json, parquet or text")
        builders.add(builder)
    if len(builders) > 1:
        raise DataError(f"source files mix formats ({', '.join(sorted(builders))}): prepare one format at a time")
    return builders.pop()


def load_source(dataset, name, data_files, source_split, text_column, streaming):
    """The source documents as a datasets.Dataset (or IterableDataset if streaming) of one column."""
    from datasets import load_dataset
    kwargs = {"sample_by": "document"} if dataset == "text" else {}  # a .txt file is one document
    ds = load_dataset(dataset, name, data_files=data_files, split=source_split, streaming=streaming, **kwargs)
    try:
        return ds.select_columns([text_column])
    except ValueError as e:
        raise DataError(f"source {dataset} {data_files or name or ''} has no column {text_column!r} ({e}): "
                        "pass --text_column") from e


class NotText(ValueError):
    """A document whose text column holds something other than a string or null."""


def _first_bad_record(path, text_column):
    """The first place in a local source file that a reader trips on, as a message (None: none found).
    Called only when reading the source failed, to say where and why: datasets' own errors name
    neither the file nor the line."""
    opener = gzip.open if path.endswith(".gz") else open
    kind = BUILDERS.get(os.path.splitext(path[:-3] if path.endswith(".gz") else path)[1])

    def check(record, where):
        if kind != "json":
            return None
        if not isinstance(record, dict):
            return f"{where} is a JSON {type(record).__name__}, not an object: one JSON object per document"
        text = record.get(text_column)
        if text is not None and not isinstance(text, str):
            return (f"{where}: {text_column!r} holds {text!r:.40} ({type(text).__name__}), not text: fix it, "
                    "or pass --text_column naming the text field")
        return None

    try:
        if kind == "parquet":
            import pyarrow as pa
            import pyarrow.parquet as pq
            schema = pq.read_schema(path)
            if text_column in schema.names:
                typ = schema.field(text_column).type
                if not (pa.types.is_string(typ) or pa.types.is_large_string(typ) or pa.types.is_null(typ)):
                    return f"{path}: column {text_column!r} has type {typ}, not text: pass --text_column"
            return None
        with opener(path, "rb") as f:
            if kind == "json" and f.read(1).lstrip() == b"[":  # one JSON array of objects
                f.seek(0)
                try:
                    records = json.loads(f.read().decode("utf-8"))
                except UnicodeDecodeError as e:
                    return f"{path} is not UTF-8 text (byte {e.start}): convert it to UTF-8"
                except json.JSONDecodeError as e:
                    return f"{path} is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg}): fix it"
                return next(filter(None, (check(r, f"{path} item {i}") for i, r in enumerate(records))), None)
            f.seek(0)
            for n, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    return (f"{path} line {n} is not UTF-8 ({e.reason} at byte {e.start} of the line): "
                            "convert the file to UTF-8 (e.g. iconv -f latin1 -t utf-8)")
                if kind != "json" or not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    return f"{path} line {n} is not valid JSON ({e.msg}, column {e.colno}): fix or remove that line"
                bad = check(record, f"{path} line {n}")
                if bad:
                    return bad
    except (OSError, EOFError, ValueError) as e:  # a corrupt .gz or parquet file
        return f"{path} could not be read ({type(e).__name__}: {e}): replace it"
    return None


def _source_error(e, dataset, name, data_files, text_column):
    """A DataError that says which source file (and line) could not be read, for `e` raised while
    reading a source."""
    for f in data_files or []:
        if dataset in BUILDERS.values():
            message = _first_bad_record(f, text_column)
            if message:
                return DataError(message)
    if isinstance(e, NotText):
        return DataError(f"{e}: pass --text_column naming a text column")
    cause = e
    while cause.__cause__ is not None or cause.__context__ is not None:
        cause = cause.__cause__ or cause.__context__
    reason = (str(cause).strip().splitlines() or [""])[0]
    return DataError(f"could not read source {dataset} {data_files or name or ''}: "
                     f"{type(cause).__name__}: {reason}")


CHUNK_CHARS = 1 << 18  # characters of text per tokenizer task


def _chunks(ds, text_column):
    """Lists of consecutive document texts of about CHUNK_CHARS characters, in source order."""
    texts, size = [], 0
    for index, row in enumerate(ds):
        text = row[text_column]
        if text is not None and not isinstance(text, str):
            raise NotText(f"document {index} of the source holds {text!r:.40} ({type(text).__name__}) "
                          f"in column {text_column!r}, not text")
        texts.append(text or "")  # null: an empty document
        size += len(texts[-1])
        if size >= CHUNK_CHARS:
            yield texts
            texts, size = [], 0
    if texts:
        yield texts


def _encode_docs(tokenizer_name, texts):
    """Tokens of documents as [EOT] + encode(text) each (none for an empty text), and their lengths."""
    tok = get_tokenizer(tokenizer_name)
    ids, lengths = [], []
    for text in texts:
        doc = [tok.eot] + tok.encode(text) if text else []
        ids += doc
        lengths.append(len(doc))
    return np.array(ids, dtype=np.uint16), np.array(lengths, dtype=np.int64)


def _encoded(chunks, tokenizer_name, num_proc):
    """_encode_docs over the chunks, in order, on `num_proc` processes with a bounded backlog."""
    if num_proc == 1:
        for texts in chunks:
            yield _encode_docs(tokenizer_name, texts)
        return
    with multiprocessing.Pool(num_proc) as pool:
        pending = deque()
        for texts in chunks:
            pending.append(pool.apply_async(_encode_docs, (tokenizer_name, texts)))
            if len(pending) >= 2 * num_proc:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


SETTINGS = ("format_version", "source", "tokenizer", "tokenizer_fingerprint",
            "val_fraction", "test_fraction", "shard_tokens")


def _our_files(out_dir):
    return sorted(p for p in out_dir.iterdir() if OUR_FILES.fullmatch(p.name)) if out_dir.is_dir() else []


def _up_to_date(out_dir, settings):
    """True if out_dir holds exactly this preparation; DataError if it holds one that would be lost."""
    shards = [p for p in _our_files(out_dir) if p.suffix == ".bin"]
    meta = load_meta(out_dir) if (out_dir / "meta.json").exists() else None
    old = meta or (read_header(shards[0]) if shards else None)
    if old is None:
        return False
    if old["tokenizer_fingerprint"] != settings["tokenizer_fingerprint"]:
        raise DataError(f"{out_dir} holds shards from tokenizer {old['tokenizer']!r}, not {settings['tokenizer']!r}: "
                        "pass --overwrite to replace them, or choose another --out_dir")
    if meta is None:
        return False  # shards without meta.json are what an interrupted run left: nothing to lose
    if {k: meta.get(k) for k in SETTINGS} == settings:
        return True
    changed = ", ".join(k for k in SETTINGS if meta.get(k) != settings[k])
    raise DataError(f"{out_dir} holds data prepared with other settings ({changed}): "
                    "pass --overwrite to replace it, or choose another --out_dir")


def _tokenize(ds, text_column, tok, out_dir, shard_tokens, num_proc, val_fraction, test_fraction):
    """Tokenize the documents of `ds` into the shards of each split; returns the ShardWriter of each split."""
    from datasets import Dataset
    from datasets.utils.tqdm import tqdm
    writers = {s: ShardWriter(out_dir, s, tok, shard_tokens) for s in SPLITS}
    index = 0
    with tqdm(total=len(ds) if isinstance(ds, Dataset) else None, unit="docs", desc="tokenizing") as bar:
        for tokens, lengths in _encoded(_chunks(ds, text_column), tok.name, num_proc):
            split = np.array([SPLITS.index(split_of(index + j, val_fraction, test_fraction))
                              for j in range(len(lengths))])
            token_split = np.repeat(split, lengths)
            for i, s in enumerate(SPLITS):
                writers[s].add(tokens[token_split == i], int(np.count_nonzero((split == i) & (lengths > 0))))
            index += len(lengths)
            bar.update(len(lengths))
    for w in writers.values():
        w.flush()
    return writers


def prepare(dataset=None, name=None, data_files=None, source_split="train", text_column="text",
            streaming=False, tokenizer="gpt2", out_dir=None, val_fraction=0.05, test_fraction=0.05,
            shard_tokens=10**8, num_proc=1, overwrite=False):
    """Tokenize a source into shards under out_dir and write its meta.json; returns the meta dict."""
    tok = get_tokenizer(tokenizer)
    _check_fits_uint16(tok)
    if dataset is None and data_files is None:
        data_files = [str(DEFAULT_CORPUS)]
    if dataset is None or dataset in set(BUILDERS.values()):  # local files
        if not data_files:
            raise DataError(f"--dataset {dataset} reads local files: pass them with --data_files")
        data_files = _local_files(data_files)
        dataset = dataset or _builder(data_files)
        stem = Path(data_files[0]).name.split(".")[0]
    else:  # a hub dataset
        stem = dataset.split("/")[-1] + (f"-{name}" if name else "")
    if out_dir is None:
        out_dir = DATA_DIR / (stem if tok.name == "gpt2" else f"{stem}_{tok.name}")
    out_dir = Path(out_dir)
    source = {"dataset": dataset, "name": name, "data_files": data_files,
              "split": source_split, "text_column": text_column}
    settings = {"format_version": FORMAT_VERSION, "source": source, "tokenizer": tok.name,
                "tokenizer_fingerprint": tok.fingerprint, "val_fraction": val_fraction,
                "test_fraction": test_fraction, "shard_tokens": shard_tokens}
    created = not out_dir.exists()
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(os_error_message(e, out_dir)) from None
    lock = DirLock(out_dir, "prepare_data.py run")
    cleared = False  # whether out_dir's previous contents are gone: then a failure removes what we wrote
    try:
        if not overwrite and _up_to_date(out_dir, settings):
            print(f"{out_dir} is already prepared from this source with these settings (--overwrite rebuilds it)")
            return load_meta(out_dir)
        try:
            ds = load_source(dataset, name, data_files, source_split, text_column, streaming)
            for p in sorted(_our_files(out_dir), key=lambda p: p.name != "meta.json"):
                p.unlink()  # meta.json first: a half-cleared directory never looks prepared
            cleared = True
            t0 = time.time()
            writers = _tokenize(ds, text_column, tok, out_dir, shard_tokens, num_proc, val_fraction, test_fraction)
        except DataError:
            raise
        except Exception as e:
            raise _source_error(e, dataset, name, data_files, text_column) from None
        if sum(w.docs for w in writers.values()) == 0:
            raise DataError(f"source {dataset} {data_files or name or ''} has no documents with text "
                            f"in column {text_column!r}: pass a non-empty source")
        splits = {s: {"docs": w.docs, "tokens": w.tokens, "shards": len(w.files), "files": w.files}
                  for s, w in writers.items()}
        baseline = None
        if writers["val"].tokens:
            baseline = unigram_baseline(writers["train"].counts, writers["val"].counts)
        meta = {**settings, "vocab_size": tok.vocab_size, "eot": tok.eot, "eot_placement": "before each document",
                "splits": splits, "unigram_baseline_nats": baseline}
        _write_atomic(out_dir / "meta.json", [(json.dumps(meta, indent=2) + "\n").encode()])
    except BaseException:
        for p in _our_files(out_dir) if cleared or created else []:
            p.unlink(missing_ok=True)  # shards of a failed run are orphans: never half a preparation
        if created:
            (out_dir / ".lock").unlink(missing_ok=True)
            with suppress(OSError):
                out_dir.rmdir()
        raise
    finally:
        lock.release()

    dt = time.time() - t0
    total = sum(w.tokens for w in writers.values())
    for s, info in splits.items():
        print(f"{s:>5}: {info['docs']:,} docs, {info['tokens']:,} tokens, {info['shards']} shards")
        if info["tokens"] == 0 and s != "train" and meta[f"{s}_fraction"] > 0:
            print(f"warning: split {s} is empty: the source has too few documents for --{s}_fraction", file=sys.stderr)
    if baseline is not None:
        print(f"unigram baseline (val, train frequencies): {baseline:.4f} nats/token")
    print(f"wrote {out_dir} in {dt:.1f}s ({total / dt:,.0f} tokens/s)")
    return meta


# -----------------------------------------------------------------------------
# reading prepared data

def load_meta(data_dir):
    """The meta.json of a prepared data directory."""
    path = Path(data_dir) / "meta.json"
    if not path.is_file():
        raise DataError(f"{path} not found: prepare the data first, with `python prepare_data.py` "
                        f"(and --out_dir {data_dir} for another source; see --help)")
    try:
        meta = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise DataError(f"{path} is not valid JSON ({e}): re-run `python prepare_data.py --overwrite "
                        f"--out_dir {data_dir}` with the same source") from e
    redo = f"re-run `python prepare_data.py --overwrite --out_dir {data_dir}` with the same source"
    if not isinstance(meta, dict):
        raise DataError(f"{path} holds a JSON {type(meta).__name__}, not an object: {redo}")
    if meta.get("format_version") != FORMAT_VERSION:
        raise DataError(f"{path} has format version {meta.get('format_version')}, this code reads "
                        f"{FORMAT_VERSION}: {redo}")
    missing = [k for k in META_KEYS if k not in meta]
    if missing:
        raise DataError(f"{path} lacks {', '.join(missing)}: it is incomplete; {redo}")
    for split, info in meta["splits"].items():
        if not isinstance(info, dict) or "tokens" not in info or "files" not in info:
            raise DataError(f"{path}: split {split!r} lacks its tokens or files: {redo}")
    return meta


META_KEYS = ("tokenizer", "tokenizer_fingerprint", "vocab_size", "splits")  # what readers of meta.json need


def _open_split(data_dir, split):
    """The memory-mapped shards of one split, checked against meta.json."""
    meta = load_meta(data_dir)
    info = meta["splits"].get(split)
    if info is None:
        raise DataError(f"{data_dir} has no split {split!r}: use one of {', '.join(meta['splits'])}")
    if info["tokens"] == 0:
        raise DataError(f"split {split!r} of {data_dir} is empty: re-run prepare_data.py with --overwrite "
                        "and fractions that give it documents")
    return [open_shard(Path(data_dir) / f, meta["tokenizer_fingerprint"]) for f in info["files"]]


def check_split(data_dir, split):
    """Open every shard of a split as the loaders will, and read each token id once (one pass over
    the split's bytes): a shard that is missing, truncated, from another tokenizer or holding an id
    outside the tokenizer's vocabulary is a DataError naming it. Returns the split's token count."""
    meta = load_meta(data_dir)
    vocab = meta["vocab_size"]
    total = 0
    for name, shard in zip(meta["splits"][split]["files"], _open_split(data_dir, split)):
        top = max(int(shard[i:i + (1 << 24)].max()) for i in range(0, len(shard), 1 << 24))
        if top >= vocab:
            raise DataError(f"shard {Path(data_dir) / name} holds token id {top}, outside the {meta['tokenizer']} "
                            f"tokenizer's ids 0..{vocab - 1}: it is corrupt or was written for another tokenizer; "
                            f"re-create it with `python prepare_data.py --overwrite --out_dir {data_dir}`")
        total += len(shard)
    return total


class TokenLoader:
    """Seeded, resumable training batches of a split for any number of ranks.

    Every shard is cut into windows of seq_len + 1 tokens overlapping by one (x = w[:-1], y = w[1:]).
    The windows of all epochs form one stream, epoch e a permutation seeded by (seed, e). Each call
    consumes the next world_size * batch_size windows of the stream and rank r takes the r-th block
    of batch_size: a step sees the same windows whatever its split into ranks and micro-steps.
    """

    def __init__(self, data_dir, split, batch_size, seq_len, rank=0, world_size=1, seed=0):
        if not 0 <= rank < world_size:
            raise DataError(f"rank {rank} is not in 0..{world_size - 1}")
        self.split, self.batch_size, self.seq_len = split, batch_size, seq_len
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.shards = _open_split(data_dir, split)
        per_shard = [(len(s) - 1) // seq_len for s in self.shards]
        self.starts = np.cumsum([0] + per_shard)  # first window id of each shard
        self.n_windows = int(self.starts[-1])
        if self.n_windows == 0:
            raise DataError(f"split {split!r} of {data_dir} has no shard of seq_len + 1 = {seq_len + 1} tokens: "
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
                raise DataError(f"loader state does not fit: {key} is {state.get(key)!r} in the saved state but "
                                f"{mine[key]!r} here; resume with the same data, seed, batch_size and seq_len")
        self.epoch, self.pos = int(state["epoch"]), int(state["pos"])


def eval_batches(data_dir, split, batch_size, seq_len, max_tokens, rank=0, world_size=1):
    """(x, y) batches over the first max_tokens targets of a split (None: all), in order.

    The split is cut into n = min(max_tokens, tokens - 1) // seq_len windows, the same for every
    world_size; rank r gets windows r, r + world_size, ... (when n is not a multiple of world_size,
    the first ranks get one window more: sum losses and token counts over ranks, then divide).
    """
    if not 0 <= rank < world_size:
        raise DataError(f"rank {rank} is not in 0..{world_size - 1}")
    shards = _open_split(data_dir, split)
    total = sum(len(s) for s in shards)
    n = (total - 1 if max_tokens is None else min(max_tokens, total - 1)) // seq_len
    if n == 0 and max_tokens is not None and max_tokens < seq_len:
        raise DataError(f"max_tokens={max_tokens} is less than one window of seq_len={seq_len} targets: "
                        f"raise max_tokens to at least {seq_len}")
    if n == 0:
        raise DataError(f"split {split!r} of {data_dir} has {total} tokens, too few for one window of "
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


# -----------------------------------------------------------------------------
# command line

def _count(text):
    """A positive integer, also written like 1e8."""
    value = float(text)
    if value != int(value) or value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a positive whole number")
    return int(value)


def _fraction(text):
    value = float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"{text} is not in [0, 1]")
    return value


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = parser.add_argument_group("source (default: the embedded Shakespeare corpus)")
    src.add_argument("--dataset", help="hub dataset (e.g. HuggingFaceFW/fineweb-edu), "
                     "or json/parquet/text with --data_files")
    src.add_argument("--name", help="hub dataset config (e.g. sample-10BT)")
    src.add_argument("--data_files", nargs="+", help="local .jsonl[.gz], .json[.gz], .parquet or .txt[.gz] files or "
                     "glob patterns (a .txt file is one document); with a hub --dataset, files inside it")
    src.add_argument("--source_split", default="train", help="split of the source to read")
    src.add_argument("--text_column", default="text")
    src.add_argument("--streaming", action="store_true", help="stream the source instead of caching it first")
    out = parser.add_argument_group("output")
    out.add_argument("--tokenizer", default="gpt2", choices=sorted(TOKENIZERS))
    out.add_argument("--out_dir", help="default: data/<source name>[_<tokenizer> unless gpt2]")
    out.add_argument("--val_fraction", type=_fraction, default=0.05, help="fraction of documents for val")
    out.add_argument("--test_fraction", type=_fraction, default=0.05, help="fraction of documents for test")
    out.add_argument("--shard_tokens", type=_count, default=10**8, help="tokens per shard (1e8 style accepted)")
    out.add_argument("--num_proc", type=_count, default=1, help="tokenizer processes")
    out.add_argument("--overwrite", action="store_true", help="replace what out_dir holds")
    args = parser.parse_args(argv)
    if args.val_fraction + args.test_fraction > 1:
        parser.error("--val_fraction + --test_fraction must be at most 1")
    try:
        prepare(**vars(args))
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
