"""The files ``split`` writes in ``DST/vision``, named once for the encoders that read them and
for ``load_encoder``, which picks the encoder by the settings' ``"format"``."""

CONFIG_NAME = "sgl_embeds_vision.json"  # the vision half's settings
WEIGHTS_NAME = "model.safetensors"  # tower, projector (and image_newline)
LLAVA_FORMAT = "sgl_embeds.llava_vision/1"  # LLaVA-1.5: tower.VisionConfig
ANYRES_FORMAT = "sgl_embeds.llava_anyres_vision/1"  # LLaVA-NeXT / OneVision: anyres.AnyresConfig
