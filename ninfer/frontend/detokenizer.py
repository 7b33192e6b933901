"""Token ids to text while streaming, and stop strings.

`IncrementalDetokenizer` emits text only once it is final: byte-level tokens that end inside a multi-byte
UTF-8 character (an emoji or a CJK character split over several tokens) are held back until the character
completes, so a client never sees a broken character. `StopMatcher` holds back text that could be the
start of a stop string and reports the cut; the stop string itself is never emitted (as in OpenAI's API).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

_REPLACEMENT = "\ufffd"


class _Decoder(Protocol):
    hidden_ids: frozenset[int]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str: ...


class IncrementalDetokenizer:
    """Decode a growing id sequence into text deltas that never end inside a character.

    It decodes a small window of ids twice, without and with the new ids, and emits the difference once
    it no longer ends in U+FFFD (the decoder's mark for an incomplete byte sequence). Decoding a window
    rather than one token at a time keeps decoders that look at neighbouring tokens (SentencePiece's
    leading-space rule) correct. Ids in `hidden_ids` (control tokens such as <|im_end|>) produce no text.
    """

    def __init__(self, tokenizer: _Decoder, hidden_ids: Iterable[int] | None = None):
        self._tok = tokenizer
        self._hidden = frozenset(tokenizer.hidden_ids if hidden_ids is None else hidden_ids)
        self._ids: list[int] = []
        self._window_start = 0  # first id of the decode window (text before it was emitted)
        self._emitted_end = 0  # ids before this index have had their text emitted

    def push(self, ids: Sequence[int]) -> str:
        """Add generated ids; return the text that became final (possibly empty)."""
        self._ids.extend(i for i in ids if i not in self._hidden)
        if len(self._ids) == self._emitted_end:
            return ""
        return self._emit(final=False)

    def flush(self) -> str:
        """Return whatever is still held (at the end of generation), even an incomplete character."""
        if len(self._ids) == self._emitted_end:
            return ""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        window = self._ids[self._window_start:]
        before = self._tok.decode(window[: self._emitted_end - self._window_start])
        after = self._tok.decode(window)
        if not final and (len(after) <= len(before) or after.endswith(_REPLACEMENT)):
            return ""  # an incomplete character (or a token that decodes to nothing yet): hold back
        delta = after[len(before):] if after.startswith(before) else after
        self._window_start = self._emitted_end
        self._emitted_end = len(self._ids)
        return delta


class StopMatcher:
    """Cut generated text at the first stop string, holding back a possible partial stop string.

    `push` returns the text that is safe to emit; once a stop string is seen, `matched` names it and
    everything from it on is dropped. `flush` releases the held tail when generation ends without a stop.
    """

    def __init__(self, stops: Iterable[str] = ()):
        self.stops = tuple(s for s in stops if s)
        self.matched: str | None = None
        self._held = ""

    def push(self, text: str) -> str:
        if self.matched is not None or not text:
            return ""
        if not self.stops:
            return text
        buffer = self._held + text
        first = None
        for stop in self.stops:
            at = buffer.find(stop)
            if at >= 0 and (first is None or at < first[0]):
                first = (at, stop)
        if first is not None:
            self.matched = first[1]
            self._held = ""
            return buffer[: first[0]]
        keep = self._partial_stop_length(buffer)
        self._held = buffer[len(buffer) - keep:] if keep else ""
        return buffer[: len(buffer) - keep]

    def flush(self) -> str:
        held, self._held = self._held, ""
        return "" if self.matched is not None else held

    def _partial_stop_length(self, buffer: str) -> int:
        """Length of the longest tail of `buffer` that is a proper prefix of some stop string."""
        best = 0
        for stop in self.stops:
            for size in range(min(len(stop) - 1, len(buffer)), best, -1):
                if buffer.endswith(stop[:size]):
                    best = size
                    break
        return best
