"""What a handle fallback costs: a request naming a handle the server does not hold is refused
(400 ``UnknownSpanHandle``) and sent again with the rows inline and ``keep_spans``.

One plugin server (demo model, float32), one span of N rows (the model's own embedding rows),
its prefix cached. Timed over the same HTTP client, 10 requests each, medians: the refusal, a
request with the rows inline (``keep_spans``), a request by handle. A fallback costs the refusal
plus the inline request.

    python benchmarks/bench_handle_fallback.py [--rows 1024]
"""

from __future__ import annotations

import argparse
import time

from sglang.utils import http_request

from common import commit, demo_dir, embedding_table, machine, p50, provenance, save, server, table
from sgl_embeds_protocol import keys, wire


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1024)
    args = ap.parse_args()
    rows = embedding_table(demo_dir())[1000:1000 + args.rows].contiguous()
    handle = keys.content_key(rows)
    greedy = {"temperature": 0, "max_new_tokens": 1}

    def request(span: dict, i: int, **extra) -> tuple[float, int]:
        body = {"input_segments": [{"type": "embeds", "embeds": span}, {"type": "text", "text": f" question {i}?"}],
                "sampling_params": greedy, **extra}
        t0 = time.perf_counter()
        status = http_request(url + "/generate", json=body).status_code
        return time.perf_counter() - t0, status

    with server(demo_dir(), True, ["--enable-cache-report"]) as s:
        url = s.url
        refused = [request({"handle": handle}, i) for i in range(10)]  # never sent: unknown
        assert all(status == 400 for _, status in refused)
        inline = [request(wire.encode_tensor(rows), i, keep_spans=True) for i in range(11)][1:]  # first: prefill
        by_handle = [request({"handle": handle}, i) for i in range(10)]
    times = {"refused (UnknownSpanHandle)": refused, "rows inline + keep_spans": inline, "by handle": by_handle}
    out = [[name, p50([t for t, _ in v]) * 1000] for name, v in times.items()]
    text = f"{provenance()}\nSmolLM2-135M-Instruct float32; a cached {args.rows}-row span + a new question, 1 new token\n"
    text += table("one request of each kind (ms, median of 10)", ["request", "ms"], out)
    save("handle_fallback", {"commit": commit(), "machine": machine(), "rows": args.rows,
                             "ms": {name: [t * 1000 for t, _ in v] for name, v in times.items()}}, text)


if __name__ == "__main__":
    main()
