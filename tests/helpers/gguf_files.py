"""Tiny GGUF files written with the `gguf` package under llama.cpp's tensor names (tests that load
models as blocks: test_gguf_families.py, test_requant.py)."""
import numpy as np

GEMMA = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
         "post_feedforward_layernorm": "post_ffw_norm"}
NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
         "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
         "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}


def write_gguf(hf, path, arch: str, skip=()):
    import gguf

    """hf's weights under llama.cpp's names: matrices as Q8_0 blocks, vectors as F32 (Gemma's
    norms as 1 + w, as llama.cpp's converter writes them)."""
    w = gguf.GGUFWriter(str(path), arch)
    names = {**NAMES, **GEMMA} if arch == "gemma3" else NAMES
    for name, t in hf.state_dict().items():
        name = name.removeprefix("model.")
        if arch == "gemma3" and name.endswith("norm.weight"):
            t = t + 1
        if name.startswith("layers."):
            _, i, rest = name.split(".", 2)
            ours, kind = rest.rsplit(".", 1)
            name = f"blk.{i}.{names[ours]}.{kind}"
        else:
            name = {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
                    "lm_head.weight": "output.weight"}[name]
        if any(s in name for s in skip) or (name == "output.weight" and hf.config.tie_word_embeddings):
            continue
        data = t.float().numpy()
        if data.ndim == 2:
            q = gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, data.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
