"""Which token ids end a reply."""
from __future__ import annotations

# Special tokens that end a generation, by their text (llama.cpp's end-of-generation set, roughly):
# counted as EOS wherever the tokenizer has one of them as an added token.
END_OF_GENERATION = ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<end_of_turn>",
                     "<|end|>", "<EOT>")


def eos_ids(tokenizer, hf_config) -> set[int]:
    """The tokenizer's and the config's EOS ids, and every added token in END_OF_GENERATION: a GGUF
    names one eos id (Qwen's <|im_end|>), yet a reply that reaches <|endoftext|> is over, and
    transformers stops there too (generation_config.json)."""
    ids = set()
    for src in (tokenizer.eos_token_id, getattr(hf_config, "eos_token_id", None)):
        if isinstance(src, int):
            ids.add(src)
        elif isinstance(src, (list, tuple)):
            ids.update(int(i) for i in src)
    added = getattr(tokenizer, "added_tokens_encoder", None) or {}
    ids.update(added[t] for t in END_OF_GENERATION if t in added)
    return ids
