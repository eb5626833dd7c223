//! The GPU model's lab knobs ([`GpuTuning`], in `super::options`) from the environment: read
//! here and only here ([`GpuTuning::from_env`], [`GpuOptions::with_env`]): the worker, the
//! bench binaries and the GPU tests call it at start, and the worker logs the result.

use super::error::GpuError;
use super::options::{Fp8Fusion, Fp8Scales, GpuOptions, GpuTuning, SKINNY_MAX};

impl Fp8Fusion {
    /// `all`, `none`, or a comma-separated list of `norm`, `glu`, `qkv`, `add`; an unknown word
    /// is ignored with a warning.
    pub(super) fn parse(v: &str) -> Self {
        match v.trim() {
            "" | "all" => return Self::ALL,
            "none" => return Self::NONE,
            _ => {}
        }
        let mut f = Self::NONE;
        for w in v.split(',').map(str::trim) {
            match w {
                "norm" => f.norm = true,
                "glu" => f.glu = true,
                "qkv" => f.qkv = true,
                "add" => f.add = true,
                other => tracing::warn!(
                    word = other,
                    "KVFLEET_FP8_FUSE: not norm, glu, qkv or add; ignored"
                ),
            }
        }
        f
    }
}

impl Fp8Scales {
    fn parse(v: Option<&str>) -> Result<Self, GpuError> {
        match v {
            None | Some("") => Ok(Fp8Scales::Timed),
            Some("0") => Ok(Fp8Scales::PerRow),
            Some("1") => Ok(Fp8Scales::Unit),
            Some(other) => Err(GpuError::Invalid(format!(
                "KVFLEET_FP8_UNIT_SCALES={other}: expected 1 (unit scales in every FP8 GEMM), 0 (per-row \
                 scales wherever cuBLASLt takes them) or unset (each GEMM shape timed both ways once)"
            ))),
        }
    }
}

/// `KVFLEET_FP8_SKINNY`: a token count (at most [`SKINNY_MAX`]), `off` or 0; unset:
/// [`SKINNY_MAX`]; anything else warns and keeps the default.
fn parse_skinny(v: Option<&str>) -> usize {
    match v.map(str::trim) {
        None | Some("") => SKINNY_MAX,
        Some("off") => 0,
        Some(w) => match w.parse::<usize>() {
            Ok(n) => n.min(SKINNY_MAX),
            Err(_) => {
                tracing::warn!(
                    value = w,
                    "KVFLEET_FP8_SKINNY: not a token count or `off`; the default kept"
                );
                SKINNY_MAX
            }
        },
    }
}

/// The one-token FP8 GEMV variants that lost their measurements are gone (bench/RESULTS.md:
/// `int`, `h2` and `mma` were slower on an H200); `KVFLEET_FP8_GEMV` naming one is an error, so
/// that an old bench script does not time the default under another name.
fn check_fp8_gemv(v: Option<&str>) -> Result<(), GpuError> {
    match v.map(str::trim) {
        None | Some("") | Some("cvt") => Ok(()),
        Some(other) => Err(GpuError::Invalid(format!(
            "KVFLEET_FP8_GEMV={other}: only cvt (the default) is left; the int, h2 and mma variants lost \
             their measurements (bench/RESULTS.md) and were removed: unset the variable"
        ))),
    }
}

/// Whether a switch that is on by default stays on: anything but `0`.
fn on_unless_zero(v: Option<&str>) -> bool {
    v.is_none_or(|v| v.trim() != "0")
}

impl GpuTuning {
    /// The knobs from the environment (the names above), today's defaults where unset.
    pub fn from_env() -> Result<Self, GpuError> {
        Self::from_vars(|k| std::env::var(k).ok())
    }

    /// The knobs from `var` (a variable's value, `None` when unset).
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Self, GpuError> {
        let get = var;
        check_fp8_gemv(get("KVFLEET_FP8_GEMV").as_deref())?;
        let d = GpuTuning::default();
        Ok(GpuTuning {
            fp8_gemv_row: on_unless_zero(get("KVFLEET_FP8_GEMV_ROW").as_deref()),
            gemv_blocks_per_sm: get("KVFLEET_GEMV_BLOCKS_PER_SM")
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(d.gemv_blocks_per_sm),
            gemv_qkv_split: on_unless_zero(get("KVFLEET_GEMV_QKV").as_deref()),
            fp8_skinny_max: parse_skinny(get("KVFLEET_FP8_SKINNY").as_deref()),
            fp8_skinny_unit16: get("KVFLEET_FP8_SKINNY_UNIT").is_none_or(|v| v.trim() != "32"),
            fp8_fusion: get("KVFLEET_FP8_FUSE").map_or(Fp8Fusion::ALL, |v| Fp8Fusion::parse(&v)),
            fp8_scales: Fp8Scales::parse(get("KVFLEET_FP8_UNIT_SCALES").as_deref())?,
            fused_merge: on_unless_zero(get("KVFLEET_FUSED_MERGE").as_deref()),
            profile: get("KVFLEET_PROFILE").is_some_and(|v| v == "1"),
        })
    }
}

impl GpuOptions {
    /// These options with the tuning from the environment ([`GpuTuning::from_env`]) and
    /// `KVFLEET_SINGLE_TOKEN_APPEND=0` turning the one-token append into the cache off.
    pub fn with_env(mut self) -> Result<Self, GpuError> {
        self.tuning = GpuTuning::from_env()?;
        self.single_token_append &=
            on_unless_zero(std::env::var("KVFLEET_SINGLE_TOKEN_APPEND").ok().as_deref());
        Ok(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn from(vars: &[(&str, &str)]) -> Result<GpuTuning, GpuError> {
        let vars: Vec<(String, String)> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        GpuTuning::from_vars(|k| vars.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone()))
    }

    #[test]
    fn no_variables_give_the_defaults_the_measurements_kept() {
        assert_eq!(from(&[]).unwrap(), GpuTuning::default());
        let d = GpuTuning::default();
        assert!(d.fp8_gemv_row && d.gemv_qkv_split && d.fp8_skinny_unit16 && d.fused_merge);
        assert_eq!((d.gemv_blocks_per_sm, d.fp8_skinny_max), (4, 8));
        assert_eq!((d.fp8_fusion, d.fp8_scales), (Fp8Fusion::ALL, Fp8Scales::Timed));
        assert!(!d.profile);
    }

    #[test]
    fn each_variable_sets_its_knob() {
        let t = from(&[
            ("KVFLEET_FP8_GEMV_ROW", "0"),
            ("KVFLEET_GEMV_BLOCKS_PER_SM", "0"),
            ("KVFLEET_GEMV_QKV", "0"),
            ("KVFLEET_FP8_SKINNY", "off"),
            ("KVFLEET_FP8_SKINNY_UNIT", "32"),
            ("KVFLEET_FP8_FUSE", "norm,add"),
            ("KVFLEET_FP8_UNIT_SCALES", "1"),
            ("KVFLEET_FUSED_MERGE", "0"),
            ("KVFLEET_PROFILE", "1"),
            ("KVFLEET_FP8_GEMV", "cvt"),
        ])
        .unwrap();
        let only = |norm, glu, qkv, add| Fp8Fusion { norm, glu, qkv, add };
        let want = GpuTuning {
            fp8_gemv_row: false,
            gemv_blocks_per_sm: 0,
            gemv_qkv_split: false,
            fp8_skinny_max: 0,
            fp8_skinny_unit16: false,
            fp8_fusion: only(true, false, false, true),
            fp8_scales: Fp8Scales::Unit,
            fused_merge: false,
            profile: true,
        };
        assert_eq!(t, want);
    }

    #[test]
    fn the_skinny_count_is_capped_and_a_bad_one_keeps_the_default() {
        assert_eq!(parse_skinny(Some("4")), 4);
        assert_eq!(parse_skinny(Some("0")), 0);
        assert_eq!(parse_skinny(Some("64")), SKINNY_MAX);
        assert_eq!(parse_skinny(Some("many")), SKINNY_MAX);
    }

    #[test]
    fn the_fusion_list_reads_its_words_and_ignores_others() {
        let only = |norm, glu, qkv, add| Fp8Fusion { norm, glu, qkv, add };
        assert_eq!(Fp8Fusion::parse(""), Fp8Fusion::ALL);
        assert_eq!(Fp8Fusion::parse("all"), Fp8Fusion::ALL);
        assert_eq!(Fp8Fusion::parse("none"), Fp8Fusion::NONE);
        assert_eq!(Fp8Fusion::parse("glu, qkv"), only(false, true, true, false));
        assert_eq!(Fp8Fusion::parse("norm,bogus"), only(true, false, false, false));
    }

    #[test]
    fn a_removed_fp8_gemv_variant_or_a_bad_scale_path_is_an_error_naming_the_variable() {
        let e = from(&[("KVFLEET_FP8_GEMV", "h2")]).unwrap_err().to_string();
        assert!(e.contains("KVFLEET_FP8_GEMV=h2") && e.contains("unset"), "{e}");
        assert_eq!(Fp8Scales::parse(Some("")).unwrap(), Fp8Scales::Timed);
        assert_eq!(Fp8Scales::parse(Some("0")).unwrap(), Fp8Scales::PerRow);
        let e = from(&[("KVFLEET_FP8_UNIT_SCALES", "yes")])
            .unwrap_err()
            .to_string();
        assert!(e.contains("KVFLEET_FP8_UNIT_SCALES=yes"), "{e}");
    }
}
