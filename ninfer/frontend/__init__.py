"""Text side of a request: tokenizer, chat template, detokenisation, stop strings, reasoning and tool calls.

See docs/frontend.md for the API the CLI and the HTTP server use.
"""

from ninfer.frontend.chat_template import ChatTemplate, ChatTemplateError
from ninfer.frontend.detokenizer import IncrementalDetokenizer, StopMatcher
from ninfer.frontend.presets import SamplingPresets
from ninfer.frontend.prompt import Prompt, TextFrontend, media_parts
from ninfer.frontend.reasoning import ReasoningParser, prompt_opens_reasoning, split_reasoning
from ninfer.frontend.stream import (
    CompletedText,
    ContentDelta,
    Delta,
    Finish,
    OutputProcessor,
    ReasoningDelta,
    StreamOptions,
    TextStream,
    ToolCallDelta,
    Usage,
)
from ninfer.frontend.tokenizer import Tokenizer, TokenizerError
from ninfer.frontend.tool_calls import ToolCall, ToolCallParser, parse_tool_calls

__all__ = [
    "ChatTemplate", "ChatTemplateError", "CompletedText", "ContentDelta", "Delta", "Finish",
    "IncrementalDetokenizer", "OutputProcessor", "Prompt", "ReasoningDelta", "ReasoningParser",
    "SamplingPresets", "StopMatcher", "StreamOptions", "TextFrontend", "TextStream", "Tokenizer",
    "TokenizerError", "ToolCall", "ToolCallDelta", "ToolCallParser", "Usage", "media_parts",
    "parse_tool_calls", "prompt_opens_reasoning", "split_reasoning",
]
