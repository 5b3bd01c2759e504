"""What a training call's JSON costs at both ends, the standard library beside what the client and the gateway use
(pure: no services): the client's non-finite check and writing of a forward_backward body, the gateway's reading
of it and its schema's validation, and the client's reading of an answer holding per-datum logprobs.

    python3 benchmarks/bench_json_body.py [--datums 8] [--tokens 512] [--calls 200]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.service_tenant import tenant_datums  # noqa: E402
from loraplex.client.json_body import check_finite, encode, first_non_finite  # noqa: E402
from loraplex.client.types import datum_json  # noqa: E402
from loraplex.runtime.json_read import parse_json  # noqa: E402
from loraplex.service.schemas import ForwardBackwardRequest  # noqa: E402


def median_ms(fn: Callable[[], Any], calls: int) -> float:
    fn()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--datums", type=int, default=8)
    p.add_argument("--tokens", type=int, default=512, help="tokens per datum")
    p.add_argument("--calls", type=int, default=200)
    args = p.parse_args()
    datums = tenant_datums(512, [args.tokens] * args.datums, 0)
    body = {"seq_id": 1, "data": [datum_json(d) for d in datums], "loss_fn": "cross_entropy", "loss_fn_config": {}}
    raw = json.dumps(body).encode()
    answer = json.dumps({"request_id": "r", "state": "complete", "result": {
        "logprobs": [[-float(i % 97) / 7 for i in range(args.tokens)] for _ in range(args.datums)],
        "metrics": {"loss:sum": 1234.5}}}).encode()  # fmt: skip
    print(f"{args.datums} datums x {args.tokens} tokens: body {len(raw):,} bytes, answer {len(answer):,} bytes; "
          f"median of {args.calls} calls, ms")  # fmt: skip
    rows = [
        ("client: non-finite check", lambda: first_non_finite(body), lambda: check_finite(body)),
        ("client: write the body", lambda: json.dumps(body).encode(), lambda: encode(body)),
        ("gateway: read the body", lambda: json.loads(raw), lambda: parse_json(raw)),
        ("client: read the answer", lambda: json.loads(answer), lambda: parse_json(answer)),
    ]
    print(f"{'':28} {'stdlib':>8} {'ours':>8}")
    for name, stdlib, ours in rows:
        print(f"{name:28} {median_ms(stdlib, args.calls):8.3f} {median_ms(ours, args.calls):8.3f}")
    parsed = parse_json(raw)
    print(
        f"{'gateway: validate the body':28} {'':>8} {median_ms(lambda: ForwardBackwardRequest.model_validate(parsed), args.calls):8.3f}"
    )


if __name__ == "__main__":
    main()
