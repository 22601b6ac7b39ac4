"""sample.py: cached decoding equals full forward passes for every variant (float64), a batch equals
its samples decoded one at a time, the sampling filters, and the command line on a tiny fake checkpoint."""

import os

import pytest
import torch

import sample
from conftest import F64, randomize_routing, tokens
from conftest import tiny as shared_tiny
from data import get_tokenizer
from model import GPT, RD_MODES, RESIDUALS, GPTConfig, stable_seed
from model_fast import make_model
from sample import Window, filter_logits, generate, main, sample_logits

VARIANTS = [dict(residual=r) for r in RESIDUALS if r != "rd_attnres"]
VARIANTS += [dict(residual="rd_attnres", rd_mode=m) for m in RD_MODES]


def tiny(**kw):
    """3 layers, random routing: a context of 8, so that 20 generated tokens slide the window three or four times."""
    return randomize_routing(shared_tiny(block_size=8, **kw))


def steps(model, prompts, n, **kw):
    """generate's steps as one token list per row."""
    return torch.stack(list(generate(model, prompts, n, **kw)), 1).tolist()


# --- the window and its cache ----------------------------------------------------------------------

def test_window_crops_the_prompt_and_slides_to_half_the_context():
    model = tiny()
    assert Window(model, [list(range(20)), list(range(100, 120))]).tokens.tolist() == \
        [list(range(12, 20)), list(range(112, 120))]
    window = Window(model, [list(range(5)), list(range(100, 105))])
    lengths = []
    for t in range(5, 16):
        window.append(torch.tensor([t, 100 + t]))
        lengths.append(window.tokens.size(1))
    assert lengths == [6, 7, 8, 4, 5, 6, 7, 8, 4, 5, 6]
    assert window.tokens.tolist() == [list(range(10, 16)), list(range(110, 116))]


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(v.values()))
def test_cached_logits_and_greedy_tokens_equal_full_forward_passes(variant):
    model = tiny(**variant)
    seqs = tokens(2, 25).tolist()  # a batch of two rows
    window, slides = Window(model, [s[:5] for s in seqs]), 0
    for t in range(5, 25):  # 20 steps through a context of 8: the window slides four times
        with torch.no_grad():
            full, _ = model(window.tokens)
        torch.testing.assert_close(window.next_logits(), full[:, -1], rtol=0, atol=F64)
        window.append(torch.tensor([s[t] for s in seqs]))
        slides += window.cache is None
    assert slides == 4
    prompts = tokens(2, 3).tolist()
    assert steps(model, prompts, 20, temperature=0) == steps(model, prompts, 20, temperature=0, use_cache=False)


# --- batches -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", [dict(residual="standard"), dict(residual="rd_attnres"), dict(residual="dar"),
                                     dict(residual="mhc", hc_streams=2)], ids=lambda v: v["residual"])
def test_a_batch_equals_its_rows_decoded_one_at_a_time(variant):
    """Greedy, three prompts of one length: 20 tokens through a context of 8 slide the window four times. Seeded, four
    samples of one prompt, each its own random stream. A batch is one forward pass per token, with or without the cache
    (a slide replaces a step's forward)."""
    model, calls = tiny(**variant), []
    model.register_forward_pre_hook(lambda module, args: calls.append(args[0].size(0)))
    prompts = tokens(3, 5).tolist()
    alone = [steps(model, [p], 20, temperature=0)[0] for p in prompts]
    assert len({tuple(row) for row in alone}) == 3  # the rows differ: a batch that mixed them would show
    for use_cache in (True, False):
        calls.clear()
        assert steps(model, prompts, 20, temperature=0, use_cache=use_cache) == alone and calls == [3] * 20

    def draw(seed, rows, use_cache=True):
        gens = [torch.Generator().manual_seed(stable_seed(seed, i)) for i in rows]
        return steps(model, [prompts[0]] * len(gens), 20, temperature=1.0, top_k=20, top_p=0.9,
                     generators=gens, use_cache=use_cache)

    calls.clear()
    batch = draw(5, range(4))
    assert len({tuple(row) for row in batch}) == 4 and calls == [4] * 20  # each sample its own random stream
    assert batch == [draw(5, [i])[0] for i in range(4)]
    calls.clear()
    assert draw(5, range(4), use_cache=False) == batch and calls == [4] * 20
    assert draw(6, range(4)) != batch


def test_sample_seeds_are_stable_and_distinct():
    assert stable_seed(0, 0) == 3056769172604291498  # pinned: changing it changes every seeded sample
    seeds = {stable_seed(s, i) for s in range(-3, 20) for i in range(20)}
    assert len(seeds) == 23 * 20 and all(0 <= x < 2 ** 63 for x in seeds)


# --- sampling ----------------------------------------------------------------------------------------

PROBS = torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15], dtype=torch.float64)


@pytest.mark.parametrize("top_k, top_p, kept", [
    (None, None, {0, 1, 2, 3, 4}),
    (2, None, {1, 3}),
    (9, None, {0, 1, 2, 3, 4}),  # k past the vocabulary keeps everything
    (None, 1.0, {0, 1, 2, 3, 4}),
    (None, 0.6, {1, 3}),  # 0.4 + 0.3 reaches 0.6
    (None, 0.75, {1, 3, 4}),  # 0.4 + 0.3 does not reach 0.75; + 0.15 does
    (None, 0.2, {1}),  # the most likely token alone already reaches it
    (3, 0.45, {1}),  # after top_k: 0.4 / 0.85 = 0.47 reaches 0.45 (without top_k, 3 would stay)
])
def test_filter_keeps_exactly_the_top_k_and_the_nucleus(top_k, top_p, kept):
    logits = PROBS.log()
    out = filter_logits(logits, top_k, top_p)
    assert {i for i in range(5) if out[i] > float("-inf")} == kept
    assert all(out[i] == logits[i] for i in kept)


def test_samples_follow_the_filtered_distribution_and_generate_draws_only_below_vocab_size():
    logits, g = PROBS.log().expand(4000, 5), torch.Generator().manual_seed(0)
    assert sample_logits(logits, temperature=0).tolist() == [1] * 4000
    draws = sample_logits(logits, 1.0, top_k=2, generators=[g] * 4000)
    assert set(draws.tolist()) == {1, 3}
    assert abs((draws == 1).double().mean().item() - 0.4 / 0.7) < 0.03
    assert max(steps(tiny(), tokens(1, 3).tolist(), 50, generators=[g], vocab_size=7)[0]) < 7


# --- the command line ---------------------------------------------------------------------------------

CONFIG = dict(vocab_size=260, block_size=16, n_layer=2, n_head=2, n_embd=32, residual="rd_attnres")


def save_checkpoint(path, model):
    torch.save({"model_config": CONFIG, "model": model.state_dict(), "tokenizer": "byte", "step": 0}, path)


@pytest.fixture
def run_dir(tmp_path):
    save_checkpoint(tmp_path / "ckpt.pt", randomize_routing(make_model(GPTConfig(**CONFIG))))
    return tmp_path


def cli(capsys, *args):
    """sample.py's (exit status, stdout, stderr)."""
    return main([str(a) for a in args]), *capsys.readouterr()


def test_cli_greedy_text_is_the_same_without_the_cache_and_at_a_vanishing_top_p_or_temperature(run_dir, capsys):
    """--top_p 1e-50 is 0 in float32, which every token's probability before it reaches (the first's is 0): all were
    masked, the draw was NaN, a traceback; the most likely token always stays. A temperature whose 1 / t overflows
    float32 (or that rounds to 0): the argmax, not NaN."""
    args = ("--ckpt", run_dir, "--prompt", "To be, or", "--max_new_tokens", 40)
    rc, cached, err = cli(capsys, *args, "--temperature", 0)
    assert rc == 0 and cached.startswith("To be, or") and "kv cache" in err
    rc, full, err = cli(capsys, *args, "--temperature", 0, "--no_cache")
    assert rc == 0 and full == cached and "no cache" in err
    for vanishing in (["--top_p", 1e-50], ["--temperature", "1e-46"], ["--temperature", "1e-45"], ["--temperature", "1e-30"]):
        rc, out, err = cli(capsys, *args, *vanishing)
        assert (rc, out) == (0, cached), err
    logits = torch.tensor([[1.0, 3.0, -2.0], [0.5, -1.0, 0.25]])
    assert sample_logits(logits, 1e-45).tolist() == [1, 0] and sample_logits(logits, 1e-46).tolist() == [1, 0]


def test_cli_a_fixed_seed_reproduces_the_samples_whatever_the_batch(run_dir, capsys, monkeypatch):
    """--num_samples 1000000 once took all of a machine's memory as one batch; the samples now go in batches of
    --batch_size (default DEFAULT_BATCH_SIZE), each sample with its own seed as before."""
    real, batches = sample.generate, []
    monkeypatch.setattr(sample, "generate", lambda model, prompts, *a, **kw: batches.append(len(prompts))
                        or real(model, prompts, *a, **kw))
    args = ("--ckpt", run_dir / "ckpt.pt", "--max_new_tokens", 30, "--top_k", 50, "--top_p", 0.9)
    rc, three, err = cli(capsys, *args, "--seed", 7, "--num_samples", 3)
    samples = three.split("-" * 40 + "\n")
    assert rc == 0 and len(samples) == 3 and len(set(samples)) == 3
    assert "3 samples in one batch" in err and "tokens/s" in err
    assert cli(capsys, *args, "--seed", 7, "--num_samples", 3)[1] == three
    assert cli(capsys, *args, "--seed", 7, "--num_samples", 2)[1] == ("-" * 40 + "\n").join(samples[:2])
    assert cli(capsys, *args, "--seed", 7)[1] == samples[0]
    assert cli(capsys, *args, "--seed", 8, "--num_samples", 3)[1] != three
    args = ("--ckpt", run_dir, "--max_new_tokens", 6, "--num_samples", 10, "--seed", 3)
    batches.clear()
    rc, one_batch, err = cli(capsys, *args, "--batch_size", 10)
    assert rc == 0 and batches == [10] and "10 samples in one batch" in err
    batches.clear()
    rc, out, err = cli(capsys, *args, "--batch_size", 4)
    assert rc == 0 and batches == [4, 4, 2] and "10 samples in batches of 4" in err
    assert out == one_batch and len(out.split("-" * 40 + "\n")) == 10  # the same samples, separated alike
    batches.clear()
    monkeypatch.setattr(sample, "DEFAULT_BATCH_SIZE", 3)  # the default bounds the batch too
    rc, out, err = cli(capsys, *args)
    assert rc == 0 and batches == [3, 3, 3, 1] and out == one_batch


def test_cli_crops_a_long_prompt_with_a_warning(run_dir, tmp_path, capsys):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("x" * 40)
    rc, out, err = cli(capsys, "--ckpt", run_dir, "--prompt_file", prompt, "--max_new_tokens", 5)
    assert rc == 0 and out.startswith("x" * 40)
    assert "warning: the prompt has 40 tokens" in err and "its last 16" in err


@torch.no_grad()
def test_cli_a_sample_ends_at_end_of_text(tmp_path, capsys, monkeypatch):
    model = make_model(GPTConfig(**CONFIG))
    for p in model.parameters():
        p.zero_()
    model.wte.weight.fill_(1.0)  # sublayer outputs are zero: the final state is the embedding
    model.lm_head.weight[get_tokenizer("byte").eot] = 1.0  # whose only positive logit is EOT
    save_checkpoint(tmp_path / "ckpt.pt", model)
    rc, out, err = cli(capsys, "--ckpt", tmp_path, "--prompt", "hi", "--temperature", 0)
    assert rc == 0 and out == "hi\n" and err.startswith("1 tokens")
    forward, calls = GPT.forward, []
    monkeypatch.setattr(GPT, "forward", lambda *a, **kw: calls.append(1) or forward(*a, **kw))
    rc, out, err = cli(capsys, "--ckpt", tmp_path, "--prompt", "hi", "--num_samples", 2)
    assert rc == 0 and out == "hi\n" + "-" * 40 + "\nhi\n"
    assert err.startswith("2 tokens") and len(calls) == 1  # decoding stops once every sample has ended


@pytest.mark.parametrize("args, match", [
    (["--ckpt", "{dir}/nowhere"], "no checkpoint at"),
    (["--ckpt", "{dir}/junk.pt"], "is not a readable checkpoint"),
    (["--ckpt", "{dir}/untagged.pt"], "is not a train.py checkpoint"),
    (["--top_k", 0], "--top_k must be at least 1"),
    (["--top_p", 0], "--top_p must be in (0, 1]"),
    (["--top_p", 1.5], "--top_p must be in (0, 1]"),
    (["--temperature", "inf"], "--temperature must be a finite number >= 0"),
    (["--batch_size", 0], "--batch_size must be at least 1"),
    (["--prompt_file", "{dir}/latin1.txt"], "not UTF-8"),
    (["--prompt_file", "{dir}"], "cannot read the prompt file"),
])
def test_cli_bad_input_gives_one_clear_error(args, match, run_dir, capsys):
    (run_dir / "junk.pt").write_bytes(b"this is not a checkpoint")
    torch.save({"model": {}}, run_dir / "untagged.pt")
    (run_dir / "latin1.txt").write_bytes("café".encode("latin-1"))
    rc, out, err = cli(capsys, "--ckpt", run_dir, *(str(a).format(dir=run_dir) for a in args))  # (the last --ckpt counts)
    assert rc == 2 and out == ""
    assert err.startswith("error: ") and match in err and "Traceback" not in err


def test_a_prompt_byte_that_is_not_utf8_reaches_a_byte_model_as_given(run_dir, capsys):
    """A command line's bytes arrive as surrogate escapes: a byte-level model reads them as the bytes they were."""
    rc, out, err = cli(capsys, "--ckpt", run_dir, "--prompt", os.fsdecode(b"ROMEO\xff:"), "--max_new_tokens", 2,
                       "--temperature", 0)
    assert rc == 0 and "Traceback" not in err
    assert get_tokenizer("byte").encode(os.fsdecode(b"ROMEO\xff:")) == list(b"ROMEO\xff:")

