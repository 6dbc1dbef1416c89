//! A small encoder for the same wire format, for fakes, tests and benchmarks: it
//! writes batches the way msgspec does (positional envelope; events as tagged maps or
//! positional arrays). Production ingestion never encodes.

/// An engine block hash on the wire.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum WireHash<'a> {
    /// A 64-bit int hash (stored widened; must fit `i64` or `u64`).
    Int(i128),
    /// A byte-string hash.
    Bytes(&'a [u8]),
}

/// One event to encode.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum WireEvent<'a> {
    /// `BlockStored`.
    Stored {
        /// Engine hashes of the blocks.
        block_hashes: &'a [WireHash<'a>],
        /// Parent hash.
        parent: Option<WireHash<'a>>,
        /// Tokens of all blocks.
        token_ids: &'a [u32],
        /// Tokens per block.
        block_size: u32,
        /// Medium string, if any.
        medium: Option<&'a str>,
        /// LoRA name, if any.
        lora_name: Option<&'a str>,
    },
    /// `BlockRemoved`.
    Removed {
        /// Engine hashes of the blocks.
        block_hashes: &'a [WireHash<'a>],
        /// Medium string, if any.
        medium: Option<&'a str>,
    },
    /// `AllBlocksCleared`.
    Cleared,
}

/// Which event encoding to write.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum WireForm {
    /// Maps tagged by `"type"` (current vLLM).
    Map,
    /// Positional arrays led by the tag (older vLLM, SGLang).
    Array,
}

/// Encodes `[ts, events, rank?]`.
pub fn encode_batch(ts: f64, events: &[WireEvent<'_>], rank: Option<u32>, form: WireForm) -> Vec<u8> {
    let mut w = Writer(Vec::with_capacity(64));
    w.array(if rank.is_some() { 3 } else { 2 });
    w.f64(ts);
    w.array(events.len());
    for ev in events {
        w.event(ev, form);
    }
    if let Some(r) = rank {
        w.int(i128::from(r));
    }
    w.0
}

/// A msgpack writer.
pub struct Writer(pub Vec<u8>);

impl Writer {
    /// nil.
    pub fn nil(&mut self) {
        self.0.push(0xc0);
    }

    /// An int in the smallest form msgspec uses.
    pub fn int(&mut self, v: i128) {
        let b = &mut self.0;
        match v {
            0..=0x7f => b.push(v as u8),
            -32..=-1 => b.push(v as i8 as u8),
            0x80..=0xff => b.extend_from_slice(&[0xcc, v as u8]),
            0x100..=0xffff => {
                b.push(0xcd);
                b.extend_from_slice(&(v as u16).to_be_bytes());
            }
            0x1_0000..=0xffff_ffff => {
                b.push(0xce);
                b.extend_from_slice(&(v as u32).to_be_bytes());
            }
            0x1_0000_0000.. => {
                b.push(0xcf);
                b.extend_from_slice(&(v as u64).to_be_bytes());
            }
            _ => {
                b.push(0xd3);
                b.extend_from_slice(&(v as i64).to_be_bytes());
            }
        }
    }

    /// A float64.
    pub fn f64(&mut self, v: f64) {
        self.0.push(0xcb);
        self.0.extend_from_slice(&v.to_be_bytes());
    }

    /// A str.
    pub fn str(&mut self, s: &str) {
        self.header(s.len(), 0xa0, 31, [0xd9, 0xda, 0xdb]);
        self.0.extend_from_slice(s.as_bytes());
    }

    /// A bin.
    pub fn bin(&mut self, s: &[u8]) {
        let n = s.len();
        if n <= 0xff {
            self.0.extend_from_slice(&[0xc4, n as u8]);
        } else if n <= 0xffff {
            self.0.push(0xc5);
            self.0.extend_from_slice(&(n as u16).to_be_bytes());
        } else {
            self.0.push(0xc6);
            self.0.extend_from_slice(&(n as u32).to_be_bytes());
        }
        self.0.extend_from_slice(s);
    }

    /// An array header.
    pub fn array(&mut self, n: usize) {
        self.header(n, 0x90, 15, [0, 0xdc, 0xdd]);
    }

    /// A map header.
    pub fn map(&mut self, n: usize) {
        self.header(n, 0x80, 15, [0, 0xde, 0xdf]);
    }

    fn header(&mut self, n: usize, fix: u8, fix_max: usize, wide: [u8; 3]) {
        if n <= fix_max {
            self.0.push(fix | n as u8);
        } else if n <= 0xff && wide[0] != 0 {
            self.0.extend_from_slice(&[wide[0], n as u8]);
        } else if n <= 0xffff {
            self.0.push(wide[1]);
            self.0.extend_from_slice(&(n as u16).to_be_bytes());
        } else {
            self.0.push(wide[2]);
            self.0.extend_from_slice(&(n as u32).to_be_bytes());
        }
    }

    fn hash(&mut self, h: &WireHash<'_>) {
        match h {
            WireHash::Int(v) => self.int(*v),
            WireHash::Bytes(b) => self.bin(b),
        }
    }

    fn hashes(&mut self, hs: &[WireHash<'_>]) {
        self.array(hs.len());
        for h in hs {
            self.hash(h);
        }
    }

    fn opt_str(&mut self, s: Option<&str>) {
        match s {
            Some(s) => self.str(s),
            None => self.nil(),
        }
    }

    fn key(&mut self, form: WireForm, name: &str) {
        if form == WireForm::Map {
            self.str(name);
        }
    }

    fn event(&mut self, ev: &WireEvent<'_>, form: WireForm) {
        let (tag, fields) = match ev {
            WireEvent::Stored { .. } => ("BlockStored", 7),
            WireEvent::Removed { .. } => ("BlockRemoved", 2),
            WireEvent::Cleared => ("AllBlocksCleared", 0),
        };
        match form {
            WireForm::Map => {
                self.map(fields + 1);
                self.str("type");
            }
            WireForm::Array => self.array(fields + 1),
        }
        self.str(tag);
        match ev {
            WireEvent::Stored { block_hashes, parent, token_ids, block_size, medium, lora_name } => {
                self.key(form, "block_hashes");
                self.hashes(block_hashes);
                self.key(form, "parent_block_hash");
                match parent {
                    Some(p) => self.hash(p),
                    None => self.nil(),
                }
                self.key(form, "token_ids");
                self.array(token_ids.len());
                for t in *token_ids {
                    self.int(i128::from(*t));
                }
                self.key(form, "block_size");
                self.int(i128::from(*block_size));
                self.key(form, "lora_id");
                self.nil();
                self.key(form, "medium");
                self.opt_str(*medium);
                self.key(form, "lora_name");
                self.opt_str(*lora_name);
            }
            WireEvent::Removed { block_hashes, medium } => {
                self.key(form, "block_hashes");
                self.hashes(block_hashes);
                self.key(form, "medium");
                self.opt_str(*medium);
            }
            WireEvent::Cleared => {}
        }
    }
}
