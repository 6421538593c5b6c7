//! A restricted unpickler: builds values, tensors and DCP dataclasses, never runs anything.
//!
//! Python's pickle is a stack machine whose `GLOBAL` + `REDUCE` opcodes call any importable
//! function, so loading a stranger's `.bin` with `pickle.load` runs its code. This machine
//! implements the opcodes of protocols 2–5 that torch.save and DCP metadata use, and resolves
//! globals against an allow-list modelled on torch's own `weights_only=True` loader
//! ([`resolve_global`]): tensor rebuild functions, storage classes and dtypes, `OrderedDict`,
//! `torch.Size`, the `torch.distributed.checkpoint` dataclasses. Any other global is refused by
//! name when it is read, before a `REDUCE` could use it. Calls of allowed globals are
//! interpreted by [`super::globals`] (a tensor becomes a [`super::value::TensorView`], a
//! dataclass a [`Value::Object`]).
//!
//! Every length read from the input is checked against the bytes left, the stack, memo and
//! container sizes are capped, and integers are checked before use.

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;

use super::globals::{call, persistent_load};
pub use super::globals::{resolve_global, torch_dtype};
use super::value::{invalid, set_items, tuple, PResult, Seq, Value, MAX_CONTAINER_ENTRIES};

/// The largest pickle read into memory (DCP metadata of a 1T-parameter model is tens of MB).
pub const MAX_PICKLE_BYTES: u64 = 1 << 30;
/// Stack and memo entry limits.
pub const MAX_STACK_ENTRIES: usize = 1 << 20;
pub const MAX_MEMO_ENTRIES: usize = 1 << 24;
/// Largest `LONG1`/`LONG4` integer, in bytes.
const MAX_LONG_BYTES: usize = 16;

/// Runs the machine over `data` and returns the value `STOP` leaves, with the byte count
/// consumed (a legacy torch.save file holds several pickles back to back).
pub fn unpickle(data: &[u8]) -> PResult<(Value, usize)> {
    Machine {
        data,
        pos: 0,
        stack: Vec::new(),
        marks: Vec::new(),
        memo: HashMap::new(),
    }
    .run()
}

struct Machine<'a> {
    data: &'a [u8],
    pos: usize,
    stack: Vec<Value>,
    marks: Vec<usize>,
    memo: HashMap<u32, Value>,
}

impl Machine<'_> {
    fn take(&mut self, n: usize) -> PResult<&[u8]> {
        if n > self.data.len() - self.pos {
            return invalid(format!(
                "truncated: {n} bytes needed at offset {}, {} left",
                self.pos,
                self.data.len() - self.pos
            ));
        }
        let s = &self.data[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn u8(&mut self) -> PResult<u8> {
        Ok(self.take(1)?[0])
    }

    fn le<const N: usize>(&mut self) -> PResult<[u8; N]> {
        Ok(self.take(N)?.try_into().expect("length checked"))
    }

    fn len32(&mut self) -> PResult<usize> {
        Ok(u32::from_le_bytes(self.le()?) as usize)
    }

    fn len64(&mut self) -> PResult<usize> {
        usize::try_from(u64::from_le_bytes(self.le()?))
            .or_else(|_| invalid("length does not fit in memory"))
    }

    fn line(&mut self) -> PResult<&str> {
        let rest = &self.data[self.pos..];
        let Some(n) = rest.iter().position(|&b| b == b'\n') else {
            return invalid("truncated: unterminated text argument");
        };
        let s = std::str::from_utf8(&rest[..n]).or_else(|_| invalid("text argument not UTF-8"))?;
        self.pos += n + 1;
        Ok(s)
    }

    fn push(&mut self, v: Value) -> PResult<()> {
        if self.stack.len() >= MAX_STACK_ENTRIES {
            return invalid(format!("stack deeper than {MAX_STACK_ENTRIES} entries"));
        }
        self.stack.push(v);
        Ok(())
    }

    fn pop(&mut self) -> PResult<Value> {
        if self.stack.len() <= self.marks.last().copied().unwrap_or(0) {
            return invalid(format!("stack underflow at offset {}", self.pos));
        }
        Ok(self.stack.pop().expect("length checked"))
    }

    fn top(&mut self) -> PResult<&mut Value> {
        if self.stack.len() <= self.marks.last().copied().unwrap_or(0) {
            return invalid(format!("stack underflow at offset {}", self.pos));
        }
        Ok(self.stack.last_mut().expect("length checked"))
    }

    fn pop_mark(&mut self) -> PResult<Vec<Value>> {
        let Some(m) = self.marks.pop() else {
            return invalid(format!("no MARK before offset {}", self.pos));
        };
        Ok(self.stack.split_off(m))
    }

    fn memo_put(&mut self, idx: u32) -> PResult<()> {
        if self.memo.len() >= MAX_MEMO_ENTRIES && !self.memo.contains_key(&idx) {
            return invalid(format!("memo larger than {MAX_MEMO_ENTRIES} entries"));
        }
        let v = self.top()?.clone();
        self.memo.insert(idx, v);
        Ok(())
    }

    fn memo_get(&mut self, idx: u32) -> PResult<()> {
        let Some(v) = self.memo.get(&idx).cloned() else {
            return invalid(format!("memo entry {idx} read before it was written"));
        };
        self.push(v)
    }

    fn str_value(bytes: &[u8]) -> PResult<Value> {
        match std::str::from_utf8(bytes) {
            Ok(s) => Ok(Value::Str(s.into())),
            Err(_) => invalid("string is not UTF-8"),
        }
    }

    fn run(mut self) -> PResult<(Value, usize)> {
        loop {
            let at = self.pos;
            let op = self.u8()?;
            match op {
                0x80 => {
                    let proto = self.u8()?;
                    if proto > 5 {
                        return invalid(format!("unsupported pickle protocol {proto}"));
                    }
                }
                0x95 => {
                    self.take(8)?; // FRAME: a length hint, the bytes follow inline
                }
                b'.' => {
                    let v = self.pop()?;
                    return Ok((v, self.pos));
                }
                b'(' => {
                    if self.marks.len() >= MAX_STACK_ENTRIES {
                        return invalid("too many nested MARKs");
                    }
                    self.marks.push(self.stack.len());
                }
                b'0' => {
                    self.pop()?;
                }
                b'1' => {
                    self.pop_mark()?;
                }
                b'2' => {
                    let v = self.top()?.clone();
                    self.push(v)?;
                }
                b'N' => self.push(Value::None)?,
                0x88 => self.push(Value::Bool(true))?,
                0x89 => self.push(Value::Bool(false))?,
                b'J' => {
                    let v = i32::from_le_bytes(self.le()?);
                    self.push(Value::Int(v.into()))?
                }
                b'K' => {
                    let v = self.u8()?;
                    self.push(Value::Int(v.into()))?
                }
                b'M' => {
                    let v = u16::from_le_bytes(self.le()?);
                    self.push(Value::Int(v.into()))?
                }
                0x8a | 0x8b => {
                    let n = if op == 0x8a {
                        self.u8()? as usize
                    } else {
                        self.len32()?
                    };
                    if n > MAX_LONG_BYTES {
                        return invalid(format!("integer of {n} bytes is too large"));
                    }
                    let bytes = self.take(n)?;
                    let mut buf = if bytes.last().is_some_and(|b| b & 0x80 != 0) {
                        [0xffu8; 16]
                    } else {
                        [0u8; 16]
                    };
                    buf[..n].copy_from_slice(bytes);
                    self.push(Value::Int(i128::from_le_bytes(buf)))?
                }
                b'I' | b'L' => {
                    let line = self.line()?.trim_end_matches('L').to_string();
                    let v = match line.as_str() {
                        "00" => Value::Bool(false),
                        "01" => Value::Bool(true),
                        s => Value::Int(s.parse().or_else(|_| invalid("bad text integer"))?),
                    };
                    self.push(v)?
                }
                b'G' => {
                    let v = f64::from_be_bytes(self.le()?);
                    self.push(Value::Float(v))?
                }
                b'X' | 0x8c | 0x8d => {
                    let n = match op {
                        b'X' => self.len32()?,
                        0x8c => self.u8()? as usize,
                        _ => self.len64()?,
                    };
                    let v = Self::str_value(self.take(n)?)?;
                    self.push(v)?
                }
                b'T' | b'U' => {
                    // BINSTRING / SHORT_BINSTRING: py2 str, read as text
                    let n = if op == b'T' {
                        self.len32()?
                    } else {
                        self.u8()? as usize
                    };
                    let v = Self::str_value(self.take(n)?)?;
                    self.push(v)?
                }
                b'B' | b'C' | 0x8e | 0x96 => {
                    let n = match op {
                        b'B' => self.len32()?,
                        b'C' => self.u8()? as usize,
                        _ => self.len64()?,
                    };
                    let v = Value::Bytes(self.take(n)?.into());
                    self.push(v)?
                }
                b')' => self.push(tuple(Vec::new()))?,
                b't' => {
                    let items = self.pop_mark()?;
                    self.push(tuple(items))?
                }
                0x85..=0x87 => {
                    let n = (op - 0x84) as usize;
                    let mut items = Vec::with_capacity(n);
                    for _ in 0..n {
                        items.push(self.pop()?);
                    }
                    items.reverse();
                    self.push(tuple(items))?
                }
                b']' => self.push(Value::List(Rc::default()))?,
                b'l' => {
                    let items = self.pop_mark()?;
                    self.push(Value::List(Rc::new(RefCell::new(Seq(items)))))?
                }
                b'a' | b'e' => {
                    let items = if op == b'a' {
                        vec![self.pop()?]
                    } else {
                        self.pop_mark()?
                    };
                    let Value::List(list) = self.top()? else {
                        return invalid(format!("APPEND to a non-list at offset {at}"));
                    };
                    let mut list = list.borrow_mut();
                    if list.len() + items.len() > MAX_CONTAINER_ENTRIES {
                        return invalid(format!("list longer than {MAX_CONTAINER_ENTRIES}"));
                    }
                    list.extend(items);
                }
                b'}' => self.push(Value::Dict(Rc::default()))?,
                b'd' => {
                    let items = self.pop_mark()?;
                    let dict = Value::Dict(Rc::default());
                    set_items(&dict, items, at)?;
                    self.push(dict)?
                }
                b's' | b'u' => {
                    let items = if op == b's' {
                        let v = self.pop()?;
                        let k = self.pop()?;
                        vec![k, v]
                    } else {
                        self.pop_mark()?
                    };
                    let target = self.top()?.clone();
                    set_items(&target, items, at)?;
                }
                // BINPUT and LONG_BINPUT store into the memo, BINGET and LONG_BINGET read
                // from it; the first of each pair has a 1-byte index, the second 4 bytes.
                b'q' | b'r' | b'h' | b'j' => {
                    let i = if matches!(op, b'q' | b'h') {
                        self.u8()?.into()
                    } else {
                        u32::from_le_bytes(self.le()?)
                    };
                    if matches!(op, b'q' | b'r') {
                        self.memo_put(i)?
                    } else {
                        self.memo_get(i)?
                    }
                }
                0x94 => {
                    let i = u32::try_from(self.memo.len())
                        .or_else(|_| invalid("memo index overflows"))?;
                    self.memo_put(i)?
                }
                b'p' | b'g' => {
                    let i: u32 = self
                        .line()?
                        .parse()
                        .or_else(|_| invalid("bad memo index"))?;
                    if op == b'p' {
                        self.memo_put(i)?
                    } else {
                        self.memo_get(i)?
                    }
                }
                b'c' => {
                    let module = self.line()?.to_string();
                    let name = self.line()?.to_string();
                    let g = resolve_global(&module, &name)?;
                    self.push(Value::Global(g))?
                }
                0x93 => {
                    let name = self.pop()?;
                    let module = self.pop()?;
                    let (Some(module), Some(name)) = (module.as_str(), name.as_str()) else {
                        return invalid("STACK_GLOBAL operands are not strings");
                    };
                    let g = resolve_global(module, name)?;
                    self.push(Value::Global(g))?
                }
                b'R' | 0x81 => {
                    let args = self.pop()?;
                    let callable = self.pop()?;
                    let Value::Global(g) = callable else {
                        return invalid(format!(
                            "call of a {} at offset {at} (only allowed globals can be called)",
                            callable.kind()
                        ));
                    };
                    let Value::Tuple(args) = args else {
                        return invalid(format!("call arguments are not a tuple at offset {at}"));
                    };
                    let v = call(&g, &args)?;
                    self.push(v)?
                }
                b'b' => {
                    let state = self.pop()?;
                    match self.top()? {
                        Value::Object(o) => {
                            o.borrow_mut().state = Some(state);
                        }
                        // `_rebuild_parameter_with_state` and OrderedDict subclasses: the
                        // state (hooks, attributes) does not change the tensor or its items.
                        Value::Tensor(_) | Value::UnsupportedTensor(_) | Value::Dict(_) => {}
                        other => {
                            return invalid(format!("BUILD on a {} at offset {at}", other.kind()))
                        }
                    }
                }
                b'Q' => {
                    let pid = self.pop()?;
                    let v = persistent_load(&pid)?;
                    self.push(v)?
                }
                _ => {
                    return invalid(format!(
                        "unsupported opcode 0x{op:02x} at offset {at} (not used by torch.save)"
                    ))
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::dtype::DType;
    use crate::format::torch::value::PickleError;

    #[test]
    fn forbidden_global_is_named_before_any_call() {
        // c posix\nsystem\n (X 'touch /x' t R .
        let mut p = b"\x80\x02cposix\nsystem\nq\x00X\x08\x00\x00\x00touch /x\x85R.".to_vec();
        assert_eq!(
            unpickle(&p).unwrap_err(),
            PickleError::Forbidden("posix.system".into())
        );
        p = b"\x80\x04\x8c\x08builtins\x8c\x04eval\x93.".to_vec();
        assert_eq!(
            unpickle(&p).unwrap_err(),
            PickleError::Forbidden("builtins.eval".into())
        );
        assert!(resolve_global("torch", "load").is_err());
        assert!(resolve_global("torch", "FooStorage").is_err());
    }

    #[test]
    fn containers_and_memo() {
        // {'a': [1, 2], 'b': <memo of the list>}, protocol 2
        let p = b"\x80\x02}q\x00(X\x01\x00\x00\x00a]q\x01(K\x01K\x02eX\x01\x00\x00\x00bh\x01u.";
        let (v, used) = unpickle(p).unwrap();
        assert_eq!(used, p.len());
        let Value::Dict(d) = v else { panic!() };
        let d = d.borrow();
        assert_eq!(d.len(), 2);
        assert_eq!(d[1].1.as_u64s(), Some(vec![1, 2]));
    }

    #[test]
    fn malformed_inputs_are_errors() {
        for (p, want) in [
            (&b"\x80\x02"[..], "truncated"),
            (b"\x80\x02X\xff\xff\xff\x7f", "truncated"),
            (b"\x80\x02\xff", "unsupported opcode 0xff"),
            (b"\x80\x02h\x05.", "memo entry 5"),
            (b"\x80\x02t.", "no MARK"),
            (b"\x80\x02.", "underflow"),
            (b"\x80\x02K\x01K\x02R.", "call of a int"),
            (b"\x80\x02\x8a\x20", "too large"),
        ] {
            let err = unpickle(p).unwrap_err();
            let PickleError::Invalid(msg) = err else {
                panic!("{err:?}")
            };
            assert!(msg.contains(want), "{msg} lacks {want}");
        }
    }

    #[test]
    fn tensor_subclass_rebuild_gives_the_tensor() {
        let mut p = b"\x80\x02ctorch._tensor\n_rebuild_from_type_v2\n(".to_vec();
        p.extend(b"ctorch._utils\n_rebuild_tensor_v2\nctorch.nn.parameter\nParameter\n(");
        p.extend(b"(X\x07\x00\x00\x00storagectorch\nHalfStorage\nX\x01\x00\x00\x007");
        p.extend(b"X\x03\x00\x00\x00cpuK\x06tQK\x02K\x02K\x03\x86K\x03K\x01\x86\x89}t}tR.");
        let (v, _) = unpickle(&p).unwrap();
        let Value::Tensor(t) = v else {
            panic!("{}", v.kind())
        };
        assert_eq!(t.dtype, DType::F16);
        assert_eq!((t.storage.key.as_str(), t.storage.numel), ("7", 6));
        assert_eq!(
            (t.storage_offset, &t.shape[..], &t.strides[..]),
            (2, &[2, 3][..], &[3, 1][..])
        );
    }

    #[test]
    fn dataclass_state_with_and_without_slots() {
        let class =
            b"\x80\x04\x8c%torch.distributed.checkpoint.metadata\x8c\rMetadataIndex\x93)\x81";
        let fqn = b"}\x8c\x03fqn\x8c\x01as";
        for slots in [false, true] {
            let mut p = class.to_vec();
            if slots {
                p.push(b'N');
                p.extend(fqn);
                p.push(0x86);
            } else {
                p.extend(fqn);
            }
            p.extend(b"b.");
            let (v, _) = unpickle(&p).unwrap();
            assert_eq!(v.class(), Some("MetadataIndex"));
            assert_eq!(v.attr("fqn").unwrap().as_str(), Some("a"), "slots {slots}");
            assert!(v.attr("offset").is_none());
        }
    }

    #[test]
    fn long1_reads_the_legacy_magic_number() {
        let p = b"\x80\x02\x8a\x0al\xfc\x9cF\xf9 j\xa8P\x19.";
        let (v, _) = unpickle(p).unwrap();
        assert!(matches!(v, Value::Int(0x1950a86a20f9469cfc6c)));
    }
}
