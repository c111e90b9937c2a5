"""What can be wrong with one sample, as a kind that reports count and skipped.jsonl records.

`SampleError` is a `DataError` (so the CLI prints it without a traceback) that also says which
kind of problem it is; `ds-omni data check` tallies the kinds per source.
"""

from __future__ import annotations

import json

from ds_omni.errors import DataError

MALFORMED = "__ds_omni_malformed__"  # the key of a row standing for a line that did not parse

KINDS = {
    "malformed": "a line of a JSON lines file that does not parse",
    "column": "a schema column the row does not have",
    "media_missing": "an image or audio file that does not exist",
    "media_unreadable": "an image or audio clip that does not decode",
    "markers": "markers in the text that do not match the items",
    "text": "empty text, a malformed turn, or no assistant turn",
    "template": "a conversation the chat template cannot render, or not prefix-stable",
    "conversation_string": "a conversation stored as a JSON string (schema.conversation_strings)",
    "overlong": "more tokens than data.max_seq_len",
    "other": "any other problem",
}


class SampleError(DataError):
    """A bad sample: `kind` is one of KINDS; `encoder` names the encoder of a marker mismatch."""

    def __init__(self, message: str, kind: str, encoder: str | None = None):
        super().__init__(message)
        self.kind, self.encoder = kind, encoder

    def __reduce__(self):  # a data worker sends it back to the loader
        return type(self), (str(self), self.kind, self.encoder), self.__dict__


def kind_of(error: DataError) -> str:
    """The kind of a sample's error (media errors raised below the sample layer are plain)."""
    if isinstance(error, SampleError):
        return error.kind
    text = str(error)
    if "does not exist" in text or "not found" in text:
        return "media_missing"
    if "unreadable" in text or "cannot read" in text:
        return "media_unreadable"
    return "other"


def malformed_line(path: str, at: int, error: ValueError) -> dict:
    """The row standing for the JSON lines line of `path` at byte `at` that did not parse:
    `Source.parts` makes it a bad sample, named by file and 1-based line number."""
    with open(path, "rb") as f:
        number = f.read(at).count(b"\n") + 1
    what = (f"{error.msg} at column {error.colno}" if isinstance(error, json.JSONDecodeError)
            else error)
    return {MALFORMED: f"{path!r} line {number} is not valid JSON ({what}); fix or remove the "
                       "line, or set the source's on_bad_sample to \"skip\" to leave it out"}
