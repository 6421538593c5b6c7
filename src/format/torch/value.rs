//! The values the restricted unpickler builds: containers, tensors, DCP dataclasses, and why
//! a pickle is refused. The machine (`pickle`) and the allow-list that interprets calls of
//! allowed globals (`globals`) both build them, so they sit here, below both.

use std::cell::RefCell;
use std::rc::Rc;

use crate::format::dtype::DType;

/// Per-container entry limit (the machine's stack and memo limits are in `pickle`).
pub const MAX_CONTAINER_ENTRIES: usize = 1 << 24;
/// Tensor ranks beyond this are refused (torch allows 64 dimensions).
pub const MAX_TENSOR_RANK: usize = 64;
pub type List = Rc<RefCell<Seq>>;
pub type Dict = Rc<RefCell<Pairs>>;

/// The items of a tuple or list. Dropped iteratively: a pickle can nest containers a million
/// deep in a few megabytes, and the default recursive drop would overflow the stack.
#[derive(Clone, Debug, Default)]
pub struct Seq(pub Vec<Value>);

/// The entries of a dict, in insertion order (dropped like [`Seq`]).
#[derive(Clone, Debug, Default)]
pub struct Pairs(pub Vec<(Value, Value)>);

impl std::ops::Deref for Seq {
    type Target = Vec<Value>;
    fn deref(&self) -> &Vec<Value> {
        &self.0
    }
}
impl std::ops::DerefMut for Seq {
    fn deref_mut(&mut self) -> &mut Vec<Value> {
        &mut self.0
    }
}
impl std::ops::Deref for Pairs {
    type Target = Vec<(Value, Value)>;
    fn deref(&self) -> &Vec<(Value, Value)> {
        &self.0
    }
}
impl std::ops::DerefMut for Pairs {
    fn deref_mut(&mut self) -> &mut Vec<(Value, Value)> {
        &mut self.0
    }
}
impl Drop for Seq {
    fn drop(&mut self) {
        dismantle(std::mem::take(&mut self.0));
    }
}
impl Drop for Pairs {
    fn drop(&mut self) {
        dismantle(unpair(std::mem::take(&mut self.0)));
    }
}

fn unpair(pairs: Vec<(Value, Value)>) -> Vec<Value> {
    pairs.into_iter().flat_map(|(k, v)| [k, v]).collect()
}

/// Drops values without recursion: containers held only here are emptied onto a work list
/// before they are dropped, so every drop is shallow.
fn dismantle(mut work: Vec<Value>) {
    while let Some(v) = work.pop() {
        match v {
            Value::Tuple(t) => {
                if let Ok(mut s) = Rc::try_unwrap(t) {
                    work.append(&mut s.0);
                }
            }
            Value::List(l) => {
                if let Ok(c) = Rc::try_unwrap(l) {
                    work.append(&mut c.into_inner().0);
                }
            }
            Value::Dict(d) => {
                if let Ok(c) = Rc::try_unwrap(d) {
                    let mut p = c.into_inner();
                    work.extend(unpair(std::mem::take(&mut p.0)));
                }
            }
            Value::Object(o) => {
                if let Ok(c) = Rc::try_unwrap(o) {
                    let mut o = c.into_inner();
                    work.append(&mut o.args.0);
                    work.extend(o.state.take());
                }
            }
            _ => {}
        }
    }
}

/// A typed view of a storage, as `_rebuild_tensor_v2/v3` describe it.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorView {
    pub storage: StorageRef,
    pub dtype: DType,
    pub storage_offset: u64,
    pub shape: Vec<u64>,
    pub strides: Vec<u64>,
}

/// A persistent-id storage reference: `('storage', type, key, location, numel)`.
#[derive(Clone, Debug, PartialEq)]
pub struct StorageRef {
    pub key: String,
    /// `None` for an `UntypedStorage` (and an unsupported one).
    pub dtype: Option<DType>,
    /// The torch dtype of a typed storage safetensors cannot hold (`complex128`).
    pub unsupported: Option<&'static str>,
    pub numel: u64,
}

#[derive(Clone, Debug)]
pub struct Object {
    pub class: &'static str,
    pub args: Seq,
    pub state: Option<Value>,
}

#[derive(Clone, Debug)]
pub enum Value {
    None,
    Bool(bool),
    Int(i128),
    Float(f64),
    Str(Rc<str>),
    Bytes(Rc<[u8]>),
    Tuple(Rc<Seq>),
    List(List),
    Dict(Dict),
    Global(Global),
    Storage(StorageRef),
    Tensor(Rc<TensorView>),
    /// A tensor of a torch dtype safetensors cannot hold (`complex128`, quantised types).
    UnsupportedTensor(&'static str),
    Object(Rc<RefCell<Object>>),
}

impl Value {
    /// A short name of the kind, for messages.
    pub fn kind(&self) -> &'static str {
        match self {
            Value::None => "None",
            Value::Bool(_) => "bool",
            Value::Int(_) => "int",
            Value::Float(_) => "float",
            Value::Str(_) => "str",
            Value::Bytes(_) => "bytes",
            Value::Tuple(_) => "tuple",
            Value::List(_) => "list",
            Value::Dict(_) => "dict",
            Value::Global(_) => "class",
            Value::Storage(_) => "storage",
            Value::Tensor(_) | Value::UnsupportedTensor(_) => "tensor",
            Value::Object(_) => "object",
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_u64(&self) -> Option<u64> {
        match self {
            Value::Int(i) => u64::try_from(*i).ok(),
            Value::Bool(b) => Some(*b as u64),
            _ => None,
        }
    }

    /// The items of a tuple or list.
    pub fn items(&self) -> Option<Vec<Value>> {
        match self {
            Value::Tuple(t) => Some(t.to_vec()),
            Value::List(l) => Some(l.borrow().to_vec()),
            _ => None,
        }
    }

    /// A tuple/list of non-negative ints (a `torch.Size`, offsets, strides).
    pub fn as_u64s(&self) -> Option<Vec<u64>> {
        let items = self.items()?;
        if items.len() > MAX_TENSOR_RANK {
            return None;
        }
        items.iter().map(Value::as_u64).collect()
    }

    /// Attribute `name` of a dataclass object (its `BUILD` state dict).
    /// A class with `__slots__` pickles `(dict or None, slots dict)`; both are searched.
    pub fn attr(&self, name: &str) -> Option<Value> {
        let Value::Object(o) = self else { return None };
        let o = o.borrow();
        let find = |v: &Value| match v {
            Value::Dict(d) => d
                .borrow()
                .iter()
                .find(|(k, _)| k.as_str() == Some(name))
                .map(|(_, v)| v.clone()),
            _ => None,
        };
        match o.state.as_ref()? {
            Value::Tuple(t) if t.len() == 2 => find(&t[0]).or_else(|| find(&t[1])),
            state => find(state),
        }
    }

    pub fn class(&self) -> Option<&'static str> {
        match self {
            Value::Object(o) => Some(o.borrow().class),
            _ => None,
        }
    }
}

/// An allowed global.
#[derive(Clone, Debug, PartialEq)]
pub enum Global {
    RebuildTensorV2,
    RebuildTensorV3,
    RebuildParameter,
    RebuildParameterWithState,
    /// `torch._tensor._rebuild_from_type_v2(func, new_type, args, state)`: a tensor subclass.
    RebuildFromTypeV2,
    OrderedDict,
    TorchSize,
    /// `torch.FloatStorage` etc.: the dtype of a typed storage.
    TypedStorage(DType),
    /// `torch.storage.UntypedStorage`: bytes, typed by `_rebuild_tensor_v3`'s dtype argument.
    UntypedStorage,
    Dtype(DType),
    /// A torch dtype or storage class safetensors cannot hold, by its torch dtype name.
    Unsupported(&'static str),
    /// `torch.nn.Parameter`: called with a tensor, it is that tensor.
    Parameter,
    /// A class or function whose call only records its arguments (DCP dataclasses,
    /// `torch.serialization._get_layout`, `pathlib.PosixPath`, …).
    Record(&'static str),
}

/// Why a pickle was refused.
#[derive(Debug, PartialEq)]
pub enum PickleError {
    /// A global outside the allow-list: `module.name`.
    Forbidden(String),
    Invalid(String),
}

pub(super) type PResult<T> = std::result::Result<T, PickleError>;

pub(super) fn invalid<T>(msg: impl Into<String>) -> PResult<T> {
    Err(PickleError::Invalid(msg.into()))
}

pub fn tuple(items: Vec<Value>) -> Value {
    Value::Tuple(Rc::new(Seq(items)))
}

pub(super) fn set_items(target: &Value, items: Vec<Value>, at: usize) -> PResult<()> {
    let Value::Dict(dict) = target else {
        return invalid(format!("SETITEM on a {} at offset {at}", target.kind()));
    };
    if !items.len().is_multiple_of(2) {
        return invalid(format!("odd number of items for SETITEMS at offset {at}"));
    }
    let mut dict = dict.borrow_mut();
    if dict.len() + items.len() / 2 > MAX_CONTAINER_ENTRIES {
        return invalid(format!("dict larger than {MAX_CONTAINER_ENTRIES}"));
    }
    // Python would let a repeated key replace the earlier value; torch never writes one, and
    // the state-dict readers refuse repeated names, so entries are kept as they come.
    let mut it = items.into_iter();
    while let (Some(k), Some(v)) = (it.next(), it.next()) {
        dict.push((k, v));
    }
    Ok(())
}
