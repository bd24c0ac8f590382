"""MuddConfig: the per-token coefficient MLPs of model/mudd.py (HEAD's MUDD gates, DC and MUDD
connections), nested into GPTConfig.mudd. Every part is off by default: each is a loss-parity
ablation until measured (docs/LOG.md).

What must stay stable: nothing here holds tensors. Validated when built, against the GPTConfig it
is nested into (GPTConfig.__post_init__ calls `check`); every message names the field to change.
"""

from dataclasses import dataclass


@dataclass(slots=True, kw_only=True)
class MuddConfig:
    # Gates: two MLP blocks (hidden `hidden`) give per-token coefficients. Block 0 reads x0 and
    # serves the layers before `split_layer`, block 1 reads the residual entering `split_layer` and
    # serves the rest. They replace the learned scalars x0_lambdas, ngram_lambdas and skip_gate
    # with per-token values (same init), and add XSA on `xsa_layers` and an output gate on
    # `attn_gate_layers` (HEAD: MUDD gates, PR #315).
    gates: bool = False
    # Connections: a block at the start of the last layer (its V gets a term from x0's residual,
    # the residual after `source_layer` and its own input; its residual is recombined from them;
    # its lambdas, value-embedding gate and x0 / n-gram coefficients become per-token) and a block
    # after the last layer (the final norm reads x plus learned per-token amounts of those
    # residuals, of the skip layer's output and of the first value embedding; the source_layer
    # term starts at `backout_init`) (HEAD: MUDD, arXiv:2502.12170).
    connections: bool = False
    hidden: int = 64  # both kinds of block: D -> hidden -> coefficients
    split_layer: int = 4  # HEAD: the post gate is computed at the start of layer 4
    xsa_layers: tuple[int, ...] = (1, 3, 4, 7)  # y -= tanh(a) <y, v> / |v|^2 v (arXiv:2603.09078)
    attn_gate_layers: tuple[int, ...] = (3, 10)  # y *= g per token and head
    attn_gate_init: float = 0.25
    source_layer: int = 7  # the connections' middle source (HEAD: cache[7])
    backout_init: float = -0.5  # the post-loop block's source_layer coefficient at init
    ve_gate_init: float = 2.0  # the last layer's value-embedding gate at init (HEAD: 2*sigmoid's bound)
    # DC (HEAD: lightweight dynamically composable attention on layer 10; needs the gates, whose
    # block gives its per-token head weights): the layer's output gains w2_h(t) sum_j a(t, j)
    # v_h(j), a(t, j) = sum_h' w1_h'(t) p_h'(t, j), p the softmax of the layer's own scores over
    # the last `dc_window` keys of the token's document (w1 RMS-normed over heads, init 1; w2
    # init 0: no change at init)
    dc: bool = False
    dc_layers: tuple[int, ...] = (10,)
    dc_window: int = 112
    gate_scale: float = 0.1  # the gates' output scale at init (a learned scalar)
    connection_scale: float = 0.1  # the connections' output scale (a constant)

    def check(self, num_layers: int, attention_layers: list[int], paired_layers: tuple[int, ...],
              value_embed_layers: tuple[int, ...]):
        """Raise ValueError naming the field when the layer indices do not fit the model."""
        if self.hidden < 1:
            raise ValueError(f"MuddConfig.hidden={self.hidden} must be >= 1")
        if self.dc_window < 1:
            raise ValueError(f"MuddConfig.dc_window={self.dc_window} must be >= 1")
        if self.dc and not self.gates:
            raise ValueError("MuddConfig.dc takes its head weights from the gates: set gates=true too")
        if not (self.gates or self.connections):
            return
        if not 0 < self.split_layer < num_layers:
            raise ValueError(f"MuddConfig.split_layer={self.split_layer} must lie in (0, {num_layers})")
        bad = [i for i in self.xsa_layers if i not in attention_layers or i in paired_layers]
        if self.gates and bad:
            raise ValueError(f"MuddConfig.xsa_layers has {bad}: XSA needs an unpaired attention layer "
                             f"(attention layers {attention_layers}, paired {list(paired_layers)})")
        bad = [i for i in self.dc_layers if i not in attention_layers or i in paired_layers]
        if self.dc and bad:
            raise ValueError(f"MuddConfig.dc_layers has {bad}: DC needs an unpaired attention layer")
        bad = [i for i in self.attn_gate_layers if i not in attention_layers]
        if self.gates and bad:
            raise ValueError(f"MuddConfig.attn_gate_layers has {bad}: not attention layers "
                             f"{attention_layers}")
        last = num_layers - 1
        if self.connections:
            if last not in attention_layers:
                raise ValueError(f"MuddConfig.connections needs attention in the last layer {last}")
            if not 0 <= self.source_layer < last:
                raise ValueError(f"MuddConfig.source_layer={self.source_layer} must lie in [0, {last}): "
                                 f"a residual recorded before the last layer")
            if last not in value_embed_layers:
                raise ValueError(f"MuddConfig.connections gates the last layer's value embedding: "
                                 f"GPTConfig.value_embed_layers must hold {last}")
