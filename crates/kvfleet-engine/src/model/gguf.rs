//! GGUF reader: header, metadata, tensor index, and dequantisation to f32.
//!
//! Format facts follow the GGUF specification (ggml-org/ggml `docs/gguf.md`): little-endian,
//! magic `GGUF`, version 2 or 3 (64-bit counts), key/value metadata, a tensor index whose
//! dimensions are listed fastest-first, and a data section aligned to `general.alignment`
//! (default 32). Block layouts of the quantised types follow ggml-org/ggml `src/ggml-common.h`
//! (`block_q4_0`, `block_q4_1`, `block_q8_0`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use memmap2::Mmap;
use rayon::prelude::*;

/// Errors of reading a GGUF file.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("cannot open model file {path}: {source}; check the path (env KVFLEET_SMOLLM2_GGUF or --model)")]
    Open {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("not a GGUF file (magic {0:02x?}); pass a .gguf model file")]
    BadMagic([u8; 4]),
    #[error(
        "GGUF version {0} is not supported (only 2 and 3); re-convert the model with a current llama.cpp"
    )]
    Version(u32),
    #[error("GGUF file is truncated or corrupt: {0}")]
    Corrupt(String),
    #[error("metadata key `{0}` is missing; the model file lacks required metadata")]
    MissingKey(String),
    #[error("metadata key `{key}` has type {found}, expected {expected}")]
    KeyType {
        key: String,
        found: &'static str,
        expected: &'static str,
    },
    #[error("tensor `{0}` is not in the model file")]
    MissingTensor(String),
    #[error("tensor `{name}` has type {ty}, which kvfleet cannot load; supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K (re-quantise the model to one of these)")]
    UnsupportedType { name: String, ty: String },
}

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Vec<Value>),
}

impl Value {
    fn type_name(&self) -> &'static str {
        match self {
            Value::U8(_) => "u8",
            Value::I8(_) => "i8",
            Value::U16(_) => "u16",
            Value::I16(_) => "i16",
            Value::U32(_) => "u32",
            Value::I32(_) => "i32",
            Value::U64(_) => "u64",
            Value::I64(_) => "i64",
            Value::F32(_) => "f32",
            Value::F64(_) => "f64",
            Value::Bool(_) => "bool",
            Value::String(_) => "string",
            Value::Array(_) => "array",
        }
    }

    /// The value as an unsigned integer, when it is a non-negative integer of any width.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v.into()),
            Value::U16(v) => Some(v.into()),
            Value::U32(v) => Some(v.into()),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// The value as a float, when it is any number.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v.into()),
            Value::F64(v) => Some(v),
            _ => self.as_u64().map(|v| v as f64),
        }
    }
}

/// Tensor element types of ggml (`enum ggml_type`, ggml-org/ggml `include/ggml.h`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q8_0,
    Q4K,
    Q6K,
    Bf16,
    /// Any other ggml type: indexed, but not loadable.
    Other(u32),
}

impl GgmlType {
    fn from_u32(v: u32) -> Self {
        match v {
            0 => GgmlType::F32,
            1 => GgmlType::F16,
            2 => GgmlType::Q4_0,
            3 => GgmlType::Q4_1,
            6 => GgmlType::Q5_0,
            8 => GgmlType::Q8_0,
            12 => GgmlType::Q4K,
            14 => GgmlType::Q6K,
            30 => GgmlType::Bf16,
            other => GgmlType::Other(other),
        }
    }

    /// (elements per block, bytes per block), or None for a type we do not know.
    pub fn block(self) -> Option<(usize, usize)> {
        match self {
            GgmlType::F32 => Some((1, 4)),
            GgmlType::F16 | GgmlType::Bf16 => Some((1, 2)),
            GgmlType::Q4_0 => Some((32, 18)),
            GgmlType::Q4_1 => Some((32, 20)),
            GgmlType::Q5_0 => Some((32, 22)),
            GgmlType::Q8_0 => Some((32, 34)),
            // Super-blocks of QK_K = 256 elements.
            GgmlType::Q4K => Some((256, 144)),
            GgmlType::Q6K => Some((256, 210)),
            GgmlType::Other(_) => None,
        }
    }

    pub fn name(self) -> String {
        match self {
            GgmlType::F32 => "F32".into(),
            GgmlType::F16 => "F16".into(),
            GgmlType::Q4_0 => "Q4_0".into(),
            GgmlType::Q4_1 => "Q4_1".into(),
            GgmlType::Q5_0 => "Q5_0".into(),
            GgmlType::Q8_0 => "Q8_0".into(),
            GgmlType::Q4K => "Q4_K".into(),
            GgmlType::Q6K => "Q6_K".into(),
            GgmlType::Bf16 => "BF16".into(),
            GgmlType::Other(v) => match v {
                6 => "Q5_0".into(),
                7 => "Q5_1".into(),
                9 => "Q8_1".into(),
                10..=15 => format!("Q{}_K", [2, 3, 4, 5, 6, 8][(v - 10) as usize]),
                _ => format!("ggml type {v}"),
            },
        }
    }
}

/// One entry of the tensor index.
#[derive(Debug, Clone)]
pub struct TensorInfo {
    pub name: String,
    /// Dimensions, fastest-varying first (GGUF order): a `[in, out]` matrix has rows of `in`.
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    /// Offset from the start of the data section.
    pub offset: u64,
}

impl TensorInfo {
    /// Element count (saturating: a header's dims are untrusted; the parser rejects tensors
    /// whose bytes overflow or lie past the file).
    pub fn elements(&self) -> u64 {
        self.dims.iter().fold(1u64, |a, &d| a.saturating_mul(d))
    }
}

/// Most values reserved up front for a header array or the tensor index: counts come from
/// the file, so a large count grows the vector as elements really parse.
const PREALLOCATE_MAX: usize = 4096;
/// Largest `general.alignment` accepted (llama.cpp writes 32).
const ALIGNMENT_MAX: u64 = 1 << 16;

enum Storage {
    Mapped(Mmap),
    Owned(Vec<u8>),
}

impl Storage {
    fn bytes(&self) -> &[u8] {
        match self {
            Storage::Mapped(m) => m,
            Storage::Owned(v) => v,
        }
    }
}

/// A parsed GGUF file; tensor bytes stay in the memory map until dequantised.
pub struct Gguf {
    storage: Storage,
    pub version: u32,
    pub metadata: BTreeMap<String, Value>,
    pub tensors: Vec<TensorInfo>,
    by_name: BTreeMap<String, usize>,
    data_start: usize,
}

impl std::fmt::Debug for Gguf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gguf")
            .field("version", &self.version)
            .field("metadata_keys", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], GgufError> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.buf.len())
            .ok_or_else(|| {
                GgufError::Corrupt(format!(
                    "needs {n} bytes at offset {}, file has {}",
                    self.pos,
                    self.buf.len()
                ))
            })?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    fn arr<const N: usize>(&mut self) -> Result<[u8; N], GgufError> {
        let s = self.take(N)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }
    fn u32(&mut self) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.arr()?))
    }
    fn u64(&mut self) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.arr()?))
    }
    fn len(&mut self, what: &str, min_elem_bytes: usize) -> Result<usize, GgufError> {
        let n = self.u64()?;
        let remaining = (self.buf.len() - self.pos) as u64;
        if n.saturating_mul(min_elem_bytes as u64) > remaining {
            return Err(GgufError::Corrupt(format!(
                "{what} of length {n} at offset {} runs past the end",
                self.pos
            )));
        }
        Ok(n as usize)
    }
    fn string(&mut self) -> Result<String, GgufError> {
        let n = self.len("string", 1)?;
        let s = self.take(n)?;
        String::from_utf8(s.to_vec())
            .map_err(|_| GgufError::Corrupt(format!("string at offset {} is not UTF-8", self.pos)))
    }
    fn value(&mut self, ty: u32, depth: u32) -> Result<Value, GgufError> {
        Ok(match ty {
            0 => Value::U8(self.arr::<1>()?[0]),
            1 => Value::I8(self.arr::<1>()?[0] as i8),
            2 => Value::U16(u16::from_le_bytes(self.arr()?)),
            3 => Value::I16(i16::from_le_bytes(self.arr()?)),
            4 => Value::U32(self.u32()?),
            5 => Value::I32(i32::from_le_bytes(self.arr()?)),
            6 => Value::F32(f32::from_le_bytes(self.arr()?)),
            7 => Value::Bool(self.arr::<1>()?[0] != 0),
            8 => Value::String(self.string()?),
            9 => {
                if depth > 4 {
                    return Err(GgufError::Corrupt("arrays nested too deeply".into()));
                }
                let ety = self.u32()?;
                let n = self.len("array", 1)?;
                let mut out = Vec::with_capacity(n.min(PREALLOCATE_MAX));
                for _ in 0..n {
                    out.push(self.value(ety, depth + 1)?);
                }
                Value::Array(out)
            }
            10 => Value::U64(self.u64()?),
            11 => Value::I64(i64::from_le_bytes(self.arr()?)),
            12 => Value::F64(f64::from_le_bytes(self.arr()?)),
            other => {
                return Err(GgufError::Corrupt(format!(
                    "unknown metadata value type {other} at offset {}",
                    self.pos
                )))
            }
        })
    }
}

impl Gguf {
    /// Memory-maps and parses a GGUF file.
    pub fn open(path: &Path) -> Result<Self, GgufError> {
        let open_err = |source| GgufError::Open {
            path: path.to_path_buf(),
            source,
        };
        let file = std::fs::File::open(path).map_err(open_err)?;
        // SAFETY: the map is read-only; a model file changed underneath a running worker is
        // outside what we support (as with every mmap-based loader).
        let map = unsafe { Mmap::map(&file) }.map_err(open_err)?;
        Self::parse(Storage::Mapped(map))
    }

    /// Parses a GGUF image held in memory (tests, embedded files).
    pub fn from_bytes(bytes: Vec<u8>) -> Result<Self, GgufError> {
        Self::parse(Storage::Owned(bytes))
    }

    fn parse(storage: Storage) -> Result<Self, GgufError> {
        let buf = storage.bytes();
        let mut r = Reader { buf, pos: 0 };
        let magic: [u8; 4] = r.arr().map_err(|_| GgufError::BadMagic([0; 4])).and_then(|m| {
            if &m == b"GGUF" {
                Ok(m)
            } else {
                Err(GgufError::BadMagic(m))
            }
        })?;
        debug_assert_eq!(&magic, b"GGUF");
        let version = r.u32()?;
        if !(2..=3).contains(&version) {
            return Err(GgufError::Version(version));
        }
        let n_tensors = r.len("tensor index", 8)?;
        let n_kv = r.len("metadata", 8)?;
        let mut metadata = BTreeMap::new();
        for _ in 0..n_kv {
            let key = r.string()?;
            let ty = r.u32()?;
            let v = r.value(ty, 0)?;
            metadata.insert(key, v);
        }
        let mut tensors = Vec::with_capacity(n_tensors.min(PREALLOCATE_MAX));
        let mut by_name = BTreeMap::new();
        for _ in 0..n_tensors {
            let name = r.string()?;
            let nd = r.u32()?;
            if nd > 4 {
                return Err(GgufError::Corrupt(format!(
                    "tensor `{name}` has {nd} dimensions (at most 4)"
                )));
            }
            let mut dims = Vec::with_capacity(nd as usize);
            for _ in 0..nd {
                dims.push(r.u64()?);
            }
            let ty = GgmlType::from_u32(r.u32()?);
            let offset = r.u64()?;
            by_name.insert(name.clone(), tensors.len());
            tensors.push(TensorInfo {
                name,
                dims,
                ty,
                offset,
            });
        }
        let align = metadata
            .get("general.alignment")
            .and_then(Value::as_u64)
            .unwrap_or(32)
            .max(1);
        if align > ALIGNMENT_MAX {
            return Err(GgufError::Corrupt(format!(
                "general.alignment {align} is larger than {ALIGNMENT_MAX}"
            )));
        }
        let align = align as usize;
        let data_start = r.pos.div_ceil(align) * align;
        let me = Gguf {
            version,
            metadata,
            tensors,
            by_name,
            data_start,
            storage,
        };
        // Every tensor of a known type must lie inside the file.
        for t in &me.tensors {
            if let Some(n) = me.byte_len(t)? {
                let end = (me.data_start as u64)
                    .checked_add(t.offset)
                    .and_then(|s| s.checked_add(n as u64));
                if end.is_none_or(|e| e > me.storage.bytes().len() as u64) {
                    return Err(GgufError::Corrupt(format!(
                        "tensor `{}` ({n} bytes at data offset {}) lies past the end of the file",
                        t.name, t.offset
                    )));
                }
            }
        }
        Ok(me)
    }

    fn byte_len(&self, t: &TensorInfo) -> Result<Option<usize>, GgufError> {
        let Some((per_block, block_bytes)) = t.ty.block() else {
            return Ok(None);
        };
        let n = t
            .dims
            .iter()
            .try_fold(1u64, |a, &d| a.checked_mul(d))
            .ok_or_else(|| GgufError::Corrupt(format!("tensor `{}` is too large", t.name)))?;
        if n % per_block as u64 != 0 {
            return Err(GgufError::Corrupt(format!(
                "tensor `{}` has {n} elements, not a multiple of the {} block of {per_block}",
                t.name,
                t.ty.name()
            )));
        }
        usize::try_from(n / per_block as u64)
            .ok()
            .and_then(|blocks| blocks.checked_mul(block_bytes))
            .map(Some)
            .ok_or_else(|| GgufError::Corrupt(format!("tensor `{}` is too large", t.name)))
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }

    pub fn get_str(&self, key: &str) -> Result<&str, GgufError> {
        match self.get(key) {
            Some(Value::String(s)) => Ok(s),
            Some(v) => Err(GgufError::KeyType {
                key: key.into(),
                found: v.type_name(),
                expected: "string",
            }),
            None => Err(GgufError::MissingKey(key.into())),
        }
    }

    pub fn get_u64(&self, key: &str) -> Result<u64, GgufError> {
        let v = self.get(key).ok_or_else(|| GgufError::MissingKey(key.into()))?;
        v.as_u64().ok_or(GgufError::KeyType {
            key: key.into(),
            found: v.type_name(),
            expected: "unsigned integer",
        })
    }

    pub fn get_f64(&self, key: &str) -> Result<f64, GgufError> {
        let v = self.get(key).ok_or_else(|| GgufError::MissingKey(key.into()))?;
        v.as_f64().ok_or(GgufError::KeyType {
            key: key.into(),
            found: v.type_name(),
            expected: "number",
        })
    }

    pub fn get_array(&self, key: &str) -> Result<&[Value], GgufError> {
        match self.get(key) {
            Some(Value::Array(a)) => Ok(a),
            Some(v) => Err(GgufError::KeyType {
                key: key.into(),
                found: v.type_name(),
                expected: "array",
            }),
            None => Err(GgufError::MissingKey(key.into())),
        }
    }

    pub fn tensor_info(&self, name: &str) -> Option<&TensorInfo> {
        self.by_name.get(name).map(|&i| &self.tensors[i])
    }

    /// The raw bytes of a tensor of a known type.
    pub fn tensor_bytes(&self, name: &str) -> Result<(&TensorInfo, &[u8]), GgufError> {
        let t = self
            .tensor_info(name)
            .ok_or_else(|| GgufError::MissingTensor(name.into()))?;
        let n = self.byte_len(t)?.ok_or_else(|| GgufError::UnsupportedType {
            name: name.into(),
            ty: t.ty.name(),
        })?;
        let start = self.data_start + t.offset as usize;
        Ok((t, &self.storage.bytes()[start..start + n]))
    }

    /// Dequantises a tensor to f32 in GGUF element order (row-major over reversed dims).
    pub fn dequantize(&self, name: &str) -> Result<Vec<f32>, GgufError> {
        let (t, bytes) = self.tensor_bytes(name)?;
        let mut out = vec![0f32; t.elements() as usize];
        dequantize_into(t.ty, bytes, &mut out).map_err(|ty| GgufError::UnsupportedType {
            name: name.into(),
            ty,
        })?;
        Ok(out)
    }
}

/// Dequantises `bytes` of type `ty` into `out` (whose length is the element count). Runs the
/// blocks in parallel. Returns the type's name as the error for a type we cannot decode.
pub fn dequantize_into(ty: GgmlType, bytes: &[u8], out: &mut [f32]) -> Result<(), String> {
    let (per_block, block_bytes) = ty.block().ok_or_else(|| ty.name())?;
    if bytes.len() / block_bytes * per_block != out.len() || bytes.len() % block_bytes != 0 {
        return Err(format!(
            "{} with {} bytes for {} elements",
            ty.name(),
            bytes.len(),
            out.len()
        ));
    }
    // Chunks of many blocks keep rayon's overhead small.
    const BLOCKS_PER_TASK: usize = 1024;
    out.par_chunks_mut(per_block * BLOCKS_PER_TASK)
        .zip(bytes.par_chunks(block_bytes * BLOCKS_PER_TASK))
        .for_each(|(o, b)| {
            for (ob, bb) in o.chunks_mut(per_block).zip(b.chunks(block_bytes)) {
                decode_block(ty, bb, ob);
            }
        });
    Ok(())
}

fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

fn decode_block(ty: GgmlType, b: &[u8], o: &mut [f32]) {
    match ty {
        GgmlType::F32 => o[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        GgmlType::F16 => o[0] = f16_at(b, 0),
        GgmlType::Bf16 => o[0] = bf16::from_le_bytes([b[0], b[1]]).to_f32(),
        // block_q4_0 { half d; uint8_t qs[16]; }: low nibbles are elements 0..16, high 16..32.
        GgmlType::Q4_0 => {
            let d = f16_at(b, 0);
            for j in 0..16 {
                let q = b[2 + j];
                o[j] = ((q & 0x0f) as i32 - 8) as f32 * d;
                o[j + 16] = ((q >> 4) as i32 - 8) as f32 * d;
            }
        }
        // block_q4_1 { half d; half m; uint8_t qs[16]; }: x = q * d + m.
        GgmlType::Q4_1 => {
            let d = f16_at(b, 0);
            let m = f16_at(b, 2);
            for j in 0..16 {
                let q = b[4 + j];
                o[j] = (q & 0x0f) as f32 * d + m;
                o[j + 16] = (q >> 4) as f32 * d + m;
            }
        }
        // block_q8_0 { half d; int8_t qs[32]; }
        GgmlType::Q8_0 => {
            let d = f16_at(b, 0);
            for j in 0..32 {
                o[j] = (b[2 + j] as i8) as f32 * d;
            }
        }
        // block_q5_0 { half d; uint8_t qh[4]; uint8_t qs[16]; }: element j (< 16) takes the low
        // nibble of qs[j] and bit j of qh as its fifth bit, element j + 16 the high nibble and
        // bit j + 16; x = (q - 16) * d.
        GgmlType::Q5_0 => {
            let d = f16_at(b, 0);
            let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
            for j in 0..16 {
                let q = b[6 + j];
                let lo = (q & 0x0f) as u32 | ((qh >> j) & 1) << 4;
                let hi = (q >> 4) as u32 | ((qh >> (j + 16)) & 1) << 4;
                o[j] = (lo as i32 - 16) as f32 * d;
                o[j + 16] = (hi as i32 - 16) as f32 * d;
            }
        }
        GgmlType::Q4K => decode_q4_k(b, o),
        GgmlType::Q6K => decode_q6_k(b, o),
        GgmlType::Other(_) => unreachable!("rejected by dequantize_into"),
    }
}

/// The 6-bit scale and min of sub-block `j` (0..8) of a Q4_K super-block, packed into 12 bytes:
/// sub-blocks 0..4 keep theirs in the low 6 bits of bytes j (scale) and j + 4 (min); 4..8 put
/// their low 4 bits in the nibbles of byte j + 4 and their top 2 bits in the top bits of bytes
/// j - 4 (scale) and j (min).
fn q4_k_scale_min(s: &[u8], j: usize) -> (f32, f32) {
    let (sc, m) = if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    };
    (sc as f32, m as f32)
}

/// block_q4_K { half d; half dmin; uint8_t scales[12]; uint8_t qs[128]; }: eight sub-blocks of
/// 32, x = d * scale_j * q - dmin * min_j. Each 32 bytes of qs hold two sub-blocks: low
/// nibbles the first, high nibbles the second (ggml-org/ggml `src/ggml-quants.c`,
/// `dequantize_row_q4_K`; layout in `src/ggml-common.h`).
fn decode_q4_k(b: &[u8], o: &mut [f32]) {
    let d = f16_at(b, 0);
    let dmin = f16_at(b, 2);
    let scales = &b[4..16];
    let qs = &b[16..144];
    for pair in 0..4 {
        let (s0, m0) = q4_k_scale_min(scales, 2 * pair);
        let (s1, m1) = q4_k_scale_min(scales, 2 * pair + 1);
        let q = &qs[32 * pair..32 * pair + 32];
        let out = &mut o[64 * pair..64 * pair + 64];
        for l in 0..32 {
            out[l] = d * s0 * (q[l] & 0x0f) as f32 - dmin * m0;
            out[l + 32] = d * s1 * (q[l] >> 4) as f32 - dmin * m1;
        }
    }
}

/// block_q6_K { uint8_t ql[128]; uint8_t qh[64]; int8_t scales[16]; half d; }: sixteen
/// sub-blocks of 16 with signed 8-bit scales, x = d * scale * (q - 32), q = 4 low bits from ql
/// and 2 high bits from qh. Each half (128 elements) uses 64 bytes of ql, 32 of qh and 8
/// scales: element l + 32 * i (l < 32, i < 4) takes ql[l + 32 * (i & 1)]'s low (i < 2) or high
/// nibble and bits 2i..2i+2 of qh[l] (ggml-org/ggml `src/ggml-quants.c`, `dequantize_row_q6_K`).
fn decode_q6_k(b: &[u8], o: &mut [f32]) {
    let d = f16_at(b, 208);
    for half in 0..2 {
        let ql = &b[64 * half..64 * half + 64];
        let qh = &b[128 + 32 * half..128 + 32 * half + 32];
        let sc = &b[192 + 8 * half..192 + 8 * half + 8];
        let out = &mut o[128 * half..128 * half + 128];
        for l in 0..32 {
            for i in 0..4 {
                let low = ql[l + 32 * (i & 1)];
                let nib = if i < 2 { low & 0x0f } else { low >> 4 };
                let q = (nib | ((qh[l] >> (2 * i)) & 3) << 4) as i32 - 32;
                let scale = sc[l / 16 + 2 * i] as i8 as f32;
                out[l + 32 * i] = d * scale * q as f32;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(x: f32) -> [u8; 2] {
        f16::from_f32(x).to_le_bytes()
    }

    #[test]
    fn q4_0_block_decodes_low_then_high_nibbles_minus_eight() {
        let mut b = h(0.5).to_vec();
        for j in 0..16u8 {
            b.push(j | ((15 - j) << 4));
        }
        let mut o = vec![0f32; 32];
        dequantize_into(GgmlType::Q4_0, &b, &mut o).unwrap();
        for j in 0..16 {
            assert_eq!(o[j], (j as f32 - 8.0) * 0.5);
            assert_eq!(o[j + 16], (7.0 - j as f32) * 0.5);
        }
    }

    #[test]
    fn q4_1_block_decodes_with_scale_and_min() {
        let mut b = h(0.25).to_vec();
        b.extend(h(-1.0));
        for j in 0..16u8 {
            b.push(j | (3 << 4));
        }
        let mut o = vec![0f32; 32];
        dequantize_into(GgmlType::Q4_1, &b, &mut o).unwrap();
        for j in 0..16 {
            assert_eq!(o[j], j as f32 * 0.25 - 1.0);
            assert_eq!(o[j + 16], 3.0 * 0.25 - 1.0);
        }
    }

    #[test]
    fn q8_0_two_blocks_decode_signed_bytes() {
        let mut b = Vec::new();
        for d in [2.0f32, -0.5] {
            b.extend(h(d));
            for j in 0..32i8 {
                b.push((j - 16) as u8);
            }
        }
        let mut o = vec![0f32; 64];
        dequantize_into(GgmlType::Q8_0, &b, &mut o).unwrap();
        assert_eq!(o[0], -32.0);
        assert_eq!(o[31], 30.0);
        assert_eq!(o[32], 8.0);
        assert_eq!(o[63], -7.5);
    }

    #[test]
    fn q5_0_block_takes_the_fifth_bit_from_qh() {
        let mut b = h(0.5).to_vec();
        // Fifth bit set for elements 1 and 17 (bits 1 and 17), nothing else.
        b.extend(((1u32 << 1) | (1u32 << 17)).to_le_bytes());
        for j in 0..16u8 {
            b.push(j | ((15 - j) << 4));
        }
        let mut o = vec![0f32; 32];
        dequantize_into(GgmlType::Q5_0, &b, &mut o).unwrap();
        assert_eq!(o[0], -8.0, "q 0 - 16");
        assert_eq!(o[1], (1.0 + 16.0 - 16.0) * 0.5, "q 1 | 16");
        assert_eq!(o[15], (15.0 - 16.0) * 0.5);
        assert_eq!(o[16], (15.0 - 16.0) * 0.5);
        assert_eq!(o[17], (14.0 + 16.0 - 16.0) * 0.5, "q 14 | 16");
        assert_eq!(o[31], (0.0 - 16.0) * 0.5);
    }

    /// Packs eight 6-bit (scale, min) pairs the way Q4_K stores them.
    fn pack_q4_k_scales(sm: &[(u8, u8); 8]) -> [u8; 12] {
        let mut s = [0u8; 12];
        for j in 0..4 {
            s[j] = sm[j].0 | ((sm[j + 4].0 >> 4) << 6);
            s[j + 4] = sm[j].1 | ((sm[j + 4].1 >> 4) << 6);
            s[j + 8] = (sm[j + 4].0 & 0x0f) | ((sm[j + 4].1 & 0x0f) << 4);
        }
        s
    }

    #[test]
    fn q4_k_super_block_applies_each_sub_blocks_scale_and_min() {
        // Scales and mins above 15 exercise the split 6-bit packing of sub-blocks 4..8.
        let sm = [
            (1, 0),
            (2, 1),
            (3, 2),
            (63, 4),
            (5, 63),
            (17, 33),
            (40, 7),
            (8, 20),
        ];
        let (d, dmin) = (0.5f32, 0.25f32);
        let mut b = h(d).to_vec();
        b.extend(h(dmin));
        b.extend(pack_q4_k_scales(&sm));
        let q = |i: usize| ((i * 7 + 3) % 16) as u8;
        // Element e: sub-block e / 32; pair p = e / 64 holds sub-blocks 2p (low nibbles) and
        // 2p + 1 (high nibbles) in bytes 32p..32p + 32.
        let mut qs = [0u8; 128];
        for e in 0..256 {
            let (p, in_pair) = (e / 64, e % 64);
            let byte = 32 * p + in_pair % 32;
            qs[byte] |= if in_pair < 32 { q(e) } else { q(e) << 4 };
        }
        b.extend(qs);
        assert_eq!(b.len(), 144);
        let mut o = vec![0f32; 256];
        dequantize_into(GgmlType::Q4K, &b, &mut o).unwrap();
        for e in 0..256 {
            let (sc, m) = sm[e / 32];
            let want = d * sc as f32 * q(e) as f32 - dmin * m as f32;
            assert_eq!(o[e], want, "element {e}");
        }
    }

    #[test]
    fn q6_k_super_block_combines_ql_qh_and_signed_scales() {
        let d = 0.125f32;
        let q = |e: usize| ((e * 13 + 5) % 64) as u8; // 6-bit, stored with +32 bias
        let scales: [i8; 16] = [1, -2, 3, -4, 5, 6, -7, 8, 127, -128, 11, 12, -13, 14, 15, -16];
        let mut ql = [0u8; 128];
        let mut qh = [0u8; 64];
        for e in 0..256 {
            let (half, r) = (e / 128, e % 128);
            let (i, l) = (r / 32, r % 32);
            let lo = q(e) & 0x0f;
            let byte = 64 * half + l + 32 * (i & 1);
            ql[byte] |= if i < 2 { lo } else { lo << 4 };
            qh[32 * half + l] |= (q(e) >> 4) << (2 * i);
        }
        let mut b = ql.to_vec();
        b.extend(qh);
        b.extend(scales.iter().map(|&s| s as u8));
        b.extend(h(d));
        assert_eq!(b.len(), 210);
        let mut o = vec![0f32; 256];
        dequantize_into(GgmlType::Q6K, &b, &mut o).unwrap();
        for e in 0..256 {
            // Sub-blocks of 16 elements, in order.
            let want = d * scales[e / 16] as f32 * (q(e) as i32 - 32) as f32;
            assert_eq!(o[e], want, "element {e}");
        }
    }

    #[test]
    fn float_types_decode_exactly() {
        let vals = [1.5f32, -2.25, 0.0, 384.0];
        let f32b: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
        let f16b: Vec<u8> = vals.iter().flat_map(|&v| h(v)).collect();
        let bf16b: Vec<u8> = vals
            .iter()
            .flat_map(|&v| bf16::from_f32(v).to_le_bytes())
            .collect();
        for (ty, b) in [
            (GgmlType::F32, f32b),
            (GgmlType::F16, f16b),
            (GgmlType::Bf16, bf16b),
        ] {
            let mut o = vec![0f32; 4];
            dequantize_into(ty, &b, &mut o).unwrap();
            assert_eq!(o, vals, "{ty:?}");
        }
    }

    #[test]
    fn wrong_byte_count_and_unknown_type_are_errors() {
        let mut o = vec![0f32; 32];
        assert!(dequantize_into(GgmlType::Q8_0, &[0u8; 33], &mut o).is_err());
        let e = dequantize_into(GgmlType::Other(11), &[0u8; 110], &mut o).unwrap_err();
        assert_eq!(e, "Q3_K");
    }

    /// A GGUF image with one metadata key and one Q8_0 tensor.
    fn tiny_gguf(ty: u32) -> Vec<u8> {
        let mut b = b"GGUF".to_vec();
        b.extend(3u32.to_le_bytes());
        b.extend(1u64.to_le_bytes()); // tensors
        b.extend(1u64.to_le_bytes()); // kv
        let key = b"general.architecture";
        b.extend((key.len() as u64).to_le_bytes());
        b.extend(key);
        b.extend(8u32.to_le_bytes());
        b.extend(5u64.to_le_bytes());
        b.extend(b"llama");
        let name = b"w";
        b.extend((name.len() as u64).to_le_bytes());
        b.extend(name);
        b.extend(2u32.to_le_bytes());
        b.extend(32u64.to_le_bytes());
        b.extend(2u64.to_le_bytes());
        b.extend(ty.to_le_bytes());
        b.extend(0u64.to_le_bytes());
        while b.len() % 32 != 0 {
            b.push(0);
        }
        for d in [1.0f32, 2.0] {
            b.extend(h(d));
            b.extend([1u8; 32]);
        }
        b
    }

    #[test]
    fn hand_built_file_parses_metadata_and_tensor() {
        let g = Gguf::from_bytes(tiny_gguf(8)).unwrap();
        assert_eq!(g.get_str("general.architecture").unwrap(), "llama");
        let t = g.tensor_info("w").unwrap();
        assert_eq!(t.dims, vec![32, 2]);
        let w = g.dequantize("w").unwrap();
        assert_eq!(w.len(), 64);
        assert_eq!((w[0], w[63]), (1.0, 2.0));
    }

    #[test]
    fn truncated_file_and_unsupported_tensor_type_are_clear_errors() {
        let mut b = tiny_gguf(8);
        b.truncate(b.len() - 10);
        assert!(matches!(Gguf::from_bytes(b), Err(GgufError::Corrupt(_))));
        let g = Gguf::from_bytes(tiny_gguf(11)).unwrap();
        let e = g.dequantize("w").unwrap_err();
        assert!(e.to_string().contains("Q3_K"), "{e}");
        assert!(matches!(
            Gguf::from_bytes(b"GGML....".to_vec()),
            Err(GgufError::BadMagic(_))
        ));
        assert!(matches!(g.dequantize("nope"), Err(GgufError::MissingTensor(_))));
    }
}
