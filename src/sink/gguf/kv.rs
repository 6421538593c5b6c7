//! GGUF metadata: typed values and their encoding.
//!
//! A KV is `key: string, type: u32, value`; strings are `u64 length + UTF-8 bytes` (no NUL);
//! arrays are `element type: u32, count: u64, elements` and may hold strings but not arrays
//! (gguf-py cannot write nested arrays and llama.cpp never reads one). Order is kept as inserted,
//! because gguf-py writes keys in insertion order and we want byte-identical headers.

/// GGUF value type ids (`GGUFValueType`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum ValueType {
    U8 = 0,
    I8 = 1,
    U16 = 2,
    I16 = 3,
    U32 = 4,
    I32 = 5,
    F32 = 6,
    Bool = 7,
    String = 8,
    Array = 9,
    U64 = 10,
    I64 = 11,
    F64 = 12,
}

/// One metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Array),
}

/// A homogeneous array (GGUF arrays carry one element type): the element types of [`Value`]
/// but arrays.
#[derive(Debug, Clone, PartialEq)]
#[rustfmt::skip]
pub enum Array {
    U8(Vec<u8>), I8(Vec<i8>), U16(Vec<u16>), I16(Vec<i16>), U32(Vec<u32>), I32(Vec<i32>),
    U64(Vec<u64>), I64(Vec<i64>), F32(Vec<f32>), F64(Vec<f64>),
    Bool(Vec<bool>), String(Vec<String>),
}

impl Value {
    pub fn value_type(&self) -> ValueType {
        match self {
            Value::U8(_) => ValueType::U8,
            Value::I8(_) => ValueType::I8,
            Value::U16(_) => ValueType::U16,
            Value::I16(_) => ValueType::I16,
            Value::U32(_) => ValueType::U32,
            Value::I32(_) => ValueType::I32,
            Value::U64(_) => ValueType::U64,
            Value::I64(_) => ValueType::I64,
            Value::F32(_) => ValueType::F32,
            Value::F64(_) => ValueType::F64,
            Value::Bool(_) => ValueType::Bool,
            Value::String(_) => ValueType::String,
            Value::Array(_) => ValueType::Array,
        }
    }

    /// Appends the type id and the value.
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&(self.value_type() as u32).to_le_bytes());
        match self {
            Value::U8(v) => out.push(*v),
            Value::I8(v) => out.extend_from_slice(&v.to_le_bytes()),
            Value::U16(v) => out.extend_from_slice(&v.to_le_bytes()),
            Value::I16(v) => out.extend_from_slice(&v.to_le_bytes()),
            Value::U32(v) => out.extend_from_slice(&v.to_le_bytes()),
            Value::I32(v) => out.extend_from_slice(&v.to_le_bytes()),
            Value::U64(v) => out.extend_from_slice(&v.to_le_bytes()),
            Value::I64(v) => out.extend_from_slice(&v.to_le_bytes()),
            Value::F32(v) => out.extend_from_slice(&v.to_le_bytes()),
            Value::F64(v) => out.extend_from_slice(&v.to_le_bytes()),
            Value::Bool(v) => out.push(u8::from(*v)),
            Value::String(s) => encode_str(s, out),
            Value::Array(a) => a.encode(out),
        }
    }
}

impl Array {
    pub fn len(&self) -> usize {
        match self {
            Array::U8(v) => v.len(),
            Array::I8(v) => v.len(),
            Array::U16(v) => v.len(),
            Array::I16(v) => v.len(),
            Array::U32(v) => v.len(),
            Array::I32(v) => v.len(),
            Array::U64(v) => v.len(),
            Array::I64(v) => v.len(),
            Array::F32(v) => v.len(),
            Array::F64(v) => v.len(),
            Array::Bool(v) => v.len(),
            Array::String(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn element_type(&self) -> ValueType {
        match self {
            Array::U8(_) => ValueType::U8,
            Array::I8(_) => ValueType::I8,
            Array::U16(_) => ValueType::U16,
            Array::I16(_) => ValueType::I16,
            Array::U32(_) => ValueType::U32,
            Array::I32(_) => ValueType::I32,
            Array::U64(_) => ValueType::U64,
            Array::I64(_) => ValueType::I64,
            Array::F32(_) => ValueType::F32,
            Array::F64(_) => ValueType::F64,
            Array::Bool(_) => ValueType::Bool,
            Array::String(_) => ValueType::String,
        }
    }

    fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&(self.element_type() as u32).to_le_bytes());
        out.extend_from_slice(&(self.len() as u64).to_le_bytes());
        fn each<T: Copy, const N: usize>(v: &[T], out: &mut Vec<u8>, f: fn(T) -> [u8; N]) {
            for &x in v {
                out.extend_from_slice(&f(x));
            }
        }
        match self {
            Array::U8(v) => out.extend_from_slice(v),
            Array::I8(v) => each(v, out, i8::to_le_bytes),
            Array::U16(v) => each(v, out, u16::to_le_bytes),
            Array::I16(v) => each(v, out, i16::to_le_bytes),
            Array::U32(v) => each(v, out, u32::to_le_bytes),
            Array::I32(v) => each(v, out, i32::to_le_bytes),
            Array::U64(v) => each(v, out, u64::to_le_bytes),
            Array::I64(v) => each(v, out, i64::to_le_bytes),
            Array::F32(v) => each(v, out, f32::to_le_bytes),
            Array::F64(v) => each(v, out, f64::to_le_bytes),
            Array::Bool(v) => out.extend(v.iter().map(|&b| u8::from(b))),
            Array::String(v) => v.iter().for_each(|s| encode_str(s, out)),
        }
    }
}

/// `u64` length then the UTF-8 bytes.
pub fn encode_str(s: &str, out: &mut Vec<u8>) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

/// Ordered metadata. Setting an existing key replaces its value in place (gguf-py warns and
/// overwrites; GGUF forbids duplicate keys, and llama.cpp rejects a file that has one).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Metadata {
    entries: Vec<(String, Value)>,
}

impl Metadata {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn set(&mut self, key: impl Into<String>, value: Value) {
        let key = key.into();
        match self.entries.iter_mut().find(|(k, _)| *k == key) {
            Some(slot) => slot.1 = value,
            None => self.entries.push((key, value)),
        }
    }

    /// Sets `key` right after `after` (at the end when `after` is absent); an existing `key`
    /// is replaced in place, as [`Metadata::set`] does.
    pub fn insert_after(&mut self, after: &str, key: impl Into<String>, value: Value) {
        let key = key.into();
        if self.get(&key).is_some() {
            return self.set(key, value);
        }
        match self.entries.iter().position(|(k, _)| k == after) {
            Some(i) => self.entries.insert(i + 1, (key, value)),
            None => self.entries.push((key, value)),
        }
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.entries.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    pub fn remove(&mut self, key: &str) -> Option<Value> {
        let i = self.entries.iter().position(|(k, _)| k == key)?;
        Some(self.entries.remove(i).1)
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn iter(&self) -> impl Iterator<Item = (&str, &Value)> {
        self.entries.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// Appends every KV in order.
    pub fn encode(&self, out: &mut Vec<u8>) {
        for (k, v) in &self.entries {
            encode_str(k, out);
            v.encode(out);
        }
    }

    /// Encoded size of every KV.
    pub fn encoded_len(&self) -> u64 {
        let mut v = Vec::new();
        self.encode(&mut v);
        v.len() as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn string_and_array_encodings_match_the_spec() {
        let mut m = Metadata::new();
        m.set("a", Value::String("hé".into()));
        m.set(
            "b",
            Value::Array(Array::String(vec!["x".into(), "".into()])),
        );
        m.set("c", Value::Bool(true));
        let mut out = Vec::new();
        m.encode(&mut out);
        let mut want = Vec::new();
        want.extend_from_slice(&1u64.to_le_bytes());
        want.push(b'a');
        want.extend_from_slice(&8u32.to_le_bytes());
        want.extend_from_slice(&3u64.to_le_bytes());
        want.extend_from_slice("hé".as_bytes());
        want.extend_from_slice(&1u64.to_le_bytes());
        want.push(b'b');
        want.extend_from_slice(&9u32.to_le_bytes());
        want.extend_from_slice(&8u32.to_le_bytes());
        want.extend_from_slice(&2u64.to_le_bytes());
        want.extend_from_slice(&1u64.to_le_bytes());
        want.push(b'x');
        want.extend_from_slice(&0u64.to_le_bytes());
        want.extend_from_slice(&1u64.to_le_bytes());
        want.push(b'c');
        want.extend_from_slice(&7u32.to_le_bytes());
        want.push(1);
        assert_eq!(out, want);
        assert_eq!(m.encoded_len(), want.len() as u64);
    }

    #[test]
    fn setting_a_key_twice_replaces_it_in_place() {
        let mut m = Metadata::new();
        m.set("x", Value::U32(1));
        m.set("y", Value::U32(2));
        m.set("x", Value::U32(3));
        let keys: Vec<_> = m.iter().map(|(k, _)| k).collect();
        assert_eq!(keys, ["x", "y"]);
        assert_eq!(m.get("x"), Some(&Value::U32(3)));
    }
}
