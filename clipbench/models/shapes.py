"""The shape of a decoder model (dense or mixture-of-experts): what the memory plan needs from a config.

    shape = model_shape("Qwen/Qwen3-1.7B-Base")      # shipped table: no network
    shape = model_shape("/models/my-qwen3")           # a local directory: transformers AutoConfig
    shape.n_params(), shape.kv_bytes_per_token(2)

Design choices:
* The Qwen3 family's shapes ship with clipbench (`QWEN3` below), and Qwen2.5-7B's (`QWEN2_5`, the
  dense arm of the NSR-scale recipes), so `clipbench plan` works offline for the models the recipes use. Any other model is read with `transformers.AutoConfig` from a
  local path or the hub (cached by transformers after the first read).
* Only decoders with the Llama layout are described (RMSNorm, GQA attention, SwiGLU MLP):
  Qwen3 (adds q/k RMSNorm), Qwen2 (q/k/v bias), Llama and Mistral; and the mixture-of-experts
  decoders whose every layer's MLP is `num_experts` routed SwiGLU experts and a bias-free linear
  router, no shared expert: Qwen3-MoE (q/k RMSNorm) and Mixtral. Any other layout (Qwen2-MoE's
  shared expert, a dense layer among sparse ones, ...) is refused with a clear error rather than
  estimated wrongly.
* A MoE shape counts all parameters (`n_params`: what memory holds) and those one token uses
  (`n_active_params`: attention, router, the `experts_per_tok` experts it is routed to).
* The parameter count is computed from the config (never read from a model card), so it is exact
  for these layouts; tests check it against transformers' own modules on the meta device.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from clipbench.errors import UserError

SUPPORTED_TYPES = ("qwen3", "qwen2", "llama", "mistral")
MOE_TYPES = ("qwen3_moe", "mixtral")  # every layer sparse, no shared expert


@dataclass(frozen=True)
class ModelShape:
    name: str
    model_type: str
    vocab_size: int  # V
    hidden_size: int  # h
    intermediate_size: int  # I (SwiGLU: gate, up (h -> I) and down (I -> h))
    num_layers: int  # L
    num_heads: int  # a (query heads)
    num_kv_heads: int  # k (GQA key/value heads)
    head_dim: int  # d
    tie_word_embeddings: bool  # the output head is the input embedding (one V x h matrix)
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k (d weights each)
    qkv_bias: bool = False  # Qwen2: bias on q, k, v
    o_bias: bool = False  # Llama/Qwen3 attention_bias=true: bias on q, k, v and o
    mlp_bias: bool = False  # Llama mlp_bias=true
    max_position_embeddings: int | None = None
    source: str = ""  # where the numbers come from
    num_experts: int = 0  # E: routed experts per layer (0: a dense model)
    experts_per_tok: int = 0  # k: experts each token is routed to
    # intermediate_size is each expert's width I for a MoE shape (Qwen3-MoE's moe_intermediate_size)

    # -- parameters ------------------------------------------------------------------------------
    def layer_params(self) -> int:
        """Parameters of one decoder layer."""
        h, ad, kd = self.hidden_size, self.q_dim, self.kv_dim
        attn = h * ad + 2 * h * kd + ad * h  # q, k, v, o projections
        if self.qkv_bias or self.o_bias:
            attn += ad + 2 * kd  # q, k, v biases
        if self.o_bias:
            attn += h  # o bias
        if self.qk_norm:
            attn += 2 * self.head_dim  # q_norm, k_norm weights
        norms = 2 * h  # input and post-attention RMSNorm
        return attn + self.mlp_params(self.num_experts) + norms

    def active_layer_params(self) -> int:
        """Parameters of one decoder layer that one token uses (a dense layer: all of them)."""
        if not self.is_moe:
            return self.layer_params()
        return self.layer_params() - self.mlp_params(self.num_experts) + self.mlp_params(self.experts_per_tok)

    def mlp_params(self, experts: int) -> int:
        """The MLP of one layer: one SwiGLU (dense), or the router (E x h) and `experts` of the E experts."""
        h, i = self.hidden_size, self.intermediate_size
        swiglu = 3 * h * i + ((2 * i + h) if self.mlp_bias else 0)
        return swiglu if not self.is_moe else self.num_experts * h + experts * swiglu

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def embedding_params(self) -> int:
        """Input embedding, plus the output head when it is not tied."""
        return self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)

    def n_params(self) -> int:
        """All parameters: embeddings (+ untied head) + L layers + the final RMSNorm."""
        return self.embedding_params() + self.num_layers * self.layer_params() + self.hidden_size

    def n_active_params(self) -> int:
        """The parameters one token's forward uses: all of a dense model; a MoE model's attention,
        routers, its `experts_per_tok` experts per layer, embeddings and the final norm."""
        return self.embedding_params() + self.num_layers * self.active_layer_params() + self.hidden_size

    # -- derived sizes ---------------------------------------------------------------------------
    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, itemsize: int) -> int:
        return kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, itemsize)


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, itemsize: int) -> int:
    """K and V of every layer for one token: 2 * L * kv_heads * head_dim * itemsize."""
    return 2 * num_layers * num_kv_heads * head_dim * itemsize


def attention_dims(cfg) -> tuple[int, int, int]:
    """(query heads, key/value heads, head dim) of a transformers config (defaults as transformers:
    no num_key_value_heads = multi-head attention, no head_dim = hidden_size // heads)."""
    heads = cfg.num_attention_heads
    return (
        heads,
        getattr(cfg, "num_key_value_heads", None) or heads,
        getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
    )


def _q3(size: str, h: int, i: int, layers: int, heads: int, tied: bool) -> ModelShape:
    return ModelShape(
        name=f"Qwen/Qwen3-{size}-Base",
        model_type="qwen3",
        vocab_size=151936,
        hidden_size=h,
        intermediate_size=i,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=8,
        head_dim=128,
        tie_word_embeddings=tied,
        qk_norm=True,
        max_position_embeddings=32768,
        source=f"config.json of Qwen/Qwen3-{size}-Base on the Hugging Face hub (shipped with clipbench)",
    )


# The Qwen3 dense family (Qwen3 Technical Report, arXiv 2505.09388, Table 1: layers, heads, tying;
# hidden/intermediate/vocab sizes from each model's config.json). The post-trained models
# (Qwen/Qwen3-<size>) have the same shapes (only max_position_embeddings differs, 40960), so both
# names resolve here.
QWEN3: dict[str, ModelShape] = {
    s.name: s
    for s in (
        _q3("0.6B", 1024, 3072, 28, 16, True),
        _q3("1.7B", 2048, 6144, 28, 16, True),
        _q3("4B", 2560, 9728, 36, 32, True),
        _q3("8B", 4096, 12288, 36, 32, False),
        _q3("14B", 5120, 17408, 40, 40, False),
        _q3("32B", 5120, 25600, 64, 64, False),
    )
}


def _q3_moe(size: str, h: int, i: int, layers: int, heads: int) -> ModelShape:
    return ModelShape(
        name=f"Qwen/Qwen3-{size}-Base",
        model_type="qwen3_moe",
        vocab_size=151936,
        hidden_size=h,
        intermediate_size=i,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=4,
        head_dim=128,
        tie_word_embeddings=False,
        qk_norm=True,
        max_position_embeddings=32768,
        num_experts=128,
        experts_per_tok=8,
        source=f"config.json of Qwen/Qwen3-{size}-Base on the Hugging Face hub (shipped with clipbench)",
    )


# The Qwen3 MoE models (same report, Table 2: 128 experts, 8 routed, no shared expert; hidden size and
# expert width from each config.json): 30.5B total / 3.3B active, and 235B / 22B.
QWEN3.update(
    {
        s.name: s
        for s in (
            _q3_moe("30B-A3B", 2048, 768, 48, 32),
            _q3_moe("235B-A22B", 4096, 1536, 94, 64),
        )
    }
)
for _s in list(QWEN3.values()):
    _post = _s.name.removesuffix("-Base")
    QWEN3[_post] = replace(_s, name=_post, max_position_embeddings=40960, source=_s.source.replace(_s.name, _post))


# Qwen2.5-7B (base and instruct share the shape): config.json of Qwen/Qwen2.5-7B on the Hugging Face
# hub. 7,615,616,512 parameters, the card's "7.61B" (6.53B non-embedding); q/k/v carry a bias.
QWEN2_5: dict[str, ModelShape] = {
    name: ModelShape(
        name=name,
        model_type="qwen2",
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_layers=28,
        num_heads=28,
        num_kv_heads=4,
        head_dim=128,
        tie_word_embeddings=False,
        qkv_bias=True,
        max_position_embeddings=131072 if name.endswith("7B") else 32768,
        source=f"config.json of {name} on the Hugging Face hub (shipped with clipbench)",
    )
    for name in ("Qwen/Qwen2.5-7B", "Qwen/Qwen2.5-7B-Instruct")
}


def from_hf_config(cfg, name: str = "", source: str = "") -> ModelShape:
    """A ModelShape from a transformers config object (AutoConfig) of a supported decoder."""
    model_type = getattr(cfg, "model_type", None)
    num_experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None) or 0
    if num_experts and model_type not in MOE_TYPES:
        raise UserError(
            f"model.name: '{name}' is a mixture-of-experts model ({model_type}) of a layout the "
            f"memory plan does not know; it knows the mixture-of-experts decoders {', '.join(MOE_TYPES)}"
        )
    if not num_experts and model_type not in SUPPORTED_TYPES:
        raise UserError(
            f"model.name: '{name}' has model_type '{model_type}'; the memory plan knows "
            f"the dense decoders {', '.join(SUPPORTED_TYPES)} and the mixture-of-experts "
            f"decoders {', '.join(MOE_TYPES)}"
        )
    if model_type == "qwen3_moe" and (
        list(getattr(cfg, "mlp_only_layers", None) or []) or getattr(cfg, "decoder_sparse_step", 1) != 1
    ):
        raise UserError(
            f"model.name: '{name}' mixes dense and sparse layers (mlp_only_layers, decoder_sparse_step); "
            f"the memory plan knows mixture-of-experts models whose every layer is sparse"
        )
    heads, kv_heads, head_dim = attention_dims(cfg)
    attention_bias = bool(getattr(cfg, "attention_bias", False))
    width = cfg.moe_intermediate_size if model_type == "qwen3_moe" else cfg.intermediate_size
    return ModelShape(
        name=name,
        model_type=model_type,
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=width,
        num_layers=cfg.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        qkv_bias=model_type == "qwen2",
        o_bias=attention_bias and model_type != "qwen2",
        mlp_bias=bool(getattr(cfg, "mlp_bias", False)),
        max_position_embeddings=getattr(cfg, "max_position_embeddings", None),
        source=source or name,
        num_experts=num_experts,
        experts_per_tok=getattr(cfg, "num_experts_per_tok", 0) if num_experts else 0,
    )


def hf_config(shape: ModelShape, **override):
    """A transformers config of `shape`, its model_type's own config class (e.g. to build a model of
    the shape's family, or write its config.json offline); `override`: config fields to replace."""
    from transformers import AutoConfig  # noqa: PLC0415 - transformers is heavy

    kw = dict(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        tie_word_embeddings=shape.tie_word_embeddings,
        max_position_embeddings=shape.max_position_embeddings,
        attention_bias=shape.o_bias,
        mlp_bias=shape.mlp_bias,
    )
    if shape.model_type in ("qwen2", "qwen3", *MOE_TYPES):
        kw.pop("mlp_bias")  # no such field; qwen2's q/k/v bias and qwen3's q/k norms come with the type
    if shape.model_type == "qwen3_moe":
        kw.update(
            moe_intermediate_size=kw.pop("intermediate_size"),
            num_experts=shape.num_experts,
            num_experts_per_tok=shape.experts_per_tok,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    elif shape.model_type == "mixtral":
        kw.update(num_local_experts=shape.num_experts, num_experts_per_tok=shape.experts_per_tok)
    if "intermediate_size" in override and shape.model_type == "qwen3_moe":
        override = {**override, "moe_intermediate_size": override["intermediate_size"]}
    kw = {k: v for k, v in kw.items() if v is not None}  # unknown: the config class's default
    return AutoConfig.for_model(shape.model_type, **{**kw, **override})


def model_shape(name: str) -> ModelShape:
    """The shape of `name`: a local directory (AutoConfig), a shipped Qwen3 / Qwen2.5 shape, else the hub.

    `name` is already resolved (no `builtin:` prefix). Raises UserError when it cannot be read."""
    if os.path.exists(os.path.expanduser(name)):
        return _auto_config(os.path.expanduser(name), f"{name}/config.json")
    if name in QWEN3:
        return QWEN3[name]
    if name in QWEN2_5:
        return QWEN2_5[name]
    return _auto_config(name, f"config.json of {name} (Hugging Face hub)")


def _auto_config(name: str, source: str) -> ModelShape:
    from transformers import AutoConfig  # noqa: PLC0415 - transformers is heavy

    try:
        cfg = AutoConfig.from_pretrained(name)
    except (OSError, ValueError, KeyError) as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UserError(f"model.name: cannot read the config of '{name}': {reason}") from None
    return from_hf_config(cfg, name, source)
