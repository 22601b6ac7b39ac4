"""docs/adding_a_variant.md followed as a newcomer would: small variants added the guide's way (one row in
model.RESIDUALS each), trained, sampled and diagnosed. If a step of the guide stops working, this file fails."""

import itertools
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import model
import model_fast
import sample
import train
from common import cli
from conftest import BF16_PATHS, F64, F64_OP, ThreeRoutes, bf16_routing_error, randomize_routing, tiny, tokens, unlearned
from model import AttnRes, AttnResStream, FullAttnRes, RDAttnRes, SumStream, depth_attention, note, site_name
from tools import bench, diagnose
from train import model_config

from runs import argv, run


class ReZero(nn.Module):
    """ReZero (Bachlechner et al., 2020): h_{j+1} = h_j + alpha_j y_j, alpha_j = 0 at init."""

    def __init__(self, cfg):
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(2 * cfg.n_layer))

    @torch.no_grad()
    def reset_parameters(self, rng):
        self.alpha.zero_()

    def start(self, x0, record=None):
        return _ReZeroStream(self, x0)


class _ReZeroStream(SumStream):
    def __init__(self, mod, x0):
        super().__init__(x0)
        self.mod = mod

    def write(self, j, y):
        self.h = self.h + self.mod.alpha[j] * y


class TemperedAttnRes(AttnRes):
    """Block AttnRes with a learnable temperature per site: logit_r = (w / tau) . RMSNorm(s_r), tau = exp(log_tau) = 1
    at init. It only changes the query rows: one override of queries, both depth_impl paths run it unchanged."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.log_tau = nn.Parameter(torch.zeros(self.L + 1))

    @torch.no_grad()
    def reset_parameters(self, rng):
        super().reset_parameters(rng)
        self.log_tau.zero_()  # tau = 1: exactly Block AttnRes

    def queries(self, j):
        return super().queries(j) / self.log_tau[j].exp()


class DepthALiBi(AttnRes):
    """Block AttnRes with a bias over how far back each source is (ALiBi over depth): at site j (the readout too) over
    sources r = 0..n-1, logit_r += -softplus(a_j) (n - 1 - r). Its stream overrides `site`: it runs plain."""

    uniform_at_zero_queries = False  # softplus(0) > 0: zero queries still lean towards the newest source

    def __init__(self, cfg):
        super().__init__(cfg)
        self.a = nn.Parameter(torch.zeros(self.L + 1))  # a_0 reads one source: never used, as w_0 is not

    @torch.no_grad()
    def reset_parameters(self, rng):
        super().reset_parameters(rng)
        self.a.zero_()

    def start(self, x0, record=None):
        return DepthALiBiStream(self, x0, record)

    def scalars(self):  # diagnostics.json's per-site values of this variant (tools/diagnose.py)
        return {"slope": F.softplus(self.a)}


class DepthALiBiStream(AttnResStream):
    def site(self, j, sources):
        bias = -F.softplus(self.mod.a[j]) * torch.arange(len(sources) - 1, -1, -1)
        h, a = zip(*[depth_attention(w, sources, bias=bias) for w in self.mod.queries(j)])
        note(self.record, site_name(j, self.mod.L), torch.stack(a, 1).squeeze(1))
        return self.mod.combine(h)


class MultiHeadAttnRes(AttnRes):
    """Block AttnRes with H = 2 pseudo-queries per site, one per channel group: head g's logits are w_j[g] .
    RMSNorm(s_r)[g] (the norm over all d), its output the group's channels. Only queries and combine change."""

    heads = 2
    route_names = ("head 0", "head 1")

    def queries(self, j):  # row g: w_j on group g's channels, 0 elsewhere
        return torch.block_diag(*super().queries(j).view(self.heads, 1, -1))

    def combine(self, h):  # group g's channels from head g
        return torch.cat([h_g.chunk(self.heads, -1)[g] for g, h_g in enumerate(h)], -1)


def textbook_logits(net, idx, heads=1, slope=None):
    """Block AttnRes in plain tensors over x0, the completed blocks and the open block's sum (the readout: every block):
    h_j[g] = sum_r softmax_r(w_j[g] . (s_r / rms(s_r))[g] - slope_j (n - 1 - r)) s_r[g] for each of `heads` channel
    groups g (MultiHeadAttnRes); slope_j = softplus(a_j) for DepthALiBi, else 0."""
    S, L, w = net.residual.S, net.residual.L, net.residual.w
    cos, sin = net.cos[:idx.size(1)], net.sin[:idx.size(1)]
    x0, ys, d = net.wte(idx), [], w.size(1)

    def site(j):
        sources = [x0] + [sum(ys[b:b + S]) for b in range(0, j, S)]  # the last one: the open block's sum
        normed, out = [s / s.square().mean(-1, keepdim=True).add(torch.finfo(s.dtype).eps).sqrt() for s in sources], []
        for c in (slice(g * d // heads, (g + 1) * d // heads) for g in range(heads)):
            logits = torch.stack([k[..., c] @ w[j, c] - (0 if slope is None else slope[j] * (len(sources) - 1 - r))
                                  for r, k in enumerate(normed)])
            out.append(sum(a.unsqueeze(-1) * s[..., c] for a, s in zip(logits.softmax(0), sources)))
        return torch.cat(out, -1)

    for j in range(L):
        block = net.blocks[j // 2]
        ys.append(block.attn(site(j), cos, sin, j // 2) if j % 2 == 0 else block.mlp(site(j)))
    return net.lm_head(model.norm(site(L)))


# Zero gradients at init by construction (the guide's exemptions): rezero's alpha = 0 hides every sublayer's output, so
# no sublayer weight gets one; tempered: with zero queries, w / tau = 0 whatever tau, so log_tau gets none.
ZERO_GRAD = {"rezero": lambda name: name.startswith("blocks."), "tempered": ("residual.log_tau",), "multihead": (),
             "depth_alibi": ()}
NEW = {"rezero": ReZero, "tempered": TemperedAttnRes, "multihead": MultiHeadAttnRes, "depth_alibi": DepthALiBi}


@pytest.fixture
def registered(monkeypatch):
    """The guide's step 2: one row per variant in model.RESIDUALS."""
    for name, cls in NEW.items():
        monkeypatch.setitem(model.RESIDUALS, name, cls)


def unlearned_at_init(residual, exempt=()):
    """conftest's unlearned on a variant's model, each name with its variant."""
    net, idx = tiny(residual=residual), tokens()
    net(idx, idx.roll(-1, 1))[1].backward()
    return [f"{residual}: {name}" for name in unlearned(net, exempt)]


@pytest.mark.parametrize("residual", NEW)
def test_a_new_variant_learns_and_exempts_only_what_its_init_zeroes(registered, residual):
    assert unlearned_at_init(residual, ZERO_GRAD[residual]) == []


def test_a_parameter_a_subclass_adds_keeps_its_init_and_is_named_if_it_never_learns(monkeypatch):
    """AttnRes' reset_parameters zeroes its queries, nothing else; a dead parameter is named with its variant."""
    class Unused(AttnRes):
        def __init__(self, cfg):
            super().__init__(cfg)
            self.slope = nn.Parameter(torch.ones(self.L + 1))  # declared, never read

    monkeypatch.setitem(model.RESIDUALS, "unused", Unused)
    assert torch.equal(tiny(residual="unused").residual.slope, torch.ones(7, dtype=torch.float64))
    assert unlearned_at_init("unused") == ["unused: residual.slope"]


@pytest.mark.parametrize("impl", ["two_phase", "reference"])
def test_depth_alibi_matches_its_textbook_definition_and_runs_plain(registered, impl, capsys):
    """The guide's worked example of a variant that changes the logits: a subclass overriding `site` runs as
    written on both paths (a note says so once), and equals its definition at random queries and slopes."""
    model_fast.plain_stream_note.cache_clear()
    net, idx = tiny(residual="depth_alibi", depth_impl=impl, attnres_block_size=2), tokens()
    assert ("DepthALiBiStream runs as the plain stream" in capsys.readouterr().err) == (impl == "two_phase")
    randomize_routing(net)
    with torch.no_grad():
        torch.testing.assert_close(net(idx)[0], textbook_logits(net, idx, slope=F.softplus(net.residual.a)), rtol=0, atol=F64)


def test_a_stream_routing_in_a_source_s_bf16_fails_the_dtype_rule(registered, monkeypatch):
    """A twin-less stream casting its sources to the newest one's dtype (bf16 under autocast) fails the dtype test."""
    site = DepthALiBiStream.site

    def one_dtype(self, j, sources):  # the sources "in one dtype": the newest's, bf16 under autocast
        return site(self, j, [s.to(sources[-1].dtype) for s in sources])

    monkeypatch.setattr(DepthALiBiStream, "site", one_dtype)
    net = randomize_routing(tiny(residual="depth_alibi").float(), scale=0.3)
    assert bf16_routing_error(net, monkeypatch)[1] > 10 * BF16_PATHS


def edited_shared_stream(self, j, sources):
    """The shortcut the guide warns against: a depth bias in the shared model.AttnResStream, which its twin ignores."""
    bias = -0.5 * torch.arange(len(sources) - 1, -1, -1)
    h, _ = zip(*[depth_attention(w, sources, bias=bias) for w in self.mod.queries(j)])
    return self.mod.combine(h)


def test_an_edit_to_a_shared_stream_that_its_twin_does_not_follow_is_refused(data_dir, tmp_path, monkeypatch, capsys,
                                                                             straight):
    """Every command that builds the fast model (train, sample, diagnose, bench) refuses it in one line, before a step."""
    monkeypatch.setattr(AttnResStream, "site", edited_shared_stream)
    model_fast.proved.clear()
    commands = [(train.main, argv(data_dir, tmp_path, "--run_name=after")),
                (sample.main, ["--ckpt", str(straight), "--max_new_tokens", "2"]),
                (diagnose.main, ["--ckpt", str(straight), "--tokens", "128", "--out", str(tmp_path / "diag")]),
                (bench.main, ["--variants", "block_attnres", "--n_layer", "1", "--n_embd", "16", "--n_head", "1",
                              "--vocab_size", "64", "--seq_len", "8", "--repeats", "1", "--routing_blocks", "",
                              "--out", str(tmp_path / "bench.json")])]
    capsys.readouterr()
    for command, args in commands:
        assert cli(command, args) == 2, command.__module__
        err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("warning:")]  # (bench: load)
        assert len(err) == 1 and "FastAttnResStream" in err[0] and "depth_impl=reference" in err[0], err
    assert not (tmp_path / "after" / "log.jsonl").exists()


def test_rezero_starts_as_the_embedding_alone(registered):
    """alpha = 0: every sublayer's output is hidden, the logits are lm_head(norm(x0))."""
    net, idx = tiny(residual="rezero"), tokens()
    torch.testing.assert_close(net(idx)[0], net.lm_head(model.norm(net.wte(idx))), rtol=0, atol=F64_OP)


def test_a_temperature_of_one_is_block_attnres_on_both_paths(registered):
    """At init (tau = 1) the tempered variant is Block AttnRes bit for bit in its shared weights and
    outputs; with random queries and temperatures its two-phase path equals the reference (float64)."""
    idx = tokens()
    block, tempered = tiny(residual="block_attnres"), tiny(residual="tempered")
    shared = block.state_dict()
    assert all(torch.equal(shared[k], v) for k, v in tempered.state_dict().items() if k in shared)
    assert torch.equal(block(idx)[0], tempered(idx)[0])
    out = []
    for impl in ("two_phase", "reference"):
        net = randomize_routing(tiny(residual="tempered", depth_impl=impl))
        logits, loss = net(idx, idx.roll(-1, 1))
        loss.backward()
        out.append((logits, net.residual.log_tau.grad, net.residual.w.grad))
    for a, b in zip(*out):
        torch.testing.assert_close(a, b, rtol=0, atol=F64)
    with torch.no_grad():  # the readout's query is tempered too: it comes from queries as well
        net.residual.log_tau[-1] += 1.0
    assert not torch.allclose(net(idx)[0], out[-1][0])


@pytest.mark.parametrize("impl", ["two_phase", "reference"])
def test_a_variant_with_several_rows_at_the_readout_matches_its_textbook_definition(registered, impl):
    """The guide's definition test: at random queries both paths give the variant's own definition (a fast-vs-plain
    test cannot see a variant wrong the same way on both). The readout is a site: its two rows and combine count."""
    net, idx = randomize_routing(tiny(residual="multihead", depth_impl=impl, attnres_block_size=3)), tokens()
    with torch.no_grad():
        torch.testing.assert_close(net(idx)[0], textbook_logits(net, idx, heads=MultiHeadAttnRes.heads), rtol=0, atol=F64)


def test_a_subclass_is_what_its_class_declares_not_what_its_name_says(monkeypatch):
    """Block size, routes and flags come from the class: a subclass of FullAttnRes is Full AttnRes (S = 1), one of
    RDAttnRes takes rd_mode (tied: Block AttnRes), one of AttnRes is Block; a name not registered is refused."""
    for name, base in (("my_full", FullAttnRes), ("my_rd", RDAttnRes), ("my_block", AttnRes)):
        monkeypatch.setitem(model.RESIDUALS, name, type(name, (base,), {}))  # a subclass that adds nothing
    assert tiny(residual="my_full").residual.S == 1 and tiny(residual="my_block").residual.S == 4
    idx = tokens()
    for mine, theirs, kw in (("my_full", "full_attnres", {}), ("my_rd", "block_attnres", dict(rd_mode="tied")),
                             ("my_rd", "rd_attnres", {}), ("my_block", "block_attnres", {})):
        a = randomize_routing(tiny(residual=mine, **kw))  # the same random parameters, as their shapes are the same
        b = randomize_routing(tiny(residual=theirs, **(kw if theirs == "rd_attnres" else {})))
        torch.testing.assert_close(a(idx)[0], b(idx)[0], rtol=0, atol=F64_OP, msg=mine)  # the same ops
    with pytest.raises(ValueError, match="rd_mode='tied' only applies to residual='rd_attnres' or 'my_rd'"):
        model_config(dict(residual="my_block", rd_mode="tied"))
    with pytest.raises(ValueError, match="unknown residual 'rezero'; choose one of standard, "):  # not registered here
        model_config(dict(residual="rezero"))


def test_diagnostics_name_the_routes_the_variant_declares(registered, monkeypatch):
    """diagnose takes the route names from the module (route_names) and compares every pair at every site that has
    them all: multihead's at every site and the readout, RD-AttnRes' and ThreeRoutes' at attention sites."""
    monkeypatch.setitem(model.RESIDUALS, "three_routes", ThreeRoutes)
    expected = {"multihead": (("head 0", "head 1"), 7), "three_routes": (("Q route", "K route", "V route"), 3),
                "rd_attnres": (("QK route", "V route"), 3), "block_attnres": (("routing weights",), 0)}
    for residual, (names, sites) in expected.items():
        net, record = randomize_routing(tiny(residual=residual)), {}
        with torch.no_grad():
            net(tokens(), record=record)
        assert diagnose.recorded_kind([record]) == "routes"
        assert diagnose.route_names([record], getattr(net.residual, "route_names", None)) == names
        js, short = diagnose.route_js([record], names), [n.removesuffix(" route") for n in names]
        assert list(js) == [f"{a}||{b}" for a, b in itertools.combinations(short, 2)]
        for per_site in js.values():  # attn.0 routes over x0 alone
            assert len(per_site) == sites and per_site["attn.0"] == 0 and min(list(per_site.values())[1:]) > 0


@pytest.mark.parametrize("residual", NEW)
def test_a_new_variant_trains_samples_and_diagnoses(registered, residual, data_dir, tmp_path, capsys):
    summary = run(data_dir, tmp_path, f"--residual={residual}", "--run_name=new", "--max_steps=4")
    assert summary["step"] == 4 and math.isfinite(summary["val_loss"])
    assert sample.main(["--ckpt", str(tmp_path / "new"), "--max_new_tokens", "4", "--seed", "0"]) == 0
    found = diagnose.diagnose(str(tmp_path / "new"), str(tmp_path / "diag"), tokens=256, batch_size=2)
    assert math.isfinite(found["val_loss"])
    if residual == "tempered":  # it records like Block AttnRes, so it is diagnosed like it
        assert "routing_maps" in found and found["max_weight_mean"] is not None
    elif residual == "multihead":  # its own routes, compared at every site, the readout's too
        assert list(found["js_per_site"]) == ["head 0||head 1"] and "readout" in found["js_per_site"]["head 0||head 1"]
    elif residual == "depth_alibi":  # its own scalars (the slopes) recorded and drawn, beside its routing
        assert len(found["scalars"]["slope"]) == 2 * 2 + 1 and (tmp_path / "diag" / "scalars.png").exists()
        assert "routing_maps" in found and "slope: " in diagnose.summary(found)
    else:  # it records nothing: no routing measures, and no crash
        assert "routing_maps" not in found
