"""The generic stage builder: for every supported decoder-only type, a chain of stages is the model.

Each type is built from its own config class (3 blocks, hidden 64, dropout off, fp32, the
builder's default sdpa attention where the model offers it) and compared with the full model on
one left-padded batch: logits, summed loss and the gradient of every parameter.
"""
from __future__ import annotations

import pytest

from hapt_hf.core.families import accepted_model_types
from benchmarks.chain_check import chain_ranges, check_chain, tiny_config
from hapt_hf.pipeline.stage import StageBuildError, build_stage

ATOL = 4e-5
HAND_WRITTEN = ("gpt2", "llama", "mistral", "qwen2", "opt")
GENERIC = ("qwen3", "phi3", "phi", "gemma", "gemma2", "gemma3_text", "gpt_neox", "falcon",
           "stablelm", "olmo2", "granite", "starcoder2", "gptj", "bloom", "mixtral", "qwen2_moe",
           "cohere", "deepseek_v2", "biogpt", "afmoe", "nanochat", "gemma4_text", "gpt_neo", "dbrx",
           "lfm2_moe", "cohere_compass_text", "openai-gpt", "ctrl")
HALVABLE = ("qwen3", "gemma", "starcoder2", "qwen2_moe")
PARALLEL = ("gptj", "gpt_neox", "falcon", "phi", "cohere")


def _assert_equal(result) -> None:
    assert result.params_matched > 0
    assert result.logits <= ATOL and result.loss <= ATOL * 10 and result.grads <= ATOL, result


@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("model_type", HAND_WRITTEN + GENERIC)
def test_chain_of_blocks_is_the_full_model(model_type, stages):
    _assert_equal(check_chain(tiny_config(model_type), chain_ranges(3, stages)))


@pytest.mark.parametrize("model_type", HALVABLE)
def test_chain_of_halves_is_the_full_model(model_type):
    # 3 stages over 8 half-layers: the cuts fall inside blocks
    _assert_equal(check_chain(tiny_config(model_type), chain_ranges(3, 3, "half"), "half"))


@pytest.mark.parametrize("model_type", PARALLEL)
def test_parallel_blocks_refuse_halves_with_the_reason(model_type):
    with pytest.raises(StageBuildError, match="in parallel.*use layer_unit 'block'"):
        build_stage(tiny_config(model_type), (0, 2), layer_unit="half", attn_implementation="eager")


def _accepted_types_without_sdpa() -> list[str]:
    """Accepted types whose causal-LM class has no sdpa attention on the installed transformers
    (which ones changes between releases: GPT-J gained it in 5.24; older releases lack some types)."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    classes = {t: getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(t, ""), None)
               for t in accepted_model_types()}
    return [t for t, cls in classes.items() if cls is not None and not cls._supports_sdpa]


def test_attention_the_model_lacks_is_refused_with_the_fix():
    lacking = _accepted_types_without_sdpa()
    if not lacking:
        pytest.skip("every accepted model type implements sdpa on this transformers: none to refuse")
    for model_type in lacking:  # the builder's default attention is sdpa
        with pytest.raises(StageBuildError,
                           match=f"'{model_type}' does not support attn_implementation 'sdpa'.*'eager'"):
            build_stage(tiny_config(model_type, blocks=2), (0, 2))


def test_sandwich_norm_blocks_refuse_halves_with_the_reason():
    # Gemma 2 normalises the attention output before the residual: not the LLaMA block
    with pytest.raises(StageBuildError, match="Gemma2DecoderLayer's forward is not the pre-norm"):
        build_stage(tiny_config("gemma2"), (0, 2), layer_unit="half", attn_implementation="eager")


def test_router_aux_loss_is_refused_with_the_fix():
    config = tiny_config("mixtral")
    config.output_router_logits = True
    with pytest.raises(StageBuildError, match="output_router_logits = False"):
        build_stage(config, (0, 2))


@pytest.mark.parametrize(("model_type", "kind"), [("rwkv", "recurrent state \\('state'\\)"),
                                                  ("bamba", "layer_types holds \\['linear_attention'\\]")])
def test_recurrent_layers_are_refused_with_the_reason(model_type, kind):
    with pytest.raises(StageBuildError, match=kind):
        build_stage(tiny_config(model_type, blocks=2), (0, 2), unverified=True)


def test_encoder_decoder_is_refused():
    from transformers import BartConfig
    with pytest.raises(StageBuildError, match="'bart' is not supported.*encoder-decoder"):
        build_stage(BartConfig(encoder_layers=1, decoder_layers=1, d_model=16, vocab_size=64,
                               encoder_attention_heads=2, decoder_attention_heads=2,
                               encoder_ffn_dim=16, decoder_ffn_dim=16), (0, 2))


def test_softcapping_runs_in_the_head():
    # Gemma 2's logits are capped at final_logit_softcapping by the causal LM's own forward
    import torch
    config = tiny_config("gemma2")
    config.final_logit_softcapping = 0.5
    stage = build_stage(config, (0, 5), attn_implementation="eager")
    logits = stage(torch.randint(3, 100, (1, 8)))
    assert logits.abs().max() <= 0.5


def test_a_weightless_norm_before_the_layers_runs_on_the_first_stage():
    # NanoChat norms the embedding with its (weightless) final norm before the first layer: the
    # first stage's output is the normed embedding, as the full model hands it to layer 0
    import torch
    config = tiny_config("nanochat")
    stage = build_stage(config, (0, 1))
    ids = torch.randint(3, 100, (2, 8))
    embedded = stage.get_submodule("model.embed_tokens")(ids)
    torch.testing.assert_close(stage(ids), torch.nn.functional.rms_norm(
        embedded, (embedded.shape[-1],), eps=config.rms_norm_eps))


@pytest.mark.parametrize(("setting", "value"), [("hidden_size_per_layer_input", 16),
                                                ("num_kv_shared_layers", 1)])
def test_layers_reading_more_than_the_hidden_state_are_refused(setting, value):
    # Gemma 4's per-layer input embeddings and shared keys / values are streams beside the
    # hidden state: the configs without them are cut (tiny_config), these are refused
    config = tiny_config("gemma4_text")
    setattr(config, setting, value)
    with pytest.raises(StageBuildError, match=f"config.{setting} is {value}: .*only configs"):
        build_stage(config, (0, 2))
