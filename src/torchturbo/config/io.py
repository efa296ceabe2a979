"""Reading a config file: a table from TOML, every problem naming the file.

TOML is read by ``tomllib`` (standard library) and written by ``tomli-w``.
"""

from __future__ import annotations

import errno
import stat
import sys
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on Python 3.10
    import tomli as tomllib

from torchturbo.base.paths import loop_words, symlink_loop
from torchturbo.config.validation import ConfigError

#: A config file is a few hundred bytes; a larger one is the wrong file.
MAX_FILE_BYTES = 1 << 20


def read_table(path: str | Path) -> dict[str, Any]:
    """The table a TOML config file holds, not yet validated; every problem names the file."""
    path = Path(path)
    text = _read_config_file(path)
    try:
        return parse_toml(text)
    except ConfigError as err:
        raise ConfigError(*err.problems, where=str(path)) from err


def parse_toml(text: str) -> dict[str, Any]:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"config is not valid TOML: {err}") from err
    except RecursionError:  # tomllib recurses once per level of nested arrays and tables
        raise ConfigError("config nests arrays or tables too deeply to read") from None


def _read_config_file(path: Path) -> str:
    """The text of a config file; an error that names the file says why it cannot be read."""
    try:
        status = path.stat()
        kind = _not_a_file(status.st_mode)
        if kind is None and status.st_size > MAX_FILE_BYTES:
            kind = f"{status.st_size:,} bytes, not a config file (at most {MAX_FILE_BYTES:,})"
        data = b"" if kind else path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"config file {str(path)!r} does not exist") from None
    except OSError as err:
        if err.errno == errno.ELOOP:
            loop = symlink_loop(path) or path
            raise ConfigError(
                f"config file {str(path)!r}: {loop_words(loop, 'the config file')}"
            ) from None
        raise ConfigError(f"cannot read config file {str(path)!r}: {err.strerror}") from None
    if kind:
        raise ConfigError(f"config file {str(path)!r} is {kind}")
    try:
        # utf-8-sig: a byte-order mark (Windows editors write one) is not a TOML statement.
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise ConfigError(
            f"config file {str(path)!r} is not UTF-8 text (byte {data[err.start]:#04x} at offset "
            f"{err.start}): a config is a TOML file such as the turbo.toml that tune writes"
        ) from None
    if not text.strip():
        raise ConfigError(
            f"config file {str(path)!r} is empty, so it sets nothing (a write that failed?): "
            "give it the settings (torchturbo config show prints them all), or leave the "
            "config out to train with the defaults"
        )
    return text


def _not_a_file(mode: int) -> str | None:
    """What a path is when it is not a file that can be read as text (pipes can), else None."""
    kinds = {
        stat.S_ISDIR: "a directory",
        stat.S_ISCHR: "a character device",
        stat.S_ISBLK: "a block device",
        stat.S_ISSOCK: "a socket",
    }
    return next((f"{kind}, not a file" for test, kind in kinds.items() if test(mode)), None)
