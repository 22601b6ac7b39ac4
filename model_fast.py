"""The fast path of model.py (depth_impl="two_phase", the default): its AttnRes, DAR and Delta AttnRes streams routed in
two phases, tested equal to the plain streams (tests/test_routing.py). A chunk of sites knows its queries (parameters)
when it opens. Phase 1, once per chunk: every query over the sources completed before it (lse_q, o_q). Phase 2, per site:
the sources added since join by the online softmax, h = c_o o_q + sum_k c_k s_k, (c_o, c_k) = softmax(lse_q, l_k). A
source is [*, d] ([M, *, d]: DAR's two streams), N = prod(*). Routing runs in the compute dtype, autocast off."""

import dataclasses
import functools
import math
import sys
from pathlib import Path

import torch
import torch._functorch.config
import torch.nn.functional as F
from torch.autograd import Function

import model
from common import UserError, need
from model import compute_dtype, float32_routing


def autocast_off(t):
    """Autocast off: a custom Function's backward computes in its own dtype, even traced by torch.compile."""
    return torch.autocast(t.device.type, enabled=False)


def needs_grad(*tensors):
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _softmax0(x):
    """(softmax, logsumexp) over dim 0 of a small [n, ...] tensor, elementwise (faster there than torch's)."""
    m = x.amax(0)
    e = (x - m).exp_()
    z = e.sum(0)
    return e.div_(z), z.log_().add_(m)


class _RMSInv(Function):
    """rms_inv with a one-pass backward, dinv/dk = -inv^3 k / d."""

    @staticmethod
    def forward(ctx, k):
        inv = _rms_inv(k)
        ctx.save_for_backward(k, inv)
        return inv

    @staticmethod
    def backward(ctx, g):
        k, inv = ctx.saved_tensors
        with autocast_off(k):
            return ((g * inv.pow(3) / -k.size(-1)).unsqueeze(-1) * k.to(inv.dtype)).to(k.dtype)


def _rms_inv(k):
    """1 / rms(k) over the last dim in the compute dtype, by F.rms_norm's ops (its bits)."""
    kf = k.to(compute_dtype(k))
    with float32_routing(k):
        return torch.rsqrt(kf.pow(2).mean(-1).add_(torch.finfo(kf.dtype).eps))


def rms_inv(k):
    """1 / rms(k) over channels: RMSNorm(k) = k * rms_inv(k), once per source."""
    return _RMSInv.apply(k) if needs_grad(k) else _rms_inv(k)


# Phase 1: every query of a chunk over the completed sources, in one pass.


def _rows(W, streams):
    """Per target t: (its query rows, key stream, value stream)."""
    Qt = len(W) // len(streams)
    return [(slice(t * Qt, (t + 1) * Qt), ks, vs) for t, (ks, vs) in enumerate(streams)]


def _phase1(W, inv, sources, streams):
    """W [Q, d], inv [n, M, N], sources n x [M, *, d] -> lse [N, Q], weights a [n, N, Q], o_q [N, d] per row, dots."""
    dt, (_, M, N), rows = inv.dtype, inv.shape, _rows(W, streams)
    W, sources = W.to(dt), [s.reshape(M, N, -1).to(dt) for s in sources]
    dots = torch.stack([torch.cat([s[ks] @ W[q].T for q, ks, _ in rows], -1) for s in sources])  # w_q . k_r
    inv_q = torch.cat([inv[:, ks].unsqueeze(-1).expand(-1, -1, q.stop - q.start) for q, ks, _ in rows], -1)
    a, lse = _softmax0(dots * inv_q)
    o = []
    for q, _, vs in rows:  # o_q = sum_r a_rq v_r, target t's rows at once
        O_t = a[0, :, q].unsqueeze(-1) * sources[0][vs].unsqueeze(1)
        for a_r, s in zip(a[1:], sources[1:]):
            O_t.addcmul_(a_r[:, q].unsqueeze(-1), s[vs].unsqueeze(1))
        o += O_t.unbind(1)
    return lse, a, o, dots


class _Phase1(Function):
    """_phase1 saving references to the sources; each o_q an output of its own (its gradient comes unpadded)."""

    @staticmethod
    def forward(ctx, W, inv, streams, *sources):
        lse, a, o, dots = _phase1(W, inv, sources, streams)
        ctx.streams = streams
        ctx.save_for_backward(W, inv, a, dots, *sources)
        ctx.mark_non_differentiable(a)
        return lse, a, *o

    @staticmethod
    def backward(ctx, g_lse, _, *g_o):
        W, inv, a, dots, *sources = ctx.saved_tensors
        with autocast_off(inv):
            dt, (_, M, N) = inv.dtype, inv.shape
            srcs = [s.reshape(M, N, -1).to(dt) for s in sources]
            Wf, rows = W.to(dt), _rows(W, ctx.streams)
            zero = torch.zeros_like(srcs[0][0]) if any(g is None for g in g_o) else None
            G = [torch.stack([zero if g is None else g.to(dt) for g in g_o[q]], 1) for q, _, _ in rows]  # [N, Qt, d]
            E = torch.stack([torch.cat([torch.bmm(s[vs].unsqueeze(1), G_t.transpose(1, 2)).squeeze(1)  # g_q . v_r
                                        for (_, _, vs), G_t in zip(rows, G)], -1) for s in srcs])
            dl = a * (E - (a * E).sum(0))  # dL/dl_rq: the softmax's backward ..
            if g_lse is not None:
                dl.addcmul_(a, g_lse)  # .. and lse's, dlse/dl = a
            gW, g_inv, g_src = torch.zeros_like(Wf), torch.zeros_like(inv), []
            for r, s in enumerate(srcs):
                g = [None] * M
                for (q, ks, vs), G_t in zip(rows, G):
                    gv = torch.bmm(a[r, :, q].unsqueeze(1), G_t).squeeze(1)  # dL/dv_r = sum_q a_rq g_q
                    g[vs] = gv if g[vs] is None else g[vs].add_(gv)
                    C = dl[r, :, q] * inv[r, ks].unsqueeze(-1)  # dL/d(w_q . k_r)
                    g[ks] = C @ Wf[q] if g[ks] is None else g[ks].addmm_(C, Wf[q])  # dL/dk_r
                    gW[q] += C.T @ s[ks]
                    g_inv[r, ks] += (dl[r, :, q] * dots[r, :, q]).sum(-1)
                g_src.append(torch.stack(g) if M > 1 else g[0])
        return gW.to(W.dtype), g_inv, None, *[g.reshape(s.shape).to(s.dtype) for g, s in zip(g_src, sources)]


# Phase 2: one site's query, merged with the sources added since its chunk opened.


def _merge(o, lse, w, keys, values, inv):
    """o [N, d], lse [N], w [d], keys/values K x [N, d], inv [K, N] -> h [N, d], c [K+1, N], dk [K, N]."""
    dt, w = inv.dtype, w.to(inv.dtype)
    dk = torch.stack([k.to(dt) @ w for k in keys])  # w . k_k
    c = _softmax0(torch.cat([lse.unsqueeze(0), dk * inv]))[0]  # (c_o, c_1, .., c_K)
    h = c[0].unsqueeze(-1) * o.to(dt)
    for c_k, v in zip(c[1:], values):
        h.addcmul_(c_k.unsqueeze(-1), v.to(dt))
    return h, c, dk


class _Merge(Function):
    """_merge; `shared`: keys are values. Saves h, not o: the gradient needs g . o only through g . h."""

    @staticmethod
    def forward(ctx, o, lse, w, inv, shared, *kv):
        K = len(inv)
        h, c, dk = _merge(o, lse, w, kv[:K], kv[:K] if shared else kv[K:], inv)
        ctx.shared, ctx.o_dtype = shared, o.dtype
        ctx.save_for_backward(h, w, inv, c, dk, *kv)
        return h

    @staticmethod
    def backward(ctx, g):
        h, w, inv, c, dk, *kv = ctx.saved_tensors
        with autocast_off(inv):
            K, dt = len(inv), inv.dtype
            keys, values = kv[:K], kv[:K] if ctx.shared else kv[K:]
            g, wf = g.to(dt), w.to(dt)
            gh = (g * h).sum(-1)
            dl = c[1:] * (torch.stack([(g * v.to(dt)).sum(-1) for v in values]) - gh)  # dL/dl_k = c_k (g.v_k - g.h)
            C = dl * inv  # dL/d(w . k_k)
            g_values = [c_k.unsqueeze(-1) * g for c_k in c[1:]]
            g_keys = [C_k.unsqueeze(-1) * wf for C_k in C] if not ctx.shared else \
                [gv.addcmul_(C_k.unsqueeze(-1), wf) for gv, C_k in zip(g_values, C)]
            gw = sum(C_k @ k.to(dt) for C_k, k in zip(C, keys))
        g_kv = g_keys if ctx.shared else g_keys + g_values
        return ((c[0].unsqueeze(-1) * g).to(ctx.o_dtype), -dl.sum(0), gw.to(w.dtype), dl * dk, None,
                *[gs.to(s.dtype) for gs, s in zip(g_kv, kv)])


def _merge_rows(O, lse, W, sources, inv):
    """_merge for R rows W [R, d] over the same sources (keys = values), one matmul per source."""
    dt, W = inv.dtype, W.to(inv.dtype)
    dk = torch.stack([s.to(dt) @ W.T for s in sources])  # w_r . k_k
    c = _softmax0(torch.cat([lse.unsqueeze(0), dk * inv.unsqueeze(-1)]))[0]
    H = []
    for r, o in enumerate(O):
        h = c[0, :, r].unsqueeze(-1) * o.to(dt)
        for c_k, s in zip(c[1:], sources):
            h.addcmul_(c_k[:, r].unsqueeze(-1), s.to(dt))
        H.append(h)
    return H, c, dk


class _MergeRows(Function):
    """_Merge for R rows sharing their sources (RD-AttnRes' w_QK, w_V): each source's gradient is written once."""

    @staticmethod
    def forward(ctx, lse, W, inv, R, *args):
        O, sources = args[:R], args[R:]
        H, c, dk = _merge_rows(O, lse, W, sources, inv)
        ctx.R, ctx.o_dtype = R, O[0].dtype
        ctx.save_for_backward(W, inv, c, dk, *H, *sources)
        return tuple(H)

    @staticmethod
    def backward(ctx, *G):
        W, inv, c, dk, *rest = ctx.saved_tensors
        H, sources = rest[:ctx.R], rest[ctx.R:]
        with autocast_off(inv):
            dt, Wf = inv.dtype, W.to(inv.dtype)
            G = [torch.zeros_like(h) if g is None else g.to(dt) for g, h in zip(G, H)]
            gh = torch.stack([(g * h).sum(-1) for g, h in zip(G, H)], -1)  # g_r . h_r, [N, R]
            S = [s.to(dt) for s in sources]
            E = torch.stack([torch.stack([(g * s).sum(-1) for g in G], -1) for s in S])  # g_r . s_k, [K, N, R]
            dl = c[1:] * (E - gh)  # dL/dl_kr = c_kr (g_r . s_k - g_r . h_r)
            C = dl * inv.unsqueeze(-1)  # dL/d(w_r . k_k)
            g_src = []
            for c_k, C_k in zip(c[1:], C):  # dL/ds_k = sum_r c_kr g_r + C_kr w_r: one write per source
                g_s = C_k @ Wf
                for r, g in enumerate(G):
                    g_s.addcmul_(c_k[:, r].unsqueeze(-1), g)
                g_src.append(g_s)
            gW = sum(C_k.T @ s for C_k, s in zip(C, S))
            g_o = [(c[0, :, r].unsqueeze(-1) * g).to(ctx.o_dtype) for r, g in enumerate(G)]
        return (-dl.sum(0), gW.to(W.dtype), (dl * dk).sum(-1), None, *g_o,
                *[g.to(s.dtype) for g, s in zip(g_src, sources)])


def merge_rows(O, lse, W, sources, inv):
    """Phase 2 for R rows of one site over the same recent sources, as R merges give it."""
    with float32_routing(W):
        inv = torch.stack(inv)
        if needs_grad(*O, lse, W, inv, *sources):
            return list(_MergeRows.apply(lse, W, inv, len(O), *O, *sources))
        return _merge_rows(O, lse, W, sources, inv)[0]


def _fused_merge(o, lse, alpha, W, streams, recent, inv):
    """DAR's fused h = sum_t alpha_t (c_o,t o_t + sum_k c_k,t R_k[value stream of t]) -> h, c, dk."""
    dt, alpha, W = inv.dtype, alpha.to(inv.dtype), W.to(inv.dtype)
    dk = torch.stack([torch.stack([R[ks].to(dt) @ w for w, (ks, _) in zip(W, streams)]) for R in recent]) \
        if recent else lse.new_empty(0, 2, lse.size(-1))
    key_inv = inv[:, [ks for ks, _ in streams]]  # [K, 2, N]
    c = _softmax0(torch.cat([lse.unsqueeze(0), dk * key_inv]))[0]
    cw = (c * alpha.view(1, 2, 1)).unsqueeze(-1)  # alpha folded into the coefficients
    h = cw[0, 0] * o[0].to(dt)
    h.addcmul_(cw[0, 1], o[1].to(dt))
    for k, R in enumerate(recent):
        for t, (_, vs) in enumerate(streams):
            h.addcmul_(cw[k + 1, t], R[vs].to(dt))
    return h, c, dk


class _FusedMerge(Function):
    """_fused_merge; g . h does not separate the targets: the backward recomputes g . o_t from the completed sources."""

    @staticmethod
    def forward(ctx, o0, o1, lse, a, alpha, W, inv, streams, K, *sources):
        h, c, dk = _fused_merge((o0, o1), lse, alpha, W, streams, sources[:K], inv)
        ctx.streams, ctx.K, ctx.o_dtype = streams, K, o0.dtype
        ctx.save_for_backward(a, alpha, W, inv, c, dk, *sources)
        return h

    @staticmethod
    def backward(ctx, g):
        a, alpha, W, inv, c, dk, *sources = ctx.saved_tensors
        recent, completed = sources[:ctx.K], sources[ctx.K:]
        with autocast_off(inv):
            dt, streams = inv.dtype, ctx.streams
            g, Wf, af = g.to(dt), W.to(dt), alpha.to(dt)
            vs_of = [vs for _, vs in streams]
            E = torch.stack([(V.to(dt) * g).sum(-1)[vs_of] for V in completed])  # [n, 2, N]: g . v_rt
            X = torch.stack([(a.transpose(1, 2) * E).sum(0)]  # [K+1, 2, N]: g . o_t, then g . R_k[value stream of t]
                            + [(R.to(dt) * g).sum(-1)[vs_of] for R in recent])
            r = (c * X).sum(0)  # g . r_t
            dl = c * af.view(1, 2, 1) * (X - r)  # dL/dlogits, per target: a softmax backward
            cw = (c * af.view(1, 2, 1)).unsqueeze(-1)
            g_recent, gW, g_inv = [], torch.zeros_like(Wf), torch.zeros_like(inv)
            for k, R in enumerate(recent):
                gR = torch.zeros(R.shape, dtype=dt, device=R.device)
                for t, (ks, vs) in enumerate(streams):
                    C = dl[k + 1, t] * inv[k, ks]
                    gR[vs].addcmul_(cw[k + 1, t], g)
                    gR[ks].addcmul_(C.unsqueeze(-1), Wf[t])
                    gW[t] += C @ R[ks].to(dt)
                    g_inv[k, ks] += dl[k + 1, t] * dk[k, t]
                g_recent.append(gR.to(R.dtype))
            g_o = [(cw[0, t] * g).to(ctx.o_dtype) for t in (0, 1)]
        return (*g_o, dl[0], None, r.sum(-1).to(alpha.dtype), gW.to(W.dtype), g_inv, None, None,
                *g_recent, *[None] * len(completed))


class TwoPhaseRouter:
    """Routes one chunk: opening it runs phase 1 over the completed sources; each read is phase 2."""

    def __init__(self, W, completed, inv, streams=None):
        self.W, self.streams = W, streams
        self.shape = completed[0].shape if streams is None else completed[0].shape[1:]  # [*, d] of an output
        self.Qt = len(W) // (1 if streams is None else len(streams))
        self.completed = self._flat(completed, [])[0] if streams else None
        M, streams = (1, ((0, 0),)) if streams is None else (completed[0].size(0), streams)
        with float32_routing(W):  # phase 1: lse [N, Q], a [n, N, Q], o_q [N, d] per row
            inv = torch.stack(inv).reshape(len(completed), M, -1)
            if needs_grad(W, inv, *completed):
                self.lse, self.a, *self.o = _Phase1.apply(W, inv, streams, *completed)
            else:
                self.lse, self.a, self.o = _phase1(W, inv, completed, streams)[:3]

    def _flat(self, sources, inv):
        """Sources [*, d] -> [N, d], norm factors [*] -> [N] (DAR's: after their stream axis)."""
        k = 0 if self.streams is None else 1
        return [s.flatten(k, -2) for s in sources], [i.flatten(k) for i in inv]

    def read(self, q, recent=(), inv=()):
        """h of query row q over the completed sources and `recent` (phase 2)."""
        o, lse, w = self.o[q], self.lse[:, q], self.W[q]
        if not recent:  # h = o_q; a copy of its own, so that saving it does not keep the chunk's O alive
            return (o if len(self.W) == 1 else o.clone()).view(self.shape)
        recent, inv = self._flat(recent, inv)
        keys = values = recent  # AttnRes: the keys are the values
        if self.streams is not None:  # one target of DAR: its key and value streams of each source
            ks, vs = self.streams[q // self.Qt]
            keys, values, inv = [R[ks] for R in recent], [R[vs] for R in recent], [i[ks] for i in inv]
        kv = keys if values is keys else keys + values
        with float32_routing(w):
            inv = torch.stack(inv)
            if needs_grad(o, lse, w, inv, *kv):
                return _Merge.apply(o, lse, w, inv, values is keys, *kv).view(self.shape)
            return _merge(o, lse, w, keys, values, inv)[0].view(self.shape)

    def read_rows(self, rows, recent=(), inv=()):
        """h of each of one site's rows, in one merge where they share their sources."""
        if len(rows) == 1 or not recent or self.streams is not None:
            return [self.read(q, recent, inv) for q in rows]
        H = merge_rows([self.o[q] for q in rows], self.lse[:, list(rows)], self.W[list(rows)], *self._flat(recent, inv))
        return [h.view(self.shape) for h in H]

    def read_fused(self, rows, alpha, recent=(), inv=()):
        """DAR: h = alpha_0 r_0 + alpha_1 r_1 for the rows (target 0's, target 1's)."""
        recent, inv = self._flat(recent, inv)
        o, lse, a, W = [self.o[q] for q in rows], self.lse[:, list(rows)].T, self.a[:, :, list(rows)], self.W[list(rows)]
        with float32_routing(W):
            inv = torch.stack(inv) if recent else lse.new_empty(0, self.completed[0].size(0), lse.size(-1))
            if needs_grad(*o, lse, alpha, W, inv, *recent):  # (the completed sources: for the backward's recomputation)
                h = _FusedMerge.apply(*o, lse, a, alpha, W, inv, self.streams, len(recent), *recent, *self.completed)
            else:
                h = _fused_merge(o, lse, alpha, W, self.streams, recent, inv)[0]
        return h.view(self.shape)


def _transport(P, rho, beta, y):
    out = torch.empty_like(P)
    torch.lerp(P[1], P[0], rho, out=out[0])  # P_o + rho (P_m - P_o)
    torch.lerp(P[0], P[1], rho, out=out[1])
    return out.addcmul_(beta.to(P.dtype).view(2, *[1] * y.dim()), y.to(P.dtype))


class _Transport(Function):
    """DAR's write P'_m = rho P_m + (1 - rho) P_o + beta_m y, elementwise (autograd's 2 x 2 matmul: slower on CPU)."""

    @staticmethod
    def forward(ctx, P, rho, beta, y):  # P [2, *, d], rho [], beta [2], y [*, d]
        ctx.save_for_backward(P, rho, beta, y)
        return _transport(P, rho, beta, y)

    @staticmethod
    def backward(ctx, g):
        P, rho, beta, y = ctx.saved_tensors
        with autocast_off(P):
            g = g.to(P.dtype)
            g_P = torch.empty_like(g)
            torch.lerp(g[1], g[0], rho, out=g_P[0])
            torch.lerp(g[0], g[1], rho, out=g_P[1])
            g_rho = ((g[0] - g[1]) * (P[0] - P[1])).sum()  # dP'_m/drho = P_m - P_o
            g_beta = g.flatten(1) @ y.to(P.dtype).flatten()
            g_y = (beta[0] * g[0]).addcmul_(beta[1].to(g.dtype), g[1])
        return g_P, g_rho.to(rho.dtype), g_beta.to(beta.dtype), g_y.to(y.dtype)


def transport(P, rho, beta, y):
    """model.transport, elementwise, in P's dtype."""
    with float32_routing(P):
        return _Transport.apply(P, rho, beta, y) if needs_grad(P, rho, beta, y) else _transport(P, rho, beta, y)


# The fast twins of model.py's AttnRes, DAR and Delta AttnRes streams, routed a chunk at a time.


class _BlockHistory:
    """What the fast streams share: the completed blocks, their norm factors, the open block's partial sum, a router."""

    def __init__(self, mod, x0, depth_chunk):
        self.mod, self.chunk = mod, mod.S * math.ceil(depth_chunk / mod.S)  # sites per router: whole blocks
        self.blocks, self.inv = [x0], [rms_inv(x0)]  # block representations b_0 = x0, b_1, ..
        self.partial, self.router, self.routed = None, None, 0  # routed: blocks the open router covers

    def _opens(self, j):
        """Site j (L: the readout, a chunk of its own): closes a block at its boundary; whether a router opens here."""
        if j > 0 and (j % self.mod.S == 0 or j == self.mod.L):  # Eq. 5: b = the partial sum of the block's y
            self.blocks.append(self.partial)
            self.inv.append(rms_inv(self.partial))
            self.partial = None
        return j % self.chunk == 0 or j == self.mod.L

    def _open(self, W, streams=None):
        self.router = TwoPhaseRouter(W, list(self.blocks), list(self.inv), streams)
        self.routed = len(self.blocks)

    def _recent(self, with_partial=True):
        """The sources (and norm factors) that arrived since the router opened."""
        if not with_partial or self.partial is None:
            return self.blocks[self.routed:], self.inv[self.routed:]
        return self.blocks[self.routed:] + [self.partial], self.inv[self.routed:] + [rms_inv(self.partial)]

    def write(self, j, y):  # the block sum accumulates in x0's dtype (float32 under bf16 autocast)
        self.partial = y if self.partial is None else self.partial.to(self.blocks[0].dtype) + y

    def readout(self):
        return self.read(self.mod.L)


class FastAttnResStream(_BlockHistory):
    """model.AttnResStream, a chunk of sites per router."""

    def chunk_queries(self, j0):
        """(W [Q, d], {j: site j's rows}) from site j0: the sites' first rows in order, then RD's w_V rows."""
        sites = range(j0, min(j0 + self.chunk, self.mod.L) if j0 < self.mod.L else j0 + 1)  # (the readout: alone)
        routes = [self.mod.queries(j) for j in sites]
        rows, n = {}, len(sites)
        for i, (j, w) in enumerate(zip(sites, routes)):
            rows[j] = (i, *range(n, n + len(w) - 1))
            n += len(w) - 1
        return torch.cat([w[:1] for w in routes] + [w[1:] for w in routes]), rows

    def read(self, j):
        if self._opens(j):
            W, self.rows = self.chunk_queries(j)
            self._open(W)
        return self.mod.combine(self.router.read_rows(self.rows[j], *self._recent()))


class FastDARStream(_BlockHistory):
    """model.DARStream, a chunk of sites per router; a state holds both streams: one router serves both targets."""

    def __init__(self, mod, x0, depth_chunk):
        super().__init__(mod, x0.expand(2, *x0.shape), depth_chunk)  # both streams start as x0 (a view)

    def read(self, j):
        mod = self.mod
        if self._opens(j):
            w = mod.w[j:j + self.chunk]  # [C, 2, d]: the chunk's queries, target 0's rows, then target 1's
            self.j0, self.C = j, len(w)
            self._open(torch.cat([w[:, 0], w[:, 1]]), mod.streams)
        rows, alpha = (j - self.j0, self.C + j - self.j0), mod.theta_alpha[j].softmax(0)
        recent, inv = self._recent(mod.include_partial)
        if mod.routing != "sep_v":
            return self.router.read_fused(rows, alpha, recent, inv)
        r = [self.router.read(q, recent, inv) @ mod.v_proj[m].T for m, q in enumerate(rows)]
        return alpha[0] * r[0] + alpha[1] * r[1]

    record, transport = None, staticmethod(transport)  # DAR's write (no record), its transport elementwise
    write = model.DARStream.write


class FastDeltaStream(_BlockHistory):
    """model.DeltaStream, a chunk of sites per router."""

    def __init__(self, mod, x0, depth_chunk):
        super().__init__(mod, x0, depth_chunk)
        self.h = x0  # h~, the standard stream

    def read(self, j):
        if self._opens(j):
            self._open(self.mod.w[j:j + self.chunk])
        return self.h + self.router.read(j % self.chunk, *self._recent(with_partial=False))  # completed blocks only

    def write(self, j, y):
        self.h = self.h + y
        super().write(j, y)

    def readout(self):
        return self.h


# The plain stream -> its fast twin, which reads the module as the plain stream does: S, L, queries/combine or w.
TWINS = {model.AttnResStream: FastAttnResStream, model.DARStream: FastDARStream, model.DeltaStream: FastDeltaStream}


def twin_of(cls):
    """(fast twin of plain stream class cls, or None and why): a subclass keeps it unless it overrides a method."""
    for i, base in enumerate(cls.__mro__):
        if base in TWINS:
            own = sorted({n for c in cls.__mro__[:i] for n, v in vars(c).items() if callable(v) and hasattr(base, n)})
            return (None, f"it overrides {', '.join(own)} of model.{base.__name__}") if own else (TWINS[base], None)
    return None, None


class _NormProject(Function):
    """y = F.linear(F.rms_norm(h), W) saving only references to h and W; the backward rebuilds RMSNorm(h)."""

    @staticmethod
    def forward(ctx, h, W):
        y = F.linear(_normed(h)[0].to(h.dtype), W)  # F.rms_norm's ops: the same bits
        ctx.mm_dtype = y.dtype
        ctx.save_for_backward(h, W)
        return y

    @staticmethod
    def backward(ctx, g):
        h, W = ctx.saved_tensors
        with autocast_off(h):
            mm, dt = ctx.mm_dtype, compute_dtype(h)
            x, rinv = _normed(h)  # RMSNorm(h), rebuilt by the forward's ops: the same bits
            g = g.to(mm)
            g_W = g.reshape(-1, g.size(-1)).T @ x.to(mm).reshape(-1, x.size(-1)) if ctx.needs_input_grad[1] else None
            g_h = None
            if ctx.needs_input_grad[0]:
                gx = (g @ W.to(mm)).to(dt)
                g_h = gx.addcmul_(x, (gx * x).sum(-1, keepdim=True), value=-1 / x.size(-1)).mul_(rinv)
        return None if g_h is None else g_h.to(h.dtype), None if g_W is None else g_W.to(W.dtype)


def _normed(h):
    """(RMSNorm(h), 1 / rms [..., 1]) in the compute dtype."""
    rinv = _rms_inv(h).unsqueeze(-1)
    return h.to(compute_dtype(h)) * rinv, rinv


def norm_project(h, W):
    """F.linear(RMSNorm(h), W) for an attention K or V input of its own (RD-AttnRes' h_V, MUDDFormer's h_K and h_V),
    saving h and W for backward instead of RMSNorm(h)."""
    if needs_grad(h, W):
        return _NormProject.apply(h, W)
    return F.linear(model.norm(h), W)


# The fast model, and how a config picks its model.


class FastGPT(model.GPT):
    """model.GPT with its streams run by their fast twins: the same parameters and numbers."""

    norm_project = staticmethod(norm_project)

    def start_stream(self, x0, record=None):  # a record is filled by the plain streams only
        stream = self.residual.start(x0, record)
        twin = twin_of(type(stream))[0] if record is None else None
        return twin(self.residual, x0, self.cfg.depth_chunk) if twin else stream


def make_model(cfg, seed=0):
    """The model a config asks for: FastGPT for depth_impl="two_phase", model.GPT for "reference"."""
    net = (FastGPT if cfg.depth_impl == "two_phase" else model.GPT)(cfg, seed)
    if cfg.depth_impl == "two_phase":
        stream = type(net.residual.start(torch.zeros(1, 1, cfg.n_embd)))
        plain_stream_note(stream)
        if twin := twin_of(stream)[0]:
            with torch.device("cpu"):  # (a model built on the meta device is checked on real numbers)
                check_twin(type(net.residual), stream, twin, cfg)
    return net


proved = set()  # (module class, plain stream class, twin, config) checked in this process


def check_twin(mod, stream, twin, cfg):
    """The twin equals the plain stream (once per class, config and process): both run a float64 copy of the module
    at random routing parameters, fed the same sublayer outputs."""
    if (mod, stream, twin, repr(cfg)) in proved:
        return
    tiny = dataclasses.replace(cfg, n_embd=8, n_head=1)  # the config itself, at a small width
    residual, g = mod(tiny).double(), torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in residual.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype))
    x0, R = (torch.randn(*shape, generator=g, dtype=torch.float64) for shape in ((2, 3, 8), (residual.L, 8, 8)))

    def run(s):
        inputs = []
        for j in range(residual.L):
            h = s.read(j)
            inputs += h if isinstance(h, tuple) else [h]
            s.write(j, torch.tanh(sum(inputs[-len(h) if isinstance(h, tuple) else -1:]) @ R[j]))
        return inputs + [s.readout()]
    plain, fast = run(stream(residual, x0)), run(twin(residual, x0, tiny.depth_chunk))
    diff = max((a - b).abs().max().item() for a, b in zip(plain, fast)) if len(plain) == len(fast) else math.inf
    if diff > 1e-9:
        raise UserError(f"the fast path's {twin.__name__} does not compute what {stream.__module__}.{stream.__qualname__} "
                        f"does for {mod.__name__} (max difference {diff:.2g} in float64): run with "
                        "--depth_impl=reference, or update the twin in model_fast.py (docs/adding_a_variant.md)")
    proved.add((mod, stream, twin, repr(cfg)))


@functools.cache
def plain_stream_note(cls):
    """One line, once per class, when a stream that could have a fast twin runs plain."""
    if why := twin_of(cls)[1]:
        print(f"note: {cls.__module__}.{cls.__qualname__} runs as the plain stream on depth_impl='two_phase', without the fast "
              f"path's speed and memory: {why}; write its twin and register it in model_fast.TWINS", file=sys.stderr)


def checkpoint_problem(ckpt):
    """What makes a checkpoint dict unusable by any reader (a key missing, a bad step, a non-finite weight), or None."""
    missing = [k for k in ("model", "model_config", "tokenizer", "step") if k not in ckpt]
    if missing:
        return f"it lacks {', '.join(missing)}"
    if type(ckpt["step"]) is not int or ckpt["step"] < 0:
        return f"its step is {ckpt['step']!r}, not a count"
    if not all(isinstance(ckpt.get(k, {}), dict) for k in ("model", "model_config", "train_config", "segments")):
        return "its model, model_config, train_config or segments is not a dict"
    if ckpt.get("val_loss") is not None and not (type(ckpt["val_loss"]) is float and math.isfinite(ckpt["val_loss"])):
        return f"its val_loss is {ckpt['val_loss']!r}, not a finite number"
    seg = ckpt.get("segments", {})
    if not (isinstance(seg.get("seconds", 0.0), (int, float)) and all(isinstance(seg.get(k, []), list) for k in
            ("speeds", "commits", "torch", "hosts")) and all(isinstance(x, (int, float)) for x in seg.get("speeds", []))):
        return "its segments (time, speeds, provenance) are malformed"
    bad = next((k for k, v in ckpt["model"].items() if torch.is_tensor(v) and v.is_floating_point()
                and not torch.isfinite(v).all()), None)
    return f"its weight {bad} is not finite" if bad else None


def read_checkpoint(file, remedy):
    """A checkpoint file's dict, loaded weights_only (no code in it runs): what is none is one UserError line."""
    try:
        ckpt = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # (torch's message may advise weights_only=False, which is unsafe: not quoted)
        raise UserError(f"{file} is not a readable checkpoint ({type(e).__name__}): truncated, or not train.py's; "
                        f"{remedy}") from None
    need(isinstance(ckpt, dict), f"{file} is not a train.py checkpoint; {remedy}")
    return ckpt


def load_model(path, device="cpu"):
    """(the model of a checkpoint file or run directory, in eval mode; the checkpoint dict)."""
    file = Path(path) / "ckpt.pt" if Path(path).is_dir() else Path(path)
    need(file.is_file(), f"no checkpoint at {file}")
    ckpt = read_checkpoint(file, "it cannot be used")
    need({"model", "model_config"} <= set(ckpt), f"{file} is not a train.py checkpoint")
    need((why := checkpoint_problem(ckpt)) is None, f"{file} is damaged ({why}): it cannot be used")
    try:
        net = make_model(model.GPTConfig(**ckpt["model_config"]))
        net.load_state_dict(ckpt["model"])
    except UserError:
        raise
    except (TypeError, ValueError, RuntimeError, KeyError) as e:
        first = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
        raise UserError(f"{path}: the checkpoint's model does not fit this model.py: {first}") from None
    return net.to(device).eval(), ckpt


def compile_model(net, **kwargs):
    """torch.compile(net, **kwargs), backward traced outside autocast as eager runs it, static shapes (docs/model.md)."""
    torch._functorch.config.backward_pass_autocast = "off"
    return torch.compile(net, **{"dynamic": False, **kwargs})
