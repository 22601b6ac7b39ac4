"""
Tokenize a text corpus into binary shards (their format: token_data.py).

    python prepare_data.py                              # embedded Shakespeare -> data/shakespeare/
    python prepare_data.py --tokenizer byte             # same corpus as bytes -> data/shakespeare_byte/
    python prepare_data.py --data_files input.txt       # one text, cut into pieces for the splits (below)
    python prepare_data.py --data_files 'corpus/*.parquet' --out_dir data/corpus --num_proc 8
    python prepare_data.py --dataset HuggingFaceFW/fineweb-edu --name sample-10BT \
        --val_fraction 0.001 --test_fraction 0.001 --num_proc 16

An output directory holds {train,val,test}_NNNNNN.bin shards and meta.json (written last), and a
.lock file: one preparation at a time writes into it (a second one is refused). A run that fails
removes what it wrote; a directory it created is removed too.
Reading: every source is read as a stream, one document (or one piece of one) at a time, so memory
does not grow with the corpus: it holds the shard being filled of each split (--shard_tokens ids of
2 bytes at most) and the record a JSON or parquet reader is on; a .txt file is never held whole (a
JSON array file, `[{...}, ...]`, is: use JSON lines for large corpora). depthres/sources.py reads the
sources: local files itself; a hub --dataset streams through `datasets` (--no-streaming downloads and
caches it first). A UTF-8 byte order mark at the start of a file is dropped, and the line ends of a
.txt file become "\\n".
Documents: a .txt file is one document, and so is a JSON or parquet record. Each one is tokenized as
<|endoftext|> followed by its text, so EOT marks the start of every document (nanoGPT's convention),
and a split is the concatenation of its documents.
Splits: document i (its position in the source) goes to val, test or train by the fractional
part of (i + 1) / golden ratio (Fibonacci hashing): the same on every machine and for every
--num_proc, it needs no document count (streaming works), and it spreads each split evenly over
the corpus, so even the 42 Shakespeare documents give 2 val and 2 test documents at 5% each.
The fractions count documents, not tokens.
THE CUTTING RULE (a lone text, such as nanoGPT's input.txt, and very long documents):
  - which: a document longer than CUT_CHARS = 1,048,576 characters, and a source's only document
    (one .txt file, or a single record), is cut into pieces; every other document stays whole;
  - where: a piece ends at the first line end ("\\n") at or after PIECE_CHARS = 4,096 characters;
    where no line ends before LONG_LINE_CHARS = 16,384 characters, after the last space or tab
    before that length, or else at it; the last piece is what is left;
  - splits: piece j of document i goes to the split document i + j would go to, so a lone text's
    pieces split as documents 0, 1, 2, ... do (a 1.1 MB input.txt: about 270 pieces, about 13 in
    val and 13 in test at 5% each), and every document that is not cut keeps its split;
  - filling: a lone text whose pieces would leave val or test empty (a positive fraction, and no piece
    drawn for it) gives that split one of its last FILL_WINDOW = 4 pieces that went to train, val the
    last such one, test the one before, as long as train keeps one: a lone text of 3 pieces or more
    fills every split (a 20 kB text: 6 pieces, 4 train, 1 val, 1 test);
  - EOT: a piece starts with EOT where its split's text jumps: at the document's first piece, and
    where the piece before it went to another split. A run of consecutive pieces in one split is
    the document's text unchanged; a split of a cut text is its runs, EOT before each.
  The fractions then count pieces; meta.json's docs count pieces too.
  A preparation written before this rule (its meta.json has no cut_documents) counts as up to date
  unless it holds a lone document; rebuild one that had documents above CUT_CHARS with --overwrite
  to cut them.
Settings train.py cannot use are said before any work: --val_fraction 0 (an empty val split, which
train.py refuses) and a --shard_tokens below one training window (train.py's default seq_len + 1; a
window never crosses a shard) are each a `warning:` line; a split cut into more than MAX_SHARDS =
10,000 shards (a file each) is an error.
Exit status: 0 done; 2 with one `error:` line (bad flags, a source that cannot be read, an out_dir
that cannot be written, too many shards), leaving no output behind; 130 on Ctrl-C (`stopped by
Ctrl-C; ...`).
"""

import argparse
import fcntl
import multiprocessing
import os
import re
import shutil
import signal
import sys
import time
from collections import deque
from contextlib import suppress
from itertools import chain
from pathlib import Path

import numpy as np

from common import Stopped, UserError, cli, os_error_message
from depthres.sources import BUILDERS, READ_CHARS, documents, format_of, local_files
from depthres.token_data import (
    DATA_DIR,
    FORMAT_VERSION,
    SPLITS,
    TOKENIZERS,
    check_fits_uint16,
    get_tokenizer,
    load_meta,
    read_header,
    write_meta,
    write_shard,
)

DEFAULT_CORPUS = DATA_DIR / "shakespeare.jsonl.gz"
# the files a preparation owns in its out_dir, and their temporary names while being written (files.temporary;
# .NAME.tmp: an older version's)
OUR_FILES = re.compile(r"\.?((train|val|test)_\d{6}\.bin|meta\.json)(\.tmp|\.\d+-[0-9a-f]{8}\.tmp)?")
STAGING = ".prepare_data-staging"  # a preparation is built here, beside the one it replaces, then moved in
MAX_SHARD_TOKENS = 2**30  # a shard is assembled in memory: 2 GiB of uint16 ids
MAX_SHARDS = 10_000  # per split: more is a --shard_tokens far too small for the corpus (one file a shard)
WINDOW = 256 + 1  # a training window at train.py's default seq_len

# the cutting rule: the module docstring (--help) states it
CUT_CHARS = 1 << 20
PIECE_CHARS = 1 << 12
LONG_LINE_CHARS = 1 << 14
FILL_WINDOW = 4
CUT_RULE = {"above_chars": CUT_CHARS, "or_lone": True, "piece_chars": PIECE_CHARS, "long_line_chars": LONG_LINE_CHARS,
            "eot": "before a document, and before a piece whose predecessor went to another split",
            "fill": f"a lone text's empty val, test take its last train pieces (of its last {FILL_WINDOW})"}


# -----------------------------------------------------------------------------
# splits and cutting

def split_of(index, val_fraction, test_fraction):
    """The split ("train", "val" or "test") of the document at position `index` of the source."""
    u = ((index + 1) * 0x9E3779B97F4A7C15 % 2**64) / 2**64  # frac((index + 1) / golden ratio)
    if u < val_fraction:
        return "val"
    if u < val_fraction + test_fraction:
        return "test"
    return "train"


def _piece_end(buf):
    """Where the first piece of `buf` ends (an index past its last character), or None when `buf`
    is too short to tell."""
    end = buf.find("\n", PIECE_CHARS - 1, LONG_LINE_CHARS)
    if end >= 0:
        return end + 1
    if len(buf) < LONG_LINE_CHARS:
        return None
    end = max(buf.rfind(" ", PIECE_CHARS - 1, LONG_LINE_CHARS), buf.rfind("\t", PIECE_CHARS - 1, LONG_LINE_CHARS))
    return end + 1 if end >= 0 else LONG_LINE_CHARS


def _pieces(blocks):
    """The pieces of a text given as consecutive blocks of it. A block is taken READ_CHARS characters at a
    time, so a piece costs a copy of at most that much however long the block (a whole record's text)."""
    buf = ""
    for block in blocks:
        for start in range(0, len(block), READ_CHARS):
            buf += block[start:start + READ_CHARS]
            while (end := _piece_end(buf)) is not None:
                yield buf[:end]
                buf = buf[end:]
    if buf:
        yield buf


def _filled(assigned, wanted):
    """`assigned`, the [split, piece] of a lone text's pieces in order, with the splits in `wanted` that no
    piece went to filled. Holds FILL_WINDOW pieces, never the text."""
    seen, tail, trains = set(), deque(), 0
    for split, piece in assigned:
        tail.append([split, piece])
        if len(tail) > FILL_WINDOW:
            done = tail.popleft()
            seen.add(done[0])
            trains += done[0] == "train"
            yield done
    seen |= {split for split, _ in tail}
    missing = [s for s in wanted if s not in seen]
    late = [unit for unit in reversed(tail) if unit[0] == "train"]
    for split, unit in zip(missing, late[:max(0, trains + len(late) - 1)]):
        unit[0] = split
    yield from tail


def _units(documents, split_of_index, cut, wanted):
    """(split, text, eot) of every document that stays whole and of every piece of the ones that are cut,
    in order; eot: the unit starts with EOT. documents: sources.documents'. split_of_index: document index ->
    split. cut: a dict that counts the documents cut and their pieces, and says whether the source is one
    lone document. wanted: the splits besides train with a positive fraction (a lone text fills them)."""
    documents = iter(documents)
    held = [doc for doc in (next(documents, None), next(documents, None)) if doc is not None]
    cut["lone"] = lone = len(held) == 1  # one document of lookahead tells the source's only one
    for i, blocks in enumerate(chain(held, documents)):
        blocks, head, size = iter(blocks), [], 0
        if not lone:  # hold up to CUT_CHARS of the text to see whether it is longer
            for block in blocks:
                head.append(block)
                size += len(block)
                if size > CUT_CHARS:
                    break
            else:
                yield split_of_index(i), "".join(head), True
                continue
        n, before = 0, None
        assigned = ([split_of_index(i + j), piece] for j, piece in enumerate(_pieces(chain(head, blocks))))
        for split, piece in _filled(assigned, wanted) if lone else assigned:
            yield split, piece, split != before
            before, n = split, n + 1
        cut["documents"] += n > 0
        cut["pieces"] += n


# -----------------------------------------------------------------------------
# tokenizing

CHUNK_CHARS = 1 << 18  # characters of text per tokenizer task


def _chunks(units):
    """Lists of consecutive units of about CHUNK_CHARS characters in all, in order: a tokenizer task each."""
    chunk, size = [], 0
    for unit in units:
        chunk.append(unit)
        size += len(unit[1])
        if size >= CHUNK_CHARS:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def _encode(tokenizer_name, units):
    """The tokens of units, as EOT (where the unit says so) + encode(text) each (nothing for an empty text),
    with each unit's token count and split id."""
    tok = get_tokenizer(tokenizer_name)
    ids, lengths = [], []
    for _, text, eot in units:
        doc = [tok.eot] * eot + tok.encode(text) if text else []
        ids += doc
        lengths.append(len(doc))
    splits = [SPLITS.index(split) for split, _, _ in units]
    return np.array(ids, dtype=np.uint16), np.array(lengths, dtype=np.int64), np.array(splits)


def _ignore_sigint():
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process' to handle, and to report


def _encoded(chunks, tokenizer_name, num_proc):
    """_encode of each chunk, in order, on `num_proc` processes with a bounded backlog."""
    if num_proc == 1:
        yield from (_encode(tokenizer_name, chunk) for chunk in chunks)
        return
    with multiprocessing.Pool(num_proc, initializer=_ignore_sigint) as pool:
        pending = deque()
        for chunk in chunks:
            pending.append(pool.apply_async(_encode, (tokenizer_name, chunk)))
            if len(pending) >= 2 * num_proc:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def _our_files(out_dir):
    return sorted(p for p in out_dir.iterdir() if OUR_FILES.fullmatch(p.name)) if out_dir.is_dir() else []


def _setting(meta, key):
    """A setting of a meta.json; one written before the cutting rule held its documents whole, which is the
    rule's result unless the source was one document (or had one above CUT_CHARS: see the docstring)."""
    if key == "cut_documents" and key not in meta and sum(s.get("docs", 0) for s in meta["splits"].values()) > 1:
        return CUT_RULE
    if key == "cut_documents" and isinstance(meta.get(key), dict) and "fill" not in meta[key] and \
            {**meta[key], "fill": CUT_RULE["fill"]} == CUT_RULE and \
            all(meta["splits"][s]["tokens"] for s in ("val", "test") if meta[f"{s}_fraction"] > 0):
        return CUT_RULE  # written before the filling, which fills only a split left empty: the same data
    return meta.get(key)


def _up_to_date(out_dir, settings):
    """True if out_dir holds exactly this preparation; UserError if it holds one that would be lost."""
    shards = [p for p in _our_files(out_dir) if p.suffix == ".bin"]
    meta = load_meta(out_dir) if (out_dir / "meta.json").exists() else None
    old = meta or (read_header(shards[0]) if shards else None)
    if old is None:
        return False
    if old["tokenizer_fingerprint"] != settings["tokenizer_fingerprint"]:
        raise UserError(f"{out_dir} holds shards from tokenizer {old['tokenizer']!r}, not {settings['tokenizer']!r}: "
                        "pass --overwrite to replace them, or choose another --out_dir")
    if meta is None:
        return False  # shards without meta.json are what an interrupted run left: nothing to lose
    changed = ", ".join(k for k in settings if _setting(meta, k) != settings[k])
    if not changed:
        return True
    raise UserError(f"{out_dir} holds data prepared with other settings ({changed}): "
                    "pass --overwrite to replace it, or choose another --out_dir")


class ShardWriter:
    """Cuts the token stream of one split into shards of `shard_tokens` tokens."""

    def __init__(self, out_dir, split, tokenizer, shard_tokens):
        self.out_dir, self.split, self.tokenizer = out_dir, split, tokenizer
        self.buf = np.empty(shard_tokens, dtype=np.uint16)  # its pages are taken as it fills
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
        if len(self.files) == MAX_SHARDS:
            raise UserError(f"--shard_tokens {len(self.buf):,} cuts the {self.split} split into more than {MAX_SHARDS:,} "
                            "shards (a file each): raise --shard_tokens (default 1e8)")
        shard = self.buf[:self.fill]
        for i in range(0, len(shard), 1 << 22):  # bincount works on int64 copies: a slice at a time, not the shard
            self.counts += np.bincount(shard[i:i + (1 << 22)], minlength=len(self.counts))
        name = f"{self.split}_{len(self.files):06d}.bin"
        write_shard(self.out_dir / name, shard, self.tokenizer)
        self.files.append(name)
        self.fill = 0


def unigram_baseline(train_counts, val_counts):
    """Cross-entropy (nats/token) of val under the add-one-smoothed unigram distribution of train."""
    logp = np.log(train_counts + 1.0) - np.log(train_counts.sum() + len(train_counts))
    return float(-(val_counts * logp).sum() / val_counts.sum())


def _tokenize(documents, tok, out_dir, shard_tokens, num_proc, val_fraction, test_fraction, cut):
    """Tokenize the documents into the shards of each split; returns the ShardWriter of each split."""
    from tqdm import tqdm
    writers = {s: ShardWriter(out_dir, s, tok, shard_tokens) for s in SPLITS}
    wanted = [s for s, f in (("val", val_fraction), ("test", test_fraction)) if f > 0]
    units = _units(documents, lambda i: split_of(i, val_fraction, test_fraction), cut, wanted)
    with tqdm(unit="docs", desc="tokenizing", disable=None) as bar:  # no bar when stderr is not a terminal
        for tokens, lengths, split in _encoded(_chunks(units), tok.name, num_proc):
            token_split = np.repeat(split, lengths)
            for i, s in enumerate(SPLITS):
                writers[s].add(tokens[token_split == i], int(np.count_nonzero((split == i) & (lengths > 0))))
            bar.update(len(lengths))
    for w in writers.values():
        w.flush()
    return writers


def prepare(dataset=None, name=None, data_files=None, source_split="train", text_column="text",
            streaming=True, tokenizer="gpt2", out_dir=None, val_fraction=0.05, test_fraction=0.05,
            shard_tokens=10**8, num_proc=1, overwrite=False):
    """Tokenize a source into shards under out_dir and write its meta.json; returns the meta dict.
    The new preparation is built in out_dir/.prepare_data-staging and moved into place once complete,
    so a failure (a bad source, a full disk, an interrupt) leaves what out_dir held as it was.
    streaming only matters for a hub dataset (local files are always read as a stream)."""
    tok = get_tokenizer(tokenizer)
    check_fits_uint16(tok)
    if val_fraction + test_fraction >= 1:
        raise UserError(f"--val_fraction {val_fraction} + --test_fraction {test_fraction} leaves no documents for "
                        "the train split: keep their sum below 1")
    if not 1 <= shard_tokens <= MAX_SHARD_TOKENS:
        raise UserError(f"--shard_tokens {shard_tokens:g} is out of range: a shard is assembled in memory (2 bytes "
                        f"a token), so use 1 to {MAX_SHARD_TOKENS:,} (default 1e8)")
    if val_fraction == 0:
        print("warning: --val_fraction 0 leaves the val split empty: train.py evaluates on it and refuses such data; "
              "pass --val_fraction > 0 (default 0.05) to train on it", file=sys.stderr, flush=True)
    if shard_tokens < WINDOW:
        print(f"warning: --shard_tokens {shard_tokens} holds less than one training window (train.py's default seq_len "
              f"+ 1 = {WINDOW} tokens), and a window never crosses a shard: train.py would read nothing of such "
              "shards; pass --shard_tokens 1e6 or more", file=sys.stderr, flush=True)
    if dataset is None and data_files is None:
        data_files = [str(DEFAULT_CORPUS)]
    local = dataset is None or dataset in set(BUILDERS.values())
    if local:
        if not data_files:
            raise UserError(f"--dataset {dataset} reads local files: pass them with --data_files")
        if source_split != "train":
            raise UserError(f"--source_split {source_split} names a split of a hub dataset; local files are read "
                            "whole: drop it")
        data_files = local_files(data_files)
        dataset = dataset or format_of(data_files)
        stem = Path(data_files[0]).name.split(".")[0]
    else:  # a hub dataset
        stem = dataset.split("/")[-1] + (f"-{name}" if name else "")
    if out_dir is None:
        out_dir = DATA_DIR / (stem if tok.name == "gpt2" else f"{stem}_{tok.name}")
    out_dir = Path(out_dir)
    if out_dir.is_symlink() and not out_dir.exists():
        raise UserError(f"--out_dir {out_dir} is a symbolic link to {os.readlink(out_dir)}, which does not exist: "
                        "create that directory, or pass another --out_dir")
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"--out_dir {out_dir} is a file, not a directory")
    for f in data_files if local else ():
        if out_dir.resolve() in Path(f).parents:
            raise UserError(f"source file {f} lies inside --out_dir {out_dir}, whose files prepare_data.py writes "
                            "and replaces: move the source out of it, or choose another --out_dir")
    source = {"dataset": dataset, "name": name, "data_files": data_files,
              "split": source_split, "text_column": text_column}
    settings = {"format_version": FORMAT_VERSION, "source": source, "tokenizer": tok.name,
                "tokenizer_fingerprint": tok.fingerprint, "val_fraction": val_fraction,
                "test_fraction": test_fraction, "shard_tokens": shard_tokens, "cut_documents": CUT_RULE}
    created = not out_dir.exists()
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(os_error_message(e, out_dir)) from None
    lock = os.open(out_dir / ".lock", os.O_RDWR | os.O_CREAT, 0o644)  # (depthres.files is gone: the data side's
    try:                                                             # rewrite replaces this file)
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise UserError(f"{out_dir} is in use by another prepare_data.py run") from None
    staging, swapping = out_dir / STAGING, False  # swapping: out_dir's previous preparation is being replaced
    kept = f"; {out_dir}'s previous preparation is unchanged" if (out_dir / "meta.json").exists() else ""
    lost = (f"while moving the new preparation into place: {out_dir} holds neither the old one nor the new one; "
            "run prepare_data.py again")
    try:
        shutil.rmtree(staging, ignore_errors=True)  # what a killed run left
        odd = next((p for p in _our_files(out_dir) if p.is_symlink() or not p.is_file()), None)
        if odd is not None:  # (before any compute, and before --overwrite removes a shard)
            kind = "a symbolic link" if odd.is_symlink() else "a directory" if odd.is_dir() else "not a regular file"
            raise UserError(f"{odd} is {kind}, where prepare_data.py keeps a file of its own: move or remove it, then "
                            "run again")
        if not overwrite and _up_to_date(out_dir, settings):
            print(f"{out_dir} is already prepared from this source with these settings (--overwrite rebuilds it)")
            return load_meta(out_dir)
        try:
            staging.mkdir()
        except OSError as e:
            raise UserError(os_error_message(e, staging) + kept) from None
        cut = {"documents": 0, "pieces": 0, "lone": False}
        try:
            t0 = time.time()
            docs = documents(dataset, name, data_files, source_split, text_column, streaming)
            writers = _tokenize(docs, tok, staging, shard_tokens, num_proc, val_fraction, test_fraction, cut)
            if sum(w.docs for w in writers.values()) == 0:
                raise UserError(f"source {dataset} {data_files or name or ''} has no documents with text "
                                f"in column {text_column!r}: pass a non-empty source")
            if writers["train"].tokens == 0:
                raise UserError(f"the train split is empty: all {sum(w.docs for w in writers.values())} documents went "
                                "to val or test; lower --val_fraction / --test_fraction, or pass more documents")
            splits = {s: {"docs": w.docs, "tokens": w.tokens, "shards": len(w.files), "files": w.files}
                      for s, w in writers.items()}
            baseline = None
            if writers["val"].tokens:
                baseline = unigram_baseline(writers["train"].counts, writers["val"].counts)
            meta = {**settings, "vocab_size": tok.vocab_size, "eot": tok.eot,
                    "eot_placement": "before each document (in a cut one, where its split's text jumps)",
                    "splits": splits, "unigram_baseline_nats": baseline}
            write_meta(staging, meta)
        except UserError as e:
            raise UserError(f"{e}{kept}") from None
        except OSError as e:  # reading raises UserError, and writing a shard does too: this is something else
            raise UserError(f"{type(e).__name__} while preparing into {staging}: {e}{kept}") from None
        swapping = True
        try:
            _swap_in(staging, out_dir)
        except OSError as e:
            raise UserError(f"{os_error_message(e, out_dir)}, {lost}") from None
        swapping = False  # done: the new preparation is whole
    except BaseException as e:
        shutil.rmtree(staging, ignore_errors=True)
        for p in _our_files(out_dir) if swapping or created else []:
            p.unlink(missing_ok=True)  # half a swap is no preparation: never leave one that looks valid
        if created:
            (out_dir / ".lock").unlink(missing_ok=True)
            with suppress(OSError):
                out_dir.rmdir()
        if isinstance(e, KeyboardInterrupt) and not isinstance(e, Stopped):  # Ctrl-C: say what out_dir holds now
            if swapping:
                raise Stopped(f"stopped by Ctrl-C {lost}") from None
            raise Stopped("stopped by Ctrl-C" + (kept or f"; nothing was left in {out_dir}")) from None
        raise
    finally:
        os.close(lock)

    dt = time.time() - t0
    total = sum(w.tokens for w in writers.values())
    for s, info in splits.items():
        print(f"{s:>5}: {info['docs']:,} docs, {info['tokens']:,} tokens, {info['shards']} shards")
        if info["tokens"] == 0 and s != "train" and meta[f"{s}_fraction"] > 0:
            few = (f"the lone text gave only {cut['pieces']} pieces of about {PIECE_CHARS:,} characters (3 fill every "
                   "split): pass more text" if cut["lone"] else
                   f"the source has too few documents for --{s}_fraction")
            print(f"warning: split {s} is empty: {few}", file=sys.stderr)
    if cut["documents"]:
        print(f"cut {cut['documents']:,} document(s) (a lone one, or longer than {CUT_CHARS:,} characters) into "
              f"{cut['pieces']:,} pieces at line ends for the splits (the cutting rule: prepare_data.py --help)")
    if baseline is not None:
        print(f"unigram baseline (val, train frequencies): {baseline:.4f} nats/token")
    print(f"wrote {out_dir} in {dt:.1f}s ({total / max(dt, 1e-9):,.0f} tokens/s)")
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
                     "glob patterns (a .txt file is one document; a lone or very long one is cut: see above); "
                     "with a hub --dataset, files inside it")
    src.add_argument("--source_split", default="train", help="split of a hub dataset to read")
    src.add_argument("--text_column", default="text")
    src.add_argument("--streaming", action=argparse.BooleanOptionalAction, default=True,
                     help="stream a hub dataset (the default) or, with --no-streaming, download and cache it "
                     "first; local files are always read as a stream")
    out = parser.add_argument_group("output")
    out.add_argument("--tokenizer", default="gpt2", choices=sorted(TOKENIZERS))
    out.add_argument("--out_dir", help="default: data/<source name>[_<tokenizer> unless gpt2]")
    out.add_argument("--val_fraction", type=_fraction, default=0.05, help="fraction of documents for val")
    out.add_argument("--test_fraction", type=_fraction, default=0.05, help="fraction of documents for test")
    out.add_argument("--shard_tokens", type=_count, default=10**8, help="tokens per shard (1e8 style accepted)")
    out.add_argument("--num_proc", type=_count, default=1, help="tokenizer processes")
    out.add_argument("--overwrite", action="store_true", help="replace what out_dir holds")

    def run(argv):
        try:
            prepare(**vars(parser.parse_args(argv)))
        except KeyboardInterrupt as e:  # before prepare() started: nothing to clean up
            raise e if isinstance(e, Stopped) else Stopped("stopped by Ctrl-C; nothing was written") from None
    return cli(run, argv)


if __name__ == "__main__":
    sys.exit(main())
