"""GPTConfig: every layer index and size of the GPT (model/gpt.py), in a module of its own so the
run config (config.py) imports no runtime module. Nests the n-gram and fp8 configs.

What must stay stable: nothing here holds tensors. Validated when built; every rule names the field
to change (tests/test_model.py::test_config_validation). `tiny()` is the CPU tests' and the
cpu-tiny preset's model.
"""

from dataclasses import dataclass, field

from track_1_short.model.tokens import PADDED_VOCAB
from track_1_short.model.fp8_config import Fp8Config
from track_1_short.model.mudd_config import MuddConfig
from track_1_short.model.ngram_config import NgramConfig

BACKENDS = ("auto", "reference", "flex", "varlen", "fa3", "fa4")  # attention backends (model/attention.py)
ATTN_OUT_INITS = ("zero", "uniform")  # the attention output projections' init (GPTConfig.attn_out_init)


@dataclass(slots=True, kw_only=True)
class GPTConfig:
    vocab_size: int = PADDED_VOCAB  # GPT-2's 50257 padded to a multiple of 128
    num_layers: int = 11
    model_dim: int = 768
    num_heads: int = 6  # even: qk_bank entries are head pairs
    head_dim: int = 128
    mlp_hidden: int = 3072
    long_window_layers: tuple[int, ...] = (3, 10)  # ws_long, yarn_wide, partial key offset
    paired_head_layers: tuple[int, ...] = (0, 2, 5, 9)  # yarn_paired_head, doubled positions
    no_attention_layer: int | None = 6
    skip_from_layer: int = 3  # its output skips into no_attention_layer
    value_embed_layers: tuple[int, ...] = (1, 2, 8, 9, 10)  # table k serves the k-th of these
    # each bank's matrix count is padded to a multiple of this, so the optimizer's sharding splits it
    # over 1, 2, 4 or 8 ranks (8 = constants.REFERENCE_WORLD_SIZE): speedrun qk 60 -> 64, vo 20 -> 24,
    # mlp 11 layers x 2 = 22 -> 24 matrices (12 entries)
    bank_pad_multiple: int = 8
    max_position: int = 262_144  # rotary table rows: >= the largest T (train and eval) per rank
    attention_backend: str = "auto"  # BACKENDS (model/attention.py)
    lm_head_init_std: float = 0.005
    # the attention output projections (vo_bank's O entries): "zero" (ours so far, as the older
    # records) or "uniform" (HEAD: O drawn like V, std 0.5/sqrt(D), so Q, K and V get gradient at
    # step 0); a loss-parity ablation until measured
    attn_out_init: str = "zero"
    # None: every layer's attention reads rms_norm(x) (ours so far); L: the layers after L read
    # rms_norm(the residual after layer L) instead (HEAD: 7, layers 8-10 attend over norm(h_7))
    attn_input_layer: int | None = None
    # paired layers' layout copies. False (in place): q and k are put in pair_heads' layout before
    # the rotation (Yarn.rotate_doubled), which then writes them there, and the output projection
    # reads the attention output as it is (its columns permuted: attention.pair_major_columns, a
    # [D, H*Dh] weight copy). True (the reference): q and k rotated in [T, H, Dh], then copied by
    # pair_heads; the output copied back by unpair_heads (three [T, D] copies per layer and
    # micro-step that the in-place path has not). The same values either way (the output
    # projection's sum in another order).
    paired_head_copies: bool = False
    # backout: the final norm reads x + backout * (the residual after backout_layer); HEAD starts
    # its post-loop MUDD coefficient of h_7 at -0.5 (learned per token there; a constant here)
    backout_layer: int | None = None
    backout: float = 0.0
    eval_chunk_tokens: int = 8192  # eval_ce materialises [chunk, V] float32 logits at a time
    ngram: NgramConfig = field(default_factory=lambda: NgramConfig(cache_rows=2 * 262_144))
    fp8: Fp8Config = field(default_factory=Fp8Config)
    mudd: MuddConfig = field(default_factory=MuddConfig)  # per-token gates and connections (off)

    def __post_init__(self):
        layers = range(self.num_layers)
        for name in ("long_window_layers", "paired_head_layers", "value_embed_layers"):
            bad = [i for i in getattr(self, name) if i not in layers or i == self.no_attention_layer]
            if bad:
                raise ValueError(f"GPTConfig.{name} has layers {bad} outside [0, {self.num_layers}) "
                                 f"or equal to no_attention_layer={self.no_attention_layer}")
        if set(self.long_window_layers) & set(self.paired_head_layers):
            raise ValueError("GPTConfig.paired_head_layers and long_window_layers must not overlap "
                             "(the partial key offset is defined for unpaired heads)")
        if self.num_heads % 2 or self.head_dim % 4:
            raise ValueError(f"GPTConfig.num_heads={self.num_heads} must be even and head_dim="
                             f"{self.head_dim} a multiple of 4")
        if self.num_heads * self.head_dim != self.model_dim:
            raise ValueError(f"GPTConfig.model_dim={self.model_dim} must equal num_heads*head_dim="
                             f"{self.num_heads * self.head_dim} (vo_bank entries are square)")
        if self.no_attention_layer is not None and not (
                0 <= self.skip_from_layer < self.no_attention_layer < self.num_layers):
            raise ValueError(f"GPTConfig.skip_from_layer={self.skip_from_layer} must precede "
                             f"no_attention_layer={self.no_attention_layer} < num_layers")
        if self.attention_backend not in BACKENDS:
            raise ValueError(f"GPTConfig.attention_backend={self.attention_backend!r}: one of {BACKENDS}")
        for name in ("attn_input_layer", "backout_layer"):
            layer = getattr(self, name)
            if layer is not None and layer not in layers:
                raise ValueError(f"GPTConfig.{name}={layer} outside [0, {self.num_layers}) (None: off)")
        if self.backout and self.backout_layer is None:
            raise ValueError(f"GPTConfig.backout={self.backout} needs a backout_layer (the layer "
                             f"whose residual the final norm subtracts)")
        if self.mudd.connections and self.backout:
            raise ValueError(f"GPTConfig.backout={self.backout} with mudd.connections: the connections "
                             f"learn the backout (MuddConfig.backout_init); set backout=0")
        self.mudd.check(self.num_layers, self.attention_layers, self.paired_head_layers,
                        self.value_embed_layers)
        if self.attn_out_init not in ATTN_OUT_INITS:
            raise ValueError(f"GPTConfig.attn_out_init={self.attn_out_init!r}: one of {ATTN_OUT_INITS}")
        if self.bank_pad_multiple < 1:
            raise ValueError(f"GPTConfig.bank_pad_multiple={self.bank_pad_multiple} must be >= 1")
        if (self.ngram.dim, self.ngram.vocab_size) != (self.model_dim, self.vocab_size):
            raise ValueError(f"GPTConfig.ngram.dim/vocab_size=({self.ngram.dim}, {self.ngram.vocab_size})"
                             f" must equal model_dim/vocab_size ({self.model_dim}, {self.vocab_size})")

    @classmethod
    def tiny(cls, **overrides) -> "GPTConfig":
        """CPU tests and the cpu-tiny preset: 6 layers, d=128, 2 heads x 64, real GPT-2 vocab; the
        layer roles of the 11-layer model scaled to 6 layers."""
        vocab = overrides.get("vocab_size", PADDED_VOCAB)
        fields = dict(
            num_layers=6, model_dim=128, num_heads=2, head_dim=64, mlp_hidden=512,
            long_window_layers=(2, 5), paired_head_layers=(0, 3), no_attention_layer=4,
            skip_from_layer=2, value_embed_layers=(1, 3, 5), max_position=4096,
            ngram=NgramConfig(vocab_size=vocab, dim=128, bigram_rows=4096, trigram_rows=4096,
                              cache_rows=2 * 4096),
            mudd=MuddConfig(split_layer=3, xsa_layers=(1, 2), attn_gate_layers=(2, 5), source_layer=3,
                            dc_layers=(5,), dc_window=16),
        )
        fields.update(overrides)
        return cls(**fields)

    @property
    def attention_layers(self) -> list[int]:
        return [i for i in range(self.num_layers) if i != self.no_attention_layer]
