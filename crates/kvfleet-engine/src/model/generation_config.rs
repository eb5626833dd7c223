//! The sampling defaults a checkpoint ships in `generation_config.json`, used for a request
//! that omits them, as vLLM's `--generation-config auto` (its default) uses them
//! (vllm-project/vllm `vllm/config/model.py`, `get_diff_sampling_param`: `temperature`,
//! `top_p`, `top_k`, `min_p`, `repetition_penalty`). A GGUF carries none: OpenAI's defaults.

use serde_json::Value;

/// The sampling parameters a model asks for when a request does not say; `None`: OpenAI's
/// default (temperature 1, top-p 1, no top-k, min-p 0, no repetition penalty).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SamplingDefaults {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
}

impl SamplingDefaults {
    /// The defaults in a parsed `generation_config.json`. A value of the wrong type or out of
    /// its range is left out (the server's default applies), as a request would be refused for it.
    pub fn from_generation_config(v: &Value) -> Self {
        let float = |k: &str, ok: fn(f32) -> bool| {
            v.get(k)
                .and_then(Value::as_f64)
                .map(|x| x as f32)
                .filter(|&x| x.is_finite() && ok(x))
        };
        SamplingDefaults {
            temperature: float("temperature", |t| t >= 0.0),
            top_p: float("top_p", |p| p > 0.0 && p <= 1.0),
            top_k: v.get("top_k").and_then(Value::as_i64).filter(|&k| k >= -1),
            min_p: float("min_p", |p| (0.0..=1.0).contains(&p)),
            repetition_penalty: float("repetition_penalty", |r| r > 0.0),
        }
    }

    /// Whether the model sets any default.
    pub fn any(&self) -> bool {
        *self != SamplingDefaults::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sampling_keys_are_read_and_bad_values_left_out() {
        let v = serde_json::json!({
            "bos_token_id": 128000, "do_sample": true, "eos_token_id": [128001, 128009],
            "temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": "high", "min_p": 2.0
        });
        let d = SamplingDefaults::from_generation_config(&v);
        assert_eq!(
            d,
            SamplingDefaults {
                temperature: Some(0.6),
                top_p: Some(0.9),
                top_k: Some(20),
                min_p: None,
                repetition_penalty: None,
            }
        );
        assert!(d.any());
        assert!(!SamplingDefaults::from_generation_config(&serde_json::json!({"eos_token_id": 2})).any());
    }
}
