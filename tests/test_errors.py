"""fastdata.errors: DecodeError's fields, as raised and as rebuilt from a worker's text."""
from __future__ import annotations

from fastdata.errors import DecodeError


def test_why_is_the_reason_or_the_whole_message():
    """DecodeError.why (what the dali backend records for a file it refuses): the reason given; for an
    error rebuilt from a message with no recoverable reason, the message itself, never None."""
    e = DecodeError("/data/a.jpg", "image file is truncated")
    assert e.why == "image file is truncated" and e.reason == e.why
    text = "Caught DecodeError in DataLoader worker process 0. Original Traceback: something else"
    rebuilt = DecodeError(text)
    assert rebuilt.reason is None and rebuilt.why == text
