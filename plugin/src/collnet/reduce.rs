//! Element-wise reductions for CollNet: every `ncclDataType_t` NCCL sends
//! (int8 … uint64, fp16, bf16, fp32, fp64, and fp8 e4m3/e5m2 since 2.24) ×
//! sum, prod, max, min.
//!
//! Semantics, the same on every rank (each element is reduced once, by its
//! owner, in rank order, and then distributed, so results are bit-identical
//! everywhere and from run to run):
//! - integers wrap on overflow (two's complement, as GPUs compute);
//! - fp32 and fp64 use IEEE arithmetic; `max`/`min` return the other operand
//!   when one is NaN (C's `fmax`/`fmin`);
//! - fp16, bf16 and fp8 compute each pairwise step in f32 and round to the
//!   type, to nearest even; fp8 saturates to its largest finite value (as
//!   NCCL's `__NV_SATFINITE` conversions do), NaN stays NaN.
//!
//! Buffers are byte slices of whole elements in native byte order: NCCL's
//! buffers need not be aligned for the type, so elements are read and
//! written by value.

#![forbid(unsafe_code)]

use half::{bf16, f16};

/// `ncclDataType_t`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DataType {
    /// `ncclInt8`.
    I8,
    /// `ncclUint8`.
    U8,
    /// `ncclInt32`.
    I32,
    /// `ncclUint32`.
    U32,
    /// `ncclInt64`.
    I64,
    /// `ncclUint64`.
    U64,
    /// `ncclFloat16`.
    F16,
    /// `ncclFloat32`.
    F32,
    /// `ncclFloat64`.
    F64,
    /// `ncclBfloat16`.
    Bf16,
    /// `ncclFloat8e4m3` (NCCL >= 2.24).
    F8E4M3,
    /// `ncclFloat8e5m2` (NCCL >= 2.24).
    F8E5M2,
}

impl DataType {
    /// Every type, in `ncclDataType_t` order.
    pub const ALL: [DataType; 12] = [
        DataType::I8,
        DataType::U8,
        DataType::I32,
        DataType::U32,
        DataType::I64,
        DataType::U64,
        DataType::F16,
        DataType::F32,
        DataType::F64,
        DataType::Bf16,
        DataType::F8E4M3,
        DataType::F8E5M2,
    ];

    /// From NCCL's value; `None` for a type this build does not know.
    pub fn from_nccl(v: i32) -> Option<Self> {
        usize::try_from(v)
            .ok()
            .and_then(|i| Self::ALL.get(i).copied())
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DataType::I8 | DataType::U8 | DataType::F8E4M3 | DataType::F8E5M2 => 1,
            DataType::F16 | DataType::Bf16 => 2,
            DataType::I32 | DataType::U32 | DataType::F32 => 4,
            DataType::I64 | DataType::U64 | DataType::F64 => 8,
        }
    }
}

/// `ncclRedOp_t` as NCCL sends it to CollNet (avg and the pre/post-scaled
/// sums reach the network as sum).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RedOp {
    /// `ncclSum`.
    Sum,
    /// `ncclProd`.
    Prod,
    /// `ncclMax`.
    Max,
    /// `ncclMin`.
    Min,
}

impl RedOp {
    /// Every op, in `ncclRedOp_t` order.
    pub const ALL: [RedOp; 4] = [RedOp::Sum, RedOp::Prod, RedOp::Max, RedOp::Min];

    /// From NCCL's value; `None` for an op this build does not implement.
    pub fn from_nccl(v: i32) -> Option<Self> {
        usize::try_from(v)
            .ok()
            .and_then(|i| Self::ALL.get(i).copied())
    }
}

/// `acc[i] = acc[i] op src[i]` for every element. Both slices hold the same
/// whole number of elements of `ty`.
pub fn reduce(ty: DataType, op: RedOp, acc: &mut [u8], src: &[u8]) {
    assert_eq!(acc.len(), src.len(), "reduce: operands of different sizes");
    assert_eq!(acc.len() % ty.size(), 0, "reduce: not whole elements");
    macro_rules! ints {
        ($t:ty) => {
            apply::<$t, { std::mem::size_of::<$t>() }>(acc, src, |a, b| match op {
                RedOp::Sum => a.wrapping_add(b),
                RedOp::Prod => a.wrapping_mul(b),
                RedOp::Max => a.max(b),
                RedOp::Min => a.min(b),
            })
        };
    }
    macro_rules! floats {
        ($t:ty) => {
            apply::<$t, { std::mem::size_of::<$t>() }>(acc, src, |a, b| match op {
                RedOp::Sum => a + b,
                RedOp::Prod => a * b,
                RedOp::Max => a.max(b),
                RedOp::Min => a.min(b),
            })
        };
    }
    match ty {
        DataType::I8 => ints!(i8),
        DataType::U8 => ints!(u8),
        DataType::I32 => ints!(i32),
        DataType::U32 => ints!(u32),
        DataType::I64 => ints!(i64),
        DataType::U64 => ints!(u64),
        DataType::F32 => floats!(f32),
        DataType::F64 => floats!(f64),
        DataType::F16 => apply::<f16, 2>(acc, src, |a, b| {
            f16::from_f32(f32_op(op, a.to_f32(), b.to_f32()))
        }),
        DataType::Bf16 => apply::<bf16, 2>(acc, src, |a, b| {
            bf16::from_f32(f32_op(op, a.to_f32(), b.to_f32()))
        }),
        DataType::F8E4M3 => {
            for (a, b) in acc.iter_mut().zip(src) {
                *a = E4M3.encode(f32_op(op, E4M3.decode(*a), E4M3.decode(*b)));
            }
        }
        DataType::F8E5M2 => {
            for (a, b) in acc.iter_mut().zip(src) {
                *a = E5M2.encode(f32_op(op, E5M2.decode(*a), E5M2.decode(*b)));
            }
        }
    }
}

fn f32_op(op: RedOp, a: f32, b: f32) -> f32 {
    match op {
        RedOp::Sum => a + b,
        RedOp::Prod => a * b,
        RedOp::Max => a.max(b),
        RedOp::Min => a.min(b),
    }
}

/// A type read and written by value from native-order bytes.
trait Elem: Copy {
    fn read(b: &[u8]) -> Self;
    fn write(self, b: &mut [u8]);
}

macro_rules! elem {
    ($($t:ty),*) => {$(
        impl Elem for $t {
            fn read(b: &[u8]) -> Self {
                <$t>::from_ne_bytes(b.try_into().expect("one element"))
            }
            fn write(self, b: &mut [u8]) {
                b.copy_from_slice(&self.to_ne_bytes());
            }
        }
    )*};
}
elem!(i8, u8, i32, u32, i64, u64, f32, f64, f16, bf16);

fn apply<T: Elem, const N: usize>(acc: &mut [u8], src: &[u8], f: impl Fn(T, T) -> T) {
    for (a, b) in acc.chunks_exact_mut(N).zip(src.chunks_exact(N)) {
        f(T::read(a), T::read(b)).write(a);
    }
}

/// An 8-bit float format: exponent and mantissa bits, bias, and whether the
/// all-ones exponent is reserved for inf/NaN (e5m2) or only the all-ones
/// code is NaN (e4m3, "fn": no infinities).
#[derive(Debug, Clone, Copy)]
pub struct Fp8 {
    man: u32,
    bias: i32,
    ieee: bool,
}

/// `ncclFloat8e4m3` (OCP E4M3FN: max 448, no infinities).
pub const E4M3: Fp8 = Fp8 {
    man: 3,
    bias: 7,
    ieee: false,
};
/// `ncclFloat8e5m2` (OCP E5M2: max 57344, IEEE-style inf and NaN).
pub const E5M2: Fp8 = Fp8 {
    man: 2,
    bias: 15,
    ieee: true,
};

impl Fp8 {
    fn exp_max_field(self) -> u32 {
        (1 << (7 - self.man)) - 1
    }

    /// The largest finite code (positive).
    fn max_code(self) -> u8 {
        if self.ieee {
            // Exponent one below all-ones, mantissa all ones.
            (((self.exp_max_field() - 1) << self.man) | ((1 << self.man) - 1)) as u8
        } else {
            // All ones but the last mantissa bit (all ones is NaN).
            0x7e
        }
    }

    fn nan_code(self) -> u8 {
        0x7f
    }

    /// The value of `code`.
    pub fn decode(self, code: u8) -> f32 {
        let sign = if code & 0x80 != 0 { -1.0f32 } else { 1.0 };
        let e = u32::from(code & 0x7f) >> self.man;
        let m = u32::from(code) & ((1 << self.man) - 1);
        if self.ieee && e == self.exp_max_field() {
            return if m == 0 {
                sign * f32::INFINITY
            } else {
                f32::NAN
            };
        }
        if !self.ieee && code & 0x7f == 0x7f {
            return f32::NAN;
        }
        let frac = m as f32 / (1u32 << self.man) as f32;
        if e == 0 {
            sign * frac * 2f32.powi(1 - self.bias)
        } else {
            sign * (1.0 + frac) * 2f32.powi(e as i32 - self.bias)
        }
    }

    /// `x` rounded to nearest even, saturating to the largest finite value.
    pub fn encode(self, x: f32) -> u8 {
        if x.is_nan() {
            return self.nan_code();
        }
        let sign = if x.is_sign_negative() { 0x80u8 } else { 0 };
        let max = self.decode(self.max_code());
        let a = f64::from(x.abs());
        if a >= f64::from(max) {
            return sign | self.max_code();
        }
        let emin = 1 - self.bias;
        let e = (a.log2().floor() as i32).max(emin);
        let step = 2f64.powi(e - self.man as i32);
        let q = (a / step).round_ties_even() as u32;
        let code = if e == emin && q < (1 << self.man) {
            // Subnormal (or zero); a carry into the implicit bit is the
            // smallest normal, which this encoding gives too.
            q
        } else {
            let (e, q) = if q == 2 << self.man {
                (e + 1, q / 2)
            } else {
                (e, q)
            };
            (((e + self.bias) as u32) << self.man) | (q - (1 << self.man))
        };
        sign | (code.min(u32::from(self.max_code())) as u8)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fp8_round_trips_every_code() {
        for f in [E4M3, E5M2] {
            for c in 0..=255u8 {
                let v = f.decode(c);
                if v.is_nan() || v.is_infinite() {
                    continue;
                }
                let back = f.encode(v);
                // +0 and -0 both decode to a zero of their sign.
                assert_eq!(back, c, "{f:?}: code {c:#04x} = {v} encodes as {back:#04x}");
            }
        }
    }

    #[test]
    fn fp8_known_values_and_saturation() {
        assert_eq!(E4M3.decode(0x7e), 448.0);
        assert_eq!(E5M2.decode(0x7b), 57344.0);
        assert_eq!(E4M3.encode(1000.0), 0x7e);
        assert_eq!(E4M3.encode(-1000.0), 0xfe);
        assert_eq!(E5M2.encode(f32::INFINITY), 0x7b);
        assert_eq!(E4M3.decode(0x01), 2f32.powi(-9));
        assert_eq!(E5M2.decode(0x01), 2f32.powi(-16));
        assert_eq!(E4M3.encode(1.0), 0x38);
        assert_eq!(E5M2.encode(1.0), 0x3c);
        // Ties go to even: 1.0625 is halfway between 1.0 and 1.125 in e4m3.
        assert_eq!(E4M3.encode(1.0625), 0x38);
        assert_eq!(E4M3.encode(1.1875), 0x3a);
        assert!(E4M3.decode(E4M3.encode(f32::NAN)).is_nan());
    }

    #[test]
    fn integers_wrap_and_compare() {
        let mut a = [250u8, 3, 7];
        reduce(DataType::U8, RedOp::Sum, &mut a, &[10, 4, 0]);
        assert_eq!(a, [4, 7, 7]);
        let mut a: Vec<u8> = [-5i32, 9].iter().flat_map(|v| v.to_ne_bytes()).collect();
        let b: Vec<u8> = [3i32, -20].iter().flat_map(|v| v.to_ne_bytes()).collect();
        reduce(DataType::I32, RedOp::Min, &mut a, &b);
        let got: Vec<i32> = a
            .chunks(4)
            .map(|c| i32::from_ne_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(got, [-5, -20]);
    }

    #[test]
    fn halves_compute_in_f32_and_round() {
        let x = f16::from_f32(1.0);
        let y = f16::from_f32(0.000_488_28); // half an ulp of 1.0: ties to even
        let mut a = x.to_ne_bytes().to_vec();
        reduce(DataType::F16, RedOp::Sum, &mut a, &y.to_ne_bytes());
        assert_eq!(
            f16::from_ne_bytes([a[0], a[1]]),
            f16::from_f32(1.0 + 0.000_488_28)
        );
        let mut a = bf16::from_f32(3.0).to_ne_bytes().to_vec();
        reduce(
            DataType::Bf16,
            RedOp::Prod,
            &mut a,
            &bf16::from_f32(-2.0).to_ne_bytes(),
        );
        assert_eq!(bf16::from_ne_bytes([a[0], a[1]]).to_f32(), -6.0);
    }

    #[test]
    fn float_max_ignores_nan() {
        let mut a: Vec<u8> = f32::NAN.to_ne_bytes().to_vec();
        reduce(DataType::F32, RedOp::Max, &mut a, &2.5f32.to_ne_bytes());
        assert_eq!(f32::from_ne_bytes(a.try_into().unwrap()), 2.5);
    }

    #[test]
    fn nccl_values_map_and_unknown_ones_do_not() {
        assert_eq!(DataType::from_nccl(9), Some(DataType::Bf16));
        assert_eq!(DataType::from_nccl(11), Some(DataType::F8E5M2));
        assert_eq!(DataType::from_nccl(12), None);
        assert_eq!(DataType::from_nccl(-1), None);
        assert_eq!(RedOp::from_nccl(3), Some(RedOp::Min));
        assert_eq!(RedOp::from_nccl(4), None, "avg reaches the network as sum");
    }
}
