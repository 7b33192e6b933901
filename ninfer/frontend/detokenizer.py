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

    It decodes a small window of ids (the last fully emitted token as context, then the new ones) and
    emits the new text up to any trailing U+FFFD, the decoder's mark for a byte sequence that is not
    complete yet. The context token keeps decoders that look at neighbouring tokens (SentencePiece's
    leading-space rule) correct. Ids in `hidden_ids` (control tokens such as <|im_end|>) produce no text.
    """

    def __init__(self, tokenizer: _Decoder, hidden_ids: Iterable[int] | None = None):
        self._tok = tokenizer
        self._hidden = frozenset(tokenizer.hidden_ids if hidden_ids is None else hidden_ids)
        self._ids: list[int] = []
        self._window_start = 0  # first id of the decode window
        self._emitted_chars = 0  # characters of the window's decoded text already emitted

    def push(self, ids: Sequence[int]) -> str:
        """Add generated ids; return the text that became final (possibly empty)."""
        before = len(self._ids)
        self._ids.extend(i for i in ids if i not in self._hidden)
        return self._emit(final=False) if len(self._ids) > before else ""

    def flush(self) -> str:
        """Return whatever is still held (at the end of generation), even an incomplete character."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        text = self._tok.decode(self._ids[self._window_start:])
        stable = text if final else text.rstrip(_REPLACEMENT)
        delta = stable[self._emitted_chars:]
        self._emitted_chars = max(self._emitted_chars, len(stable))
        if stable == text and len(self._ids) - self._window_start > 1:
            # Everything decoded is final: keep only the last token as context for the next window.
            self._window_start = len(self._ids) - 1
            self._emitted_chars = len(self._tok.decode(self._ids[self._window_start:]))
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
