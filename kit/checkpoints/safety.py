"""Telling a file that would run code from a corrupt one, without ever running it.

``torch.load(weights_only=True)`` refuses both, but only names the culprit for some pickle
formats (protocol 2/3 globals). A protocol-4/5 pickle stops at its first frame opcode, a legacy
tar checkpoint and a TorchScript archive are refused by format. :func:`code_carrying_reason`
reads such a file's pickle opcodes (``pickletools``: parsing, no unpickling) and archive layout
and says why it carries code, or None when it is merely corrupt or unsupported.
"""

from __future__ import annotations

import pickletools
import re
import tarfile
import zipfile
from collections.abc import Iterator
from typing import IO, Any

# what kit's (and torch.save's) own pickles reference; everything else needs code to rebuild
_SAFE_GLOBALS = {
    "collections.OrderedDict",
    "torch._utils._rebuild_tensor_v2",
    "torch._utils._rebuild_parameter",
    "torch.serialization._get_layout",
    "torch.Size",
    "torch.device",
    "torch.Tensor",
    "builtins.set",
    "builtins.frozenset",
    "builtins.bytearray",
    "builtins.complex",
    "_codecs.encode",
}
_SAFE_PATTERN = re.compile(r"torch\.(\w*Storage|float\w*|u?int\d+|bool|bfloat16|complex\d+|q\w*int\w*|bits\w+|strided)")
_STRING_OPS = {"UNICODE", "SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "STRING", "BINSTRING", "SHORT_BINSTRING"}
_PUT_OPS = {"PUT", "BINPUT", "LONG_BINPUT"}
_GET_OPS = {"GET", "BINGET", "LONG_BINGET"}
_MAX_PICKLES = 8  # the legacy format is a few pickles followed by raw storage bytes
_MAX_OPS = 20_000_000


def code_carrying_reason(path: str) -> str | None:
    """Why loading ``path`` would run code (a named global, TorchScript, legacy tar), else None."""
    try:
        if zipfile.is_zipfile(path):
            return _zip_reason(path)
        if tarfile.is_tarfile(path):
            return "it is a legacy tar checkpoint, which torch can only read by unpickling with code execution"
        with open(path, "rb") as f:
            if f.peek(2)[:2] == b"PK":  # a torn zip (torch.save's format), not a pickle stream
                return None
            return _pickles_reason(f)
    except Exception:  # noqa: BLE001 - a file this scan cannot read is judged by the load error
        return None


def _zip_reason(path: str) -> str | None:
    with zipfile.ZipFile(path) as z:
        names = z.namelist()
        if any("/code/" in n or n.endswith("/constants.pkl") for n in names):
            return "it is a TorchScript archive, which carries code (load it with torch.jit.load if you trust it)"
        for name in names:
            if name.endswith(".pkl"):
                with z.open(name) as f:
                    if (reason := _pickles_reason(f)) is not None:
                        return f"{reason} (in {name})"
    return None


def _pickles_reason(f: IO[bytes]) -> str | None:
    for _ in range(_MAX_PICKLES):
        if not f.peek(1)[:1]:  # type: ignore[attr-defined]  # buffered files and zip members peek
            return None
        try:
            for name in _globals_of_one_pickle(f):
                if name not in _SAFE_GLOBALS and not _SAFE_PATTERN.fullmatch(name) and name not in _user_safe():
                    return f"unpickling it needs the global {name!r}, which could run code"
        except ValueError:  # not (or no longer) a pickle: the raw bytes after the legacy format's pickles
            return None
    return None


def _user_safe() -> set[str]:
    """Globals the user allowed with ``torch.serialization.add_safe_globals``."""
    import torch.serialization

    names = set()
    for g in torch.serialization.get_safe_globals():
        obj = g[0] if isinstance(g, tuple) else g
        names.add(f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', '')}")
    return names


def _globals_of_one_pickle(f: IO[bytes]) -> Iterator[str]:
    """The globals one pickle references (``module.name``), read from its opcodes, never executed."""
    memo: dict[Any, Any] = {}
    pushed: list[Any] = []  # recent pushes, enough to resolve STACK_GLOBAL's two strings
    for count, (op, arg, _) in enumerate(pickletools.genops(f)):
        if count > _MAX_OPS:
            raise ValueError("too many opcodes")
        name = op.name
        if name in ("GLOBAL", "INST"):
            yield str(arg).replace(" ", ".", 1)
        elif name == "STACK_GLOBAL":
            module, attr = pushed[-2:] if len(pushed) >= 2 else (None, None)
            yield f"{module}.{attr}" if isinstance(module, str) and isinstance(attr, str) else "<unresolvable>"
        elif name in ("EXT1", "EXT2", "EXT4"):
            yield f"<copyreg extension {arg}>"
        elif name in _STRING_OPS:
            pushed.append(arg)
        elif name == "MEMOIZE":
            memo[len(memo)] = pushed[-1] if pushed else None
        elif name in _PUT_OPS:
            memo[arg] = pushed[-1] if pushed else None
        elif name in _GET_OPS:
            pushed.append(memo.get(arg))
        elif name == "STOP":
            return
        elif op.stack_after:
            pushed.append(None)
        del pushed[:-4]
