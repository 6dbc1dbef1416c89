//! A bounded, zero-copy MessagePack reader over a byte slice.
//!
//! It reads only what the event decoder needs (nil, bool, ints, floats, str, bin,
//! array and map headers) and can skip any value. Every length a payload claims is
//! checked against the bytes actually left before it is believed, so a 5-byte input
//! claiming 2^32 elements fails at once instead of allocating; skipping is iterative
//! (a count of items still owed), so nesting depth cannot overflow the stack. Work is
//! linear in the input length. What the values mean is left to [`crate::decode`].

use core::fmt;

/// Why a MessagePack value could not be read.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub enum MsgpackError {
    /// The input ended inside a value.
    Truncated,
    /// An array, map, str or bin claims more elements or bytes than remain.
    LengthExceedsInput {
        /// Elements (arrays, maps) or bytes (str, bin) claimed.
        claimed: u64,
        /// Bytes left in the input.
        remaining: u64,
    },
    /// A value of another type stood where `expected` was needed.
    UnexpectedType {
        /// What the decoder wanted, for example "int" or "array".
        expected: &'static str,
        /// The marker byte found.
        marker: u8,
    },
    /// The marker byte 0xc1 is never valid.
    ReservedMarker,
    /// A str value is not valid UTF-8.
    InvalidUtf8,
}

impl fmt::Display for MsgpackError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MsgpackError::Truncated => f.write_str("msgpack input ends inside a value"),
            MsgpackError::LengthExceedsInput { claimed, remaining } => {
                write!(f, "msgpack length {claimed} exceeds the {remaining} bytes left")
            }
            MsgpackError::UnexpectedType { expected, marker } => {
                write!(f, "expected msgpack {expected}, found marker 0x{marker:02x}")
            }
            MsgpackError::ReservedMarker => f.write_str("reserved msgpack marker 0xc1"),
            MsgpackError::InvalidUtf8 => f.write_str("msgpack str is not UTF-8"),
        }
    }
}

impl std::error::Error for MsgpackError {}

/// Result alias for this module.
pub type Result<T> = core::result::Result<T, MsgpackError>;

/// A cursor over one MessagePack document.
#[derive(Clone, Debug)]
pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

/// How a value is framed, for skipping.
enum Shape {
    /// A scalar followed by this many payload bytes.
    Bytes(u64),
    /// A container holding this many further values.
    Items(u64),
}

impl<'a> Reader<'a> {
    /// A reader at the start of `buf`.
    pub fn new(buf: &'a [u8]) -> Self {
        Reader { buf, pos: 0 }
    }

    /// Bytes consumed so far.
    pub fn position(&self) -> usize {
        self.pos
    }

    /// Bytes not yet consumed.
    pub fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    /// Moves the cursor back to `pos` (a value from [`Reader::position`]).
    pub fn rewind(&mut self, pos: usize) {
        self.pos = pos.min(self.buf.len());
    }

    /// The next marker byte, not consumed.
    pub fn peek(&self) -> Result<u8> {
        self.buf.get(self.pos).copied().ok_or(MsgpackError::Truncated)
    }

    /// Consumes a nil if one is next; reports whether it did.
    pub fn eat_nil(&mut self) -> Result<bool> {
        if self.peek()? == 0xc0 {
            self.pos += 1;
            return Ok(true);
        }
        Ok(false)
    }

    fn byte(&mut self) -> Result<u8> {
        let b = self.peek()?;
        self.pos += 1;
        Ok(b)
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return Err(MsgpackError::Truncated);
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn be<const N: usize>(&mut self) -> Result<[u8; N]> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    fn be_len(&mut self, width: usize) -> Result<u64> {
        Ok(match width {
            1 => u64::from(self.byte()?),
            2 => u64::from(u16::from_be_bytes(self.be()?)),
            _ => u64::from(u32::from_be_bytes(self.be()?)),
        })
    }

    /// Checks that `claimed` units of `unit_bytes` each can still fit.
    fn fits(&self, claimed: u64, unit_bytes: u64) -> Result<usize> {
        let remaining = self.remaining() as u64;
        if claimed.saturating_mul(unit_bytes) > remaining {
            return Err(MsgpackError::LengthExceedsInput { claimed, remaining });
        }
        // Bounded by the input length, which is a usize.
        Ok(claimed as usize)
    }

    /// Reads an array header; the length is at most the bytes left.
    pub fn array_len(&mut self) -> Result<usize> {
        let m = self.peek()?;
        let n = match m {
            0x90..=0x9f => {
                self.pos += 1;
                u64::from(m & 0x0f)
            }
            0xdc => {
                self.pos += 1;
                self.be_len(2)?
            }
            0xdd => {
                self.pos += 1;
                self.be_len(4)?
            }
            _ => return Err(MsgpackError::UnexpectedType { expected: "array", marker: m }),
        };
        self.fits(n, 1)
    }

    /// Reads a map header; the pair count is at most half the bytes left.
    pub fn map_len(&mut self) -> Result<usize> {
        let m = self.peek()?;
        let n = match m {
            0x80..=0x8f => {
                self.pos += 1;
                u64::from(m & 0x0f)
            }
            0xde => {
                self.pos += 1;
                self.be_len(2)?
            }
            0xdf => {
                self.pos += 1;
                self.be_len(4)?
            }
            _ => return Err(MsgpackError::UnexpectedType { expected: "map", marker: m }),
        };
        self.fits(n, 2)
    }

    /// Reads any integer, signed or unsigned, widened to i128.
    #[inline]
    pub fn int(&mut self) -> Result<i128> {
        let m = self.peek()?;
        let v = match m {
            0x00..=0x7f => {
                self.pos += 1;
                return Ok(i128::from(m));
            }
            0xe0..=0xff => {
                self.pos += 1;
                return Ok(i128::from(m as i8));
            }
            0xcc => {
                self.pos += 1;
                i128::from(self.byte()?)
            }
            0xcd => {
                self.pos += 1;
                i128::from(u16::from_be_bytes(self.be()?))
            }
            0xce => {
                self.pos += 1;
                i128::from(u32::from_be_bytes(self.be()?))
            }
            0xcf => {
                self.pos += 1;
                i128::from(u64::from_be_bytes(self.be()?))
            }
            0xd0 => {
                self.pos += 1;
                i128::from(self.byte()? as i8)
            }
            0xd1 => {
                self.pos += 1;
                i128::from(i16::from_be_bytes(self.be()?))
            }
            0xd2 => {
                self.pos += 1;
                i128::from(i32::from_be_bytes(self.be()?))
            }
            0xd3 => {
                self.pos += 1;
                i128::from(i64::from_be_bytes(self.be()?))
            }
            _ => return Err(MsgpackError::UnexpectedType { expected: "int", marker: m }),
        };
        Ok(v)
    }

    /// Reads an array of `n` unsigned ints that fit u32 (token ids) onto `out`.
    ///
    /// The hot loop of decoding: positive fixint, uint8/16/32 are read inline; any
    /// other int form goes through [`Reader::int`]. Returns `Ok(false)` (having
    /// consumed the offending value) for a negative or too large value.
    pub fn u32_array(&mut self, n: usize, out: &mut Vec<u32>) -> Result<bool> {
        out.reserve(n);
        for _ in 0..n {
            let buf = &self.buf[self.pos..];
            let (v, used) = match buf {
                [m @ 0x00..=0x7f, ..] => (u32::from(*m), 1),
                [0xcc, b, ..] => (u32::from(*b), 2),
                [0xcd, a, b, ..] => (u32::from(u16::from_be_bytes([*a, *b])), 3),
                [0xce, a, b, c, d, ..] => (u32::from_be_bytes([*a, *b, *c, *d]), 5),
                _ => match u32::try_from(self.int()?) {
                    Ok(v) => (v, 0),
                    Err(_) => return Ok(false),
                },
            };
            self.pos += used;
            out.push(v);
        }
        Ok(true)
    }

    /// Reads a float (32 or 64 bit) or an integer, as f64.
    pub fn float(&mut self) -> Result<f64> {
        let m = self.peek()?;
        match m {
            0xca => {
                self.pos += 1;
                Ok(f64::from(f32::from_be_bytes(self.be()?)))
            }
            0xcb => {
                self.pos += 1;
                Ok(f64::from_be_bytes(self.be()?))
            }
            _ => match self.int() {
                Ok(i) => Ok(i as f64),
                Err(_) => Err(MsgpackError::UnexpectedType { expected: "float", marker: m }),
            },
        }
    }

    /// Reads a str or a bin as raw bytes, borrowed from the input.
    pub fn str_or_bin(&mut self) -> Result<&'a [u8]> {
        let m = self.peek()?;
        let n = match m {
            0xa0..=0xbf => {
                self.pos += 1;
                u64::from(m & 0x1f)
            }
            0xd9 | 0xc4 => {
                self.pos += 1;
                self.be_len(1)?
            }
            0xda | 0xc5 => {
                self.pos += 1;
                self.be_len(2)?
            }
            0xdb | 0xc6 => {
                self.pos += 1;
                self.be_len(4)?
            }
            _ => return Err(MsgpackError::UnexpectedType { expected: "str", marker: m }),
        };
        let n = self.fits(n, 1)?;
        self.take(n)
    }

    /// True when the next value is a bin.
    pub fn is_bin(&self) -> Result<bool> {
        Ok(matches!(self.peek()?, 0xc4..=0xc6))
    }

    /// Reads a UTF-8 str.
    pub fn str(&mut self) -> Result<&'a str> {
        let m = self.peek()?;
        if matches!(m, 0xc4..=0xc6) {
            return Err(MsgpackError::UnexpectedType { expected: "str", marker: m });
        }
        let raw = self.str_or_bin()?;
        core::str::from_utf8(raw).map_err(|_| MsgpackError::InvalidUtf8)
    }

    /// Skips one complete value of any type, however nested.
    pub fn skip(&mut self) -> Result<()> {
        // Items still owed; each costs at least one byte, so this stays below the
        // input length and the loop below is linear in it.
        let mut owed: u64 = 1;
        while owed > 0 {
            owed -= 1;
            match self.shape()? {
                Shape::Bytes(n) => {
                    let n = self.fits(n, 1)?;
                    self.pos += n;
                }
                Shape::Items(n) => {
                    owed += n;
                    let remaining = self.remaining() as u64;
                    if owed > remaining {
                        return Err(MsgpackError::LengthExceedsInput { claimed: owed, remaining });
                    }
                }
            }
        }
        Ok(())
    }

    /// Consumes one marker (and its length field) and says what follows it.
    fn shape(&mut self) -> Result<Shape> {
        let m = self.byte()?;
        Ok(match m {
            0x00..=0x7f | 0xe0..=0xff | 0xc0 | 0xc2 | 0xc3 => Shape::Bytes(0),
            0x80..=0x8f => Shape::Items(2 * u64::from(m & 0x0f)),
            0x90..=0x9f => Shape::Items(u64::from(m & 0x0f)),
            0xa0..=0xbf => Shape::Bytes(u64::from(m & 0x1f)),
            0xc1 => return Err(MsgpackError::ReservedMarker),
            0xc4 | 0xd9 => Shape::Bytes(self.be_len(1)?),
            0xc5 | 0xda => Shape::Bytes(self.be_len(2)?),
            0xc6 | 0xdb => Shape::Bytes(self.be_len(4)?),
            // ext 8/16/32: length, then a type byte, then the data.
            0xc7 => Shape::Bytes(self.be_len(1)? + 1),
            0xc8 => Shape::Bytes(self.be_len(2)? + 1),
            0xc9 => Shape::Bytes(self.be_len(4)? + 1),
            0xca => Shape::Bytes(4),
            0xcb => Shape::Bytes(8),
            0xcc | 0xd0 => Shape::Bytes(1),
            0xcd | 0xd1 => Shape::Bytes(2),
            0xce | 0xd2 => Shape::Bytes(4),
            0xcf | 0xd3 => Shape::Bytes(8),
            // fixext 1/2/4/8/16: a type byte, then the data.
            0xd4 => Shape::Bytes(2),
            0xd5 => Shape::Bytes(3),
            0xd6 => Shape::Bytes(5),
            0xd7 => Shape::Bytes(9),
            0xd8 => Shape::Bytes(17),
            0xdc => Shape::Items(self.be_len(2)?),
            0xdd => Shape::Items(self.be_len(4)?),
            0xde => Shape::Items(2 * self.be_len(2)?),
            0xdf => Shape::Items(2 * self.be_len(4)?),
        })
    }
}

#[cfg(test)]
mod tests;
