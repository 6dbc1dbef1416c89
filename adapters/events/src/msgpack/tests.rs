use super::*;

#[track_caller]
fn check_int(bytes: &[u8], want: Result<i128>) {
    assert_eq!(Reader::new(bytes).int(), want);
}

#[test]
fn ints_of_every_width() {
    check_int(&[0x05], Ok(5));
    check_int(&[0xff], Ok(-1));
    check_int(&[0xcc, 0xff], Ok(255));
    check_int(&[0xcd, 0x01, 0x00], Ok(256));
    check_int(&[0xce, 0xff, 0xff, 0xff, 0xff], Ok(u32::MAX.into()));
    check_int(&[0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff], Ok(u64::MAX.into()));
    check_int(&[0xd0, 0x80], Ok(-128));
    check_int(&[0xd1, 0x80, 0x00], Ok(i16::MIN.into()));
    check_int(&[0xd2, 0x80, 0, 0, 0], Ok(i32::MIN.into()));
    check_int(&[0xd3, 0x80, 0, 0, 0, 0, 0, 0, 0], Ok(i64::MIN.into()));
    check_int(&[0xcd, 0x01], Err(MsgpackError::Truncated));
    check_int(&[0xc0], Err(MsgpackError::UnexpectedType { expected: "int", marker: 0xc0 }));
    check_int(&[], Err(MsgpackError::Truncated));
}

#[track_caller]
fn check_skip(bytes: &[u8], want: Result<usize>) {
    let mut r = Reader::new(bytes);
    assert_eq!(r.skip().map(|()| r.position()), want);
}

#[test]
fn skip_checks_claims_against_input() {
    check_skip(&[0x92, 0x01, 0xa1, b'x', 0x00], Ok(4));
    check_skip(&[0x81, 0xa1, b'k', 0x91, 0xc0], Ok(5));
    check_skip(&[0xd4, 0x01, 0x02], Ok(3));
    check_skip(&[0xc7, 0x02, 0x05, 0xaa, 0xbb], Ok(5));
    check_skip(
        &[0xdd, 0xff, 0xff, 0xff, 0xff],
        Err(MsgpackError::LengthExceedsInput { claimed: u64::from(u32::MAX), remaining: 0 }),
    );
    check_skip(
        &[0xdf, 0x7f, 0xff, 0xff, 0xff],
        Err(MsgpackError::LengthExceedsInput { claimed: 2 * 0x7fff_ffff, remaining: 0 }),
    );
    check_skip(
        &[0xc6, 0xff, 0xff, 0xff, 0xff, 0x00],
        Err(MsgpackError::LengthExceedsInput { claimed: u64::from(u32::MAX), remaining: 1 }),
    );
    check_skip(&[0xc1], Err(MsgpackError::ReservedMarker));
    check_skip(&[0x93, 0x01], Err(MsgpackError::LengthExceedsInput { claimed: 3, remaining: 1 }));
}

#[test]
fn deep_nesting_is_skipped_without_recursion() {
    let mut deep = vec![0x91u8; 1_000_000];
    deep.push(0xc0);
    check_skip(&deep, Ok(deep.len()));
    check_skip(&deep[..deep.len() - 1], Err(MsgpackError::LengthExceedsInput { claimed: 1, remaining: 0 }));
}

#[test]
fn headers_refuse_impossible_lengths() {
    assert_eq!(
        Reader::new(&[0xdc, 0x00, 0x03, 0x01]).array_len(),
        Err(MsgpackError::LengthExceedsInput { claimed: 3, remaining: 1 })
    );
    assert_eq!(
        Reader::new(&[0x82, 0x01, 0x02, 0x03]).map_len(),
        Err(MsgpackError::LengthExceedsInput { claimed: 2, remaining: 3 })
    );
    assert_eq!(Reader::new(&[0x92, 0x01, 0x02]).array_len(), Ok(2));
}

#[test]
fn strings_floats_and_bins() {
    assert_eq!(Reader::new(&[0xa3, b'G', b'P', b'U']).str(), Ok("GPU"));
    assert_eq!(Reader::new(&[0xa2, 0xff, 0xfe]).str(), Err(MsgpackError::InvalidUtf8));
    assert_eq!(Reader::new(&[0xc4, 0x02, 1, 2]).str_or_bin(), Ok(&[1u8, 2][..]));
    assert_eq!(
        Reader::new(&[0xc4, 0x02, 1, 2]).str(),
        Err(MsgpackError::UnexpectedType { expected: "str", marker: 0xc4 })
    );
    assert_eq!(Reader::new(&[0xca, 0x3f, 0xc0, 0, 0]).float(), Ok(1.5));
    assert_eq!(Reader::new(&[0x07]).float(), Ok(7.0));
}

#[track_caller]
fn check_u32s(bytes: &[u8], n: usize, want: Result<(bool, Vec<u32>)>) {
    let mut out = Vec::new();
    let got = Reader::new(bytes).u32_array(n, &mut out).map(|ok| (ok, out));
    assert_eq!(got, want);
}

#[test]
fn token_arrays_take_every_unsigned_form() {
    let all =
        [0x7f, 0xcc, 0xff, 0xcd, 0x12, 0x34, 0xce, 0xff, 0xff, 0xff, 0xff, 0xcf, 0, 0, 0, 0, 0, 0, 0, 9, 0xd0, 0x05];
    check_u32s(&all, 6, Ok((true, vec![127, 255, 0x1234, u32::MAX, 9, 5])));
    check_u32s(&[0xff], 1, Ok((false, vec![])));
    check_u32s(&[0xcf, 0, 0, 0, 1, 0, 0, 0, 0], 1, Ok((false, vec![])));
    check_u32s(&[0xcd, 0x01], 1, Err(MsgpackError::Truncated));
    check_u32s(&[0xc0], 1, Err(MsgpackError::UnexpectedType { expected: "int", marker: 0xc0 }));
}
