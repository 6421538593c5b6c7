//! The k-quant, i-quant and ternary row encoders (`tftf::ops::gguf::kquants`) against ggml's
//! own `ggml_quantize_chunk` (llama.cpp 0c1e570, what `llama-quantize` calls), byte for byte,
//! with and without an importance matrix. Golden rows: `tests/fixtures/gguf_kquants/`
//! (`generate.py` there).

mod common;

use std::collections::BTreeSet;

use safetensors::SafeTensors;
use tftf::ops::gguf::kquants::{row_bytes, KQuant};

/// Cases the generator writes; a fixture missing one fails rather than shrinking the test.
const CASES: [&str; 14] = [
    "gaussian",
    "bf16_gaussian",
    "heavy_tailed",
    "zeros",
    "constant",
    "outlier",
    "tiny",
    "negative",
    "mixed_sign",
    "grid",
    "wide",
    "varied",
    "dead_columns",
    "zero_sub_blocks",
];

fn golden() -> Vec<u8> {
    std::fs::read(common::fixture("gguf_kquants/golden.safetensors")).expect("golden rows")
}

fn f32s(st: &SafeTensors, name: &str) -> (Vec<f32>, Vec<usize>) {
    let t = st.tensor(name).unwrap_or_else(|e| panic!("{name}: {e}"));
    let vals = t
        .data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    (vals, t.shape().to_vec())
}

/// The types ggml encodes only with an importance matrix (it asserts one): their goldens are
/// the `.imatrix` ones alone.
fn needs_imatrix(ty: KQuant) -> bool {
    matches!(ty, KQuant::Iq2Xxs | KQuant::Iq2Xs | KQuant::Iq1S)
}

/// Encodes every case's rows as `ty`, with and without its imatrix (with only, for the types
/// that need one), and compares each row with ggml's; a mismatch names the case, row, block
/// and byte.
fn assert_matches_ggml(ty: KQuant) {
    let bytes = golden();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut checked = BTreeSet::new();
    for case in CASES {
        let (rows, shape) = f32s(&st, case);
        let (imatrix, _) = f32s(&st, &format!("{case}.imatrix"));
        let n = shape[1];
        let (_, block_bytes) = ty.block();
        let row_len = row_bytes(ty, n).expect("whole blocks");
        for (suffix, qw) in [("", None), (".imatrix", Some(imatrix.as_slice()))] {
            if qw.is_none() && needs_imatrix(ty) {
                assert!(
                    st.tensor(&format!("{}.{case}", ty.name())).is_err(),
                    "ggml cannot make it"
                );
                continue;
            }
            let name = format!("{}.{case}{suffix}", ty.name());
            let want = st.tensor(&name).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(want.shape(), &[shape[0], row_len], "{name}");
            let mut got = vec![0xAAu8; row_len];
            for (r, (src, want)) in rows
                .chunks_exact(n)
                .zip(want.data().chunks_exact(row_len))
                .enumerate()
            {
                ty.quantize_row(src, &mut got, qw);
                if let Some(at) = got.iter().zip(want).position(|(a, b)| a != b) {
                    let (block, byte) = (at / block_bytes, at % block_bytes);
                    let span = block * block_bytes..(block + 1) * block_bytes;
                    panic!(
                        "{name} row {r}: block {block} byte {byte} is {:#04x}, ggml {:#04x}\n\
                         ours: {:02x?}\nggml: {:02x?}",
                        got[at],
                        want[at],
                        &got[span.clone()],
                        &want[span]
                    );
                }
                checked.insert(name.clone());
            }
        }
    }
    let per_case = if needs_imatrix(ty) { 1 } else { 2 };
    assert_eq!(checked.len(), per_case * CASES.len(), "{}", ty.name());
}

#[test]
fn q6_k_rows_are_byte_identical_to_ggml() {
    assert_matches_ggml(KQuant::Q6K);
}

#[test]
fn q5_k_rows_are_byte_identical_to_ggml() {
    assert_matches_ggml(KQuant::Q5K);
}

#[test]
fn q4_k_rows_are_byte_identical_to_ggml() {
    assert_matches_ggml(KQuant::Q4K);
}

#[test]
fn q3_k_rows_are_byte_identical_to_ggml() {
    assert_matches_ggml(KQuant::Q3K);
}

#[test]
fn q2_k_rows_are_byte_identical_to_ggml() {
    assert_matches_ggml(KQuant::Q2K);
}

#[test]
fn iq4_nl_rows_are_byte_identical_to_ggml() {
    assert_matches_ggml(KQuant::Iq4Nl);
}

#[test]
fn iq4_xs_rows_are_byte_identical_to_ggml() {
    assert_matches_ggml(KQuant::Iq4Xs);
}

#[test]
fn iq3_xxs_rows_are_byte_identical_to_ggml() {
    assert_matches_ggml(KQuant::Iq3Xxs);
}

#[test]
fn iq3_s_rows_are_byte_identical_to_ggml() {
    assert_matches_ggml(KQuant::Iq3S);
}

#[test]
fn tq1_0_rows_are_byte_identical_to_ggml() {
    assert_matches_ggml(KQuant::Tq1_0);
}

#[test]
fn tq2_0_rows_are_byte_identical_to_ggml() {
    assert_matches_ggml(KQuant::Tq2_0);
}

#[test]
fn iq2_xxs_rows_are_byte_identical_to_ggml() {
    assert_matches_ggml(KQuant::Iq2Xxs);
}

#[test]
fn iq2_xs_rows_are_byte_identical_to_ggml() {
    assert_matches_ggml(KQuant::Iq2Xs);
}

#[test]
fn iq2_s_rows_are_byte_identical_to_ggml() {
    assert_matches_ggml(KQuant::Iq2S);
}

#[test]
fn iq1_s_rows_are_byte_identical_to_ggml() {
    assert_matches_ggml(KQuant::Iq1S);
}

#[test]
fn iq1_m_rows_are_byte_identical_to_ggml() {
    assert_matches_ggml(KQuant::Iq1M);
}

/// The imatrix changes the k-quant and IQ4 bytes (so the weighted path is really taken) and
/// leaves the ternary ones alone, as in ggml.
#[test]
fn the_imatrix_path_is_taken_where_ggml_takes_it() {
    let bytes = golden();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let (rows, shape) = f32s(&st, "gaussian");
    let (imatrix, _) = f32s(&st, "gaussian.imatrix");
    let src = &rows[..shape[1]];
    for ty in KQuant::ALL.into_iter().filter(|&t| !needs_imatrix(t)) {
        let len = row_bytes(ty, src.len()).unwrap();
        let (mut plain, mut weighted) = (vec![0u8; len], vec![0u8; len]);
        ty.quantize_row(src, &mut plain, None);
        ty.quantize_row(src, &mut weighted, Some(&imatrix));
        let ternary = matches!(ty, KQuant::Tq1_0 | KQuant::Tq2_0);
        assert_eq!(plain == weighted, ternary, "{}", ty.name());
    }
}
