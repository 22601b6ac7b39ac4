"""
A decoder-only GPT with depth-routing residual connections.

Every residual variant answers two questions for sublayer j (attention or MLP, L = 2 * n_layer of
them): what is its input h_j, and where does its output y_j = F_j(PreNorm_j(h_j)) go? The sublayers
themselves never change. The math contract is VARIANTS.md; section numbers below refer to it.

    standard       h_{j+1} = h_j + y_j                                        (section 1)
    full_attnres   h_j = depth attention over [x0, y_0, .., y_{j-1}]          (section 2, AttnRes Eq. 1-4)
    block_attnres  h_j = depth attention over block sums [x0, b_1, .., partial]  (section 3, Eq. 5-6)
    rd_attnres     Block AttnRes, but attention reads Q/K and V through two routes (section 4)
    dar            two streams; each retrieves its history with keys from the other (section 5)
    hc, mhc        n streams mixed by (manifold-constrained) Hyper-Connections (section 6)

One primitive, `depth_attention` (routing weights, then the weighted sum), carries AttnRes, RD-AttnRes
and DAR.
"""

import hashlib
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

RESIDUALS = ("standard", "full_attnres", "block_attnres", "rd_attnres", "dar", "hc", "mhc")
RD_MODES = ("decoupled", "tied", "average", "frozen_v")
DAR_ROUTINGS = ("cross", "self_kv", "cross_v", "fixed_kv", "sep_v")
DEPTH_IMPLS = ("lean", "reference")


@dataclass
class GPTConfig:
    vocab_size: int = 50304  # GPT-2's 50257, padded to a multiple of 64
    block_size: int = 1024  # context length
    n_layer: int = 12
    n_head: int = 6  # head dim 128
    n_embd: int = 768
    mlp_ratio: int = 4
    tie_embeddings: bool = False  # share wte and lm_head
    rope_base: float = 10000.0
    logit_softcap: float = 0.0  # 0 = off; else logits = c * tanh(logits / c)
    residual: str = "standard"  # one of RESIDUALS
    attnres_block_size: int = 4  # S, in sublayers (4 = two transformer layers); block_attnres, rd_attnres
    rd_mode: str | None = None  # rd_attnres only; None means "decoupled"
    dar_block_size: int = 4  # K, in sublayers; 1 is Full DAR
    dar_include_partial: bool = True  # the current in-block state is a candidate source
    dar_routing: str | None = None  # dar only; None means "cross"
    hc_streams: int = 4  # n, for hc and mhc (mhc with 2 is the DAR paper's mHC-2 baseline)
    depth_impl: str = "lean"  # "lean" (custom autograd, no copies saved) or "reference" (plain autograd)

    def __post_init__(self):
        def need(ok, msg):
            if not ok:
                raise ValueError(msg)

        need(self.residual in RESIDUALS, f"unknown residual {self.residual!r}; choose one of {', '.join(RESIDUALS)}")
        need(self.rd_mode is None or self.residual == "rd_attnres",
             f"rd_mode={self.rd_mode!r} only applies to residual='rd_attnres' (got residual={self.residual!r}); drop rd_mode")
        need(self.rd_mode is None or self.rd_mode in RD_MODES,
             f"unknown rd_mode {self.rd_mode!r}; choose one of {', '.join(RD_MODES)}")
        need(self.dar_routing is None or self.residual == "dar",
             f"dar_routing={self.dar_routing!r} only applies to residual='dar' (got residual={self.residual!r}); drop dar_routing")
        need(self.dar_routing is None or self.dar_routing in DAR_ROUTINGS,
             f"unknown dar_routing {self.dar_routing!r}; choose one of {', '.join(DAR_ROUTINGS)}")
        need(self.dar_block_size >= 1, f"dar_block_size counts sublayers and must be >= 1, got {self.dar_block_size}")
        need(self.hc_streams >= 1, f"hc_streams must be >= 1, got {self.hc_streams}")
        need(self.attnres_block_size >= 1, f"attnres_block_size counts sublayers and must be >= 1, got {self.attnres_block_size}")
        need(self.depth_impl in DEPTH_IMPLS, f"unknown depth_impl {self.depth_impl!r}; choose one of {', '.join(DEPTH_IMPLS)}")
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "mlp_ratio"):
            need(getattr(self, name) >= 1, f"{name} must be >= 1, got {getattr(self, name)}")
        need(self.n_embd % self.n_head == 0, f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        need((self.n_embd // self.n_head) % 2 == 0, f"head dim n_embd/n_head={self.n_embd // self.n_head} must be even for rotary embeddings")
        need(self.logit_softcap >= 0, f"logit_softcap must be >= 0, got {self.logit_softcap}")


# ----------------------------------------------------------------------------------------------
# Depth attention (section 0): the one primitive of the AttnRes family.
#
#     logit_r = w . RMSNorm(k_r)      per token; no temperature, no 1/sqrt(d); the key norm has no gain
#     a       = softmax_r(logit)      over the depth axis                     (w.(g*k) = (w*g).k, so a
#     h       = sum_r a_r * v_r       values are the raw sources              gain would be redundant)
#
# Keys and values are lists of n tensors [..., d] (usually the same list). The query w is [d], or
# [Q, d] to route Q queries over the same sources in one pass (RD-AttnRes' two routes). With
# per_query=True each source is [Q, ..., d] and query q reads slice q (DAR's two streams in one pass).
# RMSNorm(k_r) = k_r * inv_r with inv_r = 1 / rms(k_r): a source's norm factor does not depend on
# the query, so the residual streams compute it once per source (_rms_inv) and pass it to every site
# that reads the source. Everything runs in float32 (float64 for float64 models), also inside bf16
# autocast regions, where only the sources stay bf16.


def _compute_dtype(t):
    return torch.promote_types(t.dtype, torch.float32)


def _float32_routing(t):
    """Autocast off: the routing math must not drop to bf16 (the sources themselves may be bf16)."""
    return torch.autocast(t.device.type, enabled=False)


def _rms_inv(k):
    """inv = 1 / rms(k) over channels, [...] for k [..., d]: RMSNorm(k) = k * inv."""
    dt = _compute_dtype(k)
    with _float32_routing(k):
        return torch.rsqrt(torch.linalg.vector_norm(k, dim=-1, dtype=dt).square() / k.size(-1) + torch.finfo(dt).eps)


def _dots(k, W, per_query):
    """k . W_q: [Q, ...] for keys k [..., d] shared by the Q queries, or [Q, ..., d] one slice per query."""
    if per_query:
        return (k.reshape(len(W), -1, W.size(1)) @ W.unsqueeze(-1)).view(k.shape[:-1])
    return (k @ W.T).movedim(-1, 0)


class _DepthWeights(torch.autograd.Function):
    """a = softmax_r(inv_r (W k_r)), [n, Q, ...], with a hand-written backward. It saves the queries,
    [n, Q, ...]-sized tensors and references to the keys, never copies: every site of Full AttnRes
    adds O(n B T) floats for backward, not O(n B T d), and no float32 copy of a bf16 source outlives
    the forward pass. The norm factors arrive as an input and get their gradient here; autograd
    takes it once per source, through the _rms_inv that made them."""

    @staticmethod
    def forward(ctx, W, inv, per_query, *keys):  # W [Q, d]; inv [n, ...] ([n, Q, ...] per query)
        Wf = W.to(inv.dtype)
        dots = torch.stack([_dots(k.to(inv.dtype), Wf, per_query) for k in keys])  # [n, Q, ...]
        a = (dots * (inv if per_query else inv.unsqueeze(1))).softmax(0)
        ctx.per_query = per_query
        ctx.save_for_backward(W, inv, a, dots, *keys)
        return a

    @staticmethod
    def backward(ctx, ga):
        W, inv, a, dots, *keys = ctx.saved_tensors
        Q, d = W.shape
        Wf = W.to(a.dtype)
        dl = a * (ga - (a * ga).sum(0, keepdim=True))  # softmax backward: dL/dlogit
        if ctx.per_query:
            g_inv, c = dl * dots, dl * inv  # c = dL/d(W k_r)
        else:
            g_inv, c = (dl * dots).sum(1), dl * inv.unsqueeze(1)
        gW, gk = torch.zeros_like(Wf), []
        for c_r, k in zip(c, keys):
            k = k.to(a.dtype)
            if ctx.per_query:
                gW += (c_r.reshape(Q, 1, -1) @ k.reshape(Q, -1, d)).squeeze(1)
                gk.append(c_r.unsqueeze(-1) * Wf.view(Q, *[1] * (k.dim() - 2), d))
            else:
                gW += c_r.reshape(Q, -1) @ k.reshape(-1, d)
                gk.append(c_r.movedim(0, -1) @ Wf)
        return gW.to(W.dtype), g_inv, None, *[g.to(k.dtype) for g, k in zip(gk, keys)]


class _DepthMix(torch.autograd.Function):
    """h = sum_r a_r v_r, [Q, ..., d]; with fuse, values [Q, ..., d] and h = sum_q sum_r a_rq v_rq,
    [..., d] (DAR's fused retrieval: the per-target retrievals are never materialised). Each source
    is read once, accumulated in place; saves a and references to the values."""

    @staticmethod
    def forward(ctx, a, fuse, *values):  # a [n, Q, ...]; values [..., d] or [Q, ..., d]
        terms = [(a_r[q], v[q]) for a_r, v in zip(a, values) for q in range(len(a_r))] if fuse else zip(a, values)
        h = None
        for a_r, v in terms:
            h = a_r.unsqueeze(-1) * v.to(a.dtype) if h is None else h.addcmul_(a_r.unsqueeze(-1), v.to(a.dtype))
        ctx.save_for_backward(a, *values)
        return h.to(values[0].dtype)

    @staticmethod
    def backward(ctx, g):
        a, *values = ctx.saved_tensors
        g = g.to(a.dtype)
        ga = torch.stack([(g * v.to(a.dtype)).sum(-1) for v in values])  # dL/da_r = g . v_r (g [..., d] when fused)
        gv = []
        for a_r, v in zip(a, values):
            g_r = a_r.unsqueeze(-1) * g  # [Q, ..., d]; a shared value sums over the Q routes
            gv.append((g_r.view(v.shape) if g_r.numel() == v.numel() else g_r.sum_to_size(v.shape)).to(v.dtype))
        return ga, None, *gv


def depth_weights_reference(W, keys, per_query=False):
    """The weights in plain autograd. Readable, but it saves a float copy of every normalised key at
    every site: Full AttnRes then keeps O(L^2) source-sized tensors alive for backward."""
    dt, (Q, d) = _compute_dtype(keys[0]), W.shape
    W = W.to(dt)

    def logit(k):
        k = F.rms_norm(k.to(dt), (d,), eps=torch.finfo(dt).eps)
        return (k * W.view(Q, *[1] * (k.dim() - 2), d)).sum(-1) if per_query else (k @ W.T).movedim(-1, 0)

    return torch.stack([logit(k) for k in keys]).softmax(0)


def depth_mix_reference(a, values, fuse=False):
    h = sum(a_r.unsqueeze(-1) * v.to(a.dtype) for a_r, v in zip(a, values))
    return (h.sum(0) if fuse else h).to(values[0].dtype)


def depth_weights(W, keys, inv=None, per_query=False, impl="lean"):
    """Routing weights a [n, Q, ...] of the queries W [Q, d]. inv: the keys' norm factors (_rms_inv),
    when the caller keeps them; the reference recomputes the norm at every call, like a naive port."""
    with _float32_routing(W):
        if impl == "reference":
            return depth_weights_reference(W, keys, per_query)
        inv = torch.stack(inv if inv is not None else [_rms_inv(k) for k in keys])
        return _DepthWeights.apply(W, inv, per_query, *keys)


def depth_mix(a, values, fuse=False, impl="lean"):
    """h = sum_r a_r v_r: [Q, ..., d] for a [n, Q, ...]; fuse (values [Q, ..., d]): summed over Q too."""
    with _float32_routing(a):
        return depth_mix_reference(a, values, fuse) if impl == "reference" else _DepthMix.apply(a, fuse, *values)


def depth_attention(w, keys, values=None, inv=None, per_query=False, impl="lean"):
    """h = sum_r softmax_r(w . RMSNorm(k_r)) v_r. Returns (h, a): h [..., d] and the routing weights
    a [n, ...] for w [d]; h [Q, ..., d] and a [n, Q, ...] for w [Q, d]."""
    a = depth_weights(w.reshape(-1, w.shape[-1]), keys, inv, per_query, impl)
    h = depth_mix(a, keys if values is None else values, impl=impl)
    return (h, a) if w.dim() == 2 else (h[0], a[:, 0])


# ----------------------------------------------------------------------------------------------
# Residual variants. Each is a module that holds its parameters and starts, per forward pass, a
# stream object with three methods: read(j) -> h_j, write(j, y_j), readout() -> final hidden state.


class StandardResidual(nn.Module):
    """Section 1: h_{j+1} = h_j + y_j, h_0 = x0."""

    def reset_parameters(self, rng):
        pass

    def start(self, x0, record=None):
        return _SumStream(x0)


class _SumStream:
    def __init__(self, x0):
        self.h = x0

    def read(self, j):
        return self.h

    def write(self, j, y):
        self.h = self.h + y

    def readout(self):
        return self.h


def _site_name(j):
    return f"{'attn' if j % 2 == 0 else 'mlp'}.{j // 2}"


class AttnRes(nn.Module):
    """Sections 2-4: Full (S = 1), Block (S > 1) and Role-Decoupled Attention Residuals.

    w[j] is sublayer j's pseudo-query and w[L] the readout's (w[0] is inert: sublayer 0 sees x0
    alone). RD-AttnRes adds w_v[i], the value route's query of layer i's attention sublayer.
    """

    def __init__(self, cfg):
        super().__init__()
        L, d = 2 * cfg.n_layer, cfg.n_embd
        self.S = 1 if cfg.residual == "full_attnres" else cfg.attnres_block_size
        self.rd_mode = (cfg.rd_mode or "decoupled") if cfg.residual == "rd_attnres" else None
        self.impl = cfg.depth_impl
        self.w = nn.Parameter(torch.zeros(L + 1, d))
        if self.rd_mode in ("decoupled", "average", "frozen_v"):
            self.w_v = nn.Parameter(torch.zeros(cfg.n_layer, d), requires_grad=self.rd_mode != "frozen_v")

    @torch.no_grad()
    def reset_parameters(self, rng):
        for p in self.parameters():
            p.zero_()  # zero queries: uniform routing at init, what makes these variants train stably

    def start(self, x0, record=None):
        return _AttnResStream(self, x0, record)


class _AttnResStream:
    def __init__(self, mod, x0, record):
        self.m, self.record = mod, record
        self.completed, self.partial = [x0], None  # block representations b_0 = x0, b_1, ..; partial sum
        self.inv = [_rms_inv(x0)]  # each completed block's norm factor, computed once for all later sites

    def _attend(self, w, site):
        sources, inv = self.completed, self.inv
        if self.partial is not None:
            sources, inv = sources + [self.partial], inv + [_rms_inv(self.partial)]
        h, a = depth_attention(w, sources, inv=inv, impl=self.m.impl)
        if self.record is not None:
            self.record[site] = a.detach()
        return h

    def read(self, j):
        m = self.m
        if j > 0 and j % m.S == 0:  # Eq. 5: a block boundary closes the partial sum
            self._close_block()
        site = _site_name(j)
        if m.rd_mode is None or m.rd_mode == "tied" or j % 2 == 1:
            return self._attend(m.w[j], site)
        # RD-AttnRes at an attention sublayer: both routes in one pass over the same normalised keys
        h_qk, h_v = self._attend(torch.stack([m.w[j], m.w_v[j // 2]]), site)
        if m.rd_mode == "average":
            return 0.5 * (h_qk + h_v)  # control: two routes, no role separation
        return h_qk, h_v  # (Q/K input, V input)

    def write(self, j, y):
        self.partial = y if self.partial is None else self.partial + y

    def _close_block(self):
        self.completed.append(self.partial)
        self.inv.append(_rms_inv(self.partial))
        self.partial = None

    def readout(self):
        self._close_block()
        return self._attend(self.m.w[-1], "readout")


# ----------------------------------------------------------------------------------------------
# Dual Attention Residuals (section 5): two streams, each with its own block history and partial
# sum P_m. Target stream m retrieves with its own query; by default its keys come from the
# opposite stream and its values from its own history (reciprocal cross-stream addressing).

# dar_routing -> (key stream, value stream) for targets m = 0 and m = 1
DAR_ROUTES = {
    "cross": ((1, 0), (0, 1)),  # keys from the opposite stream, values from the target's own
    "self_kv": ((0, 1), (0, 1)),  # two independent retrievers
    "cross_v": ((0, 1), (1, 0)),  # keys own, values opposite
    "fixed_kv": ((0, 0), (1, 1)),  # stream 0 supplies every key, stream 1 every value
    "sep_v": ((0, 1), (0, 1)),  # self_kv plus a learned value projection per stream
}


class DualAttnRes(nn.Module):
    """Per site j (sublayers 0..L-1, readout L), all scalars per site [our reading, section 5]:
        w[j, m]            pseudo-query of target stream m, zero-init
        alpha_j = softmax(theta_alpha[j])      fusion of the two retrievals, init 0.6 for stream
                                               j mod 2 and 0.4 for the other
        rho_j   = sigmoid(theta_rho[j])        doubly-stochastic transport, init 0.982 (near identity);
                                               absent in Full DAR (K = 1), which has no in-block state
        beta_jm = 2 sigmoid(theta_beta[j, m])  gated write, init 1 into stream j mod 2 and 0.24 into
                                               the other
        v_proj[m]          (sep_v only) d x d value projection per stream, identity-init
    Symmetry: both streams start as x0. The beta init makes their states differ; the alpha init
    makes their gradients differ (with alpha = 1/2 and zero queries both streams would get equal
    gradients, and rho none). Without both the streams could stay equal forever.
    """

    def __init__(self, cfg):
        super().__init__()
        L, d = 2 * cfg.n_layer, cfg.n_embd
        self.K, self.include_partial, self.impl = cfg.dar_block_size, cfg.dar_include_partial, cfg.depth_impl
        self.routing = cfg.dar_routing or "cross"
        self.key_of, self.value_of = map(list, DAR_ROUTES[self.routing])  # stream of target t's keys, of its values
        if self.routing != "fixed_kv":  # permutations: the target reading stream s's keys, its values
            self.key_reader = [self.key_of.index(s) for s in (0, 1)]
            self.value_reader = [self.value_of.index(s) for s in (0, 1)]
        self.w = nn.Parameter(torch.zeros(L + 1, 2, d))
        self.theta_alpha = nn.Parameter(torch.zeros(L + 1, 2))
        if self.K > 1:  # Full DAR (K = 1) starts a new block at every sublayer: nothing to transport
            self.theta_rho = nn.Parameter(torch.zeros(L))
        self.theta_beta = nn.Parameter(torch.zeros(L, 2))
        if self.routing == "sep_v":
            self.v_proj = nn.Parameter(torch.zeros(2, d, d))
        self.ablate = {}  # diagnostics only: {sublayer j: streams whose retrieval r_m is replaced by its token mean}

    @torch.no_grad()
    def reset_parameters(self, rng):
        self.w.zero_()
        mine = torch.arange(self.theta_alpha.size(0)) % 2  # stream j mod 2: attention 0, MLP 1 (readout 0)
        half = 0.5 * math.log(0.6 / 0.4)
        self.theta_alpha.fill_(-half)
        self.theta_alpha[torch.arange(len(mine)), mine] = half
        if self.K > 1:
            self.theta_rho.fill_(4.0)
        self.theta_beta.fill_(-2.0)
        self.theta_beta[torch.arange(len(mine) - 1), mine[:-1]] = 0.0
        if self.routing == "sep_v":
            self.v_proj.copy_(torch.eye(self.v_proj.size(-1)).expand_as(self.v_proj))

    def start(self, x0, record=None):
        return _DARStream(self, x0, record)


def _reorder(a, order):
    """a[:, order] for weights [n, 2, B, T]; the identity order costs no copy."""
    return a if order == [0, 1] else a[:, order]


class _DARStream:
    """Every state holds both streams in one tensor [2, B, T, d], stream m at index m, so that one
    depth-attention pass retrieves for both targets."""

    def __init__(self, mod, x0, record):
        self.m, self.record = mod, record
        self.history = [x0.expand(2, *x0.shape)]  # completed block states; both streams start as x0 (a view)
        self.inv = [_rms_inv(x0).expand(2, *x0.shape[:-1])]  # their norm factors, computed once
        self.P = None  # in-block partial states [2, B, T, d]

    def _close_block(self):
        self.history.append(self.P)
        self.inv.append(_rms_inv(self.P))
        self.P = None

    def _retrieve(self, j, site):
        """h = alpha_0 r_0 + alpha_1 r_1,  r_t = sum softmax(w_t . RMSNorm(keys of t)) values of t."""
        m = self.m
        S, inv = self.history, self.inv
        if m.include_partial and self.P is not None:
            S, inv = S + [self.P], inv + [_rms_inv(self.P)]
        if m.routing == "fixed_kv":  # both targets read stream 0's keys and stream 1's values: two queries
            a = depth_weights(m.w[j], [s[0] for s in S], [i[0] for i in inv], impl=m.impl)  # [n, target, B, T]
            values, reader = [s[1] for s in S], [0, 1]
        else:  # slice s of every source is read by the target whose keys (values) live in stream s
            a = _reorder(depth_weights(m.w[j, m.key_reader], S, inv, per_query=True, impl=m.impl), m.key_of)
            values, reader = S, m.value_reader  # a: [n, target, B, T]
        alpha = m.theta_alpha[j].softmax(0)  # per target
        if self.record is not None:
            self.record[site] = a.movedim(1, 0).detach()  # [2 targets, n, B, T]
            self.record[site + "/alpha"] = alpha.detach()
        a, alpha = _reorder(a, reader), alpha[reader]  # ordered as the values: slice s for target reader[s]
        if m.routing != "sep_v" and j not in m.ablate:  # alpha folded into the weights: one weighted sum
            a = a * alpha.view(1, 2, 1, 1)
            if m.routing == "fixed_kv":
                return depth_mix(a.sum(1, keepdim=True), values, impl=m.impl)[0]
            return depth_mix(a, values, fuse=True, impl=m.impl)
        r = depth_mix(a, values, impl=m.impl)  # r[s]: the retrieval of target reader[s]
        if m.routing == "sep_v":
            r = r @ m.v_proj[reader].mT.unsqueeze(1)  # [2, 1, d, d] against r [2, B, T, d]
        if j in m.ablate:  # diagnostics: a target's retrieval replaced by its token mean
            lost = torch.tensor([t in m.ablate[j] for t in reader], device=r.device).view(2, 1, 1, 1)
            r = torch.where(lost, r.mean(dim=(1, 2), keepdim=True), r)
        return alpha[0] * r[0] + alpha[1] * r[1]

    def read(self, j):
        if j > 0 and j % self.m.K == 0:
            self._close_block()
        return self._retrieve(j, _site_name(j))

    def write(self, j, y):
        beta = 2 * torch.sigmoid(self.m.theta_beta[j]).view(2, 1, 1, 1)
        if self.P is None:  # first sublayer of a block
            self.P = beta * y
        else:  # P_m <- rho P_m + (1 - rho) P_o + beta_m y: a doubly-stochastic 2 x 2 transport of the streams
            rho = torch.sigmoid(self.m.theta_rho[j])
            M = torch.stack([torch.stack([rho, 1 - rho]), torch.stack([1 - rho, rho])])
            with _float32_routing(y):  # a matmul over the stream axis: saves no new source-sized tensor
                self.P = (M.to(self.P.dtype) @ self.P.flatten(1)).view_as(self.P) + beta * y
        if self.record is not None:  # each stream's state: everything it holds, x0 + its blocks + P_m
            self.record[f"state.{j}"] = (sum(self.history) + self.P).detach()

    def readout(self):
        self._close_block()
        return self._retrieve(-1, "readout")


# ----------------------------------------------------------------------------------------------
# Hyper-Connections (section 6): n parallel residual streams H [B, T, n, d], each starting as x0,
# mixed by per-token matrices; summed before the final norm.


class HyperConnections(nn.Module):
    """Dynamic Hyper-Connections (Zhu et al.), per sublayer j:
        h = sum_i Am_i H_i;   H_i <- sum_k Ar_{k,i} H_k + B_i y
    each coefficient static + s * tanh(RMSNorm(H_k) . W): Am, B from W[..., 0], W[..., -1] with
    scale s_beta for B; Ar from W[..., 1:n+1] with scale s_alpha.
    Init: W = 0, s = 0.01, B = 1, Am one-hot at j mod n, Ar = I: exactly the pre-norm residual.
    (So s_alpha and s_beta start with a zero gradient: tanh(0) = 0; W's gradient is non-zero.)"""

    def __init__(self, cfg):
        super().__init__()
        L, d, n = 2 * cfg.n_layer, cfg.n_embd, cfg.hc_streams
        self.n = n
        self.Am = nn.Parameter(torch.zeros(L, n))
        self.Ar = nn.Parameter(torch.zeros(L, n, n))
        self.B = nn.Parameter(torch.zeros(L, n))
        self.W = nn.Parameter(torch.zeros(L, d, n + 2))
        self.s_alpha = nn.Parameter(torch.zeros(L))
        self.s_beta = nn.Parameter(torch.zeros(L))

    @torch.no_grad()
    def reset_parameters(self, rng):
        L, n = self.Am.shape
        self.Am.zero_()
        self.Am[torch.arange(L), torch.arange(L) % n] = 1.0
        self.Ar.copy_(torch.eye(n).expand_as(self.Ar))
        self.B.fill_(1.0)
        self.W.zero_()
        self.s_alpha.fill_(0.01)
        self.s_beta.fill_(0.01)

    def start(self, x0, record=None):
        return _MultiStream(self, x0, record)

    def coefficients(self, j, H):
        """(pre [B, T, n], res [B, T, n_target, n_source], post [B, T, n]) for sublayer j."""
        n = self.n
        dyn = norm(H) @ self.W[j].to(H.dtype)  # [B, T, n, n + 2], row k from stream k
        pre = self.Am[j] + self.s_alpha[j] * torch.tanh(dyn[..., 0])
        res = self.Ar[j] + self.s_alpha[j] * torch.tanh(dyn[..., 1:n + 1])  # [B, T, k, i]
        post = self.B[j] + self.s_beta[j] * torch.tanh(dyn[..., -1])
        return pre, res.transpose(-1, -2), post


class ManifoldHC(nn.Module):
    """Manifold-constrained Hyper-Connections (DeepSeek mHC), per sublayer j, from x = RMSNorm of
    the flattened n*d state and one projection phi[j] [n*d, 2n + n^2], all in float32:
        H_pre  = sigmoid(a_pre z_pre + b_pre)              [n]
        H_post = 2 sigmoid(a_post z_post + b_post)         [n]
        H_res  = SinkhornKnopp(exp(a_res z_res + b_res))   [n, n], doubly stochastic
    h = sum_i H_pre_i H_i;  H_i <- sum_k H_res[i, k] H_k + H_post_i y.
    Init [our reading]: phi ~ normal(0, 0.02) and a = 0.01 (a small dynamic part whose gains all
    have gradients); b_pre = +3 at stream j mod n, -3 elsewhere (one-hot-ish reads that break the
    symmetry of streams all starting at x0); b_post = 0 (every stream gets y); b_res = 2 I, so
    H_res starts near the identity (diagonal 0.88 for n = 2, 0.71 for n = 4) with logits far from
    exp's underflow. 20 Sinkhorn-Knopp iterations make rows and columns sum to 1 within 1e-5 while
    the logits' spread stays moderate; a larger diagonal would converge too slowly for that."""

    def __init__(self, cfg):
        super().__init__()
        L, d, n = 2 * cfg.n_layer, cfg.n_embd, cfg.hc_streams
        self.n = n
        self.phi = nn.Parameter(torch.zeros(L, n * d, 2 * n + n * n))
        self.a = nn.Parameter(torch.zeros(L, 3))  # gains of (pre, post, res)
        self.b_pre = nn.Parameter(torch.zeros(L, n))
        self.b_post = nn.Parameter(torch.zeros(L, n))
        self.b_res = nn.Parameter(torch.zeros(L, n, n))

    @torch.no_grad()
    def reset_parameters(self, rng):
        L, n = self.b_pre.shape
        self.phi.copy_(torch.empty(self.phi.shape).normal_(0.0, 0.02, generator=rng("phi")))
        self.a.fill_(0.01)
        self.b_pre.fill_(-3.0)
        self.b_pre[torch.arange(L), torch.arange(L) % n] = 3.0
        self.b_post.zero_()
        self.b_res.copy_(2.0 * torch.eye(n).expand_as(self.b_res))

    def start(self, x0, record=None):
        return _MultiStream(self, x0, record)

    def coefficients(self, j, H):
        n, dt = self.n, _compute_dtype(H)
        x = norm(H.flatten(-2).to(dt))  # [B, T, n*d]
        z = x @ self.phi[j].to(dt)
        a = self.a[j].to(dt)
        pre = torch.sigmoid(a[0] * z[..., :n] + self.b_pre[j])
        post = 2 * torch.sigmoid(a[1] * z[..., n:2 * n] + self.b_post[j])
        res = sinkhorn_knopp(a[2] * z[..., 2 * n:].unflatten(-1, (n, n)) + self.b_res[j])
        return pre.to(H.dtype), res.to(H.dtype), post.to(H.dtype)


def sinkhorn_knopp(logits, iters=20):
    """Project exp(logits) onto the doubly-stochastic matrices: alternate row and column scaling."""
    M = torch.exp(logits - logits.amax(dim=(-2, -1), keepdim=True))
    for _ in range(iters):
        M = M / M.sum(-1, keepdim=True)
        M = M / M.sum(-2, keepdim=True)
    return M


class _MultiStream:
    """The stream state shared by HC and mHC: H [B, T, n, d]."""

    def __init__(self, mod, x0, record):
        self.m, self.record = mod, record
        self.H = x0.unsqueeze(-2).expand(*x0.shape[:-1], mod.n, x0.size(-1))

    def read(self, j):
        pre, self.res, self.post = self.m.coefficients(j, self.H)
        if self.record is not None:
            site = _site_name(j)
            self.record[site + "/pre"], self.record[site + "/res"] = pre.detach(), self.res.detach()
            self.record[site + "/post"] = self.post.detach()
        return torch.einsum("btn,btnd->btd", pre, self.H)

    def write(self, j, y):
        self.H = torch.einsum("btik,btkd->btid", self.res, self.H) + self.post.unsqueeze(-1) * y.unsqueeze(-2)
        if self.record is not None:
            self.record[f"state.{j}"] = self.H.detach()

    def readout(self):
        return self.H.sum(-2)


# ----------------------------------------------------------------------------------------------
# The transformer: RMSNorm pre-norms without gains, rotary attention with QK-norm, ReLU^2 MLP.


def norm(x):
    return F.rms_norm(x, (x.size(-1),))


def rotary(x, cos, sin):
    """Rotate the two halves of each head's channels by position-dependent angles (RoPE)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class KVCache:
    """Keys and values of past positions, per layer, for incremental decoding. Depth routing works
    per position, so the attention keys and values are all that any residual variant needs cached."""

    def __init__(self, cfg, batch_size, device=None, dtype=torch.float32):
        shape = (cfg.n_layer, batch_size, cfg.n_head, cfg.block_size, cfg.n_embd // cfg.n_head)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.pos = 0  # positions filled so far

    def update(self, layer, k, v):
        T = k.size(2)
        self.k[layer, :, :, self.pos:self.pos + T] = k
        self.v[layer, :, :, self.pos:self.pos + T] = v
        return self.k[layer, :, :, :self.pos + T], self.v[layer, :, :, :self.pos + T]


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        d = cfg.n_embd
        self.n_head, self.head_dim = cfg.n_head, d // cfg.n_head
        self.c_q = nn.Linear(d, d, bias=False)
        self.c_k = nn.Linear(d, d, bias=False)
        self.c_v = nn.Linear(d, d, bias=False)
        self.c_proj = nn.Linear(d, d, bias=False)

    def forward(self, h, cos, sin, layer, cache=None):
        """h is the sublayer input, or (h_QK, h_V) when RD-AttnRes routes values separately."""
        h_qk, h_v = h if isinstance(h, tuple) else (h, None)
        x_qk = norm(h_qk)
        x_v = x_qk if h_v is None else norm(h_v)
        B, T, _ = x_qk.shape
        q = self.c_q(x_qk).view(B, T, self.n_head, self.head_dim)
        k = self.c_k(x_qk).view(B, T, self.n_head, self.head_dim)
        v = self.c_v(x_v).view(B, T, self.n_head, self.head_dim)
        q, k = rotary(norm(q), cos, sin), rotary(norm(k), cos, sin)  # QK-norm, then RoPE
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        mask, causal = None, True
        if cache is not None:
            P = cache.pos
            k, v = cache.update(layer, k, v)
            if P > 0:  # queries at P..P+T-1 see keys 0..their own position
                causal = False
                mask = torch.arange(P + T, device=q.device) <= torch.arange(P, P + T, device=q.device)[:, None]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, cfg.mlp_ratio * cfg.n_embd, bias=False)
        self.c_proj = nn.Linear(cfg.mlp_ratio * cfg.n_embd, cfg.n_embd, bias=False)

    def forward(self, h):
        return self.c_proj(F.relu(self.c_fc(norm(h))).square())


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.attn = CausalSelfAttention(cfg)
        self.mlp = MLP(cfg)


def make_residual(cfg):
    if cfg.residual == "standard":
        return StandardResidual()
    if cfg.residual == "dar":
        return DualAttnRes(cfg)
    if cfg.residual == "hc":
        return HyperConnections(cfg)
    if cfg.residual == "mhc":
        return ManifoldHC(cfg)
    return AttnRes(cfg)


class GPT(nn.Module):
    def __init__(self, cfg, seed=0):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.router = make_residual(cfg)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        hd = cfg.n_embd // cfg.n_head
        freqs = cfg.rope_base ** (-torch.arange(0, hd, 2, dtype=torch.float32) / hd)
        angles = torch.outer(torch.arange(cfg.block_size, dtype=torch.float32), freqs)
        self.register_buffer("cos", angles.cos()[:, None, :], persistent=False)  # [T, 1, hd/2]
        self.register_buffer("sin", angles.sin()[:, None, :], persistent=False)
        self.init_weights(seed)

    @torch.no_grad()
    def init_weights(self, seed):
        """Every tensor's init. Each weight draws from its own generator seeded by (seed, name), so
        two variants built with one seed share every common weight bit for bit (section 8).
            wte, c_q, c_k, c_v, c_fc, lm_head   normal(0, 0.02)                    (GPT-2)
            attn.c_proj, mlp.c_proj             normal(0, 0.02 / sqrt(2 n_layer))  (GPT-2's scaled residual init)
            router.*                            the variant's own: see its reset_parameters (pseudo-queries zero)
        """
        std_out = 0.02 / math.sqrt(2 * self.cfg.n_layer)
        def rng(name):
            return torch.Generator().manual_seed(param_seed(seed, name))

        for name, p in self.named_parameters():
            if not name.startswith("router."):
                std = std_out if name.endswith("c_proj.weight") else 0.02
                p.copy_(torch.empty(p.shape).normal_(0.0, std, generator=rng(name)))
        self.router.reset_parameters(lambda name: rng("router." + name))

    def param_groups(self, weight_decay):
        """AdamW groups: matrices decay; depth-routing parameters (pseudo-queries, gates) never do."""
        routing = {id(p) for p in self.router.parameters()}
        decay, no_decay = [], []
        for p in self.parameters():
            if p.requires_grad:
                (no_decay if id(p) in routing or p.dim() < 2 else decay).append(p)
        return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]

    def num_params(self, trainable_only=False):
        return sum(p.numel() for p in self.parameters() if p.requires_grad or not trainable_only)

    def flops_per_token(self):
        """Training FLOPs per token: 6 per matmul weight, plus attention's 12 * layers * d * T."""
        c = self.cfg
        n_matmul = self.num_params() - self.wte.weight.numel() * (not c.tie_embeddings)
        return 6 * n_matmul + 12 * c.n_layer * c.n_embd * c.block_size

    def forward(self, idx, targets=None, kv_cache=None, routing=None):
        """idx [B, T] token ids. Returns (logits, loss); loss is None without targets.
        kv_cache: a KVCache for incremental decoding. routing: a dict to fill with each site's
        depth-routing weights [n_sources, B, T] (RD-AttnRes attention sites: [n, 2, B, T], QK
        route then V route)."""
        B, T = idx.shape
        P = kv_cache.pos if kv_cache is not None else 0
        if P + T > self.cfg.block_size:
            raise ValueError(f"sequence of {P + T} positions exceeds block_size={self.cfg.block_size}")
        cos, sin = self.cos[P:P + T].to(self.wte.weight.dtype), self.sin[P:P + T].to(self.wte.weight.dtype)
        stream = self.router.start(self.wte(idx), routing)
        for i, block in enumerate(self.blocks):
            stream.write(2 * i, block.attn(stream.read(2 * i), cos, sin, i, kv_cache))
            stream.write(2 * i + 1, block.mlp(stream.read(2 * i + 1)))
        if kv_cache is not None:
            kv_cache.pos += T
        logits = self.lm_head(norm(stream.readout()))
        logits = logits.to(_compute_dtype(logits))  # float32 loss (float64 in tests)
        if self.cfg.logit_softcap > 0:
            logits = self.cfg.logit_softcap * torch.tanh(logits / self.cfg.logit_softcap)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss


def param_seed(seed, name):
    """A stable 63-bit seed for one parameter (Python's hash() is salted per process)."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:8], "little") >> 1
