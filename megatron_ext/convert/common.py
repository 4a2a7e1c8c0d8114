"""What every Hugging Face layout shares, below both hf.py and kimi_linear.py so that neither imports the other's
internals: the error type conversion raises and the config fields the DeepSeek-V3 family names the same way."""

from __future__ import annotations


class ConversionError(ValueError):
    """Bad conversion input; the message names the tensor and/or file."""


def backbone_fields(text: dict) -> dict:
    """The preset fields every DeepSeek-V3-family config (Kimi Linear's too) names the same way: sizes and MLA."""
    return dict(num_layers=text["num_hidden_layers"], hidden_size=text["hidden_size"],
                ffn_hidden_size=text["intermediate_size"], num_attention_heads=text["num_attention_heads"],
                vocab_size=text["vocab_size"], q_lora_rank=text.get("q_lora_rank"), kv_lora_rank=text["kv_lora_rank"],
                qk_head_dim=text["qk_nope_head_dim"], qk_pos_emb_head_dim=text["qk_rope_head_dim"],
                v_head_dim=text["v_head_dim"])
