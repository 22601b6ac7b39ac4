"""Bad input is one `error:` line and exit 2, before any compute: keys, types, configs, the data, the vocabulary; a
tool run by its path is no traceback either."""

import json
import os
import shutil
import subprocess
import sys

import pytest

import train
from common import ROOT, UserError, cli

from runs import argv


@pytest.fixture
def no_compute(monkeypatch):
    """Building a model or taking a step fails the test: the error must come first."""
    def never(*args, **kwargs):
        raise AssertionError("computed before the error")
    monkeypatch.setattr(train, "make_model", never)
    monkeypatch.setattr(train, "train_step", never)


@pytest.mark.parametrize("args, message", [
    (["--batchsize=8"], "unknown key 'batchsize' in the command line; did you mean batch_size"),
    (["--lr=fast"], "lr expects float, got 'fast'"),
    (["--max_steps=1.5"], "max_steps expects int"),
    (["--compile=yes"], "compile expects true/false"),
    (["--n_layers=3"], "did you mean n_layer"),
    (["--lr"], "--lr needs a value: --lr=VALUE"),
    (["--lr_schedule=linear"], "lr_schedule must be cosine or wsd"),
    (["--n_embd=33"], "n_embd=33 / n_head=2 must be a whole, even head dim"),
    (["--vocab_size=64"], "vocab_size=64 is smaller than the byte tokenizer's"),
    (["--batch_tokens=300"], "batch_tokens=300 is not a multiple of batch_size * seq_len * world_size = 128 "
                             "(e.g. batch_tokens=256)"),
    (["--eval_tokens=16"], "eval_tokens=16 is less than seq_len=32"),
    (["--run_name=a/b"], "run_name must be a plain directory name"),
    (["--residual=resnet"], "unknown residual 'resnet'; choose one of standard"),
    (["--rd_mode=tied"], "rd_mode='tied' only applies to residual='rd_attnres'"),
    (["--residual=rd_attnres", "--rd_mode=shared"], "unknown rd_mode 'shared'"),
    (["--residual=denseformer", "--denseformer_period=5"], "between 1 and n_layer=2"),
    (["--n_layer=0"], "n_layer must be >= 1"),
    (["--wandb_log=true"], "wandb_log=true needs the wandb package"),
])
def test_bad_keys_are_one_line_before_any_compute(data_dir, tmp_path, monkeypatch, capsys, no_compute, args, message):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    assert cli(train.main, argv(data_dir, tmp_path, *args)) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("text, message", [("n_layer = 2 +\n", "line 1: syntax error"), ("n_layer = undefined\n", "NameError"),
                                           ("import sys\nsys.exit(3)\n", "config file")])
def test_a_config_file_that_fails_is_one_line(tmp_path, capsys, text, message):
    path = tmp_path / "bad.py"
    path.write_text(text)
    assert cli(train.main, [str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: config file {path}") and message in err and err.count("\n") == 1


def test_missing_data_says_the_exact_command_that_makes_it(tmp_path, monkeypatch, capsys, no_compute):
    """configs/exp_cpu.py's data is byte tokens: the hint makes byte tokens, where it once said to make GPT-2's."""
    monkeypatch.chdir(tmp_path)
    assert cli(train.main, [str(ROOT / "configs" / "exp_cpu.py")]) == 2
    assert "`python prepare_data.py --tokenizer byte" in capsys.readouterr().err  # (--out_dir: not run from the root)
    assert cli(train.main, [str(ROOT / "configs" / "demo.py"), "--data_dir=elsewhere"]) == 2
    err = capsys.readouterr().err
    assert "`python prepare_data.py --data_files" in err and "--out_dir elsewhere`" in err


def test_a_data_dir_whose_tokens_are_not_what_its_name_says_is_refused(data_dir, tmp_path, no_compute):
    shutil.copytree(data_dir, tmp_path / "corpus_gpt2")  # byte tokens under a name that promises GPT-2's
    with pytest.raises(UserError, match="named for the gpt2 tokenizer"):
        train.main(argv(tmp_path / "corpus_gpt2", tmp_path))


@pytest.mark.parametrize("tool", ["bench", "diagnose", "gpu_check"])
def test_a_tool_runs_by_its_path_as_by_its_module(tool):
    by_path, by_module = (subprocess.run([sys.executable, *how, "--help"], cwd=ROOT, capture_output=True, text=True,
                                         timeout=120) for how in ([f"tools/{tool}.py"], ["-m", f"tools.{tool}"]))
    assert by_path.returncode == by_module.returncode == 0, by_path.stderr
    assert by_path.stdout.partition("-h, --help")[2] == by_module.stdout.partition("-h, --help")[2] != ""  # (not the prog)


@pytest.mark.parametrize("env, message", [(dict(WORLD_SIZE="2"), "WORLD_SIZE=2 is set, but not by torchrun"),
                                          (dict(RANK="1"), "not a torchrun rank"), (dict(WORLD_SIZE="abc"), "not a torchrun"),
                                          (dict(LOCAL_RANK="x"), "not a torchrun rank")])
def test_a_stray_launcher_variable_is_one_line(data_dir, tmp_path, monkeypatch, capsys, no_compute, env, message):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert cli(train.main, argv(data_dir, tmp_path)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


def test_a_closed_pipe_discards_the_output_and_the_run_finishes(data_dir, tmp_path):
    """`python train.py ... | head -1`: the run goes on to its end, its output discarded (as a sweep's does)."""
    p = subprocess.Popen([sys.executable, "train.py", *argv(data_dir, tmp_path)], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env={**os.environ, "OMP_NUM_THREADS": "1"})
    p.stdout.readline()
    p.stdout.close()  # what head does after its line
    assert p.wait(timeout=300) == 0, p.stderr.read()
    assert json.loads((tmp_path / "test" / "summary.json").read_text())["step"] == 6
