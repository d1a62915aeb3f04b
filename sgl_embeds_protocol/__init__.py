"""sgl_embeds_protocol: what the client (``sgl_embeds``) and the server (``sgl_embeds_srt``) share,
importing neither: the prompt model (``segments``), tensors on the wire (``wire``), the binary body
(``binary_body``), content keys (``keys``), bounded caches (``lru``), the VLM families (``family``),
the info message (``info``) and every SGLang internal either side patches or relies on, with its
guard (``targets``). This file imports nothing, so importing one module stays light.
"""
