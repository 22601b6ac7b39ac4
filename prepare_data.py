"""
Tokenize a text corpus into binary shards (their format: shards.py).

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
import glob
import gzip
import json
import multiprocessing
import os
import re
import shutil
import sys
import time
from collections import deque
from contextlib import suppress
from pathlib import Path

import numpy as np

from depthres.files import DirLock, os_error_message, sync_dir
from depthres.shards import (
    DATA_DIR,
    FORMAT_VERSION,
    SPLITS,
    TOKENIZERS,
    DataError,
    check_fits_uint16,
    get_tokenizer,
    load_meta,
    read_header,
    write_meta,
    write_shard,
)

DEFAULT_CORPUS = DATA_DIR / "shakespeare.jsonl.gz"
# the files a preparation owns in its out_dir (and their temporary names while being written)
OUR_FILES = re.compile(r"\.?((train|val|test)_\d{6}\.bin|meta\.json)(\.tmp)?")
STAGING = ".prepare_data-staging"  # a preparation is built here, beside the one it replaces, then moved in
MAX_SHARD_TOKENS = 2**30  # a shard is assembled in memory: 2 GiB of uint16 ids


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
    """Tokenize a source into shards under out_dir and write its meta.json; returns the meta dict.
    The new preparation is built in out_dir/.prepare_data-staging and moved into place once complete,
    so a failure (a bad source, a full disk, an interrupt) leaves what out_dir held as it was."""
    tok = get_tokenizer(tokenizer)
    check_fits_uint16(tok)
    if val_fraction + test_fraction >= 1:
        raise DataError(f"--val_fraction {val_fraction} + --test_fraction {test_fraction} leaves no documents for "
                        "the train split: keep their sum below 1")
    if not 1 <= shard_tokens <= MAX_SHARD_TOKENS:
        raise DataError(f"--shard_tokens {shard_tokens:g} is out of range: a shard is assembled in memory (2 bytes "
                        f"a token), so use 1 to {MAX_SHARD_TOKENS:,} (default 1e8)")
    if dataset is None and data_files is None:
        data_files = [str(DEFAULT_CORPUS)]
    local = dataset is None or dataset in set(BUILDERS.values())
    if local:
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
    for f in data_files if local else ():
        if out_dir.resolve() in Path(f).parents:
            raise DataError(f"source file {f} lies inside --out_dir {out_dir}, whose files prepare_data.py writes "
                            "and replaces: move the source out of it, or choose another --out_dir")
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
    lock = DirLock(out_dir, "prepare_data.py run", DataError)
    staging, swapping = out_dir / STAGING, False  # swapping: out_dir's previous preparation is being replaced
    try:
        shutil.rmtree(staging, ignore_errors=True)  # what a killed run left
        if not overwrite and _up_to_date(out_dir, settings):
            print(f"{out_dir} is already prepared from this source with these settings (--overwrite rebuilds it)")
            return load_meta(out_dir)
        had = (out_dir / "meta.json").exists()
        try:
            staging.mkdir()
            ds = load_source(dataset, name, data_files, source_split, text_column, streaming)
            t0 = time.time()
            writers = _tokenize(ds, text_column, tok, staging, shard_tokens, num_proc, val_fraction, test_fraction)
            if sum(w.docs for w in writers.values()) == 0:
                raise DataError(f"source {dataset} {data_files or name or ''} has no documents with text "
                                f"in column {text_column!r}: pass a non-empty source")
            if writers["train"].tokens == 0:
                raise DataError(f"the train split is empty: all {sum(w.docs for w in writers.values())} documents went "
                                "to val or test; lower --val_fraction / --test_fraction, or pass more documents")
        except DataError as e:
            raise DataError(f"{e}; {out_dir}'s previous preparation is unchanged" if had else str(e)) from None
        except OSError as e:
            raise DataError(os_error_message(e, staging) + (f"; {out_dir}'s previous preparation is unchanged"
                                                            if had else "")) from None
        except Exception as e:
            raise _source_error(e, dataset, name, data_files, text_column) from None
        splits = {s: {"docs": w.docs, "tokens": w.tokens, "shards": len(w.files), "files": w.files}
                  for s, w in writers.items()}
        baseline = None
        if writers["val"].tokens:
            baseline = unigram_baseline(writers["train"].counts, writers["val"].counts)
        meta = {**settings, "vocab_size": tok.vocab_size, "eot": tok.eot, "eot_placement": "before each document",
                "splits": splits, "unigram_baseline_nats": baseline}
        write_meta(staging, meta)
        swapping = True
        try:
            _swap_in(staging, out_dir)
        except OSError as e:
            raise DataError(f"{os_error_message(e, out_dir)}, while moving the new preparation into place: "
                            "neither the old one nor the new one is left; run prepare_data.py again") from None
        swapping = False  # done: the new preparation is whole
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        for p in _our_files(out_dir) if swapping or created else []:
            p.unlink(missing_ok=True)  # half a swap is no preparation: never leave one that looks valid
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


def _swap_in(staging, out_dir):
    """Move the complete preparation in `staging` into out_dir, in place of what out_dir held. The old
    meta.json goes first and the new one comes last, so a directory caught halfway never looks prepared;
    each move is a rename (no room needed beyond what both preparations already take)."""
    (out_dir / "meta.json").unlink(missing_ok=True)
    new = {p.name for p in staging.iterdir()}
    for p in _our_files(out_dir):
        if p.name not in new:
            p.unlink()
    for p in sorted(staging.iterdir(), key=lambda p: p.name == "meta.json"):
        os.replace(p, out_dir / p.name)
    sync_dir(out_dir)
    staging.rmdir()


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
    try:
        prepare(**vars(args))
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
