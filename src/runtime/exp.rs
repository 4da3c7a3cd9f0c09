//! `exp` in plain f32 arithmetic that a compiler can vectorise, for the CPU backend's passes.
//!
//! `f32::exp` is a call into the C library, one value at a time: QuickGELU's and the softmax's
//! passes spend most of their time in it (BENCHMARKS.md). [`exp`] has no calls and no branches
//! (its limits are selects), so a loop over a slice becomes SIMD code; the loops that use it are
//! compiled for several instruction sets and pick one at run time (`multiversion`). Each step is
//! one IEEE f32 operation with no contraction into fused multiply-adds, so every instruction set
//! gives the same bits.

/// `2²³ · 1.5`: adding it to a float of magnitude below `2²²` rounds it to an integer (to
/// nearest, ties to even) held in the low bits of the sum.
const ROUND: f32 = 12_582_912.0;

/// `ln 2` in two parts (Cody and Waite): the high part has few enough bits that `n · LN2_HIGH`
/// is exact for every `n` in range.
const LN2_HIGH: f32 = 0.693_359_4;
const LN2_LOW: f32 = -2.121_944_4e-4;

/// The largest f32 whose `exp` is finite (just below `ln(f32::MAX)`).
const LARGEST: f32 = 88.722_83;

/// The smallest f32 whose `exp` is a normal f32 (just above `ln(f32::MIN_POSITIVE)`).
const SMALLEST: f32 = -87.336_54;

/// `eˣ` within 1 ulp for `x` in `[SMALLEST, LARGEST]`; `∞` above, `0` below (results that
/// would be subnormal flush to zero), NaN for NaN.
///
/// `x = n·ln 2 + r` with `n` the nearest integer to `x / ln 2` and `|r| ≤ ln 2 / 2`; `eʳ` from
/// Cephes' `expf` polynomial, then scaled by `2ⁿ` through the exponent bits, in two halves so
/// that each factor is a normal f32 over the whole range (`n` runs from −126 to 128).
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    let shifted = x * std::f32::consts::LOG2_E + ROUND;
    let n = shifted - ROUND;
    let r = x - n * LN2_HIGH - n * LN2_LOW;
    let mut p = 1.987_569_2e-4;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let e_r = p * (r * r) + r + 1.0;
    // `n` as an integer: the low bits of `shifted` past ROUND's.
    let n = shifted.to_bits().wrapping_sub(ROUND.to_bits()) as i32;
    let half = n >> 1;
    let power_of_two = |e: i32| f32::from_bits((e.wrapping_add(127) as u32) << 23);
    let y = e_r * power_of_two(half) * power_of_two(n.wrapping_sub(half));
    if x > LARGEST {
        f32::INFINITY
    } else if x < SMALLEST {
        0.0
    } else {
        y
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Against float64 on a dense sweep of the whole finite range and past both ends.
    #[test]
    fn matches_float64() {
        let steps = 1 << 21;
        let (low, high) = (-90.0f64, 90.0f64);
        let mut worst = 0.0f64;
        for i in 0..=steps {
            let x = (low + (high - low) * f64::from(i) / f64::from(steps)) as f32;
            let expected = f64::from(x).exp();
            let got = f64::from(exp(x));
            if expected > f64::from(f32::MAX) {
                assert_eq!(got, f64::INFINITY, "exp({x})");
            } else if expected < f64::from(f32::MIN_POSITIVE) {
                assert_eq!(got, 0.0, "exp({x}) flushes to zero");
            } else {
                worst = worst.max((got - expected).abs() / expected);
            }
        }
        // Tolerance: the polynomial's own error, the reduction's and the final product's
        // roundings: measured 0.68 ε; 1 ε bounds it (half an ulp is the best f32 can do).
        assert!(
            worst <= f64::from(f32::EPSILON),
            "worst relative error {worst:e}"
        );
    }

    /// The exact points and the special values.
    #[test]
    fn special_values() {
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(-0.0), 1.0);
        assert_eq!(exp(f32::INFINITY), f32::INFINITY);
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(100.0), f32::INFINITY);
        assert_eq!(exp(-100.0), 0.0);
        assert!(exp(f32::NAN).is_nan());
        // The ends of the range stay finite and normal.
        assert!(exp(LARGEST).is_finite());
        assert!(exp(SMALLEST) >= f32::MIN_POSITIVE);
    }
}
