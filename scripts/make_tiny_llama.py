#!/usr/bin/env python3
"""Build a tiny random-weight Llama model and its tokenizer in a local folder.

No hub access is needed or used: the byte-level BPE tokenizer is trained here on a
synthetic corpus generated from a fixed word list with one seeded
`numpy.random.Generator`, and the model weights are drawn with a seeded torch generator.
The result loads with `transformers.AutoModelForCausalLM` / `AutoTokenizer` and serves
with vLLM (CPU or GPU); its outputs are gibberish, which is all the integration tests need
(they pin output lengths with `max_tokens` + `ignore_eos`).

Shape (defaults): 2 layers, hidden 128, 2 heads of 64 (vLLM's CPU attention wants a
head size it has kernels for; 64 is one), 1 KV head, MLP 256, vocab 1,024, context 4,096
tokens, bfloat16 weights (~0.6 MB).

Usage:
    python scripts/make_tiny_llama.py OUT_DIR [--seed 0] [--vocab-size 1024] [--layers 2]

Needs `transformers`, `tokenizers` and `torch` (the `rps_astro_cli[transformers]` extra, or
the vLLM venv). Exit code 2 on a bad argument.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

_WORDS = (
    "the a an of to in and is was for on with as by at from that this it be are were "
    "model token request image video text queue batch prefill decode cache block engine "
    "schedule latency time first last next small large fast slow wait run stop start "
    "sand pebble rock river stone water light dark day night red green blue one two three "
    "four five six seven eight nine ten hello world question answer please write tell me "
    "about story code python list number table data user system assistant why how what "
    "when where who which can could would should will may might must do does did have has"
).split()

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + (message['content'] if message['content'] is string "
    "else message['content'] | map(attribute='text') | select('defined') | join(' ')) + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def _corpus(n_lines: int, seed: int) -> list[str]:
    import numpy as np

    rng = np.random.default_rng(seed)
    lines = []
    for _ in range(n_lines):
        k = int(rng.integers(4, 24))
        idx = rng.integers(0, len(_WORDS), size=k)
        lines.append(" ".join(_WORDS[i] for i in idx))
    return lines


def build_tokenizer(out: Path, vocab_size: int, seed: int):
    """Train a byte-level BPE tokenizer with `vocab_size` entries and save it as a
    `PreTrainedTokenizerFast` (bos `<s>` = 1, eos `</s>` = 2, unk `<unk>` = 0) with a
    minimal chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(4000, seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        pad_token="</s>", model_max_length=4096,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))
    return fast


def build_model(out: Path, vocab_size: int, layers: int, seed: int) -> None:
    """Random-weight `LlamaForCausalLM` (see module docstring for the shape)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab_size, hidden_size=128, intermediate_size=256,
        num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
        head_dim=64, max_position_embeddings=4096, rms_norm_eps=1e-5,
        bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(str(out), safe_serialization=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir", help="Folder to write (created; existing files are overwritten).")
    ap.add_argument("--seed", type=int, default=0, help="Seed for the corpus and the weights.")
    ap.add_argument("--vocab-size", type=int, default=1024, help="Tokenizer/model vocabulary (≥ 300).")
    ap.add_argument("--layers", type=int, default=2, help="Decoder layers (≥ 1).")
    a = ap.parse_args(argv)
    if a.vocab_size < 300:
        print("error: --vocab-size must be ≥ 300 (256 byte symbols + specials + merges)", file=sys.stderr)
        return 2
    if a.layers < 1:
        print("error: --layers must be ≥ 1", file=sys.stderr)
        return 2
    try:
        import tokenizers  # noqa: F401
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as exc:
        print(f"error: {exc.name} is not installed; pip install 'rps_astro_cli[transformers]'",
              file=sys.stderr)
        return 2
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out, a.vocab_size, a.seed)
    build_model(out, a.vocab_size, a.layers, a.seed)
    (out / "ASTRO_TINY_MODEL.json").write_text(json.dumps(
        {"what": "random-weight tiny Llama for tests", "seed": a.seed,
         "vocab_size": a.vocab_size, "layers": a.layers}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
