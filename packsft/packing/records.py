"""One input line, from its text to a :class:`~packsft.conversation.Conversation`: the parse that the packer's
workers and the Energon trainer share."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from packsft.conversation import Conversation, ConversationError, parse_record
from packsft.jsonl import loads_line
from packsft.packing.energon import check_text_only
from packsft.record_formats import RecordFormatError, source_field


def parse_line(path: str, line: int, text: str | None, decode_error: str | None,
               convert: Callable[[Any], Any] | None = None, record_format: str = "messages",
               text_only: bool = False, **options: Any) -> tuple[Conversation, Any, Any]:
    """``(conv, record, source)`` of one input line: its conversation, its record (converted) and the record as
    read.

    Args:
        text, decode_error: the line as :func:`packsft.jsonl.iter_jsonl_lines` yields it.
        convert: ``packsft.record_formats.record_converter``'s function for ``record_format``, or None.
        text_only: refuse a record with media (an Energon sample: :func:`packsft.packing.energon.check_text_only`).
        options: ``parse_record``'s keywords (``input_key``, ``output_key``, ``default_system_prompt``).

    Raises:
        ConversationError: the line is not a valid record, naming the input's own field (ShareGPT's
            ``conversations[j].value``).
    """
    record = loads_line(text, path, line, decode_error)
    if text_only:
        check_text_only(record, path, line)
    source = record
    if convert is not None:
        try:
            record = convert(record)
        except RecordFormatError as e:
            raise ConversationError(path, line, "", str(e)) from e
    try:
        conv = parse_record(record, path, line, **options)
    except ConversationError as e:
        e.field = source_field(record_format, source, e.field)
        raise
    return conv, record, source
