//! GGUF reader: memory-maps the file, parses the header, metadata and tensor table, and hands out tensors as
//! byte slices of the map. Nothing is copied; a layer range touches only the pages of its own tensors.
//!
//! Every length read from the file is checked against what remains before anything is allocated, so a truncated
//! or hostile file gives an error naming what was wrong, never a panic or an out-of-memory.

use anyhow::{Context, Result, bail};
use memmap2::Mmap;
use std::collections::BTreeMap;
use std::fmt;
use std::fs::File;
use std::path::{Path, PathBuf};

const MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;
/// A tensor never has more dimensions than ggml's GGML_MAX_DIMS.
const MAX_DIMS: u32 = 4;

/// Tensor storage types, numbered as in ggml.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
    Q8K,
    IQ2XXS,
    IQ2XS,
    IQ3XXS,
    IQ1S,
    IQ4NL,
    IQ3S,
    IQ2S,
    IQ4XS,
    BF16,
}

impl GgmlType {
    pub fn from_u32(v: u32) -> Option<Self> {
        Some(match v {
            0 => Self::F32,
            1 => Self::F16,
            2 => Self::Q4_0,
            3 => Self::Q4_1,
            6 => Self::Q5_0,
            7 => Self::Q5_1,
            8 => Self::Q8_0,
            9 => Self::Q8_1,
            10 => Self::Q2K,
            11 => Self::Q3K,
            12 => Self::Q4K,
            13 => Self::Q5K,
            14 => Self::Q6K,
            15 => Self::Q8K,
            16 => Self::IQ2XXS,
            17 => Self::IQ2XS,
            18 => Self::IQ3XXS,
            19 => Self::IQ1S,
            20 => Self::IQ4NL,
            21 => Self::IQ3S,
            22 => Self::IQ2S,
            23 => Self::IQ4XS,
            30 => Self::BF16,
            _ => return None,
        })
    }

    pub fn to_u32(self) -> u32 {
        match self {
            Self::F32 => 0,
            Self::F16 => 1,
            Self::Q4_0 => 2,
            Self::Q4_1 => 3,
            Self::Q5_0 => 6,
            Self::Q5_1 => 7,
            Self::Q8_0 => 8,
            Self::Q8_1 => 9,
            Self::Q2K => 10,
            Self::Q3K => 11,
            Self::Q4K => 12,
            Self::Q5K => 13,
            Self::Q6K => 14,
            Self::Q8K => 15,
            Self::IQ2XXS => 16,
            Self::IQ2XS => 17,
            Self::IQ3XXS => 18,
            Self::IQ1S => 19,
            Self::IQ4NL => 20,
            Self::IQ3S => 21,
            Self::IQ2S => 22,
            Self::IQ4XS => 23,
            Self::BF16 => 30,
        }
    }

    /// Number of weights in one block.
    pub fn block_size(self) -> usize {
        match self {
            Self::F32 | Self::F16 | Self::BF16 => 1,
            Self::Q4_0 | Self::Q4_1 | Self::Q5_0 | Self::Q5_1 | Self::Q8_0 | Self::Q8_1 | Self::IQ4NL => 32,
            Self::Q2K | Self::Q3K | Self::Q4K | Self::Q5K | Self::Q6K | Self::Q8K => 256,
            Self::IQ2XXS | Self::IQ2XS | Self::IQ2S | Self::IQ3XXS | Self::IQ3S | Self::IQ1S | Self::IQ4XS => 256,
        }
    }

    /// Bytes of one block.
    pub fn type_size(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::F16 | Self::BF16 => 2,
            Self::Q4_0 => 18,
            Self::Q4_1 => 20,
            Self::Q5_0 => 22,
            Self::Q5_1 => 24,
            Self::Q8_0 => 34,
            Self::Q8_1 => 36,
            Self::Q2K => 84,
            Self::Q3K => 110,
            Self::Q4K => 144,
            Self::Q5K => 176,
            Self::Q6K => 210,
            Self::Q8K => 292,
            Self::IQ2XXS => 66,
            Self::IQ2XS => 74,
            Self::IQ3XXS => 98,
            Self::IQ1S => 50,
            Self::IQ4NL => 18,
            Self::IQ3S => 110,
            Self::IQ2S => 82,
            Self::IQ4XS => 136,
        }
    }

    /// Bytes of a row of `n` weights; `None` if `n` is not a whole number of blocks, or its bytes overflow.
    pub fn row_bytes(self, n: usize) -> Option<usize> {
        if !n.is_multiple_of(self.block_size()) {
            return None;
        }
        (n / self.block_size()).checked_mul(self.type_size())
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "F32",
            Self::F16 => "F16",
            Self::Q4_0 => "Q4_0",
            Self::Q4_1 => "Q4_1",
            Self::Q5_0 => "Q5_0",
            Self::Q5_1 => "Q5_1",
            Self::Q8_0 => "Q8_0",
            Self::Q8_1 => "Q8_1",
            Self::Q2K => "Q2_K",
            Self::Q3K => "Q3_K",
            Self::Q4K => "Q4_K",
            Self::Q5K => "Q5_K",
            Self::Q6K => "Q6_K",
            Self::Q8K => "Q8_K",
            Self::IQ2XXS => "IQ2_XXS",
            Self::IQ2XS => "IQ2_XS",
            Self::IQ3XXS => "IQ3_XXS",
            Self::IQ1S => "IQ1_S",
            Self::IQ4NL => "IQ4_NL",
            Self::IQ3S => "IQ3_S",
            Self::IQ2S => "IQ2_S",
            Self::IQ4XS => "IQ4_XS",
            Self::BF16 => "BF16",
        }
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A metadata value. Arrays keep their element type so an empty array still says what it would hold.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    /// A long top-level array (token texts, scores, merges), checked but left in the file: see [`LazyArray`].
    Lazy(LazyArray),
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    Str(String),
    Array(Vec<Value>),
    U64(u64),
    I64(i64),
    F64(f64),
}

/// Where a long array's elements lie in the mapped file. Parsed into `Value`s, Gemma 3's three tokenizer arrays of
/// 262,144 items took about 30 MB of heap for as long as the model was loaded, although they are read once, to
/// build the tokenizer; [`GgufFile::str_array`] and [`GgufFile::num_array`] read them when asked.
#[derive(Clone, Debug, PartialEq)]
pub struct LazyArray {
    pub elem_ty: u32,
    pub len: u64,
    start: usize,
    end: usize,
}

/// The largest page-cache folio Linux maps whole on a fault: one PMD, 2 MiB on x86-64 and on AArch64 with 4 KiB pages.
const FOLIO_MAX: usize = 2 << 20;

/// Top-level arrays longer than this stay in the file until asked for.
const LAZY_MIN: u64 = 1024;

impl Value {
    /// Any integer type as u64 (negative values refused).
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v as u64),
            Value::U16(v) => Some(v as u64),
            Value::U32(v) => Some(v as u64),
            Value::U64(v) => Some(v),
            Value::I8(v) if v >= 0 => Some(v as u64),
            Value::I16(v) if v >= 0 => Some(v as u64),
            Value::I32(v) if v >= 0 => Some(v as u64),
            Value::I64(v) if v >= 0 => Some(v as u64),
            _ => None,
        }
    }

    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            Value::I8(v) => Some(v as i64),
            Value::I16(v) => Some(v as i64),
            Value::I32(v) => Some(v as i64),
            Value::I64(v) => Some(v),
            _ => self.as_u64().and_then(|v| i64::try_from(v).ok()),
        }
    }

    pub fn as_f32(&self) -> Option<f32> {
        match *self {
            Value::F32(v) => Some(v),
            Value::F64(v) => Some(v as f32),
            _ => self.as_i64().map(|v| v as f32),
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(v) => Some(v),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }

    /// A short human-readable rendering; long arrays are summarised.
    pub fn summary(&self) -> String {
        match self {
            Value::Str(s) => {
                let one_line = s.replace('\n', "\\n");
                if one_line.chars().count() > 80 {
                    format!("{:?}…", one_line.chars().take(80).collect::<String>())
                } else {
                    format!("{one_line:?}")
                }
            }
            Value::Array(a) if a.len() > 8 => format!("[{} items]", a.len()),
            Value::Lazy(l) => format!("[{} items]", l.len),
            Value::Array(a) => {
                format!("[{}]", a.iter().map(|v| v.summary()).collect::<Vec<_>>().join(", "))
            }
            Value::U8(v) => v.to_string(),
            Value::I8(v) => v.to_string(),
            Value::U16(v) => v.to_string(),
            Value::I16(v) => v.to_string(),
            Value::U32(v) => v.to_string(),
            Value::I32(v) => v.to_string(),
            Value::U64(v) => v.to_string(),
            Value::I64(v) => v.to_string(),
            Value::F32(v) => v.to_string(),
            Value::F64(v) => v.to_string(),
            Value::Bool(v) => v.to_string(),
        }
    }
}

/// Where one tensor lives in the file.
#[derive(Clone, Debug)]
pub struct TensorInfo {
    pub name: String,
    /// ggml order: `dims[0]` is the row length (contiguous), `dims[1]` the number of rows.
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    /// Absolute byte offset in the file.
    pub offset: usize,
    pub size: usize,
}

impl TensorInfo {
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }
    /// Row length (first dimension).
    pub fn ne0(&self) -> usize {
        self.dims[0] as usize
    }
    /// Number of rows: the product of all dimensions past the first.
    pub fn n_rows(&self) -> usize {
        self.dims[1..].iter().product::<u64>() as usize
    }
}

/// A parsed, memory-mapped GGUF file.
pub struct GgufFile {
    pub path: PathBuf,
    pub version: u32,
    pub metadata: BTreeMap<String, Value>,
    pub tensors: BTreeMap<String, TensorInfo>,
    /// Tensor names in file order (for listings).
    pub tensor_order: Vec<String>,
    pub alignment: u64,
    pub data_offset: usize,
    mmap: Mmap,
}

/// Bounds-checked little-endian cursor over the mapped bytes.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.buf.len());
        match end {
            Some(end) => {
                let s = &self.buf[self.pos..end];
                self.pos = end;
                Ok(s)
            }
            None => bail!(
                "truncated GGUF: {what} needs {n} bytes at offset {} but the file has {}",
                self.pos,
                self.buf.len()
            ),
        }
    }
    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }
    fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1, "u8")?[0])
    }
    fn u16(&mut self) -> Result<u16> {
        Ok(u16::from_le_bytes(self.take(2, "u16")?.try_into().unwrap()))
    }
    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.take(4, "u32")?.try_into().unwrap()))
    }
    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.take(8, "u64")?.try_into().unwrap()))
    }
    /// A length-prefixed string's bytes, the length checked against what remains.
    fn string_bytes(&mut self, what: &str) -> Result<&'a [u8]> {
        let len = self.u64()?;
        if len > self.remaining() as u64 {
            bail!(
                "truncated or corrupt GGUF: {what} claims {len} bytes, {} remain",
                self.remaining()
            );
        }
        self.take(len as usize, what)
    }
    fn string(&mut self, what: &str) -> Result<String> {
        let bytes = self.string_bytes(what)?;
        // Token texts may hold invalid UTF-8 in some converters; keep them lossily rather than fail the load.
        Ok(String::from_utf8_lossy(bytes).into_owned())
    }
    /// An array's element type and count, checked: not an array of arrays, and no more elements than bytes remain
    /// (every element takes at least one byte, so a larger count is a lie).
    fn array_header(&mut self) -> Result<(u32, u64)> {
        let elem_ty = self.u32()?;
        if elem_ty == 9 {
            // As in llama.cpp's reader. Parsed, each element of an inner array would also cost a `Value` (32 bytes)
            // per byte of file.
            bail!("corrupt GGUF: an array of arrays (not valid GGUF; llama.cpp refuses it too)");
        }
        let n = self.u64()?;
        if n > self.remaining() as u64 {
            bail!(
                "truncated or corrupt GGUF: array claims {n} elements, {} bytes remain",
                self.remaining()
            );
        }
        Ok((elem_ty, n))
    }

    /// Steps over one value with the checks [`Cursor::value`] makes, keeping nothing.
    fn skip(&mut self, ty: u32) -> Result<()> {
        match ty {
            0 | 1 | 7 => _ = self.take(1, "u8")?,
            2 | 3 => _ = self.take(2, "u16")?,
            4..=6 => _ = self.take(4, "u32")?,
            10..=12 => _ = self.take(8, "u64")?,
            8 => _ = self.string_bytes("string value")?,
            9 => {
                let (elem_ty, n) = self.array_header()?;
                for _ in 0..n {
                    self.skip(elem_ty)?;
                }
            }
            other => bail!("corrupt GGUF: unknown metadata value type {other}"),
        }
        Ok(())
    }

    fn value(&mut self, ty: u32, depth: u32) -> Result<Value> {
        Ok(match ty {
            0 => Value::U8(self.u8()?),
            1 => Value::I8(self.u8()? as i8),
            2 => Value::U16(self.u16()?),
            3 => Value::I16(self.u16()? as i16),
            4 => Value::U32(self.u32()?),
            5 => Value::I32(self.u32()? as i32),
            6 => Value::F32(f32::from_bits(self.u32()?)),
            7 => Value::Bool(self.u8()? != 0),
            8 => Value::Str(self.string("string value")?),
            9 => {
                let (elem_ty, n) = self.array_header()?;
                if depth == 0 && n > LAZY_MIN {
                    let start = self.pos;
                    for _ in 0..n {
                        self.skip(elem_ty)?;
                    }
                    return Ok(Value::Lazy(LazyArray {
                        elem_ty,
                        len: n,
                        start,
                        end: self.pos,
                    }));
                }
                let mut items = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    items.push(self.value(elem_ty, depth + 1)?);
                }
                Value::Array(items)
            }
            10 => Value::U64(self.u64()?),
            11 => Value::I64(self.u64()? as i64),
            12 => Value::F64(f64::from_bits(self.u64()?)),
            other => bail!("corrupt GGUF: unknown metadata value type {other}"),
        })
    }
}

impl GgufFile {
    pub fn open(path: &Path) -> Result<Self> {
        let file = File::open(path).with_context(|| format!("cannot open model {}", path.display()))?;
        // SAFETY: the map is read-only; a model file changed underneath a running process is outside our contract
        // (as with every mmap-based loader).
        let mmap = unsafe { Mmap::map(&file) }.with_context(|| format!("cannot map {}", path.display()))?;
        let g = Self::parse(path, mmap).with_context(|| format!("{} is not a usable GGUF model", path.display()))?;
        // The header and metadata were read into owned values (or are re-read on demand): their pages can go.
        g.release_around(0, g.data_offset);
        Ok(g)
    }

    /// The strings of the array under `key`, read straight from the map for an array left there: no value per
    /// element is built (Gemma 3's 262,144 token texts as [`Value`]s took 10 MB more while the tokenizer was built).
    /// Invalid UTF-8 is kept lossily, as at open. `None` when the key is absent. Borrowed strings keep their file
    /// pages mapped: call [`GgufFile::release_array`] once they are no longer needed.
    pub fn str_array(&self, key: &str) -> Result<Option<Vec<std::borrow::Cow<'_, str>>>> {
        match self.metadata.get(key) {
            None => Ok(None),
            Some(Value::Array(a)) => a
                .iter()
                .enumerate()
                .map(|(i, v)| {
                    v.as_str()
                        .map(std::borrow::Cow::Borrowed)
                        .with_context(|| format!("{key}[{i}] is {}, not a string", v.summary()))
                })
                .collect::<Result<_>>()
                .map(Some),
            Some(Value::Lazy(l)) => {
                if l.elem_ty != 8 {
                    bail!("{key} is an array of metadata type {}, not of strings", l.elem_ty);
                }
                let mut c = self.cursor(l);
                (0..l.len)
                    .map(|_| Ok(String::from_utf8_lossy(c.string_bytes("string value")?)))
                    .collect::<Result<_>>()
                    .map(Some)
            }
            Some(_) => bail!("GGUF key {key} is not an array"),
        }
    }

    /// The numbers of the array under `key`, each converted by `conv` (`None`: not such a number); for an array left
    /// in the file, one element at a time without keeping the [`Value`]s. `None` when the key is absent.
    pub fn num_array<T>(&self, key: &str, conv: impl Fn(&Value) -> Option<T>) -> Result<Option<Vec<T>>> {
        let one = |i: usize, v: &Value| conv(v).with_context(|| format!("{key}[{i}] is {}, not a number", v.summary()));
        match self.metadata.get(key) {
            None => Ok(None),
            Some(Value::Array(a)) => a
                .iter()
                .enumerate()
                .map(|(i, v)| one(i, v))
                .collect::<Result<_>>()
                .map(Some),
            Some(Value::Lazy(l)) => {
                let mut c = self.cursor(l);
                let out = (0..l.len as usize)
                    .map(|i| one(i, &c.value(l.elem_ty, 1)?))
                    .collect::<Result<_>>()
                    .map(Some);
                self.release_around(l.start, l.end);
                out
            }
            Some(_) => bail!("GGUF key {key} is not an array"),
        }
    }

    /// A cursor at the first element of an array left in the file (bounds were checked at open).
    fn cursor(&self, l: &LazyArray) -> Cursor<'_> {
        Cursor {
            buf: &self.mmap[..l.end],
            pos: l.start,
        }
    }

    /// `v` with a lazy array parsed (to copy metadata into another file).
    pub fn owned_value(&self, v: &Value) -> Result<Value> {
        match v {
            Value::Lazy(l) => Ok(Value::Array(self.parse_lazy(l)?)),
            other => Ok(other.clone()),
        }
    }

    fn parse_lazy(&self, l: &LazyArray) -> Result<Vec<Value>> {
        let mut c = self.cursor(l);
        let items = (0..l.len).map(|_| c.value(l.elem_ty, 1)).collect::<Result<Vec<_>>>()?;
        self.release_around(l.start, l.end);
        Ok(items)
    }

    fn parse(path: &Path, mmap: Mmap) -> Result<Self> {
        let buf: &[u8] = &mmap;
        if buf.len() < 4 || &buf[..4] != MAGIC {
            bail!("not a GGUF file (bad magic)");
        }
        let mut c = Cursor { buf, pos: 4 };
        let version = c.u32()?;
        if !(2..=3).contains(&version) {
            bail!("unsupported GGUF version {version} (supported: 2 and 3)");
        }
        let n_tensors = c.u64()?;
        let n_kv = c.u64()?;
        if n_tensors > c.remaining() as u64 || n_kv > c.remaining() as u64 {
            bail!(
                "corrupt GGUF header: {n_tensors} tensors, {n_kv} metadata entries in a {}-byte file",
                buf.len()
            );
        }

        let mut metadata = BTreeMap::new();
        for _ in 0..n_kv {
            let key = c.string("metadata key")?;
            let ty = c.u32()?;
            let v = c.value(ty, 0).with_context(|| format!("metadata entry {key:?}"))?;
            metadata.insert(key, v);
        }
        let alignment = match metadata.get("general.alignment") {
            Some(v) => v
                .as_u64()
                .filter(|a| a.is_power_of_two())
                .context("general.alignment is not a power of two")?,
            None => DEFAULT_ALIGNMENT,
        };

        let mut infos = Vec::with_capacity(n_tensors as usize);
        for _ in 0..n_tensors {
            let name = c.string("tensor name")?;
            let n_dims = c.u32()?;
            if n_dims == 0 || n_dims > MAX_DIMS {
                bail!("tensor {name:?} has {n_dims} dimensions (1 to {MAX_DIMS} allowed)");
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                dims.push(c.u64()?);
            }
            let raw_ty = c.u32()?;
            let ty = GgmlType::from_u32(raw_ty)
                .with_context(|| format!("tensor {name:?} has unsupported tensor type {raw_ty}"))?;
            let rel_offset = c.u64()?;
            infos.push((name, dims, ty, rel_offset));
        }
        let data_offset = (c.pos as u64).div_ceil(alignment) * alignment;

        let mut tensors = BTreeMap::new();
        let mut tensor_order = Vec::with_capacity(infos.len());
        for (name, dims, ty, rel_offset) in infos {
            let n: u64 = dims
                .iter()
                .try_fold(1u64, |a, &d| a.checked_mul(d))
                .context("tensor size overflows")?;
            let ne0 = dims[0] as usize;
            let Some(row) = ty.row_bytes(ne0) else {
                bail!(
                    "tensor {name:?}: row length {ne0} is not a multiple of the {ty} block size {}, or too large",
                    ty.block_size()
                );
            };
            let size = (row as u64)
                .checked_mul(n / dims[0].max(1))
                .context("tensor size overflows")?;
            if rel_offset % alignment != 0 {
                bail!("tensor {name:?} is not aligned to {alignment} bytes");
            }
            let start = data_offset + rel_offset;
            let end = start.checked_add(size).context("tensor offset overflows")?;
            if end > buf.len() as u64 {
                bail!(
                    "truncated GGUF: tensor {name:?} ends at byte {end} but the file has {} bytes",
                    buf.len()
                );
            }
            tensor_order.push(name.clone());
            let info = TensorInfo {
                name: name.clone(),
                dims,
                ty,
                offset: start as usize,
                size: size as usize,
            };
            if tensors.insert(name.clone(), info).is_some() {
                bail!("tensor {name:?} appears twice");
            }
        }

        Ok(GgufFile {
            path: path.to_path_buf(),
            version,
            metadata,
            tensors,
            tensor_order,
            alignment,
            data_offset: data_offset as usize,
            mmap,
        })
    }

    /// Drops the pages the array under `key` was read from, when it was left in the file ([`GgufFile::str_array`]
    /// borrows them), and the page-cache folios around them ([`GgufFile::release_around`]).
    pub fn release_array(&self, key: &str) {
        if let Some(Value::Lazy(l)) = self.metadata.get(key) {
            self.release_around(l.start, l.end);
        }
    }

    /// [`GgufFile::release`] of `start..end` widened to [`FOLIO_MAX`] boundaries. Linux maps a whole large page-cache
    /// folio on a fault, so reading metadata in place may have mapped the tensor data next to it too; a tensor read in
    /// place there faults its pages back in on its next use.
    fn release_around(&self, start: usize, end: usize) {
        let lo = start / FOLIO_MAX * FOLIO_MAX;
        let hi = end.next_multiple_of(FOLIO_MAX).min(self.mmap.len());
        if hi > lo {
            self.release(lo, hi - lo);
        }
    }

    /// Tells the kernel this process no longer needs the mapped pages inside `offset..offset + len` (a tensor that
    /// was copied into another layout), so they stop counting towards its memory. A later read would fault them in
    /// again from the file; nothing is lost.
    pub fn release(&self, offset: usize, len: usize) {
        let page = 4096;
        let start = offset.next_multiple_of(page);
        // Only whole pages inside the range; the map's last page is the file's alone, however much of it is used
        // (madvise rounds the length up to it).
        let end = if offset + len >= self.mmap.len() {
            self.mmap.len()
        } else {
            (offset + len) / page * page
        };
        if end > start {
            // SAFETY: the mapping is read-only and file-backed: dropped pages are re-read from the file on access.
            let _ = unsafe {
                self.mmap
                    .unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, start, end - start)
            };
        }
    }

    /// The whole mapped file.
    pub fn bytes(&self) -> &[u8] {
        &self.mmap
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }

    pub fn get_str(&self, key: &str) -> Option<&str> {
        self.get(key).and_then(Value::as_str)
    }

    pub fn get_u64(&self, key: &str) -> Option<u64> {
        self.get(key).and_then(Value::as_u64)
    }

    pub fn get_f32(&self, key: &str) -> Option<f32> {
        self.get(key).and_then(Value::as_f32)
    }

    pub fn get_bool(&self, key: &str) -> Option<bool> {
        self.get(key).and_then(Value::as_bool)
    }

    pub fn require_u64(&self, key: &str) -> Result<u64> {
        self.get_u64(key)
            .with_context(|| format!("missing or non-integer metadata {key:?}"))
    }

    pub fn architecture(&self) -> Result<&str> {
        self.get_str("general.architecture")
            .context("missing metadata general.architecture")
    }

    pub fn tensor_info(&self, name: &str) -> Result<&TensorInfo> {
        self.tensors
            .get(name)
            .with_context(|| format!("tensor {name:?} not found in {}", self.path.display()))
    }

    /// The bytes of one tensor (bounds were checked at open).
    pub fn tensor_data(&self, info: &TensorInfo) -> &[u8] {
        &self.mmap[info.offset..info.offset + info.size]
    }
}

/// Writes GGUF v3 files: used by `baton quantize`, by tests that build random-weight models, and by tests that
/// corrupt files on purpose.
pub struct GgufWriter {
    pub metadata: Vec<(String, Value)>,
    pub tensors: Vec<(String, Vec<u64>, GgmlType, Vec<u8>)>,
}

impl GgufWriter {
    pub fn new() -> Self {
        GgufWriter {
            metadata: Vec::new(),
            tensors: Vec::new(),
        }
    }

    /// A copy of `file`, metadata and tensors in its order, to edit and write back (tests make malformed and
    /// variant models this way).
    pub fn from_file(file: &GgufFile) -> Result<Self> {
        let mut w = GgufWriter::new();
        for (k, v) in &file.metadata {
            w.meta(k, file.owned_value(v)?);
        }
        for name in &file.tensor_order {
            let t = &file.tensors[name];
            w.tensor(name, t.dims.clone(), t.ty, file.tensor_data(t).to_vec());
        }
        Ok(w)
    }

    /// Adds a metadata entry; a [`Value::Lazy`] must be parsed first ([`GgufFile::owned_value`]).
    pub fn meta(&mut self, key: &str, v: Value) {
        assert!(
            !matches!(v, Value::Lazy(_)),
            "GGUF metadata {key:?}: parse lazy arrays before writing them"
        );
        self.metadata.push((key.to_string(), v));
    }

    pub fn tensor(&mut self, name: &str, dims: Vec<u64>, ty: GgmlType, data: Vec<u8>) {
        self.tensors.push((name.to_string(), dims, ty, data));
    }

    fn write_value(out: &mut Vec<u8>, v: &Value) {
        match v {
            Value::U8(x) => out.push(*x),
            Value::I8(x) => out.push(*x as u8),
            Value::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
            Value::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
            Value::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
            Value::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
            Value::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
            Value::Bool(x) => out.push(*x as u8),
            Value::Str(s) => {
                out.extend_from_slice(&(s.len() as u64).to_le_bytes());
                out.extend_from_slice(s.as_bytes());
            }
            Value::Lazy(_) => unreachable!("GgufWriter::meta refuses lazy arrays"),
            Value::Array(items) => {
                let elem_ty = items.first().map(Self::type_id).unwrap_or(4);
                out.extend_from_slice(&elem_ty.to_le_bytes());
                out.extend_from_slice(&(items.len() as u64).to_le_bytes());
                for it in items {
                    Self::write_value(out, it);
                }
            }
            Value::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
            Value::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
            Value::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
        }
    }

    fn type_id(v: &Value) -> u32 {
        match v {
            Value::U8(_) => 0,
            Value::I8(_) => 1,
            Value::U16(_) => 2,
            Value::I16(_) => 3,
            Value::U32(_) => 4,
            Value::I32(_) => 5,
            Value::F32(_) => 6,
            Value::Bool(_) => 7,
            Value::Str(_) => 8,
            Value::Array(_) | Value::Lazy(_) => 9,
            Value::U64(_) => 10,
            Value::I64(_) => 11,
            Value::F64(_) => 12,
        }
    }

    /// Serialises the whole file into memory.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&3u32.to_le_bytes());
        out.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (k, v) in &self.metadata {
            Self::write_value(&mut out, &Value::Str(k.clone()));
            out.extend_from_slice(&Self::type_id(v).to_le_bytes());
            Self::write_value(&mut out, v);
        }
        let align = DEFAULT_ALIGNMENT as usize;
        let mut offset = 0usize;
        for (name, dims, ty, data) in &self.tensors {
            Self::write_value(&mut out, &Value::Str(name.clone()));
            out.extend_from_slice(&(dims.len() as u32).to_le_bytes());
            for d in dims {
                out.extend_from_slice(&d.to_le_bytes());
            }
            out.extend_from_slice(&ty.to_u32().to_le_bytes());
            out.extend_from_slice(&(offset as u64).to_le_bytes());
            offset = (offset + data.len()).div_ceil(align) * align;
        }
        out.resize(out.len().div_ceil(align) * align, 0);
        for (_, _, _, data) in &self.tensors {
            out.extend_from_slice(data);
            out.resize(out.len().div_ceil(align) * align, 0);
        }
        out
    }

    /// Writes atomically: a temporary file in the same directory, renamed into place.
    pub fn write(&self, path: &Path) -> Result<()> {
        crate::util::write_atomic(path, &self.to_bytes())
    }
}

impl Default for GgufWriter {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Vec<u8> {
        let mut w = GgufWriter::new();
        w.meta("general.architecture", Value::Str("llama".into()));
        w.meta("test.u32", Value::U32(7));
        w.meta("test.f64", Value::F64(1.5));
        w.meta(
            "test.arr",
            Value::Array(vec![Value::Str("a".into()), Value::Str("bc".into())]),
        );
        w.meta("test.bool", Value::Bool(true));
        w.meta("test.i8", Value::I8(-3));
        w.tensor(
            "t0",
            vec![4, 2],
            GgmlType::F32,
            (0..8u32).flat_map(|i| (i as f32).to_le_bytes()).collect(),
        );
        w.tensor("t1", vec![32], GgmlType::Q8_0, vec![1u8; 34]);
        w.to_bytes()
    }

    fn open_bytes(bytes: &[u8]) -> Result<GgufFile> {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("m.gguf");
        std::fs::write(&p, bytes).unwrap();
        GgufFile::open(&p)
    }

    #[test]
    fn round_trip_metadata_and_tensors() {
        let g = open_bytes(&sample()).unwrap();
        assert_eq!(g.version, 3);
        assert_eq!(g.architecture().unwrap(), "llama");
        assert_eq!(g.get_u64("test.u32"), Some(7));
        assert_eq!(g.get_f32("test.f64"), Some(1.5));
        assert_eq!(g.get_bool("test.bool"), Some(true));
        assert_eq!(g.get("test.i8").and_then(Value::as_i64), Some(-3));
        assert_eq!(g.get("test.arr").unwrap().as_array().unwrap().len(), 2);
        let t0 = g.tensor_info("t0").unwrap();
        assert_eq!((t0.ne0(), t0.n_rows(), t0.ty), (4, 2, GgmlType::F32));
        let d = g.tensor_data(t0);
        assert_eq!(f32::from_le_bytes(d[28..32].try_into().unwrap()), 7.0);
        assert_eq!(g.tensor_data(g.tensor_info("t1").unwrap()).len(), 34);
        assert_eq!(g.tensor_info("t1").unwrap().offset % 32, 0);
    }

    #[test]
    fn every_truncation_is_an_error_not_a_panic() {
        let bytes = sample();
        for cut in 0..bytes.len() - 1 {
            // Cuts inside the final padding still leave every tensor whole.
            let r = open_bytes(&bytes[..cut]);
            if cut < bytes.len() - 30 {
                assert!(r.is_err(), "cut at {cut} was accepted");
            }
        }
    }

    /// A top-level array longer than `LAZY_MIN` is checked at open but parsed only when asked for, to the same
    /// values; it can be copied into another file; a cut through it is still an error at open.
    #[test]
    fn long_arrays_are_parsed_on_demand_to_the_same_values() {
        let n = LAZY_MIN as usize + 5;
        let texts: Vec<Value> = (0..n).map(|i| Value::Str(format!("tok{i}"))).collect();
        let scores: Vec<Value> = (0..n).map(|i| Value::F32(i as f32 * 0.5)).collect();
        let mut w = GgufWriter::new();
        w.meta("general.architecture", Value::Str("llama".into()));
        w.meta("tokenizer.ggml.tokens", Value::Array(texts.clone()));
        w.meta("tokenizer.ggml.scores", Value::Array(scores.clone()));
        w.tensor("t1", vec![32], GgmlType::Q8_0, vec![1u8; 34]);
        let bytes = w.to_bytes();
        let g = open_bytes(&bytes).unwrap();
        let lazy = g.get("tokenizer.ggml.tokens").unwrap();
        assert!(matches!(lazy, Value::Lazy(l) if l.len == n as u64), "{lazy:?}");
        assert_eq!(lazy.summary(), format!("[{n} items]"));
        let parsed = |g: &GgufFile, key: &str| g.owned_value(g.get(key).unwrap()).unwrap();
        assert_eq!(parsed(&g, "tokenizer.ggml.tokens"), Value::Array(texts.clone()));
        assert_eq!(parsed(&g, "tokenizer.ggml.scores"), Value::Array(scores.clone()));
        assert!(g.num_array("no.such.key", Value::as_f32).unwrap().is_none());
        assert!(g.str_array("general.architecture").is_err());
        assert!(g.num_array("general.architecture", Value::as_f32).is_err());
        // The typed readers give the same, lazy or not, and name a wrong element type.
        let strs: Vec<String> = texts.iter().map(|v| v.as_str().unwrap().to_string()).collect();
        let nums: Vec<f32> = scores.iter().map(|v| v.as_f32().unwrap()).collect();
        assert_eq!(g.str_array("tokenizer.ggml.tokens").unwrap().unwrap(), strs);
        assert_eq!(
            g.num_array("tokenizer.ggml.scores", Value::as_f32).unwrap().unwrap(),
            nums
        );
        assert!(g.str_array("no.such.key").unwrap().is_none());
        let e = format!("{:#}", g.str_array("tokenizer.ggml.scores").unwrap_err());
        assert!(e.contains("not of strings"), "{e}");
        let e = format!("{:#}", g.num_array("tokenizer.ggml.tokens", Value::as_f32).unwrap_err());
        assert!(e.contains("tokenizer.ggml.tokens[0] is \"tok0\", not a number"), "{e}");
        let mut w3 = GgufWriter::new();
        w3.meta("short.strs", Value::Array(texts[..3].to_vec()));
        w3.meta("short.nums", Value::Array(vec![Value::U8(1), Value::U8(2)]));
        let g3 = open_bytes(&w3.to_bytes()).unwrap();
        assert_eq!(g3.str_array("short.strs").unwrap().unwrap(), strs[..3]);
        assert_eq!(g3.num_array("short.nums", Value::as_i64).unwrap().unwrap(), [1, 2]);
        let e = format!("{:#}", g3.str_array("short.nums").unwrap_err());
        assert!(e.contains("short.nums[0] is 1, not a string"), "{e}");
        // Copied into a new file through owned_value, it reads back the same.
        let mut w2 = GgufWriter::new();
        for (k, v) in &g.metadata {
            w2.meta(k, g.owned_value(v).unwrap());
        }
        let g2 = open_bytes(&w2.to_bytes()).unwrap();
        assert_eq!(parsed(&g2, "tokenizer.ggml.tokens"), Value::Array(texts.clone()));
        // Cut inside the long array: refused at open, not when the array is read.
        let e = format!("{:#}", open_bytes(&bytes[..bytes.len() / 2]).err().unwrap());
        assert!(e.contains("truncated"), "{e}");
    }

    #[test]
    fn bad_magic_and_version_are_named() {
        let mut b = sample();
        b[0] = b'X';
        let e = format!("{:#}", open_bytes(&b).err().unwrap());
        assert!(e.contains("not a GGUF file"), "{e}");
        let mut b = sample();
        b[4] = 9;
        let e = format!("{:#}", open_bytes(&b).err().unwrap());
        assert!(e.contains("unsupported GGUF version 9"), "{e}");
    }

    #[test]
    fn unsupported_tensor_type_is_named() {
        let mut w = GgufWriter::new();
        w.tensor("t", vec![32], GgmlType::Q8_0, vec![0; 34]);
        let mut b = w.to_bytes();
        // The type id of the only tensor follows its name (8+1 bytes), n_dims (4) and one dim (8).
        let pos = 24 + 8 + 1 + 4 + 8;
        b[pos..pos + 4].copy_from_slice(&99u32.to_le_bytes());
        let e = format!("{:#}", open_bytes(&b).err().unwrap());
        assert!(e.contains("unsupported tensor type 99"), "{e}");
    }

    #[test]
    fn huge_counts_are_refused_before_allocation() {
        let mut b = sample();
        b[16..24].copy_from_slice(&u64::MAX.to_le_bytes()); // kv count
        assert!(open_bytes(&b).is_err());
    }
}
