"""The one reader of the JSON dlmrt takes in: configs, manifests and the lines of JSONL files.

It is bounded and strict, and every failure is one error of the caller's class that names the file
and says what to do:

- a file is read by `dlmrt.core.file_reads`: a regular file only, of at most limits.MAX_CONFIG_BYTES
  (configs and manifests are kilobytes);
- the bytes must be UTF-8 and the text standard JSON: `NaN` and `Infinity`, which Python's parser
  takes, are refused, as are integers of more digits than Python converts;
- nesting deeper than MAX_DEPTH is refused, and so is a parse that runs out of stack.

What the values mean is checked by each format's owner, on what this returns.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dlmrt.core import file_reads, limits
from dlmrt.core.errors import DlmrtError

MAX_DEPTH = 32


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def parse(text: str, source: str, error: type[DlmrtError], hint: str = "") -> Any:
    """The JSON value of `text` (read from `source`), or `error` naming it."""
    suffix = f": {hint}" if hint else ""
    try:
        value = json.loads(text, parse_constant=_refuse_constant)
    except json.JSONDecodeError as problem:
        raise error(f"{source} is not valid JSON ({problem.msg} at line {problem.lineno} column "
                    f"{problem.colno}){suffix}") from None
    except ValueError as problem:  # a refused constant, or an integer over Python's digit limit
        raise error(f"{source} is not valid JSON ({str(problem).split(';')[0]}){suffix}") from None
    except RecursionError:
        raise error(f"{source} is nested too deeply to be a dlmrt file (at most {MAX_DEPTH} levels){suffix}") from None
    if _depth(value) > MAX_DEPTH:
        raise error(f"{source} is nested too deeply to be a dlmrt file (at most {MAX_DEPTH} levels){suffix}")
    return value


def read(path: Path, error: type[DlmrtError], hint: str = "", *, require_object: bool = True) -> Any:
    """The JSON value of the file at `path` (an object, unless `require_object` is false)."""
    suffix = f": {hint}" if hint else ""
    text = file_reads.read_text(path, error, most=limits.MAX_CONFIG_BYTES, what="JSON", too_large=hint, hint=hint)
    value = parse(text, str(path), error, hint)
    if require_object and not isinstance(value, dict):
        raise error(f"{path} must hold a JSON object, not {_json_kind(value)}{suffix}")
    return value


def _json_kind(value: Any) -> str:
    return {list: "an array", str: "a string", bool: "true or false", type(None): "null"}.get(
        type(value), "a number")


def _depth(value: Any) -> int:
    """How deeply `value` nests (a scalar is 0), without recursion."""
    deepest, pending = 0, [(value, 0)]
    while pending:
        item, depth = pending.pop()
        if isinstance(item, (dict, list)):
            if depth + 1 > MAX_DEPTH:
                return depth + 1
            deepest = max(deepest, depth + 1)
            pending.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest
