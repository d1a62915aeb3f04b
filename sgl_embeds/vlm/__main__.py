"""``python -m sgl_embeds.vlm split SRC DST``: split a LLaVA-1.5, -NeXT or -OneVision checkpoint
(see ``checkpoint.py``)."""

from __future__ import annotations

import argparse
import sys
import time

from sgl_embeds.vlm.checkpoint import split


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sgl_embeds.vlm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("split", help="write DST/llm (for SGLang) and DST/vision (for load_encoder)")
    p.add_argument("src", help="an HF LLaVA-1.5, LLaVA-NeXT or LLaVA-OneVision directory "
                   "(safetensors)")
    p.add_argument("dst", help="output directory")
    args = parser.parse_args(argv)
    start = time.monotonic()
    try:
        llm, vision = split(args.src, args.dst)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"[split] done in {time.monotonic() - start:.1f} s\n"
          f"  serve:  python -m sglang.launch_server --model-path {llm}\n"
          f"  encode: sgl_embeds.vlm.load_encoder({str(vision)!r})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
