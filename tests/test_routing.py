"""model_fast.py equals model.py's plain references (float64): the two-phase router alone, and every variant's model."""

import pytest
import torch
import torch.nn as nn

import model as model_module
import model_fast
from conftest import F64, F64_OP, ThreeRoutes, randomize_routing, tiny
from model import DAR_STREAMS, RESIDUALS, AttnResStream, FullAttnRes, GPTConfig
from model_fast import TwoPhaseRouter, make_model, rms_inv, transport
from tools.bench import ReferenceRouter, saved_activation_bytes

# --- the router alone: phase 1 over the completed sources, phase 2 with the recent ones ----------------

B, T, d = 2, 3, 8


def sources(n, streams=None, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (B, T, d) if streams is None else (2, B, T, d)
    return [torch.randn(shape, generator=g, dtype=dtype).requires_grad_() for _ in range(n)]


def route(Router, W, completed, recent, reads, streams=None, alpha=None):
    """Open a router over `completed`, read each query row in `reads` with `recent`: a tuple of rows is one site's
    (read_rows: RD-AttnRes's two routes); with alpha, read_fused the (target 0, target 1) row pairs."""
    inv = lambda srcs: [rms_inv(s) for s in srcs]  # noqa: E731, the streams' way: norm factors made outside
    router = Router(W, completed, inv(completed), streams)
    if alpha is None:
        return [h for q in reads for h in (router.read_rows(q, recent, inv(recent)) if isinstance(q, tuple)
                                           else [router.read(q, recent, inv(recent))])]
    return [router.read_fused(rows, alpha, recent, inv(recent)) for rows in reads]


CASES = {  # name: (streams, number of query rows, reads, fused)
    "one-stream": (None, 3, [0, 1, 2], False),
    "one-stream-rows": (None, 4, [(0, 2), (1, 3, 0)], False),  # sites that read several rows at once
    **{f"dar-{r}": (DAR_STREAMS[r], 4, [(0, 2), (1, 3)], True) for r in ("cross", "self_kv", "cross_v", "fixed_kv")},
    "dar-cross-per-target": (DAR_STREAMS["cross"], 4, [0, 1, 2, 3], False),
}


@pytest.mark.parametrize("K", [0, 1, 2])
@pytest.mark.parametrize("case", CASES)
def test_router_equals_reference(case, K):
    streams, Q, reads, fused = CASES[case]
    completed, recent = sources(3, streams), sources(K, streams, seed=1)
    g = torch.Generator().manual_seed(2)
    W = (0.5 * torch.randn(Q, d, generator=g, dtype=torch.float64)).requires_grad_()
    alpha = torch.tensor([0.7, 0.3], dtype=torch.float64, requires_grad=True) if fused else None
    leaves = [W, *completed, *recent] + ([alpha] if fused else [])

    def run(Router):  # the outputs, the gradients of a loss on all, and of one on the last alone (None for its site's others)
        hs = route(Router, W, completed, recent, reads, streams, alpha)
        gh = [torch.randn(h.shape, generator=torch.Generator().manual_seed(i), dtype=h.dtype) for i, h in enumerate(hs)]
        last = torch.autograd.grad(hs[-1].square().sum(), leaves, retain_graph=True)
        return (*hs, *torch.autograd.grad(sum((h * g).sum() for h, g in zip(hs, gh)), leaves), *last)

    fast = run(TwoPhaseRouter)
    for f, r in zip(fast, run(ReferenceRouter), strict=True):
        torch.testing.assert_close(f, r, rtol=0, atol=F64_OP)  # one router step in another order
    for mode in (torch.no_grad, torch.inference_mode):  # without gradients: the same numbers, bit for bit
        with mode():
            without = route(TwoPhaseRouter, W, completed, recent, reads, streams, alpha)
        assert all(torch.equal(f.detach(), w) for f, w in zip(fast, without))

    def outputs(W, *rest):
        n = len(completed)
        a = rest[-1] if fused else None
        return tuple(route(TwoPhaseRouter, W, list(rest[:n]), list(rest[n:n + K]), reads, streams, a))
    torch.autograd.gradcheck(outputs, leaves, fast_mode=True)


@pytest.mark.parametrize("reads", [[0, 1], [(0, 1)]], ids=["read", "read_rows"])
@pytest.mark.parametrize("Router", [TwoPhaseRouter, ReferenceRouter], ids=lambda R: R.__name__)
def test_routing_stays_float32_under_bf16_autocast(Router, reads):
    completed, recent = sources(3, dtype=torch.float32), sources(1, dtype=torch.float32, seed=1)
    W = torch.randn(2, d)
    plain = route(Router, W, completed, recent, reads)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = route(Router, W, completed, recent, reads)
    for p, m in zip(plain, mixed):
        assert m.dtype == torch.float32
        torch.testing.assert_close(m, p, rtol=0, atol=0)


# --- every variant, and variants a user writes: the two-phase model is the reference model, or runs plain ---

MODELS = [  # block and chunk sizes, beyond each name in RESIDUALS at its defaults
    dict(residual="full_attnres", depth_chunk=1),  # a router per site: phase 1 alone
    dict(residual="full_attnres", depth_chunk=3),  # chunks of 3 sites that do not divide 8 sublayers
    dict(residual="full_attnres", depth_chunk=16),  # one chunk for the whole model
    *[dict(residual="block_attnres", attnres_block_size=s) for s in (1, 2, 3, 4, 5, 8, 20)],
    dict(residual="block_attnres", attnres_block_size=3, depth_chunk=7),  # chunks of 9: 3 blocks each
    *[dict(residual="rd_attnres", rd_mode=m) for m in ("decoupled", "tied", "average", "frozen_v")],
    dict(residual="rd_attnres", attnres_block_size=3),  # blocks that start at MLP sublayers
    dict(residual="rd_attnres", attnres_block_size=1, depth_chunk=3),
    *[dict(residual="dar", dar_routing=r) for r in ("cross", "self_kv", "cross_v", "fixed_kv", "sep_v")],
    *[dict(residual="dar", dar_block_size=k) for k in (1, 3, 5)],
    dict(residual="dar", dar_block_size=1, depth_chunk=6),  # 3 history entries per chunk
    dict(residual="dar", dar_include_partial=False),
    dict(residual="dar", dar_block_size=1, dar_include_partial=False, dar_routing="cross_v"),
    *[dict(residual="delta_attnres", delta_block_size=s) for s in (1, 2, 3, 4, 5, 20)],
    dict(residual="delta_attnres", depth_chunk=1),
    dict(residual="delta_attnres", depth_chunk=3),
    dict(residual="delta_attnres", delta_block_size=2, depth_chunk=5),  # chunks of 3 blocks
]


def model(**kw):
    """4 layers: 8 sublayers, so most block and chunk sizes leave a short last one."""
    m = randomize_routing(tiny(block_size=16, n_layer=4, n_embd=16, **kw))
    if m.cfg.dar_routing == "sep_v":
        with torch.no_grad():
            m.residual.v_proj.mul_(0.3)
    return m


def forward_backward(m, idx):
    m.zero_grad()
    logits, loss = m(idx, idx.roll(-1, 1))
    loss.backward()
    return logits.detach(), {n: p.grad for n, p in m.named_parameters() if p.grad is not None}


class StaticStream(AttnResStream):
    """Static AttnRes: softmax over one learned logit per (site, source), no keys; a stream the fast path lacks."""

    def read(self, j):
        if j > 0 and j % self.mod.S == 0:
            self.blocks, self.partial = self.blocks + [self.partial], None
        sources = self.blocks + ([self.partial] if self.partial is not None else [])
        a = self.mod.logits[j, :len(sources)].softmax(0)
        return sum(a_r * s for a_r, s in zip(a, sources))


class StaticAttnRes(FullAttnRes):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.logits = nn.Parameter(torch.zeros(self.L + 1, self.L + 1))

    def start(self, x0, record=None):
        return StaticStream(self, x0, record)


USER_VARIANTS = {"three_routes": ThreeRoutes, "static_attnres": StaticAttnRes}


@pytest.mark.parametrize("variant", [dict(residual=r) for r in (*RESIDUALS, *USER_VARIANTS)] + MODELS,
                         ids=lambda v: "-".join(map(str, v.values())))
def test_every_variant_runs_the_same_numbers_on_both_paths(variant, monkeypatch):
    """Every name in RESIDUALS, two a user writes (an extra route; a stream of its own) and MODELS, at random weights:
    the default path (the twin where the plain stream has one, else the plain stream) equals depth_impl="reference",
    logits and every gradient in float64, and without gradients bit for bit."""
    for name, cls in USER_VARIANTS.items():
        monkeypatch.setitem(model_module.RESIDUALS, name, cls)
    idx = torch.randint(0, 61, (2, 10), generator=torch.Generator().manual_seed(0))
    fast, ref = model(**variant), model(depth_impl="reference", **variant)
    with torch.no_grad():
        for p in (*fast.parameters(), *ref.parameters()):  # the sublayers too: trained-looking everywhere
            p.mul_(1 + 0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel()), dtype=p.dtype))
    ref.load_state_dict(fast.state_dict())
    plain = type(fast.residual.start(fast.wte(idx)))
    assert type(fast.start_stream(fast.wte(idx))) is model_fast.TWINS.get(plain, plain)  # the twin, or plain
    (lf, gf), (lr, gr) = forward_backward(fast, idx), forward_backward(ref, idx)
    torch.testing.assert_close(lf, lr, rtol=0, atol=F64)
    assert gf.keys() == gr.keys()
    if len(variant) == 1:  # a registered name at its defaults: every routing parameter learns
        assert all(gr[n].abs().max() > 0 for n in gr if n.startswith("residual."))
    for n in gr:
        torch.testing.assert_close(gf[n], gr[n], rtol=0, atol=F64, msg=n)
    with torch.no_grad():
        torch.testing.assert_close(fast(idx)[0], lf, rtol=0, atol=0)


def test_a_stream_subclass_keeps_its_twin_unless_it_overrides_a_method_and_then_says_so(monkeypatch, capsys):
    """A subclass of a stream in TWINS that overrides none of its methods runs the twin; one that overrides
    one runs as written, and make_model says so in one line, once: which class, why, where a twin goes."""
    class Renamed(AttnResStream):
        """A name of its own, nothing overridden."""

    class OwnRead(AttnResStream):
        def read(self, j):
            return super().read(j)

    for stream in (Renamed, OwnRead):
        monkeypatch.setitem(model_module.RESIDUALS, stream.__name__, type("Mod", (FullAttnRes,), dict(
            start=lambda self, x0, record=None, stream=stream: stream(self, x0, record))))
    assert model_fast.twin_of(Renamed) == (model_fast.FastAttnResStream, None)
    assert model(residual="Renamed").start_stream(torch.zeros(1, 2, 16)).__class__ is model_fast.FastAttnResStream
    assert capsys.readouterr().err == ""
    net, _ = model(residual="OwnRead"), model(residual="OwnRead")
    assert type(net.start_stream(torch.zeros(1, 2, 16))) is OwnRead
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and all(word in err for word in ("OwnRead", "overrides read", "model_fast.TWINS"))


# --- memory: references to the sources, nothing source-sized per site ----------------------------------

@pytest.mark.parametrize("residual, per_site", [("full_attnres", 1), ("block_attnres", 1), ("rd_attnres", 2),
                                                ("dar", 3), ("delta_attnres", 2)])
def test_saved_activations_stay_linear_in_the_sources(residual, per_site):
    """Routing adds, per site, the sources it must keep (Full: the output; Block: the partial sum; RD: + an attention
    site's value input; DAR: both streams' partial states and y; Delta: the output and the routed term) plus a few
    [N, n, Q] statistics. A copy of a source saved at every site (a normalised key, a phase-1 output) adds L sources."""
    Bt, Tt, dm, n_layer = 2, 32, 128, 6
    L = 2 * n_layer
    idx = torch.randint(0, 61, (Bt, Tt), generator=torch.Generator().manual_seed(0))

    def saved(**kw):
        m = make_model(GPTConfig(vocab_size=61, block_size=Tt, n_layer=n_layer, n_head=2, n_embd=dm, **kw), seed=0)
        return saved_activation_bytes(lambda: m(idx, idx)[1].backward())

    extra = saved(residual=residual) - saved(residual="standard")
    reference = saved(residual=residual, depth_impl="reference") - saved(residual="standard")
    source = Bt * Tt * dm * 4
    assert extra < (per_site * (L + 1) + L / 2) * source
    assert extra <= reference
    if residual == "full_attnres":  # the plain stream: a normalised copy per (site, source) pair, L (L + 1) / 2
        assert reference > 0.75 * L * (L + 1) / 2 * source


def test_dar_transport_equals_its_reference():
    g = torch.Generator().manual_seed(0)
    P = torch.randn(2, B, T, d, generator=g, dtype=torch.float64).requires_grad_()
    y = torch.randn(B, T, d, generator=g, dtype=torch.float64).requires_grad_()
    rho = torch.tensor(0.8, dtype=torch.float64, requires_grad=True)
    beta = torch.tensor([1.3, 0.4], dtype=torch.float64, requires_grad=True)
    gout = torch.randn(2, B, T, d, generator=g, dtype=torch.float64)
    fast, ref = ([f(P, rho, beta, y), *torch.autograd.grad((f(P, rho, beta, y) * gout).sum(), (P, rho, beta, y))]
                 for f in (transport, model_module.transport))
    for f, r in zip(fast, ref, strict=True):
        torch.testing.assert_close(f, r, rtol=0, atol=F64_OP)  # one op in another order
    torch.autograd.gradcheck(transport, (P, rho, beta, y))
