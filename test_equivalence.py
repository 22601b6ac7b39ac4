"""Exact reductions between residual variants (float64), and the model's other contracts."""

import hashlib
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import model as model_module
import model_fast
from conftest import BF16_PATHS, F64, F64_EPS, F64_OP, bf16_routing_error, randomize_routing, tiny, tokens, unlearned
from model import RESIDUALS, AttnRes, DualAttnRes, GPTConfig, MUDDFormer, depth_attention, norm
from model_fast import make_model, norm_project
from sample import KVCache
from tools import bench

# Every registered variant at its defaults, then the options that change what a variant computes
VARIANTS = [dict(residual=r) for r in RESIDUALS] + [
    *[dict(residual="rd_attnres", rd_mode=m) for m in ("tied", "average", "frozen_v")],
    *[dict(residual="dar", dar_routing=r) for r in ("self_kv", "cross_v", "fixed_kv", "sep_v")],
    dict(residual="dar", dar_block_size=1),
    dict(residual="dar", dar_include_partial=False),
    dict(residual="mhc", hc_streams=2),
    dict(residual="denseformer", denseformer_dilation=2, denseformer_period=2),  # one DWA, after layer 2 of 3
    dict(residual="delta_attnres", delta_block_size=4),
]
IDS = ["-".join(map(str, v.values())) for v in VARIANTS]
ATTNRES = [v for v in VARIANTS if issubclass(RESIDUALS[v["residual"]], AttnRes)]  # the family, by class
UNIFORM_AT_ZERO = [v for v in ATTNRES if RESIDUALS[v["residual"]].uniform_at_zero_queries]
DAR = [v for v in VARIANTS if issubclass(RESIDUALS[v["residual"]], DualAttnRes)]
# Parameters whose gradient is zero at init by construction, not by accident (docs/adding_a_variant.md):
#   hc: s * tanh(RMSNorm(H) W) with W = 0 (the paper's init) gives the scales s no gradient, and its streams start equal
#   (B = 1, Ar = I), so dL/dAm_i = g . H_i = g . h = 0: h feeds a scale-invariant norm, whose gradient is orthogonal to h;
#   dar fixed_kv: both targets read the same keys and values, so r_0 = r_1 while their queries are equal (zero at init)
#   and the fusion gate alpha gets none; muddformer: W1 sits behind W2 = 0 (the reference's init), so W1 gets none.
# Each entry is a tuple of parameter-name prefixes, or a predicate on the name.
ZERO_GRAD_AT_INIT = {"hc": ("residual.s_alpha", "residual.s_beta", "residual.Am"), "fixed_kv": ("residual.theta_alpha",),
                     "muddformer": ("residual.W1.",)}


def loss_and_grads(model, idx):
    model.zero_grad()
    logits, loss = model(idx, idx.roll(-1, 1))
    loss.backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_grads_equal(ga, gb, names=None, atol=F64):
    for n in names if names is not None else ga.keys() & gb.keys():
        torch.testing.assert_close(ga[n], gb[n], rtol=0, atol=atol, msg=f"gradient of {n}")


# --- 1. reductions: at init, and between the AttnRes variants -------------------------------------------

DENSE_KP = [(1, 1), (2, 1), (1, 2), (2, 2), (3, 1), (3, 3)]  # 3 layers: p = 2 leaves the last one without a DWA
AT_INIT_STANDARD = [*[(v, F64_EPS) for v in UNIFORM_AT_ZERO], (dict(residual="hc"), F64_EPS),
                    (dict(residual="delta_attnres"), F64_EPS), (dict(residual="muddformer"), 0),
                    *[(dict(residual="denseformer", denseformer_dilation=k, denseformer_period=p), 0) for k, p in DENSE_KP]]


@pytest.mark.parametrize("variant, atol", AT_INIT_STANDARD, ids=["-".join(map(str, v.values())) for v, _ in AT_INIT_STANDARD])
def test_at_init_equals_standard(variant, atol):
    """At init the AttnRes family (zero queries), HC and Delta AttnRes (S = 1: h_j = h~_j + h~_j / (j + 1)) are the
    standard residual up to the norms' eps; DenseFormer and MUDDFormer exactly (0 * X_j + .. + 1 * X_i = X_i)."""
    idx = tokens()
    torch.testing.assert_close(tiny(**variant)(idx)[0], tiny(residual="standard")(idx)[0], rtol=0, atol=atol)


@pytest.mark.parametrize("a, b", [(dict(residual="full_attnres"), dict(residual="block_attnres", attnres_block_size=1)),
                                  (dict(residual="block_attnres"), dict(residual="rd_attnres", rd_mode="tied"))],
                         ids=["block_size_one_is_full_attnres", "rd_tied_is_block_attnres"])
def test_same_function(a, b):
    """Two variants with the same random routing parameters: same logits, same gradient everywhere."""
    idx, a, b = tokens(), randomize_routing(tiny(**a)), randomize_routing(tiny(**b))
    (la, ga), (lb, gb) = loss_and_grads(a, idx), loss_and_grads(b, idx)
    torch.testing.assert_close(la, lb, rtol=0, atol=F64)
    assert ga.keys() == gb.keys()
    assert_grads_equal(ga, gb)


@pytest.mark.parametrize("mode, move_apart", [("decoupled", lambda w: w.add_(0.5)), ("average", lambda w: w.mul_(-1.0))])
def test_rd_with_value_queries_copied_from_qk_is_block_attnres(mode, move_apart):
    """w_V = the attention sublayer's w_QK: decoupled and average are Block AttnRes; w_V moved apart, they are not."""
    idx, block = tokens(), randomize_routing(tiny(residual="block_attnres"))
    rd = randomize_routing(tiny(residual="rd_attnres", rd_mode=mode))
    with torch.no_grad():
        rd.residual.w_v.copy_(rd.residual.w[0:-1:2])
    torch.testing.assert_close(rd(idx)[0], block(idx)[0], rtol=0, atol=F64)
    with torch.no_grad():
        move_apart(rd.residual.w_v)
    assert (rd(idx)[0] - block(idx)[0]).abs().max() > 1e-4  # the V route matters


def test_rd_frozen_v_stays_zero_without_gradient():
    model = randomize_routing(tiny(residual="rd_attnres", rd_mode="frozen_v"))
    with torch.no_grad():
        model.residual.w_v.zero_()
    opt = torch.optim.AdamW(model.param_groups(0.1), lr=1e-2)
    for step in range(2):
        loss_and_grads(model, tokens(seed=step))
        opt.step()
    assert not model.residual.w_v.requires_grad and model.residual.w_v.grad is None
    assert torch.count_nonzero(model.residual.w_v) == 0
    assert all(model.residual.w_v is not p for g in model.param_groups(0.1) for p in g["params"])


# --- 2. parameter count --------------------------------------------------------------------------

def test_rd_adds_one_vector_per_layer_and_delta_one_per_sublayer():
    block = tiny(residual="block_attnres").num_params()
    assert tiny(residual="rd_attnres", rd_mode="tied").num_params() == block
    for mode in ("decoupled", "average", "frozen_v"):
        assert tiny(residual="rd_attnres", rd_mode=mode).num_params() == block + 3 * 32  # n_layer * n_embd
    assert tiny(residual="rd_attnres", rd_mode="frozen_v").num_params(trainable_only=True) == block
    assert tiny(residual="delta_attnres").num_params() == tiny().num_params() + 2 * 3 * 32


# --- 3. paired init -------------------------------------------------------------------------------

def test_paired_init_shares_every_common_weight():
    models = [tiny(seed=7, dtype=torch.float32, **v) for v in VARIANTS]
    ref = dict(models[0].named_parameters())
    for m in (dict(m.named_parameters()) for m in models[1:]):
        assert [n for n, p in ref.items() if n not in m or not torch.equal(m[n], p)] == []
    other = dict(tiny(seed=8, dtype=torch.float32).named_parameters())
    assert all(not torch.equal(other[n], p) for n, p in ref.items())


# The first 16 hex digits of sha256 over every parameter's name and float32 bytes, as the code before
# the residual module's renaming (GPT.router -> GPT.residual, issue 35) drew them, the names mapped
INITIAL_WEIGHTS_SHA256 = {  # residual: (seed 0, seed 1)
    "standard": ("ffadb8e982a8402c", "42ac93a0744045dc"),
    "full_attnres": ("af6859043fdaca09", "3a51ff7b4a9ac8fa"),
    "block_attnres": ("af6859043fdaca09", "3a51ff7b4a9ac8fa"),
    "rd_attnres": ("2c2ece084c1ae155", "03d1df2eb35eccd9"),
    "dar": ("b9b9ac6dc4a034f0", "d71b9d6db7ae9d89"),
    "hc": ("a5e4289f725e4762", "27f80099ff77f778"),
    "mhc": ("4e379d2754b15a67", "ff3950776dfcaef2"),
    "denseformer": ("5e29b07e70db9924", "2337fb9d6fc4953a"),
    "muddformer": ("cd37ca131e8c4d9e", "1ccffba94f14f9f5"),
    "delta_attnres": ("cf0147f9b254d65f", "755eb9b342626140"),
}


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("residual", INITIAL_WEIGHTS_SHA256)
def test_initial_weights_are_the_same_bits_as_before(residual, seed):
    m = make_model(GPTConfig(vocab_size=61, block_size=16, n_layer=4, n_head=2, n_embd=32, residual=residual), seed=seed)
    h = hashlib.sha256()
    for n, p in m.named_parameters():
        h.update(n.encode())
        h.update(p.detach().numpy().tobytes())
    assert h.hexdigest()[:16] == INITIAL_WEIGHTS_SHA256[residual][seed]


# --- 4. causality, and the key/value cache (incremental decoding) ----------------------------------------

@pytest.mark.parametrize("variant", VARIANTS, ids=IDS)
def test_causal_and_the_kv_cache_matches_full_forward(variant):
    model, idx = randomize_routing(tiny(**variant)), tokens(B=2, T=12)
    full, _ = model(idx)
    changed = idx.clone()
    changed[:, 6] = (idx[:, 6] + 1) % 61  # a token changes its own logits and later ones, no earlier one
    after = model(changed)[0]
    torch.testing.assert_close(after[:, :6], full[:, :6], rtol=0, atol=0)
    assert (after[:, 6] - full[:, 6]).abs().max() > 0
    cache = KVCache(model.cfg, batch_size=2, dtype=torch.float64)
    steps = [model(idx[:, :5], kv_cache=cache)[0]]  # prefill 5, then one token at a time
    steps += [model(idx[:, t:t + 1], kv_cache=cache)[0] for t in range(5, 12)]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=0, atol=F64)


# --- 5. at init: the first sublayer reads the embedding, the loss is log(vocab), every parameter learns -----

@pytest.mark.parametrize("variant", VARIANTS, ids=IDS)
def test_first_input_is_embedding_and_all_params_get_grads(variant):
    """AttnRes-family sublayer 0 reads x0 itself; the multi-stream variants a multiple of it (mhc's one-hot-ish
    read, dar's two gates summing to 1), delta_attnres x0 + x0: the pre-norm makes them x0 again."""
    model = tiny(**variant)
    assert abs(model(tokens(B=4, T=16), tokens(B=4, T=16, seed=1))[1].item() - math.log(61)) < 0.05  # step 0's loss
    seen = []
    model.blocks[0].attn.register_forward_pre_hook(lambda mod, args: seen.append(args[0]))
    idx = tokens()
    loss_and_grads(model, idx)
    h0 = seen[0] if not isinstance(seen[0], tuple) else seen[0][0]
    x0 = model.wte(idx)
    if variant["residual"] in ("dar", "mhc", "delta_attnres"):
        # RMSNorm(c x0) against RMSNorm(x0), c = 2 (delta) or 1 up to rounding: the eps term of F64_EPS, one norm deep
        eps_effect = 1e-11 if variant["residual"] == "delta_attnres" else 1e-12  # 2 x0: the norm's eps counts half
        torch.testing.assert_close(norm(h0), norm(x0), rtol=0, atol=eps_effect)
    else:
        assert torch.equal(h0, x0)
    assert unlearned(model, ZERO_GRAD_AT_INIT.get(variant.get("dar_routing", variant["residual"]), ())) == []


def saved_activation_bytes(model, idx):
    return bench.saved_activation_bytes(lambda: model(idx, idx)[1].backward())


def test_checkpointing_saves_the_sublayer_inputs_and_nothing_inside():
    """A checkpointed sublayer saves its input and nothing of its internals: with the standard residual (its inputs
    are running sums nothing else keeps) each layer adds exactly its two inputs to what is saved for backward."""
    B, T, d = 2, 12, 32
    saved = [saved_activation_bytes(tiny(residual="standard", n_layer=n, activation_checkpointing=True),
                                    tokens(B=B, T=T)) for n in (3, 6)]
    assert saved[1] - saved[0] == 3 * 2 * B * T * d * 8  # 3 more layers of two float64 inputs


# --- 6. activation checkpointing: memory, not math ---------------------------------------------------------

@pytest.mark.parametrize("variant", VARIANTS, ids=IDS)
def test_activation_checkpointing_recomputes_the_sublayers_and_changes_no_gradient(variant, monkeypatch):
    """activation_checkpointing runs every sublayer again in backward, the routing as it is: the same logits and
    gradients bit for bit, less saved. An attention K or V input of its own (RD-AttnRes, MUDDFormer) goes through
    model_fast.norm_project only without it (with it the sublayer is recomputed whole): gradients to float64 rounding."""
    own_input = []
    monkeypatch.setattr(model_fast.FastGPT, "norm_project", staticmethod(lambda h, W: own_input.append(1) or norm_project(h, W)))
    plain, ckpt = randomize_routing(tiny(**variant)), randomize_routing(tiny(activation_checkpointing=True, **variant))
    calls, separate = [], []  # separate: whether an attention got a K or V input of its own
    for block in ckpt.blocks:
        for sublayer in (block.attn, block.mlp):
            sublayer.register_forward_pre_hook(lambda *args: calls.append(1))
    for block in plain.blocks:
        block.attn.register_forward_pre_hook(
            lambda _, args: separate.append(isinstance(args[0], tuple) and any(h is not args[0][0] for h in args[0])))
    idx = tokens()
    (logits_p, grads_p), plain_calls = loss_and_grads(plain, idx), len(own_input)
    logits_c, grads_c = loss_and_grads(ckpt, idx)
    assert len(calls) == 2 * (2 * ckpt.cfg.n_layer)  # each sublayer: forward, then again in backward
    assert torch.equal(logits_c, logits_p) and grads_c.keys() == grads_p.keys()
    assert bool(own_input) == any(separate) and len(own_input) == plain_calls  # checkpointed: no norm_project
    assert_grads_equal(grads_c, grads_p, atol=F64_OP if own_input else 0)
    assert saved_activation_bytes(ckpt, idx) < saved_activation_bytes(plain, idx)
    with torch.no_grad():  # nothing to recompute without gradients
        calls.clear()
        torch.testing.assert_close(ckpt(idx)[0], plain(idx)[0], rtol=0, atol=0)
    assert len(calls) == 2 * ckpt.cfg.n_layer


# --- 7. the multi-stream family: DAR, HC, mHC ------------------------------------------------------------

def test_dar_self_kv_with_saturated_gates_is_block_attnres():
    """alpha = beta = (1, 0), rho = 1 (logits of +-800 saturate exactly in float64): stream 0 is Block AttnRes."""
    idx = tokens()
    block = randomize_routing(tiny(residual="block_attnres", attnres_block_size=2))  # 2 sublayers: one transformer layer
    dar = randomize_routing(tiny(residual="dar", dar_routing="self_kv", dar_block_size=1))
    with torch.no_grad():
        dar.residual.w[:, 0] = block.residual.w
        dar.residual.theta_alpha.copy_(torch.tensor([800.0, -800.0]))
        dar.residual.theta_beta.copy_(torch.tensor([0.0, -800.0]))
        dar.residual.theta_rho.fill_(800.0)
    (la, ga), (lb, gb) = loss_and_grads(block, idx), loss_and_grads(dar, idx)
    torch.testing.assert_close(lb, la, rtol=0, atol=F64)
    shared = [n for n in ga if not n.startswith("residual.")]
    assert_grads_equal(ga, gb, shared)
    torch.testing.assert_close(gb["residual.w"][:, 0], ga["residual.w"], rtol=0, atol=F64)


def test_full_dar_reads_each_stream_through_the_other():
    """Full DAR (dar_block_size=1): one history entry per layer, the attention's write transported (rho) before the
    MLP's joins it, so the streams' entries point different ways and `cross` retrieves unlike `self_kv`."""
    idx = tokens()
    cross = randomize_routing(tiny(residual="dar", dar_block_size=1))
    self_kv = randomize_routing(tiny(residual="dar", dar_block_size=1, dar_routing="self_kv"))  # same shapes, seed: weights
    assert all(torch.equal(p, q) for p, q in zip(cross.parameters(), self_kv.parameters()))
    record = {}
    cross(idx, record=record)
    entry = record["state.1"]  # the first layer's entry, both streams [2, B, T, d]
    assert (norm(entry[0]) - norm(entry[1])).abs().max() > 1e-2
    assert (cross(idx)[0] - self_kv(idx)[0]).abs().max() > 1e-3


def dar_textbook_logits(model, idx):
    """VARIANTS.md section 5 spelled out target by target, stream by stream: what the batched DAR stream must match."""
    R, cfg = model.residual, model.cfg
    key_of, value_of = {"cross": ((1, 0), (0, 1)), "self_kv": ((0, 1), (0, 1)), "cross_v": ((0, 1), (1, 0)),
                        "fixed_kv": ((0, 0), (1, 1)), "sep_v": ((0, 1), (0, 1))}[cfg.dar_routing or "cross"]
    K = 2 * cfg.dar_block_size  # sublayers per history entry
    x0 = model.wte(idx)
    history, P = [[x0], [x0]], [None, None]
    cos, sin = model.cos[:idx.size(1)], model.sin[:idx.size(1)]

    def retrieve(j):
        S = [history[s] + ([P[s]] if cfg.dar_include_partial and P[s] is not None else []) for s in (0, 1)]
        alpha, h = R.theta_alpha[j].softmax(0), 0
        for m in (0, 1):
            logits = torch.stack([norm(k) @ R.w[j, m] for k in S[key_of[m]]])
            r_m = sum(a * v for a, v in zip(logits.softmax(0).unsqueeze(-1), S[value_of[m]]))
            h = h + alpha[m] * (r_m @ R.v_proj[m].T if cfg.dar_routing == "sep_v" else r_m)
        return h

    for j in range(2 * cfg.n_layer):
        if j > 0 and j % K == 0:
            history, P = [history[0] + [P[0]], history[1] + [P[1]]], [None, None]
        block = model.blocks[j // 2]
        y = block.attn(retrieve(j), cos, sin, j // 2) if j % 2 == 0 else block.mlp(retrieve(j))
        beta = 2 * torch.sigmoid(R.theta_beta[j])
        if P[0] is None:
            P = [beta[0] * y, beta[1] * y]
        else:
            rho = torch.sigmoid(R.theta_rho[j])
            P = [rho * P[0] + (1 - rho) * P[1] + beta[0] * y, (1 - rho) * P[0] + rho * P[1] + beta[1] * y]
    history = [history[0] + [P[0]], history[1] + [P[1]]]
    P = [None, None]
    return model.lm_head(norm(retrieve(-1)))


@pytest.mark.parametrize("variant", DAR, ids=lambda v: "-".join(map(str, v.values())))
def test_dar_matches_its_textbook_definition(variant):
    """At init the streams differ (the inits break their symmetry); at random parameters, VARIANTS.md's definition."""
    model, record = tiny(**variant), {}
    model(tokens(), record=record)
    last = record[f"state.{2 * model.cfg.n_layer - 1}"]  # [2, B, T, d]
    assert (last[0] - last[1]).abs().max() > 1e-3 * last.abs().max()
    randomize_routing(model)
    if variant.get("dar_routing") == "sep_v":
        with torch.no_grad():
            model.residual.v_proj.mul_(0.2)  # random projections, at a scale that keeps activations sane
    idx = tokens()
    textbook = dar_textbook_logits(model, idx)
    torch.testing.assert_close(model(idx)[0], textbook, rtol=0, atol=F64)
    plain = tiny(depth_impl="reference", **variant)  # the plain stream too
    plain.load_state_dict(model.state_dict())
    torch.testing.assert_close(plain(idx)[0], textbook, rtol=0, atol=F64)


def targets_swapped(state):
    """DAR's parameters with its two targets relabelled: pseudo-queries w[:, m] and alpha logits theta_alpha[:, m]."""
    return {k: v.flip(1) if k in ("residual.w", "residual.theta_alpha") else v for k, v in state.items()}


@pytest.mark.parametrize("impl", ["two_phase", "reference"])
def test_dar_cross_v_is_cross_with_its_targets_relabelled(impl):
    """Nothing after the alpha fusion knows which target is which: cross_v at P is cross at P with the targets
    swapped, values and gradients (VARIANTS.md, section 5); self_kv, fixed_kv and sep_v are no relabelling of cross."""
    idx, cross = tokens(), randomize_routing(tiny(residual="dar", depth_impl=impl))
    P = {k: v.clone() for k, v in cross.state_dict().items()}
    cross.load_state_dict(targets_swapped(P))
    lc, gc = loss_and_grads(cross, idx)
    for routing in ("cross_v", "self_kv", "fixed_kv", "sep_v"):
        other = tiny(residual="dar", depth_impl=impl, dar_routing=routing)
        other.load_state_dict({**other.state_dict(), **P}, strict=False)  # (sep_v: its v_proj, the identity)
        lo, go = loss_and_grads(other, idx)
        if routing == "cross_v":
            torch.testing.assert_close(lo, lc, rtol=0, atol=F64)
            assert_grads_equal(targets_swapped(go), gc)
        else:
            assert (lo - lc).abs().max() > 1e-4, routing
            cross.load_state_dict(P)  # nor is it cross unswapped
            assert (lo - loss_and_grads(cross, idx)[0]).abs().max() > 1e-4, routing
            cross.load_state_dict(targets_swapped(P))


@pytest.mark.parametrize("streams", [2, 4])
def test_mhc_mixing_matrices_are_doubly_stochastic(streams):
    model = tiny(residual="mhc", hc_streams=streams)
    with torch.no_grad():
        model.residual.a.fill_(0.1)  # ten times the init's dynamic part
    record = {}
    model(tokens(), record=record)
    res = [v for k, v in record.items() if k.endswith("/res")]
    assert len(res) == 2 * model.cfg.n_layer
    for H in res:
        assert (H - torch.eye(streams)).abs().max() > 1e-3  # not trivially the identity
        # not rounding: Sinkhorn-Knopp's 20 iterations end on a column scaling, rows converge to within 1e-5 (section 6)
        torch.testing.assert_close(H.sum(-1), torch.ones(H.shape[:-1], dtype=H.dtype), rtol=0, atol=1e-5)
        torch.testing.assert_close(H.sum(-2), torch.ones(H.shape[:-1], dtype=H.dtype), rtol=0, atol=1e-5)


def test_block_sums_accumulate_in_the_embedding_dtype_under_bf16():
    """Under bf16 autocast y is bf16; a block's partial sum accumulates in x0's dtype (float32), as h = x0 + y_0 + .."""
    model = tiny(residual="block_attnres", dtype=torch.float32)
    x0 = torch.randn(2, 3, 32)
    ys = [torch.randn(2, 3, 32).bfloat16() for _ in range(3)]
    stream = model.residual.start(x0)
    for j, y in enumerate(ys):
        stream.write(j, y)
    assert stream.partial.dtype == torch.float32
    # float32 sums of bf16 values (exact in float32): two roundings of <= u = 6e-8 each; 1e-6 is 8x that
    torch.testing.assert_close(stream.partial, ys[0].float() + ys[1].float() + ys[2].float(), rtol=1e-6, atol=0)


@pytest.mark.parametrize("variant", VARIANTS, ids=IDS)
def test_every_depth_mix_stays_float32_under_bf16_autocast(variant, monkeypatch):
    """The dtype rule: every depth mix in float32 under bf16 autocast (GPT.forward runs the stream in float32_routing).
    Fed the same sublayer outputs, the stream the model runs (its twin, if any) routes them as bf16 under autocast as
    in float32 without: a mix in bf16 (a matmul under autocast, a cast to a source's dtype) is off by a fraction of u."""
    model = randomize_routing(tiny(dtype=torch.float32, **variant), scale=0.3)  # trained-looking, activations sane
    dtypes, error = bf16_routing_error(model, monkeypatch)
    assert dtypes == {torch.float32} and error < BF16_PATHS


class Lockstep:
    """The plain stream and the fast path's fed the same sublayer outputs (of the plain inputs); pairs: (fast, plain)."""

    def __init__(self, plain, fast):
        self.plain, self.fast, self.pairs = plain, fast, []

    def read(self, j):
        self.pairs.append((self.fast.read(j), self.plain.read(j)))
        return self.pairs[-1][1]

    def write(self, j, y):
        self.plain.write(j, y)
        self.fast.write(j, y)

    def readout(self):
        self.pairs.append((self.fast.readout(), self.plain.readout()))
        return self.pairs[-1][1]


@pytest.mark.parametrize("variant", VARIANTS, ids=IDS)
def test_both_paths_route_in_float32_and_agree_under_bf16_autocast(variant, monkeypatch):
    """The dtype rule on both paths, real sublayers under CPU bf16 autocast: fed the same sublayer outputs (lockstep),
    the plain stream and the fast path's give float32 inputs at every site, within BF16_PATHS relative."""
    model = randomize_routing(tiny(dtype=torch.float32, **variant), scale=0.3)  # trained-looking, as above
    lockstep = []
    fast_stream = model.start_stream
    monkeypatch.setattr(model, "start_stream", lambda x0, record=None: lockstep.append(
        Lockstep(model.residual.start(x0), fast_stream(x0))) or lockstep[-1])
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        model(tokens())
    pairs = [pair for fast, plain in lockstep[0].pairs for pair in zip(*[h if isinstance(h, tuple) else (h,)
                                                                          for h in (fast, plain)], strict=True)]
    assert len(pairs) > 2 * model.cfg.n_layer and {h.dtype for pair in pairs for h in pair} == {torch.float32}
    for fast, plain in pairs:
        assert ((fast - plain).norm() / plain.norm()).item() < BF16_PATHS


def test_model_py_alone_builds_and_runs_its_default_model():
    """model.GPT runs the plain streams whatever depth_impl says: GPTConfig's defaults build without model_fast."""
    code = ("import sys, torch, model; cfg = model.GPTConfig(n_layer=2, n_embd=32, n_head=2, vocab_size=61, "
            "block_size=8, residual='block_attnres'); assert cfg.depth_impl == 'two_phase'; "
            "model.GPT(cfg)(torch.zeros(1, 8, dtype=torch.long)); assert 'model_fast' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent, check=True)


def test_mhc_has_no_underflowed_gradients_in_float32():
    model = tiny(residual="mhc", dtype=torch.float32)
    loss_and_grads(model, tokens())
    for n, p in model.residual.named_parameters():
        assert (p.grad != 0).float().mean() > 0.5, f"residual.{n}: most of its gradient is exactly zero"


# --- 8. DenseFormer, MUDDFormer, Delta AttnRes ----------------------------------------------------------

def run_layers(model, idx, after_layer):
    """The per-layer variants' loop (VARIANTS.md section 7): layer i's attention reads `inp` (or a (Q, K, V) tuple), its
    MLP m = base + attn; after_layer(i, X = [x0, X_1, .., X_{i+1}]) gives the next (inp, base); the readout: base."""
    cos, sin = model.cos[:idx.size(1)], model.sin[:idx.size(1)]
    X = [model.wte(idx)]
    inp = base = X[0]
    for i, block in enumerate(model.blocks):
        m = base + block.attn(inp, cos, sin, i)
        X.append(m + block.mlp(m))
        inp, base = after_layer(i, X)
    return model.lm_head(norm(base))


def denseformer_textbook_logits(model, idx):
    """Y_i = sum_{j in S(i)} alpha_{i,j} X_j if p | i, else X_i; S(i) = {0 <= j <= i: j = i mod k}."""
    k, p = model.cfg.denseformer_dilation or 1, model.cfg.denseformer_period or 1

    def dwa(i, X):
        i += 1  # X_i is the output of the i-th layer
        if i % p:
            return X[i], X[i]
        S = [j for j in range(i + 1) if j % k == i % k]
        Y = sum(model.residual.alpha[str(i)][n] * X[j] for n, j in enumerate(S))
        return Y, Y

    return run_layers(model, idx, dwa)


@pytest.mark.parametrize("k, p", DENSE_KP)
def test_denseformer_matches_its_textbook_definition(k, p):
    model, idx = randomize_routing(tiny(residual="denseformer", denseformer_dilation=k, denseformer_period=p)), tokens()
    torch.testing.assert_close(model(idx)[0], denseformer_textbook_logits(model, idx), rtol=0, atol=F64)


@pytest.mark.parametrize("k, p, count", [(1, 1, 90), (2, 1, 48), (4, 5, 5), (1, 12, 13)])
def test_denseformer_parameter_count(k, p, count):
    """P = sum over the DWAs i (p | i) of |S(i)| = floor(i / k) + 1; 12 layers, 1x1: D (D + 3) / 2 = 90."""
    cfg = GPTConfig(n_layer=12, n_embd=8, n_head=2, residual="denseformer", denseformer_dilation=k, denseformer_period=p)
    assert sum(a.numel() for a in model_module.DenseFormer(cfg).parameters()) == count


def mudd_textbook_logits(model, idx):
    """A_i = W2_i GELU(W1_i RMSNorm(X_{i+1})) + a_i per token, way-major [C, n]; Z^c = sum_j A[c, j] X_j; the next
    attention reads (Z^Q, Z^K, Z^V), the next base is Z^R; the readout is the last layer's one way."""
    R = model.residual

    def mix(i, X):
        A = F.gelu(norm(X[-1]) @ R.W1[i]) @ R.W2[i] + R.a[i].flatten()  # [B, T, C * n]
        Z = torch.einsum("btcn,nbtd->cbtd", A.unflatten(-1, R.a[i].shape), torch.stack(X))
        return (tuple(Z[:3]), Z[3]) if len(Z) == 4 else (None, Z[0])

    return run_layers(model, idx, mix)


@pytest.mark.parametrize("n_layer", [1, 3])
def test_muddformer_matches_its_textbook_definition(n_layer):
    model = randomize_routing(tiny(residual="muddformer", n_layer=n_layer))
    with torch.no_grad():
        for W in model.residual.W2:
            W.mul_(0.1)  # random dynamic weights at a scale that keeps activations sane
    idx = tokens()
    torch.testing.assert_close(model(idx)[0], mudd_textbook_logits(model, idx), rtol=0, atol=F64)


def test_muddformer_parameter_count():
    """Per layer d H_i + H_i C_i n_i + C_i n_i, H_i = round64(C_i n_i e_i): 610,689 at 12 x 768, every H_i 64 there."""
    cfg = GPTConfig(n_layer=12, n_embd=768, residual="muddformer")
    mudd = MUDDFormer(cfg)
    assert sum(p.numel() for p in mudd.parameters()) == 610_689
    assert [W.size(1) for W in mudd.W1] == [64] * 12
    assert [tuple(a.shape) for a in mudd.a][::11] == [(4, 2), (1, 13)]  # 4 ways, then the readout's one


def test_attention_reads_one_two_or_three_inputs_and_normalises_each_once(monkeypatch):
    """h, (h_QK, h_V) and (h_Q, h_K, h_V) are one code path: a repeated input is the same input."""
    model = tiny()
    attn, cos, sin = model.blocks[0].attn, model.cos[:12], model.sin[:12]
    g = torch.Generator().manual_seed(0)
    a, b, c = (torch.randn(2, 12, 32, generator=g, dtype=torch.float64) for _ in range(3))
    calls = []
    monkeypatch.setattr(model_module, "norm", lambda x: calls.append(x) or norm(x))

    def run(h):
        calls.clear()
        return attn(h, cos, sin, 0), len(calls) - 2  # minus QK-norm's two calls

    (one, n1), (same3, n3), (rd, n2), (rd3, n2b), (qkv, n3b) = map(run, [a, (a, a, a), (a, b), (a, a, b), (a, b, c)])
    assert (n1, n3, n2, n2b, n3b) == (1, 1, 2, 2, 3)
    assert torch.equal(one, same3) and torch.equal(rd, rd3)
    # (a, b, c): queries from a, keys from b, values from c
    q, k, v = (lin(norm(x)).view(2, 12, 2, 16) for lin, x in ((attn.c_q, a), (attn.c_k, b), (attn.c_v, c)))
    q, k = model_module.rotary(norm(q), cos, sin), model_module.rotary(norm(k), cos, sin)
    y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    torch.testing.assert_close(qkv, attn.c_proj(y.transpose(1, 2).reshape(2, 12, 32)), rtol=0, atol=F64_OP)


def delta_textbook_logits(model, idx):
    """h_j = h~_j + depth_attention([x0, b_1, .., b_m], w_j), b_m = sum of the y of completed block m
    (S sublayers each); y_j = F_j(norm(h_j)); h~_{j+1} = h~_j + y_j; the readout is h~_L."""
    S, w = model.cfg.delta_block_size or 1, model.residual.w
    cos, sin = model.cos[:idx.size(1)], model.sin[:idx.size(1)]
    x0 = model.wte(idx)
    h, ys = x0, []
    for j in range(2 * model.cfg.n_layer):
        blocks = [sum(ys[b * S:(b + 1) * S]) for b in range(j // S)]
        h_j = h + depth_attention(w[j], [x0] + blocks)[0]
        block = model.blocks[j // 2]
        ys.append(block.attn(h_j, cos, sin, j // 2) if j % 2 == 0 else block.mlp(h_j))
        h = h + ys[-1]
    return model.lm_head(norm(h))


@pytest.mark.parametrize("S", [1, 2, 3, 4, 7])
def test_delta_matches_its_textbook_definition(S):
    model, idx = tiny(residual="delta_attnres", delta_block_size=S), tokens()
    if S > 1:  # at init, unlike S = 1, not the standard residual (section 7.3)
        assert (model(idx)[0] - tiny(residual="standard")(idx)[0]).abs().max() > 1e-4
    randomize_routing(model)
    torch.testing.assert_close(model(idx)[0], delta_textbook_logits(model, idx), rtol=0, atol=F64)
