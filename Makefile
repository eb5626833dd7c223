# kvfleet task runner: CI (.ci/run) calls `make test`; README's two commands are `make run`
# and `make test`.
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
CARGO ?= cargo
CRD := crds/inferencedeployments.kvfleet.io.yaml
TOOLS_ENV := .tools/env
VERSION := $(shell sed -n 's/^version = "\(.*\)"$$/\1/p' Cargo.toml | head -1)

.PHONY: run test tools fmt fmt-check clippy unit crds crd-check bench image image-cpu

## run: build and run kvfleet on its embedded default (worker: SmolLM2 + attention engine, CPU)
run: tools
	$(CARGO) build --release
	./target/release/kvfleet worker --listen 0.0.0.0:8000

## test: everything CI checks (installs the external tools first)
test: tools fmt-check clippy crd-check unit

## tools: helm, kubectl, promtool, prometheus, NVRTC + CUDA headers into .tools/
tools:
	./.ci/install-tools > /dev/null

fmt:
	$(CARGO) fmt --all

fmt-check:
	$(CARGO) fmt --all -- --check

clippy:
	$(CARGO) clippy --all-targets --locked -- -D warnings

## unit: the test suite, with the tools on PATH (GPU and cluster tests are ignored and say so)
unit:
	source $(TOOLS_ENV) && $(CARGO) test --locked

## crds: regenerate crds/ from src/api and sync the chart's copies
crds:
	$(CARGO) run --quiet -- crd > $(CRD)
	charts/kvfleet/hack/sync-files.sh

## crd-check: fail when crds/ differs from what src/api generates
crd-check:
	$(CARGO) run --quiet --locked -- crd | diff -u $(CRD) - || \
	  { echo "$(CRD) is stale: run 'make crds' and commit it" >&2; exit 1; }

## bench: build the benchmarks (run them one by one, see bench/RESULTS.md)
bench:
	$(CARGO) bench --no-run

## image: the runtime image kvfleet:$(VERSION) (gpu flavour: NVRTC, CUDA headers, cuBLAS) as the
## OCI archive target/image/kvfleet-$(VERSION).oci.tar, pulling no base image (root; docs/install.md)
image: tools
	$(CARGO) build --release --locked
	./image/build --flavour gpu

## image-cpu: kvfleet:$(VERSION)-cpu, without CUDA libraries (tests, small installs)
image-cpu: tools
	$(CARGO) build --release --locked
	./image/build --flavour cpu
