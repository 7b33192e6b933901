"""Split generated text into reasoning (`<think>…</think>`) and content, streaming or whole.

Qwen3.5's template ends the generation prompt with `<think>\\n`, so the generation starts inside the
reasoning and only `</think>` appears in the output; with `enable_thinking=false` the prompt already holds
an empty `<think>\\n\\n</think>\\n\\n` and the output is all content. Models whose template does not open
the block may start their output with `<think>` themselves. The split inverts the template's own
rendering of an assistant turn: newlines right inside the tags and right after `</think>` are dropped.
"""

from __future__ import annotations

OPEN_TAG = "<think>"
CLOSE_TAG = "</think>"

Piece = tuple[str, str]  # ("reasoning" | "content", text)


def prompt_opens_reasoning(prompt: str, open_tag: str = OPEN_TAG, close_tag: str = CLOSE_TAG) -> bool:
    """True when the prompt ends inside an unclosed reasoning block, so generation starts in reasoning."""
    opened = prompt.rfind(open_tag)
    return opened >= 0 and opened > prompt.rfind(close_tag)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `tag`."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


class ReasoningParser:
    """Streaming splitter: `push(text)` and `flush()` return ("reasoning" | "content", text) pieces."""

    def __init__(
        self, starts_in_reasoning: bool = False, open_tag: str = OPEN_TAG, close_tag: str = CLOSE_TAG
    ):
        self.open_tag = open_tag
        self.close_tag = close_tag
        self._state = "reasoning" if starts_in_reasoning else "start"
        self._reasoning_begun = False  # any reasoning text emitted yet (leading newlines are dropped)
        self.saw_reasoning = starts_in_reasoning
        self._buffer = ""

    @property
    def in_reasoning(self) -> bool:
        return self._state == "reasoning"

    def push(self, text: str) -> list[Piece]:
        self._buffer += text
        pieces: list[Piece] = []
        while self._buffer:
            before = (self._state, len(self._buffer))
            getattr(self, f"_step_{self._state}")(pieces)
            if (self._state, len(self._buffer)) == before:
                break  # waiting for more text
        return pieces

    def flush(self) -> list[Piece]:
        """End of generation: release held text (an unclosed reasoning block stays reasoning)."""
        pieces: list[Piece] = []
        held, self._buffer = self._buffer, ""
        if self._state == "reasoning":
            self._add_reasoning(pieces, held.rstrip("\n"))
        elif self._state in ("start", "content"):
            if held:
                pieces.append(("content", held))
        return pieces

    # --- states --------------------------------------------------------------------------------------

    def _step_start(self, pieces: list[Piece]) -> None:
        stripped = self._buffer.lstrip()
        if stripped.startswith(self.open_tag):
            self._buffer = stripped[len(self.open_tag):]
            self._state = "reasoning"
            self.saw_reasoning = True
        elif not self.open_tag.startswith(stripped):  # cannot become <think>: plain content
            self._state = "content"

    def _step_reasoning(self, pieces: list[Piece]) -> None:
        at = self._buffer.find(self.close_tag)
        if at >= 0:
            self._add_reasoning(pieces, self._buffer[:at].rstrip("\n"))
            self._buffer = self._buffer[at + len(self.close_tag):]
            self._state = "after_close"
            return
        # Hold a possible partial </think> and trailing newlines (they may sit right before </think>).
        keep = _partial_suffix(self._buffer, self.close_tag)
        body = self._buffer[: len(self._buffer) - keep]
        ready = body.rstrip("\n")
        if ready:
            self._add_reasoning(pieces, ready)
            self._buffer = self._buffer[len(ready):]

    def _step_after_close(self, pieces: list[Piece]) -> None:
        stripped = self._buffer.lstrip("\n")
        self._buffer = stripped
        if stripped:
            self._state = "content"

    def _step_content(self, pieces: list[Piece]) -> None:
        pieces.append(("content", self._buffer))
        self._buffer = ""

    def _add_reasoning(self, pieces: list[Piece], text: str) -> None:
        if not self._reasoning_begun:
            text = text.lstrip("\n")
        if text:
            self._reasoning_begun = True
            pieces.append(("reasoning", text))


def split_reasoning(text: str, starts_in_reasoning: bool = False) -> tuple[str | None, str]:
    """Whole-text split: (reasoning or None when there was no reasoning block, content)."""
    parser = ReasoningParser(starts_in_reasoning)
    pieces = parser.push(text) + parser.flush()
    reasoning = "".join(t for kind, t in pieces if kind == "reasoning")
    content = "".join(t for kind, t in pieces if kind == "content")
    return (reasoning if parser.saw_reasoning else None), content
