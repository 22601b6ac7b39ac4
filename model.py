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

One primitive, `depth_attention`, carries AttnRes, RD-AttnRes and DAR.
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
# [Q, d] to route Q queries over the same sources in one pass (RD-AttnRes' two routes); the outputs
# then get a leading Q axis. Everything runs in float32 (float64 for float64 models).


def _compute_dtype(t):
    return torch.promote_types(t.dtype, torch.float32)


def depth_attention_reference(w, keys, values=None):
    """The math above in plain autograd. Readable, but it saves a float copy of every normalised key
    at every site: Full AttnRes then keeps O(L^2) source-sized tensors alive for backward."""
    values = keys if values is None else values
    dt, d = _compute_dtype(keys[0]), w.shape[-1]
    W = w.reshape(-1, d).to(dt)  # [Q, d]
    logits = torch.stack([F.rms_norm(k.to(dt), (d,), eps=torch.finfo(dt).eps) @ W.T for k in keys])  # [n, ..., Q]
    a = logits.softmax(0)
    h = sum(a_r.unsqueeze(-1) * v.to(dt).unsqueeze(-2) for a_r, v in zip(a, values))  # [..., Q, d]
    h, a = h.movedim(-2, 0).to(values[0].dtype), a.movedim(-1, 1)  # [Q, ..., d], [n, Q, ...]
    return (h, a) if w.dim() == 2 else (h[0], a[:, 0])


class _DepthAttention(torch.autograd.Function):
    """The same math with a hand-written backward. It saves only the inputs themselves (references
    to source tensors that already exist, never copies), the softmax and the per-source norm factors
    ([n, ...] each); backward recomputes the rest. So every site of Full AttnRes adds O(n B T) floats,
    not O(n B T d), and no float32 copies of bf16 sources outlive the forward pass. Each source is
    read once per pass through a matmul or a fused reduction, never through a product temporary."""

    @staticmethod
    def forward(ctx, W, n, *kv):  # W [Q, d]
        keys, values = kv[:n], (kv[n:] or kv[:n])
        dt, d = _compute_dtype(keys[0]), W.shape[-1]
        Wf = W.to(dt)
        inv = torch.stack([torch.rsqrt(torch.linalg.vector_norm(k.to(dt), dim=-1).square() / d + torch.finfo(dt).eps)
                           for k in keys])  # [n, ...] 1 / rms(k_r)
        logits = torch.stack([(k.to(dt) @ Wf.T).movedim(-1, 0) * inv_r for k, inv_r in zip(keys, inv)])  # [n, Q, ...]
        a = logits.softmax(0)
        h = a[0].unsqueeze(-1) * values[0].to(dt)
        for a_r, v in zip(a[1:], values[1:]):
            h.addcmul_(a_r.unsqueeze(-1), v.to(dt))  # [Q, ..., d]
        ctx.n, ctx.d, ctx.shared = n, d, len(kv) == n
        ctx.save_for_backward(W, a, logits, inv, *kv)
        return h.to(values[0].dtype), a

    @staticmethod
    def backward(ctx, g, _ga):
        W, a, logits, inv, *kv = ctx.saved_tensors
        n, d = ctx.n, ctx.d
        keys, values = kv[:n], (kv[:n] if ctx.shared else kv[n:])
        dt = a.dtype
        g, Wf = g.to(dt), W.to(dt)
        da = torch.stack([(g * v.to(dt)).sum(-1) for v in values])  # dL/da_r = g . v_r  [n, Q, ...]
        dl = a * (da - (a * da).sum(0, keepdim=True))  # softmax backward
        c = dl * inv.unsqueeze(1)  # dL/d(W k_r): the norm factor folded in
        coef = (dl * logits).sum(1) * inv.square() / d  # logit_r = inv_r (W k_r), d inv_r/d k_r = -inv_r^3 k_r / d
        gW = torch.zeros_like(Wf)
        gk, gv = [], []
        for r in range(n):
            k = keys[r].to(dt)
            gW += c[r].reshape(len(Wf), -1) @ k.reshape(-1, d)
            gk.append((c[r].movedim(0, -1) @ Wf).addcmul_(coef[r].unsqueeze(-1), k, value=-1))
            gv.append((a[r].unsqueeze(-1) * g).sum(0))  # sum over the Q routes
        grads = [x + y for x, y in zip(gk, gv)] if ctx.shared else gk + gv
        return (gW.to(W.dtype), None, *[gr.to(t.dtype) for gr, t in zip(grads, kv)])


def depth_attention(w, keys, values=None, impl="lean"):
    """h = sum_r softmax_r(w . RMSNorm(k_r)) v_r. Returns (h, a): h [..., d] and the routing weights
    a [n, ...] for w [d]; h [Q, ..., d] and a [n, Q, ...] for w [Q, d]."""
    if impl == "reference":
        return depth_attention_reference(w, keys, values)
    h, a = _DepthAttention.apply(w.reshape(-1, w.shape[-1]), len(keys), *keys, *([] if values is None else values))
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

    def _attend(self, w, site):
        sources = self.completed + ([self.partial] if self.partial is not None else [])
        h, a = depth_attention(w, sources, impl=self.m.impl)
        if self.record is not None:
            self.record[site] = a.detach()
        return h

    def read(self, j):
        m = self.m
        if j > 0 and j % m.S == 0:  # Eq. 5: a block boundary closes the partial sum
            self.completed.append(self.partial)
            self.partial = None
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

    def readout(self):
        self.completed.append(self.partial)
        self.partial = None
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
        self.key_of, self.value_of = DAR_ROUTES[self.routing]
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


class _DARStream:
    def __init__(self, mod, x0, record):
        self.m, self.record = mod, record
        # completed block states of each stream, both starting at x0 (a view: torch.compile cannot trace
        # one tensor passed twice to the depth-attention Function, as cross routing would)
        self.history = ([x0], [x0.view_as(x0)])
        self.P = [None, None]  # in-block partial states

    def _close_block(self):
        for s in (0, 1):
            self.history[s].append(self.P[s])
        self.P = [None, None]

    def _retrieve(self, j, site):
        """h = alpha_0 r_0 + alpha_1 r_1,  r_m = sum softmax(w_m . RMSNorm(keys)) values."""
        m = self.m
        S = [self.history[s] + ([self.P[s]] if m.include_partial and self.P[s] is not None else []) for s in (0, 1)]
        r, a = [], []
        for t in (0, 1):
            keys, values = S[m.key_of[t]], S[m.value_of[t]]
            r_t, a_t = depth_attention(m.w[j, t], keys, None if keys is values else values, impl=m.impl)
            r_t = r_t @ m.v_proj[t].T if m.routing == "sep_v" else r_t
            if t in m.ablate.get(j, ()):
                r_t = r_t.mean(dim=(0, 1), keepdim=True).expand_as(r_t)
            r.append(r_t)
            a.append(a_t)
        alpha = m.theta_alpha[j].softmax(0)
        if self.record is not None:
            self.record[site] = torch.stack(a).detach()  # [2 targets, n, B, T]
            self.record[site + "/alpha"] = alpha.detach()
        return alpha[0] * r[0] + alpha[1] * r[1]

    def read(self, j):
        if j > 0 and j % self.m.K == 0:
            self._close_block()
        return self._retrieve(j, _site_name(j))

    def write(self, j, y):
        beta = 2 * torch.sigmoid(self.m.theta_beta[j])
        P0, P1 = self.P
        if P0 is None:  # first sublayer of a block
            self.P = [beta[0] * y, beta[1] * y]
        else:
            rho = torch.sigmoid(self.m.theta_rho[j])
            self.P = [rho * P0 + (1 - rho) * P1 + beta[0] * y, (1 - rho) * P0 + rho * P1 + beta[1] * y]
        if self.record is not None:  # each stream's state: everything it holds, x0 + its blocks + P_m
            self.record[f"state.{j}"] = torch.stack([sum(self.history[s]) + self.P[s] for s in (0, 1)]).detach()

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
