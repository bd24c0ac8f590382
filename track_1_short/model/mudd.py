"""Per-token coefficients from small MLPs: the gates and the connections of MuddConfig
(HEAD modded-nanogpt's MUDD gates and MUDD connections, facts 1.5), and the layout that says which
coefficient serves which layer. GPT (model/gpt.py) builds one LayerMix per layer from them.

One block: coefs(x) = (W2 gelu(W1 x) + b) * s, x [T, D] -> [T, NC].
- W1 [NB, hidden, D] drawn as nn.Linear's default (kaiming uniform), W2 [NB, NC, hidden] zero: at
  init every coefficient equals its init value b*s whatever x is (the model starts as the one
  without MUDD, except for the values HEAD picks differently: see the inits below).
- b [NB, NC] is stored in the pre-scaled domain (init / s), as HEAD's, so Adam's steps on b are
  in units of s. s: a learned scalar for the gates (`mudd_gates.scale`, init
  MuddConfig.gate_scale), the constant MuddConfig.connection_scale for the connections.

Gates (`mudd_gates`, 2 blocks; GateLayout): block 0 reads x0 and serves the layers before
MuddConfig.split_layer, block 1 reads the residual entering split_layer and serves the rest. Per
layer, in this order: XSA strength [H] (xsa_layers, init 0: off), attention output gate [H]
(attn_gate_layers, init attn_gate_init), x0 coefficient [1] and n-gram coefficient [1] (every
attention layer but a connected last layer; the scalars' inits), the skip gate [1] (the
no-attention layer; the scalar's init), DC's head weights w1 [H] (init 1) and w2 [H] (init 0)
(MuddConfig.dc_layers, with MuddConfig.dc).

Connections (`mudd_connections`, 2 blocks of fixed roles, CONNECTION_IN / CONNECTION_OUT): block 0
reads the residual entering the last layer, block 1 the residual after it. Sources: `embed` the
residual after the n-gram injection (before layer 0), `source` the residual after
MuddConfig.source_layer, `self`/`previous` the residual entering the last layer, `skip` the
skip_from_layer output, `value_embed` the first value-embedding table's rows.

What must stay stable: parameters only (no buffers); the coefficients are computed in the
forward, so nothing here is state for the step graphs beyond the parameters.

Legend: T tokens, D model dim, H heads, NB blocks, NC coefficients of the widest block.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from track_1_short.model.attention import document_ids
from track_1_short.model.mudd_config import MuddConfig

DC_BLOCK = 128  # DC's query block: the keys of a block are the window before it and the block
# block 0 of the connections, at the start of the last layer: V term (3), residual
# recombination (3), value-embedding gate lanes (2, each over half of the heads), the layer's
# attention lambdas, x0 / n-gram coefficients and MLP lambdas (6)
CONNECTION_IN = ("v_embed", "v_source", "v_self", "r_embed", "r_source", "r_self", "ve_gate_a",
                 "ve_gate_b", "resid_attn", "post_attn", "x0", "ngram", "resid_mlp", "post_mlp")
# block 1, after the last layer: x += sum of these sources, each with its own coefficient
CONNECTION_OUT = ("embed", "source", "previous", "value_embed", "skip")
XSA_EPS = 1e-8  # XSA's floor on |v|^2
# a coefficient block's output GEMM is computed GEMM_ALIGN columns at a time (zero weight rows
# pad it, the extra columns are dropped): a row of n bf16 outputs is 16-byte aligned only for n a
# multiple of 8, which the blocks' n (26, 41, 14, 5 in the speedrun model) are not. With MUDD on,
# a cuBLAS align1 GEMM kernel took 3.98 ms per stage-C step on the H200 (none without MUDD;
# fast_head_mudd against fast in docs/results/step_variants_h200_2026-12-02_C.json), most likely
# these GEMMs; the padded ones are not timed yet
GEMM_ALIGN = 8


@dataclass(frozen=True, slots=True)
class ScalarInits:
    """The learned scalars' init values (GPT's), which the per-token coefficients start from."""

    resid: float
    post: float
    x0: float
    ngram: float
    skip: float


class CoefBlocks(nn.Module):
    """Concern: NB coefficient MLPs sharing one parameter set (w1, w2, b2[, scale])."""

    def __init__(self, dim: int, hidden: int, inits: Sequence[Sequence[float]], scale: float,
                 learn_scale: bool):
        super().__init__()
        nb, nc = len(inits), max(1, max(len(b) for b in inits))
        self.num_coefs = [len(b) for b in inits]
        self.w1 = nn.Parameter(torch.empty(nb, hidden, dim))  # [NB, hidden, D]
        for j in range(nb):
            nn.init.kaiming_uniform_(self.w1.data[j], a=math.sqrt(5))
        self.w2 = nn.Parameter(torch.zeros(nb, nc, hidden))  # [NB, NC, hidden]
        b = torch.zeros(nb, nc)
        for j, values in enumerate(inits):
            b[j, : len(values)] = torch.tensor(values) / scale
        self.b2 = nn.Parameter(b)  # [NB, NC], pre-scaled
        if learn_scale:
            self.scale = nn.Parameter(torch.tensor(scale))
        else:
            self.scale = scale

    def forward(self, x: Tensor, block: int) -> Tensor:
        """Block `block`'s coefficients for x [T, D] -> [T, num_coefs[block]], x's dtype (the
        output GEMM over GEMM_ALIGN-padded columns: the same values as the n-column one)."""
        n = self.num_coefs[block]
        n_pad = -(-n // GEMM_ALIGN) * GEMM_ALIGN
        h = F.gelu(F.linear(x, self.w1[block].to(x.dtype)))  # [T, hidden]
        w2 = F.pad(self.w2[block, :n], (0, 0, 0, n_pad - n))  # [n_pad, hidden], zero rows after n
        out = F.linear(h, w2.to(x.dtype))[:, :n] + self.b2[block, :n].to(x.dtype)
        scale = self.scale.to(x.dtype) if isinstance(self.scale, Tensor) else self.scale
        return out * scale  # [T, n]


@dataclass(frozen=True, slots=True)
class GateLayout:
    """Where each gate coefficient sits: (layer, role) -> (block, first column, width)."""

    inits: tuple[tuple[float, ...], ...]  # per block, the init value of each coefficient
    where: dict = field(default_factory=dict)

    @classmethod
    def build(cls, mudd: MuddConfig, num_layers: int, num_heads: int, attention_layers: list[int],
              no_attention_layer: int | None, inits: ScalarInits) -> "GateLayout":
        blocks: list[list[float]] = [[], []]
        where = {}
        connected_last = num_layers - 1 if mudd.connections else None

        def add(block, layer, role, values):
            where[(layer, role)] = (block, len(blocks[block]), len(values))
            blocks[block].extend(values)

        for i in range(num_layers):
            b = 0 if i < mudd.split_layer else 1
            if i in mudd.xsa_layers:
                add(b, i, "xsa", [0.0] * num_heads)
            if i in mudd.attn_gate_layers:
                add(b, i, "attn_gate", [mudd.attn_gate_init] * num_heads)
            if i in attention_layers and i != connected_last:
                add(b, i, "x0", [inits.x0])
                add(b, i, "ngram", [inits.ngram])
            if i == no_attention_layer:
                add(b, i, "skip", [inits.skip])
            if mudd.dc and i in mudd.dc_layers:
                add(b, i, "dc_w1", [1.0] * num_heads)
                add(b, i, "dc_w2", [0.0] * num_heads)
        return cls(inits=tuple(tuple(v) for v in blocks), where=where)


class GateValues:
    """One forward's gate outputs: each block computed once (`compute`), then looked up by
    (layer, role) as a [T, width] view."""

    def __init__(self, gates: CoefBlocks, layout: GateLayout):
        self.gates, self.layout, self.out = gates, layout, {}

    def compute(self, block: int, x: Tensor):
        self.out[block] = self.gates(x, block)  # [T, NC_block]

    def get(self, layer: int, role: str) -> Tensor | None:
        loc = self.layout.where.get((layer, role))
        if loc is None:
            return None
        block, start, width = loc
        return self.out[block][:, start: start + width]  # [T, width]


def connection_inits(mudd: MuddConfig, inits: ScalarInits) -> list[list[float]]:
    """Init values of the two connection blocks, in CONNECTION_IN / CONNECTION_OUT order."""
    block_in = dict.fromkeys(CONNECTION_IN, 0.0)
    block_in.update(ve_gate_a=mudd.ve_gate_init, ve_gate_b=mudd.ve_gate_init, resid_attn=inits.resid,
                    post_attn=inits.post, x0=inits.x0, ngram=inits.ngram, resid_mlp=inits.resid,
                    post_mlp=inits.post)
    block_out = dict.fromkeys(CONNECTION_OUT, 0.0)
    block_out["source"] = mudd.backout_init
    return [list(block_in.values()), list(block_out.values())]


def named(coefs: Tensor, roles: tuple[str, ...]) -> dict[str, Tensor]:
    """[T, len(roles)] -> {role: [T, 1]}."""
    return dict(zip(roles, coefs.split(1, dim=-1)))


def xsa(y: Tensor, v: Tensor, alpha: Tensor) -> Tensor:
    """Exclusive self attention (arXiv:2603.09078), gated: y minus tanh(alpha) of its component
    along the token's own value vector. y, v [T, H, Dh], alpha [T, H] -> [T, H, Dh]."""
    along = (y * v).sum(-1, keepdim=True) / v.square().sum(-1, keepdim=True).clamp_min(XSA_EPS)
    return y - torch.tanh(alpha)[..., None] * along * v


def dc_weights(w1: Tensor, w2: Tensor) -> tuple[Tensor, Tensor]:
    """DC's per-token head weights from the gate coefficients [T, H]: w1 RMS-normed over heads
    (float32, eps 1e-6), w2 as is."""
    return F.rms_norm(w1.float(), (w1.shape[-1],), eps=1e-6).to(w1.dtype), w2


def block_windows(x: Tensor, num_blocks: int, window: int) -> Tensor:
    """The keys (or values) each DC query block reads: x [T, ...] -> [NB, window - 1 + DC_BLOCK,
    ...], row j of block n holding position n * DC_BLOCK - (window - 1) + j, zeros where that
    falls before 0 or at T and after. Built from whole blocks (the block itself and the shifted
    copies of the ones before it that the window reaches into) with pads, cats and slices only,
    so its backward adds slices; an index gather of the overlapping rows would, in the backward,
    scatter-add every row ~2x (at window 112 an inductor index_put kernel of 1.6 ms per stage-C
    micro-step on the H200, 2026-12-02)."""
    t, rest = x.shape[0], x.shape[1:]
    xb = F.pad(x, (0, 0) * len(rest) + (0, num_blocks * DC_BLOCK - t))
    xb = xb.view(num_blocks, DC_BLOCK, *rest)  # [NB, B, ...]
    back = -(-(window - 1) // DC_BLOCK)  # earlier blocks the window reaches into
    tail = (0, 0) * (len(rest) + 1)  # pads of every dim after the block dim
    parts = [F.pad(xb, tail + (m, 0))[:num_blocks] for m in range(back, 0, -1)]  # block n - m
    full = torch.cat([*parts, xb], dim=1)  # [NB, (back + 1) B, ...]
    return full[:, back * DC_BLOCK - (window - 1):]  # [NB, window - 1 + B, ...]


def dc_correction(q: Tensor, k: Tensor, v: Tensor, cum_seqlens: Tensor, w1: Tensor, w2: Tensor,
                  scale: float, window: int) -> Tensor:
    """DC's addition to a layer's attention output (dynamically composable attention, one
    composition over the heads): extra_h(t) = w2_h(t) sum_j a(t, j) v_h(j) with
    a(t, j) = sum_h' w1_h'(t) p_h'(t, j), p_h the softmax of scale q_h(t) . k_h(j) over the keys
    j with 0 <= t - j < window in t's document. q, k, v [T, H, D] (q, k as the attention used
    them), w1, w2 [T, H] -> [T, H, D] in v's dtype.

    Blocked: queries in blocks of DC_BLOCK, each against the window - 1 keys before it and its
    own (block_windows; zero rows pad the front and the end), so memory is O(T (DC_BLOCK +
    window)) per head."""
    t, h, d = q.shape
    nb = -(-t // DC_BLOCK)
    pad, span = nb * DC_BLOCK - t, DC_BLOCK + window - 1
    front = window - 1
    qb = F.pad(q, (0, 0, 0, 0, 0, pad)).view(nb, DC_BLOCK, h, d)  # [NB, B, H, D]
    kw, vw = (block_windows(x, nb, window) for x in (k, v))  # [NB, L, H, D]
    qpos = torch.arange(nb * DC_BLOCK, device=q.device).view(nb, DC_BLOCK)  # [NB, B]
    kpos = qpos[:, :1] + torch.arange(span, device=q.device) - front  # [NB, L] (< 0: padding)
    doc = document_ids(cum_seqlens, nb * DC_BLOCK)  # [NB*B]; positions >= T share the last id
    key_doc = torch.where(kpos >= 0, doc[kpos.clamp(min=0)], -1)  # [NB, L]
    rel = qpos[:, :, None] - kpos[:, None, :]  # [NB, B, L]
    valid = (rel >= 0) & (rel < window) & (doc[qpos][:, :, None] == key_doc[:, None, :])
    wide = torch.promote_types(q.dtype, torch.float32)  # the softmax at >= float32
    s = torch.einsum("nqhd,nkhd->nhqk", qb, kw).to(wide) * scale  # [NB, H, B, L]
    p = s.masked_fill(~valid[:, None], float("-inf")).softmax(-1)
    w1b = F.pad(w1, (0, 0, 0, pad)).view(nb, DC_BLOCK, h).to(wide)  # [NB, B, H]
    # the head mix as a broadcast product and a sum over H (6), not an einsum: as a batched
    # matmul of contraction length H it ran as float32 gemv / non-tensor-core GEMM kernels
    # (11 ms per step at C on the H200, 2026-12-02); this way inductor fuses it into reductions
    a = (p * w1b.transpose(1, 2)[..., None]).sum(1).to(v.dtype)  # [NB, B, L]
    mixed = torch.einsum("nqk,nkhd->nqhd", a, vw)  # [NB, B, H, D]
    return (mixed.reshape(nb * DC_BLOCK, h, d)[:t] * w2[..., None]).to(v.dtype)
