//! A Hugging Face `config.json`: the keys kvfleet reads, the other names some families give
//! them, and the defaults transformers gives them when absent.
//!
//! Two readers over the one file, because their callers need different strictness:
//! - [`decoder`] / [`ConfigView`] for the planner (`plan::Geometry::from_hf_config`): any
//!   architecture, alias keys (`n_layer`, `kv_channels`, ...), the decoder of a multimodal
//!   config in its `text_config`; a mistyped key is a [`PlanError::InvalidConfig`] naming it.
//! - [`HfConfigJson`] for the model loader (`kvfleet_engine::model::hf`): the keys it builds
//!   weights from are required, and a mistyped key is reported with its JSON path and position
//!   (deserialize it with `serde_path_to_error`).

use serde::Deserialize;
use serde_json::Value;

use super::PlanError;

/// Keys of the decoder's layer count, in the order they are tried.
pub const LAYERS_KEYS: &[&str] = &["num_hidden_layers", "num_layers", "n_layer", "n_layers"];
/// Keys of the query heads per layer.
pub const HEADS_KEYS: &[&str] = &["num_attention_heads", "n_head", "n_heads"];
/// Keys of the hidden size.
pub const HIDDEN_KEYS: &[&str] = &["hidden_size", "n_embd", "d_model"];
/// Keys of the size of one attention head.
pub const HEAD_DIM_KEYS: &[&str] = &["head_dim", "kv_channels"];

// === impl planner reader ===

/// The decoder section of a config.
#[derive(Clone, Copy, Debug)]
pub struct Decoder<'a> {
    /// `architectures[0]` of the root, else its `model_type`, else `unknown`.
    pub architecture: &'a str,
    /// `model_type` of the decoder section, else of the root, else empty.
    pub model_type: &'a str,
    /// The keys come from the nested `text_config` of a multimodal config.
    pub nested: bool,
    pub keys: ConfigView<'a>,
}

/// Finds the decoder of `config`: its nested `text_config` when that is an object, else the
/// root, which must be an object.
pub fn decoder(config: &Value) -> Result<Decoder<'_>, PlanError> {
    let top = config.as_object().ok_or_else(|| PlanError::InvalidConfig {
        key: "<root>".into(),
        message: "config.json must be a JSON object".into(),
    })?;
    let architecture = top
        .get("architectures")
        .and_then(|a| a.get(0))
        .and_then(Value::as_str)
        .or_else(|| top.get("model_type").and_then(Value::as_str))
        .unwrap_or("unknown");
    let (text, nested) = match top.get("text_config") {
        Some(t) if t.is_object() => (t, true),
        _ => (config, false),
    };
    let model_type = text
        .get("model_type")
        .and_then(Value::as_str)
        .or_else(|| top.get("model_type").and_then(Value::as_str))
        .unwrap_or("");
    Ok(Decoder {
        architecture,
        model_type,
        nested,
        keys: ConfigView(text),
    })
}

/// Typed reads from a config object; a present key of the wrong type is an error.
#[derive(Clone, Copy, Debug)]
pub struct ConfigView<'a>(&'a Value);

impl<'a> ConfigView<'a> {
    pub fn get(&self, key: &str) -> Option<&'a Value> {
        self.0.get(key)
    }
    pub fn has(&self, key: &str) -> bool {
        self.0.get(key).is_some()
    }
    pub fn is_null(&self, key: &str) -> bool {
        self.0.get(key).is_some_and(Value::is_null)
    }
    /// A non-negative integer that fits u32; absent and `null` are `None`.
    pub fn u32(&self, key: &str) -> Result<Option<u32>, PlanError> {
        match self.0.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_u64()
                .and_then(|v| u32::try_from(v).ok())
                .map(Some)
                .ok_or_else(|| PlanError::InvalidConfig {
                    key: key.into(),
                    message: format!("expected a non-negative integer, got {v}"),
                }),
        }
    }
    /// The first of `keys` that is set.
    pub fn first_u32(&self, keys: &[&str]) -> Result<Option<u32>, PlanError> {
        for k in keys {
            if let Some(v) = self.u32(k)? {
                return Ok(Some(v));
            }
        }
        Ok(None)
    }
    /// A boolean; any other value is `None`.
    pub fn bool(&self, key: &str) -> Option<bool> {
        self.0.get(key).and_then(Value::as_bool)
    }
}

// === impl loader reader ===

/// The keys of a Llama-family `config.json` the model loader reads, typed as transformers
/// writes them (unknown keys are ignored).
#[derive(Clone, Debug, Deserialize)]
pub struct HfConfigJson {
    pub architectures: Option<Vec<String>>,
    pub model_type: Option<String>,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: Option<usize>,
    pub head_dim: Option<usize>,
    pub rms_norm_eps: Option<f64>,
    pub rope_theta: Option<f64>,
    pub rope_scaling: Option<Value>,
    /// transformers v5 moves `rope_theta` and the scaling here.
    pub rope_parameters: Option<Value>,
    pub max_position_embeddings: Option<usize>,
    pub vocab_size: usize,
    pub tie_word_embeddings: Option<bool>,
    pub attention_bias: Option<bool>,
    pub mlp_bias: Option<bool>,
    pub hidden_act: Option<String>,
    pub sliding_window: Option<usize>,
    pub use_sliding_window: Option<bool>,
    pub partial_rotary_factor: Option<f64>,
}

impl HfConfigJson {
    /// KV heads; without `num_key_value_heads`, multi-head attention (one per query head).
    pub fn kv_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    /// `head_dim`, else `hidden_size / num_attention_heads`.
    pub fn head_dim(&self) -> usize {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads.max(1))
    }

    /// `rope_theta`, else `rope_parameters.rope_theta`, else 10,000.
    pub fn rope_theta(&self) -> f64 {
        self.rope_theta
            .or_else(|| self.rope_parameters.as_ref()?.get("rope_theta")?.as_f64())
            .unwrap_or(10000.0)
    }

    /// `rope_scaling`, else `rope_parameters` (transformers v5), when set.
    pub fn rope_scaling(&self) -> Option<&Value> {
        self.rope_scaling
            .as_ref()
            .or(self.rope_parameters.as_ref())
            .filter(|v| !v.is_null())
    }

    /// `max_position_embeddings`, else Llama's 2048.
    pub fn max_position_embeddings(&self) -> usize {
        self.max_position_embeddings.unwrap_or(2048)
    }

    /// `rms_norm_eps`, else Llama's 1e-6.
    pub fn rms_norm_eps(&self) -> f64 {
        self.rms_norm_eps.unwrap_or(1e-6)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_decoder_of_a_multimodal_config_is_its_text_config() {
        let c = json!({"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
            "text_config": {"model_type": "gemma3_text", "num_hidden_layers": 34}});
        let d = decoder(&c).unwrap();
        assert_eq!(
            (d.architecture, d.model_type, d.nested),
            ("Gemma3ForConditionalGeneration", "gemma3_text", true)
        );
        assert_eq!(d.keys.first_u32(LAYERS_KEYS).unwrap(), Some(34));
        assert!(decoder(&json!([1])).is_err());
    }

    #[test]
    fn alias_keys_and_mistyped_values() {
        let c = json!({"n_layer": 12, "n_head": -1, "multi_query_attention": "yes"});
        let d = decoder(&c).unwrap();
        assert_eq!(d.architecture, "unknown");
        assert_eq!(d.keys.first_u32(LAYERS_KEYS).unwrap(), Some(12));
        let e = d.keys.first_u32(HEADS_KEYS).unwrap_err().to_string();
        assert!(e.contains("n_head") && e.contains("non-negative"), "{e}");
        assert_eq!(d.keys.bool("multi_query_attention"), None);
    }

    #[test]
    fn loader_defaults_follow_transformers() {
        let c: HfConfigJson = serde_json::from_value(json!({"hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "vocab_size": 100, "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}}))
        .unwrap();
        assert_eq!((c.kv_heads(), c.head_dim()), (4, 16));
        assert_eq!(c.rope_theta(), 1e6);
        assert_eq!(
            c.rope_scaling().and_then(|s| s.get("rope_type")),
            Some(&json!("default"))
        );
        assert_eq!((c.max_position_embeddings(), c.rms_norm_eps()), (2048, 1e-6));
    }
}
