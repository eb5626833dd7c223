//! What each vLLM release accepts, as data with sources: which command-line flags exist,
//! which `--kv-cache-dtype` values and attention backends, how the backend is chosen (flag
//! or environment variable), and which compat rules a release lifts.
//!
//! The controller renders only what the release of the pod's image accepts, and validation
//! denies a spec asking for something its release lacks, naming the release that has it.
//! Adding a row here (a new release, a rule a release lifts) changes both without code.
//!
//! Sources: `vllm#N` = vllm-project/vllm pull request or issue; "docs vX" = the
//! `vllm.config.cache` page of docs.vllm.ai for that release. "D" documented, "I" inferred
//! (the first release after a merge date, or the oldest release kvfleet knows).

use std::cmp::Ordering;
use std::fmt;

use serde::Serialize;

use super::vocab::{AttentionBackend as B, KvCacheDtype as D, SpeculativeMethod};

/// A vLLM release number, `MAJOR.MINOR.PATCH`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
pub struct VllmVersion {
    pub major: u32,
    pub minor: u32,
    pub patch: u32,
}

impl Ord for VllmVersion {
    fn cmp(&self, other: &Self) -> Ordering {
        (self.major, self.minor, self.patch).cmp(&(other.major, other.minor, other.patch))
    }
}
impl PartialOrd for VllmVersion {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl fmt::Display for VllmVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}

const fn v(major: u32, minor: u32, patch: u32) -> VllmVersion {
    VllmVersion { major, minor, patch }
}

impl VllmVersion {
    /// Parses `0.12`, `v0.12.0`, `0.20.1rc1` or `v0.21.0-cu130`: the leading `MAJOR.MINOR[.PATCH]`.
    pub fn parse(s: &str) -> Option<VllmVersion> {
        let s = s.trim().trim_start_matches('v');
        let mut nums = [0u32; 3];
        let mut count = 0;
        for (i, part) in s.splitn(3, '.').enumerate() {
            let digits: String = part.chars().take_while(|c| c.is_ascii_digit()).collect();
            if digits.is_empty() {
                break;
            }
            nums[i] = digits.parse().ok()?;
            count = i + 1;
            if digits.len() != part.len() {
                break;
            }
        }
        (count >= 2).then(|| v(nums[0], nums[1], nums[2]))
    }

    /// The version in an image reference's tag (`vllm/vllm-openai:v0.12.0`), if the tag is one.
    pub fn from_image(image: &str) -> Option<VllmVersion> {
        let without_digest = image.split('@').next().unwrap_or(image);
        let last = without_digest.rsplit('/').next().unwrap_or(without_digest);
        let (_, tag) = last.split_once(':')?;
        VllmVersion::parse(tag)
    }

    /// The official image of this release.
    pub fn image(self) -> String {
        format!("{VLLM_IMAGE_REPOSITORY}:v{self}")
    }
}

/// Repository of vLLM's OpenAI-compatible server image.
pub const VLLM_IMAGE_REPOSITORY: &str = "vllm/vllm-openai";

/// A release kvfleet knows, with where its facts come from.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Release {
    pub version: VllmVersion,
    pub note: &'static str,
}

/// The releases the table describes, oldest first. Every fact below is stated for these;
/// a newer release is treated as the newest here (facts carry forward until a row says
/// otherwise), an older one is refused.
pub static RELEASES: &[Release] = &[
    Release {
        version: v(0, 11, 0),
        note: "kvfleet's previous default image; backend through VLLM_ATTENTION_BACKEND",
    },
    Release {
        version: v(0, 12, 0),
        note: "--attention-backend (vllm#26315)",
    },
    Release {
        version: v(0, 13, 0),
        note: "--max-model-len auto (vllm#29431)",
    },
    Release {
        version: v(0, 14, 0),
        note: "VLLM_ATTENTION_BACKEND removed (deprecation of vllm#26315 named v0.14.0)",
    },
    Release {
        version: v(0, 15, 0),
        note: "multi-node without Ray: --nnodes, --node-rank, --master-addr, --headless (vllm#23691)",
    },
    Release {
        version: v(0, 19, 0),
        note: "float16 KV cache dtype (vllm#37199)",
    },
    Release {
        version: v(0, 20, 0),
        note: "last release before the Gemma 4 capacity change (vllm#43308); DFlash speculative decoding (vllm#36847)",
    },
    Release {
        version: v(0, 21, 0),
        note: "nvfp4 KV cache on sm_100 (vllm#40177); GPU KV cache size = max_concurrency x max_model_len",
    },
    Release {
        version: v(0, 29, 0),
        note: "kvfleet's default image",
    },
];

/// The oldest release kvfleet renders for.
pub fn oldest() -> VllmVersion {
    RELEASES[0].version
}

/// The newest release the table describes.
pub fn newest() -> VllmVersion {
    RELEASES[RELEASES.len() - 1].version
}

/// The release of kvfleet's default image. Every flag the controller may render exists in it
/// (tests/vllm_versions.rs renders each example for it).
pub const DEFAULT_VERSION: VllmVersion = v(0, 29, 0);

/// kvfleet's default vLLM image.
pub fn default_image() -> String {
    DEFAULT_VERSION.image()
}

/// Since when something exists (and, for what was removed, until when).
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Availability {
    /// First release that has it; `None`: no release in the table has it.
    pub since: Option<VllmVersion>,
    /// First release that no longer has it.
    pub removed_in: Option<VllmVersion>,
    pub source: &'static str,
}

impl Availability {
    /// In every release of the table.
    pub const fn always(source: &'static str) -> Self {
        Availability {
            since: ALWAYS,
            removed_in: None,
            source,
        }
    }

    /// From release `since` on.
    pub const fn since(since: VllmVersion, source: &'static str) -> Self {
        Availability {
            since: Some(since),
            removed_in: None,
            source,
        }
    }

    /// In no release (kvfleet's own names).
    pub const fn never(source: &'static str) -> Self {
        Availability {
            since: None,
            removed_in: None,
            source,
        }
    }

    /// The same, gone from release `removed_in` on.
    pub const fn removed_in(self, removed_in: VllmVersion) -> Self {
        Availability {
            removed_in: Some(removed_in),
            ..self
        }
    }

    pub fn at(&self, version: VllmVersion) -> bool {
        self.since.is_some_and(|s| version >= s) && self.removed_in.is_none_or(|r| version < r)
    }
}

const ALWAYS: Option<VllmVersion> = Some(v(0, 11, 0));

/// A command-line flag of `vllm.entrypoints.openai.api_server` that kvfleet renders.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Flag {
    pub flag: &'static str,
    pub availability: Availability,
}

const fn flag(flag: &'static str, availability: Availability) -> Flag {
    Flag { flag, availability }
}

const ENGINE_ARGS: &str = "vllm engine arguments, docs.vllm.ai serve CLI reference (D)";

/// Every flag the controller renders, with the releases that accept it.
pub static FLAGS: &[Flag] = &[
    flag("--model", Availability::always(ENGINE_ARGS)),
    flag("--served-model-name", Availability::always(ENGINE_ARGS)),
    flag("--host", Availability::always(ENGINE_ARGS)),
    flag("--port", Availability::always(ENGINE_ARGS)),
    flag("--kv-cache-dtype", Availability::always(ENGINE_ARGS)),
    flag("--max-model-len", Availability::always(ENGINE_ARGS)),
    flag("--max-num-seqs", Availability::always(ENGINE_ARGS)),
    flag("--max-num-batched-tokens", Availability::always(ENGINE_ARGS)),
    flag("--block-size", Availability::always(ENGINE_ARGS)),
    flag("--gpu-memory-utilization", Availability::always(ENGINE_ARGS)),
    flag("--tensor-parallel-size", Availability::always(ENGINE_ARGS)),
    flag("--pipeline-parallel-size", Availability::always(ENGINE_ARGS)),
    // `spec.engine.quantization: fp8`: quantize an unquantized checkpoint at load (vLLM's
    // `fp8` method, vllm/model_executor/layers/quantization/fp8.py).
    flag("--quantization", Availability::always(ENGINE_ARGS)),
    // Prefix caching is on by default in the V1 engine, the only engine of every release in this
    // table; kvfleet renders only the `--no-` form, when the spec turns it off.
    flag("--no-enable-prefix-caching", Availability::always("vllm engine arguments: --enable-prefix-caching, --no-enable-prefix-caching (argparse BooleanOptionalAction) (D)")),
    // `spec.engine.speculative`: one JSON object (vllm/config/speculative.py SpeculativeConfig),
    // in V1 since 0.8 (before it: --speculative-model '[ngram]', --ngram-prompt-lookup-max).
    flag("--speculative-config", Availability::always("vllm engine arguments: --speculative-config (SpeculativeConfig as JSON); docs/features/spec_decode.md (D)")),
    // KV events (vllm/distributed/kv_events.py, KVEventsConfig), in releases since 0.9.
    flag("--kv-events-config", Availability::always("vllm engine arguments: --kv-events-config (KVEventsConfig: enable_kv_cache_events, publisher, endpoint, topic) (D)")),
    flag("--load-format", Availability::always(ENGINE_ARGS)),
    flag("--download-dir", Availability::always(ENGINE_ARGS)),
    flag("--nnodes", MULTI_NODE),
    flag("--node-rank", MULTI_NODE),
    flag("--master-addr", MULTI_NODE),
    flag("--master-port", MULTI_NODE),
    flag("--headless", MULTI_NODE),
    flag("--attention-backend", Availability::since(v(0, 12, 0), "vllm#26315 (merged 2025-11, AttentionConfig; D)")),
];

/// vLLM's multi-node launch without Ray (the multiprocessing executor across nodes): every
/// node runs `vllm serve` with the same parallelism plus `--nnodes N --node-rank R
/// --master-addr LEADER`, and the nodes other than rank 0 add `--headless` (no API server).
/// vllm#23691 ("[V1] Support MP Executor for multi node distributed inference", opened
/// 2025-08-26) added the flags. Its merge date is not in what kvfleet could read, so the
/// first release is not known; 0.15.0 is the oldest release a public source states has them
/// (Center-for-AI-Innovation/LLMFlux#137, "vLLM 0.15.0's native rendezvous flags"). kvfleet
/// claims 0.15.0 and denies multi-node specs on older releases: never a flag the release may
/// lack. Lower `since` when a source shows an older release has them.
pub const MULTI_NODE: Availability = Availability::since(
    v(0, 15, 0),
    "vllm#23691 (flags); 0.15.0 stated by Center-for-AI-Innovation/LLMFlux#137 (D); older releases not known",
);

/// The environment variable that chose the backend before `--attention-backend`.
pub const ATTENTION_BACKEND_ENV: &str = "VLLM_ATTENTION_BACKEND";

/// Releases that read [`ATTENTION_BACKEND_ENV`].
pub const ATTENTION_BACKEND_ENV_AVAILABILITY: Availability =
    Availability::always("vllm#26315 deprecation warning \"will be removed in v0.14.0\"; vllm#30564 (D)")
        .removed_in(v(0, 14, 0));

/// `--max-model-len auto` (fit the context to the KV pool). kvfleet renders a number (its
/// capacity plan needs one) but records the fact for docs/vllm.md.
///
/// Known: vllm#29431 ("Add `--max-model-len auto` to auto-fit context to available memory"),
/// whose test logs are dated 11-25 (2025). Not known: the first release that ships it; 0.13.0
/// is the first row after that date. kvfleet never renders `auto`, so this row informs
/// docs/vllm.md only.
pub const MAX_MODEL_LEN_AUTO: Availability = Availability::since(
    v(0, 13, 0),
    "vllm#29431 (test logs 2025-11-25; first release not found, 0.13.0 assumed: I); also cited by kaito-project/kaito#2156",
);

/// Whether `flag` exists in `version`; unknown flags (extraArgs) are not judged.
pub fn flag_at(flag: &str, version: VllmVersion) -> Option<bool> {
    FLAGS
        .iter()
        .find(|f| f.flag == flag)
        .map(|f| f.availability.at(version))
}

/// The `--kv-cache-dtype` values each release accepts (`vllm.config.cache.CacheDType`).
pub fn kv_dtype_availability(dtype: D) -> Availability {
    match dtype {
        D::Auto | D::Fp8 | D::Fp8E4m3 | D::Fp8E5m2 => Availability::always("docs v0.9.2 CacheDType auto, fp8, fp8_e4m3, fp8_e5m2 (D)"),
        // Known: docs v0.11.1 list bfloat16 in CacheDType, docs v0.10.2 do not. Not
        // known: whether 0.11.0 (between them) has it; the table's oldest row is
        // 0.11.0 and kvfleet assumes it does. A spec asking for bfloat16 on 0.11.0 is the
        // one case this row could get wrong (the fix would be `since: 0.11.1`).
        D::Bfloat16 => Availability::always("docs v0.11.1 CacheDType adds bfloat16 (absent in v0.10.2) (D); 0.11.0 not known, assumed (I)"),
        // Known: vllm#37199 (merged 2026-03-16) and docs v0.21.0, whose TRITON_ATTN
        // backend lists "float16" among its supported_kv_cache_dtypes. Not known: the
        // first release; 0.19.0 is the first row after the merge date.
        D::Float16 => Availability::since(v(0, 19, 0), "vllm#37199 adds float16 to CacheDType (merged 2026-03-16); present in docs v0.21.0 triton_attn (D); first release 0.19.0 assumed (I)"),
        D::Nvfp4 => Availability::since(v(0, 21, 0), "vllm#40177 nvfp4 KV cache through FlashInfer trtllm-gen on sm_100 (released in v0.21.0; D)"),
    }
}

/// The attention backend names each release accepts.
pub fn backend_availability(backend: B) -> Availability {
    match backend {
        B::Auto => Availability::always("kvfleet: auto renders no backend at all"),
        B::FlashAttn | B::FlashInfer | B::FlexAttention | B::TreeAttn => {
            Availability::always("vllm docs/design/attention_backends.md (D)")
        }
        // Known: vllm#14071 named the backend TRITON_ATTN_VLLM_V1 (2025-03);
        // vllm#24648 (approved 2025-09-22) split triton_attn into a Triton-only backend and
        // rocm_attn; docs v0.13.0 list both modules, docs v0.10.2 only the old one; docs
        // v0.21.0 name it "TRITON_ATTN". Not known: whether 0.11.0 and 0.12.0 accept the
        // name TRITON_ATTN (the split fell between 0.10.2 and 0.13.0).
        B::TritonAttn => Availability::always(
            "vllm#14071, vllm#24648; docs v0.13.0 and v0.21.0 (D); 0.11.0 and 0.12.0 not known, assumed (I)",
        ),
        B::FlashMla | B::CutlassMla | B::FlashInferMla | B::TritonMla => {
            Availability::always("vllm docs/design/attention_backends.md (D)")
        }
        B::KvfleetCuda | B::KvfleetCpu => Availability::never("kvfleet's own backends, never vLLM's"),
    }
}

/// The `method` values of `--speculative-config` each release accepts
/// (vllm/config/speculative.py `SpeculativeMethod`).
pub fn speculative_method_availability(method: SpeculativeMethod) -> Availability {
    match method {
        // The n-gram proposer runs in the V1 engine since 0.8 (vllm/v1/spec_decode/ngram_proposer.py)
        // and `method: ngram` with prompt_lookup_max/min is the documented form of every release
        // of the table (docs/features/spec_decode.md, "Speculating by matching n-grams in the prompt").
        SpeculativeMethod::Ngram => Availability::always(
            "vllm v1/spec_decode/ngram_proposer.py; docs/features/spec_decode.md ngram example (D)",
        ),
        // Known: vllm#16937 "[V1][Spec Decode] EAGLE-3 Support" (merged 2025-04, before 0.9.0)
        // added `eagle3`; vllm#21737 documents that EAGLE-3 drafters need `method: eagle3`.
        // The target must implement SupportsEagle3 (Llama, Qwen, ... per release): vLLM checks
        // that at start, admission cannot (it does not read the architecture).
        SpeculativeMethod::Eagle3 => Availability::always(
            "vllm#16937 (merged 2025-04), vllm#21737 docs/features/spec_decode.md (D)",
        ),
        // Known: vllm#36847 added `dflash` (vllm-project/vllm-ascend#8118 calls it the merged
        // upstream support and cherry-picks its commit onto v0.19.0, so 0.19.0 lacks it);
        // NVIDIA-NeMo/Automodel#2913 states "available since vLLM 0.20". Earlier attempts
        // (vllm#32206, vllm#34014, vllm#36767) were closed unmerged.
        SpeculativeMethod::Dflash => Availability::since(
            v(0, 20, 0),
            "vllm#36847 (absent from v0.19.0 per vllm-project/vllm-ascend#8118); 0.20.0 stated by NVIDIA-NeMo/Automodel#2913 (D)",
        ),
    }
}

/// `disable_by_batch_size` of `--speculative-config`: read by the V0 engine only. vLLM never
/// reads it since 0.10.0, when V0 was removed (vllm#25112), and vllm#35060 (2026-02) removed
/// the key. kvfleet renders it for no release: on the kvfleet runtime it is a worker setting.
pub const SPEC_DISABLE_BY_BATCH_SIZE: Availability =
    Availability::never("vllm#25112 (unused since 0.10.0, V0 removed), vllm#35060 (key removed) (D)");

/// A compat rule that holds only up to a release. Rules not listed hold for every release.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct RuleLift {
    pub rule: &'static str,
    /// First release where the rule no longer holds; `None`: still holds in every release.
    pub lifted_in: Option<VllmVersion>,
    pub source: &'static str,
}

/// Rules whose fact is expected to change with a release. When a release lifts one, set
/// `lifted_in` and the denial disappears for that release and later ones.
pub static RULE_LIFTS: &[RuleLift] = &[
    RuleLift {
        rule: "vllm.nvfp4-kv-needs-sm100",
        lifted_in: None,
        source: "nvfp4 KV on sm_120 and sm_8x is proposed, not merged: vllm#46329, vllm#50288 (closed), vllm#46963 (open)",
    },
    RuleLift {
        rule: "vllm.flashinfer-sm120-prefill-crash",
        lifted_in: None,
        source: "seen in vLLM 0.15; no release known to fix it (vllm#40153, vllm#40677)",
    },
];

/// Whether compat rule `id` holds in `version` (`None`: the rule holds).
pub fn rule_holds(id: &str, version: Option<VllmVersion>) -> bool {
    match (RULE_LIFTS.iter().find(|l| l.rule == id), version) {
        (
            Some(RuleLift {
                lifted_in: Some(l), ..
            }),
            Some(v),
        ) => v < *l,
        _ => true,
    }
}

/// How the attention backend reaches vLLM in `version`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendChoice {
    /// `--attention-backend NAME` (0.12 on).
    Flag,
    /// `VLLM_ATTENTION_BACKEND=NAME` (before 0.12).
    Env,
}

pub fn backend_choice(version: VllmVersion) -> BackendChoice {
    if flag_at("--attention-backend", version) == Some(true) {
        BackendChoice::Flag
    } else {
        BackendChoice::Env
    }
}

/// Where the version of a spec came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum VersionSource {
    /// `spec.engine.vllm.version`.
    Field,
    /// The tag of `spec.engine.image`.
    ImageTag,
    /// kvfleet's default image.
    Default,
}

/// Why a spec's vLLM version is unknown or unusable.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum VersionError {
    #[error("spec.engine.image {image:?} has no version in its tag (a digest, latest or nightly); set spec.engine.vllm.version to the vLLM release the image holds, e.g. \"{d}\"", d = DEFAULT_VERSION)]
    Unknown { image: String },
    #[error("spec.engine.vllm.version {0:?} is not of the form MAJOR.MINOR[.PATCH], e.g. \"{d}\"", d = DEFAULT_VERSION)]
    Invalid(String),
    #[error("spec.engine.vllm.version {field} contradicts the tag of spec.engine.image {image:?} ({tag}); remove spec.engine.vllm.version or make it equal to the image's release")]
    Contradiction {
        field: VllmVersion,
        image: String,
        tag: VllmVersion,
    },
    #[error("vLLM {0} is older than {oldest}, the oldest release kvfleet renders flags for; use image {default} (or at least {oldest})", oldest = oldest(), default = default_image())]
    TooOld(VllmVersion),
}

/// The vLLM release of a spec: `spec.engine.vllm.version`, else the image tag, else (no image)
/// the default image's release.
pub fn resolve(
    image: Option<&str>,
    field: Option<&str>,
) -> Result<(VllmVersion, VersionSource), VersionError> {
    let from_field = match field {
        Some(f) => Some(VllmVersion::parse(f).ok_or_else(|| VersionError::Invalid(f.to_string()))?),
        None => None,
    };
    let from_tag = image.and_then(VllmVersion::from_image);
    let (version, source) = match (from_field, from_tag, image) {
        (Some(f), Some(t), Some(i)) if f != t => {
            return Err(VersionError::Contradiction {
                field: f,
                image: i.to_string(),
                tag: t,
            })
        }
        (Some(f), _, _) => (f, VersionSource::Field),
        (None, Some(t), _) => (t, VersionSource::ImageTag),
        (None, None, Some(i)) => return Err(VersionError::Unknown { image: i.to_string() }),
        (None, None, None) => (DEFAULT_VERSION, VersionSource::Default),
    };
    if version < oldest() {
        return Err(VersionError::TooOld(version));
    }
    Ok((version, source))
}

/// The first release of the table at or after `since` (for "use image ..." fixes).
pub fn first_release_with(a: &Availability) -> Option<VllmVersion> {
    let since = a.since?;
    RELEASES
        .iter()
        .map(|r| r.version)
        .find(|v| *v >= since && a.at(*v))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_parse_from_tags_and_fields() {
        assert_eq!(
            VllmVersion::from_image("vllm/vllm-openai:v0.11.0"),
            Some(v(0, 11, 0))
        );
        assert_eq!(
            VllmVersion::from_image("registry:5000/vllm/vllm-openai:v0.21.1-cu130"),
            Some(v(0, 21, 1))
        );
        assert_eq!(VllmVersion::from_image("vllm/vllm-openai:latest"), None);
        assert_eq!(
            VllmVersion::from_image("registry:5000/vllm"),
            None,
            "a port is not a tag"
        );
        assert_eq!(VllmVersion::from_image("vllm/vllm-openai@sha256:abcd"), None);
        assert_eq!(VllmVersion::parse("0.20.1rc1"), Some(v(0, 20, 1)));
        assert_eq!(VllmVersion::parse("0.21"), Some(v(0, 21, 0)));
        assert_eq!(VllmVersion::parse("latest"), None);
        assert!(v(0, 9, 9) < v(0, 10, 0), "numeric, not textual order");
    }

    #[test]
    fn the_backend_is_an_env_var_before_0_12_and_a_flag_from_0_12() {
        assert_eq!(backend_choice(v(0, 11, 0)), BackendChoice::Env);
        assert_eq!(backend_choice(v(0, 12, 0)), BackendChoice::Flag);
        assert!(ATTENTION_BACKEND_ENV_AVAILABILITY.at(v(0, 13, 0)));
        assert!(!ATTENTION_BACKEND_ENV_AVAILABILITY.at(v(0, 14, 0)));
        // Every release has one way to choose the backend.
        for r in RELEASES {
            let flag = flag_at("--attention-backend", r.version) == Some(true);
            let env = ATTENTION_BACKEND_ENV_AVAILABILITY.at(r.version);
            assert!(flag || env, "{}", r.version);
        }
    }

    #[test]
    fn nvfp4_kv_exists_from_0_21_and_its_sm100_rule_still_holds() {
        assert!(!kv_dtype_availability(D::Nvfp4).at(v(0, 20, 0)));
        assert!(kv_dtype_availability(D::Nvfp4).at(v(0, 21, 0)));
        assert_eq!(
            first_release_with(&kv_dtype_availability(D::Nvfp4)),
            Some(v(0, 21, 0))
        );
        assert!(rule_holds("vllm.nvfp4-kv-needs-sm100", Some(newest())));
    }

    #[test]
    fn dflash_exists_from_0_20_and_ngram_and_eagle3_in_every_release() {
        let dflash = speculative_method_availability(SpeculativeMethod::Dflash);
        assert!(!dflash.at(v(0, 19, 0)));
        assert!(dflash.at(v(0, 20, 0)));
        assert_eq!(first_release_with(&dflash), Some(v(0, 20, 0)));
        for m in [SpeculativeMethod::Ngram, SpeculativeMethod::Eagle3] {
            assert!(speculative_method_availability(m).at(oldest()), "{m}");
        }
        assert!(!SPEC_DISABLE_BY_BATCH_SIZE.at(newest()));
        assert_eq!(flag_at("--speculative-config", oldest()), Some(true));
    }

    #[test]
    fn the_version_comes_from_the_field_the_tag_or_the_default() {
        assert_eq!(resolve(None, None), Ok((DEFAULT_VERSION, VersionSource::Default)));
        assert_eq!(
            resolve(Some("vllm/vllm-openai:v0.12.0"), None),
            Ok((v(0, 12, 0), VersionSource::ImageTag))
        );
        assert_eq!(
            resolve(Some("my.registry/team/vllm:prod"), Some("0.21.1")),
            Ok((v(0, 21, 1), VersionSource::Field))
        );
        assert!(matches!(
            resolve(Some("my.registry/team/vllm:prod"), None),
            Err(VersionError::Unknown { .. })
        ));
        assert!(matches!(
            resolve(Some("vllm/vllm-openai:v0.12.0"), Some("0.21")),
            Err(VersionError::Contradiction { .. })
        ));
        let old = resolve(Some("vllm/vllm-openai:v0.10.2"), None).unwrap_err();
        assert!(
            old.to_string().contains("0.10.2") && old.to_string().contains("0.11.0"),
            "{old}"
        );
    }

    #[test]
    fn the_default_release_has_every_flag_and_value_kvfleet_renders() {
        for f in FLAGS {
            assert!(
                f.availability.at(DEFAULT_VERSION),
                "{} missing in {DEFAULT_VERSION}",
                f.flag
            );
        }
        for d in D::ALL {
            assert!(kv_dtype_availability(d).at(DEFAULT_VERSION), "{d}");
        }
        for m in SpeculativeMethod::ALL {
            assert!(speculative_method_availability(m).at(DEFAULT_VERSION), "{m}");
        }
        assert_eq!(DEFAULT_VERSION, newest());
    }
}
