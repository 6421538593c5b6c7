//! The CUDA kernels' arithmetic, compiled for the host from the very `kernels/*.cuh` sources the
//! GPU build uses, checked bit for bit against the Rust CPU ops on random inputs and every edge
//! code; and the committed PTX checked against those sources. CI has no GPU: this is how it
//! verifies what the GPU computes.

use std::ffi::{c_int, c_void, CString};
use std::ops::Range;
use std::path::Path;
use std::sync::OnceLock;

use tftf::commands::selftest::encoders::{modelopt_op, quantize_op, quantize_weight};
use tftf::commands::selftest::table::{self as selftest, DequantShape, Lcg as Rng};
use tftf::format::dtype::DType;
use tftf::ops::fp4::engram::requant_row;
use tftf::ops::fp4::kernel::Fp4Params;
use tftf::ops::fp4::kernel::RowSums;
use tftf::ops::fp4::nvfp4::{NvBlockScales, NvReencode};
use tftf::ops::fp8::kernel::DequantParams;
use tftf::ops::fp8::{DequantFp8, ScaleLayout, ScaleMode};
use tftf::ops::gguf::GgmlType;
use tftf::ops::int::kernel::{GptqParams, Int4Params, IntParams};
use tftf::ops::kernel::gguf::{GgufLaunch, GgufParams};
use tftf::ops::kernel::{kernel_dtype, Kernel};
use tftf::ops::lora::kernel::{DeltaParams, LoraParams};
use tftf::ops::quantize::encode::{modelopt_mx_exponent, WeightType};
use tftf::ops::quantize::kernel::QuantParams;
use tftf::ops::quantize::ops::{BlockMath, QuantizeRows, FP8_BLOCK};
use tftf::ops::quantize::Scheme;
use tftf::ops::Op;
use tftf::plan::kernel::merge::{MergeLaunch, MergeParams};

/// Must match OPTIONS in scripts/gen-ptx.py.
const PTX_OPTIONS: &str = "--gpu-architecture=compute_80 --fmad=false --std=c++17";

struct HostKernels(*mut c_void);
unsafe impl Send for HostKernels {}
unsafe impl Sync for HostKernels {}

/// Builds kernels/host.cpp with g++ (no contraction, as the PTX is built with --fmad=false) once
/// per test run and loads it.
fn kernels() -> &'static HostKernels {
    static LIB: OnceLock<HostKernels> = OnceLock::new();
    LIB.get_or_init(|| {
        let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join("libtftf_host_kernels.so");
        let status = std::process::Command::new("g++")
            .args([
                "-O2",
                "-std=c++17",
                "-Wall",
                "-Wextra",
                "-Werror",
                "-ffp-contract=off",
            ])
            .args([
                "-fno-fast-math",
                "-shared",
                "-fPIC",
                "kernels/host.cpp",
                "-o",
            ])
            .arg(&out)
            .status()
            .expect("g++ runs (the kernel tests compile kernels/host.cpp for the host)");
        assert!(status.success(), "g++ failed on kernels/host.cpp");
        let path = CString::new(out.to_str().unwrap()).unwrap();
        // SAFETY: loading a library we just built; its functions are looked up by name below.
        let h = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        assert!(!h.is_null(), "dlopen {}", out.display());
        HostKernels(h)
    })
}

fn sym(name: &str) -> *mut c_void {
    let c = CString::new(name).unwrap();
    // SAFETY: the handle is a live library from `kernels()`.
    let p = unsafe { libc::dlsym(kernels().0, c.as_ptr()) };
    assert!(!p.is_null(), "symbol {name}");
    p
}

macro_rules! host_fn {
    ($name:literal, fn($($t:ty),*) -> $r:ty) => {{
        // SAFETY: the symbol has this C signature in kernels/host.cpp.
        unsafe { std::mem::transmute::<*mut c_void, unsafe extern "C" fn($($t),*) -> $r>(sym($name)) }
    }};
}

fn host_cast(src: DType, dst: DType, input: &[u8]) -> Vec<u8> {
    let n = input.len() as u64 / (src.bits() / 8);
    let mut out = vec![0u8; (n * dst.bits() / 8) as usize];
    let f = host_fn!(
        "tftf_host_cast",
        fn(*const u8, *mut u8, u64, c_int, c_int) -> ()
    );
    unsafe {
        f(
            input.as_ptr(),
            out.as_mut_ptr(),
            n,
            kernel_dtype(src),
            kernel_dtype(dst),
        )
    };
    out
}

/// The selftest's cases whose op, over all its units, has a kernel of the tuple variant
/// `$variant`, each with that kernel's parameters.
macro_rules! cases_with {
    ($variant:path) => {
        selftest::cases().into_iter().filter_map(|case| {
            match case.op.kernel(&(0..case.op.units())) {
                Some($variant(p)) => Some((case, p)),
                _ => None,
            }
        })
    };
}

fn hex_diff(what: &str, got: &[u8], want: &[u8], elem: usize) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    if let Some(i) =
        (0..got.len() / elem).find(|&i| got[i * elem..][..elem] != want[i * elem..][..elem])
    {
        panic!(
            "{what}: element {i} differs: kernel {:02x?}, CPU {:02x?}",
            &got[i * elem..][..elem],
            &want[i * elem..][..elem]
        );
    }
}

/// The selftest's cast cases (every 16-bit code, float edges, integer rounding edges, random
/// bytes), on the host build.
#[test]
fn casts_match_the_cpu_op_bit_for_bit() {
    let mut n = 0;
    for case in selftest::cases() {
        let Some(Kernel::Cast { src, dst }) = case.op.kernel(&(0..case.op.units())) else {
            continue;
        };
        let mut want = vec![0u8; (case.op.units() * case.op.out_unit_bytes()) as usize];
        case.op
            .compute(0..case.op.units(), &[&case.inputs[0]], &mut want)
            .unwrap();
        let got = host_cast(src, dst, &case.inputs[0]);
        hex_diff(&case.what, &got, &want, (dst.bits() / 8) as usize);
        n += 1;
    }
    assert_eq!(n, 13 * 3 - 3, "every source × target pair");
}

fn host_dequant(p: &DequantParams, dst: DType, codes: &[u8], scales: &[u8]) -> Option<Vec<u8>> {
    let n = codes.len() as u64;
    let mut out = vec![0u8; (n * dst.bits() / 8) as usize];
    let f = host_fn!(
        "tftf_host_dequant_fp8",
        fn(*const u8, *const u8, *mut u8, u64, *const DequantParams) -> c_int
    );
    let ok = unsafe { f(codes.as_ptr(), scales.as_ptr(), out.as_mut_ptr(), n, p) };
    (ok != 0).then_some(out)
}

/// [`host_dequant`] of `op`'s chunk `units`.
fn host_dequant_op(
    op: &DequantFp8,
    units: Range<u64>,
    codes: &[u8],
    scales: &[u8],
) -> Option<Vec<u8>> {
    host_dequant(&op.kernel_params(&units), op.dst, codes, scales)
}

fn cpu_compute(op: &dyn Op, units: Range<u64>, inputs: &[&[u8]]) -> Result<Vec<u8>, String> {
    let mut out = vec![0u8; ((units.end - units.start) * op.out_unit_bytes()) as usize];
    op.compute(units, inputs, &mut out).map(|_| out)
}

/// Every weight, scale and output dtype and mode on four shapes (block grids ragged both ways,
/// experts, per-row scales, one scale shared by experts), on chunks that start mid-tensor.
#[test]
fn fp8_dequant_matches_the_cpu_op_bit_for_bit() {
    let shape = |experts, rows, cols, br, bc, shared| DequantShape {
        experts,
        rows,
        cols,
        br,
        bc,
        shared,
    };
    let shapes = [
        shape(1, 37, 300, 16, 128, false),
        shape(3, 20, 64, 8, 32, false),
        shape(1, 9, 256, 1, 256, false),
        shape(2, 6, 40, 6, 40, true),
    ];
    let modes = [
        (ScaleMode::Multiply, false),
        (ScaleMode::Divide, false),
        (ScaleMode::Multiply, true),
        (ScaleMode::Divide, true),
    ];
    let cases = selftest::dequant_cases(&mut Rng(2), &shapes, &modes);
    assert_eq!(cases.len(), 4 * 2 * 5 * 3 * 4);
    for case in cases {
        let op = case.op.as_ref();
        let all = op.units();
        let g = op.granularity();
        for units in [0..all, g..all.min(3 * g), (all - g)..all] {
            let ins = selftest::slices(op, units.clone(), &case.inputs);
            let what = format!("{} units {units:?}", case.what);
            let want = cpu_compute(op, units.clone(), &ins);
            let Some(Kernel::DequantFp8(p)) = op.kernel(&units) else {
                unreachable!("dequantisation has a kernel")
            };
            let dst = case.out_dtype;
            let got = host_dequant(&p, dst, ins[0], ins.get(1).copied().unwrap_or(&[]));
            match (got, want) {
                (Some(g), Ok(w)) => hex_diff(&what, &g, &w, (dst.bits() / 8) as usize),
                (None, Err(_)) => {}
                (g, w) => panic!("{what}: kernel ok={}, CPU {:?}", g.is_some(), w.err()),
            }
        }
    }
}

#[test]
fn refused_values_are_refused_by_the_kernel_too() {
    let op = DequantFp8 {
        weight_dtype: DType::F8_E4M3,
        scale_dtype: Some(DType::F32),
        layout: ScaleLayout {
            experts: 1,
            rows: 2,
            cols: 4,
            expert_stride: 1,
            grid_cols: 1,
            block_rows: 2,
            block_cols: 4,
        },
        mode: ScaleMode::Multiply,
        dst: DType::BF16,
        allow_nonfinite: false,
    };
    let one = 1f32.to_le_bytes();
    let codes = [0x38u8, 0x7F, 0, 0, 0, 0, 0, 0];
    assert!(host_dequant_op(&op, 0..2, &codes, &one).is_none());
    assert!(cpu_compute(&op, 0..2, &[&codes, &one])
        .unwrap_err()
        .contains("non-finite F8_E4M3 code 0x7f at [0, 1]"));
    let inf = f32::INFINITY.to_le_bytes();
    assert!(host_dequant_op(&op, 0..2, &[0; 8], &inf).is_none());
    assert!(host_dequant_op(&op, 0..2, &[0; 8], &one).is_some());
    // Results the output dtype cannot hold: 448 × 1e38 (f32 overflow), 448 × 1000 in F16,
    // 1 / 0 and 0 / 0; each allowed with --allow-nonfinite, bit for bit as the CPU op.
    let cases = [
        (ScaleMode::Multiply, DType::BF16, 1e38f32),
        (ScaleMode::Multiply, DType::F16, 1000.0),
        (ScaleMode::Divide, DType::F32, 0.0),
    ];
    let codes = [0x38u8, 0x7E, 0, 0, 0, 0, 0, 0];
    for (mode, dst, scale) in cases {
        let mut op = DequantFp8 {
            mode,
            dst,
            layout: op.layout.clone(),
            ..op
        };
        let s = scale.to_le_bytes();
        assert!(
            host_dequant_op(&op, 0..2, &codes, &s).is_none(),
            "{mode:?} {dst}"
        );
        assert!(cpu_compute(&op, 0..2, &[&codes, &s])
            .unwrap_err()
            .contains("is not finite"));
        op.allow_nonfinite = true;
        let want = cpu_compute(&op, 0..2, &[&codes, &s]).unwrap();
        assert_eq!(host_dequant_op(&op, 0..2, &codes, &s).unwrap(), want);
    }
}

#[test]
fn nvfp4_scale_transcode_matches_the_cpu_op() {
    let f = host_fn!(
        "tftf_host_nv_block_scales",
        fn(*const u8, *mut u8, u64, c_int) -> c_int
    );
    let all: Vec<u8> = (0..=254).collect();
    for g in -140..=140 {
        let op = NvBlockScales {
            rows: 1,
            groups: all.len() as u64,
            g,
        };
        let want = cpu_compute(&op, 0..1, &[&all]).unwrap();
        let mut got = vec![0u8; want.len()];
        assert_eq!(
            unsafe { f(all.as_ptr(), got.as_mut_ptr(), all.len() as u64, g) },
            1
        );
        hex_diff(&format!("g={g}"), &got, &want, 2);
    }
    let nan = [127u8, 0xFF];
    let mut got = [0u8; 4];
    assert_eq!(unsafe { f(nan.as_ptr(), got.as_mut_ptr(), 2, 0) }, 0);
    assert!(cpu_compute(
        &NvBlockScales {
            rows: 1,
            groups: 2,
            g: 0
        },
        0..1,
        &[&nan]
    )
    .is_err());
}

#[test]
fn nvfp4_reencode_matches_the_cpu_op() {
    let f = host_fn!(
        "tftf_host_nv_reencode",
        fn(*const u8, *const u8, *mut u8, u64, c_int) -> ()
    );
    let mut rng = Rng(3);
    let scales: Vec<u8> = (0..=254).collect();
    let mut packed = rng.bytes(16 * scales.len());
    packed[16..32].fill(0x88); // an all-±0 block
    for g in [-127, -20, -3, 0, 5, 30, 120] {
        let op = NvReencode {
            rows: 1,
            groups: scales.len() as u64,
            g,
        };
        let want = cpu_compute(&op, 0..1, &[&packed, &scales]).unwrap();
        let mut got = vec![0u8; want.len()];
        unsafe {
            f(
                packed.as_ptr(),
                scales.as_ptr(),
                got.as_mut_ptr(),
                scales.len() as u64,
                g,
            )
        };
        hex_diff(&format!("g={g}"), &got, &want, 16);
    }
}

/// Packed codes, new scales, per-row sums, clamped blocks.
type EngramResult = (Vec<u8>, Vec<u8>, Vec<RowSums>, u64);

fn host_engram(codes: &[u8], scales: &[u8], rows: u64, cols: u64) -> Option<EngramResult> {
    let f = host_fn!(
        "tftf_host_engram",
        fn(*const u8, *const u8, *mut u8, *mut u8, u64, u64, *mut RowSums, *mut u64) -> c_int
    );
    let mut packed = vec![0u8; codes.len() / 2];
    let mut new_scales = vec![0u8; scales.len()];
    let mut sums = vec![RowSums::default(); rows as usize];
    let mut clamped = 0u64;
    let ok = unsafe {
        f(
            codes.as_ptr(),
            scales.as_ptr(),
            packed.as_mut_ptr(),
            new_scales.as_mut_ptr(),
            rows,
            cols,
            sums.as_mut_ptr(),
            &mut clamped,
        )
    };
    (ok != 0).then_some((packed, new_scales, sums, clamped))
}

#[test]
fn engram_requant_and_its_quality_sums_match_the_cpu_op() {
    let mut rng = Rng(4);
    let (rows, cols) = (64u64, 256u64);
    let nb = (cols / 32) as usize;
    let mut codes = rng.bytes((rows * cols) as usize);
    codes
        .iter_mut()
        .filter(|c| **c & 0x7F == 0x7F)
        .for_each(|c| *c = 0x7E);
    for (i, c) in codes.iter_mut().take(254).enumerate() {
        *c = if i as u8 & 0x7F == 0x7F { 0 } else { i as u8 };
    }
    codes[256..288].fill(0); // all-zero block
    codes[288..320].fill(0x80); // all -0
    let mut scales: Vec<u8> = (0..rows as usize * nb)
        .map(|_| (rng.next_u32() % 200) as u8)
        .collect();
    scales[20] = 0; // 2^-127 with tiny codes: clamped
    codes[20 * 32..21 * 32].fill(0x01);
    scales[21] = 254; // near the top
    codes[21 * 32..22 * 32].fill(0x30);
    let (packed, new_scales, sums, clamped) =
        host_engram(&codes, &scales, rows, cols).expect("kernel accepts");
    let mut want_packed = vec![0u8; packed.len()];
    let mut want_scales = vec![0u8; new_scales.len()];
    let mut want_clamped = 0;
    for r in 0..rows as usize {
        let (s, c) = requant_row(
            r as u64,
            &codes[r * cols as usize..(r + 1) * cols as usize],
            &scales[r * nb..(r + 1) * nb],
            &mut want_packed[r * cols as usize / 2..(r + 1) * cols as usize / 2],
            &mut want_scales[r * nb..(r + 1) * nb],
        )
        .unwrap();
        want_clamped += c;
        for (name, g, w) in [
            ("dot", sums[r].dot, s.dot),
            ("xx", sums[r].xx, s.xx),
            ("yy", sums[r].yy, s.yy),
            ("sq_err", sums[r].sq_err, s.sq_err),
        ] {
            assert_eq!(
                g.to_bits(),
                w.to_bits(),
                "row {r} {name}: kernel {g}, CPU {w}"
            );
        }
    }
    assert!(want_clamped > 0);
    assert_eq!(clamped, want_clamped);
    hex_diff("packed", &packed, &want_packed, 1);
    hex_diff("scales", &new_scales, &want_scales, 1);
    // Refused inputs: NaN scale, NaN code, scale beyond 2^127.
    let mut bad = scales.clone();
    bad[5] = 0xFF;
    assert!(host_engram(&codes, &bad, rows, cols).is_none());
    let mut bad = codes.clone();
    bad[1000] = 0xFF;
    assert!(host_engram(&bad, &scales, rows, cols).is_none());
    let (big_c, big_s) = ([0x7Eu8; 32], [254u8]);
    assert!(host_engram(&big_c, &big_s, 1, 32).is_none());
    let (mut o, mut s) = ([0u8; 16], [0u8; 1]);
    assert!(requant_row(0, &big_c, &big_s, &mut o, &mut s)
        .unwrap_err()
        .contains("beyond F8_E8M0"));
}

#[test]
fn lora_merge_matches_the_cpu_op_bit_for_bit() {
    let delta_fn = host_fn!(
        "tftf_host_lora_delta",
        fn(*const f32, *const f32, *mut f32, u64, *const DeltaParams) -> ()
    );
    let merge_fn = host_fn!(
        "tftf_host_lora",
        fn(*const u8, *const f32, *const f32, *mut u8, u64, *const LoraParams) -> ()
    );
    let mut n = 0;
    for case in selftest::cases() {
        let op = case.op.as_ref();
        let units = 5..op.units() - 3;
        let Some(Kernel::Lora(f)) = op.kernel(&units) else {
            continue;
        };
        let tr = units.end - units.start;
        let ins = selftest::slices(op, units.clone(), &case.inputs);
        let mut want = vec![0u8; (tr * op.out_unit_bytes()) as usize];
        op.compute(units.clone(), &ins, &mut want).unwrap();
        assert!(f.base_dequant.is_none() && f.base_inputs == 1);
        let a = tftf::ops::cast::to_f32(f.a_dtype, ins[1]);
        let b = tftf::ops::cast::to_f32(f.b_dtype, ins[2]);
        let (coef, vecs) = if f.coef_is_a { (&a, &b) } else { (&b, &a) };
        let mut delta = vec![0f32; (tr * f.delta.cols) as usize];
        let (c, v, d) = (coef.as_ptr(), vecs.as_ptr(), delta.as_mut_ptr());
        unsafe { delta_fn(c, v, d, tr, &f.delta) };
        let mag = f
            .m_dtype
            .map(|d| tftf::ops::cast::to_f32(d, ins[3]))
            .unwrap_or_default();
        let p = LoraParams {
            cols: f.delta.cols,
            scale: f.scale,
            base_dtype: kernel_dtype(f.base_dtype),
            dst: kernel_dtype(f.dst),
            dora: f.m_dtype.is_some() as i32,
            pad: 0,
        };
        let mut got = vec![0u8; want.len()];
        let (w, dl, mg, o) = (
            ins[0].as_ptr(),
            delta.as_ptr(),
            mag.as_ptr(),
            got.as_mut_ptr(),
        );
        unsafe { merge_fn(w, dl, mg, o, tr, &p) };
        hex_diff(&case.what, &got, &want, (f.dst.bits() / 8) as usize);
        n += 1;
    }
    assert_eq!(n, 15, "every LoRA, grouped-expert and expert-slice case");
}

#[test]
fn lora_epilogue_matches_the_cpu_merge_bit_for_bit() {
    let f = host_fn!(
        "tftf_host_lora",
        fn(*const u8, *const f32, *const f32, *mut u8, u64, *const LoraParams) -> ()
    );
    let mut rng = Rng(5);
    let (rows, cols) = (24usize, 100usize);
    for base_dtype in [DType::BF16, DType::F16, DType::F32] {
        for dst in [DType::BF16, DType::F16, DType::F32] {
            for dora in [false, true] {
                let w32 = rng.f32s(rows * cols);
                let base = selftest::f32_bytes_as(base_dtype, &w32);
                let delta: Vec<f32> = rng
                    .f32s(rows * cols)
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                    .collect();
                let mag: Vec<f32> = (0..rows)
                    .map(|_| rng.next_u32() as f32 / u32::MAX as f32 + 0.01)
                    .collect();
                let s = 0.37f32;
                let mut w = tftf::ops::cast::to_f32(base_dtype, &base);
                let mut want = vec![0u8; rows * cols * (dst.bits() / 8) as usize];
                tftf::ops::lora::merge::merge_epilogue(
                    &mut w,
                    &delta,
                    s,
                    dora.then_some(&mag[..]),
                    dst,
                    &mut want,
                );
                let p = LoraParams {
                    cols: cols as u64,
                    scale: s,
                    base_dtype: kernel_dtype(base_dtype),
                    dst: kernel_dtype(dst),
                    dora: dora as i32,
                    pad: 0,
                };
                let mut got = vec![0u8; want.len()];
                unsafe {
                    f(
                        base.as_ptr(),
                        delta.as_ptr(),
                        mag.as_ptr(),
                        got.as_mut_ptr(),
                        rows as u64,
                        &p,
                    )
                };
                hex_diff(
                    &format!("{base_dtype}->{dst} dora={dora}"),
                    &got,
                    &want,
                    (dst.bits() / 8) as usize,
                );
            }
        }
    }
}

/// The selftest's packed-integer cases (every width, with and without zero points, NaN and
/// infinite scales), on the host build, whole and in the op's 32-row chunks.
#[test]
fn int_dequant_matches_the_cpu_op_bit_for_bit() {
    let f = host_fn!(
        "tftf_host_dequant_int",
        fn(*const u8, *const u8, *const u8, *mut u8, u64, *const IntParams) -> ()
    );
    let mut n = 0;
    for (case, p) in cases_with!(Kernel::DequantInt) {
        let op = case.op.as_ref();
        let g = op.granularity();
        let mut cuts: Vec<u64> = (0..op.units()).step_by(g as usize).collect();
        cuts.push(op.units());
        let (mut got, mut want) = (Vec::new(), Vec::new());
        for units in cuts.windows(2).map(|w| w[0]..w[1]) {
            let ins = selftest::slices(op, units.clone(), &case.inputs);
            let len = ((units.end - units.start) * op.out_unit_bytes()) as usize;
            let mut w = vec![0u8; len];
            op.compute(units.clone(), &ins, &mut w).unwrap();
            let mut k = vec![0u8; len];
            let zp = ins.get(2).map_or(std::ptr::null(), |z| z.as_ptr());
            let elements = (units.end - units.start) * p.cols;
            // SAFETY: the slices are the op's input ranges for `units`; `k` holds `elements`.
            unsafe {
                f(
                    ins[0].as_ptr(),
                    ins[1].as_ptr(),
                    zp,
                    k.as_mut_ptr(),
                    elements,
                    &p,
                )
            };
            got.extend(k);
            want.extend(w);
        }
        hex_diff(
            &case.what,
            &got,
            &want,
            (case.out_dtype.bits() / 8) as usize,
        );
        n += 1;
    }
    assert_eq!(n, 8 * 5, "every width × scale/zero-point variant");
}

/// Asserts a decoder kernel's run (`ok`: its return, `got`) against the CPU op's (`cpu`,
/// `want`): the same bytes, or both refusing; returns the CPU op's refusal.
fn same_or_both_refused(
    case: &selftest::Case,
    what: &str,
    cpu: Result<(), String>,
    ok: c_int,
    got: &[u8],
    want: &[u8],
) -> Option<String> {
    match cpu {
        Ok(()) => {
            assert_eq!(ok, 1, "{what}: kernel refused");
            hex_diff(what, got, want, (case.out_dtype.bits() / 8) as usize);
            None
        }
        Err(e) => {
            assert_eq!(ok, 0, "{what}: CPU refused ({e}), kernel did not");
            Some(e)
        }
    }
}

/// The selftest's GPTQ cases (every width, v1 and v2 zeros, groups by size and by act-order
/// `g_idx`, NaN and infinite scales) on the host build; a `g_idx` outside the scales is refused
/// by both.
#[test]
fn gptq_dequant_matches_the_cpu_op_bit_for_bit() {
    let f = host_fn!(
        "tftf_host_dequant_gptq",
        fn(*const u8, *const u8, *const u8, *const u8, *mut u8, u64, *const GptqParams) -> c_int
    );
    let (mut n, mut refused) = (0, 0);
    for (case, p) in cases_with!(Kernel::DequantGptq) {
        let op = case.op.as_ref();
        let ins = selftest::slices(op, 0..1, &case.inputs);
        let len = op.out_unit_bytes() as usize;
        let mut want = vec![0u8; len];
        let cpu = op.compute(0..1, &ins, &mut want);
        let mut got = vec![0u8; len];
        let g_idx = ins.get(3).map_or(std::ptr::null(), |g| g.as_ptr());
        // SAFETY: the slices are the op's whole inputs; `got` holds rows × cols elements.
        let ok = unsafe {
            f(
                ins[0].as_ptr(),
                ins[1].as_ptr(),
                ins[2].as_ptr(),
                g_idx,
                got.as_mut_ptr(),
                p.rows * p.cols,
                &p,
            )
        };
        if let Some(e) = same_or_both_refused(&case, &case.what, cpu, ok, &got, &want) {
            assert!(e.contains("g_idx[41]"), "{e}");
            refused += 1;
        }
        n += 1;
    }
    assert_eq!((n, refused), (3 * 5, 3), "every width × layout");
}

/// The selftest's ModelOpt INT4 cases on the host build, whole and a packed row at a time; a
/// non-finite scale is refused by both.
#[test]
fn modelopt_int4_dequant_matches_the_cpu_op_bit_for_bit() {
    let f = host_fn!(
        "tftf_host_dequant_int4_modelopt",
        fn(*const u8, *const u8, *mut u8, u64, *const Int4Params) -> c_int
    );
    let (mut n, mut refused) = (0, 0);
    for (case, p) in cases_with!(Kernel::DequantInt4Modelopt) {
        let op = case.op.as_ref();
        let whole = 0..op.units();
        let pieces: Vec<Range<u64>> = (0..op.units()).map(|u| u..u + 1).collect();
        for units in std::iter::once(whole).chain(pieces) {
            let ins = selftest::slices(op, units.clone(), &case.inputs);
            let len = ((units.end - units.start) * op.out_unit_bytes()) as usize;
            let mut want = vec![0u8; len];
            let cpu = op.compute(units.clone(), &ins, &mut want);
            let mut got = vec![0u8; len];
            let elements = 2 * (units.end - units.start) * p.cols;
            // SAFETY: the slices are the op's input ranges for `units`; `got` holds `elements`.
            let ok = unsafe {
                f(
                    ins[0].as_ptr(),
                    ins[1].as_ptr(),
                    got.as_mut_ptr(),
                    elements,
                    &p,
                )
            };
            let what = format!("{} {units:?}", case.what);
            if same_or_both_refused(&case, &what, cpu, ok, &got, &want).is_some() {
                refused += 1;
            }
        }
        n += 1;
    }
    assert_eq!(n, 4, "every group × output dtype");
    assert!(refused >= 2, "the non-finite scales are refused");
}

/// The selftest's FP4 cases (NVFP4 both ways, ModelOpt's +0, every E8M0 exponent, NaN scales,
/// gpt-oss experts transposed) on the host build; a value the CPU op refuses is refused by the
/// kernel too.
#[test]
fn fp4_dequant_matches_the_cpu_op_bit_for_bit() {
    let f = host_fn!(
        "tftf_host_dequant_fp4",
        fn(*const u8, *const u8, *const u8, *mut u8, u64, *const Fp4Params) -> c_int
    );
    let run = |op: &dyn Op, p: &Fp4Params, inputs: &[Vec<u8>]| {
        let units = 0..op.units();
        let ins = selftest::slices(op, units.clone(), inputs);
        let len = (op.units() * op.out_unit_bytes()) as usize;
        let mut want = vec![0u8; len];
        let cpu = op.compute(units, &ins, &mut want);
        let mut got = vec![0u8; len];
        let global = ins.get(2).map_or(std::ptr::null(), |g| g.as_ptr());
        // SAFETY: the slices are the op's inputs for every unit; `got` holds 2 × codes elements.
        let ok = unsafe {
            f(
                ins[0].as_ptr(),
                ins[1].as_ptr(),
                global,
                got.as_mut_ptr(),
                2 * ins[0].len() as u64,
                p,
            )
        };
        (cpu.map(|_| want), ok == 1, got)
    };
    let mut n = 0;
    for (case, p) in cases_with!(Kernel::DequantFp4) {
        let op = case.op.as_ref();
        let (want, ok, got) = run(op, &p, &case.inputs);
        assert!(ok, "{}: kernel refused, CPU said {want:?}", case.what);
        hex_diff(
            &case.what,
            &got,
            &want.unwrap(),
            (case.out_dtype.bits() / 8) as usize,
        );
        // Without --allow-nonfinite, an infinite product is refused by both.
        if p.e8m0 == 1 && p.allow_nonfinite == 0 {
            let mut inputs = case.inputs.clone();
            inputs[1][7] = 255;
            let (want, ok, _) = run(op, &p, &inputs);
            assert!(want.is_err() && !ok, "{}: 2^128 must be refused", case.what);
        }
        n += 1;
    }
    assert_eq!(n, 6, "every FP4 scheme");
}

/// The quantisers' host build over one chunk: (codes, scales), or None when it refuses the
/// weight. Unwritten bytes keep a fill pattern the CPU side does not use.
fn host_quantize(
    p: &QuantParams,
    weight: &[u8],
    code_bytes: usize,
    scale_bytes: usize,
) -> Option<(Vec<u8>, Vec<u8>)> {
    let f = host_fn!(
        "tftf_host_quantize",
        fn(*const u8, *mut u8, *mut u8, *const QuantParams) -> c_int
    );
    let mut codes = vec![0xAAu8; code_bytes];
    let mut scales = vec![0xAAu8; scale_bytes];
    // SAFETY: `weight` holds p.rows rows; the outputs are sized by the caller for them.
    let ok = unsafe { f(weight.as_ptr(), codes.as_mut_ptr(), scales.as_mut_ptr(), p) };
    (ok != 0).then_some((codes, scales))
}

/// The CPU op's (codes, scales) of chunk `units`, from the whole weight.
fn cpu_quantize(
    op: &dyn Op,
    units: Range<u64>,
    weight: &[u8],
) -> Result<(Vec<u8>, Vec<u8>), String> {
    let len = |k| {
        let s = op.out_span(k, units.clone());
        (s.end - s.start) as usize
    };
    let mut codes = vec![0x55u8; len(0)];
    let mut scales = vec![0x55u8; len(1)];
    let inputs = [weight.to_vec()];
    let ins = selftest::slices(op, units.clone(), &inputs);
    op.compute_all(units, &ins, &mut [&mut codes, &mut scales])
        .map(|_| (codes, scales))
}

/// Host kernel against the CPU op on the whole weight and on chunks starting mid-tensor.
fn check_quantize(op: &dyn Op, weight: &[u8], what: &str) {
    let all = op.units();
    let unit_bytes = op.in_unit_bytes() as usize;
    // Chunks start at multiples of the granularity (128 rows for FP8 blocks).
    let g = op.granularity();
    let mid = (5 * g).min((all - 1) / g * g);
    let last = (all - 1) / g * g;
    for units in [0..all, mid..(mid + 16 * g).min(all), last..all] {
        let what = format!("{what} units {units:?}");
        let Some(Kernel::Quantize(p)) = op.kernel(&units) else {
            panic!("{what}: no quantiser kernel")
        };
        let chunk = &weight[units.start as usize * unit_bytes..units.end as usize * unit_bytes];
        let len = |k| {
            let s = op.out_span(k, units.clone());
            (s.end - s.start) as usize
        };
        let got = host_quantize(&p, chunk, len(0), len(1));
        match (got, cpu_quantize(op, units.clone(), weight)) {
            (Some((gc, gs)), Ok((wc, ws))) => {
                hex_diff(&format!("{what} codes"), &gc, &wc, 1);
                hex_diff(&format!("{what} scales"), &gs, &ws, 1);
            }
            (None, Err(_)) => {}
            (g, w) => panic!("{what}: kernel ok={}, CPU {:?}", g.is_some(), w.err()),
        }
    }
}

/// The selftest's quantiser cases (every row-local scheme × weight dtype, and FP8 blocks in
/// their one-op form) on the host build.
#[test]
fn quantizers_match_the_cpu_op_byte_for_byte() {
    let mut n = 0;
    for case in selftest::cases() {
        let op = case.op.as_ref();
        if !matches!(op.kernel(&(0..1)), Some(Kernel::Quantize(_))) {
            continue;
        }
        check_quantize(op, &case.inputs[0], &case.what);
        n += 1;
    }
    assert_eq!(
        n,
        6 * 3 + 2 * 3 + 6 * 3,
        "every scheme × weight dtype, FP8 blocks both ways, ModelOpt's six schemes"
    );
}

/// More shapes (a one-column row, ragged FP8 rows, one group a row), every row kind of the
/// selftest's weights under several seeds, and NVFP4 under tensor scales that make the
/// effective scale exact (1, powers of two) or not.
#[test]
fn quantizers_match_the_cpu_op_on_more_shapes_and_scales() {
    // Each scheme with its column counts, in this order.
    let widths: [(Scheme, &[u64]); 6] = [
        (Scheme::Fp8Dynamic, &[1, 7, 1000]),
        (Scheme::W8A16, &[128, 512]),
        (Scheme::W4A16, &[128, 640]),
        (Scheme::Nvfp4A16, &[16, 272]),
        (Scheme::Mxfp4A16, &[32, 320]),
        (Scheme::Mxfp8A16, &[32, 224]),
    ];
    let shapes = widths
        .iter()
        .flat_map(|&(scheme, cols)| cols.iter().map(move |&c| (scheme, c)));
    let mut rng = Rng(0x51);
    for (scheme, cols) in shapes {
        for wt in [WeightType::BF16, WeightType::F16, WeightType::F32] {
            let rows = 64;
            let weight = quantize_weight(wt, rows, cols, &mut rng);
            let mut op = quantize_op(scheme, wt, rows, cols, &weight);
            let what = format!("{} {:?} {rows}×{cols}", scheme.name(), wt);
            check_quantize(&op, &weight, &what);
            if scheme == Scheme::Nvfp4A16 {
                for global in [1.0f32, 0.5, 64.0, 2688.0, 1234.567, 3.0e-3, 1.0e6] {
                    op.global = global;
                    check_quantize(&op, &weight, &format!("{what} global {global}"));
                }
            }
        }
    }
}

/// ModelOpt's MX exponent without a logarithm (kernels/quantize.cuh) against the CPU's
/// `ceil(log2(d))` with the logarithm rounded to f32: for every binade of d (subnormal ones
/// included), the 4096 least and greatest mantissas (where the f32 rounding of the logarithm
/// decides) and 4096 others, under both element maxima.
#[test]
fn modelopt_mx_exponent_matches_the_cpu_logarithm() {
    let f = host_fn!("tftf_host_modelopt_mx_exponent", fn(f32, f32) -> c_int);
    let mut rng = Rng(0xe8);
    let mut n = 0u64;
    for elem_max in [6.0f32, 448.0] {
        for binade in 0u32..255 {
            let mantissas = (0u32..4096)
                .chain((0x7F_F000u32..0x80_0000).rev())
                .chain((0..4096).map(|_| rng.next_u32() & 0x7F_FFFF));
            for m in mantissas {
                // d = amax / elem_max; build amax from d so every d's binade is reached.
                let d = f32::from_bits(binade << 23 | m);
                for amax in [
                    d * elem_max,
                    (d * elem_max).next_up(),
                    (d * elem_max).next_down(),
                ] {
                    if !amax.is_finite() || amax < 0.0 {
                        continue;
                    }
                    // SAFETY: a pure function of two floats.
                    let got = unsafe { f(amax, elem_max) };
                    assert_eq!(
                        got,
                        modelopt_mx_exponent(amax, elem_max),
                        "amax {amax:e} ({:#010x}) / {elem_max}",
                        amax.to_bits()
                    );
                    n += 1;
                }
            }
        }
    }
    assert!(n > 12_000_000, "{n}");
}

/// More shapes for ModelOpt (one group a row, many groups, ragged FP8 rows and blocks) and
/// NVFP4 under `weight_scale_2` values that make the effective scale exact or not.
#[test]
fn modelopt_quantizers_match_the_cpu_op_on_more_shapes_and_scales() {
    let shapes = [
        (Scheme::Fp8Dynamic, 64u64, 1u64),
        (Scheme::Fp8Dynamic, 64, 1000),
        (Scheme::Fp8Block, 130, 129),
        (Scheme::Fp8Block, 256, 384),
        (Scheme::W4A16, 64, 128),
        (Scheme::W4A16, 64, 640),
        (Scheme::Nvfp4A16, 64, 16),
        (Scheme::Nvfp4A16, 64, 272),
        (Scheme::Mxfp4A16, 64, 32),
        (Scheme::Mxfp4A16, 64, 320),
        (Scheme::Mxfp8A16, 64, 32),
        (Scheme::Mxfp8A16, 64, 224),
    ];
    let mut rng = Rng(0x0d7);
    for (scheme, rows, cols) in shapes {
        for wt in [WeightType::BF16, WeightType::F16, WeightType::F32] {
            let weight = quantize_weight(wt, rows, cols, &mut rng);
            let mut op = modelopt_op(scheme, wt, rows, cols, &weight);
            let what = format!("ModelOpt {} {:?} {rows}×{cols}", scheme.name(), wt);
            check_quantize(&op, &weight, &what);
            if scheme == Scheme::Nvfp4A16 {
                for s2 in [1.0f32, 0.5, 1.0 / 64.0, 2688.0, 1234.567, 3.0e-3, 1.0e-6] {
                    op.scale_2 = s2;
                    check_quantize(&op, &weight, &format!("{what} weight_scale_2 {s2}"));
                }
            }
        }
    }
}

/// A non-finite weight (NaN, ±infinity) is refused by the kernel as by the CPU op, under both
/// compressed-tensors' and ModelOpt's arithmetic.
#[test]
fn quantizers_refuse_non_finite_weights_as_the_cpu_op_does() {
    let mut rng = Rng(9);
    let shapes = tftf::commands::selftest::encoders::QUANTIZE_SHAPES;
    let modelopt = shapes.into_iter().filter(|(s, _)| *s != Scheme::W8A16);
    let ops = shapes
        .into_iter()
        .map(|(s, c)| (s, c, false))
        .chain(modelopt.map(|(s, c)| (s, c, true)));
    for (scheme, cols, is_modelopt) in ops {
        for wt in [WeightType::BF16, WeightType::F16, WeightType::F32] {
            let rows = 10;
            let clean = quantize_weight(wt, rows, cols, &mut rng);
            let op: Box<dyn Op> = if is_modelopt {
                Box::new(modelopt_op(scheme, wt, rows, cols, &clean))
            } else {
                Box::new(quantize_op(scheme, wt, rows, cols, &clean))
            };
            let op = op.as_ref();
            for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
                let b = selftest::f32_bytes_as(wt.dtype(), &bad.to_le_bytes());
                let mut weight = clean.clone();
                let at = (3 * cols as usize + cols as usize - 1) * b.len();
                weight[at..at + b.len()].copy_from_slice(&b);
                let units = 0..rows;
                let Some(Kernel::Quantize(p)) = op.kernel(&units) else {
                    unreachable!()
                };
                let code_bytes = (rows * op.out_unit_bytes()) as usize;
                let scale_bytes = (rows * op.extra_unit_bytes(0)) as usize;
                let what = format!("{} {:?} holding {bad}", scheme.name(), wt);
                assert!(
                    host_quantize(&p, &weight, code_bytes, scale_bytes).is_none(),
                    "{what}: the kernel must refuse"
                );
                let err = cpu_quantize(op, units, &weight).unwrap_err();
                assert!(
                    err.contains(&format!("at [3, {}]", cols - 1)),
                    "{what}: {err}"
                );
            }
        }
    }
}

/// Scales that overflow (an F16 MX group rounding up to 2^16, transformers' 448 / amax of a
/// block below 1.3e-36) are refused by the kernel as by the CPU op.
#[test]
fn quantizers_refuse_overflowing_scales_as_the_cpu_op_does() {
    let f16 = |v: f32| selftest::f32_bytes_as(DType::F16, &v.to_le_bytes());
    let mut mx: Vec<u8> = (0..4 * 64).flat_map(|_| f16(1.0)).collect();
    mx[2 * (2 * 64 + 33)..2 * (2 * 64 + 34)].copy_from_slice(&f16(-57344.0));
    for scheme in [Scheme::Mxfp4A16, Scheme::Mxfp8A16] {
        let op = quantize_op(scheme, WeightType::F16, 4, 64, &mx);
        let Some(Kernel::Quantize(p)) = op.kernel(&(0..4)) else {
            unreachable!()
        };
        let (cb, sb) = (op.out_span(0, 0..4).end, op.out_span(1, 0..4).end);
        assert!(host_quantize(&p, &mx, cb as usize, sb as usize).is_none());
        let err = cpu_quantize(&op, 0..4, &mx).unwrap_err();
        assert!(err.contains("[2, 32..64]"), "{err}");
        // 49152 (1.5 · 2^15) rounds to the power of two 2^15: accepted by both.
        let mut ok = mx.clone();
        ok[2 * (2 * 64 + 33)..2 * (2 * 64 + 34)].copy_from_slice(&f16(-49152.0));
        let got = host_quantize(&p, &ok, cb as usize, sb as usize).expect("accepted");
        let want = cpu_quantize(&op, 0..4, &ok).unwrap();
        assert_eq!(got, want);
    }
    let (rows, cols) = (130u64, 200u64);
    let mut tiny: Vec<f32> = vec![1.0; (rows * cols) as usize];
    for r in 128..130 {
        for c in 128..200 {
            tiny[(r * cols + c) as usize] = 1e-37;
        }
    }
    let weight: Vec<u8> = tiny.iter().flat_map(|v| v.to_le_bytes()).collect();
    let op = QuantizeRows {
        scheme: Scheme::Fp8Block,
        rows,
        cols,
        wt: WeightType::F32,
        global: 1.0,
        block: BlockMath::Transformers,
    };
    let Some(Kernel::Quantize(p)) = op.kernel(&(0..rows)) else {
        unreachable!()
    };
    let (cb, sb) = (op.out_span(0, 0..rows).end, op.out_span(1, 0..rows).end);
    assert!(host_quantize(&p, &weight, cb as usize, sb as usize).is_none());
    let err = cpu_quantize(&op, 0..rows, &weight).unwrap_err();
    assert!(err.contains("block [1, 1]"), "{err}");
    let (mut c, mut s) = (vec![0u8; cb as usize], vec![0u8; sb as usize]);
    let err = op
        .compute_reference(0..rows, &[&weight], &mut [&mut c, &mut s])
        .unwrap_err();
    assert!(err.contains("block [1, 1]"), "reference: {err}");
}

/// FP8_BLOCK's (codes, block scales) of a chunk of whole block rows, from the CPU op itself;
/// Err for a non-finite weight.
fn reference_fp8_blocks(
    math: BlockMath,
    wt: WeightType,
    weight: &[u8],
    cols: u64,
) -> Result<(Vec<u8>, Vec<u8>), String> {
    let rows = (weight.len() / wt.bytes()) as u64 / cols;
    let op = QuantizeRows {
        block: math,
        scheme: Scheme::Fp8Block,
        global: 1.0,
        rows,
        cols,
        wt,
    };
    let len = |k| op.out_span(k, 0..rows).end as usize;
    let (mut codes, mut scales) = (vec![0u8; len(0)], vec![0u8; len(1)]);
    op.compute_all(0..rows, &[weight], &mut [&mut codes, &mut scales])?;
    Ok((codes, scales))
}

/// Rows of the selftest weights' row kind `kind` only (so that whole 128×128 blocks are zero,
/// ties, tiny or huge), `rows` × `cols`.
fn weight_of_kind(wt: WeightType, kind: u64, rows: u64, cols: u64, rng: &mut Rng) -> Vec<u8> {
    let all = quantize_weight(wt, 8 * rows, cols, rng);
    let row = cols as usize * wt.bytes();
    all.chunks_exact(row)
        .skip(kind as usize)
        .step_by(8)
        .flatten()
        .copied()
        .collect()
}

/// The FP8 block kernel (both block arithmetics, every weight dtype) against the reference, on
/// blocks ragged in either direction, whole-block-row chunks starting mid-tensor, blocks of one
/// row kind each (zero, ties, subnormal scales, huge), and refused non-finite weights.
#[test]
fn fp8_block_quantizer_matches_the_cpu_block_arithmetic() {
    let mut rng = Rng(0xb10c);
    let mut n = 0;
    for math in [BlockMath::CompressedTensors, BlockMath::Transformers] {
        for wt in [WeightType::BF16, WeightType::F16, WeightType::F32] {
            let mut weights: Vec<(u64, u64, Vec<u8>, String)> = Vec::new();
            for (rows, cols) in [(300u64, 300u64), (128, 128), (130, 129), (5, 7), (256, 384)] {
                let w = quantize_weight(wt, rows, cols, &mut rng);
                weights.push((rows, cols, w, format!("{rows}×{cols}")));
            }
            for kind in 0..8 {
                let w = weight_of_kind(wt, kind, 200, 260, &mut rng);
                weights.push((200, 260, w, format!("row kind {kind}, 200×260")));
            }
            let mut bad = weights[0].2.clone();
            let nan = selftest::f32_bytes_as(wt.dtype(), &f32::NAN.to_le_bytes());
            let at = (140 * 300 + 299) * wt.bytes();
            bad[at..at + wt.bytes()].copy_from_slice(&nan);
            weights.push((300, 300, bad, "NaN at [140, 299]".into()));
            for (rows, cols, weight, shape) in &weights {
                let row_bytes = *cols as usize * wt.bytes();
                let mut starts = vec![0u64];
                if *rows > FP8_BLOCK {
                    starts.push(FP8_BLOCK);
                }
                for start in starts {
                    let what = format!("FP8_BLOCK {math:?} {wt:?} {shape} from row {start}");
                    let chunk = &weight[start as usize * row_bytes..];
                    let n_rows = rows - start;
                    let p = QuantParams::new(Scheme::Fp8Block, n_rows, *cols, wt, 1.0, math);
                    let scale_bytes = (n_rows.div_ceil(FP8_BLOCK) * cols.div_ceil(FP8_BLOCK))
                        as usize
                        * math.scale_bytes(wt);
                    let got = host_quantize(&p, chunk, (n_rows * cols) as usize, scale_bytes);
                    match (got, reference_fp8_blocks(math, wt, chunk, *cols)) {
                        (Some((gc, gs)), Ok((wc, ws))) => {
                            hex_diff(&format!("{what} codes"), &gc, &wc, 1);
                            hex_diff(&format!("{what} scales"), &gs, &ws, math.scale_bytes(wt));
                        }
                        (None, Err(_)) => {}
                        (g, w) => panic!("{what}: kernel ok={}, reference {:?}", g.is_some(), w),
                    }
                    n += 1;
                }
            }
        }
    }
    assert!(n > 2 * 3 * 14);
}

/// kernels/tftf.ptx records a hash of the sources it was built from (scripts/gen-ptx.py).
#[test]
fn committed_ptx_is_built_from_the_current_sources() {
    use sha2::{Digest, Sha256};
    let mut names: Vec<String> = std::fs::read_dir("kernels")
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.ends_with(".cu") || n.ends_with(".cuh"))
        .collect();
    names.sort();
    let mut h = Sha256::new();
    h.update(PTX_OPTIONS.as_bytes());
    h.update([0]);
    for n in &names {
        h.update(n.as_bytes());
        h.update([0]);
        h.update(std::fs::read(Path::new("kernels").join(n)).unwrap());
        h.update([0]);
    }
    let want: String = h.finalize().iter().map(|b| format!("{b:02x}")).collect();
    let ptx = std::fs::read_to_string("kernels/tftf.ptx").unwrap();
    let first = ptx.lines().next().unwrap();
    assert_eq!(
        first,
        format!("// tftf-kernels-sha256: {want}"),
        "kernels/tftf.ptx is stale: run python3 scripts/gen-ptx.py and commit the result"
    );
    for entry in [
        "tftf_cast",
        "tftf_dequant_fp8",
        "tftf_dequant_int",
        "tftf_dequant_gptq",
        "tftf_dequant_int4_modelopt",
        "tftf_dequant_fp4",
        "tftf_nv_block_scales",
        "tftf_nv_reencode",
        "tftf_engram_blocks",
        "tftf_engram_rows",
        "tftf_lora_delta",
        "tftf_dora_factors",
        "tftf_lora",
        "tftf_quantize_groups",
        "tftf_quantize_fp8_amax",
        "tftf_quantize_fp8_scales",
        "tftf_quantize_fp8_codes",
        "tftf_gguf",
    ] {
        assert!(
            ptx.contains(&format!(".entry {entry}(")),
            "PTX lacks {entry}"
        );
    }
    assert!(
        ptx.contains(".version 8.2"),
        "PTX ISA must stay at 8.2 for R535 drivers"
    );
    assert!(
        !ptx.contains("fma.rn.f32") && !ptx.contains("fma.rn.f64"),
        "contracted multiply-adds would break bit-exactness"
    );
}

/// Units `0..units` cut into chunks of each size of `sizes` in turn (every cut of one size,
/// then of the next), as the reader cuts them.
fn chunkings(units: u64, sizes: [u64; 3]) -> Vec<Range<u64>> {
    let mut out = Vec::new();
    for per in sizes {
        let mut u = 0;
        while u < units {
            out.push(u..(u + per).min(units));
            u += per;
        }
    }
    out
}

fn host_gguf(l: &GgufLaunch, inputs: &[&[u8]], out_len: usize) -> Vec<u8> {
    let joined = inputs.concat();
    let mut out = vec![0u8; out_len];
    let f = host_fn!(
        "tftf_host_gguf",
        fn(*const u8, *const u32, *const f32, *const u8, *mut u8, u64, *const GgufParams) -> ()
    );
    let map = if l.map.is_empty() {
        std::ptr::null()
    } else {
        l.map.as_ptr()
    };
    let weights = if l.weights.is_empty() {
        std::ptr::null()
    } else {
        l.weights.as_ptr()
    };
    let tables = l.tables.as_deref().map_or(std::ptr::null(), <[u8]>::as_ptr);
    let (input, output) = (joined.as_ptr(), out.as_mut_ptr());
    unsafe { f(input, map, weights, tables, output, l.items, &l.params) };
    out
}

/// gguf-py's own Q8_0 quantiser (tests/fixtures/gguf/q8_0_*: random blocks at three scales and
/// the edge blocks: ties, scales that underflow, overflow or are subnormal in f16) gives the
/// bytes the kernel gives.
#[test]
fn gguf_q8_0_kernel_equals_gguf_py() {
    let input = std::fs::read("tests/fixtures/gguf/q8_0_input.f32").unwrap();
    let want = std::fs::read("tests/fixtures/gguf/q8_0_output.bin").unwrap();
    let l = GgufLaunch {
        params: GgufParams {
            src: kernel_dtype(DType::F32),
            ty: GgmlType::Q8_0.id() as i32,
            ..GgufParams::default()
        },
        map: Vec::new(),
        weights: Vec::new(),
        tables: None,
        blocks: false,
        items: input.len() as u64 / 4 / 32,
    };
    hex_diff("q8_0", &host_gguf(&l, &[&input], want.len()), &want, 34);
}

/// The selftest's GGUF cases (every recipe the kernel takes, to every type it writes, from every
/// float source with random bits: NaNs, infinities, subnormals), each chunked every way: the
/// kernel's bytes are the CPU op's.
#[test]
fn gguf_kernel_matches_the_cpu_op_bit_for_bit() {
    let mut checked = 0;
    for case in selftest::cases().into_iter().filter(|c| c.kernel == "gguf") {
        let op = &*case.op;
        let units = op.units();
        for chunk in chunkings(units, [1, 3, units]) {
            let Some(Kernel::Gguf(l)) = op.kernel(&chunk) else {
                panic!("{}: no kernel for {chunk:?}", case.what);
            };
            let pieces = selftest::slices(op, chunk.clone(), &case.inputs);
            let want = cpu_compute(op, chunk.clone(), &pieces).unwrap();
            let got = host_gguf(&l, &pieces, want.len());
            // Bytes per item: a block's for the block types, else compared bytewise.
            let elem = match l.params.ty {
                0 | 1 | 30 => 1,
                _ => want.len() / l.items as usize,
            };
            hex_diff(&format!("{} {chunk:?}", case.what), &got, &want, elem);
            checked += 1;
        }
    }
    assert!(checked > 100, "{checked} chunks compared");
}

/// The selftest's elementwise merge cases (linear and task arithmetic over inputs of every float
/// dtype with random bits, rounded to each compute dtype, into each output dtype), each chunked
/// three ways: the kernel's bytes are the CPU op's, NaNs included.
#[test]
fn merge_kernel_matches_the_cpu_op_bit_for_bit() {
    let f = host_fn!(
        "tftf_host_merge",
        fn(*const u8, *const f64, *mut u8, u64, *const MergeParams) -> ()
    );
    let mut checked = 0;
    for case in selftest::cases()
        .into_iter()
        .filter(|c| c.kernel == "merge")
    {
        let op = &*case.op;
        let units = op.units();
        for chunk in chunkings(units, [1, 333, units]) {
            let Some(Kernel::Merge(l)) = op.kernel(&chunk) else {
                panic!("{}: no kernel for {chunk:?}", case.what);
            };
            let MergeLaunch { params: mut p, .. } = *l;
            let pieces = selftest::slices(op, chunk.clone(), &case.inputs);
            let want = cpu_compute(op, chunk.clone(), &pieces).unwrap();
            // Joined as the GPU backend joins them: each input at an 8-byte boundary.
            let mut joined = Vec::new();
            for (k, piece) in pieces.iter().enumerate() {
                joined.resize(joined.len().next_multiple_of(8), 0);
                p.offsets[k] = joined.len() as u64;
                joined.extend_from_slice(piece);
            }
            let mut got = vec![0u8; want.len()];
            let n = chunk.end - chunk.start;
            unsafe { f(joined.as_ptr(), std::ptr::null(), got.as_mut_ptr(), n, &p) };
            let elem = want.len() / n as usize;
            hex_diff(&format!("{} {chunk:?}", case.what), &got, &want, elem);
            checked += 1;
        }
    }
    assert!(checked >= 48 * 3, "{checked} chunks compared");
}
