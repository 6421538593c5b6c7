//! The pickle allow-list and what calling an allowed global means.
//!
//! Modelled on torch's `weights_only=True` loader: tensor rebuild functions, typed and untyped
//! storage classes, dtypes, `OrderedDict`, `torch.Size`, plus the dataclasses a DCP
//! `.metadata` pickles (`torch.distributed.checkpoint.metadata.*`, `_StorageInfo`) and the
//! helpers their state uses (`torch.serialization._get_layout`, `pathlib.PosixPath`). No call
//! runs Python: a rebuild becomes a [`TensorView`], a dataclass an [`Object`] recording its
//! arguments, and anything else is [`PickleError::Forbidden`] by name.

use std::cell::RefCell;
use std::rc::Rc;

use super::value::{
    invalid, set_items, tuple, Global, Object, PResult, PickleError, Seq, StorageRef, TensorView,
    Value, MAX_TENSOR_RANK,
};
use crate::format::dtype::DType;

/// The allow-list (torch's `weights_only` set, plus what DCP `.metadata` files contain).
pub fn resolve_global(module: &str, name: &str) -> PResult<Global> {
    use Global::*;
    let g = match (module, name) {
        ("torch._utils", "_rebuild_tensor_v2") => RebuildTensorV2,
        ("torch._utils", "_rebuild_tensor_v3") => RebuildTensorV3,
        ("torch._utils", "_rebuild_parameter") => RebuildParameter,
        ("torch._utils", "_rebuild_parameter_with_state") => RebuildParameterWithState,
        ("torch._tensor", "_rebuild_from_type_v2") => RebuildFromTypeV2,
        ("torch.nn.parameter", "Parameter") | ("torch.nn", "Parameter") => Parameter,
        ("torch", "Tensor") => Record("Tensor"),
        ("collections", "OrderedDict") => OrderedDict,
        ("torch", "Size") => TorchSize,
        ("torch.storage", "UntypedStorage") | ("torch", "UntypedStorage") => UntypedStorage,
        ("torch", n) if n.ends_with("Storage") => match (storage_dtype(n), unsupported(n)) {
            (Some(d), _) => TypedStorage(d),
            (None, Some(torch_name)) => Unsupported(torch_name),
            (None, None) => return Err(PickleError::Forbidden(format!("{module}.{name}"))),
        },
        ("torch", n) => match (torch_dtype(n), unsupported(n)) {
            (Some(d), _) => Dtype(d),
            (None, Some(torch_name)) => Unsupported(torch_name),
            (None, None) => return Err(PickleError::Forbidden(format!("{module}.{name}"))),
        },
        ("torch.distributed.checkpoint.metadata", n) => Record(match n {
            "Metadata" => "Metadata",
            "TensorStorageMetadata" => "TensorStorageMetadata",
            "BytesStorageMetadata" => "BytesStorageMetadata",
            "TensorProperties" => "TensorProperties",
            "ChunkStorageMetadata" => "ChunkStorageMetadata",
            "MetadataIndex" => "MetadataIndex",
            "StorageMeta" => "StorageMeta",
            "_MEM_FORMAT_ENCODING" => "_MEM_FORMAT_ENCODING",
            _ => return Err(PickleError::Forbidden(format!("{module}.{name}"))),
        }),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo") => Record("_StorageInfo"),
        ("torch.distributed.checkpoint.planner", "_StorageInfo") => Record("_StorageInfo"),
        ("torch.serialization", "_get_layout") => Record("_get_layout"),
        ("pathlib", "PosixPath") => Record("PosixPath"),
        _ => return Err(PickleError::Forbidden(format!("{module}.{name}"))),
    };
    Ok(g)
}

fn storage_dtype(class: &str) -> Option<DType> {
    Some(match class {
        "FloatStorage" => DType::F32,
        "DoubleStorage" => DType::F64,
        "HalfStorage" => DType::F16,
        "BFloat16Storage" => DType::BF16,
        "LongStorage" => DType::I64,
        "IntStorage" => DType::I32,
        "ShortStorage" => DType::I16,
        "CharStorage" => DType::I8,
        "ByteStorage" => DType::U8,
        "BoolStorage" => DType::BOOL,
        "ComplexFloatStorage" => DType::C64,
        "Float8_e4m3fnStorage" => DType::F8_E4M3,
        "Float8_e5m2Storage" => DType::F8_E5M2,
        _ => return None,
    })
}

/// Torch dtypes (and their storage classes) that safetensors cannot hold, by torch's name:
/// legitimate in a checkpoint, so refused as an unsupported dtype rather than as a global
/// that could run code.
fn unsupported(name: &str) -> Option<&'static str> {
    const DTYPES: [(&str, &str); 20] = [
        ("complex128", "complex128"),
        ("cdouble", "complex128"),
        ("ComplexDoubleStorage", "complex128"),
        ("complex32", "complex32"),
        ("chalf", "complex32"),
        ("quint8", "quint8"),
        ("QUInt8Storage", "quint8"),
        ("qint8", "qint8"),
        ("QInt8Storage", "qint8"),
        ("qint32", "qint32"),
        ("QInt32Storage", "qint32"),
        ("quint4x2", "quint4x2"),
        ("QUInt4x2Storage", "quint4x2"),
        ("quint2x4", "quint2x4"),
        ("QUInt2x4Storage", "quint2x4"),
        ("bits1x8", "bits1x8"),
        ("bits2x4", "bits2x4"),
        ("bits4x2", "bits4x2"),
        ("bits8", "bits8"),
        ("bits16", "bits16"),
    ];
    const SUB_BYTE_INTS: [&str; 14] = [
        "uint1", "uint2", "uint3", "uint4", "uint5", "uint6", "uint7", "int1", "int2", "int3",
        "int4", "int5", "int6", "int7",
    ];
    DTYPES
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, torch_name)| *torch_name)
        .or_else(|| SUB_BYTE_INTS.iter().find(|n| **n == name).copied())
}

/// `torch.<name>` dtypes that safetensors can hold. `float4_e2m1fn_x2` (two E2M1 codes a byte,
/// the even element in the low nibble) is read as `F4`, as the safetensors package writes it.
pub fn torch_dtype(name: &str) -> Option<DType> {
    Some(match name {
        "float32" | "float" => DType::F32,
        "float64" | "double" => DType::F64,
        "float16" | "half" => DType::F16,
        "bfloat16" => DType::BF16,
        "int64" | "long" => DType::I64,
        "int32" | "int" => DType::I32,
        "int16" | "short" => DType::I16,
        "int8" => DType::I8,
        "uint8" => DType::U8,
        "uint16" => DType::U16,
        "uint32" => DType::U32,
        "uint64" => DType::U64,
        "bool" => DType::BOOL,
        "complex64" | "cfloat" => DType::C64,
        "float8_e4m3fn" => DType::F8_E4M3,
        "float8_e5m2" => DType::F8_E5M2,
        "float8_e4m3fnuz" => DType::F8_E4M3FNUZ,
        "float8_e5m2fnuz" => DType::F8_E5M2FNUZ,
        "float8_e8m0fnu" => DType::F8_E8M0,
        "float4_e2m1fn_x2" => DType::F4,
        _ => return None,
    })
}

/// `('storage', storage_type, key, location, numel[, view_metadata])`.
pub(super) fn persistent_load(pid: &Value) -> PResult<Value> {
    let Value::Tuple(t) = pid else {
        return invalid(format!("persistent id is a {}, not a tuple", pid.kind()));
    };
    if !(t.len() == 5 || t.len() == 6) || t[0].as_str() != Some("storage") {
        return invalid("persistent id is not a ('storage', …) tuple");
    }
    let (dtype, unsupported) = match &t[1] {
        Value::Global(Global::TypedStorage(d)) => (Some(*d), None),
        Value::Global(Global::UntypedStorage) => (None, None),
        Value::Global(Global::Unsupported(name)) => (None, Some(*name)),
        other => {
            return invalid(format!(
                "persistent id names a {} instead of a storage class",
                other.kind()
            ))
        }
    };
    let Some(key) = t[2].as_str() else {
        return invalid("storage key is not a string");
    };
    let Some(numel) = t[4].as_u64() else {
        return invalid("storage size is not a non-negative int");
    };
    if t.len() == 6 && !matches!(t[5], Value::None) {
        return invalid("storage views (pre-0.4 torch.save) are not supported");
    }
    Ok(Value::Storage(StorageRef {
        key: key.to_string(),
        dtype,
        unsupported,
        numel,
    }))
}

pub(super) fn call(g: &Global, args: &[Value]) -> PResult<Value> {
    match g {
        Global::RebuildTensorV2 | Global::RebuildTensorV3 => rebuild_tensor(g, args),
        // `torch.nn.Parameter(data, requires_grad)` (REDUCE or NEWOBJ) is a tensor to
        // `torch.load(weights_only=True)` too.
        Global::RebuildParameter | Global::RebuildParameterWithState | Global::Parameter => {
            match args.first() {
                Some(t @ (Value::Tensor(_) | Value::UnsupportedTensor(_))) => Ok(t.clone()),
                _ => invalid("a parameter rebuilt without a tensor"),
            }
        }
        Global::RebuildFromTypeV2 => match args {
            [Value::Global(f), Value::Global(_), Value::Tuple(inner), ..]
                if matches!(f, Global::RebuildTensorV2 | Global::RebuildTensorV3) =>
            {
                rebuild_tensor(f, inner)
            }
            _ => invalid("_rebuild_from_type_v2 without a tensor rebuild function"),
        },
        Global::OrderedDict => {
            let dict = Value::Dict(Rc::default());
            if let Some(pairs) = args.first() {
                let Some(pairs) = pairs.items() else {
                    return invalid("OrderedDict argument is not a list of pairs");
                };
                let mut items = Vec::with_capacity(pairs.len() * 2);
                for p in pairs {
                    match p.items().as_deref() {
                        Some([k, v]) => items.extend([k.clone(), v.clone()]),
                        _ => return invalid("OrderedDict item is not a pair"),
                    }
                }
                set_items(&dict, items, 0)?;
            }
            Ok(dict)
        }
        Global::TorchSize => match args {
            [] => Ok(tuple(Vec::new())),
            [dims] if dims.as_u64s().is_some() => Ok(tuple(dims.items().unwrap_or_default())),
            _ => invalid("torch.Size of something other than non-negative ints"),
        },
        Global::TypedStorage(_)
        | Global::UntypedStorage
        | Global::Dtype(_)
        | Global::Unsupported(_) => {
            invalid("storages and dtypes are never constructed by a torch.save pickle")
        }
        Global::Record(class) => Ok(Value::Object(Rc::new(RefCell::new(Object {
            class,
            args: Seq(args.to_vec()),
            state: None,
        })))),
    }
}

/// `_rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad, hooks[, meta])`;
/// v3 adds the dtype after the hooks.
fn rebuild_tensor(g: &Global, args: &[Value]) -> PResult<Value> {
    if args.len() < 4 {
        return invalid("tensor rebuild with fewer than 4 arguments");
    }
    let Value::Storage(storage) = &args[0] else {
        return invalid(format!(
            "tensor rebuilt from a {} instead of a storage",
            args[0].kind()
        ));
    };
    let Some(storage_offset) = args[1].as_u64() else {
        return invalid("tensor storage offset is not a non-negative int");
    };
    let (Some(shape), Some(strides)) = (args[2].as_u64s(), args[3].as_u64s()) else {
        return invalid(format!(
            "tensor size/stride are not tuples of at most {MAX_TENSOR_RANK} non-negative ints"
        ));
    };
    if shape.len() != strides.len() {
        return invalid("tensor size and stride differ in rank");
    }
    let dtype = if *g == Global::RebuildTensorV3 {
        match args.get(6) {
            Some(Value::Global(Global::Dtype(d))) => *d,
            Some(Value::Global(Global::Unsupported(name))) => {
                return Ok(Value::UnsupportedTensor(name))
            }
            _ => return invalid("_rebuild_tensor_v3 without a dtype"),
        }
    } else {
        match (storage.dtype, storage.unsupported) {
            (Some(d), _) => d,
            (None, Some(name)) => return Ok(Value::UnsupportedTensor(name)),
            (None, None) => return invalid("untyped storage rebuilt without a dtype"),
        }
    };
    let view = TensorView {
        storage: storage.clone(),
        dtype,
        storage_offset,
        shape,
        strides,
    };
    let view = if dtype == DType::F4 {
        unpack_fp4_pairs(view)?
    } else {
        view
    };
    Ok(Value::Tensor(Rc::new(view)))
}

/// A `float4_e2m1fn_x2` view (one element a byte, two codes in it) in `F4` elements, as
/// safetensors counts them: the last dimension and every offset and stride doubled. The pair in
/// a byte stays together, so the last dimension keeps stride 1 (a view with another last
/// stride is refused when it is placed, as sub-byte strided views are).
fn unpack_fp4_pairs(mut view: TensorView) -> PResult<TensorView> {
    let overflow = || PickleError::Invalid("float4_e2m1fn_x2 view offsets overflow".into());
    let Some(last) = view.shape.len().checked_sub(1) else {
        return invalid("a 0-d float4_e2m1fn_x2 tensor (one byte, two codes) has no F4 shape");
    };
    view.shape[last] = view.shape[last].checked_mul(2).ok_or_else(overflow)?;
    view.storage_offset = view.storage_offset.checked_mul(2).ok_or_else(overflow)?;
    for (d, s) in view.strides.iter_mut().enumerate() {
        if d != last || *s != 1 {
            *s = s.checked_mul(2).ok_or_else(overflow)?;
        }
    }
    Ok(view)
}
