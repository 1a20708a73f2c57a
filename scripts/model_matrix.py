"""Check which of transformers' causal LMs the stage builder cuts exactly; write the verified list.

For every model type of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``: a tiny config from the type's own
config class (benchmarks/chain_check.py tiny_config), then a chain of 2 stages compared with the
full model (logits, summed loss, every gradient; atol 4e-5), then the planner's model reader on
the same config (hapt_hf.profiling.model_reader.read_model: what `hapt-hf plan` and the launch
path read). A type is

- **tested**: verified, and in tests/pipeline/test_generic_stage.py (chains of 2 and 3 stages);
- **works**: verified: the chain check and the read below pass;
- **refused: recurrent/hybrid layers**: its config has layers with per-layer state (mamba, ...);
- **refused: not one layer stack**: not one embedding, one decoder-layer list and one head;
- **not verified: ...**: the chain differs from the full model; transformers' own default config
  of the type does not build its model; the generic builder does not fit the type (the reason in
  words); the check crashed otherwise; no tiny config could be built here; or the chain
  matched but the model reader cannot read the type (the planner could not plan it). The builder
  refuses it and names the reason.

The generic stage builder accepts exactly the verified types (hapt_hf/core/families.py reads
hapt_hf/data/model_matrix.json, which this script writes with docs/models.md).

    python3 scripts/model_matrix.py              # every type: rewrites the JSON and docs/models.md
    python3 scripts/model_matrix.py --type X     # check one type on this transformers, print it
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/ from the checkout

import transformers  # noqa: E402
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # noqa: E402

from hapt_hf.core.families import MATRIX_FILE, VERIFIED_STATUSES  # noqa: E402
from hapt_hf.errors import HaptError  # noqa: E402
from benchmarks.chain_check import chain_ranges, check_chain, tiny_config  # noqa: E402
from hapt_hf.pipeline.config_checks import recurrent_refusal  # noqa: E402

ATOL = 4e-5
MAX_PARAMS = 5_000_000
TESTED = ("gpt2", "llama", "mistral", "qwen2", "opt", "qwen3", "phi3", "phi", "gemma", "gemma2",
          "gemma3_text", "gpt_neox", "falcon", "stablelm", "olmo2", "granite", "starcoder2", "gptj",
          "bloom", "mixtral", "qwen2_moe", "cohere", "deepseek_v2", "biogpt", "afmoe", "nanochat",
          "gemma4_text", "gpt_neo", "dbrx", "lfm2_moe", "cohere_compass_text", "openai-gpt", "ctrl")
RECURRENT = "refused: recurrent/hybrid layers"
NOT_A_STACK = "refused: not one layer stack"
DEFAULT_BROKEN = "not verified: transformers' default config does not build"
DOES_NOT_FIT = "not verified: the generic builder does not fit"
NOT_READ = "not verified: the model reader cannot read it"
READ_SEQ = 32
BUILDER_DOES_NOT_FIT = {
    "xmod": "every layer picks a language adapter set on the model (set_default_language), "
            "which the stage does not carry",
}
"""Why the check of these types crashes, in words (shown only while it does crash)."""


PLANNER_NOTE = (
    "`hapt_hf.model_spec` (and `hapt-hf plan`, `simulate`, `profile` and the launch path, which "
    "pass its reader) reads every accepted type's figures off the model, gpt2, llama, "
    "mistral, qwen2 and opt included (hapt_hf/profiling/model_reader.py: parameters and FLOPs "
    "from the model built on the meta device, only the experts that run for MoE (top-k routing "
    "evenly spread where a model's code groups tokens by expert); the bytes kept "
    "for the backward measured on one layer (and half) of each kind on fake CPU tensors, no "
    "memory, with the attention implementation the runtime builds and dropout kept as GPU "
    "kernels keep it). The hand formulas of gpt2, llama, mistral, qwen2 and opt "
    "(`ModelSpec.from_formula`) are the tests' oracles and what `ModelSpec.from_config` gives "
    "without a reader (torch-free), where every other type is refused. Blocks cut in halves "
    "(`layer_unit: half`) are those the stage builder cuts: GPT-2's, OPT's (pre-norm or "
    "post-norm) and the LLaMA block (an attention residual then an MLP residual); the other "
    "types are planned in whole blocks and `layer_unit: half` is refused with the reason "
    "(attention and MLP in parallel: GPT-J, GPT-NeoX, Falcon, Phi...).")
"""How the planner describes the accepted types (the page's header)."""
PRECISION_NOTE = (
    "Precisions: every accepted type trains in fp32, bf16 and fp16 (16 bits: autocast over fp32 "
    "weights); tests/pipeline/test_model_types_16bit.py runs each one's forward under bf16 and "
    "fp16 autocast. DBRX's experts, which transformers writes without the cast its other MoEs "
    "make (`index_add_` of the experts' 16-bit output into the fp32 residual stream, refused "
    "under autocast in transformers' own model), get that cast in the stages "
    "(hapt_hf/compat/moe_autocast.py); tests/pipeline/test_moe_autocast.py trains DBRX in bf16 "
    "on 2 stages as one process does under the same autocast.")
"""Which precisions the accepted types run in (the page's header)."""


def classify(model_type: str) -> tuple[str, str]:
    try:
        config = tiny_config(model_type, blocks=2)
    except Exception as err:  # noqa: BLE001 - any failure of a third-party config is reported
        recurrent = _default_recurrence(model_type)
        return (RECURRENT, recurrent) if recurrent else ("not verified: no tiny config", _short(err))
    recurrent = recurrent_refusal(config)
    if recurrent is not None:  # before the full model runs: a tiny hybrid may not run at all
        return RECURRENT, recurrent
    try:
        size = _meta_params(config)
    except Exception as err:  # noqa: BLE001
        return _crashed(model_type, err)
    if size > MAX_PARAMS:  # sizes the tiny config could not reach (other field names)
        return "not verified: no tiny config", f"{size / 1e6:.0f}M parameters with the small sizes set"
    try:
        r = check_chain(config, chain_ranges(2, 2), unverified=True)
    except HaptError as err:
        return (RECURRENT if "layer_types" in str(err) else NOT_A_STACK), _short(err)
    except Exception as err:  # noqa: BLE001
        return _crashed(model_type, err)
    if max(r.logits, r.grads) > ATOL:
        return ("not verified: chain differs from the full model",
                f"max |logits diff| {r.logits:.2e}, max |grad diff| {r.grads:.2e}")
    unread = reader_failure(config)
    if unread is not None:  # the builder would cut it, but the planner could not plan it
        return NOT_READ, unread
    return ("tested" if model_type in TESTED else "works"), f"{r.params_matched} parameters matched"


def reader_failure(config) -> str | None:
    """Why the planner's model reader fails on ``config`` (the error in words), or None."""
    from benchmarks.chain_check import attention_for
    from hapt_hf.profiling.model_reader import read_model
    try:
        read_model(config, READ_SEQ, "fp32", attention_for(config))
    except Exception as err:  # noqa: BLE001 - any failure of the read is the type's status
        return f"{type(err).__name__}: {_short(err)}"
    return None


def _crashed(model_type: str, err: Exception) -> tuple[str, str]:
    """The status of a type whose check crashed: transformers' own default config of the type
    does not build its model, a known way in which the type's forward leaves the generic
    builder's assumptions (read only once the check has crashed), or an unexplained crash."""
    raw = f"{type(err).__name__}: {_short(err)}"
    try:
        _meta_params(transformers.AutoConfig.for_model(model_type))
    except Exception as default_err:  # noqa: BLE001
        return DEFAULT_BROKEN, f"{type(default_err).__name__}: {_short(default_err)}"
    if model_type in BUILDER_DOES_NOT_FIT:
        return DOES_NOT_FIT, f"{BUILDER_DOES_NOT_FIT[model_type]} ({raw})"
    return "not verified: check crashed", raw


def _default_recurrence(model_type: str) -> str | None:
    """Why the type is recurrent/hybrid, read off its default config (where no tiny one builds)."""
    try:
        return recurrent_refusal(transformers.AutoConfig.for_model(model_type))
    except Exception:  # noqa: BLE001 - the default config may not build either
        return None


def _meta_params(config) -> int:
    import torch
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def _short(err: Exception) -> str:
    text = " ".join(str(err).split())
    return (text[:220] + "...") if len(text) > 220 else text


def markdown(matrix: dict) -> str:
    """docs/models.md from the matrix (tests/pipeline/test_model_matrix.py checks they agree)."""
    rows = matrix["types"]
    counts = collections.Counter(e["status"] for e in rows.values())
    lines = ["# Supported models", "",
             f"Generated by `python3 scripts/model_matrix.py` on transformers {matrix['transformers']} "
             "from `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`: each type built tiny (2 blocks, hidden 64, "
             "dropout off, fp32) and cut into 2 stages whose logits, summed loss and gradients are "
             "compared with the full model, then read by the planner's model reader. `tested`: "
             "also in tests/pipeline/test_generic_stage.py. "
             f"The stage builder and the planner accept exactly the {' and '.join(VERIFIED_STATUSES)} "
             "types (the list is hapt_hf/data/model_matrix.json); every other type is refused with "
             "its status below. " + PLANNER_NOTE + " " + PRECISION_NOTE + " To check one type on your transformers: "
             "`python3 scripts/model_matrix.py --type X`.", "",
             "Totals: " + ", ".join(f"{k} {v}" for k, v in counts.most_common()), "",
             "| model type | status | detail |", "|---|---|---|"]
    lines += [f"| {t} | {e['status']} | {e['detail'].replace('|', chr(92) + '|')} |"
              for t, e in sorted(rows.items())]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--type", help="check this one model type and print its status")
    args = parser.parse_args(argv)
    transformers.logging.set_verbosity_error()
    if args.type:
        status, why = classify(args.type)
        print(f"{args.type}: {status} ({why})")
        sys.exit(0 if status in VERIFIED_STATUSES else 1)
    types = {}
    for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        status, why = classify(model_type)
        types[model_type] = {"status": status, "detail": why}
        print(model_type, status, why[:100], file=sys.stderr, flush=True)
    matrix = {"transformers": transformers.__version__, "types": types}
    MATRIX_FILE.write_text(json.dumps(matrix, indent=1, sort_keys=True) + "\n")
    (Path(__file__).resolve().parent.parent / "docs" / "models.md").write_text(markdown(matrix))


if __name__ == "__main__":
    main()
