"""Model layers: norm, rotary embedding, paged attention."""
