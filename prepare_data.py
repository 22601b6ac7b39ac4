"""
Tokenize a corpus (local files or a hub dataset) into token shards and meta.json (sources, splits, format: docs/data.md).

    python prepare_data.py                           # embedded Shakespeare -> data/shakespeare/
    python prepare_data.py --tokenizer byte          # as bytes -> data/shakespeare_byte/
    python prepare_data.py --data_files input.txt    # one text, split by position
    python prepare_data.py --dataset HuggingFaceFW/fineweb-edu --name sample-10BT --num_proc 16

A document is EOT + its text; the split fractions count documents. --out_dir is replaced only with
--overwrite, and only once the new data is whole. Exit status 0, or 2 after one `error:` line.
"""

import argparse
import ctypes
import glob
import json
import multiprocessing
import os
import shutil
import signal
import sys
import time
from functools import partial
from itertools import chain, islice
from pathlib import Path

import numpy as np
from tqdm import tqdm

from common import ROOT, UserError, cli, need, write_atomic
from data import (
    DATA_DIR,
    DEFAULT_CORPUS,
    FORMAT_VERSION,
    SPLITS,
    TOKENIZERS,
    check_tokenizer,
    get_tokenizer,
    load_meta,
    write_shard,
)

BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text"}  # by file extension
SPLIT_RULE = "document i by frac((i + 1) / golden ratio); a lone document by position: train, val, test"


def split_of(index, val_fraction, test_fraction):
    """The split ("train", "val" or "test") of document `index`, by the golden ratio."""
    u = ((index + 1) * 0x9E3779B97F4A7C15 % 2**64) / 2**64  # frac((index + 1) / golden ratio)
    return "val" if u < val_fraction else "test" if u < val_fraction + test_fraction else "train"


# --- reading ------------------------------------------------------------------------------------------------

def local_files(patterns):
    """Local source files, each pattern's matches sorted."""
    files = []
    for pattern in patterns:
        matches = sorted(glob.glob(os.path.expanduser(pattern)))
        need(matches, f"source file {pattern} not found: check the path (a hub dataset goes in --dataset)")
        files += [str(Path(f).resolve()) for f in matches]
    return files


def builder_of(files):
    """The builder (json, parquet or text) for local files, by their extension."""
    builders = {BUILDERS.get(Path(f.removesuffix(".gz")).suffix) for f in files}
    need(None not in builders and len(builders) == 1, f"source files {', '.join(files)}: pass files of one format, told "
         f"by the extension ({', '.join(BUILDERS)}, optionally .gz), or say it with --dataset json, parquet or text")
    return builders.pop()


def texts(dataset, name, data_files, source_split, text_column, streaming):
    """The texts of a source, in order, through datasets.load_dataset."""
    where = f"{dataset}{f' ({name})' if name else ''} {' '.join(data_files or [])}".strip()
    try:
        import datasets
        datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # what fails is said once, below
        kw = {"sample_by": "document"} if dataset == "text" else {}  # a .txt file is one document
        ds = datasets.load_dataset(dataset, name, data_files=data_files, split=source_split, streaming=streaming, **kw)
        for i, row in enumerate(ds):
            text = row.get(text_column)
            if not isinstance(text, str) and (text is not None or text_column not in row):
                kind = type(text).__name__ if text_column in row else "missing"
                raise UserError(f"source {where} document {i}: column {text_column!r} is {kind}, not text (its "
                                f"columns: {', '.join(row)}): pass --text_column")
            yield text or ""
    except UserError:
        raise
    except Exception as e:
        cause = e
        while cause.__cause__ or cause.__context__:
            cause = cause.__cause__ or cause.__context__
        reason = ": ".join([type(cause).__name__] + str(cause).strip().splitlines()[:1])
        raise UserError(f"could not read source {where} ({reason}): check the source (a local file that is valid UTF-8 "
                        "JSON, parquet or text; a hub name, --name, --source_split)") from None


def units(texts, val_fraction, test_fraction):
    """(split, text) of every document; a lone document is cut by position."""
    texts = iter(texts)
    head = list(islice(texts, 2))
    if len(head) == 1:  # one document: split by position, as nanoGPT splits input.txt
        text, n = head[0], len(head[0])
        a, b = int(n * (1 - val_fraction - test_fraction)), int(n * (1 - test_fraction))
        yield from (u for u in [("train", text[:a]), ("val", text[a:b]), ("test", text[b:])] if u[1])
        return
    yield from ((split_of(i, val_fraction, test_fraction), t) for i, t in enumerate(chain(head, texts)))


def encode(tokenizer_name, unit):
    split, text = unit
    tok = get_tokenizer(tokenizer_name)
    return split, np.array([tok.eot] + tok.encode(text) if text else [], dtype=np.uint16)


def quiet_worker():
    """A worker ignores Ctrl-C (the main process reports it) and dies of the pool's SIGTERM."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def encoded(units, tokenizer_name, num_proc):
    """encode of each unit, in order, on num_proc processes."""
    if num_proc == 1:
        yield from (encode(tokenizer_name, u) for u in units)
        return
    with multiprocessing.Pool(num_proc, initializer=quiet_worker) as pool:
        units = iter(units)
        while block := list(islice(units, 64 * num_proc)):
            yield from pool.imap(partial(encode, tokenizer_name), block, chunksize=16)


# --- writing ------------------------------------------------------------------------------------------------

class SplitWriter:
    """One split's token stream, cut into shards, and its unigram counts."""

    def __init__(self, out_dir, split, tokenizer, shard_tokens):
        self.out_dir, self.split, self.tok, self.shard_tokens = out_dir, split, tokenizer, shard_tokens
        self.held, self.fill, self.files, self.digests, self.docs, self.tokens = [], 0, [], [], 0, 0
        self.counts = np.zeros(tokenizer.vocab_size, dtype=np.int64)

    def add(self, ids):
        self.docs += len(ids) > 0
        self.tokens += len(ids)
        self.held.append(ids)
        self.fill += len(ids)
        while self.fill >= self.shard_tokens:
            self.flush(self.shard_tokens)

    def flush(self, n=None):
        ids = np.concatenate(self.held) if self.held else np.zeros(0, np.uint16)
        shard, self.held = ids[:n], [ids[len(ids) if n is None else n:]]
        self.fill = len(self.held[0])
        if len(shard):
            for i in range(0, len(shard), 1 << 22):  # bincount makes an int64 copy: a slice at a time
                self.counts += np.bincount(shard[i:i + (1 << 22)], minlength=len(self.counts))
            self.files.append(f"{self.split}_{len(self.files):06d}.bin")
            self.digests.append(write_shard(self.out_dir / self.files[-1], shard, self.tok))


def unigram_baseline(train_counts, val_counts):
    """Cross-entropy (nats/token) of val under the add-one-smoothed unigram distribution of train."""
    logp = np.log(train_counts + 1.0) - np.log(train_counts.sum() + len(train_counts))
    return float(-(val_counts * logp).sum() / val_counts.sum())


def replace_dir(new, out_dir):
    """Put the complete directory `new` in out_dir's place: one atomic exchange where the OS has it (Linux
    renameat2), so a kill at any moment leaves the old data or the new at out_dir, never neither."""
    if not out_dir.exists():
        os.rename(new, out_dir)
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        exchanged = libc.renameat2(-100, os.fsencode(new), -100, os.fsencode(out_dir), 2) == 0  # AT_FDCWD, EXCHANGE
    except (OSError, AttributeError):
        exchanged = False
    if not exchanged:  # two renames: a kill between them leaves both copies beside out_dir, hidden
        old = new.with_name(new.name + ".old")
        os.rename(out_dir, old)
        os.rename(new, out_dir)
        new = old
    shutil.rmtree(new)  # now the old data (a run that opened its shards keeps them: open maps keep their files)


def prepare(dataset=None, name=None, data_files=None, source_split="train", text_column="text",
            streaming=True, tokenizer="gpt2", out_dir=None, val_fraction=0.05, test_fraction=0.05,
            shard_tokens=10**8, num_proc=1, overwrite=False):
    """Tokenize a source into shards and meta.json under out_dir; the meta dict."""
    tok = get_tokenizer(tokenizer)
    need(val_fraction >= 0 and test_fraction >= 0 and val_fraction + test_fraction < 1, f"--val_fraction {val_fraction} "
         f"and --test_fraction {test_fraction}: each must be >= 0 and their sum below 1, to leave documents for train")
    if dataset is None and data_files is None:
        data_files = [str(DEFAULT_CORPUS)]
    local = dataset is None or dataset in BUILDERS.values()
    if local:
        data_files = local_files(data_files or [])
        dataset, stem = dataset or builder_of(data_files), Path(data_files[0]).name.split(".")[0]
        # meta.json records a file inside the repository relative to it, so a moved checkout keeps its preparation
        recorded = [os.path.relpath(p, ROOT) if Path(p).is_relative_to(ROOT) else p for p in data_files]
    else:
        stem, recorded = dataset.split("/")[-1] + (f"-{name}" if name else ""), data_files
    out_dir = Path(out_dir or DATA_DIR / (stem if tok.name == "gpt2" else f"{stem}_{tok.name}"))
    check_tokenizer(out_dir, tok.name)
    inside = [f for f in [dataset, *(data_files or [])] if f and Path(f).exists()  # any local input, whatever reads it
              and Path(f).resolve().is_relative_to(out_dir.resolve())]
    need(not inside, f"{inside[:1]} is inside --out_dir {out_dir}, which a preparation replaces whole: move the corpus "
                     "out of it, or choose another --out_dir")
    settings = {"format_version": FORMAT_VERSION, "split_rule": SPLIT_RULE,
                "source": {"dataset": dataset, "name": name, "data_files": recorded,
                           "split": source_split, "text_column": text_column},
                "tokenizer": tok.name, "tokenizer_fingerprint": tok.fingerprint, "vocab_size": tok.vocab_size,
                "eot": tok.eot, "val_fraction": val_fraction, "test_fraction": test_fraction, "shard_tokens": shard_tokens}
    prepared = (out_dir / "meta.json").is_file()
    if prepared and not overwrite:
        old = load_meta(out_dir)
        if all(old.get(k) == v for k, v in settings.items()):
            print(f"{out_dir} is already prepared from this source with these settings (--overwrite rebuilds it)")
            return old
        raise UserError(f"{out_dir} holds data prepared otherwise: pass --overwrite to replace it, or choose "
                        "another --out_dir")
    need(prepared or not out_dir.exists() or (out_dir.is_dir() and not any(out_dir.iterdir())),
         f"--out_dir {out_dir} is a file, or holds files but no preparation (meta.json): choose another --out_dir")
    real = out_dir.resolve()  # (a link to a directory elsewhere: the new data goes there)
    real.parent.mkdir(parents=True, exist_ok=True)
    tmp = real.with_name(f".{real.name}.{os.getpid()}.tmp")  # hidden beside out_dir, on its file system
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        t0 = time.time()
        writers = {s: SplitWriter(tmp, s, tok, shard_tokens) for s in SPLITS}
        source = texts(dataset, name, data_files, source_split, text_column, streaming)
        for split, ids in tqdm(encoded(units(source, val_fraction, test_fraction), tok.name, num_proc),
                               unit="docs", desc="tokenizing", disable=None):  # no bar unless stderr is a terminal
            writers[split].add(ids)
        for w in writers.values():
            w.flush()
        need(writers["train"].tokens, f"the train split of {out_dir} would be empty ({sum(w.docs for w in writers.values())} "
             "documents with text): pass more documents, or lower --val_fraction / --test_fraction")
        splits = {s: {"docs": w.docs, "tokens": w.tokens, "shards": len(w.files), "files": w.files, "blake2b": w.digests}
                  for s, w in writers.items()}
        baseline = unigram_baseline(writers["train"].counts, writers["val"].counts) if writers["val"].tokens else None
        meta = {**settings, "splits": splits, "unigram_baseline_nats": baseline}
        write_atomic(tmp / "meta.json", json.dumps(meta, indent=2) + "\n")  # the last file of a preparation
        replace_dir(tmp, real)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # what a failure left (after the rename: nothing)
    for s, info in splits.items():
        print(f"{s:>5}: {info['docs']:,} docs, {info['tokens']:,} tokens, {info['shards']} shards")
    if baseline is not None:
        print(f"unigram baseline (val, train frequencies): {baseline:.4f} nats/token")
    dt = time.time() - t0
    print(f"wrote {out_dir} in {dt:.1f}s ({sum(w.tokens for w in writers.values()) / max(dt, 1e-9):,.0f} tokens/s)")
    return meta


# --- command line -------------------------------------------------------------------------------------------

def _count(text):
    """A positive integer, also written like 1e8."""
    value = float(text)
    if not 1 <= value <= 2**62 or value != int(value):  # (inf and nan too)
        raise argparse.ArgumentTypeError(f"{text} is not a positive whole number")
    return int(value)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = parser.add_argument_group("source (default: the embedded Shakespeare corpus)")
    src.add_argument("--dataset", help="hub dataset (e.g. HuggingFaceFW/fineweb-edu), or json/parquet/text "
                     "with --data_files")
    src.add_argument("--name", help="hub dataset config (e.g. sample-10BT)")
    src.add_argument("--data_files", nargs="+", help="local .jsonl, .json, .parquet or .txt files (.gz too) or glob "
                     "patterns; with a hub --dataset, files inside it")
    src.add_argument("--source_split", default="train", help="split of the source to read")
    src.add_argument("--text_column", default="text")
    src.add_argument("--streaming", action=argparse.BooleanOptionalAction, default=True,
                     help="stream the source (the default) or, with --no-streaming, download and cache it first")
    out = parser.add_argument_group("output")
    out.add_argument("--tokenizer", default="gpt2", choices=sorted(TOKENIZERS))
    out.add_argument("--out_dir", help="default: data/<source name>[_<tokenizer> unless gpt2]")
    out.add_argument("--val_fraction", type=float, default=0.05, help="fraction of documents for val")
    out.add_argument("--test_fraction", type=float, default=0.05, help="fraction of documents for test")
    out.add_argument("--shard_tokens", type=_count, default=10**8, help="tokens per shard (1e8 style accepted)")
    out.add_argument("--num_proc", type=_count, default=1, help="tokenizer processes")
    out.add_argument("--overwrite", action="store_true", help="replace what out_dir holds")
    return cli(lambda argv: prepare(**vars(parser.parse_args(argv))), argv)


if __name__ == "__main__":
    sys.exit(main())
