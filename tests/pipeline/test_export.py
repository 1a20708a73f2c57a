"""The export's file names and the removal of an earlier export's weights (no ranks; the
export written by the stages of real plans is checked in tests/integration/test_accelerate_portable.py
and the pipeline's tensor-parallel, interleaved and replica tests)."""
from __future__ import annotations

from hapt_hf.pipeline.export import has_weights, remove_stale_weights, shard_file


def test_file_names_are_save_pretrained_s():
    assert shard_file(0, 1) == "model.safetensors"
    assert [shard_file(k, 3) for k in range(3)] == [f"model-0000{k}-of-00003.safetensors"
                                                    for k in (1, 2, 3)]


def test_an_earlier_exports_weights_are_removed_and_nothing_else(tmp_path):
    out, new = tmp_path / "out", tmp_path / "new"
    out.mkdir(), new.mkdir()
    old = ["model.safetensors", "model-00001-of-00003.safetensors",
           "model-00002-of-00002.safetensors", "model.safetensors.index.json"]
    for name in old + ["tokenizer.json", "config.json", "adapter_model.safetensors"]:
        (out / name).write_text("")
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                 "model.safetensors.index.json", "config.json"):
        (new / name).write_text("")
    assert has_weights(out) and has_weights(new)
    remove_stale_weights(out, new)
    assert sorted(p.name for p in out.iterdir()) == [
        "adapter_model.safetensors", "config.json", "model-00002-of-00002.safetensors",
        "model.safetensors.index.json", "tokenizer.json"]
    assert not has_weights(tmp_path)
