"""Text files the commands read (calibration, evaluation and training text): one reader, one error for a file that
is not UTF-8, naming the flag and the file."""

from __future__ import annotations

from pathlib import Path

from kiln.cli.paths import check_input_file
from kiln.errors import UsageError


def read_text_file(flag: str, path: str) -> str:
    """The UTF-8 text of the file `flag` names; a UsageError naming both when it is missing, unreadable or not
    UTF-8 (call it before slow work, so a bad file fails fast)."""
    check_input_file(flag, path)
    data = Path(path).read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"{flag} {path}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); give a "
                         "UTF-8 text file (convert it with e.g. `iconv -t UTF-8`)") from None
    return text.replace("\r\n", "\n").replace("\r", "\n")  # newlines as text mode (Path.read_text) reads them
