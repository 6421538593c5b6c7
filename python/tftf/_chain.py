"""Upstream's ``tftf run`` pipe-chain grammar as pipe objects (``tftf.cli._parse_pipe_chain``):
``--key-filter --include 'a*' --dtype-cast bf16`` → ``KeyFilterPipe(...) | DTypeCastPipe(...)``.

Each section flag opens a section; its options follow (``--name value``, ``--name=value``),
and bare values fill the section's positional slot. The ``tftf`` command itself parses ``run``
in Rust; this is for Python programs that build chains from such token lists.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from tftf import _tensor

_FLOAT_NAMES = ("bf16", "bfloat16", "fp16", "f16", "float16", "half", "fp32", "f32", "float32", "float",
                "fp64", "f64", "float64", "double")


def _usage(message: str) -> Exception:
    try:
        import click
    except ImportError:
        return ValueError(message)
    return click.UsageError(message)


class _Option:
    """One option of a section: how many values it takes, whether it repeats, its check."""

    def __init__(self, nargs: int = 1, multiple: bool = False, choices: Optional[Sequence[str]] = None,
                 convert: Callable[[str], Any] = str, required: bool = False, default: Any = None) -> None:
        self.nargs, self.multiple, self.choices = nargs, multiple, choices
        self.convert, self.required, self.default = convert, required, default


def _dtype_option(required: bool, default: Optional[str] = None) -> _Option:
    return _Option(choices=_FLOAT_NAMES, required=required, default=default)


# flag → (options, the option bare values fill, how the pipe is built)
def _specs() -> Dict[str, Tuple[Dict[str, _Option], Optional[str], Callable[[dict], Any]]]:
    from tftf.pipes.dtype_cast import DTypeCastPipe
    from tftf.pipes.fp8_dequant import FP8DequantPipe
    from tftf.pipes.key_filter import KeyFilterPipe
    from tftf.pipes.key_rename import KeyRenamePipe
    from tftf.pipes.lora_merge import LoRAMergePipe

    return {
        "--dtype-cast": ({"dtype": _dtype_option(True)}, "dtype", lambda o: DTypeCastPipe(o["dtype"])),
        "--dequant-fp8": ({"dtype": _dtype_option(False, "bf16"), "block-size": _Option(convert=int, default=128)},
                          "dtype", lambda o: FP8DequantPipe(o["dtype"], block_size=o["block-size"])),
        "--key-filter": ({"include": _Option(multiple=True, default=[]), "exclude": _Option(multiple=True, default=[])},
                         "include", lambda o: KeyFilterPipe(o["include"], o["exclude"])),
        "--key-rename": ({"rule": _Option(nargs=2, multiple=True, required=True)}, "rule",
                         lambda o: KeyRenamePipe([tuple(r) for r in o["rule"]])),
        "--merge-lora": ({"adapter": _Option(required=True), "scale": _Option(convert=float, default=1.0),
                          "adapter-name": _Option(default="default")}, "adapter",
                         lambda o: LoRAMergePipe(o["adapter"], adapter_name=o["adapter-name"], scale=o["scale"])),
    }


def _parse_section(flag: str, tokens: List[str], spec) -> Any:
    options, positional, build = spec
    values: Dict[str, Any] = {}
    bare: List[str] = []
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if not token.startswith("--"):
            bare.append(token)
            i += 1
            continue
        name, _, inline = token[2:].partition("=")
        option = options.get(name)
        if option is None:
            raise _usage(f"Unknown option {token!r} for {flag}; options: {', '.join('--' + n for n in options)}")
        given = [inline] if inline else []
        i += 1
        while len(given) < option.nargs and i < len(tokens) and not tokens[i].startswith("--"):
            given.append(tokens[i])
            i += 1
        if len(given) < option.nargs:
            raise _usage(f"{flag}: option --{name} requires {option.nargs} value(s)")
        _store(flag, name, option, values, given)
    if bare:
        option = options[positional]
        if option.nargs > 1 and len(bare) % option.nargs:
            raise _usage(f"{flag}: bare values come in groups of {option.nargs}: {bare}")
        groups = [bare[k:k + option.nargs] for k in range(0, len(bare), option.nargs)]
        if not option.multiple and (len(groups) > 1 or positional in values):
            raise _usage(f"{flag}: unexpected extra value(s) {bare}")
        for group in groups:
            _store(flag, positional, option, values, group)
    for name, option in options.items():
        if name not in values:
            if option.required:
                raise _usage(f"{flag} requires --{name}")
            values[name] = option.default
    return build(values)


def _store(flag: str, name: str, option: _Option, values: Dict[str, Any], given: List[str]) -> None:
    if option.choices is not None and given[0].lower() not in option.choices:
        raise _usage(f"{flag}: --{name} {given[0]!r} is not one of {list(option.choices)}")
    try:
        value = [option.convert(v) for v in given] if option.nargs > 1 else option.convert(given[0])
    except ValueError:
        raise _usage(f"{flag}: --{name} takes a number, not {given[0]!r}") from None
    if option.choices is not None:
        value = _tensor.st_name(value)
    if option.multiple:
        values.setdefault(name, []).append(value)
    else:
        values[name] = value


def parse_pipe_chain(tokens: Sequence[str]) -> Any:
    """The pipe the section tokens describe (``PassthroughPipe`` for none). Raises click's
    ``UsageError`` (``ValueError`` without click) naming the section and the token."""
    from tftf.pipes.passthrough import PassthroughPipe

    specs = _specs()
    sections: List[Tuple[str, List[str]]] = []
    for token in tokens:
        flag = token.split("=", 1)[0]
        if flag in specs:
            sections.append((flag, [token.split("=", 1)[1]] if "=" in token else []))
        elif not sections:
            raise _usage(f"Unexpected token {token!r} before any pipe flag; pipes: {', '.join(sorted(specs))}")
        else:
            sections[-1][1].append(token)
    pipes = [_parse_section(flag, toks, specs[flag]) for flag, toks in sections]
    if not pipes:
        return PassthroughPipe()
    chain = pipes[0]
    for p in pipes[1:]:
        chain = chain | p
    return chain
