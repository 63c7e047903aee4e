"""What the tests prove for each model type, one row per README line: the only place these claims are typed.

scripts/families_table.py renders these rows, and the model types refused with a reason (`Family.refused_types`
in families/table.py), as README's Families tables; tests/test_families_table.py fails when the README says
anything else, when a model_type ckpttool reads has no row, and when a row names a test that does not exist.
Adding a model type: add its row here (naming the tests that prove it), then
`python scripts/families_table.py --write`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Proven:
    label: str
    """the README's first column"""
    model_types: tuple[str, ...]
    """the config.json model_types the row covers (every one ckpttool reads is covered by some row)"""
    convert: str
    shard: str
    merge: str
    verify: str
    notes: str
    tests: tuple[str, ...]
    """`file::test function` of the tests that prove the row"""


PROVEN: tuple[Proven, ...] = (
    Proven("DeepSeek-V3 / R1 (`deepseek_v3`), FP8", ("deepseek_v3",),
           "bit-exact vs DeepSeek's reference scripts", "1, 2, 4 (FP8 kept or BF16)",
           "tensor for tensor, scales included", "mp 1, 2, 4",
           "MTP dropped by default; `--keep-mtp` output verifies (MTP skipped, said so); V3.1 `scale_fmt: ue8m0` "
           "dequantizes to the block formula",
           ("test_convert.py::test_fused_convert_equals_reference_two_pass",
            "test_merge.py::test_deepseek_shard_then_merge_gives_the_same_tensors",
            "test_verify.py::test_mp_shards_match_reference_and_transformers",
            "test_deepseek_variants.py::test_keep_mtp_output_passes_verify_and_says_the_mtp_layer_is_skipped",
            "test_deepseek_variants.py::test_v31_ue8m0_scale_format_dequantizes_to_the_block_formula")),
    Proven("DeepSeek-V3 saved by transformers 5 (BF16/F32)", ("deepseek_v3",), "yes", "1, 2", "", "mp 1, 2",
           "`rope_theta` only in `rope_parameters`, non-zero router bias",
           ("test_config_reading.py::test_transformers_saved_v3_verifies_against_transformers",)),
    Proven("DeepSeek-V3.2 (`deepseek_v32`)", ("deepseek_v32",), "yes", "1, 2", "byte for byte",
           "mp 1, 2 (as transformers' DeepseekV32)",
           "the indexer (`self_attn.indexer.*`) is replicated on every rank while MLA's `wq_b` is cut; verify loads "
           "and checks every indexer tensor but runs dense attention, which equals the sparse one while prompt + "
           "generation fit in `index_topk` (longer is refused); `mlp_layer_types` read when given",
           ("test_deepseek_variants.py::test_v32_indexer_is_replicated_and_verifies_against_transformers",
            "test_deepseek_variants.py::test_v32_sequences_longer_than_index_topk_are_refused_by_verify")),
    Proven("GLM-5 (`glm_moe_dsa`)", ("glm_moe_dsa",), "yes", "1, 2, 4", "byte for byte",
           "mp 1, 2 (as transformers' GlmMoeDsa)",
           "V3.2's rules (indexer replicated, dense attention within `index_topk`); layers whose `indexer_types` "
           "entry is `shared` (or that `index_topk_freq` / `index_topk_pattern` make so) hold no indexer; "
           "`attention_bias`, sigmoid routing with correction bias over expert groups",
           ("test_mla_types.py::test_shard_then_verify_gives_transformers_greedy_tokens",
            "test_mla_types.py::test_shard_mp4_then_merge_is_byte_identical_per_tensor",
            "test_mla_types.py::test_glm5_shared_layers_hold_no_indexer_and_the_others_a_replicated_one",
            "test_mla_types.py::test_rows_read_what_their_classes_read")),
    Proven("Mistral 4 (`mistral4`)", ("mistral4",), "yes", "1, 2, 4", "tensor for tensor (experts one by one)",
           "mp 1, 2 (as transformers' Mistral4ForCausalLM)",
           "MLA with interleaved rope, softmax routing over expert groups without a bias, Llama-4's query scaling "
           "(`llama_4_scaling_beta`), YaRN by default, `attention_bias`; experts saved stacked",
           ("test_mla_types.py::test_shard_then_verify_gives_transformers_greedy_tokens",
            "test_mla_types.py::test_shard_mp4_then_merge_is_byte_identical_per_tensor",
            "test_mla_types.py::test_mistral4_query_scaling_is_what_verify_checks")),
    Proven("Kimi-K2 (`kimi_k2`)", ("kimi_k2",), "yes", "2", "", "mp 2 (as transformers' DeepseekV3)",
           "V3 routing without `topk_method` in config.json",
           ("test_config_reading.py::test_kimi_k2_is_the_v3_architecture_verified",)),
    Proven("Kimi-K2.5 / K2.6 (`kimi_k25`): DeepSeek-V3 text tower, vision tower and projector passed through; "
           "BF16, and as published: routed experts INT4 compressed-tensors (groups of 32)",
           ("kimi_k25",), "yes; vision tower and projector unchanged; INT4 equal to compressed-tensors' own "
           "decompression", "1, 2, 4 (vision tower and projector whole "
           "on rank 0)", "byte for byte (the hub's and save_pretrained's names; transformers' own: experts one by "
           "one)", "mp 1, 2 (as transformers' Kimi_K25ForConditionalGeneration); INT4 at mp 2 against the decompressed form",
           "text tower as `language_model.model.*` (the hub's), `model.language_model.*` (transformers') or "
           "`language_model.model.blocks.*` (transformers 5.24's save_pretrained): all shard alike; verify skips "
           "rank 0's vision tower (said so) and checks its bytes against the reference",
           ("test_multimodal.py::test_text_tower_verifies_against_transformers_kimi_k25",
            "test_multimodal.py::test_every_spelling_shards_to_the_same_text_tower_and_rank0_carries_the_rest",
            "test_multimodal.py::test_merge_gives_each_spelling_back",
            "test_multimodal.py::test_verify_compares_rank0s_vision_tower_with_the_reference",
            "test_multimodal.py::test_published_int4_form_converts_to_what_the_librarys_decompression_gives_and_verifies")),
    Proven("MiniMax-M3 (`minimax_m3_vl`): its text model (`minimax_m3_vl_text`), vision tower and projector passed "
           "through", ("minimax_m3_vl",), "yes; vision tower and projector unchanged",
           "1, 2, 4 (MoE mp layout; vision tower and projector whole on rank 0)", "byte for byte (the whole file)",
           "mp 1, 2 (as transformers' MiniMaxM3SparseForConditionalGeneration)",
           "Gemma norms, per-head q/k norm, clamped SwiGLU (`swiglu_alpha`, `swiglu_limit`) in dense, shared and routed "
           "experts, sigmoid routing with correction bias scaled by `routed_scaling_factor`, the lightning indexer "
           "replicated (verify runs dense attention, equal to the block-sparse one up to index_topk_blocks x "
           "index_block_size positions; longer is refused); partial rotary from the rope parameters (transformers "
           "5.24 ignores `rotary_dim`). Refused: transformers' own names (fused `gate_up_proj`) and the text model "
           "alone",
           ("test_minimax_m3.py::test_shard_then_verify_gives_transformers_greedy_tokens_minimax_m3",
            "test_minimax_m3.py::test_shard_mp4_then_merge_is_byte_identical",
            "test_minimax_m3.py::test_verify_refuses_what_the_indexer_would_not_keep_whole",
            "test_minimax_m3.py::test_plan_inspect_and_refusals_say_why",
            "test_minimax_m3.py::test_config_is_read_as_minimaxm3vltextconfig_reads_it")),
    Proven("Mistral Large 4 (`mistral_large4`): its text model (`mistral_large4_text`), vision tower and projector "
           "passed through", ("mistral_large4",), "yes; vision tower and projector unchanged",
           "1, 2, 4 (vision tower and projector whole on rank 0)",
           "byte for byte (Mistral's names, the whole file; transformers' own: experts one by one, named as "
           "transformers stacks them on load)",
           "mp 1, 2 (as transformers' MistralLarge4ForConditionalGeneration), both spellings",
           "GLM-5's DSA without a query LoRA: NoPE layers (`no_rope_layers`), latent KV shared across layers "
           "(`kv_source_layers`: reusing layers hold no `kv_a_proj_with_mqa` and read their source's cache), "
           "shared-indexer layers, per-head softmax scaling cut with the heads, LeRoPE's `rotary_emb.alpha` (float32) "
           "and the indexers replicated, `final_logit_softcapping`, the router kept in float32; dense attention within "
           "`index_topk` (longer is refused), `--attn naive` refused; read in Mistral's own names (the hub's and "
           "save_pretrained's) and transformers' own. Refused: the text model alone, a `kv_source_layers` transformers "
           "would read otherwise",
           ("test_mistral_large4.py::test_shard_then_verify_gives_transformers_greedy_tokens",
            "test_mistral_large4.py::test_what_large4_adds_moves_the_logits_the_comparison_checks",
            "test_mistral_large4.py::test_both_spellings_shard_to_the_same_text_tower_and_rank0_carries_the_rest",
            "test_mistral_large4.py::test_merge_gives_each_spelling_back",
            "test_mistral_large4.py::test_hf_outputs_load_in_transformers_as_the_model_they_came_from",
            "test_mistral_large4.py::test_expected_shapes_are_what_transformers_saved",
            "test_mistral_large4.py::test_layers_read_as_the_class_derives_them",
            "test_mistral_large4.py::test_configs_transformers_would_read_otherwise_are_refused")),
    Proven("DeepSeek-V2 / V2-Lite (`deepseek_v2`)", ("deepseek_v2",), "yes", "1, 2, 4", "tensor for tensor",
           "mp 1, 2, 4", "",
           ("test_convert.py::test_shard_bf16_v2_lite_equals_reference",
            "test_merge.py::test_deepseek_shard_then_merge_gives_the_same_tensors",
            "test_verify.py::test_mp_shards_match_reference_and_transformers")),
    Proven("Llama, Mistral, Qwen2, Qwen3", ("llama", "mistral", "qwen2", "qwen3"), "quantize fp8/int8/int4",
           "1, 2, 4", "byte for byte", "mp 2, 4",
           "GQA heads replicated when fewer than ranks; llama3 RoPE; Mistral sliding window",
           ("test_dense.py::test_shard_then_verify_gives_transformers_greedy_tokens",
            "test_merge.py::test_dense_shard_then_merge_is_byte_identical")),
    Proven("gpt-oss (`gpt_oss`), MXFP4", ("gpt_oss",), "bit-equal to transformers' MXFP4 dequant",
           "2 (MXFP4 kept or BF16)", "tensor for tensor", "mp 2", "",
           ("test_gpt_oss_pipeline.py::test_dequant_equals_transformers_mxfp4_dequantization_bit_for_bit",
            "test_gpt_oss_pipeline.py::test_convert_mp2_verifies_against_mxfp4_reference",
            "test_gpt_oss_pipeline.py::test_mxfp4_shards_verify_against_bf16_export",
            "test_merge.py::test_gpt_oss_shard_then_merge_gives_the_same_tensors")),
    Proven("Qwen3-MoE (`qwen3_moe`), BF16", ("qwen3_moe",), "yes", "1, 2", "byte for byte", "mp 1, 2",
           "q/k norm per head, dense `mlp_only_layers`, non-default `rope_theta`",
           ("test_moe.py::test_shard_then_verify_gives_transformers_greedy_tokens",
            "test_moe.py::test_shard_mp4_then_merge_is_byte_identical_per_tensor")),
    Proven("Qwen3-MoE, block FP8 (128x128 `weight_scale_inv` per expert)", ("qwen3_moe",),
           "bit-equal to the block formula",
           "2 (FP8 kept), 4 (`--dtype bf16`; FP8 kept is refused: the cut is off the 128-blocks)", "",
           "mp 2 (FP8), 4 (BF16)", "",
           ("test_moe_fp8.py::test_dequant_is_the_block_formula_bit_for_bit_and_drops_the_quantization_config",
            "test_moe_fp8.py::test_fp8_kept_shards_verify_against_transformers",
            "test_moe_fp8.py::test_fp8_cut_off_block_boundaries_is_refused_and_bf16_output_works")),
    Proven("Qwen2-MoE (`qwen2_moe`)", ("qwen2_moe",), "yes", "1, 2", "byte for byte", "mp 1, 2",
           "shared expert with its sigmoid gate, qkv biases",
           ("test_moe.py::test_shard_then_verify_gives_transformers_greedy_tokens",
            "test_moe.py::test_shard_mp4_then_merge_is_byte_identical_per_tensor")),
    Proven("Mixtral (`mixtral`)", ("mixtral",), "yes", "1, 2", "byte for byte", "mp 1, 2",
           "`block_sparse_moe.experts.E.w1/w2/w3`",
           ("test_moe.py::test_shard_then_verify_gives_transformers_greedy_tokens",
            "test_moe.py::test_mixtral_names_map_to_the_common_layout")),
    Proven("OLMoE (`olmoe`)", ("olmoe",), "yes", "1, 2, 4", "byte for byte", "mp 1, 2",
           "q/k norm over all heads (reduced across ranks), `clip_qkv`",
           ("test_moe.py::test_shard_then_verify_gives_transformers_greedy_tokens",
            "test_moe.py::test_routed_experts_go_whole_to_their_rank_and_full_qk_norm_is_cut_on_heads")),
    Proven("GLM-4.5/4.6 (`glm4_moe`)", ("glm4_moe",), "yes", "1, 2", "byte for byte (MTP layer too)", "mp 1, 2",
           "shared experts, sigmoid routing with `e_score_correction_bias` and expert groups, "
           "`routed_scaling_factor`, partial rotary, qkv biases; MTP dropped by default, `--keep-mtp` output "
           "verifies (MTP skipped, said so)",
           ("test_moe.py::test_shard_then_verify_gives_transformers_greedy_tokens",
            "test_moe.py::test_mtp_layer_is_dropped_by_default_and_kept_shards_verify")),
    Proven("DeepSeek-V4 (`deepseek_v4`), BF16, in DeepSeek's names or transformers 5.24's save_pretrained's; and "
           "as published: FP8 with E8M0 `.scale` per 128x128 block (V4.1: 32x32) beside MXFP4 routed experts "
           "(`expert_dtype: fp4`)", ("deepseek_v4",),
           "names kept, MTP kept; transformers loads the output with nothing missing",
           "1, 2, 4 (DeepSeek's V4 layout, MTP kept); V4-Flash's dims plan at 4 and 8, 16 is refused (`o_groups`)",
           "byte for byte, both spellings (MTP too)",
           "mp 1, 2, 4 (as transformers' DeepseekV4ForCausalLM), both spellings",
           "sliding, CSA (with its indexer's top-k) and HCA layers, hash and top-k MoE, YaRN on the compressed "
           "layers, hyper-connections; verify skips the MTP layer (said so). Refused with the reason: "
           "`deepseek_v41` (V4.1-Flash), DSpark stages (V4-Flash-0731). The published form dequantizes bit-equal "
           "to transformers' own dequant and converts to the BF16 shards its BF16 form gives (verified at mp 2 and "
           "4); `quantize --to fp8-block-deepseek --mp N` repacks its MXFP4 experts into FP8 128x128 and cuts it "
           "per rank in one pass, as DeepSeek's convert.py `--expert-dtype fp8` lays it out (`wo_a` BF16), verified "
           "at mp 2 and 4; MXFP4 experts and 32x32 blocks are not cut per rank (refused by name)",
           ("test_deepseek_v4.py::test_shard_then_verify_gives_transformers_greedy_tokens",
            "test_deepseek_v4.py::test_shard_then_merge_is_byte_identical",
            "test_deepseek_v4.py::test_dequant_keeps_names_and_mtp_and_transformers_loads_it",
            "test_deepseek_v4_fp8.py::test_convert_from_the_published_form_verifies_against_transformers",
            "test_repack_mp.py::test_v4_repacked_and_sharded_in_one_pass_is_shard_of_the_repack_and_verifies",
            "test_repack_mp.py::test_published_v4_with_mxfp4_experts_is_not_cut_without_a_repack")),
    Proven("MiniMax-M2 (`minimax_m2`)", ("minimax_m2",), "yes", "1, 2", "byte for byte", "mp 1, 2",
           "q/k norm over all heads (mp must divide the KV heads), sigmoid routing with correction bias, "
           "`rotary_dim`",
           ("test_moe.py::test_shard_then_verify_gives_transformers_greedy_tokens",
            "test_moe.py::test_full_qk_norm_with_replicated_kv_heads_is_refused")),
    Proven("Mixtral and MiniMax-M2 as transformers 5.24 saves them (`save_original_format=False`)",
           ("mixtral", "minimax_m2"), "yes", "1, 2", "", "mp 1, 2",
           "router at `mlp.gate`, bias at `mlp.e_score_correction_bias`, experts stacked: read as the published names "
           "(key-table aliases); a checkpoint holding both spellings of one tensor is refused",
           ("test_moe.py::test_transformers_own_form_reads_as_the_published_one_and_verifies",
            "test_moe.py::test_two_spellings_of_one_tensor_are_refused")),
    Proven("ERNIE-4.5-MoE (`ernie4_5_moe`)", ("ernie4_5_moe",), "yes", "1, 2, 4", "byte for byte (MTP layer too)",
           "mp 1, 2",
           "MoE layers from `moe_layer_start_index` to `moe_layer_end_index` every `moe_layer_interval`, shared "
           "experts, softmax routing with the `[1, E]` correction bias, interleaved RoPE, `use_bias` on every "
           "projection and on the (tied) head; MTP (named as vLLM's ErnieMTP loads it; transformers builds none) "
           "dropped by default, `--keep-mtp` output verifies (MTP skipped, said so)",
           ("test_moe.py::test_shard_then_verify_gives_transformers_greedy_tokens",
            "test_moe.py::test_shard_mp4_then_merge_is_byte_identical_per_tensor",
            "test_moe.py::test_mtp_layer_is_dropped_by_default_and_kept_shards_verify")),
    Proven("Llama-4 text (`llama4_text`)", ("llama4_text",), "yes", "1, 2, 4 (8 refused: heads)", "byte for byte",
           "mp 1, 2 (as transformers' Llama4ForCausalLM)",
           "experts stacked [E, H, 2I] kept stacked by expert range, routing that scales each token before its "
           "expert, a shared expert, dense layers by `interleave_moe_layer_step` / `moe_layers`, NoPE layers, L2 q/k "
           "norm, attention temperature, chunked attention, llama3 RoPE on interleaved pairs; the quantize stage "
           "refuses it. The multimodal `llama4` wrapper is not read",
           ("test_llama4.py::test_shard_then_verify_gives_transformers_greedy_tokens",
            "test_llama4.py::test_shard_mp4_keeps_experts_stacked_by_range_and_merges_back_byte_identical",
            "test_llama4.py::test_plan_and_inspect_read_it_and_refusals_say_why")),
    Proven("MiMo-V2-Flash (`mimo_v2_flash`)", ("mimo_v2_flash",), "yes", "1, 2, 4 (8 refused: heads)",
           "byte for byte", "mp 1, 2 (as transformers' MiMoV2FlashForCausalLM)",
           "sliding-window layers with twice the KV heads and attention sinks beside full ones (KV heads replicated "
           "per layer kind), `v_head_dim` narrower than `head_dim`, `attention_value_scale`, a rope per layer kind on "
           "a partial share, grouped sigmoid routing with a correction bias, dense layers by `mlp_layer_types`; "
           "transformers' own form (stacked experts, `self_attn.sinks`) read as published. Its MTP layers "
           "(`model.mtp.*`, which transformers ignores) are not read: a checkpoint holding them is refused by name",
           ("test_mimo.py::test_shard_then_verify_gives_transformers_greedy_tokens",
            "test_mimo.py::test_shard_mp4_replicates_kv_heads_per_layer_kind_and_merges_back_byte_identical",
            "test_mimo.py::test_transformers_own_form_reads_as_the_published_one")),
    Proven("Qwen3-Next (`qwen3_next`), BF16", ("qwen3_next",), "yes", "1, 2, 4 (8 refused: heads)",
           "byte for byte (MTP layer too)", "mp 1, 2 (as transformers' Qwen3NextForCausalLM)",
           "Gated DeltaNet layers beside gated full attention: projections, conv and recurrent state cut on whole "
           "key-head groups (the conv's q, k and v channels as three tensors per rank), zero-centred norms, partial "
           "rotary, a dense `mlp_only_layers` layer, attention biases, layer types from `full_attention_interval`; "
           "MTP (`mtp.*`) dropped by default, `--keep-mtp` output verifies (MTP skipped, said so). The bundled model "
           "refuses quantized shards (verify a `--dtype bf16` output)",
           ("test_gated_deltanet.py::test_shard_then_verify_gives_transformers_greedy_tokens",
            "test_gated_deltanet.py::test_shard_mp4_then_merge_is_byte_identical_per_tensor",
            "test_gated_deltanet.py::test_linear_attention_is_cut_on_whole_key_heads",
            "test_gated_deltanet.py::test_mtp_layer_is_dropped_by_default_kept_on_request_verified_and_merged",
            "test_gated_deltanet.py::test_mp_that_cuts_a_head_group_is_refused")),
    Proven("Qwen3.5/3.6 MoE's text model (`qwen3_5_moe_text`), BF16", ("qwen3_5_moe_text",), "yes",
           "1, 2, 4 (8 refused: heads)", "byte for byte", "mp 1, 2 (as transformers' Qwen3_5MoeForCausalLM)",
           "Qwen3-Next's layers with `in_proj_qkv` / `in_proj_z` / `in_proj_b` / `in_proj_a` (`in_proj_qkv` and the "
           "conv held as q, k, v segments per rank), every layer MoE, tied embeddings; stacked experts read as per "
           "expert",
           ("test_gated_deltanet.py::test_shard_then_verify_gives_transformers_greedy_tokens",
            "test_gated_deltanet.py::test_shard_mp4_then_merge_is_byte_identical_per_tensor",
            "test_gated_deltanet.py::test_stacked_experts_shard_as_the_per_expert_checkpoint")),
    Proven("Qwen3.5/3.6 MoE (`qwen3_5_moe`): its text model, vision tower passed through", ("qwen3_5_moe",),
           "yes; vision tower unchanged", "1, 2, 4 (vision tower whole on rank 0)",
           "byte for byte (the whole file, MTP layer and vision tower too)",
           "mp 2 (as transformers' Qwen3_5MoeForCausalLM, its AutoModelForCausalLM)",
           "text tower as `model.language_model.*` (the hub's and save_pretrained's), `model.visual.*` passed "
           "through, MTP at the top (`mtp.*`: `text_config.mtp_num_hidden_layers` zeroed when dropped); positions "
           "of a text prompt are the same on every mrope axis, so verify runs plain partial rotary",
           ("test_gated_deltanet.py::test_multimodal_wrapper_text_tower_verifies_and_the_rest_passes_through",
            "test_gated_deltanet.py::test_multimodal_wrapper_merges_back_byte_for_byte_mtp_and_vision_tower_included")),
    Proven("Kimi-Linear (`kimi_linear`), BF16, in the published spelling and transformers' save_pretrained's",
           ("kimi_linear",), "yes", "1, 2, 4 (8 refused: heads)", "byte for byte, each spelling",
           "mp 1, 2 (as transformers' KimiLinearForCausalLM)",
           "KDA (a decay per key channel, low-rank forget and output gates) beside MLA without rotary, both cut on "
           "whole heads; sigmoid routing with correction bias over expert groups, a dense first layer; fields under "
           "Moonshot's names or transformers' aliases, layer lists from `linear_attn_config`. Refused by name: a query "
           "LoRA, attention biases, and Moonshot's fields transformers' model does not build (`mla_use_output_gate`, "
           "`use_full_rank_gate`, `moe_layer_freq` other than 1, ...: Kimi-K3's text model)",
           ("test_kimi_linear.py::test_shard_then_verify_gives_transformers_greedy_tokens",
            "test_kimi_linear.py::test_shard_mp4_then_merge_is_byte_identical_in_its_own_spelling",
            "test_kimi_linear.py::test_fields_are_read_as_kimi_linear_config_reads_them",
            "test_kimi_linear.py::test_what_transformers_does_not_build_is_refused_by_name")),
    Proven("LongCat-Flash (`longcat_flash`), BF16, in the published spelling (zero experts hold no weights, MTP "
           "layer) and transformers' save_pretrained's (per expert, or its own stacked form)", ("longcat_flash",), "yes",
           "1, 2, 4 (8 refused: heads; mp must divide routed + zero experts)",
           "byte for byte, each spelling (MTP layer too); the stacked form merges to the per-expert one",
           "mp 1, 2 (as transformers' LongcatFlashForCausalLM)",
           "two MLA sublayers per layer (query LoRA, LoRA scaling of the query and latent, interleaved rotary pairs) "
           "cut on whole heads, two dense MLPs, a shortcut MoE: softmax over routed + zero (identity) experts, "
           "correction bias for the choice, unnormalised weights times `routed_scaling_factor`. Zero experts are "
           "counted as experts after the routed ones (the router's width, the ranges ranks own); transformers' "
           "save_pretrained writes unused gate and up projections for them, carried to their rank; its own form "
           "(`save_original_format=False`: experts stacked, zero-expert slots in `gate_up_proj` only) is read as "
           "its per-expert one. `attention_bias`: the q_a/kv_a biases replicated, o_proj's added once after the "
           "sum. The published MTP layer (`model.mtp.*`, which transformers ignores) is kept in HF outputs, dropped "
           "from mp by default; `--keep-mtp` cuts it like a layer and verify compares it with the reference (not "
           "run, said so). transformers 5.24 cannot load the published spelling (a size mismatch): verify against "
           "it falls back to the bundled model, said so. Refused by name: `router_bias`, LoRA scaling off, "
           "non-identity zero experts, rope types other than default",
           ("test_longcat_flash.py::test_shard_then_verify_gives_transformers_greedy_tokens",
            "test_longcat_flash.py::test_shard_mp4_then_merge_is_byte_identical_in_its_own_spelling",
            "test_longcat_flash.py::test_heads_are_cut_whole_and_zero_experts_ranked_after_routed_ones",
            "test_longcat_flash.py::test_a_published_reference_falls_back_to_the_bundled_model_and_says_why",
            "test_longcat_flash.py::test_fields_are_read_as_longcat_flash_config_reads_them",
            "test_longcat_flash.py::test_what_ckpttools_model_does_not_build_is_refused_by_name",
            "test_longcat_flash.py::test_transformers_own_stacked_form_reads_as_its_per_expert_spelling",
            "test_longcat_flash.py::test_the_stacked_form_verifies_against_itself",
            "test_longcat_flash.py::test_attention_biases_are_cut_as_their_weights",
            "test_longcat_flash.py::test_attention_biases_verify_as_transformers",
            "test_longcat_flash.py::test_a_kept_mtp_layer_is_cut_like_a_layer_and_merges_back_byte_for_byte",
            "test_longcat_flash.py::test_a_kept_mtp_layer_verifies_and_is_compared_with_the_reference")),
)
