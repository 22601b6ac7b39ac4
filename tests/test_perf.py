"""The fast paths: torch.compile traces every variant whole and agrees with eager, also under bf16
autocast and without gradients; the benchmark runs end to end."""

import json

import pytest
import torch
import torch._dynamo

from common import cli
from conftest import randomize_routing, tiny, tokens
from model_fast import compile_model
from tools import bench

FAMILIES = [  # 2 layers; 1 where every layer runs the same ops and nothing is read across layers (less to trace)
    dict(residual="standard", n_layer=1),
    dict(residual="full_attnres"),
    dict(residual="block_attnres", attnres_block_size=3),
    dict(residual="rd_attnres"),
    dict(residual="dar"),
    dict(residual="dar", dar_block_size=1, dar_routing="fixed_kv"),
    dict(residual="hc", n_layer=1),
    dict(residual="mhc", n_layer=1),
    dict(residual="denseformer", denseformer_dilation=2),
    dict(residual="muddformer"),
    dict(residual="delta_attnres", delta_block_size=3),
]
IDS = ["-".join(map(str, v.values())) for v in FAMILIES]
FAST_FUNCTIONS = pytest.mark.parametrize("variant", [dict(residual="rd_attnres"), dict(residual="dar", dar_block_size=1)],
                                         ids=["rd_attnres", "dar"])  # the families the fast path's custom Functions carry


def randomized(**kw):
    """conftest's tiny model in float32, 2 layers of 16 tokens, its routing randomized."""
    return randomize_routing(tiny(dtype=torch.float32, **{"block_size": 16, "n_layer": 2, **kw}), scale=0.3, add=True)


IDX = tokens(T=16)


def step(model, fn, autocast):
    model.zero_grad()
    with autocast:
        loss = fn(IDX, IDX.roll(-1, 1))[1]
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


# Compiled against eager, the same traced graph: decompositions (rms_norm into pow, mean and rsqrt; fused adds)
# reorder float32 sums of up to d = 32 terms, 32 u = 2e-6 relative; rtol 1e-5 is 5x that, atol 1e-6 the same for
# entries near 0. Under bf16 autocast the bf16 ops are the same ops in the same dtype, so the same bound holds.
def assert_compiled_equals_eager(model, compiled, autocast):
    loss_c, grads_c = step(model, compiled, autocast)
    loss_e, grads_e = step(model, model, autocast)
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-5, atol=1e-6)
    assert grads_c.keys() == grads_e.keys()
    for n in grads_e:
        torch.testing.assert_close(grads_c[n], grads_e[n], rtol=1e-5, atol=1e-6, msg=n)


@pytest.fixture
def plain_compile():
    """torch.compile as a user calls it: the backward traced under the forward's autocast (AOTAutograd's default)."""
    with torch._functorch.config.patch(backward_pass_autocast="same_as_forward"):
        yield lambda model, **kw: torch.compile(model, fullgraph=True, dynamic=False, **kw)


@pytest.mark.slow
@pytest.mark.parametrize("variant", FAMILIES, ids=IDS)
def test_compiled_equals_eager_in_training_and_evaluation(variant):
    """compile_model (train.py's and bench's), fullgraph: a graph break fails; aot_eager traces as inductor does. Its
    backward runs outside autocast as eager's, so bf16 training equals eager; also under no_grad and inference_mode."""
    torch._dynamo.reset()
    model = randomized(**variant)
    compiled = compile_model(model, fullgraph=True, backend="aot_eager")
    assert_compiled_equals_eager(model, compiled, torch.autocast("cpu", dtype=torch.bfloat16))
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            torch.testing.assert_close(compiled(IDX)[0], model(IDX)[0], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@FAST_FUNCTIONS
def test_the_fast_functions_hold_under_plain_compile(variant, plain_compile):
    """A plain torch.compile traces the backward under the forward's autocast: the fast path's custom Functions
    turn autocast off themselves, so the families they carry still equal eager exactly."""
    torch._dynamo.reset()
    model = randomized(**variant)
    compiled = plain_compile(model, backend="aot_eager")
    assert_compiled_equals_eager(model, compiled, torch.autocast("cpu", dtype=torch.bfloat16))


@pytest.mark.slow
@pytest.mark.xdist_group("inductor")  # with test_norm_project's: one process pays inductor's first-use warm-up
@FAST_FUNCTIONS
def test_inductor_under_bf16_autocast_equals_eager(variant, plain_compile):
    """Inductor under bf16 autocast (~25 s each): it keeps float32 where eager rounds to bf16 between ops, so the
    gradients agree to bf16 precision (3% of each tensor's largest entry); aot_eager above checks them exactly."""
    torch._dynamo.reset()
    model = randomized(n_layer=1, **variant)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16)
    (loss_c, grads_c), (loss_e, grads_e) = step(model, plain_compile(model), autocast), step(model, model, autocast)
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-2, atol=0)  # 2-3 bf16 u (3.9e-3): one rounding fewer a sublayer
    assert grads_c.keys() == grads_e.keys()
    for n in grads_e:
        assert (grads_c[n] - grads_e[n]).abs().max() <= 0.03 * grads_e[n].abs().max(), n  # 8 bf16 u of the largest


@pytest.mark.slow
def test_activation_checkpointing_compiles_whole_and_equals_eager():
    """fullgraph traces each checkpointed sublayer as one region and equals eager under bf16 autocast; eager with
    checkpointing equals eager without (the loss bit for bit, the gradients to bf16 rounding)."""
    torch._dynamo.reset()
    model = randomized(residual="rd_attnres", activation_checkpointing=True)
    ops = []

    def backend(graph, example_inputs):
        ops.extend(node.target for node in graph.graph.nodes if node.op == "call_function")
        return torch._dynamo.lookup_backend("aot_eager")(graph, example_inputs)

    autocast = torch.autocast("cpu", dtype=torch.bfloat16)
    assert_compiled_equals_eager(model, compile_model(model, fullgraph=True, backend=backend), autocast)
    assert ops.count(torch.ops.higher_order.tag_activation_checkpoint) == 2 * model.cfg.n_layer
    plain = randomized(residual="rd_attnres")
    (loss_p, grads_p), (loss_c, grads_c) = step(plain, plain, autocast), step(model, model, autocast)
    assert torch.equal(loss_c, loss_p) and grads_c.keys() == grads_p.keys()
    for n in grads_p:
        # bf16 matmul outputs (u = 2^-8) summed in float32: the graphs may round an entry apart by one ulp of the
        # tensor's scale, 2u * max|g|; a wrong recomputation (another input, a missed sublayer) is off by |g| itself
        bound = 2 * 2.0**-8 * grads_p[n].abs().max()
        assert (grads_c[n] - grads_p[n]).abs().max() <= bound, n


def run_bench(tmp_path, variants, *extra):
    return bench.main(["--variants", variants, "--n_layer", "2", "--n_embd", "32", "--n_head", "2",
                       "--vocab_size", "97", "--seq_len", "16", "--batch_size", "2", "--repeats", "3",
                       "--warmup", "1", "--out", str(tmp_path / "bench.json"), *extra])


def test_benchmark_runs_and_reports_ratios(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bench.os, "getloadavg", lambda: (9.0, 9.0, 9.0))  # a machine busier than its cores
    results, routing = run_bench(tmp_path, "block_attnres,rd_attnres:rd_mode=tied,dar:dar_block_size=1,"
                                 "standard:activation_checkpointing=true", "--routing_blocks", "3:2")
    assert [r["variant"] for r in results] == ["standard", "block_attnres", "rd_attnres:rd_mode=tied",
                                               "dar:dar_block_size=1", "standard:activation_checkpointing=true"]
    assert results[-1]["memory_ratio"] < 0.8  # the sublayers' internals are recomputed, not saved
    assert results[0]["speed_ratio"] == 1.0 and results[0]["memory_ratio"] == 1.0
    assert all(r["tokens_per_s"] > 0 and r["saved_activation_bytes"] > 0 for r in results)
    assert all(lo <= r["speed_ratio"] <= hi for r in results for lo, hi in [r["speed_ratio_quartiles"]])
    assert results[1]["params"] > results[0]["params"]  # the pseudo-queries
    assert {(r["impl"], r["pass_"]) for r in routing} == {
        (i, p) for i in ("TwoPhaseRouter", "ReferenceRouter") for p in ("forward", "forward+backward")}
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert saved["steps"][1]["variant"] == "block_attnres" and saved["bandwidth_bytes_per_s"] > 0
    assert saved["load"]["load_1min"] == 9.0 and saved["load"]["cores"] >= 1  # recorded beside the figures
    out, err = capsys.readouterr()
    assert "| `block_attnres` |" in out and "busier than its cores" in err


@pytest.mark.slow
def test_compiled_benchmark_compiles_every_variant(tmp_path):
    """Each model's forward is a recompile of one code object: past the limit (1 here) Dynamo would run the rest
    eagerly; bench.py raises the limit to fit its variants and makes a hit an error."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    # config.patch, not monkeypatch: monkeypatch's undo deletes the key, which hides it from every later compile
    with torch._dynamo.config.patch(recompile_limit=1, fail_on_recompile_limit_hit=False):
        run_bench(tmp_path, "block_attnres,hc", "--compile", "--compile_backend", "eager", "--routing_blocks", "")
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 3  # standard, block_attnres, hc


def test_variant_specs_parse_every_field_type():
    args = bench.argparse.Namespace(vocab_size=97, seq_len=16, n_layer=3, n_head=2, n_embd=32)
    c = bench.variant_config("denseformer:denseformer_dilation=2:denseformer_period=3", args)
    assert (c.residual, c.denseformer_dilation, c.denseformer_period, c.n_layer) == ("denseformer", 2, 3, 3)
    c = bench.variant_config("dar:dar_include_partial=false:dar_routing=self_kv", args)
    assert (c.dar_include_partial, c.dar_routing) == (False, "self_kv")


# --- bench.py, reliability round three: bad input is one line, before any compute ---------------------

@pytest.mark.parametrize("args, message", [
    (["--variants", "standard,nosuch"], "--variants nosuch: unknown residual 'nosuch'; choose one of standard, "),
    (["--variants", "rd_attnres:rd_mod=tied"], "did you mean rd_mode"),
    (["--variants", "rd_attnres:rd_mode"], "--variants rd_attnres:rd_mode: 'rd_mode' is not key=value"),
    (["--variants", "dar:dar_block_size=two"], "--variants dar:dar_block_size=two: dar_block_size expects int"),
    (["--variants", "standard:activation_checkpointing=yes"], "activation_checkpointing expects true/false"),
    (["--variants", "standard:n_layer=4"], "n_layer is set for every variant by bench's flags"),
    (["--n_layer", "0"], "--n_layer must be at least 1, got 0"),
    (["--n_embd", "30", "--n_head", "4"], "n_embd=30 / n_head=4 must be a whole, even head dim"),
    (["--device", "cuda"], "--device cuda: no CUDA device is available"),
    (["--device", "tpu"], "--device tpu is not a device: use auto, cpu, cuda or cuda:N"),
    (["--repeats", "0"], "--repeats must be at least 1, got 0"),
    (["--warmup", "-1"], "--warmup must be at least 0, got -1"),
    (["--routing_blocks", "4:4,8"], "--routing_blocks: each block is sources:sites, both at least 1"),
    (["--out", "{tmp}"], "--out {tmp} is a directory: pass the JSON file to write"),
    (["--out", "{tmp}/missing/bench.json"], "cannot write {tmp}/missing/bench.json: no such file or directory"),
], ids=["residual", "key_typo", "no_value", "not_int", "not_bool", "shape_key", "n_layer", "heads", "cuda", "tpu",
        "repeats", "warmup", "routing_blocks", "out_dir", "out_missing_dir"])
def test_bench_bad_input_is_one_line_before_any_compute(args, message, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(bench, "Runner", None)  # never reached: no model built, no step run
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    status = cli(bench.main, ["--out", str(tmp_path / "bench.json"), *args])
    err = capsys.readouterr().err
    assert status == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert message.replace("{tmp}", str(tmp_path)) in err, err
    assert list(tmp_path.iterdir()) == []
