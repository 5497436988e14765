"""Find the first malformed record of local .jsonl/.json/.parquet files, to name its file and line in an error.

The Hugging Face builders that read these files report a bad record as, at best, `JSON parse error: Invalid value.
in row 0` (the row of a block, in an unnamed file), and a record without the text field or with a number in it not
at all. This scan runs only once the loaded data looks wrong (a load error, the text field missing, null or not
text), so a good dataset is read once, by the builder.

A record is malformed when it is not valid JSON, not a JSON object, has no text field, or holds something other than
a string (or null, an empty document) there. Lines count from 1, as editors show them; Parquet rows count from 1 too.
"""

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_JSON_TYPES = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number",
               float: "a number"}


def first_malformed_record(files: list[str], field: str) -> str | None:
    """`<file> line N: <what is wrong>` for the first malformed record of `files`, or None if all are fine."""
    for path in files:
        if Path(path).suffix == ".parquet":
            problem = _parquet_problem(path, field)
        else:
            problem = next(_json_problems(path, field), None)
        if problem is not None:
            return f"{path} {problem}"
    return None


def _record_problem(record: Any, field: str) -> str | None:
    if not isinstance(record, dict):
        return f"is {_JSON_TYPES.get(type(record), 'null')}, not a JSON object (a record with a {field!r} field)"
    if field not in record:
        has = ", ".join(map(repr, record)) or "no fields"
        return f"has no field {field!r} (it has {has}); set training.dataset_text_field to the field with the text"
    value = record[field]
    if value is not None and not isinstance(value, str):
        return f"has {_JSON_TYPES.get(type(value), type(value).__name__)} in field {field!r}, not a string"
    return None


def _json_problems(path: str, field: str) -> Iterator[str]:
    """Problems of a JSON-lines file, or of a .json file holding one array of records."""
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    if text.lstrip().startswith("["):
        yield from _json_array_problems(text, field)
        return
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            yield f"line {number} is not valid JSON: {e.msg} (column {e.colno})"
            continue
        problem = _record_problem(record, field)
        if problem is not None:
            yield f"line {number} {problem}"


def _json_array_problems(text: str, field: str) -> Iterator[str]:
    try:
        records = json.loads(text)
    except json.JSONDecodeError as e:
        yield f"line {e.lineno} is not valid JSON: {e.msg} (column {e.colno})"
        return
    # The document is valid: decode it again record by record, only to learn the line each record starts on.
    decoder = json.JSONDecoder()
    position = text.index("[") + 1
    line, counted_to = 1, 0
    for record in records:
        while text[position] in " \t\r\n,":
            position += 1
        line += text.count("\n", counted_to, position)
        counted_to = position
        problem = _record_problem(record, field)
        if problem is not None:
            yield f"line {line} {problem}"
        position = decoder.raw_decode(text, position)[1]


def _parquet_problem(path: str, field: str) -> str | None:
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    try:
        schema = pq.read_schema(path)
    except (pa.ArrowInvalid, OSError) as e:
        return f"is not a Parquet file: {e}"
    if field not in schema.names:
        return (f"has no column {field!r} (it has {', '.join(map(repr, schema.names))}); set "
                f"training.dataset_text_field to the column with the text")
    column_type = schema.field(field).type
    if pa.types.is_string(column_type) or pa.types.is_large_string(column_type) or pa.types.is_null(column_type):
        return None
    column = pq.read_table(path, columns=[field]).column(field)
    valid = pc.is_valid(column).to_pylist()
    row = valid.index(True) + 1 if True in valid else 1
    return f"row {row}: column {field!r} holds {column_type}, not strings"
