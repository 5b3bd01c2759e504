"""Which CUDA-graph capture of the engine's body works here: each capture mode in its own process (a failed capture
leaves the CUDA context unusable), a tiny Qwen3 engine, three training steps of one shape (eager, capture, replay).

    python3 benchmarks/probe_graphs.py            # prints one line per mode and, last, the first mode that worked"""

from __future__ import annotations

import os
import subprocess
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def child() -> None:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from loraplex.models.presets import TINY_SHAPES
    from loraplex.workers.engine import Engine

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=512, **TINY_SHAPES["tiny"])).to("cuda", torch.bfloat16)
    model.requires_grad_(False)
    engine = Engine(model, num_slots=4, max_rank=8, device="cuda", fused_elementwise=True, cuda_graphs=True)
    engine.create_adapter("a", 8, 16.0, 0)
    data = [{"model_input": list(range(1, 101)), "loss_fn_inputs": {"target_tokens": list(range(2, 102)),
             "weights": [1.0] * 100}}]  # fmt: skip
    try:
        for _ in range(3):
            out = engine.forward_backward([engine.prepare("a", data, "cross_entropy", None, False)])
            engine.optim_step([("a", {"learning_rate": 1e-3})])
        torch.cuda.synchronize()
        assert engine.graphs is not None
        print("OK", engine.graphs.captures, engine.graphs.replays, out[0]["metrics"]["loss:sum"])
    except Exception:
        print("FAIL", "".join(traceback.format_exc().splitlines(keepends=True)[-14:]))


def main() -> None:
    if os.environ.get("PROBE_CHILD"):
        child()
        return
    first = None
    variants = [("thread_local", "capture"), ("global", "capture"), ("relaxed", "capture"), ("thread_local", "default"),
                ("global", "default")]  # fmt: skip
    for mode, statics in variants:
        env = {**os.environ, "PROBE_CHILD": "1", "LORAPLEX_GRAPH_CAPTURE": mode, "LORAPLEX_GRAPH_STATICS": statics}
        run = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300)
        lines = (run.stdout + run.stderr).strip()
        print(f"== {mode} {statics}: {lines[-2500:]}", flush=True)
        if first is None and "\nOK " in "\n" + run.stdout:
            first = f"{mode} {statics}"
    print(first or "none")


if __name__ == "__main__":
    main()
