"""The GGUF metadata keys every decoder-only family's file carries, as llama.cpp's converter writes them from an
HF config (the test GGUF writers add their family's own keys after these)."""

from __future__ import annotations

from gguf import GGUFWriter


def add_decoder_metadata(writer: GGUFWriter, config) -> None:
    """Layer count, context, widths, heads, head size, norm epsilon, vocabulary and BOS/EOS of `config`."""
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
