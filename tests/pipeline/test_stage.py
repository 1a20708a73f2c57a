"""One-process tests of pipeline stages: a chain of stages is the full Hugging Face model."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.testing import assert_close
from transformers import (
    AutoModelForCausalLM,
    BertConfig,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    OPTConfig,
    PretrainedConfig,
    Qwen2Config,
)

from hapt_hf.core.defaults import DEFAULT_ATTN_IMPLEMENTATION
from hapt_hf.pipeline import checkpoint_io, init_replay
from hapt_hf.pipeline import stage as stage_module
from hapt_hf.pipeline.stage import PipelineStage, StageBuildError, StageInputError, build_stage, supported_families

VOCAB, SEQ, BATCH = 128, 16, 3
TOL = {"rtol": 1e-5, "atol": 4e-5}


def gpt2(blocks: int = 6) -> GPT2Config:
    # Dropout off: the chain and the full model draw dropout masks in different orders.
    return GPT2Config(n_layer=blocks, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=32,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)


def llama(blocks: int = 6) -> LlamaConfig:
    return LlamaConfig(num_hidden_layers=blocks, hidden_size=64, intermediate_size=128,
                       num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                       max_position_embeddings=32, tie_word_embeddings=False)


def mistral(blocks: int = 6) -> MistralConfig:
    # A window shorter than the sequence, so the sliding mask differs from the causal one.
    return MistralConfig(num_hidden_layers=blocks, hidden_size=64, intermediate_size=128,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                         max_position_embeddings=32, sliding_window=4)


def qwen2(blocks: int = 6) -> Qwen2Config:
    # Blocks 2.. use sliding attention, blocks 0-1 full: both mask kinds in one model.
    return Qwen2Config(num_hidden_layers=blocks, hidden_size=64, intermediate_size=128,
                       num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                       max_position_embeddings=32, use_sliding_window=True, sliding_window=4,
                       max_window_layers=2, tie_word_embeddings=True)


def opt(blocks: int = 6, projected: bool = False) -> OPTConfig:
    # projected: embeddings narrower than the blocks, so project_in / project_out exist.
    return OPTConfig(num_hidden_layers=blocks, hidden_size=64, ffn_dim=128, num_attention_heads=4,
                     vocab_size=VOCAB, max_position_embeddings=32, dropout=0.0, attention_dropout=0.0,
                     word_embed_proj_dim=32 if projected else 64, pad_token_id=1, bos_token_id=2,
                     eos_token_id=2)


def reference(config: PretrainedConfig, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=DEFAULT_ATTN_IMPLEMENTATION)


def batch(padded: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    labels = ids.clone()
    if not padded:
        return ids, None, labels
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, :5] = 0   # left padding
    mask[2, -3:] = 0  # right padding
    labels[mask == 0] = -100
    return ids, mask, labels


def run_chain(stages: list[PipelineStage], ids, mask, labels=None) -> torch.Tensor:
    x = ids
    for stage in stages:
        x = stage(x, attention_mask=mask, labels=labels if stage.is_last else None)
    return x


def token_count(labels: torch.Tensor) -> torch.Tensor:
    return (labels[:, 1:] != -100).sum()


def assert_grads_match(stages: list[PipelineStage], ref: torch.nn.Module) -> None:
    """Every stage parameter's grad equals the full model's; tied copies on two stages sum to it."""
    ref_grads = {n: p.grad for n, p in ref.named_parameters(remove_duplicate=False)}
    got: dict[str, torch.Tensor] = {}
    for stage in stages:
        tied = {id(p) for p in stage.tied_parameters()}
        for name, param in stage.named_parameters(remove_duplicate=False):
            assert param.grad is not None, name
            if id(param) in tied:  # the runtime sums these two copies' grads between the stages
                name = stage.adapter.input_embedding_key
            got[name] = got[name] + param.grad if name in got else param.grad
    split_tie = any(stage.tied_parameters() for stage in stages)
    expected = set(ref_grads) - ({stages[-1].adapter.output_embedding_key} if split_tie else set())
    assert set(got) == expected
    for name, grad in got.items():
        assert_close(grad, ref_grads[name], **TOL, msg=lambda m, n=name: f"{n}: {m}")


PARTITIONS = {
    "two_stages_4+2": (6, [(0, 5), (5, 8)]),
    "four_stages_1+3+1+2": (7, [(0, 2), (2, 5), (5, 6), (6, 9)]),
    "embedding_and_head_alone": (6, [(0, 1), (1, 7), (7, 8)]),
    "single_stage": (6, [(0, 8)]),
}


@pytest.mark.parametrize("family", [gpt2, llama], ids=["gpt2_tied", "llama_untied"])
@pytest.mark.parametrize("partition", list(PARTITIONS), ids=list(PARTITIONS))
def test_chain_equals_full_model_with_padding(family: Callable, partition: str) -> None:
    blocks, ranges = PARTITIONS[partition]
    config = family(blocks)
    ref = reference(config)
    stages = [build_stage(config, r) for r in ranges]
    ids, mask, labels = batch(padded=True)

    out = ref(ids, attention_mask=mask, labels=labels)
    assert_close(run_chain(stages, ids, mask), out.logits, **TOL)
    loss = run_chain(stages, ids, mask, labels) / token_count(labels)
    assert loss.ndim == 0
    assert_close(loss, out.loss, **TOL)

    out.loss.backward()
    loss.backward()
    assert_grads_match(stages, ref)
    assert_tied_ends(stages)


def assert_tied_ends(stages: list[PipelineStage]) -> None:
    """Only the two ends of a tie split over two stages are reported, each by its own stage."""
    first, last = stages[0], stages[-1]
    split = first.config.tie_word_embeddings and len(stages) > 1
    assert first.tied_parameters() == ([first.get_parameter(first.adapter.input_embedding_key)] if split else [])
    assert last.tied_parameters() == ([last.get_parameter(last.adapter.output_embedding_key)] if split else [])
    assert all(s.tied_parameters() == [] for s in stages[1:-1])
    if first.config.tie_word_embeddings and len(stages) == 1:  # both ends on one stage: one Parameter
        assert first.get_parameter("lm_head.weight") is first.get_parameter(first.adapter.input_embedding_key)


@pytest.mark.parametrize("family", [mistral, qwen2, opt, lambda: opt(projected=True)],
                         ids=["mistral_sliding", "qwen2_mixed_tied", "opt_tied", "opt_projected"])
def test_mistral_qwen2_opt_match(family: Callable) -> None:
    config = family()
    ref = reference(config)
    stages = [build_stage(config, r) for r in [(0, 3), (3, 5), (5, 8)]]
    ids, mask, labels = batch(padded=True)
    out = ref(ids, attention_mask=mask, labels=labels)
    loss = run_chain(stages, ids, mask, labels) / token_count(labels)
    assert_close(loss, out.loss, **TOL)
    out.loss.backward()
    loss.backward()
    assert_grads_match(stages, ref)


@pytest.mark.parametrize(("family", "use_cache"), [(gpt2, True), (llama, False)],
                         ids=["gpt2_use_cache", "llama_no_cache"])
def test_no_attention_mask_and_explicit_position_ids(family: Callable, use_cache: bool) -> None:
    config = family()
    # With use_cache the full model skips packed-sequence masks; without, it builds them.
    config.use_cache = use_cache
    ref = reference(config)
    stages = [build_stage(config, r) for r in [(0, 4), (4, 8)]]
    ids, _, labels = batch(padded=False)
    assert_close(run_chain(stages, ids, None, labels) / token_count(labels), ref(ids, labels=labels).loss, **TOL)
    # Two sequences packed in each row: without a mask and without use_cache, the position ids
    # alone make the mask block-diagonal, on every stage as in the full model.
    packed = torch.arange(SEQ // 2).repeat(2).unsqueeze(0).expand(BATCH, -1)
    # Positions two apart: rotary (relative) and learned (absolute) embeddings both see them.
    spread = (2 * torch.arange(SEQ)).unsqueeze(0)
    ones = torch.ones(BATCH, SEQ, dtype=torch.long)
    for pos, mask in [(packed, None), (spread, ones)]:
        hidden = stages[0](ids, attention_mask=mask, position_ids=pos)
        logits = stages[1](hidden, attention_mask=mask, position_ids=pos)
        assert_close(logits, ref(ids, attention_mask=mask, position_ids=pos).logits, **TOL)
        assert not torch.allclose(logits, run_chain(stages, ids, mask), **TOL)  # the positions mattered


@pytest.mark.parametrize("family", [gpt2, llama], ids=["gpt2", "llama"])
def test_recompute_gives_same_loss_and_grads(family: Callable) -> None:
    config = family()
    ref = reference(config)
    stages = [build_stage(config, r, recompute=True) for r in [(0, 3), (3, 8)]]
    ids, mask, labels = batch(padded=True)
    loss = run_chain(stages, ids, mask, labels) / token_count(labels)
    ref(ids, attention_mask=mask, labels=labels).loss.backward()
    loss.backward()
    assert_grads_match(stages, ref)


@pytest.mark.parametrize("family", [gpt2, llama, mistral, qwen2, lambda: opt(projected=True)],
                         ids=["gpt2", "llama", "mistral", "qwen2", "opt_projected"])
def test_seed_init_is_bit_identical_without_building_the_full_model(family: Callable, monkeypatch) -> None:
    config = family()
    ref_state = reference(config, seed=3).state_dict()
    after_ref = torch.rand(4)  # where the generator stands after the full model's build

    def full_model_forbidden(*args, **kwargs):
        raise AssertionError("seed init fell back to building the full model")

    monkeypatch.setattr(init_replay, "full_model_init", full_model_forbidden)
    ranges = [(0, 2), (2, 6), (6, 8)]
    gathered = checkpoint_io.gather_state_dicts(build_stage(config, r, seed=3).hf_state_dict() for r in ranges)
    # The replay consumed the generator exactly as the full build did.
    assert torch.equal(torch.rand(4), after_ref)
    assert set(gathered) == set(ref_state)
    for key, value in ref_state.items():
        assert torch.equal(gathered[key], value), key
    other = build_stage(config, (2, 6), seed=4).hf_state_dict()
    assert not all(torch.equal(other[k], gathered[k]) for k in other)


class _ReadSpy:
    """Wraps safe_open and records which tensor keys a stage reads."""

    def __init__(self, real) -> None:
        self.real, self.read = real, []

    def __call__(self, *args, **kwargs):
        spy = self

        class Handle:
            def __enter__(self):
                self.inner = spy.real(*args, **kwargs).__enter__()
                return self

            def __exit__(self, *exc):
                return self.inner.__exit__(*exc)

            def keys(self):
                return self.inner.keys()

            def get_tensor(self, key):
                spy.read.append(key)
                return self.inner.get_tensor(key)

        return Handle()


@pytest.mark.parametrize(("family", "shard"), [(gpt2, "40KB"), (llama, None)],
                         ids=["gpt2_tied_sharded", "llama_untied_single_file"])
def test_checkpoint_load_reads_only_stage_keys(family: Callable, shard: str | None, tmp_path, monkeypatch) -> None:
    config = family()
    saved = reference(config, seed=11)
    kwargs = {"max_shard_size": shard} if shard else {}
    saved.save_pretrained(tmp_path, safe_serialization=True, **kwargs)
    assert (tmp_path / ("model.safetensors.index.json" if shard else "model.safetensors")).is_file()
    monkeypatch.setattr(stage_module, "_seeded_init", lambda *a: pytest.fail("seed init on the checkpoint path"))
    full_state = saved.state_dict()
    for span in [(0, 3), (3, 6), (6, 8)]:
        spy = _ReadSpy(checkpoint_io.safe_open)
        monkeypatch.setattr(checkpoint_io, "safe_open", spy)
        stage = build_stage(config, span, checkpoint_dir=tmp_path)
        own = stage.hf_state_dict()
        for key, value in own.items():
            assert torch.equal(value, full_state[key]), key
        stored = {k if k in full_state and not (config.tie_word_embeddings and k == "lm_head.weight")
                  else stage.adapter.input_embedding_key for k in own}
        assert sorted(spy.read) == sorted(stored)
    ids, mask, labels = batch(padded=True)
    stages = [build_stage(config, r, checkpoint_dir=tmp_path) for r in [(0, 4), (4, 8)]]
    assert_close(run_chain(stages, ids, mask, labels) / token_count(labels),
                 saved(ids, attention_mask=mask, labels=labels).loss, **TOL)


def test_gathered_stages_save_and_load_as_full_model(tmp_path) -> None:
    config = gpt2(blocks=2)
    stages = [build_stage(config, r, seed=5) for r in [(0, 2), (2, 4)]]
    full = checkpoint_io.gather_state_dicts(s.hf_state_dict() for s in stages)
    checkpoint_io.save_full_checkpoint(full, config, tmp_path, tied_keys=["lm_head.weight"])
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=DEFAULT_ATTN_IMPLEMENTATION)
    for key, value in loaded.state_dict().items():
        assert torch.equal(value, full[key]), key
    with pytest.raises(checkpoint_io.CheckpointError, match="appears in two stages"):
        checkpoint_io.gather_state_dicts([stages[0].hf_state_dict(), stages[0].hf_state_dict()])


def test_dtype_and_stage_flags() -> None:
    stage = build_stage(llama(blocks=3), (2, 5), dtype=torch.bfloat16)
    assert {p.dtype for p in stage.parameters()} == {torch.bfloat16}
    assert stage.get_buffer("model.rotary_emb.inv_freq").dtype == torch.float32  # as HF keeps it
    assert (stage.is_first, stage.is_last, list(stage.block_indices)) == (False, True, [1, 2])
    out = stage(torch.randn(2, SEQ, 64, dtype=torch.bfloat16))
    assert out.shape == (2, SEQ, VOCAB)


def test_unsupported_family_names_supported_ones() -> None:
    with pytest.raises(StageBuildError, match=r"'bert' is not supported.*gpt2.*llama.*mistral.*qwen2.*opt"):
        build_stage(BertConfig(), (0, 2))
    assert supported_families() == ["gpt2", "llama", "opt"]
    config = opt(blocks=2)
    config.layerdrop = 0.1
    with pytest.raises(StageBuildError, match=r"config.layerdrop is 0.1.*set config.layerdrop = 0.0"):
        build_stage(config, (0, 2))


@pytest.mark.parametrize("bad", [(0, 0), (3, 2), (-1, 2), (0, 9), ("a", 2)])
def test_bad_layer_range_is_explained(bad) -> None:
    with pytest.raises(StageBuildError, match=r"layer_range .* 0 <= start < end <= 8"):
        build_stage(gpt2(), bad)


def test_wrong_input_kind_is_explained() -> None:
    first, second = build_stage(gpt2(blocks=2), (0, 2)), build_stage(gpt2(blocks=2), (2, 4))
    with pytest.raises(StageInputError, match="must be input_ids"):
        first(torch.randn(2, SEQ, 64))
    with pytest.raises(StageInputError, match="must be hidden states"):
        second(torch.zeros(2, SEQ, dtype=torch.long))


def test_missing_checkpoint_is_explained(tmp_path) -> None:
    with pytest.raises(StageBuildError, match="neither model.safetensors nor"):
        build_stage(gpt2(blocks=2), (0, 3), checkpoint_dir=tmp_path)
    reference(llama(blocks=2)).save_pretrained(tmp_path, safe_serialization=True)
    with pytest.raises(StageBuildError, match="has no tensor 'transformer.wte.weight'"):
        build_stage(gpt2(blocks=2), (0, 3), checkpoint_dir=tmp_path)
    # An untied LM head is never stood in for by the input embedding.
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["lm_head.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(StageBuildError, match="has no tensor 'lm_head.weight'"):
        build_stage(llama(blocks=2), (2, 4), checkpoint_dir=tmp_path)
