"""Does a tenant's request time say whether another tenant sent the same span? (docs/reliability.md,
"Tenants")

One server of the demo model (float32) launched by ``python -m sgl_embeds serve --tenants FILE``
with two tenants, alice and bob. Each trial draws a new span (``--rows`` rows of the demo model's
token embeddings, a different random pick per trial) inside the same short prompt, and is one of
three cases, the cases taking turns trial by trial:

* ``bob, alice sent it``: alice sends the prompt (not timed), then bob sends it (timed): the case
  a cross-tenant cache hit would make fast;
* ``bob, nobody sent it``: bob sends it (timed), never sent before;
* ``alice again``: alice sends it twice and her second is timed: her own cache hit, what the
  channel would look like were it open.

Each request asks for one new token, so its time is the prefill's (TTFT). If tenants are kept
apart, the first two cases time alike and apart from the third.

    python benchmarks/bench_tenant_timing.py [--rows 384] [--trials 60]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import requests
import torch

from common import demo_dir, embedding_table, pct, p50, provenance, save, table
from sgl_embeds_protocol import wire
from sgl_embeds_testing.server import Server

TENANTS = {"key-alice": "alice", "key-bob": "bob"}
ALICE, BOB = ({"Authorization": f"Bearer {key}"} for key in TENANTS)
CASES = ["bob, alice sent it", "bob, nobody sent it", "alice again"]


def send(url: str, rows: torch.Tensor, headers: dict) -> tuple[float, int]:
    """(seconds, cached tokens) of the prompt with ``rows`` as its span, one new token."""
    payload = {"input_segments": [{"type": "text", "text": "Describe this: "},
                                  {"type": "embeds", "embeds": wire.encode_tensor(rows)},
                                  {"type": "text", "text": " in one word."}],
               "sampling_params": {"temperature": 0, "max_new_tokens": 1}}
    start = time.perf_counter()
    r = requests.post(url + "/generate", json=payload, headers=headers, timeout=300)
    seconds = time.perf_counter() - start
    r.raise_for_status()
    return seconds, r.json()["meta_info"]["cached_tokens"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=384)
    parser.add_argument("--trials", type=int, default=60)
    args = parser.parse_args()
    model = demo_dir()
    vocab = embedding_table(model)
    generator = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory() as folder:
        table_file = Path(folder) / "tenants.json"
        table_file.write_text(json.dumps(TENANTS))
        server = Server(model, via_serve=True, extra_args=["--enable-cache-report", "--tenants", str(table_file)])
        server.start()
        try:
            send(server.url, vocab[:args.rows], ALICE)  # warm-up
            times: dict[str, list[float]] = {case: [] for case in CASES}
            cached: dict[str, list[int]] = {case: [] for case in CASES}
            for trial in range(args.trials):
                rows = vocab[torch.randint(0, vocab.shape[0], (args.rows,), generator=generator)]
                case = CASES[trial % len(CASES)]
                if case != "bob, nobody sent it":
                    send(server.url, rows, ALICE)
                seconds, hit = send(server.url, rows, ALICE if case == "alice again" else BOB)
                times[case].append(seconds)
                cached[case].append(hit)
        finally:
            server.stop()
    rows = [[case, len(times[case]), 1000 * p50(times[case]), 1000 * pct(times[case], 0.1),
             1000 * pct(times[case], 0.9), max(cached[case])] for case in CASES]
    text = table(f"A tenant's TTFT for a {args.rows}-row span prompt (ms)",
                 ["case", "trials", "p50", "p10", "p90", "most cached tokens"], rows)
    text += f"\n\n{provenance()}"
    print(f"\n{provenance()}")
    save("tenant_timing", {"rows": args.rows, "trials": args.trials, "times_s": times, "cached": cached,
                           "provenance": provenance()}, text)


if __name__ == "__main__":
    main()
