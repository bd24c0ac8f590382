"""GPT: the speedrun's GPT-2-small variant, single device, returning the per-token training loss.

What it replaces: HEAD modded-nanogpt's `GPT` (train_gpt.py:1486-1693, a 208-line forward with
hard-coded layer indices) with one config dataclass holding every layer index, and a forward split
into embed / attention block / MLP block / loss.

Architecture (modded-nanogpt record facts 1.2-1.6; MUDD gates, XSA, DC and MUDD connections are
optional (GPTConfig.mudd, model/mudd.py, off by default)):
token embedding; hashed bigram + trigram rows (NgramLookup, gated per layer); smear
x[t] += lambda * sigmoid(w . x[t][:12]) * x[t-1]; x0 = rms_norm(x); per layer: attention (QK-norm,
half-truncated RoPE + YaRN, sliding-window causal attention over packed documents; short window
except on `long_window_layers`, which use `yarn_wide` and the partial key offset; paired-head
attention on `paired_head_layers` with `yarn_paired_head`), value embeddings added into V on
`value_embed_layers` with gates 2*sigmoid(W.[attn_in[:6], ve[:6]]) per head; layer
`no_attention_layer` has no attention and a sigmoid-gated skip from `skip_from_layer`'s output; ReLU^2
MLP; residual lambdas; x0 skips; final rms_norm; lm head; softcap 23*sigmoid((z+5)/7.5); MTP and
prefix-token CE (loss.py).

Parameters (names optim/anvil_config.PARAM_TABLE keys on):
- matrix banks (ANVIL): `qk_bank` [NQK, 2*Dh, D] one entry per (attention layer, {Q, K}, head pair),
  `vo_bank` [NVO, D, D] one per (attention layer, {V, O}), `mlp_bank` [NL, 2, F, D] (c_fc [F, D]
  out x in, c_proj [F, D] stored in x out). Each bank's MATRIX count (NQK, NVO, 2*NL) is padded to a
  multiple of bank_pad_multiple (mlp_bank: NL entries of 2 matrices); pads are zero, unused.
- adam: `embed.weight` [V, D] (gradient through the float32 buffer `embed_grad_accum` when the
  trainer passes it as forward's embed_grad), `lm_head` [D, V] (transposed, HEAD layout), `value_embeds.weight`
  [NVE*V, D] (gradient through ValueEmbedPull.grad_accum when the trainer passes it), scalars
  `sa_lambdas`, `resid_lambdas`, `post_lambdas` [L, 2], `x0_lambdas`, `ngram_lambdas` [L],
  `smear_lambda`, `skip_lambda` [], gates `smear_gate.weight` [1, 12], `skip_gate` [],
  `ve_gate_bank` [NVE, H, 12] (NVE - 1 entries with MuddConfig.connections: the last layer's
  value-embedding gate is theirs; none if that leaves none). With MuddConfig.gates, `mudd_gates.{w1, w2, b2, scale}` replace
  x0_lambdas, ngram_lambdas and skip_gate; with MuddConfig.connections, `mudd_connections.{w1,
  w2, b2}` (model/mudd.py has the shapes). Scalars, gates and MUDD stay float32; cast only
  banks/embeddings/head to bf16.
- embed and lm_head are TWO parameters, equal (embed = lm_head.T) at init; keeping them tied while
  training (adding embed's gradient into lm_head's and copying back, facts 3) is the trainer's job.

Not parameters: the n-gram lookup's row cache and signs (`ngram_table`, model/ngram_lookup.py; the
table itself, its shards and its sparse Adam are the trainer's NgramStore, perf/ngram_store.py,
which fills the cache before each forward), YaRN tables, fp8 scales, prefix table.

What must stay stable for CUDA graphs: every parameter and buffer address (YaRN, prefix table,
n-gram cache and fp8 scales are only ever written in place). Python values the compiled forward
specializes on: shapes, ForwardScheduleConfig's ints, the YaRN attn_scale floats, the attention
backend, len(mtp_weights). No .item(), host syncs or data-dependent shapes in forward/eval_ce.

Call order (trainer): GPT(cfg) -> cast params -> .to(device) -> resolve_attention_backend(device)
(logged) -> set_prefix_table(...) in the timed region -> per step set_yarn_window(ws_long) (YaRN
moves where ws_long changes) and model(...) -> after warmup reset_yarn() (+ ngram_table.reset()).

Deviations from HEAD: by default no MUDD gates, XSA or MUDD connections (GPTConfig.mudd turns
them on: then the x0, n-gram and skip coefficients are per token, XSA and the attention output
gates run, DC adds to the last layer's output (MuddConfig.dc), and the last layer and the final
norm read the connections; without them the backout is a constant, GPTConfig.backout, off by
default); DC in torch ops (HEAD: a Triton kernel), its window 112; MUDD parameters stay
float32 (HEAD: bf16); layers 8-10 read norm(x), not norm(output of layer 7), unless
GPTConfig.attn_input_layer = 7; the QKV pre-multiplier sa_lambdas[:, 0] scales V only (Q and K
are rms-normed right after, which removes the factor); trigram rows; full-softmax loss in torch ops.

Legend: T tokens, D model dim, H heads, Dh head_dim, F MLP hidden, V vocab, L layers, N MTP targets,
NVE value-embedding tables, C cum_seqlens entries.
"""

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from track_1_short.model.attention import (attention, pair_heads, pair_major_columns, paired_rows,
                                           resolve_backend, unpair_heads)
from track_1_short.model.fp8 import PlainMatmuls
from track_1_short.model.gpt_config import GPTConfig
from track_1_short.model.loss import per_token_ce, softcap, training_loss
from track_1_short.model.mudd import (CONNECTION_IN, CONNECTION_OUT, CoefBlocks, GateLayout,
                                      GateValues, ScalarInits, connection_inits, dc_correction,
                                      dc_weights, named, xsa)
from track_1_short.model.ngram_lookup import NgramLookup
from track_1_short.model.value_embed import ValueEmbedPull, pull_rows
from track_1_short.model.yarn import Yarn

SMEAR_DIMS = 12  # facts 1.2: the smear gate reads x[t][:12]
VE_GATE_DIMS = 6  # the value-embedding gate reads attn_in[:6] and ve[:6]
# the learned scalars' inits (facts 1.2), which MUDD's per-token coefficients start from too
INITS = ScalarInits(resid=math.sqrt(1.1), post=1.0, x0=0.0, ngram=0.05, skip=0.5)


@dataclass(slots=True)
class ForwardScheduleConfig:
    """Per-step schedule values. Tensors change within a key (copied into static buffers); the ints
    are specialized on by the compiled forward (part of StepGraphKey)."""

    mtp_weights: Tensor  # float32 [N]
    prefix_weight: Tensor  # float32 0-d
    ws_short: int  # tokens
    ws_long: int  # tokens
    train_max_seq_len: int  # tokens


@dataclass(slots=True)
class LayerMix:
    """Layer i's coefficients: learned 0-d scalars, or with MUDD per-token [T, 1] / [T, H]
    values, all in x's dtype."""

    resid_attn: Tensor
    post_attn: Tensor
    resid_mlp: Tensor
    post_mlp: Tensor
    x0: Tensor | None = None  # coefficient of x0_src (None: no term; the no-attention layer)
    x0_src: Tensor | None = None  # x0, or (the connected last layer) the residual before layer 0
    ngram: Tensor | None = None  # layer 0's scales the n-gram rows in the first residual
    skip: Tensor | None = None  # the no-attention layer's skip gate
    xsa: Tensor | None = None  # [T, H] XSA strength before tanh
    attn_gate: Tensor | None = None  # [T, H]
    v_extra: Tensor | None = None  # [T, D] added into V
    ve_gate: Tensor | None = None  # [T, H]: replaces the ve_gate_bank gate
    dc: tuple[Tensor, Tensor] | None = None  # DC's head weights (w1, w2) [T, H] each


EVAL_MATMULS = PlainMatmuls()  # eval never runs fp8 (nor advances its delayed scales)


class BankViews(NamedTuple):
    """The matrix banks split into per-matrix views once per forward (GPT._bank_views), which the
    layers then read. Indexing a bank per layer (`mlp_bank[i]`, `qk_bank[a*h:(a+1)*h]`) makes
    each bank's gradient a sum of one select/slice backward per layer, a full-bank tensor each:
    inductor fuses them into one kernel that loads every layer's gradient for every element of the
    bank (0.59 ms per micro-step for mlp_bank on the H200, 2026-12-02 trace). One unbind per bank
    makes it a stack, whose slices the weight-gradient GEMMs write in place."""

    qk: tuple[Tensor, ...]  # per attention slot a: [2*H*Dh, D] (H head pairs' Q and K rows)
    vo: tuple[Tensor, ...]  # per entry: [D, D]; slot a's V at 2a, its O at 2a + 1
    mlp: tuple[Tensor, ...]  # per matrix: [F, D]; layer i's c_fc at 2i, its c_proj at 2i + 1


def _padded(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def rms_norm(x: Tensor) -> Tensor:
    return F.rms_norm(x, (x.shape[-1],))


GRAD_W_CHUNKS = 64  # narrow_linear's weight gradient: T split into up to this many GEMMs of a bmm


def narrow_product_sum(x: Tensor, w: Tensor) -> Tensor:
    """x [T, K], w [N, K] -> [T, N]: products summed over K in float32, rounded to x's dtype once
    (narrow_linear's forward; autograd's own backward of it is the slow one narrow_linear avoids)."""
    return (x.unsqueeze(-2).float() * w.float()).sum(-1).to(x.dtype)  # [T, N, K] -> [T, N]


class _NarrowLinear(torch.autograd.Function):
    """narrow_linear's op: x [T, K] bf16, w [N, K] -> [T, N]. Traced by dynamo/AOTAutograd."""

    @staticmethod
    def forward(x: Tensor, w: Tensor) -> Tensor:
        return narrow_product_sum(x, w)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, g: Tensor):
        x, w = ctx.saved_tensors
        grad_x = (g.unsqueeze(-1).float() * w.float()).sum(-2).to(x.dtype)  # [T, N, K] -> [T, K]
        t, c = x.shape[0], math.gcd(x.shape[0], GRAD_W_CHUNKS)  # static: dynamic=False compiles
        xc = x.float().reshape(c, t // c, x.shape[1])  # [C, T/C, K]
        gc = g.float().reshape(c, t // c, g.shape[1])  # [C, T/C, N]
        grad_w = torch.bmm(gc.transpose(1, 2), xc).sum(0)  # [C, N, K] -> [N, K], float32 sums
        return grad_x, grad_w.to(w.dtype)


def narrow_linear(x: Tensor, w: Tensor) -> Tensor:
    """F.linear(x, w) for a narrow weight (the smear gate [1, 12], the value-embedding gates
    [H, 12]): x [T, K], w [N, K] -> [T, N] in x's dtype; F.linear is its reference.
    Forward and input gradient: products summed over K (N) in float32, rounded once, which
    inductor fuses into their neighbours. Weight gradient: T split into C = gcd(T, 64) chunks, a
    float32 bmm [C, N, T/C] @ [C, T/C, K] (x and g hold bf16 values, exact in TF32) and a sum over
    C; callers keep T a multiple of 64 (the smear gate runs on all T rows, not T - 1).

    Why: as F.linear the weight gradient is one GEMM contracting over all T tokens into N * K <=
    72 outputs. cuBLAS runs it split-K with its workspace (~7 us at T = 16384 on an H100) and on
    one thread block without it (train.blas=no_workspace, which keeps the memsets out of the step
    graphs): ~190 us at T = 16384, ~430 us at T = 49152, five per micro-step. Left to autograd, the
    product-and-sum form's weight gradient is an inductor reduction over T with 72 outputs: ~230 us
    and ~720 us (docs/results/host_bound_h100_2026-12-06/, calls 2-3 and 5). The bmm's C chunks
    each get their own thread blocks under any cuBLAS setting."""
    return _NarrowLinear.apply(x, w)


def norm_rotate(qk: Tensor, yarn: Yarn, paired: bool, copies: bool = False) -> tuple[Tensor, Tensor]:
    """The torch definition of q/k's rms-norm + rotation (kernels/qk_norm_rope.py's reference):
    qk [T, 2, H, Dh] -> q, k each [T, H, Dh] or, paired, [2T, H/2, Dh] (pair_heads' layout),
    rotated per head at doubled positions (Yarn.rotate_doubled); `copies` (paired only): rotated
    over [T, H/2, 2Dh] and then copied by pair_heads (GPTConfig.paired_head_copies), the same values."""
    t, _, h, dh = qk.shape
    # unbind, not qk[:, 0] / qk[:, 1]: its backward is one stack that inductor writes in place;
    # two selects' backward is zeros + select_backward + add, an extra pass (11.6 ms per step
    # at C in the H200 trace of 2026-12-03)
    q, k = (rms_norm(z) for z in qk.unbind(1))  # [T, H, Dh] each
    if not paired:
        return yarn.rotate(q), yarn.rotate(k)
    if copies:
        return tuple(pair_heads(yarn.rotate(z.reshape(t, h // 2, 2 * dh)).view(t, h, dh)) for z in (q, k))
    return yarn.rotate_doubled(pair_heads(q)), yarn.rotate_doubled(pair_heads(k))  # written paired


class GPT(nn.Module):
    """Concern: the model's single-device math (the forward and the eval CE) and the state it
    reads (parameters, YaRN tables, the prefix table, the n-gram lookup's cache). Systems
    concerns (dtype casts, fp8, the fused loss, compile, graphs) are applied from outside
    (trainer/build.py)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        c = self.config = config
        d, v, h, dh, nl = c.model_dim, c.vocab_size, c.num_heads, c.head_dim, c.num_layers
        self.attn_slot = {layer: a for a, layer in enumerate(c.attention_layers)}  # layer -> bank slot
        self.ve_slot = {layer: k for k, layer in enumerate(c.value_embed_layers)}
        n_attn, pad = len(self.attn_slot), c.bank_pad_multiple
        bound = math.sqrt(3) * 0.5 * d ** -0.5  # uniform with std 0.5/sqrt(D) (modded-nanogpt init)

        self.embed = nn.Embedding(v, d)
        self.lm_head = nn.Parameter(torch.randn(d, v) * c.lm_head_init_std)  # [D, V]
        with torch.no_grad():
            self.embed.weight.copy_(self.lm_head.T)
        # the token embedding's pulled gradient (forward's embed_grad; float32 whatever the
        # table's dtype: a micro-step's repeated tokens and the micro-steps sum in it)
        self.register_buffer("embed_grad_accum", torch.zeros(v, d), persistent=False)  # [V, D]
        self.value_embeds = ValueEmbedPull(len(c.value_embed_layers), v, d)
        self.ngram_table = NgramLookup(c.ngram)  # the lookup only: the table is the trainer's NgramStore

        qk = torch.zeros(_padded(n_attn * h, pad), 2 * dh, d)  # [NQK, 2Dh, D]
        qk[: n_attn * h].uniform_(-bound, bound)
        vo = torch.zeros(_padded(2 * n_attn, pad), d, d)  # [NVO, D, D]; V entries even, O odd
        vo[0: 2 * n_attn: 2].uniform_(-bound, bound)
        if c.attn_out_init == "uniform":  # else O stays zero
            vo[1: 2 * n_attn: 2].uniform_(-bound, bound)
        # [NL, 2, F, D]; c_proj zero init; NL entries hold 2*NL matrices, a multiple of pad
        mlp = torch.zeros(_padded(nl, pad // math.gcd(pad, 2)), 2, c.mlp_hidden, d)
        mlp[:nl, 0].uniform_(-bound, bound)
        self.qk_bank, self.vo_bank, self.mlp_bank = (nn.Parameter(t) for t in (qk, vo, mlp))

        self.sa_lambdas = nn.Parameter(torch.tensor([[0.5, 1.0]] * nl))  # [L, 2] (V in, O out)
        self.resid_lambdas = nn.Parameter(torch.full((nl, 2), INITS.resid))  # [L, 2] (attn, mlp)
        self.post_lambdas = nn.Parameter(torch.full((nl, 2), INITS.post))  # [L, 2]
        self.smear_gate = nn.Linear(SMEAR_DIMS, 1, bias=False)
        nn.init.zeros_(self.smear_gate.weight)
        self.smear_lambda = nn.Parameter(torch.zeros(()))
        self.skip_lambda = nn.Parameter(torch.tensor(-1.5))
        m = c.mudd
        # the value-embedding gates' weights, one entry per gated layer (a connected last layer's
        # gate comes from the connections)
        gated = [i for i in c.value_embed_layers if not (m.connections and i == nl - 1)]
        self.ve_gate_slot = {layer: k for k, layer in enumerate(gated)}
        if gated:
            self.ve_gate_bank = nn.Parameter(torch.zeros(len(gated), h, 2 * VE_GATE_DIMS))
        if m.gates:  # per-token x0, n-gram and skip coefficients replace the scalars
            self.gate_layout = GateLayout.build(m, nl, h, c.attention_layers, c.no_attention_layer, INITS)
            self.mudd_gates = CoefBlocks(d, m.hidden, self.gate_layout.inits, m.gate_scale,
                                         learn_scale=True)
        else:
            self.x0_lambdas = nn.Parameter(torch.full((nl,), INITS.x0))  # [L]
            self.ngram_lambdas = nn.Parameter(torch.full((nl,), INITS.ngram))  # [L]
            self.skip_gate = nn.Parameter(torch.tensor(INITS.skip))
        if m.connections:
            self.mudd_connections = CoefBlocks(d, m.hidden, connection_inits(m, INITS),
                                               m.connection_scale, learn_scale=False)

        self.yarn = Yarn(dh, c.max_position)
        self.yarn_paired_head = Yarn(dh, c.max_position, paired=True)
        self.yarn_wide = Yarn(dh, c.max_position)
        # Strategies the trainer may replace before compiling (trainer/build.py prepare_model):
        # the training forward's matmuls (fp8: model/fp8.Fp8Matmuls) and its lm-head loss (the
        # fused kernel, kernels/softcap_ce.py: f(x, lm_head, targets, mtp_weights, prefix_weight,
        # prefix_targets) -> [T]). Eval always uses plain matmuls and the torch loss.
        self.matmuls: PlainMatmuls = PlainMatmuls()
        self.head_loss = None  # None: softcap(matmuls lm_head) -> loss.training_loss
        # q/k rms-norm + rotation in one kernel (kernels/qk_norm_rope.py: f(qk [T, 2, H, Dh], cos,
        # sin [rows, Dh], paired) -> q, k in the attention's layout); None: norm_rotate (the torch
        # definition, its reference). Training and eval alike (trainer/build.py installs it).
        self.qk_norm_rope = None
        self.register_buffer("prefix_table", torch.full((v,), -1, dtype=torch.int64))  # [V]
        self.attention_backend: str | None = None  # set by resolve_attention_backend
        self.yarn_window: int | None = None  # ws_long the YaRN tables serve (None: the base tables)

    # ---- trainer-facing helpers (eager) ----

    def resolve_attention_backend(self, device: torch.device) -> str:
        """Fix the attention backend for `device` (config 'auto': CUDA flex, CPU reference)."""
        self.attention_backend = resolve_backend(self.config.attention_backend, device)
        return self.attention_backend

    def apply_window_change(self, old_ws_long: int, new_ws_long: int):
        """YaRN at a stage transition. All three tables follow ws_long, as HEAD's two do (facts 1.3);
        ws_short changes do not touch YaRN. yarn_wide is its own instance (own scale) so a later
        schedule can move it separately; today it stays equal to `yarn`."""
        if old_ws_long != new_ws_long:
            for y in (self.yarn, self.yarn_paired_head, self.yarn_wide):
                y.extend_window(old_ws_long, new_ws_long)

    def set_yarn_window(self, ws_long: int):
        """YaRN for the training window ws_long, from the window the tables serve now: nothing when
        they already serve it (a step run again, a stage's later steps), apply_window_change
        otherwise. The first call after construction or reset_yarn() only records ws_long (the
        base tables serve the first stage). Windows must come in schedule order: YaRN updates
        compound (384 -> 896 -> 1408 is not 384 -> 1408)."""
        if self.yarn_window is not None:
            self.apply_window_change(self.yarn_window, ws_long)
        self.yarn_window = ws_long

    def reset_yarn(self):
        for y in (self.yarn, self.yarn_paired_head, self.yarn_wide):
            y.reset()
        self.yarn_window = None

    @torch.no_grad()
    def set_prefix_table(self, table: Tensor):
        """In-place fill (the compiled graph keeps the buffer); table int64 [V], -1 = no prefix."""
        self.prefix_table.copy_(table)

    # ---- forward ----

    def forward(self, inputs: Tensor, targets: Tensor, cum_seqlens: Tensor, ngram_slots: Tensor,
                cfg: ForwardScheduleConfig, ngram_sink: Tensor | None = None,
                value_embed_grad: Tensor | None = None, embed_grad: Tensor | None = None) -> Tensor:
        """Per-token training loss float32 [T]; the trainer backpropagates loss.sum().
        value_embed_grad / embed_grad: persistent buffers the value-embedding tables' / the token
        embedding's backward adds into (model/value_embed.pull_rows; those tables then get no
        .grad), or None for dense gradients."""
        x = self._trunk(inputs, cum_seqlens, ngram_slots, ngram_sink, value_embed_grad, embed_grad,
                        cfg.ws_short, cfg.ws_long, cfg.train_max_seq_len, self.matmuls)  # [T, D]
        prefix_targets = self.prefix_table[targets]  # [T], -1: no prefix term
        if self.head_loss is not None:
            return self.head_loss(x, self.lm_head, targets, cfg.mtp_weights, cfg.prefix_weight,
                                  prefix_targets)
        capped = softcap(self.matmuls.matmul(x, self.lm_head, "lm_head"))  # [T, V]
        return training_loss(capped, targets, cfg.mtp_weights, cfg.prefix_weight, prefix_targets)

    def eval_ce(self, inputs: Tensor, targets: Tensor, cum_seqlens: Tensor, ngram_slots: Tensor,
                ws_short: int, ws_long: int, max_seq_len: int) -> Tensor:
        """Per-token CE float32 [T] (no MTP, no prefix term, no fp8), logits in chunks."""
        x = self._trunk(inputs, cum_seqlens, ngram_slots, None, None, None, ws_short, ws_long,
                        max_seq_len, EVAL_MATMULS)
        chunk = self.config.eval_chunk_tokens
        out = []
        for start in range(0, x.shape[0], chunk):
            logits = x[start: start + chunk] @ self.lm_head.to(x.dtype)  # [chunk, V]
            out.append(per_token_ce(softcap(logits), targets[start: start + chunk]))
        return torch.cat(out)

    def _backend(self, device: torch.device) -> str:
        if self.attention_backend is not None:
            return self.attention_backend
        if self.config.attention_backend == "auto":
            return "flex" if device.type == "cuda" else "reference"
        raise ValueError("call model.resolve_attention_backend(device) before the first forward")

    def _trunk(self, inputs, cum_seqlens, ngram_slots, ngram_sink, value_embed_grad, embed_grad,
               ws_short: int, ws_long: int, max_seq_len: int, matmuls: PlainMatmuls) -> Tensor:
        """Embedding through the last layer; returns rms_norm(x) [T, D]. `matmuls`: the MLP
        projections' strategy (the training forward's self.matmuls; eval's plain one)."""
        c, m = self.config, self.config.mudd
        backend = self._backend(inputs.device)
        last = c.num_layers - 1
        banks = self._bank_views()
        x = pull_rows(self.embed.weight, inputs.long(), embed_grad)  # [T, D]
        ngram = self.ngram_table.gather(ngram_slots, ngram_sink).to(x.dtype)  # [T, D]
        w = self.smear_gate.weight.to(x.dtype)  # [1, 12]
        gate = torch.sigmoid(narrow_linear(x[:, :SMEAR_DIMS], w))[1:]  # [T, 1] -> [T-1, 1]
        x = torch.cat([x[:1], x[1:] + self.smear_lambda.to(x.dtype) * gate * x[:-1]])
        x0 = rms_norm(x)
        gates = GateValues(self.mudd_gates, self.gate_layout) if m.gates else None
        if gates is not None:
            gates.compute(0, x0)
        mix = self._mix(0, x0, gates)
        x = x0 + mix.ngram * ngram
        ves = {layer: self.value_embeds.lookup(k, inputs, value_embed_grad).to(x.dtype)
               for layer, k in self.ve_slot.items()}  # each [T, D]
        first = x  # the residual entering layer 0 (the connections' "embed" source)
        after = {}  # layer -> the residual after it: the skip, attention-input, backout and source
        for i in range(c.num_layers):
            if gates is not None and i == m.split_layer:
                gates.compute(1, x)
            if i > 0:
                mix = self._mix(i, x0, gates)
            if i == c.no_attention_layer:
                skip = after[c.skip_from_layer]
                x = x + (torch.sigmoid(self.skip_lambda).to(x.dtype) * mix.skip) * skip
            else:
                window = ws_long if i in c.long_window_layers else ws_short
                source = after.get(c.attn_input_layer, x)  # set only for the layers after it
                if m.connections and i == last:
                    x, mix = self._connect_in(x, first, after[m.source_layer], mix)
                x = self._attention_block(i, x, ngram, ves.get(i), cum_seqlens, window, max_seq_len,
                                          backend, source, mix, banks)
            x = self._mlp_block(i, x, matmuls, mix, banks)
            after[i] = x
        if c.backout_layer is not None and c.backout:
            x = x + c.backout * after[c.backout_layer]
        if m.connections:
            sources = {"embed": first, "source": after[m.source_layer], "previous": after[last - 1],
                       "value_embed": ves[c.value_embed_layers[0]], "skip": after[c.skip_from_layer]}
            mu = named(self.mudd_connections(x, 1), CONNECTION_OUT)  # each [T, 1]
            x = x + sum(mu[name] * sources[name] for name in CONNECTION_OUT)
        return rms_norm(x)

    def _bank_views(self) -> BankViews:
        """Each bank unbound once (BankViews says why); the pads are left out."""
        c = self.config
        n_qk, rows = len(self.attn_slot), c.num_heads * self.qk_bank.shape[1]
        qk = self.qk_bank[: n_qk * c.num_heads].view(n_qk, rows, -1).unbind(0)  # [2*H*Dh, D] each
        return BankViews(qk=qk, vo=self.vo_bank.unbind(0), mlp=self.mlp_bank.flatten(0, 1).unbind(0))

    def _mix(self, i: int, x0: Tensor, gates: GateValues | None) -> LayerMix:
        """Layer i's coefficients: the learned scalars, or per-token gates (MuddConfig.gates)."""
        dt = x0.dtype
        mix = LayerMix(resid_attn=self.resid_lambdas[i, 0].to(dt), post_attn=self.post_lambdas[i, 0].to(dt),
                   resid_mlp=self.resid_lambdas[i, 1].to(dt), post_mlp=self.post_lambdas[i, 1].to(dt),
                   x0_src=x0)
        if gates is None:
            mix.x0, mix.ngram = self.x0_lambdas[i].to(dt), self.ngram_lambdas[i].to(dt)
            mix.skip = self.skip_gate.to(dt)
        else:
            mix.x0, mix.ngram, mix.skip = (gates.get(i, r) for r in ("x0", "ngram", "skip"))
            mix.xsa, mix.attn_gate = gates.get(i, "xsa"), gates.get(i, "attn_gate")
            w1 = gates.get(i, "dc_w1")
            if w1 is not None:
                mix.dc = dc_weights(w1, gates.get(i, "dc_w2"))
        return mix

    def _connect_in(self, x: Tensor, first: Tensor, source: Tensor, mix: LayerMix):
        """The connections' first block, at the start of the last layer (x its input): a V term
        from the first residual, the source layer's and x, x recombined from them, and the
        layer's per-token lambdas and VE gate."""
        h = self.config.num_heads
        mu = named(self.mudd_connections(x, 0), CONNECTION_IN)  # each [T, 1]
        mix.v_extra = mu["v_embed"] * first + mu["v_source"] * source + mu["v_self"] * x
        mix.ve_gate = torch.cat([mu["ve_gate_a"].expand(-1, h // 2),
                                 mu["ve_gate_b"].expand(-1, h - h // 2)], dim=-1)  # [T, H]
        for name in ("resid_attn", "post_attn", "x0", "ngram", "resid_mlp", "post_mlp"):
            setattr(mix, name, mu[name])
        mix.x0_src = first
        x = (1 + mu["r_self"]) * x + mu["r_embed"] * first + mu["r_source"] * source
        return x, mix

    def _attention_block(self, i: int, x: Tensor, ngram: Tensor, ve: Tensor | None,
                         cum_seqlens: Tensor, window: int, max_seq_len: int, backend: str,
                         attn_in: Tensor, mix: LayerMix, banks: BankViews) -> Tensor:
        """Layer i's attention over rms_norm(attn_in) (x, or an earlier layer's residual:
        GPTConfig.attn_input_layer) added into the residual x with mix's coefficients."""
        c = self.config
        t, h, dh, a = x.shape[0], c.num_heads, c.head_dim, self.attn_slot[i]
        lam = self.sa_lambdas[i].to(x.dtype)
        xn = rms_norm(attn_in)  # [T, D]
        qk_w = banks.qk[a].to(x.dtype)  # [2*H*Dh, D]
        qk = F.linear(xn, qk_w).view(t, 2, h, dh)  # [T, 2, H, Dh]: q, k
        v = F.linear(xn, banks.vo[2 * a].to(x.dtype)).view(t, h, dh) * lam[0]
        if ve is not None:
            gate = mix.ve_gate
            if gate is None:
                gate_in = torch.cat([xn[:, :VE_GATE_DIMS], ve[:, :VE_GATE_DIMS]], dim=-1)  # [T, 12]
                w = self.ve_gate_bank[self.ve_gate_slot[i]].to(x.dtype)  # [H, 12]
                gate = 2 * torch.sigmoid(narrow_linear(gate_in, w))  # [T, H]
            v = v + gate[..., None] * ve.view(t, h, dh)
        if mix.v_extra is not None:
            v = v + mix.v_extra.view(t, h, dh)
        # [T, H, Dh]; a paired layer's in place: [2T, H/2, Dh] (GPTConfig.paired_head_copies)
        y = self._attend(i, qk, v, cum_seqlens, window, max_seq_len, backend, mix.dc)
        o_w = banks.vo[2 * a + 1].to(x.dtype)  # [D, H*Dh]
        if i in c.paired_head_layers and not c.paired_head_copies:  # no XSA here: MuddConfig.check
            if mix.attn_gate is not None:
                y = y * pair_heads(mix.attn_gate[..., None])  # [T, H, 1] -> [2T, H/2, 1]
            y, o_w = paired_rows(y), pair_major_columns(o_w, h)  # [T, H*Dh], [D, H*Dh]
        else:
            if mix.xsa is not None:
                y = xsa(y, v, mix.xsa)
            if mix.attn_gate is not None:
                y = y * mix.attn_gate[..., None]
            y = y.reshape(t, h * dh)
        y = F.linear(y, o_w) * lam[1]
        x = mix.resid_attn * x + mix.post_attn * y + mix.x0 * mix.x0_src
        if i > 0:  # layer 0's n-gram term went into the residual's initial value
            x = x + mix.ngram * ngram
        return x

    def _norm_rotate(self, qk: Tensor, yarn: Yarn, paired: bool) -> tuple[Tensor, Tensor]:
        """qk [T, 2, H, Dh] -> q, k rms-normed per head and rotated by `yarn`, each [T, H, Dh] or,
        paired, [2T, H/2, Dh] (pair_heads' layout). The installed kernel (self.qk_norm_rope) where
        there is one, except on the paired reference path; else this torch code, its reference."""
        copies = paired and self.config.paired_head_copies
        if self.qk_norm_rope is not None and not copies:
            return self.qk_norm_rope(qk, *yarn.head_tables(), paired)
        return norm_rotate(qk, yarn, paired, copies)

    def _attend(self, i: int, qk: Tensor, v: Tensor, cum_seqlens: Tensor, window: int,
                max_seq_len: int, backend: str, dc: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """Norm + rotary + attention for layer i over qk [T, 2, H, Dh] and v [T, H, Dh]: paired
        heads, long (wide + key offset) or short; with `dc` (unpaired layers), DC's addition over
        the rotated q, k (mudd.dc_correction). Returns [T, H, Dh]; a paired layer's
        [2T, H/2, Dh] unless GPTConfig.paired_head_copies."""
        c = self.config
        t, _, h, dh = qk.shape
        if i in c.paired_head_layers:
            y = self.yarn_paired_head
            q, k = self._norm_rotate(qk, y, paired=True)  # [2T, H/2, Dh] each
            out = attention(q, k, pair_heads(v), 2 * cum_seqlens,
                            2 * max_seq_len, window, y.attn_scale, backend)  # [2T, H/2, Dh]
            return unpair_heads(out) if c.paired_head_copies else out
        y = self.yarn_wide if i in c.long_window_layers else self.yarn
        q, k = self._norm_rotate(qk, y, paired=False)  # [T, H, Dh] each
        if i in c.long_window_layers:
            # partial key offset (facts 1.2): the stationary half of k_t is k_{t-1}'s (not doc-masked)
            half = dh // 2
            k = torch.cat([k[:, :, :half], torch.cat([k[:1, :, half:], k[:-1, :, half:]])], dim=-1)
        out = attention(q, k, v, cum_seqlens, max_seq_len, window, y.attn_scale, backend)
        if dc is not None:
            out = out + dc_correction(q, k, v, cum_seqlens, *dc, y.attn_scale, c.mudd.dc_window)
        return out

    def _mlp_block(self, i: int, x: Tensor, matmuls: PlainMatmuls, mix: LayerMix,
                   banks: BankViews) -> Tensor:
        # [F, D] each: c_fc (out x in), c_proj (in x out)
        fc, proj = (banks.mlp[2 * i + j].to(x.dtype) for j in (0, 1))
        # with fp8 installed (training forward only), mlp_down advances layer i's delayed scales;
        # with a fused MLP kernel installed (kernels/relu2_mlp.py), one kernel per projection
        y = matmuls.relu2_mlp(rms_norm(x), fc, proj, layer=i)  # [T, D]
        return mix.resid_mlp * x + mix.post_mlp * y
