//! What kvfleet's own engine serves, per device: the model architectures its loaders read
//! and the weight formats its linear ops run. Admission reads this table so that a
//! `runtime: kvfleet` deployment it admits can start; the engine crate's tests check that
//! its loaders and this table agree (`crates/kvfleet-engine/src/model/hf.rs`,
//! `served_architectures_agree_with_the_admission_table`).

use super::vocab::Quantization;

/// Where a part of the engine runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Devices {
    /// The CUDA engine (`KVFLEET_CUDA`).
    pub cuda: bool,
    /// The CPU engine (`KVFLEET_CPU`).
    pub cpu: bool,
}

const BOTH: Devices = Devices {
    cuda: true,
    cpu: true,
};
const CPU: Devices = Devices {
    cuda: false,
    cpu: true,
};
const NONE: Devices = Devices {
    cuda: false,
    cpu: false,
};

/// One architecture the engine loads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Served {
    /// Hugging Face `architectures[0]`.
    pub name: &'static str,
    /// Where it runs.
    pub devices: Devices,
    /// Read from a safetensors checkpoint (`config.json`); otherwise from GGUF only.
    pub safetensors: bool,
}

/// The architectures the engine loads (GGUF files of llama.cpp's `llama`, `mistral`, `qwen2`,
/// `qwen3` and `gemma3` architectures are these).
pub const ARCHITECTURES: &[Served] = &[
    served("LlamaForCausalLM", BOTH, true),
    served("MistralForCausalLM", BOTH, true),
    served("Qwen2ForCausalLM", BOTH, true),
    served("Qwen3ForCausalLM", BOTH, true),
    served("Gemma3ForCausalLM", BOTH, false),
    // Mixture of experts: the CPU engine's `model/moe.rs`; the CUDA engine refuses them.
    served("Qwen3MoeForCausalLM", CPU, true),
    served("Qwen2MoeForCausalLM", CPU, true),
    served("OlmoeForCausalLM", CPU, true),
    served("MixtralForCausalLM", CPU, true),
];

const fn served(name: &'static str, devices: Devices, safetensors: bool) -> Served {
    Served {
        name,
        devices,
        safetensors,
    }
}

/// How the engine serves an architecture; `None` for one it does not load.
pub fn architecture(name: &str) -> Option<Served> {
    ARCHITECTURES.iter().find(|a| a.name == name).copied()
}

/// The served architectures on one device, for messages: "A, B and C".
pub fn architectures_on(cuda: bool) -> String {
    let names: Vec<&str> = ARCHITECTURES
        .iter()
        .filter(|a| if cuda { a.devices.cuda } else { a.devices.cpu })
        .map(|a| a.name)
        .collect();
    match names.split_last() {
        None => "none".to_string(),
        Some((last, [])) => (*last).to_string(),
        Some((last, rest)) => format!("{} and {last}", rest.join(", ")),
    }
}

/// Mixture-of-experts layers (router, experts).
pub const MOE: Devices = CPU;

/// Where the engine runs a checkpoint's weight quantization.
pub fn quantization(q: Quantization) -> Devices {
    match q {
        Quantization::None | Quantization::Fp8 | Quantization::Gguf => BOTH,
        // Packed 4-bit linear layers on the CPU engine (model/w4/); no GPU kernels yet.
        Quantization::Awq | Quantization::Gptq | Quantization::W4a16 => CPU,
        // MXFP4 comes with gpt-oss's experts, which no engine serves yet.
        Quantization::Mxfp4 | Quantization::Int8 | Quantization::Nvfp4 => NONE,
    }
}

/// The quantizations the engine runs on one device, for messages.
pub fn quantizations_on(cuda: bool) -> String {
    const ALL: [Quantization; 9] = [
        Quantization::None,
        Quantization::Fp8,
        Quantization::Awq,
        Quantization::Gptq,
        Quantization::W4a16,
        Quantization::Mxfp4,
        Quantization::Int8,
        Quantization::Nvfp4,
        Quantization::Gguf,
    ];
    let names: Vec<&str> = ALL
        .iter()
        .filter(|q| {
            let d = quantization(**q);
            if cuda {
                d.cuda
            } else {
                d.cpu
            }
        })
        .map(|q| q.as_str())
        .collect();
    names.join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_list_what_each_device_serves() {
        assert_eq!(
            architectures_on(true),
            "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM and Gemma3ForCausalLM"
        );
        assert_eq!(
            architectures_on(false),
            "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Gemma3ForCausalLM, \
             Qwen3MoeForCausalLM, Qwen2MoeForCausalLM, OlmoeForCausalLM and MixtralForCausalLM"
        );
        assert!(quantizations_on(true).starts_with("none, fp8"));
        assert!(architecture("GptOssForCausalLM").is_none());
        assert_eq!(quantizations_on(false), "none, fp8, awq, gptq, w4a16, gguf");
    }
}
