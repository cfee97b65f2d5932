"""Text of a generation as it streams: incremental detokenization with stop strings, and
the chat output parser that splits DSV4 completions into reasoning, content and DSML
tool calls while they stream (chat.parse_completion is the whole-text form).

Both hold back the tail that could still turn into a marker (a stop string, "</think>",
the tool-call block), so no fragment of a marker ever reaches the client.
"""
from __future__ import annotations

from .. import chat


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest proper prefix of `marker` that `text` ends with (0: none)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class IncrementalText:
    """Token ids -> text deltas, cut at the first stop string (which is never emitted).

    decode: ids -> str (tokenizer.decode). Decodes a short window of ids per token (the
    last emitted ids as context), so a multi-byte character or a word piece that needs the
    next id is held until it is complete (its text ends in U+FFFD until then)."""

    def __init__(self, decode, stop: tuple[str, ...] = ()):
        self.decode, self.stop = decode, tuple(stop)
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = []
        self.prefix_offset = self.read_offset = 0
        self.text = ""      # decoded so far (cut at a stop string once found)
        self.sent = 0       # characters of self.text already emitted
        self.stopped = False

    def push(self, ids) -> tuple[str, bool]:
        """Feed new ids -> (text now safe to emit, whether a stop string ended the text)."""
        if self.stopped:
            return "", True
        self.ids.extend(int(i) for i in ids)
        prefix = self.decode(self.ids[self.prefix_offset:self.read_offset])
        new = self.decode(self.ids[self.prefix_offset:])
        if len(new) > len(prefix) and not new.endswith("\ufffd"):
            self.text += new[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        start = max(0, self.sent - self.hold)   # a stop string may straddle emitted text
        cut = min((i for i in (self.text.find(s, start) for s in self.stop) if i >= 0),
                  default=-1)
        if cut >= 0:
            self.text, self.stopped = self.text[:cut], True
            return self._emit(len(self.text)), True
        return self._emit(max(self.sent, len(self.text) - self.hold)), False

    def finish(self) -> str:
        """The held-back rest, when generation ends for another reason (no more ids)."""
        if not self.stopped and self.read_offset < len(self.ids):   # an incomplete tail
            self.text += self.decode(self.ids[self.prefix_offset:])[
                len(self.decode(self.ids[self.prefix_offset:self.read_offset])):]
            self.read_offset = len(self.ids)
        return self._emit(len(self.text))

    def _emit(self, upto: int) -> str:
        out = self.text[self.sent:upto]
        self.sent = max(self.sent, upto)
        return out


class ChatOutputParser:
    """Streaming form of chat.parse_completion: feed(text) / finish() -> events
    ("reasoning", str), ("content", str), ("tool_calls", [OpenAI tool call dicts]).

    Thinking mode starts in reasoning, up to "</think>". Content is held back while its tail
    could begin a DSML tool-call block (a prefix of the block's opening tag, or the
    newlines that separate it from the content); the block is parsed when it closes. The
    concatenated events equal parse_completion's fields for a well-formed completion. A
    block that never closes or does not parse comes out as content, so no text is lost."""

    def __init__(self, thinking: bool):
        self.mode = "reasoning" if thinking else "content"
        self.buf = ""

    def feed(self, text: str) -> list[tuple[str, object]]:
        self.buf += text
        return self._drain(final=False)

    def finish(self) -> list[tuple[str, object]]:
        return self._drain(final=True)

    def _drain(self, final: bool) -> list[tuple[str, object]]:
        out = []

        def emit(kind, s):
            if s:
                out.append((kind, s))

        while True:
            if self.mode == "reasoning":
                i = self.buf.find(chat.THINK_END)
                if i >= 0:
                    emit("reasoning", self.buf[:i])
                    self.buf, self.mode = self.buf[i + len(chat.THINK_END):], "content"
                    continue
                keep = 0 if final else partial_suffix(self.buf, chat.THINK_END)
            elif self.mode == "content":
                i = self.buf.find(chat.TOOL_CALLS_START)
                if i >= 0:
                    text = self.buf[:i]
                    # the "\n\n" before the block belongs to the tool-call envelope
                    emit("content", text[:-2] if text.endswith("\n\n") else text)
                    self.buf, self.mode = self.buf[i:], "tools"
                    continue
                keep = 0 if final else partial_suffix(self.buf, chat.TOOL_CALLS_START)
                if not final:   # and the newlines before it
                    keep += len(self.buf[:len(self.buf) - keep]) - len(
                        self.buf[:len(self.buf) - keep].rstrip("\n"))
            elif self.mode == "tools":
                end = self.buf.find(chat.TOOL_CALLS_END)
                if end < 0:
                    if final:   # never closed: keep the text
                        emit("content", self.buf)
                        self.buf = ""
                    break
                block = self.buf[:end + len(chat.TOOL_CALLS_END)]
                try:
                    calls = chat._parse_tool_calls(block[len(chat.TOOL_CALLS_START):end])
                    out.append(("tool_calls", calls))
                except ValueError:
                    emit("content", block)
                self.buf, self.mode = self.buf[end + len(chat.TOOL_CALLS_END):], "after"
                continue
            else:   # after a tool-call block: the model should have ended; keep any text
                keep = 0 if final else len(self.buf) - len(self.buf.rstrip())
                text = self.buf[:len(self.buf) - keep]
                emit("content", text if text.strip() else "")
                self.buf = self.buf[len(self.buf) - keep:]
                break
            emit("reasoning" if self.mode == "reasoning" else "content",
                 self.buf[:len(self.buf) - keep])
            self.buf = self.buf[len(self.buf) - keep:]
            break
        return out
