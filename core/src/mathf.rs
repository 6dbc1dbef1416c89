//! The few float functions the core needs, written out because `core` has no libm.
//!
//! They are deterministic on every platform (plain IEEE arithmetic, no intrinsics), which
//! keeps decisions reproducible across machines.

const LN2_HI: f64 = 6.931_471_803_691_238e-1;
const LN2_LO: f64 = 1.908_214_929_270_587_7e-10;
/// 1/k! for k in 0..14.
const INV_FACT: [f64; 14] = {
    let mut t = [1.0; 14];
    let mut k = 1;
    while k < 14 {
        t[k] = t[k - 1] / k as f64;
        k += 1;
    }
    t
};
const INV_LN2: f64 = core::f64::consts::LOG2_E;

/// `e^x`, accurate to a few ulps on the range the core uses (`x <= 0`, sampling weights).
pub(crate) fn exp(x: f64) -> f64 {
    if x.is_nan() {
        return x;
    }
    if x > 709.0 {
        return f64::INFINITY;
    }
    if x < -745.0 {
        return 0.0;
    }
    let k = round(x * INV_LN2);
    let r = (x - k * LN2_HI) - k * LN2_LO;
    // Taylor series of e^r for |r| <= ln2/2 in Horner form; 13 terms reach double
    // precision.
    let mut sum = INV_FACT[13];
    let mut i = 13;
    while i > 0 {
        i -= 1;
        sum = sum * r + INV_FACT[i];
    }
    scale_by_pow2(sum, k as i32)
}

/// Rounds half away from zero, for finite `x` of modest size.
pub(crate) fn round(x: f64) -> f64 {
    if x >= 0.0 {
        (x + 0.5) as i64 as f64
    } else {
        -((-x + 0.5) as i64 as f64)
    }
}

/// Largest integer not above `x`, for finite `x` within `i64`.
pub(crate) fn floor(x: f64) -> f64 {
    let t = x as i64 as f64;
    if t > x {
        t - 1.0
    } else {
        t
    }
}

/// Smallest integer not below `x`, for finite `x` within `i64`.
pub(crate) fn ceil(x: f64) -> f64 {
    -floor(-x)
}

fn scale_by_pow2(v: f64, mut k: i32) -> f64 {
    let mut out = v;
    // Step in chunks so subnormal results stay correct.
    while k > 1000 {
        out *= f64::from_bits(((1023 + 1000) as u64) << 52);
        k -= 1000;
    }
    while k < -1000 {
        out *= f64::from_bits(((1023 - 1000) as u64) << 52);
        k += 1000;
    }
    out * f64::from_bits(((1023 + k) as u64) << 52)
}

#[cfg(test)]
mod tests;
