"""A request's size is checked before anything is built
from it, against the real stack (redis-server, SQLite, the gateway under uvicorn, one CPU pool on the tiny model).

- 89- and 201-byte Tinker forward_backward bodies declaring sparse tensors of 2^24 zeros: a 404 for an adapter that
  is not the caller's and a 413 naming the limit for its own, at once, the gateway's peak memory unmoved.
- a 31 MB OpenAI prompt (and ones just over the limits) is a 413 at once, never tokenized; the victim trains on.
- stop sequences (count, length) and sample work (samples x (prompt + max_tokens)) bounded alike on the native,
  Tinker and OpenAI sampling routes; a usual RL group still passes.
- get_info's tokenizer_id is the base model's name, never a server folder, except on a loopback-only stack."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from loraplex.api.tinker.model_info import tokenizer_id
from loraplex.api.tinker.proto import pb
from loraplex.launch.embedded import local_tokenizer_folder
from tests.security.harness import check_victim, tenant_key

PROTOBUF = {"Content-Type": "application/x-protobuf"}
# The prompt attacker: argv[3] OpenAI prompts of 31 MB (again every second, as a client retrying it);
# one JSON line per answer. A flood of such bodies at the loopback's rate is the body limit's matter, not this row's.
ATTACK = """
import json, sys, time, httpx
url, key, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
body = json.dumps({"model": "tiny", "prompt": "lorem ipsum " * (31_000_000 // 12), "max_tokens": 4}).encode()
with httpx.Client(base_url=url, headers={"X-API-Key": key, "Content-Type": "application/json"}, timeout=60) as c:
    for i in range(count):
        time.sleep(1.0 if i else 0.0)
        start = time.perf_counter()
        r = c.post("/v1/completions", content=body)
        print(json.dumps({"status": r.status_code, "seconds": time.perf_counter() - start, "text": r.text[:300]}))
"""
MB = 2**20


def _sparse_zeros(tensor, n: int) -> None:
    """A [1, n] float32 sparse CSR tensor with no values: a few bytes declaring n zeros."""
    tensor.dtype = pb.DTYPE_FLOAT32
    tensor.shape.extend([1, n])
    tensor.sparse_csr.crow_indices = np.zeros(2, dtype="<i8").tobytes()


def sparse_bomb(model_id: str, tensors: int) -> bytes:
    """A ForwardBackwardRequest (the SDK's own protobuf schema) of one 1-token datum whose loss inputs each declare
    2^24 zeros: 89 bytes with one tensor, 175 with three (as much as a 201-byte body can declare)."""
    msg = pb.ForwardBackwardRequest(model_id=model_id, seq_id=0, loss_fn="cross_entropy")
    datum = msg.data.add()
    datum.model_input.add().encoded_text.tokens = np.array([5], dtype="<i4").tobytes()
    for name in ("target_tokens", "weights", "logprobs", "advantages", "mask")[:tensors]:
        _sparse_zeros(datum.loss_fn_inputs[name], 2**24)
    return msg.SerializeToString()


def _descendants(pid: int) -> list[int]:
    children = Path(f"/proc/{pid}/task/{pid}/children")
    found = [int(p) for p in children.read_text().split()] if children.exists() else []
    return [pid] + [d for c in found for d in _descendants(c)]


def gateway_peak_mb(stack) -> float:
    """The gateway's peak resident memory (VmHWM; the uvicorn process and any workers it forked), MiB."""
    total = 0
    for pid in _descendants(stack.child("api").pid):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                total += int(line.split()[1])
    return total / 1024


@pytest.fixture(scope="module")
def attacker(stack):
    key = tenant_key(stack, "attacker")
    with httpx.Client(base_url=stack.base_url, headers={"X-API-Key": key}, timeout=60) as client:
        yield client


def _tinker_session(client: httpx.Client) -> str:
    body = {"tags": [], "user_metadata": None, "sdk_version": "0.38.0", "type": "create_session"}
    response = client.post("/api/v1/create_session", json=body)
    assert response.status_code == 200, response.text
    return response.json()["session_id"]


@pytest.fixture(scope="module")
def tinker_ids(attacker):
    """(an adapter of the attacker's, a Tinker sampling session over the base model)."""
    sid = _tinker_session(attacker)
    body = {"session_id": sid, "model_seq_id": 0, "base_model": "tiny", "lora_config": {"rank": 4}}
    created = attacker.post("/api/v1/create_model", json=body)
    assert created.status_code == 200, created.text
    model_id = f"{sid}:train:0"
    sampler = attacker.post("/api/v1/create_sampling_session", json={"session_id": sid, "sampling_session_seq_id": 0})
    assert sampler.status_code == 200, sampler.text
    return model_id, sampler.json()["sampling_session_id"]


def _expect(response: httpx.Response, status: int, *words: str) -> None:
    assert response.status_code == status, (response.status_code, response.text[:500])
    text = response.text
    assert all(w in text for w in words), text[:500]
    assert "Traceback" not in text


# --- sparse tensors ---------------------------------------------------------------------------------------------------


def test_sparse_tensor_bombs_are_refused_before_they_are_expanded(stack, attacker, tinker_ids) -> None:
    model_id, _ = tinker_ids
    small, large = sparse_bomb("no-such:tr:0", 1), sparse_bomb("no-such:tr:0", 3)
    assert len(small) == 89 and len(large) <= 201
    before = gateway_peak_mb(stack)
    for body in (small, large):  # an adapter that does not exist: 404 before any tensor is looked at
        start = time.perf_counter()
        _expect(attacker.post("/api/v1/forward_backward", content=body, headers=PROTOBUF), 404)
        assert time.perf_counter() - start < 1.0
    own = sparse_bomb(model_id, 3)
    for seq_id, body in enumerate((own, sparse_bomb(model_id, 1))):  # its own adapter: 413 naming the limit
        msg = pb.ForwardBackwardRequest.FromString(body)
        msg.seq_id = seq_id
        start = time.perf_counter()
        response = attacker.post("/api/v1/forward_backward", content=msg.SerializeToString(), headers=PROTOBUF)
        _expect(response, 413, "LORAPLEX_MAX_TOKENS_PER_DATUM", str(2**24))
        assert time.perf_counter() - start < 1.0
    grown = gateway_peak_mb(stack) - before
    assert grown < 50, f"the gateway's peak memory grew by {grown:.0f} MiB"


# --- OpenAI prompts ---------------------------------------------------------------------------------------------------


def test_a_31_mb_openai_prompt_is_refused_before_tokenizing_and_the_victim_trains_on(stack, attacker, victim) -> None:
    alone = victim.alone(10)
    with victim.training() as during:
        # The attacker is a process of its own (another client machine).
        attack = subprocess.run([sys.executable, "-c", ATTACK, stack.base_url, attacker.headers["X-API-Key"], "3"],
                                capture_output=True, text=True, timeout=120)  # fmt: skip
    assert attack.returncode == 0, attack.stderr[-2000:]
    answers = [json.loads(line) for line in attack.stdout.splitlines()]
    assert answers and all(a["status"] == 413 and "LORAPLEX_MAX_PROMPT_BYTES" in a["text"] for a in answers), answers
    assert max(a["seconds"] for a in answers) < 5.0, answers  # was 30-42 s of tokenizing
    check_victim(alone, during, label=f"{len(answers)} OpenAI prompts of 31 MB")


def test_openai_prompts_and_chats_over_their_limits_are_413_naming_them(stack, attacker) -> None:
    per_prompt = stack.settings.resolved_max_prompt_bytes  # 16 x max_tokens_per_datum: 512 KiB
    in_all = stack.settings.resolved_max_prompt_bytes_per_request  # 16 x max_sample_tokens_per_request: 1 MiB
    over = "a" * (per_prompt + 1)
    _expect(attacker.post("/v1/completions", json={"model": "tiny", "prompt": over}), 413, "LORAPLEX_MAX_PROMPT_BYTES")
    several = ["b" * (per_prompt - 10)] * (in_all // per_prompt + 1)
    _expect(attacker.post("/v1/completions", json={"model": "tiny", "prompt": several}), 413,
            "LORAPLEX_MAX_PROMPT_BYTES_PER_REQUEST")  # fmt: skip
    many = ["c"] * (stack.settings.max_samples_per_request + 1)
    _expect(attacker.post("/v1/completions", json={"model": "tiny", "prompt": many}), 400,
            "LORAPLEX_MAX_SAMPLES_PER_REQUEST")  # fmt: skip
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}] * (stack.settings.max_chat_messages + 1)}
    _expect(attacker.post("/v1/chat/completions", json=chat), 413, "LORAPLEX_MAX_CHAT_MESSAGES")
    long_chat = {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": over}]}]}
    _expect(attacker.post("/v1/chat/completions", json=long_chat), 413, "LORAPLEX_MAX_PROMPT_BYTES")


# --- sample work and stops --------------------------------------------------------------------------------------------


def _native_sampler(client: httpx.Client) -> str:
    created = client.post("/v1/samplers", json={})
    assert created.status_code == 201, created.text
    return created.json()["sampler_id"]


def test_a_million_stop_strings_are_refused_at_once(stack, attacker) -> None:
    sampler_id = _native_sampler(attacker)
    body = json.dumps({"seq_id": 0, "prompt": [1, 2, 3], "stop": [f"st{i:07d}" for i in range(1_000_000)]}).encode()
    assert len(body) > 12 * MB  # a million stop strings
    start = time.perf_counter()
    response = attacker.post(f"/v1/samplers/{sampler_id}/sample", content=body,
                             headers={"Content-Type": "application/json"})  # fmt: skip
    _expect(response, 413, "LORAPLEX_MAX_STOP_SEQUENCES")
    assert time.perf_counter() - start < 5.0


def test_stop_and_sample_work_bounds_hold_on_every_sampling_route(stack, attacker, tinker_ids) -> None:
    s = stack.settings
    too_many = [f"x{i}" for i in range(s.max_stop_sequences + 1)]
    too_long = ["y" * (s.max_stop_chars + 1)]
    too_many_ids = list(range(s.max_stop_sequences + 1))
    big = {"num_samples": 64, "max_tokens": 4000}  # 256,000 tokens of sampling

    sampler_id = _native_sampler(attacker)
    native = f"/v1/samplers/{sampler_id}/sample"
    for seq_id, (extra, words) in enumerate([
        ({"stop": too_many}, ["LORAPLEX_MAX_STOP_SEQUENCES"]),
        ({"stop": too_many_ids}, ["LORAPLEX_MAX_STOP_SEQUENCES"]),
        ({"stop": too_long}, ["LORAPLEX_MAX_STOP_CHARS"]),
        ({**big, "max_tokens": 4000}, ["LORAPLEX_MAX_SAMPLE_TOKENS_PER_REQUEST"]),
    ]):  # fmt: skip
        _expect(attacker.post(native, json={"seq_id": seq_id, "prompt": [1, 2, 3], **extra}), 413, *words)

    _, tinker_sampler = tinker_ids
    for seq_id, (params, n, words) in enumerate([
        ({"stop": too_many, "max_tokens": 4}, 1, ["LORAPLEX_MAX_STOP_SEQUENCES"]),
        ({"stop": too_many_ids, "max_tokens": 4}, 1, ["LORAPLEX_MAX_STOP_SEQUENCES"]),
        ({"stop": too_long, "max_tokens": 4}, 1, ["LORAPLEX_MAX_STOP_CHARS"]),
        ({"max_tokens": 4000}, 64, ["LORAPLEX_MAX_SAMPLE_TOKENS_PER_REQUEST"]),
    ]):  # fmt: skip
        body = {"sampling_session_id": tinker_sampler, "seq_id": seq_id, "num_samples": n,
                "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]}, "sampling_params": params}  # fmt: skip
        _expect(attacker.post("/api/v1/asample", json=body), 413, *words)

    for extra, words in [
        ({"stop": too_many}, ["LORAPLEX_MAX_STOP_SEQUENCES"]),
        ({"stop": too_long}, ["LORAPLEX_MAX_STOP_CHARS"]),
        ({"n": 64, "max_tokens": 4000}, ["LORAPLEX_MAX_SAMPLE_TOKENS_PER_REQUEST"]),
    ]:
        _expect(attacker.post("/v1/completions", json={"model": "tiny", "prompt": "hello", **extra}), 413, *words)


def test_a_usual_rl_group_still_samples(stack, attacker, tinker_ids) -> None:
    """16 samples x (512 prompt + 1,024 new) is within the default sample work (65,536): accepted (and run)."""
    _, tinker_sampler = tinker_ids
    body = {"sampling_session_id": tinker_sampler, "seq_id": 100, "num_samples": 16,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [(7 * i) % 200 + 3 for i in range(512)]}]},
            "sampling_params": {"max_tokens": 1024, "stop": ["\n\n"] * 4, "temperature": 1.0, "seed": 1}}  # fmt: skip
    response = attacker.post("/api/v1/asample", json=body)
    assert response.status_code == 200, response.text
    assert len(response.json()["sample_sequence_ids"]) == 16


# --- server paths -----------------------------------------------------------------------------------------------------


def test_get_info_names_no_server_path_unless_every_client_shares_the_machine(stack, attacker, tinker_ids) -> None:
    """A gateway on a non-loopback address answers a name (tests/integration/test_tinker_routes.py checks the route
    itself); the embedded stack on the loopback names the local folder, which its clients can read anyway, so the
    SDK's get_tokenizer() works offline."""
    model_id, _ = tinker_ids
    info = attacker.post("/api/v1/get_info", json={"model_id": model_id})
    assert info.status_code == 200, info.text
    assert info.json()["model_data"]["tokenizer_id"] == str(stack.settings.resolved_model_cache / "tiny")
    served = stack.settings.model_copy(update={"api_host": "0.0.0.0", "tokenizer_id": ""})
    assert local_tokenizer_folder(served) == ""
    assert tokenizer_id(served, served.base_model) == "tiny"
