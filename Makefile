# kvfleet task runner: CI (.ci/run) calls `make test`; README's two commands are `make run`
# and `make test`.
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
CARGO ?= cargo
CRD := crds/inferencedeployments.kvfleet.io.yaml
TOOLS_ENV := .tools/env
VERSION := $(shell sed -n 's/^version = "\(.*\)"$$/\1/p' Cargo.toml | head -1)

.PHONY: run test tools fmt fmt-check clippy unit e2e crds crd-check bench image image-cpu

## run: build and run kvfleet on its embedded default (worker: SmolLM2 served on the engine, CPU)
run: tools
	$(CARGO) build --release
	./target/release/kvfleet worker --listen 0.0.0.0:8000

## test: everything CI checks (installs the external tools first), the e2e suites included
test: tools fmt-check clippy crd-check unit e2e

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

# The real control plane of the e2e suites (kube-apiserver, controller-manager, scheduler,
# etcd on loopback; see ../shared/k8s/README.md) and the suites that need it.
K8S ?= ../shared/k8s
E2E_SUITES := $(patsubst tests/%.rs,--test %,$(sort $(wildcard tests/e2e_*.rs)))

## e2e: the cluster suites (tests/e2e_*) with --ignored, against KUBECONFIG; when it is
## unset, against ../shared/k8s started here (and stopped again, its data kept)
e2e:
	source $(TOOLS_ENV); \
	if [ -z "$${KUBECONFIG:-}" ]; then \
	  eval "$$($(K8S)/up)"; \
	  trap '$(K8S)/down >/dev/null 2>&1 || true' EXIT; \
	fi; \
	start=$$(date +%s); \
	$(CARGO) test --locked $(E2E_SUITES) -- --ignored --test-threads=1; \
	echo "e2e suites: $$(( $$(date +%s) - start )) s" >&2

## crds: regenerate crds/ from crates/kvfleet-core/src/api and sync the chart's copies
crds:
	$(CARGO) run --quiet -- crd > $(CRD)
	charts/kvfleet/hack/sync-files.sh

## crd-check: fail when crds/ differs from what crates/kvfleet-core/src/api generates
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
