//! The dispatch table's types: the kernels of one instruction set for every weight type, and the scalar table
//! every SIMD table is tested against. `x86.rs` and `neon.rs` fill tables; `mod.rs` picks one per CPU.

use super::{blocks32, float, iquants, kquants};
use crate::gguf::GgmlType;

/// `n` blocks of a weight row dotted with `n` blocks of quantized activations.
pub type DotFn = fn(n: usize, w: &[u8], x: &[u8]) -> f32;
/// `out[t] = dot(w, x[t * x_stride..])` for `t < out.len()` (at most [`MULTI`]): one weight row against several
/// activation rows, each weight block unpacked once.
pub type MultiDotFn = fn(n: usize, w: &[u8], x: &[u8], x_stride: usize, out: &mut [f32]);
pub type QuantFn = fn(x: &[f32], out: &mut [u8]);

/// Most activation rows a [`MultiDotFn`] takes.
pub const MULTI: usize = 4;

/// The kernels for one weight type.
#[derive(Clone, Copy)]
pub struct QKernel {
    /// The type activations are quantized to.
    pub vec_dot_type: GgmlType,
    pub dot: DotFn,
    pub multi: Option<MultiDotFn>,
}

/// The dispatch table: one per instruction set, chosen once.
/// An F16 row's bytes dotted with f32 activations.
pub type DotF16 = fn(&[u8], &[f32]) -> f32;

pub struct Kernels {
    pub isa: &'static str,
    pub quant_q8_0: QuantFn,
    pub quant_q8_1: QuantFn,
    pub quant_q8_k: QuantFn,
    pub q4_0: QKernel,
    pub q4_1: QKernel,
    pub q5_0: QKernel,
    pub q5_1: QKernel,
    pub q8_0: QKernel,
    pub q2_k: QKernel,
    pub q3_k: QKernel,
    pub q4_k: QKernel,
    pub q5_k: QKernel,
    pub q6_k: QKernel,
    pub iq4_nl: QKernel,
    pub iq4_xs: QKernel,
    pub iq2_xxs: QKernel,
    pub iq2_xs: QKernel,
    pub iq2_s: QKernel,
    pub iq3_xxs: QKernel,
    pub iq3_s: QKernel,
    pub iq1_s: QKernel,
    pub dot_f32: fn(&[f32], &[f32]) -> f32,
    /// `dot_f32` of an F16 row (its bytes) converted in registers, with the same bits; `None` where the table has
    /// none, and the row is converted to f32 first.
    pub dot_f16: Option<DotF16>,
}

impl Kernels {
    pub fn for_type(&self, ty: GgmlType) -> Option<QKernel> {
        use GgmlType::*;
        Some(match ty {
            Q4_0 => self.q4_0,
            Q4_1 => self.q4_1,
            Q5_0 => self.q5_0,
            Q5_1 => self.q5_1,
            Q8_0 => self.q8_0,
            Q2K => self.q2_k,
            Q3K => self.q3_k,
            Q4K => self.q4_k,
            Q5K => self.q5_k,
            Q6K => self.q6_k,
            IQ4NL => self.iq4_nl,
            IQ4XS => self.iq4_xs,
            IQ2XXS => self.iq2_xxs,
            IQ2XS => self.iq2_xs,
            IQ2S => self.iq2_s,
            IQ3XXS => self.iq3_xxs,
            IQ3S => self.iq3_s,
            IQ1S => self.iq1_s,
            F32 | F16 | BF16 | Q8_1 | Q8K => return None,
        })
    }

    pub(crate) fn quant(&self, ty: GgmlType) -> QuantFn {
        match ty {
            GgmlType::Q8_0 => self.quant_q8_0,
            GgmlType::Q8_1 => self.quant_q8_1,
            _ => self.quant_q8_k,
        }
    }

    /// The portable reference every SIMD table is tested against.
    pub fn scalar() -> Kernels {
        let k = |vec_dot_type, dot| QKernel {
            vec_dot_type,
            dot,
            multi: None,
        };
        use GgmlType::*;
        Kernels {
            isa: "scalar",
            quant_q8_0: blocks32::quantize_row_q8_0,
            quant_q8_1: blocks32::quantize_row_q8_1,
            quant_q8_k: kquants::quantize_row_q8_k,
            q4_0: k(Q8_0, blocks32::dot_q4_0_q8_0),
            q4_1: k(Q8_1, blocks32::dot_q4_1_q8_1),
            q5_0: k(Q8_0, blocks32::dot_q5_0_q8_0),
            q5_1: k(Q8_1, blocks32::dot_q5_1_q8_1),
            q8_0: k(Q8_0, blocks32::dot_q8_0_q8_0),
            q2_k: k(Q8K, kquants::dot_q2_k_q8_k),
            q3_k: k(Q8K, kquants::dot_q3_k_q8_k),
            q4_k: k(Q8K, kquants::dot_q4_k_q8_k),
            q5_k: k(Q8K, kquants::dot_q5_k_q8_k),
            q6_k: k(Q8K, kquants::dot_q6_k_q8_k),
            iq4_nl: k(Q8_0, iquants::dot_iq4_nl_q8_0),
            iq4_xs: k(Q8K, iquants::dot_iq4_xs_q8_k),
            iq2_xxs: k(Q8K, iquants::dot_iq2_xxs_q8_k),
            iq2_xs: k(Q8K, iquants::dot_iq2_xs_q8_k),
            iq2_s: k(Q8K, iquants::dot_iq2_s_q8_k),
            iq3_xxs: k(Q8K, iquants::dot_iq3_xxs_q8_k),
            iq3_s: k(Q8K, iquants::dot_iq3_s_q8_k),
            iq1_s: k(Q8K, iquants::dot_iq1_s_q8_k),
            dot_f32: float::dot_f32,
            dot_f16: None,
        }
    }
}
