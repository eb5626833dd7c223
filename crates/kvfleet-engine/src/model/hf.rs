//! Hugging Face checkpoints: a directory with `config.json`, `model.safetensors` (or shards
//! listed by `model.safetensors.index.json`), `tokenizer.json` and `tokenizer_config.json`.
//! Shards are memory-mapped; BF16/F16/F32 tensors become f32 at load, and so do FP8 (e4m3fn)
//! weights of vLLM `fp8` and compressed-tensors `float-quantized` checkpoints, dequantized
//! with their scales ([`super::fp8`]; [`Safetensors::fp8_weight`] keeps them as stored).
//!
//! RoPE layout: Hugging Face Llama-family attention rotates the two halves of each head
//! (`rotate_half`, huggingface/transformers `src/transformers/models/llama/modeling_llama.py`),
//! and its Q/K projections are stored in that order. llama.cpp's converter permutes Q/K rows of
//! `llama` models into adjacent pairs instead (ggml-org/llama.cpp `convert_hf_to_gguf.py`,
//! `LlamaModel.permute`). Checkpoints loaded here keep their rows and run with
//! `rope_neox = true`, for every architecture.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use kvfleet_core::plan::hf_config::HfConfigJson;
use memmap2::Mmap;
use rayon::prelude::*;
use safetensors::tensor::{Metadata, SafeTensorError};
use safetensors::Dtype;
use serde::Deserialize;

use super::fp8::{Fp8Config, Fp8ConfigError, Fp8Strategy, Fp8Weight};
use super::llama::{Llama, LlamaConfig, LoadError};
pub use super::moe::MOE_ARCHITECTURES;
use super::moe::{self, Moe};
use super::tokenizer::{Tokenizer, TokenizerError};
use super::w4::{RawTensor, W4Config, W4Error};

/// `architectures[0]` of `config.json` -> kvfleet's architecture name: the Hugging Face
/// architectures the CPU engine serves (the CUDA engine all but [`MOE_ARCHITECTURES`]).
pub const ARCHITECTURES: &[(&str, &str)] = &[
    ("LlamaForCausalLM", "llama"),
    ("MistralForCausalLM", "mistral"),
    ("Qwen2ForCausalLM", "qwen2"),
    ("Qwen3ForCausalLM", "qwen3"),
    ("Qwen3MoeForCausalLM", "qwen3moe"),
    ("Qwen2MoeForCausalLM", "qwen2moe"),
    ("OlmoeForCausalLM", "olmoe"),
    ("MixtralForCausalLM", "mixtral"),
];

/// Whether the CPU engine serves checkpoints of Hugging Face architecture `arch`
/// (`architectures[0]` of their `config.json`): the admission's question for
/// `runtime: kvfleet` on the CPU.
pub fn cpu_serves(arch: &str) -> bool {
    ARCHITECTURES.iter().any(|(hf, _)| *hf == arch)
}

/// Whether the CUDA engine serves architecture `arch`: the CPU's but the mixtures of experts
/// ([`MOE_ARCHITECTURES`]). By architecture alone: the GPU's kernels also bound the shapes
/// (head dims, `kvfleet_cuda::gpu::GpuLlama::check_shapes`).
pub fn cuda_serves(arch: &str) -> bool {
    cpu_serves(arch) && !MOE_ARCHITECTURES.contains(&arch)
}

/// Errors of loading a Hugging Face checkpoint.
#[derive(Debug, thiserror::Error)]
pub enum HfError {
    #[error("cannot read {}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{} is not valid: {source}", path.display())]
    Json {
        path: PathBuf,
        #[source]
        source: serde_path_to_error::Error<serde_json::Error>,
    },
    #[error(
        "{}: architecture `{arch}` is not supported; kvfleet loads LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM, Qwen2MoeForCausalLM, OlmoeForCausalLM and MixtralForCausalLM",
        path.display()
    )]
    Architecture { path: PathBuf, arch: String },
    #[error(
        "{}: rope_scaling type `{kind}` is not supported; kvfleet supports none (default), linear and llama3",
        path.display()
    )]
    RopeScaling { path: PathBuf, kind: String },
    #[error("{}: {msg}", path.display())]
    Config { path: PathBuf, msg: String },
    #[error(
        "{} holds no weights: expected model.safetensors, or model.safetensors.index.json and its shards",
        dir.display()
    )]
    NoWeights { dir: PathBuf },
    #[error("{} is not a valid safetensors file: {source}", path.display())]
    Safetensors {
        path: PathBuf,
        #[source]
        source: SafeTensorError,
    },
    #[error("{}: {msg}", path.display())]
    Index { path: PathBuf, msg: String },
    #[error("tensor `{tensor}` is missing from the checkpoint in {} (is config.json from the same model?)", dir.display())]
    MissingTensor { dir: PathBuf, tensor: String },
    #[error("{}: tensor `{tensor}` has shape {got:?}, config.json implies {want:?}", path.display())]
    Shape {
        path: PathBuf,
        tensor: String,
        got: Vec<usize>,
        want: Vec<usize>,
    },
    #[error(
        "{}: tensor `{tensor}` has dtype {dtype}; kvfleet loads BF16, F16, F32 and FP8 (F8_E4M3 with a weight_scale) checkpoints (for other quantised weights serve a GGUF file)",
        path.display()
    )]
    Dtype {
        path: PathBuf,
        tensor: String,
        dtype: String,
    },
    #[error("{}: {source}", path.display())]
    Tokenizer {
        path: PathBuf,
        #[source]
        source: TokenizerError,
    },
    #[error("{}: {source}", path.display())]
    Quantization {
        path: PathBuf,
        #[source]
        source: Fp8ConfigError,
    },
    #[error("{}: {source}", path.display())]
    W4 {
        path: PathBuf,
        #[source]
        source: W4Error,
    },
    #[error("{}: FP8 weight `{tensor}`: {msg}", path.display())]
    Fp8Scale {
        path: PathBuf,
        tensor: String,
        msg: String,
    },
    #[error(transparent)]
    Load(#[from] LoadError),
}

pub(crate) fn read(path: &Path) -> Result<String, HfError> {
    std::fs::read_to_string(path).map_err(|source| HfError::Io {
        path: path.into(),
        source,
    })
}

pub(crate) fn parse_json<T: serde::de::DeserializeOwned>(path: &Path, text: &str) -> Result<T, HfError> {
    let de = &mut serde_json::Deserializer::from_str(text);
    serde_path_to_error::deserialize(de).map_err(|source| HfError::Json {
        path: path.into(),
        source,
    })
}

/// `config.json` of a checkpoint directory, or the path itself when it names a file.
pub(crate) fn config_path(path: &Path) -> PathBuf {
    if path.is_dir() {
        path.join("config.json")
    } else {
        path.to_path_buf()
    }
}

// === impl config ===

/// A checkpoint's geometry plus what [`LlamaConfig`] does not carry.
#[derive(Debug, Clone, PartialEq)]
pub struct HfConfig {
    pub llama: LlamaConfig,
    /// llama3 RoPE scaling: per rotated pair, the divisor of its inverse frequency.
    pub rope_freq_factors: Option<Vec<f32>>,
}

impl HfConfig {
    /// Reads `config.json` (or the `config.json` of a checkpoint directory).
    pub fn load(path: &Path) -> Result<Self, HfError> {
        let path = config_path(path);
        Self::parse(&path, &read(&path)?)
    }

    /// Parses the text of a `config.json` (the keys [`HfConfigJson`] reads); `path` only names
    /// it in errors.
    pub fn parse(path: &Path, text: &str) -> Result<Self, HfError> {
        let raw: HfConfigJson = parse_json(path, text)?;
        let json: serde_json::Value = parse_json(path, text)?;
        let cfg_err = |msg: String| HfError::Config {
            path: path.into(),
            msg,
        };
        let arch = match (raw.architectures.as_deref(), raw.model_type.as_deref()) {
            (Some([a, ..]), _) => ARCHITECTURES
                .iter()
                .find(|(hf, _)| hf == a)
                .map(|(_, ours)| *ours)
                .ok_or_else(|| HfError::Architecture {
                    path: path.into(),
                    arch: a.clone(),
                })?,
            (_, Some(t)) => ARCHITECTURES
                .iter()
                .find(|(_, ours)| ours == &t)
                .map(|(_, ours)| *ours)
                .ok_or_else(|| HfError::Architecture {
                    path: path.into(),
                    arch: t.into(),
                })?,
            _ => return Err(cfg_err("neither `architectures` nor `model_type` is set".into())),
        };
        if let Some(act) = raw.hidden_act.as_deref().filter(|a| *a != "silu") {
            return Err(cfg_err(format!(
                "hidden_act `{act}` is not supported; Llama-family models use silu"
            )));
        }
        if raw.mlp_bias == Some(true) {
            return Err(cfg_err("mlp_bias = true is not supported".into()));
        }
        if raw.partial_rotary_factor.is_some_and(|f| f != 1.0) {
            return Err(cfg_err(
                "partial_rotary_factor other than 1 is not supported".into(),
            ));
        }
        if raw.num_attention_heads == 0 {
            return Err(cfg_err("num_attention_heads is 0".into()));
        }
        // Bounds before anything is sized from them: far above any real model.
        for (key, value, max) in [
            ("hidden_size", Some(raw.hidden_size), 1usize << 17),
            ("intermediate_size", Some(raw.intermediate_size), 1 << 20),
            ("num_hidden_layers", Some(raw.num_hidden_layers), 4096),
            ("num_attention_heads", Some(raw.num_attention_heads), 1024),
            ("num_key_value_heads", raw.num_key_value_heads, 1024),
            ("head_dim", raw.head_dim, 16_384),
            ("vocab_size", Some(raw.vocab_size), 1 << 22),
            ("max_position_embeddings", raw.max_position_embeddings, 1 << 25),
            ("sliding_window", raw.sliding_window, 1 << 25),
        ] {
            if let Some(v) = value.filter(|v| *v > max) {
                return Err(cfg_err(format!("{key} {v} is above the maximum {max}")));
            }
        }
        let head_dim = raw.head_dim();
        let rope_theta = raw.rope_theta();
        let mut context_len = raw.max_position_embeddings();
        // Attention within the window is full attention, so clamping the context to the
        // window keeps results exact.
        let windowed = match arch {
            "mistral" | "mixtral" => true,
            "qwen2" | "qwen3" | "qwen2moe" | "qwen3moe" => raw.use_sliding_window == Some(true),
            _ => false,
        };
        if let Some(w) = raw.sliding_window.filter(|_| windowed) {
            context_len = context_len.min(w);
        }
        let mut llama = LlamaConfig {
            arch: arch.to_string(),
            n_layers: raw.num_hidden_layers,
            d_model: raw.hidden_size,
            d_ff: raw.intermediate_size,
            n_heads: raw.num_attention_heads,
            n_kv_heads: raw.kv_heads(),
            head_dim,
            vocab: raw.vocab_size,
            context_len,
            rope_theta: rope_theta as f32,
            rope_dims: head_dim,
            rope_linear_scale: 1.0,
            rope_neox: true,
            rms_eps: raw.rms_norm_eps() as f32,
            // Qwen2 always has Q/K/V biases, Qwen2-MoE unless `qkv_bias` is false; the others
            // only with `attention_bias`.
            attn_bias: arch == "qwen2"
                || (arch == "qwen2moe" && json.get("qkv_bias").and_then(|v| v.as_bool()) != Some(false))
                || raw.attention_bias == Some(true),
            qk_norm: matches!(arch, "qwen3" | "qwen3moe" | "olmoe"),
            qk_norm_full: arch == "olmoe",
            tied_embeddings: raw.tie_word_embeddings.unwrap_or(false),
            gemma3: None,
            moe: Moe::from_config_json(arch, &json).map_err(cfg_err)?,
        };
        let scaling = raw.rope_scaling();
        let mut rope_freq_factors = None;
        if let Some(s) = scaling {
            let kind = s
                .get("rope_type")
                .or_else(|| s.get("type"))
                .and_then(|v| v.as_str())
                .unwrap_or("default");
            let num = |k: &str| s.get(k).and_then(|v| v.as_f64());
            let need = |k: &str| {
                num(k).ok_or_else(|| cfg_err(format!("rope_scaling `{kind}` needs a number `{k}`")))
            };
            match kind {
                "default" => {}
                "linear" => llama.rope_linear_scale = need("factor")? as f32,
                "llama3" => {
                    rope_freq_factors = Some(llama3_freq_factors(
                        &llama,
                        need("factor")?,
                        need("low_freq_factor")?,
                        need("high_freq_factor")?,
                        need("original_max_position_embeddings")?,
                    ))
                }
                other => {
                    return Err(HfError::RopeScaling {
                        path: path.into(),
                        kind: other.into(),
                    })
                }
            }
        }
        llama.check()?;
        Ok(HfConfig {
            llama,
            rope_freq_factors,
        })
    }
}

/// Llama 3.1 RoPE scaling as a divisor per rotated pair: low frequencies (wavelength beyond
/// `original / low_freq_factor`) are divided by `factor`, high ones kept, the band between
/// interpolated (huggingface/transformers `src/transformers/modeling_rope_utils.py`,
/// `_compute_llama3_parameters`; llama.cpp stores the same divisors as `rope_freqs.weight`).
fn llama3_freq_factors(cfg: &LlamaConfig, factor: f64, low: f64, high: f64, original: f64) -> Vec<f32> {
    let dims = cfg.rope_dims as f64;
    let (low_wavelen, high_wavelen) = (original / low, original / high);
    (0..cfg.rope_dims / 2)
        .map(|i| {
            let freq = (cfg.rope_theta as f64).powf(-2.0 * i as f64 / dims);
            let wavelen = 2.0 * std::f64::consts::PI / freq;
            let scaled = if wavelen < high_wavelen {
                freq
            } else if wavelen > low_wavelen {
                freq / factor
            } else {
                let smooth = (original / wavelen - low) / (high - low);
                (1.0 - smooth) * freq / factor + smooth * freq
            };
            (freq / scaled) as f32
        })
        .collect()
}

// === impl weights ===

struct Shard {
    path: PathBuf,
    mmap: Mmap,
    /// Byte offset of the data section (after the 8-byte length and the JSON header).
    data_start: usize,
    meta: Metadata,
}

/// The memory-mapped safetensors files of a checkpoint and which holds each tensor.
pub struct Safetensors {
    dir: PathBuf,
    shards: Vec<Shard>,
    index: HashMap<String, usize>,
}

impl std::fmt::Debug for Safetensors {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Safetensors")
            .field("dir", &self.dir)
            .field("shards", &self.shards.len())
            .field("tensors", &self.index.len())
            .finish()
    }
}

#[derive(Deserialize)]
struct IndexFile {
    weight_map: HashMap<String, String>,
}

impl Safetensors {
    /// Maps `model.safetensors`, or every shard `model.safetensors.index.json` names.
    pub fn open(dir: &Path) -> Result<Self, HfError> {
        let index_path = dir.join("model.safetensors.index.json");
        let single = dir.join("model.safetensors");
        let (files, weight_map) = if index_path.is_file() {
            let idx: IndexFile = parse_json(&index_path, &read(&index_path)?)?;
            let mut files: Vec<String> = idx.weight_map.values().cloned().collect();
            files.sort();
            files.dedup();
            (files, Some(idx.weight_map))
        } else if single.is_file() {
            (vec!["model.safetensors".to_string()], None)
        } else {
            return Err(HfError::NoWeights { dir: dir.into() });
        };
        let mut shards = Vec::with_capacity(files.len());
        let mut index = HashMap::new();
        for (i, f) in files.iter().enumerate() {
            if f.contains('/') || f.contains('\\') || f == ".." {
                return Err(HfError::Index {
                    path: index_path.clone(),
                    msg: format!("shard `{f}` is not a file name in the checkpoint directory"),
                });
            }
            let path = dir.join(f);
            let file = File::open(&path).map_err(|source| HfError::Io {
                path: path.clone(),
                source,
            })?;
            // SAFETY: the map is read-only; a checkpoint modified while being served is
            // outside what kvfleet can guard against (as for the GGUF reader).
            let mmap = unsafe { Mmap::map(&file) }.map_err(|source| HfError::Io {
                path: path.clone(),
                source,
            })?;
            let (header, meta) =
                safetensors::SafeTensors::read_metadata(&mmap).map_err(|source| HfError::Safetensors {
                    path: path.clone(),
                    source,
                })?;
            for name in meta.tensors().keys() {
                index.insert(name.clone(), i);
            }
            shards.push(Shard {
                path,
                mmap,
                data_start: 8 + header,
                meta,
            });
        }
        if let Some(map) = weight_map {
            for (name, file) in map {
                let held = index.get(&name).is_some_and(|&i| shards[i].path.ends_with(&file));
                if !held {
                    return Err(HfError::Index {
                        path: index_path.clone(),
                        msg: format!("tensor `{name}` is listed in {file}, which does not hold it"),
                    });
                }
            }
        }
        Ok(Safetensors {
            dir: dir.into(),
            shards,
            index,
        })
    }

    /// Whether the checkpoint holds tensor `name`.
    pub fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    /// Names of every tensor.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.index.keys().map(String::as_str)
    }

    /// The shard holding tensor `name` and its entry, checked against `shape`.
    fn located(
        &self,
        name: &str,
        shape: &[usize],
    ) -> Result<(&Shard, &safetensors::tensor::TensorInfo), HfError> {
        let missing = || HfError::MissingTensor {
            dir: self.dir.clone(),
            tensor: name.into(),
        };
        let shard = &self.shards[*self.index.get(name).ok_or_else(missing)?];
        let info = shard.meta.info(name).ok_or_else(missing)?;
        if info.shape != shape {
            return Err(HfError::Shape {
                path: shard.path.clone(),
                tensor: name.into(),
                got: info.shape.clone(),
                want: shape.to_vec(),
            });
        }
        Ok((shard, info))
    }

    /// Tensor `name` as f32, checked against `shape`.
    pub fn tensor_f32(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>, HfError> {
        let (shard, info) = self.located(name, shape)?;
        if info.dtype == Dtype::F8_E4M3 {
            return Ok(self.fp8_weight(name)?.dequantize());
        }
        let (a, b) = info.data_offsets;
        // `read_metadata` checked the offsets against the file length and the shape.
        let bytes = &shard.mmap[shard.data_start + a..shard.data_start + b];
        let n: usize = shape.iter().product();
        let mut out = vec![0f32; n];
        const CHUNK: usize = 1 << 16;
        match info.dtype {
            Dtype::F32 => out.par_chunks_mut(CHUNK).enumerate().for_each(|(c, o)| {
                let src = &bytes[c * CHUNK * 4..];
                for (v, b) in o.iter_mut().zip(src.chunks_exact(4)) {
                    *v = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                }
            }),
            Dtype::BF16 => out.par_chunks_mut(CHUNK).enumerate().for_each(|(c, o)| {
                let src = &bytes[c * CHUNK * 2..];
                for (v, b) in o.iter_mut().zip(src.chunks_exact(2)) {
                    *v = f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16);
                }
            }),
            Dtype::F16 => out.par_chunks_mut(CHUNK).enumerate().for_each(|(c, o)| {
                let src = &bytes[c * CHUNK * 2..];
                for (v, b) in o.iter_mut().zip(src.chunks_exact(2)) {
                    *v = half::f16::from_le_bytes([b[0], b[1]]).to_f32();
                }
            }),
            other => {
                return Err(HfError::Dtype {
                    path: shard.path.clone(),
                    tensor: name.into(),
                    dtype: other.to_string(),
                })
            }
        }
        Ok(out)
    }
}

impl Safetensors {
    /// Integer tensor `name` (I64 or I32) as i64, checked against `shape` (an EAGLE-3
    /// drafter's `d2t` token map).
    pub fn tensor_i64(&self, name: &str, shape: &[usize]) -> Result<Vec<i64>, HfError> {
        let (shard, info) = self.located(name, shape)?;
        let (a, b) = info.data_offsets;
        let bytes = &shard.mmap[shard.data_start + a..shard.data_start + b];
        match info.dtype {
            Dtype::I64 => Ok(bytes
                .chunks_exact(8)
                .map(|b| i64::from_le_bytes(b.try_into().unwrap_or([0; 8])))
                .collect()),
            Dtype::I32 => Ok(bytes
                .chunks_exact(4)
                .map(|b| i32::from_le_bytes(b.try_into().unwrap_or([0; 4])) as i64)
                .collect()),
            other => Err(HfError::Dtype {
                path: shard.path.clone(),
                tensor: name.into(),
                dtype: other.to_string(),
            }),
        }
    }

    /// Tensor `name` as stored (shape, dtype, bytes), when held: the packed tensors of 4-bit
    /// checkpoints, read by [`super::w4`].
    pub fn raw(&self, name: &str) -> Option<RawTensor<'_>> {
        let shard = &self.shards[*self.index.get(name)?];
        let info = shard.meta.info(name)?;
        let (a, b) = info.data_offsets;
        Some(RawTensor {
            shape: &info.shape,
            dtype: info.dtype,
            data: &shard.mmap[shard.data_start + a..shard.data_start + b],
        })
    }

    /// The shape and dtype of tensor `name`, when held.
    pub fn info(&self, name: &str) -> Option<(Vec<usize>, Dtype)> {
        let shard = &self.shards[*self.index.get(name)?];
        let info = shard.meta.info(name)?;
        Some((info.shape.clone(), info.dtype))
    }

    /// FP8 matrix `name` (`<layer>.weight`, F8_E4M3, `[rows, cols]`) with its
    /// `<layer>.weight_scale` and, when stored, `<layer>.input_scale`, as the checkpoint holds
    /// them. The scale's shape gives the strategy: one element (`[]` or `[1]`) per tensor,
    /// `[rows]` or `[rows, 1]` per output channel.
    pub fn fp8_weight(&self, name: &str) -> Result<Fp8Weight, HfError> {
        let missing = |tensor: &str| HfError::MissingTensor {
            dir: self.dir.clone(),
            tensor: tensor.into(),
        };
        let shard = &self.shards[*self.index.get(name).ok_or_else(|| missing(name))?];
        let info = shard.meta.info(name).ok_or_else(|| missing(name))?;
        let scale_err = |msg: String| HfError::Fp8Scale {
            path: shard.path.clone(),
            tensor: name.into(),
            msg,
        };
        if info.dtype != Dtype::F8_E4M3 {
            return Err(scale_err(format!("dtype {} is not F8_E4M3", info.dtype)));
        }
        let [rows, cols] = info.shape[..] else {
            return Err(scale_err(format!("shape {:?} is not a matrix", info.shape)));
        };
        let (a, b) = info.data_offsets;
        let data = shard.mmap[shard.data_start + a..shard.data_start + b].to_vec();
        let stem = name.strip_suffix(".weight").unwrap_or(name);
        let scale_name = format!("{stem}.weight_scale");
        let (scale_shape, _) = self.info(&scale_name).ok_or_else(|| missing(&scale_name))?;
        let n: usize = scale_shape.iter().product();
        let strategy = match (n, scale_shape.as_slice()) {
            (1, _) => Fp8Strategy::Tensor,
            (n, [r] | [r, 1]) if n == rows && *r == rows => Fp8Strategy::Channel,
            _ => {
                return Err(scale_err(format!(
                    "{scale_name} has shape {scale_shape:?}; kvfleet reads one scale per tensor or one per output channel ([{rows}] or [{rows}, 1]), not block-wise scales"
                )))
            }
        };
        let scale = self.tensor_f32(&scale_name, &scale_shape)?;
        if let Some(bad) = scale.iter().find(|s| !s.is_finite() || **s <= 0.0) {
            return Err(scale_err(format!(
                "{scale_name} holds {bad}; scales must be finite and positive"
            )));
        }
        let input_name = format!("{stem}.input_scale");
        let input_scale = match self.info(&input_name) {
            Some((shape, _)) => self
                .tensor_f32(&input_name, &shape)?
                .iter()
                .copied()
                .reduce(f32::max),
            None => None,
        };
        Ok(Fp8Weight {
            data,
            scale,
            strategy,
            rows,
            cols,
            input_scale,
        })
    }
}

/// The Hugging Face name of a tensor [`Llama::from_tensors`] asks for by its GGUF name.
pub fn hf_tensor_name(gguf: &str) -> String {
    match gguf {
        "token_embd.weight" => return "model.embed_tokens.weight".into(),
        "output_norm.weight" => return "model.norm.weight".into(),
        "output.weight" => return "lm_head.weight".into(),
        _ => {}
    }
    let Some((layer, rest)) = gguf.strip_prefix("blk.").and_then(|r| r.split_once('.')) else {
        return gguf.into();
    };
    let (stem, kind) = rest.rsplit_once('.').unwrap_or((rest, "weight"));
    let hf = match stem {
        "attn_norm" => "input_layernorm",
        "attn_q" => "self_attn.q_proj",
        "attn_k" => "self_attn.k_proj",
        "attn_v" => "self_attn.v_proj",
        "attn_output" => "self_attn.o_proj",
        "attn_q_norm" => "self_attn.q_norm",
        "attn_k_norm" => "self_attn.k_norm",
        "ffn_norm" => "post_attention_layernorm",
        "ffn_gate" => "mlp.gate_proj",
        "ffn_up" => "mlp.up_proj",
        "ffn_down" => "mlp.down_proj",
        other => other,
    };
    format!("model.layers.{layer}.{hf}.{kind}")
}

// === impl checkpoint ===

/// Loads the model of a checkpoint directory.
pub fn load_model(dir: &Path) -> Result<Llama, HfError> {
    let cfg = HfConfig::load(dir)?;
    let w4 = w4_quantization(dir)?;
    quantization(dir)?;
    let st = Safetensors::open(dir)?;
    let (arch, experts) = (
        cfg.llama.arch.clone(),
        cfg.llama.moe.as_ref().map_or(0, |m| m.experts),
    );
    let source = |name: &str, shape: &[usize]| match moe::hf_tensor_names(&arch, name, experts) {
        // An MoE tensor: one of the checkpoint's, or its experts' stacked.
        Some(names) if names.len() > 1 => {
            let mut all = Vec::with_capacity(shape.iter().product());
            for n in names {
                all.extend(st.tensor_f32(&n, &shape[1..])?);
            }
            Ok(all)
        }
        Some(names) => st.tensor_f32(&names[0], shape),
        None => st.tensor_f32(&hf_tensor_name(name), shape),
    };
    let Some(w4) = w4 else {
        return Llama::from_tensors(cfg.llama, cfg.rope_freq_factors.as_deref(), source);
    };
    // 4-bit checkpoints: each projection stays packed ([`super::w4`]).
    let path = dir.to_path_buf();
    let linear = |name: &str, rows: usize, cols: usize| {
        let hf = hf_tensor_name(name);
        let stem = hf.strip_suffix(".weight").unwrap_or(&hf);
        w4.load_linear(stem, rows, cols, |n| st.raw(n))
            .map(|w| w.map(super::linear::Linear::from_w4))
            .map_err(|source| HfError::W4 {
                path: path.clone(),
                source,
            })
    };
    Llama::from_tensors_packed(cfg.llama, cfg.rope_freq_factors.as_deref(), source, linear)
}

/// The checkpoint's FP8 `quantization_config`, validated: `None` for an unquantized one and
/// for a 4-bit one ([`w4_quantization`]); an error naming the field for one kvfleet cannot
/// read (block-wise, other methods).
pub fn quantization(dir: &Path) -> Result<Option<Fp8Config>, HfError> {
    let path = config_path(dir);
    let raw: serde_json::Value = parse_json(&path, &read(&path)?)?;
    if W4Config::from_config_json(&raw)
        .map_err(|source| HfError::W4 {
            path: path.clone(),
            source,
        })?
        .is_some()
    {
        return Ok(None);
    }
    Fp8Config::from_config_json(&raw).map_err(|source| HfError::Quantization { path, source })
}

/// The checkpoint's 4-bit `quantization_config` (AWQ, GPTQ, compressed-tensors W4A16,
/// MXFP4), validated: `None` when it has none or another one; an error naming the field for a
/// 4-bit variant kvfleet cannot read.
pub fn w4_quantization(dir: &Path) -> Result<Option<W4Config>, HfError> {
    let path = config_path(dir);
    let raw: serde_json::Value = parse_json(&path, &read(&path)?)?;
    W4Config::from_config_json(&raw).map_err(|source| HfError::W4 { path, source })
}

/// Loads `tokenizer.json` (and `tokenizer_config.json`, `generation_config.json` when present)
/// of a checkpoint directory.
pub fn load_tokenizer(dir: &Path) -> Result<Tokenizer, HfError> {
    let path = dir.join("tokenizer.json");
    let tj = read(&path)?;
    let cfg_path = dir.join("tokenizer_config.json");
    let cfg = cfg_path.is_file().then(|| read(&cfg_path)).transpose()?;
    let mut t =
        Tokenizer::from_hf_json(&tj, cfg.as_deref()).map_err(|source| HfError::Tokenizer { path, source })?;
    // Current transformers saves the template beside the config, and reads it first.
    let jinja = dir.join("chat_template.jinja");
    if jinja.is_file() {
        t.chat_template = Some(super::chat_template::ChatTemplate::new(&read(&jinja)?));
    }
    // Instruct models often end a turn with a token other than the tokenizer's EOS; the
    // generation config lists them all.
    let gen = dir.join("generation_config.json");
    if gen.is_file() {
        let v: serde_json::Value = parse_json(&gen, &read(&gen)?)?;
        let ids: Vec<u64> = match v.get("eos_token_id") {
            Some(serde_json::Value::Array(a)) => a.iter().filter_map(|x| x.as_u64()).collect(),
            Some(x) => x.as_u64().into_iter().collect(),
            None => Vec::new(),
        };
        for id in ids {
            let id = id as u32;
            if (id as usize) < t.vocab_size() && !t.stop_tokens.contains(&id) {
                t.stop_tokens.push(id);
            }
        }
        t.sampling_defaults = super::generation_config::SamplingDefaults::from_generation_config(&v);
        if t.sampling_defaults.any() {
            let d = &t.sampling_defaults;
            tracing::info!(
                temperature = ?d.temperature,
                top_p = ?d.top_p,
                top_k = ?d.top_k,
                min_p = ?d.min_p,
                repetition_penalty = ?d.repetition_penalty,
                "sampling defaults from generation_config.json, for requests that omit them"
            );
        }
    }
    Ok(t)
}

/// The geometry of `config` (a config.json or a checkpoint directory) and the directory's
/// tokenizer when it has one (else [`Tokenizer::bytes_only`]), for dummy weights made later on
/// the device that serves them.
pub fn load_dummy_config(config: &Path) -> Result<(LlamaConfig, Tokenizer), HfError> {
    let cfg = HfConfig::load(config)?;
    cfg.llama.check()?;
    let dir = config_path(config)
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_default();
    let tokenizer = if dir.join("tokenizer.json").is_file() {
        load_tokenizer(&dir)?
    } else {
        Tokenizer::bytes_only()
    };
    Ok((cfg.llama, tokenizer))
}

/// Random weights of the geometry in `config` on the host, with the tokenizer of
/// [`load_dummy_config`].
pub fn load_dummy(config: &Path, seed: u64) -> Result<(Llama, Tokenizer), HfError> {
    let (cfg, tokenizer) = load_dummy_config(config)?;
    Ok((Llama::dummy(cfg, seed)?, tokenizer))
}

#[cfg(test)]
mod tests;
