"""Regenerates chunkserve/data/tokenizer/ from the default model's GGUF (SmolLM2-135M-Instruct).

Model presets run with random weights and have no tokenizer of their own; the engine gives them
this one (see Tokenizer.from_bundled). It is SmolLM2's tokenizer exactly as chunkserve rebuilds it
from the GGUF, so the bundled copy and the GGUF's encode, decode and template identically
(tests/test_dummy_weights.py checks it). The output is byte-for-byte reproducible.

    .venv/bin/python tools/export_tokenizer.py
"""
from __future__ import annotations

import gzip
import json
import os

from chunkserve.tokenizer.gguf_vocab import load_gguf_tokenizer
from chunkserve.model.loaders.source import resolve_model_path
from chunkserve.tokenizer.tokenizer import BUNDLED_TOKENIZER_DIR


def main() -> None:
    spec = load_gguf_tokenizer(resolve_model_path("smollm2-135m"))
    tok = spec.tokenizer

    def text(token_id: int | None) -> str | None:
        return None if token_id is None else tok.id_to_token(token_id)

    config = {
        "bos_token": text(spec.bos_token_id),
        "eos_token": text(spec.eos_token_id),
        "add_bos_token": spec.add_bos,
        "add_eos_token": spec.add_eos,
        "chat_template": spec.chat_template,
    }
    os.makedirs(BUNDLED_TOKENIZER_DIR, exist_ok=True)
    raw = tok.to_str(pretty=False).encode("utf-8")
    # mtime=0 and no file name in the header: the same tokenizer gives the same bytes.
    with open(os.path.join(BUNDLED_TOKENIZER_DIR, "tokenizer.json.gz"), "wb") as f:
        with gzip.GzipFile(filename="", mode="wb", fileobj=f, compresslevel=9, mtime=0) as gz:
            gz.write(raw)
    with open(os.path.join(BUNDLED_TOKENIZER_DIR, "tokenizer_config.json"), "w",
              encoding="utf-8") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
        f.write("\n")
    print(f"wrote {BUNDLED_TOKENIZER_DIR} ({len(raw):,} bytes of tokenizer.json before gzip)")


if __name__ == "__main__":
    main()
