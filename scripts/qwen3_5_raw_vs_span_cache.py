"""Measures, by hand, the cached count of repeats on Qwen3.5: a raw image (SGLang's own path,
the tower running) against the same prompt with the image as a span (issue #36). Starts one
tiny Qwen3.5 server with working vision weights and the pooled ``qwen3_5`` server's flags
(tests/conftest.py), sends each prompt three times from an empty cache both ways, prints the
prompt length, each repeat's ``cached_tokens`` and the first answer's ids, and stops the server.

    PYTHONPATH=. .venv/bin/python scripts/qwen3_5_raw_vs_span_cache.py
"""

import sys
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from conftest import QWEN3_5_ARGS, QWEN_VL_ARGS  # noqa: E402
from qwen_vl_harness import chat_text, grid_span, span_segments  # noqa: E402

from sgl_embeds_testing.qwen_vl import png_base64, sample_images, tiny_qwen3_5_dir  # noqa: E402
from sgl_embeds_testing.server import Server  # noqa: E402

PROMPTS = [("describe it in a few words", ("disc",)), ("describe what you see", ("disc",)),
           ("what is in the two pictures and how do they differ", ("disc", "square"))]
GREEDY_10 = {"temperature": 0.0, "max_new_tokens": 10}


def main() -> None:
    checkpoint = tiny_qwen3_5_dir()
    server = Server(checkpoint, via_serve=True, env={"SGLANG_MAMBA_CONV_DTYPE": "float32"},
                    extra_args=[*QWEN_VL_ARGS, *QWEN3_5_ARGS]).start()
    print(f"server pid {server.proc.pid}: {' '.join(QWEN_VL_ARGS + QWEN3_5_ARGS)}", flush=True)
    try:
        for question, names in PROMPTS:
            text = chat_text(checkpoint, question, len(names))
            images = [sample_images()[name] for name in names]
            raw = {"text": text, "image_data": [png_base64(image) for image in images]}
            spans = {"input_segments": span_segments(text, [grid_span(checkpoint, image) for image in images])}
            for label, body in (("raw image", raw), ("span", spans)):
                requests.post(server.url + "/flush_cache", timeout=60).raise_for_status()
                outs = []
                for _ in range(3):
                    res = requests.post(server.url + "/generate", json={**body, "sampling_params": GREEDY_10},
                                        timeout=300)
                    res.raise_for_status()
                    outs.append(res.json())
                print(f"{question!r} {label}: prompt {outs[0]['meta_info']['prompt_tokens']}, cached "
                      f"{[out['meta_info']['cached_tokens'] for out in outs]}, ids {outs[0]['output_ids']}",
                      flush=True)
    finally:
        server.stop()


if __name__ == "__main__":
    main()
