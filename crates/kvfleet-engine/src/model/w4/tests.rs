use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use super::mxfp4::{dequantize_mxfp4_row, e8m0_to_f32, from_blocks, E2M1};
use super::*;
use crate::model::hf::{self, Safetensors};
use crate::model::linear::LinearQuantization;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/int4")
        .join(name)
}

fn expected(dir: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap()
}

/// The tiny Llamas of `tests/fixtures/int4/generate.py`, their format and group size.
const CHECKPOINTS: &[(&str, W4Method, Option<usize>)] = &[
    ("awq-g32", W4Method::Awq, Some(32)),
    ("awq-g64", W4Method::Awq, Some(64)),
    ("awq-g128", W4Method::Awq, Some(128)),
    ("gptq-g32-sym", W4Method::Gptq, Some(32)),
    ("gptq-g64-asym-act", W4Method::Gptq, Some(64)),
    ("gptq-g128-sym-act", W4Method::Gptq, Some(128)),
    ("gptq-channel-v2", W4Method::Gptq, None),
    ("ct-group-asym", W4Method::CompressedTensors, Some(32)),
    ("ct-channel-sym", W4Method::CompressedTensors, None),
    // Quantized and packed by compressed-tensors itself (`ct_package.py`).
    ("ct-pkg-group-asym", W4Method::CompressedTensors, Some(32)),
];

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|f| f.to_bits()).collect()
}

#[test]
fn every_4bit_checkpoint_loads_packed_and_dequantizes_to_the_reference_bit_for_bit() {
    for &(name, method, group) in CHECKPOINTS {
        let dir = fixture(name);
        let cfg = hf::w4_quantization(&dir).unwrap().unwrap();
        assert_eq!((cfg.method, cfg.group_size), (method, group), "{name}");
        assert_eq!(
            hf::quantization(&dir).unwrap(),
            None,
            "{name}: not an FP8 checkpoint"
        );
        let want = expected(&dir);
        let st = Safetensors::open(&dir).unwrap();
        for (stem, t) in want["tensors"].as_object().unwrap() {
            let (rows, cols) = (
                t["rows"].as_u64().unwrap() as usize,
                t["cols"].as_u64().unwrap() as usize,
            );
            let w = cfg.load_linear(stem, rows, cols, |n| st.raw(n)).unwrap().unwrap();
            assert_eq!(
                (w.rows, w.cols, w.groups),
                (rows, cols, t["groups"].as_u64().unwrap() as usize)
            );
            let mut row = vec![0f32; cols];
            for (r, values) in t["selected"].as_object().unwrap() {
                let r: usize = r.parse().unwrap();
                let values: Vec<f32> = values
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|v| v.as_f64().unwrap() as f32)
                    .collect();
                w.dequantize_row(r, &mut row);
                assert_eq!(bits(&row), bits(&values), "{name} {stem} row {r}");
            }
            // Edge cases the generator put there: both extreme codes, the zero of row 0's first
            // group (0 where the format stores it), a g_idx permutation with desc_act.
            let codes: Vec<u8> = (0..rows)
                .flat_map(|r| (0..cols).map(move |c| (r, c)))
                .map(|(r, c)| w.code(r, c))
                .collect();
            assert!(codes.contains(&0) && codes.contains(&15), "{name} {stem}");
            let z0 = t["zero_of_row0_group0"].as_u64().unwrap() as u8;
            assert_eq!(w.zeros[0], z0, "{name} {stem}: the zero of row 0, group 0");
            assert_eq!(w.g_idx.is_some(), name.contains("-act"), "{name} {stem}");
            // The whole weight dequantizes as its rows do.
            let full = w.dequantize();
            w.dequantize_row(rows - 1, &mut row);
            assert_eq!(bits(&full[(rows - 1) * cols..]), bits(&row));
        }
    }
    for name in ["awq-g32", "gptq-channel-v2", "ct-group-asym"] {
        let t = &expected(&fixture(name))["tensors"]["model.layers.0.self_attn.q_proj"];
        assert_eq!(
            t["zero_of_row0_group0"], 0,
            "{name}: a zero point of 0 is covered"
        );
    }
}

#[test]
fn a_packed_model_computes_the_logits_of_its_dequantized_f32_model() {
    let tokens: Vec<u32> = b"The quick brown fox jumps"
        .iter()
        .map(|&b| u32::from(b))
        .collect();
    for &(name, method, _) in CHECKPOINTS {
        let m = hf::load_model(&fixture(name)).unwrap();
        assert_eq!(m.quantization(), LinearQuantization::W4A16(method), "{name}");
        // The weights stay packed: no f32 copy of a projection is held.
        let t = m.tensors();
        assert!(
            t.layers[0].wq.is_empty() && t.layers[0].w_down.is_empty(),
            "{name}"
        );
        assert!(
            t.lm_head.is_some_and(|h| !h.is_empty()),
            "{name}: the LM head stays bf16"
        );
        let f = m.dequantized();
        assert_eq!(f.quantization(), LinearQuantization::None);
        let rows = |m: &crate::model::llama::Llama| m.prompt_logits(&tokens, |_, row| row.to_vec()).unwrap();
        let (a, b) = (rows(&m), rows(&f));
        let worst = a
            .iter()
            .flatten()
            .zip(b.iter().flatten())
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max);
        assert!(worst <= 1e-5, "{name}: packed and f32 logits differ by {worst}");
        assert!(a.iter().flatten().all(|v| v.is_finite()));
    }
}

#[test]
fn mxfp4_rows_dequantize_to_the_reference_bits_with_every_code_and_scale_extreme() {
    let dir = fixture("mxfp4");
    let want = expected(&dir);
    let st = Safetensors::open(&dir).unwrap();
    let stem = want["tensor"].as_str().unwrap();
    let blocks = st.raw(&format!("{stem}_blocks")).unwrap();
    let scales = st.raw(&format!("{stem}_scales")).unwrap();
    let (experts, rows, cols) = (
        want["experts"].as_u64().unwrap() as usize,
        want["rows"].as_u64().unwrap() as usize,
        want["cols"].as_u64().unwrap() as usize,
    );
    assert_eq!(blocks.shape, [experts, rows, cols / 32, 16]);
    assert_eq!(scales.shape, [experts, rows, cols / 32]);
    let want: Vec<u32> = want["bits"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect();
    let same = |a: f32, b: u32| a.to_bits() == b || (a.is_nan() && f32::from_bits(b).is_nan());
    let mut row = vec![0f32; cols];
    for e in 0..experts {
        for r in 0..rows {
            let i = e * rows + r;
            dequantize_mxfp4_row(
                &blocks.data[i * cols / 2..(i + 1) * cols / 2],
                &scales.data[i * cols / 32..(i + 1) * cols / 32],
                &mut row,
            );
            for (c, v) in row.iter().enumerate() {
                assert!(same(*v, want[i * cols + c]), "expert {e} row {r} col {c}: {v}");
            }
        }
        // The same expert through the linear op's layout.
        let n = rows * cols;
        let w = from_blocks(
            &blocks.data[e * n / 2..(e + 1) * n / 2],
            &scales.data[e * n / 32..(e + 1) * n / 32],
            rows,
            cols,
        )
        .unwrap();
        for (k, v) in w.dequantize().iter().enumerate() {
            assert!(same(*v, want[e * n + k]), "expert {e} element {k}: {v}");
        }
    }
    let scales_seen: std::collections::HashSet<u8> = scales.data.iter().copied().collect();
    for s in [0u8, 1, 127, 254, 255] {
        assert!(scales_seen.contains(&s), "scale {s} is covered");
    }
    assert!(
        want.iter().any(|b| f32::from_bits(*b).is_infinite()),
        "6 x 2^127 overflows"
    );
}

#[test]
fn e2m1_and_e8m0_decode_as_the_ocp_spec_defines_them() {
    assert_eq!(e8m0_to_f32(127), 1.0);
    assert_eq!(e8m0_to_f32(128), 2.0);
    assert_eq!(e8m0_to_f32(1), 2f32.powi(-126));
    assert_eq!(e8m0_to_f32(0), 2f32.powi(-126) / 2.0, "2^-127, a subnormal");
    assert_eq!(e8m0_to_f32(254), 2f32.powi(127));
    assert!(e8m0_to_f32(255).is_nan());
    // Sign bit 3, exponent bits 2-1 (bias 1), mantissa bit 0; exponent 0 is subnormal (0.5).
    for (code, v) in E2M1.iter().enumerate() {
        let (s, e, m) = (code >> 3, (code >> 1) & 3, code & 1);
        let mag = if e == 0 {
            m as f32 * 0.5
        } else {
            (1.0 + m as f32 * 0.5) * 2f32.powi(e as i32 - 1)
        };
        assert_eq!(
            v.to_bits(),
            (if s == 1 { -mag } else { mag }).to_bits(),
            "code {code}"
        );
    }
    let mut out = [0f32; 32];
    let blocks: Vec<u8> = (0..16u8).map(|i| i | (15 - i) << 4).collect();
    dequantize_mxfp4_row(&blocks, &[126], &mut out);
    assert_eq!(out[0], 0.0);
    assert_eq!(out[1], -3.0, "code 15 (-6) x 0.5");
    assert_eq!(out[14], 3.0, "code 7 (6) x 0.5");
}

#[test]
fn awq_words_hold_output_columns_in_its_interleaved_order() {
    // One input row, 8 outputs, one group: nibble k of the word holds output AWQ_ORDER[k].
    let word = (0..8).fold(0u32, |w, k| w | (k as u32) << (4 * k)) as i32;
    let zeros = 0x1111_1111u32 as i32;
    let w = awq::repack(&[word; 8], &[zeros], &[0.5; 8], 8, 8, 8);
    for (k, &o) in awq::AWQ_ORDER.iter().enumerate() {
        assert_eq!(w.code(o, 0), k as u8, "output {o}");
    }
    let mut row = [0f32; 8];
    w.dequantize_row(2, &mut row);
    assert_eq!(row[0], (1.0 - 1.0) * 0.5, "output 2 is nibble 1");
    w.dequantize_row(1, &mut row);
    assert_eq!(row[0], (4.0 - 1.0) * 0.5, "output 1 is nibble 4");
}

#[test]
fn gptq_v1_adds_one_to_the_stored_zero_and_v2_does_not() {
    // 8 inputs x 8 outputs; input row k holds code k; stored zero nibbles 15 and 7.
    let qweight: Vec<i32> = (0..8)
        .map(|_| (0..8).fold(0u32, |w, k| w | (k as u32) << (4 * k)) as i32)
        .collect();
    let qzeros = [0x7777_777Fu32 as i32];
    for (v1, z0, z1) in [(true, 16u8, 8u8), (false, 15, 7)] {
        let w = gptq::repack(&qweight, &qzeros, &[1.0; 8], None, 8, 8, 8, v1);
        assert_eq!((w.zeros[0], w.zeros[1]), (z0, z1), "v1 {v1}");
        let mut row = [0f32; 8];
        w.dequantize_row(0, &mut row);
        assert_eq!(row[3], 3.0 - f32::from(z0));
    }
    // A g_idx that is i / group is dropped; a permutation is kept and applied per column.
    let trivial: Vec<u32> = (0..16).map(|i| i / 8).collect();
    let qweight16: Vec<i32> = [qweight.clone(), qweight.clone()].concat();
    let w = gptq::repack(&qweight16, &[0, 0], &[1.0; 16], Some(trivial), 8, 16, 8, false);
    assert!(w.g_idx.is_none());
    let perm: Vec<u32> = (0..16).map(|i| (i % 2) as u32).collect();
    let mut scales = vec![1.0f32; 8];
    scales.extend([2.0f32; 8]);
    let w = gptq::repack(&qweight16, &[0, 0], &scales, Some(perm), 8, 16, 8, false);
    let mut row = [0f32; 16];
    w.dequantize_row(0, &mut row);
    assert_eq!((row[2], row[3]), (2.0, 6.0), "column 3 is in group 1 (scale 2)");
}

#[test]
fn the_tiled_packed_product_equals_the_dequantized_matrix_product_bit_for_bit() {
    // 300 rows (tiles do not divide it), 40 columns in 5 groups of 8, asymmetric zeros, with and
    // without a g_idx permutation.
    let (rows, cols) = (300, 40);
    let codes: Vec<u8> = (0..rows * cols / 2).map(|i| (i * 37 % 251) as u8).collect();
    let scales: Vec<f32> = (0..rows * 5).map(|i| 0.01 + (i % 7) as f32 * 0.003).collect();
    let zeros: Vec<u8> = (0..rows * 5).map(|i| (i % 16) as u8).collect();
    let x: Vec<f32> = (0..3 * cols).map(|i| (i as f32 * 0.37).sin()).collect();
    for g_idx in [
        None,
        Some((0..cols as u32).map(|c| (c * 3) % 5).collect::<Vec<_>>()),
    ] {
        let w = W4Weight {
            method: W4Method::Gptq,
            rows,
            cols,
            codes: codes.clone(),
            group_size: 8,
            groups: 5,
            scales: scales.clone(),
            zeros: zeros.clone(),
            g_idx,
        }
        .checked()
        .unwrap();
        let dense = w.dequantize();
        for t in [1, 3] {
            let (mut a, mut b) = (vec![0f32; t * rows], vec![0f32; t * rows]);
            w.project(&x[..t * cols], t, &mut a);
            matmul_t(&x[..t * cols], t, cols, &dense, rows, &mut b);
            assert_eq!(bits(&a), bits(&b), "t {t}");
        }
    }
}

#[test]
fn quantization_configs_of_each_format_parse_and_unsupported_variants_name_the_field() {
    let parse = |qc: Value| W4Config::from_config_json(&json!({ "quantization_config": qc }));
    let awq = parse(
        json!({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": true, "version": "GEMM"}),
    )
    .unwrap()
    .unwrap();
    assert_eq!(
        (awq.method, awq.group_size, awq.zero_minus_one),
        (W4Method::Awq, Some(128), false)
    );
    let awq = parse(json!({"quant_method": "awq", "w_bit": 4, "q_group_size": 64, "zero_point": true}))
        .unwrap()
        .unwrap();
    assert_eq!(awq.group_size, Some(64), "AutoAWQ's older keys");
    let gptq =
        parse(json!({"quant_method": "gptq", "bits": 4, "group_size": -1, "desc_act": true, "sym": false}))
            .unwrap()
            .unwrap();
    assert_eq!(
        (gptq.group_size, gptq.act_order, gptq.zero_minus_one),
        (None, true, true)
    );
    let v2 =
        parse(json!({"quant_method": "gptq", "bits": 4, "group_size": 32, "checkpoint_format": "gptq_v2"}))
            .unwrap()
            .unwrap();
    assert!(!v2.zero_minus_one);
    let ct = |w: Value, extra: Value| {
        let mut g = json!({"targets": ["Linear"], "weights": w});
        if let (Some(g), Some(e)) = (g.as_object_mut(), extra.as_object()) {
            g.extend(e.clone());
        }
        json!({"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"], "config_groups": {"group_0": g}})
    };
    let c = parse(ct(
        json!({"type": "int", "num_bits": 4, "strategy": "group", "group_size": 128, "symmetric": false}),
        json!({}),
    ))
    .unwrap()
    .unwrap();
    assert_eq!(
        (c.method, c.group_size, c.zero_points, c.ignored.as_slice()),
        (
            W4Method::CompressedTensors,
            Some(128),
            true,
            &["lm_head".to_string()][..]
        )
    );
    let c = parse(ct(
        json!({"type": "int", "num_bits": 4, "strategy": "channel", "symmetric": true}),
        json!({}),
    ))
    .unwrap()
    .unwrap();
    assert_eq!((c.group_size, c.zero_points), (None, false));
    // FP8 and 8-bit integers are the FP8 reader's; no config, no 4-bit method.
    assert_eq!(
        parse(ct(
            json!({"type": "float", "num_bits": 8, "strategy": "channel"}),
            json!({})
        ))
        .unwrap(),
        None
    );
    assert_eq!(
        parse(ct(
            json!({"type": "int", "num_bits": 8, "strategy": "channel"}),
            json!({})
        ))
        .unwrap(),
        None
    );
    assert_eq!(parse(json!({"quant_method": "fp8"})).unwrap(), None);
    assert_eq!(W4Config::from_config_json(&json!({})).unwrap(), None);
    let mx = parse(json!({"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}))
        .unwrap()
        .unwrap();
    assert_eq!(
        (mx.method, mx.group_size, mx.zero_points),
        (W4Method::Mxfp4, Some(32), false)
    );
    for (qc, field) in [
        (
            json!({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}),
            "quantization_config.version",
        ),
        (
            json!({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": false}),
            "quantization_config.zero_point",
        ),
        (
            json!({"quant_method": "awq", "bits": 3, "group_size": 128}),
            "quantization_config.bits",
        ),
        (
            json!({"quant_method": "awq", "bits": 4}),
            "quantization_config.group_size",
        ),
        (
            json!({"quant_method": "gptq", "bits": 8, "group_size": 128}),
            "quantization_config.bits",
        ),
        (
            json!({"quant_method": "gptq", "bits": 4, "group_size": 100}),
            "quantization_config.group_size",
        ),
        (
            json!({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"}),
            "quantization_config.checkpoint_format",
        ),
        (
            json!({"quant_method": "gptq", "bits": 4, "group_size": 128, "lm_head": true}),
            "quantization_config.lm_head",
        ),
        (
            ct(
                json!({"type": "int", "num_bits": 4, "strategy": "tensor"}),
                json!({}),
            ),
            "quantization_config.config_groups.group_0.weights.strategy",
        ),
        (
            ct(
                json!({"type": "int", "num_bits": 4, "strategy": "channel"}),
                json!({"input_activations": {"type": "int", "num_bits": 8}}),
            ),
            "quantization_config.config_groups.group_0.input_activations",
        ),
    ] {
        let e = parse(qc.clone()).unwrap_err();
        assert!(e.to_string().contains(field), "{qc}: {e}");
    }
}

#[test]
fn a_packed_tensor_of_the_wrong_shape_or_a_missing_g_idx_is_an_error_naming_it() {
    let dir = fixture("gptq-g64-asym-act");
    let cfg = hf::w4_quantization(&dir).unwrap().unwrap();
    let st = Safetensors::open(&dir).unwrap();
    let stem = "model.layers.0.self_attn.q_proj";
    let e = cfg.load_linear(stem, 192, 200, |n| st.raw(n)).unwrap_err();
    assert!(
        e.to_string().contains("q_proj") && e.to_string().contains("shape"),
        "{e}"
    );
    let e = cfg
        .load_linear(stem, 192, 192, |n| st.raw(n).filter(|_| !n.ends_with("g_idx")))
        .unwrap_err();
    assert!(
        e.to_string().contains("g_idx") && e.to_string().contains("desc_act"),
        "{e}"
    );
    assert_eq!(
        cfg.load_linear("lm_head", 257, 192, |n| st.raw(n)).unwrap(),
        None,
        "stored unquantized"
    );
}

#[test]
fn fp8_at_load_leaves_a_packed_model_as_it_is() {
    let m = hf::load_model(&fixture("awq-g32")).unwrap();
    let mut q = m.clone();
    q.quantize_fp8();
    assert_eq!(q.quantization(), LinearQuantization::W4A16(W4Method::Awq));
    assert_eq!(q.linear_weight_bytes(), m.linear_weight_bytes());
}

#[test]
fn compressed_tensors_weight_g_idx_and_unpacked_int8_zero_points_are_read() {
    // 8 rows x 16 columns, groups of 8 chosen by `weight_g_idx` (column c in group c % 2);
    // row r's codes are all r + 4, its zero points (signed, unpacked I8) -2 and 3, scales 1 and 2.
    let (rows, cols) = (8usize, 16usize);
    let packed: Vec<u8> = (0..rows)
        .flat_map(|r| {
            let word = (0..8).fold(0u32, |w, k| w | ((r as u32 + 4) << (4 * k)));
            [word, word].into_iter().flat_map(u32::to_le_bytes)
        })
        .collect();
    let scales: Vec<u8> = (0..rows)
        .flat_map(|_| [1f32, 2.0])
        .flat_map(f32::to_le_bytes)
        .collect();
    let zps: Vec<u8> = (0..rows).flat_map(|_| [-2i8 as u8, 3]).collect();
    let g_idx: Vec<u8> = (0..cols as i32).flat_map(|c| (c % 2).to_le_bytes()).collect();
    let shape: Vec<u8> = [rows as i64, cols as i64]
        .into_iter()
        .flat_map(i64::to_le_bytes)
        .collect();
    let (s_packed, s_scale, s_zp, s_g, s_shape) = ([rows, 2], [rows, 2], [rows, 2], [cols], [2]);
    let get = |n: &str| -> Option<RawTensor<'_>> {
        let (shape, dtype, data): (&[usize], Dtype, &[u8]) = match n.rsplit('.').next()? {
            "weight_packed" => (&s_packed, Dtype::I32, &packed),
            "weight_scale" => (&s_scale, Dtype::F32, &scales),
            "weight_zero_point" => (&s_zp, Dtype::I8, &zps),
            "weight_g_idx" => (&s_g, Dtype::I32, &g_idx),
            "weight_shape" => (&s_shape, Dtype::I64, &shape),
            _ => return None,
        };
        Some(RawTensor { shape, dtype, data })
    };
    let qc = json!({"quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized",
        "config_groups": {"g": {"weights": {"type": "int", "num_bits": 4, "strategy": "group", "group_size": 8,
        "symmetric": false, "actorder": "group"}}}}});
    let cfg = W4Config::from_config_json(&qc).unwrap().unwrap();
    assert!(cfg.act_order && cfg.zero_points);
    let w = cfg.load_linear("m", rows, cols, get).unwrap().unwrap();
    assert!(w.g_idx.is_some());
    let mut row = vec![0f32; cols];
    w.dequantize_row(5, &mut row);
    // Stored code 9 is signed 1; zero points -2 (group 0) and 3 (group 1).
    for (c, v) in row.iter().enumerate() {
        let want = if c % 2 == 0 {
            (1.0 + 2.0) * 1.0
        } else {
            (1.0 - 3.0) * 2.0
        };
        assert_eq!(*v, want, "column {c}");
    }
}

#[test]
fn an_odd_number_of_columns_dequantizes_its_last_column_from_a_low_nibble() {
    // One group of 7 columns (compressed-tensors channel scales on an odd in_features).
    let codes: Vec<u8> = vec![0x10, 0x32, 0x54, 0x06, 0xfe, 0xdc, 0xba, 0x09];
    let w = W4Weight {
        method: W4Method::CompressedTensors,
        rows: 2,
        cols: 7,
        codes,
        group_size: 7,
        groups: 1,
        scales: vec![0.5, 2.0],
        zeros: vec![8, 8],
        g_idx: None,
    }
    .checked()
    .unwrap();
    let mut row = [0f32; 7];
    w.dequantize_row(0, &mut row);
    assert_eq!(
        row,
        [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0].map(|q: f32| (q - 8.0) * 0.5)
    );
    w.dequantize_row(1, &mut row);
    assert_eq!(
        row,
        [14.0, 15.0, 12.0, 13.0, 10.0, 11.0, 9.0].map(|q: f32| (q - 8.0) * 2.0)
    );
}
