#!/usr/bin/env bash
# Builds the GPU test and benchmark binaries here (release) and packs what a `device` call
# carries into .device/MODE/ (gitignored): stripped, xz-compressed binaries, the trimmed FlashInfer
# wheel and its tvm-ffi dependency (bench/peers.py), and, for the model calls, one half of the
# SmolLM2 GGUF each (the device tool carries at most 64 MiB per call).
#   bench/device/pack.sh attention   # peers + attention bench + cuda_attention/cuda_worker tests
#   bench/device/pack.sh serve       # the worker (and BASE=PATH, an earlier one) for the HTTP benchmark;
#                                    # KVFLEET_PACK_GPU_BINS=1 adds the GPU tests and model bench (sampling.sh)
#   bench/device/pack.sh harden      # the worker + fuzz_openai: overload, hostile bodies, cold start on a GPU
#   bench/device/pack.sh model-a     # model binaries + the GGUF's first half
#   bench/device/pack.sh model-b     # the GGUF's second half
#   bench/device/pack.sh fp8-a       # FP8 weights (bench/device/fp8.sh): GPU tests, model bench, GGUF half
#   bench/device/pack.sh fp8-b       # the GGUF's second half
#   bench/device/pack.sh spec-a      # speculative decoding (bench/device/spec.sh): the worker, GGUF half
#   bench/device/pack.sh spec-b      # the GGUF's second half and guidellm's wheels (issue 34)
#   bench/device/pack.sh draft-a     # EAGLE-3 on the GPU and the FP8 GEMVs (bench/device/drafter.sh): the
#                                    # worker, GPU tests, model bench
#   bench/device/pack.sh draft-b     # the GGUF's first half (KVFLEET_PACK_GPU_BINS=1: the drafter tests
#                                    # and the worker too)
#   bench/device/pack.sh draft-c     # the GGUF's second half, transformers' GGUF wheels
#   bench/device/pack.sh append      # the one-token K/V write (bench/device/append.sh): GPU tests,
#                                    # model bench, the worker
#   bench/device/pack.sh clients     # the worker, prometheus and the wheels of bench/device/clients.sh
#                                    # (inference-perf, the transformers log-probabilities); no GGUF
set -euo pipefail
cd "$(dirname "$0")/../.."
mode=${1:?usage: pack.sh attention|serve|harden|model-a|model-b|clients|fp8-a|fp8-b|spec-a|spec-b|draft-a|draft-b|draft-c|append}
out=.device/$mode
rm -rf "$out"; mkdir -p "$out/bin"

# Prints the executable path of each test/bench target built by one cargo invocation.
exe_of() { cargo "$@" --locked --no-run --message-format=json 2>/dev/null \
  | python3 -c 'import sys,json
for l in sys.stdin:
    m=json.loads(l)
    if m.get("reason")=="compiler-artifact" and m.get("executable") and (set(m["target"]["kind"]) & {"test","bench"} or m["profile"]["test"]):
        print(m["target"]["name"], m["executable"])'; }

pack_bins() {
  while read -r name exe; do
    strip -o "$out/bin/$name" "$exe"
    xz -T2 -6 "$out/bin/$name"
  done
}

gguf="${KVFLEET_SMOLLM2_GGUF:-.tools/models/SmolLM2-135M-Instruct.Q4_1.gguf}"
half=$(( ($(stat -Lc %s "$gguf") + 1) / 2 ))
case "$mode" in
  attention)
    { exe_of test --release --test cuda_attention --test cuda_worker; exe_of bench --bench attention --bench model; } | pack_bins
    whl=/tmp/kvfleet-whl
    if [ ! -f "$whl/fi-trim.zip" ]; then
      mkdir -p "$whl"
      python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform any -d "$whl" \
        flashinfer-python==0.7.2.post1 'apache-tvm-ffi<0.2,>=0.1.11'
      # The wheel is 62 MB; batch decode's JIT needs the Python package, include/, the top-level
      # csrc sources, cutlass and cccl, not the kernel sources of other features.
      python3 bench/device/trim_wheel.py "$whl"/flashinfer_python-*.whl "$whl/fi-trim.zip"
    fi
    mkdir -p "$out/whl"; cp "$whl/fi-trim.zip" "$whl"/apache_tvm_ffi-*.whl "$out/whl/"
    strip -o "$out/bin/kvfleet" target/release/kvfleet && xz -T2 -6 "$out/bin/kvfleet"
    # Optional variant builds to time in the same call: VARIANTS=DIR holding attention_TAG
    # binaries and variants.txt ("TAG ARGS..." per line, see run.sh).
    if [ -n "${VARIANTS:-}" ]; then
      for f in "$VARIANTS"/attention_*; do strip -o "$out/bin/$(basename "$f")" "$f"; xz -T2 -6 "$out/bin/$(basename "$f")"; done
      cp "$VARIANTS/variants.txt" "$out/"
    fi
    cp bench/peers.py "$out/"
    ;;
  serve)
    # The serving benchmark: this tree's worker and, with BASE=PATH, an earlier build to time
    # in the same call (bench/RESULTS.md, issue 19).
    strip -o "$out/bin/kvfleet" target/release/kvfleet && xz -T2 -6 "$out/bin/kvfleet"
    if [ -n "${BASE:-}" ]; then strip -o "$out/bin/kvfleet-base" "$BASE" && xz -T2 -6 "$out/bin/kvfleet-base"; fi
    # KVFLEET_PACK_GPU_BINS=1: the cuda_model tests and the model benchmark too (sampling.sh).
    if [ -n "${KVFLEET_PACK_GPU_BINS:-}" ]; then
      { exe_of test --release --test cuda_model --test cuda_gemma3 --test cuda_worker; exe_of bench --bench model; } | pack_bins
    fi
    cp bench/http_load.py bench/peers.py bench/device/llama-3.1-8b.json bench/device/prefix.sh bench/device/fleet.sh "$out/"
    ;;
  harden)
    # Overload, hostile bodies and cold start against a GPU worker (bench/device/harden.sh;
    # issues 35 and 31). KVFLEET_PACK_GPU_BINS=1 adds the GPU model tests (cuda_model, cuda_worker).
    strip -o "$out/bin/kvfleet" target/release/kvfleet && xz -T2 -6 "$out/bin/kvfleet"
    { exe_of test --release --test fuzz_openai;
      if [ -n "${KVFLEET_PACK_GPU_BINS:-}" ]; then exe_of test --release --test cuda_model --test cuda_worker; fi; } | pack_bins
    cp bench/overload.py bench/http_load.py bench/cold_start.py bench/device/llama-3.1-8b.json bench/device/smollm2-135m.json \
      bench/device/harden.sh "$out/"
    ;;
  model-a)
    { exe_of test --release --test cuda_model; exe_of bench --bench model; } | pack_bins
    strip -o "$out/bin/kvfleet" target/release/kvfleet && xz -T2 -6 "$out/bin/kvfleet"
    head -c "$half" "$gguf" > "$out/gguf.part1"
    cp bench/http_load.py bench/device/llama-3.1-8b.json "$out/"
    ;;
  model-b)
    tail -c +"$((half + 1))" "$gguf" > "$out/gguf.part2"
    sha256sum -b "$gguf" | cut -d' ' -f1 > "$out/gguf.sha256"
    cp bench/http_load.py "$out/"
    ;;
  clients)
    # inference-perf and its server-side report through Prometheus, and transformers'
    # log-probabilities (bench/device/clients.sh; issue 34). The device has torch,
    # transformers, numpy, aiohttp, pyyaml, rich, tqdm, jinja2, prometheus-client, uvloop, pillow,
    # tiktoken; these wheels are the rest (accelerate: transformers loads a GGUF only with it) (the pydantic and requests families may be there too:
    # pip --upgrade --target puts ours first). Debian's prometheus links only libc.
    strip -o "$out/bin/kvfleet" target/release/kvfleet && xz -T2 -6 "$out/bin/kvfleet"
    xz -T2 -6 -c "${PROMETHEUS:-/usr/bin/prometheus}" > "$out/bin/prometheus.xz"
    whl=.whl/clients; mkdir -p "$whl" "$out/whl"
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      --platform manylinux1_x86_64 -d "$whl" inference-perf==0.7.0 gguf==0.19.0 jmespath==1.1.0 \
      aiofiles==25.1.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
      typing-extensions==4.16.0 requests==2.34.2 urllib3==2.8.0 idna==3.20 charset-normalizer==3.5.3 \
      certifi==2026.10.19.post1 accelerate==1.15.0 psutil==7.2.2
    cp "$whl"/*.whl "$out/whl/"
    ;;
  fp8-a)
    { exe_of test --release -p kvfleet-cuda --lib | sed 's/^kvfleet_cuda /cuda_lib /'; exe_of test --release --test cuda_fp8 --test cuda_model --test cuda_capacity;
      exe_of bench --bench model; } | pack_bins
    head -c "$half" "$gguf" > "$out/gguf.part1"
    cp bench/peers.py "$out/"
    ;;
  fp8-b)
    tail -c +"$((half + 1))" "$gguf" > "$out/gguf.part2"
    sha256sum -b "$gguf" | cut -d' ' -f1 > "$out/gguf.sha256"
    ;;
  spec-a)
    strip -o "$out/bin/kvfleet" target/release/kvfleet && xz -T2 -6 "$out/bin/kvfleet"
    head -c "$half" "$gguf" > "$out/gguf.part1"
    ;;
  spec-b)
    tail -c +"$((half + 1))" "$gguf" > "$out/gguf.part2"
    sha256sum -b "$gguf" | cut -d' ' -f1 > "$out/gguf.sha256"
    # guidellm 0.8.1 and what the device image lacks of its needs (it has torch, transformers,
    # pandas, pyarrow, httpx, numpy): 9 MB of wheels for Python 3.12.
    mkdir -p "$out/whl"
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      --platform manylinux1_x86_64 --platform any -d "$out/whl" \
      guidellm==0.8.1 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 culsans==0.11.0 aiologic \
      eval_type_backport faker ftfy wcwidth loguru pydantic-settings python-dotenv pydantic==2.14.4 \
      pydantic-core==2.50.5 annotated-types typing-inspection sanic sanic-routing html5tagger tracerite \
      more-itertools websockets h2 hpack hyperframe httptools ujson sniffio gguf==0.19.0
    ;;
  draft-a)
    { exe_of test --release -p kvfleet-cuda --lib | sed 's/^kvfleet_cuda /cuda_lib /'; exe_of test --release --test cuda_drafter --test cuda_model;
      exe_of bench --bench model; } | pack_bins
    strip -o "$out/bin/kvfleet" target/release/kvfleet && xz -T2 -6 "$out/bin/kvfleet"
    cp bench/peers.py bench/http_load.py bench/spec_copy.py bench/device/llama-3.1-8b.json "$out/"
    ;;
  draft-b)
    head -c "$half" "$gguf" > "$out/gguf.part1"
    # KVFLEET_PACK_GPU_BINS=1: the drafter tests and the worker ride along (a re-run of part c
    # after a code change, without part a's benches).
    if [ -n "${KVFLEET_PACK_GPU_BINS:-}" ]; then
      exe_of test --release --test cuda_drafter | pack_bins
      strip -o "$out/bin/kvfleet" target/release/kvfleet && xz -T2 -6 "$out/bin/kvfleet"
    fi
    ;;
  draft-c)
    tail -c +"$((half + 1))" "$gguf" > "$out/gguf.part2"
    sha256sum -b "$gguf" | cut -d' ' -f1 > "$out/gguf.sha256"
    # transformers reads a GGUF through gguf-py and accelerate (the device has torch and
    # transformers): the bf16 log-probability reference (issue 34).
    mkdir -p "$out/whl"
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform any -d "$out/whl" \
      gguf==0.19.0 accelerate==1.15.0 psutil==7.2.2
    ;;
  append)
    { exe_of test --release -p kvfleet-cuda --lib | sed 's/^kvfleet_cuda /cuda_lib /'; exe_of test --release --test cuda_model;
      exe_of bench --bench model; } | pack_bins
    cargo build --release --locked
    strip -o "$out/bin/kvfleet" target/release/kvfleet && xz -T2 -6 "$out/bin/kvfleet"
    cp bench/peers.py bench/http_load.py bench/device/llama-3.1-8b.json bench/device/ncu_step.py "$out/"
    ;;
  *) echo "unknown mode $mode" >&2; exit 2 ;;
esac
du -sh "$out"; ls -la "$out" "$out"/*/ 2>/dev/null
