"""
A decoder-only GPT with depth-routing residual connections.

Every residual variant answers two questions for sublayer j (attention or MLP, L = 2 * n_layer of
them): what is its input h_j, and where does its output y_j = F_j(PreNorm_j(h_j)) go? The sublayers
themselves never change. The math contract is VARIANTS.md; section numbers below refer to it.

    standard       h_{j+1} = h_j + y_j                                        (section 1)
    full_attnres   h_j = depth attention over [x0, y_0, .., y_{j-1}]          (section 2, AttnRes Eq. 1-4)
    block_attnres  h_j = depth attention over block sums [x0, b_1, .., partial]  (section 3, Eq. 5-6)
    rd_attnres     Block AttnRes, but attention reads Q/K and V through two routes (section 4)

One primitive, `depth_attention`, carries all of them.
"""

import hashlib
import math
from dataclasses import dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F

RESIDUALS = ("standard", "full_attnres", "block_attnres", "rd_attnres")
RD_MODES = ("decoupled", "tied", "average", "frozen_v")
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
        need(self.attnres_block_size >= 1, f"attnres_block_size counts sublayers and must be >= 1, got {self.attnres_block_size}")
        need(self.depth_impl in DEPTH_IMPLS, f"unknown depth_impl {self.depth_impl!r}; choose one of {', '.join(DEPTH_IMPLS)}")
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "mlp_ratio"):
            need(getattr(self, name) >= 1, f"{name} must be >= 1, got {getattr(self, name)}")
        need(self.n_embd % self.n_head == 0, f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        need((self.n_embd // self.n_head) % 2 == 0, f"head dim n_embd/n_head={self.n_embd // self.n_head} must be even for rotary embeddings")
        need(self.logit_softcap >= 0, f"logit_softcap must be >= 0, got {self.logit_softcap}")

    @classmethod
    def keys(cls):
        return [f.name for f in fields(cls)]


# ----------------------------------------------------------------------------------------------
# Depth attention (section 0): the one primitive of the AttnRes family.
#
#     logit_r = w . RMSNorm(k_r)      per token; no temperature, no 1/sqrt(d); the key norm has no gain
#     a       = softmax_r(logit)      over the depth axis                     (w.(g*k) = (w*g).k, so a
#     h       = sum_r a_r * v_r       values are the raw sources              gain would be redundant)
#
# Keys and values are lists of n tensors [..., d] (usually the same list). The query w broadcasts
# against a key: w [d] gives one route; w [Q, 1, 1, d] routes Q queries over the same sources in one
# pass (RD-AttnRes' two routes). Everything runs in float32 (float64 for float64 models).


def _compute_dtype(t):
    return torch.promote_types(t.dtype, torch.float32)


def depth_attention_reference(w, keys, values=None):
    """The math above in plain autograd. Readable, but it saves a float copy of every normalised key
    at every site: Full AttnRes then keeps O(L^2) source-sized tensors alive for backward."""
    values = keys if values is None else values
    dt = _compute_dtype(keys[0])
    d = w.shape[-1]
    logits = torch.stack([(F.rms_norm(k.to(dt), (d,), eps=torch.finfo(dt).eps) * w.to(dt)).sum(-1) for k in keys])
    a = logits.softmax(0)  # [n, ...]
    h = sum(a_r.unsqueeze(-1) * v.to(dt) for a_r, v in zip(a, values))
    return h.to(values[0].dtype), a


class _DepthAttention(torch.autograd.Function):
    """The same math with a hand-written backward. It saves only the inputs themselves (references
    to source tensors that already exist, never copies), the [n, ...] softmax and the per-source norm
    factors; backward recomputes the rest. So every site of Full AttnRes adds O(n * B * T) floats,
    not O(n * B * T * d), and no float32 copies of bf16 sources outlive the forward pass."""

    @staticmethod
    def forward(ctx, w, n, *kv):
        keys, values = kv[:n], (kv[n:] or kv[:n])
        dt = _compute_dtype(keys[0])
        eps, d = torch.finfo(dt).eps, w.shape[-1]
        wf = w.to(dt)
        inv = torch.stack([torch.rsqrt(k.to(dt).pow(2).mean(-1) + eps) for k in keys])  # 1 / rms(k_r)
        logits = torch.stack([(k.to(dt) * wf).sum(-1) * inv_r for k, inv_r in zip(keys, inv)])  # [n, ...]
        a = logits.softmax(0)
        h = sum(a_r.unsqueeze(-1) * v.to(dt) for a_r, v in zip(a, values))
        ctx.n, ctx.d, ctx.shared = n, d, len(kv) == n
        ctx.save_for_backward(w, a, logits, inv, *kv)
        return h.to(values[0].dtype), a

    @staticmethod
    def backward(ctx, g, _ga):
        w, a, logits, inv, *kv = ctx.saved_tensors
        n, d = ctx.n, ctx.d
        keys, values = kv[:n], (kv if ctx.shared else kv[n:])
        dt = a.dtype
        g, wf = g.to(dt), w.to(dt)
        da = torch.stack([(g * v.to(dt)).sum(-1) for v in values])  # dL/da_r = g . v_r
        dl = a * (da - (a * da).sum(0, keepdim=True))  # softmax backward
        gw = torch.zeros_like(wf)
        grads = []
        for r in range(n):
            k = keys[r].to(dt)
            c = (dl[r] * inv[r]).unsqueeze(-1)  # dL/d(w . k_r) before the norm factor
            gw = gw + (c * k).sum_to_size(wf.shape)
            # logit_r = inv_r (w . k_r), d inv_r / d k_r = -inv_r^3 k_r / d
            gk = c * wf - (dl[r] * logits[r] * inv[r].pow(2) / d).unsqueeze(-1) * k
            grads.append(gk.sum_to_size(k.shape))
        gv = [(a_r.unsqueeze(-1) * g).sum_to_size(v.shape) for a_r, v in zip(a, values)]
        if ctx.shared:
            grads = [gk + gvr for gk, gvr in zip(grads, gv)]
        else:
            grads = grads + gv
        return (gw.to(w.dtype), None, *[gr.to(t.dtype) for gr, t in zip(grads, kv)])


def depth_attention(w, keys, values=None, impl="lean"):
    """h = sum_r softmax_r(w . RMSNorm(k_r)) v_r. Returns (h, a) with a the [n, ...] routing weights."""
    if impl == "reference":
        return depth_attention_reference(w, keys, values)
    return _DepthAttention.apply(w, len(keys), *keys, *([] if values is None else values))


# ----------------------------------------------------------------------------------------------
# Residual variants. Each is a module that holds its parameters and starts, per forward pass, a
# stream object with three methods: read(j) -> h_j, write(j, y_j), readout() -> final hidden state.


class StandardResidual(nn.Module):
    """Section 1: h_{j+1} = h_j + y_j, h_0 = x0."""

    def reset_parameters(self):
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
    def reset_parameters(self):
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
        site = f"{'attn' if j % 2 == 0 else 'mlp'}.{j // 2}"
        if m.rd_mode is None or m.rd_mode == "tied" or j % 2 == 1:
            return self._attend(m.w[j], site)
        # RD-AttnRes at an attention sublayer: both routes in one pass over the same normalised keys
        W = torch.stack([m.w[j], m.w_v[j // 2]]).view(2, 1, 1, -1)  # [2, 1, 1, d] against [B, T, d]
        h_qk, h_v = self._attend(W, site)
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
            router.*                            the variant's own, deterministic (pseudo-queries zero)
        """
        std_out = 0.02 / math.sqrt(2 * self.cfg.n_layer)
        for name, p in self.named_parameters():
            if name.startswith("router."):
                continue
            g = torch.Generator().manual_seed(param_seed(seed, name))
            std = std_out if name.endswith("c_proj.weight") else 0.02
            p.copy_(torch.empty(p.shape, dtype=torch.float32).normal_(0.0, std, generator=g))
        self.router.reset_parameters()

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
