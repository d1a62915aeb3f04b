"""Weight-loader hook: a split LLM reads its weights in place, from the checkpoint's own files
that ``split`` linked into its folder, under the names its ``WEIGHTS_FILE`` gives them
(``sgl_embeds_protocol.split_weights``); any other model loads as SGLang loads it.
"""

from __future__ import annotations

import os
from typing import Any, Callable

from sgl_embeds_protocol.split_weights import renamed, weight_names


def weights_iterator(original: Callable, self: Any, source: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook of ``DefaultModelLoader._get_weights_iterator``: the (name, tensor) pairs of a
    split LLM's folder renamed to the LLM's names and filtered to them; a tensor the LLM names
    and no file holds is an error when the files are read to the end."""
    weights = original(self, source, *args, **kwargs)
    folder = source.model_or_path
    by_key = weight_names(folder) if isinstance(folder, str) and os.path.isdir(folder) else None
    if by_key is None:
        return weights
    prefix = source.prefix
    return renamed(weights, {prefix + key: prefix + name for key, name in by_key.items()}, folder)
