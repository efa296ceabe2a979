"""Sizes and durations: the usual spellings read right; everything else is one clear error."""

from __future__ import annotations

import argparse
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torchturbo.output.units import MAX_BYTES, MAX_SECONDS, UnitError, parse_duration, parse_size

GiB, MiB = 2**30, 2**20
# No example database: the tests leave no .hypothesis/ folder behind and every run is fresh.
PROPERTY = settings(max_examples=300, deadline=None, database=None)


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("20G", 20 * GiB),  # GNU coreutils: a bare suffix is binary
        ("20GiB", 20 * GiB),
        ("20gib", 20 * GiB),  # case never matters
        ("20 Gi", 20 * GiB),
        ("20GB", 20 * 10**9),  # ...and "B" after the prefix decimal
        ("20gb", 20 * 10**9),
        ("512M", 512 * MiB),
        ("512MB", 512 * 10**6),
        ("1.5T", int(1.5 * 2**40)),
        (".5k", 512),
        ("1024", 1024),
        ("1024B", 1024),
        ("1024b", 1024),  # bytes, never bits
        ("1e9", 10**9),
        ("7E", 7 * 2**60),
    ],
)
def test_sizes(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("inf", "is not a size"),
        ("nan", "is not a size"),
        ("-1G", "at least 1 byte"),
        ("0", "at least 1 byte"),
        ("0.1", "at least 1 byte"),
        ("1e400", "too large: at most 9223372036854775807 bytes"),
        ("1e99999999999GiB", "too large"),  # beyond Decimal's exponent range: no OverflowError
        ("9999999999999999999999T", "too large"),
        ("8EiB", "too large"),
        ("20XB", "is not a size"),
        ("20 G B", "is not a size"),
        ("1.5.5G", "is not a size"),
        ("G", "is not a size"),
        ("", "is not a size"),
        ("1" * 100, "is not a size"),
    ],
)
def test_bad_sizes_say_what_is_wrong(text, message):
    with pytest.raises(UnitError, match=message):
        parse_size(text)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("90", 90),
        ("90s", 90),
        ("90sec", 90),
        ("90 seconds", 90),
        ("1m30s", 90),
        ("1m 30s", 90),
        ("1:30", 90),
        ("5m", 300),
        ("5min", 300),
        ("1h", 3600),
        ("1.5h", 5400),
        ("1h30m", 5400),
        ("2d", 2 * 86400),
        ("0.5", 0.5),
        ("1e3", 1000),
    ],
)
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("inf", "is not a duration"),
        ("Infinity", "is not a duration"),
        ("nan", "is not a duration"),
        ("-5m", "must be positive"),
        ("-0", "must be positive"),
        ("0", "must be positive"),
        ("0s", "must be positive"),
        ("400d", "too long: at most 31536000 s"),
        ("1e999999", "too long"),
        ("99999999999999999999999999h", "too long"),
        ("5 fortnights", "is not a duration"),
        ("fast", "is not a duration"),
        ("10ms", "is not a duration"),
        ("", "is not a duration"),
    ],
)
def test_bad_durations_say_what_is_wrong(text, message):
    with pytest.raises(UnitError, match=message):
        parse_duration(text)


def test_argparse_prints_the_message_not_a_generic_one():
    parser = argparse.ArgumentParser(exit_on_error=False)
    parser.add_argument("--memory-budget", type=parse_size)
    with pytest.raises(argparse.ArgumentError, match=r"'inf' is not a size: use e\.g\. 20GiB"):
        parser.parse_args(["--memory-budget", "inf"])


@PROPERTY
@given(st.text(max_size=80))
def test_any_text_is_a_usable_size_or_a_unit_error(text):
    try:
        size = parse_size(text)
    except UnitError as err:
        assert "\n" not in str(err) and repr(text) in str(err)
    else:
        assert isinstance(size, int) and 1 <= size <= MAX_BYTES


@PROPERTY
@given(st.text(max_size=80))
def test_any_text_is_a_usable_duration_or_a_unit_error(text):
    try:
        seconds = parse_duration(text)
    except UnitError as err:
        assert "\n" not in str(err) and repr(text) in str(err)
    else:
        assert isinstance(seconds, float) and 0 < seconds <= MAX_SECONDS


@PROPERTY
@given(
    st.integers(1, 10**6),
    st.sampled_from(["", "k", "m", "g", "t"]),
    st.sampled_from(["", "i", "ib", "b"]),
    st.booleans(),
)
def test_generated_sizes_read_as_their_number_times_the_unit(number, prefix, suffix, upper):
    if not prefix and suffix in ("i", "ib"):
        suffix = ""  # "ib" alone is no unit
    unit = prefix + suffix
    base = 1000 if suffix == "b" and prefix else 1024
    expected = number * base ** (" kmgt".index(prefix) if prefix else 0)
    text = f"{number}{unit.upper() if upper else unit}"
    if expected > MAX_BYTES:
        with pytest.raises(UnitError, match="too large"):
            parse_size(text)
    else:
        assert parse_size(text) == expected


@PROPERTY
@given(st.integers(0, 99), st.integers(0, 59), st.integers(0, 59))
def test_generated_durations_read_as_their_parts(hours, minutes, seconds):
    text = f"{hours}h{minutes}m{seconds}s"
    total = hours * 3600 + minutes * 60 + seconds
    if total == 0:
        with pytest.raises(UnitError, match="must be positive"):
            parse_duration(text)
    else:
        assert math.isclose(parse_duration(text), total)
