"""The ``tftf`` command: the Rust binary's command line, run in this process.

``tftf`` (the console script) and ``python -m tftf`` both call :func:`main`, which hands the
arguments to the Rust core's command line: the same subcommands, options, output, exit codes
(0 success, 1 failure, 2 usage) and signal handling (Ctrl-C or SIGTERM stops the run, removes
its temporary files and exits 130 or 143) as the standalone binary.
"""

from __future__ import annotations

import sys
from typing import List, Optional

from tftf import _core

__all__ = ["main", "run"]


def run(argv: List[str]) -> int:
    """Runs the command line on *argv* (without the program name) in this process and returns
    the exit code. Python keeps its signal handling: Ctrl-C stops the run (its temporary files
    removed) and raises ``KeyboardInterrupt``."""
    sys.stdout.flush()
    sys.stderr.flush()
    return _core.cli_run(["tftf", *argv])


def main(argv: Optional[List[str]] = None) -> int:
    """The console script and ``python -m tftf``: the command line on ``sys.argv[1:]``, with
    the binary's signal handling (SIGINT, SIGTERM and SIGHUP end the run with 128 + the
    signal's number), then exits with its code. With *argv*, as :func:`run`, returning it."""
    if argv is not None:
        return run(list(argv))
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(_core.cli_main(["tftf", *sys.argv[1:]]))


def _make_writer(output_path, *, dry_run: bool = False, max_shard_size: int = 20 * 1024**3):
    """Upstream's writer factory: a :class:`~tftf.NullWriter` for a dry run, else a
    :class:`~tftf.ShardedWriter` into *output_path*."""
    from pathlib import Path

    from tftf.io.null_writer import NullWriter
    from tftf.io.sharded_writer import ShardedWriter

    if dry_run:
        return NullWriter()
    return ShardedWriter(Path(output_path), max_shard_bytes=max_shard_size)


def __getattr__(name: str):
    # `cli`: the command line as a click command (upstream's `tftf.cli.cli`), for programs and
    # tests that drive it with click's CliRunner. Built on first use: click is optional.
    if name == "cli":
        return _click_command()
    raise AttributeError(f"module 'tftf.cli' has no attribute {name!r}")


def _click_command():
    import click

    @click.command(name="tftf", context_settings={"ignore_unknown_options": True, "allow_extra_args": True,
                                                  "help_option_names": []})
    @click.argument("args", nargs=-1, type=click.UNPROCESSED)
    def cli(args):
        """Runs the tftf command line in-process (Python's signal handling kept)."""
        sys.stdout.flush()
        sys.stderr.flush()
        code = _core.cli_run(["tftf", *args])
        if code:
            raise SystemExit(code)

    return cli


def _bad_parameter(message: str, hint: str) -> Exception:
    """click's ``BadParameter`` when click is installed (upstream's exception), else ValueError."""
    try:
        import click
    except ImportError:
        return ValueError(f"{hint}: {message}")
    return click.BadParameter(message, param_hint=hint)


def _latest_checkpoint(path):
    """The ``checkpoint-N`` subdirectory of a training directory with the highest N, or None."""
    import re

    steps = [(int(d.name.split("-")[1]), d) for d in path.iterdir() if d.is_dir() and re.fullmatch(r"checkpoint-\d+", d.name)]
    return max(steps)[1] if steps else None


def _model_dcp_dir(checkpoint):
    """The DCP directory (one with ``.metadata``) in *checkpoint*, a model one before an
    optimizer one; None when there is none."""
    found = sorted(d for d in checkpoint.iterdir() if d.is_dir() and (d / ".metadata").exists())
    models = [d for d in found if "optimizer" not in d.name.lower()]
    return (models or found or [None])[0]


def _resolve_dcp_checkpoint(path):
    """Upstream's helper: a DCP directory as it is; for a training directory (``checkpoint-N``
    subdirectories) the DCP directory inside the latest checkpoint; anything else unchanged."""
    from pathlib import Path

    path = Path(path)
    if (path / ".metadata").exists():
        return path
    latest = _latest_checkpoint(path)
    if latest is None:
        return path
    dcp = _model_dcp_dir(latest)
    if dcp is None:
        raise _bad_parameter(f"No DCP directory (with .metadata) found inside {latest}.", "-c / --checkpoint-dir")
    return dcp


def _resolve_adapter(path):
    """Upstream's helper: ``(path, kind, config_hint)`` of an adapter given as a file, a DCP
    directory or a training directory (its latest checkpoint's DCP directory or
    ``adapter_model.safetensors``; ``config_hint`` is the training directory's
    ``adapter_config.json`` when there is one). *kind* is ``"dcp"`` or ``"lora"``."""
    from pathlib import Path

    path = Path(path)
    if not path.is_dir():
        return path, "lora", None
    if (path / ".metadata").exists():
        return path, "dcp", None
    latest = _latest_checkpoint(path)
    if latest is None:
        return path, "lora", None
    hint = path / "adapter_config.json"
    hint = hint if hint.exists() else None
    dcp = _model_dcp_dir(latest)
    if dcp is not None:
        return dcp, "dcp", hint
    if (latest / "adapter_model.safetensors").exists():
        return latest, "lora", hint
    raise _bad_parameter(f"{path} does not appear to be a training directory with mergeable adapters.", "-a / --adapter")


def _parse_pipe_chain(tokens):
    """Upstream's ``run`` chain parser: section tokens → a pipe (see :mod:`tftf._chain`)."""
    from tftf._chain import parse_pipe_chain

    return parse_pipe_chain(tokens)
