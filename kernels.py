"""
The numerics model.py and its fast path share, each equal to the plain ops it replaces:

  - the compute dtype and autocast switches that keep depth routing in float32 (float64 for float64
    models), also inside bf16 autocast regions, where only the sources stay bf16 (`in_float32`);
  - DAR's transport as one elementwise pass (`transport`; model.transport_reference is the plain math);
  - `matmul32`, a float32 matmul whose backward stays float32 under autocast (mHC, MUDDFormer);
  - `norm_project`, RMSNorm then a projection, for an attention K or V input of its own (RD-AttnRes' h_V,
    MUDDFormer's h_K and h_V), which keeps one float per token for backward instead of the normalised input.

Each is tested equal to the plain ops in float64, values and gradients (tests/test_routing.py,
tests/test_norm_project.py).
"""

import functools
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch.autograd import Function


def compute_dtype(t):
    return torch.promote_types(t.dtype, torch.float32)


def in_float32(f):
    """f(w, keys, values=None) on its inputs cast to the compute dtype (float32; float64 for float64
    models) with autocast off, its output h cast back to the values' dtype: depth attention in float32,
    also inside bf16 autocast regions, where only the sources stay bf16."""
    @functools.wraps(f)
    def wrapped(w, keys, values=None):
        values = keys if values is None else values
        dt = compute_dtype(keys[0])
        with float32_routing(w):
            h, a = f(w.to(dt), [k.to(dt) for k in keys], [v.to(dt) for v in values])
        return h.to(values[0].dtype), a
    return wrapped


def float32_routing(t):
    """Autocast off: the routing math must not drop to bf16 (the sources themselves may be bf16)."""
    return torch.autocast(t.device.type, enabled=False) if torch.is_autocast_enabled(t.device.type) else nullcontext()


def autocast_off(t):
    """Autocast off, whatever state the caller is in: a custom Function's backward computes in its
    own dtype even where the backward is traced or run under the forward's autocast (torch.compile's
    AOTAutograd traces it so by default), where is_autocast_enabled() need not tell."""
    return torch.autocast(t.device.type, enabled=False)


def needs_grad(*tensors):
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


# ----------------------------------------------------------------------------------------------
# DAR's write, elementwise.


def _transport(P, rho, beta, y):
    out = torch.empty_like(P)
    torch.lerp(P[1], P[0], rho, out=out[0])  # P_o + rho (P_m - P_o)
    torch.lerp(P[0], P[1], rho, out=out[1])
    return out.addcmul_(beta.to(P.dtype).view(2, *[1] * y.dim()), y.to(P.dtype))


class _Transport(Function):
    """P'_m = rho P_m + (1 - rho) P_o + beta_m y (o = 1 - m): DAR's doubly-stochastic transport of
    the two streams' partial states and its gated write. Elementwise, forward and backward, saving
    references to P and y only (autograd's backward of the same thing as a 2 x 2 matmul over the
    streams runs skinny matmuls, several times slower on CPU)."""

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
    """DAR's write P' = [[rho, 1 - rho], [1 - rho, rho]] P + beta y, in P's dtype (float32 or float64)."""
    with float32_routing(P):
        return _Transport.apply(P, rho, beta, y) if needs_grad(P, rho, beta, y) else _transport(P, rho, beta, y)


# ----------------------------------------------------------------------------------------------
# A float32 matmul whose backward stays float32 (mHC's and MUDDFormer's coefficient projections).


class _Matmul32(Function):
    """a [..., k] @ b [k, n] in the inputs' (float32 or float64) dtype; the backward computes in that
    dtype with autocast off too, wherever it is traced or run (autograd's own backward of a float32
    matmul, traced by torch.compile under the forward's autocast, would run in bf16)."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a @ b

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        with autocast_off(a):
            g = g.to(a.dtype)
            g_a = g @ b.T if ctx.needs_input_grad[0] else None
            g_b = a.reshape(-1, a.size(-1)).T @ g.reshape(-1, g.size(-1)) if ctx.needs_input_grad[1] else None
        return g_a, g_b


def matmul32(a, b):
    """a @ b with autocast off, forward and backward (see _Matmul32); a and b in one float dtype."""
    with float32_routing(a):
        return _Matmul32.apply(a, b) if needs_grad(a, b) else a @ b


# ----------------------------------------------------------------------------------------------
# Normalise, then project: a K or V input of its own (RD-AttnRes' h_V, MUDDFormer's h_K and h_V).


def _rms_norm(h):
    """(RMSNorm(h) in h's dtype, 1 / rms(h) [..., 1] in the compute dtype): F.rms_norm without a gain and
    with its default eps, by the same operations in the same order (on CPU: the same bits)."""
    hf = h.to(compute_dtype(h))
    rinv = _reciprocal_rms(hf)
    return (hf * rinv).to(h.dtype), rinv


def _reciprocal_rms(hf):
    """1 / rms over the last dimension, with F.rms_norm's default eps ([..., 1], hf's dtype)."""
    return torch.rsqrt(hf.pow(2).mean(-1, keepdim=True).add_(torch.finfo(hf.dtype).eps))


class _NormProject(Function):
    """y = RMSNorm(h) @ W.T, as F.linear(F.rms_norm(h), W) computes it, saving only references: h (the
    routing keeps it anyway) and W (a parameter), never RMSNorm(h). The backward recomputes the
    reciprocal RMS rinv from h (the same ops as the forward: the same bits; one pass over h), rebuilds
    x = RMSNorm(h) = h * rinv elementwise for dW = g^T x, and takes RMSNorm's backward:
    dh = rinv (gx - x mean(gx * x)), gx = g W.
    The projection runs in the dtype autocast gives F.linear in the forward (bf16 under bf16
    autocast, as the plain ops; else the inputs'), and the backward's two matmuls in that same dtype,
    explicitly, with autocast off wherever the backward is traced or run; the norm and its backward
    in the compute dtype (float32; float64 for float64 models)."""

    @staticmethod
    def forward(ctx, h, W):
        x, rinv = _rms_norm(h)
        y = F.linear(x, W)
        ctx.mm_dtype = y.dtype
        ctx.save_for_backward(h, W)
        return y

    @staticmethod
    def backward(ctx, g):
        h, W = ctx.saved_tensors
        with autocast_off(h):
            mm, dt = ctx.mm_dtype, compute_dtype(h)
            hf = h.to(dt)
            rinv = _reciprocal_rms(hf)  # as the forward computed it: the same bits
            x = hf * rinv  # RMSNorm(h), rebuilt
            g = g.to(mm)
            g_W = g.reshape(-1, g.size(-1)).T @ x.to(mm).reshape(-1, x.size(-1)) if ctx.needs_input_grad[1] else None
            g_h = None
            if ctx.needs_input_grad[0]:
                gx = (g @ W.to(mm)).to(dt)
                g_h = gx.addcmul_(x, (gx * x).sum(-1, keepdim=True), value=-1 / x.size(-1)).mul_(rinv)
        return None if g_h is None else g_h.to(h.dtype), None if g_W is None else g_W.to(W.dtype)


def norm_project(h, W):
    """F.linear(RMSNorm(h), W) (RMSNorm without a gain, F.rms_norm's default eps), keeping references to
    h and W for backward instead of RMSNorm(h): see _NormProject. The same forward as the plain ops."""
    if needs_grad(h, W):
        return _NormProject.apply(h, W)
    return F.linear(_rms_norm(h)[0], W)
