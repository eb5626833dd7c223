#!/bin/sh
# Copies the repository's generated and declarative sources into the chart, which can only
# read files inside itself (.Files.Get). tests/chart.rs fails when a copy drifts.
# Run from anywhere: charts/kvfleet/hack/sync-files.sh
set -eu
chart=$(cd "$(dirname "$0")/.." && pwd)
root=$(cd "$chart/../.." && pwd)
mkdir -p "$chart/files/crds" "$chart/files/dashboards" "$chart/files/prometheus"
rm -f "$chart"/files/crds/*.yaml "$chart"/files/dashboards/*.json
cp "$root"/crds/*.yaml "$chart/files/crds/"
cp "$root"/deploy/grafana/*.json "$chart/files/dashboards/"
cp "$root/deploy/prometheus/kvfleet-rules.yaml" "$chart/files/prometheus/kvfleet-rules.yaml"
echo "synced crds/, deploy/grafana/ and deploy/prometheus/kvfleet-rules.yaml into $chart/files/"
