"""The fast paths: torch.compile traces every variant whole, and the benchmark runs end to end."""

import json

import pytest
import torch

import bench
from model import GPT, GPTConfig

FAMILIES = [
    dict(residual="standard"),
    dict(residual="full_attnres"),
    dict(residual="rd_attnres"),
    dict(residual="dar"),
    dict(residual="hc"),
    dict(residual="mhc"),
]


def tiny(**kw):
    return GPT(GPTConfig(vocab_size=61, block_size=16, n_layer=2, n_head=2, n_embd=32, **kw), seed=0)


def step(model, compiled, idx):
    model.zero_grad()
    loss = compiled(idx, idx.roll(-1, 1))[1]
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def randomized(model):
    with torch.no_grad():
        for p in model.router.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    return model


def assert_compiled_equals_eager(variant, backend):
    torch._dynamo.reset()
    model = randomized(tiny(**variant))
    idx = torch.randint(0, 61, (2, 16), generator=torch.Generator().manual_seed(0))
    loss_c, grads_c = step(model, torch.compile(model, fullgraph=True, backend=backend), idx)
    loss_e, grads_e = step(model, model, idx)
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-5, atol=1e-6)
    assert grads_c.keys() == grads_e.keys()
    for n in grads_e:
        torch.testing.assert_close(grads_c[n], grads_e[n], rtol=1e-4, atol=1e-6, msg=n)


@pytest.mark.parametrize("variant", FAMILIES, ids=lambda v: v["residual"])
def test_compiles_without_graph_breaks(variant):
    """fullgraph=True: a graph break anywhere (the depth-attention Function included) is an error.
    aot_eager traces forward and backward as inductor does, without generating code."""
    assert_compiled_equals_eager(variant, "aot_eager")


def test_inductor_compiled_model_equals_eager():
    """Inductor itself, on the two-route RD-AttnRes path (about a minute on 2 CPU cores)."""
    assert_compiled_equals_eager(dict(residual="rd_attnres"), "inductor")


def test_benchmark_runs_and_reports_ratios(tmp_path, capsys):
    out = tmp_path / "bench.json"
    results, routing = bench.main(["--variants", "block_attnres,rd_attnres:rd_mode=tied,dar:dar_block_size=1",
                                   "--n_layer", "2", "--n_embd", "32", "--n_head", "2", "--vocab_size", "97",
                                   "--seq_len", "16", "--batch_size", "2", "--repeats", "2", "--warmup", "1",
                                   "--routing_sources", "3", "--out", str(out)])
    assert [r["variant"] for r in results] == ["standard", "block_attnres", "rd_attnres:rd_mode=tied", "dar:dar_block_size=1"]
    assert results[0]["speed_ratio"] == 1.0 and results[0]["memory_ratio"] == 1.0
    assert all(r["tokens_per_s"] > 0 and r["memory_bytes"] > 0 for r in results)
    assert results[1]["params"] > results[0]["params"]  # the pseudo-queries
    assert {(r["impl"], r["pass_"]) for r in routing} == {
        (i, p) for i in ("lean", "reference") for p in ("forward", "forward+backward")}
    saved = json.loads(out.read_text())
    assert saved["steps"][1]["variant"] == "block_attnres" and saved["bandwidth_bytes_per_s"] > 0
    assert "| `block_attnres` |" in capsys.readouterr().out
