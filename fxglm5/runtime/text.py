"""A request's text as its tokens arrive, ended by its stop strings.

The engine gives each request of a tokenizer-backed engine a :class:`RequestText`. Every emitted token is pushed
(``fxglm5.model.tokenizer.TextStream``: bytes of a character still arriving are held back); the first stop string
that appears ends the text just before it and marks the request stopped (the runtime then lets it leave, as a stop
token does). ``take`` hands out the text that is final: while the request runs it holds back a tail that could
still grow into a stop string, so a streamed client never sees part of one (the OpenAI API's and vLLM's rule).
"""

from __future__ import annotations

from fxglm5.model.tokenizer import TextStream


class RequestText:
    def __init__(self, tokenizer, stops: tuple[str, ...] = ()):
        self.stream, self.stops = TextStream(tokenizer), tuple(stops)
        self.longest = max(map(len, self.stops), default=0)
        self.text, self.sent, self.stopped = "", 0, False

    def push(self, token: int) -> None:
        if self.stopped:
            return
        before = len(self.text)
        self.text += self.stream.push(token)
        self._cut(before)

    def _cut(self, before: int) -> None:
        """End the text before the first stop string that the characters from ``before`` on completed."""
        start = max(0, before - self.longest + 1)
        found = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        if found:
            self.text, self.stopped = self.text[:min(found)], True

    def take(self, final: bool) -> str:
        """The text not handed out yet; unless ``final``, without a tail that may be the start of a stop string."""
        if final and not self.stopped:
            before = len(self.text)
            self.text += self.stream.rest()  # bytes that never became a whole character
            self._cut(before)
        end = len(self.text)
        if not final and not self.stopped:
            end -= max((n for s in self.stops for n in range(min(len(s) - 1, end), 0, -1)
                        if self.text.endswith(s[:n])), default=0)
        new, self.sent = self.text[self.sent:end], max(self.sent, end)
        return new
