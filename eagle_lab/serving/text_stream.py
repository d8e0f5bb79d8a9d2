"""Decoded text as tokens arrive, for the CLI's stream and the server's responses alike."""

from __future__ import annotations

import sys


class TextStream:
    """Prints decoded text as tokens arrive, holding back what a stop string may still cut."""

    def __init__(self, tokenizer, stop: list[str], out=sys.stdout):
        self.tokenizer, self.stop, self.out = tokenizer, [s for s in stop if s], out
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = []
        self.printed = 0

    def text(self) -> str:
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        cuts = [text.find(s) for s in self.stop if s in text]
        return text[: min(cuts)] if cuts else text

    def push(self, tokens: list[int]) -> None:
        self.ids.extend(tokens)
        text = self.text()
        upto = len(text) - self.hold
        if text.endswith("\ufffd"):  # an incomplete multi-byte character: wait for the rest
            upto = min(upto, len(text) - 1)
        if upto > self.printed:
            self.out.write(text[self.printed: upto])
            self.out.flush()
            self.printed = upto

    def finish(self) -> str:
        text = self.text()
        self.out.write(text[self.printed:] + "\n")
        self.out.flush()
        return text


class NullOut:
    """A stream target that drops what it is given (output=json prints one object at the end)."""

    def write(self, _text: str) -> None:
        pass

    def flush(self) -> None:
        pass
