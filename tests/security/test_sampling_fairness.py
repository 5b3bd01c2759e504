"""Through the real stack: a tenant's big sample request (64 samples x
hundreds of tokens, seconds of the CPU pool) while tenant B trains. The sampler runs it in slices between training
plans, so B's step stays under 2x its alone latency; and the request, held over many plans for longer than the
stale-entry claim's idle time (made short here), runs once, with every token counted once."""

from __future__ import annotations

import re
import time
import urllib.request

import pytest

from loraplex.client import ServiceClient
from loraplex.runtime.netutil import free_port
from tests.security.harness import Victim, check_victim, running_stack, tenant_key

SAMPLES, NEW_TOKENS = 64, 200


def _metric(port: int, name: str, **labels: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"{name}\{{(.*)\}} (\S+)$", line)
        if m and all(f'{k}="{v}"' in m.group(1) for k, v in labels.items()):
            total += float(m.group(2))
    return total


@pytest.fixture(scope="module")
def sampling_stack(tmp_path_factory):
    port = free_port()
    # A claim idle time far below the request's seconds in flight: a second execution would show. Eight rows
    # per decode step: on this CPU a step of 32 rows (~75 ms) is longer than the victim's whole step (one slice runs
    # at least one decode step; on a GPU a step of 32 rows is a few ms).
    with running_stack(tmp_path_factory.mktemp("sampling"), pool_metrics_port=port, stale_claim_ms=300,
                       sampler_max_rows=8) as stack:
        yield stack, port


def test_a_big_sample_request_runs_in_slices_beside_training_and_once(sampling_stack) -> None:
    stack, port = sampling_stack
    victim = Victim(stack)
    attacker = ServiceClient(stack.base_url, tenant_key(stack, "sampler"))
    try:
        sampler = attacker.create_sampling_client(base_model=stack.settings.base_model)
        # warm the sampler's path (first decode cache); its tokens count in the metric below (no stop: both of them)
        warm = sampler.sample([5, 6, 7], max_tokens=2, seed=1, stop=[]).result()
        warm_tokens = sum(len(s["tokens"]) for s in warm["sequences"])
        alone = victim.alone(10)
        with victim.training() as during:
            started = time.perf_counter()
            future = sampler.sample(list(range(10, 18)), num_samples=SAMPLES, max_tokens=NEW_TOKENS, seed=3, stop=[])
            result = future.result(timeout=240)
            took = time.perf_counter() - started
        print(f"the sample request took {took:.1f} s")
        assert took > 1.0  # long enough that a whole-plan sampler would have held the victim for seconds
        assert [len(s["tokens"]) for s in result["sequences"]] == [NEW_TOKENS] * SAMPLES
        # executed once: one sample request answered, its tokens counted once (plus the warm-up's)
        assert _metric(port, "loraplex_pool_requests_total", kind="sample") == 2
        assert _metric(port, "loraplex_pool_sampled_tokens_total") == SAMPLES * NEW_TOKENS + warm_tokens
        check_victim(alone, during, label="beside a 64 x 200 sample request")
    finally:
        attacker.close()
        victim.close()
