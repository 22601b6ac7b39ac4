"""
Where prepare_data.py's documents come from (documents()): local files (JSON lines or a JSON array, parquet, text;
.gz too) and hub datasets through `datasets`, each read as a stream of texts. Whatever a source does
wrong (a missing or empty file, the same file twice, mixed formats, bytes that are not UTF-8, a record
without the text field, a damaged file, a hub dataset that cannot be read) is one UserError that names
the source, the line or record, and what to do.
"""

import glob
import gzip
import io
import json
import os
import re
import zlib
from contextlib import contextmanager
from pathlib import Path

from common import UserError

READ_CHARS = 1 << 16  # a .txt file is read in blocks of this many characters

BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text"}


def local_files(patterns):
    """Expand and check local source files; sorted, so the document order is the same everywhere."""
    files, seen = [], {}
    for pattern in patterns:
        matches = sorted(glob.glob(os.path.expanduser(pattern)))
        if not matches:
            raise UserError(f"source file {pattern} not found: check the path (a hub dataset goes in --dataset)")
        for f in matches:
            if not os.path.isfile(f):
                raise UserError(f"source {f} is not a file: pass files or a pattern such as '{f}/*.parquet'")
            st = os.stat(f)
            if st.st_size == 0:
                raise UserError(f"source file {f} is empty: pass a file with documents")
            if (st.st_dev, st.st_ino) in seen:  # the same file twice, by path, glob or link
                first, by = seen[(st.st_dev, st.st_ino)]
                raise UserError(f"source file {f} (from {pattern!r}) is also {first} (from {by!r}): pass each "
                                "file once (its documents would be counted twice, some in val and in train)")
            seen[(st.st_dev, st.st_ino)] = (f, pattern)
            files.append(f)
    return [str(Path(f).resolve()) for f in files]


def format_of(files):
    """The kind of local files (json, parquet or text), from their extension."""
    builders = set()
    for f in files:
        stem = f[:-3] if f.endswith(".gz") else f
        builder = BUILDERS.get(os.path.splitext(stem)[1])
        if builder is None:
            raise UserError(f"cannot tell the format of {f} from its extension "
                            f"({', '.join(BUILDERS)}, optionally .gz): pass --dataset json, parquet or text")
        builders.add(builder)
    if len(builders) > 1:
        raise UserError(f"source files mix formats ({', '.join(sorted(builders))}): prepare one format at a time")
    return builders.pop()


def _open_bytes(path):
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


def _open_text(path):
    """A local file as text: .gz decompressed, UTF-8 (strict), a leading byte order mark dropped, line
    ends as "\\n"."""
    return io.TextIOWrapper(_open_bytes(path), encoding="utf-8-sig", newline=None)


def _not_utf8(path):
    """UserError naming the first line of a local file that is not UTF-8 (the file read again, in blocks)."""
    import codecs
    decoder = codecs.getincrementaldecoder("utf-8")()
    pos, line, line_start = 0, 1, 0  # the file offset of the block, its line, where that line starts
    with _open_bytes(path) as f:
        while True:
            block = f.read(1 << 20)
            held = decoder.getstate()[0]  # the start of a character cut by the previous block
            try:
                decoder.decode(block, final=not block)
            except UnicodeDecodeError as e:
                before = (held + block)[:e.start]
                line += before.count(b"\n")
                if b"\n" in before:
                    line_start = pos - len(held) + before.rfind(b"\n") + 1
                return UserError(f"{path} line {line} is not UTF-8 ({e.reason} at byte "
                                 f"{pos - len(held) + e.start - line_start} of the line): convert the file to UTF-8 "
                                 "(e.g. iconv -f latin1 -t utf-8)")
            if not block:
                return UserError(f"{path} is not UTF-8: convert the file to UTF-8")
            line += block.count(b"\n")
            if b"\n" in block:
                line_start = pos + block.rfind(b"\n") + 1
            pos += len(block)


@contextmanager
def _read_errors(path, where=lambda: ""):
    """Reading a local file: what it raises becomes one UserError naming the file."""
    try:
        yield
    except UnicodeDecodeError:
        raise _not_utf8(path) from None
    except (OSError, EOFError, zlib.error) as e:  # what a damaged file (a corrupt or cut .gz) raises
        reason = getattr(e, "strerror", None) or str(e)
        raise UserError(f"{path} could not be read{where()} ({type(e).__name__}: {reason}): it is damaged "
                        "or cut short; replace it") from None


def _text_blocks(path):
    """A .txt file, as blocks of its text."""
    with _read_errors(path), _open_text(path) as f:
        while block := f.read(READ_CHARS):
            yield block


SURROGATE = re.compile("[\ud800-\udfff]")


def _record_text(record, where, text_column, first):
    """The text of a JSON record; UserError if it is not one."""
    if not isinstance(record, dict):
        raise UserError(f"{where} is a JSON {type(record).__name__}, not an object: one JSON object per document")
    if text_column not in record and first:
        raise UserError(f"{where} has no field {text_column!r} (its fields: {', '.join(map(str, record))}): "
                        "pass --text_column naming the text field")
    text = record.get(text_column)
    if text is not None and not isinstance(text, str):
        raise UserError(f"{where}: {text_column!r} holds {text!r:.40} ({type(text).__name__}), not text: fix it, "
                        "or pass --text_column naming the text field")
    if text and (bad := SURROGATE.search(text)):  # a "\ud800" escape that pairs with nothing: not Unicode text
        raise UserError(f"{where}: {text_column!r} holds a lone surrogate ({bad.group()!r}) at character "
                        f"{bad.start()}: not Unicode text; fix or remove it")
    return text


def _json(text, path, line, where, fix):
    """`text`, from line `line` of `path` on, as JSON. What is not JSON is a UserError naming its line; what
    Python's reader cannot hold (nesting deeper than its recursion limit, an integer of more than 4,300 digits)
    one naming `where`, said briefly (the advice to raise the digit limit is dropped)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{path} line {line + e.lineno - 1} is not valid JSON ({e.msg}, column {e.colno}): "
                        f"{fix}") from None
    except (ValueError, RecursionError) as e:
        raise UserError(f"{where} is not valid JSON ({type(e).__name__}: {str(e).split(';')[0]}): {fix}") from None


def json_texts(path, text_column):
    """The texts of a JSON lines file (one object per line), or of a JSON array of objects."""
    n, first = 0, True
    with _read_errors(path, lambda: f" after line {n}" if n else ""), _open_text(path) as f:
        for line in f:
            n += 1
            stripped = line.strip()
            if not stripped:
                continue
            if first and stripped.startswith("["):  # one JSON array: read whole
                records = _json(line + f.read(), path, n, path, "fix it")
                for i, record in enumerate(records):
                    yield _record_text(record, f"{path} item {i}", text_column, i == 0)
                return
            record = _json(stripped, path, n, f"{path} line {n}", "fix or remove that line")
            yield _record_text(record, f"{path} line {n}", text_column, first)
            first = False


def parquet_texts(path, text_column):
    """The texts of a parquet file's column, a batch of rows at a time."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    try:
        f = pq.ParquetFile(path)
        schema = f.schema_arrow
        if text_column not in schema.names:
            raise UserError(f"{path} has no column {text_column!r} (its columns: {', '.join(schema.names)}): "
                            "pass --text_column")
        typ = schema.field(text_column).type
        if not (pa.types.is_string(typ) or pa.types.is_large_string(typ) or pa.types.is_null(typ)):
            raise UserError(f"{path}: column {text_column!r} has type {typ}, not text: pass --text_column")
        for batch in f.iter_batches(batch_size=256, columns=[text_column]):
            yield from batch.column(0).to_pylist()
    except (OSError, pa.ArrowException) as e:
        raise UserError(f"{path} could not be read ({type(e).__name__}: {e}): replace it") from None


def hub_texts(dataset, name, data_files, source_split, text_column, streaming):
    """The texts of a hub dataset's column, through `datasets`."""
    where = dataset + (f" ({name})" if name else "") + (f" {data_files}" if data_files else "")
    try:
        from datasets import load_dataset
        ds = load_dataset(dataset, name, data_files=data_files, split=source_split, streaming=streaming)
        try:
            ds = ds.select_columns([text_column])
        except ValueError as e:
            raise UserError(f"source {where} has no column {text_column!r} ({e}): pass --text_column") from None
        for index, row in enumerate(ds):
            yield _record_text(row, f"source {where} document {index}", text_column, False)
    except (UserError, GeneratorExit):
        raise
    except Exception as e:
        cause = e
        while cause.__cause__ is not None or cause.__context__ is not None:
            cause = cause.__cause__ or cause.__context__
        reason = (str(cause).strip().splitlines() or [""])[0]
        raise UserError(f"could not read source {where}: {type(cause).__name__}: {reason}: check the dataset's "
                        "name, --name and --source_split, and the network") from None


def documents(dataset, name, data_files, source_split, text_column, streaming):
    """The documents of a source, in order, each as an iterable of blocks of its text: a .txt file (one
    document) is read a block at a time as it is consumed; a record's text is one block ("" for none).
    dataset: json, parquet or text for local files (data_files: local_files'), else a hub dataset."""
    if dataset == "text":
        return (_text_blocks(path) for path in data_files)
    if dataset in ("json", "parquet"):
        read = json_texts if dataset == "json" else parquet_texts
        texts = (text for path in data_files for text in read(path, text_column))
    else:
        texts = hub_texts(dataset, name, data_files, source_split, text_column, streaming)
    return ([text or ""] for text in texts)
