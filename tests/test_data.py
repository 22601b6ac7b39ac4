"""Tests of prepare_data.py: shards, splits, tokenizers, loaders and bad input."""

import json
import os
import random
import subprocess
import sys
from functools import lru_cache
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import prepare_data
from common import UserError
from depthres import token_data
from depthres.token_data import (
    SPLITS,
    GPT2Tokenizer,
    TokenLoader,
    eval_batches,
    get_tokenizer,
    load_meta,
    open_shard,
    write_shard,
)
from prepare_data import main, split_of

ROOT = Path(__file__).resolve().parent.parent
_rng = random.Random(0)
# 60 documents of random numbered words (so windows differ), non-ASCII text, and one empty document
DOCS = [" ".join(_rng.choice(["to", "be", "or", "thee", "été", "naïve", "日本", "😀", "\n"]) + str(_rng.randrange(1000))
                 for _ in range(_rng.randint(5, 80))) for _ in range(60)]
DOCS[7] = ""


def write_jsonl(path, texts, key="text"):
    path.write_text("".join(json.dumps({key: t}) + "\n" for t in texts))
    return str(path)


def prep(src, out, *args):
    """Run the CLI in-process on local files with the byte tokenizer; returns the exit code."""
    return main(["--data_files", str(src), "--out_dir", str(out), "--tokenizer", "byte", *map(str, args)])


def split_stream(out, split):
    files = load_meta(out)["splits"][split]["files"]
    return np.concatenate([open_shard(out / f) for f in files]).tolist()


def expected_stream(tok, docs, split, val_fraction, test_fraction):
    ids = []
    for i, text in enumerate(docs):
        if text and split_of(i, val_fraction, test_fraction) == split:
            ids += [tok.eot] + tok.encode(text)
    return ids


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """A byte-level corpus in several shards per split."""
    tmp = tmp_path_factory.mktemp("data")
    assert prep(write_jsonl(tmp / "c.jsonl", DOCS), tmp / "out", "--shard_tokens", "1e3",
                "--val_fraction", 0.2, "--test_fraction", 0.1, "--streaming") == 0
    return tmp / "out"


def files_of(d):
    return {p.name: p.read_bytes() for p in sorted(Path(d).iterdir())}


# -----------------------------------------------------------------------------
# tokenizers

def test_gpt2_known_ids():
    tok = get_tokenizer("gpt2")
    assert tok.encode("Hello world, this is a test.") == [15496, 995, 11, 428, 318, 257, 1332, 13]
    assert (tok.eot, tok.vocab_size, tok.name) == (50256, 50257, "gpt2")
    text = "naïve 日本 <|endoftext|>  spaces\n"
    assert tok.decode(tok.encode(text)) == text
    assert tok.eot not in tok.encode(text)  # special tokens inside a document are plain text


def test_byte_tokenizer():
    tok = get_tokenizer("byte")
    assert (tok.eot, tok.vocab_size) == (256, 257)
    assert tok.encode("aé") == [97, 0xC3, 0xA9]
    assert tok.decode([97, 256, 98]) == "a<|endoftext|>b"


def test_gpt2_vocabulary_checksum(tmp_path):
    bad = tmp_path / "gpt2.tiktoken"
    bad.write_bytes(token_data.GPT2_RANKS.read_bytes()[:-10])
    with pytest.raises(UserError, match="sha256"):
        GPT2Tokenizer(bad)
    with pytest.raises(UserError, match="not found"):
        GPT2Tokenizer(tmp_path / "missing.tiktoken")


# -----------------------------------------------------------------------------
# preparing

def test_round_trip(data_dir):
    tok, meta = get_tokenizer("byte"), load_meta(data_dir)
    for split in SPLITS:
        expected = expected_stream(tok, DOCS, split, 0.2, 0.1)
        info = meta["splits"][split]
        assert split_stream(data_dir, split) == expected
        assert info["tokens"] == len(expected) > 0
        assert info["docs"] == sum(1 for i, t in enumerate(DOCS) if t and split_of(i, 0.2, 0.1) == split)
        assert info["shards"] == len(info["files"]) == -(-len(expected) // 1000)
    assert sum(meta["splits"][s]["docs"] for s in SPLITS) == len(DOCS) - 1
    assert (meta["tokenizer"], meta["vocab_size"], meta["eot"]) == ("byte", 257, 256)
    assert 0 < meta["unigram_baseline_nats"] < np.log(257)


def test_gpt2_through_shards(tmp_path):
    (tmp_path / "a.txt").write_text("Hello world, this is a test.")
    (tmp_path / "b.txt").write_text("Hello world")
    out = tmp_path / "out"
    assert main(["--data_files", str(tmp_path / "*.txt"), "--out_dir", str(out),
                 "--val_fraction", "0", "--test_fraction", "0"]) == 0
    # each .txt file is one document, EOT before each; files in sorted order
    assert split_stream(out, "train") == [50256, 15496, 995, 11, 428, 318, 257, 1332, 13, 50256, 15496, 995]


def test_split_independent_of_num_proc(tmp_path, monkeypatch):
    monkeypatch.setattr(prepare_data, "CHUNK_CHARS", 200)  # many tokenizer tasks
    src = write_jsonl(tmp_path / "c.jsonl", DOCS)
    for n in (1, 2):
        assert main(["--data_files", src, "--out_dir", str(tmp_path / f"out{n}"), "--num_proc", str(n),
                     "--shard_tokens", "300", "--val_fraction", "0.2"]) == 0
    assert files_of(tmp_path / "out1") == files_of(tmp_path / "out2")


def test_default_corpus_split():
    splits = [split_of(i, 0.05, 0.05) for i in range(42)]
    assert (splits.count("val"), splits.count("test")) == (2, 2)
    assert [split_of(i, 0.3, 0.2) for i in range(1000)].count("val") == 300


def test_parquet_source_streaming_or_not(tmp_path, data_dir):
    from datasets import Dataset
    parquet = tmp_path / "c.parquet"
    Dataset.from_dict({"id": list(range(len(DOCS))), "body": DOCS}).to_parquet(str(parquet))
    for streaming in ([], ["--streaming"]):
        out = tmp_path / f"out{len(streaming)}"
        assert main(["--dataset", "parquet", "--data_files", str(parquet), "--text_column", "body", *streaming,
                     "--tokenizer", "byte", "--out_dir", str(out), "--shard_tokens", "1e3",
                     "--val_fraction", "0.2", "--test_fraction", "0.1"]) == 0
        shards = {k: v for k, v in files_of(out).items() if k != "meta.json"}
        assert shards == {k: v for k, v in files_of(data_dir).items() if k != "meta.json"}


def test_rerun_is_up_to_date_or_refused(tmp_path, capsys):
    src = write_jsonl(tmp_path / "c.jsonl", DOCS)
    out = tmp_path / "out"
    assert prep(src, out, "--streaming") == 0
    before = files_of(out)
    assert prep(src, out) == 0
    assert "already prepared" in capsys.readouterr().out
    assert prep(src, out, "--val_fraction", 0.5) == 2
    assert "other settings (val_fraction)" in capsys.readouterr().err
    assert files_of(out) == before


def test_interrupted_run_leaves_no_valid_output(tmp_path, monkeypatch):
    src = write_jsonl(tmp_path / "c.jsonl", DOCS)
    out = tmp_path / "out"
    replace, calls = os.replace, []

    def interrupt_third(a, b):
        calls.append(b)
        if len(calls) % 3 == 0:
            raise KeyboardInterrupt
        replace(a, b)
    monkeypatch.setattr(os, "replace", interrupt_third)
    assert prep(src, out, "--shard_tokens", 500) == 130  # Ctrl-C: one line (test_ctrl_c_is_one_line_and_exit_130)
    assert not out.exists()  # the run removed its shards and the directory it created
    out.mkdir()
    with pytest.raises(KeyboardInterrupt):
        prepare_data.prepare(data_files=[src], tokenizer="byte", out_dir=out, shard_tokens=500)
    assert [p.name for p in out.iterdir()] == [".lock"]  # a directory it did not create stays, empty
    monkeypatch.setattr(os, "replace", replace)
    # a killed run (kill -9) cannot clean up: its shards without meta.json are no data, and are replaced
    assert prep(src, tmp_path / "clean", "--shard_tokens", 500) == 0
    for name in ("train_000000.bin", "train_000001.bin"):
        (out / name).write_bytes((tmp_path / "clean" / name).read_bytes())
    with pytest.raises(UserError, match="prepare_data.py"):
        load_meta(out)
    assert prep(src, out, "--shard_tokens", 500) == 0  # the leftovers are replaced without --overwrite
    assert files_of(out).keys() == files_of(tmp_path / "clean").keys()


# -----------------------------------------------------------------------------
# loaders

def windows_of(data_dir, split, T):
    shards = [open_shard(data_dir / f) for f in load_meta(data_dir)["splits"][split]["files"]]
    return sorted(tuple(s[j * T:j * T + T + 1]) for s in shards for j in range((len(s) - 1) // T))


def rows(x, y):
    return [tuple(r) for r in torch.cat([x, y[:, -1:]], 1).tolist()]


def test_loader_epoch_covers_every_window(data_dir):
    T = 16
    loader = TokenLoader(data_dir, "train", batch_size=1, seq_len=T, seed=1)
    seen = []
    for _ in range(loader.n_windows):
        x, y = loader.next_batch()
        assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (1, T)
        assert torch.equal(x[:, 1:], y[:, :-1])
        seen += rows(x, y)
    assert sorted(seen) == windows_of(data_dir, "train", T)
    assert (loader.epoch, loader.pos) == (1, 0)


def test_ranks_and_micro_steps_see_the_same_windows(data_dir):
    B, T, seed = 3, 16, 5
    single = TokenLoader(data_dir, "train", 2 * B, T, seed=seed)
    accum = TokenLoader(data_dir, "train", B, T, seed=seed)
    ranks = [TokenLoader(data_dir, "train", B, T, rank=r, world_size=2, seed=seed) for r in range(2)]
    first_epoch = single.n_windows // (2 * B)
    seen = set()
    for step in range(first_epoch * 2 + 3):  # past two epoch boundaries
        x, y = single.next_batch()
        micro = [accum.next_batch() for _ in range(2)]
        per_rank = [loader.next_batch() for loader in ranks]
        for batches in (micro, per_rank):
            assert torch.equal(x, torch.cat([b[0] for b in batches]))
            assert torch.equal(y, torch.cat([b[1] for b in batches]))
        if step < first_epoch:  # ranks read disjoint windows, and nothing repeats within an epoch
            rank_rows = [set(rows(*b)) for b in per_rank]
            assert not rank_rows[0] & rank_rows[1] and not seen & (rank_rows[0] | rank_rows[1])
            seen |= rank_rows[0] | rank_rows[1]
    first = [TokenLoader(data_dir, "train", 2 * B, T, seed=s).next_batch()[0] for s in (seed, seed + 1)]
    assert not torch.equal(*first)


def test_loader_resumes_exactly(data_dir):
    kwargs = dict(batch_size=4, seq_len=16, rank=1, world_size=2, seed=7)
    loader = TokenLoader(data_dir, "train", **kwargs)
    for _ in range(loader.n_windows // 8 - 2):
        loader.next_batch()
    state = json.loads(json.dumps(loader.state_dict()))
    expected = [loader.next_batch() for _ in range(6)]  # crosses into the next epoch
    resumed = TokenLoader(data_dir, "train", **kwargs)
    resumed.load_state_dict(state)
    for (x, y), (rx, ry) in zip(expected, (resumed.next_batch() for _ in range(6))):
        assert torch.equal(x, rx) and torch.equal(y, ry)
    for key, value in (("seed", 8), ("seq_len", 32)):
        other = TokenLoader(data_dir, "train", **{**kwargs, key: value})
        with pytest.raises(UserError, match=key):
            other.load_state_dict(state)


def test_eval_batches(data_dir):
    T, stream = 8, split_stream(data_dir, "val")
    full = list(eval_batches(data_dir, "val", 4, T, max_tokens=100))
    x, y = torch.cat([b[0] for b in full]), torch.cat([b[1] for b in full])
    assert x.shape == (100 // T, T) and [len(b[0]) for b in full] == [4, 4, 4]
    assert x.flatten().tolist() == stream[:len(x) * T] and y.flatten().tolist() == stream[1:len(x) * T + 1]
    per_rank = [torch.cat([b[0] for b in eval_batches(data_dir, "val", 4, T, 100, rank=r, world_size=2)])
                for r in range(2)]
    assert torch.equal(per_rank[0], x[0::2]) and torch.equal(per_rank[1], x[1::2])
    everything = torch.cat([b[1] for b in eval_batches(data_dir, "val", 64, T, max_tokens=None)])
    assert everything.numel() == (len(stream) - 1) // T * T
    with pytest.raises(UserError, match="too few"):
        eval_batches(data_dir, "val", 4, len(stream), max_tokens=None)


# -----------------------------------------------------------------------------
# bad input: one clear message, nothing lost

def test_missing_or_empty_source(tmp_path, capsys):
    assert prep(tmp_path / "missing.jsonl", tmp_path / "out") == 2
    assert "missing.jsonl not found" in capsys.readouterr().err
    (tmp_path / "empty.jsonl").write_text("")
    assert prep(tmp_path / "empty.jsonl", tmp_path / "out") == 2
    assert "is empty" in capsys.readouterr().err
    assert prep(write_jsonl(tmp_path / "blank.jsonl", ["", ""]), tmp_path / "out", "--streaming") == 2
    assert "no documents" in capsys.readouterr().err
    assert prep(write_jsonl(tmp_path / "body.jsonl", ["x"], key="body"), tmp_path / "out") == 2
    assert "--text_column" in capsys.readouterr().err
    (tmp_path / "c.csv").write_text("text\nx\n")
    assert prep(tmp_path / "c.csv", tmp_path / "out") == 2
    assert "--dataset json, parquet or text" in capsys.readouterr().err
    assert not (tmp_path / "out" / "meta.json").exists()


def test_out_dir_of_another_tokenizer(tmp_path, capsys):
    src = write_jsonl(tmp_path / "c.jsonl", ["Hello world"])
    out = tmp_path / "out"
    assert prep(src, out, "--streaming") == 0
    before = files_of(out)
    gpt2 = ["--data_files", src, "--out_dir", str(out), "--streaming"]
    assert main(gpt2) == 2
    assert "holds shards from tokenizer 'byte', not 'gpt2'" in capsys.readouterr().err
    assert files_of(out) == before
    assert main(gpt2 + ["--overwrite"]) == 0
    assert load_meta(out)["tokenizer"] == "gpt2"


def test_bad_shards(data_dir, tmp_path):
    shard = tmp_path / "train_000000.bin"
    good = (data_dir / "train_000000.bin").read_bytes()
    for content, message in ((good[:-1], "truncated"), (good[:20], "truncated"),
                             (b"NOTASHRD" + good[8:], "wrong magic"), (good[:8] + b"\x09" + good[9:], "version")):
        shard.write_bytes(content)
        with pytest.raises(UserError, match=message) as e:
            open_shard(shard)
        assert str(shard) in str(e.value) and "--overwrite" in str(e.value)
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in data_dir.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    (broken / "train_000001.bin").write_bytes(good[:-2])
    with pytest.raises(UserError, match="train_000001.bin is truncated"):
        TokenLoader(broken, "train", 2, 8)


def test_vocabulary_too_large_for_uint16(tmp_path, monkeypatch, capsys):
    big = SimpleNamespace(name="big", vocab_size=100277, eot=100276, fingerprint="00" * 8)
    with pytest.raises(UserError, match="uint16"):
        write_shard(tmp_path / "x.bin", [1, 2, 3], big)
    assert not (tmp_path / "x.bin").exists()
    monkeypatch.setitem(prepare_data.TOKENIZERS, "big", lambda: big)
    monkeypatch.setattr(prepare_data, "get_tokenizer", lru_cache(prepare_data.get_tokenizer.__wrapped__))
    src = write_jsonl(tmp_path / "c.jsonl", ["Hello"])
    assert main(["--data_files", src, "--out_dir", str(tmp_path / "out"), "--tokenizer", "big"]) == 2
    assert "uint16" in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_missing_data_or_split(data_dir, tmp_path):
    with pytest.raises(UserError, match="python prepare_data.py"):
        TokenLoader(tmp_path / "nothing", "train", 2, 8)
    with pytest.raises(UserError, match="no split 'validation'"):
        TokenLoader(data_dir, "validation", 2, 8)
    with pytest.raises(UserError, match="no split 'validation'"):
        eval_batches(data_dir, "validation", 2, 8, 100)
    out = tmp_path / "no_test"
    assert prep(write_jsonl(tmp_path / "c.jsonl", DOCS), out, "--test_fraction", 0, "--streaming") == 0
    with pytest.raises(UserError, match="'test' .* is empty"):
        TokenLoader(out, "test", 2, 8)


# -----------------------------------------------------------------------------
# the command line

def test_cli_default_corpus(tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, str(ROOT / "prepare_data.py"), "--tokenizer", "byte", "--out_dir", str(out),
           "--num_proc", "2"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    splits = load_meta(out)["splits"]
    assert [splits[s]["docs"] for s in SPLITS] == [38, 2, 2]
    assert sum(splits[s]["tokens"] for s in SPLITS) > 5_000_000


def test_cli_error_is_one_line(tmp_path):
    cmd = [sys.executable, str(ROOT / "prepare_data.py"), "--data_files", str(tmp_path / "nope.jsonl")]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert run.stderr.startswith("error: source file") and "Traceback" not in run.stderr


# -----------------------------------------------------------------------------
# reliability: what a loader would trip on is found when a split is checked, named, with the fix

def copy_dir(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_token_ids_outside_the_vocabulary_name_their_shard(data_dir, tmp_path):
    assert token_data.check_split(data_dir, "train") == load_meta(data_dir)["splits"]["train"]["tokens"]
    tok = get_tokenizer("byte")
    for bad_id in (300, 256 + 64):  # inside the padded vocabulary (trains silently), and past it (IndexError)
        broken = copy_dir(data_dir, tmp_path / f"ids{bad_id}")
        tokens = open_shard(broken / "train_000001.bin").copy()
        tokens[17] = bad_id
        write_shard(broken / "train_000001.bin", tokens, tok)  # a valid header: only the ids are wrong
        with pytest.raises(UserError, match=f"train_000001.bin holds token id {bad_id}, outside the byte "
                                            "tokenizer's ids 0..256"):
            token_data.check_split(broken, "train")


def test_meta_without_a_key_and_empty_shards_say_what_is_wrong(data_dir, tmp_path):
    broken = copy_dir(data_dir, tmp_path / "broken")
    meta = load_meta(data_dir)
    for drop, message in (("vocab_size", "lacks vocab_size: it is incomplete"), ("splits", "lacks splits")):
        (broken / "meta.json").write_text(json.dumps({k: v for k, v in meta.items() if k != drop}))
        with pytest.raises(UserError, match=message) as e:
            TokenLoader(broken, "train", 2, 8)
        assert "--overwrite" in str(e.value)
    (broken / "meta.json").write_text("[1, 2]")
    with pytest.raises(UserError, match="holds a JSON list, not an object"):
        load_meta(broken)
    (broken / "meta.json").write_text(json.dumps(meta))
    (broken / "val_000000.bin").write_bytes(b"")
    with pytest.raises(UserError, match=r"val_000000.bin is empty \(0 bytes"):
        token_data.check_split(broken, "val")
    (broken / "val_000000.bin").write_bytes(token_data.SHARD_MAGIC[:5])
    with pytest.raises(UserError, match="val_000000.bin is truncated"):
        token_data.check_split(broken, "val")


def test_eval_advice_names_the_key_to_change(data_dir):
    with pytest.raises(UserError, match="max_tokens=7 is less than one window of seq_len=8 targets"):
        eval_batches(data_dir, "val", 4, 8, max_tokens=7)
    tokens = load_meta(data_dir)["splits"]["val"]["tokens"]
    with pytest.raises(UserError, match=f"use seq_len <= {tokens - 1}, or prepare a larger val split"):
        eval_batches(data_dir, "val", 4, tokens, max_tokens=None)


@pytest.mark.parametrize("name, content, message", [
    ("latin1.txt", "café au lait\nun thé\n".encode("latin-1"), "latin1.txt line 1 is not UTF-8"),
    ("latin1.jsonl", b'{"text": "a"}\n' + '{"text": "café"}\n'.encode("latin-1"), "latin1.jsonl line 2 is not UTF-8"),
    ("broken.jsonl", b'{"text": "a"}\n{"text": "b"\n{"text": "c"}\n', "broken.jsonl line 2 is not valid JSON"),
    ("numbers.jsonl", b'{"text": 5}\n{"text": 7}\n', "numbers.jsonl line 1: 'text' holds 5 (int), not text"),
    ("mixed.jsonl", b'{"text": "a"}\n{"text": null}\n{"text": 3}\n', "mixed.jsonl line 3: 'text' holds 3 (int)"),
    # round five: each was a traceback
    ("deep.jsonl", b'{"text": "a"}\n{"text": "b", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n",
     "deep.jsonl line 2 is not valid JSON (RecursionError: maximum recursion depth exceeded"),
    ("deep_array.jsonl", b"[" * 100_000 + b"]" * 100_000 + b"\n",
     "deep_array.jsonl is not valid JSON (RecursionError: maximum recursion depth exceeded"),
    ("huge_int.jsonl", b'{"text": "a", "n": 1' + b"0" * 5000 + b"}\n",
     "huge_int.jsonl line 1 is not valid JSON (ValueError: Exceeds the limit (4300 digits) for integer string "
     "conversion"),
])
@pytest.mark.parametrize("streaming", [False, True])
def test_unreadable_sources_name_the_file_and_line(tmp_path, capsys, name, content, message, streaming):
    (tmp_path / name).write_bytes(content)
    out = tmp_path / "out"
    assert prep(tmp_path / name, out, *(["--streaming"] if streaming else [])) == 2
    err = capsys.readouterr().err  # the progress bar, then one line
    assert err.split("\n")[-2].startswith("error: ") and message in err.split("\n")[-2] and "Traceback" not in err
    assert not out.exists()  # nothing left behind


def test_a_file_given_twice_is_refused(tmp_path, capsys):
    src = write_jsonl(tmp_path / "c.jsonl", DOCS)
    (tmp_path / "link.jsonl").symlink_to(src)
    for files in ([src, src], [str(tmp_path / "*.jsonl")], [src, str(tmp_path / "c*.jsonl")]):
        assert main(["--data_files", *files, "--out_dir", str(tmp_path / "out"), "--tokenizer", "byte"]) == 2
        assert "pass each file once" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


# -----------------------------------------------------------------------------
# reliability, round two: no source destroyed, no useless preparation, the old one kept until the new fits

def test_a_source_inside_out_dir_is_refused_before_anything_is_written(tmp_path, capsys):
    d = tmp_path / "D"
    d.mkdir()
    source = d / "meta.json"  # the case: a source named like a file prepare_data.py owns
    source.write_text('{"text":"a"}\n{"text":"b"}\n')
    nested = d / "corpus" / "c.jsonl"
    nested.parent.mkdir()
    write_jsonl(nested, DOCS)
    for src in (source, nested):
        for extra in ([], ["--overwrite"]):
            assert prep(src, d, *extra) == 2
            err = capsys.readouterr().err
            assert err == (f"error: source file {src} lies inside --out_dir {d}, whose files prepare_data.py writes "
                           "and replaces: move the source out of it, or choose another --out_dir\n")
    assert source.read_text() == '{"text":"a"}\n{"text":"b"}\n'
    assert sorted(p.name for p in d.iterdir()) == ["corpus", "meta.json"]  # no lock, no shard


@pytest.mark.parametrize("args, message", [
    (["--val_fraction", 1, "--test_fraction", 0], "--val_fraction 1.0 + --test_fraction 0.0 leaves no documents for "
                                                  "the train split: keep their sum below 1"),
    (["--val_fraction", 0.6, "--test_fraction", 0.6], "leaves no documents for the train split"),
    (["--shard_tokens", "1e12"], "--shard_tokens 1e+12 is out of range: a shard is assembled in memory"),
], ids=["val_is_everything", "over_one", "huge_shards"])
def test_settings_that_cannot_give_a_training_set_are_refused_up_front(tmp_path, capsys, args, message):
    assert prep(write_jsonl(tmp_path / "c.jsonl", DOCS), tmp_path / "out", *args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_an_empty_train_split_is_refused(tmp_path, capsys):
    # one document, whose hash sends it to val at 70% (frac(1 / golden ratio) = 0.618)
    assert prep(write_jsonl(tmp_path / "c.jsonl", ["one document"]), tmp_path / "out", "--val_fraction", 0.7,
                "--test_fraction", 0) == 2
    assert "the train split is empty: all 1 documents went to val or test" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_directory_of_the_users_in_out_dir_is_left_alone(tmp_path):
    out = tmp_path / "out"
    (out / ".staging").mkdir(parents=True)  # the user's, with a name a tool might use for its own
    (out / ".staging" / "notes.txt").write_text("mine")
    (out / "README").write_text("also mine")
    src = write_jsonl(tmp_path / "c.jsonl", DOCS)
    assert prep(src, out) == 0 and prep(src, out, "--overwrite") == 0
    assert (out / ".staging" / "notes.txt").read_text() == "mine" and (out / "README").read_text() == "also mine"


# -----------------------------------------------------------------------------
# reliability, round three: a lone text splits, memory stays bounded, every failure is one line

def lines_of_text(n_chars, seed=0):
    """Lines of random words, about n_chars characters of text ending with a line end."""
    rng, lines, size = random.Random(seed), [], 0
    while size < n_chars:
        line = " ".join(rng.choice(["to", "be", "or", "not", "thee", "été", "日本"]) + str(rng.randrange(100))
                        for _ in range(rng.randint(1, 14))) + "\n"
        lines.append(line)
        size += len(line)
    return "".join(lines)


def reference_pieces(text, piece, long_line):
    """The cutting rule of prepare_data.py's docstring, written out plainly."""
    out = []
    while text:
        end = text.find("\n", piece - 1, long_line)
        if end < 0 and len(text) < long_line:
            end = len(text) - 1
        elif end < 0:
            end = max(text.rfind(" ", piece - 1, long_line), text.rfind("\t", piece - 1, long_line))
            end = long_line - 1 if end < 0 else end
        out.append(text[:end + 1])
        text = text[end + 1:]
    return out


def test_a_lone_text_file_is_cut_at_line_ends_into_every_split(tmp_path, capsys):
    text = lines_of_text(250_000)
    (tmp_path / "input.txt").write_text(text)
    out = tmp_path / "out"
    assert prep(tmp_path / "input.txt", out, "--val_fraction", 0.1, "--test_fraction", 0.1) == 0
    meta = load_meta(out)
    assert all(meta["splits"][s]["tokens"] > 0 for s in SPLITS), meta["splits"]
    assert "warning" not in capsys.readouterr().err
    pieces = reference_pieces(text, prepare_data.PIECE_CHARS, prepare_data.LONG_LINE_CHARS)
    assert "".join(pieces) == text and len(pieces) >= 10
    assert all(p.endswith("\n") and len(p) >= prepare_data.PIECE_CHARS for p in pieces[:-1])
    tok = get_tokenizer("byte")
    for split in SPLITS:  # piece j of the lone document goes where document j would go
        assert split_stream(out, split) == cut_stream(tok, pieces, 0, split, 0.1, 0.1)
        runs = "".join(p if split_of(j, 0.1, 0.1) == split else "\0" for j, p in enumerate(pieces)).split("\0")
        assert tok.decode(split_stream(out, split)) == "<|endoftext|>".join([""] + [r for r in runs if r])
    assert sum(meta["splits"][s]["docs"] for s in SPLITS) == len(pieces)


def cut_stream(tok, pieces, i, split, val_fraction, test_fraction):
    """The tokens that the pieces of document i give `split`: EOT where the split's text jumps."""
    ids, before = [], None
    for j, piece in enumerate(pieces):
        s = split_of(i + j, val_fraction, test_fraction)
        if s == split:
            ids += [tok.eot] * (s != before) + tok.encode(piece)
        before = s
    return ids


def test_a_long_document_among_others_is_cut_and_the_others_keep_their_splits(tmp_path, monkeypatch):
    monkeypatch.setattr(prepare_data, "CUT_CHARS", 3000)  # what a 1 MiB document does, at a small size
    monkeypatch.setattr(prepare_data, "PIECE_CHARS", 200)
    monkeypatch.setattr(prepare_data, "LONG_LINE_CHARS", 800)
    long = lines_of_text(5000, seed=1)[:4000] + "x" * 1700 + " tail"  # ends in a line longer than 800
    docs = DOCS[:10] + [long] + DOCS[10:]
    src = write_jsonl(tmp_path / "c.jsonl", docs)
    assert prep(src, tmp_path / "out", "--val_fraction", 0.2, "--test_fraction", 0.1) == 0
    pieces = reference_pieces(long, 200, 800)
    assert len(pieces) > 10 and pieces[-2] == "x" * 800 and pieces[-1].endswith(" tail")
    tok = get_tokenizer("byte")
    for split in SPLITS:  # document i as before; piece j of the long document 10 as document 10 + j
        expected = expected_stream(tok, docs[:10], split, 0.2, 0.1) + cut_stream(tok, pieces, 10, split, 0.2, 0.1)
        expected += [i for j, t in enumerate(docs[11:], 11) if t and split_of(j, 0.2, 0.1) == split
                     for i in [tok.eot] + tok.encode(t)]
        assert split_stream(tmp_path / "out", split) == expected


def test_a_byte_order_mark_is_stripped_from_text_and_json(tmp_path):
    bom = "\ufeff"
    for name, content in (("a.txt", bom + "Hello\nworld\n"), ("a.jsonl", bom + '{"text": "Hello"}\n')):
        (tmp_path / name).write_text(content, encoding="utf-8")
        out = tmp_path / f"out_{name}"
        assert prep(tmp_path / name, out, "--val_fraction", 0, "--test_fraction", 0) == 0
        assert split_stream(out, "train")[:6] == [256, *b"Hello"]


# prepare_data.main in a fresh process; printed last: the peak of what it allocated, every Python object and
# numpy array, as tracemalloc counts them from after the imports (the allocator, the build and the machine do
# not enter it: their figure, the peak resident set, is python -m tools.bench --memory's)
TRACED_PEAK = """
import sys, tracemalloc
import prepare_data
tracemalloc.start()
assert prepare_data.main(sys.argv[1:]) == 0
print(tracemalloc.get_traced_memory()[1])
"""


def traced_peak_mib(*args):
    """The peak memory (MiB) a prepare_data.py process with these arguments allocates, tracemalloc's count."""
    run = subprocess.run([sys.executable, "-c", TRACED_PEAK, *map(str, args)], cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    return int(run.stdout.splitlines()[-1]) / 2**20


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["txt", "jsonl"])
def test_memory_does_not_grow_with_the_corpus(tmp_path, kind):
    """A lone text (the input.txt case) and many JSON documents, 4 MB and 16 MB: the default
    preparation reads the source as a stream, so the memory it allocates stays where it was (the issue:
    4.58 GB for a 200 MB .txt, 1.55 GB for a 200 MB jsonl, held whole)."""
    peaks = []
    for mb in (4, 16):
        src = tmp_path / f"c{mb}.{kind}"
        text = lines_of_text(1 << 20, seed=mb) * mb  # 1 MiB of lines, repeated: the size is what matters here
        if kind == "txt":
            src.write_text(text)
        else:
            lines = text.splitlines(keepends=True)
            write_jsonl(src, ["".join(lines[i:i + 40]) for i in range(0, len(lines), 40)])
        peaks.append(traced_peak_mib("--data_files", src, "--out_dir", tmp_path / f"out{mb}", "--tokenizer", "byte",
                                     "--shard_tokens", "1e5"))
        src.unlink()
    # the corpus grows by 12 Mi characters, which take 12 MiB at least held whole (a byte a character): memory that
    # grows by a quarter of that grows with the corpus; a stream's window stays as it was (7-8 MiB here)
    assert peaks[1] - peaks[0] < 12 / 4, f"peak {peaks[0]:.1f} MiB allocated for 4 MB, {peaks[1]:.1f} MiB for 16 MB"
    assert all(load_meta(tmp_path / f"out{mb}")["splits"]["val"]["tokens"] > 0 for mb in (4, 16))


def test_ctrl_c_is_one_line_and_exit_130(tmp_path, monkeypatch, capsys):
    src = write_jsonl(tmp_path / "c.jsonl", DOCS)
    out = tmp_path / "out"
    assert prep(src, out, "--shard_tokens", 500) == 0
    before = files_of(out)
    real, calls = prepare_data.write_shard, []

    def interrupt_the_second(*args):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args)
    monkeypatch.setattr(prepare_data, "write_shard", interrupt_the_second)
    assert prep(src, out, "--shard_tokens", 400, "--overwrite") == 130
    assert capsys.readouterr().err == f"stopped by Ctrl-C; {out}'s previous preparation is unchanged\n"
    assert files_of(out) == before
    calls.clear()
    assert prep(src, tmp_path / "new", "--shard_tokens", 400) == 130
    assert capsys.readouterr().err == f"stopped by Ctrl-C; nothing was left in {tmp_path / 'new'}\n"
    assert not (tmp_path / "new").exists()


CTRL_C_IN_A_SHARD_WRITE = """
import sys, time
import prepare_data
real = prepare_data.write_shard
def slow(*args):
    print("writing", flush=True)
    time.sleep(60)
prepare_data.write_shard = slow
sys.exit(prepare_data.main(sys.argv[1:]))
"""


def test_ctrl_c_at_a_terminal_stops_every_process_in_one_line(tmp_path):
    """Ctrl-C at a terminal signals the whole process group, the tokenizer processes too."""
    import signal
    src = write_jsonl(tmp_path / "c.jsonl", DOCS)
    out = tmp_path / "out"
    p = subprocess.Popen([sys.executable, "-c", CTRL_C_IN_A_SHARD_WRITE, "--data_files", src, "--out_dir", str(out),
                          "--tokenizer", "byte", "--num_proc", "2"], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert p.stdout.readline() == "writing\n"
        os.killpg(p.pid, signal.SIGINT)
        assert p.wait(timeout=60) == 130
        err = p.stderr.read()
        assert err == f"stopped by Ctrl-C; nothing was left in {out}\n", err
        assert not out.exists()
    finally:
        p.kill()


def test_a_corrupt_gzip_is_a_read_error_naming_the_file(tmp_path, capsys):
    import gzip
    good = gzip.compress("".join(json.dumps({"text": t}) + "\n" for t in DOCS * 20).encode())
    for name, content in (("garbage.jsonl.gz", b"this is not gzip data" * 10), ("cut.jsonl.gz", good[:len(good) // 2]),
                          ("cut.txt.gz", gzip.compress(lines_of_text(50_000).encode())[:3000])):
        (tmp_path / name).write_bytes(content)
        for streaming in ([], ["--streaming"]):
            assert prep(tmp_path / name, tmp_path / "out", *streaming) == 2
            err = capsys.readouterr().err.splitlines()[-1]
            assert err.startswith(f"error: {tmp_path / name} could not be read") and "replace it" in err, err
            assert "cannot write" not in err
    assert not (tmp_path / "out").exists()


def test_an_unreachable_hub_dataset_is_a_read_error_naming_it(tmp_path, monkeypatch, capsys):
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'someone/corpus' on the Hub (LocalEntryNotFoundError)")
    monkeypatch.setattr(datasets, "load_dataset", offline)
    assert main(["--dataset", "someone/corpus", "--out_dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot write" not in err
    assert err.startswith("error: could not read source someone/corpus: ConnectionError: Couldn't reach"), err
    assert not (tmp_path / "out").exists()

    def fails_midway(*args, **kwargs):
        def rows():
            yield {"text": "a document"}
            raise OSError("Read timed out")
        return SimpleNamespace(select_columns=lambda columns: rows())
    monkeypatch.setattr(datasets, "load_dataset", fails_midway)
    assert main(["--dataset", "someone/corpus", "--out_dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: could not read source someone/corpus: OSError: Read timed out"), err


@pytest.mark.parametrize("streaming", [False, True])
def test_a_lone_surrogate_names_the_file_and_line(tmp_path, capsys, streaming):
    src = tmp_path / "s.jsonl"
    src.write_text('{"text": "fine"}\n{"text": "x \\ud800 y"}\n')
    assert prep(src, tmp_path / "out", *(["--streaming"] if streaming else [])) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {src} line 2: 'text' holds a lone surrogate"), err
    assert not (tmp_path / "out").exists()


def test_an_out_dir_that_is_a_dangling_link_or_a_file_is_one_clear_line(tmp_path, capsys):
    src = write_jsonl(tmp_path / "c.jsonl", DOCS)
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "gone")
    assert prep(src, link) == 2
    assert capsys.readouterr().err == (f"error: --out_dir {link} is a symbolic link to {tmp_path / 'gone'}, which does "
                                       "not exist: create that directory, or pass another --out_dir\n")
    (tmp_path / "file").write_text("x")
    assert prep(src, tmp_path / "file") == 2
    assert capsys.readouterr().err == f"error: --out_dir {tmp_path / 'file'} is a file, not a directory\n"
    assert link.is_symlink() and not (tmp_path / "gone").exists()


# -----------------------------------------------------------------------------
# round four: settings that leave a split empty, absurd shard counts, a small lone text


def test_a_small_lone_text_fills_every_split(tmp_path, capsys):
    """A lone 24 kB .txt cut into 6 pieces gave an empty val split (the pieces' hashes: 5 train, 1 test)."""
    text = lines_of_text(21_000)
    (tmp_path / "input.txt").write_text(text)
    out = tmp_path / "out"
    assert prep(tmp_path / "input.txt", out) == 0
    meta = load_meta(out)
    docs = {s: meta["splits"][s]["docs"] for s in SPLITS}
    assert docs == {"train": 4, "val": 1, "test": 1}, docs
    assert "warning" not in capsys.readouterr().err
    pieces = reference_pieces(text, prepare_data.PIECE_CHARS, prepare_data.LONG_LINE_CHARS)
    assert len(pieces) == 6 and [split_of(j, 0.05, 0.05) for j in range(6)].count("val") == 0
    tok = get_tokenizer("byte")  # the last piece is val's (it was train's), the one before test's
    assert split_stream(out, "val") == [tok.eot] + tok.encode(pieces[-1])
    assert split_stream(out, "test") == [tok.eot] + tok.encode(pieces[-2])
    assert tok.decode(split_stream(out, "train")) == "<|endoftext|>" + "".join(pieces[:-2])


@pytest.mark.parametrize("n_pieces, val, test", [(1, 0, 0), (2, 1, 0), (3, 1, 1)])
def test_a_lone_text_fills_what_its_pieces_can_and_train_keeps_one(n_pieces, val, test):
    with pytest.MonkeyPatch.context() as m:
        m.setattr(prepare_data, "PIECE_CHARS", 8)
        units = list(prepare_data._units([["".join(f"piece {j}\n" for j in range(n_pieces))]],
                                         lambda i: "train", {"documents": 0, "pieces": 0, "lone": False}, ["val", "test"]))
    splits = [s for s, _, _ in units]
    assert len(splits) == n_pieces and splits.count("val") == val and splits.count("test") == test
    assert splits.count("train") == n_pieces - val - test >= 1


def test_a_lone_text_too_short_to_fill_every_split_says_so(tmp_path, capsys):
    (tmp_path / "input.txt").write_text(lines_of_text(5_000))  # 2 pieces: train and val
    assert prep(tmp_path / "input.txt", tmp_path / "out") == 0
    assert capsys.readouterr().err == ("warning: split test is empty: the lone text gave only 2 pieces of about 4,096 "
                                       "characters (3 fill every split): pass more text\n")


def test_val_fraction_0_is_a_warning_before_any_work(tmp_path, capsys):
    """--val_fraction 0 was accepted silently; train.py then refused the data."""
    assert prep(write_jsonl(tmp_path / "c.jsonl", DOCS), tmp_path / "out", "--val_fraction", 0) == 0
    err = capsys.readouterr().err
    assert err.startswith("warning: --val_fraction 0 leaves the val split empty: train.py evaluates on it and refuses "
                          "such data; pass --val_fraction > 0 (default 0.05) to train on it\n")
    assert load_meta(tmp_path / "out")["splits"]["val"]["tokens"] == 0


def test_absurd_numbers_of_shards_are_refused(tmp_path, monkeypatch, capsys):
    """--shard_tokens 10 wrote 18,912 files of the embedded corpus, and train.py then blamed seq_len."""
    monkeypatch.setattr(prepare_data, "MAX_SHARDS", 5)  # the same rule at 10,000, without writing them
    out = tmp_path / "out"
    assert prep(write_jsonl(tmp_path / "c.jsonl", DOCS), out, "--shard_tokens", 10) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == ("warning: --shard_tokens 10 holds less than one training window (train.py's default seq_len + 1 "
                      "= 257 tokens), and a window never crosses a shard: train.py would read nothing of such shards; "
                      "pass --shard_tokens 1e6 or more")
    assert err[-1] == ("error: --shard_tokens 10 cuts the train split into more than 5 shards (a file each): raise "
                       "--shard_tokens (default 1e8)")
    assert not out.exists()
    assert prepare_data.MAX_SHARDS * 10 < 18_912 and monkeypatch.undo() is None and prepare_data.MAX_SHARDS == 10_000


def test_a_shard_replaced_by_a_directory_is_one_line_and_overwrite_deletes_nothing(data_dir, tmp_path, capsys):
    """A shard's path holding a directory read as 'missing'; --overwrite then deleted the other shards and crashed
    on it (IsADirectoryError), every time. Both now say what it is, before anything is read or removed."""
    import shutil
    out = tmp_path / "d"
    shutil.copytree(data_dir, out)
    shard = out / "val_000000.bin"
    shard.unlink()
    shard.mkdir()
    with pytest.raises(UserError, match=f"shard {shard} is a directory, not a shard: move or remove it, then re-create"):
        token_data.read_header(shard)
    before = sorted(p.name for p in out.iterdir())
    source = next(data_dir.parent.glob("*.jsonl"))
    assert main(["--data_files", str(source), "--tokenizer", "byte", "--out_dir", str(out), "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert err == (f"error: {shard} is a directory, where prepare_data.py keeps a file of its own: move or remove it, "
                   "then run again\n")
    assert sorted(p.name for p in out.iterdir()) == before and (out / "train_000000.bin").is_file()
