"""sgl_embeds: precomputed embeddings as a first-class, cache-aware input of SGLang."""
