"""A decoder-only GPT with depth-routing residual connections in plain autograd (the math: VARIANTS.md, by section).
A variant answers, for sublayer j (attention or MLP, L = 2 * n_layer): what is its input h_j, and where does
y_j = F_j(PreNorm_j(h_j)) go? GPT asks its stream: h_j = stream.read(j); stream.write(j, y_j).
model_fast.py holds the fast twins, tested equal."""

import hashlib
import math
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint


def need(ok, message):
    if not ok:
        raise ValueError(message)


def key(default, help):
    """A config key: its default and its meaning (python train.py --help prints it)."""
    return field(default=default, metadata={"help": help})


@dataclass
class GPTConfig:  # the model's keys; a bad value is a ValueError naming it (train.py: one `error:` line)
    vocab_size: int = key(50304, "GPT-2's 50257, padded to a multiple of 64 (train.py: the data's, padded)")
    block_size: int = key(1024, "context length")
    n_layer: int = key(12, "transformer layers (two sublayers each)")
    n_head: int = key(6, "attention heads (head dim n_embd / n_head, even)")
    n_embd: int = key(768, "model width")
    mlp_ratio: int = key(4, "MLP width / n_embd")
    mlp_hidden: int | None = key(None, "the MLP's hidden width; None: mlp_ratio * n_embd (parameter-matched controls)")
    tie_embeddings: bool = key(False, "share wte and lm_head")
    rope_base: float = key(10000.0, "rotary embeddings' base")
    logit_softcap: float = key(0.0, "0 = off; else logits = c * tanh(logits / c)")
    residual: str = key("standard", "a name in RESIDUALS (the table of variants; VARIANTS.md)")
    attnres_block_size: int = key(4, "S, in sublayers (4 = two transformer layers); block_attnres, rd_attnres")
    rd_mode: str | None = key(None, "rd_attnres only: decoupled (None), tied, average or frozen_v")
    dar_block_size: int = key(2, "K, in transformer layers (2K sublayers); 1 is Full DAR")
    dar_include_partial: bool = key(True, "the current in-block state is a candidate source")
    dar_routing: str | None = key(None, "dar only: cross (None), self_kv, cross_v, fixed_kv or sep_v")
    hc_streams: int = key(4, "n, for hc and mhc (mhc with 2 is the DAR paper's mHC-2 baseline)")
    denseformer_dilation: int | None = key(None, "k, in transformer layers; denseformer only; None means 1")
    denseformer_period: int | None = key(None, "p, a DWA after every p-th layer; denseformer only; None means 1")
    delta_block_size: int | None = key(None, "S, in sublayers; delta_attnres only; None means 1 (per sublayer)")
    depth_impl: str = key("two_phase", "model_fast.make_model: two_phase (the fast twins) or reference (plain)")
    depth_chunk: int = key(4, "two_phase: sites that share one phase 1, rounded up to whole blocks (speed only)")
    activation_checkpointing: bool = key(False, "recompute each sublayer's internals in backward (memory only)")

    def __post_init__(self):
        need(self.residual in RESIDUALS, f"unknown residual {self.residual!r}; choose one of {', '.join(RESIDUALS)}")
        for name, owner in FLAG_OWNERS.items():  # a flag of one family refuses every other variant
            owners = " or ".join(repr(r) for r, cls in RESIDUALS.items() if issubclass(cls, owner))
            need(getattr(self, name) is None or issubclass(RESIDUALS[self.residual], owner), f"{name}="
                 f"{getattr(self, name)!r} only applies to residual={owners} (got residual={self.residual!r}); drop {name}")
        for name, choices in (("rd_mode", RD_MODES), ("dar_routing", DAR_STREAMS), ("depth_impl", DEPTH_IMPLS)):
            need(getattr(self, name) in (None, *choices), f"unknown {name} {getattr(self, name)!r}: one of {', '.join(choices)}")
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "mlp_ratio", "mlp_hidden", "hc_streams",
                     "dar_block_size", "attnres_block_size", "delta_block_size", "depth_chunk"):
            need(getattr(self, name) is None or getattr(self, name) >= 1, f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("denseformer_dilation", "denseformer_period"):
            need(getattr(self, name) is None or 1 <= getattr(self, name) <= self.n_layer,
                 f"{name} counts transformer layers: between 1 and n_layer={self.n_layer}, got {getattr(self, name)}")
        need(self.n_embd % self.n_head == 0 and self.n_embd // self.n_head % 2 == 0,
             f"n_embd={self.n_embd} / n_head={self.n_head} must be a whole, even head dim (rotary)")
        need(self.logit_softcap >= 0 and self.rope_base > 0, "logit_softcap must be >= 0 and rope_base > 0")

# The transformer: RMSNorm pre-norms without gains, rotary attention with QK-norm, ReLU^2 MLP.


def norm(x):
    return F.rms_norm(x, (x.size(-1),))


def rotary(x, cos, sin):
    """RoPE: rotate the two halves of each head's channels by position-dependent angles."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg, norm_project=None):
        super().__init__()
        d = cfg.n_embd
        self.n_head, self.head_dim = cfg.n_head, d // cfg.n_head
        self.norm_project = norm_project  # FastGPT's linear(norm(h)) (model_fast.norm_project, the same numbers)
        self.c_q, self.c_k, self.c_v, self.c_proj = (nn.Linear(d, d, bias=False) for _ in range(4))

    def forward(self, h, cos, sin, layer, cache=None):
        """h: h_j, or (h_QK, h_V) (RD-AttnRes), or (h_Q, h_K, h_V)."""
        h = h if isinstance(h, tuple) else (h,)
        h_q, h_k, h_v = h if len(h) == 3 else (h[0], h[0], h[-1])
        x_q = norm(h_q)
        B, T, _ = x_q.shape
        q = self.c_q(x_q).view(B, T, self.n_head, self.head_dim)
        k = (self.c_k(x_q) if h_k is h_q else self.normed(self.c_k, h_k)).view(B, T, self.n_head, self.head_dim)
        v = (self.c_v(x_q) if h_v is h_q else self.normed(self.c_v, h_v)).view(B, T, self.n_head, self.head_dim)
        q, k = rotary(norm(q), cos, sin), rotary(norm(k), cos, sin)  # QK-norm, then RoPE
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        mask = None
        if cache is not None:
            pos, (k, v) = cache.pos, cache.update(layer, k, v)
            if pos > 0:  # queries at pos..pos+T-1 see keys 0..their own position
                mask = torch.arange(pos + T, device=q.device) <= torch.arange(pos, pos + T, device=q.device)[:, None]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, -1))

    def normed(self, linear, h):  # linear(norm(h)) for a K or V input of its own
        if self.norm_project is not None and torch.is_grad_enabled() and h.requires_grad:
            return self.norm_project(h, linear.weight)
        return linear(norm(h))


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        hidden = cfg.mlp_hidden or cfg.mlp_ratio * cfg.n_embd
        self.c_fc = nn.Linear(cfg.n_embd, hidden, bias=False)
        self.c_proj = nn.Linear(hidden, cfg.n_embd, bias=False)

    def forward(self, h):
        return self.c_proj(F.relu(self.c_fc(norm(h))).square())


class Block(nn.Module):
    def __init__(self, cfg, norm_project=None):
        super().__init__()
        self.attn = CausalSelfAttention(cfg, norm_project)
        self.mlp = MLP(cfg)


# Depth attention (section 0), and the dtype rule: every depth mix in float32 (float64 models: float64).


def compute_dtype(t):
    return torch.promote_types(t.dtype, torch.float32)


def float32_routing(t):
    """Autocast off: the routing math stays in float32."""
    return torch.autocast(t.device.type, enabled=False) if torch.is_autocast_enabled(t.device.type) else nullcontext()


def autocast_of(t):
    """The caller's autocast (re-entered for the sublayers), or none."""
    dev = t.device.type
    return torch.autocast(dev, dtype=torch.get_autocast_dtype(dev)) if torch.is_autocast_enabled(dev) else nullcontext()


def depth_attention(w, keys, values=None, bias=None):
    """Section 0: h = sum_r softmax_r(w . RMSNorm(k_r) + bias_r) v_r (values: the keys if None; bias: an additive
    logit per source, or none), in float32; returns (h, a)."""
    values = keys if values is None else values
    dt = compute_dtype(keys[0])
    with float32_routing(w):
        logits = torch.stack([norm(k.to(dt)) @ w.to(dt) for k in keys])  # per token
        if bias is not None:
            logits = logits + bias.to(dt).view(-1, *(1,) * (logits.dim() - 1))
        a = logits.softmax(0)  # over the depth axis
        h = sum(a_r.unsqueeze(-1) * v.to(dt) for a_r, v in zip(a, values))  # values are the raw sources
    return h.to(values[0].dtype), a


# Residual variants: a module holds the parameters and starts, per forward pass, a stream: read(j), write(j, y), readout().


def site_name(j, L=None):
    return "readout" if j == L else f"{'attn' if j % 2 == 0 else 'mlp'}.{j // 2}"


def note(record, key, value):  # diagnostics: keep value (detached) under key when forward was given a record
    if record is not None:
        record[key] = value.detach()


class StandardResidual(nn.Module):
    """Section 1: h_{j+1} = h_j + y_j, h_0 = x0."""

    def __init__(self, cfg=None):
        super().__init__()

    def reset_parameters(self, rng):
        pass

    def start(self, x0, record=None):
        return SumStream(x0)


class SumStream:
    def __init__(self, x0):
        self.h = x0

    def read(self, j):
        return self.h

    def write(self, j, y):
        self.h = self.h + y

    def readout(self):
        return self.h


class AttnRes(nn.Module):
    """Sections 2-3, Block Attention Residuals: sublayer j attends with pseudo-query w[j] (the readout: w[L])
    over blocks of S = attnres_block_size sublayers; zero-init, so routing starts uniform."""

    S = None  # sublayers per block: attnres_block_size, unless a subclass fixes it (FullAttnRes: 1)
    uniform_at_zero_queries = True  # zero queries mix uniformly: the family's reductions (test_equivalence.py)

    def __init__(self, cfg):
        super().__init__()
        self.L, self.S = 2 * cfg.n_layer, self.S or cfg.attnres_block_size
        self.w = nn.Parameter(torch.zeros(self.L + 1, cfg.n_embd))

    @torch.no_grad()
    def reset_parameters(self, rng):
        self.w.zero_()

    def queries(self, j):
        """Site j's pseudo-queries [routes, d]."""
        return self.w[j:j + 1]

    def combine(self, h):
        """The input from the routes' retrievals: h_j, (h_QK, h_V) or (h_Q, h_K, h_V)."""
        return h[0] if len(h) == 1 else tuple(h)

    def start(self, x0, record=None):
        return AttnResStream(self, x0, record)


class FullAttnRes(AttnRes):
    """Section 2: every sublayer output is a source of its own (S = 1)."""

    S = 1


RD_MODES = ("decoupled", "tied", "average", "frozen_v")
DEPTH_IMPLS = ("two_phase", "reference")  # model_fast.make_model's fast twins, or the plain streams


class RDAttnRes(AttnRes):
    """Section 4, Role-Decoupled AttnRes: attention sublayers read Q/K with w[j] and V with w_v[i] (rd_mode: docs/model.md)."""

    route_names = ("QK route", "V route")  # a site's query rows, as tools/diagnose.py labels them

    def __init__(self, cfg):
        super().__init__(cfg)
        self.rd_mode = cfg.rd_mode or "decoupled"
        if self.rd_mode != "tied":
            self.w_v = nn.Parameter(torch.zeros(cfg.n_layer, cfg.n_embd), requires_grad=self.rd_mode != "frozen_v")

    @torch.no_grad()
    def reset_parameters(self, rng):
        super().reset_parameters(rng)
        if self.rd_mode != "tied":
            self.w_v.zero_()

    def queries(self, j):
        if self.rd_mode != "tied" and j % 2 == 0 and j < self.L:
            return torch.cat([self.w[j:j + 1], self.w_v[j // 2:j // 2 + 1]])
        return self.w[j:j + 1]

    def combine(self, h):
        if self.rd_mode == "average" and len(h) == 2:
            return 0.5 * (h[0] + h[1])  # control: two routes, no role separation
        return super().combine(h)


class AttnResStream:
    """Eq. 1-6: site j attends over the completed blocks b_0 = x0, b_1, .. and the partial sum, once per route."""

    def __init__(self, mod, x0, record=None):
        self.mod, self.record = mod, record
        self.blocks, self.partial = [x0], None

    def read(self, j):
        if j > 0 and j % self.mod.S == 0:  # Eq. 5: a block boundary closes the partial sum
            self.blocks, self.partial = self.blocks + [self.partial], None
        return self.site(j, self.blocks + ([self.partial] if self.partial is not None else []))

    def write(self, j, y):
        self.partial = y if self.partial is None else self.partial.to(self.blocks[0].dtype) + y  # in x0's dtype

    def readout(self):  # site L, read as every site is
        self.blocks, self.partial = self.blocks + [self.partial], None
        return self.site(self.mod.L, self.blocks)

    def site(self, j, sources):
        h, a = zip(*[depth_attention(w, sources) for w in self.mod.queries(j)])  # Eq. 6, one per route
        note(self.record, site_name(j, self.mod.L), torch.stack(a, 1).squeeze(1))
        return self.mod.combine(h)


# dar_routing -> for targets m = 0 and m = 1: (the stream of its keys, the stream of its values)
DAR_STREAMS = {
    "cross": ((1, 0), (0, 1)),  # keys from the opposite stream, values from the target's own
    "self_kv": ((0, 0), (1, 1)),  # two independent retrievers
    "cross_v": ((0, 1), (1, 0)),  # keys own, values opposite
    "fixed_kv": ((0, 1), (0, 1)),  # stream 0 supplies every key, stream 1 every value
    "sep_v": ((0, 0), (1, 1)),  # self_kv plus a learned value projection per stream
}


class DualAttnRes(nn.Module):
    """Section 5, Dual Attention Residuals: two streams m = 0, 1, blocks of K = dar_block_size layers. Per site j:
    pseudo-queries w[j, m]; fusion alpha_j = softmax(theta_alpha[j]); transport rho_j = sigmoid(theta_rho[j]);
    gated write beta_jm = 2 sigmoid(theta_beta[j, m]). The inits break the streams' symmetry (docs/model.md)."""

    def __init__(self, cfg):
        super().__init__()
        L, d = 2 * cfg.n_layer, cfg.n_embd
        self.L, self.S = L, 2 * cfg.dar_block_size  # sublayers per block
        self.include_partial = cfg.dar_include_partial
        self.routing = cfg.dar_routing or "cross"
        self.streams = DAR_STREAMS[self.routing]
        self.w = nn.Parameter(torch.zeros(L + 1, 2, d))
        self.theta_alpha = nn.Parameter(torch.zeros(L + 1, 2))
        self.theta_rho = nn.Parameter(torch.zeros(L))  # used by the non-first sublayers of a block
        self.theta_beta = nn.Parameter(torch.zeros(L, 2))
        if self.routing == "sep_v":
            self.v_proj = nn.Parameter(torch.zeros(2, d, d))

    @torch.no_grad()
    def reset_parameters(self, rng):
        self.w.zero_()
        mine = torch.arange(self.theta_alpha.size(0)) % 2  # stream j mod 2: attention 0, MLP 1 (readout 0)
        half = 0.5 * math.log(0.6 / 0.4)
        self.theta_alpha.fill_(-half)
        self.theta_alpha[torch.arange(len(mine)), mine] = half
        self.theta_rho.fill_(4.0)
        self.theta_beta.fill_(-2.0)
        self.theta_beta[torch.arange(len(mine) - 1), mine[:-1]] = 0.0
        if self.routing == "sep_v":
            self.v_proj.copy_(torch.eye(self.v_proj.size(-1)).expand_as(self.v_proj))

    def start(self, x0, record=None):
        return DARStream(self, x0, record)


def transport(P, rho, beta, y):
    """P'_m = rho P_m + (1 - rho) P_o + beta_m y: doubly-stochastic transport of P [2, B, T, d], then the gated write."""
    y = y.to(P.dtype)  # beta_m y in bf16 would round every write (a 0-dim beta_m does not promote y)
    P_0 = rho * P[0] + (1 - rho) * P[1] + beta[0] * y
    P_1 = (1 - rho) * P[0] + rho * P[1] + beta[1] * y
    return torch.stack([P_0, P_1])


class DARStream:
    """Both streams' blocks and partial states P_m in one [2, B, T, d]; target m reads the streams DAR_STREAMS names."""

    def __init__(self, mod, x0, record=None):
        self.mod, self.record = mod, record
        self.blocks, self.partial = [x0.expand(2, *x0.shape)], None  # both streams start as x0

    def read(self, j):
        if j > 0 and j % self.mod.S == 0:  # a block boundary: the partial state joins the blocks
            self.blocks, self.partial = self.blocks + [self.partial], None
        return self.fuse(j, self.retrieve(j))

    def retrieve(self, j):
        """r_m = sum softmax(w_{j,m} . RMSNorm(keys of m)) values of m, for both targets m."""
        mod = self.mod
        sources = self.blocks + ([self.partial] if mod.include_partial and self.partial is not None else [])
        r, a = zip(*[depth_attention(mod.w[j, m], [s[ks] for s in sources], [s[vs] for s in sources])
                     for m, (ks, vs) in enumerate(mod.streams)])
        note(self.record, site_name(j, mod.L), torch.stack(a))  # [2 targets, n, B, T]
        if mod.routing == "sep_v":
            r = [r_m @ mod.v_proj[m].T for m, r_m in enumerate(r)]
        return r

    def fuse(self, j, r):
        """h = alpha_0 r_0 + alpha_1 r_1, the fused input of the unchanged branch."""
        alpha = self.mod.theta_alpha[j].softmax(0)
        note(self.record, site_name(j, self.mod.L) + "/alpha", alpha)
        return alpha[0] * r[0] + alpha[1] * r[1]

    transport = staticmethod(transport)  # (the fast twin writes with its elementwise one)

    def write(self, j, y):
        beta = 2 * torch.sigmoid(self.mod.theta_beta[j])
        if self.partial is None:  # first sublayer of a block
            self.partial = beta.view(2, 1, 1, 1) * y
        else:
            self.partial = self.transport(self.partial, torch.sigmoid(self.mod.theta_rho[j]), beta, y)
        if self.record is not None:  # each stream's state: x0 + its blocks + P_m
            note(self.record, f"state.{j}", sum(self.blocks) + self.partial)

    def readout(self):  # the readout is site j = L: w[L], theta_alpha[L]
        self.blocks, self.partial = self.blocks + [self.partial], None
        return self.fuse(self.mod.L, self.retrieve(self.mod.L))


# Hyper-Connections (section 6): n residual streams H [B, T, n, d] from x0, mixed per token, summed at the end.


class HyperConnections(nn.Module):
    """Section 6, Dynamic Hyper-Connections (Zhu et al.), per sublayer j: h = sum_i Am_i H_i and
    H_i <- sum_k Ar_{k,i} H_k + B_i y, each coefficient static + s * tanh(RMSNorm(H_k) . W)."""

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
        return MultiStream(self, x0, record)

    def coefficients(self, j, H):
        """(pre [B, T, n], res [B, T, n_target, n_source], post [B, T, n]) for sublayer j."""
        dyn = norm(H) @ self.W[j].to(H.dtype)  # [B, T, n, n + 2], row k from stream k
        pre = self.Am[j] + self.s_alpha[j] * torch.tanh(dyn[..., 0])
        res = self.Ar[j] + self.s_alpha[j] * torch.tanh(dyn[..., 1:self.n + 1])  # [B, T, k, i]
        post = self.B[j] + self.s_beta[j] * torch.tanh(dyn[..., -1])
        return pre, res.transpose(-1, -2), post


class ManifoldHC(nn.Module):
    """Section 6, manifold-constrained HC (DeepSeek mHC), per sublayer j, from z = RMSNorm(H flat) @ phi[j]:
    H_pre = sigmoid(a z + b), H_post = 2 sigmoid(a z + b), H_res = SinkhornKnopp(exp(a z + b)) (doubly stochastic);
    h = sum_i H_pre_i H_i;  H_i <- sum_k H_res[i, k] H_k + H_post_i y."""

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
        return MultiStream(self, x0, record)

    def coefficients(self, j, H):
        n, dt = self.n, compute_dtype(H)
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


class MultiStream:
    """The stream state shared by HC and mHC: H [B, T, n, d]."""

    def __init__(self, mod, x0, record):
        self.mod, self.record = mod, record
        self.H = x0.unsqueeze(-2).expand(*x0.shape[:-1], mod.n, x0.size(-1))

    def read(self, j):
        pre, self.res, self.post = self.mod.coefficients(j, self.H)
        for name, value in (("pre", pre), ("res", self.res), ("post", self.post)):
            note(self.record, f"{site_name(j)}/{name}", value)
        return torch.einsum("btn,btnd->btd", pre, self.H)

    def write(self, j, y):
        self.H = torch.einsum("btik,btkd->btid", self.res, self.H) + self.post.unsqueeze(-1) * y.unsqueeze(-2)
        note(self.record, f"state.{j}", self.H)

    def readout(self):
        return self.H.sum(-2)


# Section 7. DenseFormer and MUDDFormer mix whole layers' outputs X_0 = x0, X_1, .., X_D (D = n_layer), as their papers.


class DenseFormer(nn.Module):
    """Section 7.1, DenseFormer (arXiv 2402.02622): after every p-th layer i a depth-weighted average (DWA)
    Y_i = sum_{j in S(i)} alpha_{i,j} X_j, S(i) = {0 <= j <= i: j = i mod k}; layer i+1 reads Y_i, the readout Y_D."""

    def __init__(self, cfg):
        super().__init__()
        self.k, self.p = cfg.denseformer_dilation or 1, cfg.denseformer_period or 1
        self.alpha = nn.ParameterDict({str(i): nn.Parameter(torch.zeros(i // self.k + 1))  # |S(i)|
                                       for i in range(self.p, cfg.n_layer + 1, self.p)})

    @torch.no_grad()
    def reset_parameters(self, rng):
        for a in self.alpha.values():
            a.zero_()
            a[-1] = 1.0  # alpha_{i,i} = 1: the identity

    def start(self, x0, record=None):
        return DenseStream(self, x0, record)


class DenseStream:
    def __init__(self, mod, x0, record):
        self.mod, self.record = mod, record
        self.X, self.Y = [x0], x0  # X_0 = x0, Y_0 = X_0

    def read(self, j):
        return self.Y if j % 2 == 0 else self.h  # the attention reads Y_i, the MLP the in-layer residual

    def write(self, j, y):
        if j % 2 == 0:
            self.h = self.Y + y  # m = Y_i + attn
            return
        self.X.append(self.h + y)  # X_i
        i, mod = len(self.X) - 1, self.mod  # layer i (1-based) has ended
        self.Y = self.X[-1]
        if i % mod.p == 0:  # DWA: Y_i = sum_{j in S(i)} alpha_{i,j} X_j
            alpha = mod.alpha[str(i)]
            self.Y = sum(a * X for a, X in zip(alpha.unbind(), self.X[i % mod.k::mod.k]))
            note(self.record, f"dwa.{i}", alpha)  # [|S(i)|], static: the same for every token

    def readout(self):
        return self.Y


class MUDDFormer(nn.Module):
    """Section 7.2, MUDDFormer (arXiv 2502.12170): after layer i, per token, one mix per way c in Q, K, V, R:
    Z_i^c = sum_j A_i[c, j] X_j, A_i = W2_i GELU(W1_i RMSNorm(X_i)) + a_i; layer i+1 reads them, the readout Z_D."""

    def __init__(self, cfg):
        super().__init__()
        D, d = cfg.n_layer, cfg.n_embd
        ways = [4] * (D - 1) + [1]  # C_i: Q, K, V, R; one way after the last layer
        expand = [1] * (D - 1) + [4]  # e_i
        n = range(2, D + 2)  # sources after layer i = 1..D: i + 1
        hidden = [(C * n_i * e // 64 + 1) * 64 for C, n_i, e in zip(ways, n, expand)]  # round64: 64 -> 128
        self.W1 = nn.ParameterList(nn.Parameter(torch.zeros(d, H)) for H in hidden)
        self.W2 = nn.ParameterList(nn.Parameter(torch.zeros(H, C * n_i)) for H, C, n_i in zip(hidden, ways, n))
        self.a = nn.ParameterList(nn.Parameter(torch.zeros(C, n_i)) for C, n_i in zip(ways, n))

    @torch.no_grad()
    def reset_parameters(self, rng):
        for i, (W1, W2, a) in enumerate(zip(self.W1, self.W2, self.a)):
            W1.copy_(torch.empty(W1.shape).normal_(0.0, W1.size(0) ** -0.5, generator=rng(f"W1.{i}")))
            W2.zero_()
            a.zero_()
            a[:, -1] = 1.0  # every way reads the current output X_i

    def start(self, x0, record=None):
        return MuddStream(self, x0, record)

    def weights(self, i, X):
        """A_i [C_i, i+1, B, T] (way-major) from the output of layer i, X = X_i, in float32."""
        W1, W2, a, dt = self.W1[i - 1], self.W2[i - 1], self.a[i - 1], compute_dtype(X)
        A = F.gelu(norm(X.to(dt)) @ W1.to(dt)) @ W2.to(dt) + a.flatten().to(dt)
        return A.unflatten(-1, a.shape).permute(2, 3, 0, 1)


class MuddStream:
    def __init__(self, mod, x0, record):
        self.mod, self.record = mod, record
        self.X, self.Z = [x0], (x0,) * 4  # the first layer reads x0 in every way

    def read(self, j):
        return self.Z[:3] if j % 2 == 0 else self.h  # (Z^Q, Z^K, Z^V); the MLP reads m

    def write(self, j, y):
        if j % 2 == 0:
            self.h = self.Z[3] + y  # m = Z^R + attn
            return
        self.X.append(self.h + y)  # X_i
        i = len(self.X) - 1  # layer i (1-based) has ended
        A = self.mod.weights(i, self.X[-1])
        self.Z = sum(A[:, j].unsqueeze(-1) * X for j, X in enumerate(self.X)).unbind(0)  # Z_i^c = sum_j A_i[c, j] X_j
        # recorded under the site that reads the mix: the next layer's attention, [4, n, B, T] (readout: [n, B, T])
        note(self.record, f"attn.{i}" if len(self.Z) > 1 else "readout", A if len(self.Z) > 1 else A[0])

    def readout(self):
        return self.Z[0]


class DeltaAttnRes(nn.Module):
    """Section 7.3, Delta AttnRes (arXiv 2605.18855): the standard stream h~ stays, each input adds depth attention
    over the completed blocks: h_j = h~_j + depth_attention(w_j, [x0, b_1, ..]);  h~_{j+1} = h~_j + y_j."""

    def __init__(self, cfg):
        super().__init__()
        self.L, self.S = 2 * cfg.n_layer, cfg.delta_block_size or 1
        self.w = nn.Parameter(torch.zeros(self.L, cfg.n_embd))

    @torch.no_grad()
    def reset_parameters(self, rng):
        self.w.zero_()  # uniform routing at init: S = 1 is then the standard residual up to the norms' eps

    def start(self, x0, record=None):
        return DeltaStream(self, x0, record)


class DeltaStream:
    def __init__(self, mod, x0, record=None):
        self.mod, self.record = mod, record
        self.h, self.blocks, self.partial = x0, [x0], None  # h~, the standard stream; the completed blocks

    def read(self, j):
        if j > 0 and j % self.mod.S == 0:  # a block boundary closes the partial sum: b = sum of the block's y
            self.blocks, self.partial = self.blocks + [self.partial], None
        r, a = depth_attention(self.mod.w[j], self.blocks)  # completed blocks only
        note(self.record, site_name(j), a)
        return self.h + r

    def write(self, j, y):
        self.h = self.h + y
        self.partial = y if self.partial is None else self.partial.to(self.blocks[0].dtype) + y  # in x0's dtype

    def readout(self):
        return self.h


# The one list of variants: name (the `residual` key) -> module. train.model_config accepts exactly its names.
RESIDUALS = {
    "standard": StandardResidual,
    "full_attnres": FullAttnRes,
    "block_attnres": AttnRes,
    "rd_attnres": RDAttnRes,
    "dar": DualAttnRes,
    "hc": HyperConnections,
    "mhc": ManifoldHC,
    "denseformer": DenseFormer,
    "muddformer": MUDDFormer,
    "delta_attnres": DeltaAttnRes,
}
# a flag of one family of variants -> the class its residual must be (or subclass)
FLAG_OWNERS = {"rd_mode": RDAttnRes, "dar_routing": DualAttnRes, "denseformer_dilation": DenseFormer,
               "denseformer_period": DenseFormer, "delta_block_size": DeltaAttnRes}


def make_residual(cfg):
    return RESIDUALS[cfg.residual](cfg)  # (GPTConfig checked the name)


# The model: the sublayers in order on a variant's stream; then activation checkpointing, rotary tables, init.


class GPT(nn.Module):
    norm_project = None  # FastGPT's (model_fast.py)

    def __init__(self, cfg, seed=0):
        super().__init__()
        self.cfg = cfg
        norm_project = None if cfg.activation_checkpointing else self.norm_project  # (which recomputes the sublayer)
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg, norm_project) for _ in range(cfg.n_layer))
        self.residual = make_residual(cfg)  # the variant: its parameters, and a stream per forward pass
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        for name, table in zip(("cos", "sin"), rotary_tables(cfg)):  # [T, 1, hd/2]; on the meta device for a meta model
            self.register_buffer(name, table.to(self.wte.weight.device), persistent=False)
        if not self.wte.weight.is_meta:  # built on the meta device (FSDP: train.sharded_model), values come later
            self.init_weights(seed)

    def forward(self, idx, targets=None, kv_cache=None, record=None):
        """idx [B, T] -> (logits, loss or None). kv_cache: sample.KVCache; record: a dict for diagnostics (docs/model.md)."""
        B, T = idx.shape
        pos = kv_cache.pos if kv_cache is not None else 0
        if pos + T > self.cfg.block_size:
            raise ValueError(f"sequence of {pos + T} positions exceeds block_size={self.cfg.block_size}")
        cos, sin = self.cos[pos:pos + T].to(self.wte.weight.dtype), self.sin[pos:pos + T].to(self.wte.weight.dtype)
        x0 = self.wte(idx)
        # F_j(PreNorm_j(h_j)) is checkpointed, not the routing: its sources are read by later sites anyway
        ckpt = self.cfg.activation_checkpointing and kv_cache is None and torch.is_grad_enabled()
        sublayer, amp = checkpointed if ckpt else call, autocast_of(x0)  # amp: the caller's autocast, if any
        with float32_routing(x0):  # the dtype rule: every depth mix with autocast off; the sublayers in amp
            stream = self.start_stream(x0, record)
            for i, block in enumerate(self.blocks):
                stream.write(2 * i, sublayer(amp, block.attn, stream.read(2 * i), cos, sin, i, kv_cache))
                stream.write(2 * i + 1, sublayer(amp, block.mlp, stream.read(2 * i + 1)))
            h = stream.readout()
        if kv_cache is not None:
            kv_cache.pos += T
        logits = self.lm_head(norm(h))
        logits = logits.to(compute_dtype(logits))  # float32 loss (float64 in tests)
        if self.cfg.logit_softcap > 0:
            logits = self.cfg.logit_softcap * torch.tanh(logits / self.cfg.logit_softcap)
        loss = None if targets is None else F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss

    def start_stream(self, x0, record=None):
        """The variant's stream for one forward pass (FastGPT: its fast twin)."""
        return self.residual.start(x0, record)

    def param_groups(self, weight_decay):
        """AdamW groups: matrices decay; depth-routing parameters (pseudo-queries, gates) never do."""
        residual, decay, no_decay = {id(p) for p in self.residual.parameters()}, [], []
        for p in (p for p in self.parameters() if p.requires_grad):
            (no_decay if id(p) in residual or p.dim() < 2 else decay).append(p)
        return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]

    def num_params(self, trainable_only=False):
        return sum(p.numel() for p in self.parameters() if p.requires_grad or not trainable_only)

    def flops_per_token(self):
        """Training FLOPs per token: 6 per matmul weight, plus attention's 12 * layers * d * T."""
        c = self.cfg
        n_matmul = self.num_params() - self.wte.weight.numel() * (not c.tie_embeddings)
        return 6 * n_matmul + 12 * c.n_layer * c.n_embd * c.block_size

    @torch.no_grad()
    def init_weights(self, seed):
        """Every parameter to its initial value for this seed (InitialWeights)."""
        init = InitialWeights(self.cfg, seed)
        for name, p in self.named_parameters():
            p.copy_(init(name, p.shape))

    @torch.no_grad()
    def init_buffers(self):
        """The rotary tables again (a model built on the meta device has none)."""
        for buffer, table in zip((self.cos, self.sin), rotary_tables(self.cfg)):
            buffer.copy_(table)


def call(amp, f, *args):  # f(*args) under autocast amp
    with amp:
        return f(*args)


def checkpointed(amp, f, *args):  # the same, its internals recomputed in backward (activation_checkpointing)
    return torch.utils.checkpoint.checkpoint(call, amp, f, *args, use_reentrant=False)


def rotary_tables(cfg):
    """RoPE's (cos, sin) [block_size, 1, head_dim / 2], float32, on the CPU: the same bits on every device."""
    hd = cfg.n_embd // cfg.n_head
    freqs = cfg.rope_base ** (-torch.arange(0, hd, 2, dtype=torch.float32, device="cpu") / hd)
    angles = torch.outer(torch.arange(cfg.block_size, dtype=torch.float32, device="cpu"), freqs)
    return angles.cos()[:, None, :], angles.sin()[:, None, :]


class InitialWeights:
    """Section 8: every parameter's initial value by name, init(name, shape), from a generator seeded by
    (seed, name), so variants built with one seed share every common weight."""

    def __init__(self, cfg, seed):
        self.cfg, self.seed, self._residual = cfg, seed, None

    def rng(self, name):
        return torch.Generator().manual_seed(stable_seed(self.seed, name))

    @torch.no_grad()
    def __call__(self, name, shape):
        if name.startswith("residual."):
            value = self.residual()[name.removeprefix("residual.")]
            if value.shape != torch.Size(shape):
                raise ValueError(f"{name} has shape {tuple(value.shape)} in its module, not {tuple(shape)}")
            return value
        std = 0.02 / math.sqrt(2 * self.cfg.n_layer) if name.endswith("c_proj.weight") else 0.02
        return torch.empty(shape, device="cpu").normal_(0.0, std, generator=self.rng(name))

    def residual(self):
        """{name: value} of the residual module's parameters after its reset_parameters."""
        if self._residual is None:
            with torch.device("cpu"):
                module = make_residual(self.cfg)
            module.reset_parameters(lambda name: self.rng("router." + name))  # the module's first name: seeds keep their draws
            self._residual = {name: p.detach() for name, p in module.named_parameters()}
        return self._residual


def stable_seed(seed, name):
    """A 63-bit seed for (seed, name), the same in every process and machine."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:8], "little") >> 1
