"""What the tests share: tolerances, a tiny model, a routing randomiser, a user's variant, the learning and dtype checks;
fixtures (one thread, the byte corpus, one straight run, a read-only mount, a full disk); make test-all's test order."""

import builtins
import errno
import gzip
import io
import json
import os
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from model import GPTConfig, RDAttnRes
from model_fast import make_model
from prepare_data import DEFAULT_CORPUS, prepare

from runs import run

# --- tolerances: each from the rounding of the arithmetic it compares -------------------------------------
# u, the unit roundoff: float64 2^-53 = 1.1e-16, float32 2^-24 = 6.0e-8, bfloat16 2^-8 = 3.9e-3. The models here
# are tiny (width <= 32, <= 8 layers, values below ~10), and a sum of n terms below X rounds to within n u X.
F64 = 1e-10  # one function in float64 through other ops (a fast path, a textbook, a reduction, a cache): the
#              logits chain ~10^2 ops, each a sum of <= 10^2 terms below 10, so they differ by <= 10^5 u = 1e-11;
#              1e-10 is 10x that, and 600x below float32's u: one float32 op on either side fails it
F64_OP = 1e-12  # one float64 op or sublayer in another order (<= 10^2 terms below 10): <= 10^3 u = 1e-13, 10x that
F64_ZERO = 1e-13  # a gradient that is zero by construction: its terms cancel exactly in exact arithmetic, and its
#                   sum of <= 10^2 of them below 1 rounds to <= 10^2 u = 1e-14
F64_EPS = 1e-9  # a reduction through RMSNorm(c h) = RMSNorm(h) (c > 0, uniform routing: c >= 1/9 on <= 9 sources):
#                 the norm's eps (2.2e-16) makes them differ by (1/c^2 - 1) eps / (2 ms(h)) <= 80 x 2.2e-16 / 8e-4
#                 = 2e-11 relative (ms(h) >= 4e-4: embeddings of std 0.02), a few norms deep: below 1e-9

# A stream that rounds a depth mix or a state write to bf16 (u = 2^-8) departs by a fraction of u: DAR's plain write,
# rounding beta_m y alone, by 6.7e-4 to 9.7e-4 relative. Float32 routing in another order: ~10 float32 u (measured
# <= 1.6e-7). u / 64 = 6.1e-5 lies between, 11x below the first and 380x above the second.
BF16_PATHS = 2 ** -8 / 64


def unlearned(model, exempt=()):
    """After a backward at init: the trainable parameters without a finite gradient, or whose gradient is zero where
    `exempt` (an entry of ZERO_GRAD_AT_INIT: name prefixes or a predicate) expects none to be, or not zero where it does."""
    zero = exempt if callable(exempt) else lambda name: name.startswith(tuple(exempt))
    return [n for n, p in model.named_parameters() if p.requires_grad and (p.grad is None or not torch.isfinite(p.grad).all()
            or not (p.grad.abs().max() < F64_ZERO if zero(n) else p.grad.abs().max() > 10 * F64_ZERO))]


def tiny(seed=0, dtype=torch.float64, **kw):
    """A 3-layer model: 6 sublayers, so block size 4 gives a full block and a short one."""
    kw = dict(dict(vocab_size=61, block_size=24, n_layer=3, n_head=2, n_embd=32, attnres_block_size=4), **kw)
    return make_model(GPTConfig(**kw), seed=seed).to(dtype)


def tokens(B=2, T=12, seed=0):
    return torch.randint(0, 61, (B, T), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def randomize_routing(model, seed=1, scale=1.0, add=False):
    """Random routing parameters, standard normal times `scale` (add: added to the init, each gate kept near its own
    start): routing away from its uniform start. Returns the model."""
    g = torch.Generator().manual_seed(seed)
    for p in model.residual.parameters():
        noise = scale * torch.randn(p.shape, generator=g, dtype=torch.float64)
        p.add_(noise) if add else p.copy_(noise)
    return model


class ThreeRoutes(RDAttnRes):
    """A user's variant: RD-AttnRes with a pseudo-query for each of the Q, K and V inputs of every attention sublayer
    (a 3-tuple h). Only its queries change, so the fast twin serves it (three query rows per attention site)."""

    route_names = ("Q route", "K route", "V route")

    def __init__(self, cfg):
        super().__init__(cfg)
        self.w_k = nn.Parameter(torch.zeros(cfg.n_layer, cfg.n_embd))

    @torch.no_grad()
    def reset_parameters(self, rng):
        super().reset_parameters(rng)
        self.w_k.zero_()

    def queries(self, j):
        rows = super().queries(j)
        return torch.cat([rows[:1], self.w_k[j // 2:j // 2 + 1], rows[1:]]) if len(rows) == 2 else rows


def bf16_routing_error(model, monkeypatch):
    """Under bf16 autocast, with stub sublayers whose outputs are bf16: the site inputs' dtypes, and their largest
    relative distance (the readout's too) from a run without autocast fed the same outputs in float32."""
    seen, ys, replay = [], [], []

    def stub(h, *args):
        seen.extend(h if isinstance(h, tuple) else (h,))
        if replay:
            return replay.pop(0).float()
        ys.append(torch.tanh(sum(h) if isinstance(h, tuple) else h).to(torch.bfloat16))  # as bf16 as a sublayer's y
        return ys[-1]

    for block in model.blocks:
        monkeypatch.setattr(block.attn, "forward", stub)
        monkeypatch.setattr(block.mlp, "forward", stub)
    start = model.start_stream

    def recording(x0, record=None):  # the stream, its readout seen too
        stream = start(x0, record)
        readout = stream.readout
        stream.readout = lambda: seen.append(readout()) or seen[-1]
        return stream

    monkeypatch.setattr(model, "start_stream", recording)
    with torch.no_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(tokens())
        mixed, seen, replay[:] = seen, [], ys
        model(tokens())
    assert len(seen) == len(mixed) > 2 * model.cfg.n_layer
    return {h.dtype for h in mixed}, max(((h - w).norm() / w.norm()).item() for h, w in zip(mixed, seen))


@pytest.fixture(autouse=True)
def one_thread():
    """The test model is tiny: a second thread only adds synchronisation (and contention on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    """40 short documents of the embedded corpus as byte tokens (2 of them val, 2 test)."""
    tmp = tmp_path_factory.mktemp("data")
    with gzip.open(DEFAULT_CORPUS, "rt") as f:
        texts = [json.loads(line)["text"][:3000] for line in f][:40]
    source = tmp / "tiny.jsonl"
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    prepare(data_files=[str(source)], tokenizer="byte", out_dir=tmp / "byte")
    return tmp / "byte"


@pytest.fixture(scope="session")
def straight(data_dir, tmp_path_factory):
    """An uninterrupted run of configs/test.py (6 steps, checkpoints at 3 and 6): tests read or copy it, never change it."""
    out = tmp_path_factory.mktemp("straight")
    run(data_dir, out, "--run_name=straight")
    return out / "straight"


@pytest.fixture
def read_only(monkeypatch):
    """Make writes under the returned function's directories fail as on a read-only mount (EROFS):
    os.open for writing, os.mkdir, open() and Path.open in a writing mode. (As root, chmod stops nothing.)"""
    roots = []

    def blocked(path, writing):
        return writing and any(str(Path(path)).startswith(str(r)) for r in roots)

    def refuse(path):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

    real_os_open, real_mkdir, real_open = os.open, os.mkdir, builtins.open

    def os_open(path, flags, *args, **kwargs):
        if blocked(path, flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)):
            refuse(path)
        return real_os_open(path, flags, *args, **kwargs)

    def mkdir(path, *args, **kwargs):
        if blocked(path, True) and Path(path).parent.is_dir() and not Path(path).exists():
            refuse(path)  # (with no parent: FileNotFoundError, as the kernel says first)
        return real_mkdir(path, *args, **kwargs)

    def open_(file, mode="r", *args, **kwargs):
        if isinstance(file, (str, Path)) and blocked(file, any(c in mode for c in "wax+")):
            refuse(file)
        return real_open(file, mode, *args, **kwargs)
    monkeypatch.setattr(os, "open", os_open)
    monkeypatch.setattr(os, "mkdir", mkdir)
    monkeypatch.setattr(builtins, "open", open_)
    monkeypatch.setattr(io, "open", open_)
    return roots.append


@pytest.fixture
def full_disk(monkeypatch):
    """full_disk(directory, free): files opened for writing under `directory` (open(), Path.open) share `free` bytes: a
    write takes what is left (a partial write, as the kernel's), then fails with ENOSPC, as on a disk that full."""
    roots, room = [], {}
    real_open = builtins.open

    class Filling:
        def __init__(self, f):
            self._f = f

        def write(self, data):
            n = min(len(data), room["free"])
            if n:
                self._f.write(data[:n])
                room["free"] -= n
            if n < len(data):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return n

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self._f.close()

        def __getattr__(self, name):
            return getattr(self._f, name)

    def open_(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        writing = isinstance(file, (str, Path)) and any(c in mode for c in "wax+")
        return Filling(f) if writing and any(str(Path(file)).startswith(str(r)) for r in roots) else f
    monkeypatch.setattr(builtins, "open", open_)
    monkeypatch.setattr(io, "open", open_)

    def fill(directory, free):
        roots.append(directory)
        room["free"] = free
    return fill


def pytest_collection_modifyitems(config, items):
    """With --dist loadgroup (make test-all), each test process takes the next test (an xdist_group as one unit) when
    nearly idle: the slow ones first, so that the last minutes are short tests on both cores. Otherwise files' order."""
    if getattr(config.option, "loadgroup", False):  # set in xdist's test processes
        items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: files' order within
