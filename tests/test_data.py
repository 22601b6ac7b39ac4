"""Tests of data.py and prepare_data.py: tokenizers, shards, splits, loaders, the opened data, bad input."""

import errno
import gzip
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path
from shutil import copytree

import numpy as np
import pytest
import torch

import data
import prepare_data
import train
from common import UserError, log_records
from data import SPLITS, TokenData, TokenLoader, eval_batches, get_tokenizer, load_meta, open_shard
from prepare_data import main, split_of

from runs import ROOT, run

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
    return np.concatenate([open_shard(out / f) for f in files]).tolist() if files else []


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """A byte-level corpus in several shards per split."""
    tmp = tmp_path_factory.mktemp("data")
    assert prep(write_jsonl(tmp / "c.jsonl", DOCS), tmp / "out", "--shard_tokens", "1e3",
                "--val_fraction", 0.2, "--test_fraction", 0.1) == 0
    return tmp / "out"


def files_of(d, but=None):
    return {p.name: p.read_bytes() for p in sorted(Path(d).iterdir()) if p.name != but}


# --- tokenizers ---------------------------------------------------------------------------------------------

def test_tokenizers_known_ids_and_the_gpt2_vocabulary_checksum(tmp_path):
    tok, byte = get_tokenizer("gpt2"), get_tokenizer("byte")
    assert tok.encode("Hello world, this is a test.") == [15496, 995, 11, 428, 318, 257, 1332, 13]
    assert (tok.eot, tok.vocab_size, tok.name, byte.eot, byte.vocab_size) == (50256, 50257, "gpt2", 256, 257)
    text = "naïve 日本 <|endoftext|>  spaces\n"
    assert tok.decode(tok.encode(text)) == text and tok.eot not in tok.encode(text)  # "<|endoftext|>" in a text: text
    assert byte.encode("aé") == [97, 0xC3, 0xA9] and byte.decode([97, 256, 98]) == "a<|endoftext|>b"
    (tmp_path / "gpt2.tiktoken").write_bytes(data.GPT2_RANKS.read_bytes()[:-10])
    with pytest.raises(UserError, match="sha256"):
        data.GPT2Tokenizer(tmp_path / "gpt2.tiktoken")


# --- preparing ----------------------------------------------------------------------------------------------

def test_round_trip(data_dir):
    tok, meta = get_tokenizer("byte"), load_meta(data_dir)
    for split in SPLITS:
        docs = [t for i, t in enumerate(DOCS) if t and split_of(i, 0.2, 0.1) == split]
        expected = [i for t in docs for i in [tok.eot] + tok.encode(t)]
        info = meta["splits"][split]
        assert split_stream(data_dir, split) == expected
        assert info["tokens"] == len(expected) > 0 and info["docs"] == len(docs)
        assert info["shards"] == len(info["files"]) == -(-len(expected) // 1000)
    assert (meta["tokenizer"], meta["vocab_size"], meta["eot"]) == ("byte", 257, 256)
    assert 0 < meta["unigram_baseline_nats"] < np.log(257)
    assert [split_of(i, 0.3, 0.2) for i in range(1000)].count("val") == 300  # (42 at 0.05: test_cli_default_corpus)


def test_cli_default_corpus(tmp_path):
    """The embedded corpus as bytes: the shards every CPU study of the repository was measured on."""
    out = tmp_path / "out"
    child = subprocess.run([sys.executable, str(ROOT / "prepare_data.py"), "--tokenizer", "byte", "--out_dir", str(out),
                            "--num_proc", "2"], capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr
    meta = load_meta(out)
    assert [meta["splits"][s]["docs"] for s in SPLITS] == [38, 2, 2]
    assert [hashlib.sha256((out / f"{s}_000000.bin").read_bytes()).hexdigest()[:16] for s in SPLITS] == [
        "d59e536cb55ff509", "2c5eb14d0c2db76c", "871b37a596b557da"]
    assert meta["source"]["data_files"] == ["data/shakespeare.jsonl.gz"]  # relative to the repository


def test_text_files_are_documents_in_sorted_order_and_a_lone_one_is_split_by_position(tmp_path):
    (tmp_path / "a.txt").write_text("Hello world, this is a test.")
    with gzip.open(tmp_path / "b.txt.gz", "wt") as f:
        f.write("Hello world")
    out = tmp_path / "out"
    assert main(["--data_files", str(tmp_path / "a.txt"), str(tmp_path / "b.txt.gz"), "--out_dir", str(out),
                 "--val_fraction", "0", "--test_fraction", "0"]) == 0
    assert split_stream(out, "train") == [50256, 15496, 995, 11, 428, 318, 257, 1332, 13, 50256, 15496, 995]
    text = "".join(f"line {i}, été\n" for i in range(1000))
    (tmp_path / "input.txt").write_text(text)
    assert prep(tmp_path / "input.txt", tmp_path / "lone") == 0
    a, b = int(len(text) * (1 - 0.05 - 0.05)), int(len(text) * (1 - 0.05))  # 90/5/5, as prepare_data computes it
    for split, part in zip(SPLITS, (text[:a], text[a:b], text[b:])):
        assert split_stream(tmp_path / "lone", split) == [256] + list(part.encode())


def test_num_proc_parquet_streaming_or_not_and_a_hub_dataset_give_the_same_shards(tmp_path, monkeypatch, data_dir):
    """The hub path, offline: load_dataset (faked) gets the name, config, split and streaming, rows in order."""
    import datasets
    for n in (1, 2):  # GPT-2 tokens, in this process or in two workers
        assert main(["--data_files", write_jsonl(tmp_path / "c.jsonl", DOCS), "--out_dir", str(tmp_path / f"out{n}"),
                     "--num_proc", str(n), "--shard_tokens", "300", "--val_fraction", "0.2"]) == 0
    assert files_of(tmp_path / "out1") == files_of(tmp_path / "out2")
    parquet, settings = tmp_path / "c.parquet", ["--shard_tokens", "1e3", "--val_fraction", "0.2", "--test_fraction", "0.1"]
    datasets.Dataset.from_dict({"id": list(range(len(DOCS))), "body": DOCS}).to_parquet(str(parquet))
    for streaming in ("--streaming", "--no-streaming"):
        assert main(["--dataset", "parquet", "--data_files", str(parquet), "--text_column", "body", streaming,
                     "--tokenizer", "byte", "--out_dir", str(tmp_path / streaming), *settings]) == 0
        assert files_of(tmp_path / streaming, but="meta.json") == files_of(data_dir, but="meta.json")
    calls = []
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **kw: calls.append((a, kw)) or
                        [{"id": i, "text": t} for i, t in enumerate(DOCS)])
    assert main(["--dataset", "someone/corpus", "--name", "small", "--out_dir", str(tmp_path / "hub"), "--tokenizer",
                 "byte", *settings]) == 0
    assert calls == [(("someone/corpus", "small"), dict(data_files=None, split="train", streaming=True))]
    assert files_of(tmp_path / "hub", but="meta.json") == files_of(data_dir, but="meta.json")


def test_a_rerun_is_up_to_date_or_refused_and_never_deletes_an_input(tmp_path, capsys):
    src, out = write_jsonl(tmp_path / "c.jsonl", DOCS), tmp_path / "out"
    assert prep(src, out) == 0
    before = files_of(out)
    assert prep(src, out) == 0
    assert "already prepared" in capsys.readouterr().out
    assert prep(src, out, "--val_fraction", 0.5) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert files_of(out) == before
    kept = write_jsonl(out / "mine.jsonl", DOCS)  # a corpus file inside --out_dir
    assert prep(kept, out, "--overwrite") == 2
    assert main(["--dataset", str(out), "--data_files", "mine.jsonl", "--out_dir", str(out), "--overwrite"]) == 2
    assert capsys.readouterr().err.count("inside --out_dir") == 2 and Path(kept).exists() and load_meta(out)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("a user's file")
    assert prep(src, tmp_path / "mine", "--overwrite") == 2  # not a preparation: never replaced
    assert "no preparation" in capsys.readouterr().err and (tmp_path / "mine" / "notes.txt").exists()


@pytest.mark.parametrize("failure, status", [(OSError(errno.ENOSPC, "No space left on device"), 2),
                                             (KeyboardInterrupt(), 130), (signal.SIGTERM, 143)])
def test_a_failed_preparation_leaves_out_dir_as_it_was(tmp_path, monkeypatch, failure, status):
    src, out = write_jsonl(tmp_path / "c.jsonl", DOCS), tmp_path / "out"
    assert prep(src, out, "--shard_tokens", 500) == 0
    before = files_of(out)
    real, calls = prepare_data.write_shard, []

    def fail_at_the_third(*args):
        calls.append(args)
        if len(calls) == 3 and isinstance(failure, signal.Signals):
            os.kill(os.getpid(), failure)
        elif len(calls) == 3:
            raise failure
        return real(*args)
    monkeypatch.setattr(prepare_data, "write_shard", fail_at_the_third)
    assert prep(src, out, "--shard_tokens", 400, "--overwrite") == status
    assert files_of(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl", "out"]
    calls.clear()
    assert prep(src, tmp_path / "new", "--shard_tokens", 400) == status
    assert not (tmp_path / "new").exists()


def test_a_preparation_over_opened_data_changes_nothing_for_its_reader(tmp_path):
    """Promise 6: the data a run opened is the data it uses, whatever prepare_data.py --overwrite does."""
    out = tmp_path / "out"
    assert prep(write_jsonl(tmp_path / "a.jsonl", DOCS), out, "--shard_tokens", 1e3) == 0
    opened = TokenData(out)

    def read(d):
        loader = TokenLoader(d, "train", 2, 16, seed=1)
        return [loader.next_batch()[0] for _ in range(3)] + [x for x, _ in eval_batches(d, "val", 4, 8, 100)]
    before = read(opened)
    assert prep(write_jsonl(tmp_path / "b.jsonl", [d[::-1] for d in DOCS]), out, "--shard_tokens", 1e3,
                "--overwrite") == 0
    assert all(torch.equal(a, b) for a, b in zip(before, read(opened)))
    assert not all(torch.equal(a, b) for a, b in zip(before, read(out)))  # opened anew: the new data


def test_a_resume_on_data_prepared_again_is_refused(tmp_path):
    """Promise 6: a run records its data's fingerprint (meta.json's shard digests, no read of the corpus); changed
    text of the same size, prepared again under a killed run, is other data."""
    src = write_jsonl(tmp_path / "a.jsonl", DOCS)
    assert prep(src, tmp_path / "d_byte") == 0
    run(tmp_path / "d_byte", tmp_path, "--max_steps=6", "--ckpt_interval=3")
    (tmp_path / "test" / "summary.json").unlink()
    ckpt = torch.load(tmp_path / "test" / "ckpt.pt", weights_only=True)
    torch.save({**ckpt, "step": 3}, tmp_path / "test" / "ckpt.pt")  # as if killed after step 3
    write_jsonl(tmp_path / "a.jsonl", [d.swapcase() for d in DOCS])  # same size, other text
    assert prep(src, tmp_path / "d_byte", "--overwrite") == 0
    with pytest.raises(UserError, match="trained on other data than .* holds now.*--overwrite=true"):
        run(tmp_path / "d_byte", tmp_path, "--max_steps=6", "--ckpt_interval=3", "--resume=true")
    config = json.loads((tmp_path / "test" / "config.json").read_text())
    assert config["data_fingerprint"] == ckpt["data_fingerprint"] != TokenData(tmp_path / "d_byte").fingerprint


def test_a_shard_rewritten_under_a_live_run_stops_it_and_keeps_its_checkpoint(data_dir, tmp_path, monkeypatch):
    """A shard changed in place (cp over it, dd conv=notrunc) is noticed at the next evaluation by a stat, no read."""
    d = copytree(data_dir, tmp_path / "data_byte")
    real = train.train_step

    def step_then_rewrite(*args, **kw):
        out = real(*args, **kw)
        if args[2].epoch * args[2].n_windows + args[2].pos >= 4 * 8:  # after step 4: the first val shard, in place
            shard = d / load_meta(d)["splits"]["val"]["files"][0]
            with open(shard, "r+b") as f:
                f.seek(-2, os.SEEK_END)
                f.write(b"\x01\x00")
        return out
    monkeypatch.setattr(train, "train_step", step_then_rewrite)
    with pytest.raises(UserError, match="val_000000.bin changed under this run.*checkpoint of step 3"):
        run(d, tmp_path, "--max_steps=6", "--ckpt_interval=3", "--batch_tokens=256")
    assert torch.load(tmp_path / "test" / "ckpt.pt", weights_only=True)["step"] == 3
    assert not [r for r in log_records(tmp_path / "test") if r["kind"] == "diverged"]  # no divergence: other data


def test_a_preparation_killed_after_its_exchange_leaves_the_new_data(tmp_path):
    """The replace is one atomic exchange (renameat2): a kill at any moment leaves the old data or the new at out_dir."""
    src, out = write_jsonl(tmp_path / "c.jsonl", DOCS), tmp_path / "out"
    assert prep(src, out) == 0
    child = subprocess.run([sys.executable, "-c", "import os, signal, shutil, prepare_data\n"
                            "rmtree = shutil.rmtree\n"  # the old data's removal, after the exchange: killed there
                            "shutil.rmtree = lambda p, **k: rmtree(p, **k) if k else os.kill(os.getpid(), signal.SIGKILL)\n"
                            f"prepare_data.main(['--data_files', {src!r}, '--out_dir', {str(out)!r}, '--tokenizer', "
                            "'byte', '--shard_tokens', '500', '--overwrite'])"], cwd=ROOT, capture_output=True)
    assert child.returncode == -signal.SIGKILL
    assert load_meta(out)["shard_tokens"] == 500 and TokenData(out).splits["train"]  # the new data, whole


def test_ids_beyond_the_tokenizer_s_vocabulary_are_one_line(data_dir, tmp_path):
    """Header and size intact, an id of 300 in byte data: refused as the batch is read, in training and evaluation."""
    d = copytree(data_dir, tmp_path / "bad_byte")
    for split in ("train", "val"):
        shard = d / load_meta(d)["splits"][split]["files"][0]
        prepare_data.write_shard(shard, np.full(len(open_shard(shard)), 300), get_tokenizer("byte"))
    with pytest.raises(UserError, match="token id 300, beyond its byte tokenizer's 257 ids"):
        next(eval_batches(d, "val", 2, 8, 64))
    with pytest.raises(UserError, match="token id 300"):
        run(d, tmp_path, "--max_steps=1")


# --- loaders ------------------------------------------------------------------------------------------------

def rows(x, y):
    return [tuple(r) for r in torch.cat([x, y[:, -1:]], 1).tolist()]


def test_an_epoch_covers_every_window_and_ranks_and_micro_steps_see_the_same_windows(data_dir):
    B, T, seed = 3, 16, 5
    loader, seen = TokenLoader(data_dir, "train", batch_size=1, seq_len=T, seed=1), []
    for _ in range(loader.n_windows):
        x, y = loader.next_batch()
        assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (1, T)
        assert torch.equal(x[:, 1:], y[:, :-1])
        seen += rows(x, y)
    shards = [open_shard(data_dir / f) for f in load_meta(data_dir)["splits"]["train"]["files"]]
    assert sorted(seen) == sorted(tuple(s[j * T:j * T + T + 1]) for s in shards for j in range((len(s) - 1) // T))
    assert (loader.epoch, loader.pos) == (1, 0)
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
    assert torch.cat([b[1] for b in eval_batches(data_dir, "val", 64, T, max_tokens=None)]).numel() == (len(stream) - 1) // T * T
    with pytest.raises(UserError, match="too few"):
        eval_batches(data_dir, "val", 4, len(stream), max_tokens=None)
    with pytest.raises(UserError, match="max_tokens"):
        eval_batches(data_dir, "val", 4, 8, max_tokens=7)


# --- bad input: one clear line ------------------------------------------------------------------------------

def test_bad_sources_are_one_line_naming_them(tmp_path, capsys):
    (tmp_path / "latin1.txt").write_bytes("café\n".encode("latin-1"))
    (tmp_path / "broken.jsonl").write_bytes(b'{"text": "a"}\n{"text": "b"\n')
    (tmp_path / "numbers.jsonl").write_bytes(b'{"text": 5}\n')
    (tmp_path / "c.csv").write_text("text\nx\n")
    write_jsonl(tmp_path / "body.jsonl", ["x"], key="body")
    for name, keyword in [("missing.jsonl", "not found"), ("latin1.txt", "latin1.txt"), ("broken.jsonl", "broken.jsonl"),
                          ("numbers.jsonl", "--text_column"), ("body.jsonl", "--text_column"), ("c.csv", "extension")]:
        assert prep(tmp_path / name, tmp_path / "out") == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and keyword in err, err
    assert prep(write_jsonl(tmp_path / "blank.jsonl", ["", ""]), tmp_path / "out") == 2
    assert "empty" in capsys.readouterr().err and not (tmp_path / "out").exists()
    with pytest.raises(SystemExit) as e:  # argparse's one line (--shard_tokens inf was an OverflowError traceback)
        main(["--shard_tokens", "inf", "--out_dir", str(tmp_path / "x")])
    assert e.value.code == 2 and "not a positive whole number" in capsys.readouterr().err


def test_a_directory_named_for_another_tokenizer_is_refused_and_missing_data_names_its_command(data_dir, tmp_path, capsys):
    """The new user's trap: GPT-2 tokens prepared into data/shakespeare_byte trained another model silently."""
    src = write_jsonl(tmp_path / "c.jsonl", DOCS)
    assert main(["--data_files", src, "--out_dir", str(tmp_path / "corpus_byte")]) == 2
    assert "--tokenizer byte" in capsys.readouterr().err and not (tmp_path / "corpus_byte").exists()
    assert data.prepare_command(data.DATA_DIR / "shakespeare_byte") == "python prepare_data.py --tokenizer byte"
    assert data.prepare_command(data.DATA_DIR / "shakespeare") == "python prepare_data.py"
    with pytest.raises(UserError, match="--tokenizer byte --out_dir"):
        TokenLoader(tmp_path / "mine_byte", "train", 2, 8)
    with pytest.raises(UserError, match="no split 'validation'"):
        eval_batches(data_dir, "validation", 2, 8, 100)
    assert prep(src, tmp_path / "no_test", "--test_fraction", 0) == 0
    with pytest.raises(UserError, match="empty"):
        TokenLoader(tmp_path / "no_test", "test", 2, 8)


def test_bad_shards_and_meta_are_one_line_with_the_fix(data_dir, tmp_path):
    good = (data_dir / "train_000000.bin").read_bytes()
    for i, content in enumerate((good[:-1], good[:20], b"NOTASHRD" + good[8:], good[:8] + b"\x09" + good[9:])):
        broken = copytree(data_dir, tmp_path / f"shard{i}")
        (broken / "train_000000.bin").write_bytes(content)
        with pytest.raises(UserError, match="train_000000.bin.*--overwrite"):
            TokenLoader(broken, "train", 2, 8)
    broken = copytree(data_dir, tmp_path / "meta")
    meta = load_meta(data_dir)
    for change in ({"vocab_size": None}, {"splits": []}, {"format_version": 0}):
        (broken / "meta.json").write_text(json.dumps({**meta, **change}))
        with pytest.raises(UserError, match="meta.json.*--overwrite"):
            TokenData(broken)
    (broken / "meta.json").write_text(json.dumps({k: v for k, v in meta.items() if k != "tokenizer_fingerprint"}))
    with pytest.raises(UserError, match="lacks tokenizer_fingerprint"):  # (was a KeyError traceback)
        TokenData(broken)
    meta["splits"]["train"]["tokens"] += 5
    (broken / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(UserError, match="tokens"):
        TokenData(broken)
