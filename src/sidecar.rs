//! `kvfleet capacity-sidecar`: runs beside a vLLM server in its pod, reads the KV pool vLLM
//! really allocated from its `/metrics` (`vllm:cache_config_info`, labels `num_gpu_blocks` and
//! `block_size`, or `kv_cache_size_tokens` where vLLM publishes it) and records it on its own
//! pod as the annotation kvfleet workers write (`kvfleet.io/measured-kv-tokens`), which the
//! controller reads into `status.capacity.measuredTokensPerReplica`.

use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, Patch, PatchParams};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::publish::{annotation_patch, pod_identity};

/// Arguments of `kvfleet capacity-sidecar`.
#[derive(clap::Args, Debug, Clone)]
pub struct SidecarArgs {
    /// vLLM's metrics endpoint (host:port and path; plain HTTP).
    #[arg(long, default_value = "127.0.0.1:8000/metrics", env = "KVFLEET_VLLM_METRICS")]
    pub metrics: String,
    /// Seconds between reads.
    #[arg(long, default_value_t = 15)]
    pub interval_seconds: u64,
}

/// The KV pool of one vLLM server, from `vllm:cache_config_info`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CacheConfig {
    pub num_gpu_blocks: u64,
    pub block_size: u64,
    /// `kv_cache_size_tokens` when vLLM publishes it (what it logs as "GPU KV cache size").
    pub kv_cache_size_tokens: Option<u64>,
}

impl CacheConfig {
    /// Tokens the pool holds: vLLM's own figure when published, else blocks x block size.
    pub fn tokens(&self) -> u64 {
        self.kv_cache_size_tokens
            .unwrap_or(self.num_gpu_blocks * self.block_size)
    }
}

/// The label values of one Prometheus text-format sample line (`name{a="1",b="x"} 1.0`).
fn labels(line: &str) -> Vec<(String, String)> {
    let Some(start) = line.find('{') else {
        return Vec::new();
    };
    let mut out = Vec::new();
    let mut rest = &line[start + 1..];
    loop {
        rest = rest.trim_start_matches([',', ' ']);
        let Some(eq) = rest.find("=\"") else { break };
        let key = rest[..eq].trim().to_string();
        let mut value = String::new();
        let mut chars = rest[eq + 2..].char_indices();
        let mut end = None;
        while let Some((i, c)) = chars.next() {
            match c {
                '\\' => {
                    if let Some((_, n)) = chars.next() {
                        value.push(if n == 'n' { '\n' } else { n });
                    }
                }
                '"' => {
                    end = Some(eq + 2 + i + 1);
                    break;
                }
                c => value.push(c),
            }
        }
        out.push((key, value));
        match end {
            Some(e) => rest = &rest[e..],
            None => break,
        }
        if rest.starts_with('}') {
            break;
        }
    }
    out
}

/// The pool from a `/metrics` body; the smallest when several engines report (data
/// parallelism), `None` while vLLM has not sized its pool (`num_gpu_blocks="None"`).
pub fn parse_cache_config(metrics: &str) -> Option<CacheConfig> {
    metrics
        .lines()
        .filter(|l| l.starts_with("vllm:cache_config_info{"))
        .filter_map(|l| {
            let ls = labels(l);
            let get = |k: &str| {
                ls.iter()
                    .find(|(n, _)| n == k)
                    .and_then(|(_, v)| v.parse::<u64>().ok())
            };
            let num_gpu_blocks = get("num_gpu_blocks").filter(|b| *b > 0)?;
            let block_size = get("block_size").filter(|b| *b > 0)?;
            Some(CacheConfig {
                num_gpu_blocks,
                block_size,
                kv_cache_size_tokens: get("kv_cache_size_tokens").filter(|t| *t > 0),
            })
        })
        .min_by_key(CacheConfig::tokens)
}

/// GET `host:port/path` over plain HTTP/1.0 (no chunking), returning the body of a 200.
pub async fn fetch(endpoint: &str) -> Result<String, String> {
    let endpoint = endpoint.trim_start_matches("http://");
    let (host, path) = match endpoint.find('/') {
        Some(i) => (&endpoint[..i], &endpoint[i..]),
        None => (endpoint, "/metrics"),
    };
    let connect = tokio::net::TcpStream::connect(host);
    let mut stream = tokio::time::timeout(Duration::from_secs(5), connect)
        .await
        .map_err(|_| format!("{host}: connect timed out"))?
        .map_err(|e| format!("{host}: {e}"))?;
    let request = format!("GET {path} HTTP/1.0\r\nHost: {host}\r\nAccept: text/plain\r\n\r\n");
    stream
        .write_all(request.as_bytes())
        .await
        .map_err(|e| format!("{host}: {e}"))?;
    let mut raw = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut raw))
        .await
        .map_err(|_| format!("{host}{path}: read timed out"))?
        .map_err(|e| format!("{host}{path}: {e}"))?;
    let text = String::from_utf8_lossy(&raw);
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| format!("{host}{path}: not an HTTP response"))?;
    let status = head.lines().next().unwrap_or_default();
    if status.split_whitespace().nth(1) != Some("200") {
        return Err(format!("{host}{path}: {status}"));
    }
    Ok(body.to_string())
}

/// Reads vLLM's pool until SIGTERM, annotating the pod whenever the figure changes.
pub async fn run(args: SidecarArgs) -> Result<(), SidecarError> {
    let (namespace, name) = pod_identity(|k| std::env::var(k).ok()).ok_or(SidecarError::NotInPod)?;
    let client = kube::Client::try_default().await.map_err(SidecarError::Client)?;
    let pods: Api<Pod> = Api::namespaced(client, &namespace);
    let mut published: Option<u64> = None;
    let interval = Duration::from_secs(args.interval_seconds.max(1));
    let shutdown = crate::serving::shutdown_signal();
    tokio::pin!(shutdown);
    loop {
        match fetch(&args.metrics).await.map(|b| parse_cache_config(&b)) {
            Ok(Some(cfg)) if published != Some(cfg.tokens()) => {
                let tokens = cfg.tokens();
                match pods
                    .patch(
                        &name,
                        &PatchParams::default(),
                        &Patch::Merge(annotation_patch(tokens)),
                    )
                    .await
                {
                    Ok(_) => {
                        tracing::info!(tokens, blocks = cfg.num_gpu_blocks, block_size = cfg.block_size, pod = %name, "published vLLM's measured KV capacity");
                        published = Some(tokens);
                    }
                    Err(error) => {
                        tracing::warn!(%error, pod = %name, "cannot annotate own pod; check the pod's service account may patch pods")
                    }
                }
            }
            Ok(Some(_)) => {}
            Ok(None) => tracing::debug!("vllm:cache_config_info has no pool yet"),
            Err(error) => tracing::debug!(%error, "vLLM metrics not readable yet"),
        }
        tokio::select! {
            () = &mut shutdown => return Ok(()),
            () = tokio::time::sleep(interval) => {}
        }
    }
}

/// Why the sidecar cannot run.
#[derive(Debug, thiserror::Error)]
pub enum SidecarError {
    #[error("POD_NAME and POD_NAMESPACE are unset; the sidecar annotates its own pod: set them from the downward API (metadata.name, metadata.namespace)")]
    NotInPod,
    #[error("cannot build a Kubernetes client (in-cluster service account or KUBECONFIG)")]
    Client(#[source] kube::Error),
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A vLLM `/metrics` excerpt as vLLM publishes it (label set of
    /// `vllm:cache_config_info`, values from a Qwen2.5 1.5B server), plus neighbours.
    const VLLM_METRICS: &str = r#"# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="Qwen/Qwen2.5-Coder-1.5B-Instruct"} 0.0
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",calculate_kv_scales="False",cpu_offload_gb="0",enable_prefix_caching="False",gpu_memory_utilization="0.9",is_attention_free="False",num_cpu_blocks="9362",num_gpu_blocks="81767",num_gpu_blocks_override="None",sliding_window="None",swap_space_bytes="4294967296"} 1.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="Qwen/Qwen2.5-Coder-1.5B-Instruct"} 0.0
"#;

    #[test]
    fn the_pool_of_a_real_vllm_metrics_page_is_blocks_times_block_size() {
        let cfg = parse_cache_config(VLLM_METRICS).expect("cache_config_info");
        assert_eq!(cfg.num_gpu_blocks, 81_767);
        assert_eq!(cfg.block_size, 16);
        assert_eq!(cfg.tokens(), 1_308_272);
    }

    #[test]
    fn vllms_own_token_figure_wins_and_an_unsized_pool_is_not_a_figure() {
        let page = "vllm:cache_config_info{block_size=\"16\",kv_cache_size_tokens=\"123433\",num_gpu_blocks=\"14835\"} 1.0\n";
        assert_eq!(parse_cache_config(page).unwrap().tokens(), 123_433);
        let not_sized = "vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"None\"} 1.0\n";
        assert_eq!(parse_cache_config(not_sized), None);
        let two = "vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"6000\"} 1.0\nvllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"5000\"} 1.0\n";
        assert_eq!(
            parse_cache_config(two).unwrap().tokens(),
            80_000,
            "the smallest engine"
        );
        assert_eq!(parse_cache_config("vllm:num_requests_running 0\n"), None);
        let escaped = "vllm:cache_config_info{a=\"x\\\"y,z\",block_size=\"32\",num_gpu_blocks=\"10\"} 1\n";
        assert_eq!(parse_cache_config(escaped).unwrap().tokens(), 320);
    }

    #[tokio::test]
    async fn fetch_reads_a_metrics_page_over_http() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut buf = [0u8; 1024];
            let n = s.read(&mut buf).await.unwrap();
            assert!(String::from_utf8_lossy(&buf[..n]).starts_with("GET /metrics HTTP/1.0"));
            let body = VLLM_METRICS;
            let resp = format!(
                "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            );
            s.write_all(resp.as_bytes()).await.unwrap();
        });
        let body = fetch(&format!("{addr}/metrics")).await.unwrap();
        assert_eq!(parse_cache_config(&body).unwrap().tokens(), 1_308_272);
        assert!(fetch("127.0.0.1:1/metrics").await.is_err());
    }
}
