"""sgl_embeds_srt: the server side of sgl_embeds (an SGLang plugin), and the modules both sides share.

The plugin entry point is ``sgl_embeds_srt.plugin:register``; SGLang loads it in every server
process and in ``sglang.Engine``. Nothing here imports the client package ``sgl_embeds``, so a
server never loads the DSL or its frontend hooks.

Shared with the client (they import neither side): ``segments`` (the prompt model), ``wire``
(tensors on the wire), ``keys`` (content keys of a span), ``lru`` (bounded caches), ``family`` (the served model's
family, written by the split, read by the plugin) and ``targets`` (every SGLang internal either side patches or relies on, with its guard).
This file imports nothing, so the client's import of a shared module stays light.
"""
