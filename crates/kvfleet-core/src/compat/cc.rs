//! CUDA compute capabilities, parsed as numbers (GFD labels are strings, and "10" < "9" as text).

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A CUDA compute capability such as 9.0 (sm_90) or 12.1 (sm_121).
///
/// Ordering is numeric: major first, then minor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ComputeCapability {
    pub major: u32,
    pub minor: u32,
}

impl ComputeCapability {
    pub const fn new(major: u32, minor: u32) -> Self {
        Self { major, minor }
    }

    /// The architecture family, `cc // 10` in sm numbering: 10.3 is family 100, 12.1 is
    /// family 120, 11.0 (Jetson Thor, sm_101 before CUDA 13) is family 110 of its own.
    pub fn family(self) -> u32 {
        self.major * 10
    }

    /// The sm number, e.g. 90 for 9.0 and 103 for 10.3.
    pub fn sm_number(self) -> u32 {
        self.major * 10 + self.minor
    }

    /// `sm_90`, `sm_103`, ...
    pub fn sm(self) -> String {
        format!("sm_{}", self.sm_number())
    }

    /// Parses the GFD label pair `nvidia.com/gpu.compute.major` / `.minor`.
    pub fn from_labels(major: &str, minor: &str) -> Result<Self, ParseComputeCapabilityError> {
        let err = || ParseComputeCapabilityError {
            value: format!("{major}.{minor}"),
        };
        let major = major.trim().parse::<u32>().map_err(|_| err())?;
        let minor = minor.trim().parse::<u32>().map_err(|_| err())?;
        if major == 0 || major > 99 || minor > 9 {
            return Err(err());
        }
        Ok(Self { major, minor })
    }
}

/// A string that is not a compute capability.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid compute capability {value:?}; write it as major.minor, e.g. \"8.6\" or \"12.0\" (or sm_86)")]
pub struct ParseComputeCapabilityError {
    pub value: String,
}

impl FromStr for ComputeCapability {
    type Err = ParseComputeCapabilityError;

    /// Accepts `major.minor` ("9.0", "12.1") and `sm_NN` ("sm_90", "sm_121", "sm_100a").
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let t = s.trim();
        if let Some((major, minor)) = t.split_once('.') {
            return Self::from_labels(major, minor)
                .map_err(|_| ParseComputeCapabilityError { value: s.to_string() });
        }
        let err = || ParseComputeCapabilityError { value: s.to_string() };
        let digits = t
            .strip_prefix("sm_")
            .or_else(|| t.strip_prefix("SM_"))
            .ok_or_else(err)?;
        let digits = digits.trim_end_matches(['a', 'f']);
        if digits.len() < 2 || !digits.bytes().all(|b| b.is_ascii_digit()) {
            return Err(err());
        }
        let (major, minor) = digits.split_at(digits.len() - 1);
        Self::from_labels(major, minor).map_err(|_| err())
    }
}

impl fmt::Display for ComputeCapability {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)
    }
}

impl Serialize for ComputeCapability {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for ComputeCapability {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// GPU targets kvfleet's kernels are compiled for and claim (`kvfleet-cuda` builds them).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Arch {
    Sm80,
    Sm86,
    Sm89,
    Sm90a,
    Sm100a,
    Sm120a,
}

impl Arch {
    pub const ALL: [Arch; 6] = [
        Self::Sm80,
        Self::Sm86,
        Self::Sm89,
        Self::Sm90a,
        Self::Sm100a,
        Self::Sm120a,
    ];

    /// NVRTC's `--gpu-architecture` value (virtual arch: NVRTC emits PTX for it).
    pub fn nvrtc_arch(self) -> &'static str {
        match self {
            Self::Sm80 => "compute_80",
            Self::Sm86 => "compute_86",
            Self::Sm89 => "compute_89",
            Self::Sm90a => "compute_90a",
            Self::Sm100a => "compute_100a",
            Self::Sm120a => "compute_120a",
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Sm80 => "sm_80",
            Self::Sm86 => "sm_86",
            Self::Sm89 => "sm_89",
            Self::Sm90a => "sm_90a",
            Self::Sm100a => "sm_100a",
            Self::Sm120a => "sm_120a",
        }
    }

    /// The target to build for a device of compute capability `major.minor`, or `None` if the
    /// kernels do not support it (pre-Ampere: no bf16 `mma.sync`). Families without their own
    /// entry take the newest of their family we build (sm_87 Orin -> sm_86, sm_103 -> sm_100a,
    /// sm_121 -> sm_120a); PTX is JIT-compiled forward by the driver inside a family.
    pub fn for_capability(major: i32, minor: i32) -> Option<Self> {
        match (major, minor) {
            (8, 0) => Some(Self::Sm80),
            (8, 6) | (8, 7) => Some(Self::Sm86),
            (8, 9) => Some(Self::Sm89),
            (9, 0) => Some(Self::Sm90a),
            (10, 0) | (10, 3) => Some(Self::Sm100a),
            (12, 0) | (12, 1) => Some(Self::Sm120a),
            _ => None,
        }
    }
}

impl fmt::Display for Arch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cc(s: &str) -> ComputeCapability {
        s.parse().unwrap()
    }

    #[test]
    fn parses_numbers_and_sm_names() {
        assert_eq!(cc("9.0"), ComputeCapability::new(9, 0));
        assert_eq!(cc("12.0"), ComputeCapability::new(12, 0));
        assert_eq!(cc(" 8.6 "), ComputeCapability::new(8, 6));
        assert_eq!(cc("sm_90"), ComputeCapability::new(9, 0));
        assert_eq!(cc("sm_103"), ComputeCapability::new(10, 3));
        assert_eq!(cc("sm_121"), ComputeCapability::new(12, 1));
        assert_eq!(cc("sm_100a"), ComputeCapability::new(10, 0));
        for bad in ["", "9", "nine.0", "9.x", "-1.0", "sm_", "sm_9", "9.10", "0.0"] {
            assert!(bad.parse::<ComputeCapability>().is_err(), "{bad:?} parsed");
        }
    }

    #[test]
    fn ordering_is_numeric_not_textual() {
        assert!(cc("10.0") > cc("9.0"));
        assert!(cc("12.0") > cc("10.3"));
        assert!(cc("8.9") > cc("8.6"));
        assert!(cc("7.5") < cc("8.0"));
        // As strings "10.0" < "9.0": the reason labels are parsed.
        assert!("10.0" < "9.0");
    }

    #[test]
    fn family_is_cc_div_10_in_sm_numbering() {
        let cases = [
            ("7.5", 70),
            ("8.0", 80),
            ("8.6", 80),
            ("8.9", 80),
            ("9.0", 90),
            ("10.0", 100),
            ("10.3", 100),
            ("11.0", 110),
            ("12.0", 120),
            ("12.1", 120),
        ];
        for (s, family) in cases {
            assert_eq!(cc(s).family(), family, "{s}");
        }
    }

    #[test]
    fn display_sm_and_serde_round_trip() {
        assert_eq!(cc("10.3").to_string(), "10.3");
        assert_eq!(cc("10.3").sm(), "sm_103");
        assert_eq!(cc("9.0").sm(), "sm_90");
        let json = serde_json::to_string(&cc("12.1")).unwrap();
        assert_eq!(json, "\"12.1\"");
        assert_eq!(
            serde_json::from_str::<ComputeCapability>(&json).unwrap(),
            cc("12.1")
        );
    }

    #[test]
    fn gfd_label_pair_parses() {
        assert_eq!(
            ComputeCapability::from_labels("10", "3").unwrap(),
            ComputeCapability::new(10, 3)
        );
        assert!(ComputeCapability::from_labels("ten", "0").is_err());
    }
}
