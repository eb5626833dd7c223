# Ceilings and peers for `bench/attention.rs`, measured in the same device call:
#   device copy bandwidth (bytes read + written), bf16 and FP8 (e4m3) GEMM 8192^3, PyTorch SDPA (flash) causal
#   prefill 8 x 4096 x 32 heads x d128, FlashInfer batch decode with paged KV (HND, page 16) at
#   batch 64, context 4096, 32/8 heads, d128 for bf16 and fp8 e4m3 KV, with and without tensor
#   cores (the faster is the peer). Medians of CUDA-event timings after warm-up, random inputs.
# Usage: python3 bench/peers.py OUT_JSON   (FlashInfer optional: import failure is reported)
import json, os, sys, time, traceback
import torch

out_path = sys.argv[1] if len(sys.argv) > 1 else "anchors.json"
res = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
print("peers on", res["device"], "torch", torch.__version__, flush=True)


def median_ms(fn, iters=30, warm=5):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); b.synchronize()
        ts.append(a.elapsed_time(b))
    ts.sort()
    return ts[len(ts) // 2]


src = torch.randn(1 << 29, device="cuda")  # 2 GiB
dst = torch.empty_like(src)
t = median_ms(lambda: dst.copy_(src))
res["copy_GBps"] = 2 * src.numel() * 4 / (t * 1e-3) / 1e9
print(f"copy {res['copy_GBps']:.0f} GB/s", flush=True)
del src, dst

n = 8192
a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
t = median_ms(lambda: a @ b, iters=20)
res["gemm_bf16_TFLOPs"] = 2 * n ** 3 / (t * 1e-3) / 1e12
print(f"gemm bf16 {res['gemm_bf16_TFLOPs']:.0f} TFLOP/s", flush=True)
del a, b

# The FP8 GEMM ceiling (issue 32): e4m3 x e4m3 -> bf16 with per-tensor scales, the shape of
# the bf16 one (torch._scaled_mm wants the second operand column-major).
try:
    a8 = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b8 = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()
    one = torch.ones((), device="cuda")
    t = median_ms(lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16), iters=20)
    res["gemm_fp8_TFLOPs"] = 2 * n ** 3 / (t * 1e-3) / 1e12
    print(f"gemm fp8 {res['gemm_fp8_TFLOPs']:.0f} TFLOP/s", flush=True)
    del a8, b8
except Exception as e:  # noqa: BLE001
    print("gemm fp8 unavailable:", e)

if os.environ.get("PEERS_CEILINGS_ONLY"):
    # The serving benchmark (bench/device/run.sh serve) needs only the two ceilings.
    json.dump(res, open(out_path, "w"), indent=1)
    sys.exit(0)

from torch.nn.attention import SDPBackend, sdpa_kernel
B, S, H, D = 8, 4096, 32, 128
q = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16)
k = torch.randn_like(q); v = torch.randn_like(q)
flops = 4 * B * H * S * S * D / 2
with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
    t = median_ms(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True), iters=20)
res["sdpa_causal_ms"] = t
res["sdpa_causal_TFLOPs"] = flops / (t * 1e-3) / 1e12
print(f"sdpa flash causal 8x4096: {t:.3f} ms {res['sdpa_causal_TFLOPs']:.0f} TFLOP/s", flush=True)
try:
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        t = median_ms(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True), iters=20)
    res["sdpa_cudnn_causal_TFLOPs"] = flops / (t * 1e-3) / 1e12
    print(f"sdpa cudnn causal 8x4096: {t:.3f} ms {res['sdpa_cudnn_causal_TFLOPs']:.0f} TFLOP/s", flush=True)
except Exception as e:  # noqa: BLE001
    print("sdpa cudnn unavailable:", e)
del q, k, v

try:
    t0 = time.time()
    import flashinfer
    print("flashinfer", flashinfer.__version__, flush=True)
    bs, ctx, hq, hkv, hd, page = 64, 4096, 32, 8, 128, 16
    per = ctx // page
    npages = bs * per
    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    indptr = torch.arange(0, bs + 1, device="cuda", dtype=torch.int32) * per
    indices = torch.randperm(npages, device="cuda").to(torch.int32)
    last = torch.full((bs,), page, device="cuda", dtype=torch.int32)
    qd = torch.randn(bs, hq, hd, device="cuda", dtype=torch.bfloat16)
    for name, kvdt in [("bf16", torch.bfloat16), ("fp8", torch.float8_e4m3fn)]:
        kv = (torch.randn(npages, 2, hkv, page, hd, device="cuda", dtype=torch.bfloat16) * 0.5).to(kvdt)
        best = None
        for tc in (True, False):
            try:
                w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "HND", use_tensor_cores=tc)
                w.plan(indptr, indices, last, hq, hkv, hd, page, data_type=kvdt, q_data_type=torch.bfloat16)
                w.run(qd, kv); torch.cuda.synchronize()
                t = median_ms(lambda: w.run(qd, kv), iters=50)
                print(f"flashinfer decode {name} tensor_cores={tc}: {t*1e3:.1f} us", flush=True)
                res[f"fi_decode_{name}_tc{int(tc)}_us"] = t * 1e3
                best = t if best is None else min(best, t)
            except Exception:  # noqa: BLE001
                traceback.print_exc()
        if best is not None:
            kvbytes = kv.numel() * kv.element_size()
            res[f"fi_decode_{name}_us"] = best * 1e3
            res[f"fi_decode_{name}_GBps"] = kvbytes / (best * 1e-3) / 1e9
        del kv
    print("flashinfer total", round(time.time() - t0, 1), "s", flush=True)
except Exception:  # noqa: BLE001
    traceback.print_exc()

with open(out_path, "w") as f:
    json.dump(res, f, indent=1)
print(json.dumps(res))
