//! The bytes under every message: [`Enc`] appends little-endian fields, [`Dec`] reads them back with every length
//! checked against the bytes present, and [`Codec`] is the pair of functions each message body implements beside
//! its type (`messages.rs`, `hidden.rs`).

use super::WireError;
use crate::engine::snapshot::RowDtype;

/// Longest label ([`Dec::label`]) a peer may send.
pub const MAX_LABEL: usize = 64;

pub(super) fn malformed<T>(msg: impl Into<String>) -> Result<T, WireError> {
    Err(WireError::Malformed(msg.into()))
}

/// How one message body (or a field type shared by several) is laid out on the wire.
pub(super) trait Codec: Sized {
    /// Appends the fields, in docs/protocol.md's order.
    fn put(&self, e: &mut Enc);
    /// Reads the fields back; a count or length that runs past the payload is an error, never an allocation.
    fn get(d: &mut Dec) -> Result<Self, WireError>;
}

pub(super) struct Enc(pub Vec<u8>);

impl Enc {
    pub fn raw(&mut self, b: &[u8]) {
        self.0.extend_from_slice(b);
    }
    pub fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    pub fn u16(&mut self, v: u16) {
        self.raw(&v.to_le_bytes());
    }
    pub fn u32(&mut self, v: u32) {
        self.raw(&v.to_le_bytes());
    }
    pub fn u64(&mut self, v: u64) {
        self.raw(&v.to_le_bytes());
    }
    pub fn f32(&mut self, v: f32) {
        self.raw(&v.to_le_bytes());
    }
    /// A label as [`Dec::label`] takes it: control characters become `?`, cut to [`MAX_LABEL`] bytes on a char
    /// boundary.
    pub fn label(&mut self, s: &str) {
        let mut clean: String = s.chars().map(|c| if c.is_control() { '?' } else { c }).collect();
        let mut end = clean.len().min(MAX_LABEL);
        while !clean.is_char_boundary(end) {
            end -= 1;
        }
        clean.truncate(end);
        self.str(&clean);
    }
    /// u16 length + UTF-8 bytes (truncated at 65 535 bytes on a char boundary).
    pub fn str(&mut self, s: &str) {
        let mut end = s.len().min(u16::MAX as usize);
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        self.u16(end as u16);
        self.raw(&s.as_bytes()[..end]);
    }
    /// u32 count + token ids.
    pub fn tokens(&mut self, t: &[u32]) {
        self.u32(t.len() as u32);
        t.iter().for_each(|&v| self.u32(v));
    }
}

pub(super) struct Dec<'a> {
    pub b: &'a [u8],
    pub pos: usize,
}

impl<'a> Dec<'a> {
    pub fn left(&self) -> usize {
        self.b.len() - self.pos
    }
    pub fn take(&mut self, n: usize) -> Result<&'a [u8], WireError> {
        if n > self.left() {
            return malformed(format!(
                "field of {n} bytes at offset {} runs past the payload end",
                self.pos
            ));
        }
        let s = &self.b[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }
    pub fn arr<const N: usize>(&mut self) -> Result<[u8; N], WireError> {
        Ok(self.take(N)?.try_into().unwrap())
    }
    pub fn u8(&mut self) -> Result<u8, WireError> {
        Ok(self.take(1)?[0])
    }
    pub fn u16(&mut self) -> Result<u16, WireError> {
        Ok(u16::from_le_bytes(self.arr()?))
    }
    pub fn u32(&mut self) -> Result<u32, WireError> {
        Ok(u32::from_le_bytes(self.arr()?))
    }
    pub fn u64(&mut self) -> Result<u64, WireError> {
        Ok(u64::from_le_bytes(self.arr()?))
    }
    pub fn f32(&mut self) -> Result<f32, WireError> {
        Ok(f32::from_le_bytes(self.arr()?))
    }
    /// A u32 element count whose elements of `size` bytes must fit in what is left.
    pub fn count(&mut self, size: usize) -> Result<usize, WireError> {
        let n = self.u32()? as usize;
        if n.saturating_mul(size) > self.left() {
            return malformed(format!("count {n} runs past the payload end"));
        }
        Ok(n)
    }
    pub fn str(&mut self) -> Result<String, WireError> {
        let n = self.u16()? as usize;
        let b = self.take(n)?;
        match std::str::from_utf8(b) {
            Ok(s) => Ok(s.to_string()),
            Err(_) => malformed("string is not UTF-8"),
        }
    }
    /// A short label a node reports about itself (protocol 5: its backend and ISA in READY): at most
    /// [`MAX_LABEL`] bytes of UTF-8 without control characters, so it can go into a log line or a table as is.
    pub fn label(&mut self) -> Result<String, WireError> {
        let n = self.u16()? as usize;
        if n > MAX_LABEL {
            return malformed(format!("label of {n} bytes exceeds {MAX_LABEL}"));
        }
        match std::str::from_utf8(self.take(n)?) {
            Ok(s) if !s.chars().any(char::is_control) => Ok(s.to_string()),
            Ok(_) => malformed("label holds control characters"),
            Err(_) => malformed("label is not UTF-8"),
        }
    }
    /// A request id (protocol 4): empty (none) or [`crate::util::valid_request_id`], at most
    /// [`crate::util::MAX_REQUEST_ID`] bytes, so what a peer sends can go into a log line as is.
    pub fn request_id(&mut self) -> Result<String, WireError> {
        let n = self.u16()? as usize;
        if n > crate::util::MAX_REQUEST_ID {
            return malformed(format!(
                "request id of {n} bytes exceeds {}",
                crate::util::MAX_REQUEST_ID
            ));
        }
        let b = self.take(n)?;
        match std::str::from_utf8(b) {
            Ok(s) if s.is_empty() || crate::util::valid_request_id(s) => Ok(s.to_string()),
            _ => malformed("request id holds characters other than letters, digits and -_.:"),
        }
    }
    /// What [`Enc::tokens`] wrote.
    pub fn tokens(&mut self) -> Result<Vec<u32>, WireError> {
        let n = self.count(4)?;
        (0..n).map(|_| self.u32()).collect()
    }
    /// A 0/1 flag; anything else is malformed (`what` names it).
    pub fn flag(&mut self, what: &str) -> Result<bool, WireError> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            v => malformed(format!("{what} flag {v} is neither 0 nor 1")),
        }
    }
}

/// The wire's one-byte code for a row type (hidden states and KV chunks; docs/protocol.md).
impl Codec for RowDtype {
    fn put(&self, e: &mut Enc) {
        e.u8(match self {
            RowDtype::F32 => 0,
            RowDtype::F16 => 1,
            RowDtype::BF16 => 2,
            RowDtype::Q8 => 3,
        })
    }

    fn get(d: &mut Dec) -> Result<Self, WireError> {
        Ok(match d.u8()? {
            0 => RowDtype::F32,
            1 => RowDtype::F16,
            2 => RowDtype::BF16,
            3 => RowDtype::Q8,
            c => return malformed(format!("unknown hidden-state type {c}")),
        })
    }
}
