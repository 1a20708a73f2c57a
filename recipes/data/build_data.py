"""Rebuild the shipped dataset and tokenizer from corpus.txt (no network needed).

    python3 recipes/data/build_data.py

Writes ``tiny_corpus.jsonl`` (one paragraph per line, column ``text``) and ``tokenizer/``: a
byte-level BPE trained on the corpus, loadable with ``AutoTokenizer.from_pretrained``.
The vocabulary is small (1024) so the built-in models stay tiny.
"""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

HERE = Path(__file__).resolve().parent
VOCAB_SIZE = 1024
EOS = "<|endoftext|>"


def paragraphs() -> list[str]:
    text = (HERE / "corpus.txt").read_text()
    return [" ".join(p.split()) for p in text.split("\n\n") if p.strip()]


def main() -> None:
    paras = paragraphs()
    with open(HERE / "tiny_corpus.jsonl", "w") as f:
        for p in paras:
            f.write(json.dumps({"text": p}) + "\n")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(paras, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS, eos_token=EOS,
                                   unk_token=EOS, model_max_length=1024)
    fast.save_pretrained(HERE / "tokenizer")
    # Name the class every transformers release knows, so older installs load it too.
    cfg_path = HERE / "tokenizer" / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    print(f"{len(paras)} paragraphs, vocab {fast.vocab_size}")


if __name__ == "__main__":
    main()
