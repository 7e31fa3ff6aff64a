//! Element types, reduction operators, and reductions over little-endian byte buffers.

use std::fmt;
use std::str::FromStr;

use fabric::{Error, Result};

/// The element types collectives reduce.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DataType {
    /// `u8`.
    U8,
    /// `i32`.
    I32,
    /// `u32`.
    U32,
    /// `i64`.
    I64,
    /// `u64`.
    U64,
    /// `f32`.
    F32,
    /// `f64`.
    F64,
}

impl DataType {
    /// Every type.
    pub const ALL: [DataType; 7] = [
        DataType::U8,
        DataType::I32,
        DataType::U32,
        DataType::I64,
        DataType::U64,
        DataType::F32,
        DataType::F64,
    ];

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DataType::U8 => 1,
            DataType::I32 | DataType::U32 | DataType::F32 => 4,
            DataType::I64 | DataType::U64 | DataType::F64 => 8,
        }
    }

    /// The name nccl-tests prints (`uint8`, `int32`, `float`...).
    pub fn name(self) -> &'static str {
        match self {
            DataType::U8 => "uint8",
            DataType::I32 => "int32",
            DataType::U32 => "uint32",
            DataType::I64 => "int64",
            DataType::U64 => "uint64",
            DataType::F32 => "float",
            DataType::F64 => "double",
        }
    }
}

impl fmt::Display for DataType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for DataType {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s {
            "u8" | "uint8" => DataType::U8,
            "i32" | "int32" => DataType::I32,
            "u32" | "uint32" => DataType::U32,
            "i64" | "int64" => DataType::I64,
            "u64" | "uint64" => DataType::U64,
            "f32" | "float" => DataType::F32,
            "f64" | "double" => DataType::F64,
            _ => {
                return Err(Error::invalid(format!(
                    "unknown type {s:?} (u8, i32, u32, i64, u64, f32, f64)"
                )))
            }
        })
    }
}

/// Reduction operators.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceOp {
    /// Sum (wrapping for integers).
    Sum,
    /// Minimum.
    Min,
    /// Maximum.
    Max,
}

impl ReduceOp {
    /// The name nccl-tests prints.
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Min => "min",
            ReduceOp::Max => "max",
        }
    }
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for ReduceOp {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s {
            "sum" => ReduceOp::Sum,
            "min" => ReduceOp::Min,
            "max" => ReduceOp::Max,
            _ => return Err(Error::invalid(format!("unknown op {s:?} (sum, min, max)"))),
        })
    }
}

/// A Rust type collectives carry: one of [`DataType`].
pub trait Element: Copy + Send + 'static {
    /// Its [`DataType`].
    const DTYPE: DataType;
    /// Appends its little-endian bytes.
    fn put(self, out: &mut Vec<u8>);
    /// Reads it from little-endian bytes (exactly `DTYPE.size()` of them).
    fn get(b: &[u8]) -> Self;
    /// Writes its little-endian bytes into `b` (exactly `DTYPE.size()` of them).
    fn store(self, b: &mut [u8]);
}

macro_rules! element {
    ($t:ty, $d:ident) => {
        impl Element for $t {
            const DTYPE: DataType = DataType::$d;
            fn put(self, out: &mut Vec<u8>) {
                out.extend_from_slice(&self.to_le_bytes());
            }
            #[inline(always)]
            fn get(b: &[u8]) -> Self {
                <$t>::from_le_bytes(b.try_into().expect("element size"))
            }
            #[inline(always)]
            fn store(self, b: &mut [u8]) {
                b.copy_from_slice(&self.to_le_bytes());
            }
        }
    };
}
element!(u8, U8);
element!(i32, I32);
element!(u32, U32);
element!(i64, I64);
element!(u64, U64);
element!(f32, F32);
element!(f64, F64);

/// Elements to bytes.
pub fn to_bytes<T: Element>(v: &[T]) -> Vec<u8> {
    let mut out = Vec::with_capacity(v.len() * T::DTYPE.size());
    for &x in v {
        x.put(&mut out);
    }
    out
}

/// Bytes back into elements.
pub fn from_bytes<T: Element>(b: &[u8], out: &mut [T]) {
    for (x, c) in out.iter_mut().zip(b.chunks_exact(T::DTYPE.size())) {
        *x = T::get(c);
    }
}

/// `acc[i] = f(acc[i], other[i])` (or `f(other[i], acc[i])`) over little-endian `T`s; a
/// generic closure so the loop is inlined and vectorizes.
#[inline(always)]
fn zip_with<T: Element, F: Fn(T, T) -> T>(acc: &mut [u8], other: &[u8], other_first: bool, f: F) {
    let n = T::DTYPE.size();
    for (a, b) in acc.chunks_exact_mut(n).zip(other.chunks_exact(n)) {
        let (x, y) = (T::get(a), T::get(b));
        let r = if other_first { f(y, x) } else { f(x, y) };
        r.store(a);
    }
}

macro_rules! reduce_as {
    ($t:ty, $acc:expr, $other:expr, $op:expr, $of:expr, $sum:expr) => {
        match $op {
            ReduceOp::Sum => zip_with::<$t, _>($acc, $other, $of, $sum),
            ReduceOp::Min => zip_with::<$t, _>($acc, $other, $of, |a: $t, b: $t| a.min(b)),
            ReduceOp::Max => zip_with::<$t, _>($acc, $other, $of, |a: $t, b: $t| a.max(b)),
        }
    };
}

/// `acc = acc op other` element-wise (`other op acc` when `other_first`: the operand order
/// is part of the result for floating point, and collectives fix it).
pub fn reduce(dtype: DataType, op: ReduceOp, acc: &mut [u8], other: &[u8], other_first: bool) {
    debug_assert_eq!(acc.len(), other.len());
    match dtype {
        DataType::U8 => reduce_as!(u8, acc, other, op, other_first, |a: u8, b: u8| a
            .wrapping_add(b)),
        DataType::I32 => reduce_as!(i32, acc, other, op, other_first, |a: i32, b: i32| a
            .wrapping_add(b)),
        DataType::U32 => reduce_as!(u32, acc, other, op, other_first, |a: u32, b: u32| a
            .wrapping_add(b)),
        DataType::I64 => reduce_as!(i64, acc, other, op, other_first, |a: i64, b: i64| a
            .wrapping_add(b)),
        DataType::U64 => reduce_as!(u64, acc, other, op, other_first, |a: u64, b: u64| a
            .wrapping_add(b)),
        DataType::F32 => reduce_as!(f32, acc, other, op, other_first, |a: f32, b: f32| a + b),
        DataType::F64 => reduce_as!(f64, acc, other, op, other_first, |a: f64, b: f64| a + b),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reductions_per_type() {
        let mut a = to_bytes(&[1i32, -5, 7]);
        reduce(
            DataType::I32,
            ReduceOp::Sum,
            &mut a,
            &to_bytes(&[2i32, 5, -8]),
            false,
        );
        let mut out = [0i32; 3];
        from_bytes(&a, &mut out);
        assert_eq!(out, [3, 0, -1]);
        let mut a = to_bytes(&[250u8, 3]);
        reduce(
            DataType::U8,
            ReduceOp::Sum,
            &mut a,
            &to_bytes(&[10u8, 4]),
            false,
        );
        assert_eq!(a, [4, 7], "u8 sums wrap");
        let mut a = to_bytes(&[1.5f64, -2.0]);
        reduce(
            DataType::F64,
            ReduceOp::Min,
            &mut a,
            &to_bytes(&[0.5f64, 3.0]),
            true,
        );
        let mut f = [0f64; 2];
        from_bytes(&a, &mut f);
        assert_eq!(f, [0.5, -2.0]);
        let mut a = to_bytes(&[u64::MAX, 0]);
        reduce(
            DataType::U64,
            ReduceOp::Max,
            &mut a,
            &to_bytes(&[1u64, 9]),
            false,
        );
        assert_eq!(a, to_bytes(&[u64::MAX, 9]));
    }

    #[test]
    fn float_sum_follows_the_given_order() {
        // (1e20 + -1e20) + 1 differs from 1e20 + (-1e20 + 1): the order is the caller's.
        let mut a = to_bytes(&[1e20f64]);
        reduce(
            DataType::F64,
            ReduceOp::Sum,
            &mut a,
            &to_bytes(&[-1e20f64]),
            false,
        );
        reduce(
            DataType::F64,
            ReduceOp::Sum,
            &mut a,
            &to_bytes(&[1f64]),
            false,
        );
        let mut b = to_bytes(&[1f64]);
        reduce(
            DataType::F64,
            ReduceOp::Sum,
            &mut b,
            &to_bytes(&[-1e20f64]),
            true,
        );
        reduce(
            DataType::F64,
            ReduceOp::Sum,
            &mut b,
            &to_bytes(&[1e20f64]),
            true,
        );
        assert_ne!(a, b);
    }

    #[test]
    fn names_parse() {
        for d in DataType::ALL {
            assert_eq!(d.name().parse::<DataType>().unwrap(), d);
        }
        assert!("f16".parse::<DataType>().is_err());
        assert_eq!("max".parse::<ReduceOp>().unwrap(), ReduceOp::Max);
        assert!("prod".parse::<ReduceOp>().is_err());
    }
}
