"""What the GPU image's torch offers for packed (varlen) attention with Qwen3's grouped-query heads, checked against
per-sequence causal SDPA, with forward+backward timings for 8 x 512 and ragged lengths (one H100/H200 call).

    python3 benchmarks/probe_attention.py [--flex] [--first-call]
        --flex: flex_attention too, compiled per shape
        --first-call: the dense path's first forward+backward at shapes it has not seen, per SDPA backend (cuDNN
        builds an execution plan per shape; flash builds nothing), against the same shape's steady time"""

# ruff: noqa: B023, B905 - each closure is called within its own loop iteration; a probe, run once

from __future__ import annotations

import inspect
import sys
import time

import torch
import torch.nn.functional as F


def reference(q, k, v, lens):  # type: ignore[no-untyped-def]
    out, start = [], 0
    rep = q.shape[1] // k.shape[1]
    for n in lens:
        qs, ks, vs = (t[start : start + n].transpose(0, 1) for t in (q, k, v))
        ks, vs = ks.repeat_interleave(rep, 0), vs.repeat_interleave(rep, 0)
        out.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True).transpose(0, 1))
        start += n
    return torch.cat(out)


def timed(fn, reps=20):  # type: ignore[no-untyped-def]
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e3


def compare(label, call, inputs, grad, want, want_grads):  # type: ignore[no-untyped-def]
    """One variant against the reference: its largest errors (output, input gradients) and its fwd+bwd time."""
    try:
        got = call()
        got_grads = torch.autograd.grad(got, inputs, grad)
        err = (got - want).abs().max().item()
        gerr = max((a - b).abs().max().item() for a, b in zip(got_grads, want_grads))
        ms = timed(lambda: torch.autograd.grad(call(), inputs, grad))
        print(f"  {label}: max err {err:.3g}, grad err {gerr:.3g}, fwd+bwd {ms:.3f} ms")
    except Exception as exc:  # noqa: BLE001 - a probe reports what fails
        print(f"  {label}: {type(exc).__name__}: {str(exc)[:300]}")


def first_calls() -> None:
    """Each backend's first fwd+bwd at (S sequences, L tokens) shapes new to the process, then that shape again: what a
    microbatch of a length not seen before pays once (eager steps, and each CUDA graph capture)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    hq, hkv, d = 32, 8, 128
    shapes = [(1, 512), (8, 512), (1, 37), (3, 300), (2, 1024), (16, 256), (1, 2048), (5, 411)]
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION):  # libraries loaded, context made
        x = torch.randn(1, hq, 64, d, device="cuda", dtype=torch.bfloat16)
        with sdpa_kernel(backend):
            F.scaled_dot_product_attention(x, x, x, is_causal=True)
    for offset, backend in enumerate((SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION)):
        for s_, l_ in shapes:
            l_ += offset  # a length the other backend's loop did not run, so no cache is shared
            q, k, v = (torch.randn(s_, h, l_, d, device="cuda", dtype=torch.bfloat16).requires_grad_()
                       for h in (hq, hkv, hkv))  # fmt: skip

            def call():  # type: ignore[no-untyped-def]
                with sdpa_kernel(backend):
                    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                return torch.autograd.grad(out, (q, k, v), torch.ones_like(out))

            torch.cuda.synchronize()
            t0 = time.perf_counter()
            call()
            torch.cuda.synchronize()
            first = (time.perf_counter() - t0) * 1e3
            print(f"  first call {backend.name} S={s_} L={l_}: {first:.2f} ms, steady {timed(call, reps=10):.3f} ms")


def main() -> None:
    print("torch", torch.__version__)
    if "--first-call" in sys.argv:
        first_calls()
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError as exc:
        print("no varlen_attn:", exc)
        varlen_attn = None
    if varlen_attn is not None:
        print("varlen_attn", inspect.signature(varlen_attn))
    hq, hkv, d = 32, 8, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, lens in (("uniform 8x512", [512] * 8), ("ragged", [37, 900, 128, 2048, 64, 511, 300, 108])):
        n = sum(lens)
        q, k, v = (torch.randn(n, h, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
                   for h in (hq, hkv, hkv))  # fmt: skip
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
        want = reference(q, k, v, lens)
        grad = torch.randn_like(want)
        want_g = torch.autograd.grad(want, (q, k, v), grad)
        print(name, "reference fwd+bwd ms", round(timed(lambda: torch.autograd.grad(reference(q, k, v, lens), (q, k, v), grad)), 3))
        if varlen_attn is None:
            continue
        params = inspect.signature(varlen_attn).parameters
        kw = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
        # "flag": enable_gqa where offered; "direct": the kv heads as they are, no flag (whether torch 2.11's varlen
        # passes them to flash as flash-attention itself allows); "repeat": the kv heads repeated to the query heads.
        for how in ("flag", "direct", "repeat"):
            if how == "flag" and "enable_gqa" not in params:
                print("  enable_gqa: not offered")
                continue
            def call():  # type: ignore[no-untyped-def]
                rep = how == "repeat"
                kk, vv = (k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)) if rep else (k, v)
                extra = {"enable_gqa": True} if how == "flag" else {}
                return varlen_attn(q, kk, vv, cu, cu, max(lens), max(lens), **kw, **extra)
            compare(f"varlen {how}", call, (q, k, v), grad, want, want_g)
        # Dense SDPA where every sequence has one length (the rows as [S, H, L, D] views of the packed [N, H, D]: no
        # copy), per backend; and cuDNN over the packed rows with cumulative lengths (what nested tensors call).
        from torch.nn.attention import SDPBackend, sdpa_kernel
        if len(set(lens)) == 1:
            s_, l_ = len(lens), lens[0]
            for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
                def dcall():  # type: ignore[no-untyped-def]
                    qd, kd, vd = (t.view(s_, l_, t.shape[1], d).transpose(1, 2) for t in (q, k, v))
                    with sdpa_kernel(backend):
                        out = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=True)
                    return out.transpose(1, 2).reshape(n, hq, d)
                compare(f"dense sdpa {backend.name}", dcall, (q, k, v), grad, want, want_g)
        for how in ("direct", "repeat"):
            def ccall():  # type: ignore[no-untyped-def]
                rep = how == "repeat"
                kk, vv = (k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)) if rep else (k, v)
                return torch.ops.aten._cudnn_attention_forward(q, kk, vv, None, cu, cu, max(lens), max(lens), True, 0.0,
                                                               True, False)[0]  # fmt: skip
            compare(f"cudnn ragged {how}", ccall, (q, k, v), grad, want, want_g)
        if "--flex" not in sys.argv:
            continue
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention
            seq_id = torch.repeat_interleave(torch.arange(len(lens), device="cuda"), torch.tensor(lens, device="cuda"))
            def mask(b, h, qi, ki):  # type: ignore[no-untyped-def]
                return (seq_id[qi] == seq_id[ki]) & (qi >= ki)
            bm = create_block_mask(mask, 1, 1, n, n, device="cuda")
            flex = torch.compile(flex_attention)
            def fcall():  # type: ignore[no-untyped-def]
                out = flex(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], block_mask=bm, enable_gqa=True)
                return out[0].transpose(0, 1)
            got = fcall()
            err = (got - want).abs().max().item()
            ms = timed(lambda: torch.autograd.grad(fcall(), (q, k, v), grad))
            print(f"  flex (compiled) gqa: max err {err:.3g}, fwd+bwd {ms:.3f} ms")
        except Exception as exc:  # noqa: BLE001
            print(f"  flex: {type(exc).__name__}: {str(exc)[:300]}")


if __name__ == "__main__":
    main()
