"""Text files the commands read (calibration, evaluation and training text): one reader, one error for a file that
is not UTF-8, naming the flag and the file."""

from __future__ import annotations

from kiln.cli.common import check_input_file
from kiln.errors import UsageError


def read_text_file(flag: str, path: str) -> str:
    """The UTF-8 text of the file `flag` names; a UsageError naming both when it is missing, unreadable or not
    UTF-8 (call it before slow work, so a bad file fails fast)."""
    check_input_file(flag, path)
    try:
        with open(path, encoding="utf-8") as f:  # text mode, as Path.read_text: newlines normalised
            return f.read()
    except UnicodeDecodeError:
        with open(path, "rb") as f:  # again as bytes, for the offset in the file (the text reader's is per chunk)
            data = f.read()
        at = _bad_offset(data)
    raise UsageError(f"{flag} {path}: not UTF-8 text (byte 0x{data[at]:02x} at offset {at}); give a UTF-8 text "
                     "file (convert it with e.g. `iconv -t UTF-8`)")


def _bad_offset(data: bytes) -> int:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        return e.start
    return 0
