"""``python -m sgl_embeds serve CHECKPOINT [--dry-run] [SGLang flags...]`` (also the console script
``sgl_embeds``): serve a checkpoint with the plugin (``serve.py``)."""

from __future__ import annotations

import sys

from sgl_embeds import serve

USAGE = "usage: sgl_embeds serve CHECKPOINT [--dry-run] [SGLang flags...]"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        return serve.main(argv[1:])
    print(USAGE if argv[:1] in (["-h"], ["--help"]) else f"error: unknown command\n{USAGE}",
          file=sys.stderr)
    return 0 if argv[:1] in (["-h"], ["--help"]) else 2


if __name__ == "__main__":
    sys.exit(main())
