"""Trims the FlashInfer wheel to what batch decode's JIT needs, so it fits a device call.

Keeps every Python file (the package imports many modules at start), include/, cutlass, cccl and
the top-level csrc sources; drops the kernel sources and data of unrelated features.
Usage: python3 trim_wheel.py FLASHINFER.whl OUT.zip   (unzip OUT.zip into a site folder)
"""
import sys
import zipfile

DROP_DATA = (
    "flashinfer/experimental/", "flashinfer/moe_ep/", "flashinfer/fused_moe/", "flashinfer/cute_dsl/",
    "flashinfer/prims_ts/", "flashinfer/gemm/kernels/", "flashinfer/attention/prims_ts/",
    "flashinfer/topk_varlen/", "flashinfer/gdn_kernels/", "flashinfer/trace/",
)

src, dst = sys.argv[1], sys.argv[2]
kept = 0
with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
    for info in zin.infolist():
        name = info.filename
        if name.startswith("flashinfer/data/csrc/") and name.count("/") > 3:
            continue
        if name.startswith(DROP_DATA) and not name.endswith(".py"):
            continue
        zout.writestr(info, zin.read(name))
        kept += 1
print(f"kept {kept} files in {dst}")
