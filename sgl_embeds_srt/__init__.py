"""sgl_embeds_srt: the server side of sgl_embeds, an SGLang plugin (``plugin:register``, loaded by
every SGLang process and by ``sglang.Engine``). It never imports the client package ``sgl_embeds``;
what both sides share is the package ``sgl_embeds_protocol``.
"""
