use super::*;

#[track_caller]
fn check(x: f64, want: f64) {
    let got = exp(x);
    let rel = if want == 0.0 { got } else { (got - want) / want };
    assert!(rel.abs() < 1e-14, "exp({x}) = {got}, want {want}");
}

#[test]
fn exp_matches_std() {
    for &x in &[0.0, -1e-9, -0.5, -1.0, -2.5, -10.0, -100.0, -700.0, 1.0, 3.3, 50.0] {
        check(x, std::primitive::f64::exp(x));
    }
    assert_eq!(exp(-1000.0), 0.0);
    assert!(exp(f64::NAN).is_nan());
}

#[test]
fn floor_and_ceil() {
    for &(x, f, c) in &[(1.5, 1.0, 2.0), (-1.5, -2.0, -1.0), (3.0, 3.0, 3.0), (-0.0, 0.0, 0.0)] {
        assert_eq!(floor(x), f, "floor({x})");
        assert_eq!(ceil(x), c, "ceil({x})");
    }
}
