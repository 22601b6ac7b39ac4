"""Bad data, configs, keys and checkpoints are one `error:` line before step 1."""

import json
import math
import random
import re

import pytest

import train
from data import load_meta
from depthres import UserError, config
from depthres.checkpoint import load_checkpoint

from runs import CONFIG, run

# ----------------------------------------------------------------------------------------------
# Reliability: data and configs are checked before step 1


def broken_copy(data_dir, tmp_path, name, change):
    """A copy of data_dir with `change(copy)` applied."""
    out = tmp_path / name
    out.mkdir()
    for f in data_dir.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    change(out)
    return out


def truncate(name):
    return lambda d: (d / name).write_bytes((d / name).read_bytes()[:-3])


def test_bad_data_is_found_before_step_1(data_dir, tmp_path, monkeypatch):
    def no_vocab_size(d):
        meta = json.loads((d / "meta.json").read_text())
        del meta["vocab_size"]
        (d / "meta.json").write_text(json.dumps(meta))

    val_tokens = load_meta(data_dir)["splits"]["val"]["tokens"]
    cases = [(broken_copy(data_dir, tmp_path, "val", truncate("val_000000.bin")), [],
              "val_000000.bin is truncated or corrupt"),
             (broken_copy(data_dir, tmp_path, "test", truncate("test_000000.bin")), [],
              "test_000000.bin is truncated or corrupt"),
             (broken_copy(data_dir, tmp_path, "meta", no_vocab_size), [], "meta.json lacks vocab_size"),
             (data_dir, [f"--seq_len={val_tokens}", f"--eval_tokens={val_tokens}", "--batch_size=1",
                         f"--batch_tokens={val_tokens}"],
              f"split 'val' of {data_dir} has {val_tokens} tokens, too few for one evaluation sequence of "
              f"seq_len \\+ 1 = {val_tokens + 1}: use seq_len <= {val_tokens - 1}, or prepare the data with a "
              "larger --val_fraction")]
    monkeypatch.setattr(train, "train_step", None)  # never reached
    for data, args, message in cases:
        with pytest.raises(UserError, match=message):
            run(data, tmp_path / "runs", *args)
        assert not (tmp_path / "runs").exists()
    with pytest.raises(UserError, match="eval_tokens=16 is less than one sequence of seq_len=32 tokens: "
                                          "set eval_tokens >= 32"):
        run(data_dir, tmp_path / "runs", "--eval_tokens=16")


def test_config_values_out_of_range_are_config_errors(data_dir, tmp_path, capsys, monkeypatch):
    for arg, message in [("--seed=-1", r"seed must be in \[0, 2\*\*32\), got -1"),
                         ("--seed=5e9", r"seed must be in \[0, 2\*\*32\), got 5000000000"),
                         ("--data_seed=-1", r"data_seed must be in \[0, 2\*\*32\)"),
                         ("--lr=inf", "lr must be a finite number, got inf"),
                         ("--lr=nan", "lr must be a finite number, got nan"),
                         ("--grad_clip=inf", "grad_clip must be a finite number"),
                         ("--lr=0", "lr > 0"),
                         ("--eps=-1", "eps must be > 0"),
                         ("--eps=0", r"eps must be > 0 \(AdamW divides by sqrt\(v\) \+ eps, and v = 0 for a "
                                     r"parameter whose gradient is 0: NaN\)"),
                         ("--eps=1e-40", "at least float32's smallest normal 1.18e-38, got 1e-40"),
                         ("--wandb_project=me/runs", "wandb_project must be a non-empty name without /"),
                         ("--wandb_tags=seed0," + "x" * 65, "wandb_tags: a W&B tag is at most 64 characters")]:
        with pytest.raises(UserError, match=message):
            config.parse_config([CONFIG, arg])
    run(data_dir, tmp_path, "--warmup_steps=10", "--max_steps=2")
    assert ("warning: warmup_steps=10 is more than the run's 2 steps: the learning rate ends its warmup at 0.002, "
            "never reaching lr=0.01") in capsys.readouterr().err

    monkeypatch.setattr(train, "train_step", lambda *args, **kwargs: (4178201.5, math.inf, 0))
    with pytest.raises(UserError, match=re.escape("non-finite gradient norm at step 1 (loss 4178201.5, gradient "
                                                      "norm inf)")):
        run(data_dir, tmp_path, "--run_name=diverged")


def test_a_random_bytes_checkpoint_never_quotes_unsafe_advice(tmp_path):
    bad = tmp_path / "ckpt.pt"
    bad.write_bytes(random.Random(1).randbytes(100_000))
    with pytest.raises(UserError) as e:
        load_checkpoint(bad)
    assert str(e.value).startswith(f"{bad} is not a readable checkpoint") and "weights_only" not in str(e.value)


BAD_CONFIG_FILES = [
    ("residual = 'standard'\nn_layer = 2 +\n", "line 2: syntax error"),
    ("import math\nn_layer = 2\nlr = math.sqrt(-1)\n", "line 3: ValueError: math domain error"),
    ("n_layer = undefined_name\n", "line 1: NameError"),
    ("import sys\nsys.exit(3)\n", "line 2: SystemExit: 3"),  # (train.py ended with status 3, and no message)
]


@pytest.mark.parametrize("text, message", BAD_CONFIG_FILES, ids=["syntax", "raises", "name", "exit"])
def test_a_config_file_that_fails_names_its_line(tmp_path, text, message):
    path = tmp_path / "bad.py"
    path.write_text(text)
    with pytest.raises(UserError, match=re.escape(f"config file {path}, {message}")):
        config.parse_config([str(path)])


def test_a_config_file_may_import_what_it_computes_with(tmp_path):
    """A function imported by name is a tool of the file, not a key (it was refused as "unknown key 'ceil'")."""
    path = tmp_path / "ok.py"
    path.write_text("from math import ceil, log2\nmax_steps = ceil(2.5)\nn_layer = int(log2(8))\n")
    tc, model_settings = config.parse_config([str(path)])
    assert tc.max_steps == 3 and model_settings == {"n_layer": 3}


@pytest.mark.parametrize("arg, message", [
    ("--rope_base=0", "rope_base must be a finite number > 0"),
    ("--rope_base=-5", "rope_base must be a finite number > 0"),
    ("--rope_base=inf", "rope_base must be a finite number > 0"),
    ("--rope_base=nan", "rope_base must be a finite number > 0"),
    ("--logit_softcap=inf", "logit_softcap must be a finite number >= 0"),
    ("--run_name=a/b", "run_name must be a plain directory name inside out_dir"),
    ("--run_name=..", "run_name must be a plain directory name inside out_dir"),
    ("--run_name=/tmp/elsewhere", "run_name must be a plain directory name inside out_dir"),
    # control characters in what is printed or becomes a path (round three): a forged line, a terminal escape
    ("--run_name=evil\ndone: run_dir FAKE, step 2, val_loss 0.0001",
     r"run_name holds a control character \('\\n' at position 4\), got 'evil\\ndone: run_dir FAKE"),
    ("--run_name=red\x1b[31m", r"run_name holds a control character \('\\x1b' at position 3\)"),
    ("--run_name=bell\x07", "run_name holds a control character"),
    ("--run_name=c1\x85", "run_name holds a control character"),
    ("--run_name=del\x7f", "run_name holds a control character"),
    ("--run_name=cr\r", "run_name holds a control character"),
    ("--out_dir=runs\ndone: x", "out_dir holds a control character"),
    ("--data_dir=data\x1b[2J", "data_dir holds a control character"),
    ("--wandb_run_name=a\nb", "wandb_run_name holds a control character"),
    ("--wandb_group=a\x07", "wandb_group holds a control character"),
    ("--wandb_tags=a,b\nc", "wandb_tags holds a control character"),
    ("--resume=x\ny", "resume holds a control character"),
    # invisible format characters (round five): a right-to-left override reorders what follows, a zero-width
    # space hides in a directory name
    ("--run_name=evil\u202etxt.exe", r"run_name holds a control character \('\\u202e' at position 4\)"),
    ("--run_name=zero\u200bwidth", r"run_name holds a control character \('\\u200b' at position 4\)"),
])
def test_bad_keys_are_refused_before_step_1(data_dir, tmp_path, monkeypatch, arg, message):
    monkeypatch.chdir(tmp_path)  # a relative out_dir, if it were taken, would show there
    monkeypatch.setattr(train, "train_step", None)  # never reached
    with pytest.raises(UserError, match=message):
        run(data_dir, tmp_path, arg)
    assert not any(tmp_path.iterdir())


def edit_meta(change):
    def edit(d):
        meta = json.loads((d / "meta.json").read_text())
        change(meta)
        (d / "meta.json").write_text(json.dumps(meta))
    return edit


@pytest.mark.parametrize("change, message", [
    (lambda m: m.update(vocab_size="257"), "vocab_size '257' is not the byte tokenizer's 257"),
    (lambda m: m.update(vocab_size=-1), "vocab_size -1 is not the byte tokenizer's 257"),
    (lambda m: m.update(splits=[]), "splits is a JSON list, not an object"),
    (lambda m: m["splits"]["train"].update(files="train_000000.bin"), "split 'train': files 'train_000000.bin' is not "
                                                                     "a list of file names"),
    (lambda m: m["splits"]["val"].update(files=["../../secret.bin"]), "is not a list of file names"),
    (lambda m: m.update(tokenizer="sentencepiece"), "tokenizer 'sentencepiece' is not one of gpt2, byte"),
    (lambda m: m["splits"]["train"].update(tokens=m["splits"]["train"]["tokens"] + 5),
     "split 'train' of .* holds [0-9,]+ tokens in its shards, but its meta.json says [0-9,]+"),
    # round five: each was a traceback
    (lambda m: m["splits"].pop("val"), "splits lacks 'val': prepare_data.py writes train, val and test"),
    (lambda m: m.update(unigram_baseline_nats="3.4"), "unigram_baseline_nats '3.4' is not a number"),
], ids=["vocab_str", "vocab_negative", "splits_list", "files_str", "files_path", "tokenizer", "tokens", "no_val",
        "baseline_str"])
def test_a_bad_meta_json_is_refused_before_step_1(data_dir, tmp_path, monkeypatch, change, message):
    data = broken_copy(data_dir, tmp_path, "data", edit_meta(change))
    monkeypatch.setattr(train, "train_step", None)  # never reached
    with pytest.raises(UserError, match=message):
        run(data, tmp_path / "runs")
    assert not (tmp_path / "runs").exists()


def test_a_model_too_large_for_memory_is_refused_before_it_is_built(data_dir, tmp_path, monkeypatch):
    """vocab_size=1e10 would allocate 1.28 TB for the embedding alone (and as much again for the head): the
    parameters are counted on the meta device and the training state compared with the memory there is."""
    import model
    monkeypatch.setattr(model.GPT, "init_weights", None)  # never reached: no weight is allocated
    monkeypatch.setattr(train, "train_step", None)
    message = (r"the model would have 640,000,0[0-9,]+ parameters \(10,000,000,000 x 32 in the embedding alone\): "
               r"training them needs about 9,537 GiB per rank \(16 bytes a parameter\), more than the [0-9,]+ GiB "
               "of (this host's|a GPU's) memory; set a smaller vocab_size, n_embd or n_layer")
    with pytest.raises(UserError, match=message):
        run(data_dir, tmp_path, "--vocab_size=10000000000")
    assert not (tmp_path / "test").exists()


@pytest.mark.parametrize("kw, match", [
    (dict(residual="resnet"), "unknown residual 'resnet'"),
    (dict(residual="block_attnres", rd_mode="tied"), "rd_mode='tied' only applies to residual='rd_attnres'"),
    (dict(residual="rd_attnres", rd_mode="shared"), "unknown rd_mode 'shared'"),
    (dict(residual="block_attnres", attnres_block_size=0), "attnres_block_size counts sublayers and must be >= 1"),
    (dict(n_embd=30, n_head=4), "n_embd=30 is not divisible by n_head=4"),
    (dict(n_embd=24, n_head=8), "head dim .* must be even"),
    (dict(n_layer=0), "n_layer must be >= 1"),
    (dict(depth_impl="triton"), "unknown depth_impl 'triton'"),
    (dict(residual="block_attnres", dar_routing="cross"), "dar_routing='cross' only applies to residual='dar'"),
    (dict(residual="dar", dar_routing="mixed"), "unknown dar_routing 'mixed'"),
    (dict(residual="dar", dar_block_size=0), "dar_block_size counts transformer layers and must be >= 1"),
    (dict(depth_chunk=0), "depth_chunk counts sublayers and must be >= 1"),
    (dict(residual="mhc", hc_streams=0), "hc_streams must be >= 1"),
    (dict(residual="standard", denseformer_dilation=2), "denseformer_dilation=2 only applies to residual='denseformer'"),
    (dict(residual="muddformer", denseformer_period=2), "denseformer_period=2 only applies to residual='denseformer'"),
    (dict(residual="denseformer", n_layer=4, denseformer_period=5),
     "denseformer_period counts transformer layers and must be between 1 and n_layer=4, got 5"),
    (dict(residual="denseformer", denseformer_dilation=0), "denseformer_dilation .* between 1 and n_layer"),
    (dict(residual="block_attnres", delta_block_size=4), "delta_block_size=4 only applies to residual='delta_attnres'"),
    (dict(residual="delta_attnres", delta_block_size=0), "delta_block_size counts sublayers and must be >= 1"),
])
def test_a_bad_model_key_is_one_clear_line(kw, match):
    """depthres.config.model_config checks every model key, wherever a GPTConfig is built from user input
    (train.py, a checkpoint, the bench)."""
    with pytest.raises(config.UserError, match=match):
        config.model_config(kw)


LONG = "x" * 300  # a path component longer than the OS allows (255 bytes on Linux)


@pytest.mark.parametrize("command", ["train", "train_data", "prepare_data", "sample", "sample_prompt", "diagnose",
                                     "export"])
def test_a_path_longer_than_the_os_allows_is_one_line_in_every_command(command, tmp_path, capsys):
    """Round five: a traceback in each (diagnose blamed curves.png). Every command runs through depthres.cli: an
    OSError is one line naming the path, exit 2, like every other error (depthres/__init__.py lists the statuses;
    the experiments' commands: experiments/tests/test_sweep.py)."""
    import prepare_data
    import sample
    from tools import diagnose, export_ckpt
    path = str(tmp_path / LONG)
    main, argv = {"train": (train.cli, [path]), "train_data": (train.cli, [CONFIG, f"--data_dir={path}"]),
                  "prepare_data": (prepare_data.main, ["--tokenizer", "byte", "--out_dir", path]),
                  "sample": (sample.main, ["--ckpt", path]),
                  "sample_prompt": (sample.main, ["--ckpt", ".", "--prompt_file", path]),
                  "diagnose": (diagnose.main, ["--ckpt", path]), "export": (export_ckpt.main, [path])}[command]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "the name is longer than the OS allows" in err, err
