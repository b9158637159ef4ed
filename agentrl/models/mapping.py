"""HF (transformers `glm_moe_dsa`) <-> Megatron-core 0.19.2 GPTModel weight names and layouts.

Megatron names below were read from the installed megatron-core 0.19.2 source:
- models/gpt/experimental_attention_variant_module_specs.py: the DSA layer is an
  AbsorbedMLASelfAttention with separate `input_layernorm` (fuse_input_layernorm=False), unfused
  `q_layernorm` / `kv_layernorm` (DSA needs the normalised q latent), and
  `core_attention.indexer.{linear_wq_b, linear_wk, k_norm, linear_weights_proj}`; MoE layers keep a
  separate `pre_mlp_layernorm`; dense layers fuse it into `mlp.linear_fc1.layer_norm_weight` only
  when the backend fuses norm+linear (TransformerEngine), else `pre_mlp_layernorm.weight`.
- transformer/experimental_attention_variant/absorbed_mla.py: `linear_kv_up_proj` keeps K and V
  fused, per head [nope | v] rows: the same layout as HF `kv_b_proj`, so it maps unchanged.
- transformer/experimental_attention_variant/dsa.py: `DSAttention` builds an indexer only where
  `is_dsa_skip_topk_layer` is false; the indexer `k_norm` is a LayerNorm (weight and bias), as in HF.
- transformer/moe/router.py: `router.weight` and the persistent buffer `router.expert_bias`.
- transformer/moe/experts.py: SequentialMLP (the non-TE backend) names experts
  `experts.local_experts.{e}.linear_fc{1,2}.weight`; TEGroupedMLP names them
  `experts.linear_fc{1,2}.weight{e}`. GLU fc1 rows are [gate; up] (mlp.py chunks gate first).
- transformer/multi_token_prediction.py: `mtp.layers.{k}.{enorm, hnorm, eh_proj, final_layernorm}`
  and the inner layer `mtp.layers.{k}.mtp_model_layer.*`; eh_proj input is cat(enorm(emb), hnorm(h)).
  The MTP inner layer is built from the last decoder layer's spec and numbered k+1, so it has an
  indexer iff Megatron's schedule computes at layer k+1 (always for k=0).
Not confirmed from source (no TransformerEngine installed here): the TE-backend names
`mlp.linear_fc1.layer_norm_weight` and `experts.linear_fc1.weight{e}` come from the TE spec
provider and TEGroupedMLP code paths read above, but were never instantiated.

HF side: transformers keeps routed experts fused in memory (`mlp.experts.gate_up_proj` [E, 2I, H],
`mlp.experts.down_proj` [E, H, I]); released checkpoints store them per expert
(`mlp.experts.{e}.{gate,up,down}_proj.weight`). Both are accepted. MTP layers are `model.layers.{N+k}`
in checkpoints (transformers does not build them); their `embed_tokens` / `shared_head.head` copy the
main embedding / lm_head, which Megatron shares, so they are checked equal and dropped on the way in
and re-emitted on the way out.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from agentrl.models.arch import ModelArch

HfExpertFormat = Literal["fused", "per_expert"]
RuleKind = Literal["copy", "glu", "stack", "stack_glu", "alias"]


@dataclass(frozen=True)
class MegatronNaming:
    """Which Megatron backend's module names to produce."""

    fused_dense_pre_mlp_norm: bool = False  # TE: dense pre-MLP norm lives in linear_fc1.layer_norm_weight
    grouped_experts: bool = False  # TEGroupedMLP names (weight{e}) instead of SequentialMLP's

    @classmethod
    def for_backend(cls, use_te: bool) -> MegatronNaming:
        return cls(fused_dense_pre_mlp_norm=use_te, grouped_experts=use_te)


@dataclass(frozen=True)
class Rule:
    """One group of HF tensors <-> one group of Megatron tensors.

    copy: 1 <-> 1.  glu: (gate, up) <-> fc1 = cat([gate, up]).  stack: hf [E, ...] <-> E tensors.
    stack_glu: hf gate_up [E, 2I, H] <-> E fc1 tensors.  alias: an HF duplicate of a Megatron tensor
    (MTP embed/head copies): checked equal on the way in, copied on the way out.
    """

    kind: RuleKind
    hf: tuple[str, ...]
    mg: tuple[str, ...]


def dsa_schedule(config: Any) -> tuple[int, int]:
    """(index_topk_freq, index_skip_topk_offset) of an HF config, checked against its indexer_types."""
    freq = int(getattr(config, "index_topk_freq", None) or 1)
    offset = getattr(config, "index_skip_topk_offset", None)
    offset = 2 if offset is None else int(offset)  # transformers' own default when the kwarg is absent
    if freq > 1 and offset < 1:
        raise ValueError(
            f"index_skip_topk_offset={offset} with index_topk_freq={freq} makes layer 1 reuse a top-k that "
            "does not exist; set index_skip_topk_offset >= 1 in the model config"
        )
    expected = ["full" if max(layer - offset, 0) % freq == 0 else "shared"
                for layer in range(1, config.num_hidden_layers + 1)]
    if list(config.indexer_types) != expected:
        raise ValueError(
            f"config.indexer_types {config.indexer_types} is not the freq/offset schedule "
            f"(index_topk_freq={freq}, index_skip_topk_offset={offset}) Megatron implements; "
            "fix index_topk_freq / index_skip_topk_offset in the model config"
        )
    return freq, offset


def megatron_computes_index(layer_number: int, freq: int, offset: int) -> bool:
    """Megatron's rule (dsa.is_dsa_skip_topk_layer), 1-indexed; equals HF's for offset >= 1."""
    if freq <= 1:
        return True
    return max(layer_number - max(offset, 1), 0) % freq == 0


def num_mtp_layers(config: Any) -> int:
    return int(getattr(config, "num_nextn_predict_layers", None) or 0)


def arch_from_hf(config: Any) -> ModelArch:
    """The planner's ModelArch view of an HF GlmMoeDsaConfig (for the DSA pipeline-split rule)."""
    freq, offset = dsa_schedule(config)
    return ModelArch(
        name=str(getattr(config, "_name_or_path", "") or "glm_moe_dsa"),
        family="glm_moe_dsa",
        num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        vocab_size=config.vocab_size,
        num_dense_layers=sum(t == "dense" for t in config.mlp_layer_types),
        n_routed_experts=config.n_routed_experts,
        experts_per_token=config.num_experts_per_tok,
        moe_intermediate_size=config.moe_intermediate_size,
        dense_intermediate_size=config.intermediate_size,
        num_attention_heads=config.num_attention_heads,
        index_topk_freq=freq,
        index_skip_topk_offset=offset,
        index_topk=config.index_topk,
        num_mtp_layers=num_mtp_layers(config),
    )


def _attention_rules(hf: str, mg: str, has_indexer: bool) -> list[Rule]:
    pairs = [
        ("input_layernorm.weight", "input_layernorm.weight"),
        ("self_attn.q_a_proj.weight", "self_attention.linear_q_down_proj.weight"),
        ("self_attn.q_a_layernorm.weight", "self_attention.q_layernorm.weight"),
        ("self_attn.q_b_proj.weight", "self_attention.linear_q_up_proj.weight"),
        ("self_attn.kv_a_proj_with_mqa.weight", "self_attention.linear_kv_down_proj.weight"),
        ("self_attn.kv_a_layernorm.weight", "self_attention.kv_layernorm.weight"),
        ("self_attn.kv_b_proj.weight", "self_attention.linear_kv_up_proj.weight"),
        ("self_attn.o_proj.weight", "self_attention.linear_proj.weight"),
    ]
    if has_indexer:
        idx = "self_attention.core_attention.indexer."
        pairs += [
            ("self_attn.indexer.wq_b.weight", idx + "linear_wq_b.weight"),
            ("self_attn.indexer.wk.weight", idx + "linear_wk.weight"),
            ("self_attn.indexer.k_norm.weight", idx + "k_norm.weight"),
            ("self_attn.indexer.k_norm.bias", idx + "k_norm.bias"),
            ("self_attn.indexer.weights_proj.weight", idx + "linear_weights_proj.weight"),
        ]
    return [Rule("copy", (hf + h,), (mg + m,)) for h, m in pairs]


def _mlp_rules(hf: str, mg: str, is_moe: bool, n_experts: int, naming: MegatronNaming,
               hf_experts: HfExpertFormat) -> list[Rule]:
    norm = "pre_mlp_layernorm.weight"
    if not is_moe and naming.fused_dense_pre_mlp_norm:
        norm = "mlp.linear_fc1.layer_norm_weight"
    rules = [Rule("copy", (hf + "post_attention_layernorm.weight",), (mg + norm,))]
    if not is_moe:
        return rules + [
            Rule("glu", (hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"), (mg + "mlp.linear_fc1.weight",)),
            Rule("copy", (hf + "mlp.down_proj.weight",), (mg + "mlp.linear_fc2.weight",)),
        ]
    rules += [
        Rule("copy", (hf + "mlp.gate.weight",), (mg + "mlp.router.weight",)),
        Rule("copy", (hf + "mlp.gate.e_score_correction_bias",), (mg + "mlp.router.expert_bias",)),
        Rule("glu", (hf + "mlp.shared_experts.gate_proj.weight", hf + "mlp.shared_experts.up_proj.weight"),
             (mg + "mlp.shared_experts.linear_fc1.weight",)),
        Rule("copy", (hf + "mlp.shared_experts.down_proj.weight",), (mg + "mlp.shared_experts.linear_fc2.weight",)),
    ]
    fc1 = tuple(mg + expert_param_name(e, "linear_fc1", naming) for e in range(n_experts))
    fc2 = tuple(mg + expert_param_name(e, "linear_fc2", naming) for e in range(n_experts))
    if hf_experts == "fused":
        rules += [Rule("stack_glu", (hf + "mlp.experts.gate_up_proj",), fc1),
                  Rule("stack", (hf + "mlp.experts.down_proj",), fc2)]
    else:
        for e in range(n_experts):
            ex = f"{hf}mlp.experts.{e}."
            rules += [Rule("glu", (ex + "gate_proj.weight", ex + "up_proj.weight"), (fc1[e],)),
                      Rule("copy", (ex + "down_proj.weight",), (fc2[e],))]
    return rules


def expert_param_name(expert: int, linear: str, naming: MegatronNaming) -> str:
    """Name of one expert's weight below a MoE layer's prefix (`...mlp.`)."""
    if naming.grouped_experts:
        return f"mlp.experts.{linear}.weight{expert}"
    return f"mlp.experts.local_experts.{expert}.{linear}.weight"


def mapping_rules(config: Any, naming: MegatronNaming = MegatronNaming(),
                  hf_experts: HfExpertFormat = "fused") -> list[Rule]:
    """Every tensor of the model (decoder, embedding, head, MTP), as rules in a fixed order."""
    freq, offset = dsa_schedule(config)
    n_layers, n_exp = config.num_hidden_layers, config.n_routed_experts
    rules = [Rule("copy", ("model.embed_tokens.weight",), ("embedding.word_embeddings.weight",))]
    for i in range(n_layers):
        hf, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
        rules += _attention_rules(hf, mg, config.indexer_types[i] == "full")
        rules += _mlp_rules(hf, mg, config.mlp_layer_types[i] == "sparse", n_exp, naming, hf_experts)
    rules += [Rule("copy", ("model.norm.weight",), ("decoder.final_layernorm.weight",))]
    if not config.tie_word_embeddings:
        rules += [Rule("copy", ("lm_head.weight",), ("output_layer.weight",))]
    mtp_is_moe = config.mlp_layer_types[-1] == "sparse"  # Megatron reuses the last layer's spec
    for k in range(num_mtp_layers(config)):
        hf, mg = f"model.layers.{n_layers + k}.", f"mtp.layers.{k}."
        inner = mg + "mtp_model_layer."
        rules += [Rule("copy", (hf + h,), (mg + m,)) for h, m in (
            ("enorm.weight", "enorm.weight"), ("hnorm.weight", "hnorm.weight"),
            ("eh_proj.weight", "eh_proj.weight"), ("shared_head.norm.weight", "final_layernorm.weight"))]
        rules += _attention_rules(hf, inner, megatron_computes_index(k + 1, freq, offset))
        rules += _mlp_rules(hf, inner, mtp_is_moe, n_exp, naming, hf_experts)
        head = "embedding.word_embeddings.weight" if config.tie_word_embeddings else "output_layer.weight"
        rules += [Rule("alias", (hf + "embed_tokens.weight",), ("embedding.word_embeddings.weight",)),
                  Rule("alias", (hf + "shared_head.head.weight",), (head,))]
    return rules


def detect_hf_expert_format(state_dict: Iterable[str]) -> HfExpertFormat:
    keys = list(state_dict)
    if any(k.endswith("mlp.experts.gate_up_proj") for k in keys):
        return "fused"
    if any(".mlp.experts." in k and k.endswith(".gate_proj.weight") for k in keys):
        return "per_expert"
    return "fused"  # no routed experts at all: either format yields the same rules


def rule_to_megatron(rule: Rule, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """HF tensors of `rule` (in rule.hf order) -> Megatron tensors (in rule.mg order)."""
    if rule.kind == "copy":
        return [tensors[0]]
    if rule.kind == "glu":
        return [torch.cat(tensors, dim=0)]
    if rule.kind in ("stack", "stack_glu"):
        stacked = tensors[0]
        if stacked.shape[0] != len(rule.mg):
            raise ValueError(f"{rule.hf[0]} holds {stacked.shape[0]} experts, the config {len(rule.mg)}")
        return [t.clone() for t in stacked.unbind(0)]
    raise ValueError(f"rule kind {rule.kind!r} has no per-rule HF->Megatron conversion")


def rule_to_hf(rule: Rule, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Megatron tensors of `rule` (in rule.mg order) -> HF tensors (in rule.hf order)."""
    if rule.kind == "copy":
        return [tensors[0]]
    if rule.kind == "alias":
        return [tensors[0].clone()]
    if rule.kind == "glu":
        gate, up = tensors[0].chunk(2, dim=0)
        return [gate.clone(), up.clone()]
    if rule.kind in ("stack", "stack_glu"):
        return [torch.stack(tensors, dim=0)]
    raise ValueError(f"unknown rule kind {rule.kind!r}")


def _check_keys(have: set[str], want: set[str], side: str, fix: str) -> None:
    missing, extra = sorted(want - have), sorted(have - want)
    if missing or extra:
        raise ValueError(
            f"{side} state dict does not match the model config: missing {len(missing)} {missing[:8]}, "
            f"unexpected {len(extra)} {extra[:8]}; {fix}"
        )


def hf_to_megatron(state_dict: dict[str, torch.Tensor], config: Any,
                   naming: MegatronNaming = MegatronNaming()) -> dict[str, torch.Tensor]:
    """Full (unsharded) HF state dict -> full Megatron GPTModel state dict. Strict on names.

    Expert format (fused or per expert) is detected. MTP layers are mapped when the config has
    `num_nextn_predict_layers`; their embed/head copies are optional but must equal the main ones."""
    rules = mapping_rules(config, naming, detect_hf_expert_format(state_dict))
    required = {k for r in rules if r.kind != "alias" for k in r.hf}
    optional = {k for r in rules if r.kind == "alias" for k in r.hf}
    have = set(state_dict)
    _check_keys(have, required | (optional & have),
                "HF", "is the checkpoint the model named in the config (layers, experts, MTP, tie)?")
    out: dict[str, torch.Tensor] = {}
    for rule in rules:
        if rule.kind == "alias":
            continue
        for name, t in zip(rule.mg, rule_to_megatron(rule, [state_dict[k] for k in rule.hf]), strict=True):
            out[name] = t
    for rule in rules:
        copy = state_dict.get(rule.hf[0]) if rule.kind == "alias" else None
        if copy is not None and not torch.equal(copy, out[rule.mg[0]]):
            raise ValueError(
                f"{rule.hf[0]} differs from the tensor Megatron shares it with ({rule.mg[0]}); "
                "Megatron cannot hold a separate copy, so the conversion would lose it"
            )
    return out


def megatron_to_hf(state_dict: dict[str, torch.Tensor], config: Any,
                   naming: MegatronNaming = MegatronNaming(), hf_experts: HfExpertFormat = "fused",
                   mtp_aliases: bool = True) -> dict[str, torch.Tensor]:
    """Full Megatron state dict -> HF state dict (fused experts for transformers, per_expert for
    checkpoints and inference engines). Megatron-only extras (`_extra_state`) are ignored."""
    rules = [r for r in mapping_rules(config, naming, hf_experts) if mtp_aliases or r.kind != "alias"]
    weights = {k: v for k, v in state_dict.items() if not k.endswith("_extra_state")}
    _check_keys(set(weights), {k for r in rules if r.kind != "alias" for k in r.mg}, "Megatron",
                "was the model built from this config (same layers, experts, MTP, backend naming)?")
    out: dict[str, torch.Tensor] = {}
    for rule in rules:
        for name, t in zip(rule.hf, rule_to_hf(rule, [weights[k] for k in rule.mg]), strict=True):
            out[name] = t
    return out
