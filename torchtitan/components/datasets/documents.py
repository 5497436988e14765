"""Where a text dataset's documents come from: the embedded corpus, local files (.jsonl, .json, .parquet, .txt: a
file, a folder or a glob) or a Hugging Face hub dataset, streamed with retries. `Source` names what was asked for,
`load_documents` opens it, and `Documents` reads the raw text values in order from any document index (map-style
datasets index a document directly; a stream skips to it). Packing them into samples is `text.py`'s.

A malformed record of a local file (not JSON, not an object, without the text field, or not text) is an error
naming the file and line (records.py). Plain-text (.txt) files hold one document per line, as the Hugging Face
`text` builder reads them. A streamed source survives transient faults (rate limits, server errors, dropped
connections, stalled reads) by resuming at the record after the last one read, up to `StreamRetry.max_attempts`
times in a row; a checkpoint resumes it from the stream's own position where one was recorded (see `Documents`).
"""

import glob
import os
import random
import re
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchtitan.components.datasets.corpus import embedded_corpus
from torchtitan.components.datasets.records import first_malformed_record
from torchtitan.errors import UserError
from torchtitan.tools.logging import logger

DATASETS = ("embedded", "embedded_validation", "c4", "c4_validation")
"""Names accepted for `training.dataset` when no `training.dataset_path` is given."""

_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text"}
# The Hugging Face `text` builder stores each line under this column, whatever the configured field.
_TXT_FIELD = "text"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_GLOB_CHARS = re.compile(r"[*?[]")
# Rows read per access when scanning a map-style dataset: one Arrow slice per document is much slower.
_CHUNK = 256


class Documents:
    """The raw text values of a dataset, readable in order from any document index.

    `read_positioned(start, position)` yields, from document `start` on, each document's value with the stream's
    own position after it (None where documents are indexed directly). A stream starts at `position` instead of
    skipping to `start` when given (the position after document `start - 1`, as an earlier pass yielded it), which
    costs at most the re-reading of one of the stream's files, where skipping to `start` reads every record before
    it. The position travels with its document, so it is known however far a reader runs ahead of the consumer.
    `read_from` yields the values alone."""

    def __init__(self, read_positioned: Callable[[int, dict | None], Iterator[tuple[Any, dict | None]]],
                 size: int | None) -> None:
        self.read_positioned = read_positioned
        self.size = size

    def read_from(self, start: int, position: dict | None = None) -> Iterator[Any]:
        return (value for value, _ in self.read_positioned(start, position))


def _sized_documents(read: Callable[[int, int], Sequence[Any]], size: int) -> Documents:
    def read_positioned(start: int, position: dict | None = None) -> Iterator[tuple[Any, None]]:
        for chunk_start in range(start, size, _CHUNK):
            for value in read(chunk_start, min(chunk_start + _CHUNK, size)):
                yield value, None

    return Documents(read_positioned, size)


@dataclass(frozen=True)
class StreamRetry:
    """How a streamed source survives faults: up to `max_attempts` reads in a row that fail with a transient error,
    waiting `backoff_seconds * 2**(attempt - 1)` (capped at a minute) times a random factor in [1, 2) between them."""

    max_attempts: int = 8
    backoff_seconds: float = 1.0

    def delay(self, attempt: int) -> float:
        return min(self.backoff_seconds * 2 ** (attempt - 1), 60.0) * (1 + random.random())


# Names of exception classes (anywhere in an error's class hierarchy or causes) that a later attempt can get past:
# builtins, httpx's, requests' and urllib3's, http.client's, and aiohttp's (fsspec's HTTP file system), whose
# connection errors (ServerDisconnectedError, ClientOSError, ...) derive from ClientConnectionError and whose
# truncated bodies are ClientPayloadError; its timeouts are TimeoutErrors.
_TRANSIENT_ERRORS = {"ConnectionError", "TimeoutError", "TimeoutException", "TransportError", "NetworkError",
                     "RemoteProtocolError", "ChunkedEncodingError", "ProtocolError", "IncompleteRead",
                     "ClientConnectionError", "ClientPayloadError"}


def is_transient(error: BaseException | None) -> bool:
    """Rate limits (HTTP 429), server errors (5xx) and dropped connections, also when wrapped in another error."""
    seen = 0
    while error is not None and seen < 10:
        status = getattr(getattr(error, "response", None), "status_code", None)
        if isinstance(status, int) and (status == 429 or status >= 500):
            return True
        if any(cls.__name__ in _TRANSIENT_ERRORS for cls in type(error).__mro__):
            return True
        error, seen = error.__cause__ or error.__context__, seen + 1
    return False


def _wait_or_fail(error: Exception, attempt: int, option: str, retry: StreamRetry) -> None:
    """After attempt `attempt` failed with `error`: re-raise it unless transient, stop with one error line after the
    last attempt, else wait before the next one."""
    if not is_transient(error):
        raise error
    if attempt >= retry.max_attempts:
        raise UserError(
            f"{option}: streaming failed {attempt} times in a row (training.stream_max_attempts = "
            f"{retry.max_attempts}), last with {type(error).__name__}: {' '.join(str(error).split())}; check the "
            f"network and the hub's status, or raise training.stream_max_attempts"
        ) from None
    delay = retry.delay(attempt)
    logger.warning(f"{option}: transient error while streaming ({type(error).__name__}: "
                   f"{' '.join(str(error).split())}); attempt {attempt + 1} of {retry.max_attempts} in {delay:.2f} s")
    time.sleep(delay)


def _retrying(call: Callable[[], Any], option: str, retry: StreamRetry) -> Any:
    attempt = 1
    while True:
        try:
            return call()
        except Exception as error:
            _wait_or_fail(error, attempt, option, retry)
            attempt += 1


def _streaming_documents(dataset: Any, field: str, field_option: str, source_option: str,
                         retry: StreamRetry) -> Documents:
    def read_positioned(start: int, position: dict | None = None) -> Iterator[tuple[Any, dict]]:
        # A view of its own for each pass: a loaded position stays the start of the view it was loaded into.
        rows = dataset.skip(0 if position is not None else start)
        # A failed read resumes after the last record read, so that no record is lost or read twice.
        attempt = 1
        while True:
            if position is not None:
                rows.load_state_dict(position)
            try:
                for row in rows:
                    if field not in row:
                        raise UserError(
                            f"{field_option}: the records have no field {field!r}; "
                            f"they have {', '.join(map(repr, row))}"
                        )
                    position = rows.state_dict()
                    attempt = 1
                    yield row[field], position
                return
            except UserError:
                raise
            except Exception as error:
                _wait_or_fail(error, attempt, source_option, retry)
                attempt += 1

    return Documents(read_positioned, None)


class Source:
    """Where the documents come from, and how to name that source in messages."""

    def __init__(self, *, dataset: str, dataset_path: str | None, text_field: str, section: str,
                 path_option: str | None = None, retry: StreamRetry = StreamRetry()):
        self.retry = retry
        self.dataset = dataset
        self.dataset_path = dataset_path
        self.text_field = text_field
        self.section = section
        self.path_option = path_option or f"{section}.dataset_path"

    @property
    def label(self) -> str:
        return self.dataset_path if self.dataset_path is not None else self.dataset

    def option(self) -> str:
        """The option that selected the data, with its value."""
        if self.dataset_path is not None:
            return f"{self.path_option}={self.dataset_path!r}"
        return f"{self.section}.dataset={self.dataset!r}"

    def field_option(self) -> str:
        """The text field option, with its value and the data it applies to."""
        return f"training.dataset_text_field={self.text_field!r} ({self.option()})"


def load_documents(source: Source) -> Documents:
    if source.dataset_path is None:
        if source.dataset == "embedded":
            return _list_documents(embedded_corpus("train"))
        if source.dataset == "embedded_validation":
            return _list_documents(embedded_corpus("validation"))
        if source.dataset in ("c4", "c4_validation"):
            split = "validation" if source.dataset == "c4_validation" else "train"
            return _hub_documents(source, "allenai/c4", "en", split)
        raise UserError(
            f"{source.option()} is not a known dataset; valid names are {', '.join(DATASETS)}, "
            f"or set {source.section}.dataset_path to local files or a Hugging Face hub dataset id"
        )
    path = os.path.expanduser(source.dataset_path)
    if not os.path.exists(path) and not _GLOB_CHARS.search(path):
        if _HUB_ID.match(path) and Path(path).suffix not in _BUILDERS:
            return _hub_documents(source, path, None, "train")
        raise UserError(f"{source.option()} does not exist; give an existing file, folder or glob")
    return _local_documents(source, _data_files(source, path))


def _list_documents(texts: list[str]) -> Documents:
    return _sized_documents(lambda start, stop: texts[start:stop], len(texts))


def _data_files(source: Source, path: str) -> list[str]:
    supported = ", ".join(_BUILDERS)
    if os.path.isdir(path):
        files = sorted(
            str(p) for p in Path(path).rglob("*") if p.is_file() and p.suffix in _BUILDERS
        )
        if not files:
            raise UserError(f"{source.option()} is a folder without {supported} files")
        return files
    if os.path.isfile(path):
        files = [path]
    else:
        files = sorted(p for p in glob.glob(path, recursive=True) if os.path.isfile(p))
        if not files:
            raise UserError(
                f"{source.option()} matches no files; give a glob that matches {supported} files"
            )
    unsupported = [f for f in files if Path(f).suffix not in _BUILDERS]
    if unsupported:
        raise UserError(
            f"{source.option()} includes {unsupported[0]!r}, which has an unsupported extension; "
            f"valid extensions are {supported}"
        )
    return files


def _local_documents(source: Source, files: list[str]) -> Documents:
    # Imported here because `datasets` takes seconds to import and the embedded corpus does not need it.
    import datasets

    builders = sorted({_BUILDERS[Path(f).suffix] for f in files})
    if len(builders) > 1:
        raise UserError(
            f"{source.option()} mixes file types ({', '.join(builders)}); use files of one type"
        )
    builder = builders[0]
    # The builders cannot infer a schema from no rows, and fail with a message about `features`.
    if all(os.path.getsize(f) == 0 for f in files):
        raise UserError(f"{source.option()} has no documents: its files are empty")
    field = _TXT_FIELD if builder == "text" else source.text_field
    # The builders log their own errors ("Failed to load JSON from file ..."): the one error line is ours.
    verbosity = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    try:
        dataset = datasets.load_dataset(builder, data_files=files, split="train")
    except datasets.exceptions.DatasetGenerationError as e:
        _raise_if_malformed(source, builder, files, field)
        raise UserError(f"{source.option()} could not be read as {builder}: {e.__cause__ or e}") from e
    except ValueError as e:
        # Files that are not empty but hold no records (blank lines, a JSON [] or {}) give a split without data.
        if "corresponds to no data" not in str(e):
            # pyarrow's errors are ValueErrors too (a file that is not Parquet at all, for one).
            _raise_if_malformed(source, builder, files, field)
            raise
        raise UserError(f"{source.option()} has no documents: its files hold no records") from e
    finally:
        datasets.logging.set_verbosity(verbosity)
    if dataset.num_rows and not _holds_text(dataset, field):
        _raise_if_malformed(source, builder, files, field)
    if dataset.num_rows and field not in dataset.column_names:
        raise UserError(
            f"{source.field_option()}: the records have no field {field!r}; "
            f"they have {', '.join(map(repr, dataset.column_names))}"
        )
    if dataset.num_rows:
        dataset = dataset.select_columns([field])
    documents = _sized_documents(lambda start, stop: dataset[start:stop][field], dataset.num_rows)
    logger.info(f"dataset {source.label}: {dataset.num_rows} documents from {len(files)} file(s)")
    return documents


def _holds_text(dataset: Any, field: str) -> bool:
    """Whether every record has the text field as a string, judged from the loaded table's schema and null count
    (a record without the field reads as null)."""
    if field not in dataset.column_names:
        return False
    return getattr(dataset.features[field], "dtype", None) in ("string", "large_string") and \
        dataset.data.column(field).null_count == 0


def _raise_if_malformed(source: Source, builder: str, files: list[str], field: str) -> None:
    """Name the file and line of the first malformed record, if there is one (a null text field is not: it is an
    empty document)."""
    if builder == "text":
        return
    problem = first_malformed_record(files, field)
    if problem is not None:
        raise UserError(f"{source.option()}: {problem}")


def _hub_documents(source: Source, repo: str, config: str | None, split: str) -> Documents:
    import datasets

    try:
        # Opening reads the first file's schema: it can meet the same faults as the reads that follow.
        dataset = _retrying(lambda: datasets.load_dataset(repo, config, split=split, streaming=True), source.option(),
                            source.retry)
    except datasets.exceptions.DatasetNotFoundError as e:
        raise UserError(
            f"{source.option()} is neither an existing local path nor a dataset on the Hugging Face hub "
            f"({e})"
        ) from e
    if dataset.column_names is not None and source.text_field not in dataset.column_names:
        raise UserError(
            f"{source.field_option()}: the records have no field {source.text_field!r}; "
            f"they have {', '.join(map(repr, dataset.column_names))}"
        )
    logger.info(f"dataset {source.label}: streaming {repo} split {split} from the Hugging Face hub")
    return _streaming_documents(dataset, source.text_field, source.field_option(), source.option(), source.retry)


def document_text(source: Source, value: Any, index: int) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise UserError(
            f"{source.field_option()}: document {index} holds a "
            f"{type(value).__name__}, not text; name a field that holds strings"
        )
    return value


def document_texts(dataset_path: str, text_field: str, option: str) -> tuple[Iterator[str], int | None]:
    """The non-empty texts at `dataset_path` (anything training.dataset_path takes, named `option` in errors), in
    the order the trainer reads them, and the number of documents when it is known."""
    source = Source(dataset=option, dataset_path=dataset_path, text_field=text_field, section="training",
                     path_option=option)
    documents = load_documents(source)
    texts = (
        text
        for index, value in enumerate(documents.read_from(0))
        if (text := document_text(source, value, index))
    )
    return texts, documents.size
