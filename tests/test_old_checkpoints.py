"""A checkpoint written before parameters were renamed still works: depthres.checkpoint.RENAMED maps its names."""

import shutil
from pathlib import Path

import pytest
import torch

import sample
from depthres.checkpoint import load_checkpoint, renamed, whole_checkpoint
from model import GPTConfig
from model_fast import make_model
from tools import diagnose

from runs import losses, run

BEFORE_ISSUE35 = Path(__file__).parent / "fixtures" / "before_issue35"  # written by commit 22037cb (its README)


def same_training(resumed, straight):
    """Steps 4-6, trained here from the old checkpoint, are the straight run's bit for bit. Steps 1-3 are
    the fixture's log, written on another machine: equal up to float32 rounding (on an AMD EPYC step 2's
    logged loss differs by 8e-8 relative while every later step matches exactly)."""
    r, s = losses(resumed), losses(straight)
    assert [k for k, _ in r] == [k for k, _ in s] and len(r) == 6
    assert r[3:] == s[3:]
    assert [v for _, v in r[:3]] == pytest.approx([v for _, v in s[:3]], rel=1e-6, abs=0)


def test_renamed_maps_only_the_old_names():
    assert renamed("router.w") == "residual.w" and renamed("router.W1.0") == "residual.W1.0"
    assert renamed("residual.w") == "residual.w" and renamed("blocks.0.attn.c_q.weight") == "blocks.0.attn.c_q.weight"


def test_a_checkpoint_from_before_the_renaming_loads_samples_diagnoses_and_resumes(data_dir, tmp_path, straight):
    run_dir = tmp_path / "old"
    shutil.copytree(BEFORE_ISSUE35, run_dir, ignore=shutil.ignore_patterns("README.md", "ckpt"))  # ckpt.pt alone
    written = torch.load(run_dir / "ckpt.pt", weights_only=True)["model"]
    assert "router.w" in written  # the file holds the old names
    ckpt = load_checkpoint(run_dir)
    assert ckpt["model"].keys() == {renamed(k) for k in written} and ckpt["step"] == 3  # read under the new ones
    model = make_model(GPTConfig(**ckpt["model_config"]))
    model.load_state_dict(ckpt["model"])  # strict: every weight found under its new name
    assert torch.equal(model.residual.w, written["router.w"])
    assert sample.main(["--ckpt", str(run_dir), "--max_new_tokens", "2"]) == 0
    found = diagnose.diagnose(str(run_dir), str(tmp_path / "diag"), tokens=256, batch_size=2, data_dir=str(data_dir))
    assert "routing_maps" in found
    run(data_dir, tmp_path, "--run_name=old", "--resume=true")
    same_training(run_dir, straight)  # steps 4-6 trained by this code from the old checkpoint


def test_a_sharded_checkpoint_from_before_the_renaming_loads_and_resumes(data_dir, tmp_path, straight):
    """The same step-3 state saved by that code's save_sharded (one process): DCP's index names the
    parameters router.*; load_sharded reads them under their new names, weights and AdamW state."""
    run_dir = tmp_path / "old"
    shutil.copytree(BEFORE_ISSUE35, run_dir, ignore=shutil.ignore_patterns("README.md", "ckpt.pt"))  # ckpt/ alone
    whole = load_checkpoint(BEFORE_ISSUE35 / "ckpt.pt")
    gathered = whole_checkpoint(run_dir / "ckpt")
    assert gathered["model"].keys() == {renamed(k) for k in whole["model"]}
    assert all(torch.equal(v, gathered["model"][renamed(k)]) for k, v in whole["model"].items())
    run(data_dir, tmp_path, "--run_name=old", "--resume=true")
    same_training(run_dir, straight)
