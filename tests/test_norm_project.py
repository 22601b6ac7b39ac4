"""model_fast.norm_project (an attention K or V input of its own: RD-AttnRes' h_V, MUDDFormer's h_K, h_V) gives the
plain ops' numbers in float64, under bf16 autocast, without gradients and compiled; in the model, keeping no copy."""

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
import torch.utils.checkpoint

import model as model_module
import model_fast
from conftest import F64_OP, F64_ZERO, randomize_routing, tiny, tokens
from model import norm
from model_fast import norm_project
from tools.bench import saved_activation_bytes

B, T, d, n = 2, 5, 16, 12


def inputs(dtype=torch.float64, seed=0, shape=(B, T, d)):
    g = torch.Generator().manual_seed(seed)
    h = (3 * torch.randn(shape, generator=g, dtype=dtype)).requires_grad_()
    W = (0.3 * torch.randn(n, shape[-1], generator=g, dtype=dtype)).requires_grad_()
    gy = torch.randn(*shape[:-1], n, generator=g, dtype=dtype)
    return h, W, gy


def plain(h, W):
    return F.linear(norm(h), W)


def value_and_grads(f, h, W, gy):
    y = f(h, W)
    leaves = [t for t in (h, W) if t.requires_grad]
    return y, torch.autograd.grad((y * gy.to(y.dtype)).sum(), leaves)


@pytest.mark.parametrize("shape", [(B, T, d), (T, d), (B, 1, 3, d)], ids=["BTd", "Td", "4d"])
@pytest.mark.parametrize("grads", ["both", "h", "W"])
def test_norm_project_equals_the_plain_ops_in_float64(shape, grads):
    """The forward bit for bit (F.rms_norm's ops, then F.linear), every gradient to float64 rounding, gradcheck."""
    h, W, gy = inputs(shape=shape)
    h.requires_grad_(grads != "W")
    W.requires_grad_(grads != "h")
    (y, g), (y_ref, g_ref) = value_and_grads(norm_project, h, W, gy), value_and_grads(plain, h, W, gy)
    assert torch.equal(y, y_ref)
    assert len(g) == len(g_ref) == (2 if grads == "both" else 1)
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b, rtol=0, atol=F64_ZERO)  # one norm and one matmul of <= 32 terms below 1
    torch.autograd.gradcheck(norm_project, (h, W))
    torch.autograd.gradcheck(norm_project, (h.detach()[:1].mul(1e-3).requires_grad_(grads != "W"), W))  # eps matters


def test_norm_project_saves_only_references_to_h_and_the_weight():
    """Without gradients (no_grad, inference_mode) it is the plain ops, bit for bit."""
    h, W, _ = inputs(dtype=torch.float32)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        norm_project(h, W)
    assert [tuple(t.shape) for t in saved] == [(B, T, d), (n, d)]
    assert saved[0] is h and saved[1] is W  # references, not copies
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            assert torch.equal(norm_project(h, W), plain(h, W))


def test_norm_project_under_bf16_autocast_equals_the_plain_ops():
    """Under bf16 autocast the projection runs in bf16, as F.linear does there, forward (the same
    bits) and backward; the norm and its backward in float32; each gradient in its input's dtype."""
    h, W, gy = inputs(dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        (y, g), (y_ref, g_ref) = value_and_grads(norm_project, h, W, gy), value_and_grads(plain, h, W, gy)
    assert y.dtype == torch.bfloat16 and torch.equal(y, y_ref)
    for a, b in zip(g, g_ref, strict=True):
        assert a.dtype == torch.float32
        # float32, the norm's backward in another order: a sum over d = 32 channels, 32 u = 2e-6 relative; 5x that
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.fixture
def plain_compile():
    """torch.compile as a user calls it: AOTAutograd traces the backward under the forward's autocast."""
    torch._dynamo.reset()
    with torch._functorch.config.patch(backward_pass_autocast="same_as_forward"):
        yield lambda f, **kw: torch.compile(f, fullgraph=True, dynamic=False, **kw)
    torch._dynamo.reset()


@pytest.mark.slow
@pytest.mark.xdist_group("inductor")  # with test_perf's inductor tests: one process pays inductor's first-use warm-up
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_norm_project_under_plain_compile_equals_eager(plain_compile, backend):
    """fullgraph=True (no graph break), in float32 and under bf16 autocast with the backward traced
    under it: the backward's matmuls keep the forward's dtype, its norm stays float32."""
    h, W, gy = inputs(dtype=torch.float32)
    compiled = plain_compile(norm_project, backend=backend)
    # float32: as above (32 u); bf16: the compiled graph keeps float32 between the ops eager rounds, 2-3 bf16 u
    for autocast, tol in [(torch.autocast("cpu", enabled=False), 1e-5), (torch.autocast("cpu", dtype=torch.bfloat16), 1e-2)]:
        with autocast:
            (y, g), (y_ref, g_ref) = value_and_grads(compiled, h, W, gy), value_and_grads(norm_project, h, W, gy)
        assert y.dtype == y_ref.dtype
        torch.testing.assert_close(y, y_ref, rtol=tol, atol=tol if backend == "inductor" else 0)
        for a, b in zip(g, g_ref, strict=True):
            assert a.dtype == torch.float32
            torch.testing.assert_close(a, b, rtol=tol, atol=1e-6 if backend == "aot_eager" else tol)


# --- the whole model: RD-AttnRes' h_V, MUDDFormer's h_K and h_V -------------------------------------

Bm, Tm, dm, n_layer = 2, 12, 32, 4
IDX = tokens(Bm, Tm)


def run(m):
    """(logits, every gradient, saved bytes of one step: every storage, and without the parameters)."""
    out = {}

    def step():
        m.zero_grad()
        out["logits"], loss = m(IDX, IDX.roll(-1, 1))
        loss.backward()
    saved = saved_activation_bytes(step), saved_activation_bytes(step, exclude=list(m.parameters()))
    return out["logits"].detach(), {k: p.grad for k, p in m.named_parameters() if p.grad is not None}, saved


PATHS = {  # CausalSelfAttention.normed as it was: the plain ops, and the checkpoint of the last change
    "plain": lambda self, linear, h: linear(norm(h)),
    "checkpoint": lambda self, linear, h: torch.utils.checkpoint.checkpoint(lambda x: linear(norm(x)), h,
                                                                           use_reentrant=False),
}
USES = {"rd_attnres": n_layer, "muddformer": 2 * (n_layer - 1)}  # MUDDFormer's first layer reads x0 three times


@pytest.mark.parametrize("residual", USES)
def test_model_equals_the_plain_path_and_the_checkpoint_path(residual, monkeypatch):
    """The plain ops' and the checkpoint's logits bit for bit, gradients to float64 rounding; saved, per separate input:
    the plain ops' normalised copy and 1 / rms less, against the checkpoint only a reference to the projection's weight."""
    calls = []
    monkeypatch.setattr(model_fast.FastGPT, "norm_project", staticmethod(lambda h, W: calls.append(1) or norm_project(h, W)))
    logits, grads, saved = run(randomize_routing(tiny(residual=residual, n_layer=n_layer)))
    assert len(calls) == 2 * USES[residual]  # run() steps twice: counting with and without the parameters
    for path, normed in PATHS.items():
        with monkeypatch.context() as mp:
            mp.setattr(model_module.CausalSelfAttention, "normed", normed)
            logits_p, grads_p, saved_p = run(randomize_routing(tiny(residual=residual, n_layer=n_layer)))
        assert torch.equal(logits, logits_p), path
        assert grads.keys() == grads_p.keys()
        for k in grads_p:
            torch.testing.assert_close(grads[k], grads_p[k], rtol=0, atol=F64_OP, msg=f"{path}: {k}")
        uses, token, weight = USES[residual], Bm * Tm * 8, dm * dm * 8
        weights = n_layer if residual == "rd_attnres" else uses  # c_v of every layer; c_k and c_v of layers 1..
        (saved_all, saved_act), (saved_all_p, saved_act_p) = saved, saved_p
        if path == "plain":
            assert saved_all_p - saved_all == saved_act_p - saved_act == uses * token * (dm + 1)  # RMSNorm(h), 1 / rms
        else:  # the weights' references (parameters) more, and not one activation byte
            assert saved_all - saved_all_p == weights * weight and saved_act == saved_act_p
