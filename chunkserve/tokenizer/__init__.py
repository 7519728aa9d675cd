"""The tokenizer a model ships with (a HF tokenizer.json or a GGUF vocabulary) and its chat
template."""
